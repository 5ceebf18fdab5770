/* SPDX-License-Identifier: MIT */
/*
 * test_jit_custom.c - custom ops inside compiled backwards (jit/record.c
 * rec_call_custom, the plan's call instructions, jit/run/guards.c call_custom).
 *
 * Every scenario runs NSTEPS training steps twice from the same start: once
 * with compiled autograd off (the reference) and once with it on, and
 * checks that
 *   (a) every .grad equals the eager run's bit for bit after every step,
 *   (b) nothing fell back: one compile, then a memory-cache hit per step,
 *   (c) each custom backward C function ran exactly as often as eagerly
 *       (once per node per step: the program calls it, nothing else does).
 * Between steps the leaves move (w -= 0.1 * w.grad under no_grad), so each
 * run reads new saved values through the same program.
 * Schemas: jitc::scaled_gelu(Tensor, float), jitc::two(Tensor, Tensor) ->
 * (Tensor, Tensor), jitc::shift(Tensor, int), alone and in a model mixing
 * them with built-in ops (linear, tanh, add, mean). Also: an output that
 * gets no gradient (zeros reach the function), an input that needs none,
 * keys that differ by a scalar argument or by the op's schema name, a
 * failing backward and one returning no gradient (the run is abandoned and
 * the eager engine decides, as without compiled autograd), programs
 * with custom calls never written to the disk cache, and custom ops inside
 * activation-checkpoint regions (compiled, also when the region must
 * recompute a custom op's forward: an opaque forward call), and an op
 * with more gradients than a call step holds (falls back for good).
 *
 * Leaves: w [4, 6], v [4, 6], b [4] (f32); x [3, 6] is data.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NSTEPS 4
#define NW 24

/* ------------------------------------------------------ user functions */

static int g_calls_sg, g_calls_two, g_calls_shift;
static int g_fail_from = -1, g_fail_to = -1; /* scaled_gelu backward fails on calls
                                                  [from, to) */
static bool g_drop_grad;    /* scaled_gelu backward returns no gradient */

static int sg_fwd(gj_tensor *x, double alpha, gj_tensor **out) {
    *out = gj_mul_scalar(gj_tanh(x), alpha);
    return *out ? 0 : 1;
}

/* d/dx alpha * tanh(x) = alpha * (1 - tanh(x)^2) */
static int sg_bwd(gj_tensor *g, gj_tensor *x, double alpha, gj_tensor **gx) {
    int call = g_calls_sg++;
    if (call >= g_fail_from && call < g_fail_to) return 7;
    if (g_drop_grad) return 0;
    gj_tensor *t = gj_tanh(x);
    *gx = gj_mul(g, gj_mul_scalar(gj_add_scalar(gj_neg(gj_mul(t, t)), 1.0), alpha));
    return *gx ? 0 : 1;
}

static int two_fwd(gj_tensor *a, gj_tensor *b, gj_tensor **prod, gj_tensor **sum) {
    *prod = gj_mul(a, b);
    *sum = gj_add(a, b);
    return *prod && *sum ? 0 : 1;
}

static int two_bwd(gj_tensor *gp, gj_tensor *gs, gj_tensor *a, gj_tensor *b, gj_tensor **ga,
                   gj_tensor **gb) {
    g_calls_two++;
    *ga = gj_add(gj_mul(gp, b), gs);
    *gb = gj_add(gj_mul(gp, a), gs);
    return *ga && *gb ? 0 : 1;
}

/* roll along the last axis by k */
static gj_tensor *roll(gj_tensor *x, int64_t k) {
    int nd = gj_tensor_ndim(x);
    int64_t n = gj_tensor_shape(x)[nd - 1];
    k = ((k % n) + n) % n;
    if (k == 0) return gj_contiguous(x);
    gj_tensor *parts[2] = {gj_narrow(x, nd - 1, n - k, k), gj_narrow(x, nd - 1, 0, n - k)};
    return gj_cat(2, parts, nd - 1);
}

static int shift_fwd(gj_tensor *x, int64_t k, gj_tensor **out) {
    *out = roll(x, k);
    return *out ? 0 : 1;
}

static int shift_bwd(gj_tensor *g, gj_tensor *x, int64_t k, gj_tensor **gx) {
    (void)x;
    g_calls_shift++;
    *gx = roll(g, -k);
    return *gx ? 0 : 1;
}

/* sum4(a, b, c, d, e) = a + b + c + d + e: five gradients, more than a
 * call has (GJ_RT_MAX_OUTPUTS, 4) */
static int sum4_fwd(gj_tensor *a, gj_tensor *b, gj_tensor *c, gj_tensor *d, gj_tensor *e,
                    gj_tensor **out) {
    *out = gj_add(gj_add(gj_add(a, b), gj_add(c, d)), e);
    return *out ? 0 : 1;
}

static int sum4_bwd(gj_tensor *g, gj_tensor *a, gj_tensor *b, gj_tensor *c, gj_tensor *d,
                    gj_tensor *e, gj_tensor **ga, gj_tensor **gb, gj_tensor **gc,
                    gj_tensor **gd, gj_tensor **ge) {
    (void)a;
    (void)b;
    (void)c;
    (void)d;
    (void)e;
    *ga = gj_mul_scalar(g, 1.0);
    *gb = gj_mul_scalar(g, 2.0);
    *gc = gj_mul_scalar(g, 3.0);
    *gd = gj_mul_scalar(g, 4.0);
    *ge = gj_mul_scalar(g, 5.0);
    return *ga && *gb && *gc && *gd && *ge ? 0 : 1;
}

static gj_custom_op *g_sg, *g_sg2, *g_two, *g_shift, *g_sum4;

static void define_ops(void) {
    if (g_sg) return;
    g_sg = gj_custom_op_define("jitc::scaled_gelu(Tensor x, float alpha) -> Tensor",
                               (void *)sg_fwd, (void *)sg_bwd);
    g_sg2 = gj_custom_op_define("jitc::scaled_gelu_b(Tensor x, float alpha) -> Tensor",
                                (void *)sg_fwd, (void *)sg_bwd);
    g_two = gj_custom_op_define("jitc::two(Tensor a, Tensor b) -> (Tensor, Tensor)",
                                (void *)two_fwd, (void *)two_bwd);
    g_shift = gj_custom_op_define("jitc::shift(Tensor x, int k) -> Tensor", (void *)shift_fwd,
                                  (void *)shift_bwd);
    g_sum4 = gj_custom_op_define(
        "jitc::sum4(Tensor a, Tensor b, Tensor c, Tensor d, Tensor e) -> Tensor", (void *)sum4_fwd,
        (void *)sum4_bwd);
    assert_non_null(g_sum4);
    if (!g_sg || !g_sg2 || !g_two || !g_shift) print_error("define: %s\n", gj_last_error());
    assert_non_null(g_sg);
    assert_non_null(g_sg2);
    assert_non_null(g_two);
    assert_non_null(g_shift);
}

static gj_tensor *call1(gj_custom_op *op, gj_tensor *x, double scalar) {
    gj_tensor *out = NULL;
    if (gj_custom_op_call(op, &x, &scalar, &out) != 0) return NULL;
    return out;
}

/* ------------------------------------------------------------- models */

typedef enum model {
    M_SG,         /* sum(sg(w, alpha) * v) */
    M_SG_B,       /* the same with jitc::scaled_gelu_b */
    M_TWO,        /* (p, s) = two(w, v); mean(p * s) */
    M_TWO_SECOND, /* only s = two(w, v)[1] used: p's gradient is zeros */
    M_TWO_NO_V,   /* M_TWO with v not requiring grad */
    M_SHIFT,      /* sum(shift(w, k) * w) */
    M_MIXED,      /* linear -> sg -> shift -> two(., v) -> tanh(add) -> mean */
} model;

typedef struct run {
    model m;
    double alpha;
    gj_tensor *w, *v, *b, *x;
    double gw[NSTEPS][NW], gv[NSTEPS][NW], gb[NSTEPS][4];
    bool has_gw[NSTEPS];
    int calls[3]; /* backward calls of sg, two, shift over the run */
} run;

static void make_leaves(run *r) {
    gjt_rng g;
    gjt_rng_seed(&g, 11);
    const int64_t sw[] = {4, 6}, sb[] = {4}, sx[] = {3, 6};
    r->w = gjt_uniform(&g, GJ_F32, 2, sw, -1.5, 1.5);
    r->v = gjt_uniform(&g, GJ_F32, 2, sw, -1, 1);
    r->b = gjt_uniform(&g, GJ_F32, 1, sb, -0.5, 0.5);
    r->x = gjt_uniform(&g, GJ_F32, 2, sx, -1, 1);
    assert_int_equal(gj_set_requires_grad(r->w, true), 0);
    assert_int_equal(gj_set_requires_grad(r->v, r->m != M_TWO_NO_V), 0);
    assert_int_equal(gj_set_requires_grad(r->b, true), 0);
}

/* The loss of r's model for this step (the step's scope owns it). */
static gj_tensor *loss(run *r, int step) {
    gj_tensor *o[2], *ab[2];
    switch (r->m) {
    case M_SG:
    case M_SG_B: {
        gj_tensor *h = call1(r->m == M_SG ? g_sg : g_sg2, r->w, r->alpha);
        return gj_sum(gj_mul(h, r->v), 0, NULL, false);
    }
    case M_TWO:
    case M_TWO_NO_V:
        ab[0] = r->w;
        ab[1] = r->v;
        if (gj_custom_op_call(g_two, ab, NULL, o) != 0) return NULL;
        return gj_mean(gj_mul(o[0], o[1]), 0, NULL, false);
    case M_TWO_SECOND:
        ab[0] = r->w;
        ab[1] = r->v;
        if (gj_custom_op_call(g_two, ab, NULL, o) != 0) return NULL;
        return gj_sum(gj_tanh(o[1]), 0, NULL, false);
    case M_SHIFT:
        return gj_sum(gj_mul(call1(g_shift, r->w, 2), r->w), 0, NULL, false);
    case M_MIXED: {
        gj_tensor *h = gj_linear(r->x, r->w, r->b); /* [3, 4] */
        gj_tensor *a = call1(g_sg, h, r->alpha);
        gj_tensor *s = call1(g_shift, a, 1);
        ab[0] = s;
        ab[1] = gj_narrow(r->v, 1, 0, 4); /* [4, 4] */
        ab[1] = gj_narrow(ab[1], 0, 0, 3); /* [3, 4] */
        if (gj_custom_op_call(g_two, ab, NULL, o) != 0) return NULL;
        return gj_mean(gj_tanh(gj_add(o[0], o[1])), 0, NULL, false);
    }
    }
    return NULL;
}

static void grad_of(gj_tensor *t, double *out, int n, bool *has) {
    gj_tensor *g = gj_tensor_grad(t);
    if (has) *has = g != NULL;
    if (!g) {
        memset(out, 0, (size_t)n * sizeof *out);
        return;
    }
    assert_int_equal(gj_tensor_to_f64(g, out), 0);
}

/* Runs NSTEPS steps of r's model with compiled autograd on or off. */
/* Back to the disk cache the suite was started with (GRADJIT_CACHE_DIR). */
static void restore_disk_cache(void) {
    const char *env = getenv("GRADJIT_CACHE_DIR");
    gj_jit_set_disk_cache(env && *env && strcmp(env, "off") != 0 ? env : NULL);
}

static void run_steps(run *r, bool compiled) {
    make_leaves(r);
    g_calls_sg = g_calls_two = g_calls_shift = 0;
    gj_set_compiled_autograd(compiled);
    for (int step = 0; step < NSTEPS; step++) {
        gj_scope_push();
        assert_int_equal(gj_tensor_set_grad(r->w, NULL), 0);
        assert_int_equal(gj_tensor_set_grad(r->v, NULL), 0);
        assert_int_equal(gj_tensor_set_grad(r->b, NULL), 0);
        gj_tensor *l = loss(r, step);
        if (!l) print_error("loss: %s\n", gj_last_error());
        assert_non_null(l);
        if (gj_backward(l, NULL) != 0) print_error("backward: %s\n", gj_last_error());
        grad_of(r->w, r->gw[step], NW, &r->has_gw[step]);
        grad_of(r->v, r->gv[step], NW, NULL);
        grad_of(r->b, r->gb[step], 4, NULL);
        gj_no_grad_push();
        if (gj_tensor_grad(r->w))
            assert_int_equal(gj_add_scaled_(r->w, gj_tensor_grad(r->w), -0.1), 0);
        gj_no_grad_pop();
        gj_scope_pop();
    }
    gj_set_compiled_autograd(false);
    r->calls[0] = g_calls_sg;
    r->calls[1] = g_calls_two;
    r->calls[2] = g_calls_shift;
    gj_release(r->w);
    gj_release(r->v);
    gj_release(r->b);
    gj_release(r->x);
}

/* Eager vs compiled for model m: bit-equal grads, no fallback, one compile
 * then hits, the same backward calls. */
static void check_model(model m, double alpha) {
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gj_jit_clear_cache();
    static run e, c;
    memset(&e, 0, sizeof e);
    memset(&c, 0, sizeof c);
    e.m = c.m = m;
    e.alpha = c.alpha = alpha;
    run_steps(&e, false);
    gj_compiled_autograd_reset_stats();
    run_steps(&c, true);
    gj_ca_stats s = gjt_ca_now();
    if (s.fallbacks) print_error("fallback: %s\n", gj_compiled_autograd_last_fallback());
    assert_int_equal(s.backwards, NSTEPS);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles + s.disk_hits, 1 /* made once: compiled, or loaded */);
    assert_int_equal(s.mem_hits, NSTEPS - 1);
    assert_memory_equal(e.gw, c.gw, sizeof e.gw);
    assert_memory_equal(e.gv, c.gv, sizeof e.gv);
    assert_memory_equal(e.gb, c.gb, sizeof e.gb);
    assert_memory_equal(e.calls, c.calls, sizeof e.calls);
    assert_true(e.calls[0] + e.calls[1] + e.calls[2] >= NSTEPS);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_scaled_gelu(void **st) {
    (void)st;
    check_model(M_SG, 0.8);
}

static void test_two(void **st) {
    (void)st;
    check_model(M_TWO, 0);
}

static void test_two_second_only(void **st) {
    (void)st;
    check_model(M_TWO_SECOND, 0);
}

static void test_two_input_without_grad(void **st) {
    (void)st;
    check_model(M_TWO_NO_V, 0);
}

static void test_shift(void **st) {
    (void)st;
    check_model(M_SHIFT, 0);
}

static void test_mixed_model(void **st) {
    (void)st;
    check_model(M_MIXED, 0.7);
}

/* The key holds the op's schema name and its scalar arguments: another
 * alpha or another op of the same signature compiles a program of its own;
 * running each again hits. */
static void test_keys(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gj_jit_set_disk_cache(NULL); /* counts compiles, not disk hits */
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    static run r;
    const struct {
        model m;
        double alpha;
    } seq[] = {{M_SG, 0.8}, {M_SG, 0.5}, {M_SG_B, 0.8}, {M_SG, 0.8}, {M_SG_B, 0.8}};
    for (int i = 0; i < 5; i++) {
        memset(&r, 0, sizeof r);
        r.m = seq[i].m;
        r.alpha = seq[i].alpha;
        run_steps(&r, true);
    }
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.fallbacks, 0);
    /* three programs; alpha is an argument of the custom call step, not of
     * any fused kernel, so alpha 0.5's program is bound to the kernels
     * alpha 0.8's compiled (no compile) */
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.instantiations, 1);
    assert_int_equal(s.mem_hits, 5 * NSTEPS - 3);
    assert_int_equal(gjt_live_bytes(), live0);
    restore_disk_cache();
}

/* A backward that fails during a compiled run: the run is abandoned (no
 * .grad written), the eager engine runs the step again and reports the
 * error, or (here) succeeds; a failure of user code is not a cause that
 * recurs, so the next step runs compiled again. */
static void test_failing_backward(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    gjt_rng g;
    gjt_rng_seed(&g, 3);
    const int64_t sw[] = {4, 6};
    gj_tensor *w = gjt_uniform(&g, GJ_F32, 2, sw, -1, 1);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    gj_set_compiled_autograd(true);
    g_calls_sg = 0;
    g_fail_from = 1; /* the second call: the compiled run of step 1 */
    g_fail_to = 2;
    for (int step = 0; step < 3; step++) {
        gj_scope_push();
        assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
        gj_tensor *l = gj_sum(call1(g_sg, w, 0.5), 0, NULL, false);
        /* step 1: the compiled call failed, the eager engine ran it again */
        assert_int_equal(gj_backward(l, NULL), 0);
        assert_non_null(gj_tensor_grad(w));
        gj_scope_pop();
    }
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles + s.disk_hits, 1);
    assert_int_equal(s.mem_hits, 1); /* step 2 (step 1's hit was abandoned: a fallback) */
    assert_int_equal(s.fallbacks, 1); /* the abandoned run only: step 2 ran compiled */
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 1);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "jitc::scaled_gelu"));
    assert_int_equal(g_calls_sg, 4); /* step 0, step 1 twice, step 2 */

    /* a backward failing for good: the error is eager's, no .grad written */
    gj_jit_clear_cache();
    g_calls_sg = 0;
    g_fail_from = 1;
    g_fail_to = 1000;
    for (int step = 0; step < 2; step++) {
        gj_scope_push();
        assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
        gj_tensor *l = gj_sum(call1(g_sg, w, 0.25), 0, NULL, false);
        if (step == 0) {
            assert_int_equal(gj_backward(l, NULL), 0);
        } else {
            assert_int_equal(gj_backward(l, NULL), -1);
            GJT_ASSERT_ERROR("jitc::scaled_gelu");
            assert_null(gj_tensor_grad(w));
        }
        gj_scope_pop();
    }
    assert_int_equal(g_calls_sg, 3); /* step 0; step 1 compiled, then eager */
    g_fail_from = g_fail_to = -1;
    gj_set_compiled_autograd(false);
    gj_release(w);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A backward returning no gradient for an input that wants one: eager lets
 * no gradient flow there; the compiled run is abandoned and the eager
 * engine gives that result (w has no .grad, b has its own). */
static void test_no_gradient_returned(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gj_jit_set_disk_cache(NULL); /* counts compiles, not disk hits */
    gj_jit_clear_cache();
    g_drop_grad = true;
    static run e, c;
    memset(&e, 0, sizeof e);
    memset(&c, 0, sizeof c);
    e.m = c.m = M_SG;
    e.alpha = c.alpha = 0.8;
    run_steps(&e, false);
    gj_compiled_autograd_reset_stats();
    run_steps(&c, true);
    g_drop_grad = false;
    gj_ca_stats s = gjt_ca_now();
    /* step 0 compiled, its run was abandoned: every backward is a fallback */
    assert_int_equal(s.compiles, 0);
    assert_int_equal(s.fallbacks, NSTEPS);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_HOOK_GUARD], NSTEPS);
    for (int k = 0; k < NSTEPS; k++) assert_false(c.has_gw[k]);
    assert_memory_equal(e.has_gw, c.has_gw, sizeof e.has_gw);
    assert_memory_equal(e.gw, c.gw, sizeof e.gw);
    assert_int_equal(c.calls[0], NSTEPS + 1); /* the abandoned compiled call, then eager */
    assert_int_equal(gjt_live_bytes(), live0);
    restore_disk_cache();
}

/* Programs with custom calls live on disk too: the call step names the op
 * by canonical position, resolved at each run. After the memory cache is
 * dropped (what a new process starts with) the same model is a disk hit,
 * not a compile, and runs its custom op through the program. */
static void test_on_disk(void **st) {
    (void)st;
    define_ops();
    char dir[] = "/tmp/gj_custom_cacheXXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    static run e, r, r2;
    memset(&e, 0, sizeof e);
    memset(&r, 0, sizeof r);
    memset(&r2, 0, sizeof r2);
    e.m = r.m = r2.m = M_MIXED;
    e.alpha = r.alpha = r2.alpha = 0.3;
    run_steps(&e, false);
    run_steps(&r, true);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.disk_hits, 0);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int files = 0;
    for (struct dirent *de; (de = readdir(d)) != NULL;)
        if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0) files++;
    closedir(d);
    assert_int_equal(files, 1);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    run_steps(&r2, true);
    s = gjt_ca_now();
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 0);
    assert_int_equal(s.disk_hits, 1);
    assert_memory_equal(e.gw, r2.gw, sizeof e.gw);
    assert_int_equal(r2.calls[0], NSTEPS); /* the op's backward, once per step */
    gj_jit_clear_cache();
    d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d)) != NULL;)
        if (de->d_name[0] != '.') {
            char path[sizeof dir + 300];
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            unlink(path);
        }
    if (d) closedir(d);
    rmdir(dir);
    restore_disk_cache();
}

static int ck_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    (void)n_in;
    (void)n_out;
    out[0] = call1(g_sg, in[0], 0.6);
    if (out[0] && *(bool *)user) out[0] = gj_tanh(out[0]);
    return out[0] ? 0 : -1;
}

/* A custom op inside an activation-checkpoint region. Its backward, run by
 * the region's backward, is a call of the compiled program like any other
 * (found by its place in the tape). A region that recomputes a custom op's
 * output (here for tanh's backward) replays its C forward as an opaque
 * forward call step of the program: it compiles once too. Gradients equal
 * eager's bit for bit either way. */
static void test_checkpoint_region(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gjt_rng g;
    gjt_rng_seed(&g, 9);
    const int64_t sw[] = {4, 6};
    gj_tensor *w = gjt_uniform(&g, GJ_F32, 2, sw, -1, 1);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    for (int recompute = 0; recompute < 2; recompute++) {
        bool tanh_after = recompute == 1;
        double gr[2][NW];
        gj_jit_clear_cache();
        for (int mode = 0; mode < 2; mode++) {
            gj_set_compiled_autograd(mode == 1);
            gj_compiled_autograd_reset_stats();
            for (int step = 0; step < 2; step++) {
                gj_scope_push();
                assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
                gj_tensor *y = NULL;
                assert_int_equal(gj_checkpoint(ck_fn, &tanh_after, 1, &w, 1, &y, NULL, NULL), 0);
                gj_tensor *l = gj_sum(gj_mul(y, y), 0, NULL, false);
                assert_int_equal(gj_backward(l, NULL), 0);
                grad_of(w, gr[mode], NW, NULL);
                gj_release(y);
                gj_scope_pop();
            }
        }
        gj_set_compiled_autograd(false);
        gj_ca_stats s = gjt_ca_now();
        assert_memory_equal(gr[0], gr[1], sizeof gr[0]);
        assert_int_equal(s.fallbacks, 0);
        assert_int_equal(s.compiles + s.disk_hits, 1);
        assert_int_equal(s.mem_hits, 1);
    }
    gj_release(w);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A call with more than 4 inputs needing a gradient does not fit a call
 * step: a permanent fallback (GJ_CA_OTHER), eager's gradients. */
static void test_too_many_gradients(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_set_quiet(true);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    gjt_rng g;
    gjt_rng_seed(&g, 4);
    const int64_t sh[] = {2, 3};
    gj_tensor *x[5];
    for (int i = 0; i < 5; i++) {
        x[i] = gjt_uniform(&g, GJ_F32, 2, sh, -1, 1);
        assert_int_equal(gj_set_requires_grad(x[i], true), 0);
    }
    gj_set_compiled_autograd(true);
    for (int step = 0; step < 2; step++) {
        gj_scope_push();
        gj_tensor *y = NULL;
        assert_int_equal(gj_custom_op_call(g_sum4, x, NULL, &y), 0);
        assert_int_equal(gj_backward(gj_sum(gj_mul(y, y), 0, NULL, false), NULL), 0);
        gj_scope_pop();
    }
    gj_set_compiled_autograd(false);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 0);
    assert_int_equal(s.fallbacks, 2);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_OTHER], 2);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "exceed a compiled call"));
    double g0[6], g4[6];
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(x[0]), g0), 0);
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(x[4]), g4), 0);
    for (int k = 0; k < 6; k++) assert_true(g4[k] == (double)(float)(5.0 * g0[k])); /* f32 product */
    for (int i = 0; i < 5; i++) gj_release(x[i]);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scaled_gelu),
        cmocka_unit_test(test_two),
        cmocka_unit_test(test_two_second_only),
        cmocka_unit_test(test_two_input_without_grad),
        cmocka_unit_test(test_shift),
        cmocka_unit_test(test_mixed_model),
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_failing_backward),
        cmocka_unit_test(test_no_gradient_returned),
        cmocka_unit_test(test_on_disk),
        cmocka_unit_test(test_checkpoint_region),
        cmocka_unit_test(test_too_many_gradients),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
