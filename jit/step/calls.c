/* SPDX-License-Identifier: MIT */
/*
 * calls.c - what a step program calls outside itself (step_int.h): the
 * tensor hooks on its leaves, each parameter's post-accumulate hooks,
 * custom ops' forward and backward C functions, and a gradient reducer's
 * gives and takes (jit.h, gj_jit_reducer), with the guards that check,
 * after each user call, that the program still computes what the eager
 * step would.
 *
 * Invariants:
 *   - User code never sees a buffer of the plan: a custom op's function
 *     gets fresh tensors holding copies of its arguments, and its results
 *     are copied back; a tensor hook gets a fresh
 *     tensor holding a copy of the gradient, and what it returns is copied
 *     back; a parameter's post-accumulate hooks see its .grad set to a
 *     fresh tensor holding the gradient (as the eager backward leaves it),
 *     and the .grad they leave is copied back. The reducer's own hook,
 *     when a parameter has one among its post hooks, is a give in that
 *     order. The .grads stay set after the run, as during eager's step.
 *   - Every user call comes before every update (the plan places the
 *     backward's instructions, these calls among them, before the updates),
 *     so a trip stops the run with no parameter or state written: the
 *     caller then runs the step eagerly from the same generator position
 *     (the user code called so far runs again there). A failing hook is
 *     transient (the step stays compiled); record_stream, set_ on a tensor
 *     of the step, or a .grad removed or given another dtype or shape, is
 *     permanent (the step runs eagerly from then on).
 *   - Reducer calls do not trip: their failures are errors (a collective
 *     that failed); the reducer's end() runs after every run.
 */
#include "jit/step/step_int.h"

#include <stdarg.h>
#include <stddef.h>
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

static void trip(gj_jit_step_run *sr, gj_ca_reason code, bool permanent, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void trip(gj_jit_step_run *sr, gj_ca_reason code, bool permanent, const char *fmt, ...) {
    if (sr->tripped) return; /* the first cause */
    sr->tripped = true;
    sr->permanent = permanent;
    sr->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sr->why, sizeof sr->why, fmt, ap);
    va_end(ap);
}

/* After user code `who`: record_stream called, or a tensor the program
 * reads or writes changed by set_ (dtype, shape or storage). 1 if tripped. */
static int guards_after(gj_jit_step_run *sr, const char *who, uint64_t rs0) {
    if (gj_rt_record_stream_calls() != rs0) {
        trip(sr, GJ_CA_RECORD_STREAM, true, "%s called gj_tensor_record_stream during a compiled "
             "step", who);
        return 1;
    }
    const gj_jit_plan *p = &sr->pr->plan;
    for (int i = 0; i < sr->pr->n_inputs; i++) {
        gj_tensor *t = sr->bound[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        bool moved = !t->storage->fetch && gj_rt_data_ptr(t) != sr->data[i]; /* (a remote
                                  storage's bytes come and go: ZeRO stage 3's gathers) */
        if (!gj_jit_meta_equal(&m, &p->in_meta[i]) || moved) {
            char a[96], b[96];
            trip(sr, GJ_CA_SET_MISMATCH, true, "%s changed a tensor of the step (set_) from %s "
                 "to %s%s during a compiled step", who, gj_jit_fmt_meta(a, sizeof a, &p->in_meta[i]),
                 gj_jit_fmt_meta(b, sizeof b, &m),
                 moved ? " with another storage" : "");
            return 1;
        }
    }
    return 0;
}

/* The live hook hookref i of the program names, or NULL. */
static const gj_ag_hook *hook_of(const gj_jit_step_run *sr, int i) {
    const gj_jit_hookref *ref = &sr->pr->hooks[i];
    const gj_ag_hook *hs[64];
    int n = gj_ag_leaf_hooks(sr->hook_leaf[i], hs, 64);
    if (ref->j >= n || ref->j >= 64 ||
        (hs[ref->j]->kind == GJ_AG_HOOK_POST_ACCUMULATE) != ref->post)
        return NULL;
    return hs[ref->j];
}

/* gj_jit_hook_call: tensor hook hs->hook on a fresh copy of the gradient. */
static int call_tensor_hook(void *ctx, const gj_jit_hook_instr *hs, const void *src, void *dst) {
    gj_jit_step_run *sr = ctx;
    const gj_rt_meta *m = &hs->meta;
    size_t nb = (size_t)gj_rt_numel(m->ndim, m->shape) * gj_rt_dtype_size(m->dtype);
    const gj_ag_hook *h = hook_of(sr, hs->hook);
    if (!h) { /* (the guards checked every leaf's hooks before the run) */
        trip(sr, GJ_CA_HOOK_GUARD, true, "hook #%d of the step's program is not on its leaf",
             hs->hook);
        return 1;
    }
    gj_tensor *t = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    if (!t) return -1;
    if (nb) memcpy(gj_rt_data_ptr(t), src, nb);
    uint64_t rs0 = gj_rt_record_stream_calls();
    gj_tensor *rt = gj_ag_call_hook_ref(h, t);
    gj_rt_tensor_release(t);
    if (!rt) {
        trip(sr, GJ_CA_HOOK_GUARD, false, "hook #%lld failed during a compiled step: %s",
             (long long)h->handle, gj_last_error());
        return 1;
    }
    gj_tensor *c = gj_rt_is_contiguous(rt) ? rt : gj_rt_contiguous(rt);
    if (c && nb) memcpy(dst, gj_rt_data_ptr(c), nb);
    if (c && c != rt) gj_rt_tensor_release(c);
    gj_rt_tensor_release(rt);
    if (!c) return -1;
    char who[48];
    snprintf(who, sizeof who, "hook #%lld", (long long)h->handle);
    return guards_after(sr, who, rs0);
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
        if (h->handle == own) { /* the reducer's hook: a give, in the hooks' order */
            if (!cur || cur->dtype != m->dtype || !gj_rt_is_contiguous(cur) ||
                gj_rt_numel(cur->ndim, cur->shape) != gj_rt_numel(m->ndim, m->shape)) {
                trip(sr, GJ_CA_HOOK_GUARD, true, "a post-accumulate hook left parameter %d "
                     "without a contiguous .grad of its own meta before its reducer's", p);
                return 1;
            }
            if (t_n_gives < GJ_JIT_MAX_POST_LOG) t_gives[t_n_gives++] = instr;
            if (red->give(red->ctx, ri, m->dtype, gj_rt_data_ptr(cur)) != 0)
                return -1;
            continue;
        }
        uint64_t rs0 = gj_rt_record_stream_calls();
        if (gj_ag_eager_call_post_hook(NULL, h, leaf) != 0) {
            trip(sr, GJ_CA_HOOK_GUARD, false, "post-accumulate hook #%lld failed during a "
                 "compiled step: %s", (long long)h->handle, gj_last_error());
            return 1;
        }
        char who[64];
        snprintf(who, sizeof who, "post-accumulate hook #%lld", (long long)h->handle);
        if (guards_after(sr, who, rs0) != 0) return 1;
    }
    gj_tensor *cur = am->grad;
    gj_rt_meta cm;
    if (cur) gj_rt_meta_of(cur, &cm);
    if (!cur || !gj_jit_meta_equal(&cm, m)) {
        trip(sr, GJ_CA_HOOK_GUARD, true, "the post-accumulate hooks of parameter %d %s its .grad "
             "during a compiled step", p, cur ? "changed the dtype or shape of" : "removed");
        return 1;
    }
    gj_tensor *c = gj_rt_is_contiguous(cur) ? cur : gj_rt_contiguous(cur);
    if (!c) return -1;
    if (nb) memcpy(dst, gj_rt_data_ptr(c), nb);
    if (c != cur) gj_rt_tensor_release(c);
    if (p >= on) gj_ag_meta_set_grad(am, NULL);
    return 0;
}

/* Copies tensor t (of meta m) into dst. 0 or -1 (OOM). */
static int copy_out(gj_tensor *t, void *dst) {
    gj_tensor *c = gj_rt_is_contiguous(t) ? t : gj_rt_contiguous(t);
    if (!c) return -1;
    size_t nb = (size_t)gj_rt_numel(c->ndim, c->shape) * gj_rt_dtype_size(c->dtype);
    if (nb) memcpy(dst, gj_rt_data_ptr(c), nb);
    if (c != t) gj_rt_tensor_release(c);
    return 0;
}

/* A custom op's forward (the step function's call, or a checkpoint
 * region's recomputation) or backward C function on copies of src; dst
 * receives its outputs, or the gradients of the arguments in cs->args. A
 * failure is transient (eager fails the step the same way); an output of
 * another meta than the program's, permanent. 0, 1 or -1. */
static int call_custom(gj_jit_step_run *sr, const gj_jit_call_instr *cs, void *const *src,
                       void *const *dst) {
    const gj_jit_step_custom *sc = NULL;
    for (int k = 0; k < sr->n_customs && !sc; k++)
        if (sr->customs[k].tape == cs->tape && sr->customs[k].node == cs->node) sc = &sr->customs[k];
    const gj_custom_op *op = sc ? gj_ag_custom_of(sc->op) : NULL;
    if (!op) {
        gj_rt_set_error("gj_step_run: internal: no custom op for call (node %d, tape %d)",
                        cs->node, cs->tape);
        return -1;
    }
    int no = gj_ag_custom_n_outputs(op), nt = gj_ag_custom_n_tensor_args(op);
    gj_tensor *ts[GJ_JIT_CALL_MAX_IN] = {0}, *res[GJ_JIT_CALL_MAX_IN] = {0};
    int rc = -1;
    if (gj_jit_call_inputs(cs, src, ts) != 0) goto done;
    uint64_t rs0 = gj_rt_record_stream_calls();
    int r = cs->fwd ? gj_ag_custom_run_forward(op, &sc->attrs, ts, res)
                    : gj_ag_custom_run_backward(op, &sc->attrs, cs->in_meta, ts, ts + no, res);
    if (r != 0) {
        trip(sr, GJ_CA_HOOK_GUARD, false, "custom op %s: its %s failed during a compiled step: %s",
             sc->op->name, cs->fwd ? "forward" : "backward", gj_last_error());
        rc = 1;
        goto done;
    }
    for (int i = 0, j = 0; i < (cs->fwd ? no : nt) && j < cs->n_out; i++) {
        if (!cs->fwd && !(cs->args & (1u << i))) continue; /* no gradient wanted */
        gj_rt_meta m;
        if (res[i]) gj_rt_meta_of(res[i], &m);
        if (!res[i] || !gj_jit_meta_equal(&m, &cs->out_meta[j])) {
            char a[96];
            trip(sr, GJ_CA_HOOK_GUARD, true, "custom op %s: its %s gave %s for %s %d where the "
                 "program has %s", sc->op->name, cs->fwd ? "forward" : "backward",
                 res[i] ? gj_jit_fmt_meta(a, sizeof a, &m) : "nothing",
                 cs->fwd ? "output" : "argument", i, gj_jit_fmt_meta((char[96]){0}, 96,
                                                                       &cs->out_meta[j]));
            rc = 1;
            goto done;
        }
        if (copy_out(res[i], dst[j++]) != 0) goto done;
    }
    char who[160];
    snprintf(who, sizeof who, "custom op %s", sc->op->name);
    rc = guards_after(sr, who, rs0);
done:
    for (int k = 0; k < GJ_JIT_CALL_MAX_IN; k++) {
        if (ts[k]) gj_rt_tensor_release(ts[k]);
        if (res[k]) gj_rt_tensor_release(res[k]);
    }
    return rc;
}

/* gj_jit_custom_call of a step program: custom ops, the reducer's gives
 * and takes and the parameters' post-accumulate hooks. */
static int call_instr(void *ctx, const gj_jit_call_instr *cs, void *const *src,
                      void *const *dst) {
    gj_jit_step_run *sr = ctx;
    if (cs->tape == GJ_JIT_CALL_STEP_FWD || cs->tape >= -1) return call_custom(sr, cs, src, dst);
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
    int instr = (int)((const gj_jit_instr *)((const char *)cs - offsetof(gj_jit_instr, cs)) -
                      sr->pr->plan.instrs); /* (cs is its instruction's) */
    if (post) return call_post_hooks(sr, p, &cs->in_meta[0], src[0], dst[0], instr);
    int i = zgive ? p : call->red_of[p];
    if (take) return red->take(red->ctx, i, cs->out_meta[0].dtype, dst[0]);
    if (t_n_gives < GJ_JIT_MAX_POST_LOG) t_gives[t_n_gives++] = instr;
    return red->give(red->ctx, i, cs->n_in ? cs->in_meta[0].dtype : red->params[i]->dtype,
                     cs->n_in ? src[0] : NULL);
}

/* gj_jit_input_fetch of a step program whose inputs include remote
 * storages (ZeRO stage 3's parameters): input i gathered for the
 * instructions about to read it, as an eager primitive would. */
static void *fetch_input(void *ctx, int i, uint64_t epoch) {
    gj_jit_step_run *sr = ctx;
    gj_tensor *t = sr->bound[i];
    if (!t->storage->fetch) return sr->data[i];
    return gj_rt_storage_fetch(t->storage, epoch) == 0 ? gj_rt_data_ptr(t) : NULL;
}

int gj_jit_step_exec(gj_jit_step_run *sr, const uint64_t *params, void **out, gj_jit_outs *ac) {
    const gj_jit_plan *p = &sr->pr->plan;
    t_n_gives = 0;
    t_n_instrs = p->n_instrs;
    t_last_gemm = -1;
    for (int k = 0; k < p->n_instrs; k++)
        if (p->instrs[k].kind == GJ_JIT_INSTR_MATMUL) t_last_gemm = k;
    int er = gj_jit_plan_exec_calls(p, sr->data, params, out, gj_jit_alloc_output, ac,
                                    call_tensor_hook, call_instr, NULL,
                                    sr->remote ? fetch_input : NULL, sr);
    if (er == 1 && !sr->tripped) er = -1; /* (only a trip abandons) */
    const gj_jit_reducer *red = sr->call->red;
    if (red && sr->pr->n_calls > 0 && red->end(red->ctx) != 0 && er == 0) er = -1;
    return er;
}
