/* SPDX-License-Identifier: MIT */
/*
 * backward.c - gj_jit_backward and gj_jit_grad: a backward's key (its walk,
 * key.c) -> its program (cache.c) -> a run on this backward's tensors
 * (run.c, guards.c), or a fallback to the eager engine (fallback.c).
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

/* gj_jit_backward and gj_jit_grad (gr non-NULL). */
static int run_compiled(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                        const gj_jit_grad_req *gr, bool retain_graph, bool *handled) {
    *handled = false;
    gj_jit_walk w;
    gj_jit_capture cap;
    memset(&cap, 0, sizeof cap);
    bwd_src src = {&w, n_roots, roots, seeds, &cap, false};
    gj_jit_got got = {0};
    gj_tensor **tensors = NULL;
    uint64_t stripes = 0; /* leaf-lock stripes held during the run */
    char why[400] = "";
    gj_ca_reason code = GJ_CA_OTHER;
    int rc = 0;
    unsigned fl = gj_jit_log_flags();
    bool timed = (fl & (GJ_JIT_LOG_PROF | GJ_JIT_LOG_INSTRS)) != 0;
    double tp0 = timed ? gj_jit_now_ms() : 0, tp1 = 0, tp2 = 0;
    gj_tensor **outs = NULL; /* gj_grad: the program's outputs */
    if (gj_jit_walk_build_grad(&w, n_roots, roots, seeds, gr ? gr->n_inputs : 0,
                               gr ? gr->inputs : NULL) != 0) {
        gj_jit_walk_free(&w);
        gj_jit_fallback(GJ_JIT_PATH_BACKWARD, GJ_CA_OTHER, "out of memory while computing the key", false);
        return 0;
    }
    if (w.invalid) {
        /* Not a fallback: the backward is an error (graph freed, saved
         * tensor modified, root without grad), which the eager engine
         * reports with its usual message. Nothing is counted. */
        goto out;
    }
    gj_jit_key key = gj_jit_walk_key(&w);
    gj_jit_source source = {bwd_capture, bwd_finish, &src, GJ_JIT_PATH_BACKWARD};
    int g = gj_jit_get_program(&key, &source, &got);
    if (g < 0) { /* the processes run different programs: an error */
        rc = -1;
        *handled = true;
        goto out;
    }
    if (g == GJ_JIT_FELL) goto out;
    if (g == GJ_JIT_FALL) {
        snprintf(why, sizeof why, "%s", got.why);
        code = got.code;
        goto fall;
    }
    gj_jit_program *prog = got.prog;

    /* .grads are read (as inputs, and when accumulating in place) and
     * written by the run: hold the stripes of every leaf it writes from
     * here to the end, or leave the backward to the eager engine, which
     * waits for them (docs/fallbacks.md) */
    for (int o = 0; o < prog->n_outputs; o++)
        if (prog->outputs[o].acc_node >= 0) /* none for gj_grad: it writes no .grad */
            stripes |= 1ull << gj_ag_leaf_stripe(w.nodes[prog->outputs[o].acc_node]->leaf);
    if (!gj_ag_leaf_trylock_stripes(stripes)) {
        stripes = 0;
        code = GJ_CA_LOCK_CONTENTION;
        snprintf(why, sizeof why, "another thread's backward is writing a .grad of this backward "
                                  "(a leaf shared between threads, or two leaves in one of the "
                                  "64 lock stripes)");
        goto fall;
    }
    /* the run's input tensors */
    tensors = gj_rt_calloc((size_t)prog->n_inputs + 1, sizeof *tensors);
    if (gr) outs = gj_rt_calloc((size_t)prog->n_outputs + 1, sizeof *outs);
    if (!tensors || (gr && !outs)) {
        snprintf(why, sizeof why, "out of memory");
        goto fall;
    }
    if (src.captured) {
        memcpy(tensors, cap.tensors, (size_t)prog->n_inputs * sizeof *tensors);
    } else if (prog->recapture || !gj_jit_inputs_from_walk(prog, &w, seeds, tensors)) {
        src.captured = true;
        if (gj_jit_capture_run(&cap, &w, n_roots, roots, seeds) != 0 ||
            cap.g.n_inputs != prog->n_inputs) {
            snprintf(why, sizeof why, "re-capture failed: %s", cap.reason);
            code = cap.code;
            goto fall;
        }
        memcpy(tensors, cap.tensors, (size_t)prog->n_inputs * sizeof *tensors);
    }
    double t1 = gj_jit_now_ms();
    tp1 = t1;
    gj_jit_runctx hc;
    memset(&hc, 0, sizeof hc);
    int r = gj_jit_run_program(prog, &w, tensors, why, sizeof why, &hc, outs);
    gj_ag_leaf_unlock_stripes(stripes); /* before the cache lock: leaf locks are taken under it */
    stripes = 0;
    tp2 = gj_jit_now_ms();
    if (r == 1) goto fall;
    if (r == 2 || (r == 0 && hc.tripped)) {
        /* a guard: eager-only from now on, unless user code failed this
         * time (an allocation in a hook): the next clean instruction runs compiled.
         * It counts as a fallback also when a post hook tripped after the
         * run finished (the .grads not yet written got the eager
         * accumulate's result) */
        bool first = !hc.transient && gj_jit_demote(&key, hc.code, hc.why);
        gj_jit_fallback(GJ_JIT_PATH_BACKWARD, hc.code, hc.why, first);
        if (r == 2) goto out; /* nothing written: the eager engine runs this backward */
    } else {
        gj_jit_count_run(GJ_JIT_PATH_BACKWARD, got.made, gj_jit_now_ms() - t1); /* it ran (r == -1: and failed) */
    }
    if (r == 0) gj_jit_note_last_program(prog);
    rc = r == 0 ? 0 : -1;
    *handled = true;
    if (rc == 0 && gr) gj_jit_hand_out(prog, gr, outs);
    if (rc == 0 && !retain_graph) gj_jit_release_graph(&w, n_roots, roots);
    if (timed && rc == 0) {
        double tend = gj_jit_now_ms();
        if (fl & GJ_JIT_LOG_INSTRS)
            fprintf(stderr,
                    "[gradjit instrs] backward %.3f ms: key and lookup %.3f, program %.3f (steps "
                    "and buffers), graph release %.3f\n",
                    tend - tp0, tp1 - tp0, tp2 - tp1, tend - tp2);
        gj_jit_prof_backward(got.fresh, tend - tp0, tp1 - tp0, tp2 - tp1, tend - tp2);
    }
    goto out;
fall:
    gj_jit_fallback(GJ_JIT_PATH_BACKWARD, code, why, false);
out:
    gj_ag_leaf_unlock_stripes(stripes);
    gj_jit_program_release(got.prog);
    gj_rt_free(tensors);
    gj_rt_free(outs);
    if (src.captured) gj_jit_capture_free(&cap);
    gj_jit_walk_free(&w);
    return rc;
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
