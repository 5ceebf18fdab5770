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
    print_message("  compiled: %lld backwards, %lld fell back while another thread wrote a "
                  "shared .grad\n",
                  (long long)(b.backwards - a.backwards), (long long)(b.fallbacks - a.fallbacks));
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
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
