/* SPDX-License-Identifier: MIT */
/*
 * test_jit_fallback.c - the public side of compiled-autograd fallbacks:
 * reason names, per-reason counters, the last fallback's message, quiet
 * mode (one stderr line per eager-only key, none when quiet), the
 * recompile limit per call site (a model run at more batch sizes than the
 * limit: the extra keys run eagerly, remembered per key, other sites
 * unaffected), retain_graph (supported compiled: no fallback, gradients
 * accumulate as eager), tensor hooks (called by the compiled program; see
 * test_jit_hooks.c for their guards), and gj_grad (compiled and counted like a backward).
 * Every backward that falls back still gives the eager gradients.
 */
#include "gjtest.h"

#include "jit/jit.h"
#include "jit/plan/plan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* x[batch, 6] -> tanh(x @ w^T + b) -> mean: w [4, 6], b [4] require grad. */
typedef gjt_mlp mlp; /* gjtest.h */

/* One backward at this batch size (inputs from a fixed seed); returns the
 * backward's status. */
static int mlp_step(mlp *m, int64_t batch, bool compiled, bool sigmoid) {
    gjt_rng r;
    gjt_rng_seed(&r, 100 + (uint64_t)batch);
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){batch, 6}, -1, 1);
    gj_tensor *h = gj_linear(x, m->w, m->b);
    h = sigmoid ? gj_sigmoid(h) : gj_tanh(h);
    int rc = gj_backward(gj_mean(h, 0, NULL, false), NULL);
    gj_release(x);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    return rc;
}

/* The .grad values of w and b after one step, then cleared (malloc'd). */
static double *take_grads(mlp *m) {
    double *g = malloc(28 * sizeof *g);
    assert_non_null(g);
    double *gw = gjt_values(gj_tensor_grad(m->w)), *gb = gjt_values(gj_tensor_grad(m->b));
    assert_true(gw && gb);
    memcpy(g, gw, 24 * sizeof *g);
    memcpy(g + 24, gb, 4 * sizeof *g);
    free(gw);
    free(gb);
    assert_int_equal(gj_tensor_set_grad(m->w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(m->b, NULL), 0);
    return g;
}

/* Step at batch compiled; its grads equal eager's exactly. */
static void step_matches_eager(mlp *m, int64_t batch, bool sigmoid) {
    assert_int_equal(mlp_step(m, batch, false, sigmoid), 0);
    double *want = take_grads(m);
    assert_int_equal(mlp_step(m, batch, true, sigmoid), 0);
    double *got = take_grads(m);
    assert_memory_equal(got, want, 28 * sizeof *got);
    free(got);
    free(want);
}

/* ------------------------------------------------------------ the tests */

static void test_reason_names(void **st) {
    (void)st;
    for (int r = 0; r < GJ_CA_N_REASONS; r++) {
        const char *n = gj_ca_reason_name((gj_ca_reason)r);
        assert_non_null(n);
        assert_true(strlen(n) > 0 && strcmp(n, "unknown") != 0);
        for (int q = 0; q < r; q++) assert_string_not_equal(n, gj_ca_reason_name((gj_ca_reason)q));
    }
    assert_string_equal(gj_ca_reason_name(GJ_CA_NO_LOWERING), "no_lowering");
    assert_string_equal(gj_ca_reason_name(GJ_CA_RECOMPILE_LIMIT), "recompile_limit");
    assert_string_equal(gj_ca_reason_name(GJ_CA_N_REASONS), "unknown");
    assert_string_equal(gj_ca_reason_name((gj_ca_reason)-1), "unknown");
}

/* Limit 3 per call site: batches 1..3 compile, 4 and 5 run eagerly with
 * GJ_CA_RECOMPILE_LIMIT (and stay eager-only: no capture when seen again),
 * a compiled batch still hits, another site (sigmoid instead of tanh)
 * still compiles. Limit 0: nothing new compiles; < 0: no limit. */
static void test_recompile_limit(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    assert_int_equal(gj_jit_recompile_limit(), 8); /* the default */
    gj_compiled_autograd_set_recompile_limit(3);
    /* sizes make the keys here: with dynamic shapes (the default) batches 3
     * on would be bound to the symbolic kernels, not compiled
     * (test_jit_dynamic.c); off, every size compiles */
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_OFF);
    mlp m;
    gjt_mlp_init(&m, 41);
    for (int64_t batch = 1; batch <= 5; batch++) step_matches_eager(&m, batch, false);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 3);
    assert_int_equal(s.fallbacks, 2);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RECOMPILE_LIMIT], 2);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "recompile_limit: "));
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "limit 3"));
    step_matches_eager(&m, 4, false); /* remembered: eager again, no compile */
    step_matches_eager(&m, 2, false); /* compiled: a hit */
    s = gjt_ca_now();
    assert_int_equal(s.compiles, 3);
    assert_int_equal(s.mem_hits, 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RECOMPILE_LIMIT], 3);
    step_matches_eager(&m, 1, true); /* another call site */
    assert_int_equal(gjt_ca_now().compiles, 4);
    assert_int_equal(gjt_ca_now().fallbacks, 3);

    gj_compiled_autograd_set_recompile_limit(0);
    step_matches_eager(&m, 2, true); /* new key of the sigmoid site: refused */
    assert_int_equal(gjt_ca_now().compiles, 4);
    assert_int_equal(gjt_ca_now().fallbacks_by_reason[GJ_CA_RECOMPILE_LIMIT], 4);
    step_matches_eager(&m, 3, false); /* compiled before: still runs compiled */
    assert_int_equal(gjt_ca_now().mem_hits, 2);

    gj_compiled_autograd_set_recompile_limit(-1);
    for (int64_t batch = 6; batch <= 12; batch++) step_matches_eager(&m, batch, false);
    assert_int_equal(gjt_ca_now().compiles, 11);
    assert_int_equal(gjt_ca_now().fallbacks, 4);

    gj_compiled_autograd_set_recompile_limit(8);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
    gj_compiled_autograd_reset_stats();
    s = gjt_ca_now();
    for (int r = 0; r < GJ_CA_N_REASONS; r++) assert_int_equal(s.fallbacks_by_reason[r], 0);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* stderr lines of fallbacks while fn runs (fn's own output ignored). */
static int count_fallback_lines(void (*fn)(mlp *), mlp *m) {
    char path[] = "/tmp/gradjit-fallback-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fd, STDERR_FILENO) >= 0);
    fn(m);
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    FILE *f = fdopen(fd, "r");
    assert_non_null(f);
    rewind(f);
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f))
        n += strstr(line, "compiled autograd fell back to eager: no_lowering: ") != NULL;
    fclose(f);
    unlink(path);
    return n;
}

/* Two backwards of one key (the .grad cleared in between) refused. */
static void two_refused_steps(mlp *m) {
    gj_jit_test_no_lowering(GJ_P_MATMUL);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(mlp_step(m, 3, true, false), 0);
        free(take_grads(m));
    }
    gj_jit_test_no_lowering(-1);
}

/* A key that falls back for good prints one line (not one per backward);
 * quiet mode prints none; the counters count either way. */
static void test_quiet(void **st) {
    (void)st;
    mlp m;
    gjt_mlp_init(&m, 41);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    unsetenv("GRADJIT_LOG");
    gj_compiled_autograd_set_quiet(false);
    assert_int_equal(count_fallback_lines(two_refused_steps, &m), 1);
    assert_int_equal(gjt_ca_now().fallbacks_by_reason[GJ_CA_NO_LOWERING], 2);
    gj_jit_clear_cache();
    gj_compiled_autograd_set_quiet(true);
    assert_int_equal(count_fallback_lines(two_refused_steps, &m), 0);
    assert_int_equal(gjt_ca_now().fallbacks_by_reason[GJ_CA_NO_LOWERING], 4);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "no lowering for matmul"));
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
}

/* retain_graph is supported compiled: three backwards through one graph
 * (the last one frees it) accumulate exactly as eager's, no fallback. */
static void retained_three(mlp *m, bool compiled) {
    gjt_rng r;
    gjt_rng_seed(&r, 7);
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){5, 6}, -1, 1);
    gj_tensor *loss = gj_mean(gj_tanh(gj_linear(x, m->w, m->b)), 0, NULL, false);
    assert_int_equal(gj_backward_ex(loss, NULL, true), 0);
    assert_int_equal(gj_backward_ex(loss, NULL, true), 0);
    assert_int_equal(gj_backward_ex(loss, NULL, false), 0);
    assert_int_not_equal(gj_backward(loss, NULL), 0); /* freed now, in both modes */
    GJT_ASSERT_ERROR("second time");
    gj_release(x);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
}

static void test_retain_graph(void **st) {
    (void)st;
    mlp m;
    gjt_mlp_init(&m, 41);
    gj_jit_clear_cache();
    retained_three(&m, false);
    double *want = take_grads(&m);
    gj_compiled_autograd_reset_stats();
    retained_three(&m, true);
    double *got = take_grads(&m);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RETAIN_GRAPH], 0);
    assert_int_equal(s.compiles + s.mem_hits, 3); /* .grad absent, then present: 2 keys */
    assert_int_equal(s.fallbacks, 0); /* the freed graph is eager's error, not a fallback */
    assert_memory_equal(got, want, 28 * sizeof *got);
    free(got);
    free(want);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
}

/* A tensor hook on the graph: the compiled program calls it (once, on the
 * real gradient; eager gradients, no fallback); the key records hook kinds
 * and counts, so the same model without the hook is another program. */
static int g_hook_calls;
static gj_tensor *double_hook(gj_tensor *grad, void *user) {
    (void)user;
    g_hook_calls++;
    return gj_mul_scalar(grad, 2.0);
}

static void hooked(mlp *m, bool compiled, bool hook) {
    gjt_rng r;
    gjt_rng_seed(&r, 9);
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
    gj_tensor *h = gj_linear(x, m->w, m->b);
    if (hook) assert_true(gj_register_hook(h, double_hook, NULL) > 0);
    assert_int_equal(gj_backward(gj_mean(gj_tanh(h), 0, NULL, false), NULL), 0);
    gj_release(x);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
}

static void test_hooks_compiled(void **st) {
    (void)st;
    mlp m;
    gjt_mlp_init(&m, 41);
    gj_jit_clear_cache();
    hooked(&m, false, true);
    double *want = take_grads(&m);
    gj_compiled_autograd_reset_stats();
    g_hook_calls = 0;
    hooked(&m, true, true);
    double *got = take_grads(&m);
    assert_int_equal(g_hook_calls, 1);
    assert_memory_equal(got, want, 28 * sizeof *got);
    assert_int_equal(gjt_ca_now().compiles, 1);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    hooked(&m, true, false); /* no hook: another key, compiled */
    free(take_grads(&m));
    assert_int_equal(gjt_ca_now().compiles, 2);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    free(got);
    free(want);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
}

/* gj_grad runs compiled with the flag on and is counted like a backward
 * (one backward, one compile); it touches no .grad (tests/test_jit_grad.c
 * checks its results against eager's). */
static void test_grad_counts(void **st) {
    (void)st;
    mlp m;
    gjt_mlp_init(&m, 41);
    gj_compiled_autograd_reset_stats();
    gj_set_compiled_autograd(true);
    gj_scope_push();
    gjt_rng r;
    gjt_rng_seed(&r, 8);
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
    gj_tensor *loss = gj_mean(gj_tanh(gj_linear(x, m.w, m.b)), 0, NULL, false);
    gj_tensor *in[2] = {m.w, m.b}, *g[2] = {NULL, NULL};
    assert_int_equal(gj_grad(1, &loss, NULL, 2, in, g, false, false), 0);
    assert_non_null(g[0]);
    assert_non_null(g[1]);
    gj_release(g[0]);
    gj_release(g[1]);
    gj_release(x);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 1);
    assert_int_equal(s.compiles + s.disk_hits, 1); /* the ctest disk cache may hold it */
    assert_int_equal(s.mem_hits + s.fallbacks, 0);
    assert_null(gj_tensor_grad(m.w));
    gjt_mlp_free(&m);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reason_names),
        cmocka_unit_test(test_recompile_limit),
        cmocka_unit_test(test_quiet),
        cmocka_unit_test(test_retain_graph),
        cmocka_unit_test(test_hooks_compiled),
        cmocka_unit_test(test_grad_counts),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
