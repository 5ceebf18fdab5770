/* SPDX-License-Identifier: MIT */
/*
 * capture.h - the structural key of a backward (key.c) and the recording
 * builder that captures it as a gj_jit_graph (record.c). Internal to jit/.
 *
 * The walk visits the autograd graph reachable from the roots breadth first
 * (roots in order, then each node's edges in input order) and numbers nodes
 * in discovery order: the "canonical index". The key is a text
 * serialization of everything the backward's computation depends on, in
 * canonical order, and never an address; its 128-bit hash indexes the cache.
 * The walk also keeps, for this process only, the maps from node pointers
 * and saved-tensor pointers back to canonical positions, so a cached program
 * can find its run-time inputs without a new capture.
 */
#ifndef GJ_JIT_CAPTURE_H
#define GJ_JIT_CAPTURE_H

#include "jit/ir/ir.h"

typedef struct gj_jit_walk {
    gj_ag_node **nodes; /* canonical order; borrowed (kept alive by the roots) */
    bool *needed;       /* the engine runs this node (an accumulate is reachable) */
    int n, cap;
    int64_t *slots; /* open addressing: node pointer -> index + 1 */
    int64_t nslots;
    struct gj_jit_saved_slot {
        const gj_tensor *t; /* NULL: empty */
        int node, slot;     /* node -1: ambiguous (the same tensor saved twice) */
    } *saved;
    int64_t nsaved_slots;
    gj_ag_node **root_refs; /* references taken by gj_ag_edge_of (released by free) */
    int n_roots;
    char *key; /* canonical serialization, NUL-terminated */
    size_t key_len, key_cap;
    uint64_t hash[2];
    uint64_t site[2]; /* the "call site" (recompile limit): the key without shapes
                         and attribute values -- op names, edges, creation ranks,
                         dtypes and ranks of every meta -- hashed */
    int n_hooks;      /* hooks on the graph's nodes and leaves (in the key) */
    /* gj_grad mode (grad_mode): the requested inputs, borrowed, and per
     * input the canonical index of its gradient edge's node (-1: not
     * reachable from the roots) and the edge's input_nr. needed[] then
     * marks what the engine runs in gj_grad mode (a requested input's node
     * is reachable), and the key holds these edges, not the leaves' .grads
     * (a gj_grad touches none). */
    bool grad_mode;
    int n_req;
    gj_tensor *const *req_inputs;
    int *req_node, *req_nr;
    gj_ag_node **req_refs; /* references taken by gj_ag_edge_of (released by free) */
    bool invalid;     /* eager would refuse this backward (freed graph, stale saved tensor) */
    char reason[256]; /* why, when invalid */
} gj_jit_walk;

/* Walks the graph of roots (borrowed) with seeds (borrowed, entries may be
 * NULL: ones). Fills w (caller frees with gj_jit_walk_free even on failure).
 * Returns 0, or -1 on OOM (error set). A graph eager would reject sets
 * w->invalid instead of failing. */
int gj_jit_walk_build(gj_jit_walk *w, int n_roots, gj_tensor *const *roots,
                      gj_tensor *const *seeds);
/* The walk of a gj_grad of roots with respect to inputs[0..n_inputs)
 * (borrowed, kept in w for the capture): as gj_jit_walk_build, in gj_grad
 * mode (see grad_mode). An input that does not require grad makes the walk
 * invalid (the eager engine reports it). */
int gj_jit_walk_build_grad(gj_jit_walk *w, int n_roots, gj_tensor *const *roots,
                           gj_tensor *const *seeds, int n_inputs, gj_tensor *const *inputs);
void gj_jit_walk_free(gj_jit_walk *w);
/* Canonical index of node, or -1. */
int gj_jit_walk_find(const gj_jit_walk *w, const gj_ag_node *node);
/* Canonical origin of a saved tensor pointer: 0 and (node, slot), or -1. */
int gj_jit_walk_saved_origin(const gj_jit_walk *w, const gj_tensor *t, int *node, int *slot);

/* Mask of the integer attributes of op that are run-time values (left out
 * of the key and fed to the compiled program at each run). */
uint32_t gj_jit_runtime_attrs(const gj_ag_opdef *op);
/* Where the dropout with this seed and offset lives: the canonical index
 * of its node and *tape = -1, or of the checkpoint node whose tape holds it
 * at op position *tape; -1 if none. */
int gj_jit_walk_find_dropout(const gj_jit_walk *w, uint64_t seed, uint64_t offset, int *tape);
/* The run-time (seed, offset) of the dropout at (node, tape) of w (as
 * found by gj_jit_walk_find_dropout in the run that compiled): 0, or -1 if
 * there is no dropout there in this graph. */
int gj_jit_dropout_params(const gj_jit_walk *w, int node, int tape, uint64_t out[2]);

/* keydiff.c. How far apart two keys are: the number of lines that differ
 * (lines past the shorter key's end count too); 0 if equal. */
int gj_jit_key_distance(const char *a, size_t na, const char *b, size_t nb);
/* Writes to out[cap] (always terminated) the first difference of new_key
 * from old_key, in the graph's words: the node (canonical index, op name,
 * creation rank; or the tape op of a checkpoint node), the role of the
 * differing part (input k, saved tensor k, .grad, attribute) and its old and
 * new values ("size mismatch at dim 0: expected 32, actual 48"). Returns
 * gj_jit_key_distance of the two. */
int gj_jit_key_diff(const char *old_key, size_t old_len, const char *new_key, size_t new_len,
                    char *out, size_t cap);


/* ------------------------------------------------------------ capture */

typedef struct gj_jit_capture {
    gj_jit_graph g;
    gj_tensor **tensors; /* per graph input: the real tensor of this run (borrowed) */
    int cap_tensors;
    bool unknown_origin; /* some input is GJ_JIT_IN_OTHER */
    /* gj_grad mode: per requested input of the walk, the graph output that
     * holds its gradient (the first request of its edge names it; a second
     * request of the same edge shares it), or -1 when no gradient reaches
     * it. Graph outputs are then these gradients (acc_node -1). */
    int *ret;
    bool permanent;      /* the failure depends on the key only: remember eager-only */
    gj_ca_reason code;   /* the failure's class (GJ_CA_OTHER unless told) */
    char reason[256];    /* why the capture failed */
} gj_jit_capture;

/* Runs the engine's traversal with the recording builder (retain_graph, so
 * nothing is freed) and fills cap; in gj_grad mode (w->grad_mode) the
 * traversal of gj_grad (nothing accumulated, post-accumulate hooks not
 * called), whose gradients become the graph's outputs (cap->ret). Returns 0, or -1 with cap->reason set
 * (and the error message of the failing call). Caller frees with
 * gj_jit_capture_free in every case. */
int gj_jit_capture_run(gj_jit_capture *cap, const gj_jit_walk *w, int n_roots,
                       gj_tensor *const *roots, gj_tensor *const *seeds);
void gj_jit_capture_free(gj_jit_capture *cap);

/* The recording builder itself (record.c), for captures other than a
 * backward's (a training step's: step_capture.c). A value of it is a graph
 * value id + 1 as a pointer (gj_jit_rec_val, gj_jit_rec_id). resolve, when
 * set, gives the value of every tensor the formulas ask for as a constant
 * (a saved tensor: its value id, or -1 with the capture's reason set);
 * dropout, when set, says where a dropout mask's seed and offset come from
 * at run time (the graph node's rt_node and rt_tape; 0, or -1 with the
 * reason set). */
typedef struct gj_jit_recorder {
    gj_ag_builder b; /* first: the builder pointer is the recorder pointer */
    gj_jit_capture *cap;
    const gj_jit_walk *w;
    int (*resolve)(void *ctx, gj_tensor *t);
    int (*dropout)(void *ctx, uint64_t seed, uint64_t offset, int *rt_node, int *rt_tape);
    void *ctx;
    int phase; /* of the nodes recorded from now on (gj_jit_node.phase) */
} gj_jit_recorder;
static inline gj_val *gj_jit_rec_val(int id) { return (gj_val *)(uintptr_t)((uintptr_t)id + 1); }
static inline int gj_jit_rec_id(gj_val *v) { return (int)((uintptr_t)v - 1); }
/* A recorder of cap (initialised by the caller: gj_jit_graph_init) over
 * walk w, without resolve and dropout. */
void gj_jit_recorder_init(gj_jit_recorder *r, gj_jit_capture *cap, const gj_jit_walk *w);
/* A graph input for tensor t (role, node, slot as gj_jit_input), read in
 * place in t's layout (GRAD: contiguous); its value id, or -1 (OOM). */
int gj_jit_recorder_input(gj_jit_recorder *r, gj_tensor *t, gj_jit_role role, int node,
                          int slot);

#endif /* GJ_JIT_CAPTURE_H */
