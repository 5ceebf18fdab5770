/* SPDX-License-Identifier: MIT */
/*
 * generic.h - symbolic (size-independent) plans and the process-wide
 * registry of compiled kernels, see generic.c. Internal to jit/.
 */
#ifndef GJ_JIT_GENERIC_H
#define GJ_JIT_GENERIC_H

#include "code.h"
#include "plan.h"

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
/* The kernel signature of generic plan p into *b (a wbuf): per kernel step
 * its name, and at a name's first step the kernel's generic description.
 * Two plans with equal signatures call the same kernel functions under
 * the same names. 0, or -1 on OOM. */
struct wbuf;
int gj_jit_generic_signature(const gj_jit_plan *p, struct wbuf *b);
/* A fresh symbol prefix for a symbolic program's code: "gjs" and 32 hex
 * digits from the time, the pid, a counter and an address, so code loaded
 * from disk never clashes with code compiled here. */
void gj_jit_generic_prefix(char out[48]);
/* Makes p generic: fills every kernel's integer table (plan.h) and gives
 * kernels with one generic description one name. 0, or -1 on OOM. */
int gj_jit_plan_make_generic(gj_jit_plan *p);
/* Undoes gj_jit_plan_make_generic (the plan compiles specialised). 0, or
 * -1 on OOM. */
int gj_jit_plan_make_specific(gj_jit_plan *p);
/* Whether generic kernel code has room for k's column accumulators
 * (its block at most GJ_JIT_MAX_RED_BLOCK when it has reduce stores). */
bool gj_jit_generic_block_ok(const gj_jit_kernel *k);
/* Registered kernels (tests). */
int gj_jit_generic_kernels(void);

#endif /* GJ_JIT_GENERIC_H */
