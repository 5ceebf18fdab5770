/* SPDX-License-Identifier: MIT */
/*
 * settings.c - every GRADJIT_* setting of jit/ under one rule: its
 * variable is read once, the first time the value is needed, and a setter
 * called before or after wins; a value that does not parse is reported
 * once on stderr and the default used. Also the GRADJIT_LOG flags and the
 * size syntax of the limits.
 */
#include "jit/base/base.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static void (*_Atomic g_on_flags)(unsigned flags); /* gj_jit_on_log_flags */
static atomic_bool g_flags_told;

static atomic_int g_recompile_limit = 8;
static atomic_int g_dynamic = -1; /* gj_ca_dynamic; -1: GRADJIT_DYNAMIC not read yet */
static atomic_int g_fail_llvm = -1; /* -1: GRADJIT_TEST_FAIL_LLVM not read yet */

/* A size limit in bytes (< 0: none): its variable read once, by whichever
 * of the getter and the setter comes first (pthread_once, so a value that
 * does not parse is reported once), and a setter wins over it. read_env
 * is the limit's own once-function (pthread_once takes no argument): it
 * calls limit_read on this limit. */
typedef struct size_limit {
    pthread_once_t once;
    void (*read_env)(void);
    const char *var;
    int64_t dflt;
    _Atomic int64_t bytes;
} size_limit;

static void mem_limit_read(void);
static void disk_limit_read(void);
static size_limit g_mem_limit = {PTHREAD_ONCE_INIT, mem_limit_read, "GRADJIT_CACHE_MEM_LIMIT",
                                 GJ_JIT_MEM_LIMIT_DEFAULT, 0};
static size_limit g_disk_limit = {PTHREAD_ONCE_INIT, disk_limit_read, "GRADJIT_CACHE_DISK_LIMIT",
                                  GJ_JIT_DISK_LIMIT_DEFAULT, 0};

/* GRADJIT_LOG, parsed once per process: comma/space separated words,
 * matched whole and in any case. An unknown word is reported once on
 * stderr (the known ones still count); "help" prints the words. */
static _Atomic int g_log_cached = -1; /* the parsed GRADJIT_LOG flags, -1: not yet */

unsigned gj_jit_log_flags(void) {
    _Atomic int *cached = &g_log_cached;
    int v = atomic_load(cached);
    if (v >= 0) return (unsigned)v;
    static const struct {
        const char *word, *what;
        unsigned flag;
    } words[] = {
        {"graph", "the captured graph, before and after CSE/DCE", GJ_JIT_LOG_GRAPH},
        {"ir", "the LLVM IR of each compiled module", GJ_JIT_LOG_IR},
        {"plan", "buffers, kernels and steps of each plan", GJ_JIT_LOG_PLAN},
        {"cache", "memory/disk hits, compiles, saves, evictions, rejected disk entries",
         GJ_JIT_LOG_CACHE},
        {"fallback", "each backward that runs eagerly, not only the first per key", GJ_JIT_LOG_FALLBACK},
        {"prof", "compile phases, and at exit a summary of the compiled runs (phases, "
                 "the steps that took the most time)", GJ_JIT_LOG_PROF},
        {"instrs", "one line per compiled backward and per instruction of it", GJ_JIT_LOG_INSTRS},
        {"recompiles", "why a call site compiles again: the first difference from its "
                       "nearest earlier key", GJ_JIT_LOG_RECOMPILES},
        {"leaks", "at exit: tensors still alive, their bytes, scopes still open", GJ_JIT_LOG_LEAKS},
        {"gemm", "each GEMM shape's provider as GRADJIT_GEMM=auto decides it, with the "
                 "measured times (runtime/gemm_provider.c)", GJ_JIT_LOG_GEMM},
        {"all", "all of the above", 0x3ffu},
    };
    static atomic_bool reported;
    bool report = !atomic_exchange(&reported, true); /* one parse prints */
    unsigned fl = 0;
    const char *e = getenv("GRADJIT_LOG");
    while (e && *e) {
        size_t n = strcspn(e, ", ");
        bool known = n == 4 && strncasecmp(e, "help", 4) == 0;
        if (known && report) {
            fprintf(stderr, "gradjit: GRADJIT_LOG takes comma- or space-separated words "
                            "(any case), output on stderr:\n");
            for (size_t k = 0; k < sizeof words / sizeof words[0]; k++)
                fprintf(stderr, "  %-10s %s\n", words[k].word, words[k].what);
            fprintf(stderr, "  %-10s this list\n", "help");
        }
        for (size_t k = 0; k < sizeof words / sizeof words[0]; k++)
            if (n == strlen(words[k].word) && strncasecmp(e, words[k].word, n) == 0) {
                fl |= words[k].flag;
                known = true;
            }
        if (!known && report)
            fprintf(stderr, "gradjit: unknown word '%.*s' in GRADJIT_LOG ignored (the words: "
                            "graph, ir, plan, cache, fallback, prof, instrs, recompiles, leaks, "
                            "gemm, all, help)\n",
                    (int)n, e);
        e += n;
        e += strspn(e, ", ");
    }
    atomic_store(cached, (int)fl);
    void (*fn)(unsigned) = atomic_load(&g_on_flags);
    if (fn && !atomic_exchange(&g_flags_told, true)) fn(fl);
    return fl;
}

void gj_jit_on_log_flags(void (*fn)(unsigned flags)) {
    atomic_store(&g_on_flags, fn);
    int v = atomic_load(&g_log_cached); /* parsed already: tell fn now */
    if (v >= 0 && !atomic_exchange(&g_flags_told, true)) fn((unsigned)v);
}

int gj_jit_parse_bytes(const char *s, int64_t *out) {
    if (!s || !*s) return -1;
    if (strcasecmp(s, "none") == 0 || strcasecmp(s, "unlimited") == 0 || strcmp(s, "-1") == 0) {
        *out = -1;
        return 0;
    }
    uint64_t v = 0;
    const char *c = s;
    for (; *c >= '0' && *c <= '9'; c++) {
        if (v > (UINT64_MAX - 9) / 10) return -1;
        v = v * 10 + (uint64_t)(*c - '0');
    }
    if (c == s) return -1;
    int shift = 0;
    switch (*c) {
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    case 't': case 'T': shift = 40; break;
    default: break;
    }
    if (shift) {
        c++;
        if (strcasecmp(c, "ib") == 0) c += 2;
    }
    if (*c == 'b' || *c == 'B') c++;
    if (*c != '\0') return -1;
    if (v > ((uint64_t)INT64_MAX >> shift)) return -1;
    *out = (int64_t)(v << shift);
    return 0;
}

int64_t gj_jit_env_bytes(const char *var, int64_t dflt) {
    const char *e = getenv(var);
    int64_t v;
    if (!e || !*e) return dflt;
    if (gj_jit_parse_bytes(e, &v) == 0) return v;
    fprintf(stderr, "gradjit: %s='%s' is not a size (a whole number of bytes with an optional "
                    "unit K, M, G or T, e.g. 512M; or none): using the default, %lld bytes\n",
            var, e, (long long)dflt);
    return dflt;
}

void gj_jit_set_recompile_limit(int n) { atomic_store(&g_recompile_limit, n < 0 ? -1 : n); }

void gj_jit_set_dynamic(gj_ca_dynamic mode) {
    atomic_store(&g_dynamic, mode == GJ_CA_DYNAMIC_OFF || mode == GJ_CA_DYNAMIC_ALWAYS
                                 ? (int)mode
                                 : (int)GJ_CA_DYNAMIC_AUTO);
}

gj_ca_dynamic gj_jit_dynamic(void) {
    int m = atomic_load(&g_dynamic);
    if (m >= 0) return (gj_ca_dynamic)m;
    const char *e = getenv("GRADJIT_DYNAMIC");
    int want = GJ_CA_DYNAMIC_AUTO;
    if (e && *e) {
        if (strcasecmp(e, "off") == 0 || strcmp(e, "0") == 0) want = GJ_CA_DYNAMIC_OFF;
        else if (strcasecmp(e, "always") == 0) want = GJ_CA_DYNAMIC_ALWAYS;
        else if (strcasecmp(e, "auto") != 0 && strcmp(e, "1") != 0)
            fprintf(stderr, "gradjit: GRADJIT_DYNAMIC='%s' is not off, auto or always: using auto\n", e);
    }
    atomic_compare_exchange_strong(&g_dynamic, &m, want); /* the setter wins */
    return (gj_ca_dynamic)atomic_load(&g_dynamic);
}

int gj_jit_recompile_limit(void) { return atomic_load(&g_recompile_limit); }

void gj_jit_test_fail_llvm(bool on) { atomic_store(&g_fail_llvm, on ? 1 : 0); }

bool gj_jit_fail_llvm(void) {
    int v = atomic_load(&g_fail_llvm);
    if (v >= 0) return v == 1;
    const char *e = getenv("GRADJIT_TEST_FAIL_LLVM");
    int want = e && *e && strcmp(e, "0") != 0 ? 1 : 0;
    atomic_compare_exchange_strong(&g_fail_llvm, &v, want); /* the setter wins */
    return atomic_load(&g_fail_llvm) == 1;
}

/* Reads limit l's variable (once: its read_env, through pthread_once). */
static void limit_read(size_limit *l) {
    atomic_store(&l->bytes, gj_jit_env_bytes(l->var, l->dflt));
}

static void mem_limit_read(void) { limit_read(&g_mem_limit); }
static void disk_limit_read(void) { limit_read(&g_disk_limit); }

/* Limit l: its variable's value until a setter ran, then the setter's. */
static int64_t limit_get(size_limit *l) {
    pthread_once(&l->once, l->read_env);
    return atomic_load(&l->bytes);
}

/* Sets limit l (< 0: none), after its variable is read: the setter wins. */
static void limit_set(size_limit *l, int64_t bytes) {
    pthread_once(&l->once, l->read_env); /* the setter wins over the env */
    atomic_store(&l->bytes, bytes < 0 ? -1 : bytes);
}

int64_t gj_jit_mem_limit(void) { return limit_get(&g_mem_limit); }
void gj_jit_store_mem_limit(int64_t bytes) { limit_set(&g_mem_limit, bytes); }
int64_t gj_jit_disk_limit(void) { return limit_get(&g_disk_limit); }
void gj_jit_set_disk_limit(int64_t bytes) { limit_set(&g_disk_limit, bytes); }

