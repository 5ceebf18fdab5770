/* SPDX-License-Identifier: MIT */
/*
 * test_streams.c - streams and events (order, cross-stream waits, drain on
 * free), the caching allocator (reuse by size class, cached_bytes, release,
 * failure injection, threads) and gj_tensor_record_stream (a block used on
 * a busy stream is not reused before the stream has passed).
 *
 * Blocking work items wait on a gate the test opens, so every ordering the
 * tests check is forced, never timed.
 */
#include "gjtest.h"
#include "runtime/rt.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* A gate work items can wait on until the test opens it. */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool open;
    int entered; /* work items that reached the gate */
} gate;

static void gate_init(gate *g) {
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->open = false;
    g->entered = 0;
}

static void gate_destroy(gate *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

static void gate_open(gate *g) {
    pthread_mutex_lock(&g->mu);
    g->open = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Work item: blocks until the gate opens. */
static void wait_gate(void *ctx) {
    gate *g = ctx;
    pthread_mutex_lock(&g->mu);
    g->entered++;
    pthread_cond_broadcast(&g->cv);
    while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

/* Waits until n work items reached the gate. */
static void gate_wait_entered(gate *g, int n) {
    pthread_mutex_lock(&g->mu);
    while (g->entered < n) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

/* Work item: appends its tag to a shared log (the stream runs one item at
 * a time, and the test reads the log only after a synchronize). */
typedef struct logger {
    char buf[64];
    int n;
} logger;

typedef struct log_item {
    logger *log;
    char tag;
} log_item;

static void log_it(void *ctx) {
    log_item *it = ctx;
    it->log->buf[it->log->n++] = it->tag;
}

static int64_t cached(void) {
    gj_mem m;
    gj_mem_stats(&m);
    return m.cached_bytes;
}

/* ------------------------------------------------------------ streams */

static void test_stream_order(void **st) {
    (void)st;
    gj_stream *s = gj_stream_new();
    assert_non_null(s);
    logger log = {{0}, 0};
    log_item items[26];
    for (int i = 0; i < 26; i++) {
        items[i] = (log_item){&log, (char)('a' + i)};
        assert_int_equal(gj_stream_enqueue(s, log_it, &items[i]), 0);
    }
    assert_int_equal(gj_stream_synchronize(s), 0);
    assert_string_equal(log.buf, "abcdefghijklmnopqrstuvwxyz");
    assert_int_equal(gj_stream_enqueue(s, NULL, NULL), -1);
    GJT_ASSERT_ERROR("gj_stream_enqueue");
    /* free drains what is still queued */
    gate g;
    gate_init(&g);
    assert_int_equal(gj_stream_enqueue(s, wait_gate, &g), 0);
    log_item last = {&log, '!'};
    assert_int_equal(gj_stream_enqueue(s, log_it, &last), 0);
    gate_open(&g);
    gj_stream_free(s);
    assert_int_equal(log.n, 27);
    assert_int_equal(log.buf[26], '!');
    gate_destroy(&g);
    gj_stream_free(NULL);
}

static void test_events(void **st) {
    (void)st;
    gj_stream *s1 = gj_stream_new(), *s2 = gj_stream_new();
    assert_non_null(s1);
    assert_non_null(s2);
    gate g;
    gate_init(&g);
    gj_event *before = gj_stream_record_event(s1); /* nothing enqueued: passed */
    assert_true(gj_event_query(before));
    assert_int_equal(gj_event_wait(before), 0);
    assert_int_equal(gj_stream_enqueue(s1, wait_gate, &g), 0);
    gj_event *e = gj_stream_record_event(s1);
    assert_non_null(e);
    gate_wait_entered(&g, 1);
    assert_false(gj_event_query(e));
    /* s2 waits for e before its later work */
    logger log = {{0}, 0};
    log_item x = {&log, 'x'};
    assert_int_equal(gj_stream_wait_event(s2, e), 0);
    assert_int_equal(gj_stream_enqueue(s2, log_it, &x), 0);
    gj_event *e2 = gj_stream_record_event(s2);
    gj_event_free(e); /* the pending wait does not need the event object */
    assert_false(gj_event_query(e2));
    assert_int_equal(log.n, 0);
    gate_open(&g);
    assert_int_equal(gj_event_wait(e2), 0);
    assert_true(gj_event_query(e2));
    assert_int_equal(log.n, 1);
    assert_int_equal(gj_stream_wait_event(s2, before), 0);
    gj_event_free(before);
    /* an event outlives its stream (which drained) */
    gj_stream_free(s2);
    assert_true(gj_event_query(e2));
    gj_event_free(e2);
    gj_stream_free(s1);
    gate_destroy(&g);
    assert_null(gj_stream_record_event(NULL));
    assert_int_equal(gj_event_wait(NULL), -1);
}

/* ---------------------------------------------------- caching allocator */

static void test_cache_reuse(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_mem_release_cache();
    int64_t c0 = cached();
    gj_tensor *t = gj_zeros(GJ_F32, 1, (int64_t[]){1000}); /* 4000 bytes: class 4032 */
    void *p = gj_tensor_data(t);
    gj_release(t);
    assert_int_equal(cached(), c0 + 4032);
    assert_int_equal(gjt_live_bytes(), live0);
    /* the same class (4001..4032 bytes) gets the block back, zeroed for gj_zeros */
    gj_tensor *u = gj_zeros(GJ_F64, 1, (int64_t[]){503});
    assert_ptr_equal(gj_tensor_data(u), p);
    assert_int_equal(cached(), c0);
    assert_true(gj_tensor_item_at(u, 502) == 0.0);
    /* another class does not */
    gj_release(u);
    gj_tensor *v = gj_zeros(GJ_F32, 1, (int64_t[]){2000});
    assert_ptr_not_equal(gj_tensor_data(v), p);
    gj_release(v);
    /* a large block (above 1 MiB: four classes per power of two) */
    gj_tensor *big = gj_zeros(GJ_F32, 1, (int64_t[]){300000}); /* 1.2 MB -> class 1.25 MiB */
    void *bp = gj_tensor_data(big);
    gj_release(big);
    gj_tensor *big2 = gj_zeros(GJ_F32, 1, (int64_t[]){310000});
    assert_ptr_equal(gj_tensor_data(big2), bp);
    gj_release(big2);
    assert_true(cached() >= c0 + 4032 + 8000 + 1310720);
    gj_mem_release_cache();
    assert_int_equal(cached(), 0);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* An injected failure fails the allocation even when a block is cached;
 * the next allocation gets the block. */
static void test_cache_failure_injection(void **st) {
    (void)st;
    gj_mem_release_cache();
    void *a = gj_rt_alloc_data(777);
    assert_non_null(a);
    gj_rt_free_data(a, 777);
    gj_rt_alloc_fail_at(1);
    assert_null(gj_rt_alloc_data(777));
    GJT_ASSERT_ERROR("out of memory");
    void *b = gj_rt_alloc_data(777);
    assert_ptr_equal(a, b);
    gj_rt_free_data(b, 777);
    gj_rt_alloc_fail_at(0);
}

typedef struct churn_ctx {
    uint64_t seed;
    int ok;
} churn_ctx;

/* Allocates and frees blocks of mixed sizes, checking each block keeps its
 * own fill pattern while others come and go. */
static void *churn(void *arg) {
    churn_ctx *c = arg;
    gjt_rng r;
    gjt_rng_seed(&r, c->seed);
    unsigned char *held[16] = {0};
    size_t sizes[16] = {0};
    c->ok = 1;
    for (int it = 0; it < 3000; it++) {
        int k = (int)gjt_rng_int(&r, 16);
        if (held[k]) {
            for (size_t i = 0; i < sizes[k]; i += 97)
                if (held[k][i] != (unsigned char)k) c->ok = 0;
            gj_rt_free_data(held[k], sizes[k]);
            held[k] = NULL;
        } else {
            sizes[k] = (size_t)(1 + gjt_rng_int(&r, 3) * 3000 + gjt_rng_int(&r, 64));
            held[k] = gj_rt_alloc_data(sizes[k]);
            if (!held[k]) {
                c->ok = 0;
                break;
            }
            memset(held[k], k, sizes[k]);
        }
    }
    for (int k = 0; k < 16; k++)
        if (held[k]) gj_rt_free_data(held[k], sizes[k]);
    return NULL;
}

static void test_cache_threads(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    pthread_t th[3];
    churn_ctx ctx[3] = {{1, 0}, {2, 0}, {3, 0}};
    for (int i = 0; i < 3; i++) assert_int_equal(pthread_create(&th[i], NULL, churn, &ctx[i]), 0);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++) assert_int_equal(ctx[i].ok, 1);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------ record_stream */

static void test_record_stream(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_mem_release_cache();
    const int64_t n[] = {12345}; /* 49380 bytes: a class no other tensor here uses */
    gj_stream *s = gj_stream_new();
    assert_non_null(s);
    gate g;
    gate_init(&g);
    assert_int_equal(gj_stream_enqueue(s, wait_gate, &g), 0); /* s is busy */

    gj_tensor *t = gj_ones(GJ_F32, 1, n);
    void *p = gj_tensor_data(t);
    assert_int_equal(gj_tensor_record_stream(t, s), 0);
    assert_int_equal(gj_tensor_record_stream(t, s), 0); /* twice: one record */
    gj_release(t);
    assert_int_equal(gjt_live_bytes(), live0);
    assert_true(cached() >= 49408); /* held, waiting for s */

    gj_tensor *u = gj_zeros(GJ_F32, 1, n);
    assert_ptr_not_equal(gj_tensor_data(u), p);
    gj_release(u); /* u's block is cached now */
    gj_tensor *u2 = gj_zeros(GJ_F32, 1, n);
    assert_ptr_not_equal(gj_tensor_data(u2), p); /* u's block, not t's */

    gate_open(&g);
    assert_int_equal(gj_stream_synchronize(s), 0);
    gj_tensor *w = gj_zeros(GJ_F32, 1, n);
    assert_ptr_equal(gj_tensor_data(w), p); /* s has passed: t's block is free again */
    assert_true(gj_tensor_item_at(w, 0) == 0.0);
    gj_release(w);
    gj_release(u2);

    /* recorded on an idle stream: reused at once */
    gj_tensor *a = gj_ones(GJ_F32, 1, n);
    void *pa = gj_tensor_data(a);
    assert_int_equal(gj_tensor_record_stream(a, s), 0);
    gj_release(a);
    gj_tensor *b = gj_zeros(GJ_F32, 1, n);
    assert_ptr_equal(gj_tensor_data(b), pa);
    gj_release(b);

    /* a view records its storage; the block waits for a stream freed later */
    gate g2;
    gate_init(&g2);
    assert_int_equal(gj_stream_enqueue(s, wait_gate, &g2), 0);
    gj_tensor *c = gj_ones(GJ_F32, 1, n);
    void *pc = gj_tensor_data(c);
    gj_tensor *cv = gj_narrow(c, 0, 5, 10);
    assert_int_equal(gj_tensor_record_stream(cv, s), 0);
    gj_release(cv);
    gj_release(c);
    gj_tensor *d = gj_zeros(GJ_F32, 1, n);
    assert_ptr_not_equal(gj_tensor_data(d), pc);
    gate_open(&g2);
    gj_stream_free(s); /* drains: every point of s is passed */
    gj_tensor *e = gj_zeros(GJ_F32, 1, n);
    assert_ptr_equal(gj_tensor_data(e), pc);
    gj_release(e);
    gj_release(d);

    assert_int_equal(gj_tensor_record_stream(NULL, NULL), -1);
    gate_destroy(&g);
    gate_destroy(&g2);
    gj_mem_release_cache();
    assert_int_equal(cached(), 0);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_order),
        cmocka_unit_test(test_events),
        cmocka_unit_test(test_cache_reuse),
        cmocka_unit_test(test_cache_failure_injection),
        cmocka_unit_test(test_cache_threads),
        cmocka_unit_test(test_record_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
