/* SPDX-License-Identifier: MIT */
/*
 * ops_linalg.c - forward and backward formulas of matmul and linear.
 *
 * Dimension legend: M, N, K the matrix dims, "..." the batch dims (which
 * broadcast, numpy rules). With X = op(a), Y = op(b) (op = transpose of the
 * last two dims when ta / tb):  out = X Y,  gX = g Y^T,  gY = X^T g.
 * Gradients of broadcast batch dims are summed back with sum_to, so an
 * operand that was broadcast gets the sum over the batch.
 *
 * Invariants: both operands have ndim >= 2 (the frontend refuses 1-D
 * matmul); linear flattens its leading dims, so its weight and bias
 * gradients are single 2-D products / sums over all leading dims.
 *
 * Attributes:
 *   matmul: i[0] = ta, i[1] = tb (ni == 0: both false). Saves a, b.
 *   linear: inputs x[..., in], w[out, in], optionally b[out];
 *           i[0] = has_bias. Saves x2 = x as [N, in] and w.
 */
#include "autograd/ops_common.h"

static bool attr_flag(const gj_ag_attrs *a, int k) { return a->ni > k && a->i[k] != 0; }

/* matmul: out = op(a) op(b). */
static int matmul_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                      gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_matmul(b, in[0], in[1], attr_flag(a, 0), attr_flag(a, 1)));
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, in[1]);
    return 1;
}

/* Gradient of a 2-D b when a is batched (and not transposed): the batch is
 * folded into M, so gb is one 2-D product instead of a batched product
 * followed by a sum over the batch. a[..., M, K], g[..., M, N]. */
static gj_val *matmul_gb_folded(gj_ag_builder *b, gj_val *x, gj_val *g, bool tb) {
    gj_rt_meta xm, gm;
    gj_ag_meta(b, x, &xm);
    gj_ag_meta(b, g, &gm);
    int64_t rows = gj_ops_prod(xm.ndim - 1, xm.shape);
    int64_t x2s[2] = {rows, xm.shape[xm.ndim - 1]};
    int64_t g2s[2] = {rows, gm.shape[gm.ndim - 1]};
    gj_val *x2 = gj_ag_reshape(b, x, 2, x2s);
    gj_val *g2 = x2 ? gj_ag_reshape(b, g, 2, g2s) : NULL;
    if (!g2)
        return NULL;
    /* tb == 0: gb[K, N] = x2^T g2;  tb == 1: gb[N, K] = g2^T x2 */
    return tb ? gj_ag_matmul(b, g2, x2, true, false) : gj_ag_matmul(b, x2, g2, true, false);
}

static int matmul_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                      gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    bool ta = attr_flag(a, 0), tb = attr_flag(a, 1);
    gj_val *x = gj_ag_saved(ctx, 0), *y = gj_ag_saved(ctx, 1);
    if (gj_ag_needs_grad(ctx, 0)) {
        /* ta=0: ga = g op(b)^T;  ta=1: ga = (g op(b)^T)^T = op(b) g^T */
        gj_val *t = !ta ? gj_ag_matmul(b, g, y, false, !tb) : gj_ag_matmul(b, y, g, tb, true);
        GJ_OPS_TRY(t);
        GJ_OPS_TRY(gin[0] = gj_ops_to_input(b, ctx, 0, t));
    }
    if (gj_ag_needs_grad(ctx, 1)) {
        const gj_rt_meta *am = gj_ag_input_meta(ctx, 0), *bm = gj_ag_input_meta(ctx, 1);
        gj_val *t;
        if (bm->ndim == 2 && am->ndim > 2 && !ta) {
            t = matmul_gb_folded(b, x, g, tb);
        } else {
            /* tb=0: gb = op(a)^T g;  tb=1: gb = (op(a)^T g)^T = g^T op(a) */
            t = !tb ? gj_ag_matmul(b, x, g, !ta, false) : gj_ag_matmul(b, g, x, true, ta);
        }
        GJ_OPS_TRY(t);
        GJ_OPS_TRY(gin[1] = gj_ops_to_input(b, ctx, 1, t));
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_matmul = {"matmul", matmul_fwd, matmul_bwd};

/* linear: y = x w^T + b, x[..., in] flattened to x2[N, in] (N = product of
 * the leading dims, 1 for a 1-D x). */
static int linear_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                      gj_val *const *in, gj_val **outs) {
    gj_rt_meta xm, wm;
    gj_ag_meta(b, in[0], &xm);
    gj_ag_meta(b, in[1], &wm);
    int64_t nfeat = xm.shape[xm.ndim - 1], nout = wm.shape[0];
    gj_val *x2 = in[0];
    if (xm.ndim != 2) {
        int64_t s2[2] = {gj_ops_prod(xm.ndim - 1, xm.shape), nfeat};
        GJ_OPS_TRY(x2 = gj_ag_reshape(b, in[0], 2, s2));
    }
    gj_val *y = gj_ag_matmul(b, x2, in[1], false, true); /* [N, out] */
    GJ_OPS_TRY(y);
    if (attr_flag(a, 0))
        GJ_OPS_TRY(y = gj_ag_binary(b, GJ_P_ADD, y, in[2]));
    if (xm.ndim != 2) {
        int64_t ys[GJ_MAX_DIMS];
        for (int k = 0; k < xm.ndim - 1; k++)
            ys[k] = xm.shape[k];
        ys[xm.ndim - 1] = nout;
        GJ_OPS_TRY(y = gj_ag_reshape(b, y, xm.ndim, ys));
    }
    outs[0] = y;
    gj_ag_save(ctx, x2);
    gj_ag_save(ctx, in[1]);
    return 1;
}

/* g2 = g as [N, out]:  gx = reshape(g2 w),  gw = g2^T x2,  gb = sum_rows(g2). */
static int linear_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                      gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    const gj_rt_meta *xm = gj_ag_input_meta(ctx, 0), *wm = gj_ag_input_meta(ctx, 1);
    gj_val *x2 = gj_ag_saved(ctx, 0), *w = gj_ag_saved(ctx, 1);
    gj_val *g2 = g;
    if (xm->ndim != 2) {
        int64_t s2[2] = {gj_ops_prod(xm->ndim - 1, xm->shape), wm->shape[0]};
        GJ_OPS_TRY(g2 = gj_ag_reshape(b, g, 2, s2));
    }
    if (gj_ag_needs_grad(ctx, 0)) {
        gj_val *t = gj_ag_matmul(b, g2, w, false, false); /* [N, in] */
        GJ_OPS_TRY(t);
        if (xm->ndim != 2)
            GJ_OPS_TRY(t = gj_ag_reshape(b, t, xm->ndim, xm->shape));
        gin[0] = t;
    }
    if (gj_ag_needs_grad(ctx, 1))
        GJ_OPS_TRY(gin[1] = gj_ag_matmul(b, g2, x2, true, false)); /* [out, in] */
    if (attr_flag(a, 0) && gj_ag_needs_grad(ctx, 2))
        GJ_OPS_TRY(gin[2] = gj_ag_sum(b, g2, 1u, false)); /* [out] */
    return 0;
}
const gj_ag_opdef gj_ag_op_linear = {"linear", linear_fwd, linear_bwd};
