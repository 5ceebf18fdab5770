/* SPDX-License-Identifier: MIT */
/*
 * optim.c - optimizers (gj_optim): SGD (momentum, weight decay), AdamW and
 * Lion, with the update rules of torch.optim (defaults: dampening 0, no
 * nesterov, no amsgrad, not maximize) and of Lion's reference code. Each
 * rule is written once, in autograd/optim_<name>.c (a gj_ag_optdef): this
 * file keeps the parameters, the state and the configuration, runs the
 * rule eagerly (gj_ag_opt_apply) and describes it to the compiled step.
 *
 * Invariants:
 *   - The optimizer holds one reference to each parameter (the caller's
 *     kind, never a scope's) and owns its state tensors, allocated lazily
 *     (zero-filled) at the first step where the parameter has a .grad, and
 *     for counting rules (AdamW) its per-parameter step count. A parameter
 *     whose .grad is NULL is skipped (its state and step count do not
 *     move), like PyTorch.
 *   - Updates are in place on the parameter's storage, outside autograd
 *     (no node is recorded, grad mode is irrelevant), and bump its version.
 *   - Math runs in f64 for f64 parameters and in f32 for f32 and bf16
 *     parameters; state is f64 for f64 parameters and f32 otherwise (bf16
 *     parameters keep f32 state, more precise than PyTorch's bf16 state).
 *     .grad may have any float dtype (e.g. f32 grads of bf16 params).
 *   - gj_optim_step validates every parameter and allocates every state
 *     before updating anything, so a failed step changes nothing.
 *   - cfg[] is the rule's configuration in its checkpoint order: lr first,
 *     weight_decay second.
 */
#include "fe.h"
#include "../jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct opt_param {
    gj_tensor *p;                         /* retained */
    gj_tensor *s[GJ_AG_OPT_MAX_STATE];    /* the rule's state tensors (owned), NULL until used */
    int64_t step;                         /* counting rules: updates this parameter took */
} opt_param;

struct gj_optim {
    const gj_ag_optdef *def;
    int n;
    opt_param *ps; /* [n] */
    double cfg[GJ_AG_OPT_MAX_CFG];
};

/* ------------------------------------------------------ construction */

static gj_optim *opt_new(const char *op, const gj_ag_optdef *def, int n, gj_tensor *const *params,
                         const double *cfg) {
    for (int i = 0; i < def->n_cfg; i++) {
        double v = cfg[i], lo = def->cfg_lo[i], hi = def->cfg_hi[i];
        if (v >= lo && (def->cfg_hi_open[i] ? v < hi : v <= hi)) continue;
        gj_rt_set_error("%s: %s = %g is out of range [%g, %g%s", op, def->cfg_names[i], v, lo, hi,
                        def->cfg_hi_open[i] ? ")" : "]");
        return NULL;
    }
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
    if (!o) return NULL;
    o->ps = gj_rt_calloc((size_t)n, sizeof *o->ps);
    if (!o->ps) {
        gj_rt_free(o);
        return NULL;
    }
    o->def = def;
    o->n = n;
    memcpy(o->cfg, cfg, (size_t)def->n_cfg * sizeof *cfg);
    for (int k = 0; k < n; k++) {
        gj_rt_tensor_retain(params[k]);
        o->ps[k].p = params[k];
    }
    return o;
}

gj_optim *gj_sgd_new(int n_params, gj_tensor *const *params, double lr, double momentum,
                     double weight_decay) {
    const double cfg[] = {lr, weight_decay, momentum};
    return opt_new("gj_sgd_new", &gj_ag_opt_sgd, n_params, params, cfg);
}

gj_optim *gj_adamw_new(int n_params, gj_tensor *const *params, double lr, double beta1,
                       double beta2, double eps, double weight_decay) {
    const double cfg[] = {lr, weight_decay, beta1, beta2, eps};
    return opt_new("gj_adamw_new", &gj_ag_opt_adamw, n_params, params, cfg);
}

gj_optim *gj_lion_new(int n_params, gj_tensor *const *params, double lr, double beta1,
                      double beta2, double weight_decay) {
    const double cfg[] = {lr, weight_decay, beta1, beta2};
    return opt_new("gj_lion_new", &gj_ag_opt_lion, n_params, params, cfg);
}

/* -------------------------------------------------------------- step */

/* A new state tensor for parameter p (in the rule's compute type), its
 * bytes undefined: zeros by its first writer (see opt_make_state). */
static gj_tensor *opt_state(const gj_tensor *p) {
    return gj_rt_tensor_empty(gj_ag_opt_dtype(p->dtype), p->ndim, p->shape);
}

/* Parameter q's missing state tensors for structure s; bit i of *zero set
 * for each one made: it stands for zeros until the update writes it
 * (gj_ag_opt_apply), or opt_settle zero-fills it. 0 or -1. */
static int opt_make_state(const gj_optim *o, opt_param *q, uint32_t s, unsigned *zero) {
    for (int i = 0; i < o->def->n_state; i++) {
        if (!o->def->uses_state(s, i) || q->s[i]) continue;
        if (!(q->s[i] = opt_state(q->p))) return -1;
        *zero |= 1u << i;
    }
    return 0;
}

/* Zero-fills q's state tensors named by zero (made, never written). */
static void opt_settle(opt_param *q, unsigned zero) {
    for (int i = 0; i < GJ_AG_OPT_MAX_STATE; i++)
        if ((zero & (1u << i)) && q->s[i])
            gj_rt_zero_fill(gj_rt_data_ptr(q->s[i]),
                            (size_t)q->s[i]->numel * gj_rt_dtype_size(q->s[i]->dtype));
}

int gj_optim_step(gj_optim *o) {
    const char *op = "gj_optim_step";
    if (!o) {
        gj_rt_set_error("%s: optimizer is NULL", op);
        return -1;
    }
    const gj_ag_optdef *def = o->def;
    uint32_t s = def->structure(o->cfg);
    int rc = -1;
    gj_tensor **grads = gj_rt_calloc((size_t)o->n, sizeof *grads); /* contiguous, owned */
    unsigned *zero = gj_rt_calloc((size_t)o->n + 1, sizeof *zero); /* state made now, unwritten */
    if (!grads || !zero) goto done;
    /* Pass 1: validate, make grads contiguous, allocate missing state. */
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        gj_tensor *p = q->p, *g = gj_tensor_grad(p);
        if (!g) continue;
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
        if (!(grads[k] = gj_rt_contiguous(g)) || opt_make_state(o, q, s, &zero[k]) != 0)
            goto done;
    }
    /* Pass 2: update. */
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        if (!grads[k]) continue;
        double h[GJ_AG_OPT_MAX_HYPER];
        def->hyper(o->cfg, q->step + 1, h);
        if (gj_ag_opt_apply(def, s, h, q->p, grads[k], q->s, &zero[k]) != 0) goto done;
        if (def->counts_steps) q->step++;
        gj_rt_bump_version(q->p);
    }
    rc = 0;
done:
    for (int k = 0; zero && k < o->n; k++) /* (a failed step: the state it made is zero) */
        if (zero[k]) opt_settle(&o->ps[k], zero[k]);
    if (grads)
        for (int k = 0; k < o->n; k++)
            if (grads[k]) gj_rt_tensor_release(grads[k]);
    gj_rt_free(grads);
    gj_rt_free(zero);
    return rc;
}

/* -------------------------------------------------- the compiled step */

int gj_fe_optim_n(const gj_optim *o) { return o ? o->n : 0; }

gj_tensor *gj_fe_optim_param(const gj_optim *o, int k) { return o->ps[k].p; }

void gj_fe_optim_describe(const gj_optim *o, gj_jit_opt *out, gj_tensor **s1, gj_tensor **s2,
                          double *hyper) {
    memset(out, 0, sizeof *out);
    out->def = o->def;
    out->structure = o->def->structure(o->cfg);
    out->n = o->n;
    for (int k = 0; k < o->n; k++) {
        const opt_param *q = &o->ps[k];
        s1[k] = q->s[0];
        s2[k] = q->s[1];
        /* exactly the doubles gj_optim_step would give this update */
        double *h = hyper + (size_t)k * GJ_AG_OPT_MAX_HYPER;
        memset(h, 0, GJ_AG_OPT_MAX_HYPER * sizeof *h);
        o->def->hyper(o->cfg, q->step + 1, h);
    }
    out->params = NULL; /* the caller fills params, s1, s2 (its own arrays) */
}

void gj_fe_optim_updated(gj_optim *o, const bool *updated) {
    for (int k = 0; k < o->n; k++)
        if (updated[k] && o->def->counts_steps) o->ps[k].step++;
}

int gj_fe_optim_zero_state(gj_optim *o, const unsigned *state) {
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        for (int i = 0; i < o->def->n_state && i < GJ_AG_OPT_MAX_STATE; i++) {
            if (!(state[k] & (1u << i)) || q->s[i]) continue;
            /* zeroed storage: memory new from the system is zero already,
             * so the program's first update is its first toucher */
            const gj_tensor *p = q->p;
            if (!(q->s[i] = gj_rt_tensor_new(gj_ag_opt_dtype(p->dtype), p->ndim, p->shape)))
                return -1;
        }
    }
    return 0;
}

void gj_optim_zero_grad(gj_optim *o) {
    if (!o) return;
    for (int k = 0; k < o->n; k++) gj_tensor_set_grad(o->ps[k].p, NULL);
}

void gj_optim_set_lr(gj_optim *o, double lr) {
    if (!o) return;
    if (!(lr >= 0.0)) {
        gj_rt_set_error("gj_optim_set_lr: lr = %g must be >= 0", lr);
        return;
    }
    o->cfg[0] = lr;
}

void gj_optim_free(gj_optim *o) {
    if (!o) return;
    for (int k = 0; k < o->n; k++) {
        gj_rt_tensor_release(o->ps[k].p);
        for (int i = 0; i < GJ_AG_OPT_MAX_STATE; i++)
            if (o->ps[k].s[i]) gj_rt_tensor_release(o->ps[k].s[i]);
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

int gj_optim_state_dict_add(gj_optim *o, gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_optim_state_dict_add";
    if (!o || !sd) {
        gj_rt_set_error("%s: NULL optimizer or state dict", op);
        return -1;
    }
    if (!prefix) prefix = "optim";
    const gj_ag_optdef *def = o->def;
    char key[512], val[64];
    if (!opt_key(key, sizeof key, op, prefix, -1, "kind") ||
        gj_state_dict_set_metadata(sd, key, def->name) != 0)
        return -1;
    snprintf(val, sizeof val, "%d", o->n);
    if (!opt_key(key, sizeof key, op, prefix, -1, "n_params") ||
        gj_state_dict_set_metadata(sd, key, val) != 0)
        return -1;
    for (int i = 0; i < def->n_cfg; i++) {
        snprintf(val, sizeof val, "%.17g", o->cfg[i]); /* round-trips exactly */
        if (!opt_key(key, sizeof key, op, prefix, -1, def->cfg_names[i]) ||
            gj_state_dict_set_metadata(sd, key, val) != 0)
            return -1;
    }
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        bool any = false;
        for (int i = 0; i < def->n_state; i++) {
            if (!q->s[i]) continue;
            any = true;
            if (!opt_key(key, sizeof key, op, prefix, k, def->state_names[i]) ||
                gj_state_dict_add(sd, key, q->s[i]) != 0)
                return -1;
        }
        if (!any || !def->counts_steps) continue;
        if (!opt_key(key, sizeof key, op, prefix, k, "step")) return -1;
        gj_tensor *st = gj_rt_tensor_new(GJ_I64, 0, NULL);
        if (!st) return -1;
        *(int64_t *)gj_rt_data_ptr(st) = q->step;
        int rc = gj_state_dict_add(sd, key, st);
        gj_rt_tensor_release(st); /* the dict holds its own reference */
        if (rc != 0) return -1;
    }
    return 0;
}

/* Whether t is a state tensor fit for parameter p (shape and state dtype). */
static bool opt_state_fits(const gj_tensor *t, const gj_tensor *p) {
    if (t->dtype != gj_ag_opt_dtype(p->dtype) || t->ndim != p->ndim) return false;
    for (int d = 0; d < p->ndim; d++)
        if (t->shape[d] != p->shape[d]) return false;
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

/* The configuration stored in sd under prefix into cfg[], each problem
 * added to m. -1 if a key does not fit (error set), else 0. */
static int load_cfg(const gj_optim *o, const gj_state_dict *sd, const char *op,
                    const char *prefix, gj_fe_msg *m, double *cfg) {
    const gj_ag_optdef *def = o->def;
    char key[512];
    if (!opt_key(key, sizeof key, op, prefix, -1, "kind")) return -1;
    const char *fk = gj_state_dict_get_metadata(sd, key);
    if (!fk)
        gj_fe_msg_add(m, "missing metadata \"%s\" (this optimizer is \"%s\")", key, def->name);
    else if (strcmp(fk, def->name) != 0)
        gj_fe_msg_add(m, "\"%s\" is \"%.40s\", this optimizer is \"%s\"", key, fk, def->name);
    uint64_t np = 0;
    if (!opt_key(key, sizeof key, op, prefix, -1, "n_params")) return -1;
    const char *fn = gj_state_dict_get_metadata(sd, key);
    if (!fn)
        gj_fe_msg_add(m, "missing metadata \"%s\" (this optimizer has %d parameters)", key,
                      o->n);
    else if (gj_fe_meta_u64(sd, key, &np) != 0 || np != (uint64_t)o->n)
        gj_fe_msg_add(m, "\"%s\" is \"%.40s\", this optimizer has %d parameters", key, fn,
                      o->n);
    for (int i = 0; i < def->n_cfg; i++) {
        if (!opt_key(key, sizeof key, op, prefix, -1, def->cfg_names[i])) return -1;
        const char *v = gj_state_dict_get_metadata(sd, key);
        char *end = NULL;
        cfg[i] = v ? strtod(v, &end) : NAN;
        double hi = def->cfg_hi[i];
        bool bad = !v || !v[0] || *end || !isfinite(cfg[i]) || cfg[i] < def->cfg_lo[i] ||
                   (def->cfg_hi_open[i] ? cfg[i] >= hi : cfg[i] > hi);
        if (!v)
            gj_fe_msg_add(m, "missing metadata \"%s\"", key);
        else if (bad)
            gj_fe_msg_add(m, "\"%s\" is \"%.40s\", not a finite number in [%g, %g%s", key, v,
                          def->cfg_lo[i], hi, def->cfg_hi_open[i] ? ")" : "]");
    }
    return 0;
}

/* Whether name (under prefix) is one this optimizer writes. */
static bool opt_own_name(const gj_optim *o, const char *nm, size_t pl) {
    char *end = NULL;
    long k = strtol(nm + pl + 1, &end, 10);
    if (end == nm + pl + 1 || *end != '.' || k < 0 || k >= o->n) return false;
    const char *f = end + 1;
    for (int i = 0; i < o->def->n_state; i++)
        if (!strcmp(f, o->def->state_names[i])) return true;
    return o->def->counts_steps && !strcmp(f, "step");
}

int gj_optim_load_state_dict(gj_optim *o, const gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_optim_load_state_dict";
    if (!o || !sd) {
        gj_rt_set_error("%s: NULL optimizer or state dict", op);
        return -1;
    }
    if (!prefix) prefix = "optim";
    const gj_ag_optdef *def = o->def;
    int rc = -1;
    gj_fe_msg *m = gj_rt_calloc(1, sizeof *m);
    gj_tensor **ns = gj_rt_calloc((size_t)o->n * GJ_AG_OPT_MAX_STATE, sizeof *ns);
    int64_t *steps = gj_rt_calloc((size_t)o->n, sizeof *steps);
    double cfg[GJ_AG_OPT_MAX_CFG];
    if (!m || !ns || !steps || load_cfg(o, sd, op, prefix, m, cfg) != 0) goto done;
    char key[512], sp[160], st[160];
    /* Per-parameter state: shapes and dtypes against the parameters. */
    for (int k = 0; k < o->n; k++) {
        const gj_tensor *p = o->ps[k].p;
        gj_tensor *t[GJ_AG_OPT_MAX_STATE] = {0}, *ts = NULL;
        int have = 0;
        for (int i = 0; i < def->n_state; i++) {
            if (!opt_key(key, sizeof key, op, prefix, k, def->state_names[i])) goto done;
            t[i] = gj_state_dict_get(sd, key);
            have += t[i] != NULL;
            if (t[i] && !opt_state_fits(t[i], p))
                gj_fe_msg_add(m, "\"%s\" is %s %s, parameter %d needs %s %s", key,
                              gj_rt_dtype_name(t[i]->dtype),
                              gj_rt_fmt_shape(st, sizeof st, t[i]->ndim, t[i]->shape), k,
                              gj_rt_dtype_name(gj_ag_opt_dtype(p->dtype)),
                              gj_rt_fmt_shape(sp, sizeof sp, p->ndim, p->shape));
        }
        if (def->counts_steps) {
            if (!opt_key(key, sizeof key, op, prefix, k, "step")) goto done;
            ts = gj_state_dict_get(sd, key);
            if ((have != 0 && have != def->n_state) || (have != 0) != (ts != NULL))
                gj_fe_msg_add(m, "parameter %d: %s%s%s and step must be given together", k,
                              def->state_names[0], def->n_state > 1 ? ", " : "",
                              def->n_state > 1 ? def->state_names[1] : "");
            else if (ts && (ts->dtype != GJ_I64 || ts->numel != 1 || gj_rt_get(ts, 0) < 1))
                gj_fe_msg_add(m, "\"%s\" must be one i64 value >= 1", key);
            else if (ts)
                steps[k] = *(const int64_t *)gj_rt_data_ptr(ts);
        }
        for (int i = 0; i < def->n_state && m->count == 0; i++)
            if (t[i] && !(ns[k * GJ_AG_OPT_MAX_STATE + i] = opt_copy_state(t[i]))) goto done;
    }
    /* Names under the prefix that this optimizer would not have written. */
    size_t pl = strlen(prefix);
    for (int i = 0; i < gj_state_dict_size(sd); i++) {
        const char *nm = gj_state_dict_name(sd, i);
        if (strncmp(nm, prefix, pl) != 0 || nm[pl] != '.') continue;
        if (!opt_own_name(o, nm, pl))
            gj_fe_msg_add(m, "unexpected \"%.200s\" for a %s optimizer of %d parameters", nm,
                          def->name, o->n);
    }
    if (m->count > 0) {
        gj_fe_msg_fail(m, op, "problem", "problems");
        goto done;
    }
    /* Everything checked and copied: swap the state in. */
    for (int k = 0; k < o->n; k++) {
        opt_param *q = &o->ps[k];
        for (int i = 0; i < GJ_AG_OPT_MAX_STATE; i++) {
            if (q->s[i]) gj_rt_tensor_release(q->s[i]);
            q->s[i] = ns[k * GJ_AG_OPT_MAX_STATE + i];
            ns[k * GJ_AG_OPT_MAX_STATE + i] = NULL;
        }
        q->step = steps[k];
    }
    memcpy(o->cfg, cfg, (size_t)def->n_cfg * sizeof *cfg);
    rc = 0;
done:
    if (ns)
        for (int k = 0; k < o->n * GJ_AG_OPT_MAX_STATE; k++)
            if (ns[k]) gj_rt_tensor_release(ns[k]);
    gj_rt_free(m);
    gj_rt_free(ns);
    gj_rt_free(steps);
    return rc;
}
