/* SPDX-License-Identifier: MIT */
/*
 * plan_kernel.c - a fused group becomes a kernel: its accesses (buffer,
 * dtype, offset, strides over the iteration space), its expression list in
 * evaluation order, and its stores (plain, or reductions into double
 * accumulators); then the kernel's dims are collapsed and scheduled.
 *
 * Contract: gj_jit_pl_kernel(pl, gi, k, memo) fills k for group gi from
 * the planner's value table (memo: gj_jit_memo, every id -1 on
 * entry) and returns 0, or -1 on out of memory. The schedule (rows, column
 * block, number of blocks, grain) is a pure function of the kernel's dims,
 * reduction axes and stores, so a plan read back from the disk cache gets
 * the same one. Lowering (lower.c) emits exactly these loops: the lane
 * order of every sum, and so every bit, follows from the schedule alone.
 */
#include "jit/plan/plan_int.h"

static int kadd_access(gj_jit_kernel *k, int buf, gj_dtype dt, int64_t off, const int64_t *st,
                       int nd) {
    for (int a = 0; a < k->n_acc; a++) {
        const gj_jit_access *x = &k->acc[a];
        if (x->buf == buf && x->dtype == dt && x->offset == off &&
            memcmp(x->strides, st, (size_t)nd * sizeof *st) == 0)
            return a;
    }
    if (gj_jit_grow((void **)&k->acc, k->n_acc, &k->cap_acc, sizeof *k->acc) != 0) return -1;
    gj_jit_access *x = &k->acc[k->n_acc];
    memset(x, 0, sizeof *x);
    x->buf = buf;
    x->dtype = dt;
    x->offset = off;
    memcpy(x->strides, st, (size_t)nd * sizeof *st);
    return k->n_acc++;
}

static int kadd_expr(gj_jit_kernel *k, const gj_jit_expr *e) {
    if (gj_jit_grow((void **)&k->ex, k->n_ex, &k->cap_ex, sizeof *k->ex) != 0) return -1;
    k->ex[k->n_ex] = *e;
    return k->n_ex++;
}

static int kadd_store(gj_jit_kernel *k, int access, int expr, bool reduce, bool max) {
    if (gj_jit_grow((void **)&k->st, k->n_st, &k->cap_st, sizeof *k->st) != 0) return -1;
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

/* Expression of value v inside kernel k over S (memo->id[v] caches it). */
static int value_expr(planner *pl, gj_jit_kernel *k, gj_jit_memo *memo, int gi, int nd,
                      const int64_t *S, int v) {
    if (memo->id[v] >= 0) return memo->id[v];
    const vinfo *x = &pl->vi[v];
    const gj_rt_meta *m = vmeta(pl, v);
    gj_jit_expr e;
    memset(&e, 0, sizeof e);
    e.dtype = m->dtype;
    if (x->kind == V_CONST) {
        e.kind = GJ_JIT_E_CONST;
        e.cval = x->cval;
    } else if (x->kind == V_FUSED && x->group != gi && recomputes(pl, gi, v)) {
        /* computed again from its inputs (plan_nodes.c: need_value) */
        const gj_jit_node *n = &pl->g->nodes[pl->g->values[v].node];
        e.kind = GJ_JIT_E_OP;
        e.inst = n->inst;
        for (int a = 0; a < n->inst.n_in && a < 3; a++) {
            int id = value_expr(pl, k, memo, gi, nd, S, n->in[a]);
            if (id < 0) return -1;
            e.args[a] = id;
        }
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
    if (id >= 0) gj_jit_memo_put(memo, v, id);
    return id;
}

/* Drops the expressions no store depends on, then the accesses nothing
 * reads or writes any more. A group member whose value another kernel now
 * computes again (recompute) is built here but not stored, and a value
 * used only through it is dead with it. Expressions keep their order
 * (every argument before its user); returns 0, or -1 on out of memory. */
static int drop_dead(gj_jit_kernel *k) {
    if (k->n_ex == 0) return 0;
    int *map = gj_rt_malloc((size_t)(k->n_ex + k->n_acc) * sizeof *map);
    if (!map) return -1;
    int *amap = map + k->n_ex;
    for (int i = 0; i < k->n_ex; i++) map[i] = 0;
    for (int s = 0; s < k->n_st; s++) map[k->st[s].expr] = 1;
    for (int i = k->n_ex - 1; i >= 0; i--) {
        const gj_jit_expr *e = &k->ex[i];
        if (map[i] && e->kind == GJ_JIT_E_OP)
            for (int a = 0; a < e->inst.n_in && a < 3; a++) map[e->args[a]] = 1;
    }
    int n = 0;
    for (int i = 0; i < k->n_ex; i++) {
        if (!map[i]) {
            map[i] = -1;
            continue;
        }
        gj_jit_expr e = k->ex[i];
        if (e.kind == GJ_JIT_E_OP)
            for (int a = 0; a < e.inst.n_in && a < 3; a++) e.args[a] = map[e.args[a]];
        k->ex[n] = e;
        map[i] = n++;
    }
    k->n_ex = n;
    for (int s = 0; s < k->n_st; s++) k->st[s].expr = map[k->st[s].expr];
    for (int a = 0; a < k->n_acc; a++) amap[a] = 0;
    for (int i = 0; i < k->n_ex; i++)
        if (k->ex[i].kind == GJ_JIT_E_LOAD) amap[k->ex[i].access] = 1;
    for (int s = 0; s < k->n_st; s++) amap[k->st[s].access] = 1;
    int na = 0;
    for (int a = 0; a < k->n_acc; a++) {
        if (!amap[a]) {
            amap[a] = -1;
            continue;
        }
        k->acc[na] = k->acc[a];
        amap[a] = na++;
    }
    k->n_acc = na;
    for (int i = 0; i < k->n_ex; i++)
        if (k->ex[i].kind == GJ_JIT_E_LOAD) k->ex[i].access = amap[k->ex[i].access];
    for (int s = 0; s < k->n_st; s++) k->st[s].access = amap[k->st[s].access];
    gj_rt_free(map);
    return 0;
}

/* The eager kernel (runtime/kernels_reduce.c, gj_k_reduce) drops the dims
 * of size 1, sorts the reduced dims by decreasing stride (stably) and
 * coalesces neighbours (stride[prev] == stride * size). When the innermost
 * kept dim has a smaller stride than every reduced dim it adds row-wise:
 * each output from 0, in the sorted order of the reduced indices (run 0).
 * Otherwise each output sums runs of the innermost coalesced dim in 8
 * lanes (lane = position mod 8), adding each run's fixed tree to its
 * accumulator, the other reduced dims outside in sorted order (run = the
 * dims in that innermost one). The kernel's loops give the same order
 * when its dims are nested as perm says: the reduced dims in the sorted
 * order, last for runs, before the last kept dim when row-wise. That is
 * the natural order for a contiguous value (kept dims stay in place);
 * otherwise the kept dims go first (row-wise: all but the innermost). */
void gj_jit_pl_red_order(int nd, const int64_t *S, const int64_t *st, uint32_t red,
                         red_order *o) {
    int kept[GJ_MAX_DIMS], rd[GJ_MAX_DIMS], nat[GJ_MAX_DIMS], nk = 0, nr = 0, n = 0;
    for (int d = 0; d < nd; d++) {
        if (S[d] == 1) continue;
        nat[n++] = d;
        if ((red >> d) & 1u) rd[nr++] = d;
        else kept[nk++] = d;
    }
    for (int a = 1; a < nr; a++) /* (eager's stable insertion sort) */
        for (int b = a; b > 0 && st[rd[b - 1]] < st[rd[b]]; b--) {
            int t = rd[b];
            rd[b] = rd[b - 1];
            rd[b - 1] = t;
        }
    bool rowwise = nk > 0;
    for (int q = 0; q < nr && rowwise; q++) rowwise = st[kept[nk - 1]] < st[rd[q]];
    int run = 0;
    if (!rowwise && nr > 0)
        for (run = 1; run < nr && st[rd[nr - run - 1]] == st[rd[nr - run]] * S[rd[nr - run]];)
            run++;
    bool natural = true;
    for (int q = 0, r = 0; q < n && natural; q++)
        if ((red >> nat[q]) & 1u) natural = rd[r++] == nat[q];
    if (n > 0 && rowwise) natural = natural && !((red >> nat[n - 1]) & 1u);
    for (int q = n - run; q < n && natural; q++) natural = (red >> nat[q]) & 1u;
    o->n = n;
    o->run = run;
    int w = 0;
    if (natural) {
        for (int q = 0; q < n; q++) o->perm[w++] = (int8_t)nat[q];
        return;
    }
    for (int q = 0; q < nk - (rowwise ? 1 : 0); q++) o->perm[w++] = (int8_t)kept[q];
    for (int q = 0; q < nr; q++) o->perm[w++] = (int8_t)rd[q];
    if (rowwise) o->perm[w++] = (int8_t)kept[nk - 1];
}

/* Nests k's dims as ord says (NULL: as they are) and drops those of size
 * 1, then merges adjacent dims that every access walks contiguously (and
 * that are both reduced or both kept), never across the start of ord's
 * run; sets k->run_dims to the dims the run then spans. */
static void collapse_dims(gj_jit_kernel *k, const red_order *ord) {
    int n = 0, run_from = -1, run_at = -1;
    int64_t dims[GJ_MAX_DIMS], t[GJ_MAX_DIMS];
    uint32_t red = 0;
    if (ord) { /* permuted, size-1 dims dropped */
        for (int q = 0; q < ord->n; q++) {
            dims[q] = k->dims[ord->perm[q]];
            if ((k->red >> ord->perm[q]) & 1u) red |= 1u << q;
        }
        for (int a = 0; a < k->n_acc; a++) {
            for (int q = 0; q < ord->n; q++) t[q] = k->acc[a].strides[ord->perm[q]];
            memcpy(k->acc[a].strides, t, (size_t)ord->n * sizeof t[0]);
        }
        n = ord->n;
        if (ord->run > 0) run_from = n - ord->run;
    } else {
        for (int d = 0; d < k->nd; d++) {
            if (k->dims[d] == 1) continue;
            dims[n] = k->dims[d];
            if ((k->red >> d) & 1u) red |= 1u << n;
            for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[n] = k->acc[a].strides[d];
            n++;
        }
    }
    int nd = 0;
    uint32_t nred = 0;
    for (int d = 0; d < n; d++) {
        bool r = (red >> d) & 1u;
        if (nd > 0 && d != run_from) {
            int q = nd - 1;
            bool ok = ((nred >> q) & 1u) == r;
            for (int a = 0; a < k->n_acc && ok; a++)
                if (k->acc[a].strides[q] != k->acc[a].strides[d] * dims[d]) ok = false;
            if (ok) {
                dims[q] *= dims[d];
                for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[q] = k->acc[a].strides[d];
                continue;
            }
        }
        if (d == run_from) run_at = nd;
        dims[nd] = dims[d];
        for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[nd] = k->acc[a].strides[d];
        if (r) nred |= 1u << nd;
        nd++;
    }
    if (nd == 0) {
        nd = 1;
        dims[0] = 1;
        for (int a = 0; a < k->n_acc; a++) k->acc[a].strides[0] = 0;
    }
    k->nd = nd;
    for (int d = 0; d < GJ_MAX_DIMS; d++) k->dims[d] = d < nd ? dims[d] : 0;
    for (int a = 0; a < k->n_acc; a++)
        for (int d = nd; d < GJ_MAX_DIMS; d++) k->acc[a].strides[d] = 0;
    k->red = nred;
    k->run_dims = run_at >= 0 && nd - run_at > 1 ? nd - run_at : 0;
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

int gj_jit_pl_kernel(planner *pl, int gi, gj_jit_kernel *k, gj_jit_memo *memo) {
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
            int e = is_member_of(pl, x, gi) ? memo->id[x] : value_expr(pl, k, memo, gi, nd, S, x);
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
            int id = is_member_of(pl, v, gi) ? memo->id[v] : value_expr(pl, k, memo, gi, nd, S, v);
            if (id < 0) return -1;
            e.args[a] = id;
        }
        int id = kadd_expr(k, &e);
        if (id < 0) return -1;
        gj_jit_memo_put(memo, n->out[0], id);
        const vinfo *o = &pl->vi[n->out[0]];
        if (o->buf >= 0) {
            int a = kadd_access(k, o->buf, e.dtype, o->offset, o->strides, nd);
            if (a < 0 || kadd_store(k, a, id, false, false) != 0) return -1;
        }
    }
    if (drop_dead(k) != 0) return -1;
    collapse_dims(k, G->has_red ? &G->ord : NULL);
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
