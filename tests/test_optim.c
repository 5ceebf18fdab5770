/* SPDX-License-Identifier: MIT */
/*
 * test_optim.c - SGD and AdamW against the torch.optim update rules, Lion
 * against its reference implementation's.
 *
 * The expected parameters after each of three steps were computed in Python
 * (double precision) with the torch.optim formulas, for p0 = [1, -2, 0.5]
 * and the gradients G[0..2] below:
 *   SGD:   d = g + wd*p; buf = d (first step) else momentum*buf + d;
 *          p -= lr * (momentum ? buf : d)
 *   AdamW: p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g^2;
 *          p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
 *   Lion:  c = b1*m + (1-b1)*g; p = p*(1-lr*wd) - lr*sign(c);
 *          m = b2*m + (1-b2)*g
 * f64 parameters must match to 1e-14, f32 to 2e-6. bf16 parameters are
 * checked against the same update done in f32 and rounded to bf16.
 */
#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int64_t S3[1] = {3};
static const double P0[3] = {1.0, -2.0, 0.5};
static const double G[3][3] = {{0.5, -0.25, 2.0}, {0.1, 0.3, -1.0}, {-0.4, 0.2, 0.05}};

/* lr 0.1, no momentum, no weight decay */
static const double SGD_PLAIN[3][3] = {
    {0.94999999999999996, -1.9750000000000001, 0.29999999999999999},
    {0.93999999999999995, -2.0049999999999999, 0.40000000000000002},
    {0.97999999999999998, -2.0249999999999999, 0.39500000000000002}};
/* lr 0.1, momentum 0.9, weight decay 0.01 */
static const double SGD_MOM[3][3] = {
    {0.94899999999999995, -1.9730000000000001, 0.29949999999999999},
    {0.89215099999999992, -1.9767270000000001, 0.21875049999999999},
    {0.88009474899999995, -1.9981045730000002, 0.14085719949999997}};
/* lr 0.01, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 */
static const double ADAMW[3][3] = {
    {0.98990000020000002, -1.9898000004, 0.48995000005},
    {0.98177060063844523, -1.9910304676547348, 0.48723763467023817},
    {0.98073542957573734, -1.9947283174326418, 0.4849876973756293}};

/* lr 0.01, betas (0.9, 0.99), weight decay 0.1 */
static const double LION[3][3] = {{0.989, -1.988, 0.4895},
                                  {0.978011, -1.996012, 0.4990105},
                                  {0.987032989, -2.004015988, 0.4885114895}};

static gj_tensor *param(gj_dtype dt, const double *v) {
    gj_tensor *p = gjt_tensor(dt, 1, S3, v);
    assert_non_null(p);
    assert_int_equal(gj_set_requires_grad(p, true), 0);
    return p;
}

/* Sets p's .grad to G[step] in dtype gdt. */
static void set_grad(gj_tensor *p, int step, gj_dtype gdt) {
    gj_tensor *g = gjt_tensor(gdt, 1, S3, G[step]);
    assert_non_null(g);
    assert_int_equal(gj_tensor_set_grad(p, g), 0);
    gj_release(g);
}

/* Three steps of o on p (dtype dt) against want[step]. */
static void run3(gj_optim *o, gj_tensor *p, gj_dtype dt, const double want[3][3], double tol) {
    for (int s = 0; s < 3; s++) {
        set_grad(p, s, dt);
        int64_t v0 = gj_tensor_version(p);
        assert_int_equal(gj_optim_step(o), 0);
        assert_true(gj_tensor_version(p) > v0);
        char what[64];
        snprintf(what, sizeof what, "%s step %d", gj_tensor_dtype(p) == GJ_F64 ? "f64" : "f32",
                 s + 1);
        assert_true(gjt_tensor_close(what, p, want[s], tol, 0));
    }
}

static void sgd_case(gj_dtype dt, double mom, double wd, const double want[3][3], double tol) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p = param(dt, P0);
    gj_optim *o = gj_sgd_new(1, &p, 0.1, mom, wd);
    assert_non_null(o);
    run3(o, p, dt, want, tol);
    gj_optim_free(o);
    gj_release(p);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_sgd_plain(void **s) {
    sgd_case(GJ_F64, 0.0, 0.0, SGD_PLAIN, 1e-14);
    sgd_case(GJ_F32, 0.0, 0.0, SGD_PLAIN, 2e-6);
}

static void test_sgd_momentum(void **s) {
    sgd_case(GJ_F64, 0.9, 0.01, SGD_MOM, 1e-14);
    sgd_case(GJ_F32, 0.9, 0.01, SGD_MOM, 2e-6);
}

static void adamw_case(gj_dtype dt, double tol) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p = param(dt, P0);
    gj_optim *o = gj_adamw_new(1, &p, 0.01, 0.9, 0.999, 1e-8, 0.01);
    assert_non_null(o);
    run3(o, p, dt, ADAMW, tol);
    gj_optim_free(o);
    gj_release(p);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_adamw_f64(void **s) { adamw_case(GJ_F64, 1e-14); }
static void test_adamw_f32(void **s) { adamw_case(GJ_F32, 2e-6); }

/* Lion against its rule; its state goes through a checkpoint (kind "lion",
 * one "exp_avg" per parameter, no step) and a fresh optimizer loaded from
 * it continues to the same values. */
static void test_lion(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    for (int d = 0; d < 2; d++) {
        gj_dtype dt = d ? GJ_F32 : GJ_F64;
        gj_tensor *p = param(dt, P0);
        gj_optim *o = gj_lion_new(1, &p, 0.01, 0.9, 0.99, 0.1);
        assert_non_null(o);
        run3(o, p, dt, LION, d ? 2e-6 : 1e-14);
        gj_state_dict *sd = gj_state_dict_new();
        assert_int_equal(gj_optim_state_dict_add(o, sd, "opt"), 0);
        assert_string_equal(gj_state_dict_get_metadata(sd, "opt.kind"), "lion");
        assert_non_null(gj_state_dict_get(sd, "opt.0.exp_avg"));
        assert_null(gj_state_dict_get(sd, "opt.0.step"));
        double now[3];
        assert_int_equal(gj_tensor_to_f64(p, now), 0);
        gj_tensor *p2 = param(dt, now); /* the same values, another optimizer */
        gj_optim *o2 = gj_lion_new(1, &p2, 0.5, 0.5, 0.5, 0.0);
        assert_int_equal(gj_optim_load_state_dict(o2, sd, "opt"), 0);
        gj_optim *a = gj_adamw_new(1, &p2, 0.01, 0.9, 0.999, 1e-8, 0.0);
        assert_int_not_equal(gj_optim_load_state_dict(a, sd, "opt"), 0);
        GJT_ASSERT_ERROR("lion");
        gj_state_dict_free(sd);
        set_grad(p, 1, dt);
        set_grad(p2, 1, dt);
        assert_int_equal(gj_optim_step(o), 0);
        assert_int_equal(gj_optim_step(o2), 0);
        double x[3], y[3];
        assert_int_equal(gj_tensor_to_f64(p, x), 0);
        assert_int_equal(gj_tensor_to_f64(p2, y), 0);
        assert_memory_equal(x, y, sizeof x);
        gj_optim_free(a);
        gj_optim_free(o2);
        gj_optim_free(o);
        gj_tensor_set_grad(p, NULL);
        gj_tensor_set_grad(p2, NULL);
        gj_release(p);
        gj_release(p2);
    }
    gj_tensor *p = param(GJ_F32, P0);
    assert_null(gj_lion_new(1, &p, 0.01, 1.5, 0.99, 0.0));
    GJT_ASSERT_ERROR("beta1");
    gj_release(p);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A parameter without .grad is skipped: its value and its AdamW step count
 * do not move, so its next update is the one of its own second step. */
static void test_skip_null_grad(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *a = param(GJ_F64, P0), *b = param(GJ_F64, P0);
    gj_tensor *ps[2] = {a, b};
    gj_optim *o = gj_adamw_new(2, ps, 0.01, 0.9, 0.999, 1e-8, 0.01);
    assert_non_null(o);
    set_grad(a, 0, GJ_F64);
    assert_int_equal(gj_optim_step(o), 0); /* b has no grad yet */
    assert_true(gjt_tensor_close("a after step 1", a, ADAMW[0], 1e-14, 0));
    assert_true(gjt_tensor_close("b untouched", b, P0, 0, 0));
    set_grad(b, 0, GJ_F64);
    gj_tensor_set_grad(a, NULL);
    assert_int_equal(gj_optim_step(o), 0);
    assert_true(gjt_tensor_close("a untouched", a, ADAMW[0], 1e-14, 0));
    assert_true(gjt_tensor_close("b after its step 1", b, ADAMW[0], 1e-14, 0));
    set_grad(a, 1, GJ_F64);
    set_grad(b, 1, GJ_F64);
    assert_int_equal(gj_optim_step(o), 0);
    assert_true(gjt_tensor_close("a after step 2", a, ADAMW[1], 1e-14, 0));
    assert_true(gjt_tensor_close("b after its step 2", b, ADAMW[1], 1e-14, 0));
    gj_optim_zero_grad(o);
    assert_null(gj_tensor_grad(a));
    assert_null(gj_tensor_grad(b));
    assert_int_equal(gj_optim_step(o), 0); /* nothing to do */
    assert_true(gjt_tensor_close("a unchanged", a, ADAMW[1], 1e-14, 0));
    gj_optim_free(o);
    gj_release(a);
    gj_release(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* set_lr changes later steps only: plain SGD with lr 0.1 then 0.5. */
static void test_set_lr(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p = param(GJ_F64, P0);
    gj_optim *o = gj_sgd_new(1, &p, 0.1, 0.0, 0.0);
    assert_non_null(o);
    set_grad(p, 0, GJ_F64);
    assert_int_equal(gj_optim_step(o), 0);
    gj_optim_set_lr(o, 0.5);
    set_grad(p, 1, GJ_F64);
    assert_int_equal(gj_optim_step(o), 0);
    double want[3];
    for (int i = 0; i < 3; i++)
        want[i] = P0[i] - 0.1 * G[0][i] - 0.5 * G[1][i];
    assert_true(gjt_tensor_close("set_lr", p, want, 1e-15, 0));
    gj_optim_free(o);
    gj_release(p);
    assert_int_equal(gjt_live_bytes(), live0);
}

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bf16 parameters with f32 grads (mixed precision): the update runs in f32
 * from the bf16 value and the result is rounded to bf16 once per step. */
static void test_bf16_params(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p = param(GJ_BF16, P0);
    gj_optim *o = gj_sgd_new(1, &p, 0.1, 0.9, 0.0);
    assert_non_null(o);
    float ref[3], buf[3];
    for (int i = 0; i < 3; i++)
        ref[i] = bf16_round((float)P0[i]);
    for (int st = 0; st < 3; st++) {
        set_grad(p, st, GJ_F32);
        assert_int_equal(gj_optim_step(o), 0);
        double want[3];
        for (int i = 0; i < 3; i++) {
            float g = (float)G[st][i];
            buf[i] = st == 0 ? g : 0.9f * buf[i] + g;
            ref[i] = bf16_round(ref[i] - 0.1f * buf[i]);
            want[i] = ref[i];
        }
        assert_true(gjt_tensor_close("bf16 sgd", p, want, 0, 0));
    }
    gj_optim_free(o);
    gj_release(p);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The optimizer holds its own reference: releasing the caller's keeps the
 * parameter alive until gj_optim_free. */
static void test_param_reference(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p = param(GJ_F32, P0);
    gj_optim *o = gj_sgd_new(1, &p, 0.1, 0.0, 0.0);
    assert_non_null(o);
    set_grad(p, 0, GJ_F32);
    gj_release(p);
    assert_int_equal(gj_optim_step(o), 0);
    gj_optim_free(o);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_bad_arguments(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *p = param(GJ_F32, P0);
    gj_tensor *idx = gj_zeros(GJ_I64, 1, S3);
    assert_non_null(idx);
    gj_clear_error();
    assert_null(gj_sgd_new(0, &p, 0.1, 0.0, 0.0));
    GJT_ASSERT_ERROR("gj_sgd_new");
    assert_null(gj_sgd_new(1, &idx, 0.1, 0.0, 0.0));
    GJT_ASSERT_ERROR("float");
    assert_null(gj_sgd_new(1, &p, -1.0, 0.0, 0.0));
    GJT_ASSERT_ERROR("lr");
    gj_tensor *twice[2] = {p, p};
    assert_null(gj_adamw_new(2, twice, 0.1, 0.9, 0.999, 1e-8, 0.0));
    GJT_ASSERT_ERROR("same tensor");
    assert_null(gj_adamw_new(1, &p, 0.1, 1.0, 0.999, 1e-8, 0.0));
    GJT_ASSERT_ERROR("beta1");
    assert_null(gj_adamw_new(1, &p, 0.1, 0.9, 0.999, NAN, 0.0));
    GJT_ASSERT_ERROR("eps");
    gj_clear_error();
    assert_int_not_equal(gj_optim_step(NULL), 0);
    GJT_ASSERT_ERROR("gj_optim_step");
    gj_optim_free(NULL);
    gj_release(p);
    gj_release(idx);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sgd_plain),      cmocka_unit_test(test_sgd_momentum),
        cmocka_unit_test(test_adamw_f64),      cmocka_unit_test(test_adamw_f32),
        cmocka_unit_test(test_skip_null_grad), cmocka_unit_test(test_set_lr),
        cmocka_unit_test(test_bf16_params),    cmocka_unit_test(test_param_reference),
        cmocka_unit_test(test_bad_arguments),  cmocka_unit_test(test_lion),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
