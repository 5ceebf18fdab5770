/* SPDX-License-Identifier: MIT */
/*
 * cache.h - programs by key: the memory cache, and how a program is made
 * for a key it does not hold (the disk cache, kernels of other programs,
 * a compile). Shared by every compiled path: the backward (compiled.c)
 * and the training step (step.c). Internal to jit/.
 *
 * A key is the canonical text of what a program computes (never an
 * address: the same in every process), its 128-bit hash, and its "call
 * site" (the text without sizes), which the recompile limit and dynamic
 * shapes count by.
 */
#ifndef GJ_JIT_CACHE_H
#define GJ_JIT_CACHE_H

#include "capture.h"
#include "fallback.h"
#include "program.h"

typedef struct gj_jit_key {
    const char *text; /* NUL-terminated */
    size_t len;
    uint64_t hash[2];
    uint64_t site[2];
} gj_jit_key;

/* The key of a backward's walk (borrowing its text). */
static inline gj_jit_key gj_jit_walk_key(const gj_jit_walk *w) {
    gj_jit_key k = {w->key, w->key_len, {w->hash[0], w->hash[1]}, {w->site[0], w->site[1]}};
    return k;
}

/* What makes the graph of a key the cache does not hold: capture builds it
 * (into the caller's storage) and returns it, or NULL with why[] (and
 * *code, *permanent: a failure that depends on the key only, remembered
 * as eager-only) set; finish, when not NULL, copies what the program needs
 * from the capture once it is planned (0, or -1 on OOM). Both run under
 * the cache's lock. */
typedef struct gj_jit_source {
    gj_jit_graph *(*capture)(void *ctx, char *why, size_t why_cap, gj_ca_reason *code,
                             bool *permanent);
    int (*finish)(void *ctx, gj_jit_program *prog);
    void *ctx;
    gj_jit_path path; /* whose counters a fallback decided here goes to */
} gj_jit_source;

/* The outcome of gj_jit_get_program. */
enum {
    GJ_JIT_GOT = 0,  /* got->prog holds a reference for the caller's run */
    GJ_JIT_FALL = 1, /* run eagerly this time: the caller counts the fallback with
                        got->code and got->why (gj_jit_fallback, not first) */
    GJ_JIT_FELL = 2, /* run eagerly: the fallback is counted and reported already
                        (the key was just marked eager-only) */
};
typedef struct gj_jit_got {
    gj_jit_program *prog;
    gj_jit_made made; /* how it was found (GJ_JIT_GOT) */
    bool fresh;       /* compiled, loaded or bound for this call */
    gj_ca_reason code;
    char why[400];
} gj_jit_got;

/* The program of key k: from the memory cache; else, unless the key is
 * eager-only or its call site reached the recompile limit, src captures
 * and plans it, and it is loaded from the disk cache, bound to kernels
 * other programs compiled, or compiled (and then saved to disk). Returns
 * GJ_JIT_GOT, _FALL or _FELL as above, or -1 with the error set when the
 * processes of a cross-process agreement disagree on the key. */
int gj_jit_get_program(const gj_jit_key *k, const gj_jit_source *src, gj_jit_got *got);

/* Drops a run's reference to p (the cache's lock not held), freeing p if it
 * was the last (its entry was evicted, demoted or cleared meanwhile). */
void gj_jit_program_release(gj_jit_program *p);

/* Marks the entry of key w eager-only after a guard tripped (its program is
 * dropped). Returns whether this call did it: the first time for the key,
 * when the warning is printed. */
bool gj_jit_demote(const gj_jit_key *w, gj_ca_reason code, const char *why);

/* The memory and disk cache levels of gj_ca_stats. */
void gj_jit_cache_levels(int64_t *mem_bytes, int64_t *mem_entries, int64_t *disk_bytes);

#endif /* GJ_JIT_CACHE_H */
