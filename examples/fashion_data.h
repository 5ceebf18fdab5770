/* SPDX-License-Identifier: MIT */
/*
 * fashion_data.h - the Fashion-MNIST splits for the example trainers, read
 * with the library's IDX reader (gj_idx_load) from the gzip files Debian's
 * dataset-fashion-mnist package installs. Header-only (static functions);
 * not part of the library.
 *
 * A dataset keeps the raw bytes: images [n, 28, 28] as uint8, labels [n]
 * as uint8 in 0..9; trainers standardise the pixels of each batch.
 */
#ifndef GJ_EXAMPLES_FASHION_DATA_H
#define GJ_EXAMPLES_FASHION_DATA_H

#include "gradjit.h"
#include "common.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"
#define FASHION_PACKAGE "dataset-fashion-mnist"

typedef struct dataset {
    uint8_t *images; /* [n, 784] */
    uint8_t *labels; /* [n], values 0..9 */
    int64_t n;
} dataset;

/* One IDX file of `want_ndim` dimensions as bytes (*out malloc'd, *n its
 * first dimension). 0, 2 if the file is missing (with the package hint), or
 * 1 (message on stderr) if it is damaged or of another shape. */
static int fashion_load_idx(const char *prog, const char *path, int want_ndim, uint8_t **out,
                            int64_t *n) {
    *out = NULL;
    if (access(path, R_OK) != 0) {
        fprintf(stderr,
                "%s: cannot read %s (%s).\nThe Fashion-MNIST data comes from the Debian "
                "package \"%s\": apt install %s\n",
                prog, path, strerror(errno), FASHION_PACKAGE, FASHION_PACKAGE);
        return 2;
    }
    gj_tensor *t = gj_idx_load(path, GJ_F32, 1.0); /* bytes 0..255, exact in f32 */
    if (!t) {
        fprintf(stderr, "%s: %s\n", prog, gj_last_error());
        return 1;
    }
    const int64_t *s = gj_tensor_shape(t);
    int nd = gj_tensor_ndim(t);
    if (nd != want_ndim || (nd == 3 && (s[1] != 28 || s[2] != 28))) {
        fprintf(stderr, "%s: %s: %d dimensions%s, expected %s\n", prog, path, nd,
                nd == 3 ? " of other sizes" : "", want_ndim == 3 ? "[n, 28, 28]" : "[n]");
        gj_release(t);
        return 1;
    }
    int64_t total = gj_tensor_numel(t);
    *out = malloc((size_t)(total ? total : 1));
    if (!*out) {
        fprintf(stderr, "%s: out of memory reading %s\n", prog, path);
        gj_release(t);
        return 1;
    }
    const float *v = gj_tensor_data(t);
    for (int64_t i = 0; i < total; i++) (*out)[i] = (uint8_t)v[i];
    *n = s[0];
    gj_release(t);
    return 0;
}

/* Loads split ("train" or "t10k") with expected_n items; 0, 1 or 2 as
 * fashion_load_idx. */
static int load_split(const char *prog, const char *split, int64_t expected_n, dataset *d) {
    char ip[512], lp[512];
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", FASHION_DIR, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", FASHION_DIR, split);
    int64_t ni = 0, nl = 0;
    *d = (dataset){0};
    int rc = fashion_load_idx(prog, ip, 3, &d->images, &ni);
    if (rc == 0) rc = fashion_load_idx(prog, lp, 1, &d->labels, &nl);
    if (rc == 0 && (ni != expected_n || nl != expected_n)) {
        fprintf(stderr, "%s: %s: %lld images and %lld labels, expected %lld\n", prog, split,
                (long long)ni, (long long)nl, (long long)expected_n);
        rc = 1;
    }
    for (int64_t i = 0; rc == 0 && i < nl; i++)
        if (d->labels[i] >= 10) {
            fprintf(stderr, "%s: %s: label %u at %lld out of range\n", prog, split,
                    d->labels[i], (long long)i);
            rc = 1;
        }
    d->n = ni;
    return rc;
}

/* The dataset's pixel mean and standard deviation (of the [0, 1] scale). */
#define PIX_MEAN 0.2860f
#define PIX_STD 0.3530f
enum { FASHION_PIXELS = 28 * 28 };

/* Standardised pixels of rows idx[first..first+n) (or rows first..first+n
 * if idx is NULL) into x [n, 784] and their labels into y [n]. */
static void gather(const dataset *d, const int64_t *idx, int64_t first, int64_t n, float *x,
                   int64_t *y) {
    const float scale = 1.0f / (255.0f * PIX_STD), shift = PIX_MEAN / PIX_STD;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = idx ? idx[first + i] : first + i;
        const uint8_t *p = d->images + r * FASHION_PIXELS;
        for (int j = 0; j < FASHION_PIXELS; j++)
            x[i * FASHION_PIXELS + j] = (float)p[j] * scale - shift;
        y[i] = d->labels[r];
    }
}

/* Fisher-Yates shuffle of v[0..n) drawing from *state (splitmix64). */
static void shuffle(int64_t *v, int64_t n, uint64_t *state) {
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(splitmix64(state) % (uint64_t)(i + 1));
        int64_t t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

static void dataset_free(dataset *d) {
    free(d->images);
    free(d->labels);
    *d = (dataset){0};
}

#endif /* GJ_EXAMPLES_FASHION_DATA_H */
