/* SPDX-License-Identifier: MIT */
/*
 * ops_reduce.c - forward and backward formulas of the reductions sum (also
 * mean, as a scaled sum) and max over an axis.
 *
 * Invariants: the reduced axes are a bitmask of input axes, already
 * normalised by the frontend (never empty for a tensor with ndim > 0).
 * Backward brings the gradient to the keepdim shape with a reshape, then
 * broadcasts it (an expand, or the broadcast of an elementwise op).
 *
 * Attributes:
 *   sum: i[0] = axes bitmask, i[1] = keepdim, f[0] = scale (nf == 0: 1).
 *        out = scale * sum(x); gj_mean uses scale = 1/n, one node.
 *   max: i[0] = axis, i[1] = keepdim. Values only. Ties: the gradient goes
 *        to EVERY position equal to the maximum (PyTorch picks one index),
 *        so tied inputs each receive the full gradient.
 */
#include "autograd/ops_common.h"

static double sum_scale(const gj_ag_attrs *a) { return a->nf > 0 ? a->f[0] : 1.0; }

/* sum: out = scale * sum over axes.  gx = expand(reshape(g, keepdim) * scale). */
static int sum_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    uint32_t axes = (uint32_t)a->i[0];
    double scale = sum_scale(a);
    gj_val *y;
    if (axes == 0) { /* 0-d input: nothing to reduce */
        gj_rt_inst inst = {.prim = GJ_P_COPY, .n_in = 1};
        y = scale == 1.0 ? gj_ag_emit1(b, &inst, in)
                         : gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, in[0], scale);
        GJ_OPS_TRY(y);
        outs[0] = y;
        return 1;
    }
    GJ_OPS_TRY(y = gj_ag_sum(b, in[0], axes, a->i[1] != 0));
    if (scale != 1.0)
        GJ_OPS_TRY(y = gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, y, scale));
    outs[0] = y;
    return 1;
}
static int sum_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    uint32_t axes = (uint32_t)a->i[0];
    double scale = sum_scale(a);
    if (scale != 1.0)
        GJ_OPS_TRY(g = gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, g, scale));
    if (axes == 0) {
        gin[0] = g;
        return 0;
    }
    if (!a->i[1]) {
        int64_t ks[GJ_MAX_DIMS];
        gj_ops_keep_shape(m->ndim, m->shape, axes, ks);
        GJ_OPS_TRY(g = gj_ag_reshape(b, g, m->ndim, ks));
    }
    GJ_OPS_TRY(gin[0] = gj_ag_expand(b, g, m->ndim, m->shape));
    return 0;
}
const gj_ag_opdef gj_ag_op_sum = {"sum", sum_fwd, sum_bwd};

/* max over axis i[0]: saves x and the output.
 * gx = eq(x, y_keepdim) * g_keepdim (broadcast to x's shape). */
static int max_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_MAX,
                       .n_in = 1,
                       .axes = 1u << a->i[0],
                       .keepdim = a->i[1] != 0};
    GJ_OPS_TRY(outs[0] = gj_ag_emit1(b, &inst, in));
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, outs[0]);
    return 1;
}
static int max_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    gj_val *x = gj_ag_saved(ctx, 0), *y = gj_ag_saved(ctx, 1);
    if (!a->i[1]) {
        int64_t ks[GJ_MAX_DIMS];
        gj_ops_keep_shape(m->ndim, m->shape, 1u << a->i[0], ks);
        GJ_OPS_TRY(y = gj_ag_reshape(b, y, m->ndim, ks));
        GJ_OPS_TRY(g = gj_ag_reshape(b, g, m->ndim, ks));
    }
    gj_val *mask = gj_ag_binary(b, GJ_P_EQ, x, y); /* x's shape */
    GJ_OPS_TRY(mask);
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, mask, g));
    return 0;
}
const gj_ag_opdef gj_ag_op_max = {"max", max_fwd, max_bwd};
