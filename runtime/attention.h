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
 *   - Blocks of GJ_ATTN_BR queries against blocks of GJ_ATTN_BC keys (the
 *     two equal: a query block starts where a key block does). A score is
 *     the dot product over d in ascending order, one fused multiply-add
 *     per term from 0, times scale. Every sum of products is a chain of
 *     fused multiply-adds in one fixed order (keys ascending, blocks
 *     ascending; queries ascending for the key gradients); a query's sum
 *     of probabilities is a chain of additions over keys ascending;
 *     maxima are order-free; D_i = dO_i . O_i takes 16 lanes and a fixed
 *     tree. No other contraction: the code is compiled without
 *     -ffast-math and with -ffp-contract=off, and the exponential and
 *     logarithm are gj_math.h's. Scores are kept transposed (a row per
 *     key), so per-query statistics are vectors over a block's queries.
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

#include "attention_table.h"
#include "gj_math.h"

#include <stdbool.h>
#include <stdint.h>

/* Every function is inlined into its caller, so the caller's target (an
 * eager kernel's per-CPU clone, or the JIT's host) compiles it, and the
 * JIT's constants reach every loop; the tiles' small loops are unrolled.
 * Not in the sanitizer builds (GJ_NO_UNROLL): instrumented, that code takes
 * the compiler many minutes. Neither changes an operation or its order:
 * the same bits. */
#ifdef GJ_NO_UNROLL
#define GJ_ATTN_INLINE static inline
#define GJ_ATTN_UNROLL
#else
#define GJ_ATTN_INLINE static inline __attribute__((always_inline))
#define GJ_ATTN_UNROLL _Pragma("GCC unroll 8")
#endif

#define GJ_ATTN_BR GJ_ATTN_BLOCK /* queries per block */
#define GJ_ATTN_BC GJ_ATTN_BLOCK /* keys per block */
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

/* ------------------------------------------------ a compiled program's view */

/* The geometry and memory of table gi over buffers bufs, whose element
 * size (q's) is el bytes. */
GJ_ATTN_INLINE void gj_attn_from_table(const int64_t *gi, void *const *bufs, bool fwd, int64_t el,
                                       gj_attn_geom *g, gj_attn_mem *m) {
    g->B = gi[GJ_ATTN_GI_B];
    g->H = gi[GJ_ATTN_GI_H];
    g->T = gi[GJ_ATTN_GI_T];
    g->S = gi[GJ_ATTN_GI_S];
    g->D = gi[GJ_ATTN_GI_D];
    g->E = gi[GJ_ATTN_GI_E];
    int64_t *st[5] = {g->qs, g->ks, g->vs, g->os, g->gos};
    for (int a = 0; a < 5; a++)
        for (int d = 0; d < 3; d++)
            st[a][d] = gi[GJ_ATTN_GI_QS + 3 * a + d];
    g->causal = gi[GJ_ATTN_GI_CAUSAL];
    __builtin_memcpy(&g->scale, &gi[GJ_ATTN_GI_SCALE], sizeof g->scale);
    __builtin_memcpy(&g->p, &gi[GJ_ATTN_GI_P], sizeof g->p);
    const char *in[5];
    for (int a = 0; a < 5; a++)
        in[a] = (const char *)bufs[a] + gi[GJ_ATTN_GI_OFF + a] * el;
    m->q = in[0];
    m->k = in[1];
    m->v = in[2];
    m->seed = m->offset = 0;
    if (fwd) {
        m->o = m->go = m->lse_in = 0;
        m->out = bufs[3];
        m->lse = bufs[4];
        m->gq = m->gk = m->gv = m->ws = 0;
        return;
    }
    m->o = in[3];
    m->go = in[4];
    m->lse_in = bufs[5];
    m->out = m->lse = 0;
    m->gq = bufs[6];
    m->gk = bufs[7];
    m->gv = bufs[8];
    m->ws = bufs[9];
}

/* One call as the eager kernel runs it: geometry, memory and element type
 * (GJ_ATTN_F32, _BF16, _F64). */
enum { GJ_ATTN_F32 = 0, GJ_ATTN_BF16 = 1, GJ_ATTN_F64 = 2 };
typedef struct gj_attn_run {
    gj_attn_geom g;
    gj_attn_mem m;
    int type;
} gj_attn_run;

GJ_ATTN_INLINE int64_t gj_attn_fwd_units(const gj_attn_geom *g) {
    return gj_attn_units_of(true, g->B, g->H, g->T);
}
GJ_ATTN_INLINE int64_t gj_attn_bwd_units(const gj_attn_geom *g) {
    return gj_attn_units_of(false, g->B, g->H, g->T);
}
GJ_ATTN_INLINE int64_t gj_attn_bwd_ws_elems(const gj_attn_geom *g) {
    return gj_attn_ws_of(g->T, g->D, g->E);
}

/* Multiply-adds the unit counts take (the masked blocks skipped), for
 * rates: forward 2 products, backward 5 (QK^T, dO V^T, dV, dQ, dK). */
GJ_ATTN_INLINE double gj_attn_pairs(const gj_attn_geom *g) {
    double pairs = (double)g->T * (double)g->S;
    if (g->causal)
        pairs = (double)g->T * ((double)g->T + 1) / 2;
    return pairs * (double)(g->B * g->H);
}

/* ------------------------------------------------------------ vectors */

/* 512-bit vectors of the accumulator types (16 floats, 8 doubles), as the
 * compilers' generic vector extension: the products keep their blocks of
 * accumulators in these. GJ_ATTN_VFMA is one fused multiply-add per lane
 * on every path: clang's elementwise builtin (the JIT's bitcode), the
 * AVX-512 or FMA instructions where the translation unit targets them (the
 * eager kernel's per-CPU builds), else a loop of fmaf. Same arithmetic,
 * so the same bits. */
typedef float gj_attn_vf __attribute__((vector_size(64)));
typedef double gj_attn_vd __attribute__((vector_size(64)));
typedef float gj_attn_vf_u __attribute__((vector_size(64), aligned(4), may_alias));
typedef double gj_attn_vd_u __attribute__((vector_size(64), aligned(8), may_alias));

#if defined(__clang__)
#define GJ_ATTN_VFMA(a, b, c) __builtin_elementwise_fma(a, b, c)
#else
/* the vector helpers are always inlined: no call passes a vector, so the
 * ABI of 512-bit vectors on CPUs without AVX-512 never matters */
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
GJ_ATTN_INLINE gj_attn_vf gj_attn_fma_vf(gj_attn_vf a, gj_attn_vf b, gj_attn_vf c) {
#if defined(__AVX512F__)
    return (gj_attn_vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    union { gj_attn_vf v; __m256 h[2]; } x = {a}, y = {b}, z = {c};
    z.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
    z.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
    return z.v;
#else
    for (int l = 0; l < 16; l++)
        c[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return c;
#endif
}
GJ_ATTN_INLINE gj_attn_vd gj_attn_fma_vd(gj_attn_vd a, gj_attn_vd b, gj_attn_vd c) {
#if defined(__AVX512F__)
    return (gj_attn_vd)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__FMA__)
    union { gj_attn_vd v; __m256d h[2]; } x = {a}, y = {b}, z = {c};
    z.h[0] = _mm256_fmadd_pd(x.h[0], y.h[0], z.h[0]);
    z.h[1] = _mm256_fmadd_pd(x.h[1], y.h[1], z.h[1]);
    return z.v;
#else
    for (int l = 0; l < 8; l++)
        c[l] = __builtin_fma(a[l], b[l], c[l]);
    return c;
#endif
}
#define GJ_ATTN_VFMA(a, b, c) \
    _Generic((a), gj_attn_vf: gj_attn_fma_vf, gj_attn_vd: gj_attn_fma_vd)(a, b, c)
#endif

/* ---------------------------------------------------- the three versions */

#define GJ_ATTN_T float
#define GJ_ATTN_A float
#define GJ_ATTN_V gj_attn_vf
#define GJ_ATTN_VU gj_attn_vf_u
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
#define GJ_ATTN_V gj_attn_vf
#define GJ_ATTN_VU gj_attn_vf_u
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
#define GJ_ATTN_V gj_attn_vd
#define GJ_ATTN_VU gj_attn_vd_u
#define GJ_ATTN_SFX f64
#define GJ_ATTN_LD(p, i) ((p)[i])
#define GJ_ATTN_ST(x) (x)
#define GJ_ATTN_FMA __builtin_fma
#define GJ_ATTN_EXP gj_m_exp_d
#define GJ_ATTN_LOG gj_m_log_d
#define GJ_ATTN_DROP gj_m_dropout_scale_d
#include "attention_impl.h"

#endif /* GJ_ATTENTION_H */
