/* SPDX-License-Identifier: MIT */
/*
 * guards.c - user code inside a compiled run: tensor hooks, custom op
 * functions and post-accumulate hooks are called on fresh tensors holding
 * copies of the program's buffers, and what they did is checked right
 * after each call (run.h).
 *
 * Invariants:
 *   - A hook never sees a buffer of the plan: it gets a fresh tensor
 *     holding a copy of the gradient, and what it returns (or the tensor it
 *     kept, with its in-place changes) is copied into the plan's buffer. A
 *     program with hooks also updates existing .grads through private
 *     copies, written back only once every instruction ran (run.c), so a run
 *     abandoned by a guard has written no .grad.
 *   - Guards after each hook call and custom call: record_stream called
 *     (the run finishes, the key becomes eager-only: GJ_CA_RECORD_STREAM);
 *     a graph input (saved tensor, seed, .grad) or a leaf whose .grad the
 *     program writes, whose dtype, shape or storage user code changed with
 *     set_ (GJ_CA_SET_MISMATCH; a .grad swapped for one of the same meta
 *     before the plan touched it is followed instead); a .grad replaced or
 *     created, or failing user code (GJ_CA_HOOK_GUARD). A tensor hook's or
 *     custom call's trip abandons the run, the eager engine runs the whole
 *     backward again (so the user code called before the trip runs twice
 *     in that instruction); a post hook's trip keeps the run, and the .grads not
 *     yet written get what the eager accumulate makes of them (a leaf now
 *     bf16: a bf16 .grad). The caller (backward.c) then makes the key
 *     eager-only, unless the trip was user code failing this time (a hook
 *     or custom op function returning an error, e.g. out of memory) with
 *     no earlier cause in the run (ctx->transient).
 *   - The reason of a run whose guards tripped more than once is its first
 *     cause in program order (gj_jit_trip: class and message), the later
 *     ones listed after "also:"; whether the run goes on depends only on
 *     who tripped (a tensor hook or custom call abandons it), never on
 *     which reason is kept.
 *   - Custom ops: a custom op's backward is a call instruction of the plan; its C
 *     function gets fresh tensors holding copies of the output gradients
 *     and saved arguments, and the gradients it returns are copied into
 *     the plan's buffers. It failing, or returning no gradient for an input
 *     that wants one, abandons the run like a tensor hook's guard (the
 *     eager engine redoes the backward).
 */
#include "jit/run/run.h"
#include "jit/jit.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------- before a program runs */

bool gj_jit_views_overlap(const gj_tensor *a, const gj_tensor *b) {
    if (!a->storage || a->storage != b->storage || a->numel == 0 || b->numel == 0) return false;
    int64_t lo[2], hi[2];
    const gj_tensor *t[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        int64_t l = t[k]->offset, h = t[k]->offset;
        for (int d = 0; d < t[k]->ndim; d++) {
            int64_t e = (t[k]->shape[d] - 1) * t[k]->strides[d];
            if (e < 0) l += e;
            else h += e;
        }
        int64_t es = (int64_t)gj_rt_dtype_size(t[k]->dtype);
        lo[k] = l * es;
        hi[k] = (h + 1) * es; /* exclusive */
    }
    return lo[0] < hi[1] && lo[1] < hi[0];
}

int gj_jit_input_fits(const gj_jit_program *pr, int i, const gj_tensor *t) {
    gj_rt_meta m;
    gj_rt_meta_of(t, &m);
    if (!gj_jit_meta_equal(&m, &pr->plan.in_meta[i])) return 1;
    int64_t st[GJ_MAX_DIMS];
    gj_jit_input_strides(t, st);
    return memcmp(st, pr->inputs[i].strides, (size_t)m.ndim * sizeof st[0]) != 0 ? 2 : 0;
}

void *gj_jit_alloc_output(void *vctx, int o) {
    gj_jit_outs *c = vctx;
    const gj_rt_meta *m = &c->p->out_meta[o];
    c->news[o] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    return c->news[o] ? gj_rt_data_ptr(c->news[o]) : NULL;
}

/* ------------------------------------------------- user code in a run */

/* Records a guard's trip: the first in program order is the reason (class
 * and message); a later one is appended as "; also: <class>: <message>"
 * unless the message holds it already, and a message full ends in "...".
 * What the run does next is up to the caller (abandon or go on), whatever
 * the reason kept. */
void gj_jit_trip(gj_jit_runctx *hc, gj_ca_reason code, const char *fmt, ...) {
    char msg[sizeof hc->why];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!hc->tripped) {
        hc->tripped = true;
        hc->code = code;
        snprintf(hc->why, sizeof hc->why, "%s", msg);
        return;
    }
    char also[sizeof hc->why + 64];
    snprintf(also, sizeof also, "; also: %s: %s", gj_jit_reason_name(code), msg);
    size_t n = strlen(hc->why), cap = sizeof hc->why, len = strlen(msg);
    bool same_first = code == hc->code && strncmp(hc->why, msg, len) == 0 &&
                      (hc->why[len] == '\0' || strncmp(hc->why + len, "; also: ", 8) == 0);
    if (hc->why_full || same_first || strstr(hc->why, also)) return;
    if (n + strlen(also) < cap) {
        memcpy(hc->why + n, also, strlen(also) + 1);
    } else { /* as much as fits, then "..." */
        snprintf(hc->why + n, cap - n, "%s", also);
        memcpy(hc->why + cap - 4, "...", 4);
        hc->why_full = true;
    }
}

/* The leaf of graph output o (NULL for a gradient gj_grad returns). */
gj_tensor *gj_jit_output_leaf(const gj_jit_runctx *hc, int o) {
    int acc = hc->pr->outputs[o].acc_node;
    return acc >= 0 ? hc->w->nodes[acc]->leaf : NULL;
}

/* Trips GJ_CA_SET_MISMATCH if user code `who` changed the dtype, shape or
 * storage of a leaf whose .grad the program writes (a parameter set_ to a
 * bf16 copy in the middle of the backward: eager then makes its .grad
 * bf16). 1 if it tripped, else 0. */
int gj_jit_guard_leaves(gj_jit_runctx *hc, const char *who) {
    char a[96], b[96];
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        gj_tensor *leaf = gj_jit_output_leaf(hc, o);
        if (!leaf) continue; /* a gj_grad output: no leaf written */
        gj_rt_meta m;
        gj_rt_meta_of(leaf, &m);
        if (!gj_jit_meta_equal(&m, &hc->leaf_meta[o])) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s changed leaf %s (whose .grad is output #%d) to "
                 "%s (set_) during a compiled run", who,
                 gj_jit_fmt_meta(a, sizeof a, &hc->leaf_meta[o]), o,
                 gj_jit_fmt_meta(b, sizeof b, &m));
            return 1;
        }
        if (gj_rt_data_ptr(leaf) != hc->leaf_data[o]) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of leaf %s (whose .grad is "
                 "output #%d) (set_) during a compiled run", who,
                 gj_jit_fmt_meta(a, sizeof a, &m), o);
            return 1;
        }
    }
    return 0;
}

/* Checks, after user code `who` ("hook #3", "custom op ns::f") ran at
 * instruction `instruction` (a tensor hook or a custom call), that every tensor the
 * program reads or writes is still the one it was compiled for: inputs
 * (saved tensors, seeds, .grads) and the leaves whose .grad it writes. A
 * set_ that changed the dtype, shape or storage of one of them trips
 * GJ_CA_SET_MISMATCH, whichever user code made it; except that a .grad
 * whose storage was swapped (same dtype and shape) before the plan first
 * touched it is read again from its new storage, as the eager accumulation
 * would. A .grad replaced or created trips GJ_CA_HOOK_GUARD.
 * 0, 1 (tripped: abandon) or -1 (error). */
static int guard_inputs(gj_jit_runctx *hc, const char *who, int step) {
    const gj_jit_plan *p = &hc->pr->plan;
    char a[96], b[96];
    for (int i = 0; i < hc->pr->n_inputs; i++) {
        gj_tensor *t = hc->tensors[i];
        const gj_jit_input *in = &hc->pr->inputs[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (!gj_jit_meta_equal(&m, &p->in_meta[i])) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH,
                 "%s changed %s #%d from %s to %s (set_) during a compiled run", who,
                 in->role == GJ_JIT_IN_GRAD ? "the .grad of input" : "input", i,
                 gj_jit_fmt_meta(a, sizeof a, &p->in_meta[i]), gj_jit_fmt_meta(b, sizeof b, &m));
            return 1;
        }
        if (in->role == GJ_JIT_IN_GRAD) {
            gj_tensor *leaf = hc->w->nodes[in->node]->leaf;
            gj_ag_tensor_meta *lm = leaf ? leaf->ag : NULL;
            if (!lm || lm->grad != t) {
                gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s replaced the .grad of a leaf during a "
                     "compiled run", who);
                return 1;
            }
            if (gj_rt_data_ptr(t) != hc->data0[i]) {
                if (p->bufs[i].first_instr >= 0 && p->bufs[i].first_instr <= step) {
                    gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of a .grad (set_) "
                         "after the compiled run had updated it", who);
                    return 1;
                }
                if (gj_rt_copy_into(hc->priv[i], t) != 0) return -1;
                hc->data0[i] = gj_rt_data_ptr(t);
            }
            continue; /* the sum is written back to its (new) storage at the end */
        }
        if (gj_rt_data_ptr(t) != hc->data0[i]) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of input #%d (set_) "
                 "during a compiled run", who, i);
            return 1;
        }
    }
    if (gj_jit_guard_leaves(hc, who) != 0) return 1;
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        if (hc->pr->outputs[o].grad_input >= 0 || !gj_jit_output_leaf(hc, o)) continue;
        gj_ag_tensor_meta *lm = gj_jit_output_leaf(hc, o)->ag;
        if (lm && lm->grad) {
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s gave a leaf a .grad during a compiled run", who);
            return 1;
        }
    }
    return 0;
}

/* gj_jit_hook_call of run_program: calls the tensor hook on a fresh tensor
 * holding a copy of src and copies the value flowing on into dst. */
int gj_jit_call_tensor_hook(void *vctx, const gj_jit_hook_instr *hs, const void *src, void *dst) {
    gj_jit_runctx *hc = vctx;
    const gj_rt_meta *m = &hs->meta;
    int64_t numel = 1;
    for (int k = 0; k < m->ndim; k++) numel *= m->shape[k];
    size_t nb = (size_t)numel * gj_rt_dtype_size(m->dtype);
    const gj_ag_hook *h = hc->hooks[hs->hook];
    if (h->removed) { /* removed by an earlier hook of this backward: eager skips it */
        if (nb) memcpy(dst, src, nb);
        return 0;
    }
    gj_tensor *t = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    if (!t) return -1;
    if (nb) memcpy(gj_rt_data_ptr(t), src, nb);
    uint64_t rs0 = gj_rt_record_stream_calls();
    gj_tensor *rt = gj_ag_call_hook_ref(h, t);
    int rc = 0;
    if (!rt) {
        hc->transient = !hc->tripped; /* (a cause that recurs, met earlier, still demotes) */
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "hook #%lld failed during a compiled run: %s",
             (long long)h->handle, gj_last_error());
        rc = 1;
    } else {
        gj_tensor *c = gj_rt_is_contiguous(rt) ? rt : gj_rt_contiguous(rt);
        if (!c) {
            rc = -1;
        } else {
            if (nb) memcpy(dst, gj_rt_data_ptr(c), nb);
            if (c != rt) gj_rt_tensor_release(c);
        }
        gj_rt_tensor_release(rt);
    }
    gj_rt_tensor_release(t);
    if (rc == 0 && gj_rt_record_stream_calls() != rs0)
        gj_jit_trip(hc, GJ_CA_RECORD_STREAM, "hook #%lld called gj_tensor_record_stream during a "
             "compiled run", (long long)h->handle);
    if (rc == 0) {
        const gj_jit_instr *st = (const gj_jit_instr *)(const void *)((const char *)hs -
                                                                     offsetof(gj_jit_instr, hk));
        char who[48];
        snprintf(who, sizeof who, "hook #%lld", (long long)h->handle);
        rc = guard_inputs(hc, who, (int)(st - hc->pr->plan.instrs));
    }
    return rc;
}

int gj_jit_call_inputs(const gj_jit_call_instr *cs, void *const *src, gj_tensor **ts) {
    for (int k = 0; k < cs->n_in; k++) {
        const gj_rt_meta *m = &cs->in_meta[k];
        ts[k] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
        if (!ts[k]) return -1;
        size_t nb = (size_t)gj_rt_numel(m->ndim, m->shape) * gj_rt_dtype_size(m->dtype);
        if (nb) memcpy(gj_rt_data_ptr(ts[k]), src[k], nb);
    }
    return 0;
}

/* The forward call instruction of gj_jit_call_custom: runs the custom op's forward C
 * function on fresh tensors holding copies of its tensor arguments (src)
 * and copies its outputs into dst. It failing, or giving an output of
 * another shape or dtype than the region's first run, abandons the run
 * (GJ_CA_HOOK_GUARD): the eager engine redoes the backward. */
static int call_custom_fwd(gj_jit_runctx *hc, const gj_jit_call_instr *cs, const gj_ag_opdef *od,
                           const gj_ag_attrs *at, const gj_custom_op *op, void *const *src,
                           void *const *dst) {
    int no = gj_ag_custom_n_outputs(op), nt = gj_ag_custom_n_tensor_args(op);
    if (nt != cs->n_in || no != cs->n_out) {
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: the tape op does not match the program",
             od->name);
        return 1;
    }
    gj_tensor *ts[GJ_JIT_CALL_MAX_IN] = {0}, *outs[GJ_RT_MAX_OUTPUTS] = {0};
    int rc = -1;
    if (gj_jit_call_inputs(cs, src, ts) != 0) goto done;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_custom_run_forward(op, at, ts, outs) != 0) {
        hc->transient = !hc->tripped;
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: forward failed while recomputing a "
             "checkpoint region during a compiled run: %s", od->name, gj_last_error());
        rc = 1;
        goto done;
    }
    if (gj_rt_record_stream_calls() != rs0)
        gj_jit_trip(hc, GJ_CA_RECORD_STREAM, "custom op %s called gj_tensor_record_stream during a "
             "compiled run", od->name);
    for (int k = 0; k < cs->n_out; k++) {
        gj_rt_meta m;
        gj_rt_meta_of(outs[k], &m);
        if (!gj_jit_meta_equal(&m, &cs->out_meta[k])) {
            char a[96], b[96];
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: recomputed output %d is %s, the region's "
                 "first run gave %s", od->name, k, gj_jit_fmt_meta(a, sizeof a, &m),
                 gj_jit_fmt_meta(b, sizeof b, &cs->out_meta[k]));
            rc = 1;
            goto done;
        }
        gj_tensor *c = gj_rt_is_contiguous(outs[k]) ? outs[k] : gj_rt_contiguous(outs[k]);
        if (!c) goto done;
        size_t nb = (size_t)gj_rt_numel(m.ndim, m.shape) * gj_rt_dtype_size(m.dtype);
        if (nb) memcpy(dst[k], gj_rt_data_ptr(c), nb);
        if (c != outs[k]) gj_rt_tensor_release(c);
    }
    rc = 0;
done:
    for (int k = 0; k < GJ_JIT_CALL_MAX_IN; k++)
        if (ts[k]) gj_rt_tensor_release(ts[k]);
    for (int k = 0; k < GJ_RT_MAX_OUTPUTS; k++)
        if (outs[k]) gj_rt_tensor_release(outs[k]);
    return rc;
}

/* gj_jit_custom_call of run_program: runs the custom op's backward C
 * function on fresh tensors holding copies of src (output gradients, then
 * saved arguments) and copies the gradients of the needed inputs into dst.
 * The function failing, or returning no gradient for a needed input,
 * abandons the run (GJ_CA_HOOK_GUARD): the eager engine redoes the
 * backward and reports the error or lets no gradient flow, as it does. */
int gj_jit_call_custom(void *vctx, const gj_jit_call_instr *cs, void *const *src,
                       void *const *dst) {
    gj_jit_runctx *hc = vctx;
    const gj_ag_node *node = cs->node < hc->w->n ? hc->w->nodes[cs->node] : NULL;
    const gj_ag_opdef *od = NULL;
    const gj_ag_attrs *at = NULL;
    if (node && cs->tape < 0) {
        od = node->op;
        at = &node->attrs;
    } else if (node) { /* an op of a checkpoint node's tape */
        od = gj_ag_ckpt_op(node, cs->tape, &at);
    }
    const gj_custom_op *op = od && at ? gj_ag_custom_of(od) : NULL;
    if (!op) {
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom call of node %d: not a custom op", cs->node);
        return 1;
    }
    int no = gj_ag_custom_n_outputs(op), nt = gj_ag_custom_n_tensor_args(op);
    if (cs->fwd) return call_custom_fwd(hc, cs, od, at, op, src, dst);
    if (no + nt != cs->n_in) {
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: the node does not match the program", od->name);
        return 1;
    }
    gj_tensor *ts[GJ_JIT_CALL_MAX_IN] = {0}, *gin[GJ_JIT_CALL_MAX_IN] = {0};
    int rc = -1;
    if (gj_jit_call_inputs(cs, src, ts) != 0) goto done;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_custom_run_backward(op, at, cs->in_meta, ts, ts + no, gin) != 0) {
        hc->transient = !hc->tripped;
        gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: backward failed during a compiled run: %s",
             od->name, gj_last_error());
        rc = 1;
        goto done;
    }
    if (gj_rt_record_stream_calls() != rs0)
        gj_jit_trip(hc, GJ_CA_RECORD_STREAM, "custom op %s called gj_tensor_record_stream during a "
             "compiled run", od->name);
    for (int i = 0, j = 0; i < nt && j < cs->n_out; i++) {
        if (!(cs->args & (1u << i))) continue; /* no gradient wanted: not an output */
        if (!gin[i]) {
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: backward returned no gradient for "
                 "tensor argument %d during a compiled run", od->name, i);
            rc = 1;
            goto done;
        }
        gj_tensor *c = gj_rt_is_contiguous(gin[i]) ? gin[i] : gj_rt_contiguous(gin[i]);
        if (!c) goto done;
        size_t nb = (size_t)gj_rt_numel(c->ndim, c->shape) * gj_rt_dtype_size(c->dtype);
        if (nb) memcpy(dst[j], gj_rt_data_ptr(c), nb);
        if (c != gin[i]) gj_rt_tensor_release(c);
        j++;
    }
    {
        const gj_jit_instr *st = (const gj_jit_instr *)(const void *)((const char *)cs -
                                                                     offsetof(gj_jit_instr, cs));
        char who[160];
        snprintf(who, sizeof who, "custom op %s", od->name);
        rc = guard_inputs(hc, who, (int)(st - hc->pr->plan.instrs));
    }
done:
    for (int k = 0; k < GJ_JIT_CALL_MAX_IN; k++) {
        if (ts[k]) gj_rt_tensor_release(ts[k]);
        if (gin[k]) gj_rt_tensor_release(gin[k]);
    }
    return rc;
}

/* Runs post-accumulate hook i of the program (its leaf's .grad is written)
 * and its guards, which trip but never abandon (the .grads written so far
 * are final): record_stream, a .grad whose dtype or shape changed, a leaf
 * of an output changed by set_ (the outputs not yet written then get the
 * eager accumulate's result, see write_output), a .grad given to a leaf
 * whose output is not yet written. 0, or -1 when an error was raised inside
 * the hook (the backward then fails with it, as in eager). */
int gj_jit_run_post_hook(gj_jit_runctx *hc, int i, int written) {
    gj_ag_builder *eb = gj_ag_eager_builder();
    const gj_jit_hookref *ref = &hc->pr->hooks[i];
    const gj_ag_hook *h = hc->hooks[i];
    gj_tensor *leaf = hc->w->nodes[ref->node]->leaf;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_eager_call_post_hook(eb, h, leaf) != 0)
        return -1; /* an error inside the hook fails the backward, as in eager */
    if (gj_rt_record_stream_calls() != rs0)
        gj_jit_trip(hc, GJ_CA_RECORD_STREAM, "post-accumulate hook #%lld called "
             "gj_tensor_record_stream during a compiled run", (long long)h->handle);
    char who[64];
    snprintf(who, sizeof who, "post-accumulate hook #%lld", (long long)h->handle);
    gj_jit_guard_leaves(hc, who);
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        gj_ag_tensor_meta *lm = gj_jit_output_leaf(hc, o) ? gj_jit_output_leaf(hc, o)->ag : NULL;
        gj_rt_meta m;
        if (!lm || !lm->grad) continue;
        if (o >= written && hc->pr->outputs[o].grad_input < 0) {
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s gave a leaf a .grad during a compiled run", who);
            continue;
        }
        gj_rt_meta_of(lm->grad, &m);
        if (!gj_jit_meta_equal(&m, &hc->pr->plan.out_meta[o])) {
            char a[96], b[96];
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s changed a .grad from %s to %s (set_) during a "
                 "compiled run", who, gj_jit_fmt_meta(a, sizeof a, &hc->pr->plan.out_meta[o]),
                 gj_jit_fmt_meta(b, sizeof b, &m));
        }
    }
    return 0;
}

