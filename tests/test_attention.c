/* SPDX-License-Identifier: MIT */
/*
 * test_attention.c - gj_scaled_dot_product_attention, the fused attention
 * (runtime/attention.h).
 *
 *   - f64 finite differences of the fused op (causal and not, sizes that
 *     are not multiples of the 64-row blocks, D != E, strided inputs);
 *   - the fused op against the unfused formula (matmul, scale, masked
 *     fill, softmax, matmul) in f64 (values and gradients within 1e-12 of
 *     the largest) and in f32 (within 1e-5); bf16 against f32 within bf16's
 *     resolution; dropout against the unfused formula with gj_dropout on
 *     the probabilities (the same mask);
 *   - the bits do not depend on the thread count;
 *   - bad arguments are refused with a message naming the op, the shapes
 *     and the dtypes.
 */
#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------- formulas */

typedef struct attn_cfg {
    bool causal;
    double scale, p;
    bool fused;
} attn_cfg;

/* The unfused formula: softmax(q k^T scale [+ causal mask]) [dropout] v. */
static gj_tensor *unfused(gj_tensor *q, gj_tensor *k, gj_tensor *v, const attn_cfg *c) {
    int64_t T = gj_tensor_shape(q)[2], S = gj_tensor_shape(k)[2];
    gj_tensor *kt = gj_transpose(k, 2, 3);
    gj_tensor *att = kt ? gj_matmul(q, kt) : NULL;
    double scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)gj_tensor_shape(q)[3]);
    att = att ? gj_mul_scalar(att, scale) : NULL;
    if (att && c->causal) {
        double *mv = calloc((size_t)(T * S), sizeof *mv);
        for (int64_t i = 0; i < T; i++)
            for (int64_t j = 0; j < S; j++)
                mv[i * S + j] = j > i;
        gj_tensor *mask = gjt_tensor(gj_tensor_dtype(att), 2, (int64_t[]){T, S}, mv);
        free(mv);
        att = gj_masked_fill(att, mask, -INFINITY);
        gj_release(mask);
    }
    att = att ? gj_softmax(att, -1) : NULL;
    if (att && c->p > 0)
        att = gj_dropout(att, c->p, true);
    return att ? gj_matmul(att, v) : NULL;
}

static gj_tensor *attn(gj_tensor **in, void *ctx) {
    const attn_cfg *c = ctx;
    if (c->fused)
        return gj_scaled_dot_product_attention(in[0], in[1], in[2], c->causal, c->scale, c->p,
                                               true);
    return unfused(in[0], in[1], in[2], c);
}

/* q, k, v as views of one [B, T, 3, H, D] tensor (a fused qkv projection's
 * layout): strided over (b, h, t). */
static gj_tensor *attn_strided(gj_tensor **in, void *ctx) {
    const int64_t *s = gj_tensor_shape(in[0]); /* [B, T, 3 H D] */
    int64_t B = s[0], T = s[1], HD = s[2] / 3, H = 2, D = HD / H;
    gj_tensor *qkv[3];
    for (int i = 0; i < 3; i++) {
        gj_tensor *x = gj_narrow(in[0], 2, i * HD, HD);
        x = x ? gj_reshape(x, 4, (int64_t[]){B, T, H, D}) : NULL;
        qkv[i] = x ? gj_permute(x, (int[]){0, 2, 1, 3}) : NULL;
    }
    return attn(qkv, ctx);
}

static gjt_input in4(int64_t B, int64_t H, int64_t T, int64_t D) {
    gjt_input x = {.ndim = 4, .shape = {B, H, T, D}, .lo = -1, .hi = 1};
    return x;
}

/* ------------------------------------------------ finite differences */

static void test_gradcheck_f64(void **state) {
    (void)state;
    const struct {
        int64_t B, H, T, S, D, E;
        bool causal;
        double scale;
    } cases[] = {
        {1, 1, 5, 5, 3, 3, true, 0},     {2, 2, 7, 9, 4, 3, false, 0},
        {1, 2, 70, 70, 8, 8, true, 0},   {1, 1, 66, 130, 5, 6, false, 0.7},
        {1, 1, 129, 129, 4, 4, true, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        attn_cfg cfg = {cases[i].causal, cases[i].scale, 0, true};
        gjt_check c = {.name = "sdpa f64", .fn = attn, .ctx = &cfg, .n_in = 3,
                       .eps = 1e-6, .atol = 1e-7, .rtol = 1e-6, .data_seed = 100 + i,
                       .sample = 48};
        c.in[0] = in4(cases[i].B, cases[i].H, cases[i].T, cases[i].D);
        c.in[1] = in4(cases[i].B, cases[i].H, cases[i].S, cases[i].D);
        c.in[2] = in4(cases[i].B, cases[i].H, cases[i].S, cases[i].E);
        if (i == 1) c.in[0].view = GJT_TRANSPOSED; /* a q whose rows are strided */
        assert_int_equal(gjt_gradcheck(&c), 0);
    }
    /* strided q, k, v out of one qkv tensor */
    attn_cfg cfg = {true, 0, 0, true};
    gjt_check c = {.name = "sdpa f64, views of qkv", .fn = attn_strided, .ctx = &cfg, .n_in = 1,
                   .eps = 1e-6, .atol = 1e-7, .rtol = 1e-6, .data_seed = 7, .sample = 64};
    c.in[0] = (gjt_input){.ndim = 3, .shape = {2, 67, 3 * 2 * 4}, .lo = -1, .hi = 1};
    assert_int_equal(gjt_gradcheck(&c), 0);
}

/* ----------------------------------------- fused against the formula */

/* The fused op and the formula on the same leaves: outputs and gradients
 * within tol of the largest magnitude. */
static void compare(gj_dtype dt, int64_t B, int64_t H, int64_t T, int64_t S, int64_t D, int64_t E,
                    attn_cfg cfg, double tol, uint64_t seed) {
    gjt_rng r;
    gj_tensor *leaf[2][3];
    int64_t shp[3][4] = {{B, H, T, D}, {B, H, S, D}, {B, H, S, E}};
    for (int side = 0; side < 2; side++) {
        gjt_rng_seed(&r, seed);
        for (int i = 0; i < 3; i++) {
            leaf[side][i] = gjt_uniform(&r, dt, 4, shp[i], -1, 1);
            gj_set_requires_grad(leaf[side][i], true);
        }
    }
    gj_tensor *gy = gjt_uniform(&r, dt, 4, (int64_t[]){B, H, T, E}, -1, 1);
    double *out[2], *grad[2][3];
    for (int side = 0; side < 2; side++) {
        gj_scope_push();
        attn_cfg c = cfg;
        c.fused = side == 0;
        if (cfg.p > 0) gj_manual_seed(99); /* the same mask both sides */
        gj_tensor *y = attn(leaf[side], &c);
        assert_non_null(y);
        gj_tensor *l = gj_sum(gj_mul(y, gy), 0, NULL, false);
        assert_int_equal(gj_backward(l, NULL), 0);
        out[side] = gjt_values(y);
        for (int i = 0; i < 3; i++) grad[side][i] = gjt_values(gj_tensor_grad(leaf[side][i]));
        gj_scope_pop();
    }
    int64_t n[4] = {B * H * T * E, B * H * T * D, B * H * S * D, B * H * S * E};
    double *want[4] = {out[1], grad[1][0], grad[1][1], grad[1][2]};
    double *got[4] = {out[0], grad[0][0], grad[0][1], grad[0][2]};
    const char *what[4] = {"output", "gq", "gk", "gv"};
    for (int k = 0; k < 4; k++) {
        double mag = 0;
        for (int64_t x = 0; x < n[k]; x++) mag = fmax(mag, fabs(want[k][x]));
        char label[160];
        snprintf(label, sizeof label, "%s %s B%lld H%lld T%lld S%lld D%lld E%lld causal %d p %g",
                 what[k], dt == GJ_F64 ? "f64" : dt == GJ_F32 ? "f32" : "bf16", (long long)B,
                 (long long)H, (long long)T, (long long)S, (long long)D, (long long)E, cfg.causal,
                 cfg.p);
        assert_true(gjt_allclose(label, got[k], want[k], n[k], tol * mag, 0));
    }
    for (int side = 0; side < 2; side++) {
        free(out[side]);
        for (int i = 0; i < 3; i++) {
            free(grad[side][i]);
            gj_release(leaf[side][i]);
        }
    }
    gj_release(gy);
}

static void test_against_formula(void **state) {
    (void)state;
    attn_cfg causal = {true, 0, 0, true}, full = {false, 0.3, 0, true};
    compare(GJ_F64, 1, 2, 200, 200, 16, 16, causal, 1e-12, 1);
    compare(GJ_F64, 2, 1, 65, 127, 8, 12, full, 1e-12, 2);
    compare(GJ_F32, 1, 3, 256, 256, 64, 64, causal, 2e-5, 3);
    compare(GJ_F32, 1, 2, 100, 33, 32, 16, full, 2e-5, 4);
    /* dropout on the probabilities: the mask gj_dropout draws */
    attn_cfg drop = {true, 0, 0.25, true};
    compare(GJ_F64, 1, 2, 90, 90, 8, 8, drop, 1e-12, 5);
    drop.causal = false;
    compare(GJ_F32, 2, 1, 70, 50, 16, 8, drop, 2e-5, 6);
}

/* bf16 against f32 on the same (bf16-representable) values. */
static void test_bf16(void **state) {
    (void)state;
    attn_cfg cfg = {true, 0, 0, true};
    gjt_check c = {.name = "sdpa bf16", .fn = attn, .ctx = &cfg, .n_in = 3, .data_seed = 11};
    c.in[0] = in4(1, 2, 100, 32);
    c.in[1] = in4(1, 2, 100, 32);
    c.in[2] = in4(1, 2, 100, 32);
    assert_int_equal(gjt_gradcompare(&c, GJ_BF16, 2e-2, 2e-2), 0);
    assert_int_equal(gjt_gradcompare(&c, GJ_F32, 1e-5, 1e-5), 0);
}

/* ------------------------------------------------------- determinism */

static void test_thread_counts(void **state) {
    (void)state;
    gj_dtype dts[3] = {GJ_F32, GJ_BF16, GJ_F64};
    for (int d = 0; d < 3; d++) {
        double *ref[4] = {NULL, NULL, NULL, NULL};
        for (int t = 1; t <= 3; t++) {
            gj_set_num_threads(t);
            gjt_rng r;
            gjt_rng_seed(&r, 21);
            gj_tensor *x[3];
            for (int i = 0; i < 3; i++) {
                x[i] = gjt_uniform(&r, dts[d], 4, (int64_t[]){2, 3, 150, 24}, -2, 2);
                gj_set_requires_grad(x[i], true);
            }
            gj_scope_push();
            gj_manual_seed(5);
            gj_tensor *y = gj_scaled_dot_product_attention(x[0], x[1], x[2], true, 0, 0.1, true);
            assert_non_null(y);
            assert_int_equal(gj_backward(gj_sum(gj_mul(y, y), 0, NULL, false), NULL), 0);
            double *v[4] = {gjt_values(y), gjt_values(gj_tensor_grad(x[0])),
                            gjt_values(gj_tensor_grad(x[1])), gjt_values(gj_tensor_grad(x[2]))};
            int64_t n = 2 * 3 * 150 * 24;
            for (int k = 0; k < 4; k++) {
                if (!ref[k]) {
                    ref[k] = v[k];
                    continue;
                }
                if (memcmp(ref[k], v[k], (size_t)n * sizeof(double)) != 0)
                    fail_msg("dtype %d, %d threads: output %d differs from 1 thread", d, t, k);
                free(v[k]);
            }
            gj_scope_pop();
            for (int i = 0; i < 3; i++) gj_release(x[i]);
        }
        for (int k = 0; k < 4; k++) free(ref[k]);
    }
    gj_set_num_threads(0);
}

/* ---------------------------------------------- compiled = eager */

/* A causal self-attention layer: x [B, T, C] -> qkv -> heads (views of
 * the qkv product) -> fused attention -> merged -> projection; the loss the
 * mean of y*y. */
typedef struct attn_model {
    gj_tensor *wqkv, *bqkv, *wo, *bo;
    int64_t C, H;
    gj_dtype dt;
} attn_model;

static gj_tensor *layer_loss(void *ctx, int n_in, gj_tensor *const *in) {
    attn_model *m = ctx;
    (void)n_in;
    const int64_t *xs = gj_tensor_shape(in[0]);
    int64_t B = xs[0], T = xs[1], C = m->C, H = m->H;
    gj_tensor *qkv = gj_linear(in[0], m->wqkv, m->bqkv); /* [B, T, 3C] */
    gj_tensor *h[3];
    for (int i = 0; i < 3; i++) {
        gj_tensor *x = qkv ? gj_narrow(qkv, 2, i * C, C) : NULL;
        x = x ? gj_reshape(x, 4, (int64_t[]){B, T, H, C / H}) : NULL;
        h[i] = x ? gj_permute(x, (int[]){0, 2, 1, 3}) : NULL;
    }
    gj_tensor *y = h[2] ? gj_scaled_dot_product_attention(h[0], h[1], h[2], true, 0, 0, true) : NULL;
    y = y ? gj_permute(y, (int[]){0, 2, 1, 3}) : NULL;
    y = y ? gj_reshape(y, 3, (int64_t[]){B, T, C}) : NULL;
    y = y ? gj_linear(y, m->wo, m->bo) : NULL;
    return y ? gj_mean(gj_mul(y, y), 0, NULL, false) : NULL;
}

static void model_init(attn_model *m, gj_dtype dt, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    m->C = 32;
    m->H = 2;
    m->dt = dt;
    m->wqkv = gjt_uniform(&r, dt, 2, (int64_t[]){3 * m->C, m->C}, -0.3, 0.3);
    m->bqkv = gjt_uniform(&r, dt, 1, (int64_t[]){3 * m->C}, -0.1, 0.1);
    m->wo = gjt_uniform(&r, dt, 2, (int64_t[]){m->C, m->C}, -0.3, 0.3);
    m->bo = gjt_uniform(&r, dt, 1, (int64_t[]){m->C}, -0.1, 0.1);
    gj_tensor *p[4] = {m->wqkv, m->bqkv, m->wo, m->bo};
    for (int i = 0; i < 4; i++) gj_set_requires_grad(p[i], true);
}

static void model_free(attn_model *m) {
    gj_release(m->wqkv), gj_release(m->bqkv), gj_release(m->wo), gj_release(m->bo);
}

/* Training steps eager and compiled (gj_step, AdamW), over sequence lengths
 * that change (a symbolic program's generic attention kernel after the
 * second): the same losses and parameters, bit for bit; the compiled steps
 * ran compiled. Under autocast (bf16) too. */
static void test_step_bits(void **state) {
    (void)state;
    const int64_t Ts[] = {70, 70, 64, 130, 50};
    for (int ac = 0; ac < 2; ac++) {
        double loss[2][5];
        double *par[2];
        int64_t n_par = 0;
        gj_ca_stats st = {0};
        for (int mode = 0; mode < 2; mode++) {
            attn_model m;
            model_init(&m, GJ_F32, 77);
            gj_tensor *p[4] = {m.wqkv, m.bqkv, m.wo, m.bo};
            gj_optim *o = gj_adamw_new(4, p, 1e-2, 0.9, 0.999, 1e-8, 0.01);
            gj_step_opts so = {.eager = mode == 0, .autocast = ac ? GJ_BF16 : GJ_F32};
            gj_step *s = gj_step_new(layer_loss, &m, o, &so);
            assert_non_null(s);
            gj_ca_stats s0;
            gj_step_stats(&s0);
            for (int i = 0; i < 5; i++) {
                gjt_rng r;
                gjt_rng_seed(&r, 900 + i);
                gj_tensor *x = gjt_uniform(&r, GJ_F32, 3, (int64_t[]){2, Ts[i], m.C}, -1, 1);
                gj_scope_push();
                gj_tensor *l = NULL;
                if (gj_step_run(s, 1, &x, &l) != 0) fail_msg("step %d: %s", i, gj_last_error());
                loss[mode][i] = gj_tensor_item(l);
                gj_scope_pop();
                gj_release(x);
            }
            gj_step_stats(&st);
            st.fallbacks -= s0.fallbacks;
            st.compiles += st.mem_hits + st.disk_hits + st.instantiations;
            st.compiles -= s0.compiles + s0.mem_hits + s0.disk_hits + s0.instantiations;
            n_par = 0;
            for (int i = 0; i < 4; i++) n_par += gj_tensor_numel(p[i]);
            par[mode] = malloc((size_t)n_par * sizeof(double));
            for (int i = 0, at = 0; i < 4; at += (int)gj_tensor_numel(p[i]), i++)
                assert_int_equal(gj_tensor_to_f64(p[i], par[mode] + at), 0);
            gj_step_free(s);
            gj_optim_free(o);
            model_free(&m);
        }
        if (memcmp(loss[0], loss[1], sizeof loss[0]) != 0)
            fail_msg("autocast %d: losses differ (eager %.17g, compiled %.17g at step 0)", ac,
                     loss[0][0], loss[1][0]);
        assert_memory_equal(par[0], par[1], (size_t)n_par * sizeof(double));
        assert_int_equal(st.fallbacks, 0);
        assert_true(st.compiles >= 5); /* every compiled step made or ran a program */
        free(par[0]), free(par[1]);
    }
}

/* Compiled autograd's backward of attention: eager's gradients bit for
 * bit, in f32, bf16 and f64. */
static void test_compiled_autograd_bits(void **state) {
    (void)state;
    gj_dtype dts[3] = {GJ_F32, GJ_BF16, GJ_F64};
    for (int d = 0; d < 3; d++) {
        double *g[2][3];
        for (int mode = 0; mode < 2; mode++) {
            gj_set_compiled_autograd(mode == 1);
            gjt_rng r;
            gjt_rng_seed(&r, 31);
            gj_tensor *x[3];
            for (int i = 0; i < 3; i++) {
                x[i] = gjt_uniform(&r, dts[d], 4, (int64_t[]){1, 2, 100, 64}, -1, 1);
                gj_set_requires_grad(x[i], true);
            }
            gj_scope_push();
            gj_tensor *y = gj_scaled_dot_product_attention(x[0], x[1], x[2], d != 1, 0, 0, true);
            assert_int_equal(gj_backward(gj_sum(gj_mul(y, y), 0, NULL, false), NULL), 0);
            for (int i = 0; i < 3; i++) g[mode][i] = gjt_values(gj_tensor_grad(x[i]));
            gj_scope_pop();
            for (int i = 0; i < 3; i++) gj_release(x[i]);
        }
        gj_set_compiled_autograd(gjt_compiled());
        for (int i = 0; i < 3; i++) {
            if (memcmp(g[0][i], g[1][i], 2 * 100 * 64 * sizeof(double)) != 0)
                fail_msg("dtype %d: gradient %d of the compiled backward differs from eager's", d, i);
            free(g[0][i]), free(g[1][i]);
        }
    }
}

/* ------------------------------------------------------- bad input */

static void test_bad_input(void **state) {
    (void)state;
    gj_tensor *q = gj_zeros(GJ_F32, 4, (int64_t[]){1, 2, 8, 4});
    gj_tensor *k = gj_zeros(GJ_F32, 4, (int64_t[]){1, 2, 6, 4});
    gj_tensor *v = gj_zeros(GJ_F32, 4, (int64_t[]){1, 2, 6, 5});
    gj_tensor *q3 = gj_zeros(GJ_F32, 3, (int64_t[]){2, 8, 4});
    gj_tensor *k64 = gj_zeros(GJ_F64, 4, (int64_t[]){1, 2, 6, 4});
    gj_tensor *big = gj_zeros(GJ_F32, 4, (int64_t[]){1, 1, 4, 200});
    gj_tensor *lab = gj_zeros(GJ_I64, 4, (int64_t[]){1, 2, 6, 4});
    assert_null(gj_scaled_dot_product_attention(q, k, v, true, 0, 0, true));
    GJT_ASSERT_ERROR("causal attention needs as many keys as queries");
    GJT_ASSERT_ERROR("gj_scaled_dot_product_attention");
    GJT_ASSERT_ERROR("[1, 2, 8, 4]");
    assert_null(gj_scaled_dot_product_attention(q3, k, v, false, 0, 0, true));
    GJT_ASSERT_ERROR("expected q [B, H, T, D]");
    GJT_ASSERT_ERROR("[2, 8, 4]");
    assert_null(gj_scaled_dot_product_attention(q, k64, v, false, 0, 0, true));
    GJT_ASSERT_ERROR("f64");
    assert_null(gj_scaled_dot_product_attention(big, big, big, false, 0, 0, true));
    GJT_ASSERT_ERROR("at most 128");
    assert_null(gj_scaled_dot_product_attention(q, k, v, false, 0, 1.0, true));
    GJT_ASSERT_ERROR("dropout_p must be in [0, 1)");
    assert_null(gj_scaled_dot_product_attention(q, k, v, false, NAN, 0, true));
    GJT_ASSERT_ERROR("scale");
    assert_null(gj_scaled_dot_product_attention(lab, lab, lab, false, 0, 0, true));
    GJT_ASSERT_ERROR("i64");
    assert_null(gj_scaled_dot_product_attention(NULL, k, v, false, 0, 0, true));
    GJT_ASSERT_ERROR("gj_scaled_dot_product_attention");
    /* not training: dropout is off, no mask drawn */
    gj_tensor *y = gj_scaled_dot_product_attention(q, k, v, false, 0, 0.5, false);
    assert_non_null(y);
    gj_release(y);
    gj_tensor *all[] = {q, k, v, q3, k64, big, lab};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gj_release(all[i]);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradcheck_f64), cmocka_unit_test(test_against_formula),
        cmocka_unit_test(test_bf16),          cmocka_unit_test(test_thread_counts),
        cmocka_unit_test(test_bad_input),     cmocka_unit_test(test_step_bits),
        cmocka_unit_test(test_compiled_autograd_bits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
