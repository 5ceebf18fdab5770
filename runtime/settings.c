/* SPDX-License-Identifier: MIT */
/*
 * settings.c - every GRADJIT_* environment variable the runtime reads, and
 * the GRADJIT_LOG words of the whole library.
 *
 * Invariants:
 *   - Each variable is read at most once per process, on first use
 *     (pthread_once); later changes of the environment are not seen. A
 *     value that does not parse is reported once on stderr and the default
 *     is used. The modules' own setters (gj_rt_set_num_threads,
 *     gj_rt_set_gemm_provider, gj_rt_set_mem_limit, ...) win over these
 *     values: a module asks here only for its starting value.
 *   - GRADJIT_LOG is parsed here, once, for every layer: the words are the
 *     GJ_RT_LOG_* flags. jit/ reads them through gj_rt_log_flags (it adds
 *     its exit summary on top); the runtime reads `gemm` and `pages`.
 *   - Nothing here allocates after the first read, and every getter is
 *     safe from any thread.
 */
#include "runtime/rt.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ----------------------------------------------------------- GRADJIT_LOG */

static const struct {
    const char *word, *what;
    unsigned flag;
} g_log_words[] = {
    {"graph", "the captured graph, before and after CSE/DCE", GJ_RT_LOG_GRAPH},
    {"ir", "the LLVM IR of each compiled module", GJ_RT_LOG_IR},
    {"plan", "buffers, kernels and steps of each plan", GJ_RT_LOG_PLAN},
    {"cache", "memory/disk hits, compiles, saves, evictions, rejected disk entries; at exit "
              "the counters of compiled autograd and of the compiled step",
     GJ_RT_LOG_CACHE},
    {"fallback", "each backward that runs eagerly, not only the first per key",
     GJ_RT_LOG_FALLBACK},
    {"prof", "compile phases, and at exit a summary of the compiled runs (phases, the "
             "steps that took the most time, the memory's page size)",
     GJ_RT_LOG_PROF},
    {"instrs", "one line per compiled backward and per instruction of it", GJ_RT_LOG_INSTRS},
    {"recompiles", "why a call site compiles again: the first difference from its nearest "
                   "earlier key (a size bound to a symbolic program compiles nothing and prints "
                   "nothing)",
     GJ_RT_LOG_RECOMPILES},
    {"leaks", "at exit: tensors still alive, their bytes, scopes still open", GJ_RT_LOG_LEAKS},
    {"gemm", "each f32/bf16 GEMM shape's provider once when it is decided: measured (the "
             "default with a cache directory, or GRADJIT_GEMM=auto) or read back from the "
             "cache directory, with the measured times",
     GJ_RT_LOG_GEMM},
    {"all", "all of the above", GJ_RT_LOG_ALL},
};

static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;
static unsigned g_log;

static void log_read(void) {
    const char *e = getenv("GRADJIT_LOG");
    size_t nw = sizeof g_log_words / sizeof g_log_words[0];
    while (e && *e) {
        size_t n = strcspn(e, ", ");
        bool known = n == 4 && strncasecmp(e, "help", 4) == 0;
        if (known) {
            fprintf(stderr, "gradjit: GRADJIT_LOG takes comma- or space-separated words "
                            "(any case), output on stderr:\n");
            for (size_t k = 0; k < nw; k++)
                fprintf(stderr, "  %-10s %s\n", g_log_words[k].word, g_log_words[k].what);
            fprintf(stderr, "  %-10s this list\n", "help");
        }
        for (size_t k = 0; k < nw; k++)
            if (n == strlen(g_log_words[k].word) && strncasecmp(e, g_log_words[k].word, n) == 0) {
                g_log |= g_log_words[k].flag;
                known = true;
            }
        if (!known && n > 0)
            fprintf(stderr, "gradjit: unknown word '%.*s' in GRADJIT_LOG ignored (the words: "
                            "graph, ir, plan, cache, fallback, prof, instrs, recompiles, leaks, "
                            "gemm, all, help)\n",
                    (int)n, e);
        e += n;
        e += strspn(e, ", ");
    }
}

unsigned gj_rt_log_flags(void) {
    pthread_once(&g_log_once, log_read);
    return g_log;
}

/* --------------------------------------------------------- plain values */

/* A whole number in [lo, hi] from variable var's value v: 0 and *out set,
 * or -1 (reported on stderr with what the default is). */
static int parse_count(const char *var, const char *v, long long lo, long long hi,
                       const char *dflt_what, long long *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end != v && *end == '\0' && errno == 0 && x >= lo && x <= hi) {
        *out = x;
        return 0;
    }
    fprintf(stderr, "gradjit: %s='%s' is not a whole number from %lld to %lld: %s\n", var, v,
            lo, hi, dflt_what);
    return -1;
}

static pthread_once_t g_vals_once = PTHREAD_ONCE_INIT;
static int g_threads;          /* GRADJIT_NUM_THREADS; 0: one per core */
static int64_t g_alloc_cache;  /* GRADJIT_ALLOC_CACHE_MB in bytes; -1: the default */
static int64_t g_mem_limit;    /* GRADJIT_MEM_LIMIT_MB in bytes; 0: none */
static int g_gemm = GJ_RT_GEMM_DEFAULT;
static bool g_hugepages = true; /* GRADJIT_HUGEPAGES */

static void vals_read(void) {
    long long x;
    const char *v = getenv("GRADJIT_NUM_THREADS");
    if (v && *v && parse_count("GRADJIT_NUM_THREADS", v, LLONG_MIN, LLONG_MAX,
                               "using the default (one thread per core)", &x) == 0)
        g_threads = x < 0 ? 0 : x > INT_MAX ? INT_MAX : (int)x;
    g_alloc_cache = -1;
    v = getenv("GRADJIT_ALLOC_CACHE_MB");
    if (v && *v && parse_count("GRADJIT_ALLOC_CACHE_MB", v, 0, INT64_MAX / (1 << 20),
                               "using the default", &x) == 0)
        g_alloc_cache = (int64_t)x << 20;
    v = getenv("GRADJIT_MEM_LIMIT_MB");
    if (v && *v && parse_count("GRADJIT_MEM_LIMIT_MB", v, 1, INT64_MAX / (1 << 20),
                               "no memory limit", &x) == 0)
        g_mem_limit = (int64_t)x << 20;
    v = getenv("GRADJIT_GEMM");
    if (v && *v) {
        if (strcasecmp(v, "default") == 0)
            g_gemm = GJ_RT_GEMM_DEFAULT;
        else if (strcasecmp(v, "openblas") == 0)
            g_gemm = GJ_RT_GEMM_OPENBLAS;
        else if (strcasecmp(v, "onednn") == 0)
            g_gemm = GJ_RT_GEMM_ONEDNN;
        else if (strcasecmp(v, "auto") == 0)
            g_gemm = GJ_RT_GEMM_AUTO;
        else
            fprintf(stderr, "gradjit: GRADJIT_GEMM='%s' is not default, openblas, onednn or "
                            "auto: using the default\n", v);
    }
    v = getenv("GRADJIT_HUGEPAGES");
    if (v && *v) {
        if (strcmp(v, "0") == 0 || strcasecmp(v, "off") == 0 || strcasecmp(v, "no") == 0)
            g_hugepages = false;
        else if (!(strcmp(v, "1") == 0 || strcasecmp(v, "on") == 0 || strcasecmp(v, "yes") == 0))
            fprintf(stderr, "gradjit: GRADJIT_HUGEPAGES='%s' is not on or off: on\n", v);
    }
}

int gj_rt_env_threads(void) {
    pthread_once(&g_vals_once, vals_read);
    return g_threads;
}

int64_t gj_rt_env_alloc_cache(void) {
    pthread_once(&g_vals_once, vals_read);
    return g_alloc_cache;
}

int64_t gj_rt_env_mem_limit(void) {
    pthread_once(&g_vals_once, vals_read);
    return g_mem_limit;
}

int gj_rt_env_gemm(void) {
    pthread_once(&g_vals_once, vals_read);
    return g_gemm;
}

bool gj_rt_env_hugepages(void) {
    pthread_once(&g_vals_once, vals_read);
    return g_hugepages;
}

/* ------------------------------------------------------ the cache folder */

static pthread_once_t g_dir_once = PTHREAD_ONCE_INIT;
static char g_dir[4096];
static const char *g_dir_p; /* g_dir or NULL: none */

/* GRADJIT_CACHE_DIR ("off" or empty: none), else $XDG_CACHE_HOME/gradjit,
 * else $HOME/.cache/gradjit, else none. A path too long for the buffer is
 * reported and taken as none (never truncated). */
static void dir_read(void) {
    const char *e = getenv("GRADJIT_CACHE_DIR");
    const char *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    int n = -1;
    if (e)
        n = (*e && strcmp(e, "off") != 0) ? snprintf(g_dir, sizeof g_dir, "%s", e) : -1;
    else if (x && *x)
        n = snprintf(g_dir, sizeof g_dir, "%s/gradjit", x);
    else if (h && *h)
        n = snprintf(g_dir, sizeof g_dir, "%s/.cache/gradjit", h);
    if (n >= (int)sizeof g_dir) {
        fprintf(stderr, "gradjit: the cache directory's path is longer than %zu bytes: no cache "
                        "directory\n", sizeof g_dir - 1);
        n = -1;
    }
    g_dir_p = n > 0 ? g_dir : NULL;
}

const char *gj_rt_env_cache_dir(void) {
    pthread_once(&g_dir_once, dir_read);
    return g_dir_p;
}
