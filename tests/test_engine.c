/* SPDX-License-Identifier: MIT */
/*
 * test_engine.c - the eager autograd engine through the public API:
 * accumulation into .grad (and its dtype), shared subgraphs and diamonds,
 * retain_graph and the second-backward error, no-grad mode, gj_grad,
 * version counters, in-place rules, seeds, requires_grad rules, detach.
 *
 * Each test checks at its end that every tensor byte it allocated is freed
 * again (the graph dies with the last tensor referring to it).
 *
 * Compiled mode (GJT_COMPILED=1, the ctest entry test_engine_compiled): every
 * gj_backward of these tests runs with compiled autograd on through
 * gjt_backward, which requires that it really ran compiled, so the same
 * expected .grad values are checked on the compiled path; a backward that
 * must fail goes through gjt_backward_fails, which requires the eager engine
 * to fail with the identical message (second backward without retain_graph,
 * version counters, seeds, roots without grad). gj_grad is eager by
 * definition and runs as is. test_determinism also compares compiled with
 * eager gradients (1e-6 of the largest, f32).
 */
#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static gj_tensor *leaf64(int ndim, const int64_t *shape, const double *v, bool rg) {
    gj_tensor *t = gjt_tensor(GJ_F64, ndim, shape, v);
    assert_non_null(t);
    if (rg)
        assert_int_equal(gj_set_requires_grad(t, true), 0);
    return t;
}

/* .grad of t must equal want (n values). */
static void assert_grad(gj_tensor *t, const double *want, double tol) {
    gj_tensor *g = gj_tensor_grad(t);
    assert_non_null(g);
    assert_int_equal(gj_tensor_numel(g), gj_tensor_numel(t));
    assert_true(gjt_shape_is(g, gj_tensor_ndim(t), gj_tensor_shape(t)));
    assert_true(gjt_tensor_close(".grad", g, want, tol, tol));
}

static const double XV[] = {-0.8, 0.3, 1.2};
static const int64_t S3[] = {3};

/* Two backwards through two graphs add up; an existing .grad is added to. */
static void test_accumulation(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    assert_null(gj_tensor_grad(x));
    gj_scope_push();
    assert_int_equal(gjt_backward(gj_sum(gj_mul_scalar(x, 3.0), 0, NULL, false), NULL, false), 0);
    assert_grad(x, (double[]){3, 3, 3}, 0);
    assert_int_equal(gjt_backward(gj_sum(gj_mul(x, x), 0, NULL, false), NULL, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 3 + 2 * XV[i];
    assert_grad(x, w, 1e-15);
    /* replace .grad by ones, then accumulate */
    gj_tensor *ones = gj_ones(GJ_F64, 1, S3);
    assert_int_equal(gj_tensor_set_grad(x, ones), 0);
    assert_int_equal(gjt_backward(gj_sum(gj_mul_scalar(x, -2.0), 0, NULL, false), NULL, false), 0);
    assert_grad(x, (double[]){-1, -1, -1}, 0);
    /* clearing */
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    assert_null(gj_tensor_grad(x));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The dtype of an existing .grad is kept; a fresh .grad has the leaf's dtype. */
static void test_grad_dtype(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *x = gj_scope_keep(leaf64(1, S3, XV, true));
    gj_tensor *z64 = gj_zeros(GJ_F64, 1, S3);
    assert_int_equal(gj_tensor_set_grad(x, z64), 0);
    assert_int_equal(gjt_backward(gj_sum(gj_tanh(x), 0, NULL, false), NULL, false), 0);
    assert_int_equal(gj_tensor_dtype(gj_tensor_grad(x)), GJ_F64);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 1 - tanh(XV[i]) * tanh(XV[i]);
    assert_grad(x, w, 1e-15);

    gj_tensor *xf = gj_scope_keep(gj_cast(x, GJ_F32));
    assert_non_null(xf);
    assert_true(gj_requires_grad(xf)); /* a cast of a leaf is part of the graph */
    assert_false(gj_is_leaf(xf));
    gj_release(xf);
    xf = gj_scope_keep(gjt_tensor(GJ_F32, 1, S3, XV));
    assert_int_equal(gj_set_requires_grad(xf, true), 0);
    /* fresh .grad: the leaf's dtype */
    assert_int_equal(gjt_backward(gj_sum(gj_mul_scalar(xf, 2.0), 0, NULL, false), NULL, false), 0);
    assert_int_equal(gj_tensor_dtype(gj_tensor_grad(xf)), GJ_F32);
    assert_grad(xf, (double[]){2, 2, 2}, 0);
    /* an f32 .grad set by the user stays f32 and is accumulated into */
    gj_tensor *gf = gjt_tensor(GJ_F32, 1, S3, (double[]){0.5, 0.25, -1});
    assert_int_equal(gj_tensor_set_grad(xf, gf), 0);
    assert_int_equal(gjt_backward(gj_sum(gj_mul_scalar(xf, 2.0), 0, NULL, false), NULL, false), 0);
    assert_int_equal(gj_tensor_dtype(gj_tensor_grad(xf)), GJ_F32);
    assert_grad(xf, (double[]){2.5, 2.25, 1}, 0);
    gj_scope_pop();
    gj_release(x);
    gj_release(xf);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* x feeds several paths that meet again: c = tanh(x) + x*tanh(x). */
static void test_diamond(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    gj_tensor *a = gj_tanh(x);
    gj_tensor *b = gj_mul(x, a);
    gj_tensor *c = gj_add(a, b);
    gj_tensor *e = gj_exp(c);             /* e used twice below */
    gj_tensor *f = gj_add(gj_mul(e, e), e);
    assert_non_null(f);
    assert_int_equal(gjt_backward(gj_sum(f, 0, NULL, false), NULL, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++) {
        double t = tanh(XV[i]), dt = 1 - t * t;
        double cv = t + XV[i] * t, dc = dt + t + XV[i] * dt;
        double ev = exp(cv);
        w[i] = (2 * ev * ev + ev) * dc;
    }
    assert_grad(x, w, 1e-12);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

static gj_tensor *f_diamond2(gj_tensor **in, void *ctx) {
    /* two leaves, shared intermediate used by three consumers */
    gj_tensor *h = gj_mul(in[0], in[1]);
    gj_tensor *p = gj_sigmoid(h), *q = gj_tanh(h);
    gj_tensor *r = gj_mul(h, gj_add(p, q));
    return gj_cat(3, (gj_tensor *[]){r, p, h}, 0);
}

static void test_diamond_fd(void **s) {
    gjt_check c = {.name = "diamond (shared h, three consumers)", .fn = f_diamond2, .n_in = 2,
                   .in = {{.ndim = 2, .shape = {2, 3}}, {.ndim = 1, .shape = {3}}}};
    assert_int_equal(gjt_gradcheck(&c), 0);
}

/* The same tensor twice in one op. */
static void test_same_input_twice(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    assert_int_equal(gjt_backward(gj_sum(gj_mul(x, x), 0, NULL, false), NULL, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 2 * XV[i];
    assert_grad(x, w, 1e-15);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    assert_int_equal(gjt_backward(gj_sum(gj_add(x, x), 0, NULL, false), NULL, false), 0);
    assert_grad(x, (double[]){2, 2, 2}, 0);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    gj_tensor *xx[3] = {x, x, x};
    assert_int_equal(gjt_backward(gj_sum(gj_cat(3, xx, 0), 0, NULL, false), NULL, false), 0);
    assert_grad(x, (double[]){3, 3, 3}, 0);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    gj_tensor *xr = gj_reshape(x, 2, (int64_t[]){1, 3}), *xc = gj_reshape(x, 2, (int64_t[]){3, 1});
    assert_int_equal(gjt_backward(gj_sum(gj_matmul(xr, xc), 0, NULL, false), NULL, false), 0);
    assert_grad(x, w, 1e-15);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* retain_graph: backward twice gives 2x; then a plain backward; then an error. */
static void test_retain_graph(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    gj_tensor *L = gj_sum(gj_tanh(x), 0, NULL, false);
    assert_int_equal(gjt_backward(L, NULL, true), 0);
    assert_int_equal(gjt_backward(L, NULL, true), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 2 * (1 - tanh(XV[i]) * tanh(XV[i]));
    assert_grad(x, w, 1e-15);
    assert_int_equal(gjt_backward(L, NULL, false), 0);
    for (int i = 0; i < 3; i++)
        w[i] *= 1.5;
    assert_grad(x, w, 1e-15);
    gj_clear_error();
    assert_true(gjt_backward_fails(L, NULL, false));
    assert_true(gj_last_error()[0] != '\0');
    assert_grad(x, w, 1e-15); /* a failed backward leaves .grad alone */
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A second backward without retain_graph names the op and the remedy. */
static void test_second_backward_error(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = gj_scalar(GJ_F64, 0.4);
    assert_non_null(x);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_scope_push();
    gj_tensor *y = gj_tanh(x);
    assert_int_equal(gjt_backward(y, NULL, false), 0);
    double g1 = 1 - tanh(0.4) * tanh(0.4);
    assert_true(fabs(gj_tensor_item(gj_tensor_grad(x)) - g1) < 1e-15);
    gj_clear_error();
    assert_true(gjt_backward_fails(y, NULL, false));
    GJT_ASSERT_ERROR("tanh");
    if (!gjt_error_has("retain_graph") && !gjt_error_has("second time")) {
        print_error("error does not mention retain_graph: '%s'\n", gj_last_error());
        fail();
    }
    assert_true(fabs(gj_tensor_item(gj_tensor_grad(x)) - g1) < 1e-15);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A non-leaf intermediate released by the user before backward: the graph
 * keeps what it needs. */
static void test_history_outlives_tensors(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_tensor *y = gj_exp(x);
    gj_tensor *z = gj_mul(y, y);
    gj_tensor *L = gj_sum(z, 0, NULL, false);
    gj_release(y);
    gj_release(z);
    assert_int_equal(gjt_backward(L, NULL, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 2 * exp(2 * XV[i]);
    assert_grad(x, w, 1e-13);
    gj_release(L);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_no_grad(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    assert_true(gj_is_grad_enabled());
    gj_no_grad_push();
    assert_false(gj_is_grad_enabled());
    gj_tensor *y = gj_tanh(x);
    assert_non_null(y);
    assert_false(gj_requires_grad(y));
    assert_true(gj_is_leaf(y));
    gj_no_grad_push();
    assert_false(gj_is_grad_enabled());
    gj_no_grad_pop();
    assert_false(gj_is_grad_enabled()); /* still inside the outer no_grad */
    assert_false(gj_requires_grad(gj_mul(x, x)));
    gj_no_grad_pop();
    assert_true(gj_is_grad_enabled());
    gj_tensor *y2 = gj_tanh(x);
    assert_true(gj_requires_grad(y2));
    assert_false(gj_is_leaf(y2));
    /* ops on tensors that do not require grad do not require grad */
    gj_tensor *c = gj_ones(GJ_F64, 1, S3);
    assert_false(gj_requires_grad(gj_exp(c)));
    /* a mix does */
    assert_true(gj_requires_grad(gj_add(c, x)));
    /* backward of a root that does not require grad is an error */
    gj_clear_error();
    assert_true(gjt_backward_fails(gj_sum(y, 0, NULL, false), NULL, false));
    assert_true(gj_last_error()[0] != '\0');
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* gj_grad: gradients of a subset of inputs, .grad untouched; equal to backward's. */
static void test_grad_subset(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_tensor *w = leaf64(1, S3, (double[]){0.5, -1.5, 2.0}, true);
    gj_scope_push();
    gj_tensor *L = gj_sum(gj_mul(gj_tanh(x), w), 0, NULL, false);
    gj_tensor *gx = NULL;
    assert_int_equal(gj_grad(1, &L, NULL, 1, &x, &gx, true, false), 0);
    assert_non_null(gx);
    assert_null(gj_tensor_grad(x));
    assert_null(gj_tensor_grad(w));
    double want[3];
    for (int i = 0; i < 3; i++)
        want[i] = (1 - tanh(XV[i]) * tanh(XV[i])) * ((double[]){0.5, -1.5, 2.0})[i];
    assert_true(gjt_tensor_close("gj_grad x", gx, want, 1e-15, 1e-15));
    assert_true(gjt_shape_is(gx, 1, S3));
    /* both inputs at once */
    gj_tensor *both[2] = {w, x}, *g2[2] = {NULL, NULL};
    assert_int_equal(gj_grad(1, &L, NULL, 2, both, g2, true, false), 0);
    assert_true(gjt_tensor_close("gj_grad x (2nd)", g2[1], want, 1e-15, 1e-15));
    double tw[3];
    for (int i = 0; i < 3; i++)
        tw[i] = tanh(XV[i]);
    assert_true(gjt_tensor_close("gj_grad w", g2[0], tw, 1e-15, 1e-15));
    /* backward gives the same values */
    assert_int_equal(gjt_backward(L, NULL, false), 0);
    assert_grad(x, want, 1e-15);
    assert_grad(w, tw, 1e-15);
    gj_release(gx);
    gj_release(g2[0]);
    gj_release(g2[1]);
    gj_scope_pop();
    gj_release(x);
    gj_release(w);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* gj_grad with an explicit seed on a non-scalar output, and two outputs. */
static void test_grad_seeds(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    gj_tensor *y = gj_mul_scalar(x, 3.0);
    gj_tensor *seed = gjt_tensor(GJ_F64, 1, S3, (double[]){1, 2, 3});
    gj_tensor *gx = NULL;
    assert_int_equal(gj_grad(1, &y, &seed, 1, &x, &gx, true, false), 0);
    assert_true(gjt_tensor_close("seeded gj_grad", gx, (double[]){3, 6, 9}, 0, 0));
    gj_release(gx);
    /* two outputs: gradients add */
    gj_tensor *z = gj_sum(gj_mul(x, x), 0, NULL, false);
    gj_tensor *outs[2] = {y, z}, *seeds[2] = {seed, NULL};
    gx = NULL;
    assert_int_equal(gj_grad(2, outs, seeds, 1, &x, &gx, false, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 3 * (i + 1) + 2 * XV[i];
    assert_true(gjt_tensor_close("two outputs", gx, w, 1e-15, 1e-15));
    gj_release(gx);
    assert_null(gj_tensor_grad(x));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_grad_allow_unused(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_tensor *u = leaf64(2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4}, true);
    gj_scope_push();
    gj_tensor *L = gj_sum(gj_exp(x), 0, NULL, false);
    gj_tensor *in[2] = {x, u}, *g[2] = {NULL, NULL};
    gj_clear_error();
    assert_int_not_equal(gj_grad(1, &L, NULL, 2, in, g, true, false), 0);
    assert_true(gj_last_error()[0] != '\0');
    /* (a failed call may have filled g[0]; release whatever it gave) */
    gj_release(g[0]);
    gj_release(g[1]);
    g[0] = g[1] = NULL;
    assert_int_equal(gj_grad(1, &L, NULL, 2, in, g, false, true), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = exp(XV[i]);
    assert_true(gjt_tensor_close("used", g[0], w, 1e-15, 1e-15));
    assert_non_null(g[1]);
    assert_true(gjt_shape_is(g[1], 2, (int64_t[]){2, 2}));
    assert_true(gjt_tensor_close("unused: zeros", g[1], (double[]){0, 0, 0, 0}, 0, 0));
    gj_release(g[0]);
    gj_release(g[1]);
    assert_null(gj_tensor_grad(x));
    assert_null(gj_tensor_grad(u));
    gj_scope_pop();
    gj_release(x);
    gj_release(u);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A saved tensor modified in place before backward: the error names the op
 * and the version. */
static void test_version_counter(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *a = leaf64(1, S3, XV, true);
    gj_tensor *b = leaf64(1, S3, (double[]){1, 2, 3}, true);
    gj_scope_push();
    /* mul saves both of its inputs; c is modified through a detached alias */
    gj_tensor *c = gj_tanh(a);
    gj_tensor *z = gj_mul(c, b);
    gj_tensor *L = gj_sum(z, 0, NULL, false);
    gj_tensor *d = gj_detach(c);
    assert_non_null(d);
    int64_t v0 = gj_tensor_version(c);
    assert_int_equal(gj_mul_scalar_(d, 2.0), 0);
    assert_true(gj_tensor_version(c) > v0); /* the version lives on the storage */
    assert_true(gj_tensor_version(d) == gj_tensor_version(c));
    gj_clear_error();
    assert_true(gjt_backward_fails(L, NULL, false));
    GJT_ASSERT_ERROR("mul");
    GJT_ASSERT_ERROR("version");
    assert_null(gj_tensor_grad(a));

    /* tanh: modify both its input (under no_grad: a leaf) and its output */
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_tensor *y = gj_tanh(x);
    gj_tensor *L2 = gj_sum(y, 0, NULL, false);
    gj_no_grad_push();
    assert_int_equal(gj_add_(x, gj_ones(GJ_F64, 1, S3)), 0);
    gj_no_grad_pop();
    assert_int_equal(gj_mul_scalar_(gj_detach(y), 0.5), 0);
    gj_clear_error();
    assert_true(gjt_backward_fails(L2, NULL, false));
    GJT_ASSERT_ERROR("tanh");
    GJT_ASSERT_ERROR("version");

    /* in place directly on a saved non-leaf that requires grad: either refused,
     * or the following backward fails naming the op */
    gj_tensor *x3 = leaf64(1, S3, XV, true);
    gj_tensor *y3 = gj_exp(x3);
    gj_tensor *L3 = gj_sum(gj_mul(y3, y3), 0, NULL, false);
    gj_clear_error();
    int rc = gj_add_(y3, gj_ones(GJ_F64, 1, S3));
    if (rc == 0) {
        gj_clear_error();
        assert_true(gjt_backward_fails(L3, NULL, false));
        GJT_ASSERT_ERROR("mul");
        GJT_ASSERT_ERROR("version");
    } else {
        GJT_ASSERT_ERROR("add_");
        assert_int_equal(gjt_backward(L3, NULL, false), 0); /* nothing was modified */
    }
    gj_scope_pop();
    gj_release(a);
    gj_release(b); /* x and x3 were created inside the scope: the pop released them */
    assert_int_equal(gjt_live_bytes(), live0);
}

/* In-place on a leaf that requires grad is refused in grad mode; allowed
 * under no_grad (the optimizer's pattern) and bumps the version. */
static void test_inplace_leaf(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    gj_tensor *o = gj_ones(GJ_F64, 1, S3);
    int64_t v0 = gj_tensor_version(x);
    gj_clear_error();
    assert_int_not_equal(gj_add_(x, o), 0);
    GJT_ASSERT_ERROR("add_");
    gj_clear_error();
    assert_int_not_equal(gj_mul_scalar_(x, 2.0), 0);
    GJT_ASSERT_ERROR("mul_scalar_");
    gj_clear_error();
    assert_int_not_equal(gj_zero_(x), 0);
    GJT_ASSERT_ERROR("zero_");
    gj_clear_error();
    assert_int_not_equal(gj_add_scaled_(x, o, 0.5), 0);
    GJT_ASSERT_ERROR("add_scaled_");
    gj_clear_error();
    assert_int_not_equal(gj_copy_(x, o), 0);
    GJT_ASSERT_ERROR("copy_");
    gj_clear_error();
    assert_int_not_equal(gj_mul_(x, o), 0);
    GJT_ASSERT_ERROR("mul_");
    assert_true(gjt_tensor_close("leaf unchanged", x, XV, 0, 0));
    assert_int_equal(gj_tensor_version(x), v0);
    gj_no_grad_push();
    assert_int_equal(gj_add_scaled_(x, o, 0.5), 0);
    assert_int_equal(gj_mul_scalar_(x, 2.0), 0);
    gj_no_grad_pop();
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = (XV[i] + 0.5) * 2.0;
    assert_true(gjt_tensor_close("no_grad in-place", x, w, 1e-15, 0));
    assert_true(gj_tensor_version(x) >= v0 + 2);
    assert_true(gj_requires_grad(x));
    assert_true(gj_is_leaf(x));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Non-scalar root: NULL seed is an error, an explicit seed works. */
static void test_seed(void **s) {
    int64_t live0 = gjt_live_bytes();
    const int64_t sh[] = {2, 3};
    gj_tensor *x = leaf64(2, sh, (double[]){1, 2, 3, 4, 5, 6}, true);
    gj_scope_push();
    gj_tensor *y = gj_mul(x, x);
    gj_clear_error();
    assert_true(gjt_backward_fails(y, NULL, false));
    assert_true(gj_last_error()[0] != '\0');
    assert_null(gj_tensor_grad(x));
    gj_tensor *bad = gj_ones(GJ_F64, 1, (int64_t[]){3});
    gj_clear_error();
    assert_true(gjt_backward_fails(y, bad, false));
    assert_true(gj_last_error()[0] != '\0');
    gj_tensor *seed = gjt_tensor(GJ_F64, 2, sh, (double[]){1, -1, 0.5, 0, 2, 3});
    assert_int_equal(gjt_backward(y, seed, false), 0);
    assert_grad(x, (double[]){2, -4, 3, 0, 20, 36}, 0);
    /* a 0-d and a [1] root take a NULL seed */
    gj_tensor *x1 = gj_scope_keep(leaf64(1, (int64_t[]){1}, (double[]){2.0}, true));
    assert_int_equal(gjt_backward(gj_mul(x1, x1), NULL, false), 0);
    assert_grad(x1, (double[]){4.0}, 0);
    gj_scope_pop();
    gj_release(x);
    gj_release(x1);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_requires_grad_rules(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, false);
    assert_false(gj_requires_grad(x));
    assert_true(gj_is_leaf(x));
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    assert_true(gj_requires_grad(x));
    gj_scope_push();
    gj_tensor *y = gj_tanh(x);
    assert_true(gj_requires_grad(y));
    assert_false(gj_is_leaf(y));
    gj_clear_error();
    assert_int_not_equal(gj_set_requires_grad(y, false), 0);
    assert_true(gj_last_error()[0] != '\0');
    assert_true(gj_requires_grad(y));
    /* integer tensors cannot require grad */
    gj_tensor *lab = gjt_i64(1, S3, (int64_t[]){0, 1, 2});
    gj_clear_error();
    assert_int_not_equal(gj_set_requires_grad(lab, true), 0);
    assert_true(gj_last_error()[0] != '\0');
    assert_false(gj_requires_grad(lab));
    /* turning it off on a leaf works */
    gj_tensor *x2 = leaf64(1, S3, XV, true);
    assert_int_equal(gj_set_requires_grad(x2, false), 0);
    assert_false(gj_requires_grad(gj_exp(x2)));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_detach(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_scope_push();
    gj_tensor *y = gj_exp(x);
    gj_tensor *d = gj_detach(y);
    assert_non_null(d);
    assert_false(gj_requires_grad(d));
    assert_true(gj_is_leaf(d));
    assert_ptr_equal(gj_tensor_data(d), gj_tensor_data(y)); /* same storage */
    assert_false(gj_requires_grad(gj_mul(d, d)));
    /* gradient stops at d: L = sum(y * d) has dL/dx = d * exp(x) */
    assert_int_equal(gjt_backward(gj_sum(gj_mul(y, d), 0, NULL, false), NULL, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = exp(2 * XV[i]);
    assert_grad(x, w, 1e-13);
    /* detach of a leaf */
    gj_tensor *dx = gj_detach(x);
    assert_false(gj_requires_grad(dx));
    assert_ptr_equal(gj_tensor_data(dx), gj_tensor_data(x));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Gradients through views land in the base leaf: two views of one leaf. */
static void test_views_of_one_leaf(void **s) {
    int64_t live0 = gjt_live_bytes();
    const int64_t sh[] = {2, 3};
    gj_tensor *x = leaf64(2, sh, (double[]){1, 2, 3, 4, 5, 6}, true);
    gj_scope_push();
    gj_tensor *t = gj_transpose(x, 0, 1);            /* [3,2] */
    gj_tensor *n = gj_narrow(x, 1, 1, 2);            /* [2,2] cols 1,2 */
    gj_tensor *a = gj_sum(gj_mul_scalar(t, 2.0), 0, NULL, false);
    gj_tensor *b = gj_sum(gj_mul(n, n), 0, NULL, false);
    assert_int_equal(gjt_backward(gj_add(a, b), NULL, false), 0);
    assert_grad(x, (double[]){2, 2 + 4, 2 + 6, 2, 2 + 10, 2 + 12}, 0);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* In-place ops on views write through to the base and bump its version. */
static void test_inplace_on_views(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    const int64_t sh[] = {2, 3};
    gj_tensor *x = gjt_tensor(GJ_F64, 2, sh, (double[]){1, 2, 3, 4, 5, 6});
    gj_tensor *t = gj_transpose(x, 0, 1); /* [3,2] */
    int64_t v0 = gj_tensor_version(x);
    assert_int_equal(gj_add_(t, gjt_tensor(GJ_F64, 1, (int64_t[]){2}, (double[]){10, 20})), 0);
    assert_true(gjt_tensor_close("add_ through transposed view", x,
                                 (double[]){11, 12, 13, 24, 25, 26}, 0, 0));
    assert_true(gj_tensor_version(x) > v0);
    gj_tensor *n = gj_narrow(x, 1, 1, 2); /* [2,2] cols 1,2 */
    assert_int_equal(gj_mul_scalar_(n, 2.0), 0);
    assert_true(gjt_tensor_close("mul_scalar_ through narrowed view", x,
                                 (double[]){11, 24, 26, 24, 50, 52}, 0, 0));
    assert_int_equal(gj_zero_(gj_narrow(x, 0, 0, 1)), 0);
    assert_true(gjt_tensor_close("zero_ of row 0", x, (double[]){0, 0, 0, 24, 50, 52}, 0, 0));
    /* copy_ broadcasts and casts */
    assert_int_equal(gj_copy_(x, gjt_tensor(GJ_F32, 2, (int64_t[]){2, 1}, (double[]){0.5, -1})), 0);
    assert_true(gjt_tensor_close("copy_ bcast+cast", x, (double[]){0.5, 0.5, 0.5, -1, -1, -1}, 0, 0));
    assert_int_equal(gj_tensor_dtype(x), GJ_F64);
    /* mul_ and add_scaled_ */
    gj_tensor *y = gjt_tensor(GJ_F64, 2, sh, (double[]){1, 2, 3, 4, 5, 6});
    assert_int_equal(gj_mul_(x, y), 0);
    assert_int_equal(gj_add_scaled_(x, y, -0.5), 0);
    assert_true(gjt_tensor_close("mul_ then add_scaled_", x,
                                 (double[]){0, 0, 0, -6, -7.5, -9}, 1e-15, 0));
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A user-set non-contiguous .grad is accumulated into correctly. */
static void test_noncontiguous_grad(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    const int64_t sh[] = {2, 3};
    gj_tensor *x = gjt_tensor(GJ_F64, 2, sh, (double[]){1, 2, 3, 4, 5, 6});
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_tensor *g0 = gjt_tensor(GJ_F64, 2, (int64_t[]){3, 2}, (double[]){1, 2, 3, 4, 5, 6});
    gj_tensor *g0t = gj_transpose(g0, 0, 1); /* [[1,3,5],[2,4,6]] */
    assert_int_equal(gj_tensor_set_grad(x, g0t), 0);
    assert_int_equal(gjt_backward(gj_sum(gj_mul_scalar(x, 10.0), 0, NULL, false), NULL, false), 0);
    assert_grad(x, (double[]){11, 13, 15, 12, 14, 16}, 0);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Backward from a leaf itself, and into a detached tensor made a leaf. */
static void test_backward_from_leaf(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *x = leaf64(1, S3, XV, true);
    gj_tensor *seed = gjt_tensor(GJ_F64, 1, S3, (double[]){1, 2, 3});
    assert_int_equal(gjt_backward(x, seed, false), 0);
    assert_grad(x, (double[]){1, 2, 3}, 0);
    /* detach, then requires_grad on the new leaf */
    gj_tensor *y = gj_exp(x);
    gj_tensor *d = gj_detach(y);
    assert_int_equal(gj_set_requires_grad(d, true), 0);
    assert_int_equal(gjt_backward(gj_sum(gj_mul(d, d), 0, NULL, false), NULL, false), 0);
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 2 * exp(XV[i]);
    assert_grad(d, w, 1e-14);
    assert_grad(x, (double[]){1, 2, 3}, 0); /* untouched */
    assert_null(gj_tensor_grad(y));         /* non-leaves get no .grad */
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The same backward twice gives bitwise identical gradients (f32, shapes big
 * enough for the thread pool). With compiled autograd on, a third pass runs
 * eagerly and the compiled gradients must match it within 1e-6 of the
 * largest. */
static void test_determinism(void **s) {
    int64_t live0 = gjt_live_bytes();
    double *g[3] = {NULL, NULL, NULL};
    int64_t n = 128 * 96;
    bool compiled = gj_compiled_autograd_enabled();
    for (int pass = 0; pass < (compiled ? 3 : 2); pass++) {
        if (pass == 2)
            gj_set_compiled_autograd(false);
        gjt_rng r;
        gjt_rng_seed(&r, 5);
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){128, 96}, -1, 1);
        gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){64, 96}, -1, 1);
        gj_tensor *lab = gjt_labels(&r, 1, (int64_t[]){128}, 64);
        assert_int_equal(gj_set_requires_grad(x, true), 0);
        gj_tensor *L = gj_cross_entropy(gj_gelu(gj_linear(x, w, NULL)), lab);
        assert_non_null(L);
        assert_int_equal(gjt_backward(L, NULL, false), 0);
        g[pass] = gjt_values(gj_tensor_grad(x));
        gj_scope_pop();
    }
    assert_non_null(g[0]);
    assert_non_null(g[1]);
    assert_memory_equal(g[0], g[1], sizeof(double) * (size_t)n);
    if (compiled) {
        gj_set_compiled_autograd(true);
        assert_non_null(g[2]);
        assert_true(gjt_same_as_eager("linear+gelu+cross_entropy grad x", g[0], g[2], n,
                                      gjt_compiled_rel_tol(GJ_F32)));
    }
    free(g[0]);
    free(g[1]);
    free(g[2]);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A saved tensor modified in place between two backwards of a retained
 * graph: the second backward fails naming the op and the version, and .grad
 * keeps the first backward's values. Two rounds with graphs of the same
 * structure, so that in compiled mode the second round runs the cached
 * program: the version check must hold on a cache hit too. */
static void test_version_counter_after_backward(void **s) {
    int64_t live0 = gjt_live_bytes();
    double w[3];
    for (int i = 0; i < 3; i++)
        w[i] = 2 * exp(XV[i]);
    for (int round = 0; round < 2; round++) {
        gj_tensor *x = leaf64(1, S3, XV, true);
        gj_scope_push();
        gj_tensor *y = gj_exp(x); /* exp saves its output */
        gj_tensor *L = gj_sum(gj_mul_scalar(y, 2.0), 0, NULL, false);
        assert_non_null(L);
        assert_int_equal(gjt_backward(L, NULL, true), 0);
        assert_grad(x, w, 1e-15);
        assert_int_equal(gj_mul_scalar_(gj_detach(y), 3.0), 0);
        assert_true(gjt_backward_fails(L, NULL, false));
        GJT_ASSERT_ERROR("exp");
        GJT_ASSERT_ERROR("version");
        assert_grad(x, w, 1e-15);
        gj_scope_pop();
        gj_release(x);
    }
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A graph that is never backwarded is freed with its tensors; so is one
 * whose backward failed. */
static void test_unused_graph_freed(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = gj_randn(GJ_F64, 2, (int64_t[]){16, 16}, 1.0);
    assert_non_null(x);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_tensor *m = gj_matmul(x, x);
    gj_tensor *y = gj_tanh(m);
    gj_tensor *L = gj_sum(y, 0, NULL, false);
    assert_non_null(L);
    assert_true(gjt_live_bytes() > live0 + 3 * 16 * 16 * 8);
    gj_release(m);
    gj_release(y);
    gj_release(L);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
    /* failed backward (non-scalar root without seed) */
    x = gj_randn(GJ_F64, 1, (int64_t[]){8}, 1.0);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    y = gj_exp(x);
    assert_true(gjt_backward_fails(y, NULL, false));
    gj_release(y);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accumulation),
        cmocka_unit_test(test_grad_dtype),
        cmocka_unit_test(test_diamond),
        cmocka_unit_test(test_diamond_fd),
        cmocka_unit_test(test_same_input_twice),
        cmocka_unit_test(test_retain_graph),
        cmocka_unit_test(test_second_backward_error),
        cmocka_unit_test(test_history_outlives_tensors),
        cmocka_unit_test(test_no_grad),
        cmocka_unit_test(test_grad_subset),
        cmocka_unit_test(test_grad_seeds),
        cmocka_unit_test(test_grad_allow_unused),
        cmocka_unit_test(test_version_counter),
        cmocka_unit_test(test_inplace_leaf),
        cmocka_unit_test(test_seed),
        cmocka_unit_test(test_requires_grad_rules),
        cmocka_unit_test(test_detach),
        cmocka_unit_test(test_views_of_one_leaf),
        cmocka_unit_test(test_inplace_on_views),
        cmocka_unit_test(test_noncontiguous_grad),
        cmocka_unit_test(test_backward_from_leaf),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_version_counter_after_backward),
        cmocka_unit_test(test_unused_graph_freed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
