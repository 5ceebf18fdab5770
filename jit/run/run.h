/* SPDX-License-Identifier: MIT */
/*
 * run.h - the run stage's entry (guards.c): every check a cached program
 * needs before and during a run, for the backward and the training step
 * alike (an input's meta and layout against the program's, memory two
 * views share), the outputs a run allocates, and user code called by a
 * compiled run (tensor hooks, custom op functions, post-accumulate hooks)
 * with the guards that check, after each call, that the program still
 * computes what eager would.
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

/* ------------------------------------------------- user code in a run */

/* The state of one compiled run of a backward: its program, walk and
 * input tensors, what the guards compare against, the outputs written so
 * far, and the first guard that tripped. */
typedef struct gj_jit_runctx {
    const gj_jit_program *pr;
    const gj_jit_walk *w;
    gj_tensor *const *tensors;   /* the run's inputs (borrowed) */
    void **data0;                /* their data pointers when the run started */
    gj_tensor **priv;            /* GRAD inputs: the private copy the plan updates */
    gj_rt_meta *leaf_meta;       /* per output: its leaf's dtype and shape at the start */
    const void **leaf_data;      /* per output: its leaf's data pointer at the start */
    const gj_ag_hook **hooks;    /* per hook reference, resolved at the start */
    /* writing outputs (run.c): the next output and hook reference, and
     * what the early writes between instructions need */
    int next_out, next_hook;
    int early_from;              /* instructions after which no hook/call instruction is left */
    gj_tensor **contig, **news;
    bool tripped;                /* a guard tripped */
    bool transient;              /* ... first because user code failed this time (not a
                                    cause that recurs: the key stays compiled) */
    gj_ca_reason code;           /* the first cause's class */
    char why[400];               /* the first cause; then "; also: <class>: <message>"
                                    for each later one */
    bool why_full;               /* why[] had no room for a later cause ("...") */
} gj_jit_runctx;

/* Records that a guard tripped with class code and a message. The reason
 * is the first cause in program order: the first trip of the run (the
 * guards run after each user call in the order the program makes them;
 * within one call they check a failure, then record_stream, then the
 * program's tensors: changed by set_, a .grad replaced or given). Later
 * trips are listed in why
 * after "also:". The class and message never decide what the run does:
 * the caller abandons the run on a tensor hook's or custom call's trip,
 * whatever came first. */
void gj_jit_trip(gj_jit_runctx *hc, gj_ca_reason code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The leaf of graph output o (NULL for a gradient gj_grad returns). */
gj_tensor *gj_jit_output_leaf(const gj_jit_runctx *hc, int o);

/* Trips GJ_CA_SET_MISMATCH if user code `who` changed the dtype, shape or
 * storage of a leaf whose .grad the program writes. 1 if it tripped, else
 * 0. */
int gj_jit_guard_leaves(gj_jit_runctx *hc, const char *who);

/* gj_jit_hook_call of a run (program.h): calls the tensor hook of hook
 * instruction hs on a fresh tensor holding a copy of src, copies the value
 * flowing on into dst, then runs the guards. 0, 1 (abandon: tripped) or
 * -1 (error set). vctx is the gj_jit_runctx. */
int gj_jit_call_tensor_hook(void *vctx, const gj_jit_hook_instr *hs, const void *src, void *dst);

/* Fresh contiguous tensors ts[0..cs->n_in) holding copies of call
 * instruction cs's input buffers src[] (of cs->in_meta): what user code
 * gets instead of a plan's buffers. 0, or -1 on OOM (the ones made so far
 * are in ts for the caller to release). */
int gj_jit_call_inputs(const gj_jit_call_instr *cs, void *const *src, gj_tensor **ts);

/* gj_jit_custom_call of a run: runs the custom op's backward (or, for a
 * checkpoint region's recomputation, its forward) C function on fresh
 * tensors holding copies of src and copies its results into dst, then
 * runs the guards. 0, 1 or -1 as above. */
int gj_jit_call_custom(void *vctx, const gj_jit_call_instr *cs, void *const *src,
                       void *const *dst);

/* Runs post-accumulate hook i of the program (its leaf's .grad is written,
 * and `written` outputs are) and its guards, which trip but never abandon
 * (the .grads written so far are final). 0, or -1 when an error was raised
 * inside the hook (the backward then fails with it, as in eager). */
int gj_jit_run_post_hook(gj_jit_runctx *hc, int i, int written);

#endif /* GJ_JIT_RUN_H */
