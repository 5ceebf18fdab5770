/* SPDX-License-Identifier: MIT */
/*
 * backward.c - gj_jit_backward and gj_jit_grad: a backward's key (its walk,
 * key.c) -> its program (cache.c) -> a run on this backward's tensors
 * (grads.c, with user code through calls.c), or a fallback to the eager
 * engine (fallback.c).
 *
 * Invariants:
 *   - A fallback (handled = false) has changed nothing: no .grad written,
 *     no graph freed. It is counted and its reason kept; the caller runs
 *     the eager engine, which gives the reference gradients (or the error).
 *   - Every backward counts exactly once (base.h): as the way its
 *     program was found when it ran, or as a fallback.
 *   - A graph eager would refuse (freed graph, modified saved tensor) is
 *     not a fallback: the eager engine reports the error; nothing counts.
 *   - .grads are read and written by the run: it holds the leaf-lock
 *     stripes of every leaf it writes (all or none, never blocking); when
 *     another thread's backward holds one, this backward runs eagerly
 *     (GJ_CA_LOCK_CONTENTION), which waits for them.
 *   - A guard that trips (guards.c) makes the key eager-only, unless user
 *     code failed this time with no earlier cause in the run: then only
 *     this backward falls back.
 */
#include "jit/jit.h"

#include "jit/cache/cache.h"
#include "jit/run/run_int.h"

#include <stdio.h>
#include <string.h>

/* The capture of a backward that the cache asks for (gj_jit_source). */
typedef struct bwd_src {
    const gj_jit_walk *w;
    int n_roots;
    gj_tensor *const *roots, *const *seeds;
    gj_jit_capture *cap;
    bool captured; /* cap holds a capture to free */
} bwd_src;

static gj_jit_graph *bwd_capture(void *ctx, char *why, size_t why_cap, gj_ca_reason *code,
                                 bool *permanent) {
    bwd_src *s = ctx;
    s->captured = true;
    if (gj_jit_capture_run(s->cap, s->w, s->n_roots, s->roots, s->seeds) == 0) return &s->cap->g;
    snprintf(why, why_cap, "%s", s->cap->reason);
    *code = s->cap->code;
    *permanent = s->cap->permanent;
    return NULL;
}

/* A gj_grad's program: which output answers which requested input. */
static int bwd_finish(void *ctx, gj_jit_program *prog) {
    bwd_src *s = ctx;
    if (!s->w->grad_mode) return 0;
    prog->ret = gj_rt_malloc(((size_t)s->w->n_req + 1) * sizeof *prog->ret);
    if (!prog->ret) return -1;
    memcpy(prog->ret, s->cap->ret, (size_t)s->w->n_req * sizeof *prog->ret);
    prog->n_ret = s->w->n_req;
    return 0;
}

/* One run_compiled, carried from stage to stage: the call's arguments, the
 * walk and its capture (src.captured: cap holds one to free), the program
 * found (got, a reference), the run's input tensors (borrowed) and a
 * gj_grad's outputs, the leaf-lock stripes held, a fallback's reason and
 * the timings. br_free releases what it holds. Each stage returns BR_ON
 * (the next stage runs), BR_FALL (a fallback with code and why: counted,
 * nothing written) or BR_OUT (done: rc and *handled set). */
typedef struct bwd_run {
    int n_roots;
    gj_tensor *const *roots, *const *seeds;
    const gj_jit_grad_req *gr;
    bool retain_graph;
    bool *handled;
    gj_jit_walk w;
    gj_jit_capture cap;
    bwd_src src;
    gj_jit_key key;
    gj_jit_got got;
    gj_tensor **tensors;
    gj_tensor **outs;  /* gj_grad: the program's outputs */
    uint64_t stripes;  /* leaf-lock stripes held during the run */
    char why[400];
    gj_ca_reason code;
    int rc;
    unsigned fl;
    bool timed;
    double tp0, tp1, tp2;
} bwd_run;

enum { BR_ON, BR_FALL, BR_OUT };

/* The key's program from the cache: found (got.prog), or a fallback the
 * cache reported already (FELL), or one to report (FALL). */
static int br_program(bwd_run *b) {
    b->key = gj_jit_walk_key(&b->w);
    gj_jit_source source = {bwd_capture, bwd_finish, &b->src, GJ_JIT_PATH_BACKWARD, false};
    int g = gj_jit_get_program(&b->key, &source, &b->got);
    if (g < 0) { /* the processes run different programs: an error */
        b->rc = -1;
        *b->handled = true;
        return BR_OUT;
    }
    if (g == GJ_JIT_FELL) return BR_OUT;
    if (g == GJ_JIT_FALL) {
        snprintf(b->why, sizeof b->why, "%s", b->got.why);
        b->code = b->got.code;
        return BR_FALL;
    }
    return BR_ON;
}

/* .grads are read (as inputs, and when accumulating in place) and
 * written by the run: hold the stripes of every leaf it writes from
 * here to the end, or leave the backward to the eager engine, which
 * waits for them (docs/fallbacks.md) */
static int br_lock(bwd_run *b) {
    gj_jit_program *prog = b->got.prog;
    for (int o = 0; o < prog->n_outputs; o++)
        if (prog->outputs[o].acc_node >= 0) /* none for gj_grad: it writes no .grad */
            b->stripes |= 1ull << gj_ag_leaf_stripe(b->w.nodes[prog->outputs[o].acc_node]->leaf);
    if (!gj_ag_leaf_trylock_stripes(b->stripes)) {
        b->stripes = 0;
        b->code = GJ_CA_LOCK_CONTENTION;
        snprintf(b->why, sizeof b->why,
                 "another thread's backward is writing a .grad of this backward "
                 "(a leaf shared between threads, or two leaves in one of the "
                 "64 lock stripes)");
        return BR_FALL;
    }
    return BR_ON;
}

/* The run's input tensors: the capture's, else from the walk, else from a
 * capture made now. */
static int br_tensors(bwd_run *b) {
    gj_jit_program *prog = b->got.prog;
    b->tensors = gj_rt_calloc((size_t)prog->n_inputs + 1, sizeof *b->tensors);
    if (b->gr) b->outs = gj_rt_calloc((size_t)prog->n_outputs + 1, sizeof *b->outs);
    if (!b->tensors || (b->gr && !b->outs)) {
        snprintf(b->why, sizeof b->why, "out of memory");
        return BR_FALL;
    }
    if (b->src.captured) {
        memcpy(b->tensors, b->cap.tensors, (size_t)prog->n_inputs * sizeof *b->tensors);
    } else if (prog->recapture || !gj_jit_inputs_from_walk(prog, &b->w, b->seeds, b->tensors)) {
        b->src.captured = true;
        if (gj_jit_capture_run(&b->cap, &b->w, b->n_roots, b->roots, b->seeds) != 0 ||
            b->cap.g.n_inputs != prog->n_inputs) {
            snprintf(b->why, sizeof b->why, "re-capture failed: %s", b->cap.reason);
            b->code = b->cap.code;
            return BR_FALL;
        }
        memcpy(b->tensors, b->cap.tensors, (size_t)prog->n_inputs * sizeof *b->tensors);
    }
    return BR_ON;
}

/* The run (the stripes dropped after it), what a tripped guard decides,
 * the count, a gj_grad's outputs handed out, the graph released, the
 * timings logged. */
static int br_run(bwd_run *b) {
    gj_jit_program *prog = b->got.prog;
    double t1 = gj_jit_now_ms();
    b->tp1 = t1;
    gj_jit_runctx hc;
    memset(&hc, 0, sizeof hc);
    int r = gj_jit_run_program(prog, &b->w, b->tensors, b->why, sizeof b->why, &hc, b->outs);
    gj_ag_leaf_unlock_stripes(b->stripes); /* before the cache lock: leaf locks are taken under it */
    b->stripes = 0;
    b->tp2 = gj_jit_now_ms();
    if (r == 1) return BR_FALL;
    if (r == 2 || (r == 0 && hc.tripped)) {
        /* a guard: eager-only from now on, unless user code failed this
         * time (an allocation in a hook): the next clean instruction runs compiled.
         * It counts as a fallback also when a post hook tripped after the
         * run finished (the .grads not yet written got the eager
         * accumulate's result) */
        bool first = !hc.transient && gj_jit_demote(&b->key, hc.code, hc.why);
        gj_jit_fallback(GJ_JIT_PATH_BACKWARD, hc.code, hc.why, first);
        if (r == 2) return BR_OUT; /* nothing written: the eager engine runs this backward */
    } else {
        gj_jit_count_run(GJ_JIT_PATH_BACKWARD, b->got.made, gj_jit_now_ms() - t1); /* it ran (r == -1: and failed) */
    }
    if (r == 0) gj_jit_note_last_program(prog);
    int rc = r == 0 ? 0 : -1;
    b->rc = rc;
    *b->handled = true;
    if (rc == 0 && b->gr) gj_jit_hand_out(prog, b->gr, b->outs);
    if (rc == 0 && !b->retain_graph) gj_jit_release_graph(&b->w, b->n_roots, b->roots);
    if (b->timed && rc == 0) {
        double tend = gj_jit_now_ms();
        if (b->fl & GJ_JIT_LOG_INSTRS)
            fprintf(stderr,
                    "[gradjit instrs] backward %.3f ms: key and lookup %.3f, program %.3f (steps "
                    "and buffers), graph release %.3f\n",
                    tend - b->tp0, b->tp1 - b->tp0, b->tp2 - b->tp1, tend - b->tp2);
        gj_jit_prof_backward(b->got.fresh, tend - b->tp0, b->tp1 - b->tp0, b->tp2 - b->tp1,
                             tend - b->tp2);
    }
    return BR_OUT;
}

/* Releases what b holds: the stripes, the program's reference, the
 * tables, the capture, the walk. */
static void br_free(bwd_run *b) {
    gj_ag_leaf_unlock_stripes(b->stripes);
    gj_jit_program_release(b->got.prog);
    gj_rt_free(b->tensors);
    gj_rt_free(b->outs);
    if (b->src.captured) gj_jit_capture_free(&b->cap);
    gj_jit_walk_free(&b->w);
}

/* gj_jit_backward and gj_jit_grad (gr non-NULL). */
static int run_compiled(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                        const gj_jit_grad_req *gr, bool retain_graph, bool *handled) {
    *handled = false;
    bwd_run b;
    memset(&b, 0, sizeof b);
    b.n_roots = n_roots;
    b.roots = roots;
    b.seeds = seeds;
    b.gr = gr;
    b.retain_graph = retain_graph;
    b.handled = handled;
    b.src = (bwd_src){&b.w, n_roots, roots, seeds, &b.cap, false};
    b.code = GJ_CA_OTHER;
    b.fl = gj_jit_log_flags();
    b.timed = (b.fl & (GJ_JIT_LOG_PROF | GJ_JIT_LOG_INSTRS)) != 0;
    b.tp0 = b.timed ? gj_jit_now_ms() : 0;
    if (gj_jit_walk_build_grad(&b.w, n_roots, roots, seeds, gr ? gr->n_inputs : 0,
                               gr ? gr->inputs : NULL) != 0) {
        gj_jit_walk_free(&b.w);
        gj_jit_fallback(GJ_JIT_PATH_BACKWARD, GJ_CA_OTHER, "out of memory while computing the key", false);
        return 0;
    }
    /* An invalid walk is not a fallback: the backward is an error (graph
     * freed, saved tensor modified, root without grad), which the eager
     * engine reports with its usual message. Nothing is counted. */
    int st = b.w.invalid ? BR_OUT : br_program(&b);
    if (st == BR_ON) st = br_lock(&b);
    if (st == BR_ON) st = br_tensors(&b);
    if (st == BR_ON) st = br_run(&b);
    if (st == BR_FALL) gj_jit_fallback(GJ_JIT_PATH_BACKWARD, b.code, b.why, false);
    br_free(&b);
    return b.rc;
}

int gj_jit_backward(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                    bool retain_graph, bool *handled) {
    return run_compiled(n_roots, roots, seeds, NULL, retain_graph, handled);
}

int gj_jit_grad(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds, int n_inputs,
                gj_tensor *const *inputs, gj_tensor **grads_out, bool retain_graph,
                bool *handled) {
    for (int i = 0; i < n_inputs; i++) grads_out[i] = NULL;
    gj_jit_grad_req gr = {n_inputs, inputs, grads_out};
    return run_compiled(n_roots, roots, seeds, &gr, retain_graph, handled);
}
