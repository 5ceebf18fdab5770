/* SPDX-License-Identifier: MIT */
/*
 * cache_int.h - compiled programs on disk, so a second process skips
 * compilation (internal to jit/).
 *
 * One file per key: <dir>/<128-bit hash in hex>.gjc holding the full key
 * text, the plan, the run-time roles of inputs and outputs, and the object
 * code of its kernels, guarded by the library version, the LLVM version,
 * target triple, CPU name and features (gj_jit_host_id), the sizes of the
 * serialised structures, and a 128-bit checksum. A file that fails any
 * check, whose plan is not the plan this process made for the key, that is
 * not a regular file of bounded size, or that (or whose directory) is not
 * the user's own and private, is reported as stale, damaged or refused and
 * recompiled, never trusted (docs/architecture.md, "The cache trusts nothing it
 * reads").
 */
#ifndef GJ_JIT_DISKCACHE_H
#define GJ_JIT_DISKCACHE_H

#include "jit/cache/cache.h"


/* What a save found in the directory: entries it deleted for the size
 * limit, and the bytes of our entries left (-1: not measured). */
typedef struct gj_jit_disk_usage {
    int64_t evictions;
    int64_t bytes;
} gj_jit_disk_usage;

/* Writes program pr (planned for key w) with its object code -- the code
 * of the kernels it compiled (kept by pr->code, compiled under prefix) and
 * of the kernels it borrowed from other programs (pr->shared) -- so that
 * a later process loads it alone: to a new temporary file (O_EXCL, 0600),
 * then renamed, so
 * readers never see half a file. Creates the directory 0700 if needed;
 * refuses one not private to the user (message on stderr, once). Then
 * keeps the directory within gj_jit_disk_limit(): the entries (regular
 * files of this user named <32 hex digits>.gjc; nothing else is counted,
 * no symlink followed, and nothing else deleted but our own temporary files
 * more than an hour old) are deleted least recently used first
 * (by modification time: a save writes it, a load that is used sets it to
 * the present), never the one just written; *u (may be NULL) receives what
 * that found. 0, or -1 (the reason logged under GRADJIT_LOG=cache; never
 * an error for the caller). */
int gj_jit_disk_save(const gj_jit_key *w, const gj_jit_program *pr, const char *prefix,
                     gj_jit_disk_usage *u);

/* The symbol prefix of the code of program pr (planned, not yet generic)
 * for key w: "gjk" and the 128-bit hash of the key's hash and pr's plan,
 * so that two processes name the same code alike and different code
 * differently. 0, or -1 on OOM. */
int gj_jit_program_prefix(const gj_jit_key *w, const gj_jit_program *pr, char out[48]);

/* Looks up key w for pr, the program this process planned for it
 * (gj_jit_program_plan; no code yet): if the entry is usable and its plan
 * is byte for byte pr's, loads its object code into pr (pr->code set, and
 * pr->shared with the code of the kernels it borrowed, those kernels
 * marked shared) and returns 0. Otherwise -1 and pr unchanged: *found false if there is no
 * entry, true if there was one that could not be used (why[] says why:
 * stale, damaged, refused, or an LLVM error). A used entry's
 * modification time is set to the present (its LRU stamp). Sets no error. */
int gj_jit_disk_load(const gj_jit_key *w, gj_jit_program *pr, const char *prefix, bool *found,
                     char *why, size_t why_cap);
/* (prefix: the symbol prefix its own code was compiled with; an entry may
 * also have a fresh one of gj_jit_generic_prefix, which a symbolic
 * program's code always has: pass NULL for those.) */

/* Symbolic entries: the object code of a symbolic program, filed under
 * its kernel signature (gj_jit_generic_signature: the kernels' names and
 * generic descriptions, no sizes), so that any later plan with the same
 * kernels -- another size of the call site, in another process -- finds
 * it. The same checks as a program entry (the signature is compared byte
 * for byte, never parsed). Save: pr generic, prefix the one it was
 * compiled with. Load: pr generic (its plan for this size), as
 * gj_jit_disk_load. */
int gj_jit_disk_save_symbolic(const gj_jit_program *pr, const char *prefix,
                              gj_jit_disk_usage *u);
int gj_jit_disk_load_symbolic(gj_jit_program *pr, bool *found, char *why, size_t why_cap);

#endif /* GJ_JIT_DISKCACHE_H */
