/* SPDX-License-Identifier: MIT */
/*
 * kernels_lce.c - LCE_FWD, the fused linear cross-entropy head: the mean
 * over rows of cross_entropy(h w^T + b, labels) and, when asked, its
 * gradients for a unit upstream gradient, without ever holding the
 * rows x vocabulary logits.
 *
 * Dimension legend: N rows (positions), C the model width, V the
 * vocabulary, R the rows of one chunk.
 *
 * Algorithm, per chunk of R rows (gj_rt_lce_chunk_rows: chunks of equal
 * size whose f32 logits take at most GJ_LCE_CHUNK_BYTES; fewer chunks
 * mean fewer passes of the gw GEMM over gw, V x C, which reads and writes
 * it whole):
 *   1. L[R, V] = h[rows] w^T (+ b)             one GEMM of the GEMM layer
 *   2. each row (kernels_composite.c's CE row, rows in parallel): its
 *      loss term lse - L[label]; with gradients, L becomes in place
 *      (softmax - onehot) / n, n the rows not ignored (an ignored row has
 *      term 0 and gradient 0)
 *   3. gh[rows] = L w                          (NN GEMM)
 *      gw = L^T h[rows]  (+ gw, after the first chunk)   (TN GEMM)
 *      gb += the column sums of L, rows in order
 * The loss is the N terms summed as CE_FWD sums them, divided by n.
 * Three GEMMs of the unfused head's size; the gradient is made in the
 * forward, as Liger's kernel does, and the backward only scales it.
 *
 * Invariants:
 *   - Every label is checked (in [0, V), or the ignored label) before
 *     anything is written.
 *   - The chunking depends on (N, V) alone and every sum has a fixed
 *     order, so eager and a compiled program (which calls gj_rt_lce_run
 *     with its buffers) give the same bits at any thread count.
 *   - With one chunk, unit upstream gradient and no ignored row, the
 *     logits, the loss and the logits' gradient are the unfused head's
 *     (matmul, CE_FWD, CE_BWD) bit for bit; the GEMMs of the gradients
 *     then differ only in how the GEMM layer splits rows.
 *   - bf16: GEMM operands bf16, products and statistics in f32 (L is f32;
 *     its gradient is rounded to bf16 for the two gradient GEMMs); gh, gw
 *     and gb are made in f32 and each rounded once. f64: all in double.
 */
#include "runtime/kernels.h"

#define GJ_LCE_CHUNK_BYTES ((int64_t)64 << 20)

static _Atomic int64_t g_test_chunk_bytes;

void gj_rt_lce_test_chunk_bytes(int64_t bytes) { g_test_chunk_bytes = bytes > 0 ? bytes : 0; }

int64_t gj_rt_lce_chunk_rows(int64_t N, int64_t V) {
    int64_t cap = g_test_chunk_bytes > 0 ? g_test_chunk_bytes : GJ_LCE_CHUNK_BYTES;
    int64_t most = cap / (4 * (V > 0 ? V : 1)); /* rows that fit */
    if (most < 1)
        most = 1;
    if (N <= most)
        return N > 0 ? N : 1;
    /* equal chunks, rounded up to 16 rows where that still fits */
    int64_t n = (N + most - 1) / most, r = (N + n - 1) / n;
    if (r >= 16 && r + (16 - r % 16) % 16 <= most)
        r += (16 - r % 16) % 16;
    return r;
}

typedef struct lce_work {
    const gj_rt_lce *a;
    gj_dtype ct;        /* compute type of L: f32 (f32, bf16) or f64 */
    size_t es;          /* its element size */
    void *L;            /* [R, V] */
    uint16_t *L16;      /* bf16 with gradients: L rounded, [R, V] */
    float *bf;          /* bf16 with a bias: b in f32 [V] */
    float *hf;          /* bf16: gh of a chunk in f32 [R, C] */
    float *gwf;         /* bf16: gw in f32 [V, C] */
    double *gbacc;      /* gb's column sums [V] */
    double *terms;      /* [N] */
    double scale;       /* 1 / n */
    bool grad;
    int64_t r0, R;      /* the chunk: rows [r0, r0 + R) */
} lce_work;

/* Step 2 over rows [b, e) of the chunk: the bias, then the CE row. */
static void lce_rows(void *ctx, int64_t b, int64_t e) {
    const lce_work *w = ctx;
    const gj_rt_lce *a = w->a;
    for (int64_t r = b; r < e; r++) {
        char *row = (char *)w->L + (size_t)(r * a->V) * w->es;
        if (a->b && w->ct == GJ_F64) {
            double *x = (double *)row;
            const double *bb = a->b;
            for (int64_t j = 0; j < a->V; j++)
                x[j] = x[j] + bb[j];
        } else if (a->b) {
            float *x = (float *)row;
            const float *bb = w->bf ? w->bf : a->b;
            for (int64_t j = 0; j < a->V; j++)
                x[j] = x[j] + bb[j];
        }
        int64_t lab = a->labels[w->r0 + r];
        gj_rt_k_ce_row(w->ct, row, a->V, lab == a->ignore ? -1 : lab, w->scale, w->grad,
                       &w->terms[w->r0 + r]);
        if (w->L16)
            gj_rt_k_round_bf16(w->L16 + r * a->V, (const float *)row, a->V);
    }
}

/* gb's column sums over the chunk, columns [b, e). */
static void lce_colsums(void *ctx, int64_t b, int64_t e) {
    const lce_work *w = ctx;
    int64_t V = w->a->V;
    for (int64_t r = 0; r < w->R; r++) {
        if (w->ct == GJ_F64) {
            const double *x = (const double *)w->L + r * V;
            for (int64_t j = b; j < e; j++)
                w->gbacc[j] += x[j];
        } else {
            const float *x = (const float *)w->L + r * V;
            for (int64_t j = b; j < e; j++)
                w->gbacc[j] += (double)x[j];
        }
    }
}

/* C[M, N] (+)= op(A) op(B) in the work's dtype (bf16 operands: f32 C). */
static void lce_gemm(const lce_work *w, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                     const void *A, int64_t lda, const void *B, int64_t ldb, bool acc, void *C,
                     int64_t ldc) {
    switch (w->a->dt) {
    case GJ_F64:
        gj_rt_dgemm(ta, tb, M, N, K, 1.0, A, lda, B, ldb, acc ? 1.0 : 0.0, C, ldc);
        break;
    case GJ_BF16:
        gj_rt_bgemm(ta, tb, M, N, K, A, lda, B, ldb, acc ? 1.0f : 0.0f, C, ldc);
        break;
    default:
        gj_rt_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, acc ? 1.0f : 0.0f, C, ldc);
        break;
    }
}

typedef struct round_work {
    uint16_t *dst;
    const float *src;
} round_work;

static void round_range(void *ctx, int64_t b, int64_t e) {
    const round_work *r = ctx;
    gj_rt_k_round_bf16(r->dst + b, r->src + b, e - b);
}

/* dst = src rounded to bf16, on the pool. */
static void round_bf16(uint16_t *dst, const float *src, int64_t n) {
    round_work r = {dst, src};
    gj_rt_parallel_for(n, GJ_K_GRAIN, round_range, &r);
}

/* Steps 1-3 of the chunk at rows [w->r0, w->r0 + w->R). */
static void lce_chunk(lce_work *w, bool first) {
    const gj_rt_lce *a = w->a;
    size_t in_es = a->dt == GJ_F64 ? 8 : a->dt == GJ_BF16 ? 2 : 4;
    const char *h = (const char *)a->h + (size_t)(w->r0 * a->C) * in_es;
    lce_gemm(w, false, true, w->R, a->V, a->C, h, a->C, a->w, a->C, false, w->L, a->V);
    gj_rt_parallel_for(w->R, 1, lce_rows, w);
    if (!w->grad)
        return;
    const void *dl = w->L16 ? (const void *)w->L16 : w->L;
    char *gh = (char *)a->gh + (size_t)(w->r0 * a->C) * in_es;
    lce_gemm(w, false, false, w->R, a->C, a->V, dl, a->V, a->w, a->C, false, w->hf ? (void *)w->hf : gh,
             a->C);
    if (w->hf)
        round_bf16((uint16_t *)gh, w->hf, w->R * a->C);
    lce_gemm(w, true, false, a->V, a->C, w->R, dl, a->V, h, a->C, !first,
             w->gwf ? (void *)w->gwf : a->gw, a->C);
    if (w->gbacc)
        gj_rt_parallel_for(a->V, 256, lce_colsums, w);
}

static int check_labels(const gj_rt_lce *a, int64_t *n_valid) {
    int64_t n = 0;
    for (int64_t r = 0; r < a->N; r++) {
        int64_t l = a->labels[r];
        if (l == a->ignore)
            continue;
        if (l < 0 || l >= a->V) {
            gj_rt_set_error("lce_fwd: label %lld at row %lld out of range [0, %lld) (V = %lld, "
                            "ignored label %lld)", (long long)l, (long long)r, (long long)a->V,
                            (long long)a->V, (long long)a->ignore);
            return -1;
        }
        n++;
    }
    *n_valid = n;
    return 0;
}

/* The scratch of w (sizes in bytes in sz[]); 0 or -1 (OOM). */
enum { S_L, S_L16, S_BF, S_HF, S_GWF, S_GB, S_TERMS, S_COUNT };

static int lce_alloc(lce_work *w, size_t sz[S_COUNT], void *p[S_COUNT]) {
    const gj_rt_lce *a = w->a;
    bool bf = a->dt == GJ_BF16;
    int64_t R = gj_rt_lce_chunk_rows(a->N, a->V);
    memset(sz, 0, S_COUNT * sizeof sz[0]);
    sz[S_L] = (size_t)(R * a->V) * w->es;
    sz[S_L16] = bf && w->grad ? (size_t)(R * a->V) * 2 : 0;
    sz[S_BF] = bf && a->b ? (size_t)a->V * 4 : 0;
    sz[S_HF] = bf && w->grad ? (size_t)(R * a->C) * 4 : 0;
    sz[S_GWF] = bf && w->grad ? (size_t)(a->V * a->C) * 4 : 0;
    sz[S_GB] = w->grad && a->b ? (size_t)a->V * sizeof(double) : 0;
    sz[S_TERMS] = (size_t)a->N * sizeof(double);
    for (int i = 0; i < S_COUNT; i++) {
        if (sz[i] && !(p[i] = gj_rt_k_scratch(sz[i])))
            return -1;
    }
    w->L = p[S_L];
    w->L16 = p[S_L16];
    w->bf = p[S_BF];
    w->hf = p[S_HF];
    w->gwf = p[S_GWF];
    w->gbacc = p[S_GB];
    w->terms = p[S_TERMS];
    if (w->gbacc)
        memset(w->gbacc, 0, sz[S_GB]);
    if (w->bf)
        for (int64_t j = 0; j < a->V; j++)
            w->bf[j] = gj_m_bf16_to_f32(((const uint16_t *)a->b)[j]);
    return 0;
}

/* The outputs that are made in f32 or double and rounded once. */
static void lce_finish(const lce_work *w) {
    const gj_rt_lce *a = w->a;
    if (w->gwf)
        round_bf16(a->gw, w->gwf, a->V * a->C);
    if (w->gbacc)
        for (int64_t j = 0; j < a->V; j++)
            gj_rt_k_store(a->gb, a->dt, j, w->gbacc[j]);
}

int gj_rt_lce_run(const gj_rt_lce *a) {
    int64_t n = 0;
    if (check_labels(a, &n) != 0)
        return -1;
    lce_work w = {.a = a, .ct = a->dt == GJ_F64 ? GJ_F64 : GJ_F32, .grad = a->gh != NULL};
    w.es = w.ct == GJ_F64 ? sizeof(double) : sizeof(float);
    w.scale = n > 0 ? 1.0 / (double)n : 0.0;
    size_t sz[S_COUNT] = {0};
    void *p[S_COUNT] = {0};
    int rc = -1;
    if (lce_alloc(&w, sz, p) != 0)
        goto done;
    int64_t R = gj_rt_lce_chunk_rows(a->N, a->V);
    for (int64_t r0 = 0; r0 < a->N; r0 += R) {
        w.r0 = r0;
        w.R = a->N - r0 < R ? a->N - r0 : R;
        lce_chunk(&w, r0 == 0);
    }
    lce_finish(&w);
    double loss = gj_rt_k_ce_sum_terms(w.terms, a->N) / (double)n;
    gj_rt_k_store(a->loss, w.ct, 0, loss);
    rc = 0;
done:
    for (int i = 0; i < S_COUNT; i++)
        if (p[i])
            gj_rt_k_scratch_free(p[i], sz[i]);
    return rc;
}

int gj_rt_k_lce(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs) {
    int n_in = inst->n_in, rc = -1;
    gj_tensor *c[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < n_in; i++)
        if (!(c[i] = gj_rt_contiguous(in[i])))
            goto done;
    gj_rt_lce a = {.dt = in[0]->dtype,
                   .N = in[0]->shape[0],
                   .C = in[0]->shape[1],
                   .V = in[1]->shape[0],
                   .ignore = inst->start,
                   .h = gj_rt_data_ptr(c[0]),
                   .w = gj_rt_data_ptr(c[1]),
                   .labels = gj_rt_data_ptr(c[2]),
                   .b = n_in == 4 ? gj_rt_data_ptr(c[3]) : NULL,
                   .loss = gj_rt_data_ptr(outs[0])};
    if (inst->keepdim) {
        a.gh = gj_rt_data_ptr(outs[1]);
        a.gw = gj_rt_data_ptr(outs[2]);
        a.gb = n_in == 4 ? gj_rt_data_ptr(outs[3]) : NULL;
    }
    rc = gj_rt_lce_run(&a);
done:
    for (int i = 0; i < 4; i++)
        gj_rt_tensor_release(c[i]);
    return rc;
}
