/* SPDX-License-Identifier: MIT */
/*
 * pool.c - the persistent thread pool behind gj_rt_parallel_for.
 *
 * Invariants:
 *   - g_nthreads (>= 1) is the configured thread count: GRADJIT_NUM_THREADS
 *     or the cores this process may run on, until gj_rt_set_num_threads.
 *     The pool has g_nworkers worker threads plus the calling thread; it is
 *     (re)built lazily by the next parallel_for when g_nworkers+1 differs.
 *   - One job at a time: g_submit is held by the caller for the whole job,
 *     so g_job is stable while any worker reads it. A job is published by
 *     writing g_job and then incrementing g_gen; every worker acknowledges
 *     every generation by decrementing g_pending (also when it has no chunk),
 *     so no worker can lag into the next job.
 *   - Waiting spins briefly, then sleeps on a condition variable; the
 *     sleepers / caller_waiting flags (seq_cst, Dekker-style against g_gen /
 *     g_pending) tell the other side whether it must take the mutex and
 *     signal, so a hot loop of jobs costs no system call.
 *   - Work runs inline (no hand-off) when it is small, when one thread is
 *     configured, when called from inside a task (nested), or when another
 *     thread is using the pool at that moment.
 */
#define _GNU_SOURCE
#include "runtime/rt.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define GJ_RT_MAX_THREADS 256
#define GJ_RT_SPIN_WAKE 4000   /* pause iterations before a worker sleeps */
#define GJ_RT_SPIN_DONE 40000  /* pause iterations before the caller sleeps */

typedef struct gj_rt_job {
    gj_rt_range_fn fn;
    void *ctx;
    int64_t n;
    int nchunks;
} gj_rt_job;

static pthread_once_t g_cfg_once = PTHREAD_ONCE_INIT;
static atomic_int g_nthreads;

static pthread_mutex_t g_submit = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static pthread_t g_workers[GJ_RT_MAX_THREADS];
static int g_nworkers;           /* under g_submit */
static uint64_t g_start_gen;     /* g_gen when the workers were started */
static gj_rt_job g_job;          /* written under g_submit before g_gen++ */
static atomic_ullong g_gen;
static atomic_int g_pending;
static atomic_int g_sleepers;
static atomic_int g_caller_waiting;
static atomic_bool g_shutdown;
static _Thread_local bool t_in_task;

static inline void gj_rt_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int gj_rt_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int gj_rt_clamp_threads(long n) {
    if (n <= 0)
        n = gj_rt_cores();
    return n > GJ_RT_MAX_THREADS ? GJ_RT_MAX_THREADS : (int)n;
}

/* A forked child has no workers: forget the parent's pool. */
static void gj_rt_pool_atfork_child(void) {
    pthread_mutex_init(&g_submit, NULL);
    pthread_mutex_init(&g_m, NULL);
    pthread_cond_init(&g_wake, NULL);
    pthread_cond_init(&g_done, NULL);
    g_nworkers = 0;
    atomic_store(&g_pending, 0);
    atomic_store(&g_sleepers, 0);
    atomic_store(&g_caller_waiting, 0);
    atomic_store(&g_shutdown, false);
    t_in_task = false;
}

/* The starting thread count: GRADJIT_NUM_THREADS (settings.c; <= 0 or
 * unset: one per core). */
static void gj_rt_pool_config(void) {
    atomic_store(&g_nthreads, gj_rt_clamp_threads(gj_rt_env_threads()));
    pthread_atfork(NULL, NULL, gj_rt_pool_atfork_child);
}

int gj_rt_num_threads(void) {
    pthread_once(&g_cfg_once, gj_rt_pool_config);
    return atomic_load(&g_nthreads);
}

/* n <= 0: one per core. Applies to gradjit's pool at its next use
 * (OpenBLAS and oneDNN always run single-threaded on the pool's threads). */
void gj_rt_set_num_threads(int n) {
    pthread_once(&g_cfg_once, gj_rt_pool_config);
    int t = gj_rt_clamp_threads(n);
    atomic_store(&g_nthreads, t);
}

bool gj_rt_in_pool_task(void) { return t_in_task; }

/* Bounds of chunk i of n elements in k chunks (sizes differ by <= 1). */
static inline void gj_rt_chunk(int64_t n, int k, int i, int64_t *b, int64_t *e) {
    int64_t base = n / k, rem = n % k;
    *b = i * base + (i < rem ? i : rem);
    *e = *b + base + (i < rem ? 1 : 0);
}

static void gj_rt_run_chunk(const gj_rt_job *job, int i) {
    int64_t b, e;
    gj_rt_chunk(job->n, job->nchunks, i, &b, &e);
    if (e > b)
        job->fn(job->ctx, b, e);
}

static void *gj_rt_worker_main(void *arg) {
    int id = (int)(intptr_t)arg; /* 1..nworkers; the caller runs chunk 0 */
    uint64_t seen = g_start_gen;
    t_in_task = true;
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load(&g_gen)) == seen) {
            if (++spins < GJ_RT_SPIN_WAKE) {
                gj_rt_cpu_relax();
                continue;
            }
            pthread_mutex_lock(&g_m);
            atomic_fetch_add(&g_sleepers, 1);
            while ((g = atomic_load(&g_gen)) == seen)
                pthread_cond_wait(&g_wake, &g_m);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_m);
        }
        seen = g;
        bool stop = atomic_load(&g_shutdown);
        if (!stop && id < g_job.nchunks)
            gj_rt_run_chunk(&g_job, id);
        if (atomic_fetch_sub(&g_pending, 1) == 1 && atomic_load(&g_caller_waiting)) {
            pthread_mutex_lock(&g_m);
            pthread_cond_signal(&g_done);
            pthread_mutex_unlock(&g_m);
        }
        if (stop)
            return NULL;
    }
}

/* Publishes g_job (already written) to all workers and wakes sleepers.
 * Caller holds g_submit. */
static void gj_rt_publish(void) {
    atomic_store(&g_pending, g_nworkers);
    atomic_fetch_add(&g_gen, 1);
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_m);
        pthread_cond_broadcast(&g_wake);
        pthread_mutex_unlock(&g_m);
    }
}

/* Waits until every worker acknowledged the current generation. */
static void gj_rt_wait_done(void) {
    for (int spins = 0; atomic_load(&g_pending) != 0; spins++) {
        if (spins < GJ_RT_SPIN_DONE) {
            gj_rt_cpu_relax();
            continue;
        }
        pthread_mutex_lock(&g_m);
        atomic_store(&g_caller_waiting, 1);
        while (atomic_load(&g_pending) != 0)
            pthread_cond_wait(&g_done, &g_m);
        atomic_store(&g_caller_waiting, 0);
        pthread_mutex_unlock(&g_m);
    }
}

/* Makes the pool have want-1 workers (fewer if thread creation fails).
 * Caller holds g_submit and no job is running. */
static void gj_rt_pool_resize(int want) {
    if (g_nworkers > 0) {
        atomic_store(&g_shutdown, true);
        gj_rt_publish();
        gj_rt_wait_done();
        for (int i = 0; i < g_nworkers; i++)
            pthread_join(g_workers[i], NULL);
        g_nworkers = 0;
        atomic_store(&g_shutdown, false);
    }
    g_start_gen = atomic_load(&g_gen);
    g_job.nchunks = 0;
    for (int i = 0; i < want - 1; i++) {
        if (gj_rt_thread_start(&g_workers[i], gj_rt_worker_main, (void *)(intptr_t)(i + 1)) != 0)
            break;
        g_nworkers++;
    }
}

int gj_rt_thread_start(pthread_t *t, void *(*fn)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    static const int sync[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT};
    for (size_t i = 0; i < sizeof sync / sizeof sync[0]; i++) sigdelset(&all, sync[i]);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* the new thread inherits it */
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

void gj_rt_parallel_for(int64_t n, int64_t grain, gj_rt_range_fn fn, void *ctx) {
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    int nt = gj_rt_num_threads();
    if (nt <= 1 || n < 2 * grain || t_in_task || pthread_mutex_trylock(&g_submit) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (g_nworkers + 1 != nt)
        gj_rt_pool_resize(nt);
    int64_t k = n / grain;
    if (k > g_nworkers + 1)
        k = g_nworkers + 1;
    if (k <= 1) {
        pthread_mutex_unlock(&g_submit);
        fn(ctx, 0, n);
        return;
    }
    g_job.fn = fn;
    g_job.ctx = ctx;
    g_job.n = n;
    g_job.nchunks = (int)k;
    gj_rt_publish();
    t_in_task = true;
    gj_rt_run_chunk(&g_job, 0);
    t_in_task = false;
    gj_rt_wait_done();
    pthread_mutex_unlock(&g_submit);
}
