/* SPDX-License-Identifier: MIT */
/*
 * grads.c - running a backward's program on this backward's tensors
 * (run_int.h): its inputs from the walk, the .grads it writes (in the
 * eager engine's order, post-accumulate hooks in between), a gj_grad's
 * returned gradients, and freeing the graph afterwards; and what a
 * backward's run brings to the user code it calls (calls.c): its hooks and
 * custom ops found on the walk.
 *
 * Invariants:
 *   - Inputs are read in place, in the layout the key recorded; saved
 *     tensors are checked exactly as the eager engine checks them (walk
 *     validation) before anything runs. An existing .grad is updated in
 *     place (through a contiguous copy if strided, or a private copy when
 *     the program calls user code: written back only once every instruction ran).
 *   - A run that falls back or fails before its last instruction has written no
 *     .grad, except the ones final before an early post-accumulate hook
 *     (GJ_HOOK_NO_GRAPH_WRITES) when no hook or call instruction is left.
 *   - gj_grad: its outputs (acc_node -1) are new tensors handed to the
 *     caller (program->ret maps requested inputs to outputs); no .grad is
 *     read, written or locked, no post-accumulate hook runs; without
 *     retain_graph the walk's needed op nodes are freed, as the engine's
 *     gj_grad frees the nodes it ran.
 */
#include "jit/run/run_int.h"

#include <stdio.h>
#include <string.h>

/* The event log of this thread's last compiled run: after how many instructions
 * each post-accumulate hook ran (gj_jit_last_post_hook_instrs). */
static _Thread_local int t_post_instrs[GJ_JIT_MAX_POST_LOG], t_n_post_instrs, t_run_instrs;
/* The id of the last program this thread ran (ids are never reused, so a
 * freed program is never mistaken for a new one) and its description. */
static _Thread_local uint64_t g_last_id;
static _Thread_local gj_ca_program_info g_last_info;
static _Thread_local bool g_have_last;

/* Writes graph output o into its leaf's .grad (news[o] or, for an existing
 * .grad, its private or contiguous copy contig[] written back). A leaf that
 * user code changed with set_ during the run (another dtype, or a .grad a
 * post-accumulate hook gave it) gets what the eager accumulate makes of the
 * program's gradient: a new .grad in the leaf's dtype, or the gradient
 * added into the .grad it has. A leaf of another shape is an error, as in
 * the eager engine. 0, or -1 (error set; earlier outputs stay written, as
 * with an eager backward that fails half-way). */
static int write_output(const gj_jit_program *pr, const gj_jit_walk *w,
                        gj_tensor *const *tensors, gj_tensor **contig, gj_tensor **news, int o) {
    const gj_jit_output *oo = &pr->outputs[o];
    const gj_rt_meta *om = &pr->plan.out_meta[o];
    if (oo->acc_node < 0) return 0; /* gj_grad: news[o] goes to the caller */
    gj_tensor *leaf = w->nodes[oo->acc_node]->leaf;
    if (!gj_ag_leaf_grad_fits(leaf, om, NULL)) return -1;
    if (oo->grad_input >= 0) {
        gj_tensor *g = tensors[oo->grad_input], *c = contig[oo->grad_input];
        if (c != g && gj_rt_copy_into(g, c) != 0) return -1; /* a strided or private .grad */
        gj_rt_bump_version(g);
        return 0;
    }
    gj_ag_tensor_meta *lm = gj_ag_meta_get(leaf, true);
    if (!lm) return -1;
    if (!news[o]) return 0; /* an empty gradient no instruction wrote: not expected */
    if (lm->grad || leaf->dtype != om->dtype) {
        gj_ag_builder *eb = gj_ag_eager_builder();
        int rc = eb->accumulate(eb, leaf, gj_ag_tensor_val(news[o]));
        gj_rt_tensor_release(news[o]);
        news[o] = NULL;
        return rc;
    }
    gj_ag_meta_set_grad(lm, news[o]); /* the slot takes the reference */
    news[o] = NULL;
    return 0;
}

/* Instructions after which output o of pr is final: no later instruction reads or
 * writes its buffer. */
static int output_final_after(const gj_jit_program *pr, int o) {
    const gj_jit_buffer *x = &pr->plan.bufs[pr->plan.out_buf[o]];
    return x->last_instr + 1;
}

/* Writes outputs into their leaves' .grads in the eager engine's order,
 * each post-accumulate hook right after the .grads eager writes before it
 * (hookref.n_out), so a hook that changes a later leaf with set_ has the
 * effect it has in eager; resumes where the previous call stopped
 * (hc->next_out, hc->next_hook). With done < the plan's instruction count (called
 * between instructions) it stops at the first output not yet final after `done`
 * instructions and at the first hook not registered GJ_HOOK_NO_GRAPH_WRITES: only
 * such hooks run mid-program (a gradient reducer then starts while the
 * backward goes on); the rest wait for the last instruction. 0 or -1 (error set). */
static int write_outputs_until(gj_jit_runctx *hc, const gj_jit_program *pr, const gj_jit_walk *w,
                               gj_tensor *const *tensors, bool hooks, int done) {
    bool all = done >= pr->plan.n_instrs;
    for (;;) {
        while (hooks && hc->next_hook < pr->n_hooks && !pr->hooks[hc->next_hook].post)
            hc->next_hook++;
        bool hook_left = hooks && hc->next_hook < pr->n_hooks;
        int need = hook_left ? pr->hooks[hc->next_hook].n_out : pr->n_outputs;
        if (need > pr->n_outputs) need = pr->n_outputs;
        for (; hc->next_out < need; hc->next_out++) {
            if (!all && output_final_after(pr, hc->next_out) > done) return 0;
            if (write_output(pr, w, tensors, hc->contig, hc->news, hc->next_out) != 0) return -1;
        }
        if (!hook_left) return 0;
        const gj_ag_hook *h = hc->hooks[hc->next_hook];
        if (!all && !h->early) return 0;
        if (!h->removed) {
            if (t_n_post_instrs < GJ_JIT_MAX_POST_LOG) t_post_instrs[t_n_post_instrs++] = done;
            if (gj_jit_run_post_hook(hc, hc->next_hook, hc->next_out) != 0) return -1;
        }
        hc->next_hook++;
    }
}

/* gj_jit_progress: between groups of instructions, once no hook or custom call
 * instruction is left (they may abandon the run, which must then have written
 * nothing), the outputs that are final and the early hooks after them. */
static int write_early(void *ctx, int done) {
    gj_jit_runctx *hc = ctx;
    if (done < hc->early_from) return 0;
    return write_outputs_until(hc, hc->pr, hc->w, hc->tensors, true, done);
}

/* ------------------------------------------ the backward's user code */

/* The hook reference i names: resolved from the walk when the run
 * started (rp_hooks). */
static const gj_ag_hook *bwd_hook(gj_jit_runctx *hc, int i) { return hc->hooks[i]; }

/* The custom op of call instruction cs: the op of the walk's node cs->node,
 * or op cs->tape of that checkpoint node's tape. */
static const gj_ag_opdef *bwd_custom(gj_jit_runctx *hc, const gj_jit_call_instr *cs,
                                     const gj_ag_attrs **at) {
    const gj_ag_node *node = cs->node >= 0 && cs->node < hc->w->n ? hc->w->nodes[cs->node] : NULL;
    if (!node) return NULL;
    if (cs->tape < 0) {
        *at = &node->attrs;
        return node->op;
    }
    return gj_ag_ckpt_op(node, cs->tape, at);
}

/* A backward's user code (calls.c): a tensor hook's or custom call's trip
 * abandons the run, a record_stream or a post hook's trip keeps it. */
static const gj_jit_run_path g_backward = {"run", false, bwd_hook, bwd_custom, NULL};

/* One gj_jit_run_program, carried from stage to stage: the program, the
 * walk and its tensors, where a fallback's reason goes, the run's context
 * (hooks), and what the run allocates, all freed by rp_free: contig[i] (a
 * .grad input's contiguous or private copy, a reference), news[o] (a new
 * output, a reference), the data pointers in[] and out[], params[] (the
 * dropout seeds and offsets). Each stage returns RP_ON (the next stage
 * runs) or the run's result (see gj_jit_run_program). */
typedef struct running {
    gj_jit_program *pr;
    const gj_jit_plan *p;
    const gj_jit_walk *w;
    gj_tensor *const *tensors;
    char *why;
    size_t why_cap;
    gj_jit_runctx *hc;
    int n_in, n_out;
    bool hooks; /* user code runs during the plan */
    gj_tensor **contig, **news;
    void **in, **out;
    uint64_t *params;
} running;

enum { RP_ON = -2 }; /* the next stage decides */

/* The run's tables, and (user code runs during the plan) the hooks of the
 * program found on this backward's graph. */
static int rp_hooks(running *r) {
    gj_jit_program *pr = r->pr;
    gj_jit_runctx *hc = r->hc;
    r->contig = gj_rt_calloc((size_t)r->n_in + 1, sizeof *r->contig);
    r->news = gj_rt_calloc((size_t)r->n_out + 1, sizeof *r->news);
    r->in = gj_rt_calloc((size_t)r->n_in + 1, sizeof *r->in);
    r->out = gj_rt_calloc((size_t)r->n_out + 1, sizeof *r->out);
    if (!r->contig || !r->news || !r->in || !r->out) return -1;
    hc->path = &g_backward;
    hc->pr = pr;
    hc->w = r->w;
    hc->tensors = r->tensors;
    r->hooks = pr->n_hooks > 0 || pr->n_calls > 0;
    if (!r->hooks) return RP_ON;
    hc->data0 = gj_rt_calloc((size_t)r->n_in + 1, sizeof *hc->data0);
    hc->hooks = gj_rt_calloc((size_t)pr->n_hooks + 1, sizeof *hc->hooks);
    if (!hc->data0 || !hc->hooks) return -1;
    for (int i = 0; i < pr->n_hooks; i++) {
        const gj_jit_hookref *ref = &pr->hooks[i];
        const gj_ag_hook *hs[64];
        int c = ref->node < r->w->n ? gj_ag_node_hooks(r->w->nodes[ref->node], ref->k, hs, 64) : 0;
        if (ref->j >= c || ref->j >= 64 ||
            (hs[ref->j]->kind == GJ_AG_HOOK_POST_ACCUMULATE) != ref->post) {
            snprintf(r->why, r->why_cap, "hook #%d of the program not found on the graph", i);
            return 1;
        }
        hc->hooks[i] = hs[ref->j];
    }
    return RP_ON;
}

/* The plan's inputs: each checked against the program, a .grad made
 * contiguous (a private copy when user code runs), the others read in
 * place. */
static int rp_inputs(running *r) {
    gj_jit_program *pr = r->pr;
    gj_tensor *const *tensors = r->tensors;
    for (int i = 0; i < r->n_in; i++) {
        gj_tensor *t = tensors[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (t->storage->fetch) { /* (its bytes exist only while eager primitives read it) */
            snprintf(r->why, r->why_cap, "input #%d is a parameter sharded at rest (ZeRO stage "
                     "3): it is gathered per read, which the eager backward does", i);
            return 1;
        }
        int fits = gj_jit_input_fits(pr, i, t);
        if (fits == 1) {
            snprintf(r->why, r->why_cap, "input #%d changed shape or dtype", i);
            return 1;
        }
        if (pr->inputs[i].role == GJ_JIT_IN_GRAD) {
            for (int j = 0; j < r->n_in; j++)
                if (j != i && gj_jit_views_overlap(tensors[j], t)) {
                    snprintf(r->why, r->why_cap,
                             "a .grad shares memory with another input of the graph");
                    return 1;
                }
        }
        if (pr->inputs[i].role == GJ_JIT_IN_GRAD) { /* written: contiguous (copy if strided) */
            if (r->hooks) { /* a private copy: written back once every instruction ran */
                r->contig[i] = gj_rt_tensor_empty(m.dtype, m.ndim, m.shape);
                if (r->contig[i] && gj_rt_copy_into(r->contig[i], t) != 0) return -1;
            } else {
                r->contig[i] = gj_rt_contiguous(t);
            }
            if (!r->contig[i]) return -1;
            r->in[i] = gj_rt_data_ptr(r->contig[i]);
            continue;
        }
        if (fits == 2) {
            snprintf(r->why, r->why_cap, "input #%d has another layout than when compiled", i);
            return 1;
        }
        r->in[i] = gj_rt_data_ptr(t); /* read in place */
    }
    return RP_ON;
}

/* When user code runs: what the guards after it compare with (the inputs'
 * data, each leaf's meta and data), and the dropout seeds and offsets of
 * this run. */
static int rp_before(running *r) {
    gj_jit_runctx *hc = r->hc;
    const gj_jit_plan *p = r->p;
    if (r->hooks) {
        for (int i = 0; i < r->n_in; i++) hc->data0[i] = gj_rt_data_ptr(r->tensors[i]);
        hc->priv = r->contig;
        hc->leaf_meta = gj_rt_calloc((size_t)r->n_out + 1, sizeof *hc->leaf_meta);
        hc->leaf_data = gj_rt_calloc((size_t)r->n_out + 1, sizeof *hc->leaf_data);
        if (!hc->leaf_meta || !hc->leaf_data) return -1;
        for (int o = 0; o < r->n_out; o++) {
            gj_tensor *leaf = gj_jit_output_leaf(hc, o);
            if (!leaf) continue; /* a gj_grad output */
            gj_rt_meta_of(leaf, &hc->leaf_meta[o]);
            hc->leaf_data[o] = gj_rt_data_ptr(leaf);
        }
    }
    if (p->n_rt_params > 0) { /* dropout seeds/offsets of this run */
        r->params = gj_rt_calloc((size_t)p->n_rt_params * 2, sizeof *r->params);
        if (!r->params) return -1;
        for (int k = 0; k < p->n_rt_params; k++) {
            if (gj_jit_dropout_params(r->w, p->rt_param_node[k], p->rt_param_tape[k],
                                      &r->params[2 * k]) != 0) {
                snprintf(r->why, r->why_cap, "dropout parameters not found");
                return 1;
            }
        }
    }
    return RP_ON;
}

/* The plan's instructions, then the outputs written (.grads, or a
 * gj_grad's new tensors moved to ret_out). */
static int rp_exec(running *r, gj_tensor **ret_out) {
    gj_jit_program *pr = r->pr;
    const gj_jit_plan *p = r->p;
    gj_jit_runctx *hc = r->hc;
    gj_jit_outs oc = {p, r->news};
    hc->contig = r->contig;
    hc->news = r->news;
    hc->next_out = hc->next_hook = 0;
    hc->early_from = 0;
    t_n_post_instrs = 0;
    t_run_instrs = p->n_instrs;
    bool early = false;
    for (int i = 0; r->hooks && i < pr->n_hooks; i++)
        early |= pr->hooks[i].post && hc->hooks[i]->early;
    for (int s = 0; s < p->n_instrs; s++)
        if (p->instrs[s].kind == GJ_JIT_INSTR_HOOK || p->instrs[s].kind == GJ_JIT_INSTR_CALL)
            hc->early_from = s + 1;
    int er = gj_jit_run_calls(hc, r->in, r->params, r->out, &oc, early ? write_early : NULL);
    if (er == 1) return 2;
    if (er != 0) return -1;
    if (write_outputs_until(hc, pr, r->w, r->tensors, r->hooks, p->n_instrs) != 0) return -1;
    for (int o = 0; ret_out && o < r->n_out; o++) {
        if (!r->news[o]) { /* every output of a gj_grad is a new buffer */
            gj_rt_set_error("gj_grad: internal: compiled output #%d was not written", o);
            for (int q = 0; q < o; q++) gj_rt_tensor_release(ret_out[q]);
            return -1;
        }
        ret_out[o] = r->news[o];
    }
    for (int o = 0; ret_out && o < r->n_out; o++) r->news[o] = NULL;
    return 0;
}

/* Releases what the run holds (r's tables, hc's), whatever the result. */
static void rp_free(running *r) {
    gj_jit_runctx *hc = r->hc;
    for (int i = 0; i < r->n_in && r->contig; i++)
        if (r->contig[i]) gj_rt_tensor_release(r->contig[i]);
    for (int o = 0; o < r->n_out && r->news; o++)
        if (r->news[o]) gj_rt_tensor_release(r->news[o]);
    gj_rt_free(r->contig);
    gj_rt_free(r->news);
    gj_rt_free(r->in);
    gj_rt_free(r->out);
    gj_rt_free(r->params);
    gj_rt_free(hc->data0);
    gj_rt_free((void *)hc->hooks);
    gj_rt_free(hc->leaf_meta);
    gj_rt_free((void *)hc->leaf_data);
    hc->leaf_meta = NULL;
    hc->leaf_data = NULL;
    hc->data0 = NULL;
    hc->hooks = NULL;
    hc->priv = NULL;
}

/* Runs program pr on the tensors of this backward. Returns 0 (gradients
 * written; hc->tripped tells whether a guard tripped after a post hook or a
 * record_stream), 1 (fallback: nothing written, reason in why), 2 (a guard
 * tripped in a tensor hook: nothing written, hooks ran, reason in hc) or -1
 * (error set, nothing written). A gj_grad's program (ret_out non-NULL)
 * writes no .grad: on 0, ret_out[o] receives output o as a new tensor. */
int gj_jit_run_program(gj_jit_program *pr, const gj_jit_walk *w, gj_tensor *const *tensors,
                       char *why, size_t why_cap, gj_jit_runctx *hc, gj_tensor **ret_out) {
    running r;
    memset(&r, 0, sizeof r);
    r.pr = pr;
    r.p = &pr->plan;
    r.w = w;
    r.tensors = tensors;
    r.why = why;
    r.why_cap = why_cap;
    r.hc = hc;
    r.n_in = pr->n_inputs;
    r.n_out = pr->n_outputs;
    int rc = rp_hooks(&r);
    if (rc == RP_ON) rc = rp_inputs(&r);
    if (rc == RP_ON) rc = rp_before(&r);
    if (rc == RP_ON) rc = rp_exec(&r, ret_out);
    rp_free(&r);
    return rc;
}

/* The input tensors of program pr for this walk, from canonical origins.
 * tensors[] receives borrowed pointers. false if an origin is missing. */
bool gj_jit_inputs_from_walk(const gj_jit_program *pr, const gj_jit_walk *w,
                             gj_tensor *const *seeds, gj_tensor **tensors) {
    for (int i = 0; i < pr->n_inputs; i++) {
        const gj_jit_input *in = &pr->inputs[i];
        gj_tensor *t = NULL;
        switch (in->role) {
        case GJ_JIT_IN_SAVED:
            if (in->node >= 0 && in->node < w->n && in->slot < w->nodes[in->node]->n_saved)
                t = w->nodes[in->node]->saved[in->slot].t;
            break;
        case GJ_JIT_IN_SEED:
            t = seeds ? seeds[in->slot] : NULL;
            break;
        case GJ_JIT_IN_GRAD:
            if (in->node >= 0 && in->node < w->n && w->nodes[in->node]->leaf) {
                gj_ag_tensor_meta *m = w->nodes[in->node]->leaf->ag;
                t = m ? m->grad : NULL;
            }
            break;
        default:
            break;
        }
        if (!t) return false;
        tensors[i] = t;
    }
    return true;
}

/* Gives the gradients of a gj_grad's run (outs[o]: output o, a reference
 * each, consumed) to the requested inputs: an edge requested twice gets
 * the same tensor with one more reference (gj_grad then gives each slot
 * a header of its own, as after an eager run). */
void gj_jit_hand_out(const gj_jit_program *pr, const gj_jit_grad_req *gr, gj_tensor **outs) {
    for (int i = 0; i < gr->n_inputs; i++) {
        int o = i < pr->n_ret ? pr->ret[i] : -1;
        gr->grads_out[i] = o >= 0 ? outs[o] : NULL;
        if (o >= 0) gj_rt_tensor_retain(outs[o]);
    }
    for (int o = 0; o < pr->n_outputs; o++) gj_rt_tensor_release(outs[o]);
}

/* Without retain_graph, frees the saved tensors of what the engine ran: in
 * backward mode every node of the roots' graph, in gj_grad mode the needed
 * op nodes of the walk (the engine's gj_grad frees only those). */
void gj_jit_release_graph(const gj_jit_walk *w, int n_roots, gj_tensor *const *roots) {
    if (!w->grad_mode) {
        gj_ag_release_graph(n_roots, roots);
        return;
    }
    for (int i = 0; i < w->n; i++)
        if (w->needed[i] && w->nodes[i]->kind == GJ_AG_OP) gj_ag_node_free_saved(w->nodes[i]);
}

/* Remembers prog (a reference held) as this thread's last program (its
 * description is made once per program). */
void gj_jit_note_last_program(const gj_jit_program *prog) {
    if (g_have_last && prog->id == g_last_id) return;
    gj_jit_plan_info(&prog->plan, &g_last_info);
    g_last_info.code_parts = gj_jit_code_parts(prog->code);
    g_last_info.symbolic = prog->plan.generic;
    g_last_info.bound = prog->code == NULL && prog->n_shared > 0;
    g_last_id = prog->id;
    g_have_last = true;
}

bool gj_jit_last_program_info(gj_ca_program_info *out) {
    if (g_have_last) *out = g_last_info;
    return g_have_last;
}

int gj_jit_last_post_hook_instrs(int *out, int cap, int *n_instrs) {
    for (int i = 0; i < t_n_post_instrs && i < cap; i++) out[i] = t_post_instrs[i];
    if (n_instrs) *n_instrs = t_run_instrs;
    return t_n_post_instrs;
}

