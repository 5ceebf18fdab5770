/* SPDX-License-Identifier: MIT */
/*
 * ag.h - the eager autograd engine: builders, op definitions, graph nodes,
 * and the backward traversal.
 *
 * One formula, two interpreters: every op's forward and backward is written
 * once against gj_ag_builder. The eager builder (ag_eager.c) runs each
 * instruction at once through gj_rt_exec; the recording builder of jit/
 * records it. A gj_val is opaque: for the eager builder it IS a gj_tensor*.
 *
 * Graph invariants:
 *   - A tensor that requires grad and is not a leaf has meta->node (its
 *     grad_fn) and meta->output_nr. A leaf that requires grad gets an
 *     accumulate node on first use (meta->acc, a weak pointer cleared when
 *     the node dies); the node holds a strong reference to the leaf.
 *   - Nodes hold strong references to the nodes of their inputs' edges, so a
 *     tensor keeps its whole history alive; saved tensors are detached
 *     aliases (no autograd meta), so no reference cycle exists.
 *   - A saved tensor remembers its storage's version at save time; backward
 *     refuses to use it if the version moved.
 */
#ifndef GJ_AG_H
#define GJ_AG_H

#include "../runtime/rt.h"

/* -------------------------------------------------------------- builder */

typedef struct gj_val gj_val; /* opaque value of a builder */
typedef struct gj_ag_builder gj_ag_builder;
struct gj_ag_opdef; /* below: named by call_custom_fwd */
struct gj_ag_attrs;
typedef struct gj_ag_hook gj_ag_hook; /* a tensor or post-accumulate hook (below) */
typedef struct gj_ag_node gj_ag_node; /* a graph node (below) */

struct gj_ag_builder {
    /* Runs or records inst on inputs in[0..inst->n_in); writes inst's
     * outputs to outs. Returns the number of outputs or -1 (error set).
     * Values returned belong to the builder until the end of the current
     * node's formula (end_node); keep one with `keep`. */
    int (*emit)(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in, gj_val **outs);
    /* Shape and dtype of a value. */
    void (*meta)(gj_ag_builder *b, gj_val *v, gj_rt_meta *out);
    /* A real tensor as a value of this builder (eager: itself; recorder: a
     * graph input). The tensor is borrowed for the builder's lifetime. */
    gj_val *(*constant)(gj_ag_builder *b, gj_tensor *t);
    /* Take/drop an extra reference to v beyond the current node's formula. */
    void (*keep)(gj_ag_builder *b, gj_val *v);
    void (*drop)(gj_ag_builder *b, gj_val *v);
    /* End of one node's formula (the engine calls it after each node):
     * every value not kept is released. */
    void (*end_node)(gj_ag_builder *b);
    /* Leaf gradient g (already summed over all paths, in the leaf's dtype)
     * flows into leaf's .grad: eager sets .grad (a new tensor, or g cast to
     * the existing .grad's dtype and added in place); the recorder makes it
     * a graph output accumulated into .grad. Returns 0 or -1. */
    int (*accumulate)(gj_ag_builder *b, gj_tensor *leaf, gj_val *g);
    bool records; /* true for the recording builder */
    /* Appended by helper "hooks" (autograd/hooks.c). Runs tensor hook h on
     * the gradient grad (a value of b): returns the value to use from now
     * on -- grad itself if the hook kept it, else a replacement of grad's
     * shape and dtype belonging to the current step -- or NULL with the
     * error set. A builder that leaves call_hook (call_post_hook) NULL
     * cannot run a graph with tensor (post-accumulate) hooks:
     * gj_ag_run_backward refuses it before producing any gradient, with the
     * error "hooks: this builder cannot run hooks". */
    gj_val *(*call_hook)(gj_ag_builder *b, const gj_ag_hook *h, gj_val *grad);
    /* Runs post-accumulate hook h on leaf once its .grad was written. 0/-1. */
    int (*call_post_hook)(gj_ag_builder *b, const gj_ag_hook *h, gj_tensor *leaf);
    /* Appended by helper "customjit": records an opaque call of the
     * backward of custom op node `node` (the op's node, or the temporary
     * node of a checkpoint tape's backward; a recording builder only: the
     * eager builder leaves it NULL and runs the C function itself). gout:
     * the n_out output gradients (NULL: none), saved: the node's saved
     * tensor arguments as values of b, needs: which inputs want a gradient;
     * gin[i] receives a value for each needed input. 0 or -1 (error set).
     * A recording builder without it cannot capture custom ops. */
    int (*call_custom)(gj_ag_builder *b, gj_ag_node *node, gj_val *const *gout,
                       gj_val *const *saved, const bool *needs, gj_val **gin);
    /* Records an opaque call of the forward of custom op `op` (attributes
     * a) on in[0..n_in), its tensor arguments (a recording builder only:
     * how a checkpoint region's recomputation replays a custom op, whose
     * forward is a C function); outs[] receive its outputs. Returns the
     * number of outputs, or -1 (error set). A recording builder without it
     * cannot recompute custom ops. */
    int (*call_custom_fwd)(gj_ag_builder *b, const struct gj_ag_opdef *op,
                           const struct gj_ag_attrs *a, int n_in, gj_val *const *in,
                           gj_val **outs);
    /* Appended for the compiled step. In gj_grad mode (nothing accumulated),
     * called once for each node an input's gradient is taken from (a
     * requested leaf's accumulate node) when its gradients are complete,
     * after its tensor hooks: the moment an eager backward writes the
     * leaf's .grad and runs its post-accumulate hooks. grads: the node's
     * output gradients (entries NULL: none reached it). NULL: not called.
     * 0, or -1 (error set: the traversal fails). */
    int (*captured)(gj_ag_builder *b, gj_ag_node *n, gj_val *const *grads);
};

/* Emit helpers: one output each; NULL on error. */
gj_val *gj_ag_emit1(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in);
gj_val *gj_ag_unary(gj_ag_builder *b, gj_rt_prim p, gj_val *x);
gj_val *gj_ag_scalar_op(gj_ag_builder *b, gj_rt_prim p, gj_val *x, double c);
gj_val *gj_ag_binary(gj_ag_builder *b, gj_rt_prim p, gj_val *x, gj_val *y);
gj_val *gj_ag_where(gj_ag_builder *b, gj_val *c, gj_val *x, gj_val *y);
gj_val *gj_ag_fill(gj_ag_builder *b, gj_dtype dt, int ndim, const int64_t *shape, double v);
gj_val *gj_ag_sum(gj_ag_builder *b, gj_val *x, uint32_t axes, bool keepdim);
gj_val *gj_ag_reshape(gj_ag_builder *b, gj_val *x, int ndim, const int64_t *shape);
gj_val *gj_ag_expand(gj_ag_builder *b, gj_val *x, int ndim, const int64_t *shape);
gj_val *gj_ag_permute(gj_ag_builder *b, gj_val *x, int ndim, const int *perm);
gj_val *gj_ag_transpose_last2(gj_ag_builder *b, gj_val *x);
gj_val *gj_ag_matmul(gj_ag_builder *b, gj_val *x, gj_val *y, bool ta, bool tb);
gj_val *gj_ag_cast(gj_ag_builder *b, gj_val *x, gj_dtype dt);
/* Sum a broadcast gradient back to shape (ndim, shape): reduces the leading
 * extra dims and the dims that were 1. Returns x itself if shapes match. */
gj_val *gj_ag_sum_to(gj_ag_builder *b, gj_val *x, int ndim, const int64_t *shape);
void gj_ag_meta(gj_ag_builder *b, gj_val *v, gj_rt_meta *out);

/* The eager builder (a process-wide singleton is fine: it has no state
 * besides its temporaries list, which is per thread). */
gj_ag_builder *gj_ag_eager_builder(void);
static inline gj_tensor *gj_ag_val_tensor(gj_val *v) { return (gj_tensor *)v; }
static inline gj_val *gj_ag_tensor_val(gj_tensor *t) { return (gj_val *)t; }

/* Express a composite instruction (SOFTMAX .. CE_BWD) with primitives on
 * any builder (used by the recording builder). Returns outputs as emit. */
int gj_ag_decompose(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in, gj_val **outs);

/* ------------------------------------------------------- op definitions */

#define GJ_AG_MAX_IN 16
#define GJ_AG_MAX_SAVED 8
#define GJ_AG_MAX_OUT 2

/* Attributes of an op instance (stored in its node, part of the cache key). */
typedef struct gj_ag_attrs {
    double f[4];
    int64_t i[GJ_MAX_DIMS + 4];
    int ni;      /* used entries of i */
    int nf;      /* used entries of f */
} gj_ag_attrs;

typedef struct gj_ag_fctx gj_ag_fctx; /* forward context: saving */
typedef struct gj_ag_bctx gj_ag_bctx; /* backward context */

typedef struct gj_ag_opdef {
    const char *name;
    /* Forward: outs[0..n_out) from in[0..n_in). Save what backward needs
     * with gj_ag_save. Returns n_out or -1. */
    int (*forward)(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs);
    /* Backward: from grads of outputs gout[k] (NULL if that output got no
     * gradient), write gin[i] for every i with gj_ag_needs_grad(ctx, i)
     * (others may stay NULL). Returns 0 or -1. */
    int (*backward)(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin);
} gj_ag_opdef;

/* Forward context API. */
void gj_ag_save(gj_ag_fctx *ctx, gj_val *v);          /* saved[k] in call order */
/* Backward context API. */
gj_val *gj_ag_saved(gj_ag_bctx *ctx, int k);
int gj_ag_n_inputs(gj_ag_bctx *ctx);
bool gj_ag_needs_grad(gj_ag_bctx *ctx, int i);
const gj_rt_meta *gj_ag_input_meta(gj_ag_bctx *ctx, int i);
const gj_rt_meta *gj_ag_output_meta(gj_ag_bctx *ctx, int k);

/* Run op eagerly on user tensors and record a node when grad mode is on and
 * an input requires grad. outs receive new references (not yet scoped).
 * Returns the number of outputs or -1 with the error set. */
int gj_ag_apply(const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in, gj_tensor *const *in,
                gj_tensor **outs);

/* ------------------------------------------------------------- nodes */

typedef struct gj_ag_node gj_ag_node;

typedef struct gj_ag_edge {
    gj_ag_node *node; /* NULL: input needs no gradient */
    int input_nr;     /* which output of `node` this edge feeds */
} gj_ag_edge;

typedef enum gj_ag_node_kind { GJ_AG_OP = 0, GJ_AG_ACCUMULATE = 1 } gj_ag_node_kind;

typedef struct gj_ag_saved_tensor {
    gj_tensor *t;     /* detached alias */
    int64_t version;  /* storage version at save */
} gj_ag_saved_tensor;

struct gj_ag_node {
    atomic_long refcount;
    gj_ag_node_kind kind;
    const gj_ag_opdef *op;          /* GJ_AG_OP */
    gj_tensor *leaf;                /* GJ_AG_ACCUMULATE: strong ref */
    uint64_t seq;                   /* creation order, for the ready queue */
    gj_ag_attrs attrs;
    int n_in;
    gj_ag_edge next[GJ_AG_MAX_IN];  /* edge per input */
    gj_rt_meta in_meta[GJ_AG_MAX_IN];
    int n_out;
    gj_rt_meta out_meta[GJ_AG_MAX_OUT];
    int n_saved;
    gj_ag_saved_tensor saved[GJ_AG_MAX_SAVED];
    bool released;                  /* saved tensors freed by a backward */
    gj_ag_hook *out_hooks[GJ_AG_MAX_OUT]; /* GJ_AG_OP: tensor hooks per output (owned) */
};

/* Autograd metadata of a tensor (tensor->ag). */
typedef struct gj_ag_tensor_meta {
    bool requires_grad;
    gj_ag_node *node;   /* grad_fn (strong), NULL for leaves */
    int output_nr;
    gj_ag_node *acc;    /* leaves: weak pointer to the accumulate node */
    gj_tensor *grad;    /* leaves: accumulated .grad (owned, pinned; set it with
                           gj_ag_meta_set_grad) */
    gj_ag_hook *hooks;      /* leaves: tensor hooks (owned; non-leaves: in the node) */
    gj_ag_hook *post_hooks; /* leaves: post-accumulate hooks (owned) */
} gj_ag_tensor_meta;

gj_ag_tensor_meta *gj_ag_meta_get(gj_tensor *t, bool create); /* NULL if none / OOM */
/* The only way to change m->grad: g (a reference, stolen; NULL clears)
 * replaces the old .grad, whose reference is released. The slot pins the
 * reference it holds (gj_tensor.pinned), so that the public gj_release of
 * the borrowed pointer gj_tensor_grad hands out is refused instead of
 * freeing a .grad still installed. */
void gj_ag_meta_set_grad(gj_ag_tensor_meta *m, gj_tensor *g);
/* Per-leaf serialisation of .grad accumulation (striped recursive
 * mutexes): the eager engine holds a leaf's lock while it writes its .grad;
 * a compiled run takes the stripes of all the leaves it writes with
 * gj_ag_leaf_trylock_stripes (all or none, never blocking) and holds them
 * for the whole run. */
int gj_ag_leaf_stripe(const gj_tensor *leaf); /* 0..63 */
void gj_ag_leaf_lock(const gj_tensor *leaf);
void gj_ag_leaf_unlock(const gj_tensor *leaf);
bool gj_ag_leaf_trylock_stripes(uint64_t stripes); /* bit i: stripe i */
void gj_ag_leaf_unlock_stripes(uint64_t stripes);
void gj_ag_node_retain(gj_ag_node *n);
void gj_ag_node_release(gj_ag_node *n);
/* The edge a gradient for t flows into (node NULL if t needs no grad),
 * holding a new reference to the node: release it or store it. */
gj_ag_edge gj_ag_edge_of(gj_tensor *t);

/* Run node's backward formula on builder b (saved tensors become b's
 * constants). needs[i]: input i wants a gradient. */
int gj_ag_node_backward(gj_ag_builder *b, gj_ag_node *node, const bool *needs,
                        gj_val *const *gout, gj_val **gin);

/* ------------------------------------------------------------- engine */

bool gj_ag_grad_enabled(void);
void gj_ag_no_grad_enter(void);
void gj_ag_no_grad_exit(void);

/* Run the backward traversal from roots with seeds (values of builder b)
 * -- the one traversal both interpreters share. If capture_inputs is
 * non-NULL (gj_grad), gradients flowing into those tensors' edges are
 * returned in grads_out (values of b, kept) instead of accumulating.
 * Returns 0 or -1 with the error set. */
int gj_ag_run_backward(gj_ag_builder *b, int n_roots, gj_tensor *const *roots,
                       gj_val *const *seeds, int n_inputs, gj_tensor *const *inputs,
                       gj_val **grads_out, bool retain_graph, bool accumulate);

/* Whether a gradient of meta g (the shape op `op` saw in the forward; op
 * may be NULL) fits leaf now: gj_tensor_set_ may have given the leaf
 * another shape since the forward. If not, sets the error naming the
 * leaf's old and new shapes (the backward is an error, as in PyTorch). */
bool gj_ag_leaf_grad_fits(const gj_tensor *leaf, const gj_rt_meta *g, const char *op);

/* Public backwards (gj_backward, gj_grad; named fn in errors) bracket
 * their whole run, eager or compiled, with enter/exit. enter refuses (-1,
 * error naming fn and saying the graph's backward is running) a backward
 * started from user code inside a running backward of this thread when
 * its graph shares a node with that one: it would run the same hooks
 * again without end, and free saved tensors the outer one still reads.
 * A backward of an unrelated graph is allowed. 0 on success: call exit
 * once the backward returns. */
int gj_ag_backward_enter(int n_roots, gj_tensor *const *roots, const char *fn);
void gj_ag_backward_exit(void);

/* Free the saved tensors of every node reachable from roots (what a
 * backward without retain_graph does at its end). */
void gj_ag_release_graph(int n_roots, gj_tensor *const *roots);
/* Free the saved tensors of one op node and mark it released (what the
 * engine does to each node it ran, without retain_graph). */
void gj_ag_node_free_saved(gj_ag_node *nd);

/* ------------------------------------------------- op definitions table */

extern const gj_ag_opdef gj_ag_op_add, gj_ag_op_sub, gj_ag_op_mul, gj_ag_op_div,
    gj_ag_op_neg, gj_ag_op_exp, gj_ag_op_log, gj_ag_op_tanh, gj_ag_op_sigmoid,
    gj_ag_op_relu, gj_ag_op_gelu, gj_ag_op_sqrt, gj_ag_op_pow_scalar, gj_ag_op_add_scalar,
    gj_ag_op_mul_scalar, gj_ag_op_sum, gj_ag_op_max, gj_ag_op_matmul, gj_ag_op_reshape,
    gj_ag_op_permute, gj_ag_op_expand, gj_ag_op_slice, gj_ag_op_cat, gj_ag_op_copy,
    gj_ag_op_softmax, gj_ag_op_log_softmax, gj_ag_op_layer_norm, gj_ag_op_cross_entropy,
    gj_ag_op_embedding, gj_ag_op_dropout, gj_ag_op_where, gj_ag_op_cast;
/* Appended by ops: masked_fill(x, mask) with f[0] = value; linear(x, w[, b])
 * with i[0] = has_bias (see autograd/ops_*.c for every op's attributes). */
extern const gj_ag_opdef gj_ag_op_masked_fill, gj_ag_op_linear;
/* Appended by conv (ops_conv.c, its header lists the attributes): conv2d(x,
 * w[, b]), max_pool2d(x), avg_pool2d(x), NCHW. */
extern const gj_ag_opdef gj_ag_op_conv2d, gj_ag_op_max_pool2d, gj_ag_op_avg_pool2d;
/* The fused ops (ops_fused.c, its header lists the attributes): scaled
 * dot-product attention. */
extern const gj_ag_opdef gj_ag_op_sdpa;
extern const gj_ag_opdef gj_ag_op_lce;

/* ------------------------------------ checkpoint regions (helper ckpt) */
/* Activation checkpointing (autograd/checkpoint.c, public gj_checkpoint).
 * While a region is open on this thread, gj_ag_apply runs each op eagerly
 * and appends it to the region's tape instead of recording a node; at the
 * region's end the whole region becomes ONE node of gj_ag_op_checkpoint
 * whose backward replays the tape (recomputing what the policy dropped,
 * reading what it saved) and runs the tape's backward formulas, on
 * whatever builder the engine passes: eager recomputation, or inlined
 * recomputation in a captured graph. */

/* An op's forward / backward formula on values of any builder, outside of
 * a node (the tape's replay). forward_vals: outs as op->forward; when saved
 * is non-NULL it receives the values the formula saved (at most
 * GJ_AG_MAX_SAVED) and *n_saved their count. backward_vals: runs
 * op->backward with the given input/output metas and saved values. Both
 * return what the formula returns (-1 with the error set). */
int gj_ag_forward_vals(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs, int *n_saved, gj_val **saved);
int gj_ag_backward_vals(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                        const gj_rt_meta *in_meta, int n_out, const gj_rt_meta *out_meta,
                        int n_saved, gj_val *const *saved, const bool *needs,
                        gj_val *const *gout, gj_val **gin);
/* The node whose backward is running (borrowed). */
gj_ag_node *gj_ag_ctx_node(gj_ag_bctx *ctx);

/* The op of a region's node. attrs: i[0], i[1] = 128-bit hash of the
 * tape's canonical serialization (literal dropout seeds/offsets), so the
 * JIT key differs whenever the tape's structure or decisions differ. */
extern const gj_ag_opdef gj_ag_op_checkpoint;

typedef struct gj_ag_ckpt_region gj_ag_ckpt_region;
/* The region open on this thread, or NULL. */
gj_ag_ckpt_region *gj_ag_ckpt_active(void);
/* Tape ops the backwards of checkpoint nodes replayed (recomputed) on this
 * thread so far, with any builder: eager recomputation, or recomputation
 * recorded into a compiled graph. For tests of the policies. */
int64_t gj_ag_ckpt_recomputed(void);
/* The number of ops on region r's tape so far. */
int gj_ag_ckpt_tape_len(const gj_ag_ckpt_region *r);
/* Where stored tensor k of checkpoint node n (gj_ag_ckpt_stored) comes
 * from: an output (GJ_AG_STORED_OUTPUT: output *index of tape op *op), a
 * value an op's formula saved (GJ_AG_STORED_INTERNAL: saved value *index of
 * tape op *op), or a tensor from outside the region that it read
 * (GJ_AG_STORED_SOURCE: input *index of tape op *op is it). 0, or -1 if n
 * is not a live checkpoint node or k is out of range. */
enum { GJ_AG_STORED_OUTPUT = 0, GJ_AG_STORED_INTERNAL = 1, GJ_AG_STORED_SOURCE = 2 };
int gj_ag_ckpt_stored_origin(const gj_ag_node *n, int k, int *kind, int *op, int *index);
/* Opens a region on this thread: in[0..n_in) (borrowed) are its inputs,
 * policy (may be NULL: recompute everything) decides per op. NULL with the
 * error set if a region is already open (nested regions are an error). */
gj_ag_ckpt_region *gj_ag_ckpt_begin(int n_in, gj_tensor *const *in, gj_ckpt_policy_fn policy,
                                    void *policy_data);
/* Called by gj_ag_apply for every op run while region r is open: appends
 * op (its inputs in, its outputs vout as the formula produced them and outs
 * as handed to the caller, the formula's saved values) to the tape. 0 or -1
 * (error set; the tape is unchanged). */
int gj_ag_ckpt_note(gj_ag_ckpt_region *r, const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                    gj_tensor *const *in, gj_val *const *vout, int n_out, gj_tensor *const *outs,
                    int n_saved, gj_val *const *saved);
/* Closes r (always: r is freed) and makes fn_out[0..n_out) (borrowed, as
 * fn returned them) the outputs of one checkpoint node: outs[k] receive new
 * references (not scoped) carrying the node as grad_fn (or plain tensors if
 * nothing in the region requires grad). 0 or -1 (error set, outs NULL). */
int gj_ag_ckpt_end(gj_ag_ckpt_region *r, int n_out, gj_tensor *const *fn_out, gj_tensor **outs);
/* Closes and frees r without making a node (fn failed). */
void gj_ag_ckpt_abort(gj_ag_ckpt_region *r);
/* gj_ag_node_release calls this for a dying checkpoint node: frees its tape. */
void gj_ag_ckpt_node_free(gj_ag_node *n);

/* What a checkpoint node holds for its backward (the "saved set"). */
typedef struct gj_ag_ckpt_info {
    int n_entries;        /* ops in the tape */
    int n_saved_entries;  /* ops whose outputs the policy saved */
    int n_stored;         /* tensors held: inputs read, saved outputs, their internals */
    int n_node_saved;     /* of which the first n_node_saved are node->saved[] */
    int64_t stored_bytes; /* bytes of those tensors (their views' extents) */
    int n_in_node;        /* node inputs: region inputs + outside tensors requiring grad */
} gj_ag_ckpt_info;
/* 0 and *out if n is a live checkpoint node, -1 otherwise. */
int gj_ag_ckpt_info_of(const gj_ag_node *n, gj_ag_ckpt_info *out);
/* Stored tensor k of checkpoint node n (borrowed; NULL once released):
 * k < n_node_saved is n->saved[k].t, the others are held by the tape.
 * *version (may be NULL) receives the storage version at save time. */
gj_tensor *gj_ag_ckpt_stored(const gj_ag_node *n, int k, int64_t *version);
/* Canonical text of checkpoint node n's tape (for jit/key.c): per op its
 * name, attributes, input slots (region input k / output m of op j /
 * outside tensor c), metas, saved flag and policy; the stored tensors'
 * metas. runtime_attrs(op) (may be NULL) gives a mask of integer attributes
 * written as '*' (run-time values such as dropout seeds). Writes at most
 * cap bytes (NUL-terminated when cap > 0) and returns the full length, as
 * snprintf; -1 if n is not a checkpoint node. Never contains an address. */
int64_t gj_ag_ckpt_serialize(const gj_ag_node *n, uint32_t (*runtime_attrs)(const gj_ag_opdef *),
                             char *buf, size_t cap);
/* The ops of checkpoint node n's tape: their count (-1 if n is not a live
 * checkpoint node), and op j's definition with its attributes (*attrs,
 * borrowed while n lives; NULL if j is out of range). For the JIT's
 * run-time parameters (the seed and offset of a dropout inside a region). */
int gj_ag_ckpt_n_ops(const gj_ag_node *n);
const gj_ag_opdef *gj_ag_ckpt_op(const gj_ag_node *n, int j, const gj_ag_attrs **attrs);
/* The metas op j of checkpoint node n's tape saw when the region ran: its
 * n_in input metas (*n_in, in_meta[GJ_AG_MAX_IN]) and output metas
 * (out_meta[GJ_AG_MAX_OUT]). Returns its number of outputs, or -1 if n is
 * not a live checkpoint node or j is out of range. */
int gj_ag_ckpt_op_metas(const gj_ag_node *n, int j, int *n_in, gj_rt_meta *in_meta,
                        gj_rt_meta *out_meta);

/* ------------------------- hooks, custom ops, anomaly (helper "hooks") */

typedef enum gj_ag_hook_kind {
    GJ_AG_HOOK_TENSOR = 0,          /* gj_grad_hook_fn: may replace the gradient */
    GJ_AG_HOOK_POST_ACCUMULATE = 1, /* gj_post_accumulate_hook_fn: after .grad is written */
} gj_ag_hook_kind;

/* One registered hook. Lists are singly linked in registration order and
 * owned by a node (tensor hooks of a non-leaf output: node->out_hooks[k])
 * or by a leaf's meta (hooks, post_hooks). A removed hook stays in its list
 * (flag `removed`, skipped by everyone) until the list is compacted at a
 * later registration outside any hook call, or its owner dies. */
struct gj_ag_hook {
    int64_t handle;              /* > 0, unique in the process */
    gj_ag_hook_kind kind;
    gj_grad_hook_fn fn;          /* GJ_AG_HOOK_TENSOR */
    gj_post_accumulate_hook_fn post_fn; /* GJ_AG_HOOK_POST_ACCUMULATE */
    void *user;
    bool removed;
    bool early;                  /* post-accumulate: promises no writes to the graph's
                                    tensors, so a compiled run may call it mid-program */
    gj_ag_hook *next;            /* next hook of the same list */
    gj_ag_hook *all_prev, *all_next; /* hooks.c: every live hook, for removal */
};

/* Registers a hook on t (which must require grad; post-accumulate: a
 * leaf): fn for GJ_AG_HOOK_TENSOR, post_fn for GJ_AG_HOOK_POST_ACCUMULATE.
 * Returns the handle or -1 with an error naming op. */
int64_t gj_ag_hook_register(gj_tensor *t, gj_ag_hook_kind kind, gj_grad_hook_fn fn,
                            gj_post_accumulate_hook_fn post_fn, void *user, const char *op);
int gj_ag_hook_remove(int64_t handle); /* 0, or -1 if unknown/removed (no error set) */
/* Whether leaf t has a live tensor or post-accumulate hook. */
bool gj_ag_leaf_has_hooks(const gj_tensor *t);
/* The live hooks of leaf t (tensor hooks, then post-accumulate hooks):
 * up to cap written to out; returns how many there are. */
int gj_ag_leaf_hooks(const gj_tensor *t, const gj_ag_hook **out, int cap);
/* Sets the `early` flag of live hook handle. 0, or -1 if unknown/removed. */
int gj_ag_hook_set_early(int64_t handle);
/* Frees a list (node and meta destruction). */
void gj_ag_hooks_free(gj_ag_hook **list);
/* The live hooks the engine runs for output k of node n, in run order: an
 * OP node's tensor hooks of output k; for an ACCUMULATE node (k = 0) the
 * leaf's tensor hooks, then its post-accumulate hooks. Writes up to cap of
 * them to out (out may be NULL) and returns how many there are: what a
 * structural key records (kinds and counts, never the pointers). */
int gj_ag_node_hooks(const gj_ag_node *n, int k, const gj_ag_hook **out, int cap);
/* Engine side: runs the tensor hooks of output k of n on *buf (replacing
 * it, keep/drop handled), or the post-accumulate hooks of leaf. 0 or -1. */
int gj_ag_run_tensor_hooks(gj_ag_builder *b, gj_ag_node *n, int k, gj_val **buf);
int gj_ag_run_post_hooks(gj_ag_builder *b, gj_tensor *leaf);
/* Appended by helper "hookjit": runs tensor hook h on g (borrowed) exactly
 * as the eager builder does (user scope, no_grad, shape/dtype check) and
 * returns the tensor to use from now on as a new reference (g itself,
 * retained, when the hook returned NULL or g), or NULL with the error set.
 * The compiled backward calls hooks through it. */
gj_tensor *gj_ag_call_hook_ref(const gj_ag_hook *h, gj_tensor *g);
/* The eager builder's call_hook / call_post_hook. */
gj_val *gj_ag_eager_call_hook(gj_ag_builder *b, const gj_ag_hook *h, gj_val *grad);
int gj_ag_eager_call_post_hook(gj_ag_builder *b, const gj_ag_hook *h, gj_tensor *leaf);
/* The frontend's scopes: user code called from the engine (hooks, custom
 * op functions) runs inside a scope of its own. The frontend registers
 * its scope operations: push (opens one and returns its identity: what
 * t->scope holds for a tensor registered in it), pop (closes the
 * innermost), level (how many scopes are open on this thread) and
 * open_from (whether scope s is one of this thread's open scopes, opened
 * when `level` scopes were open or later). gj_ag_user_scope_push opens the
 * user scope (u.id NULL when no frontend registered); after the user code
 * returned, gj_ag_user_scope_close closes it and every scope the user code
 * left open inside it: 0, or -1 with an error naming `who` when the user
 * code left scopes open (closed now) or closed the scope it was called in
 * (and maybe its caller's: nothing more is closed then). */
typedef struct gj_ag_scope_ops {
    void *(*push)(void);
    void (*pop)(void);
    int (*level)(void);
    bool (*open_from)(const void *scope, int level);
} gj_ag_scope_ops;
typedef struct gj_ag_uscope {
    void *id;
    int level; /* scopes open before it */
} gj_ag_uscope;
void gj_ag_set_user_scope(const gj_ag_scope_ops *ops);
gj_ag_uscope gj_ag_user_scope_push(void);
int gj_ag_user_scope_close(gj_ag_uscope u, const char *who);
/* gj_ag_user_scope_close after user code failed: the error already set
 * stays first (a scope problem is appended to it). */
void gj_ag_uscope_close_keep_error(gj_ag_uscope u, const char *who);
/* Takes the reference that user code returned for t (call while the user
 * scope u is open): if t is registered in u or in a scope the user code
 * opened inside it (and left open), the reference is that scope's and a
 * new one is taken; otherwise (gj_retain'ed, or kept out of any scope) it
 * is stolen. Returns a new reference without autograd meta (an alias
 * replaces t if needed), or NULL with an error naming what if t is not a
 * live tensor. */
gj_tensor *gj_ag_take_user_ref(gj_tensor *t, gj_ag_uscope u, const char *what);
/* Drops a reference user code returned that will not be used (nothing if
 * it is a scope's of u, as above, or t is not a live tensor). */
void gj_ag_drop_user_ref(gj_tensor *t, gj_ag_uscope u);
/* The tensor g is lent to user code (a hook's gradient): while pinned,
 * gj_release refuses to drop the references it had when lent (the user
 * code owns none of them). pin returns what unpin takes back. */
int gj_ag_pin_lent(gj_tensor *g);
void gj_ag_unpin_lent(gj_tensor *g, int pins);
/* Pushes one reference of t (transferred) on the eager builder's step;
 * NULL on OOM (the reference is released). */
gj_val *gj_ag_eager_adopt(gj_tensor *t);

/* Anomaly mode: the engine checks every gradient an op produces with the
 * eager builder for NaN/Inf and fails naming the op (process-wide flag). */
void gj_ag_set_anomaly(bool on);
bool gj_ag_anomaly(void);
/* 0, or -1 with an error if value g (gradient for input i of n) holds a
 * NaN or an Inf. Checks eager values only. */
int gj_ag_anomaly_check(gj_ag_builder *b, const gj_ag_node *n, int i, gj_val *g);

/* Custom ops (autograd/custom.c; public API in frontend/custom.c). The
 * opdef of a custom op is named after its schema ("ns::name"); its backward
 * runs the user's C function on real tensors: with a recording builder it
 * becomes an opaque call (builder.call_custom), or fails ("custom op ...:
 * cannot be captured") if the builder has no call_custom. */
gj_custom_op *gj_ag_custom_define(const char *schema, void *forward_fn, void *backward_fn);
gj_custom_op *gj_ag_custom_find(const char *name);
int gj_ag_custom_call(gj_custom_op *op, gj_tensor *const *tensor_args, const double *scalar_args,
                      gj_tensor **outs);
/* The custom op of an opdef, or NULL for a built-in op. */
gj_custom_op *gj_ag_custom_of(const gj_ag_opdef *op);
int gj_ag_custom_n_outputs(const gj_custom_op *op);
int gj_ag_custom_n_tensor_args(const gj_custom_op *op);
/* Runs op's backward C function on real tensors: gout[n outputs] (NULL:
 * zeros of output k's meta out_meta[k]), inputs[n tensor args] and the
 * scalars as stored in the node's attributes; gin[n tensor args] receive
 * new references (unscoped) or NULL. The entry an opaque call node of a
 * compiled program can use. 0 or -1 with an error. */
int gj_ag_custom_run_backward(const gj_custom_op *op, const gj_ag_attrs *a,
                              const gj_rt_meta *out_meta, gj_tensor *const *gout,
                              gj_tensor *const *inputs, gj_tensor **gin);
/* Runs op's forward C function on real tensors inputs[n tensor args] with
 * the scalars of attributes a (under no_grad, in a scope of its own); outs
 * [n outputs] receive new references (unscoped, no autograd meta; an
 * argument handed back is a new header on its storage). The entry a
 * compiled program's opaque forward call uses. 0, or -1 with an error and
 * outs all NULL. */
int gj_ag_custom_run_forward(const gj_custom_op *op, const gj_ag_attrs *a,
                             gj_tensor *const *inputs, gj_tensor **outs);

/* ------------------------------------ optimizer updates (optim_*.c) */
/* Each optimizer's update is written once, as a formula against the
 * builder (optim_sgd.c, optim_adamw.c, optim_lion.c): the eager
 * gj_optim_step runs it on each parameter with the chunk interpreter of
 * optim.c (gj_ag_opt_apply), the compiled step records it after the
 * parameter's gradient (jit/step_capture.c), and its name and structure
 * are the compiled step's key and guards. The formula's values are in the
 * update's compute type T (f64 for f64 parameters, else f32); so are the
 * optimizer's state tensors. Adding an optimizer is one file with one
 * gj_ag_optdef (and its public constructor, a few lines in
 * frontend/optim.c). */

enum { GJ_AG_OPT_MAX_STATE = 2, GJ_AG_OPT_MAX_CFG = 6, GJ_AG_OPT_MAX_HYPER = 8 };

typedef struct gj_ag_optdef {
    const char *name; /* "sgd", "adamw", "lion": a checkpoint's optimizer kind */
    /* Configuration, in the order checkpoints store it: lr first,
     * weight_decay second; each in [lo, hi) (hi_open) or [lo, hi]. */
    int n_cfg;
    const char *cfg_names[GJ_AG_OPT_MAX_CFG];
    double cfg_lo[GJ_AG_OPT_MAX_CFG], cfg_hi[GJ_AG_OPT_MAX_CFG];
    bool cfg_hi_open[GJ_AG_OPT_MAX_CFG];
    /* State tensors per parameter, by their checkpoint names. */
    int n_state;
    const char *state_names[GJ_AG_OPT_MAX_STATE];
    bool counts_steps; /* a per-parameter step count ("step" in checkpoints) */
    int n_hyper;       /* run-time scalars per parameter and update */
    /* Bits of the configuration that change the update's graph (SGD's
     * momentum or weight decay nonzero): part of the compiled step's key
     * and guards; the rest of the configuration is run-time values. */
    uint32_t (*structure)(const double *cfg);
    /* Whether the update under structure s reads and writes state k. */
    bool (*uses_state)(uint32_t s, int k);
    /* The run-time scalars h[0..n_hyper) of the update that will be the
     * parameter's t-th (t >= 1; counting optimizers only use it), from
     * cfg: the doubles both interpreters cast to T. */
    void (*hyper)(const double *cfg, int64_t t, double *h);
    /* The update: p, g (T), state[k] (T; NULL where unused), h[j] (0-d, T)
     * -> *p_new and state_new[k] for each used state (T). 0 or -1. */
    int (*update)(gj_ag_builder *b, uint32_t s, gj_val *p, gj_val *g, gj_val *const *state,
                  gj_val *const *h, gj_val **p_new, gj_val **state_new);
} gj_ag_optdef;

extern const gj_ag_optdef gj_ag_opt_sgd, gj_ag_opt_adamw, gj_ag_opt_lion;

/* The compute type of the update of a parameter of dtype dt. */
static inline gj_dtype gj_ag_opt_dtype(gj_dtype dt) { return dt == GJ_F64 ? GJ_F64 : GJ_F32; }

/* Runs def's update (structure s, scalars h) eagerly on parameter p
 * (contiguous, any float dtype) with gradient g (contiguous, p's numel,
 * any float dtype) and state[k] (contiguous, in T; NULL where unused), in
 * place: the formula interpreted chunk by chunk with the eager kernels'
 * loops (gj_rt_ew_dense), one pass over memory, split over the pool. Bumps
 * nothing. *zero_state (may be NULL: none): bit k says state[k]'s bytes
 * are undefined and stand for zeros (a state made for this first update):
 * the update reads zeros instead and is the state's first writer (the same
 * bits as with zero-filled state); a state the formula does not write is
 * zero-filled. On success every bit is cleared. 0, or -1 with the error set
 * (the formula uses a primitive the interpreter lacks: nothing written,
 * the bits unchanged). */
int gj_ag_opt_apply(const gj_ag_optdef *def, uint32_t s, const double *h, gj_tensor *p,
                    const gj_tensor *g, gj_tensor *const *state, unsigned *zero_state);

/* ---------------------------------------- the trace of a step (trace.c) */
/* While a training step's function runs eagerly under gj_ag_trace_begin,
 * every op gj_ag_apply runs on this thread (outside checkpoint regions) is
 * appended to the trace with where its inputs came from; the compiled step
 * (jit/step.c) replays it with the recording builder. See trace.c. */

typedef enum gj_ag_slot_kind {
    GJ_AG_SLOT_INPUT = 0,  /* step input #index */
    GJ_AG_SLOT_PARAM = 1,  /* parameter #index */
    GJ_AG_SLOT_CONST = 2,  /* constant #index: from outside, or made in the function */
    GJ_AG_SLOT_OUTPUT = 3, /* output #out of entry #index */
    GJ_AG_SLOT_ALIAS = 4,  /* gj_detach of slot alias_of: the same value, no gradient */
} gj_ag_slot_kind;

typedef struct gj_ag_trace_slot {
    gj_ag_slot_kind kind;
    int index, out, alias_of;
    bool created;   /* CONST: made in the function by gj_zeros, gj_full, ... */
    gj_tensor *t;   /* strong while the trace lives */
    gj_rt_meta meta;
} gj_ag_trace_slot;

typedef struct gj_ag_trace_entry {
    const gj_ag_opdef *op;
    gj_ag_attrs attrs;
    int n_in, n_out;
    int in[GJ_AG_MAX_IN];   /* slots */
    int out[GJ_AG_MAX_OUT]; /* slots */
    gj_ag_node *node;       /* the node gj_ag_apply made (strong), or NULL */
    /* An op of a checkpoint region: op #tape_pos of the tape of checkpoint
     * node ckpt (the region's own entry comes after its ops; borrowed: the
     * region's entry holds the node). NULL for an op outside regions. */
    gj_ag_node *ckpt;
    bool in_region;
    int tape_pos;
} gj_ag_trace_entry;

typedef struct gj_ag_trace {
    int n_inputs, n_params;
    gj_ag_trace_slot *slots;
    int n_slots, cap_slots;
    gj_ag_trace_entry *entries;
    int n_entries, cap_entries;
    uint64_t seed, rng0, rng1; /* the generator: seed, counter at begin and end */
    uint64_t reseeds;          /* gj_rt_rng_reseeds() at begin */
    bool failed;               /* out of memory while recording */
    char untraceable[300];     /* why a replay would differ ("" if it would not) */
} gj_ag_trace;

/* Starts recording this thread's ops: in[0..n_in) are the step inputs,
 * params[0..n_params) the parameters (borrowed; the trace takes its own
 * references). NULL with the error set if a trace is already recording. */
gj_ag_trace *gj_ag_trace_begin(int n_in, gj_tensor *const *in, int n_params,
                               gj_tensor *const *params);
/* Stops recording (the trace stays readable); notes a reseeded generator. */
void gj_ag_trace_end(gj_ag_trace *tr);
void gj_ag_trace_free(gj_ag_trace *tr);
/* The trace recording on this thread, or NULL (cheap: a thread-local). */
gj_ag_trace *gj_ag_trace_active(void);
/* The slot of t (the latest if several), or -1. */
int gj_ag_trace_slot_of(const gj_ag_trace *tr, const gj_tensor *t);
/* The step input or constant whose values slot s holds, all of them and
 * nothing else (through aliases and the reshapes, permutes and copies the
 * function made of it): its slot, or -1 when s holds values the function
 * computed. What the compiled step checks before its program runs, as the
 * eager op checks its argument (labels, indices). */
int gj_ag_trace_value_source(const gj_ag_trace *tr, int s);
/* gj_ag_apply: op made outs[] from in[] (node: the node it recorded, or
 * NULL; tape_pos: its position on the tape of the checkpoint region open,
 * or -1 outside regions). Nothing if no trace is recording. */
void gj_ag_trace_note_op(const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                         gj_tensor *const *in, int n_out, gj_tensor *const *outs,
                         gj_ag_node *node, int tape_pos);
/* The frontend tells the recording trace (if any) what the function did:
 * an alias of src without history (gj_detach); a tensor made by a creation
 * function (deterministic: from its arguments alone); a read of t's values
 * (writable: through a pointer the caller may write through); and anything
 * a replay cannot reproduce (printf-style reason; the first one is kept). */
void gj_ag_trace_note_alias(gj_tensor *src, gj_tensor *alias);
void gj_ag_trace_note_created(gj_tensor *t, bool deterministic, const char *what);
void gj_ag_trace_note_read(const gj_tensor *t, const char *what, bool writable);
void gj_ag_trace_untraceable(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void gj_ag_trace_untraceable_in(gj_ag_trace *tr, const char *why);

#endif /* GJ_AG_H */

