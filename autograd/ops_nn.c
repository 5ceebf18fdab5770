/* SPDX-License-Identifier: MIT */
/*
 * ops_nn.c - forward and backward formulas of the NN ops built on the
 * composite primitives: softmax, log_softmax, layer_norm, cross_entropy,
 * and embedding.
 *
 * Invariants: composites act on the last axis. softmax / log_softmax over
 * another axis swap that axis with the last (a permutation that is its own
 * inverse), apply, and swap back; the saved output is the one in the
 * swapped layout, so backward applies the composite backward there.
 *
 * Attributes:
 *   softmax, log_softmax: i[0] = axis (normalised, 0 <= axis < ndim)
 *   layer_norm: inputs x, then w if i[0], then b if i[1]; f[0] = eps.
 *               Saves x, mean, rstd (and w if present); xhat is recomputed
 *               in backward as (x - mean) * rstd.
 *   cross_entropy: inputs logits[N, K], labels[N] (i64). Output: the mean
 *               NLL (0-d). Saves logits, lse[N], labels.
 *   embedding: inputs table[V, D], idx (i64, any shape). Saves idx.
 */
#include "autograd/ops_common.h"

/* ------------------------------------------------- softmax / log_softmax */

/* Shared forward: composite p over axis i[0] of in[0]; saves the output in
 * the last-axis layout. */
static int softmax_like_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, gj_rt_prim p,
                            const gj_ag_attrs *a, gj_val *x, gj_val **outs) {
    gj_rt_meta m;
    gj_ag_meta(b, x, &m);
    int axis = (int)a->i[0], perm[GJ_MAX_DIMS];
    bool swap = axis != m.ndim - 1;
    if (swap) {
        gj_ops_swap_last_perm(m.ndim, axis, perm);
        GJ_OPS_TRY(x = gj_ag_permute(b, x, m.ndim, perm));
    }
    gj_val *y = gj_ag_unary(b, p, x);
    GJ_OPS_TRY(y);
    gj_ag_save(ctx, y);
    if (swap)
        GJ_OPS_TRY(y = gj_ag_permute(b, y, m.ndim, perm));
    outs[0] = y;
    return 1;
}

/* Shared backward: gx = swap(p_bwd(y, swap(g))). */
static int softmax_like_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, gj_rt_prim p,
                            const gj_ag_attrs *a, gj_val *g, gj_val **gin) {
    if (!g || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    int axis = (int)a->i[0], perm[GJ_MAX_DIMS];
    bool swap = axis != m->ndim - 1;
    if (swap) {
        gj_ops_swap_last_perm(m->ndim, axis, perm);
        GJ_OPS_TRY(g = gj_ag_permute(b, g, m->ndim, perm));
    }
    gj_rt_inst inst = {.prim = p, .n_in = 2};
    gj_val *args[2] = {gj_ag_saved(ctx, 0), g};
    gj_val *gx = gj_ag_emit1(b, &inst, args);
    GJ_OPS_TRY(gx);
    if (swap)
        GJ_OPS_TRY(gx = gj_ag_permute(b, gx, m->ndim, perm));
    gin[0] = gx;
    return 0;
}

static int softmax_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs) {
    return softmax_like_fwd(b, ctx, GJ_P_SOFTMAX, a, in[0], outs);
}
/* gx = y * (g - sum(g * y)) */
static int softmax_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                       gj_val *const *gout, gj_val **gin) {
    return softmax_like_bwd(b, ctx, GJ_P_SOFTMAX_BWD, a, gout[0], gin);
}
const gj_ag_opdef gj_ag_op_softmax = {"softmax", softmax_fwd, softmax_bwd};

static int log_softmax_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                           gj_val *const *in, gj_val **outs) {
    return softmax_like_fwd(b, ctx, GJ_P_LOG_SOFTMAX, a, in[0], outs);
}
/* gx = g - exp(y) * sum(g) */
static int log_softmax_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                           gj_val *const *gout, gj_val **gin) {
    return softmax_like_bwd(b, ctx, GJ_P_LOG_SOFTMAX_BWD, a, gout[0], gin);
}
const gj_ag_opdef gj_ag_op_log_softmax = {"log_softmax", log_softmax_fwd, log_softmax_bwd};

/* ------------------------------------------------------------ layer_norm */

/* out = xhat * w + b, (xhat, mean, rstd) = LN_FWD(x, eps). */
static int layer_norm_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                          gj_val *const *in, gj_val **outs) {
    bool has_w = a->i[0] != 0, has_b = a->i[1] != 0;
    gj_rt_inst inst = {.prim = GJ_P_LN_FWD, .n_in = 1, .scalar = a->f[0]};
    gj_val *r[GJ_RT_MAX_OUTPUTS] = {NULL};
    if (b->emit(b, &inst, in, r) != 3)
        return -1;
    gj_val *y = r[0];
    if (has_w)
        GJ_OPS_TRY(y = gj_ag_binary(b, GJ_P_MUL, y, in[1]));
    if (has_b)
        GJ_OPS_TRY(y = gj_ag_binary(b, GJ_P_ADD, y, in[has_w ? 2 : 1]));
    outs[0] = y;
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, r[1]);
    gj_ag_save(ctx, r[2]);
    if (has_w)
        gj_ag_save(ctx, in[1]);
    return 1;
}

/* gxhat = g * w;  gw = sum_to(g * xhat), xhat = (x - mean) * rstd;
 * gb = sum_to(g);  gx = LN_BWD(x, mean, rstd, gxhat). */
static int layer_norm_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                          gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    bool has_w = a->i[0] != 0, has_b = a->i[1] != 0;
    int iw = 1, ib = has_w ? 2 : 1;
    gj_val *x = gj_ag_saved(ctx, 0), *mean = gj_ag_saved(ctx, 1), *rstd = gj_ag_saved(ctx, 2);
    if (has_w && gj_ag_needs_grad(ctx, iw)) {
        gj_val *xhat = gj_ag_binary(b, GJ_P_SUB, x, mean);
        GJ_OPS_TRY(xhat);
        GJ_OPS_TRY(xhat = gj_ag_binary(b, GJ_P_MUL, xhat, rstd));
        gj_val *t = gj_ag_binary(b, GJ_P_MUL, g, xhat);
        GJ_OPS_TRY(t);
        GJ_OPS_TRY(gin[iw] = gj_ops_to_input(b, ctx, iw, t));
    }
    if (has_b && gj_ag_needs_grad(ctx, ib))
        GJ_OPS_TRY(gin[ib] = gj_ops_to_input(b, ctx, ib, g));
    if (gj_ag_needs_grad(ctx, 0)) {
        gj_val *gxhat = g;
        if (has_w)
            GJ_OPS_TRY(gxhat = gj_ag_binary(b, GJ_P_MUL, g, gj_ag_saved(ctx, 3)));
        gj_rt_inst inst = {.prim = GJ_P_LN_BWD, .n_in = 4};
        gj_val *args[4] = {x, mean, rstd, gxhat};
        GJ_OPS_TRY(gin[0] = gj_ag_emit1(b, &inst, args));
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_layer_norm = {"layer_norm", layer_norm_fwd, layer_norm_bwd};

/* --------------------------------------------------------- cross_entropy */

/* (loss, lse) = CE_FWD(logits, labels); only loss is an output. */
static int cross_entropy_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                             gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_CE_FWD, .n_in = 2};
    gj_val *r[GJ_RT_MAX_OUTPUTS] = {NULL};
    if (b->emit(b, &inst, in, r) != 2)
        return -1;
    outs[0] = r[0];
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, r[1]);
    gj_ag_save(ctx, in[1]);
    return 1;
}
/* glogits = (softmax(logits) - onehot(labels)) * g / N = CE_BWD(...). */
static int cross_entropy_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                             gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_rt_inst inst = {.prim = GJ_P_CE_BWD, .n_in = 4};
    gj_val *args[4] = {gj_ag_saved(ctx, 0), gj_ag_saved(ctx, 1), gj_ag_saved(ctx, 2),
                       gout[0]};
    GJ_OPS_TRY(gin[0] = gj_ag_emit1(b, &inst, args));
    return 0;
}
const gj_ag_opdef gj_ag_op_cross_entropy = {"cross_entropy", cross_entropy_fwd,
                                            cross_entropy_bwd};

/* ------------------------------------------------------------- embedding */

/* out = table[idx] (rows). gtable = scatter_add_rows(g, idx) into [V, D]. */
static int embedding_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                         gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_GATHER_ROWS, .n_in = 2};
    GJ_OPS_TRY(outs[0] = gj_ag_emit1(b, &inst, in));
    gj_ag_save(ctx, in[1]);
    return 1;
}
static int embedding_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                         gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_rt_inst inst = {.prim = GJ_P_SCATTER_ADD_ROWS,
                       .n_in = 2,
                       .len = gj_ag_input_meta(ctx, 0)->shape[0]};
    gj_val *args[2] = {gout[0], gj_ag_saved(ctx, 0)};
    GJ_OPS_TRY(gin[0] = gj_ag_emit1(b, &inst, args));
    return 0;
}
const gj_ag_opdef gj_ag_op_embedding = {"embedding", embedding_fwd, embedding_bwd};
