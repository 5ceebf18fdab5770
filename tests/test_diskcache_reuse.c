/* SPDX-License-Identifier: MIT */
/*
 * test_diskcache_reuse.c - every program one process compiles, shares or
 * instantiates is a disk hit in the next process.
 *
 * A child process runs a suite of models on one GRADJIT_CACHE_DIR: MLPs
 * whose layers are identical within a model and between models (so later
 * models borrow kernels an earlier one compiled), a train variant with
 * dropout next to its eval variant, a tensor hook, post-accumulate hooks
 * and a custom op, each in f32, f64 and bf16. Each model trains a few
 * steps eagerly and then compiled from the same weights, and the child
 * checks the compiled gradients against eager's. It prints its counters.
 * The parent runs the child twice on a fresh directory: the first compiles
 * and shares kernels between programs; the second compiles nothing, falls
 * back nowhere, and finds every program the first one made on disk.
 */
#include "gjtest.h"

#include "../jit/jit.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *g_self;

enum { STEPS = 3, BATCH = 8, IN = 12, HID = 24, OUT = 6, MAXL = 4 };

typedef enum variant {
    V_PLAIN = 0,   /* the eval variant */
    V_DROPOUT = 1, /* the train variant: dropout after each hidden GELU */
    V_HOOK = 2,    /* a tensor hook halves the gradient of the first hidden layer */
    V_POST = 3,    /* post-accumulate hooks on every weight (count their calls) */
    V_CUSTOM = 4,  /* a custom op (scaled tanh) after the first hidden layer */
} variant;

typedef struct model {
    int layers; /* Linear layers: IN -> HID (-> HID)* -> OUT */
    variant v;
    gj_dtype dt;
    gj_tensor *w[MAXL], *b[MAXL];
} model;

static gj_custom_op *g_stanh;
static int g_post_calls;

/* mylib::stanh(x, alpha) = alpha * tanh(x) */
static int stanh_fwd(gj_tensor *x, double alpha, gj_tensor **out) {
    *out = gj_mul_scalar(gj_tanh(x), alpha);
    return *out ? 0 : -1;
}

static int stanh_bwd(gj_tensor *g, gj_tensor *x, double alpha, gj_tensor **gx) {
    gj_tensor *t = gj_tanh(x);
    gj_tensor *d = gj_add_scalar(gj_neg(gj_mul(t, t)), 1.0);
    *gx = gj_mul_scalar(gj_mul(g, d), alpha);
    return *gx ? 0 : -1;
}

static gj_tensor *halve(gj_tensor *g, void *user) {
    (void)user;
    return gj_mul_scalar(g, 0.5);
}

static void count_post(gj_tensor *leaf, void *user) {
    (void)leaf;
    (void)user;
    g_post_calls++;
}

static void model_init(model *m, int layers, variant v, gj_dtype dt, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->layers = layers;
    m->v = v;
    m->dt = dt;
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    for (int l = 0; l < layers; l++) {
        int64_t in = l == 0 ? IN : HID, out = l == layers - 1 ? OUT : HID;
        const int64_t sw[] = {out, in}, sb[] = {out};
        m->w[l] = gjt_uniform(&r, dt, 2, sw, -0.4, 0.4);
        m->b[l] = gjt_uniform(&r, dt, 1, sb, -0.1, 0.1);
        assert_int_equal(gj_set_requires_grad(m->w[l], true), 0);
        assert_int_equal(gj_set_requires_grad(m->b[l], true), 0);
        if (v == V_POST)
            assert_true(gj_register_post_accumulate_grad_hook(m->w[l], count_post, NULL) > 0);
    }
}

static void model_free(model *m) {
    for (int l = 0; l < m->layers; l++) {
        gj_release(m->w[l]);
        gj_release(m->b[l]);
    }
}

static gj_tensor *forward(model *m, gj_tensor *x) {
    gj_tensor *h = x;
    for (int l = 0; l < m->layers; l++) {
        h = gj_linear(h, m->w[l], m->b[l]);
        if (l == m->layers - 1) break;
        h = gj_gelu(h);
        if (m->v == V_DROPOUT) h = gj_dropout(h, 0.2, true);
        if (l == 0 && m->v == V_HOOK) assert_true(gj_register_hook(h, halve, NULL) > 0);
        if (l == 0 && m->v == V_CUSTOM) {
            gj_tensor *y = NULL;
            const double alpha = 1.5;
            assert_int_equal(gj_custom_op_call(g_stanh, &h, &alpha, &y), 0);
            h = y;
        }
    }
    return gj_mean(gj_mul(h, h), 0, NULL, false);
}

/* Trains m for STEPS steps (SGD, from its current weights) and writes
 * each step's weight gradients into g[step][...] as doubles. */
static void train(model *m, bool compiled, double *g, int64_t per_step) {
    gj_set_compiled_autograd(compiled);
    gj_manual_seed(5); /* the same dropout masks in both modes */
    gjt_rng r;
    gjt_rng_seed(&r, 99);
    for (int step = 0; step < STEPS; step++) {
        gj_scope_push();
        const int64_t sx[] = {BATCH, IN};
        gj_tensor *x = gjt_uniform(&r, m->dt, 2, sx, -1, 1);
        for (int l = 0; l < m->layers; l++) {
            assert_int_equal(gj_tensor_set_grad(m->w[l], NULL), 0);
            assert_int_equal(gj_tensor_set_grad(m->b[l], NULL), 0);
        }
        gj_tensor *loss = forward(m, x);
        assert_non_null(loss);
        if (gj_backward(loss, NULL) != 0) print_error("backward: %s\n", gj_last_error());
        int64_t off = 0;
        for (int l = 0; l < m->layers; l++) {
            gj_tensor *gw = gj_tensor_grad(m->w[l]);
            assert_non_null(gw);
            assert_int_equal(gj_tensor_to_f64(gw, g + step * per_step + off), 0);
            off += gj_tensor_numel(gw);
            gj_no_grad_push();
            assert_int_equal(gj_add_scaled_(m->w[l], gw, -0.05), 0);
            gj_no_grad_pop();
        }
        gj_scope_pop();
    }
    gj_set_compiled_autograd(false);
}

/* One model of the suite: eager, then compiled from the same weights; the
 * compiled gradients must be eager's. Returns whether the compiled
 * program borrowed kernels from another program. */
static bool run_model(int layers, variant v, gj_dtype dt, uint64_t seed) {
    model e, c;
    model_init(&e, layers, v, dt, seed);
    model_init(&c, layers, v, dt, seed);
    int64_t per_step = 0;
    for (int l = 0; l < layers; l++) per_step += gj_tensor_numel(e.w[l]);
    double *ge = calloc((size_t)(STEPS * per_step), sizeof *ge);
    double *gc = calloc((size_t)(STEPS * per_step), sizeof *gc);
    assert_true(ge && gc);
    g_post_calls = 0;
    train(&e, false, ge, per_step);
    int eager_posts = g_post_calls;
    g_post_calls = 0;
    gj_ca_stats before = gjt_ca_now();
    train(&c, true, gc, per_step);
    gj_ca_stats after = gjt_ca_now();
    assert_true(gjt_ran_compiled("suite model", &before, &after, STEPS));
    assert_int_equal(g_post_calls, eager_posts);
    char what[64];
    snprintf(what, sizeof what, "layers %d variant %d dtype %d", layers, (int)v, (int)dt);
    assert_true(gjt_same_as_eager(what, gc, ge, STEPS * per_step, gjt_compiled_rel_tol(dt)));
    gj_ca_program_info info;
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    free(ge);
    free(gc);
    model_free(&e);
    model_free(&c);
    return info.shared_kernel_functions > 0;
}

/* The child: the whole suite, then its counters on stdout. */
static int child_suite(void) {
    gj_compiled_autograd_set_quiet(true);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_OFF); /* one program per key, counted */
    g_stanh = gj_custom_op_define("reuse::stanh(Tensor x, float alpha) -> Tensor",
                                  (void *)stanh_fwd, (void *)stanh_bwd);
    assert_non_null(g_stanh);
    const gj_dtype dts[] = {GJ_F32, GJ_F64, GJ_BF16};
    const struct {
        int layers;
        variant v;
    } suite[] = {{3, V_PLAIN}, {4, V_PLAIN},  {3, V_DROPOUT}, {2, V_PLAIN},
                 {3, V_HOOK},  {3, V_POST},   {3, V_CUSTOM},  {4, V_DROPOUT}};
    int shared = 0, n = 0;
    for (int d = 0; d < 3; d++)
        for (size_t i = 0; i < sizeof suite / sizeof suite[0]; i++, n++)
            shared += run_model(suite[i].layers, suite[i].v, dts[d], 100 + (uint64_t)i);
    gj_ca_stats s = gjt_ca_now();
    printf("models=%d compiles=%lld disk_hits=%lld instantiations=%lld mem_hits=%lld "
           "fallbacks=%lld shared=%d\n",
           n, (long long)s.compiles, (long long)s.disk_hits, (long long)s.instantiations,
           (long long)s.mem_hits, (long long)s.fallbacks, shared);
    gj_jit_clear_cache();
    return 0;
}

typedef struct counts {
    int models, shared;
    long long compiles, disk_hits, instantiations, mem_hits, fallbacks;
} counts;

static counts run_child(const char *dir) {
    char env_dir[512];
    snprintf(env_dir, sizeof env_dir, "GRADJIT_CACHE_DIR=%s", dir);
    const char *env[] = {env_dir, NULL};
    char *out = NULL, *err = NULL;
    int rc = gjt_run_self(g_self, "--child-suite", env, &out, &err);
    if (rc != 0) print_error("child failed (%d): %s\n%s\n", rc, out ? out : "", err ? err : "");
    assert_int_equal(rc, 0);
    counts c;
    memset(&c, 0, sizeof c);
    const char *line = out ? strstr(out, "models=") : NULL;
    assert_non_null(line);
    assert_int_equal(sscanf(line,
                            "models=%d compiles=%lld disk_hits=%lld instantiations=%lld "
                            "mem_hits=%lld fallbacks=%lld shared=%d",
                            &c.models, &c.compiles, &c.disk_hits, &c.instantiations, &c.mem_hits,
                            &c.fallbacks, &c.shared),
                     7);
    printf("  child: %s", line);
    free(out);
    free(err);
    return c;
}

static void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d)) != NULL;) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(dir);
}

/* Two processes on one fresh directory: the second one compiles nothing
 * and gets every program the first one made from disk. */
static void test_second_process(void **st) {
    (void)st;
    char base[] = "/tmp/gjdc-reuse-XXXXXX";
    assert_non_null(mkdtemp(base));
    char dir[600];
    snprintf(dir, sizeof dir, "%s/cache", base);
    counts a = run_child(dir);
    assert_int_equal(a.fallbacks, 0);
    assert_true(a.compiles > 0);
    assert_true(a.shared >= 3);         /* programs borrowed kernels... */
    assert_true(a.instantiations >= 0); /* ...or were made of borrowed kernels only */
    int64_t made = a.compiles + a.instantiations;
    assert_int_equal(made + a.mem_hits, (int64_t)a.models * STEPS);
    counts b = run_child(dir);
    assert_int_equal(b.fallbacks, 0);
    assert_int_equal(b.compiles, 0);
    assert_int_equal(b.instantiations, 0);
    assert_int_equal(b.disk_hits, made);
    assert_int_equal(b.mem_hits, a.mem_hits);
    remove_dir(dir);
    rmdir(base);
}

int main(int argc, char **argv) {
    g_self = argv[0];
    if (argc > 1 && strcmp(argv[1], "--child-suite") == 0) return child_suite();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_second_process)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
