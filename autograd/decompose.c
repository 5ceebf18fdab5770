/* SPDX-License-Identifier: MIT */
/*
 * decompose.c - the composite primitives (SOFTMAX .. CE_BWD) expressed with
 * non-composite primitives, on any builder. The recording builder of jit/
 * uses it so the fusion pass sees plain elementwise ops and reductions; the
 * eager builder runs the composites as hand-fused kernels instead, and
 * tests/test_decompose.c checks both agree (f64, 1e-12).
 *
 * Invariants: every composite acts on the last axis L of its first input.
 * bf16 inputs are cast to f32 first and every output is cast to the dtype
 * gj_rt_infer gives the composite, so the decomposition has exactly the
 * composite's output metas. Reductions keep their dims so that their
 * results broadcast against the input.
 *
 * The one-hot of the cross-entropy labels is EQ(cast(labels)[N, 1],
 * IOTA[K]) (IOTA: value = index, a nullary primitive appended for this).
 * Labels are compared in f32 (f64 when K > 2^24, where f32 stops being
 * exact), so the comparison is exact for every valid label.
 *
 * Numerics follow the eager kernels (runtime/kernels_composite.c) step by
 * step: row reductions (sums, dot products, means) are taken in double --
 * the f32 values are widened (exactly) to f64 before the product and the
 * SUM, which then adds in the same lane order as the eager row kernels --
 * divided by C in double and rounded once to the compute dtype; the
 * elementwise parts run in the compute dtype in the eager kernels' order.
 * So the decomposition gives the composite's values bit for bit (f32 and
 * f64), except LOG_SOFTMAX and CE_FWD with more than 512 classes, whose
 * eager kernels sum exp() in tiles of 512 (one rounding step apart).
 * The eager composites read a non-contiguous input as a contiguous copy,
 * and a SUM or MAX adds in an order that follows the strides of what it
 * reads (runtime/kernels_reduce.c), so a row reduction of one of the
 * composite's inputs itself (an f64 input, whose casts are no-ops)
 * reduces a COPY of it (own_rows): the rows of a contiguous tensor, as
 * the composite's lanes take them, whatever view the input is.
 */
#include "autograd/ops_common.h"


/* v, or when v is one of the composite's inputs in[0..n_in) itself, a
 * contiguous copy of it (to be reduced; see the top of the file). */
static gj_val *own_rows(gj_ag_builder *b, gj_val *v, gj_val *const *in, int n_in) {
    bool input = false;
    for (int k = 0; k < n_in; k++) input |= v && v == in[k];
    if (!input) return v;
    gj_rt_inst inst = {.prim = GJ_P_COPY, .n_in = 1};
    return gj_ag_emit1(b, &inst, &v);
}

/* Reduction of x over `axes` with keepdim. */
static gj_val *reduce(gj_ag_builder *b, gj_rt_prim p, gj_val *x, uint32_t axes, bool keep) {
    gj_rt_inst inst = {.prim = p, .n_in = 1, .axes = axes, .keepdim = keep};
    return gj_ag_emit1(b, &inst, &x);
}

/* The dtype composites compute in: f32 for bf16 storage, else dt. */
static gj_dtype compute_dtype(gj_dtype dt) { return dt == GJ_BF16 ? GJ_F32 : dt; }

/* one-hot [N, K] of labels [N] (i64) in dtype dt: EQ(labels[N,1], iota[K]). */
static gj_val *one_hot(gj_ag_builder *b, gj_val *labels, int64_t n, int64_t k, gj_dtype dt) {
    gj_dtype cmp = (dt == GJ_F32 && k > (INT64_C(1) << 24)) ? GJ_F64 : dt;
    gj_val *lab = gj_ag_cast(b, labels, cmp);
    int64_t s2[2] = {n, 1};
    lab = lab ? gj_ag_reshape(b, lab, 2, s2) : NULL;
    if (!lab)
        return NULL;
    gj_rt_inst iota = {.prim = GJ_P_IOTA, .n_in = 0, .dtype = cmp, .axis = 0, .ndim = 1};
    iota.shape[0] = k;
    gj_val *io = gj_ag_emit1(b, &iota, NULL);
    gj_val *oh = io ? gj_ag_binary(b, GJ_P_EQ, lab, io) : NULL;
    return gj_ag_cast(b, oh, dt);
}

/* The mean over the last axis of v (f64), as the eager kernels take it:
 * the double sum divided by C (not multiplied by 1/C). */
static gj_val *row_mean_d(gj_ag_builder *b, gj_val *v, uint32_t last, int64_t c) {
    gj_val *s = reduce(b, GJ_P_SUM, v, last, true);
    gj_val *n = s ? gj_ops_const0(b, GJ_F64, (double)c) : NULL;
    return n ? gj_ag_binary(b, GJ_P_DIV, s, n) : NULL;
}

/* Row-wise max m of x (keepdim; of xr, x as own_rows gives it), z = x - m,
 * e = exp(z) in x's dtype, and s = sum(e) accumulated in double (f64). */
static int shifted_exp_sum(gj_ag_builder *b, gj_val *x, gj_val *xr, uint32_t last, gj_val **m,
                           gj_val **z, gj_val **e, gj_val **s) {
    *m = xr ? reduce(b, GJ_P_MAX, xr, last, true) : NULL;
    *z = *m ? gj_ag_binary(b, GJ_P_SUB, x, *m) : NULL;
    *e = *z ? gj_ag_unary(b, GJ_P_EXP, *z) : NULL;
    gj_val *ed = *e ? gj_ag_cast(b, *e, GJ_F64) : NULL;
    *s = ed ? reduce(b, GJ_P_SUM, ed, last, true) : NULL;
    return *s ? 0 : -1;
}

int gj_ag_decompose(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in,
                    gj_val **outs) {
    gj_rt_meta im[GJ_RT_MAX_INPUTS], om[GJ_RT_MAX_OUTPUTS];
    if (inst->n_in < 1 || inst->n_in > 4) {
        gj_rt_set_error("decompose: %s is not a composite primitive",
                        gj_rt_prim_name(inst->prim));
        return -1;
    }
    for (int k = 0; k < inst->n_in; k++) {
        if (!in[k])
            return -1;
        gj_ag_meta(b, in[k], &im[k]);
    }
    int n_out = gj_rt_infer(inst, im, om);
    if (n_out < 0)
        return -1;
    int nd = im[0].ndim;
    uint32_t last = nd > 0 ? 1u << (nd - 1) : 0;
    int64_t c = nd > 0 ? im[0].shape[nd - 1] : 1;
    gj_dtype cdt = compute_dtype(im[0].dtype);
    gj_val *r[GJ_RT_MAX_OUTPUTS] = {NULL, NULL, NULL};
    gj_val *x = gj_ag_cast(b, in[0], cdt);
    GJ_OPS_TRY(x);

    switch (inst->prim) {
    case GJ_P_SOFTMAX: { /* y = e * (1 / sum(e)), e = exp(x - max), 1/sum in double */
        gj_val *m, *z, *e, *s;
        if (shifted_exp_sum(b, x, own_rows(b, x, in, inst->n_in), last, &m, &z, &e, &s) != 0)
            return -1;
        gj_val *inv = gj_ag_unary(b, GJ_P_RECIP, s);
        inv = inv ? gj_ag_cast(b, inv, cdt) : NULL;
        r[0] = inv ? gj_ag_binary(b, GJ_P_MUL, e, inv) : NULL;
        break;
    }
    case GJ_P_LOG_SOFTMAX: { /* y = (x - max) - log(sum(exp(x - max))), log in double */
        gj_val *m, *z, *e, *s;
        if (shifted_exp_sum(b, x, own_rows(b, x, in, inst->n_in), last, &m, &z, &e, &s) != 0)
            return -1;
        gj_val *l = gj_ag_unary(b, GJ_P_LOG, s);
        l = l ? gj_ag_cast(b, l, cdt) : NULL;
        r[0] = l ? gj_ag_binary(b, GJ_P_SUB, z, l) : NULL;
        break;
    }
    case GJ_P_SOFTMAX_BWD: { /* (y, gy) -> y * (gy - d), d = sum(gy * y) in double */
        gj_val *gy = gj_ag_cast(b, in[1], cdt);
        gj_val *gyd = gy ? gj_ag_cast(b, gy, GJ_F64) : NULL;
        gj_val *yd = gyd ? gj_ag_cast(b, x, GJ_F64) : NULL;
        gj_val *p = yd ? gj_ag_binary(b, GJ_P_MUL, gyd, yd) : NULL;
        gj_val *s = p ? reduce(b, GJ_P_SUM, p, last, true) : NULL;
        s = s ? gj_ag_cast(b, s, cdt) : NULL;
        gj_val *d = s ? gj_ag_binary(b, GJ_P_SUB, gy, s) : NULL;
        r[0] = d ? gj_ag_binary(b, GJ_P_MUL, x, d) : NULL;
        break;
    }
    case GJ_P_LOG_SOFTMAX_BWD: { /* (y, gy) -> gy - exp(y) * s, s = sum(gy) in double */
        gj_val *gy = gj_ag_cast(b, in[1], cdt);
        gj_val *gyd = gy ? gj_ag_cast(b, gy, GJ_F64) : NULL;
        gj_val *gyr = gyd ? own_rows(b, gyd, in, inst->n_in) : NULL;
        gj_val *s = gyr ? reduce(b, GJ_P_SUM, gyr, last, true) : NULL;
        s = s ? gj_ag_cast(b, s, cdt) : NULL;
        gj_val *e = s ? gj_ag_unary(b, GJ_P_EXP, x) : NULL;
        gj_val *t = e ? gj_ag_binary(b, GJ_P_MUL, e, s) : NULL;
        r[0] = t ? gj_ag_binary(b, GJ_P_SUB, gy, t) : NULL;
        break;
    }
    case GJ_P_LN_FWD: { /* two-pass mean and biased var in double; rstd = 1/sqrt(var + eps) */
        gj_val *xd = gj_ag_cast(b, x, GJ_F64);
        gj_val *xr = xd ? own_rows(b, xd, in, inst->n_in) : NULL;
        gj_val *mu = xr ? row_mean_d(b, xr, last, c) : NULL;
        gj_val *dv = mu ? gj_ag_binary(b, GJ_P_SUB, xd, mu) : NULL;
        gj_val *dd = dv ? gj_ag_binary(b, GJ_P_MUL, dv, dv) : NULL;
        gj_val *var = dd ? row_mean_d(b, dd, last, c) : NULL;
        gj_val *ve = var ? gj_ag_scalar_op(b, GJ_P_ADD_SCALAR, var, inst->scalar) : NULL;
        gj_val *rs = ve ? gj_ag_unary(b, GJ_P_RSQRT, ve) : NULL;
        gj_val *mean = rs ? gj_ag_cast(b, mu, cdt) : NULL;
        gj_val *rstd = mean ? gj_ag_cast(b, rs, cdt) : NULL;
        gj_val *d = rstd ? gj_ag_binary(b, GJ_P_SUB, x, mean) : NULL;
        r[0] = d ? gj_ag_binary(b, GJ_P_MUL, d, rstd) : NULL;
        r[1] = mean;
        r[2] = rstd;
        break;
    }
    case GJ_P_LN_BWD: { /* rstd * ((g - a) - xhat * q), a = mean(g), q = mean(g * xhat) */
        gj_val *mean = gj_ag_cast(b, in[1], cdt);
        gj_val *rstd = gj_ag_cast(b, in[2], cdt);
        gj_val *g = gj_ag_cast(b, in[3], cdt);
        gj_val *d = (mean && rstd && g) ? gj_ag_binary(b, GJ_P_SUB, x, mean) : NULL;
        gj_val *xhat = d ? gj_ag_binary(b, GJ_P_MUL, d, rstd) : NULL;
        gj_val *gd = xhat ? gj_ag_cast(b, g, GJ_F64) : NULL;
        gj_val *gr = gd ? own_rows(b, gd, in, inst->n_in) : NULL;
        gj_val *a = gr ? row_mean_d(b, gr, last, c) : NULL;
        a = a ? gj_ag_cast(b, a, cdt) : NULL;
        gj_val *xd = a ? gj_ag_cast(b, xhat, GJ_F64) : NULL;
        gj_val *gx = xd ? gj_ag_binary(b, GJ_P_MUL, gd, xd) : NULL;
        gj_val *q = gx ? row_mean_d(b, gx, last, c) : NULL;
        q = q ? gj_ag_cast(b, q, cdt) : NULL;
        gj_val *t1 = q ? gj_ag_binary(b, GJ_P_SUB, g, a) : NULL;
        gj_val *t2 = t1 ? gj_ag_binary(b, GJ_P_MUL, xhat, q) : NULL;
        gj_val *t3 = t2 ? gj_ag_binary(b, GJ_P_SUB, t1, t2) : NULL;
        r[0] = t3 ? gj_ag_binary(b, GJ_P_MUL, rstd, t3) : NULL;
        break;
    }
    case GJ_P_CE_FWD: { /* loss = sum_n(lse_n - x[n, label_n]) / N in double; lse[N] */
        int64_t n = im[0].shape[0], k = im[0].shape[1];
        gj_val *m, *z, *e, *s;
        if (shifted_exp_sum(b, x, own_rows(b, x, in, inst->n_in), 2u, &m, &z, &e, &s) != 0)
            return -1;
        gj_val *l = gj_ag_unary(b, GJ_P_LOG, s);
        gj_val *md = l ? gj_ag_cast(b, m, GJ_F64) : NULL;
        gj_val *lse = md ? gj_ag_binary(b, GJ_P_ADD, md, l) : NULL; /* [N, 1] f64 */
        gj_val *oh = lse ? one_hot(b, in[1], n, k, cdt) : NULL;
        gj_val *xd = oh ? gj_ag_cast(b, x, GJ_F64) : NULL;
        gj_val *nll = xd ? gj_ag_binary(b, GJ_P_SUB, lse, xd) : NULL; /* [N, K] */
        gj_val *zero = nll ? gj_ops_const0(b, GJ_F64, 0.0) : NULL;
        gj_val *pick = zero ? gj_ag_where(b, oh, nll, zero) : NULL;
        /* each row's one term (its sum with zeros: exactly the term), then
         * the N terms as a SUM adds a run, the eager kernel's order; row by
         * row, the pick fuses into a parallel row reduction instead of a
         * [N, K] f64 tensor summed on one thread */
        gj_val *row = pick ? reduce(b, GJ_P_SUM, pick, 2u, true) : NULL;
        gj_val *tot = row ? reduce(b, GJ_P_SUM, row, 3u, false) : NULL;
        gj_val *nn = tot ? gj_ops_const0(b, GJ_F64, (double)n) : NULL;
        gj_val *loss = nn ? gj_ag_binary(b, GJ_P_DIV, tot, nn) : NULL;
        r[0] = loss ? gj_ag_cast(b, loss, cdt) : NULL;
        gj_val *lc = r[0] ? gj_ag_cast(b, lse, cdt) : NULL;
        r[1] = lc ? gj_ag_reshape(b, lc, 1, &n) : NULL;
        break;
    }
    case GJ_P_CE_BWD: { /* exp(x - lse) * s, minus s at the label; s = g / N in double */
        int64_t n = im[0].shape[0], k = im[0].shape[1], s2[2] = {n, 1};
        gj_val *lse = gj_ag_cast(b, in[1], cdt);
        lse = lse ? gj_ag_reshape(b, lse, 2, s2) : NULL;
        gj_val *z = lse ? gj_ag_binary(b, GJ_P_SUB, x, lse) : NULL;
        gj_val *p = z ? gj_ag_unary(b, GJ_P_EXP, z) : NULL;
        gj_val *g = p ? gj_ag_cast(b, in[3], cdt) : NULL;
        gj_val *gd = g ? gj_ag_cast(b, g, GJ_F64) : NULL;
        gj_val *nn = gd ? gj_ops_const0(b, GJ_F64, (double)n) : NULL;
        gj_val *sc = nn ? gj_ag_binary(b, GJ_P_DIV, gd, nn) : NULL;
        sc = sc ? gj_ag_cast(b, sc, cdt) : NULL;
        gj_val *t = sc ? gj_ag_binary(b, GJ_P_MUL, p, sc) : NULL;
        gj_val *oh = t ? one_hot(b, in[2], n, k, cdt) : NULL;
        gj_val *tl = oh ? gj_ag_binary(b, GJ_P_SUB, t, sc) : NULL;
        r[0] = tl ? gj_ag_where(b, oh, tl, t) : NULL;
        break;
    }
    default:
        gj_rt_set_error("decompose: %s is not a composite primitive",
                        gj_rt_prim_name(inst->prim));
        return -1;
    }
    for (int k = 0; k < n_out; k++) {
        GJ_OPS_TRY(r[k]);
        gj_rt_meta rm;
        gj_ag_meta(b, r[k], &rm);
        if (rm.ndim != om[k].ndim ||
            memcmp(rm.shape, om[k].shape, (size_t)rm.ndim * sizeof rm.shape[0]) != 0)
            GJ_OPS_TRY(r[k] = gj_ag_reshape(b, r[k], om[k].ndim, om[k].shape));
        GJ_OPS_TRY(outs[k] = gj_ag_cast(b, r[k], om[k].dtype));
    }
    return n_out;
}
