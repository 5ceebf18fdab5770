/* SPDX-License-Identifier: MIT */
/*
 * test_custom_ops.c - custom ops from C functions and schema strings:
 * mylib::scaled_gelu (Tensor, float), mylib::two (two Tensor results),
 * mylib::shift (Tensor, int), checked by finite differences in f64; schema
 * errors; call errors (scalars, missing backward, failing or misbehaving
 * user functions, modified saved inputs); no_grad; and compiled autograd,
 * which runs their backward functions as opaque calls of the compiled
 * program, with the same gradients.
 *
 * The user functions follow the calling convention of gradjit.h: tensors
 * borrowed, scalars by value in schema order, results through out-pointers
 * as new references, 0 for success. They run in a scope of their own.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------ user functions */

/* scaled_gelu(x, alpha) = alpha * gelu(x) (tanh approximation) */
static int sg_fwd(gj_tensor *x, double alpha, gj_tensor **out) {
    *out = gj_mul_scalar(gj_gelu(x), alpha);
    return *out ? 0 : 1;
}

/* gelu'(x) = 0.5(1 + t) + 0.5 x (1 - t^2) c (1 + 3k x^2), t = tanh(c(x + k x^3)) */
static gj_tensor *gelu_grad(gj_tensor *x) {
    const double c = 0.7978845608028654, k = 0.044715;
    gj_tensor *x2 = gj_mul(x, x);
    gj_tensor *u = gj_mul_scalar(gj_add(x, gj_mul_scalar(gj_mul(x2, x), k)), c);
    gj_tensor *t = gj_tanh(u);
    gj_tensor *a = gj_mul_scalar(gj_add_scalar(t, 1.0), 0.5);
    gj_tensor *one_m_t2 = gj_add_scalar(gj_neg(gj_mul(t, t)), 1.0);
    gj_tensor *poly = gj_mul_scalar(gj_add_scalar(gj_mul_scalar(x2, 3 * k), 1.0), 0.5 * c);
    return gj_add(a, gj_mul(gj_mul(x, one_m_t2), poly));
}

static int sg_bwd(gj_tensor *g, gj_tensor *x, double alpha, gj_tensor **gx) {
    *gx = gj_mul(g, gj_mul_scalar(gelu_grad(x), alpha));
    return *gx ? 0 : 1;
}

/* two(a, b) = (a * b, a + b) */
static int two_fwd(gj_tensor *a, gj_tensor *b, gj_tensor **prod, gj_tensor **sum) {
    *prod = gj_mul(a, b);
    *sum = gj_add(a, b);
    return *prod && *sum ? 0 : 1;
}

static int two_bwd(gj_tensor *gp, gj_tensor *gs, gj_tensor *a, gj_tensor *b, gj_tensor **ga,
                   gj_tensor **gb) {
    *ga = gj_add(gj_mul(gp, b), gs);
    *gb = gj_add(gj_mul(gp, a), gs);
    return *ga && *gb ? 0 : 1;
}

/* shift(x, k): roll along the last axis by k (out[..., i] = x[..., i - k]) */
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
    *gx = roll(g, -k);
    return *gx ? 0 : 1;
}

static gj_custom_op *g_sg, *g_two, *g_shift;

static void define_ops(void) {
    if (g_sg) return;
    g_sg = gj_custom_op_define("mylib::scaled_gelu(Tensor x, float alpha) -> Tensor",
                               (void *)sg_fwd, (void *)sg_bwd);
    g_two = gj_custom_op_define("mylib::two(Tensor a, Tensor b) -> (Tensor, Tensor)",
                                (void *)two_fwd, (void *)two_bwd);
    g_shift = gj_custom_op_define(" mylib::shift ( Tensor x ,int k)->Tensor ",
                                  (void *)shift_fwd, (void *)shift_bwd);
    if (!g_sg || !g_two || !g_shift) print_error("define: %s\n", gj_last_error());
    assert_non_null(g_sg);
    assert_non_null(g_two);
    assert_non_null(g_shift);
}

/* ------------------------------------------------------ gradient checks */

static gj_tensor *call1(gj_custom_op *op, gj_tensor **in, const double *sc) {
    gj_tensor *out = NULL;
    if (gj_custom_op_call(op, in, sc, &out) != 0) return NULL;
    return out;
}

static gj_tensor *f_sg(gj_tensor **in, void *ctx) { return call1(g_sg, in, ctx); }
static gj_tensor *f_shift(gj_tensor **in, void *ctx) { return call1(g_shift, in, ctx); }

/* both results used: prod + 2 * sum */
static gj_tensor *f_two(gj_tensor **in, void *ctx) {
    (void)ctx;
    gj_tensor *o[2];
    if (gj_custom_op_call(g_two, in, NULL, o) != 0) return NULL;
    return gj_add(o[0], gj_mul_scalar(o[1], 2.0));
}

/* only the second result used: the first gets zeros as its gradient */
static gj_tensor *f_two_second(gj_tensor **in, void *ctx) {
    (void)ctx;
    gj_tensor *o[2];
    if (gj_custom_op_call(g_two, in, NULL, o) != 0) return NULL;
    return gj_tanh(o[1]);
}

static void test_scaled_gelu(void **st) {
    (void)st;
    define_ops();
    double alpha = 1.7;
    gjt_check c = {.name = "mylib::scaled_gelu", .fn = f_sg, .ctx = &alpha, .n_in = 1,
                   .in = {{.ndim = 2, .shape = {3, 4}, .lo = -3, .hi = 3}}, .data_seed = 11};
    assert_int_equal(gjt_gradcheck(&c), 0);
    c.in[0].view = GJT_TRANSPOSED;
    assert_int_equal(gjt_gradcheck(&c), 0);
    /* forward values: alpha * gelu */
    gj_scope_push();
    gj_tensor *x = gjt_tensor(GJ_F64, 1, (int64_t[]){3}, (double[]){-1, 0.5, 2});
    gj_tensor *y = f_sg(&x, &alpha);
    assert_non_null(y);
    gj_tensor *ref = gj_mul_scalar(gj_gelu(x), alpha);
    double want[3];
    assert_int_equal(gj_tensor_to_f64(ref, want), 0);
    assert_true(gjt_tensor_close("scaled_gelu", y, want, 0, 0));
    assert_false(gj_requires_grad(y));
    gj_scope_pop();
}

static void test_two(void **st) {
    (void)st;
    define_ops();
    gjt_check c = {.name = "mylib::two", .fn = f_two, .n_in = 2,
                   .in = {{.ndim = 2, .shape = {2, 3}}, {.ndim = 2, .shape = {2, 3}, .view = GJT_TRANSPOSED}},
                   .data_seed = 12};
    assert_int_equal(gjt_gradcheck(&c), 0);
    c.fn = f_two_second;
    c.name = "mylib::two (second result only)";
    assert_int_equal(gjt_gradcheck(&c), 0);
    c.in[1].constant = true; /* b needs no gradient */
    assert_int_equal(gjt_gradcheck(&c), 0);
}

static void test_shift(void **st) {
    (void)st;
    define_ops();
    double k = 2;
    gjt_check c = {.name = "mylib::shift k=2", .fn = f_shift, .ctx = &k, .n_in = 1,
                   .in = {{.ndim = 2, .shape = {2, 5}}}, .data_seed = 13};
    assert_int_equal(gjt_gradcheck(&c), 0);
    k = -1;
    c.name = "mylib::shift k=-1";
    assert_int_equal(gjt_gradcheck(&c), 0);
    gj_scope_push();
    gj_tensor *x = gjt_tensor(GJ_F64, 1, (int64_t[]){5}, (double[]){0, 1, 2, 3, 4});
    double k2 = 2;
    assert_true(gjt_tensor_close("shift", f_shift(&x, &k2), (double[]){3, 4, 0, 1, 2}, 0, 0));
    double kbad = 1.5;
    assert_null(f_shift(&x, &kbad));
    GJT_ASSERT_ERROR("mylib::shift");
    GJT_ASSERT_ERROR("integer");
    gj_scope_pop();
}

/* ---------------------------------------------------------------- errors */

static int nop_fwd(gj_tensor *x, gj_tensor **out) {
    *out = gj_retain(x);
    return 0;
}

static void test_schema_errors(void **st) {
    (void)st;
    static const struct {
        const char *schema, *msg;
    } bad[] = {
        {"scaled_gelu(Tensor x) -> Tensor", "::"},
        {"mylib::f(Tensor x, float) -> Tensor", "argument name"},
        {"mylib::f(Tensor? x) -> Tensor", "optional"},
        {"mylib::f(Tensor x, double a) -> Tensor", "unknown argument type"},
        {"mylib::f(Tensor x) Tensor", "'->'"},
        {"mylib::f(Tensor x) -> int", "results must be Tensor"},
        {"mylib::f(float a) -> Tensor", "at least one Tensor"},
        {"mylib::f(Tensor x, Tensor x) -> Tensor", "duplicate"},
        {"mylib::f(Tensor x) -> (Tensor, Tensor, Tensor)", "too many results"},
        {"mylib::f(Tensor x -> Tensor", "expected"},
        {"mylib::f(Tensor x) -> Tensor y z", "unexpected text"},
        {"mylib::f(Tensor x, int k=3) -> Tensor", "default values"},
        {"mylib::f(Tensor x, float a, float b, float c, float d, float e) -> Tensor",
         "too many float"},
        {"", "namespace"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gj_clear_error();
        gj_custom_op *op = gj_custom_op_define(bad[i].schema, (void *)nop_fwd, NULL);
        if (op || !gjt_error_has(bad[i].msg) || !gjt_error_has("malformed schema"))
            print_error("schema \"%s\": got '%s', want '%s'\n", bad[i].schema, gj_last_error(),
                        bad[i].msg);
        assert_null(op);
    }
    assert_null(gj_custom_op_define(NULL, (void *)nop_fwd, NULL));
    GJT_ASSERT_ERROR("gj_custom_op_define");
    assert_null(gj_custom_op_define("mytest::nofwd(Tensor x) -> Tensor", NULL, NULL));
    GJT_ASSERT_ERROR("gj_custom_op_define");
    gj_custom_op *d = gj_custom_op_define("mytest::dup(Tensor x) -> Tensor", (void *)nop_fwd, NULL);
    assert_non_null(d);
    assert_ptr_equal(gj_custom_op_find("mytest::dup"), d);
    assert_null(gj_custom_op_find("mytest::nope"));
    assert_null(gj_custom_op_define("mytest::dup(Tensor y) -> Tensor", (void *)nop_fwd, NULL));
    GJT_ASSERT_ERROR("already defined");
}

static int fail_fwd(gj_tensor *x, gj_tensor **out) {
    (void)out;
    gj_tensor *bad = gj_matmul(x, x); /* [3] @ [3]: an error message of its own */
    return bad ? 0 : 7;
}

static int silent_fwd(gj_tensor *x, gj_tensor **out) {
    (void)x;
    (void)out;
    return 0; /* writes no output */
}

static int wrong_bwd(gj_tensor *g, gj_tensor *x, gj_tensor **gx) {
    (void)x;
    *gx = gj_sum(g, 0, NULL, false); /* a scalar for a [3] input */
    return 0;
}

static int failing_bwd(gj_tensor *g, gj_tensor *x, gj_tensor **gx) {
    (void)g;
    (void)x;
    (void)gx;
    return 3;
}

static void test_call_errors(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    const int64_t s3[] = {3};
    gj_tensor *x = gjt_tensor(GJ_F64, 1, s3, (double[]){1, 2, 3});
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_tensor *out[2] = {NULL, NULL};

    gj_custom_op *nb = gj_custom_op_define("mytest::nobwd(Tensor x) -> Tensor", (void *)nop_fwd, NULL);
    assert_non_null(nb);
    assert_int_equal(gj_custom_op_call(nb, &x, NULL, out), -1);
    GJT_ASSERT_ERROR("without a backward");
    gj_no_grad_push();
    assert_int_equal(gj_custom_op_call(nb, &x, NULL, out), 0); /* fine under no_grad */
    assert_false(gj_requires_grad(out[0]));
    assert_ptr_equal(gj_tensor_data(out[0]), gj_tensor_data(x));
    gj_no_grad_pop();

    gj_custom_op *ff = gj_custom_op_define("mytest::failfwd(Tensor x) -> Tensor", (void *)fail_fwd,
                                           (void *)failing_bwd);
    assert_int_equal(gj_custom_op_call(ff, &x, NULL, out), -1);
    GJT_ASSERT_ERROR("mytest::failfwd: forward function returned 7");
    GJT_ASSERT_ERROR("matmul");

    gj_custom_op *sf = gj_custom_op_define("mytest::silent(Tensor x) -> Tensor", (void *)silent_fwd,
                                           (void *)failing_bwd);
    assert_int_equal(gj_custom_op_call(sf, &x, NULL, out), -1);
    GJT_ASSERT_ERROR("wrote no tensor");

    gj_custom_op *wb = gj_custom_op_define("mytest::wrongbwd(Tensor x) -> Tensor", (void *)nop_fwd,
                                           (void *)wrong_bwd);
    assert_int_equal(gj_custom_op_call(wb, &x, NULL, out), 0);
    assert_true(gj_requires_grad(out[0]));
    assert_int_equal(gj_backward(gj_sum(out[0], 0, NULL, false), NULL), -1);
    GJT_ASSERT_ERROR("argument 'x'");
    GJT_ASSERT_ERROR("[3]");
    assert_null(gj_tensor_grad(x));

    gj_custom_op *fb = gj_custom_op_define("mytest::failbwd(Tensor x) -> Tensor", (void *)nop_fwd,
                                           (void *)failing_bwd);
    assert_int_equal(gj_custom_op_call(fb, &x, NULL, out), 0);
    assert_int_equal(gj_backward(gj_sum(out[0], 0, NULL, false), NULL), -1);
    GJT_ASSERT_ERROR("backward function returned 3");

    /* a saved input modified in place before backward */
    double alpha = 2.0;
    gj_tensor *y = gj_mul_scalar(x, 1.0);
    assert_int_equal(gj_custom_op_call(g_sg, &y, &alpha, out), 0);
    gj_tensor *l = gj_sum(out[0], 0, NULL, false);
    gj_no_grad_push();
    assert_int_equal(gj_mul_scalar_(y, 3.0), 0);
    gj_no_grad_pop();
    assert_int_equal(gj_backward(l, NULL), -1);
    GJT_ASSERT_ERROR("mylib::scaled_gelu");
    GJT_ASSERT_ERROR("modified by an in-place operation");

    assert_int_equal(gj_custom_op_call(NULL, &x, NULL, out), -1);
    assert_int_equal(gj_custom_op_call(g_sg, &x, NULL, out), -1); /* scalars missing */
    GJT_ASSERT_ERROR("scalar_args");
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------------ compiled */

/* One step of a small model through all three ops; returns .grad of w. */
static void model_step(gj_tensor *w, gj_tensor *v, double *gw, double *gv) {
    gj_scope_push();
    double alpha = 0.8, k = 1;
    assert_int_equal(gj_tensor_set_grad(w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(v, NULL), 0);
    gj_tensor *h = call1(g_sg, &w, &alpha);
    gj_tensor *s = call1(g_shift, &h, &k);
    gj_tensor *ab[2] = {s, v}, *o[2];
    assert_int_equal(gj_custom_op_call(g_two, ab, NULL, o), 0);
    gj_tensor *l = gj_sum(gj_tanh(gj_add(o[0], o[1])), 0, NULL, false);
    assert_int_equal(gj_backward(l, NULL), 0);
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(w), gw), 0);
    assert_int_equal(gj_tensor_to_f64(gj_tensor_grad(v), gv), 0);
    gj_scope_pop();
}

/* The compiled backward runs the three ops' backward functions as opaque
 * calls: no fallback, one compile then cache hits, eager's gradients bit
 * for bit (tests/test_jit_custom.c covers the compiled path in depth). */
static void test_compiled(void **st) {
    (void)st;
    define_ops();
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    gj_compiled_autograd_set_quiet(true);
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    const int64_t sh[] = {4, 6};
    gj_tensor *w = gjt_uniform(&r, GJ_F64, 2, sh, -2, 2);
    gj_tensor *v = gjt_uniform(&r, GJ_F64, 2, sh, -1, 1);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_set_requires_grad(v, true), 0);
    double ew[24], ev[24], cw[24], cv[24];
    gj_set_compiled_autograd(false);
    model_step(w, v, ew, ev);
    gj_set_compiled_autograd(true);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    for (int step = 0; step < 3; step++) {
        model_step(w, v, cw, cv);
        assert_memory_equal(ew, cw, sizeof ew);
        assert_memory_equal(ev, cv, sizeof ev);
    }
    gj_ca_stats s;
    gj_compiled_autograd_stats(&s);
    gj_set_compiled_autograd(was);
    assert_int_equal(s.backwards, 3);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles + s.disk_hits, 1); /* made once: compiled, or loaded */
    assert_int_equal(s.mem_hits, 2);
    gj_release(w);
    gj_release(v);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scaled_gelu),
        cmocka_unit_test(test_two),
        cmocka_unit_test(test_shift),
        cmocka_unit_test(test_schema_errors),
        cmocka_unit_test(test_call_errors),
        cmocka_unit_test(test_compiled),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
