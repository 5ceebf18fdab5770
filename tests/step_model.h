/* SPDX-License-Identifier: MIT */
/*
 * step_model.h - a small model and a recorder of everything a training
 * step leaves behind, shared by the suites that hold the compiled step
 * (gj_step) to the eager step bit for bit: test_step_guards.c and
 * test_step_check.c.
 *
 * The model is a 2-layer MLP (x[B, SM_IN] -> Linear -> GELU -> Linear ->
 * cross-entropy over SM_OUT classes) whose step function reads its flags
 * from the ctx (a sm_model), so that a test can make it do what a ported
 * training loop does. A run of a script (sm_script) runs the same steps
 * eagerly and compiled, from the same weights, data and generator, and
 * records per step the return code, the error, the loss bits, and after
 * each step every parameter, the .grad of every leaf it watches and the
 * generator's position: sm_same() fails on the first difference.
 */
#ifndef STEP_MODEL_H
#define STEP_MODEL_H

#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SM_IN = 6, SM_HID = 8, SM_OUT = 4, SM_NP = 4, SM_MAXSTEP = 12, SM_WATCH = 4 };

typedef struct sm_model {
    gj_tensor *p[SM_NP]; /* w1 [HID, IN], b1 [HID], w2 [OUT, HID], b2 [OUT] */
    /* what the step function does besides the MLP (set by a test) */
    bool add_in1;          /* h0 = in[0] + in[1] (in[1]: [B, IN]) */
    bool in1_weight;       /* the first layer's weight is in[1] instead of w1 */
    gj_tensor *shift;      /* captured: h0 = in[0] + shift ([IN]) */
    gj_tensor *scale;      /* captured 0-d: h scaled by gj_tensor_item(scale) */
    double cscale;         /* != 0: h scaled by this C double (gj_mul_scalar) */
    gj_tensor *w2T;        /* captured: the second layer is h @ w2T (a view made outside) */
    bool train;            /* dropout 0.25 after the hidden layer when true */
    bool branch;           /* an extra tanh on the hidden layer when true */
    uint64_t reseed;       /* != 0: gj_manual_seed(reseed) inside the function */
    bool null_loss;        /* returns NULL without an error */
    gj_step *inner;        /* runs this step inside the function (on in[]) */
    gj_tensor *cmask;      /* captured [HID] tensor the hidden layer is multiplied by */
    gj_custom_op *custom;  /* h = custom(h, 0.75): "(Tensor x, float alpha) -> Tensor" */
} sm_model;

static inline void sm_init(sm_model *m, uint64_t seed) {
    memset(m, 0, sizeof *m);
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    const int64_t s[SM_NP][2] = {{SM_HID, SM_IN}, {SM_HID, 0}, {SM_OUT, SM_HID}, {SM_OUT, 0}};
    for (int k = 0; k < SM_NP; k++) {
        m->p[k] = gjt_uniform(&r, GJ_F32, s[k][1] ? 2 : 1, s[k], -0.5, 0.5);
        assert_int_equal(gj_set_requires_grad(m->p[k], true), 0);
    }
}

static inline void sm_free(sm_model *m) {
    for (int k = 0; k < SM_NP; k++) gj_release(m->p[k]);
}

/* The step function. */
static inline gj_tensor *sm_loss(void *ctx, int n_in, gj_tensor *const *in) {
    sm_model *m = ctx;
    if (m->null_loss) return NULL;
    if (m->inner) {
        gj_tensor *il = NULL;
        if (gj_step_run(m->inner, n_in, in, &il) != 0) return NULL;
    }
    if (m->reseed) gj_manual_seed(m->reseed);
    gj_tensor *x = in[0];
    if (m->add_in1) x = gj_add(x, in[1]);
    if (m->shift) x = gj_add(x, m->shift);
    gj_tensor *h = gj_gelu(gj_linear(x, m->in1_weight ? in[1] : m->p[0], m->p[1]));
    if (m->cmask) h = gj_mul(h, m->cmask);
    if (m->custom) {
        double alpha = 0.75;
        gj_tensor *o = NULL;
        if (gj_custom_op_call(m->custom, &h, &alpha, &o) != 0) return NULL;
        h = o;
    }
    if (m->scale) h = gj_mul_scalar(h, gj_tensor_item(m->scale));
    if (m->cscale != 0) h = gj_mul_scalar(h, m->cscale);
    if (m->branch) h = gj_tanh(h);
    if (m->train) h = gj_dropout(h, 0.25, true);
    gj_tensor *y = m->w2T ? gj_add(gj_matmul(h, m->w2T), m->p[3]) : gj_linear(h, m->p[2], m->p[3]);
    return gj_cross_entropy(y, in[2]);
}

/* Step i's inputs: in[0] x [B, IN], in[1] (in1: a [B, IN] tensor or the
 * caller's), in[2] labels [B]. A script's hooks change them per step. */
typedef struct sm_script sm_script;
struct sm_script {
    int steps, batch;
    bool adamw, keep_grads;
    double clip;
    int check_every;
    size_t mem_budget; /* gj_step_opts.mem_budget of the compiled run */
    /* before step i (both modes): changes the model or the inputs */
    void (*before)(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager);
    void *user;
    gj_tensor *watch[SM_WATCH]; /* filled by before(): leaves whose .grad is recorded */
    uint64_t (*variant)(const sm_script *sc, const sm_model *m, int i); /* NULL: 0 */
};

/* What a run leaves. */
typedef struct sm_result {
    int rc[SM_MAXSTEP];
    char err[SM_MAXSTEP][200];
    double loss[SM_MAXSTEP];
    double *vals[SM_MAXSTEP]; /* per step: parameters, then watched .grads (NaN: none) */
    int64_t n_vals[SM_MAXSTEP];
    uint64_t rng[SM_MAXSTEP];
    gj_ca_stats stats;
    gj_step_memory mem; /* the compiled run's program (zeros: none) */
} sm_result;

static inline void sm_result_free(sm_result *r) {
    for (int i = 0; i < SM_MAXSTEP; i++) free(r->vals[i]);
}

static inline int64_t sm_append(double **v, int64_t n, const gj_tensor *t) {
    int64_t k = t ? gj_tensor_numel(t) : 1;
    *v = realloc(*v, (size_t)(n + k) * sizeof **v);
    assert_non_null(*v);
    if (t) assert_int_equal(gj_tensor_to_f64(t, *v + n), 0);
    else (*v)[n] = NAN;
    return n + k;
}

/* Runs sc eagerly or compiled from fresh weights; m (zeroed flags set by
 * the caller's setup) is the step's ctx. */
static inline sm_result sm_run(sm_script *sc, const sm_model *flags, bool eager) {
    sm_model m;
    sm_init(&m, 3);
    sm_model keep = m;
    m = *flags;
    memcpy(m.p, keep.p, sizeof m.p);
    gj_optim *o = sc->adamw ? gj_adamw_new(SM_NP, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.01)
                            : gj_sgd_new(SM_NP, m.p, 0.1, 0.9, 0.0);
    assert_non_null(o);
    gj_step_opts so = {.eager = eager, .keep_grads = sc->keep_grads, .clip_norm = sc->clip,
                       .check_every = sc->check_every, .mem_budget = eager ? 0 : sc->mem_budget};
    gj_step *st = gj_step_new(sm_loss, &m, o, &so);
    assert_non_null(st);
    gj_manual_seed(42);
    gj_step_reset_stats();
    gjt_rng r;
    gjt_rng_seed(&r, 19);
    sm_result res;
    memset(&res, 0, sizeof res);
    memset(sc->watch, 0, sizeof sc->watch);
    for (int i = 0; i < sc->steps; i++) {
        gj_scope_push();
        int64_t b = sc->batch;
        gj_tensor *in[3];
        in[0] = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, SM_IN}, -1, 1);
        in[1] = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, SM_IN}, -0.1, 0.1);
        in[2] = gjt_labels(&r, 1, &b, SM_OUT);
        if (sc->before) sc->before(sc, &m, i, in, eager);
        gj_tensor *loss = NULL;
        uint64_t var = sc->variant ? sc->variant(sc, &m, i) : 0;
        gj_clear_error();
        res.rc[i] = var ? gj_step_run_variant(st, var, 3, in, &loss) : gj_step_run(st, 3, in, &loss);
        snprintf(res.err[i], sizeof res.err[i], "%s", res.rc[i] ? gj_last_error() : "");
        res.loss[i] = loss ? gj_tensor_item(loss) : -1.0;
        int64_t n = 0;
        for (int k = 0; k < SM_NP; k++) n = sm_append(&res.vals[i], n, m.p[k]);
        for (int k = 0; k < SM_NP; k++) n = sm_append(&res.vals[i], n, gj_tensor_grad(m.p[k]));
        for (int k = 0; k < SM_WATCH; k++)
            if (sc->watch[k]) n = sm_append(&res.vals[i], n, gj_tensor_grad(sc->watch[k]));
        res.n_vals[i] = n;
        gj_rng_get_state(NULL, &res.rng[i]);
        gj_scope_pop();
    }
    gj_step_stats(&res.stats);
    if (gj_step_memory_stats(st, &res.mem) != 0) memset(&res.mem, 0, sizeof res.mem);
    gj_step_free(st);
    gj_optim_free(o);
    for (int k = 0; k < SM_NP; k++) gj_tensor_set_grad(m.p[k], NULL);
    sm_free(&m);
    return res;
}

/* Fails on the first difference between the eager and the compiled run. */
static inline void sm_same(const char *what, const sm_script *sc, const sm_result *e,
                           const sm_result *c) {
    for (int i = 0; i < sc->steps; i++) {
        if (e->rc[i] != c->rc[i])
            fail_msg("%s: step %d returned %d eager ('%s'), %d compiled ('%s')", what, i, e->rc[i],
                     e->err[i], c->rc[i], c->err[i]);
        if (strcmp(e->err[i], c->err[i]) != 0)
            fail_msg("%s: step %d error eager '%s', compiled '%s'", what, i, e->err[i], c->err[i]);
        if (memcmp(&e->loss[i], &c->loss[i], sizeof e->loss[i]) != 0)
            fail_msg("%s: step %d loss %.9g eager, %.9g compiled", what, i, e->loss[i], c->loss[i]);
        if (e->n_vals[i] != c->n_vals[i])
            fail_msg("%s: step %d: %lld values eager, %lld compiled", what, i,
                     (long long)e->n_vals[i], (long long)c->n_vals[i]);
        for (int64_t k = 0; k < e->n_vals[i]; k++) {
            double a = e->vals[i][k], b = c->vals[i][k];
            if (memcmp(&a, &b, sizeof a) != 0 && !(isnan(a) && isnan(b)))
                fail_msg("%s: step %d value %lld: %.9g eager, %.9g compiled", what, i,
                         (long long)k, a, b);
        }
        if (e->rng[i] != c->rng[i])
            fail_msg("%s: step %d generator at %llu eager, %llu compiled", what, i,
                     (unsigned long long)e->rng[i], (unsigned long long)c->rng[i]);
    }
}

/* Runs sc both ways, compares, and returns the compiled run's counters. */
static inline gj_ca_stats sm_check(const char *what, sm_script *sc, const sm_model *flags) {
    gj_compiled_autograd_set_quiet(true);
    sm_result e = sm_run(sc, flags, true);
    sm_result c = sm_run(sc, flags, false);
    sm_same(what, sc, &e, &c);
    gj_ca_stats s = c.stats;
    sm_result_free(&e);
    sm_result_free(&c);
    return s;
}

#endif /* STEP_MODEL_H */
