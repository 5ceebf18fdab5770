/* SPDX-License-Identifier: MIT */
/*
 * ops_common.h - small helpers shared by the op definitions (ops_*.c).
 *
 * Every helper only composes builder calls (gj_ag_*), so formulas written
 * with them stay valid for both the eager and the recording builder. A
 * helper returns NULL when an emit failed (the error is already set);
 * callers propagate with GJ_OPS_TRY.
 */
#ifndef GJ_AG_OPS_COMMON_H
#define GJ_AG_OPS_COMMON_H

#include "autograd/ag.h"

#include <string.h>

/* Propagate a failed emit (NULL value) as the -1 status of forward/backward. */
#define GJ_OPS_TRY(v)      \
    do {                   \
        if (!(v))          \
            return -1;     \
    } while (0)

/* A 0-d constant of dtype dt (broadcasts against anything). */
static inline gj_val *gj_ops_const0(gj_ag_builder *b, gj_dtype dt, double v) {
    int64_t none[1] = {0}; /* never read (ndim 0); not NULL for memcpy */
    return gj_ag_fill(b, dt, 0, none, v);
}

/* Gradient for input i: g summed back to the input's shape (broadcast undo).
 * Returns g itself when the shapes already match. */
static inline gj_val *gj_ops_to_input(gj_ag_builder *b, gj_ag_bctx *ctx, int i, gj_val *g) {
    const gj_rt_meta *m = gj_ag_input_meta(ctx, i);
    return gj_ag_sum_to(b, g, m->ndim, m->shape);
}

/* Shape of (ndim, shape) with every axis of `axes` set to 1 (keepdim form). */
static inline void gj_ops_keep_shape(int ndim, const int64_t *shape, uint32_t axes,
                                     int64_t *out) {
    for (int k = 0; k < ndim; k++)
        out[k] = (axes >> k) & 1u ? 1 : shape[k];
}

/* Permutation swapping axis `axis` with the last axis (its own inverse). */
static inline void gj_ops_swap_last_perm(int ndim, int axis, int *perm) {
    for (int k = 0; k < ndim; k++)
        perm[k] = k;
    perm[axis] = ndim - 1;
    perm[ndim - 1] = axis;
}

/* Product of shape[0..n). */
static inline int64_t gj_ops_prod(int n, const int64_t *shape) {
    int64_t p = 1;
    for (int k = 0; k < n; k++)
        p *= shape[k];
    return p;
}

#endif /* GJ_AG_OPS_COMMON_H */
