/* SPDX-License-Identifier: MIT */
/*
 * test_jit_compiled.c - compiled autograd end to end through the public
 * API: gradients of small models (an MLP with GELU and cross-entropy, the
 * W2 pointwise loss of docs/benchmarks.md at a small size) computed compiled
 * must equal the eager engine's (1e-6 relative in f32), the second backward
 * must hit the cache, existing .grad buffers are accumulated into, and
 * every fallback (a primitive without lowering -- forced by a test switch,
 * since all have one --, a forced LLVM failure, a freed graph) still ends
 * with exactly the eager result and is counted under its reason. Also the
 * structural key: identical for the same model built twice, different when
 * a shape, a dtype or an attribute changes.
 */
#include "gjtest.h"

#include "jit/capture/capture.h"
#include "jit/codegen/codegen.h"
#include "jit/jit.h"
#include "jit/plan/plan.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------------ helpers */

typedef struct model {
    int n_params;
    gj_tensor *params[16];
    gj_tensor *data[4]; /* inputs that need no grad */
} model;

static void model_free(model *m) {
    for (int i = 0; i < m->n_params; i++) gj_release(m->params[i]);
    for (int i = 0; i < 4; i++) gj_release(m->data[i]);
    memset(m, 0, sizeof *m);
}

static void clear_grads(model *m) {
    for (int i = 0; i < m->n_params; i++) assert_int_equal(gj_tensor_set_grad(m->params[i], NULL), 0);
}

/* Copies of every parameter's .grad (malloc'd; NULL entries for none). */
static double **grads_of(model *m) {
    double **g = calloc((size_t)m->n_params, sizeof *g);
    assert_non_null(g);
    for (int i = 0; i < m->n_params; i++) {
        gj_tensor *t = gj_tensor_grad(m->params[i]);
        assert_non_null(t);
        assert_int_equal(gj_tensor_dtype(t), gj_tensor_dtype(m->params[i]));
        g[i] = gjt_values(t);
        assert_non_null(g[i]);
    }
    return g;
}

static void grads_free(model *m, double **g) {
    for (int i = 0; i < m->n_params; i++) free(g[i]);
    free(g);
}

/* got == want within rtol relative to the largest |want| of the tensor. */
static void assert_grads_close(model *m, double **got, double **want, double rtol) {
    for (int i = 0; i < m->n_params; i++) {
        int64_t n = gj_tensor_numel(m->params[i]);
        double mx = 0;
        for (int64_t k = 0; k < n; k++) mx = fmax(mx, fabs(want[i][k]));
        char what[32];
        snprintf(what, sizeof what, "param %d grad", i);
        assert_true(gjt_allclose(what, got[i], want[i], n, rtol * mx, rtol));
    }
}

typedef gj_tensor *(*loss_fn)(model *m);

/* One forward + backward in a scope, compiled or not. Returns 0 or the
 * backward's status. */
static int step(model *m, loss_fn f, bool compiled) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *loss = f(m);
    assert_non_null(loss);
    int rc = gj_backward(loss, NULL);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    return rc;
}

/* ------------------------------------------------------------- models */

/* MLP: x[B,16] -> Linear(16,32) -> GELU -> Linear(32,10) -> CE(labels). */
static void mlp_init(model *m, int64_t batch, gj_dtype dt, uint64_t seed) {
    memset(m, 0, sizeof *m);
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    int64_t s1[2] = {32, 16}, s2[1] = {32}, s3[2] = {10, 32}, s4[1] = {10};
    m->params[0] = gjt_uniform(&r, dt, 2, s1, -0.25, 0.25);
    m->params[1] = gjt_uniform(&r, dt, 1, s2, -0.25, 0.25);
    m->params[2] = gjt_uniform(&r, dt, 2, s3, -0.2, 0.2);
    m->params[3] = gjt_uniform(&r, dt, 1, s4, -0.2, 0.2);
    m->n_params = 4;
    for (int i = 0; i < 4; i++) {
        assert_non_null(m->params[i]);
        assert_int_equal(gj_set_requires_grad(m->params[i], true), 0);
    }
    int64_t xs[2] = {batch, 16}, ls[1] = {batch};
    m->data[0] = gjt_uniform(&r, dt, 2, xs, -2, 2);
    m->data[1] = gjt_labels(&r, 1, ls, 10);
    assert_non_null(m->data[0]);
    assert_non_null(m->data[1]);
}

static gj_tensor *mlp_loss(model *m) {
    gj_tensor *h = gj_gelu(gj_linear(m->data[0], m->params[0], m->params[1]));
    return gj_cross_entropy(gj_linear(h, m->params[2], m->params[3]), m->data[1]);
}

/* W2: loss = sum(tanh(x*w + b) * sigmoid(x) + exp(-(x*x))), all leaves. */
static void w2_init(model *m, int64_t n, uint64_t seed) {
    memset(m, 0, sizeof *m);
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    int64_t s[1] = {n};
    for (int i = 0; i < 3; i++) {
        m->params[i] = gjt_uniform(&r, GJ_F32, 1, s, -2, 2);
        assert_non_null(m->params[i]);
        assert_int_equal(gj_set_requires_grad(m->params[i], true), 0);
    }
    m->n_params = 3;
}

static gj_tensor *w2_loss(model *m) {
    gj_tensor *x = m->params[0], *w = m->params[1], *b = m->params[2];
    gj_tensor *t = gj_mul(gj_tanh(gj_add(gj_mul(x, w), b)), gj_sigmoid(x));
    return gj_sum(gj_add(t, gj_exp(gj_neg(gj_mul(x, x)))), 0, NULL, false);
}

/* A loss whose backward needs SCATTER_ADD_ROWS (embedding). */
static gj_tensor *embed_loss(model *m) {
    gj_tensor *t = gj_reshape(m->params[0], 2, (int64_t[]){3, 3});
    gj_tensor *y = gj_embedding(gj_tanh(t), m->data[0]);
    return gj_sum(gj_mul(y, y), 0, NULL, false);
}

/* narrow and cat: PAD and CAT in the backward (lowered). */
static gj_tensor *narrow_cat_loss(model *m) {
    gj_tensor *x = m->params[0], *w = m->params[1];
    gj_tensor *parts[3] = {gj_narrow(gj_tanh(x), 0, 2, 5), gj_narrow(w, 0, 0, 3), gj_exp(x)};
    gj_tensor *c = gj_cat(3, parts, 0);
    return gj_sum(gj_mul(c, c), 0, NULL, false);
}

/* A pre-norm transformer block (W3's structure at a small size):
 * h = x + Attn(LN(x)); y = h + MLP(LN(h)); loss = mean(y*y).
 * params: x, ln1 w/b, qkv w/b, out w/b, ln2 w/b, fc1 w/b, fc2 w/b. */
enum { BB = 2, BT = 5, BC = 8, BH = 2 };

static void block_init(model *m, uint64_t seed) {
    memset(m, 0, sizeof *m);
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    const int64_t shapes[13][3] = {
        {3, BB * BT, BC}, {1, BC}, {1, BC}, {2, 3 * BC, BC}, {1, 3 * BC}, {2, BC, BC}, {1, BC},
        {1, BC}, {1, BC}, {2, 4 * BC, BC}, {1, 4 * BC}, {2, BC, 4 * BC}, {1, BC}};
    for (int i = 0; i < 13; i++) {
        int nd = (int)shapes[i][0];
        int64_t sh[3] = {shapes[i][1], shapes[i][2], 0};
        if (i == 0) {
            sh[0] = BB;
            sh[1] = BT;
            sh[2] = BC;
        }
        double lo = (i == 1 || i == 7) ? 0.5 : -0.4, hi = (i == 1 || i == 7) ? 1.5 : 0.4;
        m->params[i] = gjt_uniform(&r, GJ_F32, nd, sh, lo, hi);
        assert_non_null(m->params[i]);
        assert_int_equal(gj_set_requires_grad(m->params[i], true), 0);
    }
    m->n_params = 13;
    /* causal mask [T, T]: 1 above the diagonal */
    double mk[BT * BT];
    for (int i = 0; i < BT; i++)
        for (int j = 0; j < BT; j++) mk[i * BT + j] = j > i ? 1.0 : 0.0;
    m->data[0] = gjt_tensor(GJ_F32, 2, (int64_t[]){BT, BT}, mk);
    assert_non_null(m->data[0]);
}

static gj_tensor *block_loss(model *m) {
    gj_tensor **p = m->params;
    gj_tensor *x = p[0];
    gj_tensor *qkv = gj_linear(gj_layer_norm(x, p[1], p[2], 1e-5), p[3], p[4]); /* [B,T,3C] */
    int hd = BC / BH;
    gj_tensor *heads[3];
    for (int k = 0; k < 3; k++) {
        gj_tensor *t = gj_narrow(qkv, 2, k * BC, BC);
        t = gj_reshape(t, 4, (int64_t[]){BB, BT, BH, hd});
        heads[k] = gj_permute(t, (int[]){0, 2, 1, 3}); /* [B,H,T,hd] */
    }
    gj_tensor *att = gj_mul_scalar(gj_matmul(heads[0], gj_transpose(heads[1], 2, 3)),
                                   1.0 / sqrt((double)hd));
    att = gj_softmax(gj_masked_fill(att, m->data[0], -1e9), -1);
    gj_tensor *o = gj_permute(gj_matmul(att, heads[2]), (int[]){0, 2, 1, 3});
    o = gj_reshape(o, 3, (int64_t[]){BB, BT, BC});
    gj_tensor *h = gj_add(x, gj_linear(o, p[5], p[6]));
    gj_tensor *f = gj_linear(gj_gelu(gj_linear(gj_layer_norm(h, p[7], p[8], 1e-5), p[9], p[10])),
                             p[11], p[12]);
    gj_tensor *y = gj_add(h, f);
    return gj_mean(gj_mul(y, y), 0, NULL, false);
}

/* ------------------------------------------------------------ the tests */

/* Compiled gradients of the MLP equal eager ones; the second backward is
 * a cache hit; accumulation into existing .grad matches eager's. */
static void test_mlp(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_jit_clear_cache();
    model m;
    mlp_init(&m, 8, GJ_F32, 11);
    assert_int_equal(step(&m, mlp_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);

    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, mlp_loss, true), 0);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 0);
    double **got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-6);
    grads_free(&m, got);

    clear_grads(&m); /* same key again: a hit */
    assert_int_equal(step(&m, mlp_loss, true), 0);
    s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 1);
    assert_int_equal(s.fallbacks, 0);
    assert_true(s.compile_ms > 0);
    got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-6);
    grads_free(&m, got);

    /* .grad present: accumulated in place, as eager does */
    gj_tensor *g0 = gj_tensor_grad(m.params[0]);
    assert_int_equal(step(&m, mlp_loss, true), 0);
    assert_ptr_equal(gj_tensor_grad(m.params[0]), g0); /* same tensor, updated */
    got = grads_of(&m);
    clear_grads(&m);
    assert_int_equal(step(&m, mlp_loss, false), 0);
    assert_int_equal(step(&m, mlp_loss, false), 0);
    double **ref2 = grads_of(&m);
    assert_grads_close(&m, got, ref2, 1e-6);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    grads_free(&m, got);
    grads_free(&m, ref2);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The W2 pointwise loss: one fused kernel; bit-identical to eager. */
static void test_w2(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    model m;
    w2_init(&m, 5000, 12);
    assert_int_equal(step(&m, w2_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, w2_loss, true), 0);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    assert_int_equal(gjt_ca_now().compiles, 1);
    double **got = grads_of(&m);
    for (int i = 0; i < 3; i++) assert_memory_equal(got[i], ref[i], 5000 * sizeof(double));
    grads_free(&m, got);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* f64 MLP: compiled equals eager (tolerance at f64 level). */
static void test_mlp_f64(void **st) {
    (void)st;
    model m;
    mlp_init(&m, 5, GJ_F64, 13);
    assert_int_equal(step(&m, mlp_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, mlp_loss, true), 0);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    double **got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-13);
    grads_free(&m, got);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
}

/* The transformer block: layer norm, attention (narrow, permutes, batched
 * matmuls, masked softmax), GELU MLP, residuals; compiled equals eager. */
static void test_block(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    model m;
    block_init(&m, 19);
    assert_int_equal(step(&m, block_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, block_loss, true), 0);
    if (gjt_ca_now().fallbacks) print_error("fallback: %s\n", gj_jit_last_fallback_reason());
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    assert_int_equal(gjt_ca_now().compiles, 1);
    double **got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-6);
    grads_free(&m, got);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A primitive without lowering (forced by the test switch: every
 * primitive has one): the backward runs eagerly (same values), the reason
 * is readable and counted as GJ_CA_NO_LOWERING, and the key is remembered
 * as eager-only. Without the switch the same backward compiles and gives
 * the eager bytes (scatter in index order). */
static void test_fallback_no_lowering(void **st) {
    (void)st;
    model m;
    w2_init(&m, 9, 14);
    m.n_params = 1;
    m.data[0] = gjt_i64(1, (int64_t[]){4}, (int64_t[]){2, 0, 2, 1});
    assert_int_equal(step(&m, embed_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    gj_jit_test_no_lowering(GJ_P_SCATTER_ADD_ROWS);
    assert_int_equal(step(&m, embed_loss, true), 0);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.fallbacks, 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_NO_LOWERING], 1);
    assert_int_equal(s.compiles, 0);
    assert_non_null(strstr(gj_jit_last_fallback_reason(), "no lowering for scatter_add_rows"));
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "no_lowering: "));
    double **got = grads_of(&m);
    assert_memory_equal(got[0], ref[0], 9 * sizeof(double));
    grads_free(&m, got);
    clear_grads(&m);
    gj_jit_test_no_lowering(-1);
    assert_int_equal(step(&m, embed_loss, true), 0); /* eager-only key: no new capture */
    assert_int_equal(gjt_ca_now().fallbacks, 2);
    assert_int_equal(gjt_ca_now().fallbacks_by_reason[GJ_CA_NO_LOWERING], 2);
    got = grads_of(&m);
    assert_memory_equal(got[0], ref[0], 9 * sizeof(double));
    grads_free(&m, got);
    gj_jit_clear_cache(); /* forget the eager-only mark: now it compiles */
    clear_grads(&m);
    assert_int_equal(step(&m, embed_loss, true), 0);
    assert_int_equal(gjt_ca_now().fallbacks, 2);
    assert_int_equal(gjt_ca_now().compiles, 1);
    got = grads_of(&m);
    assert_memory_equal(got[0], ref[0], 9 * sizeof(double));
    grads_free(&m, got);
    grads_free(&m, ref);
    m.n_params = 3;
    model_free(&m);
    gj_jit_clear_cache();
}

/* narrow + cat: compiled equals eager exactly (copies and pads). */
static void test_narrow_cat(void **st) {
    (void)st;
    model m;
    w2_init(&m, 9, 18);
    m.n_params = 2;
    assert_int_equal(step(&m, narrow_cat_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, narrow_cat_loss, true), 0);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    double **got = grads_of(&m);
    for (int i = 0; i < 2; i++) assert_memory_equal(got[i], ref[i], 9 * sizeof(double));
    grads_free(&m, got);
    grads_free(&m, ref);
    m.n_params = 3;
    model_free(&m);
    gj_jit_clear_cache();
}

/* A forced LLVM failure becomes a fallback with an "LLVM error" reason and
 * eager gradients. */
static void test_fallback_llvm_error(void **st) {
    (void)st;
    model m;
    w2_init(&m, 100, 15);
    assert_int_equal(step(&m, w2_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    gj_jit_test_fail_llvm(true);
    assert_int_equal(step(&m, w2_loss, true), 0);
    gj_jit_test_fail_llvm(false);
    assert_int_equal(gjt_ca_now().fallbacks, 1);
    assert_int_equal(gjt_ca_now().compiles, 0);
    assert_non_null(strstr(gj_jit_last_fallback_reason(), "LLVM error"));
    assert_int_equal(gjt_ca_now().fallbacks_by_reason[GJ_CA_LLVM_ERROR], 1);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "llvm_error: "));
    double **got = grads_of(&m);
    for (int i = 0; i < 3; i++) assert_memory_equal(got[i], ref[i], 100 * sizeof(double));
    grads_free(&m, got);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
}

/* Without retain_graph the compiled backward frees the graph: a second
 * backward through it fails exactly like eager (after a fallback). With
 * retain_graph it can run twice. */
static void test_retain_graph(void **st) {
    (void)st;
    model m;
    w2_init(&m, 16, 16);
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_reset_stats();
    gj_scope_push();
    gj_tensor *loss = w2_loss(&m);
    assert_int_equal(gj_backward_ex(loss, NULL, true), 0);
    assert_int_equal(gj_backward_ex(loss, NULL, false), 0);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    assert_int_not_equal(gj_backward(loss, NULL), 0);
    GJT_ASSERT_ERROR("second time");
    assert_int_equal(gjt_ca_now().fallbacks, 0); /* an error, not a fallback */
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    double **got = grads_of(&m);
    clear_grads(&m);
    assert_int_equal(step(&m, w2_loss, false), 0);
    assert_int_equal(step(&m, w2_loss, false), 0);
    double **ref = grads_of(&m);
    for (int i = 0; i < 3; i++) assert_memory_equal(got[i], ref[i], 16 * sizeof(double));
    grads_free(&m, got);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
}

/* bf16 parameters with f32 math (the W5 pattern): grads cast back to bf16. */
static gj_tensor *bf16_loss(model *m) {
    gj_tensor *w = gj_cast(m->params[0], GJ_F32), *b = gj_cast(m->params[1], GJ_F32);
    gj_tensor *h = gj_gelu(gj_linear(m->data[0], w, b));
    return gj_mean(gj_mul(h, h), 0, NULL, false);
}

static void test_bf16_params(void **st) {
    (void)st;
    model m;
    memset(&m, 0, sizeof m);
    gjt_rng r;
    gjt_rng_seed(&r, 21);
    m.params[0] = gjt_uniform(&r, GJ_BF16, 2, (int64_t[]){6, 5}, -0.5, 0.5);
    m.params[1] = gjt_uniform(&r, GJ_BF16, 1, (int64_t[]){6}, -0.5, 0.5);
    m.n_params = 2;
    for (int i = 0; i < 2; i++) assert_int_equal(gj_set_requires_grad(m.params[i], true), 0);
    m.data[0] = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 5}, -1, 1);
    assert_int_equal(step(&m, bf16_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, bf16_loss, true), 0);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    double **got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-2); /* one bf16 ulp: the f32 gemm order may differ */
    grads_free(&m, got);
    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
}

/* A leaf as the root; two leaves sharing one .grad tensor (an aliasing
 * the compiled run refuses: fallback, eager values). */
static gj_tensor *shared_loss(model *m) {
    return gj_sum(gj_mul(gj_tanh(m->params[0]), m->params[1]), 0, NULL, false);
}

static void test_edge_cases(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = gjt_tensor(GJ_F64, 1, (int64_t[]){1}, (double[]){0.5});
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(gj_backward(x, NULL), 0);
    gj_set_compiled_autograd(false);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    assert_true(gj_tensor_item(gj_tensor_grad(x)) == 1.0);
    gj_release(x);

    model m;
    w2_init(&m, 7, 22);
    m.n_params = 2;
    gj_tensor *g = gj_zeros(GJ_F32, 1, (int64_t[]){7});
    assert_int_equal(gj_tensor_set_grad(m.params[0], g), 0);
    assert_int_equal(gj_tensor_set_grad(m.params[1], g), 0);
    bool shared = gj_tensor_grad(m.params[0]) == gj_tensor_grad(m.params[1]);
    assert_int_equal(step(&m, shared_loss, false), 0);
    double **ref = grads_of(&m);
    assert_int_equal(gj_zero_(g), 0);
    assert_int_equal(gj_tensor_set_grad(m.params[0], g), 0);
    assert_int_equal(gj_tensor_set_grad(m.params[1], g), 0);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, shared_loss, true), 0);
    if (shared) {
        assert_int_equal(gjt_ca_now().fallbacks, 1);
        assert_non_null(strstr(gj_jit_last_fallback_reason(), "shares memory"));
    }
    double **got = grads_of(&m);
    for (int i = 0; i < 2; i++) assert_memory_equal(got[i], ref[i], 7 * sizeof(double));
    grads_free(&m, got);
    grads_free(&m, ref);
    gj_release(g);
    m.n_params = 3;
    model_free(&m);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Dropout draws a new mask (seed, offset) at every step: the key leaves
 * them out and the compiled program reads them at run time, so later steps
 * hit the cache and still use their own masks. */
static gj_tensor *dropout_loss(model *m) {
    gj_tensor *h = gj_dropout(gj_tanh(gj_mul(m->params[0], m->params[1])), 0.4, true);
    return gj_sum(gj_mul(h, gj_sigmoid(m->params[2])), 0, NULL, false);
}

static void test_dropout(void **st) {
    (void)st;
    model m;
    w2_init(&m, 300, 24);
    gj_compiled_autograd_reset_stats();
    for (uint64_t seed = 5; seed < 8; seed++) {
        gj_manual_seed(seed);
        assert_int_equal(step(&m, dropout_loss, false), 0);
        double **ref = grads_of(&m);
        clear_grads(&m);
        gj_manual_seed(seed);
        assert_int_equal(step(&m, dropout_loss, true), 0);
        double **got = grads_of(&m);
        for (int i = 0; i < 3; i++) assert_memory_equal(got[i], ref[i], 300 * sizeof(double));
        clear_grads(&m);
        grads_free(&m, got);
        grads_free(&m, ref);
    }
    assert_int_equal(gjt_ca_now().compiles, 1);
    assert_int_equal(gjt_ca_now().mem_hits, 2);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    model_free(&m);
    gj_jit_clear_cache();
}

/* ---------------------------------------------------------- disk cache */

/* Path of the one .gjc file in dir (static buffer), or NULL. */
static const char *cache_file(const char *dir) {
    static char path[1200];
    const char *found = NULL;
    DIR *d = opendir(dir);
    if (!d) return NULL;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n > 4 && strcmp(e->d_name + n - 4, ".gjc") == 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            found = path;
        }
    }
    closedir(d);
    return found;
}

static void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char p[1200];
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        remove(p);
    }
    closedir(d);
    rmdir(dir);
}

/* Compile once: the program goes to disk. After the memory cache (and the
 * LLJIT) are dropped, the same key loads from disk, also in another process
 * (a forked child computes the same key); a damaged file is recompiled. */
static void test_disk_cache(void **st) {
    (void)st;
    char dir[] = "/tmp/gradjit-test-cache-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    gj_jit_clear_cache();
    model m;
    mlp_init(&m, 6, GJ_F32, 23);
    assert_int_equal(step(&m, mlp_loss, false), 0);
    double **ref = grads_of(&m);
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, mlp_loss, true), 0);
    assert_int_equal(gjt_ca_now().compiles, 1);
    assert_int_equal(gjt_ca_now().disk_hits, 0);
    const char *file = cache_file(dir);
    assert_non_null(file);
    char path[1200];
    snprintf(path, sizeof path, "%s", file);

    /* a new "process" as far as the JIT is concerned */
    gj_jit_clear_cache();
    clear_grads(&m);
    assert_int_equal(step(&m, mlp_loss, true), 0);
    assert_int_equal(gjt_ca_now().compiles, 1);
    assert_int_equal(gjt_ca_now().disk_hits, 1);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    double **got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-6);
    grads_free(&m, got);

    /* a real second process: same model built from scratch, same key */
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        gj_jit_clear_cache();
        gj_compiled_autograd_reset_stats();
        model c;
        mlp_init(&c, 6, GJ_F32, 23);
        int rc = step(&c, mlp_loss, true);
        gj_ca_stats s = gjt_ca_now();
        _exit(rc == 0 && s.disk_hits == 1 && s.compiles == 0 && s.fallbacks == 0 ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);

    /* damage the file: it is recompiled (and rewritten), never trusted */
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, 200, SEEK_SET), 0);
    int c0 = fgetc(f);
    assert_int_equal(fseek(f, 200, SEEK_SET), 0);
    fputc(c0 ^ 0x5a, f);
    fclose(f);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    clear_grads(&m);
    assert_int_equal(step(&m, mlp_loss, true), 0);
    assert_int_equal(gjt_ca_now().compiles, 1);
    assert_int_equal(gjt_ca_now().disk_hits, 0);
    got = grads_of(&m);
    assert_grads_close(&m, got, ref, 1e-6);
    grads_free(&m, got);
    /* truncated: the same */
    assert_int_equal(truncate(path, 100), 0);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    clear_grads(&m);
    assert_int_equal(step(&m, mlp_loss, true), 0);
    assert_int_equal(gjt_ca_now().compiles, 1);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    gj_jit_clear_cache();
    clear_grads(&m);
    gj_compiled_autograd_reset_stats();
    assert_int_equal(step(&m, mlp_loss, true), 0); /* the rewritten file is good */
    assert_int_equal(gjt_ca_now().disk_hits, 1);

    grads_free(&m, ref);
    model_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    remove_dir(dir);
}

/* --------------------------------------------------------------- keys */

static gj_tensor *scaled_mlp_loss(model *m, double c) {
    gj_tensor *h = gj_mul_scalar(gj_gelu(gj_linear(m->data[0], m->params[0], m->params[1])), c);
    return gj_cross_entropy(gj_linear(h, m->params[2], m->params[3]), m->data[1]);
}

/* The key text of the backward of a fresh model (malloc'd). */
static char *key_of(int64_t batch, gj_dtype dt, double c, uint64_t seed, uint64_t hash[2]) {
    model m;
    mlp_init(&m, batch, dt, seed);
    gj_scope_push();
    gj_tensor *loss = scaled_mlp_loss(&m, c);
    assert_non_null(loss);
    gj_jit_walk w;
    assert_int_equal(gj_jit_walk_build(&w, 1, &loss, NULL), 0);
    assert_false(w.invalid);
    char *k = strdup(w.key);
    hash[0] = w.hash[0];
    hash[1] = w.hash[1];
    assert_int_equal((size_t)strlen(k), w.key_len);
    gj_jit_walk_free(&w);
    gj_scope_pop();
    model_free(&m);
    return k;
}

static void test_key(void **st) {
    (void)st;
    uint64_t h1[2], h2[2], h3[2];
    char *a = key_of(8, GJ_F32, 2.0, 1, h1);
    /* The text itself is pinned: the disk cache files programs under its
     * hash in every process, so a change of its bytes (key.c formats most
     * fields without vsnprintf) must be deliberate, with a new version. */
    assert_string_equal(
        a, "gradjit-key v1 roots=1 nodes=9\n"
           "R0 e0:0 m0[] seed-\n"
           "N0 cross_entropy r8 a in e1:0:0[8,10] e-1:0:3[8] out 0[] saved3 0[8,10]c 0[8]c "
           "3[8]c\n"
           "N1 linear r5 ai1 in e2:0:0[8,32] e3:0:0[10,32] e4:0:0[10] out 0[8,10] saved2 "
           "0[8,32]c 0[10,32]c\n"
           "N2 mul_scalar r4 af0x1p+1 in e5:0:0[8,32] out 0[8,32] saved0\n"
           "N3 acc r6 leaf0[10,32]c grad-\n"
           "N4 acc r7 leaf0[10]c grad-\n"
           "N5 gelu r3 af0x0p+0 in e6:0:0[8,32] out 0[8,32] saved1 0[8,32]c\n"
           "N6 linear r0 ai1 in e-1:0:0[8,16] e7:0:0[32,16] e8:0:0[32] out 0[8,32] saved2 "
           "0[8,16]c 0[32,16]c\n"
           "N7 acc r1 leaf0[32,16]c grad-\n"
           "N8 acc r2 leaf0[32]c grad-\n");
    char *b = key_of(8, GJ_F32, 2.0, 99, h2); /* other values, same structure */
    assert_string_equal(a, b);
    assert_true(h1[0] == h2[0] && h1[1] == h2[1]);
    char *c = key_of(9, GJ_F32, 2.0, 1, h3); /* shape */
    assert_true(strcmp(a, c) != 0);
    assert_false(h1[0] == h3[0] && h1[1] == h3[1]);
    char *d = key_of(8, GJ_F64, 2.0, 1, h3); /* dtype */
    assert_true(strcmp(a, d) != 0);
    assert_false(h1[0] == h3[0] && h1[1] == h3[1]);
    char *e = key_of(8, GJ_F32, 3.0, 1, h3); /* attribute */
    assert_true(strcmp(a, e) != 0);
    assert_false(h1[0] == h3[0] && h1[1] == h3[1]);
    free(a);
    free(b);
    free(c);
    free(d);
    free(e);
}

/* The key records each leaf's .grad presence and dtype. */
static void test_key_grad_state(void **st) {
    (void)st;
    model m;
    w2_init(&m, 4, 17);
    gj_scope_push();
    gj_tensor *loss = w2_loss(&m);
    gj_jit_walk w1, w2, w3;
    assert_int_equal(gj_jit_walk_build(&w1, 1, &loss, NULL), 0);
    int64_t s[1] = {4};
    gj_tensor *g = gj_zeros(GJ_F32, 1, s);
    assert_int_equal(gj_tensor_set_grad(m.params[1], g), 0);
    assert_int_equal(gj_jit_walk_build(&w2, 1, &loss, NULL), 0);
    gj_tensor *g64 = gj_zeros(GJ_F64, 1, s);
    int rc = gj_tensor_set_grad(m.params[1], g64);
    if (rc == 0) {
        assert_int_equal(gj_jit_walk_build(&w3, 1, &loss, NULL), 0);
        assert_true(strcmp(w2.key, w3.key) != 0);
        gj_jit_walk_free(&w3);
    }
    assert_true(strcmp(w1.key, w2.key) != 0);
    gj_jit_walk_free(&w1);
    gj_jit_walk_free(&w2);
    gj_scope_pop();
    model_free(&m);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL); /* counts below assume compiles, not disk hits */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key),
        cmocka_unit_test(test_key_grad_state),
        cmocka_unit_test(test_mlp),
        cmocka_unit_test(test_w2),
        cmocka_unit_test(test_mlp_f64),
        cmocka_unit_test(test_block),
        cmocka_unit_test(test_fallback_no_lowering),
        cmocka_unit_test(test_narrow_cat),
        cmocka_unit_test(test_fallback_llvm_error),
        cmocka_unit_test(test_retain_graph),
        cmocka_unit_test(test_bf16_params),
        cmocka_unit_test(test_edge_cases),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_disk_cache),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
