/* SPDX-License-Identifier: MIT */
/*
 * run.h - the run stage's entry, for the compiled backward and the
 * compiled training step alike: the checks a cached program needs before
 * a run (an input's meta and layout against the program's, memory two
 * views share) and the outputs a run allocates (guards.c); the plan's
 * interpreter (exec.c); and user code called inside a run (tensor hooks,
 * custom op functions, post-accumulate hooks: calls.c) with the guards
 * that check, after each call, that the program still computes what eager
 * would (guards.c). What only one path does is its own: the backward's
 * .grads (grads.c), the step's reducer calls (step/).
 */
#ifndef GJ_JIT_RUN_H
#define GJ_JIT_RUN_H

#include "jit/capture/capture.h"
#include "jit/cache/cache.h"

/* ---------------------------------------------- before a program runs */

/* Whether the memories of views a and b may overlap: the same storage and
 * intersecting byte ranges (from their lowest to their highest element,
 * negative strides included; an empty view touches nothing). */
bool gj_jit_views_overlap(const gj_tensor *a, const gj_tensor *b);

/* Whether tensor t can be graph input i of program pr as it is read in
 * place: 0 (its meta and layout are the program's), 1 (another shape or
 * dtype), 2 (another layout). */
int gj_jit_input_fits(const gj_jit_program *pr, int i, const gj_tensor *t);

/* The outputs a run makes: gj_jit_alloc_output (a gj_jit_out_alloc, ctx a
 * gj_jit_outs) puts a new tensor for output o of plan p into news[o] (its
 * data uninitialised: the program writes it all). */
typedef struct gj_jit_outs {
    const gj_jit_plan *p;
    gj_tensor **news;
} gj_jit_outs;
void *gj_jit_alloc_output(void *ctx, int o);

/* ------------------------------------------------ running a plan (exec.c) */

/* Allocates the data of a new .grad for graph output o (ctx: the
 * caller's); NULL on OOM (error set). */
typedef void *(*gj_jit_out_alloc)(void *ctx, int o);

/* Runs plan p: in[i] is the data of graph input i (contiguous, of
 * p->in_meta[i]); params the run-time values (seed, offset of dropout pair
 * k at [2k], [2k+1]; NULL if p->n_rt_params is 0); out[o] the data of a
 * new .grad for output o, or NULL to have alloc(actx, o) called just
 * before the instruction that writes it (ignored
 * for in-place outputs, whose data is the .grad input's). Temporaries live
 * from their first to their last instruction. Returns 0, or -1 on OOM
 * (error set; instructions before the failure have run: in-place outputs
 * may be updated, as with an eager backward that runs out of memory). */
int gj_jit_plan_exec(const gj_jit_plan *p, void *const *in, const uint64_t *params, void **out,
                     gj_jit_out_alloc alloc, void *actx);
/* Runs a hook instruction: src (contiguous, hs->meta) is the gradient, dst
 * receives the value flowing on. Returns 0, -1 (error set), or 1 to abandon
 * the run (a guard tripped; the caller knows why). */
typedef int (*gj_jit_hook_call)(void *ctx, const gj_jit_hook_instr *hs, const void *src, void *dst);
/* Runs a custom call instruction: src[k] (contiguous, cs->in_meta[k]) are its
 * inputs, dst[k] receive its outputs. Returns 0, -1 or 1 as a hook call. */
typedef int (*gj_jit_custom_call)(void *ctx, const gj_jit_call_instr *cs, void *const *src,
                                  void *const *dst);
/* Called after each group of instructions with the number of instructions
 * done so far (the outputs whose buffers no later instruction uses are
 * final). 0 to go on, -1 to stop the run (error set). */
typedef int (*gj_jit_progress)(void *ctx, int instrs_done);
/* Called before each group of instructions for every program input the
 * group reads: makes input i's bytes present (a remote storage: ZeRO stage
 * 3's parameters, gathered while read) in `epoch` (one per group: what it
 * fetched is not released while the group runs) and returns where they are
 * now, or NULL with an error. */
typedef void *(*gj_jit_input_fetch)(void *ctx, int input, uint64_t epoch);
/* gj_jit_plan_exec with hook instructions run through hook(hctx, ...), call
 * instructions through call(hctx, ...), progress(hctx, ...) after each
 * group and fetch(hctx, ...) before it (any may be NULL; a hook or call
 * instruction without its callback is an error). Returns 0, -1 (error), or
 * 1 (a hook or call asked to abandon the run: temporaries are freed,
 * outputs allocated so far belong to the caller as usual). */
int gj_jit_plan_exec_calls(const gj_jit_plan *p, void *const *in, const uint64_t *params,
                           void **out, gj_jit_out_alloc alloc, void *actx, gj_jit_hook_call hook,
                           gj_jit_custom_call call, gj_jit_progress progress,
                           gj_jit_input_fetch fetch, void *hctx);

/* ------------------------------------------------- user code in a run */

typedef struct gj_jit_runctx gj_jit_runctx;

/* What a compiled path brings to a run that calls user code: the backward's
 * (grads.c) and the training step's (step/calls.c). */
typedef struct gj_jit_run_path {
    const char *name;  /* "run" (a backward) or "step": "... during a compiled <name>" */
    bool stop_on_trip; /* every trip abandons the run (the step: no update is written
                          before its last call); else only a tensor hook's or a custom
                          call's does, and a record_stream is noted and the run goes on */
    /* The live hook that hook reference i of the program names, or NULL. */
    const gj_ag_hook *(*hook)(gj_jit_runctx *hc, int i);
    /* The custom op that call instruction cs calls (*at: its attributes), or
     * NULL when the run's graph has none there. */
    const gj_ag_opdef *(*custom)(gj_jit_runctx *hc, const gj_jit_call_instr *cs,
                                 const gj_ag_attrs **at);
    /* The path's own call instructions (a tape below -1 other than
     * GJ_JIT_CALL_STEP_FWD: a step's reducer gives and takes and its
     * parameters' post-accumulate hooks); NULL: the path makes none. */
    gj_jit_custom_call own;
} gj_jit_run_path;

/* The state of one compiled run that calls user code: its program and
 * input tensors, what the guards compare against, the outputs written so
 * far (a backward's), and the first guard that tripped. */
struct gj_jit_runctx {
    const gj_jit_run_path *path;
    void *own;                   /* the path's own state (the step's gj_jit_step_run) */
    const gj_jit_program *pr;
    const gj_jit_walk *w;        /* a backward's walk (NULL in a step: no leaf outputs) */
    gj_tensor *const *tensors;   /* the run's inputs (borrowed) */
    void **data0;                /* their data pointers when the run started */
    bool remote;                 /* an input's storage is remote (ZeRO stage 3): fetched as
                                    the program reads it */
    gj_tensor **priv;            /* GRAD inputs: the private copy the plan updates */
    gj_rt_meta *leaf_meta;       /* per output: its leaf's dtype and shape at the start */
    const void **leaf_data;      /* per output: its leaf's data pointer at the start */
    const gj_ag_hook **hooks;    /* a backward's: per hook reference, resolved at the start */
    /* writing outputs (grads.c): the next output and hook reference, and
     * what the early writes between instructions need */
    int next_out, next_hook;
    int early_from;              /* instructions after which no hook/call instruction is left */
    gj_tensor **contig, **news;
    bool tripped;                /* a guard tripped */
    bool transient;              /* ... first because user code failed this time (not a
                                    cause that recurs: the key or step stays compiled) */
    gj_ca_reason code;           /* the first cause's class */
    char why[400];               /* the first cause; then "; also: <class>: <message>"
                                    for each later one */
    bool why_full;               /* why[] had no room for a later cause ("...") */
};

/* Records that a guard tripped with class code and a message. The reason
 * is the first cause in program order: the first trip of the run (the
 * guards run after each user call in the order the program makes them;
 * within one call they check a failure, then record_stream, then what the
 * call returned, then the program's tensors: changed by set_, a .grad
 * replaced or given). Later trips are listed in why after "also:". The
 * class and message never decide what the run does: the caller abandons
 * the run on a tensor hook's or custom call's trip (on any trip with
 * path->stop_on_trip), whatever came first. */
void gj_jit_trip(gj_jit_runctx *hc, gj_ca_reason code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The leaf of graph output o (NULL for a gradient gj_grad returns, and in
 * a step, whose outputs are no leaves' .grads). */
gj_tensor *gj_jit_output_leaf(const gj_jit_runctx *hc, int o);

/* After user code `who` ran at instruction `instr`, checks that every
 * tensor the program reads or writes is still the one it was compiled
 * for (guards.c): the inputs (saved tensors, seeds, .grads, a step's
 * tensors), the leaves whose .grad it writes, no .grad given. 0, 1
 * (tripped: abandon) or -1 (error). */
int gj_jit_guard_inputs(gj_jit_runctx *hc, const char *who, int instr);

/* After post-accumulate hook `who` ran once a backward's program is done
 * with the .grads before it (`written` outputs written): a leaf changed by
 * set_, a .grad given to a leaf whose output is not yet written, a .grad
 * of another dtype or shape. These trip but never abandon (guards.c). */
void gj_jit_guard_post(gj_jit_runctx *hc, const char *who, int written);

/* Runs hc->pr's plan (in, params, out, ac as gj_jit_plan_exec) with its
 * hook and call instructions calling user code through hc and its path:
 * tensor hooks and custom ops' C functions on fresh tensors holding copies
 * of the plan's buffers, each followed by the guards; the path's own call
 * instructions through path->own; remote inputs fetched as the program
 * reads them (hc->remote); progress(hc, ...) after each group when not
 * NULL. 0, 1 (a trip abandoned the run: hc says why) or -1 (error set). */
int gj_jit_run_calls(gj_jit_runctx *hc, void *const *in, const uint64_t *params, void **out,
                     gj_jit_outs *ac, gj_jit_progress progress);

/* Calls post-accumulate hook h on leaf inside a program (a step's call of
 * a parameter's hooks, at instruction instr), then the guards after a call
 * (gj_jit_guard_inputs). 0, 1 (tripped: the hook failed, transient, or a
 * guard tripped) or -1 (error). */
int gj_jit_call_post_hook(gj_jit_runctx *hc, const gj_ag_hook *h, gj_tensor *leaf, int instr);

/* Runs post-accumulate hook i of a backward's program (its leaf's .grad is
 * written, and `written` outputs are) and gj_jit_guard_post. 0, or -1 when
 * an error was raised inside the hook (the backward then fails with it, as
 * in eager). */
int gj_jit_run_post_hook(gj_jit_runctx *hc, int i, int written);

/* Copies the first nb bytes of tensor t's elements (contiguous, in its
 * dtype) into dst: what user code returned into a plan's buffer. 0 or -1
 * (out of memory). */
int gj_jit_copy_out(gj_tensor *t, void *dst, size_t nb);

/* The index in hc->pr's plan of the call instruction cs is part of. */
int gj_jit_call_instr_index(const gj_jit_runctx *hc, const gj_jit_call_instr *cs);

#endif /* GJ_JIT_RUN_H */
