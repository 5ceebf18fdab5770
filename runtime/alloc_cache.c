/* SPDX-License-Identifier: MIT */
/*
 * alloc_cache.c - the caching allocator behind gj_rt_alloc_data: freed
 * tensor blocks are kept in per-size-class free lists and handed out again,
 * and a block whose storage was used on a stream (gj_tensor_record_stream)
 * is not reused before that stream has passed the point where it was freed.
 *
 * Size classes: up to 1 MiB a block's size is its request rounded up to 64
 * bytes (one class per 64 bytes); above, four classes per power of two
 * (sizes in (2^k, 2^(k+1)] round up to a multiple of 2^(k-2): at most 25%
 * slack). A block is only reused for a request of exactly its class.
 *
 * Invariants (all under g_mu):
 *   - A block is in exactly one place: handed out, in the free list of its
 *     class (g_free[idx]), on the deferred list, or returned to libc.
 *   - g_cached_bytes is the sum of the class sizes of the blocks in the free
 *     lists; g_deferred_bytes that of the deferred blocks. Neither is part of
 *     live_bytes (alloc.c counts bytes in use by tensors).
 *   - The record table maps a handed-out block to the streams it was recorded
 *     on (each retained). gj_rt_cache_free moves the record to the deferred
 *     list with, per stream, the stream's point at that moment; a deferred
 *     block goes to its free list once every stream has passed its point.
 *   - Nothing here counts towards failure injection except the record
 *     table's allocations (gj_rt_malloc): a free can never fail.
 *   - g_held_bytes is the sum of the class sizes of every block taken from
 *     libc and not returned (handed out, cached or deferred): what the
 *     process holds for tensors. With a memory limit (GRADJIT_MEM_LIMIT_MB,
 *     gj_set_mem_limit), a new block that would take g_held_bytes past it
 *     first empties the cache, then fails with an error naming the limit;
 *     g_held_peak is its maximum since the last gj_mem_reset_peak.
 *   - Cached blocks are poisoned under AddressSanitizer, so a use after free
 *     of tensor bytes is still reported; they stay reachable from g_free (no
 *     leak report) and are returned to libc at exit.
 *   - First touch: a block whose class is HUGE_MIN (2 MiB) or more is its
 *     own anonymous mapping, 2 MiB-aligned, advised MADV_HUGEPAGE when the
 *     kernel offers transparent huge pages and GRADJIT_HUGEPAGES is on
 *     (MADV_NOHUGEPAGE when it is off), unmapped when it leaves the cache;
 *     smaller blocks come from aligned_alloc. Whether a block is a mapping
 *     follows from its class alone, so every path that frees one knows how.
 *     A new mapping is zero and untouched: gj_rt_cache_alloc says so
 *     (*fresh), and the zero-filling allocation (alloc.c) skips its memset.
 *   - Every cached block carries the era it was cached in (g_era, moved on
 *     by gj_rt_alloc_cache_mark), so the blocks of one phase that the next
 *     did not reuse can be returned alone (gj_rt_alloc_release_cache_before).
 */
#include "runtime/rt.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if defined(__SANITIZE_ADDRESS__)
#define GJ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GJ_ASAN 1
#endif
#endif
#ifdef GJ_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define ALIGN 64
#define SMALL_LIMIT ((size_t)1 << 20)
#define N_SMALL (SMALL_LIMIT / ALIGN)      /* classes 64 .. 1 MiB */
#define N_CLASSES (N_SMALL + 4 * 44)       /* plus 4 per octave up to 2^64 */
#define DEFAULT_LIMIT_MB 2048
#define HUGE_MIN ((size_t)2 << 20)          /* blocks this big: mappings of 2 MiB pages */
#define PAGE_4K ((size_t)4096)

typedef struct free_node {
    void *p;
    uint64_t era; /* g_era when it was cached */
    struct free_node *next;
} free_node;

typedef struct rec_use {
    gj_stream *s;   /* retained */
    uint64_t point; /* deferred: the stream's point when the block was freed */
} rec_use;

typedef struct rec {
    void *p;
    size_t nbytes; /* deferred: the size it was freed with */
    int n, cap;
    rec_use *uses;
    struct rec *next; /* hash chain, or the deferred list */
} rec;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static free_node *g_free[N_CLASSES];
static int64_t g_cached_bytes, g_deferred_bytes;
static int64_t g_limit = -1; /* bytes the free lists may hold; -1: not read yet */
static int64_t g_held_bytes, g_held_peak; /* see the invariants */
static int64_t g_mem_limit = -1;          /* 0: none; -1: GRADJIT_MEM_LIMIT_MB not read yet */
static rec **g_rtab;          /* record table: data pointer -> rec */
static size_t g_rtab_n, g_nrec;
static rec *g_deferred;
static atomic_int g_n_deferred; /* read without the lock to skip polling */
static uint64_t g_era;          /* gj_rt_alloc_cache_mark's count */

/* Class of a request of n bytes: its index and block size. */
static size_t class_of(size_t n, int *idx) {
    if (n == 0) n = 1;
    if (n <= SMALL_LIMIT) {
        size_t c = (n + ALIGN - 1) & ~(size_t)(ALIGN - 1);
        *idx = (int)(c / ALIGN) - 1;
        return c;
    }
    int k = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^k < n <= 2^(k+1) */
    size_t step = (size_t)1 << (k - 2);
    size_t c = (n + step - 1) / step * step;
    int sub = (int)((c - ((size_t)1 << k)) / step) - 1; /* 0..3 */
    *idx = (int)N_SMALL + (k - 20) * 4 + sub;
    return c;
}

/* The block size of class idx (class_of's inverse). */
static size_t class_size(int idx) {
    if (idx < (int)N_SMALL) return (size_t)(idx + 1) * ALIGN;
    int r = idx - (int)N_SMALL, k = 20 + r / 4, sub = r % 4;
    return ((size_t)1 << k) + (size_t)(sub + 1) * ((size_t)1 << (k - 2));
}

static int64_t limit_bytes(void) {
    if (g_limit < 0) {
        int64_t env = gj_rt_env_alloc_cache();
        long long mb = env >= 0 ? env >> 20 : DEFAULT_LIMIT_MB;
        g_limit = mb > INT64_MAX / (1 << 20) ? INT64_MAX : mb * (1 << 20);
    }
    return g_limit;
}

static size_t ptr_slot(const void *p, size_t n) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)(x & (n - 1));
}

/* ------------------------------------------------------ large blocks */

static pthread_once_t g_thp_once = PTHREAD_ONCE_INIT;
static int g_thp_mode; /* GJ_RT_THP_*: what the kernel offers */
static atomic_llong g_mapped_bytes;  /* large blocks mapped (new, zero) since start */
static atomic_llong g_advised_bytes; /* of which advised MADV_HUGEPAGE */
static atomic_llong g_n_mapped;      /* large blocks mapped since start */
static atomic_int g_thp_override = -1; /* tests: -1 the kernel's mode, else a GJ_RT_THP_* */

/* /sys/kernel/mm/transparent_hugepage/enabled: "[always]", "[madvise]" or
 * "[never]" (absent: none, as on kernels built without THP). */
static void thp_read(void) {
    g_thp_mode = GJ_RT_THP_NONE;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return;
    char buf[128] = {0};
    if (fgets(buf, sizeof buf, f)) {
        if (strstr(buf, "[always]")) g_thp_mode = GJ_RT_THP_ALWAYS;
        else if (strstr(buf, "[madvise]")) g_thp_mode = GJ_RT_THP_MADVISE;
        else if (strstr(buf, "[never]")) g_thp_mode = GJ_RT_THP_NEVER;
    }
    fclose(f);
}

int gj_rt_thp_mode(void) {
    pthread_once(&g_thp_once, thp_read);
    int o = atomic_load(&g_thp_override);
    return o >= 0 ? o : g_thp_mode;
}

void gj_rt_thp_simulate(int mode) { atomic_store(&g_thp_override, mode); }

static atomic_int g_huge_set = -1; /* gj_set_hugepages: -1 not called, else 0 / 1 */

bool gj_rt_hugepages_on(void) {
    int v = atomic_load(&g_huge_set);
    return v >= 0 ? v != 0 : gj_rt_env_hugepages();
}

void gj_set_hugepages(bool on) { atomic_store(&g_huge_set, on ? 1 : 0); }

/* Whether new large blocks are advised for huge pages. */
static bool thp_wanted(void) {
    int m = gj_rt_thp_mode();
    return gj_rt_hugepages_on() && (m == GJ_RT_THP_ALWAYS || m == GJ_RT_THP_MADVISE);
}

static size_t map_len(size_t c) { return (c + PAGE_4K - 1) & ~(PAGE_4K - 1); }

/* A new block of class size c (64-byte aligned; a large one 2 MiB-aligned
 * and zero: *fresh). NULL when the system has no memory. */
static void *block_new(size_t c, bool *fresh) {
    *fresh = false;
    if (c < HUGE_MIN) return aligned_alloc(ALIGN, c);
    size_t len = map_len(c), span = len + HUGE_MIN - PAGE_4K; /* room to align the start */
    if (span < len) return NULL;
    char *r = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) return NULL;
    uintptr_t a = ((uintptr_t)r + HUGE_MIN - 1) & ~(uintptr_t)(HUGE_MIN - 1);
    size_t head = (size_t)(a - (uintptr_t)r), tail = span - head - len;
    if (head) munmap(r, head);
    if (tail) munmap((char *)a + len, tail);
    void *p = (void *)a;
    atomic_fetch_add(&g_mapped_bytes, (long long)len);
    atomic_fetch_add(&g_n_mapped, 1);
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    if (thp_wanted()) {
        if (madvise(p, len, MADV_HUGEPAGE) == 0) atomic_fetch_add(&g_advised_bytes, (long long)len);
    } else if (gj_rt_thp_mode() == GJ_RT_THP_ALWAYS) {
        (void)madvise(p, len, MADV_NOHUGEPAGE); /* GRADJIT_HUGEPAGES=0 under "always" */
    }
#endif
    *fresh = true;
    return p;
}

/* Returns block p of class size c to the system. */
static void block_release(void *p, size_t c) {
    if (c < HUGE_MIN) {
        free(p);
        return;
    }
    UNPOISON(p, c);
    munmap(p, map_len(c));
}

void gj_rt_page_stats(gj_rt_page_stats_t *out) {
    out->thp_mode = gj_rt_thp_mode();
    out->hugepages = thp_wanted();
    out->large_min = (int64_t)HUGE_MIN;
    out->mapped_bytes = atomic_load(&g_mapped_bytes);
    out->advised_bytes = atomic_load(&g_advised_bytes);
    out->n_mapped = atomic_load(&g_n_mapped);
}

/* Puts block p of class idx (size c) in its free list, or frees it when
 * the cache is full or a list node cannot be had. Lock held. */
static void cache_put_locked(void *p, size_t c, int idx) {
    free_node *fn = NULL;
    if (g_cached_bytes + (int64_t)c <= limit_bytes()) fn = malloc(sizeof *fn);
    if (!fn) {
        block_release(p, c);
        g_held_bytes -= (int64_t)c;
        return;
    }
    POISON(p, c);
    fn->p = p;
    fn->era = g_era;
    fn->next = g_free[idx];
    g_free[idx] = fn;
    g_cached_bytes += (int64_t)c;
}

static void rec_release_uses(rec *r) {
    for (int i = 0; i < r->n; i++) gj_rt_stream_release(r->uses[i].s);
    gj_rt_free(r->uses);
    gj_rt_free(r);
}

/* Moves every deferred block whose streams have all passed their points to
 * the cache. Lock held. */
static void poll_locked(void) {
    rec **pp = &g_deferred;
    while (*pp) {
        rec *r = *pp;
        bool done = true;
        for (int i = 0; i < r->n && done; i++) done = gj_rt_stream_passed(r->uses[i].s, r->uses[i].point);
        if (!done) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        int idx;
        size_t c = class_of(r->nbytes, &idx);
        g_deferred_bytes -= (int64_t)c;
        atomic_fetch_sub(&g_n_deferred, 1);
        cache_put_locked(r->p, c, idx);
        rec_release_uses(r);
    }
}

void gj_rt_cache_poll(void) {
    if (atomic_load(&g_n_deferred) == 0) return;
    pthread_mutex_lock(&g_mu);
    poll_locked();
    pthread_mutex_unlock(&g_mu);
}

/* Frees every block of the free lists. Lock held. */
static void release_locked(void) {
    g_held_bytes -= g_cached_bytes;
    for (int i = 0; i < (int)N_CLASSES; i++) {
        size_t c = 0;
        while (g_free[i]) {
            free_node *fn = g_free[i];
            g_free[i] = fn->next;
            if (c == 0) c = class_size(i);
            block_release(fn->p, c);
            free(fn);
        }
    }
    g_cached_bytes = 0;
}

void gj_rt_alloc_release_cache(void) {
    pthread_mutex_lock(&g_mu);
    poll_locked();
    release_locked();
    pthread_mutex_unlock(&g_mu);
}

uint64_t gj_rt_alloc_cache_mark(void) {
    pthread_mutex_lock(&g_mu);
    poll_locked();
    uint64_t m = ++g_era;
    pthread_mutex_unlock(&g_mu);
    return m;
}

void gj_rt_alloc_release_cache_before(uint64_t mark) {
    pthread_mutex_lock(&g_mu);
    poll_locked();
    for (int i = 0; i < (int)N_CLASSES; i++) {
        size_t c = class_size(i);
        for (free_node **pp = &g_free[i]; *pp;) {
            free_node *fn = *pp;
            if (fn->era >= mark) {
                pp = &fn->next;
                continue;
            }
            *pp = fn->next;
            block_release(fn->p, c);
            free(fn);
            g_cached_bytes -= (int64_t)c;
            g_held_bytes -= (int64_t)c;
        }
    }
    pthread_mutex_unlock(&g_mu);
}

void gj_mem_release_cache(void) { gj_rt_alloc_release_cache(); }

/* At exit: hand the cached blocks back to libc. */
__attribute__((destructor)) static void cache_at_exit(void) { gj_rt_alloc_release_cache(); }

int64_t gj_rt_cache_bytes(void) {
    pthread_mutex_lock(&g_mu);
    int64_t n = g_cached_bytes + g_deferred_bytes;
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* GRADJIT_MEM_LIMIT_MB, read once (lock held): a count of MiB > 0, else
 * no limit (a value that is not a count warns once). */
static int64_t mem_limit_locked(void) {
    if (g_mem_limit < 0) {
        g_mem_limit = gj_rt_env_mem_limit();
    }
    return g_mem_limit;
}

int gj_rt_set_mem_limit(int64_t bytes) {
    if (bytes < 0) {
        gj_rt_set_error("gj_set_mem_limit: the limit must be >= 0 bytes (0: none), got %lld",
                        (long long)bytes);
        return -1;
    }
    pthread_mutex_lock(&g_mu);
    g_mem_limit = bytes;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

void gj_rt_held_stats(int64_t *held, int64_t *peak, int64_t *limit) {
    pthread_mutex_lock(&g_mu);
    *held = g_held_bytes;
    *peak = g_held_peak;
    *limit = mem_limit_locked();
    pthread_mutex_unlock(&g_mu);
}

void gj_rt_held_reset_peak(void) {
    pthread_mutex_lock(&g_mu);
    g_held_peak = g_held_bytes;
    pthread_mutex_unlock(&g_mu);
}

/* Takes c bytes more from libc into the count, or false (lock held) when
 * that would pass the limit even after emptying the cache. */
static bool held_take_locked(size_t c) {
    int64_t lim = mem_limit_locked();
    if (lim > 0 && g_held_bytes + (int64_t)c > lim) {
        poll_locked();
        release_locked();
        if (g_held_bytes + (int64_t)c > lim)
            return false;
    }
    g_held_bytes += (int64_t)c;
    if (g_held_bytes > g_held_peak) g_held_peak = g_held_bytes;
    return true;
}

/* A block of nbytes' class: the most recently cached one, else a new one
 * (after releasing the cache if libc has no memory left). NULL on OOM
 * (*over_limit set when the memory limit refused it). */
void *gj_rt_cache_alloc(size_t nbytes, bool *over_limit, bool *fresh) {
    *over_limit = false;
    *fresh = false;
    int idx;
    size_t c = class_of(nbytes, &idx);
    pthread_mutex_lock(&g_mu);
    if (atomic_load(&g_n_deferred) > 0) poll_locked();
    free_node *fn = g_free[idx];
    if (fn) {
        g_free[idx] = fn->next;
        g_cached_bytes -= (int64_t)c;
    }
    bool ok = fn || held_take_locked(c);
    int64_t held = g_held_bytes;
    pthread_mutex_unlock(&g_mu);
    if (fn) {
        void *p = fn->p;
        free(fn);
        UNPOISON(p, c);
        return p;
    }
    if (!ok) {
        *over_limit = true;
        gj_rt_set_error("out of memory under gradjit's memory limit of %.1f MiB "
                        "(GRADJIT_MEM_LIMIT_MB or gj_set_mem_limit): it holds %.1f MiB of "
                        "tensor memory and a tensor needs %.1f MiB more",
                        (double)g_mem_limit / 1048576.0, (double)held / 1048576.0,
                        (double)c / 1048576.0);
        return NULL;
    }
    void *p = block_new(c, fresh);
    if (!p) {
        gj_rt_alloc_release_cache();
        p = block_new(c, fresh);
    }
    if (!p) {
        pthread_mutex_lock(&g_mu);
        g_held_bytes -= (int64_t)c;
        pthread_mutex_unlock(&g_mu);
    }
    return p;
}

/* Removes and returns the record of p (NULL if none). Lock held. */
static rec *rtab_take(void *p) {
    if (g_nrec == 0) return NULL;
    for (rec **pp = &g_rtab[ptr_slot(p, g_rtab_n)]; *pp; pp = &(*pp)->next) {
        if ((*pp)->p != p) continue;
        rec *r = *pp;
        *pp = r->next;
        g_nrec--;
        return r;
    }
    return NULL;
}

void gj_rt_cache_free(void *p, size_t nbytes) {
    if (!p) return;
    int idx;
    size_t c = class_of(nbytes, &idx);
    pthread_mutex_lock(&g_mu);
    rec *r = rtab_take(p);
    if (r) {
        bool done = true;
        for (int i = 0; i < r->n; i++) {
            r->uses[i].point = gj_rt_stream_point(r->uses[i].s);
            done &= gj_rt_stream_passed(r->uses[i].s, r->uses[i].point);
        }
        if (!done) {
            POISON(p, c);
            r->nbytes = nbytes;
            r->next = g_deferred;
            g_deferred = r;
            g_deferred_bytes += (int64_t)c;
            atomic_fetch_add(&g_n_deferred, 1);
            pthread_mutex_unlock(&g_mu);
            return;
        }
        rec_release_uses(r);
    }
    cache_put_locked(p, c, idx);
    pthread_mutex_unlock(&g_mu);
}

/* Grows the record table to n buckets (a power of two). Lock held. */
static int rtab_grow(size_t n) {
    rec **t = gj_rt_calloc(n, sizeof *t);
    if (!t) return -1;
    for (size_t i = 0; i < g_rtab_n; i++) {
        while (g_rtab[i]) {
            rec *r = g_rtab[i];
            g_rtab[i] = r->next;
            size_t h = ptr_slot(r->p, n);
            r->next = t[h];
            t[h] = r;
        }
    }
    gj_rt_free(g_rtab);
    g_rtab = t;
    g_rtab_n = n;
    return 0;
}

int gj_rt_cache_record_stream(void *p, gj_stream *s) {
    int rc = -1;
    pthread_mutex_lock(&g_mu);
    if (g_nrec + 1 > g_rtab_n && rtab_grow(g_rtab_n ? g_rtab_n * 2 : 64) != 0) goto done;
    rec *r = NULL;
    for (r = g_rtab[ptr_slot(p, g_rtab_n)]; r && r->p != p; r = r->next) {
    }
    if (!r) {
        r = gj_rt_calloc(1, sizeof *r);
        if (!r) goto done;
        r->p = p;
        size_t h = ptr_slot(p, g_rtab_n);
        r->next = g_rtab[h];
        g_rtab[h] = r;
        g_nrec++;
    }
    for (int i = 0; i < r->n; i++)
        if (r->uses[i].s == s) {
            rc = 0;
            goto done;
        }
    if (r->n == r->cap) {
        int cap = r->cap ? r->cap * 2 : 2;
        rec_use *u = gj_rt_realloc(r->uses, (size_t)cap * sizeof *u);
        if (!u) goto done; /* r stays (maybe with no use): harmless */
        r->uses = u;
        r->cap = cap;
    }
    gj_rt_stream_retain(s);
    r->uses[r->n].s = s;
    r->uses[r->n].point = 0;
    r->n++;
    rc = 0;
done:
    pthread_mutex_unlock(&g_mu);
    return rc;
}
