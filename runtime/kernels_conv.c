// SPDX-License-Identifier: MIT
/*
 * kernels_conv.c - the sliding-window primitives IM2COL and COL2IM (the
 * unfold and fold of conv2d and the pools), and their shared raw-memory
 * cores gj_rt_im2col_run / gj_rt_col2im_run, which the compiled program
 * calls as well (jit/program.c), so eager and compiled give the same bits.
 *
 * Dimension legend: N batch, C channels, H x W image, kh x kw kernel taps
 * (i, j), OH x OW output positions (oh, ow). Tap (i, j) of position
 * (oh, ow) reads image element h = oh*sh - ph + i*dh, w = ow*sw - pw + j*dw.
 *
 * Invariants:
 *   - Work is split over (n, c) planes (im2col: over (n, c, i, j) rows),
 *     never inside a sum: results do not depend on the thread count.
 *   - im2col only moves values (no arithmetic): any float dtype is copied
 *     by element size; the pad value is rounded to the dtype once.
 *   - col2im zero-fills each plane, then adds the taps in (i, j, oh, ow)
 *     order: image element (h, w) receives its terms in (i, j) row-major
 *     order (at most one (oh, ow) per tap reaches it). f32 and f64 add in
 *     their own dtype; bf16 adds in an f32 scratch rounded once at the end.
 */
#include "runtime/kernels.h"

/* ------------------------------------------------------------ geometry */

/* Output positions along one axis, or <= 0 if the window never fits. */
static int64_t gj_k_win_out(int64_t size, int64_t k, int64_t s, int64_t p, int64_t d) {
    int64_t span = d * (k - 1) + 1;
    int64_t room = size + 2 * p - span;
    return room < 0 ? 0 : room / s + 1;
}

bool gj_rt_win_of(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_win *g) {
    const int64_t *a = inst->shape;
    if (inst->ndim != GJ_RT_WIN_NDIM)
        return false;
    memset(g, 0, sizeof *g);
    g->kh = a[0], g->kw = a[1], g->sh = a[2], g->sw = a[3];
    g->ph = a[4], g->pw = a[5], g->dh = a[6], g->dw = a[7];
    if (g->kh < 1 || g->kw < 1 || g->sh < 1 || g->sw < 1 || g->ph < 0 || g->pw < 0 ||
        g->dh < 1 || g->dw < 1)
        return false;
    /* bound the attributes so that no index computation below overflows */
    const int64_t big = INT64_C(1) << 31;
    for (int k = 0; k < GJ_RT_WIN_NDIM; k++)
        if (a[k] >= big)
            return false;
    g->N = in->shape[0];
    g->C = in->shape[1];
    if (inst->prim == GJ_P_IM2COL) {
        if (in->ndim != 4)
            return false;
        g->H = in->shape[2];
        g->W = in->shape[3];
    } else {
        if (in->ndim != 6 || in->shape[2] != g->kh || in->shape[3] != g->kw)
            return false;
        g->H = inst->start;
        g->W = inst->len;
    }
    if (g->H >= big || g->W >= big)
        return false;
    g->OH = gj_k_win_out(g->H, g->kh, g->sh, g->ph, g->dh);
    g->OW = gj_k_win_out(g->W, g->kw, g->sw, g->pw, g->dw);
    if (g->OH < 1 || g->OW < 1)
        return false;
    if (inst->prim == GJ_P_COL2IM && (in->shape[4] != g->OH || in->shape[5] != g->OW))
        return false;
    return true;
}

/* -------------------------------------------------------------- im2col */

typedef struct gj_k_im2col_ctx {
    const gj_rt_win *g;
    const char *x;
    const int64_t *xs;
    char *out;
    size_t el;
    uint64_t pad; /* the pad value's bits in the dtype (low el bytes) */
} gj_k_im2col_ctx;

/* The output columns [*lo, *hi) whose tap lands inside [0, size): tap
 * offset t (= -pad + tap * dilation), stride st; position o reads o*st + t. */
static void gj_k_in_range(int64_t n_out, int64_t size, int64_t st, int64_t t, int64_t *lo,
                          int64_t *hi) {
    int64_t a = t >= 0 ? 0 : (-t + st - 1) / st;         /* first o with o*st + t >= 0 */
    int64_t b = size - t <= 0 ? 0 : (size - t - 1) / st + 1; /* first o with o*st + t >= size */
    *lo = a < n_out ? a : n_out;
    *hi = b < n_out ? b : n_out;
    if (*hi < *lo)
        *hi = *lo;
}

/* One row (n, c, i, j) of OH*OW elements, for an element type T: pad
 * outside the image, a straight copy (contiguous when stride and the
 * image's column stride are 1) inside. */
#define GJ_K_IM2COL_ROW(T)                                                              \
    do {                                                                                \
        const T *xp = (const T *)c->x;                                                  \
        T *op = (T *)c->out + r * g->OH * g->OW;                                        \
        T pad;                                                                          \
        memcpy(&pad, &c->pad, sizeof pad);                                              \
        int64_t tw = j * g->dw - g->pw, lo, hi;                                         \
        gj_k_in_range(g->OW, g->W, g->sw, tw, &lo, &hi);                                \
        for (int64_t oh = 0; oh < g->OH; oh++, op += g->OW) {                           \
            int64_t h = oh * g->sh - g->ph + i * g->dh;                                 \
            if (h < 0 || h >= g->H) {                                                   \
                for (int64_t ow = 0; ow < g->OW; ow++) op[ow] = pad;                    \
                continue;                                                               \
            }                                                                           \
            const T *row = xp + n * xs[0] + ch * xs[1] + h * xs[2];                     \
            for (int64_t ow = 0; ow < lo; ow++) op[ow] = pad;                           \
            if (g->sw == 1 && xs[3] == 1) {                                             \
                memcpy(op + lo, row + lo + tw, (size_t)(hi - lo) * sizeof(T));          \
            } else {                                                                    \
                int64_t step = g->sw * xs[3];                                           \
                const T *src = row + (lo * g->sw + tw) * xs[3];                         \
                for (int64_t ow = lo; ow < hi; ow++, src += step) op[ow] = *src;        \
            }                                                                           \
            for (int64_t ow = hi; ow < g->OW; ow++) op[ow] = pad;                       \
        }                                                                               \
    } while (0)

static void gj_k_im2col_range(void *vctx, int64_t b, int64_t e) {
    const gj_k_im2col_ctx *c = vctx;
    const gj_rt_win *g = c->g;
    const int64_t *xs = c->xs;
    for (int64_t r = b; r < e; r++) {
        int64_t j = r % g->kw, i = (r / g->kw) % g->kh;
        int64_t ch = (r / (g->kw * g->kh)) % g->C, n = r / (g->kw * g->kh * g->C);
        switch (c->el) {
        case 2: GJ_K_IM2COL_ROW(uint16_t); break;
        case 4: GJ_K_IM2COL_ROW(uint32_t); break;
        default: GJ_K_IM2COL_ROW(uint64_t); break;
        }
    }
}
#undef GJ_K_IM2COL_ROW

void gj_rt_im2col_run(const gj_rt_win *g, gj_dtype dt, const void *x, const int64_t *xs,
                      double pad, void *out) {
    gj_k_im2col_ctx c = {g, x, xs, out, gj_rt_dtype_size(dt), 0};
    if (dt == GJ_F64) {
        memcpy(&c.pad, &pad, sizeof pad);
    } else if (dt == GJ_BF16) {
        uint16_t v = gj_m_f32_to_bf16((float)pad);
        memcpy(&c.pad, &v, sizeof v);
    } else {
        float v = (float)pad;
        memcpy(&c.pad, &v, sizeof v);
    }
    int64_t rows = g->N * g->C * g->kh * g->kw, per = g->OH * g->OW;
    if (rows <= 0 || per <= 0)
        return;
    gj_rt_parallel_for(rows, per >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / per, gj_k_im2col_range, &c);
}

/* -------------------------------------------------------------- col2im */

typedef struct gj_k_col2im_ctx {
    const gj_rt_win *g;
    gj_dtype dt;
    const char *cols;
    const int64_t *cs;
    void *acc; /* [N, C, H, W]: the output (f32, f64) or an f32 scratch (bf16) */
} gj_k_col2im_ctx;

/* Plane (n, ch): acc = 0, then every tap added in (i, j, oh, ow) order
 * (only the columns whose tap lands in the image; a unit-stride inner loop
 * when the stride and the columns' last stride are 1). */
#define GJ_K_COL2IM_PLANE(TA, LOAD)                                                     \
    do {                                                                                \
        TA *ap = (TA *)c->acc + p * g->H * g->W;                                        \
        for (int64_t q = 0; q < g->H * g->W; q++) ap[q] = 0;                            \
        for (int64_t i = 0; i < g->kh; i++)                                             \
            for (int64_t j = 0; j < g->kw; j++) {                                       \
                int64_t tw = j * g->dw - g->pw, lo, hi;                                 \
                gj_k_in_range(g->OW, g->W, g->sw, tw, &lo, &hi);                        \
                for (int64_t oh = 0; oh < g->OH; oh++) {                                \
                    int64_t h = oh * g->sh - g->ph + i * g->dh;                         \
                    if (h < 0 || h >= g->H) continue;                                   \
                    int64_t base = n * cs[0] + ch * cs[1] + i * cs[2] + j * cs[3] +     \
                                   oh * cs[4];                                          \
                    TA *arow = ap + h * g->W;                                           \
                    if (g->sw == 1 && cs[5] == 1) {                                     \
                        for (int64_t ow = lo; ow < hi; ow++)                            \
                            arow[ow + tw] += LOAD(base + ow);                           \
                    } else {                                                            \
                        for (int64_t ow = lo; ow < hi; ow++)                            \
                            arow[ow * g->sw + tw] += LOAD(base + ow * cs[5]);           \
                    }                                                                   \
                }                                                                       \
            }                                                                           \
    } while (0)

static void gj_k_col2im_range(void *vctx, int64_t b, int64_t e) {
    const gj_k_col2im_ctx *c = vctx;
    const gj_rt_win *g = c->g;
    const int64_t *cs = c->cs;
    for (int64_t p = b; p < e; p++) {
        int64_t n = p / g->C, ch = p % g->C;
        if (c->dt == GJ_F64) {
            const double *src = (const double *)c->cols;
#define GJ_K_LD(k) src[k]
            GJ_K_COL2IM_PLANE(double, GJ_K_LD);
#undef GJ_K_LD
        } else if (c->dt == GJ_BF16) {
            const uint16_t *src = (const uint16_t *)c->cols;
#define GJ_K_LD(k) gj_m_bf16_to_f32(src[k])
            GJ_K_COL2IM_PLANE(float, GJ_K_LD);
#undef GJ_K_LD
        } else {
            const float *src = (const float *)c->cols;
#define GJ_K_LD(k) src[k]
            GJ_K_COL2IM_PLANE(float, GJ_K_LD);
#undef GJ_K_LD
        }
    }
}
#undef GJ_K_COL2IM_PLANE

int gj_rt_col2im_run(const gj_rt_win *g, gj_dtype dt, const void *cols, const int64_t *cs,
                     void *out) {
    int64_t planes = g->N * g->C, total = planes * g->H * g->W;
    if (total <= 0)
        return 0;
    void *acc = out;
    size_t acc_bytes = 0;
    if (dt == GJ_BF16) {
        acc_bytes = (size_t)total * sizeof(float);
        acc = gj_rt_k_scratch(acc_bytes);
        if (!acc) {
            gj_rt_set_error("col2im: out of memory (%zu bytes of scratch)", acc_bytes);
            return -1;
        }
    }
    gj_k_col2im_ctx c = {g, dt, cols, cs, acc};
    int64_t per = g->kh * g->kw * g->OH * g->OW;
    gj_rt_parallel_for(planes, per >= GJ_K_GRAIN ? 1 : GJ_K_GRAIN / (per > 0 ? per : 1),
                       gj_k_col2im_range, &c);
    if (dt == GJ_BF16) {
        const float *a = acc;
        uint16_t *o = out;
        for (int64_t k = 0; k < total; k++)
            o[k] = gj_m_f32_to_bf16(a[k]);
        gj_rt_k_scratch_free(acc, acc_bytes);
    }
    return 0;
}

/* ---------------------------------------------------- eager entry points */

int gj_rt_k_im2col(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out) {
    gj_rt_meta m;
    gj_rt_win g;
    gj_rt_meta_of(x, &m);
    if (!gj_rt_win_of(inst, &m, &g)) {
        gj_rt_set_error("im2col: internal: bad geometry");
        return -1;
    }
    gj_rt_im2col_run(&g, x->dtype, gj_rt_data_ptr(x), x->strides, inst->scalar,
                     gj_rt_data_ptr(out));
    return 0;
}

int gj_rt_k_col2im(const gj_rt_inst *inst, gj_tensor *cols, gj_tensor *out) {
    gj_rt_meta m;
    gj_rt_win g;
    gj_rt_meta_of(cols, &m);
    if (!gj_rt_win_of(inst, &m, &g)) {
        gj_rt_set_error("col2im: internal: bad geometry");
        return -1;
    }
    return gj_rt_col2im_run(&g, cols->dtype, gj_rt_data_ptr(cols), cols->strides,
                            gj_rt_data_ptr(out));
}
