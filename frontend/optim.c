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
#include "../jit/jit.h"
#include "../runtime/gj_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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
    if (n <= 0) {
        gj_rt_set_error("%s: need a non-empty parameter list (n_params = %d)", op, n);
        return NULL;
    }
    if (!params) {
        gj_rt_set_error("%s: params is NULL (n_params = %d)", op, n);
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
        char sp[160], sg[160], nm[160];
        if (!gj_rt_is_contiguous(p) || !gj_rt_dtype_is_float(p->dtype) ||
            !gj_rt_dtype_is_float(g->dtype) || g->numel != p->numel) {
            gj_rt_set_error("%s: parameter %d%s (%s %s) must be a contiguous float tensor with a "
                            "float .grad of the same shape (got %s %s)",
                            op, k, gj_rt_tensor_label(p, nm, sizeof nm), gj_rt_dtype_name(p->dtype),
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

/* -------------------------------------------------- the compiled step */

int gj_fe_optim_n(const gj_optim *o) { return o ? o->n : 0; }

gj_tensor *gj_fe_optim_param(const gj_optim *o, int k) { return o->ps[k].p; }

void gj_fe_optim_describe(const gj_optim *o, gj_jit_opt *out, gj_tensor **s1, gj_tensor **s2,
                          double *hyper) {
    memset(out, 0, sizeof *out);
    out->kind = o->kind == OPT_SGD ? GJ_JIT_OPT_SGD : GJ_JIT_OPT_ADAMW;
    out->n = o->n;
    out->momentum = o->momentum != 0.0;
    out->weight_decay = o->weight_decay != 0.0;
    for (int k = 0; k < o->n; k++) {
        const opt_param *q = &o->ps[k];
        s1[k] = q->s1;
        s2[k] = q->s2;
        double *h = hyper + (size_t)k * GJ_JIT_HYPER;
        memset(h, 0, GJ_JIT_HYPER * sizeof *h);
        /* exactly the doubles gj_optim_step hands its kernel (opt_job) */
        h[GJ_JIT_H_LR] = o->lr;
        h[GJ_JIT_H_MOMENTUM] = o->momentum;
        h[GJ_JIT_H_WD] = o->weight_decay;
        h[GJ_JIT_H_B1C] = 1.0 - o->beta1;
        h[GJ_JIT_H_B2] = o->beta2;
        h[GJ_JIT_H_B2C] = 1.0 - o->beta2;
        h[GJ_JIT_H_EPS] = o->eps;
        if (o->kind == OPT_ADAMW) { /* the step this update will be */
            int64_t t = q->step + 1;
            double bc1 = 1.0 - pow(o->beta1, (double)t);
            double bc2 = 1.0 - pow(o->beta2, (double)t);
            h[GJ_JIT_H_STEP_SIZE] = o->lr / bc1;
            h[GJ_JIT_H_BC2_SQRT] = sqrt(bc2);
            h[GJ_JIT_H_DECAY] = 1.0 - o->lr * o->weight_decay;
        }
    }
    out->params = NULL; /* the caller fills params, s1, s2 (its own arrays) */
}

void gj_fe_optim_updated(gj_optim *o, const bool *updated) {
    for (int k = 0; k < o->n; k++)
        if (updated[k] && o->kind == OPT_ADAMW) o->ps[k].step++;
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

/* ------------------------------------------------------- checkpoints */

/* "<prefix>.<k>.<field>" into buf; false (error set) if it does not fit. */
static bool opt_key(char *buf, size_t cap, const char *op, const char *prefix, int k,
                    const char *field) {
    int n = k >= 0 ? snprintf(buf, cap, "%s.%d.%s", prefix, k, field)
                   : snprintf(buf, cap, "%s.%s", prefix, field);
    if (n < 0 || (size_t)n >= cap) {
        gj_rt_set_error("%s: prefix \"%.100s...\" is too long", op, prefix);
        return false;
    }
    return true;
}

/* The hyperparameters, in the order stored; pointers into o. */
typedef struct opt_hyper {
    const char *name;
    double *v;
} opt_hyper;

static int opt_hypers(gj_optim *o, opt_hyper *h) {
    int n = 0;
    h[n++] = (opt_hyper){"lr", &o->lr};
    h[n++] = (opt_hyper){"weight_decay", &o->weight_decay};
    if (o->kind == OPT_SGD) {
        h[n++] = (opt_hyper){"momentum", &o->momentum};
    } else {
        h[n++] = (opt_hyper){"beta1", &o->beta1};
        h[n++] = (opt_hyper){"beta2", &o->beta2};
        h[n++] = (opt_hyper){"eps", &o->eps};
    }
    return n;
}

int gj_optim_state_dict_add(gj_optim *o, gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_optim_state_dict_add";
    if (!o || !sd) {
        gj_rt_set_error("%s: NULL optimizer or state dict", op);
        return -1;
    }
    if (!prefix)
        prefix = "optim";
    char key[512], val[64];
    if (!opt_key(key, sizeof key, op, prefix, -1, "kind") ||
        gj_state_dict_set_metadata(sd, key, o->kind == OPT_SGD ? "sgd" : "adamw") != 0)
        return -1;
    snprintf(val, sizeof val, "%d", o->n);
    if (!opt_key(key, sizeof key, op, prefix, -1, "n_params") ||
        gj_state_dict_set_metadata(sd, key, val) != 0)
        return -1;
    opt_hyper h[6];
    int nh = opt_hypers(o, h);
    for (int i = 0; i < nh; i++) {
        snprintf(val, sizeof val, "%.17g", *h[i].v); /* round-trips exactly */
        if (!opt_key(key, sizeof key, op, prefix, -1, h[i].name) ||
            gj_state_dict_set_metadata(sd, key, val) != 0)
            return -1;
    }
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        if (!q->s1)
            continue;
        if (o->kind == OPT_SGD) {
            if (!opt_key(key, sizeof key, op, prefix, k, "momentum_buffer") ||
                gj_state_dict_add(sd, key, q->s1) != 0)
                return -1;
            continue;
        }
        if (!opt_key(key, sizeof key, op, prefix, k, "exp_avg") ||
            gj_state_dict_add(sd, key, q->s1) != 0 ||
            !opt_key(key, sizeof key, op, prefix, k, "exp_avg_sq") ||
            gj_state_dict_add(sd, key, q->s2) != 0 ||
            !opt_key(key, sizeof key, op, prefix, k, "step"))
            return -1;
        gj_tensor *st = gj_rt_tensor_new(GJ_I64, 0, NULL);
        if (!st)
            return -1;
        *(int64_t *)gj_rt_data_ptr(st) = q->step;
        int rc = gj_state_dict_add(sd, key, st);
        gj_rt_tensor_release(st); /* the dict holds its own reference */
        if (rc != 0)
            return -1;
    }
    return 0;
}

/* Whether t is a state tensor fit for parameter p (shape and state dtype). */
static bool opt_state_fits(const gj_tensor *t, const gj_tensor *p) {
    if (t->dtype != (p->dtype == GJ_F64 ? GJ_F64 : GJ_F32) || t->ndim != p->ndim)
        return false;
    for (int d = 0; d < p->ndim; d++)
        if (t->shape[d] != p->shape[d])
            return false;
    return true;
}

/* A private contiguous copy of a state tensor. */
static gj_tensor *opt_copy_state(gj_tensor *t) {
    gj_tensor *c = gj_rt_tensor_empty(t->dtype, t->ndim, t->shape);
    if (c && gj_rt_copy_into(c, t) != 0) {
        gj_rt_tensor_release(c);
        return NULL;
    }
    return c;
}

int gj_optim_load_state_dict(gj_optim *o, const gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_optim_load_state_dict";
    if (!o || !sd) {
        gj_rt_set_error("%s: NULL optimizer or state dict", op);
        return -1;
    }
    if (!prefix)
        prefix = "optim";
    const char *kind = o->kind == OPT_SGD ? "sgd" : "adamw";
    int rc = -1;
    gj_fe_msg *m = gj_rt_calloc(1, sizeof *m);
    gj_tensor **n1 = gj_rt_calloc((size_t)o->n, sizeof *n1);
    gj_tensor **n2 = gj_rt_calloc((size_t)o->n, sizeof *n2);
    int64_t *steps = gj_rt_calloc((size_t)o->n, sizeof *steps);
    if (!m || !n1 || !n2 || !steps)
        goto done;
    char key[512];
    /* Kind, parameter count, hyperparameters. */
    if (!opt_key(key, sizeof key, op, prefix, -1, "kind"))
        goto done;
    const char *fk = gj_state_dict_get_metadata(sd, key);
    if (!fk)
        gj_fe_msg_add(m, "missing metadata \"%s\" (this optimizer is \"%s\")", key, kind);
    else if (strcmp(fk, kind) != 0)
        gj_fe_msg_add(m, "\"%s\" is \"%.40s\", this optimizer is \"%s\"", key, fk, kind);
    uint64_t np = 0;
    if (!opt_key(key, sizeof key, op, prefix, -1, "n_params"))
        goto done;
    const char *fn = gj_state_dict_get_metadata(sd, key);
    if (!fn)
        gj_fe_msg_add(m, "missing metadata \"%s\" (this optimizer has %d parameters)", key,
                      o->n);
    else if (gj_fe_meta_u64(sd, key, &np) != 0 || np != (uint64_t)o->n)
        gj_fe_msg_add(m, "\"%s\" is \"%.40s\", this optimizer has %d parameters", key, fn,
                      o->n);
    opt_hyper h[6];
    double hv[6];
    int nh = opt_hypers(o, h);
    for (int i = 0; i < nh; i++) {
        if (!opt_key(key, sizeof key, op, prefix, -1, h[i].name))
            goto done;
        const char *v = gj_state_dict_get_metadata(sd, key);
        char *end = NULL;
        hv[i] = v ? strtod(v, &end) : NAN;
        bool beta = !strncmp(h[i].name, "beta", 4);
        if (!v)
            gj_fe_msg_add(m, "missing metadata \"%s\"", key);
        else if (!v[0] || *end || !isfinite(hv[i]) || hv[i] < 0 || (beta && hv[i] >= 1))
            gj_fe_msg_add(m, "\"%s\" is \"%.40s\", not a finite number in [0, %s)", key, v,
                          beta ? "1" : "inf");
    }
    /* Per-parameter state: shapes and dtypes against the parameters. */
    for (int k = 0; k < o->n; k++) {
        const gj_tensor *p = o->ps[k].p;
        const char *f1 = o->kind == OPT_SGD ? "momentum_buffer" : "exp_avg";
        gj_tensor *t1, *t2 = NULL, *ts = NULL;
        if (!opt_key(key, sizeof key, op, prefix, k, f1))
            goto done;
        t1 = gj_state_dict_get(sd, key);
        char sp[160], st[160];
        if (t1 && !opt_state_fits(t1, p))
            gj_fe_msg_add(m, "\"%s\" is %s %s, parameter %d needs %s %s", key,
                          gj_rt_dtype_name(t1->dtype),
                          gj_rt_fmt_shape(st, sizeof st, t1->ndim, t1->shape), k,
                          p->dtype == GJ_F64 ? "f64" : "f32",
                          gj_rt_fmt_shape(sp, sizeof sp, p->ndim, p->shape));
        if (o->kind == OPT_ADAMW) {
            if (!opt_key(key, sizeof key, op, prefix, k, "exp_avg_sq"))
                goto done;
            t2 = gj_state_dict_get(sd, key);
            if (t2 && !opt_state_fits(t2, p))
                gj_fe_msg_add(m, "\"%s\" is %s %s, parameter %d needs %s %s", key,
                              gj_rt_dtype_name(t2->dtype),
                              gj_rt_fmt_shape(st, sizeof st, t2->ndim, t2->shape), k,
                              p->dtype == GJ_F64 ? "f64" : "f32",
                              gj_rt_fmt_shape(sp, sizeof sp, p->ndim, p->shape));
            if (!opt_key(key, sizeof key, op, prefix, k, "step"))
                goto done;
            ts = gj_state_dict_get(sd, key);
            if (!t1 != !t2 || !t1 != !ts)
                gj_fe_msg_add(m, "parameter %d: exp_avg, exp_avg_sq and step must be given "
                                 "together",
                              k);
            else if (ts && (ts->dtype != GJ_I64 || ts->numel != 1 ||
                            gj_rt_get(ts, 0) < 1))
                gj_fe_msg_add(m, "\"%s\" must be one i64 value >= 1", key);
            else if (ts)
                steps[k] = *(const int64_t *)gj_rt_data_ptr(ts);
        }
        if (m->count == 0 && t1) {
            n1[k] = opt_copy_state(t1);
            n2[k] = t2 ? opt_copy_state(t2) : NULL;
            if (!n1[k] || (t2 && !n2[k]))
                goto done;
        }
    }
    /* Names under the prefix that this optimizer would not have written. */
    size_t pl = strlen(prefix);
    for (int i = 0; i < gj_state_dict_size(sd); i++) {
        const char *nm = gj_state_dict_name(sd, i);
        if (strncmp(nm, prefix, pl) != 0 || nm[pl] != '.')
            continue;
        char *end = NULL;
        long k = strtol(nm + pl + 1, &end, 10);
        bool ok = end != nm + pl + 1 && *end == '.' && k >= 0 && k < o->n;
        if (ok) {
            const char *f = end + 1;
            ok = o->kind == OPT_SGD ? !strcmp(f, "momentum_buffer")
                                    : !strcmp(f, "exp_avg") || !strcmp(f, "exp_avg_sq") ||
                                          !strcmp(f, "step");
        }
        if (!ok)
            gj_fe_msg_add(m, "unexpected \"%.200s\" for a %s optimizer of %d parameters", nm,
                          kind, o->n);
    }
    if (m->count > 0) {
        gj_fe_msg_fail(m, op, "problem", "problems");
        goto done;
    }
    /* Everything checked and copied: swap the state in. */
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        if (q->s1)
            gj_rt_tensor_release(q->s1);
        if (q->s2)
            gj_rt_tensor_release(q->s2);
        q->s1 = n1[k];
        q->s2 = n2[k];
        n1[k] = n2[k] = NULL;
        q->step = steps[k];
    }
    for (int i = 0; i < nh; i++)
        *h[i].v = hv[i];
    rc = 0;
done:
    if (n1 && n2)
        for (int k = 0; k < o->n; k++) {
            if (n1[k])
                gj_rt_tensor_release(n1[k]);
            if (n2[k])
                gj_rt_tensor_release(n2[k]);
        }
    gj_rt_free(m);
    gj_rt_free(n1);
    gj_rt_free(n2);
    gj_rt_free(steps);
    return rc;
}
