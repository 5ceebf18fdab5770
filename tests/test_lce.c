/* SPDX-License-Identifier: MIT */
/*
 * test_lce.c - gj_linear_cross_entropy, the fused vocabulary head
 * (runtime/kernels_lce.c).
 *
 *   - f64 finite differences of the fused op (with and without a bias,
 *     ignored rows, [B, T, C] inputs, several chunks of rows);
 *   - the fused op against the unfused formula (gj_linear, then
 *     gj_cross_entropy over the rows not ignored) in f64 (within 1e-12)
 *     and f32 (within 1e-5), with one chunk and with many; with one chunk,
 *     no ignored row and no bias, the loss is the unfused loss bit for bit;
 *     bf16 against f32 within bf16's resolution;
 *   - the bits do not depend on the thread count; the no-grad forward's
 *     loss equals the grad-mode loss;
 *   - compiled steps (gj_step) and compiled autograd give the eager bits,
 *     in f32, bf16 autocast and f64, over changing batch sizes;
 *   - bad arguments are refused with a message naming the op, the shapes
 *     and the dtypes; a label out of range names the row.
 */
#include "gjtest.h"

#include "runtime/rt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IGNORE = -100 };

/* ------------------------------------------------------------- formulas */

typedef struct lce_cfg {
    gj_tensor *labels; /* [N] or h's leading shape */
    bool fused, bias;
} lce_cfg;

/* The unfused formula: cross_entropy(h w^T + b) over the rows whose label
 * is not IGNORE (those rows gathered first). */
static gj_tensor *unfused(gj_tensor *h, gj_tensor *w, gj_tensor *b, gj_tensor *labels) {
    int64_t C = gj_tensor_shape(h)[gj_tensor_ndim(h) - 1], N = gj_tensor_numel(labels);
    gj_tensor *h2 = gj_reshape(h, 2, (int64_t[]){N, C});
    double *lv = gjt_values(labels);
    int64_t *rows = malloc((size_t)N * sizeof *rows), *keep = malloc((size_t)N * sizeof *keep), n = 0;
    for (int64_t i = 0; i < N; i++)
        if ((int64_t)lv[i] != IGNORE) {
            rows[n] = i;
            keep[n++] = (int64_t)lv[i];
        }
    gj_tensor *ri = gj_from_data(GJ_I64, 1, &n, rows), *li = gj_from_data(GJ_I64, 1, &n, keep);
    free(lv), free(rows), free(keep);
    gj_tensor *hv = h2 ? gj_embedding(h2, ri) : NULL;
    gj_tensor *logits = hv ? gj_linear(hv, w, b) : NULL;
    gj_tensor *loss = logits ? gj_cross_entropy(logits, li) : NULL;
    gj_release(ri), gj_release(li);
    return loss;
}

static gj_tensor *head(gj_tensor **in, void *ctx) {
    const lce_cfg *c = ctx;
    gj_tensor *b = c->bias ? in[2] : NULL;
    if (!c->fused) return unfused(in[0], in[1], b, c->labels);
    gj_tensor *l = gj_linear_cross_entropy(in[0], in[1], b, c->labels, IGNORE);
    /* bf16 inputs give an f32 loss; the harness wants the inputs' dtype */
    return l && gj_tensor_dtype(l) != gj_tensor_dtype(in[0]) ? gj_cast(l, gj_tensor_dtype(in[0])) : l;
}

/* Labels of shape (ndim, shape) in [0, V), every fifth row IGNORE when ignore. */
static gj_tensor *labels_of(uint64_t seed, int ndim, const int64_t *shape, int64_t V, bool ignore) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    int64_t n = gjt_numel(ndim, shape);
    int64_t *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = ignore && i % 5 == 2 ? IGNORE : gjt_rng_int(&r, V);
    gj_tensor *t = gj_from_data(GJ_I64, ndim, shape, v);
    free(v);
    return t;
}

/* ------------------------------------------------ finite differences */

static void test_gradcheck_f64(void **state) {
    (void)state;
    const struct {
        int64_t B, T, C, V;
        bool bias, ignore;
        int64_t chunk_bytes;
    } cases[] = {
        {0, 7, 5, 11, true, true, 0},    {0, 9, 4, 13, false, false, 0},
        {2, 6, 3, 17, true, true, 0},    {0, 23, 6, 9, true, true, 4 * 9 * 3},
        {3, 5, 4, 10, false, true, 4 * 10 * 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gj_rt_lce_test_chunk_bytes(cases[i].chunk_bytes);
        int64_t lsh[2] = {cases[i].B, cases[i].T};
        int lnd = cases[i].B ? 2 : 1;
        lce_cfg cfg = {labels_of(40 + i, lnd, cases[i].B ? lsh : lsh + 1, cases[i].V, cases[i].ignore),
                       true, cases[i].bias};
        gjt_check c = {.name = "linear_cross_entropy f64", .fn = head, .ctx = &cfg,
                       .n_in = cases[i].bias ? 3 : 2, .eps = 1e-6, .atol = 1e-7, .rtol = 1e-6,
                       .data_seed = 200 + i};
        c.in[0] = (gjt_input){.ndim = lnd + 1, .lo = -1, .hi = 1};
        memcpy(c.in[0].shape, cases[i].B ? lsh : lsh + 1, (size_t)lnd * sizeof(int64_t));
        c.in[0].shape[lnd] = cases[i].C;
        c.in[1] = (gjt_input){.ndim = 2, .shape = {cases[i].V, cases[i].C}, .lo = -1, .hi = 1};
        c.in[2] = (gjt_input){.ndim = 1, .shape = {cases[i].V}, .lo = -0.5, .hi = 0.5};
        if (i == 1) c.in[1].view = GJT_NARROWED; /* a weight read through a view */
        assert_int_equal(gjt_gradcheck(&c), 0);
        gj_release(cfg.labels);
    }
    gj_rt_lce_test_chunk_bytes(0);
}

/* ----------------------------------------- fused against the formula */

/* The fused op and the formula on the same leaves (dtype dt): loss and
 * gradients within tol of the largest magnitude. Returns whether the two
 * losses are the same bits. */
static bool compare(gj_dtype dt, int64_t N, int64_t C, int64_t V, bool bias, bool ignore,
                    double tol, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    gj_tensor *x[3] = {gjt_uniform(&r, dt, 2, (int64_t[]){N, C}, -1, 1),
                       gjt_uniform(&r, dt, 2, (int64_t[]){V, C}, -1, 1),
                       gjt_uniform(&r, dt, 1, (int64_t[]){V}, -0.5, 0.5)};
    for (int i = 0; i < 3; i++) gj_set_requires_grad(x[i], true);
    lce_cfg cfg = {labels_of(seed, 1, &N, V, ignore), true, bias};
    double l[2], *g[2][3] = {{0}};
    for (int f = 0; f < 2; f++) {
        cfg.fused = f == 1;
        gj_scope_push();
        gj_tensor *loss = head(x, &cfg);
        assert_non_null(loss);
        l[f] = gj_tensor_item(loss);
        assert_int_equal(gjt_backward(loss, NULL, false), 0);
        for (int i = 0; i < (bias ? 3 : 2); i++) {
            g[f][i] = gjt_values(gj_tensor_grad(x[i]));
            gj_tensor_set_grad(x[i], NULL);
        }
        gj_scope_pop();
    }
    char what[96];
    snprintf(what, sizeof what, "dtype %d N %lld V %lld: loss", (int)dt, (long long)N, (long long)V);
    assert_true(gjt_allclose(what, &l[1], &l[0], 1, tol * fabs(l[0]), 0));
    int64_t n[3] = {N * C, V * C, V};
    for (int i = 0; i < (bias ? 3 : 2); i++) {
        double big = 0;
        for (int64_t k = 0; k < n[i]; k++) big = fmax(big, fabs(g[0][i][k]));
        snprintf(what, sizeof what, "dtype %d N %lld V %lld: gradient %d", (int)dt, (long long)N,
                 (long long)V, i);
        assert_true(gjt_allclose(what, g[1][i], g[0][i], n[i], tol * big, 0));
        free(g[0][i]), free(g[1][i]);
    }
    gj_release(cfg.labels);
    for (int i = 0; i < 3; i++) gj_release(x[i]);
    return memcmp(&l[0], &l[1], sizeof l[0]) == 0;
}

static void test_against_formula(void **state) {
    (void)state;
    for (int chunks = 0; chunks < 2; chunks++) {
        gj_rt_lce_test_chunk_bytes(chunks ? 4 * 300 * 7 : 0); /* 7 rows of V = 300 */
        compare(GJ_F64, 50, 24, 300, true, true, 1e-12, 5);
        compare(GJ_F64, 33, 16, 301, false, false, 1e-12, 6);
        compare(GJ_F32, 50, 24, 300, true, true, 1e-5, 7);
        compare(GJ_F32, 64, 32, 300, false, false, 1e-5, 8);
    }
    gj_rt_lce_test_chunk_bytes(0);
    /* one chunk, no bias, nothing ignored: the unfused loss's bits */
    assert_true(compare(GJ_F32, 64, 32, 300, false, false, 1e-5, 9));
    assert_true(compare(GJ_F64, 40, 16, 120, false, false, 1e-12, 10));
}

/* bf16 leaves against f64 leaves holding the same values. */
static void test_bf16(void **state) {
    (void)state;
    for (int chunks = 0; chunks < 2; chunks++) {
        gj_rt_lce_test_chunk_bytes(chunks ? 4 * 130 * 5 : 0);
        for (int bias = 0; bias < 2; bias++) {
            lce_cfg cfg = {labels_of(77, 1, (int64_t[]){21}, 130, true), true, bias == 1};
            gjt_check c = {.name = "linear_cross_entropy bf16", .fn = head, .ctx = &cfg,
                           .n_in = bias ? 3 : 2, .data_seed = 3};
            c.in[0] = (gjt_input){.ndim = 2, .shape = {21, 16}, .lo = -1, .hi = 1};
            c.in[1] = (gjt_input){.ndim = 2, .shape = {130, 16}, .lo = -1, .hi = 1};
            c.in[2] = (gjt_input){.ndim = 1, .shape = {130}, .lo = -0.5, .hi = 0.5};
            assert_int_equal(gjt_gradcompare(&c, GJ_BF16, 2e-2, 2e-2), 0);
            assert_int_equal(gjt_gradcompare(&c, GJ_F32, 1e-5, 1e-5), 0);
            gj_release(cfg.labels);
        }
    }
    gj_rt_lce_test_chunk_bytes(0);
}

/* The same bits at 1, 2 and 3 threads; the no-grad loss is the grad-mode loss. */
static void test_threads_and_no_grad(void **state) {
    (void)state;
    gj_dtype dts[3] = {GJ_F32, GJ_BF16, GJ_F64};
    gj_rt_lce_test_chunk_bytes(4 * 200 * 9);
    for (int d = 0; d < 3; d++) {
        double *ref[4] = {0};
        for (int t = 1; t <= 3; t++) {
            gj_set_num_threads(t);
            gjt_rng r;
            gjt_rng_seed(&r, 12);
            gj_tensor *x[3] = {gjt_uniform(&r, dts[d], 2, (int64_t[]){40, 24}, -1, 1),
                               gjt_uniform(&r, dts[d], 2, (int64_t[]){200, 24}, -1, 1),
                               gjt_uniform(&r, dts[d], 1, (int64_t[]){200}, -1, 1)};
            for (int i = 0; i < 3; i++) gj_set_requires_grad(x[i], true);
            gj_tensor *lab = labels_of(4, 1, (int64_t[]){40}, 200, true);
            gj_scope_push();
            gj_no_grad_push();
            gj_tensor *l0 = gj_linear_cross_entropy(x[0], x[1], x[2], lab, IGNORE);
            gj_no_grad_pop();
            gj_tensor *l = gj_linear_cross_entropy(x[0], x[1], x[2], lab, IGNORE);
            assert_non_null(l0);
            assert_non_null(l);
            assert_true(gj_tensor_item(l0) == gj_tensor_item(l));
            assert_int_equal(gj_backward(l, NULL), 0);
            double *v[4] = {gjt_values(l), gjt_values(gj_tensor_grad(x[0])),
                            gjt_values(gj_tensor_grad(x[1])), gjt_values(gj_tensor_grad(x[2]))};
            int64_t n[4] = {1, 40 * 24, 200 * 24, 200};
            for (int k = 0; k < 4; k++) {
                if (t == 1) {
                    ref[k] = v[k];
                    continue;
                }
                if (memcmp(ref[k], v[k], (size_t)n[k] * sizeof(double)) != 0)
                    fail_msg("dtype %d, %d threads: output %d differs from 1 thread", d, t, k);
                free(v[k]);
            }
            gj_scope_pop();
            gj_release(lab);
            for (int i = 0; i < 3; i++) gj_release(x[i]);
        }
        for (int k = 0; k < 4; k++) free(ref[k]);
    }
    gj_set_num_threads(0);
    gj_rt_lce_test_chunk_bytes(0);
}

/* ---------------------------------------------- compiled = eager */

/* A small language-model head: x [B, T, C] -> tanh(linear) -> fused head
 * over a vocabulary of V with a bias, tied to an embedding of the labels
 * (the weight read by the embedding and the head, as GPT-2 ties wte). With
 * Vp > V, wte has Vp rows (llm.c's padded vocabulary) and the head reads its
 * first V. Untied, the head alone reads wte. */
typedef struct lm_model {
    gj_tensor *w1, *b1, *wte, *bv;
    int64_t C, V, Vp;
    bool untied; /* no embedding: x alone enters the linear layer */
} lm_model;

static gj_tensor *lm_loss(void *ctx, int n_in, gj_tensor *const *in) {
    lm_model *m = ctx;
    (void)n_in;
    gj_tensor *e = m->untied ? NULL : gj_embedding(m->wte, in[1]); /* [B, T, C] */
    gj_tensor *h = m->untied ? in[0] : e ? gj_add(in[0], e) : NULL;
    h = h ? gj_tanh(gj_linear(h, m->w1, m->b1)) : NULL;
    gj_tensor *w = m->Vp > m->V ? gj_narrow(m->wte, 0, 0, m->V) : m->wte;
    return h && w ? gj_linear_cross_entropy(h, w, m->bv, in[2], IGNORE) : NULL;
}

static void lm_init(lm_model *m, uint64_t seed, int64_t V, int64_t Vp, bool untied) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    m->C = 24;
    m->V = V;
    m->Vp = Vp;
    m->untied = untied;
    m->w1 = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){m->C, m->C}, -0.3, 0.3);
    m->b1 = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){m->C}, -0.1, 0.1);
    m->wte = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){m->Vp, m->C}, -0.3, 0.3);
    m->bv = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){m->V}, -0.1, 0.1);
    gj_tensor *p[4] = {m->w1, m->b1, m->wte, m->bv};
    for (int i = 0; i < 4; i++) gj_set_requires_grad(p[i], true);
}

static void lm_free(lm_model *m) {
    gj_release(m->w1), gj_release(m->b1), gj_release(m->wte), gj_release(m->bv);
}

/* What lm_steps reports of one run. */
typedef struct lm_run {
    double loss[5];
    double *par; /* every parameter after the steps, malloc'd */
    int64_t n_par;
    int64_t compiles, fallbacks;
    int64_t planned_peak; /* compiled: the last program's planned peak */
} lm_run;

/* Five AdamW training steps of the model (vocabulary V, padded to Vp,
 * untied or not), eager or compiled, over batch sizes that change. */
static void lm_steps(bool eager, gj_dtype autocast, int64_t V, int64_t Vp, bool untied, lm_run *out) {
    const int64_t Bs[] = {2, 2, 3, 1, 4};
    lm_model m;
    lm_init(&m, 5, V, Vp, untied);
    gj_tensor *p[4] = {m.w1, m.b1, m.wte, m.bv};
    gj_optim *o = gj_adamw_new(4, p, 1e-2, 0.9, 0.999, 1e-8, 0.01);
    gj_step_opts so = {.eager = eager, .autocast = autocast};
    gj_step *s = gj_step_new(lm_loss, &m, o, &so);
    assert_non_null(s);
    gj_ca_stats s0, st;
    gj_step_stats(&s0);
    for (int i = 0; i < 5; i++) {
        gjt_rng r;
        gjt_rng_seed(&r, 300 + i);
        int64_t sh[2] = {Bs[i], 16};
        gj_tensor *in[3] = {gjt_uniform(&r, GJ_F32, 3, (int64_t[]){Bs[i], 16, m.C}, -1, 1),
                            labels_of(60 + i, 2, sh, m.V, false), labels_of(80 + i, 2, sh, m.V, true)};
        gj_scope_push();
        gj_tensor *l = NULL;
        if (gj_step_run(s, 3, in, &l) != 0) fail_msg("step %d: %s", i, gj_last_error());
        out->loss[i] = gj_tensor_item(l);
        gj_scope_pop();
        for (int k = 0; k < 3; k++) gj_release(in[k]);
    }
    gj_step_stats(&st);
    out->fallbacks = st.fallbacks - s0.fallbacks;
    out->compiles = st.compiles + st.mem_hits + st.disk_hits + st.instantiations -
                    (s0.compiles + s0.mem_hits + s0.disk_hits + s0.instantiations);
    gj_step_memory mm = {0};
    out->planned_peak = !eager && gj_step_memory_stats(s, &mm) == 0 ? mm.planned_peak_bytes : -1;
    out->n_par = 0;
    for (int i = 0; i < 4; i++) out->n_par += gj_tensor_numel(p[i]);
    out->par = malloc((size_t)out->n_par * sizeof(double));
    for (int i = 0, at = 0; i < 4; at += (int)gj_tensor_numel(p[i]), i++)
        assert_int_equal(gj_tensor_to_f64(p[i], out->par + at), 0);
    gj_step_free(s);
    gj_optim_free(o);
    lm_free(&m);
}

/* Eager's and the compiled step's runs: the same losses and parameters,
 * bit for bit, the compiled steps compiled without a fallback. */
static void lm_expect_same(const lm_run *e, const lm_run *c, const char *what) {
    for (int i = 0; i < 5; i++)
        if (memcmp(&e->loss[i], &c->loss[i], sizeof(double)) != 0)
            fail_msg("%s: losses differ at step %d (eager %.17g, compiled %.17g)", what, i,
                     e->loss[i], c->loss[i]);
    assert_int_equal(e->n_par, c->n_par);
    assert_memory_equal(e->par, c->par, (size_t)e->n_par * sizeof(double));
    assert_int_equal(c->fallbacks, 0);
    assert_true(c->compiles >= 5);
}

/* Training steps eager and compiled (gj_step, AdamW), with two chunks of
 * rows at the larger batches: the same bits. f32 and bf16. */
static void test_step_bits(void **state) {
    (void)state;
    gj_rt_lce_test_chunk_bytes(4 * 150 * 40);
    for (int ac = 0; ac < 2; ac++) {
        lm_run e, c;
        lm_steps(true, ac ? GJ_BF16 : GJ_F32, 150, 150, false, &e);
        lm_steps(false, ac ? GJ_BF16 : GJ_F32, 150, 150, false, &c);
        lm_expect_same(&e, &c, ac ? "bf16" : "f32");
        free(e.par), free(c.par);
    }
    gj_rt_lce_test_chunk_bytes(0);
}

/* A padded vocabulary (the head reads the first V of wte's Vp rows), tied
 * and untied, with eager's bits; untied, the compiled step writes the head's
 * weight gradient straight into wte's padded gradient: no second V x C
 * buffer, so the planned peak stays within half a gradient of the unpadded
 * model's (tied, the embedding's gradient beside it sets the peak). */
static void test_step_padded_vocab(void **state) {
    (void)state;
    const int64_t V = 2000, Vp = 2048, C = 24;
    for (int untied = 0; untied < 2; untied++) {
        lm_run e, c, u;
        lm_steps(true, GJ_F32, V, Vp, untied, &e);
        lm_steps(false, GJ_F32, V, Vp, untied, &c);
        lm_expect_same(&e, &c, untied ? "padded vocabulary, untied" : "padded vocabulary");
        lm_steps(false, GJ_F32, V, V, untied, &u);
        assert_true(u.planned_peak > 0 && c.planned_peak > 0);
        if (untied && c.planned_peak >= u.planned_peak + V * C * 4 / 2)
            fail_msg("padded: planned peak %lld bytes, unpadded %lld: a second gradient of %lld bytes",
                     (long long)c.planned_peak, (long long)u.planned_peak, (long long)(V * C * 4));
        free(e.par), free(c.par), free(u.par);
    }
}

/* Compiled autograd's backward through the head: eager's gradients bit
 * for bit, in f32, bf16 and f64, an upstream gradient other than 1. */
static void test_compiled_autograd_bits(void **state) {
    (void)state;
    gj_dtype dts[3] = {GJ_F32, GJ_BF16, GJ_F64};
    for (int d = 0; d < 3; d++) {
        double *g[2][3];
        for (int mode = 0; mode < 2; mode++) {
            gj_set_compiled_autograd(mode == 1);
            gjt_rng r;
            gjt_rng_seed(&r, 31);
            gj_tensor *x[3] = {gjt_uniform(&r, dts[d], 2, (int64_t[]){30, 16}, -1, 1),
                               gjt_uniform(&r, dts[d], 2, (int64_t[]){90, 16}, -1, 1),
                               gjt_uniform(&r, dts[d], 1, (int64_t[]){90}, -1, 1)};
            for (int i = 0; i < 3; i++) gj_set_requires_grad(x[i], true);
            gj_tensor *lab = labels_of(8, 1, (int64_t[]){30}, 90, true);
            gj_scope_push();
            gj_tensor *l = gj_linear_cross_entropy(x[0], x[1], x[2], lab, IGNORE);
            assert_int_equal(gj_backward(gj_mul_scalar(l, 0.37), NULL), 0);
            for (int i = 0; i < 3; i++) g[mode][i] = gjt_values(gj_tensor_grad(x[i]));
            gj_scope_pop();
            gj_release(lab);
            for (int i = 0; i < 3; i++) gj_release(x[i]);
        }
        gj_set_compiled_autograd(gjt_compiled());
        int64_t n[3] = {30 * 16, 90 * 16, 90};
        for (int i = 0; i < 3; i++) {
            if (memcmp(g[0][i], g[1][i], (size_t)n[i] * sizeof(double)) != 0)
                fail_msg("dtype %d: gradient %d of the compiled backward differs from eager's", d, i);
            free(g[0][i]), free(g[1][i]);
        }
    }
}

/* ------------------------------------------------------- bad input */

static void test_bad_input(void **state) {
    (void)state;
    gj_tensor *h = gj_zeros(GJ_F32, 2, (int64_t[]){4, 8});
    gj_tensor *w = gj_zeros(GJ_F32, 2, (int64_t[]){10, 8});
    gj_tensor *w7 = gj_zeros(GJ_F32, 2, (int64_t[]){10, 7});
    gj_tensor *w64 = gj_zeros(GJ_F64, 2, (int64_t[]){10, 8});
    gj_tensor *b9 = gj_zeros(GJ_F32, 1, (int64_t[]){9});
    gj_tensor *lab = labels_of(1, 1, (int64_t[]){4}, 10, true);
    gj_tensor *lab5 = labels_of(1, 1, (int64_t[]){5}, 10, false);
    gj_tensor *labf = gj_zeros(GJ_F32, 1, (int64_t[]){4});
    gj_tensor *bad = gj_from_data(GJ_I64, 1, (int64_t[]){4}, (int64_t[]){1, 2, 10, 3});
    gj_tensor *neg = gj_from_data(GJ_I64, 1, (int64_t[]){4}, (int64_t[]){1, -1, 0, 3});
    assert_null(gj_linear_cross_entropy(h, w7, NULL, lab, IGNORE));
    GJT_ASSERT_ERROR("gj_linear_cross_entropy");
    GJT_ASSERT_ERROR("[10, 7]");
    assert_null(gj_linear_cross_entropy(h, w, b9, lab, IGNORE));
    GJT_ASSERT_ERROR("bias [9]");
    assert_null(gj_linear_cross_entropy(h, w, NULL, lab5, IGNORE));
    GJT_ASSERT_ERROR("labels [5]");
    assert_null(gj_linear_cross_entropy(h, w64, NULL, lab, IGNORE));
    GJT_ASSERT_ERROR("dtype mismatch");
    assert_null(gj_linear_cross_entropy(h, w, NULL, labf, IGNORE));
    GJT_ASSERT_ERROR("i64");
    assert_null(gj_linear_cross_entropy(h, w, NULL, bad, IGNORE));
    GJT_ASSERT_ERROR("labels[2] = 10 is out of range [0, 10) and is not the ignored label -100");
    assert_null(gj_linear_cross_entropy(h, w, NULL, neg, IGNORE));
    GJT_ASSERT_ERROR("labels[1] = -1");
    assert_null(gj_linear_cross_entropy(NULL, w, NULL, lab, IGNORE));
    GJT_ASSERT_ERROR("gj_linear_cross_entropy");
    assert_null(gj_linear_cross_entropy(lab, w, NULL, lab, IGNORE));
    GJT_ASSERT_ERROR("expected a float tensor");
    /* -1 is fine as the ignored label; every row ignored: NaN */
    gj_tensor *l = gj_linear_cross_entropy(h, w, NULL, neg, -1);
    assert_non_null(l);
    assert_true(isfinite(gj_tensor_item(l)));
    gj_tensor *all_ign = gj_from_data(GJ_I64, 1, (int64_t[]){4}, (int64_t[]){7, 7, 7, 7});
    gj_tensor *l2 = gj_linear_cross_entropy(h, w, NULL, all_ign, 7);
    assert_non_null(l2);
    assert_true(isnan(gj_tensor_item(l2)));
    gj_tensor *all[] = {h, w, w7, w64, b9, lab, lab5, labf, bad, neg, l, all_ign, l2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gj_release(all[i]);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradcheck_f64),       cmocka_unit_test(test_against_formula),
        cmocka_unit_test(test_bf16),                cmocka_unit_test(test_threads_and_no_grad),
        cmocka_unit_test(test_bad_input),           cmocka_unit_test(test_step_bits),
        cmocka_unit_test(test_step_padded_vocab),   cmocka_unit_test(test_compiled_autograd_bits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
