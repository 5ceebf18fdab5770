/* SPDX-License-Identifier: MIT */
/*
 * tensor.c - the public tensor API: creation, references and scopes,
 * accessors, requires_grad/.grad, backward and gj_grad, no-grad mode.
 *
 * Scope invariants: each thread has a stack of scopes. A scope holds exactly
 * one reference to each tensor registered in it (t->scope == that scope,
 * t->scope_slot == its index in the scope's array). gj_release and
 * gj_scope_keep unregister a tensor (the slot becomes NULL) before it can
 * die, so a scope never drops a reference it no longer holds.
 * g_open_scopes counts the scopes open on every thread (pushes past the
 * fixed stack included); a thread that exits pops its own first.
 *
 * Forgotten scopes: a push without its pop keeps every tensor made after
 * it alive. gj_scope_depth and gj_live_tensors show it through the API, a
 * one-time stderr warning fires when a thread's depth reaches
 * GJ_FE_SCOPE_WARN_DEPTH, and GRADJIT_LOG=leaks prints what is still alive
 * and open at exit (fe_leaks_at_exit).
 */
#include "fe.h"
#include "../jit/jit.h"
#include "../runtime/gj_math.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* -------------------------------------------------------------- scopes */

typedef struct fe_scope {
    gj_tensor **items;
    int64_t n, cap;
} fe_scope;

/* Scopes live in a fixed per-thread stack so that gj_scope_push never
 * allocates and so cannot fail: a trainer's push/pop pairs always match.
 * Pushes deeper than GJ_FE_MAX_SCOPES are counted in g_overflow and share
 * the innermost real scope (an error is set). */
#define GJ_FE_MAX_SCOPES 256
/* A thread's depth (real and overflow scopes) at which a forgotten
 * gj_scope_pop is reported once per process on stderr: deeper than any
 * real program nests (a step is one scope; recursion adds a few). */
#define GJ_FE_SCOPE_WARN_DEPTH 10000
static _Thread_local fe_scope g_scopes[GJ_FE_MAX_SCOPES];
static _Thread_local int g_depth, g_overflow;
static _Thread_local bool g_thread_registered; /* scopes_thread_exit will run */
static atomic_llong g_open_scopes;             /* every thread's g_depth + g_overflow */
static pthread_key_t g_scope_key;
static pthread_once_t g_scope_once = PTHREAD_ONCE_INIT;

/* At thread exit: release what the thread's scopes still hold and free
 * their arrays (a thread that never popped would leak otherwise). */
static void scopes_thread_exit(void *unused) {
    (void)unused;
    while (g_overflow > 0 || g_depth > 0) gj_scope_pop();
    for (int i = 0; i < GJ_FE_MAX_SCOPES; i++) {
        gj_rt_free(g_scopes[i].items);
        g_scopes[i].items = NULL;
        g_scopes[i].cap = 0;
    }
}

/* GRADJIT_LOG=leaks: one line at exit, what is still alive and open. */
static void fe_leaks_at_exit(void) {
    gj_mem m;
    gj_mem_stats(&m);
    long long n = (long long)gj_live_tensors(), open = (long long)atomic_load(&g_open_scopes);
    fprintf(stderr, "[gradjit leaks] at exit: %lld tensor%s alive (%lld bytes of tensor storage), "
                    "%lld scope%s open (%d on the exiting thread)%s\n",
            n, n == 1 ? "" : "s", (long long)m.live_bytes, open, open == 1 ? "" : "s",
            g_depth + g_overflow,
            n || open ? ": release what you own and pop every scope you push" : "");
}

/* Once per process, at the first scope or tensor: the thread-exit key, and
 * the leak report if GRADJIT_LOG asks for it (this reads GRADJIT_LOG). */
static void scope_key_init(void) {
    pthread_key_create(&g_scope_key, scopes_thread_exit);
    if (gj_jit_log_leaks()) atexit(fe_leaks_at_exit);
}

/* Arranges scopes_thread_exit for this thread (once per thread). */
static void scope_thread_register(void) {
    pthread_once(&g_scope_once, scope_key_init);
    pthread_setspecific(g_scope_key, g_scopes);
    g_thread_registered = true;
}

gj_tensor *gj_fe_own(gj_tensor *t) {
    if (!t) return gj_fe_fail();
    gj_rt_tensor_result();
    if (!g_thread_registered) scope_thread_register();
    if (g_depth == 0) return t;
    fe_scope *s = &g_scopes[g_depth - 1];
    if (s->n == s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 64;
        gj_tensor **items = gj_rt_realloc(s->items, (size_t)cap * sizeof *items);
        if (!items) { /* cannot register: do not leak it, fail the call */
            gj_rt_tensor_release(t);
            return gj_fe_fail();
        }
        s->items = items;
        s->cap = cap;
    }
    t->scope = s;
    t->scope_slot = s->n;
    s->items[s->n++] = t;
    return t;
}

static void scope_unregister(gj_tensor *t) {
    fe_scope *s = t->scope;
    if (!s) return;
    s->items[t->scope_slot] = NULL;
    t->scope = NULL;
    t->scope_slot = 0;
}

void gj_scope_push(void) {
    if (!g_thread_registered) scope_thread_register();
    atomic_fetch_add(&g_open_scopes, 1);
    if (g_depth + g_overflow + 1 == GJ_FE_SCOPE_WARN_DEPTH) {
        static atomic_bool warned;
        if (!atomic_exchange(&warned, true))
            fprintf(stderr, "gradjit: %d scopes are open on one thread: a gj_scope_push without "
                            "its gj_scope_pop? Every tensor made since stays alive until its "
                            "scope pops (gj_scope_depth, gj_live_tensors; GRADJIT_LOG=leaks "
                            "reports at exit). Printed once.\n",
                    GJ_FE_SCOPE_WARN_DEPTH);
    }
    if (g_depth == GJ_FE_MAX_SCOPES) {
        g_overflow++;
        gj_rt_set_error("gj_scope_push: more than %d nested scopes; the inner ones share "
                        "scope %d",
                        GJ_FE_MAX_SCOPES, GJ_FE_MAX_SCOPES);
        return;
    }
    g_depth++;
}

int gj_scope_depth(void) { return g_depth + g_overflow; }

void gj_scope_pop(void) {
    if (g_overflow > 0) {
        g_overflow--;
        atomic_fetch_sub(&g_open_scopes, 1);
        return;
    }
    if (g_depth == 0) {
        gj_rt_set_error("gj_scope_pop: no scope is open");
        return;
    }
    atomic_fetch_sub(&g_open_scopes, 1);
    fe_scope *s = &g_scopes[g_depth - 1];
    for (int64_t i = s->n - 1; i >= 0; i--) {
        gj_tensor *t = s->items[i];
        if (!t) continue;
        t->scope = NULL;
        gj_rt_tensor_release(t);
    }
    s->n = 0;
    if (s->cap > 65536) { /* keep the usual per-step array, not a rare huge one */
        gj_rt_free(s->items);
        s->items = NULL;
        s->cap = 0;
    }
    g_depth--;
}

/* gj_scope_push for user code called by the engine (hooks, custom ops):
 * returns the identity of the scope now innermost (what t->scope holds for
 * tensors registered in it; past the depth limit, the shared innermost). */
static void *user_scope_push(void) {
    gj_scope_push();
    return g_depth > 0 ? (void *)&g_scopes[g_depth - 1] : NULL;
}

/* Scopes open on this thread (those past the depth limit too). */
static int scope_level(void) { return g_depth + g_overflow; }

/* Whether s is one of this thread's open scopes, opened when `level` scopes
 * were open or later. */
static bool scope_open_from(const void *s, int level) {
    for (int i = level < 0 ? 0 : level; i < g_depth; i++)
        if ((const void *)&g_scopes[i] == s) return true;
    return false;
}

void gj_fe_use_scopes(void) {
    static const gj_ag_scope_ops ops = {user_scope_push, gj_scope_pop, scope_level,
                                        scope_open_from};
    gj_ag_set_user_scope(&ops);
}

gj_tensor *gj_scope_keep(gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_scope_keep", "t")) return gj_fe_fail();
    scope_unregister(t);
    gj_rt_tensor_result();
    return t;
}

void gj_release(gj_tensor *t) {
    if (!t) return;
    if (!gj_rt_check_tensor(t, "gj_release", "t")) return;
    int pinned = atomic_load(&t->pinned);
    if (pinned > 0 && atomic_load(&t->refcount) <= pinned) {
        /* Every reference left is held by gradjit (a .grad slot, or the
         * engine while it lends the tensor to a hook): the caller holds
         * none, so this pointer is borrowed. Freeing it would leave its
         * holder dangling; refuse, loudly. */
        char sh[96];
        gj_rt_fmt_shape(sh, sizeof sh, t->ndim, t->shape);
        gj_rt_set_error("gj_release: refused: the caller holds no reference to this %s %s "
                        "tensor: it is borrowed (the .grad gj_tensor_grad returns, or the "
                        "gradient a hook was handed); do not release it (gj_tensor_set_grad(leaf, "
                        "NULL) clears .grad)",
                        gj_rt_dtype_name(t->dtype), sh);
        fprintf(stderr, "gradjit: %s\n", gj_last_error());
        return;
    }
    scope_unregister(t);
    gj_rt_tensor_release(t);
}

gj_tensor *gj_retain(gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_retain", "t")) return gj_fe_fail();
    gj_rt_tensor_retain(t);
    gj_rt_tensor_result();
    return t;
}

/* ------------------------------------------------------------ creation */

static gj_tensor *new_checked(gj_dtype dt, int ndim, const int64_t *shape, const char *op) {
    if (!gj_rt_dtype_valid((int)dt)) {
        gj_rt_set_error("%s: invalid dtype %d", op, (int)dt);
        return gj_fe_fail();
    }
    if (ndim > 0 && !shape) {
        gj_rt_set_error("%s: shape is NULL for ndim %d", op, ndim);
        return gj_fe_fail();
    }
    if (!gj_rt_check_shape(ndim, shape, dt, op)) return gj_fe_fail();
    return gj_rt_tensor_new(dt, ndim, shape);
}

gj_tensor *gj_from_data(gj_dtype dtype, int ndim, const int64_t *shape, const void *data) {
    gj_tensor *t = new_checked(dtype, ndim, shape, "gj_from_data");
    if (!t) return gj_fe_fail();
    if (t->numel > 0) {
        if (!data) {
            gj_rt_set_error("gj_from_data: data is NULL for %lld elements", (long long)t->numel);
            gj_rt_tensor_release(t);
            return gj_fe_fail();
        }
        memcpy(t->storage->data, data, (size_t)t->numel * gj_rt_dtype_size(dtype));
    }
    GJ_FE_TRACE_CREATED(t, false, "gj_from_data");
    return gj_fe_own(t);
}

/* Writes value v (given as double) to element i of contiguous t. */
static void set_elem(gj_tensor *t, int64_t i, double v) {
    void *p = t->storage->data;
    switch (t->dtype) {
    case GJ_F32: ((float *)p)[i] = (float)v; break;
    case GJ_F64: ((double *)p)[i] = v; break;
    case GJ_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case GJ_BF16: ((uint16_t *)p)[i] = gj_m_f32_to_bf16((float)v); break;
    }
}

gj_tensor *gj_full(gj_dtype dtype, int ndim, const int64_t *shape, double value) {
    gj_tensor *t = new_checked(dtype, ndim, shape, "gj_full");
    if (!t) return gj_fe_fail();
    if (value != 0.0)
        for (int64_t i = 0; i < t->numel; i++) set_elem(t, i, value);
    GJ_FE_TRACE_CREATED(t, true, "gj_full");
    return gj_fe_own(t);
}

gj_tensor *gj_zeros(gj_dtype dtype, int ndim, const int64_t *shape) {
    gj_tensor *t = new_checked(dtype, ndim, shape, "gj_zeros");
    GJ_FE_TRACE_CREATED(t, true, "gj_zeros");
    return gj_fe_own(t);
}

gj_tensor *gj_ones(gj_dtype dtype, int ndim, const int64_t *shape) {
    gj_tensor *t = new_checked(dtype, ndim, shape, "gj_ones");
    if (!t) return gj_fe_fail();
    for (int64_t i = 0; i < t->numel; i++) set_elem(t, i, 1.0);
    GJ_FE_TRACE_CREATED(t, true, "gj_ones");
    return gj_fe_own(t);
}

gj_tensor *gj_scalar(gj_dtype dtype, double value) {
    gj_tensor *t = new_checked(dtype, 0, NULL, "gj_scalar");
    if (!t) return gj_fe_fail();
    set_elem(t, 0, value);
    GJ_FE_TRACE_CREATED(t, true, "gj_scalar");
    return gj_fe_own(t);
}


gj_tensor *gj_randn(gj_dtype dtype, int ndim, const int64_t *shape, double std) {
    gj_tensor *t = new_checked(dtype, ndim, shape, "gj_randn");
    if (!t) return gj_fe_fail();
    if (!gj_rt_dtype_is_float(dtype)) {
        gj_rt_set_error("gj_randn: dtype %s is not a float dtype", gj_rt_dtype_name(dtype));
        gj_rt_tensor_release(t);
        return gj_fe_fail();
    }
    if (!isfinite(std) || std < 0.0) { /* as torch.normal: std >= 0, and a number */
        gj_rt_set_error("gj_randn: std must be a finite number >= 0, got %g", std);
        gj_rt_tensor_release(t);
        return gj_fe_fail();
    }
    uint64_t seed = gj_rt_rng_seed(), c0 = gj_rt_rng_reserve((uint64_t)t->numel);
    for (int64_t i = 0; i < t->numel; i++)
        set_elem(t, i, std * gj_rt_rng_normal(seed, c0 + (uint64_t)i));
    GJ_FE_TRACE_CREATED(t, false, "gj_randn");
    return gj_fe_own(t);
}

gj_tensor *gj_rand(gj_dtype dtype, int ndim, const int64_t *shape, double lo, double hi) {
    gj_tensor *t = new_checked(dtype, ndim, shape, "gj_rand");
    if (!t) return gj_fe_fail();
    if (!gj_rt_dtype_is_float(dtype) || !isfinite(lo) || !isfinite(hi) || !(hi >= lo)) {
        gj_rt_set_error("gj_rand: needs a float dtype and finite bounds lo <= hi (got %s, "
                        "[%g, %g))",
                        gj_rt_dtype_name(dtype), lo, hi);
        gj_rt_tensor_release(t);
        return gj_fe_fail();
    }
    uint64_t seed = gj_rt_rng_seed(), c0 = gj_rt_rng_reserve((uint64_t)t->numel);
    for (int64_t i = 0; i < t->numel; i++)
        set_elem(t, i, lo + (hi - lo) * gj_rt_rng_uniform(seed, c0 + (uint64_t)i));
    GJ_FE_TRACE_CREATED(t, false, "gj_rand");
    return gj_fe_own(t);
}

/* ----------------------------------------------------------- accessors */

/* On a NULL or dead tensor each accessor sets an error naming itself
 * (with the cause of the NULL, gj_rt_check_tensor) and returns its
 * documented sentinel. */
gj_dtype gj_tensor_dtype(const gj_tensor *t) {
    return gj_rt_check_tensor(t, "gj_tensor_dtype", "t") ? t->dtype : GJ_F32;
}
int gj_tensor_ndim(const gj_tensor *t) {
    return gj_rt_check_tensor(t, "gj_tensor_ndim", "t") ? t->ndim : -1;
}
const int64_t *gj_tensor_shape(const gj_tensor *t) {
    return gj_rt_check_tensor(t, "gj_tensor_shape", "t") ? t->shape : NULL;
}
const int64_t *gj_tensor_strides(const gj_tensor *t) {
    return gj_rt_check_tensor(t, "gj_tensor_strides", "t") ? t->strides : NULL;
}
int64_t gj_tensor_numel(const gj_tensor *t) {
    return gj_rt_check_tensor(t, "gj_tensor_numel", "t") ? t->numel : -1;
}
bool gj_tensor_is_contiguous(const gj_tensor *t) {
    return gj_rt_check_tensor(t, "gj_tensor_is_contiguous", "t") && gj_rt_is_contiguous(t);
}

void *gj_tensor_data(gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_tensor_data", "t")) return NULL;
    GJ_FE_TRACE_READ(t, "gj_tensor_data", true);
    if (gj_rt_present(t) != 0) return NULL; /* (a ZeRO-3 parameter: gathered) */
    return gj_rt_data_ptr(t);
}

int gj_tensor_to_f64(const gj_tensor *t, double *out) {
    if (!gj_rt_check_tensor(t, "gj_tensor_to_f64", "t")) return -1;
    if (!out && t->numel) {
        gj_rt_set_error("gj_tensor_to_f64: out is NULL");
        return -1;
    }
    GJ_FE_TRACE_READ(t, "gj_tensor_to_f64", false);
    if (gj_rt_present(t) != 0) return -1; /* (a ZeRO-3 parameter: gathered) */
    for (int64_t i = 0; i < t->numel; i++) out[i] = gj_rt_get(t, i);
    return 0;
}

int gj_tensor_to_f32(const gj_tensor *t, float *out) {
    if (!gj_rt_check_tensor(t, "gj_tensor_to_f32", "t")) return -1;
    if (!out && t->numel) {
        gj_rt_set_error("gj_tensor_to_f32: out is NULL");
        return -1;
    }
    GJ_FE_TRACE_READ(t, "gj_tensor_to_f32", false);
    if (gj_rt_present(t) != 0) return -1; /* (a ZeRO-3 parameter: gathered) */
    for (int64_t i = 0; i < t->numel; i++) out[i] = (float)gj_rt_get(t, i);
    return 0;
}

double gj_tensor_item_at(const gj_tensor *t, int64_t index) {
    if (!gj_rt_check_tensor(t, "gj_tensor_item_at", "t")) return NAN;
    GJ_FE_TRACE_READ(t, "gj_tensor_item_at", false);
    if (gj_rt_present(t) != 0) return NAN; /* (a ZeRO-3 parameter: gathered) */
    if (index < 0 || index >= t->numel) {
        char sh[96];
        gj_rt_fmt_shape(sh, sizeof sh, t->ndim, t->shape);
        gj_rt_set_error("gj_tensor_item_at: index %lld out of range for %s tensor of shape %s",
                        (long long)index, gj_rt_dtype_name(t->dtype), sh);
        return NAN;
    }
    return gj_rt_get(t, index);
}

double gj_tensor_item(const gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_tensor_item", "t")) return NAN;
    GJ_FE_TRACE_READ(t, "gj_tensor_item", false);
    if (gj_rt_present(t) != 0) return NAN; /* (a ZeRO-3 parameter: gathered) */
    if (t->numel != 1) {
        char sh[96];
        gj_rt_fmt_shape(sh, sizeof sh, t->ndim, t->shape);
        gj_rt_set_error("gj_tensor_item: tensor of shape %s has %lld elements, not 1", sh,
                        (long long)t->numel);
        return NAN;
    }
    return gj_rt_get(t, 0);
}

int64_t gj_tensor_version(const gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_tensor_version", "t")) return -1;
    return atomic_load(&t->storage->version);
}

/* --------------------------------------------------------------- names */

int gj_tensor_set_name(gj_tensor *t, const char *name) {
    if (!gj_rt_check_tensor(t, "gj_tensor_set_name", "t")) return -1;
    char *copy = NULL;
    if (name && name[0]) {
        size_t n = strlen(name);
        if (n > 255) {
            gj_rt_set_error("gj_tensor_set_name: name of %zu bytes (at most 255)", n);
            return -1;
        }
        copy = gj_rt_malloc(n + 1);
        if (!copy) return -1;
        memcpy(copy, name, n + 1);
    }
    gj_rt_free(t->name);
    t->name = copy;
    return 0;
}

const char *gj_tensor_name(const gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_tensor_name", "t")) return NULL;
    return t->name;
}

/* ------------------------------------------------------------ autograd */

int gj_set_requires_grad(gj_tensor *t, bool requires_grad) {
    if (!gj_rt_check_tensor(t, "gj_set_requires_grad", "t")) return -1;
    GJ_FE_TRACE_UNTRACEABLE("gj_set_requires_grad");
    gj_ag_tensor_meta *m = t->ag;
    if (m && m->node) {
        gj_rt_set_error("gj_set_requires_grad: only leaf tensors can change requires_grad "
                        "(this one was computed by op %s); use gj_detach",
                        m->node->op->name);
        return -1;
    }
    if (requires_grad && !gj_rt_dtype_is_float(t->dtype)) {
        gj_rt_set_error("gj_set_requires_grad: only float tensors can require grad (got %s)",
                        gj_rt_dtype_name(t->dtype));
        return -1;
    }
    if (!requires_grad && !m) return 0;
    m = gj_ag_meta_get(t, true);
    if (!m) return -1;
    m->requires_grad = requires_grad;
    return 0;
}

bool gj_requires_grad(const gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_requires_grad", "t")) return false;
    gj_ag_tensor_meta *m = t->ag;
    return m && m->requires_grad;
}

bool gj_is_leaf(const gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_is_leaf", "t")) return false;
    gj_ag_tensor_meta *m = t->ag;
    return !(m && m->node);
}

gj_tensor *gj_tensor_grad(const gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_tensor_grad", "t")) return gj_fe_fail();
    gj_ag_tensor_meta *m = t->ag;
    gj_rt_tensor_result(); /* no .grad yet is a NULL that no failure explains */
    return m ? m->grad : NULL;
}

int gj_tensor_set_grad(gj_tensor *t, gj_tensor *g) {
    if (!gj_rt_check_tensor(t, "gj_tensor_set_grad", "t")) return -1;
    GJ_FE_TRACE_UNTRACEABLE("gj_tensor_set_grad");
    if (g) {
        if (!gj_rt_check_tensor(g, "gj_tensor_set_grad", "g")) return -1;
        if (g->ndim != t->ndim || memcmp(g->shape, t->shape, (size_t)t->ndim * 8) != 0 ||
            !gj_rt_dtype_is_float(g->dtype)) {
            char a[96], b[96];
            gj_rt_fmt_shape(a, sizeof a, t->ndim, t->shape);
            gj_rt_fmt_shape(b, sizeof b, g->ndim, g->shape);
            gj_rt_set_error("gj_tensor_set_grad: grad %s %s does not fit tensor %s %s",
                            gj_rt_dtype_name(g->dtype), b, gj_rt_dtype_name(t->dtype), a);
            return -1;
        }
    }
    gj_ag_tensor_meta *m = gj_ag_meta_get(t, g != NULL);
    if (!m) return g ? -1 : 0;
    if (g) gj_rt_tensor_retain(g);
    gj_ag_meta_set_grad(m, g);
    return 0;
}

gj_tensor *gj_detach(gj_tensor *t) {
    if (!gj_rt_check_tensor(t, "gj_detach", "t")) return gj_fe_fail();
    gj_tensor *a = gj_rt_tensor_alias(t);
    if (a && gj_ag_trace_active()) gj_ag_trace_note_alias(t, a);
    return gj_fe_own(a);
}

void gj_no_grad_push(void) { gj_ag_no_grad_enter(); }
void gj_no_grad_pop(void) { gj_ag_no_grad_exit(); }
bool gj_is_grad_enabled(void) { return gj_ag_grad_enabled(); }

/* ------------------------------------------------------------ backward */

/* The seed of root: a borrowed seed after checks, or a new ones tensor
 * (*made = true). */
static gj_tensor *make_seed(gj_tensor *root, gj_tensor *seed, const char *op, int idx,
                            bool *made) {
    char a[96], b[96];
    *made = false;
    if (seed) {
        if (!gj_rt_check_tensor(seed, op, "seed")) return NULL;
        if (seed->ndim != root->ndim ||
            memcmp(seed->shape, root->shape, (size_t)root->ndim * 8) != 0 ||
            seed->dtype != root->dtype) {
            gj_rt_fmt_shape(a, sizeof a, root->ndim, root->shape);
            gj_rt_fmt_shape(b, sizeof b, seed->ndim, seed->shape);
            gj_rt_set_error("%s: seed %d is %s %s but the output is %s %s", op, idx,
                            gj_rt_dtype_name(seed->dtype), b, gj_rt_dtype_name(root->dtype), a);
            return NULL;
        }
        return seed;
    }
    if (root->numel != 1) {
        gj_rt_fmt_shape(a, sizeof a, root->ndim, root->shape);
        gj_rt_set_error("%s: a seed gradient is needed for output %d of shape %s (only "
                        "one-element outputs get an implicit seed of 1)",
                        op, idx, a);
        return NULL;
    }
    gj_tensor *s = gj_rt_tensor_new(root->dtype, root->ndim, root->shape);
    if (!s) return NULL;
    set_elem(s, 0, 1.0);
    *made = true;
    return s;
}

/* Anomaly mode runs every backward eagerly (its NaN/Inf checks need real
 * tensors): true then, counted as a GJ_CA_INCOMPATIBLE_MODE fallback, with
 * a warning printed once per process. */
static bool anomaly_blocks_compiled(void) {
    static atomic_bool warned;
    if (!gj_ag_anomaly()) return false;
    if (!atomic_exchange(&warned, true))
        fprintf(stderr, "gradjit: anomaly mode is on: compiled autograd is off for these "
                        "backwards (they run eagerly)\n");
    gj_jit_note_fallback(GJ_CA_INCOMPATIBLE_MODE, "anomaly mode is on");
    return true;
}

/* The backward of roots[0..n) (checked) with seeds (NULL, or entries
 * NULL: ones), fn naming it in messages: compiled first when the flag is
 * on, else (or on a fallback) eagerly. */
static int backward_roots(int n, gj_tensor *const *roots, gj_tensor *const *seeds,
                          bool retain_graph, const char *fn) {
    GJ_FE_TRACE_UNTRACEABLE("a backward (gj_backward)");
    int rc = -1;
    gj_tensor **sd = gj_rt_calloc((size_t)n, sizeof *sd);
    bool *made = gj_rt_calloc((size_t)n, sizeof *made);
    gj_val **sv = gj_rt_calloc((size_t)n, sizeof *sv);
    if (!sd || !made || !sv) goto done;
    for (int r = 0; r < n; r++) {
        sd[r] = make_seed(roots[r], seeds ? seeds[r] : NULL, fn, r, &made[r]);
        if (!sd[r]) goto done;
        sv[r] = gj_ag_tensor_val(sd[r]);
    }
    if (gj_ag_backward_enter(n, roots, fn) != 0) goto done; /* re-entered from a hook */
    bool handled = false;
    if (gj_fe_compiled_enabled()) {
        gj_fe_count_backward();
        if (!anomaly_blocks_compiled())
            rc = gj_jit_backward(n, roots, sd, retain_graph, &handled);
    }
    if (!handled) {
        gj_ag_builder *b = gj_ag_eager_builder();
        rc = gj_ag_run_backward(b, n, roots, sv, 0, NULL, NULL, retain_graph, true);
    }
    /* A backward that succeeded leaves no error, however it ran (eager,
     * compiled, or a fallback that ended well: the compiler's message stays
     * readable through gj_compiled_autograd_last_fallback, not
     * gj_last_error), so a stale message never outlives a good step. */
    if (rc == 0) gj_clear_error();
    gj_ag_backward_exit();
done:
    for (int r = 0; sd && made && r < n; r++)
        if (made[r]) gj_rt_tensor_release(sd[r]);
    gj_rt_free(sd);
    gj_rt_free(made);
    gj_rt_free(sv);
    return rc;
}

int gj_backward_ex(gj_tensor *root, gj_tensor *seed, bool retain_graph) {
    if (!gj_rt_check_tensor(root, "gj_backward", "root")) return -1;
    return backward_roots(1, &root, &seed, retain_graph, "gj_backward");
}

int gj_backward_multi(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                      bool retain_graph) {
    if (n_roots <= 0 || !roots) {
        gj_rt_set_error("gj_backward_multi: needs n_roots > 0 and non-NULL roots (got %d)",
                        n_roots);
        return -1;
    }
    for (int r = 0; r < n_roots; r++)
        if (!gj_rt_check_tensor(roots[r], "gj_backward_multi", "roots[r]")) return -1;
    return backward_roots(n_roots, roots, seeds, retain_graph, "gj_backward_multi");
}

int gj_backward(gj_tensor *root, gj_tensor *seed) { return gj_backward_ex(root, seed, false); }

int gj_grad(int n_outputs, gj_tensor *const *outputs, gj_tensor *const *seeds, int n_inputs,
            gj_tensor *const *inputs, gj_tensor **grads_out, bool retain_graph,
            bool allow_unused) {
    GJ_FE_TRACE_UNTRACEABLE("gj_grad");
    int rc = -1;
    if (n_outputs <= 0 || n_inputs <= 0 || !outputs || !inputs || !grads_out) {
        gj_rt_set_error("gj_grad: needs n_outputs > 0, n_inputs > 0 and non-NULL outputs, "
                        "inputs and grads_out (got %d, %d)",
                        n_outputs, n_inputs);
        return -1;
    }
    for (int i = 0; i < n_inputs; i++) grads_out[i] = NULL;
    gj_tensor **sd = gj_rt_calloc((size_t)n_outputs, sizeof *sd);
    bool *made = gj_rt_calloc((size_t)n_outputs, sizeof *made);
    gj_val **sv = gj_rt_calloc((size_t)n_outputs, sizeof *sv);
    gj_val **gv = gj_rt_calloc((size_t)n_inputs, sizeof *gv);
    gj_tensor **gt = gj_rt_calloc((size_t)n_inputs, sizeof *gt);
    if (!sd || !made || !sv || !gv || !gt) goto done;
    for (int i = 0; i < n_outputs; i++)
        if (!gj_rt_check_tensor(outputs[i], "gj_grad", "outputs[i]")) goto done;
    for (int i = 0; i < n_inputs; i++)
        if (!gj_rt_check_tensor(inputs[i], "gj_grad", "inputs[i]")) goto done;
    for (int i = 0; i < n_outputs; i++) {
        sd[i] = make_seed(outputs[i], seeds ? seeds[i] : NULL, "gj_grad", i, &made[i]);
        if (!sd[i]) goto done;
        sv[i] = gj_ag_tensor_val(sd[i]);
    }
    if (gj_ag_backward_enter(n_outputs, outputs, "gj_grad") != 0) goto done;
    /* gt[i]: a reference to input i's gradient (the same tensor for an
     * input given twice), or NULL when none reaches it, however it ran */
    int brc = -1;
    bool handled = false;
    if (gj_fe_compiled_enabled()) {
        gj_fe_count_backward();
        if (!anomaly_blocks_compiled())
            brc = gj_jit_grad(n_outputs, outputs, sd, n_inputs, inputs, gt, retain_graph,
                              &handled);
    }
    if (!handled) {
        gj_ag_builder *b = gj_ag_eager_builder();
        brc = gj_ag_run_backward(b, n_outputs, outputs, sv, n_inputs, inputs, gv, retain_graph,
                                 false);
        for (int i = 0; i < n_inputs; i++) gt[i] = brc == 0 ? gj_ag_val_tensor(gv[i]) : NULL;
    }
    gj_ag_backward_exit();
    if (brc != 0) goto done;
    gj_clear_error(); /* a good gj_grad leaves no message, however it ran (gj_backward_ex) */
    rc = 0;
    for (int i = 0; i < n_inputs; i++) {
        gj_tensor *g = gt[i]; /* a reference kept for us */
        if (g && rc == 0 && atomic_load(&g->refcount) > 1) {
            /* Someone else holds this tensor too: another slot (the same
             * input twice), the caller (its own seed flowing through), a
             * saved tensor. Each slot gets a header of its own, so each
             * reference is registered once and released once. */
            gj_tensor *a = gj_rt_tensor_alias(g);
            gj_rt_tensor_release(g);
            g = a;
            if (!g) {
                rc = -1;
                continue;
            }
        }
        if (!g) {
            if (allow_unused) {
                g = gj_rt_tensor_new(inputs[i]->dtype, inputs[i]->ndim, inputs[i]->shape);
            } else {
                gj_rt_set_error("gj_grad: input %d is not reachable from the outputs "
                                "(pass allow_unused to get zeros)",
                                i);
            }
            if (!g) rc = -1;
        }
        grads_out[i] = g;
    }
    if (rc != 0) {
        for (int i = 0; i < n_inputs; i++) {
            if (grads_out[i]) gj_rt_tensor_release(grads_out[i]);
            grads_out[i] = NULL;
        }
    } else {
        for (int i = 0; i < n_inputs; i++) gj_fe_own(grads_out[i]);
    }
done:
    for (int i = 0; sd && made && i < n_outputs; i++)
        if (made[i]) gj_rt_tensor_release(sd[i]);
    gj_rt_free(sd);
    gj_rt_free(made);
    gj_rt_free(sv);
    gj_rt_free(gv);
    gj_rt_free(gt);
    if (rc != 0) gj_rt_null_result(); /* grads_out[] are NULL: passed on, they cite it */
    return rc;
}
