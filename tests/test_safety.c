/* SPDX-License-Identifier: MIT */
/*
 * test_safety.c - legal calls that used to free memory still in use or
 * recurse without end (the hardening issue's use-after-free list), each run
 * in eager mode and with compiled autograd on:
 *   - gj_grad with the same input twice (and with an input whose gradient
 *     is the caller's own seed): a distinct reference per slot;
 *   - a tensor hook returning the gradient it was given (`lambda g: g`);
 *   - a custom op whose backward hands back its borrowed grad_out (a
 *     straight-through estimator), also when that grad_out is the zeros the
 *     engine made for an output that got no gradient, and one whose
 *     forward hands back its borrowed argument (the identity);
 *   - gj_backward / gj_grad called from a hook on the graph that runs;
 *   - gj_release on the borrowed pointer of gj_tensor_grad;
 *   - an op failing inside a hook that then returns NULL, or inside a
 *     custom backward that then returns 0.
 * In compiled mode a backward that succeeds must have run compiled (no
 * fallback) and give the eager run's gradients; one that fails must fail
 * the same way eagerly (gjt_backward / gjt_backward_fails). Every test
 * ends with the live tensor bytes it started with.
 *
 * Leaf: w [2, 3] (f64, values W0). Run under ASan (GJ_SANITIZE) to see the
 * old defects as reports rather than wrong numbers.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NW 6
static const double W0[NW] = {0.5, -1.0, 1.5, 2.0, -0.25, 0.75};
static const int64_t WSHAPE[2] = {2, 3};

/* Sets compiled autograd for one run of a scenario, from an empty cache. */
static void set_mode(bool compiled) {
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    gjt_set_compiled(compiled);
    gj_set_compiled_autograd(compiled);
}

static gj_tensor *leaf_w(void) {
    gj_tensor *w = gjt_tensor(GJ_F64, 2, WSHAPE, W0);
    assert_non_null(w);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    return w;
}

static gj_tensor *sum_all(gj_tensor *x) { return gj_sum(x, 0, NULL, false); }

/* Copies t's values to out (NW of them). */
static void values_of(const gj_tensor *t, double *out) {
    assert_non_null(t);
    assert_int_equal(gj_tensor_numel(t), NW);
    assert_int_equal(gj_tensor_to_f64(t, out), 0);
}

/* ------------------------------------------------- 1. gj_grad twice */

/* gj_grad(l, [w, w]) with l = sum(w * w): two distinct references, each
 * 2 w, each released once by the caller, then the scope pops. Also
 * y = w * 3 differentiated w.r.t. itself with a seed s: the caller gets a
 * reference of its own, not its seed pointer re-registered in the scope. */
static void test_grad_same_input_twice(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    for (int mode = 0; mode < 2; mode++) {
        set_mode(mode == 1);
        gj_tensor *w = leaf_w();
        gj_scope_push();
        gj_tensor *l = sum_all(gj_mul(w, w));
        gj_tensor *in[2] = {w, w}, *g[2] = {NULL, NULL};
        assert_int_equal(gj_grad(1, &l, NULL, 2, in, g, false, false), 0);
        assert_non_null(g[0]);
        assert_non_null(g[1]);
        assert_ptr_not_equal(g[0], g[1]);
        double want[NW], got[NW];
        for (int i = 0; i < NW; i++) want[i] = 2.0 * W0[i];
        for (int k = 0; k < 2; k++) {
            values_of(g[k], got);
            assert_true(gjt_allclose("gj_grad twice", got, want, NW, 0, 0));
        }
        gj_release(g[0]);
        gj_release(g[1]);
        gj_scope_pop();

        gj_scope_push();
        gj_tensor *y = gj_mul_scalar(w, 3.0);
        gj_tensor *s = gj_full(GJ_F64, 2, WSHAPE, 0.5);
        gj_tensor *gy = NULL;
        assert_int_equal(gj_grad(1, &y, &s, 1, &y, &gy, false, false), 0);
        assert_non_null(gy);
        assert_ptr_not_equal(gy, s);
        values_of(gy, got);
        for (int i = 0; i < NW; i++) want[i] = 0.5;
        assert_true(gjt_allclose("gj_grad of the seed", got, want, NW, 0, 0));
        gj_release(gy);
        gj_scope_pop();
        assert_null(gj_tensor_grad(w)); /* gj_grad never touches .grad */
        gj_release(w);
    }
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* --------------------------------------------- 2. hook returning grad */

static int g_identity_calls;

static gj_tensor *hook_identity(gj_tensor *grad, void *user) {
    (void)user;
    g_identity_calls++;
    return grad;
}

/* l = sum((3 w)^2) with identity hooks on h = 3 w and on w, two steps
 * (the second accumulates): w.grad = 18 w per step, twice; compiled equals
 * eager. */
static void test_hook_returns_its_grad(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    double res[2][NW];
    for (int mode = 0; mode < 2; mode++) {
        set_mode(mode == 1);
        g_identity_calls = 0;
        gj_tensor *w = leaf_w();
        assert_true(gj_register_hook(w, hook_identity, NULL) > 0);
        for (int step = 0; step < 2; step++) {
            gj_scope_push();
            gj_tensor *h = gj_mul_scalar(w, 3.0);
            assert_true(gj_register_hook(h, hook_identity, NULL) > 0);
            gj_tensor *l = sum_all(gj_mul(h, h));
            assert_int_equal(gjt_backward(l, NULL, false), 0);
            gj_scope_pop();
        }
        assert_int_equal(g_identity_calls, 4);
        values_of(gj_tensor_grad(w), res[mode]);
        double want[NW];
        for (int i = 0; i < NW; i++) want[i] = 2.0 * 18.0 * W0[i];
        assert_true(gjt_allclose(mode ? "compiled" : "eager", res[mode], want, NW, 1e-12, 0));
        gj_release(w);
    }
    assert_true(gjt_same_as_eager("identity hook", res[1], res[0], NW,
                                  gjt_compiled_rel_tol(GJ_F64)));
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ---------------------------------------- 3. straight-through backward */

static int g_ste_calls;

/* y = round(x) as x rounded through a cast to i64 and back. */
static int ste_fwd(gj_tensor *x, gj_tensor **out) {
    *out = gj_cast(gj_cast(gj_add_scalar(x, 0.5), GJ_I64), GJ_F64);
    return *out ? 0 : 1;
}

/* Straight-through: the gradient of x is grad_out itself (borrowed). */
static int ste_bwd(gj_tensor *grad_out, gj_tensor *x, gj_tensor **gx) {
    (void)x;
    g_ste_calls++;
    *gx = grad_out;
    return 0;
}

/* The identity, handing back its borrowed argument as the output. */
static int ident_fwd(gj_tensor *x, gj_tensor **out) {
    *out = x;
    return 0;
}

static int two_fwd(gj_tensor *x, gj_tensor **o0, gj_tensor **o1) {
    *o0 = gj_mul_scalar(x, 2.0);
    *o1 = gj_mul_scalar(x, 5.0);
    return *o0 && *o1 ? 0 : 1;
}

/* The gradient of x is grad_out1 alone: the zeros the engine made when
 * output 1 got no gradient. */
static int two_bwd(gj_tensor *g0, gj_tensor *g1, gj_tensor *x, gj_tensor **gx) {
    (void)g0;
    (void)x;
    g_ste_calls++;
    *gx = g1;
    return 0;
}

/* l = sum((ste(w) + ident(w)) * c) -> w.grad = 2 c, ident's forward
 * returning its argument; l2 = sum(two(w)[0]) -> the gradient is output
 * 1's (zeros), adding nothing. Two steps each; compiled equals eager and
 * runs compiled. */
static void test_custom_backward_returns_grad_out(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_custom_op *ste = gj_custom_op_define("safety::ste(Tensor x) -> Tensor", (void *)ste_fwd,
                                            (void *)ste_bwd);
    gj_custom_op *two = gj_custom_op_define("safety::two(Tensor x) -> (Tensor, Tensor)",
                                            (void *)two_fwd, (void *)two_bwd);
    gj_custom_op *ident = gj_custom_op_define("safety::ident(Tensor x) -> Tensor",
                                              (void *)ident_fwd, (void *)ste_bwd);
    assert_non_null(ste);
    assert_non_null(two);
    assert_non_null(ident);
    static const double C[NW] = {1.0, 2.0, -3.0, 0.5, 4.0, -1.5};
    double res[2][NW];
    for (int mode = 0; mode < 2; mode++) {
        set_mode(mode == 1);
        g_ste_calls = 0;
        gj_tensor *w = leaf_w();
        for (int step = 0; step < 2; step++) {
            gj_scope_push();
            gj_tensor *y = NULL, *z = NULL, *o[2] = {NULL, NULL};
            assert_int_equal(gj_custom_op_call(ste, &w, NULL, &y), 0);
            assert_int_equal(gj_custom_op_call(ident, &w, NULL, &z), 0);
            assert_ptr_not_equal(z, w);
            gj_tensor *c = gjt_tensor(GJ_F64, 2, WSHAPE, C);
            assert_int_equal(gjt_backward(sum_all(gj_mul(gj_add(y, z), c)), NULL, false), 0);
            assert_int_equal(gj_custom_op_call(two, &w, NULL, o), 0);
            assert_int_equal(gjt_backward(sum_all(o[0]), NULL, false), 0);
            gj_release(c);
            gj_scope_pop();
        }
        assert_int_equal(g_ste_calls, 6);
        values_of(gj_tensor_grad(w), res[mode]);
        double want[NW];
        for (int i = 0; i < NW; i++) want[i] = 4.0 * C[i];
        assert_true(gjt_allclose(mode ? "compiled" : "eager", res[mode], want, NW, 1e-12, 0));
        gj_release(w);
    }
    assert_true(gjt_same_as_eager("straight-through", res[1], res[0], NW,
                                  gjt_compiled_rel_tol(GJ_F64)));
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------- 4. re-entrant backward */

typedef struct reenter {
    gj_tensor *root;  /* the loss of the running backward (borrowed) */
    gj_tensor *w;     /* the leaf (borrowed) */
    bool use_grad;    /* call gj_grad instead of gj_backward */
    bool clear;       /* clear the inner error before returning NULL */
    int calls, inner_rc;
    char inner_err[512];
} reenter;

static gj_tensor *hook_reenter(gj_tensor *grad, void *user) {
    (void)grad;
    reenter *r = user;
    r->calls++;
    if (r->calls > 8) return NULL; /* the old recursion: stop it ourselves */
    if (r->use_grad) {
        gj_tensor *g = NULL;
        r->inner_rc = gj_grad(1, &r->root, NULL, 1, &r->w, &g, true, false);
        gj_release(g);
    } else {
        r->inner_rc = gj_backward(r->root, NULL);
    }
    snprintf(r->inner_err, sizeof r->inner_err, "%s", gj_last_error());
    if (r->clear) gj_clear_error();
    return NULL;
}

/* One backward of l = sum(tanh(w) * w) whose hook on h = tanh(w) calls a
 * backward of l itself: the inner call fails at once naming its function
 * and the reason; the outer one then fails with that error (the hook left
 * it set) or, when the hook cleared it, finishes with the right .grad. */
static void reenter_run(bool compiled, bool use_grad, bool clear, double *out) {
    set_mode(compiled);
    gj_tensor *w = leaf_w();
    gj_scope_push();
    gj_tensor *h = gj_tanh(w);
    gj_tensor *l = sum_all(gj_mul(h, w));
    reenter r = {.root = l, .w = w, .use_grad = use_grad, .clear = clear};
    assert_true(gj_register_hook(h, hook_reenter, &r) > 0);
    const char *fn = use_grad ? "gj_grad" : "gj_backward";
    if (clear) {
        assert_int_equal(gjt_backward(l, NULL, false), 0);
        assert_int_equal(r.calls, 1);
        values_of(gj_tensor_grad(w), out);
        double want[NW];
        for (int i = 0; i < NW; i++) {
            double t = tanh(W0[i]);
            want[i] = t + W0[i] * (1.0 - t * t);
        }
        assert_true(gjt_allclose("outer backward", out, want, NW, 1e-12, 1e-12));
    } else {
        assert_true(gjt_backward_fails(l, NULL, false));
        assert_true(gjt_error_has(fn));
        assert_true(gjt_error_has("running"));
        assert_true(r.calls >= 1 && r.calls <= 3); /* compiled: again in the eager rerun(s) */
    }
    assert_int_not_equal(r.inner_rc, 0);
    if (!strstr(r.inner_err, fn) || !strstr(r.inner_err, "running")) {
        print_error("inner error: '%s'\n", r.inner_err);
        fail();
    }
    gj_scope_pop();
    gj_release(w);
}

static void test_backward_from_hook(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    double e[NW], c[NW];
    for (int use_grad = 0; use_grad < 2; use_grad++) {
        reenter_run(false, use_grad, true, e);
        reenter_run(true, use_grad, true, c);
        assert_true(gjt_same_as_eager("outer backward", c, e, NW, gjt_compiled_rel_tol(GJ_F64)));
        reenter_run(false, use_grad, false, NULL);
        reenter_run(true, use_grad, false, NULL);
    }
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------ 5. release of a borrowed .grad */

/* gj_release(gj_tensor_grad(w)) is refused with an error naming
 * gj_release; .grad stays valid and later backwards accumulate into it.
 * Releasing a reference the caller did take (gj_retain) stays legal. */
static void test_release_borrowed_grad(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    double res[2][NW];
    for (int mode = 0; mode < 2; mode++) {
        set_mode(mode == 1);
        gj_tensor *w = leaf_w();
        for (int step = 0; step < 3; step++) {
            gj_scope_push();
            assert_int_equal(gjt_backward(sum_all(gj_mul(w, w)), NULL, false), 0);
            gj_scope_pop();
            gj_tensor *g = gj_tensor_grad(w);
            assert_non_null(g);
            gj_clear_error();
            gj_release(g); /* the bug: a borrowed pointer */
            GJT_ASSERT_ERROR("gj_release");
            assert_true(gjt_error_has("borrowed"));
            assert_ptr_equal(gj_tensor_grad(w), g);
        }
        values_of(gj_tensor_grad(w), res[mode]);
        double want[NW];
        for (int i = 0; i < NW; i++) want[i] = 3.0 * 2.0 * W0[i];
        assert_true(gjt_allclose(mode ? "compiled" : "eager", res[mode], want, NW, 1e-12, 0));
        /* a reference of the caller's own: released, the .grad lives on */
        gj_tensor *mine = gj_retain(gj_tensor_grad(w));
        gj_clear_error();
        gj_release(mine);
        assert_string_equal(gj_last_error(), "");
        /* cleared, then the retained former .grad is the caller's to free */
        mine = gj_retain(gj_tensor_grad(w));
        assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
        gj_release(mine);
        assert_string_equal(gj_last_error(), "");
        gj_release(w);
    }
    assert_true(gjt_same_as_eager("after refused releases", res[1], res[0], NW,
                                  gjt_compiled_rel_tol(GJ_F64)));
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* --------------------------------------------- 6. errors inside hooks */

static int g_failing_calls;

/* An op fails inside the hook (shapes do not broadcast); it returns NULL
 * ("keep the gradient") with the op's error still set. */
static gj_tensor *hook_op_fails(gj_tensor *grad, void *user) {
    (void)user;
    g_failing_calls++;
    gj_tensor *bad = gj_zeros(GJ_F64, 1, (int64_t[]){5});
    gj_tensor *r = gj_add(grad, bad);
    assert_null(r);
    return NULL;
}

/* A custom backward in which an op fails; it returns 0 and no gradient. */
static int quiet_fail_bwd(gj_tensor *grad_out, gj_tensor *x, gj_tensor **gx) {
    (void)x;
    (void)gx;
    g_failing_calls++;
    gj_tensor *r = gj_matmul(grad_out, grad_out); /* [2, 3] @ [2, 3] */
    assert_null(r);
    return 0;
}

static int copy_fwd(gj_tensor *x, gj_tensor **out) {
    *out = gj_mul_scalar(x, 1.0);
    return *out ? 0 : 1;
}

/* The same for a custom op's backward that returns 0 after an op failed
 * inside it: the backward fails with the op's error in both modes. */
static void test_error_inside_custom_backward(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_custom_op *op = gj_custom_op_define("safety::quietfail(Tensor x) -> Tensor",
                                           (void *)copy_fwd, (void *)quiet_fail_bwd);
    assert_non_null(op);
    for (int mode = 0; mode < 2; mode++) {
        set_mode(mode == 1);
        g_failing_calls = 0;
        gj_tensor *w = leaf_w();
        gj_scope_push();
        gj_tensor *y = NULL;
        assert_int_equal(gj_custom_op_call(op, &w, NULL, &y), 0);
        assert_true(gjt_backward_fails(sum_all(gj_mul(y, w)), NULL, false));
        GJT_ASSERT_ERROR("safety::quietfail");
        GJT_ASSERT_ERROR("matmul");
        assert_true(g_failing_calls >= 1);
        assert_null(gj_tensor_grad(w));
        gj_scope_pop();
        gj_release(w);
    }
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The backward fails with the op's error in both modes, .grad untouched
 * by the failed call; once the hook is replaced by one returning its
 * gradient without an error, a backward of a fresh graph succeeds. */
static void test_error_inside_hook(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    for (int mode = 0; mode < 2; mode++) {
        set_mode(mode == 1);
        g_failing_calls = 0;
        gj_tensor *w = leaf_w();
        gj_scope_push();
        gj_tensor *h = gj_mul_scalar(w, 2.0);
        assert_true(gj_register_hook(h, hook_op_fails, NULL) > 0);
        gj_tensor *l = sum_all(gj_mul(h, w));
        assert_true(gjt_backward_fails(l, NULL, false));
        GJT_ASSERT_ERROR("gj_add");
        assert_true(gjt_error_has("hook"));
        assert_true(g_failing_calls >= 1);
        assert_null(gj_tensor_grad(w));
        gj_scope_pop();
        gj_jit_clear_cache(); /* the failed compiled run made the key eager-only */
        gj_scope_push();
        h = gj_mul_scalar(w, 2.0);
        assert_true(gj_register_hook(h, hook_identity, NULL) > 0);
        assert_int_equal(gjt_backward(sum_all(gj_mul(h, w)), NULL, false), 0);
        double got[NW], want[NW];
        values_of(gj_tensor_grad(w), got);
        for (int i = 0; i < NW; i++) want[i] = 4.0 * W0[i];
        assert_true(gjt_allclose("after the failed backward", got, want, NW, 1e-12, 0));
        gj_scope_pop();
        gj_release(w);
    }
    set_mode(false);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grad_same_input_twice),
        cmocka_unit_test(test_hook_returns_its_grad),
        cmocka_unit_test(test_custom_backward_returns_grad_out),
        cmocka_unit_test(test_backward_from_hook),
        cmocka_unit_test(test_release_borrowed_grad),
        cmocka_unit_test(test_error_inside_hook),
        cmocka_unit_test(test_error_inside_custom_backward),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
