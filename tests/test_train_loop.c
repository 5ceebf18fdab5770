/* SPDX-License-Identifier: MIT */
/*
 * test_train_loop.c - training loops end to end: a small MLP fits a fixed
 * synthetic regression problem (a random linear teacher plus a tanh term)
 * with AdamW for 1,000 steps, each step inside gj_scope_push/pop. Live
 * tensor bytes must be identical after step 10 and after step 1000 (no
 * growth), and the loss must fall below half its initial value. The same
 * with SGD + momentum for fewer steps; and the first steps of AdamW and SGD
 * checked against the PyTorch update formulas computed on the host.
 *
 * Compiled autograd: the first 50 AdamW steps run eagerly and compiled from
 * the same seed must give the same loss curve (1e-5 relative, f32), the
 * compiled run compiling once and hitting the cache 49 times. In compiled
 * mode (GJT_COMPILED=1, the ctest entry test_train_loop_compiled) every
 * other backward here runs compiled too (gjt_backward checks it did).
 */
#include "gjtest.h"
#include "jit/cache/cache.h"
#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NS 64 /* samples */
#define NI 4  /* inputs */
#define NH 16 /* hidden */
#define NO 2  /* outputs */

/* x [NS, NI], y [NS, NO] = x A^T + 0.5 tanh(x B^T) + c (fixed seeds). */
static void make_data(gj_tensor **x, gj_tensor **y) {
    gjt_rng r;
    gjt_rng_seed(&r, 2024);
    double xv[NS * NI], yv[NS * NO], A[NO * NI], B[NO * NI], c[NO];
    for (int i = 0; i < NO * NI; i++) {
        A[i] = gjt_rng_uniform(&r, -1, 1);
        B[i] = gjt_rng_uniform(&r, -1, 1);
    }
    for (int o = 0; o < NO; o++)
        c[o] = gjt_rng_uniform(&r, -0.5, 0.5);
    for (int i = 0; i < NS * NI; i++)
        xv[i] = gjt_rng_normal(&r);
    for (int n = 0; n < NS; n++)
        for (int o = 0; o < NO; o++) {
            double a = 0, b = 0;
            for (int k = 0; k < NI; k++) {
                a += xv[n * NI + k] * A[o * NI + k];
                b += xv[n * NI + k] * B[o * NI + k];
            }
            yv[n * NO + o] = a + 0.5 * tanh(b) + c[o];
        }
    *x = gjt_tensor(GJ_F32, 2, (int64_t[]){NS, NI}, xv);
    *y = gjt_tensor(GJ_F32, 2, (int64_t[]){NS, NO}, yv);
    assert_non_null(*x);
    assert_non_null(*y);
}

typedef struct mlp {
    gj_linear_layer l1, l2;
} mlp;

/* mean((l2(tanh(l1(x))) - y)^2); new reference (scoped) or NULL. */
static gj_tensor *mlp_loss(mlp *m, gj_tensor *x, gj_tensor *y) {
    gj_tensor *h = gj_linear_forward(&m->l1, x);
    gj_tensor *a = h ? gj_tanh(h) : NULL;
    gj_tensor *p = a ? gj_linear_forward(&m->l2, a) : NULL;
    gj_tensor *d = p ? gj_sub(p, y) : NULL;
    gj_tensor *sq = d ? gj_mul(d, d) : NULL;
    return sq ? gj_mean(sq, 0, NULL, false) : NULL;
}

/* Trains for `steps` steps; returns initial and final loss, live bytes after
 * step 10 and after the last step, and (if losses is not NULL) every step's
 * loss in losses[0..steps). */
static void train(bool adamw, int steps, double *loss0, double *loss_end, int64_t *live10,
                  int64_t *live_end, double *losses) {
    int64_t live_start = gjt_live_bytes();
    gj_tensor *x, *y;
    make_data(&x, &y);
    gj_manual_seed(1);
    mlp m;
    assert_int_equal(gj_linear_init(&m.l1, NI, NH, true, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&m.l2, NH, NO, true, GJ_F32), 0);
    assert_int_equal(m.l1.in_features, NI);
    assert_int_equal(m.l1.out_features, NH);
    assert_true(gjt_shape_is(m.l1.weight, 2, (int64_t[]){NH, NI}));
    assert_true(gjt_shape_is(m.l1.bias, 1, (int64_t[]){NH}));
    assert_true(gj_requires_grad(m.l1.weight));
    gj_tensor *params[4] = {m.l1.weight, m.l1.bias, m.l2.weight, m.l2.bias};
    gj_optim *opt = adamw ? gj_adamw_new(4, params, 1e-2, 0.9, 0.999, 1e-8, 1e-4)
                          : gj_sgd_new(4, params, 0.05, 0.9, 0.0);
    assert_non_null(opt);
    for (int it = 1; it <= steps; it++) {
        gj_scope_push();
        gj_optim_zero_grad(opt);
        assert_null(gj_tensor_grad(m.l1.weight));
        gj_tensor *loss = mlp_loss(&m, x, y);
        assert_non_null(loss);
        double lv = gj_tensor_item(loss);
        assert_true(isfinite(lv));
        if (losses)
            losses[it - 1] = lv;
        if (it == 1)
            *loss0 = lv;
        *loss_end = lv;
        assert_int_equal(gjt_backward(loss, NULL, false), 0);
        assert_non_null(gj_tensor_grad(m.l2.bias));
        assert_int_equal(gj_optim_step(opt), 0);
        gj_scope_pop();
        if (it == 10)
            *live10 = gjt_live_bytes();
    }
    *live_end = gjt_live_bytes();
    gj_optim_free(opt);
    gj_linear_free(&m.l1);
    gj_linear_free(&m.l2);
    gj_release(x);
    gj_release(y);
    assert_int_equal(gjt_live_bytes(), live_start);
}

static void test_adamw_1000_steps(void **s) {
    double l0 = 0, l1 = 0;
    int64_t live10 = 0, live_end = 0;
    train(true, 1000, &l0, &l1, &live10, &live_end, NULL);
    fprintf(stderr, "adamw: loss %.5f -> %.5f; live bytes after step 10: %lld, after 1000: %lld\n",
            l0, l1, (long long)live10, (long long)live_end);
    assert_int_equal(live_end, live10);
    assert_true(l1 < 0.5 * l0);
}

static void test_sgd_momentum_300_steps(void **s) {
    double l0 = 0, l1 = 0;
    int64_t live10 = 0, live_end = 0;
    train(false, 300, &l0, &l1, &live10, &live_end, NULL);
    fprintf(stderr, "sgd: loss %.5f -> %.5f\n", l0, l1);
    assert_int_equal(live_end, live10);
    assert_true(l1 < 0.5 * l0);
}

/* The first three updates of each optimizer against the PyTorch formulas,
 * with gradients L = sum(p * G_t) (so dL/dp = G_t exactly). */
static void run_update_check(bool adamw) {
    int64_t live0 = gjt_live_bytes();
    const double p0[3] = {0.5, -1.0, 2.0};
    const double G[3][3] = {{0.1, -0.2, 0.3}, {-0.4, 0.5, 0.05}, {0.2, 0.2, -0.6}};
    const double lr = 0.1, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.05, mom = 0.8;
    gj_tensor *p = gjt_tensor(GJ_F64, 1, (int64_t[]){3}, p0);
    assert_int_equal(gj_set_requires_grad(p, true), 0);
    gj_optim *o = adamw ? gj_adamw_new(1, &p, lr, b1, b2, eps, wd)
                        : gj_sgd_new(1, &p, lr, mom, wd);
    assert_non_null(o);
    double ref[3], m1[3] = {0}, v2[3] = {0}, buf[3] = {0};
    memcpy(ref, p0, sizeof ref);
    for (int t = 1; t <= 3; t++) {
        gj_scope_push();
        gj_optim_zero_grad(o);
        gj_tensor *g = gjt_tensor(GJ_F64, 1, (int64_t[]){3}, G[t - 1]);
        assert_int_equal(gjt_backward(gj_sum(gj_mul(p, g), 0, NULL, false), NULL, false), 0);
        assert_int_equal(gj_optim_step(o), 0);
        gj_scope_pop();
        for (int i = 0; i < 3; i++) {
            double gi = G[t - 1][i];
            if (adamw) {
                ref[i] *= 1 - lr * wd;
                m1[i] = b1 * m1[i] + (1 - b1) * gi;
                v2[i] = b2 * v2[i] + (1 - b2) * gi * gi;
                double mh = m1[i] / (1 - pow(b1, t)), vh = v2[i] / (1 - pow(b2, t));
                ref[i] -= lr * mh / (sqrt(vh) + eps);
            } else {
                gi += wd * ref[i];
                buf[i] = t == 1 ? gi : mom * buf[i] + gi;
                ref[i] -= lr * buf[i];
            }
        }
        char nm[64];
        snprintf(nm, sizeof nm, "%s step %d", adamw ? "adamw" : "sgd", t);
        assert_true(gjt_tensor_close(nm, p, ref, 1e-12, 1e-9));
    }
    /* set_lr takes effect */
    gj_optim_set_lr(o, 0.0);
    double before[3];
    assert_int_equal(gj_tensor_to_f64(p, before), 0);
    gj_scope_push();
    gj_optim_zero_grad(o);
    assert_int_equal(gjt_backward(gj_sum(gj_mul(p, p), 0, NULL, false), NULL, false), 0);
    assert_int_equal(gj_optim_step(o), 0);
    gj_scope_pop();
    assert_true(gjt_tensor_close("lr 0: unchanged", p, before, 0, 0));
    assert_true(gj_is_leaf(p));
    assert_true(gj_requires_grad(p));
    gj_optim_free(o);
    gj_release(p);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_adamw_update_formula(void **s) { run_update_check(true); }
static void test_sgd_update_formula(void **s) { run_update_check(false); }

/* 50 AdamW steps eagerly, then compiled (memory cache emptied, disk cache
 * off, so the compiled run must compile exactly once), from the same seed:
 * the loss curves agree within 1e-5 relative at every step, and the compiled
 * run counts 50 backwards, 1 compile, 49 memory hits and no fallback. */
static void test_compiled_matches_eager_50_steps(void **s) {
    enum { STEPS = 50 };
    double loss[2][STEPS];
    bool was_on = gj_compiled_autograd_enabled();
    char dir[1024] = "";
    if (gj_jit_disk_dir())
        snprintf(dir, sizeof dir, "%s", gj_jit_disk_dir());
    gj_jit_set_disk_cache(NULL);
    gj_ca_stats a = {0}, b = {0};
    for (int mode = 0; mode < 2; mode++) {
        double l0 = 0, l1 = 0;
        int64_t live10 = 0, live_end = 0;
        gj_set_compiled_autograd(mode == 1);
        if (mode == 1) {
            gj_jit_clear_cache();
            a = gjt_ca_now();
        }
        train(true, STEPS, &l0, &l1, &live10, &live_end, loss[mode]);
        if (mode == 1)
            b = gjt_ca_now();
        assert_int_equal(live_end, live10);
    }
    gj_set_compiled_autograd(was_on);
    gj_jit_set_disk_cache(dir);
    double worst = 0.0;
    int worst_step = 0;
    for (int k = 0; k < STEPS; k++) {
        double rel = fabs(loss[1][k] - loss[0][k]) / fabs(loss[0][k]);
        if (!(rel <= worst)) {
            worst = rel;
            worst_step = k + 1;
        }
    }
    long long compiles = (long long)(b.compiles - a.compiles);
    long long hits = (long long)(b.mem_hits - a.mem_hits + b.disk_hits - a.disk_hits);
    long long fallbacks = (long long)(b.fallbacks - a.fallbacks);
    fprintf(stderr,
            "eager vs compiled, %d steps: loss %.7g -> %.7g (eager) / %.7g -> %.7g (compiled), "
            "max relative difference %.3g (step %d); %lld backwards, %lld compile(s), %lld "
            "cache hit(s), %lld fallback(s)\n",
            STEPS, loss[0][0], loss[0][STEPS - 1], loss[1][0], loss[1][STEPS - 1], worst,
            worst > 0 ? worst_step : 0, (long long)(b.backwards - a.backwards), compiles, hits,
            fallbacks);
    if (fallbacks)
        fprintf(stderr, "last fallback: '%s'\n", gj_compiled_autograd_last_fallback());
    assert_true(worst <= 1e-5);
    assert_int_equal(b.backwards - a.backwards, STEPS);
    assert_int_equal(compiles, 1);
    assert_int_equal(hits, STEPS - 1);
    assert_int_equal(fallbacks, 0);
    assert_true(loss[1][STEPS - 1] < loss[1][0]);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw_update_formula),
        cmocka_unit_test(test_sgd_update_formula),
        cmocka_unit_test(test_adamw_1000_steps),
        cmocka_unit_test(test_sgd_momentum_300_steps),
        cmocka_unit_test(test_compiled_matches_eager_50_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
