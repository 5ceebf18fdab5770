/* SPDX-License-Identifier: MIT */
/*
 * demo_w1.c - trains the W1 MLP of docs/benchmarks.md (784-1024-1024-10, GELU,
 * cross-entropy) for 20 AdamW steps on synthetic data, once with the eager
 * engine and once with compiled autograd, and prints both side by side.
 *
 * Data: every step draws x[256,784] ~ N(0,1) from the seeded generator; a
 * fixed random linear teacher W_t[784,10] labels it with argmax(x @ W_t).
 * Both runs reseed the generator (gj_manual_seed) before creating the model,
 * so they see identical weights and batches and their losses must agree; the
 * program prints the largest relative loss difference and exits 1 if it is
 * above 1e-3 (or if anything fails). Each step runs inside gj_scope_push/pop.
 *
 *   demo_w1 [--steps N] [--threads N]
 */
#include "gradjit.h"
#include "args.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { N = 256, IN = 784, HID = 1024, K = 10, MAX_STEPS = 1000 };
#define SEED 1234u
#define LR 1e-3
#define LOSS_TOL 1e-3

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Teacher labels for x[N,IN]: argmax over K of x @ wt (wt [IN,K]).
 * New reference to an i64 [N] tensor, or NULL. */
static gj_tensor *teacher_labels(gj_tensor *x, gj_tensor *wt) {
    float scores[N * K];
    int64_t lab[N], n = N;
    gj_no_grad_push();
    gj_tensor *s = gj_matmul(x, wt); /* [N, K] */
    gj_no_grad_pop();
    if (!s || gj_tensor_to_f32(s, scores) != 0)
        return NULL;
    for (int i = 0; i < N; i++) {
        int best = 0;
        for (int j = 1; j < K; j++)
            if (scores[i * K + j] > scores[i * K + best])
                best = j;
        lab[i] = best;
    }
    return gj_from_data(GJ_I64, 1, &n, lab);
}

/* Trains for `steps` steps; loss[i] and bwd_ms[i] per step, stats of the
 * compiled path in *st. 0 on success, else -1 with a message on stderr. */
static int train(bool compiled, int steps, double *loss, double *bwd_ms, gj_ca_stats *st) {
    int rc = -1;
    gj_linear_layer l[3] = {{0}};
    gj_optim *opt = NULL;
    gj_tensor *wt = NULL;
    const int64_t dims[4] = {IN, HID, HID, K};

    gj_set_compiled_autograd(compiled);
    gj_compiled_autograd_reset_stats();
    gj_manual_seed(SEED);
    for (int i = 0; i < 3; i++)
        if (gj_linear_init(&l[i], dims[i], dims[i + 1], true, GJ_F32) != 0)
            goto fail;
    int64_t ws[2] = {IN, K};
    if (!(wt = gj_randn(GJ_F32, 2, ws, 1.0)))
        goto fail;
    gj_tensor *params[6] = {l[0].weight, l[0].bias, l[1].weight,
                            l[1].bias,   l[2].weight, l[2].bias};
    if (!(opt = gj_adamw_new(6, params, LR, 0.9, 0.999, 1e-8, 0.01)))
        goto fail;

    for (int s = 0; s < steps; s++) {
        gj_scope_push();
        int64_t xs[2] = {N, IN};
        gj_tensor *x = gj_randn(GJ_F32, 2, xs, 1.0);
        gj_tensor *y = x ? teacher_labels(x, wt) : NULL;
        gj_tensor *h = y ? gj_gelu(gj_linear_forward(&l[0], x)) : NULL;
        h = h ? gj_gelu(gj_linear_forward(&l[1], h)) : NULL;
        gj_tensor *logits = h ? gj_linear_forward(&l[2], h) : NULL;
        gj_tensor *lo = logits ? gj_cross_entropy(logits, y) : NULL;
        int ok = lo != NULL;
        double t0 = now_ms();
        ok = ok && gj_backward(lo, NULL) == 0;
        bwd_ms[s] = now_ms() - t0;
        ok = ok && gj_optim_step(opt) == 0;
        if (ok)
            loss[s] = gj_tensor_item(lo);
        gj_optim_zero_grad(opt);
        gj_scope_pop();
        if (!ok)
            goto fail;
    }
    gj_compiled_autograd_stats(st);
    rc = 0;
fail:
    if (rc != 0)
        fprintf(stderr, "demo_w1 (%s): %s\n", compiled ? "compiled" : "eager", gj_last_error());
    gj_optim_free(opt);
    gj_release(wt);
    for (int i = 0; i < 3; i++)
        gj_linear_free(&l[i]);
    gj_set_compiled_autograd(false);
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(const double *v, int n) {
    double tmp[MAX_STEPS];
    memcpy(tmp, v, (size_t)n * sizeof *v);
    qsort(tmp, (size_t)n, sizeof *tmp, cmp_double);
    return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

int main(int argc, char **argv) {
    int steps = 20, threads = 0;
    const arg_spec specs[] = {
        ARG_OPT("steps", ARG_INT, &steps, 1, MAX_STEPS, "training steps"),
        ARG_OPT("threads", ARG_INT, &threads, 0, 4096, "gradjit threads (0: every CPU)"),
    };
    int prc = args_parse("demo_w1",
                         "Trains W1 (784-1024-1024-10 GELU MLP, synthetic data) eagerly and "
                         "compiled and prints both step times.",
                         argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (prc != 0) return prc > 0 ? 0 : 2;
    gj_set_num_threads(threads);
    gj_info info;
    gj_get_info(&info);
    printf("gradjit %s, %d threads, BLAS %s\n", info.version, info.num_threads,
           info.blas_core ? info.blas_core : "?");
    printf("W1 MLP 784-1024-1024-10 (GELU), batch %d, AdamW lr %g, %d steps, synthetic "
           "teacher labels\n\n",
           N, LR, steps);

    double le[MAX_STEPS], lc[MAX_STEPS], be[MAX_STEPS], bc[MAX_STEPS];
    gj_ca_stats se, sc;
    if (train(false, steps, le, be, &se) != 0 || train(true, steps, lc, bc, &sc) != 0)
        return 1;

    printf("%4s  %12s  %12s  %10s  %10s\n", "step", "loss eager", "loss compiled", "bwd ms eag",
           "bwd ms cmp");
    double maxrel = 0.0;
    for (int s = 0; s < steps; s++) {
        double rel = fabs(lc[s] - le[s]) / fmax(fabs(le[s]), 1e-30);
        if (!(rel <= maxrel))
            maxrel = rel; /* also catches NaN */
        printf("%4d  %12.6f  %12.6f  %10.3f  %10.3f\n", s, le[s], lc[s], be[s], bc[s]);
    }
    printf("\nmedian backward: eager %.3f ms, compiled %.3f ms (speedup %.2fx; step 0 of "
           "compiled includes compilation)\n",
           median(be, steps), median(bc, steps), median(be, steps) / median(bc, steps));
    printf("compiled autograd: %lld backwards, %lld compiles (%.1f ms), %lld memory hits, %lld "
           "disk hits, %lld fallbacks\n",
           (long long)sc.backwards, (long long)sc.compiles, sc.compile_ms, (long long)sc.mem_hits,
           (long long)sc.disk_hits, (long long)sc.fallbacks);
    if (sc.backwards == 0)
        printf("WARNING: no backward went through the compiled path (the compiled column is "
               "eager)\n");
    if (sc.fallbacks > 0)
        printf("WARNING: %lld backwards fell back to the eager engine\n",
               (long long)sc.fallbacks);
    printf("max relative loss difference (compiled vs eager): %.3e (%s, tolerance %.0e)\n", maxrel,
           maxrel <= LOSS_TOL ? "match" : "MISMATCH", LOSS_TOL);
    return maxrel <= LOSS_TOL ? 0 : 1;
}
