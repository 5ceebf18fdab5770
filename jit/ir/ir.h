/* SPDX-License-Identifier: MIT */
/*
 * ir.h - the graph IR of the compiled path (internal to jit/).
 *
 * A gj_jit_graph is a captured backward: a list of nodes in emission order
 * (which is a topological order), each one primitive instruction (a
 * gj_rt_inst, never a composite) reading values and producing values. A
 * value is either an output of a node or a graph input (a real tensor at run
 * time: a saved tensor, a seed, an existing .grad). Graph outputs are leaf
 * gradients: each names the accumulate node (by canonical index, see key.c)
 * whose leaf receives it and whether it is added in place into an existing
 * .grad (which is then also a graph input) or becomes a new .grad.
 *
 * Invariants:
 *   - Value ids are dense 0..n_values-1; node ids dense 0..n_nodes-1.
 *   - Every input id of node i is a value defined by a graph input or by a
 *     node j < i (emission order is topological).
 *   - values[v].meta is what gj_rt_infer gave for the producing instruction
 *     (or the tensor's meta for a graph input).
 *   - Nothing here holds a tensor or a pointer that differs between runs:
 *     the graph of a cached program is reused for every later backward.
 */
#ifndef GJ_JIT_IR_H
#define GJ_JIT_IR_H

#include "jit/base/base.h"

#include <stdio.h>

/* What a graph input is at run time. */
typedef enum gj_jit_role {
    GJ_JIT_IN_SAVED = 0, /* saved tensor #slot of canonical node #node */
    GJ_JIT_IN_SEED = 1,  /* seed of root #slot */
    GJ_JIT_IN_GRAD = 2,  /* existing .grad of the leaf of accumulate node #node */
    GJ_JIT_IN_OTHER = 3, /* a constant of unknown origin (needs a re-capture per run) */
    GJ_JIT_IN_STEP = 4,  /* a training step's tensor: kind #node (step_int.h), index #slot */
} gj_jit_role;

typedef struct gj_jit_input {
    gj_jit_role role;
    int value; /* the value it defines */
    int node;  /* canonical node index (SAVED, GRAD), -1 otherwise */
    int slot;  /* saved slot (SAVED) or root index (SEED) */
    /* The layout the program reads it in, in elements from the view's first
     * element (gj_jit_input_strides): the tensor's own strides for SAVED,
     * SEED and OTHER inputs, read in place; contiguous for GRAD (updated
     * through a contiguous copy when the .grad is strided). */
    int64_t strides[GJ_MAX_DIMS];
} gj_jit_input;

typedef struct gj_jit_output {
    int value;      /* gradient value (in the leaf's dtype, or .grad's for in place) */
    int acc_node;   /* canonical index of the accumulate node; -1: a gradient that
                       gj_grad returns (a new tensor, no .grad touched) */
    int grad_input; /* in place into this graph input's tensor (.grad), or -1: new .grad */
} gj_jit_output;

typedef struct gj_jit_node {
    gj_rt_inst inst; /* inst.n_in inputs */
    int rt_node;     /* DROPOUT_MASK: canonical node whose attrs hold seed and
                        offset at run time (-1: the constants of inst) */
    int rt_tape;     /* DROPOUT_MASK with rt_node >= 0: -1 (the node's own attrs),
                        or the op position in checkpoint node #rt_node's tape */
    int hook;        /* >= 0: an opaque call of tensor hook g->hooks[hook]; inst is
                        then COPY (the value flowing on has the input's meta). Never
                        merged by CSE nor removed by DCE. -1: an ordinary node */
    int custom;      /* >= 0: an opaque call of the backward of the custom op at
                        canonical node #custom (gj_jit_graph_add_custom): inputs
                        are its output gradients then its saved tensor arguments,
                        outputs the gradients of its inputs that are needed; inst
                        is then COPY with n_in set and means nothing else. Never
                        merged by CSE nor removed by DCE. -1: an ordinary node */
    int custom_tape;      /* custom call: -1 (node #custom is the custom op's node), or
                             op #custom_tape of checkpoint node #custom's tape */
    uint32_t custom_args; /* custom call: bit i set if output j (j-th set bit) is the
                             gradient of tensor argument i */
    bool custom_fwd;      /* custom call of the op's forward instead (a checkpoint
                             region's recomputation): inputs are its tensor
                             arguments, outputs its outputs; custom_args is 0 */
    int in[GJ_RT_MAX_INPUTS];
    int n_out;
    int out[GJ_RT_MAX_OUTPUTS];
    /* CSE merges only nodes of one phase: a training step's forward is
     * phase 0 and its backward phase 1 (a memory budget's recomputations
     * 2 and up, one phase per place they run, plan/remat.c), so a value a checkpoint region
     * recomputes in the backward is never replaced by the forward's (which
     * would keep it alive across the step, against the region's policy) */
    int phase;
    /* A training step's memory budget (plan/remat.c): remat marks a forward
     * node computed again in the backward (phase 1) instead of keeping its
     * value; apart marks a node after the forward (phase 1) that the
     * planner never fuses into a kernel with forward nodes (set on every
     * such node of a budgeted graph: a backward value computed in the
     * forward would be kept across the step, out of the budget's reach);
     * pinned marks a forward op of a checkpoint region, whose values the
     * region's policy keeps or recomputes and the budget never touches */
    bool remat, apart, pinned;
} gj_jit_node;

typedef struct gj_jit_value {
    gj_rt_meta meta;
    int node;  /* producing node, or -1 for a graph input */
    int index; /* output number of the node, or graph input index */
} gj_jit_value;

/* A hook the program calls, named by canonical position so that a cached
 * program finds it again in a later backward: the j-th live hook that
 * gj_ag_node_hooks lists for output k of canonical node `node`. */
typedef struct gj_jit_hookref {
    int node, k, j;
    bool post; /* a post-accumulate hook (run after its leaf's .grad is written) */
    int n_out; /* post: graph outputs recorded before it (.grads eager wrote by then) */
} gj_jit_hookref;

typedef struct gj_jit_graph {
    gj_jit_node *nodes;
    int n_nodes, cap_nodes;
    gj_jit_value *values;
    int n_values, cap_values;
    gj_jit_input *inputs;
    int n_inputs, cap_inputs;
    gj_jit_output *outputs;
    int n_outputs, cap_outputs;
    gj_jit_hookref *hooks; /* every hook call, in the engine's order */
    int n_hooks, cap_hooks;
    /* For messages only: the accumulate nodes' leaves by canonical index
     * (borrowed from the capture's walk, valid while it lives), so dumps can
     * quote a leaf's gj_tensor_set_name. NULL: none. */
    gj_ag_node *const *walk_nodes;
    int n_walk_nodes;
} gj_jit_graph;

void gj_jit_graph_init(gj_jit_graph *g);
void gj_jit_graph_free(gj_jit_graph *g);

/* Adds a graph input of meta m (contiguous strides; see
 * gj_jit_input_strides); returns its value id or -1 (OOM, error set). */
int gj_jit_graph_add_input(gj_jit_graph *g, const gj_rt_meta *m, gj_jit_role role, int node,
                           int slot);
/* The normalised strides of t as a graph input reads it: t's strides, with
 * every size-1 dim given its contiguous stride (never used to address, so
 * it must not make two equal layouts look different). */
void gj_jit_input_strides(const gj_tensor *t, int64_t *strides);
/* Whether strides (over m's shape) are m's contiguous ones. */
bool gj_jit_strides_contiguous(const gj_rt_meta *m, const int64_t *strides);
/* Adds a node for inst on inputs in[0..inst->n_in) (value ids); output metas
 * come from gj_rt_infer. Writes the output value ids to outs (may be NULL).
 * Returns the number of outputs or -1 with the error set. */
int gj_jit_graph_add_node(gj_jit_graph *g, const gj_rt_inst *inst, const int *in, int *outs);
/* Adds a graph output. 0 or -1 (OOM). */
int gj_jit_graph_add_output(gj_jit_graph *g, int value, int acc_node, int grad_input);

/* Appends an opaque custom-op backward call (node.custom = rt_node, the
 * canonical index, node.custom_tape = tape; node.custom_args = args, one
 * bit per output): reads in[0..n_in), defines n_out values of metas
 * out_meta, their ids to outs. Returns n_out or -1 (error set). */
int gj_jit_graph_add_custom(gj_jit_graph *g, int rt_node, int tape, uint32_t args, int n_in,
                            const int *in, int n_out, const gj_rt_meta *out_meta, int *outs);

/* Appends a hook reference; returns its index or -1 (OOM). */
int gj_jit_graph_add_hook(gj_jit_graph *g, const gj_jit_hookref *h);
/* Copies src's hook table into dst (which has none). 0 or -1 (OOM). */
int gj_jit_graph_copy_hooks(gj_jit_graph *dst, const gj_jit_graph *src);

/* Prints the graph, one op a line with shapes and dtypes. */
void gj_jit_graph_print(const gj_jit_graph *g, FILE *f);
/* "f32[2, 3]" into buf. Returns buf. */
char *gj_jit_fmt_meta(char *buf, size_t cap, const gj_rt_meta *m);
/* Whether two instructions are the same operation (every attribute). */
bool gj_jit_inst_equal(const gj_rt_inst *a, const gj_rt_inst *b);
bool gj_jit_meta_equal(const gj_rt_meta *a, const gj_rt_meta *b);

/* Primitive classes. */
bool gj_jit_prim_is_elementwise(gj_rt_prim p); /* unary, binary, WHERE, COPY */
bool gj_jit_prim_is_composite(gj_rt_prim p);   /* SOFTMAX .. CE_BWD */
bool gj_jit_prim_is_movement(gj_rt_prim p);    /* RESHAPE, PERMUTE, EXPAND, SLICE */

/* ------------------------------------------------------------- passes */

/* Common-subexpression elimination then dead-code elimination: rewrites g in
 * place into an equivalent graph with no duplicate and no unused node
 * (inputs are kept, in order, even when unused). Also legalises: a bf16
 * MATMUL becomes CAST(f32) of both operands, an f32 MATMUL and a CAST back
 * to bf16 (the eager kernel's numerics). 0 or -1 (OOM). */
int gj_jit_pass_cse_dce(gj_jit_graph *g);

/* Graph rebuilds (passes.c), for the passes that make a new graph from an
 * old one: every input of g in order, with role and strides (their new ids
 * into newid); node n of g with its inputs renamed to args, keeping its
 * origin, phase and marks (its outputs' new ids into newid); then g's
 * outputs (renamed through newid) and hook table, ng replacing g (ng left
 * empty; g unchanged on failure). Each 0 or -1 (OOM). */
int gj_jit_graph_copy_inputs(gj_jit_graph *ng, const gj_jit_graph *g, int *newid);
int gj_jit_graph_copy_node(gj_jit_graph *ng, const gj_jit_graph *g, const gj_jit_node *n,
                           const int *args, int *newid);
int gj_jit_graph_finish_rebuild(gj_jit_graph *g, gj_jit_graph *ng, const int *newid);

/* Sums of PADs: ADD trees whose leaves are single-use PADs of pieces into
 * disjoint ranges of one axis (the backward of several narrows of one
 * tensor, e.g. the q, k, v heads of a fused qkv) become one CAT of the
 * pieces (each + 0.0, as the sum of pads makes -0.0 into +0.0) and zero
 * gaps: one buffer written in place instead of a zero-filled buffer per
 * piece and a summing pass. Dead PADs stay for the next DCE. Sets
 * *changed. 0 or -1 (OOM). */
int gj_jit_pass_pad_sums(gj_jit_graph *g, bool *changed);

/* The most tensor inputs an opaque call node (a custom op's forward or
 * backward) takes: what a plan's CALL instruction holds. */
#define GJ_JIT_CALL_MAX_IN 10
/* custom_tape of a training step's reducer calls (jit.h, gj_jit_reducer):
 * node.custom is then the optimizer's parameter index. GIVE reads that
 * parameter's gradient (or nothing: no gradient) and has no output; TAKE
 * has no input and outputs the reduced gradient. */
#define GJ_JIT_CALL_GIVE (-2)
#define GJ_JIT_CALL_TAKE (-3)
/* ... and of its call of a parameter's post-accumulate hooks: node.custom
 * the parameter; its input the gradient as .grad holds it, its output the
 * .grad the hooks leave (the reducer's own hook among them is a give). */
#define GJ_JIT_CALL_POST (-4)
/* ... and of its call of a custom op's forward (the step function called
 * it): node.custom the op's entry in the step's trace. */
#define GJ_JIT_CALL_STEP_FWD (-5)

#endif /* GJ_JIT_IR_H */
