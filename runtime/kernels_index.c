/* SPDX-License-Identifier: MIT */
/*
 * kernels_index.c - GATHER_ROWS (embedding forward) and SCATTER_ADD_ROWS
 * (its backward), with i64 indices.
 *
 * Invariants:
 *   - Every index is validated before any output byte is written; the first
 *     bad one is reported with its position, its value and V.
 *   - GATHER_ROWS copies whole rows (any table strides), parallel over
 *     index positions.
 *   - SCATTER_ADD_ROWS adds source rows into a zero-filled [V, D] output in
 *     index order; the work is split over column chunks only, so each
 *     output element receives its additions in the same order whatever the
 *     thread count (deterministic). bf16 accumulates in an f32 scratch and is
 *     rounded once.
 */
#include "runtime/kernels.h"

#define GJ_K_SCOLS 256 /* columns per scatter task */

/* Checks idx[0..n) against [0, V); error naming op and the first bad one. */
static int gj_k_check_idx(const char *op, const int64_t *idx, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= V) {
            gj_rt_set_error("%s: index %lld at position %lld out of range [0, %lld) (V = %lld)",
                            op, (long long)idx[i], (long long)i, (long long)V, (long long)V);
            return -1;
        }
    }
    return 0;
}

typedef struct gj_k_gather_ctx {
    const char *table;
    int64_t ts0, ts1, D, el;
    const int64_t *idx;
    char *out;
} gj_k_gather_ctx;

static void gj_k_gather_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_gather_ctx *c = ctx;
    for (int64_t i = b; i < e; i++) {
        const char *src = c->table + c->idx[i] * c->ts0 * c->el;
        char *dst = c->out + i * c->D * c->el;
        if (c->ts1 == 1) {
            memcpy(dst, src, (size_t)(c->D * c->el));
        } else {
            for (int64_t j = 0; j < c->D; j++)
                memcpy(dst + j * c->el, src + j * c->ts1 * c->el, (size_t)c->el);
        }
    }
}

int gj_rt_k_gather_rows(gj_tensor *table, gj_tensor *idx, gj_tensor *out) {
    if (out->numel == 0 && idx->numel == 0)
        return 0;
    gj_tensor *ic = gj_rt_contiguous(idx);
    if (!ic)
        return -1;
    int rc = -1;
    const int64_t *iv = gj_rt_data_ptr(ic);
    int64_t n = ic->numel, D = table->shape[1];
    if (gj_k_check_idx("gather_rows", iv, n, table->shape[0]) != 0)
        goto done;
    if (D > 0) {
        gj_k_gather_ctx c = {.table = gj_rt_data_ptr(table), .ts0 = table->strides[0],
                             .ts1 = table->strides[1], .D = D,
                             .el = (int64_t)gj_rt_dtype_size(table->dtype), .idx = iv,
                             .out = gj_rt_data_ptr(out)};
        gj_rt_parallel_for(n, D >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / D, gj_k_gather_range, &c);
    }
    rc = 0;
done:
    gj_rt_tensor_release(ic);
    return rc;
}

typedef struct gj_k_scatter_ctx {
    gj_dtype dt;       /* source dtype */
    const void *src;   /* [n, D] contiguous */
    const int64_t *idx;
    int64_t n, D;
    void *acc;         /* [V, D]: f32 (for f32 and bf16) or f64 */
} gj_k_scatter_ctx;

static void gj_k_scatter_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_scatter_ctx *c = ctx;
    int64_t D = c->D;
    for (int64_t ch = b; ch < e; ch++) {
        int64_t j0 = ch * GJ_K_SCOLS, j1 = j0 + GJ_K_SCOLS < D ? j0 + GJ_K_SCOLS : D;
        for (int64_t i = 0; i < c->n; i++) {
            int64_t r = c->idx[i];
            switch (c->dt) {
            case GJ_F32: {
                const float *restrict s = (const float *)c->src + i * D;
                float *restrict a = (float *)c->acc + r * D;
                for (int64_t j = j0; j < j1; j++)
                    a[j] += s[j];
                break;
            }
            case GJ_BF16: {
                const uint16_t *restrict s = (const uint16_t *)c->src + i * D;
                float *restrict a = (float *)c->acc + r * D;
                for (int64_t j = j0; j < j1; j++)
                    a[j] += gj_m_bf16_to_f32(s[j]);
                break;
            }
            case GJ_F64: {
                const double *restrict s = (const double *)c->src + i * D;
                double *restrict a = (double *)c->acc + r * D;
                for (int64_t j = j0; j < j1; j++)
                    a[j] += s[j];
                break;
            }
            case GJ_I64:
                break; /* rejected by gj_rt_infer */
            }
        }
    }
}

int gj_rt_k_scatter_add_rows(const gj_rt_inst *inst, gj_tensor *src, gj_tensor *idx,
                             gj_tensor *out) {
    int64_t V = inst->len, D = out->shape[1];
    gj_tensor *sc = NULL, *ic = NULL, *acc = NULL;
    int rc = -1;
    ic = gj_rt_contiguous(idx);
    if (!ic)
        goto done;
    if (gj_k_check_idx("scatter_add_rows", gj_rt_data_ptr(ic), ic->numel, V) != 0)
        goto done;
    if (ic->numel == 0 || D == 0) {
        rc = 0;
        goto done;
    }
    sc = gj_rt_contiguous(src);
    if (!sc)
        goto done;
    acc = out;
    if (out->dtype == GJ_BF16) {
        acc = gj_rt_tensor_new(GJ_F32, 2, out->shape);
        if (!acc)
            goto done;
    }
    gj_k_scatter_ctx c = {.dt = src->dtype, .src = gj_rt_data_ptr(sc), .idx = gj_rt_data_ptr(ic),
                          .n = ic->numel, .D = D, .acc = gj_rt_data_ptr(acc)};
    int64_t chunks = (D + GJ_K_SCOLS - 1) / GJ_K_SCOLS;
    int64_t per = ic->numel * GJ_K_SCOLS;
    gj_rt_parallel_for(chunks, per >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / per, gj_k_scatter_range, &c);
    if (acc != out && gj_rt_copy_into(out, acc) != 0)
        goto done;
    rc = 0;
done:
    if (acc != out)
        gj_rt_tensor_release(acc);
    gj_rt_tensor_release(sc);
    gj_rt_tensor_release(ic);
    return rc;
}
