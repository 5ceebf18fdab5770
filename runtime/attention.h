/* SPDX-License-Identifier: MIT */
/*
 * attention.h - fused scaled dot-product attention (FlashAttention's
 * algorithm on a CPU), written once and compiled twice: by the library's
 * compiler for the eager kernel (kernels_attention.c) and by clang into the
 * JIT's bitcode (math_bc.c), where a compiled program's attention kernel
 * calls it with its sizes and strides as constants and LLVM specialises it.
 *
 * Dimension legend: B = batch, H = heads, T = queries, S = keys, D = the
 * head size of q and k, E = the head size of v (and of the output).
 *   q [B, H, T, D], k [B, H, S, D], v [B, H, S, E]: any strides over
 *     (b, h, t), the last dimension contiguous;
 *   o [B, H, T, E] and go (its gradient): the same rule; lse [B, H, T]
 *     (the log-sum-exp of each query's scaled scores), gq, gk, gv:
 *     contiguous outputs.
 *
 * Invariants (what makes every thread count and both compilers give the
 * same bits):
 *   - Blocks of GJ_ATTN_BR queries against blocks of GJ_ATTN_BC keys. A
 *     score is the dot product over d in ascending order, one fused
 *     multiply-add per term from 0, times scale. Every sum of products is
 *     a chain of fused multiply-adds in one fixed order (keys ascending,
 *     blocks ascending); row sums of probabilities take 16 lanes and a
 *     fixed tree; maxima are order-free. No other contraction: the code
 *     is compiled without -ffast-math and with -ffp-contract=off, and the
 *     exponential and logarithm are gj_math.h's.
 *   - The forward's unit of work is (b, h, query block); the backward's is
 *     (b, h), its key blocks in order and, for each, the query blocks that
 *     see it in order. No two units write the same output, so any thread
 *     may run any unit.
 *   - Causal (T == S): key j is seen by query i when j <= i; key blocks
 *     wholly above the diagonal are skipped.
 *   - Dropout p > 0 multiplies probability (b, h, i, j) by
 *     gj_m_dropout_scale(seed, offset + ((b H + h) T + i) S + j, p): the
 *     counter gj_dropout would use on the [B, H, T, S] probabilities. The
 *     running sums use the probabilities before dropout.
 *   - bf16 operands are widened into f32 tiles (exact); every output is
 *     rounded once. f32 and bf16 accumulate in float, f64 in double.
 *   - Stack use per call: at most about 3 * GJ_ATTN_BR * GJ_ATTN_DMAX + 4 *
 *     GJ_ATTN_BC * GJ_ATTN_DMAX accumulator elements (the D and E of a call
 *     are at most GJ_ATTN_DMAX; the op checks it).
 */
#ifndef GJ_ATTENTION_H
#define GJ_ATTENTION_H

#include "gj_math.h"

#include <stdbool.h>
#include <stdint.h>

#define GJ_ATTN_BR 64    /* queries per block */
#define GJ_ATTN_BC 64    /* keys per block */
#define GJ_ATTN_DMAX 128 /* largest head size */

/* The geometry of one attention: sizes, strides (elements, over b, h, t),
 * scale, causal, dropout p. Constant for a compiled kernel. */
typedef struct gj_attn_geom {
    int64_t B, H, T, S, D, E;
    int64_t qs[3], ks[3], vs[3], os[3], gos[3];
    double scale, p;
    int64_t causal;
} gj_attn_geom;

/* The memory of one call: inputs (q, k, v; the backward also o, go and
 * lse), outputs (the forward o and lse; the backward gq, gk, gv) and the
 * dropout stream. ws: the backward's workspace, gj_attn_bwd_ws_elems
 * accumulator elements per (b, h) unit. */
typedef struct gj_attn_mem {
    const void *q, *k, *v, *o, *go, *lse_in;
    void *out, *lse, *gq, *gk, *gv, *ws;
    uint64_t seed, offset;
} gj_attn_mem;

static inline int64_t gj_attn_fwd_units(const gj_attn_geom *g) {
    return g->B * g->H * ((g->T + GJ_ATTN_BR - 1) / GJ_ATTN_BR);
}
static inline int64_t gj_attn_bwd_units(const gj_attn_geom *g) { return g->B * g->H; }
/* Backward workspace per unit: dQ of the head and the rows' D_i, in
 * accumulator elements. */
static inline int64_t gj_attn_bwd_ws_elems(const gj_attn_geom *g) { return g->T * (g->D + 1); }

/* Multiply-adds the unit counts take (the masked blocks skipped), for
 * rates: forward 2 products, backward 5 (QK^T, dO V^T, dV, dQ, dK). */
static inline double gj_attn_pairs(const gj_attn_geom *g) {
    double pairs = (double)g->T * (double)g->S;
    if (g->causal)
        pairs = (double)g->T * ((double)g->T + 1) / 2;
    return pairs * (double)(g->B * g->H);
}

/* ---------------------------------------------------- the three versions */

#define GJ_ATTN_T float
#define GJ_ATTN_A float
#define GJ_ATTN_SFX f32
#define GJ_ATTN_LD(p, i) ((p)[i])
#define GJ_ATTN_ST(x) (x)
#define GJ_ATTN_FMA __builtin_fmaf
#define GJ_ATTN_EXP gj_m_exp_f
#define GJ_ATTN_LOG gj_m_log_f
#define GJ_ATTN_DROP gj_m_dropout_scale_f
#include "attention_impl.h"

#define GJ_ATTN_T uint16_t
#define GJ_ATTN_A float
#define GJ_ATTN_SFX bf16
#define GJ_ATTN_LD(p, i) gj_m_bf16_to_f32((p)[i])
#define GJ_ATTN_ST(x) gj_m_f32_to_bf16(x)
#define GJ_ATTN_FMA __builtin_fmaf
#define GJ_ATTN_EXP gj_m_exp_f
#define GJ_ATTN_LOG gj_m_log_f
#define GJ_ATTN_DROP gj_m_dropout_scale_f
#include "attention_impl.h"

#define GJ_ATTN_T double
#define GJ_ATTN_A double
#define GJ_ATTN_SFX f64
#define GJ_ATTN_LD(p, i) ((p)[i])
#define GJ_ATTN_ST(x) (x)
#define GJ_ATTN_FMA __builtin_fma
#define GJ_ATTN_EXP gj_m_exp_d
#define GJ_ATTN_LOG gj_m_log_d
#define GJ_ATTN_DROP gj_m_dropout_scale_d
#include "attention_impl.h"

#endif /* GJ_ATTENTION_H */
