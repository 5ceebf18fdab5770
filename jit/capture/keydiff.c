/* SPDX-License-Identifier: MIT */
/*
 * keydiff.c - why a call site compiles again: the first difference between
 * two keys of one site (key.c's text), said in the words of the graph
 * (GRADJIT_LOG=recompiles, like PyTorch's TORCH_LOGS=recompiles).
 *
 * Invariants:
 *   - Works on key texts only (never on the graphs): a key is lines, each
 *     line tokens separated by single spaces; the first token names the
 *     line ("R<r>" root, "N<i>" node, "N<i>." a line of node i's
 *     checkpoint tape, "gradjit-key" the header).
 *   - Two keys of one call site have the same nodes, op names, edges and
 *     ranks; what differs is a meta (dtype, a size), a layout, an attribute
 *     value, a tape's contents or a .grad's presence. Anything else is
 *     still described, as the two differing tokens.
 *   - Pure functions of the texts: no allocation, nothing global.
 */
#include "jit/capture/capture.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A span of text [p, p + n). */
typedef struct span {
    const char *p;
    size_t n;
} span;

/* Line k (0-based) of text: true and *out, or false past the end. */
static bool nth_line(const char *t, size_t len, int k, span *out) {
    const char *end = t + len;
    *out = (span){"", 0};
    for (int i = 0; t < end; i++) {
        const char *nl = memchr(t, '\n', (size_t)(end - t));
        size_t n = nl ? (size_t)(nl - t) : (size_t)(end - t);
        if (i == k) {
            *out = (span){t, n};
            return true;
        }
        t += n + 1;
    }
    return false;
}

static int count_lines(const char *t, size_t len) {
    int n = 0;
    span s;
    while (nth_line(t, len, n, &s)) n++;
    return n;
}

static bool span_eq(span a, span b) { return a.n == b.n && memcmp(a.p, b.p, a.n) == 0; }

/* Token k of a line: true and *out, or false. */
static bool nth_tok(span line, int k, span *out) {
    const char *p = line.p, *end = line.p + line.n;
    *out = (span){"", 0};
    for (int i = 0; p <= end; i++) {
        const char *sp = memchr(p, ' ', (size_t)(end - p));
        size_t n = sp ? (size_t)(sp - p) : (size_t)(end - p);
        if (i == k) {
            *out = (span){p, n};
            return true;
        }
        if (!sp) return false;
        p = sp + 1;
    }
    return false;
}

int gj_jit_key_distance(const char *a, size_t na, const char *b, size_t nb) {
    int la = count_lines(a, na), lb = count_lines(b, nb), d = abs(la - lb);
    for (int k = 0; k < la && k < lb; k++) {
        span x, y;
        nth_line(a, na, k, &x);
        nth_line(b, nb, k, &y);
        d += !span_eq(x, y);
    }
    return d;
}

/* ------------------------------------------------------- describing */

typedef struct out_buf {
    char *p;
    size_t cap, len;
} out_buf;

static void put(out_buf *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out_buf *o, const char *fmt, ...) {
    if (o->len + 1 >= o->cap) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->p + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    if (n > 0) o->len += (size_t)n < o->cap - o->len ? (size_t)n : o->cap - o->len - 1;
}

/* A meta inside a token: "<prefix><dtype>[d0,d1,...]<suffix>". */
typedef struct meta_tok {
    bool ok;
    span prefix, suffix;
    int dtype;
    int ndim;
    long long dims[GJ_MAX_DIMS + 1];
} meta_tok;

static meta_tok parse_meta(span t) {
    meta_tok m = {0};
    const char *lb = memchr(t.p, '[', t.n);
    const char *rb = lb ? memchr(lb, ']', (size_t)(t.p + t.n - lb)) : NULL;
    if (!lb || !rb) return m;
    const char *d = lb;
    while (d > t.p && d[-1] >= '0' && d[-1] <= '9') d--;
    if (d == lb) return m;
    m.dtype = atoi(d);
    m.prefix = (span){t.p, (size_t)(d - t.p)};
    m.suffix = (span){rb + 1, (size_t)(t.p + t.n - rb - 1)};
    for (const char *p = lb + 1; p < rb && m.ndim <= GJ_MAX_DIMS;) {
        char *e;
        m.dims[m.ndim++] = strtoll(p, &e, 10);
        if (e == p) return m;
        p = *e == ',' ? e + 1 : e;
    }
    m.ok = true;
    return m;
}

static void put_shape(out_buf *o, const meta_tok *m) {
    put(o, "[");
    for (int k = 0; k < m->ndim; k++) put(o, k ? ", %lld" : "%lld", m->dims[k]);
    put(o, "]");
}

static const char *dtype_name(int d) {
    return d >= (int)GJ_F32 && d <= (int)GJ_I64 ? gj_rt_dtype_name((gj_dtype)d) : "?";
}

/* Describes two differing metas; false if neither token is a meta. */
static bool describe_meta(out_buf *o, span a, span b) {
    meta_tok x = parse_meta(a), y = parse_meta(b);
    if (!x.ok || !y.ok) return false;
    if (x.dtype != y.dtype) {
        put(o, "dtype mismatch: expected %s, actual %s", dtype_name(x.dtype), dtype_name(y.dtype));
    } else if (x.ndim != y.ndim) {
        put(o, "rank mismatch: expected %d, actual %d", x.ndim, y.ndim);
    } else {
        int k = 0;
        while (k < x.ndim && x.dims[k] == y.dims[k]) k++;
        if (k < x.ndim) {
            put(o, "size mismatch at dim %d: expected %lld, actual %lld", k, x.dims[k], y.dims[k]);
        } else if (!span_eq(x.suffix, y.suffix)) {
            put(o, "layout mismatch: expected %.*s, actual %.*s", (int)x.suffix.n, x.suffix.p,
                (int)y.suffix.n, y.suffix.p);
            return true;
        } else {
            put(o, "expected %.*s, actual %.*s", (int)a.n, a.p, (int)b.n, b.p);
            return true;
        }
    }
    put(o, " (shape ");
    put_shape(o, &x);
    put(o, " -> ");
    put_shape(o, &y);
    put(o, ")");
    return true;
}

/* Value k of an attribute list "a[f<x>,<x>...][i<n>,<n>...]": its span
 * in the f (is_f) or i part, false if absent. */
static bool attr_item(span t, bool is_f, int k, span *out) {
    *out = (span){"", 0};
    const char *p = t.p + 1, *end = t.p + t.n; /* after 'a' */
    const char *ip = memchr(p, 'i', (size_t)(end - p));
    const char *lo = is_f ? p : ip, *hi = is_f ? (ip ? ip : end) : end;
    if (!lo || lo >= hi || *lo != (is_f ? 'f' : 'i')) return false;
    lo++;
    for (int i = 0; lo <= hi; i++) {
        const char *c = memchr(lo, ',', (size_t)(hi - lo));
        size_t n = c ? (size_t)(c - lo) : (size_t)(hi - lo);
        if (i == k) {
            *out = (span){lo, n};
            return true;
        }
        if (!c) return false;
        lo = c + 1;
    }
    return false;
}

/* Describes two differing attribute tokens ("a..."). */
static void describe_attrs(out_buf *o, span a, span b) {
    for (int f = 1; f >= 0; f--)
        for (int k = 0; k < GJ_MAX_DIMS + 4; k++) {
            span x, y;
            bool hx = attr_item(a, f, k, &x), hy = attr_item(b, f, k, &y);
            if (!hx && !hy) break;
            if (hx && hy && span_eq(x, y)) continue;
            if (hx && hy && f) {
                char bx[64], by[64];
                snprintf(bx, sizeof bx, "%.*s", (int)x.n, x.p);
                snprintf(by, sizeof by, "%.*s", (int)y.n, y.p);
                put(o, "attribute f[%d] mismatch: expected %.17g, actual %.17g", k,
                    strtod(bx, NULL), strtod(by, NULL));
            } else if (hx && hy) {
                put(o, "attribute i[%d] mismatch: expected %.*s, actual %.*s", k, (int)x.n, x.p,
                    (int)y.n, y.p);
            } else {
                put(o, "attribute %c[%d] %s", f ? 'f' : 'i', k, hx ? "removed" : "added");
            }
            return;
        }
    put(o, "attributes: expected %.*s, actual %.*s", (int)a.n, a.p, (int)b.n, b.p);
}

/* What token k of a node line is (scanning the section keywords before it). */
static void put_role(out_buf *o, span line, int k) {
    const char *sec = NULL;
    int idx = 0;
    for (int i = 0; i < k; i++) {
        span t;
        if (!nth_tok(line, i, &t)) break;
        if (t.n == 2 && memcmp(t.p, "in", 2) == 0) {
            sec = "input";
            idx = -1;
        } else if (t.n == 3 && memcmp(t.p, "out", 3) == 0) {
            sec = "output";
            idx = -1;
        } else if (t.n >= 5 && memcmp(t.p, "saved", 5) == 0) {
            sec = "saved tensor";
            idx = -1;
        } else if (t.n == 2 && memcmp(t.p, "sv", 2) == 0) {
            sec = "saved value";
            idx = -1;
        }
        if (sec) idx++;
    }
    span t;
    nth_tok(line, k, &t);
    if (t.n >= 4 && memcmp(t.p, "leaf", 4) == 0) {
        put(o, "leaf ");
    } else if (t.n >= 4 && memcmp(t.p, "grad", 4) == 0) {
        put(o, ".grad ");
    } else if (t.n >= 4 && memcmp(t.p, "seed", 4) == 0) {
        put(o, "seed gradient ");
    } else if (t.n >= 1 && t.p[0] == 'm' && !sec) {
        put(o, "root value ");
    } else if (sec) {
        put(o, "%s %d ", sec, idx);
    }
}

/* Describes line x (old) vs y (new) of the same position. */
static void describe_line(out_buf *o, span x, span y) {
    span h0;
    nth_tok(y, 0, &h0);
    bool tape = h0.n > 1 && h0.p[h0.n - 1] == '.';
    int first = 0; /* first token of the line's payload */
    if (h0.n >= 1 && h0.p[0] == 'N') {
        span op, rank;
        char idx[24];
        snprintf(idx, sizeof idx, "%.*s", (int)(h0.n - 1 - tape), h0.p + 1);
        if (tape) {
            span e, eop;
            if (nth_tok(y, 1, &e) && e.n && e.p[0] == 'E' && nth_tok(y, 2, &eop)) {
                put(o, "node #%s checkpoint, tape op #%.*s %.*s: ", idx, (int)(e.n - 1), e.p + 1,
                    (int)eop.n, eop.p);
                first = 3;
            } else if (nth_tok(y, 1, &e) && e.n && e.p[0] == 'S') {
                put(o, "node #%s checkpoint, tape source #%.*s: ", idx, (int)(e.n - 1), e.p + 1);
                first = 2;
            } else {
                put(o, "node #%s checkpoint, tape: ", idx);
                first = 1;
            }
        } else if (nth_tok(y, 1, &op) && nth_tok(y, 2, &rank)) {
            put(o, "node #%s %.*s (creation rank %.*s): ", idx,
                op.n == 3 && memcmp(op.p, "acc", 3) == 0 ? 10 : (int)op.n,
                op.n == 3 && memcmp(op.p, "acc", 3) == 0 ? "accumulate" : op.p, (int)rank.n - 1,
                rank.p + 1);
            first = 3;
        }
    } else if (h0.n >= 1 && h0.p[0] == 'R') {
        put(o, "root #%.*s: ", (int)h0.n - 1, h0.p + 1);
        first = 1;
    } else {
        put(o, "graph: ");
    }
    /* the first differing token that is not the attribute list, then the
     * attributes: a size that changed explains the attributes computed
     * from it (a mean's 1/n), not the other way round */
    int k_attr = -1, k_other = -1;
    for (int k = first; k_other < 0; k++) {
        span a, b;
        bool ha = nth_tok(x, k, &a), hb = nth_tok(y, k, &b);
        if (!ha && !hb) break;
        if (ha && hb && span_eq(a, b)) continue;
        bool attr = ha && hb && k == first && a.n && b.n && a.p[0] == 'a' && b.p[0] == 'a';
        if (attr)
            k_attr = k;
        else
            k_other = k;
    }
    if (k_other >= 0) {
        span a, b;
        bool ha = nth_tok(x, k_other, &a), hb = nth_tok(y, k_other, &b);
        if (!ha || !hb) {
            put(o, "%s token %.*s", ha ? "removed" : "added", ha ? (int)a.n : (int)b.n,
                ha ? a.p : b.p);
        } else {
            put_role(o, y, k_other);
            if (!describe_meta(o, a, b))
                put(o, "expected %.*s, actual %.*s", (int)a.n, a.p, (int)b.n, b.p);
        }
        if (k_attr >= 0) put(o, "; and ");
    }
    if (k_attr >= 0) {
        span a, b;
        nth_tok(x, k_attr, &a);
        nth_tok(y, k_attr, &b);
        describe_attrs(o, a, b);
    }
    if (k_attr < 0 && k_other < 0) put(o, "(lines differ in spacing only)");
}

int gj_jit_key_diff(const char *old_key, size_t old_len, const char *new_key, size_t new_len,
                    char *out, size_t cap) {
    out_buf o = {out, cap, 0};
    if (cap) out[0] = '\0';
    int n_old = count_lines(old_key, old_len), n_new = count_lines(new_key, new_len);
    int d = gj_jit_key_distance(old_key, old_len, new_key, new_len);
    for (int k = 0; k < n_old || k < n_new; k++) {
        span x = {"", 0}, y = {"", 0};
        bool hx = nth_line(old_key, old_len, k, &x), hy = nth_line(new_key, new_len, k, &y);
        if (hx && hy && span_eq(x, y)) continue;
        if (!hx || !hy) {
            put(&o, "the key has %d lines, was %d (line %d: %.*s)", n_new, n_old, k + 1,
                (int)(hx ? x.n : y.n) > 80 ? 80 : (int)(hx ? x.n : y.n), hx ? x.p : y.p);
            return d;
        }
        describe_line(&o, x, y);
        return d;
    }
    put(&o, "the keys are equal");
    return 0;
}
