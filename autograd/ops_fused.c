/* SPDX-License-Identifier: MIT */
/*
 * ops_fused.c - forward and backward formulas of the fused ops whose
 * kernels never hold their large intermediate: scaled dot-product
 * attention (the T x S scores, runtime/attention.h) and the linear
 * cross-entropy head (the rows x vocabulary logits).
 *
 * Attributes:
 *   scaled_dot_product_attention: inputs q [B, H, T, D], k [B, H, S, D],
 *       v [B, H, S, E]. f[0] = scale, f[1] = dropout p; i[0] = causal,
 *       i[1] = generator seed (bits of the uint64), i[2] = first counter
 *       (p > 0: B H T S counters reserved; the mask is regenerated in
 *       backward from them, never saved). Saves q, k, v, o, lse.
 *   linear_cross_entropy: inputs h [N, C], weight [V, C], labels [N] (i64)
 *       and optionally bias [V]. i[0] = the ignored label, i[1] = 1 when
 *       gradients are wanted: the forward then makes them for a unit
 *       upstream gradient and saves them (gh, gw (, gb)); the backward
 *       multiplies each by the gradient that arrives (exact when it is 1).
 */
#include "autograd/ops_common.h"

/* ------------------------------------------------------------ attention */

/* The ATTN_* instruction of a node's attributes. */
static void attn_inst(const gj_ag_attrs *a, gj_rt_prim p, gj_rt_inst *inst) {
    memset(inst, 0, sizeof *inst);
    inst->prim = p;
    inst->n_in = p == GJ_P_ATTN_FWD ? 3 : 6;
    inst->scalar = a->f[0];
    inst->scalar2 = a->f[1];
    inst->keepdim = a->i[0] != 0;
    uint64_t seed;
    memcpy(&seed, &a->i[1], sizeof seed);
    inst->seed = seed;
    inst->rng_offset = (uint64_t)a->i[2];
}

/* (o, lse) = ATTN_FWD(q, k, v): the output and each query's log-sum-exp. */
static int sdpa_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst;
    attn_inst(a, GJ_P_ATTN_FWD, &inst);
    gj_val *r[GJ_RT_MAX_OUTPUTS] = {NULL};
    if (b->emit(b, &inst, in, r) != 2)
        return -1;
    outs[0] = r[0];
    for (int i = 0; i < 3; i++)
        gj_ag_save(ctx, in[i]);
    gj_ag_save(ctx, r[0]);
    gj_ag_save(ctx, r[1]);
    return 1;
}

/* (gq, gk, gv) = ATTN_BWD(q, k, v, o, g, lse): the probabilities recomputed
 * block by block from lse. */
static int sdpa_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !(gj_ag_needs_grad(ctx, 0) || gj_ag_needs_grad(ctx, 1) ||
                      gj_ag_needs_grad(ctx, 2)))
        return 0;
    gj_rt_inst inst;
    attn_inst(a, GJ_P_ATTN_BWD, &inst);
    gj_val *args[6] = {gj_ag_saved(ctx, 0), gj_ag_saved(ctx, 1), gj_ag_saved(ctx, 2),
                       gj_ag_saved(ctx, 3), gout[0],             gj_ag_saved(ctx, 4)};
    gj_val *r[GJ_RT_MAX_OUTPUTS] = {NULL};
    if (b->emit(b, &inst, args, r) != 3)
        return -1;
    for (int i = 0; i < 3; i++)
        if (gj_ag_needs_grad(ctx, i))
            gin[i] = r[i];
    return 0;
}

const gj_ag_opdef gj_ag_op_sdpa = {"scaled_dot_product_attention", sdpa_fwd, sdpa_bwd};

/* ------------------------------------------------- linear cross-entropy */

/* loss (, gh, gw (, gb)) = LCE_FWD(h, w, labels (, b)). */
static int lce_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_LCE_FWD, .n_in = n_in, .start = a->i[0],
                       .keepdim = a->i[1] != 0};
    gj_val *r[GJ_RT_MAX_OUTPUTS] = {NULL};
    int want = !inst.keepdim ? 1 : n_in == 4 ? 4 : 3;
    if (b->emit(b, &inst, in, r) != want)
        return -1;
    outs[0] = r[0];
    for (int k = 1; k < want; k++)
        gj_ag_save(ctx, r[k]);
    return 1;
}

/* g_i = saved gradient i * g (g broadcast, in the gradient's dtype). */
static int lce_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a, gj_val *const *gout,
                   gj_val **gin) {
    if (!gout[0] || !a->i[1])
        return 0;
    static const int input_of_saved[3] = {0, 1, 3}; /* gh, gw, gb */
    for (int k = 0; k < 3; k++) {
        int i = input_of_saved[k];
        gj_val *s = gj_ag_saved(ctx, k); /* NULL: gb without a bias */
        if (!s || !gj_ag_needs_grad(ctx, i))
            continue;
        const gj_rt_meta *m = gj_ag_input_meta(ctx, i);
        gj_val *g = gj_ag_cast(b, gout[0], m->dtype);
        GJ_OPS_TRY(g);
        gj_val *ge = gj_ag_expand(b, g, m->ndim, m->shape);
        GJ_OPS_TRY(gin[i] = gj_ag_binary(b, GJ_P_MUL, s, ge));
    }
    return 0;
}

const gj_ag_opdef gj_ag_op_lce = {"linear_cross_entropy", lce_fwd, lce_bwd};
