/* SPDX-License-Identifier: MIT */
/*
 * gemm_split.c - gradjit-gemm-split: on this machine, is a GEMM faster as
 * row blocks or as column blocks of C? runtime/blas.c's gj_rt_gemm_split_of
 * answers with a fixed rule (the longer side; rows for a GEMM with A
 * transposed whose blocks keep >= 64 rows), measured on one CPU; this tool
 * measures the rule's premise on another.
 *
 * For each shape, the same GEMM runs as `threads` row blocks and as
 * `threads` column blocks on gradjit's pool (gj_rt_gemm_block: the very
 * blocks eager and compiled run), the two ways interleaved (ABBA) for
 * --pairs pairs; the row is the median of the per-pair ratios rows /
 * columns with its interquartile range (< 1: rows faster) and the side the
 * rule picks. Unlike gradjit-bench this tool uses the runtime's internal
 * API (runtime/rt.h); it only measures, it changes nothing.
 *
 * --epilogue asks whether elementwise work on a GEMM's output is cheaper
 * done on each block right after the block's GEMM, on the same thread,
 * while the block is in cache (an "epilogue"), than as a separate pass
 * over C after the whole GEMM (what eager and the compiled program do).
 * The work is a ReLU backward, out = x > 0 ? C : 0, the cheapest per
 * element, so the one where memory traffic weighs most: its ratio bounds
 * what any epilogue could save. Both ways run the rule's blocks.
 * --epilogue-fwd does the same with a forward layer's epilogue, out =
 * gelu(C + bias) per column (a Linear's bias and tanh-GELU: what the
 * compiled step's forward fuses into one pass after its GEMM).
 *
 *   gradjit-gemm-split [--pairs N] [--threads T] [--f64] [--epilogue | --epilogue-fwd]
 *                      [M N K TA TB ...]
 */
#include "bench/clock.h"
#include "runtime/gj_math.h"
#include "runtime/gemm_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The GEMM c as `parts` row (by_rows) or column blocks on the pool; ms. */
static double timed(const gj_rt_gemm_call *c, bool by_rows, int parts) {
    gj_rt_gemm_split sp = {parts, by_rows, by_rows ? c->M : c->N};
    double t0 = bench_now_ms();
    gj_rt_gemm_run(c, &sp);
    return bench_now_ms() - t0;
}

typedef struct epi_job {
    const gj_rt_gemm_call *c;
    const gj_rt_gemm_split *sp;
    const char *x; /* [M, N], the ReLU's input; or [N], the bias (fwd) */
    char *out;     /* [M, N] */
    bool gemm;     /* run the block's GEMM first */
    bool fwd;      /* gelu(C + bias) instead of the ReLU backward */
} epi_job;

static void relu_backward_block(const epi_job *j, int i) {
    const gj_rt_gemm_call *c = j->c;
    const gj_rt_gemm_split *sp = j->sp;
    int64_t lo = sp->len * i / sp->parts, hi = sp->len * (i + 1) / sp->parts;
    int64_t r0 = sp->by_rows ? lo : 0, r1 = sp->by_rows ? hi : c->M;
    int64_t c0 = sp->by_rows ? 0 : lo, c1 = sp->by_rows ? c->N : hi;
    for (int64_t r = r0; r < r1; r++) {
        int64_t o = r * c->N;
        if (j->fwd && c->f64) {
            const double *restrict g = (const double *)c->C + o;
            const double *restrict bias = (const double *)(const void *)j->x;
            double *restrict y = (double *)(void *)j->out + o;
            for (int64_t q = c0; q < c1; q++) y[q] = gj_m_gelu_d(g[q] + bias[q]);
        } else if (j->fwd) {
            const float *restrict g = (const float *)c->C + o;
            const float *restrict bias = (const float *)(const void *)j->x;
            float *restrict y = (float *)(void *)j->out + o;
            for (int64_t q = c0; q < c1; q++) y[q] = gj_m_gelu_f(g[q] + bias[q]);
        } else if (c->f64) {
            const double *restrict g = (const double *)c->C + o;
            const double *restrict x = (const double *)(const void *)j->x + o;
            double *restrict y = (double *)(void *)j->out + o;
            for (int64_t q = c0; q < c1; q++) y[q] = x[q] > 0 ? g[q] : 0.0;
        } else {
            const float *restrict g = (const float *)c->C + o;
            const float *restrict x = (const float *)(const void *)j->x + o;
            float *restrict y = (float *)(void *)j->out + o;
            for (int64_t q = c0; q < c1; q++) y[q] = x[q] > 0 ? g[q] : 0.0f;
        }
    }
}

static void epi_range(void *vctx, int64_t b, int64_t e) {
    const epi_job *j = vctx;
    for (int64_t i = b; i < e; i++) {
        if (j->gemm) gj_rt_gemm_block(j->c, j->sp, (int)i);
        relu_backward_block(j, (int)i);
    }
}

/* The GEMM c and the ReLU backward on the rule's blocks, fused (each block
 * then its epilogue) or as two passes; ms. */
static double timed_epilogue(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp, const char *x,
                             char *out, bool fused, bool fwd) {
    epi_job j = {c, sp, x, out, fused, fwd};
    double t0 = bench_now_ms();
    if (!fused) gj_rt_gemm_run(c, sp);
    gj_rt_parallel_for(sp->parts, 1, epi_range, &j);
    return bench_now_ms() - t0;
}

/* One shape: prints its row. 0, or -1 (out of memory). */
static int measure(int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool f64, int threads,
                   int pairs, bool epilogue, bool fwd) {
    size_t el = f64 ? 8 : 4;
    char *A = malloc((size_t)(M * K) * el), *B = malloc((size_t)(K * N) * el);
    char *C = malloc((size_t)(M * N) * el), *X = malloc((size_t)(M * N) * el);
    char *Y = malloc((size_t)(M * N) * el);
    double *r = malloc((size_t)pairs * sizeof *r), *tr = malloc((size_t)pairs * sizeof *tr);
    double *tc = malloc((size_t)pairs * sizeof *tc);
    int rc = -1;
    if (!A || !B || !C || !X || !Y || !r || !tr || !tc) goto done;
    for (int64_t i = 0; i < M * N; i++) { /* half the ReLU inputs positive */
        if (f64) ((double *)(void *)X)[i] = (double)(i % 101) - 50.0;
        else ((float *)(void *)X)[i] = (float)(i % 101) - 50.0f;
    }
    for (int64_t i = 0; i < M * K; i++) {
        if (f64) ((double *)(void *)A)[i] = (double)(i % 97) * 1e-3;
        else ((float *)(void *)A)[i] = (float)(i % 97) * 1e-3f;
    }
    for (int64_t i = 0; i < K * N; i++) {
        if (f64) ((double *)(void *)B)[i] = (double)(i % 89) * 1e-3;
        else ((float *)(void *)B)[i] = (float)(i % 89) * 1e-3f;
    }
    gj_rt_gemm_call c = {f64, ta, tb, M, N, K, 1.0, A, ta ? M : K, B, tb ? K : N, 0.0, C, N, false};
    gj_rt_gemm_split rule;
    gj_rt_gemm_split_of(ta, M, N, K, threads, &rule);
    double gf = 2.0 * (double)M * (double)N * (double)K * 1e-6;
    if (epilogue) {
        for (int w = 0; w < 5; w++) {
            timed_epilogue(&c, &rule, X, Y, true, fwd);
            timed_epilogue(&c, &rule, X, Y, false, fwd);
        }
        for (int p = 0; p < pairs; p++) {
            bool fused_first = (p & 1) == 0;
            double a = timed_epilogue(&c, &rule, X, Y, fused_first, fwd);
            double b = timed_epilogue(&c, &rule, X, Y, !fused_first, fwd);
            tr[p] = fused_first ? a : b; /* fused */
            tc[p] = fused_first ? b : a; /* two passes */
            r[p] = tr[p] / tc[p];
        }
        qsort(r, (size_t)pairs, sizeof *r, bench_cmp_double);
        qsort(tr, (size_t)pairs, sizeof *tr, bench_cmp_double);
        qsort(tc, (size_t)pairs, sizeof *tc, bench_cmp_double);
        printf("%-5s %s%s %6lld %6lld %6lld %9.3f %9.3f   %.3f [%.3f-%.3f]  %d %s\n",
               f64 ? "dgemm" : "sgemm", ta ? "T" : "N", tb ? "T" : "N", (long long)M,
               (long long)N, (long long)K, tr[pairs / 2], tc[pairs / 2], r[pairs / 2],
               r[pairs / 4], r[3 * pairs / 4], rule.parts,
               rule.parts < 2 ? "block" : rule.by_rows ? "row blocks" : "column blocks");
        rc = 0;
        goto done;
    }
    for (int w = 0; w < 5; w++) { /* warm-up: both ways */
        timed(&c, true, threads);
        timed(&c, false, threads);
    }
    for (int p = 0; p < pairs; p++) {
        bool rows_first = (p & 1) == 0;
        double a = timed(&c, rows_first, threads), b = timed(&c, !rows_first, threads);
        tr[p] = rows_first ? a : b;
        tc[p] = rows_first ? b : a;
        r[p] = tr[p] / tc[p];
    }
    qsort(r, (size_t)pairs, sizeof *r, bench_cmp_double);
    qsort(tr, (size_t)pairs, sizeof *tr, bench_cmp_double);
    qsort(tc, (size_t)pairs, sizeof *tc, bench_cmp_double);
    printf("%-5s %s%s %6lld %6lld %6lld %9.3f %9.3f %8.1f %8.1f   %.3f [%.3f-%.3f]  %s\n",
           f64 ? "dgemm" : "sgemm", ta ? "T" : "N", tb ? "T" : "N", (long long)M, (long long)N,
           (long long)K, tr[pairs / 2], tc[pairs / 2], gf / tr[pairs / 2], gf / tc[pairs / 2],
           r[pairs / 2], r[pairs / 4], r[3 * pairs / 4],
           rule.parts < 2 ? "one block" : rule.by_rows ? "rows" : "columns");
    rc = 0;
done:
    free(A), free(B), free(C), free(X), free(Y), free(r), free(tr), free(tc);
    return rc;
}

int main(int argc, char **argv) {
    /* The backward GEMMs of the reference workloads with A transposed (the
     * dW GEMMs), and a few without, as M N K TA TB. */
    static const long long defaults[][5] = {
        {512, 784, 128, 1, 0},  {256, 512, 128, 1, 0},  {128, 512, 128, 1, 0},
        {64, 1024, 512, 1, 0},  {512, 2048, 128, 1, 0}, {1024, 784, 256, 1, 0},
        {256, 1024, 1024, 1, 0}, {128, 512, 256, 0, 0}, {256, 1024, 1024, 0, 0},
        {1024, 768, 256, 0, 1},
    };
    int pairs = 100, threads = gj_rt_num_threads();
    bool f64 = false, epilogue = false, fwd = false;
    long long (*shapes)[5] = NULL;
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--pairs") && i + 1 < argc) {
            pairs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--f64")) {
            f64 = true;
        } else if (!strcmp(argv[i], "--epilogue")) {
            epilogue = true;
        } else if (!strcmp(argv[i], "--epilogue-fwd")) {
            epilogue = fwd = true;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: gradjit-gemm-split [--pairs N] [--threads T] [--f64] [--epilogue | "
                   "--epilogue-fwd] [M N K TA TB ...]\n");
            return 0;
        } else if (i + 4 < argc) {
            long long (*s)[5] = realloc(shapes, (size_t)(n + 1) * sizeof *shapes);
            if (!s) {
                free(shapes);
                return 1;
            }
            shapes = s;
            for (int k = 0; k < 5; k++) shapes[n][k] = atoll(argv[i + k]);
            if (shapes[n][0] < 1 || shapes[n][1] < 1 || shapes[n][2] < 1) {
                fprintf(stderr, "gradjit-gemm-split: M, N and K must be >= 1\n");
                free(shapes);
                return 1;
            }
            n++;
            i += 4;
        } else {
            fprintf(stderr, "gradjit-gemm-split: unknown or incomplete argument '%s' (--help)\n",
                    argv[i]);
            free(shapes);
            return 1;
        }
    }
    if (pairs < 10 || threads < 2) {
        fprintf(stderr, "gradjit-gemm-split: needs --pairs >= 10 and >= 2 threads\n");
        free(shapes);
        return 1;
    }
    gj_rt_set_num_threads(threads);
    if (gj_rt_openblas_init() != 0) {
        fprintf(stderr, "gradjit-gemm-split: %s\n", gj_last_error());
        free(shapes);
        return 1;
    }
    printf("gradjit-gemm-split | BLAS core %s | %d threads, %d blocks per GEMM | %d pairs (ABBA)\n",
           gj_rt_blas_corename(), threads, threads, pairs);
    if (epilogue) {
        printf("ratio = GEMM with %s on each block right after it / GEMM, then the same as "
               "its own pass, per pair, median [IQR] (< 1: the epilogue saves)\n",
               fwd ? "gelu(C + bias)" : "a ReLU backward");
        printf("%-5s %-2s %6s %6s %6s %9s %9s   %-20s  %s\n", "", "op", "M", "N", "K",
               "fused ms", "2 pass ms", "ratio [IQR]", "blocks (the rule's)");
    } else {
        printf("ratio = rows / columns time per pair, median [IQR] (< 1: row blocks faster); "
               "rule = the side gj_rt_gemm_split_of takes\n");
        printf("%-5s %-2s %6s %6s %6s %9s %9s %8s %8s   %-20s  %s\n", "", "op", "M", "N", "K",
               "rows ms", "cols ms", "rows GF", "cols GF", "ratio [IQR]", "rule");
    }
    int rc = 0;
    for (int s = 0; s < (n ? n : (int)(sizeof defaults / sizeof defaults[0])); s++) {
        const long long *d = n ? shapes[s] : defaults[s];
        if (measure(d[0], d[1], d[2], d[3] != 0, d[4] != 0, f64, threads, pairs, epilogue, fwd) !=
            0) {
            fprintf(stderr, "gradjit-gemm-split: out of memory\n");
            rc = 1;
            break;
        }
    }
    free(shapes);
    return rc;
}
