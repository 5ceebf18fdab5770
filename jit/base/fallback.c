/* SPDX-License-Identifier: MIT */
/*
 * fallback.c - the counters of gj_ca_stats and fallback reporting (see
 * base.h for the counting rule: one outcome per call).
 *
 * Invariants:
 *   - The counters change under g_stats_lock only; a caller may hold the
 *     program cache's lock (cache.c) when it counts (that lock is taken
 *     first, never the other way round).
 *   - The last fallback message is kept per thread (what
 *     gj_compiled_autograd_last_fallback returns for the thread that fell
 *     back) and per process (what it returns on a thread that never fell
 *     back since the last reset: a fallback on a worker thread is readable
 *     from the main one).
 */
#include "jit/base/base.h"
#include "jit/jit.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static pthread_mutex_t g_stats_lock = PTHREAD_MUTEX_INITIALIZER;
static gj_ca_stats g_stats[GJ_JIT_N_PATHS];
static atomic_bool g_quiet;
static _Thread_local char g_last_reason[512];
static _Thread_local uint64_t g_last_gen; /* g_reset_gen when g_last_reason was set */
static char g_process_reason[512];        /* under g_stats_lock */
static uint64_t g_reset_gen = 1;          /* under g_stats_lock */

double gj_jit_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void gj_jit_count_run(gj_jit_path path, gj_jit_made how, double run_ms) {
    gj_ca_stats *st = &g_stats[path];
    pthread_mutex_lock(&g_stats_lock);
    st->backwards++; /* (the backward path's is replaced by the frontend's count) */
    switch (how) {
    case GJ_JIT_MADE_MEM_HIT: st->mem_hits++; break;
    case GJ_JIT_MADE_DISK_HIT: st->disk_hits++; break;
    case GJ_JIT_MADE_BOUND: st->instantiations++; break;
    case GJ_JIT_MADE_COMPILED: st->compiles++; break;
    }
    st->run_ms += run_ms;
    pthread_mutex_unlock(&g_stats_lock);
}

void gj_jit_count_compile_ms(gj_jit_path path, double ms) {
    pthread_mutex_lock(&g_stats_lock);
    g_stats[path].compile_ms += ms;
    pthread_mutex_unlock(&g_stats_lock);
}

static _Atomic double g_making_ms; /* gj_jit_making_ms: never reset */

void gj_jit_count_making_ms(double ms) {
    double old = atomic_load(&g_making_ms);
    while (!atomic_compare_exchange_weak(&g_making_ms, &old, old + ms)) {
    }
}

double gj_jit_making_ms(void) { return atomic_load(&g_making_ms); }

void gj_jit_count_evictions(int64_t mem, int64_t disk) {
    pthread_mutex_lock(&g_stats_lock);
    g_stats[GJ_JIT_PATH_BACKWARD].mem_evictions += mem;
    g_stats[GJ_JIT_PATH_BACKWARD].disk_evictions += disk;
    pthread_mutex_unlock(&g_stats_lock);
}

void gj_jit_counters(gj_jit_path path, gj_ca_stats *out) {
    pthread_mutex_lock(&g_stats_lock);
    *out = g_stats[path];
    pthread_mutex_unlock(&g_stats_lock);
}

void gj_jit_reset_stats(void) {
    pthread_mutex_lock(&g_stats_lock);
    memset(&g_stats[GJ_JIT_PATH_BACKWARD], 0, sizeof g_stats[0]);
    g_process_reason[0] = '\0';
    g_reset_gen++;
    pthread_mutex_unlock(&g_stats_lock);
    g_last_reason[0] = '\0';
}

const char *gj_jit_reason_name(gj_ca_reason r) {
    switch (r) {
    case GJ_CA_NO_LOWERING: return "no_lowering";
    case GJ_CA_LLVM_ERROR: return "llvm_error";
    case GJ_CA_RECORD_STREAM: return "record_stream";
    case GJ_CA_SET_MISMATCH: return "set_mismatch";
    case GJ_CA_RECOMPILE_LIMIT: return "recompile_limit";
    case GJ_CA_RETAIN_GRAPH: return "retain_graph";
    case GJ_CA_HOOK_GUARD: return "hook_guard";
    case GJ_CA_INCOMPATIBLE_MODE: return "incompatible_mode";
    case GJ_CA_OTHER: return "other";
    case GJ_CA_LOCK_CONTENTION: return "lock_contention";
    case GJ_CA_UNTRACEABLE: return "untraceable";
    default: return "unknown";
    }
}

const char *gj_jit_last_fallback_reason(void) { return gj_jit_last_fallback(); }

const char *gj_jit_last_fallback(void) {
    static _Thread_local char copy[512];
    pthread_mutex_lock(&g_stats_lock);
    bool mine = g_last_reason[0] && g_last_gen == g_reset_gen;
    if (!mine) snprintf(copy, sizeof copy, "%s", g_process_reason);
    pthread_mutex_unlock(&g_stats_lock);
    return mine ? g_last_reason : copy;
}

void gj_jit_set_quiet(bool quiet) { atomic_store(&g_quiet, quiet); }

void gj_jit_note_fallback(gj_ca_reason reason, const char *detail) {
    gj_jit_fallback(GJ_JIT_PATH_BACKWARD, reason, detail ? detail : "", false);
}

void gj_jit_cstep_reset_stats(void) {
    pthread_mutex_lock(&g_stats_lock);
    memset(&g_stats[GJ_JIT_PATH_STEP], 0, sizeof g_stats[0]);
    pthread_mutex_unlock(&g_stats_lock);
}

void gj_jit_cstep_stats(gj_ca_stats *out) { gj_jit_counters(GJ_JIT_PATH_STEP, out); }

void gj_jit_cstep_note_fallback(gj_ca_reason reason, const char *detail, bool first) {
    gj_jit_fallback(GJ_JIT_PATH_STEP, reason, detail ? detail : "", first);
}

static void fallback(gj_jit_path path, gj_ca_reason code, const char *reason, bool first_for_key,
                     bool count);

void gj_jit_cstep_note_eager(gj_ca_reason reason, const char *detail) {
    fallback(GJ_JIT_PATH_STEP, reason, detail ? detail : "", true, false);
}

void gj_jit_fallback(gj_jit_path path, gj_ca_reason code, const char *reason,
                     bool first_for_key) {
    fallback(path, code, reason, first_for_key, true);
}

static void fallback(gj_jit_path path, gj_ca_reason code, const char *reason, bool first_for_key,
                     bool count) {
    if ((unsigned)code >= GJ_CA_N_REASONS) code = GJ_CA_OTHER;
    snprintf(g_last_reason, sizeof g_last_reason, "%s%s: %s",
             path == GJ_JIT_PATH_STEP ? "step: " : "", gj_jit_reason_name(code), reason);
    pthread_mutex_lock(&g_stats_lock);
    if (count) {
        g_stats[path].fallbacks++;
        g_stats[path].fallbacks_by_reason[code]++;
        if (path == GJ_JIT_PATH_STEP) g_stats[path].backwards++;
    }
    g_last_gen = g_reset_gen;
    snprintf(g_process_reason, sizeof g_process_reason, "%s", g_last_reason);
    pthread_mutex_unlock(&g_stats_lock);
    unsigned fl = gj_jit_log_flags();
    if ((fl & GJ_JIT_LOG_FALLBACK) || (first_for_key && !atomic_load(&g_quiet)))
        fprintf(stderr, "gradjit: compiled %s fell back to eager: %s\n",
                path == GJ_JIT_PATH_STEP ? "step" : "autograd", g_last_reason);
}
