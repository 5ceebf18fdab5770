/* SPDX-License-Identifier: MIT */
/*
 * node.c - graph nodes, per-tensor autograd metadata, and gj_ag_apply (run
 * an op's forward formula eagerly and record its node).
 *
 * Invariants (see also ag.h):
 *   - node->next[i].node is a strong reference (or NULL); releasing the
 *     last reference of a node releases its edges iteratively (a long chain
 *     of nodes must not overflow the C stack).
 *   - An ACCUMULATE node holds its leaf strongly; the leaf's meta->acc is a
 *     weak pointer that the node clears when it dies.
 *   - Saved tensors are detached aliases: they hold storage, not history.
 */
#include "ag.h"

#include <pthread.h>
#include <string.h>

static atomic_ullong g_seq;
static pthread_once_t g_ag_once = PTHREAD_ONCE_INIT;

static void meta_free(gj_tensor *t) {
    gj_ag_tensor_meta *m = t->ag;
    t->ag = NULL;
    if (!m) return;
    gj_ag_meta_set_grad(m, NULL);
    if (m->node) gj_ag_node_release(m->node);
    gj_ag_hooks_free(&m->hooks); /* a leaf's hooks die with it (autograd/hooks.c) */
    gj_ag_hooks_free(&m->post_hooks);
    /* m->acc is weak and cannot be alive here: it holds t strongly. */
    gj_rt_free(m);
}

static void ag_init(void) { gj_rt_set_ag_free(meta_free); }

void gj_ag_meta_set_grad(gj_ag_tensor_meta *m, gj_tensor *g) {
    gj_tensor *old = m->grad;
    if (g) atomic_fetch_add(&g->pinned, 1);
    m->grad = g;
    if (old) {
        atomic_fetch_sub(&old->pinned, 1);
        gj_rt_tensor_release(old);
    }
}

gj_ag_tensor_meta *gj_ag_meta_get(gj_tensor *t, bool create) {
    if (t->ag || !create) return t->ag;
    pthread_once(&g_ag_once, ag_init);
    gj_ag_tensor_meta *m = gj_rt_calloc(1, sizeof *m);
    if (!m) return NULL;
    t->ag = m;
    return m;
}

/* ------------------------------------------------------- leaf locks */

/* Accumulation into a leaf's .grad is serialised per leaf, as PyTorch does,
 * with striped recursive mutexes (a thread may meet its own stripe again:
 * a hook's backward on another leaf of the same stripe). */
#define GJ_AG_LEAF_LOCKS 64
static pthread_mutex_t g_leaf_locks[GJ_AG_LEAF_LOCKS];
static pthread_once_t g_leaf_once = PTHREAD_ONCE_INIT;

static void leaf_locks_init(void) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    for (int i = 0; i < GJ_AG_LEAF_LOCKS; i++) pthread_mutex_init(&g_leaf_locks[i], &a);
    pthread_mutexattr_destroy(&a);
}

int gj_ag_leaf_stripe(const gj_tensor *leaf) {
    uint64_t h = (uint64_t)(uintptr_t)leaf;
    h ^= h >> 29;
    h *= 0x9E3779B97F4A7C15ull;
    return (int)(h >> 58); /* 0..63 */
}

void gj_ag_leaf_lock(const gj_tensor *leaf) {
    pthread_once(&g_leaf_once, leaf_locks_init);
    pthread_mutex_lock(&g_leaf_locks[gj_ag_leaf_stripe(leaf)]);
}

void gj_ag_leaf_unlock(const gj_tensor *leaf) {
    pthread_mutex_unlock(&g_leaf_locks[gj_ag_leaf_stripe(leaf)]);
}

bool gj_ag_leaf_trylock_stripes(uint64_t stripes) {
    pthread_once(&g_leaf_once, leaf_locks_init);
    for (int i = 0; i < GJ_AG_LEAF_LOCKS; i++) {
        if (!((stripes >> i) & 1u)) continue;
        if (pthread_mutex_trylock(&g_leaf_locks[i]) != 0) {
            gj_ag_leaf_unlock_stripes(stripes & ((1ull << i) - 1)); /* the ones taken */
            return false;
        }
    }
    return true;
}

void gj_ag_leaf_unlock_stripes(uint64_t stripes) {
    for (int i = GJ_AG_LEAF_LOCKS - 1; i >= 0; i--)
        if ((stripes >> i) & 1u) pthread_mutex_unlock(&g_leaf_locks[i]);
}

void gj_ag_node_retain(gj_ag_node *n) { atomic_fetch_add(&n->refcount, 1); }

/* Frees one node whose count reached zero, pushing the edges whose count
 * reaches zero in turn onto the work list. */
void gj_ag_node_release(gj_ag_node *n) {
    if (!n || atomic_fetch_sub(&n->refcount, 1) != 1) return;
    gj_ag_node *stack_small[64];
    gj_ag_node **stack = stack_small;
    int64_t top = 0, cap = 64;
    stack[top++] = n;
    while (top > 0) {
        gj_ag_node *cur = stack[--top];
        for (int i = 0; i < cur->n_in; i++) {
            gj_ag_node *nx = cur->next[i].node;
            if (!nx || atomic_fetch_sub(&nx->refcount, 1) != 1) continue;
            if (top == cap) {
                gj_ag_node **bigger = gj_rt_malloc((size_t)cap * 2 * sizeof *bigger);
                if (!bigger) { /* cannot grow: free this one recursively instead */
                    atomic_store(&nx->refcount, 1);
                    gj_ag_node_release(nx);
                    continue;
                }
                memcpy(bigger, stack, (size_t)top * sizeof *bigger);
                if (stack != stack_small) gj_rt_free(stack);
                stack = bigger;
                cap *= 2;
            }
            stack[top++] = nx;
        }
        if (cur->kind == GJ_AG_OP && cur->op == &gj_ag_op_checkpoint)
            gj_ag_ckpt_node_free(cur); /* its tape (autograd/checkpoint.c) */
        for (int k = 0; k < cur->n_saved; k++)
            if (cur->saved[k].t) gj_rt_tensor_release(cur->saved[k].t);
        for (int k = 0; k < GJ_AG_MAX_OUT; k++) gj_ag_hooks_free(&cur->out_hooks[k]);
        if (cur->kind == GJ_AG_ACCUMULATE && cur->leaf) {
            gj_ag_tensor_meta *lm = cur->leaf->ag;
            gj_ag_leaf_lock(cur->leaf); /* against gj_ag_edge_of on another thread */
            if (lm && lm->acc == cur) lm->acc = NULL;
            gj_ag_leaf_unlock(cur->leaf);
            gj_rt_tensor_release(cur->leaf);
        }
        gj_rt_free(cur);
    }
    if (stack != stack_small) gj_rt_free(stack);
}

static gj_ag_node *node_new(gj_ag_node_kind kind) {
    gj_ag_node *n = gj_rt_calloc(1, sizeof *n);
    if (!n) return NULL;
    atomic_store(&n->refcount, 1);
    n->kind = kind;
    n->seq = atomic_fetch_add(&g_seq, 1);
    return n;
}

/* Edge for the gradient of t, holding a NEW reference to e.node (release
 * it, or store it in a node's next[]). Creates the accumulate node of a
 * leaf on first use (node NULL and an error set on OOM). */
gj_ag_edge gj_ag_edge_of(gj_tensor *t) {
    gj_ag_edge e = {NULL, 0};
    gj_ag_tensor_meta *m = t->ag;
    if (!m || !m->requires_grad) return e;
    if (m->node) {
        e.node = m->node;
        e.input_nr = m->output_nr;
        gj_ag_node_retain(e.node);
        return e;
    }
    /* m->acc is weak and shared by every graph (and thread) using the leaf:
     * under the leaf's lock, retain it only while its count is not zero (a
     * node whose last reference is being dropped on another thread is
     * never revived), else install a new one */
    gj_ag_leaf_lock(t);
    gj_ag_node *a = m->acc;
    if (a) {
        long c = atomic_load(&a->refcount);
        while (c > 0 && !atomic_compare_exchange_weak(&a->refcount, &c, c + 1)) {
        }
        if (c > 0) {
            gj_ag_leaf_unlock(t);
            e.node = a;
            return e;
        }
    }
    gj_ag_node *acc = node_new(GJ_AG_ACCUMULATE);
    if (acc) {
        gj_rt_tensor_retain(t);
        acc->leaf = t;
        acc->n_out = 1;
        gj_rt_meta_of(t, &acc->out_meta[0]);
        m->acc = acc; /* weak */
    }
    gj_ag_leaf_unlock(t);
    e.node = acc; /* the creation reference is the caller's (NULL on OOM) */
    return e;
}

/* ------------------------------------------------------------ contexts */

struct gj_ag_fctx {
    int n_saved;
    gj_val *saved[GJ_AG_MAX_SAVED];
    bool overflow;
};

void gj_ag_save(gj_ag_fctx *ctx, gj_val *v) {
    if (!ctx) return;
    if (ctx->n_saved == GJ_AG_MAX_SAVED) {
        ctx->overflow = true;
        return;
    }
    ctx->saved[ctx->n_saved++] = v;
}

struct gj_ag_bctx {
    gj_ag_node *node;
    gj_val *saved[GJ_AG_MAX_SAVED];
    const bool *needs;
};

gj_val *gj_ag_saved(gj_ag_bctx *ctx, int k) {
    return k >= 0 && k < ctx->node->n_saved ? ctx->saved[k] : NULL;
}
int gj_ag_n_inputs(gj_ag_bctx *ctx) { return ctx->node->n_in; }
bool gj_ag_needs_grad(gj_ag_bctx *ctx, int i) {
    return i >= 0 && i < ctx->node->n_in && ctx->needs[i];
}
const gj_rt_meta *gj_ag_input_meta(gj_ag_bctx *ctx, int i) { return &ctx->node->in_meta[i]; }
const gj_rt_meta *gj_ag_output_meta(gj_ag_bctx *ctx, int k) { return &ctx->node->out_meta[k]; }

/* Calls node->op->backward with saved tensors turned into values of b.
 * needs[i] says which inputs want a gradient. Used by the engine only. */
int gj_ag_node_backward(gj_ag_builder *b, gj_ag_node *node, const bool *needs,
                        gj_val *const *gout, gj_val **gin) {
    gj_ag_bctx ctx = {.node = node, .needs = needs};
    for (int k = 0; k < node->n_saved; k++) {
        ctx.saved[k] = b->constant(b, node->saved[k].t);
        if (!ctx.saved[k]) return -1;
    }
    return node->op->backward(b, &ctx, &node->attrs, gout, gin);
}

/* --------------------------------------------------------------- apply */

static bool any_requires_grad(int n_in, gj_tensor *const *in) {
    for (int i = 0; i < n_in; i++) {
        gj_ag_tensor_meta *m = in[i]->ag;
        if (m && m->requires_grad) return true;
    }
    return false;
}

/* Runs op's forward on the eager builder; records a node if needed.
 * outs[k]: new references. */
int gj_ag_apply(const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in, gj_tensor *const *in,
                gj_tensor **outs) {
    gj_ag_builder *b = gj_ag_eager_builder();
    gj_ag_ckpt_region *ckpt = gj_ag_ckpt_active(); /* in a checkpoint region: tape, no node */
    bool record = !ckpt && gj_ag_grad_enabled() && any_requires_grad(n_in, in);
    gj_ag_fctx fctx = {0};
    gj_val *vin[GJ_AG_MAX_IN];
    gj_val *vout[GJ_AG_MAX_OUT] = {0};
    gj_ag_node *node = NULL;
    int n_out = -1;
    if (n_in > GJ_AG_MAX_IN) {
        gj_rt_set_error("%s: too many inputs (%d > %d)", op->name, n_in, GJ_AG_MAX_IN);
        return -1;
    }
    for (int i = 0; i < n_in; i++) vin[i] = gj_ag_tensor_val(in[i]);
    n_out = op->forward(b, (record || ckpt) ? &fctx : NULL, a, n_in, vin, vout);
    if (n_out < 0) goto fail;
    if (fctx.overflow) {
        gj_rt_set_error("%s: internal: more than %d saved tensors", op->name, GJ_AG_MAX_SAVED);
        goto fail;
    }
    for (int k = 0; k < n_out; k++) {
        gj_tensor *t = gj_ag_val_tensor(vout[k]);
        /* A forward may hand back an input or a tensor with history (e.g.
         * an identity): outputs always get a fresh header of their own. */
        bool shared = t->ag != NULL;
        for (int i = 0; i < n_in; i++) shared |= t == in[i];
        outs[k] = shared ? gj_rt_tensor_alias(t) : (gj_rt_tensor_retain(t), t);
        if (!outs[k]) {
            for (int j = 0; j < k; j++) gj_rt_tensor_release(outs[j]);
            goto fail;
        }
    }
    int tape_pos = ckpt ? gj_ag_ckpt_tape_len(ckpt) : -1;
    if (ckpt && gj_ag_ckpt_note(ckpt, op, a, n_in, in, vout, n_out, outs, fctx.n_saved,
                                fctx.saved) != 0)
        goto fail_outs;
    if (record) {
        node = node_new(GJ_AG_OP);
        if (!node) goto fail_outs;
        node->op = op;
        if (a) node->attrs = *a;
        node->n_in = n_in;
        node->n_out = n_out;
        for (int i = 0; i < n_in; i++) {
            gj_rt_meta_of(in[i], &node->in_meta[i]);
            gj_ag_edge e = gj_ag_edge_of(in[i]); /* new reference, stored */
            gj_ag_tensor_meta *im = in[i]->ag;
            node->next[i] = e;
            if (im && im->requires_grad && !e.node) goto fail_node;
        }
        for (int k = 0; k < n_out; k++) gj_rt_meta_of(outs[k], &node->out_meta[k]);
        for (int s = 0; s < fctx.n_saved; s++) {
            gj_tensor *st = gj_ag_val_tensor(fctx.saved[s]);
            node->saved[s].t = gj_rt_tensor_alias(st);
            if (!node->saved[s].t) goto fail_node;
            if (st->name) { /* messages about the saved value quote the user's name */
                size_t nl = strlen(st->name) + 1;
                node->saved[s].t->name = gj_rt_malloc(nl);
                if (!node->saved[s].t->name) goto fail_node;
                memcpy(node->saved[s].t->name, st->name, nl);
            }
            node->saved[s].version = atomic_load(&st->storage->version);
            node->n_saved = s + 1;
        }
        for (int k = 0; k < n_out; k++) {
            if (!gj_rt_dtype_is_float(outs[k]->dtype)) continue;
            gj_ag_tensor_meta *om = gj_ag_meta_get(outs[k], true);
            if (!om) goto fail_node;
            om->requires_grad = true;
            om->node = node;
            om->output_nr = k;
            gj_ag_node_retain(node);
        }
        gj_ag_node_release(node); /* outputs own it now */
    }
    if (gj_ag_trace_active()) gj_ag_trace_note_op(op, a, n_in, in, n_out, outs, node, tape_pos);
    b->end_node(b);
    return n_out;

fail_node:
    /* outputs may already hold the node: detach them before releasing */
    for (int k = 0; k < n_out; k++) {
        gj_ag_tensor_meta *om = outs[k]->ag;
        if (om && om->node == node) {
            om->node = NULL;
            om->requires_grad = false;
            gj_ag_node_release(node);
        }
    }
    gj_ag_node_release(node);
fail_outs:
    for (int k = 0; k < n_out; k++) gj_rt_tensor_release(outs[k]);
fail:
    b->end_node(b);
    return -1;
}

/* ------------------------------------------- formulas outside of nodes */

/* Runs op's forward formula on builder b; saved (optional) receives the
 * values it saved. Used by checkpoint regions to replay their tape. */
int gj_ag_forward_vals(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs, int *n_saved, gj_val **saved) {
    gj_ag_fctx ctx = {0};
    int n = op->forward(b, saved ? &ctx : NULL, a, n_in, in, outs);
    if (n < 0) return -1;
    if (ctx.overflow) {
        gj_rt_set_error("%s: internal: more than %d saved tensors", op->name, GJ_AG_MAX_SAVED);
        return -1;
    }
    if (saved) {
        for (int s = 0; s < ctx.n_saved; s++) saved[s] = ctx.saved[s];
        *n_saved = ctx.n_saved;
    }
    return n;
}

/* Runs op's backward formula with explicit metas and saved values: the
 * context's node is a shape-only stand-in (never linked nor counted). */
int gj_ag_backward_vals(gj_ag_builder *b, const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                        const gj_rt_meta *in_meta, int n_out, const gj_rt_meta *out_meta,
                        int n_saved, gj_val *const *saved, const bool *needs,
                        gj_val *const *gout, gj_val **gin) {
    if (n_in > GJ_AG_MAX_IN || n_out > GJ_AG_MAX_OUT || n_saved > GJ_AG_MAX_SAVED) {
        gj_rt_set_error("%s: internal: formula arity out of range", op->name);
        return -1;
    }
    gj_ag_node stand_in;
    memset(&stand_in, 0, sizeof stand_in);
    stand_in.kind = GJ_AG_OP;
    stand_in.op = op;
    if (a) stand_in.attrs = *a;
    stand_in.n_in = n_in;
    stand_in.n_out = n_out;
    stand_in.n_saved = n_saved;
    memcpy(stand_in.in_meta, in_meta, (size_t)n_in * sizeof *in_meta);
    memcpy(stand_in.out_meta, out_meta, (size_t)n_out * sizeof *out_meta);
    gj_ag_bctx ctx = {.node = &stand_in, .needs = needs};
    for (int k = 0; k < n_saved; k++) ctx.saved[k] = saved[k];
    return op->backward(b, &ctx, &stand_in.attrs, gout, gin);
}

gj_ag_node *gj_ag_ctx_node(gj_ag_bctx *ctx) { return ctx->node; }
