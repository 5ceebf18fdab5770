/* SPDX-License-Identifier: MIT */
/*
 * attention_table.h - the integer table through which a compiled
 * program's attention kernel receives its geometry (runtime/attention.h
 * reads it; jit/ writes it). Layout only: no code.
 */
#ifndef GJ_ATTENTION_TABLE_H
#define GJ_ATTENTION_TABLE_H

/* A compiled program's attention kernel gets its geometry as a table of
 * GJ_ATTN_NI integers (constants of the kernel, or read at run time by a
 * symbolic program's), and its memory as the instruction's buffers:
 * forward q k v out lse, backward q k v o go lse gq gk gv ws, q k v o go
 * read at the element offsets of the table. */
enum {
    GJ_ATTN_GI_B = 0, GJ_ATTN_GI_H, GJ_ATTN_GI_T, GJ_ATTN_GI_S, GJ_ATTN_GI_D, GJ_ATTN_GI_E,
    GJ_ATTN_GI_QS = 6,   /* 3 strides each: q, k, v, o, go */
    GJ_ATTN_GI_CAUSAL = 21,
    GJ_ATTN_GI_SCALE,    /* the bits of the double */
    GJ_ATTN_GI_P,        /* the bits of the double */
    GJ_ATTN_GI_OFF,      /* 5 element offsets: q, k, v, o, go */
    GJ_ATTN_NI = GJ_ATTN_GI_OFF + 5
};

#include <stdbool.h>
#include <stdint.h>

/* The block size of queries and of keys (attention.h's GJ_ATTN_BR, _BC). */
#define GJ_ATTN_BLOCK 64

/* Units of work of a forward (b, h, query block) or a backward (b, h). */
static inline int64_t gj_attn_units_of(bool fwd, int64_t B, int64_t H, int64_t T) {
    return fwd ? B * H * ((T + GJ_ATTN_BLOCK - 1) / GJ_ATTN_BLOCK) : B * H;
}
/* Backward workspace per unit, in accumulator elements: the head's dQ
 * [T][D], Q^T and dO^T a block at a time ([Tp/64][D][64], [Tp/64][E][64],
 * Tp: T rounded up to a block) and the rows' D_i [T]. */
static inline int64_t gj_attn_ws_of(int64_t T, int64_t D, int64_t E) {
    int64_t Tp = (T + GJ_ATTN_BLOCK - 1) / GJ_ATTN_BLOCK * GJ_ATTN_BLOCK;
    return T * (D + 1) + Tp * (D + E);
}

#endif /* GJ_ATTENTION_TABLE_H */
