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
 *   gradjit-gemm-split [--pairs N] [--threads T] [--f64] [M N K TA TB ...]
 */
#include "bench/clock.h"
#include "runtime/rt.h"

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

/* One shape: prints its row. 0, or -1 (out of memory). */
static int measure(int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool f64, int threads,
                   int pairs) {
    size_t el = f64 ? 8 : 4;
    char *A = malloc((size_t)(M * K) * el), *B = malloc((size_t)(K * N) * el);
    char *C = malloc((size_t)(M * N) * el);
    double *r = malloc((size_t)pairs * sizeof *r), *tr = malloc((size_t)pairs * sizeof *tr);
    double *tc = malloc((size_t)pairs * sizeof *tc);
    int rc = -1;
    if (!A || !B || !C || !r || !tr || !tc) goto done;
    for (int64_t i = 0; i < M * K; i++) {
        if (f64) ((double *)(void *)A)[i] = (double)(i % 97) * 1e-3;
        else ((float *)(void *)A)[i] = (float)(i % 97) * 1e-3f;
    }
    for (int64_t i = 0; i < K * N; i++) {
        if (f64) ((double *)(void *)B)[i] = (double)(i % 89) * 1e-3;
        else ((float *)(void *)B)[i] = (float)(i % 89) * 1e-3f;
    }
    gj_rt_gemm_call c = {f64, ta, tb, M, N, K, 1.0, A, ta ? M : K, B, tb ? K : N, 0.0, C, N};
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
    gj_rt_gemm_split rule;
    gj_rt_gemm_split_of(ta, M, N, K, threads, &rule);
    double gf = 2.0 * (double)M * (double)N * (double)K * 1e-6;
    printf("%-5s %s%s %6lld %6lld %6lld %9.3f %9.3f %8.1f %8.1f   %.3f [%.3f-%.3f]  %s\n",
           f64 ? "dgemm" : "sgemm", ta ? "T" : "N", tb ? "T" : "N", (long long)M, (long long)N,
           (long long)K, tr[pairs / 2], tc[pairs / 2], gf / tr[pairs / 2], gf / tc[pairs / 2],
           r[pairs / 2], r[pairs / 4], r[3 * pairs / 4],
           rule.parts < 2 ? "one block" : rule.by_rows ? "rows" : "columns");
    rc = 0;
done:
    free(A), free(B), free(C), free(r), free(tr), free(tc);
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
    bool f64 = false;
    long long (*shapes)[5] = NULL;
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--pairs") && i + 1 < argc) {
            pairs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--f64")) {
            f64 = true;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: gradjit-gemm-split [--pairs N] [--threads T] [--f64] [M N K TA TB ...]\n");
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
    if (gj_rt_blas_init() != 0) {
        fprintf(stderr, "gradjit-gemm-split: %s\n", gj_last_error());
        free(shapes);
        return 1;
    }
    printf("gradjit-gemm-split | BLAS core %s | %d threads, %d blocks per GEMM | %d pairs (ABBA)\n",
           gj_rt_blas_corename(), threads, threads, pairs);
    printf("ratio = rows / columns time per pair, median [IQR] (< 1: row blocks faster); "
           "rule = the side gj_rt_gemm_split_of takes\n");
    printf("%-5s %-2s %6s %6s %6s %9s %9s %8s %8s   %-20s  %s\n", "", "op", "M", "N", "K",
           "rows ms", "cols ms", "rows GF", "cols GF", "ratio [IQR]", "rule");
    int rc = 0;
    for (int s = 0; s < (n ? n : (int)(sizeof defaults / sizeof defaults[0])); s++) {
        const long long *d = n ? shapes[s] : defaults[s];
        if (measure(d[0], d[1], d[2], d[3] != 0, d[4] != 0, f64, threads, pairs) != 0) {
            fprintf(stderr, "gradjit-gemm-split: out of memory\n");
            rc = 1;
            break;
        }
    }
    free(shapes);
    return rc;
}
