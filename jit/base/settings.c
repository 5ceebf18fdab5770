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

/* GRADJIT_LOG: the runtime parses it once for every layer (runtime/
 * settings.c, where the words are listed); jit/ adds the exit summary,
 * registered through gj_jit_on_log_flags, on the first read. */
static _Atomic int g_log_cached = -1; /* the parsed GRADJIT_LOG flags, -1: not yet */

unsigned gj_jit_log_flags(void) {
    int v = atomic_load(&g_log_cached);
    if (v >= 0) return (unsigned)v;
    unsigned fl = gj_rt_log_flags();
    atomic_store(&g_log_cached, (int)fl);
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

