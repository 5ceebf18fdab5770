/* SPDX-License-Identifier: MIT */
/*
 * program.h - a compiled program (a backward's or a training step's): the
 * plan, its machine code, and what its inputs and outputs are at run time.
 * Part of the cache stage's entry (cache.h).
 *
 * Invariants:
 *   - inputs[i] / outputs[o] describe graph input i / output o of the plan
 *     in the order the plan expects them (canonical origins, see ir.h).
 *   - recapture: some input has no canonical origin, so every run captures
 *     again (cheap: no kernel runs) to collect the input tensors.
 *   - refs and id belong to cache.c (under its cache lock): the memory
 *     cache holds one reference, and every run of the program one more, so
 *     an entry evicted or demoted while a thread (or a hook re-entering
 *     gj_backward) runs it is freed by the last run, not under it.
 */
#ifndef GJ_JIT_PROGRAM_H
#define GJ_JIT_PROGRAM_H

#include "jit/codegen/codegen.h"
#include "jit/plan/plan.h"

typedef struct gj_jit_program {
    gj_jit_plan plan;
    gj_jit_code *code;     /* compiled for this program (NULL for a bound one) */
    /* A generic plan bound to kernels compiled for other sizes (plan/symbolic.c):
     * a reference to each code object its kernels are in. */
    gj_jit_code **shared;
    int n_shared;
    gj_jit_input *inputs;
    int n_inputs;
    gj_jit_output *outputs;
    int n_outputs;
    bool recapture;
    gj_jit_hookref *hooks; /* tensor hooks (hook instructions) and post-accumulate hooks */
    int n_hooks;
    int n_calls; /* call instructions (custom ops, a step's reducer and post-hook calls) */
    /* A gj_grad's program (its outputs have acc_node -1): per requested
     * input, the output holding its gradient or -1 (none reaches it);
     * cache.c copies it from the capture. NULL, 0 for a backward. */
    int *ret;
    int n_ret;
    /* A step's program: what plan/remat.c's stats say of its graph (the
     * source's finish sets them; 0 otherwise) and the budget it met */
    int64_t saved_bytes, recomputed;
    double recompute_flops;
    int64_t budget;
    int refs;    /* cache.c: the cache's reference + runs in progress */
    uint64_t id; /* cache.c: unique in the process, never reused */
} gj_jit_program;

/* Optimises g in place (CSE, DCE) and plans it: the program of g with its
 * plan and no code yet; NULL with why[] set and *permanent telling whether
 * the failure depends only on the graph (no lowering) rather than on this
 * run (out of memory). */
gj_jit_program *gj_jit_program_plan(gj_jit_graph *g, char *why, size_t why_cap, bool *permanent);
/* Compiles pr's kernels that are not shared with symbols `<prefix>_<name>`
 * (prefix NULL: a fresh one); `keep` as gj_jit_code_compile. Sets
 * pr->code: 0, or -1 with why[] set and *permanent true for an LLVM error
 * (pr keeps its plan, no code). */
int gj_jit_program_compile(gj_jit_program *pr, const char *prefix, bool keep, char *why,
                           size_t why_cap, bool *permanent);
/* Both halves, keeping no object code. */
gj_jit_program *gj_jit_program_build(gj_jit_graph *g, const char *prefix, char *why,
                                     size_t why_cap, bool *permanent);
void gj_jit_program_free(gj_jit_program *pr);
/* The bytes pr holds: the program and its plan's heap arrays (at their
 * capacities), the input/output/hook tables and its machine code
 * (gj_jit_code_bytes). What the memory cache's limit counts. */
size_t gj_jit_program_bytes(const gj_jit_program *pr);
/* The public description of plan p (gradjit.h: gj_ca_program_info). */
void gj_jit_plan_info(const gj_jit_plan *p, gj_ca_program_info *out);

#endif /* GJ_JIT_PROGRAM_H */
