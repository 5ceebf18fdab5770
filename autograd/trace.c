/* SPDX-License-Identifier: MIT */
/*
 * trace.c - the trace of a training step's forward: while a step function
 * runs eagerly under gj_ag_trace_begin, every op gj_ag_apply runs on this
 * thread is appended to the trace, with where each of its inputs came
 * from, so that the compiler can replay the forward with the recording
 * builder and compile forward, backward and update as one program (the
 * compiled step, jit/step.c). The eager run itself is unchanged: its
 * results are the reference.
 *
 * Slots. Every tensor the trace has seen is a slot: a step input, a
 * parameter, a constant (a tensor from outside the function, or made in it
 * by a creation function whose result depends only on its arguments:
 * gj_zeros, gj_ones, gj_full, gj_scalar), an output of an entry, or an
 * alias (gj_detach) of another slot, which is the same value without a
 * gradient. While the trace lives it holds a strong reference to every
 * slot's tensor, so no pointer is reused while slots are found by pointer.
 *
 * Invariants:
 *   - Entries are in execution order and read only slots defined before.
 *   - An op run inside a checkpoint region is on the region's tape, not
 *     here; the region's own node (op "checkpoint") is an entry.
 *   - Whatever the function does that a replay would not reproduce makes
 *     the trace untraceable, with the first reason kept: reading a value
 *     it computed (or an input's or a parameter's), an in-place op, set_,
 *     a hook, a nested backward, random numbers other than dropout's,
 *     reseeding (even to the seed it had), a tensor made from caller
 *     memory, a value read of any tensor (a constant's too: the program
 *     would keep the value the trace read), a tensor from outside the
 *     function that carries autograd history (its graph belongs to one
 *     backward), labels of a cross-entropy the function computed (the
 *     program checks labels it can read before it starts). The compiled
 *     step then runs eagerly with that reason.
 *   - rng0/rng1: the generator's counter when the function started and
 *     ended, seed its seed: the dropout masks drawn meanwhile, in order.
 */
#include "ag.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local gj_ag_trace *g_trace; /* recording on this thread, or NULL */

gj_ag_trace *gj_ag_trace_active(void) { return g_trace; }

static int slot_add(gj_ag_trace *tr, gj_tensor *t, gj_ag_slot_kind kind, int index, int out) {
    if (tr->n_slots == tr->cap_slots) {
        int nc = tr->cap_slots ? tr->cap_slots * 2 : 64;
        gj_ag_trace_slot *s = gj_rt_realloc(tr->slots, (size_t)nc * sizeof *s);
        if (!s) return -1;
        tr->slots = s;
        tr->cap_slots = nc;
    }
    gj_ag_trace_slot *s = &tr->slots[tr->n_slots];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->index = index;
    s->out = out;
    s->alias_of = -1;
    s->t = t;
    gj_rt_tensor_retain(t);
    gj_rt_meta_of(t, &s->meta);
    return tr->n_slots++;
}

int gj_ag_trace_slot_of(const gj_ag_trace *tr, const gj_tensor *t) {
    for (int s = tr->n_slots - 1; s >= 0; s--)
        if (tr->slots[s].t == t) return s;
    return -1;
}

void gj_ag_trace_untraceable(const char *fmt, ...) {
    gj_ag_trace *tr = g_trace;
    if (!tr || tr->untraceable[0]) return; /* the first reason is kept */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tr->untraceable, sizeof tr->untraceable, fmt, ap);
    va_end(ap);
}

gj_ag_trace *gj_ag_trace_begin(int n_in, gj_tensor *const *in, int n_params,
                               gj_tensor *const *params) {
    if (g_trace) {
        gj_rt_set_error("gj_step_run: a step is already being traced on this thread (a step "
                        "function may not run another step)");
        return NULL;
    }
    gj_ag_trace *tr = gj_rt_calloc(1, sizeof *tr);
    if (!tr) return NULL;
    tr->n_inputs = n_in;
    tr->n_params = n_params;
    for (int k = 0; k < n_in; k++)
        if (slot_add(tr, in[k], GJ_AG_SLOT_INPUT, k, 0) < 0) goto fail;
    for (int p = 0; p < n_params; p++)
        if (slot_add(tr, params[p], GJ_AG_SLOT_PARAM, p, 0) < 0) goto fail;
    tr->seed = gj_rt_rng_seed();
    tr->rng0 = tr->rng1 = gj_rt_rng_reserve(0);
    tr->reseeds = gj_rt_rng_reseeds();
    g_trace = tr;
    return tr;
fail:
    gj_ag_trace_free(tr);
    return NULL;
}

void gj_ag_trace_end(gj_ag_trace *tr) {
    if (g_trace != tr) return;
    g_trace = NULL;
    tr->rng1 = gj_rt_rng_reserve(0);
    if (gj_rt_rng_seed() != tr->seed || gj_rt_rng_reseeds() != tr->reseeds)
        gj_ag_trace_untraceable_in(tr, "the step function reseeded the generator "
                                       "(gj_manual_seed or gj_rng_set_state), which a compiled "
                                       "step cannot replay");
}

void gj_ag_trace_untraceable_in(gj_ag_trace *tr, const char *why) {
    if (!tr->untraceable[0]) snprintf(tr->untraceable, sizeof tr->untraceable, "%s", why);
}

void gj_ag_trace_free(gj_ag_trace *tr) {
    if (!tr) return;
    if (g_trace == tr) g_trace = NULL;
    for (int s = 0; s < tr->n_slots; s++) gj_rt_tensor_release(tr->slots[s].t);
    for (int j = 0; j < tr->n_entries; j++)
        if (tr->entries[j].node) gj_ag_node_release(tr->entries[j].node);
    gj_rt_free(tr->slots);
    gj_rt_free(tr->entries);
    gj_rt_free(tr);
}

/* The slot of tensor t, adding it as a constant when the trace has not
 * seen it. -1 on OOM. */
static int slot_or_const(gj_ag_trace *tr, gj_tensor *t) {
    int s = gj_ag_trace_slot_of(tr, t);
    if (s >= 0) return s;
    int c = 0;
    for (int k = 0; k < tr->n_slots; k++) c += tr->slots[k].kind == GJ_AG_SLOT_CONST;
    return slot_add(tr, t, GJ_AG_SLOT_CONST, c, 0);
}

int gj_ag_trace_value_source(const gj_ag_trace *tr, int s) {
    while (s >= 0) {
        const gj_ag_trace_slot *sl = &tr->slots[s];
        if (sl->kind == GJ_AG_SLOT_INPUT || sl->kind == GJ_AG_SLOT_CONST) return s;
        if (sl->kind == GJ_AG_SLOT_ALIAS) {
            s = sl->alias_of;
            continue;
        }
        if (sl->kind != GJ_AG_SLOT_OUTPUT) return -1;
        const gj_ag_trace_entry *e = &tr->entries[sl->index];
        if (e->op != &gj_ag_op_reshape && e->op != &gj_ag_op_permute && e->op != &gj_ag_op_copy)
            return -1; /* (every element once, none made up) */
        s = e->in[0];
    }
    return -1;
}

/* A tensor from outside the function (a step input or a constant) that has
 * autograd history: the eager step's backward runs into that history (and
 * fails the second time it is freed); a replay would not. */
static void note_history(gj_ag_trace *tr, int s) {
    const gj_ag_trace_slot *sl = &tr->slots[s];
    if (sl->kind != GJ_AG_SLOT_INPUT && sl->kind != GJ_AG_SLOT_CONST) return;
    gj_ag_tensor_meta *m = sl->t->ag;
    if (!m || !m->node) return;
    gj_ag_trace_untraceable_in(tr, sl->kind == GJ_AG_SLOT_INPUT
                                       ? "a step input has autograd history (it was computed "
                                         "from tensors that require grad): the eager backward "
                                         "runs into that history, a compiled step cannot; "
                                         "detach it"
                                       : "the step function used a tensor made outside it from "
                                         "tensors that require grad (a view or result of an op "
                                         "on a parameter): its graph belongs to one backward; "
                                         "make it inside the step function");
}

void gj_ag_trace_note_op(const gj_ag_opdef *op, const gj_ag_attrs *a, int n_in,
                         gj_tensor *const *in, int n_out, gj_tensor *const *outs,
                         gj_ag_node *node, int tape_pos) {
    gj_ag_trace *tr = g_trace;
    if (!tr || tr->failed) return;
    if (tr->n_entries == tr->cap_entries) {
        int nc = tr->cap_entries ? tr->cap_entries * 2 : 64;
        gj_ag_trace_entry *e = gj_rt_realloc(tr->entries, (size_t)nc * sizeof *e);
        if (!e) {
            tr->failed = true;
            return;
        }
        tr->entries = e;
        tr->cap_entries = nc;
    }
    gj_ag_trace_entry *e = &tr->entries[tr->n_entries];
    memset(e, 0, sizeof *e);
    e->op = op;
    if (a) e->attrs = *a;
    e->n_in = n_in;
    e->n_out = n_out;
    for (int i = 0; i < n_in; i++) {
        e->in[i] = slot_or_const(tr, in[i]);
        if (e->in[i] < 0) {
            tr->failed = true;
            return;
        }
        note_history(tr, e->in[i]);
    }
    if (op == &gj_ag_op_cross_entropy && gj_ag_trace_value_source(tr, e->in[1]) < 0)
        gj_ag_trace_untraceable_in(tr, "the step function computed the labels of "
                                       "gj_cross_entropy: a compiled step checks labels it reads "
                                       "from a step input or a tensor from outside (pass them "
                                       "as an input)");
    for (int k = 0; k < n_out; k++) {
        e->out[k] = slot_add(tr, outs[k], GJ_AG_SLOT_OUTPUT, tr->n_entries, k);
        if (e->out[k] < 0) {
            tr->failed = true;
            return;
        }
    }
    if (node) gj_ag_node_retain(node);
    e->node = node;
    e->in_region = tape_pos >= 0;
    e->tape_pos = tape_pos;
    if (op == &gj_ag_op_checkpoint && node) /* the region's ops, just before it, are its tape */
        for (int j = tr->n_entries - 1; j >= 0 && tr->entries[j].in_region && !tr->entries[j].ckpt;
             j--)
            tr->entries[j].ckpt = node;
    tr->n_entries++;
}

void gj_ag_trace_note_alias(gj_tensor *src, gj_tensor *alias) {
    gj_ag_trace *tr = g_trace;
    if (!tr || tr->failed) return;
    int s = slot_or_const(tr, src);
    int a = s >= 0 ? slot_add(tr, alias, GJ_AG_SLOT_ALIAS, 0, 0) : -1;
    if (a < 0) {
        tr->failed = true;
        return;
    }
    tr->slots[a].alias_of = s;
}

void gj_ag_trace_note_created(gj_tensor *t, bool deterministic, const char *what) {
    gj_ag_trace *tr = g_trace;
    if (!tr || tr->failed) return;
    if (!deterministic) {
        gj_ag_trace_untraceable("the step function made a tensor with %s (random numbers or "
                                "memory of the caller, different at each call): make it outside "
                                "and pass it as an input",
                                what);
        return;
    }
    int s = slot_or_const(tr, t);
    if (s < 0) tr->failed = true;
    else tr->slots[s].created = true;
}

void gj_ag_trace_note_read(const gj_tensor *t, const char *what, bool writable) {
    gj_ag_trace *tr = g_trace;
    if (!tr || tr->untraceable[0]) return;
    int s = gj_ag_trace_slot_of(tr, t);
    while (s >= 0 && tr->slots[s].kind == GJ_AG_SLOT_ALIAS) s = tr->slots[s].alias_of;
    if (s >= 0 && tr->slots[s].kind == GJ_AG_SLOT_CONST && tr->slots[s].created && writable) {
        gj_ag_trace_untraceable("the step function wrote (%s) into a tensor it made: a compiled "
                                "step keeps what it held when traced",
                                what);
        return;
    }
    static const char *const kinds[] = {"an input", "a parameter", "a tensor from outside it",
                                        "a value it computed", ""};
    if (s < 0) { /* a tensor the trace has not seen: from outside (ctx, a global) */
        gj_ag_trace_untraceable("the step function read a tensor from outside it (%s): a "
                                "compiled step does not run the function again, so it cannot "
                                "depend on values",
                                what);
        return;
    }
    gj_ag_trace_untraceable("the step function read %s (%s): a compiled step does not run the "
                            "function again, so it cannot depend on values",
                            kinds[tr->slots[s].kind], what);
}
