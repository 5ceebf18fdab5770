/* SPDX-License-Identifier: MIT */
/*
 * optim.c - optimizers: SGD (momentum, weight decay) and AdamW, with the
 * update rules of torch.optim (defaults: dampening 0, no nesterov, no
 * amsgrad, not maximize).
 *
 * Invariants:
 *   - The optimizer holds one reference to each parameter (the caller's
 *     kind, never a scope's) and owns its state tensors, allocated lazily at
 *     the first step where the parameter has a .grad: SGD's momentum buffer,
 *     AdamW's exp_avg / exp_avg_sq and its per-parameter step count. A
 *     parameter whose .grad is NULL is skipped (its state and step count do
 *     not move), like PyTorch.
 *   - Updates are in place on the parameter's storage, outside autograd
 *     (no node is recorded, grad mode is irrelevant), and bump its version.
 *   - Math runs in f64 for f64 parameters and in f32 for f32 and bf16
 *     parameters; state is f64 for f64 parameters and f32 otherwise (bf16
 *     parameters keep f32 state, more precise than PyTorch's bf16 state).
 *     .grad may have any float dtype (e.g. f32 grads of bf16 params).
 *   - gj_optim_step validates every parameter and allocates every state
 *     before updating anything, so a failed step changes nothing.
 */
#include "fe.h"
#include "../runtime/gj_math.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

typedef enum opt_kind { OPT_SGD = 0, OPT_ADAMW = 1 } opt_kind;

typedef struct opt_param {
    gj_tensor *p;       /* retained */
    gj_tensor *s1, *s2; /* SGD: momentum buffer (s1); AdamW: exp_avg, exp_avg_sq */
    int64_t step;       /* AdamW: steps this parameter took */
} opt_param;

struct gj_optim {
    opt_kind kind;
    int n;
    opt_param *ps; /* [n] */
    double lr, momentum, weight_decay, beta1, beta2, eps;
};

/* ------------------------------------------------------- conversions */

/* Elements [i0, i0 + n) of a contiguous float buffer of dtype dt. */
static void opt_load_f(const void *base, gj_dtype dt, int64_t i0, int n, float *out) {
    if (dt == GJ_F32) {
        memcpy(out, (const float *)base + i0, (size_t)n * sizeof *out);
    } else if (dt == GJ_F64) {
        const double *s = (const double *)base + i0;
        for (int k = 0; k < n; k++)
            out[k] = (float)s[k];
    } else {
        const uint16_t *s = (const uint16_t *)base + i0;
        for (int k = 0; k < n; k++)
            out[k] = gj_m_bf16_to_f32(s[k]);
    }
}

static void opt_load_d(const void *base, gj_dtype dt, int64_t i0, int n, double *out) {
    if (dt == GJ_F64) {
        memcpy(out, (const double *)base + i0, (size_t)n * sizeof *out);
    } else if (dt == GJ_F32) {
        const float *s = (const float *)base + i0;
        for (int k = 0; k < n; k++)
            out[k] = s[k];
    } else {
        const uint16_t *s = (const uint16_t *)base + i0;
        for (int k = 0; k < n; k++)
            out[k] = gj_m_bf16_to_f32(s[k]);
    }
}

/* Stores into an f32 or bf16 buffer. */
static void opt_store_f(void *base, gj_dtype dt, int64_t i0, int n, const float *in) {
    if (dt == GJ_F32) {
        memcpy((float *)base + i0, in, (size_t)n * sizeof *in);
    } else {
        uint16_t *d = (uint16_t *)base + i0;
        for (int k = 0; k < n; k++)
            d[k] = gj_m_f32_to_bf16(in[k]);
    }
}

/* ----------------------------------------------------------- kernels */

#define OPT_CHUNK 256

/* One parameter's update, split over the thread pool by element range. */
typedef struct opt_job {
    opt_kind kind;
    void *p;          /* param data, dtype pdt, contiguous */
    gj_dtype pdt;
    const void *g;    /* grad data, dtype gdt, contiguous */
    gj_dtype gdt;
    void *s1, *s2;    /* state, f64 if pdt == f64 else f32 */
    bool first;       /* SGD: momentum buffer just created (buf = g) */
    double lr, momentum, wd, beta1, beta2, eps;
    double step_size; /* AdamW: lr / bias_correction1 */
    double bc2_sqrt;  /* AdamW: sqrt(bias_correction2) */
    double decay;     /* AdamW: 1 - lr * weight_decay */
} opt_job;

/* The update in compute type T over [begin, end): loads a chunk of param,
 * grad and state into T buffers, updates, stores back. */
#define OPT_DEFINE_RANGE(NAME, T, LOAD, STORE_P, SQRT)                                      \
    static void NAME(void *ctx, int64_t begin, int64_t end) {                               \
        const opt_job *j = ctx;                                                             \
        T p[OPT_CHUNK], g[OPT_CHUNK];                                                       \
        T *s1 = j->s1, *s2 = j->s2;                                                         \
        const T lr = (T)j->lr, mom = (T)j->momentum, wd = (T)j->wd;                         \
        const T b1c = (T)(1.0 - j->beta1), b2 = (T)j->beta2, b2c = (T)(1.0 - j->beta2);     \
        const T eps = (T)j->eps, ss = (T)j->step_size, bc2s = (T)j->bc2_sqrt;               \
        const T decay = (T)j->decay;                                                        \
        for (int64_t i0 = begin; i0 < end; i0 += OPT_CHUNK) {                               \
            int n = (int)(end - i0 < OPT_CHUNK ? end - i0 : OPT_CHUNK);                     \
            LOAD(j->p, j->pdt, i0, n, p);                                                   \
            LOAD(j->g, j->gdt, i0, n, g);                                                   \
            if (j->kind == OPT_SGD) {                                                       \
                for (int k = 0; k < n; k++) {                                               \
                    T d = g[k];                                                             \
                    if (j->wd != 0.0)                                                       \
                        d = d + wd * p[k];                                                  \
                    if (j->momentum != 0.0) {                                               \
                        T *b = &s1[i0 + k];                                                 \
                        *b = j->first ? d : mom * *b + d;                                   \
                        d = *b;                                                             \
                    }                                                                       \
                    p[k] = p[k] - lr * d;                                                   \
                }                                                                           \
            } else {                                                                        \
                for (int k = 0; k < n; k++) {                                               \
                    T *m = &s1[i0 + k], *v = &s2[i0 + k];                                   \
                    T pk = p[k] * decay;                                                    \
                    *m = *m + b1c * (g[k] - *m); /* lerp, as torch */                       \
                    *v = *v * b2 + b2c * g[k] * g[k];                                       \
                    T denom = SQRT(*v) / bc2s + eps;                                        \
                    p[k] = pk - ss * (*m / denom);                                          \
                }                                                                           \
            }                                                                               \
            STORE_P(j->p, j->pdt, i0, n, p);                                                \
        }                                                                                   \
    }

static void opt_store_d(void *base, gj_dtype dt, int64_t i0, int n, const double *in) {
    (void)dt; /* f64 parameters only */
    memcpy((double *)base + i0, in, (size_t)n * sizeof *in);
}

OPT_DEFINE_RANGE(opt_range_f32, float, opt_load_f, opt_store_f, sqrtf)
OPT_DEFINE_RANGE(opt_range_f64, double, opt_load_d, opt_store_d, sqrt)

/* ------------------------------------------------------ construction */

static gj_optim *opt_new(const char *op, opt_kind kind, int n, gj_tensor *const *params) {
    if (n <= 0 || !params) {
        gj_rt_set_error("%s: need a non-empty parameter list (n_params = %d)", op, n);
        return NULL;
    }
    for (int k = 0; k < n; k++) {
        const gj_tensor *p = params[k];
        char arg[32]; /* "params[1] is NULL (caused by: ...)": the cause is kept */
        snprintf(arg, sizeof arg, "params[%d]", k);
        if (!gj_rt_check_tensor(p, op, arg)) return NULL;
        if (!gj_rt_dtype_is_float(p->dtype)) {
            gj_rt_set_error("%s: params[%d] must be a float tensor, got %s", op, k,
                            gj_rt_dtype_name(p->dtype));
            return NULL;
        }
        for (int j = 0; j < k; j++) {
            if (params[j] == p) {
                gj_rt_set_error("%s: params[%d] and params[%d] are the same tensor", op, j, k);
                return NULL;
            }
        }
    }
    gj_optim *o = gj_rt_calloc(1, sizeof *o);
    if (!o)
        return NULL;
    o->ps = gj_rt_calloc((size_t)n, sizeof *o->ps);
    if (!o->ps) {
        gj_rt_free(o);
        return NULL;
    }
    o->kind = kind;
    o->n = n;
    for (int k = 0; k < n; k++) {
        gj_rt_tensor_retain(params[k]);
        o->ps[k].p = params[k];
    }
    return o;
}

static bool opt_hyper_ok(const char *op, const char *name, double v, double lo, double hi,
                         bool hi_open) {
    if (v >= lo && (hi_open ? v < hi : v <= hi))
        return true;
    gj_rt_set_error("%s: %s = %g is out of range %s%g, %g%s", op, name, v, "[", lo, hi,
                    hi_open ? ")" : "]");
    return false;
}

gj_optim *gj_sgd_new(int n_params, gj_tensor *const *params, double lr, double momentum,
                     double weight_decay) {
    const char *op = "gj_sgd_new";
    if (!opt_hyper_ok(op, "lr", lr, 0.0, INFINITY, true) ||
        !opt_hyper_ok(op, "momentum", momentum, 0.0, INFINITY, true) ||
        !opt_hyper_ok(op, "weight_decay", weight_decay, 0.0, INFINITY, true))
        return NULL;
    gj_optim *o = opt_new(op, OPT_SGD, n_params, params);
    if (!o)
        return NULL;
    o->lr = lr;
    o->momentum = momentum;
    o->weight_decay = weight_decay;
    return o;
}

gj_optim *gj_adamw_new(int n_params, gj_tensor *const *params, double lr, double beta1,
                       double beta2, double eps, double weight_decay) {
    const char *op = "gj_adamw_new";
    if (!opt_hyper_ok(op, "lr", lr, 0.0, INFINITY, true) ||
        !opt_hyper_ok(op, "beta1", beta1, 0.0, 1.0, true) ||
        !opt_hyper_ok(op, "beta2", beta2, 0.0, 1.0, true) ||
        !opt_hyper_ok(op, "eps", eps, 0.0, INFINITY, true) ||
        !opt_hyper_ok(op, "weight_decay", weight_decay, 0.0, INFINITY, true))
        return NULL;
    gj_optim *o = opt_new(op, OPT_ADAMW, n_params, params);
    if (!o)
        return NULL;
    o->lr = lr;
    o->beta1 = beta1;
    o->beta2 = beta2;
    o->eps = eps;
    o->weight_decay = weight_decay;
    return o;
}

/* -------------------------------------------------------------- step */

/* A new zeroed state tensor for parameter p. */
static gj_tensor *opt_state(const gj_tensor *p) {
    return gj_rt_tensor_new(p->dtype == GJ_F64 ? GJ_F64 : GJ_F32, p->ndim, p->shape);
}

int gj_optim_step(gj_optim *o) {
    const char *op = "gj_optim_step";
    if (!o) {
        gj_rt_set_error("%s: optimizer is NULL", op);
        return -1;
    }
    int rc = -1;
    gj_tensor **grads = gj_rt_calloc((size_t)o->n, sizeof *grads); /* contiguous, owned */
    bool *fresh = gj_rt_calloc((size_t)o->n, sizeof *fresh);
    if (!grads || !fresh)
        goto done;
    /* Pass 1: validate, make grads contiguous, allocate missing state. */
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        gj_tensor *p = q->p, *g = gj_tensor_grad(p);
        if (!g)
            continue;
        char sp[160], sg[160];
        if (!gj_rt_is_contiguous(p) || !gj_rt_dtype_is_float(p->dtype) ||
            !gj_rt_dtype_is_float(g->dtype) || g->numel != p->numel) {
            gj_rt_set_error("%s: parameter %d (%s %s) must be a contiguous float tensor with a "
                            "float .grad of the same shape (got %s %s)",
                            op, k, gj_rt_dtype_name(p->dtype),
                            gj_rt_fmt_shape(sp, sizeof sp, p->ndim, p->shape),
                            gj_rt_dtype_name(g->dtype),
                            gj_rt_fmt_shape(sg, sizeof sg, g->ndim, g->shape));
            goto done;
        }
        if (!(grads[k] = gj_rt_contiguous(g)))
            goto done;
        bool need2 = o->kind == OPT_ADAMW;
        bool need1 = need2 || o->momentum != 0.0;
        if (need1 && !q->s1) {
            if (!(q->s1 = opt_state(p)))
                goto done;
            fresh[k] = true;
        }
        if (need2 && !q->s2 && !(q->s2 = opt_state(p)))
            goto done;
    }
    /* Pass 2: update. */
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        if (!grads[k])
            continue;
        opt_job j = {
            .kind = o->kind,
            .p = gj_rt_data_ptr(q->p),
            .pdt = q->p->dtype,
            .g = gj_rt_data_ptr(grads[k]),
            .gdt = grads[k]->dtype,
            .s1 = q->s1 ? gj_rt_data_ptr(q->s1) : NULL,
            .s2 = q->s2 ? gj_rt_data_ptr(q->s2) : NULL,
            .first = fresh[k],
            .lr = o->lr,
            .momentum = o->momentum,
            .wd = o->weight_decay,
            .beta1 = o->beta1,
            .beta2 = o->beta2,
            .eps = o->eps,
        };
        if (o->kind == OPT_ADAMW) {
            q->step++;
            double bc1 = 1.0 - pow(o->beta1, (double)q->step);
            double bc2 = 1.0 - pow(o->beta2, (double)q->step);
            j.step_size = o->lr / bc1;
            j.bc2_sqrt = sqrt(bc2);
            j.decay = 1.0 - o->lr * o->weight_decay;
        }
        gj_rt_parallel_for(q->p->numel, 1 << 14,
                           q->p->dtype == GJ_F64 ? opt_range_f64 : opt_range_f32, &j);
        gj_rt_bump_version(q->p);
    }
    rc = 0;
done:
    if (grads)
        for (int k = 0; k < o->n; k++)
            if (grads[k])
                gj_rt_tensor_release(grads[k]);
    gj_rt_free(grads);
    gj_rt_free(fresh);
    return rc;
}

void gj_optim_zero_grad(gj_optim *o) {
    if (!o)
        return;
    for (int k = 0; k < o->n; k++)
        gj_tensor_set_grad(o->ps[k].p, NULL);
}

void gj_optim_set_lr(gj_optim *o, double lr) {
    if (!o)
        return;
    if (!(lr >= 0.0)) {
        gj_rt_set_error("gj_optim_set_lr: lr = %g must be >= 0", lr);
        return;
    }
    o->lr = lr;
}

void gj_optim_free(gj_optim *o) {
    if (!o)
        return;
    for (int k = 0; k < o->n; k++) {
        gj_rt_tensor_release(o->ps[k].p);
        if (o->ps[k].s1)
            gj_rt_tensor_release(o->ps[k].s1);
        if (o->ps[k].s2)
            gj_rt_tensor_release(o->ps[k].s2);
    }
    gj_rt_free(o->ps);
    gj_rt_free(o);
}
