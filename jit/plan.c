/* SPDX-License-Identifier: MIT */
/*
 * plan.c - from a captured graph to an execution plan: view folding,
 * elementwise fusion with trailing reductions, BLAS steps, graph outputs,
 * the schedule of every kernel and the memory plan (buffer lifetimes).
 *
 * Value classes while planning (one per graph value):
 *   VIEW  - a strided view of a buffer (graph inputs, BLAS and reduction
 *           results, movement ops folded into index maps, virtual buffers);
 *   CONST - a FILL (a scalar broadcast anywhere, never stored);
 *   FUSED - computed inside a fused group at each element of the group's
 *           iteration space; it gets a buffer ("materialised") only when
 *           something outside the group needs it.
 *
 * Steps (fused groups, matmuls, index ops) form a dependency graph: a step depends on
 * the steps that write the buffers it reads. Fusion invariant: a node may
 * join group G only if each of its inputs is a constant, an elementwise
 * member of G, or produced by a step that does not depend on G (so the
 * step graph stays acyclic). Reductions join the group of their input (if
 * it has the same iteration space and no reduction over other axes yet);
 * nothing consumes a reduction's result inside the group that produced it.
 * Steps run in a topological order of that graph, ties broken by the
 * position of their first node (emission order), which keeps lifetimes
 * short.
 */
#include "plan.h"

#include <stdlib.h>
#include <string.h>

typedef enum vkind { V_UNSET = 0, V_VIEW, V_CONST, V_FUSED } vkind;

typedef struct vinfo {
    vkind kind;
    int buf; /* VIEW: buffer; FUSED: buffer once materialised, else -1 */
    int64_t offset;
    int64_t strides[GJ_MAX_DIMS]; /* over the value's own shape */
    double cval;
    int group; /* FUSED: its group */
} vinfo;

typedef struct pgroup {
    int ndim;
    int64_t shape[GJ_MAX_DIMS];
    int first;
    int64_t pos;
    int *nodes; /* members and SUMs, in order */
    int n, cap;
    bool has_red;
    uint32_t red_axes;
    bool is_copy;           /* a copy group: value (or constant) -> a view of a buffer */
    int copy_src;           /* the value, or -1: the constant copy_cval */
    double copy_cval;
    int copy_dst;           /* destination buffer, written at */
    int64_t copy_off;       /* offset copy_off with strides copy_st over shape */
    int64_t copy_st[GJ_MAX_DIMS];
    int step;               /* its pstep */
    bool dead;              /* merged into another group */
} pgroup;

/* A step while planning: a group or a matmul, with its dependencies. */
/* What a planned step will be. */
typedef enum pstep_kind {
    PS_GROUP = 0,   /* a fused elementwise group: a kernel */
    PS_MATMUL = 1,  /* a BLAS call */
    PS_BARRIER = 2, /* no code: joins several writers of one value */
    PS_DEAD = 3,    /* merged into another group */
    PS_INDEX = 4,   /* gather / scatter-add of rows */
    PS_HOOK = 5,    /* a tensor hook call */
    PS_CALL = 6,    /* a custom op's backward call */
    PS_FOLD = 7     /* an im2col / col2im */
} pstep_kind;

typedef struct pstep {
    pstep_kind kind;
    int idx;  /* group or matmul index */
    int64_t pos;
    int *deps;
    int n_deps, cap_deps;
    int mark;
} pstep;

typedef struct planner {
    const gj_jit_graph *g;
    gj_jit_plan *p;
    vinfo *vi;
    pgroup *groups;
    int n_groups, cap_groups;
    gj_jit_matmul *mms;
    int n_mm, cap_mm;
    gj_jit_index *ixs;
    int n_ix, cap_ix;
    gj_jit_hookstep *hks;
    int n_hk, cap_hk;
    gj_jit_callstep *cls;
    int n_cl, cap_cl;
    gj_jit_fold *fds;
    int n_fd, cap_fd;
    int last_hook_step; /* -1, or the pstep of the latest hook or custom call */
    pstep *ps;
    int n_ps, cap_ps;
    int *uses; /* per value: node inputs and graph outputs reading it */
    int mark_gen;
    int *stack;
    char *why;
    size_t why_cap;
} planner;

/* ------------------------------------------------------------ helpers */

static int grow(void **arr, int n, int *cap, size_t sz) {
    if (n < *cap) return 0;
    int nc = *cap ? *cap * 2 : 16;
    void *q = gj_rt_realloc(*arr, (size_t)nc * sz);
    if (!q) return -1;
    *arr = q;
    *cap = nc;
    return 0;
}

static void contig_strides(int nd, const int64_t *shape, int64_t *st) {
    int64_t s = 1;
    for (int k = nd - 1; k >= 0; k--) {
        st[k] = s;
        s *= shape[k] > 0 ? shape[k] : 1;
    }
}

static int64_t numel_of(int nd, const int64_t *shape) {
    int64_t n = 1;
    for (int k = 0; k < nd; k++) n *= shape[k];
    return n;
}

static bool same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
    if (na != nb) return false;
    for (int k = 0; k < na; k++)
        if (a[k] != b[k]) return false;
    return true;
}

static int oom(planner *pl) {
    snprintf(pl->why, pl->why_cap, "out of memory while planning");
    return -1;
}

static int no_lowering(planner *pl, const gj_jit_node *n, const char *detail) {
    snprintf(pl->why, pl->why_cap, "no lowering for %s%s%s", gj_rt_prim_name(n->inst.prim),
             detail ? " " : "", detail ? detail : "");
    gj_rt_set_error("jit: %s", pl->why);
    return -1;
}

static const gj_rt_meta *vmeta(planner *pl, int v) { return &pl->g->values[v].meta; }

/* New buffer; returns its id or -1. */
static int new_buf(planner *pl, gj_jit_buf_kind kind, int index, gj_dtype dt, int64_t numel) {
    gj_jit_plan *p = pl->p;
    if (grow((void **)&p->bufs, p->n_bufs, &p->cap_bufs, sizeof *p->bufs) != 0) return -1;
    gj_jit_buffer *b = &p->bufs[p->n_bufs];
    memset(b, 0, sizeof *b);
    b->kind = kind;
    b->index = index;
    b->dtype = dt;
    b->numel = numel;
    b->nbytes = (size_t)numel * gj_rt_dtype_size(dt);
    b->first_step = b->last_step = -1;
    b->writer = -1;
    b->gen_param = -1;
    return p->n_bufs++;
}

static bool buf_virtual(const gj_jit_buffer *b) {
    return b->kind == GJ_JIT_BUF_IOTA || b->kind == GJ_JIT_BUF_DROPOUT;
}

/* New pstep; returns its id or -1 (OOM). */
static int new_pstep(planner *pl, pstep_kind kind, int idx, int64_t pos) {
    int old_cap = pl->cap_ps;
    if (grow((void **)&pl->ps, pl->n_ps, &pl->cap_ps, sizeof *pl->ps) != 0) return -1;
    if (pl->cap_ps != old_cap || !pl->stack) {
        int *st = gj_rt_realloc(pl->stack, (size_t)pl->cap_ps * sizeof *st);
        if (!st) return -1;
        pl->stack = st;
    }
    pstep *s = &pl->ps[pl->n_ps];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->idx = idx;
    s->pos = pos;
    return pl->n_ps++;
}

/* Step s reads something step d writes. 0 or -1 (OOM). */
static int add_dep(planner *pl, int s, int d) {
    if (d < 0 || d == s) return 0;
    pstep *x = &pl->ps[s];
    for (int k = 0; k < x->n_deps; k++)
        if (x->deps[k] == d) return 0;
    if (grow((void **)&x->deps, x->n_deps, &x->cap_deps, sizeof *x->deps) != 0) return -1;
    x->deps[x->n_deps++] = d;
    return 0;
}

/* Does step s depend (transitively) on step t? */
static bool depends(planner *pl, int s, int t) {
    if (s < 0) return false;
    if (s == t) return true;
    int gen = ++pl->mark_gen, top = 0;
    pl->stack[top++] = s;
    pl->ps[s].mark = gen;
    while (top > 0) {
        const pstep *x = &pl->ps[pl->stack[--top]];
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

/* The step producing value v (-1: a graph input, constant or generator). */
static int producer(planner *pl, int v) {
    const vinfo *x = &pl->vi[v];
    if (x->kind == V_CONST) return -1;
    if (x->kind == V_FUSED) return pl->groups[x->group].step;
    return x->buf >= 0 ? pl->p->bufs[x->buf].writer : -1;
}

/* Gives FUSED value v a contiguous buffer of its own if it has none. */
static int materialize(planner *pl, int v) {
    vinfo *x = &pl->vi[v];
    if (x->kind != V_FUSED || x->buf >= 0) return 0;
    const gj_rt_meta *m = vmeta(pl, v);
    int b = new_buf(pl, GJ_JIT_BUF_TEMP, -1, m->dtype, numel_of(m->ndim, m->shape));
    if (b < 0) return oom(pl);
    x->buf = b;
    x->offset = 0;
    contig_strides(m->ndim, m->shape, x->strides);
    pl->p->bufs[b].writer = pl->groups[x->group].step;
    return 0;
}

static int new_group(planner *pl, int ndim, const int64_t *shape, int first, int64_t pos) {
    if (grow((void **)&pl->groups, pl->n_groups, &pl->cap_groups, sizeof *pl->groups) != 0)
        return -1;
    pgroup *G = &pl->groups[pl->n_groups];
    memset(G, 0, sizeof *G);
    G->ndim = ndim;
    memcpy(G->shape, shape, (size_t)ndim * sizeof *shape);
    G->first = first;
    G->pos = pos;
    G->copy_src = -1;
    G->copy_dst = -1;
    G->step = new_pstep(pl, PS_GROUP, pl->n_groups, pos);
    if (G->step < 0) return -1;
    return pl->n_groups++;
}

static int group_add(pgroup *G, int node) {
    if (grow((void **)&G->nodes, G->n, &G->cap, sizeof *G->nodes) != 0) return -1;
    G->nodes[G->n++] = node;
    return 0;
}

/* A copy group over shape (nd, shape) writing value src (or, src < 0, the
 * constant cval) into buffer dst at offset off with strides st. Returns its
 * step or -1. Does not set the buffer's writer. */
static int copy_into(planner *pl, int src, double cval, int nd, const int64_t *shape, int dst,
                     int64_t off, const int64_t *st, int64_t pos) {
    if (src >= 0 && pl->vi[src].kind == V_FUSED && materialize(pl, src) != 0) return -1;
    int gi = new_group(pl, nd, shape, -1, pos);
    if (gi < 0) return oom(pl);
    pgroup *G = &pl->groups[gi];
    G->is_copy = true;
    G->copy_src = src;
    G->copy_cval = cval;
    G->copy_dst = dst;
    G->copy_off = off;
    memcpy(G->copy_st, st, (size_t)nd * sizeof *st);
    if (src >= 0 && add_dep(pl, G->step, producer(pl, src)) != 0) return oom(pl);
    return G->step;
}

/* A copy group writing value src (VIEW or CONST) into a new contiguous
 * buffer dst (or the given one when dst >= 0) at position pos. Returns the
 * buffer, or -1. */
static int copy_to_buffer(planner *pl, int src, int dst, gj_jit_buf_kind kind, int index,
                          int64_t pos) {
    const gj_rt_meta *m = vmeta(pl, src);
    if (dst < 0) {
        dst = new_buf(pl, kind, index, m->dtype, numel_of(m->ndim, m->shape));
        if (dst < 0) return oom(pl);
    }
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(m->ndim, m->shape, cs);
    int sid = copy_into(pl, src, 0.0, m->ndim, m->shape, dst, 0, cs, pos);
    if (sid < 0) return -1;
    pl->p->bufs[dst].writer = sid;
    return dst;
}

/* Makes value v appear in buffer b at offset off with strides st (over v's
 * shape): an unmaterialised fused value is stored there by its own group;
 * anything else is copied. Returns the writing step, or -1. */
static int place_into(planner *pl, int v, int b, int64_t off, const int64_t *st, int64_t pos) {
    vinfo *x = &pl->vi[v];
    const gj_rt_meta *m = vmeta(pl, v);
    if (x->kind == V_FUSED && x->buf < 0) {
        x->buf = b;
        x->offset = off;
        memcpy(x->strides, st, (size_t)m->ndim * sizeof *st);
        return pl->groups[x->group].step;
    }
    return copy_into(pl, v, 0.0, m->ndim, m->shape, b, off, st, pos);
}

/* ------------------------------------------------------- view folding */

/* torch's stride computation for a view with a new shape; false if the
 * strided layout cannot express it. */
static bool reshape_strides(int on, const int64_t *oshape, const int64_t *ostr, int nn,
                            const int64_t *nshape, int64_t *nstr) {
    if (numel_of(on, oshape) == 0 || on == 0) {
        contig_strides(nn, nshape, nstr);
        return true;
    }
    int view_d = nn - 1;
    int64_t chunk = ostr[on - 1], tnum = 1, vnum = 1;
    for (int td = on - 1; td >= 0; td--) {
        tnum *= oshape[td];
        if (td == 0 || (oshape[td - 1] != 1 && ostr[td - 1] != tnum * chunk)) {
            while (view_d >= 0 && (vnum < tnum || nshape[view_d] == 1)) {
                nstr[view_d] = vnum * chunk;
                vnum *= nshape[view_d];
                view_d--;
            }
            if (vnum != tnum) return false;
            if (td > 0) {
                chunk = ostr[td - 1];
                tnum = 1;
                vnum = 1;
            }
        }
    }
    return view_d == -1;
}

/* out = movement inst applied to view in (shape im -> om). false if not
 * expressible (RESHAPE of an incompatible layout). */
static bool fold_view(const gj_rt_inst *inst, const gj_rt_meta *im, const vinfo *in,
                      const gj_rt_meta *om, vinfo *out) {
    out->offset = in->offset;
    switch (inst->prim) {
    case GJ_P_PERMUTE:
        for (int k = 0; k < om->ndim; k++) out->strides[k] = in->strides[inst->shape[k]];
        return true;
    case GJ_P_EXPAND: {
        int lead = om->ndim - im->ndim;
        for (int k = 0; k < om->ndim; k++) {
            int s = k - lead;
            out->strides[k] = (s < 0 || (im->shape[s] == 1 && om->shape[k] != 1))
                                  ? 0
                                  : in->strides[s];
        }
        return true;
    }
    case GJ_P_SLICE: {
        int ax = inst->axis < 0 ? inst->axis + im->ndim : inst->axis;
        memcpy(out->strides, in->strides, sizeof out->strides);
        out->offset = in->offset + inst->start * in->strides[ax];
        return true;
    }
    case GJ_P_RESHAPE:
        return reshape_strides(im->ndim, im->shape, in->strides, om->ndim, om->shape,
                               out->strides);
    default:
        return false;
    }
}

/* ---------------------------------------------------------- the nodes */

static bool is_member_of(planner *pl, int v, int gi) {
    return pl->vi[v].kind == V_FUSED && pl->vi[v].group == gi;
}

/* May a node reading in[0..n_in) join group gi without a cycle? */
static bool inputs_allow(planner *pl, int gi, int n_in, const int *in) {
    int gs = pl->groups[gi].step;
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
    if (G->is_copy || !same_shape(G->ndim, G->shape, om->ndim, om->shape)) return false;
    return inputs_allow(pl, gi, n->inst.n_in, n->in);
}

/* Merges group b into group a when both run over the same space, neither
 * is a copy, their reductions agree, and neither depends on the other (so
 * the merged step cannot close a cycle). Returns 0 (merged or not) or -1
 * (OOM). */
static int merge_groups(planner *pl, int a, int b) {
    pgroup *A = &pl->groups[a], *B = &pl->groups[b];
    if (a == b || A->dead || B->dead || A->is_copy || B->is_copy ||
        !same_shape(A->ndim, A->shape, B->ndim, B->shape))
        return 0;
    if (A->has_red && B->has_red && A->red_axes != B->red_axes) return 0;
    if (A->has_red != B->has_red) { /* keep enough parallel rows (see plan_sum) */
        uint32_t ax = A->has_red ? A->red_axes : B->red_axes;
        int64_t kept = 1;
        for (int d = 0; d < A->ndim; d++)
            if (!((ax >> d) & 1u)) kept *= A->shape[d];
        if (kept < 64 && numel_of(A->ndim, A->shape) > 65536) return 0;
    }
    if (depends(pl, A->step, B->step) || depends(pl, B->step, A->step)) return 0;
    /* members in node order (a topological order) */
    int n = A->n + B->n;
    int *nodes = gj_rt_malloc((size_t)(n + 1) * sizeof *nodes);
    if (!nodes) return oom(pl);
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
    if (B->has_red) {
        A->has_red = true;
        A->red_axes = B->red_axes;
    }
    if (B->first >= 0 && (A->first < 0 || B->first < A->first)) A->first = B->first;
    int sa = A->step, sb = B->step;
    if (pl->ps[sb].pos < pl->ps[sa].pos) pl->ps[sa].pos = pl->ps[sb].pos;
    for (int v = 0; v < pl->g->n_values; v++)
        if (pl->vi[v].kind == V_FUSED && pl->vi[v].group == b) pl->vi[v].group = a;
    for (int q = 0; q < pl->p->n_bufs; q++)
        if (pl->p->bufs[q].writer == sb) pl->p->bufs[q].writer = sa;
    for (int k = 0; k < pl->ps[sb].n_deps; k++)
        if (add_dep(pl, sa, pl->ps[sb].deps[k]) != 0) return oom(pl);
    pl->ps[sb].n_deps = 0;
    pl->ps[sb].kind = PS_DEAD;
    for (int s2 = 0; s2 < pl->n_ps; s2++) {
        pstep *x = &pl->ps[s2];
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
        if (add_dep(pl, pl->groups[gi].step, producer(pl, v)) != 0) return oom(pl);
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

static int plan_elementwise(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]);
    const char *bad = elementwise_unsupported(pl, n);
    if (bad) return no_lowering(pl, n, bad);
    int gi = -1;
    for (int k = 0; k < n->inst.n_in && gi < 0; k++) {
        const vinfo *x = &pl->vi[n->in[k]];
        if (x->kind == V_FUSED && can_join(pl, x->group, n, om)) gi = x->group;
    }
    if (gi < 0) {
        gi = new_group(pl, om->ndim, om->shape, i, 2 * (int64_t)i + 1);
        if (gi < 0) return oom(pl);
    }
    /* operands computed by other, independent groups over the same space:
     * merge those groups into this one instead of materialising, unless an
     * input of n is produced by a step depending on that group */
    for (int k = 0; k < n->inst.n_in; k++) {
        const vinfo *x = &pl->vi[n->in[k]];
        if (x->kind != V_FUSED || x->group == gi) continue;
        int h = x->group;
        bool ok = true;
        for (int q = 0; q < n->inst.n_in && ok; q++) {
            int u = n->in[q];
            if (pl->vi[u].kind == V_CONST || is_member_of(pl, u, gi) || is_member_of(pl, u, h))
                continue;
            ok = !depends(pl, producer(pl, u), pl->groups[h].step);
        }
        if (ok && merge_groups(pl, gi, h) != 0) return -1;
    }
    for (int k = 0; k < n->inst.n_in; k++) {
        int v = n->in[k];
        if (pl->vi[v].kind == V_FUSED && pl->vi[v].group != gi && materialize(pl, v) != 0)
            return -1;
    }
    if (group_reads(pl, gi, n->inst.n_in, n->in) != 0) return -1;
    if (group_add(&pl->groups[gi], i) != 0) return oom(pl);
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_FUSED;
    o->group = gi;
    o->buf = -1;
    return 0;
}

/* SUM or MAX: joins the group of its input (or a recent group reducing the
 * same axes over the same space), stores into a new temporary. */
static int plan_reduce(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    int x = n->in[0];
    const gj_rt_meta *xm = vmeta(pl, x), *om = vmeta(pl, n->out[0]);
    const vinfo *xi = &pl->vi[x];
    uint32_t axes = n->inst.axes;
    if (xm->dtype == GJ_I64) return no_lowering(pl, n, "on i64");

    int gi = -1;
    /* Fusing a reduction into a big group makes the group run over the
     * reduction's outputs: only do it when that leaves enough parallel rows. */
    bool fusable = numel_of(om->ndim, om->shape) >= 64 || numel_of(xm->ndim, xm->shape) <= 65536;
    if (xi->kind == V_FUSED && fusable) {
        const pgroup *G = &pl->groups[xi->group];
        if (same_shape(G->ndim, G->shape, xm->ndim, xm->shape) &&
            (!G->has_red || G->red_axes == axes) && !G->is_copy)
            gi = xi->group;
    }
    for (int c = pl->n_groups - 1; c >= 0 && c >= pl->n_groups - 16 && gi < 0; c--) {
        const pgroup *G = &pl->groups[c];
        if (fusable && !G->dead && !G->is_copy && G->has_red && G->red_axes == axes &&
            same_shape(G->ndim, G->shape, xm->ndim, xm->shape) && inputs_allow(pl, c, 1, &x))
            gi = c;
    }
    if (gi < 0) {
        gi = new_group(pl, xm->ndim, xm->shape, i, 2 * (int64_t)i + 1);
        if (gi < 0) return oom(pl);
    }
    if (xi->kind == V_FUSED && xi->group != gi && materialize(pl, x) != 0) return -1;
    if (group_reads(pl, gi, 1, &x) != 0) return -1;
    pgroup *G = &pl->groups[gi];
    G->has_red = true;
    G->red_axes = axes;
    if (group_add(G, i) != 0) return oom(pl);
    int b = new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (b < 0) return oom(pl);
    pl->p->bufs[b].writer = G->step;
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
        return no_lowering(pl, n, om->dtype == GJ_BF16 ? "on bf16" : "on i64");
    if (am->ndim < 2 || bm->ndim < 2) return no_lowering(pl, n, "with fewer than 2 dims");
    gj_jit_matmul mm;
    memset(&mm, 0, sizeof mm);
    int64_t ast[GJ_MAX_DIMS], bst[GJ_MAX_DIMS];
    bool atr, btr;
    if (blas_operand(pl, n->in[0], i, &mm.a_buf, &mm.a_off, &mm.lda, &atr, ast) != 0) return -1;
    if (blas_operand(pl, n->in[1], i, &mm.b_buf, &mm.b_off, &mm.ldb, &btr, bst) != 0) return -1;
    mm.dtype = om->dtype;
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
    mm.c_buf = new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (mm.c_buf < 0) return oom(pl);
    if (grow((void **)&pl->mms, pl->n_mm, &pl->cap_mm, sizeof *pl->mms) != 0) return oom(pl);
    int sid = new_pstep(pl, PS_MATMUL, pl->n_mm, 2 * (int64_t)i + 1);
    if (sid < 0) return oom(pl);
    pl->mms[pl->n_mm++] = mm;
    if (add_dep(pl, sid, pl->p->bufs[mm.a_buf].writer) != 0 ||
        add_dep(pl, sid, pl->p->bufs[mm.b_buf].writer) != 0)
        return oom(pl);
    pl->p->bufs[mm.c_buf].writer = sid;
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_VIEW;
    o->buf = mm.c_buf;
    o->offset = 0;
    contig_strides(om->ndim, om->shape, o->strides);
    return 0;
}

static int plan_movement(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    int x = n->in[0];
    const gj_rt_meta *im = vmeta(pl, x), *om = vmeta(pl, n->out[0]);
    vinfo *o = &pl->vi[n->out[0]];
    if (pl->vi[x].kind == V_CONST) {
        o->kind = V_CONST;
        o->cval = pl->vi[x].cval;
        return 0;
    }
    if (pl->vi[x].kind == V_FUSED && materialize(pl, x) != 0) return -1;
    vinfo xin = pl->vi[x];
    if (!fold_view(&n->inst, im, &xin, om, o)) {
        /* RESHAPE of a layout that cannot be viewed: copy, then view */
        int b = copy_to_buffer(pl, x, -1, GJ_JIT_BUF_TEMP, -1, 2 * (int64_t)i);
        if (b < 0) return -1;
        xin.buf = b;
        xin.offset = 0;
        contig_strides(im->ndim, im->shape, xin.strides);
        if (!fold_view(&n->inst, im, &xin, om, o)) return no_lowering(pl, n, "(view)");
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

/* GATHER_ROWS (table[V, D] viewed in place when it is a real buffer) and
 * SCATTER_ADD_ROWS (src contiguous): one index step each (plan.h). */
static int plan_index(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]), *sm = vmeta(pl, n->in[0]),
                     *im = vmeta(pl, n->in[1]);
    if (sm->dtype == GJ_I64) return no_lowering(pl, n, "on i64");
    if (im->dtype != GJ_I64) return no_lowering(pl, n, "with float indices");
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
    ix.out_buf = new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (ix.out_buf < 0) return oom(pl);
    if (grow((void **)&pl->ixs, pl->n_ix, &pl->cap_ix, sizeof *pl->ixs) != 0) return oom(pl);
    int sid = new_pstep(pl, PS_INDEX, pl->n_ix, 2 * (int64_t)i + 1);
    if (sid < 0) return oom(pl);
    pl->ixs[pl->n_ix++] = ix;
    if (add_dep(pl, sid, pl->p->bufs[ix.src_buf].writer) != 0 ||
        add_dep(pl, sid, pl->p->bufs[ix.idx_buf].writer) != 0)
        return oom(pl);
    pl->p->bufs[ix.out_buf].writer = sid;
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_VIEW;
    o->buf = ix.out_buf;
    o->offset = 0;
    contig_strides(om->ndim, om->shape, o->strides);
    return 0;
}

/* IM2COL / COL2IM: one fold step (plan.h) reading its source in place
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
    if (sm->dtype == GJ_I64) return no_lowering(pl, n, "on i64");
    if (!gj_rt_win_of(&n->inst, sm, &fd.win)) return no_lowering(pl, n, "(geometry)");
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
    fd.out_buf = new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (fd.out_buf < 0) return oom(pl);
    if (grow((void **)&pl->fds, pl->n_fd, &pl->cap_fd, sizeof *pl->fds) != 0) return oom(pl);
    int sid = new_pstep(pl, PS_FOLD, pl->n_fd, 2 * (int64_t)i + 1);
    if (sid < 0) return oom(pl);
    pl->fds[pl->n_fd++] = fd;
    if (add_dep(pl, sid, pl->p->bufs[fd.src_buf].writer) != 0) return oom(pl);
    pl->p->bufs[fd.out_buf].writer = sid;
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_VIEW;
    o->buf = fd.out_buf;
    o->offset = 0;
    contig_strides(om->ndim, om->shape, o->strides);
    return 0;
}

/* A tensor hook call (node.hook >= 0): the input as a contiguous buffer, a
 * new contiguous temporary for the value flowing on, one hook step after
 * the previous hook step (the engine's order of hook calls). */
static int plan_hook(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    gj_jit_hookstep hk;
    memset(&hk, 0, sizeof hk);
    hk.hook = n->hook;
    hk.meta = *vmeta(pl, n->out[0]);
    if (contiguous_operand(pl, n->in[0], i, &hk.src_buf) != 0) return -1;
    hk.out_buf = new_buf(pl, GJ_JIT_BUF_TEMP, -1, hk.meta.dtype,
                         numel_of(hk.meta.ndim, hk.meta.shape));
    if (hk.out_buf < 0) return oom(pl);
    if (grow((void **)&pl->hks, pl->n_hk, &pl->cap_hk, sizeof *pl->hks) != 0) return oom(pl);
    int sid = new_pstep(pl, PS_HOOK, pl->n_hk, 2 * (int64_t)i + 1);
    if (sid < 0) return oom(pl);
    pl->hks[pl->n_hk++] = hk;
    if (add_dep(pl, sid, pl->p->bufs[hk.src_buf].writer) != 0 ||
        add_dep(pl, sid, pl->last_hook_step) != 0)
        return oom(pl);
    pl->last_hook_step = sid;
    pl->p->bufs[hk.out_buf].writer = sid;
    vinfo *o = &pl->vi[n->out[0]];
    o->kind = V_VIEW;
    o->buf = hk.out_buf;
    o->offset = 0;
    contig_strides(hk.meta.ndim, hk.meta.shape, o->strides);
    return 0;
}

/* A custom op's backward (or forward) call (node.custom >= 0): every input as a
 * contiguous buffer, a new contiguous temporary per output, one call step
 * after the previous hook or call step (the engine's order). */
static int plan_custom(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    gj_jit_callstep cs;
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
        cs.out_buf[k] = new_buf(pl, GJ_JIT_BUF_TEMP, -1, cs.out_meta[k].dtype,
                                numel_of(cs.out_meta[k].ndim, cs.out_meta[k].shape));
        if (cs.out_buf[k] < 0) return oom(pl);
    }
    if (grow((void **)&pl->cls, pl->n_cl, &pl->cap_cl, sizeof *pl->cls) != 0) return oom(pl);
    int sid = new_pstep(pl, PS_CALL, pl->n_cl, 2 * (int64_t)i + 1);
    if (sid < 0) return oom(pl);
    pl->cls[pl->n_cl++] = cs;
    for (int k = 0; k < cs.n_in; k++)
        if (add_dep(pl, sid, pl->p->bufs[cs.src_buf[k]].writer) != 0) return oom(pl);
    if (add_dep(pl, sid, pl->last_hook_step) != 0) return oom(pl);
    pl->last_hook_step = sid;
    for (int k = 0; k < cs.n_out; k++) {
        pl->p->bufs[cs.out_buf[k]].writer = sid;
        vinfo *o = &pl->vi[n->out[k]];
        o->kind = V_VIEW;
        o->buf = cs.out_buf[k];
        o->offset = 0;
        contig_strides(cs.out_meta[k].ndim, cs.out_meta[k].shape, o->strides);
    }
    return 0;
}

/* PAD and CAT: a new buffer whose regions are written by the producers of
 * the pieces (stored in place when they are fused values, else copied),
 * after a zero fill for PAD. A barrier step joins the writers, so readers
 * of the result depend on all of them. */
static int plan_pad_cat(planner *pl, int i) {
    const gj_jit_node *n = &pl->g->nodes[i];
    const gj_rt_meta *om = vmeta(pl, n->out[0]);
    int ax = n->inst.axis < 0 ? n->inst.axis + om->ndim : n->inst.axis;
    if (ax < 0 || ax >= om->ndim) return no_lowering(pl, n, "(axis)");
    int b = new_buf(pl, GJ_JIT_BUF_TEMP, -1, om->dtype, numel_of(om->ndim, om->shape));
    if (b < 0) return oom(pl);
    int barrier = new_pstep(pl, PS_BARRIER, -1, 2 * (int64_t)i + 1);
    if (barrier < 0) return oom(pl);
    int64_t cs[GJ_MAX_DIMS];
    contig_strides(om->ndim, om->shape, cs);
    int fill = -1;
    if (n->inst.prim == GJ_P_PAD) {
        fill = copy_into(pl, -1, 0.0, om->ndim, om->shape, b, 0, cs, 2 * (int64_t)i);
        if (fill < 0 || add_dep(pl, barrier, fill) != 0) return -1;
    }
    int64_t at = n->inst.prim == GJ_P_PAD ? n->inst.start : 0;
    for (int k = 0; k < n->inst.n_in; k++) {
        int v = n->in[k];
        int w = place_into(pl, v, b, at * cs[ax], cs, 2 * (int64_t)i);
        if (w < 0) return -1;
        if (add_dep(pl, barrier, w) != 0 || add_dep(pl, w, fill) != 0) return oom(pl);
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
        return 0;
    }
    int64_t ne = numel_of(om->ndim, om->shape);
    int b;
    if (n->inst.prim == GJ_P_IOTA) {
        int ax = n->inst.axis < 0 ? n->inst.axis + om->ndim : n->inst.axis;
        if (ax < 0 || ax >= om->ndim) return no_lowering(pl, n, "(axis)");
        b = new_buf(pl, GJ_JIT_BUF_IOTA, -1, om->dtype, ne);
        if (b < 0) return oom(pl);
        pl->p->bufs[b].gen_len = om->shape[ax];
        pl->p->bufs[b].gen_inner = numel_of(om->ndim - ax - 1, om->shape + ax + 1);
        if (pl->p->bufs[b].gen_inner < 1) pl->p->bufs[b].gen_inner = 1;
        if (pl->p->bufs[b].gen_len < 1) pl->p->bufs[b].gen_len = 1;
    } else {
        if (om->dtype == GJ_I64) return no_lowering(pl, n, "on i64");
        b = new_buf(pl, GJ_JIT_BUF_DROPOUT, -1, om->dtype, ne);
        if (b < 0) return oom(pl);
        /* constants only when not run-time: this step's seed and offset must
         * not enter the plan (kernel names, the disk cache's plan compare) */
        pl->p->bufs[b].gen_seed = n->rt_node >= 0 ? 0 : n->inst.seed;
        pl->p->bufs[b].gen_offset = n->rt_node >= 0 ? 0 : n->inst.rng_offset;
        pl->p->bufs[b].gen_p = n->inst.scalar;
        if (n->rt_node >= 0) { /* seed and offset read at run time */
            gj_jit_plan *p = pl->p;
            if (p->params_buf < 0) {
                p->params_buf = new_buf(pl, GJ_JIT_BUF_PARAMS, -1, GJ_I64, 0);
                if (p->params_buf < 0) return oom(pl);
            }
            int *q = gj_rt_realloc(p->rt_param_node, (size_t)(p->n_rt_params + 1) * sizeof *q);
            if (!q) return oom(pl);
            p->rt_param_node = q;
            q[p->n_rt_params] = n->rt_node;
            q = gj_rt_realloc(p->rt_param_tape, (size_t)(p->n_rt_params + 1) * sizeof *q);
            if (!q) return oom(pl);
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
    pl->ps[G->step].kind = PS_DEAD;
    pl->ps[G->step].n_deps = 0;
    return true;
}

static int plan_outputs(planner *pl) {
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
            } else if (x->kind == V_FUSED && x->buf < 0) {
                x->buf = dst;
                x->offset = 0;
                contig_strides(m->ndim, m->shape, x->strides);
                p->bufs[dst].writer = pl->groups[x->group].step;
            } else if (copy_to_buffer(pl, v, dst, GJ_JIT_BUF_TEMP, -1, pos++) < 0) {
                return -1;
            }
        } else if (x->kind == V_FUSED && x->buf < 0) {
            dst = new_buf(pl, GJ_JIT_BUF_OUTPUT, oi, m->dtype, ne);
            if (dst < 0) return oom(pl);
            x->buf = dst;
            x->offset = 0;
            contig_strides(m->ndim, m->shape, x->strides);
            p->bufs[dst].writer = pl->groups[x->group].step;
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
    return 0;
}

/* ---------------------------------------------------- kernel building */

static int kadd_access(gj_jit_kernel *k, int buf, gj_dtype dt, int64_t off, const int64_t *st,
                       int nd) {
    for (int a = 0; a < k->n_acc; a++) {
        const gj_jit_access *x = &k->acc[a];
        if (x->buf == buf && x->dtype == dt && x->offset == off &&
            memcmp(x->strides, st, (size_t)nd * sizeof *st) == 0)
            return a;
    }
    if (grow((void **)&k->acc, k->n_acc, &k->cap_acc, sizeof *k->acc) != 0) return -1;
    gj_jit_access *x = &k->acc[k->n_acc];
    memset(x, 0, sizeof *x);
    x->buf = buf;
    x->dtype = dt;
    x->offset = off;
    memcpy(x->strides, st, (size_t)nd * sizeof *st);
    return k->n_acc++;
}

static int kadd_expr(gj_jit_kernel *k, const gj_jit_expr *e) {
    if (grow((void **)&k->ex, k->n_ex, &k->cap_ex, sizeof *k->ex) != 0) return -1;
    k->ex[k->n_ex] = *e;
    return k->n_ex++;
}

static int kadd_store(gj_jit_kernel *k, int access, int expr, bool reduce, bool max) {
    if (grow((void **)&k->st, k->n_st, &k->cap_st, sizeof *k->st) != 0) return -1;
    gj_jit_store *s = &k->st[k->n_st++];
    memset(s, 0, sizeof *s);
    s->access = access;
    s->expr = expr;
    s->reduce = reduce;
    s->max = max;
    return 0;
}

/* Strides over S (nd dims, shape S) of a view of a value of shape m,
 * broadcast numpy-style (right aligned, size-1 dims stride 0). */
static void broadcast_strides(const gj_rt_meta *m, const vinfo *x, int nd, const int64_t *S,
                              int64_t *out) {
    int lead = nd - m->ndim;
    for (int k = 0; k < nd; k++) {
        int s = k - lead;
        out[k] = (s < 0 || (m->shape[s] == 1 && S[k] != 1)) ? 0 : x->strides[s];
    }
}

/* Expression of value v inside kernel k over S (memo[v] caches it). */
static int value_expr(planner *pl, gj_jit_kernel *k, int *memo, int gi, int nd,
                      const int64_t *S, int v) {
    if (memo[v] >= 0) return memo[v];
    const vinfo *x = &pl->vi[v];
    const gj_rt_meta *m = vmeta(pl, v);
    gj_jit_expr e;
    memset(&e, 0, sizeof e);
    e.dtype = m->dtype;
    if (x->kind == V_CONST) {
        e.kind = GJ_JIT_E_CONST;
        e.cval = x->cval;
    } else {
        if (x->kind == V_FUSED && (x->group == gi || x->buf < 0)) {
            gj_rt_set_error("jit plan: internal: value %d used before it is computed", v);
            return -1;
        }
        int64_t st[GJ_MAX_DIMS];
        broadcast_strides(m, x, nd, S, st);
        e.kind = GJ_JIT_E_LOAD;
        e.access = kadd_access(k, x->buf, m->dtype, x->offset, st, nd);
        if (e.access < 0) return -1;
    }
    int id = kadd_expr(k, &e);
    if (id >= 0) memo[v] = id;
    return id;
}

/* Folds dims of size 1 and merges adjacent dims that every access walks
 * contiguously (and that are both reduced or both kept). */
static void collapse_dims(gj_jit_kernel *k) {
    int nd = 0;
    int64_t dims[GJ_MAX_DIMS];
    uint32_t red = 0;
    for (int d = 0; d < k->nd; d++) {
        if (k->dims[d] == 1) continue;
        bool r = (k->red >> d) & 1u;
        if (nd > 0) {
            int q = nd - 1;
            bool rq = (red >> q) & 1u;
            bool ok = rq == r;
            for (int a = 0; a < k->n_acc && ok; a++)
                if (k->acc[a].strides[q] != k->acc[a].strides[d] * k->dims[d]) ok = false;
            if (ok) {
                dims[q] *= k->dims[d];
                for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[q] = k->acc[a].strides[d];
                continue;
            }
        }
        dims[nd] = k->dims[d];
        for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[nd] = k->acc[a].strides[d];
        if (r) red |= 1u << nd;
        nd++;
    }
    if (nd == 0) {
        nd = 1;
        dims[0] = 1;
        for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[0] = 0;
    }
    k->nd = nd;
    memcpy(k->dims, dims, sizeof dims);
    for (int a = 0; a < k->n_acc; a++)
        for (int d = nd; d < GJ_MAX_DIMS; d++) k->acc[a].strides[d] = 0;
    k->red = red;
}

/* Rows, blocks and grain of kernel k (see plan.h). */
static void schedule_kernel(gj_jit_kernel *k) {
    int L = k->nd - 1;
    bool acc = k->red != 0; /* double accumulators per column: reduce stores */
    for (int s = 0; s < k->n_st; s++) acc |= k->st[s].reduce; /* (also over no dims left) */
    int64_t red_work = 1, outer = 1;
    for (int d = 0; d < k->nd; d++) {
        if ((k->red >> d) & 1u) red_work *= k->dims[d];
        else if (d < L) outer *= k->dims[d];
    }
    if ((k->red >> L) & 1u) {
        k->block = 1;
        k->nblk = 1;
        k->rows = outer;
        k->grain = red_work > 0 ? 32768 / red_work : 1;
    } else {
        int64_t inner = k->dims[L];
        if (acc) { /* double accumulators on the stack; >= 8 column blocks when wide */
            int64_t want = (inner + 7) / 8;
            want = (want + 15) / 16 * 16;
            if (want < 64) want = 64;
            if (want > GJ_JIT_MAX_RED_BLOCK) want = GJ_JIT_MAX_RED_BLOCK;
            k->block = inner < want ? inner : want;
        } else if (outer >= 16 || inner <= 8192) {
            k->block = inner;
        } else {
            int64_t want = (inner + 15) / 16;
            if (want < 4096) want = 4096;
            k->block = (want + 63) / 64 * 64;
        }
        k->nblk = k->block > 0 ? (inner + k->block - 1) / k->block : 0;
        k->rows = outer * k->nblk;
        int64_t work = k->block * red_work;
        k->grain = work > 0 ? 32768 / work : 1;
    }
    if (k->grain < 1) k->grain = 1;
}

static int build_kernel(planner *pl, int gi, gj_jit_kernel *k, int *memo) {
    const pgroup *G = &pl->groups[gi];
    const gj_jit_graph *g = pl->g;
    memset(k, 0, sizeof *k);
    int nd = G->ndim;
    const int64_t *S = G->shape;
    k->nd = nd;
    memcpy(k->dims, S, (size_t)nd * sizeof *S);
    k->red = G->has_red ? G->red_axes : 0;
    if (G->is_copy) {
        const gj_jit_buffer *b = &pl->p->bufs[G->copy_dst];
        int e;
        if (G->copy_src >= 0) {
            e = value_expr(pl, k, memo, gi, nd, S, G->copy_src);
        } else {
            gj_jit_expr c;
            memset(&c, 0, sizeof c);
            c.kind = GJ_JIT_E_CONST;
            c.dtype = b->dtype;
            c.cval = G->copy_cval;
            e = kadd_expr(k, &c);
        }
        if (e < 0) return -1;
        int a = kadd_access(k, G->copy_dst, b->dtype, G->copy_off, G->copy_st, nd);
        if (a < 0 || kadd_store(k, a, e, false, false) != 0) return -1;
    }
    for (int t = 0; t < G->n; t++) {
        const gj_jit_node *n = &g->nodes[G->nodes[t]];
        if (n->inst.prim == GJ_P_SUM || n->inst.prim == GJ_P_MAX) {
            int x = n->in[0];
            int e = is_member_of(pl, x, gi) ? memo[x] : value_expr(pl, k, memo, gi, nd, S, x);
            if (e < 0) return -1;
            const vinfo *o = &pl->vi[n->out[0]];
            const gj_rt_meta *om = vmeta(pl, n->out[0]);
            int64_t ost[GJ_MAX_DIMS], ocs[GJ_MAX_DIMS];
            contig_strides(om->ndim, om->shape, ocs);
            int q = 0;
            for (int d = 0; d < nd; d++) {
                if ((G->red_axes >> d) & 1u) {
                    ost[d] = 0;
                    if (n->inst.keepdim) q++;
                } else {
                    ost[d] = ocs[q++];
                }
            }
            int a = kadd_access(k, o->buf, om->dtype, 0, ost, nd);
            if (a < 0 || kadd_store(k, a, e, true, n->inst.prim == GJ_P_MAX) != 0) return -1;
            continue;
        }
        gj_jit_expr e;
        memset(&e, 0, sizeof e);
        e.kind = GJ_JIT_E_OP;
        e.inst = n->inst;
        e.dtype = vmeta(pl, n->out[0])->dtype;
        for (int a = 0; a < n->inst.n_in && a < 3; a++) {
            int v = n->in[a];
            int id = is_member_of(pl, v, gi) ? memo[v] : value_expr(pl, k, memo, gi, nd, S, v);
            if (id < 0) return -1;
            e.args[a] = id;
        }
        int id = kadd_expr(k, &e);
        if (id < 0) return -1;
        memo[n->out[0]] = id;
        const vinfo *o = &pl->vi[n->out[0]];
        if (o->buf >= 0) {
            int a = kadd_access(k, o->buf, e.dtype, o->offset, o->strides, nd);
            if (a < 0 || kadd_store(k, a, id, false, false) != 0) return -1;
        }
    }
    collapse_dims(k);
    schedule_kernel(k);
    /* params: the distinct real buffers, in first-use order, then the run's
     * parameters if a dropout mask reads them */
    k->param_buf = gj_rt_malloc((size_t)(k->n_acc + 2) * sizeof *k->param_buf);
    if (!k->param_buf) return -1;
    bool rt = false;
    for (int a = 0; a < k->n_acc; a++) {
        int b = k->acc[a].buf;
        if (buf_virtual(&pl->p->bufs[b])) {
            rt |= pl->p->bufs[b].gen_param >= 0;
            continue;
        }
        bool seen = false;
        for (int q = 0; q < k->n_params; q++) seen |= k->param_buf[q] == b;
        if (!seen) k->param_buf[k->n_params++] = b;
    }
    if (rt) k->param_buf[k->n_params++] = pl->p->params_buf;
    return 0;
}

/* ------------------------------------------------------- memory plan */

/* ------------------------------------------------------------ driver */

static atomic_int g_refused_prim = -1;

void gj_jit_test_no_lowering(int prim) { atomic_store(&g_refused_prim, prim < 0 ? -1 : prim); }

int gj_jit_plan_build(const gj_jit_graph *g, gj_jit_plan *p, char *why, size_t why_cap) {
    planner pl;
    memset(&pl, 0, sizeof pl);
    memset(p, 0, sizeof *p);
    pl.g = g;
    pl.p = p;
    pl.why = why;
    pl.why_cap = why_cap;
    pl.last_hook_step = -1;
    why[0] = '\0';
    int rc = -1;
    int *memo = NULL, *order = NULL;
    bool *is_placed = NULL;
    pl.vi = gj_rt_calloc((size_t)g->n_values + 1, sizeof *pl.vi);
    p->n_inputs = g->n_inputs;
    p->n_outputs = g->n_outputs;
    p->params_buf = -1;
    p->in_meta = gj_rt_calloc((size_t)g->n_inputs + 1, sizeof *p->in_meta);
    p->out_meta = gj_rt_calloc((size_t)g->n_outputs + 1, sizeof *p->out_meta);
    p->out_buf = gj_rt_calloc((size_t)g->n_outputs + 1, sizeof *p->out_buf);
    if (!pl.vi || !p->in_meta || !p->out_meta || !p->out_buf) {
        oom(&pl);
        goto done;
    }
    for (int v = 0; v < g->n_values; v++) pl.vi[v].buf = -1;
    pl.uses = gj_rt_calloc((size_t)g->n_values + 1, sizeof *pl.uses);
    if (!pl.uses) {
        oom(&pl);
        goto done;
    }
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < g->nodes[i].inst.n_in; k++) pl.uses[g->nodes[i].in[k]]++;
    for (int o = 0; o < g->n_outputs; o++) pl.uses[g->outputs[o].value]++;
    for (int k = 0; k < g->n_inputs; k++) { /* read in place, in their recorded layout */
        const gj_rt_meta *m = &g->values[g->inputs[k].value].meta;
        const int64_t *st = g->inputs[k].strides;
        p->in_meta[k] = *m;
        int64_t extent = numel_of(m->ndim, m->shape) > 0 ? 1 : 0;
        for (int d = 0; d < m->ndim && extent > 0; d++) extent += (m->shape[d] - 1) * st[d];
        int b = new_buf(&pl, GJ_JIT_BUF_INPUT, k, m->dtype, extent);
        if (b != k) {
            oom(&pl);
            goto done;
        }
        vinfo *x = &pl.vi[g->inputs[k].value];
        x->kind = V_VIEW;
        x->buf = b;
        x->offset = 0;
        memcpy(x->strides, st, sizeof x->strides);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const gj_jit_node *n = &g->nodes[i];
        gj_rt_prim pr = n->inst.prim;
        int r;
        if (n->custom >= 0) {
            r = plan_custom(&pl, i);
        } else if (n->hook >= 0) {
            r = plan_hook(&pl, i);
        } else if ((int)pr == atomic_load(&g_refused_prim)) {
            r = no_lowering(&pl, n, "(test switch)");
        } else if (pr == GJ_P_FILL || pr == GJ_P_IOTA || pr == GJ_P_DROPOUT_MASK) {
            r = plan_generator(&pl, i);
        } else if (gj_jit_prim_is_movement(pr)) {
            r = plan_movement(&pl, i);
        } else if (gj_jit_prim_is_elementwise(pr)) {
            r = plan_elementwise(&pl, i);
        } else if (pr == GJ_P_SUM || pr == GJ_P_MAX) {
            r = plan_reduce(&pl, i);
        } else if (pr == GJ_P_MATMUL) {
            r = plan_matmul(&pl, i);
        } else if (pr == GJ_P_PAD || pr == GJ_P_CAT) {
            r = plan_pad_cat(&pl, i);
        } else if (pr == GJ_P_GATHER_ROWS || pr == GJ_P_SCATTER_ADD_ROWS) {
            r = plan_index(&pl, i);
        } else if (pr == GJ_P_IM2COL || pr == GJ_P_COL2IM) {
            r = plan_fold(&pl, i);
        } else {
            r = no_lowering(&pl, n, NULL);
        }
        if (r != 0) {
            if (!why[0]) oom(&pl);
            goto done;
        }
    }
    if (plan_outputs(&pl) != 0) goto done;

    /* steps: a topological order of the step graph, earliest position first */
    memo = gj_rt_malloc((size_t)(g->n_values + 1) * sizeof *memo);
    order = gj_rt_malloc((size_t)(pl.n_ps + 1) * sizeof *order);
    is_placed = gj_rt_calloc((size_t)pl.n_ps + 1, sizeof *is_placed);
    p->cap_steps = pl.n_ps + 1;
    p->steps = gj_rt_calloc((size_t)p->cap_steps, sizeof *p->steps);
    if (!memo || !order || !is_placed || !p->steps) {
        oom(&pl);
        goto done;
    }
    int n_live = 0;
    for (int c = 0; c < pl.n_ps; c++) {
        if (pl.ps[c].kind == PS_DEAD) is_placed[c] = true; /* merged away */
        else n_live++;
    }
    for (int t = 0; t < n_live; t++) {
        int best = -1;
        for (int c = 0; c < pl.n_ps; c++) {
            if (is_placed[c]) continue;
            bool ready = true;
            for (int k = 0; k < pl.ps[c].n_deps && ready; k++) ready = is_placed[pl.ps[c].deps[k]];
            if (ready && (best < 0 || pl.ps[c].pos < pl.ps[best].pos)) best = c;
        }
        if (best < 0) {
            if (gj_jit_log_flags() & GJ_JIT_LOG_PLAN)
                for (int c = 0; c < pl.n_ps; c++) {
                    fprintf(stderr, "  pstep %d kind %d idx %d pos %lld%s deps:", c, pl.ps[c].kind,
                            pl.ps[c].idx, (long long)pl.ps[c].pos, is_placed[c] ? " placed" : "");
                    for (int k = 0; k < pl.ps[c].n_deps; k++) fprintf(stderr, " %d", pl.ps[c].deps[k]);
                    fprintf(stderr, "\n");
                }
            snprintf(why, why_cap, "internal: the step graph has a cycle");
            gj_rt_set_error("jit plan: %s", why);
            goto done;
        }
        is_placed[best] = true;
        order[t] = best;
    }
    for (int t = 0; t < n_live; t++) {
        const pstep *ps = &pl.ps[order[t]];
        if (ps->kind == PS_BARRIER) continue;
        gj_jit_step *st = &p->steps[p->n_steps++];
        st->pos = ps->pos;
        if (ps->kind == PS_MATMUL) {
            st->kind = GJ_JIT_STEP_MATMUL;
            st->mm = pl.mms[ps->idx];
            continue;
        }
        if (ps->kind == PS_INDEX) {
            st->kind = GJ_JIT_STEP_INDEX;
            st->ix = pl.ixs[ps->idx];
            continue;
        }
        if (ps->kind == PS_FOLD) {
            st->kind = GJ_JIT_STEP_FOLD;
            st->fd = pl.fds[ps->idx];
            continue;
        }
        if (ps->kind == PS_HOOK) {
            st->kind = GJ_JIT_STEP_HOOK;
            st->hk = pl.hks[ps->idx];
            continue;
        }
        if (ps->kind == PS_CALL) {
            st->kind = GJ_JIT_STEP_CALL;
            st->cs = pl.cls[ps->idx];
            continue;
        }
        st->kind = GJ_JIT_STEP_KERNEL;
        for (int v = 0; v < g->n_values; v++) memo[v] = -1;
        if (build_kernel(&pl, ps->idx, &st->k, memo) != 0) {
            if (!why[0]) snprintf(why, why_cap, "kernel construction failed: %s", gj_last_error());
            goto done;
        }
    }
    gj_jit_schedule_order(p);
    gj_jit_schedule_groups(p);
    for (int s = 0; s < p->n_steps; s++)
        if (p->steps[s].kind == GJ_JIT_STEP_KERNEL)
            snprintf(p->steps[s].k.name, sizeof p->steps[s].k.name, "k%d", s);
    if (gj_jit_dedupe_kernels(p) != 0 || gj_jit_plan_memory(p) != 0) {
        oom(&pl);
        goto done;
    }
    rc = 0;
done:
    for (int gi = 0; gi < pl.n_groups; gi++) gj_rt_free(pl.groups[gi].nodes);
    gj_rt_free(pl.groups);
    gj_rt_free(pl.mms);
    gj_rt_free(pl.ixs);
    gj_rt_free(pl.hks);
    gj_rt_free(pl.cls);
    gj_rt_free(pl.fds);
    for (int t = 0; t < pl.n_ps; t++) gj_rt_free(pl.ps[t].deps);
    gj_rt_free(pl.ps);
    gj_rt_free(pl.stack);
    gj_rt_free(pl.vi);
    gj_rt_free(pl.uses);
    gj_rt_free(memo);
    gj_rt_free(order);
    gj_rt_free(is_placed);
    if (rc != 0) gj_jit_plan_free(p);
    return rc;
}

void gj_jit_plan_free(gj_jit_plan *p) {
    if (!p) return;
    for (int s = 0; s < p->n_steps; s++) {
        gj_jit_kernel *k = &p->steps[s].k;
        gj_rt_free(k->acc);
        gj_rt_free(k->ex);
        gj_rt_free(k->st);
        gj_rt_free(k->param_buf);
        gj_rt_free(k->ints);
    }
    gj_rt_free(p->steps);
    gj_rt_free(p->bufs);
    gj_rt_free(p->in_meta);
    gj_rt_free(p->out_meta);
    gj_rt_free(p->out_buf);
    gj_rt_free(p->by_first);
    gj_rt_free(p->by_last);
    gj_rt_free(p->rt_param_node);
    gj_rt_free(p->rt_param_tape);
    memset(p, 0, sizeof *p);
    p->params_buf = -1;
}

/* ------------------------------------------------------------- print */

static const char *buf_kind_name(gj_jit_buf_kind k) {
    switch (k) {
    case GJ_JIT_BUF_INPUT: return "input";
    case GJ_JIT_BUF_OUTPUT: return "output";
    case GJ_JIT_BUF_TEMP: return "temp";
    case GJ_JIT_BUF_IOTA: return "iota";
    case GJ_JIT_BUF_PARAMS: return "params";
    default: return "dropout";
    }
}

void gj_jit_plan_print(const gj_jit_plan *p, FILE *f) {
    char sh[160];
    fprintf(f, "plan: %d steps, %d buffers, peak of temporaries %zu bytes\n", p->n_steps,
            p->n_bufs, p->peak_temp_bytes);
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        fprintf(f, "  b%d %s #%d %s x%lld", b, buf_kind_name(x->kind), x->index,
                gj_rt_dtype_name(x->dtype), (long long)x->numel);
        if (x->first_step >= 0) fprintf(f, " live [%d, %d]", x->first_step, x->last_step);
        fprintf(f, "\n");
    }
    for (int s = 0; s < p->n_steps; s++) {
        const gj_jit_step *st = &p->steps[s];
        if (st->kind == GJ_JIT_STEP_CALL) {
            fprintf(f, "  step %d: custom %s call of node %d tape %d (", s,
                    st->cs.fwd ? "forward" : "backward", st->cs.node, st->cs.tape);
            for (int k = 0; k < st->cs.n_in; k++) fprintf(f, "%sb%d", k ? ", " : "", st->cs.src_buf[k]);
            fprintf(f, ") ->");
            for (int k = 0; k < st->cs.n_out; k++) fprintf(f, " b%d", st->cs.out_buf[k]);
            fprintf(f, "\n");
            continue;
        }
        if (st->kind == GJ_JIT_STEP_HOOK) {
            gj_rt_fmt_shape(sh, sizeof sh, st->hk.meta.ndim, st->hk.meta.shape);
            fprintf(f, "  step %d: b%d = hook #%d(b%d) %s %s\n", s, st->hk.out_buf, st->hk.hook,
                    st->hk.src_buf, gj_rt_dtype_name(st->hk.meta.dtype), sh);
            continue;
        }
        if (st->kind == GJ_JIT_STEP_FOLD) {
            const gj_jit_fold *x = &st->fd;
            const gj_rt_win *w = &x->win;
            fprintf(f, "  step %d: %s b%d = b%d+%lld %s N=%lld C=%lld H=%lld W=%lld kernel=%lldx%lld "
                    "stride=%lldx%lld pad=%lldx%lld dilation=%lldx%lld out=%lldx%lld\n", s,
                    x->col2im ? "col2im" : "im2col", x->out_buf, x->src_buf, (long long)x->src_off,
                    gj_rt_dtype_name(x->dtype), (long long)w->N, (long long)w->C, (long long)w->H,
                    (long long)w->W, (long long)w->kh, (long long)w->kw, (long long)w->sh,
                    (long long)w->sw, (long long)w->ph, (long long)w->pw, (long long)w->dh,
                    (long long)w->dw, (long long)w->OH, (long long)w->OW);
            continue;
        }
        if (st->kind == GJ_JIT_STEP_INDEX) {
            const gj_jit_index *x = &st->ix;
            fprintf(f, "  step %d: %s b%d = b%d [b%d] %s n=%lld D=%lld V=%lld\n", s,
                    x->scatter ? "scatter_add_rows" : "gather_rows", x->out_buf, x->src_buf,
                    x->idx_buf, gj_rt_dtype_name(x->dtype), (long long)x->n, (long long)x->D,
                    (long long)x->V);
            continue;
        }
        if (st->kind == GJ_JIT_STEP_MATMUL) {
            const gj_jit_matmul *m = &st->mm;
            int g0 = s;
            while (g0 > 0 && p->steps[g0 - 1].group_end == st->group_end) g0--;
            char grp[48] = "";
            if (st->group_end - g0 > 1)
                snprintf(grp, sizeof grp, "  [side by side: steps %d..%d]", g0, st->group_end - 1);
            fprintf(f, "  step %d: %s b%d %s b%d%s @ b%d%s  M=%lld N=%lld K=%lld batch=%d%s\n", s,
                    m->dtype == GJ_F64 ? "dgemm" : "sgemm", m->c_buf, m->accumulate ? "+=" : "=",
                    m->a_buf, m->ta ? "^T" : "",
                    m->b_buf, m->tb ? "^T" : "", (long long)m->M, (long long)m->N,
                    (long long)m->K, m->nb, grp);
            continue;
        }
        const gj_jit_kernel *k = &st->k;
        gj_rt_fmt_shape(sh, sizeof sh, k->nd, k->dims);
        fprintf(f, "  step %d: kernel %s over %s red=0x%x rows=%lld block=%lld grain=%lld\n", s,
                k->name, sh, (unsigned)k->red, (long long)k->rows, (long long)k->block,
                (long long)k->grain);
        for (int a = 0; a < k->n_acc; a++) {
            gj_rt_fmt_shape(sh, sizeof sh, k->nd, k->acc[a].strides);
            fprintf(f, "    a%d: b%d %s +%lld strides %s\n", a, k->acc[a].buf,
                    gj_rt_dtype_name(k->acc[a].dtype), (long long)k->acc[a].offset, sh);
        }
        for (int e = 0; e < k->n_ex; e++) {
            const gj_jit_expr *x = &k->ex[e];
            if (x->kind == GJ_JIT_E_LOAD)
                fprintf(f, "    e%d = load a%d\n", e, x->access);
            else if (x->kind == GJ_JIT_E_CONST)
                fprintf(f, "    e%d = const %.17g %s\n", e, x->cval, gj_rt_dtype_name(x->dtype));
            else {
                fprintf(f, "    e%d = %s(", e, gj_rt_prim_name(x->inst.prim));
                for (int q = 0; q < x->inst.n_in && q < 3; q++)
                    fprintf(f, "%se%d", q ? ", " : "", x->args[q]);
                fprintf(f, ") %s\n", gj_rt_dtype_name(x->dtype));
            }
        }
        for (int q = 0; q < k->n_st; q++)
            fprintf(f, "    a%d %s e%d\n", k->st[q].access,
                    !k->st[q].reduce ? "=" : k->st[q].max ? "max=" : "+=", k->st[q].expr);
    }
}
