/* SPDX-License-Identifier: MIT */
/*
 * ir.c - the graph IR: building, printing, instruction equality, and the
 * GRADJIT_LOG switches of jit/.
 *
 * Invariants: see ir.h. Arrays grow by doubling (gj_jit_grow, base.h); a
 * failed growth leaves the graph unchanged (and consistent) and reports -1.
 */
#include "jit/ir/ir.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

void gj_jit_graph_init(gj_jit_graph *g) { memset(g, 0, sizeof *g); }

void gj_jit_graph_free(gj_jit_graph *g) {
    if (!g) return;
    gj_rt_free(g->nodes);
    gj_rt_free(g->values);
    gj_rt_free(g->inputs);
    gj_rt_free(g->outputs);
    gj_rt_free(g->hooks);
    memset(g, 0, sizeof *g);
}

static int add_value(gj_jit_graph *g, const gj_rt_meta *m, int node, int index) {
    if (gj_jit_grow((void **)&g->values, g->n_values, &g->cap_values, sizeof *g->values) != 0)
        return -1;
    gj_jit_value *v = &g->values[g->n_values];
    memset(v, 0, sizeof *v);
    v->meta = *m;
    v->node = node;
    v->index = index;
    return g->n_values++;
}

int gj_jit_graph_add_input(gj_jit_graph *g, const gj_rt_meta *m, gj_jit_role role, int node,
                           int slot) {
    if (gj_jit_grow((void **)&g->inputs, g->n_inputs, &g->cap_inputs, sizeof *g->inputs) != 0)
        return -1;
    int v = add_value(g, m, -1, g->n_inputs);
    if (v < 0) return -1;
    gj_jit_input *in = &g->inputs[g->n_inputs++];
    memset(in, 0, sizeof *in);
    in->role = role;
    in->value = v;
    in->node = node;
    in->slot = slot;
    gj_rt_contiguous_strides(m->ndim, m->shape, in->strides);
    return v;
}

void gj_jit_input_strides(const gj_tensor *t, int64_t *strides) {
    int64_t cs[GJ_MAX_DIMS];
    gj_rt_contiguous_strides(t->ndim, t->shape, cs);
    memset(strides, 0, GJ_MAX_DIMS * sizeof *strides);
    for (int k = 0; k < t->ndim; k++) strides[k] = t->shape[k] == 1 ? cs[k] : t->strides[k];
}

bool gj_jit_strides_contiguous(const gj_rt_meta *m, const int64_t *strides) {
    int64_t cs[GJ_MAX_DIMS];
    gj_rt_contiguous_strides(m->ndim, m->shape, cs);
    for (int k = 0; k < m->ndim; k++)
        if (m->shape[k] > 1 && strides[k] != cs[k]) return false;
    return true;
}

/* Room for one more node and n_out more values (reserved together, so a
 * failure leaves no half node); returns the next node slot, zeroed, with
 * no origin (rt_node, hook, custom = -1), or NULL on OOM. */
static gj_jit_node *node_reserve(gj_jit_graph *g, int n_out) {
    if (gj_jit_grow((void **)&g->nodes, g->n_nodes, &g->cap_nodes, sizeof *g->nodes) != 0) return NULL;
    if (g->n_values + n_out > g->cap_values) {
        int nc = g->cap_values ? g->cap_values : 16;
        while (nc < g->n_values + n_out) nc *= 2;
        void *p = gj_rt_realloc(g->values, (size_t)nc * sizeof *g->values);
        if (!p) return NULL;
        g->values = p;
        g->cap_values = nc;
    }
    gj_jit_node *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->rt_node = -1;
    n->rt_tape = -1;
    n->hook = -1;
    n->custom = -1;
    n->custom_tape = -1;
    return n;
}

/* Completes the node reserved by node_reserve: inputs, one value per
 * output (ids to outs if non-NULL). Cannot fail; returns n_out. */
static int node_commit(gj_jit_graph *g, gj_jit_node *n, const int *in, int n_in,
                       const gj_rt_meta *out_meta, int n_out, int *outs) {
    int id = g->n_nodes;
    for (int i = 0; i < n_in; i++) n->in[i] = in[i];
    n->n_out = n_out;
    for (int k = 0; k < n_out; k++) {
        n->out[k] = add_value(g, &out_meta[k], id, k);
        if (outs) outs[k] = n->out[k];
    }
    g->n_nodes++;
    return n_out;
}

int gj_jit_graph_add_node(gj_jit_graph *g, const gj_rt_inst *inst, const int *in, int *outs) {
    gj_rt_meta in_meta[GJ_RT_MAX_INPUTS], out_meta[GJ_RT_MAX_OUTPUTS];
    if (inst->n_in < 0 || inst->n_in > GJ_RT_MAX_INPUTS) {
        gj_rt_set_error("jit: instruction %s with %d inputs", gj_rt_prim_name(inst->prim),
                        inst->n_in);
        return -1;
    }
    for (int i = 0; i < inst->n_in; i++) {
        if (in[i] < 0 || in[i] >= g->n_values) {
            gj_rt_set_error("jit: instruction %s reads an undefined value",
                            gj_rt_prim_name(inst->prim));
            return -1;
        }
        in_meta[i] = g->values[in[i]].meta;
    }
    int n_out = gj_rt_infer(inst, in_meta, out_meta);
    if (n_out < 0) return -1;
    gj_jit_node *n = node_reserve(g, n_out);
    if (!n) return -1;
    n->inst = *inst;
    return node_commit(g, n, in, inst->n_in, out_meta, n_out, outs);
}

int gj_jit_graph_add_custom(gj_jit_graph *g, int rt_node, int tape, uint32_t args, int n_in,
                            const int *in, int n_out, const gj_rt_meta *out_meta, int *outs) {
    if (n_in < 0 || n_in > GJ_RT_MAX_INPUTS || n_out < 0 || n_out > GJ_RT_MAX_OUTPUTS) {
        gj_rt_set_error("jit: custom call with %d inputs and %d outputs", n_in, n_out);
        return -1;
    }
    for (int i = 0; i < n_in; i++)
        if (in[i] < 0 || in[i] >= g->n_values) {
            gj_rt_set_error("jit: custom call reads an undefined value");
            return -1;
        }
    gj_jit_node *n = node_reserve(g, n_out);
    if (!n) return -1;
    n->inst.prim = GJ_P_COPY;
    n->inst.n_in = n_in;
    n->custom = rt_node;
    n->custom_args = args;
    n->custom_tape = tape;
    return node_commit(g, n, in, n_in, out_meta, n_out, outs);
}

int gj_jit_graph_add_output(gj_jit_graph *g, int value, int acc_node, int grad_input) {
    if (gj_jit_grow((void **)&g->outputs, g->n_outputs, &g->cap_outputs, sizeof *g->outputs) != 0)
        return -1;
    gj_jit_output *o = &g->outputs[g->n_outputs++];
    o->value = value;
    o->acc_node = acc_node;
    o->grad_input = grad_input;
    return 0;
}

char *gj_jit_fmt_meta(char *buf, size_t cap, const gj_rt_meta *m) {
    char sh[160];
    gj_rt_fmt_shape(sh, sizeof sh, m->ndim, m->shape);
    snprintf(buf, cap, "%s%s", gj_rt_dtype_name(m->dtype), sh);
    return buf;
}

bool gj_jit_meta_equal(const gj_rt_meta *a, const gj_rt_meta *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim) return false;
    for (int k = 0; k < a->ndim; k++)
        if (a->shape[k] != b->shape[k]) return false;
    return true;
}

bool gj_jit_inst_equal(const gj_rt_inst *a, const gj_rt_inst *b) {
    if (a->prim != b->prim || a->n_in != b->n_in || a->dtype != b->dtype || a->axes != b->axes ||
        a->keepdim != b->keepdim || a->ta != b->ta || a->tb != b->tb || a->wide != b->wide ||
        a->axis != b->axis ||
        a->start != b->start || a->len != b->len || a->seed != b->seed ||
        a->rng_offset != b->rng_offset || a->ndim != b->ndim)
        return false;
    if (memcmp(&a->scalar, &b->scalar, sizeof a->scalar) != 0 ||
        memcmp(&a->scalar2, &b->scalar2, sizeof a->scalar2) != 0)
        return false;
    for (int k = 0; k < a->ndim && k < GJ_MAX_DIMS; k++)
        if (a->shape[k] != b->shape[k]) return false;
    return true;
}

bool gj_jit_prim_is_elementwise(gj_rt_prim p) {
    return (p >= GJ_P_NEG && p <= GJ_P_WHERE) || p == GJ_P_COPY;
}

bool gj_jit_prim_is_composite(gj_rt_prim p) { return p >= GJ_P_SOFTMAX && p <= GJ_P_CE_BWD; }

bool gj_jit_prim_is_movement(gj_rt_prim p) {
    return p == GJ_P_RESHAPE || p == GJ_P_PERMUTE || p == GJ_P_EXPAND || p == GJ_P_SLICE;
}

/* The attributes of inst that matter for its primitive, as text. */
static void fmt_attrs(char *buf, size_t cap, const gj_rt_inst *in) {
    char sh[160];
    buf[0] = '\0';
    switch (in->prim) {
    case GJ_P_ADD_SCALAR:
    case GJ_P_MUL_SCALAR:
    case GJ_P_POW_SCALAR:
        snprintf(buf, cap, " c=%.9g", in->scalar);
        break;
    case GJ_P_CAST:
        snprintf(buf, cap, " to=%s", gj_rt_dtype_name(in->dtype));
        break;
    case GJ_P_FILL:
        snprintf(buf, cap, " value=%.9g", in->scalar);
        break;
    case GJ_P_DROPOUT_MASK:
        snprintf(buf, cap, " p=%.9g seed=%llu offset=%llu", in->scalar,
                 (unsigned long long)in->seed, (unsigned long long)in->rng_offset);
        break;
    case GJ_P_SUM:
    case GJ_P_MAX:
        snprintf(buf, cap, " axes=0x%x%s", (unsigned)in->axes, in->keepdim ? " keepdim" : "");
        break;
    case GJ_P_PERMUTE:
        gj_rt_fmt_shape(sh, sizeof sh, in->ndim, in->shape);
        snprintf(buf, cap, " perm=%s", sh);
        break;
    case GJ_P_SLICE:
    case GJ_P_PAD:
        snprintf(buf, cap, " axis=%d start=%lld len=%lld", in->axis, (long long)in->start,
                 (long long)in->len);
        break;
    case GJ_P_CAT:
        snprintf(buf, cap, " axis=%d", in->axis);
        break;
    case GJ_P_MATMUL:
        snprintf(buf, cap, "%s%s%s", in->ta ? " ta" : "", in->tb ? " tb" : "",
                 in->wide ? " wide" : "");
        break;
    case GJ_P_SCATTER_ADD_ROWS:
        snprintf(buf, cap, " rows=%lld", (long long)in->len);
        break;
    default:
        break;
    }
}

static const char *role_name(gj_jit_role r) {
    switch (r) {
    case GJ_JIT_IN_SAVED: return "saved";
    case GJ_JIT_IN_SEED: return "seed";
    case GJ_JIT_IN_GRAD: return "grad";
    default: return "other";
    }
}

/* " 'name'" of the leaf of accumulate node acc, when the graph knows it. */
static const char *acc_label(const gj_jit_graph *g, int acc, char *buf, size_t cap) {
    if (!g->walk_nodes || acc < 0 || acc >= g->n_walk_nodes || !g->walk_nodes[acc]) return "";
    return gj_rt_tensor_label(g->walk_nodes[acc]->leaf, buf, cap);
}

void gj_jit_graph_print(const gj_jit_graph *g, FILE *f) {
    char nb[300];
    char mb[200], ab[200];
    fprintf(f, "graph: %d inputs, %d nodes, %d outputs\n", g->n_inputs, g->n_nodes,
            g->n_outputs);
    for (int i = 0; i < g->n_inputs; i++) {
        const gj_jit_input *in = &g->inputs[i];
        gj_jit_fmt_meta(mb, sizeof mb, &g->values[in->value].meta);
        fprintf(f, "  %%%d = input #%d %s", in->value, i, role_name(in->role));
        if (in->role == GJ_JIT_IN_SAVED) fprintf(f, " node %d slot %d", in->node, in->slot);
        if (in->role == GJ_JIT_IN_SEED) fprintf(f, " root %d", in->slot);
        if (in->role == GJ_JIT_IN_GRAD)
            fprintf(f, " of acc node %d%s", in->node, acc_label(g, in->node, nb, sizeof nb));
        fprintf(f, " : %s\n", mb);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const gj_jit_node *n = &g->nodes[i];
        fprintf(f, " ");
        for (int k = 0; k < n->n_out; k++) fprintf(f, "%s %%%d", k ? "," : "", n->out[k]);
        if (n->custom >= 0 && n->custom_tape == GJ_JIT_CALL_STEP_FWD) {
            fprintf(f, " = call_custom_fwd[trace entry %d](", n->custom);
        } else if (n->custom >= 0 && n->custom_tape <= GJ_JIT_CALL_GIVE) {
            fprintf(f, " = %s[param %d](",
                    n->custom_tape == GJ_JIT_CALL_GIVE   ? "reduce_give"
                    : n->custom_tape == GJ_JIT_CALL_TAKE ? "reduce_take"
                                                         : "post_hooks",
                    n->custom);
        } else if (n->custom >= 0) {
            fprintf(f, " = call_custom%s[node %d tape %d](", n->custom_fwd ? "_fwd" : "",
                    n->custom, n->custom_tape);
        } else if (n->hook >= 0) {
            const gj_jit_hookref *h = &g->hooks[n->hook];
            fprintf(f, " = call_hook#%d[node %d out %d #%d](", n->hook, h->node, h->k, h->j);
        } else {
            fprintf(f, " = %s(", gj_rt_prim_name(n->inst.prim));
        }
        for (int k = 0; k < n->inst.n_in; k++) fprintf(f, "%s%%%d", k ? ", " : "", n->in[k]);
        fmt_attrs(ab, sizeof ab, &n->inst);
        fprintf(f, ")%s :", ab);
        for (int k = 0; k < n->n_out; k++)
            fprintf(f, " %s", gj_jit_fmt_meta(mb, sizeof mb, &g->values[n->out[k]].meta));
        fprintf(f, "\n");
    }
    for (int i = 0; i < g->n_hooks; i++)
        if (g->hooks[i].post)
            fprintf(f, "  post-accumulate hook #%d: node %d #%d (after the .grads)\n", i,
                    g->hooks[i].node, g->hooks[i].j);
    for (int i = 0; i < g->n_outputs; i++) {
        const gj_jit_output *o = &g->outputs[i];
        if (o->acc_node < 0) { /* gj_grad: a returned gradient */
            fprintf(f, "  output #%d: %%%d -> returned by gj_grad (new)\n", i, o->value);
            continue;
        }
        fprintf(f, "  output #%d: %%%d -> .grad of acc node %d%s%s\n", i, o->value, o->acc_node,
                acc_label(g, o->acc_node, nb, sizeof nb),
                o->grad_input >= 0 ? " (in place)" : " (new)");
    }
}

int gj_jit_graph_add_hook(gj_jit_graph *g, const gj_jit_hookref *h) {
    if (gj_jit_grow((void **)&g->hooks, g->n_hooks, &g->cap_hooks, sizeof *g->hooks) != 0) return -1;
    g->hooks[g->n_hooks] = *h;
    return g->n_hooks++;
}

int gj_jit_graph_copy_hooks(gj_jit_graph *dst, const gj_jit_graph *src) {
    for (int i = 0; i < src->n_hooks; i++)
        if (gj_jit_graph_add_hook(dst, &src->hooks[i]) < 0) return -1;
    return 0;
}
