// SPDX-License-Identifier: MIT
/*
 * test_cache_limits.c - the size limits of the program caches (issue 12,
 * item 5; docs/guide.md, "Cache limits").
 *
 * Memory: over 1,000 distinct keys (a graph whose shapes change at every
 * step) the bytes the cache charges never exceed its limit, every key
 * compiles once, every program beyond what fits is evicted (counters), and
 * the process's heap and resident memory stop growing once the cache is
 * full (measured with mallinfo2 and /proc/self/statm, without sanitizers:
 * their allocators keep freed memory in quarantine). An evicted program
 * compiles again when its key comes back and gives the eager gradients.
 * Least recently used order: a key hit after another is kept when a third
 * one needs room. Programs evicted while another thread runs them are
 * freed by that thread's run, not under it: once for sure (a run held
 * inside a tensor hook while another key evicts its program) and in a
 * free-running race (two threads, limit 0); run under ASan and TSan.
 *
 * Disk: after every save the entries in the directory fit the limit (sizes
 * from stat, and the disk_bytes level agrees), deletions are counted, an
 * entry loaded from disk is younger than one only written before it, and
 * files that are not ours (other names, a symlink named like an entry, a
 * directory) are neither deleted nor counted nor followed; a temporary of
 * ours is not counted, and deleted only when two hours old (a dead
 * writer's).
 *
 * Environment: GRADJIT_CACHE_MEM_LIMIT and GRADJIT_CACHE_DISK_LIMIT take a
 * whole number with an optional binary unit or "none"; anything else warns
 * once naming the variable and keeps the default; GRADJIT_LOG=cache prints
 * evictions. Those run this binary again (fork + exec, --child-*).
 *
 * Counters and bytes are asserted, never times.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GJT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define GJT_SANITIZED 1
#endif
#endif
#ifndef GJT_SANITIZED
#define GJT_SANITIZED 0
#endif

static const char *g_self; /* this binary, for the child runs */

/* A fresh start: no cached program, counters at zero, quiet. */
static void fresh(void) {
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
}

/* ------------------------------------------------------------- models */

/* sum(tanh(x * w)) with x [a, b] (random, seeded by a and b) and leaf w
 * [b]: each (a, b) is its own key, of one call site. Status. */
static int mul_step(gj_tensor *w, int64_t a, int64_t b, bool compiled) {
    gjt_rng r;
    gjt_rng_seed(&r, (uint64_t)(a * 1000 + b));
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){a, b}, -1, 1);
    int rc = gj_backward(gj_sum(gj_tanh(gj_mul(x, w)), 0, NULL, false), NULL);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    return rc;
}

/* mean(tanh(x @ w^T + b)) with x [n, 6], w [4, 6], b [4]: a matmul step
 * and fused kernels; each batch size n is its own key. */
typedef gjt_mlp mlp; /* gjtest.h */

/* Whether a leaf of m shares a .grad lock stripe with a leaf of o. */
static bool stripes_meet(const mlp *m, const mlp *o) {
    int a[2] = {gj_ag_leaf_stripe(m->w), gj_ag_leaf_stripe(m->b)};
    int b[2] = {gj_ag_leaf_stripe(o->w), gj_ag_leaf_stripe(o->b)};
    return a[0] == b[0] || a[0] == b[1] || a[1] == b[0] || a[1] == b[1];
}

/* mlp_init for a model whose leaves share no lock stripe with o's. The
 * stripes hash the leaves' addresses, so two threads' models collide now
 * and then: a compiled run then falls back (the stripe is taken) and its
 * eager backward waits for the other thread -- for ever, if that thread is
 * held in a hook until this one finishes. */
static void mlp_init_apart(mlp *m, const mlp *o) {
    mlp tried[16];
    int n = 0;
    gjt_mlp_init(m, 77);
    while (stripes_meet(m, o) && n < 16) {
        tried[n++] = *m; /* kept until the end: new tensors get new addresses */
        gjt_mlp_init(m, 77);
    }
    assert_false(stripes_meet(m, o));
    for (int i = 0; i < n; i++) gjt_mlp_free(&tried[i]);
}

/* One backward of batch n in the current mode (the flag untouched). */
static int mlp_run(mlp *m, int64_t n) {
    gjt_rng r;
    gjt_rng_seed(&r, (uint64_t)n);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){n, 6}, -1, 1);
    int rc = gj_backward(gj_mean(gj_tanh(gj_linear(x, m->w, m->b)), 0, NULL, false), NULL);
    gj_scope_pop();
    return rc;
}

static int mlp_step(mlp *m, int64_t n, bool compiled) {
    gj_set_compiled_autograd(compiled);
    int rc = mlp_run(m, n);
    gj_set_compiled_autograd(false);
    return rc;
}

/* A compiled backward of batch n with no .grad yet (a .grad that exists
 * is part of the key: every call here has the same key for the same n). */
static int mlp_fresh_step(mlp *m, int64_t n) {
    assert_int_equal(gj_tensor_set_grad(m->w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(m->b, NULL), 0);
    return mlp_step(m, n, true);
}

/* The 28 .grad values of w and b (malloc'd), then cleared. */
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

/* One compiled backward of batch n: no fallback, the eager gradients. */
static void mlp_check(mlp *m, int64_t n, const double *ref) {
    int64_t fb = gjt_ca_now().fallbacks;
    assert_int_equal(mlp_step(m, n, true), 0);
    if (gjt_ca_now().fallbacks != fb) print_error("fallback: %s\n", gj_compiled_autograd_last_fallback());
    assert_int_equal(gjt_ca_now().fallbacks, fb);
    double *g = take_grads(m);
    bool ok = gjt_allclose("compiled vs eager", g, ref, 28, 1e-6, 1e-5);
    free(g);
    assert_true(ok);
}

/* ------------------------------------------------------------ memory */

/* Bytes malloc has handed out and not had back (0 if unknown). The caching
 * allocator's free blocks are returned first, so only live data counts. */
static int64_t heap_bytes(void) {
    gj_mem_release_cache();
    struct mallinfo2 mi = mallinfo2();
    return (int64_t)(mi.uordblks + mi.hblkhd);
}

static int64_t rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, res = 0;
    if (!f) return 0;
    if (fscanf(f, "%ld %ld", &size, &res) != 2) res = 0;
    fclose(f);
    return (int64_t)res * sysconf(_SC_PAGESIZE);
}

enum { BMAX = 25, AMAX = 40 }; /* 1,000 keys: x [a, b], a in 1..40, b in 1..25 */

/* 1,000 distinct keys with a 1 MiB limit: each compiles once, the charged
 * bytes never pass the limit, every program that does not fit is evicted,
 * and the heap and resident memory stop growing: from key 200 to key 1000
 * they grow by less than 1 MiB and 4 MiB, where the same 800 programs
 * kept would take more than 8 MiB of heap (measured first, on 50 keys
 * without a limit; the charge per program is checked to cover at least
 * half of that heap). */
static void test_mem_bound_1000_keys(void **st) {
    (void)st;
    gj_tensor *w[BMAX + 1] = {0};
    for (int b = 1; b <= BMAX; b++) {
        w[b] = gj_ones(GJ_F32, 1, (int64_t[]){b});
        assert_int_equal(gj_set_requires_grad(w[b], true), 0);
    }
    gj_jit_set_disk_cache(NULL);
    gj_compiled_autograd_set_recompile_limit(-1); /* one call site, 1,000 keys */

    /* what a kept program costs: 50 keys, no limit */
    gj_compiled_autograd_set_mem_cache_limit(-1);
    fresh();
    assert_int_equal(mul_step(w[BMAX], AMAX, BMAX, true), 0); /* LLJIT, BLAS, pool up */
    int64_t h0 = heap_bytes(), c0 = gjt_ca_now().mem_bytes;
    for (int k = 0; k < 50; k++) assert_int_equal(mul_step(w[1 + k % 5], 1 + k / 5, 1 + k % 5, true), 0);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 51);
    assert_int_equal(s.mem_evictions, 0);
    assert_int_equal(s.mem_entries, 51);
    int64_t heap_per = (heap_bytes() - h0) / 50, charged_per = (s.mem_bytes - c0) / 50;
    print_message("a kept program: %lld bytes charged, %lld bytes of heap%s\n",
                  (long long)charged_per, (long long)heap_per,
                  GJT_SANITIZED ? " (sanitizer: not measured)" : "");
    if (!GJT_SANITIZED && heap_per > 0) {
        assert_true(charged_per * 2 >= heap_per);
        assert_true(heap_per * 800 > (8 << 20));
    }

    /* 1,000 keys, 1 MiB */
    const int64_t limit = 1 << 20;
    gj_compiled_autograd_set_mem_cache_limit(limit);
    fresh();
    int64_t max_bytes = 0, heap200 = 0, rss200 = 0;
    int k = 0;
    for (int a = 1; a <= AMAX; a++) {
        for (int b = 1; b <= BMAX; b++) {
            assert_int_equal(mul_step(w[b], a, b, true), 0);
            s = gjt_ca_now();
            assert_int_equal(s.fallbacks, 0);
            if (s.mem_bytes > max_bytes) max_bytes = s.mem_bytes;
            assert_true(s.mem_bytes <= limit);
            if (++k == 200) {
                heap200 = heap_bytes();
                rss200 = rss_bytes();
            }
        }
    }
    s = gjt_ca_now();
    int64_t heap_growth = heap_bytes() - heap200, rss_growth = rss_bytes() - rss200;
    print_message("1000 keys, limit %lld: %lld compiles, %lld evictions, %lld entries kept, "
                  "at most %lld bytes charged; from key 200 to 1000 the heap grew by %lld "
                  "bytes, the resident set by %lld\n",
                  (long long)limit, (long long)s.compiles, (long long)s.mem_evictions,
                  (long long)s.mem_entries, (long long)max_bytes, (long long)heap_growth,
                  (long long)rss_growth);
    assert_int_equal(s.compiles, 1000);
    assert_int_equal(s.mem_hits, 0);
    assert_true(s.mem_entries >= 8); /* a 1 MiB cache holds several of these programs */
    assert_int_equal(s.mem_evictions + s.mem_entries, 1000);
    assert_true(max_bytes > limit / 2);
    if (!GJT_SANITIZED) {
        assert_true(heap_growth < (1 << 20));
        assert_true(rss_growth < (4 << 20));
    }
    /* the entries kept are the most recent keys: the last one is a hit */
    assert_int_equal(mul_step(w[BMAX], AMAX, BMAX, true), 0);
    assert_int_equal(gjt_ca_now().mem_hits, 1);
    assert_int_equal(gjt_ca_now().compiles, 1000);
    /* a lower limit evicts at once, down to the most recently used entry */
    gj_compiled_autograd_set_mem_cache_limit(0);
    s = gjt_ca_now();
    assert_int_equal(s.mem_entries, 1);
    assert_int_equal(s.mem_evictions + s.mem_entries, 1000);

    gj_compiled_autograd_set_mem_cache_limit(-1);
    gj_compiled_autograd_set_recompile_limit(8);
    fresh();
    for (int b = 1; b <= BMAX; b++) gj_release(w[b]);
}

/* With room for one program (limit 0: only the entry in use stays), keys
 * A and B alternate: every backward compiles, the other program is
 * evicted, and the recompiled program gives the eager gradients. Without a
 * limit the next use of A is a hit. */
static void test_evicted_recompiles(void **st) {
    (void)st;
    mlp m;
    gjt_mlp_init(&m, 77);
    gj_jit_set_disk_cache(NULL);
    const int64_t A = 5, B = 7;
    assert_int_equal(mlp_step(&m, A, false), 0);
    double *ref_a = take_grads(&m);
    assert_int_equal(mlp_step(&m, B, false), 0);
    double *ref_b = take_grads(&m);

    gj_compiled_autograd_set_mem_cache_limit(0);
    fresh();
    mlp_check(&m, A, ref_a);
    mlp_check(&m, B, ref_b);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.mem_evictions, 1);
    assert_int_equal(s.mem_entries, 1);
    mlp_check(&m, A, ref_a); /* evicted: compiled again */
    mlp_check(&m, A, ref_a); /* now the entry in use: a hit */
    mlp_check(&m, B, ref_b);
    s = gjt_ca_now();
    assert_int_equal(s.compiles, 4);
    assert_int_equal(s.mem_hits, 1);
    assert_int_equal(s.mem_evictions, 3);
    assert_int_equal(s.fallbacks, 0);

    gj_compiled_autograd_set_mem_cache_limit(-1);
    mlp_check(&m, A, ref_a);
    mlp_check(&m, A, ref_a);
    s = gjt_ca_now();
    assert_int_equal(s.compiles, 5);
    assert_int_equal(s.mem_hits, 2);
    assert_int_equal(s.mem_evictions, 3);
    assert_int_equal(s.mem_entries, 2);

    fresh();
    free(ref_a);
    free(ref_b);
    gjt_mlp_free(&m);
}

/* Keys A, B, then A again (a hit), then C: with room for A and the larger
 * of B and C but not all three, B -- the least recently used -- is the one
 * evicted: A is still a hit, B compiles again. */
static void test_lru_order(void **st) {
    (void)st;
    mlp m;
    gjt_mlp_init(&m, 77);
    gj_jit_set_disk_cache(NULL);
    const int64_t A = 11, B = 12, C = 13;
    /* what each entry is charged */
    gj_compiled_autograd_set_mem_cache_limit(-1);
    fresh();
    int64_t sz[3], before = 0;
    const int64_t keys[3] = {A, B, C};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(mlp_fresh_step(&m, keys[i]), 0);
        sz[i] = gjt_ca_now().mem_bytes - before;
        before = gjt_ca_now().mem_bytes;
        assert_true(sz[i] > 0);
    }
    int64_t limit = sz[0] + (sz[1] > sz[2] ? sz[1] : sz[2]);

    gj_compiled_autograd_set_mem_cache_limit(limit);
    fresh();
    assert_int_equal(mlp_fresh_step(&m, A), 0);
    assert_int_equal(mlp_fresh_step(&m, B), 0);
    assert_int_equal(gjt_ca_now().mem_evictions, 0);
    assert_int_equal(mlp_fresh_step(&m, A), 0);
    assert_int_equal(gjt_ca_now().mem_hits, 1);
    assert_int_equal(mlp_fresh_step(&m, C), 0);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 3);
    assert_int_equal(s.mem_evictions, 1);
    assert_int_equal(s.mem_entries, 2);
    assert_int_equal(s.mem_bytes, sz[0] + sz[2]);
    assert_int_equal(mlp_fresh_step(&m, A), 0); /* kept */
    assert_int_equal(gjt_ca_now().mem_hits, 2);
    assert_int_equal(gjt_ca_now().compiles, 3);
    assert_int_equal(mlp_fresh_step(&m, B), 0); /* evicted */
    assert_int_equal(gjt_ca_now().compiles, 4);
    assert_int_equal(gjt_ca_now().fallbacks, 0);

    gj_compiled_autograd_set_mem_cache_limit(-1);
    fresh();
    assert_int_equal(gj_tensor_set_grad(m.w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(m.b, NULL), 0);
    gjt_mlp_free(&m);
}

/* ----------------------------------------------------------- threads */

enum { NT = 2, TITERS = 12 };
static mlp g_tm[NT];
static int g_tfail[NT];

static void *evict_worker(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < TITERS; i++)
        if (mlp_run(&g_tm[t], 2 + t * 3 + i % 3) != 0) g_tfail[t] = 1;
    return NULL;
}

/* Two threads, each with its own leaves and three batch sizes in turn,
 * limit 0: nearly every insertion evicts the program the other thread is
 * running. Every backward runs compiled, and each thread's summed .grads
 * equal the serial eager sum (no program was freed under a run). */
static void test_threads_evict(void **st) {
    (void)st;
    gj_jit_set_disk_cache(NULL);
    double ref[NT][28];
    for (int t = 0; t < NT; t++) {
        if (t == 0) gjt_mlp_init(&g_tm[t], 77);
        else mlp_init_apart(&g_tm[t], &g_tm[0]);
        for (int i = 0; i < TITERS; i++)
            assert_int_equal(mlp_step(&g_tm[t], 2 + t * 3 + i % 3, false), 0);
        double *g = take_grads(&g_tm[t]);
        memcpy(ref[t], g, sizeof ref[t]);
        free(g);
    }
    gj_compiled_autograd_set_mem_cache_limit(0);
    fresh();
    pthread_t th[NT];
    gj_set_compiled_autograd(true);
    for (int t = 0; t < NT; t++)
        assert_int_equal(pthread_create(&th[t], NULL, evict_worker, (void *)(intptr_t)t), 0);
    for (int t = 0; t < NT; t++) assert_int_equal(pthread_join(th[t], NULL), 0);
    gj_set_compiled_autograd(false);
    gj_ca_stats s = gjt_ca_now();
    print_message("threads, limit 0: %lld compiles, %lld hits, %lld evictions, %lld fallbacks\n",
                  (long long)s.compiles, (long long)s.mem_hits, (long long)s.mem_evictions,
                  (long long)s.fallbacks);
    assert_int_equal(s.fallbacks, 0);
    /* (a key whose kernels another key compiled is bound to them, no compile) */
    assert_int_equal(s.compiles + s.instantiations + s.mem_hits, NT * TITERS);
    assert_int_equal(s.mem_evictions, s.compiles + s.instantiations - s.mem_entries);
    assert_true(s.mem_evictions >= NT * TITERS / 2);
    for (int t = 0; t < NT; t++) {
        assert_int_equal(g_tfail[t], 0);
        double *g = take_grads(&g_tm[t]);
        bool ok = gjt_allclose("threads: compiled vs eager", g, ref[t], 28, 1e-6, 1e-5);
        free(g);
        assert_true(ok);
        gjt_mlp_free(&g_tm[t]);
    }
    gj_compiled_autograd_set_mem_cache_limit(-1);
    fresh();
}

/* A tensor hook that, when armed, tells the main thread that the compiled
 * run is inside it and waits until the main thread says go on. */
static pthread_mutex_t g_hs_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hs_cond = PTHREAD_COND_INITIALIZER;
static int g_hs_state; /* 0 idle, 1 armed, 2 a run is in the hook, 3 go on */
static mlp g_hm;
static int g_hs_rc;

static gj_tensor *blocking_hook(gj_tensor *grad, void *user) {
    (void)grad;
    (void)user;
    pthread_mutex_lock(&g_hs_lock);
    if (g_hs_state == 1) {
        g_hs_state = 2;
        pthread_cond_broadcast(&g_hs_cond);
        while (g_hs_state != 3) pthread_cond_wait(&g_hs_cond, &g_hs_lock);
    }
    pthread_mutex_unlock(&g_hs_lock);
    return NULL; /* keep the gradient */
}

/* mean(tanh(h)), h = x @ w^T + b with the blocking hook on h; batch 3. */
static int hooked_run(mlp *m) {
    gjt_rng r;
    gjt_rng_seed(&r, 3);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
    gj_tensor *h = gj_linear(x, m->w, m->b);
    int rc = -1;
    if (h && gj_register_hook(h, blocking_hook, NULL) >= 0)
        rc = gj_backward(gj_mean(gj_tanh(h), 0, NULL, false), NULL);
    gj_scope_pop();
    return rc;
}

static void *hooked_worker(void *arg) {
    (void)arg;
    g_hs_rc = hooked_run(&g_hm);
    return NULL;
}

/* The program a thread is running is evicted under it, deterministically:
 * a worker's compiled run (a memory hit) blocks in a tensor hook while the
 * main thread compiles another key with limit 0, which evicts the worker's
 * program; the worker then finishes its run on that program (freed only
 * when the run ends: ASan would see a use after free otherwise) with the
 * eager gradients. */
static void test_evict_running_program(void **st) {
    (void)st;
    gj_jit_set_disk_cache(NULL);
    mlp other;
    gjt_mlp_init(&g_hm, 77);
    mlp_init_apart(&other, &g_hm);
    g_hs_state = 0;
    assert_int_equal(hooked_run(&g_hm), 0); /* eager reference */
    double *ref = take_grads(&g_hm);
    gj_compiled_autograd_set_mem_cache_limit(0);
    fresh();
    gj_set_compiled_autograd(true);
    assert_int_equal(hooked_run(&g_hm), 0); /* compiles (hook not armed) */
    double *g = take_grads(&g_hm);
    assert_true(gjt_allclose("hooked, compiled", g, ref, 28, 1e-6, 1e-5));
    free(g);
    g_hs_state = 1;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, hooked_worker, NULL), 0);
    pthread_mutex_lock(&g_hs_lock);
    while (g_hs_state != 2) pthread_cond_wait(&g_hs_cond, &g_hs_lock);
    pthread_mutex_unlock(&g_hs_lock);
    assert_int_equal(mlp_run(&other, 4), 0); /* another key: evicts the running program */
    gj_ca_stats s = gjt_ca_now();
    pthread_mutex_lock(&g_hs_lock); /* (the worker goes on before anything can fail here) */
    g_hs_state = 3;
    pthread_cond_broadcast(&g_hs_cond);
    pthread_mutex_unlock(&g_hs_lock);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(s.compiles, 2);
    assert_int_equal(s.mem_hits, 0); /* the worker's run counts once it ends... */
    assert_int_equal(s.mem_evictions, 1);
    assert_int_equal(s.mem_entries, 1);
    assert_int_equal(gjt_ca_now().mem_hits, 1); /* ...as a memory hit */
    gj_set_compiled_autograd(false);
    assert_int_equal(g_hs_rc, 0);
    assert_int_equal(gjt_ca_now().fallbacks, 0);
    g = take_grads(&g_hm);
    assert_true(gjt_allclose("hooked, evicted while running", g, ref, 28, 1e-6, 1e-5));
    free(g);
    free(ref);
    g_hs_state = 0;
    gj_compiled_autograd_set_mem_cache_limit(-1);
    fresh();
    assert_int_equal(gj_tensor_set_grad(other.w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(other.b, NULL), 0);
    gjt_mlp_free(&other);
    gjt_mlp_free(&g_hm);
}

/* -------------------------------------------------------------- disk */

/* Our entries in dir (<32 hex>.gjc regular files): count and bytes. */
static int dir_entries(const char *dir, int64_t *bytes) {
    int n = 0;
    *bytes = 0;
    DIR *d = opendir(dir);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (len != 36 || strcmp(e->d_name + 32, ".gjc") != 0 ||
            strspn(e->d_name, "0123456789abcdef") != 32)
            continue;
        char path[512];
        struct stat stt;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (lstat(path, &stt) != 0 || !S_ISREG(stt.st_mode)) continue;
        n++;
        *bytes += (int64_t)stt.st_size;
    }
    closedir(d);
    return n;
}

static bool exists(const char *dir, const char *name) {
    char path[512];
    struct stat stt;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return lstat(path, &stt) == 0;
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A limit of 3.5 entries: after every save the directory's entries fit
 * (and gjt_ca_now().disk_bytes is their size), the deletions are counted, an
 * entry loaded from disk survives a save that needs room while an older
 * one only written goes, and what is not ours stays untouched. */
static void test_disk_limit(void **st) {
    (void)st;
    char dir[] = "/tmp/gjcl-disk-XXXXXX", out[] = "/tmp/gjcl-out-XXXXXX";
    assert_non_null(mkdtemp(dir));
    assert_non_null(mkdtemp(out));
    chmod(dir, 0700);
    char path[512], target[512];
    /* not ours: other names, a temporary, uppercase hex, a directory and a
     * symlink named like entries (the symlink points outside) */
    const char *hexname = "0123456789abcdef0123456789abcdef.gjc";
    const char *dirname_ = "fedcba9876543210fedcba9876543210.gjc";
    const char *upper = "0123456789ABCDEF0123456789ABCDEF.gjc";
    snprintf(target, sizeof target, "%s/victim", out);
    write_file(target, "must survive");
    snprintf(path, sizeof path, "%s/%s", dir, hexname);
    assert_int_equal(symlink(target, path), 0);
    snprintf(path, sizeof path, "%s/%s", dir, dirname_);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/%s", dir, upper);
    write_file(path, "not an entry name");
    snprintf(path, sizeof path, "%s/notes.txt", dir);
    write_file(path, "the user's notes");
    snprintf(path, sizeof path, "%s/.gjc-0123456789abcdef", dir);
    write_file(path, "someone's temporary");
    /* two hours old: a temporary a dead writer left (ours: deleted), and
     * the user's notes (not ours: kept) */
    struct timespec old[2] = {{time(NULL) - 7200, 0}, {time(NULL) - 7200, 0}};
    snprintf(path, sizeof path, "%s/.gjc-00000000deadbeef", dir);
    write_file(path, "abandoned temporary");
    assert_int_equal(utimensat(AT_FDCWD, path, old, 0), 0);
    snprintf(path, sizeof path, "%s/old-notes.txt", dir);
    write_file(path, "the user's old notes");
    assert_int_equal(utimensat(AT_FDCWD, path, old, 0), 0);

    mlp m;
    gjt_mlp_init(&m, 77);
    gj_jit_set_disk_cache(dir);
    gj_compiled_autograd_set_disk_cache_limit(-1);
    fresh();
    /* one entry's size */
    assert_int_equal(mlp_fresh_step(&m, 21), 0);
    int64_t one;
    assert_int_equal(dir_entries(dir, &one), 1);
    assert_int_equal(gjt_ca_now().disk_bytes, one);
    const int64_t limit = one * 7 / 2;
    gj_compiled_autograd_set_disk_cache_limit(limit);

    /* keys 22, 23 (3 entries), then 21 loaded (its stamp renewed), then
     * 24: one entry must go, and it is 22 */
    int64_t written = 1, bytes;
    for (int64_t n = 22; n <= 23; n++) {
        gj_jit_clear_cache();
        assert_int_equal(mlp_fresh_step(&m, n), 0);
        written++;
        assert_int_equal(dir_entries(dir, &bytes), 3 > written ? written : 3);
    }
    assert_int_equal(gjt_ca_now().disk_evictions, 0);
    gj_jit_clear_cache();
    int64_t dh = gjt_ca_now().disk_hits;
    assert_int_equal(mlp_fresh_step(&m, 21), 0);
    assert_int_equal(gjt_ca_now().disk_hits, dh + 1);
    gj_jit_clear_cache();
    assert_int_equal(mlp_fresh_step(&m, 24), 0);
    written++;
    assert_int_equal(dir_entries(dir, &bytes), 3);
    assert_true(bytes <= limit);
    assert_int_equal(gjt_ca_now().disk_bytes, bytes);
    assert_int_equal(gjt_ca_now().disk_evictions, 1);
    gj_jit_clear_cache();
    dh = gjt_ca_now().disk_hits;
    int64_t comp = gjt_ca_now().compiles;
    assert_int_equal(mlp_fresh_step(&m, 21), 0); /* loaded after 22 was written: kept */
    assert_int_equal(gjt_ca_now().disk_hits, dh + 1);
    assert_int_equal(gjt_ca_now().compiles, comp);
    gj_jit_clear_cache();
    assert_int_equal(mlp_fresh_step(&m, 22), 0); /* the least recently used: deleted */
    assert_int_equal(gjt_ca_now().compiles, comp + 1);
    written++;

    /* ten more keys: the directory never holds more than the limit */
    for (int64_t n = 30; n < 40; n++) {
        gj_jit_clear_cache();
        assert_int_equal(mlp_fresh_step(&m, n), 0);
        written++;
        int c = dir_entries(dir, &bytes);
        assert_true(bytes <= limit);
        assert_int_equal(gjt_ca_now().disk_bytes, bytes);
        assert_int_equal(gjt_ca_now().disk_evictions, written - c);
    }
    assert_int_equal(gjt_ca_now().fallbacks, 0);

    /* limit 0: only the entry just written stays */
    gj_compiled_autograd_set_disk_cache_limit(0);
    gj_jit_clear_cache();
    assert_int_equal(mlp_fresh_step(&m, 50), 0);
    assert_int_equal(dir_entries(dir, &bytes), 1);
    assert_int_equal(gjt_ca_now().disk_bytes, bytes);

    /* what is not ours is still there, untouched, never followed */
    assert_true(exists(dir, hexname));
    assert_true(exists(dir, dirname_));
    assert_true(exists(dir, upper));
    assert_true(exists(dir, "notes.txt"));
    assert_true(exists(dir, ".gjc-0123456789abcdef"));
    assert_true(exists(dir, "old-notes.txt"));
    assert_false(exists(dir, ".gjc-00000000deadbeef"));
    char buf[64] = "";
    FILE *f = fopen(target, "r");
    assert_non_null(f);
    assert_non_null(fgets(buf, sizeof buf, f));
    fclose(f);
    assert_string_equal(buf, "must survive");

    fresh();
    gj_jit_set_disk_cache(NULL);
    gj_compiled_autograd_set_disk_cache_limit(-1);
    assert_int_equal(gj_tensor_set_grad(m.w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(m.b, NULL), 0);
    gjt_mlp_free(&m);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", dir, out);
    assert_int_equal(system(cmd), 0);
}

/* ------------------------------------------------------- environment */

/* Runs this binary with `mode` and var=value (NULL: unset) in the
 * environment; its stdout (the limits it saw) into out, stderr into err
 * (malloc'd). Returns the exit status. */
static int run_child(const char *mode, const char *var, const char *value, char **out,
                     char **err) {
    char set[256];
    snprintf(set, sizeof set, "%s=%s", var, value ? value : "");
    const char *env[] = {"GRADJIT_CACHE_MEM_LIMIT", "GRADJIT_CACHE_DISK_LIMIT", "GRADJIT_LOG",
                         "GRADJIT_CACHE_DIR=off", value ? set : NULL, NULL};
    return gjt_run_self(g_self, mode, env, out, err);
}

static int count_of(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* The memory and disk limits as a child sees them with var=value: "mem disk". */
static void expect_limits(const char *var, const char *value, long long mem, long long disk,
                          bool warns) {
    char *out, *err, want[64];
    assert_int_equal(run_child("--child-limits", var, value, &out, &err), 0);
    snprintf(want, sizeof want, "%lld %lld\n", mem, disk);
    if (strcmp(out, want) != 0)
        print_error("%s='%s': got '%s', want '%s'\n", var, value ? value : "(unset)", out, want);
    assert_string_equal(out, want);
    if (warns) {
        assert_int_equal(count_of(err, var), 1);
        assert_non_null(strstr(err, value));
    } else {
        assert_string_equal(err, "");
    }
    free(out);
    free(err);
}

/* Sizes parse strictly; defaults are 256 MiB and 1 GiB; a bad value warns
 * once (naming the variable and the value) and keeps the default. */
static void test_env_limits(void **st) {
    (void)st;
    const long long M = 256LL << 20, D = 1LL << 30;
    const char *mv = "GRADJIT_CACHE_MEM_LIMIT", *dv = "GRADJIT_CACHE_DISK_LIMIT";
    expect_limits(mv, NULL, M, D, false);
    expect_limits(mv, "", M, D, false);
    expect_limits(mv, "512M", 512LL << 20, D, false);
    expect_limits(mv, "65536", 65536, D, false);
    expect_limits(mv, "64KiB", 64LL << 10, D, false);
    expect_limits(mv, "2g", 2LL << 30, D, false);
    expect_limits(mv, "100b", 100, D, false);
    expect_limits(mv, "0", 0, D, false);
    expect_limits(mv, "none", -1, D, false);
    expect_limits(mv, "Unlimited", -1, D, false);
    expect_limits(dv, "4G", M, 4LL << 30, false);
    expect_limits(dv, "-1", M, -1, false);
    static const char *bad[] = {"12 MB", "-5", "1.5G", "abc", "12MiBs", " 12",
                                "99999999999999999999", "9999999999T", "M"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        expect_limits(mv, bad[i], M, D, true);
        expect_limits(dv, bad[i], M, D, true);
    }
    /* the setter wins over the variable */
    char *out;
    assert_int_equal(run_child("--child-set", mv, "1M", &out, NULL), 0);
    assert_string_equal(out, "4096 8192\n");
    free(out);
}

/* GRADJIT_LOG=cache names each eviction (limit 0 from the environment),
 * and its exit summary counts them. */
static void test_env_log_evictions(void **st) {
    (void)st;
    char *out, *err;
    assert_int_equal(run_child("--child-evict", "GRADJIT_LOG", "cache", &out, &err), 0);
    if (count_of(err, "[gradjit cache] evicted") != 2) print_error("stderr: %s\n", err);
    assert_int_equal(count_of(err, "[gradjit cache] evicted"), 2);
    assert_int_equal(count_of(err, "[gradjit cache] compiled "), 3);
    /* the exit summary: compiled autograd's counters, the step's, the evictions */
    assert_int_equal(count_of(err, "[gradjit cache] summary, compiled autograd (backwards): 3 "
                                   "compiles"), 1);
    assert_int_equal(count_of(err, "[gradjit cache] summary, compiled step (gj_step runs): 0 "
                                   "compiles"), 1);
    assert_int_equal(count_of(err, "[gradjit cache] summary, programs evicted by the cache "
                                   "limits: 2 from memory"), 1);
    free(out);
    free(err);
}

/* ------------------------------------------------------------- main */

static int child(const char *mode) {
    if (strcmp(mode, "--child-limits") == 0) {
        long long a = (long long)gj_compiled_autograd_mem_cache_limit();
        long long b = (long long)gj_compiled_autograd_disk_cache_limit();
        if (a != (long long)gj_compiled_autograd_mem_cache_limit()) return 2; /* read once */
        printf("%lld %lld\n", a, b);
        return 0;
    }
    if (strcmp(mode, "--child-set") == 0) {
        gj_compiled_autograd_set_mem_cache_limit(4096);
        gj_compiled_autograd_set_disk_cache_limit(8192);
        printf("%lld %lld\n", (long long)gj_compiled_autograd_mem_cache_limit(),
               (long long)gj_compiled_autograd_disk_cache_limit());
        return 0;
    }
    if (strcmp(mode, "--child-evict") == 0) { /* three keys, room for one */
        gj_compiled_autograd_set_quiet(true);
        gj_compiled_autograd_set_mem_cache_limit(0);
        mlp m;
        gjt_mlp_init(&m, 77);
        int rc = 0;
        for (int64_t n = 2; n <= 4; n++) rc |= mlp_step(&m, n, true);
        gj_ca_stats s = gjt_ca_now();
        gjt_mlp_free(&m);
        return rc == 0 && s.compiles == 3 && s.mem_evictions == 2 ? 0 : 1;
    }
    return 126;
}

int main(int argc, char **argv) {
    g_self = argv[0];
    /* the suites make distinct keys by changing sizes, and measure the
     * cache with one compiled program per key: dynamic shapes off (bound
     * symbolic programs are tested in test_jit_dynamic.c) */
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_OFF);
    if (argc > 1) return child(argv[1]);
    gj_compiled_autograd_set_quiet(true);
    const char *only = getenv("GJT_FILTER");
    if (only && *only) cmocka_set_test_filter(only);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_evicted_recompiles), cmocka_unit_test(test_lru_order),
        cmocka_unit_test(test_threads_evict),      cmocka_unit_test(test_evict_running_program),
        cmocka_unit_test(test_disk_limit),
        cmocka_unit_test(test_env_limits),         cmocka_unit_test(test_env_log_evictions),
        cmocka_unit_test(test_mem_bound_1000_keys),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
