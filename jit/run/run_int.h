/* SPDX-License-Identifier: MIT */
/*
 * run_int.h - running a backward's program on the tensors of one backward
 * (grads.c). Internal to jit/run/.
 */
#ifndef GJ_JIT_RUN_INT_H
#define GJ_JIT_RUN_INT_H

#include "jit/run/run.h"
#include "jit/jit.h"

/* What a gj_grad asks for (NULL for a backward): the inputs, and where
 * their gradients go (new references, NULL where none reaches). */
typedef struct gj_jit_grad_req {
    int n_inputs;
    gj_tensor *const *inputs;
    gj_tensor **grads_out;
} gj_jit_grad_req;

/* Runs program pr on the tensors of this backward. Returns 0 (gradients
 * written; hc->tripped tells whether a guard tripped after a post hook or a
 * record_stream), 1 (fallback: nothing written, reason in why), 2 (a guard
 * tripped in a tensor hook: nothing written, hooks ran, reason in hc) or -1
 * (error set, nothing written). A gj_grad's program (ret_out non-NULL)
 * writes no .grad: on 0, ret_out[o] receives output o as a new tensor. */
int gj_jit_run_program(gj_jit_program *pr, const gj_jit_walk *w, gj_tensor *const *tensors,
                       char *why, size_t why_cap, gj_jit_runctx *hc, gj_tensor **ret_out);

/* The input tensors of program pr for this walk, from canonical origins.
 * tensors[] receives borrowed pointers. false if an origin is missing. */
bool gj_jit_inputs_from_walk(const gj_jit_program *pr, const gj_jit_walk *w,
                             gj_tensor *const *seeds, gj_tensor **tensors);

/* Gives the gradients of a gj_grad's run (outs[o]: output o, a reference
 * each, consumed) to the requested inputs: an edge requested twice gets
 * the same tensor with one more reference. */
void gj_jit_hand_out(const gj_jit_program *pr, const gj_jit_grad_req *gr, gj_tensor **outs);

/* Without retain_graph, frees the saved tensors of what the engine ran: in
 * backward mode every node of the roots' graph, in gj_grad mode the needed
 * op nodes of the walk (the engine's gj_grad frees only those). */
void gj_jit_release_graph(const gj_jit_walk *w, int n_roots, gj_tensor *const *roots);

/* Remembers prog as this thread's last program (gj_jit_last_program_info). */
void gj_jit_note_last_program(const gj_jit_program *prog);

#endif /* GJ_JIT_RUN_INT_H */
