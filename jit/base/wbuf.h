/* SPDX-License-Identifier: MIT */
/*
 * wbuf.h - a growable byte buffer and the field writers that serialise
 * plans (part of base.h): the disk cache writes plans with them, and
 * dedupe.c describes kernels with them, so both see the same bytes for the
 * same fields (no struct padding, no pointers, no dims past a rank).
 * put_kernel_code, which knows a plan's kernel, is plan.h's.
 *
 * Invariant: after an allocation failure `oom` is set and every later put
 * is a no-op; p[0..n) is what was written before it.
 */
#ifndef GJ_JIT_WBUF_H
#define GJ_JIT_WBUF_H

#include "runtime/rt.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef struct wbuf {
    unsigned char *p;
    size_t n, cap;
    bool oom;
} wbuf;

static inline void wbuf_put(wbuf *b, const void *src, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *q = gj_rt_realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}

static inline void wbuf_u64(wbuf *b, uint64_t v) { wbuf_put(b, &v, sizeof v); }
static inline void wbuf_i64(wbuf *b, int64_t v) { wbuf_u64(b, (uint64_t)v); }
static inline void wbuf_f64(wbuf *b, double v) { wbuf_put(b, &v, sizeof v); }

/* v[0..n) of a GJ_MAX_DIMS array (n clamped to it): entries past the rank
 * may be left uninitialised by the planner, so they are not part of the
 * plan's bytes. */
static inline void wbuf_dims(wbuf *b, const int64_t *v, int n) {
    n = n < 0 ? 0 : n > GJ_MAX_DIMS ? GJ_MAX_DIMS : n;
    wbuf_i64(b, n);
    for (int i = 0; i < n; i++) wbuf_i64(b, v[i]);
}

/* Every field of an instruction (unused fields are zero). */
static inline void wbuf_inst(wbuf *b, const gj_rt_inst *x) {
    wbuf_i64(b, x->prim);
    wbuf_i64(b, x->n_in);
    wbuf_f64(b, x->scalar);
    wbuf_i64(b, x->dtype);
    wbuf_u64(b, x->axes);
    wbuf_u64(b, (uint64_t)x->keepdim | (uint64_t)x->ta << 1 | (uint64_t)x->tb << 2);
    wbuf_i64(b, x->axis);
    wbuf_i64(b, x->start);
    wbuf_i64(b, x->len);
    wbuf_u64(b, x->seed);
    wbuf_u64(b, x->rng_offset);
    wbuf_i64(b, x->ndim);
    wbuf_dims(b, x->shape, x->ndim);
}

#endif /* GJ_JIT_WBUF_H */
