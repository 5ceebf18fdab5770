/* SPDX-License-Identifier: MIT */
/*
 * checkpoint.c - activation-checkpoint regions: the tape recorded while a
 * region's function runs, the single autograd node a region becomes, and
 * that node's backward (replay, then the tape's backward formulas in
 * reverse), written once against the builder interface so that the eager
 * engine recomputes and the recording builder of jit/ inlines the very same
 * recomputation into a captured graph.
 *
 * Slots. A tape reads values through slots: a SOURCE (region input k, or a
 * tensor from outside the region that some op read: a "constant", e.g. a
 * parameter) or output m of ENTRY j (an op recorded earlier in the same
 * region). While a region is open, tensors are identified by pointer: the
 * region holds a strong reference to every source and every op output it
 * has seen, so no pointer is reused while the tape maps it.
 *
 * Invariants of a finished tape (owned by exactly one checkpoint node,
 * found through a registry keyed by the node, freed by gj_ag_ckpt_node_free
 * when the node dies):
 *   - entries are in execution order and only read sources or outputs of
 *     earlier entries;
 *   - per entry, `keep` says whether the policy saved its outputs; every
 *     saved output and every value its formula saved that is neither an
 *     input nor an output ("internal", e.g. layer_norm's mean) is a STORED
 *     tensor of the tape, as is every source some entry reads. Stored
 *     tensors are detached aliases with the storage version seen when the
 *     region ran; the first GJ_AG_MAX_SAVED are the node's own saved
 *     tensors (so the engine and the JIT validate and find them as any
 *     saved tensor), the rest are held here;
 *   - saved values live per region and per op position: a backward never
 *     reads another region's tape, whatever the engine skips.
 *
 * The node's inputs are the region inputs (in order) followed by every
 * outside tensor requiring grad that the tape reads: parameters used in a
 * region receive their gradients like any other leaf.
 *
 * Backward (ckpt_bwd) first plans: which entries' formulas run (a gradient
 * reaches an output and an input wanting one is upstream), which values
 * those formulas read, and so which dropped entries run again (early stop:
 * an op whose output no formula reads is not recomputed). The replay keeps
 * only the values formulas read; the sweep then runs the formulas last to
 * first, summing gradients per slot with ADD. On the eager builder it ends
 * a step after the replay and after each formula, so dead temporaries die
 * at once (the engine keeps the incoming gradients), and hands its results
 * back as fresh temporaries of the step. A dropout entry keeps the seed and
 * offset of its first run in its attributes: the replay draws the same mask
 * and takes nothing from the generator.
 */
#include "ag.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------- the tape */

typedef struct ckpt_ref {
    int entry; /* -1: source `index`; else output `index` of entry `entry` */
    int index;
} ckpt_ref;

enum { SV_INPUT = 0, SV_OUTPUT = 1, SV_INTERNAL = 2 };

typedef struct ckpt_sref {
    int kind;  /* SV_* */
    int index; /* input i, output m, or stored tensor k (SV_INTERNAL of a kept entry) */
} ckpt_sref;

typedef struct ckpt_entry {
    const gj_ag_opdef *op;
    gj_ag_attrs attrs;
    int n_in, n_out, n_saved;
    ckpt_ref in[GJ_AG_MAX_IN];
    gj_rt_meta in_meta[GJ_AG_MAX_IN];
    gj_rt_meta out_meta[GJ_AG_MAX_OUT];
    ckpt_sref saved[GJ_AG_MAX_SAVED]; /* what the formula saved, by reference */
    int out_stored[GJ_AG_MAX_OUT];     /* stored index of a kept output, else -1 */
    gj_ckpt_policy policy;
    bool keep; /* outputs (and internals) saved by the policy */
    bool grad; /* gradient can flow through it (grad mode on, a differentiable input) */
} ckpt_entry;

typedef struct ckpt_src {
    gj_tensor *t;       /* while the region is open: the tensor (strong); then NULL */
    int64_t version;    /* storage version when first seen */
    gj_rt_meta meta;
    bool requires_grad; /* a gradient can flow to it */
    bool read;          /* some entry reads it */
    int node_in;        /* input index of the node, or -1 */
    int stored;         /* stored index, or -1 */
} ckpt_src;

typedef struct ckpt_tape ckpt_tape;
struct ckpt_tape {
    gj_ag_node *node;  /* the owning node (registry key), NULL before */
    ckpt_tape *hnext;  /* registry chain */
    ckpt_entry *e;
    int n_entries, cap_entries;
    ckpt_src *src;
    int n_src, cap_src;
    int n_in;          /* region inputs: sources 0..n_in-1 */
    int n_out;
    ckpt_ref out[GJ_AG_MAX_OUT];
    int n_node_in;
    gj_tensor **stored;        /* [n_stored]; entries < n_node_saved are NULL (node->saved) */
    int64_t *stored_version;   /* [n_stored] */
    gj_rt_meta *stored_meta;   /* [n_stored] */
    int n_stored, n_node_saved;
    int *out_base;             /* [n_entries]: first slot of entry j's outputs */
    int n_slots;               /* n_src + all outputs */
    uint64_t rng_seed, rng_counter; /* the generator's state at region entry */
    bool has_policy;
};

/* One value the region held while open: an op output or an internal. */
typedef struct ckpt_held {
    gj_tensor *t; /* strong */
    int64_t version;
    int entry, index; /* output `index` of `entry`, or internal: index = -1 - saved slot */
} ckpt_held;

struct gj_ag_ckpt_region {
    ckpt_tape *tape;
    gj_ckpt_policy_fn policy;
    void *policy_data;
    ckpt_held *held;
    int n_held, cap_held;
};

static _Thread_local gj_ag_ckpt_region *g_region;
static _Thread_local int64_t g_recomputed; /* tape ops replayed by backwards, this thread */

int64_t gj_ag_ckpt_recomputed(void) { return g_recomputed; }

gj_ag_ckpt_region *gj_ag_ckpt_active(void) { return g_region; }

int gj_ag_ckpt_tape_len(const gj_ag_ckpt_region *r) { return r->tape->n_entries; }

static void tape_free(ckpt_tape *tp) {
    if (!tp) return;
    for (int s = 0; s < tp->n_src; s++)
        if (tp->src[s].t) gj_rt_tensor_release(tp->src[s].t);
    for (int k = 0; k < tp->n_stored && tp->stored; k++)
        if (tp->stored[k]) gj_rt_tensor_release(tp->stored[k]);
    gj_rt_free(tp->stored);
    gj_rt_free(tp->stored_version);
    gj_rt_free(tp->stored_meta);
    gj_rt_free(tp->out_base);
    gj_rt_free(tp->e);
    gj_rt_free(tp->src);
    gj_rt_free(tp);
}

static void region_free(gj_ag_ckpt_region *r) {
    if (!r) return;
    if (g_region == r) g_region = NULL;
    for (int h = 0; h < r->n_held; h++) gj_rt_tensor_release(r->held[h].t);
    gj_rt_free(r->held);
    tape_free(r->tape);
    gj_rt_free(r);
}

/* ------------------------------------------------------------ registry */

/* node -> tape, chained buckets; one mutex (nodes die on any thread). */
#define CKPT_BUCKETS 1024
static ckpt_tape *g_buckets[CKPT_BUCKETS];
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned node_bucket(const gj_ag_node *n) {
    uint64_t x = (uint64_t)(uintptr_t)n;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (unsigned)(x & (CKPT_BUCKETS - 1));
}

static void registry_add(ckpt_tape *tp, gj_ag_node *n) {
    unsigned h = node_bucket(n);
    pthread_mutex_lock(&g_reg_lock);
    tp->node = n;
    tp->hnext = g_buckets[h];
    g_buckets[h] = tp;
    pthread_mutex_unlock(&g_reg_lock);
}

/* The tape of n (borrowed: valid while n lives), or NULL. */
static ckpt_tape *registry_find(const gj_ag_node *n) {
    unsigned h = node_bucket(n);
    pthread_mutex_lock(&g_reg_lock);
    ckpt_tape *tp = g_buckets[h];
    while (tp && tp->node != n) tp = tp->hnext;
    pthread_mutex_unlock(&g_reg_lock);
    return tp;
}

void gj_ag_ckpt_node_free(gj_ag_node *n) {
    unsigned h = node_bucket(n);
    pthread_mutex_lock(&g_reg_lock);
    ckpt_tape **pp = &g_buckets[h];
    while (*pp && (*pp)->node != n) pp = &(*pp)->hnext;
    ckpt_tape *tp = *pp;
    if (tp) *pp = tp->hnext;
    pthread_mutex_unlock(&g_reg_lock);
    tape_free(tp);
}

/* ------------------------------------------------------ recording (forward) */

gj_ag_ckpt_region *gj_ag_ckpt_begin(int n_in, gj_tensor *const *in, gj_ckpt_policy_fn policy,
                                    void *policy_data) {
    if (g_region) {
        gj_rt_set_error("gj_checkpoint: nested checkpoint regions are not supported (a region "
                        "is already open on this thread: call gj_checkpoint outside of the "
                        "outer region's function, or merge the regions)");
        return NULL;
    }
    gj_ag_ckpt_region *r = gj_rt_calloc(1, sizeof *r);
    ckpt_tape *tp = r ? gj_rt_calloc(1, sizeof *tp) : NULL;
    if (!tp) goto fail;
    r->tape = tp;
    r->policy = policy;
    r->policy_data = policy_data;
    tp->has_policy = policy != NULL;
    tp->rng_seed = gj_rt_rng_seed();
    tp->rng_counter = gj_rt_rng_reserve(0);
    tp->cap_src = n_in + 8;
    tp->src = gj_rt_calloc((size_t)tp->cap_src, sizeof *tp->src);
    if (!tp->src) goto fail;
    for (int k = 0; k < n_in; k++) {
        ckpt_src *s = &tp->src[k];
        gj_rt_tensor_retain(in[k]);
        s->t = in[k];
        s->version = atomic_load(&in[k]->storage->version);
        gj_rt_meta_of(in[k], &s->meta);
        gj_ag_tensor_meta *m = in[k]->ag;
        s->requires_grad = m && m->requires_grad && gj_rt_dtype_is_float(in[k]->dtype);
        s->node_in = -1;
        s->stored = -1;
        tp->n_src++;
    }
    tp->n_in = n_in;
    g_region = r;
    return r;
fail:
    region_free(r);
    return NULL;
}

void gj_ag_ckpt_abort(gj_ag_ckpt_region *r) { region_free(r); }

/* The slot tensor t is known as, or entry -2 if unknown. Later holds win
 * over sources (a source is never an op output, so there is no overlap). */
static ckpt_ref find_ref(const gj_ag_ckpt_region *r, const gj_tensor *t) {
    for (int h = r->n_held - 1; h >= 0; h--)
        if (r->held[h].t == t && r->held[h].index >= 0)
            return (ckpt_ref){r->held[h].entry, r->held[h].index};
    const ckpt_tape *tp = r->tape;
    for (int s = 0; s < tp->n_src; s++)
        if (tp->src[s].t == t) return (ckpt_ref){-1, s};
    return (ckpt_ref){-2, 0};
}

/* A new constant source for t (retained). Its index, or -1 (OOM). */
static int add_const(ckpt_tape *tp, gj_tensor *t) {
    if (tp->n_src == tp->cap_src) {
        int cap = tp->cap_src * 2 + 8;
        ckpt_src *s = gj_rt_realloc(tp->src, (size_t)cap * sizeof *s);
        if (!s) return -1;
        tp->src = s;
        tp->cap_src = cap;
    }
    ckpt_src *s = &tp->src[tp->n_src];
    memset(s, 0, sizeof *s);
    gj_rt_tensor_retain(t);
    s->t = t;
    s->version = atomic_load(&t->storage->version);
    gj_rt_meta_of(t, &s->meta);
    gj_ag_tensor_meta *m = t->ag;
    s->requires_grad = m && m->requires_grad && gj_rt_dtype_is_float(t->dtype);
    s->node_in = -1;
    s->stored = -1;
    return tp->n_src++;
}

static int held_push(gj_ag_ckpt_region *r, gj_tensor *t, int entry, int index) {
    if (r->n_held == r->cap_held) {
        int cap = r->cap_held ? r->cap_held * 2 : 32;
        ckpt_held *h = gj_rt_realloc(r->held, (size_t)cap * sizeof *h);
        if (!h) return -1;
        r->held = h;
        r->cap_held = cap;
    }
    gj_rt_tensor_retain(t);
    r->held[r->n_held++] = (ckpt_held){t, atomic_load(&t->storage->version), entry, index};
    return 0;
}

static bool ref_differentiable(const ckpt_tape *tp, ckpt_ref ref) {
    if (ref.entry < 0) return tp->src[ref.index].requires_grad;
    const ckpt_entry *e = &tp->e[ref.entry];
    return e->grad && gj_rt_dtype_is_float(e->out_meta[ref.index].dtype);
}

static const char *policy_name(gj_ckpt_policy p) {
    switch (p) {
    case GJ_CKPT_MUST_SAVE: return "MUST_SAVE";
    case GJ_CKPT_PREFER_SAVE: return "PREFER_SAVE";
    case GJ_CKPT_MUST_RECOMPUTE: return "MUST_RECOMPUTE";
    case GJ_CKPT_PREFER_RECOMPUTE: return "PREFER_RECOMPUTE";
    }
    return "?";
}

int gj_ag_ckpt_note(gj_ag_ckpt_region *r, const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                    gj_tensor *const *in, gj_val *const *vout, int n_out, gj_tensor *const *outs,
                    int n_saved, gj_val *const *saved) {
    ckpt_tape *tp = r->tape;
    int n_src0 = tp->n_src, n_held0 = r->n_held;
    if (n_out > GJ_AG_MAX_OUT || n_in > GJ_AG_MAX_IN || n_saved > GJ_AG_MAX_SAVED) {
        gj_rt_set_error("gj_checkpoint: internal: op %s arity out of range", op->name);
        return -1;
    }
    if (tp->n_entries == tp->cap_entries) {
        int cap = tp->cap_entries ? tp->cap_entries * 2 : 16;
        ckpt_entry *e = gj_rt_realloc(tp->e, (size_t)cap * sizeof *e);
        if (!e) return -1;
        tp->e = e;
        tp->cap_entries = cap;
    }
    int j = tp->n_entries;
    ckpt_entry *e = &tp->e[j];
    memset(e, 0, sizeof *e);
    e->op = op;
    if (a) e->attrs = *a;
    e->n_in = n_in;
    e->n_out = n_out;
    e->n_saved = n_saved;
    gj_ckpt_policy pol = GJ_CKPT_PREFER_RECOMPUTE; /* no policy: recompute everything */
    if (r->policy) {
        pol = r->policy(op->name, j, r->policy_data);
        if ((int)pol < (int)GJ_CKPT_MUST_SAVE || (int)pol > (int)GJ_CKPT_PREFER_RECOMPUTE) {
            gj_rt_set_error("gj_checkpoint: the policy returned %d for op %s at position %d; "
                            "expected a gj_ckpt_policy (0..3)",
                            (int)pol, op->name, j);
            return -1;
        }
    }
    e->policy = pol;
    e->keep = pol == GJ_CKPT_MUST_SAVE || pol == GJ_CKPT_PREFER_SAVE;
    bool any_diff = false;
    for (int i = 0; i < n_in; i++) {
        ckpt_ref ref = find_ref(r, in[i]);
        if (ref.entry == -2) {
            int s = add_const(tp, in[i]);
            if (s < 0) goto fail;
            ref = (ckpt_ref){-1, s};
        }
        if (ref.entry < 0) tp->src[ref.index].read = true;
        e->in[i] = ref;
        gj_rt_meta_of(in[i], &e->in_meta[i]);
        any_diff |= ref_differentiable(tp, ref);
    }
    e->grad = gj_ag_grad_enabled() && any_diff;
    for (int k = 0; k < n_out; k++) {
        gj_rt_meta_of(outs[k], &e->out_meta[k]);
        e->out_stored[k] = -1;
    }
    for (int s = 0; s < n_saved; s++) {
        ckpt_sref sr = {SV_INTERNAL, -1};
        for (int i = 0; i < n_in && sr.kind == SV_INTERNAL; i++)
            if (saved[s] == gj_ag_tensor_val(in[i])) sr = (ckpt_sref){SV_INPUT, i};
        for (int k = 0; k < n_out && sr.kind == SV_INTERNAL; k++)
            if (saved[s] == vout[k]) sr = (ckpt_sref){SV_OUTPUT, k};
        if (sr.kind == SV_INTERNAL && e->keep &&
            held_push(r, gj_ag_val_tensor(saved[s]), j, -1 - s) != 0)
            goto fail;
        e->saved[s] = sr;
    }
    for (int k = 0; k < n_out; k++)
        if (held_push(r, outs[k], j, k) != 0) goto fail;
    tp->n_entries++;
    return 0;
fail:
    while (r->n_held > n_held0) gj_rt_tensor_release(r->held[--r->n_held].t);
    while (tp->n_src > n_src0) gj_rt_tensor_release(tp->src[--tp->n_src].t);
    return -1;
}

/* ------------------------------------------------------- serialization */

typedef struct sbuf {
    char *p;
    size_t cap;
    int64_t len; /* full length, even beyond cap */
} sbuf;

static void sb_put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_put(sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = (size_t)b->len < b->cap ? b->cap - (size_t)b->len : 0;
    int n = vsnprintf(room ? b->p + b->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) b->len += n;
}

static void sb_meta(sbuf *b, const gj_rt_meta *m) {
    sb_put(b, "%d[", (int)m->dtype);
    for (int k = 0; k < m->ndim; k++) sb_put(b, k ? ",%lld" : "%lld", (long long)m->shape[k]);
    sb_put(b, "]");
}

static void sb_ref(sbuf *b, const ckpt_tape *tp, ckpt_ref r) {
    if (r.entry >= 0)
        sb_put(b, "e%d:%d", r.entry, r.index);
    else if (r.index < tp->n_in)
        sb_put(b, "in%d", r.index);
    else
        sb_put(b, "c%d", r.index - tp->n_in);
}

/* The canonical text of a finished tape (see gj_ag_ckpt_serialize). */
static int64_t tape_serialize(const ckpt_tape *tp, uint32_t (*runtime_attrs)(const gj_ag_opdef *),
                              char *buf, size_t cap) {
    sbuf b = {buf, cap, 0};
    if (cap) buf[0] = '\0';
    sb_put(&b, "ckpt v1 in=%d src=%d ops=%d out=%d stored=%d/%d policy=%d\n", tp->n_in,
           tp->n_src, tp->n_entries, tp->n_out, tp->n_stored, tp->n_node_saved,
           tp->has_policy ? 1 : 0);
    for (int s = 0; s < tp->n_src; s++) {
        const ckpt_src *c = &tp->src[s];
        sb_put(&b, " S%d ", s);
        sb_meta(&b, &c->meta);
        sb_put(&b, " rg%d rd%d n%d st%d\n", c->requires_grad, c->read, c->node_in, c->stored);
    }
    for (int j = 0; j < tp->n_entries; j++) {
        const ckpt_entry *e = &tp->e[j];
        uint32_t rt = runtime_attrs ? runtime_attrs(e->op) : 0;
        sb_put(&b, " E%d %s a", j, e->op->name);
        for (int k = 0; k < e->attrs.nf && k < 4; k++)
            sb_put(&b, "%s%a", k ? "," : "f", e->attrs.f[k]);
        for (int k = 0; k < e->attrs.ni && k < GJ_MAX_DIMS + 4; k++) {
            if ((rt >> k) & 1u)
                sb_put(&b, "%s*", k ? "," : "i");
            else
                sb_put(&b, "%s%lld", k ? "," : "i", (long long)e->attrs.i[k]);
        }
        sb_put(&b, " in");
        for (int i = 0; i < e->n_in; i++) {
            sb_put(&b, " ");
            sb_ref(&b, tp, e->in[i]);
            sb_put(&b, ":");
            sb_meta(&b, &e->in_meta[i]);
        }
        sb_put(&b, " out");
        for (int k = 0; k < e->n_out; k++) {
            sb_put(&b, " ");
            sb_meta(&b, &e->out_meta[k]);
            sb_put(&b, "/%d", e->out_stored[k]);
        }
        sb_put(&b, " sv");
        for (int s = 0; s < e->n_saved; s++)
            sb_put(&b, " %c%d", "ioS"[e->saved[s].kind], e->saved[s].index);
        sb_put(&b, " %s keep%d grad%d\n", policy_name(e->policy), e->keep, e->grad);
    }
    sb_put(&b, " OUT");
    for (int k = 0; k < tp->n_out; k++) {
        sb_put(&b, " ");
        sb_ref(&b, tp, tp->out[k]);
    }
    sb_put(&b, "\n STORED");
    for (int k = 0; k < tp->n_stored; k++) {
        sb_put(&b, " ");
        sb_meta(&b, &tp->stored_meta[k]);
    }
    sb_put(&b, "\n");
    return b.len;
}

int64_t gj_ag_ckpt_serialize(const gj_ag_node *n, uint32_t (*runtime_attrs)(const gj_ag_opdef *),
                             char *buf, size_t cap) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return -1;
    const ckpt_tape *tp = registry_find(n);
    if (!tp) return -1;
    return tape_serialize(tp, runtime_attrs, buf, cap);
}

/* 128-bit hash (two independent 64-bit lanes) of bytes. */
static void hash128(const char *p, size_t n, uint64_t out[2]) {
    uint64_t a = 0xcbf29ce484222325ull, b = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    for (size_t i = 0; i < n; i++) {
        a = (a ^ (unsigned char)p[i]) * 0x100000001b3ull;
        b = (b + (unsigned char)p[i] + 1) * 0xff51afd7ed558ccdull;
        b ^= b >> 29;
    }
    out[0] = a ^ (a >> 31);
    out[1] = b ^ (b >> 33);
}

/* ---------------------------------------------------------------- info */

int gj_ag_ckpt_info_of(const gj_ag_node *n, gj_ag_ckpt_info *out) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return -1;
    const ckpt_tape *tp = registry_find(n);
    if (!tp) return -1;
    memset(out, 0, sizeof *out);
    out->n_entries = tp->n_entries;
    for (int j = 0; j < tp->n_entries; j++) out->n_saved_entries += tp->e[j].keep;
    out->n_stored = tp->n_stored;
    out->n_node_saved = tp->n_node_saved;
    out->n_in_node = tp->n_node_in;
    for (int k = 0; k < tp->n_stored; k++) {
        const gj_rt_meta *m = &tp->stored_meta[k];
        out->stored_bytes += gj_rt_numel(m->ndim, m->shape) * (int64_t)gj_rt_dtype_size(m->dtype);
    }
    return 0;
}

gj_tensor *gj_ag_ckpt_stored(const gj_ag_node *n, int k, int64_t *version) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return NULL;
    const ckpt_tape *tp = registry_find(n);
    if (!tp || k < 0 || k >= tp->n_stored) return NULL;
    if (k < tp->n_node_saved) {
        if (k >= n->n_saved) return NULL;
        if (version) *version = n->saved[k].version;
        return n->saved[k].t;
    }
    if (version) *version = tp->stored_version[k];
    return tp->stored[k];
}

int gj_ag_ckpt_stored_origin(const gj_ag_node *n, int k, int *kind, int *op, int *index) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return -1;
    const ckpt_tape *tp = registry_find(n);
    if (!tp || k < 0 || k >= tp->n_stored) return -1;
    for (int j = 0; j < tp->n_entries; j++) {
        const ckpt_entry *e = &tp->e[j];
        for (int m = 0; m < e->n_out; m++)
            if (e->out_stored[m] == k) {
                *kind = GJ_AG_STORED_OUTPUT;
                *op = j;
                *index = m;
                return 0;
            }
        for (int s = 0; s < e->n_saved && e->keep; s++)
            if (e->saved[s].kind == SV_INTERNAL && e->saved[s].index == k) {
                *kind = GJ_AG_STORED_INTERNAL;
                *op = j;
                *index = s;
                return 0;
            }
        for (int i = 0; i < e->n_in; i++)
            if (e->in[i].entry < 0 && tp->src[e->in[i].index].stored == k) {
                *kind = GJ_AG_STORED_SOURCE;
                *op = j;
                *index = i;
                return 0;
            }
    }
    return -1;
}

int gj_ag_ckpt_n_ops(const gj_ag_node *n) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return -1;
    const ckpt_tape *tp = registry_find(n);
    return tp ? tp->n_entries : -1;
}

const gj_ag_opdef *gj_ag_ckpt_op(const gj_ag_node *n, int j, const gj_ag_attrs **attrs) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return NULL;
    const ckpt_tape *tp = registry_find(n);
    if (!tp || j < 0 || j >= tp->n_entries) return NULL;
    if (attrs) *attrs = &tp->e[j].attrs;
    return tp->e[j].op;
}

int gj_ag_ckpt_op_metas(const gj_ag_node *n, int j, int *n_in, gj_rt_meta *in_meta,
                        gj_rt_meta *out_meta) {
    if (!n || n->kind != GJ_AG_OP || n->op != &gj_ag_op_checkpoint) return -1;
    const ckpt_tape *tp = registry_find(n);
    if (!tp || j < 0 || j >= tp->n_entries) return -1;
    const ckpt_entry *e = &tp->e[j];
    *n_in = e->n_in;
    memcpy(in_meta, e->in_meta, (size_t)e->n_in * sizeof *in_meta);
    memcpy(out_meta, e->out_meta, (size_t)e->n_out * sizeof *out_meta);
    return e->n_out;
}

/* ------------------------------------------------------ closing a region */

/* The checkpoint op's forward hands back the region's outputs and saves
 * the first stored tensors; it only runs inside gj_ag_ckpt_end. */
typedef struct ckpt_pending {
    int n_out;
    gj_tensor *out[GJ_AG_MAX_OUT];
    int n_save;
    gj_tensor *save[GJ_AG_MAX_SAVED];
} ckpt_pending;

static _Thread_local ckpt_pending *g_pending;

static int ckpt_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    ckpt_pending *p = g_pending;
    if (!p || b->records) {
        gj_rt_set_error("checkpoint: this op is made by gj_checkpoint only");
        return -1;
    }
    for (int k = 0; k < p->n_out; k++) outs[k] = gj_ag_tensor_val(p->out[k]);
    for (int s = 0; s < p->n_save; s++) gj_ag_save(ctx, gj_ag_tensor_val(p->save[s]));
    return p->n_out;
}

/* Appends a stored tensor (an alias of t, version v). Index or -1. */
static int store(ckpt_tape *tp, gj_tensor *t, int64_t v, int *cap) {
    if (tp->n_stored == *cap) {
        int nc = *cap ? *cap * 2 : 16;
        gj_tensor **s = gj_rt_realloc(tp->stored, (size_t)nc * sizeof *s);
        if (!s) return -1;
        tp->stored = s;
        int64_t *sv = gj_rt_realloc(tp->stored_version, (size_t)nc * sizeof *sv);
        if (!sv) return -1;
        tp->stored_version = sv;
        gj_rt_meta *sm = gj_rt_realloc(tp->stored_meta, (size_t)nc * sizeof *sm);
        if (!sm) return -1;
        tp->stored_meta = sm;
        *cap = nc;
    }
    gj_tensor *al = gj_rt_tensor_alias(t);
    if (!al) return -1;
    tp->stored[tp->n_stored] = al;
    tp->stored_version[tp->n_stored] = v;
    gj_rt_meta_of(t, &tp->stored_meta[tp->n_stored]);
    return tp->n_stored++;
}

/* Checks that nothing the tape saw was modified in place inside the region
 * (the replay would not see such a write). 0 or -1 (error set). */
static int check_versions(const gj_ag_ckpt_region *r) {
    const ckpt_tape *tp = r->tape;
    for (int h = 0; h < r->n_held; h++) {
        const ckpt_held *hd = &r->held[h];
        if (atomic_load(&hd->t->storage->version) != hd->version) {
            gj_rt_set_error("gj_checkpoint: a tensor computed by op %s (position %d) inside the "
                            "region was modified in place before the region ended; in-place "
                            "ops are not recorded, so recomputation would differ",
                            tp->e[hd->entry].op->name, hd->entry);
            return -1;
        }
    }
    for (int s = 0; s < tp->n_src; s++) {
        if (atomic_load(&tp->src[s].t->storage->version) != tp->src[s].version) {
            char sh[96];
            gj_rt_fmt_shape(sh, sizeof sh, tp->src[s].meta.ndim, tp->src[s].meta.shape);
            gj_rt_set_error("gj_checkpoint: %s %d (%s %s) was modified in place inside the "
                            "region after an op read it",
                            s < tp->n_in ? "input" : "outside tensor",
                            s < tp->n_in ? s : s - tp->n_in,
                            gj_rt_dtype_name(tp->src[s].meta.dtype), sh);
            return -1;
        }
    }
    return 0;
}

/* Decides the stored set and the node inputs of a finished tape. */
static int tape_finish(gj_ag_ckpt_region *r, gj_tensor **node_in) {
    ckpt_tape *tp = r->tape;
    int cap = 0;
    tp->out_base = gj_rt_calloc((size_t)tp->n_entries + 1, sizeof *tp->out_base);
    if (!tp->out_base) return -1;
    tp->n_slots = tp->n_src;
    for (int j = 0; j < tp->n_entries; j++) {
        tp->out_base[j] = tp->n_slots;
        tp->n_slots += tp->e[j].n_out;
    }
    for (int s = 0; s < tp->n_src; s++) {
        ckpt_src *c = &tp->src[s];
        if (c->read && (c->stored = store(tp, c->t, c->version, &cap)) < 0) return -1;
    }
    for (int j = 0; j < tp->n_entries; j++) {
        ckpt_entry *e = &tp->e[j];
        if (!e->keep) continue;
        for (int h = 0; h < r->n_held; h++) {
            const ckpt_held *hd = &r->held[h];
            if (hd->entry != j) continue;
            int k = store(tp, hd->t, hd->version, &cap);
            if (k < 0) return -1;
            if (hd->index >= 0)
                e->out_stored[hd->index] = k;
            else
                e->saved[-1 - hd->index].index = k;
        }
    }
    tp->n_node_saved = tp->n_stored < GJ_AG_MAX_SAVED ? tp->n_stored : GJ_AG_MAX_SAVED;
    int n = 0;
    for (int s = 0; s < tp->n_src; s++) {
        ckpt_src *c = &tp->src[s];
        if (s >= tp->n_in && !(c->requires_grad && c->read)) continue;
        if (n == GJ_AG_MAX_IN) {
            gj_rt_set_error("gj_checkpoint: the region has more than %d inputs (its %d inputs "
                            "plus the tensors requiring grad it reads from outside, such as "
                            "parameters); split it into smaller regions",
                            GJ_AG_MAX_IN, tp->n_in);
            return -1;
        }
        c->node_in = n;
        node_in[n++] = c->t;
    }
    tp->n_node_in = n;
    return 0;
}

int gj_ag_ckpt_end(gj_ag_ckpt_region *r, int n_out, gj_tensor *const *fn_out, gj_tensor **outs) {
    ckpt_tape *tp = r->tape;
    gj_tensor *node_in[GJ_AG_MAX_IN];
    gj_tensor *dup[GJ_AG_MAX_OUT] = {0};
    ckpt_pending pend = {0};
    int rc = -1;
    if (g_region == r) g_region = NULL; /* the node below is not part of the tape */
    if (n_out < 1 || n_out > GJ_AG_MAX_OUT) {
        gj_rt_set_error("gj_checkpoint: a region has 1 to %d outputs, got %d", GJ_AG_MAX_OUT,
                        n_out);
        region_free(r);
        return -1;
    }
    for (int k = 0; k < n_out; k++) outs[k] = NULL;
    for (int k = 0; k < n_out; k++) {
        ckpt_ref ref = find_ref(r, fn_out[k]);
        if (ref.entry == -2) {
            int s = add_const(tp, fn_out[k]);
            if (s < 0) goto done;
            ref = (ckpt_ref){-1, s};
        }
        tp->out[k] = ref;
    }
    tp->n_out = n_out;
    if (check_versions(r) != 0 || tape_finish(r, node_in) != 0) goto done;
    {
        char small[4096];
        int64_t len = tape_serialize(tp, NULL, small, sizeof small);
        char *text = small;
        if (len >= (int64_t)sizeof small) {
            text = gj_rt_malloc((size_t)len + 1);
            if (!text) goto done;
            tape_serialize(tp, NULL, text, (size_t)len + 1);
        }
        uint64_t h[2];
        hash128(text, (size_t)len, h);
        if (text != small) gj_rt_free(text);
        gj_ag_attrs at = {0};
        memcpy(&at.i[0], &h[0], sizeof h[0]);
        memcpy(&at.i[1], &h[1], sizeof h[1]);
        at.ni = 2;
        pend.n_out = n_out;
        for (int k = 0; k < n_out; k++) {
            /* An output computed in the region becomes the node's output
             * itself. A tensor from outside (an input passed through) or
             * one returned twice gets a header of its own, so no outside
             * tensor receives a grad_fn. */
            bool own = tp->out[k].entry >= 0;
            for (int q = 0; q < k; q++) own &= fn_out[q] != fn_out[k];
            pend.out[k] = fn_out[k];
            if (!own) {
                if (!(dup[k] = gj_rt_tensor_alias(fn_out[k]))) goto done;
                pend.out[k] = dup[k];
            }
        }
        pend.n_save = tp->n_node_saved;
        for (int s = 0; s < pend.n_save; s++) pend.save[s] = tp->stored[s];
        g_pending = &pend;
        int n = gj_ag_apply(&gj_ag_op_checkpoint, &at, tp->n_node_in, node_in, outs);
        g_pending = NULL;
        if (n < 0) { /* apply released what it made; outs[] may still point at it */
            for (int k = 0; k < n_out; k++) outs[k] = NULL;
            goto done;
        }
    }
    gj_ag_node *node = NULL;
    for (int k = 0; k < n_out && !node; k++) {
        gj_ag_tensor_meta *m = outs[k]->ag;
        if (m && m->node && m->node->op == &gj_ag_op_checkpoint) node = m->node;
    }
    if (node) {
        /* the node holds the first stored tensors itself */
        for (int s = 0; s < tp->n_node_saved; s++) {
            gj_rt_tensor_release(tp->stored[s]);
            tp->stored[s] = NULL;
        }
        for (int s = 0; s < tp->n_src; s++) {
            gj_rt_tensor_release(tp->src[s].t);
            tp->src[s].t = NULL;
        }
        registry_add(tp, node);
        r->tape = NULL; /* owned by the node now */
    }
    rc = 0;
done:
    if (rc != 0)
        for (int k = 0; k < n_out; k++) {
            if (outs[k]) gj_rt_tensor_release(outs[k]);
            outs[k] = NULL;
        }
    for (int k = 0; k < GJ_AG_MAX_OUT; k++)
        if (dup[k]) gj_rt_tensor_release(dup[k]);
    region_free(r);
    return rc;
}

/* ------------------------------------------------------------- backward */

/* Everything one backward of a tape uses, freed in one place. */
typedef struct replay {
    gj_ag_builder *b;
    const ckpt_tape *tp;
    bool *want, *has_g, *run_bwd, *need_run;
    gj_val **val;     /* per slot: value (kept if own[slot]) */
    bool *own;
    gj_val **acc;     /* per slot: summed gradient (kept) */
    gj_val **stored;  /* per stored tensor: a constant of b (borrowed) */
    gj_val **esaved;  /* [n_entries * GJ_AG_MAX_SAVED]: kept */
    int *n_esaved;
} replay;

static int slot_of(const ckpt_tape *tp, ckpt_ref r) {
    return r.entry < 0 ? r.index : tp->out_base[r.entry] + r.index;
}

static void replay_free(replay *R) {
    const ckpt_tape *tp = R->tp;
    gj_ag_builder *b = R->b;
    for (int s = 0; s < tp->n_slots && R->own; s++) {
        if (R->own[s]) b->drop(b, R->val[s]);
        if (R->acc[s]) b->drop(b, R->acc[s]);
    }
    for (int j = 0; j < tp->n_entries && R->esaved && R->n_esaved; j++)
        for (int s = 0; s < R->n_esaved[j]; s++) b->drop(b, R->esaved[j * GJ_AG_MAX_SAVED + s]);
    gj_rt_free(R->want);
    gj_rt_free(R->val);
    gj_rt_free(R->esaved);
    gj_rt_free(R->n_esaved);
    gj_rt_free(R->stored);
}

static int replay_alloc(replay *R) {
    const ckpt_tape *tp = R->tp;
    size_t ns = (size_t)tp->n_slots + 1, ne = (size_t)tp->n_entries + 1;
    /* bools: want, has_g, own per slot; run_bwd, need_run per entry */
    R->want = gj_rt_calloc(3 * ns + 2 * ne, sizeof(bool));
    R->val = gj_rt_calloc(2 * ns, sizeof(gj_val *));
    R->esaved = gj_rt_calloc(ne * GJ_AG_MAX_SAVED, sizeof(gj_val *));
    R->n_esaved = gj_rt_calloc(ne, sizeof(int));
    R->stored = gj_rt_calloc((size_t)tp->n_stored + 1, sizeof(gj_val *));
    if (!R->want || !R->val || !R->esaved || !R->n_esaved || !R->stored) return -1;
    R->has_g = R->want + ns;
    R->own = R->has_g + ns;
    R->run_bwd = R->own + ns;
    R->need_run = R->run_bwd + ne;
    R->acc = R->val + ns;
    return 0;
}

/* acc[slot] += g (g borrowed; the sum is kept). */
static int acc_add(replay *R, int slot, gj_val *g) {
    gj_ag_builder *b = R->b;
    if (!R->acc[slot]) {
        b->keep(b, g);
        R->acc[slot] = g;
        return 0;
    }
    gj_val *s = gj_ag_binary(b, GJ_P_ADD, R->acc[slot], g);
    if (!s) return -1;
    b->keep(b, s);
    b->drop(b, R->acc[slot]);
    R->acc[slot] = s;
    return 0;
}

/* Marks that the backward needs the value of slot: a dropped output makes
 * its entry run again (stored values are constants). */
static void need_value(replay *R, int slot) {
    const ckpt_tape *tp = R->tp;
    if (slot < tp->n_src) return;
    for (int j = tp->n_entries - 1; j >= 0; j--) {
        if (slot < tp->out_base[j]) continue;
        if (!tp->e[j].keep) R->need_run[j] = true;
        return;
    }
}

/* Decides which entries run their backward and which run again. */
static void plan_replay(replay *R, gj_ag_bctx *ctx, gj_val *const *gout) {
    const ckpt_tape *tp = R->tp;
    for (int s = 0; s < tp->n_src; s++)
        R->want[s] = tp->src[s].node_in >= 0 && gj_ag_needs_grad(ctx, tp->src[s].node_in);
    for (int j = 0; j < tp->n_entries; j++) {
        const ckpt_entry *e = &tp->e[j];
        bool w = false;
        for (int i = 0; i < e->n_in; i++) w |= R->want[slot_of(tp, e->in[i])];
        for (int k = 0; k < e->n_out; k++)
            R->want[tp->out_base[j] + k] = w && e->grad && gj_rt_dtype_is_float(e->out_meta[k].dtype);
    }
    for (int k = 0; k < tp->n_out; k++)
        if (gout[k]) R->has_g[slot_of(tp, tp->out[k])] = true;
    for (int j = tp->n_entries - 1; j >= 0; j--) {
        const ckpt_entry *e = &tp->e[j];
        bool g = false, w = false;
        for (int k = 0; k < e->n_out; k++) g |= R->has_g[tp->out_base[j] + k];
        for (int i = 0; i < e->n_in; i++) w |= R->want[slot_of(tp, e->in[i])];
        R->run_bwd[j] = e->grad && g && w;
        if (!R->run_bwd[j]) continue;
        for (int i = 0; i < e->n_in; i++) {
            int s = slot_of(tp, e->in[i]);
            if (R->want[s]) R->has_g[s] = true;
        }
    }
    for (int j = tp->n_entries - 1; j >= 0; j--) {
        const ckpt_entry *e = &tp->e[j];
        if (R->run_bwd[j]) {
            /* saved inputs are read from their slots; a dropped entry whose
             * formula saved its output or an internal value runs again */
            for (int s = 0; s < e->n_saved; s++) {
                if (e->saved[s].kind == SV_INPUT)
                    need_value(R, slot_of(tp, e->in[e->saved[s].index]));
                else if (!e->keep)
                    R->need_run[j] = true;
            }
        }
        if (R->need_run[j])
            for (int i = 0; i < e->n_in; i++) need_value(R, slot_of(tp, e->in[i]));
    }
}

static bool meta_eq(const gj_rt_meta *a, const gj_rt_meta *b) {
    return a->dtype == b->dtype && a->ndim == b->ndim &&
           memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) == 0;
}

/* Stored tensor k as a value of the builder (a constant). */
static gj_val *stored_val(replay *R, gj_ag_bctx *ctx, int k) {
    const ckpt_tape *tp = R->tp;
    if (R->stored[k]) return R->stored[k];
    gj_val *v;
    if (k < tp->n_node_saved) {
        v = gj_ag_saved(ctx, k);
    } else {
        gj_tensor *t = tp->stored[k];
        if (atomic_load(&t->storage->version) != tp->stored_version[k]) {
            gj_rt_set_error("backward: a tensor saved by a checkpoint region (stored #%d) was "
                            "modified by an in-place operation: it is at version %lld, expected "
                            "version %lld",
                            k, (long long)atomic_load(&t->storage->version),
                            (long long)tp->stored_version[k]);
            return NULL;
        }
        v = R->b->constant(R->b, t);
    }
    if (!v && !gj_last_error()[0]) gj_rt_set_error("checkpoint: stored tensor #%d is gone", k);
    R->stored[k] = v;
    return v;
}

/* Replays the entries that must run again, in order, and resolves the
 * saved values of every entry whose backward runs. */
static int run_replay(replay *R, gj_ag_bctx *ctx) {
    const ckpt_tape *tp = R->tp;
    gj_ag_builder *b = R->b;
    for (int s = 0; s < tp->n_src; s++)
        if (tp->src[s].stored >= 0 && !(R->val[s] = stored_val(R, ctx, tp->src[s].stored)))
            return -1;
    for (int j = 0; j < tp->n_entries; j++) {
        const ckpt_entry *e = &tp->e[j];
        if (!e->keep) continue;
        for (int k = 0; k < e->n_out; k++)
            if (e->out_stored[k] >= 0 &&
                !(R->val[tp->out_base[j] + k] = stored_val(R, ctx, e->out_stored[k])))
                return -1;
    }
    for (int j = 0; j < tp->n_entries; j++) {
        const ckpt_entry *e = &tp->e[j];
        gj_val **es = &R->esaved[j * GJ_AG_MAX_SAVED];
        if (R->need_run[j]) {
            g_recomputed++;
            gj_val *vin[GJ_AG_MAX_IN], *vout[GJ_AG_MAX_OUT] = {0}, *sv[GJ_AG_MAX_SAVED] = {0};
            int ns = 0;
            for (int i = 0; i < e->n_in; i++) {
                vin[i] = R->val[slot_of(tp, e->in[i])];
                if (!vin[i]) {
                    gj_rt_set_error("checkpoint: internal: op %s (position %d) replayed before "
                                    "its input %d",
                                    e->op->name, j, i);
                    return -1;
                }
            }
            int n = gj_ag_forward_vals(b, e->op, &e->attrs, e->n_in, vin, vout, &ns,
                                       R->run_bwd[j] ? sv : NULL);
            if (n < 0) return -1;
            if (n != e->n_out) {
                gj_rt_set_error("checkpoint: recomputing op %s (position %d) gave %d outputs, "
                                "the first run %d",
                                e->op->name, j, n, e->n_out);
                return -1;
            }
            for (int k = 0; k < n; k++) {
                gj_rt_meta m;
                b->meta(b, vout[k], &m);
                if (!meta_eq(&m, &e->out_meta[k])) {
                    gj_rt_set_error("checkpoint: recomputing op %s (position %d) gave output %d "
                                    "of another shape or dtype than the first run",
                                    e->op->name, j, k);
                    return -1;
                }
                int s = tp->out_base[j] + k;
                b->keep(b, vout[k]);
                R->val[s] = vout[k];
                R->own[s] = true;
            }
            if (R->run_bwd[j]) {
                for (int s = 0; s < ns; s++) {
                    b->keep(b, sv[s]);
                    es[s] = sv[s];
                }
                R->n_esaved[j] = ns;
            }
        } else if (R->run_bwd[j]) { /* saved values by reference (slots, stored) */
            for (int s = 0; s < e->n_saved; s++) {
                const ckpt_sref *sr = &e->saved[s];
                gj_val *v = sr->kind == SV_INPUT    ? R->val[slot_of(tp, e->in[sr->index])]
                            : sr->kind == SV_OUTPUT ? R->val[tp->out_base[j] + sr->index]
                                                    : stored_val(R, ctx, sr->index);
                if (!v) {
                    if (!gj_last_error()[0])
                        gj_rt_set_error("checkpoint: internal: saved value %d of op %s "
                                        "(position %d) is missing",
                                        s, e->op->name, j);
                    return -1;
                }
                b->keep(b, v);
                es[s] = v;
                R->n_esaved[j] = s + 1;
            }
        }
    }
    /* only the entries' saved values survive the replay */
    for (int s = 0; s < tp->n_slots; s++) {
        if (R->own[s]) b->drop(b, R->val[s]);
        R->own[s] = false;
        R->val[s] = NULL;
    }
    b->end_node(b);
    return 0;
}

/* The reverse sweep: each entry's backward formula, last entry first. */
static int run_sweep(replay *R, gj_val *const *gout) {
    const ckpt_tape *tp = R->tp;
    gj_ag_builder *b = R->b;
    for (int k = 0; k < tp->n_out; k++) {
        int s = slot_of(tp, tp->out[k]);
        if (gout[k] && R->has_g[s] && acc_add(R, s, gout[k]) != 0) return -1;
    }
    for (int j = tp->n_entries - 1; j >= 0; j--) {
        if (!R->run_bwd[j]) continue;
        const ckpt_entry *e = &tp->e[j];
        gj_val *go[GJ_AG_MAX_OUT] = {0}, *gi[GJ_AG_MAX_IN] = {0};
        bool needs[GJ_AG_MAX_IN] = {0};
        for (int k = 0; k < e->n_out; k++) go[k] = R->acc[tp->out_base[j] + k];
        for (int i = 0; i < e->n_in; i++) needs[i] = R->want[slot_of(tp, e->in[i])];
        if (gj_ag_backward_vals(b, e->op, &e->attrs, e->n_in, e->in_meta, e->n_out, e->out_meta,
                                R->n_esaved[j], &R->esaved[j * GJ_AG_MAX_SAVED], needs, go,
                                gi) != 0)
            return -1;
        for (int i = 0; i < e->n_in; i++) {
            if (!needs[i] || !gi[i]) continue;
            gj_rt_meta m;
            b->meta(b, gi[i], &m);
            if (!meta_eq(&m, &e->in_meta[i])) {
                gj_rt_set_error("backward: internal: op %s (checkpoint position %d) produced a "
                                "gradient of another shape or dtype for its input %d",
                                e->op->name, j, i);
                return -1;
            }
            if (acc_add(R, slot_of(tp, e->in[i]), gi[i]) != 0) return -1;
        }
        /* this entry is done: free its saved values and output gradients */
        for (int s = 0; s < R->n_esaved[j]; s++) b->drop(b, R->esaved[j * GJ_AG_MAX_SAVED + s]);
        R->n_esaved[j] = 0;
        for (int k = 0; k < e->n_out; k++) {
            int s = tp->out_base[j] + k;
            b->drop(b, R->acc[s]);
            R->acc[s] = NULL;
        }
        b->end_node(b);
    }
    return 0;
}

/* Backward of a region: replay what the policy dropped, then the tape's
 * formulas in reverse; gradients of the node's inputs in gin. The values
 * returned are temporaries of the current step, as any formula's. */
static int ckpt_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    const gj_ag_node *node = gj_ag_ctx_node(ctx);
    const ckpt_tape *tp = registry_find(node);
    if (!tp) {
        gj_rt_set_error("checkpoint: internal: the region's tape is missing");
        return -1;
    }
    replay R = {.b = b, .tp = tp};
    int rc = -1;
    if (replay_alloc(&R) != 0) goto done;
    plan_replay(&R, ctx, gout);
    if (run_replay(&R, ctx) != 0 || run_sweep(&R, gout) != 0) goto done;
    for (int s = 0; s < tp->n_src; s++) {
        int ni = tp->src[s].node_in;
        gj_val *g = R.acc[s];
        if (ni < 0 || !g || !R.want[s]) continue;
        if (!b->records) {
            /* a temporary of this step (the kept reference is dropped below) */
            gj_rt_meta m;
            b->meta(b, g, &m);
            g = gj_ag_reshape(b, g, m.ndim, m.shape);
            if (!g) goto done;
        }
        gin[ni] = g;
    }
    rc = 0;
done:
    replay_free(&R);
    return rc;
}

const gj_ag_opdef gj_ag_op_checkpoint = {"checkpoint", ckpt_fwd, ckpt_bwd};
