/* SPDX-License-Identifier: MIT */
/*
 * record.c - the recording builder: the engine's own traversal, run with a
 * builder that appends IR nodes instead of computing, captures a backward
 * as a gj_jit_graph.
 *
 * Invariants:
 *   - A gj_val of this builder is (value id + 1) cast to a pointer; values
 *     live as long as the graph, so keep/drop/end_node do nothing.
 *   - Composite instructions are never recorded: they are decomposed into
 *     primitives (gj_ag_decompose) on this same builder.
 *   - constant(t) makes a new graph input for every call (no merging by
 *     address: two inputs that alias today may not alias in a later run
 *     with the same key). Its canonical origin is looked up in the walk;
 *     its strides are recorded (the key holds them) and it is read in place.
 *   - In gj_grad mode (the walk's grad_mode) the engine runs its gj_grad
 *     traversal: nothing is accumulated, and the gradients it returns for
 *     the requested inputs become the graph outputs (capture_grad).
 *   - accumulate(leaf, g) makes a graph output. With an existing .grad the
 *     .grad becomes an input and the output is ADD(.grad, CAST(g)), written
 *     in place: the same arithmetic as the eager accumulate (a strided
 *     .grad is read as a contiguous copy and the sum copied back).
 *   - Hooks are not run here (there are no values): a tensor hook becomes an
 *     opaque COPY node carrying a hook index, a post-accumulate hook an entry
 *     of the hook table; the compiled run calls them (guards.c).
 *   - A custom op's backward (a C function) becomes one opaque call node
 *     (rec_call_custom) naming the op's node by canonical index; the
 *     compiled run calls the function on copies of the node's inputs. A
 *     custom op's forward, met when a checkpoint region recomputes it,
 *     becomes one too (rec_call_custom_fwd), naming its tape op.
 */
#include "jit/capture/capture.h"

#include <string.h>

typedef gj_jit_recorder recorder;

static gj_val *id_val(int id) { return gj_jit_rec_val(id); }
static int val_id(gj_val *v) { return gj_jit_rec_id(v); }

/* Records the real tensor of graph input index i. 0 or -1 (OOM). */
static int note_tensor(gj_jit_capture *cap, int i, gj_tensor *t) {
    if (i >= cap->cap_tensors) {
        int nc = cap->cap_tensors ? cap->cap_tensors * 2 : 16;
        while (nc <= i) nc *= 2;
        gj_tensor **p = gj_rt_realloc(cap->tensors, (size_t)nc * sizeof *p);
        if (!p) return -1;
        cap->tensors = p;
        cap->cap_tensors = nc;
    }
    cap->tensors[i] = t;
    return 0;
}

int gj_jit_recorder_input(gj_jit_recorder *r, gj_tensor *t, gj_jit_role role, int node,
                          int slot) {
    gj_rt_meta m;
    gj_rt_meta_of(t, &m);
    int v = gj_jit_graph_add_input(&r->cap->g, &m, role, node, slot);
    if (v < 0) return -1;
    if (role != GJ_JIT_IN_GRAD) /* read in place, in its own layout */
        gj_jit_input_strides(t, r->cap->g.inputs[r->cap->g.n_inputs - 1].strides);
    if (note_tensor(r->cap, r->cap->g.n_inputs - 1, t) != 0) return -1;
    return v;
}

static void fail_reason(recorder *r, bool permanent, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail_reason(recorder *r, bool permanent, const char *fmt, ...) {
    if (r->cap->reason[0]) return; /* keep the first */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->cap->reason, sizeof r->cap->reason, fmt, ap);
    va_end(ap);
    r->cap->permanent = permanent;
}

static int rec_emit(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in,
                    gj_val **outs) {
    recorder *r = (recorder *)b;
    if (gj_jit_prim_is_composite(inst->prim)) return gj_ag_decompose(b, inst, in, outs);
    int ids[GJ_RT_MAX_INPUTS], out_ids[GJ_RT_MAX_OUTPUTS];
    if (inst->n_in < 0 || inst->n_in > GJ_RT_MAX_INPUTS) {
        gj_rt_set_error("jit capture: %s with %d inputs", gj_rt_prim_name(inst->prim),
                        inst->n_in);
        return -1;
    }
    for (int i = 0; i < inst->n_in; i++) {
        if (!in[i]) {
            gj_rt_set_error("jit capture: %s: input %d is missing", gj_rt_prim_name(inst->prim),
                            i);
            return -1;
        }
        ids[i] = val_id(in[i]);
    }
    int n = gj_jit_graph_add_node(&r->cap->g, inst, ids, out_ids);
    if (n < 0) return -1;
    r->cap->g.nodes[r->cap->g.n_nodes - 1].phase = r->phase;
    if (inst->prim == GJ_P_DROPOUT_MASK) { /* seed/offset come from the node (or tape) at run time */
        gj_jit_node *gn = &r->cap->g.nodes[r->cap->g.n_nodes - 1];
        if (r->dropout) {
            if (r->dropout(r->ctx, inst->seed, inst->rng_offset, &gn->rt_node, &gn->rt_tape) != 0)
                return -1;
        } else {
            gn->rt_node =
                gj_jit_walk_find_dropout(r->w, inst->seed, inst->rng_offset, &gn->rt_tape);
        }
    }
    for (int k = 0; k < n; k++) outs[k] = id_val(out_ids[k]);
    return n;
}

static void rec_meta(gj_ag_builder *b, gj_val *v, gj_rt_meta *out) {
    recorder *r = (recorder *)b;
    *out = r->cap->g.values[val_id(v)].meta;
}

static gj_val *rec_constant(gj_ag_builder *b, gj_tensor *t) {
    recorder *r = (recorder *)b;
    if (r->resolve) { /* a training step: the value its forward computed */
        int v = r->resolve(r->ctx, t);
        return v < 0 ? NULL : id_val(v);
    }
    int node = -1, slot = 0;
    gj_jit_role role = GJ_JIT_IN_SAVED;
    if (gj_jit_walk_saved_origin(r->w, t, &node, &slot) != 0) {
        role = GJ_JIT_IN_OTHER;
        node = -1;
        r->cap->unknown_origin = true;
    }
    int v = gj_jit_recorder_input(r, t, role, node, slot);
    return v < 0 ? NULL : id_val(v);
}

static void rec_keep(gj_ag_builder *b, gj_val *v) {
    (void)b;
    (void)v;
}

static void rec_drop(gj_ag_builder *b, gj_val *v) {
    (void)b;
    (void)v;
}

static void rec_end_node(gj_ag_builder *b) { (void)b; }

static int rec_accumulate(gj_ag_builder *b, gj_tensor *leaf, gj_val *gv) {
    recorder *r = (recorder *)b;
    gj_jit_graph *g = &r->cap->g;
    gj_ag_tensor_meta *lm = leaf->ag;
    gj_ag_leaf_lock(leaf); /* acc is shared with other threads' graphs */
    gj_ag_node *an = lm ? lm->acc : NULL;
    gj_ag_leaf_unlock(leaf);
    int acc = gj_jit_walk_find(r->w, an);
    if (acc < 0) {
        fail_reason(r, false, "leaf gradient without an accumulate node in the walk");
        gj_rt_set_error("jit capture: internal: leaf without accumulate node");
        return -1;
    }
    int gid = val_id(gv);
    gj_rt_meta gm = g->values[gid].meta;
    gj_tensor *grad = lm->grad;
    if (!grad) {
        if (gm.dtype != leaf->dtype) {
            gj_rt_inst cast = {.prim = GJ_P_CAST, .n_in = 1, .dtype = leaf->dtype};
            if (gj_jit_graph_add_node(g, &cast, &gid, &gid) < 0) return -1;
        }
        return gj_jit_graph_add_output(g, gid, acc, -1);
    }
    if (grad->ndim != leaf->ndim || memcmp(grad->shape, leaf->shape,
                                           (size_t)leaf->ndim * sizeof leaf->shape[0]) != 0 ||
        !gj_rt_dtype_is_float(grad->dtype)) {
        fail_reason(r, true, ".grad of a leaf has another shape or is not a float tensor");
        gj_rt_set_error("jit capture: unsupported .grad layout");
        return -1;
    }
    int gin = gj_jit_recorder_input(r, grad, GJ_JIT_IN_GRAD, acc, 0);
    if (gin < 0) return -1;
    if (gm.dtype != grad->dtype) {
        gj_rt_inst cast = {.prim = GJ_P_CAST, .n_in = 1, .dtype = grad->dtype};
        if (gj_jit_graph_add_node(g, &cast, &gid, &gid) < 0) return -1;
    }
    gj_rt_inst add = {.prim = GJ_P_ADD, .n_in = 2};
    int args[2] = {gin, gid}, sum;
    if (gj_jit_graph_add_node(g, &add, args, &sum) < 0) return -1;
    return gj_jit_graph_add_output(g, sum, acc, g->n_inputs - 1);
}

/* The canonical reference of hook h (which the engine is about to run for
 * a node of the walk): 0, or -1 if h is on no node of the walk. */
static int find_hook(const gj_jit_walk *w, const gj_ag_hook *h, gj_jit_hookref *ref) {
    const gj_ag_hook *hs[64];
    for (int i = 0; i < w->n; i++) {
        const gj_ag_node *n = w->nodes[i];
        int n_out = n->kind == GJ_AG_OP ? n->n_out : 1;
        for (int k = 0; k < n_out; k++) {
            int c = gj_ag_node_hooks(n, k, hs, 64);
            for (int j = 0; j < c && j < 64; j++) {
                if (hs[j] != h) continue;
                ref->node = i;
                ref->k = k;
                ref->j = j;
                ref->post = h->kind == GJ_AG_HOOK_POST_ACCUMULATE;
                ref->n_out = 0;
                return 0;
            }
        }
    }
    return -1;
}

/* A tensor hook becomes an opaque call node (COPY with a hook index): the
 * program runs the hook on the real gradient and takes what it returns. */
static gj_val *rec_call_hook(gj_ag_builder *b, const gj_ag_hook *h, gj_val *grad) {
    recorder *r = (recorder *)b;
    gj_jit_hookref ref;
    if (find_hook(r->w, h, &ref) != 0) {
        fail_reason(r, false, "a hook that is not on the walked graph");
        gj_rt_set_error("jit capture: hook #%lld not found on the graph", (long long)h->handle);
        return NULL;
    }
    int hi = gj_jit_graph_add_hook(&r->cap->g, &ref);
    if (hi < 0) return NULL;
    gj_rt_inst copy = {.prim = GJ_P_COPY, .n_in = 1};
    int in = val_id(grad), out;
    if (gj_jit_graph_add_node(&r->cap->g, &copy, &in, &out) < 0) return NULL;
    r->cap->g.nodes[r->cap->g.n_nodes - 1].hook = hi;
    return id_val(out);
}

/* A post-accumulate hook is recorded in order, with the number of outputs
 * (.grads) recorded before it; the program runs it right after writing
 * those, as the engine does. */
static int rec_call_post_hook(gj_ag_builder *b, const gj_ag_hook *h, gj_tensor *leaf) {
    recorder *r = (recorder *)b;
    (void)leaf;
    gj_jit_hookref ref;
    if (find_hook(r->w, h, &ref) != 0) {
        fail_reason(r, false, "a post-accumulate hook that is not on the walked graph");
        gj_rt_set_error("jit capture: hook #%lld not found on the graph", (long long)h->handle);
        return -1;
    }
    ref.n_out = r->cap->g.n_outputs; /* its leaf's output is the last one */
    return gj_jit_graph_add_hook(&r->cap->g, &ref) < 0 ? -1 : 0;
}

static bool same_attrs(const gj_ag_attrs *a, const gj_ag_attrs *b) {
    if (a->nf != b->nf || a->ni != b->ni) return false;
    for (int k = 0; k < a->nf; k++)
        if (memcmp(&a->f[k], &b->f[k], sizeof a->f[k]) != 0) return false;
    for (int k = 0; k < a->ni; k++)
        if (a->i[k] != b->i[k]) return false;
    return true;
}

/* The checkpoint node of the walk whose tape holds an op of node's opdef
 * and attributes (the temporary node of a tape's backward): its canonical
 * index and *tape the op's position, or -1. Two such ops of one tape are
 * the same call (same function, same scalars), so the first one serves. */
static int find_tape_op(const gj_jit_walk *w, const gj_ag_node *node, int *tape) {
    for (int i = 0; i < w->n; i++) {
        int n_ops = gj_ag_ckpt_n_ops(w->nodes[i]);
        for (int j = 0; j < n_ops; j++) {
            const gj_ag_attrs *at = NULL;
            if (gj_ag_ckpt_op(w->nodes[i], j, &at) == node->op && at &&
                same_attrs(at, &node->attrs)) {
                *tape = j;
                return i;
            }
        }
    }
    return -1;
}

/* A custom op's backward becomes one opaque call node: its inputs are the
 * output gradients (zeros of the output's meta where none flows, as the
 * eager call materializes them) and the saved tensor arguments; its
 * outputs the gradients of the needed inputs, of the saved arguments'
 * metas (what gj_ag_custom_run_backward enforces). */
static int rec_call_custom(gj_ag_builder *b, gj_ag_node *node, gj_val *const *gout,
                           gj_val *const *saved, const bool *needs, gj_val **gin) {
    recorder *r = (recorder *)b;
    const gj_custom_op *op = gj_ag_custom_of(node->op);
    int nt = gj_ag_custom_n_tensor_args(op), no = gj_ag_custom_n_outputs(op);
    int ci = gj_jit_walk_find(r->w, node), tape = -1;
    if (ci < 0) /* a node of a checkpoint tape's backward: find its op there */
        ci = find_tape_op(r->w, node, &tape);
    if (ci < 0) {
        fail_reason(r, false, "a custom op node that is not on the walked graph");
        gj_rt_set_error("jit capture: custom op %s: node not found on the graph", node->op->name);
        return -1;
    }
    int n_need = 0;
    for (int i = 0; i < nt; i++) n_need += needs[i];
    if (no + nt > GJ_JIT_CALL_MAX_IN || n_need > GJ_RT_MAX_OUTPUTS) {
        fail_reason(r, true, "custom op %s: %d outputs and %d tensor arguments (%d needing a "
                    "gradient) exceed a compiled call (at most %d inputs in all, %d gradients)",
                    node->op->name, no, nt, n_need, GJ_JIT_CALL_MAX_IN, GJ_RT_MAX_OUTPUTS);
        gj_rt_set_error("jit capture: %s", r->cap->reason);
        return -1;
    }
    int in[GJ_JIT_CALL_MAX_IN], outs[GJ_RT_MAX_OUTPUTS];
    gj_rt_meta om[GJ_RT_MAX_OUTPUTS];
    for (int k = 0; k < no; k++) {
        gj_val *g = gout[k];
        if (!g) {
            const gj_rt_meta *m = &node->out_meta[k];
            g = gj_ag_fill(b, m->dtype, m->ndim, m->shape, 0.0);
            if (!g) return -1;
        }
        in[k] = val_id(g);
    }
    uint32_t args = 0;
    for (int i = 0, j = 0; i < nt; i++) {
        in[no + i] = val_id(saved[i]);
        if (!needs[i]) continue;
        om[j++] = r->cap->g.values[in[no + i]].meta;
        args |= 1u << i;
    }
    if (gj_jit_graph_add_custom(&r->cap->g, ci, tape, args, no + nt, in, n_need, om, outs) < 0)
        return -1;
    for (int i = 0, j = 0; i < nt; i++) gin[i] = needs[i] ? id_val(outs[j++]) : NULL;
    return 0;
}

/* The checkpoint node of the walk whose tape holds an op of opdef op with
 * attributes a whose inputs had metas im[0..n_in): its canonical index,
 * *tape the op's position and om[] / *n_out its output metas; or -1. Two
 * such ops are the same call (same function, scalars and shapes), so the
 * first one serves. */
static int find_tape_fwd(const gj_jit_walk *w, const gj_ag_opdef *op, const gj_ag_attrs *a,
                         int n_in, const gj_rt_meta *im, int *tape, gj_rt_meta *om, int *n_out) {
    for (int i = 0; i < w->n; i++) {
        int n_ops = gj_ag_ckpt_n_ops(w->nodes[i]);
        for (int j = 0; j < n_ops; j++) {
            const gj_ag_attrs *at = NULL;
            if (gj_ag_ckpt_op(w->nodes[i], j, &at) != op || !at || !same_attrs(at, a)) continue;
            gj_rt_meta tin[GJ_AG_MAX_IN];
            int tn = 0, no = gj_ag_ckpt_op_metas(w->nodes[i], j, &tn, tin, om);
            bool same = no >= 0 && tn == n_in;
            for (int k = 0; k < n_in && same; k++) same = gj_jit_meta_equal(&tin[k], &im[k]);
            if (!same) continue;
            *tape = j;
            *n_out = no;
            return i;
        }
    }
    return -1;
}

/* A custom op's forward, replayed by a checkpoint region's backward,
 * becomes one opaque call node: its inputs the tensor arguments, its
 * outputs those the region's first run had (metas from the tape). */
static int rec_call_custom_fwd(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a,
                               int n_in, gj_val *const *in, gj_val **outs) {
    recorder *r = (recorder *)b;
    gj_rt_meta im[GJ_AG_MAX_IN], om[GJ_AG_MAX_OUT];
    if (n_in > GJ_AG_MAX_IN) {
        gj_rt_set_error("jit capture: custom op %s with %d tensor arguments", op->name, n_in);
        return -1;
    }
    for (int i = 0; i < n_in; i++) im[i] = r->cap->g.values[val_id(in[i])].meta;
    int tape = -1, n_out = 0;
    int ci = find_tape_fwd(r->w, op, a, n_in, im, &tape, om, &n_out);
    if (ci < 0) {
        fail_reason(r, false, "a recomputed custom op %s that is on no checkpoint tape of the "
                    "walked graph", op->name);
        gj_rt_set_error("jit capture: custom op %s: tape op not found", op->name);
        return -1;
    }
    if (n_in > GJ_JIT_CALL_MAX_IN || n_out > GJ_RT_MAX_OUTPUTS) {
        fail_reason(r, true, "custom op %s: %d tensor arguments and %d outputs exceed a "
                    "compiled forward call (at most %d and %d)", op->name, n_in, n_out,
                    GJ_JIT_CALL_MAX_IN, GJ_RT_MAX_OUTPUTS);
        gj_rt_set_error("jit capture: %s", r->cap->reason);
        return -1;
    }
    int ids[GJ_JIT_CALL_MAX_IN], out_ids[GJ_RT_MAX_OUTPUTS];
    for (int i = 0; i < n_in; i++) ids[i] = val_id(in[i]);
    if (gj_jit_graph_add_custom(&r->cap->g, ci, tape, 0, n_in, ids, n_out, om, out_ids) < 0)
        return -1;
    r->cap->g.nodes[r->cap->g.n_nodes - 1].custom_fwd = true;
    for (int k = 0; k < n_out; k++) outs[k] = id_val(out_ids[k]);
    return n_out;
}

/* gj_grad mode: the engine's gj_grad traversal; the gradient of each
 * requested input becomes a graph output (acc_node -1, nothing in place),
 * one per distinct edge, in the order of their first request (cap->ret).
 * 0, or -1 (error set). */
static int capture_grad(recorder *r, int n_roots, gj_tensor *const *roots,
                        gj_val *const *seed_vals) {
    const gj_jit_walk *w = r->w;
    gj_jit_capture *cap = r->cap;
    int rc = -1;
    gj_val **gv = gj_rt_calloc((size_t)w->n_req + 1, sizeof *gv);
    cap->ret = gj_rt_calloc((size_t)w->n_req + 1, sizeof *cap->ret);
    if (!gv || !cap->ret) goto done;
    if (gj_ag_run_backward(&r->b, n_roots, roots, seed_vals, w->n_req, w->req_inputs, gv, true,
                           false) != 0)
        goto done;
    for (int i = 0; i < w->n_req; i++) {
        cap->ret[i] = -1;
        if (!gv[i]) continue; /* unreachable: the caller decides (allow_unused) */
        for (int j = 0; j < i && cap->ret[i] < 0; j++)
            if (w->req_node[j] == w->req_node[i] && w->req_nr[j] == w->req_nr[i])
                cap->ret[i] = cap->ret[j]; /* the same edge again: the same gradient */
        if (cap->ret[i] >= 0) continue;
        cap->ret[i] = cap->g.n_outputs;
        if (gj_jit_graph_add_output(&cap->g, val_id(gv[i]), -1, -1) != 0) goto done;
    }
    rc = 0;
done:
    gj_rt_free(gv);
    return rc;
}

void gj_jit_recorder_init(gj_jit_recorder *r, gj_jit_capture *cap, const gj_jit_walk *w) {
    memset(r, 0, sizeof *r);
    r->b = (gj_ag_builder){.emit = rec_emit,
                           .meta = rec_meta,
                           .constant = rec_constant,
                           .keep = rec_keep,
                           .drop = rec_drop,
                           .end_node = rec_end_node,
                           .accumulate = rec_accumulate,
                           .records = true,
                           .call_hook = rec_call_hook,
                           .call_post_hook = rec_call_post_hook,
                           .call_custom = rec_call_custom,
                           .call_custom_fwd = rec_call_custom_fwd};
    r->cap = cap;
    r->w = w;
}

int gj_jit_capture_run(gj_jit_capture *cap, const gj_jit_walk *w, int n_roots,
                       gj_tensor *const *roots, gj_tensor *const *seeds) {
    memset(cap, 0, sizeof *cap);
    cap->code = GJ_CA_OTHER;
    gj_jit_graph_init(&cap->g);
    cap->g.walk_nodes = w->nodes; /* leaf names in GRADJIT_LOG=graph */
    cap->g.n_walk_nodes = w->n;
    recorder r;
    gj_jit_recorder_init(&r, cap, w);
    int rc = -1;
    gj_val **seed_vals = gj_rt_calloc((size_t)n_roots + 1, sizeof *seed_vals);
    if (!seed_vals) goto done;
    for (int i = 0; i < n_roots; i++) {
        int v;
        if (seeds && seeds[i]) {
            v = gj_jit_recorder_input(&r, seeds[i], GJ_JIT_IN_SEED, -1, i);
        } else {
            gj_rt_inst fill = {.prim = GJ_P_FILL, .n_in = 0, .scalar = 1.0,
                               .dtype = roots[i]->dtype, .ndim = roots[i]->ndim};
            memcpy(fill.shape, roots[i]->shape, (size_t)roots[i]->ndim * sizeof fill.shape[0]);
            if (gj_jit_graph_add_node(&cap->g, &fill, NULL, &v) < 0) v = -1;
        }
        if (v < 0) goto done;
        seed_vals[i] = id_val(v);
    }
    if (w->grad_mode) {
        rc = capture_grad(&r, n_roots, roots, seed_vals);
        goto done;
    }
    if (gj_ag_run_backward(&r.b, n_roots, roots, seed_vals, 0, NULL, NULL, true, true) != 0)
        goto done;
    rc = 0;
done:
    if (rc != 0 && !cap->reason[0])
        snprintf(cap->reason, sizeof cap->reason, "capture failed: %s", gj_last_error());
    gj_rt_free(seed_vals);
    return rc;
}

void gj_jit_capture_free(gj_jit_capture *cap) {
    if (!cap) return;
    gj_jit_graph_free(&cap->g);
    gj_rt_free(cap->tensors);
    gj_rt_free(cap->ret);
    memset(cap, 0, sizeof *cap);
}
