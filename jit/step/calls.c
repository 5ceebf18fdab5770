/* SPDX-License-Identifier: MIT */
/*
 * calls.c - what is the step's own in a run of its program (step_int.h),
 * on top of the user code machinery every compiled run shares (run.h,
 * jit/run/calls.c): how its hook and custom call instructions find what
 * they call (the hooks on its leaves as they are now, the custom ops its
 * trace recorded), its parameters' post-accumulate hooks, and a gradient
 * reducer's gives and takes (jit.h, gj_jit_reducer).
 *
 * Invariants:
 *   - A step stops on every trip (its path's stop_on_trip): every user
 *     call comes before every update (the plan places the backward's
 *     instructions, these calls among them, before the updates), so a trip
 *     stops the run with no parameter or state written, and the caller
 *     runs the step eagerly from the same generator position (the user
 *     code called so far runs again there). A failing hook or custom op is
 *     transient (the step stays compiled); record_stream, set_ on a tensor
 *     of the step, or a .grad removed or given another dtype or shape, is
 *     permanent (the step runs eagerly from then on).
 *   - A parameter's post-accumulate hooks see its .grad set to a fresh
 *     tensor holding the gradient (as the eager backward leaves it), and
 *     the .grad they leave is copied back. The reducer's own hook, when a
 *     parameter has one among its post hooks, is a give in that order.
 *     The .grads stay set after the run, as during eager's step.
 *   - Reducer calls do not trip: their failures are errors (a collective
 *     that failed); the reducer's end() runs after every run.
 */
#include "jit/step/step_int.h"

#include <stdio.h>
#include <string.h>

/* This thread's last run with a reducer: where its gives ran. */
static _Thread_local int t_gives[GJ_JIT_MAX_POST_LOG], t_n_gives, t_n_instrs, t_last_gemm;

int gj_jit_last_reducer_gives(int *out, int cap, int *n_instrs, int *last_gemm) {
    for (int k = 0; k < t_n_gives && k < cap; k++) out[k] = t_gives[k];
    *n_instrs = t_n_instrs;
    *last_gemm = t_last_gemm;
    return t_n_gives;
}

/* The live hook hookref i of the program names on its leaf now, or NULL. */
static const gj_ag_hook *step_hook(gj_jit_runctx *hc, int i) {
    const gj_jit_step_run *sr = hc->own;
    const gj_jit_hookref *ref = &hc->pr->hooks[i];
    const gj_ag_hook *hs[64];
    int n = gj_ag_leaf_hooks(sr->hook_leaf[i], hs, 64);
    if (ref->j >= n || ref->j >= 64 ||
        (hs[ref->j]->kind == GJ_AG_HOOK_POST_ACCUMULATE) != ref->post)
        return NULL;
    return hs[ref->j];
}

/* The custom op of call instruction cs, as the step's capture recorded it. */
static const gj_ag_opdef *step_custom(gj_jit_runctx *hc, const gj_jit_call_instr *cs,
                                      const gj_ag_attrs **at) {
    const gj_jit_step_run *sr = hc->own;
    for (int k = 0; k < sr->n_customs; k++)
        if (sr->customs[k].tape == cs->tape && sr->customs[k].node == cs->node) {
            *at = &sr->customs[k].attrs;
            return sr->customs[k].op;
        }
    return NULL;
}

/* Parameter p's post-accumulate hooks on its .grad set to a copy of src
 * (of meta m); dst receives the .grad they leave. p >= the optimizer's n:
 * (ZeRO) the reducer's parameter p - n, whose .grad is dropped after them,
 * as gj_ddp_wait drops it. 0, 1 (tripped) or -1. */
static int call_post_hooks(gj_jit_step_run *sr, int p, const gj_rt_meta *m, const void *src,
                           void *dst, int instr) {
    const gj_jit_step_call *call = sr->call;
    const gj_jit_reducer *red = call->red;
    int on = call->opt->n, ri = p >= on ? p - on : red ? call->red_of[p] : -1; /* (the
                                                                     reducer's index) */
    gj_tensor *leaf = p >= on ? red->params[ri] : call->opt->params[p];
    int64_t own = red && ri >= 0 ? red->hooks[ri] : 0;
    size_t nb = (size_t)gj_rt_numel(m->ndim, m->shape) * gj_rt_dtype_size(m->dtype);
    gj_tensor *g = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    gj_ag_tensor_meta *am = g ? gj_ag_meta_get(leaf, true) : NULL;
    if (!am) {
        if (g) gj_rt_tensor_release(g);
        return -1;
    }
    if (nb) memcpy(gj_rt_data_ptr(g), src, nb);
    gj_ag_meta_set_grad(am, g); /* (the slot takes the reference) */
    const gj_ag_hook *hs[64];
    int n = gj_ag_leaf_hooks(leaf, hs, 64);
    for (int j = 0; j < n && j < 64; j++) {
        const gj_ag_hook *h = hs[j];
        if (h->kind != GJ_AG_HOOK_POST_ACCUMULATE || h->removed) continue;
        gj_tensor *cur = am->grad;
        if (h->handle != own) { /* user code, and the guards after it */
            int r = gj_jit_call_post_hook(&sr->hc, h, leaf, instr);
            if (r != 0) return r;
            continue;
        }
        /* the reducer's hook: a give, in the hooks' order */
        if (!cur || cur->dtype != m->dtype || !gj_rt_is_contiguous(cur) ||
            gj_rt_numel(cur->ndim, cur->shape) != gj_rt_numel(m->ndim, m->shape)) {
            gj_jit_trip(&sr->hc, GJ_CA_HOOK_GUARD, "a post-accumulate hook left parameter %d "
                        "without a contiguous .grad of its own meta before its reducer's", p);
            return 1;
        }
        if (t_n_gives < GJ_JIT_MAX_POST_LOG) t_gives[t_n_gives++] = instr;
        if (red->give(red->ctx, ri, m->dtype, gj_rt_data_ptr(cur)) != 0) return -1;
    }
    gj_tensor *cur = am->grad;
    gj_rt_meta cm;
    if (cur) gj_rt_meta_of(cur, &cm);
    if (!cur || !gj_jit_meta_equal(&cm, m)) {
        gj_jit_trip(&sr->hc, GJ_CA_HOOK_GUARD, "the post-accumulate hooks of parameter %d %s its "
                    ".grad during a compiled step", p,
                    cur ? "changed the dtype or shape of" : "removed");
        return 1;
    }
    if (gj_jit_copy_out(cur, dst, nb) != 0) return -1;
    if (p >= on) gj_ag_meta_set_grad(am, NULL);
    return 0;
}

/* The step's own call instructions (gj_jit_run_path.own): the reducer's
 * gives and takes and the parameters' post-accumulate hooks. */
static int step_own_call(void *ctx, const gj_jit_call_instr *cs, void *const *src,
                         void *const *dst) {
    gj_jit_runctx *hc = ctx;
    gj_jit_step_run *sr = hc->own;
    const gj_jit_step_call *call = sr->call;
    const gj_jit_reducer *red = call->red;
    int p = cs->node;
    bool give = cs->tape == GJ_JIT_CALL_GIVE, take = cs->tape == GJ_JIT_CALL_TAKE,
         post = cs->tape == GJ_JIT_CALL_POST;
    bool zgive = give && red && red->zero; /* (ZeRO: a give names the reducer's parameter) */
    int zpost = post && red && red->zero ? red->n : 0; /* (ZeRO: n + i, reducer parameter i) */
    if (p < 0 || p >= (zgive ? red->n : call->opt->n + zpost) || !(give || take || post) ||
        ((give || take) && (!red || (!zgive && call->red_of[p] < 0))) || (take && cs->n_out != 1) ||
        (give && cs->n_in > 1) || (post && (cs->n_in != 1 || cs->n_out != 1))) {
        gj_rt_set_error("gj_step_run: internal: call instruction of kind %d on parameter %d is "
                        "none a step program makes", cs->tape, p);
        return -1;
    }
    int instr = gj_jit_call_instr_index(hc, cs);
    if (post) return call_post_hooks(sr, p, &cs->in_meta[0], src[0], dst[0], instr);
    int i = zgive ? p : call->red_of[p];
    if (take) return red->take(red->ctx, i, cs->out_meta[0].dtype, dst[0]);
    if (t_n_gives < GJ_JIT_MAX_POST_LOG) t_gives[t_n_gives++] = instr;
    return red->give(red->ctx, i, cs->n_in ? cs->in_meta[0].dtype : red->params[i]->dtype,
                     cs->n_in ? src[0] : NULL);
}

/* A step's user code: every trip stops the run before any update. */
static const gj_jit_run_path g_step = {"step", true, step_hook, step_custom, step_own_call};

int gj_jit_step_exec(gj_jit_step_run *sr, const uint64_t *params, void **out, gj_jit_outs *ac) {
    const gj_jit_plan *p = &sr->hc.pr->plan;
    sr->hc.path = &g_step;
    sr->hc.own = sr;
    t_n_gives = 0;
    t_n_instrs = p->n_instrs;
    t_last_gemm = -1;
    for (int k = 0; k < p->n_instrs; k++)
        if (p->instrs[k].kind == GJ_JIT_INSTR_MATMUL) t_last_gemm = k;
    int er = gj_jit_run_calls(&sr->hc, sr->hc.data0, params, out, ac, NULL);
    if (er == 1 && !sr->hc.tripped) er = -1; /* (only a trip abandons) */
    const gj_jit_reducer *red = sr->call->red;
    if (red && sr->hc.pr->n_calls > 0 && red->end(red->ctx) != 0 && er == 0) er = -1;
    return er;
}
