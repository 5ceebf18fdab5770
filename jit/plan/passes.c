/* SPDX-License-Identifier: MIT */
/*
 * passes.c - graph-to-graph passes on the IR: common-subexpression
 * elimination, dead-code elimination and legalisation (a bf16 MATMUL
 * becomes casts around an f32 one, which is what the eager kernel does).
 *
 * Invariants: the rewritten graph computes the same outputs from the same
 * inputs (graph inputs are all kept, in order and with their roles, since a
 * cached program is fed its inputs by position); node order stays a
 * topological order; only nodes with a live output survive.
 */
#include "jit/ir/ir.h"

#include <string.h>

/* Starts a rebuild: every input of g, in order and with its role and
 * strides, into ng; their new ids into newid. 0 or -1. */
int gj_jit_graph_copy_inputs(gj_jit_graph *ng, const gj_jit_graph *g, int *newid) {
    for (int k = 0; k < g->n_inputs; k++) {
        const gj_jit_input *in = &g->inputs[k];
        int v = gj_jit_graph_add_input(ng, &g->values[in->value].meta, in->role, in->node,
                                       in->slot);
        if (v < 0) return -1;
        memcpy(ng->inputs[ng->n_inputs - 1].strides, in->strides, sizeof in->strides);
        newid[in->value] = v;
    }
    return 0;
}

/* Appends node n of the old graph to ng with its inputs renamed to args,
 * keeping its origin (rt_node, hook), and records the new ids of its
 * outputs in newid. 0 or -1. */
int gj_jit_graph_copy_node(gj_jit_graph *ng, const gj_jit_graph *g, const gj_jit_node *n,
                           const int *args, int *newid) {
    int outs[GJ_RT_MAX_OUTPUTS];
    if (n->custom >= 0) { /* an opaque call: its output metas are its own */
        gj_rt_meta om[GJ_RT_MAX_OUTPUTS];
        for (int k = 0; k < n->n_out; k++) om[k] = g->values[n->out[k]].meta;
        if (gj_jit_graph_add_custom(ng, n->custom, n->custom_tape, n->custom_args,
                                    n->inst.n_in, args, n->n_out, om, outs) < 0)
            return -1;
        ng->nodes[ng->n_nodes - 1].custom_fwd = n->custom_fwd;
        ng->nodes[ng->n_nodes - 1].phase = n->phase;
        ng->nodes[ng->n_nodes - 1].pinned = n->pinned;
        ng->nodes[ng->n_nodes - 1].apart = n->apart;
        for (int k = 0; k < n->n_out; k++) newid[n->out[k]] = outs[k];
        return 0;
    }
    int no = gj_jit_graph_add_node(ng, &n->inst, args, outs);
    if (no < 0) return -1;
    ng->nodes[ng->n_nodes - 1].rt_node = n->rt_node;
    ng->nodes[ng->n_nodes - 1].rt_tape = n->rt_tape;
    ng->nodes[ng->n_nodes - 1].hook = n->hook;
    ng->nodes[ng->n_nodes - 1].phase = n->phase;
    ng->nodes[ng->n_nodes - 1].remat = n->remat;
    ng->nodes[ng->n_nodes - 1].apart = n->apart;
    ng->nodes[ng->n_nodes - 1].pinned = n->pinned;
    for (int k = 0; k < no && k < n->n_out; k++) newid[n->out[k]] = outs[k];
    return 0;
}

/* Ends a rebuild: ng gets g's outputs (renamed through newid) and hook
 * table, then replaces g (ng is left empty). 0 or -1 (g unchanged). */
int gj_jit_graph_finish_rebuild(gj_jit_graph *g, gj_jit_graph *ng, const int *newid) {
    for (int o = 0; o < g->n_outputs; o++) {
        const gj_jit_output *out = &g->outputs[o];
        if (gj_jit_graph_add_output(ng, newid[out->value], out->acc_node, out->grad_input) != 0)
            return -1;
    }
    if (gj_jit_graph_copy_hooks(ng, g) != 0) return -1;
    gj_jit_graph_free(g);
    *g = *ng;
    gj_jit_graph_init(ng);
    return 0;
}

static uint64_t hmix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

static uint64_t node_hash(const gj_rt_inst *in, const int *args) {
    uint64_t h = hmix(0, (uint64_t)in->prim);
    uint64_t sb;
    memcpy(&sb, &in->scalar, sizeof sb);
    h = hmix(h, sb);
    h = hmix(h, (uint64_t)in->axes ^ ((uint64_t)in->dtype << 32));
    h = hmix(h, (uint64_t)in->ndim ^ ((uint64_t)in->ta << 40) ^ ((uint64_t)in->tb << 41) ^
                    ((uint64_t)in->wide << 42));
    for (int k = 0; k < in->ndim && k < GJ_MAX_DIMS; k++) h = hmix(h, (uint64_t)in->shape[k]);
    for (int k = 0; k < in->n_in; k++) h = hmix(h, (uint64_t)args[k]);
    return h;
}

/* A bf16 MATMUL as the eager kernel runs it: the wide product of the bf16
 * operands (f32, gj_rt_bgemm's blocks), rounded once to bf16 by a CAST that
 * fuses into the kernel reading it. Appends the nodes to ng; *out receives
 * the result. 0 or -1 (OOM). */
static int legal_bf16_matmul(gj_jit_graph *ng, const gj_jit_node *mm, const int *args, int *out) {
    gj_rt_inst wide = mm->inst;
    wide.wide = true;
    gj_rt_inst down = {.prim = GJ_P_CAST, .n_in = 1, .dtype = GJ_BF16};
    int r;
    if (gj_jit_graph_add_node(ng, &wide, args, &r) < 0) return -1;
    if (gj_jit_graph_add_node(ng, &down, &r, out) < 0) return -1;
    for (int k = 1; k <= 2; k++) { /* both of the matmul's phase and marks */
        ng->nodes[ng->n_nodes - k].phase = mm->phase;
        ng->nodes[ng->n_nodes - k].remat = mm->remat;
        ng->nodes[ng->n_nodes - k].apart = mm->apart;
        ng->nodes[ng->n_nodes - k].pinned = mm->pinned;
    }
    return 0;
}

int gj_jit_pass_cse_dce(gj_jit_graph *g) {
    int rc = -1;
    int nv = g->n_values, nn = g->n_nodes;
    int *repl = gj_rt_malloc((size_t)(nv + 1) * sizeof *repl);
    int64_t ntab = 16;
    while (ntab < (int64_t)nn * 2 + 2) ntab *= 2;
    int *tab = gj_rt_malloc((size_t)ntab * sizeof *tab);
    bool *live_v = gj_rt_calloc((size_t)nv + 1, sizeof *live_v);
    bool *live_n = gj_rt_calloc((size_t)nn + 1, sizeof *live_n);
    int *newid = gj_rt_malloc((size_t)(nv + 1) * sizeof *newid);
    gj_jit_graph ng;
    gj_jit_graph_init(&ng);
    if (!repl || !tab || !live_v || !live_n || !newid) goto done;
    for (int v = 0; v < nv; v++) repl[v] = v;
    for (int64_t s = 0; s < ntab; s++) tab[s] = -1;

    /* CSE: the first node computing (inst, canonical inputs) wins */
    for (int i = 0; i < nn; i++) {
        gj_jit_node *n = &g->nodes[i];
        for (int k = 0; k < n->inst.n_in; k++) n->in[k] = repl[n->in[k]];
        if (n->hook >= 0 || n->custom >= 0) continue; /* an opaque call: never merged */
        uint64_t h = node_hash(&n->inst, n->in) & (uint64_t)(ntab - 1);
        for (;; h = (h + 1) & (uint64_t)(ntab - 1)) {
            int j = tab[h];
            if (j < 0) {
                tab[h] = i;
                break;
            }
            const gj_jit_node *m = &g->nodes[j];
            if (m->phase == n->phase && gj_jit_inst_equal(&m->inst, &n->inst) &&
                memcmp(m->in, n->in, (size_t)n->inst.n_in * sizeof n->in[0]) == 0) {
                for (int k = 0; k < n->n_out; k++) repl[n->out[k]] = m->out[k];
                break;
            }
        }
    }
    /* DCE: live from the outputs backwards */
    for (int o = 0; o < g->n_outputs; o++) {
        g->outputs[o].value = repl[g->outputs[o].value];
        live_v[g->outputs[o].value] = true;
    }
    for (int i = nn - 1; i >= 0; i--) {
        const gj_jit_node *n = &g->nodes[i];
        bool live = n->hook >= 0 || n->custom >= 0; /* calls have effects: always kept */
        for (int k = 0; k < n->n_out; k++) live |= live_v[n->out[k]] && repl[n->out[k]] == n->out[k];
        if (!live) continue;
        live_n[i] = true;
        for (int k = 0; k < n->inst.n_in; k++) live_v[n->in[k]] = true;
    }
    /* rebuild: inputs first (same order), then live nodes */
    for (int v = 0; v < nv; v++) newid[v] = -1;
    if (gj_jit_graph_copy_inputs(&ng, g, newid) != 0) goto done;
    for (int i = 0; i < nn; i++) {
        if (!live_n[i]) continue;
        const gj_jit_node *n = &g->nodes[i];
        int args[GJ_RT_MAX_INPUTS];
        for (int k = 0; k < n->inst.n_in; k++) args[k] = newid[n->in[k]];
        if (n->inst.prim == GJ_P_MATMUL && g->values[n->out[0]].meta.dtype == GJ_BF16) {
            if (legal_bf16_matmul(&ng, n, args, &newid[n->out[0]]) != 0) goto done;
            continue;
        }
        if (gj_jit_graph_copy_node(&ng, g, n, args, newid) != 0) goto done;
    }
    if (gj_jit_graph_finish_rebuild(g, &ng, newid) != 0) goto done;
    rc = 0;
done:
    gj_jit_graph_free(&ng);
    gj_rt_free(repl);
    gj_rt_free(tab);
    gj_rt_free(live_v);
    gj_rt_free(live_n);
    gj_rt_free(newid);
    return rc;
}

/* ------------------------------------------------------------ pad sums */

/* A set of PAD pieces summed together: piece values placed at starts along
 * one axis of one output meta, pairwise disjoint. */
typedef struct pad_set {
    int n;
    int axis;
    int piece[GJ_RT_MAX_INPUTS];
    int64_t start[GJ_RT_MAX_INPUTS], len[GJ_RT_MAX_INPUTS];
} pad_set;

/* The pad set value v stands for (v is a single-use PAD, or a single-use
 * ADD of two pad sets with the same axis and meta, disjoint), or false. */
static bool pad_set_of(const gj_jit_graph *g, const int *uses, int v, bool root, pad_set *ps) {
    const gj_jit_value *val = &g->values[v];
    if (val->node < 0 || (!root && uses[v] != 1)) return false;
    const gj_jit_node *n = &g->nodes[val->node];
    if (n->inst.prim == GJ_P_PAD) {
        const gj_rt_meta *m = &val->meta;
        int ax = n->inst.axis < 0 ? n->inst.axis + m->ndim : n->inst.axis;
        ps->n = 1;
        ps->axis = ax;
        ps->piece[0] = n->in[0];
        ps->start[0] = n->inst.start;
        ps->len[0] = g->values[n->in[0]].meta.shape[ax];
        return true;
    }
    if (n->inst.prim != GJ_P_ADD) return false;
    const gj_rt_meta *a = &g->values[n->in[0]].meta, *b = &g->values[n->in[1]].meta;
    if (!gj_jit_meta_equal(a, &val->meta) || !gj_jit_meta_equal(b, &val->meta)) return false;
    pad_set x, y;
    if (!pad_set_of(g, uses, n->in[0], false, &x) || !pad_set_of(g, uses, n->in[1], false, &y))
        return false;
    if (x.axis != y.axis || x.n + y.n > GJ_RT_MAX_INPUTS) return false;
    for (int i = 0; i < x.n; i++)
        for (int j = 0; j < y.n; j++)
            if (x.start[i] < y.start[j] + y.len[j] && y.start[j] < x.start[i] + x.len[i])
                return false;
    *ps = x;
    for (int j = 0; j < y.n; j++) {
        ps->piece[ps->n] = y.piece[j];
        ps->start[ps->n] = y.start[j];
        ps->len[ps->n++] = y.len[j];
    }
    return true;
}

int gj_jit_pass_pad_sums(gj_jit_graph *g, bool *changed) {
    *changed = false;
    int rc = -1, nv = g->n_values;
    int *uses = gj_rt_calloc((size_t)nv + 1, sizeof *uses);
    int *newid = gj_rt_malloc((size_t)(nv + 1) * sizeof *newid);
    gj_jit_graph ng;
    gj_jit_graph_init(&ng);
    if (!uses || !newid) goto done;
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < g->nodes[i].inst.n_in; k++) uses[g->nodes[i].in[k]]++;
    for (int o = 0; o < g->n_outputs; o++) uses[g->outputs[o].value] += 2; /* never inner */
    for (int v = 0; v < nv; v++) newid[v] = -1;
    if (gj_jit_graph_copy_inputs(&ng, g, newid) != 0) goto done;
    for (int i = 0; i < g->n_nodes; i++) {
        const gj_jit_node *n = &g->nodes[i];
        int args[GJ_RT_MAX_INPUTS];
        pad_set ps;
        /* the root of a sum of >= 2 disjoint pads: the consumer is not an ADD
         * that would extend the set */
        bool root = n->inst.prim == GJ_P_ADD && pad_set_of(g, uses, n->out[0], true, &ps) &&
                    ps.n >= 2;
        if (root) { /* at most GJ_RT_MAX_INPUTS parts (pieces and zero gaps) in a CAT */
            const gj_rt_meta *om = &g->values[n->out[0]].meta;
            int64_t covered = 0;
            int gaps = 0;
            for (int j = 0; j < ps.n; j++) covered += ps.len[j];
            for (int j = 0; j < ps.n; j++) { /* a gap before piece j, unless another ends there */
                bool touched = ps.start[j] == 0;
                for (int q = 0; q < ps.n && !touched; q++) touched = ps.start[q] + ps.len[q] == ps.start[j];
                gaps += !touched;
            }
            gaps += covered < om->shape[ps.axis]; /* at most one more (the end), a bound */
            root = ps.n + gaps <= GJ_RT_MAX_INPUTS;
        }
        if (root && uses[n->out[0]] == 1) {
            for (int j = i + 1; j < g->n_nodes; j++) {
                const gj_jit_node *c = &g->nodes[j];
                bool reads = false;
                for (int k = 0; k < c->inst.n_in; k++) reads |= c->in[k] == n->out[0];
                pad_set big;
                if (reads && c->inst.prim == GJ_P_ADD && pad_set_of(g, uses, c->out[0], true, &big))
                    root = false;
            }
        }
        if (root) {
            /* CAT of the pieces by start, zeros in the gaps; each piece + 0.0,
             * as the eager sum of pads gives it (-0.0 becomes +0.0). The
             * pieces are disjoint, so they sort by start without ties. */
            const gj_rt_meta *om = &g->values[n->out[0]].meta;
            int ax = ps.axis, parts[GJ_RT_MAX_INPUTS], np = 0;
            int64_t at = 0;
            gj_rt_inst fill = {.prim = GJ_P_FILL, .n_in = 0, .dtype = om->dtype,
                               .ndim = om->ndim, .scalar = 0.0};
            memcpy(fill.shape, om->shape, sizeof fill.shape);
            gj_rt_inst z = {.prim = GJ_P_ADD_SCALAR, .n_in = 1, .scalar = 0.0};
            for (int q = 0; q < ps.n; q++) {
                int best = -1;
                for (int j = 0; j < ps.n; j++)
                    if (ps.start[j] >= at && (best < 0 || ps.start[j] < ps.start[best])) best = j;
                if (ps.start[best] > at) { /* a gap of zeros */
                    fill.shape[ax] = ps.start[best] - at;
                    if (np >= GJ_RT_MAX_INPUTS || gj_jit_graph_add_node(&ng, &fill, NULL, &parts[np++]) < 0)
                        goto done;
                }
                int src = newid[ps.piece[best]];
                if (np >= GJ_RT_MAX_INPUTS || gj_jit_graph_add_node(&ng, &z, &src, &parts[np++]) < 0)
                    goto done;
                at = ps.start[best] + ps.len[best];
            }
            if (at < om->shape[ax]) {
                fill.shape[ax] = om->shape[ax] - at;
                if (np >= GJ_RT_MAX_INPUTS || gj_jit_graph_add_node(&ng, &fill, NULL, &parts[np++]) < 0)
                    goto done;
            }
            gj_rt_inst cat = {.prim = GJ_P_CAT, .n_in = np, .axis = ax};
            if (gj_jit_graph_add_node(&ng, &cat, parts, &newid[n->out[0]]) < 0) goto done;
            *changed = true;
            continue;
        }
        for (int k = 0; k < n->inst.n_in; k++) args[k] = newid[n->in[k]];
        if (gj_jit_graph_copy_node(&ng, g, n, args, newid) != 0) goto done;
    }
    if (gj_jit_graph_finish_rebuild(g, &ng, newid) != 0) goto done;
    rc = 0;
done:
    gj_jit_graph_free(&ng);
    gj_rt_free(uses);
    gj_rt_free(newid);
    return rc;
}
