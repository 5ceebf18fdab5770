// SPDX-License-Identifier: MIT
/*
 * test_conv.c - gj_conv2d, gj_max_pool2d, gj_avg_pool2d.
 *
 *   - forwards against direct loops written here (the definition: a sum
 *     over the window, PyTorch's padding, dilation and groups), f64 to
 *     1e-12 and f32 to 1e-5, over stride > 1, padding, dilation, groups,
 *     1x1 kernels, a kernel as large as the input and non-square kernels;
 *   - every gradient by central finite differences in f64 (gjt_gradcheck),
 *     on the same cases, with contiguous and transposed inputs;
 *   - max-pool ties: the gradient goes to the first maximum of each window
 *     (row-major), as PyTorch; avg-pool divides by kernel*kernel including
 *     padding (count_include_pad=True);
 *   - bad input: NULL and an error naming the op, the shapes, the dtypes;
 *   - compiled mode: a small CNN's backward runs compiled with GEMM and fold
 *     (im2col/col2im) steps, no fallback, and gives exactly (bit for bit)
 *     the eager gradients in f32 and f64.
 *
 * Under GJT_COMPILED=1 (ctest test_conv_compiled) every gradcheck also
 * runs its backward compiled and requires it to match eager (gjtest.h).
 */
#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SH(...)                                                                    \
    .ndim = (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),             \
    .shape = {__VA_ARGS__}
#define CHECK(...)                                                                 \
    do {                                                                           \
        gjt_check c_ = __VA_ARGS__;                                                \
        if (gjt_gradcheck(&c_) != 0)                                               \
            nfail++;                                                               \
    } while (0)

/* ------------------------------------------------------------ references */

typedef struct conv_cfg {
    int64_t N, C, H, W, OC, kh, kw, stride, pad, dil, groups;
    bool bias;
} conv_cfg;

static int64_t out_size(int64_t n, int64_t k, int64_t s, int64_t p, int64_t d) {
    return (n + 2 * p - d * (k - 1) - 1) / s + 1;
}

/* Direct convolution: y[n, oc, oh, ow] = b[oc] + sum over c, i, j. */
static double *ref_conv(const conv_cfg *c, const double *x, const double *w, const double *b) {
    int64_t OH = out_size(c->H, c->kh, c->stride, c->pad, c->dil);
    int64_t OW = out_size(c->W, c->kw, c->stride, c->pad, c->dil);
    int64_t Cg = c->C / c->groups, OCg = c->OC / c->groups;
    double *y = calloc((size_t)(c->N * c->OC * OH * OW), sizeof *y);
    for (int64_t n = 0; n < c->N; n++)
        for (int64_t oc = 0; oc < c->OC; oc++)
            for (int64_t oh = 0; oh < OH; oh++)
                for (int64_t ow = 0; ow < OW; ow++) {
                    double s = b ? b[oc] : 0.0;
                    int64_t g = oc / OCg;
                    for (int64_t ci = 0; ci < Cg; ci++)
                        for (int64_t i = 0; i < c->kh; i++)
                            for (int64_t j = 0; j < c->kw; j++) {
                                int64_t h = oh * c->stride - c->pad + i * c->dil;
                                int64_t v = ow * c->stride - c->pad + j * c->dil;
                                if (h < 0 || h >= c->H || v < 0 || v >= c->W) continue;
                                s += x[((n * c->C + g * Cg + ci) * c->H + h) * c->W + v] *
                                     w[((oc * Cg + ci) * c->kh + i) * c->kw + j];
                            }
                    y[((n * c->OC + oc) * OH + oh) * OW + ow] = s;
                }
    return y;
}

/* Direct pools: max over the window (padding never wins), or the window's
 * sum (padding as zeros) divided by k*k. */
static double *ref_pool(bool max, int64_t N, int64_t C, int64_t H, int64_t W, int64_t k,
                        int64_t s, int64_t p, const double *x) {
    int64_t OH = out_size(H, k, s, p, 1), OW = out_size(W, k, s, p, 1);
    double *y = calloc((size_t)(N * C * OH * OW), sizeof *y);
    for (int64_t nc = 0; nc < N * C; nc++)
        for (int64_t oh = 0; oh < OH; oh++)
            for (int64_t ow = 0; ow < OW; ow++) {
                double acc = max ? -INFINITY : 0.0;
                for (int64_t i = 0; i < k; i++)
                    for (int64_t j = 0; j < k; j++) {
                        int64_t h = oh * s - p + i, v = ow * s - p + j;
                        if (h < 0 || h >= H || v < 0 || v >= W) continue;
                        double e = x[(nc * H + h) * W + v];
                        acc = max ? (e > acc ? e : acc) : acc + e;
                    }
                y[(nc * OH + oh) * OW + ow] = max ? acc : acc / (double)(k * k);
            }
    return y;
}

static const conv_cfg g_cases[] = {
    /* N, C, H, W, OC, kh, kw, stride, pad, dil, groups, bias */
    {2, 3, 6, 5, 4, 3, 3, 1, 0, 1, 1, true},   /* plain 3x3 */
    {1, 2, 7, 7, 3, 3, 3, 2, 1, 1, 1, true},   /* stride 2, padding 1 */
    {2, 2, 7, 6, 2, 3, 2, 1, 2, 2, 1, false},  /* dilation 2, padding 2, 3x2 kernel */
    {1, 4, 5, 5, 6, 3, 3, 1, 1, 1, 2, true},   /* groups 2 */
    {2, 4, 4, 4, 4, 2, 2, 2, 0, 1, 4, true},   /* depthwise (groups = C), stride 2 */
    {2, 3, 4, 5, 2, 1, 1, 1, 0, 1, 1, true},   /* 1x1 */
    {2, 2, 4, 3, 3, 4, 3, 1, 0, 1, 1, true},   /* kernel = input size */
    {1, 1, 9, 8, 2, 5, 5, 3, 2, 1, 1, false},  /* 5x5, stride 3, padding 2 */
};
#define N_CASES (int)(sizeof g_cases / sizeof g_cases[0])

static const char *case_name(char *buf, size_t cap, const char *what, const conv_cfg *c) {
    snprintf(buf, cap,
             "%s x[%lld,%lld,%lld,%lld] w[%lld,%lld,%lld,%lld] s%lld p%lld d%lld g%lld%s", what,
             (long long)c->N, (long long)c->C, (long long)c->H, (long long)c->W,
             (long long)c->OC, (long long)(c->C / c->groups), (long long)c->kh,
             (long long)c->kw, (long long)c->stride, (long long)c->pad, (long long)c->dil,
             (long long)c->groups, c->bias ? " bias" : "");
    return buf;
}

/* ---------------------------------------------------------------- forward */

static void test_conv_forward_reference(void **s) {
    int nfail = 0;
    gjt_rng r;
    gjt_rng_seed(&r, 11);
    for (int t = 0; t < N_CASES; t++) {
        const conv_cfg *c = &g_cases[t];
        int64_t xs[4] = {c->N, c->C, c->H, c->W};
        int64_t ws[4] = {c->OC, c->C / c->groups, c->kh, c->kw};
        int64_t OH = out_size(c->H, c->kh, c->stride, c->pad, c->dil);
        int64_t OW = out_size(c->W, c->kw, c->stride, c->pad, c->dil);
        int64_t ys[4] = {c->N, c->OC, OH, OW};
        for (int d = 0; d < 2; d++) {
            gj_dtype dt = d ? GJ_F32 : GJ_F64;
            gj_scope_push();
            gj_tensor *x = gjt_uniform(&r, dt, 4, xs, -1, 1);
            gj_tensor *w = gjt_uniform(&r, dt, 4, ws, -1, 1);
            gj_tensor *b = gjt_uniform(&r, dt, 1, &c->OC, -1, 1);
            double *xv = gjt_values(x), *wv = gjt_values(w), *bv = gjt_values(b);
            double *want = ref_conv(c, xv, wv, c->bias ? bv : NULL);
            gj_tensor *y = gj_conv2d(x, w, c->bias ? b : NULL, c->stride, c->pad, c->dil,
                                     c->groups);
            char nm[200];
            case_name(nm, sizeof nm, d ? "conv2d f32" : "conv2d f64", c);
            if (!y) {
                fprintf(stderr, "  %s: NULL: %s\n", nm, gj_last_error());
                nfail++;
            } else if (!gjt_shape_is(y, 4, ys)) {
                fprintf(stderr, "  %s: wrong output shape\n", nm);
                nfail++;
            } else if (gj_tensor_dtype(y) != dt ||
                       !gjt_tensor_close(nm, y, want, d ? 1e-5 : 1e-12, d ? 1e-5 : 1e-12)) {
                nfail++;
            }
            free(xv), free(wv), free(bv), free(want);
            gj_scope_pop();
        }
    }
    assert_int_equal(nfail, 0);
}

static void test_pool_forward_reference(void **s) {
    int nfail = 0;
    gjt_rng r;
    gjt_rng_seed(&r, 12);
    /* N, C, H, W, kernel, stride, padding */
    const int64_t cases[][7] = {{2, 3, 6, 6, 2, 2, 0}, {1, 2, 7, 5, 3, 2, 1}, {2, 1, 5, 5, 3, 1, 1},
                                {1, 2, 4, 4, 4, 1, 0}, {1, 1, 9, 7, 5, 3, 2}, {2, 2, 3, 3, 1, 1, 0}};
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        const int64_t *c = cases[t];
        int64_t xs[4] = {c[0], c[1], c[2], c[3]};
        int64_t ys[4] = {c[0], c[1], out_size(c[2], c[4], c[5], c[6], 1),
                         out_size(c[3], c[4], c[5], c[6], 1)};
        for (int d = 0; d < 2; d++) {
            gj_dtype dt = d ? GJ_F32 : GJ_F64;
            gj_scope_push();
            /* negative values: a max taken with zero padding would be wrong */
            gj_tensor *x = gjt_uniform(&r, dt, 4, xs, -2, -0.5);
            double *xv = gjt_values(x);
            for (int m = 0; m < 2; m++) {
                double *want = ref_pool(m == 0, c[0], c[1], c[2], c[3], c[4], c[5], c[6], xv);
                gj_tensor *y = m == 0 ? gj_max_pool2d(x, c[4], c[5], c[6])
                                      : gj_avg_pool2d(x, c[4], c[5], c[6]);
                char nm[160];
                snprintf(nm, sizeof nm, "%s %s x[%lld,%lld,%lld,%lld] k%lld s%lld p%lld",
                         m == 0 ? "max_pool2d" : "avg_pool2d", d ? "f32" : "f64",
                         (long long)c[0], (long long)c[1], (long long)c[2], (long long)c[3],
                         (long long)c[4], (long long)c[5], (long long)c[6]);
                if (!y || !gjt_shape_is(y, 4, ys)) {
                    fprintf(stderr, "  %s: %s\n", nm, y ? "wrong shape" : gj_last_error());
                    nfail++;
                } else if (!gjt_tensor_close(nm, y, want, d ? 1e-6 : 1e-12, d ? 1e-6 : 1e-12)) {
                    nfail++;
                }
                free(want);
            }
            free(xv);
            gj_scope_pop();
        }
    }
    /* stride 0 means stride = kernel (PyTorch's default) */
    gj_scope_push();
    int64_t xs[4] = {1, 1, 4, 4};
    gj_tensor *x = gjt_uniform(&r, GJ_F64, 4, xs, -1, 1);
    gj_tensor *a = gj_max_pool2d(x, 2, 0, 0), *b = gj_max_pool2d(x, 2, 2, 0);
    assert_non_null(a);
    assert_non_null(b);
    double *av = gjt_values(a), *bv = gjt_values(b);
    assert_true(gjt_shape_is(a, 4, (int64_t[]){1, 1, 2, 2}));
    assert_memory_equal(av, bv, 4 * sizeof(double));
    free(av), free(bv);
    gj_scope_pop();
    assert_int_equal(nfail, 0);
}

/* ------------------------------------------------------------- gradients */

static gj_tensor *f_conv(gj_tensor **in, void *ctx) {
    const conv_cfg *c = ctx;
    return gj_conv2d(in[0], in[1], c->bias ? in[2] : NULL, c->stride, c->pad, c->dil,
                     c->groups);
}

static void test_conv_grad(void **s) {
    int nfail = 0;
    char nm[200];
    for (int t = 0; t < N_CASES; t++) {
        const conv_cfg *c = &g_cases[t];
        for (int v = 0; v < 2; v++) {
            /* v = 1: x and w as transposed views (non-contiguous) */
            gjt_view view = v ? GJT_TRANSPOSED : GJT_PLAIN;
            case_name(nm, sizeof nm, v ? "conv2d grad (transposed x, w)" : "conv2d grad", c);
            CHECK({.name = nm, .fn = f_conv, .ctx = (void *)c, .n_in = c->bias ? 3 : 2,
                   .in = {{SH(c->N, c->C, c->H, c->W), .view = view},
                          {SH(c->OC, c->C / c->groups, c->kh, c->kw), .view = view},
                          {SH(c->OC)}},
                   .data_seed = (uint64_t)(100 + t)});
        }
    }
    /* only some inputs need a gradient: x constant, then w and b constant */
    const conv_cfg *c = &g_cases[1];
    CHECK({.name = "conv2d grad, x constant", .fn = f_conv, .ctx = (void *)c, .n_in = 3,
           .in = {{SH(1, 2, 7, 7), .constant = true}, {SH(3, 2, 3, 3)}, {SH(3)}},
           .data_seed = 7});
    CHECK({.name = "conv2d grad, w b constant", .fn = f_conv, .ctx = (void *)c, .n_in = 3,
           .in = {{SH(1, 2, 7, 7)}, {SH(3, 2, 3, 3), .constant = true},
                  {SH(3), .constant = true}},
           .data_seed = 8});
    assert_int_equal(nfail, 0);
}

typedef struct pool_ctx {
    bool max;
    int64_t k, s, p;
} pool_ctx;

static gj_tensor *f_pool(gj_tensor **in, void *ctx) {
    const pool_ctx *c = ctx;
    return c->max ? gj_max_pool2d(in[0], c->k, c->s, c->p) : gj_avg_pool2d(in[0], c->k, c->s, c->p);
}

static void test_pool_grad(void **s) {
    int nfail = 0;
    char nm[160];
    /* kernel, stride, padding; x shape */
    const int64_t cases[][7] = {{2, 2, 0, 2, 3, 4, 4}, {3, 2, 1, 1, 2, 7, 5}, {3, 1, 1, 2, 1, 5, 5},
                                {4, 1, 0, 1, 2, 4, 4}, {5, 3, 2, 1, 1, 9, 7}, {1, 1, 0, 2, 2, 3, 3},
                                {2, 1, 0, 1, 2, 4, 5}};
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        const int64_t *c = cases[t];
        for (int m = 0; m < 2; m++) {
            pool_ctx pc = {m == 0, c[0], c[1], c[2]};
            for (int v = 0; v < 2; v++) {
                snprintf(nm, sizeof nm, "%s grad x[%lld,%lld,%lld,%lld] k%lld s%lld p%lld%s",
                         m == 0 ? "max_pool2d" : "avg_pool2d", (long long)c[3], (long long)c[4],
                         (long long)c[5], (long long)c[6], (long long)c[0], (long long)c[1],
                         (long long)c[2], v ? " transposed" : "");
                CHECK({.name = nm, .fn = f_pool, .ctx = &pc, .n_in = 1,
                       .in = {{SH(c[3], c[4], c[5], c[6]), .distinct = true,
                               .view = v ? GJT_TRANSPOSED : GJT_PLAIN}},
                       .data_seed = (uint64_t)(200 + t)});
            }
        }
    }
    assert_int_equal(nfail, 0);
}

/* A small CNN: conv, relu, max-pool, conv, gelu, avg-pool, flatten, linear. */
static gj_tensor *f_cnn(gj_tensor **in, void *ctx) {
    gj_tensor *h = gj_conv2d(in[0], in[1], in[2], 1, 1, 1, 1);
    h = h ? gj_relu(h) : NULL;
    h = h ? gj_max_pool2d(h, 2, 2, 0) : NULL;
    h = h ? gj_conv2d(h, in[3], NULL, 1, 1, 1, 2) : NULL;
    h = h ? gj_gelu(h) : NULL;
    h = h ? gj_avg_pool2d(h, 2, 1, 1) : NULL;
    int64_t n = h ? gj_tensor_shape(h)[0] : 0;
    h = h ? gj_reshape(h, 2, (int64_t[]){n, -1}) : NULL;
    return h ? gj_linear(h, in[4], NULL) : NULL;
}

static void test_cnn_grad(void **s) {
    int nfail = 0;
    /* x [2,2,6,6] -> conv 2->4 (3x3 pad 1) -> pool 2 -> [2,4,3,3] -> conv 4->4 g2
     * -> [2,4,3,3] -> avg k2 s1 p1 -> [2,4,4,4] -> linear 64 -> 3 */
    CHECK({.name = "cnn", .fn = f_cnn, .n_in = 5,
           .in = {{SH(2, 2, 6, 6), .distinct = true}, {SH(4, 2, 3, 3)}, {SH(4)},
                  {SH(4, 2, 3, 3)}, {SH(3, 64)}},
           .data_seed = 31});
    assert_int_equal(nfail, 0);
}

/* conv, relu, max-pool inside a checkpoint region (recomputed in backward;
 * compiled: the recomputation's im2col becomes a fold step). */
static int ckpt_body(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    gj_tensor *h = gj_conv2d(in[0], in[1], in[2], 1, 1, 1, 1);
    h = h ? gj_relu(h) : NULL;
    out[0] = h ? gj_max_pool2d(h, 2, 2, 0) : NULL;
    return out[0] ? 0 : -1;
}

static gj_tensor *f_ckpt(gj_tensor **in, void *ctx) {
    gj_tensor *y = NULL;
    if (gj_checkpoint(ckpt_body, NULL, 3, in, 1, &y, NULL, NULL) != 0)
        return NULL;
    return y;
}

static void test_checkpointed_grad(void **s) {
    int nfail = 0;
    CHECK({.name = "conv relu max-pool in a checkpoint", .fn = f_ckpt, .n_in = 3,
           .in = {{SH(2, 2, 4, 4), .distinct = true}, {SH(3, 2, 3, 3)}, {SH(3)}},
           .data_seed = 41});
    assert_int_equal(nfail, 0);
}

/* f32 and bf16 forwards and gradients against f64 on the same values. */
static void test_low_precision(void **s) {
    int nfail = 0;
    const conv_cfg *c = &g_cases[3]; /* groups 2, padding 1, bias */
    pool_ctx mp = {true, 3, 2, 1}, ap = {false, 3, 2, 1};
    for (int d = 0; d < 2; d++) {
        gj_dtype dt = d ? GJ_BF16 : GJ_F32;
        double tol = d ? 5e-2 : 1e-5;
        gjt_check cc = {.name = d ? "conv2d bf16" : "conv2d f32", .fn = f_conv, .ctx = (void *)c,
                        .n_in = 3,
                        .in = {{SH(1, 4, 5, 5)}, {SH(6, 2, 3, 3)}, {SH(6)}},
                        .data_seed = 51};
        nfail += gjt_gradcompare(&cc, dt, tol, tol) != 0;
        gjt_check cm = {.name = d ? "max_pool2d bf16" : "max_pool2d f32", .fn = f_pool,
                        .ctx = &mp, .n_in = 1, .in = {{SH(2, 2, 7, 6), .distinct = true}},
                        .data_seed = 52};
        nfail += gjt_gradcompare(&cm, dt, tol, tol) != 0;
        gjt_check ca = {.name = d ? "avg_pool2d bf16" : "avg_pool2d f32", .fn = f_pool,
                        .ctx = &ap, .n_in = 1, .in = {{SH(2, 2, 7, 6)}}, .data_seed = 53};
        nfail += gjt_gradcompare(&ca, dt, tol, tol) != 0;
    }
    assert_int_equal(nfail, 0);
}

/* ---------------------------------------------------- exact semantics */

/* Max-pool on a constant image: every window ties, so the gradient goes to
 * the first element of each window (row-major), as in PyTorch. */
static void test_max_pool_ties(void **s) {
    gj_scope_push();
    int64_t xs[4] = {1, 1, 4, 4};
    gj_tensor *x = gj_full(GJ_F64, 4, xs, 0.5);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    /* windows 3x3, stride 1, padding 1: window (oh, ow) starts at (oh-1, ow-1);
     * its first in-image element is (max(oh-1,0), max(ow-1,0)) */
    gj_tensor *y = gj_max_pool2d(x, 3, 1, 1);
    assert_non_null(y);
    gj_tensor *l = gj_sum(y, 0, NULL, false);
    assert_int_equal(gjt_backward(l, NULL, false), 0);
    double want[16] = {0};
    for (int oh = 0; oh < 4; oh++)
        for (int ow = 0; ow < 4; ow++)
            want[(oh > 0 ? oh - 1 : 0) * 4 + (ow > 0 ? ow - 1 : 0)] += 1.0;
    assert_true(gjt_tensor_close("max_pool2d ties", gj_tensor_grad(x), want, 0, 0));
    /* a NaN in a window is its maximum and receives the gradient */
    double xv[4] = {1.0, NAN, 2.0, 3.0};
    gj_tensor *xn = gj_from_data(GJ_F64, 4, (int64_t[]){1, 1, 2, 2}, xv);
    assert_int_equal(gj_set_requires_grad(xn, true), 0);
    gj_tensor *yn = gj_max_pool2d(xn, 2, 2, 0);
    assert_true(isnan(gj_tensor_item(yn)));
    assert_int_equal(gjt_backward(gj_sum(yn, 0, NULL, false), NULL, false), 0);
    double wn[4] = {0, 1, 0, 0};
    assert_true(gjt_tensor_close("max_pool2d NaN", gj_tensor_grad(xn), wn, 0, 0));
    gj_scope_pop();
}

/* Avg-pool counts padding in the divisor (count_include_pad=True). */
static void test_avg_pool_include_pad(void **s) {
    gj_scope_push();
    gj_tensor *x = gj_ones(GJ_F64, 4, (int64_t[]){1, 1, 2, 2});
    gj_tensor *y = gj_avg_pool2d(x, 3, 1, 1); /* each 3x3 window holds the 4 ones */
    assert_non_null(y);
    double want[4] = {4.0 / 9, 4.0 / 9, 4.0 / 9, 4.0 / 9};
    assert_true(gjt_tensor_close("avg_pool2d padding", y, want, 1e-15, 0));
    gj_scope_pop();
}

/* ---------------------------------------------------------------- errors */

static void test_bad_input(void **s) {
    gj_scope_push();
    gj_tensor *x = gj_zeros(GJ_F32, 4, (int64_t[]){2, 4, 5, 5});
    gj_tensor *x3 = gj_zeros(GJ_F32, 3, (int64_t[]){4, 5, 5});
    gj_tensor *xd = gj_zeros(GJ_F64, 4, (int64_t[]){2, 4, 5, 5});
    gj_tensor *w = gj_zeros(GJ_F32, 4, (int64_t[]){6, 4, 3, 3});
    gj_tensor *wg = gj_zeros(GJ_F32, 4, (int64_t[]){6, 2, 3, 3});
    gj_tensor *wbig = gj_zeros(GJ_F32, 4, (int64_t[]){6, 4, 6, 6});
    gj_tensor *b = gj_zeros(GJ_F32, 1, (int64_t[]){6});
    gj_tensor *b5 = gj_zeros(GJ_F32, 1, (int64_t[]){5});
    gj_tensor *xi = gj_zeros(GJ_I64, 4, (int64_t[]){2, 4, 5, 5});

    gj_clear_error();
    assert_null(gj_conv2d(x3, w, NULL, 1, 0, 1, 1)); /* rank */
    GJT_ASSERT_ERROR("gj_conv2d");
    assert_true(gjt_error_has("[4, 5, 5]"));
    assert_null(gj_conv2d(xd, w, NULL, 1, 0, 1, 1)); /* dtype mismatch */
    GJT_ASSERT_ERROR("gj_conv2d");
    assert_true(gjt_error_has("f64") && gjt_error_has("f32"));
    assert_null(gj_conv2d(x, wg, NULL, 1, 0, 1, 3)); /* 4 channels, 3 groups */
    GJT_ASSERT_ERROR("gj_conv2d");
    assert_true(gjt_error_has("groups 3") && gjt_error_has("[2, 4, 5, 5]"));
    assert_null(gj_conv2d(x, w, NULL, 1, 0, 1, 2)); /* w.shape[1] != C / groups */
    assert_true(gjt_error_has("C / groups"));
    assert_null(gj_conv2d(x, wbig, NULL, 1, 0, 1, 1)); /* output size <= 0 */
    GJT_ASSERT_ERROR("gj_conv2d");
    assert_true(gjt_error_has("output size") && gjt_error_has("[6, 4, 6, 6]"));
    assert_null(gj_conv2d(x, w, NULL, 1, 0, 3, 1)); /* dilation: span 7 > 5 */
    assert_true(gjt_error_has("output size"));
    assert_null(gj_conv2d(x, w, NULL, 0, 0, 1, 1)); /* stride 0 */
    assert_true(gjt_error_has("stride >= 1"));
    assert_null(gj_conv2d(x, w, NULL, 1, -1, 1, 1));
    assert_true(gjt_error_has("padding >= 0"));
    assert_null(gj_conv2d(x, w, b5, 1, 0, 1, 1)); /* bias shape */
    assert_true(gjt_error_has("[5]") && gjt_error_has("[6]"));
    assert_null(gj_conv2d(xi, w, NULL, 1, 0, 1, 1)); /* i64 */
    GJT_ASSERT_ERROR("gj_conv2d");
    assert_null(gj_conv2d(NULL, w, b, 1, 0, 1, 1));
    GJT_ASSERT_ERROR("gj_conv2d");

    assert_null(gj_max_pool2d(x3, 2, 2, 0));
    GJT_ASSERT_ERROR("gj_max_pool2d");
    assert_null(gj_max_pool2d(x, 6, 1, 0)); /* larger than the image */
    assert_true(gjt_error_has("output size"));
    assert_null(gj_avg_pool2d(x, 2, 1, 2)); /* padding > kernel / 2 */
    GJT_ASSERT_ERROR("gj_avg_pool2d");
    assert_true(gjt_error_has("half the kernel"));
    assert_null(gj_avg_pool2d(x, 0, 1, 0));
    assert_true(gjt_error_has("kernel >= 1"));
    assert_null(gj_max_pool2d(xi, 2, 2, 0));
    GJT_ASSERT_ERROR("gj_max_pool2d");
    /* a good call after all that still works */
    assert_non_null(gj_conv2d(x, w, b, 1, 1, 1, 1));
    gj_scope_pop();
}

/* ------------------------------------------------------------ compiled */

/* The CNN's gradients in dtype dt, compiled (on) or eager: .grad of every
 * leaf, concatenated as raw bytes into out (malloc'd, *n bytes). */
static unsigned char *cnn_grads(gj_dtype dt, bool compiled, size_t *n, gj_ca_program_info *info) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    const int64_t shapes[5][4] = {{4, 2, 8, 8}, {6, 2, 3, 3}, {6}, {4, 3, 3, 3}, {3, 64}};
    const int nd[5] = {4, 4, 1, 4, 2};
    gj_tensor *in[5];
    for (int k = 0; k < 5; k++) {
        in[k] = gjt_uniform(&r, dt, nd[k], shapes[k], -1, 1);
        if (k > 0) gj_set_requires_grad(in[k], true);
    }
    /* x [4,2,8,8] -> conv 2->6 pad 1, relu, max-pool 2 -> [4,6,4,4] -> conv
     * 6->4 groups 2 pad 1, gelu, avg-pool 2 -> [4,4,2,2] -> linear 16 -> 3
     * (its weight a narrowed view of a [3, 64] leaf) */
    gj_tensor *h = gj_conv2d(in[0], in[1], in[2], 1, 1, 1, 1);
    h = gj_max_pool2d(gj_relu(h), 2, 2, 0);
    h = gj_conv2d(h, in[3], NULL, 1, 1, 1, 2);
    h = gj_avg_pool2d(gj_gelu(h), 2, 2, 0); /* [4, 4, 2, 2] */
    h = gj_reshape(h, 2, (int64_t[]){4, 16});
    gj_tensor *w2 = gj_narrow(in[4], 1, 0, 16);
    gj_tensor *loss = gj_sum(gj_linear(h, w2, NULL), 0, NULL, false);
    assert_non_null(loss);
    gj_ca_stats before = gjt_ca_now();
    assert_int_equal(gj_backward(loss, NULL), 0);
    gj_ca_stats after = gjt_ca_now();
    if (compiled) {
        assert_true(gjt_ran_compiled("cnn backward", &before, &after, 1));
        assert_int_equal(gj_compiled_autograd_last_program(info), 0);
    }
    *n = 0;
    for (int k = 1; k < 5; k++) *n += (size_t)gj_tensor_numel(in[k]) * (dt == GJ_F64 ? 8 : 4);
    unsigned char *out = malloc(*n), *p = out;
    for (int k = 1; k < 5; k++) {
        gj_tensor *g = gj_tensor_grad(in[k]);
        assert_non_null(g);
        size_t nb = (size_t)gj_tensor_numel(g) * (dt == GJ_F64 ? 8 : 4);
        memcpy(p, gj_tensor_data(g), nb);
        p += nb;
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    return out;
}

static void test_compiled_bitwise(void **s) {
    bool was = gj_compiled_autograd_enabled();
    for (int d = 0; d < 2; d++) {
        gj_dtype dt = d ? GJ_F64 : GJ_F32;
        size_t ne, nc;
        gj_ca_program_info info;
        unsigned char *e = cnn_grads(dt, false, &ne, NULL);
        unsigned char *c = cnn_grads(dt, true, &nc, &info);
        assert_int_equal(ne, nc);
        if (memcmp(e, c, ne) != 0) {
            fprintf(stderr, "  compiled CNN gradients (%s) differ from eager\n",
                    dt == GJ_F64 ? "f64" : "f32");
            fail();
        }
        /* GEMMs for both convs and the linear; fold steps (im2col for the
         * conv weights, col2im for the inputs' gradients and the pools) */
        assert_true(info.gemm_instrs >= 4);
        assert_true(info.kernel_instrs >= 1);
        assert_true(info.other_instrs >= 4);
        free(e);
        free(c);
    }
    gj_set_compiled_autograd(was);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv_forward_reference),
        cmocka_unit_test(test_pool_forward_reference),
        cmocka_unit_test(test_conv_grad),
        cmocka_unit_test(test_pool_grad),
        cmocka_unit_test(test_cnn_grad),
        cmocka_unit_test(test_checkpointed_grad),
        cmocka_unit_test(test_low_precision),
        cmocka_unit_test(test_max_pool_ties),
        cmocka_unit_test(test_avg_pool_include_pad),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_compiled_bitwise),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
