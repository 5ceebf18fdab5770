/* SPDX-License-Identifier: MIT */
/*
 * test_jit_fuzz.c - differential test of compiled autograd: random small
 * models built from the public ops (elementwise with broadcasting,
 * reductions, max, views, narrow/cat, expand, matmul, linear, softmax,
 * log-softmax, layer norm, cross-entropy, embedding, where, masked fill,
 * casts, dropout), whose backward runs once eagerly and once compiled.
 * Every graph must compile (no fallback: every primitive has a lowering)
 * and every leaf's .grad must agree with eager's within rtol times the
 * largest |eager| entry of that .grad:
 *     f64 1e-12, f32 1e-6, bf16 2^-7 (one bf16 rounding step).
 * The compiled path follows the eager kernels' numerics (double
 * accumulation, the same lane order; see autograd/decompose.c); what is
 * left is the order inside BLAS for differently laid-out operands and
 * the GEMM that accumulates into an existing .grad (beta = 1).
 *
 * Each model is a pure function of its seed, so a failure prints the seed
 * and the op sequence. Odd seeds start with existing .grad buffers on some
 * leaves (the in-place accumulation path); seeds divisible by 5 run the
 * backward twice with retain_graph (accumulating). The default run checks
 * 2,000 graphs from fixed seeds (400 under AddressSanitizer);
 * GJT_FUZZ_SEED=n reproduces one seed alone (for every dtype, or only
 * GJT_FUZZ_DTYPE=f32|f64|bf16); GJT_FUZZ_COUNT=n runs n seeds per dtype.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__SANITIZE_ADDRESS__)
#define FUZZ_SCALE 5 /* a fifth of the graphs under ASan */
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_SCALE 5
#endif
#endif
#ifndef FUZZ_SCALE
#define FUZZ_SCALE 1
#endif

#define MAXT 48
#define NLEAF 7

typedef struct fuzz {
    gjt_rng rng;
    gj_dtype dt;
    gj_tensor *leaves[NLEAF]; /* [R,C], [R,C], [R,1], [C], [C], table [V,C], weight [C,C] */
    int n_leaves;
    gj_tensor *pool[MAXT]; /* borrowed from the scope */
    int n;
    char log[2048];
    int64_t R, C;
    gj_tensor *idx, *labels, *mask; /* i64 [R] in [0, V), i64 [R] in [0, C), dt [R, C] */
} fuzz;

enum { FUZZ_V = 4 };

static void note(fuzz *f, const char *s) {
    size_t l = strlen(f->log);
    snprintf(f->log + l, sizeof f->log - l, "%s ", s);
}

static gj_tensor *pick(fuzz *f) { return f->pool[gjt_rng_int(&f->rng, f->n)]; }

static void push(fuzz *f, gj_tensor *t, const char *what) {
    if (!t) {
        print_error("op %s failed: %s\n", what, gj_last_error());
        fail();
    }
    note(f, what);
    if (f->n < MAXT) f->pool[f->n++] = t;
}

/* A tensor of f's pool with exactly this shape, or NULL. */
static gj_tensor *pick_shape(fuzz *f, int nd, const int64_t *shape) {
    int start = (int)gjt_rng_int(&f->rng, f->n);
    for (int k = 0; k < f->n; k++) {
        gj_tensor *t = f->pool[(start + k) % f->n];
        if (gjt_shape_is(t, nd, shape)) return t;
    }
    return NULL;
}

/* One random op on the pool. */
static void fuzz_op(fuzz *f) {
    gj_tensor *x = pick(f);
    int nd = gj_tensor_ndim(x);
    const int64_t *sh = gj_tensor_shape(x);
    int64_t rc[2] = {f->R, f->C};
    bool is_rc = gjt_shape_is(x, 2, rc);
    switch (gjt_rng_int(&f->rng, 26)) {
    case 0: push(f, gj_tanh(x), "tanh"); break;
    case 1: push(f, gj_sigmoid(x), "sigmoid"); break;
    case 2: push(f, gj_gelu(x), "gelu"); break;
    case 3: push(f, gj_exp(gj_tanh(x)), "exp(tanh)"); break;
    case 4: push(f, gj_add_scalar(gj_mul_scalar(x, -1.5), 0.25), "affine"); break;
    case 5: { /* binary: same shape, or broadcast against a row, a column, a bias */
        gj_tensor *y = pick_shape(f, nd, sh);
        if (!y) y = x;
        int64_t r = gjt_rng_int(&f->rng, 4);
        if (nd == 2 && r == 0) y = gj_sum(y, 1, (int[]){(int)gjt_rng_int(&f->rng, 2)}, true);
        else if (nd == 2 && r == 1 && sh[0] == f->R) y = f->leaves[2];
        else if (nd >= 1 && r == 2 && sh[nd - 1] == f->C) y = f->leaves[3];
        switch (gjt_rng_int(&f->rng, 4)) {
        case 0: push(f, gj_add(x, y), "add"); break;
        case 1: push(f, gj_sub(y, x), "sub"); break;
        case 2: push(f, gj_mul(x, y), "mul"); break;
        default: push(f, gj_div(x, gj_add_scalar(gj_sigmoid(y), 0.5)), "div"); break;
        }
        break;
    }
    case 6: { /* reduction */
        int ax = nd > 0 ? (int)gjt_rng_int(&f->rng, nd) : 0;
        bool keep = gjt_rng_int(&f->rng, 2);
        if (nd == 0) push(f, gj_mul_scalar(x, 2.0), "scale");
        else if (gjt_rng_int(&f->rng, 2)) push(f, gj_sum(x, 1, &ax, keep), keep ? "sum_keep" : "sum");
        else push(f, gj_mean(x, 1, &ax, keep), keep ? "mean_keep" : "mean");
        break;
    }
    case 7: /* transpose + elementwise (a strided view) */
        if (nd == 2) push(f, gj_mul(gj_transpose(x, 0, 1), gj_transpose(x, 0, 1)), "transpose_sq");
        else push(f, gj_neg(x), "neg");
        break;
    case 8: { /* matmul with a compatible partner or with a leaf */
        if (nd != 2) {
            push(f, gj_pow_scalar(x, 2.0), "pow2");
            break;
        }
        gj_tensor *y = NULL;
        for (int k = 0; k < f->n && !y; k++) {
            gj_tensor *c = f->pool[k];
            if (gj_tensor_ndim(c) == 2 && gj_tensor_shape(c)[0] == sh[1]) y = c;
        }
        if (y) push(f, gj_matmul(x, y), "matmul");
        else push(f, gj_matmul(x, gj_transpose(x, 0, 1)), "matmul_xxT");
        break;
    }
    case 9:
        if (nd >= 1 && sh[nd - 1] > 1) push(f, gj_softmax(x, -1), "softmax");
        else push(f, gj_sigmoid(x), "sigmoid");
        break;
    case 10:
        if (nd >= 1 && sh[nd - 1] > 1) push(f, gj_log_softmax(x, nd - 1), "log_softmax");
        else push(f, gj_tanh(x), "tanh");
        break;
    case 11:
        if (nd == 2 && sh[1] == f->C) push(f, gj_layer_norm(x, f->leaves[3], f->leaves[4], 1e-5), "layer_norm");
        else if (nd >= 1 && sh[nd - 1] > 1) push(f, gj_layer_norm(x, NULL, NULL, 1e-5), "layer_norm_plain");
        else push(f, gj_exp(gj_neg(gj_mul(x, x))), "gauss");
        break;
    case 12: /* narrow + cat */
        if (nd >= 1 && sh[nd - 1] >= 2) {
            int64_t len = sh[nd - 1] / 2;
            gj_tensor *a = gj_narrow(x, nd - 1, 0, len), *b = gj_narrow(gj_tanh(x), nd - 1, len, sh[nd - 1] - len);
            gj_tensor *parts[2] = {b, a};
            push(f, gj_cat(2, parts, nd - 1), "narrow_cat");
        } else {
            push(f, gj_mul_scalar(x, 0.5), "half");
        }
        break;
    case 13: { /* reshape to flat and back, with a scale in between */
        int64_t ne = gj_tensor_numel(x);
        gj_tensor *flat = gj_mul_scalar(gj_reshape(gj_contiguous(x), 1, &ne), 1.25);
        push(f, gj_reshape(flat, nd, sh), "reshape");
        break;
    }
    case 14: /* dropout: run-time seed/offset */
        push(f, gj_dropout(x, 0.25, true), "dropout");
        break;
    case 15: { /* max over an axis (values) */
        if (nd == 0) {
            push(f, gj_relu(x), "relu");
            break;
        }
        int ax = (int)gjt_rng_int(&f->rng, nd);
        bool keep = gjt_rng_int(&f->rng, 2);
        push(f, gj_max(x, ax, keep), keep ? "max_keep" : "max");
        break;
    }
    case 16: /* embedding rows of the table leaf: [R, C] */
        push(f, gj_mul(gj_embedding(f->leaves[5], f->idx), is_rc ? x : f->leaves[0]), "embedding");
        break;
    case 17: /* cross-entropy of [R, C] logits */
        if (is_rc) push(f, gj_cross_entropy(x, f->labels), "cross_entropy");
        else push(f, gj_sqrt(gj_add_scalar(gj_mul(x, x), 0.25)), "sqrt");
        break;
    case 18: /* linear with the weight leaf [C, C] and the bias leaf [C] */
        if (nd >= 1 && sh[nd - 1] == f->C) push(f, gj_linear(x, f->leaves[6], f->leaves[4]), "linear");
        else push(f, gj_log(gj_add_scalar(gj_sigmoid(x), 0.1)), "log");
        break;
    case 19: /* where with a fixed mask */
        if (is_rc) push(f, gj_where(f->mask, x, gj_tanh(f->leaves[1])), "where");
        else push(f, gj_pow_scalar(x, 3.0), "pow3");
        break;
    case 20: { /* a cast to another float dtype and back */
        gj_dtype other = f->dt == GJ_F64 ? GJ_F32 : GJ_F64;
        push(f, gj_cast(gj_mul_scalar(gj_cast(x, other), 0.75), f->dt), "cast_roundtrip");
        break;
    }
    case 21: /* expand a column (or a scalar) to [R, C] */
        if (nd == 2 && sh[1] == 1 && sh[0] == f->R) push(f, gj_mul(gj_expand(x, 2, rc), f->leaves[0]), "expand");
        else if (nd == 0) push(f, gj_mul(gj_expand(x, 2, rc), f->leaves[1]), "expand_scalar");
        else push(f, gj_relu(x), "relu");
        break;
    case 22: /* permute (2-D) through a view */
        if (is_rc) push(f, gj_view(gj_contiguous(gj_permute(x, (int[]){1, 0})), 2, (int64_t[]){f->C, f->R}), "permute_view");
        else push(f, gj_neg(x), "neg");
        break;
    case 23: /* cat along the first axis with a leaf, then narrow back */
        if (is_rc) {
            gj_tensor *parts[2] = {x, f->leaves[1]};
            push(f, gj_narrow(gj_tanh(gj_cat(2, parts, 0)), 0, 1, f->R), "cat0_narrow");
        } else {
            push(f, gj_sigmoid(x), "sigmoid");
        }
        break;
    default: { /* masked fill with a fixed pattern */
        if (!is_rc) {
            push(f, gj_relu(x), "relu");
            break;
        }
        push(f, gj_masked_fill(x, f->mask, -0.5), "masked_fill");
        break;
    }
    }
}

static gj_tensor *fuzz_loss(fuzz *f) {
    gj_tensor *loss = NULL;
    for (int k = f->n - 1; k >= 0 && k >= f->n - 3; k--) {
        gj_tensor *t = f->pool[k];
        gj_tensor *s = gj_sum(gj_mul(t, gj_tanh(t)), 0, NULL, false);
        loss = loss ? gj_add(loss, s) : s;
    }
    return loss;
}

/* The leaves and fixed data of seed's model (same values for the same seed). */
static void build_leaves(fuzz *f, uint64_t seed, gj_dtype dt) {
    memset(f, 0, sizeof *f);
    gjt_rng_seed(&f->rng, seed);
    f->dt = dt;
    f->R = 2 + gjt_rng_int(&f->rng, 4);
    f->C = 2 + gjt_rng_int(&f->rng, 5);
    int64_t rc[2] = {f->R, f->C}, c1[1] = {f->C}, r1[2] = {f->R, 1}, vc[2] = {FUZZ_V, f->C},
            cc[2] = {f->C, f->C}, rr[1] = {f->R};
    f->leaves[0] = gjt_uniform(&f->rng, dt, 2, rc, -1, 1);
    f->leaves[1] = gjt_uniform(&f->rng, dt, 2, rc, -1, 1);
    f->leaves[2] = gjt_uniform(&f->rng, dt, 2, r1, -1, 1);
    f->leaves[3] = gjt_uniform(&f->rng, dt, 1, c1, 0.5, 1.5);
    f->leaves[4] = gjt_uniform(&f->rng, dt, 1, c1, -0.5, 0.5);
    f->leaves[5] = gjt_uniform(&f->rng, dt, 2, vc, -1, 1);
    f->leaves[6] = gjt_uniform(&f->rng, dt, 2, cc, -0.7, 0.7);
    f->n_leaves = NLEAF;
    for (int i = 0; i < f->n_leaves; i++) {
        assert_non_null(f->leaves[i]);
        assert_int_equal(gj_set_requires_grad(f->leaves[i], true), 0);
    }
    f->idx = gjt_labels(&f->rng, 1, rr, FUZZ_V);
    f->labels = gjt_labels(&f->rng, 1, rr, f->C);
    double mk[64];
    for (int i = 0; i < f->R * f->C; i++) mk[i] = (i % 3) == 0;
    f->mask = gjt_tensor(dt, 2, rc, mk);
    assert_true(f->idx && f->labels && f->mask);
}

static void free_leaves(fuzz *f) {
    for (int i = 0; i < f->n_leaves; i++) gj_release(f->leaves[i]);
    gj_release(f->idx);
    gj_release(f->labels);
    gj_release(f->mask);
}

/* Builds the model of seed (same ops for the same seed), runs its backward
 * (twice with retain_graph for seeds divisible by 5) and returns the .grad
 * values of each leaf (malloc'd, NULL for no grad); numel[i] their sizes. */
static double **run_model(uint64_t seed, gj_dtype dt, bool compiled, char *log, size_t logcap,
                          int64_t *numel) {
    fuzz f;
    build_leaves(&f, seed, dt);
    if (seed & 1) { /* existing .grad buffers: accumulated into (in place) */
        for (int i = 0; i < f.n_leaves; i += 3) {
            gj_tensor *g0 = gj_full(dt, gj_tensor_ndim(f.leaves[i]), gj_tensor_shape(f.leaves[i]),
                                    0.5 + i);
            assert_int_equal(gj_tensor_set_grad(f.leaves[i], g0), 0);
            gj_release(g0);
        }
    }
    gj_manual_seed(seed); /* the same dropout masks in both modes */
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    for (int i = 0; i < f.n_leaves; i++) f.pool[f.n++] = f.leaves[i];
    int ops = 4 + (int)gjt_rng_int(&f.rng, 9);
    for (int k = 0; k < ops; k++) fuzz_op(&f);
    gj_tensor *loss = fuzz_loss(&f);
    assert_non_null(loss);
    int rc = 0;
    if (seed % 5 == 0) {
        rc = gj_backward_ex(loss, NULL, true);
        if (rc == 0) rc = gj_backward(loss, NULL);
    } else {
        rc = gj_backward(loss, NULL);
    }
    if (rc != 0) {
        print_error("seed %llu %s: backward failed: %s (ops: %s)\n", (unsigned long long)seed,
                    gj_rt_dtype_name(dt), gj_last_error(), f.log);
        fail();
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    double **g = calloc(NLEAF, sizeof *g);
    assert_non_null(g);
    for (int i = 0; i < f.n_leaves; i++) {
        gj_tensor *t = gj_tensor_grad(f.leaves[i]);
        g[i] = t ? gjt_values(t) : NULL;
        numel[i] = gj_tensor_numel(f.leaves[i]);
    }
    free_leaves(&f);
    snprintf(log, logcap, "%s", f.log);
    return g;
}

/* Runs seed both ways; true if its gradients agree and it compiled. */
static bool check_seed(uint64_t seed, gj_dtype dt, double rtol) {
    char log_e[2048], log_c[2048];
    int64_t ne[NLEAF], nc[NLEAF];
    gj_ca_stats s0, s1;
    double **ge = run_model(seed, dt, false, log_e, sizeof log_e, ne);
    gj_compiled_autograd_stats(&s0);
    double **gc = run_model(seed, dt, true, log_c, sizeof log_c, nc);
    gj_compiled_autograd_stats(&s1);
    assert_string_equal(log_e, log_c);
    bool ok = true;
    if (s1.fallbacks != s0.fallbacks) {
        print_error("seed %llu %s fell back: %s (ops: %s)\n", (unsigned long long)seed,
                    gj_rt_dtype_name(dt), gj_compiled_autograd_last_fallback(), log_c);
        ok = false;
    }
    for (int i = 0; i < NLEAF; i++) {
        if (!ge[i] || !gc[i]) {
            if (ge[i] || gc[i]) {
                print_error("seed %llu %s: leaf %d has a .grad in one mode only (ops: %s)\n",
                            (unsigned long long)seed, gj_rt_dtype_name(dt), i, log_c);
                ok = false;
            }
            continue;
        }
        double mx = 0;
        for (int64_t k = 0; k < ne[i]; k++) mx = fmax(mx, fabs(ge[i][k]));
        char what[96];
        snprintf(what, sizeof what, "seed %llu %s leaf %d", (unsigned long long)seed,
                 gj_rt_dtype_name(dt), i);
        if (!gjt_allclose(what, gc[i], ge[i], ne[i], rtol * mx + 1e-300, 0.0)) {
            print_error("ops: %s\n", log_c);
            ok = false;
        }
    }
    for (int i = 0; i < NLEAF; i++) {
        free(ge[i]);
        free(gc[i]);
    }
    free(ge);
    free(gc);
    return ok;
}

static bool dtype_selected(gj_dtype dt) {
    const char *want = getenv("GJT_FUZZ_DTYPE");
    return !want || !*want || strcmp(want, gj_rt_dtype_name(dt)) == 0;
}

static void run_fuzz(gj_dtype dt, double rtol, uint64_t base, int count) {
    if (!dtype_selected(dt)) return;
    int64_t live0 = gjt_live_bytes();
    const char *one = getenv("GJT_FUZZ_SEED");
    const char *cnt = getenv("GJT_FUZZ_COUNT"); /* a longer run by hand */
    if (cnt && atoi(cnt) > 0) count = atoi(cnt);
    int bad = 0, total = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int k = 0; k < count; k++) {
        uint64_t seed = one ? strtoull(one, NULL, 10) : base + (uint64_t)k;
        if (!check_seed(seed, dt, rtol)) {
            bad++;
            print_error("reproduce: GJT_FUZZ_SEED=%llu GJT_FUZZ_DTYPE=%s ./test_jit_fuzz\n",
                        (unsigned long long)seed, gj_rt_dtype_name(dt));
        }
        total++;
        if (one) break;
        if (k % 100 == 99) gj_jit_clear_cache(); /* bound the cache of this long run */
    }
    gj_jit_clear_cache();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double sec = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    print_message("%s: %d graphs, %d mismatches or fallbacks, %.1f s (rtol %g)\n",
                  gj_rt_dtype_name(dt), total, bad, sec, rtol);
    assert_int_equal(bad, 0);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_fuzz_f64(void **st) {
    (void)st;
    run_fuzz(GJ_F64, 1e-12, 1000, 700 / FUZZ_SCALE);
}

static void test_fuzz_f32(void **st) {
    (void)st;
    run_fuzz(GJ_F32, 1e-6, 5000, 900 / FUZZ_SCALE);
}

static void test_fuzz_bf16(void **st) {
    (void)st;
    run_fuzz(GJ_BF16, 1.0 / 128, 9000, 400 / FUZZ_SCALE);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL);       /* every graph compiles here */
    gj_jit_set_recompile_limit(-1);    /* random graphs may share a call site */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuzz_f64),
        cmocka_unit_test(test_fuzz_f32),
        cmocka_unit_test(test_fuzz_bf16),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
