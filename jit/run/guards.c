/* SPDX-License-Identifier: MIT */
/*
 * guards.c - the checks of a compiled run (run.h), for the backward and
 * the training step alike: before a program runs, whether a tensor fits
 * the program's input (meta, layout) and whether two views share memory;
 * after user code ran inside a run, whether the program still computes
 * what eager would; and the record of what tripped.
 *
 * Invariants:
 *   - Guards after a call inside a program (a tensor hook, a custom op, a
 *     step's post-accumulate hooks; calls.c runs them): a program input
 *     (saved tensor, seed, .grad, a step's parameter, state, input or
 *     constant) or a leaf whose .grad the program writes, whose dtype,
 *     shape or storage user code changed with set_ (GJ_CA_SET_MISMATCH; a
 *     .grad swapped for one of the same meta before the plan touched it is
 *     followed instead; a remote storage's bytes come and go, ZeRO stage
 *     3's gathers, and are not a swap); a .grad replaced or created
 *     (GJ_CA_HOOK_GUARD). Such a trip abandons the run.
 *   - Guards after a backward's post-accumulate hook, which runs once the
 *     .grads before it are written: a leaf changed by set_, a .grad given
 *     or changed. They trip but keep the run: the .grads not yet written
 *     get what the eager accumulate makes of them (a leaf now bf16: a bf16
 *     .grad). The caller then makes the key eager-only.
 *   - The reason of a run whose guards tripped more than once is its first
 *     cause in program order (gj_jit_trip: class and message), the later
 *     ones listed after "also:"; whether the run goes on depends only on
 *     who tripped, never on which reason is kept. `transient` is set by
 *     the caller of the first trip when it is user code failing this time
 *     (calls.c), which does not make the key or the step eager.
 */
#include "jit/run/run.h"
#include "jit/jit.h"

#include <stdarg.h>
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

/* ------------------------------------------------ after user code ran */

/* The word of the run's messages: "... during a compiled run" (a
 * backward, or no path: gj_jit_trip's own tests) or "... step". */
static const char *path_name(const gj_jit_runctx *hc) {
    return hc->path ? hc->path->name : "run";
}

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

gj_tensor *gj_jit_output_leaf(const gj_jit_runctx *hc, int o) {
    int acc = hc->pr->outputs[o].acc_node;
    return acc >= 0 && hc->w ? hc->w->nodes[acc]->leaf : NULL;
}

/* Trips GJ_CA_SET_MISMATCH if user code `who` changed the dtype, shape or
 * storage of a leaf whose .grad the program writes (a parameter set_ to a
 * bf16 copy in the middle of the backward: eager then makes its .grad
 * bf16). 1 if it tripped, else 0. */
static int guard_leaves(gj_jit_runctx *hc, const char *who) {
    char a[96], b[96];
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        gj_tensor *leaf = gj_jit_output_leaf(hc, o);
        if (!leaf) continue; /* a gj_grad output: no leaf written */
        gj_rt_meta m;
        gj_rt_meta_of(leaf, &m);
        if (!gj_jit_meta_equal(&m, &hc->leaf_meta[o])) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s changed leaf %s (whose .grad is output #%d) to "
                 "%s (set_) during a compiled %s", who,
                 gj_jit_fmt_meta(a, sizeof a, &hc->leaf_meta[o]), o,
                 gj_jit_fmt_meta(b, sizeof b, &m), path_name(hc));
            return 1;
        }
        if (gj_rt_data_ptr(leaf) != hc->leaf_data[o]) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of leaf %s (whose .grad is "
                 "output #%d) (set_) during a compiled %s", who,
                 gj_jit_fmt_meta(a, sizeof a, &m), o, path_name(hc));
            return 1;
        }
    }
    return 0;
}

/* How a message names program input i: "input #3", "the .grad of input
 * #3", or, in a step (whose input numbers mean nothing to its user), "a
 * tensor of the step". */
static const char *input_name(const gj_jit_input *in, int i, char *buf, size_t cap) {
    if (in->role == GJ_JIT_IN_STEP) return "a tensor of the step";
    snprintf(buf, cap, "%sinput #%d", in->role == GJ_JIT_IN_GRAD ? "the .grad of " : "", i);
    return buf;
}

/* Checks, after user code `who` ("hook #3", "custom op ns::f") ran at
 * instruction `instr`, that every tensor the program reads or writes is
 * still the one it was compiled for: inputs (saved tensors, seeds, .grads,
 * a step's tensors) and the leaves whose .grad it writes. A set_ that
 * changed the dtype, shape or storage of one of them trips
 * GJ_CA_SET_MISMATCH, whichever user code made it; except that a .grad
 * whose storage was swapped (same dtype and shape) before the plan first
 * touched it is read again from its new storage, as the eager accumulation
 * would. A .grad replaced or created trips GJ_CA_HOOK_GUARD.
 * 0, 1 (tripped: abandon) or -1 (error). */
int gj_jit_guard_inputs(gj_jit_runctx *hc, const char *who, int instr) {
    const gj_jit_plan *p = &hc->pr->plan;
    char a[96], b[96], nm[48];
    for (int i = 0; i < hc->pr->n_inputs; i++) {
        gj_tensor *t = hc->tensors[i];
        const gj_jit_input *in = &hc->pr->inputs[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (!gj_jit_meta_equal(&m, &p->in_meta[i])) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s changed %s from %s to %s (set_) during a "
                        "compiled %s", who, input_name(in, i, nm, sizeof nm),
                        gj_jit_fmt_meta(a, sizeof a, &p->in_meta[i]),
                        gj_jit_fmt_meta(b, sizeof b, &m), path_name(hc));
            return 1;
        }
        if (in->role == GJ_JIT_IN_GRAD) {
            gj_tensor *leaf = hc->w->nodes[in->node]->leaf;
            gj_ag_tensor_meta *lm = leaf ? leaf->ag : NULL;
            if (!lm || lm->grad != t) {
                gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s replaced the .grad of a leaf during a "
                     "compiled %s", who, path_name(hc));
                return 1;
            }
            if (gj_rt_data_ptr(t) != hc->data0[i]) {
                if (p->bufs[i].first_instr >= 0 && p->bufs[i].first_instr <= instr) {
                    gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of a .grad (set_) "
                         "after the compiled %s had updated it", who, path_name(hc));
                    return 1;
                }
                if (gj_rt_copy_into(hc->priv[i], t) != 0) return -1;
                hc->data0[i] = gj_rt_data_ptr(t);
            }
            continue; /* the sum is written back to its (new) storage at the end */
        }
        /* (a remote storage's bytes come and go: ZeRO stage 3's gathers) */
        if (!t->storage->fetch && gj_rt_data_ptr(t) != hc->data0[i]) {
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of %s (set_) during a "
                        "compiled %s", who, input_name(in, i, nm, sizeof nm), path_name(hc));
            return 1;
        }
    }
    if (guard_leaves(hc, who) != 0) return 1;
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        if (hc->pr->outputs[o].grad_input >= 0 || !gj_jit_output_leaf(hc, o)) continue;
        gj_ag_tensor_meta *lm = gj_jit_output_leaf(hc, o)->ag;
        if (lm && lm->grad) {
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s gave a leaf a .grad during a compiled %s", who,
                        path_name(hc));
            return 1;
        }
    }
    return 0;
}

/* The guards after a backward's post-accumulate hook (its .grads before it
 * written): a leaf of an output changed by set_ (the outputs not yet
 * written then get the eager accumulate's result, grads.c's write_output),
 * a .grad given to a leaf whose output is not yet written, a .grad whose
 * dtype or shape changed. They trip, never abandon. */
void gj_jit_guard_post(gj_jit_runctx *hc, const char *who, int written) {
    guard_leaves(hc, who);
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        gj_ag_tensor_meta *lm = gj_jit_output_leaf(hc, o) ? gj_jit_output_leaf(hc, o)->ag : NULL;
        gj_rt_meta m;
        if (!lm || !lm->grad) continue;
        if (o >= written && hc->pr->outputs[o].grad_input < 0) {
            gj_jit_trip(hc, GJ_CA_HOOK_GUARD, "%s gave a leaf a .grad during a compiled %s", who,
                        path_name(hc));
            continue;
        }
        gj_rt_meta_of(lm->grad, &m);
        if (!gj_jit_meta_equal(&m, &hc->pr->plan.out_meta[o])) {
            char a[96], b[96];
            gj_jit_trip(hc, GJ_CA_SET_MISMATCH, "%s changed a .grad from %s to %s (set_) during a "
                 "compiled %s", who, gj_jit_fmt_meta(a, sizeof a, &hc->pr->plan.out_meta[o]),
                 gj_jit_fmt_meta(b, sizeof b, &m), path_name(hc));
        }
    }
}
