/* SPDX-License-Identifier: MIT */
/*
 * test_data.c - gj_idx_load (files written here, gzip and plain, every
 * element type, and damaged ones), the batch iterator (coverage, order,
 * shuffling, drop_last, errors) and the tensor printer (exact text).
 */
#include "gjtest.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

static char g_dir[] = "/tmp/gjt_data_XXXXXX";

/* Writes an IDX file: header (type code tc, dims) + payload bytes, gzip
 * when gz; extra trailing bytes, or `cut` bytes fewer of the payload. */
static void write_idx(const char *path, bool gz, int tc, int nd, const uint32_t *dims,
                      const void *payload, size_t bytes, int cut, int extra) {
    uint8_t hdr[4 + 16] = {0, 0, (uint8_t)tc, (uint8_t)nd};
    for (int d = 0; d < nd; d++) {
        hdr[4 + 4 * d] = (uint8_t)(dims[d] >> 24);
        hdr[5 + 4 * d] = (uint8_t)(dims[d] >> 16);
        hdr[6 + 4 * d] = (uint8_t)(dims[d] >> 8);
        hdr[7 + 4 * d] = (uint8_t)dims[d];
    }
    size_t n = bytes - (size_t)cut;
    uint8_t pad[4] = {1, 2, 3, 4};
    if (gz) {
        gzFile g = gzopen(path, "wb");
        assert_non_null(g);
        gzwrite(g, hdr, 4 + 4 * (unsigned)nd);
        if (n) gzwrite(g, payload, (unsigned)n);
        if (extra) gzwrite(g, pad, (unsigned)extra);
        gzclose(g);
    } else {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(hdr, 1, 4 + 4 * (size_t)nd, f);
        fwrite(payload, 1, n, f);
        fwrite(pad, 1, (size_t)extra, f);
        fclose(f);
    }
}

static void path_of(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", g_dir, name);
}

static void test_idx_load(void **state) {
    (void)state;
    char p[256];
    /* u8 images [3, 2, 2], gzip, scaled to [0, 1] */
    uint8_t img[12];
    for (int i = 0; i < 12; i++) img[i] = (uint8_t)(i * 20);
    path_of(p, sizeof p, "img.gz");
    write_idx(p, true, 0x08, 3, (uint32_t[]){3, 2, 2}, img, sizeof img, 0, 0);
    gj_tensor *t = gj_idx_load(p, GJ_F32, 1.0 / 255);
    assert_non_null(t);
    assert_true(gjt_shape_is(t, 3, (int64_t[]){3, 2, 2}));
    double want[12];
    for (int i = 0; i < 12; i++) want[i] = (float)(i * 20 * (1.0 / 255));
    assert_true(gjt_tensor_close("u8 images", t, want, 0, 0));
    gj_release(t);
    /* the same bytes as i64 labels, plain file */
    path_of(p, sizeof p, "lab");
    write_idx(p, false, 0x08, 1, (uint32_t[]){12}, img, sizeof img, 0, 0);
    t = gj_idx_load(p, GJ_I64, 1);
    assert_non_null(t);
    for (int i = 0; i < 12; i++) assert_true(gj_tensor_item_at(t, i) == i * 20);
    gj_release(t);
    /* big-endian i16, i32, f32, f64 */
    uint8_t i16[4] = {0xff, 0xfe, 0x01, 0x00};           /* -2, 256 */
    uint8_t i32[8] = {0x80, 0, 0, 0, 0, 0, 0x01, 0x02};  /* INT32_MIN, 258 */
    uint8_t f32[4] = {0x3f, 0xc0, 0, 0};                 /* 1.5 */
    uint8_t f64[8] = {0xc0, 0x09, 0x21, 0xfb, 0x54, 0x44, 0x2d, 0x18}; /* -pi */
    path_of(p, sizeof p, "i16");
    write_idx(p, true, 0x0B, 1, (uint32_t[]){2}, i16, 4, 0, 0);
    t = gj_idx_load(p, GJ_I64, 1);
    assert_true(t && gj_tensor_item_at(t, 0) == -2 && gj_tensor_item_at(t, 1) == 256);
    gj_release(t);
    path_of(p, sizeof p, "i32");
    write_idx(p, true, 0x0C, 1, (uint32_t[]){2}, i32, 8, 0, 0);
    t = gj_idx_load(p, GJ_F64, 1);
    assert_true(t && gj_tensor_item_at(t, 0) == -2147483648.0 && gj_tensor_item_at(t, 1) == 258);
    gj_release(t);
    path_of(p, sizeof p, "f32");
    write_idx(p, false, 0x0D, 1, (uint32_t[]){1}, f32, 4, 0, 0);
    t = gj_idx_load(p, GJ_F64, 2);
    assert_true(t && gj_tensor_item_at(t, 0) == 3.0);
    gj_release(t);
    path_of(p, sizeof p, "f64");
    write_idx(p, true, 0x0E, 1, (uint32_t[]){1}, f64, 8, 0, 0);
    t = gj_idx_load(p, GJ_F64, 1);
    assert_true(t && gj_tensor_item_at(t, 0) == -3.141592653589793);
    gj_release(t);

    /* damaged files: each an error naming the file, never a crash */
    path_of(p, sizeof p, "cut.gz");
    write_idx(p, true, 0x08, 3, (uint32_t[]){3, 2, 2}, img, sizeof img, 1, 0);
    assert_null(gj_idx_load(p, GJ_F32, 1));
    assert_true(gjt_error_has("truncated data") && gjt_error_has("cut.gz"));
    path_of(p, sizeof p, "extra");
    write_idx(p, false, 0x08, 1, (uint32_t[]){12}, img, sizeof img, 0, 3);
    assert_null(gj_idx_load(p, GJ_I64, 1));
    assert_true(gjt_error_has("bytes after"));
    path_of(p, sizeof p, "badtype");
    write_idx(p, true, 0x07, 1, (uint32_t[]){12}, img, sizeof img, 0, 0);
    assert_null(gj_idx_load(p, GJ_F32, 1));
    assert_true(gjt_error_has("not an IDX file"));
    path_of(p, sizeof p, "rank0");
    write_idx(p, true, 0x08, 0, NULL, img, 0, 0, 0);
    assert_null(gj_idx_load(p, GJ_F32, 1));
    path_of(p, sizeof p, "huge");
    write_idx(p, true, 0x08, 3, (uint32_t[]){0xffffffffu, 0xffffffffu, 2}, img, 0, 0, 0);
    assert_null(gj_idx_load(p, GJ_F32, 1));
    assert_true(gjt_error_has("16 GiB"));
    path_of(p, sizeof p, "shorthdr");
    write_idx(p, false, 0x08, 3, (uint32_t[]){3, 2, 2}, img, 0, 0, 0);
    FILE *f = fopen(p, "r+b");
    assert_non_null(f);
    assert_int_equal(ftruncate(fileno(f), 9), 0);
    fclose(f);
    assert_null(gj_idx_load(p, GJ_F32, 1));
    assert_true(gjt_error_has("truncated header"));
    path_of(p, sizeof p, "f32");
    assert_null(gj_idx_load(p, GJ_I64, 1)); /* 1.5 is not an integer */
    assert_true(gjt_error_has("not an integer"));
    assert_null(gj_idx_load(p, GJ_I64, 2.0));
    assert_true(gjt_error_has("scale"));
    path_of(p, sizeof p, "missing");
    assert_null(gj_idx_load(p, GJ_F32, 1));
    assert_true(gjt_error_has("cannot open") && gjt_error_has("missing"));
    assert_null(gj_idx_load(NULL, GJ_F32, 1));

    /* the real Fashion-MNIST labels, when the Debian package is there */
    const char *fm = "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz";
    if (access(fm, R_OK) == 0) {
        t = gj_idx_load(fm, GJ_I64, 1);
        assert_non_null(t);
        assert_true(gjt_shape_is(t, 1, (int64_t[]){10000}));
        int64_t count[10] = {0};
        for (int64_t i = 0; i < 10000; i++) {
            double v = gj_tensor_item_at(t, i);
            assert_true(v >= 0 && v < 10);
            count[(int)v]++;
        }
        for (int k = 0; k < 10; k++) assert_int_equal(count[k], 1000); /* balanced test set */
        gj_release(t);
    }
}

/* Rows of x are their own index (x[i] = {i, 10 i}), y[i] = i. */
static void test_batches(void **state) {
    (void)state;
    double xv[20], yv[10];
    for (int i = 0; i < 10; i++) {
        xv[2 * i] = i;
        xv[2 * i + 1] = 10 * i;
        yv[i] = i;
    }
    gj_tensor *xy[2] = {gjt_tensor(GJ_F32, 2, (int64_t[]){10, 2}, xv),
                        gjt_tensor(GJ_F64, 1, (int64_t[]){10}, yv)};
    /* in order, the last batch short */
    gj_batches *it = gj_batches_new(2, xy, 3, false, false, 1);
    assert_non_null(it);
    assert_int_equal(gj_batches_len(it), 4);
    gj_tensor *b[2];
    int64_t seen = 0, sizes[4];
    int nb = 0;
    while (gj_batches_next(it, b)) {
        sizes[nb++] = gj_tensor_shape(b[0])[0];
        for (int64_t r = 0; r < gj_tensor_shape(b[0])[0]; r++, seen++) {
            assert_true(gj_tensor_item_at(b[0], 2 * r) == seen);
            assert_true(gj_tensor_item_at(b[0], 2 * r + 1) == 10 * seen);
            assert_true(gj_tensor_item_at(b[1], r) == seen);
        }
        gj_release(b[0]);
        gj_release(b[1]);
    }
    assert_string_equal(gj_last_error(), ""); /* the end, not an error */
    assert_int_equal(nb, 4);
    assert_int_equal(sizes[3], 1);
    assert_int_equal(seen, 10);
    gj_batches_free(it);

    /* shuffled, drop_last: 3 batches of 3, rows paired across tensors,
     * no row twice; the same seed gives the same order; epochs differ */
    gj_batches *a = gj_batches_new(2, xy, 3, true, true, 7);
    gj_batches *c = gj_batches_new(2, xy, 3, true, true, 7);
    assert_int_equal(gj_batches_len(a), 3);
    int order[2][9];
    for (int epoch = 0; epoch < 2; epoch++) {
        int used[10] = {0}, k = 0;
        while (gj_batches_next(a, b)) {
            gj_tensor *bc[2];
            assert_true(gj_batches_next(c, bc));
            assert_int_equal(gj_tensor_shape(b[0])[0], 3);
            for (int r = 0; r < 3; r++) {
                int row = (int)gj_tensor_item_at(b[1], r);
                assert_true(gj_tensor_item_at(b[0], 2 * r) == row); /* x and y together */
                assert_true(gj_tensor_item_at(bc[1], r) == row);    /* same seed, same order */
                assert_int_equal(used[row]++, 0);
                order[epoch][k++] = row;
            }
            for (int q = 0; q < 2; q++) {
                gj_release(b[q]);
                gj_release(bc[q]);
            }
        }
        assert_int_equal(k, 9);
        gj_batches_reset(a);
        gj_batches_reset(c);
    }
    assert_true(memcmp(order[0], order[1], sizeof order[0]) != 0);
    gj_batches_free(a);
    gj_batches_free(c);

    /* errors */
    gj_tensor *short_y = gjt_tensor(GJ_F64, 1, (int64_t[]){9}, yv);
    gj_tensor *bad[2] = {xy[0], short_y};
    assert_null(gj_batches_new(2, bad, 3, false, false, 0));
    assert_true(gjt_error_has("9 rows"));
    assert_null(gj_batches_new(2, xy, 0, false, false, 0));
    assert_null(gj_batches_new(0, xy, 3, false, false, 0));
    assert_false(gj_batches_next(NULL, b));
    assert_int_equal(gj_batches_len(NULL), -1);
    gj_release(short_y);
    gj_release(xy[0]);
    gj_release(xy[1]);
}

static void expect_text(gj_tensor *t, int edge, const char *want) {
    char *s = gj_tensor_format(t, edge);
    assert_non_null(s);
    if (strcmp(s, want) != 0) {
        fprintf(stderr, "got:\n%s\nwant:\n%s\n", s, want);
        fail();
    }
    gj_free_string(s);
}

static void test_printer(void **state) {
    (void)state;
    gj_tensor *m = gjt_tensor(GJ_F32, 2, (int64_t[]){2, 2}, (double[]){1, -2.5, 0, 3});
    expect_text(m, 3, "tensor([[ 1.0000, -2.5000],\n        [ 0.0000,  3.0000]], dtype=f32)");
    assert_int_equal(gj_set_requires_grad(m, true), 0);
    expect_text(m, 3,
                "tensor([[ 1.0000, -2.5000],\n        [ 0.0000,  3.0000]], dtype=f32, "
                "requires_grad=true)");
    gj_release(m);
    gj_tensor *ix = gjt_i64(1, (int64_t[]){3}, (int64_t[]){7, -1, 42});
    expect_text(ix, 3, "tensor([ 7, -1, 42], dtype=i64)");
    gj_release(ix);
    double v[10];
    for (int i = 0; i < 10; i++) v[i] = i;
    gj_tensor *l = gjt_tensor(GJ_F64, 1, (int64_t[]){10}, v);
    expect_text(l, 2, "tensor([0.0000, 1.0000, ..., 8.0000, 9.0000], dtype=f64)");
    gj_release(l);
    gj_tensor *sci = gjt_tensor(GJ_F64, 1, (int64_t[]){2}, (double[]){1e-6, 2.0});
    expect_text(sci, 3, "tensor([1.0000e-06, 2.0000e+00], dtype=f64)");
    gj_release(sci);
    gj_tensor *z = gj_scalar(GJ_F32, 0.5);
    expect_text(z, 3, "tensor(0.5000, dtype=f32)");
    gj_release(z);
    gj_tensor *e = gj_zeros(GJ_F32, 2, (int64_t[]){0, 3});
    expect_text(e, 3, "tensor([], size=(0, 3), dtype=f32)");
    gj_release(e);
    gj_tensor *nan = gjt_tensor(GJ_F32, 1, (int64_t[]){2}, (double[]){NAN, -INFINITY});
    expect_text(nan, 3, "tensor([ nan, -inf], dtype=f32)");
    gj_release(nan);
    assert_null(gj_tensor_format(NULL, 3));
    assert_int_equal(gj_tensor_print(NULL), -1);
}

static int setup(void **state) {
    (void)state;
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idx_load),
        cmocka_unit_test(test_batches),
        cmocka_unit_test(test_printer),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
