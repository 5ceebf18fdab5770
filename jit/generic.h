/* SPDX-License-Identifier: MIT */
/*
 * generic.h - the registry of generic (size-independent) kernels, see
 * generic.c. Internal to jit/.
 */
#ifndef GJ_JIT_GENERIC_H
#define GJ_JIT_GENERIC_H

#include "code.h"
#include "plan.h"

/* Registers every compiled kernel of generic plan p (its fn, from code c)
 * under its generic description, unless one is registered already; the
 * registry then holds a reference to c. 0, or -1 on OOM (what was
 * registered stays). No-op for a plan that is not generic. */
int gj_jit_generic_register(const gj_jit_plan *p, gj_jit_code *code);
/* Sets every kernel's fn of generic plan p from the registry. 0: all
 * found; *codes_out (gj_rt_malloc'd) holds the n distinct code objects
 * used, each with a new reference for the caller. 1: some kernel is not
 * registered (fns cleared, nothing held; why[] names the first); -1: out
 * of memory. */
int gj_jit_generic_bind(gj_jit_plan *p, gj_jit_code ***codes_out, int *n_codes_out, char *why,
                        size_t why_cap);
/* Drops the code objects that only the registry still references (all:
 * every one, with its entries). */
void gj_jit_generic_sweep(bool all);
/* Registered kernels (tests). */
int gj_jit_generic_kernels(void);

#endif /* GJ_JIT_GENERIC_H */
