/* SPDX-License-Identifier: MIT */
/*
 * alloc.c - the library's two allocation paths and their accounting.
 *
 * Invariants:
 *   - Metadata (headers, nodes, lists) goes through gj_rt_malloc/calloc/
 *     realloc/free; tensor bytes go through gj_rt_alloc_data/free_data, which
 *     return 64-byte aligned blocks whose size is rounded up to 64 bytes.
 *   - live_bytes is the sum of the `nbytes` requested by every data block not
 *     yet freed (exact: gj_rt_free_data is told the same nbytes);
 *     peak_bytes >= live_bytes at all times and only a reset lowers it (to
 *     live_bytes). n_data counts successful data allocations.
 *   - alloc_count counts every allocation attempt on both paths; the failure
 *     injection makes attempt number `fail_target` fail (once). A failed
 *     allocation changes no byte counter and sets the thread's error.
 *   - All counters are atomics: any thread may allocate and free.
 *   - Data blocks come from the caching allocator (alloc_cache.c): a freed
 *     block is kept for reuse by a later request of its size class, so
 *     live_bytes counts bytes in use by tensors, not bytes held from libc.
 *   - Known zero: a block new from the system (a large block's fresh
 *     mapping) is zero. gj_rt_alloc_data_zero zero-fills only blocks that
 *     are not (zeroed_bytes counts what it wrote, zero_skipped_bytes what it
 *     did not need to).
 */
#include "runtime/rt.h"

#include <stdlib.h>
#include <string.h>

#define GJ_RT_DATA_ALIGN 64
#define GJ_RT_ZERO_SPLIT ((size_t)4 << 20) /* zero fills this big go over the pool */
#define GJ_RT_ZERO_CHUNK ((size_t)1 << 20)

static atomic_llong g_live_bytes;
static atomic_llong g_peak_bytes;
static atomic_llong g_n_data;
static atomic_llong g_alloc_count; /* attempts, both paths */
static atomic_llong g_fail_target; /* 0: off; else attempt number that fails */
static atomic_llong g_count_mark;  /* g_alloc_count at the last fail_at call */
static atomic_llong g_zeroed;       /* bytes gj_rt_alloc_data_zero / gj_rt_zero_fill wrote */
static atomic_llong g_zero_skipped; /* bytes it did not write: fresh from the system */

/* Counts one allocation attempt; true if this attempt must fail. */
static bool gj_rt_alloc_attempt(void) {
    long long c = atomic_fetch_add(&g_alloc_count, 1) + 1;
    long long target = atomic_load(&g_fail_target);
    if (target != 0 && c == target) {
        atomic_compare_exchange_strong(&g_fail_target, &target, 0);
        return true;
    }
    return false;
}

static void gj_rt_oom(size_t n) {
    gj_rt_set_error("out of memory allocating %zu bytes", n);
}

void *gj_rt_malloc(size_t n) {
    if (gj_rt_alloc_attempt()) {
        gj_rt_oom(n);
        return NULL;
    }
    void *p = malloc(n ? n : 1);
    if (!p)
        gj_rt_oom(n);
    return p;
}

void *gj_rt_calloc(size_t count, size_t n) {
    if (gj_rt_alloc_attempt()) {
        gj_rt_oom(count * n);
        return NULL;
    }
    if (n && count > SIZE_MAX / n) {
        gj_rt_set_error("out of memory allocating %zu x %zu bytes (size overflows)", count, n);
        return NULL;
    }
    void *p = calloc(count ? count : 1, n ? n : 1);
    if (!p)
        gj_rt_oom(count * n);
    return p;
}

/* Like realloc, but a failure leaves p valid and untouched, and n == 0
 * keeps a (minimal) block instead of freeing p. */
void *gj_rt_realloc(void *p, size_t n) {
    if (gj_rt_alloc_attempt()) {
        gj_rt_oom(n);
        return NULL;
    }
    void *q = realloc(p, n ? n : 1);
    if (!q)
        gj_rt_oom(n);
    return q;
}

void *gj_rt_malloc_aligned(size_t align, size_t n) {
    if (gj_rt_alloc_attempt()) {
        gj_rt_oom(n);
        return NULL;
    }
    size_t size = (n + align - 1) & ~(align - 1); /* aligned_alloc wants a multiple */
    void *p = size >= n ? aligned_alloc(align, size ? size : align) : NULL;
    if (!p)
        gj_rt_oom(n);
    return p;
}

void gj_rt_free(void *p) { free(p); }

/* Raises the peak to at least `live` (lock-free max). */
static void gj_rt_bump_peak(long long live) {
    long long peak = atomic_load(&g_peak_bytes);
    while (live > peak && !atomic_compare_exchange_weak(&g_peak_bytes, &peak, live)) {
    }
}

/* 64-byte aligned block of at least nbytes (contents undefined; zero when
 * *fresh, if fresh is not NULL); NULL with an error on failure. nbytes 0
 * returns a valid minimal block. */
static void *alloc_data_fresh(size_t nbytes, bool *fresh) {
    bool f = false;
    if (fresh)
        *fresh = false;
    if (gj_rt_alloc_attempt()) {
        gj_rt_oom(nbytes);
        return NULL;
    }
    if (nbytes > (size_t)INT64_MAX - GJ_RT_DATA_ALIGN) {
        gj_rt_oom(nbytes);
        return NULL;
    }
    bool over_limit;
    void *p = gj_rt_cache_alloc(nbytes, &over_limit, &f); /* alloc_cache.c: cached or new */
    if (!p) {
        if (!over_limit) /* (past the memory limit the error names it) */
            gj_rt_oom(nbytes);
        return NULL;
    }
    long long live = atomic_fetch_add(&g_live_bytes, (long long)nbytes) + (long long)nbytes;
    gj_rt_bump_peak(live);
    atomic_fetch_add(&g_n_data, 1);
    if (fresh)
        *fresh = f;
    return p;
}

void *gj_rt_alloc_data(size_t nbytes) { return alloc_data_fresh(nbytes, NULL); }

static void zero_range(void *ctx, int64_t b, int64_t e) {
    const size_t *z = ctx; /* {address, bytes} */
    char *p = (char *)(uintptr_t)z[0];
    size_t lo = (size_t)b * GJ_RT_ZERO_CHUNK, hi = (size_t)e * GJ_RT_ZERO_CHUNK;
    if (hi > z[1])
        hi = z[1];
    memset(p + lo, 0, hi - lo);
}

void gj_rt_zero_fill(void *p, size_t nbytes) {
    if (!p || nbytes == 0)
        return;
    atomic_fetch_add(&g_zeroed, (long long)nbytes);
    if (nbytes < GJ_RT_ZERO_SPLIT) {
        memset(p, 0, nbytes);
        return;
    }
    size_t z[2] = {(size_t)(uintptr_t)p, nbytes};
    gj_rt_parallel_for((int64_t)((nbytes + GJ_RT_ZERO_CHUNK - 1) / GJ_RT_ZERO_CHUNK), 1, zero_range,
                       z);
}

/* As gj_rt_alloc_data, but the first nbytes are zero: written only when the
 * block is not fresh from the system. */
void *gj_rt_alloc_data_zero(size_t nbytes) {
    bool fresh;
    void *p = alloc_data_fresh(nbytes, &fresh);
    if (p && fresh)
        atomic_fetch_add(&g_zero_skipped, (long long)nbytes);
    else if (p)
        gj_rt_zero_fill(p, nbytes);
    return p;
}

void gj_rt_zero_stats(int64_t *zeroed, int64_t *skipped) {
    *zeroed = atomic_load(&g_zeroed);
    *skipped = atomic_load(&g_zero_skipped);
}

/* nbytes must be the size passed to gj_rt_alloc_data. NULL is ignored. */
void gj_rt_free_data(void *p, size_t nbytes) {
    if (!p)
        return;
    atomic_fetch_sub(&g_live_bytes, (long long)nbytes); /* before another thread can reuse p */
    gj_rt_cache_free(p, nbytes); /* cached for reuse, deferred for streams, or freed */
}

int64_t gj_rt_alloc_fail_at(int64_t n) {
    long long now = atomic_load(&g_alloc_count);
    long long since = now - atomic_exchange(&g_count_mark, now);
    atomic_store(&g_fail_target, n > 0 ? now + n : 0);
    return since;
}

int64_t gj_rt_alloc_count(void) { return atomic_load(&g_alloc_count); }

void gj_mem_stats(gj_mem *out) {
    if (!out)
        return;
    out->live_bytes = atomic_load(&g_live_bytes);
    out->peak_bytes = atomic_load(&g_peak_bytes);
    out->n_allocs = atomic_load(&g_n_data);
    out->cached_bytes = gj_rt_cache_bytes();
    gj_rt_held_stats(&out->held_bytes, &out->held_peak_bytes, &out->limit_bytes);
}

int gj_set_mem_limit(int64_t bytes) { return gj_rt_set_mem_limit(bytes); }

/* Peak := live now (a concurrent allocation may raise it again at once). */
void gj_mem_reset_peak(void) {
    gj_rt_held_reset_peak();
    atomic_store(&g_peak_bytes, atomic_load(&g_live_bytes));
    gj_rt_bump_peak(atomic_load(&g_live_bytes));
}
