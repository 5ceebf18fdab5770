/* SPDX-License-Identifier: MIT */
/*
 * hooks.c - tensor hooks and post-accumulate hooks (registration, removal,
 * the engine's calls through the builder, the eager builder's calls into the
 * user's C functions), and anomaly mode's NaN/Inf check.
 *
 * Invariants:
 *   - Every hook is in exactly one list (a node's out_hooks[k], or a leaf
 *     meta's hooks / post_hooks), in registration order, and in the global
 *     list of live hooks (g_all, under g_mu) used to find a handle. It is
 *     freed with its list's owner, or by compaction once removed.
 *   - Removal only sets `removed`; lists are compacted at a registration
 *     made outside any hook call on this thread, so a list being iterated
 *     by the engine never loses a node under it.
 *   - The engine runs the hooks present when a gradient is ready (a hook
 *     registered by a hook on the same tensor runs from the next backward).
 *   - User code (hooks) runs under no_grad inside a user scope of its own;
 *     a tensor it returns is adopted by the eager builder's current step
 *     (retained first when that scope owns the returned reference), so its
 *     temporaries die with the scope and the replacement with the step.
 */
#include "ag.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static gj_ag_hook *g_all; /* every live hook (doubly linked through all_prev/all_next) */
static int64_t g_next_handle;
static _Thread_local int g_in_hook; /* depth of user hook calls on this thread */
static gj_ag_scope_ops g_sops; /* the frontend's (all NULL until it registers) */
static atomic_bool g_anomaly;

/* ------------------------------------------------------------ scopes */

void gj_ag_set_user_scope(const gj_ag_scope_ops *ops) { g_sops = *ops; }

gj_ag_uscope gj_ag_user_scope_push(void) {
    gj_ag_uscope u = {NULL, g_sops.level ? g_sops.level() : 0};
    if (g_sops.push) u.id = g_sops.push();
    return u;
}

int gj_ag_user_scope_close(gj_ag_uscope u, const char *who) {
    if (!g_sops.pop || !g_sops.level) return 0;
    int left = g_sops.level() - (u.level + 1);
    if (left < 0) {
        gj_rt_set_error("%s closed the scope it was called in (gj_scope_pop without a "
                        "gj_scope_push of its own): temporaries of its caller may have been "
                        "freed",
                        who);
        return -1;
    }
    for (int i = 0; i <= left; i++) g_sops.pop();
    if (left == 0) return 0;
    gj_rt_set_error("%s returned with %d scope%s it opened still open (gj_scope_push without "
                    "gj_scope_pop); %s closed now",
                    who, left, left == 1 ? "" : "s", left == 1 ? "it was" : "they were");
    return -1;
}

void gj_ag_uscope_close_keep_error(gj_ag_uscope u, const char *who) {
    char first[512];
    snprintf(first, sizeof first, "%s", gj_last_error());
    if (gj_ag_user_scope_close(u, who) != 0 && first[0]) {
        char more[400];
        snprintf(more, sizeof more, "%s", gj_last_error());
        gj_rt_set_error("%s; also: %s", first, more);
    } else if (first[0]) {
        gj_rt_set_error("%s", first);
    }
}

/* Whether t is registered in user scope u or in a scope opened inside it. */
static bool in_user_scope(const gj_tensor *t, gj_ag_uscope u) {
    if (!t->scope || !u.id) return false;
    return t->scope == u.id || (g_sops.open_from && g_sops.open_from(t->scope, u.level));
}

gj_tensor *gj_ag_take_user_ref(gj_tensor *t, gj_ag_uscope u, const char *what) {
    if (!gj_rt_check_tensor(t, "user code", what)) return NULL;
    if (in_user_scope(t, u)) gj_rt_tensor_retain(t); /* the scope keeps its own */
    if (t->ag) { /* values of the engine never carry history */
        gj_tensor *a = gj_rt_tensor_alias(t);
        gj_rt_tensor_release(t);
        t = a;
    }
    return t;
}

void gj_ag_drop_user_ref(gj_tensor *t, gj_ag_uscope u) {
    if (!t || t->magic != GJ_RT_TENSOR_MAGIC || in_user_scope(t, u)) return;
    gj_rt_tensor_release(t);
}

int gj_ag_pin_lent(gj_tensor *g) {
    int pins = (int)atomic_load(&g->refcount);
    atomic_fetch_add(&g->pinned, pins);
    return pins;
}

void gj_ag_unpin_lent(gj_tensor *g, int pins) { atomic_fetch_sub(&g->pinned, pins); }

/* ------------------------------------------------------- registration */

/* Unlinks h from the global list and frees it. Lock held. */
static void hook_destroy_locked(gj_ag_hook *h) {
    if (h->all_prev) h->all_prev->all_next = h->all_next;
    else g_all = h->all_next;
    if (h->all_next) h->all_next->all_prev = h->all_prev;
    gj_rt_free(h);
}

void gj_ag_hooks_free(gj_ag_hook **list) {
    if (!*list) return;
    pthread_mutex_lock(&g_mu);
    while (*list) {
        gj_ag_hook *h = *list;
        *list = h->next;
        hook_destroy_locked(h);
    }
    pthread_mutex_unlock(&g_mu);
}

int64_t gj_ag_hook_register(gj_tensor *t, gj_ag_hook_kind kind, gj_grad_hook_fn fn,
                            gj_post_accumulate_hook_fn post_fn, void *user, const char *op) {
    if (!gj_rt_check_tensor(t, op, "t")) return -1;
    char sh[96];
    gj_rt_fmt_shape(sh, sizeof sh, t->ndim, t->shape);
    if ((kind == GJ_AG_HOOK_TENSOR && !fn) || (kind == GJ_AG_HOOK_POST_ACCUMULATE && !post_fn)) {
        gj_rt_set_error("%s: the hook function is NULL", op);
        return -1;
    }
    gj_ag_tensor_meta *m = t->ag;
    if (!m || !m->requires_grad) {
        gj_rt_set_error("%s: cannot register a hook on a tensor that does not require grad "
                        "(%s %s)",
                        op, gj_rt_dtype_name(t->dtype), sh);
        return -1;
    }
    gj_ag_hook **list;
    if (kind == GJ_AG_HOOK_POST_ACCUMULATE) {
        if (m->node) {
            gj_rt_set_error("%s: post-accumulate-grad hooks can only be registered on leaf "
                            "tensors (this %s %s tensor was computed by op %s)",
                            op, gj_rt_dtype_name(t->dtype), sh, m->node->op->name);
            return -1;
        }
        list = &m->post_hooks;
    } else {
        list = m->node ? &m->node->out_hooks[m->output_nr] : &m->hooks;
    }
    gj_ag_hook *h = gj_rt_calloc(1, sizeof *h);
    if (!h) return -1;
    h->kind = kind;
    h->fn = fn;
    h->post_fn = post_fn;
    h->user = user;
    pthread_mutex_lock(&g_mu);
    h->handle = ++g_next_handle;
    h->all_next = g_all;
    if (g_all) g_all->all_prev = h;
    g_all = h;
    gj_ag_hook **pp = list;
    while (*pp) {
        if ((*pp)->removed && g_in_hook == 0) { /* compact */
            gj_ag_hook *dead = *pp;
            *pp = dead->next;
            hook_destroy_locked(dead);
            continue;
        }
        pp = &(*pp)->next;
    }
    *pp = h;
    int64_t handle = h->handle;
    pthread_mutex_unlock(&g_mu);
    return handle;
}

int gj_ag_hook_remove(int64_t handle) {
    int rc = -1;
    pthread_mutex_lock(&g_mu);
    for (gj_ag_hook *h = g_all; h; h = h->all_next) {
        if (h->handle != handle) continue;
        if (!h->removed) {
            h->removed = true;
            rc = 0;
        }
        break;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

int gj_ag_hook_set_early(int64_t handle) {
    int rc = -1;
    pthread_mutex_lock(&g_mu);
    for (gj_ag_hook *h = g_all; h; h = h->all_next) {
        if (h->handle != handle) continue;
        if (!h->removed && h->kind == GJ_AG_HOOK_POST_ACCUMULATE) {
            h->early = true;
            rc = 0;
        }
        break;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* --------------------------------------------------------- enumeration */

static int list_live(const gj_ag_hook *h, const gj_ag_hook **out, int cap, int n) {
    for (; h; h = h->next) {
        if (h->removed) continue;
        if (out && n < cap) out[n] = h;
        n++;
    }
    return n;
}

int gj_ag_node_hooks(const gj_ag_node *n, int k, const gj_ag_hook **out, int cap) {
    if (!n) return 0;
    if (n->kind == GJ_AG_OP)
        return k >= 0 && k < GJ_AG_MAX_OUT ? list_live(n->out_hooks[k], out, cap, 0) : 0;
    if (k != 0 || !n->leaf) return 0;
    const gj_ag_tensor_meta *m = n->leaf->ag;
    if (!m) return 0;
    int c = list_live(m->hooks, out, cap, 0);
    return list_live(m->post_hooks, out, cap, c);
}

/* ------------------------------------------------------------- engine */

static gj_ag_hook *tensor_hooks_of(gj_ag_node *n, int k) {
    if (n->kind == GJ_AG_OP) return k < GJ_AG_MAX_OUT ? n->out_hooks[k] : NULL;
    gj_ag_tensor_meta *m = n->leaf ? n->leaf->ag : NULL;
    return m ? m->hooks : NULL;
}

static int list_count(const gj_ag_hook *h) {
    int c = 0;
    for (; h; h = h->next) c++;
    return c;
}

int gj_ag_run_tensor_hooks(gj_ag_builder *b, gj_ag_node *n, int k, gj_val **buf) {
    gj_ag_hook *h = tensor_hooks_of(n, k);
    if (!h || !*buf) return 0;
    int count = list_count(h); /* hooks added by these hooks wait for the next backward */
    for (int i = 0; i < count; i++, h = h->next) {
        if (h->removed) continue;
        if (!b->call_hook) {
            gj_rt_set_error("hooks: this builder cannot run hooks (a hook on output %d of op %s)",
                            k, n->kind == GJ_AG_OP ? n->op->name : "AccumulateGrad");
            return -1;
        }
        gj_val *nv = b->call_hook(b, h, *buf);
        if (!nv) return -1;
        if (nv != *buf) {
            b->keep(b, nv);
            b->drop(b, *buf);
            *buf = nv;
        }
    }
    return 0;
}

int gj_ag_run_post_hooks(gj_ag_builder *b, gj_tensor *leaf) {
    gj_ag_tensor_meta *m = leaf->ag;
    gj_ag_hook *h = m ? m->post_hooks : NULL;
    int count = list_count(h);
    for (int i = 0; i < count; i++, h = h->next) {
        if (h->removed) continue;
        if (!b->call_post_hook) {
            gj_rt_set_error("hooks: this builder cannot run hooks (a post-accumulate-grad hook)");
            return -1;
        }
        if (b->call_post_hook(b, h, leaf) != 0) return -1;
    }
    return 0;
}

/* ------------------------------------------------------ eager builder */

gj_tensor *gj_ag_call_hook_ref(const gj_ag_hook *h, gj_tensor *g) {
    gj_ag_uscope us = gj_ag_user_scope_push();
    gj_ag_no_grad_enter();
    g_in_hook++;
    gj_clear_error();
    int pins = gj_ag_pin_lent(g); /* borrowed by the hook: gj_release(g) is refused */
    gj_tensor *r = h->fn(g, h->user);
    gj_ag_unpin_lent(g, pins);
    g_in_hook--;
    gj_ag_no_grad_exit();
    gj_tensor *out = NULL;
    if (r == g) r = NULL; /* `lambda g: g`: g is borrowed, returning it means "keep it" */
    if (!r && gj_last_error()[0]) {
        /* An op failed inside the hook and the hook kept the gradient
         * anyway: what it meant to do did not happen, so the backward
         * fails with that error rather than going on silently. */
        char why[512];
        snprintf(why, sizeof why, "%s", gj_last_error());
        gj_rt_set_error("hooks: hook #%lld returned NULL (keep the gradient) with an error set "
                        "inside it (clear it with gj_clear_error if it was handled): %s",
                        (long long)h->handle, why);
    } else if (!r) {
        gj_rt_tensor_retain(g);
        out = g;
    } else if (!gj_rt_check_tensor(r, "hooks", "the tensor returned by a hook")) {
        out = NULL;
    } else if (r->dtype != g->dtype || r->ndim != g->ndim ||
               memcmp(r->shape, g->shape, (size_t)g->ndim * sizeof g->shape[0]) != 0) {
        char a[96], c[96];
        gj_rt_fmt_shape(a, sizeof a, g->ndim, g->shape);
        gj_rt_fmt_shape(c, sizeof c, r->ndim, r->shape);
        gj_rt_set_error("hooks: hook #%lld registered on a tensor of shape %s (%s) returned a "
                        "gradient of shape %s (%s); a hook must return NULL or a tensor of "
                        "the gradient's shape and dtype",
                        (long long)h->handle, a, gj_rt_dtype_name(g->dtype), c,
                        gj_rt_dtype_name(r->dtype));
        gj_ag_drop_user_ref(r, us);
        out = NULL;
    } else {
        out = gj_ag_take_user_ref(r, us, "the tensor returned by a hook");
    }
    char who[64];
    snprintf(who, sizeof who, "hooks: hook #%lld", (long long)h->handle);
    if (!out) {
        gj_ag_uscope_close_keep_error(us, who);
    } else if (gj_ag_user_scope_close(us, who) != 0) {
        gj_rt_tensor_release(out);
        out = NULL;
    }
    return out;
}

/* Calls the user's hook on the real gradient; checks and adopts what it
 * returns. */
gj_val *gj_ag_eager_call_hook(gj_ag_builder *b, const gj_ag_hook *h, gj_val *grad) {
    (void)b;
    gj_tensor *g = gj_ag_val_tensor(grad);
    gj_tensor *out = gj_ag_call_hook_ref(h, g);
    if (!out) return NULL;
    if (out == g) { /* kept: the reference taken for us is not needed */
        gj_rt_tensor_release(g);
        return grad;
    }
    return gj_ag_eager_adopt(out);
}

int gj_ag_eager_call_post_hook(gj_ag_builder *b, const gj_ag_hook *h, gj_tensor *leaf) {
    (void)b;
    gj_ag_uscope us = gj_ag_user_scope_push();
    gj_ag_no_grad_enter();
    g_in_hook++;
    gj_clear_error();
    h->post_fn(leaf, h->user);
    g_in_hook--;
    gj_ag_no_grad_exit();
    char who[80];
    snprintf(who, sizeof who, "hooks: post-accumulate hook #%lld", (long long)h->handle);
    if (gj_last_error()[0]) {
        /* An op failed inside the hook and the hook returned as if it had
         * done its work: the backward fails with that error (as for tensor
         * hooks) instead of going on with a .grad the hook did not make. */
        char why[512];
        snprintf(why, sizeof why, "%s", gj_last_error());
        gj_rt_set_error("hooks: post-accumulate hook #%lld returned with an error set inside it "
                        "(clear it with gj_clear_error if it was handled): %s",
                        (long long)h->handle, why);
        gj_ag_uscope_close_keep_error(us, who);
        return -1;
    }
    return gj_ag_user_scope_close(us, who);
}

bool gj_ag_leaf_has_hooks(const gj_tensor *t) {
    const gj_ag_tensor_meta *m = t->ag;
    if (!m) return false;
    for (const gj_ag_hook *h = m->hooks; h; h = h->next)
        if (!h->removed) return true;
    for (const gj_ag_hook *h = m->post_hooks; h; h = h->next)
        if (!h->removed) return true;
    return false;
}

int gj_ag_leaf_hooks(const gj_tensor *t, const gj_ag_hook **out, int cap) {
    const gj_ag_tensor_meta *m = t->ag;
    if (!m) return 0;
    return list_live(m->post_hooks, out, cap, list_live(m->hooks, out, cap, 0));
}

/* ------------------------------------------------------------ anomaly */

void gj_ag_set_anomaly(bool on) { atomic_store(&g_anomaly, on); }
bool gj_ag_anomaly(void) { return atomic_load(&g_anomaly); }

/* Index of the first non-finite element of t, or -1. */
static int64_t first_nonfinite(const gj_tensor *t) {
    if (gj_rt_is_contiguous(t) && t->dtype == GJ_F32) {
        const float *p = gj_rt_data_ptr(t);
        for (int64_t i = 0; i < t->numel; i++)
            if (!isfinite(p[i])) return i;
        return -1;
    }
    if (gj_rt_is_contiguous(t) && t->dtype == GJ_F64) {
        const double *p = gj_rt_data_ptr(t);
        for (int64_t i = 0; i < t->numel; i++)
            if (!isfinite(p[i])) return i;
        return -1;
    }
    for (int64_t i = 0; i < t->numel; i++)
        if (!isfinite(gj_rt_get(t, i))) return i;
    return -1;
}

int gj_ag_anomaly_check(gj_ag_builder *b, const gj_ag_node *n, int i, gj_val *g) {
    if (b->records || !g) return 0;
    gj_tensor *t = gj_ag_val_tensor(g);
    if (!gj_rt_dtype_is_float(t->dtype)) return 0;
    int64_t j = first_nonfinite(t);
    if (j < 0) return 0;
    double v = gj_rt_get(t, j);
    char sh[96];
    gj_rt_fmt_shape(sh, sizeof sh, t->ndim, t->shape);
    gj_rt_set_error("backward: anomaly mode: op %s produced %s in the gradient for its input %d "
                    "(%s %s, element %lld = %g)",
                    n->kind == GJ_AG_OP ? n->op->name : "AccumulateGrad", isnan(v) ? "NaN" : "Inf",
                    i, gj_rt_dtype_name(t->dtype), sh, (long long)j, v);
    return -1;
}
