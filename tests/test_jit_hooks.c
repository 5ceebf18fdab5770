/* SPDX-License-Identifier: MIT */
/*
 * test_jit_hooks.c - hooks inside compiled backwards (jit/run/backward.c) and
 * the guards that run after each hook call.
 *
 * Every scenario runs the same steps twice on a fresh model: once with
 * compiled autograd off (the reference) and once with it on, and checks
 *   (a) the fallbacks are counted under the expected reason,
 *   (b) every .grad (and the bucket a hook swapped in) equals the eager
 *       run's bit for bit after every step,
 *   (c) one "fell back" line on stderr for the key (none in quiet mode),
 *   (d) once a key is eager-only, later steps neither capture nor compile,
 * and the exact number of hook calls (the semantics documented in
 * docs/fallbacks.md): a tensor hook's set_ guard abandons the compiled run
 * and the eager engine runs that backward again, so the tensor hooks of
 * that step run twice; a record_stream guard (tensor or post-accumulate
 * hook) lets the compiled run finish, so every hook runs once.
 * Also: the order of hook calls and a gradient a hook keeps (never written
 * behind its back), a failing hook (hook_guard, the eager error), a hook on
 * the loss and accumulation into an existing .grad.
 *
 * Model: x[3, 6] -> tanh(x @ w^T + b) -> mean; w [4, 6], b [4] are leaves.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NSTEPS 5
#define NW 24
#define NB 4
#define NBUCKET 32
#define NVALS (NW + NB + NBUCKET)

typedef enum kind {
    K_HOOK_RS = 0, /* tensor hook on the non-leaf h: record_stream(grad) from step `from` */
    K_POST_RS,     /* post-accumulate hook on w: record_stream(w.grad) from step `from` */
    K_SET,         /* tensor hook on w: set_(w.grad, view of bucket) from step `from` */
} kind;

typedef struct scen {
    kind k;
    int from;         /* first step at which the hook does its effect */
    gj_dtype bucket_dt; /* K_SET: dtype of the flat bucket */
    /* state of one run */
    int step, calls;
    bool swapped;      /* K_SET: w.grad already swapped in this step */
    gj_tensor *w, *b;  /* leaves (owned) */
    gj_tensor *bucket; /* K_SET: this step's flat bucket (owned) */
    gj_stream *s;
} scen;

/* Gradient hook: records a stream from step `from`, returns grad * 0.5. */
static gj_tensor *hook_rs(gj_tensor *grad, void *user) {
    scen *sc = user;
    sc->calls++;
    if (sc->step >= sc->from) assert_int_equal(gj_tensor_record_stream(grad, sc->s), 0);
    return gj_mul_scalar(grad, 0.5);
}

static void post_rs(gj_tensor *leaf, void *user) {
    scen *sc = user;
    sc->calls++;
    if (sc->step >= sc->from)
        assert_int_equal(gj_tensor_record_stream(gj_tensor_grad(leaf), sc->s), 0);
}

/* From step `from`, once per step: w.grad := a [4, 6] view at offset 4 of
 * the flat bucket (set_), the ZeRO bucket idiom. Keeps the gradient. */
static gj_tensor *hook_set(gj_tensor *grad, void *user) {
    (void)grad;
    scen *sc = user;
    sc->calls++;
    if (sc->step < sc->from || sc->swapped) return NULL;
    gj_tensor *v = gj_view(gj_narrow(sc->bucket, 0, 4, NW), 2, (int64_t[]){4, 6});
    assert_non_null(v);
    assert_int_equal(gj_tensor_set_(gj_tensor_grad(sc->w), v), 0);
    sc->swapped = true;
    return NULL;
}

static void model_init(scen *sc) {
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    sc->w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    sc->b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(sc->w, true), 0);
    assert_int_equal(gj_set_requires_grad(sc->b, true), 0);
    if (sc->k == K_POST_RS)
        assert_true(gj_register_post_accumulate_grad_hook(sc->w, post_rs, sc) > 0);
    if (sc->k == K_SET) assert_true(gj_register_hook(sc->w, hook_set, sc) > 0);
    sc->s = gj_stream_new();
    assert_non_null(sc->s);
}

static void model_free(scen *sc) {
    assert_int_equal(gj_stream_synchronize(sc->s), 0);
    gj_stream_free(sc->s);
    gj_release(sc->w);
    gj_release(sc->b);
    if (sc->bucket) gj_release(sc->bucket);
    sc->bucket = NULL;
}

/* One step: fresh .grads (K_SET: an f32 zero .grad for w and a new bucket
 * of 0.25), a backward, and the values of w.grad, b.grad, bucket. */
static void one_step(scen *sc, bool compiled, double *vals) {
    gjt_rng r;
    gjt_rng_seed(&r, 500 + (uint64_t)sc->step);
    assert_int_equal(gj_tensor_set_grad(sc->b, NULL), 0);
    if (sc->k == K_SET) {
        if (sc->bucket) gj_release(sc->bucket);
        sc->bucket = gj_full(sc->bucket_dt, 1, (int64_t[]){NBUCKET}, 0.25);
        gj_tensor *z = gj_zeros(GJ_F32, 2, (int64_t[]){4, 6});
        assert_int_equal(gj_tensor_set_grad(sc->w, z), 0);
        gj_release(z);
        sc->swapped = false;
    } else {
        assert_int_equal(gj_tensor_set_grad(sc->w, NULL), 0);
    }
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
    gj_tensor *h = gj_linear(x, sc->w, sc->b);
    if (sc->k == K_HOOK_RS) assert_true(gj_register_hook(h, hook_rs, sc) > 0);
    assert_int_equal(gj_backward(gj_mean(gj_tanh(h), 0, NULL, false), NULL), 0);
    gj_release(x);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    memset(vals, 0, NVALS * sizeof *vals);
    double *gw = gjt_values(gj_tensor_grad(sc->w)), *gb = gjt_values(gj_tensor_grad(sc->b));
    assert_true(gw && gb);
    memcpy(vals, gw, NW * sizeof *vals);
    memcpy(vals + NW, gb, NB * sizeof *vals);
    free(gw);
    free(gb);
    if (sc->bucket) {
        double *bv = gjt_values(sc->bucket);
        assert_non_null(bv);
        memcpy(vals + NW + NB, bv, NBUCKET * sizeof *vals);
        free(bv);
    }
    sc->step++;
}

/* Runs the scenario; vals[NSTEPS][NVALS]; *calls: hook calls in all. */
static void run_all(scen tmpl, bool compiled, double (*vals)[NVALS], int *calls) {
    scen sc = tmpl;
    model_init(&sc);
    for (int s = 0; s < NSTEPS; s++) one_step(&sc, compiled, vals[s]);
    *calls = sc.calls;
    model_free(&sc);
}

/* Lines of "fell back" on stderr while fn(ctx) runs. */
static int stderr_fallback_lines(void (*fn)(void *), void *ctx) {
    char path[] = "/tmp/gj_test_jit_hooks_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0);
    assert_true(dup2(fd, 2) >= 0);
    fn(ctx);
    fflush(stderr);
    assert_true(dup2(saved, 2) >= 0);
    close(saved);
    FILE *f = fdopen(fd, "r");
    assert_non_null(f);
    rewind(f);
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, "gradjit: compiled autograd fell back to eager")) n++;
    fclose(f);
    unlink(path);
    return n;
}

typedef struct compiled_run {
    scen tmpl;
    double (*vals)[NVALS];
    int calls;
} compiled_run;

static void do_compiled(void *vctx) {
    compiled_run *c = vctx;
    run_all(c->tmpl, true, c->vals, &c->calls);
}

/* The whole check for one scenario: the expected reason (or -1: no
 * fallback), the step at which the guard trips, and the expected hook
 * calls of the compiled run beyond one per step (tensor hooks run again in
 * the step whose run a guard abandoned). */
static void check_scenario(scen tmpl, int reason, int extra_calls) {
    int64_t live0 = gjt_live_bytes();
    double want[NSTEPS][NVALS], got[NSTEPS][NVALS];
    int want_calls;
    run_all(tmpl, false, want, &want_calls);
    assert_int_equal(want_calls, NSTEPS);
    for (int quiet = 0; quiet < 2; quiet++) {
        gj_jit_clear_cache();
        gj_compiled_autograd_reset_stats();
        gj_compiled_autograd_set_quiet(quiet != 0);
        compiled_run c = {tmpl, got, 0};
        int lines = stderr_fallback_lines(do_compiled, &c);
        gj_ca_stats s = gjt_ca_now();
        for (int st = 0; st < NSTEPS; st++) {
            if (memcmp(got[st], want[st], sizeof want[st]) != 0) {
                for (int i = 0; i < NVALS; i++)
                    if (got[st][i] != want[st][i])
                        print_error("step %d value %d: compiled %.17g eager %.17g\n", st, i,
                                    got[st][i], want[st][i]);
            }
            assert_memory_equal(got[st], want[st], sizeof want[st]);
        }
        /* (d): one capture and compile in all (a program found on disk
         * instead); every backward counts once, so a step 0 that compiled
         * and tripped counts as a fallback, not as a compile */
        assert_int_equal(s.compiles + s.disk_hits + (reason >= 0 && tmpl.from == 0), 1);
        assert_int_equal(c.calls, NSTEPS + extra_calls);
        if (reason < 0) {
            assert_int_equal(s.fallbacks, 0);
            assert_int_equal(s.mem_hits, NSTEPS - 1);
            assert_int_equal(lines, 0);
            continue;
        }
        /* (a) the tripping step and every later one, all under reason */
        int n_fb = NSTEPS - tmpl.from;
        assert_int_equal(s.fallbacks, n_fb);
        assert_int_equal(s.fallbacks_by_reason[reason], n_fb);
        /* cached runs up to the trip (the tripping step is a fallback) */
        assert_int_equal(s.mem_hits, tmpl.from > 0 ? tmpl.from - 1 : 0);
        assert_non_null(strstr(gj_compiled_autograd_last_fallback(), gj_ca_reason_name(reason)));
        assert_int_equal(lines, quiet ? 0 : 1); /* (c) */
    }
    gj_compiled_autograd_set_quiet(true);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* 1. a gradient hook calls record_stream on the gradient it receives
 * (from the first compiled run on). */
static void test_hook_record_stream(void **st) {
    (void)st;
    check_scenario((scen){.k = K_HOOK_RS, .from = 1}, GJ_CA_RECORD_STREAM, 0);
}

/* 2. a post-accumulate-grad hook calls record_stream on the .grad. */
static void test_post_hook_record_stream(void **st) {
    (void)st;
    check_scenario((scen){.k = K_POST_RS, .from = 1}, GJ_CA_RECORD_STREAM, 0);
}

/* 3. a hook set_'s w's f32 .grad to a bf16 view into a flat bucket: the
 * guard abandons the compiled run, eager runs the backward (the hook runs a
 * second time in that step) and accumulates in bf16 into the bucket. */
static void test_set_bf16_bucket(void **st) {
    (void)st;
    check_scenario((scen){.k = K_SET, .from = 1, .bucket_dt = GJ_BF16}, GJ_CA_SET_MISMATCH, 1);
}

/* 4. the same set_ with an f32 bucket (same dtype and shape): no fallback,
 * the compiled run accumulates into the bucket's memory. */
static void test_set_same_meta_stays_compiled(void **st) {
    (void)st;
    check_scenario((scen){.k = K_SET, .from = 0, .bucket_dt = GJ_F32}, -1, 0);
}

/* 9. hooks that change behaviour after the capture: record_stream from
 * step 3 (compiled at step 0, cached at 1 and 2), and set_ to bf16 from
 * step 3 (abandoned run, the hook runs twice in step 3). */
static void test_hook_changes_record_stream(void **st) {
    (void)st;
    check_scenario((scen){.k = K_HOOK_RS, .from = 3}, GJ_CA_RECORD_STREAM, 0);
}

static void test_post_hook_changes_record_stream(void **st) {
    (void)st;
    check_scenario((scen){.k = K_POST_RS, .from = 3}, GJ_CA_RECORD_STREAM, 0);
}

static void test_hook_changes_set_dtype(void **st) {
    (void)st;
    check_scenario((scen){.k = K_SET, .from = 3, .bucket_dt = GJ_BF16}, GJ_CA_SET_MISMATCH, 1);
}

/* ------------------------------------------------ order and pinning */

typedef struct logged {
    char log[64];
    int n;
    gj_tensor *kept;   /* a gradient a hook kept (gj_retain) */
    double kept_vals[12];
} logged;

typedef struct tag_user {
    logged *l;
    char c;
    double scale; /* 0: keep the gradient */
} tag_user;

static void log_char(logged *l, char c) {
    if (l->n < (int)sizeof l->log - 1) l->log[l->n++] = c;
    l->log[l->n] = '\0';
}

static gj_tensor *tag_hook(gj_tensor *grad, void *user) {
    tag_user *u = user;
    log_char(u->l, u->c);
    return u->scale != 0.0 ? gj_mul_scalar(grad, u->scale) : NULL;
}

static void tag_post(gj_tensor *leaf, void *user) {
    (void)leaf;
    tag_user *u = user;
    log_char(u->l, u->c);
}

/* Keeps the first gradient it sees (h's, [3, 4]) and a copy of its values. */
static gj_tensor *keep_hook(gj_tensor *grad, void *user) {
    logged *l = user;
    if (!l->kept) {
        l->kept = gj_retain(grad);
        assert_int_equal(gj_tensor_to_f64(grad, l->kept_vals), 0);
    }
    return NULL;
}

/* Steps of the order model; log of step i in logs[i], grads in vals[i]. */
static void order_run(bool compiled, int steps, char (*logs)[64], double (*vals)[NW + NB]) {
    gjt_rng r;
    gjt_rng_seed(&r, 78);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    gj_tensor *b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_set_requires_grad(b, true), 0);
    logged l = {{0}, 0, NULL, {0}};
    tag_user uw = {&l, 'W', 2.0}, ub = {&l, 'B', 0.0}, uh = {&l, 'H', 0.0}, uh2 = {&l, 'I', -1.5},
             upw = {&l, 'P', 0.0};
    assert_true(gj_register_hook(w, tag_hook, &uw) > 0);
    assert_true(gj_register_post_accumulate_grad_hook(b, tag_post, &ub) > 0);
    assert_true(gj_register_post_accumulate_grad_hook(w, tag_post, &upw) > 0);
    for (int st = 0; st < steps; st++) {
        l.n = 0;
        l.log[0] = '\0';
        assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
        assert_int_equal(gj_tensor_set_grad(b, NULL), 0);
        gjt_rng_seed(&r, 900);
        gj_set_compiled_autograd(compiled);
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
        gj_tensor *h = gj_linear(x, w, b);
        assert_true(gj_register_hook(h, tag_hook, &uh) > 0);
        assert_true(gj_register_hook(h, tag_hook, &uh2) > 0);
        assert_true(gj_register_hook(h, keep_hook, &l) > 0);
        assert_int_equal(gj_backward(gj_mean(gj_tanh(h), 0, NULL, false), NULL), 0);
        gj_release(x);
        gj_scope_pop();
        gj_set_compiled_autograd(false);
        memcpy(logs[st], l.log, sizeof l.log);
        assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(w), vals[st]), 0);
        assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(b), vals[st] + NW), 0);
    }
    /* the gradient the hook kept was never written behind its back */
    double now[12];
    assert_non_null(l.kept);
    assert_int_equal(gj_tensor_numel(l.kept), 12);
    assert_int_equal(gj_tensor_to_f64(l.kept, now), 0);
    assert_memory_equal(now, l.kept_vals, sizeof now);
    gj_release(l.kept);
    gj_release(w);
    gj_release(b);
}

/* Several tensor hooks (two replacing, one keeping a reference to the
 * gradient) and post-accumulate hooks: the compiled program calls the tensor
 * hooks in the eager order and the post-accumulate hooks after every .grad
 * was written, in the eager order among themselves; gradients are the eager
 * ones, the kept gradient keeps its values, nothing falls back. */
static void test_hook_order_and_pinning(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    char elog[1][64], clog[3][64];
    double ev[1][NW + NB], cv[3][NW + NB];
    order_run(false, 1, elog, ev);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    order_run(true, 3, clog, cv);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 2);
    assert_int_equal(s.fallbacks, 0);
    char want[64];
    int n = 0;
    for (const char *c = elog[0]; *c; c++)
        if (*c != 'B' && *c != 'P') want[n++] = *c;
    for (const char *c = elog[0]; *c; c++)
        if (*c == 'B' || *c == 'P') want[n++] = *c;
    want[n] = '\0';
    assert_int_equal(strlen(elog[0]), 5);
    for (int i = 0; i < 3; i++) {
        assert_string_equal(clog[i], want);
        assert_memory_equal(cv[i], ev[0], sizeof ev[0]);
    }
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------ failing hook */

static int g_bad_step, g_bad_calls;
/* Returns a gradient of a wrong shape at step g_bad_step, else grad * 3. */
static gj_tensor *bad_hook(gj_tensor *grad, void *user) {
    int *step = user;
    g_bad_calls++;
    if (*step == g_bad_step) return gj_zeros(GJ_F32, 1, (int64_t[]){5});
    return gj_mul_scalar(grad, 3.0);
}

/* Backward status of each step in rcs[], gradients in vals[]. */
static void bad_run(bool compiled, int *rcs, double (*vals)[NW + NB]) {
    gjt_rng r;
    gjt_rng_seed(&r, 79);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    gj_tensor *b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_set_requires_grad(b, true), 0);
    for (int st = 0; st < NSTEPS; st++) {
        assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
        assert_int_equal(gj_tensor_set_grad(b, NULL), 0);
        gjt_rng_seed(&r, 901);
        gj_set_compiled_autograd(compiled);
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
        gj_tensor *h = gj_linear(x, w, b);
        assert_true(gj_register_hook(h, bad_hook, &st) > 0);
        rcs[st] = gj_backward(gj_mean(gj_tanh(h), 0, NULL, false), NULL);
        gj_release(x);
        gj_scope_pop();
        gj_set_compiled_autograd(false);
        memset(vals[st], 0, sizeof vals[st]);
        if (rcs[st] == 0) {
            assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(w), vals[st]), 0);
            assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(b), vals[st] + NW), 0);
        } else {
            assert_non_null(strstr(gj_last_error(), "returned a gradient of shape"));
            assert_null(gj_tensor_grad(w));
            assert_null(gj_tensor_grad(b));
        }
    }
    gj_release(w);
    gj_release(b);
}

/* A hook that returns a gradient of the wrong shape at step 2 (compiled at
 * step 0, cached at 1): the guard abandons the compiled run, the eager
 * engine runs the backward and reports the hook's error exactly as an
 * eager-only run does (so the hook ran twice in step 2); a hook's error
 * is not a cause that recurs, so later steps run compiled again, with the
 * eager gradients. */
static void test_hook_error_guard(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    int erc[NSTEPS], crc[NSTEPS];
    double ev[NSTEPS][NW + NB], cv[NSTEPS][NW + NB];
    g_bad_step = 2;
    g_bad_calls = 0;
    bad_run(false, erc, ev);
    assert_int_equal(g_bad_calls, NSTEPS);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    g_bad_calls = 0;
    bad_run(true, crc, cv);
    assert_int_equal(g_bad_calls, NSTEPS + 1);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles + s.disk_hits, 1);
    assert_int_equal(s.mem_hits, NSTEPS - 2); /* step 2's hit was abandoned: a fallback */
    assert_int_equal(s.fallbacks, 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 1);
    assert_memory_equal(crc, erc, sizeof erc);
    assert_int_equal(erc[2], -1);
    assert_memory_equal(cv, ev, sizeof ev);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------- root hook, accumulation */

static gj_tensor *times2(gj_tensor *grad, void *user) {
    (*(int *)user)++;
    return gj_mul_scalar(grad, 2.0);
}

/* Three backwards without clearing .grad: a hook on the loss (the seed's
 * gradient) and a replacing hook on leaf w whose .grad then exists and is
 * accumulated into. */
static void accum_run(bool compiled, double *vals, int *calls) {
    gjt_rng r;
    gjt_rng_seed(&r, 80);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    gj_tensor *b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_set_requires_grad(b, true), 0);
    assert_true(gj_register_hook(w, times2, calls) > 0);
    for (int st = 0; st < 3; st++) {
        gjt_rng_seed(&r, 902 + (uint64_t)st);
        gj_set_compiled_autograd(compiled);
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
        gj_tensor *loss = gj_mean(gj_tanh(gj_linear(x, w, b)), 0, NULL, false);
        assert_true(gj_register_hook(loss, times2, calls) > 0);
        assert_int_equal(gj_backward(loss, NULL), 0);
        gj_release(x);
        gj_scope_pop();
        gj_set_compiled_autograd(false);
    }
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(w), vals), 0);
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(b), vals + NW), 0);
    gj_release(w);
    gj_release(b);
}

static void test_root_hook_and_accumulation(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    double ev[NW + NB], cv[NW + NB];
    int ec = 0, cc = 0;
    accum_run(false, ev, &ec);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    accum_run(true, cv, &cc);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(ec, 6);
    assert_int_equal(cc, 6);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 2); /* without, then with an existing .grad */
    assert_int_equal(s.mem_hits, 1);
    assert_memory_equal(cv, ev, sizeof ev);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------- hooks that misuse references */

/* A hook that releases the gradient it was lent (borrowed), and one that
 * opens a scope and returns a tensor made in it without closing it. */
static gj_tensor *release_hook(gj_tensor *grad, void *user) {
    (void)user;
    gj_release(grad);
    return NULL;
}

static gj_tensor *open_scope_hook(gj_tensor *grad, void *user) {
    (void)user;
    gj_scope_push();
    return gj_mul_scalar(grad, 2.0);
}

/* Both are a clear error from gj_backward in both modes, every step: no
 * crash, no .grad written, nothing leaked, and the scope the hook left
 * open is closed (the step's own pop then closes the last scope). */
static void misuse_run(gj_grad_hook_fn fn, bool compiled, const char *want) {
    int64_t live0 = gjt_live_bytes();
    gjt_rng r;
    gjt_rng_seed(&r, 41);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    gj_set_compiled_autograd(compiled);
    for (int step = 0; step < 3; step++) {
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
        gj_tensor *h = gj_tanh(gj_matmul(x, gj_transpose(w, 0, 1)));
        assert_true(gj_register_hook(h, fn, NULL) > 0);
        assert_int_equal(gj_backward(gj_sum(gj_mul(h, h), 0, NULL, false), NULL), -1);
        if (!strstr(gj_last_error(), want)) print_error("error: %s\n", gj_last_error());
        assert_non_null(strstr(gj_last_error(), want));
        assert_null(gj_tensor_grad(w));
        gj_release(x);
        gj_scope_pop();
        gj_clear_error();
        gj_scope_pop(); /* no scope is left open: this pop has none to close */
        assert_non_null(strstr(gj_last_error(), "no scope is open"));
    }
    gj_set_compiled_autograd(false);
    gj_release(w);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_hook_releases_borrowed_grad(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    misuse_run(release_hook, false, "it is borrowed");
    gj_jit_clear_cache();
    misuse_run(release_hook, true, "it is borrowed");
    gj_jit_clear_cache();
}

static void test_hook_leaves_scope_open(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    misuse_run(open_scope_hook, false, "scope it opened still open");
    gj_jit_clear_cache();
    misuse_run(open_scope_hook, true, "scope it opened still open");
    gj_jit_clear_cache();
}

/* ------------------------- a transient failure in a hook is not for good */

static gj_tensor *double_hook(gj_tensor *grad, void *user) {
    (void)user;
    return gj_mul_scalar(grad, 2.0);
}

/* One step of the hooked model: 0 or -1 (the backward's status); the
 * gradient of w into g when it succeeded. Allocation k of the backward
 * fails when k > 0. */
static int64_t g_bwd_allocs; /* allocations of the last hooked_step's backward */

static int hooked_step(gj_tensor *w, int64_t k, double *g) {
    gjt_rng r;
    gjt_rng_seed(&r, 42);
    gj_scope_push();
    assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
    gj_tensor *h = gj_tanh(gj_matmul(x, gj_transpose(w, 0, 1)));
    assert_true(gj_register_hook(h, double_hook, NULL) > 0);
    gj_tensor *loss = gj_sum(gj_mul(h, h), 0, NULL, false);
    if (k > 0) gj_rt_alloc_fail_at(k);
    int64_t n0 = gj_rt_alloc_count();
    int rc = gj_backward(loss, NULL);
    g_bwd_allocs = gj_rt_alloc_count() - n0;
    gj_rt_alloc_fail_at(0);
    if (rc == 0) assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(w), g), 0);
    gj_scope_pop();
    return rc;
}

/* An allocation failing at any point of a hooked compiled backward (in the
 * hook, in the program, in the cache) fails that backward or sends it to
 * the eager engine, but never makes the key eager-only: the next clean
 * step runs compiled again, with eager's gradients. */
static void test_hook_oom_is_transient(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gj_jit_clear_cache();
    gjt_rng r;
    gjt_rng_seed(&r, 43);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    double ref[24], g[24];
    assert_int_equal(hooked_step(w, 0, ref), 0); /* eager */
    gj_set_compiled_autograd(true);
    assert_int_equal(hooked_step(w, 0, g), 0); /* compiles */
    assert_memory_equal(g, ref, sizeof ref);
    assert_int_equal(hooked_step(w, 0, g), 0); /* a memory hit: count its allocations */
    int64_t n_alloc = g_bwd_allocs;
    assert_true(n_alloc > 0);
    int failed = 0;
    for (int64_t k = 1; k <= n_alloc; k++) {
        int rc = hooked_step(w, k, g);
        failed += rc != 0;
        if (rc != 0) assert_true(gjt_error_has("memory"));
        gj_ca_stats before = gjt_ca_now();
        assert_int_equal(hooked_step(w, 0, g), 0);
        gj_ca_stats after = gjt_ca_now();
        char what[64];
        snprintf(what, sizeof what, "the clean step after allocation %lld failed", (long long)k);
        assert_true(gjt_ran_compiled(what, &before, &after, 1));
        assert_memory_equal(g, ref, sizeof ref);
    }
    assert_true(failed > 0);
    gj_set_compiled_autograd(false);
    gj_release(w);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hook_record_stream),
        cmocka_unit_test(test_post_hook_record_stream),
        cmocka_unit_test(test_set_bf16_bucket),
        cmocka_unit_test(test_set_same_meta_stays_compiled),
        cmocka_unit_test(test_hook_changes_record_stream),
        cmocka_unit_test(test_post_hook_changes_record_stream),
        cmocka_unit_test(test_hook_changes_set_dtype),
        cmocka_unit_test(test_hook_order_and_pinning),
        cmocka_unit_test(test_hook_error_guard),
        cmocka_unit_test(test_root_hook_and_accumulation),
        cmocka_unit_test(test_hook_releases_borrowed_grad),
        cmocka_unit_test(test_hook_leaves_scope_open),
        cmocka_unit_test(test_hook_oom_is_transient),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
