/*
 * ceiling.c - the machine's own ceiling, measured at start of a --paired
 * run, and each workload's lower bound (BENCHMARKS.md: "the ceiling is
 * measured, not assumed").
 *
 * bound = sum over the compiled program's GEMM steps of the best time this
 *         machine does that GEMM in: on all threads, or single-threaded
 *         with every core doing one such GEMM at once (time / cores)
 *       + the program's compulsory bytes (inputs read once, new .grad
 *         written once) at the measured copy bandwidth.
 * The GEMM list comes from the program itself (gj_compiled_autograd_
 * last_program), so the bound follows whatever the compiler emits. GEMMs
 * run through gj_matmul (eager, no grad), with the same transposes; a shape
 * met again in the same workload is timed once.
 */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double c_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void bench_ceiling_measure(bench_ceiling *c, int threads) {
    memset(c, 0, sizeof *c);
    c->threads = threads;
    size_t n = (size_t)64 << 20; /* 64 MiB each way: well past the caches */
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a);
        free(b);
        return;
    }
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t0 = c_now_ms();
        memcpy(b, a, n);
        double t = c_now_ms() - t0;
        if (t < best)
            best = t;
        a[r] = b[n - 1 - (size_t)r]; /* keep the copies */
    }
    /* a copy reads n and writes n bytes */
    c->copy_gbs = 2.0 * (double)n / (best * 1e6);
    free(a);
    free(b);
}

/* Best-of-5 milliseconds of one GEMM of g's shape on the current threads. */
static double time_gemm(const gj_ca_gemm *g) {
    gj_dtype dt = g->dtype;
    int64_t bt = g->batch;
    int64_t as[3] = {bt, g->ta ? g->K : g->M, g->ta ? g->M : g->K};
    int64_t bs[3] = {bt, g->tb ? g->N : g->K, g->tb ? g->K : g->N};
    double best = -1;
    gj_no_grad_push();
    gj_scope_push();
    gj_tensor *A = gj_randn(dt, bt > 1 ? 3 : 2, bt > 1 ? as : as + 1, 1.0);
    gj_tensor *B = gj_randn(dt, bt > 1 ? 3 : 2, bt > 1 ? bs : bs + 1, 1.0);
    int d0 = bt > 1 ? 1 : 0;
    if (A && g->ta)
        A = gj_transpose(A, d0, d0 + 1);
    if (B && g->tb)
        B = gj_transpose(B, d0, d0 + 1);
    if (!A || !B)
        goto out;
    best = 1e30;
    for (int r = 0; r < 7; r++) {
        gj_scope_push();
        double t0 = c_now_ms();
        gj_tensor *C = gj_matmul(A, B);
        double t = c_now_ms() - t0;
        gj_scope_pop();
        if (!C) {
            best = -1;
            goto out;
        }
        if (r >= 2 && t < best)
            best = t;
    }
out:
    gj_scope_pop();
    gj_no_grad_pop();
    return best;
}

void bench_ceiling_bound(bench_ceiling *c, bench_paired_result *r) {
    gj_ca_program_info pi;
    if (gj_compiled_autograd_last_program(&pi) != 0)
        return;
    int nt = c->threads > 0 ? c->threads : 1, n = pi.n_gemms < GJ_CA_MAX_GEMMS ? pi.n_gemms
                                                                         : GJ_CA_MAX_GEMMS;
    double gemm_ms = 0;
    int first = c->n_shapes;
    for (int i = 0; i < n; i++) {
        const gj_ca_gemm *g = &pi.gemms[i];
        double fl = 2.0 * (double)g->M * (double)g->N * (double)g->K * (double)g->batch;
        const bench_gemm_rate *seen = NULL; /* the same shape earlier in this workload */
        for (int j = first; j < c->n_shapes && !seen; j++) {
            const gj_ca_gemm *h = &c->shapes[j].g;
            if (h->dtype == g->dtype && h->ta == g->ta && h->tb == g->tb && h->M == g->M &&
                h->N == g->N && h->K == g->K && h->batch == g->batch)
                seen = &c->shapes[j];
        }
        if (seen) {
            double r1 = seen->gflops_1 * nt, rn = seen->gflops_n;
            gemm_ms += fl / ((r1 > rn ? r1 : rn) * 1e6);
            continue;
        }
        double tn = time_gemm(g);
        gj_set_num_threads(1);
        double t1 = time_gemm(g);
        gj_set_num_threads(c->threads);
        if (tn < 0 || t1 < 0)
            return;
        gemm_ms += tn < t1 / nt ? tn : t1 / nt;
        if (c->n_shapes < BENCH_MAX_SHAPES) {
            bench_gemm_rate *s = &c->shapes[c->n_shapes++];
            snprintf(s->workload, sizeof s->workload, "%s", r->wl->id);
            s->g = *g;
            s->gflops_1 = fl / (t1 * 1e6);
            s->gflops_n = fl / (tn * 1e6);
        }
    }
    double bytes = (double)(pi.input_bytes + pi.output_bytes);
    r->gemm_gflop = pi.gemm_flops * 1e-9;
    r->bytes_mb = bytes * 1e-6;
    r->bound_ms = gemm_ms + (c->copy_gbs > 0 ? bytes / (c->copy_gbs * 1e6) : 0);
}

void bench_ceiling_print(const bench_ceiling *c) {
    printf("ceiling: copy bandwidth %.1f GB/s (memcpy of 64 MiB, best of 5); GEMM rates per "
           "workload shape follow the table\n\n",
           c->copy_gbs);
}

void bench_ceiling_print_shapes(const bench_ceiling *c) {
    if (c->n_shapes == 0)
        return;
    printf("\nGEMM steps of each compiled backward at this machine's rates (GFLOP/s, best of 5):\n");
    printf("%-4s %-3s %6s %6s %6s %6s %9s %9s\n", "id", "op", "M", "N", "K", "batch",
           "1 thread", "all");
    for (int i = 0; i < c->n_shapes; i++) {
        const bench_gemm_rate *s = &c->shapes[i];
        printf("%-4s %c%c  %6lld %6lld %6lld %6lld %9.1f %9.1f\n", s->workload,
               s->g.ta ? 'T' : 'N', s->g.tb ? 'T' : 'N', (long long)s->g.M, (long long)s->g.N,
               (long long)s->g.K, (long long)s->g.batch, s->gflops_1, s->gflops_n);
    }
}

void bench_ceiling_json(FILE *f, const bench_ceiling *c) {
    fprintf(f, "{\"copy_gbs\": %.3f, \"gemms\": [", c->copy_gbs);
    for (int i = 0; i < c->n_shapes; i++) {
        const bench_gemm_rate *s = &c->shapes[i];
        fprintf(f,
                "%s\n    {\"workload\": \"%s\", \"ta\": %s, \"tb\": %s, \"M\": %lld, \"N\": %lld, "
                "\"K\": %lld, \"batch\": %lld, \"gflops_1\": %.2f, \"gflops_all\": %.2f}",
                i ? "," : "", s->workload, s->g.ta ? "true" : "false", s->g.tb ? "true" : "false",
                (long long)s->g.M, (long long)s->g.N, (long long)s->g.K, (long long)s->g.batch,
                s->gflops_1, s->gflops_n);
    }
    fprintf(f, "]}");
}

void bench_ceiling_free(bench_ceiling *c) { memset(c, 0, sizeof *c); }
