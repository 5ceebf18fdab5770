/* SPDX-License-Identifier: MIT */
/*
 * eager.c - the eager interpreter of the builder interface, and the emit
 * helpers every formula uses (they only call b->emit, so they serve the
 * recording builder of jit/ as well).
 *
 * Invariants of the eager builder:
 *   - A gj_val of this builder is a gj_tensor*.
 *   - Every tensor produced by emit is owned by the per-thread temporaries
 *     list until end_node, which drops exactly one reference per entry;
 *     `keep` adds a reference that survives end_node, `drop` removes it.
 *   - constant(t) returns t itself, borrowed: it never enters the list.
 */
#include "ag.h"

#include <pthread.h>
#include <string.h>

typedef struct eager_temps {
    gj_tensor **items;
    int64_t n, cap;
} eager_temps;

static _Thread_local eager_temps g_temps;
static pthread_key_t g_temps_key;
static pthread_once_t g_temps_once = PTHREAD_ONCE_INIT;

/* At thread exit: free the thread's temporaries list. */
static void temps_thread_exit(void *unused) {
    (void)unused;
    for (int64_t i = g_temps.n - 1; i >= 0; i--) gj_rt_tensor_release(g_temps.items[i]);
    gj_rt_free(g_temps.items);
    g_temps.items = NULL;
    g_temps.n = g_temps.cap = 0;
}

static void temps_key_init(void) { pthread_key_create(&g_temps_key, temps_thread_exit); }

/* Append t (one reference, transferred) to the temporaries. On OOM t is
 * released and -1 returned. */
static int temps_push(gj_tensor *t) {
    if (g_temps.n == g_temps.cap) {
        int64_t cap = g_temps.cap ? g_temps.cap * 2 : 64;
        gj_tensor **items = gj_rt_realloc(g_temps.items, (size_t)cap * sizeof *items);
        if (!items) {
            gj_rt_tensor_release(t);
            return -1;
        }
        if (!g_temps.items) {
            pthread_once(&g_temps_once, temps_key_init);
            pthread_setspecific(g_temps_key, &g_temps);
        }
        g_temps.items = items;
        g_temps.cap = cap;
    }
    g_temps.items[g_temps.n++] = t;
    return 0;
}

static int eager_emit(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in,
                      gj_val **outs) {
    (void)b;
    gj_tensor *res[GJ_RT_MAX_OUTPUTS] = {0};
    int n = gj_rt_exec(inst, (gj_tensor *const *)in, res);
    if (n < 0) return -1;
    int rc = n;
    for (int k = 0; k < n; k++) {
        if (rc >= 0 && temps_push(res[k]) == 0) {
            outs[k] = gj_ag_tensor_val(res[k]);
        } else {
            if (rc >= 0) rc = -1; /* temps_push released res[k] */
            else gj_rt_tensor_release(res[k]);
            outs[k] = NULL;
        }
    }
    return rc;
}

static void eager_meta(gj_ag_builder *b, gj_val *v, gj_rt_meta *out) {
    (void)b;
    gj_rt_meta_of(gj_ag_val_tensor(v), out);
}

static gj_val *eager_constant(gj_ag_builder *b, gj_tensor *t) {
    (void)b;
    return gj_ag_tensor_val(t);
}

static void eager_keep(gj_ag_builder *b, gj_val *v) {
    (void)b;
    gj_rt_tensor_retain(gj_ag_val_tensor(v));
}

static void eager_drop(gj_ag_builder *b, gj_val *v) {
    (void)b;
    if (v) gj_rt_tensor_release(gj_ag_val_tensor(v));
}

static void eager_end_node(gj_ag_builder *b) {
    (void)b;
    for (int64_t i = g_temps.n - 1; i >= 0; i--) gj_rt_tensor_release(g_temps.items[i]);
    g_temps.n = 0;
    if (g_temps.cap > 4096) { /* do not keep a huge list alive forever */
        gj_rt_free(g_temps.items);
        g_temps.items = NULL;
        g_temps.cap = 0;
    }
}

/* .grad of leaf receives g: set it (sharing g's storage when nothing else
 * uses it, else a contiguous copy) or add into the existing .grad in its
 * own dtype, in place, so borrowed .grad pointers stay valid. */
static int eager_accumulate(gj_ag_builder *b, gj_tensor *leaf, gj_val *gv) {
    (void)b;
    gj_tensor *g = gj_ag_val_tensor(gv);
    gj_ag_tensor_meta *m = gj_ag_meta_get(leaf, true);
    if (!m) return -1;
    if (!m->grad) {
        gj_tensor *ng;
        bool exclusive = atomic_load(&g->storage->refcount) == 1 &&
                         atomic_load(&g->refcount) == 1 && gj_rt_is_contiguous(g) &&
                         g->offset == 0 && g->dtype == leaf->dtype;
        if (exclusive) {
            ng = gj_rt_tensor_alias(g);
        } else {
            ng = gj_rt_tensor_empty(leaf->dtype, leaf->ndim, leaf->shape); /* (copied over) */
            if (ng && gj_rt_copy_into(ng, g) != 0) {
                gj_rt_tensor_release(ng);
                ng = NULL;
            }
        }
        if (!ng) return -1;
        gj_ag_meta_set_grad(m, ng);
        return 0;
    }
    gj_tensor *grad = m->grad;
    gj_tensor *gc = g;
    gj_tensor *res[GJ_RT_MAX_OUTPUTS] = {0}, *sum = NULL;
    int rc = -1;
    if (g->dtype != grad->dtype) {
        gj_rt_inst cast = {.prim = GJ_P_CAST, .n_in = 1, .dtype = grad->dtype};
        if (gj_rt_exec(&cast, &g, res) < 0) return -1;
        gc = res[0];
    }
    gj_rt_inst add = {.prim = GJ_P_ADD, .n_in = 2};
    gj_tensor *args[2] = {grad, gc};
    if (gj_rt_exec(&add, args, res) < 0) goto done;
    sum = res[0];
    if (gj_rt_copy_into(grad, sum) != 0) goto done;
    gj_rt_bump_version(grad);
    rc = 0;
done:
    if (sum) gj_rt_tensor_release(sum);
    if (gc != g) gj_rt_tensor_release(gc);
    return rc;
}

static gj_ag_builder g_eager = {
    .emit = eager_emit,
    .meta = eager_meta,
    .constant = eager_constant,
    .keep = eager_keep,
    .drop = eager_drop,
    .end_node = eager_end_node,
    .accumulate = eager_accumulate,
    .records = false,
    .call_hook = gj_ag_eager_call_hook,
    .call_post_hook = gj_ag_eager_call_post_hook,
};

gj_ag_builder *gj_ag_eager_builder(void) { return &g_eager; }

/* One reference of t (transferred) joins the current step's temporaries:
 * how tensors made by user code (hooks, custom ops) become eager values. */
gj_val *gj_ag_eager_adopt(gj_tensor *t) {
    if (!t) return NULL;
    return temps_push(t) == 0 ? gj_ag_tensor_val(t) : NULL;
}

/* ------------------------------------------------------------ helpers */

gj_val *gj_ag_emit1(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in) {
    gj_val *outs[GJ_RT_MAX_OUTPUTS] = {0};
    for (int i = 0; i < inst->n_in; i++)
        if (!in[i]) return NULL; /* an earlier emit failed: error already set */
    int n = b->emit(b, inst, in, outs);
    return n >= 1 ? outs[0] : NULL;
}

gj_val *gj_ag_unary(gj_ag_builder *b, gj_rt_prim p, gj_val *x) {
    gj_rt_inst inst = {.prim = p, .n_in = 1};
    return gj_ag_emit1(b, &inst, &x);
}

gj_val *gj_ag_scalar_op(gj_ag_builder *b, gj_rt_prim p, gj_val *x, double c) {
    gj_rt_inst inst = {.prim = p, .n_in = 1, .scalar = c};
    return gj_ag_emit1(b, &inst, &x);
}

gj_val *gj_ag_binary(gj_ag_builder *b, gj_rt_prim p, gj_val *x, gj_val *y) {
    gj_rt_inst inst = {.prim = p, .n_in = 2};
    gj_val *in[2] = {x, y};
    return gj_ag_emit1(b, &inst, in);
}

gj_val *gj_ag_where(gj_ag_builder *b, gj_val *c, gj_val *x, gj_val *y) {
    gj_rt_inst inst = {.prim = GJ_P_WHERE, .n_in = 3};
    gj_val *in[3] = {c, x, y};
    return gj_ag_emit1(b, &inst, in);
}

gj_val *gj_ag_fill(gj_ag_builder *b, gj_dtype dt, int ndim, const int64_t *shape, double v) {
    gj_rt_inst inst = {.prim = GJ_P_FILL, .n_in = 0, .scalar = v, .dtype = dt, .ndim = ndim};
    if (ndim > 0) memcpy(inst.shape, shape, (size_t)ndim * sizeof *shape);
    return gj_ag_emit1(b, &inst, NULL);
}

gj_val *gj_ag_sum(gj_ag_builder *b, gj_val *x, uint32_t axes, bool keepdim) {
    gj_rt_inst inst = {.prim = GJ_P_SUM, .n_in = 1, .axes = axes, .keepdim = keepdim};
    return gj_ag_emit1(b, &inst, &x);
}

gj_val *gj_ag_reshape(gj_ag_builder *b, gj_val *x, int ndim, const int64_t *shape) {
    gj_rt_inst inst = {.prim = GJ_P_RESHAPE, .n_in = 1, .ndim = ndim};
    if (ndim > 0) memcpy(inst.shape, shape, (size_t)ndim * sizeof *shape);
    return gj_ag_emit1(b, &inst, &x);
}

gj_val *gj_ag_expand(gj_ag_builder *b, gj_val *x, int ndim, const int64_t *shape) {
    gj_rt_inst inst = {.prim = GJ_P_EXPAND, .n_in = 1, .ndim = ndim};
    if (ndim > 0) memcpy(inst.shape, shape, (size_t)ndim * sizeof *shape);
    return gj_ag_emit1(b, &inst, &x);
}

gj_val *gj_ag_permute(gj_ag_builder *b, gj_val *x, int ndim, const int *perm) {
    gj_rt_inst inst = {.prim = GJ_P_PERMUTE, .n_in = 1, .ndim = ndim};
    for (int k = 0; k < ndim; k++) inst.shape[k] = perm[k];
    return gj_ag_emit1(b, &inst, &x);
}

gj_val *gj_ag_transpose_last2(gj_ag_builder *b, gj_val *x) {
    if (!x) return NULL;
    gj_rt_meta m;
    b->meta(b, x, &m);
    int perm[GJ_MAX_DIMS];
    for (int k = 0; k < m.ndim; k++) perm[k] = k;
    if (m.ndim >= 2) {
        perm[m.ndim - 2] = m.ndim - 1;
        perm[m.ndim - 1] = m.ndim - 2;
    }
    return gj_ag_permute(b, x, m.ndim, perm);
}

gj_val *gj_ag_matmul(gj_ag_builder *b, gj_val *x, gj_val *y, bool ta, bool tb) {
    gj_rt_inst inst = {.prim = GJ_P_MATMUL, .n_in = 2, .ta = ta, .tb = tb};
    gj_val *in[2] = {x, y};
    return gj_ag_emit1(b, &inst, in);
}

gj_val *gj_ag_cast(gj_ag_builder *b, gj_val *x, gj_dtype dt) {
    if (!x) return NULL;
    gj_rt_meta m;
    b->meta(b, x, &m);
    if (m.dtype == dt) return x;
    gj_rt_inst inst = {.prim = GJ_P_CAST, .n_in = 1, .dtype = dt};
    return gj_ag_emit1(b, &inst, &x);
}

void gj_ag_meta(gj_ag_builder *b, gj_val *v, gj_rt_meta *out) { b->meta(b, v, out); }

/* Sum x (broadcast to a larger shape) back to (ndim, shape): leading extra
 * axes are summed away, axes where shape has 1 are summed with keepdim. */
gj_val *gj_ag_sum_to(gj_ag_builder *b, gj_val *x, int ndim, const int64_t *shape) {
    if (!x) return NULL;
    gj_rt_meta m;
    b->meta(b, x, &m);
    if (m.ndim == ndim && memcmp(m.shape, shape, (size_t)ndim * sizeof *shape) == 0) return x;
    int lead = m.ndim - ndim;
    if (lead < 0) {
        gj_rt_set_error("autograd: internal: sum_to target has more dims than the gradient");
        return NULL;
    }
    uint32_t axes = 0;
    for (int k = 0; k < lead; k++) axes |= 1u << k;
    for (int k = 0; k < ndim; k++)
        if (shape[k] == 1 && m.shape[lead + k] != 1) axes |= 1u << (lead + k);
    gj_val *s = x;
    if (axes) {
        s = gj_ag_sum(b, x, axes, true);
        if (!s) return NULL;
    }
    return gj_ag_reshape(b, s, ndim, shape);
}
