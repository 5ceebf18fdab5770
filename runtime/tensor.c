/* SPDX-License-Identifier: MIT */
/*
 * tensor.c - tensor headers: creation, views, reference counting, layout
 * queries and the one generic strided copy (with dtype conversion).
 *
 * Invariants:
 *   - A live header has magic GJ_RT_TENSOR_MAGIC, refcount >= 1, a valid
 *     dtype, 0 <= ndim <= GJ_MAX_DIMS, shape[k] >= 0, strides[k] >= 0, and
 *     numel == prod(shape). Every element it can address lies inside its
 *     storage (checked by gj_rt_tensor_view; guaranteed by construction
 *     elsewhere). shape/strides beyond ndim are zero.
 *   - The header owns one reference to its storage and, if `ag` is set, the
 *     autograd metadata, freed through the callback of gj_rt_set_ag_free.
 *   - When the last reference goes, magic becomes GJ_RT_TENSOR_DEAD before
 *     the header is freed, so a stale pointer is usually caught by
 *     gj_rt_check_tensor rather than silently used.
 *   - bf16 values are the upper 16 bits of an IEEE f32; converting to bf16
 *     rounds to nearest even and keeps NaNs NaN (quiet).
 */
#include "runtime/rt.h"
#include "runtime/gj_math.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static void (*g_ag_free)(gj_tensor *t);
static atomic_llong g_live_tensors; /* headers made by gj_rt_header_new, not yet freed */

/* ------------------------------------------------------------- dtypes */

size_t gj_rt_dtype_size(gj_dtype dt) {
    switch (dt) {
    case GJ_F32: return 4;
    case GJ_F64: return 8;
    case GJ_BF16: return 2;
    case GJ_I64: return 8;
    }
    return 0;
}

bool gj_rt_dtype_is_float(gj_dtype dt) { return dt == GJ_F32 || dt == GJ_F64 || dt == GJ_BF16; }

bool gj_rt_dtype_valid(int dt) { return dt >= GJ_F32 && dt <= GJ_I64; }

/* C's float -> integer conversion is undefined out of range: saturate,
 * NaN -> 0, otherwise truncate toward zero. */
static inline int64_t gj_rt_f_to_i64(double x) {
    if (x != x)
        return 0;
    if (x >= 9223372036854775808.0)
        return INT64_MAX;
    if (x < -9223372036854775808.0)
        return INT64_MIN;
    return (int64_t)x;
}

/* ----------------------------------------------------------- validation */

bool gj_rt_check_indices(const char *op, const char *arg, const gj_tensor *idx, int64_t bound) {
    return gj_rt_check_labels(op, arg, idx, bound, -1, false);
}

bool gj_rt_check_labels(const char *op, const char *arg, const gj_tensor *idx, int64_t bound,
                        int64_t ignore, bool has_ignore) {
    if (idx->dtype != GJ_I64) {
        gj_rt_set_error("%s: %s must be an i64 tensor, got %s", op, arg,
                        gj_rt_dtype_name(idx->dtype));
        return false;
    }
    if (gj_rt_is_abstract(idx) && gj_rt_abstract())
        return true; /* (the program checks them before it starts) */
    if (gj_rt_present(idx) != 0)
        return false;
    const int64_t *base = (const int64_t *)gj_rt_data_ptr(idx);
    bool dense = gj_rt_is_contiguous(idx);
    for (int64_t i = 0; i < idx->numel; i++) {
        int64_t off = i;
        if (!dense) { /* strided: element offset of row-major index i */
            int64_t rem = i;
            off = 0;
            for (int k = idx->ndim - 1; k >= 0; k--) {
                off += (rem % idx->shape[k]) * idx->strides[k];
                rem /= idx->shape[k];
            }
        }
        int64_t v = base[off];
        if ((v < 0 || v >= bound) && !(has_ignore && v == ignore)) {
            char ig[64] = "";
            if (has_ignore)
                snprintf(ig, sizeof ig, " and is not the ignored label %lld", (long long)ignore);
            gj_rt_set_error("%s: %s[%lld] = %lld is out of range [0, %lld)%s", op, arg,
                            (long long)i, (long long)v, (long long)bound, ig);
            return false;
        }
    }
    return true;
}

bool gj_rt_check_tensor(const gj_tensor *t, const char *op, const char *arg) {
    if (!t) {
        /* A NULL here is usually the result of an earlier failed call in a
         * chain such as gj_cross_entropy(gj_linear(gj_gelu(gj_linear(x, ..)))):
         * carry the innermost cause forward however deep the chain is. The
         * cause (error.c) is either "<op>: <arg> is NULL (caused by:
         * <cause>)", whose cause is the innermost one already, or itself
         * the first failure. Without one (the NULL was passed as such, or
         * calls have succeeded since the last failure) the message says
         * only that the argument is NULL. */
        const char *prev = gj_rt_null_cause();
        if (prev) {
            char cause[768];
            const char *c = strstr(prev, " (caused by: ");
            if (c) {
                c += strlen(" (caused by: ");
                size_t n = strlen(c);
                if (n > 0 && c[n - 1] == ')') n--; /* its own closing parenthesis */
                snprintf(cause, sizeof cause, "%.*s", (int)(n < 767 ? n : 767), c);
            } else {
                snprintf(cause, sizeof cause, "%s", prev);
            }
            gj_rt_set_error("%s: %s is NULL (caused by: %s)", op, arg, cause);
            gj_rt_null_result(); /* still that NULL's cause, for its next use */
        } else {
            gj_rt_set_error("%s: %s is NULL", op, arg);
        }
        return false;
    }
    if (t->magic != GJ_RT_TENSOR_MAGIC) {
        gj_rt_set_error("%s: %s is not a live tensor (released?)", op, arg);
        return false;
    }
    return true;
}

bool gj_rt_check_shape(int ndim, const int64_t *shape, gj_dtype dt, const char *op) {
    char buf[256];
    if (ndim < 0 || ndim > GJ_MAX_DIMS) {
        gj_rt_set_error("%s: ndim %d out of range [0, %d]", op, ndim, GJ_MAX_DIMS);
        return false;
    }
    if (!gj_rt_dtype_valid((int)dt)) {
        gj_rt_set_error("%s: invalid dtype %d", op, (int)dt);
        return false;
    }
    if (ndim > 0 && !shape) {
        gj_rt_set_error("%s: shape is NULL with ndim %d", op, ndim);
        return false;
    }
    for (int k = 0; k < ndim; k++) {
        if (shape[k] < 0) {
            gj_rt_set_error("%s: negative dimension %lld (axis %d) in shape %s %s", op,
                            (long long)shape[k], k, gj_rt_fmt_shape(buf, sizeof buf, ndim, shape),
                            gj_rt_dtype_name(dt));
            return false;
        }
    }
    /* The byte size of the non-zero dims must fit even when a zero dim
     * makes the tensor empty: strides, views and reshapes of [0, 2^62,
     * 2^62] would overflow otherwise. */
    int64_t bytes = (int64_t)gj_rt_dtype_size(dt);
    for (int k = 0; k < ndim; k++) {
        if (shape[k] == 0)
            continue;
        if (__builtin_mul_overflow(bytes, shape[k], &bytes)) {
            gj_rt_set_error("%s: shape %s %s is too large (byte size overflows)", op,
                            gj_rt_fmt_shape(buf, sizeof buf, ndim, shape), gj_rt_dtype_name(dt));
            return false;
        }
    }
    return true;
}

/* --------------------------------------------------------------- layout */

int64_t gj_rt_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int k = 0; k < ndim; k++)
        n *= shape[k];
    return n;
}

void gj_rt_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides) {
    int64_t s = 1;
    for (int k = ndim - 1; k >= 0; k--) {
        strides[k] = s;
        s *= shape[k] > 0 ? shape[k] : 1;
    }
}

/* Row-major dense: size-1 axes may carry any stride; empty is contiguous. */
bool gj_rt_is_contiguous(const gj_tensor *t) {
    if (t->numel == 0)
        return true;
    int64_t expect = 1;
    for (int k = t->ndim - 1; k >= 0; k--) {
        if (t->shape[k] == 1)
            continue;
        if (t->strides[k] != expect)
            return false;
        expect *= t->shape[k];
    }
    return true;
}

void gj_rt_meta_of(const gj_tensor *t, gj_rt_meta *out) {
    memset(out, 0, sizeof *out);
    out->dtype = t->dtype;
    out->ndim = t->ndim;
    for (int k = 0; k < t->ndim; k++)
        out->shape[k] = t->shape[k];
}

bool gj_rt_broadcast_shape(int na, const int64_t *a, int nb, const int64_t *b, int *nout,
                           int64_t *out) {
    if (na < 0 || nb < 0 || na > GJ_MAX_DIMS || nb > GJ_MAX_DIMS)
        return false;
    int n = na > nb ? na : nb;
    int64_t tmp[GJ_MAX_DIMS];
    for (int k = 0; k < n; k++) {
        int ia = k - (n - na), ib = k - (n - nb);
        int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
        if (da == db || db == 1)
            tmp[k] = da;
        else if (da == 1)
            tmp[k] = db;
        else
            return false;
    }
    *nout = n;
    for (int k = 0; k < n; k++)
        out[k] = tmp[k];
    return true;
}

/* ------------------------------------------------------------- headers */

/* Fresh header over s (retained): refcount 1, no autograd meta, no scope. */
static gj_tensor *gj_rt_header_new(gj_rt_storage *s, gj_dtype dt, int ndim, const int64_t *shape,
                                   const int64_t *strides, int64_t offset) {
    gj_tensor *t = gj_rt_calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->magic = GJ_RT_TENSOR_MAGIC;
    atomic_init(&t->refcount, 1);
    t->dtype = dt;
    t->ndim = ndim;
    for (int k = 0; k < ndim; k++)
        t->shape[k] = shape[k];
    if (strides)
        for (int k = 0; k < ndim; k++)
            t->strides[k] = strides[k];
    else
        gj_rt_contiguous_strides(ndim, shape, t->strides);
    t->offset = offset;
    t->numel = gj_rt_numel(ndim, shape);
    t->storage = s;
    t->scope_slot = -1;
    gj_rt_storage_retain(s);
    atomic_fetch_add(&g_live_tensors, 1);
    return t;
}

static gj_tensor *gj_rt_tensor_make(gj_dtype dt, int ndim, const int64_t *shape, bool zero) {
    if (!gj_rt_check_shape(ndim, shape, dt, "tensor_new"))
        return NULL;
    size_t nbytes = (size_t)gj_rt_numel(ndim, shape) * gj_rt_dtype_size(dt);
    gj_rt_storage *s = zero ? gj_rt_storage_new(nbytes) : gj_rt_storage_new_uninit(nbytes);
    if (!s)
        return NULL;
    gj_tensor *t = gj_rt_header_new(s, dt, ndim, shape, NULL, 0);
    gj_rt_storage_release(s); /* the header holds the only reference now */
    return t;
}

/* New contiguous zeroed tensor (new reference); NULL with error set. */
gj_tensor *gj_rt_tensor_new(gj_dtype dt, int ndim, const int64_t *shape) {
    return gj_rt_tensor_make(dt, ndim, shape, true);
}

/* New contiguous tensor with undefined contents (new reference). */
gj_tensor *gj_rt_tensor_empty(gj_dtype dt, int ndim, const int64_t *shape) {
    return gj_rt_tensor_make(dt, ndim, shape, false);
}

gj_tensor *gj_rt_tensor_abstract(gj_dtype dt, int ndim, const int64_t *shape) {
    if (!gj_rt_check_shape(ndim, shape, dt, "tensor_abstract"))
        return NULL;
    gj_rt_storage *s =
        gj_rt_storage_new_abstract((size_t)gj_rt_numel(ndim, shape) * gj_rt_dtype_size(dt));
    if (!s)
        return NULL;
    gj_tensor *t = gj_rt_header_new(s, dt, ndim, shape, NULL, 0);
    gj_rt_storage_release(s);
    return t;
}

gj_tensor *gj_rt_tensor_abstract_like(const gj_tensor *t) {
    gj_rt_storage *s = gj_rt_storage_new_abstract(t->storage->nbytes);
    if (!s)
        return NULL;
    gj_tensor *a = gj_rt_header_new(s, t->dtype, t->ndim, t->shape, t->strides, t->offset);
    gj_rt_storage_release(s);
    return a;
}

/* New header viewing s (borrowed; the header retains it). strides NULL
 * means contiguous. Fails (NULL, error) if the view leaves the storage. */
gj_tensor *gj_rt_tensor_view(gj_rt_storage *s, gj_dtype dt, int ndim, const int64_t *shape,
                             const int64_t *strides, int64_t offset) {
    char buf[256];
    if (!s) {
        gj_rt_set_error("tensor_view: storage is NULL");
        return NULL;
    }
    if (!gj_rt_check_shape(ndim, shape, dt, "tensor_view"))
        return NULL;
    int64_t cs[GJ_MAX_DIMS];
    if (!strides) {
        gj_rt_contiguous_strides(ndim, shape, cs);
        strides = cs;
    }
    if (offset < 0)
        goto bad;
    int64_t last = offset; /* largest element index addressed */
    bool empty = false;
    for (int k = 0; k < ndim; k++) {
        if (strides[k] < 0)
            goto bad;
        empty |= shape[k] == 0;
    }
    if (!empty) {
        for (int k = 0; k < ndim; k++) {
            int64_t step;
            if (__builtin_mul_overflow(shape[k] - 1, strides[k], &step) ||
                __builtin_add_overflow(last, step, &last))
                goto bad;
        }
        int64_t end_bytes;
        if (__builtin_add_overflow(last, 1, &end_bytes) ||
            __builtin_mul_overflow(end_bytes, (int64_t)gj_rt_dtype_size(dt), &end_bytes) ||
            (uint64_t)end_bytes > (uint64_t)s->nbytes)
            goto bad;
    }
    return gj_rt_header_new(s, dt, ndim, shape, strides, offset);
bad:
    gj_rt_set_error("tensor_view: view %s %s (offset %lld) does not fit its storage of %zu bytes",
                    gj_rt_fmt_shape(buf, sizeof buf, ndim, shape), gj_rt_dtype_name(dt),
                    (long long)offset, s->nbytes);
    return NULL;
}

/* New header (new reference) sharing t's storage and layout, no ag meta. */
gj_tensor *gj_rt_tensor_alias(const gj_tensor *t) {
    return gj_rt_header_new(t->storage, t->dtype, t->ndim, t->shape, t->strides, t->offset);
}

void gj_rt_tensor_retain(gj_tensor *t) {
    if (t)
        atomic_fetch_add(&t->refcount, 1);
}

void gj_rt_tensor_release(gj_tensor *t) {
    if (!t || atomic_fetch_sub(&t->refcount, 1) != 1)
        return;
    if (t->ag && g_ag_free)
        g_ag_free(t);
    t->ag = NULL;
    gj_rt_storage_release(t->storage);
    t->storage = NULL;
    t->magic = GJ_RT_TENSOR_DEAD;
    gj_rt_free(t->name);
    gj_rt_free(t);
    atomic_fetch_sub(&g_live_tensors, 1);
}

int64_t gj_live_tensors(void) { return atomic_load(&g_live_tensors); }

const char *gj_rt_tensor_label(const gj_tensor *t, char *buf, size_t cap) {
    if (!t || !t->name || cap == 0) return "";
    snprintf(buf, cap, " '%s'", t->name);
    return buf;
}

void gj_rt_set_ag_free(void (*fn)(gj_tensor *t)) { g_ag_free = fn; }

void gj_rt_bump_version(gj_tensor *t) { atomic_fetch_add(&t->storage->version, 1); }

/* Element i (row-major over the view's shape) as double; NaN if out of range. */
double gj_rt_get(const gj_tensor *t, int64_t i) {
    if (i < 0 || i >= t->numel)
        return NAN;
    int64_t off = t->offset;
    for (int k = t->ndim - 1; k >= 0; k--) {
        off += (i % t->shape[k]) * t->strides[k];
        i /= t->shape[k];
    }
    const char *base = t->storage->data;
    switch (t->dtype) {
    case GJ_F32: return ((const float *)base)[off];
    case GJ_F64: return ((const double *)base)[off];
    case GJ_BF16: return gj_m_bf16_to_f32(((const uint16_t *)base)[off]);
    case GJ_I64: return (double)((const int64_t *)base)[off];
    }
    return NAN;
}

/* ------------------------------------------------------ strided copy */

/* Converts n elements: dst[i*ds] = convert(src[i*ss]) (strides in elements). */
typedef void (*gj_rt_conv_fn)(void *dst, int64_t ds, const void *src, int64_t ss, int64_t n);

#define GJ_RT_CONV(NAME, DT, ST, EXPR)                                                      \
    static void NAME(void *dp, int64_t ds, const void *sp, int64_t ss, int64_t n) {         \
        DT *restrict d = dp;                                                                \
        const ST *restrict s = sp;                                                          \
        if (ds == 1 && ss == 1) {                                                           \
            for (int64_t i = 0; i < n; i++) {                                               \
                ST x = s[i];                                                                \
                d[i] = (EXPR);                                                              \
            }                                                                               \
        } else if (ss == 0) {                                                               \
            ST x = s[0];                                                                    \
            DT v = (EXPR);                                                                  \
            for (int64_t i = 0; i < n; i++)                                                 \
                d[i * ds] = v;                                                              \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                ST x = s[i * ss];                                                           \
                d[i * ds] = (EXPR);                                                         \
            }                                                                               \
        }                                                                                   \
    }

/* Indexed [dst dtype][src dtype] in gj_dtype order f32, f64, bf16, i64. */
GJ_RT_CONV(conv_f32_f32, float, float, x)
GJ_RT_CONV(conv_f32_f64, float, double, (float)x)
GJ_RT_CONV(conv_f32_bf16, float, uint16_t, gj_m_bf16_to_f32(x))
GJ_RT_CONV(conv_f32_i64, float, int64_t, (float)x)
GJ_RT_CONV(conv_f64_f32, double, float, (double)x)
GJ_RT_CONV(conv_f64_f64, double, double, x)
GJ_RT_CONV(conv_f64_bf16, double, uint16_t, (double)gj_m_bf16_to_f32(x))
GJ_RT_CONV(conv_f64_i64, double, int64_t, (double)x)
GJ_RT_CONV(conv_bf16_f32, uint16_t, float, gj_m_f32_to_bf16(x))
GJ_RT_CONV(conv_bf16_f64, uint16_t, double, gj_m_f32_to_bf16((float)x))
GJ_RT_CONV(conv_bf16_bf16, uint16_t, uint16_t, x)
GJ_RT_CONV(conv_bf16_i64, uint16_t, int64_t, gj_m_f32_to_bf16((float)x))
GJ_RT_CONV(conv_i64_f32, int64_t, float, gj_rt_f_to_i64(x))
GJ_RT_CONV(conv_i64_f64, int64_t, double, gj_rt_f_to_i64(x))
GJ_RT_CONV(conv_i64_bf16, int64_t, uint16_t, gj_rt_f_to_i64(gj_m_bf16_to_f32(x)))
GJ_RT_CONV(conv_i64_i64, int64_t, int64_t, x)

static const gj_rt_conv_fn gj_rt_conv_table[4][4] = {
    {conv_f32_f32, conv_f32_f64, conv_f32_bf16, conv_f32_i64},
    {conv_f64_f32, conv_f64_f64, conv_f64_bf16, conv_f64_i64},
    {conv_bf16_f32, conv_bf16_f64, conv_bf16_bf16, conv_bf16_i64},
    {conv_i64_f32, conv_i64_f64, conv_i64_bf16, conv_i64_i64},
};

/* A copy over a coalesced iteration space of nd >= 1 axes (no size-1 axes
 * unless nd == 1); element strides per axis for both sides. */
typedef struct gj_rt_copy_plan {
    int nd;
    int64_t shape[GJ_MAX_DIMS];
    int64_t ds[GJ_MAX_DIMS], ss[GJ_MAX_DIMS];
    char *dbase;       /* first element of dst */
    const char *sbase; /* first element of src */
    size_t del, sel;   /* element sizes */
    gj_rt_conv_fn fn;
} gj_rt_copy_plan;

/* Copies flat (row-major) elements [begin, end) of the plan. */
static void gj_rt_copy_range(void *ctx, int64_t begin, int64_t end) {
    const gj_rt_copy_plan *p = ctx;
    int nd = p->nd, last = nd - 1;
    int64_t idx[GJ_MAX_DIMS];
    int64_t doff = 0, soff = 0, rem = begin;
    for (int k = last; k >= 0; k--) {
        idx[k] = rem % p->shape[k];
        rem /= p->shape[k];
        doff += idx[k] * p->ds[k];
        soff += idx[k] * p->ss[k];
    }
    for (int64_t i = begin; i < end;) {
        int64_t run = p->shape[last] - idx[last];
        if (run > end - i)
            run = end - i;
        p->fn(p->dbase + doff * (int64_t)p->del, p->ds[last], p->sbase + soff * (int64_t)p->sel,
              p->ss[last], run);
        i += run;
        idx[last] += run;
        doff += run * p->ds[last];
        soff += run * p->ss[last];
        for (int k = last; k > 0 && idx[k] == p->shape[k]; k--) {
            doff += p->ds[k - 1] - p->shape[k] * p->ds[k];
            soff += p->ss[k - 1] - p->shape[k] * p->ss[k];
            idx[k] = 0;
            idx[k - 1]++;
        }
    }
}

/* Same-dtype contiguous: bytes [begin, end) of one block (ctx = plan). */
static void gj_rt_memcpy_range(void *ctx, int64_t begin, int64_t end) {
    const gj_rt_copy_plan *p = ctx;
    memcpy(p->dbase + begin, p->sbase + begin, (size_t)(end - begin));
}

#define GJ_RT_COPY_GRAIN 32768        /* elements per task, at least */
#define GJ_RT_MEMCPY_GRAIN (1 << 20)  /* bytes per task, at least */

int gj_rt_copy_into(gj_tensor *dst, const gj_tensor *src) {
    char b1[256], b2[256];
    if (!gj_rt_check_tensor(dst, "copy_into", "dst") || !gj_rt_check_tensor(src, "copy_into", "src"))
        return -1;
    if (gj_rt_is_abstract(dst) || gj_rt_is_abstract(src)) /* no bytes to copy */
        return gj_rt_storage_fetch(gj_rt_is_abstract(dst) ? dst->storage : src->storage, 0);
    int nd = dst->ndim, off = dst->ndim - src->ndim;
    bool ok = off >= 0;
    for (int k = 0; ok && k < src->ndim; k++)
        ok = src->shape[k] == dst->shape[k + off] || src->shape[k] == 1;
    if (!ok) {
        gj_rt_set_error("copy_into: cannot broadcast src %s %s to dst %s %s",
                        gj_rt_fmt_shape(b1, sizeof b1, src->ndim, src->shape),
                        gj_rt_dtype_name(src->dtype),
                        gj_rt_fmt_shape(b2, sizeof b2, dst->ndim, dst->shape),
                        gj_rt_dtype_name(dst->dtype));
        return -1;
    }
    if (dst->numel == 0)
        return 0;

    /* Effective src strides in dst's axes: broadcast axes read stride 0. */
    int64_t sst[GJ_MAX_DIMS];
    for (int k = 0; k < nd; k++) {
        int ks = k - off;
        sst[k] = (ks < 0 || src->shape[ks] != dst->shape[k]) ? 0 : src->strides[ks];
    }

    if (dst->storage == src->storage) {
        bool same = dst->dtype == src->dtype && dst->offset == src->offset;
        for (int k = 0; same && k < nd; k++)
            same = dst->shape[k] == 1 || dst->strides[k] == sst[k];
        if (same)
            return 0;
        /* Possible overlap: go through a private copy of src. */
        gj_tensor *tmp = gj_rt_tensor_empty(src->dtype, src->ndim, src->shape);
        if (!tmp)
            return -1;
        int rc = gj_rt_copy_into(tmp, src);
        if (rc == 0)
            rc = gj_rt_copy_into(dst, tmp);
        gj_rt_tensor_release(tmp);
        return rc;
    }

    /* Coalesce: drop size-1 axes, merge axes that are dense in both. */
    gj_rt_copy_plan p;
    memset(&p, 0, sizeof p);
    for (int k = 0; k < nd; k++) {
        if (dst->shape[k] == 1)
            continue;
        int j = p.nd - 1;
        if (j >= 0 && p.ds[j] == dst->strides[k] * dst->shape[k] && p.ss[j] == sst[k] * dst->shape[k]) {
            p.shape[j] *= dst->shape[k];
            p.ds[j] = dst->strides[k];
            p.ss[j] = sst[k];
        } else {
            p.shape[p.nd] = dst->shape[k];
            p.ds[p.nd] = dst->strides[k];
            p.ss[p.nd] = sst[k];
            p.nd++;
        }
    }
    if (p.nd == 0) {
        p.nd = 1;
        p.shape[0] = 1;
    }
    p.del = gj_rt_dtype_size(dst->dtype);
    p.sel = gj_rt_dtype_size(src->dtype);
    p.dbase = gj_rt_data_ptr(dst);
    p.sbase = gj_rt_data_ptr(src);
    p.fn = gj_rt_conv_table[dst->dtype][src->dtype];

    if (p.nd == 1 && p.ds[0] == 1 && p.ss[0] == 1 && dst->dtype == src->dtype) {
        gj_rt_parallel_for(p.shape[0] * (int64_t)p.del, GJ_RT_MEMCPY_GRAIN, gj_rt_memcpy_range, &p);
        return 0;
    }
    bool dst_overlaps = false; /* an expanded dst: several elements share memory */
    for (int k = 0; k < p.nd; k++)
        dst_overlaps |= p.ds[k] == 0 && p.shape[k] > 1;
    if (dst_overlaps)
        gj_rt_copy_range(&p, 0, dst->numel);
    else
        gj_rt_parallel_for(dst->numel, GJ_RT_COPY_GRAIN, gj_rt_copy_range, &p);
    return 0;
}

/* Contiguous version of t: t itself retained if already contiguous, else a
 * new tensor (new reference either way). NULL with error on OOM. */
gj_tensor *gj_rt_contiguous(gj_tensor *t) {
    if (gj_rt_is_contiguous(t)) {
        gj_rt_tensor_retain(t);
        return t;
    }
    gj_tensor *out = gj_rt_tensor_empty(t->dtype, t->ndim, t->shape);
    if (!out)
        return NULL;
    if (gj_rt_copy_into(out, t) != 0) {
        gj_rt_tensor_release(out);
        return NULL;
    }
    return out;
}
