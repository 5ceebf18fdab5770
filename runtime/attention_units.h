/* SPDX-License-Identifier: MIT */
/*
 * attention_units.h - the eager kernel's loops over units of attention.h,
 * for one instruction set: included by kernels_attention.c (the baseline
 * build) and by kernels_attention_x86v3.c / _x86v4.c, which the build
 * compiles for x86-64-v3 (AVX2, FMA) and x86-64-v4 (AVX-512); the kernel
 * picks the widest the CPU runs. GJ_ATTN_ISA names the build. No include
 * guard: one inclusion per translation unit.
 *
 * The head sizes most models use are given to the inlined algorithm as
 * constants (a local copy of the geometry whose D and E are literals), so
 * its products keep their accumulators in registers; other sizes take the
 * general path. The bits are the same on every path and every build.
 */
#include "runtime/attention.h"

#define GJ_ATTN_CAT2_(a, b) a##_##b
#define GJ_ATTN_CAT2(a, b) GJ_ATTN_CAT2_(a, b)
#define GJ_ATTN_ISA_FN(name) GJ_ATTN_CAT2(name, GJ_ATTN_ISA)

#define GJ_ATTN_DT(fn, x, g, b, e)                                                            \
    for (int64_t u = (b); u < (e); u++) {                                                     \
        if ((x)->type == GJ_ATTN_F32)                                                         \
            gj_attn_##fn##_f32(g, &(x)->m, u);                                                \
        else if ((x)->type == GJ_ATTN_BF16)                                                   \
            gj_attn_##fn##_bf16(g, &(x)->m, u);                                               \
        else                                                                                  \
            gj_attn_##fn##_f64(g, &(x)->m, u);                                                \
    }
#define GJ_ATTN_UNITS(fn, x, b, e)                                                            \
    do {                                                                                      \
        gj_attn_geom gg = (x)->g;                                                             \
        if (gg.D == 64 && gg.E == 64) {                                                       \
            gg.D = 64, gg.E = 64;                                                             \
            GJ_ATTN_DT(fn, x, &gg, b, e);                                                     \
        } else if (gg.D == 32 && gg.E == 32) {                                                \
            gg.D = 32, gg.E = 32;                                                             \
            GJ_ATTN_DT(fn, x, &gg, b, e);                                                     \
        } else if (gg.D == 128 && gg.E == 128) {                                              \
            gg.D = 128, gg.E = 128;                                                           \
            GJ_ATTN_DT(fn, x, &gg, b, e);                                                     \
        } else {                                                                              \
            GJ_ATTN_DT(fn, x, &gg, b, e);                                                     \
        }                                                                                     \
    } while (0)

/* Units [b, e) of the forward / backward of run vctx (a gj_attn_run). */
void GJ_ATTN_ISA_FN(gj_rt_attn_fwd_range)(void *vctx, int64_t b, int64_t e);
void GJ_ATTN_ISA_FN(gj_rt_attn_bwd_range)(void *vctx, int64_t b, int64_t e);

void GJ_ATTN_ISA_FN(gj_rt_attn_fwd_range)(void *vctx, int64_t b, int64_t e) {
    const gj_attn_run *x = vctx;
    GJ_ATTN_UNITS(fwd_unit, x, b, e);
}

void GJ_ATTN_ISA_FN(gj_rt_attn_bwd_range)(void *vctx, int64_t b, int64_t e) {
    const gj_attn_run *x = vctx;
    GJ_ATTN_UNITS(bwd_unit, x, b, e);
}

#undef GJ_ATTN_UNITS
#undef GJ_ATTN_DT
#undef GJ_ATTN_ISA_FN
#undef GJ_ATTN_CAT2
#undef GJ_ATTN_CAT2_
