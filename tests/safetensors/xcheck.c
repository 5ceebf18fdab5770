/* SPDX-License-Identifier: MIT */
/*
 * xcheck.c - the gradjit side of the cross-reader test (cross_reader.py):
 *
 *   st_xcheck write FILE   writes the tensors listed below with gradjit
 *   st_xcheck read FILE    reads FILE (written by numpy in cross_reader.py)
 *                          and checks every value bit for bit
 *
 * Both sides compute the expected values from the same small formulas,
 * written independently here and in the Python script. Exit 0 on success,
 * 1 with a message naming the tensor and element otherwise.
 */
#include "gradjit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what) {
    fprintf(stderr, "st_xcheck: %s: %s\n", what, gj_last_error());
    return 1;
}

static int add(gj_state_dict *sd, const char *name, gj_dtype dt, int ndim, const int64_t *shape,
               const void *data) {
    gj_tensor *t = gj_from_data(dt, ndim, shape, data);
    int rc = t ? gj_state_dict_add(sd, name, t) : -1;
    gj_release(t);
    return rc;
}

static int write_file(const char *path) {
    gj_state_dict *sd = gj_state_dict_new();
    float f32[12];
    for (int i = 0; i < 12; i++)
        f32[i] = (float)i * 0.5f - 3.0f;
    double f64[5] = {M_PI, -1e300, 5e-324, INFINITY, -0.0};
    uint16_t bf16[6] = {0x3f80, 0xbf80, 0x7fc0, 0x0001, 0xff80, 0x4049};
    int64_t i64[4] = {INT64_MIN, -1, 0, INT64_MAX};
    float scalar = 2.5f;
    int64_t s34[2] = {3, 4}, s5 = 5, s23[2] = {2, 3}, s4 = 4, s03[2] = {0, 3};
    int rc = 0;
    rc |= add(sd, "gj.f32", GJ_F32, 2, s34, f32);
    rc |= add(sd, "gj.f64", GJ_F64, 1, &s5, f64);
    rc |= add(sd, "gj.bf16", GJ_BF16, 2, s23, bf16);
    rc |= add(sd, "gj.i64", GJ_I64, 1, &s4, i64);
    rc |= add(sd, "gj.scalar", GJ_F32, 0, NULL, &scalar);
    rc |= add(sd, "gj.empty", GJ_F32, 2, s03, NULL);
    rc |= gj_state_dict_set_metadata(sd, "format", "pt");
    rc |= gj_state_dict_set_metadata(sd, "unicode", "\xc3\xa9\xe2\x82\xac \"q\"");
    if (rc != 0 || gj_save_safetensors(sd, path) != 0) {
        gj_state_dict_free(sd);
        return fail("write");
    }
    gj_state_dict_free(sd);
    return 0;
}

/* Checks that sd holds name with this dtype, shape and bytes. */
static int expect(const gj_state_dict *sd, const char *name, gj_dtype dt, int ndim,
                  const int64_t *shape, const void *bytes, size_t nbytes) {
    gj_tensor *t = gj_state_dict_get(sd, name);
    if (!t) {
        fprintf(stderr, "st_xcheck: %s missing\n", name);
        return 1;
    }
    if (gj_tensor_dtype(t) != dt || gj_tensor_ndim(t) != ndim) {
        fprintf(stderr, "st_xcheck: %s: dtype %d ndim %d, expected %d and %d\n", name,
                (int)gj_tensor_dtype(t), gj_tensor_ndim(t), (int)dt, ndim);
        return 1;
    }
    for (int d = 0; d < ndim; d++)
        if (gj_tensor_shape(t)[d] != shape[d]) {
            fprintf(stderr, "st_xcheck: %s: dim %d is %lld, expected %lld\n", name, d,
                    (long long)gj_tensor_shape(t)[d], (long long)shape[d]);
            return 1;
        }
    if (nbytes && memcmp(gj_tensor_data(t), bytes, nbytes) != 0) {
        const unsigned char *a = gj_tensor_data(t), *b = bytes;
        size_t i = 0;
        while (a[i] == b[i])
            i++;
        fprintf(stderr, "st_xcheck: %s: byte %zu is 0x%02x, expected 0x%02x\n", name, i, a[i],
                b[i]);
        return 1;
    }
    return 0;
}

static int read_file(const char *path) {
    gj_state_dict *sd = gj_load_safetensors(path);
    if (!sd)
        return fail("read");
    float f32[6];
    for (int i = 0; i < 6; i++)
        f32[i] = (float)i * 0.25f - 1.0f;
    double f64[3] = {1.0 / 3.0, -2.5, 1e-310};
    uint16_t bf16[4] = {0x4000, 0xc040, 0x0000, 0x8000};
    int64_t i64[4] = {(int64_t)1 << 40, -5, 7, -((int64_t)1 << 62)};
    int64_t s23[2] = {2, 3}, s3 = 3, s4 = 4, s22[2] = {2, 2}, s1 = 1;
    double one = 42.0;
    int rc = 0;
    rc |= expect(sd, "py.f32", GJ_F32, 2, s23, f32, sizeof f32);
    rc |= expect(sd, "py.f64", GJ_F64, 1, &s3, f64, sizeof f64);
    rc |= expect(sd, "py.bf16", GJ_BF16, 1, &s4, bf16, sizeof bf16);
    rc |= expect(sd, "py.i64 \xe2\x9c\x93", GJ_I64, 2, s22, i64, sizeof i64);
    rc |= expect(sd, "py.one", GJ_F64, 1, &s1, &one, sizeof one);
    const char *w = gj_state_dict_get_metadata(sd, "writer");
    if (!w || strcmp(w, "numpy") != 0) {
        fprintf(stderr, "st_xcheck: metadata writer is %s, expected numpy\n", w ? w : "absent");
        rc = 1;
    }
    if (gj_state_dict_size(sd) != 5) {
        fprintf(stderr, "st_xcheck: %d tensors, expected 5\n", gj_state_dict_size(sd));
        rc = 1;
    }
    /* Loading into existing tensors by name, as a resumed model would. */
    gj_state_dict *model = gj_state_dict_new();
    gj_tensor *t = gj_zeros(GJ_F32, 2, s23);
    gj_state_dict_add(model, "py.f32", t);
    if (gj_state_dict_copy_into(model, sd, false) != 0 ||
        gj_tensor_item_at(t, 5) != (double)f32[5]) {
        fprintf(stderr, "st_xcheck: copy_into: %s\n", gj_last_error());
        rc = 1;
    }
    gj_release(t);
    gj_state_dict_free(model);
    gj_state_dict_free(sd);
    if (rc == 0)
        printf("st_xcheck: %s: 5 tensors and the metadata match bit for bit\n", path);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "write") && strcmp(argv[1], "read"))) {
        fprintf(stderr, "usage: st_xcheck write|read FILE\n");
        return 2;
    }
    return strcmp(argv[1], "write") == 0 ? write_file(argv[2]) : read_file(argv[2]);
}
