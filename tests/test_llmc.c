/* SPDX-License-Identifier: MIT */
/*
 * test_llmc.c - llm.c's files (frontend/llmc.c): model checkpoints, token
 * files, the batch loader and the tokenizer.
 *
 * Checks: files built byte by byte here (llm.c's layouts) load into the
 * right tensors in llm.c's order, and the writers produce exactly those
 * bytes; the loader serves llm.c's DataLoader batches (file order, the
 * tail that does not fill a batch unused, the wrap to the start, resets)
 * and, shuffled, llm.c's permutations (reference orders printed by llm.c's
 * own llmc/rand.h, see test_loader_shuffle); positions restore exactly;
 * tokenizers of versions 1 and 2 decode; a table of damaged files each
 * fails with a message naming the file and the field; thousands of random
 * mutations and truncations of valid files never crash (ASan in CI) and
 * either load consistently or fail with a message; failed allocations
 * leave nothing behind.
 */
#include "gjtest.h"
#include "runtime/rt.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------ helpers */

static char tmpdir[64];

static int setup_dir(void **state) {
    (void)state;
    return gjt_tmpdir_make(tmpdir, sizeof tmpdir, "gjt-llmc");
}

static int teardown_dir(void **state) {
    (void)state;
    return gjt_tmpdir_remove(tmpdir);
}

static const char *path_of(const char *name) {
    static char p[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s", tmpdir, name);
    return p[k];
}

static void write_file(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* The whole file (malloc'd) and its length. */
static unsigned char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static void put32(unsigned char *p, int32_t v) {
    uint32_t u = (uint32_t)v;
    for (int k = 0; k < 4; k++)
        p[k] = (unsigned char)(u >> (8 * k));
}

/* The error names what it must: the file and a word about the field. */
static void assert_error_has(const char *path, const char *word) {
    const char *e = gj_last_error();
    if (!strstr(e, path) || !gjt_error_has(word))
        fail_msg("error should name '%s' and '%s', got: %s", path, word, e);
}

/* A small configuration: L 2, NH 2, C 4, V 11 padded to 16, maxT 8. */
static const gj_llmc_config tiny = {.max_seq_len = 8, .vocab_size = 11, .num_layers = 2,
                                    .num_heads = 2, .channels = 4, .padded_vocab_size = 16};
#define TINY_N 592 /* its parameter count */

/* A model file of cfg built by hand: llm.c's header, then float j of
 * tensor i = i + j / 1024 (exact in f32), tensors in llm.c's order. */
static unsigned char *model_bytes(const gj_llmc_config *c, int64_t n_params, size_t *len) {
    size_t n = 1024 + 4 * (size_t)n_params;
    unsigned char *b = calloc(1, n);
    assert_non_null(b);
    const int32_t w[8] = {20240326, 3, c->max_seq_len, c->vocab_size, c->num_layers,
                          c->num_heads, c->channels, c->padded_vocab_size};
    for (int k = 0; k < 8; k++)
        put32(b + 4 * k, w[k]);
    size_t off = 1024;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int64_t s[3], e = 1;
        int nd = gj_llmc_param_shape(c, i, s);
        for (int d = 0; d < nd; d++)
            e *= s[d];
        for (int64_t j = 0; j < e; j++) {
            float f = (float)i + (float)j / 1024.0f;
            int32_t v;
            memcpy(&v, &f, 4);
            put32(b + off, v);
            off += 4;
        }
    }
    assert_int_equal(off, n);
    *len = n;
    return b;
}

/* A token file of tok[0..n) built by hand. */
static unsigned char *tokens_bytes(const uint16_t *tok, int64_t n, size_t *len) {
    unsigned char *b = calloc(1, 1024 + 2 * (size_t)n);
    assert_non_null(b);
    put32(b, 20240520);
    put32(b + 4, 1);
    put32(b + 8, (int32_t)n);
    for (int64_t i = 0; i < n; i++) {
        b[1024 + 2 * i] = (unsigned char)(tok[i] & 0xff);
        b[1024 + 2 * i + 1] = (unsigned char)(tok[i] >> 8);
    }
    *len = 1024 + 2 * (size_t)n;
    return b;
}

/* ------------------------------------------------------------- model */

static void test_model_layout(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    assert_int_equal(gj_llmc_num_parameters(&tiny), TINY_N);
    gj_llmc_config gpt2 = {1024, 50257, 12, 12, 768, 50304};
    assert_int_equal(gj_llmc_num_parameters(&gpt2), 124475904); /* llm.c's num_parameters */
    static const char *names[16] = {"wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb",
                                    "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb",
                                    "fcprojw", "fcprojb", "lnfw", "lnfb"};
    for (int i = 0; i < 16; i++)
        assert_string_equal(gj_llmc_param_name(i), names[i]);
    assert_null(gj_llmc_param_name(16));
    assert_null(gj_llmc_param_name(-1));
    int64_t s[3];
    assert_int_equal(gj_llmc_param_shape(&gpt2, 0, s), 2);
    assert_true(s[0] == 50304 && s[1] == 768);
    assert_int_equal(gj_llmc_param_shape(&gpt2, 12, s), 3);
    assert_true(s[0] == 12 && s[1] == 768 && s[2] == 3072);
    assert_int_equal(gj_llmc_param_shape(&gpt2, 16, s), -1);

    /* a hand-made file: every tensor where llm.c puts it, f32 and f64 */
    size_t len;
    unsigned char *b = model_bytes(&tiny, TINY_N, &len);
    const char *p = path_of("model.bin");
    write_file(p, b, len);
    for (int k = 0; k < 2; k++) {
        gj_dtype dt = k ? GJ_F64 : GJ_F32;
        gj_llmc_config c;
        gj_tensor *t[16];
        assert_int_equal(gj_llmc_load_model(p, dt, &c, t), 0);
        assert_memory_equal(&c, &tiny, sizeof c);
        for (int i = 0; i < 16; i++) {
            int nd = gj_llmc_param_shape(&tiny, i, s);
            assert_true(gjt_shape_is(t[i], nd, s));
            assert_int_equal(gj_tensor_dtype(t[i]), dt);
            assert_false(gj_requires_grad(t[i]));
            int64_t n = gj_tensor_numel(t[i]);
            assert_true(gj_tensor_item_at(t[i], 0) == (double)i);
            assert_true(gj_tensor_item_at(t[i], n - 1) == (double)i + (double)(n - 1) / 1024.0);
        }
        /* the writer gives back exactly these bytes (from f32 and from f64) */
        const char *q = path_of("model2.bin");
        assert_int_equal(gj_llmc_save_model(q, &c, t), 0);
        size_t len2;
        unsigned char *b2 = read_file(q, &len2);
        assert_int_equal(len2, len);
        assert_memory_equal(b2, b, len);
        free(b2);
        for (int i = 0; i < 16; i++)
            gj_release(t[i]);
    }
    free(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Writes b with header word k set to v (k < 0: unchanged), length len. */
static const char *variant(const char *name, const unsigned char *b, size_t len, int k, int32_t v) {
    unsigned char *m = malloc(len + 8);
    assert_non_null(m);
    memcpy(m, b, len);
    if (k >= 0)
        put32(m + 4 * k, v);
    const char *p = path_of(name);
    write_file(p, m, len);
    free(m);
    return p;
}

static void expect_model_error(const char *p, const char *word) {
    gj_llmc_config c;
    gj_tensor *t[16];
    gj_clear_error();
    assert_int_equal(gj_llmc_load_model(p, GJ_F32, &c, t), -1);
    for (int i = 0; i < 16; i++)
        assert_null(t[i]);
    assert_error_has(p, word);
}

static void test_model_bad_files(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    size_t len;
    unsigned char *b = model_bytes(&tiny, TINY_N, &len);
    expect_model_error(variant("m.bin", b, len, 0, 20240520), "token file magic");
    expect_model_error(variant("m.bin", b, len, 0, 1), "magic");
    expect_model_error(variant("m.bin", b, len, 1, 5), "bf16");
    expect_model_error(variant("m.bin", b, len, 1, 2), "version");
    expect_model_error(variant("m.bin", b, len, 2, 0), "max_seq_len");
    expect_model_error(variant("m.bin", b, len, 3, -5), "vocab_size");
    expect_model_error(variant("m.bin", b, len, 4, 0), "num_layers");
    expect_model_error(variant("m.bin", b, len, 5, 3), "num_heads"); /* 4 % 3 */
    expect_model_error(variant("m.bin", b, len, 6, INT32_MIN), "channels");
    expect_model_error(variant("m.bin", b, len, 7, 10), "padded_vocab_size"); /* < V */
    expect_model_error(variant("m.bin", b, len, 7, 17), "need");             /* sizes vs length */
    /* sizes whose product overflows int64 */
    {
        unsigned char h[1024] = {0};
        memcpy(h, b, 1024);
        for (int k = 2; k <= 7; k++)
            put32(h + 4 * k, INT32_MAX);
        put32(h + 20, 1); /* NH 1 */
        expect_model_error(variant("m.bin", h, 1024, -1, 0), "overflow");
    }
    expect_model_error(variant("m.bin", b, len - 4, -1, 0), "truncated");
    expect_model_error(variant("m.bin", b, 1000, -1, 0), "truncated");
    expect_model_error(variant("m.bin", b, 0, -1, 0), "truncated");
    {
        unsigned char *x = calloc(1, len + 4);
        memcpy(x, b, len);
        expect_model_error(variant("m.bin", x, len + 4, -1, 0), "too long");
        free(x);
    }
    expect_model_error(path_of("missing.bin"), "cannot open");
    expect_model_error(tmpdir, "regular file");
    gj_llmc_config c;
    gj_tensor *t[16];
    assert_int_equal(gj_llmc_load_model(variant("m.bin", b, len, -1, 0), GJ_I64, &c, t), -1);
    GJT_ASSERT_ERROR("f32 or f64");
    assert_int_equal(gj_llmc_load_model(NULL, GJ_F32, &c, t), -1);
    GJT_ASSERT_ERROR("path");
    /* the writer refuses a tensor of the wrong shape or dtype, and a bad config */
    assert_int_equal(gj_llmc_load_model(path_of("m.bin"), GJ_F32, &c, t), 0);
    gj_tensor *keep = t[4];
    int64_t s2[2] = {3, 3};
    t[4] = gj_zeros(GJ_F32, 2, s2);
    assert_int_equal(gj_llmc_save_model(path_of("out.bin"), &c, t), -1);
    assert_error_has(path_of("out.bin"), "qkvw");
    gj_release(t[4]);
    t[4] = gj_zeros(GJ_I64, 3, (int64_t[]){2, 12, 4});
    assert_int_equal(gj_llmc_save_model(path_of("out.bin"), &c, t), -1);
    GJT_ASSERT_ERROR("f32 or f64");
    gj_release(t[4]);
    t[4] = keep;
    gj_llmc_config bad = c;
    bad.num_heads = 3;
    assert_int_equal(gj_llmc_save_model(path_of("out.bin"), &bad, t), -1);
    GJT_ASSERT_ERROR("num_heads");
    assert_int_equal(access(path_of("out.bin"), F_OK), -1); /* nothing written */
    assert_int_equal(gj_llmc_save_model(path_of("nodir/x.bin"), &c, t), -1);
    GJT_ASSERT_ERROR("nodir does not exist");
    assert_int_equal(gj_llmc_config_check(&bad), -1);
    GJT_ASSERT_ERROR("multiple of num_heads");
    assert_int_equal(gj_llmc_num_parameters(NULL), -1);
    for (int i = 0; i < 16; i++)
        gj_release(t[i]);
    free(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* -------------------------------------------------------- token files */

static void test_tokens(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    uint16_t tok[300];
    for (int i = 0; i < 300; i++)
        tok[i] = (uint16_t)(i * 257 % 65536); /* both bytes of each token vary */
    size_t len;
    unsigned char *b = tokens_bytes(tok, 300, &len);
    const char *p = path_of("tok.bin");
    assert_int_equal(gj_llmc_save_tokens(p, tok, 300), 0);
    size_t len2;
    unsigned char *b2 = read_file(p, &len2);
    assert_int_equal(len2, len);
    assert_memory_equal(b, b2, len); /* llm.c's bytes */
    free(b2);
    gj_tensor *t = gj_llmc_load_tokens(p, 0);
    assert_non_null(t);
    int64_t n = 300;
    assert_true(gjt_shape_is(t, 1, &n));
    assert_int_equal(gj_tensor_dtype(t), GJ_I64);
    for (int i = 0; i < 300; i++)
        assert_int_equal((int64_t)gj_tensor_item_at(t, i), tok[i]);
    gj_release(t);
    t = gj_llmc_load_tokens(p, 65536);
    assert_non_null(t);
    gj_release(t);
    /* token 1 is 257: a vocabulary of 257 refuses it, naming its position */
    assert_null(gj_llmc_load_tokens(p, 257));
    assert_error_has(p, "token 1 is 257");
    const char *q;
    q = variant("t.bin", b, len, 0, 20240326);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "model checkpoint magic");
    q = variant("t.bin", b, len, 1, 2);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "version");
    q = variant("t.bin", b, len, 2, 0);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "token count");
    q = variant("t.bin", b, len, 2, -3);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "token count");
    q = variant("t.bin", b, len - 1, -1, 0);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "truncated");
    q = variant("t.bin", b, len, 2, 299);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "too long");
    q = variant("t.bin", b, 10, -1, 0);
    assert_null(gj_llmc_load_tokens(q, 0));
    assert_error_has(q, "truncated");
    assert_int_equal(gj_llmc_save_tokens(p, tok, 0), -1);
    GJT_ASSERT_ERROR("tokens");
    assert_int_equal(gj_llmc_save_tokens(p, NULL, 5), -1);
    free(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------------- loader */

/* A file of tokens 0, 1, ..., n-1: a batch's first input is its offset. */
static const char *counting_file(const char *name, int n) {
    uint16_t *tok = malloc((size_t)n * sizeof *tok);
    assert_non_null(tok);
    for (int i = 0; i < n; i++)
        tok[i] = (uint16_t)i;
    const char *p = path_of(name);
    assert_int_equal(gj_llmc_save_tokens(p, tok, n), 0);
    free(tok);
    return p;
}

/* The next batch must be tokens [first, first + B T] of a counting file. */
static void expect_batch(gj_llmc_loader *l, int64_t B, int64_t T, int64_t first) {
    gj_tensor *x, *y;
    assert_int_equal(gj_llmc_loader_next(l, &x, &y), 0);
    int64_t s[2] = {B, T};
    assert_true(gjt_shape_is(x, 2, s) && gjt_shape_is(y, 2, s));
    assert_int_equal(gj_tensor_dtype(x), GJ_I64);
    for (int64_t i = 0; i < B * T; i++) {
        if ((int64_t)gj_tensor_item_at(x, i) != first + i ||
            (int64_t)gj_tensor_item_at(y, i) != first + i + 1)
            fail_msg("batch at %lld: element %lld is %g -> %g", (long long)first, (long long)i,
                     gj_tensor_item_at(x, i), gj_tensor_item_at(y, i));
    }
    gj_release(x);
    gj_release(y);
}

static void test_loader_order(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    /* 20 tokens, B 2, T 3: (20 - 1) / 6 = 3 batches; token 19 is never read */
    const char *p = counting_file("count.bin", 20);
    gj_llmc_loader *l = gj_llmc_loader_new(p, 2, 3, 100, false);
    assert_non_null(l);
    assert_int_equal(gj_llmc_loader_num_tokens(l), 20);
    assert_int_equal(gj_llmc_loader_num_batches(l), 3);
    int64_t e, k;
    expect_batch(l, 2, 3, 0);
    expect_batch(l, 2, 3, 6);
    expect_batch(l, 2, 3, 12); /* targets end at token 18 */
    assert_int_equal(gj_llmc_loader_get_position(l, &e, &k), 0);
    assert_true(e == 0 && k == 3);
    expect_batch(l, 2, 3, 0); /* the wrap: llm.c's dataloader_advance_ resets */
    assert_int_equal(gj_llmc_loader_get_position(l, &e, &k), 0);
    assert_true(e == 1 && k == 1);
    expect_batch(l, 2, 3, 6);
    gj_llmc_loader_reset(l);
    expect_batch(l, 2, 3, 0);
    assert_int_equal(gj_llmc_loader_set_position(l, 7, 2), 0);
    expect_batch(l, 2, 3, 12);
    assert_int_equal(gj_llmc_loader_set_position(l, 0, 4), -1);
    GJT_ASSERT_ERROR("no such position");
    assert_int_equal(gj_llmc_loader_set_position(l, -1, 0), -1);
    gj_llmc_loader_free(l);
    /* exactly one batch and its last target: 7 tokens for B 2, T 3; 6 are too few */
    l = gj_llmc_loader_new(p, 1, 19, 100, false);
    assert_non_null(l);
    assert_int_equal(gj_llmc_loader_num_batches(l), 1);
    expect_batch(l, 1, 19, 0);
    expect_batch(l, 1, 19, 0);
    gj_llmc_loader_free(l);
    assert_null(gj_llmc_loader_new(p, 1, 20, 100, false));
    assert_error_has(p, "fewer than one batch");
    assert_null(gj_llmc_loader_new(p, 2, 3, 19, false)); /* token 19 >= 19 */
    assert_error_has(p, "token 19 is 19");
    assert_null(gj_llmc_loader_new(p, 0, 3, 0, false));
    GJT_ASSERT_ERROR("batch");
    assert_null(gj_llmc_loader_new(p, 1 << 20, 1 << 20, 0, false));
    GJT_ASSERT_ERROR("int32");
    /* a file cut after the loader checked it: the batch read fails, no crash */
    l = gj_llmc_loader_new(p, 2, 3, 0, false);
    assert_non_null(l);
    assert_int_equal(truncate(p, 1024 + 2 * 8), 0);
    gj_tensor *x = (gj_tensor *)1, *y = (gj_tensor *)1;
    expect_batch(l, 2, 3, 0);
    assert_int_equal(gj_llmc_loader_next(l, &x, &y), -1);
    assert_null(x);
    assert_null(y);
    assert_error_has(p, "truncated");
    gj_llmc_loader_free(l);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Data-parallel reading (llm.c's DataLoader with process_rank and
 * num_processes): rank r of N takes its B T slice of every N B T chunk, so
 * the ranks together read one process's batches of N B rows. */
static void test_loader_ranks(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    /* 40 tokens, B 2, T 3, 3 ranks: (40 - 1) / 18 = 2 batches */
    const char *p = counting_file("ranks.bin", 40);
    gj_llmc_loader *l[3];
    for (int r = 0; r < 3; r++) {
        l[r] = gj_llmc_loader_new_rank(p, 2, 3, 100, false, r, 3);
        assert_non_null(l[r]);
        assert_int_equal(gj_llmc_loader_num_batches(l[r]), 2);
    }
    for (int k = 0; k < 3; k++) /* the third is the next epoch's first */
        for (int r = 0; r < 3; r++) expect_batch(l[r], 2, 3, (k % 2) * 18 + r * 6);
    for (int r = 0; r < 3; r++) gj_llmc_loader_free(l[r]);
    /* one process of batch 6 reads what the three read, row block by row block */
    gj_llmc_loader *one = gj_llmc_loader_new_rank(p, 6, 3, 100, false, 0, 1);
    assert_non_null(one);
    expect_batch(one, 6, 3, 0);
    expect_batch(one, 6, 3, 18);
    gj_llmc_loader_free(one);
    assert_null(gj_llmc_loader_new_rank(p, 2, 3, 100, false, 3, 3));
    GJT_ASSERT_ERROR("rank 3 of 3 ranks");
    assert_null(gj_llmc_loader_new_rank(p, 2, 3, 100, false, 0, 0));
    GJT_ASSERT_ERROR("rank 0 of 0 ranks");
    assert_null(gj_llmc_loader_new_rank(p, 2, 10, 100, false, 0, 2)); /* 41 tokens needed */
    assert_error_has(p, "fewer than one batch of 2 x 2 x 10");
    /* shuffled: each rank draws its own order from 42 + rank, as llm.c */
    gj_llmc_loader *a = gj_llmc_loader_new_rank(p, 1, 3, 100, true, 0, 2);
    gj_llmc_loader *b = gj_llmc_loader_new(p, 1, 6, 100, true);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(gj_llmc_loader_num_batches(a), gj_llmc_loader_num_batches(b));
    gj_llmc_loader_free(a);
    gj_llmc_loader_free(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* llm.c's shuffled train loader. The reference orders were printed by a
 * program built on llm.c's own llmc/rand.h (commit f1e2ace, not part of
 * this repository): manual_seed(&s, 42), then per epoch
 * init_identity_permutation and random_permutation(p, n, &s). */
static void test_loader_shuffle(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    static const int ref10[3][10] = {{1, 3, 9, 7, 6, 0, 8, 4, 5, 2},
                                     {9, 8, 2, 5, 1, 0, 7, 6, 4, 3},
                                     {6, 2, 8, 3, 9, 1, 0, 5, 4, 7}};
    static const int ref3[3][3] = {{2, 1, 0}, {2, 0, 1}, {2, 1, 0}};
    /* B 1, T 2: 21 tokens hold 10 batches, batch k starts at token 2k */
    const char *p = counting_file("count21.bin", 21);
    gj_llmc_loader *l = gj_llmc_loader_new(p, 1, 2, 0, true);
    assert_non_null(l);
    for (int e = 0; e < 3; e++)
        for (int k = 0; k < 10; k++)
            expect_batch(l, 1, 2, 2 * ref10[e][k]);
    /* a position restores the order, mid-epoch */
    assert_int_equal(gj_llmc_loader_set_position(l, 1, 4), 0);
    for (int k = 4; k < 10; k++)
        expect_batch(l, 1, 2, 2 * ref10[1][k]);
    expect_batch(l, 1, 2, 2 * ref10[2][0]);
    /* reset draws the next permutation, as llm.c's dataloader_reset */
    assert_int_equal(gj_llmc_loader_set_position(l, 0, 3), 0);
    gj_llmc_loader_reset(l);
    expect_batch(l, 1, 2, 2 * ref10[1][0]);
    gj_llmc_loader_free(l);
    /* 3 batches (B 2, T 3 over 20 tokens), three epochs */
    p = counting_file("count20.bin", 20);
    l = gj_llmc_loader_new(p, 2, 3, 0, true);
    assert_non_null(l);
    for (int e = 0; e < 3; e++)
        for (int k = 0; k < 3; k++)
            expect_batch(l, 2, 3, 6 * ref3[e][k]);
    gj_llmc_loader_free(l);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ---------------------------------------------------------- tokenizer */

/* A tokenizer file by hand: version ver, n pieces "p<i>" (piece 0 "\n"),
 * eot (version 2). */
static unsigned char *tokenizer_bytes(int ver, int n, int eot, size_t *len) {
    size_t cap = 1024 + (size_t)n * 10;
    unsigned char *b = calloc(1, cap);
    assert_non_null(b);
    put32(b, 20240328);
    put32(b + 4, ver);
    put32(b + 8, n);
    if (ver == 2)
        put32(b + 12, eot);
    size_t off = 1024;
    for (int i = 0; i < n; i++) {
        char s[16];
        int k = i == 0 ? snprintf(s, sizeof s, "\n") : snprintf(s, sizeof s, "p%d", i);
        b[off++] = (unsigned char)k;
        memcpy(b + off, s, (size_t)k);
        off += (size_t)k;
    }
    *len = off;
    return b;
}

static void test_tokenizer(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    size_t len;
    unsigned char *b = tokenizer_bytes(2, 300, 7, &len);
    const char *p = path_of("tok2.bin");
    write_file(p, b, len);
    gj_llmc_tokenizer *t = gj_llmc_tokenizer_load(p);
    assert_non_null(t);
    assert_int_equal(gj_llmc_tokenizer_vocab_size(t), 300);
    assert_int_equal(gj_llmc_tokenizer_eot(t), 7);
    size_t n;
    assert_string_equal(gj_llmc_tokenizer_decode(t, 0, &n), "\n");
    assert_int_equal(n, 1);
    assert_string_equal(gj_llmc_tokenizer_decode(t, 299, &n), "p299");
    assert_int_equal(n, 4);
    assert_null(gj_llmc_tokenizer_decode(t, 300, &n));
    assert_int_equal(n, 0);
    GJT_ASSERT_ERROR("out of range");
    assert_null(gj_llmc_tokenizer_decode(t, -1, NULL));
    /* the writer gives back the same bytes */
    const char *pieces[300];
    int lens[300];
    for (int i = 0; i < 300; i++)
        pieces[i] = gj_llmc_tokenizer_decode(t, i, &n), lens[i] = (int)n;
    const char *q = path_of("tok2w.bin");
    assert_int_equal(gj_llmc_tokenizer_save(q, 300, pieces, lens, 7), 0);
    size_t len2;
    unsigned char *b2 = read_file(q, &len2);
    assert_int_equal(len2, len);
    assert_memory_equal(b, b2, len);
    free(b2);
    lens[5] = 0;
    assert_int_equal(gj_llmc_tokenizer_save(q, 300, pieces, lens, 7), -1);
    GJT_ASSERT_ERROR("piece 5");
    lens[5] = 2;
    assert_int_equal(gj_llmc_tokenizer_save(q, 300, pieces, lens, 300), -1);
    GJT_ASSERT_ERROR("end-of-text");
    gj_llmc_tokenizer_free(t);
    free(b);
    /* version 1: GPT-2's 50257 pieces, end-of-text 50256 */
    b = tokenizer_bytes(1, 50257, 0, &len);
    p = path_of("tok1.bin");
    write_file(p, b, len);
    t = gj_llmc_tokenizer_load(p);
    assert_non_null(t);
    assert_int_equal(gj_llmc_tokenizer_eot(t), 50256);
    assert_string_equal(gj_llmc_tokenizer_decode(t, 50256, NULL), "p50256");
    gj_llmc_tokenizer_free(t);
    free(b);
    b = tokenizer_bytes(1, 300, 0, &len);
    p = variant("tk.bin", b, len, -1, 0);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "version 1");
    free(b);
    /* damaged version 2 files */
    b = tokenizer_bytes(2, 300, 7, &len);
    p = variant("tk.bin", b, len, 0, 20240520);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "token file magic");
    p = variant("tk.bin", b, len, 1, 3);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "version");
    p = variant("tk.bin", b, len, 3, 300);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "end-of-text");
    p = variant("tk.bin", b, len, 2, 301);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "truncated");
    p = variant("tk.bin", b, len, 2, INT32_MAX);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "vocab_size");
    p = variant("tk.bin", b, len, 2, 0);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "vocab_size");
    p = variant("tk.bin", b, len, 2, 299);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "after the last");
    p = variant("tk.bin", b, len - 1, -1, 0);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "truncated");
    b[1024 + 2] = 0; /* piece 0 ("\n") takes bytes 0-1; piece 1's length byte */
    p = variant("tk.bin", b, len, -1, 0);
    assert_null(gj_llmc_tokenizer_load(p));
    assert_error_has(p, "piece 1 has length 0");
    free(b);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* --------------------------------------------------------------- fuzz */

typedef enum fuzz_kind { FUZZ_MODEL, FUZZ_TOKENS, FUZZ_TOKENIZER } fuzz_kind;

/* Loads p as kind; a success must be consistent, a failure must say why
 * naming the file. Returns whether it loaded. */
static bool fuzz_load(fuzz_kind kind, const char *p, size_t len) {
    gj_clear_error();
    bool ok = false;
    if (kind == FUZZ_MODEL) {
        gj_llmc_config c;
        gj_tensor *t[16];
        if (gj_llmc_load_model(p, GJ_F32, &c, t) == 0) {
            ok = true;
            assert_int_equal(gj_llmc_config_check(&c), 0);
            int64_t total = 0, s[3];
            for (int i = 0; i < 16; i++) {
                int nd = gj_llmc_param_shape(&c, i, s);
                assert_true(gjt_shape_is(t[i], nd, s));
                total += gj_tensor_numel(t[i]);
                gj_release(t[i]);
            }
            assert_int_equal(1024 + 4 * (size_t)total, len);
        }
    } else if (kind == FUZZ_TOKENS) {
        gj_tensor *t = gj_llmc_load_tokens(p, 11);
        if (t) {
            ok = true;
            assert_int_equal(1024 + 2 * (size_t)gj_tensor_numel(t), len);
            for (int64_t i = 0; i < gj_tensor_numel(t); i++)
                assert_true(gj_tensor_item_at(t, i) < 11);
            gj_release(t);
        }
        if (gj_last_error()[0] && !strstr(gj_last_error(), p))
            fail_msg("no file name in: %s", gj_last_error());
        gj_clear_error();
        gj_llmc_loader *l = gj_llmc_loader_new(p, 2, 3, 11, true);
        if (l) {
            for (int k = 0; k < 5; k++) {
                gj_tensor *x, *y;
                assert_int_equal(gj_llmc_loader_next(l, &x, &y), 0);
                gj_release(x);
                gj_release(y);
            }
            gj_llmc_loader_free(l);
        } else if (ok) {
            GJT_ASSERT_ERROR("fewer than one batch"); /* a valid but short file */
        }
    } else {
        gj_llmc_tokenizer *t = gj_llmc_tokenizer_load(p);
        if (t) {
            ok = true;
            int64_t v = gj_llmc_tokenizer_vocab_size(t);
            assert_true(v >= 1 && gj_llmc_tokenizer_eot(t) < v);
            for (int64_t i = 0; i < v; i++) {
                size_t n;
                const char *s = gj_llmc_tokenizer_decode(t, i, &n);
                assert_non_null(s);
                assert_true(n >= 1 && n <= 255 && s[n] == 0);
            }
            gj_llmc_tokenizer_free(t);
        }
    }
    if (!ok && (!gj_last_error()[0] || !strstr(gj_last_error(), p)))
        fail_msg("kind %d: failed without a message naming the file: '%s'", (int)kind,
                 gj_last_error());
    return ok;
}

/* Random damage to valid files of each kind: bits flipped (mostly in the
 * header), header words set to edge values, the file cut or extended,
 * tokenizer length bytes changed. Never a crash; a load is consistent or
 * fails with a message. */
static void test_fuzz(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    size_t vlen[3];
    unsigned char *valid[3];
    valid[FUZZ_MODEL] = model_bytes(&tiny, TINY_N, &vlen[0]);
    uint16_t tok[60];
    for (int i = 0; i < 60; i++)
        tok[i] = (uint16_t)(i * 7 % 11);
    valid[FUZZ_TOKENS] = tokens_bytes(tok, 60, &vlen[1]);
    valid[FUZZ_TOKENIZER] = tokenizer_bytes(2, 40, 3, &vlen[2]);
    static const int32_t edge[] = {0, 1, -1, 2, 3, 5, 8, 11, 16, 255, 256, 65536, INT32_MAX,
                                   INT32_MIN, INT32_MAX / 2, 1 << 20, 20240326, 20240520,
                                   20240328};
    const int n_edge = (int)(sizeof edge / sizeof edge[0]);
    gjt_rng r;
    gjt_rng_seed(&r, 20261127);
    const char *p = path_of("fuzz.bin");
    int loaded[3] = {0}, cases = 1500;
    for (int kind = 0; kind < 3; kind++) {
        size_t cap = vlen[kind] + 256;
        unsigned char *m = malloc(cap);
        assert_non_null(m);
        for (int c = 0; c < cases; c++) {
            size_t len = vlen[kind];
            memcpy(m, valid[kind], len);
            int edits = 1 + (int)gjt_rng_int(&r, 3);
            for (int e = 0; e < edits; e++) {
                switch (gjt_rng_int(&r, 6)) {
                case 0: { /* a bit, in the header's used words or anywhere */
                    size_t at = gjt_rng_int(&r, 2) ? (size_t)gjt_rng_int(&r, 32)
                                                   : (size_t)gjt_rng_int(&r, (int64_t)len);
                    if (at < len)
                        m[at] ^= (unsigned char)(1u << gjt_rng_int(&r, 8));
                    break;
                }
                case 1: /* a header word to an edge value */
                    put32(m + 4 * gjt_rng_int(&r, 8), edge[gjt_rng_int(&r, n_edge)]);
                    break;
                case 2: /* a header word off by a little */
                {
                    int k = (int)gjt_rng_int(&r, 8);
                    int32_t w = (int32_t)((uint32_t)m[4 * k] | (uint32_t)m[4 * k + 1] << 8 |
                                          (uint32_t)m[4 * k + 2] << 16 |
                                          (uint32_t)m[4 * k + 3] << 24);
                    put32(m + 4 * k, (int32_t)((uint32_t)w + (uint32_t)gjt_rng_int(&r, 5) - 2u));
                    break;
                }
                case 3: /* cut */
                    len = (size_t)gjt_rng_int(&r, (int64_t)len + 1);
                    break;
                case 4: /* extend with random bytes */
                {
                    size_t add = 1 + (size_t)gjt_rng_int(&r, 64);
                    if (len + add <= cap) {
                        for (size_t i = 0; i < add; i++)
                            m[len + i] = (unsigned char)gjt_rng_u64(&r);
                        len += add;
                    }
                    break;
                }
                default: /* any byte after the header (tokenizer lengths, tokens) */
                    if (len > 1024)
                        m[1024 + (size_t)gjt_rng_int(&r, (int64_t)(len - 1024))] =
                            (unsigned char)gjt_rng_int(&r, 256);
                    break;
                }
            }
            write_file(p, m, len);
            loaded[kind] += fuzz_load((fuzz_kind)kind, p, len);
        }
        free(m);
        free(valid[kind]);
    }
    print_message("fuzz: %d mutated files of each kind; loaded: model %d, tokens %d, "
                  "tokenizer %d\n", cases, loaded[0], loaded[1], loaded[2]);
    for (int kind = 0; kind < 3; kind++)
        assert_true(loaded[kind] > 0 && loaded[kind] < cases / 2);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------- allocation failures */

static void test_alloc_failures(void **state) {
    (void)state;
    size_t len;
    unsigned char *b = model_bytes(&tiny, TINY_N, &len);
    const char *pm = path_of("am.bin");
    write_file(pm, b, len);
    free(b);
    const char *pt = counting_file("at.bin", 50);
    unsigned char *tb = tokenizer_bytes(2, 20, 1, &len);
    const char *pk = path_of("ak.bin");
    write_file(pk, tb, len);
    free(tb);
    int64_t live0 = gjt_live_bytes();
    for (int what = 0; what < 5; what++) {
        int failed = 0;
        for (int64_t k = 1; k < 300; k++) {
            gj_rt_alloc_fail_at(k);
            gj_clear_error();
            bool ok;
            if (what == 0) {
                gj_llmc_config c;
                gj_tensor *t[16];
                ok = gj_llmc_load_model(pm, GJ_F32, &c, t) == 0;
                gj_rt_alloc_fail_at(0);
                if (ok) {
                    assert_int_equal(gj_llmc_save_model(path_of("am2.bin"), &c, t), 0);
                    for (int i = 0; i < 16; i++)
                        gj_release(t[i]);
                }
            } else if (what == 1) {
                gj_tensor *t = gj_llmc_load_tokens(pt, 0);
                gj_rt_alloc_fail_at(0);
                ok = t != NULL;
                gj_release(t);
            } else if (what == 2) {
                gj_llmc_loader *l = gj_llmc_loader_new(pt, 2, 3, 0, true);
                gj_tensor *x = NULL, *y = NULL;
                ok = l && gj_llmc_loader_next(l, &x, &y) == 0;
                gj_rt_alloc_fail_at(0);
                gj_release(x);
                gj_release(y);
                gj_llmc_loader_free(l);
            } else if (what == 3) {
                gj_llmc_tokenizer *t = gj_llmc_tokenizer_load(pk);
                gj_rt_alloc_fail_at(0);
                ok = t != NULL;
                gj_llmc_tokenizer_free(t);
            } else {
                uint16_t tok[5] = {1, 2, 3, 4, 5};
                ok = gj_llmc_save_tokens(path_of("as.bin"), tok, 5) == 0;
                gj_rt_alloc_fail_at(0);
            }
            if (ok)
                break;
            failed++;
            assert_true(gj_last_error()[0] != '\0');
        }
        assert_true(failed >= 1);
        assert_int_equal(gjt_live_bytes(), live0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_layout),
        cmocka_unit_test(test_model_bad_files),
        cmocka_unit_test(test_tokens),
        cmocka_unit_test(test_loader_order),
        cmocka_unit_test(test_loader_ranks),
        cmocka_unit_test(test_loader_shuffle),
        cmocka_unit_test(test_tokenizer),
        cmocka_unit_test(test_fuzz),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
