/* SPDX-License-Identifier: MIT */
/*
 * fashion_data.h - Fashion-MNIST for the two classifier trainers
 * (train_fashion_mnist, train_fashion_cnn): the splits, read with the
 * library's IDX reader (gj_idx_load) from the gzip files Debian's
 * dataset-fashion-mnist package installs, and a classifier's training run
 * on them as trainer.h's hooks (fashion_run: shuffled batches, the test
 * accuracy after every epoch, the epoch lines, the --both table, the CSV
 * and the PNG). The trainer brings its model. Header-only (static
 * functions); not part of the library.
 *
 * A dataset keeps the raw bytes: images [n, 28, 28] as uint8, labels [n]
 * as uint8 in 0..9; trainers standardise the pixels of each batch.
 */
#ifndef GJ_EXAMPLES_FASHION_DATA_H
#define GJ_EXAMPLES_FASHION_DATA_H

#include "gradjit.h"
#include "common.h"
#include "plot.h"
#include "trainer.h"

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

/* Rows of args.h's table for the flags both trainers take alike, in this
 * order: --epochs, --batch, --lr, --seed, --threads (f their train_flags). */
#define FASHION_ARGS(f)                                                                        \
    ARG_OPT("epochs", ARG_INT, &(f)->epochs, 1, 1000, "epochs"),                               \
    ARG_OPT("batch", ARG_INT, &(f)->batch, 1, 60000, "examples per batch"),                    \
    TRAIN_ARG_LR(f),                                                                           \
    ARG_OPT("seed", ARG_U64, &(f)->seed, 0, 0, "seed of the weights and the shuffle"),         \
    TRAIN_ARG_THREADS(f)

/* The training split and the test split. */
typedef struct fashion_splits {
    dataset train, test;
} fashion_splits;

/* Frees both splits' bytes (d zeroed: may be freed again). */
static inline void fashion_free(fashion_splits *d) {
    dataset_free(&d->train);
    dataset_free(&d->test);
}

/* Loads both splits into *d (owned by the caller: fashion_free) and checks
 * that a batch of `batch` examples fits the training split. 0; 2 if a file
 * is missing or the batch too large, 1 if a file is damaged (with a
 * message starting with prog); on failure d holds nothing. */
static inline int fashion_load(const char *prog, int batch, fashion_splits *d) {
    int rc = load_split(prog, "train", 60000, &d->train);
    if (rc == 0)
        rc = load_split(prog, "t10k", 10000, &d->test);
    if (rc == 0 && batch > d->train.n) {
        fprintf(stderr, "%s: --batch %d exceeds the %lld training examples\n", prog, batch,
                (long long)d->train.n);
        rc = 2;
    }
    if (rc != 0)
        fashion_free(d);
    return rc;
}

/* ------------------------------------------------- a classifier's run */

/* A classifier's training run on the splits (trainer.h's run, its def's
 * data a fashion_splits): every epoch visits the training split in a fresh
 * shuffled order (splitmix64 from --seed) in full batches only (the
 * remainder is skipped, so every step has one shape) and ends with the
 * test accuracy (no-grad forward in chunks, argmax). The trainer's run
 * struct begins with one; its init hook makes the model and calls
 * fashion_run_init. */
typedef struct fashion_run {
    train_run run;
    int64_t *order;        /* [train n] example indices, this epoch's order */
    float *xb;             /* [batch, 784] a batch's standardised images */
    int64_t *yb;           /* [batch] its labels */
    int64_t shard, offset; /* examples of each batch this run takes, from `offset` on */
    double *acc;           /* [epochs] test accuracy after each epoch */
    /* logits [n, 10] of images [n, 784] (scope-owned new reference, or NULL
     * with gj_last_error() set), of model (borrowed) */
    gj_tensor *(*forward)(void *model, gj_tensor *x);
    void *model;
    int chunk; /* images per no-grad forward of the evaluation */
} fashion_run;

/* The splits a run of a fashion_def trains and tests on (borrowed). */
static inline const fashion_splits *fashion_data(const train_run *r) {
    return r->def->data;
}

/* The training step's forward (a gj_step_fn): ctx the fashion_run, in[0]
 * images [n, 784] f32, in[1] labels [n] i64 (borrowed). The mean
 * cross-entropy of the model's logits, a 0-d scope-owned new reference, or
 * NULL. */
static inline gj_tensor *fashion_loss(void *ctx, int n_in, gj_tensor *const *in) {
    const fashion_run *fr = ctx;
    (void)n_in;
    gj_tensor *logits = fr->forward(fr->model, in[0]);
    return logits ? gj_cross_entropy(logits, in[1]) : NULL;
}

/* The classifier's part of fr, made by the trainer's init hook once the
 * model (forward's, the step's and the evaluation's) and r->opt are: its
 * buffers, the order 0..n-1, the stepper (fashion_loss, in the run's mode,
 * on r->opt), the evaluation in chunks of `chunk` images. Of each batch it
 * takes the `size`-th share number `rank` (data parallel; 0 and 1: all).
 * Prints the steps per epoch. 0, -1 (gj_last_error()), or 1 after a
 * message. */
static inline int fashion_run_init(fashion_run *fr, int rank, int size, int chunk,
                                   gj_tensor *(*forward)(void *model, gj_tensor *x),
                                   void *model) {
    train_run *r = &fr->run;
    const train_def *d = r->def;
    int64_t n = fashion_data(r)->train.n, batch = d->f->batch;
    fr->shard = batch / size;
    fr->offset = rank * fr->shard;
    fr->forward = forward;
    fr->model = model;
    fr->chunk = chunk;
    fr->order = malloc((size_t)n * sizeof *fr->order);
    fr->xb = malloc((size_t)batch * FASHION_PIXELS * sizeof *fr->xb);
    fr->yb = malloc((size_t)batch * sizeof *fr->yb);
    fr->acc = calloc((size_t)d->epochs, sizeof *fr->acc);
    if (!fr->order || !fr->xb || !fr->yb || !fr->acc) {
        fprintf(stderr, "%s: out of memory\n", d->prog);
        return 1;
    }
    if (stepper_init(&r->st, r->mode, fashion_loss, fr, r->opt) != 0)
        return -1;
    for (int64_t i = 0; i < n; i++)
        fr->order[i] = i;
    if (!d->f->quiet)
        printf("[%s] %lld steps per epoch of %d examples\n", r->tag,
               (long long)d->per_epoch, d->f->batch);
    return 0;
}

/* Releases what fashion_run_init made (also half made). */
static inline void fashion_run_free(fashion_run *fr) {
    free(fr->order);
    free(fr->xb);
    free(fr->yb);
    free(fr->acc);
    fr->order = NULL;
    fr->xb = NULL;
    fr->yb = NULL;
    fr->acc = NULL;
}

/* Test accuracy in [0,1], or -1 on error (gj_last_error()). */
static inline double fashion_accuracy(const fashion_run *fr) {
    const dataset *test = &fashion_data(&fr->run)->test;
    int64_t chunk = fr->chunk;
    float *x = malloc((size_t)chunk * FASHION_PIXELS * sizeof *x);
    float *logits = malloc((size_t)chunk * 10 * sizeof *logits);
    int64_t *y = malloc((size_t)chunk * sizeof *y);
    int64_t correct = 0;
    double acc = -1.0;
    if (!x || !logits || !y)
        goto fail;
    gj_no_grad_push();
    for (int64_t first = 0; first < test->n; first += chunk) {
        int64_t n = test->n - first < chunk ? test->n - first : chunk;
        gather(test, NULL, first, n, x, y);
        gj_scope_push();
        int64_t xs[2] = {n, FASHION_PIXELS};
        gj_tensor *xt = gj_from_data(GJ_F32, 2, xs, x);
        gj_tensor *lt = xt ? fr->forward(fr->model, xt) : NULL;
        int ok = lt && gj_tensor_to_f32(lt, logits) == 0;
        gj_scope_pop();
        if (!ok) {
            gj_no_grad_pop();
            goto fail;
        }
        for (int64_t i = 0; i < n; i++) {
            int best = 0;
            for (int j = 1; j < 10; j++)
                if (logits[i * 10 + j] > logits[i * 10 + best])
                    best = j;
            correct += best == y[i];
        }
    }
    gj_no_grad_pop();
    acc = (double)correct / (double)test->n;
fail:
    free(x);
    free(logits);
    free(y);
    return acc;
}

/* The hooks of a fashion_run (train_def's; r is a fashion_run). */

/* A fresh order of the training split for the epoch (from r->rng). */
static inline int fashion_epoch_begin(train_run *r) {
    fashion_run *fr = (fashion_run *)r;
    shuffle(fr->order, fashion_data(r)->train.n, &r->rng);
    return 0;
}

/* This run's share of batch r->batch in this epoch's order: images [shard,
 * 784] f32 and labels [shard] i64. */
static inline int fashion_batch(train_run *r, gj_tensor **in) {
    fashion_run *fr = (fashion_run *)r;
    int64_t xs[2] = {fr->shard, FASHION_PIXELS}, ys = fr->shard;
    gather(&fashion_data(r)->train, fr->order, r->batch * r->def->f->batch + fr->offset,
           fr->shard, fr->xb, fr->yb);
    in[0] = gj_from_data(GJ_F32, 2, xs, fr->xb);
    in[1] = gj_from_data(GJ_I64, 1, &ys, fr->yb);
    return 0;
}

/* Epoch e's test accuracy into fr->acc[e]. 0 or -1 (gj_last_error()). */
static inline int fashion_epoch_end(train_run *r, int e) {
    fashion_run *fr = (fashion_run *)r;
    fr->acc[e] = fashion_accuracy(fr);
    return fr->acc[e] < 0 ? -1 : 0;
}

/* Epoch e's line: one run's loss, accuracy, speed and ms per step, or
 * --both's accuracies, ms per step and paired ratio [interquartile range]. */
static inline void fashion_epoch_report(const train_run *a, const train_run *c, int e,
                                        const double q[3]) {
    const train_def *d = a->def;
    const fashion_run *fa = (const fashion_run *)a, *fc = (const fashion_run *)c;
    bool split = step_mode_split(a->mode);
    progress_clear(d->f, 120);
    if (d->f->quiet)
        return;
    if (!c)
        printf("[%s] epoch %d/%d: train loss %.4f, test accuracy %.4f, %.1f s "
               "(%.0f examples/s), %s %.2f ms/step\n",
               a->tag, e + 1, d->epochs, a->train_loss[e], fa->acc[e], a->epoch_s[e],
               (double)(d->per_epoch * d->f->batch) / a->epoch_s[e], train_ms_what(a),
               split ? a->bwd_ms[e] : a->step_ms[e]);
    else
        printf("[both] epoch %d/%d: test accuracy %.4f / %.4f, %s %.2f / %.2f "
               "ms/step (eager / compiled), paired ratio %.3fx [%.2f-%.2f]\n",
               e + 1, d->epochs, fa->acc[e], fc->acc[e], train_ms_what(a),
               split ? a->bwd_ms[e] : a->step_ms[e], split ? c->bwd_ms[e] : c->step_ms[e],
               q[1], q[0], q[2]);
}

/* A train_def for a classifier on the splits d (borrowed) with the trainer's
 * options, run struct (size bytes, a fashion_run first) and model hooks;
 * per_epoch steps per epoch. The trainer may add lr_at, save, resume. */
static inline train_def fashion_def(const char *prog, const train_flags *f, const void *opts,
                                    const fashion_splits *d, size_t size, int64_t per_epoch,
                                    int (*init)(train_run *), void (*free_)(train_run *)) {
    return (train_def){.prog = prog, .f = f, .opts = opts, .data = d, .size = size,
                       .epochs = f->epochs, .per_epoch = per_epoch, .by_epoch = true,
                       .every = 10, .init = init, .free = free_,
                       .epoch_begin = fashion_epoch_begin, .batch = fashion_batch,
                       .epoch_end = fashion_epoch_end, .epoch_report = fashion_epoch_report};
}

/* --both's table: per epoch the accuracies, ms per step and seconds of
 * both runs and the paired ratio [interquartile range] (q from
 * train_run_both), then the compiled run's counters and whether the loss
 * curves are identical. */
static inline void fashion_both_table(const train_run *a, const train_run *c,
                                      double (*q)[3]) {
    const fashion_run *fa = (const fashion_run *)a, *fc = (const fashion_run *)c;
    bool cs = c->mode == STEP_COMPILED;
    if (cs)
        printf("\nsteps interleaved ABBA (eager, compiled, compiled, eager, ...); ratio = eager / "
               "compiled step time (forward, backward and AdamW update) per step pair, median "
               "[interquartile range]\n");
    else
        printf("\nsteps interleaved ABBA (eager, compiled, compiled, eager, ...); ratio = eager / "
               "compiled backward per step pair, median [interquartile range]\n");
    printf("%5s  %10s  %10s  %12s  %12s  %9s  %9s  %18s\n", "epoch", "acc eager", "acc compl",
           cs ? "step ms eagr" : "bwd ms eager", cs ? "step ms comp" : "bwd ms compl", "s eager",
           "s compl", cs ? "step ratio [IQR]" : "bwd ratio [IQR]");
    for (int e = 0; e < a->def->epochs; e++)
        printf("%5d  %10.4f  %10.4f  %12.3f  %12.3f  %9.1f  %9.1f  %7.3fx [%.2f-%.2f]\n", e + 1,
               fa->acc[e], fc->acc[e], cs ? a->step_ms[e] : a->bwd_ms[e],
               cs ? c->step_ms[e] : c->bwd_ms[e], a->epoch_s[e], c->epoch_s[e], q[e][1],
               q[e][0], q[e][2]);
    print_counters(c->mode, &c->ca, &c->cs);
    print_pair_curves(a, c);
}

/* The counters of one run a's compiled path (c NULL), or --both's table
 * (fashion_both_table); then the trainer prints its final lines. */
static inline void fashion_results(const train_run *a, const train_run *c, double (*q)[3]) {
    if (c)
        fashion_both_table(a, c, q);
    else
        print_counters(a->mode, &a->ca, &a->cs);
}

#define FASHION_SMOOTH 25 /* steps in the moving average of the plotted loss */

/* The loss curve(s) (moving average; the raw eager loss faint behind) and
 * the test accuracy per epoch as a PNG at path: one run a, or --both's a
 * and c; the title names the model. 0, or -1 after a message. */
static inline int fashion_png(const char *path, const train_run *a, const train_run *c,
                              const char *model) {
    const train_def *d = a->def;
    const fashion_run *fa = (const fashion_run *)a, *fc = (const fashion_run *)c;
    const char *na = c ? "eager" : a->tag, *nb = c ? c->tag : NULL;
    int64_t n = d->per_epoch * d->epochs;
    double *sa = malloc((size_t)n * sizeof *sa), *sb = c ? malloc((size_t)n * sizeof *sb) : NULL;
    double ep[1000], acc_a[1000], acc_b[1000];
    plot_img im = {0};
    int rc = -1;
    if (!sa || (c && !sb)) {
        fprintf(stderr, "%s: out of memory plotting\n", d->prog);
        goto done;
    }
    smooth(a->loss, n, FASHION_SMOOTH, sa);
    if (c)
        smooth(c->loss, n, FASHION_SMOOTH, sb);
    for (int e = 0; e < d->epochs; e++) {
        ep[e] = e + 1;
        acc_a[e] = fa->acc[e];
        acc_b[e] = c ? fc->acc[e] : NAN;
    }
    if (plot_img_init(&im, 1000, 900) != 0)
        goto done;
    plot_series loss[3] = {
        {NULL, NULL, a->loss, (int)n, 0xd9d9d9u, 1, 0},
        {na, NULL, sa, (int)n, c ? 0x9ecae1u : 0x08519cu, c ? 5 : 2, 0},
        {nb, NULL, sb, (int)n, 0x08519cu, 1, 0},
    };
    char title[160];
    snprintf(title, sizeof title, "Fashion-MNIST %s: training loss (%d-step moving average; "
             "raw in grey)", model, FASHION_SMOOTH);
    plot_line_panel(&im, 0, 10, 1000, 520, title, "step", "cross-entropy", loss, c ? 3 : 2, 0, 0);
    plot_series acc[2] = {
        {na, ep, acc_a, d->epochs, c ? 0x9ecae1u : 0x08519cu, c ? 7 : 3, 13},
        {nb, ep, acc_b, d->epochs, 0x08519cu, 2, 7},
    };
    snprintf(title, sizeof title, "test accuracy per epoch (batch %d, lr %g, seed %llu)",
             d->f->batch, d->f->lr, (unsigned long long)d->f->seed);
    plot_line_panel(&im, 0, 540, 1000, 360, title, "epoch", "accuracy", acc, c ? 2 : 1, 0, 0);
    rc = plot_write_png(&im, path);
done:
    plot_img_free(&im);
    free(sa);
    free(sb);
    return rc;
}

/* The files of a run (or --both's two): --csv, --png (the title naming the
 * model), then the "wrote" line. 0, or 1 after a message. */
static inline int fashion_write(const train_run *a, const train_run *c, const char *model) {
    const train_flags *f = a->def->f;
    if (f->csv && write_loss_csv(f->csv, a, c, NULL, NULL) != 0)
        return 1;
    if (f->png && fashion_png(f->png, a, c, model) != 0)
        return 1;
    print_wrote(f);
    return 0;
}

#endif /* GJ_EXAMPLES_FASHION_DATA_H */
