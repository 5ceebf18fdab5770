/* SPDX-License-Identifier: MIT */
/*
 * train.c - training utilities around backward: global gradient-norm
 * clipping and learning-rate schedules, as torch.nn.utils.clip_grad_norm_
 * and torch.optim.lr_scheduler compute them.
 *
 * Invariants: clipping reads every .grad first (f64 sum of squares, in
 * parameter order, each .grad in row-major order) and scales them only
 * after the norm is known and finite, so a failure changes no gradient;
 * the schedules are pure functions of their arguments.
 */
#include "fe.h"

#include <math.h>

int gj_clip_grad_norm(int n, gj_tensor *const *params, double max_norm, double *total_norm) {
    GJ_FE_TRACE_UNTRACEABLE("gj_clip_grad_norm");
    const char *op = "gj_clip_grad_norm";
    if (total_norm) *total_norm = NAN;
    if (n < 0 || (n > 0 && !params)) {
        gj_rt_set_error("%s: %d parameters at %p", op, n, (const void *)params);
        return -1;
    }
    if (!(max_norm > 0.0) || !isfinite(max_norm)) {
        gj_rt_set_error("%s: max_norm must be finite and > 0 (got %g)", op, max_norm);
        return -1;
    }
    /* the sum of squares per parameter in f64 by the SUM kernel (its
     * order: what the compiled step's fused sum reproduces), then the
     * parameters' sums in order */
    double ss = 0.0;
    for (int k = 0; k < n; k++) {
        if (!params[k]) {
            gj_rt_set_error("%s: parameter %d is NULL", op, k);
            return -1;
        }
        gj_tensor *g = gj_tensor_grad(params[k]);
        if (!g) continue; /* no gradient this step: skipped, as in PyTorch */
        if (!gj_rt_dtype_is_float(g->dtype)) {
            char nm[160];
            gj_rt_set_error("%s: .grad of parameter %d%s is %s, not a float dtype", op, k,
                            gj_rt_tensor_label(params[k], nm, sizeof nm),
                            gj_rt_dtype_name(g->dtype));
            return -1;
        }
        gj_scope_push();
        gj_no_grad_push();
        gj_tensor *d = gj_cast(g, GJ_F64);
        gj_tensor *s = d ? gj_sum(gj_mul(d, d), 0, NULL, false) : NULL;
        double v = s ? gj_tensor_item(s) : NAN;
        gj_no_grad_pop();
        gj_scope_pop();
        if (!s) return -1;
        ss += v;
    }
    double norm = sqrt(ss);
    if (total_norm) *total_norm = norm;
    if (!isfinite(norm)) {
        gj_rt_set_error("%s: the total gradient norm is %g: gradients left as they are", op,
                        norm);
        return -1;
    }
    double coef = max_norm / (norm + 1e-6);
    if (coef >= 1.0) return 0;
    for (int k = 0; k < n; k++) {
        gj_tensor *g = gj_tensor_grad(params[k]);
        if (g && gj_mul_scalar_(g, coef) != 0) return -1;
    }
    return 0;
}

double gj_lr_step(double base_lr, int64_t step, int64_t step_size, double gamma) {
    if (step < 0 || step_size <= 0 || !isfinite(base_lr) || !isfinite(gamma)) {
        gj_rt_set_error("gj_lr_step: step %lld, step_size %lld (> 0), base_lr %g and gamma %g "
                        "(finite) are required",
                        (long long)step, (long long)step_size, base_lr, gamma);
        return NAN;
    }
    return base_lr * pow(gamma, (double)(step / step_size));
}

double gj_lr_cosine(double base_lr, int64_t step, int64_t warmup, int64_t total, double min_lr) {
    if (step < 0 || warmup < 0 || total <= warmup || !isfinite(base_lr) || !isfinite(min_lr)) {
        gj_rt_set_error("gj_lr_cosine: needs step >= 0, 0 <= warmup < total and finite rates "
                        "(got step %lld, warmup %lld, total %lld, base_lr %g, min_lr %g)",
                        (long long)step, (long long)warmup, (long long)total, base_lr, min_lr);
        return NAN;
    }
    if (step < warmup) return base_lr * (double)(step + 1) / (double)warmup;
    double t = (double)(step - warmup) / (double)(total - warmup);
    if (t > 1.0) t = 1.0;
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + cos(M_PI * t));
}

/* Index of the largest of v[0..n) with stride s; NaN counts as the
 * largest, and the first of equal values wins (torch.argmax). */
static int64_t argmax_run(const double *v, int64_t n, int64_t s) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++) {
        double a = v[i * s], b = v[best * s];
        if (b != b) break; /* a NaN already won */
        if (a != a || a > b) best = i;
    }
    return best;
}

gj_tensor *gj_argmax(gj_tensor *x, int axis, bool keepdim) {
    if (x) GJ_FE_TRACE_READ(x, "gj_argmax", false);
    const char *op = "gj_argmax";
    if (!gj_rt_check_tensor(x, op, "x")) return gj_fe_fail();
    int nd = x->ndim;
    if (nd == 0 || axis < -nd || axis >= nd) {
        gj_rt_set_error("%s: axis %d out of range for a %d-d tensor", op, axis, nd);
        return gj_fe_fail();
    }
    if (!gj_rt_dtype_is_float(x->dtype)) {
        gj_rt_set_error("%s: x is %s, not a float dtype", op, gj_rt_dtype_name(x->dtype));
        return gj_fe_fail();
    }
    if (axis < 0) axis += nd;
    if (x->shape[axis] == 0) {
        gj_rt_set_error("%s: axis %d of x has size 0", op, axis);
        return gj_fe_fail();
    }
    int64_t outer = 1, len = x->shape[axis], inner = 1;
    for (int d = 0; d < axis; d++) outer *= x->shape[d];
    for (int d = axis + 1; d < nd; d++) inner *= x->shape[d];
    double *v = gj_rt_malloc((size_t)(x->numel > 0 ? x->numel : 1) * sizeof *v);
    int64_t *idx = gj_rt_malloc((size_t)(outer * inner > 0 ? outer * inner : 1) * sizeof *idx);
    gj_tensor *out = NULL;
    if (!v || !idx || gj_tensor_to_f64(x, v) != 0) goto done;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++)
            idx[o * inner + i] = argmax_run(v + o * len * inner + i, len, inner);
    int64_t shape[GJ_MAX_DIMS];
    int on = 0;
    for (int d = 0; d < nd; d++) {
        if (d == axis && !keepdim) continue;
        shape[on++] = d == axis ? 1 : x->shape[d];
    }
    out = gj_from_data(GJ_I64, on, shape, idx);
done:
    gj_rt_free(v);
    gj_rt_free(idx);
    return out;
}

double gj_accuracy(gj_tensor *logits, gj_tensor *labels) {
    if (logits) GJ_FE_TRACE_READ(logits, "gj_accuracy", false);
    const char *op = "gj_accuracy";
    if (!gj_rt_check_tensor(logits, op, "logits") || !gj_rt_check_tensor(labels, op, "labels"))
        return NAN;
    if (logits->ndim != 2 || labels->ndim != 1 || labels->dtype != GJ_I64 ||
        labels->shape[0] != logits->shape[0] || logits->shape[0] == 0) {
        char a[96], b[96];
        gj_rt_set_error("%s: needs logits [N, K] (N > 0) and i64 labels [N]; got logits %s %s, "
                        "labels %s %s",
                        op, gj_rt_fmt_shape(a, sizeof a, logits->ndim, logits->shape),
                        gj_rt_dtype_name(logits->dtype),
                        gj_rt_fmt_shape(b, sizeof b, labels->ndim, labels->shape),
                        gj_rt_dtype_name(labels->dtype));
        return NAN;
    }
    gj_tensor *pred = gj_argmax(logits, 1, false);
    if (!pred || gj_rt_present(pred) != 0) { /* (abstract: no values) */
        gj_release(pred);
        return NAN;
    }
    int64_t n = logits->shape[0], hit = 0;
    const int64_t *p = gj_rt_data_ptr(pred);
    for (int64_t i = 0; i < n; i++) hit += p[i] == (int64_t)gj_tensor_item_at(labels, i);
    gj_release(pred);
    return (double)hit / (double)n;
}
