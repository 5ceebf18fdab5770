/* SPDX-License-Identifier: MIT */
/*
 * key.c - the structural key of a backward: a canonical walk of the autograd
 * graph from the roots, its text serialization and its 128-bit hash.
 *
 * Invariants:
 *   - Canonical indices are breadth-first discovery order from the roots'
 *     edges (roots in order, edges of a node in input order): a function of
 *     the graph's shape only, never of addresses, so two processes building
 *     the same model get the same key.
 *   - The serialization contains everything the captured computation
 *     depends on: per node its kind (opdef name), attributes (floats in
 *     exact hex), input and output metas, saved tensors' metas, edges as
 *     (canonical index, input_nr), the node's rank in creation order (the
 *     engine runs ready nodes newest first, which fixes the order gradients
 *     are summed in); per accumulate node the leaf's meta and its .grad's
 *     presence, meta and contiguity; per root its meta, edge and seed meta;
 *     the kinds and counts of hooks on every node output and leaf. A
 *     gj_grad's key (gj_jit_walk_build_grad) says so in a line of its own
 *     and lists its inputs by edge ("I<i> e<node>:<nr>", e-1 when
 *     unreachable); its accumulate lines hold no .grad ("grad*"): such a
 *     key never equals a gj_backward's.
 *   - Under GJ_CA_DYNAMIC_ALWAYS the key has a line "dynamic always": such
 *     a program (generic from its first compile) never answers for the
 *     default mode's specialised one, so both can be compared in one run.
 *   - Pointer maps (node -> index, saved tensor -> (node, slot)) are
 *     process-local helpers and never enter the key.
 *   - Run-time attributes (dropout's RNG seed and offset, new at every
 *     step) are written as '*': the compiled program reads them from the
 *     node at run time instead of baking them in. A checkpoint node's own
 *     attributes (a hash of its tape, seeds included) are run-time too:
 *     the key holds the tape's text instead, with its dropouts' seeds and
 *     offsets as '*', read from the tape at run time (lines "N<i>.").
 */
#include "jit/capture/capture.h"
#include "jit/jit.h"

#include "runtime/gj_math.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------- hashing */

static uint64_t ptr_hash(const void *p) { return gj_m_mix64((uint64_t)(uintptr_t)p); }

/* ---------------------------------------------------- runtime attrs */

uint32_t gj_jit_runtime_attrs(const gj_ag_opdef *op) {
    if (op == &gj_ag_op_dropout) return 0x3u; /* i[0] = seed bits, i[1] = offset */
    if (op == &gj_ag_op_sdpa) return 0x6u;    /* i[1] = seed bits, i[2] = offset */
    /* a region's i[0..1] hash its tape with the seeds and offsets of its
     * dropouts; the key holds the tape's own text instead (put_tape) */
    if (op == &gj_ag_op_checkpoint) return 0x3u;
    return 0u;
}

/* Whether attrs are those of a dropout with this seed and offset. */
static bool dropout_is(const gj_ag_attrs *a, uint64_t seed, uint64_t offset) {
    if (a->ni < 2) return false;
    uint64_t s;
    memcpy(&s, &a->i[0], sizeof s);
    return s == seed && (uint64_t)a->i[1] == offset;
}

int gj_jit_walk_find_dropout(const gj_jit_walk *w, uint64_t seed, uint64_t offset, int *tape) {
    *tape = -1;
    for (int i = 0; i < w->n; i++) {
        const gj_ag_node *n = w->nodes[i];
        if (n->kind != GJ_AG_OP) continue;
        if (n->op == &gj_ag_op_dropout && dropout_is(&n->attrs, seed, offset)) return i;
        int n_ops = n->op == &gj_ag_op_checkpoint ? gj_ag_ckpt_n_ops(n) : 0;
        for (int j = 0; j < n_ops; j++) {
            const gj_ag_attrs *at = NULL;
            if (gj_ag_ckpt_op(n, j, &at) == &gj_ag_op_dropout && at &&
                dropout_is(at, seed, offset)) {
                *tape = j;
                return i;
            }
        }
    }
    return -1;
}

int gj_jit_dropout_params(const gj_jit_walk *w, int node, int tape, uint64_t out[2]) {
    const gj_ag_node *n = (node >= 0 && node < w->n) ? w->nodes[node] : NULL;
    if (!n || n->kind != GJ_AG_OP) return -1;
    const gj_ag_attrs *at = NULL;
    const gj_ag_opdef *op = tape < 0 ? n->op : gj_ag_ckpt_op(n, tape, &at);
    if (tape < 0) at = &n->attrs;
    if (op != &gj_ag_op_dropout || !at || at->ni < 2) return -1;
    memcpy(&out[0], &at->i[0], sizeof out[0]);
    out[1] = (uint64_t)at->i[1];
    return 0;
}

/* --------------------------------------------------------- pointer maps */

int gj_jit_walk_find(const gj_jit_walk *w, const gj_ag_node *node) {
    if (!w->nslots || !node) return -1;
    uint64_t mask = (uint64_t)w->nslots - 1;
    for (uint64_t h = ptr_hash(node) & mask;; h = (h + 1) & mask) {
        int64_t s = w->slots[h];
        if (s == 0) return -1;
        if (w->nodes[s - 1] == node) return (int)(s - 1);
    }
}

static int slots_rehash(gj_jit_walk *w, int64_t nslots) {
    int64_t *slots = gj_rt_calloc((size_t)nslots, sizeof *slots);
    if (!slots) return -1;
    uint64_t mask = (uint64_t)nslots - 1;
    for (int i = 0; i < w->n; i++) {
        uint64_t h = ptr_hash(w->nodes[i]) & mask;
        while (slots[h]) h = (h + 1) & mask;
        slots[h] = i + 1;
    }
    gj_rt_free(w->slots);
    w->slots = slots;
    w->nslots = nslots;
    return 0;
}

/* Appends node (not yet present). Returns its index or -1 (OOM). */
static int walk_add(gj_jit_walk *w, gj_ag_node *node) {
    if (w->n == w->cap) {
        int cap = w->cap ? w->cap * 2 : 32;
        gj_ag_node **nn = gj_rt_realloc(w->nodes, (size_t)cap * sizeof *nn);
        if (!nn) return -1;
        w->nodes = nn;
        w->cap = cap;
    }
    w->nodes[w->n++] = node;
    if ((int64_t)w->n * 2 > w->nslots) {
        if (slots_rehash(w, w->nslots ? w->nslots * 2 : 64) != 0) {
            w->n--;
            return -1;
        }
    } else {
        uint64_t mask = (uint64_t)w->nslots - 1;
        uint64_t h = ptr_hash(node) & mask;
        while (w->slots[h]) h = (h + 1) & mask;
        w->slots[h] = w->n;
    }
    return w->n - 1;
}

int gj_jit_walk_saved_origin(const gj_jit_walk *w, const gj_tensor *t, int *node, int *slot) {
    if (!w->nsaved_slots || !t) return -1;
    uint64_t mask = (uint64_t)w->nsaved_slots - 1;
    for (uint64_t h = ptr_hash(t) & mask;; h = (h + 1) & mask) {
        const struct gj_jit_saved_slot *s = &w->saved[h];
        if (!s->t) return -1;
        if (s->t == t) {
            if (s->node < 0) return -1;
            *node = s->node;
            *slot = s->slot;
            return 0;
        }
    }
}

/* Builds the saved-tensor map of every needed op node. 0 or -1 (OOM). */
static int build_saved_map(gj_jit_walk *w) {
    int64_t count = 0;
    for (int i = 0; i < w->n; i++)
        if (w->nodes[i]->kind == GJ_AG_OP) count += w->nodes[i]->n_saved;
    int64_t ns = 16;
    while (ns < count * 2 + 2) ns *= 2;
    w->saved = gj_rt_calloc((size_t)ns, sizeof *w->saved);
    if (!w->saved) return -1;
    w->nsaved_slots = ns;
    uint64_t mask = (uint64_t)ns - 1;
    for (int i = 0; i < w->n; i++) {
        const gj_ag_node *nd = w->nodes[i];
        if (nd->kind != GJ_AG_OP) continue;
        for (int k = 0; k < nd->n_saved; k++) {
            const gj_tensor *t = nd->saved[k].t;
            if (!t) continue;
            uint64_t h = ptr_hash(t) & mask;
            while (w->saved[h].t && w->saved[h].t != t) h = (h + 1) & mask;
            if (w->saved[h].t == t) {
                w->saved[h].node = -1; /* ambiguous */
                continue;
            }
            w->saved[h].t = t;
            w->saved[h].node = i;
            w->saved[h].slot = k;
        }
    }
    return 0;
}

/* ------------------------------------------------------- serialization */

/* Makes room for n more bytes and a NUL in w->key. 0 or -1 (out of memory). */
static int key_room(gj_jit_walk *w, size_t n) {
    if (w->key && w->key_len + n < w->key_cap) return 0;
    size_t cap = w->key_cap ? w->key_cap * 2 : 4096;
    while (cap < w->key_len + n + 1) cap *= 2;
    char *k = gj_rt_realloc(w->key, cap);
    if (!k) return -1;
    w->key = k;
    w->key_cap = cap;
    return 0;
}

/* Whether fmt uses only the conversions key_put_fast formats itself. */
static bool key_fmt_simple(const char *fmt) {
    for (const char *f = fmt; *f; f++) {
        if (*f != '%') continue;
        f++;
        if (*f == 'd' || *f == 's' || *f == 'c' || *f == '%') continue;
        if (f[0] == 'l' && f[1] == 'l' && f[2] == 'd') {
            f += 2;
            continue;
        }
        return false;
    }
    return true;
}

/* key_put for formats of literal text, %d, %lld, %s, %c and %% only: the
 * same bytes as vsnprintf without its per-call parsing and locale work
 * (the key is built on every compiled backward, so this is on the hot
 * path). 0 or -1 (out of memory). */
static int key_put_fast(gj_jit_walk *w, const char *fmt, va_list ap) {
    for (const char *f = fmt; *f;) {
        const char *lit = f;
        while (*f && *f != '%') f++;
        if (f > lit) {
            if (key_room(w, (size_t)(f - lit)) != 0) return -1;
            memcpy(w->key + w->key_len, lit, (size_t)(f - lit));
            w->key_len += (size_t)(f - lit);
        }
        if (!*f) break;
        f++; /* past '%' */
        char num[24];
        const char *str = num;
        size_t n = 0;
        if (*f == 's') {
            str = va_arg(ap, const char *);
            if (!str) str = "(null)";
            n = strlen(str);
            f++;
        } else if (*f == 'c') {
            num[0] = (char)va_arg(ap, int);
            n = 1;
            f++;
        } else if (*f == '%') {
            num[0] = '%';
            n = 1;
            f++;
        } else {
            long long v;
            if (*f == 'd') {
                v = va_arg(ap, int);
                f++;
            } else { /* "lld" (key_fmt_simple) */
                v = va_arg(ap, long long);
                f += 3;
            }
            unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
            char rev[24];
            int r = 0;
            do {
                rev[r++] = (char)('0' + u % 10);
                u /= 10;
            } while (u);
            if (v < 0) num[n++] = '-';
            while (r > 0) num[n++] = rev[--r];
        }
        if (key_room(w, n) != 0) return -1;
        memcpy(w->key + w->key_len, str, n);
        w->key_len += n;
    }
    if (key_room(w, 0) != 0) return -1;
    w->key[w->key_len] = '\0';
    return 0;
}

static int key_put(gj_jit_walk *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int key_put(gj_jit_walk *w, const char *fmt, ...) {
    if (key_fmt_simple(fmt)) {
        va_list ap;
        va_start(ap, fmt);
        int rc = key_put_fast(w, fmt, ap);
        va_end(ap);
        return rc;
    }
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = w->key_cap - w->key_len;
        int n = vsnprintf(w->key ? w->key + w->key_len : NULL, w->key ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0) return -1;
        if (w->key && (size_t)n < room) {
            w->key_len += (size_t)n;
            return 0;
        }
        if (key_room(w, (size_t)n) != 0) return -1;
    }
}

/* " hooks:<kinds>" for the live hooks of output k of node n (T: tensor
 * hook, P: post-accumulate), nothing if none; counts them in w->n_hooks.
 * Kinds and counts only, never the functions. */
static int put_hooks(gj_jit_walk *w, const gj_ag_node *n, int k) {
    const gj_ag_hook *h[16];
    int nh = gj_ag_node_hooks(n, k, h, 16);
    if (nh <= 0) return 0;
    w->n_hooks += nh;
    if (key_put(w, " hooks%d:", nh) != 0) return -1;
    for (int q = 0; q < nh && q < 16; q++)
        if (key_put(w, "%c", h[q]->kind == GJ_AG_HOOK_POST_ACCUMULATE ? 'P' : 'T') != 0) return -1;
    return 0;
}

static int put_meta(gj_jit_walk *w, const gj_rt_meta *m) {
    if (key_put(w, "%d[", (int)m->dtype) != 0) return -1;
    for (int k = 0; k < m->ndim; k++)
        if (key_put(w, k ? ",%lld" : "%lld", (long long)m->shape[k]) != 0) return -1;
    return key_put(w, "]");
}

/* Meta, then "c" (contiguous) or "s(<strides>)": a compiled program reads
 * saved tensors in place, so their layout is part of the key. */
static int put_tensor(gj_jit_walk *w, const gj_tensor *t) {
    gj_rt_meta m;
    gj_rt_meta_of(t, &m);
    if (put_meta(w, &m) != 0) return -1;
    int64_t st[GJ_MAX_DIMS];
    gj_jit_input_strides(t, st);
    if (gj_jit_strides_contiguous(&m, st)) return key_put(w, "c");
    if (key_put(w, "s(") != 0) return -1;
    for (int k = 0; k < m.ndim; k++)
        if (key_put(w, k ? ",%lld" : "%lld", (long long)st[k]) != 0) return -1;
    return key_put(w, ")");
}

/* The call-site hash: a running 128-bit hash of what the key holds minus
 * shapes and attribute values (see capture.h). */
typedef struct site_hash {
    uint64_t a, b;
} site_hash;

static void site_u64(site_hash *h, uint64_t v) {
    h->a = gj_m_mix64(h->a ^ v) + 0x9e3779b97f4a7c15ull;
    h->b = gj_m_mix64(h->b + v * 0xff51afd7ed558ccdull) ^ (h->b >> 17);
}

static void site_str(site_hash *h, const char *s) {
    uint64_t v = 0xcbf29ce484222325ull;
    for (; s && *s; s++) v = (v ^ (unsigned char)*s) * 0x100000001b3ull;
    site_u64(h, v);
}

static void site_meta(site_hash *h, const gj_rt_meta *m) {
    site_u64(h, ((uint64_t)m->dtype << 8) | (uint64_t)m->ndim);
}

/* The tape of checkpoint node #i, one key line per tape line, each
 * "N<i>." and the line: its ops, attributes (dropout's seed and offset as
 * '*': the program reads them from the tape at run time), slots, metas and
 * policy decisions. Adds the tape's op names to the call site. 0 or -1. */
static int put_tape(gj_jit_walk *w, site_hash *sh, int i, const gj_ag_node *n) {
    char small[2048];
    int64_t len = gj_ag_ckpt_serialize(n, gj_jit_runtime_attrs, small, sizeof small);
    if (len < 0) return key_put(w, "N%d.tape-\n", i);
    char *text = small;
    if (len >= (int64_t)sizeof small) {
        text = gj_rt_malloc((size_t)len + 1);
        if (!text) return -1;
        gj_ag_ckpt_serialize(n, gj_jit_runtime_attrs, text, (size_t)len + 1);
    }
    int rc = 0;
    for (const char *l = text; *l && rc == 0;) {
        size_t ll = strcspn(l, "\n");
        rc = key_put(w, "N%d.%s%.*s\n", i, l[0] == ' ' ? "" : " ", (int)ll, l);
        l += ll + (l[ll] == '\n');
    }
    for (int j = 0, n_ops = gj_ag_ckpt_n_ops(n); j < n_ops; j++)
        site_str(sh, gj_ag_ckpt_op(n, j, NULL)->name);
    if (text != small) gj_rt_free(text);
    return rc;
}

typedef struct seq_rank {
    uint64_t seq;
    int idx;
} seq_rank;

static int cmp_seq(const void *a, const void *b) {
    const seq_rank *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq ? 1 : 0;
}

/* One serialize, carried from part to part: the walk (its key text grows
 * by key_put), the roots and seeds, the call-site hash, and each node's
 * rank by sequence number (rank[i], owned by serialize). Each part returns
 * 0, or -1 (out of memory) with the key text left partial. */
typedef struct ser {
    gj_jit_walk *w;
    int n_roots;
    gj_tensor *const *roots, *const *seeds;
    const int *root_node, *root_nr;
    site_hash sh;
    int *rank;
} ser;

/* rank[i]: node i's position among the walk's nodes by sequence number. */
static int ser_ranks(ser *s) {
    gj_jit_walk *w = s->w;
    s->rank = gj_rt_malloc((size_t)(w->n + 1) * sizeof *s->rank);
    seq_rank *sr = gj_rt_malloc((size_t)(w->n + 1) * sizeof *sr);
    if (!s->rank || !sr) {
        gj_rt_free(sr);
        return -1;
    }
    for (int i = 0; i < w->n; i++) {
        sr[i].seq = w->nodes[i]->seq;
        sr[i].idx = i;
    }
    qsort(sr, (size_t)w->n, sizeof *sr, cmp_seq);
    for (int i = 0; i < w->n; i++) s->rank[sr[i].idx] = i;
    gj_rt_free(sr);
    return 0;
}

/* The key's first lines: its header, the dynamic mode when it makes a
 * program of its own, a gj_grad's inputs, and one line per root. */
static int ser_head(ser *s) {
    gj_jit_walk *w = s->w;
    site_hash *sh = &s->sh;
    site_u64(sh, ((uint64_t)s->n_roots << 32) | (uint64_t)w->n);
    if (key_put(w, "gradjit-key v1 roots=%d nodes=%d\n", s->n_roots, w->n) != 0) return -1;
    /* symbolic from the first compile: a program of its own (the same graph
     * under the default mode keeps its specialised program) */
    if (gj_jit_dynamic() == GJ_CA_DYNAMIC_ALWAYS && key_put(w, "dynamic always\n") != 0) return -1;
    if (w->grad_mode) { /* a gj_grad: its inputs, by edge (never a .grad) */
        site_u64(sh, 0x6772616400000000ull | (uint64_t)(uint32_t)w->n_req);
        if (key_put(w, "grad inputs=%d\n", w->n_req) != 0) return -1;
        for (int i = 0; i < w->n_req; i++) {
            site_u64(sh, ((uint64_t)(uint32_t)w->req_node[i] << 32) |
                             (uint64_t)(uint32_t)w->req_nr[i]);
            if (key_put(w, "I%d e%d:%d\n", i, w->req_node[i],
                        w->req_node[i] >= 0 ? w->req_nr[i] : 0) != 0)
                return -1;
        }
    }
    for (int r = 0; r < s->n_roots; r++) {
        gj_rt_meta m;
        gj_rt_meta_of(s->roots[r], &m);
        site_u64(sh, ((uint64_t)(uint32_t)s->root_node[r] << 32) |
                         (uint64_t)(uint32_t)s->root_nr[r]);
        site_meta(sh, &m);
        if (key_put(w, "R%d e%d:%d m", r, s->root_node[r], s->root_nr[r]) != 0) return -1;
        if (put_meta(w, &m) != 0 || key_put(w, " seed") != 0) return -1;
        if (s->seeds && s->seeds[r]) {
            if (put_tensor(w, s->seeds[r]) != 0) return -1;
        } else if (key_put(w, "-") != 0) {
            return -1;
        }
        if (key_put(w, "\n") != 0) return -1;
    }
    return 0;
}

/* The line of accumulate node i: its leaf, its .grad (under the leaf's
 * lock; '*' for a gj_grad, which neither reads nor writes it), hooks. */
static int ser_acc(ser *s, int i, const gj_ag_node *n) {
    gj_jit_walk *w = s->w;
    gj_tensor *leaf = n->leaf;
    gj_ag_tensor_meta *lm = leaf ? leaf->ag : NULL;
    site_u64(&s->sh, 0xacc0000000000000ull | (uint64_t)s->rank[i]);
    if (leaf) {
        gj_rt_meta lmeta;
        gj_rt_meta_of(leaf, &lmeta);
        site_meta(&s->sh, &lmeta);
    }
    if (key_put(w, "N%d acc r%d leaf", i, s->rank[i]) != 0) return -1;
    if (leaf && put_tensor(w, leaf) != 0) return -1;
    if (key_put(w, " grad") != 0) return -1;
    if (w->grad_mode) { /* a gj_grad neither reads nor writes .grad */
        if (key_put(w, "*") != 0) return -1;
    } else {
        /* another thread's backward may be replacing this .grad */
        if (leaf) gj_ag_leaf_lock(leaf);
        gj_tensor *lg = lm ? lm->grad : NULL;
        site_u64(&s->sh, lg ? 1u + (uint64_t)lg->dtype : 0u);
        int gr = lg ? put_tensor(w, lg) : key_put(w, "-");
        if (leaf) gj_ag_leaf_unlock(leaf);
        if (gr != 0) return -1;
    }
    if (put_hooks(w, n, 0) != 0 || key_put(w, "\n") != 0) return -1;
    return 0;
}

/* The line of op node i: op, rank, attributes (run-time ones as '*'),
 * edges and metas in and out with hooks, saved tensors, released; a
 * checkpoint's tape after it. */
static int ser_op(ser *s, int i, const gj_ag_node *n) {
    gj_jit_walk *w = s->w;
    site_hash *sh = &s->sh;
    site_str(sh, n->op ? n->op->name : "?");
    site_u64(sh, ((uint64_t)s->rank[i] << 16) | ((uint64_t)n->n_in << 8) | (uint64_t)n->n_out);
    for (int k = 0; k < n->n_in; k++) {
        int e = n->next[k].node ? gj_jit_walk_find(w, n->next[k].node) : -1;
        site_u64(sh, ((uint64_t)(uint32_t)e << 32) | (uint64_t)(uint32_t)n->next[k].input_nr);
        site_meta(sh, &n->in_meta[k]);
    }
    for (int k = 0; k < n->n_out; k++) site_meta(sh, &n->out_meta[k]);
    if (key_put(w, "N%d %s r%d a", i, n->op ? n->op->name : "?", s->rank[i]) != 0) return -1;
    uint32_t rt = gj_jit_runtime_attrs(n->op);
    for (int k = 0; k < n->attrs.nf && k < 4; k++)
        if (key_put(w, "%s%a", k ? "," : "f", n->attrs.f[k]) != 0) return -1;
    for (int k = 0; k < n->attrs.ni && k < GJ_MAX_DIMS + 4; k++) {
        if ((rt >> k) & 1u) {
            if (key_put(w, "%s*", k ? "," : "i") != 0) return -1;
        } else if (key_put(w, "%s%lld", k ? "," : "i", (long long)n->attrs.i[k]) != 0) {
            return -1;
        }
    }
    if (key_put(w, " in") != 0) return -1;
    for (int k = 0; k < n->n_in; k++) {
        int e = n->next[k].node ? gj_jit_walk_find(w, n->next[k].node) : -1;
        if (key_put(w, " e%d:%d:", e, e >= 0 ? n->next[k].input_nr : 0) != 0) return -1;
        if (put_meta(w, &n->in_meta[k]) != 0) return -1;
    }
    if (key_put(w, " out") != 0) return -1;
    for (int k = 0; k < n->n_out; k++) {
        if (key_put(w, " ") != 0 || put_meta(w, &n->out_meta[k]) != 0) return -1;
        if (put_hooks(w, n, k) != 0) return -1;
    }
    if (key_put(w, " saved%d", n->n_saved) != 0) return -1;
    for (int k = 0; k < n->n_saved; k++) {
        if (key_put(w, " ") != 0) return -1;
        if (n->saved[k].t) {
            if (put_tensor(w, n->saved[k].t) != 0) return -1;
        } else if (key_put(w, "-") != 0) {
            return -1;
        }
    }
    if (key_put(w, "%s\n", n->released ? " released" : "") != 0) return -1;
    if (n->op == &gj_ag_op_checkpoint && put_tape(w, sh, i, n) != 0) return -1;
    return 0;
}

/* The key text of walk w (key_put) and its call-site hash (w->site): the
 * head, then one line per node (a checkpoint's tape after its line).
 * 0, or -1 (out of memory; w->site not set). */
static int serialize(gj_jit_walk *w, int n_roots, gj_tensor *const *roots,
                     gj_tensor *const *seeds, const int *root_node, const int *root_nr) {
    ser s = {w, n_roots, roots, seeds, root_node, root_nr,
             {0x243f6a8885a308d3ull, 0x13198a2e03707344ull}, NULL};
    int rc = ser_ranks(&s);
    if (rc == 0) rc = ser_head(&s);
    for (int i = 0; rc == 0 && i < w->n; i++) {
        const gj_ag_node *n = w->nodes[i];
        rc = n->kind == GJ_AG_ACCUMULATE ? ser_acc(&s, i, n) : ser_op(&s, i, n);
    }
    if (rc == 0) {
        site_u64(&s.sh, (uint64_t)w->n_hooks);
        w->site[0] = gj_m_mix64(s.sh.a);
        w->site[1] = gj_m_mix64(s.sh.b);
    }
    gj_rt_free(s.rank);
    return rc;
}

/* ------------------------------------------------------------- the walk */

/* needed[i]: an accumulate node (gj_grad mode: the node of a requested
 * input) is reachable from node i, what the engine runs. Kahn order, then
 * children before parents. */
static int compute_needed(gj_jit_walk *w) {
    int rc = -1;
    int *deps = gj_rt_calloc((size_t)w->n + 1, sizeof *deps);
    int *order = gj_rt_malloc((size_t)(w->n + 1) * sizeof *order);
    w->needed = gj_rt_calloc((size_t)w->n + 1, sizeof *w->needed);
    if (!deps || !order || !w->needed) goto done;
    for (int i = 0; i < w->n; i++)
        for (int k = 0; k < w->nodes[i]->n_in; k++) {
            int j = gj_jit_walk_find(w, w->nodes[i]->next[k].node);
            if (j >= 0) deps[j]++;
        }
    int head = 0, tail = 0;
    for (int i = 0; i < w->n; i++)
        if (deps[i] == 0) order[tail++] = i;
    while (head < tail) {
        const gj_ag_node *cur = w->nodes[order[head++]];
        for (int k = 0; k < cur->n_in; k++) {
            int j = gj_jit_walk_find(w, cur->next[k].node);
            if (j >= 0 && --deps[j] == 0) order[tail++] = j;
        }
    }
    for (int t = tail - 1; t >= 0; t--) {
        int i = order[t];
        const gj_ag_node *nd = w->nodes[i];
        bool need = !w->grad_mode && nd->kind == GJ_AG_ACCUMULATE;
        for (int r = 0; r < w->n_req && w->grad_mode && !need; r++) need = w->req_node[r] == i;
        for (int k = 0; k < nd->n_in && !need; k++) {
            int j = gj_jit_walk_find(w, nd->next[k].node);
            if (j >= 0 && w->needed[j]) need = true;
        }
        w->needed[i] = need;
    }
    rc = 0;
done:
    gj_rt_free(deps);
    gj_rt_free(order);
    return rc;
}

/* What the engine's validation would refuse, as a reason (w->invalid). */
static void validate(gj_jit_walk *w) {
    for (int i = 0; i < w->n && !w->invalid; i++) {
        const gj_ag_node *n = w->nodes[i];
        if (!w->needed[i] || n->kind != GJ_AG_OP) continue;
        if (n->released) {
            w->invalid = true;
            snprintf(w->reason, sizeof w->reason, "graph already freed (op %s)", n->op->name);
            return;
        }
        for (int k = 0; k < n->n_in; k++) { /* a leaf given another shape by set_ */
            const gj_ag_node *nx = n->next[k].node;
            if (nx && nx->kind == GJ_AG_ACCUMULATE && nx->leaf &&
                (nx->leaf->ndim != n->in_meta[k].ndim ||
                 memcmp(nx->leaf->shape, n->in_meta[k].shape,
                        (size_t)nx->leaf->ndim * sizeof nx->leaf->shape[0]) != 0)) {
                w->invalid = true;
                snprintf(w->reason, sizeof w->reason,
                         "a leaf of op %s changed shape (set_) after the forward", n->op->name);
                return;
            }
        }
        for (int k = 0; k < n->n_saved; k++) {
            if (!n->saved[k].t ||
                atomic_load(&n->saved[k].t->storage->version) != n->saved[k].version) {
                w->invalid = true;
                snprintf(w->reason, sizeof w->reason,
                         "saved tensor #%d of op %s was modified in place", k, n->op->name);
                return;
            }
        }
    }
}

/* gj_grad mode: the canonical edge of every requested input (after the
 * breadth-first walk). An input with no gradient edge makes the walk
 * invalid, as the engine refuses it. 0 or -1 (OOM). */
static int find_requests(gj_jit_walk *w) {
    w->req_node = gj_rt_calloc((size_t)w->n_req + 1, sizeof *w->req_node);
    w->req_nr = gj_rt_calloc((size_t)w->n_req + 1, sizeof *w->req_nr);
    w->req_refs = gj_rt_calloc((size_t)w->n_req + 1, sizeof *w->req_refs);
    if (!w->req_node || !w->req_nr || !w->req_refs) return -1;
    for (int i = 0; i < w->n_req; i++) {
        gj_ag_edge e = gj_ag_edge_of(w->req_inputs[i]);
        w->req_refs[i] = e.node;
        w->req_node[i] = e.node ? gj_jit_walk_find(w, e.node) : -1;
        w->req_nr[i] = e.input_nr;
        if (!e.node && !w->invalid) {
            w->invalid = true;
            snprintf(w->reason, sizeof w->reason, "input %d does not require grad", i);
        }
    }
    return 0;
}

int gj_jit_walk_build(gj_jit_walk *w, int n_roots, gj_tensor *const *roots,
                      gj_tensor *const *seeds) {
    return gj_jit_walk_build_grad(w, n_roots, roots, seeds, 0, NULL);
}

int gj_jit_walk_build_grad(gj_jit_walk *w, int n_roots, gj_tensor *const *roots,
                           gj_tensor *const *seeds, int n_inputs, gj_tensor *const *inputs) {
    memset(w, 0, sizeof *w);
    int rc = -1;
    int *root_node = gj_rt_calloc((size_t)n_roots + 1, sizeof *root_node);
    int *root_nr = gj_rt_calloc((size_t)n_roots + 1, sizeof *root_nr);
    w->root_refs = gj_rt_calloc((size_t)n_roots + 1, sizeof *w->root_refs);
    if (!root_node || !root_nr || !w->root_refs) goto done;
    w->grad_mode = inputs != NULL;
    w->n_req = inputs ? n_inputs : 0;
    w->req_inputs = inputs;
    w->n_roots = n_roots;
    for (int r = 0; r < n_roots; r++) {
        gj_ag_edge e = gj_ag_edge_of(roots[r]);
        w->root_refs[r] = e.node;
        root_node[r] = -1;
        if (!e.node) {
            w->invalid = true;
            snprintf(w->reason, sizeof w->reason, "root %d has no gradient edge", r);
            continue;
        }
        int j = gj_jit_walk_find(w, e.node);
        if (j < 0) j = walk_add(w, e.node);
        if (j < 0) goto done;
        root_node[r] = j;
        root_nr[r] = e.input_nr;
    }
    /* breadth first: w->nodes doubles as the queue */
    for (int head = 0; head < w->n; head++) {
        gj_ag_node *cur = w->nodes[head];
        for (int k = 0; k < cur->n_in; k++) {
            gj_ag_node *nx = cur->next[k].node;
            if (!nx || gj_jit_walk_find(w, nx) >= 0) continue;
            if (walk_add(w, nx) < 0) goto done;
        }
    }
    if (w->grad_mode && find_requests(w) != 0) goto done;
    if (compute_needed(w) != 0) goto done;
    if (build_saved_map(w) != 0) goto done;
    validate(w);
    if (serialize(w, n_roots, roots, seeds, root_node, root_nr) != 0) goto done;
    gj_jit_hash128(w->key, w->key_len, w->hash);
    rc = 0;
done:
    gj_rt_free(root_node);
    gj_rt_free(root_nr);
    return rc;
}

void gj_jit_walk_free(gj_jit_walk *w) {
    if (!w) return;
    for (int r = 0; r < w->n_roots && w->root_refs; r++)
        if (w->root_refs[r]) gj_ag_node_release(w->root_refs[r]);
    for (int i = 0; i < w->n_req && w->req_refs; i++)
        if (w->req_refs[i]) gj_ag_node_release(w->req_refs[i]);
    gj_rt_free(w->root_refs);
    gj_rt_free(w->req_refs);
    gj_rt_free(w->req_node);
    gj_rt_free(w->req_nr);
    gj_rt_free(w->nodes);
    gj_rt_free(w->needed);
    gj_rt_free(w->slots);
    gj_rt_free(w->saved);
    gj_rt_free(w->key);
    memset(w, 0, sizeof *w);
}

/* ------------------------------------------------------ the key string */

char *gj_jit_key_string(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds) {
    if (n_roots <= 0 || !roots) {
        gj_rt_set_error("gj_jit_key_string: needs n_roots > 0 and roots (got %d)", n_roots);
        return NULL;
    }
    for (int r = 0; r < n_roots; r++)
        if (!gj_rt_check_tensor(roots[r], "gj_jit_key_string", "roots[r]")) return NULL;
    gj_jit_walk w;
    char *out = NULL;
    if (gj_jit_walk_build(&w, n_roots, roots, seeds) == 0) {
        out = gj_rt_malloc(w.key_len + 1);
        if (out) memcpy(out, w.key, w.key_len + 1);
    } else {
        gj_rt_set_error("gj_jit_key_string: out of memory");
    }
    gj_jit_walk_free(&w);
    return out;
}
