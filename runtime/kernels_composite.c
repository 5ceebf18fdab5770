/* SPDX-License-Identifier: MIT */
/*
 * kernels_composite.c - the hand-fused composites over the last axis:
 * SOFTMAX, LOG_SOFTMAX, their backwards, LN_FWD / LN_BWD (layer norm
 * without affine) and CE_FWD / CE_BWD (cross-entropy with integer labels,
 * mean over rows), in the style of llm.c: one row at a time, a few passes
 * over a row that stays in cache, rows in parallel.
 *
 * Dimension legend: R = rows (product of all dims but the last), C = the
 * last dim; for CE, N = rows of logits and K = classes.
 *
 * Invariants:
 *   - f32 and f64 run in place on contiguous inputs (non-contiguous inputs
 *     are copied first). bf16 converts its inputs to f32 tensors, runs the
 *     f32 kernel into f32 outputs and rounds each output once.
 *   - Row reductions (max, sums, dot products) use 8 independent lanes in
 *     double, combined in a fixed tree; the work is split over rows only,
 *     so results do not depend on the thread count. exp/log are gj_math.h.
 *   - CE labels are all validated before any output is written; the loss
 *     is the sum of per-row terms (computed in double) taken as a SUM
 *     kernel takes a run (8 lanes, combined in the fixed tree), divided by
 *     N (N = 0 gives NaN, like a mean of nothing).
 */
#include "runtime/kernels.h"

#define GJ_K_CTILE 512 /* stack tile of exp values */

/* --------------------------------------------------------- row kernels */

#define GJ_K_ROWS(SFX, T, EXP, LOG)                                                            \
    GJ_K_INLINE double rsum_##SFX(const T *x, int64_t n) {                                      \
        double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                 \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            for (int k = 0; k < 8; k++)                                                         \
                l[k] += (double)x[i + k];                                                       \
        for (int k = 0; i < n; i++, k++)                                                        \
            l[k] += (double)x[i];                                                               \
        return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));               \
    }                                                                                           \
    GJ_K_INLINE double rdot_##SFX(const T *x, const T *y, int64_t n) {                          \
        double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                 \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            for (int k = 0; k < 8; k++)                                                         \
                l[k] += (double)x[i + k] * (double)y[i + k];                                    \
        for (int k = 0; i < n; i++, k++)                                                        \
            l[k] += (double)x[i] * (double)y[i];                                                \
        return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));               \
    }                                                                                           \
    GJ_K_INLINE T rmax_##SFX(const T *x, int64_t n) {                                           \
        T l[8];                                                                                 \
        for (int k = 0; k < 8; k++)                                                             \
            l[k] = (T)-__builtin_inf();                                                         \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8)                                                              \
            for (int k = 0; k < 8; k++) {                                                       \
                T v = x[i + k];                                                                 \
                l[k] = (v > l[k] || v != v) ? v : l[k];                                         \
            }                                                                                   \
        for (int k = 0; i < n; i++, k++)                                                        \
            l[k] = (x[i] > l[k] || x[i] != x[i]) ? x[i] : l[k];                                 \
        T m = l[0];                                                                             \
        for (int k = 1; k < 8; k++)                                                             \
            m = (l[k] > m || l[k] != l[k]) ? l[k] : m;                                          \
        return m;                                                                               \
    }                                                                                           \
    /* sum_i exp(x[i] - m), through a stack tile. */                                            \
    GJ_K_INLINE double rsumexp_##SFX(const T *restrict x, T m, int64_t n) {                     \
        _Alignas(64) T buf[GJ_K_CTILE];                                                          \
        double s = 0.0;                                                                         \
        for (int64_t t = 0; t < n; t += GJ_K_CTILE) {                                           \
            int64_t w = n - t < GJ_K_CTILE ? n - t : GJ_K_CTILE;                                \
            for (int64_t i = 0; i < w; i++)                                                     \
                buf[i] = EXP(x[t + i] - m);                                                     \
            s += rsum_##SFX(buf, w);                                                            \
        }                                                                                       \
        return s;                                                                               \
    }                                                                                           \
    /* y = softmax(x): max, exp and sum, scale. */                                              \
    GJ_K_CLONES static void softmax_row_##SFX(const T *restrict x, T *restrict y, int64_t C) { \
        T m = rmax_##SFX(x, C);                                                                 \
        for (int64_t i = 0; i < C; i++)                                                         \
            y[i] = EXP(x[i] - m);                                                               \
        T inv = (T)(1.0 / rsum_##SFX(y, C));                                                    \
        for (int64_t i = 0; i < C; i++)                                                         \
            y[i] = y[i] * inv;                                                                  \
    }                                                                                           \
    /* y = x - max - log(sum exp(x - max)). */                                                  \
    GJ_K_CLONES static void log_softmax_row_##SFX(const T *restrict x, T *restrict y,          \
                                                  int64_t C) {                                  \
        T m = rmax_##SFX(x, C);                                                                 \
        T ls = (T)gj_m_log_d(rsumexp_##SFX(x, m, C));                                           \
        for (int64_t i = 0; i < C; i++)                                                         \
            y[i] = (x[i] - m) - ls;                                                             \
    }                                                                                           \
    /* gx = y * (gy - sum(gy*y)). */                                                            \
    GJ_K_CLONES static void softmax_bwd_row_##SFX(const T *restrict y, const T *restrict gy,   \
                                                  T *restrict gx, int64_t C) {                  \
        T d = (T)rdot_##SFX(gy, y, C);                                                          \
        for (int64_t i = 0; i < C; i++)                                                         \
            gx[i] = y[i] * (gy[i] - d);                                                         \
    }                                                                                           \
    /* gx = gy - exp(y) * sum(gy). */                                                           \
    GJ_K_CLONES static void log_softmax_bwd_row_##SFX(const T *restrict y,                     \
                                                      const T *restrict gy, T *restrict gx,     \
                                                      int64_t C) {                              \
        T s = (T)rsum_##SFX(gy, C);                                                             \
        for (int64_t i = 0; i < C; i++)                                                         \
            gx[i] = gy[i] - EXP(y[i]) * s;                                                      \
    }                                                                                           \
    /* xhat = (x - mean) * rstd, rstd = 1/sqrt(biased var + eps); two-pass var. */              \
    GJ_K_CLONES static void ln_fwd_row_##SFX(const T *restrict x, T *restrict xh,              \
                                             T *restrict mean, T *restrict rstd, int64_t C,     \
                                             double eps) {                                      \
        double mu = rsum_##SFX(x, C) / (double)C;                                               \
        double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                 \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= C; i += 8)                                                              \
            for (int k = 0; k < 8; k++) {                                                       \
                double dv = (double)x[i + k] - mu;                                              \
                l[k] += dv * dv;                                                                \
            }                                                                                   \
        for (int k = 0; i < C; i++, k++) {                                                      \
            double dv = (double)x[i] - mu;                                                      \
            l[k] += dv * dv;                                                                    \
        }                                                                                       \
        double var = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) /     \
                     (double)C;                                                                 \
        double rs = 1.0 / gj_m_sqrt_d(var + eps);                                               \
        T m = (T)mu, r = (T)rs;                                                                 \
        for (int64_t j = 0; j < C; j++)                                                         \
            xh[j] = (x[j] - m) * r;                                                             \
        *mean = m;                                                                              \
        *rstd = r;                                                                              \
    }                                                                                           \
    /* gx = rstd * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * rstd. */          \
    GJ_K_CLONES static void ln_bwd_row_##SFX(const T *restrict x, T mean, T rstd,              \
                                             const T *restrict g, T *restrict gx, int64_t C) {  \
        double l[8] = {0, 0, 0, 0, 0, 0, 0, 0}, q[8] = {0, 0, 0, 0, 0, 0, 0, 0};                \
        int64_t i = 0;                                                                          \
        for (; i + 8 <= C; i += 8)                                                              \
            for (int k = 0; k < 8; k++) {                                                       \
                T xh = (x[i + k] - mean) * rstd;                                                \
                l[k] += (double)g[i + k];                                                       \
                q[k] += (double)g[i + k] * (double)xh;                                          \
            }                                                                                   \
        for (int k = 0; i < C; i++, k++) {                                                      \
            T xh = (x[i] - mean) * rstd;                                                        \
            l[k] += (double)g[i];                                                               \
            q[k] += (double)g[i] * (double)xh;                                                  \
        }                                                                                       \
        T a = (T)((((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) /        \
                  (double)C);                                                                   \
        T b = (T)((((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]))) /        \
                  (double)C);                                                                   \
        for (int64_t j = 0; j < C; j++) {                                                       \
            T xh = (x[j] - mean) * rstd;                                                        \
            gx[j] = rstd * ((g[j] - a) - xh * b);                                               \
        }                                                                                       \
    }                                                                                           \
    /* lse of one row (double); *term = lse - x[label]. */                                      \
    GJ_K_CLONES static double ce_fwd_row_##SFX(const T *restrict x, int64_t label, int64_t K,  \
                                               double *term) {                                  \
        T m = rmax_##SFX(x, K);                                                                 \
        double lse = (double)m + gj_m_log_d(rsumexp_##SFX(x, m, K));                            \
        *term = lse - (double)x[label];                                                         \
        return lse;                                                                             \
    }                                                                                           \
    /* gx = (exp(x - lse) - onehot(label)) * scale. */                                          \
    GJ_K_CLONES static void ce_bwd_row_##SFX(const T *restrict x, T lse, int64_t label,        \
                                             T scale, T *restrict gx, int64_t K) {              \
        for (int64_t i = 0; i < K; i++)                                                         \
            gx[i] = EXP(x[i] - lse) * scale;                                                    \
        gx[label] -= scale;                                                                     \
    }                                                                                           \
    /* x = (exp(x - lse) - onehot(label)) * scale, in place (ce_bwd_row's formula). */          \
    GJ_K_CLONES static void ce_grad_row_##SFX(T *x, T lse, int64_t label, T scale, int64_t K) { \
        for (int64_t i = 0; i < K; i++)                                                         \
            x[i] = EXP(x[i] - lse) * scale;                                                     \
        x[label] -= scale;                                                                      \
    }

GJ_K_ROWS(f, float, gj_m_exp_f, gj_m_log_f)
GJ_K_ROWS(d, double, gj_m_exp_d, gj_m_log_d)

/* ------------------------------------------------------------- drivers */

typedef struct gj_k_comp_ctx {
    gj_rt_prim prim;
    gj_dtype dt; /* f32 or f64 */
    int64_t C;
    double eps;
    const void *a, *b, *c, *d; /* inputs (contiguous) */
    const int64_t *labels;
    void *o0, *o1, *o2; /* outputs */
    double *terms;      /* CE_FWD per-row loss terms */
    double scale;       /* CE_BWD g / N */
} gj_k_comp_ctx;

#define GJ_K_ROW(P, r, C) ((P) + (r) * (C))

static void gj_k_comp_range_f(const gj_k_comp_ctx *c, int64_t b, int64_t e) {
    int64_t C = c->C;
    const float *A = c->a, *B = c->b, *Cc = c->c, *D = c->d;
    float *O0 = c->o0, *O1 = c->o1, *O2 = c->o2;
    for (int64_t r = b; r < e; r++) {
        switch (c->prim) {
        case GJ_P_SOFTMAX: softmax_row_f(GJ_K_ROW(A, r, C), GJ_K_ROW(O0, r, C), C); break;
        case GJ_P_LOG_SOFTMAX: log_softmax_row_f(GJ_K_ROW(A, r, C), GJ_K_ROW(O0, r, C), C); break;
        case GJ_P_SOFTMAX_BWD:
            softmax_bwd_row_f(GJ_K_ROW(A, r, C), GJ_K_ROW(B, r, C), GJ_K_ROW(O0, r, C), C);
            break;
        case GJ_P_LOG_SOFTMAX_BWD:
            log_softmax_bwd_row_f(GJ_K_ROW(A, r, C), GJ_K_ROW(B, r, C), GJ_K_ROW(O0, r, C), C);
            break;
        case GJ_P_LN_FWD:
            ln_fwd_row_f(GJ_K_ROW(A, r, C), GJ_K_ROW(O0, r, C), O1 + r, O2 + r, C, c->eps);
            break;
        case GJ_P_LN_BWD:
            ln_bwd_row_f(GJ_K_ROW(A, r, C), B[r], Cc[r], GJ_K_ROW(D, r, C), GJ_K_ROW(O0, r, C), C);
            break;
        case GJ_P_CE_FWD:
            O1[r] = (float)ce_fwd_row_f(GJ_K_ROW(A, r, C), c->labels[r], C, &c->terms[r]);
            break;
        case GJ_P_CE_BWD:
            ce_bwd_row_f(GJ_K_ROW(A, r, C), B[r], c->labels[r], (float)c->scale,
                         GJ_K_ROW(O0, r, C), C);
            break;
        default: break;
        }
    }
}

static void gj_k_comp_range_d(const gj_k_comp_ctx *c, int64_t b, int64_t e) {
    int64_t C = c->C;
    const double *A = c->a, *B = c->b, *Cc = c->c, *D = c->d;
    double *O0 = c->o0, *O1 = c->o1, *O2 = c->o2;
    for (int64_t r = b; r < e; r++) {
        switch (c->prim) {
        case GJ_P_SOFTMAX: softmax_row_d(GJ_K_ROW(A, r, C), GJ_K_ROW(O0, r, C), C); break;
        case GJ_P_LOG_SOFTMAX: log_softmax_row_d(GJ_K_ROW(A, r, C), GJ_K_ROW(O0, r, C), C); break;
        case GJ_P_SOFTMAX_BWD:
            softmax_bwd_row_d(GJ_K_ROW(A, r, C), GJ_K_ROW(B, r, C), GJ_K_ROW(O0, r, C), C);
            break;
        case GJ_P_LOG_SOFTMAX_BWD:
            log_softmax_bwd_row_d(GJ_K_ROW(A, r, C), GJ_K_ROW(B, r, C), GJ_K_ROW(O0, r, C), C);
            break;
        case GJ_P_LN_FWD:
            ln_fwd_row_d(GJ_K_ROW(A, r, C), GJ_K_ROW(O0, r, C), O1 + r, O2 + r, C, c->eps);
            break;
        case GJ_P_LN_BWD:
            ln_bwd_row_d(GJ_K_ROW(A, r, C), B[r], Cc[r], GJ_K_ROW(D, r, C), GJ_K_ROW(O0, r, C), C);
            break;
        case GJ_P_CE_FWD:
            O1[r] = ce_fwd_row_d(GJ_K_ROW(A, r, C), c->labels[r], C, &c->terms[r]);
            break;
        case GJ_P_CE_BWD:
            ce_bwd_row_d(GJ_K_ROW(A, r, C), B[r], c->labels[r], c->scale, GJ_K_ROW(O0, r, C), C);
            break;
        default: break;
        }
    }
}

static void gj_k_comp_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_comp_ctx *c = ctx;
    if (c->dt == GJ_F32)
        gj_k_comp_range_f(c, b, e);
    else
        gj_k_comp_range_d(c, b, e);
}

static bool gj_k_is_label_input(gj_rt_prim p, int i) {
    return (p == GJ_P_CE_FWD && i == 1) || (p == GJ_P_CE_BWD && i == 2);
}

static int gj_k_n_outputs(gj_rt_prim p) {
    return p == GJ_P_LN_FWD ? 3 : p == GJ_P_CE_FWD ? 2 : 1;
}

/* Runs inst for f32/f64 on inputs of that dtype (labels i64); outs
 * allocated contiguous. */
static int gj_k_comp_run(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs) {
    int n_in = inst->n_in, rc = -1;
    gj_tensor *ci[4] = {NULL, NULL, NULL, NULL};
    double *terms = NULL;
    size_t terms_bytes = 0;
    for (int i = 0; i < n_in; i++) {
        ci[i] = gj_rt_contiguous(in[i]);
        if (!ci[i])
            goto done;
    }
    const gj_tensor *x = ci[0];
    int64_t C = x->shape[x->ndim - 1];
    int64_t R = C > 0 ? x->numel / C : gj_rt_numel(x->ndim - 1, x->shape);
    gj_k_comp_ctx c = {.prim = inst->prim, .dt = x->dtype, .C = C, .eps = inst->scalar,
                       .a = gj_rt_data_ptr(ci[0])};
    void **ins[4] = {NULL, (void **)&c.b, (void **)&c.c, (void **)&c.d};
    for (int i = 1; i < n_in; i++) {
        if (gj_k_is_label_input(inst->prim, i))
            c.labels = gj_rt_data_ptr(ci[i]);
        else
            *ins[i] = gj_rt_data_ptr(ci[i]);
    }
    c.o0 = gj_rt_data_ptr(outs[0]);
    if (outs[1])
        c.o1 = gj_rt_data_ptr(outs[1]);
    if (outs[2])
        c.o2 = gj_rt_data_ptr(outs[2]);

    if (c.labels) { /* CE: validate every label first */
        for (int64_t r = 0; r < R; r++) {
            if (c.labels[r] < 0 || c.labels[r] >= C) {
                gj_rt_set_error("%s: label %lld at row %lld out of range [0, %lld) (K = %lld)",
                                gj_rt_prim_name(inst->prim), (long long)c.labels[r],
                                (long long)r, (long long)C, (long long)C);
                goto done;
            }
        }
    }
    if (inst->prim == GJ_P_CE_FWD) {
        terms_bytes = (size_t)R * sizeof(double);
        terms = gj_rt_k_scratch(terms_bytes);
        if (!terms)
            goto done;
        c.terms = terms;
    }
    if (inst->prim == GJ_P_CE_BWD) {
        double g = gj_rt_k_load(c.d, x->dtype, 0);
        c.scale = g / (double)R;
        c.o1 = NULL;
    }
    if (R > 0 && (C > 0 || inst->prim == GJ_P_LN_FWD))
        gj_rt_parallel_for(R, C >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / (C > 0 ? C : 1),
                           gj_k_comp_range, &c);
    if (inst->prim == GJ_P_CE_FWD) {
        /* the rows' terms summed as every SUM kernel sums a run: 8 lanes
         * (position mod 8, the tail from lane 0), combined pairwise; the
         * compiled decomposition's row-then-total sum is this order too */
        gj_rt_k_store(c.o0, x->dtype, 0, gj_rt_k_ce_sum_terms(terms, R) / (double)R);
    }
    rc = 0;
done:
    if (terms)
        gj_rt_k_scratch_free(terms, terms_bytes);
    for (int i = 0; i < 4; i++)
        gj_rt_tensor_release(ci[i]);
    return rc;
}

double gj_rt_k_ce_sum_terms(const double *terms, int64_t n) {
    double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t r = 0;
    for (; r + 8 <= n; r += 8)
        for (int k = 0; k < 8; k++)
            l[k] += terms[r + k];
    for (int k = 0; r < n; r++, k++)
        l[k] += terms[r];
    return 0.0 + (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])));
}

void gj_rt_k_ce_row(gj_dtype dt, void *x, int64_t K, int64_t label, double scale, bool grad,
                    double *term) {
    if (label < 0) {
        *term = 0.0;
        if (grad)
            memset(x, 0, (size_t)K * (dt == GJ_F64 ? sizeof(double) : sizeof(float)));
        return;
    }
    if (dt == GJ_F64) {
        double lse = ce_fwd_row_d(x, label, K, term);
        if (grad)
            ce_grad_row_d(x, lse, label, scale, K);
    } else {
        float lse = (float)ce_fwd_row_f(x, label, K, term);
        if (grad)
            ce_grad_row_f(x, lse, label, (float)scale, K);
    }
}

int gj_rt_k_composite(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs) {
    if (in[0]->dtype != GJ_BF16)
        return gj_k_comp_run(inst, in, outs);
    /* bf16: f32 copies of the float inputs, f32 outputs, rounded once. */
    int rc = -1, nout = gj_k_n_outputs(inst->prim);
    gj_tensor *fi[4] = {NULL, NULL, NULL, NULL}, *fo[GJ_RT_MAX_OUTPUTS] = {NULL, NULL, NULL};
    gj_tensor *use[4];
    for (int i = 0; i < inst->n_in; i++) {
        if (gj_k_is_label_input(inst->prim, i)) {
            use[i] = in[i];
            continue;
        }
        fi[i] = gj_rt_tensor_empty(GJ_F32, in[i]->ndim, in[i]->shape);
        if (!fi[i] || gj_rt_copy_into(fi[i], in[i]) != 0)
            goto done;
        use[i] = fi[i];
    }
    for (int k = 0; k < nout; k++) {
        fo[k] = gj_rt_tensor_empty(GJ_F32, outs[k]->ndim, outs[k]->shape);
        if (!fo[k])
            goto done;
    }
    if (gj_k_comp_run(inst, use, fo) != 0)
        goto done;
    for (int k = 0; k < nout; k++)
        if (gj_rt_copy_into(outs[k], fo[k]) != 0)
            goto done;
    rc = 0;
done:
    for (int i = 0; i < 4; i++)
        gj_rt_tensor_release(fi[i]);
    for (int k = 0; k < GJ_RT_MAX_OUTPUTS; k++)
        gj_rt_tensor_release(fo[k]);
    return rc;
}
