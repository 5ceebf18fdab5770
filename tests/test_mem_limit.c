/* SPDX-License-Identifier: MIT */
/*
 * test_mem_limit.c - the memory limit on the bytes gradjit holds for
 * tensors (gj_set_mem_limit, GRADJIT_MEM_LIMIT_MB; runtime/alloc_cache.c).
 *
 *   - Allocations fail, with an error naming the limit, exactly when the
 *     bytes held would pass it; held_bytes never passes it; freeing makes
 *     room again; a request that only fits once the allocator's cache is
 *     emptied succeeds (the cache is emptied first). 0 removes the limit; a
 *     negative limit is an error.
 *   - A compiled training step (gj_step) under a limit below what it needs
 *     fails cleanly: -1, the limit in the error, the parameters untouched,
 *     no tensor bytes leaked; the same step with room runs and equals the
 *     eager step.
 *   - GRADJIT_MEM_LIMIT_MB sets the limit at start (a child process); a
 *     value that is not a count of MiB warns and sets none.
 */
#include "gjtest.h"

#include "runtime/rt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB ((int64_t)1 << 20)

static const char *g_self;

static gj_mem mem_now(void) {
    gj_mem m;
    gj_mem_stats(&m);
    return m;
}

static int restore(void **state) {
    (void)state;
    gj_set_mem_limit(0);
    return 0;
}

/* 1 MiB tensors (exactly one size class) until the limit refuses one. */
static void test_limit_basics(void **state) {
    (void)state;
    gj_clear_error();
    assert_int_equal(gj_set_mem_limit(-5), -1);
    assert_true(gjt_error_has("gj_set_mem_limit: the limit must be >= 0 bytes"));
    gj_mem_release_cache();
    int64_t base = mem_now().held_bytes;
    assert_int_equal(gj_set_mem_limit(base + 8 * MIB), 0);
    assert_true(mem_now().limit_bytes == base + 8 * MIB);
    const int64_t n1 = MIB / 4; /* f32 elements of 1 MiB */
    gj_tensor *t[16] = {0};
    int got = 0;
    gj_clear_error();
    for (; got < 16; got++) {
        t[got] = gj_zeros(GJ_F32, 1, &n1);
        if (!t[got]) break;
        assert_true(mem_now().held_bytes <= base + 8 * MIB);
    }
    assert_int_equal(got, 8);
    assert_true(gjt_error_has("memory limit of"));
    assert_true(gjt_error_has("GRADJIT_MEM_LIMIT_MB or gj_set_mem_limit"));
    /* freed blocks are cached (still held); a 4 MiB tensor needs the
     * cache emptied first, and gets it */
    for (int k = 0; k < got; k++) gj_release(t[k]);
    assert_true(mem_now().held_bytes == base + 8 * MIB);
    const int64_t n4 = MIB;
    gj_tensor *big = gj_zeros(GJ_F32, 1, &n4);
    assert_non_null(big);
    assert_true(mem_now().held_bytes == base + 4 * MIB);
    /* 5 MiB more: refused; without the limit: fine */
    const int64_t n5 = 5 * MIB / 4;
    assert_null(gj_zeros(GJ_F32, 1, &n5));
    assert_int_equal(gj_set_mem_limit(0), 0);
    gj_tensor *more = gj_zeros(GJ_F32, 1, &n5);
    assert_non_null(more);
    gj_release(more);
    gj_release(big);
}

/* x[16, 256] -> Linear(256, 256) -> GELU -> Linear(256, 8) -> CE. */
typedef struct mlp {
    gj_tensor *p[4];
} mlp;

static gj_tensor *mlp_loss(void *ctx, int n_in, gj_tensor *const *in) {
    mlp *m = ctx;
    (void)n_in;
    gj_tensor *h = gj_gelu(gj_linear(in[0], m->p[0], m->p[1]));
    return gj_cross_entropy(gj_linear(h, m->p[2], m->p[3]), in[1]);
}

static void mlp_init(mlp *m) {
    gjt_rng r;
    gjt_rng_seed(&r, 3);
    const int64_t s[4][2] = {{256, 256}, {256, 0}, {8, 256}, {8, 0}};
    for (int k = 0; k < 4; k++) {
        m->p[k] = gjt_uniform(&r, GJ_F32, s[k][1] ? 2 : 1, s[k], -0.1, 0.1);
        assert_int_equal(gj_set_requires_grad(m->p[k], true), 0);
    }
}

/* Two steps of a fresh copy of the model (eager or compiled) under `limit`
 * bytes above what is held now (0: none): the return code of the first
 * failing step (0 if none), and the parameters' values after. */
static int run_steps(bool eager, int64_t limit, double *out, int64_t *n_out) {
    mlp m;
    mlp_init(&m);
    gj_optim *o = gj_adamw_new(4, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.0);
    gj_step_opts so = {.eager = eager};
    gj_step *st = gj_step_new(mlp_loss, &m, o, &so);
    assert_non_null(st);
    gjt_rng r;
    gjt_rng_seed(&r, 9);
    gj_mem_release_cache();
    if (limit) assert_int_equal(gj_set_mem_limit(mem_now().held_bytes + limit), 0);
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        gj_scope_push();
        int64_t xs[2] = {16, 256}, b = 16;
        gj_tensor *in[2] = {gjt_uniform(&r, GJ_F32, 2, xs, -1, 1), gjt_labels(&r, 1, &b, 8)};
        rc = gj_step_run(st, 2, in, NULL);
        gj_scope_pop();
    }
    assert_int_equal(gj_set_mem_limit(0), 0);
    int64_t at = 0;
    for (int k = 0; k < 4; k++) {
        assert_int_equal(gj_tensor_to_f64(m.p[k], out + at), 0);
        at += gj_tensor_numel(m.p[k]);
    }
    *n_out = at;
    gj_step_free(st);
    gj_optim_free(o);
    for (int k = 0; k < 4; k++) gj_release(m.p[k]);
    return rc;
}

static void test_limit_step(void **state) {
    (void)state;
    int64_t n = 256 * 256 + 256 + 8 * 256 + 8;
    double *e = malloc((size_t)n * sizeof *e), *c = malloc((size_t)n * sizeof *c);
    double *f = malloc((size_t)n * sizeof *f), *init = malloc((size_t)n * sizeof *init);
    assert_true(e && c && f && init);
    int64_t live0 = gjt_live_bytes(), k;
    assert_int_equal(run_steps(true, 0, e, &k), 0);
    assert_int_equal(run_steps(false, 0, c, &k), 0);
    assert_memory_equal(e, c, (size_t)n * sizeof *e);
    /* 64 KiB above what the process holds: the model's own AdamW state
     * (2 x 264 KiB) cannot be had; the step fails and leaves the
     * parameters as they were */
    mlp m;
    mlp_init(&m);
    int64_t at = 0;
    for (int j = 0; j < 4; j++) {
        assert_int_equal(gj_tensor_to_f64(m.p[j], init + at), 0);
        at += gj_tensor_numel(m.p[j]);
        gj_release(m.p[j]);
    }
    gj_clear_error();
    assert_int_equal(run_steps(false, 64 * 1024, f, &k), -1);
    if (!gjt_error_has("memory limit of")) fail_msg("the error: %s", gj_last_error());
    assert_memory_equal(f, init, (size_t)n * sizeof *f);
    assert_int_equal(gjt_live_bytes(), live0);
    /* with room for it (8 MiB): the compiled step's bits again */
    assert_int_equal(run_steps(false, 8 * MIB, f, &k), 0);
    assert_memory_equal(f, c, (size_t)n * sizeof *f);
    assert_int_equal(gjt_live_bytes(), live0);
    free(e), free(c), free(f), free(init);
}

static void test_env(void **state) {
    (void)state;
    const char *env[] = {"GRADJIT_MEM_LIMIT_MB=3", NULL};
    char *out = NULL, *err = NULL;
    assert_int_equal(gjt_run_self(g_self, "--child-limit", env, &out, &err), 0);
    assert_non_null(strstr(out, "limit 3145728"));
    free(out), free(err);
    const char *bad[] = {"GRADJIT_MEM_LIMIT_MB=3GB", NULL};
    assert_int_equal(gjt_run_self(g_self, "--child-limit", bad, &out, &err), 0);
    assert_non_null(strstr(out, "limit 0"));
    assert_non_null(strstr(err, "GRADJIT_MEM_LIMIT_MB='3GB' is not a whole number"));
    free(out), free(err);
}

int main(int argc, char **argv) {
    g_self = argv[0];
    if (argc >= 2 && strcmp(argv[1], "--child-limit") == 0) {
        gj_mem m = mem_now();
        printf("limit %lld\n", (long long)m.limit_bytes);
        return 0;
    }
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_limit_basics, restore),
        cmocka_unit_test_teardown(test_limit_step, restore),
        cmocka_unit_test_teardown(test_env, restore),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
