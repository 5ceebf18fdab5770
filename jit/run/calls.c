/* SPDX-License-Identifier: MIT */
/*
 * calls.c - user code inside a compiled run (run.h), for the backward and
 * the training step alike: tensor hooks, custom ops' forward and backward
 * C functions and post-accumulate hooks, each called on fresh tensors
 * holding copies of the program's buffers and followed by the guards
 * (guards.c). What differs between the paths is the path's own
 * (gj_jit_run_path): how a hook or a custom call finds what it calls, the
 * words of the messages, whether every trip stops the run, and the call
 * instructions only it makes (a step's reducer calls, step/calls.c).
 *
 * Invariants:
 *   - User code never sees a buffer of the plan: a hook gets a fresh
 *     tensor holding a copy of the gradient, and what it returns (or the
 *     tensor it kept, with its in-place changes) is copied into the plan's
 *     buffer; a custom op's function gets fresh tensors holding copies of
 *     its arguments, and its results are copied back. A backward with user
 *     code updates existing .grads through private copies, written back
 *     only once every instruction ran (grads.c), and a step's calls all
 *     come before its first update, so a run abandoned by a trip has
 *     written nothing.
 *   - After each call, in this order: the call failing (GJ_CA_HOOK_GUARD,
 *     transient: user code failing this time keeps the key or the step
 *     compiled, unless an earlier cause of the run recurs); record_stream
 *     called in it (GJ_CA_RECORD_STREAM); what it returned (a custom op's
 *     result of another dtype or shape than the program's, or no gradient
 *     for an input that wants one: GJ_CA_HOOK_GUARD); the program's
 *     tensors (gj_jit_guard_inputs). A tensor hook's or custom call's trip
 *     abandons the run (the eager engine or the eager step runs it again,
 *     so the user code called before the trip runs twice); a record_stream
 *     does too where the path stops on every trip (the step), else the run
 *     goes on and the key becomes eager-only afterwards.
 *   - A backward's post-accumulate hooks run after the .grads before them
 *     are written: an error raised inside one fails the backward, as in
 *     eager, and their guards (gj_jit_guard_post) never abandon.
 */
#include "jit/run/run.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* The bytes of a dense tensor of meta m. */
static size_t meta_nbytes(const gj_rt_meta *m) {
    return (size_t)gj_rt_numel(m->ndim, m->shape) * gj_rt_dtype_size(m->dtype);
}

int gj_jit_copy_out(gj_tensor *t, void *dst, size_t nb) {
    gj_tensor *c = gj_rt_is_contiguous(t) ? t : gj_rt_contiguous(t);
    if (!c) return -1;
    if (nb) memcpy(dst, gj_rt_data_ptr(c), nb);
    if (c != t) gj_rt_tensor_release(c);
    return 0;
}

int gj_jit_call_instr_index(const gj_jit_runctx *hc, const gj_jit_call_instr *cs) {
    const gj_jit_instr *st =
        (const gj_jit_instr *)(const void *)((const char *)cs - offsetof(gj_jit_instr, cs));
    return (int)(st - hc->pr->plan.instrs);
}

/* User code failed this time (fmt: what and why): a trip of class
 * GJ_CA_HOOK_GUARD that is transient when it is the run's first cause.
 * Returns 1 (abandon the run). */
static int failed(gj_jit_runctx *hc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int failed(gj_jit_runctx *hc, const char *fmt, ...) {
    char msg[sizeof hc->why];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    hc->transient = !hc->tripped; /* (a cause that recurs, met earlier, still demotes) */
    gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s", msg);
    return 1;
}

/* Right after user code `who` returned (rs0: the record_stream count before
 * it): a record_stream in it trips GJ_CA_RECORD_STREAM. 1 when the run
 * stops there (the path stops on every trip), else 0. */
static int after_call(gj_jit_runctx *hc, const char *who, uint64_t rs0) {
    if (gj_rt_record_stream_calls() == rs0) return 0;
    gj_jit_trip(hc, GJ_CA_RECORD_STREAM, "%s called gj_tensor_record_stream during a compiled %s",
                who, hc->path->name);
    return hc->path->stop_on_trip ? 1 : 0;
}

/* ------------------------------------------------------- tensor hooks */

/* gj_jit_hook_call of a run: the tensor hook of hook instruction hs on a
 * fresh tensor holding a copy of src; the value flowing on (what it
 * returned, or the tensor it kept) copied into dst; then the guards. A
 * hook an earlier hook removed is skipped, as eager skips it. 0, 1
 * (abandon: tripped) or -1 (error set). */
static int call_tensor_hook(void *ctx, const gj_jit_hook_instr *hs, const void *src, void *dst) {
    gj_jit_runctx *hc = ctx;
    const gj_rt_meta *m = &hs->meta;
    size_t nb = meta_nbytes(m);
    const gj_ag_hook *h = hc->path->hook(hc, hs->hook);
    if (!h) {
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "hook #%d of the %s's program is not on its leaf",
                    hs->hook, hc->path->name);
        return 1;
    }
    if (h->removed) {
        if (nb) memcpy(dst, src, nb);
        return 0;
    }
    gj_tensor *t = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    if (!t) return -1;
    if (nb) memcpy(gj_rt_data_ptr(t), src, nb);
    uint64_t rs0 = gj_rt_record_stream_calls();
    gj_tensor *rt = gj_ag_call_hook_ref(h, t);
    gj_rt_tensor_release(t);
    char who[48];
    snprintf(who, sizeof who, "hook #%lld", (long long)h->handle);
    if (!rt)
        return failed(hc, "%s failed during a compiled %s: %s", who, hc->path->name,
                      gj_last_error());
    int rc = gj_jit_copy_out(rt, dst, nb);
    gj_rt_tensor_release(rt);
    if (rc != 0) return -1;
    if (after_call(hc, who, rs0) != 0) return 1;
    const gj_jit_instr *st =
        (const gj_jit_instr *)(const void *)((const char *)hs - offsetof(gj_jit_instr, hk));
    return gj_jit_guard_inputs(hc, who, (int)(st - hc->pr->plan.instrs));
}

/* ---------------------------------------------------------- custom ops */

/* Fresh contiguous tensors ts[0..cs->n_in) holding copies of call
 * instruction cs's input buffers src[] (of cs->in_meta): what user code
 * gets instead of a plan's buffers. 0, or -1 on OOM (the ones made so far
 * are in ts for the caller to release). */
static int call_inputs(const gj_jit_call_instr *cs, void *const *src, gj_tensor **ts) {
    for (int k = 0; k < cs->n_in; k++) {
        const gj_rt_meta *m = &cs->in_meta[k];
        ts[k] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
        if (!ts[k]) return -1;
        size_t nb = meta_nbytes(m);
        if (nb) memcpy(gj_rt_data_ptr(ts[k]), src[k], nb);
    }
    return 0;
}

/* What custom op od's function returned for call cs (res: a forward's
 * outputs, or a backward's gradient per tensor argument), copied into dst:
 * each of the program's meta. A result of another dtype or shape, or no
 * gradient for an argument that wants one, trips GJ_CA_HOOK_GUARD (the
 * eager engine then reports or skips it as it does). 0, 1 or -1. */
static int custom_results(gj_jit_runctx *hc, const gj_jit_call_instr *cs, const gj_ag_opdef *od,
                          int n_res, gj_tensor *const *res, void *const *dst) {
    for (int i = 0, j = 0; i < n_res && j < cs->n_out; i++) {
        if (!cs->fwd && !(cs->args & (1u << i))) continue; /* no gradient wanted: not an output */
        if (!res[i]) {
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: backward returned no gradient for "
                        "tensor argument %d during a compiled %s", od->name, i, hc->path->name);
            return 1;
        }
        gj_rt_meta m;
        gj_rt_meta_of(res[i], &m);
        if (!gj_jit_meta_equal(&m, &cs->out_meta[j])) {
            char a[96], b[96];
            gj_jit_fmt_meta(a, sizeof a, &m);
            gj_jit_fmt_meta(b, sizeof b, &cs->out_meta[j]);
            if (cs->fwd && cs->tape >= 0)
                gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: recomputed output %d is %s, the "
                            "region's first run gave %s", od->name, i, a, b);
            else
                gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: its %s gave %s for %s %d where "
                            "the program has %s", od->name, cs->fwd ? "forward" : "backward", a,
                            cs->fwd ? "output" : "argument", i, b);
            return 1;
        }
        if (gj_jit_copy_out(res[i], dst[j++], meta_nbytes(&m)) != 0) return -1;
    }
    return 0;
}

/* A custom call instruction: the op's backward C function on fresh
 * tensors holding copies of src (output gradients, then saved arguments),
 * the gradients of the arguments in cs->args copied into dst; or, for a
 * forward call (a checkpoint region's recomputation, or the step
 * function's own call in a step), its forward on copies of its tensor
 * arguments, the outputs copied into dst. Then the guards. 0, 1 or -1. */
static int call_custom(gj_jit_runctx *hc, const gj_jit_call_instr *cs, void *const *src,
                       void *const *dst) {
    const gj_ag_attrs *at = NULL;
    const gj_ag_opdef *od = hc->path->custom(hc, cs, &at);
    const gj_custom_op *op = od && at ? gj_ag_custom_of(od) : NULL;
    if (!op) {
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom call of node %d: not a custom op", cs->node);
        return 1;
    }
    int no = gj_ag_custom_n_outputs(op), nt = gj_ag_custom_n_tensor_args(op);
    if (cs->fwd ? nt != cs->n_in || no != cs->n_out : no + nt != cs->n_in) {
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: the %s does not match the program",
                    od->name, cs->tape >= 0 ? "tape op" : "node");
        return 1;
    }
    gj_tensor *ts[GJ_JIT_CALL_MAX_IN] = {0}, *res[GJ_JIT_CALL_MAX_IN + GJ_RT_MAX_OUTPUTS] = {0};
    char who[160];
    snprintf(who, sizeof who, "custom op %s", od->name);
    int rc = -1;
    if (call_inputs(cs, src, ts) != 0) goto done;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (cs->fwd ? gj_ag_custom_run_forward(op, at, ts, res) != 0
                : gj_ag_custom_run_backward(op, at, cs->in_meta, ts, ts + no, res) != 0) {
        rc = failed(hc, "%s: %s failed%s during a compiled %s: %s", who,
                    cs->fwd ? "forward" : "backward",
                    cs->fwd && cs->tape >= 0 ? " while recomputing a checkpoint region" : "",
                    hc->path->name, gj_last_error());
        goto done;
    }
    rc = after_call(hc, who, rs0);
    if (rc == 0) rc = custom_results(hc, cs, od, cs->fwd ? no : nt, res, dst);
    if (rc == 0) rc = gj_jit_guard_inputs(hc, who, gj_jit_call_instr_index(hc, cs));
done:
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++)
        if (ts[k]) gj_rt_tensor_release(ts[k]);
    for (size_t k = 0; k < sizeof res / sizeof res[0]; k++)
        if (res[k]) gj_rt_tensor_release(res[k]);
    return rc;
}

/* gj_jit_custom_call of a run: a custom op's call, or one of the path's own
 * call instructions. */
static int call_instr(void *ctx, const gj_jit_call_instr *cs, void *const *src,
                      void *const *dst) {
    gj_jit_runctx *hc = ctx;
    if (cs->tape >= -1 || cs->tape == GJ_JIT_CALL_STEP_FWD) return call_custom(hc, cs, src, dst);
    if (!hc->path->own) {
        gj_rt_set_error("compiled %s: internal: a call instruction of kind %d that it does not "
                        "make", hc->path->name, cs->tape);
        return -1;
    }
    return hc->path->own(hc, cs, src, dst);
}

/* ------------------------------------------------------------ the run */

/* gj_jit_input_fetch of a run whose inputs include remote storages (ZeRO
 * stage 3's parameters): input i gathered for the instructions about to
 * read it, as an eager primitive would. */
static void *fetch_input(void *ctx, int i, uint64_t epoch) {
    gj_jit_runctx *hc = ctx;
    gj_tensor *t = hc->tensors[i];
    if (!t->storage->fetch) return hc->data0[i];
    return gj_rt_storage_fetch(t->storage, epoch) == 0 ? gj_rt_data_ptr(t) : NULL;
}

int gj_jit_run_calls(gj_jit_runctx *hc, void *const *in, const uint64_t *params, void **out,
                     gj_jit_outs *ac, gj_jit_progress progress) {
    return gj_jit_plan_exec_calls(&hc->pr->plan, in, params, out, gj_jit_alloc_output, ac,
                                  call_tensor_hook, call_instr, progress,
                                  hc->remote ? fetch_input : NULL, hc);
}

/* ------------------------------------------------ post-accumulate hooks */

int gj_jit_call_post_hook(gj_jit_runctx *hc, const gj_ag_hook *h, gj_tensor *leaf, int instr) {
    char who[64];
    snprintf(who, sizeof who, "post-accumulate hook #%lld", (long long)h->handle);
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_eager_call_post_hook(NULL, h, leaf) != 0)
        return failed(hc, "%s failed during a compiled %s: %s", who, hc->path->name,
                      gj_last_error());
    if (after_call(hc, who, rs0) != 0) return 1;
    return gj_jit_guard_inputs(hc, who, instr);
}

int gj_jit_run_post_hook(gj_jit_runctx *hc, int i, int written) {
    const gj_jit_hookref *ref = &hc->pr->hooks[i];
    const gj_ag_hook *h = hc->hooks[i];
    gj_tensor *leaf = hc->w->nodes[ref->node]->leaf;
    char who[64];
    snprintf(who, sizeof who, "post-accumulate hook #%lld", (long long)h->handle);
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_eager_call_post_hook(NULL, h, leaf) != 0)
        return -1; /* an error inside the hook fails the backward, as in eager */
    (void)after_call(hc, who, rs0); /* (a backward's path goes on) */
    gj_jit_guard_post(hc, who, written);
    return 0;
}
