/* SPDX-License-Identifier: MIT */
/*
 * test_step_guards.c - what a compiled step must notice of its step
 * function and of its caller, so that it never differs from the eager step
 * without a word: aliasing among inputs, parameters and captured tensors;
 * the values eager checks (labels, indices); reseeds and value reads
 * inside the function; leaves outside the optimizer and their hooks;
 * .grads present before a run or left by a failed clip; a view of a
 * parameter made outside the function; a step inside the step function;
 * a NULL loss; and the memory its variants may hold. Each case runs the
 * same steps eagerly and compiled and compares everything a step leaves
 * (step_model.h), return codes and errors included.
 */
#include "step_model.h"

#include "../jit/jit.h"

#include <malloc.h>

/* ---------------------------------------------------------- aliasing */

/* in = {x, x} for two steps, then {x + noise, x}: the program traced with
 * one tensor in both roles must not replay when they part. */
static void alias_inputs(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)m, (void)eager;
    gj_tensor *x = in[0];
    if (i < 2) {
        in[1] = x;
    } else {
        in[1] = x;
        in[0] = gj_add(x, gj_mul_scalar(in[0], 0.3));
    }
}

/* The first layer's weight is passed as in[1] while tracing, then another
 * tensor: the gradient must stop flowing into w1 through in[1]. */
static void alias_param(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)eager;
    if (i < 2) {
        in[1] = m->p[0];
    } else {
        gj_no_grad_push();
        in[1] = gj_mul_scalar(m->p[0], 0.5); /* (no grad: a plain input) */
        gj_no_grad_pop();
    }
}

/* A captured tensor passed as an input while tracing, then not. */
static void alias_const(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)eager;
    in[1] = i < 2 ? m->shift : gj_mul_scalar(m->shift, 3.0);
}

static void test_aliasing(void **st) {
    (void)st;
    sm_model f = {0};
    f.add_in1 = true;
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = alias_inputs};
    gj_ca_stats s = sm_check("one tensor in two input roles", &sc, &f);
    assert_int_equal(s.fallbacks, 0);
    assert_true(s.compiles + s.mem_hits + s.disk_hits + s.instantiations == 5);

    sm_model g = {0};
    g.in1_weight = true;
    sc.before = alias_param;
    sm_check("a parameter passed as an input while tracing", &sc, &g);

    sm_model h = {0};
    h.add_in1 = true;
    gjt_rng r;
    gjt_rng_seed(&r, 8);
    h.shift = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, SM_IN}, -1, 1);
    sc.before = alias_const;
    sm_check("a captured tensor passed as an input while tracing", &sc, &h);
    gj_release(h.shift);
}

/* An input that is a view overlapping a parameter (the update writes the
 * parameter in place): that run is eager, with eager's results. */
static void overlap_param(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)eager;
    if (i >= 1) in[1] = gj_reshape(gj_detach(m->p[0]), 2, (int64_t[]){SM_HID, SM_IN});
}

static void test_overlapping_view(void **st) {
    (void)st;
    sm_model f = {0};
    f.in1_weight = true;
    sm_script sc = {.steps = 4, .batch = 4, .adamw = true, .before = overlap_param};
    gj_ca_stats s = sm_check("an input viewing a parameter's memory", &sc, &f);
    assert_int_equal(s.fallbacks, 3);
    assert_true(strstr(gj_compiled_autograd_last_fallback(), "shares its memory") != NULL);
}

/* ------------------------------------------------------- value checks */

static void bad_labels(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)m, (void)eager;
    int64_t b = sc->batch, v[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    if (i == 2) v[1] = 100005;
    if (i == 3) v[2] = -100; /* the ignore_index habit */
    if (i == 2 || i == 3) in[2] = gjt_i64(1, &b, v);
}

/* Labels through a reshape in the function are checked too. */
static gj_tensor *reshaped_labels(void *ctx, int n_in, gj_tensor *const *in) {
    sm_model *m = ctx;
    (void)n_in;
    gj_tensor *y = gj_linear(gj_gelu(gj_linear(in[0], m->p[0], m->p[1])), m->p[2], m->p[3]);
    int64_t b = gj_tensor_shape(in[2])[0] * gj_tensor_shape(in[2])[1];
    return gj_cross_entropy(y, gj_reshape(in[2], 1, &b));
}

static void test_labels_checked(void **st) {
    (void)st;
    sm_model f = {0};
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = bad_labels};
    gj_ca_stats s = sm_check("labels out of range after compiling", &sc, &f);
    assert_int_equal(s.fallbacks, 0);

    /* the same through a reshape, and an embedding's indices */
    gj_compiled_autograd_set_quiet(true);
    double loss[2][4];
    char err[2][4][160];
    for (int mode = 0; mode < 2; mode++) {
        sm_model m;
        sm_init(&m, 5);
        gj_optim *o = gj_sgd_new(SM_NP, m.p, 0.1, 0.0, 0.0);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *stp = gj_step_new(reshaped_labels, &m, o, &so);
        gjt_rng r;
        gjt_rng_seed(&r, 4);
        for (int i = 0; i < 4; i++) {
            gj_scope_push();
            gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){6, SM_IN}, -1, 1);
            int64_t v[6] = {0, 1, 2, 3, 1, 2};
            if (i == 2) v[4] = 7;
            gj_tensor *in[3] = {x, NULL, gjt_i64(2, (int64_t[]){2, 3}, v)}, *l = NULL;
            in[1] = x;
            int rc = gj_step_run(stp, 3, in, &l);
            loss[mode][i] = rc == 0 ? gj_tensor_item(l) : -1;
            snprintf(err[mode][i], sizeof err[mode][i], "%s", rc ? gj_last_error() : "");
            gj_scope_pop();
        }
        gj_step_free(stp);
        gj_optim_free(o);
        sm_free(&m);
    }
    assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
    assert_string_equal(err[0][2], err[1][2]);
    assert_non_null(strstr(err[1][2], "gj_cross_entropy: labels[4] = 7 is out of range [0, 4)"));
}

/* -------------------------------------------------- reseeds, value reads */

static void test_reseed_in_function(void **st) {
    (void)st;
    sm_model f = {0};
    f.train = true;
    f.reseed = 42; /* the seed the run already has */
    sm_script sc = {.steps = 4, .batch = 4, .adamw = true};
    gj_ca_stats s = sm_check("gj_manual_seed(42) inside the function", &sc, &f);
    assert_int_equal(s.fallbacks, 4);
    assert_true(strstr(gj_compiled_autograd_last_fallback(), "reseeded") != NULL);
}

static void change_scale(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    if (i == 0) *(double *)gj_tensor_data(m->scale) = 0.75; /* (each run from the same value) */
    if (i == 3) {
        gj_no_grad_push();
        assert_int_equal(gj_mul_scalar_(m->scale, 1.5), 0);
        gj_no_grad_pop();
    }
}

static void test_value_read_of_captured(void **st) {
    (void)st;
    sm_model f = {0};
    double one = 0.75;
    f.scale = gj_from_data(GJ_F64, 0, NULL, &one);
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = change_scale};
    gj_ca_stats s = sm_check("gj_tensor_item of a captured tensor", &sc, &f);
    assert_int_equal(s.fallbacks, 5);
    assert_true(strstr(gj_compiled_autograd_last_fallback(), "read a tensor from outside") != NULL);
    gj_release(f.scale);
}

/* --------------------------------------------- leaves outside the optimizer */

static int64_t g_hook_calls;
static gj_tensor *count_hook(gj_tensor *g, void *u) {
    (void)g, (void)u;
    g_hook_calls++;
    return NULL;
}

/* x (in[0]) requires grad every step; a captured shift too (its .grad
 * accumulates across steps, as nothing zeroes it); from step 3 a hook sits
 * on the shift. */
static void extra_leaves(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)eager;
    sm_script *w = (sm_script *)sc;
    assert_int_equal(gj_set_requires_grad(in[0], true), 0);
    w->watch[0] = in[0];
    w->watch[1] = m->shift;
    if (i == 3) assert_true(gj_register_hook(m->shift, count_hook, NULL) >= 0);
}

static void test_extra_leaves(void **st) {
    (void)st;
    int64_t calls[2];
    for (int mode = 0; mode < 2; mode++) {
        sm_model f = {0};
        gjt_rng r;
        gjt_rng_seed(&r, 9);
        f.shift = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){SM_IN}, -1, 1);
        assert_int_equal(gj_set_requires_grad(f.shift, true), 0);
        sm_script sc = {.steps = 6, .batch = 4, .adamw = true, .before = extra_leaves};
        g_hook_calls = 0;
        sm_result r1 = sm_run(&sc, &f, mode == 0);
        calls[mode] = g_hook_calls;
        if (mode == 1) { /* compiled until the hook: steps 0-2 as programs */
            assert_true(r1.stats.compiles + r1.stats.mem_hits + r1.stats.disk_hits +
                            r1.stats.instantiations >= 3);
        }
        static sm_result first;
        if (mode == 0) first = r1;
        else {
            sm_same("leaves outside the optimizer, a hook on one after the trace", &sc, &first, &r1);
            sm_result_free(&first);
            sm_result_free(&r1);
        }
        gj_tensor_set_grad(f.shift, NULL);
        gj_release(f.shift);
    }
    assert_int_equal(calls[0], 3);
    assert_int_equal(calls[1], calls[0]);
}

/* ------------------------------------------------------ .grads of runs */

/* A diagnostic backward between steps leaves .grads the eager step's
 * zero_grad clears. */
static void diagnostic_backward(const sm_script *sc, sm_model *m, int i, gj_tensor **in,
                                bool eager) {
    (void)sc, (void)eager;
    if (i < 2) return;
    gj_tensor *l = sm_loss(m, 3, in);
    assert_non_null(l);
    assert_int_equal(gj_backward(l, NULL), 0);
}

static void test_grads_before_a_run(void **st) {
    (void)st;
    sm_model f = {0};
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = diagnostic_backward};
    gj_ca_stats s = sm_check(".grads present before a run", &sc, &f);
    assert_int_equal(s.fallbacks, 0);
    sc.keep_grads = true;
    sm_check(".grads present before a run, keep_grads", &sc, &f);
}

static void nan_at_3(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)m, (void)eager;
    if (i == 3) in[0] = gj_add(in[0], gj_mul_scalar(gj_sum(in[0], 0, NULL, true), NAN));
}

static void test_failed_clip_leaves_grads(void **st) {
    (void)st;
    sm_model f = {0};
    sm_script sc = {.steps = 6, .batch = 4, .adamw = true, .clip = 0.5, .before = nan_at_3};
    sm_check("a non-finite clip norm at step 3", &sc, &f);
    sc.adamw = false;
    sc.keep_grads = true;
    sm_check("a non-finite clip norm, SGD, keep_grads", &sc, &f);
}

/* ------------------------------------------------ the function's misuse */

static void test_view_of_parameter_made_outside(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    sm_result res[2];
    for (int mode = 0; mode < 2; mode++) {
        sm_model m;
        sm_init(&m, 3);
        m.w2T = gj_transpose(m.p[2], 0, 1); /* once, outside the function */
        gj_scope_keep(m.w2T);
        gj_optim *o = gj_adamw_new(SM_NP, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.0);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *stp = gj_step_new(sm_loss, &m, o, &so);
        gjt_rng r;
        gjt_rng_seed(&r, 2);
        memset(&res[mode], 0, sizeof res[mode]);
        for (int i = 0; i < 4; i++) {
            gj_scope_push();
            int64_t b = 4;
            gj_tensor *in[3] = {gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, SM_IN}, -1, 1), NULL,
                                gjt_labels(&r, 1, &b, SM_OUT)},
                      *l = NULL;
            in[1] = in[0];
            res[mode].rc[i] = gj_step_run(stp, 3, in, &l);
            snprintf(res[mode].err[i], sizeof res[mode].err[i], "%s",
                     res[mode].rc[i] ? gj_last_error() : "");
            res[mode].loss[i] = l ? gj_tensor_item(l) : -1;
            gj_scope_pop();
        }
        gj_step_free(stp);
        gj_optim_free(o);
        gj_release(m.w2T);
        for (int k = 0; k < SM_NP; k++) gj_tensor_set_grad(m.p[k], NULL);
        sm_free(&m);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(res[0].rc[i], res[1].rc[i]);
        assert_memory_equal(&res[0].loss[i], &res[1].loss[i], sizeof(double));
    }
    assert_int_equal(res[0].rc[0], 0);
    assert_int_equal(res[0].rc[1], -1); /* eager: the view's graph was freed by step 0 */
}

static void test_step_inside_function(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    double loss[2][3];
    int rcs[2][3];
    for (int mode = 0; mode < 2; mode++) {
        sm_model in_m, out_m;
        sm_init(&in_m, 7);
        sm_init(&out_m, 8);
        gj_optim *oi = gj_sgd_new(SM_NP, in_m.p, 0.1, 0.0, 0.0);
        gj_optim *oo = gj_sgd_new(SM_NP, out_m.p, 0.1, 0.0, 0.0);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *inner = gj_step_new(sm_loss, &in_m, oi, &so);
        out_m.inner = inner;
        gj_step *outer = gj_step_new(sm_loss, &out_m, oo, &so);
        gjt_rng r;
        gjt_rng_seed(&r, 1);
        for (int i = 0; i < 3; i++) {
            gj_scope_push();
            int64_t b = 4;
            gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, SM_IN}, -1, 1);
            gj_tensor *in[3] = {x, x, gjt_labels(&r, 1, &b, SM_OUT)}, *l = NULL;
            rcs[mode][i] = gj_step_run(outer, 3, in, &l);
            if (rcs[mode][i] != 0) fail_msg("mode %d step %d: %s", mode, i, gj_last_error());
            loss[mode][i] = gj_tensor_item(l);
            gj_scope_pop();
        }
        gj_step_free(outer);
        gj_step_free(inner);
        gj_optim_free(oi);
        gj_optim_free(oo);
        sm_free(&in_m);
        sm_free(&out_m);
    }
    assert_memory_equal(rcs[0], rcs[1], sizeof rcs[0]);
    assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
}

static void test_null_loss(void **st) {
    (void)st;
    sm_model f = {0};
    f.null_loss = true;
    sm_script sc = {.steps = 2, .batch = 4};
    gj_compiled_autograd_set_quiet(true);
    sm_result e = sm_run(&sc, &f, true), c = sm_run(&sc, &f, false);
    sm_same("a NULL loss", &sc, &e, &c);
    assert_int_equal(c.rc[0], -1);
    assert_non_null(strstr(c.err[0], "the step function returned NULL"));
    sm_result_free(&e);
    sm_result_free(&c);
}

/* ---------------------------------------------------------- memory */

static size_t heap_in_use(void) {
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

/* Many batch sizes with a small program cache: the step's variants stay
 * within the cache's limit, and so does the heap's growth. */
static void test_variants_bounded(void **st) {
    (void)st;
    gj_compiled_autograd_set_quiet(true);
    int64_t limit = 2 << 20;
    gj_compiled_autograd_set_mem_cache_limit(limit);
    sm_model m;
    sm_init(&m, 3);
    gj_optim *o = gj_sgd_new(SM_NP, m.p, 0.01, 0.0, 0.0);
    gj_step *stp = gj_step_new(sm_loss, &m, o, NULL);
    gjt_rng r;
    gjt_rng_seed(&r, 6);
    size_t h0 = 0;
    int n = 160;
    for (int i = 0; i < n; i++) {
        if (i == 20) h0 = heap_in_use(); /* (after the first programs and kernels) */
        gj_scope_push();
        int64_t b = 2 + i;
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){b, SM_IN}, -1, 1);
        gj_tensor *in[3] = {x, x, gjt_labels(&r, 1, &b, SM_OUT)};
        assert_int_equal(gj_step_run(stp, 3, in, NULL), 0);
        gj_scope_pop();
    }
    size_t h1 = heap_in_use();
    gj_ca_stats s;
    gj_step_stats(&s);
    assert_int_equal(s.fallbacks, 0);
    printf("heap grew %.1f MiB over %d batch sizes (limit %.1f MiB)\n",
           ((double)h1 - (double)h0) / 1048576.0, n - 20, (double)limit / 1048576.0);
    assert_true(h1 < h0 + (size_t)(3 * limit));
    gj_step_free(stp);
    gj_optim_free(o);
    sm_free(&m);
    gj_compiled_autograd_set_mem_cache_limit(GJ_JIT_MEM_LIMIT_DEFAULT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_aliasing),
        cmocka_unit_test(test_overlapping_view),
        cmocka_unit_test(test_labels_checked),
        cmocka_unit_test(test_reseed_in_function),
        cmocka_unit_test(test_value_read_of_captured),
        cmocka_unit_test(test_extra_leaves),
        cmocka_unit_test(test_grads_before_a_run),
        cmocka_unit_test(test_failed_clip_leaves_grads),
        cmocka_unit_test(test_view_of_parameter_made_outside),
        cmocka_unit_test(test_step_inside_function),
        cmocka_unit_test(test_null_loss),
        cmocka_unit_test(test_variants_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
