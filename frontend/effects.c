/* SPDX-License-Identifier: MIT */
/*
 * effects.c - the public API of the runtime effects compiled autograd must
 * respect: tensor and post-accumulate hooks, gj_tensor_set_, anomaly mode.
 * (Streams and record_stream live in runtime/stream.c, custom ops in
 * frontend/custom.c.)
 *
 * Invariants: hooks are stored by autograd/hooks.c (a leaf's in its meta, a
 * non-leaf's in its grad_fn per output); user code that the engine calls
 * runs inside a scope of this frontend, registered with autograd on first
 * use (gj_ag_set_user_scope). set_ changes only dst's header (storage,
 * layout, dtype); its autograd meta is untouched.
 */
#include "fe.h"

#include <string.h>

static void use_frontend_scopes(void) { gj_fe_use_scopes(); }

/* The hooks registered during this thread's abstract first trace (while
 * gj_rt_abstract() holds). */
static _Thread_local struct {
    int n, cap;
    int64_t *h;
} g_abstract_hooks;

void gj_fe_abstract_hooks_undo(void) {
    for (int k = g_abstract_hooks.n - 1; k >= 0; k--)
        (void)gj_ag_hook_remove(g_abstract_hooks.h[k]); /* (gone with its tensor: nothing) */
    gj_rt_free(g_abstract_hooks.h);
    memset(&g_abstract_hooks, 0, sizeof g_abstract_hooks);
}

/* h (a new handle, or -1): noted when an abstract trace runs. A handle
 * that cannot be noted is removed again: -1 with the error. */
static int64_t noted(int64_t h, const char *op) {
    if (h <= 0 || !gj_rt_abstract()) return h;
    if (g_abstract_hooks.n == g_abstract_hooks.cap) {
        int cap = g_abstract_hooks.cap ? 2 * g_abstract_hooks.cap : 16;
        int64_t *nh = gj_rt_realloc(g_abstract_hooks.h, (size_t)cap * sizeof *nh);
        if (!nh) {
            (void)gj_ag_hook_remove(h);
            gj_rt_set_error("%s: out of memory noting the hook in the step's abstract trace", op);
            return -1;
        }
        g_abstract_hooks.h = nh;
        g_abstract_hooks.cap = cap;
    }
    g_abstract_hooks.h[g_abstract_hooks.n++] = h;
    return h;
}

int64_t gj_register_hook(gj_tensor *t, gj_grad_hook_fn fn, void *user) {
    use_frontend_scopes();
    GJ_FE_TRACE_UNTRACEABLE("gj_register_hook");
    return noted(gj_ag_hook_register(t, GJ_AG_HOOK_TENSOR, fn, NULL, user, "gj_register_hook"),
                 "gj_register_hook");
}

int64_t gj_register_post_accumulate_grad_hook(gj_tensor *leaf, gj_post_accumulate_hook_fn fn,
                                              void *user) {
    use_frontend_scopes();
    GJ_FE_TRACE_UNTRACEABLE("gj_register_post_accumulate_grad_hook");
    return noted(gj_ag_hook_register(leaf, GJ_AG_HOOK_POST_ACCUMULATE, NULL, fn, user,
                                     "gj_register_post_accumulate_grad_hook"),
                 "gj_register_post_accumulate_grad_hook");
}

int64_t gj_register_post_accumulate_grad_hook_ex(gj_tensor *leaf, gj_post_accumulate_hook_fn fn,
                                                 void *user, unsigned flags) {
    if (flags & ~(unsigned)GJ_HOOK_NO_GRAPH_WRITES) {
        gj_rt_set_error("gj_register_post_accumulate_grad_hook_ex: unknown flags 0x%x",
                        flags & ~(unsigned)GJ_HOOK_NO_GRAPH_WRITES);
        return -1;
    }
    use_frontend_scopes();
    GJ_FE_TRACE_UNTRACEABLE("gj_register_post_accumulate_grad_hook_ex");
    int64_t h = gj_ag_hook_register(leaf, GJ_AG_HOOK_POST_ACCUMULATE, NULL, fn, user,
                                    "gj_register_post_accumulate_grad_hook_ex");
    if (h > 0 && (flags & GJ_HOOK_NO_GRAPH_WRITES)) gj_ag_hook_set_early(h);
    return noted(h, "gj_register_post_accumulate_grad_hook_ex");
}

int gj_remove_hook(int64_t handle) {
    if (gj_ag_hook_remove(handle) != 0) {
        gj_rt_set_error("gj_remove_hook: no live hook has handle %lld (removed already, never "
                        "registered, or its tensor and graph are gone)",
                        (long long)handle);
        return -1;
    }
    return 0;
}

/* Raises the version counter of storage s to at least v (atomic max). */
static void version_at_least(gj_rt_storage *s, int64_t v) {
    long cur = atomic_load(&s->version);
    while (cur < v && !atomic_compare_exchange_weak(&s->version, &cur, (long)v)) {
    }
}

int gj_tensor_set_(gj_tensor *dst, gj_tensor *src) {
    if (!gj_rt_check_tensor(dst, "gj_tensor_set_", "dst") ||
        !gj_rt_check_tensor(src, "gj_tensor_set_", "src"))
        return -1;
    GJ_FE_TRACE_UNTRACEABLE("gj_tensor_set_");
    gj_ag_tensor_meta *m = dst->ag;
    char a[96], b[96];
    gj_rt_fmt_shape(a, sizeof a, dst->ndim, dst->shape);
    gj_rt_fmt_shape(b, sizeof b, src->ndim, src->shape);
    if (m && m->node && m->requires_grad && gj_ag_grad_enabled()) {
        gj_rt_set_error("gj_tensor_set_: dst (%s %s) is a non-leaf tensor that requires grad "
                        "(computed by op %s); set_ on it is only allowed under no_grad",
                        gj_rt_dtype_name(dst->dtype), a, m->node->op->name);
        return -1;
    }
    if (dst->storage->fetch) { /* (its gj_ddp points it at gathered values and away) */
        gj_rt_set_error("gj_tensor_set_: dst (%s %s) is a parameter sharded at rest (ZeRO stage "
                        "3): its memory belongs to its gj_ddp; write its values while unsharded "
                        "(gj_ddp_unshard, gj_ddp_reshard) instead",
                        gj_rt_dtype_name(dst->dtype), a);
        return -1;
    }
    if (m && m->requires_grad && !gj_rt_dtype_is_float(src->dtype)) {
        gj_rt_set_error("gj_tensor_set_: dst (%s %s) requires grad but src is %s %s (only float "
                        "tensors can require grad)",
                        gj_rt_dtype_name(dst->dtype), a, gj_rt_dtype_name(src->dtype), b);
        return -1;
    }
    gj_rt_storage *old = dst->storage;
    int64_t v = atomic_load(&old->version);
    int64_t vs = atomic_load(&src->storage->version);
    if (vs > v) v = vs;
    gj_rt_storage_retain(src->storage);
    dst->storage = src->storage;
    dst->dtype = src->dtype;
    dst->ndim = src->ndim;
    memcpy(dst->shape, src->shape, sizeof dst->shape);
    memcpy(dst->strides, src->strides, sizeof dst->strides);
    dst->offset = src->offset;
    dst->numel = src->numel;
    gj_rt_storage_release(old);
    version_at_least(dst->storage, v + 1);
    if (m && m->acc) gj_rt_meta_of(dst, &m->acc->out_meta[0]); /* the leaf's new meta */
    return 0;
}

void gj_set_anomaly_mode(bool on) { gj_ag_set_anomaly(on); }

bool gj_anomaly_mode_enabled(void) { return gj_ag_anomaly(); }
