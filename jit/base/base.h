/* SPDX-License-Identifier: MIT */
/*
 * base.h - the leaves of jit/, which every stage may use and which use no
 * stage: the settings (GRADJIT_* variables and their setters, settings.c),
 * the counters of gj_ca_stats and the fallbacks (fallback.c), the log
 * flags and the GRADJIT_LOG=prof tables (logsum.c), hashing and fresh
 * names (hash.c), the clock, array growth (gj_jit_grow), the text writer
 * (text.c) and the byte writer (base/wbuf.h). Nothing here calls up: the
 * exit-time summary that needs the caches is registered by jit/jit.c,
 * above every stage.
 *
 * The counters of gj_ca_stats and the fallbacks are shared by every
 * compiled path (the backward and the training step).
 *
 * Every call of a compiled path ends in exactly one outcome, counted once:
 * it ran a program (found in memory, loaded from disk, bound to kernels of
 * other programs, or compiled for it: gj_jit_count_run) or it ran eagerly
 * (gj_jit_fallback). So compiles + mem_hits + disk_hits + instantiations +
 * fallbacks is the number of calls. The time spent compiling is counted
 * when it is spent, whatever the outcome.
 */
#ifndef GJ_JIT_BASE_H
#define GJ_JIT_BASE_H

#include "autograd/ag.h"
#include "jit/base/wbuf.h"

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
/* Time spent making programs for new keys (capture, plan, binding, disk
 * load or compile), both paths, since start: never reset. */
void gj_jit_count_making_ms(double ms);
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

/* The name of fallback reason r ("record_stream", ...; "unknown" out of
 * range): what gj_ca_reason_name returns. */
const char *gj_jit_reason_name(gj_ca_reason r);

/* ---------------------------------------------------------- settings */

/* Every setting follows one rule: its variable is read once, the first
 * time the value is needed, and a setter called before or after wins. */

/* More than n distinct compiled keys from one call site: later new keys of
 * that site run eagerly (GJ_CA_RECOMPILE_LIMIT). n < 0: no limit. Default 8. */
void gj_jit_set_recompile_limit(int n);
int gj_jit_recompile_limit(void);
/* Dynamic shapes: GJ_CA_DYNAMIC_OFF, _AUTO (default: a call site's second
 * program and later ones are symbolic) or _ALWAYS; GRADJIT_DYNAMIC. */
void gj_jit_set_dynamic(gj_ca_dynamic mode);
gj_ca_dynamic gj_jit_dynamic(void);
/* The memory cache's size limit in bytes (< 0: none): until set,
 * GRADJIT_CACHE_MEM_LIMIT, else the default. gj_jit_set_mem_limit (cache
 * stage) also evicts; gj_jit_store_mem_limit only stores. */
#define GJ_JIT_MEM_LIMIT_DEFAULT ((int64_t)256 << 20)
int64_t gj_jit_mem_limit(void);
void gj_jit_store_mem_limit(int64_t bytes);
/* The disk cache's size limit in bytes (< 0: none), likewise with
 * GRADJIT_CACHE_DISK_LIMIT; applied at the next save. */
#define GJ_JIT_DISK_LIMIT_DEFAULT ((int64_t)1 << 30)
int64_t gj_jit_disk_limit(void);
void gj_jit_set_disk_limit(int64_t bytes);
/* Test switch: while on, codegen's compiles fail with an LLVM error (a
 * lookup of a symbol that does not exist), as if LLVM had failed. Until
 * set, GRADJIT_TEST_FAIL_LLVM (on unless empty or "0"). */
void gj_jit_test_fail_llvm(bool on);
bool gj_jit_fail_llvm(void);

/* ----------------------------------------------------------- logging */

/* GRADJIT_LOG's words: the runtime's flags (runtime/settings.c parses the
 * variable once for every layer). */
enum {
    GJ_JIT_LOG_GRAPH = GJ_RT_LOG_GRAPH,
    GJ_JIT_LOG_IR = GJ_RT_LOG_IR,
    GJ_JIT_LOG_CACHE = GJ_RT_LOG_CACHE,
    GJ_JIT_LOG_FALLBACK = GJ_RT_LOG_FALLBACK,
    GJ_JIT_LOG_PLAN = GJ_RT_LOG_PLAN,
    GJ_JIT_LOG_PROF = GJ_RT_LOG_PROF, /* time of every instruction of every compiled run */
    GJ_JIT_LOG_RECOMPILES = GJ_RT_LOG_RECOMPILES, /* why a call site compiles again */
    GJ_JIT_LOG_INSTRS = GJ_RT_LOG_INSTRS, /* one line per backward and per instruction */
    GJ_JIT_LOG_LEAKS = GJ_RT_LOG_LEAKS, /* at exit: live tensors and open scopes */
    GJ_JIT_LOG_GEMM = GJ_RT_LOG_GEMM,   /* GEMM provider decisions (runtime/gemm_choice.c) */
};
/* Flags parsed from GRADJIT_LOG (read once). */
unsigned gj_jit_log_flags(void);
/* GRADJIT_LOG=prof: adds one instruction's time to the summary printed at exit,
 * under its kind or kernel name. */
void gj_jit_prof_instr(const char *what, double ms);
/* GRADJIT_LOG=prof: adds one compiled backward's phases to the summary
 * (fresh: it compiled or loaded its program; counted apart, since the
 * compile is in its "key and lookup"). */
void gj_jit_prof_backward(bool fresh, double total, double key, double program, double release);
/* Prints the exit-time table of GRADJIT_LOG=prof (logsum.c); jit/jit.c
 * registers the exit-time summary and calls it. */
/* fn is called once, with the flags, when GRADJIT_LOG has been parsed (at
 * once if it was already): how jit/jit.c, above every stage, registers the
 * exit-time summary from the moment the flags are first read, without a
 * leaf calling up. */
void gj_jit_on_log_flags(void (*fn)(unsigned flags));
void gj_jit_log_prof_summary(void);

/* A size in bytes from text s, strictly: a whole number with an optional
 * binary unit (K, M, G or T, any case, optionally followed by "iB" or "B";
 * "B" alone: bytes), or "none"/"unlimited"/"-1" for no limit (*out = -1).
 * Nothing else is accepted: no sign, space, fraction or overflow. 0 and
 * *out set, or -1. */
int gj_jit_parse_bytes(const char *s, int64_t *out);
/* The size limit in environment variable var (gj_jit_parse_bytes syntax);
 * dflt when unset or empty. A value that does not parse is reported on
 * stderr (naming the variable, the value and the syntax) and dflt used.
 * Callers read it once per process. */
int64_t gj_jit_env_bytes(const char *var, int64_t dflt);


/* ------------------------------------------------------ growable arrays */

/* Makes room for one more element of size sz in *arr, of which n are used
 * and *cap allocated: doubles *cap (16 at first) through gj_rt_realloc when
 * full. 0, or -1 with *arr and *cap unchanged (the old array still valid). */
static inline int gj_jit_grow(void **arr, int n, int *cap, size_t sz) {
    if (n < *cap) return 0;
    int nc = *cap ? *cap * 2 : 16;
    void *q = gj_rt_realloc(*arr, (size_t)nc * sz);
    if (!q) return -1;
    *arr = q;
    *cap = nc;
    return 0;
}

/* -------------------------------------------------------------- text */

/* A growable text: p[0..n) written (not NUL-terminated), cap allocated;
 * starts zeroed, p freed by its owner (gj_rt_free). Invariant: after a
 * failure (allocation or format) `oom` is set and every later put is a
 * no-op; p[0..n) is what was written before it. */
typedef struct gj_jit_text {
    char *p;
    size_t n, cap;
    bool oom;
} gj_jit_text;

/* Appends printf-style text to t. */
void gj_jit_text_put(gj_jit_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ------------------------------------------------------------ hashing */

/* 128-bit hash of data[0..n) (FNV-1a and a multiply-xorshift, mixed):
 * keys, kernel descriptions, disk entries. */
void gj_jit_hash128(const void *data, size_t n, uint64_t out[2]);
/* A fresh unguessable 128-bit value from the time, the pid, a counter and
 * an address (symbol prefixes, temporary file names). */
void gj_jit_nonce(uint64_t out[2]);

#endif /* GJ_JIT_BASE_H */
