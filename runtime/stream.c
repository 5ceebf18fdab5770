/* SPDX-License-Identifier: MIT */
/*
 * stream.c - streams and events: ordered queues of work, each run by its own
 * thread, used to overlap gradient communication and copies with backward
 * compute; and gj_tensor_record_stream, which tells the caching allocator
 * (alloc_cache.c) that a storage is in use on a stream.
 *
 * Invariants:
 *   - Work items run one at a time, in enqueue order, on the stream's thread.
 *     `enqueued` counts items ever enqueued, `completed` items that have
 *     finished; completed <= enqueued, both only grow. A point of the stream
 *     is a value of `enqueued`; the stream has passed point p once
 *     completed >= p. Both counters are atomics so the allocator can test
 *     a point without taking the stream's lock.
 *   - A stream is reference-counted: the user's handle (dropped by
 *     gj_stream_free after the queue drained and the thread was joined),
 *     each event, each pending cross-stream wait and each allocator record
 *     hold one. Because a freed stream has run everything, every point of it
 *     counts as passed.
 *   - After each item the thread asks the allocator to return blocks whose
 *     streams have passed (gj_rt_cache_poll), so deferred memory comes back
 *     without a later allocation having to poll.
 */
#include "runtime/rt.h"

#include <pthread.h>

typedef struct stream_task {
    void (*fn)(void *ctx);
    void *ctx;
    struct stream_task *next;
} stream_task;

struct gj_stream {
    atomic_long refcount;
    pthread_mutex_t mu;
    pthread_cond_t work; /* queue not empty, or stop */
    pthread_cond_t done; /* `completed` moved */
    stream_task *head, *tail;
    atomic_ullong enqueued, completed;
    bool stop;
    pthread_t thread;
};

struct gj_event {
    gj_stream *s; /* retained */
    uint64_t point;
};

/* --------------------------------------------------------- references */

void gj_rt_stream_retain(gj_stream *s) { atomic_fetch_add(&s->refcount, 1); }

void gj_rt_stream_release(gj_stream *s) {
    if (!s || atomic_fetch_sub(&s->refcount, 1) != 1) return;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->done);
    gj_rt_free(s);
}

uint64_t gj_rt_stream_point(gj_stream *s) { return atomic_load(&s->enqueued); }

bool gj_rt_stream_passed(gj_stream *s, uint64_t point) {
    return atomic_load(&s->completed) >= point;
}

/* Blocks until s has passed point. */
static void wait_point(gj_stream *s, uint64_t point) {
    if (gj_rt_stream_passed(s, point)) return;
    pthread_mutex_lock(&s->mu);
    while (atomic_load(&s->completed) < point) pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static bool on_stream_thread(gj_stream *s) { return pthread_equal(pthread_self(), s->thread); }

/* ------------------------------------------------------------- thread */

static void *stream_main(void *arg) {
    gj_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->work, &s->mu);
        stream_task *t = s->head;
        if (!t) break; /* stop and drained */
        s->head = t->next;
        if (!s->head) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        t->fn(t->ctx);
        gj_rt_free(t);
        pthread_mutex_lock(&s->mu);
        atomic_fetch_add(&s->completed, 1);
        pthread_cond_broadcast(&s->done);
        pthread_mutex_unlock(&s->mu);
        gj_rt_cache_poll();
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---------------------------------------------------------- public API */

gj_stream *gj_stream_new(void) {
    gj_stream *s = gj_rt_calloc(1, sizeof *s);
    if (!s) return NULL;
    atomic_init(&s->refcount, 1);
    atomic_init(&s->enqueued, 0);
    atomic_init(&s->completed, 0);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    if (gj_rt_thread_start(&s->thread, stream_main, s) != 0) {
        gj_rt_set_error("gj_stream_new: cannot start the stream's thread");
        gj_rt_stream_release(s);
        return NULL;
    }
    return s;
}

/* Runs what is queued, joins the thread, drops the user's reference.
 * Refused (error set) from a work item of s itself. */
void gj_stream_free(gj_stream *s) {
    if (!s) return;
    if (on_stream_thread(s)) {
        gj_rt_set_error("gj_stream_free: called from a work item of the same stream");
        return;
    }
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    gj_rt_cache_poll();
    gj_rt_stream_release(s);
}

int gj_stream_enqueue(gj_stream *s, void (*fn)(void *ctx), void *ctx) {
    if (!s || !fn) {
        gj_rt_set_error("gj_stream_enqueue: stream and fn must not be NULL");
        return -1;
    }
    stream_task *t = gj_rt_malloc(sizeof *t);
    if (!t) return -1;
    t->fn = fn;
    t->ctx = ctx;
    t->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        gj_rt_free(t);
        gj_rt_set_error("gj_stream_enqueue: the stream is being freed");
        return -1;
    }
    if (s->tail) s->tail->next = t;
    else s->head = t;
    s->tail = t;
    atomic_fetch_add(&s->enqueued, 1);
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int gj_stream_synchronize(gj_stream *s) {
    if (!s) {
        gj_rt_set_error("gj_stream_synchronize: stream is NULL");
        return -1;
    }
    uint64_t point = gj_rt_stream_point(s);
    if (on_stream_thread(s) && !gj_rt_stream_passed(s, point)) {
        gj_rt_set_error("gj_stream_synchronize: a work item cannot wait for its own stream");
        return -1;
    }
    wait_point(s, point);
    return 0;
}

gj_event *gj_stream_record_event(gj_stream *s) {
    if (!s) {
        gj_rt_set_error("gj_stream_record_event: stream is NULL");
        return NULL;
    }
    gj_event *e = gj_rt_malloc(sizeof *e);
    if (!e) return NULL;
    gj_rt_stream_retain(s);
    e->s = s;
    e->point = gj_rt_stream_point(s);
    return e;
}

int gj_event_wait(gj_event *e) {
    if (!e) {
        gj_rt_set_error("gj_event_wait: event is NULL");
        return -1;
    }
    if (on_stream_thread(e->s) && !gj_rt_stream_passed(e->s, e->point)) {
        gj_rt_set_error("gj_event_wait: a work item cannot wait for a later point of its own "
                        "stream");
        return -1;
    }
    wait_point(e->s, e->point);
    return 0;
}

bool gj_event_query(gj_event *e) { return e && gj_rt_stream_passed(e->s, e->point); }

void gj_event_free(gj_event *e) {
    if (!e) return;
    gj_rt_stream_release(e->s);
    gj_rt_free(e);
}

typedef struct wait_ctx {
    gj_stream *on; /* retained */
    uint64_t point;
} wait_ctx;

/* Work item of a waiting stream: blocks until the other stream passed. */
static void wait_task(void *arg) {
    wait_ctx *w = arg;
    wait_point(w->on, w->point);
    gj_rt_stream_release(w->on);
    gj_rt_free(w);
}

int gj_stream_wait_event(gj_stream *s, gj_event *e) {
    if (!s || !e) {
        gj_rt_set_error("gj_stream_wait_event: stream and event must not be NULL");
        return -1;
    }
    /* the same stream runs in order; a passed point needs no wait */
    if (e->s == s || gj_rt_stream_passed(e->s, e->point)) return 0;
    wait_ctx *w = gj_rt_malloc(sizeof *w);
    if (!w) return -1;
    gj_rt_stream_retain(e->s);
    w->on = e->s;
    w->point = e->point;
    if (gj_stream_enqueue(s, wait_task, w) != 0) {
        gj_rt_stream_release(w->on);
        gj_rt_free(w);
        return -1;
    }
    return 0;
}

/* Calls of gj_tensor_record_stream that got a valid tensor and stream, on
 * this thread (the compiled backward's guard around hook calls reads it). */
static _Thread_local uint64_t g_record_stream_calls;

uint64_t gj_rt_record_stream_calls(void) { return g_record_stream_calls; }

int gj_tensor_record_stream(gj_tensor *t, gj_stream *s) {
    if (!gj_rt_check_tensor(t, "gj_tensor_record_stream", "t")) return -1;
    if (!s) {
        gj_rt_set_error("gj_tensor_record_stream: stream is NULL");
        return -1;
    }
    g_record_stream_calls++;
    if (t->storage->external) return 0; /* memory the allocator never reuses */
    return gj_rt_cache_record_stream(t->storage->data, s);
}
