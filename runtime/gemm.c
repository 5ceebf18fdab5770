/* SPDX-License-Identifier: MIT */
/*
 * gemm.c - the one GEMM entry of gradjit: gj_rt_sgemm / dgemm / bgemm
 * check their arguments, split a GEMM into blocks of C on gradjit's pool,
 * and compute each block with the leaf gemm_choice.c picks for the GEMM's
 * shape (openblas.c or onednn.c). Eager kernels call the entry; compiled
 * programs run the very same blocks themselves (gj_rt_gemm_split_for,
 * gj_rt_gemm_block), so both compute a GEMM with the same provider, the
 * same blocks and the same split across threads: the same bits.
 *
 * Invariants:
 *   - The split is a pure function of the GEMM's shape, flags and the
 *     thread count (gj_rt_gemm_split_of / _for). OpenBLAS's kernels round
 *     some elements differently when the block changes (a 256x1024x10
 *     sgemm split into two column halves differs from one call in about 3%
 *     of its elements), so the split is part of the contract.
 *   - A block is one single-threaded call on the calling thread; a GEMM
 *     called from inside a pool task runs as one block.
 *   - A block the picked leaf cannot compute (oneDNN refusing a block
 *     shape, or out of memory) is computed by OpenBLAS: a function of the
 *     block's shape, the same in every run.
 */
#include "runtime/gemm_int.h"

#include <limits.h>

/* Checks sizes and leading dimensions (row-major: op(A) is M x K, op(B) is
 * K x N, C is M x N) and that all fit the 32-bit BLAS interface. */
static bool args_ok(const char *op, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                    int64_t lda, int64_t ldb, int64_t ldc) {
    int64_t acols = ta ? M : K, bcols = tb ? K : N;
    if (M < 0 || N < 0 || K < 0 || lda < (acols > 1 ? acols : 1) ||
        ldb < (bcols > 1 ? bcols : 1) || ldc < (N > 1 ? N : 1)) {
        gj_rt_set_error("%s: invalid arguments M=%lld N=%lld K=%lld ta=%d tb=%d lda=%lld ldb=%lld "
                        "ldc=%lld", op, (long long)M, (long long)N, (long long)K, ta, tb,
                        (long long)lda, (long long)ldb, (long long)ldc);
        return false;
    }
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
        ldc > INT_MAX) {
        gj_rt_set_error("%s: M=%lld N=%lld K=%lld (lda=%lld ldb=%lld ldc=%lld) exceed the 32-bit "
                        "BLAS interface", op, (long long)M, (long long)N, (long long)K,
                        (long long)lda, (long long)ldb, (long long)ldc);
        return false;
    }
    return true;
}

/* ------------------------------------------------------------- the split */

/* Below this many multiply-adds a GEMM is one call (OpenBLAS's own
 * threshold for going multi-threaded: 4 * 65536). */
#define GJ_RT_GEMM_SPLIT_MIN (1 << 18)
#define GJ_RT_GEMM_MIN_BLOCK 16 /* rows or columns of a block, at least */
/* With A transposed (the dW = dY^T X GEMMs of a backward), OpenBLAS runs
 * row blocks of C a little faster than column blocks: split by rows
 * whenever each block keeps at least this many rows. Zen 3, OpenBLAS
 * 0.3.21 core Zen, 2 threads, `gradjit-gemm-split` (the two ways of one
 * GEMM interleaved on the pool, rows / columns time, medians of three runs
 * of 100-200 pairs): sgemm TN 512x784x128 0.83-1.00, 256x512x128 0.94-0.97,
 * 128x512x128 0.96-0.97, 1024x1024x256 0.97, but 64x1024x512 1.11-1.13
 * (32-row blocks); dgemm alike (0.97-0.98; 64 rows 1.10). Without a
 * transpose of A neither side wins consistently (run to run 0.86-1.09), so
 * the longer side is split. Re-check on another CPU with gradjit-gemm-split. */
#define GJ_RT_GEMM_TA_ROWS 64

void gj_rt_gemm_split_of(bool ta, int64_t M, int64_t N, int64_t K, int threads,
                         gj_rt_gemm_split *sp) {
    sp->by_rows = M >= N || (ta && M >= GJ_RT_GEMM_TA_ROWS * (int64_t)threads);
    sp->len = sp->by_rows ? M : N;
    int64_t parts = threads;
    if ((double)M * (double)N * (double)K < GJ_RT_GEMM_SPLIT_MIN)
        parts = 1;
    if (parts > sp->len / GJ_RT_GEMM_MIN_BLOCK)
        parts = sp->len / GJ_RT_GEMM_MIN_BLOCK;
    sp->parts = parts < 1 ? 1 : (int)parts;
}

void gj_rt_gemm_split_for(const gj_rt_gemm_call *c, int threads, gj_rt_gemm_split *sp) {
    gj_rt_gemm_split_of(c->ta, c->M, c->N, c->K, threads, sp);
    if (c->bf16 && !c->ta && sp->parts > 1 && !sp->by_rows &&
        c->M / GJ_RT_GEMM_MIN_BLOCK >= sp->parts) {
        sp->by_rows = true; /* row blocks of A and C: dense operands (see rt.h) */
        sp->len = c->M;
    }
}

/* ------------------------------------------------------------ the blocks */

void gj_rt_gemm_block(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp, int i) {
    int64_t el = c->f64 ? 8 : 4, ael = c->bf16 ? 2 : el; /* C's, A's and B's element bytes */
    int64_t lo = sp->len * i / sp->parts, hi = sp->len * (i + 1) / sp->parts;
    int64_t M = c->M, N = c->N, ao = 0, bo = 0, co;
    if (sp->by_rows) {
        M = hi - lo;
        ao = c->ta ? lo : lo * c->lda;
        co = lo * c->ldc;
    } else {
        N = hi - lo;
        bo = c->tb ? lo * c->ldb : lo;
        co = lo;
    }
    if (M == 0 || N == 0)
        return;
    const char *A = (const char *)c->A + ao * ael, *B = (const char *)c->B + bo * ael;
    char *C = (char *)c->C + co * el;
    int use = gj_rt_gemm_pick(c, M, N, A, B, (const float *)(const void *)C);
    if (use != GJ_GEMM_USE_ONEDNN || !gj_rt_onednn_block(c, M, N, A, B, (float *)(void *)C)) {
        use = GJ_GEMM_USE_OPENBLAS;
        gj_rt_openblas_block(c, M, N, A, B, C);
    }
    gj_rt_gemm_count_block(use, c->bf16);
}

typedef struct split_ctx {
    const gj_rt_gemm_call *c;
    const gj_rt_gemm_split *sp;
} split_ctx;

static void split_range(void *vctx, int64_t b, int64_t e) {
    const split_ctx *x = vctx;
    for (int64_t i = b; i < e; i++)
        gj_rt_gemm_block(x->c, x->sp, (int)i);
}

void gj_rt_gemm_run(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp) {
    split_ctx x = {c, sp};
    if (sp->parts == 1)
        split_range(&x, 0, 1);
    else
        gj_rt_parallel_for(sp->parts, 1, split_range, &x);
}

/* ------------------------------------------------------------- the entry */

/* C = alpha op(A) op(B) + beta C for checked arguments: K == 0 scales C;
 * otherwise the blocks of the split on the pool (one block from inside a
 * pool task). */
static void gemm(const gj_rt_gemm_call *c) {
    if (c->M == 0 || c->N == 0)
        return;
    if (c->K == 0) {
        for (int64_t i = 0; i < c->M; i++)
            for (int64_t j = 0; j < c->N; j++) {
                if (c->f64) {
                    double *C = c->C;
                    C[i * c->ldc + j] = c->beta == 0 ? 0.0 : c->beta * C[i * c->ldc + j];
                } else {
                    float *C = c->C;
                    C[i * c->ldc + j] = c->beta == 0 ? 0.0f : (float)c->beta * C[i * c->ldc + j];
                }
            }
        return;
    }
    gj_rt_gemm_split sp;
    gj_rt_gemm_split_for(c, gj_rt_in_pool_task() ? 1 : gj_rt_num_threads(), &sp);
    gj_rt_gemm_run(c, &sp);
}

void gj_rt_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                 float *C, int64_t ldc) {
    if (!args_ok("sgemm", ta, tb, M, N, K, lda, ldb, ldc))
        return;
    gemm(&(gj_rt_gemm_call){false, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, false});
}

void gj_rt_dgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                 const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                 double *C, int64_t ldc) {
    if (!args_ok("dgemm", ta, tb, M, N, K, lda, ldb, ldc))
        return;
    gemm(&(gj_rt_gemm_call){true, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, false});
}

void gj_rt_bgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                 int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (!args_ok("bgemm", ta, tb, M, N, K, lda, ldb, ldc))
        return;
    gemm(&(gj_rt_gemm_call){false, ta, tb, M, N, K, 1.0, A, lda, B, ldb, beta, C, ldc, true});
}
