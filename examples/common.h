/* SPDX-License-Identifier: MIT */
/*
 * common.h - small helpers the example trainers share (header-only, all
 * static inline: a trainer that does not use one pays nothing): a
 * monotonic clock, a qsort comparator and quartiles, the seeded shuffle's
 * generator, checkpoint metadata as exact decimals, the progress bar, the
 * Ctrl-C flag, and the training step in its four modes (stepper: eager,
 * compiled step, and forward / backward / update apart, with or without
 * compiled autograd) with their counters. Not part of the library.
 */
#ifndef GJ_EXAMPLES_COMMON_H
#define GJ_EXAMPLES_COMMON_H

#include "gradjit.h"

#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* Set by the SIGINT handler: the trainer finishes its step, saves (--save)
 * and exits 130. */
static volatile sig_atomic_t g_interrupted;

static inline void on_sigint(int sig) {
    (void)sig;
    g_interrupted = 1;
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v[0..n) (n >= 1) and gives its quartiles: q[0] lower, q[1] the
 * median, q[2] upper (the paired ratios' median [interquartile range]). */
static inline void quartiles(double *v, int64_t n, double q[3]) {
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    q[0] = v[n / 4];
    q[1] = v[n / 2];
    q[2] = v[(3 * n) / 4];
}

#define BAR_W 24 /* characters of the progress bar */

/* bar (BAR_W + 1 chars) filled in proportion to step i (0-based) of n. */
static inline void progress_bar(char *bar, int64_t i, int64_t n) {
    int fill = (int)((i + 1) * BAR_W / n);
    for (int k = 0; k < BAR_W; k++)
        bar[k] = k < fill ? '#' : '.';
    bar[BAR_W] = 0;
}

/* Whether step i of n gets a progress line: every `every` steps on a
 * terminal (and the last); otherwise (a log file) at every tenth of n. */
static inline bool progress_due(bool quiet, bool tty, int every, int64_t i, int64_t n) {
    if (quiet)
        return false;
    if (tty)
        return i % every == every - 1 || i + 1 == n;
    int64_t tenth = n / 10 > 0 ? n / 10 : 1;
    return (i + 1) % tenth == 0 && i + 1 != n;
}

static inline uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Checkpoint metadata: integers and doubles as decimals that read back
 * exactly (%.17g round-trips a double). 0 or -1 (error set). */
static inline int meta_i64(gj_state_dict *sd, const char *key, int64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRId64, v);
    return gj_state_dict_set_metadata(sd, key, buf);
}

static inline int meta_f64(gj_state_dict *sd, const char *key, double v) {
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", v);
    return gj_state_dict_set_metadata(sd, key, buf);
}

/* Moving average of v[0..n) over w steps (fewer at the start) into out. */
static inline void smooth(const double *v, int64_t n, int w, double *out) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += v[i];
        if (i >= w) acc -= v[i - w];
        out[i] = acc / (double)(i < w ? i + 1 : w);
    }
}

/* The counters line of a compiled path, "[tag] <path>: N <unit>s, N
 * compiles (ms), ... N fallbacks", and a warning when no <unit> went
 * through the compiled path. */
static inline void print_counts(const char *tag, const char *path, const char *unit,
                                const gj_ca_stats *c) {
    printf("[%s] %s: %lld %ss, %lld compiles (%.1f ms), %lld memory hits, %lld disk hits, "
           "%lld bound to symbolic kernels, %lld fallbacks\n",
           tag, path, (long long)c->backwards, unit, (long long)c->compiles, c->compile_ms,
           (long long)c->mem_hits, (long long)c->disk_hits, (long long)c->instantiations,
           (long long)c->fallbacks);
    if (c->backwards == 0)
        printf("[%s] WARNING: no %s went through the compiled path\n", tag, unit);
}

/* The compiled-autograd counters of a run, and a warning when nothing ran
 * compiled or something fell back. */
static inline void print_ca(const char *tag, const gj_ca_stats *c) {
    print_counts(tag, "compiled autograd", "backward", c);
    if (c->fallbacks > 0)
        printf("[%s] WARNING: %lld backwards fell back to the eager engine (%s)\n", tag,
               (long long)c->fallbacks, gj_compiled_autograd_last_fallback());
}

/* The compiled step's counters of a run (gj_step_stats), and a warning
 * when no step ran compiled or some ran eagerly (with how many for each
 * reason, and the last reason's message). */
static inline void print_step(const char *tag, const gj_ca_stats *c) {
    print_counts(tag, "compiled step", "step", c);
    if (c->fallbacks > 0) {
        printf("[%s] WARNING: %lld steps ran eagerly (", tag, (long long)c->fallbacks);
        const char *sep = "";
        for (int r = 0; r < GJ_CA_N_REASONS; r++)
            if (c->fallbacks_by_reason[r]) {
                printf("%s%s: %lld", sep, gj_ca_reason_name((gj_ca_reason)r),
                       (long long)c->fallbacks_by_reason[r]);
                sep = ", ";
            }
        printf("): %s\n", gj_compiled_autograd_last_fallback());
    }
}

/* Compares two runs' loss curves a[0..n), b[0..n) step by step and prints
 * one line: "identical" when every loss is the same double, else the
 * first step that differs and the largest relative difference. what names
 * the pair ("eager vs compiled step"). Returns whether they are identical. */
static inline bool print_curves(const char *what, const double *a, const double *b, int64_t n) {
    int64_t first = -1;
    double maxrel = 0.0;
    for (int64_t s = 0; s < n; s++) {
        if (a[s] == b[s] || (isnan(a[s]) && isnan(b[s])))
            continue;
        if (first < 0) first = s;
        double rel = fabs(b[s] - a[s]) / fmax(fabs(a[s]), 1e-30);
        if (!(rel <= maxrel)) maxrel = rel;
    }
    if (first < 0) {
        printf("loss curves (%s, %lld steps): identical\n", what, (long long)n);
        return true;
    }
    printf("loss curves (%s, %lld steps): DIFFER from step %lld on (%.9g, %.9g); max relative "
           "difference %.3e\n",
           what, (long long)n, (long long)first, a[first], b[first], maxrel);
    return false;
}

/* ------------------------------------------------------ the training step */

/* How a trainer runs a training step. Its forward is one step function
 * (gj_step_fn: the model in ctx, the batch's tensors as the inputs), run
 * in one of four ways that give the same bits:
 *   STEP_EAGER     gj_step with opts.eager: zero_grad, fn, gj_backward,
 *                  gj_optim_step, zero_grad (the trainers' default)
 *   STEP_COMPILED  gj_step (--compiled-step): after its first (traced) run,
 *                  forward, backward and update run as one compiled program
 *   STEP_SPLIT     fn, gj_backward, gj_optim_step, zero_grad as separate
 *                  calls with compiled autograd off, so forward and backward
 *                  are timed apart (the eager side of --both with compiled
 *                  autograd) and a hook can run between backward and update
 *                  (a split --ddp's gj_ddp_wait)
 *   STEP_SPLIT_CA  the same with compiled autograd on (--compiled-autograd;
 *                  gj_step cannot serve it: it replaces the backward)
 * gj_step's modes time the whole step only. */
typedef enum step_mode { STEP_EAGER, STEP_COMPILED, STEP_SPLIT, STEP_SPLIT_CA } step_mode;

static inline bool step_mode_split(step_mode m) { return m == STEP_SPLIT || m == STEP_SPLIT_CA; }

typedef struct stepper {
    step_mode mode;
    gj_step_fn fn;
    void *ctx;                  /* fn's, borrowed */
    gj_optim *opt;              /* borrowed */
    gj_step *step;              /* STEP_EAGER, STEP_COMPILED: owned */
    int (*between)(void *user); /* split modes: after backward, before the update; 0 or -1
                                   with gj_last_error() set (NULL: none) */
    void *between_user;
    int (*after)(void *user);   /* split modes: after the update (ZeRO's gather) */
    void *after_user;
} stepper;

/* What one step took, ms: the whole step (fn, backward, update, zero_grad);
 * in the split modes also fn alone and the backward (with `between`);
 * NaN where not measured. w: what it paid beyond running, the difference
 * of gj_warmup_stats around it (print_warmup prints it). */
typedef struct step_times {
    double fwd_ms, bwd_ms, step_ms;
    gj_warmup_stats w;
} step_times;

/* The difference b - a of two gj_warmup_stats (page_kib: b's). */
static inline gj_warmup_stats warmup_diff(const gj_warmup_stats *a, const gj_warmup_stats *b) {
    gj_warmup_stats d = *b;
    d.compile_ms -= a->compile_ms;
    d.gemm_choice_ms -= a->gemm_choice_ms;
    d.gemm_measured -= a->gemm_measured;
    d.new_bytes -= a->new_bytes;
    d.huge_bytes -= a->huge_bytes;
    d.zeroed_bytes -= a->zeroed_bytes;
    d.zero_skipped_bytes -= a->zero_skipped_bytes;
    return d;
}

/* One of the first steps: "<tag> step N paid: compile C ms, GEMM choices
 * G ms (k shapes measured), running R ms; new memory M MiB in 2 MiB pages":
 * the step's ms split into making compiled programs, choosing GEMM
 * providers and the rest (running, first touches of new memory included). */
static inline void print_warmup(const char *tag, int64_t step, double ms, const gj_warmup_stats *w) {
    double run = ms - w->compile_ms - w->gemm_choice_ms;
    printf("%s%sstep %lld paid %.0f ms: compile %.0f ms, GEMM choices %.0f ms (%lld shape%s "
           "measured), running %.0f ms; new memory %.0f MiB in %s pages\n",
           tag ? tag : "", tag ? " " : "", (long long)step, ms, w->compile_ms, w->gemm_choice_ms,
           (long long)w->gemm_measured, w->gemm_measured == 1 ? "" : "s", run > 0 ? run : 0.0,
           (double)w->new_bytes / 1048576.0, w->page_kib >= 2048 ? "2 MiB" : "4 KiB");
}

/* The compiled steps' memory budget in bytes (gj_step_opts.mem_budget;
 * train_gpt2 --memory-budget). 0: none (or GRADJIT_STEP_MEM_BUDGET_MB). */
static size_t stepper_mem_budget;

/* A stepper running fn(ctx, ...) with opt in the given mode (fn, ctx and
 * opt borrowed for its life), under the calling thread's autocast setting
 * (gj_step's opts.autocast; the split modes call fn under it). 0, or -1
 * with gj_last_error() set. */
static inline int stepper_init(stepper *s, step_mode mode, gj_step_fn fn, void *ctx,
                               gj_optim *opt) {
    *s = (stepper){.mode = mode, .fn = fn, .ctx = ctx, .opt = opt};
    if (step_mode_split(mode)) return 0;
    gj_step_opts so = {.eager = mode == STEP_EAGER, .autocast = gj_get_autocast(),
                       .mem_budget = stepper_mem_budget};
    return (s->step = gj_step_new(fn, ctx, opt, &so)) ? 0 : -1;
}

/* A compiled step's program memory (gj_step_memory_stats): "<tag>
 * program: planned peak P MiB of temporaries, K MiB kept for the
 * backward, N values recomputed (F GFLOP)[, budget B MiB]". Nothing for
 * the other modes or before the program exists. */
static inline void stepper_print_memory(const stepper *s, const char *tag) {
    gj_step_memory m;
    if (s->mode != STEP_COMPILED || !s->step || gj_step_memory_stats(s->step, &m) != 0) {
        gj_clear_error();
        return;
    }
    printf("%s%sprogram: planned peak %.1f MiB of temporaries, %.1f MiB kept for the backward, "
           "%lld values recomputed (%.1f GFLOP)",
           tag ? tag : "", tag ? " " : "", (double)m.planned_peak_bytes / 1048576.0,
           (double)m.saved_bytes / 1048576.0, (long long)m.recomputed_values,
           m.recompute_flops * 1e-9);
    if (m.budget_bytes) printf(", budget %.1f MiB", (double)m.budget_bytes / 1048576.0);
    printf("\n");
}

static inline int stepper_ddp_wait(void *ddp) { return gj_ddp_wait(ddp); }
static inline int stepper_ddp_gather(void *ddp) { return gj_ddp_gather(ddp); }

/* Data parallel (--ddp): the gradients averaged over d's ranks between
 * backward and update. The split modes call gj_ddp_wait there; gj_step's
 * modes are made again with d as opts.ddp (the compiled step then reduces
 * inside its program). 0, or -1 with gj_last_error() set. */
static inline int stepper_set_ddp(stepper *s, gj_ddp *d) {
    if (step_mode_split(s->mode)) {
        gj_tensor *const *sh;
        bool zero = gj_ddp_shards(d, &sh) >= 0; /* (ZeRO: the updated shards gathered) */
        gj_clear_error();
        s->between = stepper_ddp_wait;
        s->between_user = d;
        s->after = zero ? stepper_ddp_gather : NULL;
        s->after_user = d;
        return 0;
    }
    gj_step_free(s->step);
    gj_step_opts so = {.eager = s->mode == STEP_EAGER, .ddp = d, .autocast = gj_get_autocast(),
                       .mem_budget = stepper_mem_budget};
    return (s->step = gj_step_new(s->fn, s->ctx, s->opt, &so)) ? 0 : -1;
}

static inline void stepper_free(stepper *s) {
    gj_step_free(s->step);
    s->step = NULL;
}

/* One training step on in[0..n_in) (borrowed): *loss receives the loss, a
 * new reference owned by the innermost open scope (open one around the
 * call: the split modes leave fn's temporaries in it too). Compiled
 * autograd is on during a STEP_SPLIT_CA step only. 0, or -1 with
 * gj_last_error() set (*loss may then be NULL). */
static inline int stepper_run(stepper *s, int n_in, gj_tensor *const *in, gj_tensor **loss,
                              step_times *t) {
    *loss = NULL;
    t->fwd_ms = t->bwd_ms = NAN;
    gj_warmup_stats w0, w1;
    gj_warmup_stats_get(&w0);
    if (s->step) {
        gj_set_compiled_autograd(false);
        double t0 = now_s();
        int rc = gj_step_run(s->step, n_in, in, loss);
        t->step_ms = (now_s() - t0) * 1e3;
        gj_warmup_stats_get(&w1);
        t->w = warmup_diff(&w0, &w1);
        return rc;
    }
    gj_set_compiled_autograd(s->mode == STEP_SPLIT_CA);
    double t0 = now_s();
    *loss = s->fn(s->ctx, n_in, in);
    double t1 = now_s();
    int rc = *loss ? gj_backward(*loss, NULL) : -1;
    if (rc == 0 && s->between) rc = s->between(s->between_user);
    double t2 = now_s();
    if (rc == 0) rc = gj_optim_step(s->opt);
    if (rc == 0 && s->after) rc = s->after(s->after_user);
    gj_optim_zero_grad(s->opt);
    double t3 = now_s();
    gj_set_compiled_autograd(false);
    t->fwd_ms = (t1 - t0) * 1e3;
    t->bwd_ms = (t2 - t1) * 1e3;
    t->step_ms = (t3 - t0) * 1e3;
    gj_warmup_stats_get(&w1);
    t->w = warmup_diff(&w0, &w1);
    return rc == 0 ? 0 : -1;
}

#endif /* GJ_EXAMPLES_COMMON_H */
