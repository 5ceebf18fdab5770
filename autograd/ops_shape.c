/* SPDX-License-Identifier: MIT */
/*
 * ops_shape.c - forward and backward formulas of the movement ops: reshape
 * (also view and the identity-free aliases of the frontend), permute,
 * expand, slice (narrow) and cat.
 *
 * Invariants: attributes are normalised by the frontend (non-negative axes,
 * a full permutation, a target shape without -1). The eager kernels return
 * views where the layout allows; backward never assumes it.
 *
 * Attributes:
 *   reshape: i[0..ni) = target shape (ni = target ndim)
 *   permute: i[0..ni) = perm, output axis k reads input axis perm[k]
 *   expand:  i[0..ni) = target shape
 *   slice:   i[0] = axis, i[1] = start, i[2] = length
 *   cat:     i[0] = axis (n_in inputs, at most GJ_RT_MAX_INPUTS)
 */
#include "autograd/ops_common.h"

/* reshape: gx = reshape(g, input shape). */
static int reshape_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_reshape(b, in[0], a->ni, a->i));
    return 1;
}
static int reshape_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                       gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    GJ_OPS_TRY(gin[0] = gj_ag_reshape(b, gout[0], m->ndim, m->shape));
    return 0;
}
const gj_ag_opdef gj_ag_op_reshape = {"reshape", reshape_fwd, reshape_bwd};

/* permute: gx = permute(g, inverse perm). */
static int permute_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs) {
    int perm[GJ_MAX_DIMS];
    for (int k = 0; k < a->ni; k++)
        perm[k] = (int)a->i[k];
    GJ_OPS_TRY(outs[0] = gj_ag_permute(b, in[0], a->ni, perm));
    return 1;
}
static int permute_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                       gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    int inv[GJ_MAX_DIMS];
    for (int k = 0; k < a->ni; k++)
        inv[a->i[k]] = k;
    GJ_OPS_TRY(gin[0] = gj_ag_permute(b, gout[0], a->ni, inv));
    return 0;
}
const gj_ag_opdef gj_ag_op_permute = {"permute", permute_fwd, permute_bwd};

/* expand: gx = sum_to(g, input shape). */
static int expand_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                      gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_expand(b, in[0], a->ni, a->i));
    return 1;
}
static int expand_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                      gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    GJ_OPS_TRY(gin[0] = gj_ops_to_input(b, ctx, 0, gout[0]));
    return 0;
}
const gj_ag_opdef gj_ag_op_expand = {"expand", expand_fwd, expand_bwd};

/* slice (narrow) of length i[2] from i[1] on axis i[0]:
 * gx = pad(g) back to the input's length on that axis (zeros elsewhere). */
static int slice_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                     gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_SLICE,
                       .n_in = 1,
                       .axis = (int)a->i[0],
                       .start = a->i[1],
                       .len = a->i[2]};
    GJ_OPS_TRY(outs[0] = gj_ag_emit1(b, &inst, in));
    return 1;
}
static int slice_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                     gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    int axis = (int)a->i[0];
    gj_rt_inst inst = {.prim = GJ_P_PAD,
                       .n_in = 1,
                       .axis = axis,
                       .start = a->i[1],
                       .len = m->shape[axis]};
    GJ_OPS_TRY(gin[0] = gj_ag_emit1(b, &inst, gout));
    return 0;
}
const gj_ag_opdef gj_ag_op_slice = {"slice", slice_fwd, slice_bwd};

/* cat along axis i[0]: gin[k] = slice(g) at input k's offset and length. */
static int cat_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_CAT, .n_in = n_in, .axis = (int)a->i[0]};
    GJ_OPS_TRY(outs[0] = gj_ag_emit1(b, &inst, in));
    return 1;
}
static int cat_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    if (!gout[0])
        return 0;
    int axis = (int)a->i[0];
    int64_t start = 0;
    int n = gj_ag_n_inputs(ctx);
    for (int k = 0; k < n; k++) {
        int64_t len = gj_ag_input_meta(ctx, k)->shape[axis];
        if (gj_ag_needs_grad(ctx, k)) {
            gj_rt_inst inst = {.prim = GJ_P_SLICE,
                               .n_in = 1,
                               .axis = axis,
                               .start = start,
                               .len = len};
            GJ_OPS_TRY(gin[k] = gj_ag_emit1(b, &inst, gout));
        }
        start += len;
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_cat = {"cat", cat_fwd, cat_bwd};
