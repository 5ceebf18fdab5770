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

struct gj_ag_builder {
    /* Runs or records inst on inputs in[0..inst->n_in); writes inst's
     * outputs to outs. Returns the number of outputs or -1 (error set).
     * Values returned belong to the builder until the end of the current
     * step (gj_ag_builder_end_step); keep one with `keep`. */
    int (*emit)(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in, gj_val **outs);
    /* Shape and dtype of a value. */
    void (*meta)(gj_ag_builder *b, gj_val *v, gj_rt_meta *out);
    /* A real tensor as a value of this builder (eager: itself; recorder: a
     * graph input). The tensor is borrowed for the builder's lifetime. */
    gj_val *(*constant)(gj_ag_builder *b, gj_tensor *t);
    /* Take/drop an extra reference to v beyond the current step. */
    void (*keep)(gj_ag_builder *b, gj_val *v);
    void (*drop)(gj_ag_builder *b, gj_val *v);
    /* End of a step: every value not kept is released. */
    void (*end_step)(gj_ag_builder *b);
    /* Leaf gradient g (already summed over all paths, in the leaf's dtype)
     * flows into leaf's .grad: eager sets .grad (a new tensor, or g cast to
     * the existing .grad's dtype and added in place); the recorder makes it
     * a graph output accumulated into .grad. Returns 0 or -1. */
    int (*accumulate)(gj_ag_builder *b, gj_tensor *leaf, gj_val *g);
    bool records; /* true for the recording builder */
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
};

/* Autograd metadata of a tensor (tensor->ag). */
typedef struct gj_ag_tensor_meta {
    bool requires_grad;
    gj_ag_node *node;   /* grad_fn (strong), NULL for leaves */
    int output_nr;
    gj_ag_node *acc;    /* leaves: weak pointer to the accumulate node */
    gj_tensor *grad;    /* leaves: accumulated .grad (owned) */
} gj_ag_tensor_meta;

gj_ag_tensor_meta *gj_ag_meta_get(gj_tensor *t, bool create); /* NULL if none / OOM */
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

/* Free the saved tensors of every node reachable from roots (what a
 * backward without retain_graph does at its end). */
void gj_ag_release_graph(int n_roots, gj_tensor *const *roots);

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

#endif /* GJ_AG_H */
