/* SPDX-License-Identifier: MIT */
/*
 * plan.c - from a captured graph to an execution plan: the driver of the
 * planning passes (plan_int.h lists them) and the plan's printer.
 *
 * Order: graph inputs become views of their tensors as recorded; each node
 * is planned (plan_nodes.c, with view folding in plan_views.c); the graph
 * outputs get their buffers; the instructions are placed in a topological order of
 * the step graph, ties broken by the position of their first node
 * (emission order), which keeps lifetimes short; every fused group becomes
 * a kernel (plan_kernel.c); then schedule.c pairs independent GEMM instructions,
 * dedupe.c shares identical kernels, and memplan.c sets buffer lifetimes.
 *
 * Contract: gj_jit_plan_build returns 0 with *p complete, or -1 with why[]
 * set and *p freed; it never keeps a pointer into g.
 */
#include "jit/plan/plan_int.h"

int gj_jit_pl_oom(planner *pl) {
    snprintf(pl->why, pl->why_cap, "out of memory while planning");
    return -1;
}

int gj_jit_pl_no_lowering(planner *pl, const gj_jit_node *n, const char *detail) {
    snprintf(pl->why, pl->why_cap, "no lowering for %s%s%s", gj_rt_prim_name(n->inst.prim),
             detail ? " " : "", detail ? detail : "");
    gj_rt_set_error("jit: %s", pl->why);
    return -1;
}

/* New buffer; returns its id or -1. */
int gj_jit_pl_new_buf(planner *pl, gj_jit_buf_kind kind, int index, gj_dtype dt, int64_t numel) {
    gj_jit_plan *p = pl->p;
    if (gj_jit_grow((void **)&p->bufs, p->n_bufs, &p->cap_bufs, sizeof *p->bufs) != 0) return -1;
    gj_jit_buffer *b = &p->bufs[p->n_bufs];
    memset(b, 0, sizeof *b);
    b->kind = kind;
    b->index = index;
    b->dtype = dt;
    b->numel = numel;
    b->nbytes = (size_t)numel * gj_rt_dtype_size(dt);
    b->first_instr = b->last_instr = -1;
    b->writer = -1;
    b->gen_param = -1;
    return p->n_bufs++;
}

/* ------------------------------------------------------------ driver */

/* One gj_jit_plan_build, carried from stage to stage: the planner (its
 * tables, freed by pb_free) and the scratch of the instruction order.
 * Each stage returns 0, or -1 with why[] set (the plan is then freed by
 * the driver's one exit). */
typedef struct building {
    planner pl;
    gj_jit_memo memo;
    int *order;
    bool *is_placed;
    int n_live; /* instructions not merged away */
} building;

/* The plan's tables for the graph's inputs and outputs, the value table
 * and each value's number of uses. */
static int pb_tables(building *b) {
    planner *pl = &b->pl;
    const gj_jit_graph *g = pl->g;
    gj_jit_plan *p = pl->p;
    pl->vi = gj_rt_calloc((size_t)g->n_values + 1, sizeof *pl->vi);
    p->n_inputs = g->n_inputs;
    p->n_outputs = g->n_outputs;
    p->params_buf = -1;
    p->in_meta = gj_rt_calloc((size_t)g->n_inputs + 1, sizeof *p->in_meta);
    p->out_meta = gj_rt_calloc((size_t)g->n_outputs + 1, sizeof *p->out_meta);
    p->out_buf = gj_rt_calloc((size_t)g->n_outputs + 1, sizeof *p->out_buf);
    if (!pl->vi || !p->in_meta || !p->out_meta || !p->out_buf) return gj_jit_pl_oom(pl);
    for (int v = 0; v < g->n_values; v++) pl->vi[v].buf = -1;
    pl->uses = gj_rt_calloc((size_t)g->n_values + 1, sizeof *pl->uses);
    if (!pl->uses) return gj_jit_pl_oom(pl);
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < g->nodes[i].inst.n_in; k++) pl->uses[g->nodes[i].in[k]]++;
    for (int o = 0; o < g->n_outputs; o++) pl->uses[g->outputs[o].value]++;
    return 0;
}

/* Graph input k is buffer k, read in place, in its recorded layout. */
static int pb_inputs(building *b) {
    planner *pl = &b->pl;
    const gj_jit_graph *g = pl->g;
    for (int k = 0; k < g->n_inputs; k++) {
        const gj_rt_meta *m = &g->values[g->inputs[k].value].meta;
        const int64_t *st = g->inputs[k].strides;
        pl->p->in_meta[k] = *m;
        int64_t extent = numel_of(m->ndim, m->shape) > 0 ? 1 : 0;
        for (int d = 0; d < m->ndim && extent > 0; d++) extent += (m->shape[d] - 1) * st[d];
        int bi = gj_jit_pl_new_buf(pl, GJ_JIT_BUF_INPUT, k, m->dtype, extent);
        if (bi != k) return gj_jit_pl_oom(pl);
        vinfo *x = &pl->vi[g->inputs[k].value];
        x->kind = V_VIEW;
        x->buf = bi;
        x->offset = 0;
        memcpy(x->strides, st, sizeof x->strides);
    }
    return 0;
}

/* Every node planned (plan_nodes.c), then the outputs' buffers. */
static int pb_nodes(building *b) {
    planner *pl = &b->pl;
    for (int i = 0; i < pl->g->n_nodes; i++) {
        if (gj_jit_pl_node(pl, i) != 0) {
            if (!pl->why[0]) gj_jit_pl_oom(pl);
            return -1;
        }
    }
    return gj_jit_pl_outputs(pl) != 0 ? -1 : 0;
}

/* The order: a topological order of the step graph, earliest position
 * first, into b->order[0 .. n_live); also allocates the plan's
 * instructions and the kernels' memo. A cycle is an internal error (the
 * step graph printed under GRADJIT_LOG=plan). */
static int pb_order(building *b) {
    planner *pl = &b->pl;
    const gj_jit_graph *g = pl->g;
    gj_jit_plan *p = pl->p;
    b->memo.id = gj_rt_malloc((size_t)(g->n_values + 1) * sizeof *b->memo.id);
    b->memo.set = gj_rt_malloc((size_t)(g->n_values + 1) * sizeof *b->memo.set);
    b->memo.n_set = 0;
    if (b->memo.id)
        for (int v = 0; v < g->n_values; v++) b->memo.id[v] = -1;
    b->order = gj_rt_malloc((size_t)(pl->n_ps + 1) * sizeof *b->order);
    b->is_placed = gj_rt_calloc((size_t)pl->n_ps + 1, sizeof *b->is_placed);
    p->cap_instrs = pl->n_ps + 1;
    p->instrs = gj_rt_calloc((size_t)p->cap_instrs, sizeof *p->instrs);
    if (!b->memo.id || !b->memo.set || !b->order || !b->is_placed || !p->instrs) return gj_jit_pl_oom(pl);
    bool *is_placed = b->is_placed;
    b->n_live = 0;
    for (int c = 0; c < pl->n_ps; c++) {
        if (pl->ps[c].kind == PS_DEAD) is_placed[c] = true; /* merged away */
        else b->n_live++;
    }
    for (int t = 0; t < b->n_live; t++) {
        int best = -1;
        for (int c = 0; c < pl->n_ps; c++) {
            if (is_placed[c]) continue;
            bool ready = true;
            for (int k = 0; k < pl->ps[c].n_deps && ready; k++) ready = is_placed[pl->ps[c].deps[k]];
            if (ready && (best < 0 || pl->ps[c].pos < pl->ps[best].pos)) best = c;
        }
        if (best < 0) {
            if (gj_jit_log_flags() & GJ_JIT_LOG_PLAN)
                for (int c = 0; c < pl->n_ps; c++) {
                    fprintf(stderr, "  pinstr %d kind %d idx %d pos %lld%s deps:", c, pl->ps[c].kind,
                            pl->ps[c].idx, (long long)pl->ps[c].pos, is_placed[c] ? " placed" : "");
                    for (int k = 0; k < pl->ps[c].n_deps; k++) fprintf(stderr, " %d", pl->ps[c].deps[k]);
                    fprintf(stderr, "\n");
                }
            snprintf(pl->why, pl->why_cap, "internal: the step graph has a cycle");
            gj_rt_set_error("jit plan: %s", pl->why);
            return -1;
        }
        is_placed[best] = true;
        b->order[t] = best;
    }
    return 0;
}

/* The kernel of attention instruction at: its buffers, one row per unit
 * (grain 1), its integer table. 0, or -1 on OOM. */
static int attn_kernel(const pattn *at, gj_jit_kernel *k) {
    memset(k, 0, sizeof *k);
    k->attn = at->prim;
    k->attn_dtype = at->dtype;
    k->rows = at->units;
    k->grain = 1;
    k->param_buf = gj_rt_malloc((size_t)at->n_bufs * sizeof *k->param_buf);
    k->ints = gj_rt_malloc(GJ_ATTN_NI * sizeof *k->ints);
    if (!k->param_buf || !k->ints) {
        gj_rt_free(k->param_buf);
        gj_rt_free(k->ints);
        k->param_buf = NULL;
        k->ints = NULL;
        return -1;
    }
    memcpy(k->param_buf, at->bufs, (size_t)at->n_bufs * sizeof *k->param_buf);
    k->n_params = at->n_bufs;
    memcpy(k->ints, at->gi, sizeof at->gi);
    k->n_ints = GJ_ATTN_NI;
    return 0;
}

/* The plan's instructions in b->order: each planned instruction copied,
 * each fused group built into its kernel (plan_kernel.c); a kernel left
 * with nothing to store is dropped. */
static int pb_instrs(building *b) {
    planner *pl = &b->pl;
    gj_jit_plan *p = pl->p;
    for (int t = 0; t < b->n_live; t++) {
        const pinstr *ps = &pl->ps[b->order[t]];
        if (ps->kind == PS_BARRIER) continue;
        gj_jit_instr *st = &p->instrs[p->n_instrs++];
        st->pos = ps->pos;
        if (ps->kind == PS_MATMUL) {
            st->kind = GJ_JIT_INSTR_MATMUL;
            st->mm = pl->mms[ps->idx];
            continue;
        }
        if (ps->kind == PS_INDEX) {
            st->kind = GJ_JIT_INSTR_INDEX;
            st->ix = pl->ixs[ps->idx];
            continue;
        }
        if (ps->kind == PS_FOLD) {
            st->kind = GJ_JIT_INSTR_FOLD;
            st->fd = pl->fds[ps->idx];
            continue;
        }
        if (ps->kind == PS_LCE) {
            st->kind = GJ_JIT_INSTR_LCE;
            st->lc = pl->lcs[ps->idx];
            continue;
        }
        if (ps->kind == PS_ATTN) {
            st->kind = GJ_JIT_INSTR_KERNEL;
            if (attn_kernel(&pl->ats[ps->idx], &st->k) != 0) return gj_jit_pl_oom(pl);
            continue;
        }
        if (ps->kind == PS_HOOK) {
            st->kind = GJ_JIT_INSTR_HOOK;
            st->hk = pl->hks[ps->idx];
            continue;
        }
        if (ps->kind == PS_CALL) {
            st->kind = GJ_JIT_INSTR_CALL;
            st->cs = pl->cls[ps->idx];
            continue;
        }
        st->kind = GJ_JIT_INSTR_KERNEL;
        gj_jit_memo_clear(&b->memo);
        if (gj_jit_pl_kernel(pl, ps->idx, &st->k, &b->memo) != 0) {
            if (!pl->why[0])
                snprintf(pl->why, pl->why_cap, "kernel construction failed: %s", gj_last_error());
            return -1;
        }
        if (st->k.n_st == 0) {
            /* a group whose every value the kernels reading it compute
             * again (plan_nodes.c: need_value): nothing is left to run */
            gj_rt_free(st->k.acc);
            gj_rt_free(st->k.ex);
            gj_rt_free(st->k.st);
            gj_rt_free(st->k.param_buf);
            memset(st, 0, sizeof *st);
            p->n_instrs--;
        }
    }
    return 0;
}

/* The schedule (GEMM pairs), kernel names by position, shared kernels and
 * the memory plan. */
static int pb_finish(building *b) {
    gj_jit_plan *p = b->pl.p;
    if (gj_jit_schedule_order(p) != 0 || gj_jit_schedule_groups(p) != 0) return gj_jit_pl_oom(&b->pl);
    for (int s = 0; s < p->n_instrs; s++)
        if (p->instrs[s].kind == GJ_JIT_INSTR_KERNEL)
            snprintf(p->instrs[s].k.name, sizeof p->instrs[s].k.name, "k%d", s);
    if (gj_jit_dedupe_kernels(p) != 0 || gj_jit_plan_memory(p) != 0) return gj_jit_pl_oom(&b->pl);
    return 0;
}

/* Frees the planner's tables and the order's scratch (never the plan). */
static void pb_free(building *b) {
    planner *pl = &b->pl;
    for (int gi = 0; gi < pl->n_groups; gi++) {
        gj_rt_free(pl->groups[gi].nodes);
        gj_rt_free(pl->groups[gi].recomp);
    }
    gj_rt_free(pl->groups);
    gj_rt_free(pl->mms);
    gj_rt_free(pl->ixs);
    gj_rt_free(pl->hks);
    gj_rt_free(pl->cls);
    gj_rt_free(pl->fds);
    gj_rt_free(pl->ats);
    gj_rt_free(pl->lcs);
    for (int t = 0; t < pl->n_ps; t++) gj_rt_free(pl->ps[t].deps);
    gj_rt_free(pl->ps);
    gj_rt_free(pl->stack);
    gj_rt_free(pl->vi);
    gj_rt_free(pl->uses);
    gj_rt_free(b->memo.id);
    gj_rt_free(b->memo.set);
    gj_rt_free(b->order);
    gj_rt_free(b->is_placed);
}

int gj_jit_plan_build(const gj_jit_graph *g, gj_jit_plan *p, char *why, size_t why_cap) {
    building b;
    memset(&b, 0, sizeof b);
    memset(p, 0, sizeof *p);
    b.pl.g = g;
    b.pl.p = p;
    b.pl.why = why;
    b.pl.why_cap = why_cap;
    b.pl.last_hook_instr = -1;
    why[0] = '\0';
    int rc = pb_tables(&b);
    if (rc == 0) rc = pb_inputs(&b);
    if (rc == 0) rc = pb_nodes(&b);
    if (rc == 0) rc = pb_order(&b);
    if (rc == 0) rc = pb_instrs(&b);
    if (rc == 0) rc = pb_finish(&b);
    pb_free(&b);
    if (rc != 0) gj_jit_plan_free(p);
    return rc;
}

void gj_jit_plan_free(gj_jit_plan *p) {
    if (!p) return;
    for (int s = 0; s < p->n_instrs; s++) {
        gj_jit_kernel *k = &p->instrs[s].k;
        gj_rt_free(k->acc);
        gj_rt_free(k->ex);
        gj_rt_free(k->st);
        gj_rt_free(k->param_buf);
        gj_rt_free(k->ints);
    }
    gj_rt_free(p->instrs);
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

/* The plan printer's line for attention kernel k of instruction s. */
static void print_attn(FILE *f, int s, const gj_jit_kernel *k) {
    const int64_t *t = k->ints;
    fprintf(f, "  instr %d: kernel %s %s %s B=%lld H=%lld T=%lld S=%lld D=%lld E=%lld%s units=%lld "
               "bufs", s, k->name, gj_rt_prim_name((gj_rt_prim)k->attn),
            gj_rt_dtype_name(k->attn_dtype), (long long)t[GJ_ATTN_GI_B], (long long)t[GJ_ATTN_GI_H],
            (long long)t[GJ_ATTN_GI_T], (long long)t[GJ_ATTN_GI_S], (long long)t[GJ_ATTN_GI_D],
            (long long)t[GJ_ATTN_GI_E], t[GJ_ATTN_GI_CAUSAL] ? " causal" : "", (long long)k->rows);
    for (int q = 0; q < k->n_params; q++) fprintf(f, " b%d", k->param_buf[q]);
    fprintf(f, "\n");
}

/* The plan printer's lines for kernel k of instruction s. */
static void print_kernel(FILE *f, int s, const gj_jit_kernel *k) {
    char sh[160];
    if (k->attn) {
        print_attn(f, s, k);
        return;
    }
    gj_rt_fmt_shape(sh, sizeof sh, k->nd, k->dims);
    fprintf(f, "  instr %d: kernel %s over %s red=0x%x rows=%lld block=%lld grain=%lld", s,
            k->name, sh, (unsigned)k->red, (long long)k->rows, (long long)k->block,
            (long long)k->grain);
    if (k->run_dims > 1) fprintf(f, " run=%d dims", k->run_dims);
    fprintf(f, "\n");
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

void gj_jit_plan_print(const gj_jit_plan *p, FILE *f) {
    char sh[160];
    fprintf(f, "plan: %d instrs, %d buffers, peak of temporaries %zu bytes\n", p->n_instrs,
            p->n_bufs, p->peak_temp_bytes);
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        fprintf(f, "  b%d %s #%d %s x%lld", b, buf_kind_name(x->kind), x->index,
                gj_rt_dtype_name(x->dtype), (long long)x->numel);
        if (x->first_instr >= 0) fprintf(f, " live [%d, %d]", x->first_instr, x->last_instr);
        fprintf(f, "\n");
    }
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_instr *st = &p->instrs[s];
        if (st->kind == GJ_JIT_INSTR_CALL) {
            if (st->cs.tape == GJ_JIT_CALL_STEP_FWD)
                fprintf(f, "  instr %d: custom forward call of trace entry %d (", s, st->cs.node);
            else if (st->cs.tape <= GJ_JIT_CALL_GIVE)
                fprintf(f, "  instr %d: %s of parameter %d (", s,
                        st->cs.tape == GJ_JIT_CALL_GIVE   ? "reducer give"
                        : st->cs.tape == GJ_JIT_CALL_TAKE ? "reducer take"
                                                          : "post-accumulate hooks",
                        st->cs.node);
            else
                fprintf(f, "  instr %d: custom %s call of node %d tape %d (", s,
                        st->cs.fwd ? "forward" : "backward", st->cs.node, st->cs.tape);
            for (int k = 0; k < st->cs.n_in; k++) fprintf(f, "%sb%d", k ? ", " : "", st->cs.src_buf[k]);
            fprintf(f, ") ->");
            for (int k = 0; k < st->cs.n_out; k++) fprintf(f, " b%d", st->cs.out_buf[k]);
            fprintf(f, "\n");
            continue;
        }
        if (st->kind == GJ_JIT_INSTR_HOOK) {
            gj_rt_fmt_shape(sh, sizeof sh, st->hk.meta.ndim, st->hk.meta.shape);
            fprintf(f, "  instr %d: b%d = hook #%d(b%d) %s %s\n", s, st->hk.out_buf, st->hk.hook,
                    st->hk.src_buf, gj_rt_dtype_name(st->hk.meta.dtype), sh);
            continue;
        }
        if (st->kind == GJ_JIT_INSTR_LCE) {
            const gj_jit_lce *x = &st->lc;
            fprintf(f, "  instr %d: b%d = linear_cross_entropy(b%d+%lld, b%d+%lld, b%d+%lld, b%d+%lld) "
                    "%s N=%lld C=%lld V=%lld ignore=%lld grads=b%d+%lld,b%d+%lld,b%d+%lld\n", s,
                    x->out_buf[0], x->h_buf, (long long)x->h_off, x->w_buf, (long long)x->w_off,
                    x->lab_buf, (long long)x->lab_off, x->b_buf, (long long)x->b_off,
                    gj_rt_dtype_name(x->dtype), (long long)x->N, (long long)x->C, (long long)x->V,
                    (long long)x->ignore, x->out_buf[1], (long long)x->out_off[1], x->out_buf[2],
                    (long long)x->out_off[2], x->out_buf[3], (long long)x->out_off[3]);
            continue;
        }
        if (st->kind == GJ_JIT_INSTR_FOLD) {
            const gj_jit_fold *x = &st->fd;
            const gj_rt_win *w = &x->win;
            fprintf(f, "  instr %d: %s b%d = b%d+%lld %s N=%lld C=%lld H=%lld W=%lld kernel=%lldx%lld "
                    "stride=%lldx%lld pad=%lldx%lld dilation=%lldx%lld out=%lldx%lld\n", s,
                    x->col2im ? "col2im" : "im2col", x->out_buf, x->src_buf, (long long)x->src_off,
                    gj_rt_dtype_name(x->dtype), (long long)w->N, (long long)w->C, (long long)w->H,
                    (long long)w->W, (long long)w->kh, (long long)w->kw, (long long)w->sh,
                    (long long)w->sw, (long long)w->ph, (long long)w->pw, (long long)w->dh,
                    (long long)w->dw, (long long)w->OH, (long long)w->OW);
            continue;
        }
        if (st->kind == GJ_JIT_INSTR_INDEX) {
            const gj_jit_index *x = &st->ix;
            fprintf(f, "  instr %d: %s b%d = b%d [b%d] %s n=%lld D=%lld V=%lld\n", s,
                    x->scatter ? "scatter_add_rows" : "gather_rows", x->out_buf, x->src_buf,
                    x->idx_buf, gj_rt_dtype_name(x->dtype), (long long)x->n, (long long)x->D,
                    (long long)x->V);
            continue;
        }
        if (st->kind == GJ_JIT_INSTR_MATMUL) {
            const gj_jit_matmul *m = &st->mm;
            int g0 = s;
            while (g0 > 0 && p->instrs[g0 - 1].group_end == st->group_end) g0--;
            char grp[48] = "";
            if (st->group_end - g0 > 1)
                snprintf(grp, sizeof grp, "  [side by side: instrs %d..%d]", g0, st->group_end - 1);
            fprintf(f, "  instr %d: %s b%d %s b%d%s @ b%d%s  M=%lld N=%lld K=%lld batch=%d%s\n", s,
                    m->dtype == GJ_F64 ? "dgemm" : m->bf16 ? "bgemm" : "sgemm", m->c_buf, m->accumulate ? "+=" : "=",
                    m->a_buf, m->ta ? "^T" : "",
                    m->b_buf, m->tb ? "^T" : "", (long long)m->M, (long long)m->N,
                    (long long)m->K, m->nb, grp);
            continue;
        }
        print_kernel(f, s, &st->k);
    }
}
