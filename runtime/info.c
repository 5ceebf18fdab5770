/* SPDX-License-Identifier: MIT */
/*
 * info.c - library information and the public thread-count and GEMM
 * provider switches.
 *
 * Invariants: gj_get_info always fills every field with a valid string
 * (BLAS fields read "unavailable" if OpenBLAS cannot be loaded); asking for
 * the info loads OpenBLAS.
 */
#include "runtime/rt.h"

void gj_get_info(gj_info *out) {
    if (!out)
        return;
    out->version = GJ_VERSION_STRING;
    out->blas_core = gj_rt_blas_corename();
    out->blas_config = gj_rt_blas_config();
    out->num_threads = gj_rt_num_threads();
}

void gj_set_num_threads(int n) { gj_rt_set_num_threads(n); }

int gj_get_num_threads(void) { return gj_rt_num_threads(); }

/* (gj_gemm_provider's values are gj_rt_gemm_provider's.) */
_Static_assert(GJ_GEMM_AUTO == (int)GJ_RT_GEMM_AUTO && GJ_GEMM_OPENBLAS == (int)GJ_RT_GEMM_OPENBLAS &&
                   GJ_GEMM_ONEDNN == (int)GJ_RT_GEMM_ONEDNN &&
                   GJ_GEMM_DEFAULT == (int)GJ_RT_GEMM_DEFAULT,
               "gj_gemm_provider and gj_rt_gemm_provider disagree");

int gj_set_gemm_provider(gj_gemm_provider p) { return gj_rt_set_gemm_provider((int)p); }

gj_gemm_provider gj_get_gemm_provider(void) {
    return (gj_gemm_provider)gj_rt_gemm_provider_setting();
}
