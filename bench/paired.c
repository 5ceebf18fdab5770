/* SPDX-License-Identifier: MIT */
/*
 * paired.c - gradjit-bench --paired: eager and compiled backward steps of one
 * workload interleaved in one process (docs/benchmarks.md, "How to measure").
 *
 * Invariants: both modes run on the same parameters and inputs (one setup);
 * pairs alternate their order ABBA (eager first in even pairs, compiled
 * first in odd ones), so a drift of the machine's speed during a pair
 * weighs on both sides alike; a pair's ratio is eager / compiled backward
 * time (> 1: compiled is faster). With --symbolic the two sides are the
 * specialised and the symbolic compiled program of the same key (dynamic
 * shapes OFF and ALWAYS: two keys, two programs). Every step checks that each parameter got
 * a .grad, and the compiled steps must neither compile nor fall back once
 * warm (the row says so when they do). Nothing here is public API beyond
 * gradjit.h.
 */
#include "bench.h"
#include "clock.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The q-quantile (0..1) of v[0..n) by linear interpolation; sorts v. */
double bench_quantile(double *v, int n, double q) {
    if (n <= 0)
        return NAN;
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    double pos = q * (n - 1);
    int lo = (int)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (pos - lo) * (v[hi] - v[lo]);
}

/* One step of wl in the current mode: forward, backward (timed: *bwd_ms,
 * and forward+backward *step_ms), every parameter must hold a .grad, then
 * the untimed after_backward and the grads set to none. 0, or -1 with err. */
static int paired_step(const bench_workload *wl, bench_state *s, double *bwd_ms, double *step_ms,
                       char *err, size_t cap) {
    int rc = -1;
    gj_scope_push();
    double t0 = bench_now_ms();
    gj_tensor *loss = bench_forward(wl, s);
    double t1 = bench_now_ms();
    if (!loss) {
        snprintf(err, cap, "forward failed: %s", gj_last_error());
        goto out;
    }
    if (gj_backward(loss, NULL) != 0) {
        snprintf(err, cap, "backward failed: %s", gj_last_error());
        goto out;
    }
    double t2 = bench_now_ms();
    *bwd_ms = t2 - t1;
    *step_ms = t2 - t0;
    for (int i = 0; i < s->n_params; i++)
        if (!gj_tensor_grad(s->params[i])) {
            snprintf(err, cap, "backward left parameter %d without a .grad", i);
            goto out;
        }
    if (wl->after_backward && wl->after_backward(s) != 0) {
        snprintf(err, cap, "after-backward step failed: %s", gj_last_error());
        goto out;
    }
    rc = 0;
out:
    for (int i = 0; i < s->n_params; i++)
        gj_tensor_set_grad(s->params[i], NULL);
    gj_scope_pop();
    return rc;
}

/* Side m (0 or 1) of a pair: eager / compiled, or (symbolic) the
 * specialised / the symbolic compiled program. */
static void set_side(int m, bool symbolic) {
    if (!symbolic) {
        gj_set_compiled_autograd(m == 1);
        return;
    }
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_set_dynamic(m == 1 ? GJ_CA_DYNAMIC_ALWAYS : GJ_CA_DYNAMIC_OFF);
}

void bench_paired_run(const bench_workload *wl, int pairs, int warmup, bool symbolic,
                      bench_paired_result *r) {
    memset(r, 0, sizeof *r);
    r->wl = wl;
    r->pairs = pairs;
    r->symbolic = symbolic;
    double *ratio = calloc((size_t)pairs, sizeof *ratio);
    double *sratio = calloc((size_t)pairs, sizeof *sratio);
    double *eb = calloc((size_t)pairs, sizeof *eb), *cb = calloc((size_t)pairs, sizeof *cb);
    bench_state s = {0};
    if (!ratio || !sratio || !eb || !cb) {
        snprintf(r->error, sizeof r->error, "out of memory");
        goto done;
    }
    gj_compiled_autograd_reset_stats();
    gj_manual_seed(BENCH_SEED);
    if (wl->setup(&s) != 0) {
        snprintf(r->error, sizeof r->error, "setup failed: %s", gj_last_error());
        goto done;
    }
    double b, st;
    for (int i = 0; i < warmup; i++)
        for (int m = 0; m < 2; m++) {
            set_side(m, symbolic);
            if (paired_step(wl, &s, &b, &st, r->error, sizeof r->error) != 0)
                goto done;
            gj_ca_program_info pi;
            if (symbolic && (gj_compiled_autograd_last_program(&pi) != 0 || pi.symbolic != (m == 1))) {
                snprintf(r->error, sizeof r->error, "the %s side did not run a %s program",
                         m ? "symbolic" : "specialised", m ? "symbolic" : "specialised");
                goto done;
            }
        }
    gj_ca_stats warm, end;
    gj_compiled_autograd_stats(&warm);
    r->compile_ms = warm.compile_ms;
    for (int i = 0; i < pairs; i++) {
        double bw[2], sw[2];
        for (int j = 0; j < 2; j++) {
            int m = (i & 1) ? 1 - j : j; /* ABBA: E C | C E | E C ... */
            set_side(m, symbolic);
            if (paired_step(wl, &s, &bw[m], &sw[m], r->error, sizeof r->error) != 0)
                goto done;
        }
        eb[i] = bw[0];
        cb[i] = bw[1];
        ratio[i] = bw[0] / bw[1];
        sratio[i] = sw[0] / sw[1];
    }
    gj_compiled_autograd_stats(&end);
    r->timed_compiles = end.compiles - warm.compiles;
    r->timed_fallbacks = end.fallbacks - warm.fallbacks;
    r->timed_backwards = end.backwards - warm.backwards;
    r->ratio_q1 = bench_quantile(ratio, pairs, 0.25);
    r->ratio_med = bench_quantile(ratio, pairs, 0.5);
    r->ratio_q3 = bench_quantile(ratio, pairs, 0.75);
    r->step_ratio_med = bench_quantile(sratio, pairs, 0.5);
    r->eager_ms = bench_quantile(eb, pairs, 0.5);
    r->compiled_ms = bench_quantile(cb, pairs, 0.5);
    r->eager_min_ms = eb[0]; /* sorted by bench_quantile */
    r->compiled_min_ms = cb[0];
    r->ok = true;
done:
    gj_set_compiled_autograd(false);
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
    bench_state_free(&s);
    free(ratio);
    free(sratio);
    free(eb);
    free(cb);
}

void bench_paired_print_header(bool symbolic) {
    printf("%-4s %-13s %5s %20s %10s %10s %9s %9s %8s %10s %8s %8s  %s\n", "id", "name", "pairs",
           symbolic ? "spec./symbolic [IQR]" : "eager/compiled [IQR]",
           symbolic ? "spec. ms" : "eager ms", symbolic ? "symb. ms" : "comp. ms", "bound ms",
           symbolic ? "symb/bnd" : "comp/bnd", "peak ms", symbolic ? "spec./peak" : "eager/peak",
           "GFLOP", "MB", "checks");
}

void bench_paired_print_row(const bench_paired_result *r) {
    if (!r->ok) {
        printf("%-4s %-13s FAILED: %s\n", r->wl->id, r->wl->name, r->error);
        return;
    }
    char bound[32] = "-", rel[32] = "-", peak[32] = "-", most[32] = "-";
    if (r->bound_ms > 0) {
        snprintf(bound, sizeof bound, "%.3f", r->bound_ms);
        snprintf(rel, sizeof rel, "%.2f", r->compiled_ms / r->bound_ms);
    }
    if (r->peak_ms > 0) {
        snprintf(peak, sizeof peak, "%.3f", r->peak_ms);
        snprintf(most, sizeof most, "%.2f", r->eager_ms / r->peak_ms);
    }
    printf("%-4s %-13s %5d %6.3fx [%.2f-%.2f] %10.3f %10.3f %9s %9s %8s %10s %8.3f %8.1f  %s%s\n",
           r->wl->id, r->wl->name, r->pairs, r->ratio_med, r->ratio_q1, r->ratio_q3, r->eager_ms,
           r->compiled_ms, bound, rel, peak, most, r->gemm_gflop, r->bytes_mb,
           r->timed_fallbacks ? "FALLBACKS in timed steps"
           : r->timed_compiles ? "compiles in timed steps"
           : r->timed_backwards != (r->symbolic ? 2 : 1) * r->pairs ? "compiled path not engaged"
                                             : "ok",
           r->beaten ? ", BOUND BEATEN" : r->rechecked ? ", bound measured twice" : "");
    if (!r->beaten)
        return;
    /* a measured time below a bound: say which, with both figures */
    const char *side[2] = {r->symbolic ? "specialised" : "eager",
                           r->symbolic ? "symbolic" : "compiled"};
    double t[2] = {r->eager_min_ms, r->compiled_min_ms};
    for (int m = 0; m < 2; m++) {
        const char *what = r->bound_ms > 0 && t[m] < r->bound_ms ? "bound"
                           : r->peak_ms > 0 && t[m] < r->peak_ms ? "peak bound"
                                                                 : NULL;
        if (what)
            printf("  WARNING: %s: its %s backward took %.3f ms (fastest of %d), below its %s "
                   "%.3f ms (peak bound %.3f ms) even after measuring the rates again: that "
                   "bound is not a lower bound here\n",
                   r->wl->id, side[m], t[m], r->pairs, what,
                   !strcmp(what, "bound") ? r->bound_ms : r->peak_ms, r->peak_ms);
    }
}
