/* SPDX-License-Identifier: MIT */
/*
 * kernels_reduce.c - SUM over an axes mask and MAX over one axis.
 *
 * Invariants:
 *   - The input (any strides) is described by its kept dims (input order,
 *     which is the output's row-major order) and its reduced dims (sorted by
 *     decreasing stride, so the innermost loop has the smallest stride),
 *     size-1 dims dropped and mergeable neighbours coalesced.
 *   - Two schedules, both parallel over OUTPUT elements only:
 *       per-output (P): each output element reduces its own elements, the
 *         innermost reduced run with 8 independent accumulators combined in
 *         a fixed tree;
 *       row-wise (R): when the innermost kept dim has a smaller stride than
 *         every reduced dim (e.g. a bias gradient [N, D] -> [D]), a chunk of
 *         up to GJ_K_RCHUNK outputs along it accumulates whole input rows in
 *         reduction order.
 *     The summation order is a function of the shapes and strides only:
 *     results are identical for any thread count.
 *   - f32/bf16/f64 accumulate in double (SUM) or compare in double (MAX,
 *     exact); i64 sums wrap modulo 2^64. MAX propagates NaN.
 */
#include "runtime/kernels.h"

#define GJ_K_RCHUNK 512

/* Accumulator ops of one (op, dtype): acc entries are 8 bytes (double or
 * int64). run: acc[0] op= reduce(p[i*st], i < n); row: acc[j] op= p[j*st]. */
typedef struct gj_k_red_vt {
    void (*init)(void *acc, int64_t n);
    void (*run)(void *acc, const char *p, int64_t st, int64_t n);
    void (*row)(void *acc, const char *p, int64_t st, int64_t n);
    void (*store)(char *out, int64_t o, const void *acc, int64_t n);
} gj_k_red_vt;

#define GJ_K_MAXC(a, b) (((b) > (a) || (b) != (b)) ? (b) : (a)) /* NaN wins */

#define GJ_K_RED_FLOAT(SFX, T, LOAD, STORE)                                                  \
    static void sum_init_##SFX(void *acc, int64_t n) {                                        \
        double *a = acc;                                                                      \
        for (int64_t j = 0; j < n; j++)                                                       \
            a[j] = 0.0;                                                                       \
    }                                                                                         \
    static void max_init_##SFX(void *acc, int64_t n) {                                        \
        double *a = acc;                                                                      \
        for (int64_t j = 0; j < n; j++)                                                       \
            a[j] = -__builtin_inf();                                                          \
    }                                                                                         \
    GJ_K_CLONES static void sum_run_##SFX(void *acc, const char *pp, int64_t st, int64_t n) {             \
        const T *p = (const T *)(const void *)pp;                                             \
        double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                               \
        int64_t i = 0;                                                                        \
        if (st == 1) {                                                                        \
            for (; i + 8 <= n; i += 8)                                                        \
                for (int k = 0; k < 8; k++)                                                   \
                    l[k] += (double)LOAD(p[i + k]);                                           \
        } else {                                                                              \
            for (; i + 8 <= n; i += 8)                                                        \
                for (int k = 0; k < 8; k++)                                                   \
                    l[k] += (double)LOAD(p[(i + k) * st]);                                    \
        }                                                                                     \
        for (int k = 0; i < n; i++, k++)                                                      \
            l[k] += (double)LOAD(p[i * st]);                                                  \
        *(double *)acc += ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));  \
    }                                                                                         \
    GJ_K_CLONES static void max_run_##SFX(void *acc, const char *pp, int64_t st, int64_t n) {             \
        const T *p = (const T *)(const void *)pp;                                             \
        double l[8];                                                                          \
        for (int k = 0; k < 8; k++)                                                           \
            l[k] = -__builtin_inf();                                                          \
        int64_t i = 0;                                                                        \
        for (; i + 8 <= n; i += 8)                                                            \
            for (int k = 0; k < 8; k++) {                                                     \
                double v = (double)LOAD(p[(i + k) * st]);                                     \
                l[k] = GJ_K_MAXC(l[k], v);                                                    \
            }                                                                                 \
        for (int k = 0; i < n; i++, k++) {                                                    \
            double v = (double)LOAD(p[i * st]);                                               \
            l[k] = GJ_K_MAXC(l[k], v);                                                        \
        }                                                                                     \
        double m = *(double *)acc;                                                            \
        for (int k = 0; k < 8; k++)                                                           \
            m = GJ_K_MAXC(m, l[k]);                                                           \
        *(double *)acc = m;                                                                   \
    }                                                                                         \
    GJ_K_CLONES static void sum_row_##SFX(void *acc, const char *pp, int64_t st, int64_t n) {             \
        const T *restrict p = (const T *)(const void *)pp;                                    \
        double *restrict a = acc;                                                             \
        if (st == 1)                                                                          \
            for (int64_t j = 0; j < n; j++)                                                   \
                a[j] += (double)LOAD(p[j]);                                                   \
        else                                                                                  \
            for (int64_t j = 0; j < n; j++)                                                   \
                a[j] += (double)LOAD(p[j * st]);                                              \
    }                                                                                         \
    GJ_K_CLONES static void max_row_##SFX(void *acc, const char *pp, int64_t st, int64_t n) {             \
        const T *restrict p = (const T *)(const void *)pp;                                    \
        double *restrict a = acc;                                                             \
        for (int64_t j = 0; j < n; j++) {                                                     \
            double v = (double)LOAD(p[j * st]);                                               \
            a[j] = GJ_K_MAXC(a[j], v);                                                        \
        }                                                                                     \
    }                                                                                         \
    static void store_##SFX(char *out, int64_t o, const void *acc, int64_t n) {               \
        T *restrict q = (T *)(void *)out + o;                                                 \
        const double *restrict a = acc;                                                       \
        for (int64_t j = 0; j < n; j++)                                                       \
            q[j] = STORE(a[j]);                                                               \
    }

#define GJ_K_ID(x) (x)
#define GJ_K_BF16_LD(x) gj_m_bf16_to_f32(x)
#define GJ_K_F32_ST(x) ((float)(x))
#define GJ_K_BF16_ST(x) gj_m_f32_to_bf16((float)(x))
GJ_K_RED_FLOAT(f32, float, GJ_K_ID, GJ_K_F32_ST)
GJ_K_RED_FLOAT(f64, double, GJ_K_ID, GJ_K_ID)
GJ_K_RED_FLOAT(bf16, uint16_t, GJ_K_BF16_LD, GJ_K_BF16_ST)

/* i64 sums (wrapping: accumulated as uint64). */
static void sum_init_i64(void *acc, int64_t n) { memset(acc, 0, (size_t)n * 8); }
static void sum_run_i64(void *acc, const char *pp, int64_t st, int64_t n) {
    const int64_t *p = (const int64_t *)(const void *)pp;
    uint64_t s = (uint64_t) * (int64_t *)acc;
    for (int64_t i = 0; i < n; i++)
        s += (uint64_t)p[i * st];
    *(int64_t *)acc = (int64_t)s;
}
static void sum_row_i64(void *acc, const char *pp, int64_t st, int64_t n) {
    const int64_t *restrict p = (const int64_t *)(const void *)pp;
    uint64_t *restrict a = acc;
    for (int64_t j = 0; j < n; j++)
        a[j] += (uint64_t)p[j * st];
}
static void store_i64(char *out, int64_t o, const void *acc, int64_t n) {
    memcpy((int64_t *)(void *)out + o, acc, (size_t)n * 8);
}

static const gj_k_red_vt g_sum_vt[4] = {
    {sum_init_f32, sum_run_f32, sum_row_f32, store_f32},
    {sum_init_f64, sum_run_f64, sum_row_f64, store_f64},
    {sum_init_bf16, sum_run_bf16, sum_row_bf16, store_bf16},
    {sum_init_i64, sum_run_i64, sum_row_i64, store_i64},
};
static const gj_k_red_vt g_max_vt[3] = {
    {max_init_f32, max_run_f32, max_row_f32, store_f32},
    {max_init_f64, max_run_f64, max_row_f64, store_f64},
    {max_init_bf16, max_run_bf16, max_row_bf16, store_bf16},
};

/* One accumulator slot: double (float sums, max) or int64 (i64 sums). */
typedef union gj_k_acc {
    double d;
    int64_t i;
    uint64_t u;
} gj_k_acc;

/* ---------------------------------------------------------------- plan */

typedef struct gj_k_red_plan {
    const gj_k_red_vt *vt;
    const char *base;
    int64_t el;
    int nk, nr;
    int64_t ksz[GJ_MAX_DIMS], kst[GJ_MAX_DIMS]; /* kept dims */
    int64_t rsz[GJ_MAX_DIMS], rst[GJ_MAX_DIMS]; /* reduced dims, innermost last */
    char *out;
    int64_t J, nchunks; /* row-wise: inner kept size, chunks per row */
} gj_k_red_plan;

/* Input element offset of kept index `o` over kept dims [0, nk). */
static int64_t gj_k_red_koff(const gj_k_red_plan *p, int nk, int64_t o) {
    int64_t off = 0;
    for (int k = nk - 1; k >= 0; k--) {
        off += (o % p->ksz[k]) * p->kst[k];
        o /= p->ksz[k];
    }
    return off;
}

/* Per-output schedule: outputs [b, e). */
static void gj_k_red_p_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_red_plan *p = ctx;
    int inner = p->nr - 1; /* nr >= 1 here */
    for (int64_t o = b; o < e; o++) {
        int64_t off = gj_k_red_koff(p, p->nk, o);
        gj_k_acc acc[1];
        p->vt->init(acc, 1);
        int64_t idx[GJ_MAX_DIMS] = {0}, roff = 0;
        for (;;) {
            p->vt->run(acc, p->base + (off + roff) * p->el, p->rst[inner], p->rsz[inner]);
            int k = inner - 1;
            for (; k >= 0; k--) {
                roff += p->rst[k];
                if (++idx[k] < p->rsz[k])
                    break;
                roff -= p->rsz[k] * p->rst[k];
                idx[k] = 0;
            }
            if (k < 0)
                break;
        }
        p->vt->store(p->out, o, acc, 1);
    }
}

/* Row-wise schedule: items [b, e) = (row, chunk of the inner kept dim). */
static void gj_k_red_r_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_red_plan *p = ctx;
    _Alignas(64) gj_k_acc acc[GJ_K_RCHUNK];
    int64_t jst = p->kst[p->nk - 1];
    for (int64_t it = b; it < e; it++) {
        int64_t row = it / p->nchunks, j0 = (it % p->nchunks) * GJ_K_RCHUNK;
        int64_t jn = p->J - j0 < GJ_K_RCHUNK ? p->J - j0 : GJ_K_RCHUNK;
        int64_t off = gj_k_red_koff(p, p->nk - 1, row) + j0 * jst;
        p->vt->init(acc, jn);
        int64_t idx[GJ_MAX_DIMS] = {0}, roff = 0;
        for (;;) {
            p->vt->row(acc, p->base + (off + roff) * p->el, jst, jn);
            int k = p->nr - 1;
            for (; k >= 0; k--) {
                roff += p->rst[k];
                if (++idx[k] < p->rsz[k])
                    break;
                roff -= p->rsz[k] * p->rst[k];
                idx[k] = 0;
            }
            if (k < 0)
                break;
        }
        p->vt->store(p->out, row * p->J + j0, acc, jn);
    }
}

/* Shared driver of SUM and MAX: reduces the axes in mask. */
static int gj_k_reduce(const gj_k_red_vt *vt, uint32_t mask, gj_tensor *x, gj_tensor *out) {
    if (out->numel == 0)
        return 0;
    if (x->numel == 0) { /* SUM over an empty axis: zeros (MAX rejects it) */
        memset(gj_rt_data_ptr(out), 0, (size_t)out->numel * gj_rt_dtype_size(out->dtype));
        return 0;
    }
    gj_k_red_plan p;
    memset(&p, 0, sizeof p);
    p.vt = vt;
    p.base = gj_rt_data_ptr(x);
    p.el = (int64_t)gj_rt_dtype_size(x->dtype);
    p.out = gj_rt_data_ptr(out);
    for (int k = 0; k < x->ndim; k++) {
        int64_t sz = x->shape[k], st = x->strides[k];
        if (sz == 1)
            continue;
        if (mask & (1u << k)) {
            p.rsz[p.nr] = sz;
            p.rst[p.nr++] = st;
        } else if (p.nk > 0 && p.kst[p.nk - 1] == st * sz) {
            p.ksz[p.nk - 1] *= sz;
            p.kst[p.nk - 1] = st;
        } else {
            p.ksz[p.nk] = sz;
            p.kst[p.nk++] = st;
        }
    }
    /* Reduced dims: stable sort by decreasing stride, then coalesce. */
    for (int a = 1; a < p.nr; a++)
        for (int b = a; b > 0 && p.rst[b - 1] < p.rst[b]; b--) {
            int64_t t = p.rst[b], s = p.rsz[b];
            p.rst[b] = p.rst[b - 1];
            p.rsz[b] = p.rsz[b - 1];
            p.rst[b - 1] = t;
            p.rsz[b - 1] = s;
        }
    int nr = 0;
    for (int k = 0; k < p.nr; k++) {
        if (nr > 0 && p.rst[nr - 1] == p.rst[k] * p.rsz[k]) {
            p.rsz[nr - 1] *= p.rsz[k];
            p.rst[nr - 1] = p.rst[k];
        } else {
            p.rsz[nr] = p.rsz[k];
            p.rst[nr++] = p.rst[k];
        }
    }
    p.nr = nr;
    if (p.nr == 0) { /* nothing to reduce: one "reduced" dim of size 1 */
        p.rsz[0] = 1;
        p.rst[0] = 0;
        p.nr = 1;
    }
    int64_t rcount = 1;
    for (int k = 0; k < p.nr; k++)
        rcount *= p.rsz[k];

    bool rowwise = p.nk > 0;
    for (int k = 0; rowwise && k < p.nr; k++)
        rowwise = p.rsz[k] == 1 || p.kst[p.nk - 1] < p.rst[k];
    if (rowwise) {
        p.J = p.ksz[p.nk - 1];
        p.nchunks = (p.J + GJ_K_RCHUNK - 1) / GJ_K_RCHUNK;
        int64_t items = (out->numel / p.J) * p.nchunks;
        int64_t per = rcount * (p.J < GJ_K_RCHUNK ? p.J : GJ_K_RCHUNK);
        gj_rt_parallel_for(items, per >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / per, gj_k_red_r_range, &p);
    } else {
        gj_rt_parallel_for(out->numel, rcount >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / rcount,
                           gj_k_red_p_range, &p);
    }
    return 0;
}

int gj_rt_k_sum(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out) {
    return gj_k_reduce(&g_sum_vt[x->dtype], inst->axes, x, out);
}

int gj_rt_k_max(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out) {
    if (x->dtype == GJ_I64) {
        gj_rt_set_error("max: no kernel for dtype i64");
        return -1;
    }
    return gj_k_reduce(&g_max_vt[x->dtype], inst->axes, x, out);
}
