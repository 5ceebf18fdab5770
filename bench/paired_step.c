/* SPDX-License-Identifier: MIT */
/*
 * paired_step.c - gradjit-bench --paired N --step: whole training steps of each
 * workload, eager and compiled (gj_step: forward, backward and the AdamW
 * update), interleaved ABBA in one process (docs/benchmarks.md,
 * "How to measure").
 *
 * Invariants: each side has its own copy of the workload (two setups from
 * the same seed) and its own AdamW (the workload's step_lr and step_wd,
 * betas 0.9/0.999, eps 1e-8), so the two sides train the same model side
 * by side: after the pairs their parameters and last losses must be the
 * same bits (the compiled step promises eager's), which the row checks. The
 * step function hands the workload's forward the workload's own input
 * tensors as the step's inputs (in[0..n_in)); they keep their values, as a
 * batch would keep its shapes. A pair's ratio is eager / compiled step
 * time (> 1: compiled faster), ABBA: eager first in even pairs. Warm-up
 * steps (the compiled side's first one traces and compiles) are not timed;
 * the row says when a timed compiled step compiled or ran eagerly. Each
 * side's memory is the largest peak of tensor bytes of its timed steps
 * above what was live when the step began (its activations, gradients and
 * temporaries; the model state of both sides is live throughout).
 *
 * The step's bound, a lower bound on this machine's time for the step:
 *   GEMM FLOPs of the forward and the backward at the f32 peak
 *   (fma_peak.c: the best of the rounds so far, one measured right before
 *   the bound, of all threads at once or threads x one thread, whichever
 *   is higher; the workloads' GEMMs are all f32). The forward's are counted
 *   from the shapes (bench_workload.fwd_flops: 2 M N K per product); the
 *   backward's are those of the compiled backward of the same forward
 *   (gj_compiled_autograd_last_program after one compiled-autograd
 *   backward, untimed, on the eager side's copy), so the count follows
 *   what the compiler emits (W4's includes its recomputed layers);
 * + the compulsory bytes at the bandwidth measured over a working set of
 *   their size (bench_bandwidth_at: a cache's rate when they fit one):
 *     - the step's inputs, read once (at the read rate);
 *     - the parameters and AdamW's m and v (each of the parameter's dtype
 *       and size), each read once and written once (at the rate of bytes
 *       read and written: an in-place update or a copy, whichever is
 *       faster here);
 *   not counted: gradients (a fused step need not materialise them),
 *   activations (they may stay in registers or caches), AdamW's step
 *   counts and hyperparameters (scalars), the loss (4 bytes).
 * The working set of that measurement is inputs + 3 x parameters, capped at
 * 256 MiB (beyond any last-level cache: memory's rate either way).
 * When a measured step of either side is faster than the bound, the peaks
 * and the bandwidth are measured once more, the faster figures kept and
 * the bound recomputed; a step still faster is a WARNING naming both
 * figures (and "bound_beaten" in the JSON).
 */
#include "bench.h"
#include "clock.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct step_result {
    const bench_workload *wl;
    bool ok;
    const char *skipped; /* why there is no row, or NULL */
    char error[384];     /* !ok: why */
    int pairs;
    double ratio_med, ratio_q1, ratio_q3; /* eager / compiled step */
    double eager_ms, compiled_ms;         /* medians */
    double eager_min_ms, compiled_min_ms; /* the fastest steps */
    double fwd_gflop, bwd_gflop;          /* bwd NaN if unknown */
    double in_mb, state_mb;               /* inputs; parameters + m + v */
    double read_gbs, rw_gbs;              /* at the working set's size */
    double bound_ms;                      /* NaN if unknown */
    double peak_gflops;                   /* the peak the bound used */
    bool bf16;                            /* the bound is the bf16 step's */
    bool rechecked, beaten;               /* a step beat the bound: measured again; still */
    long long timed_compiles, timed_fallbacks, timed_steps;
    char fallback[256]; /* the compiled step's last fallback message, if any */
    bool same_bits;     /* the two sides' parameters and last losses */
    double loss_f32, loss_bf16; /* bf16_pair: each side's last loss */
    bool leak;
    /* per side, the most tensor bytes a timed step added (the runtime's
     * peak counter around it: activations, gradients, temporaries); with
     * budget_pair also its program's memory */
    int64_t step_peak[2];
    gj_step_memory mem[2];
} step_result;

/* The step function of a side: the workload's forward on its own inputs,
 * which are the step's in[0..n_in) (the same tensors). */
/* The opts.mem_budget of the sides bench_side_init makes (--budget-pair
 * sets it around its budgeted side's; 0 otherwise). */
static size_t g_init_budget;
/* --budget-pair: the last row's budget was raised to the planner's floor. */
static bool g_budget_raised;

static gj_tensor *step_fn(void *ctx, int n_in, gj_tensor *const *in) {
    bench_side *d = ctx;
    (void)n_in;
    (void)in;
    return bench_forward(d->wl, &d->s);
}

void bench_side_free(bench_side *d) {
    gj_step_free(d->step);
    gj_optim_free(d->opt);
    gj_ddp_free(d->ddp);
    bench_state_free(&d->s);
    d->step = NULL;
    d->opt = NULL;
    d->ddp = NULL;
}

int bench_side_init(bench_side *d, const bench_workload *wl, bool eager, gj_pg *pg, int zero,
                    char *err, size_t cap) {
    memset(d, 0, sizeof *d);
    d->wl = wl;
    d->eager = eager;
    gj_manual_seed(BENCH_SEED);
    if (wl->setup(&d->s) != 0) {
        snprintf(err, cap, "setup failed: %s", gj_last_error());
        return -1;
    }
    gj_ddp_options zo = {.zero = zero};
    if (pg && !(d->ddp = gj_ddp_new(pg, d->s.n_params, d->s.params, &zo))) {
        snprintf(err, cap, "gj_ddp_new: %s", gj_last_error());
        return -1;
    }
    gj_tensor *const *mine = d->s.params; /* (ZeRO: the optimizer over this rank's shards) */
    int n = zero ? gj_ddp_shards(d->ddp, &mine) : d->s.n_params;
    gj_step_opts so = {.eager = eager, .ddp = d->ddp, .autocast = wl->autocast,
                       .mem_budget = g_init_budget};
    d->opt = n > 0 ? gj_adamw_new(n, mine, wl->step_lr, 0.9, 0.999, 1e-8, wl->step_wd) : NULL;
    d->step = d->opt ? gj_step_new(step_fn, d, d->opt, &so) : NULL;
    if (!d->step) {
        snprintf(err, cap, "gj_step_new: %s", gj_last_error());
        return -1;
    }
    return 0;
}

int bench_side_run(bench_side *d, double *ms, char *err, size_t cap) {
    gj_scope_push();
    gj_tensor *loss = NULL;
    double t0 = bench_now_ms();
    int rc = gj_step_run(d->step, d->s.n_in, d->s.in, &loss);
    *ms = bench_now_ms() - t0;
    if (rc == 0)
        d->loss = gj_tensor_item(loss);
    else
        snprintf(err, cap, "%s step failed: %s", d->eager ? "eager" : "compiled",
                 gj_last_error());
    gj_scope_pop();
    return rc;
}

static size_t dtype_size(gj_dtype dt) {
    return dt == GJ_F64 || dt == GJ_I64 ? 8 : dt == GJ_BF16 ? 2 : 4;
}

static double bytes_of(gj_tensor *t) {
    return (double)gj_tensor_numel(t) * (double)dtype_size(gj_tensor_dtype(t));
}

bool bench_same_params(bench_state *a, bench_state *b) {
    for (int k = 0; k < a->n_params; k++) {
        int64_t n = gj_tensor_numel(a->params[k]);
        double *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
        bool same = x && y && gj_tensor_to_f64(a->params[k], x) == 0 &&
                    gj_tensor_to_f64(b->params[k], y) == 0 &&
                    memcmp(x, y, (size_t)n * sizeof *x) == 0;
        free(x);
        free(y);
        if (!same)
            return false;
    }
    return true;
}

/* GEMM FLOPs of the compiled backward of wl's forward on d's copy (one
 * compiled-autograd backward, untimed; the grads are cleared after), or
 * NaN when that backward did not run compiled. */
static double backward_flops(bench_side *d) {
    gj_ca_stats a, b;
    gj_compiled_autograd_stats(&a);
    gj_set_compiled_autograd(true);
    gj_scope_push();
    gj_tensor *loss = bench_forward(d->wl, &d->s);
    int rc = loss ? gj_backward(loss, NULL) : -1;
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    gj_optim_zero_grad(d->opt);
    gj_compiled_autograd_stats(&b);
    gj_ca_program_info pi;
    long long ran = (b.compiles - a.compiles) + (b.mem_hits - a.mem_hits) +
                    (b.disk_hits - a.disk_hits) + (b.instantiations - a.instantiations);
    if (rc != 0 || ran != 1 || gj_compiled_autograd_last_program(&pi) != 0) {
        gj_clear_error();
        return NAN;
    }
    return pi.gemm_flops;
}

static int64_t live_bytes(void) {
    gj_mem m;
    gj_mem_stats(&m);
    return m.live_bytes;
}

/* r's bound from its FLOPs and bytes, the current peak of c and the
 * bandwidth over the working set (with `again`: measured once more, the
 * faster of the two kept). */
static void step_bound(const bench_ceiling *c, step_result *r, double in, double state,
                       bool again) {
    double ws = in + state, cap = (double)((size_t)256 << 20), rd, rw;
    bench_bandwidth_at((size_t)(ws < cap ? ws : cap), c->threads, &rd, &rw, NULL);
    r->read_gbs = again && r->read_gbs > rd ? r->read_gbs : rd;
    r->rw_gbs = again && r->rw_gbs > rw ? r->rw_gbs : rw;
    /* the GEMMs of a workload are f32, or bf16 under its autocast */
    r->peak_gflops = bench_gemm_peak(c, r->bf16 ? GJ_BF16 : GJ_F32);
    r->bound_ms = NAN;
    if (isfinite(r->bwd_gflop) && r->peak_gflops > 0 && r->read_gbs > 0 && r->rw_gbs > 0)
        r->bound_ms = (r->fwd_gflop + r->bwd_gflop) / r->peak_gflops * 1e3 +
                      2.0 * state / (r->rw_gbs * 1e6) + in / (r->read_gbs * 1e6);
}

static bool step_beaten(const step_result *r) {
    double t = r->eager_min_ms < r->compiled_min_ms ? r->eager_min_ms : r->compiled_min_ms;
    return isfinite(r->bound_ms) && t < r->bound_ms;
}

/* gemm_pair: both sides compiled; side 0 runs with OpenBLAS pinned, side
 * 1 with the per-shape choice (GJ_GEMM_AUTO), set before each run.
 * bf16_pair: both sides compiled; side 0 the workload in f32, side 1 the
 * same in bf16 mixed precision (its autocast). */
static bool g_gemm_pair, g_bf16_pair, g_budget_pair;
static int64_t g_side_peak[2]; /* the most bytes a step of side m added */

static int side_run_as(bench_side *d, int m, double *ms, char *err, size_t cap) {
    if (g_gemm_pair && gj_set_gemm_provider(m ? GJ_GEMM_AUTO : GJ_GEMM_OPENBLAS) != 0) {
        snprintf(err, cap, "%s", gj_last_error());
        return -1;
    }
    gj_mem m0, m1;
    gj_mem_stats(&m0);
    gj_mem_reset_peak();
    int rc = bench_side_run(d, ms, err, cap);
    gj_mem_stats(&m1);
    if (m1.peak_bytes - m0.live_bytes > g_side_peak[m])
        g_side_peak[m] = m1.peak_bytes - m0.live_bytes;
    return rc;
}

/* budget_pair: side 1's budget is side 0's planned peak less half the
 * activations it keeps for the backward (read after two steps of side 0):
 * half the activations. 0, or -1 with err. */
static int budget_of(bench_side *e, size_t *budget, char *err, size_t cap) {
    double ms;
    gj_step_memory mem;
    if (side_run_as(e, 0, &ms, err, cap) != 0 || side_run_as(e, 0, &ms, err, cap) != 0)
        return -1;
    if (gj_step_memory_stats(e->step, &mem) != 0) {
        snprintf(err, cap, "%s", gj_last_error());
        return -1;
    }
    *budget = (size_t)(mem.planned_peak_bytes - mem.saved_bytes / 2);
    return 0;
}

/* budget_pair: when the budgeted side's first run finds its budget below
 * the smallest peak the planner reaches (gj_step_run's error names it),
 * side k is made again under that peak, which the error promises it meets
 * (test_step_budget checks the promise). 1 (side k ran a step under its
 * budget), 0 (side k made again, not run), or -1 with err. */
static const char g_floor_text[] = "the smallest peak the planner reaches is ";
static int budget_floor(bench_side *k, const bench_workload *w, size_t *budget, char *err,
                        size_t cap) {
    double ms;
    if (side_run_as(k, 1, &ms, err, cap) == 0)
        return 1;
    const char *at = strstr(err, g_floor_text);
    long long least = at ? atoll(at + strlen(g_floor_text)) : 0;
    if (least <= (long long)*budget)
        return -1;
    bench_side_free(k);
    *budget = (size_t)least;
    g_budget_raised = true;
    g_init_budget = *budget;
    int ki = bench_side_init(k, w, false, NULL, 0, err, cap);
    g_init_budget = 0;
    return ki;
}

static void step_run(const bench_workload *wl, int pairs, int warmup, bench_ceiling *c,
                     step_result *r) {
    memset(r, 0, sizeof *r);
    g_budget_raised = false;
    r->wl = wl;
    r->pairs = pairs;
    r->bound_ms = r->bwd_gflop = NAN;
    if (wl->no_step) {
        r->skipped = wl->no_step;
        return;
    }
    bench_side e, k; /* eager, compiled */
    bool ie = false, ik = false;
    double *ratio = calloc((size_t)pairs, sizeof *ratio);
    double *em = calloc((size_t)pairs, sizeof *em), *cm = calloc((size_t)pairs, sizeof *cm);
    int64_t live0 = live_bytes();
    if (!ratio || !em || !cm) {
        snprintf(r->error, sizeof r->error, "out of memory");
        goto done;
    }
    gj_step_reset_stats();
    bench_workload w0 = *wl, w1 = *wl;
    if (g_bf16_pair) {
        w0.autocast = GJ_F32;
        w1.autocast = GJ_BF16;
    }
    r->bf16 = w1.autocast == GJ_BF16;
    bool both_compiled = g_gemm_pair || g_bf16_pair || g_budget_pair;
    if (bench_side_init(&e, &w0, !both_compiled, NULL, 0, r->error, sizeof r->error) != 0)
        goto done;
    ie = true;
    size_t budget = 0;
    if (g_budget_pair && budget_of(&e, &budget, r->error, sizeof r->error) != 0)
        goto done;
    if (g_budget_pair) { /* side 0 made again: both sides start from the same weights */
        bench_side_free(&e);
        ie = false;
        if (bench_side_init(&e, &w0, false, NULL, 0, r->error, sizeof r->error) != 0)
            goto done;
        ie = true;
    }
    g_init_budget = budget;
    int ki = bench_side_init(&k, &w1, false, NULL, 0, r->error, sizeof r->error);
    g_init_budget = 0;
    if (ki != 0)
        goto done;
    ik = true;
    if (g_budget_pair) {
        double ms0;
        int bf = budget_floor(&k, &w1, &budget, r->error, sizeof r->error);
        if (bf < 0 || (bf == 1 && side_run_as(&e, 0, &ms0, r->error, sizeof r->error) != 0))
            goto done; /* (side 0 a step on too: both sides at the same weights) */
    }
    double ms[2];
    for (int i = 0; i < warmup; i++)
        if (side_run_as(&e, 0, &ms[0], r->error, sizeof r->error) != 0 ||
            side_run_as(&k, 1, &ms[1], r->error, sizeof r->error) != 0)
            goto done;
    gj_ca_stats warm, end;
    gj_step_stats(&warm);
    g_side_peak[0] = g_side_peak[1] = 0;
    for (int i = 0; i < pairs; i++) {
        for (int j = 0; j < 2; j++) {
            int m = (i & 1) ? 1 - j : j; /* ABBA: E C | C E | E C ... */
            if (side_run_as(m ? &k : &e, m, &ms[m], r->error, sizeof r->error) != 0)
                goto done;
        }
        em[i] = ms[0];
        cm[i] = ms[1];
        ratio[i] = ms[0] / ms[1];
    }
    gj_step_stats(&end);
    r->timed_steps = end.backwards - warm.backwards;
    r->timed_compiles = end.compiles - warm.compiles;
    r->timed_fallbacks = end.fallbacks - warm.fallbacks;
    if (end.fallbacks)
        snprintf(r->fallback, sizeof r->fallback, "%s", gj_compiled_autograd_last_fallback());
    r->ratio_q1 = bench_quantile(ratio, pairs, 0.25);
    r->ratio_med = bench_quantile(ratio, pairs, 0.5);
    r->ratio_q3 = bench_quantile(ratio, pairs, 0.75);
    r->eager_ms = bench_quantile(em, pairs, 0.5);
    r->compiled_ms = bench_quantile(cm, pairs, 0.5);
    r->eager_min_ms = em[0]; /* sorted by bench_quantile */
    r->compiled_min_ms = cm[0];
    r->same_bits = e.loss == k.loss && bench_same_params(&e.s, &k.s);
    r->loss_f32 = e.loss;
    r->loss_bf16 = k.loss;
    r->step_peak[0] = g_side_peak[0];
    r->step_peak[1] = g_side_peak[1];
    if (g_budget_pair && (gj_step_memory_stats(e.step, &r->mem[0]) != 0 ||
                          gj_step_memory_stats(k.step, &r->mem[1]) != 0)) {
        snprintf(r->error, sizeof r->error, "%s", gj_last_error());
        goto done;
    }

    /* the bound */
    double params = 0, in = 0;
    for (int p = 0; p < e.s.n_params; p++)
        params += bytes_of(e.s.params[p]);
    for (int p = 0; p < e.s.n_in; p++)
        in += bytes_of(e.s.in[p]);
    double state = 3.0 * params; /* parameters, m, v: each read and written once */
    r->in_mb = in * 1e-6;
    r->state_mb = state * 1e-6;
    r->fwd_gflop = wl->fwd_flops ? wl->fwd_flops(&e.s) * 1e-9 : 0.0;
    r->bwd_gflop = backward_flops(&e) * 1e-9;
    bench_fma_peak_again(c); /* the best of every round */
    step_bound(c, r, in, state, false);
    if (step_beaten(r)) { /* measure the rates once more before saying so */
        r->rechecked = true;
        bench_fma_peak_again(c);
        step_bound(c, r, in, state, true);
        r->beaten = step_beaten(r);
    }
    r->ok = true;
done:
    if (ie)
        bench_side_free(&e);
    if (ik)
        bench_side_free(&k);
    r->leak = r->ok && live_bytes() != live0;
    free(ratio);
    free(em);
    free(cm);
}

static void print_header(void) {
    printf("%-4s %-13s %5s %20s %10s %10s %9s %9s %8s %8s %8s %15s  %s\n", "id", "name",
           "pairs", "eager/compiled [IQR]", "eager ms", "comp. ms", "bound ms", "comp/bnd",
           "GFLOP", "MB", "GB/s", "step MiB e/c", "checks");
}

static void print_row(const step_result *r) {
    if (r->skipped) {
        printf("%-4s %-13s skipped: %s\n", r->wl->id, r->wl->name, r->skipped);
        return;
    }
    if (!r->ok) {
        printf("%-4s %-13s FAILED: %s\n", r->wl->id, r->wl->name, r->error);
        return;
    }
    char bound[32] = "-", rel[32] = "-", check[400];
    if (isfinite(r->bound_ms)) {
        snprintf(bound, sizeof bound, "%.3f", r->bound_ms);
        snprintf(rel, sizeof rel, "%.2f", r->compiled_ms / r->bound_ms);
    }
    if (r->timed_fallbacks)
        snprintf(check, sizeof check, "FALLBACK in %lld timed steps: %s", r->timed_fallbacks,
                 r->fallback);
    else if (r->timed_compiles)
        snprintf(check, sizeof check, "compiles in timed steps");
    else if (r->timed_steps !=
             (g_gemm_pair || g_bf16_pair || g_budget_pair ? 2 : 1) * (int64_t)r->pairs)
        snprintf(check, sizeof check, "compiled step not engaged");
    else if (!r->same_bits && !g_gemm_pair && !g_bf16_pair)
        snprintf(check, sizeof check, "DIFFERENT bits from eager");
    else if (r->leak)
        snprintf(check, sizeof check, "LEAK");
    else if (g_bf16_pair)
        snprintf(check, sizeof check, "ok, f32 loss %.6g, bf16 loss %.6g", r->loss_f32, r->loss_bf16);
    else if (g_gemm_pair)
        snprintf(check, sizeof check, "ok, %s", r->same_bits ? "the same bits" : "other bits (two providers)");
    else
        snprintf(check, sizeof check, "ok, eager's bits");
    char peaks[40];
    snprintf(peaks, sizeof peaks, "%.0f/%.0f", r->step_peak[0] / 1048576.0,
             r->step_peak[1] / 1048576.0);
    printf("%-4s %-13s %5d %6.3fx [%.2f-%.2f] %10.3f %10.3f %9s %9s %8.2f %8.1f %8.0f %15s  %s%s\n",
           r->wl->id, r->wl->name, r->pairs, r->ratio_med, r->ratio_q1, r->ratio_q3, r->eager_ms,
           r->compiled_ms, bound, rel, r->fwd_gflop + r->bwd_gflop, r->in_mb + r->state_mb,
           r->rw_gbs, peaks, check,
           r->beaten ? ", BOUND BEATEN" : r->rechecked ? ", bound measured twice" : "");
    if (!r->beaten)
        return;
    double t[2] = {r->eager_min_ms, r->compiled_min_ms};
    for (int m = 0; m < 2; m++)
        if (t[m] < r->bound_ms)
            printf("  WARNING: %s: its %s step took %.3f ms (fastest of %d), below its bound "
                   "%.3f ms (%s peak %.1f GFLOP/s) even after measuring the rates again: that "
                   "bound is not a lower bound here\n",
                   r->wl->id, m ? "compiled" : "eager", t[m], r->pairs, r->bound_ms,
                   r->bf16 ? "bf16" : "f32", r->peak_gflops);
}

static void json_num(FILE *f, const char *key, double v) {
    if (isfinite(v))
        fprintf(f, ", \"%s\": %.6g", key, v);
    else
        fprintf(f, ", \"%s\": null", key);
}

static int write_json(const char *path, const step_result *res, int n, const bench_ceiling *c,
                      int pairs, const char *cpu) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "gradjit-bench: cannot write %s\n", path);
        return -1;
    }
    gj_info info;
    gj_get_info(&info);
    fprintf(f, "{\"cpu\": \"");
    for (const char *p = cpu; *p; p++) /* a model name: no control characters */
        fprintf(f, *p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
    fprintf(f, "\", \"threads\": %d, \"blas_core\": \"%s\", \"pairs\": %d, "
               "\"peak_gflops_f32\": %.2f, \"peak_gflops_bf16\": %.2f, \"busy\": %s,\n "
               "\"ceiling\": ",
            c->threads, info.blas_core ? info.blas_core : "", pairs, c->peak_gflops_f32,
            c->peak_gflops_bf16, c->busy ? "true" : "false");
    bench_ceiling_json(f, c);
    fprintf(f, ",\n \"results\": [");
    int k = 0;
    for (int i = 0; i < n; i++) {
        const step_result *r = &res[i];
        if (r->skipped)
            continue;
        fprintf(f, "%s\n  {\"id\": \"%s\", \"what\": \"step\"", k++ ? "," : "", r->wl->id);
        if (r->ok) {
            json_num(f, "ratio", r->ratio_med);
            json_num(f, "ratio_q1", r->ratio_q1);
            json_num(f, "ratio_q3", r->ratio_q3);
            json_num(f, "eager_ms", r->eager_ms);
            json_num(f, "compiled_ms", r->compiled_ms);
            json_num(f, "bound_ms", r->bound_ms);
            json_num(f, "eager_min_ms", r->eager_min_ms);
            json_num(f, "compiled_min_ms", r->compiled_min_ms);
            json_num(f, "peak_gflops_f32", r->peak_gflops);
            json_num(f, "read_gbs", r->read_gbs);
            json_num(f, "rw_gbs", r->rw_gbs);
            fprintf(f, ", \"bound_rechecked\": %s, \"bound_beaten\": %s",
                    r->rechecked ? "true" : "false", r->beaten ? "true" : "false");
            json_num(f, "fwd_gflop", r->fwd_gflop);
            json_num(f, "bwd_gflop", r->bwd_gflop);
            json_num(f, "bytes_mb", r->in_mb + r->state_mb);
            json_num(f, "eager_step_peak_mib", r->step_peak[0] / 1048576.0);
            json_num(f, "compiled_step_peak_mib", r->step_peak[1] / 1048576.0);
            fprintf(f, ", \"timed_fallbacks\": %lld, \"same_bits\": %s", r->timed_fallbacks,
                    r->same_bits ? "true" : "false");
        }
        fprintf(f, ", \"ok\": %s}", r->ok ? "true" : "false");
    }
    fprintf(f, "\n]}\n");
    return fclose(f) == 0 ? 0 : -1;
}

int bench_step_main(unsigned workloads, int pairs, int warmup, const char *json_path,
                    const char *cpu, bool gemm_pair, bool bf16_pair, bool budget_pair) {
    gj_info info;
    gj_get_info(&info);
    g_gemm_pair = gemm_pair;
    g_bf16_pair = bf16_pair;
    g_budget_pair = budget_pair;
    printf("gradjit %s | CPU: %s | threads: %d | BLAS core: %s\n", info.version, cpu,
           info.num_threads, info.blas_core ? info.blas_core : "?");
    printf("%d pairs (ABBA) after %d warm-up steps per side; a step = forward, backward and "
           "AdamW update (gj_step, eager vs compiled, each side its own copy of the model); "
           "ratio = eager / compiled step (> 1: compiled faster), median [interquartile range]\n",
           pairs, warmup);
    if (gemm_pair)
        printf("--gemm-pair: both sides are compiled steps; the \"eager\" column is the step with "
               "OpenBLAS pinned for every GEMM, the \"comp.\" column the step with the provider "
               "chosen per GEMM shape (auto: oneDNN where it measured faster); ratio = OpenBLAS "
               "/ auto (> 1: the choice is faster). The two sum GEMMs in different orders, so "
               "their bits may differ\n");
    if (bf16_pair)
        printf("--bf16-pair: both sides are compiled steps; the \"eager\" column is the step in "
               "f32, the \"comp.\" column the same step in bf16 mixed precision (autocast: "
               "GEMMs and activations in bf16, f32 master parameters and AdamW state); ratio = "
               "f32 / bf16 (> 1: bf16 faster); the bound is the bf16 step's\n");
    if (budget_pair)
        printf("--budget-pair: both sides are compiled steps; the \"eager\" column is the step "
               "without a memory budget, the \"comp.\" column the step under a budget of the "
               "first's planned peak of temporaries less half the activations it keeps for the "
               "backward, or the smallest peak the planner reaches where that is more "
               "(gj_step_opts.mem_budget: activations recomputed in the backward); ratio = unbudgeted / budgeted (< 1: the budget "
               "costs time); both keep the eager step's bits. Under each row: each side's "
               "planned peak, its measured peak (tensor bytes a step adds) and what it "
               "recomputes\n");
    bench_ceiling c;
    bench_ceiling_measure(&c, info.num_threads);
    bench_fma_peak_print(&c, "at start");
    printf("bound = forward and backward GEMM FLOPs at the f32 peak (bf16 workloads: the bf16 "
           "peak) + inputs read once and "
           "parameters, AdamW m and v read and written once, at the bandwidth of a working set "
           "of their size (GB/s column: bytes read and written); bench/paired_step.c says what it "
           "counts. The peaks are measured again before each bound and the best kept; a step "
           "faster than its bound has the rates measured once more, then a WARNING\n\n");
    print_header();
    step_result res[16];
    int n = 0, failed = 0;
    for (int w = 0; w < bench_n_workloads && n < 16; w++) {
        if (!(workloads & (1u << w)))
            continue;
        step_run(&bench_workloads[w], pairs, warmup, &c, &res[n]);
        print_row(&res[n]);
        if (budget_pair && res[n].ok)
            for (int m = 0; m < 2; m++)
                printf("     %s: budget %.2f MiB, planned peak %.2f MiB, measured peak %.2f MiB, "
                       "kept for the backward %.2f MiB, %lld values recomputed (%.3f GFLOP)\n",
                       m ? "budgeted" : "unbudgeted", res[n].mem[m].budget_bytes / 1048576.0,
                       res[n].mem[m].planned_peak_bytes / 1048576.0,
                       res[n].step_peak[m] / 1048576.0, res[n].mem[m].saved_bytes / 1048576.0,
                       (long long)res[n].mem[m].recomputed_values,
                       res[n].mem[m].recompute_flops * 1e-9);
        if (budget_pair && res[n].ok && g_budget_raised)
            printf("     (the budget is the smallest peak the planner reaches: the planned peak "
                   "less half the kept activations is below it)\n");
        fflush(stdout);
        failed |= !res[n].skipped &&
                  (!res[n].ok || (!res[n].same_bits && !gemm_pair && !bf16_pair) || res[n].leak);
        n++;
    }
    printf("\n");
    bench_fma_peak_print(&c, "over the run");
    int beaten = 0;
    for (int i = 0; i < n; i++)
        beaten += res[i].ok && res[i].beaten;
    if (beaten)
        printf("WARNING: %d workload%s ran faster than its bound (lines above)\n", beaten,
               beaten == 1 ? "" : "s");
    if (json_path && strcmp(json_path, "-") != 0) {
        if (write_json(json_path, res, n, &c, pairs, cpu) != 0)
            failed = 1;
        else
            printf("wrote %s\n", json_path);
    }
    bench_ceiling_free(&c);
    return failed ? 1 : 0;
}
