/* SPDX-License-Identifier: MIT */
/*
 * test_names.c - tensor names (gj_tensor_set_name): the API, the nn layers
 * naming their parameters, and the errors that quote a name.
 */
#include "gjtest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void test_name_api(void **state) {
    (void)state;
    gj_tensor *t = gj_zeros(GJ_F32, 1, (int64_t[]){3});
    assert_null(gj_tensor_name(t));
    assert_int_equal(gj_tensor_set_name(t, "fc1.weight"), 0);
    assert_string_equal(gj_tensor_name(t), "fc1.weight");
    assert_int_equal(gj_tensor_set_name(t, "renamed"), 0);
    assert_string_equal(gj_tensor_name(t), "renamed");
    char long_name[300];
    memset(long_name, 'x', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = 0;
    assert_int_equal(gj_tensor_set_name(t, long_name), -1);
    assert_true(gjt_error_has("at most 255"));
    assert_string_equal(gj_tensor_name(t), "renamed"); /* unchanged */
    gj_tensor *v = gj_reshape(t, 2, (int64_t[]){1, 3});
    assert_null(gj_tensor_name(v)); /* views do not inherit it */
    gj_release(v);
    assert_int_equal(gj_tensor_set_name(t, NULL), 0);
    assert_null(gj_tensor_name(t));
    assert_int_equal(gj_tensor_set_name(NULL, "x"), -1);
    assert_null(gj_tensor_name(NULL));
    gj_release(t);
}

static void test_layers_name_params(void **state) {
    (void)state;
    gj_linear_layer l;
    assert_int_equal(gj_linear_init(&l, 4, 2, true, GJ_F32), 0);
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_linear_state_dict_add(&l, sd, "fc1"), 0);
    assert_string_equal(gj_tensor_name(l.weight), "fc1.weight");
    assert_string_equal(gj_tensor_name(l.bias), "fc1.bias");
    gj_state_dict_free(sd);
    gj_linear_free(&l);
}

/* The in-place error names the saved tensor; the optimizer's error names
 * the parameter. */
static void test_errors_quote_names(void **state) {
    (void)state;
    gj_tensor *w = gj_ones(GJ_F64, 2, (int64_t[]){2, 2});
    gj_tensor *x = gj_ones(GJ_F64, 2, (int64_t[]){2, 2});
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_tensor_set_name(w, "block3.attn.w"), 0);
    gj_scope_push();
    gj_tensor *loss = gj_sum(gj_matmul(x, w), 0, NULL, false);
    gj_no_grad_push();
    assert_int_equal(gj_mul_scalar_(w, 2.0), 0); /* modifies a saved tensor */
    gj_no_grad_pop();
    assert_true(gjt_backward_fails(loss, NULL, false));
    assert_true(gjt_error_has("'block3.attn.w'") && gjt_error_has("modified by an in-place"));
    gj_scope_pop();

    /* an optimizer step on a non-contiguous parameter (a transposed view) */
    gj_tensor *base = gj_zeros(GJ_F64, 2, (int64_t[]){2, 3});
    gj_tensor *p = gj_transpose(base, 0, 1);
    assert_int_equal(gj_set_requires_grad(p, true), 0);
    assert_int_equal(gj_tensor_set_name(p, "head.w"), 0);
    gj_tensor *g = gj_ones(GJ_F64, 2, (int64_t[]){3, 2});
    assert_int_equal(gj_tensor_set_grad(p, g), 0);
    gj_release(g);
    gj_optim *o = gj_sgd_new(1, &p, 0.1, 0.0, 0.0);
    if (o) { /* refused at construction or at the step: either names it */
        assert_int_equal(gj_optim_step(o), -1);
        gj_optim_free(o);
    }
    assert_true(gjt_error_has("'head.w'"));
    gj_release(p);
    gj_release(base);
    gj_release(x);
    gj_release(w);
}

/* GRADJIT_LOG=graph (set in main) quotes a leaf's name in the captured
 * graph's .grad outputs: stderr goes to a file for one compiled backward. */
static void test_graph_dump_quotes_names(void **state) {
    (void)state;
    char path[] = "/tmp/gjt_names_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    gj_tensor *w = gj_ones(GJ_F32, 2, (int64_t[]){3, 3});
    gj_tensor *x = gj_ones(GJ_F32, 2, (int64_t[]){2, 3});
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_tensor_set_name(w, "encoder.w_q"), 0);
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(true);
    fflush(stderr);
    int saved = dup(2);
    assert_true(dup2(fd, 2) >= 0);
    gj_scope_push();
    gj_tensor *loss = gj_sum(gj_tanh(gj_matmul(x, w)), 0, NULL, false);
    int rc = gj_backward(loss, NULL);
    gj_scope_pop();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    gj_set_compiled_autograd(was);
    assert_int_equal(rc, 0);
    char buf[65536];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    buf[n] = 0;
    if (!strstr(buf, ".grad of acc node") || !strstr(buf, "'encoder.w_q'")) {
        fprintf(stderr, "graph dump without the name:\n%s\n", buf);
        fail();
    }
    gj_release(x);
    gj_release(w);
}

int main(void) {
    /* before anything reads GRADJIT_LOG (once per process); a disk cache
     * hit would skip the capture that prints the graph */
    setenv("GRADJIT_LOG", "graph", 1);
    setenv("GRADJIT_CACHE_DIR", "off", 1);
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_name_api),
        cmocka_unit_test(test_layers_name_params),
        cmocka_unit_test(test_errors_quote_names),
        cmocka_unit_test(test_graph_dump_quotes_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
