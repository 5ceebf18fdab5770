/* SPDX-License-Identifier: MIT */
/*
 * test_step_budget.c - the compiled step under a memory budget
 * (gj_step_opts.mem_budget): on a trainer-like MLP and a small transformer
 * block (layer norms, attention through gj_scaled_dot_product_attention,
 * a GELU MLP, residuals), with the budget at half the unbudgeted step's
 * planned peak, the losses and parameters equal the eager step's bit for
 * bit over several steps, the tensor bytes a run adds at its peak
 * (runtime's peak counter around the run) stay under the budget, and the
 * step reports what it recomputes; a budget too small fails the run with
 * the smallest peak the planner reaches, and that peak is then a budget
 * it meets; no budget (0) is today's program; bad arguments are refused.
 * Under a budget the first run traces the forward abstractly (shapes, no
 * values) and runs the program it made: it holds the program's peak, not
 * the eager step's; a function that needs a value is traced again. The
 * budget's choice is kept in the disk cache as a hint a later plan tries
 * first (one trial plan); a damaged hint is ignored.
 */
#include "gjtest.h"

#include "jit/jit.h"
#include "jit/plan/plan.h" /* gj_jit_remat_trials */
#include "runtime/rt.h"

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NSTEP = 5, MAXP = 48 };

/* ---------------------------------------------------------------- models */

typedef enum kind { MLP = 0, BLOCK = 1 } kind;

/* MLP: x[MB, MI] -> ML linears with GELUs -> a linear head ->
 * cross-entropy over MO classes.
 * BLOCK: x[TB, TT, TC] -> TL pre-norm transformer blocks (attention with
 * TH heads, causal, and a GELU MLP, each with a residual), then a head
 * over TV classes. Deep enough that the step's peak is its activations. */
enum { MB = 256, MI = 24, MH = 64, ML = 6, MO = 10 };
enum { TB = 2, TT = 64, TC = 32, TH = 4, TL = 3, TV = 12, TPL = 11 };

typedef struct model {
    kind k;
    gj_tensor *p[MAXP];
    int np;
    bool ckpt; /* MLP: layers 1 and 2 in a gj_checkpoint region (recompute all) */
    bool peek; /* BLOCK: reads a value of its forward (gj_tensor_item) */
    gj_tensor *big, *cst; /* BLOCK, alias: the input is a view of big, cst another */
    int calls; /* of loss_fn */
} model;

static gj_tensor *param(model *m, gjt_rng *r, int ndim, const int64_t *shape, double s) {
    gj_tensor *t = gjt_uniform(r, GJ_F32, ndim, shape, -s, s);
    assert_int_equal(gj_set_requires_grad(t, true), 0);
    m->p[m->np++] = t;
    return t;
}

static void model_init(model *m, kind k) {
    memset(m, 0, sizeof *m);
    m->k = k;
    gjt_rng r;
    gjt_rng_seed(&r, 17);
    if (k == MLP) {
        for (int l = 0; l < ML; l++) {
            param(m, &r, 2, (int64_t[]){MH, l ? MH : MI}, l ? 0.2 : 0.3);
            param(m, &r, 1, (int64_t[]){MH}, 0.1);
        }
        param(m, &r, 2, (int64_t[]){MO, MH}, 0.15);
        return;
    }
    for (int l = 0; l < TL; l++) { /* TPL parameters a block */
        for (int j = 0; j < 2; j++) { /* layer norms: weight, bias */
            param(m, &r, 1, (int64_t[]){TC}, 0.2);
            param(m, &r, 1, (int64_t[]){TC}, 0.1);
        }
        for (int j = 0; j < 4; j++) param(m, &r, 2, (int64_t[]){TC, TC}, 0.2); /* q k v proj */
        param(m, &r, 2, (int64_t[]){4 * TC, TC}, 0.2);
        param(m, &r, 1, (int64_t[]){4 * TC}, 0.1);
        param(m, &r, 2, (int64_t[]){TC, 4 * TC}, 0.1);
    }
    param(m, &r, 2, (int64_t[]){TV, TC}, 0.2);
}

static void model_free(model *m) {
    for (int k = 0; k < m->np; k++) {
        gj_tensor_set_grad(m->p[k], NULL);
        gj_release(m->p[k]);
    }
}

/* MLP layers 1 and 2 as one checkpoint region. */
static int two_layers(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    model *m = user;
    (void)n_in, (void)n_out;
    gj_tensor *h = in[0];
    for (int l = 1; l <= 2; l++) h = gj_gelu(gj_linear(h, m->p[2 * l], m->p[2 * l + 1]));
    out[0] = h;
    return h ? 0 : -1;
}

static gj_tensor *mlp_loss(model *m, gj_tensor *const *in) {
    gj_tensor *h = in[0];
    for (int l = 0; l < ML && h; l++) {
        if (m->ckpt && l == 1) {
            gj_tensor *y = NULL;
            if (gj_checkpoint(two_layers, m, 1, &h, 1, &y, NULL, NULL) != 0) return NULL;
            h = y;
            l = 2;
            continue;
        }
        h = gj_gelu(gj_linear(h, m->p[2 * l], m->p[2 * l + 1]));
    }
    return gj_cross_entropy(gj_linear(h, m->p[2 * ML], NULL), in[1]);
}

/* [TB, TT, TC] -> [TB, TH, TT, TC / TH] */
static gj_tensor *heads(gj_tensor *x) {
    return gj_transpose(gj_reshape(x, 4, (int64_t[]){TB, TT, TH, TC / TH}), 1, 2);
}

static gj_tensor *block_loss(model *m, gj_tensor *const *in) {
    gj_tensor *x = in[0];
    for (int l = 0; l < TL; l++) {
        gj_tensor *const *p = m->p + l * TPL;
        gj_tensor *h = gj_layer_norm(x, p[0], p[1], 1e-5);
        gj_tensor *q = heads(gj_linear(h, p[4], NULL)), *k = heads(gj_linear(h, p[5], NULL));
        gj_tensor *v = heads(gj_linear(h, p[6], NULL));
        gj_tensor *a = gj_scaled_dot_product_attention(q, k, v, true, 0.0, 0.0, false);
        a = gj_reshape(gj_transpose(a, 1, 2), 3, (int64_t[]){TB, TT, TC});
        x = gj_add(x, gj_linear(a, p[7], NULL));
        h = gj_layer_norm(x, p[2], p[3], 1e-5);
        h = gj_gelu(gj_linear(h, p[8], p[9]));
        x = gj_add(x, gj_linear(h, p[10], NULL));
        if (m->peek && l == 0 && !isfinite(gj_tensor_item_at(x, 0))) return NULL;
        if (m->cst && l == 0) x = gj_add(x, gj_mul_scalar(m->cst, 0.5));
    }
    gj_tensor *logits = gj_linear(x, m->p[TL * TPL], NULL);
    return gj_cross_entropy(gj_reshape(logits, 2, (int64_t[]){TB * TT, TV}), in[1]);
}

static gj_tensor *loss_fn(void *ctx, int n_in, gj_tensor *const *in) {
    model *m = ctx;
    (void)n_in;
    m->calls++;
    return m->k == MLP ? mlp_loss(m, in) : block_loss(m, in);
}

/* Step i's inputs (the same for every run). */
static void inputs(kind k, int i, gj_tensor **in) {
    gjt_rng r;
    gjt_rng_seed(&r, 100 + (uint64_t)i);
    if (k == MLP) {
        int64_t b = MB;
        in[0] = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){MB, MI}, -1, 1);
        in[1] = gjt_labels(&r, 1, &b, MO);
    } else {
        int64_t n = TB * TT;
        in[0] = gjt_uniform(&r, GJ_F32, 3, (int64_t[]){TB, TT, TC}, -1, 1);
        in[1] = gjt_labels(&r, 1, &n, TV);
    }
}

/* ------------------------------------------------------------------ runs */

typedef struct result {
    double loss[NSTEP];
    double *params;
    int64_t n_params;
    int64_t peak;       /* the most bytes a compiled run (not the first) added */
    int64_t first_peak; /* the most bytes the first run added */
    gj_step_memory mem; /* after the last run (compiled steps) */
    int rc;             /* the first failing run's code (0: none) */
    char err[512];
    int first_calls;    /* of the step function in the first run */
    int64_t first_mm;   /* eager matrix products in the first run (gj_rt_exec) */
    int64_t state_bytes; /* AdamW's m and v (made by the first run) */
} result;

typedef struct variation {
    bool ckpt, peek, alias; /* alias: the input shares its memory with a constant */
    bool computing;         /* gj_step_opts.trace_computing */
    int bad_label_step; /* a label out of range in this step's input (-1: none) */
} variation;

static double *all_values(gj_tensor *const *ts, int n, int64_t *total) {
    int64_t t = 0;
    for (int k = 0; k < n; k++) t += gj_tensor_numel(ts[k]);
    double *v = calloc((size_t)t + 1, sizeof *v);
    assert_non_null(v);
    int64_t at = 0;
    for (int k = 0; k < n; k++) {
        assert_int_equal(gj_tensor_to_f64(ts[k], v + at), 0);
        at += gj_tensor_numel(ts[k]);
    }
    *total = t;
    return v;
}

/* NSTEP AdamW steps of model k from the same weights and data: eager, or
 * compiled under budget (0: none). Stops at the first failing run. */
static result run_v(kind k, bool eager, size_t budget, variation v) {
    model m;
    model_init(&m, k);
    m.ckpt = v.ckpt;
    m.peek = v.peek;
    gj_optim *o = gj_adamw_new(m.np, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.01);
    assert_non_null(o);
    gj_step_opts so = {.eager = eager, .mem_budget = budget, .trace_computing = v.computing};
    gj_step *st = gj_step_new(loss_fn, &m, o, &so);
    assert_non_null(st);
    result res;
    memset(&res, 0, sizeof res);
    for (int i = 0; i < NSTEP; i++) {
        gj_scope_push();
        gj_tensor *in[2], *loss = NULL;
        inputs(k, i, in);
        if (v.alias) { /* in[0] becomes a view of m.big, whose other half is m.cst */
            if (!m.big) {
                m.big = gj_scope_keep(gj_zeros(GJ_F32, 3, (int64_t[]){2 * TB, TT, TC}));
                m.cst = gj_scope_keep(gj_narrow(m.big, 0, 0, TB)); /* the same memory */
                assert_int_equal(gj_copy_(m.cst, in[0]), 0);
            }
            gj_tensor *view = gj_narrow(m.big, 0, 0, TB);
            assert_int_equal(gj_copy_(view, in[0]), 0);
            in[0] = view;
        }
        if (i == v.bad_label_step) {
            int64_t *lab = gj_tensor_data(in[1]);
            lab[3] = k == MLP ? MO : TV;
        }
        int calls0 = m.calls;
        int64_t mm0 = gj_rt_exec_count(GJ_P_MATMUL);
        gj_mem m0, m1;
        gj_mem_stats(&m0);
        gj_mem_reset_peak();
        int rc = gj_step_run(st, 2, in, &loss);
        gj_mem_stats(&m1);
        if (rc != 0) {
            res.rc = rc;
            snprintf(res.err, sizeof res.err, "%s", gj_last_error());
            gj_scope_pop();
            break;
        }
        if (i > 0 && m1.peak_bytes - m0.live_bytes > res.peak) res.peak = m1.peak_bytes - m0.live_bytes;
        if (i == 0) {
            res.first_peak = m1.peak_bytes - m0.live_bytes;
            res.first_calls = m.calls - calls0;
            res.first_mm = gj_rt_exec_count(GJ_P_MATMUL) - mm0;
        }
        res.loss[i] = gj_tensor_item(loss);
        gj_scope_pop();
    }
    res.params = all_values(m.p, m.np, &res.n_params);
    res.state_bytes = 2 * 4 * res.n_params;
    if (!eager && res.rc == 0 && !v.peek) { /* (peek: an eager step) */
        if (gj_step_memory_stats(st, &res.mem) != 0) fail_msg("%s", gj_last_error());
    }
    gj_step_free(st);
    gj_optim_free(o);
    gj_release(m.cst);
    gj_release(m.big);
    model_free(&m);
    return res;
}

static result run_ck(kind k, bool eager, size_t budget, bool ckpt) {
    return run_v(k, eager, budget, (variation){.ckpt = ckpt, .bad_label_step = -1});
}

static result run(kind k, bool eager, size_t budget) { return run_ck(k, eager, budget, false); }

static void same(const char *what, const result *e, const result *c) {
    assert_int_equal(e->rc, 0);
    if (c->rc != 0) fail_msg("%s: %s", what, c->err);
    for (int i = 0; i < NSTEP; i++)
        if (memcmp(&e->loss[i], &c->loss[i], sizeof e->loss[i]) != 0)
            fail_msg("%s: step %d loss %.17g eager, %.17g compiled", what, i, e->loss[i],
                     c->loss[i]);
    assert_int_equal(e->n_params, c->n_params);
    int64_t bad = 0;
    for (int64_t k = 0; k < e->n_params; k++) bad += memcmp(&e->params[k], &c->params[k], 8) != 0;
    if (bad) fail_msg("%s: %lld parameter values differ", what, (long long)bad);
}

/* Half the unbudgeted step's planned peak: eager's bits, the run's peak
 * under the budget, values recomputed. */
static void half_budget(kind k, const char *what) {
    gj_compiled_autograd_set_quiet(true);
    result e = run(k, true, 0);
    result full = run(k, false, 0);
    same(what, &e, &full);
    assert_true(full.mem.planned_peak_bytes > 0);
    assert_int_equal(full.mem.budget_bytes, 0);
    assert_true(full.mem.recompute_flops == 0.0);
    size_t budget = (size_t)full.mem.planned_peak_bytes / 2;
    gj_step_reset_stats();
    result c = run(k, false, budget);
    gj_ca_stats s;
    gj_step_stats(&s);
    if (s.fallbacks) fail_msg("%s: %s", what, gj_compiled_autograd_last_fallback());
    same(what, &e, &c);
    print_message("  %s: planned peak %lld bytes unbudgeted (run %lld, saved %lld); budget %zu: "
                  "planned %lld, run %lld, saved %lld, %lld values and %.0f FLOPs recomputed; "
                  "first run %lld (eager %lld)\n",
                  what, (long long)full.mem.planned_peak_bytes, (long long)full.peak,
                  (long long)full.mem.saved_bytes, budget, (long long)c.mem.planned_peak_bytes,
                  (long long)c.peak, (long long)c.mem.saved_bytes,
                  (long long)c.mem.recomputed_values, c.mem.recompute_flops,
                  (long long)c.first_peak, (long long)e.first_peak);
    /* the first run traces the forward only and runs the program: it holds
     * less than the eager step (whose backward the budget would not bound) */
    assert_true(c.first_peak > 0 && c.first_peak < e.first_peak);
    assert_int_equal(c.mem.budget_bytes, (int64_t)budget);
    assert_true(c.mem.planned_peak_bytes <= (int64_t)budget);
    assert_true(c.peak > 0 && c.peak <= (int64_t)budget);
    assert_true(c.mem.recompute_flops > 0.0);
    assert_true(c.mem.recomputed_values > 0);
    assert_true(c.mem.saved_bytes < full.mem.saved_bytes);
    free(e.params);
    free(full.params);
    free(c.params);
}

/* Under a budget the first run traces its forward abstractly (shapes, no
 * values): the step function runs once, nothing of the forward is held
 * beyond the program's own peak, and the bits are eager's. A function
 * that reads a value of its forward is traced again computing (it runs
 * twice in the first run) and stays what it was without a budget: an
 * untraceable step, eager from then on. A label out of range in the first
 * step is refused with the eager step's message, nothing updated. */
static void test_first_trace_abstract(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    result e = run(BLOCK, true, 0);
    result full = run(BLOCK, false, 0);
    result old = run_v(BLOCK, false, 0, (variation){.computing = true, .bad_label_step = -1});
    same("abstract first trace, no budget", &e, &full);
    same("first trace computing", &e, &old);
    size_t budget = (size_t)full.mem.planned_peak_bytes / 2;
    gj_step_reset_stats();
    result c = run(BLOCK, false, budget);
    same("abstract first trace", &e, &c);
    gj_ca_stats s;
    gj_step_stats(&s);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles + s.mem_hits + s.disk_hits, NSTEP); /* (each run the program) */
    print_message("  first run: %lld bytes added (AdamW state %lld, later runs' peak %lld; "
                  "eager's first step %lld, unbudgeted compiled %lld (%lld, later %lld, traced "
                  "computing)), %d call(s) of the step function\n",
                  (long long)c.first_peak, (long long)c.state_bytes, (long long)c.peak,
                  (long long)e.first_peak, (long long)full.first_peak,
                  (long long)old.first_peak, (long long)old.peak, c.first_calls);
    assert_int_equal(c.first_calls, 1);
    assert_int_equal(full.first_calls, 1);
    assert_int_equal(old.first_calls, 1);
    /* the first run holds the program's peak and the state it makes, no
     * activation of a traced forward; with or without a budget */
    assert_true(c.first_peak <= c.peak + c.state_bytes + 65536);
    assert_true(full.first_peak <= full.peak + full.state_bytes + 65536);
    /* the forward computed once, by the program: no eager product on the
     * abstract inputs; traced computing, the eager forward ran them too */
    assert_int_equal(c.first_mm, 0);
    assert_int_equal(full.first_mm, 0);
    assert_true(old.first_mm > 0);
    assert_true(e.first_mm > 0);
    /* a function that reads a value: traced again computing, then eager */
    result pe = run_v(BLOCK, true, 0, (variation){.peek = true, .bad_label_step = -1});
    gj_step_reset_stats();
    result pc = run_v(BLOCK, false, budget, (variation){.peek = true, .bad_label_step = -1});
    same("a step function that reads a value", &pe, &pc);
    gj_step_stats(&s);
    assert_int_equal(s.compiles + s.mem_hits + s.disk_hits, 0);
    assert_int_equal(s.fallbacks, NSTEP); /* (untraceable: as without a budget) */
    assert_int_equal(pc.first_calls, 2);
    /* an input that shares its memory with a constant of the function: the
     * abstract proxy hides it, the guards do not; traced again computing */
    result ae = run_v(BLOCK, true, 0, (variation){.alias = true, .bad_label_step = -1});
    result ac = run_v(BLOCK, false, budget, (variation){.alias = true, .bad_label_step = -1});
    same("an input aliasing a constant", &ae, &ac);
    assert_int_equal(ac.first_calls, 2);
    free(ae.params);
    free(ac.params);
    /* a label out of range in the first step: eager's error, nothing updated */
    result le = run_v(BLOCK, true, 0, (variation){.bad_label_step = 0});
    result lc = run_v(BLOCK, false, budget, (variation){.bad_label_step = 0});
    assert_int_equal(le.rc, -1);
    assert_int_equal(lc.rc, -1);
    if (strcmp(le.err, lc.err) != 0) fail_msg("eager: %s\ncompiled: %s", le.err, lc.err);
    assert_int_equal(lc.n_params, le.n_params);
    assert_memory_equal(lc.params, le.params, (size_t)le.n_params * sizeof *le.params);
    free(e.params);
    free(full.params);
    free(old.params);
    free(c.params);
    free(pe.params);
    free(pc.params);
    free(le.params);
    free(lc.params);
}

static void test_mlp_half_budget(void **st) {
    (void)st;
    half_budget(MLP, "mlp");
}

static void test_block_half_budget(void **st) {
    (void)st;
    half_budget(BLOCK, "transformer block");
}

/* A budget too small: the first run fails (-1, nothing updated) naming
 * the smallest peak reached; that peak as the budget is met, with eager's
 * bits. */
static void test_budget_too_small(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    result e = run(BLOCK, true, 0);
    result c = run(BLOCK, false, 1024);
    assert_int_equal(c.rc, -1);
    const char *at = strstr(c.err, "the smallest peak the planner reaches is ");
    if (!strstr(c.err, "gj_step_run: the memory budget of 1024 bytes") || !at)
        fail_msg("message: %s", c.err);
    long long least = atoll(at + strlen("the smallest peak the planner reaches is "));
    assert_true(least > 1024);
    /* nothing updated: the parameters are the initial ones */
    model m;
    model_init(&m, BLOCK);
    int64_t n0;
    double *p0 = all_values(m.p, m.np, &n0);
    assert_int_equal(n0, c.n_params);
    assert_memory_equal(p0, c.params, (size_t)n0 * sizeof(double));
    free(p0);
    model_free(&m);
    result ok = run(BLOCK, false, (size_t)least);
    same("budget at the reported peak", &e, &ok);
    assert_true(ok.mem.planned_peak_bytes <= least);
    free(e.params);
    free(c.params);
    free(ok.params);
}

/* A checkpoint region is a constraint: its ops are never the budget's to
 * drop or keep (its policy recomputes everything here). The smallest
 * reachable peak (above the unconstrained model's: the region's values
 * are not candidates) as the budget: eager's bits. */
static void test_checkpoint_region(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    result e = run_ck(MLP, true, 0, true);
    result full = run_ck(MLP, false, 0, true);
    same("checkpointed, no budget", &e, &full);
    result c = run_ck(MLP, false, 1024, true);
    assert_int_equal(c.rc, -1);
    const char *at = strstr(c.err, "the smallest peak the planner reaches is ");
    if (!at) fail_msg("message: %s", c.err);
    long long least = atoll(at + strlen("the smallest peak the planner reaches is "));
    assert_true(least < full.mem.planned_peak_bytes);
    result ok = run_ck(MLP, false, (size_t)least, true);
    same("checkpointed, under a budget", &e, &ok);
    assert_true(ok.mem.planned_peak_bytes <= least);
    assert_true(ok.mem.recompute_flops > 0.0);
    print_message("  checkpointed mlp: planned peak %lld unbudgeted, %lld under %lld\n",
                  (long long)full.mem.planned_peak_bytes, (long long)ok.mem.planned_peak_bytes,
                  least);
    free(e.params);
    free(full.params);
    free(c.params);
    free(ok.params);
}


/* Flips the last byte of every file in dir (its checksum); with unlink,
 * removes them and dir. */
static void each_file(const char *dir, bool unlink_all) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    for (struct dirent *de; (de = readdir(d));) {
        if (de->d_name[0] == '.') continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (unlink_all) {
            unlink(path);
            continue;
        }
        int fd = open(path, O_RDWR);
        assert_true(fd >= 0);
        off_t end = lseek(fd, -1, SEEK_END);
        unsigned char c = 0;
        assert_int_equal(pread(fd, &c, 1, end), 1);
        c ^= 0x5a;
        assert_int_equal(pwrite(fd, &c, 1, end), 1);
        close(fd);
    }
    closedir(d);
    if (unlink_all) rmdir(dir);
}

/* The choice a budget's search made is kept in the disk cache: a later
 * plan of the same step (another process; here, after the memory cache
 * is cleared) makes one trial plan instead of a search, and gets the same
 * program with eager's bits; a damaged hint is no hint (a search again). */
static void test_budget_hint(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    char dir[] = "/tmp/gj-budget-hint-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    result e = run(BLOCK, true, 0);
    result full = run(BLOCK, false, 0);
    size_t budget = (size_t)full.mem.planned_peak_bytes / 2;
    result r[3];
    int64_t trials[3];
    for (int i = 0; i < 3; i++) {
        if (i == 2) each_file(dir, false);
        gj_jit_clear_cache();
        int64_t t0 = gj_jit_remat_trials();
        r[i] = run(BLOCK, false, budget);
        trials[i] = gj_jit_remat_trials() - t0;
        same(i == 0 ? "searched" : i == 1 ? "from the hint" : "hint damaged", &e, &r[i]);
        assert_int_equal(r[i].mem.planned_peak_bytes, r[0].mem.planned_peak_bytes);
        assert_int_equal(r[i].mem.recomputed_values, r[0].mem.recomputed_values);
        assert_true(r[i].mem.recomputed_values > 0);
        free(r[i].params);
    }
    print_message("  trial plans: %lld searching, %lld with the hint, %lld with it damaged\n",
                  (long long)trials[0], (long long)trials[1], (long long)trials[2]);
    assert_true(trials[0] > 2);
    assert_int_equal(trials[1], 1);
    assert_int_equal(trials[2], trials[0]);
    gj_jit_clear_cache();
    gj_jit_default_disk_cache();
    each_file(dir, true);
    free(e.params);
    free(full.params);
}

/* No budget is today's program; a budget it fits as it is changes no
 * plan and recomputes nothing; the setting gives the budget in MiB. */
static void test_no_budget_unchanged(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    result a = run(MLP, false, 0);
    result b = run(MLP, false, (size_t)1 << 40);
    same("a budget that fits", &a, &b);
    assert_int_equal(a.mem.planned_peak_bytes, b.mem.planned_peak_bytes);
    assert_int_equal(a.mem.saved_bytes, b.mem.saved_bytes);
    assert_true(b.mem.recompute_flops == 0.0 && b.mem.recomputed_values == 0);
    free(a.params);
    free(b.params);

    model m;
    model_init(&m, MLP);
    gj_optim *o = gj_adamw_new(m.np, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.0);
    setenv("GRADJIT_STEP_MEM_BUDGET_MB", "64", 1);
    gj_step *s = gj_step_new(loss_fn, &m, o, NULL);
    setenv("GRADJIT_STEP_MEM_BUDGET_MB", "lots", 1); /* ignored, with a warning */
    gj_step *s2 = gj_step_new(loss_fn, &m, o, NULL);
    unsetenv("GRADJIT_STEP_MEM_BUDGET_MB");
    assert_non_null(s);
    assert_non_null(s2);
    for (int i = 0; i < 2; i++) {
        gj_scope_push();
        gj_tensor *in[2];
        inputs(MLP, i, in);
        assert_int_equal(gj_step_run(s, 2, in, NULL), 0);
        assert_int_equal(gj_step_run(s2, 2, in, NULL), 0);
        gj_scope_pop();
    }
    gj_step_memory mm;
    assert_int_equal(gj_step_memory_stats(s, &mm), 0);
    assert_int_equal(mm.budget_bytes, (int64_t)64 << 20);
    assert_int_equal(gj_step_memory_stats(s2, &mm), 0);
    assert_int_equal(mm.budget_bytes, 0);
    gj_step_free(s);
    gj_step_free(s2);
    gj_optim_free(o);
    model_free(&m);
}

static void test_bad_arguments(void **st) {
    (void)st;
    model m;
    model_init(&m, MLP);
    gj_optim *o = gj_adamw_new(m.np, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.0);
    gj_step_opts ev = {.eval = true, .mem_budget = 1 << 20};
    assert_null(gj_step_new(loss_fn, &m, o, &ev));
    GJT_ASSERT_ERROR("opts.mem_budget");
    assert_true(gjt_error_has("eval step"));
    gj_step_opts neg = {.mem_budget = (size_t)-4096};
    assert_null(gj_step_new(loss_fn, &m, o, &neg));
    GJT_ASSERT_ERROR("opts.mem_budget");
    gj_step_memory mm;
    assert_int_equal(gj_step_memory_stats(NULL, &mm), -1);
    GJT_ASSERT_ERROR("gj_step_memory_stats");
    gj_step_opts ok = {.mem_budget = 1 << 20};
    gj_step *s = gj_step_new(loss_fn, &m, o, &ok);
    assert_non_null(s);
    assert_int_equal(gj_step_memory_stats(s, NULL), -1);
    GJT_ASSERT_ERROR("gj_step_memory_stats");
    assert_int_equal(gj_step_memory_stats(s, &mm), -1); /* nothing compiled yet */
    assert_true(gjt_error_has("no compiled program yet"));
    gj_step_free(s);
    gj_optim_free(o);
    model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_half_budget),
        cmocka_unit_test(test_block_half_budget),
        cmocka_unit_test(test_budget_too_small),
        cmocka_unit_test(test_checkpoint_region),
        cmocka_unit_test(test_no_budget_unchanged),
        cmocka_unit_test(test_first_trace_abstract),
        cmocka_unit_test(test_budget_hint),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
