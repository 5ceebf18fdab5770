/* SPDX-License-Identifier: MIT */
/*
 * test_scope.c - ownership through scopes: a scope releases the new
 * references created while it is the innermost one; gj_scope_keep moves a
 * reference out to the caller; nested scopes release only their own;
 * gj_release of a scoped tensor is legal (no double free at pop); tensors
 * created outside any scope belong to the caller. Live tensor bytes return
 * to the baseline after every test (and ASan checks the headers).
 */
#include "gjtest.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 1024
static const int64_t SHAPE[] = {N};
#define BYTES ((int64_t)N * 4)

static void test_scope_releases_temporaries(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *a = gj_zeros(GJ_F32, 1, SHAPE);
    gj_tensor *b = gj_ones(GJ_F32, 1, SHAPE);
    assert_non_null(a);
    assert_non_null(b);
    gj_tensor *c = gj_add(a, b);
    gj_tensor *d = gj_exp(c);
    assert_non_null(d);
    assert_true(gjt_live_bytes() >= live0 + 4 * BYTES);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_scope_keep(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *a = gj_full(GJ_F32, 1, SHAPE, 2.0);
    gj_tensor *b = gj_mul_scalar(a, 3.0);
    assert_ptr_equal(gj_scope_keep(b), b);
    gj_scope_pop();
    /* b survives with its values; a is gone */
    assert_true(gjt_live_bytes() >= live0 + BYTES);
    assert_true(gjt_live_bytes() < live0 + 2 * BYTES);
    assert_true(gj_tensor_item_at(b, 0) == 6.0);
    assert_true(gj_tensor_item_at(b, N - 1) == 6.0);
    /* keep twice is harmless: it is already the caller's */
    assert_ptr_equal(gj_scope_keep(b), b);
    gj_release(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_nested_scopes(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    int64_t live_a = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *b = gj_add_scalar(a, 1.0);
    gj_tensor *c = gj_add(a, b);
    assert_non_null(c);
    gj_scope_push();
    gj_tensor *d = gj_ones(GJ_F32, 1, SHAPE);
    assert_non_null(d);
    gj_scope_pop();              /* d freed */
    assert_int_equal(gjt_live_bytes(), live_a + 2 * BYTES);
    gj_scope_pop();              /* b, c freed, a alive */
    assert_int_equal(gjt_live_bytes(), live_a);
    assert_true(gj_tensor_item_at(a, 3) == 1.0);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* gj_scope_keep from an inner scope moves a tensor out of an outer scope. */
static void test_keep_from_inner_scope(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    gj_scope_push();
    gj_scope_keep(a);
    gj_scope_pop();
    gj_scope_pop();
    assert_true(gj_tensor_item_at(a, 0) == 1.0);
    assert_int_equal(gjt_live_bytes(), live0 + BYTES);
    gj_release(a);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Releasing a scoped tensor inside the scope frees it now, and the pop does
 * not free it again. */
static void test_release_scoped(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    gj_tensor *b = gj_ones(GJ_F32, 1, SHAPE);
    assert_int_equal(gjt_live_bytes(), live0 + 2 * BYTES);
    gj_release(a);
    assert_int_equal(gjt_live_bytes(), live0 + BYTES);
    gj_tensor *c = gj_ones(GJ_F32, 1, SHAPE); /* may reuse a's slot or memory */
    assert_non_null(c);
    assert_true(gj_tensor_item_at(b, 0) == 1.0);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* An extra reference taken with gj_retain is the caller's, never the scope's. */
static void test_retain_in_scope(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    assert_ptr_equal(gj_retain(a), a);
    gj_scope_pop();
    assert_true(gj_tensor_item_at(a, 0) == 1.0);
    assert_int_equal(gjt_live_bytes(), live0 + BYTES);
    gj_release(a);
    assert_int_equal(gjt_live_bytes(), live0);
    /* retain, release inside the scope, pop: exactly one reference left */
    gj_scope_push();
    gj_tensor *b = gj_ones(GJ_F32, 1, SHAPE);
    gj_retain(b);
    gj_release(b); /* drops the scope's reference (or the extra one) */
    assert_int_equal(gjt_live_bytes(), live0 + BYTES);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0 + BYTES);
    gj_release(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Outside any scope the caller owns what it creates: an unrelated scope's
 * pop does not touch it. */
static void test_outside_scope(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    gj_scope_push();
    gj_tensor *b = gj_add(a, a);
    assert_non_null(b);
    gj_scope_pop();
    assert_true(gj_tensor_item_at(a, 5) == 1.0);
    assert_int_equal(gjt_live_bytes(), live0 + BYTES);
    gj_tensor *c = gj_add(a, a); /* no scope: the caller's */
    gj_scope_push();
    gj_scope_pop();
    assert_true(gj_tensor_item_at(c, 5) == 2.0);
    gj_release(c);
    gj_release(a);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Views, graphs and .grad: a scope frees views and the graph; a kept result
 * keeps its history alive for a later backward. */
static void test_scope_with_graph(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_tensor *x = gj_full(GJ_F64, 2, (int64_t[]){8, 8}, 0.5);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    int64_t live_x = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *t = gj_transpose(x, 0, 1);
    gj_tensor *y = gj_tanh(gj_mul(t, t));
    gj_tensor *L = gj_sum(y, 0, NULL, false);
    gj_scope_keep(L);
    gj_scope_pop();
    /* L's graph holds the saved tensors; backward after the pop works */
    assert_int_equal(gj_backward(L, NULL), 0);
    assert_non_null(gj_tensor_grad(x));
    gj_release(L);
    /* only x and its .grad remain */
    assert_int_equal(gjt_live_bytes(), live_x + 64 * 8);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    assert_int_equal(gjt_live_bytes(), live_x);
    /* backward inside a scope: temporaries freed, .grad stays with x */
    gj_scope_push();
    assert_int_equal(gj_backward(gj_sum(gj_exp(x), 0, NULL, false), NULL), 0);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live_x + 64 * 8);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Many tensors in one scope (its table grows) and many scopes in a row. */
static void test_many(void **s) {
    int64_t live0 = gjt_live_bytes();
    for (int r = 0; r < 50; r++) {
        gj_scope_push();
        gj_tensor *acc = gj_zeros(GJ_F32, 1, (int64_t[]){16});
        for (int i = 0; i < 300; i++)
            acc = gj_add_scalar(acc, 1.0);
        assert_true(gj_tensor_item_at(acc, 15) == 300.0);
        gj_scope_pop();
    }
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A pop with no open scope is reported, not a crash. */
static void test_unbalanced_pop(void **s) {
    gj_clear_error();
    gj_scope_pop();
    assert_true(gj_last_error()[0] != '\0');
    GJT_ASSERT_ERROR("scope");
}

/* Very deep nesting (deeper than any fixed table) still frees everything and
 * never frees a tensor of an outer level early. */
static void test_deep_nesting(void **s) {
    int64_t live0 = gjt_live_bytes();
    enum { DEPTH = 300 };
    static gj_tensor *t[DEPTH];
    for (int d = 0; d < DEPTH; d++) {
        gj_scope_push();
        t[d] = gj_full(GJ_F32, 1, (int64_t[]){16}, (double)d);
        assert_non_null(t[d]);
    }
    for (int d = DEPTH - 1; d >= 0; d--) {
        gj_scope_pop();
        if (d > 0 && d <= 200) /* the tensor of the enclosing level is still alive */
            assert_true(gj_tensor_item_at(t[d - 1], 3) == (double)(d - 1));
    }
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Scopes are per thread: another thread's push/pop does not touch ours. */
static void *thread_body(void *arg) {
    gj_tensor **out = arg;
    gj_scope_push();
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    gj_tensor *b = gj_add(a, a);
    *out = gj_scope_keep(gj_mul_scalar(b, 2.0));
    gj_scope_pop();
    gj_scope_pop(); /* unbalanced in this thread: an error, not a pop of main's scope */
    return NULL;
}

static void test_scopes_per_thread(void **s) {
    int64_t live0 = gjt_live_bytes();
    gj_scope_push();
    gj_tensor *mine = gj_ones(GJ_F32, 1, SHAPE);
    gj_tensor *theirs = NULL;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, thread_body, &theirs), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_non_null(theirs);
    assert_true(gj_tensor_item_at(mine, 7) == 1.0);
    assert_true(gj_tensor_item_at(theirs, 7) == 4.0);
    gj_release(theirs);
    gj_scope_pop();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------ forgotten scopes */

static const char *g_self;

/* gj_scope_depth counts this thread's open scopes (past the fixed stack
 * too), and only this thread's. */
static void *depth_body(void *arg) {
    int *out = arg;
    out[0] = gj_scope_depth();
    gj_scope_push();
    gj_scope_push();
    out[1] = gj_scope_depth();
    gj_scope_pop();
    gj_scope_pop();
    return NULL;
}

static void test_scope_depth(void **s) {
    assert_int_equal(gj_scope_depth(), 0);
    gj_scope_push();
    gj_scope_push();
    assert_int_equal(gj_scope_depth(), 2);
    int theirs[2] = {-1, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, depth_body, theirs), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(theirs[0], 0);
    assert_int_equal(theirs[1], 2);
    assert_int_equal(gj_scope_depth(), 2);
    for (int i = 0; i < 400; i++) gj_scope_push(); /* past the 256 of the fixed stack */
    assert_int_equal(gj_scope_depth(), 402);
    for (int i = 0; i < 400; i++) gj_scope_pop();
    gj_scope_pop();
    gj_scope_pop();
    assert_int_equal(gj_scope_depth(), 0);
    gj_scope_pop(); /* an error: the depth stays 0 */
    assert_int_equal(gj_scope_depth(), 0);
}

/* gj_live_tensors counts headers: views and scoped tensors included, and
 * each release or pop takes them off again. */
static void test_live_tensors(void **s) {
    int64_t n0 = gj_live_tensors();
    assert_true(n0 >= 0);
    gj_tensor *a = gj_ones(GJ_F32, 1, SHAPE);
    assert_int_equal(gj_live_tensors(), n0 + 1);
    gj_scope_push();
    gj_tensor *v = gj_reshape(a, 2, (int64_t[]){2, N / 2}); /* a view: a header of its own */
    assert_non_null(v);
    assert_non_null(gj_add(a, a));
    assert_int_equal(gj_live_tensors(), n0 + 3);
    gj_scope_pop();
    assert_int_equal(gj_live_tensors(), n0 + 1);
    gj_release(a);
    assert_int_equal(gj_live_tensors(), n0);
}

/* Child modes, run in a process of their own (stderr captured). */
static int child(const char *mode) {
    if (strcmp(mode, "--child-deep") == 0) { /* pushes 25,000 scopes, pops them */
        for (int i = 0; i < 25000; i++) gj_scope_push();
        int d = gj_scope_depth();
        for (int i = 0; i < 25000; i++) gj_scope_pop();
        return d == 25000 && gj_scope_depth() == 0 ? 0 : 1;
    }
    if (strcmp(mode, "--child-leak") == 0) { /* leaves two tensors and one scope */
        gj_tensor *mine = gj_ones(GJ_F32, 1, SHAPE); /* never released */
        gj_scope_push();
        gj_tensor *t = gj_zeros(GJ_F64, 1, (int64_t[]){3}); /* its scope is never popped */
        return mine && t ? 0 : 1;
    }
    if (strcmp(mode, "--child-clean") == 0) { /* releases and pops everything */
        gj_scope_push();
        gj_tensor *t = gj_ones(GJ_F32, 1, SHAPE);
        gj_tensor *u = gj_scope_keep(gj_add(t, t));
        gj_scope_pop();
        gj_release(u);
        return 0;
    }
    return 2;
}

/* 100,000 pushes without a pop used to grow silently: now one warning on
 * stderr when a thread's depth reaches 10,000, and only one. */
static void test_deep_warning(void **s) {
    char *err = NULL;
    assert_int_equal(gjt_run_self(g_self, "--child-deep", NULL, NULL, &err), 0);
    const char *w = strstr(err, "gradjit: 10000 scopes are open on one thread");
    if (!w) print_error("stderr: %s\n", err);
    assert_non_null(w);
    assert_null(strstr(w + strlen("gradjit: 10000 scopes"), "scopes are open")); /* once */
    assert_non_null(strstr(err, "gj_scope_pop"));
    free(err);
}

/* GRADJIT_LOG=leaks: one line at exit with the tensors alive, their bytes
 * and the scopes open; a clean program says zero. */
static void test_leak_report(void **s) {
    /* the leaking child's leaks are the point: LeakSanitizer must not fail it */
    const char *env[] = {"GRADJIT_LOG=leaks", "ASAN_OPTIONS=detect_leaks=0", NULL};
    char *err = NULL;
    assert_int_equal(gjt_run_self(g_self, "--child-leak", env, NULL, &err), 0);
    char want[256];
    snprintf(want, sizeof want,
             "[gradjit leaks] at exit: 2 tensors alive (%lld bytes of tensor storage), 1 scope "
             "open (1 on the exiting thread): release what you own and pop every scope you push\n",
             (long long)(BYTES + 3 * 8));
    assert_string_equal(err, want);
    free(err);
    assert_int_equal(gjt_run_self(g_self, "--child-clean", env, NULL, &err), 0);
    assert_string_equal(err, "[gradjit leaks] at exit: 0 tensors alive (0 bytes of tensor "
                             "storage), 0 scopes open (0 on the exiting thread)\n");
    free(err);
    /* without the word: nothing */
    const char *quiet[] = {"GRADJIT_LOG", "ASAN_OPTIONS=detect_leaks=0", NULL};
    assert_int_equal(gjt_run_self(g_self, "--child-leak", quiet, NULL, &err), 0);
    assert_string_equal(err, "");
    free(err);
}

int main(int argc, char **argv) {
    g_self = argv[0];
    if (argc > 1) return child(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scope_releases_temporaries),
        cmocka_unit_test(test_scope_keep),
        cmocka_unit_test(test_nested_scopes),
        cmocka_unit_test(test_keep_from_inner_scope),
        cmocka_unit_test(test_release_scoped),
        cmocka_unit_test(test_retain_in_scope),
        cmocka_unit_test(test_outside_scope),
        cmocka_unit_test(test_scope_with_graph),
        cmocka_unit_test(test_many),
        cmocka_unit_test(test_unbalanced_pop),
        cmocka_unit_test(test_deep_nesting),
        cmocka_unit_test(test_scopes_per_thread),
        cmocka_unit_test(test_scope_depth),
        cmocka_unit_test(test_live_tensors),
        cmocka_unit_test(test_deep_warning),
        cmocka_unit_test(test_leak_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
