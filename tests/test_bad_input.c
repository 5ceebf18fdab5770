/* SPDX-License-Identifier: MIT */
/*
 * test_bad_input.c - a catalogue of bad calls. Every entry must return NULL
 * (or a non-zero status), must not crash, must set gj_last_error() to a
 * non-empty message naming the op, and must not leak tensor bytes.
 *
 * Freed tensors are never passed (that is undefined behaviour and ASan
 * would rightly flag it); instead, headers the runtime must reject (magic 0
 * and the DEAD magic a released header carries) are built on the stack,
 * where the memory stays valid.
 */
#include "gjtest.h"

#include "runtime/rt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_fail;

/* For a call that returns a tensor (tensor true), the NULL it returned,
 * passed on, must cite its message as the cause (gradjit.h, "errors"). */
static void expect_null_impl(gj_tensor *r, const char *op, const char *expr, int line,
                             bool tensor) {
    if (r) {
        fprintf(stderr, "line %d: %s: expected NULL, got a tensor\n", line, expr);
        g_fail++;
        gj_release(r);
        return;
    }
    if (gj_last_error()[0] == '\0' || !gjt_error_has(op)) {
        fprintf(stderr, "line %d: %s: error '%s' does not name '%s'\n", line, expr,
                gj_last_error(), op);
        g_fail++;
        return;
    }
    if (!tensor) return;
    char msg[1024], want[1200];
    snprintf(msg, sizeof msg, "%s", gj_last_error());
    const char *inner = strstr(msg, " (caused by: "); /* a cause of its own is kept */
    if (inner) {
        inner += strlen(" (caused by: ");
        msg[strlen(msg) - 1] = '\0'; /* its closing parenthesis */
    }
    snprintf(want, sizeof want, "gj_neg: x is NULL (caused by: %s)", inner ? inner : msg);
    gj_tensor *n = gj_neg(r);
    if (n || strcmp(gj_last_error(), want) != 0) {
        fprintf(stderr, "line %d: %s: the NULL passed on says '%s', not '%s'\n", line, expr,
                gj_last_error(), want);
        g_fail++;
    }
}

static void expect_fail_impl(int rc, const char *op, const char *expr, int line) {
    if (rc == 0) {
        fprintf(stderr, "line %d: %s: expected a non-zero status\n", line, expr);
        g_fail++;
        return;
    }
    if (gj_last_error()[0] == '\0' || !gjt_error_has(op)) {
        fprintf(stderr, "line %d: %s: error '%s' does not name '%s'\n", line, expr,
                gj_last_error(), op);
        g_fail++;
    }
}

/* EXPECT_NULL(op, call): call returns NULL and the error names op. */
#define EXPECT_NULL(op, ...)                                                    \
    do {                                                                        \
        gj_clear_error();                                                       \
        expect_null_impl((__VA_ARGS__), op, #__VA_ARGS__, __LINE__, true);      \
    } while (0)
#define EXPECT_FAIL(op, ...)                                                    \
    do {                                                                        \
        gj_clear_error();                                                       \
        expect_fail_impl((__VA_ARGS__), op, #__VA_ARGS__, __LINE__);            \
    } while (0)

static void expect_null_optim_impl(gj_optim *o, const char *op, const char *expr, int line) {
    if (o) {
        fprintf(stderr, "line %d: %s: expected NULL, got an optimizer\n", line, expr);
        g_fail++;
        gj_optim_free(o);
        return;
    }
    expect_null_impl(NULL, op, expr, line, false);
}
#define EXPECT_NULL_OPTIM(op, ...)                                              \
    do {                                                                        \
        gj_clear_error();                                                       \
        expect_null_optim_impl((__VA_ARGS__), op, #__VA_ARGS__, __LINE__);      \
    } while (0)

#define BEGIN()                                                                 \
    g_fail = 0;                                                                 \
    int64_t live0_ = gjt_live_bytes();                                          \
    gj_scope_push()
#define END()                                                                   \
    gj_scope_pop();                                                             \
    if (gjt_live_bytes() != live0_) {                                           \
        fprintf(stderr, "leak: live bytes %lld -> %lld\n", (long long)live0_,   \
                (long long)gjt_live_bytes());                                   \
        g_fail++;                                                               \
    }                                                                           \
    assert_int_equal(g_fail, 0)

static gj_tensor *z32(int ndim, const int64_t *shape) {
    gj_tensor *t = gj_zeros(GJ_F32, ndim, shape);
    assert_non_null(t);
    return t;
}
static gj_tensor *z64(int ndim, const int64_t *shape) {
    gj_tensor *t = gj_zeros(GJ_F64, ndim, shape);
    assert_non_null(t);
    return t;
}
#define SHP(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static void test_shape_mismatch(void **s) {
    BEGIN();
    gj_tensor *a23 = z32(SHP(2, 3)), *a43 = z32(SHP(4, 3)), *a45 = z32(SHP(4, 5));
    gj_tensor *a24 = z32(SHP(2, 4)), *a234 = z32(SHP(2, 3, 4)), *a345 = z32(SHP(3, 4, 5));
    EXPECT_NULL("add", gj_add(a23, a43));
    EXPECT_NULL("sub", gj_sub(a23, a24));
    EXPECT_NULL("mul", gj_mul(a234, a43));
    EXPECT_NULL("div", gj_div(a43, a23));
    EXPECT_NULL("matmul", gj_matmul(a23, a45));         /* inner 3 vs 4 */
    EXPECT_NULL("matmul", gj_matmul(a234, a345));       /* batch 2 vs 3 */
    EXPECT_NULL("linear", gj_linear(a23, a45, NULL));   /* in 3 vs 5 */
    gj_tensor *w53 = z32(SHP(5, 3)), *b4 = z32(SHP(4));
    EXPECT_NULL("linear", gj_linear(a23, w53, b4));     /* bias 4 vs out 5 */
    EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){a23, a24}, 0));
    EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){a23, a234}, 0));
    EXPECT_NULL("cat", gj_cat(0, (gj_tensor *[]){a23}, 0));
    EXPECT_NULL("reshape", gj_reshape(a23, SHP(4, 2)));
    EXPECT_NULL("reshape", gj_reshape(a23, SHP(-1, -1)));
    EXPECT_NULL("reshape", gj_reshape(a23, SHP(-1, 4)));
    EXPECT_NULL("reshape", gj_reshape(a23, SHP(-2, -3)));
    gj_tensor *t = gj_transpose(a23, 0, 1);
    assert_non_null(t);
    EXPECT_NULL("view", gj_view(t, SHP(6)));            /* not viewable */
    EXPECT_NULL("view", gj_view(a23, SHP(7)));
    EXPECT_NULL("expand", gj_expand(a23, SHP(2, 4)));
    EXPECT_NULL("expand", gj_expand(a23, SHP(3)));      /* fewer dims */
    EXPECT_NULL("expand", gj_expand(a23, SHP(4, 3)));
    EXPECT_NULL("narrow", gj_narrow(a24, 1, 2, 3));     /* 2+3 > 4 */
    EXPECT_NULL("narrow", gj_narrow(a24, 1, -1, 2));
    EXPECT_NULL("narrow", gj_narrow(a24, 1, 0, -1));
    EXPECT_NULL("narrow", gj_narrow(a24, 0, 3, 1));
    gj_tensor *w3 = z32(SHP(3)), *w4 = z32(SHP(4));
    EXPECT_NULL("layer_norm", gj_layer_norm(a24, w3, NULL, 1e-5));
    EXPECT_NULL("layer_norm", gj_layer_norm(a24, w4, w3, 1e-5));
    EXPECT_NULL("layer_norm", gj_layer_norm(a24, a24, NULL, 1e-5));
    gj_tensor *lab3 = gjt_i64(SHP(3), (int64_t[]){0, 1, 2});
    gj_tensor *lab22 = gjt_i64(SHP(2, 2), (int64_t[]){0, 1, 2, 0});
    EXPECT_NULL("cross_entropy", gj_cross_entropy(a45, lab3));   /* N 4 vs 3 */
    EXPECT_NULL("cross_entropy", gj_cross_entropy(a45, lab22));  /* labels 2-D */
    EXPECT_NULL("cross_entropy", gj_cross_entropy(a234, lab3));  /* logits 3-D */
    gj_tensor *m43 = gj_ones(GJ_F32, SHP(4, 3));
    EXPECT_NULL("where", gj_where(m43, a23, a23));
    EXPECT_NULL("where", gj_where(a23, a43, a23));
    EXPECT_NULL("masked_fill", gj_masked_fill(a23, m43, 1.0));
    gj_tensor *tab1 = z32(SHP(5));
    EXPECT_NULL("embedding", gj_embedding(tab1, lab3));          /* table 1-D */
    gj_tensor *x34 = z32(SHP(3, 4));
    EXPECT_FAIL("add_", gj_add_(a23, x34));
    EXPECT_FAIL("add_", gj_add_(w3, a23)); /* y must broadcast to x, not x to y */
    EXPECT_FAIL("mul_", gj_mul_(a23, x34));
    EXPECT_FAIL("copy_", gj_copy_(a23, x34));
    EXPECT_FAIL("add_scaled_", gj_add_scaled_(a23, x34, 2.0));
    END();
}

/* In a chain such as gj_gelu(gj_matmul(a, b)), the NULL that reaches gelu
 * keeps the first error, which names the real problem (matmul's shapes). */
static void test_error_chain(void **s) {
    (void)s;
    gj_scope_push();
    gj_tensor *a = gj_zeros(GJ_F32, 2, (int64_t[]){2, 3});
    gj_tensor *b = gj_zeros(GJ_F32, 2, (int64_t[]){4, 5});
    gj_clear_error();
    assert_null(gj_gelu(gj_matmul(a, b)));
    const char *e = gj_last_error();
    assert_non_null(strstr(e, "gj_gelu"));
    assert_non_null(strstr(e, "matmul"));
    assert_non_null(strstr(e, "[2, 3]"));
    /* a plain NULL with no earlier error says just that */
    gj_clear_error();
    assert_null(gj_exp(NULL));
    assert_null(strstr(gj_last_error(), "before"));
    gj_scope_pop();
}

static void test_dtype_mismatch(void **s) {
    BEGIN();
    gj_tensor *f = z32(SHP(2, 3)), *d = z64(SHP(2, 3)), *d32 = z64(SHP(3, 2));
    EXPECT_NULL("add", gj_add(f, d));
    EXPECT_NULL("mul", gj_mul(d, f));
    EXPECT_NULL("matmul", gj_matmul(f, d32));
    EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){f, d}, 0));
    gj_tensor *logits = z32(SHP(3, 4));
    gj_tensor *flab = gj_zeros(GJ_F32, SHP(3));
    EXPECT_NULL("cross_entropy", gj_cross_entropy(logits, flab));
    gj_tensor *ilab = gjt_i64(SHP(3), (int64_t[]){0, 1, 2});
    gj_tensor *ilog = gjt_i64(SHP(3, 4), (int64_t[]){0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3});
    EXPECT_NULL("cross_entropy", gj_cross_entropy(ilog, ilab));  /* integer logits */
    EXPECT_NULL("exp", gj_exp(ilab));
    EXPECT_NULL("tanh", gj_tanh(ilab));
    EXPECT_NULL("softmax", gj_softmax(ilog, 1));
    EXPECT_NULL("embedding", gj_embedding(logits, flab));         /* float indices */
    gj_tensor *w4 = z64(SHP(4));
    EXPECT_NULL("layer_norm", gj_layer_norm(logits, w4, NULL, 1e-5));
    EXPECT_NULL("linear", gj_linear(logits, z64(SHP(2, 4)), NULL));
    gj_tensor *c = gj_ones(GJ_F32, SHP(2, 3));
    EXPECT_NULL("where", gj_where(c, f, d));
    EXPECT_NULL("cast", gj_cast(f, (gj_dtype)99));
    EXPECT_NULL("zeros", gj_zeros((gj_dtype)99, SHP(2)));
    EXPECT_NULL("from_data", gj_from_data((gj_dtype)-1, SHP(2), (double[]){1, 2}));
    END();
}

static void test_null_args(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3)), *w = z32(SHP(4, 3)), *b = z32(SHP(4));
    gj_tensor *lab = gjt_i64(SHP(2), (int64_t[]){0, 1});
    EXPECT_NULL("add", gj_add(NULL, a));
    EXPECT_NULL("add", gj_add(a, NULL));
    EXPECT_NULL("sub", gj_sub(NULL, NULL));
    EXPECT_NULL("mul", gj_mul(a, NULL));
    EXPECT_NULL("div", gj_div(NULL, a));
    EXPECT_NULL("neg", gj_neg(NULL));
    EXPECT_NULL("exp", gj_exp(NULL));
    EXPECT_NULL("log", gj_log(NULL));
    EXPECT_NULL("tanh", gj_tanh(NULL));
    EXPECT_NULL("sigmoid", gj_sigmoid(NULL));
    EXPECT_NULL("relu", gj_relu(NULL));
    EXPECT_NULL("gelu", gj_gelu(NULL));
    EXPECT_NULL("sqrt", gj_sqrt(NULL));
    EXPECT_NULL("pow_scalar", gj_pow_scalar(NULL, 2.0));
    EXPECT_NULL("add_scalar", gj_add_scalar(NULL, 2.0));
    EXPECT_NULL("mul_scalar", gj_mul_scalar(NULL, 2.0));
    EXPECT_NULL("sum", gj_sum(NULL, 0, NULL, false));
    EXPECT_NULL("mean", gj_mean(NULL, 0, NULL, false));
    EXPECT_NULL("max", gj_max(NULL, 0, false));
    EXPECT_NULL("matmul", gj_matmul(NULL, w));
    EXPECT_NULL("matmul", gj_matmul(a, NULL));
    EXPECT_NULL("linear", gj_linear(NULL, w, b));
    EXPECT_NULL("linear", gj_linear(a, NULL, b));
    EXPECT_NULL("transpose", gj_transpose(NULL, 0, 1));
    EXPECT_NULL("permute", gj_permute(NULL, (int[]){1, 0}));
    EXPECT_NULL("permute", gj_permute(a, NULL));
    EXPECT_NULL("reshape", gj_reshape(NULL, SHP(6)));
    EXPECT_NULL("reshape", gj_reshape(a, 2, NULL));
    EXPECT_NULL("view", gj_view(NULL, SHP(6)));
    EXPECT_NULL("expand", gj_expand(NULL, SHP(2, 3)));
    EXPECT_NULL("narrow", gj_narrow(NULL, 0, 0, 1));
    EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){a, NULL}, 0));
    EXPECT_NULL("cat", gj_cat(2, NULL, 0));
    EXPECT_NULL("contiguous", gj_contiguous(NULL));
    EXPECT_NULL("softmax", gj_softmax(NULL, 0));
    EXPECT_NULL("log_softmax", gj_log_softmax(NULL, 0));
    EXPECT_NULL("layer_norm", gj_layer_norm(NULL, NULL, NULL, 1e-5));
    EXPECT_NULL("cross_entropy", gj_cross_entropy(NULL, lab));
    EXPECT_NULL("cross_entropy", gj_cross_entropy(a, NULL));
    EXPECT_NULL("embedding", gj_embedding(NULL, lab));
    EXPECT_NULL("embedding", gj_embedding(w, NULL));
    EXPECT_NULL("dropout", gj_dropout(NULL, 0.5, true));
    EXPECT_NULL("where", gj_where(NULL, a, a));
    EXPECT_NULL("where", gj_where(a, NULL, a));
    EXPECT_NULL("where", gj_where(a, a, NULL));
    EXPECT_NULL("masked_fill", gj_masked_fill(NULL, a, 0));
    EXPECT_NULL("masked_fill", gj_masked_fill(a, NULL, 0));
    EXPECT_NULL("cast", gj_cast(NULL, GJ_F64));
    EXPECT_NULL("detach", gj_detach(NULL));
    EXPECT_NULL("from_data", gj_from_data(GJ_F32, SHP(2), NULL));
    EXPECT_NULL("from_data", gj_from_data(GJ_F32, 2, NULL, (float[]){1, 2}));
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, 2, NULL));
    EXPECT_FAIL("add_", gj_add_(NULL, a));
    EXPECT_FAIL("add_", gj_add_(a, NULL));
    EXPECT_FAIL("mul_", gj_mul_(NULL, a));
    EXPECT_FAIL("mul_scalar_", gj_mul_scalar_(NULL, 2.0));
    EXPECT_FAIL("zero_", gj_zero_(NULL));
    EXPECT_FAIL("copy_", gj_copy_(a, NULL));
    EXPECT_FAIL("backward", gj_backward(NULL, NULL));
    EXPECT_FAIL("backward", gj_backward_ex(NULL, NULL, true));
    EXPECT_FAIL("backward_multi", gj_backward_multi(1, (gj_tensor *[]){NULL}, NULL, false));
    EXPECT_FAIL("backward_multi", gj_backward_multi(0, &a, NULL, false));
    EXPECT_FAIL("backward_multi", gj_backward_multi(1, NULL, NULL, false));
    EXPECT_FAIL("requires_grad", gj_set_requires_grad(NULL, true));
    EXPECT_FAIL("set_grad", gj_tensor_set_grad(NULL, a));
    EXPECT_FAIL("to_f64", gj_tensor_to_f64(NULL, (double[6]){0}));
    EXPECT_FAIL("to_f64", gj_tensor_to_f64(a, NULL));
    EXPECT_FAIL("to_f32", gj_tensor_to_f32(NULL, (float[6]){0}));
    gj_tensor *g = NULL;
    EXPECT_FAIL("grad", gj_grad(1, (gj_tensor *[]){NULL}, NULL, 1, &a, &g, false, false));
    EXPECT_FAIL("grad", gj_grad(1, NULL, NULL, 1, &a, &g, false, false));
    assert_null(g);
    gj_clear_error();
    assert_null(gj_tensor_data(NULL));
    assert_true(gj_last_error()[0] != '\0');
    gj_clear_error();
    assert_true(isnan(gj_tensor_item(NULL)));
    assert_true(gj_last_error()[0] != '\0');
    /* NULL is ignored by release; a scope keep of NULL fails quietly */
    gj_release(NULL);
    assert_null(gj_scope_keep(NULL));
    /* optimizers and layers */
    EXPECT_NULL_OPTIM("sgd", gj_sgd_new(1, NULL, 0.1, 0, 0));
    EXPECT_NULL_OPTIM("sgd", gj_sgd_new(1, (gj_tensor *[]){NULL}, 0.1, 0, 0));
    EXPECT_NULL_OPTIM("adamw",
                      gj_adamw_new(1, (gj_tensor *[]){NULL}, 1e-3, 0.9, 0.999, 1e-8, 0.0));
    EXPECT_FAIL("optim", gj_optim_step(NULL));
    gj_optim_free(NULL);
    gj_optim_zero_grad(NULL);
    gj_linear_layer l;
    memset(&l, 0, sizeof l);
    EXPECT_FAIL("linear", gj_linear_init(NULL, 3, 4, true, GJ_F32));
    EXPECT_NULL("linear", gj_linear_forward(NULL, a));
    END();
}

static void test_bad_sizes(void **s) {
    BEGIN();
    float buf[8] = {0};
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, SHP(2, -3)));
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, SHP(INT64_MAX / 2, 4)));
    EXPECT_NULL("zeros", gj_zeros(GJ_F64, SHP(INT64_MAX / 4, 3)));
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, SHP(1LL << 32, 1LL << 32, 1LL << 32)));
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, SHP((1LL << 62) + 1)));
    EXPECT_NULL("ones", gj_ones(GJ_F32, SHP(INT64_MAX / 2, 4)));
    EXPECT_NULL("full", gj_full(GJ_F32, SHP(-1), 3.0));
    EXPECT_NULL("randn", gj_randn(GJ_F32, SHP(INT64_MAX, 2), 1.0));
    EXPECT_NULL("rand", gj_rand(GJ_F32, SHP(3, -1), 0, 1));
    /* random parameters that are not numbers, or out of range (torch.normal
     * refuses std < 0 and NaN) */
    EXPECT_NULL("std must be a finite number >= 0", gj_randn(GJ_F32, SHP(4), NAN));
    EXPECT_NULL("std must be a finite number >= 0", gj_randn(GJ_F32, SHP(4), -1.0));
    EXPECT_NULL("std must be a finite number >= 0", gj_randn(GJ_F64, SHP(4), INFINITY));
    EXPECT_NULL("finite bounds", gj_rand(GJ_F32, SHP(4), NAN, 1.0));
    EXPECT_NULL("finite bounds", gj_rand(GJ_F32, SHP(4), 0.0, INFINITY));
    EXPECT_NULL("finite bounds", gj_rand(GJ_F32, SHP(4), -INFINITY, 0.0));
    EXPECT_NULL("finite bounds", gj_rand(GJ_F32, SHP(4), 1.0, 0.0));
    EXPECT_NULL("p must be in [0, 1]", gj_dropout(z32(SHP(4)), NAN, true));
    {
        gj_tensor *r0 = gj_randn(GJ_F32, SHP(4), 0.0); /* std 0: zeros, as torch */
        assert_non_null(r0);
        for (int i = 0; i < 4; i++) assert_true(gj_tensor_item_at(r0, i) == 0.0);
        gj_release(r0);
    }
    EXPECT_NULL("from_data", gj_from_data(GJ_F32, SHP(2, -3), buf));
    EXPECT_NULL("from_data", gj_from_data(GJ_F32, SHP(INT64_MAX / 2, 4), buf));
    int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, 9, nine));
    EXPECT_NULL("from_data", gj_from_data(GJ_F32, 9, nine, buf));
    EXPECT_NULL("zeros", gj_zeros(GJ_F32, -1, nine));
    gj_tensor *a = z32(SHP(2, 3));
    EXPECT_NULL("reshape", gj_reshape(a, 9, nine));
    EXPECT_NULL("expand", gj_expand(a, 9, nine));
    EXPECT_NULL("expand", gj_expand(a, SHP(INT64_MAX, 2, 3)));
    EXPECT_NULL("view", gj_view(a, SHP(-6)));
    /* 8 dims is the maximum and works */
    int64_t eight[8] = {1, 2, 1, 1, 1, 1, 1, 3};
    gj_tensor *t8 = gj_zeros(GJ_F32, 8, eight);
    assert_non_null(t8);
    /* zero-size tensors are fine */
    gj_tensor *t0 = gj_zeros(GJ_F32, SHP(0, 3));
    assert_non_null(t0);
    assert_int_equal(gj_tensor_numel(t0), 0);
    /* element access out of range */
    gj_clear_error();
    assert_true(isnan(gj_tensor_item_at(a, 6)));
    GJT_ASSERT_ERROR("item");
    gj_clear_error();
    assert_true(isnan(gj_tensor_item_at(a, -1)));
    GJT_ASSERT_ERROR("item");
    gj_clear_error();
    assert_true(isnan(gj_tensor_item(a))); /* 6 elements */
    GJT_ASSERT_ERROR("item");
    /* dropout probability */
    EXPECT_NULL("dropout", gj_dropout(a, -0.1, true));
    EXPECT_NULL("dropout", gj_dropout(a, 1.5, true));
    EXPECT_NULL("dropout", gj_dropout(a, NAN, true));
    /* layers */
    gj_linear_layer l;
    EXPECT_FAIL("linear", gj_linear_init(&l, -1, 3, true, GJ_F32));
    EXPECT_FAIL("linear", gj_linear_init(&l, 3, INT64_MAX / 2, true, GJ_F32));
    gj_embedding_layer e;
    EXPECT_FAIL("embedding", gj_embedding_init(&e, -5, 3, GJ_F32));
    END();
}

static void test_label_and_index_range(void **s) {
    BEGIN();
    gj_tensor *logits = z32(SHP(3, 5));
    EXPECT_NULL("cross_entropy", gj_cross_entropy(logits, gjt_i64(SHP(3), (int64_t[]){0, 5, 1})));
    EXPECT_NULL("cross_entropy", gj_cross_entropy(logits, gjt_i64(SHP(3), (int64_t[]){-1, 0, 1})));
    EXPECT_NULL("cross_entropy",
                gj_cross_entropy(logits, gjt_i64(SHP(3), (int64_t[]){0, 1, INT64_MAX})));
    gj_tensor *table = z32(SHP(4, 2));
    EXPECT_NULL("embedding", gj_embedding(table, gjt_i64(SHP(2), (int64_t[]){0, 4})));
    EXPECT_NULL("embedding", gj_embedding(table, gjt_i64(SHP(2), (int64_t[]){-1, 0})));
    EXPECT_NULL("embedding", gj_embedding(table, gjt_i64(SHP(2, 1), (int64_t[]){1, INT64_MIN})));
    /* in range works, with and without grad */
    gj_tensor *ok = gj_cross_entropy(logits, gjt_i64(SHP(3), (int64_t[]){0, 4, 2}));
    assert_non_null(ok);
    assert_true(fabs(gj_tensor_item(ok) - log(5.0)) < 1e-6);
    END();
}

static void test_axis_range(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3));
    EXPECT_NULL("sum", gj_sum(a, 1, (int[]){2}, false));
    EXPECT_NULL("sum", gj_sum(a, 1, (int[]){-3}, false));
    EXPECT_NULL("sum", gj_sum(a, 2, (int[]){0, 0}, false));   /* repeated axis */
    EXPECT_NULL("sum", gj_sum(a, 3, (int[]){0, 1, 2}, false));
    EXPECT_NULL("sum", gj_sum(a, -1, (int[]){0}, false));
    EXPECT_NULL("mean", gj_mean(a, 1, (int[]){5}, true));
    EXPECT_NULL("max", gj_max(a, 2, false));
    EXPECT_NULL("max", gj_max(a, -3, false));
    EXPECT_NULL("softmax", gj_softmax(a, 2));
    EXPECT_NULL("softmax", gj_softmax(a, -3));
    EXPECT_NULL("log_softmax", gj_log_softmax(a, 7));
    EXPECT_NULL("transpose", gj_transpose(a, 0, 2));
    EXPECT_NULL("transpose", gj_transpose(a, -3, 0));
    EXPECT_NULL("permute", gj_permute(a, (int[]){0, 0}));
    EXPECT_NULL("permute", gj_permute(a, (int[]){0, 2}));
    EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){a, a}, 2));
    EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){a, a}, -3));
    EXPECT_NULL("narrow", gj_narrow(a, 2, 0, 1));
    gj_tensor *s0 = gj_scalar(GJ_F32, 1.0);
    EXPECT_NULL("softmax", gj_softmax(s0, 0));
    EXPECT_NULL("max", gj_max(s0, 0, false));
    EXPECT_NULL("transpose", gj_transpose(s0, 0, 0));
    END();
}

/* Headers the runtime must reject: not a tensor (magic 0) and a header
 * marked DEAD by release. Both live on the stack, so reading them is safe. */
static void test_dead_and_foreign_headers(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3));
    struct gj_tensor fake;
    memset(&fake, 0, sizeof fake);
    fake.ndim = 2;
    fake.shape[0] = 2;
    fake.shape[1] = 3;
    fake.numel = 6;
    for (int k = 0; k < 2; k++) {
        fake.magic = k == 0 ? 0u : GJ_RT_TENSOR_DEAD;
        EXPECT_NULL("add", gj_add(&fake, a));
        EXPECT_NULL("add", gj_add(a, &fake));
        EXPECT_NULL("exp", gj_exp(&fake));
        EXPECT_NULL("matmul", gj_matmul(a, &fake));
        EXPECT_NULL("sum", gj_sum(&fake, 0, NULL, false));
        EXPECT_NULL("reshape", gj_reshape(&fake, SHP(6)));
        EXPECT_NULL("cat", gj_cat(2, (gj_tensor *[]){a, &fake}, 0));
        EXPECT_FAIL("backward", gj_backward(&fake, NULL));
        EXPECT_FAIL("add_", gj_add_(a, &fake));
        gj_clear_error();
        assert_null(gj_tensor_data(&fake));
        assert_true(gj_last_error()[0] != '\0');
    }
    END();
}

/* Errors leave no state behind: after a failed call the next good call works
 * and gj_clear_error empties the message. */
static void test_error_state(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3)), *b = z32(SHP(4, 3));
    EXPECT_NULL("add", gj_add(a, b));
    /* the message names the shapes and the dtype */
    assert_true(gjt_error_has("[2, 3]") || gjt_error_has("[2,3]"));
    assert_true(gjt_error_has("[4, 3]") || gjt_error_has("[4,3]"));
    assert_true(gjt_error_has("f32") || gjt_error_has("float"));
    gj_tensor *c = gj_add(a, a);
    assert_non_null(c);
    gj_clear_error();
    assert_string_equal(gj_last_error(), "");
    END();
}

/* The cause a NULL argument cites comes only from the failure that made
 * that NULL (gradjit.h, "errors"): not from a failed call that returned a
 * status, not from a failure followed by calls that made tensors, not
 * after gj_clear_error; a chain keeps its innermost cause, also through
 * gj_retain(NULL), out[] of gj_grad and a second use of the same NULL. */
static bool has_cause(void) { return gjt_error_has("caused by"); }

static void test_error_cause(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3)), *b = z32(SHP(4, 5));
    /* the reported case: a status failure is no cause */
    gj_state_dict *sd = gj_state_dict_new();
    assert_non_null(sd);
    assert_int_not_equal(gj_state_dict_add(sd, NULL, a), 0);
    assert_true(isnan(gj_tensor_item(NULL)));
    assert_string_equal(gj_last_error(), "gj_tensor_item: t is NULL");
    /* a failure followed by a successful op is no cause either */
    assert_null(gj_matmul(a, b));
    assert_non_null(gj_add(a, a));
    assert_null(gj_exp(NULL));
    assert_string_equal(gj_last_error(), "gj_exp: x is NULL");
    /* nor after gj_clear_error */
    assert_null(gj_matmul(a, b));
    gj_clear_error();
    assert_null(gj_exp(NULL));
    assert_false(has_cause());
    /* a chain keeps the innermost cause, through gj_retain and keep */
    assert_null(gj_sum(gj_relu(gj_retain(gj_scope_keep(gj_gelu(gj_matmul(a, b))))), 0, NULL,
                       false));
    assert_true(gjt_error_has("gj_sum: x is NULL (caused by: gj_matmul: inner dimensions"));
    const char *c1 = strstr(gj_last_error(), "caused by");
    assert_null(strstr(c1 + 1, "caused by")); /* the innermost cause once, not nested */
    /* the same NULL used twice (a status failure that cites it, then
     * another use) cites it both times */
    gj_tensor *loss = gj_cross_entropy(a, b); /* labels of the wrong dtype */
    assert_null(loss);
    assert_int_not_equal(gj_backward(loss, NULL), 0);
    assert_true(gjt_error_has("gj_backward: root is NULL (caused by: gj_cross_entropy"));
    assert_true(isnan(gj_tensor_item(loss)));
    assert_true(gjt_error_has("gj_tensor_item: t is NULL (caused by: gj_cross_entropy"));
    /* out[] of a failed gj_grad is a NULL with a cause */
    gj_tensor *g = a;
    assert_int_not_equal(gj_grad(1, &a, NULL, 1, &a, &g, false, false), 0);
    assert_null(g);
    assert_null(gj_neg(g));
    assert_true(gjt_error_has("gj_neg: x is NULL (caused by: gj_grad"));
    /* a missing .grad or state dict entry is no failure: no stale cause */
    gj_tensor *w = z32(SHP(3));
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_null(gj_matmul(a, b));
    assert_null(gj_mul(gj_tensor_grad(w), w));
    assert_string_equal(gj_last_error(), "gj_mul: a is NULL");
    assert_null(gj_matmul(a, b));
    assert_null(gj_neg(gj_state_dict_get(sd, "absent")));
    assert_string_equal(gj_last_error(), "gj_neg: x is NULL");
    gj_state_dict_free(sd);
    END();
}

/* gj_last_error() follows errno's rule: a successful call neither sets nor
 * clears it (so a balanced push/pop leaves it as it was), except the
 * backward calls, which empty it when they succeed. */
static void test_error_after_success(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3));
    gj_clear_error();
    gj_scope_push();
    gj_tensor *c = gj_sum(gj_mul(gj_add(a, a), a), 0, NULL, false);
    assert_non_null(c);
    assert_true(gj_tensor_item(c) == 0.0);
    assert_int_equal(gj_tensor_ndim(c), 0);
    gj_scope_pop();
    assert_string_equal(gj_last_error(), ""); /* successes set nothing */
    gj_scope_pop(); /* closes BEGIN's scope */
    gj_scope_pop(); /* one too many: fails with a message */
    assert_true(gjt_error_has("gj_scope_pop: no scope is open"));
    gj_scope_push(); /* BEGIN's scope again */
    gj_scope_push();
    gj_scope_pop();
    assert_true(gjt_error_has("gj_scope_pop: no scope is open")); /* left as it was */
    gj_tensor *w = gj_ones(GJ_F32, SHP(3));
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_backward(gj_sum(gj_mul(w, w), 0, NULL, false), NULL), 0);
    assert_string_equal(gj_last_error(), ""); /* a backward that succeeds empties it */
    END();
}

/* Accessors on a NULL or released tensor set an error naming themselves
 * and return their sentinels (they used to return -1 or NULL silently). */
static void test_accessor_errors(void **s) {
    BEGIN();
    gj_tensor dead;
    memset(&dead, 0, sizeof dead);
    dead.magic = GJ_RT_TENSOR_DEAD;
    const gj_tensor *bad[2] = {NULL, &dead};
    for (int i = 0; i < 2; i++) {
        const gj_tensor *t = bad[i];
        gj_clear_error();
        assert_int_equal(gj_tensor_numel(t), -1);
        GJT_ASSERT_ERROR("gj_tensor_numel");
        gj_clear_error();
        assert_int_equal(gj_tensor_ndim(t), -1);
        GJT_ASSERT_ERROR("gj_tensor_ndim");
        gj_clear_error();
        assert_null(gj_tensor_shape(t));
        GJT_ASSERT_ERROR("gj_tensor_shape");
        gj_clear_error();
        assert_null(gj_tensor_strides(t));
        GJT_ASSERT_ERROR("gj_tensor_strides");
        gj_clear_error();
        assert_int_equal(gj_tensor_dtype(t), GJ_F32);
        GJT_ASSERT_ERROR("gj_tensor_dtype");
        gj_clear_error();
        assert_false(gj_tensor_is_contiguous(t));
        GJT_ASSERT_ERROR("gj_tensor_is_contiguous");
        gj_clear_error();
        assert_false(gj_requires_grad(t));
        GJT_ASSERT_ERROR("gj_requires_grad");
        gj_clear_error();
        assert_false(gj_is_leaf(t));
        GJT_ASSERT_ERROR("gj_is_leaf");
        gj_clear_error();
        assert_null(gj_tensor_grad(t));
        GJT_ASSERT_ERROR("gj_tensor_grad");
        gj_clear_error();
        assert_null(gj_tensor_name(t));
        GJT_ASSERT_ERROR("gj_tensor_name");
        gj_clear_error();
        assert_int_equal(gj_tensor_version(t), -1);
        GJT_ASSERT_ERROR("gj_tensor_version");
    }
    /* on a live tensor they succeed and set nothing */
    gj_tensor *a = z32(SHP(2, 3));
    gj_clear_error();
    assert_int_equal(gj_tensor_numel(a), 6);
    assert_int_equal(gj_tensor_ndim(a), 2);
    assert_int_equal(gj_tensor_shape(a)[1], 3);
    assert_int_equal(gj_tensor_strides(a)[0], 3);
    assert_int_equal(gj_tensor_dtype(a), GJ_F32);
    assert_true(gj_tensor_is_contiguous(a));
    assert_false(gj_requires_grad(a));
    assert_true(gj_is_leaf(a));
    assert_null(gj_tensor_grad(a));
    assert_string_equal(gj_last_error(), "");
    /* optimizers: a NULL params array is named as such */
    EXPECT_NULL_OPTIM("params is NULL",
                      gj_adamw_new(2, NULL, 1e-3, 0.9, 0.999, 1e-8, 0.0));
    assert_null(strstr(gj_last_error(), "non-empty"));
    EXPECT_NULL_OPTIM("params is NULL", gj_sgd_new(3, NULL, 0.1, 0, 0));
    EXPECT_NULL_OPTIM("non-empty parameter list (n_params = 0)",
                      gj_sgd_new(0, (gj_tensor *[]){a}, 0.1, 0, 0));
    END();
}

/* More: overflow in offsets, empty reductions, overlapping in-place writes,
 * .grad of the wrong shape, layers with mismatched inputs. */
static void test_misc(void **s) {
    BEGIN();
    gj_tensor *a = z32(SHP(2, 3));
    EXPECT_NULL("narrow", gj_narrow(a, 1, INT64_MAX, 2));      /* start + length overflows */
    EXPECT_NULL("narrow", gj_narrow(a, 1, 1, INT64_MAX));
    gj_tensor *e0 = z32(SHP(0, 3));
    EXPECT_NULL("max", gj_max(e0, 0, false));                  /* max over an empty axis */
    gj_tensor *se = gj_sum(e0, 1, (int[]){0}, false);          /* sum over it is zeros */
    assert_non_null(se);
    assert_true(gjt_shape_is(se, 1, (int64_t[]){3}));
    assert_true(gjt_tensor_close("sum over an empty axis", se, (double[]){0, 0, 0}, 0, 0));
    gj_tensor *ia = gjt_i64(SHP(2), (int64_t[]){1, 2});
    EXPECT_NULL("pow_scalar", gj_pow_scalar(ia, 2.0));
    EXPECT_NULL("dropout", gj_dropout(ia, 0.5, true));
    EXPECT_NULL("gelu", gj_gelu(ia));
    EXPECT_NULL("linear", gj_linear(a, z32(SHP(3)), NULL));     /* 1-D weight */
    EXPECT_NULL("linear", gj_linear(a, z32(SHP(4, 3)), z32(SHP(1, 4)))); /* 2-D bias */
    EXPECT_NULL("layer_norm", gj_layer_norm(gj_scalar(GJ_F32, 1.0), NULL, NULL, 1e-5));
    EXPECT_NULL("cat", gj_cat(-1, (gj_tensor *[]){a}, 0));
    /* in place into a view where several elements share memory */
    gj_tensor *row = z32(SHP(1, 3));
    gj_tensor *ex = gj_expand(row, SHP(2, 3));
    assert_non_null(ex);
    EXPECT_FAIL("add_", gj_add_(ex, gj_ones(GJ_F32, SHP(2, 3))));
    if (!gjt_tensor_close("expanded base unchanged", row, (double[]){0, 0, 0}, 0, 0))
        g_fail++;
    /* .grad of another shape */
    gj_tensor *x = gj_zeros(GJ_F32, SHP(3));
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    EXPECT_FAIL("grad", gj_tensor_set_grad(x, z32(SHP(4))));
    assert_null(gj_tensor_grad(x));
    /* gj_grad w.r.t. a tensor that does not require grad */
    gj_tensor *L = gj_sum(gj_mul(x, x), 0, NULL, false);
    gj_tensor *g = NULL;
    EXPECT_FAIL("grad", gj_grad(1, &L, NULL, 1, &a, &g, false, false));
    assert_null(g);
    /* layers */
    gj_linear_layer l;
    assert_int_equal(gj_linear_init(&l, 4, 2, true, GJ_F32), 0);
    EXPECT_NULL("linear", gj_linear_forward(&l, a));           /* in 3 vs 4 */
    gj_linear_free(&l);
    gj_embedding_layer em;
    assert_int_equal(gj_embedding_init(&em, 5, 2, GJ_F32), 0);
    EXPECT_NULL("embedding", gj_embedding_forward(&em, gjt_i64(SHP(1), (int64_t[]){5})));
    gj_embedding_free(&em);
    gj_layer_norm_layer ln;
    assert_int_equal(gj_layer_norm_init(&ln, 4, 1e-5, GJ_F32), 0);
    EXPECT_NULL("layer_norm", gj_layer_norm_forward(&ln, a));  /* C 3 vs 4 */
    gj_layer_norm_free(&ln);
    END();
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape_mismatch),
        cmocka_unit_test(test_error_chain),
        cmocka_unit_test(test_dtype_mismatch),
        cmocka_unit_test(test_null_args),
        cmocka_unit_test(test_bad_sizes),
        cmocka_unit_test(test_label_and_index_range),
        cmocka_unit_test(test_axis_range),
        cmocka_unit_test(test_dead_and_foreign_headers),
        cmocka_unit_test(test_error_state),
        cmocka_unit_test(test_error_cause),
        cmocka_unit_test(test_error_after_success),
        cmocka_unit_test(test_accessor_errors),
        cmocka_unit_test(test_misc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
