/* SPDX-License-Identifier: MIT */
/*
 * cache.h - programs by key: the memory cache, and how a program is made
 * for a key it does not hold (the disk cache, kernels of other programs,
 * a compile). Shared by every compiled path: the backward (run/backward.c)
 * and the training step (step.c). Internal to jit/.
 *
 * A key is the canonical text of what a program computes (never an
 * address: the same in every process), its 128-bit hash, and its "call
 * site" (the text without sizes), which the recompile limit and dynamic
 * shapes count by.
 */
#ifndef GJ_JIT_CACHE_H
#define GJ_JIT_CACHE_H

#include "jit/capture/capture.h"
#include "jit/base/base.h"
#include "jit/cache/program.h"

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
    bool own_program; /* each process's program is its own by design (a ZeRO step
                         updates its rank's shards): the key is not agreed */
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

/* The cache directory, or NULL when the disk cache is off. Default:
 * $GRADJIT_CACHE_DIR if set ("" or "off": off), else
 * $XDG_CACHE_HOME/gradjit, else $HOME/.cache/gradjit (any length). */
const char *gj_jit_disk_dir(void);

/* ------------------------------------ the kernel registry (kernels.c) */

/* Registers every kernel of p compiled in code c (its fn) under its
 * description -- generic for a symbolic plan -- unless one is registered
 * already; a shared kernel too when the code it was lent from is among
 * lent[0..n_lent) (a program loaded from disk with the code of the kernels
 * it borrowed). The registry then holds a reference to each code object it
 * names. 0, or -1 on OOM (what was registered stays). */
int gj_jit_kernels_register(const gj_jit_plan *p, gj_jit_code *code, gj_jit_code *const *lent,
                            int n_lent);
/* Sets the fn of p's kernels whose description is registered, marking
 * them shared; *codes_out (gj_rt_malloc'd, NULL if none) holds the n
 * distinct code objects used, each with a new reference for the caller.
 * Not partial: all or nothing -- 0 when every kernel was found, else 1
 * (nothing bound or held; why[] names the first kernel missing). Partial:
 * the number of distinct kernels not found (0: nothing to compile), those
 * found stay bound. -1: out of memory (nothing bound or held). */
int gj_jit_kernels_bind(gj_jit_plan *p, bool partial, gj_jit_code ***codes_out, int *n_codes_out,
                        char *why, size_t why_cap);
/* Drops the code objects that only the registry still references (all:
 * every one, with its entries). */
void gj_jit_generic_sweep(bool all);
/* The kernel signature of generic plan p into *b (a wbuf): per kernel instruction
 * its name, and at a name's first instruction the kernel's generic description.
 * Two plans with equal signatures call the same kernel functions under
 * the same names. 0, or -1 on OOM. */
int gj_jit_generic_signature(const gj_jit_plan *p, struct wbuf *b);
/* A fresh symbol prefix for a symbolic program's code: "gjs" and 32 hex
 * digits from the time, the pid, a counter and an address, so code loaded
 * from disk never clashes with code compiled here. */
void gj_jit_generic_prefix(char out[48]);



/* Registered kernels (tests). */
int gj_jit_generic_kernels(void);

/* Hints: up to GJ_DISK_HINT_MAX values a plan of key w chose (tag names
 * what they are), for a later plan of the same key to try first; the
 * caller verifies them (diskcache.c's file comment). Load: 0 with v[0..n) set, or
 * -1 (none, or not usable). Save: quiet on failure (logged under
 * GRADJIT_LOG=cache). */
#define GJ_DISK_HINT_MAX 4
int gj_jit_disk_hint_load(const gj_jit_key *w, const char *tag, int64_t *v, int n);
void gj_jit_disk_hint_save(const gj_jit_key *w, const char *tag, const int64_t *v, int n);

#endif /* GJ_JIT_CACHE_H */
