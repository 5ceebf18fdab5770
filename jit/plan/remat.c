/* SPDX-License-Identifier: MIT */
/*
 * remat.c - a training step's memory budget: forward values the backward
 * reads are computed again in the backward instead of kept, until the
 * planned peak of temporaries fits the budget.
 *
 * Vocabulary: a forward value is an output of a phase-0 node; it is saved
 * when a later node (phase >= 1: the backward, the update) reads it,
 * directly or through views (RESHAPE, PERMUTE, EXPAND, SLICE: the saved
 * value is the view's base). A candidate is a saved value the budget may
 * drop: made by an ordinary node (no hook or custom call), not a
 * checkpoint region's op (pinned: the region's policy decides), not a
 * graph output, with bytes of its own. Dropping a value recomputes its
 * chain: its node and, through their inputs, every forward value that is
 * not kept (not saved, or dropped too); the chain stops at graph inputs
 * and kept values. A chain that would need a pinned value the region did
 * not keep is no candidate.
 *
 * Order: by tier (the chain's costliest node: 0 elementwise, views,
 * generators and copies; 1 reductions, index and window ops; 2 fused
 * attention; 3 GEMMs and the fused head), then by the FLOPs of its chain
 * per byte, then by value id, each priced with the candidates before it
 * dropped (order_candidates); the other saved outputs of a dropped
 * value's node are dropped with it. The pass plans the graph with the
 * first k candidates dropped: k = 0 (the backward kept apart from the
 * forward, below), then k at each tier's end until one fits, then a
 * bisection below that for the smallest k that fits. The peak is not
 * monotone in k (a chain through dropped values recomputes more, and its
 * copies may meet other peaks), so the bisection finds a k that fits, not
 * always the least; the smallest peak of all trials is what a budget
 * that cannot be met reports.
 *
 * Invariants of the rewritten graph:
 *   - The forward is unchanged. A site is the first backward node reading
 *     a dropped value (or a view of it): right before it, the value's
 *     chain is copied (marked remat), and later backward readers of that
 *     value share the copy. Each site copies its chain afresh, in a phase
 *     of its own (2 + site), so no copy is shared between sites, neither
 *     by this pass nor by CSE, which merges only nodes of one phase: a
 *     copy lives from its site to its readers, never across the step.
 *     The plan's order (emission order among ready instructions) runs it
 *     there.
 *   - A copy is the same instruction on the same inputs (or their copies):
 *     the same kernels in the same order compute the same bits; dropout
 *     masks and attention's dropout keep their run-time offsets (rt_node).
 *   - Every node after the forward is marked apart: the planner never
 *     fuses it into a kernel with forward nodes (plan_nodes.c). Unbudgeted,
 *     an elementwise backward node of forward values (GELU's derivative)
 *     joins the forward's kernel and its result is kept instead of its
 *     input; a budgeted graph keeps what its trials counted.
 */
#include "jit/plan/plan.h"

#include <string.h>

typedef struct remat {
    const gj_jit_graph *g;
    bool *saved; /* per value: saved (a base read by phase 1) */
    bool *drop;  /* per value: dropped by this choice */
    int *cand;   /* candidates in order */
    int n_cand;
    double *key; /* per value: its chain's FLOPs per byte (candidates) */
    int *tier;   /* per value: its chain's tier (candidates) */
    int *mark;   /* per node: visit generation */
    int gen;
    int *newid, *clone; /* a rebuild's renaming: originals and copies */
    int *top;           /* per value: the copy backward nodes read (a rebuild's) */
    int *cgen;          /* per value: the site whose chain made clone[v] */
    int site;           /* the site being built: its phase is 2 + site */
    size_t budget;
} remat;

static bool is_fwd(const gj_jit_graph *g, int v) {
    int n = g->values[v].node;
    return n >= 0 && g->nodes[n].phase == 0;
}

static bool is_generator(gj_rt_prim p) {
    return p == GJ_P_FILL || p == GJ_P_IOTA || p == GJ_P_DROPOUT_MASK;
}

/* The value v views (through forward movement nodes), v itself if none. */
static int base_of(const gj_jit_graph *g, int v) {
    while (is_fwd(g, v) && gj_jit_prim_is_movement(g->nodes[g->values[v].node].inst.prim))
        v = g->nodes[g->values[v].node].in[0];
    return v;
}

static bool recomputable(const gj_jit_node *n) {
    return n->hook < 0 && n->custom < 0 && !n->pinned;
}

static size_t value_bytes(const gj_jit_graph *g, int v) {
    const gj_rt_meta *m = &g->values[v].meta;
    size_t n = gj_rt_dtype_size(m->dtype);
    for (int d = 0; d < m->ndim; d++) n *= (size_t)m->shape[d];
    return n;
}

static double numel_d(const gj_rt_meta *m) {
    double n = 1.0;
    for (int d = 0; d < m->ndim; d++) n *= (double)m->shape[d];
    return n;
}

/* FLOPs of node n: 2 M N K per GEMM, 4 T S D per attention head (half
 * under the causal mask), 6 N V C for the fused head (its logits, then
 * the gradients of h and of the weight), an element of input per
 * reduction, an element of output for the rest; views and generators
 * none. */
static double node_flops(const gj_jit_graph *g, const gj_jit_node *n) {
    gj_rt_prim p = n->inst.prim;
    const gj_rt_meta *o = &g->values[n->out[0]].meta;
    if (gj_jit_prim_is_movement(p) || is_generator(p)) return 0.0;
    if (p == GJ_P_MATMUL) {
        const gj_rt_meta *a = &g->values[n->in[0]].meta;
        double k = (double)a->shape[a->ndim - (n->inst.ta ? 2 : 1)];
        return 2.0 * numel_d(o) * k;
    }
    if (p == GJ_P_ATTN_FWD) {
        const gj_rt_meta *q = &g->values[n->in[0]].meta, *k = &g->values[n->in[1]].meta;
        double f = 4.0 * numel_d(q) * (double)k->shape[k->ndim - 2];
        return n->inst.keepdim ? f / 2.0 : f;
    }
    if (p == GJ_P_LCE_FWD) {
        const gj_rt_meta *h = &g->values[n->in[0]].meta, *w = &g->values[n->in[1]].meta;
        return 6.0 * numel_d(h) * (double)w->shape[0];
    }
    if (p == GJ_P_SUM || p == GJ_P_MAX) return numel_d(&g->values[n->in[0]].meta);
    return numel_d(o);
}

static int node_tier(gj_rt_prim p) {
    if (p == GJ_P_MATMUL || p == GJ_P_LCE_FWD) return 3;
    if (p == GJ_P_ATTN_FWD) return 2;
    if (gj_jit_prim_is_elementwise(p) || gj_jit_prim_is_movement(p) || is_generator(p) ||
        p == GJ_P_PAD || p == GJ_P_CAT)
        return 0;
    return 1;
}

/* Whether a backward reader of forward value u reads a copy: u's base is
 * not kept (not saved, or dropped) and its node can be run again. */
static bool needs_copy(const remat *r, int u) {
    const gj_jit_graph *g = r->g;
    if (!is_fwd(g, u)) return false;
    int b = base_of(g, u);
    if (!is_fwd(g, b) || !recomputable(&g->nodes[g->values[b].node])) return false;
    return !r->saved[b] || r->drop[b];
}

/* Adds the chain of value v (its node, then the inputs it needs copied)
 * to *flops and *tier; false when it needs a value a checkpoint region
 * did not keep. Nodes already visited this generation count once. */
static bool chain(remat *r, int v, double *flops, int *tier) {
    const gj_jit_graph *g = r->g;
    int ni = g->values[v].node;
    if (r->mark[ni] == r->gen) return true;
    r->mark[ni] = r->gen;
    const gj_jit_node *n = &g->nodes[ni];
    *flops += node_flops(g, n);
    if (node_tier(n->inst.prim) > *tier) *tier = node_tier(n->inst.prim);
    for (int k = 0; k < n->inst.n_in; k++) {
        int u = n->in[k], b = base_of(g, u);
        if (is_fwd(g, b) && g->nodes[g->values[b].node].pinned && !r->saved[b]) return false;
        if (needs_copy(r, u) && !chain(r, u, flops, tier)) return false;
    }
    return true;
}

/* The saved values, then the candidates with their chains' cost (each
 * with only itself dropped). */
static void find_candidates(remat *r) {
    const gj_jit_graph *g = r->g;
    for (int i = 0; i < g->n_nodes; i++) {
        const gj_jit_node *n = &g->nodes[i];
        if (n->phase == 0) continue;
        for (int k = 0; k < n->inst.n_in; k++) {
            int b = base_of(g, n->in[k]);
            if (is_fwd(g, b)) r->saved[b] = true;
        }
    }
    bool *is_out = r->drop; /* (scratch: cleared below) */
    for (int o = 0; o < g->n_outputs; o++) is_out[base_of(g, g->outputs[o].value)] = true;
    r->n_cand = 0;
    for (int v = 0; v < g->n_values; v++) {
        if (!r->saved[v] || is_out[v]) continue;
        const gj_jit_node *n = &g->nodes[g->values[v].node];
        size_t bytes = value_bytes(g, v);
        if (!recomputable(n) || is_generator(n->inst.prim) || bytes == 0) continue;
        double flops = 0.0;
        int tier = 0;
        r->gen++;
        r->drop[v] = true;
        bool ok = chain(r, v, &flops, &tier);
        r->drop[v] = false;
        if (!ok) continue;
        r->key[v] = flops / (double)bytes;
        r->tier[v] = tier;
        r->cand[r->n_cand++] = v;
    }
    memset(r->drop, 0, (size_t)g->n_values * sizeof *r->drop);
}

/* Whether candidate u comes before v: tier, FLOPs per byte, id. */
static bool cand_before(const remat *r, int u, int v) {
    if (r->tier[u] != r->tier[v]) return r->tier[u] < r->tier[v];
    if (r->key[u] != r->key[v]) return r->key[u] < r->key[v];
    return u < v;
}

/* The candidates in the order the budget drops them: each the first (by
 * cand_before) with the ones before it dropped. Dropping more only
 * lengthens chains (a chain runs through every dropped value it reads),
 * so a candidate's tier and key never fall: a key computed earlier is a
 * lower bound, and the first candidate whose key, computed again now, is
 * unchanged is the next one (a lazy greedy). A value whose chain through
 * the values before it would need one a checkpoint region did not keep
 * leaves the list. Without this, two dropped values whose chains share
 * an expensive node (attention, a GEMM) would each be priced as if the
 * other were kept, and each site would compute that node again. */
static void order_candidates(remat *r) {
    const gj_jit_graph *g = r->g;
    int m = 0, n = r->n_cand;
    while (m < n) {
        int best = m;
        for (int i = m + 1; i < n; i++)
            if (cand_before(r, r->cand[i], r->cand[best])) best = i;
        int v = r->cand[best];
        double flops = 0.0;
        int tier = 0;
        r->gen++;
        r->drop[v] = true;
        bool ok = chain(r, v, &flops, &tier);
        double key = flops / (double)value_bytes(g, v);
        if (ok && tier == r->tier[v] && key == r->key[v]) {
            r->cand[best] = r->cand[m];
            r->cand[m++] = v;
            /* Its node's other saved outputs come with it: one copy of the
             * node at the first site makes them all (site_copy). */
            const gj_jit_node *nd = &g->nodes[g->values[v].node];
            for (int o = 0; o < nd->n_out; o++)
                for (int i = m; i < n; i++)
                    if (r->cand[i] == nd->out[o]) {
                        r->drop[nd->out[o]] = true;
                        r->cand[i] = r->cand[m];
                        r->cand[m++] = nd->out[o];
                        break;
                    }
            continue;
        }
        r->drop[v] = false;
        if (ok) {
            r->tier[v] = tier;
            r->key[v] = key;
        } else {
            r->cand[best] = r->cand[--n];
        }
    }
    r->n_cand = m;
    memset(r->drop, 0, (size_t)g->n_values * sizeof *r->drop);
}

/* The copy of forward value u in ng for the current site (made now, with
 * the copies its inputs need, unless this site has it): its id, or -1
 * (OOM). Each site (the first backward read of a dropped value) computes
 * its chain afresh, in a phase of its own (2 + site): no copy is shared
 * with another site, neither here nor by CSE, so each lives only from
 * its site's emission to its readers. */
static int copy_of(remat *r, gj_jit_graph *ng, int u) {
    if (r->cgen[u] == r->site) return r->clone[u];
    const gj_jit_graph *g = r->g;
    const gj_jit_node *n = &g->nodes[g->values[u].node];
    int args[GJ_RT_MAX_INPUTS];
    for (int k = 0; k < n->inst.n_in; k++) {
        int x = n->in[k];
        args[k] = needs_copy(r, x) ? copy_of(r, ng, x) : r->newid[x];
        if (args[k] < 0) return -1;
    }
    if (gj_jit_graph_copy_node(ng, g, n, args, r->clone) != 0) return -1;
    gj_jit_node *c = &ng->nodes[ng->n_nodes - 1];
    c->phase = 2 + r->site;
    c->remat = true;
    c->apart = true;
    for (int k = 0; k < n->n_out; k++) r->cgen[n->out[k]] = r->site;
    return r->clone[u];
}

/* What a backward node reads for forward value x that needs a copy: the
 * copy of x's site, made at its first read; an output of a node with
 * several (attention's o and lse, the fused head's loss and gradients)
 * shares the copy an earlier site made of that node. -1 (OOM). */
static int site_copy(remat *r, gj_jit_graph *ng, int x) {
    if (r->top[x] >= 0) return r->top[x];
    const gj_jit_node *n = &r->g->nodes[r->g->values[x].node];
    if (n->n_out > 1 && r->cgen[x] >= 0) /* a sibling output's site copied the node */
        return r->top[x] = r->clone[x];
    r->site++;
    r->top[x] = copy_of(r, ng, x);
    return r->top[x];
}

/* The graph with the first k candidates dropped into ng (empty on entry),
 * through the passes program.c runs. 0 or -1 (OOM). */
static int rebuild(remat *r, int k, gj_jit_graph *ng) {
    const gj_jit_graph *g = r->g;
    memset(r->drop, 0, (size_t)g->n_values * sizeof *r->drop);
    for (int c = 0; c < k; c++) r->drop[r->cand[c]] = true;
    for (int v = 0; v < g->n_values; v++) r->newid[v] = r->clone[v] = r->top[v] = r->cgen[v] = -1;
    r->site = 0;
    if (gj_jit_graph_copy_inputs(ng, g, r->newid) != 0) return -1;
    for (int i = 0; i < g->n_nodes; i++) {
        const gj_jit_node *n = &g->nodes[i];
        int args[GJ_RT_MAX_INPUTS];
        for (int q = 0; q < n->inst.n_in; q++) {
            int x = n->in[q];
            args[q] = n->phase != 0 && needs_copy(r, x) ? site_copy(r, ng, x) : r->newid[x];
            if (args[q] < 0) return -1;
        }
        if (gj_jit_graph_copy_node(ng, g, n, args, r->newid) != 0) return -1;
        ng->nodes[ng->n_nodes - 1].apart = n->phase != 0;
    }
    for (int o = 0; o < g->n_outputs; o++) {
        const gj_jit_output *out = &g->outputs[o];
        if (gj_jit_graph_add_output(ng, r->newid[out->value], out->acc_node, out->grad_input) != 0)
            return -1;
    }
    if (gj_jit_graph_copy_hooks(ng, g) != 0) return -1;
    ng->walk_nodes = g->walk_nodes;
    ng->n_walk_nodes = g->n_walk_nodes;
    bool changed = false;
    if (gj_jit_pass_cse_dce(ng) != 0 || gj_jit_pass_pad_sums(ng, &changed) != 0 ||
        (changed && gj_jit_pass_cse_dce(ng) != 0))
        return -1;
    return 0;
}

/* Trial plans made by gj_jit_pass_remat in this process (tests). */
static _Atomic int64_t g_trials;

int64_t gj_jit_remat_trials(void) { return g_trials; }

/* The planned peak with the first k candidates dropped into *peak; the
 * graph into keep (when not NULL, emptied first) if it fits the budget. 0,
 * or -1 with why[] set. */
static int try_k(remat *r, int k, size_t *peak, gj_jit_graph *keep, char *why, size_t why_cap) {
    g_trials++;
    gj_jit_graph ng;
    gj_jit_graph_init(&ng);
    gj_jit_plan p;
    memset(&p, 0, sizeof p);
    if (rebuild(r, k, &ng) != 0) {
        snprintf(why, why_cap, "out of memory while planning the memory budget");
        gj_jit_graph_free(&ng);
        return -1;
    }
    if (gj_jit_plan_build(&ng, &p, why, why_cap) != 0) {
        gj_jit_graph_free(&ng);
        return -1;
    }
    *peak = p.peak_temp_bytes;
    if (gj_jit_log_flags() & GJ_JIT_LOG_PLAN) {
        fprintf(stderr, "[gradjit plan] memory budget %zu: %d of %d saved values recomputed: "
                "peak %zu\n", r->budget, k, r->n_cand, *peak);
        for (int c = 0; c < k; c++)
            fprintf(stderr, "  v%d tier %d %.3g FLOPs/byte%s\n", r->cand[c], r->tier[r->cand[c]],
                    r->key[r->cand[c]], "");
    }
    gj_jit_plan_free(&p);
    if (keep && *peak <= r->budget) {
        gj_jit_graph_free(keep);
        *keep = ng;
    } else {
        gj_jit_graph_free(&ng);
    }
    return 0;
}

/* The smallest k that fits, given that k = 0 does not (its peak in
 * out->min_peak): the first tier's end that fits, then a bisection below
 * it (down to the previous tier's end, which does not). *k_out -1 when
 * none fits, else its graph in *best; out->min_peak the smallest peak
 * seen. */
static int search(remat *r, gj_jit_remat *out, int *k_out, gj_jit_graph *best, char *why,
                  size_t why_cap) {
    int lo = 0, hi = -1;
    size_t peak = 0;
    for (int t = 0; t <= 3 && hi < 0; t++) {
        int end = 0;
        while (end < r->n_cand && r->tier[r->cand[end]] <= t) end++;
        if (end == lo) continue;
        if (try_k(r, end, &peak, best, why, why_cap) != 0) return -1;
        if (peak < out->min_peak) out->min_peak = peak;
        if (peak <= out->budget) {
            hi = end;
            out->peak = peak;
        } else {
            lo = end;
        }
    }
    while (hi >= 0 && hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (try_k(r, mid, &peak, best, why, why_cap) != 0) return -1;
        if (peak < out->min_peak) out->min_peak = peak;
        if (peak <= out->budget) {
            hi = mid;
            out->peak = peak;
        } else {
            lo = mid;
        }
    }
    *k_out = hi;
    return 0;
}

/* The hash of the candidates' order (what a hint's k counts in). */
static uint64_t order_hash(const remat *r) {
    uint64_t h[2];
    gj_jit_hash128(r->cand, (size_t)r->n_cand * sizeof *r->cand, h);
    return h[0] ^ (uint64_t)r->n_cand;
}

static void remat_free(remat *r) {
    gj_rt_free(r->saved);
    gj_rt_free(r->drop);
    gj_rt_free(r->cand);
    gj_rt_free(r->key);
    gj_rt_free(r->tier);
    gj_rt_free(r->mark);
    gj_rt_free(r->newid);
    gj_rt_free(r->clone);
    gj_rt_free(r->top);
    gj_rt_free(r->cgen);
}

int gj_jit_pass_remat(gj_jit_graph *g, gj_jit_remat *out, char *why, size_t why_cap) {
    why[0] = '\0';
    out->peak = out->min_peak = 0;
    out->n_dropped = 0;
    out->searched = false;
    bool changed = false;
    if (gj_jit_pass_cse_dce(g) != 0 || gj_jit_pass_pad_sums(g, &changed) != 0 ||
        (changed && gj_jit_pass_cse_dce(g) != 0)) {
        snprintf(why, why_cap, "out of memory in the graph passes");
        return -1;
    }
    remat r = {.g = g, .budget = out->budget};
    gj_jit_graph ng; /* the graph that fits */
    gj_jit_graph_init(&ng);
    size_t nv = (size_t)g->n_values + 1;
    r.saved = gj_rt_calloc(nv, sizeof *r.saved);
    r.drop = gj_rt_calloc(nv, sizeof *r.drop);
    r.cand = gj_rt_malloc(nv * sizeof *r.cand);
    r.key = gj_rt_calloc(nv, sizeof *r.key);
    r.tier = gj_rt_calloc(nv, sizeof *r.tier);
    r.mark = gj_rt_calloc((size_t)g->n_nodes + 1, sizeof *r.mark);
    r.newid = gj_rt_malloc(nv * sizeof *r.newid);
    r.clone = gj_rt_malloc(nv * sizeof *r.clone);
    r.top = gj_rt_malloc(nv * sizeof *r.top);
    r.cgen = gj_rt_malloc(nv * sizeof *r.cgen);
    int rc = -1, k = -1;
    if (!r.saved || !r.drop || !r.cand || !r.key || !r.tier || !r.mark || !r.newid || !r.clone ||
        !r.top || !r.cgen) {
        snprintf(why, why_cap, "out of memory while planning the memory budget");
        goto done;
    }
    find_candidates(&r);
    order_candidates(&r);
    out->order = order_hash(&r);
    bool tried = false;
    if (out->hint_k > 0 && out->hint_k <= r.n_cand && out->hint_order == out->order) {
        /* an earlier plan of this graph chose hint_k: one trial, if it fits */
        size_t peak = 0;
        if (try_k(&r, out->hint_k, &peak, &ng, why, why_cap) != 0) goto done;
        out->min_peak = peak;
        tried = true;
        if (peak <= out->budget) {
            out->peak = peak;
            k = out->hint_k;
            rc = 0;
            goto take;
        }
    }
    if (try_k(&r, 0, &out->peak, NULL, why, why_cap) != 0) goto done;
    if (!tried || out->peak < out->min_peak) out->min_peak = out->peak;
    rc = 0;
    if (out->peak <= out->budget) goto done; /* fits as it is: g unchanged */
    out->searched = true;
    if (search(&r, out, &k, &ng, why, why_cap) != 0) {
        rc = -1;
        goto done;
    }
    if (k < 0) {
        rc = 1;
        goto done;
    }
take:
    gj_jit_graph_free(g);
    *g = ng;
    gj_jit_graph_init(&ng);
    out->n_dropped = k;
done:
    gj_jit_graph_free(&ng);
    remat_free(&r);
    return rc;
}

void gj_jit_remat_stats(const gj_jit_graph *g, int64_t *saved_bytes, double *flops, int64_t *n) {
    *saved_bytes = 0;
    *flops = 0.0;
    *n = 0;
    bool *seen = gj_rt_calloc((size_t)g->n_values + 1, sizeof *seen);
    for (int i = 0; i < g->n_nodes; i++) {
        const gj_jit_node *x = &g->nodes[i];
        if (x->remat) {
            *flops += node_flops(g, x);
            *n += !gj_jit_prim_is_movement(x->inst.prim) && !is_generator(x->inst.prim);
        }
        if (x->phase == 0 || !seen) continue;
        for (int k = 0; k < x->inst.n_in; k++) {
            int b = base_of(g, x->in[k]);
            if (!is_fwd(g, b) || seen[b]) continue;
            seen[b] = true;
            if (!is_generator(g->nodes[g->values[b].node].inst.prim))
                *saved_bytes += (int64_t)value_bytes(g, b);
        }
    }
    gj_rt_free(seen);
}
