/* SPDX-License-Identifier: MIT */
/*
 * test_hooks.c - tensor hooks and post-accumulate hooks (order, the total
 * gradient, replacement, removal, survival past the tensor, errors), hooks
 * with gj_grad, hooks under compiled autograd (the capture refuses them, the
 * backward falls back with the eager gradients), gj_tensor_set_ (sharing,
 * versions, the ZeRO bucket pattern inside a hook) and anomaly mode.
 *
 * Every test checks at its end that no tensor byte leaked.
 */
#include "gjtest.h"
#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const int64_t S3[] = {3};
static const double XV[] = {-0.8, 0.3, 1.2};

static gj_tensor *leaf(int ndim, const int64_t *shape, const double *v) {
    gj_tensor *t = gjt_tensor(GJ_F64, ndim, shape, v);
    assert_non_null(t);
    assert_int_equal(gj_set_requires_grad(t, true), 0);
    return t;
}

static gj_tensor *sum_all(gj_tensor *x) { return gj_sum(x, 0, NULL, false); }

/* What a recording hook saw. */
typedef struct seen {
    int calls;
    double vals[4][8]; /* up to 4 calls, 8 values */
    char log[64];      /* the tag of each call, in order */
    const char *tag;
    double scale, shift; /* replacement: grad * scale + shift (scale 0: keep) */
} seen;

static void record(seen *s, gj_tensor *g) {
    if (s->calls < 4) {
        int64_t n = gj_tensor_numel(g);
        for (int64_t i = 0; i < n && i < 8; i++) s->vals[s->calls][i] = gj_tensor_item_at(g, i);
    }
    s->calls++;
    strncat(s->log, s->tag, sizeof s->log - strlen(s->log) - 1);
}

/* Records the gradient; replaces it by grad*scale + shift when scale != 0.
 * The temporaries live in the hook's own scope. */
static gj_tensor *rec_hook(gj_tensor *g, void *user) {
    seen *s = user;
    record(s, g);
    if (s->scale == 0.0) return NULL;
    return gj_add_scalar(gj_mul_scalar(g, s->scale), s->shift);
}

/* seen shared by several hooks: each appends its own tag to one log. */
typedef struct tagged {
    seen *s;
    const char *tag;
    double scale, shift;
} tagged;

static gj_tensor *tag_hook(gj_tensor *g, void *user) {
    tagged *t = user;
    t->s->tag = t->tag;
    record(t->s, g);
    return gj_add_scalar(gj_mul_scalar(g, t->scale), t->shift);
}

/* ------------------------------------------------------------ tests */

/* A hook on a non-leaf sees the total gradient of that tensor and its
 * replacement flows on; hooks run in registration order. */
static void test_nonleaf_hooks_order(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf(1, S3, XV);
    gj_scope_push();
    gj_tensor *y = gj_mul_scalar(x, 2.0);     /* y = 2x */
    gj_tensor *z = gj_add(gj_mul(y, y), y);   /* z = y^2 + y: dz/dy = 2y + 1 */
    seen s = {0};
    tagged a = {&s, "a", 2.0, 0.0}, b = {&s, "b", 1.0, 1.0};
    int64_t ha = gj_register_hook(y, tag_hook, &a);
    int64_t hb = gj_register_hook(y, tag_hook, &b);
    assert_true(ha > 0 && hb > ha);
    assert_int_equal(gj_backward(sum_all(z), NULL), 0);
    assert_int_equal(s.calls, 2);
    assert_string_equal(s.log, "ab");
    double want[3];
    for (int i = 0; i < 3; i++) {
        double dy = 2 * (2 * XV[i]) + 1;          /* the total gradient of y */
        assert_true(fabs(s.vals[0][i] - dy) < 1e-15); /* a saw it */
        assert_true(fabs(s.vals[1][i] - 2 * dy) < 1e-15); /* b saw a's result */
        want[i] = (2 * dy + 1) * 2;               /* then through y = 2x */
    }
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), want, 1e-14, 0));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A leaf hook runs once on the gradient summed over every path, before it
 * is accumulated; a post-accumulate hook runs after .grad was written. */
typedef struct post_seen {
    int calls;
    double grad0; /* .grad[0] as the post hook saw it */
    bool saw_grad;
} post_seen;

static void post_hook(gj_tensor *lf, void *user) {
    post_seen *p = user;
    gj_tensor *g = gj_tensor_grad(lf);
    p->calls++;
    p->saw_grad = g != NULL;
    if (g) p->grad0 = gj_tensor_item_at(g, 0);
}

static void test_leaf_hooks(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf(1, S3, XV);
    seen s = {.tag = "h", .scale = 10.0};
    post_seen p = {0};
    assert_true(gj_register_hook(x, rec_hook, &s) > 0);
    assert_true(gj_register_post_accumulate_grad_hook(x, post_hook, &p) > 0);
    gj_scope_push();
    /* x reaches the loss along three paths: L = sum(x*x + 3x) */
    assert_int_equal(gj_backward(sum_all(gj_add(gj_mul(x, x), gj_mul_scalar(x, 3.0))), NULL), 0);
    gj_scope_pop();
    assert_int_equal(s.calls, 1);
    double want[3];
    for (int i = 0; i < 3; i++) {
        assert_true(fabs(s.vals[0][i] - (2 * XV[i] + 3)) < 1e-15);
        want[i] = 10 * (2 * XV[i] + 3);
    }
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), want, 1e-14, 0));
    assert_int_equal(p.calls, 1);
    assert_true(p.saw_grad);
    assert_true(fabs(p.grad0 - want[0]) < 1e-14);
    /* second backward: the hook sees this backward's gradient only, the
     * post hook sees the accumulated .grad */
    gj_scope_push();
    assert_int_equal(gj_backward(sum_all(gj_mul_scalar(x, 1.0)), NULL), 0);
    gj_scope_pop();
    assert_int_equal(s.calls, 2);
    assert_true(fabs(s.vals[1][0] - 1.0) < 1e-15);
    assert_int_equal(p.calls, 2);
    assert_true(fabs(p.grad0 - (want[0] + 10.0)) < 1e-14);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Removal: a removed hook no longer runs; a second removal fails. */
static void test_remove(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf(1, S3, XV);
    seen s1 = {.tag = "1", .scale = 2.0}, s2 = {.tag = "2", .scale = 3.0};
    int64_t h1 = gj_register_hook(x, rec_hook, &s1);
    int64_t h2 = gj_register_hook(x, rec_hook, &s2);
    assert_int_equal(gj_remove_hook(h1), 0);
    assert_int_equal(gj_remove_hook(h1), -1);
    GJT_ASSERT_ERROR("gj_remove_hook");
    assert_int_equal(gj_remove_hook(987654321), -1);
    gj_scope_push();
    assert_int_equal(gj_backward(sum_all(x), NULL), 0);
    gj_scope_pop();
    assert_int_equal(s1.calls, 0);
    assert_int_equal(s2.calls, 1);
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), (double[]){3, 3, 3}, 0, 0));
    /* registering again compacts the removed one away; both live hooks run */
    seen s3 = {.tag = "3", .scale = 0.0};
    assert_true(gj_register_hook(x, rec_hook, &s3) > h2);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    gj_scope_push();
    assert_int_equal(gj_backward(sum_all(x), NULL), 0);
    gj_scope_pop();
    assert_int_equal(s2.calls, 2);
    assert_int_equal(s3.calls, 1);
    assert_true(fabs(s3.vals[0][0] - 3.0) < 1e-15); /* s2 ran first */
    gj_release(x);
    assert_int_equal(gj_remove_hook(h2), -1); /* the leaf is gone, and its hooks */
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A hook on a non-leaf lives with the graph: it still runs after the
 * tensor it was registered on was released. */
static void test_hook_outlives_tensor(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf(1, S3, XV);
    gj_tensor *y = gj_tanh(x);
    seen s = {.tag = "y", .scale = -1.0};
    assert_true(gj_register_hook(y, rec_hook, &s) > 0);
    gj_tensor *l = sum_all(y);
    gj_release(y);
    assert_int_equal(gj_backward(l, NULL), 0);
    assert_int_equal(s.calls, 1);
    double want[3];
    for (int i = 0; i < 3; i++) want[i] = -(1 - tanh(XV[i]) * tanh(XV[i]));
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), want, 1e-15, 0));
    gj_release(l);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Bad registrations and a hook returning the wrong shape. */
static gj_tensor *bad_shape_hook(gj_tensor *g, void *user) {
    (void)g;
    (void)user;
    return gj_zeros(GJ_F64, 2, (int64_t[]){2, 2});
}

static void test_hook_errors(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *c = gjt_tensor(GJ_F64, 1, S3, XV);
    seen s = {.tag = "s"};
    assert_int_equal(gj_register_hook(c, rec_hook, &s), -1);
    GJT_ASSERT_ERROR("does not require grad");
    gj_tensor *x = leaf(1, S3, XV);
    assert_int_equal(gj_register_hook(x, NULL, NULL), -1);
    GJT_ASSERT_ERROR("gj_register_hook");
    gj_tensor *y = gj_exp(x);
    assert_int_equal(gj_register_post_accumulate_grad_hook(y, post_hook, NULL), -1);
    GJT_ASSERT_ERROR("leaf");
    assert_int_equal(gj_register_hook(NULL, rec_hook, &s), -1);
    /* wrong shape: the backward fails naming the hook's tensor shape, and
     * no .grad was written */
    assert_true(gj_register_hook(y, bad_shape_hook, NULL) > 0);
    assert_int_equal(gj_backward(sum_all(y), NULL), -1);
    GJT_ASSERT_ERROR("[3]");
    GJT_ASSERT_ERROR("[2, 2]");
    assert_null(gj_tensor_grad(x));
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* What a hook may return: gj_retain of a tensor from an outer scope (the
 * reference is the engine's), or a tensor moved out of the hook's scope
 * with gj_scope_keep. Neither leaks nor is freed twice. */
static gj_tensor *retain_hook(gj_tensor *g, void *user) {
    (void)g;
    return gj_retain(user);
}

static gj_tensor *keep_hook(gj_tensor *g, void *user) {
    (void)user;
    return gj_scope_keep(gj_mul_scalar(g, -2.0));
}

static void test_hook_return_ownership(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *x = leaf(1, S3, XV);
    gj_tensor *fixed = gjt_tensor(GJ_F64, 1, S3, (double[]){7, 8, 9});
    gj_tensor *y = gj_mul_scalar(x, 5.0);
    assert_true(gj_register_hook(y, retain_hook, fixed) > 0);
    assert_int_equal(gj_backward(sum_all(y), NULL), 0);
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), (double[]){35, 40, 45}, 0, 0));
    assert_true(gjt_tensor_close("fixed intact", fixed, (double[]){7, 8, 9}, 0, 0));
    gj_tensor *z = gj_mul_scalar(x, 1.0);
    assert_true(gj_register_hook(z, keep_hook, NULL) > 0);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    assert_int_equal(gj_backward(sum_all(z), NULL), 0);
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), (double[]){-2, -2, -2}, 0, 0));
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* gj_grad: the hooks of the inputs run and their result is returned. */
static void test_hooks_with_grad(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *x = leaf(1, S3, XV);
    gj_tensor *y = gj_mul_scalar(x, 4.0);
    seen sx = {.tag = "x", .scale = 0.5}, sy = {.tag = "y", .scale = 0.0};
    assert_true(gj_register_hook(x, rec_hook, &sx) > 0);
    assert_true(gj_register_hook(y, rec_hook, &sy) > 0);
    gj_tensor *l = sum_all(gj_mul(y, y));
    gj_tensor *g = NULL;
    assert_int_equal(gj_grad(1, &l, NULL, 1, &x, &g, false, false), 0);
    assert_int_equal(sx.calls, 1);
    assert_int_equal(sy.calls, 1);
    double want[3];
    for (int i = 0; i < 3; i++) want[i] = 0.5 * 4 * 2 * 4 * XV[i];
    assert_true(gjt_tensor_close("gj_grad", g, want, 1e-14, 0));
    assert_null(gj_tensor_grad(x));
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Compiled autograd calls hooks from the compiled program (jit/run/):
 * the first backward captures and compiles, the second hits the cache; the
 * hook runs once per backward on the real gradient and the gradients equal
 * the eager ones. The guards are tested in test_jit_hooks.c. */
static void hooked_step(gj_tensor *w, seen *s, double *grad_out) {
    gj_scope_push();
    gj_tensor *h = gj_tanh(gj_mul_scalar(w, 0.37));
    assert_true(gj_register_hook(h, rec_hook, s) > 0);
    gj_tensor *l = sum_all(gj_exp(h));
    assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
    assert_int_equal(gj_backward(l, NULL), 0);
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(w), grad_out), 0);
    gj_scope_pop();
}

static void test_hooks_compiled_fallback(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    gj_jit_set_disk_cache(NULL); /* a program cached by another suite must not answer */
    gj_compiled_autograd_set_quiet(true);
    const int64_t sh[] = {3, 5};
    double wv[15], eager[15], comp[15];
    for (int i = 0; i < 15; i++) wv[i] = 0.1 * i - 0.7;
    gj_tensor *w = leaf(2, sh, wv);
    seen se = {.tag = "e", .scale = 1.5, .shift = -0.25};
    gj_set_compiled_autograd(false);
    hooked_step(w, &se, eager);
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_reset_stats();
    seen sc = {.tag = "c", .scale = 1.5, .shift = -0.25};
    hooked_step(w, &sc, comp);
    assert_memory_equal(eager, comp, sizeof eager);
    hooked_step(w, &sc, comp); /* the same key again: the cached program, still hooked */
    gj_ca_stats s;
    gj_compiled_autograd_stats(&s);
    gj_set_compiled_autograd(was);
    assert_int_equal(sc.calls, 2);
    assert_int_equal(s.backwards, 2);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 1);
    assert_memory_equal(eager, comp, sizeof eager);
    gj_release(w);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ---------------------------------------------------------------- set_ */

static void test_set_basic(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *dst = leaf(1, S3, XV);
    gj_tensor *src = gjt_tensor(GJ_F64, 2, (int64_t[]){2, 2}, (double[]){1, 2, 3, 4});
    int64_t v0 = gj_tensor_version(dst), vs = gj_tensor_version(src);
    assert_int_equal(gj_tensor_set_(dst, src), 0);
    assert_true(gj_tensor_version(dst) > v0);
    assert_true(gj_tensor_version(dst) > vs);
    assert_true(gjt_shape_is(dst, 2, (int64_t[]){2, 2}));
    assert_ptr_equal(gj_tensor_data(dst), gj_tensor_data(src));
    assert_true(gj_requires_grad(dst));
    assert_true(gj_is_leaf(dst));
    /* an in-place op on src is visible through dst */
    assert_int_equal(gj_mul_scalar_(src, 10.0), 0);
    assert_true(gjt_tensor_close("dst after src *= 10", dst, (double[]){10, 20, 30, 40}, 0, 0));
    /* dst still a leaf that requires grad: its gradient has the new shape */
    assert_int_equal(gj_backward(sum_all(gj_mul(dst, dst)), NULL), 0);
    assert_true(gjt_tensor_close("dst.grad", gj_tensor_grad(dst), (double[]){20, 40, 60, 80}, 0, 0));
    /* a transposed view with an offset keeps its strides and offset */
    gj_tensor *big = gjt_tensor(GJ_F64, 2, (int64_t[]){3, 2}, (double[]){1, 2, 3, 4, 5, 6});
    gj_tensor *view = gj_transpose(gj_narrow(big, 0, 1, 2), 0, 1); /* [[3,5],[4,6]] */
    gj_tensor *d2 = gj_zeros(GJ_F32, 1, (int64_t[]){7});
    assert_int_equal(gj_tensor_set_(d2, view), 0);
    assert_int_equal(gj_tensor_dtype(d2), GJ_F64);
    assert_false(gj_tensor_is_contiguous(d2));
    assert_true(gjt_tensor_close("set_ to a view", d2, (double[]){3, 5, 4, 6}, 0, 0));
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_set_refusals(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *x = leaf(1, S3, XV);
    gj_tensor *y = gj_exp(x);
    gj_tensor *z = gj_zeros(GJ_F64, 1, S3);
    assert_int_equal(gj_tensor_set_(y, z), -1);
    GJT_ASSERT_ERROR("non-leaf");
    gj_no_grad_push();
    assert_int_equal(gj_tensor_set_(y, z), 0); /* allowed under no_grad */
    gj_no_grad_pop();
    gj_tensor *labels = gjt_i64(1, S3, (int64_t[]){1, 2, 3});
    assert_int_equal(gj_tensor_set_(x, labels), -1);
    GJT_ASSERT_ERROR("i64");
    assert_int_equal(gj_tensor_set_(NULL, z), -1);
    GJT_ASSERT_ERROR("gj_tensor_set_");
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The ZeRO / DDP bucket pattern: a post-accumulate hook copies each
 * parameter's .grad into its slice of one flat bucket and swaps .grad to a
 * view of that slice with set_; later backwards accumulate in place into
 * the bucket. */
typedef struct bucket_ctx {
    gj_tensor *bucket; /* [10] f64 */
    int64_t offset;
    int calls;
} bucket_ctx;

static void bucket_hook(gj_tensor *p, void *user) {
    bucket_ctx *c = user;
    gj_tensor *g = gj_tensor_grad(p);
    gj_tensor *slot = gj_view(gj_narrow(c->bucket, 0, c->offset, gj_tensor_numel(p)),
                              gj_tensor_ndim(p), gj_tensor_shape(p));
    assert_non_null(slot);
    if (gj_tensor_data(g) != gj_tensor_data(slot)) {
        assert_int_equal(gj_copy_(slot, g), 0);
        assert_int_equal(gj_tensor_set_(g, slot), 0);
    }
    c->calls++;
}

static void test_set_in_hook_bucket(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p1 = leaf(2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
    gj_tensor *p2 = leaf(1, (int64_t[]){4}, (double[]){-1, -2, -3, -4});
    gj_tensor *bucket = gj_zeros(GJ_F64, 1, (int64_t[]){10});
    bucket_ctx c1 = {bucket, 0, 0}, c2 = {bucket, 6, 0};
    assert_true(gj_register_post_accumulate_grad_hook(p1, bucket_hook, &c1) > 0);
    assert_true(gj_register_post_accumulate_grad_hook(p2, bucket_hook, &c2) > 0);
    /* L = sum(p1^2) + 3 sum(p2): grads 2*p1 and 3 */
    double want[10] = {2, 4, 6, 8, 10, 12, 3, 3, 3, 3};
    for (int step = 1; step <= 2; step++) {
        gj_scope_push();
        gj_tensor *l = gj_add(sum_all(gj_mul(p1, p1)), gj_mul_scalar(sum_all(p2), 3.0));
        assert_int_equal(gj_backward(l, NULL), 0);
        gj_scope_pop();
        double w[10];
        for (int i = 0; i < 10; i++) w[i] = step * want[i];
        assert_true(gjt_tensor_close("bucket", bucket, w, 1e-14, 0));
        /* .grad IS the bucket's memory */
        assert_ptr_equal(gj_tensor_data(gj_tensor_grad(p1)), gj_tensor_data(bucket));
        assert_ptr_equal(gj_tensor_data(gj_tensor_grad(p2)),
                         (double *)gj_tensor_data(bucket) + 6);
        assert_true(gjt_shape_is(gj_tensor_grad(p1), 2, (int64_t[]){2, 3}));
    }
    assert_int_equal(c1.calls, 2);
    assert_int_equal(c2.calls, 2);
    gj_release(p1);
    gj_release(p2);
    gj_release(bucket);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------------- anomaly */

static void test_anomaly_mode(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = leaf(1, S3, (double[]){0.0, 1.0, 4.0});
    /* d sqrt(x)/dx = 1/(2 sqrt x) is Inf at 0 */
    gj_scope_push();
    assert_int_equal(gj_backward(sum_all(gj_sqrt(x)), NULL), 0); /* off: Inf flows through */
    assert_true(isinf(gj_tensor_item_at(gj_tensor_grad(x), 0)));
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    gj_set_anomaly_mode(true);
    assert_true(gj_anomaly_mode_enabled());
    assert_int_equal(gj_backward(sum_all(gj_sqrt(x)), NULL), -1);
    GJT_ASSERT_ERROR("anomaly");
    GJT_ASSERT_ERROR("sqrt");
    GJT_ASSERT_ERROR("Inf");
    assert_null(gj_tensor_grad(x));
    /* a finite backward passes; with compiled autograd on it runs eagerly */
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(gj_backward(sum_all(gj_mul(x, x)), NULL), 0);
    gj_ca_stats s;
    gj_compiled_autograd_stats(&s);
    gj_set_compiled_autograd(was);
    gj_set_anomaly_mode(false);
    assert_int_equal(s.backwards, 1);
    assert_int_equal(s.compiles + s.mem_hits + s.disk_hits, 0);
    /* counted as a fallback of its own reason, readable through the API */
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_INCOMPATIBLE_MODE], 1);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "anomaly"));
    assert_true(gjt_tensor_close("x.grad", gj_tensor_grad(x), (double[]){0, 2, 8}, 0, 0));
    /* NaN is named as such: d sqrt(y)/dy at y = -1 */
    gj_set_anomaly_mode(true);
    gj_tensor *y = leaf(1, (int64_t[]){1}, (double[]){-1.0});
    assert_int_equal(gj_backward(sum_all(gj_sqrt(y)), NULL), -1);
    GJT_ASSERT_ERROR("NaN");
    gj_set_anomaly_mode(false);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nonleaf_hooks_order),
        cmocka_unit_test(test_leaf_hooks),
        cmocka_unit_test(test_remove),
        cmocka_unit_test(test_hook_outlives_tensor),
        cmocka_unit_test(test_hook_errors),
        cmocka_unit_test(test_hook_return_ownership),
        cmocka_unit_test(test_hooks_with_grad),
        cmocka_unit_test(test_hooks_compiled_fallback),
        cmocka_unit_test(test_set_basic),
        cmocka_unit_test(test_set_refusals),
        cmocka_unit_test(test_set_in_hook_bucket),
        cmocka_unit_test(test_anomaly_mode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
