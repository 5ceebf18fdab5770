/* SPDX-License-Identifier: MIT */
/*
 * test_runtime.c - the runtime core: errors, allocator accounting and
 * failure injection, storage and tensor headers, the strided copy with
 * dtype conversion, the RNG, the thread pool and the BLAS wrappers.
 *
 * Byte counters are global, so every test measures deltas around its own
 * allocations; the suite runs its tests one after the other in one thread
 * (except where a test starts threads itself and joins them).
 */
#include "gjtest.h"

#include "runtime/gemm_int.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

/* Filled by main() before anything loads OpenBLAS in this process. */
static bool g_user_coretype;       /* OPENBLAS_CORETYPE set by the user */
static char g_probe_core[128];     /* OpenBLAS's own detection, in a child */

static bool error_contains(const char *needle) { return strstr(gj_last_error(), needle) != NULL; }

static int64_t live_bytes(void) {
    gj_mem m;
    gj_mem_stats(&m);
    return m.live_bytes;
}

/* ------------------------------------------------------------- errors */

static void test_errors(void **state) {
    (void)state;
    gj_clear_error();
    assert_string_equal(gj_last_error(), "");
    gj_rt_set_error("op: bad %s %d", "thing", 42);
    assert_string_equal(gj_last_error(), "op: bad thing 42");
    /* the arguments may point into the current message */
    gj_rt_set_error("outer: %s", gj_last_error());
    assert_string_equal(gj_last_error(), "outer: op: bad thing 42");
    /* long messages are truncated, not overflowed */
    char big[6000]; /* longer than the 4096-byte buffer */
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    gj_rt_set_error("%s", big);
    size_t len = strlen(gj_last_error());
    assert_true(len > 500 && len < sizeof big - 1);
    gj_clear_error();
    assert_string_equal(gj_last_error(), "");

    char buf[64];
    int64_t shape[3] = {2, 3, 4};
    assert_string_equal(gj_rt_fmt_shape(buf, sizeof buf, 3, shape), "[2, 3, 4]");
    assert_string_equal(gj_rt_fmt_shape(buf, sizeof buf, 0, shape), "[]");
    char tiny[5];
    gj_rt_fmt_shape(tiny, sizeof tiny, 3, shape);
    assert_string_equal(tiny, "[2, ");
    assert_string_equal(gj_rt_dtype_name(GJ_F32), "f32");
    assert_string_equal(gj_rt_dtype_name(GJ_F64), "f64");
    assert_string_equal(gj_rt_dtype_name(GJ_BF16), "bf16");
    assert_string_equal(gj_rt_dtype_name(GJ_I64), "i64");
}

/* ---------------------------------------------------------- allocator */

static void test_alloc_counters(void **state) {
    (void)state;
    gj_mem m0, m1, m2, m3;
    gj_mem_stats(&m0);
    void *a = gj_rt_alloc_data(1000);
    void *b = gj_rt_alloc_data(24);
    assert_non_null(a);
    assert_non_null(b);
    gj_mem_stats(&m1);
    assert_int_equal(m1.live_bytes, m0.live_bytes + 1024);
    assert_true(m1.peak_bytes >= m0.live_bytes + 1024);
    assert_int_equal(m1.n_allocs, m0.n_allocs + 2);
    gj_rt_free_data(a, 1000);
    gj_mem_stats(&m2);
    assert_int_equal(m2.live_bytes, m0.live_bytes + 24);
    assert_int_equal(m2.peak_bytes, m1.peak_bytes); /* peak stays */
    gj_mem_reset_peak();
    gj_mem_stats(&m2);
    assert_int_equal(m2.peak_bytes, m2.live_bytes);
    gj_rt_free_data(b, 24);
    gj_rt_free_data(NULL, 0);
    gj_mem_stats(&m3);
    assert_int_equal(m3.live_bytes, m0.live_bytes);
    assert_int_equal(m3.peak_bytes, m0.live_bytes + 24);
    gj_mem_reset_peak();
    gj_mem_stats(&m3);
    assert_int_equal(m3.peak_bytes, m0.live_bytes);

    /* metadata allocations do not count as tensor bytes */
    void *p = gj_rt_malloc(4096);
    void *q = gj_rt_calloc(10, 100);
    assert_non_null(p);
    assert_non_null(q);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(((unsigned char *)q)[i], 0);
    p = gj_rt_realloc(p, 8192);
    assert_non_null(p);
    assert_int_equal(live_bytes(), m0.live_bytes);
    gj_rt_free(p);
    gj_rt_free(q);
    gj_rt_free(NULL);
    /* overflowing calloc fails cleanly */
    assert_null(gj_rt_calloc(SIZE_MAX / 2, 4));
    assert_true(error_contains("out of memory"));
}

static void test_alloc_alignment(void **state) {
    (void)state;
    size_t sizes[] = {0, 1, 2, 63, 64, 65, 100, 1000, 4096, 100003};
    int64_t base = live_bytes();
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        unsigned char *p = gj_rt_alloc_data(sizes[i]);
        assert_non_null(p);
        assert_int_equal((uintptr_t)p % 64, 0);
        /* the whole rounded-up block is usable (ASan checks the bounds) */
        size_t rounded = sizes[i] ? (sizes[i] + 63) / 64 * 64 : 64;
        memset(p, 0xab, rounded);
        assert_int_equal(live_bytes(), base + (int64_t)sizes[i]);
        gj_rt_free_data(p, sizes[i]);
        assert_int_equal(live_bytes(), base);
    }
}

static void test_alloc_failure_injection(void **state) {
    (void)state;
    gj_mem m0, m1;
    gj_rt_alloc_fail_at(0); /* resets the "since last call" mark */
    int64_t c0 = gj_rt_alloc_count();
    gj_mem_stats(&m0);

    assert_int_equal(gj_rt_alloc_fail_at(3), 0);
    void *a = gj_rt_alloc_data(128); /* 1st: ok */
    void *b = gj_rt_malloc(16);      /* 2nd: ok */
    assert_non_null(a);
    assert_non_null(b);
    gj_clear_error();
    void *c = gj_rt_alloc_data(256); /* 3rd: fails */
    assert_null(c);
    assert_true(error_contains("out of memory allocating 256 bytes"));
    gj_mem_stats(&m1);
    assert_int_equal(m1.live_bytes, m0.live_bytes + 128);
    assert_int_equal(m1.n_allocs, m0.n_allocs + 1);
    void *d = gj_rt_alloc_data(256); /* later allocations succeed */
    assert_non_null(d);
    assert_int_equal(gj_rt_alloc_count(), c0 + 4);
    assert_int_equal(gj_rt_alloc_fail_at(0), 4);
    gj_rt_free_data(a, 128);
    gj_rt_free_data(d, 256);
    gj_rt_free(b);

    /* each metadata entry point */
    gj_rt_alloc_fail_at(1);
    assert_null(gj_rt_malloc(8));
    gj_rt_alloc_fail_at(1);
    assert_null(gj_rt_calloc(2, 8));
    void *r = gj_rt_malloc(8);
    assert_non_null(r);
    gj_rt_alloc_fail_at(1);
    assert_null(gj_rt_realloc(r, 64)); /* r stays valid */
    assert_true(error_contains("out of memory allocating 64 bytes"));
    gj_rt_free(r);

    /* a tensor needs 3 allocations (header, storage, data): every failure
     * point returns NULL and leaks nothing */
    int64_t shape[2] = {4, 8};
    for (int k = 1; k <= 3; k++) {
        int64_t before = live_bytes();
        gj_rt_alloc_fail_at(k);
        gj_clear_error();
        gj_tensor *t = gj_rt_tensor_new(GJ_F32, 2, shape);
        assert_null(t);
        assert_true(error_contains("out of memory"));
        assert_int_equal(live_bytes(), before);
    }
    gj_rt_alloc_fail_at(4);
    gj_tensor *t = gj_rt_tensor_new(GJ_F32, 2, shape);
    assert_non_null(t);
    gj_rt_alloc_fail_at(0);
    gj_rt_tensor_release(t);
    assert_int_equal(live_bytes(), m0.live_bytes);
}

/* ------------------------------------------------------ storage/tensor */

static int g_ag_freed;
static void count_ag_free(gj_tensor *t) {
    assert_int_equal(t->magic, GJ_RT_TENSOR_MAGIC);
    g_ag_freed++;
    t->ag = NULL;
}

static void test_storage_and_tensor_lifetime(void **state) {
    (void)state;
    int64_t base = live_bytes();
    gj_rt_storage *s = gj_rt_storage_new(0);
    assert_non_null(s);
    assert_non_null(s->data);
    assert_int_equal(s->nbytes, 0);
    gj_rt_storage_release(s);

    s = gj_rt_storage_new(100);
    assert_int_equal(live_bytes(), base + 100);
    for (int i = 0; i < 100; i++)
        assert_int_equal(((unsigned char *)s->data)[i], 0);
    gj_rt_storage_retain(s);
    gj_rt_storage_release(s);
    assert_int_equal(live_bytes(), base + 100);
    gj_rt_storage_release(s);
    assert_int_equal(live_bytes(), base);

    int64_t shape[2] = {3, 5};
    gj_tensor *t = gj_rt_tensor_new(GJ_F32, 2, shape);
    assert_non_null(t);
    assert_int_equal(live_bytes(), base + 60);
    assert_int_equal(t->numel, 15);
    assert_int_equal(t->strides[0], 5);
    assert_int_equal(t->strides[1], 1);
    assert_true(gj_rt_is_contiguous(t));
    assert_true(gj_rt_check_tensor(t, "op", "t"));
    for (int64_t i = 0; i < 15; i++)
        assert_true(gj_rt_get(t, i) == 0.0);
    assert_true(isnan(gj_rt_get(t, 15)));

    gj_tensor *e = gj_rt_tensor_empty(GJ_BF16, 2, shape);
    assert_non_null(e);
    assert_int_equal(live_bytes(), base + 60 + 30);
    gj_rt_tensor_release(e);

    gj_tensor *a = gj_rt_tensor_alias(t);
    assert_non_null(a);
    assert_ptr_equal(a->storage, t->storage);
    assert_int_equal(atomic_load(&t->storage->refcount), 2);
    assert_int_equal(live_bytes(), base + 60); /* no new data */
    gj_rt_bump_version(a);
    assert_int_equal(atomic_load(&t->storage->version), 1);

    /* the autograd callback runs once, on the last release */
    int dummy;
    gj_rt_set_ag_free(count_ag_free);
    g_ag_freed = 0;
    a->ag = &dummy;
    gj_rt_tensor_retain(a);
    gj_rt_tensor_release(a);
    assert_int_equal(g_ag_freed, 0);
    gj_rt_tensor_release(a);
    assert_int_equal(g_ag_freed, 1);
    gj_rt_set_ag_free(NULL);

    gj_rt_meta meta;
    gj_rt_meta_of(t, &meta);
    assert_int_equal(meta.dtype, GJ_F32);
    assert_int_equal(meta.ndim, 2);
    assert_int_equal(meta.shape[0], 3);
    assert_int_equal(meta.shape[1], 5);
    gj_rt_tensor_release(t);
    gj_rt_tensor_release(NULL);
    assert_int_equal(live_bytes(), base);

    /* 0-d and empty tensors */
    gj_tensor *z = gj_rt_tensor_new(GJ_F64, 0, NULL);
    assert_non_null(z);
    assert_int_equal(z->numel, 1);
    assert_int_equal(live_bytes(), base + 8);
    gj_rt_tensor_release(z);
    int64_t eshape[2] = {0, 7};
    z = gj_rt_tensor_new(GJ_F64, 2, eshape);
    assert_non_null(z);
    assert_int_equal(z->numel, 0);
    assert_true(gj_rt_is_contiguous(z));
    gj_rt_tensor_release(z);
    assert_int_equal(live_bytes(), base);
}

static void test_check_tensor(void **state) {
    (void)state;
    gj_clear_error();
    assert_false(gj_rt_check_tensor(NULL, "myop", "weight"));
    assert_string_equal(gj_last_error(), "myop: weight is NULL");
    /* A released header is freed memory; check the same magic test on a
     * header that is still valid memory but marked dead. */
    gj_tensor dead;
    memset(&dead, 0, sizeof dead);
    dead.magic = GJ_RT_TENSOR_DEAD;
    assert_false(gj_rt_check_tensor(&dead, "myop", "x"));
    assert_string_equal(gj_last_error(), "myop: x is not a live tensor (released?)");
    dead.magic = 12345;
    assert_false(gj_rt_check_tensor(&dead, "other", "y"));
    assert_true(error_contains("other: y is not a live tensor"));
}

static void test_check_shape(void **state) {
    (void)state;
    int64_t ok[3] = {2, 3, 4};
    assert_true(gj_rt_check_shape(3, ok, GJ_F32, "op"));
    assert_true(gj_rt_check_shape(0, NULL, GJ_F32, "op"));
    int64_t neg[3] = {2, -3, 4};
    assert_false(gj_rt_check_shape(3, neg, GJ_F32, "zeros"));
    assert_true(error_contains("zeros"));
    assert_true(error_contains("negative"));
    assert_true(error_contains("[2, -3, 4]"));
    int64_t huge[2] = {INT64_C(1) << 40, INT64_C(1) << 40};
    assert_false(gj_rt_check_shape(2, huge, GJ_F64, "ones"));
    assert_true(error_contains("ones"));
    assert_true(error_contains("too large"));
    assert_true(error_contains("f64"));
    int64_t edge[1] = {INT64_MAX / 4};
    assert_true(gj_rt_check_shape(1, edge, GJ_F32, "op")); /* exactly fits */
    edge[0] = INT64_MAX / 4 + 1;
    assert_false(gj_rt_check_shape(1, edge, GJ_F32, "op"));
    /* numel 0, but the other dims' byte size overflows: refused (a view or
     * reshape of it would compute overflowing strides) */
    int64_t zero_huge[3] = {INT64_C(1) << 62, 0, INT64_C(1) << 62};
    assert_false(gj_rt_check_shape(3, zero_huge, GJ_F32, "op"));
    assert_true(error_contains("too large"));
    int64_t zero_fits[3] = {INT64_C(1) << 30, 0, INT64_C(1) << 30};
    assert_true(gj_rt_check_shape(3, zero_fits, GJ_F32, "op"));
    int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    assert_false(gj_rt_check_shape(9, nine, GJ_F32, "reshape"));
    assert_true(error_contains("reshape: ndim 9"));
    assert_false(gj_rt_check_shape(-1, nine, GJ_F32, "reshape"));
    assert_false(gj_rt_check_shape(1, ok, (gj_dtype)7, "cast"));
    assert_true(error_contains("cast: invalid dtype"));
    assert_false(gj_rt_check_shape(2, NULL, GJ_F32, "op"));
    /* tensor_new reports the same */
    assert_null(gj_rt_tensor_new(GJ_F32, 3, neg));
    assert_true(error_contains("negative"));
}

static void test_broadcast_shape(void **state) {
    (void)state;
    int64_t out[GJ_MAX_DIMS];
    int n;
    int64_t a[3] = {2, 1, 4}, b[2] = {3, 1};
    assert_true(gj_rt_broadcast_shape(3, a, 2, b, &n, out));
    assert_int_equal(n, 3);
    assert_int_equal(out[0], 2);
    assert_int_equal(out[1], 3);
    assert_int_equal(out[2], 4);
    assert_true(gj_rt_broadcast_shape(0, NULL, 2, b, &n, out)); /* scalar */
    assert_int_equal(n, 2);
    assert_int_equal(out[0], 3);
    assert_int_equal(out[1], 1);
    int64_t c[2] = {3, 4}, d[1] = {5};
    assert_false(gj_rt_broadcast_shape(2, c, 1, d, &n, out));
    int64_t e[2] = {0, 1}, f[2] = {1, 5};
    assert_true(gj_rt_broadcast_shape(2, e, 2, f, &n, out)); /* 0 wins over 1 */
    assert_int_equal(out[0], 0);
    assert_int_equal(out[1], 5);
    int64_t g[1] = {0}, h[1] = {3};
    assert_false(gj_rt_broadcast_shape(1, g, 1, h, &n, out));
    int64_t same[2] = {6, 7};
    assert_true(gj_rt_broadcast_shape(2, same, 2, same, &n, out));
    assert_int_equal(out[0], 6);
    assert_int_equal(out[1], 7);
}

/* Fills a contiguous f64 tensor with 0, 1, 2, ... */
static void iota_f64(gj_tensor *t) {
    double *p = gj_rt_data_ptr(t);
    for (int64_t i = 0; i < t->numel; i++)
        p[i] = (double)i;
}

static void test_views_and_contiguous(void **state) {
    (void)state;
    int64_t base_bytes = live_bytes();
    int64_t shape[3] = {2, 3, 4};
    gj_tensor *t = gj_rt_tensor_new(GJ_F64, 3, shape);
    iota_f64(t);

    /* permute (2, 0, 1): shape [4, 2, 3], strides [1, 12, 4] */
    int64_t pshape[3] = {4, 2, 3}, pstr[3] = {1, 12, 4};
    gj_tensor *p = gj_rt_tensor_view(t->storage, GJ_F64, 3, pshape, pstr, 0);
    assert_non_null(p);
    assert_false(gj_rt_is_contiguous(p));
    for (int64_t i = 0; i < 24; i++) {
        int64_t a = i / 6, b = (i / 3) % 2, c = i % 3; /* p[a][b][c] = t[b][c][a] */
        assert_true(gj_rt_get(p, i) == (double)(b * 12 + c * 4 + a));
    }
    gj_tensor *pc = gj_rt_contiguous(p);
    assert_non_null(pc);
    assert_true(pc != p);
    assert_true(gj_rt_is_contiguous(pc));
    assert_int_equal(live_bytes(), base_bytes + 2 * 192);
    for (int64_t i = 0; i < 24; i++)
        assert_true(gj_rt_get(pc, i) == gj_rt_get(p, i));

    /* contiguous of a contiguous tensor is the tensor itself, retained */
    gj_tensor *same = gj_rt_contiguous(t);
    assert_ptr_equal(same, t);
    assert_int_equal(atomic_load(&t->refcount), 2);
    gj_rt_tensor_release(same);

    /* broadcast: row 1 of t ([3, 4] at offset 12) expanded to [5, 3, 4] */
    int64_t bshape[3] = {5, 3, 4}, bstr[3] = {0, 4, 1};
    gj_tensor *bv = gj_rt_tensor_view(t->storage, GJ_F64, 3, bshape, bstr, 12);
    assert_non_null(bv);
    assert_false(gj_rt_is_contiguous(bv));
    for (int64_t i = 0; i < 60; i++)
        assert_true(gj_rt_get(bv, i) == (double)(12 + i % 12));
    gj_tensor *bc = gj_rt_contiguous(bv);
    assert_non_null(bc);
    for (int64_t i = 0; i < 60; i++)
        assert_true(gj_rt_get(bc, i) == (double)(12 + i % 12));

    /* size-1 axes may carry any stride and still be contiguous */
    int64_t oshape[3] = {1, 3, 1}, ostr[3] = {99, 1, 7};
    gj_tensor *ov = gj_rt_tensor_view(t->storage, GJ_F64, 3, oshape, ostr, 5);
    assert_non_null(ov);
    assert_true(gj_rt_is_contiguous(ov));
    assert_true(gj_rt_get(ov, 2) == 7.0);

    /* views that leave the storage are refused */
    int64_t big[1] = {25};
    gj_clear_error();
    assert_null(gj_rt_tensor_view(t->storage, GJ_F64, 1, big, NULL, 0));
    assert_true(error_contains("tensor_view"));
    int64_t fits[1] = {24};
    gj_tensor *fv = gj_rt_tensor_view(t->storage, GJ_F64, 1, fits, NULL, 0);
    assert_non_null(fv);
    gj_rt_tensor_release(fv);
    assert_null(gj_rt_tensor_view(t->storage, GJ_F64, 1, fits, NULL, 1));
    int64_t negstr[1] = {-1};
    assert_null(gj_rt_tensor_view(t->storage, GJ_F64, 1, fits, negstr, 23));
    assert_null(gj_rt_tensor_view(t->storage, GJ_F64, 1, fits, NULL, -1));

    /* bf16 reads as the upper half of an f32 */
    int64_t one = 2;
    gj_tensor *h = gj_rt_tensor_new(GJ_BF16, 1, &one);
    ((uint16_t *)gj_rt_data_ptr(h))[0] = 0x3fc0; /* 1.5 */
    ((uint16_t *)gj_rt_data_ptr(h))[1] = 0xc010; /* -2.25 */
    assert_true(gj_rt_get(h, 0) == 1.5);
    assert_true(gj_rt_get(h, 1) == -2.25);

    gj_rt_tensor_release(h);
    gj_rt_tensor_release(ov);
    gj_rt_tensor_release(bc);
    gj_rt_tensor_release(bv);
    gj_rt_tensor_release(pc);
    gj_rt_tensor_release(p);
    gj_rt_tensor_release(t);
    assert_int_equal(live_bytes(), base_bytes);
}

/* --------------------------------------------------------------- copy */

static void store(gj_tensor *t, int64_t i, double v) {
    void *p = gj_rt_data_ptr(t);
    switch (t->dtype) {
    case GJ_F32: ((float *)p)[i] = (float)v; break;
    case GJ_F64: ((double *)p)[i] = v; break;
    case GJ_BF16: {
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16); /* exact for the values used */
        break;
    }
    case GJ_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    }
}

static void test_copy_all_dtype_pairs(void **state) {
    (void)state;
    /* exactly representable in bf16 and f32 (before truncation to i64) */
    const double vals[] = {0, 1.5, -2.25, 3, 100, -7, 0.5, -0.75};
    const double int_vals[] = {0, 1, -2, 3, 100, -7, 0, 0}; /* truncated */
    int64_t n = 8;
    int64_t base = live_bytes();
    for (int sd = 0; sd < 4; sd++) {
        for (int dd = 0; dd < 4; dd++) {
            gj_tensor *src = gj_rt_tensor_new((gj_dtype)sd, 1, &n);
            gj_tensor *dst = gj_rt_tensor_new((gj_dtype)dd, 1, &n);
            for (int64_t i = 0; i < n; i++)
                store(src, i, sd == GJ_I64 ? int_vals[i] : vals[i]);
            assert_int_equal(gj_rt_copy_into(dst, src), 0);
            for (int64_t i = 0; i < n; i++) {
                double want = (sd == GJ_I64 || dd == GJ_I64) ? int_vals[i] : vals[i];
                if (gj_rt_get(dst, i) != want) {
                    print_error("copy %s -> %s, element %lld: got %g want %g\n",
                                gj_rt_dtype_name((gj_dtype)sd), gj_rt_dtype_name((gj_dtype)dd),
                                (long long)i, gj_rt_get(dst, i), want);
                    fail();
                }
            }
            gj_rt_tensor_release(src);
            gj_rt_tensor_release(dst);
        }
    }
    assert_int_equal(live_bytes(), base);
}

static uint16_t f32_bits_to_bf16_via_copy(uint32_t bits, gj_dtype via) {
    int64_t one = 1;
    gj_tensor *src = gj_rt_tensor_new(via, 1, &one);
    gj_tensor *dst = gj_rt_tensor_new(GJ_BF16, 1, &one);
    float f;
    memcpy(&f, &bits, 4);
    if (via == GJ_F32)
        ((float *)gj_rt_data_ptr(src))[0] = f;
    else
        ((double *)gj_rt_data_ptr(src))[0] = (double)f;
    assert_int_equal(gj_rt_copy_into(dst, src), 0);
    uint16_t out = ((uint16_t *)gj_rt_data_ptr(dst))[0];
    gj_rt_tensor_release(src);
    gj_rt_tensor_release(dst);
    return out;
}

static void test_copy_bf16_rounding(void **state) {
    (void)state;
    static const struct {
        uint32_t f32;
        uint16_t bf16;
    } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 exact */
        {0x3f808000u, 0x3f80}, /* 1 + 2^-8: tie, round to even (down) */
        {0x3f818000u, 0x3f82}, /* tie, round to even (up) */
        {0x3f808001u, 0x3f81}, /* just above the tie: up */
        {0x3f807fffu, 0x3f80}, /* just below the tie: down */
        {0xbf80c000u, 0xbf81}, /* negative, above tie */
        {0x80000000u, 0x8000}, /* -0 */
        {0x7f800000u, 0x7f80}, /* +inf */
        {0xff800000u, 0xff80}, /* -inf */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x00000001u, 0x0000}, /* smallest denormal rounds to 0 */
        {0x40490fdbu, 0x4049}, /* pi */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        assert_int_equal(f32_bits_to_bf16_via_copy(cases[i].f32, GJ_F32), cases[i].bf16);
        assert_int_equal(f32_bits_to_bf16_via_copy(cases[i].f32, GJ_F64), cases[i].bf16);
    }
    /* NaNs stay NaN, including one whose payload is only in the low bits */
    uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xffc00001u, 0x7fa00000u};
    for (size_t i = 0; i < sizeof nans / sizeof *nans; i++) {
        uint16_t b = f32_bits_to_bf16_via_copy(nans[i], GJ_F32);
        assert_int_equal(b & 0x7f80, 0x7f80);
        assert_true((b & 0x007f) != 0);
        assert_int_equal(b & 0x8000, (nans[i] >> 16) & 0x8000);
    }
    /* float -> i64 saturates and maps NaN to 0 */
    int64_t three = 3;
    gj_tensor *src = gj_rt_tensor_new(GJ_F64, 1, &three);
    gj_tensor *dst = gj_rt_tensor_new(GJ_I64, 1, &three);
    double *s = gj_rt_data_ptr(src);
    s[0] = NAN;
    s[1] = 1e300;
    s[2] = -1e300;
    assert_int_equal(gj_rt_copy_into(dst, src), 0);
    int64_t *d = gj_rt_data_ptr(dst);
    assert_true(d[0] == 0);
    assert_true(d[1] == INT64_MAX);
    assert_true(d[2] == INT64_MIN);
    gj_rt_tensor_release(src);
    gj_rt_tensor_release(dst);
}

static void test_copy_broadcast_strided(void **state) {
    (void)state;
    int64_t base = live_bytes();
    /* src [3, 1] f32 broadcast into a transposed f64 dst view [2, 3, 4] */
    int64_t sshape[2] = {3, 1};
    gj_tensor *src = gj_rt_tensor_new(GJ_F32, 2, sshape);
    for (int i = 0; i < 3; i++)
        ((float *)gj_rt_data_ptr(src))[i] = (float)(10 * (i + 1));
    int64_t bshape[3] = {2, 4, 3};
    gj_tensor *buf = gj_rt_tensor_new(GJ_F64, 3, bshape);
    int64_t vshape[3] = {2, 3, 4}, vstr[3] = {12, 1, 3}; /* buf with axes 1, 2 swapped */
    gj_tensor *dst = gj_rt_tensor_view(buf->storage, GJ_F64, 3, vshape, vstr, 0);
    assert_int_equal(gj_rt_copy_into(dst, src), 0);
    for (int64_t i = 0; i < 24; i++)
        assert_true(gj_rt_get(dst, i) == 10.0 * (double)((i / 4) % 3 + 1));
    /* the underlying buffer holds row-major [2, 4, 3]: value depends on the last axis */
    for (int64_t i = 0; i < 24; i++)
        assert_true(gj_rt_get(buf, i) == 10.0 * (double)(i % 3 + 1));

    /* incompatible shapes are refused with a message */
    int64_t bad[1] = {5};
    gj_tensor *bsrc = gj_rt_tensor_new(GJ_F32, 1, bad);
    gj_clear_error();
    assert_int_equal(gj_rt_copy_into(dst, bsrc), -1);
    assert_true(error_contains("copy_into"));
    assert_true(error_contains("[5]"));
    assert_true(error_contains("[2, 3, 4]"));
    assert_int_equal(gj_rt_copy_into(NULL, bsrc), -1);
    assert_true(error_contains("dst is NULL"));
    gj_rt_tensor_release(bsrc);

    /* large, non-contiguous, converting (exercises the parallel split):
     * dst [301, 257] f32 <- transpose of a [257, 301] f64 tensor */
    int64_t tshape[2] = {257, 301};
    gj_tensor *big = gj_rt_tensor_new(GJ_F64, 2, tshape);
    iota_f64(big);
    int64_t trs[2] = {301, 257}, trst[2] = {1, 301};
    gj_tensor *tv = gj_rt_tensor_view(big->storage, GJ_F64, 2, trs, trst, 0);
    gj_tensor *out = gj_rt_tensor_new(GJ_F32, 2, trs);
    for (int threads = 1; threads <= 2; threads++) {
        gj_rt_set_num_threads(threads);
        memset(gj_rt_data_ptr(out), 0, (size_t)out->numel * 4);
        assert_int_equal(gj_rt_copy_into(out, tv), 0);
        const float *o = gj_rt_data_ptr(out);
        for (int64_t r = 0; r < 301; r++)
            for (int64_t c = 0; c < 257; c++)
                if (o[r * 257 + c] != (float)(c * 301 + r)) {
                    print_error("big copy mismatch at [%lld, %lld]\n", (long long)r, (long long)c);
                    fail();
                }
        /* large contiguous same-dtype: the memcpy path */
        gj_tensor *cc = gj_rt_tensor_new(GJ_F64, 2, tshape);
        assert_int_equal(gj_rt_copy_into(cc, big), 0);
        assert_memory_equal(gj_rt_data_ptr(cc), gj_rt_data_ptr(big), (size_t)big->numel * 8);
        gj_rt_tensor_release(cc);
    }
    gj_rt_set_num_threads(0);

    /* overlapping views of one storage: behaves as if src were copied first */
    int64_t ten = 10, nine = 9;
    gj_tensor *v = gj_rt_tensor_new(GJ_F64, 1, &ten);
    iota_f64(v);
    gj_tensor *lo = gj_rt_tensor_view(v->storage, GJ_F64, 1, &nine, NULL, 0);
    gj_tensor *hi = gj_rt_tensor_view(v->storage, GJ_F64, 1, &nine, NULL, 1);
    assert_int_equal(gj_rt_copy_into(hi, lo), 0); /* v = 0, 0, 1, ..., 8 */
    assert_true(gj_rt_get(v, 0) == 0.0);
    for (int64_t i = 1; i < 10; i++)
        assert_true(gj_rt_get(v, i) == (double)(i - 1));
    assert_int_equal(gj_rt_copy_into(v, v), 0); /* self copy: no-op */
    assert_true(gj_rt_get(v, 9) == 8.0);

    /* 0-d source into a 2-d destination, and empty tensors */
    gj_tensor *sc = gj_rt_tensor_new(GJ_I64, 0, NULL);
    ((int64_t *)gj_rt_data_ptr(sc))[0] = -4;
    int64_t s23[2] = {2, 3};
    gj_tensor *d23 = gj_rt_tensor_new(GJ_BF16, 2, s23);
    assert_int_equal(gj_rt_copy_into(d23, sc), 0);
    for (int64_t i = 0; i < 6; i++)
        assert_true(gj_rt_get(d23, i) == -4.0);
    int64_t e0[2] = {0, 3};
    gj_tensor *empty = gj_rt_tensor_new(GJ_F32, 2, e0);
    assert_int_equal(gj_rt_copy_into(empty, sc), 0);

    gj_rt_tensor_release(empty);
    gj_rt_tensor_release(d23);
    gj_rt_tensor_release(sc);
    gj_rt_tensor_release(lo);
    gj_rt_tensor_release(hi);
    gj_rt_tensor_release(v);
    gj_rt_tensor_release(out);
    gj_rt_tensor_release(tv);
    gj_rt_tensor_release(big);
    gj_rt_tensor_release(dst);
    gj_rt_tensor_release(buf);
    gj_rt_tensor_release(src);
    assert_int_equal(live_bytes(), base);
}

/* ---------------------------------------------------------------- RNG */

static void test_rng(void **state) {
    (void)state;
    gj_manual_seed(1234);
    assert_int_equal(gj_rt_rng_seed(), 1234);
    assert_int_equal(gj_rt_rng_reserve(10), 0);
    assert_int_equal(gj_rt_rng_reserve(5), 10);
    assert_int_equal(gj_rt_rng_reserve(1), 15);
    gj_manual_seed(1234);
    assert_int_equal(gj_rt_rng_reserve(1), 0); /* seeding rewinds */

    /* pure functions of (seed, counter) */
    assert_true(gj_rt_rng_bits(7, 3) == gj_rt_rng_bits(7, 3));
    assert_true(gj_rt_rng_bits(7, 3) != gj_rt_rng_bits(7, 4));
    assert_true(gj_rt_rng_bits(7, 3) != gj_rt_rng_bits(8, 3));
    assert_true(gj_rt_rng_uniform(7, 3) == gj_rt_rng_uniform(7, 3));
    assert_true(gj_rt_rng_normal(7, 3) == gj_rt_rng_normal(7, 3));

    const int n = 100000;
    double su = 0, sn = 0, sn2 = 0, umin = 1, umax = 0;
    int equal_streams = 0;
    for (int i = 0; i < n; i++) {
        double u = gj_rt_rng_uniform(42, (uint64_t)i);
        assert_true(u >= 0.0 && u < 1.0);
        su += u;
        umin = u < umin ? u : umin;
        umax = u > umax ? u : umax;
        double z = gj_rt_rng_normal(42, (uint64_t)i);
        assert_true(isfinite(z));
        sn += z;
        sn2 += z * z;
        equal_streams += gj_rt_rng_uniform(43, (uint64_t)i) == u;
    }
    double mu = su / n, mz = sn / n, vz = sn2 / n - mz * mz;
    /* standard errors: uniform mean 0.0009, normal mean 0.0032, variance 0.0045 */
    assert_true(fabs(mu - 0.5) < 0.01);
    assert_true(fabs(mz) < 0.02);
    assert_true(fabs(vz - 1.0) < 0.03);
    assert_true(umin < 0.001 && umax > 0.999);
    assert_true(equal_streams < 3);
}

/* ---------------------------------------------------------- thread pool */

typedef struct cover_ctx {
    atomic_int *hits;
    atomic_int calls;
    atomic_llong min_len;
    pthread_t threads[64];
    atomic_int n_threads_seen;
    bool nested;
} cover_ctx;

static void nested_fn(void *vctx, int64_t b, int64_t e) {
    atomic_int *count = vctx;
    atomic_fetch_add(count, (int)(e - b));
}

static void cover_fn(void *vctx, int64_t b, int64_t e) {
    cover_ctx *c = vctx;
    for (int64_t i = b; i < e; i++)
        atomic_fetch_add(&c->hits[i], 1);
    atomic_fetch_add(&c->calls, 1);
    long long len = e - b, cur = atomic_load(&c->min_len);
    while (len < cur && !atomic_compare_exchange_weak(&c->min_len, &cur, len)) {
    }
    int k = atomic_fetch_add(&c->n_threads_seen, 1);
    if (k < 64)
        c->threads[k] = pthread_self();
    if (c->nested) {
        /* a nested parallel_for runs inline and still covers its range */
        atomic_int count = 0;
        gj_rt_parallel_for(1000, 1, nested_fn, &count);
        assert_int_equal(atomic_load(&count), 1000);
    }
}

static void check_cover(int64_t n, int64_t grain, int threads, bool nested) {
    cover_ctx c;
    memset(&c, 0, sizeof c);
    c.hits = calloc((size_t)(n > 0 ? n : 1), sizeof(atomic_int));
    assert_non_null(c.hits);
    atomic_store(&c.min_len, INT64_MAX);
    c.nested = nested;
    gj_rt_parallel_for(n, grain, cover_fn, &c);
    for (int64_t i = 0; i < n; i++)
        if (atomic_load(&c.hits[i]) != 1) {
            print_error("n=%lld grain=%lld threads=%d: index %lld hit %d times\n", (long long)n,
                        (long long)grain, threads, (long long)i, atomic_load(&c.hits[i]));
            fail();
        }
    int calls = atomic_load(&c.calls);
    int64_t g = grain < 1 ? 1 : grain;
    if (n == 0) {
        assert_int_equal(calls, 0);
    } else {
        assert_true(calls >= 1 && calls <= threads);
        if (calls > 1)
            assert_true(atomic_load(&c.min_len) >= g); /* every chunk >= grain */
        if (threads >= 2 && n >= 2 * g) {
            /* worth splitting: ran on more than one thread */
            assert_true(calls >= 2);
            assert_false(pthread_equal(c.threads[0], c.threads[1]));
        }
        if (threads == 1 || n < 2 * g)
            assert_int_equal(calls, 1);
    }
    free(c.hits);
}

static void test_parallel_for_coverage(void **state) {
    (void)state;
    const int64_t ns[] = {0, 1, 2, 3, 7, 64, 100, 1000, 4099, 100000};
    const int64_t grains[] = {0, 1, 3, 50, 64, 1000, 100000};
    for (int threads = 1; threads <= 3; threads++) {
        gj_rt_set_num_threads(threads);
        assert_int_equal(gj_rt_num_threads(), threads);
        assert_int_equal(gj_get_num_threads(), threads);
        for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
            for (size_t j = 0; j < sizeof grains / sizeof *grains; j++)
                check_cover(ns[i], grains[j], threads, false);
        check_cover(5000, 100, threads, true);
        /* many small jobs in a row (the spin/sleep hand-off) */
        for (int r = 0; r < 200; r++)
            check_cover(64, 8, threads, false);
    }
    gj_set_num_threads(0);
    assert_true(gj_get_num_threads() >= 1);
}

static void *concurrent_caller(void *arg) {
    int *failures = arg;
    for (int r = 0; r < 100; r++) {
        const int64_t n = 3000;
        cover_ctx c;
        memset(&c, 0, sizeof c);
        c.hits = calloc((size_t)n, sizeof(atomic_int));
        atomic_store(&c.min_len, INT64_MAX);
        gj_rt_parallel_for(n, 10, cover_fn, &c);
        for (int64_t i = 0; i < n; i++)
            *failures += atomic_load(&c.hits[i]) != 1;
        free(c.hits);
    }
    return NULL;
}

static void test_parallel_for_concurrent_callers(void **state) {
    (void)state;
    gj_rt_set_num_threads(2);
    pthread_t th[3];
    int failures[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++)
        assert_int_equal(pthread_create(&th[i], NULL, concurrent_caller, &failures[i]), 0);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++)
        assert_int_equal(failures[i], 0);
    gj_rt_set_num_threads(0);
}

/* --------------------------------------------------------------- BLAS */

/* Reference C = alpha op(A) op(B) + beta C in double, row-major. */
static void naive_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                       const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                       double *C, int64_t ldc) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++)
                acc += (ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
            C[i * ldc + j] = alpha * acc + (beta == 0 ? 0 : beta * C[i * ldc + j]);
        }
}

static void test_gemm(void **state) {
    (void)state;
    const int64_t shapes[][3] = {{1, 1, 1}, {5, 7, 3}, {64, 33, 17}, {130, 70, 90},
                                 {3, 0, 4}, {0, 3, 4}, {4, 5, 0}};
    uint64_t seed = 99;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        for (int t = 0; t < 4; t++) {
            for (int b0 = 0; b0 < 2; b0++) {
                bool ta = t & 1, tb = t & 2;
                double beta = b0 ? 0.5 : 0.0;
                double alpha = 1.5;
                int64_t arows = ta ? K : M, acols = ta ? M : K;
                int64_t brows = tb ? N : K, bcols = tb ? K : N;
                int64_t lda = acols + 3, ldb = bcols + 1, ldc = N + 2;
                size_t asz = (size_t)(arows * lda + 1), bsz = (size_t)(brows * ldb + 1);
                size_t csz = (size_t)(M * ldc + 1);
                double *Ad = malloc(asz * 8), *Bd = malloc(bsz * 8), *Cd = malloc(csz * 8);
                double *Cr = malloc(csz * 8);
                float *Af = malloc(asz * 4), *Bf = malloc(bsz * 4), *Cf = malloc(csz * 4);
                for (size_t i = 0; i < asz; i++)
                    Af[i] = (float)(Ad[i] = gj_rt_rng_uniform(seed, i) * 2 - 1);
                for (size_t i = 0; i < bsz; i++)
                    Bf[i] = (float)(Bd[i] = gj_rt_rng_uniform(seed + 1, i) * 2 - 1);
                for (size_t i = 0; i < csz; i++) {
                    /* beta == 0 must ignore C, even NaN */
                    Cr[i] = Cd[i] = beta == 0 ? NAN : gj_rt_rng_uniform(seed + 2, i);
                    Cf[i] = (float)Cd[i];
                }
                seed += 3;
                naive_gemm(ta, tb, M, N, K, alpha, Ad, lda, Bd, ldb, beta, Cr, ldc);
                gj_rt_dgemm(ta, tb, M, N, K, alpha, Ad, lda, Bd, ldb, beta, Cd, ldc);
                gj_rt_sgemm(ta, tb, M, N, K, (float)alpha, Af, lda, Bf, ldb, (float)beta, Cf, ldc);
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < ldc; j++) {
                        size_t at = (size_t)(i * ldc + j);
                        if (j >= N) { /* padding untouched */
                            assert_true(isnan(Cd[at]) == isnan(Cr[at]));
                            continue;
                        }
                        double want = Cr[at];
                        if (fabs(Cd[at] - want) > 1e-12 * (1 + fabs(want)) ||
                            fabs((double)Cf[at] - want) > 1e-4 * (1 + fabs(want)) * (1 + K / 16.0)) {
                            print_error("gemm M=%lld N=%lld K=%lld ta=%d tb=%d beta=%g at [%lld,%lld]:"
                                        " d=%g s=%g want %g\n", (long long)M, (long long)N,
                                        (long long)K, ta, tb, beta, (long long)i, (long long)j,
                                        Cd[at], (double)Cf[at], want);
                            fail();
                        }
                    }
                free(Ad), free(Bd), free(Cd), free(Cr), free(Af), free(Bf), free(Cf);
            }
        }
    }
    /* bad leading dimension: error, C untouched */
    float A[4] = {1, 2, 3, 4}, B[4] = {1, 0, 0, 1}, C[4] = {9, 9, 9, 9};
    gj_clear_error();
    gj_rt_sgemm(false, false, 2, 2, 2, 1.0f, A, 1, B, 2, 0.0f, C, 2);
    assert_true(error_contains("lda=1"));
    for (int i = 0; i < 4; i++)
        assert_true(C[i] == 9.0f);
    gj_rt_sgemm(false, false, 2, 2, 2, 1.0f, A, 2, B, 2, 0.0f, C, 2);
    assert_true(C[0] == 1.0f && C[1] == 2.0f && C[2] == 3.0f && C[3] == 4.0f);
}

static void test_blas_info(void **state) {
    (void)state;
    assert_int_equal(gj_rt_openblas_init(), 0);
    const char *core = gj_rt_blas_corename();
    assert_non_null(core);
    assert_true(core[0] != '\0');
    assert_string_not_equal(core, "unavailable");
    assert_non_null(strstr(gj_rt_blas_config(), "OpenBLAS"));
    gj_info info;
    gj_get_info(&info);
    assert_string_equal(info.version, GJ_VERSION_STRING);
    assert_string_equal(info.blas_core, core);
    assert_string_equal(info.blas_config, gj_rt_blas_config());
    assert_int_equal(info.num_threads, gj_get_num_threads());
    gj_get_info(NULL);
}

/* The instruction-set level an OpenBLAS 0.3.21 x86-64 kernel set needs:
 * 1 SSE*, 2 AVX, 3 AVX2+FMA, 4 AVX-512; 0 for a name it does not ship. */
static int core_level(const char *core) {
    static const struct { const char *name; int level; } cores[] = {
        {"Prescott", 1}, {"Core2", 1}, {"Penryn", 1}, {"Dunnington", 1}, {"Nehalem", 1},
        {"Atom", 1}, {"Opteron", 1}, {"Opteron_SSE3", 1}, {"Barcelona", 1}, {"Nano", 1},
        {"Sandybridge", 2}, {"Bulldozer", 2}, {"Piledriver", 2}, {"Steamroller", 2},
        {"Excavator", 2}, {"Haswell", 3}, {"Zen", 3}, {"SkylakeX", 4}, {"Cooperlake", 4},
        {"SapphireRapids", 4},
    };
    for (size_t i = 0; core && i < sizeof cores / sizeof cores[0]; i++)
        if (strcasecmp(core, cores[i].name) == 0)
            return cores[i].level;
    return 0;
}

/* The rule over CPU descriptions, not over this machine: every CPU family
 * the project's machines may be maps to a kernel set OpenBLAS ships and the
 * CPU can run, and never to the generic one when AVX2 is there. */
static void test_blas_coretype_table(void **state) {
    (void)state;
    enum { F = 1, BW = 2, VL = 4, DQ = 8, CD = 16, BF = 32 };
    static const struct {
        const char *cpu;
        bool amd;
        int family;
        bool avx2, fma;
        int avx512;
        const char *want;
    } table[] = {
        {"Intel Haswell (family 6 model 63)", false, 6, true, true, 0, "Haswell"},
        {"Intel Skylake-SP (6/85)", false, 6, true, true, F | BW | VL | DQ | CD, "SkylakeX"},
        {"Intel Cooper Lake (6/85 bf16)", false, 6, true, true, F | BW | VL | DQ | CD | BF, "Cooperlake"},
        {"Intel Emerald Rapids (6/207)", false, 6, true, true, F | BW | VL | DQ | CD | BF, "Cooperlake"},
        {"Intel Knights Landing (6/87: no BW/VL/DQ)", false, 6, true, true, F | CD, "Haswell"},
        {"Intel Sandy Bridge (no AVX2)", false, 6, false, false, 0, NULL},
        {"AMD Zen 2 (family 0x17)", true, 0x17, true, true, 0, "Zen"},
        {"AMD Zen 3 (family 0x19 model 1)", true, 0x19, true, true, 0, "Zen"},
        {"AMD Zen 4 (family 0x19 model 0x11)", true, 0x19, true, true, F | BW | VL | DQ | CD | BF, "Cooperlake"},
        {"AMD Zen 5 (family 0x1a)", true, 0x1a, true, true, F | BW | VL | DQ | CD | BF, "Cooperlake"},
        {"AMD Excavator (family 0x15)", true, 0x15, true, true, 0, "Haswell"},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        gj_rt_cpu c = {.amd = table[i].amd, .family = table[i].family, .avx2 = table[i].avx2,
                       .fma = table[i].fma, .avx512f = table[i].avx512 & F,
                       .avx512bw = table[i].avx512 & BW, .avx512vl = table[i].avx512 & VL,
                       .avx512dq = table[i].avx512 & DQ, .avx512cd = table[i].avx512 & CD,
                       .avx512bf16 = table[i].avx512 & BF};
        const char *got = gj_rt_blas_core_for(&c);
        if (!table[i].want) {
            if (got)
                fail_msg("%s: want no choice, got %s", table[i].cpu, got);
            continue;
        }
        if (!got || strcmp(got, table[i].want) != 0)
            fail_msg("%s: want %s, got %s", table[i].cpu, table[i].want, got ? got : "(none)");
        int need = (c.avx512f && c.avx512bw && c.avx512vl && c.avx512dq && c.avx512cd) ? 4 : 3;
        assert_int_equal(core_level(got), need); /* shipped, and runnable here */
    }
}

/* On this machine, whatever it is: the core in use is the rule's choice, it
 * is a kernel set at least as wide as OpenBLAS's own detection, and it is
 * never the generic SSE one on an AVX2 CPU. */
static void test_blas_coretype_rule(void **state) {
    (void)state;
    const char *pick = gj_rt_blas_pick_coretype();
    if (g_user_coretype) {
        print_message("OPENBLAS_CORETYPE set by the user: rule not compared\n");
        skip();
    }
    assert_true(g_probe_core[0] != '\0');
    assert_int_equal(gj_rt_openblas_init(), 0);
    const char *used = gj_rt_blas_corename();
    print_message("cpuid rule: %s, OpenBLAS's own detection: %s, in use: %s\n",
                  pick ? pick : "(none)", g_probe_core, used);
    gj_rt_cpu c;
    gj_rt_cpu_detect(&c);
    if (pick) {
        assert_int_equal(strcasecmp(pick, used), 0);
        assert_true(core_level(used) >= core_level(g_probe_core));
    }
    if (c.avx2 && c.fma) {
        assert_non_null(pick);
        assert_true(core_level(used) >= 3);
    }
}

/* OpenBLAS's own core detection, in a child process that loads it with no
 * OPENBLAS_CORETYPE (this process must not have loaded it yet). */
static void probe_openblas_core(void) {
    int fd[2];
    if (pipe(fd) != 0)
        return;
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        unsetenv("OPENBLAS_CORETYPE");
        const char *name = "";
        void *h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
        if (h) {
            char *(*corename)(void) = (char *(*)(void))dlsym(h, "openblas_get_corename");
            if (corename)
                name = corename();
        }
        ssize_t w = write(fd[1], name, strlen(name));
        (void)w;
        _exit(0);
    }
    close(fd[1]);
    if (pid > 0) {
        ssize_t got = read(fd[0], g_probe_core, sizeof g_probe_core - 1);
        g_probe_core[got > 0 ? got : 0] = '\0';
        waitpid(pid, NULL, 0);
    }
    close(fd[0]);
}

int main(void) {
    g_user_coretype = getenv("OPENBLAS_CORETYPE") != NULL;
    if (!g_user_coretype)
        probe_openblas_core();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_alloc_counters),
        cmocka_unit_test(test_alloc_alignment),
        cmocka_unit_test(test_alloc_failure_injection),
        cmocka_unit_test(test_storage_and_tensor_lifetime),
        cmocka_unit_test(test_check_tensor),
        cmocka_unit_test(test_check_shape),
        cmocka_unit_test(test_broadcast_shape),
        cmocka_unit_test(test_views_and_contiguous),
        cmocka_unit_test(test_copy_all_dtype_pairs),
        cmocka_unit_test(test_copy_bf16_rounding),
        cmocka_unit_test(test_copy_broadcast_strided),
        cmocka_unit_test(test_rng),
        cmocka_unit_test(test_parallel_for_coverage),
        cmocka_unit_test(test_parallel_for_concurrent_callers),
        cmocka_unit_test(test_gemm),
        cmocka_unit_test(test_blas_info),
        cmocka_unit_test(test_blas_coretype_table),
        cmocka_unit_test(test_blas_coretype_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
