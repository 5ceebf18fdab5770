/* SPDX-License-Identifier: MIT */
/*
 * attention_bc.c - the JIT's entries into the fused attention algorithm
 * (runtime/attention.h), compiled by clang-19 to LLVM bitcode (see
 * CMakeLists.txt) and embedded in the library as gj_rt_attn_bc[]; the JIT
 * links it only into modules that have an attention kernel.
 *
 * Invariants:
 *   - gj_bc_attn_{fwd,bwd}_{f32,bf16,f64}(bufs, begin, end, gi) run units
 *     [begin, end) of the attention whose integer table is gi (attention.h,
 *     GJ_ATTN_GI_*) over the instruction's buffers. They are always inlined
 *     into the kernel the JIT makes for an instruction, whose table is a
 *     constant global (a symbolic program's: its run-time table), so the
 *     constants specialise every loop of the algorithm.
 *   - Names and signatures are an ABI of the JIT: add, never rename.
 */
#include "attention.h"

#define GJ_BC_ATTN(dir, sfx, el)                                                               \
    void gj_bc_attn_##dir##_##sfx(void *const *bufs, int64_t begin, int64_t end,              \
                                  const int64_t *gi);                                         \
    __attribute__((always_inline)) void gj_bc_attn_##dir##_##sfx(                             \
        void *const *bufs, int64_t begin, int64_t end, const int64_t *gi) {                   \
        gj_attn_geom g;                                                                       \
        gj_attn_mem m;                                                                        \
        gj_attn_from_table(gi, bufs, #dir[0] == 'f', el, &g, &m);                             \
        for (int64_t u = begin; u < end; u++)                                                 \
            gj_attn_##dir##_unit_##sfx(&g, &m, u);                                            \
    }

GJ_BC_ATTN(fwd, f32, 4)
GJ_BC_ATTN(fwd, bf16, 2)
GJ_BC_ATTN(fwd, f64, 8)
GJ_BC_ATTN(bwd, f32, 4)
GJ_BC_ATTN(bwd, bf16, 2)
GJ_BC_ATTN(bwd, f64, 8)
