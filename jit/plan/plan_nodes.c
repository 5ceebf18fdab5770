/* SPDX-License-Identifier: MIT */
/*
 * plan_nodes.c - planning each node of a captured graph: its output becomes
 * a view, a constant or a fused value, and instructions are added for what must
 * run (fused groups, BLAS calls, gathers and scatters, im2col / col2im,
 * hook and custom calls); then the graph outputs (.grad) get their buffers.
 *
 * Fusion invariant: a node may join group G only if each of its inputs is
 * a constant, an elementwise member of G, or produced by an instruction that does
 * not depend on G (so the step graph stays acyclic). Reductions join the
 * group of their input (if it has the same iteration space and no
 * reduction over other axes yet); nothing consumes a reduction's result
 * inside the group that produced it. A value some other instruction needs is
 * materialised: its group stores it into a buffer.
 *
 * Contract: gj_jit_pl_node is called once per node in graph order, then
 * gj_jit_pl_outputs once; each returns 0, or -1 with pl->why set (out of
 * memory, or "no lowering for ..." for what the plan cannot express, which
 * makes the backward run eagerly).
 */
#include "jit/plan/plan_int.h"

/* ------------------------------------------ values, groups and instructions */

/* New pinstr; returns its id or -1 (OOM). */
static int new_pinstr(planner *pl, pinstr_kind kind, int idx, int64_t pos) {
    int old_cap = pl->cap_ps;
    if (gj_jit_grow((void **)&pl->ps, pl->n_ps, &pl->cap_ps, sizeof *pl->ps) != 0) return -1;
    if (pl->cap_ps != old_cap || !pl->stack) {
        int *st = gj_rt_realloc(pl->stack, (size_t)pl->cap_ps * sizeof *st);
        if (!st) return -1;
        pl->stack = st;
    }
    pinstr *s = &pl->ps[pl->n_ps];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->idx = idx;
    s->pos = pos;
    return pl->n_ps++;
}

/* Instruction s reads something instruction d writes. 0 or -1 (OOM). */
static int add_dep(planner *pl, int s, int d) {
    if (d < 0 || d == s) return 0;
    pinstr *x = &pl->ps[s];
    for (int k = 0; k < x->n_deps; k++)
        if (x->deps[k] == d) return 0;
    if (gj_jit_grow((void **)&x->deps, x->n_deps, &x->cap_deps, sizeof *x->deps) != 0) return -1;
    x->deps[x->n_deps++] = d;
    return 0;
}

/* Value v is what instruction sid writes into buffer buf, contiguously. */
static void instr_output(planner *pl, int sid, int buf, int v) {
    const gj_rt_meta *m = vmeta(pl, v);
    pl->p->bufs[buf].writer = sid;
    vinfo *o = &pl->vi[v];
    o->kind = V_VIEW;
    o->buf = buf;
    o->offset = 0;
    contig_strides(m->ndim, m->shape, o->strides);
}

/* Does instruction s depend (transitively) on instruction t? */
static bool depends(planner *pl, int s, int t) {
    if (s < 0) return false;
    if (s == t) return true;
    int gen = ++pl->mark_gen, top = 0;
    pl->stack[top++] = s;
    pl->ps[s].mark = gen;
    while (top > 0) {
        const pinstr *x = &pl->ps[pl->stack[--top]];
        for (int k = 0; k < x->n_deps; k++) {
            int d = x->deps[k];
            if (d == t) return true;
            if (pl->ps[d].mark == gen) continue;
            pl->ps[d].mark = gen;
            pl->stack[top++] = d;
        }
    }
    return false;
}

/* The instruction producing value v (-1: a graph input, constant or generator). */
static int producer(planner *pl, int v) {
    const vinfo *x = &pl->vi[v];
    if (x->kind == V_CONST) return -1;
    if (x->kind == V_FUSED) return pl->groups[x->group].instr;
    return x->buf >= 0 ? pl->p->bufs[x->buf].writer : -1;
}

/* Gives FUSED value v a contiguous buffer of its own if it has none. */
static int materialize(planner *pl, int v) {
    vinfo *x = &pl->vi[v];
    if (x->kind != V_FUSED || x->buf >= 0) return 0;
    const gj_rt_meta *m = vmeta(pl, v);
    int b = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, m->dtype, numel_of(m->ndim, m->shape));
    if (b < 0) return gj_jit_pl_oom(pl);
    x->buf = b;
    x->offset = 0;
    contig_strides(m->ndim, m->shape, x->strides);
    pl->p->bufs[b].writer = pl->groups[x->group].instr;
    return 0;
}

/* Recomputation instead of a buffer. A FUSED value that another group
 * reads is normally materialised: its group stores it and the reader loads
 * it. When the value is a short chain of cheap elementwise ops (at most
 * GJ_JIT_RECOMP_NODES nodes of the kinds below) over constants and values
 * that already have buffers, the reader computes it again instead, if the
 * buffers as large as the value that this reads (the others broadcast: a
 * row's mean, a weight) take at most 3 bytes per byte of the value, what
 * the store, the write-allocate and the load of a materialised value cost.
 * The same ops in the same dtypes give the same bits, and the store and
 * the load of a whole tensor (a layer norm's xhat in f32 and f64, its g*w)
 * give way to a few vector ops. The reader still depends on the producing
 * group's step (group_reads), so the step graph is the one materialising
 * would give. */
#define GJ_JIT_RECOMP_NODES 12
#define GJ_JIT_RECOMP_FULL 8 /* distinct full-size buffers, at most */

static bool cheap_prim(gj_rt_prim p) {
    return p == GJ_P_NEG || p == GJ_P_ADD_SCALAR || p == GJ_P_MUL_SCALAR || p == GJ_P_CAST ||
           p == GJ_P_ADD || p == GJ_P_SUB || p == GJ_P_MUL;
}

typedef struct recomp_budget {
    int nodes;                     /* nodes left */
    int64_t numel;                 /* of the value asked for */
    int64_t bytes;                 /* per element, left for loads of full-size buffers */
    int full[GJ_JIT_RECOMP_FULL];  /* distinct buffers loaded of at least that size */
    int n_full;
} recomp_budget;

/* Counts the load of value u (it has a buffer) against the budget; false
 * when over it. A buffer smaller than the value (a scalar or a row
 * expanded, a weight broadcast) costs nothing. */
static bool recomp_load(planner *pl, int u, recomp_budget *bg) {
    int b = pl->vi[u].buf;
    if (pl->p->bufs[b].numel < bg->numel || buf_virtual(&pl->p->bufs[b])) return true;
    for (int k = 0; k < bg->n_full; k++)
        if (bg->full[k] == b) return true;
    bg->bytes -= (int64_t)gj_rt_dtype_size(pl->p->bufs[b].dtype);
    if (bg->n_full == GJ_JIT_RECOMP_FULL || bg->bytes < 0) return false;
    bg->full[bg->n_full++] = b;
    return true;
}

/* Can value v be computed again from its inputs within the budget?
 * Values with a buffer are loaded, not recomputed. */
static bool recomputable(planner *pl, int v, recomp_budget *bg) {
    const vinfo *x = &pl->vi[v];
    if (x->kind != V_FUSED || x->buf >= 0) return false;
    int ni = pl->g->values[v].node;
    if (ni < 0 || --bg->nodes < 0) return false;
    const gj_jit_node *n = &pl->g->nodes[ni];
    if (n->hook >= 0 || n->custom >= 0 || !cheap_prim(n->inst.prim) ||
        vmeta(pl, v)->dtype == GJ_I64)
        return false;
    for (int k = 0; k < n->inst.n_in; k++) {
        int u = n->in[k];
        const vinfo *ui = &pl->vi[u];
        if (ui->kind == V_CONST) continue;
        if ((ui->kind == V_VIEW || ui->kind == V_FUSED) && ui->buf >= 0) {
            if (!recomp_load(pl, u, bg)) return false;
            continue;
        }
        if (!recomputable(pl, u, bg)) return false;
    }
    return true;
}

/* Adds v and the FUSED inputs it needs without a buffer to gi's list. */
static int add_recomp(planner *pl, int gi, int v) {
    if (recomputes(pl, gi, v)) return 0;
    const gj_jit_node *n = &pl->g->nodes[pl->g->values[v].node];
    for (int k = 0; k < n->inst.n_in; k++) {
        const vinfo *u = &pl->vi[n->in[k]];
        if (u->kind == V_FUSED && u->buf < 0 && add_recomp(pl, gi, n->in[k]) != 0) return -1;
    }
    pgroup *G = &pl->groups[gi];
    if (gj_jit_grow((void **)&G->recomp, G->n_recomp, &G->cap_recomp, sizeof *G->recomp) != 0)
        return gj_jit_pl_oom(pl);
    G->recomp[G->n_recomp++] = v;
    return 0;
}

/* Group gi reads value v of another group: computes it again when that is
 * cheap, else gives it a buffer. 0 or -1 (OOM). */
static int need_value(planner *pl, int gi, int v) {
    if (recomputes(pl, gi, v)) return 0;
    const gj_rt_meta *m = vmeta(pl, v);
    recomp_budget bg = {GJ_JIT_RECOMP_NODES, numel_of(m->ndim, m->shape),
                        3 * (int64_t)gj_rt_dtype_size(m->dtype), {0}, 0};
    if (recomputable(pl, v, &bg)) return add_recomp(pl, gi, v);
    return materialize(pl, v);
}

static int new_group(planner *pl, int ndim, const int64_t *shape, int first, int64_t pos) {
    if (gj_jit_grow((void **)&pl->groups, pl->n_groups, &pl->cap_groups, sizeof *pl->groups) != 0)
        return -1;
    pgroup *G = &pl->groups[pl->n_groups];
    memset(G, 0, sizeof *G);
    G->ndim = ndim;
    memcpy(G->shape, shape, (size_t)ndim * sizeof *shape);
    G->first = first;
    G->pos = pos;
    G->copy_src = -1;
    G->copy_dst = -1;
    G->instr = new_pinstr(pl, PS_GROUP, pl->n_groups, pos);
    if (G->instr < 0) return -1;
    return pl->n_groups++;
}

static int group_add(planner *pl, pgroup *G, int node) {
    if (gj_jit_grow((void **)&G->nodes, G->n, &G->cap, sizeof *G->nodes) != 0) return -1;
    G->nodes[G->n++] = node;
    const gj_jit_node *n = &pl->g->nodes[node];
    G->has_fwd |= n->phase == 0;
    G->has_apart |= n->apart;
    return 0;
}

/* Whether node n may not join group G: a node kept apart from the forward
 * (a budgeted step's backward and recomputations, plan/remat.c) never
 * shares a kernel with it. */
static bool remat_apart(const pgroup *G, const gj_jit_node *n) {
    return (n->apart && G->has_fwd) || (n->phase == 0 && G->has_apart);
}

/* A copy group over shape (nd, shape) writing value src (or, src < 0, the
 * constant cval) into buffer dst at offset off with strides st. Returns its
 * instruction or -1. Does not set the buffer's writer. */
static int copy_into(planner *pl, int src, double cval, int nd, const int64_t *shape, int dst,
                     int64_t off, const int64_t *st, int64_t pos) {
    if (src >= 0 && pl->vi[src].kind == V_FUSED && materialize(pl, src) != 0) return -1;
    int gi = new_group(pl, nd, shape, -1, pos);
    if (gi < 0) return gj_jit_pl_oom(pl);
    pgroup *G = &pl->groups[gi];
    G->is_copy = true;
    G->copy_src = src;
    G->copy_cval = cval;
    G->copy_dst = dst;
    G->copy_off = off;
    memcpy(G->copy_st, st, (size_t)nd * sizeof *st);
    if (src >= 0 && add_dep(pl, G->instr, producer(pl, src)) != 0) return gj_jit_pl_oom(pl);
    return G->instr;
}

/* A copy group writing value src (VIEW or CONST) into a new contiguous
 * buffer dst (or the given one when dst >= 0) at position pos. Returns the
 * buffer, or -1. */
static int copy_to_buffer(planner *pl, int src, int dst, gj_jit_buf_kind kind, int index,
                          int64_t pos) {
    const gj_rt_meta *m = vmeta(pl, src);
    if (dst < 0) {
        dst = gj_jit_pl_new_buf(pl, kind, index, m->dtype, numel_of(m->ndim, m->shape));
        if (dst < 0) return gj_jit_pl_oom(pl);
    }
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(m->ndim, m->shape, cs);
    int sid = copy_into(pl, src, 0.0, m->ndim, m->shape, dst, 0, cs, pos);
    if (sid < 0) return -1;
    pl->p->bufs[dst].writer = sid;
    return dst;
}

/* Is value u read only through identity nodes whose outputs stay in its
 * buffer (plan_elementwise's x * 1)? */
static bool read_only_as_alias(planner *pl, int u) {
    if (pl->uses[u] != 1) return false;
    const gj_jit_graph *g = pl->g;
    for (int j = 0; j < g->n_nodes; j++)
        for (int k = 0; k < g->nodes[j].inst.n_in; k++)
            if (g->nodes[j].in[k] == u) {
                const vinfo *o = &pl->vi[g->nodes[j].out[0]];
                return o->kind == V_VIEW && o->buf == pl->vi[u].buf;
            }
    return false;
}

/* Value v placed densely at offset off of buffer b, when v is the whole of a
 * temporary a linear cross-entropy instruction writes (its weight's
 * gradient, padded to the padded vocabulary) that nothing else reads: the
 * instruction writes into b instead and no copy is made. Returns that
 * instruction, or -1 (not such a value). */
static int retarget_lce(planner *pl, int v, int b, int64_t off, const int64_t *st) {
    vinfo *x = &pl->vi[v];
    const gj_rt_meta *m = vmeta(pl, v);
    if (x->kind != V_VIEW || x->buf < 0 || x->offset != 0 || pl->uses[v] != 1) return -1;
    const gj_jit_buffer *src = &pl->p->bufs[x->buf];
    int w = src->writer;
    if (src->kind != GJ_JIT_BUF_TEMP || w < 0 || pl->ps[w].kind != PS_LCE ||
        src->numel != numel_of(m->ndim, m->shape) || src->dtype != pl->p->bufs[b].dtype)
        return -1;
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(m->ndim, m->shape, cs);
    for (int k = 0; k < m->ndim; k++)
        if (m->shape[k] > 1 && (x->strides[k] != cs[k] || st[k] != cs[k])) return -1;
    for (int u = 0; u < pl->g->n_values; u++)
        if (u != v && pl->vi[u].kind != V_CONST && pl->vi[u].kind != V_UNSET &&
            pl->vi[u].buf == x->buf && !read_only_as_alias(pl, u))
            return -1;
    gj_jit_lce *lc = &pl->lcs[pl->ps[w].idx];
    for (int o = 1; o < 4; o++)
        if (lc->out_buf[o] == x->buf) {
            lc->out_buf[o] = b;
            lc->out_off[o] = off;
            x->buf = b;
            x->offset = off;
            return w;
        }
    return -1;
}

/* Makes value v appear in buffer b at offset off with strides st (over v's
 * shape): an unmaterialised fused value is stored there by its own group, a
 * linear cross-entropy's gradient by its instruction (retarget_lce);
 * anything else is copied. Returns the writing instruction, or -1. */
static int place_into(planner *pl, int v, int b, int64_t off, const int64_t *st, int64_t pos) {
    vinfo *x = &pl->vi[v];
    const gj_rt_meta *m = vmeta(pl, v);
    if (x->kind == V_FUSED && x->buf < 0) {
        x->buf = b;
        x->offset = off;
        memcpy(x->strides, st, (size_t)m->ndim * sizeof *st);
        return pl->groups[x->group].instr;
    }
    int w = retarget_lce(pl, v, b, off, st);
    if (w >= 0) return w;
    return copy_into(pl, v, 0.0, m->ndim, m->shape, b, off, st, pos);
}

/* ---------------------------------------------------------- the nodes */

/* May a node reading in[0..n_in) join group gi without a cycle? */
static bool inputs_allow(planner *pl, int gi, int n_in, const int *in) {
    int gs = pl->groups[gi].instr;
    for (int k = 0; k < n_in; k++) {
        int v = in[k];
        if (pl->vi[v].kind == V_CONST || is_member_of(pl, v, gi)) continue;
        if (depends(pl, producer(pl, v), gs)) return false;
    }
    return true;
}

/* May elementwise node n join group gi? */
static bool can_join(planner *pl, int gi, const gj_jit_node *n, const gj_rt_meta *om) {
    const pgroup *G = &pl->groups[gi];
    if (G->is_copy || !same_shape(G->ndim, G->shape, om->ndim, om->shape) || remat_apart(G, n))
        return false;
    return inputs_allow(pl, gi, n->inst.n_in, n->in);
}

/* Merges group b into group a when both run over the same space, neither
 * is a copy, their reductions agree, and neither depends on the other (so
 * the merged instruction cannot close a cycle). Returns 0 (merged or not) or -1
 * (OOM). */
static int merge_groups(planner *pl, int a, int b) {
    pgroup *A = &pl->groups[a], *B = &pl->groups[b];
    if (a == b || A->dead || B->dead || A->is_copy || B->is_copy ||
        !same_shape(A->ndim, A->shape, B->ndim, B->shape) || (A->has_fwd && B->has_apart) ||
        (A->has_apart && B->has_fwd))
        return 0;
    if (A->has_red && B->has_red &&
        (A->red_axes != B->red_axes || !same_red_order(&A->ord, &B->ord)))
        return 0;
    if (A->has_red != B->has_red) { /* keep enough parallel rows (see plan_sum) */
        uint32_t ax = A->has_red ? A->red_axes : B->red_axes;
        int64_t kept = 1;
        for (int d = 0; d < A->ndim; d++)
            if (!((ax >> d) & 1u)) kept *= A->shape[d];
        if (kept < 64 && numel_of(A->ndim, A->shape) > 65536) return 0;
    }
    if (depends(pl, A->instr, B->instr) || depends(pl, B->instr, A->instr)) return 0;
    /* members in node order (a topological order) */
    int n = A->n + B->n;
    int *nodes = gj_rt_malloc((size_t)(n + 1) * sizeof *nodes);
    if (!nodes) return gj_jit_pl_oom(pl);
    int i = 0, j = 0, t = 0;
    while (i < A->n || j < B->n)
        nodes[t++] = (j >= B->n || (i < A->n && A->nodes[i] < B->nodes[j])) ? A->nodes[i++]
                                                                            : B->nodes[j++];
    gj_rt_free(A->nodes);
    A->nodes = nodes;
    A->n = A->cap = n;
    gj_rt_free(B->nodes);
    B->nodes = NULL;
    B->n = B->cap = 0;
    B->dead = true;
    A->has_fwd |= B->has_fwd;
    A->has_apart |= B->has_apart;
    for (int k = 0; k < B->n_recomp; k++) { /* what B computed again, A now does */
        if (recomputes(pl, a, B->recomp[k])) continue;
        if (gj_jit_grow((void **)&A->recomp, A->n_recomp, &A->cap_recomp, sizeof *A->recomp) != 0)
            return gj_jit_pl_oom(pl);
        A->recomp[A->n_recomp++] = B->recomp[k];
    }
    gj_rt_free(B->recomp);
    B->recomp = NULL;
    B->n_recomp = B->cap_recomp = 0;
    if (B->has_red) {
        A->has_red = true;
        A->red_axes = B->red_axes;
        A->ord = B->ord;
    }
    if (B->first >= 0 && (A->first < 0 || B->first < A->first)) A->first = B->first;
    int sa = A->instr, sb = B->instr;
    if (pl->ps[sb].pos < pl->ps[sa].pos) pl->ps[sa].pos = pl->ps[sb].pos;
    for (int v = 0; v < pl->g->n_values; v++)
        if (pl->vi[v].kind == V_FUSED && pl->vi[v].group == b) pl->vi[v].group = a;
    for (int q = 0; q < pl->p->n_bufs; q++)
        if (pl->p->bufs[q].writer == sb) pl->p->bufs[q].writer = sa;
    for (int k = 0; k < pl->ps[sb].n_deps; k++)
        if (add_dep(pl, sa, pl->ps[sb].deps[k]) != 0) return gj_jit_pl_oom(pl);
    pl->ps[sb].n_deps = 0;
    pl->ps[sb].kind = PS_DEAD;
    for (int s2 = 0; s2 < pl->n_ps; s2++) {
        pinstr *x = &pl->ps[s2];
        int w = 0;
        bool has_a = false;
        for (int k = 0; k < x->n_deps; k++) {
            int d = x->deps[k] == sb ? sa : x->deps[k];
            if (d == s2 || (d == sa && has_a)) continue;
            if (d == sa) has_a = true;
            bool dup = false;
            for (int q = 0; q < w; q++) dup |= x->deps[q] == d;
            if (!dup) x->deps[w++] = d;
        }
        x->n_deps = w;
    }
    return 0;
}

/* Records that group gi reads in[0..n_in). 0 or -1 (OOM). */
static int group_reads(planner *pl, int gi, int n_in, const int *in) {
    for (int k = 0; k < n_in; k++) {
        int v = in[k];
        if (pl->vi[v].kind == V_CONST || is_member_of(pl, v, gi)) continue;
        if (add_dep(pl, pl->groups[gi].instr, producer(pl, v)) != 0) return gj_jit_pl_oom(pl);
    }
    return 0;
}

/* Is the elementwise node n supported by the kernel generator? */
static const char *elementwise_unsupported(planner *pl, const gj_jit_node *n) {
    gj_dtype od = vmeta(pl, n->out[0])->dtype;
    gj_rt_prim p = n->inst.prim;
    if (p == GJ_P_CAST || p == GJ_P_COPY || p == GJ_P_WHERE || p == GJ_P_EQ) return NULL;
    if (od == GJ_I64) return "on i64";
    for (int k = 0; k < n->inst.n_in; k++)
        if (vmeta(pl, n->in[k])->dtype == GJ_I64) return "on i64";
    return NULL;
}

/* The input of elementwise node n that n's output equals bit for bit, or
 * -1: x * 1 (MUL by a constant 1, or MUL_SCALAR 1) of the output's dtype and
 * shape where x is a contiguous view of a temporary read by nothing else (the
 * backward's scale of a gradient when the loss's seed is 1). x * 1 is x for
 * every value (-0 and NaN included), and a contiguous view is what eager's
 * fresh output would be, so later reductions take the same order. */
static int identity_input(planner *pl, const gj_jit_node *n) {
    gj_rt_prim p = n->inst.prim;
    int x = -1;
    if (p == GJ_P_MUL_SCALAR && n->inst.scalar == 1.0) {
        x = 0;
    } else if (p == GJ_P_MUL && n->inst.n_in == 2) {
        gj_dtype od = vmeta(pl, n->out[0])->dtype;
        for (int k = 0; k < 2 && x < 0; k++) {
            const vinfo *c = &pl->vi[n->in[k]];
            if (c->kind == V_CONST && c->cval == 1.0 && vmeta(pl, n->in[k])->dtype == od) x = 1 - k;
        }
    }
    if (x < 0) return -1;
    int v = n->in[x];
    const gj_rt_meta *om = vmeta(pl, n->out[0]), *m = vmeta(pl, v);
    const vinfo *xi = &pl->vi[v];
    if (pl->uses[v] != 1 || !gj_jit_meta_equal(m, om) || xi->kind != V_VIEW || xi->buf < 0 ||
        pl->p->bufs[xi->buf].kind != GJ_JIT_BUF_TEMP)
        return -1;
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(m->ndim, m->shape, cs);
    for (int k = 0; k < m->ndim; k++)
        if (m->shape[k] > 1 && xi->strides[k] != cs[k]) return -1;
    return x;
}

static int plan_elementwise(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]);
    const char *bad = elementwise_unsupported(pl, n);
    if (bad) return gj_jit_pl_no_lowering(pl, n, bad);
    int same = identity_input(pl, n);
    if (same >= 0) { /* no instruction: the output is its input */
        pl->vi[n->out[0]] = pl->vi[n->in[same]];
        return 0;
    }
    int gi = -1;
    for (int k = 0; k < n->inst.n_in && gi < 0; k++) {
        const vinfo *x = &pl->vi[n->in[k]];
        if (x->kind == V_FUSED && can_join(pl, x->group, n, om)) gi = x->group;
    }
    if (gi < 0) {
        gi = new_group(pl, om->ndim, om->shape, i, 2 * (int64_t)i + 1);
        if (gi < 0) return gj_jit_pl_oom(pl);
    }
    pl->groups[gi].has_fwd |= n->phase == 0; /* (before the merges below) */
    pl->groups[gi].has_apart |= n->apart;
    /* operands computed by other, independent groups over the same space:
     * merge those groups into this one instead of materialising, unless an
     * input of n is produced by an instruction depending on that group */
    for (int k = 0; k < n->inst.n_in; k++) {
        const vinfo *x = &pl->vi[n->in[k]];
        if (x->kind != V_FUSED || x->group == gi) continue;
        int h = x->group;
        bool ok = true;
        for (int q = 0; q < n->inst.n_in && ok; q++) {
            int u = n->in[q];
            if (pl->vi[u].kind == V_CONST || is_member_of(pl, u, gi) || is_member_of(pl, u, h))
                continue;
            ok = !depends(pl, producer(pl, u), pl->groups[h].instr);
        }
        if (ok && merge_groups(pl, gi, h) != 0) return -1;
    }
    for (int k = 0; k < n->inst.n_in; k++) {
        int v = n->in[k];
        if (pl->vi[v].kind == V_FUSED && pl->vi[v].group != gi && need_value(pl, gi, v) != 0)
            return -1;
    }
    if (group_reads(pl, gi, n->inst.n_in, n->in) != 0) return -1;
    if (group_add(pl, &pl->groups[gi], i) != 0) return gj_jit_pl_oom(pl);
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_FUSED;
    o->group = gi;
    o->buf = -1;
    return 0;
}

/* SUM or MAX: joins the group of its input (or a recent group reducing the
 * same axes over the same space in the same order), stores into a new
 * temporary. The eager kernel's order of the sum (red_order) follows the
 * strides of the tensor it reads: a value computed in a group is a fresh
 * contiguous tensor in eager, a view has its view's strides, a constant
 * the layout its FILL and views gave it. A group's reductions share one
 * order, which its kernel's loops follow (plan_kernel.c). */
static int plan_reduce(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    int x = n->in[0];
    const gj_rt_meta *xm = vmeta(pl, x), *om = vmeta(pl, n->out[0]);
    const vinfo *xi = &pl->vi[x];
    uint32_t axes = n->inst.axes;
    if (xm->dtype == GJ_I64) return gj_jit_pl_no_lowering(pl, n, "on i64");
    int64_t est[GJ_MAX_DIMS];
    if (xi->kind == V_FUSED) contig_strides(xm->ndim, xm->shape, est);
    else memcpy(est, xi->strides, sizeof est);
    red_order ord;
    gj_jit_pl_red_order(xm->ndim, xm->shape, est, axes, &ord);

    int gi = -1;
    /* Fusing a reduction into a big group makes the group run over the
     * reduction's outputs: only do it when that leaves enough parallel rows. */
    bool fusable = numel_of(om->ndim, om->shape) >= 64 || numel_of(xm->ndim, xm->shape) <= 65536;
    if (xi->kind == V_FUSED && fusable) {
        const pgroup *G = &pl->groups[xi->group];
        if (same_shape(G->ndim, G->shape, xm->ndim, xm->shape) &&
            (!G->has_red || (G->red_axes == axes && same_red_order(&G->ord, &ord))) &&
            !G->is_copy && !remat_apart(G, n))
            gi = xi->group;
    }
    for (int c = pl->n_groups - 1; c >= 0 && c >= pl->n_groups - 16 && gi < 0; c--) {
        const pgroup *G = &pl->groups[c];
        if (fusable && !G->dead && !G->is_copy && !remat_apart(G, n) && G->has_red &&
            G->red_axes == axes &&
            same_red_order(&G->ord, &ord) && same_shape(G->ndim, G->shape, xm->ndim, xm->shape) &&
            inputs_allow(pl, c, 1, &x))
            gi = c;
    }
    if (gi < 0) {
        gi = new_group(pl, xm->ndim, xm->shape, i, 2 * (int64_t)i + 1);
        if (gi < 0) return gj_jit_pl_oom(pl);
    }
    if (xi->kind == V_FUSED && xi->group != gi && need_value(pl, gi, x) != 0) return -1;
    if (group_reads(pl, gi, 1, &x) != 0) return -1;
    pgroup *G = &pl->groups[gi];
    G->has_red = true;
    G->red_axes = axes;
    G->ord = ord;
    if (group_add(pl, G, i) != 0) return gj_jit_pl_oom(pl);
    int b = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (b < 0) return gj_jit_pl_oom(pl);
    pl->p->bufs[b].writer = G->instr;
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_VIEW;
    o->buf = b;
    o->offset = 0;
    contig_strides(om->ndim, om->shape, o->strides);
    return 0;
}

/* Operand v of a matmul as a BLAS-compatible view (copying it first when
 * its layout is not one). *transposed: stored as the transpose. */
static int blas_operand(planner *pl, int v, int i, int *buf, int64_t *off, int64_t *ld,
                        bool *transposed, int64_t *strides) {
    const gj_rt_meta *m = vmeta(pl, v);
    vinfo *x = &pl->vi[v];
    if (x->kind == V_FUSED && materialize(pl, v) != 0) return -1;
    int nd = m->ndim;
    int64_t R = m->shape[nd - 2], C = m->shape[nd - 1];
    bool ok = false;
    bool real = x->kind == V_FUSED || (x->kind == V_VIEW && !buf_virtual(&pl->p->bufs[x->buf]));
    if (real) { /* the eager matmul's layout rule (kernels_matmul.c) */
        int64_t sr = x->strides[nd - 2], sc = x->strides[nd - 1];
        int64_t c1 = C > 1 ? C : 1, r1 = R > 1 ? R : 1;
        if ((sc == 1 || C <= 1) && (R <= 1 || sr >= c1)) {
            *transposed = false;
            *ld = R <= 1 ? c1 : sr;
            ok = true;
        } else if ((sr == 1 || R <= 1) && (C <= 1 || sc >= r1)) {
            *transposed = true;
            *ld = C <= 1 ? r1 : sc;
            ok = true;
        }
    }
    if (!ok) {
        int b = copy_to_buffer(pl, v, -1, GJ_JIT_BUF_TEMP, -1, 2 * (int64_t)i);
        if (b < 0) return -1;
        *buf = b;
        *off = 0;
        *ld = C > 1 ? C : 1;
        *transposed = false;
        contig_strides(nd, m->shape, strides);
        return 0;
    }
    *buf = x->buf;
    *off = x->offset;
    memcpy(strides, x->strides, sizeof x->strides);
    return 0;
}

static int plan_matmul(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *am = vmeta(pl, n->in[0]), *bm = vmeta(pl, n->in[1]),
                     *om = vmeta(pl, n->out[0]);
    if (om->dtype != GJ_F32 && om->dtype != GJ_F64)
        return gj_jit_pl_no_lowering(pl, n, om->dtype == GJ_BF16 ? "on bf16" : "on i64");
    if (am->dtype != om->dtype && !(n->inst.wide && am->dtype == GJ_BF16))
        return gj_jit_pl_no_lowering(pl, n, "with mixed dtypes");
    if (am->ndim < 2 || bm->ndim < 2) return gj_jit_pl_no_lowering(pl, n, "with fewer than 2 dims");
    gj_jit_matmul mm;
    memset(&mm, 0, sizeof mm);
    int64_t ast[GJ_MAX_DIMS], bst[GJ_MAX_DIMS];
    bool atr, btr;
    if (blas_operand(pl, n->in[0], i, &mm.a_buf, &mm.a_off, &mm.lda, &atr, ast) != 0) return -1;
    if (blas_operand(pl, n->in[1], i, &mm.b_buf, &mm.b_off, &mm.ldb, &btr, bst) != 0) return -1;
    mm.dtype = om->dtype;
    mm.bf16 = am->dtype == GJ_BF16;
    mm.ta = n->inst.ta != atr;
    mm.tb = n->inst.tb != btr;
    mm.M = om->shape[om->ndim - 2];
    mm.N = om->shape[om->ndim - 1];
    mm.K = n->inst.ta ? am->shape[am->ndim - 2] : am->shape[am->ndim - 1];
    mm.nb = om->ndim - 2;
    for (int k = 0; k < mm.nb; k++) {
        mm.bshape[k] = om->shape[k];
        int sa = k - (om->ndim - am->ndim), sb = k - (om->ndim - bm->ndim);
        mm.a_bstr[k] = (sa < 0 || am->shape[sa] == 1) ? 0 : ast[sa];
        mm.b_bstr[k] = (sb < 0 || bm->shape[sb] == 1) ? 0 : bst[sb];
    }
    mm.c_buf = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (mm.c_buf < 0) return gj_jit_pl_oom(pl);
    if (gj_jit_grow((void **)&pl->mms, pl->n_mm, &pl->cap_mm, sizeof *pl->mms) != 0) return gj_jit_pl_oom(pl);
    int sid = new_pinstr(pl, PS_MATMUL, pl->n_mm, 2 * (int64_t)i + 1);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->mms[pl->n_mm++] = mm;
    if (add_dep(pl, sid, pl->p->bufs[mm.a_buf].writer) != 0 ||
        add_dep(pl, sid, pl->p->bufs[mm.b_buf].writer) != 0)
        return gj_jit_pl_oom(pl);
    instr_output(pl, sid, mm.c_buf, n->out[0]);
    return 0;
}

static int plan_movement(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    int x = n->in[0];
    const gj_rt_meta *im = vmeta(pl, x), *om = vmeta(pl, n->out[0]);
    vinfo *o = &pl->vi[n->out[0]];
    if (pl->vi[x].kind == V_CONST) { /* (strides: its layout in eager, see plan_reduce) */
        o->kind = V_CONST;
        o->cval = pl->vi[x].cval;
        vinfo cin = pl->vi[x];
        if (!gj_jit_pl_fold_view(&n->inst, im, &cin, om, o)) /* eager copies: contiguous */
            contig_strides(om->ndim, om->shape, o->strides);
        o->offset = 0;
        return 0;
    }
    if (pl->vi[x].kind == V_FUSED && materialize(pl, x) != 0) return -1;
    vinfo xin = pl->vi[x];
    if (!gj_jit_pl_fold_view(&n->inst, im, &xin, om, o)) {
        /* RESHAPE of a layout that cannot be viewed: copy, then view */
        int b = copy_to_buffer(pl, x, -1, GJ_JIT_BUF_TEMP, -1, 2 * (int64_t)i);
        if (b < 0) return -1;
        xin.buf = b;
        xin.offset = 0;
        contig_strides(im->ndim, im->shape, xin.strides);
        if (!gj_jit_pl_fold_view(&n->inst, im, &xin, om, o)) return gj_jit_pl_no_lowering(pl, n, "(view)");
    }
    o->kind = V_VIEW;
    o->buf = xin.buf;
    return 0;
}

/* v as a contiguous real buffer starting at element 0: its own buffer when
 * it already is one, else a copy made at position 2i. */
static int contiguous_operand(planner *pl, int v, int i, int *buf) {
    const gj_rt_meta *m = vmeta(pl, v);
    vinfo *x = &pl->vi[v];
    if (x->kind == V_FUSED && materialize(pl, v) != 0) return -1;
    bool ok = x->kind != V_CONST && x->buf >= 0 && !buf_virtual(&pl->p->bufs[x->buf]) &&
              x->offset == 0;
    if (ok) {
        int64_t cs[GJ_MAX_DIMS];
        contig_strides(m->ndim, m->shape, cs);
        for (int k = 0; k < m->ndim && ok; k++)
            if (m->shape[k] > 1 && x->strides[k] != cs[k]) ok = false;
    }
    if (ok) {
        *buf = x->buf;
        return 0;
    }
    int b = copy_to_buffer(pl, v, -1, GJ_JIT_BUF_TEMP, -1, 2 * (int64_t)i);
    if (b < 0) return -1;
    *buf = b;
    return 0;
}

/* An operand read dense in place: a real buffer whose view is row-major
 * contiguous from some element offset, else a contiguous copy. 0 or -1. */
static int dense_operand(planner *pl, int v, int i, int *buf, int64_t *off) {
    const gj_rt_meta *m = vmeta(pl, v);
    vinfo *x = &pl->vi[v];
    if (x->kind == V_FUSED && materialize(pl, v) != 0) return -1;
    bool ok = x->kind != V_CONST && x->buf >= 0 && !buf_virtual(&pl->p->bufs[x->buf]);
    if (ok) {
        int64_t cs[GJ_MAX_DIMS];
        contig_strides(m->ndim, m->shape, cs);
        for (int k = 0; k < m->ndim && ok; k++)
            if (m->shape[k] > 1 && x->strides[k] != cs[k]) ok = false;
    }
    *off = ok ? x->offset : 0;
    if (ok) {
        *buf = x->buf;
        return 0;
    }
    return contiguous_operand(pl, v, i, buf);
}

/* GATHER_ROWS (table[V, D] viewed in place when it is a real buffer) and
 * SCATTER_ADD_ROWS (src contiguous): one index instruction each (plan.h). */
static int plan_index(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]), *sm = vmeta(pl, n->in[0]),
                     *im = vmeta(pl, n->in[1]);
    if (sm->dtype == GJ_I64) return gj_jit_pl_no_lowering(pl, n, "on i64");
    if (im->dtype != GJ_I64) return gj_jit_pl_no_lowering(pl, n, "with float indices");
    gj_jit_index ix;
    memset(&ix, 0, sizeof ix);
    ix.scatter = n->inst.prim == GJ_P_SCATTER_ADD_ROWS;
    ix.dtype = om->dtype;
    ix.n = numel_of(im->ndim, im->shape);
    if (ix.scatter) {
        ix.V = n->inst.len;
        ix.D = om->shape[1];
        if (contiguous_operand(pl, n->in[0], i, &ix.src_buf) != 0) return -1;
        ix.src_s0 = ix.D;
        ix.src_s1 = 1;
    } else {
        ix.V = sm->shape[0];
        ix.D = sm->shape[1];
        vinfo *t = &pl->vi[n->in[0]];
        if (t->kind == V_FUSED && materialize(pl, n->in[0]) != 0) return -1;
        if (t->kind != V_CONST && t->buf >= 0 && !buf_virtual(&pl->p->bufs[t->buf])) {
            ix.src_buf = t->buf;
            ix.src_off = t->offset;
            ix.src_s0 = t->strides[0];
            ix.src_s1 = t->strides[1];
        } else {
            if (contiguous_operand(pl, n->in[0], i, &ix.src_buf) != 0) return -1;
            ix.src_s0 = ix.D;
            ix.src_s1 = 1;
        }
    }
    if (contiguous_operand(pl, n->in[1], i, &ix.idx_buf) != 0) return -1;
    ix.out_buf = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (ix.out_buf < 0) return gj_jit_pl_oom(pl);
    if (gj_jit_grow((void **)&pl->ixs, pl->n_ix, &pl->cap_ix, sizeof *pl->ixs) != 0) return gj_jit_pl_oom(pl);
    int sid = new_pinstr(pl, PS_INDEX, pl->n_ix, 2 * (int64_t)i + 1);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->ixs[pl->n_ix++] = ix;
    if (add_dep(pl, sid, pl->p->bufs[ix.src_buf].writer) != 0 ||
        add_dep(pl, sid, pl->p->bufs[ix.idx_buf].writer) != 0)
        return gj_jit_pl_oom(pl);
    instr_output(pl, sid, ix.out_buf, n->out[0]);
    return 0;
}

/* IM2COL / COL2IM: one fold instruction (plan.h) reading its source in place
 * through a strided view when that is a real buffer (a fused value is
 * materialised first; a constant or a virtual buffer is copied). */
static int plan_fold(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    int v = n->in[0];
    const gj_rt_meta *sm = vmeta(pl, v), *om = vmeta(pl, n->out[0]);
    gj_jit_fold fd;
    memset(&fd, 0, sizeof fd);
    fd.col2im = n->inst.prim == GJ_P_COL2IM;
    fd.dtype = om->dtype;
    fd.pad = n->inst.scalar;
    if (sm->dtype == GJ_I64) return gj_jit_pl_no_lowering(pl, n, "on i64");
    if (!gj_rt_win_of(&n->inst, sm, &fd.win)) return gj_jit_pl_no_lowering(pl, n, "(geometry)");
    vinfo *x = &pl->vi[v];
    if (x->kind == V_FUSED && materialize(pl, v) != 0) return -1;
    if (x->kind != V_CONST && x->buf >= 0 && !buf_virtual(&pl->p->bufs[x->buf])) {
        fd.src_buf = x->buf;
        fd.src_off = x->offset;
        for (int k = 0; k < sm->ndim; k++) fd.src_st[k] = sm->shape[k] > 1 ? x->strides[k] : 0;
    } else {
        if (contiguous_operand(pl, v, i, &fd.src_buf) != 0) return -1;
        contig_strides(sm->ndim, sm->shape, fd.src_st);
    }
    fd.out_buf = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (fd.out_buf < 0) return gj_jit_pl_oom(pl);
    if (gj_jit_grow((void **)&pl->fds, pl->n_fd, &pl->cap_fd, sizeof *pl->fds) != 0) return gj_jit_pl_oom(pl);
    int sid = new_pinstr(pl, PS_FOLD, pl->n_fd, 2 * (int64_t)i + 1);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->fds[pl->n_fd++] = fd;
    if (add_dep(pl, sid, pl->p->bufs[fd.src_buf].writer) != 0) return gj_jit_pl_oom(pl);
    instr_output(pl, sid, fd.out_buf, n->out[0]);
    return 0;
}

/* An attention operand: a real buffer read in place through its view when
 * the last dim is contiguous (a head's slice of a fused qkv product), else
 * a contiguous copy. Sets *buf, the element offset and the strides over
 * (b, h, t). 0 or -1. */
static int attn_operand(planner *pl, int v, int i, int *buf, int64_t *off, int64_t *st) {
    const gj_rt_meta *m = vmeta(pl, v);
    vinfo *x = &pl->vi[v];
    if (x->kind == V_FUSED && materialize(pl, v) != 0) return -1;
    if (x->kind != V_CONST && x->buf >= 0 && !buf_virtual(&pl->p->bufs[x->buf]) &&
        (m->shape[3] <= 1 || x->strides[3] == 1)) {
        *buf = x->buf;
        *off = x->offset;
        for (int d = 0; d < 3; d++) st[d] = x->strides[d];
        return 0;
    }
    if (contiguous_operand(pl, v, i, buf) != 0) return -1;
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(4, m->shape, cs);
    *off = 0;
    for (int d = 0; d < 3; d++) st[d] = cs[d];
    return 0;
}

/* ATTN_FWD / ATTN_BWD: one attention kernel (plan.h, gj_jit_kernel.attn)
 * over q, k, v (and o, go, lse) read in place, writing new contiguous
 * outputs (and, backward, its workspace, a temporary of this instruction
 * alone). Dropout inside attention is not lowered: its stream is the
 * run's, which only DROPOUT_MASK instructions take today. */
static int plan_attn(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    bool fwd = n->inst.prim == GJ_P_ATTN_FWD;
    if (n->inst.scalar2 > 0) return gj_jit_pl_no_lowering(pl, n, "with dropout");
    pattn at;
    memset(&at, 0, sizeof at);
    at.prim = n->inst.prim;
    const gj_rt_meta *q = vmeta(pl, n->in[0]), *k = vmeta(pl, n->in[1]), *v = vmeta(pl, n->in[2]);
    at.dtype = q->dtype;
    int64_t *gi = at.gi;
    gi[GJ_ATTN_GI_B] = q->shape[0];
    gi[GJ_ATTN_GI_H] = q->shape[1];
    gi[GJ_ATTN_GI_T] = q->shape[2];
    gi[GJ_ATTN_GI_S] = k->shape[2];
    gi[GJ_ATTN_GI_D] = q->shape[3];
    gi[GJ_ATTN_GI_E] = v->shape[3];
    gi[GJ_ATTN_GI_CAUSAL] = n->inst.keepdim;
    memcpy(&gi[GJ_ATTN_GI_SCALE], &n->inst.scalar, sizeof(double));
    memcpy(&gi[GJ_ATTN_GI_P], &n->inst.scalar2, sizeof(double));
    int strided = fwd ? 3 : 5; /* q k v (o go): in place where their rows are contiguous */
    for (int a = 0; a < strided; a++)
        if (attn_operand(pl, n->in[a], i, &at.bufs[a], &gi[GJ_ATTN_GI_OFF + a],
                         &gi[GJ_ATTN_GI_QS + 3 * a]) != 0)
            return -1;
    if (!fwd && contiguous_operand(pl, n->in[5], i, &at.bufs[5]) != 0) return -1; /* lse */
    int first_out = fwd ? 3 : 6, n_out = fwd ? 2 : 3;
    for (int o = 0; o < n_out; o++) {
        const gj_rt_meta *om = vmeta(pl, n->out[o]);
        at.bufs[first_out + o] =
            gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
        if (at.bufs[first_out + o] < 0) return gj_jit_pl_oom(pl);
    }
    at.n_bufs = first_out + n_out;
    at.units = gj_attn_units_of(fwd, gi[GJ_ATTN_GI_B], gi[GJ_ATTN_GI_H], gi[GJ_ATTN_GI_T]);
    if (!fwd) { /* the workspace: accumulators of every (b, h) unit */
        int64_t ws = at.units * gj_attn_ws_of(gi[GJ_ATTN_GI_T], gi[GJ_ATTN_GI_D], gi[GJ_ATTN_GI_E]);
        at.bufs[at.n_bufs] = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1,
                                               at.dtype == GJ_F64 ? GJ_F64 : GJ_F32, ws);
        if (at.bufs[at.n_bufs++] < 0) return gj_jit_pl_oom(pl);
    }
    if (gj_jit_grow((void **)&pl->ats, pl->n_at, &pl->cap_at, sizeof *pl->ats) != 0) return gj_jit_pl_oom(pl);
    int sid = new_pinstr(pl, PS_ATTN, pl->n_at, 2 * (int64_t)i + 1);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->ats[pl->n_at++] = at;
    for (int a = 0; a < first_out; a++)
        if (add_dep(pl, sid, pl->p->bufs[at.bufs[a]].writer) != 0) return gj_jit_pl_oom(pl);
    for (int o = 0; o < n_out; o++) instr_output(pl, sid, at.bufs[first_out + o], n->out[o]);
    if (!fwd) pl->p->bufs[at.bufs[at.n_bufs - 1]].writer = sid;
    return 0;
}

/* LCE_FWD: one linear cross-entropy instruction (plan.h, gj_jit_lce)
 * reading h, w, labels (and b) in place where they are dense, writing
 * new contiguous temporaries: the loss and, with gradients, gh, gw (, gb). */
static int plan_lce(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *h = vmeta(pl, n->in[0]), *w = vmeta(pl, n->in[1]);
    gj_jit_lce lc;
    memset(&lc, 0, sizeof lc);
    lc.dtype = h->dtype;
    lc.grad = n->inst.keepdim;
    lc.N = h->shape[0];
    lc.C = h->shape[1];
    lc.V = w->shape[0];
    lc.ignore = n->inst.start;
    lc.b_buf = -1;
    int *ib[4] = {&lc.h_buf, &lc.w_buf, &lc.lab_buf, &lc.b_buf};
    int64_t *io[4] = {&lc.h_off, &lc.w_off, &lc.lab_off, &lc.b_off};
    for (int a = 0; a < n->inst.n_in; a++)
        if (dense_operand(pl, n->in[a], i, ib[a], io[a]) != 0) return -1;
    int n_out = !lc.grad ? 1 : n->inst.n_in == 4 ? 4 : 3;
    for (int o = 0; o < 4; o++) {
        lc.out_buf[o] = -1;
        if (o >= n_out) continue;
        const gj_rt_meta *om = vmeta(pl, n->out[o]);
        lc.out_buf[o] = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
        if (lc.out_buf[o] < 0) return gj_jit_pl_oom(pl);
    }
    if (gj_jit_grow((void **)&pl->lcs, pl->n_lc, &pl->cap_lc, sizeof *pl->lcs) != 0) return gj_jit_pl_oom(pl);
    int sid = new_pinstr(pl, PS_LCE, pl->n_lc, 2 * (int64_t)i + 1);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->lcs[pl->n_lc++] = lc;
    for (int a = 0; a < n->inst.n_in; a++)
        if (add_dep(pl, sid, pl->p->bufs[*ib[a]].writer) != 0) return gj_jit_pl_oom(pl);
    for (int o = 0; o < n_out; o++) instr_output(pl, sid, lc.out_buf[o], n->out[o]);
    return 0;
}

/* A tensor hook call (node.hook >= 0): the input as a contiguous buffer, a
 * new contiguous temporary for the value flowing on, one hook instruction after
 * the previous hook instruction (the engine's order of hook calls). */
static int plan_hook(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    gj_jit_hook_instr hk;
    memset(&hk, 0, sizeof hk);
    hk.hook = n->hook;
    hk.meta = *vmeta(pl, n->out[0]);
    if (contiguous_operand(pl, n->in[0], i, &hk.src_buf) != 0) return -1;
    hk.out_buf = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, hk.meta.dtype,
                         numel_of(hk.meta.ndim, hk.meta.shape));
    if (hk.out_buf < 0) return gj_jit_pl_oom(pl);
    if (gj_jit_grow((void **)&pl->hks, pl->n_hk, &pl->cap_hk, sizeof *pl->hks) != 0) return gj_jit_pl_oom(pl);
    int sid = new_pinstr(pl, PS_HOOK, pl->n_hk, 2 * (int64_t)i + 1);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->hks[pl->n_hk++] = hk;
    if (add_dep(pl, sid, pl->p->bufs[hk.src_buf].writer) != 0 ||
        add_dep(pl, sid, pl->last_hook_instr) != 0)
        return gj_jit_pl_oom(pl);
    pl->last_hook_instr = sid;
    instr_output(pl, sid, hk.out_buf, n->out[0]);
    return 0;
}

/* A custom op's backward (or forward) call (node.custom >= 0): every input as a
 * contiguous buffer, a new contiguous temporary per output, one call instruction
 * after the previous hook or call instruction (the engine's order). */
static int plan_custom(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    gj_jit_call_instr cs;
    memset(&cs, 0, sizeof cs);
    cs.node = n->custom;
    cs.args = n->custom_args;
    cs.tape = n->custom_tape;
    cs.fwd = n->custom_fwd;
    cs.n_in = n->inst.n_in;
    cs.n_out = n->n_out;
    if (cs.n_in > GJ_JIT_CALL_MAX_IN) {
        snprintf(pl->why, pl->why_cap, "no lowering for a custom call with %d inputs", cs.n_in);
        gj_rt_set_error("jit plan: %s", pl->why);
        return -1;
    }
    for (int k = 0; k < cs.n_in; k++) {
        cs.in_meta[k] = *vmeta(pl, n->in[k]);
        if (contiguous_operand(pl, n->in[k], i, &cs.src_buf[k]) != 0) return -1;
    }
    for (int k = 0; k < cs.n_out; k++) {
        cs.out_meta[k] = *vmeta(pl, n->out[k]);
        cs.out_buf[k] = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, cs.out_meta[k].dtype,
                                numel_of(cs.out_meta[k].ndim, cs.out_meta[k].shape));
        if (cs.out_buf[k] < 0) return gj_jit_pl_oom(pl);
    }
    if (gj_jit_grow((void **)&pl->cls, pl->n_cl, &pl->cap_cl, sizeof *pl->cls) != 0) return gj_jit_pl_oom(pl);
    int64_t pos = 2 * (int64_t)i + 1;
    if (cs.tape == GJ_JIT_CALL_GIVE || cs.tape == GJ_JIT_CALL_POST) {
        /* a reducer's give (or the post-accumulate hooks, which may give)
         * goes as soon as its gradient is final (its collective then runs
         * while the backward goes on): the position of the latest
         * instruction it waits for */
        pos = 0;
        int dep[GJ_JIT_CALL_MAX_IN + 1], nd = 0;
        for (int k = 0; k < cs.n_in; k++) dep[nd++] = pl->p->bufs[cs.src_buf[k]].writer;
        dep[nd++] = pl->last_hook_instr;
        for (int k = 0; k < nd; k++)
            if (dep[k] >= 0 && pl->ps[dep[k]].pos > pos) pos = pl->ps[dep[k]].pos;
    }
    int sid = new_pinstr(pl, PS_CALL, pl->n_cl, pos);
    if (sid < 0) return gj_jit_pl_oom(pl);
    pl->cls[pl->n_cl++] = cs;
    for (int k = 0; k < cs.n_in; k++)
        if (add_dep(pl, sid, pl->p->bufs[cs.src_buf[k]].writer) != 0) return gj_jit_pl_oom(pl);
    if (add_dep(pl, sid, pl->last_hook_instr) != 0) return gj_jit_pl_oom(pl);
    pl->last_hook_instr = sid;
    for (int k = 0; k < cs.n_out; k++) instr_output(pl, sid, cs.out_buf[k], n->out[k]);
    return 0;
}

/* PAD and CAT: a new buffer whose regions are written by the producers of
 * the pieces (stored in place when they are fused values, else copied), and
 * for PAD zero fills of the regions before and after its piece. The writers
 * cover disjoint regions; a barrier instruction joins them, so readers of
 * the result depend on all of them. */
static int plan_pad_cat(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]);
    int ax = n->inst.axis < 0 ? n->inst.axis + om->ndim : n->inst.axis;
    if (ax < 0 || ax >= om->ndim) return gj_jit_pl_no_lowering(pl, n, "(axis)");
    int b = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (b < 0) return gj_jit_pl_oom(pl);
    int barrier = new_pinstr(pl, PS_BARRIER, -1, 2 * (int64_t)i + 1);
    if (barrier < 0) return gj_jit_pl_oom(pl);
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(om->ndim, om->shape, cs);
    if (n->inst.prim == GJ_P_PAD) {
        int64_t len = vmeta(pl, n->in[0])->shape[ax], start = n->inst.start;
        int64_t gap_at[2] = {0, start + len}, gap_len[2] = {start, om->shape[ax] - start - len};
        for (int q = 0; q < 2; q++) {
            if (gap_len[q] <= 0) continue;
            int64_t gs[GJ_MAX_DIMS];
            memcpy(gs, om->shape, sizeof gs);
            gs[ax] = gap_len[q];
            int fill = copy_into(pl, -1, 0.0, om->ndim, gs, b, gap_at[q] * cs[ax], cs, 2 * (int64_t)i);
            if (fill < 0) return -1;
            if (add_dep(pl, barrier, fill) != 0) return gj_jit_pl_oom(pl);
        }
    }
    int64_t at = n->inst.prim == GJ_P_PAD ? n->inst.start : 0;
    for (int k = 0; k < n->inst.n_in; k++) {
        int v = n->in[k];
        int w = place_into(pl, v, b, at * cs[ax], cs, 2 * (int64_t)i);
        if (w < 0) return -1;
        if (add_dep(pl, barrier, w) != 0) return gj_jit_pl_oom(pl);
        at += vmeta(pl, v)->shape[ax];
    }
    pl->p->bufs[b].writer = barrier;
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_VIEW;
    o->buf = b;
    o->offset = 0;
    memcpy(o->strides, cs, sizeof cs);
    return 0;
}

static int plan_generator(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]);
    vinfo *o = &pl->vi[n->out[0]];
    if (n->inst.prim == GJ_P_FILL) {
        o->kind = V_CONST;
        o->cval = n->inst.scalar;
        contig_strides(om->ndim, om->shape, o->strides); /* eager's fresh tensor */
        return 0;
    }
    int64_t ne = numel_of(om->ndim, om->shape);
    int b;
    if (n->inst.prim == GJ_P_IOTA) {
        int ax = n->inst.axis < 0 ? n->inst.axis + om->ndim : n->inst.axis;
        if (ax < 0 || ax >= om->ndim) return gj_jit_pl_no_lowering(pl, n, "(axis)");
        b = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_IOTA, -1, om->dtype, ne);
        if (b < 0) return gj_jit_pl_oom(pl);
        pl->p->bufs[b].gen_len = om->shape[ax];
        pl->p->bufs[b].gen_inner = numel_of(om->ndim - ax - 1, om->shape + ax + 1);
        if (pl->p->bufs[b].gen_inner < 1) pl->p->bufs[b].gen_inner = 1;
        if (pl->p->bufs[b].gen_len < 1) pl->p->bufs[b].gen_len = 1;
    } else {
        if (om->dtype == GJ_I64) return gj_jit_pl_no_lowering(pl, n, "on i64");
        b = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_DROPOUT, -1, om->dtype, ne);
        if (b < 0) return gj_jit_pl_oom(pl);
        /* constants only when not run-time: this instruction's seed and offset must
         * not enter the plan (kernel names, the disk cache's plan compare) */
        pl->p->bufs[b].gen_seed = n->rt_node >= 0 ? 0 : n->inst.seed;
        pl->p->bufs[b].gen_offset = n->rt_node >= 0 ? 0 : n->inst.rng_offset;
        pl->p->bufs[b].gen_p = n->inst.scalar;
        if (n->rt_node >= 0) { /* seed and offset read at run time */
            gj_jit_plan *p = pl->p;
            if (p->params_buf < 0) {
                p->params_buf = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_PARAMS, -1, GJ_I64, 0);
                if (p->params_buf < 0) return gj_jit_pl_oom(pl);
            }
            int *q = gj_rt_realloc(p->rt_param_node, (size_t)(p->n_rt_params + 1) * sizeof *q);
            if (!q) return gj_jit_pl_oom(pl);
            p->rt_param_node = q;
            q[p->n_rt_params] = n->rt_node;
            q = gj_rt_realloc(p->rt_param_tape, (size_t)(p->n_rt_params + 1) * sizeof *q);
            if (!q) return gj_jit_pl_oom(pl);
            p->rt_param_tape = q;
            q[p->n_rt_params] = n->rt_tape;
            pl->p->bufs[b].gen_param = p->n_rt_params++;
            p->bufs[p->params_buf].numel = 2 * (int64_t)p->n_rt_params;
        }
    }
    pl->p->bufs[b].nbytes = 0;
    o->kind = V_VIEW;
    o->buf = b;
    o->offset = 0;
    contig_strides(om->ndim, om->shape, o->strides);
    return 0;
}

/* In-place output o whose value is ADD(.grad, m) with m the whole result
 * of a matmul used nowhere else: let the GEMM accumulate into .grad
 * (beta = 1) and drop the ADD's kernel. true if done. */
static bool gemm_accumulate(planner *pl, const gj_jit_output *o, int dst) {
    const gj_jit_graph *g = pl->g;
    int v = o->value;
    const vinfo *x = &pl->vi[v];
    if (x->kind != V_FUSED || g->values[v].node < 0) return false;
    const gj_jit_node *n = &g->nodes[g->values[v].node];
    pgroup *G = &pl->groups[x->group];
    if (n->inst.prim != GJ_P_ADD || G->n != 1 || G->has_red || G->is_copy) return false;
    if (n->in[0] != g->inputs[o->grad_input].value) return false;
    int mv = n->in[1];
    const vinfo *mi = &pl->vi[mv];
    const gj_rt_meta *mm_meta = vmeta(pl, mv), *gm = vmeta(pl, v);
    if (mi->kind != V_VIEW || pl->uses[mv] != 1 || mi->offset != 0 ||
        !gj_jit_meta_equal(mm_meta, gm))
        return false;
    /* the whole matmul result, as laid out by the GEMM (not a broadcast or
     * permuted view of it) */
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(gm->ndim, gm->shape, cs);
    for (int k = 0; k < gm->ndim; k++)
        if (gm->shape[k] > 1 && mi->strides[k] != cs[k]) return false;
    if (pl->p->bufs[mi->buf].numel != numel_of(gm->ndim, gm->shape)) return false;
    int w = pl->p->bufs[mi->buf].writer;
    if (w < 0 || pl->ps[w].kind != 1) return false;
    gj_jit_matmul *mm = &pl->mms[pl->ps[w].idx];
    if (mm->c_buf != mi->buf || mm->accumulate) return false;
    mm->c_buf = dst;
    mm->accumulate = true;
    pl->p->bufs[dst].writer = w;
    G->dead = true;
    pl->ps[G->instr].kind = PS_DEAD;
    pl->ps[G->instr].n_deps = 0;
    return true;
}

/* The values group instruction s reads, each passed to fn(c, value, s):
 * its members' and recomputed nodes' inputs, or a copy group's source. A
 * group reads buffer b exactly when one of them is a view of b. */
static void group_reads_each(const planner *pl, int s, void (*fn)(void *, int, int), void *c) {
    const pgroup *G = &pl->groups[pl->ps[s].idx];
    if (G->is_copy) {
        if (G->copy_src >= 0) fn(c, G->copy_src, s);
        return;
    }
    for (int k = 0; k < G->n + G->n_recomp; k++) {
        int node = k < G->n ? G->nodes[k] : pl->g->values[G->recomp[k - G->n]].node;
        if (node < 0) continue;
        const gj_jit_node *n = &pl->g->nodes[node];
        for (int j = 0; j < n->inst.n_in; j++) fn(c, n->in[j], s);
    }
}

typedef struct view_of {
    const planner *pl;
    int b;
    bool found;
} view_of;

static void note_view_of(void *c, int u, int s) {
    (void)s;
    view_of *q = c;
    const vinfo *x = &q->pl->vi[u];
    if (x->kind == V_VIEW && x->buf == q->b) q->found = true;
}

/* Whether planned instruction s reads buffer b. */
static bool instr_reads_buf(const planner *pl, int s, int b) {
    const pinstr *x = &pl->ps[s];
    switch (x->kind) {
    case PS_GROUP: {
        view_of q = {pl, b, false};
        group_reads_each(pl, s, note_view_of, &q);
        return q.found;
    }
    case PS_MATMUL: return pl->mms[x->idx].a_buf == b || pl->mms[x->idx].b_buf == b;
    case PS_INDEX: return pl->ixs[x->idx].src_buf == b || pl->ixs[x->idx].idx_buf == b;
    case PS_FOLD: return pl->fds[x->idx].src_buf == b;
    case PS_ATTN: {
        const pattn *at = &pl->ats[x->idx];
        int n_in = at->prim == GJ_P_ATTN_FWD ? 3 : 6;
        for (int k = 0; k < n_in; k++)
            if (at->bufs[k] == b) return true;
        return false;
    }
    case PS_LCE: {
        const gj_jit_lce *lc = &pl->lcs[x->idx];
        return lc->h_buf == b || lc->w_buf == b || lc->lab_buf == b || lc->b_buf == b;
    }
    case PS_HOOK: return pl->hks[x->idx].src_buf == b;
    case PS_CALL:
        for (int k = 0; k < pl->cls[x->idx].n_in; k++)
            if (pl->cls[x->idx].src_buf[k] == b) return true;
        return false;
    default: return false;
    }
}

/* Which group instructions read which value, for gj_jit_pl_outputs' many
 * "who reads buffer b" questions (one per output and pass: a step of N
 * layers has O(N) outputs and O(N) instructions, and asking each group
 * through its nodes made the question quadratic; 24 layers of GPT-2 spent
 * about 0.3 s there). A group reads b exactly when one of its node inputs
 * (members, recomputed nodes) or its copy source is a view of b, and group
 * membership does not change while outputs are placed; the values'
 * buffers do (an output moved into a buffer), so the values are read at
 * each question. Instructions added after the index (copies) and the
 * other kinds are asked directly (instr_reads_buf; both go through
 * group_reads_each). */
typedef struct group_readers {
    int n0, n_vals;
    int *start, *list; /* value u: group instructions list[start[u] .. start[u + 1]) */
    int *hit, stamp;   /* per instruction: the stamp of the question it reads for */
} group_readers;

static void gr_count(void *c, int u, int s) {
    (void)s;
    ((group_readers *)c)->start[u + 1]++;
}

static void gr_fill(void *c, int u, int s) {
    group_readers *r = c;
    r->list[r->hit[u]++] = s; /* (hit: the fill cursors while building) */
}

static int group_readers_build(const planner *pl, group_readers *r) {
    memset(r, 0, sizeof *r);
    r->n0 = pl->n_ps;
    r->n_vals = pl->g->n_values;
    int cap = r->n0 > r->n_vals ? r->n0 : r->n_vals;
    r->start = gj_rt_calloc((size_t)r->n_vals + 2, sizeof *r->start);
    r->hit = gj_rt_calloc((size_t)cap + 1, sizeof *r->hit);
    if (!r->start || !r->hit) return -1;
    for (int s = 0; s < r->n0; s++)
        if (pl->ps[s].kind == PS_GROUP) group_reads_each(pl, s, gr_count, r);
    for (int u = 0; u < r->n_vals; u++) r->start[u + 1] += r->start[u];
    r->list = gj_rt_calloc((size_t)r->start[r->n_vals] + 1, sizeof *r->list);
    if (!r->list) return -1;
    for (int u = 0; u < r->n_vals; u++) r->hit[u] = r->start[u];
    for (int s = 0; s < r->n0; s++)
        if (pl->ps[s].kind == PS_GROUP) group_reads_each(pl, s, gr_fill, r);
    memset(r->hit, 0, ((size_t)cap + 1) * sizeof *r->hit);
    return 0;
}

static void group_readers_free(group_readers *r) {
    gj_rt_free(r->start);
    gj_rt_free(r->list);
    gj_rt_free(r->hit);
}

/* Marks the indexed group instructions that read buffer b now. */
static void group_readers_ask(const planner *pl, group_readers *r, int b) {
    r->stamp++;
    for (int u = 0; u < r->n_vals; u++) {
        const vinfo *x = &pl->vi[u];
        if (x->kind != V_VIEW || x->buf != b) continue;
        for (int i = r->start[u]; i < r->start[u + 1]; i++) r->hit[r->list[i]] = r->stamp;
    }
}

/* instr_reads_buf(pl, s, b) after group_readers_ask(pl, r, b). */
static bool reads_buf(const planner *pl, const group_readers *r, int s, int b) {
    if (s < r->n0 && pl->ps[s].kind == PS_GROUP) return r->hit[s] == r->stamp;
    return instr_reads_buf(pl, s, b);
}

/* Whether instruction w may write buffer b in place: not when another instruction that
 * reads b depends on w already (w would have to come both before and after
 * it). A training step's fused kernel can hold both a parameter's update
 * and a value that a reader of the old parameter needs. */
static bool may_write_in_place(planner *pl, group_readers *r, int w, int b) {
    group_readers_ask(pl, r, b);
    for (int s = 0; s < pl->n_ps; s++) {
        if (s == w || pl->ps[s].kind == PS_DEAD || !reads_buf(pl, r, s, b)) continue;
        if (depends(pl, s, w)) return false;
    }
    return true;
}

/* An output written in place into input buffer b (a .grad, or a training
 * step's parameter and optimizer state) overwrites what other steps read:
 * the writing instruction comes after every other instruction that reads b. 0 or -1. */
static int after_readers(planner *pl, group_readers *r, int b) {
    int w = pl->p->bufs[b].writer;
    if (w < 0) return 0;
    group_readers_ask(pl, r, b);
    for (int s = 0; s < pl->n_ps; s++) {
        if (s == w || pl->ps[s].kind == PS_DEAD || !reads_buf(pl, r, s, b)) continue;
        if (add_dep(pl, w, s) != 0) return gj_jit_pl_oom(pl);
    }
    return 0;
}

static int place_outputs(planner *pl, group_readers *r);

int gj_jit_pl_outputs(planner *pl) {
    group_readers r;
    int rc = group_readers_build(pl, &r) != 0 ? gj_jit_pl_oom(pl) : place_outputs(pl, &r);
    group_readers_free(&r);
    return rc;
}

/* gj_jit_pl_outputs: each output's buffer (in place where it can be). */
static int place_outputs(planner *pl, group_readers *r) {
    const gj_jit_graph *g = pl->g;
    gj_jit_plan *p = pl->p;
    int64_t pos = 2 * (int64_t)g->n_nodes + 2;
    for (int oi = 0; oi < g->n_outputs; oi++) {
        const gj_jit_output *o = &g->outputs[oi];
        int v = o->value;
        vinfo *x = &pl->vi[v];
        const gj_rt_meta *m = vmeta(pl, v);
        p->out_meta[oi] = *m;
        int64_t ne = numel_of(m->ndim, m->shape);
        int dst = -1;
        if (o->grad_input >= 0) {
            dst = o->grad_input; /* input buffers are ids 0..n_inputs-1 */
            if (gemm_accumulate(pl, o, dst)) {
                /* the GEMM writes .grad += a @ b itself */
            } else if (x->kind == V_FUSED && x->buf < 0 &&
                       may_write_in_place(pl, r, pl->groups[x->group].instr, dst)) {
                x->buf = dst;
                x->offset = 0;
                contig_strides(m->ndim, m->shape, x->strides);
                p->bufs[dst].writer = pl->groups[x->group].instr;
            } else if (copy_to_buffer(pl, v, dst, GJ_JIT_BUF_TEMP, -1, pos++) < 0) {
                return -1;
            }
            /* its readers first; decided output by output, so that the next
             * output's may_write_in_place sees these orderings too */
            if (after_readers(pl, r, dst) != 0) return -1;
        } else if (x->kind == V_FUSED && x->buf < 0) {
            dst = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_OUTPUT, oi, m->dtype, ne);
            if (dst < 0) return gj_jit_pl_oom(pl);
            x->buf = dst;
            x->offset = 0;
            contig_strides(m->ndim, m->shape, x->strides);
            p->bufs[dst].writer = pl->groups[x->group].instr;
        } else {
            int64_t cs[GJ_MAX_DIMS];
            contig_strides(m->ndim, m->shape, cs);
            bool whole = (x->kind == V_VIEW || x->kind == V_FUSED) && x->buf >= 0 &&
                         p->bufs[x->buf].kind == GJ_JIT_BUF_TEMP && x->offset == 0 &&
                         p->bufs[x->buf].numel == ne && p->bufs[x->buf].dtype == m->dtype;
            for (int k = 0; k < m->ndim && whole; k++)
                if (m->shape[k] > 1 && x->strides[k] != cs[k]) whole = false;
            if (whole) {
                dst = x->buf;
                p->bufs[dst].kind = GJ_JIT_BUF_OUTPUT;
                p->bufs[dst].index = oi;
            } else {
                dst = copy_to_buffer(pl, v, -1, GJ_JIT_BUF_OUTPUT, oi, pos++);
                if (dst < 0) return -1;
            }
        }
        p->out_buf[oi] = dst;
    }
    /* again, for copies made after an output's decision that read its
     * buffer (add_dep skips the orderings already there) */
    for (int oi = 0; oi < g->n_outputs; oi++)
        if (g->outputs[oi].grad_input >= 0 && after_readers(pl, r, g->outputs[oi].grad_input) != 0)
            return -1;
    return 0;
}

/* Test switch: a primitive the planner refuses (-1: none). */
static atomic_int g_refused_prim = -1;

void gj_jit_test_no_lowering(int prim) { atomic_store(&g_refused_prim, prim < 0 ? -1 : prim); }

int gj_jit_pl_node(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    gj_rt_prim pr = n->inst.prim;
    if (n->custom >= 0) return plan_custom(pl, i);
    if (n->hook >= 0) return plan_hook(pl, i);
    if ((int)pr == atomic_load(&g_refused_prim)) return gj_jit_pl_no_lowering(pl, n, "(test switch)");
    if (pr == GJ_P_FILL || pr == GJ_P_IOTA || pr == GJ_P_DROPOUT_MASK) return plan_generator(pl, i);
    if (gj_jit_prim_is_movement(pr)) return plan_movement(pl, i);
    if (gj_jit_prim_is_elementwise(pr)) return plan_elementwise(pl, i);
    if (pr == GJ_P_SUM || pr == GJ_P_MAX) return plan_reduce(pl, i);
    if (pr == GJ_P_MATMUL) return plan_matmul(pl, i);
    if (pr == GJ_P_PAD || pr == GJ_P_CAT) return plan_pad_cat(pl, i);
    if (pr == GJ_P_GATHER_ROWS || pr == GJ_P_SCATTER_ADD_ROWS) return plan_index(pl, i);
    if (pr == GJ_P_IM2COL || pr == GJ_P_COL2IM) return plan_fold(pl, i);
    if (pr == GJ_P_ATTN_FWD || pr == GJ_P_ATTN_BWD) return plan_attn(pl, i);
    if (pr == GJ_P_LCE_FWD) return plan_lce(pl, i);
    return gj_jit_pl_no_lowering(pl, n, NULL);
}
