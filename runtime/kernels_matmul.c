/* SPDX-License-Identifier: MIT */
/*
 * kernels_matmul.c - MATMUL: [..., M, K] x [..., K, N] -> [..., M, N] with
 * broadcast batch dims; ta / tb mean the last two dims of x / y are stored
 * transposed (x is [..., K, M] when ta).
 *
 * Invariants:
 *   - f32 / f64 go to OpenBLAS (gj_rt_sgemm / gj_rt_dgemm, row-major). Each
 *     operand matrix is passed in place whenever one of its last two strides
 *     is 1 and the other a valid leading dimension (a matrix stored
 *     transposed just flips the BLAS transpose flag); otherwise the operand
 *     is first copied to a contiguous tensor.
 *   - When y is shared by the whole batch (no batch dims or all broadcast)
 *     and x's batch and row dims collapse into one strided dim, the batch is
 *     one GEMM with M' = batch*M; otherwise one GEMM per batch element.
 *   - bf16 operands go to gj_rt_bgemm as they are (bf16 products summed in
 *     f32: oneDNN's bf16 matmul, or both converted to f32 for OpenBLAS, as
 *     the GEMM provider decides) into an f32 scratch tensor, rounded once
 *     into the bf16 output. A `wide` MATMUL (the compiled programs' legal
 *     form) returns that f32 result itself, unrounded.
 *   - The output is contiguous; GEMM writes it with beta = 0, and K == 0
 *     zero-fills it.
 */
#include "runtime/kernels.h"

/* Layout of a stored matrix (rows r, cols c, strides sr, sc) for a
 * row-major BLAS: *flip = false: row-major with leading dim *ld; *flip =
 * true: it is the row-major storage of its transpose ([c, r], ld *ld).
 * false if neither (needs a contiguous copy). */
static bool gj_k_mat_layout(int64_t r, int64_t c, int64_t sr, int64_t sc, bool *flip,
                            int64_t *ld) {
    int64_t c1 = c > 1 ? c : 1, r1 = r > 1 ? r : 1;
    if ((sc == 1 || c <= 1) && (r <= 1 || sr >= c1)) {
        *flip = false;
        *ld = r <= 1 ? c1 : sr;
        return true;
    }
    if ((sr == 1 || r <= 1) && (c <= 1 || sc >= r1)) {
        *flip = true;
        *ld = c <= 1 ? r1 : sc;
        return true;
    }
    return false;
}

/* One operand prepared for BLAS: data, per-batch-dim strides of the output
 * batch shape (0 where broadcast), transpose flag and leading dim. */
typedef struct gj_k_mm_op {
    gj_tensor *t; /* new reference (the input retained, or a contiguous copy) */
    const char *data;
    int64_t bst[GJ_MAX_DIMS];
    bool trans;
    int64_t ld;
} gj_k_mm_op;

/* Prepares t (logical matrix op(t) is used with transpose flag `tr`) for a
 * batch of rank nb with shape bs. Returns 0 or -1 (OOM). */
static int gj_k_mm_prepare(gj_tensor *t, bool tr, int nb, const int64_t *bs, gj_k_mm_op *op) {
    int nd = t->ndim;
    bool flip = false;
    int64_t ld = 1;
    gj_rt_tensor_retain(t);
    op->t = t;
    if (!gj_k_mat_layout(t->shape[nd - 2], t->shape[nd - 1], t->strides[nd - 2],
                         t->strides[nd - 1], &flip, &ld)) {
        gj_tensor *c = gj_rt_contiguous(t);
        gj_rt_tensor_release(t);
        op->t = NULL;
        if (!c)
            return -1;
        op->t = t = c;
        gj_k_mat_layout(t->shape[nd - 2], t->shape[nd - 1], t->strides[nd - 2],
                        t->strides[nd - 1], &flip, &ld);
    }
    op->trans = tr != flip;
    op->ld = ld;
    op->data = gj_rt_data_ptr(t);
    int off = nb - (nd - 2);
    for (int k = 0; k < nb; k++) {
        int kt = k - off;
        op->bst[k] = (kt < 0 || t->shape[kt] != bs[k]) ? 0 : t->strides[kt];
    }
    return 0;
}

/* C[batch] = op(A) op(B) for f32, f64 or bf16 operands (dt) already
 * prepared; C is f64 for f64 operands, else f32. */
static void gj_k_mm_run(gj_dtype dt, int nb, const int64_t *bs, const gj_k_mm_op *a,
                        const gj_k_mm_op *b, int64_t M, int64_t N, int64_t K, char *c) {
    int64_t el = (int64_t)gj_rt_dtype_size(dt), cel = dt == GJ_F64 ? 8 : 4;
    int64_t nbatch = gj_rt_numel(nb, bs);
    /* Collapse the batch into M when B is shared and A is plain row-major
     * with batch strides chaining onto its row stride. */
    bool collapse = nbatch > 1 && !a->trans;
    for (int k = 0; collapse && k < nb; k++)
        collapse = b->bst[k] == 0 || bs[k] == 1;
    if (collapse) {
        int64_t want = M * a->ld;
        for (int k = nb - 1; collapse && k >= 0; k--) {
            if (bs[k] == 1)
                continue;
            collapse = a->bst[k] == want;
            want *= bs[k];
        }
    }
    if (collapse) {
        nbatch = 1;
        M *= gj_rt_numel(nb, bs);
    }
    int64_t idx[GJ_MAX_DIMS] = {0};
    for (int64_t bi = 0; bi < nbatch; bi++) {
        int64_t ao = 0, bo = 0;
        for (int k = 0; k < nb; k++) {
            ao += idx[k] * a->bst[k];
            bo += idx[k] * b->bst[k];
        }
        char *cp = c + bi * M * N * cel;
        if (dt == GJ_BF16)
            gj_rt_bgemm(a->trans, b->trans, M, N, K, (const uint16_t *)(const void *)(a->data + ao * el),
                        a->ld, (const uint16_t *)(const void *)(b->data + bo * el), b->ld, 0.0f,
                        (float *)(void *)cp, N);
        else if (dt == GJ_F32)
            gj_rt_sgemm(a->trans, b->trans, M, N, K, 1.0f, (const float *)(const void *)(a->data + ao * el),
                        a->ld, (const float *)(const void *)(b->data + bo * el), b->ld, 0.0f,
                        (float *)(void *)cp, N);
        else
            gj_rt_dgemm(a->trans, b->trans, M, N, K, 1.0, (const double *)(const void *)(a->data + ao * el),
                        a->ld, (const double *)(const void *)(b->data + bo * el), b->ld, 0.0,
                        (double *)(void *)cp, N);
        for (int k = nb - 1; k >= 0; k--) {
            if (++idx[k] < bs[k])
                break;
            idx[k] = 0;
        }
    }
}

int gj_rt_k_matmul(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *y, gj_tensor *out) {
    int nb = out->ndim - 2;
    const int64_t *bs = out->shape;
    int64_t M = out->shape[nb], N = out->shape[nb + 1];
    int64_t K = inst->ta ? x->shape[x->ndim - 2] : x->shape[x->ndim - 1];
    if (out->numel == 0)
        return 0;
    if (K == 0) { /* a sum of nothing */
        memset(gj_rt_data_ptr(out), 0, (size_t)out->numel * gj_rt_dtype_size(out->dtype));
        return 0;
    }
    int rc = -1;
    gj_tensor *of = NULL;
    gj_k_mm_op a = {0}, b = {0};
    gj_tensor *oo = out;
    if (x->dtype == GJ_BF16 && out->dtype == GJ_BF16) { /* the f32 result, then rounded */
        of = gj_rt_tensor_empty(GJ_F32, out->ndim, out->shape);
        if (!of)
            goto fail;
        oo = of;
    }
    if (gj_k_mm_prepare(x, inst->ta, nb, bs, &a) != 0 ||
        gj_k_mm_prepare(y, inst->tb, nb, bs, &b) != 0)
        goto fail;
    gj_k_mm_run(x->dtype, nb, bs, &a, &b, M, N, K, gj_rt_data_ptr(oo));
    if (of && gj_rt_copy_into(out, of) != 0)
        goto fail;
    rc = 0;
fail:
    gj_rt_tensor_release(a.t);
    gj_rt_tensor_release(b.t);
    gj_rt_tensor_release(of);
    return rc;
}
