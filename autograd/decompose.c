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
 */
#include "autograd/ops_common.h"


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

/* Row-wise max-shifted input and sum of exponentials of x[..., K]:
 * z = x - max(x) and s = sum(exp(z)), both reduced with keepdim. */
static int shifted_exp_sum(gj_ag_builder *b, gj_val *x, uint32_t last, gj_val **z,
                           gj_val **e, gj_val **s) {
    gj_val *m = reduce(b, GJ_P_MAX, x, last, true);
    *z = m ? gj_ag_binary(b, GJ_P_SUB, x, m) : NULL;
    *e = *z ? gj_ag_unary(b, GJ_P_EXP, *z) : NULL;
    *s = *e ? reduce(b, GJ_P_SUM, *e, last, true) : NULL;
    return *s ? 0 : -1;
}

/* Log-sum-exp of logits[N, K] per row, as [N, 1]: log(sum(exp(x - m))) + m. */
static gj_val *row_lse(gj_ag_builder *b, gj_val *x) {
    gj_val *m = reduce(b, GJ_P_MAX, x, 2u, true);
    gj_val *z = m ? gj_ag_binary(b, GJ_P_SUB, x, m) : NULL;
    gj_val *e = z ? gj_ag_unary(b, GJ_P_EXP, z) : NULL;
    gj_val *s = e ? reduce(b, GJ_P_SUM, e, 2u, true) : NULL;
    gj_val *l = s ? gj_ag_unary(b, GJ_P_LOG, s) : NULL;
    return l ? gj_ag_binary(b, GJ_P_ADD, l, m) : NULL;
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
    case GJ_P_SOFTMAX: { /* y = exp(z) / sum(exp(z)) */
        gj_val *z, *e, *s;
        if (shifted_exp_sum(b, x, last, &z, &e, &s) != 0)
            return -1;
        r[0] = gj_ag_binary(b, GJ_P_DIV, e, s);
        break;
    }
    case GJ_P_LOG_SOFTMAX: { /* y = z - log(sum(exp(z))) */
        gj_val *z, *e, *s;
        if (shifted_exp_sum(b, x, last, &z, &e, &s) != 0)
            return -1;
        gj_val *l = gj_ag_unary(b, GJ_P_LOG, s);
        r[0] = l ? gj_ag_binary(b, GJ_P_SUB, z, l) : NULL;
        break;
    }
    case GJ_P_SOFTMAX_BWD: { /* (y, gy) -> y * (gy - sum(gy * y)) */
        gj_val *gy = gj_ag_cast(b, in[1], cdt);
        gj_val *p = gy ? gj_ag_binary(b, GJ_P_MUL, gy, x) : NULL;
        gj_val *s = p ? reduce(b, GJ_P_SUM, p, last, true) : NULL;
        gj_val *d = s ? gj_ag_binary(b, GJ_P_SUB, gy, s) : NULL;
        r[0] = d ? gj_ag_binary(b, GJ_P_MUL, x, d) : NULL;
        break;
    }
    case GJ_P_LOG_SOFTMAX_BWD: { /* (y, gy) -> gy - exp(y) * sum(gy) */
        gj_val *gy = gj_ag_cast(b, in[1], cdt);
        gj_val *s = gy ? reduce(b, GJ_P_SUM, gy, last, true) : NULL;
        gj_val *e = s ? gj_ag_unary(b, GJ_P_EXP, x) : NULL;
        gj_val *t = e ? gj_ag_binary(b, GJ_P_MUL, e, s) : NULL;
        r[0] = t ? gj_ag_binary(b, GJ_P_SUB, gy, t) : NULL;
        break;
    }
    case GJ_P_LN_FWD: { /* mean, var over L; rstd = 1/sqrt(var + eps); xhat */
        gj_val *s = reduce(b, GJ_P_SUM, x, last, true);
        gj_val *mean = s ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, s, 1.0 / (double)c) : NULL;
        gj_val *d = mean ? gj_ag_binary(b, GJ_P_SUB, x, mean) : NULL;
        gj_val *dd = d ? gj_ag_binary(b, GJ_P_MUL, d, d) : NULL;
        gj_val *vs = dd ? reduce(b, GJ_P_SUM, dd, last, true) : NULL;
        gj_val *var = vs ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, vs, 1.0 / (double)c) : NULL;
        gj_val *ve = var ? gj_ag_scalar_op(b, GJ_P_ADD_SCALAR, var, inst->scalar) : NULL;
        gj_val *rstd = ve ? gj_ag_unary(b, GJ_P_RSQRT, ve) : NULL;
        r[0] = rstd ? gj_ag_binary(b, GJ_P_MUL, d, rstd) : NULL;
        r[1] = mean;
        r[2] = rstd;
        break;
    }
    case GJ_P_LN_BWD: { /* rstd * (g - mean(g) - xhat * mean(g * xhat)) */
        gj_val *mean = gj_ag_cast(b, in[1], cdt);
        gj_val *rstd = gj_ag_cast(b, in[2], cdt);
        gj_val *g = gj_ag_cast(b, in[3], cdt);
        gj_val *d = (mean && rstd && g) ? gj_ag_binary(b, GJ_P_SUB, x, mean) : NULL;
        gj_val *xhat = d ? gj_ag_binary(b, GJ_P_MUL, d, rstd) : NULL;
        gj_val *sg = xhat ? reduce(b, GJ_P_SUM, g, last, true) : NULL;
        gj_val *mg = sg ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, sg, 1.0 / (double)c) : NULL;
        gj_val *gx = mg ? gj_ag_binary(b, GJ_P_MUL, g, xhat) : NULL;
        gj_val *sgx = gx ? reduce(b, GJ_P_SUM, gx, last, true) : NULL;
        gj_val *mgx = sgx ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, sgx, 1.0 / (double)c) : NULL;
        gj_val *t1 = mgx ? gj_ag_binary(b, GJ_P_SUB, g, mg) : NULL;
        gj_val *t2 = t1 ? gj_ag_binary(b, GJ_P_MUL, xhat, mgx) : NULL;
        gj_val *t3 = t2 ? gj_ag_binary(b, GJ_P_SUB, t1, t2) : NULL;
        r[0] = t3 ? gj_ag_binary(b, GJ_P_MUL, t3, rstd) : NULL;
        break;
    }
    case GJ_P_CE_FWD: { /* loss = mean_n(lse_n - x[n, label_n]); lse[N] */
        int64_t n = im[0].shape[0], k = im[0].shape[1];
        gj_val *lse = row_lse(b, x); /* [N, 1] */
        gj_val *oh = lse ? one_hot(b, in[1], n, k, cdt) : NULL;
        gj_val *nll = oh ? gj_ag_binary(b, GJ_P_SUB, lse, x) : NULL; /* [N, K] */
        gj_val *z = nll ? gj_ops_const0(b, cdt, 0.0) : NULL;
        gj_val *pick = z ? gj_ag_where(b, oh, nll, z) : NULL;
        gj_val *tot = pick ? reduce(b, GJ_P_SUM, pick, 3u, false) : NULL;
        r[0] = tot ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, tot, 1.0 / (double)n) : NULL;
        r[1] = r[0] ? gj_ag_reshape(b, lse, 1, &n) : NULL;
        break;
    }
    case GJ_P_CE_BWD: { /* (softmax(x) - onehot) * g / N, softmax = exp(x - lse) */
        int64_t n = im[0].shape[0], k = im[0].shape[1], s2[2] = {n, 1};
        gj_val *lse = gj_ag_cast(b, in[1], cdt);
        lse = lse ? gj_ag_reshape(b, lse, 2, s2) : NULL;
        gj_val *z = lse ? gj_ag_binary(b, GJ_P_SUB, x, lse) : NULL;
        gj_val *p = z ? gj_ag_unary(b, GJ_P_EXP, z) : NULL;
        gj_val *oh = p ? one_hot(b, in[2], n, k, cdt) : NULL;
        gj_val *d = oh ? gj_ag_binary(b, GJ_P_SUB, p, oh) : NULL;
        gj_val *g = d ? gj_ag_cast(b, in[3], cdt) : NULL;
        gj_val *gs = g ? gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, g, 1.0 / (double)n) : NULL;
        r[0] = gs ? gj_ag_binary(b, GJ_P_MUL, d, gs) : NULL;
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
