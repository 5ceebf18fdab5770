/* SPDX-License-Identifier: MIT */
/*
 * test_safetensors.c - checkpoints: state dicts, the safetensors writer
 * (byte-exact against the reference layout), the reader on every kind of
 * damaged input (a table of hand-made files plus thousands of random
 * mutations and truncations of valid ones, run under ASan in CI), failed
 * allocations, gj_state_dict_copy_into reporting every mismatch at once,
 * layer and optimizer state names, the RNG state, and resumed training:
 * N steps, save, a fresh process-like restart from the file, M more steps
 * must give bit-identical losses and parameters to N + M uninterrupted
 * steps (SGD with momentum and AdamW, with dropout and random inputs so
 * the RNG state matters).
 */
#include "gjtest.h"
#include "runtime/rt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ helpers */

/* A file image: 8-byte length of json, json, then dlen data bytes. */
static unsigned char *mkfile(const char *json, const void *data, size_t dlen, size_t *len) {
    size_t n = strlen(json);
    unsigned char *b = malloc(8 + n + dlen + 1);
    assert_non_null(b);
    for (int k = 0; k < 8; k++)
        b[k] = (unsigned char)((uint64_t)n >> (8 * k));
    memcpy(b + 8, json, n);
    if (dlen)
        memcpy(b + 8 + n, data, dlen);
    *len = 8 + n + dlen;
    return b;
}

/* Whether a and b have the same dtype, shape and bytes. */
static bool same_bits(const gj_tensor *a, const gj_tensor *b) {
    if (gj_tensor_dtype(a) != gj_tensor_dtype(b) || gj_tensor_ndim(a) != gj_tensor_ndim(b))
        return false;
    for (int d = 0; d < gj_tensor_ndim(a); d++)
        if (gj_tensor_shape(a)[d] != gj_tensor_shape(b)[d])
            return false;
    gj_tensor *ca = gj_contiguous((gj_tensor *)a), *cb = gj_contiguous((gj_tensor *)b);
    size_t es = gj_tensor_dtype(a) == GJ_BF16 ? 2 : gj_tensor_dtype(a) == GJ_F32 ? 4 : 8;
    bool same = memcmp(gj_tensor_data(ca), gj_tensor_data(cb),
                       (size_t)gj_tensor_numel(a) * es) == 0;
    gj_release(ca);
    gj_release(cb);
    return same;
}

static char tmpdir[64];

static int setup_dir(void **state) {
    (void)state;
    return gjt_tmpdir_make(tmpdir, sizeof tmpdir, "gjt-st");
}

static int teardown_dir(void **state) {
    (void)state;
    return gjt_tmpdir_remove(tmpdir);
}

static const char *tmpfile_path(const char *name) {
    static char p[256];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    return p;
}

/* A dict of every dtype and some corner shapes (new, with the tensors). */
static gj_state_dict *sample_dict(void) {
    gj_state_dict *sd = gj_state_dict_new();
    assert_non_null(sd);
    int64_t s23[2] = {2, 3}, s4 = 4, s03[2] = {0, 3};
    float f[6] = {1.5f, -2.0f, 0.0f, -0.0f, INFINITY, 3.25e-39f /* subnormal */};
    double d[4] = {M_PI, -1e300, NAN, 5e-324};
    uint16_t h[6] = {0x3f80, 0xbf80, 0x7fc1 /* NaN payload */, 0x0001, 0xff80, 0x4049};
    int64_t i[4] = {INT64_MIN, -1, 0, INT64_MAX};
    gj_tensor *tf = gj_from_data(GJ_F32, 2, s23, f), *td = gj_from_data(GJ_F64, 1, &s4, d);
    gj_tensor *th = gj_from_data(GJ_BF16, 2, s23, h), *ti = gj_from_data(GJ_I64, 1, &s4, i);
    gj_tensor *sc = gj_scalar(GJ_F64, 2.5), *em = gj_zeros(GJ_F32, 2, s03);
    gj_tensor *tr = gj_transpose(tf, 0, 1); /* non-contiguous: saved as [3, 2] data */
    assert_int_equal(gj_state_dict_add(sd, "layer.f32", tf), 0);
    assert_int_equal(gj_state_dict_add(sd, "layer.f64", td), 0);
    assert_int_equal(gj_state_dict_add(sd, "bf16 \"quoted\"\n", th), 0);
    assert_int_equal(gj_state_dict_add(sd, "i64.\xc3\xa9\xe2\x82\xac", ti), 0);
    assert_int_equal(gj_state_dict_add(sd, "scalar", sc), 0);
    assert_int_equal(gj_state_dict_add(sd, "empty", em), 0);
    assert_int_equal(gj_state_dict_add(sd, "transposed", tr), 0);
    assert_int_equal(gj_state_dict_set_metadata(sd, "format", "pt"), 0);
    assert_int_equal(gj_state_dict_set_metadata(sd, "note", "tab\there \\ \"q\" \x01 \xe2\x82\xac"), 0);
    gj_tensor *all[7] = {tf, td, th, ti, sc, em, tr};
    for (int k = 0; k < 7; k++)
        gj_release(all[k]);
    return sd;
}

/* ---------------------------------------------------------- round trip */

static void test_roundtrip(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    gj_state_dict *sd = sample_dict();
    void *buf = NULL;
    size_t len = 0;
    assert_int_equal(gj_save_safetensors_buffer(sd, &buf, &len), 0);
    const unsigned char *b = buf;
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--)
        n = n << 8 | b[k];
    assert_true((8 + n) % 8 == 0); /* padded as the reference does */
    assert_int_equal(b[8], '{');
    assert_int_equal(b[8 + n - 1] == ' ' || b[8 + n - 1] == '}', 1);

    gj_state_dict *back = gj_load_safetensors_buffer(buf, len);
    assert_non_null(back);
    assert_int_equal(gj_state_dict_size(back), gj_state_dict_size(sd));
    for (int i = 0; i < gj_state_dict_size(sd); i++) {
        const char *name = gj_state_dict_name(sd, i);
        gj_tensor *t = gj_state_dict_get(back, name);
        if (!t || !same_bits(t, gj_state_dict_tensor(sd, i)))
            fail_msg("tensor \"%s\" did not survive the round trip", name);
        assert_false(gj_requires_grad(t));
    }
    /* File order: I64, F64 (by name), F32 (by name), BF16. */
    const char *want[7] = {"i64.\xc3\xa9\xe2\x82\xac", "layer.f64", "scalar", "empty",
                           "layer.f32", "transposed", "bf16 \"quoted\"\n"};
    for (int i = 0; i < 7; i++)
        assert_string_equal(gj_state_dict_name(back, i), want[i]);
    assert_string_equal(gj_state_dict_get_metadata(back, "format"), "pt");
    assert_string_equal(gj_state_dict_get_metadata(back, "note"),
                        "tab\there \\ \"q\" \x01 \xe2\x82\xac");
    assert_int_equal(gj_state_dict_metadata_size(back), 2);
    const char *k = NULL, *v = NULL;
    assert_int_equal(gj_state_dict_metadata_at(back, 0, &k, &v), 0);
    assert_non_null(k);
    assert_int_not_equal(gj_state_dict_metadata_at(back, 2, &k, &v), 0);
    assert_null(gj_state_dict_name(back, 7));
    assert_null(gj_state_dict_tensor(back, -1));
    assert_null(gj_state_dict_get(back, "nope"));

    /* Through a file: the same bytes, and no temporary file left behind. */
    const char *path = tmpfile_path("rt.safetensors");
    assert_int_equal(gj_save_safetensors(sd, path), 0);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char *fb = malloc(len + 1);
    assert_int_equal(fread(fb, 1, len + 1, f), len);
    fclose(f);
    assert_memory_equal(fb, buf, len);
    free(fb);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "test $(ls '%s' | grep -c tmp) -eq 0", tmpdir);
    assert_int_equal(system(cmd), 0);
    gj_state_dict *fromfile = gj_load_safetensors(path);
    assert_non_null(fromfile);
    assert_int_equal(gj_state_dict_size(fromfile), 7);
    gj_state_dict_free(fromfile);

    free(buf);
    gj_state_dict_free(back);
    gj_state_dict_free(sd);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The exact bytes of the reference layout for a small dict: metadata
 * first, compact JSON, spaces to a multiple of 8, data in order. */
static void test_exact_layout(void **state) {
    (void)state;
    gj_state_dict *sd = gj_state_dict_new();
    int64_t s2 = 2;
    float a[2] = {1.0f, 2.0f};
    int64_t c[2] = {7, -7};
    gj_tensor *ta = gj_from_data(GJ_F32, 1, &s2, a), *tc = gj_from_data(GJ_I64, 1, &s2, c);
    assert_int_equal(gj_state_dict_add(sd, "a", ta), 0);
    assert_int_equal(gj_state_dict_add(sd, "c", tc), 0);
    assert_int_equal(gj_state_dict_set_metadata(sd, "format", "pt"), 0);
    void *buf;
    size_t len;
    assert_int_equal(gj_save_safetensors_buffer(sd, &buf, &len), 0);
    const char *json = "{\"__metadata__\":{\"format\":\"pt\"},"
                       "\"c\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}";
    size_t jn = strlen(json), padded = (jn + 8 + 7) / 8 * 8 - 8;
    assert_int_equal(len, 8 + padded + 24);
    const unsigned char *b = buf;
    assert_int_equal(b[0], padded & 0xff);
    assert_int_equal(b[1], padded >> 8);
    for (int k = 2; k < 8; k++)
        assert_int_equal(b[k], 0);
    assert_memory_equal(b + 8, json, jn);
    for (size_t k = jn; k < padded; k++)
        assert_int_equal(b[8 + k], ' ');
    assert_memory_equal(b + 8 + padded, c, 16); /* little-endian host */
    assert_memory_equal(b + 8 + padded + 16, a, 8);
    free(buf);
    gj_release(ta);
    gj_release(tc);
    gj_state_dict_free(sd);
}

/* ------------------------------------------------------- bad arguments */

static void test_dict_errors(void **state) {
    (void)state;
    gj_state_dict *sd = gj_state_dict_new();
    gj_tensor *t = gj_scalar(GJ_F32, 1.0);
    assert_int_equal(gj_state_dict_add(sd, "x", t), 0);
    assert_int_not_equal(gj_state_dict_add(sd, "x", t), 0);
    GJT_ASSERT_ERROR("already");
    assert_int_not_equal(gj_state_dict_add(sd, "", t), 0);
    GJT_ASSERT_ERROR("empty");
    assert_int_not_equal(gj_state_dict_add(sd, "__metadata__", t), 0);
    GJT_ASSERT_ERROR("reserved");
    assert_int_not_equal(gj_state_dict_add(sd, "bad\xff", t), 0);
    GJT_ASSERT_ERROR("UTF-8");
    assert_int_not_equal(gj_state_dict_add(sd, "n", NULL), 0);
    GJT_ASSERT_ERROR("gj_state_dict_add");
    assert_int_not_equal(gj_state_dict_add(NULL, "n", t), 0);
    assert_int_not_equal(gj_state_dict_set_metadata(sd, "k", "\xc0\x80"), 0); /* overlong */
    GJT_ASSERT_ERROR("UTF-8");
    assert_int_equal(gj_state_dict_set_metadata(sd, "k", "1"), 0);
    assert_int_equal(gj_state_dict_set_metadata(sd, "k", "2"), 0); /* replaces */
    assert_int_equal(gj_state_dict_metadata_size(sd), 1);
    assert_string_equal(gj_state_dict_get_metadata(sd, "k"), "2");
    assert_int_equal(gj_state_dict_size(sd), 1);
    assert_ptr_equal(gj_state_dict_tensors(sd)[0], t);

    assert_null(gj_load_safetensors(tmpfile_path("does-not-exist")));
    GJT_ASSERT_ERROR("cannot open");
    assert_null(gj_load_safetensors(tmpdir));
    GJT_ASSERT_ERROR("not a regular file");
    /* a missing directory: the message names the path given and the
     * directory, never the temporary file */
    assert_int_not_equal(gj_save_safetensors(sd, "/nonexistent-dir/sub/x.safetensors"), 0);
    assert_string_equal(gj_last_error(), "gj_save_safetensors: cannot write "
                                         "/nonexistent-dir/sub/x.safetensors: the directory "
                                         "/nonexistent-dir/sub does not exist");
    assert_int_not_equal(gj_save_safetensors(sd, "/x.safetensors/y/z"), 0);
    assert_null(strstr(gj_last_error(), ".tmp-"));
    GJT_ASSERT_ERROR("cannot write /x.safetensors/y/z");
    assert_null(gj_load_safetensors_buffer(NULL, 5));
    GJT_ASSERT_ERROR("NULL");
    gj_release(t);
    gj_state_dict_free(sd);
    gj_state_dict_free(NULL);
}

/* ---------------------------------------------------------- bad files */

typedef struct bad_case {
    const char *json;
    size_t dlen;     /* data bytes after the header */
    const char *err; /* expected in the message */
} bad_case;

static void test_malformed_table(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    static const bad_case cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},}", 8, "malformed JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "malformed JSON"},
        {"{'a':1}", 0, "malformed JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8, "leading zero"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
         16, "twice"},
        {"{\"a\":{\"dtype\":\"F99\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype"},
        {"{\"a\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4,
         "unsupported dtype \"F16\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
         "overflows"},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[9223372036854775807],\"data_offsets\":[0,8]}}", 8,
         "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,8]}}", 8,
         "dimension 0"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
         "9 dimensions"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "dimension 0"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, "dimension 0"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, "overlaps"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "unused bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "trailing"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
         "beyond the 4 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "end before"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "two integers"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "missing field \"data_offsets\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
         "unknown field"},
        {"{\"a\":[1,2]}", 0, "expected an object"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "strings to strings"},
        {"{\"__metadata__\":[]}", 0, "must be an object"},
        {"{\"\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0, "empty name"},
        {"{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0, "UTF-8"},
        {"{\"a\\u0000\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0, "u0000"},
        {"{\"a\\ud800\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0,
         "surrogate"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} x", 8, "after the end"},
        {"[1]", 0, "does not start with '{'"},
        {" {}", 0, "does not start with '{'"},
        {"{\"a\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
         0, "nesting"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}\x01", 8,
         "after the end"},
        {"{\"a\":\"unterminated}", 0, "unexpected end"},
        {"{\"a\":tru}", 0, "literal"},
    };
    unsigned char data[32] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t len;
        unsigned char *b = mkfile(cases[i].json, data, cases[i].dlen, &len);
        gj_clear_error();
        gj_state_dict *sd = gj_load_safetensors_buffer(b, len);
        if (sd || !gjt_error_has(cases[i].err))
            fail_msg("case %zu (%s): expected an error with \"%s\", got \"%s\"", i, cases[i].json,
                     cases[i].err, sd ? "(success)" : gj_last_error());
        free(b);
    }
    /* Length field problems. */
    unsigned char tiny[7] = {0};
    assert_null(gj_load_safetensors_buffer(tiny, sizeof tiny));
    GJT_ASSERT_ERROR("too short");
    unsigned char big[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
    assert_null(gj_load_safetensors_buffer(big, sizeof big));
    GJT_ASSERT_ERROR("beyond the file");
    unsigned char nine[17] = {9, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    assert_null(gj_load_safetensors_buffer(nine, 10)); /* says 9, has 2 */
    GJT_ASSERT_ERROR("truncated");
    /* Valid corner: an empty header "{}" and no data; padding spaces. */
    size_t len;
    unsigned char *b = mkfile("{}      ", NULL, 0, &len);
    gj_state_dict *sd = gj_load_safetensors_buffer(b, len);
    assert_non_null(sd);
    assert_int_equal(gj_state_dict_size(sd), 0);
    gj_state_dict_free(sd);
    free(b);
    /* Escapes decode: "\u00e9\ud83d\ude00" is UTF-8 e-acute + U+1F600. */
    b = mkfile("{\"x\\u00e9\\ud83d\\ude00\\n\":{\"dtype\":\"I64\",\"shape\":[],"
               "\"data_offsets\":[0,8]}}",
               data, 8, &len);
    sd = gj_load_safetensors_buffer(b, len);
    assert_non_null(sd);
    assert_string_equal(gj_state_dict_name(sd, 0), "x\xc3\xa9\xf0\x9f\x98\x80\n");
    assert_int_equal(gj_tensor_ndim(gj_state_dict_tensor(sd, 0)), 0);
    gj_state_dict_free(sd);
    free(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The reader is fed thousands of mutations of valid files: bytes flipped
 * or replaced by JSON punctuation, ranges deleted or duplicated, digits of
 * shapes and offsets changed, the file cut anywhere, the length field
 * changed; also header-only mutations with
 * a length field that stays consistent (so the JSON and the offset checks
 * are reached, not just the length check). It must never crash (ASan in
 * CI) and must either fail with a message or return a consistent dict. */
static void test_fuzz(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    gj_state_dict *sd = sample_dict();
    void *vbuf;
    size_t vlen;
    assert_int_equal(gj_save_safetensors_buffer(sd, &vbuf, &vlen), 0);
    gj_state_dict_free(sd);
    const unsigned char *valid = vbuf;
    uint64_t hn = 0;
    for (int k = 7; k >= 0; k--)
        hn = hn << 8 | valid[k];
    gjt_rng r;
    gjt_rng_seed(&r, 20261124);
    static const char tokens[] = "{}[]:,\"\\0123456789-.eE +tfnu";
    unsigned char *m = malloc(vlen * 2 + 64);
    assert_non_null(m);
    int n_ok = 0, n_fail = 0;
    const int cases = 7000;
    for (int c = 0; c < cases; c++) {
        size_t len = vlen;
        memcpy(m, valid, vlen);
        int kind = (int)gjt_rng_int(&r, 7);
        int edits = 1 + (int)gjt_rng_int(&r, 4);
        bool keep_len = kind >= 3; /* header-only mutations, length rewritten */
        for (int e = 0; e < edits; e++) {
            size_t lo = keep_len ? 8 : 0, hi = keep_len ? 8 + (size_t)hn : len;
            if (hi <= lo)
                break;
            size_t at = lo + (size_t)gjt_rng_int(&r, (int64_t)(hi - lo));
            switch (kind) {
            case 0: /* flip a bit anywhere */
                m[at] ^= (unsigned char)(1u << gjt_rng_int(&r, 8));
                break;
            case 1: /* cut the file */
                len = at;
                break;
            case 2: /* change the length field */
                m[gjt_rng_int(&r, 8)] = (unsigned char)gjt_rng_u64(&r);
                break;
            case 3: /* a JSON-ish byte in the header */
                m[at] = (unsigned char)tokens[gjt_rng_int(&r, sizeof tokens - 1)];
                break;
            case 4: { /* delete a header range */
                size_t n = 1 + (size_t)gjt_rng_int(&r, 12);
                if (at + n > hi)
                    n = hi - at;
                memmove(m + at, m + at + n, len - at - n);
                len -= n;
                hn -= n;
                break;
            }
            case 6: { /* change a digit of the header: shapes and offsets stay JSON */
                size_t k = at;
                while (k < hi && (m[k] < '0' || m[k] > '9'))
                    k++;
                if (k < hi)
                    m[k] = (unsigned char)('0' + gjt_rng_int(&r, 10));
                break;
            }
            default: { /* duplicate a header range (a repeated key, a longer number) */
                size_t n = 1 + (size_t)gjt_rng_int(&r, 24);
                if (at + n > hi)
                    n = hi - at;
                memmove(m + at + n, m + at, len - at);
                len += n;
                hn += n;
                break;
            }
            }
        }
        if (keep_len)
            for (int k = 0; k < 8; k++)
                m[k] = (unsigned char)(hn >> (8 * k));
        gj_clear_error();
        gj_state_dict *got = gj_load_safetensors_buffer(m, len);
        if (got) {
            n_ok++;
            int64_t bytes = 0;
            for (int i = 0; i < gj_state_dict_size(got); i++) {
                gj_tensor *t = gj_state_dict_tensor(got, i);
                assert_non_null(t);
                int64_t numel = 1;
                for (int d = 0; d < gj_tensor_ndim(t); d++)
                    numel *= gj_tensor_shape(t)[d];
                assert_int_equal(numel, gj_tensor_numel(t));
                bytes += numel * (gj_tensor_dtype(t) == GJ_BF16   ? 2
                                  : gj_tensor_dtype(t) == GJ_F32 ? 4
                                                                 : 8);
            }
            assert_true((size_t)bytes <= len);
            gj_state_dict_free(got);
        } else {
            n_fail++;
            if (gj_last_error()[0] == '\0')
                fail_msg("case %d: failed without a message", c);
        }
        /* restore hn for the next case */
        hn = 0;
        for (int k = 7; k >= 0; k--)
            hn = hn << 8 | valid[k];
    }
    print_message("fuzz: %d mutated files, %d parsed, %d rejected with a message\n", cases,
                  n_ok, n_fail);
    assert_true(n_fail > cases / 2);
    free(m);
    free(vbuf);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Every allocation of a load, made to fail in turn: NULL with an error,
 * nothing leaked (ASan/LSan), and the load after it works. */
static void test_alloc_failures(void **state) {
    (void)state;
    gj_state_dict *sd = sample_dict();
    void *buf;
    size_t len;
    assert_int_equal(gj_save_safetensors_buffer(sd, &buf, &len), 0);
    int64_t live0 = gjt_live_bytes();
    int failed = 0;
    for (int64_t k = 1; k < 400; k++) {
        gj_rt_alloc_fail_at(k);
        gj_clear_error();
        gj_state_dict *got = gj_load_safetensors_buffer(buf, len);
        gj_rt_alloc_fail_at(0);
        if (got) {
            gj_state_dict_free(got);
            break; /* k is past the last allocation */
        }
        failed++;
        assert_true(gj_last_error()[0] != '\0');
    }
    assert_true(failed > 10);
    for (int64_t k = 1; k < 200; k++) {
        void *out = NULL;
        size_t n = 0;
        gj_rt_alloc_fail_at(k);
        int rc = gj_save_safetensors_buffer(sd, &out, &n);
        gj_rt_alloc_fail_at(0);
        free(out);
        if (rc == 0)
            break;
    }
    assert_int_equal(gjt_live_bytes(), live0);
    free(buf);
    gj_state_dict_free(sd);
}

/* ------------------------------------------------------- copy_into */

static void test_copy_into_reports_all(void **state) {
    (void)state;
    int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s3 = 3;
    gj_state_dict *model = gj_state_dict_new(), *file = gj_state_dict_new();
    gj_tensor *w = gj_zeros(GJ_F32, 2, s23), *b = gj_zeros(GJ_F32, 1, &s3);
    gj_tensor *v = gj_zeros(GJ_F32, 2, s23), *u = gj_zeros(GJ_F64, 1, &s3);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_state_dict_add(model, "fc.weight", w), 0);
    assert_int_equal(gj_state_dict_add(model, "fc.bias", b), 0);
    assert_int_equal(gj_state_dict_add(model, "v", v), 0);
    assert_int_equal(gj_state_dict_add(model, "u", u), 0);
    gj_tensor *fw = gj_ones(GJ_F32, 2, s32), *fv = gj_ones(GJ_F32, 2, s23);
    gj_tensor *fu = gj_ones(GJ_F32, 1, &s3), *fx = gj_ones(GJ_F32, 1, &s3);
    assert_int_equal(gj_state_dict_add(file, "fc.weight", fw), 0); /* shape */
    assert_int_equal(gj_state_dict_add(file, "v", fv), 0);         /* fine */
    assert_int_equal(gj_state_dict_add(file, "u", fu), 0);         /* dtype */
    assert_int_equal(gj_state_dict_add(file, "extra", fx), 0);     /* unexpected */
    int64_t ver = gj_tensor_version(v);
    assert_int_not_equal(gj_state_dict_copy_into(model, file, true), 0);
    const char *e = gj_last_error();
    print_message("%s\n", e);
    assert_non_null(strstr(e, "4 mismatches"));
    assert_non_null(strstr(e, "\"fc.weight\": F32 [3, 2] in the source, F32 [2, 3]"));
    assert_non_null(strstr(e, "missing \"fc.bias\" (F32 [3])"));
    assert_non_null(strstr(e, "\"u\": F32 [3] in the source, F64 [3]"));
    assert_non_null(strstr(e, "unexpected \"extra\""));
    assert_int_equal(gj_tensor_version(v), ver); /* nothing copied */
    assert_true(gj_tensor_item_at(v, 0) == 0.0);
    /* Not strict: "extra" ignored, the other three still reported. */
    assert_int_not_equal(gj_state_dict_copy_into(model, file, false), 0);
    assert_non_null(strstr(gj_last_error(), "3 mismatches"));

    /* Many mismatches: all counted, the message stays within the buffer. */
    gj_state_dict *many = gj_state_dict_new();
    for (int i = 0; i < 300; i++) {
        char name[32];
        snprintf(name, sizeof name, "p%03d", i);
        assert_int_equal(gj_state_dict_add(many, name, b), 0);
    }
    assert_int_not_equal(gj_state_dict_copy_into(many, file, false), 0);
    assert_non_null(strstr(gj_last_error(), "300 mismatches"));
    assert_non_null(strstr(gj_last_error(), "more"));
    gj_state_dict_free(many);

    /* A matching source: values copied in place, identity kept. */
    gj_state_dict *good = gj_state_dict_new();
    double wv[6] = {1, 2, 3, 4, 5, 6}, bv[3] = {-1, -2, -3};
    gj_tensor *gw = gjt_tensor(GJ_F32, 2, s23, wv), *gb = gjt_tensor(GJ_F32, 1, &s3, bv);
    gj_tensor *gv = gj_transpose(fw, 0, 1); /* non-contiguous source */
    gj_tensor *gu = gjt_tensor(GJ_F64, 1, &s3, bv);
    assert_int_equal(gj_state_dict_add(good, "fc.weight", gw), 0);
    assert_int_equal(gj_state_dict_add(good, "fc.bias", gb), 0);
    assert_int_equal(gj_state_dict_add(good, "v", gv), 0);
    assert_int_equal(gj_state_dict_add(good, "u", gu), 0);
    assert_int_equal(gj_state_dict_copy_into(model, good, true), 0);
    assert_true(gjt_tensor_close("weight", w, wv, 0, 0));
    assert_true(gjt_tensor_close("bias", b, bv, 0, 0));
    assert_true(gj_tensor_item_at(v, 5) == 1.0);
    assert_true(gj_tensor_version(v) > ver);
    assert_true(gj_requires_grad(w));
    assert_ptr_equal(gj_state_dict_get(model, "fc.weight"), w);

    gj_tensor *all[] = {w, b, v, u, fw, fv, fu, fx, gw, gb, gv, gu};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        gj_release(all[i]);
    gj_state_dict_free(good);
    gj_state_dict_free(model);
    gj_state_dict_free(file);
}

/* ----------------------------------------------- layers, optimizers, RNG */

static void test_layer_names(void **state) {
    (void)state;
    gj_linear_layer l1, l2;
    gj_layer_norm_layer ln;
    gj_embedding_layer em;
    assert_int_equal(gj_linear_init(&l1, 3, 4, true, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&l2, 4, 2, false, GJ_F32), 0);
    assert_int_equal(gj_layer_norm_init(&ln, 4, 1e-5, GJ_F32), 0);
    assert_int_equal(gj_embedding_init(&em, 10, 3, GJ_F32), 0);
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_embedding_state_dict_add(&em, sd, "tok"), 0);
    assert_int_equal(gj_linear_state_dict_add(&l1, sd, "fc1"), 0);
    assert_int_equal(gj_layer_norm_state_dict_add(&ln, sd, "ln"), 0);
    assert_int_equal(gj_linear_state_dict_add(&l2, sd, "head"), 0);
    const char *want[] = {"tok.weight", "fc1.weight", "fc1.bias", "ln.weight", "ln.bias",
                          "head.weight"};
    assert_int_equal(gj_state_dict_size(sd), 6);
    for (int i = 0; i < 6; i++)
        assert_string_equal(gj_state_dict_name(sd, i), want[i]);
    assert_ptr_equal(gj_state_dict_get(sd, "fc1.weight"), l1.weight);
    assert_int_not_equal(gj_linear_state_dict_add(&l1, sd, "fc1"), 0); /* names taken */
    GJT_ASSERT_ERROR("already");
    assert_int_not_equal(gj_linear_state_dict_add(&l1, sd, ""), 0);
    GJT_ASSERT_ERROR("prefix");
    /* Save, perturb, load back into the layers. */
    void *buf;
    size_t len;
    assert_int_equal(gj_save_safetensors_buffer(sd, &buf, &len), 0);
    double before = gj_tensor_item_at(l1.weight, 0);
    gj_no_grad_push();
    assert_int_equal(gj_zero_(l1.weight), 0);
    gj_no_grad_pop();
    gj_state_dict *f = gj_load_safetensors_buffer(buf, len);
    assert_non_null(f);
    assert_int_equal(gj_state_dict_copy_into(sd, f, true), 0);
    assert_true(gj_tensor_item_at(l1.weight, 0) == before);
    gj_state_dict_free(f);
    /* The same through a file, in one call; then the file cut short. */
    const char *path = tmpfile_path("layers.safetensors");
    assert_int_equal(gj_save_safetensors(sd, path), 0);
    gj_no_grad_push();
    assert_int_equal(gj_zero_(l1.weight), 0);
    gj_no_grad_pop();
    assert_int_equal(gj_load_safetensors_into(sd, path, true), 0);
    assert_true(gj_tensor_item_at(l1.weight, 0) == before);
    assert_int_equal(truncate(path, (off_t)len - 5), 0);
    assert_int_not_equal(gj_load_safetensors_into(sd, path, true), 0);
    GJT_ASSERT_ERROR("layers.safetensors");
    GJT_ASSERT_ERROR("beyond the");
    assert_true(gj_tensor_item_at(l1.weight, 0) == before);
    assert_int_equal(truncate(path, 5), 0);
    assert_null(gj_load_safetensors(path));
    GJT_ASSERT_ERROR("too short");
    free(buf);
    gj_state_dict_free(sd);
    gj_linear_free(&l1);
    gj_linear_free(&l2);
    gj_layer_norm_free(&ln);
    gj_embedding_free(&em);
}

static void test_rng_state(void **state) {
    (void)state;
    gj_manual_seed(99);
    int64_t n = 5;
    gj_tensor *a = gj_randn(GJ_F64, 1, &n, 1.0);
    uint64_t seed, counter;
    gj_rng_get_state(&seed, &counter);
    assert_true(seed == 99 && counter == 5);
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_rng_state_dict_add(sd, NULL), 0);
    assert_string_equal(gj_state_dict_get_metadata(sd, "rng.counter"), "5");
    gj_tensor *b = gj_randn(GJ_F64, 1, &n, 1.0);
    gj_manual_seed(1);
    assert_int_equal(gj_rng_load_state_dict(sd, NULL), 0);
    gj_tensor *c = gj_randn(GJ_F64, 1, &n, 1.0);
    assert_true(same_bits(b, c));
    assert_false(same_bits(a, c));
    gj_rng_set_state(UINT64_MAX, UINT64_MAX - 1);
    assert_int_equal(gj_rng_state_dict_add(sd, "g"), 0);
    assert_string_equal(gj_state_dict_get_metadata(sd, "g.seed"), "18446744073709551615");
    assert_int_equal(gj_rng_load_state_dict(sd, "g"), 0);
    gj_rng_get_state(&seed, &counter);
    assert_true(seed == UINT64_MAX && counter == UINT64_MAX - 1);
    /* Malformed values: refused, state unchanged. */
    const char *bad[] = {"18446744073709551616", "-1", "1 ", "", "0x10", "12a"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(gj_state_dict_set_metadata(sd, "g.counter", bad[i]), 0);
        assert_int_not_equal(gj_rng_load_state_dict(sd, "g"), 0);
        GJT_ASSERT_ERROR("gj_rng_load_state_dict");
    }
    assert_int_not_equal(gj_rng_load_state_dict(sd, "absent"), 0);
    assert_string_equal(gj_last_error(), "gj_rng_load_state_dict: missing metadata "
                                         "\"absent.seed\" and \"absent.counter\" "
                                         "(gj_rng_state_dict_add stores both)");
    gj_state_dict *half = gj_state_dict_new();
    assert_int_equal(gj_state_dict_set_metadata(half, "h.seed", "7"), 0);
    assert_int_not_equal(gj_rng_load_state_dict(half, "h"), 0);
    GJT_ASSERT_ERROR("missing metadata \"h.counter\" (");
    gj_state_dict_free(half);
    gj_rng_get_state(&seed, &counter);
    assert_true(seed == UINT64_MAX && counter == UINT64_MAX - 1);
    gj_release(a);
    gj_release(b);
    gj_release(c);
    gj_state_dict_free(sd);
}

/* ------------------------------------------------------- resume */

/* A small model with every layer kind: embedding -> linear -> layer norm
 * -> dropout -> linear, cross-entropy; inputs drawn from the library RNG. */
typedef struct tiny {
    gj_embedding_layer em;
    gj_linear_layer fc;
    gj_layer_norm_layer ln;
    gj_linear_layer head;
    gj_optim *opt;
} tiny;

enum { T_V = 11, T_D = 8, T_H = 16, T_K = 5, T_B = 6 };

static void tiny_init(tiny *m, uint64_t seed, bool adamw) {
    gj_manual_seed(seed);
    assert_int_equal(gj_embedding_init(&m->em, T_V, T_D, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&m->fc, T_D, T_H, true, GJ_F32), 0);
    assert_int_equal(gj_layer_norm_init(&m->ln, T_H, 1e-5, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&m->head, T_H, T_K, false, GJ_F32),
                     0);
    gj_tensor *ps[6] = {m->em.weight, m->fc.weight, m->fc.bias, m->ln.weight, m->ln.bias,
                        m->head.weight};
    m->opt = adamw ? gj_adamw_new(6, ps, 3e-2, 0.9, 0.99, 1e-8, 0.01)
                   : gj_sgd_new(6, ps, 5e-2, 0.9, 1e-3);
    assert_non_null(m->opt);
}

static void tiny_free(tiny *m) {
    gj_optim_free(m->opt);
    gj_embedding_free(&m->em);
    gj_linear_free(&m->fc);
    gj_layer_norm_free(&m->ln);
    gj_linear_free(&m->head);
}

/* The model's parameters (and with opt, its optimizer and the RNG) as a
 * new dict. */
static gj_state_dict *tiny_dict(tiny *m, bool with_state) {
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_embedding_state_dict_add(&m->em, sd, "em"), 0);
    assert_int_equal(gj_linear_state_dict_add(&m->fc, sd, "fc"), 0);
    assert_int_equal(gj_layer_norm_state_dict_add(&m->ln, sd, "ln"), 0);
    assert_int_equal(gj_linear_state_dict_add(&m->head, sd, "head"), 0);
    if (with_state) {
        assert_int_equal(gj_optim_state_dict_add(m->opt, sd, NULL), 0);
        assert_int_equal(gj_rng_state_dict_add(sd, NULL), 0);
    }
    return sd;
}

/* One training step; returns the loss. Step 3 leaves the head without a
 * gradient (a parameter skipped by the optimizer: its state lags). */
static double tiny_step(tiny *m, int step) {
    gj_scope_push();
    int64_t bs = T_B;
    gj_tensor *u = gj_rand(GJ_F64, 1, &bs, 0.0, (double)T_V); /* RNG: inputs */
    gj_tensor *v = gj_rand(GJ_F64, 1, &bs, 0.0, (double)T_K);
    int64_t idx[T_B], lab[T_B];
    for (int i = 0; i < T_B; i++) {
        idx[i] = (int64_t)gj_tensor_item_at(u, i);
        lab[i] = (int64_t)gj_tensor_item_at(v, i);
    }
    gj_tensor *x = gj_from_data(GJ_I64, 1, &bs, idx), *y = gj_from_data(GJ_I64, 1, &bs, lab);
    gj_tensor *h = gj_gelu(gj_linear_forward(&m->fc, gj_embedding_forward(&m->em, x)));
    h = gj_dropout(gj_layer_norm_forward(&m->ln, h), 0.25, true); /* RNG: mask */
    gj_tensor *logits = gj_linear_forward(&m->head, h);
    gj_tensor *loss = gj_cross_entropy(logits, y);
    assert_non_null(loss);
    if (step == 3) {
        gj_tensor *l2 = gj_mean(h, 0, NULL, false);
        assert_int_equal(gj_backward(l2, NULL), 0);
    } else {
        assert_int_equal(gj_backward(loss, NULL), 0);
    }
    assert_int_equal(gj_optim_step(m->opt), 0);
    gj_optim_zero_grad(m->opt);
    double lv = gj_tensor_item(loss);
    gj_scope_pop();
    return lv;
}

static void check_resume(bool adamw) {
    enum { N = 5, M = 7 };
    double straight[N + M], resumed[N + M];
    /* Uninterrupted: N + M steps. */
    tiny a;
    tiny_init(&a, 1234, adamw);
    for (int s = 0; s < N + M; s++)
        straight[s] = tiny_step(&a, s);
    /* Interrupted: N steps, save, everything freed. */
    tiny b;
    tiny_init(&b, 1234, adamw);
    for (int s = 0; s < N; s++)
        resumed[s] = tiny_step(&b, s);
    gj_state_dict *sd = tiny_dict(&b, true);
    const char *path = tmpfile_path(adamw ? "resume-adamw.safetensors" : "resume-sgd.safetensors");
    assert_int_equal(gj_save_safetensors(sd, path), 0);
    gj_state_dict_free(sd);
    tiny_free(&b);
    /* Resumed: a fresh model from another seed, state loaded, the RNG
     * disturbed before loading. */
    tiny c;
    tiny_init(&c, 999, adamw);
    int64_t n = 17;
    gj_release(gj_randn(GJ_F32, 1, &n, 1.0));
    gj_state_dict *model = tiny_dict(&c, false);
    gj_state_dict *file = gj_load_safetensors(path);
    assert_non_null(file);
    assert_int_equal(gj_state_dict_copy_into(model, file, false), 0);
    assert_int_equal(gj_optim_load_state_dict(c.opt, file, NULL), 0);
    assert_int_equal(gj_rng_load_state_dict(file, NULL), 0);
    gj_state_dict_free(file);
    for (int s = N; s < N + M; s++)
        resumed[s] = tiny_step(&c, s);
    for (int s = 0; s < N + M; s++)
        if (memcmp(&straight[s], &resumed[s], sizeof(double)) != 0)
            fail_msg("%s: step %d loss %.17g uninterrupted, %.17g resumed",
                     adamw ? "adamw" : "sgd", s, straight[s], resumed[s]);
    gj_state_dict *pa = tiny_dict(&a, false);
    for (int i = 0; i < gj_state_dict_size(pa); i++)
        if (!same_bits(gj_state_dict_tensor(pa, i), gj_state_dict_tensor(model, i)))
            fail_msg("%s: parameter %s differs after resuming", adamw ? "adamw" : "sgd",
                     gj_state_dict_name(pa, i));
    /* And the optimizer states are the same bits too. */
    gj_state_dict *oa = gj_state_dict_new(), *oc = gj_state_dict_new();
    assert_int_equal(gj_optim_state_dict_add(a.opt, oa, NULL), 0);
    assert_int_equal(gj_optim_state_dict_add(c.opt, oc, NULL), 0);
    assert_int_equal(gj_state_dict_size(oa), gj_state_dict_size(oc));
    assert_true(gj_state_dict_size(oa) >= (adamw ? 18 : 6));
    for (int i = 0; i < gj_state_dict_size(oa); i++) {
        assert_string_equal(gj_state_dict_name(oa, i), gj_state_dict_name(oc, i));
        assert_true(same_bits(gj_state_dict_tensor(oa, i), gj_state_dict_tensor(oc, i)));
    }
    print_message("%s: %d + %d steps resumed, last loss %.9g (bit-identical to %d straight "
                  "steps)\n",
                  adamw ? "adamw" : "sgd", N, M, resumed[N + M - 1], N + M);
    gj_state_dict_free(oa);
    gj_state_dict_free(oc);
    gj_state_dict_free(pa);
    gj_state_dict_free(model);
    tiny_free(&a);
    tiny_free(&c);
}

static void test_resume_adamw(void **state) {
    (void)state;
    check_resume(true);
}

static void test_resume_sgd(void **state) {
    (void)state;
    check_resume(false);
}

static void test_optim_state_errors(void **state) {
    (void)state;
    tiny a, s;
    tiny_init(&a, 5, true);
    tiny_init(&s, 5, false);
    tiny_step(&a, 0);
    tiny_step(&s, 0);
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_optim_state_dict_add(a.opt, sd, "o"), 0);
    assert_string_equal(gj_state_dict_get_metadata(sd, "o.kind"), "adamw");
    assert_string_equal(gj_state_dict_get_metadata(sd, "o.lr"), "0.029999999999999999");
    gj_tensor *st = gj_state_dict_get(sd, "o.2.step");
    assert_non_null(st);
    assert_int_equal(gj_tensor_dtype(st), GJ_I64);
    assert_true(gj_tensor_item(st) == 1.0);
    /* Wrong kind and its state names: every problem listed. */
    assert_int_not_equal(gj_optim_load_state_dict(s.opt, sd, "o"), 0);
    const char *e = gj_last_error();
    assert_non_null(strstr(e, "\"o.kind\" is \"adamw\", this optimizer is \"sgd\""));
    assert_non_null(strstr(e, "unexpected \"o.0.exp_avg\""));
    assert_non_null(strstr(e, "missing metadata \"o.momentum\""));
    assert_null(strstr(e, "absent")); /* a missing entry is said to be missing */
    /* An empty dict: every entry missing, each named. */
    gj_state_dict *none = gj_state_dict_new();
    assert_int_not_equal(gj_optim_load_state_dict(s.opt, none, "o"), 0);
    e = gj_last_error();
    assert_non_null(strstr(e, "missing metadata \"o.kind\" (this optimizer is \"sgd\")"));
    assert_non_null(strstr(e, "missing metadata \"o.n_params\" (this optimizer has 6 "
                              "parameters)"));
    assert_non_null(strstr(e, "missing metadata \"o.lr\""));
    gj_state_dict_free(none);
    /* Wrong shapes: a state dict from another model. */
    gj_linear_layer other;
    assert_int_equal(gj_linear_init(&other, 3, 3, true, GJ_F32), 0);
    gj_tensor *ops[2] = {other.weight, other.bias};
    gj_optim *o2 = gj_adamw_new(2, ops, 1e-3, 0.9, 0.999, 1e-8, 0.0);
    assert_int_not_equal(gj_optim_load_state_dict(o2, sd, "o"), 0);
    e = gj_last_error();
    assert_non_null(strstr(e, "has 2 parameters"));
    assert_non_null(strstr(e, "\"o.0.exp_avg\" is f32 [11, 8], parameter 0 needs f32 [3, 3]"));
    assert_non_null(strstr(e, "unexpected \"o.5.exp_avg\""));
    /* Damaged values. */
    assert_int_equal(gj_state_dict_set_metadata(sd, "o.beta1", "1.5"), 0);
    gj_tensor *bad = gj_scalar(GJ_F32, 1.0);
    gj_state_dict *sd2 = gj_state_dict_new();
    for (int i = 0; i < gj_state_dict_size(sd); i++) {
        const char *nm = gj_state_dict_name(sd, i);
        assert_int_equal(gj_state_dict_add(sd2, nm, strcmp(nm, "o.1.step") ? gj_state_dict_tensor(sd, i) : bad), 0);
    }
    for (int i = 0; i < gj_state_dict_metadata_size(sd); i++) {
        const char *k, *v;
        assert_int_equal(gj_state_dict_metadata_at(sd, i, &k, &v), 0);
        assert_int_equal(gj_state_dict_set_metadata(sd2, k, v), 0);
    }
    assert_int_not_equal(gj_optim_load_state_dict(a.opt, sd2, "o"), 0);
    e = gj_last_error();
    assert_non_null(strstr(e, "2 problems"));
    assert_non_null(strstr(e, "o.beta1"));
    assert_non_null(strstr(e, "\"o.1.step\" must be one i64 value"));
    /* A good load into a fresh optimizer works (and is what resume does). */
    assert_int_equal(gj_optim_load_state_dict(a.opt, sd, "o") != 0, 1); /* beta1 still bad */
    assert_int_equal(gj_state_dict_set_metadata(sd, "o.beta1", "0.90000000000000002"), 0);
    assert_int_equal(gj_optim_load_state_dict(a.opt, sd, "o"), 0);
    gj_release(bad);
    gj_optim_free(o2);
    gj_linear_free(&other);
    gj_state_dict_free(sd);
    gj_state_dict_free(sd2);
    tiny_free(&a);
    tiny_free(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_exact_layout),
        cmocka_unit_test(test_dict_errors),
        cmocka_unit_test(test_malformed_table),
        cmocka_unit_test(test_fuzz),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_copy_into_reports_all),
        cmocka_unit_test(test_layer_names),
        cmocka_unit_test(test_rng_state),
        cmocka_unit_test(test_resume_adamw),
        cmocka_unit_test(test_resume_sgd),
        cmocka_unit_test(test_optim_state_errors),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
