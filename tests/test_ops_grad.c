/* SPDX-License-Identifier: MIT */
/*
 * test_ops_grad.c - every op of gradjit.h: gradients checked by central
 * finite differences in f64 (gjt_gradcheck) on several shapes each,
 * including size-1 and broadcast dims, 0-d tensors and non-contiguous inputs
 * (transposed, narrowed and expanded views of bigger leaves: the gradient
 * must land in the leaf's .grad); forward values checked against host
 * reference implementations; f32 and bf16 forwards checked against f64.
 *
 * Every test runs all its checks and fails at the end if any failed, so one
 * run lists every broken case on stderr.
 *
 * Compiled mode (GJT_COMPILED=1, the ctest entry test_ops_grad_compiled):
 * every gradcheck and f32/bf16 comparison also runs its backward compiled and
 * requires it to run compiled and to match the eager gradients (gjtest.h);
 * the direct backwards (dropout mask, extreme values, threads) run compiled
 * through gjt_backward against the same expected values.
 */
#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Shape of an input spec: SH(2, 3) -> .ndim = 2, .shape = {2, 3}. */
#define SH(...)                                                                    \
    .ndim = (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),             \
    .shape = {__VA_ARGS__}
/* Runs one gradcheck (a gjt_check initializer) and counts a failure. */
#define CHECK(...)                                                                 \
    do {                                                                           \
        gjt_check c_ = __VA_ARGS__;                                                \
        if (gjt_gradcheck(&c_) != 0)                                               \
            nfail++;                                                               \
    } while (0)
#define DONE() assert_int_equal(nfail, 0)

/* ------------------------------------------------------------ op thunks */

typedef gj_tensor *(*binop_fn)(gj_tensor *, gj_tensor *);
typedef gj_tensor *(*unop_fn)(gj_tensor *);
typedef struct {
    binop_fn op;
} bin_ctx;
typedef struct {
    unop_fn op;
} un_ctx;

static gj_tensor *f_bin(gj_tensor **in, void *ctx) { return ((bin_ctx *)ctx)->op(in[0], in[1]); }
static gj_tensor *f_un(gj_tensor **in, void *ctx) { return ((un_ctx *)ctx)->op(in[0]); }

/* ------------------------------------------------------ elementwise */

static int run_binary(const char *name, binop_fn op, double blo, double bhi, double bmin) {
    int nfail = 0;
    bin_ctx ctx = {op};
    char nm[96];
#define BIN(seed, ...)                                                                  \
    do {                                                                                \
        snprintf(nm, sizeof nm, "%s #%d", name, seed);                                  \
        CHECK({.name = nm, .fn = f_bin, .ctx = &ctx, .n_in = 2, .in = {__VA_ARGS__},     \
               .data_seed = (uint64_t)(seed)});                                         \
    } while (0)
#define BSPEC(...) {__VA_ARGS__, .lo = blo, .hi = bhi, .min_abs = bmin}
    BIN(1, {SH(2, 3)}, BSPEC(SH(2, 3)));
    BIN(2, {SH(2, 3)}, BSPEC(SH(3)));
    BIN(3, {SH(3, 1)}, BSPEC(SH(1, 4)));
    BIN(4, {SH(2, 3, 4), .view = GJT_TRANSPOSED}, BSPEC(SH(4), .view = GJT_NARROWED));
    BIN(5, {SH(4, 3), .view = GJT_EXPANDED}, BSPEC(SH(4, 3), .view = GJT_TRANSPOSED));
    BIN(6, {.ndim = 0}, BSPEC(SH(2, 3)));
    BIN(7, {SH(2, 1, 3)}, BSPEC(SH(4, 1)));
    BIN(8, {SH(5)}, BSPEC(.ndim = 0));
    BIN(9, {SH(1)}, BSPEC(SH(1)));
#undef BIN
#undef BSPEC
    return nfail;
}

static void test_add(void **s) { assert_int_equal(run_binary("add", gj_add, -1, 1, 0), 0); }
static void test_sub(void **s) { assert_int_equal(run_binary("sub", gj_sub, -1, 1, 0), 0); }
static void test_mul(void **s) { assert_int_equal(run_binary("mul", gj_mul, -1, 1, 0), 0); }
static void test_div(void **s) { assert_int_equal(run_binary("div", gj_div, -2, 2, 0.5), 0); }

static int run_unary(const char *name, unop_fn op, double lo, double hi, double min_abs,
                     double atol) {
    int nfail = 0;
    un_ctx ctx = {op};
    char nm[96];
#define UN(seed, ...)                                                                    \
    do {                                                                                 \
        snprintf(nm, sizeof nm, "%s #%d", name, seed);                                   \
        CHECK({.name = nm, .fn = f_un, .ctx = &ctx, .n_in = 1,                            \
               .in = {{__VA_ARGS__, .lo = lo, .hi = hi, .min_abs = min_abs}},             \
               .data_seed = (uint64_t)(seed) + 100, .atol = atol});                      \
    } while (0)
    UN(1, SH(7));
    UN(2, SH(2, 3), .view = GJT_TRANSPOSED);
    UN(3, SH(3, 4), .view = GJT_NARROWED);
    UN(4, SH(1, 1));
    UN(5, .ndim = 0);
    UN(6, SH(3, 2), .view = GJT_EXPANDED);
#undef UN
    return nfail;
}

static void test_neg(void **s) { assert_int_equal(run_unary("neg", gj_neg, -2, 2, 0, 0), 0); }
static void test_exp(void **s) { assert_int_equal(run_unary("exp", gj_exp, -2, 2, 0, 0), 0); }
static void test_log(void **s) { assert_int_equal(run_unary("log", gj_log, 0.5, 2, 0, 0), 0); }
static void test_tanh(void **s) { assert_int_equal(run_unary("tanh", gj_tanh, -2, 2, 0, 0), 0); }
static void test_sigmoid(void **s) {
    assert_int_equal(run_unary("sigmoid", gj_sigmoid, -3, 3, 0, 0), 0);
}
static void test_relu(void **s) { assert_int_equal(run_unary("relu", gj_relu, -2, 2, 0.1, 0), 0); }
static void test_gelu(void **s) { assert_int_equal(run_unary("gelu", gj_gelu, -3, 3, 0, 0), 0); }
static void test_sqrt(void **s) { assert_int_equal(run_unary("sqrt", gj_sqrt, 0.5, 2, 0, 0), 0); }

typedef struct {
    double c;
} scal_ctx;
static gj_tensor *f_pow(gj_tensor **in, void *ctx) { return gj_pow_scalar(in[0], ((scal_ctx *)ctx)->c); }
static gj_tensor *f_add_scalar(gj_tensor **in, void *ctx) {
    return gj_add_scalar(in[0], ((scal_ctx *)ctx)->c);
}
static gj_tensor *f_mul_scalar(gj_tensor **in, void *ctx) {
    return gj_mul_scalar(in[0], ((scal_ctx *)ctx)->c);
}

static void test_pow_scalar(void **s) {
    int nfail = 0;
    const double ps[] = {2.0, 0.5, -1.0, 3.0, 1.5, -0.5};
    char nm[64];
    for (int i = 0; i < 6; i++) {
        scal_ctx ctx = {ps[i]};
        snprintf(nm, sizeof nm, "pow_scalar p=%g", ps[i]);
        CHECK({.name = nm, .fn = f_pow, .ctx = &ctx, .n_in = 1,
               .in = {{SH(3, 4), .lo = 0.5, .hi = 2.0}}, .data_seed = 200 + (uint64_t)i});
        snprintf(nm, sizeof nm, "pow_scalar p=%g transposed", ps[i]);
        CHECK({.name = nm, .fn = f_pow, .ctx = &ctx, .n_in = 1,
               .in = {{SH(2, 3), .lo = 0.5, .hi = 2.0, .view = GJT_TRANSPOSED}},
               .data_seed = 210 + (uint64_t)i});
    }
    DONE();
}

static void test_add_mul_scalar(void **s) {
    int nfail = 0;
    scal_ctx c1 = {1.5}, c2 = {-2.5}, c0 = {0.0};
    CHECK({.name = "add_scalar", .fn = f_add_scalar, .ctx = &c1, .n_in = 1, .in = {{SH(3, 4)}}});
    CHECK({.name = "add_scalar narrowed", .fn = f_add_scalar, .ctx = &c1, .n_in = 1,
           .in = {{SH(2, 3), .view = GJT_NARROWED}}});
    CHECK({.name = "mul_scalar", .fn = f_mul_scalar, .ctx = &c2, .n_in = 1, .in = {{SH(3, 4)}}});
    CHECK({.name = "mul_scalar 0-d", .fn = f_mul_scalar, .ctx = &c2, .n_in = 1, .in = {{.ndim = 0}}});
    CHECK({.name = "mul_scalar by 0", .fn = f_mul_scalar, .ctx = &c0, .n_in = 1,
           .in = {{SH(2, 3), .view = GJT_TRANSPOSED}}});
    DONE();
}

/* ------------------------------------------------------- reductions */

typedef struct {
    int n_axes;
    int axes[4];
    bool keepdim;
    bool mean;
} red_ctx;
static gj_tensor *f_reduce(gj_tensor **in, void *ctx) {
    red_ctx *r = ctx;
    return r->mean ? gj_mean(in[0], r->n_axes, r->axes, r->keepdim)
                   : gj_sum(in[0], r->n_axes, r->axes, r->keepdim);
}

static void run_reduce(bool mean, int *nfailp) {
    int nfail = 0;
    const red_ctx cases[] = {
        {1, {0}, false, mean}, {1, {1}, false, mean}, {1, {2}, true, mean},
        {2, {0, 2}, false, mean}, {2, {0, 2}, true, mean}, {1, {-1}, false, mean},
        {1, {-2}, true, mean}, {0, {0}, false, mean}, {0, {0}, true, mean},
        {3, {0, 1, 2}, false, mean},
    };
    char nm[96];
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        red_ctx ctx = cases[i];
        for (int v = 0; v < 3; v++) {
            snprintf(nm, sizeof nm, "%s case %d view %d", mean ? "mean" : "sum", i, v);
            gjt_view views[3] = {GJT_PLAIN, GJT_TRANSPOSED, GJT_NARROWED};
            CHECK({.name = nm, .fn = f_reduce, .ctx = &ctx, .n_in = 1,
                   .in = {{SH(2, 3, 4), .view = views[v]}}, .data_seed = 300 + (uint64_t)i});
        }
    }
    red_ctx one = {1, {0}, false, mean};
    CHECK({.name = mean ? "mean [1,5] axis 0" : "sum [1,5] axis 0", .fn = f_reduce, .ctx = &one,
           .n_in = 1, .in = {{SH(1, 5)}}});
    CHECK({.name = mean ? "mean expanded" : "sum expanded", .fn = f_reduce, .ctx = &one,
           .n_in = 1, .in = {{SH(4, 3), .view = GJT_EXPANDED}}});
    red_ctx all0 = {0, {0}, false, mean};
    CHECK({.name = mean ? "mean of 0-d" : "sum of 0-d", .fn = f_reduce, .ctx = &all0, .n_in = 1,
           .in = {{.ndim = 0}}});
    *nfailp = nfail;
}

static void test_sum(void **s) {
    int nfail;
    run_reduce(false, &nfail);
    DONE();
}
static void test_mean(void **s) {
    int nfail;
    run_reduce(true, &nfail);
    DONE();
}

typedef struct {
    int axis;
    bool keepdim;
} max_ctx;
static gj_tensor *f_max(gj_tensor **in, void *ctx) {
    max_ctx *m = ctx;
    return gj_max(in[0], m->axis, m->keepdim);
}

static void test_max(void **s) {
    int nfail = 0;
    max_ctx c00 = {0, false}, c01 = {0, true}, c10 = {1, false}, c11 = {1, true}, c2 = {2, false},
            cm1 = {-1, true};
    CHECK({.name = "max [3,4] axis 0", .fn = f_max, .ctx = &c00, .n_in = 1,
           .in = {{SH(3, 4), .distinct = true}}});
    CHECK({.name = "max [3,4] axis 0 keepdim", .fn = f_max, .ctx = &c01, .n_in = 1,
           .in = {{SH(3, 4), .distinct = true}}});
    CHECK({.name = "max [3,4] axis 1", .fn = f_max, .ctx = &c10, .n_in = 1,
           .in = {{SH(3, 4), .distinct = true}}});
    CHECK({.name = "max [2,3,4] axis 1 keepdim", .fn = f_max, .ctx = &c11, .n_in = 1,
           .in = {{SH(2, 3, 4), .distinct = true}}});
    CHECK({.name = "max [2,3,4] axis 2 transposed", .fn = f_max, .ctx = &c2, .n_in = 1,
           .in = {{SH(2, 3, 4), .distinct = true, .view = GJT_TRANSPOSED}}});
    CHECK({.name = "max [2,5] axis -1 narrowed", .fn = f_max, .ctx = &cm1, .n_in = 1,
           .in = {{SH(2, 5), .distinct = true, .view = GJT_NARROWED}}});
    CHECK({.name = "max [1,4] axis 0", .fn = f_max, .ctx = &c00, .n_in = 1,
           .in = {{SH(1, 4), .distinct = true}}});
    DONE();
}

/* ------------------------------------------------------ linear algebra */

static gj_tensor *f_matmul(gj_tensor **in, void *ctx) { return gj_matmul(in[0], in[1]); }
static gj_tensor *f_linear_b(gj_tensor **in, void *ctx) { return gj_linear(in[0], in[1], in[2]); }
static gj_tensor *f_linear_nob(gj_tensor **in, void *ctx) { return gj_linear(in[0], in[1], NULL); }

static void test_matmul(void **s) {
    int nfail = 0;
    CHECK({.name = "matmul [3,4]x[4,5]", .fn = f_matmul, .n_in = 2, .in = {{SH(3, 4)}, {SH(4, 5)}}});
    CHECK({.name = "matmul [1,4]x[4,1]", .fn = f_matmul, .n_in = 2, .in = {{SH(1, 4)}, {SH(4, 1)}}});
    CHECK({.name = "matmul [3,1]x[1,2]", .fn = f_matmul, .n_in = 2, .in = {{SH(3, 1)}, {SH(1, 2)}}});
    CHECK({.name = "matmul batched [2,3,4]x[2,4,5]", .fn = f_matmul, .n_in = 2,
           .in = {{SH(2, 3, 4)}, {SH(2, 4, 5)}}});
    CHECK({.name = "matmul broadcast [2,1,3,4]x[3,4,2]", .fn = f_matmul, .n_in = 2,
           .in = {{SH(2, 1, 3, 4)}, {SH(3, 4, 2)}}});
    CHECK({.name = "matmul broadcast [3,4]x[2,4,5]", .fn = f_matmul, .n_in = 2,
           .in = {{SH(3, 4)}, {SH(2, 4, 5)}}});
    CHECK({.name = "matmul broadcast [2,3,4]x[4,5]", .fn = f_matmul, .n_in = 2,
           .in = {{SH(2, 3, 4)}, {SH(4, 5)}}});
    CHECK({.name = "matmul transposed a and b", .fn = f_matmul, .n_in = 2,
           .in = {{SH(3, 4), .view = GJT_TRANSPOSED}, {SH(4, 5), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "matmul narrowed a, expanded b", .fn = f_matmul, .n_in = 2,
           .in = {{SH(2, 3, 4), .view = GJT_NARROWED}, {SH(2, 4, 3), .view = GJT_EXPANDED}}});
    CHECK({.name = "matmul batched transposed", .fn = f_matmul, .n_in = 2,
           .in = {{SH(2, 3, 4), .view = GJT_TRANSPOSED}, {SH(2, 4, 2), .view = GJT_NARROWED}}});
    DONE();
}

/* A transformer-like piece under bf16 autocast: linear (bf16 GEMM), GELU
 * (bf16), matmul with a transposed view, softmax and layer norm (f32), a
 * residual add of f32 and bf16 (f32). f64 leaves are never cast, so the f64
 * run is the exact reference; the f32 run's gradients (f32, as its
 * leaves) must follow it within bf16's precision, and in compiled mode
 * equal the eager ones. */
static gj_tensor *f_autocast(gj_tensor **in, void *ctx) {
    (void)ctx;
    gj_dtype ac0 = gj_get_autocast();
    gj_set_autocast(GJ_BF16);
    gj_tensor *h = gj_gelu(gj_linear(in[0], in[1], in[2]));           /* [4, 6] bf16 */
    gj_tensor *a = gj_softmax(gj_matmul(h, gj_transpose(h, 0, 1)), -1); /* [4, 4] f32 */
    gj_tensor *y = gj_add(gj_matmul(a, h), in[0]);                      /* bf16 + f32: f32 */
    gj_tensor *out = gj_layer_norm(y, NULL, NULL, 1e-5);
    gj_set_autocast(ac0);
    return out;
}

static void test_autocast(void **s) {
    (void)s;
    gjt_check c = {.name = "autocast bf16: linear, gelu, attention, residual, layer norm",
                   .fn = f_autocast, .n_in = 3, .in = {{SH(4, 6)}, {SH(6, 6)}, {SH(6)}}};
    assert_int_equal(gjt_gradcompare(&c, GJ_F32, 3e-2, 3e-2), 0);
}

static void test_linear(void **s) {
    int nfail = 0;
    CHECK({.name = "linear x[3,4] w[5,4] b[5]", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(3, 4)}, {SH(5, 4)}, {SH(5)}}});
    CHECK({.name = "linear no bias", .fn = f_linear_nob, .n_in = 2, .in = {{SH(3, 4)}, {SH(5, 4)}}});
    CHECK({.name = "linear 3-D x[2,3,4]", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(2, 3, 4)}, {SH(2, 4)}, {SH(2)}}});
    CHECK({.name = "linear 3-D x no bias", .fn = f_linear_nob, .n_in = 2,
           .in = {{SH(2, 2, 3)}, {SH(4, 3)}}});
    CHECK({.name = "linear transposed x and w", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(3, 4), .view = GJT_TRANSPOSED}, {SH(5, 4), .view = GJT_TRANSPOSED},
                  {SH(5), .view = GJT_NARROWED}}});
    CHECK({.name = "linear x[1,1] w[1,1]", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(1, 1)}, {SH(1, 1)}, {SH(1)}}});
    CHECK({.name = "linear 1-D x[4]", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(4)}, {SH(3, 4)}, {SH(3)}}});
    DONE();
}

/* ------------------------------------------------------- shape ops */

typedef struct {
    int a, b;
} two_int;
static gj_tensor *f_transpose(gj_tensor **in, void *ctx) {
    two_int *t = ctx;
    return gj_transpose(in[0], t->a, t->b);
}
typedef struct {
    int perm[GJ_MAX_DIMS];
} perm_ctx;
static gj_tensor *f_permute(gj_tensor **in, void *ctx) {
    return gj_permute(in[0], ((perm_ctx *)ctx)->perm);
}
typedef struct {
    int ndim;
    int64_t shape[GJ_MAX_DIMS];
} shape_ctx;
static gj_tensor *f_reshape(gj_tensor **in, void *ctx) {
    shape_ctx *c = ctx;
    return gj_reshape(in[0], c->ndim, c->shape);
}
static gj_tensor *f_view(gj_tensor **in, void *ctx) {
    shape_ctx *c = ctx;
    return gj_view(in[0], c->ndim, c->shape);
}
static gj_tensor *f_expand(gj_tensor **in, void *ctx) {
    shape_ctx *c = ctx;
    return gj_expand(in[0], c->ndim, c->shape);
}
typedef struct {
    int axis;
    int64_t start, len;
} narrow_ctx;
static gj_tensor *f_narrow(gj_tensor **in, void *ctx) {
    narrow_ctx *c = ctx;
    return gj_narrow(in[0], c->axis, c->start, c->len);
}
typedef struct {
    int n, axis;
} cat_ctx;
static gj_tensor *f_cat(gj_tensor **in, void *ctx) {
    cat_ctx *c = ctx;
    return gj_cat(c->n, in, c->axis);
}
static gj_tensor *f_contiguous(gj_tensor **in, void *ctx) {
    gj_tensor *y = gj_contiguous(in[0]);
    if (y && !gj_tensor_is_contiguous(y)) {
        fprintf(stderr, "contiguous: result is not contiguous\n");
        return NULL;
    }
    return y;
}

static void test_transpose_permute(void **s) {
    int nfail = 0;
    two_int t02 = {0, 2}, t12 = {1, 2}, t10 = {1, 0}, t11 = {1, 1};
    CHECK({.name = "transpose [2,3,4] 0,2", .fn = f_transpose, .ctx = &t02, .n_in = 1,
           .in = {{SH(2, 3, 4)}}});
    CHECK({.name = "transpose [2,3,4] 1,2 of transposed", .fn = f_transpose, .ctx = &t12,
           .n_in = 1, .in = {{SH(2, 3, 4), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "transpose [3,4] 1,0 narrowed", .fn = f_transpose, .ctx = &t10, .n_in = 1,
           .in = {{SH(3, 4), .view = GJT_NARROWED}}});
    CHECK({.name = "transpose same axis", .fn = f_transpose, .ctx = &t11, .n_in = 1,
           .in = {{SH(3, 4)}}});
    perm_ctx p1 = {{2, 0, 1}}, p2 = {{1, 0, 2}}, p3 = {{0, 1, 2}}, p4 = {{3, 1, 0, 2}};
    CHECK({.name = "permute [2,3,4] 2,0,1", .fn = f_permute, .ctx = &p1, .n_in = 1,
           .in = {{SH(2, 3, 4)}}});
    CHECK({.name = "permute [2,3,4] 1,0,2 transposed", .fn = f_permute, .ctx = &p2, .n_in = 1,
           .in = {{SH(2, 3, 4), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "permute identity expanded", .fn = f_permute, .ctx = &p3, .n_in = 1,
           .in = {{SH(3, 2, 2), .view = GJT_EXPANDED}}});
    CHECK({.name = "permute 4-D", .fn = f_permute, .ctx = &p4, .n_in = 1,
           .in = {{SH(2, 1, 3, 2)}}});
    DONE();
}

static void test_reshape_view(void **s) {
    int nfail = 0;
    shape_ctx r1 = {2, {6, 4}}, r2 = {2, {-1, 2}}, r3 = {1, {24}}, r4 = {3, {4, -1, 3}},
              r5 = {0, {0}}, r6 = {4, {1, 2, 1, 3}};
    CHECK({.name = "reshape [2,3,4]->[6,4]", .fn = f_reshape, .ctx = &r1, .n_in = 1,
           .in = {{SH(2, 3, 4)}}});
    CHECK({.name = "reshape [2,3,4]->[-1,2]", .fn = f_reshape, .ctx = &r2, .n_in = 1,
           .in = {{SH(2, 3, 4)}}});
    CHECK({.name = "reshape transposed ->[24]", .fn = f_reshape, .ctx = &r3, .n_in = 1,
           .in = {{SH(2, 3, 4), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "reshape narrowed ->[4,-1,3]", .fn = f_reshape, .ctx = &r4, .n_in = 1,
           .in = {{SH(2, 3, 4), .view = GJT_NARROWED}}});
    CHECK({.name = "reshape [1]->0-d", .fn = f_reshape, .ctx = &r5, .n_in = 1, .in = {{SH(1)}}});
    CHECK({.name = "reshape expanded [2,3]->[1,2,1,3]", .fn = f_reshape, .ctx = &r6, .n_in = 1,
           .in = {{SH(2, 3), .view = GJT_EXPANDED}}});
    shape_ctx v1 = {2, {3, 4}}, v2 = {1, {24}}, v3 = {3, {2, 2, 3}};
    CHECK({.name = "view [2,6]->[3,4]", .fn = f_view, .ctx = &v1, .n_in = 1, .in = {{SH(2, 6)}}});
    CHECK({.name = "view [2,3,4]->[24]", .fn = f_view, .ctx = &v2, .n_in = 1,
           .in = {{SH(2, 3, 4)}}});
    CHECK({.name = "view [4,3]->[2,2,3]", .fn = f_view, .ctx = &v3, .n_in = 1, .in = {{SH(4, 3)}}});
    DONE();
}

static void test_expand(void **s) {
    int nfail = 0;
    shape_ctx e1 = {3, {2, 3, 4}}, e2 = {2, {3, 4}}, e3 = {2, {2, 3}}, e4 = {3, {2, 2, 3}};
    CHECK({.name = "expand [3,1]->[2,3,4]", .fn = f_expand, .ctx = &e1, .n_in = 1,
           .in = {{SH(3, 1)}}});
    CHECK({.name = "expand [1,4]->[3,4]", .fn = f_expand, .ctx = &e2, .n_in = 1,
           .in = {{SH(1, 4)}}});
    CHECK({.name = "expand 0-d->[2,3]", .fn = f_expand, .ctx = &e3, .n_in = 1, .in = {{.ndim = 0}}});
    CHECK({.name = "expand [2,3] (no-op)", .fn = f_expand, .ctx = &e3, .n_in = 1,
           .in = {{SH(2, 3), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "expand narrowed [2,3]->[2,2,3]", .fn = f_expand, .ctx = &e4, .n_in = 1,
           .in = {{SH(2, 3), .view = GJT_NARROWED}}});
    DONE();
}

static void test_narrow(void **s) {
    int nfail = 0;
    narrow_ctx n1 = {1, 1, 3}, n2 = {0, 2, 2}, n3 = {2, 0, 1}, n4 = {1, 0, 4}, n5 = {-1, 1, 2};
    CHECK({.name = "narrow [4,5] axis 1", .fn = f_narrow, .ctx = &n1, .n_in = 1,
           .in = {{SH(4, 5)}}});
    CHECK({.name = "narrow [4,5] axis 0", .fn = f_narrow, .ctx = &n2, .n_in = 1,
           .in = {{SH(4, 5)}}});
    CHECK({.name = "narrow [2,3,4] axis 2 len 1 transposed", .fn = f_narrow, .ctx = &n3,
           .n_in = 1, .in = {{SH(2, 3, 4), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "narrow full length narrowed", .fn = f_narrow, .ctx = &n4, .n_in = 1,
           .in = {{SH(3, 4), .view = GJT_NARROWED}}});
    CHECK({.name = "narrow axis -1", .fn = f_narrow, .ctx = &n5, .n_in = 1, .in = {{SH(3, 4)}}});
    DONE();
}

static void test_cat(void **s) {
    int nfail = 0;
    cat_ctx c20 = {2, 0}, c21 = {2, 1}, c31 = {3, 1}, c32 = {3, 2}, c30 = {3, 0};
    CHECK({.name = "cat 2 axis 0", .fn = f_cat, .ctx = &c20, .n_in = 2,
           .in = {{SH(2, 3)}, {SH(4, 3)}}});
    CHECK({.name = "cat 2 axis 1", .fn = f_cat, .ctx = &c21, .n_in = 2,
           .in = {{SH(2, 3)}, {SH(2, 1)}}});
    CHECK({.name = "cat 3 axis 1 (3-D)", .fn = f_cat, .ctx = &c31, .n_in = 3,
           .in = {{SH(2, 1, 3)}, {SH(2, 2, 3)}, {SH(2, 3, 3)}}});
    CHECK({.name = "cat 3 axis 2 non-contiguous", .fn = f_cat, .ctx = &c32, .n_in = 3,
           .in = {{SH(2, 3, 2), .view = GJT_TRANSPOSED}, {SH(2, 3, 1), .view = GJT_NARROWED},
                  {SH(2, 3, 3), .view = GJT_EXPANDED}}});
    CHECK({.name = "cat 3 axis 0 1-D", .fn = f_cat, .ctx = &c30, .n_in = 3,
           .in = {{SH(3)}, {SH(1)}, {SH(2)}}});
    cat_ctx c10 = {1, 0};
    CHECK({.name = "cat 1 input", .fn = f_cat, .ctx = &c10, .n_in = 1, .in = {{SH(2, 3)}}});
    DONE();
}

static void test_contiguous(void **s) {
    int nfail = 0;
    CHECK({.name = "contiguous of transposed", .fn = f_contiguous, .n_in = 1,
           .in = {{SH(3, 4), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "contiguous of narrowed", .fn = f_contiguous, .n_in = 1,
           .in = {{SH(2, 3, 2), .view = GJT_NARROWED}}});
    CHECK({.name = "contiguous of expanded", .fn = f_contiguous, .n_in = 1,
           .in = {{SH(3, 2), .view = GJT_EXPANDED}}});
    CHECK({.name = "contiguous of contiguous", .fn = f_contiguous, .n_in = 1, .in = {{SH(3, 2)}}});
    DONE();
}

/* ---------------------------------------------------------- NN ops */

typedef struct {
    int axis;
    bool log;
} sm_ctx;
static gj_tensor *f_softmax(gj_tensor **in, void *ctx) {
    sm_ctx *c = ctx;
    return c->log ? gj_log_softmax(in[0], c->axis) : gj_softmax(in[0], c->axis);
}

static void run_softmax(bool lg, int *nfailp) {
    int nfail = 0;
    sm_ctx a1 = {1, lg}, a2 = {2, lg}, a0 = {0, lg}, am = {-1, lg};
    const char *n = lg ? "log_softmax" : "softmax";
    char nm[96];
#define SM(ctxp, seed, ...)                                                                \
    do {                                                                                   \
        snprintf(nm, sizeof nm, "%s #%d", n, seed);                                        \
        CHECK({.name = nm, .fn = f_softmax, .ctx = ctxp, .n_in = 1,                        \
               .in = {{__VA_ARGS__, .lo = -3, .hi = 3}}, .data_seed = 400 + (uint64_t)(seed)}); \
    } while (0)
    SM(&a1, 1, SH(3, 5));
    SM(&a2, 2, SH(2, 3, 4));
    SM(&a1, 3, SH(2, 3, 4)); /* middle axis */
    SM(&a0, 4, SH(4, 3));
    SM(&a2, 5, SH(2, 3, 4), .view = GJT_TRANSPOSED);
    SM(&a1, 6, SH(2, 3, 4), .view = GJT_NARROWED);
    SM(&a1, 7, SH(3, 1));
    SM(&am, 8, SH(2, 5));
    SM(&a1, 9, SH(3, 4), .view = GJT_EXPANDED);
#undef SM
    *nfailp = nfail;
}
static void test_softmax(void **s) {
    int nfail;
    run_softmax(false, &nfail);
    DONE();
}
static void test_log_softmax(void **s) {
    int nfail;
    run_softmax(true, &nfail);
    DONE();
}

static gj_tensor *f_ln_wb(gj_tensor **in, void *ctx) { return gj_layer_norm(in[0], in[1], in[2], 1e-5); }
static gj_tensor *f_ln_w(gj_tensor **in, void *ctx) { return gj_layer_norm(in[0], in[1], NULL, 1e-5); }
static gj_tensor *f_ln_b(gj_tensor **in, void *ctx) { return gj_layer_norm(in[0], NULL, in[1], 1e-5); }
static gj_tensor *f_ln(gj_tensor **in, void *ctx) { return gj_layer_norm(in[0], NULL, NULL, 1e-5); }

static void test_layer_norm(void **s) {
    int nfail = 0;
    CHECK({.name = "layer_norm [3,5] w b", .fn = f_ln_wb, .n_in = 3,
           .in = {{SH(3, 5), .lo = -2, .hi = 2}, {SH(5)}, {SH(5)}}});
    CHECK({.name = "layer_norm [3,5] no w b", .fn = f_ln, .n_in = 1,
           .in = {{SH(3, 5), .lo = -2, .hi = 2}}});
    CHECK({.name = "layer_norm [2,3,4] w b", .fn = f_ln_wb, .n_in = 3,
           .in = {{SH(2, 3, 4), .lo = -2, .hi = 2}, {SH(4)}, {SH(4)}}});
    CHECK({.name = "layer_norm w only", .fn = f_ln_w, .n_in = 2,
           .in = {{SH(3, 4), .lo = -2, .hi = 2}, {SH(4)}}});
    CHECK({.name = "layer_norm b only", .fn = f_ln_b, .n_in = 2,
           .in = {{SH(3, 4), .lo = -2, .hi = 2}, {SH(4)}}});
    CHECK({.name = "layer_norm transposed x narrowed w", .fn = f_ln_wb, .n_in = 3,
           .in = {{SH(4, 6), .lo = -2, .hi = 2, .view = GJT_TRANSPOSED},
                  {SH(6), .view = GJT_NARROWED}, {SH(6)}}});
    CHECK({.name = "layer_norm 1-D x", .fn = f_ln_wb, .n_in = 3,
           .in = {{SH(6), .lo = -2, .hi = 2}, {SH(6)}, {SH(6)}}});
    DONE();
}

typedef struct {
    gj_tensor *labels;
} ce_ctx;
static gj_tensor *f_ce(gj_tensor **in, void *ctx) {
    return gj_cross_entropy(in[0], ((ce_ctx *)ctx)->labels);
}

static void test_cross_entropy(void **s) {
    int nfail = 0;
    const int64_t l4[] = {0, 4, 2, 2}, l1[] = {1}, l3[] = {2, 0, 1};
    ce_ctx c4 = {gjt_i64(1, (int64_t[]){4}, l4)}, c1 = {gjt_i64(1, (int64_t[]){1}, l1)},
           c3 = {gjt_i64(1, (int64_t[]){3}, l3)};
    assert_non_null(c4.labels);
    assert_non_null(c1.labels);
    assert_non_null(c3.labels);
    CHECK({.name = "cross_entropy [4,5]", .fn = f_ce, .ctx = &c4, .n_in = 1,
           .in = {{SH(4, 5), .lo = -3, .hi = 3}}});
    CHECK({.name = "cross_entropy [1,3]", .fn = f_ce, .ctx = &c1, .n_in = 1,
           .in = {{SH(1, 3), .lo = -3, .hi = 3}}});
    CHECK({.name = "cross_entropy narrowed [4,5]", .fn = f_ce, .ctx = &c4, .n_in = 1,
           .in = {{SH(4, 5), .lo = -3, .hi = 3, .view = GJT_NARROWED}}});
    CHECK({.name = "cross_entropy transposed [3,3]", .fn = f_ce, .ctx = &c3, .n_in = 1,
           .in = {{SH(3, 3), .lo = -3, .hi = 3, .view = GJT_TRANSPOSED}}});
    CHECK({.name = "cross_entropy [3,3] large logits", .fn = f_ce, .ctx = &c3, .n_in = 1,
           .in = {{SH(3, 3), .lo = -10, .hi = 10}}});
    gj_release(c4.labels);
    gj_release(c1.labels);
    gj_release(c3.labels);
    DONE();
}

typedef struct {
    gj_tensor *idx;
} emb_ctx;
static gj_tensor *f_emb(gj_tensor **in, void *ctx) { return gj_embedding(in[0], ((emb_ctx *)ctx)->idx); }

static void test_embedding(void **s) {
    int nfail = 0;
    const int64_t i23[] = {0, 5, 2, 2, 5, 5}, i4[] = {3, 3, 0, 1};
    emb_ctx c23 = {gjt_i64(2, (int64_t[]){2, 3}, i23)}, c4 = {gjt_i64(1, (int64_t[]){4}, i4)},
            c0 = {gj_from_data(GJ_I64, 0, (int64_t[]){1}, (int64_t[]){2})};
    assert_non_null(c23.idx);
    assert_non_null(c4.idx);
    assert_non_null(c0.idx);
    CHECK({.name = "embedding [6,3] idx[2,3] repeats", .fn = f_emb, .ctx = &c23, .n_in = 1,
           .in = {{SH(6, 3)}}});
    CHECK({.name = "embedding [4,2] idx[4]", .fn = f_emb, .ctx = &c4, .n_in = 1,
           .in = {{SH(4, 2)}}});
    CHECK({.name = "embedding transposed table", .fn = f_emb, .ctx = &c4, .n_in = 1,
           .in = {{SH(4, 3), .view = GJT_TRANSPOSED}}});
    CHECK({.name = "embedding 0-d idx", .fn = f_emb, .ctx = &c0, .n_in = 1, .in = {{SH(4, 3)}}});
    gj_release(c23.idx);
    gj_release(c4.idx);
    gj_release(c0.idx);
    DONE();
}

typedef struct {
    double p;
} drop_ctx;
static gj_tensor *f_dropout(gj_tensor **in, void *ctx) {
    return gj_dropout(in[0], ((drop_ctx *)ctx)->p, true);
}

static void test_dropout_grad(void **s) {
    int nfail = 0;
    drop_ctx c3 = {0.3}, c0 = {0.0};
    CHECK({.name = "dropout p=0.3", .fn = f_dropout, .ctx = &c3, .n_in = 1, .in = {{SH(4, 5)}},
           .reseed = true, .rng_seed = 1234});
    CHECK({.name = "dropout p=0.3 transposed", .fn = f_dropout, .ctx = &c3, .n_in = 1,
           .in = {{SH(3, 4), .view = GJT_TRANSPOSED}}, .reseed = true, .rng_seed = 99});
    CHECK({.name = "dropout p=0", .fn = f_dropout, .ctx = &c0, .n_in = 1, .in = {{SH(3, 4)}},
           .reseed = true, .rng_seed = 7});
    DONE();
}

/* Dropout: gradient is R/(1-p) where the output is kept, 0 where dropped; the
 * kept fraction is plausible; eval mode and p = 0 are the identity. */
static void test_dropout_mask(void **s) {
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    int64_t live0 = gjt_live_bytes();
    const int64_t shape[] = {40, 50};
    const int64_t n = 2000;
    double *xv = malloc(sizeof(double) * n), *Rv = malloc(sizeof(double) * n);
    for (int64_t i = 0; i < n; i++) {
        double v;
        do
            v = gjt_rng_uniform(&r, -1, 1);
        while (fabs(v) < 0.01);
        xv[i] = v;
        Rv[i] = gjt_rng_uniform(&r, -1, 1);
    }
    gj_tensor *x = gjt_tensor(GJ_F64, 2, shape, xv);
    gj_tensor *R = gjt_tensor(GJ_F64, 2, shape, Rv);
    assert_non_null(x);
    assert_non_null(R);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_manual_seed(42);
    gj_scope_push();
    gj_tensor *y = gj_dropout(x, 0.3, true);
    assert_non_null(y);
    gj_tensor *L = gj_sum(gj_mul(y, R), 0, NULL, false);
    assert_non_null(L);
    assert_int_equal(gjt_backward(L, NULL, false), 0);
    double *yv = gjt_values(y), *gv = gjt_values(gj_tensor_grad(x));
    assert_non_null(yv);
    assert_non_null(gv);
    int64_t dropped = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (yv[i] == 0.0) {
            dropped++;
            if (gv[i] != 0.0)
                bad++;
        } else {
            if (fabs(yv[i] - xv[i] / 0.7) > 1e-12 || fabs(gv[i] - Rv[i] / 0.7) > 1e-12)
                bad++;
        }
    }
    free(yv);
    free(gv);
    if (bad)
        fprintf(stderr, "dropout: %lld elements violate y in {0, x/0.7}, grad in {0, R/0.7}\n",
                (long long)bad);
    assert_int_equal(bad, 0);
    /* 2000 Bernoulli(0.3): mean 600, sd 20.5 */
    assert_true(dropped > 480 && dropped < 720);

    /* The same seed draws the same mask; another seed a different one. */
    gj_manual_seed(42);
    gj_tensor *y2 = gj_dropout(x, 0.3, true);
    gj_manual_seed(43);
    gj_tensor *y3 = gj_dropout(x, 0.3, true);
    double *a = gjt_values(y), *b = gjt_values(y2), *c = gjt_values(y3);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    assert_true(gjt_max_abs_diff(a, b, n, NULL) == 0.0);
    assert_true(gjt_max_abs_diff(a, c, n, NULL) > 0.0);
    free(a);
    free(b);
    free(c);

    /* Identity in eval mode and for p = 0. */
    gj_tensor *ye = gj_dropout(x, 0.3, false), *y0 = gj_dropout(x, 0.0, true);
    assert_true(gjt_tensor_close("dropout eval", ye, xv, 0, 0));
    assert_true(gjt_tensor_close("dropout p=0", y0, xv, 0, 0));
    gj_scope_pop();
    gj_release(x);
    gj_release(R);
    free(xv);
    free(Rv);
    assert_int_equal(gjt_live_bytes(), live0);
}

typedef struct {
    gj_tensor *cond;
} where_ctx;
static gj_tensor *f_where(gj_tensor **in, void *ctx) {
    return gj_where(((where_ctx *)ctx)->cond, in[0], in[1]);
}
typedef struct {
    gj_tensor *mask;
    double value;
    bool softmax;
} mf_ctx;
static gj_tensor *f_masked_fill(gj_tensor **in, void *ctx) {
    mf_ctx *c = ctx;
    gj_tensor *y = gj_masked_fill(in[0], c->mask, c->value);
    return c->softmax && y ? gj_softmax(y, gj_tensor_ndim(y) - 1) : y;
}

/* Upper-triangular (j > i) causal mask [T, T] of dtype dt. */
static gj_tensor *causal_mask(gj_dtype dt, int64_t T) {
    double *m = malloc(sizeof(double) * (size_t)(T * T));
    for (int64_t i = 0; i < T; i++)
        for (int64_t j = 0; j < T; j++)
            m[i * T + j] = j > i ? 1.0 : 0.0;
    gj_tensor *t;
    if (dt == GJ_I64) {
        int64_t *mi = malloc(sizeof(int64_t) * (size_t)(T * T));
        for (int64_t i = 0; i < T * T; i++)
            mi[i] = (int64_t)m[i];
        t = gj_from_data(GJ_I64, 2, (int64_t[]){T, T}, mi);
        free(mi);
    } else {
        t = gjt_tensor(dt, 2, (int64_t[]){T, T}, m);
    }
    free(m);
    return t;
}

static void test_where_masked_fill(void **s) {
    int nfail = 0;
    const double cv[] = {1, 0, 1};
    const int64_t ci[] = {0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 0};
    where_ctx w1 = {gjt_tensor(GJ_F64, 2, (int64_t[]){3, 1}, cv)},
              w2 = {gjt_i64(2, (int64_t[]){3, 4}, ci)};
    assert_non_null(w1.cond);
    assert_non_null(w2.cond);
    CHECK({.name = "where cond[3,1] a[3,4] b[4]", .fn = f_where, .ctx = &w1, .n_in = 2,
           .in = {{SH(3, 4)}, {SH(4)}}});
    CHECK({.name = "where cond i64[3,4] a transposed b narrowed", .fn = f_where, .ctx = &w2,
           .n_in = 2, .in = {{SH(3, 4), .view = GJT_TRANSPOSED}, {SH(3, 4), .view = GJT_NARROWED}}});
    CHECK({.name = "where cond[3,1] a[2,3,1] b 0-d", .fn = f_where, .ctx = &w1, .n_in = 2,
           .in = {{SH(2, 3, 1)}, {.ndim = 0}}});
    gj_release(w1.cond);
    gj_release(w2.cond);

    mf_ctx m1 = {causal_mask(GJ_I64, 4), 0.5, false}, m2 = {causal_mask(GJ_F64, 4), -1e9, true},
           m3 = {causal_mask(GJ_F64, 3), -2.0, false};
    assert_non_null(m1.mask);
    assert_non_null(m2.mask);
    assert_non_null(m3.mask);
    CHECK({.name = "masked_fill causal i64 mask [2,4,4]", .fn = f_masked_fill, .ctx = &m1,
           .n_in = 1, .in = {{SH(2, 4, 4)}}});
    CHECK({.name = "masked_fill -1e9 + softmax (attention)", .fn = f_masked_fill, .ctx = &m2,
           .n_in = 1, .in = {{SH(2, 4, 4), .lo = -2, .hi = 2}}});
    CHECK({.name = "masked_fill transposed x", .fn = f_masked_fill, .ctx = &m3, .n_in = 1,
           .in = {{SH(2, 3, 3), .view = GJT_TRANSPOSED}}});
    gj_release(m1.mask);
    gj_release(m2.mask);
    gj_release(m3.mask);
    DONE();
}

static gj_tensor *f_cast_roundtrip(gj_tensor **in, void *ctx) {
    gj_tensor *a = gj_cast(in[0], GJ_F32);
    return a ? gj_cast(a, GJ_F64) : NULL;
}
static gj_tensor *f_cast_tanh(gj_tensor **in, void *ctx) {
    gj_tensor *a = gj_cast(in[0], GJ_F32);
    gj_tensor *b = a ? gj_tanh(a) : NULL;
    return b ? gj_cast(b, GJ_F64) : NULL;
}
static gj_tensor *f_cast_f32_out(gj_tensor **in, void *ctx) { return gj_cast(in[0], GJ_F32); }

static void test_cast(void **s) {
    int nfail = 0;
    /* f32 rounding: eps large enough that rounding noise / eps stays small */
    CHECK({.name = "cast f64->f32->f64", .fn = f_cast_roundtrip, .n_in = 1, .in = {{SH(3, 4)}},
           .eps = 1e-2, .atol = 1e-4, .rtol = 1e-4});
    CHECK({.name = "cast f64->f32 tanh ->f64", .fn = f_cast_tanh, .n_in = 1,
           .in = {{SH(3, 4), .view = GJT_TRANSPOSED}}, .eps = 1e-3, .atol = 1e-3, .rtol = 1e-3});
    CHECK({.name = "cast f64->f32 (f32 output)", .fn = f_cast_f32_out, .n_in = 1,
           .in = {{SH(2, 3), .view = GJT_NARROWED}}, .eps = 1e-2, .atol = 1e-4, .rtol = 1e-4});
    CHECK({.name = "cast f64->f64", .fn = f_cast_roundtrip, .n_in = 1, .in = {{.ndim = 0}},
           .eps = 1e-2, .atol = 1e-4, .rtol = 1e-4});
    DONE();
}

/* ------------------------------------------------------------ composed */

typedef struct {
    gj_tensor *x, *labels;
} mlp_ctx;
/* CE(linear(gelu(linear(x, w1, b1)), w2, b2), labels); in = w1, b1, w2, b2. */
static gj_tensor *f_mlp(gj_tensor **in, void *ctx) {
    mlp_ctx *c = ctx;
    gj_tensor *h = gj_linear(c->x, in[0], in[1]);
    gj_tensor *g = h ? gj_gelu(h) : NULL;
    gj_tensor *o = g ? gj_linear(g, in[2], in[3]) : NULL;
    return o ? gj_cross_entropy(o, c->labels) : NULL;
}
/* A small attention-like block: softmax(q k^T / 2 masked) v, layer_norm. */
static gj_tensor *f_attn(gj_tensor **in, void *ctx) {
    gj_tensor *mask = ctx;
    gj_tensor *q = in[0], *k = in[1], *v = in[2];
    gj_tensor *kt = gj_transpose(k, 1, 2);
    gj_tensor *sc = kt ? gj_mul_scalar(gj_matmul(q, kt), 0.5) : NULL;
    gj_tensor *m = sc ? gj_masked_fill(sc, mask, -1e9) : NULL;
    gj_tensor *p = m ? gj_softmax(m, 2) : NULL;
    gj_tensor *o = p ? gj_matmul(p, v) : NULL;
    gj_tensor *r = o ? gj_add(o, q) : NULL;
    return r ? gj_layer_norm(r, in[3], NULL, 1e-5) : NULL;
}

static void test_composed(void **s) {
    int nfail = 0;
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    mlp_ctx c = {gjt_uniform(&r, GJ_F64, 2, (int64_t[]){5, 4}, -1, 1),
                 gjt_labels(&r, 1, (int64_t[]){5}, 3)};
    assert_non_null(c.x);
    assert_non_null(c.labels);
    CHECK({.name = "MLP 4-6-3 + CE", .fn = f_mlp, .ctx = &c, .n_in = 4,
           .in = {{SH(6, 4)}, {SH(6)}, {SH(3, 6)}, {SH(3)}}});
    gj_release(c.x);
    gj_release(c.labels);
    gj_tensor *mask = causal_mask(GJ_I64, 3);
    assert_non_null(mask);
    CHECK({.name = "attention block", .fn = f_attn, .ctx = mask, .n_in = 4,
           .in = {{SH(2, 3, 4)}, {SH(2, 3, 4)}, {SH(2, 3, 4), .view = GJT_TRANSPOSED}, {SH(4)}}});
    gj_release(mask);
    DONE();
}

/* --------------------------------------------------- forward references */

/* Checks t's shape and values; counts a failure. */
static void fwd_check(int *nfail, const char *what, gj_tensor *t, int ndim, const int64_t *shape,
                      const double *want, double tol) {
    if (!t) {
        fprintf(stderr, "  %s: returned NULL: %s\n", what, gj_last_error());
        (*nfail)++;
        return;
    }
    if (!gjt_shape_is(t, ndim, shape)) {
        char b1[128], b2[128];
        fprintf(stderr, "  %s: shape %s, want %s\n", what,
                gjt_fmt_shape(b1, sizeof b1, gj_tensor_ndim(t), gj_tensor_shape(t)),
                gjt_fmt_shape(b2, sizeof b2, ndim, shape));
        (*nfail)++;
        return;
    }
    if (!gjt_tensor_close(what, t, want, tol, tol))
        (*nfail)++;
}

static double ref_gelu(double x) {
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

static void test_forward_elementwise(void **s) {
    int nfail = 0;
    gj_scope_push();
    const double xv[] = {-2.5, -1.0, -0.3, 0.2, 0.7, 1.9};
    const double pv[] = {0.25, 0.5, 1.0, 1.5, 3.0, 7.0};
    const int64_t sh[] = {2, 3};
    gj_tensor *x = gjt_tensor(GJ_F64, 2, sh, xv), *p = gjt_tensor(GJ_F64, 2, sh, pv);
    double w[6];
#define UNREF(name, call, expr, arr)                                                      \
    do {                                                                                  \
        for (int i = 0; i < 6; i++) {                                                     \
            double v = arr[i];                                                            \
            w[i] = (expr);                                                                \
        }                                                                                 \
        fwd_check(&nfail, name, call, 2, sh, w, 1e-12);                                   \
    } while (0)
    UNREF("neg", gj_neg(x), -v, xv);
    UNREF("exp", gj_exp(x), exp(v), xv);
    UNREF("tanh", gj_tanh(x), tanh(v), xv);
    UNREF("sigmoid", gj_sigmoid(x), 1.0 / (1.0 + exp(-v)), xv);
    UNREF("relu", gj_relu(x), v > 0 ? v : 0.0, xv);
    UNREF("gelu (tanh approximation)", gj_gelu(x), ref_gelu(v), xv);
    UNREF("add_scalar", gj_add_scalar(x, 0.75), v + 0.75, xv);
    UNREF("mul_scalar", gj_mul_scalar(x, -3.0), v * -3.0, xv);
    UNREF("log", gj_log(p), log(v), pv);
    UNREF("sqrt", gj_sqrt(p), sqrt(v), pv);
    UNREF("pow -1", gj_pow_scalar(p, -1.0), 1.0 / v, pv);
    UNREF("pow 0.5", gj_pow_scalar(p, 0.5), sqrt(v), pv);
    UNREF("pow 2", gj_pow_scalar(x, 2.0), v * v, xv);
    UNREF("pow 3", gj_pow_scalar(x, 3.0), v * v * v, xv);
#undef UNREF
    /* binary with broadcast [2,3] op [3] */
    const double bv[] = {0.5, -2.0, 4.0};
    gj_tensor *b = gjt_tensor(GJ_F64, 1, (int64_t[]){3}, bv);
    double wa[6], ws[6], wm[6], wd[6];
    for (int i = 0; i < 6; i++) {
        wa[i] = xv[i] + bv[i % 3];
        ws[i] = xv[i] - bv[i % 3];
        wm[i] = xv[i] * bv[i % 3];
        wd[i] = xv[i] / bv[i % 3];
    }
    fwd_check(&nfail, "add bcast", gj_add(x, b), 2, sh, wa, 1e-12);
    fwd_check(&nfail, "sub bcast", gj_sub(x, b), 2, sh, ws, 1e-12);
    fwd_check(&nfail, "mul bcast", gj_mul(x, b), 2, sh, wm, 1e-12);
    fwd_check(&nfail, "div bcast", gj_div(x, b), 2, sh, wd, 1e-12);
    /* b - x: the broadcast operand first */
    for (int i = 0; i < 6; i++)
        ws[i] = bv[i % 3] - xv[i];
    fwd_check(&nfail, "sub bcast (b - x)", gj_sub(b, x), 2, sh, ws, 1e-12);
    /* [3,1] + [1,2] -> [3,2] */
    gj_tensor *c31 = gjt_tensor(GJ_F64, 2, (int64_t[]){3, 1}, bv);
    gj_tensor *c12 = gjt_tensor(GJ_F64, 2, (int64_t[]){1, 2}, (double[]){10, 20});
    fwd_check(&nfail, "add [3,1]+[1,2]", gj_add(c31, c12), 2, (int64_t[]){3, 2},
              (double[]){10.5, 20.5, 8, 18, 14, 24}, 1e-12);
    /* f32 dtype kept */
    gj_tensor *xf = gj_cast(x, GJ_F32);
    gj_tensor *ef = xf ? gj_exp(xf) : NULL;
    if (!ef || gj_tensor_dtype(ef) != GJ_F32) {
        fprintf(stderr, "  exp of f32 is not f32\n");
        nfail++;
    }
    gj_scope_pop();
    DONE();
}

static void test_forward_reductions(void **s) {
    int nfail = 0;
    gj_scope_push();
    double xv[24];
    for (int i = 0; i < 24; i++)
        xv[i] = (double)((i * 7) % 11) - 4.5 + 0.01 * i; /* distinct values */
    const int64_t sh[] = {2, 3, 4};
    gj_tensor *x = gjt_tensor(GJ_F64, 3, sh, xv);
    double s1[8], m1[8], mx0[12], mx2[6], all = 0;
    for (int a = 0; a < 2; a++)
        for (int c = 0; c < 4; c++) {
            double acc = 0;
            for (int b = 0; b < 3; b++)
                acc += xv[a * 12 + b * 4 + c];
            s1[a * 4 + c] = acc;
            m1[a * 4 + c] = acc / 3.0;
        }
    for (int i = 0; i < 12; i++)
        mx0[i] = fmax(xv[i], xv[12 + i]);
    for (int i = 0; i < 6; i++) {
        mx2[i] = xv[i * 4];
        for (int c = 1; c < 4; c++)
            mx2[i] = fmax(mx2[i], xv[i * 4 + c]);
    }
    for (int i = 0; i < 24; i++)
        all += xv[i];
    int ax1[] = {1}, axm2[] = {-2}, ax02[] = {0, 2};
    fwd_check(&nfail, "sum axis 1", gj_sum(x, 1, ax1, false), 2, (int64_t[]){2, 4}, s1, 1e-12);
    fwd_check(&nfail, "sum axis -2 keepdim", gj_sum(x, 1, axm2, true), 3, (int64_t[]){2, 1, 4}, s1,
              1e-12);
    fwd_check(&nfail, "mean axis 1", gj_mean(x, 1, ax1, false), 2, (int64_t[]){2, 4}, m1, 1e-12);
    fwd_check(&nfail, "sum all", gj_sum(x, 0, NULL, false), 0, NULL, &all, 1e-12);
    fwd_check(&nfail, "sum all keepdim", gj_sum(x, 0, NULL, true), 3, (int64_t[]){1, 1, 1}, &all,
              1e-12);
    double mall = all / 24.0;
    fwd_check(&nfail, "mean all", gj_mean(x, 0, NULL, false), 0, NULL, &mall, 1e-12);
    double s02[3];
    for (int b = 0; b < 3; b++) {
        s02[b] = 0;
        for (int a = 0; a < 2; a++)
            for (int c = 0; c < 4; c++)
                s02[b] += xv[a * 12 + b * 4 + c];
        s02[b] /= 8.0;
    }
    fwd_check(&nfail, "mean axes 0,2", gj_mean(x, 2, ax02, false), 1, (int64_t[]){3}, s02, 1e-12);
    fwd_check(&nfail, "max axis 0", gj_max(x, 0, false), 2, (int64_t[]){3, 4}, mx0, 0);
    fwd_check(&nfail, "max axis 2 keepdim", gj_max(x, 2, true), 3, (int64_t[]){2, 3, 1}, mx2, 0);
    /* reductions of a transposed view */
    gj_tensor *xt = gj_transpose(x, 0, 2); /* [4,3,2] */
    double st[12];
    for (int c = 0; c < 4; c++)
        for (int b = 0; b < 3; b++)
            st[c * 3 + b] = xv[b * 4 + c] + xv[12 + b * 4 + c];
    int ax2[] = {2};
    fwd_check(&nfail, "sum of transposed axis 2", gj_sum(xt, 1, ax2, false), 2, (int64_t[]){4, 3},
              st, 1e-12);
    gj_scope_pop();
    DONE();
}

static void test_forward_linalg_shape(void **s) {
    int nfail = 0;
    gj_scope_push();
    gjt_rng r;
    gjt_rng_seed(&r, 11);
    double av[24], bv[12], biasv[4];
    for (int i = 0; i < 24; i++)
        av[i] = gjt_rng_uniform(&r, -1, 1);
    for (int i = 0; i < 12; i++)
        bv[i] = gjt_rng_uniform(&r, -1, 1);
    for (int i = 0; i < 4; i++)
        biasv[i] = gjt_rng_uniform(&r, -1, 1);
    /* a [2,4,3] x b [3,4] -> [2,4,4] */
    gj_tensor *a = gjt_tensor(GJ_F64, 3, (int64_t[]){2, 4, 3}, av);
    gj_tensor *b = gjt_tensor(GJ_F64, 2, (int64_t[]){3, 4}, bv);
    double mm[32];
    for (int bt = 0; bt < 2; bt++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) {
                double acc = 0;
                for (int k = 0; k < 3; k++)
                    acc += av[bt * 12 + i * 3 + k] * bv[k * 4 + j];
                mm[bt * 16 + i * 4 + j] = acc;
            }
    fwd_check(&nfail, "matmul [2,4,3]x[3,4]", gj_matmul(a, b), 3, (int64_t[]){2, 4, 4}, mm, 1e-12);
    /* linear: x [2,4,3], w [4,3] (b^T as w), bias [4] */
    double wv[12];
    for (int o = 0; o < 4; o++)
        for (int k = 0; k < 3; k++)
            wv[o * 3 + k] = bv[k * 4 + o];
    gj_tensor *w = gjt_tensor(GJ_F64, 2, (int64_t[]){4, 3}, wv);
    gj_tensor *bias = gjt_tensor(GJ_F64, 1, (int64_t[]){4}, biasv);
    double lin[32];
    for (int i = 0; i < 32; i++)
        lin[i] = mm[i] + biasv[i % 4];
    fwd_check(&nfail, "linear 3-D x", gj_linear(a, w, bias), 3, (int64_t[]){2, 4, 4}, lin, 1e-12);
    fwd_check(&nfail, "linear no bias", gj_linear(a, w, NULL), 3, (int64_t[]){2, 4, 4}, mm, 1e-12);
    /* transpose / permute / narrow / expand / cat / reshape */
    double tv[24], pv[24], nv[8], ev[24], cv[36];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 3; k++) {
                tv[k * 8 + j * 2 + i] = av[i * 12 + j * 3 + k];  /* transpose 0,2 -> [3,4,2] */
                pv[j * 6 + k * 2 + i] = av[i * 12 + j * 3 + k];  /* permute {1,2,0} -> [4,3,2] */
            }
    fwd_check(&nfail, "transpose 0,2", gj_transpose(a, 0, 2), 3, (int64_t[]){3, 4, 2}, tv, 0);
    fwd_check(&nfail, "permute 1,2,0", gj_permute(a, (int[]){1, 2, 0}), 3, (int64_t[]){4, 3, 2}, pv,
              0);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            for (int k = 0; k < 2; k++)
                nv[i * 4 + j * 2 + k] = av[i * 12 + (j + 1) * 3 + (k + 1)];
    gj_tensor *n1 = gj_narrow(a, 1, 1, 2);
    fwd_check(&nfail, "narrow twice", n1 ? gj_narrow(n1, 2, 1, 2) : NULL, 3, (int64_t[]){2, 2, 2},
              nv, 0);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 4; k++)
                ev[i * 12 + j * 4 + k] = bv[j * 4 + k];
    fwd_check(&nfail, "expand [3,4]->[2,3,4]", gj_expand(b, 3, (int64_t[]){2, 3, 4}), 3,
              (int64_t[]){2, 3, 4}, ev, 0);
    /* cat along axis 1 of a [2,4,3] and a transposed [2,2,3] view */
    gj_tensor *c2 = gj_narrow(a, 1, 0, 2);
    gj_tensor *parts[2] = {a, c2};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 6; j++)
            for (int k = 0; k < 3; k++)
                cv[i * 18 + j * 3 + k] = j < 4 ? av[i * 12 + j * 3 + k] : av[i * 12 + (j - 4) * 3 + k];
    fwd_check(&nfail, "cat axis 1", gj_cat(2, parts, 1), 3, (int64_t[]){2, 6, 3}, cv, 0);
    gj_tensor *at = gj_transpose(a, 1, 2); /* [2,3,4] */
    double rv[24];
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 3; k++)
            for (int j = 0; j < 4; j++)
                rv[i * 12 + k * 4 + j] = av[i * 12 + j * 3 + k];
    fwd_check(&nfail, "reshape of transposed", gj_reshape(at, 2, (int64_t[]){-1, 6}), 2,
              (int64_t[]){4, 6}, rv, 0);
    fwd_check(&nfail, "contiguous of transposed", gj_contiguous(at), 3, (int64_t[]){2, 3, 4}, rv, 0);
    fwd_check(&nfail, "view", gj_view(a, 2, (int64_t[]){6, 4}), 2, (int64_t[]){6, 4}, av, 0);
    /* views share storage */
    gj_tensor *vw = gj_view(a, 1, (int64_t[]){24});
    if (!vw || gj_tensor_data(vw) != gj_tensor_data(a)) {
        fprintf(stderr, "  view does not share storage\n");
        nfail++;
    }
    gj_scope_pop();
    DONE();
}

static void test_forward_nn(void **s) {
    int nfail = 0;
    gj_scope_push();
    gjt_rng r;
    gjt_rng_seed(&r, 12);
    double xv[24];
    for (int i = 0; i < 24; i++)
        xv[i] = gjt_rng_uniform(&r, -3, 3);
    gj_tensor *x = gjt_tensor(GJ_F64, 3, (int64_t[]){2, 3, 4}, xv);
    /* softmax / log_softmax over the middle axis */
    double sm[24], lsm[24];
    for (int a = 0; a < 2; a++)
        for (int c = 0; c < 4; c++) {
            double mx = -INFINITY, z = 0;
            for (int b = 0; b < 3; b++)
                mx = fmax(mx, xv[a * 12 + b * 4 + c]);
            for (int b = 0; b < 3; b++)
                z += exp(xv[a * 12 + b * 4 + c] - mx);
            for (int b = 0; b < 3; b++) {
                int i = a * 12 + b * 4 + c;
                sm[i] = exp(xv[i] - mx) / z;
                lsm[i] = xv[i] - mx - log(z);
            }
        }
    const int64_t sh[] = {2, 3, 4};
    fwd_check(&nfail, "softmax axis 1", gj_softmax(x, 1), 3, sh, sm, 1e-12);
    fwd_check(&nfail, "log_softmax axis 1", gj_log_softmax(x, 1), 3, sh, lsm, 1e-12);
    /* softmax of large values stays finite */
    gj_tensor *big = gjt_tensor(GJ_F64, 1, (int64_t[]){2}, (double[]){1000.0, 1000.0});
    fwd_check(&nfail, "softmax of [1000, 1000]", gj_softmax(big, 0), 1, (int64_t[]){2},
              (double[]){0.5, 0.5}, 1e-12);
    /* layer_norm over the last axis, biased variance, eps inside the sqrt */
    double wv[4] = {1.5, -0.5, 2.0, 0.25}, bv[4] = {0.1, 0.2, -0.3, 0.0}, ln[24], lnwb[24];
    for (int row = 0; row < 6; row++) {
        double mu = 0, var = 0;
        for (int c = 0; c < 4; c++)
            mu += xv[row * 4 + c];
        mu /= 4;
        for (int c = 0; c < 4; c++)
            var += (xv[row * 4 + c] - mu) * (xv[row * 4 + c] - mu);
        var /= 4;
        for (int c = 0; c < 4; c++) {
            ln[row * 4 + c] = (xv[row * 4 + c] - mu) / sqrt(var + 1e-3);
            lnwb[row * 4 + c] = ln[row * 4 + c] * wv[c] + bv[c];
        }
    }
    gj_tensor *w = gjt_tensor(GJ_F64, 1, (int64_t[]){4}, wv);
    gj_tensor *bb = gjt_tensor(GJ_F64, 1, (int64_t[]){4}, bv);
    fwd_check(&nfail, "layer_norm", gj_layer_norm(x, NULL, NULL, 1e-3), 3, sh, ln, 1e-12);
    fwd_check(&nfail, "layer_norm w b", gj_layer_norm(x, w, bb, 1e-3), 3, sh, lnwb, 1e-12);
    /* cross_entropy: logits [6,4] (x viewed), labels */
    const int64_t lab[] = {0, 3, 1, 1, 2, 0};
    gj_tensor *labels = gjt_i64(1, (int64_t[]){6}, lab);
    gj_tensor *logits = gj_reshape(x, 2, (int64_t[]){6, 4});
    double ce = 0;
    for (int n = 0; n < 6; n++) {
        double mx = -INFINITY, z = 0;
        for (int k = 0; k < 4; k++)
            mx = fmax(mx, xv[n * 4 + k]);
        for (int k = 0; k < 4; k++)
            z += exp(xv[n * 4 + k] - mx);
        ce += -(xv[n * 4 + lab[n]] - mx - log(z));
    }
    ce /= 6;
    fwd_check(&nfail, "cross_entropy", gj_cross_entropy(logits, labels), 0, NULL, &ce, 1e-12);
    /* embedding: table [3,4] (x[0] viewed), idx [2,2] */
    gj_tensor *table = gj_reshape(gj_narrow(x, 0, 0, 1), 2, (int64_t[]){3, 4});
    const int64_t iv[] = {2, 0, 2, 1};
    gj_tensor *idx = gjt_i64(2, (int64_t[]){2, 2}, iv);
    double em[16];
    for (int i = 0; i < 4; i++)
        for (int d = 0; d < 4; d++)
            em[i * 4 + d] = xv[iv[i] * 4 + d];
    fwd_check(&nfail, "embedding", gj_embedding(table, idx), 3, (int64_t[]){2, 2, 4}, em, 0);
    /* where and masked_fill with broadcast conditions */
    gj_tensor *cond = gjt_i64(2, (int64_t[]){3, 1}, (int64_t[]){1, 0, 5});
    gj_tensor *zero = gj_scalar(GJ_F64, -7.0);
    double wh[24], mf[24];
    for (int i = 0; i < 24; i++) {
        int b = (i / 4) % 3;
        wh[i] = (b == 1) ? -7.0 : xv[i];
        mf[i] = (b == 1) ? xv[i] : 2.5;
    }
    fwd_check(&nfail, "where", gj_where(cond, x, zero), 3, sh, wh, 0);
    fwd_check(&nfail, "masked_fill", gj_masked_fill(x, cond, 2.5), 3, sh, mf, 0);
    gj_scope_pop();
    DONE();
}

/* --------------------------------------------------- f32 / bf16 vs f64 */

typedef gj_tensor *(*lp_fn)(gj_tensor **in);
static gj_tensor *lp_add(gj_tensor **in) { return gj_add(in[0], in[1]); }
static gj_tensor *lp_mul(gj_tensor **in) { return gj_mul(in[0], in[1]); }
static gj_tensor *lp_div(gj_tensor **in) { return gj_div(in[0], in[1]); }
static gj_tensor *lp_exp(gj_tensor **in) { return gj_exp(in[0]); }
static gj_tensor *lp_tanh(gj_tensor **in) { return gj_tanh(in[0]); }
static gj_tensor *lp_sigmoid(gj_tensor **in) { return gj_sigmoid(in[0]); }
static gj_tensor *lp_gelu(gj_tensor **in) { return gj_gelu(in[0]); }
static gj_tensor *lp_matmul(gj_tensor **in) { return gj_matmul(in[0], in[1]); }
static gj_tensor *lp_linear(gj_tensor **in) { return gj_linear(in[0], in[1], NULL); }
static gj_tensor *lp_sum(gj_tensor **in) { return gj_sum(in[0], 1, (int[]){1}, false); }
static gj_tensor *lp_mean(gj_tensor **in) { return gj_mean(in[0], 0, NULL, false); }
static gj_tensor *lp_softmax(gj_tensor **in) { return gj_softmax(in[0], 1); }
static gj_tensor *lp_log_softmax(gj_tensor **in) { return gj_log_softmax(in[0], 1); }
static gj_tensor *lp_ln(gj_tensor **in) { return gj_layer_norm(in[0], NULL, NULL, 1e-5); }
static gj_tensor *lp_transpose_exp(gj_tensor **in) { return gj_exp(gj_transpose(in[0], 0, 1)); }

static void test_lowp_forward(void **s) {
    int nfail = 0;
    struct {
        const char *name;
        lp_fn fn;
        int n;
        int64_t s0[2], s1[2];
        bool pos1;
    } ops[] = {
        {"add", lp_add, 2, {8, 16}, {8, 16}, false},
        {"mul", lp_mul, 2, {8, 16}, {1, 16}, false},
        {"div", lp_div, 2, {8, 16}, {8, 16}, true},
        {"exp", lp_exp, 1, {8, 16}, {0, 0}, false},
        {"tanh", lp_tanh, 1, {8, 16}, {0, 0}, false},
        {"sigmoid", lp_sigmoid, 1, {8, 16}, {0, 0}, false},
        {"gelu", lp_gelu, 1, {8, 16}, {0, 0}, false},
        {"matmul", lp_matmul, 2, {8, 16}, {16, 8}, false},
        {"linear", lp_linear, 2, {8, 16}, {4, 16}, false},
        {"sum", lp_sum, 1, {8, 16}, {0, 0}, false},
        {"mean", lp_mean, 1, {8, 16}, {0, 0}, false},
        {"softmax", lp_softmax, 1, {8, 16}, {0, 0}, false},
        {"log_softmax", lp_log_softmax, 1, {8, 16}, {0, 0}, false},
        {"layer_norm", lp_ln, 1, {8, 16}, {0, 0}, false},
        {"exp of transposed", lp_transpose_exp, 1, {8, 16}, {0, 0}, false},
    };
    gjt_rng r;
    gjt_rng_seed(&r, 21);
    for (int o = 0; o < (int)(sizeof ops / sizeof ops[0]); o++) {
        for (int d = 0; d < 2; d++) {
            gj_dtype dt = d == 0 ? GJ_F32 : GJ_BF16;
            gj_scope_push();
            gj_tensor *lp[2] = {0}, *hi[2] = {0};
            for (int i = 0; i < ops[o].n; i++) {
                const int64_t *sh = i == 0 ? ops[o].s0 : ops[o].s1;
                bool pos = i == 1 && ops[o].pos1;
                gj_tensor *x64 = gjt_uniform(&r, GJ_F64, 2, sh, pos ? 0.5 : -2, 2);
                lp[i] = gj_cast(x64, dt);
                hi[i] = lp[i] ? gj_cast(lp[i], GJ_F64) : NULL; /* the rounded values in f64 */
            }
            gj_tensor *want = ops[o].fn(hi), *got = ops[o].fn(lp);
            char nm[96];
            snprintf(nm, sizeof nm, "%s %s vs f64", ops[o].name, dt == GJ_F32 ? "f32" : "bf16");
            if (!want || !got) {
                fprintf(stderr, "  %s: NULL (%s)\n", nm, gj_last_error());
                nfail++;
            } else if (gj_tensor_dtype(got) != dt ||
                       !gjt_shape_is(got, gj_tensor_ndim(want), gj_tensor_shape(want))) {
                fprintf(stderr, "  %s: wrong dtype or shape of the result\n", nm);
                nfail++;
            } else {
                double *wv = gjt_values(want);
                /* f32: math error only; bf16: one rounding of the result
                 * (half an ulp = 2^-9 relative) plus f32 math error */
                double rtol = dt == GJ_F32 ? 1e-5 : 1.0 / 256.0;
                double atol = dt == GJ_F32 ? 1e-5 : 1e-4;
                if (!gjt_tensor_close(nm, got, wv, atol, rtol))
                    nfail++;
                free(wv);
            }
            gj_scope_pop();
        }
    }
    DONE();
}

/* ---------------------------------------------- large shapes (sampled) */

/* Shapes big enough for the kernels' parallel and blocked paths; 12 random
 * elements of each leaf are checked by finite differences. */
static void test_large_shapes(void **s) {
    int nfail = 0;
    bin_ctx add = {gj_add}, mul = {gj_mul}, dv = {gj_div};
    un_ctx gelu = {gj_gelu}, ex = {gj_exp};
    red_ctx s0 = {1, {0}, false, false}, s1k = {1, {1}, true, false}, mall = {0, {0}, false, true};
    max_ctx m1 = {1, false};
    sm_ctx sm1 = {1, false}, sm0 = {0, false}, lsm1 = {1, true};
    cat_ctx c21 = {2, 1};
#define LG(...) CHECK({__VA_ARGS__, .sample = 12})
    LG(.name = "large add [300,70]T + [70]", .fn = f_bin, .ctx = &add, .n_in = 2,
       .in = {{SH(300, 70), .view = GJT_TRANSPOSED}, {SH(70)}});
    LG(.name = "large mul [300,70] * [300,1]", .fn = f_bin, .ctx = &mul, .n_in = 2,
       .in = {{SH(300, 70)}, {SH(300, 1)}});
    LG(.name = "large div [129,257]N / [129,257]", .fn = f_bin, .ctx = &dv, .n_in = 2,
       .in = {{SH(129, 257), .view = GJT_NARROWED}, {SH(129, 257), .lo = 0.5, .hi = 2}});
    LG(.name = "large gelu [257,129] narrowed", .fn = f_un, .ctx = &gelu, .n_in = 1,
       .in = {{SH(257, 129), .view = GJT_NARROWED, .lo = -3, .hi = 3}});
    LG(.name = "large exp [64,1000] expanded", .fn = f_un, .ctx = &ex, .n_in = 1,
       .in = {{SH(64, 1000), .view = GJT_EXPANDED}});
    LG(.name = "large sum axis 0 [300,70]", .fn = f_reduce, .ctx = &s0, .n_in = 1,
       .in = {{SH(300, 70)}});
    LG(.name = "large sum axis 1 keepdim [70,300]T", .fn = f_reduce, .ctx = &s1k, .n_in = 1,
       .in = {{SH(70, 300), .view = GJT_TRANSPOSED}});
    LG(.name = "large mean all [200,100]", .fn = f_reduce, .ctx = &mall, .n_in = 1,
       .in = {{SH(200, 100)}});
    LG(.name = "large max axis 1 [64,300]", .fn = f_max, .ctx = &m1, .n_in = 1,
       .in = {{SH(64, 300), .distinct = true}});
    LG(.name = "large softmax axis 1 [40,300]", .fn = f_softmax, .ctx = &sm1, .n_in = 1,
       .in = {{SH(40, 300), .lo = -3, .hi = 3}});
    LG(.name = "large softmax axis 0 [300,40]", .fn = f_softmax, .ctx = &sm0, .n_in = 1,
       .in = {{SH(300, 40), .lo = -3, .hi = 3}});
    LG(.name = "large log_softmax [64,257]T", .fn = f_softmax, .ctx = &lsm1, .n_in = 1,
       .in = {{SH(64, 257), .lo = -3, .hi = 3, .view = GJT_TRANSPOSED}});
    LG(.name = "large layer_norm [64,200]", .fn = f_ln_wb, .n_in = 3,
       .in = {{SH(64, 200), .lo = -2, .hi = 2}, {SH(200)}, {SH(200)}});
    LG(.name = "large matmul [70,90]x[90,40]", .fn = f_matmul, .n_in = 2,
       .in = {{SH(70, 90)}, {SH(90, 40)}});
    LG(.name = "large matmul [4,33,65]T x [65,17]N", .fn = f_matmul, .n_in = 2,
       .in = {{SH(4, 33, 65), .view = GJT_TRANSPOSED}, {SH(65, 17), .view = GJT_NARROWED}});
    LG(.name = "large linear [64,96] [80,96] [80]", .fn = f_linear_b, .n_in = 3,
       .in = {{SH(64, 96)}, {SH(80, 96)}, {SH(80)}});
    LG(.name = "large cat axis 1 [100,50] [100,70]T", .fn = f_cat, .ctx = &c21, .n_in = 2,
       .in = {{SH(100, 50)}, {SH(100, 70), .view = GJT_TRANSPOSED}});
    drop_ctx dp = {0.3};
    LG(.name = "large dropout [200,100]", .fn = f_dropout, .ctx = &dp, .n_in = 1,
       .in = {{SH(200, 100)}}, .reseed = true, .rng_seed = 31);
    gjt_rng r;
    gjt_rng_seed(&r, 8);
    ce_ctx ce = {gjt_labels(&r, 1, (int64_t[]){128}, 50)};
    emb_ctx em = {gjt_labels(&r, 1, (int64_t[]){300}, 500)};
    assert_non_null(ce.labels);
    assert_non_null(em.idx);
    LG(.name = "large cross_entropy [128,50]", .fn = f_ce, .ctx = &ce, .n_in = 1,
       .in = {{SH(128, 50), .lo = -3, .hi = 3}});
    LG(.name = "large embedding [500,16] idx[300]", .fn = f_emb, .ctx = &em, .n_in = 1,
       .in = {{SH(500, 16)}});
#undef LG
    gj_release(ce.labels);
    gj_release(em.idx);
    DONE();
}

/* ------------------------------------ f32 / bf16 backward vs f64 backward */

/* x is input 0 (constant), then w1, b1, w2, b2. */
static gj_tensor *f_mlp_in(gj_tensor **in, void *ctx) {
    mlp_ctx c = {in[0], ((mlp_ctx *)ctx)->labels};
    return f_mlp(in + 1, &c);
}

static void run_lowp_backward(gj_dtype dt, double atol, double rtol, int *nfailp) {
    int nfail = 0;
    bin_ctx add = {gj_add}, sub = {gj_sub}, mul = {gj_mul}, dv = {gj_div};
    un_ctx ops[] = {{gj_neg}, {gj_exp}, {gj_tanh}, {gj_sigmoid}, {gj_relu}, {gj_gelu}};
    const char *opn[] = {"neg", "exp", "tanh", "sigmoid", "relu", "gelu"};
    un_ctx lg = {gj_log}, sq = {gj_sqrt};
    scal_ctx p2 = {2.0}, pm1 = {-1.0};
    red_ctx s0 = {1, {0}, false, false}, m02 = {2, {0, 2}, true, true};
    max_ctx mx = {1, false};
    sm_ctx sm = {1, false}, lsm = {2, true};
    cat_ctx c3 = {3, 1};
    char nm[96];
    const char *dn = dt == GJ_F32 ? "f32" : "bf16";
#define LP(...)                                                                            \
    do {                                                                                   \
        gjt_check c_ = {__VA_ARGS__};                                                      \
        snprintf(nm, sizeof nm, "%s (%s)", c_.name, dn);                                   \
        c_.name = nm;                                                                      \
        if (gjt_gradcompare(&c_, dt, atol, rtol) != 0)                                     \
            nfail++;                                                                       \
    } while (0)
    LP(.name = "add bcast", .fn = f_bin, .ctx = &add, .n_in = 2, .in = {{SH(8, 33)}, {SH(33)}});
    LP(.name = "sub", .fn = f_bin, .ctx = &sub, .n_in = 2,
       .in = {{SH(8, 33), .view = GJT_TRANSPOSED}, {SH(8, 1)}});
    LP(.name = "mul", .fn = f_bin, .ctx = &mul, .n_in = 2,
       .in = {{SH(300, 70)}, {SH(300, 70), .view = GJT_NARROWED}});
    LP(.name = "div", .fn = f_bin, .ctx = &dv, .n_in = 2,
       .in = {{SH(8, 33)}, {SH(8, 33), .lo = 0.5, .hi = 2}});
    for (int i = 0; i < 6; i++)
        LP(.name = opn[i], .fn = f_un, .ctx = &ops[i], .n_in = 1,
           .in = {{SH(37, 65), .lo = -3, .hi = 3, .min_abs = 0.05}});
    LP(.name = "log", .fn = f_un, .ctx = &lg, .n_in = 1, .in = {{SH(8, 33), .lo = 0.5, .hi = 2}});
    LP(.name = "sqrt", .fn = f_un, .ctx = &sq, .n_in = 1, .in = {{SH(8, 33), .lo = 0.5, .hi = 2}});
    LP(.name = "pow 2", .fn = f_pow, .ctx = &p2, .n_in = 1, .in = {{SH(8, 33), .lo = 0.5, .hi = 2}});
    LP(.name = "pow -1", .fn = f_pow, .ctx = &pm1, .n_in = 1,
       .in = {{SH(8, 33), .lo = 0.5, .hi = 2}});
    LP(.name = "sum axis 0", .fn = f_reduce, .ctx = &s0, .n_in = 1, .in = {{SH(300, 70)}});
    LP(.name = "mean axes 0,2", .fn = f_reduce, .ctx = &m02, .n_in = 1, .in = {{SH(4, 9, 17)}});
    LP(.name = "max axis 1", .fn = f_max, .ctx = &mx, .n_in = 1,
       .in = {{SH(8, 33), .distinct = true}});
    LP(.name = "matmul", .fn = f_matmul, .n_in = 2,
       .in = {{SH(2, 17, 33), .view = GJT_TRANSPOSED}, {SH(33, 9)}});
    LP(.name = "linear", .fn = f_linear_b, .n_in = 3, .in = {{SH(16, 40)}, {SH(24, 40)}, {SH(24)}});
    LP(.name = "softmax", .fn = f_softmax, .ctx = &sm, .n_in = 1,
       .in = {{SH(8, 33), .lo = -3, .hi = 3}});
    LP(.name = "log_softmax", .fn = f_softmax, .ctx = &lsm, .n_in = 1,
       .in = {{SH(2, 8, 33), .lo = -3, .hi = 3}});
    LP(.name = "layer_norm", .fn = f_ln_wb, .n_in = 3,
       .in = {{SH(8, 64), .lo = -2, .hi = 2}, {SH(64)}, {SH(64)}});
    LP(.name = "cat", .fn = f_cat, .ctx = &c3, .n_in = 3,
       .in = {{SH(4, 3)}, {SH(4, 5), .view = GJT_TRANSPOSED}, {SH(4, 1)}});
    gjt_rng r;
    gjt_rng_seed(&r, 9);
    ce_ctx ce = {gjt_labels(&r, 1, (int64_t[]){16}, 10)};
    emb_ctx em = {gjt_labels(&r, 2, (int64_t[]){4, 5}, 7)};
    mlp_ctx mc = {NULL, gjt_labels(&r, 1, (int64_t[]){8}, 5)};
    mf_ctx mf = {causal_mask(GJ_I64, 6), -1e9, true};
    where_ctx wc = {gjt_i64(2, (int64_t[]){1, 6}, (int64_t[]){1, 0, 0, 1, 1, 0})};
    LP(.name = "cross_entropy", .fn = f_ce, .ctx = &ce, .n_in = 1,
       .in = {{SH(16, 10), .lo = -3, .hi = 3}});
    LP(.name = "embedding", .fn = f_emb, .ctx = &em, .n_in = 1, .in = {{SH(7, 12)}});
    LP(.name = "masked_fill + softmax", .fn = f_masked_fill, .ctx = &mf, .n_in = 1,
       .in = {{SH(3, 6, 6), .lo = -2, .hi = 2}});
    LP(.name = "where", .fn = f_where, .ctx = &wc, .n_in = 2, .in = {{SH(5, 6)}, {SH(6)}});
    LP(.name = "MLP + CE", .fn = f_mlp_in, .ctx = &mc, .n_in = 5,
       .in = {{SH(8, 12), .constant = true}, {SH(16, 12)}, {SH(16)}, {SH(5, 16)}, {SH(5)}});
#undef LP
    gj_release(ce.labels);
    gj_release(em.idx);
    gj_release(mc.labels);
    gj_release(mf.mask);
    gj_release(wc.cond);
    *nfailp = nfail;
}

static void test_f32_backward_vs_f64(void **s) {
    int nfail;
    run_lowp_backward(GJ_F32, 1e-5, 1e-4, &nfail);
    DONE();
}

/* bf16: storage rounding of every intermediate (2^-9 relative) */
static void test_bf16_backward_vs_f64(void **s) {
    int nfail;
    run_lowp_backward(GJ_BF16, 3e-2, 3e-2, &nfail);
    DONE();
}

/* ------------------------------------------- partial requires_grad */

/* One input constant (no requires_grad): the others' gradients are still right. */
static void test_partial_requires_grad(void **s) {
    int nfail = 0;
    bin_ctx mul = {gj_mul}, dv = {gj_div};
    CHECK({.name = "mul, b constant", .fn = f_bin, .ctx = &mul, .n_in = 2,
           .in = {{SH(3, 4)}, {SH(4), .constant = true}}});
    CHECK({.name = "mul, a constant", .fn = f_bin, .ctx = &mul, .n_in = 2,
           .in = {{SH(3, 4), .constant = true}, {SH(3, 1)}}});
    CHECK({.name = "div, numerator constant", .fn = f_bin, .ctx = &dv, .n_in = 2,
           .in = {{SH(3, 4), .constant = true}, {SH(3, 4), .lo = 0.5, .hi = 2}}});
    CHECK({.name = "matmul, a constant", .fn = f_matmul, .n_in = 2,
           .in = {{SH(2, 3, 4), .constant = true}, {SH(4, 5)}}});
    CHECK({.name = "matmul, b constant", .fn = f_matmul, .n_in = 2,
           .in = {{SH(3, 4)}, {SH(2, 4, 5), .constant = true}}});
    CHECK({.name = "linear, x constant", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(3, 4), .constant = true}, {SH(5, 4)}, {SH(5)}}});
    CHECK({.name = "linear, w and b constant", .fn = f_linear_b, .n_in = 3,
           .in = {{SH(3, 4)}, {SH(5, 4), .constant = true}, {SH(5), .constant = true}}});
    CHECK({.name = "layer_norm, x constant", .fn = f_ln_wb, .n_in = 3,
           .in = {{SH(3, 5), .constant = true}, {SH(5)}, {SH(5)}}});
    CHECK({.name = "layer_norm, w b constant", .fn = f_ln_wb, .n_in = 3,
           .in = {{SH(3, 5)}, {SH(5), .constant = true}, {SH(5), .constant = true}}});
    cat_ctx c3 = {3, 0};
    CHECK({.name = "cat, middle constant", .fn = f_cat, .ctx = &c3, .n_in = 3,
           .in = {{SH(2, 3)}, {SH(1, 3), .constant = true}, {SH(2, 3)}}});
    gj_tensor *cond = gjt_i64(1, (int64_t[]){4}, (int64_t[]){1, 0, 0, 1});
    where_ctx w = {cond};
    CHECK({.name = "where, b constant", .fn = f_where, .ctx = &w, .n_in = 2,
           .in = {{SH(3, 4)}, {SH(3, 4), .constant = true}}});
    gj_release(cond);
    DONE();
}

/* ------------------------------------------------------ extreme values */

/* Forward values and gradients at extreme inputs: finite where the math is. */
static void test_extreme_values(void **s) {
    int nfail = 0;
    gj_scope_push();
    const double xv[] = {-1e4, -100.0, -30.0, 30.0, 100.0, 1e4};
    const int64_t sh[] = {6};
    struct {
        const char *name;
        unop_fn fn;
        double want[6], dwant[6];
    } cases[] = {
        {"sigmoid", gj_sigmoid, {0, 0, 9.357622968840175e-14, 1, 1, 1},
         {0, 3.720075976020836e-44, 9.357622968839299e-14, 9.357622968839299e-14,
          3.720075976020836e-44, 0}},
        {"tanh", gj_tanh, {-1, -1, -1, 1, 1, 1}, {0, 0, 0, 0, 0, 0}},
        {"gelu", gj_gelu, {0, 0, 0, 30, 100, 1e4}, {0, 0, 0, 1, 1, 1}},
        {"relu", gj_relu, {0, 0, 0, 30, 100, 1e4}, {0, 0, 0, 1, 1, 1}},
    };
    for (int c = 0; c < 4; c++) {
        gj_tensor *x = gj_scope_keep(gjt_tensor(GJ_F64, 1, sh, xv));
        assert_int_equal(gj_set_requires_grad(x, true), 0);
        gj_tensor *y = cases[c].fn(x);
        char nm[64];
        snprintf(nm, sizeof nm, "%s forward at extremes", cases[c].name);
        fwd_check(&nfail, nm, y, 1, sh, cases[c].want, 1e-12);
        if (y && gjt_backward(gj_sum(y, 0, NULL, false), NULL, false) == 0) {
            snprintf(nm, sizeof nm, "%s gradient at extremes", cases[c].name);
            if (!gjt_tensor_close(nm, gj_tensor_grad(x), cases[c].dwant, 1e-12, 1e-6))
                nfail++;
        } else {
            fprintf(stderr, "  %s: backward failed: %s\n", cases[c].name, gj_last_error());
            nfail++;
        }
        gj_release(x);
    }
    /* the same in f32 (overflow of intermediate terms like x^3 or exp(-x)) */
    for (int c = 0; c < 4; c++) {
        gj_tensor *x = gj_scope_keep(gjt_tensor(GJ_F32, 1, sh, xv));
        assert_int_equal(gj_set_requires_grad(x, true), 0);
        gj_tensor *y = cases[c].fn(x);
        char nm[64];
        snprintf(nm, sizeof nm, "%s f32 forward at extremes", cases[c].name);
        fwd_check(&nfail, nm, y, 1, sh, cases[c].want, 1e-6);
        if (y && gjt_backward(gj_sum(y, 0, NULL, false), NULL, false) == 0) {
            snprintf(nm, sizeof nm, "%s f32 gradient at extremes", cases[c].name);
            if (!gjt_tensor_close(nm, gj_tensor_grad(x), cases[c].dwant, 1e-6, 1e-5))
                nfail++;
        } else {
            nfail++;
        }
        gj_release(x);
    }
    /* f32 at +-1e20: terms like x^3 overflow to inf; results must stay finite */
    const double hv[] = {-1e20, 1e20};
    struct {
        const char *name;
        unop_fn fn;
        double want[2], dwant[2];
    } huge[] = {
        {"gelu", gj_gelu, {0, 1e20}, {0, 1}},
        {"sigmoid", gj_sigmoid, {0, 1}, {0, 0}},
        {"tanh", gj_tanh, {-1, 1}, {0, 0}},
    };
    for (int c = 0; c < 3; c++) {
        gj_tensor *x = gj_scope_keep(gjt_tensor(GJ_F32, 1, (int64_t[]){2}, hv));
        assert_int_equal(gj_set_requires_grad(x, true), 0);
        gj_tensor *y = huge[c].fn(x);
        char nm[64];
        snprintf(nm, sizeof nm, "%s f32 forward at +-1e20", huge[c].name);
        fwd_check(&nfail, nm, y, 1, (int64_t[]){2}, huge[c].want, 1e-6);
        if (y && gjt_backward(gj_sum(y, 0, NULL, false), NULL, false) == 0) {
            snprintf(nm, sizeof nm, "%s f32 gradient at +-1e20", huge[c].name);
            if (!gjt_tensor_close(nm, gj_tensor_grad(x), huge[c].dwant, 1e-6, 1e-6))
                nfail++;
        } else {
            nfail++;
        }
        gj_release(x);
    }
    /* softmax / log_softmax / cross_entropy with huge logits stay finite */
    gj_tensor *big = gjt_tensor(GJ_F64, 2, (int64_t[]){1, 2}, (double[]){1000.0, -1000.0});
    fwd_check(&nfail, "log_softmax [1000, -1000]", gj_log_softmax(big, 1), 2, (int64_t[]){1, 2},
              (double[]){0.0, -2000.0}, 1e-9);
    gj_tensor *lab1 = gjt_i64(1, (int64_t[]){1}, (int64_t[]){1});
    fwd_check(&nfail, "cross_entropy of [1000, -1000], label 1", gj_cross_entropy(big, lab1), 0,
              NULL, (double[]){2000.0}, 1e-9);
    /* masked attention rows with -inf: masked entries get 0 probability and 0 gradient */
    gj_tensor *x = gj_scope_keep(gjt_tensor(GJ_F32, 2, (int64_t[]){2, 3},
                                            (double[]){0.5, -0.25, 1.0, 2.0, 0.0, -1.0}));
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_tensor *mask = causal_mask(GJ_I64, 3);
    gj_tensor *m2 = gj_narrow(mask, 0, 1, 2); /* rows 1,2 of the causal mask: [0,0,1],[0,0,0] */
    gj_tensor *p = gj_softmax(gj_masked_fill(x, m2, -INFINITY), 1);
    double e0 = exp(0.5), e1 = exp(-0.25), z0 = e0 + e1;
    double e3 = exp(2.0), e4 = exp(0.0), e5 = exp(-1.0), z1 = e3 + e4 + e5;
    double pw[6] = {e0 / z0, e1 / z0, 0, e3 / z1, e4 / z1, e5 / z1};
    fwd_check(&nfail, "softmax with -inf entries", p, 2, (int64_t[]){2, 3}, pw, 1e-6);
    gj_tensor *R = gjt_tensor(GJ_F32, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, -1, 0.5, 2});
    if (p && gjt_backward(gj_sum(gj_mul(p, R), 0, NULL, false), NULL, false) == 0) {
        double gw[6];
        double Rv[6] = {1, 2, 3, -1, 0.5, 2};
        for (int r = 0; r < 2; r++) {
            double dot = 0;
            for (int k = 0; k < 3; k++)
                dot += pw[r * 3 + k] * Rv[r * 3 + k];
            for (int k = 0; k < 3; k++)
                gw[r * 3 + k] = pw[r * 3 + k] * (Rv[r * 3 + k] - dot);
        }
        if (!gjt_tensor_close("softmax with -inf: gradient", gj_tensor_grad(x), gw, 1e-6, 1e-5))
            nfail++;
    } else {
        fprintf(stderr, "  softmax with -inf: backward failed: %s\n", gj_last_error());
        nfail++;
    }
    gj_release(x);
    gj_release(mask);
    /* layer_norm of a constant row: zeros, finite gradient */
    gj_tensor *cst = gj_scope_keep(gj_full(GJ_F64, 2, (int64_t[]){2, 4}, 3.0));
    assert_int_equal(gj_set_requires_grad(cst, true), 0);
    gj_tensor *ln = gj_layer_norm(cst, NULL, NULL, 1e-5);
    fwd_check(&nfail, "layer_norm of a constant row", ln, 2, (int64_t[]){2, 4},
              (double[]){0, 0, 0, 0, 0, 0, 0, 0}, 0);
    gj_tensor *R2 = gjt_tensor(GJ_F64, 2, (int64_t[]){2, 4}, (double[]){1, -2, 3, 0, 1, 1, 1, 1});
    if (ln && gjt_backward(gj_sum(gj_mul(ln, R2), 0, NULL, false), NULL, false) == 0) {
        /* dL/dx = rstd * (R - mean(R)) (the xhat terms vanish), rstd = 1/sqrt(eps) */
        double rs = 1.0 / sqrt(1e-5);
        double gw[8] = {rs * (1 - 0.5), rs * (-2 - 0.5), rs * (3 - 0.5), rs * (0 - 0.5), 0, 0, 0, 0};
        if (!gjt_tensor_close("layer_norm constant row: gradient", gj_tensor_grad(cst), gw, 1e-6,
                              1e-9))
            nfail++;
    } else {
        fprintf(stderr, "  layer_norm constant row: backward failed: %s\n", gj_last_error());
        nfail++;
    }
    gj_release(cst);
    gj_scope_pop();
    DONE();
}

/* f32 reductions over many elements are accurate (blocked / pairwise
 * accumulation): 2^20 values of 0.1 sum to 104857.6. */
static void test_f32_reduction_accuracy(void **s) {
    int nfail = 0;
    gj_scope_push();
    const int64_t n = 1 << 20;
    gj_tensor *x = gj_full(GJ_F32, 1, &n, 0.1);
    double want = 0.1f * (double)n; /* the f32 value of 0.1, summed exactly */
    gj_tensor *sm = gj_sum(x, 0, NULL, false);
    gj_tensor *mn = gj_mean(x, 0, NULL, false);
    double wmean = (double)0.1f;
    if (!sm || !(fabs(gj_tensor_item(sm) - want) <= 1e-4 * want)) {
        fprintf(stderr, "  f32 sum of 2^20 x 0.1: got %.9g want %.9g\n",
                sm ? gj_tensor_item(sm) : NAN, want);
        nfail++;
    }
    if (!mn || !(fabs(gj_tensor_item(mn) - wmean) <= 1e-4 * wmean)) {
        fprintf(stderr, "  f32 mean of 2^20 x 0.1: got %.9g want %.9g\n",
                mn ? gj_tensor_item(mn) : NAN, wmean);
        nfail++;
    }
    /* a long row: softmax sums to 1, layer_norm of a shifted ramp is exact enough */
    const int64_t row[] = {1, 1 << 16};
    gj_tensor *z = gj_zeros(GJ_F32, 2, row);
    gj_tensor *sz = gj_sum(gj_softmax(z, 1), 0, NULL, false);
    if (!sz || !(fabs(gj_tensor_item(sz) - 1.0) <= 1e-4)) {
        fprintf(stderr, "  f32 softmax over 65536: sum %.9g\n", sz ? gj_tensor_item(sz) : NAN);
        nfail++;
    }
    gj_scope_pop();
    DONE();
}

/* One thread and two threads agree on forward values and gradients. */
static void test_threads_agree(void **s) {
    int nfail = 0;
    int nt0 = gj_get_num_threads();
    double *res[2][3] = {{0}};
    for (int pass = 0; pass < 2; pass++) {
        gj_set_num_threads(pass == 0 ? 1 : 2);
        gjt_rng r;
        gjt_rng_seed(&r, 44);
        gj_scope_push();
        gj_tensor *a = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){256, 300}, -1, 1);
        gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){200, 300}, -1, 1);
        gj_set_requires_grad(a, true);
        gj_set_requires_grad(w, true);
        gj_tensor *h = gj_gelu(gj_linear(a, w, NULL));
        gj_tensor *p = gj_softmax(gj_layer_norm(h, NULL, NULL, 1e-5), 1);
        gj_tensor *L = gj_sum(gj_mul(p, gj_tanh(h)), 0, NULL, false);
        assert_non_null(L);
        assert_int_equal(gjt_backward(L, NULL, false), 0);
        res[pass][0] = gjt_values(p);
        res[pass][1] = gjt_values(gj_tensor_grad(a));
        res[pass][2] = gjt_values(gj_tensor_grad(w));
        gj_scope_pop();
    }
    gj_set_num_threads(nt0);
    const int64_t ns[3] = {256 * 200, 256 * 300, 200 * 300};
    const char *what[3] = {"forward 1 vs 2 threads", "grad a 1 vs 2 threads",
                           "grad w 1 vs 2 threads"};
    for (int k = 0; k < 3; k++) {
        assert_non_null(res[0][k]);
        assert_non_null(res[1][k]);
        if (!gjt_allclose(what[k], res[1][k], res[0][k], ns[k], 1e-5, 1e-4))
            nfail++;
        free(res[0][k]);
        free(res[1][k]);
    }
    DONE();
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add),
        cmocka_unit_test(test_sub),
        cmocka_unit_test(test_mul),
        cmocka_unit_test(test_div),
        cmocka_unit_test(test_neg),
        cmocka_unit_test(test_exp),
        cmocka_unit_test(test_log),
        cmocka_unit_test(test_tanh),
        cmocka_unit_test(test_sigmoid),
        cmocka_unit_test(test_relu),
        cmocka_unit_test(test_gelu),
        cmocka_unit_test(test_sqrt),
        cmocka_unit_test(test_pow_scalar),
        cmocka_unit_test(test_add_mul_scalar),
        cmocka_unit_test(test_sum),
        cmocka_unit_test(test_mean),
        cmocka_unit_test(test_max),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_autocast),
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_transpose_permute),
        cmocka_unit_test(test_reshape_view),
        cmocka_unit_test(test_expand),
        cmocka_unit_test(test_narrow),
        cmocka_unit_test(test_cat),
        cmocka_unit_test(test_contiguous),
        cmocka_unit_test(test_softmax),
        cmocka_unit_test(test_log_softmax),
        cmocka_unit_test(test_layer_norm),
        cmocka_unit_test(test_cross_entropy),
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_dropout_grad),
        cmocka_unit_test(test_dropout_mask),
        cmocka_unit_test(test_where_masked_fill),
        cmocka_unit_test(test_cast),
        cmocka_unit_test(test_composed),
        cmocka_unit_test(test_forward_elementwise),
        cmocka_unit_test(test_forward_reductions),
        cmocka_unit_test(test_forward_linalg_shape),
        cmocka_unit_test(test_forward_nn),
        cmocka_unit_test(test_lowp_forward),
        cmocka_unit_test(test_large_shapes),
        cmocka_unit_test(test_f32_backward_vs_f64),
        cmocka_unit_test(test_bf16_backward_vs_f64),
        cmocka_unit_test(test_partial_requires_grad),
        cmocka_unit_test(test_extreme_values),
        cmocka_unit_test(test_f32_reduction_accuracy),
        cmocka_unit_test(test_threads_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
