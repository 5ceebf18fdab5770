/* SPDX-License-Identifier: MIT */
/*
 * test_jit_dynamic.c - dynamic shapes (gj_compiled_autograd_set_dynamic):
 * a call site that needs a second program gets a symbolic one, whose
 * kernels read their sizes at run time, and every later size is planned
 * and bound to those kernels without compiling.
 *
 * Every case runs each step twice on the same inputs, eagerly (compiled
 * autograd off) and compiled, and requires the same .grad bits, then
 * checks the counters (backwards, compiles, memory hits, instantiations,
 * fallbacks):
 *   - the W1 MLP (784-1024-1024-10, f32) and a narrower one in f64 at
 *     random batch sizes in [1, 512], a batch of 1 among them: three
 *     compiles (the first size, the symbolic program, the batch of 1),
 *     no fallback;
 *   - the same with dynamic shapes off: one compile per size, then the
 *     recompile limit (the behaviour before);
 *   - a char-LM block (embedding, positions, causal attention, layer
 *     norms, GELU MLP, cross entropy) at random batch sizes and at random
 *     sequence lengths (T x T attention, the mask and positions narrowed);
 *   - dropout in the block (run-time seeds) at random sizes;
 *   - ALWAYS: the first program is symbolic, the next size is bound
 *     (gj_ca_program_info.symbolic / .bound), and its key is not the
 *     default mode's;
 *   - bound programs hold the kernels' code: evicting the program that
 *     compiled them (a tiny memory limit) and clearing the cache leaves
 *     no kernel registered and no use after free (ASan);
 *   - the disk cache: a symbolic program loaded from disk serves new
 *     sizes without compiling, in this process and in a new one (child
 *     processes sharing a cache directory);
 *   - two threads at random sizes on one call site (TSan in CI);
 *   - kernels shared across call sites: a second site compiles only the
 *     fused kernels the first did not.
 */
#include "gjtest.h"

#include "jit/cache/cache.h"
#include "jit/jit.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAXP 20

typedef struct model {
    gj_dtype dt;
    int np;
    gj_tensor *p[MAXP];
    int kind;        /* 0: MLP, 1: block */
    int64_t in;      /* MLP: input width */
    int64_t tmax;    /* block: positions and mask rows */
    gj_tensor *mask; /* block: [tmax, tmax], 1 above the diagonal */
    double drop;     /* block: dropout probability after attention */
} model;

enum { IN = 48, HID = 96, K = 10, V = 27, C = 32, H = 2, HD = C / H };
enum { W1_IN = 784, W1_HID = 1024 }; /* the W1 benchmark's widths (bench/workloads.c) */

static gj_tensor *param(gjt_rng *r, gj_dtype dt, int nd, const int64_t *s, double a) {
    gj_tensor *t = gjt_uniform(r, dt, nd, s, -a, a);
    assert_non_null(t);
    assert_int_equal(gj_set_requires_grad(t, true), 0);
    return t;
}

static void linear_params(model *m, gjt_rng *r, int64_t in, int64_t out) {
    m->p[m->np++] = param(r, m->dt, 2, (int64_t[]){out, in}, 1.0 / sqrt((double)in));
    m->p[m->np++] = param(r, m->dt, 1, (int64_t[]){out}, 0.1);
}

static void ln_params(model *m, gjt_rng *r) {
    m->p[m->np++] = param(r, m->dt, 1, (int64_t[]){C}, 0.2);
    m->p[m->np++] = param(r, m->dt, 1, (int64_t[]){C}, 0.2);
}

/* in -> hid -> GELU -> hid -> GELU -> K, cross entropy. */
static void mlp_init_dims(model *m, gj_dtype dt, int64_t in, int64_t hid) {
    memset(m, 0, sizeof *m);
    m->dt = dt;
    m->in = in;
    gjt_rng r;
    gjt_rng_seed(&r, 11);
    linear_params(m, &r, in, hid);
    linear_params(m, &r, hid, hid);
    linear_params(m, &r, hid, K);
}

static void mlp_init(model *m, gj_dtype dt) { mlp_init_dims(m, dt, IN, HID); }

static void block_init(model *m, gj_dtype dt, int64_t tmax, double drop) {
    memset(m, 0, sizeof *m);
    m->dt = dt;
    m->kind = 1;
    m->tmax = tmax;
    m->drop = drop;
    gjt_rng r;
    gjt_rng_seed(&r, 12);
    m->p[m->np++] = param(&r, dt, 2, (int64_t[]){V, C}, 0.5);    /* token embedding */
    m->p[m->np++] = param(&r, dt, 2, (int64_t[]){tmax, C}, 0.5); /* positions */
    ln_params(m, &r);
    linear_params(m, &r, C, 3 * C);
    linear_params(m, &r, C, C);
    ln_params(m, &r);
    linear_params(m, &r, C, 4 * C);
    linear_params(m, &r, 4 * C, C);
    linear_params(m, &r, C, V);
    double *mk = calloc((size_t)(tmax * tmax), sizeof *mk);
    assert_non_null(mk);
    for (int64_t i = 0; i < tmax; i++)
        for (int64_t j = 0; j < tmax; j++) mk[i * tmax + j] = j > i;
    m->mask = gjt_tensor(dt, 2, (int64_t[]){tmax, tmax}, mk);
    free(mk);
    assert_non_null(m->mask);
}

static void model_free(model *m) {
    for (int i = 0; i < m->np; i++) gj_release(m->p[i]);
    gj_release(m->mask);
}

/* [B,T,3C] -> one of q, k, v as [B,H,T,hd]. */
static gj_tensor *heads(gj_tensor *qkv, int idx, int64_t B, int64_t T) {
    static const int perm[4] = {0, 2, 1, 3};
    gj_tensor *t = gj_narrow(qkv, 2, (int64_t)idx * C, C);
    t = t ? gj_reshape(t, 4, (int64_t[]){B, T, H, HD}) : NULL;
    return t ? gj_permute(t, perm) : NULL;
}

/* The block's loss on tokens [B,T] (inputs drawn from seed). */
static gj_tensor *block_loss(model *m, int64_t B, int64_t T, uint64_t seed) {
    gj_tensor *const *p = m->p;
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    gj_tensor *idx = gjt_labels(&r, 2, (int64_t[]){B, T}, V);
    gj_tensor *tgt = gjt_labels(&r, 1, (int64_t[]){B * T}, V);
    gj_tensor *x = gj_add(gj_embedding(p[0], idx), gj_narrow(p[1], 0, 0, T)); /* [B,T,C] */
    gj_tensor *a = gj_layer_norm(x, p[2], p[3], 1e-5);
    gj_tensor *qkv = gj_linear(a, p[4], p[5]);
    assert_non_null(qkv);
    gj_tensor *q = heads(qkv, 0, B, T), *k = heads(qkv, 1, B, T), *v = heads(qkv, 2, B, T);
    gj_tensor *att = gj_matmul(q, gj_transpose(k, 2, 3)); /* [B,H,T,T] */
    att = gj_mul_scalar(att, 1.0 / sqrt((double)HD));
    gj_tensor *mk = gj_narrow(gj_narrow(m->mask, 0, 0, T), 1, 0, T);
    att = gj_softmax(gj_masked_fill(att, mk, -1e9), -1);
    if (m->drop > 0) att = gj_dropout(att, m->drop, true);
    static const int perm[4] = {0, 2, 1, 3};
    gj_tensor *y = gj_reshape(gj_permute(gj_matmul(att, v), perm), 3, (int64_t[]){B, T, C});
    gj_tensor *h = gj_add(x, gj_linear(y, p[6], p[7]));
    gj_tensor *f = gj_gelu(gj_linear(gj_layer_norm(h, p[8], p[9], 1e-5), p[10], p[11]));
    gj_tensor *o = gj_add(h, gj_linear(f, p[12], p[13]));
    gj_tensor *logits = gj_reshape(gj_linear(o, p[14], p[15]), 2, (int64_t[]){B * T, V});
    gj_tensor *l = gj_cross_entropy(logits, tgt);
    assert_non_null(l);
    return l;
}

/* The MLP's loss on a batch of B drawn from seed; NULL on error (no
 * cmocka assert: the thread case calls it off the main thread). */
static gj_tensor *mlp_loss_of(model *m, int64_t B, uint64_t seed) {
    gj_tensor *const *p = m->p;
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    gj_tensor *x = gjt_uniform(&r, m->dt, 2, (int64_t[]){B, m->in}, -2, 2);
    gj_tensor *lab = gjt_labels(&r, 1, (int64_t[]){B}, K);
    gj_tensor *h = gj_gelu(gj_linear(x, p[0], p[1]));
    h = gj_gelu(gj_linear(h, p[2], p[3]));
    return gj_cross_entropy(gj_linear(h, p[4], p[5]), lab);
}

static gj_tensor *mlp_loss(model *m, int64_t B, uint64_t seed) {
    gj_tensor *l = mlp_loss_of(m, B, seed);
    assert_non_null(l);
    return l;
}

/* Clears every .grad. */
static void zero(model *m) {
    for (int i = 0; i < m->np; i++) assert_int_equal(gj_tensor_set_grad(m->p[i], NULL), 0);
}

/* Each parameter's .grad as doubles (exact for f32 and f64). */
static void grads(model *m, double **out) {
    for (int i = 0; i < m->np; i++) {
        gj_tensor *g = gj_tensor_grad(m->p[i]);
        assert_non_null(g);
        out[i] = gjt_values(g);
        assert_non_null(out[i]);
    }
}

/* One step at (B, T) (T ignored by the MLP): eager, then compiled on the
 * same inputs (and the same dropout seed); the .grads must be the same
 * bits. Returns false (after printing) if they are not. */
static bool step(model *m, int64_t B, int64_t T, uint64_t seed) {
    double *ge[MAXP], *gc[MAXP];
    for (int pass = 0; pass < 2; pass++) {
        gj_set_compiled_autograd(pass == 1);
        zero(m);
        gj_manual_seed(seed * 7 + 1);
        gj_scope_push();
        gj_tensor *l = m->kind ? block_loss(m, B, T, seed) : mlp_loss(m, B, seed);
        int rc = gj_backward(l, NULL);
        gj_scope_pop();
        if (rc != 0) {
            print_error("backward failed at B=%lld T=%lld: %s\n", (long long)B, (long long)T,
                        gj_last_error());
            return false;
        }
        grads(m, pass ? gc : ge);
    }
    gj_set_compiled_autograd(false);
    bool ok = true;
    for (int i = 0; i < m->np; i++) {
        int64_t n = gj_tensor_numel(m->p[i]);
        if (ok && memcmp(ge[i], gc[i], (size_t)n * sizeof(double)) != 0) {
            int64_t w = 0;
            double d = gjt_max_abs_diff(gc[i], ge[i], n, &w);
            print_error("B=%lld T=%lld: .grad of parameter %d differs from eager (max %g at %lld)\n",
                        (long long)B, (long long)T, i, d, (long long)w);
            ok = false;
        }
        free(ge[i]);
        free(gc[i]);
    }
    return ok;
}

/* Starts a case: empty cache, zero counters, AUTO, no recompile limit
 * change (default 8). */
static void fresh(gj_ca_dynamic mode) {
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    gj_compiled_autograd_set_dynamic(mode);
    gj_compiled_autograd_set_recompile_limit(8);
    gj_compiled_autograd_set_quiet(true);
}

static void report(const char *what, const gj_ca_stats *s, int sizes) {
    fprintf(stderr,
            "  %s: %d distinct sizes, %lld backwards: %lld compiles, %lld memory hits, %lld "
            "bound (no compile), %lld fallbacks\n",
            what, sizes, (long long)s->backwards, (long long)s->compiles, (long long)s->mem_hits,
            (long long)s->instantiations, (long long)s->fallbacks);
}

/* Random sizes in [lo, hi] for n steps (the first two fixed, so the second
 * program is symbolic at a known size); returns the number of distinct
 * sizes. */
static int sizes(int64_t *out, int n, int64_t first, int64_t second, int64_t lo, int64_t hi,
                 uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    int distinct = 0;
    for (int i = 0; i < n; i++) {
        out[i] = i == 0 ? first : i == 1 ? second : lo + gjt_rng_int(&r, hi - lo + 1);
        bool seen = false;
        for (int j = 0; j < i && !seen; j++) seen = out[j] == out[i];
        distinct += !seen;
    }
    return distinct;
}

/* ------------------------------------------------------------ the MLP */

static void mlp_random_batch(gj_dtype dt) {
    fresh(GJ_CA_DYNAMIC_AUTO);
    model m; /* f32: W1's widths; f64 (slower): a narrower MLP of the same structure */
    if (dt == GJ_F32) mlp_init_dims(&m, dt, W1_IN, W1_HID);
    else mlp_init(&m, dt);
    enum { N = 24 };
    int64_t b[N];
    sizes(b, N, 64, 37, 1, 512, dt == GJ_F32 ? 5 : 6);
    b[5] = 1; /* a batch of one among them */
    int distinct = 0;
    for (int i = 0; i < N; i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++) seen = b[j] == b[i];
        distinct += !seen;
    }
    for (int i = 0; i < N; i++) assert_true(step(&m, b[i], 0, 100 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report(dt == GJ_F32 ? "W1 MLP (784-1024-1024-10) f32, random batch in [1, 512]"
                        : "MLP (48-96-96-10) f64, random batch in [1, 512]",
           &s, distinct);
    assert_int_equal(s.backwards, N);
    assert_int_equal(s.fallbacks, 0);
    /* the specialised program, the symbolic one, and one more for the batch
     * of one: a dimension of 1 changes the code (the plan drops it), as
     * PyTorch specialises sizes 0 and 1 */
    assert_int_equal(s.compiles, 3);
    assert_int_equal(s.instantiations, distinct - 3);
    assert_int_equal(s.compiles + s.mem_hits + s.instantiations, N);
    model_free(&m);
}

/* Without a batch of 1: the specialised program and the symbolic one. */
static void test_mlp_random_batch_no_one(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_AUTO);
    model m;
    mlp_init_dims(&m, GJ_F32, W1_IN, W1_HID);
    enum { N = 16 };
    int64_t b[N];
    int distinct = sizes(b, N, 64, 37, 2, 512, 7);
    for (int i = 0; i < N; i++) assert_true(step(&m, b[i], 0, 150 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report("W1 MLP f32, random batch in [2, 512]", &s, distinct);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.compiles + s.mem_hits + s.instantiations, N);
    model_free(&m);
}

static void test_mlp_random_batch_f32(void **state) {
    (void)state;
    mlp_random_batch(GJ_F32);
}

static void test_mlp_random_batch_f64(void **state) {
    (void)state;
    mlp_random_batch(GJ_F64);
}

/* Dynamic shapes off: what the MLP did before -- one compile per size
 * until the recompile limit, then eager fallbacks. */
static void test_mlp_dynamic_off(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_OFF);
    model m;
    mlp_init(&m, GJ_F32);
    for (int i = 0; i < 12; i++) assert_true(step(&m, 20 + i, 0, 200 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report("MLP f32, 12 batch sizes, dynamic off", &s, 12);
    assert_int_equal(s.compiles, 8);
    assert_int_equal(s.instantiations, 0);
    assert_int_equal(s.fallbacks, 4);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RECOMPILE_LIMIT], 4);
    /* the same sizes with AUTO: 2 compiles, the rest bound; no limit met */
    fresh(GJ_CA_DYNAMIC_AUTO);
    gj_compiled_autograd_set_recompile_limit(2);
    for (int i = 0; i < 12; i++) assert_true(step(&m, 20 + i, 0, 200 + (uint64_t)i));
    s = gjt_ca_now();
    report("MLP f32, 12 batch sizes, dynamic auto, recompile limit 2", &s, 12);
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.instantiations, 10);
    assert_int_equal(s.fallbacks, 0);
    model_free(&m);
}

/* ------------------------------------------------------- the char-LM block */

static void test_block_random_batch(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_AUTO);
    model m;
    block_init(&m, GJ_F32, 16, 0);
    enum { N = 12 };
    int64_t b[N];
    int distinct = sizes(b, N, 4, 7, 1, 16, 21);
    for (int i = 0; i < N; i++) assert_true(step(&m, b[i], 16, 300 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report("char-LM block f32, T 16, random batch in [1, 16]", &s, distinct);
    assert_int_equal(s.fallbacks, 0);
    assert_true(s.compiles <= 2);
    assert_int_equal(s.compiles + s.mem_hits + s.instantiations, N);
    model_free(&m);
}

static void test_block_random_length(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_AUTO);
    model m;
    block_init(&m, GJ_F32, 32, 0);
    enum { N = 12 };
    int64_t t[N];
    int distinct = sizes(t, N, 16, 11, 2, 32, 22);
    for (int i = 0; i < N; i++) assert_true(step(&m, 3, t[i], 400 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report("char-LM block f32, B 3, random length in [2, 32]", &s, distinct);
    assert_int_equal(s.fallbacks, 0);
    assert_true(s.compiles <= 2);
    assert_int_equal(s.compiles + s.mem_hits + s.instantiations, N);
    model_free(&m);
}

/* f64 and dropout (its seed and offset are run-time inputs). */
static void test_block_dropout_f64(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_AUTO);
    model m;
    block_init(&m, GJ_F64, 12, 0.25);
    enum { N = 8 };
    int64_t b[N], t[N];
    sizes(b, N, 2, 3, 1, 5, 23);
    sizes(t, N, 12, 9, 2, 12, 24);
    for (int i = 0; i < N; i++) assert_true(step(&m, b[i], t[i], 500 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report("char-LM block f64 with dropout, random batch and length", &s, N);
    assert_int_equal(s.fallbacks, 0);
    assert_true(s.compiles <= 2);
    assert_int_equal(s.compiles + s.mem_hits + s.instantiations, N);
    model_free(&m);
}

/* ------------------------------------------------------------- ALWAYS */

static void test_always(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_ALWAYS);
    model m;
    mlp_init(&m, GJ_F32);
    gj_ca_program_info info;
    assert_true(step(&m, 10, 0, 600));
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    assert_true(info.symbolic);
    assert_false(info.bound);
    assert_true(step(&m, 11, 0, 601));
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    assert_true(info.symbolic);
    assert_true(info.bound);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.instantiations, 1);
    /* the default mode's key for size 10 is another key: specialised */
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
    gj_compiled_autograd_reset_stats();
    assert_true(step(&m, 12, 0, 602)); /* AUTO: the site has programs: bound */
    s = gjt_ca_now();
    assert_int_equal(s.instantiations, 1);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    assert_true(step(&m, 10, 0, 603)); /* AUTO, empty cache: specialised */
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    assert_false(info.symbolic);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_ALWAYS);
    assert_true(step(&m, 10, 0, 604)); /* same size, ALWAYS: its own program */
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    assert_true(info.symbolic);
    s = gjt_ca_now();
    assert_int_equal(s.mem_hits, 0);
    assert_int_equal(s.compiles + s.instantiations, 2);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
    model_free(&m);
}

/* ----------------------------------------------------- code lifetime */

/* A memory limit so small that each insertion evicts the previous
 * program: the symbolic program that compiled the kernels goes first,
 * the bound ones keep its code alive; clearing the cache then releases
 * every kernel. */
static void test_eviction_keeps_code(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_AUTO);
    int64_t old = gj_compiled_autograd_mem_cache_limit();
    gj_compiled_autograd_set_mem_cache_limit(1);
    model m;
    mlp_init(&m, GJ_F32);
    for (int i = 0; i < 10; i++) assert_true(step(&m, 30 + i, 0, 700 + (uint64_t)i));
    gj_ca_stats s = gjt_ca_now();
    report("MLP f32, 10 sizes, memory cache limit 1 byte", &s, 10);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.instantiations, 8);
    assert_true(s.mem_evictions >= 8);
    assert_true(s.mem_entries <= 1);
    assert_true(gj_jit_generic_kernels() > 0); /* held by the last bound program */
    gj_jit_clear_cache();
    assert_int_equal(gj_jit_generic_kernels(), 0);
    gj_compiled_autograd_set_mem_cache_limit(old);
    /* and with the registry emptied, the next new size compiles again */
    gj_compiled_autograd_reset_stats();
    assert_true(step(&m, 50, 0, 710));
    assert_true(step(&m, 51, 0, 711));
    assert_true(step(&m, 52, 0, 712));
    s = gjt_ca_now();
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.instantiations, 1);
    model_free(&m);
}

/* ---------------------------------------------------------- disk cache */

static void test_disk(void **state) {
    (void)state;
    char dir[] = "/tmp/gj-dyn-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    fresh(GJ_CA_DYNAMIC_ALWAYS);
    model m;
    mlp_init(&m, GJ_F32);
    assert_true(step(&m, 16, 0, 800)); /* compiles, saved */
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    assert_true(step(&m, 16, 0, 801)); /* loaded from disk: its kernels registered */
    assert_true(step(&m, 17, 0, 802)); /* bound to them */
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.disk_hits, 1);
    assert_int_equal(s.instantiations, 1);
    assert_int_equal(s.compiles, 0);
    model_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* ------------------------------------------- kernels across call sites */

/* The MLP with a mean-square loss on its logits instead of cross entropy:
 * another call site whose hidden layers' fused kernels are the MLP's. */
static gj_tensor *mlp_square_loss(model *m, int64_t B, uint64_t seed) {
    gj_tensor *const *p = m->p;
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    gj_tensor *x = gjt_uniform(&r, m->dt, 2, (int64_t[]){B, m->in}, -2, 2);
    gj_tensor *h = gj_gelu(gj_linear(gj_gelu(gj_linear(x, p[0], p[1])), p[2], p[3]));
    gj_tensor *o = gj_linear(h, p[4], p[5]);
    gj_tensor *l = gj_mean(gj_mul(o, o), 0, NULL, false);
    assert_non_null(l);
    return l;
}

/* Dynamic shapes off (specialised programs): the second call site compiles
 * only the kernels the first one did not, and calls the first one's for
 * the rest; a third key whose kernels all exist compiles nothing. Every
 * .grad equals eager's. */
static void test_kernels_across_sites(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_OFF);
    model m;
    mlp_init(&m, GJ_F32);
    gj_ca_program_info info;
    assert_true(step(&m, 32, 0, 1100)); /* site 1: cross entropy */
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    assert_int_equal(info.shared_kernel_functions, 0);
    int k1 = info.kernel_functions;
    double *ge[MAXP], *gc[MAXP];
    for (int pass = 0; pass < 2; pass++) { /* site 2: mean square, eager then compiled */
        gj_set_compiled_autograd(pass == 1);
        zero(&m);
        gj_scope_push();
        assert_int_equal(gj_backward(mlp_square_loss(&m, 32, 1101), NULL), 0);
        gj_scope_pop();
        grads(&m, pass ? gc : ge);
    }
    gj_set_compiled_autograd(false);
    for (int q = 0; q < m.np; q++) {
        assert_memory_equal(ge[q], gc[q], (size_t)gj_tensor_numel(m.p[q]) * sizeof(double));
        free(ge[q]);
        free(gc[q]);
    }
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    fprintf(stderr, "  second call site: %d kernel functions, %d of them compiled by the first "
                    "(which has %d)\n", info.kernel_functions, info.shared_kernel_functions, k1);
    assert_true(info.shared_kernel_functions > 0);
    assert_true(info.shared_kernel_functions < info.kernel_functions);
    assert_false(info.bound);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.instantiations, 0);
    assert_int_equal(s.fallbacks, 0);
    model_free(&m);
}

/* ------------------------------------------------------------ threads */

enum { TSTEPS = 8 };

typedef struct worker {
    model m;
    int64_t b[TSTEPS];
    double *g[TSTEPS][MAXP];
    int failed;
} worker;

/* A thread's compiled steps (no cmocka asserts off the main thread). */
static void *dyn_worker(void *arg) {
    worker *w = arg;
    for (int i = 0; i < TSTEPS; i++) {
        for (int q = 0; q < w->m.np; q++) w->failed |= gj_tensor_set_grad(w->m.p[q], NULL) != 0;
        gj_scope_push();
        gj_tensor *l = mlp_loss_of(&w->m, w->b[i], 1000 + (uint64_t)i);
        w->failed |= !l || gj_backward(l, NULL) != 0;
        gj_scope_pop();
        for (int q = 0; q < w->m.np && !w->failed; q++) {
            gj_tensor *gq = gj_tensor_grad(w->m.p[q]);
            w->g[i][q] = gq ? gjt_values(gq) : NULL;
            w->failed |= !w->g[i][q];
        }
    }
    return NULL;
}

/* Two threads with models of one structure (one call site) at different
 * random sizes: compiles, binds and runs race on the cache and the kernel
 * registry (TSan: ctest -L threads); every .grad equals eager's. */
static void test_threads(void **state) {
    (void)state;
    fresh(GJ_CA_DYNAMIC_AUTO);
    worker w[2];
    memset(w, 0, sizeof w);
    for (int t = 0; t < 2; t++) {
        mlp_init(&w[t].m, GJ_F32);
        sizes(w[t].b, TSTEPS, 20 + t, 30 + t, 2, 300, 31 + (uint64_t)t);
    }
    gj_set_compiled_autograd(true);
    pthread_t th[2];
    for (int t = 0; t < 2; t++) assert_int_equal(pthread_create(&th[t], NULL, dyn_worker, &w[t]), 0);
    for (int t = 0; t < 2; t++) assert_int_equal(pthread_join(th[t], NULL), 0);
    gj_set_compiled_autograd(false);
    gj_ca_stats s = gjt_ca_now();
    report("MLP f32, two threads, 8 random batch sizes each", &s, 2 * TSTEPS);
    /* the only fallback allowed: the two models' leaves share a lock stripe
     * (64 stripes by address), and a compiled run that finds one busy
     * leaves its backward to the eager engine (fallbacks.md,
     * "lock_contention") */
    assert_int_equal(s.fallbacks, s.fallbacks_by_reason[GJ_CA_LOCK_CONTENTION]);
    assert_true(s.compiles <= 3); /* a race may compile the symbolic program twice */
    for (int t = 0; t < 2; t++) {
        assert_int_equal(w[t].failed, 0);
        for (int i = 0; i < TSTEPS; i++) { /* eager reference, same inputs */
            zero(&w[t].m);
            gj_scope_push();
            gj_tensor *l = mlp_loss(&w[t].m, w[t].b[i], 1000 + (uint64_t)i);
            assert_int_equal(gj_backward(l, NULL), 0);
            gj_scope_pop();
            double *ge[MAXP];
            grads(&w[t].m, ge);
            for (int q = 0; q < w[t].m.np; q++) {
                assert_memory_equal(ge[q], w[t].g[i][q],
                                    (size_t)gj_tensor_numel(w[t].m.p[q]) * sizeof(double));
                free(ge[q]);
                free(w[t].g[i][q]);
            }
        }
        model_free(&w[t].m);
    }
}

/* Child: the MLP at the given batch sizes under GRADJIT_CACHE_DIR (set by
 * the parent), AUTO; prints "compiles C disk D bound B fallbacks F". */
static int child_sizes(const char *list) {
    model m;
    mlp_init(&m, GJ_F32);
    gj_compiled_autograd_set_quiet(true);
    uint64_t k = 0;
    for (const char *p = list; *p;) {
        char *end;
        long b = strtol(p, &end, 10);
        if (end == p || b <= 0) return 2;
        if (!step(&m, b, 0, 900 + k++)) return 1;
        p = *end == ',' ? end + 1 : end;
    }
    gj_ca_stats s = gjt_ca_now();
    printf("compiles %lld disk %lld bound %lld fallbacks %lld\n", (long long)s.compiles,
           (long long)s.disk_hits, (long long)s.instantiations, (long long)s.fallbacks);
    model_free(&m);
    return 0;
}

static char g_self[4096];

/* Runs the child at sizes under dir; returns its counters. */
static void run_child(const char *dir, const char *sizes, long long c[4]) {
    char env_dir[4200];
    snprintf(env_dir, sizeof env_dir, "GRADJIT_CACHE_DIR=%s", dir);
    const char *env[] = {env_dir, "GRADJIT_DYNAMIC", NULL};
    char mode[256], *out = NULL, *err = NULL;
    snprintf(mode, sizeof mode, "--child=%s", sizes);
    int rc = gjt_run_self(g_self, mode, env, &out, &err);
    if (rc != 0) fprintf(stderr, "child %s failed (%d): %s\n", sizes, rc, err ? err : "");
    assert_int_equal(rc, 0);
    assert_non_null(out);
    assert_int_equal(sscanf(out, "compiles %lld disk %lld bound %lld fallbacks %lld", &c[0], &c[1],
                            &c[2], &c[3]),
                     4);
    free(out);
    free(err);
}

/* A symbolic program saved by one process serves another process's sizes:
 * its kernels are on disk under their signature. */
static void test_disk_across_processes(void **state) {
    (void)state;
    char dir[] = "/tmp/gj-dyn2-XXXXXX";
    assert_non_null(mkdtemp(dir));
    long long c[4];
    run_child(dir, "16,17", c); /* specialised, then symbolic: both saved */
    fprintf(stderr, "  process 1, batch 16 then 17: %lld compiles, %lld disk hits, %lld bound, "
                    "%lld fallbacks\n", c[0], c[1], c[2], c[3]);
    assert_int_equal(c[0], 2);
    assert_int_equal(c[3], 0);
    run_child(dir, "23,24,16", c); /* 23: the symbolic entry; then bound (16 too) */
    fprintf(stderr, "  process 2, batch 23, 24, 16: %lld compiles, %lld disk hits, %lld bound, "
                    "%lld fallbacks\n", c[0], c[1], c[2], c[3]);
    assert_int_equal(c[0], 0);
    assert_int_equal(c[1], 1);
    assert_int_equal(c[2], 2);
    assert_int_equal(c[3], 0);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

int main(int argc, char **argv) {
    if (argc > 1 && strncmp(argv[1], "--child=", 8) == 0) {
        gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
        return child_sizes(argv[1] + 8);
    }
    ssize_t n = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
    if (n <= 0) snprintf(g_self, sizeof g_self, "%s", argv[0]);
    else g_self[n] = '\0';
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_random_batch_f32),
        cmocka_unit_test(test_mlp_random_batch_f64),
        cmocka_unit_test(test_mlp_random_batch_no_one),
        cmocka_unit_test(test_mlp_dynamic_off),
        cmocka_unit_test(test_block_random_batch),
        cmocka_unit_test(test_block_random_length),
        cmocka_unit_test(test_block_dropout_f64),
        cmocka_unit_test(test_always),
        cmocka_unit_test(test_eviction_keeps_code),
        cmocka_unit_test(test_disk),
        cmocka_unit_test(test_disk_across_processes),
        cmocka_unit_test(test_kernels_across_sites),
        cmocka_unit_test(test_threads),
    };
    setenv("GRADJIT_CACHE_DIR", "off", 1);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
