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
    double ss = 0.0;
    for (int k = 0; k < n; k++) {
        if (!params[k]) {
            gj_rt_set_error("%s: parameter %d is NULL", op, k);
            return -1;
        }
        gj_tensor *g = gj_tensor_grad(params[k]);
        if (!g) continue; /* no gradient this step: skipped, as in PyTorch */
        if (!gj_rt_dtype_is_float(g->dtype)) {
            gj_rt_set_error("%s: .grad of parameter %d is %s, not a float dtype", op, k,
                            gj_rt_dtype_name(g->dtype));
            return -1;
        }
        for (int64_t i = 0; i < g->numel; i++) {
            double v = gj_tensor_item_at(g, i);
            ss += v * v;
        }
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
