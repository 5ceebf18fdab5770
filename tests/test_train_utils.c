/* SPDX-License-Identifier: MIT */
/*
 * test_train_utils.c - gj_clip_grad_norm and the learning-rate schedules
 * against the formulas of torch.nn.utils.clip_grad_norm_ and
 * torch.optim.lr_scheduler (StepLR; linear warm-up then cosine), computed
 * here independently, gj_argmax (every axis, keepdim, ties, NaN) against a
 * reference loop and gj_accuracy, plus their errors.
 */
#include "gjtest.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A leaf of dtype dt whose .grad holds g[0..n) (also of dtype dt). */
static gj_tensor *leaf_with_grad(gj_dtype dt, int64_t n, const double *g) {
    gj_tensor *p = gj_zeros(dt, 1, &n);
    assert_non_null(p);
    assert_int_equal(gj_set_requires_grad(p, true), 0);
    gj_tensor *gt = gjt_tensor(dt, 1, &n, g);
    assert_non_null(gt);
    assert_int_equal(gj_tensor_set_grad(p, gt), 0);
    gj_release(gt);
    return p;
}

static void test_clip_grad_norm(void **state) {
    (void)state;
    double g1[3] = {3, 0, -4}, g2[2] = {12, 0}; /* norm sqrt(9+16+144) = 13 */
    gj_tensor *p[3] = {leaf_with_grad(GJ_F64, 3, g1), leaf_with_grad(GJ_F64, 2, g2), NULL};
    int64_t one = 1;
    p[2] = gj_zeros(GJ_F64, 1, &one); /* no .grad: skipped */
    assert_int_equal(gj_set_requires_grad(p[2], true), 0);
    double norm = 0;
    assert_int_equal(gj_clip_grad_norm(3, p, 20.0, &norm), 0); /* below: untouched */
    assert_true(fabs(norm - 13.0) < 1e-12);
    assert_true(gjt_tensor_close("unclipped", gj_tensor_grad(p[0]), g1, 0, 0));
    assert_int_equal(gj_clip_grad_norm(3, p, 6.5, &norm), 0);
    assert_true(fabs(norm - 13.0) < 1e-12);
    double c = 6.5 / (13.0 + 1e-6), w1[3] = {3 * c, 0, -4 * c}, w2[2] = {12 * c, 0};
    assert_true(gjt_tensor_close("clipped p0", gj_tensor_grad(p[0]), w1, 1e-15, 1e-15));
    assert_true(gjt_tensor_close("clipped p1", gj_tensor_grad(p[1]), w2, 1e-15, 1e-15));
    assert_null(gj_tensor_grad(p[2]));
    assert_int_equal(gj_clip_grad_norm(3, p, 6.5, NULL), 0); /* now at the bound */
    for (int i = 0; i < 3; i++) gj_release(p[i]);

    /* f32 and bf16 gradients: the norm in f64, the scaling in place */
    double g3[4] = {1, 2, 2, 4}; /* norm 5 */
    gj_tensor *q[2] = {leaf_with_grad(GJ_F32, 4, g3), leaf_with_grad(GJ_BF16, 4, g3)};
    assert_int_equal(gj_clip_grad_norm(2, q, 1.0, &norm), 0);
    assert_true(fabs(norm - sqrt(50.0)) < 1e-12);
    double s = 1.0 / (sqrt(50.0) + 1e-6), w3[4] = {s, 2 * s, 2 * s, 4 * s};
    assert_true(gjt_tensor_close("clipped f32", gj_tensor_grad(q[0]), w3, 0, 1e-6));
    assert_true(gjt_tensor_close("clipped bf16", gj_tensor_grad(q[1]), w3, 0, 1.0 / 128));
    for (int i = 0; i < 2; i++) gj_release(q[i]);
}

static void test_clip_grad_norm_errors(void **state) {
    (void)state;
    double g[2] = {1, INFINITY};
    gj_tensor *p = leaf_with_grad(GJ_F64, 2, g);
    double norm = 0;
    assert_int_equal(gj_clip_grad_norm(1, &p, 1.0, &norm), -1);
    assert_true(isinf(norm));
    assert_true(gjt_error_has("gj_clip_grad_norm"));
    assert_true(gjt_error_has("inf"));
    assert_true(isinf(gj_tensor_item_at(gj_tensor_grad(p), 1))); /* untouched */
    assert_true(gj_tensor_item_at(gj_tensor_grad(p), 0) == 1.0);
    assert_int_equal(gj_clip_grad_norm(1, &p, 0.0, NULL), -1);
    assert_true(gjt_error_has("max_norm"));
    assert_int_equal(gj_clip_grad_norm(1, &p, NAN, NULL), -1);
    assert_int_equal(gj_clip_grad_norm(1, NULL, 1.0, NULL), -1);
    gj_tensor *nul = NULL;
    assert_int_equal(gj_clip_grad_norm(1, &nul, 1.0, NULL), -1);
    assert_true(gjt_error_has("parameter 0 is NULL"));
    assert_int_equal(gj_clip_grad_norm(0, NULL, 1.0, &norm), 0); /* nothing to clip */
    assert_true(norm == 0.0);
    gj_release(p);
}

static void test_lr_schedules(void **state) {
    (void)state;
    /* StepLR(step_size 3, gamma 0.5) from 0.1 */
    static const double want_step[8] = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025};
    for (int s = 0; s < 8; s++) assert_true(fabs(gj_lr_step(0.1, s, 3, 0.5) - want_step[s]) < 1e-15);
    /* warm-up 10 then cosine to 1e-4 at step 110 */
    double base = 3e-3, lo = 1e-4;
    assert_true(fabs(gj_lr_cosine(base, 0, 10, 110, lo) - base / 10) < 1e-15);
    assert_true(fabs(gj_lr_cosine(base, 9, 10, 110, lo) - base) < 1e-15);
    assert_true(fabs(gj_lr_cosine(base, 10, 10, 110, lo) - base) < 1e-15);
    assert_true(fabs(gj_lr_cosine(base, 60, 10, 110, lo) - (base + lo) / 2) < 1e-15);
    for (int s = 35; s <= 85; s += 25) {
        double t = (s - 10) / 100.0, want = lo + (base - lo) * 0.5 * (1 + cos(M_PI * t));
        assert_true(fabs(gj_lr_cosine(base, s, 10, 110, lo) - want) < 1e-15);
    }
    assert_true(fabs(gj_lr_cosine(base, 110, 10, 110, lo) - lo) < 1e-15);
    assert_true(fabs(gj_lr_cosine(base, 500, 10, 110, lo) - lo) < 1e-15);
    assert_true(fabs(gj_lr_cosine(base, 0, 0, 100, lo) - base) < 1e-15); /* no warm-up */
    /* monotone: up during warm-up, down after */
    for (int s = 1; s < 120; s++) {
        double a = gj_lr_cosine(base, s - 1, 10, 110, lo), b = gj_lr_cosine(base, s, 10, 110, lo);
        assert_true(s <= 9 ? b > a : b <= a);
    }
    /* errors: NaN and a message */
    assert_true(isnan(gj_lr_step(0.1, 0, 0, 0.5)));
    assert_true(gjt_error_has("gj_lr_step"));
    assert_true(isnan(gj_lr_step(0.1, -1, 3, 0.5)));
    assert_true(isnan(gj_lr_cosine(base, 0, 10, 10, lo)));
    assert_true(gjt_error_has("gj_lr_cosine"));
    assert_true(isnan(gj_lr_cosine(base, -2, 10, 110, lo)));
    assert_true(isnan(gj_lr_cosine(INFINITY, 0, 10, 110, lo)));
}

static void test_argmax_accuracy(void **state) {
    (void)state;
    /* [2, 3, 4] with ties and a NaN: argmax over each axis, as torch.argmax */
    double v[24];
    for (int i = 0; i < 24; i++) v[i] = (double)((i * 7) % 5);
    v[5] = NAN;
    int64_t sh[3] = {2, 3, 4};
    gj_tensor *x = gjt_tensor(GJ_F32, 3, sh, v);
    assert_non_null(x);
    for (int axis = -3; axis < 3; axis++)
        for (int keep = 0; keep < 2; keep++) {
            int a = axis < 0 ? axis + 3 : axis;
            gj_tensor *r = gj_argmax(x, axis, keep);
            assert_non_null(r);
            assert_int_equal(gj_tensor_dtype(r), GJ_I64);
            assert_int_equal(gj_tensor_ndim(r), keep ? 3 : 2);
            int64_t got_n = gj_tensor_numel(r), k = 0;
            assert_int_equal(got_n, 24 / sh[a]);
            int64_t st[3] = {12, 4, 1};
            for (int64_t i0 = 0; i0 < (a == 0 ? 1 : 2); i0++)
                for (int64_t i1 = 0; i1 < (a == 1 ? 1 : 3); i1++)
                    for (int64_t i2 = 0; i2 < (a == 2 ? 1 : 4); i2++) {
                        int64_t base = i0 * st[0] + i1 * st[1] + i2 * st[2], best = 0;
                        for (int64_t j = 1; j < sh[a]; j++) { /* reference: NaN wins, first of ties */
                            double c = v[base + j * st[a]], b = v[base + best * st[a]];
                            if (b != b) break;
                            if (c != c || c > b) best = j;
                        }
                        assert_int_equal((int64_t)gj_tensor_item_at(r, k), best);
                        k++;
                    }
            gj_release(r);
        }
    /* accuracy: 3 of 4 rows right */
    double lg[8] = {0.1, 0.9, 2.0, -1.0, 0.5, 0.5, -3.0, -2.0};
    gj_tensor *logits = gjt_tensor(GJ_F64, 2, (int64_t[]){4, 2}, lg);
    gj_tensor *lab = gjt_i64(1, (int64_t[]){4}, (int64_t[]){1, 0, 0, 0});
    assert_true(fabs(gj_accuracy(logits, lab) - 0.75) < 1e-15);
    /* errors */
    assert_null(gj_argmax(x, 3, false));
    assert_true(gjt_error_has("gj_argmax"));
    assert_null(gj_argmax(NULL, 0, false));
    assert_null(gj_argmax(lab, 0, false));
    assert_true(gjt_error_has("float"));
    assert_true(isnan(gj_accuracy(logits, x)));
    assert_true(gjt_error_has("gj_accuracy"));
    assert_true(isnan(gj_accuracy(NULL, lab)));
    gj_release(x);
    gj_release(logits);
    gj_release(lab);
}

/* A model's parameters as one object: layers built into a state dict, whose
 * tensor array feeds the optimizer and clipping (and gj_ddp_new, see
 * test_dist) and which is the checkpoint; a fresh model loads it and
 * computes the same loss bit for bit. */
static gj_tensor *two_layer_loss(gj_linear_layer *a, gj_linear_layer *b, gj_tensor *x) {
    return gj_sum(gj_mul(gj_linear_forward(b, gj_tanh(gj_linear_forward(a, x))),
                         gj_linear_forward(b, gj_tanh(gj_linear_forward(a, x)))),
                  0, NULL, false);
}

static void test_state_dict_as_param_list(void **state) {
    (void)state;
    gj_manual_seed(5);
    gj_linear_layer a, b, a2, b2;
    assert_int_equal(gj_linear_init(&a, 4, 6, true, GJ_F64), 0);
    assert_int_equal(gj_linear_init(&b, 6, 3, true, GJ_F64), 0);
    gj_state_dict *ps = gj_state_dict_new();
    assert_int_equal(gj_linear_state_dict_add(&a, ps, "enc"), 0);
    assert_int_equal(gj_linear_state_dict_add(&b, ps, "head"), 0);
    assert_int_equal(gj_state_dict_size(ps), 4);
    assert_string_equal(gj_tensor_name(gj_state_dict_tensor(ps, 0)), "enc.weight");
    gj_optim *opt = gj_adamw_new(gj_state_dict_size(ps), gj_state_dict_tensors(ps), 0.05, 0.9,
                                 0.999, 1e-8, 0.0);
    assert_non_null(opt);
    gjt_rng r;
    gjt_rng_seed(&r, 9);
    gj_tensor *x = gjt_uniform(&r, GJ_F64, 2, (int64_t[]){5, 4}, -1, 1);
    for (int step = 0; step < 3; step++) {
        gj_scope_push();
        assert_int_equal(gj_backward(two_layer_loss(&a, &b, x), NULL), 0);
        double norm = 0;
        assert_int_equal(gj_clip_grad_norm(gj_state_dict_size(ps), gj_state_dict_tensors(ps), 1.0,
                                           &norm), 0);
        assert_true(norm > 0);
        assert_int_equal(gj_optim_step(opt), 0);
        gj_optim_zero_grad(opt);
        gj_scope_pop();
    }
    char path[] = "/tmp/gjt_params_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(gj_save_safetensors(ps, path), 0);
    /* a fresh model of other values, built the same way, loads the file */
    gj_manual_seed(77);
    assert_int_equal(gj_linear_init(&a2, 4, 6, true, GJ_F64), 0);
    assert_int_equal(gj_linear_init(&b2, 6, 3, true, GJ_F64), 0);
    gj_state_dict *ps2 = gj_state_dict_new();
    assert_int_equal(gj_linear_state_dict_add(&a2, ps2, "enc"), 0);
    assert_int_equal(gj_linear_state_dict_add(&b2, ps2, "head"), 0);
    assert_int_equal(gj_load_safetensors_into(ps2, path, true), 0);
    unlink(path);
    gj_scope_push();
    double l1 = gj_tensor_item(two_layer_loss(&a, &b, x));
    double l2 = gj_tensor_item(two_layer_loss(&a2, &b2, x));
    gj_scope_pop();
    assert_true(l1 == l2);
    for (int i = 0; i < 4; i++) {
        double *u = gjt_values(gj_state_dict_tensor(ps, i));
        double *v = gjt_values(gj_state_dict_tensor(ps2, i));
        assert_memory_equal(u, v, sizeof(double) * (size_t)gj_tensor_numel(gj_state_dict_tensor(ps, i)));
        free(u);
        free(v);
    }
    gj_optim_free(opt);
    gj_state_dict_free(ps);
    gj_state_dict_free(ps2);
    gj_linear_free(&a);
    gj_linear_free(&b);
    gj_linear_free(&a2);
    gj_linear_free(&b2);
    gj_release(x);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clip_grad_norm),
        cmocka_unit_test(test_clip_grad_norm_errors),
        cmocka_unit_test(test_lr_schedules),
        cmocka_unit_test(test_argmax_accuracy),
        cmocka_unit_test(test_state_dict_as_param_list),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
