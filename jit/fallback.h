/* SPDX-License-Identifier: MIT */
/*
 * fallback.h - the counters of gj_ca_stats and the fallbacks, shared by
 * every compiled path (the backward and the training step). Internal to
 * jit/.
 *
 * Every call of a compiled path ends in exactly one outcome, counted once:
 * it ran a program (found in memory, loaded from disk, bound to kernels of
 * other programs, or compiled for it: gj_jit_count_run) or it ran eagerly
 * (gj_jit_fallback). So compiles + mem_hits + disk_hits + instantiations +
 * fallbacks is the number of calls. The time spent compiling is counted
 * when it is spent, whatever the outcome.
 */
#ifndef GJ_JIT_FALLBACK_H
#define GJ_JIT_FALLBACK_H

#include "ir.h"

/* The compiled paths, each with its own counters: backwards (gj_ca_stats)
 * and training steps (gj_step_stats). */
typedef enum gj_jit_path {
    GJ_JIT_PATH_BACKWARD = 0,
    GJ_JIT_PATH_STEP = 1,
    GJ_JIT_N_PATHS
} gj_jit_path;

/* How the program of a call was found. */
typedef enum gj_jit_made {
    GJ_JIT_MADE_MEM_HIT = 0, /* in the memory cache */
    GJ_JIT_MADE_DISK_HIT,    /* loaded from the disk cache */
    GJ_JIT_MADE_BOUND,       /* made of kernels other programs compiled: no compile */
    GJ_JIT_MADE_COMPILED,    /* compiled for it */
} gj_jit_made;

/* Milliseconds of CLOCK_MONOTONIC. */
double gj_jit_now_ms(void);

/* A call that ran its program (made as `how`) for run_ms. */
void gj_jit_count_run(gj_jit_path path, gj_jit_made how, double run_ms);
/* Time spent compiling (counted even when the call then falls back). */
void gj_jit_count_compile_ms(gj_jit_path path, double ms);
/* Entries evicted from the memory or disk cache (counted for backwards). */
void gj_jit_count_evictions(int64_t mem, int64_t disk);

/* Records a fallback of class code: counts it (one call that ran eagerly),
 * keeps its message "<class>: <reason>" for this thread and the process,
 * and prints it (once per key, i.e. when first_for_key, unless quiet;
 * every time under GRADJIT_LOG=fallback). */
void gj_jit_fallback(gj_jit_path path, gj_ca_reason code, const char *reason, bool first_for_key);

/* The counters of path into *out (everything but `backwards` and the cache
 * levels). */
void gj_jit_counters(gj_jit_path path, gj_ca_stats *out);

#endif /* GJ_JIT_FALLBACK_H */
