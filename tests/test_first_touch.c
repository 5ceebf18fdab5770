/* SPDX-License-Identifier: MIT */
/*
 * test_first_touch.c - memory touched once, in huge pages
 * (runtime/alloc_cache.c, runtime/alloc.c, autograd/optim.c).
 *
 *   - A large tensor block (2 MiB and more) is 2 MiB-aligned, new from the
 *     system, and advised for transparent huge pages exactly when the
 *     kernel offers them and the setting is on (counters, so the test holds
 *     where THP is `never` or absent); gj_warmup_stats reports the page
 *     size.
 *   - gj_set_hugepages(false), GRADJIT_HUGEPAGES=0 (a child process) and a
 *     kernel without THP (simulated) advise nothing and report 4 KiB pages.
 *   - Known zero: gj_zeros of a new large block writes nothing (the bytes
 *     zero-filled do not grow; the skipped ones do) and reads as zeros; a
 *     recycled block is zero-filled again (dirty bytes come back as 0).
 *   - AdamW's first update is the first writer of its state: the
 *     parameter and state equal, bit for bit, an update run on explicitly
 *     zero-filled state; the interpreter run on state full of NaN marked
 *     as zero gives those bits too (it never reads it).
 *   - A compiled step's first run is its program's first run: the traced
 *     forward is eager, the program runs the backward and the update, so
 *     the runs after it map no new memory (their buffers are the first
 *     run's, cached), the first run's peak is not above the eager step's,
 *     and losses and parameters equal the eager step's bit for bit.
 */
#include "gjtest.h"

#include "autograd/ag.h"
#include "runtime/rt.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define MIB ((int64_t)1 << 20)

static const char *g_self;

static gj_warmup_stats warm_now(void) {
    gj_warmup_stats w;
    gj_warmup_stats_get(&w);
    return w;
}

static bool thp_offered(void) {
    int m = gj_rt_thp_mode();
    return m == GJ_RT_THP_MADVISE || m == GJ_RT_THP_ALWAYS;
}

static int restore(void **state) {
    (void)state;
    gj_set_hugepages(true);
    gj_rt_thp_simulate(-1);
    return 0;
}

/* A new 8 MiB block: aligned, mapped, advised as the kernel allows, zero
 * without a zero fill. */
static void test_large_block(void **state) {
    (void)state;
    gj_mem_release_cache(); /* (no cached block of this class) */
    gj_warmup_stats a = warm_now();
    const int64_t n = 2 * MIB; /* f32: 8 MiB */
    gj_tensor *t = gj_zeros(GJ_F32, 1, &n);
    assert_non_null(t);
    gj_warmup_stats b = warm_now();
    assert_int_equal((uintptr_t)gj_tensor_data(t) % (uintptr_t)(2 * MIB), 0);
    assert_true(b.new_bytes - a.new_bytes >= 8 * MIB);
    if (thp_offered()) {
        assert_true(b.huge_bytes - a.huge_bytes >= 8 * MIB);
        assert_int_equal(b.page_kib, 2048);
    } else {
        assert_int_equal(b.huge_bytes, a.huge_bytes);
        assert_int_equal(b.page_kib, 4);
    }
    assert_int_equal(b.zeroed_bytes, a.zeroed_bytes); /* no memset of new memory */
    assert_int_equal(b.zero_skipped_bytes - a.zero_skipped_bytes, 8 * MIB);
    const float *f = gj_tensor_data(t);
    for (int64_t i = 0; i < n; i += 4093) assert_true(f[i] == 0.0f && !signbit(f[i]));
    assert_true(f[n - 1] == 0.0f);
    gj_release(t);
}

/* A block back from the cache is not known zero: zero-filled again. */
static void test_recycled_zeroed(void **state) {
    (void)state;
    gj_mem_release_cache();
    const int64_t n = MIB; /* 4 MiB */
    gj_tensor *t = gj_full(GJ_F32, 1, &n, 3.5);
    assert_non_null(t);
    void *p = gj_tensor_data(t);
    gj_release(t);
    gj_warmup_stats a = warm_now();
    t = gj_zeros(GJ_F32, 1, &n);
    assert_non_null(t);
    gj_warmup_stats b = warm_now();
    assert_ptr_equal(gj_tensor_data(t), p); /* the cached block */
    assert_int_equal(b.new_bytes, a.new_bytes);
    assert_int_equal(b.zeroed_bytes - a.zeroed_bytes, 4 * MIB);
    assert_int_equal(b.zero_skipped_bytes, a.zero_skipped_bytes);
    const float *f = gj_tensor_data(t);
    for (int64_t i = 0; i < n; i++)
        if (f[i] != 0.0f) fail_msg("element %lld is %g", (long long)i, (double)f[i]);
    gj_release(t);
    /* small blocks are not mappings: nothing counted as new */
    a = warm_now();
    const int64_t s = 1000;
    t = gj_zeros(GJ_F32, 1, &s);
    assert_non_null(t);
    b = warm_now();
    assert_int_equal(b.new_bytes, a.new_bytes);
    gj_release(t);
}

/* The setting off, and a kernel without THP: mapped, aligned, not advised. */
static void test_setting_off(void **state) {
    (void)state;
    const int64_t n = MIB + 12345; /* another class than the tests above */
    for (int round = 0; round < 2; round++) {
        if (round == 0) gj_set_hugepages(false);
        else gj_rt_thp_simulate(GJ_RT_THP_NEVER);
        gj_mem_release_cache();
        gj_warmup_stats a = warm_now();
        gj_tensor *t = gj_zeros(GJ_F32, 1, &n);
        assert_non_null(t);
        gj_warmup_stats b = warm_now();
        assert_int_equal((uintptr_t)gj_tensor_data(t) % (uintptr_t)(2 * MIB), 0);
        assert_true(b.new_bytes - a.new_bytes >= n * 4);
        assert_int_equal(b.huge_bytes, a.huge_bytes);
        assert_int_equal(b.page_kib, 4);
        gj_release(t);
        restore(NULL);
    }
    /* on again: advised where the kernel offers it */
    gj_mem_release_cache();
    gj_warmup_stats a = warm_now();
    gj_tensor *t = gj_zeros(GJ_F32, 1, &n);
    assert_non_null(t);
    gj_warmup_stats b = warm_now();
    assert_true((b.huge_bytes > a.huge_bytes) == thp_offered());
    gj_release(t);
}

static void test_env_off(void **state) {
    (void)state;
    const char *env[] = {"GRADJIT_HUGEPAGES=0", NULL};
    char *out = NULL, *err = NULL;
    assert_int_equal(gjt_run_self(g_self, "--child-pages", env, &out, &err), 0);
    assert_non_null(strstr(out, "advised 0 page_kib 4"));
    free(out), free(err);
    const char *on[] = {"GRADJIT_HUGEPAGES=1", NULL};
    assert_int_equal(gjt_run_self(g_self, "--child-pages", on, &out, &err), 0);
    assert_non_null(strstr(out, thp_offered() ? "page_kib 2048" : "advised 0 page_kib 4"));
    free(out), free(err);
}

/* ------------------------------------------------ AdamW's first update */

static void fill(float *x, int64_t n, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)((double)(seed >> 11) / 9007199254740992.0 - 0.5);
    }
    x[0] = -0.0f; /* a negative zero gradient: m and v keep +0 as with zero state */
}

static void test_adamw_first_writer(void **state) {
    (void)state;
    const int64_t n = 3 * MIB / 4 + 77; /* 3 MiB of f32: a large block */
    float *p0 = malloc((size_t)n * 4), *g0 = malloc((size_t)n * 4);
    assert_non_null(p0);
    assert_non_null(g0);
    fill(p0, n, 1);
    fill(g0, n, 2);
    /* the optimizer's own first step */
    gj_tensor *p = gj_from_data(GJ_F32, 1, &n, p0);
    gj_tensor *g = gj_from_data(GJ_F32, 1, &n, g0);
    assert_int_equal(gj_tensor_set_grad(p, g), 0);
    gj_optim *o = gj_adamw_new(1, &p, 1e-3, 0.9, 0.999, 1e-8, 0.01);
    assert_non_null(o);
    assert_int_equal(gj_optim_step(o), 0);
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_optim_state_dict_add(o, sd, "opt"), 0);
    gj_tensor *m = gj_state_dict_get(sd, "opt.0.exp_avg"), *v = gj_state_dict_get(sd, "opt.0.exp_avg_sq");
    assert_non_null(m);
    assert_non_null(v);
    /* the reference: explicitly zero state, read as memory */
    const double cfg[] = {1e-3, 0.01, 0.9, 0.999, 1e-8};
    double h[GJ_AG_OPT_MAX_HYPER] = {0};
    gj_ag_opt_adamw.hyper(cfg, 1, h);
    gj_tensor *rp = gj_from_data(GJ_F32, 1, &n, p0), *rg = gj_from_data(GJ_F32, 1, &n, g0);
    gj_tensor *rs[GJ_AG_OPT_MAX_STATE] = {gj_zeros(GJ_F32, 1, &n), gj_zeros(GJ_F32, 1, &n)};
    assert_int_equal(gj_ag_opt_apply(&gj_ag_opt_adamw, 0, h, rp, rg, rs, NULL), 0);
    assert_memory_equal(gj_tensor_data(p), gj_tensor_data(rp), (size_t)n * 4);
    assert_memory_equal(gj_tensor_data(m), gj_tensor_data(rs[0]), (size_t)n * 4);
    assert_memory_equal(gj_tensor_data(v), gj_tensor_data(rs[1]), (size_t)n * 4);
    /* state full of NaN marked zero: never read, the same bits */
    gj_tensor *qp = gj_from_data(GJ_F32, 1, &n, p0);
    gj_tensor *qs[GJ_AG_OPT_MAX_STATE] = {gj_full(GJ_F32, 1, &n, NAN), gj_full(GJ_F32, 1, &n, NAN)};
    unsigned zero = 3;
    assert_int_equal(gj_ag_opt_apply(&gj_ag_opt_adamw, 0, h, qp, rg, qs, &zero), 0);
    assert_int_equal(zero, 0);
    assert_memory_equal(gj_tensor_data(qp), gj_tensor_data(rp), (size_t)n * 4);
    assert_memory_equal(gj_tensor_data(qs[0]), gj_tensor_data(rs[0]), (size_t)n * 4);
    assert_memory_equal(gj_tensor_data(qs[1]), gj_tensor_data(rs[1]), (size_t)n * 4);
    /* the second step reads the state it wrote: as the reference's second */
    gj_ag_opt_adamw.hyper(cfg, 2, h);
    assert_int_equal(gj_optim_step(o), 0);
    assert_int_equal(gj_ag_opt_apply(&gj_ag_opt_adamw, 0, h, rp, rg, rs, NULL), 0);
    assert_memory_equal(gj_tensor_data(p), gj_tensor_data(rp), (size_t)n * 4);
    for (int k = 0; k < 2; k++) gj_release(rs[k]), gj_release(qs[k]);
    gj_release(qp), gj_release(rp), gj_release(rg);
    gj_state_dict_free(sd);
    gj_optim_free(o);
    gj_release(g), gj_release(p);
    free(p0), free(g0);
}

/* An embedding and an MLP whose table, first weight and hidden
 * activations are large blocks. */
enum { FT_B = 256, FT_V = 8192, FT_IN = 512, FT_H = 2048, FT_OUT = 10, FT_STEPS = 4, FT_NP = 5 };

static gj_tensor *ft_loss(void *ctx, int n_in, gj_tensor *const *in) {
    gj_tensor *const *p = ctx;
    (void)n_in;
    gj_tensor *h = gj_gelu(gj_linear(gj_embedding(p[4], in[0]), p[0], p[1]));
    return gj_cross_entropy(gj_linear(h, p[2], p[3]), in[1]);
}

static long minor_faults(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
}

static void test_step_first_run(void **state) {
    (void)state;
    double loss[2][FT_STEPS];
    int64_t peak0[2], new_later[2], zeroed0[2];
    long faults[2][FT_STEPS];
    gj_set_hugepages(false); /* 4 KiB pages: a page left untouched is a fault later */
    float *fin[2];
    int64_t nfin = 0;
    for (int mode = 0; mode < 2; mode++) {
        gjt_rng r;
        gjt_rng_seed(&r, 5);
        gj_tensor *p[FT_NP] = {gjt_uniform(&r, GJ_F32, 2, (int64_t[]){FT_H, FT_IN}, -.05, .05),
                               gjt_uniform(&r, GJ_F32, 1, (int64_t[]){FT_H}, -.05, .05),
                               gjt_uniform(&r, GJ_F32, 2, (int64_t[]){FT_OUT, FT_H}, -.05, .05),
                               gjt_uniform(&r, GJ_F32, 1, (int64_t[]){FT_OUT}, -.05, .05),
                               gjt_uniform(&r, GJ_F32, 2, (int64_t[]){FT_V, FT_IN}, -.5, .5)};
        for (int k = 0; k < FT_NP; k++) assert_int_equal(gj_set_requires_grad(p[k], true), 0);
        gj_optim *o = gj_adamw_new(FT_NP, p, 1e-3, 0.9, 0.999, 1e-8, 0.01);
        gj_step_opts so = {.eager = mode == 0};
        gj_step *s = gj_step_new(ft_loss, p, o, &so);
        assert_non_null(s);
        gj_mem_release_cache();
        new_later[mode] = 0;
        for (int i = 0; i < FT_STEPS; i++) {
            gj_scope_push();
            int64_t b = FT_B;
            gj_tensor *in[2] = {gjt_labels(&r, 1, &b, FT_V), gjt_labels(&r, 1, &b, FT_OUT)};
            gj_mem m0;
            gj_mem_stats(&m0);
            gj_mem_reset_peak();
            gj_warmup_stats w0 = warm_now();
            long f0 = minor_faults();
            gj_tensor *l = NULL;
            if (gj_step_run(s, 2, in, &l) != 0) fail_msg("step %d: %s", i, gj_last_error());
            faults[mode][i] = minor_faults() - f0;
            gj_warmup_stats w1 = warm_now();
            gj_mem m1;
            gj_mem_stats(&m1);
            if (i == 0) peak0[mode] = m1.peak_bytes - m0.live_bytes;
            if (i == 0) zeroed0[mode] = w1.zeroed_bytes - w0.zeroed_bytes;
            if (i >= 1) new_later[mode] += w1.new_bytes - w0.new_bytes;
            loss[mode][i] = gj_tensor_item(l);
            gj_scope_pop();
        }
        if (mode == 1) {
            gj_ca_stats c;
            gj_step_stats(&c);
            if (c.fallbacks) fail_msg("%s", gj_compiled_autograd_last_fallback());
        }
        nfin = 0;
        for (int k = 0; k < FT_NP; k++) nfin += gj_tensor_numel(p[k]);
        fin[mode] = malloc((size_t)nfin * sizeof(float));
        for (int k = 0, at = 0; k < FT_NP; k++) {
            assert_int_equal(gj_tensor_to_f32(p[k], fin[mode] + at), 0);
            at += (int)gj_tensor_numel(p[k]);
        }
        gj_step_free(s);
        gj_optim_free(o);
        for (int k = 0; k < FT_NP; k++) gj_release(p[k]);
    }
    print_message("  first step's peak %lld bytes eager, %lld compiled, zero-filled %lld eager, "
                  "%lld compiled; new bytes in later steps %lld eager, %lld compiled\n",
                  (long long)peak0[0], (long long)peak0[1], (long long)zeroed0[0],
                  (long long)zeroed0[1], (long long)new_later[0], (long long)new_later[1]);
    assert_memory_equal(loss[0], loss[1], sizeof loss[0]);
    assert_memory_equal(fin[0], fin[1], (size_t)nfin * sizeof(float));
    print_message("  page faults per step: eager %ld %ld %ld %ld, compiled %ld %ld %ld %ld\n",
                  faults[0][0], faults[0][1], faults[0][2], faults[0][3], faults[1][0],
                  faults[1][1], faults[1][2], faults[1][3]);
    assert_int_equal(new_later[1], 0);
    assert_true(peak0[1] <= peak0[0]);
    /* the second step touches no page the first left for it: the table's
     * gradient (4096 pages, a few rows scattered) was touched whole */
    for (int mode = 0; mode < 2; mode++) assert_true(faults[mode][1] <= faults[mode][2] + 512);
    free(fin[0]);
    free(fin[1]);
}

int main(int argc, char **argv) {
    g_self = argv[0];
    if (argc >= 2 && strcmp(argv[1], "--child-pages") == 0) {
        const int64_t n = MIB;
        gj_tensor *t = gj_zeros(GJ_F32, 1, &n);
        gj_warmup_stats w = warm_now();
        printf("advised %lld page_kib %d\n", (long long)w.huge_bytes, w.page_kib);
        gj_release(t);
        return 0;
    }
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_large_block, restore),
        cmocka_unit_test_teardown(test_recycled_zeroed, restore),
        cmocka_unit_test_teardown(test_setting_off, restore),
        cmocka_unit_test_teardown(test_env_off, restore),
        cmocka_unit_test_teardown(test_adamw_first_writer, restore),
        cmocka_unit_test_teardown(test_step_first_run, restore),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
