/*
 * test_jit_fuzz.c - differential test of compiled autograd: random small
 * models built from the public ops (elementwise with broadcasting,
 * reductions, views, narrow/cat, matmul, softmax, layer norm, masked fill,
 * dropout),
 * whose backward runs once eagerly and once compiled; every leaf's .grad
 * must agree (f64: 1e-10 relative to the tensor's largest entry; f32: 1e-3,
 * because the decomposed layer-norm/softmax backwards round their f32
 * products where the hand-fused eager kernels keep them in double, and the
 * cancellation in those formulas magnifies that). A fallback is allowed (it
 * must give the eager values, checked the same way) but most graphs must
 * compile.
 *
 * Each model is a pure function of its seed, so a failure prints the seed
 * and the op sequence. Odd seeds start with existing .grad buffers on some
 * leaves (the in-place accumulation path). GJT_FUZZ_SEED=n reproduces one
 * seed alone; GJT_FUZZ_COUNT=n runs n seeds per dtype instead of the few of
 * the default run.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXT 48

typedef struct fuzz {
    gjt_rng rng;
    gj_dtype dt;
    gj_tensor *leaves[6];
    int n_leaves;
    gj_tensor *pool[MAXT]; /* borrowed from the scope */
    int n;
    char log[2048];
    int64_t R, C;
} fuzz;

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

/* A tensor of f's pool with exactly this shape (2-D), or NULL. */
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
    switch (gjt_rng_int(&f->rng, 16)) {
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
    case 15: /* dropout: run-time seed/offset */
        push(f, gj_dropout(x, 0.25, true), "dropout");
        break;
    default: { /* masked fill with a fixed pattern */
        if (nd != 2) {
            push(f, gj_relu(x), "relu");
            break;
        }
        double mk[64];
        for (int i = 0; i < sh[0] * sh[1] && i < 64; i++) mk[i] = (i % 3) == 0;
        gj_tensor *m = gjt_tensor(f->dt, 2, sh, mk);
        push(f, gj_masked_fill(x, m, -0.5), "masked_fill");
        gj_release(m);
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

/* Builds the model of seed (same ops for the same seed) and runs one
 * backward; returns the .grad values of each leaf (malloc'd, NULL for no
 * grad). */
static void build_leaves(fuzz *f, uint64_t seed, gj_dtype dt) {
    memset(f, 0, sizeof *f);
    gjt_rng_seed(&f->rng, seed);
    f->dt = dt;
    f->R = 2 + gjt_rng_int(&f->rng, 4);
    f->C = 2 + gjt_rng_int(&f->rng, 5);
    int64_t rc[2] = {f->R, f->C}, c1[1] = {f->C}, r1[2] = {f->R, 1};
    f->leaves[0] = gjt_uniform(&f->rng, dt, 2, rc, -1, 1);
    f->leaves[1] = gjt_uniform(&f->rng, dt, 2, rc, -1, 1);
    f->leaves[2] = gjt_uniform(&f->rng, dt, 2, r1, -1, 1);
    f->leaves[3] = gjt_uniform(&f->rng, dt, 1, c1, 0.5, 1.5);
    f->leaves[4] = gjt_uniform(&f->rng, dt, 1, c1, -0.5, 0.5);
    f->n_leaves = 5;
    for (int i = 0; i < f->n_leaves; i++) {
        assert_non_null(f->leaves[i]);
        assert_int_equal(gj_set_requires_grad(f->leaves[i], true), 0);
    }
}

static double **run_model(uint64_t seed, gj_dtype dt, bool compiled, char *log, size_t logcap) {
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
    if (gj_backward(loss, NULL) != 0) {
        print_error("seed %llu: backward failed: %s\n", (unsigned long long)seed, gj_last_error());
        fail();
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    double **g = calloc(6, sizeof *g);
    assert_non_null(g);
    for (int i = 0; i < f.n_leaves; i++) {
        gj_tensor *t = gj_tensor_grad(f.leaves[i]);
        g[i] = t ? gjt_values(t) : NULL;
        gj_release(f.leaves[i]);
    }
    snprintf(log, logcap, "%s", f.log);
    return g;
}

static int64_t leaf_numel(uint64_t seed, int i) {
    fuzz f;
    gjt_rng_seed(&f.rng, seed);
    int64_t R = 2 + gjt_rng_int(&f.rng, 4), C = 2 + gjt_rng_int(&f.rng, 5);
    return i < 2 ? R * C : i == 2 ? R : C;
}

static void check_seed(uint64_t seed, gj_dtype dt, double rtol, int *compiled_ok) {
    char log_e[2048], log_c[2048];
    gj_ca_stats s0, s1;
    double **ge = run_model(seed, dt, false, log_e, sizeof log_e);
    gj_compiled_autograd_stats(&s0);
    double **gc = run_model(seed, dt, true, log_c, sizeof log_c);
    gj_compiled_autograd_stats(&s1);
    assert_string_equal(log_e, log_c);
    if (s1.fallbacks == s0.fallbacks) (*compiled_ok)++;
    else print_message("seed %llu fell back: %s (ops: %s)\n", (unsigned long long)seed,
                       gj_jit_last_fallback_reason(), log_c);
    for (int i = 0; i < 5; i++) {
        if (!ge[i] || !gc[i]) {
            if (ge[i] != gc[i] && (!ge[i] || !gc[i])) {
                print_error("seed %llu: leaf %d has a .grad in one mode only (ops: %s)\n",
                            (unsigned long long)seed, i, log_c);
                fail();
            }
            continue;
        }
        int64_t n = leaf_numel(seed, i);
        double mx = 0;
        for (int64_t k = 0; k < n; k++) mx = fmax(mx, fabs(ge[i][k]));
        char what[96];
        snprintf(what, sizeof what, "seed %llu leaf %d", (unsigned long long)seed, i);
        if (!gjt_allclose(what, gc[i], ge[i], n, rtol * mx + 1e-300, rtol)) {
            print_error("ops: %s\n", log_c);
            fail();
        }
    }
    for (int i = 0; i < 5; i++) {
        free(ge[i]);
        free(gc[i]);
    }
    free(ge);
    free(gc);
}

static void run_fuzz(gj_dtype dt, double rtol, uint64_t base, int count) {
    int64_t live0 = gjt_live_bytes();
    const char *one = getenv("GJT_FUZZ_SEED");
    const char *cnt = getenv("GJT_FUZZ_COUNT"); /* a longer run by hand */
    if (cnt && atoi(cnt) > 0) count = atoi(cnt);
    int ok = 0, total = 0;
    for (int k = 0; k < count; k++) {
        uint64_t seed = one ? strtoull(one, NULL, 10) : base + (uint64_t)k;
        check_seed(seed, dt, rtol, &ok);
        total++;
        if (one) break;
    }
    gj_jit_clear_cache();
    print_message("%d/%d graphs compiled\n", ok, total);
    assert_true(ok * 10 >= total * 8);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_fuzz_f64(void **st) {
    (void)st;
    run_fuzz(GJ_F64, 1e-10, 1000, 24);
}

static void test_fuzz_f32(void **st) {
    (void)st;
    run_fuzz(GJ_F32, 1e-3, 5000, 16);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL); /* counts below assume compiles, not disk hits */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuzz_f64),
        cmocka_unit_test(test_fuzz_f32),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
