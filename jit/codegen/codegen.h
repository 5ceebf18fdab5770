/* SPDX-License-Identifier: MIT */
/*
 * codegen.h - compiled machine code for a plan, without LLVM types (the LLVM
 * side is llvmjit.c). Internal to jit/.
 *
 * A gj_jit_code owns the JIT resources (its object files, tracked by one
 * resource tracker in the process-wide LLJIT) of one plan; the kernel
 * function pointers it writes into the plan stay valid until it is freed.
 */
#ifndef GJ_JIT_CODE_H
#define GJ_JIT_CODE_H

#include "jit/plan/plan.h"

typedef struct gj_jit_code gj_jit_code;

/* Longest symbol prefix of a code object, with its NUL ("gjk" or "gjs" and
 * 32 hex digits). */
#define GJ_JIT_PREFIX_MAX 48

/* Compiles every distinct kernel of p that is not shared (optimised with
 * default<O3> for the host CPU) under symbol prefix `prefix`, which no live
 * code object may have, and stores each kernel's entry in p->instrs[s].k.fn.
 * The kernels are split into up to one module per thread
 * (gj_rt_num_threads, at most 4), compiled at the same time, each to its
 * own object file. With `keep`, the code keeps a copy of its object code
 * (one object file, or several behind a "GJMO" header: gj_jit_code_object)
 * for the disk cache. Returns the code, or NULL with why[] set and the
 * error set (every LLVM error is converted, never fatal). */
gj_jit_code *gj_jit_code_compile(gj_jit_plan *p, const char *prefix, bool keep, char *why,
                                 size_t why_cap);
/* Loads object code made by gj_jit_code_compile under `prefix` (e.g. from
 * the disk cache) and, when p is not NULL, looks up p's kernels that are
 * not shared in it. Object code of a prefix that a live code object
 * already has is not loaded again: that code is returned with one more
 * reference (the same kernels, reached from another program's disk entry).
 * `keep` as for gj_jit_code_compile. NULL with why[] set on failure. */
gj_jit_code *gj_jit_code_load(gj_jit_plan *p, const char *prefix, const void *obj, size_t n,
                              bool keep, char *why, size_t why_cap);
/* The entry of symbol sym ("<prefix>_<kernel name>") of c, or NULL when sym
 * is not c's or does not exist. */
gj_rt_range_fn gj_jit_code_lookup(gj_jit_code *c, const char *sym);
/* c's symbol prefix (borrowed; "" for NULL). */
const char *gj_jit_code_prefix(const gj_jit_code *c);
/* The copy of c's object code it keeps (borrowed; *n its size), or NULL
 * (*n = 0) when it keeps none. */
const void *gj_jit_code_object(const gj_jit_code *c, size_t *n);
/* Whether a live code object has symbol prefix `prefix`. */
bool gj_jit_code_prefix_live(const char *prefix);
/* "llvm <version> | <triple> | <cpu> | <features> | math <hash>": what
 * object code depends on besides the plan ("" if LLVM cannot start). */
const char *gj_jit_host_id(void);
/* Drops a reference to c (the one gj_jit_code_compile/_load returned, or
 * one from gj_jit_code_ref); the last frees it. */
void gj_jit_code_free(gj_jit_code *c);
/* One more reference to c (generic kernels shared between programs). */
void gj_jit_code_ref(gj_jit_code *c);
int gj_jit_code_refs(const gj_jit_code *c);
/* How many object files c was made of (0 for NULL). */
int gj_jit_code_parts(const gj_jit_code *c);
/* The bytes of machine code c holds in the JIT: its object files' size
 * rounded up to whole pages, plus, per object file, one page for each
 * further segment the linker maps (JITLink gives code, read-only data and data their own
 * page-aligned segments), plus the copy of its object code it keeps. An
 * estimate from outside LLVM: ORC's C API does not report what its memory
 * manager mapped. 0 for NULL. */
size_t gj_jit_code_bytes(const gj_jit_code *c);

/* Disposes the process-wide LLJIT (it is created
 * again on demand). Every gj_jit_code must have been freed. */
void gj_jit_llvm_shutdown(void);

#endif /* GJ_JIT_CODE_H */
