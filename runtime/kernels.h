/* SPDX-License-Identifier: MIT */
/*
 * kernels.h - internal header of the eager kernels (runtime/kernels_*.c):
 * the compile settings that make their loops vectorize, the cross-file
 * kernel entry points called by gj_rt_exec (kernels_exec.c), and small
 * dtype helpers. Not part of the public or runtime API.
 *
 * Invariants:
 *   - Include this header FIRST in every kernels_*.c: it switches GCC to O3
 *     with -fno-trapping-math for the whole file (loops over the
 *     select-based gj_math.h functions are only if-converted and
 *     vectorized without trapping math; results are unchanged, nothing here
 *     reads the floating-point exception flags). Everything that is inlined
 *     into those loops (gj_math.h) is then compiled with the same options.
 *   - The hot contiguous loops carry GJ_K_CLONES: one clone per x86-64
 *     level (AVX-512, AVX2, baseline), chosen once at load time.
 *   - Entry points (gj_rt_k_*) receive inputs already validated by
 *     gj_rt_infer and outputs already allocated by gj_rt_exec with the
 *     inferred metas (contiguous; zero-filled only where stated). They
 *     return 0, or -1 with the error set (data-dependent failures such as an
 *     index out of range, or out of memory for scratch space); gj_rt_exec
 *     then releases the outputs.
 *   - Work is split with gj_rt_parallel_for over OUTPUT elements/rows only,
 *     never over a reduction, so every result is independent of the thread
 *     count.
 */
#ifndef GJ_RT_KERNELS_H
#define GJ_RT_KERNELS_H

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3", "no-trapping-math")
#endif

#include "runtime/gj_math.h"
#include "runtime/rt.h"

#include <string.h>

/* target_clones makes ifunc resolvers that run before ThreadSanitizer's
 * runtime is set up (it crashes at start), so a TSan build has none. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(GJ_NO_TARGET_CLONES) && !defined(__SANITIZE_THREAD__)
#define GJ_K_CLONES \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define GJ_K_CLONES
#endif

/* A helper of the cloned kernels: inlined into each clone, so it runs in
 * the clone's vector width (an out-of-line static function is built once,
 * for the default target). */
#if defined(__GNUC__) || defined(__clang__)
#define GJ_K_INLINE static inline __attribute__((always_inline))
#else
#define GJ_K_INLINE static inline
#endif

#define GJ_K_GRAIN 32768 /* elements per parallel task, at least */

/* ----------------------------------------------------------- helpers */

/* Load element i of a float array of dtype dt (f32/bf16/f64) as double. */
static inline double gj_rt_k_load(const void *p, gj_dtype dt, int64_t i) {
    switch (dt) {
    case GJ_F32: return ((const float *)p)[i];
    case GJ_F64: return ((const double *)p)[i];
    case GJ_BF16: return gj_m_bf16_to_f32(((const uint16_t *)p)[i]);
    case GJ_I64: return (double)((const int64_t *)p)[i];
    }
    return 0.0;
}

/* Store v as element i of an array of dtype dt (bf16: rounded). */
static inline void gj_rt_k_store(void *p, gj_dtype dt, int64_t i, double v) {
    switch (dt) {
    case GJ_F32: ((float *)p)[i] = (float)v; break;
    case GJ_F64: ((double *)p)[i] = v; break;
    case GJ_BF16: ((uint16_t *)p)[i] = gj_m_f32_to_bf16((float)v); break;
    case GJ_I64: /* saturating, NaN -> 0 (a plain cast is undefined there) */
        ((int64_t *)p)[i] = v != v ? 0
                            : v >= 9223372036854775807.0 ? INT64_MAX
                            : v <= -9223372036854775808.0 ? INT64_MIN
                                                          : (int64_t)v;
        break;
    }
}

/* Scratch bytes for a kernel (counted as tensor bytes): NULL + error on
 * OOM. Free with gj_rt_k_scratch_free(p, nbytes). */
static inline void *gj_rt_k_scratch(size_t nbytes) { return gj_rt_alloc_data(nbytes ? nbytes : 1); }
static inline void gj_rt_k_scratch_free(void *p, size_t nbytes) {
    gj_rt_free_data(p, nbytes ? nbytes : 1);
}

/* ------------------------------------------------- kernel entry points */

/* kernels_elementwise.c. Unary, scalar, binary, EQ and WHERE: in[0..n_in)
 * broadcast to out's shape (any strides, stride 0 allowed); out contiguous. */
int gj_rt_k_pointwise(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor *out);
/* FILL: out[...] = inst->scalar (any dtype). */
int gj_rt_k_fill(const gj_rt_inst *inst, gj_tensor *out);
/* DROPOUT_MASK: out[i] = gj_m_dropout_scale(seed, rng_offset + i, p). */
int gj_rt_k_dropout_mask(const gj_rt_inst *inst, gj_tensor *out);
/* IOTA: out[..., i_axis, ...] = i_axis (any dtype). */
int gj_rt_k_iota(const gj_rt_inst *inst, gj_tensor *out);

/* kernels_reduce.c. SUM over inst->axes / MAX over its single axis. */
int gj_rt_k_sum(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out);
int gj_rt_k_max(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out);

/* kernels_movement.c. RESHAPE (view when x is contiguous), PERMUTE, EXPAND,
 * SLICE: a new reference (a view sharing x's storage, or for RESHAPE of a
 * non-contiguous x a contiguous copy) with meta om; NULL + error. */
gj_tensor *gj_rt_k_view_op(const gj_rt_inst *inst, gj_tensor *x, const gj_rt_meta *om);
/* PAD: out zero-filled, x copied at inst->start on inst->axis. */
int gj_rt_k_pad(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out);
/* CAT: in[0..n_in) placed one after another on inst->axis. */
int gj_rt_k_cat(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor *out);

/* kernels_matmul.c. out uninitialised (K == 0: the kernel zero-fills it). */
int gj_rt_k_matmul(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *y, gj_tensor *out);

/* kernels_index.c. gather: out [..., D]; scatter: out [V, D] zero-filled. */
int gj_rt_k_gather_rows(gj_tensor *table, gj_tensor *idx, gj_tensor *out);
int gj_rt_k_scatter_add_rows(const gj_rt_inst *inst, gj_tensor *src, gj_tensor *idx,
                             gj_tensor *out);

/* kernels_conv.c. IM2COL: x any strides, out [N,C,kh,kw,OH,OW]; COL2IM:
 * cols any strides, out [N,C,H,W] (written whole). */
int gj_rt_k_im2col(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out);
int gj_rt_k_col2im(const gj_rt_inst *inst, gj_tensor *cols, gj_tensor *out);

/* kernels_elementwise.c: o[0..n) = x[0..n) rounded to bf16 (gj_m_f32_to_bf16),
 * in the CPU's vector width; on the calling thread. */
void gj_rt_k_round_bf16(uint16_t *restrict o, const float *restrict x, int64_t n);

/* kernels_composite.c. SOFTMAX .. CE_BWD over the last axis; outs as
 * inferred (LN_FWD: xhat, mean, rstd; CE_FWD: loss, lse). */
int gj_rt_k_composite(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs);
/* One cross-entropy row of K logits x (f32 or f64, dt), in place, as
 * CE_FWD and CE_BWD compute it: *term = lse - x[label]; with grad, x
 * becomes (softmax(x) - onehot(label)) * scale. label < 0: an ignored row
 * (term 0; with grad, x zeroed). */
void gj_rt_k_ce_row(gj_dtype dt, void *x, int64_t K, int64_t label, double scale, bool grad,
                    double *term);
/* CE_FWD's sum of per-row terms (8 lanes in double, combined in the fixed tree). */
double gj_rt_k_ce_sum_terms(const double *terms, int64_t n);

/* kernels_attention.c. ATTN_FWD: outs o, lse; ATTN_BWD: outs gq, gk, gv
 * (every output written whole). */
int gj_rt_k_attention(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs);

/* kernels_lce.c. LCE_FWD: outs loss (, gh, gw (, gb)), written whole. */
int gj_rt_k_lce(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs);

#endif /* GJ_RT_KERNELS_H */
