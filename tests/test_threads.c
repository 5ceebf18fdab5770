/* SPDX-License-Identifier: MIT */
/*
 * test_threads.c - backwards on several threads into the same leaves.
 *
 * Each of 3 threads runs 12 backwards of its own graph (its own inputs)
 * through one shared MLP whose parameters are leaves, never clearing
 * .grad. Accumulation into a leaf's .grad is serialised per leaf (eager:
 * the leaf's lock around the write; compiled: the run holds the stripes of
 * every leaf it writes, or falls back to eager, which waits), so the final
 * .grad must be the sum of all 36 per-backward gradients: compared in f64
 * with a serial reference (the order of the additions differs, hence a
 * relative 1e-12). Eager and compiled. Run under ThreadSanitizer in CI
 * (ctest label threads): no data race may be reported.
 */
#include "gjtest.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NT = 3, ITERS = 12, B = 16, IN = 24, H = 32, OUT = 5 };

static gj_linear_layer g_l1, g_l2;
static gj_tensor *g_x[NT][ITERS];
static bool g_compiled;
static int g_fail[NT];
static char g_msg[NT][256];

static gj_tensor *params(int i) {
    gj_tensor *p[4] = {g_l1.weight, g_l1.bias, g_l2.weight, g_l2.bias};
    return p[i];
}

static int one_backward(gj_tensor *x) {
    gj_scope_push();
    gj_tensor *h = gj_tanh(gj_linear_forward(&g_l1, x));
    gj_tensor *y = h ? gj_linear_forward(&g_l2, h) : NULL;
    gj_tensor *loss = y ? gj_sum(gj_mul(y, y), 0, NULL, false) : NULL;
    int rc = loss ? gj_backward(loss, NULL) : -1;
    gj_scope_pop();
    return rc;
}

static void *worker(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < ITERS; i++)
        if (one_backward(g_x[t][i]) != 0) {
            g_fail[t] = 1;
            snprintf(g_msg[t], sizeof g_msg[t], "%s", gj_last_error());
            break;
        }
    return NULL;
}

/* The four .grads, concatenated (malloc'd). */
static double *grads(int64_t *n) {
    int64_t total = 0;
    for (int i = 0; i < 4; i++) total += gj_tensor_numel(params(i));
    double *out = malloc((size_t)total * sizeof *out);
    assert_non_null(out);
    int64_t at = 0;
    for (int i = 0; i < 4; i++) {
        double *v = gjt_values(gj_tensor_grad(params(i)));
        assert_non_null(v);
        memcpy(out + at, v, (size_t)gj_tensor_numel(params(i)) * sizeof *v);
        at += gj_tensor_numel(params(i));
        free(v);
    }
    *n = total;
    return out;
}

static void clear_grads(void) {
    for (int i = 0; i < 4; i++) gj_tensor_set_grad(params(i), NULL);
}

static void run_case(bool compiled) {
    g_compiled = compiled;
    clear_grads();
    /* serial reference: every backward, one after another, eagerly */
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < ITERS; i++) assert_int_equal(one_backward(g_x[t][i]), 0);
    int64_t n1, n2;
    double *ref = grads(&n1);
    clear_grads();
    pthread_t th[NT];
    gj_set_compiled_autograd(compiled); /* process-wide */
    for (int t = 0; t < NT; t++) {
        g_fail[t] = 0;
        assert_int_equal(pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t), 0);
    }
    for (int t = 0; t < NT; t++) assert_int_equal(pthread_join(th[t], NULL), 0);
    gj_set_compiled_autograd(false);
    for (int t = 0; t < NT; t++)
        if (g_fail[t]) fail_msg("%s thread %d: backward failed: %s", compiled ? "compiled" : "eager", t, g_msg[t]);
    double *got = grads(&n2);
    assert_int_equal(n1, n2);
    char what[64];
    snprintf(what, sizeof what, "%s: 3 threads x 12 backwards into shared leaves",
             compiled ? "compiled" : "eager");
    assert_true(gjt_allclose(what, got, ref, n1, 0, 1e-12));
    free(ref);
    free(got);
}

static void test_shared_leaves_eager(void **state) {
    (void)state;
    run_case(false);
}

static void test_shared_leaves_compiled(void **state) {
    (void)state;
    gj_ca_stats a, b;
    gj_compiled_autograd_stats(&a);
    run_case(true);
    gj_compiled_autograd_stats(&b);
    /* every backward went through the compiled path: compiled, or left to
     * the eager engine while another thread held a leaf (counted) */
    assert_int_equal(b.backwards - a.backwards, NT * ITERS);
    /* ... and each counts exactly once, a fallback with its reason named */
    assert_int_equal(b.compiles + b.mem_hits + b.disk_hits + b.instantiations + b.fallbacks -
                         (a.compiles + a.mem_hits + a.disk_hits + a.instantiations + a.fallbacks),
                     NT * ITERS);
    assert_int_equal(b.fallbacks - a.fallbacks, b.fallbacks_by_reason[GJ_CA_LOCK_CONTENTION] -
                                                    a.fallbacks_by_reason[GJ_CA_LOCK_CONTENTION]);
    if (b.fallbacks > a.fallbacks) /* readable from this thread too */
        assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "lock_contention"));
    print_message("  compiled: %lld backwards, %lld fell back while another thread wrote a "
                  "shared .grad\n",
                  (long long)(b.backwards - a.backwards), (long long)(b.fallbacks - a.fallbacks));
}

/* ----------------------------------- private models, settings changing */

enum { PT = 3, PITERS = 40 };

typedef struct priv_model {
    gj_tensor *w1, *b1, *w2;
    double final[H * IN + H + OUT * H];
} priv_model;

static priv_model g_pm[PT];
static atomic_bool g_stop;

static void priv_init(priv_model *m, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    m->w1 = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){H, IN}, -0.3, 0.3);
    m->b1 = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){H}, -0.1, 0.1);
    m->w2 = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){OUT, H}, -0.3, 0.3);
    assert_int_equal(gj_set_requires_grad(m->w1, true), 0);
    assert_int_equal(gj_set_requires_grad(m->b1, true), 0);
    assert_int_equal(gj_set_requires_grad(m->w2, true), 0);
}

/* PITERS SGD steps of model t on its own batches; the final weights. */
static void *priv_worker(void *arg) {
    int t = (int)(intptr_t)arg;
    priv_model *m = &g_pm[t];
    gjt_rng r;
    gjt_rng_seed(&r, 100 + (uint64_t)t);
    gj_tensor *ps[3] = {m->w1, m->b1, m->w2};
    for (int i = 0; i < PITERS; i++) {
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){B, IN}, -1, 1);
        gj_tensor *h = gj_gelu(gj_linear(x, m->w1, m->b1));
        gj_tensor *y = gj_linear(h, m->w2, NULL);
        for (int k = 0; k < 3; k++) gj_tensor_set_grad(ps[k], NULL);
        if (gj_backward(gj_mean(gj_mul(y, y), 0, NULL, false), NULL) != 0) {
            g_fail[t] = 1;
            snprintf(g_msg[t], sizeof g_msg[t], "%s", gj_last_error());
        }
        gj_no_grad_push();
        for (int k = 0; k < 3 && !g_fail[t]; k++) gj_add_scaled_(ps[k], gj_tensor_grad(ps[k]), -0.1);
        gj_no_grad_pop();
        gj_scope_pop();
    }
    int64_t at = 0;
    for (int k = 0; k < 3; k++) {
        gj_tensor_to_f64(ps[k], m->final + at);
        at += gj_tensor_numel(ps[k]);
    }
    return NULL;
}

/* The settings a fourth thread keeps changing meanwhile. */
static void *settings_thrasher(void *arg) {
    (void)arg;
    int i = 0;
    while (!atomic_load(&g_stop)) {
        gj_set_num_threads(1 + (i % 2));
        gj_mem_release_cache();
        gj_ca_stats s;
        gj_compiled_autograd_stats(&s);
        gj_compiled_autograd_set_quiet(true);
        gj_mem s2;
        gj_mem_stats(&s2);
        i++;
    }
    gj_set_num_threads(0);
    return NULL;
}

static void priv_free(priv_model *m) {
    gj_release(m->w1);
    gj_release(m->b1);
    gj_release(m->w2);
}

/* Three threads train private models compiled while a fourth changes
 * thread counts, releases the allocator's cache and reads the counters:
 * every backward counts exactly once (compiles + hits + instantiations +
 * fallbacks = backwards), every fallback carries a named reason (never
 * "other"), and the final weights are bit for bit those of the same
 * training run eagerly, one model after another. */
static void test_private_models_settings(void **state) {
    (void)state;
    static double ref[PT][H * IN + H + OUT * H];
    for (int t = 0; t < PT; t++) {
        priv_init(&g_pm[t], 7 + (uint64_t)t);
        priv_worker((void *)(intptr_t)t);
        memcpy(ref[t], g_pm[t].final, sizeof ref[t]);
        priv_free(&g_pm[t]);
        priv_init(&g_pm[t], 7 + (uint64_t)t);
    }
    gj_compiled_autograd_reset_stats();
    gj_set_compiled_autograd(true);
    atomic_store(&g_stop, false);
    pthread_t th[PT], thr;
    assert_int_equal(pthread_create(&thr, NULL, settings_thrasher, NULL), 0);
    for (int t = 0; t < PT; t++) {
        g_fail[t] = 0;
        assert_int_equal(pthread_create(&th[t], NULL, priv_worker, (void *)(intptr_t)t), 0);
    }
    for (int t = 0; t < PT; t++) assert_int_equal(pthread_join(th[t], NULL), 0);
    atomic_store(&g_stop, true);
    assert_int_equal(pthread_join(thr, NULL), 0);
    gj_set_compiled_autograd(false);
    gj_ca_stats s;
    gj_compiled_autograd_stats(&s);
    print_message("  %lld backwards: %lld compiles, %lld memory hits, %lld disk hits, %lld bound, "
                  "%lld fallbacks (%lld lock contention)\n",
                  (long long)s.backwards, (long long)s.compiles, (long long)s.mem_hits,
                  (long long)s.disk_hits, (long long)s.instantiations, (long long)s.fallbacks,
                  (long long)s.fallbacks_by_reason[GJ_CA_LOCK_CONTENTION]);
    assert_int_equal(s.backwards, PT * PITERS);
    assert_int_equal(s.compiles + s.mem_hits + s.disk_hits + s.instantiations + s.fallbacks,
                     PT * PITERS);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_OTHER], 0);
    if (s.fallbacks > 0) assert_true(gj_compiled_autograd_last_fallback()[0] != '\0');
    for (int t = 0; t < PT; t++) {
        if (g_fail[t]) fail_msg("thread %d: %s", t, g_msg[t]);
        assert_memory_equal(g_pm[t].final, ref[t], sizeof ref[t]);
        priv_free(&g_pm[t]);
    }
}

static int setup(void **state) {
    (void)state;
    gj_manual_seed(3);
    if (gj_linear_init(&g_l1, IN, H, true, GJ_F64) != 0 ||
        gj_linear_init(&g_l2, H, OUT, true, GJ_F64) != 0)
        return -1;
    gjt_rng r;
    gjt_rng_seed(&r, 17);
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < ITERS; i++)
            if (!(g_x[t][i] = gjt_uniform(&r, GJ_F64, 2, (int64_t[]){B, IN}, -1, 1))) return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    clear_grads();
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < ITERS; i++) gj_release(g_x[t][i]);
    gj_linear_free(&g_l1);
    gj_linear_free(&g_l2);
    return 0;
}

int main(void) {
    gjt_setup();
    gj_compiled_autograd_set_quiet(true);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shared_leaves_eager),
        cmocka_unit_test(test_shared_leaves_compiled),
        cmocka_unit_test(test_private_models_settings),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
