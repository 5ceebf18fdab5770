/* SPDX-License-Identifier: MIT */
/*
 * json.c - the strict JSON parser of json.h (recursive descent).
 *
 * Invariants: the cursor never moves past `end` (every read checks it
 * first, so a value cut anywhere is "unexpected end", never a read out of
 * bounds); every node allocated is reachable from the tree under
 * construction, so one gj_fe_json_free releases everything on any failure;
 * recursion depth is bounded by GJ_FE_JSON_MAX_DEPTH. All memory comes
 * from gj_rt_malloc/realloc, so tests can make any allocation fail.
 */
#include "frontend/json.h"
#include "runtime/rt.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct js_parser {
    const char *text;
    size_t pos, len;
    char *err;
    size_t cap;
    bool failed;
} js_parser;

static void js_fail(js_parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Records the first error only, with the byte offset where it happened. */
static void js_fail(js_parser *p, const char *fmt, ...) {
    if (p->failed)
        return;
    p->failed = true;
    if (!p->err || p->cap == 0)
        return;
    int n = snprintf(p->err, p->cap, "byte %zu: ", p->pos);
    if (n < 0 || (size_t)n >= p->cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err + n, p->cap - (size_t)n, fmt, ap);
    va_end(ap);
}

static void js_skip_ws(js_parser *p) {
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

/* The character at the cursor for a message: 'x', or a byte value. */
static const char *js_what(js_parser *p, char *buf, size_t cap) {
    if (p->pos >= p->len)
        return "the end of the text";
    unsigned char c = (unsigned char)p->text[p->pos];
    if (c >= 0x20 && c < 0x7f)
        snprintf(buf, cap, "'%c'", c);
    else
        snprintf(buf, cap, "byte 0x%02x", c);
    return buf;
}

/* Length of the UTF-8 sequence starting at s[0..n) if valid, else 0. */
static size_t js_utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80)
        return 1;
    size_t need;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf) {
        need = 2, cp = c & 0x1f, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 3, cp = c & 0x0f, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4, cp = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < need)
        return 0;
    for (size_t k = 1; k < need; k++) {
        if ((s[k] & 0xc0) != 0x80)
            return 0;
        cp = cp << 6 | (s[k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return need;
}

bool gj_fe_json_utf8_valid(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t k = js_utf8_seq(u + i, n - i);
        if (k == 0)
            return false;
        i += k;
    }
    return true;
}

static int js_hex4(js_parser *p, uint32_t *out) {
    if (p->len - p->pos < 4) {
        js_fail(p, "unexpected end inside a \\u escape");
        return -1;
    }
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p->text[p->pos];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) {
            js_fail(p, "bad hex digit in a \\u escape");
            return -1;
        }
        v = v << 4 | (uint32_t)d;
        p->pos++;
    }
    *out = v;
    return 0;
}

/* Parses a string at the cursor (on '"'); *out is a NUL-terminated copy
 * (gj_rt_malloc'd), *out_len its length. 0 or -1. */
static int js_string(js_parser *p, char **out, size_t *out_len) {
    *out = NULL;
    p->pos++; /* '"' */
    /* The decoded string is never longer than its source text. */
    size_t start = p->pos, cap = 1;
    for (size_t i = start; i < p->len && p->text[i] != '"'; i++)
        cap += (p->text[i] == '\\' && i + 1 < p->len) ? (i++, 2) : 1;
    cap += 4;
    char *buf = gj_rt_malloc(cap);
    if (!buf) {
        js_fail(p, "out of memory");
        return -1;
    }
    size_t n = 0;
    for (;;) {
        if (p->pos >= p->len) {
            js_fail(p, "unexpected end inside a string");
            goto fail;
        }
        unsigned char c = (unsigned char)p->text[p->pos];
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c < 0x20) {
            js_fail(p, "control character 0x%02x inside a string", c);
            goto fail;
        }
        if (c == '\\') {
            p->pos++;
            if (p->pos >= p->len) {
                js_fail(p, "unexpected end inside a string");
                goto fail;
            }
            char e = p->text[p->pos++];
            uint32_t cp;
            switch (e) {
            case '"': buf[n++] = '"'; continue;
            case '\\': buf[n++] = '\\'; continue;
            case '/': buf[n++] = '/'; continue;
            case 'b': buf[n++] = '\b'; continue;
            case 'f': buf[n++] = '\f'; continue;
            case 'n': buf[n++] = '\n'; continue;
            case 'r': buf[n++] = '\r'; continue;
            case 't': buf[n++] = '\t'; continue;
            case 'u':
                if (js_hex4(p, &cp) != 0)
                    goto fail;
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    uint32_t lo;
                    if (p->len - p->pos < 2 || p->text[p->pos] != '\\' ||
                        p->text[p->pos + 1] != 'u') {
                        js_fail(p, "high surrogate \\u%04x without a low surrogate", cp);
                        goto fail;
                    }
                    p->pos += 2;
                    if (js_hex4(p, &lo) != 0)
                        goto fail;
                    if (lo < 0xdc00 || lo > 0xdfff) {
                        js_fail(p, "high surrogate followed by \\u%04x", lo);
                        goto fail;
                    }
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                } else if (cp >= 0xdc00 && cp <= 0xdfff) {
                    js_fail(p, "lone low surrogate \\u%04x", cp);
                    goto fail;
                }
                if (cp == 0) {
                    js_fail(p, "\\u0000 inside a string is not accepted");
                    goto fail;
                }
                /* Encoded length (<= 4) never exceeds the 6+ source bytes. */
                if (cp < 0x80) {
                    buf[n++] = (char)cp;
                } else if (cp < 0x800) {
                    buf[n++] = (char)(0xc0 | cp >> 6);
                    buf[n++] = (char)(0x80 | (cp & 0x3f));
                } else if (cp < 0x10000) {
                    buf[n++] = (char)(0xe0 | cp >> 12);
                    buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3f));
                    buf[n++] = (char)(0x80 | (cp & 0x3f));
                } else {
                    buf[n++] = (char)(0xf0 | cp >> 18);
                    buf[n++] = (char)(0x80 | ((cp >> 12) & 0x3f));
                    buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3f));
                    buf[n++] = (char)(0x80 | (cp & 0x3f));
                }
                continue;
            default:
                p->pos--;
                js_fail(p, "unknown escape '\\%c'", e >= 0x20 && e < 0x7f ? e : '?');
                goto fail;
            }
        }
        size_t k = js_utf8_seq((const unsigned char *)p->text + p->pos, p->len - p->pos);
        if (k == 0) {
            js_fail(p, "invalid UTF-8 inside a string");
            goto fail;
        }
        memcpy(buf + n, p->text + p->pos, k);
        n += k;
        p->pos += k;
    }
    buf[n] = '\0';
    *out = buf;
    *out_len = n;
    return 0;
fail:
    gj_rt_free(buf);
    return -1;
}

/* RFC 8259 number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static int js_number(js_parser *p, gj_fe_json *v) {
    size_t s = p->pos;
    bool neg = false, integral = true, overflow = false;
    uint64_t mag = 0;
    if (p->text[p->pos] == '-') {
        neg = true;
        p->pos++;
    }
    if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') {
        js_fail(p, "expected a digit");
        return -1;
    }
    if (p->text[p->pos] == '0') {
        p->pos++;
        if (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') {
            js_fail(p, "a number with a leading zero");
            return -1;
        }
    } else {
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') {
            unsigned d = (unsigned)(p->text[p->pos] - '0');
            if (mag > (UINT64_MAX - d) / 10)
                overflow = true;
            else
                mag = mag * 10 + d;
            p->pos++;
        }
    }
    if (p->pos < p->len && p->text[p->pos] == '.') {
        integral = false;
        p->pos++;
        if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') {
            js_fail(p, "expected a digit after '.'");
            return -1;
        }
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9')
            p->pos++;
    }
    if (p->pos < p->len && (p->text[p->pos] == 'e' || p->text[p->pos] == 'E')) {
        integral = false;
        p->pos++;
        if (p->pos < p->len && (p->text[p->pos] == '+' || p->text[p->pos] == '-'))
            p->pos++;
        if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') {
            js_fail(p, "expected a digit in an exponent");
            return -1;
        }
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9')
            p->pos++;
    }
    v->kind = GJ_FE_JSON_NUMBER;
    v->offset = s;
    if (integral && !overflow) {
        if (!neg && mag <= (uint64_t)INT64_MAX) {
            v->is_int = true;
            v->integer = (int64_t)mag;
        } else if (neg && mag <= (uint64_t)INT64_MAX + 1) {
            v->is_int = true;
            v->integer = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
        }
    }
    return 0;
}

static int js_value(js_parser *p, gj_fe_json *v, int depth);

static void js_free_inner(gj_fe_json *v) {
    if (v->kind == GJ_FE_JSON_STRING) {
        gj_rt_free(v->str);
    } else if (v->kind == GJ_FE_JSON_ARRAY || v->kind == GJ_FE_JSON_OBJECT) {
        for (size_t i = 0; i < v->len; i++) {
            js_free_inner(&v->items[i]);
            if (v->keys)
                gj_rt_free(v->keys[i]);
        }
        gj_rt_free(v->items);
        gj_rt_free(v->keys);
    }
    memset(v, 0, sizeof *v);
}

/* Grows an array/object node to hold one more item. 0 or -1. */
static int js_grow(js_parser *p, gj_fe_json *v, size_t *cap) {
    if (v->len < *cap)
        return 0;
    size_t nc = *cap ? *cap * 2 : 4;
    gj_fe_json *items = gj_rt_realloc(v->items, nc * sizeof *items);
    if (!items) {
        js_fail(p, "out of memory");
        return -1;
    }
    v->items = items;
    if (v->kind == GJ_FE_JSON_OBJECT) {
        char **keys = gj_rt_realloc(v->keys, nc * sizeof *keys);
        if (!keys) {
            js_fail(p, "out of memory");
            return -1;
        }
        v->keys = keys;
    }
    *cap = nc;
    return 0;
}

static int js_cmp_keys(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A key given twice in one object: found by sorting copies of the key
 * pointers, O(n log n) even for a forged header with many keys. */
static int js_check_duplicates(js_parser *p, const gj_fe_json *v) {
    if (v->len < 2)
        return 0;
    char **sorted = gj_rt_malloc(v->len * sizeof *sorted);
    if (!sorted) {
        js_fail(p, "out of memory");
        return -1;
    }
    memcpy(sorted, v->keys, v->len * sizeof *sorted);
    qsort(sorted, v->len, sizeof *sorted, js_cmp_keys);
    int rc = 0;
    for (size_t i = 1; i < v->len; i++) {
        if (strcmp(sorted[i - 1], sorted[i]) == 0) {
            p->pos = v->offset;
            js_fail(p, "the object starting here has the key \"%.200s\" twice", sorted[i]);
            rc = -1;
            break;
        }
    }
    gj_rt_free(sorted);
    return rc;
}

static int js_container(js_parser *p, gj_fe_json *v, int depth, bool object) {
    if (depth >= GJ_FE_JSON_MAX_DEPTH) {
        js_fail(p, "nesting deeper than %d levels", GJ_FE_JSON_MAX_DEPTH);
        return -1;
    }
    v->kind = object ? GJ_FE_JSON_OBJECT : GJ_FE_JSON_ARRAY;
    v->offset = p->pos;
    p->pos++; /* '{' or '[' */
    char close = object ? '}' : ']', what[16];
    size_t cap = 0;
    js_skip_ws(p);
    if (p->pos < p->len && p->text[p->pos] == close) {
        p->pos++;
        return 0;
    }
    for (;;) {
        js_skip_ws(p);
        if (js_grow(p, v, &cap) != 0)
            return -1;
        char *key = NULL;
        if (object) {
            size_t klen;
            if (p->pos >= p->len || p->text[p->pos] != '"') {
                js_fail(p, "expected a string key, found %s", js_what(p, what, sizeof what));
                return -1;
            }
            if (js_string(p, &key, &klen) != 0)
                return -1;
            js_skip_ws(p);
            if (p->pos >= p->len || p->text[p->pos] != ':') {
                js_fail(p, "expected ':' after an object key, found %s",
                        js_what(p, what, sizeof what));
                gj_rt_free(key);
                return -1;
            }
            p->pos++;
            js_skip_ws(p);
        }
        gj_fe_json item = {0};
        int rc = js_value(p, &item, depth + 1);
        /* Attach even a partial item: it is freed with the tree. */
        v->items[v->len] = item;
        if (object)
            v->keys[v->len] = key;
        v->len++;
        if (rc != 0)
            return -1;
        js_skip_ws(p);
        if (p->pos < p->len && p->text[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->pos < p->len && p->text[p->pos] == close) {
            p->pos++;
            break;
        }
        js_fail(p, "expected ',' or '%c', found %s", close, js_what(p, what, sizeof what));
        return -1;
    }
    return object ? js_check_duplicates(p, v) : 0;
}

static int js_literal(js_parser *p, const char *word) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0) {
        js_fail(p, "invalid literal (expected %s)", word);
        return -1;
    }
    p->pos += n;
    return 0;
}

static int js_value(js_parser *p, gj_fe_json *v, int depth) {
    char what[16];
    js_skip_ws(p);
    if (p->pos >= p->len) {
        js_fail(p, "unexpected end, expected a value");
        return -1;
    }
    v->offset = p->pos;
    switch (p->text[p->pos]) {
    case '{': return js_container(p, v, depth, true);
    case '[': return js_container(p, v, depth, false);
    case '"':
        v->kind = GJ_FE_JSON_STRING;
        return js_string(p, &v->str, &v->len);
    case 't':
        v->kind = GJ_FE_JSON_BOOL;
        v->boolean = true;
        return js_literal(p, "true");
    case 'f':
        v->kind = GJ_FE_JSON_BOOL;
        return js_literal(p, "false");
    case 'n':
        v->kind = GJ_FE_JSON_NULL;
        return js_literal(p, "null");
    default:
        if (p->text[p->pos] == '-' || (p->text[p->pos] >= '0' && p->text[p->pos] <= '9'))
            return js_number(p, v);
        js_fail(p, "expected a value, found %s", js_what(p, what, sizeof what));
        return -1;
    }
}

gj_fe_json *gj_fe_json_parse(const char *text, size_t len, char *err, size_t cap) {
    js_parser p = {.text = text, .len = len, .err = err, .cap = cap};
    if (err && cap)
        err[0] = '\0';
    if (!text) {
        js_fail(&p, "no text");
        return NULL;
    }
    gj_fe_json *root = gj_rt_calloc(1, sizeof *root);
    if (!root) {
        js_fail(&p, "out of memory");
        return NULL;
    }
    if (js_value(&p, root, 0) != 0)
        goto fail;
    js_skip_ws(&p);
    if (p.pos != p.len) {
        char what[16];
        js_fail(&p, "%s after the end of the JSON value", js_what(&p, what, sizeof what));
        goto fail;
    }
    return root;
fail:
    gj_fe_json_free(root);
    return NULL;
}

void gj_fe_json_free(gj_fe_json *v) {
    if (!v)
        return;
    js_free_inner(v);
    gj_rt_free(v);
}

const gj_fe_json *gj_fe_json_get(const gj_fe_json *obj, const char *key) {
    if (!obj || obj->kind != GJ_FE_JSON_OBJECT)
        return NULL;
    for (size_t i = 0; i < obj->len; i++)
        if (strcmp(obj->keys[i], key) == 0)
            return &obj->items[i];
    return NULL;
}

const char *gj_fe_json_kind_name(gj_fe_json_kind k) {
    switch (k) {
    case GJ_FE_JSON_NULL: return "null";
    case GJ_FE_JSON_BOOL: return "boolean";
    case GJ_FE_JSON_NUMBER: return "number";
    case GJ_FE_JSON_STRING: return "string";
    case GJ_FE_JSON_ARRAY: return "array";
    case GJ_FE_JSON_OBJECT: return "object";
    }
    return "?";
}

static int js_put(char **buf, size_t *pos, size_t *cap, const char *s, size_t n) {
    if (*pos + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 256;
        while (nc < *pos + n + 1)
            nc *= 2;
        char *b = gj_rt_realloc(*buf, nc);
        if (!b)
            return -1;
        *buf = b;
        *cap = nc;
    }
    memcpy(*buf + *pos, s, n);
    *pos += n;
    (*buf)[*pos] = '\0';
    return 0;
}

int gj_fe_json_append_string(char **buf, size_t *pos, size_t *cap, const char *s) {
    if (js_put(buf, pos, cap, "\"", 1) != 0)
        return -1;
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        char esc[8];
        const char *out = esc;
        size_t n = 2;
        switch (*c) {
        case '"': out = "\\\""; break;
        case '\\': out = "\\\\"; break;
        case '\n': out = "\\n"; break;
        case '\r': out = "\\r"; break;
        case '\t': out = "\\t"; break;
        case '\b': out = "\\b"; break;
        case '\f': out = "\\f"; break;
        default:
            if (*c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", *c);
                n = 6;
            } else {
                esc[0] = (char)*c;
                n = 1;
            }
        }
        if (js_put(buf, pos, cap, out, n) != 0)
            return -1;
    }
    return js_put(buf, pos, cap, "\"", 1);
}
