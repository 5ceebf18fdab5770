/* SPDX-License-Identifier: MIT */
/*
 * gemm_int.h - inside the GEMM layer: its two leaf providers and the key
 * and table both of its tables use. Included by gemm.c (the entry),
 * gemm_choice.c (which provider computes a GEMM), openblas.c, onednn.c,
 * and the GEMM tests; nothing else in the library.
 *
 *          gemm.c  gj_rt_sgemm / dgemm / bgemm, the split, each block
 *           |   \
 *           |   gemm_choice.c   the choice per GEMM shape: measured,
 *           |   /      |        kept in the cache directory, read back
 *        openblas.c  onednn.c   leaves: one block on the calling thread
 *
 * Invariants:
 *   - A leaf computes one block of a GEMM on the calling thread and knows
 *     nothing of splits, choices or the pool; nothing calls upwards.
 *   - A gemm_key names a GEMM (KIND_SHAPE: transposes, M, N, K, beta 0 or
 *     1, bf16 operands; leading dimensions 0) or one block's oneDNN
 *     primitive (KIND_BLOCK: the block's M and N, and the leading
 *     dimensions too). The choice is a function of the shape only, so a
 *     GEMM computed on a strided view and the same GEMM on a dense copy
 *     (eager and compiled, say) take the same provider.
 *   - A gemm_table is read without locks: an entry is published (release)
 *     with its key set and never removed while GEMMs may run; the writer
 *     holds the owner's lock. Entries are the owner's structs whose first
 *     member is a gemm_node.
 */
#ifndef GJ_GEMM_INT_H
#define GJ_GEMM_INT_H

#include "runtime/rt.h"

/* ------------------------------------------------------------ keys */

enum { GJ_GEMM_KIND_SHAPE = 0, GJ_GEMM_KIND_BLOCK = 1 };

typedef struct gj_gemm_key {
    int64_t M, N, K, lda, ldb, ldc;
    uint8_t ta, tb, beta1, kind, bf16; /* bf16: A and B bf16, C f32 */
} gj_gemm_key;

/* The key of GEMM c's shape (kind SHAPE) or of its block [M, N] with
 * leading dimension lda for A (kind BLOCK). */
static inline gj_gemm_key gj_gemm_shape_key(const gj_rt_gemm_call *c) {
    return (gj_gemm_key){c->M, c->N, c->K, 0, 0, 0, c->ta, c->tb, c->beta == 1.0,
                         GJ_GEMM_KIND_SHAPE, c->bf16};
}
static inline gj_gemm_key gj_gemm_block_key(const gj_rt_gemm_call *c, int64_t M, int64_t N,
                                            int64_t lda) {
    return (gj_gemm_key){M, N, c->K, lda, c->ldb, c->ldc, c->ta, c->tb, c->beta == 1.0,
                         GJ_GEMM_KIND_BLOCK, c->bf16};
}

static inline uint64_t gj_gemm_key_hash(const gj_gemm_key *k) {
    uint64_t h = 1469598103934665603ull;
    const int64_t v[11] = {k->M,  k->N,  k->K,     k->lda,  k->ldb, k->ldc,
                           k->ta, k->tb, k->beta1, k->kind, k->bf16};
    for (int i = 0; i < 11; i++) {
        h ^= (uint64_t)v[i];
        h *= 1099511628211ull;
        h ^= h >> 29;
    }
    return h;
}

static inline bool gj_gemm_key_eq(const gj_gemm_key *a, const gj_gemm_key *b) {
    return a->M == b->M && a->N == b->N && a->K == b->K && a->lda == b->lda &&
           a->ldb == b->ldb && a->ldc == b->ldc && a->ta == b->ta && a->tb == b->tb &&
           a->beta1 == b->beta1 && a->kind == b->kind && a->bf16 == b->bf16;
}

/* ------------------------------------------------------------ table */

#define GJ_GEMM_BUCKETS 1024

typedef struct gj_gemm_node {
    struct gj_gemm_node *next; /* bucket chain; set before publication */
    gj_gemm_key key;
    uint64_t hash;
} gj_gemm_node;

typedef struct gj_gemm_table {
    _Atomic(gj_gemm_node *) b[GJ_GEMM_BUCKETS];
    int n; /* entries, under the owner's lock */
} gj_gemm_table;

/* The entry of k, or NULL (any thread, no lock). */
static inline gj_gemm_node *gj_gemm_find(gj_gemm_table *t, const gj_gemm_key *k, uint64_t h) {
    gj_gemm_node *e = atomic_load_explicit(&t->b[h % GJ_GEMM_BUCKETS], memory_order_acquire);
    for (; e; e = e->next)
        if (e->hash == h && gj_gemm_key_eq(&e->key, k))
            return e;
    return NULL;
}

/* Publishes node e (its key and hash set) under the owner's lock. */
static inline void gj_gemm_publish(gj_gemm_table *t, gj_gemm_node *e) {
    _Atomic(gj_gemm_node *) *b = &t->b[e->hash % GJ_GEMM_BUCKETS];
    e->next = atomic_load_explicit(b, memory_order_relaxed);
    atomic_store_explicit(b, e, memory_order_release);
    t->n++;
}

/* Unpublishes every entry and hands each to fn (the owner's lock held, no
 * GEMM running). */
static inline void gj_gemm_clear(gj_gemm_table *t, void (*fn)(gj_gemm_node *)) {
    for (int b = 0; b < GJ_GEMM_BUCKETS; b++) {
        gj_gemm_node *e = atomic_exchange(&t->b[b], NULL);
        while (e) {
            gj_gemm_node *n = e->next;
            fn(e);
            e = n;
        }
    }
    t->n = 0;
}

/* ------------------------------------------------- leaf: OpenBLAS */

/* Loads OpenBLAS once (openblas.c). 0, or -1 with an error naming why. */
int gj_rt_openblas_init(void);
/* Computes block [M, N] of GEMM c (A, B, C: the block's operands) with
 * one single-threaded OpenBLAS call: f32, f64, or bf16 operands widened to
 * f32 (exactly) first; a plain loop when OpenBLAS is missing. */
void gj_rt_openblas_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                          const void *B, void *C);

/* --------------------------------------------------- leaf: oneDNN */

/* onednn.c, built only with oneDNN's header; without it gemm_choice.c
 * defines these as "no oneDNN" (ready false, every block refused). */
/* Whether oneDNN is loaded and usable (loads it on first call). */
bool gj_rt_onednn_ready(void);
/* Computes block [M, N] of GEMM c (f32 or bf16 operands, f32 C; alpha 1,
 * beta 0 or 1) with oneDNN's matmul on the calling thread: true, or false
 * when oneDNN refuses the block (or lacks memory) and nothing was written.
 * Primitives are made on a block shape's first use and kept. */
bool gj_rt_onednn_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                        const void *B, float *C);
/* Why oneDNN is not usable ("" when it is). */
const char *gj_rt_onednn_why(void);
/* Tests: makes oneDNN look missing (on) or present again. */
void gj_rt_onednn_simulate_missing(bool on);
/* Forgets every primitive (tests, at exit; no GEMM running). */
void gj_rt_onednn_reset(void);
/* Block shapes oneDNN refused; the implementation of a block's primitive
 * ("" if none). */
int64_t gj_rt_onednn_refused(void);
void gj_rt_onednn_dump(FILE *f);

/* ------------------------------------------------------ the choice */

enum { GJ_GEMM_NONE = 0, GJ_GEMM_USE_OPENBLAS = 1, GJ_GEMM_USE_ONEDNN = 2 };

/* Which leaf computes GEMM c (gemm_choice.c): GJ_GEMM_USE_OPENBLAS or
 * GJ_GEMM_USE_ONEDNN. The first call of a shape that is measured decides
 * it on block [M, N] (operands A, B, C, read only), once per process and,
 * where the cache directory keeps it, once per machine; a thread arriving
 * meanwhile waits for that decision. */
int gj_rt_gemm_pick(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A, const void *B,
                    const float *C);
/* Counts a block computed by leaf `used` (the stats). */
void gj_rt_gemm_count_block(int used, bool bf16);

#endif /* GJ_GEMM_INT_H */
