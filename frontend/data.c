// SPDX-License-Identifier: MIT
/*
 * data.c - datasets in memory: the IDX reader (MNIST, Fashion-MNIST) and a
 * batch iterator with shuffling.
 *
 * gj_idx_load trusts nothing in the file: the magic's type code and rank,
 * every dimension (positive, product bounded, no overflow) and the exact
 * data length (a truncated file or trailing bytes are errors). gzip or
 * plain files alike (zlib reads both).
 *
 * gj_batches: an epoch is a permutation of [0, n) (Fisher-Yates with
 * splitmix64 from the seed and the epoch number, so a run is reproducible
 * and each epoch differs); batch b gathers rows perm[b*B .. b*B+B) of every
 * tensor. Without drop_last the last batch is shorter. The iterator holds
 * a reference to each tensor.
 */
#include "fe.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <zlib.h>

/* ------------------------------------------------------------------ IDX */

#define IDX_MAX_BYTES ((int64_t)1 << 34) /* 16 GiB of payload: surely a damaged header */

static int gz_exact(gzFile g, void *buf, size_t len) {
    uint8_t *p = buf;
    while (len > 0) {
        unsigned chunk = len > (1u << 30) ? (1u << 30) : (unsigned)len;
        int got = gzread(g, p, chunk);
        if (got <= 0) return -1;
        p += got;
        len -= (size_t)got;
    }
    return 0;
}

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Element i of raw big-endian IDX data of type code tc, as double. */
static double idx_value(const uint8_t *raw, int tc, int64_t i) {
    const uint8_t *p;
    switch (tc) {
    case 0x08: return raw[i];
    case 0x09: return (int8_t)raw[i];
    case 0x0B:
        p = raw + 2 * i;
        return (int16_t)(uint16_t)(p[0] << 8 | p[1]);
    case 0x0C: return (int32_t)be32(raw + 4 * i);
    case 0x0D: {
        uint32_t u = be32(raw + 4 * i);
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    default: { /* 0x0E */
        p = raw + 8 * i;
        uint64_t u = (uint64_t)be32(p) << 32 | be32(p + 4);
        double d;
        memcpy(&d, &u, 8);
        return d;
    }
    }
}

static int idx_type_size(int tc) {
    switch (tc) {
    case 0x08: case 0x09: return 1;
    case 0x0B: return 2;
    case 0x0C: case 0x0D: return 4;
    case 0x0E: return 8;
    }
    return 0;
}

gj_tensor *gj_idx_load(const char *path, gj_dtype dtype, double scale) {
    if (!path) {
        gj_rt_set_error("gj_idx_load: path is NULL");
        return gj_fe_fail();
    }
    if (dtype != GJ_F32 && dtype != GJ_F64 && dtype != GJ_BF16 && dtype != GJ_I64) {
        gj_rt_set_error("gj_idx_load(%s): unknown dtype %d", path, (int)dtype);
        return gj_fe_fail();
    }
    if (dtype == GJ_I64 ? scale != 1.0 : !isfinite(scale)) {
        gj_rt_set_error("gj_idx_load(%s): scale %g: i64 values are read as they are (scale 1), "
                        "float values need a finite scale", path, scale);
        return gj_fe_fail();
    }
    gzFile g = gzopen(path, "rb");
    if (!g) {
        gj_rt_set_error("gj_idx_load: cannot open %s: %s", path,
                        errno ? strerror(errno) : "out of memory");
        return gj_fe_fail();
    }
    gj_tensor *out = NULL;
    uint8_t *raw = NULL;
    void *vals = NULL;
    uint8_t hdr[4 + 4 * GJ_MAX_DIMS];
    if (gz_exact(g, hdr, 4) != 0) {
        gj_rt_set_error("gj_idx_load(%s): shorter than the 4-byte IDX magic", path);
        goto done;
    }
    int tc = hdr[2], nd = hdr[3];
    if (hdr[0] != 0 || hdr[1] != 0 || idx_type_size(tc) == 0 || nd < 1 || nd > GJ_MAX_DIMS) {
        gj_rt_set_error("gj_idx_load(%s): not an IDX file: magic %02x %02x %02x %02x (expected "
                        "00 00, a type code 08/09/0B/0C/0D/0E and 1..%d dimensions)",
                        path, hdr[0], hdr[1], hdr[2], hdr[3], GJ_MAX_DIMS);
        goto done;
    }
    if (gz_exact(g, hdr + 4, 4 * (size_t)nd) != 0) {
        gj_rt_set_error("gj_idx_load(%s): truncated header (%d dimensions)", path, nd);
        goto done;
    }
    int64_t shape[GJ_MAX_DIMS], n = 1;
    for (int d = 0; d < nd; d++) {
        shape[d] = be32(hdr + 4 + 4 * d);
        if (shape[d] > IDX_MAX_BYTES || (shape[d] && n > IDX_MAX_BYTES / shape[d])) {
            gj_rt_set_error("gj_idx_load(%s): dimension %d of %lld makes the data larger than "
                            "16 GiB", path, d, (long long)shape[d]);
            goto done;
        }
        n *= shape[d];
    }
    int es = idx_type_size(tc);
    if (n * es > IDX_MAX_BYTES) {
        gj_rt_set_error("gj_idx_load(%s): %lld elements of %d bytes exceed 16 GiB", path,
                        (long long)n, es);
        goto done;
    }
    raw = gj_rt_malloc((size_t)(n * es) + 1);
    if (!raw) goto done;
    if (gz_exact(g, raw, (size_t)(n * es)) != 0) {
        gj_rt_set_error("gj_idx_load(%s): truncated data: the header announces %lld elements "
                        "(%lld bytes)", path, (long long)n, (long long)(n * es));
        goto done;
    }
    uint8_t extra;
    if (gzread(g, &extra, 1) != 0) {
        gj_rt_set_error("gj_idx_load(%s): bytes after the %lld announced elements", path,
                        (long long)n);
        goto done;
    }
    if (dtype == GJ_I64) {
        int64_t *v = gj_rt_malloc((size_t)(n ? n : 1) * sizeof *v);
        vals = v;
        if (!v) goto done;
        for (int64_t i = 0; i < n; i++) {
            double x = idx_value(raw, tc, i);
            if (x != floor(x) || !(fabs(x) < 9.2e18)) {
                gj_rt_set_error("gj_idx_load(%s): element %lld (%g) is not an integer, cannot "
                                "be read as i64", path, (long long)i, x);
                goto done;
            }
            v[i] = (int64_t)x;
        }
        out = gj_from_data(GJ_I64, nd, shape, v);
    } else {
        double *v = gj_rt_malloc((size_t)(n ? n : 1) * sizeof *v);
        vals = v;
        if (!v) goto done;
        for (int64_t i = 0; i < n; i++) v[i] = idx_value(raw, tc, i) * scale;
        gj_tensor *t64 = gj_from_data(GJ_F64, nd, shape, v);
        if (t64 && dtype != GJ_F64) {
            out = gj_cast(t64, dtype);
            gj_release(t64);
        } else {
            out = t64;
        }
    }
done:
    gzclose(g);
    gj_rt_free(raw);
    gj_rt_free(vals);
    if (!out) gj_rt_null_result();
    return out;
}

/* -------------------------------------------------------------- batches */

#define GJ_BATCHES_MAX 8

struct gj_batches {
    int n_tensors;
    gj_tensor *t[GJ_BATCHES_MAX]; /* retained, contiguous */
    int64_t n, batch, next, epoch;
    int64_t *perm;
    bool shuffle, drop_last;
    uint64_t seed;
};

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void batches_order(gj_batches *it) {
    for (int64_t i = 0; i < it->n; i++) it->perm[i] = i;
    if (!it->shuffle) return;
    uint64_t s = it->seed ^ (0xd1b54a32d192ed03ull * (uint64_t)(it->epoch + 1));
    for (int64_t i = it->n - 1; i > 0; i--) {
        int64_t j = (int64_t)(splitmix64(&s) % (uint64_t)(i + 1));
        int64_t x = it->perm[i];
        it->perm[i] = it->perm[j];
        it->perm[j] = x;
    }
}

gj_batches *gj_batches_new(int n_tensors, gj_tensor *const *tensors, int64_t batch,
                           bool shuffle, bool drop_last, uint64_t seed) {
    if (n_tensors < 1 || n_tensors > GJ_BATCHES_MAX || !tensors) {
        gj_rt_set_error("gj_batches_new: 1..%d tensors, got %d", GJ_BATCHES_MAX, n_tensors);
        return NULL;
    }
    int64_t n = -1;
    for (int k = 0; k < n_tensors; k++) {
        if (!gj_rt_check_tensor(tensors[k], "gj_batches_new", "tensors[k]")) return NULL;
        if (tensors[k]->ndim < 1) {
            gj_rt_set_error("gj_batches_new: tensor %d is 0-d; batches are cut along dim 0", k);
            return NULL;
        }
        if (n >= 0 && tensors[k]->shape[0] != n) {
            gj_rt_set_error("gj_batches_new: tensor %d has %lld rows, tensor 0 has %lld", k,
                            (long long)tensors[k]->shape[0], (long long)n);
            return NULL;
        }
        n = tensors[k]->shape[0];
    }
    if (batch < 1) {
        gj_rt_set_error("gj_batches_new: batch size %lld, must be >= 1", (long long)batch);
        return NULL;
    }
    gj_batches *it = gj_rt_calloc(1, sizeof *it);
    if (!it) return NULL;
    it->perm = gj_rt_malloc((size_t)(n ? n : 1) * sizeof *it->perm);
    if (!it->perm) {
        gj_rt_free(it);
        return NULL;
    }
    it->n_tensors = n_tensors;
    it->n = n;
    it->batch = batch;
    it->shuffle = shuffle;
    it->drop_last = drop_last;
    it->seed = seed;
    for (int k = 0; k < n_tensors; k++) {
        it->t[k] = gj_rt_contiguous(tensors[k]); /* a new reference (t itself if contiguous) */
        if (!it->t[k]) {
            gj_batches_free(it);
            return NULL;
        }
    }
    batches_order(it);
    return it;
}

int64_t gj_batches_len(const gj_batches *it) {
    if (!it) return -1;
    return it->drop_last ? it->n / it->batch : (it->n + it->batch - 1) / it->batch;
}

bool gj_batches_next(gj_batches *it, gj_tensor **out) {
    GJ_FE_TRACE_UNTRACEABLE("gj_batches_next");
    if (!it || !out) {
        gj_rt_set_error("gj_batches_next: %s is NULL", !it ? "iterator" : "out");
        return false;
    }
    gj_clear_error();
    int64_t left = it->n - it->next, rows = left < it->batch ? left : it->batch;
    if (rows <= 0 || (it->drop_last && rows < it->batch)) return false;
    for (int k = 0; k < it->n_tensors; k++) out[k] = NULL;
    for (int k = 0; k < it->n_tensors; k++) {
        gj_tensor *src = it->t[k];
        int64_t shape[GJ_MAX_DIMS];
        memcpy(shape, src->shape, (size_t)src->ndim * sizeof shape[0]);
        size_t row = gj_rt_dtype_size(src->dtype);
        for (int d = 1; d < src->ndim; d++) row *= (size_t)shape[d];
        shape[0] = rows;
        gj_tensor *b = gj_rt_tensor_empty(src->dtype, src->ndim, shape);
        if (!b) goto fail;
        const char *from = gj_rt_data_ptr(src);
        char *to = gj_rt_data_ptr(b);
        for (int64_t r = 0; r < rows; r++)
            memcpy(to + (size_t)r * row, from + (size_t)it->perm[it->next + r] * row, row);
        out[k] = gj_fe_own(b);
    }
    it->next += rows;
    return true;
fail:
    for (int k = 0; k < it->n_tensors; k++) {
        gj_release(out[k]);
        out[k] = NULL;
    }
    gj_rt_null_result(); /* a NULL batch passed on cites this failure */
    return false;
}

void gj_batches_reset(gj_batches *it) {
    if (!it) return;
    it->epoch++;
    it->next = 0;
    batches_order(it);
}

void gj_batches_free(gj_batches *it) {
    if (!it) return;
    for (int k = 0; k < it->n_tensors; k++)
        if (it->t[k]) gj_rt_tensor_release(it->t[k]);
    gj_rt_free(it->perm);
    gj_rt_free(it);
}
