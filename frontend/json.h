/* SPDX-License-Identifier: MIT */
/*
 * json.h - a small strict JSON parser (RFC 8259) for the headers of
 * safetensors files (frontend/safetensors.c). Internal, not installed.
 *
 * The parser trusts nothing: it reads exactly len bytes (no NUL needed),
 * rejects anything RFC 8259 does not allow (trailing commas, single
 * quotes, control characters and invalid UTF-8 in strings, leading zeros,
 * NaN, comments), rejects a key given twice in one object, \u0000 in a
 * string (names become C strings) and nesting deeper than
 * GJ_FE_JSON_MAX_DEPTH. Integers without fraction or exponent that fit in
 * int64 are flagged as such; other numbers are only validated.
 */
#ifndef GJ_FE_JSON_H
#define GJ_FE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GJ_FE_JSON_MAX_DEPTH 32

typedef enum gj_fe_json_kind {
    GJ_FE_JSON_NULL = 0,
    GJ_FE_JSON_BOOL,
    GJ_FE_JSON_NUMBER,
    GJ_FE_JSON_STRING,
    GJ_FE_JSON_ARRAY,
    GJ_FE_JSON_OBJECT,
} gj_fe_json_kind;

typedef struct gj_fe_json gj_fe_json;
struct gj_fe_json {
    gj_fe_json_kind kind;
    bool boolean;        /* BOOL */
    bool is_int;         /* NUMBER: an integer (no '.', no exponent) within int64 */
    int64_t integer;     /* NUMBER when is_int */
    char *str;           /* STRING: UTF-8, NUL-terminated (no NUL inside) */
    size_t len;          /* STRING: bytes; ARRAY/OBJECT: number of items */
    gj_fe_json *items;   /* ARRAY/OBJECT: [len] values, in document order */
    char **keys;         /* OBJECT: [len] keys (NUL-terminated UTF-8) */
    size_t offset;       /* byte offset of the value in the text (for messages) */
};

/* Parses text[0..len) as one JSON value followed only by whitespace.
 * Returns a tree to free with gj_fe_json_free, or NULL with the reason
 * ("byte 17: expected ':' after an object key") written to err[0..cap). */
gj_fe_json *gj_fe_json_parse(const char *text, size_t len, char *err, size_t cap);
void gj_fe_json_free(gj_fe_json *v); /* NULL is ignored */
/* The member `key` of an object, or NULL. */
const gj_fe_json *gj_fe_json_get(const gj_fe_json *obj, const char *key);
/* "null", "boolean", "number", "string", "array", "object" (static). */
const char *gj_fe_json_kind_name(gj_fe_json_kind k);
/* Appends s as a JSON string literal (quotes and escapes) to buf at *pos,
 * growing buf (gj_rt_realloc) as needed. 0, or -1 on OOM (error set). */
int gj_fe_json_append_string(char **buf, size_t *pos, size_t *cap, const char *s);
/* Whether s[0..n) is valid UTF-8 (no overlong forms, no surrogates). */
bool gj_fe_json_utf8_valid(const char *s, size_t n);

#endif /* GJ_FE_JSON_H */
