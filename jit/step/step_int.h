/* SPDX-License-Identifier: MIT */
/*
 * step_int.h - the compiled training step inside jit/: forward, backward and
 * the optimizer's update of one step as one program (variants.c runs it,
 * step_capture.c builds its graph from a trace). Internal to jit/step/;
 * the frontend reaches it through jit.h.
 *
 * A step program's graph inputs have role GJ_JIT_IN_STEP, with the kind of
 * tensor in `node` and its index in `slot` (the enum below). Its outputs
 * are, in order: the loss (a new 0-d tensor); per parameter that gets a
 * gradient, when the step keeps .grads, that gradient (a new tensor); and
 * every parameter and optimizer state the update writes, in place into
 * their own input (grad_input).
 */
#ifndef GJ_JIT_STEP_H
#define GJ_JIT_STEP_H

#include "jit/cache/cache.h"
#include "jit/jit.h"
#include "jit/run/run.h"

enum {
    GJ_JIT_STEPIN_INPUT = 0,  /* step input #slot */
    GJ_JIT_STEPIN_PARAM = 1,  /* parameter #slot */
    GJ_JIT_STEPIN_STATE1 = 2, /* the rule's state 0 of parameter #slot */
    GJ_JIT_STEPIN_STATE2 = 3, /* its state 1 */
    GJ_JIT_STEPIN_CONST = 4,  /* constant #slot of the trace */
    GJ_JIT_STEPIN_HYPER = 5,  /* the run's scalars: f64 [n_params * GJ_AG_OPT_MAX_HYPER + 1] */
};

/* The ret[] entries of a step program with n parameters (gj_jit_capture_step). */
static inline int gj_jit_step_n_ret(int n, int n_extra) { return 2 * n + 1 + n_extra; }

/* rt_tape of a dropout mask whose seed is the run's and whose offset is the
 * run's first counter plus rt_node (the step's own draws, in order). */
#define GJ_JIT_RT_STEP (-2)

/* What a step's capture needs: the trace of its forward, the loss (its
 * autograd graph alive), the optimizer (gj_jit_opt) and the options. */
typedef struct gj_jit_step_spec {
    const gj_ag_trace *tr;
    int loss_slot;
    gj_tensor *loss;
    const gj_jit_opt *opt;
    bool keep_grads, eval;
    int n_extra;               /* leaves outside the optimizer that require grad */
    gj_tensor *const *extra;   /* (step inputs or constants): their gradients are outputs */
    const gj_jit_reducer *red; /* NULL, or the reducer between backward and update */
    const int *red_of;         /* with red: per parameter, its index in red or -1 */
} gj_jit_step_spec;

/* Builds the step's graph into cap (initialised here): the trace's forward
 * replayed, the loss, the gradients of the parameters (w: the gj_grad walk
 * of the loss with respect to the parameters that require grad; NULL for
 * an eval step), with a reducer each given to it (GJ_JIT_CALL_GIVE, in its
 * order, as soon as final) and taken back reduced (GJ_JIT_CALL_TAKE, right
 * before that parameter's update), and their update. cap->ret receives 2 * n + 1 + n_extra
 * ints: per parameter the output holding its kept gradient (or -1), then 1
 * if the program updates it, then the output holding the gradients' norm
 * of a clipping step (or -1), then per extra leaf the output holding its
 * gradient as the backward made it (or -1: none reaches it). 0, or -1 with
 * cap->reason (and cap->permanent) set. */
int gj_jit_capture_step(gj_jit_capture *cap, const gj_jit_walk *w, const gj_jit_step_spec *s);

/* ------------------------------------------------ a run's calls (calls.c) */

/* A custom op call instruction of a step program and the op it calls:
 * tape GJ_JIT_CALL_STEP_FWD (the forward of trace entry `node`), -1 (the
 * backward of the walk's node `node`) or >= 0 (the forward of op `tape` of
 * checkpoint node `node`'s tape, recomputed). */
typedef struct gj_jit_step_custom {
    int tape, node;
    const gj_ag_opdef *op; /* (custom ops live until exit) */
    gj_ag_attrs attrs;
} gj_jit_step_custom;

/* One run of a step program with call instructions (user code: tensor
 * hooks on leaves, custom ops, parameters' post-accumulate hooks; a
 * reducer's gives and takes) or remote inputs. hc is the run's shared
 * state (run.h): the caller sets its program (pr), its inputs (tensors:
 * per program input its tensor in this run; data0: their data when the
 * run started) and remote; gj_jit_step_exec the rest. After a trip, hc
 * says why (tripped, code, why; !transient: for good, the step turns
 * eager). */
typedef struct gj_jit_step_run {
    gj_jit_runctx hc;
    const gj_jit_step_call *call;
    const gj_jit_step_custom *customs; /* the program's custom op calls */
    int n_customs;
    gj_tensor *const *hook_leaf; /* per hook of the program: the leaf it is on */
} gj_jit_step_run;

/* Runs the plan of sr->hc.pr with its calls: 0, 1 (user code tripped a
 * guard: the run stopped before any update, sr->hc says why; the caller
 * runs the step eagerly) or -1 (error set). With a reducer, its end() is
 * called whatever the result. */
int gj_jit_step_exec(gj_jit_step_run *sr, const uint64_t *params, void **out, gj_jit_outs *ac);

#endif /* GJ_JIT_STEP_H */
