/* SPDX-License-Identifier: MIT */
/*
 * wbuf.h - a growable byte buffer and the field writers that serialise
 * plans (internal to jit/): the disk cache writes plans with them, and
 * dedupe.c describes kernels with them, so both see the same bytes for the
 * same fields (no struct padding, no pointers, no dims past a rank).
 *
 * Invariant: after an allocation failure `oom` is set and every later put
 * is a no-op; p[0..n) is what was written before it.
 */
#ifndef GJ_JIT_WBUF_H
#define GJ_JIT_WBUF_H

#include "plan.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef struct wbuf {
    unsigned char *p;
    size_t n, cap;
    bool oom;
} wbuf;

static inline void put(wbuf *b, const void *src, size_t n) {
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

static inline void put_u64(wbuf *b, uint64_t v) { put(b, &v, sizeof v); }
static inline void put_i64(wbuf *b, int64_t v) { put_u64(b, (uint64_t)v); }
static inline void put_f64(wbuf *b, double v) { put(b, &v, sizeof v); }

/* v[0..n) of a GJ_MAX_DIMS array (n clamped to it): entries past the rank
 * may be left uninitialised by the planner, so they are not part of the
 * plan's bytes. */
static inline void put_dims(wbuf *b, const int64_t *v, int n) {
    n = n < 0 ? 0 : n > GJ_MAX_DIMS ? GJ_MAX_DIMS : n;
    put_i64(b, n);
    for (int i = 0; i < n; i++) put_i64(b, v[i]);
}

/* Every field of an instruction (unused fields are zero). */
static inline void put_inst(wbuf *b, const gj_rt_inst *x) {
    put_i64(b, x->prim);
    put_i64(b, x->n_in);
    put_f64(b, x->scalar);
    put_i64(b, x->dtype);
    put_u64(b, x->axes);
    put_u64(b, (uint64_t)x->keepdim | (uint64_t)x->ta << 1 | (uint64_t)x->tb << 2);
    put_i64(b, x->axis);
    put_i64(b, x->start);
    put_i64(b, x->len);
    put_u64(b, x->seed);
    put_u64(b, x->rng_offset);
    put_i64(b, x->ndim);
    put_dims(b, x->shape, x->ndim);
}

/* A kernel's code: its expressions (instruction of each, zero for loads
 * and constants) and its stores -- the part of a kernel the disk cache and
 * dedupe.c both serialise. generic: without the constants and the
 * instructions' fields other than the primitive and its input count,
 * which a generic kernel does not build into its code (sizes reach them:
 * a mean's 1/N, the shapes of the ops they came from; lower.c). */
static inline void put_kernel_code(wbuf *b, const gj_jit_kernel *k, bool generic) {
    put_i64(b, k->n_ex);
    for (int e = 0; e < k->n_ex; e++) {
        const gj_jit_expr *x = &k->ex[e];
        put_i64(b, x->kind);
        put_i64(b, x->dtype);
        put_i64(b, x->access);
        if (generic) {
            put_i64(b, x->inst.prim);
            put_i64(b, x->inst.n_in);
        } else {
            put_f64(b, x->cval);
            put_inst(b, &x->inst);
        }
        for (int q = 0; q < 3; q++) put_i64(b, x->args[q]);
    }
    put_i64(b, k->n_st);
    for (int q = 0; q < k->n_st; q++) {
        const gj_jit_store *x = &k->st[q];
        put_i64(b, x->access);
        put_i64(b, x->expr);
        put_u64(b, (uint64_t)x->reduce | (uint64_t)x->max << 1);
    }
}

#endif /* GJ_JIT_WBUF_H */
