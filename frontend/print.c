// SPDX-License-Identifier: MIT
/*
 * print.c - a tensor's values as text, in the layout of PyTorch's repr:
 *   tensor([[ 1.0000, -2.5000],
 *           [ 0.0000,  3.0000]], dtype=f32, requires_grad=true)
 * Floats get four decimals in one common width (scientific notation when
 * the magnitudes call for it, as PyTorch switches); a dimension longer than
 * 2 * edge + 1 shows its first and last `edge` entries around "...".
 * The text is built in a growing buffer (one allocation path) and returned
 * to the caller to free with gj_free_string.
 */
#include "fe.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sbuf {
    char *s;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_put(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = (b->cap + (size_t)n + 1) * 2;
        char *s = gj_rt_realloc(b->s, nc);
        if (!s) {
            b->oom = true;
            return;
        }
        b->s = s;
        b->cap = nc;
    }
}

typedef struct pctx {
    const gj_tensor *t;
    int edge, width;
    bool sci, integer;
    sbuf *b;
} pctx;

static bool shown(int64_t i, int64_t n, int edge) {
    return n <= 2 * (int64_t)edge + 1 || i < edge || i >= n - edge;
}

static void fmt_value(const pctx *c, double v, char *out, size_t cap) {
    if (isnan(v)) snprintf(out, cap, "nan");
    else if (isinf(v)) snprintf(out, cap, v > 0 ? "inf" : "-inf");
    else if (c->integer) snprintf(out, cap, "%.0f", v);
    else if (c->sci) snprintf(out, cap, "%.4e", v);
    else snprintf(out, cap, "%.4f", v);
}

/* Dimension d of the view from flat row-major offset base (elements). */
static void print_dim(const pctx *c, int d, int64_t base, int indent) {
    const gj_tensor *t = c->t;
    sbuf *b = c->b;
    int64_t n = t->shape[d], inner = 1;
    for (int k = d + 1; k < t->ndim; k++) inner *= t->shape[k];
    sb_put(b, "[");
    bool skipped = false;
    for (int64_t i = 0; i < n; i++) {
        if (!shown(i, n, c->edge)) {
            if (!skipped) {
                sb_put(b, "...");
                skipped = true;
                if (i + 1 < n) sb_put(b, d == t->ndim - 1 ? ", " : ",\n%*s", indent + 1, "");
            }
            continue;
        }
        if (d == t->ndim - 1) {
            char v[64];
            fmt_value(c, gj_rt_get(t, base + i), v, sizeof v);
            sb_put(b, "%*s", c->width, v);
        } else {
            print_dim(c, d + 1, base + i * inner, indent + 1);
        }
        if (i + 1 < n) {
            if (d == t->ndim - 1) sb_put(b, ", ");
            else sb_put(b, ",%s%*s", d + 2 < t->ndim ? "\n\n" : "\n", indent + 1, "");
        }
    }
    sb_put(b, "]");
}

static const char *dt_name(gj_dtype d) {
    return d == GJ_F32 ? "f32" : d == GJ_F64 ? "f64" : d == GJ_BF16 ? "bf16" : "i64";
}

char *gj_tensor_format(const gj_tensor *t, int edge) {
    if (t) GJ_FE_TRACE_READ(t, "gj_tensor_format", false);
    if (!gj_rt_check_tensor(t, "gj_tensor_format", "t") || gj_rt_present(t) != 0) return NULL;
    if (edge < 1) edge = 3;
    sbuf b = {0};
    b.cap = 256;
    b.s = gj_rt_malloc(b.cap);
    if (!b.s) return NULL;
    pctx c = {.t = t, .edge = edge, .b = &b, .integer = t->dtype == GJ_I64};
    /* one format for all shown values: fixed unless the magnitudes span
     * more than PyTorch's fixed-point range */
    double lo = INFINITY, hi = 0;
    for (int64_t i = 0; i < t->numel; i++) {
        int64_t r = i;
        bool vis = true;
        for (int d = t->ndim - 1; d >= 0; d--) {
            vis &= shown(r % t->shape[d], t->shape[d], edge);
            r /= t->shape[d];
        }
        if (!vis) continue;
        double v = fabs(gj_rt_get(t, i));
        if (!isfinite(v)) continue;
        if (v != 0 && v < lo) lo = v;
        if (v > hi) hi = v;
    }
    /* PyTorch's rule: scientific when the largest shown magnitude is
     * >= 1e8, the smallest non-zero one < 1e-4, or they differ by > 1000 */
    if (!c.integer && lo != INFINITY) c.sci = hi >= 1e8 || lo < 1e-4 || hi / lo > 1e3;
    char v[64];
    for (int64_t i = 0; i < t->numel; i++) { /* the common width */
        fmt_value(&c, gj_rt_get(t, i), v, sizeof v);
        int w = (int)strlen(v);
        if (w > c.width) c.width = w;
    }
    sb_put(&b, "tensor(");
    if (t->ndim == 0) {
        fmt_value(&c, gj_rt_get(t, 0), v, sizeof v);
        sb_put(&b, "%s", v);
    } else if (t->numel == 0) {
        sb_put(&b, "[], size=(");
        for (int d = 0; d < t->ndim; d++)
            sb_put(&b, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        sb_put(&b, ")");
    } else {
        print_dim(&c, 0, 0, (int)strlen("tensor("));
    }
    sb_put(&b, ", dtype=%s%s)", dt_name(t->dtype),
           gj_requires_grad(t) ? ", requires_grad=true" : "");
    if (b.oom) {
        gj_rt_free(b.s);
        gj_rt_set_error("gj_tensor_format: out of memory");
        return NULL;
    }
    return b.s;
}

void gj_free_string(char *s) { gj_rt_free(s); }

int gj_tensor_print(const gj_tensor *t) {
    char *s = gj_tensor_format(t, 3);
    if (!s) return -1;
    int rc = printf("%s\n", s) < 0 ? -1 : 0;
    gj_free_string(s);
    return rc;
}
