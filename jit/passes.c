/*
 * passes.c - graph-to-graph passes on the IR: common-subexpression
 * elimination and dead-code elimination.
 *
 * Invariants: the rewritten graph computes the same outputs from the same
 * inputs (graph inputs are all kept, in order and with their roles, since a
 * cached program is fed its inputs by position); node order stays a
 * topological order; only nodes with a live output survive.
 */
#include "ir.h"

#include <string.h>

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
    h = hmix(h, (uint64_t)in->ndim);
    for (int k = 0; k < in->ndim && k < GJ_MAX_DIMS; k++) h = hmix(h, (uint64_t)in->shape[k]);
    for (int k = 0; k < in->n_in; k++) h = hmix(h, (uint64_t)args[k]);
    return h;
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
        uint64_t h = node_hash(&n->inst, n->in) & (uint64_t)(ntab - 1);
        for (;; h = (h + 1) & (uint64_t)(ntab - 1)) {
            int j = tab[h];
            if (j < 0) {
                tab[h] = i;
                break;
            }
            const gj_jit_node *m = &g->nodes[j];
            if (gj_jit_inst_equal(&m->inst, &n->inst) &&
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
        bool live = false;
        for (int k = 0; k < n->n_out; k++) live |= live_v[n->out[k]] && repl[n->out[k]] == n->out[k];
        if (!live) continue;
        live_n[i] = true;
        for (int k = 0; k < n->inst.n_in; k++) live_v[n->in[k]] = true;
    }
    /* rebuild: inputs first (same order), then live nodes */
    for (int v = 0; v < nv; v++) newid[v] = -1;
    for (int k = 0; k < g->n_inputs; k++) {
        const gj_jit_input *in = &g->inputs[k];
        int v = gj_jit_graph_add_input(&ng, &g->values[in->value].meta, in->role, in->node,
                                       in->slot);
        if (v < 0) goto done;
        newid[in->value] = v;
    }
    for (int i = 0; i < nn; i++) {
        if (!live_n[i]) continue;
        const gj_jit_node *n = &g->nodes[i];
        int args[GJ_RT_MAX_INPUTS], outs[GJ_RT_MAX_OUTPUTS];
        for (int k = 0; k < n->inst.n_in; k++) args[k] = newid[n->in[k]];
        int no = gj_jit_graph_add_node(&ng, &n->inst, args, outs);
        if (no < 0) goto done;
        ng.nodes[ng.n_nodes - 1].rt_node = n->rt_node;
        for (int k = 0; k < no && k < n->n_out; k++) newid[n->out[k]] = outs[k];
    }
    for (int o = 0; o < g->n_outputs; o++) {
        const gj_jit_output *out = &g->outputs[o];
        if (gj_jit_graph_add_output(&ng, newid[out->value], out->acc_node, out->grad_input) != 0)
            goto done;
    }
    gj_jit_graph_free(g);
    *g = ng;
    gj_jit_graph_init(&ng);
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
