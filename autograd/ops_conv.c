// SPDX-License-Identifier: MIT
/*
 * ops_conv.c - forward and backward formulas of conv2d, max_pool2d and
 * avg_pool2d (NCHW), written once with IM2COL / COL2IM, MATMUL,
 * reductions and elementwise primitives.
 *
 * Dimension legend: N batch, C input channels, OC output channels, G
 * groups (Cg = C / G, OCg = OC / G), H x W image, kh x kw kernel, OH x OW
 * output positions, L = OH * OW, K = kh * kw taps, Kc = Cg * K.
 *
 *   conv2d:  cols = IM2COL(x) [N, C, kh, kw, OH, OW] viewed [N, G, Kc, L];
 *            y[N, G, OCg, L] = w[G, OCg, Kc] @ cols (w broadcast over N),
 *            viewed [N, OC, OH, OW], + b[OC, 1, 1].
 *            gx = COL2IM(w^T @ g) ; gw = sum_N(g @ cols^T) with cols
 *            recomputed from the saved x (not saved: K times x's size);
 *            gb = sum of g over N, OH, OW.
 *   max_pool2d: cols = IM2COL(x, pad -inf) viewed [N, C, K, OH, OW];
 *            y = MAX over K. The backward routes g to the first tap that
 *            holds the maximum (PyTorch's choice on ties); a NaN counts as
 *            the maximum. The forward saves code[N, C, 1, OH, OW] =
 *            max over k of hit_k * (K - k), hit_k = (tap k == y or tap k is
 *            NaN), i.e. K - (first hit), and backward selects the tap with
 *            EQ(code, K - k): gx = COL2IM(where(sel, g, 0)).
 *   avg_pool2d: y = SUM over K of IM2COL(x, pad 0) / K: the padding counts
 *            in the divisor (PyTorch's count_include_pad=True default; no
 *            ceil_mode, so every window lies inside the padded image).
 *            gx = COL2IM(expand(g / K)).
 *
 * Attributes:
 *   conv2d: inputs x, w, then b if i[7]; i[0..5] = sh, sw, ph, pw, dh, dw,
 *           i[6] = G, i[7] = has_bias. Saves x, w.
 *   pools:  input x; i[0..7] = kh, kw, sh, sw, ph, pw, dh, dw.
 *           max_pool2d saves code; avg_pool2d saves nothing.
 */
#include "autograd/ops_common.h"

#include <math.h>

/* An IM2COL (image meta xm) or COL2IM (image size H x W) instruction with
 * geometry geo = {kh, kw, sh, sw, ph, pw, dh, dw}. */
static gj_rt_inst win_inst(gj_rt_prim p, const int64_t *geo, double pad, int64_t H, int64_t W) {
    gj_rt_inst inst = {.prim = p, .n_in = 1, .scalar = pad, .ndim = GJ_RT_WIN_NDIM};
    memcpy(inst.shape, geo, GJ_RT_WIN_NDIM * sizeof *geo);
    if (p == GJ_P_COL2IM) {
        inst.start = H;
        inst.len = W;
    }
    return inst;
}

static gj_val *im2col(gj_ag_builder *b, gj_val *x, const int64_t *geo, double pad) {
    gj_rt_inst inst = win_inst(GJ_P_IM2COL, geo, pad, 0, 0);
    return gj_ag_emit1(b, &inst, &x);
}

static gj_val *col2im(gj_ag_builder *b, gj_val *cols, const int64_t *geo, int64_t H, int64_t W) {
    gj_rt_inst inst = win_inst(GJ_P_COL2IM, geo, 0.0, H, W);
    return gj_ag_emit1(b, &inst, &cols);
}

/* ---------------------------------------------------------------- conv2d */

/* The shapes of one conv2d: x [N, C, H, W], w [OC, Cg, kh, kw]. */
typedef struct conv_dims {
    int64_t N, C, H, W, OC, Cg, kh, kw, G, OCg, Kc, OH, OW, L;
    int64_t geo[GJ_RT_WIN_NDIM];
} conv_dims;

static void conv_dims_of(const gj_rt_meta *xm, const gj_rt_meta *wm, const gj_ag_attrs *a,
                         conv_dims *d) {
    d->N = xm->shape[0], d->C = xm->shape[1], d->H = xm->shape[2], d->W = xm->shape[3];
    d->OC = wm->shape[0], d->Cg = wm->shape[1], d->kh = wm->shape[2], d->kw = wm->shape[3];
    d->G = a->i[6];
    d->OCg = d->OC / d->G;
    d->Kc = d->Cg * d->kh * d->kw;
    int64_t geo[GJ_RT_WIN_NDIM] = {d->kh, d->kw, a->i[0], a->i[1], a->i[2], a->i[3], a->i[4], a->i[5]};
    memcpy(d->geo, geo, sizeof geo);
    d->OH = (d->H + 2 * a->i[2] - a->i[4] * (d->kh - 1) - 1) / a->i[0] + 1;
    d->OW = (d->W + 2 * a->i[3] - a->i[5] * (d->kw - 1) - 1) / a->i[1] + 1;
    d->L = d->OH * d->OW;
}

/* IM2COL(x) viewed [N, G, Kc, L]. */
static gj_val *conv_cols(gj_ag_builder *b, gj_val *x, const conv_dims *d) {
    gj_val *cols = im2col(b, x, d->geo, 0.0);
    int64_t s4[4] = {d->N, d->G, d->Kc, d->L};
    return cols ? gj_ag_reshape(b, cols, 4, s4) : NULL;
}

/* w viewed [G, OCg, Kc]. */
static gj_val *conv_w3(gj_ag_builder *b, gj_val *w, const conv_dims *d) {
    int64_t s3[3] = {d->G, d->OCg, d->Kc};
    return gj_ag_reshape(b, w, 3, s3);
}

static int conv2d_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                      gj_val *const *in, gj_val **outs) {
    gj_rt_meta xm, wm;
    gj_ag_meta(b, in[0], &xm);
    gj_ag_meta(b, in[1], &wm);
    conv_dims d;
    conv_dims_of(&xm, &wm, a, &d);
    gj_val *cols = conv_cols(b, in[0], &d);
    gj_val *w3 = cols ? conv_w3(b, in[1], &d) : NULL;
    gj_val *y = w3 ? gj_ag_matmul(b, w3, cols, false, false) : NULL; /* [N, G, OCg, L] */
    int64_t ys[4] = {d.N, d.OC, d.OH, d.OW};
    GJ_OPS_TRY(y = y ? gj_ag_reshape(b, y, 4, ys) : NULL);
    if (a->i[7]) {
        int64_t bs[3] = {d.OC, 1, 1};
        gj_val *b3 = gj_ag_reshape(b, in[2], 3, bs);
        GJ_OPS_TRY(y = b3 ? gj_ag_binary(b, GJ_P_ADD, y, b3) : NULL);
    }
    outs[0] = y;
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, in[1]);
    return 1;
}

static int conv2d_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                      gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    const gj_rt_meta *wm = gj_ag_input_meta(ctx, 1);
    conv_dims d;
    conv_dims_of(gj_ag_input_meta(ctx, 0), wm, a, &d);
    gj_val *x = gj_ag_saved(ctx, 0), *w = gj_ag_saved(ctx, 1);
    int64_t g4s[4] = {d.N, d.G, d.OCg, d.L};
    gj_val *g4 = gj_ag_reshape(b, g, 4, g4s);
    GJ_OPS_TRY(g4);
    if (gj_ag_needs_grad(ctx, 0)) { /* gx = COL2IM(w^T @ g) */
        gj_val *w3 = conv_w3(b, w, &d);
        gj_val *gc = w3 ? gj_ag_matmul(b, w3, g4, true, false) : NULL; /* [N, G, Kc, L] */
        int64_t s6[6] = {d.N, d.C, d.kh, d.kw, d.OH, d.OW};
        gc = gc ? gj_ag_reshape(b, gc, 6, s6) : NULL;
        GJ_OPS_TRY(gin[0] = gc ? col2im(b, gc, d.geo, d.H, d.W) : NULL);
    }
    if (gj_ag_needs_grad(ctx, 1)) { /* gw = sum over N of g @ cols^T */
        gj_val *cols = conv_cols(b, x, &d);
        gj_val *t = cols ? gj_ag_matmul(b, g4, cols, false, true) : NULL; /* [N, G, OCg, Kc] */
        t = t ? gj_ag_sum(b, t, 1u, false) : NULL;
        GJ_OPS_TRY(gin[1] = t ? gj_ag_reshape(b, t, wm->ndim, wm->shape) : NULL);
    }
    if (a->i[7] && gj_ag_needs_grad(ctx, 2))
        GJ_OPS_TRY(gin[2] = gj_ag_sum(b, g, 1u | 4u | 8u, false));
    return 0;
}
const gj_ag_opdef gj_ag_op_conv2d = {"conv2d", conv2d_fwd, conv2d_bwd};

/* ------------------------------------------------------------------ pools */

typedef struct pool_dims {
    int64_t N, C, H, W, K, OH, OW;
    int64_t geo[GJ_RT_WIN_NDIM];
} pool_dims;

static void pool_dims_of(const gj_rt_meta *xm, const gj_ag_attrs *a, pool_dims *d) {
    d->N = xm->shape[0], d->C = xm->shape[1], d->H = xm->shape[2], d->W = xm->shape[3];
    for (int k = 0; k < GJ_RT_WIN_NDIM; k++)
        d->geo[k] = a->i[k];
    d->K = a->i[0] * a->i[1];
    d->OH = (d->H + 2 * a->i[4] - a->i[6] * (a->i[0] - 1) - 1) / a->i[2] + 1;
    d->OW = (d->W + 2 * a->i[5] - a->i[7] * (a->i[1] - 1) - 1) / a->i[3] + 1;
}

/* IM2COL(x, pad) viewed [N, C, K, OH, OW]. */
static gj_val *pool_cols(gj_ag_builder *b, gj_val *x, const pool_dims *d, double pad) {
    gj_val *cols = im2col(b, x, d->geo, pad);
    int64_t s5[5] = {d->N, d->C, d->K, d->OH, d->OW};
    return cols ? gj_ag_reshape(b, cols, 5, s5) : NULL;
}

/* The tap ranks K - k, shape [K, 1, 1] (broadcast against [N, C, K, OH, OW]). */
static gj_val *tap_rank(gj_ag_builder *b, gj_dtype dt, int64_t K) {
    gj_rt_inst io = {.prim = GJ_P_IOTA, .n_in = 0, .dtype = dt, .axis = 0, .ndim = 3};
    io.shape[0] = K;
    io.shape[1] = 1;
    io.shape[2] = 1;
    gj_val *r = gj_ag_emit1(b, &io, NULL);
    r = r ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, r, -1.0) : NULL;
    return r ? gj_ag_scalar_op(b, GJ_P_ADD_SCALAR, r, (double)K) : NULL;
}

static int max_pool2d_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                          gj_val *const *in, gj_val **outs) {
    gj_rt_meta xm;
    gj_ag_meta(b, in[0], &xm);
    pool_dims d;
    pool_dims_of(&xm, a, &d);
    gj_val *c5 = pool_cols(b, in[0], &d, -INFINITY);
    GJ_OPS_TRY(c5);
    gj_rt_inst mx = {.prim = GJ_P_MAX, .n_in = 1, .axes = 4u, .keepdim = true};
    gj_val *m = gj_ag_emit1(b, &mx, &c5); /* [N, C, 1, OH, OW] */
    gj_val *eqm = m ? gj_ag_binary(b, GJ_P_EQ, c5, m) : NULL;
    gj_val *self = eqm ? gj_ag_binary(b, GJ_P_EQ, c5, c5) : NULL;
    gj_val *one = self ? gj_ops_const0(b, xm.dtype, 1.0) : NULL;
    gj_val *hit = one ? gj_ag_where(b, self, eqm, one) : NULL;
    gj_val *rk = hit ? tap_rank(b, xm.dtype, d.K) : NULL;
    gj_val *hr = rk ? gj_ag_binary(b, GJ_P_MUL, hit, rk) : NULL;
    gj_val *code = hr ? gj_ag_emit1(b, &mx, &hr) : NULL; /* [N, C, 1, OH, OW] */
    GJ_OPS_TRY(code);
    int64_t ys[4] = {d.N, d.C, d.OH, d.OW};
    GJ_OPS_TRY(outs[0] = gj_ag_reshape(b, m, 4, ys));
    gj_ag_save(ctx, code);
    return 1;
}

static int max_pool2d_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                          gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *xm = gj_ag_input_meta(ctx, 0);
    pool_dims d;
    pool_dims_of(xm, a, &d);
    int64_t s5[5] = {d.N, d.C, 1, d.OH, d.OW};
    gj_val *g5 = gj_ag_reshape(b, gout[0], 5, s5);
    gj_val *rk = g5 ? tap_rank(b, xm->dtype, d.K) : NULL;
    gj_val *sel = rk ? gj_ag_binary(b, GJ_P_EQ, gj_ag_saved(ctx, 0), rk) : NULL;
    gj_val *zero = sel ? gj_ops_const0(b, xm->dtype, 0.0) : NULL;
    gj_val *gc = zero ? gj_ag_where(b, sel, g5, zero) : NULL; /* [N, C, K, OH, OW] */
    int64_t s6[6] = {d.N, d.C, d.geo[0], d.geo[1], d.OH, d.OW};
    gc = gc ? gj_ag_reshape(b, gc, 6, s6) : NULL;
    GJ_OPS_TRY(gin[0] = gc ? col2im(b, gc, d.geo, d.H, d.W) : NULL);
    return 0;
}
const gj_ag_opdef gj_ag_op_max_pool2d = {"max_pool2d", max_pool2d_fwd, max_pool2d_bwd};

static int avg_pool2d_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                          gj_val *const *in, gj_val **outs) {
    gj_rt_meta xm;
    gj_ag_meta(b, in[0], &xm);
    pool_dims d;
    pool_dims_of(&xm, a, &d);
    gj_val *c5 = pool_cols(b, in[0], &d, 0.0);
    gj_val *s = c5 ? gj_ag_sum(b, c5, 4u, false) : NULL; /* [N, C, OH, OW] */
    gj_val *k = s ? gj_ops_const0(b, xm.dtype, (double)d.K) : NULL;
    GJ_OPS_TRY(outs[0] = k ? gj_ag_binary(b, GJ_P_DIV, s, k) : NULL);
    return 1;
}

static int avg_pool2d_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                          gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    const gj_rt_meta *xm = gj_ag_input_meta(ctx, 0);
    pool_dims d;
    pool_dims_of(xm, a, &d);
    gj_val *k = gj_ops_const0(b, xm->dtype, (double)d.K);
    gj_val *gk = k ? gj_ag_binary(b, GJ_P_DIV, gout[0], k) : NULL;
    int64_t s1[6] = {d.N, d.C, 1, 1, d.OH, d.OW};
    int64_t s6[6] = {d.N, d.C, d.geo[0], d.geo[1], d.OH, d.OW};
    gj_val *g6 = gk ? gj_ag_reshape(b, gk, 6, s1) : NULL;
    g6 = g6 ? gj_ag_expand(b, g6, 6, s6) : NULL;
    GJ_OPS_TRY(gin[0] = g6 ? col2im(b, g6, d.geo, d.H, d.W) : NULL);
    return 0;
}
const gj_ag_opdef gj_ag_op_avg_pool2d = {"avg_pool2d", avg_pool2d_fwd, avg_pool2d_bwd};
