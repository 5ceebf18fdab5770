/* SPDX-License-Identifier: MIT */
/*
 * step_capture.c - the graph of a training step (step_int.h): the traced
 * forward replayed with the recording builder, the backward of the loss
 * with respect to the parameters captured as a gj_grad's is, and each
 * parameter's optimizer update, written once for the whole step.
 *
 * Invariants:
 *   - The forward is the trace's ops, run again through their own forward
 *     formulas (gj_ag_forward_vals) on the recording builder: the values
 *     the eager run computed, from the same formulas. Each node the eager
 *     forward made saved aliases of some of them; the backward formulas ask
 *     the builder for those aliases as constants, and get the forward's
 *     value instead (resolve): nothing of the traced run is read at run
 *     time but the step's inputs, parameters, optimizer state and the
 *     trace's constants.
 *   - The backward is the engine's gj_grad traversal from the loss (seed
 *     1) to the parameters that require grad: each parameter's gradient is
 *     the sum the eager backward accumulates into a fresh .grad (cast to
 *     the parameter's dtype, as that accumulate does).
 *   - The update is the optimizer's own formula (autograd/optim_*.c, the
 *     one the eager step interprets), with every scalar a run-time value
 *     of the HYPER input (never a constant of the program): the eager
 *     step's bits.
 *   - Dropout masks are drawn from the generator at run time: a mask the
 *     traced forward drew at counter rng0 + k is drawn at the run's first
 *     counter + k (GJ_JIT_RT_STEP).
 */
#include "jit/step/step_int.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

typedef struct saved_val {
    const gj_tensor *t; /* a saved alias of the traced forward */
    int v;              /* its value in the graph */
} saved_val;

typedef struct scap {
    gj_jit_recorder r;
    const gj_jit_step_spec *s;
    int *slot_val;   /* per trace slot: value id, or -1 */
    saved_val *saved;
    int n_saved, cap_saved;
    int hyper;       /* value id of the HYPER input, or -1 */
    gj_tensor *hyper_t;
    gj_tensor **made; /* state stand-ins for a step whose state does not exist yet */
    int n_made;
    int (*esaved)[GJ_AG_MAX_SAVED]; /* per trace entry: the values its formula saved */
    int *post;       /* per parameter, then (ZeRO) per reducer parameter at n + i: the
                        value its post-accumulate hooks leave, or -1 */
    int cur_entry;   /* the trace entry being replayed, or -1 (the backward) */
    int (*rec_custom_fwd)(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a,
                          int n_in, gj_val *const *in, gj_val **outs); /* the recorder's */
    bool *gave;      /* the same indices: the post hooks' call gives it to the reducer */
} scap;

static void fail(scap *c, bool permanent, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(scap *c, bool permanent, const char *fmt, ...) {
    gj_jit_capture *cap = c->r.cap;
    if (cap->reason[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cap->reason, sizeof cap->reason, fmt, ap);
    va_end(ap);
    cap->permanent = permanent;
}

/* A step input of kind `kind`, index `index`, for tensor t: its value id,
 * or -1 (OOM). *input (may be NULL) receives its graph input index. */
static int step_input(scap *c, gj_tensor *t, int kind, int index, int *input) {
    int v = gj_jit_recorder_input(&c->r, t, GJ_JIT_IN_STEP, kind, index);
    if (input) *input = c->r.cap->g.n_inputs - 1;
    return v;
}

/* The value of trace slot s (its graph input made on first use). -1 with
 * the reason set. */
static int slot_value(scap *c, int s) {
    if (c->slot_val[s] >= 0) return c->slot_val[s];
    const gj_ag_trace_slot *sl = &c->s->tr->slots[s];
    int v = -1;
    switch (sl->kind) {
    case GJ_AG_SLOT_INPUT: v = step_input(c, sl->t, GJ_JIT_STEPIN_INPUT, sl->index, NULL); break;
    case GJ_AG_SLOT_PARAM: v = step_input(c, sl->t, GJ_JIT_STEPIN_PARAM, sl->index, NULL); break;
    case GJ_AG_SLOT_CONST: v = step_input(c, sl->t, GJ_JIT_STEPIN_CONST, sl->index, NULL); break;
    case GJ_AG_SLOT_ALIAS: v = slot_value(c, sl->alias_of); break;
    case GJ_AG_SLOT_OUTPUT:
        fail(c, true, "internal: slot %d used before entry %d made it", s, sl->index);
        return -1;
    }
    if (v < 0) fail(c, false, "out of memory");
    c->slot_val[s] = v;
    return v;
}

static int note_saved(scap *c, const gj_tensor *t, int v) {
    if (c->n_saved == c->cap_saved) {
        int nc = c->cap_saved ? 2 * c->cap_saved : 64;
        saved_val *p = gj_rt_realloc(c->saved, (size_t)nc * sizeof *p);
        if (!p) return -1;
        c->saved = p;
        c->cap_saved = nc;
    }
    c->saved[c->n_saved++] = (saved_val){t, v};
    return 0;
}

/* gj_jit_recorder.resolve: a saved tensor the backward formulas read is
 * the forward value it aliases. */
static int resolve_saved(void *ctx, gj_tensor *t) {
    scap *c = ctx;
    for (int i = c->n_saved - 1; i >= 0; i--)
        if (c->saved[i].t == t) return c->saved[i].v;
    fail(c, true, "the backward reads a tensor the traced forward did not save");
    gj_rt_set_error("jit step capture: %s", c->r.cap->reason);
    return -1;
}

/* gj_jit_recorder.dropout: a mask the traced forward drew is drawn again
 * from the same place of the run's own stretch of the generator. */
static int step_dropout(void *ctx, uint64_t seed, uint64_t offset, int *rt_node, int *rt_tape) {
    scap *c = ctx;
    const gj_ag_trace *tr = c->s->tr;
    if (seed != tr->seed || offset < tr->rng0 || offset >= tr->rng1 ||
        offset - tr->rng0 > (uint64_t)INT_MAX) {
        fail(c, true, "a dropout mask the step function did not draw");
        gj_rt_set_error("jit step capture: %s", c->r.cap->reason);
        return -1;
    }
    *rt_node = (int)(offset - tr->rng0);
    *rt_tape = GJ_JIT_RT_STEP;
    return 0;
}

/* The trace entry of op #pos of checkpoint node n's tape, or -1. */
static int region_entry(const gj_ag_trace *tr, const gj_ag_node *n, int pos) {
    for (int j = 0; j < tr->n_entries; j++)
        if (tr->entries[j].ckpt == n && tr->entries[j].tape_pos == pos) return j;
    return -1;
}

/* Whether tensors a and b are the same view of the same storage. */
static bool same_view(const gj_tensor *a, const gj_tensor *b) {
    return a->storage == b->storage && a->offset == b->offset && a->ndim == b->ndim &&
           a->dtype == b->dtype &&
           memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) == 0 &&
           memcmp(a->strides, b->strides, (size_t)a->ndim * sizeof a->strides[0]) == 0;
}

/* A checkpoint region's own entry j: its outputs are values its ops made
 * (or, passed through, values from before it); the tensors the region
 * stored for its backward (the node's saved ones and the tape's) are the
 * forward values they alias (resolve_saved). 0 or -1 (reason set). */
static int region_done(scap *c, int j) {
    const gj_ag_trace *tr = c->s->tr;
    const gj_ag_trace_entry *e = &tr->entries[j];
    for (int k = 0; k < e->n_out; k++) {
        const gj_tensor *t = tr->slots[e->out[k]].t;
        int v = -1;
        for (int q = e->out[k] - 1; q >= 0 && v < 0; q--)
            if (tr->slots[q].t == t || same_view(tr->slots[q].t, t)) v = slot_value(c, q);
        if (v < 0) {
            fail(c, true, "a checkpoint region's output %d is no value of the step", k);
            return -1;
        }
        c->slot_val[e->out[k]] = v;
    }
    if (!e->node) return 0; /* nothing requires grad in it */
    gj_ag_ckpt_info info;
    if (gj_ag_ckpt_info_of(e->node, &info) != 0) {
        fail(c, true, "internal: a checkpoint region without its tape");
        return -1;
    }
    for (int k = 0; k < info.n_stored; k++) {
        int kind, op, idx, v = -1;
        gj_tensor *t = gj_ag_ckpt_stored(e->node, k, NULL);
        int re = gj_ag_ckpt_stored_origin(e->node, k, &kind, &op, &idx) == 0
                     ? region_entry(tr, e->node, op)
                     : -1;
        if (t && re >= 0) {
            const gj_ag_trace_entry *r = &tr->entries[re];
            if (kind == GJ_AG_STORED_OUTPUT) v = c->slot_val[r->out[idx]];
            else if (kind == GJ_AG_STORED_INTERNAL) v = c->esaved[re][idx];
            else v = slot_value(c, r->in[idx]);
        }
        if (v < 0) {
            fail(c, true, "a value a checkpoint region stored is no value of the step");
            return -1;
        }
        if (note_saved(c, t, v) != 0) {
            fail(c, false, "out of memory");
            return -1;
        }
    }
    return 0;
}

/* gj_ag_builder.call_custom_fwd: a custom op the step function called
 * becomes one call of its forward C function (the program runs it on
 * copies of its tensor arguments), named by its trace entry; a custom op
 * a checkpoint region recomputes in the backward is the recorder's own
 * call, named by its tape. */
static int step_custom_fwd(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a,
                           int n_in, gj_val *const *in, gj_val **outs) {
    scap *c = (scap *)(void *)b;
    if (c->cur_entry < 0) return c->rec_custom_fwd(b, op, a, n_in, in, outs);
    const gj_ag_trace_entry *e = &c->s->tr->entries[c->cur_entry];
    if (n_in != e->n_in || n_in > GJ_JIT_CALL_MAX_IN || e->n_out > GJ_RT_MAX_OUTPUTS) {
        fail(c, true, "custom op %s: %d tensor arguments and %d outputs exceed a call "
             "instruction (%d, %d)", op->name, n_in, e->n_out, GJ_JIT_CALL_MAX_IN,
             GJ_RT_MAX_OUTPUTS);
        gj_rt_set_error("jit step capture: %s", c->r.cap->reason);
        return -1;
    }
    int ids[GJ_JIT_CALL_MAX_IN], out_ids[GJ_RT_MAX_OUTPUTS];
    gj_rt_meta om[GJ_RT_MAX_OUTPUTS];
    for (int i = 0; i < n_in; i++) ids[i] = gj_jit_rec_id(in[i]);
    for (int k = 0; k < e->n_out; k++) om[k] = c->s->tr->slots[e->out[k]].meta;
    gj_jit_graph *g = &c->r.cap->g;
    if (gj_jit_graph_add_custom(g, c->cur_entry, GJ_JIT_CALL_STEP_FWD, 0, n_in, ids, e->n_out,
                                om, out_ids) < 0)
        return -1;
    g->nodes[g->n_nodes - 1].custom_fwd = true;
    for (int k = 0; k < e->n_out; k++) outs[k] = gj_jit_rec_val(out_ids[k]);
    return e->n_out;
}

/* Replays entry j of the trace: its outputs' values, and the values its
 * formula saved (for resolve_saved through its node, or through the
 * region whose tape holds it). 0 or -1 (reason set). */
static int replay_entry(scap *c, int j) {
    const gj_ag_trace_entry *e = &c->s->tr->entries[j];
    gj_ag_builder *b = &c->r.b;
    if (e->op == &gj_ag_op_checkpoint) return region_done(c, j);
    c->cur_entry = j; /* (a custom op's forward call names it) */
    gj_val *in[GJ_AG_MAX_IN], *out[GJ_AG_MAX_OUT] = {0}, *saved[GJ_AG_MAX_SAVED];
    for (int i = 0; i < e->n_in; i++) {
        int v = slot_value(c, e->in[i]);
        if (v < 0) return -1;
        in[i] = gj_jit_rec_val(v);
    }
    int n_saved = 0, n0 = c->r.cap->g.n_nodes;
    int n = gj_ag_forward_vals(b, e->op, &e->attrs, e->n_in, in, out, &n_saved, saved);
    c->cur_entry = -1;
    if (e->ckpt || e->in_region) /* a region's op: its policy, not the budget, decides */
        for (int i = n0; i < c->r.cap->g.n_nodes; i++) c->r.cap->g.nodes[i].pinned = true;
    if (n != e->n_out) {
        fail(c, false, "replaying op %s of the step: %s", e->op->name,
             n < 0 ? gj_last_error() : "another number of outputs");
        return -1;
    }
    const gj_jit_graph *g = &c->r.cap->g;
    for (int k = 0; k < n; k++) {
        int v = gj_jit_rec_id(out[k]);
        const gj_rt_meta *want = &c->s->tr->slots[e->out[k]].meta;
        if (!gj_jit_meta_equal(&g->values[v].meta, want)) {
            fail(c, true, "replaying op %s of the step gave another shape or dtype", e->op->name);
            return -1;
        }
        c->slot_val[e->out[k]] = v;
    }
    for (int s = 0; s < n_saved; s++) c->esaved[j][s] = gj_jit_rec_id(saved[s]);
    if (e->node) {
        if (e->node->n_saved != n_saved) {
            fail(c, true, "replaying op %s of the step saved %d values, its node %d", e->op->name,
                 n_saved, e->node->n_saved);
            return -1;
        }
        for (int s = 0; s < n_saved; s++)
            if (note_saved(c, e->node->saved[s].t, gj_jit_rec_id(saved[s])) != 0) {
                fail(c, false, "out of memory");
                return -1;
            }
    }
    return 0;
}

/* ------------------------------------------------------------ update */

static gj_val *cast_to(gj_ag_builder *b, gj_val *x, gj_dtype dt) {
    gj_rt_meta m;
    gj_ag_meta(b, x, &m);
    return m.dtype == dt ? x : gj_ag_cast(b, x, dt);
}

/* Scalar j of parameter p's run-time scalars (j == GJ_AG_OPT_MAX_HYPER
 * with p == n: the clip norm), as a 0-d value in dtype dt (the double cast
 * as the eager update casts it). */
static gj_val *hyper(scap *c, int p, int j, gj_dtype dt) {
    gj_ag_builder *b = &c->r.b;
    if (c->hyper < 0) {
        int64_t n = (int64_t)c->s->opt->n * GJ_AG_OPT_MAX_HYPER + 1;
        c->hyper_t = gj_rt_tensor_new(GJ_F64, 1, &n);
        if (!c->hyper_t) return NULL;
        memcpy(gj_rt_data_ptr(c->hyper_t), c->s->opt->hyper, (size_t)n * sizeof(double));
        c->hyper = step_input(c, c->hyper_t, GJ_JIT_STEPIN_HYPER, 0, NULL);
        if (c->hyper < 0) return NULL;
    }
    gj_rt_inst sl = {.prim = GJ_P_SLICE, .n_in = 1, .axis = 0,
                     .start = (int64_t)p * GJ_AG_OPT_MAX_HYPER + j, .len = 1};
    gj_val *h = gj_jit_rec_val(c->hyper);
    gj_val *x = gj_ag_emit1(b, &sl, &h);
    x = x ? gj_ag_reshape(b, x, 0, NULL) : NULL;
    return x ? cast_to(b, x, dt) : NULL;
}

/* The graph input of parameter p's state tensor t (kind STATE1/STATE2):
 * before the optimizer's first update t does not exist yet, and a tensor
 * of the meta the optimizer will give it (its compute type, contiguous)
 * stands in for it: only its meta is read (the program reads the real
 * state at run time), so its memory is left untouched -- zeroing the state
 * of a large model cost most of its step's capture. Value id, or -1. */
static int state_input(scap *c, gj_tensor *t, int kind, int p, int *input) {
    if (!t) {
        const gj_tensor *pt = c->s->opt->params[p];
        t = gj_rt_tensor_empty(gj_ag_opt_dtype(pt->dtype), pt->ndim, pt->shape);
        if (!t) return -1;
        c->made[c->n_made++] = t;
    }
    return step_input(c, t, kind, p, input);
}

/* Emits parameter p's update from its gradient g -- the optimizer's own
 * formula (opt->def->update, the one the eager step interprets) on the
 * recording builder -- and writes its outputs: the parameter and its
 * state, in place; when ok (a 0-d f64 value) is given, only where it is
 * nonzero (a clipping step's finite norm: else every output is its old
 * value). 0 or -1. */
static int emit_update(scap *c, int p, gj_val *g, gj_val *ok) {
    const gj_jit_opt *o = c->s->opt;
    const gj_ag_optdef *def = o->def;
    gj_ag_builder *b = &c->r.b;
    gj_jit_graph *gr = &c->r.cap->g;
    gj_tensor *pt = o->params[p];
    gj_dtype pd = pt->dtype, T = gj_ag_opt_dtype(pd);
    int pin = -1, s_in[GJ_AG_OPT_MAX_STATE] = {-1, -1};
    /* the parameter's input (the one the forward reads), written in place */
    int pv = slot_value(c, c->s->tr->n_inputs + p);
    if (pv < 0) return -1;
    for (int i = 0; i < gr->n_inputs; i++)
        if (gr->inputs[i].value == pv) pin = i;
    if (pin < 0) {
        fail(c, true, "internal: parameter %d has no input of its own", p);
        return -1;
    }
    gj_val *P = cast_to(b, gj_jit_rec_val(pv), T), *G = cast_to(b, g, T), *newp = NULL;
    gj_val *S[GJ_AG_OPT_MAX_STATE] = {0}, *Snew[GJ_AG_OPT_MAX_STATE] = {0};
    gj_val *H[GJ_AG_OPT_MAX_HYPER] = {0};
    gj_tensor *const *st[GJ_AG_OPT_MAX_STATE] = {o->s1, o->s2};
    if (!P || !G) goto oom;
    for (int k = 0; k < def->n_state; k++) {
        if (!def->uses_state(o->structure, k)) continue;
        int sv = state_input(c, st[k] ? st[k][p] : NULL, GJ_JIT_STEPIN_STATE1 + k, p, &s_in[k]);
        if (sv < 0) goto oom;
        S[k] = gj_jit_rec_val(sv);
    }
    for (int j = 0; j < def->n_hyper; j++)
        if (!(H[j] = hyper(c, p, j, T))) goto oom;
    if (def->update(b, o->structure, P, G, S, H, &newp, Snew) != 0 || !newp) goto oom;
    newp = cast_to(b, newp, pd);
    if (ok && newp) { /* keep the old values unless the norm was finite */
        newp = gj_ag_where(b, ok, newp, gj_jit_rec_val(pv));
        for (int k = 0; k < def->n_state; k++)
            if (S[k]) Snew[k] = Snew[k] ? gj_ag_where(b, ok, Snew[k], S[k]) : NULL;
    }
    if (!newp || gj_jit_graph_add_output(gr, gj_jit_rec_id(newp), -1, pin) != 0) goto oom;
    for (int k = 0; k < def->n_state; k++) {
        if (!S[k]) continue;
        if (!Snew[k] || gj_jit_graph_add_output(gr, gj_jit_rec_id(Snew[k]), -1, s_in[k]) != 0)
            goto oom;
    }
    return 0;
oom:
    fail(c, false, "building the %s update of parameter %d: %s", def->name, p, gj_last_error());
    return -1;
}


/* ----------------------------------------------------------- capture */

/* gj_clip_grad_norm on the gradients g[0..n) (NULL: none) in the graph,
 * as frontend/train.c computes it: per parameter the sum of squares in f64
 * (one SUM: the eager SUM kernel's order), added in parameter order; the
 * norm's square root; every gradient scaled by max / (norm + 1e-6) when
 * that is below 1 (in the gradient's dtype, as gj_mul_scalar_: bf16 in
 * f32). *ok receives 1 where the norm is finite, 0 otherwise (a NaN or
 * infinite norm: eager then fails, nothing updated); *norm the norm. 0 or
 * -1. */
static int emit_clip(scap *c, gj_val **g, int n, gj_val **ok, gj_val **norm) {
    gj_ag_builder *b = &c->r.b;
    gj_val *ss = gj_ag_fill(b, GJ_F64, 0, NULL, 0.0);
    for (int p = 0; p < n && ss; p++) {
        if (!g[p]) continue;
        gj_val *d = cast_to(b, g[p], GJ_F64);
        gj_rt_meta m;
        gj_ag_meta(b, d, &m);
        uint32_t all = m.ndim ? (uint32_t)((1u << m.ndim) - 1) : 0u;
        gj_val *sq = d ? gj_ag_binary(b, GJ_P_MUL, d, d) : NULL;
        gj_val *sp = sq ? (all ? gj_ag_sum(b, sq, all, false) : sq) : NULL;
        ss = sp ? gj_ag_binary(b, GJ_P_ADD, ss, sp) : NULL;
    }
    *norm = ss ? gj_ag_unary(b, GJ_P_SQRT, ss) : NULL;
    if (!*norm) return -1;
    gj_val *maxn = hyper(c, c->s->opt->n, 0, GJ_F64); /* after the last slot: the clip norm */
    gj_val *den = gj_ag_scalar_op(b, GJ_P_ADD_SCALAR, *norm, 1e-6);
    gj_val *coef = maxn && den ? gj_ag_binary(b, GJ_P_DIV, maxn, den) : NULL;
    gj_val *one = gj_ag_fill(b, GJ_F64, 0, NULL, 1.0);
    gj_val *below = coef && one ? gj_ag_unary(b, GJ_P_STEP, gj_ag_binary(b, GJ_P_SUB, one, coef))
                                : NULL; /* coef < 1 */
    gj_val *k = below ? gj_ag_where(b, below, coef, one) : NULL; /* x * 1 = x: no scaling */
    gj_val *zero = gj_ag_fill(b, GJ_F64, 0, NULL, 0.0);
    gj_val *diff = gj_ag_binary(b, GJ_P_SUB, *norm, *norm); /* 0 if finite, NaN if not */
    *ok = diff && zero ? gj_ag_binary(b, GJ_P_EQ, diff, zero) : NULL;
    if (!k || !*ok) return -1;
    for (int p = 0; p < n; p++) {
        if (!g[p]) continue;
        gj_rt_meta m;
        gj_ag_meta(b, g[p], &m);
        gj_dtype cdt = m.dtype == GJ_BF16 ? GJ_F32 : m.dtype;
        gj_val *x = gj_ag_binary(b, GJ_P_MUL, cast_to(b, g[p], cdt), cast_to(b, k, cdt));
        g[p] = x ? cast_to(b, x, m.dtype) : NULL;
        if (!g[p]) return -1;
    }
    return 0;
}

/* ------------------------------------------------- hooks and reducer */

/* The handle of the hook the reducer's calls replace on parameter p, or 0. */
static int64_t reducer_hook(const scap *c, int p) {
    const gj_jit_step_spec *s = c->s;
    return s->red && s->red_of[p] >= 0 ? s->red->hooks[s->red_of[p]] : 0;
}

/* ZeRO: the reducer's index of parameter t (a leaf the step function
 * reads, whose shard the optimizer updates), or -1. */
static int zero_index(const scap *c, const gj_tensor *t) {
    const gj_jit_reducer *red = c->s->red;
    for (int i = 0; red && red->zero && i < red->n; i++)
        if (red->params[i] == t) return i;
    return -1;
}

/* What the step's program cannot call, or NULL: a hook on a node that is
 * not a leaf's, or a post-accumulate hook on a leaf outside the optimizer
 * (its .grad accumulates: the hook would see eager's sum). The program
 * calls tensor hooks on leaves where the engine runs them, and each
 * parameter's post-accumulate hooks where its gradient is final. */
static const char *hooks_refused(const scap *c, const gj_jit_walk *w) {
    for (int i = 0; w && i < w->n; i++) {
        const gj_ag_node *n = w->nodes[i];
        for (int k = 0; k < GJ_AG_MAX_OUT; k++) {
            const gj_ag_hook *hs[64];
            int nh = gj_ag_node_hooks(n, k, hs, 64);
            if (nh <= 0) continue;
            if (n->kind != GJ_AG_ACCUMULATE || !n->leaf)
                return "a hook on a tensor the step function did not make (with autograd history)";
            int p = 0;
            while (p < c->s->opt->n && c->s->opt->params[p] != n->leaf) p++;
            int zi = zero_index(c, n->leaf);
            int64_t own = zi >= 0 ? c->s->red->hooks[zi] : 0;
            for (int j = 0; j < nh && j < 64; j++) /* (ZeRO: the reducer's parameters' are
                                                       called as the optimizer's are) */
                if (hs[j]->kind == GJ_AG_HOOK_POST_ACCUMULATE && p == c->s->opt->n && zi < 0 &&
                    hs[j]->handle != own)
                    return "a post-accumulate hook on a leaf outside the optimizer";
        }
    }
    return NULL;
}

/* gj_ag_builder.captured: the gradient of the leaf of accumulate node n
 * is complete (after its tensor hooks). A parameter with post-accumulate
 * hooks of the user's gets one call of them here, where eager runs them:
 * its input the gradient as .grad holds it (the parameter's dtype), its
 * output the .grad they leave (the reducer's own hook among them gives
 * the gradient to it in their order). */
static int step_captured(gj_ag_builder *b, gj_ag_node *n, gj_val *const *grads) {
    scap *c = (scap *)(void *)b;
    const gj_jit_opt *o = c->s->opt;
    if (n->kind != GJ_AG_ACCUMULATE || !grads[0]) return 0;
    int p = 0;
    while (p < o->n && o->params[p] != n->leaf) p++;
    int zi = p == o->n ? zero_index(c, n->leaf) : -1; /* (ZeRO: the call is n + zi's) */
    if (p == o->n && zi < 0) return 0;
    int at = zi >= 0 ? o->n + zi : p;
    int64_t mine = zi >= 0 ? c->s->red->hooks[zi] : reducer_hook(c, p);
    if (c->post[at] >= 0) return 0;
    const gj_ag_hook *hs[64];
    int nh = gj_ag_leaf_hooks(n->leaf, hs, 64), users = 0;
    bool own = false;
    for (int j = 0; j < nh && j < 64; j++) {
        if (hs[j]->kind != GJ_AG_HOOK_POST_ACCUMULATE) continue;
        if (hs[j]->handle == mine) own = true;
        else users++;
    }
    if (users == 0) return 0;
    gj_val *g = cast_to(b, grads[0], n->leaf->dtype);
    gj_rt_meta m;
    gj_rt_meta_of(n->leaf, &m);
    int in = g ? gj_jit_rec_id(g) : -1, out = -1;
    if (!g || gj_jit_graph_add_custom(&c->r.cap->g, at, GJ_JIT_CALL_POST, 0, 1, &in, 1, &m,
                                      &out) < 0) {
        fail(c, false, "out of memory");
        return -1;
    }
    c->post[at] = out;
    c->gave[at] = own;
    return 0;
}

/* Gives every parameter of the reducer its gradient g[p] (NULL: none), in
 * the reducer's order: one GIVE call each, which the plan places as soon
 * as that gradient is final. ZeRO: gz[i], the gradient of the reducer's
 * parameter i (the optimizer updates its shard), and the GIVE names i.
 * 0 or -1 (reason set). */
static int emit_gives(scap *c, gj_val **g, gj_val **gz) {
    const gj_jit_reducer *red = c->s->red;
    const gj_jit_opt *o = c->s->opt;
    for (int k = 0; k < red->n && red->zero; k++) {
        int i = red->order[k], in = gz[i] ? gj_jit_rec_id(gz[i]) : -1;
        if (c->gave[o->n + i]) continue; /* (its post hooks' call gave it) */
        if (gj_jit_graph_add_custom(&c->r.cap->g, i, GJ_JIT_CALL_GIVE, 0, gz[i] ? 1 : 0, &in, 0,
                                    NULL, NULL) < 0) {
            fail(c, false, "out of memory");
            return -1;
        }
    }
    for (int k = 0; k < red->n && !red->zero; k++) {
        int p = 0;
        while (p < o->n && c->s->red_of[p] != red->order[k]) p++;
        if (p == o->n) {
            fail(c, true, "internal: the reducer's parameter %d is not the optimizer's",
                 red->order[k]);
            return -1;
        }
        if (c->gave[p]) continue; /* (its post hooks' call gave it) */
        int in = g[p] ? gj_jit_rec_id(g[p]) : -1;
        if (gj_jit_graph_add_custom(&c->r.cap->g, p, GJ_JIT_CALL_GIVE, 0, g[p] ? 1 : 0, &in, 0,
                                    NULL, NULL) < 0) {
            fail(c, false, "out of memory");
            return -1;
        }
    }
    return 0;
}

/* Parameter p's reduced gradient (a TAKE call: a new contiguous value of
 * the parameter's meta), or NULL (reason set). */
static gj_val *emit_take(scap *c, int p) {
    gj_rt_meta m;
    gj_rt_meta_of(c->s->opt->params[p], &m);
    int out = -1;
    if (gj_jit_graph_add_custom(&c->r.cap->g, p, GJ_JIT_CALL_TAKE, 0, 0, NULL, 1, &m, &out) < 0) {
        fail(c, false, "out of memory");
        return NULL;
    }
    return gj_jit_rec_val(out);
}

/* The order of the updates: with a reducer, its parameters in its order
 * (each right after its gradient comes back), then the others. */
static void update_order(const scap *c, int *ord) {
    const gj_jit_opt *o = c->s->opt;
    const gj_jit_reducer *red = c->s->red;
    int n = 0;
    for (int k = 0; red && k < red->n; k++)
        for (int p = 0; p < o->n; p++)
            if (c->s->red_of[p] == red->order[k]) ord[n++] = p;
    for (int p = 0; p < o->n; p++)
        if (!red || c->s->red_of[p] < 0) ord[n++] = p;
}

/* The backward and the updates (a training step that is not eval). */
static int capture_train(scap *c, const gj_jit_walk *w) {
    const gj_jit_step_spec *s = c->s;
    const gj_jit_opt *o = s->opt;
    gj_jit_capture *cap = c->r.cap;
    gj_ag_builder *b = &c->r.b;
    int rc = -1;
    int n_ret0 = 2 * o->n + 1; /* the extra leaves' entries follow */
    gj_val **gv = gj_rt_calloc((size_t)w->n_req + 1, sizeof *gv);
    gj_val **g = gj_rt_calloc((size_t)o->n + 1, sizeof *g);
    int *ord = gj_rt_calloc((size_t)o->n + 1, sizeof *ord);
    gj_val **gz = gj_rt_calloc((size_t)(s->red ? s->red->n : 0) + 1, sizeof *gz); /* ZeRO */
    gj_val *ok = NULL, *norm = NULL;
    if (!gv || !g || !ord || !gz) goto oom;
    const gj_rt_meta *lm = &s->tr->slots[s->loss_slot].meta;
    gj_val *seed = gj_ag_fill(b, lm->dtype, lm->ndim, lm->shape, 1.0);
    if (!seed) goto oom;
    if (gj_ag_run_backward(b, 1, &s->loss, &seed, w->n_req, w->req_inputs, gv, true, false) !=
        0) {
        fail(c, false, "capturing the backward: %s", gj_last_error());
        goto done;
    }
    for (int q = 0; q < w->n_req; q++) {
        int p = 0;
        while (p < o->n && o->params[p] != w->req_inputs[q]) p++;
        int zi = p == o->n ? zero_index(c, w->req_inputs[q]) : -1;
        if (zi >= 0) { /* ZeRO: a parameter whose shard the optimizer updates: reduced */
            gz[zi] = !gv[q] ? NULL
                     : c->post[o->n + zi] >= 0 ? gj_jit_rec_val(c->post[o->n + zi])
                                                : cast_to(b, gv[q], w->req_inputs[q]->dtype);
            if (gv[q] && !gz[zi]) goto oom;
            continue;
        }
        if (p == o->n && gv[q]) { /* a leaf outside the optimizer: its gradient as made */
            for (int e = 0; e < s->n_extra; e++) {
                if (s->extra[e] != w->req_inputs[q] || cap->ret[n_ret0 + e] >= 0) continue;
                cap->ret[n_ret0 + e] = cap->g.n_outputs;
                if (gj_jit_graph_add_output(&cap->g, gj_jit_rec_id(gv[q]), -1, -1) != 0)
                    goto oom;
            }
            continue;
        }
        if (p == o->n || !gv[q]) continue; /* no gradient reaches it: not updated */
        g[p] = c->post[p] >= 0 ? gj_jit_rec_val(c->post[p]) /* what its post hooks left */
                               : cast_to(b, gv[q], o->params[p]->dtype); /* a fresh .grad's */
        if (!g[p]) goto oom;
    }
    if (s->red && emit_gives(c, g, gz) != 0) goto done;
    for (int k = 0; k < o->n; k++) ord[k] = k;
    if (s->red) update_order(c, ord);
    if (s->red && o->clip > 0) /* the norm is the reduced gradients' */
        for (int k = 0; k < o->n; k++)
            if (s->red_of[ord[k]] >= 0 && !(g[ord[k]] = emit_take(c, ord[k]))) goto done;
    if (o->clip > 0 && emit_clip(c, g, o->n, &ok, &norm) != 0) goto oom;
    for (int k = 0; k < o->n; k++) {
        int p = ord[k];
        if (s->red && o->clip <= 0 && s->red_of[p] >= 0 && !(g[p] = emit_take(c, p))) goto done;
        if (!g[p]) continue;
        if (s->keep_grads) {
            cap->ret[p] = cap->g.n_outputs;
            if (gj_jit_graph_add_output(&cap->g, gj_jit_rec_id(g[p]), -1, -1) != 0) goto oom;
        }
        if (emit_update(c, p, g[p], ok) != 0) goto done;
        cap->ret[o->n + p] = 1;
    }
    if (norm) { /* the run reads it: a non-finite norm fails the step */
        cap->ret[2 * o->n] = cap->g.n_outputs;
        if (gj_jit_graph_add_output(&cap->g, gj_jit_rec_id(norm), -1, -1) != 0) goto oom;
    }
    rc = 0;
    goto done;
oom:
    fail(c, false, "out of memory");
done:
    gj_rt_free(gv);
    gj_rt_free(g);
    gj_rt_free(ord);
    gj_rt_free(gz);
    return rc;
}

int gj_jit_capture_step(gj_jit_capture *cap, const gj_jit_walk *w, const gj_jit_step_spec *s) {
    memset(cap, 0, sizeof *cap);
    cap->code = GJ_CA_OTHER;
    gj_jit_graph_init(&cap->g);
    scap c;
    memset(&c, 0, sizeof c);
    gj_jit_recorder_init(&c.r, cap, w);
    c.r.resolve = resolve_saved;
    c.r.dropout = step_dropout;
    c.r.ctx = &c;
    c.s = s;
    c.hyper = -1;
    int rc = -1, n = s->opt->n;
    c.slot_val = gj_rt_malloc(((size_t)s->tr->n_slots + 1) * sizeof *c.slot_val);
    int n_ret = gj_jit_step_n_ret(n, s->n_extra);
    cap->ret = gj_rt_malloc(((size_t)n_ret + 1) * sizeof *cap->ret);
    c.made = gj_rt_calloc((size_t)2 * n + 1, sizeof *c.made);
    c.esaved = gj_rt_calloc((size_t)s->tr->n_entries + 1, sizeof *c.esaved);
    int nz = s->red && s->red->zero ? s->red->n : 0; /* (ZeRO: the reducer's parameters) */
    c.post = gj_rt_malloc(((size_t)(n + nz) + 1) * sizeof *c.post);
    c.gave = gj_rt_calloc((size_t)(n + nz) + 1, sizeof *c.gave);
    if (!c.slot_val || !cap->ret || !c.made || !c.esaved || !c.post || !c.gave) {
        fail(&c, false, "out of memory");
        goto done;
    }
    for (int k = 0; k < s->tr->n_slots; k++) c.slot_val[k] = -1;
    for (int p = 0; p < n + nz; p++) c.post[p] = -1;
    c.r.b.captured = step_captured;
    c.cur_entry = -1;
    c.rec_custom_fwd = c.r.b.call_custom_fwd;
    c.r.b.call_custom_fwd = step_custom_fwd;
    for (int p = 0; p < n; p++) {
        cap->ret[p] = -1;
        cap->ret[n + p] = 0;
    }
    for (int k = 2 * n; k < n_ret; k++) cap->ret[k] = -1;
    const char *refused = w && w->n_hooks > 0 ? hooks_refused(&c, w) : NULL;
    if (refused) {
        fail(&c, true, "the step's graph has %s: that step runs eagerly", refused);
        cap->code = GJ_CA_HOOK_GUARD;
        goto done;
    }
    for (int j = 0; j < s->tr->n_entries; j++)
        if (replay_entry(&c, j) != 0) goto done;
    int lv = slot_value(&c, s->loss_slot);
    if (lv < 0 || gj_jit_graph_add_output(&cap->g, lv, -1, -1) != 0) {
        fail(&c, false, "out of memory");
        goto done;
    }
    c.r.phase = 1; /* the backward: no CSE with the forward */
    if (!s->eval && capture_train(&c, w) != 0) goto done;
    rc = 0;
done:
    if (rc != 0 && !cap->reason[0])
        snprintf(cap->reason, sizeof cap->reason, "step capture failed: %s", gj_last_error());
    gj_rt_free(c.slot_val);
    gj_rt_free(c.saved);
    if (c.hyper_t) gj_rt_tensor_release(c.hyper_t);
    for (int k = 0; k < c.n_made; k++) gj_rt_tensor_release(c.made[k]);
    gj_rt_free(c.made);
    gj_rt_free(c.esaved);
    gj_rt_free(c.post);
    gj_rt_free(c.gave);
    return rc;
}
