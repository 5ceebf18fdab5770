/* SPDX-License-Identifier: MIT */
/*
 * test_step.c - the compiled training step (gj_step) against the eager
 * step, bit for bit: loss, parameters, optimizer state and kept .grads,
 * over several steps, in f32, f64 and bf16, with SGD (momentum, weight
 * decay) and AdamW, dropout, an eval step; its variants (new input shapes,
 * a parameter changed by set_), its guards and every reason it runs
 * eagerly (each checked for the reason and for eager's results); and its
 * counters, which add up to the steps run.
 */
#include "gjtest.h"

#include "../jit/codegen/codegen.h"
#include "../jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 12, HID = 24, OUT = 5, NSTEP = 6, NP = 4 };

typedef enum misuse {
    M_NONE = 0,
    M_ITEM,      /* reads a value it computed */
    M_INPLACE,   /* an in-place op */
    M_HOOK,      /* registers a hook */
    M_RANDN,     /* draws a random tensor */
    M_FROM_DATA, /* makes a tensor from memory */
    M_BACKWARD,  /* runs a backward */
    M_N
} misuse;

static const char *const g_misuse_text[M_N] = {
    "", "gj_tensor_item", "gj_mul_scalar_", "gj_register_hook", "gj_randn",
    "gj_from_data", "gj_grad"};

typedef struct model {
    gj_dtype dt;
    gj_tensor *p[NP]; /* w1 [HID, IN], b1 [HID], w2 [OUT, HID], b2 [OUT] */
    gj_tensor *unused; /* a parameter the loss never reads */
    double drop;       /* dropout probability after the hidden layer (0: none) */
    misuse mis;
    gj_tensor *mask;   /* a constant: scales the hidden layer */
} model;

static gj_tensor *keep_hook(gj_tensor *g, void *u) {
    (void)u;
    (void)g;
    return NULL;
}


/* The step function: mean cross-entropy of a 2-layer MLP. */
static gj_tensor *mlp_loss(void *ctx, int n_in, gj_tensor *const *in) {
    model *m = ctx;
    (void)n_in;
    gj_tensor *h = gj_gelu(gj_linear(in[0], m->p[0], m->p[1]));
    if (m->mask) h = gj_mul(h, m->mask);
    if (m->drop > 0) h = gj_dropout(h, m->drop, true);
    switch (m->mis) {
    case M_ITEM: (void)gj_tensor_item(gj_sum(h, 0, NULL, false)); break;
    case M_INPLACE: {
        gj_no_grad_push();
        gj_tensor *c = gj_contiguous(gj_detach(h));
        (void)gj_mul_scalar_(c, 1.0);
        gj_no_grad_pop();
        break;
    }
    case M_HOOK: (void)gj_register_hook(h, keep_hook, NULL); break;
    case M_RANDN: h = gj_add(h, gj_mul_scalar(gj_randn(m->dt, 1, (int64_t[]){HID}, 1.0), 0.0)); break;
    case M_FROM_DATA: {
        double z = 0.0;
        gj_tensor *t = gj_cast(gj_from_data(GJ_F64, 0, NULL, &z), m->dt);
        h = gj_add(h, t);
        break;
    }
    case M_BACKWARD: {
        gj_tensor *g = NULL, *x = in[0];
        (void)x;
        gj_tensor *s = gj_sum(gj_mul(h, h), 0, NULL, false);
        gj_tensor *pp = m->p[0];
        (void)gj_grad(1, &s, NULL, 1, &pp, &g, true, true);
        break;
    }
    default: break;
    }
    gj_tensor *y = gj_linear(h, m->p[2], m->p[3]);
    return gj_cross_entropy(y, in[1]);
}

static void model_init(model *m, gj_dtype dt, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->dt = dt;
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    const int64_t s[NP][2] = {{HID, IN}, {HID, 0}, {OUT, HID}, {OUT, 0}};
    for (int k = 0; k < NP; k++) {
        m->p[k] = gjt_uniform(&r, dt, s[k][1] ? 2 : 1, s[k], -0.4, 0.4);
        assert_int_equal(gj_set_requires_grad(m->p[k], true), 0);
    }
    m->unused = gjt_uniform(&r, dt, 1, (int64_t[]){3}, -1, 1);
    assert_int_equal(gj_set_requires_grad(m->unused, true), 0);
}

static void model_free(model *m) {
    for (int k = 0; k < NP; k++) gj_release(m->p[k]);
    gj_release(m->unused);
    if (m->mask) gj_release(m->mask);
}

/* What a run leaves: per step the loss, then the parameters, the
 * optimizer state (through its state dict) and the .grads (NAN: none). */
typedef struct result {
    double loss[NSTEP + 4];
    double *params, *state, *grads;
    int64_t n_params, n_state, n_grads;
    bool has_grad[NP + 1];
    uint64_t rng_counter;
} result;

static void result_free(result *r) {
    free(r->params);
    free(r->state);
    free(r->grads);
}

typedef struct run_cfg {
    gj_dtype dt;
    bool adamw, lion, keep_grads, eval;
    double drop;
    misuse mis;
    bool mask;
    double clip; /* > 0: the step clips the gradients' norm to it */
    bool nan_at3; /* step 3's input holds a NaN */
    int batch2;  /* > 0: steps from NSTEP/2 on use this batch */
    const int *batches; /* non-NULL: step i's batch (overrides batch2) */
    double lr2;  /* > 0: the learning rate from NSTEP/2 on */
    gj_dtype autocast; /* the step's opts.autocast */
} run_cfg;

static double *all_values(gj_tensor *const *ts, int n, int64_t *total) {
    int64_t t = 0;
    for (int k = 0; k < n; k++) t += ts[k] ? gj_tensor_numel(ts[k]) : 0;
    double *v = calloc((size_t)t + 1, sizeof *v);
    assert_non_null(v);
    int64_t at = 0;
    for (int k = 0; k < n; k++) {
        if (!ts[k]) continue;
        assert_int_equal(gj_tensor_to_f64(ts[k], v + at), 0);
        at += gj_tensor_numel(ts[k]);
    }
    *total = t;
    return v;
}

/* NSTEP steps of cfg, eager or compiled, from the same weights and data. */
static result run(const run_cfg *cfg, bool eager) {
    model m;
    model_init(&m, cfg->dt, 11);
    m.drop = cfg->drop;
    m.mis = cfg->mis;
    if (cfg->mask) {
        gjt_rng r;
        gjt_rng_seed(&r, 5);
        m.mask = gjt_uniform(&r, cfg->dt, 1, (int64_t[]){HID}, 0.5, 1.5);
    }
    gj_tensor *ps[NP + 1] = {m.p[0], m.p[1], m.p[2], m.p[3], m.unused};
    gj_optim *o = cfg->lion    ? gj_lion_new(NP + 1, ps, 3e-3, 0.9, 0.99, 0.2)
                  : cfg->adamw ? gj_adamw_new(NP + 1, ps, 1e-2, 0.9, 0.999, 1e-8, 0.05)
                               : gj_sgd_new(NP + 1, ps, 0.05, 0.9, 0.01);
    assert_non_null(o);
    gj_step_opts so = {.eager = eager, .keep_grads = cfg->keep_grads, .eval = cfg->eval,
                       .clip_norm = cfg->clip, .autocast = cfg->autocast};
    gj_step *st = gj_step_new(mlp_loss, &m, o, &so);
    assert_non_null(st);
    gj_manual_seed(42);
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    result res;
    memset(&res, 0, sizeof res);
    for (int i = 0; i < NSTEP; i++) {
        int64_t b = cfg->batch2 > 0 && i >= NSTEP / 2 ? cfg->batch2 : 8;
        if (cfg->batches) b = cfg->batches[i];
        if (cfg->lr2 > 0 && i == NSTEP / 2) gj_optim_set_lr(o, cfg->lr2);
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, cfg->dt, 2, (int64_t[]){b, IN}, -1, 1);
        gj_tensor *y = gjt_labels(&r, 1, &b, OUT);
        if (cfg->nan_at3 && i == 3) {
            gj_tensor *z = gj_mul_scalar(gj_sum(x, 0, NULL, true), NAN); /* NaN, [1, 1] */
            x = gj_add(x, z);
        }
        gj_tensor *in[2] = {x, y}, *loss = NULL;
        int rc = gj_step_run(st, 2, in, &loss);
        if (cfg->nan_at3 && i == 3) { /* a non-finite norm: the step fails, nothing moves */
            assert_int_equal(rc, -1);
            if (!gjt_error_has("gradient norm is")) fail_msg("step 3: %s", gj_last_error());
            res.loss[i] = -1;
            if (!cfg->keep_grads) /* (the failed step leaves the .grads eagerly) */
                for (int k = 0; k < NP + 1; k++) assert_int_equal(gj_tensor_set_grad(ps[k], NULL), 0);
            gj_scope_pop();
            continue;
        }
        if (rc != 0) fail_msg("step %d: %s", i, gj_last_error());
        assert_non_null(loss);
        assert_true(gj_is_grad_enabled());
        res.loss[i] = gj_tensor_item(loss);
        if (!cfg->keep_grads && !cfg->eval)
            for (int k = 0; k < NP + 1; k++) assert_null(gj_tensor_grad(ps[k]));
        gj_scope_pop();
    }
    res.params = all_values(ps, NP + 1, &res.n_params);
    gj_tensor *gs[NP + 1];
    for (int k = 0; k < NP + 1; k++) {
        gs[k] = gj_tensor_grad(ps[k]);
        res.has_grad[k] = gs[k] != NULL;
    }
    res.grads = all_values(gs, NP + 1, &res.n_grads);
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_optim_state_dict_add(o, sd, "o"), 0);
    res.state = all_values(gj_state_dict_tensors(sd), gj_state_dict_size(sd), &res.n_state);
    gj_state_dict_free(sd);
    uint64_t seed;
    gj_rng_get_state(&seed, &res.rng_counter);
    gj_step_free(st);
    gj_optim_free(o);
    for (int k = 0; k < NP + 1; k++) gj_tensor_set_grad(ps[k], NULL);
    model_free(&m);
    return res;
}

static void same(const char *what, const result *e, const result *c) {
    for (int i = 0; i < NSTEP; i++)
        if (memcmp(&e->loss[i], &c->loss[i], sizeof e->loss[i]) != 0)
            fail_msg("%s: step %d loss %.17g eager, %.17g compiled", what, i, e->loss[i],
                     c->loss[i]);
    assert_int_equal(e->n_params, c->n_params);
    assert_int_equal(e->n_state, c->n_state);
    assert_int_equal(e->n_grads, c->n_grads);
    assert_memory_equal(e->has_grad, c->has_grad, sizeof e->has_grad);
    int64_t bad = 0;
    for (int64_t k = 0; k < e->n_params; k++) bad += memcmp(&e->params[k], &c->params[k], 8) != 0;
    if (bad) fail_msg("%s: %lld parameter values differ", what, (long long)bad);
    assert_memory_equal(e->state, c->state, (size_t)e->n_state * sizeof(double));
    assert_memory_equal(e->grads, c->grads, (size_t)e->n_grads * sizeof(double));
    assert_true(e->rng_counter == c->rng_counter); /* the same draws from the generator */
}

static gj_ca_stats check(const char *what, const run_cfg *cfg, int64_t want_fallbacks) {
    gj_compiled_autograd_set_quiet(true);
    result e = run(cfg, true);
    gj_step_reset_stats();
    result c = run(cfg, false);
    gj_ca_stats s;
    gj_step_stats(&s);
    if (s.fallbacks != want_fallbacks)
        fail_msg("%s: %lld fallbacks (want %lld): %s", what, (long long)s.fallbacks,
                 (long long)want_fallbacks, gj_compiled_autograd_last_fallback());
    assert_int_equal(s.backwards, NSTEP);
    assert_int_equal(s.compiles + s.mem_hits + s.disk_hits + s.instantiations + s.fallbacks,
                     s.backwards);
    same(what, &e, &c);
    result_free(&e);
    result_free(&c);
    return s;
}

/* ----------------------------------------------------------- results */

static void test_f32_adamw(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32, .adamw = true};
    check("f32 AdamW", &c, 0);
}

static void test_f64_adamw(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F64, .adamw = true};
    check("f64 AdamW", &c, 0);
}

static void test_bf16_adamw(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_BF16, .adamw = true};
    check("bf16 AdamW", &c, 0);
}

/* Mixed precision: f32 parameters and state, GEMMs and the hidden layer in
 * bf16, the loss in f32; the compiled step equals the eager one bit for
 * bit (with a constant mask, dropout, clipping and kept .grads too), and
 * the thread's own autocast setting is what it was. */
static void test_autocast(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32, .adamw = true, .autocast = GJ_BF16};
    check("autocast bf16 AdamW", &c, 0);
    assert_int_equal(gj_get_autocast(), GJ_F32);
    c = (run_cfg){.dt = GJ_F32, .autocast = GJ_BF16, .mask = true, .drop = 0.25, .clip = 0.5,
                  .keep_grads = true};
    check("autocast bf16 SGD, mask, dropout, clip, kept grads", &c, 0);
    /* the step's option wins over the thread's setting, both ways */
    assert_int_equal(gj_set_autocast(GJ_BF16), 0);
    c = (run_cfg){.dt = GJ_F32, .adamw = true};
    check("f32 step under a thread with autocast on", &c, 0);
    assert_int_equal(gj_get_autocast(), GJ_BF16);
    assert_int_equal(gj_set_autocast(GJ_F32), 0);
    /* another compute dtype: refused, naming it */
    gj_clear_error();
    assert_int_equal(gj_set_autocast(GJ_F64), -1);
    assert_true(gjt_error_has("gj_set_autocast: the compute dtype must be GJ_BF16"));
    assert_int_equal(gj_get_autocast(), GJ_F32);
    model m;
    model_init(&m, GJ_F32, 3);
    gj_optim *o = gj_sgd_new(NP, m.p, 0.1, 0, 0);
    gj_step_opts so = {.autocast = GJ_I64};
    assert_null(gj_step_new(mlp_loss, &m, o, &so));
    assert_true(gjt_error_has("opts.autocast must be GJ_F32 (off) or GJ_BF16"));
    gj_optim_free(o);
    model_free(&m);
}

/* The autocast table of gradjit.h, op by op: results' dtypes, gradients
 * of f32 leaves in f32, f64 untouched, a mix refused without autocast. */
static void test_autocast_rules(void **st) {
    (void)st;
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    gj_scope_push();
    int64_t xs[2] = {4, 6}, ws[2] = {3, 6}, bs = 3, lab_n = 4;
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, xs, -1, 1);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, ws, -1, 1), *b = gjt_uniform(&r, GJ_F32, 1, &bs, -1, 1);
    gj_tensor *x64 = gjt_uniform(&r, GJ_F64, 2, xs, -1, 1);
    gj_tensor *lab = gjt_labels(&r, 1, &lab_n, 3);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_set_requires_grad(b, true), 0);
    gj_tensor *h16 = gj_cast(x, GJ_BF16);
    gj_clear_error();
    assert_null(gj_add(x, h16)); /* off: a mix is an error */
    assert_true(gjt_error_has("dtype mismatch"));
    assert_int_equal(gj_set_autocast(GJ_BF16), 0);
    gj_tensor *y = gj_linear(x, w, b);
    assert_int_equal(gj_tensor_dtype(y), GJ_BF16);
    assert_int_equal(gj_tensor_dtype(gj_matmul(x, gj_transpose(w, 0, 1))), GJ_BF16);
    assert_int_equal(gj_tensor_dtype(gj_gelu(y)), GJ_BF16); /* stays bf16 */
    assert_int_equal(gj_tensor_dtype(gj_softmax(y, -1)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_log_softmax(y, -1)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_layer_norm(h16, NULL, NULL, 1e-5)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_sum(y, 0, NULL, false)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_mean(y, 0, NULL, false)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_add(x, h16)), GJ_F32); /* a mix: f32 */
    assert_int_equal(gj_tensor_dtype(gj_mul(h16, h16)), GJ_BF16);
    gj_tensor *parts[2] = {x, h16};
    assert_int_equal(gj_tensor_dtype(gj_cat(2, parts, 0)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_matmul(x64, gj_transpose(x64, 0, 1))), GJ_F64);
    int64_t is[4] = {1, 2, 5, 5}, ks[4] = {3, 2, 3, 3};
    gj_tensor *img = gjt_uniform(&r, GJ_F32, 4, is, -1, 1), *ker = gjt_uniform(&r, GJ_F32, 4, ks, -1, 1);
    assert_int_equal(gj_tensor_dtype(gj_conv2d(img, ker, NULL, 1, 1, 1, 1)), GJ_BF16);
    gj_tensor *loss = gj_cross_entropy(y, lab);
    assert_int_equal(gj_tensor_dtype(loss), GJ_F32);
    assert_int_equal(gj_set_autocast(GJ_F32), 0);
    assert_int_equal(gj_backward(loss, NULL), 0);
    assert_int_equal(gj_tensor_dtype(gj_tensor_grad(w)), GJ_F32);
    assert_int_equal(gj_tensor_dtype(gj_tensor_grad(b)), GJ_F32);
    gj_tensor_set_grad(w, NULL);
    gj_tensor_set_grad(b, NULL);
    gj_scope_pop();
}

static void test_f32_sgd(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32};
    check("f32 SGD momentum + weight decay", &c, 0);
    c.dt = GJ_F64;
    check("f64 SGD", &c, 0);
}

/* Lion, written once (autograd/optim_lion.c) like the others: the compiled
 * step's update is the eager one's, bit for bit, in every dtype, with
 * clipping and kept .grads too. */
static void test_lion(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32, .lion = true};
    check("f32 Lion", &c, 0);
    c.dt = GJ_F64;
    check("f64 Lion", &c, 0);
    c.dt = GJ_BF16;
    check("bf16 Lion", &c, 0);
    c.dt = GJ_F32;
    c.clip = 0.05;
    c.keep_grads = true;
    c.drop = 0.2;
    check("f32 Lion, clip, kept .grads, dropout", &c, 0);
}

static void test_dropout_constant_keep(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32, .adamw = true, .drop = 0.3, .mask = true, .keep_grads = true};
    check("dropout, a constant, kept .grads", &c, 0);
}

/* gj_clip_grad_norm in the step (a small norm: every step scales), bit for
 * bit in f32 and f64 and bf16; a NaN norm fails the step in both modes
 * and leaves everything as it was. */
static void test_clip(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32, .adamw = true, .clip = 0.05};
    check("clip f32", &c, 0);
    c.dt = GJ_F64;
    check("clip f64", &c, 0);
    c.dt = GJ_BF16;
    c.adamw = false;
    check("clip bf16 SGD", &c, 0);
    c.dt = GJ_F32;
    c.clip = 1e6; /* (no scaling) */
    c.keep_grads = true;
    check("clip above the norm, kept .grads", &c, 0);
    c.clip = 0.1;
    c.keep_grads = false;
    c.nan_at3 = true;
    check("clip, a NaN norm at step 3", &c, 0);
}

static void test_eval(void **st) {
    (void)st;
    run_cfg c = {.dt = GJ_F32, .eval = true, .drop = 0.2};
    check("eval", &c, 0);
}

/* A new batch size is a new variant (traced, compiled or bound to the
 * first's symbolic kernels); a new learning rate is a run-time value. */
static void test_variants(void **st) {
    (void)st;
    gj_jit_clear_cache(); /* (the first shape's program is not in memory already) */
    run_cfg c = {.dt = GJ_F32, .adamw = true, .batch2 = 5, .lr2 = 3e-3};
    gj_ca_stats s = check("a second batch size, another lr", &c, 0);
    assert_int_equal(s.compiles + s.disk_hits + s.instantiations, 2);
    assert_int_equal(s.mem_hits, NSTEP - 2);
}

/* Dynamic shapes: a new batch size after the first is a symbolic program,
 * later sizes bind to its kernels without a compile, a batch of 1 changes
 * the code (one more symbolic program), an earlier size is a memory hit. */
static void test_dynamic_batches(void **st) {
    (void)st;
    gj_jit_clear_cache();
    static const int b[NSTEP] = {8, 9, 13, 14, 1, 8};
    run_cfg c = {.dt = GJ_F32, .adamw = true, .batches = b};
    gj_ca_stats s = check("six steps at five batch sizes", &c, 0);
    /* five programs: at most three traced or loaded (8, the symbolic one,
     * the symbolic one for a batch of 1), the rest bound to kernels in
     * memory; how a warm disk cache splits them depends on what it holds */
    assert_int_equal(s.compiles + s.disk_hits + s.instantiations, 5);
    assert_true(s.compiles + s.disk_hits <= 3);
    assert_true(s.instantiations >= 2);
    assert_int_equal(s.mem_hits, 1);
}

/* ------------------------------------------------------------ reasons */

/* Each thing a replay cannot redo: the step runs eagerly from its first
 * run on, with reason untraceable naming it, and eager's results. */
static void test_untraceable(void **st) {
    (void)st;
    for (int mi = M_ITEM; mi < M_N; mi++) {
        run_cfg c = {.dt = GJ_F32, .adamw = true, .mis = (misuse)mi};
        char what[64];
        snprintf(what, sizeof what, "untraceable: %s", g_misuse_text[mi]);
        gj_ca_stats s = check(what, &c, NSTEP);
        assert_int_equal(s.fallbacks_by_reason[GJ_CA_UNTRACEABLE], NSTEP);
        const char *last = gj_compiled_autograd_last_fallback();
        if (!strstr(last, g_misuse_text[mi]) || !strstr(last, "step: untraceable"))
            fail_msg("%s: last fallback '%s'", what, last);
    }
}

static void test_anomaly_mode(void **st) {
    (void)st;
    gj_set_anomaly_mode(true);
    run_cfg c = {.dt = GJ_F32, .adamw = true};
    gj_ca_stats s = check("anomaly mode", &c, NSTEP);
    gj_set_anomaly_mode(false);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_INCOMPATIBLE_MODE], NSTEP);
}

/* The compiler's own fallbacks, each with eager's results: an op with no
 * lowering (the test switch), an LLVM error (its test switch), the
 * recompile limit of the call site, hooks on the step's graph. */
static void test_compiler_fallbacks(void **st) {
    (void)st;
    gj_jit_set_disk_cache(NULL); /* (compiles, not disk hits) */
    gj_jit_clear_cache();
    gj_jit_test_no_lowering(GJ_P_GELU);
    run_cfg c = {.dt = GJ_F32, .adamw = true};
    gj_ca_stats s = check("no lowering", &c, NSTEP);
    gj_jit_test_no_lowering(-1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_NO_LOWERING], NSTEP);
    gj_jit_clear_cache();
    gj_jit_test_fail_llvm(true);
    s = check("LLVM error", &c, NSTEP);
    gj_jit_test_fail_llvm(false);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_LLVM_ERROR], NSTEP);
    gj_jit_clear_cache();
    gj_compiled_autograd_set_recompile_limit(1);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_OFF);
    c.batch2 = 3;
    s = check("recompile limit", &c, NSTEP / 2);
    gj_compiled_autograd_set_recompile_limit(8);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RECOMPILE_LIMIT], NSTEP / 2);
    gj_jit_clear_cache();
    const char *env = getenv("GRADJIT_CACHE_DIR");
    gj_jit_set_disk_cache(env && *env && strcmp(env, "off") != 0 ? env : NULL);
}

static gj_tensor *scale_hook(gj_tensor *g, void *u) {
    (void)u;
    return gj_mul_scalar(g, 0.5);
}

/* Properties a compiled run depends on, changed between steps: a hook on
 * a parameter (another variant: the program calls it), a
 * parameter that stops requiring grad (another variant: not updated, as
 * eagerly), a training step under no_grad (eager's error), a parameter's
 * storage swapped for one of the same meta (the program reads the new
 * one). Each run equals eager's. */
static void test_guards(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    double out[2][NSTEP + 2];
    int rcs[2][NSTEP];
    for (int mode = 0; mode < 2; mode++) {
        model m;
        model_init(&m, GJ_F32, 13);
        gj_tensor *ps[NP] = {m.p[0], m.p[1], m.p[2], m.p[3]};
        gj_optim *o = gj_adamw_new(NP, ps, 1e-2, 0.9, 0.999, 1e-8, 0.0);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *s = gj_step_new(mlp_loss, &m, o, &so);
        gjt_rng r;
        gjt_rng_seed(&r, 17);
        gj_step_reset_stats();
        int64_t hook = -1;
        for (int i = 0; i < NSTEP; i++) {
            if (i == 1) hook = gj_register_hook(m.p[1], scale_hook, NULL);
            if (i == 2) assert_int_equal(gj_remove_hook(hook), 0);
            if (i == 3) assert_int_equal(gj_set_requires_grad(m.p[3], false), 0);
            if (i == 4) {
                gj_scope_push(); /* owns the product and its copy */
                gj_no_grad_push();
                gj_tensor *c = gj_contiguous(gj_mul_scalar(m.p[0], 1.0));
                assert_int_equal(gj_tensor_set_(m.p[0], c), 0);
                gj_no_grad_pop();
                gj_scope_pop();
            }
            if (i == 5) gj_no_grad_push();
            gj_scope_push();
            int64_t b = 6;
            gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, IN}, -1, 1);
            gj_tensor *y = gjt_labels(&r, 1, &b, OUT);
            gj_tensor *in[2] = {x, y}, *l = NULL;
            rcs[mode][i] = gj_step_run(s, 2, in, &l);
            out[mode][i] = rcs[mode][i] == 0 ? gj_tensor_item(l) : -1.0;
            gj_scope_pop();
            if (i == 5) gj_no_grad_pop();
        }
        out[mode][NSTEP] = gj_tensor_item_at(m.p[0], 3);
        out[mode][NSTEP + 1] = gj_tensor_item_at(m.p[3], 1);
        if (mode == 1) {
            gj_ca_stats c;
            gj_step_stats(&c);
            assert_int_equal(c.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 0);
            assert_int_equal(c.fallbacks_by_reason[GJ_CA_INCOMPATIBLE_MODE], 1);
            assert_int_equal(c.backwards, NSTEP);
        }
        gj_step_free(s);
        gj_optim_free(o);
        model_free(&m);
    }
    assert_memory_equal(rcs[0], rcs[1], sizeof rcs[0]);
    assert_int_equal(rcs[0][5], -1); /* no_grad: nothing to differentiate */
    assert_memory_equal(out[0], out[1], sizeof out[0]);
}

/* ------------------------------------------------------------- guards */

/* A parameter given another dtype by set_ between steps is another
 * variant: the step traces again (eager's results: a bf16 parameter) and
 * the earlier variant is not run on it. */
static void test_guard_set_dtype(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    double loss[2][NSTEP];
    for (int mode = 0; mode < 2; mode++) {
        model m;
        model_init(&m, GJ_F32, 3);
        gj_tensor *ps[NP] = {m.p[0], m.p[1], m.p[2], m.p[3]};
        gj_optim *o = gj_sgd_new(NP, ps, 0.05, 0.0, 0.0);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *s = gj_step_new(mlp_loss, &m, o, &so);
        gjt_rng r;
        gjt_rng_seed(&r, 9);
        gj_step_reset_stats();
        for (int i = 0; i < NSTEP; i++) {
            if (i == NSTEP / 2) { /* every parameter to f64 */
                for (int k = 0; k < NP; k++) {
                    gj_tensor *c = gj_cast(ps[k], GJ_F64);
                    gj_no_grad_push();
                    assert_int_equal(gj_tensor_set_(ps[k], c), 0);
                    gj_no_grad_pop();
                    gj_release(c);
                }
                m.dt = GJ_F64;
            }
            gj_scope_push();
            int64_t b = 6;
            gj_tensor *x = gjt_uniform(&r, m.dt, 2, (int64_t[]){b, IN}, -1, 1);
            gj_tensor *y = gjt_labels(&r, 1, &b, OUT);
            gj_tensor *in[2] = {x, y}, *l = NULL;
            if (gj_step_run(s, 2, in, &l) != 0) fail_msg("step %d: %s", i, gj_last_error());
            loss[mode][i] = gj_tensor_item(l);
            gj_scope_pop();
        }
        if (mode == 1) {
            gj_ca_stats c;
            gj_step_stats(&c);
            assert_int_equal(c.fallbacks, 0);
            assert_int_equal(c.compiles + c.disk_hits + c.instantiations, 2);
        }
        gj_step_free(s);
        gj_optim_free(o);
        model_free(&m);
    }
    assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
}

/* A constant read by the step function is read at run time: changing its
 * values in place between steps changes the compiled step's results as it
 * changes eager's. */
static void test_constant_read_at_run_time(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    double loss[2][NSTEP];
    for (int mode = 0; mode < 2; mode++) {
        model m;
        model_init(&m, GJ_F32, 4);
        m.mask = gj_ones(GJ_F32, 1, (int64_t[]){HID});
        gj_scope_keep(m.mask);
        gj_tensor *ps[NP] = {m.p[0], m.p[1], m.p[2], m.p[3]};
        gj_optim *o = gj_adamw_new(NP, ps, 1e-2, 0.9, 0.999, 1e-8, 0.0);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *s = gj_step_new(mlp_loss, &m, o, &so);
        gjt_rng r;
        gjt_rng_seed(&r, 10);
        for (int i = 0; i < NSTEP; i++) {
            gj_no_grad_push();
            assert_int_equal(gj_mul_scalar_(m.mask, 0.9), 0);
            gj_no_grad_pop();
            gj_scope_push();
            int64_t b = 4;
            gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, IN}, -1, 1);
            gj_tensor *y = gjt_labels(&r, 1, &b, OUT);
            gj_tensor *in[2] = {x, y}, *l = NULL;
            assert_int_equal(gj_step_run(s, 2, in, &l), 0);
            loss[mode][i] = gj_tensor_item(l);
            gj_scope_pop();
        }
        gj_step_free(s);
        gj_optim_free(o);
        model_free(&m);
    }
    assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
}

/* A step program is a disk hit when the memory cache is gone (what a new
 * process sees), with the same results. */
static void test_disk(void **st) {
    (void)st;
    char dir[] = "/tmp/gj-step-disk-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    gj_jit_clear_cache();
    run_cfg c = {.dt = GJ_F32, .adamw = true, .drop = 0.1};
    gj_ca_stats s = check("into the disk cache", &c, 0);
    assert_int_equal(s.compiles, 1);
    gj_jit_clear_cache();
    s = check("from the disk cache", &c, 0);
    assert_int_equal(s.compiles, 0);
    assert_int_equal(s.disk_hits, 1);
    gj_jit_clear_cache();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    const char *env = getenv("GRADJIT_CACHE_DIR");
    gj_jit_set_disk_cache(env && *env && strcmp(env, "off") != 0 ? env : NULL);
}

/* ---------------------------------------------------- checkpoint regions */

enum { CK_L = 3, CK_B = 16, CK_C = 32 };

typedef struct ck_model {
    gj_tensor *w1[CK_L], *w2[CK_L], *b1[CK_L];
    gj_tensor *head;
    gj_ckpt_policy_fn policy;
    double drop;
} ck_model;

static gj_ckpt_policy save_all(const char *op, int pos, void *d) {
    (void)op, (void)pos, (void)d;
    return GJ_CKPT_MUST_SAVE;
}

/* torch's selective checkpointing: keep matmuls, recompute the rest */
static gj_ckpt_policy save_matmuls(const char *op, int pos, void *d) {
    (void)pos, (void)d;
    return strcmp(op, "linear") == 0 || strcmp(op, "matmul") == 0 ? GJ_CKPT_PREFER_SAVE
                                                                    : GJ_CKPT_PREFER_RECOMPUTE;
}

typedef struct ck_layer {
    ck_model *m;
    int l;
} ck_layer;

/* One residual block: x + W2 gelu(W1 x + b1), dropout inside. */
static int ck_block(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    ck_layer *cl = user;
    (void)n_in, (void)n_out;
    ck_model *m = cl->m;
    gj_tensor *h = gj_gelu(gj_linear(in[0], m->w1[cl->l], m->b1[cl->l]));
    if (m->drop > 0) h = gj_dropout(h, m->drop, true);
    out[0] = gj_add(in[0], gj_linear(h, m->w2[cl->l], NULL));
    return out[0] ? 0 : -1;
}

static gj_tensor *ck_loss(void *ctx, int n_in, gj_tensor *const *in) {
    ck_model *m = ctx;
    (void)n_in;
    gj_tensor *x = in[0];
    for (int l = 0; l < CK_L && x; l++) {
        ck_layer cl = {m, l};
        gj_tensor *y = NULL;
        if (gj_checkpoint(ck_block, &cl, 1, &x, 1, &y, m->policy, NULL) != 0) return NULL;
        x = y;
    }
    gj_tensor *o = x ? gj_linear(x, m->head, NULL) : NULL;
    return o ? gj_mean(gj_mul(o, o), 0, NULL, false) : NULL;
}

/* Three checkpointed residual blocks with dropout under each policy
 * (recompute everything, save everything, save the matmuls): the
 * compiled step runs compiled and equals eager bit for bit; its peak of
 * tensor bytes over a step is never above eager's (the regions' saved
 * sets are eager's, and a value a region recomputes is recomputed in the
 * compiled backward too, never kept from the forward). */
static void test_checkpoint_policies(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    gj_ckpt_policy_fn pols[3] = {NULL, save_all, save_matmuls};
    for (int pi = 0; pi < 3; pi++) {
        int64_t recomputed = 0;
        double loss[2][NSTEP], *fin[2];
        int64_t peak[2], nfin = 0;
        for (int mode = 0; mode < 2; mode++) {
            ck_model m;
            memset(&m, 0, sizeof m);
            m.policy = pols[pi];
            m.drop = 0.1;
            gjt_rng r;
            gjt_rng_seed(&r, 21);
            gj_tensor *ps[3 * CK_L + 1];
            int np = 0;
            for (int l = 0; l < CK_L; l++) {
                ps[np++] = m.w1[l] = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){2 * CK_C, CK_C}, -.2, .2);
                ps[np++] = m.b1[l] = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){2 * CK_C}, -.1, .1);
                ps[np++] = m.w2[l] = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){CK_C, 2 * CK_C}, -.2, .2);
            }
            ps[np++] = m.head = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, CK_C}, -.3, .3);
            for (int k = 0; k < np; k++) assert_int_equal(gj_set_requires_grad(ps[k], true), 0);
            gj_optim *o = gj_adamw_new(np, ps, 1e-2, 0.9, 0.999, 1e-8, 0.0);
            gj_step_opts so = {.eager = mode == 0};
            gj_step *s = gj_step_new(ck_loss, &m, o, &so);
            gj_manual_seed(3);
            gj_step_reset_stats();
            peak[mode] = 0;
            for (int i = 0; i < NSTEP; i++) {
                int64_t rc0 = gj_ag_ckpt_recomputed();
                gj_scope_push();
                gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){CK_B, CK_C}, -1, 1);
                gj_mem m0;
                gj_mem_stats(&m0);
                gj_mem_reset_peak();
                gj_tensor *l = NULL;
                if (gj_step_run(s, 1, &x, &l) != 0) fail_msg("step %d: %s", i, gj_last_error());
                gj_mem m1;
                gj_mem_stats(&m1);
                if (i >= 2 && m1.peak_bytes - m0.live_bytes > peak[mode])
                    peak[mode] = m1.peak_bytes - m0.live_bytes; /* (a cached step) */
                loss[mode][i] = gj_tensor_item(l);
                gj_scope_pop();
                /* recomputed ops: eager's per step; the compiled step's
                 * first run traces the forward and records the same
                 * replay into its program, which runs that step and the
                 * later ones (no replay, no eager backward) */
                int64_t rc = gj_ag_ckpt_recomputed() - rc0;
                if (mode == 0) recomputed = rc;
                else assert_int_equal(rc, i == 0 ? recomputed : 0);
            }
            if (mode == 1) {
                gj_ca_stats c;
                gj_step_stats(&c);
                if (c.fallbacks) fail_msg("policy %d: %s", pi, gj_compiled_autograd_last_fallback());
            }
            fin[mode] = all_values(ps, np, &nfin);
            gj_step_free(s);
            gj_optim_free(o);
            for (int k = 0; k < np; k++) gj_release(ps[k]);
        }
        print_message("  policy %d: %lld ops recomputed a step; step peak %lld bytes eager, %lld "
                      "compiled\n",
                      pi, (long long)recomputed, (long long)peak[0], (long long)peak[1]);
        assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
        assert_memory_equal(fin[0], fin[1], (size_t)nfin * sizeof(double));
        assert_true(peak[1] <= peak[0]);
        free(fin[0]);
        free(fin[1]);
    }
}

/* ---------------------------------------------------------- bad input */

/* A traced run's forward is eager: the blocks it freed go back to the
 * system before the program runs the step (the program's buffers are
 * other sizes), so the compiled step never holds the eager step's cache
 * beside its own: after the first run the cache holds what the program's
 * run left, as after every later run; and the later runs map nothing new. */
static void test_traced_run_returns_the_cache(void **st) {
    (void)st;
    model m;
    model_init(&m, GJ_F32, 5);
    gj_tensor *ps[NP] = {m.p[0], m.p[1], m.p[2], m.p[3]};
    gj_optim *o = gj_adamw_new(NP, ps, 1e-2, 0.9, 0.999, 1e-8, 0.0);
    gj_step *s = gj_step_new(mlp_loss, &m, o, NULL);
    gjt_rng r;
    gjt_rng_seed(&r, 4);
    int64_t cached[3];
    for (int i = 0; i < 3; i++) {
        gj_scope_push();
        int64_t b = 6;
        gj_tensor *in[2] = {gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, IN}, -1, 1),
                            gjt_labels(&r, 1, &b, OUT)};
        assert_int_equal(gj_step_run(s, 2, in, NULL), 0);
        gj_mem after;
        gj_mem_stats(&after);
        cached[i] = after.cached_bytes;
        gj_scope_pop();
    }
    assert_true(cached[0] > 0); /* (a program run caches) */
    assert_int_equal(cached[1], cached[0]);
    assert_int_equal(cached[2], cached[0]);
    gj_step_free(s);
    gj_optim_free(o);
    model_free(&m);
}

static void test_bad_input(void **st) {
    (void)st;
    model m;
    model_init(&m, GJ_F32, 5);
    gj_tensor *ps[NP] = {m.p[0], m.p[1], m.p[2], m.p[3]};
    gj_optim *o = gj_sgd_new(NP, ps, 0.1, 0.0, 0.0);
    gj_clear_error();
    assert_null(gj_step_new(NULL, &m, o, NULL));
    assert_true(gjt_error_has("fn is NULL"));
    assert_null(gj_step_new(mlp_loss, &m, NULL, NULL));
    assert_true(gjt_error_has("opt is NULL"));
    gj_step *s = gj_step_new(mlp_loss, &m, o, NULL);
    assert_non_null(s);
    assert_int_equal(gj_step_run(NULL, 0, NULL, NULL), -1);
    assert_true(gjt_error_has("step is NULL"));
    assert_int_equal(gj_step_run(s, 2, NULL, NULL), -1);
    gj_tensor *in[2] = {NULL, NULL};
    assert_int_equal(gj_step_run(s, 2, in, NULL), -1);
    assert_true(gjt_error_has("in[0]"));
    gj_step_free(s);
    gj_step_free(NULL);
    gj_optim_free(o);
    model_free(&m);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f32_adamw),
        cmocka_unit_test(test_f64_adamw),
        cmocka_unit_test(test_bf16_adamw),
        cmocka_unit_test(test_autocast),
        cmocka_unit_test(test_autocast_rules),
        cmocka_unit_test(test_f32_sgd),
        cmocka_unit_test(test_lion),
        cmocka_unit_test(test_dropout_constant_keep),
        cmocka_unit_test(test_eval),
        cmocka_unit_test(test_clip),
        cmocka_unit_test(test_variants),
        cmocka_unit_test(test_dynamic_batches),
        cmocka_unit_test(test_untraceable),
        cmocka_unit_test(test_checkpoint_policies),
        cmocka_unit_test(test_anomaly_mode),
        cmocka_unit_test(test_compiler_fallbacks),
        cmocka_unit_test(test_guards),
        cmocka_unit_test(test_guard_set_dtype),
        cmocka_unit_test(test_constant_read_at_run_time),
        cmocka_unit_test(test_disk),
        cmocka_unit_test(test_traced_run_returns_the_cache),
        cmocka_unit_test(test_bad_input),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
