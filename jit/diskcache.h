/*
 * diskcache.h - compiled programs on disk, so a second process skips
 * compilation (internal to jit/).
 *
 * One file per key: <dir>/<128-bit hash in hex>.gjc holding the full key
 * text, the plan, the run-time roles of inputs and outputs, and the object
 * code of its kernels, guarded by the library version, the LLVM version,
 * target triple, CPU name and features (gj_jit_host_id), the sizes of the
 * serialised structures, and a 128-bit checksum. A file that fails any
 * check is reported as stale or damaged and recompiled, never trusted.
 */
#ifndef GJ_JIT_DISKCACHE_H
#define GJ_JIT_DISKCACHE_H

#include "capture.h"
#include "program.h"

/* The cache directory, or NULL when the disk cache is off. Default:
 * $GRADJIT_CACHE_DIR if set ("" or "off": off), else
 * $XDG_CACHE_HOME/gradjit, else $HOME/.cache/gradjit. */
const char *gj_jit_disk_dir(void);

/* Writes program pr of key w with its object code (written to a temporary
 * file, then renamed, so readers never see half a file). 0, or -1 (the
 * reason logged under GRADJIT_LOG=cache; never an error for the caller). */
int gj_jit_disk_save(const gj_jit_walk *w, const gj_jit_program *pr, const char *prefix,
                     const void *obj, size_t obj_size);

/* The program of key w from disk, compiled code loaded and ready, or NULL:
 * *found false if there is no file, true if there was one that could not
 * be used (why[] says why: stale, damaged, or an LLVM error). */
gj_jit_program *gj_jit_disk_load(const gj_jit_walk *w, bool *found, char *why, size_t why_cap);

#endif /* GJ_JIT_DISKCACHE_H */
