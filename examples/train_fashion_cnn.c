// SPDX-License-Identifier: MIT
/*
 * train_fashion_cnn.c - trains a small CNN classifier on Fashion-MNIST with
 * gradjit (gj_conv2d, gj_max_pool2d), eagerly, with compiled autograd
 * (--compiled-autograd) or with the compiled training step
 * (--compiled-step), or eager and compiled from the same seed for a
 * side-by-side comparison (--both; --both --compiled-step). Data loading,
 * the step (fashion_data.h's fashion_loss of this file's model_forward, run
 * by examples/common.h's stepper), output and the --both pairing are
 * examples/fashion_data.h's and examples/trainer.h's, shared with
 * train_fashion_mnist.c (the MLP example); this file holds the model, its
 * flags and its target.
 *
 *   train_fashion_cnn [--compiled-autograd | --compiled-step] [--both]
 *                     [--epochs N] [--batch N]
 *                     [--lr X] [--seed N] [--threads N] [--channels C1,C2]
 *                     [--limit N] [--cosine] [--quiet] [--csv FILE] [--png FILE]
 *
 * Output: a progress bar (on a terminal) with loss, examples/s and backward
 * ms (whole step ms in gj_step's modes); a line per epoch with test
 * accuracy; the loss curve of every step as
 * CSV (--csv, default fashion_cnn_loss.csv; "-" for none) and as a PNG
 * plot (--png, default fashion_cnn_loss.png; "-" for none) with the loss
 * curve(s) and the test accuracy per epoch (examples/plot.h).
 *
 * Data: Debian's dataset-fashion-mnist package, /usr/share/datasets/
 * fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (IDX files,
 * big-endian header, read through zlib). Magic numbers, dimensions and label
 * range are checked; a missing file exits with code 2 and names the package.
 * Pixels are scaled to [0,1] and standardised with the dataset's mean/std
 * (0.2860 / 0.3530).
 *
 * Model (the two-conv baseline of the dataset's benchmark page), NCHW:
 *   x [n, 1, 28, 28] -> conv 1->C1 5x5 pad 2 -> ReLU -> max-pool 2  [n, C1, 14, 14]
 *                    -> conv C1->C2 5x5 pad 2 -> ReLU -> max-pool 2 [n, C2, 7, 7]
 *                    -> flatten -> linear C2*49 -> 10,
 * C1, C2 = 32, 64 by default (--channels), weights and biases uniform in
 * +-1/sqrt(fan_in) as torch.nn.Conv2d/Linear; cross-entropy, AdamW (betas
 * 0.9/0.999, eps 1e-8, weight decay 0.01). Target: test accuracy >= 0.91
 * within 5 epochs. --limit N trains on the first N examples of each epoch's
 * order only (a quick look; the full set by default); --cosine decays the
 * learning rate from --lr to 0 along a cosine over the run (gj_lr_cosine;
 * the compiled step reads the learning rate at every run). Every epoch visits the
 * training set in a fresh shuffled order (splitmix64 from --seed) in full
 * batches only (the remainder of 60000 / batch is skipped that epoch, so every
 * step has one shape), and ends with test accuracy (no-grad forward, argmax).
 *
 * Invariants: every training step and every evaluation chunk runs inside
 * gj_scope_push/pop; the model, the optimizer and the data are released
 * before exit. With --both the two runs start from the same seed (model and
 * shuffle generator) and advance in turn, one step each, in ABBA order, so
 * that their timings share the machine's state and its drift; their loss
 * curves must be identical (printed: "identical", or the first step that
 * differs) and each epoch prints the median paired ratio of the backward
 * (with compiled autograd) or of the whole step (--compiled-step). Without
 * a terminal, progress is printed at every tenth of an epoch.
 */
#include "gradjit.h"
#include "args.h"
#include "common.h"
#include "fashion_data.h"
#include "trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PROG "train_fashion_cnn"
#define TARGET_ACC 0.91
#define TARGET_EPOCHS 5
#define EVAL_CHUNK 200 /* images per no-grad forward (conv columns are 25x the activations) */

enum { ROWS = 28, COLS = 28, IN = ROWS * COLS, K = 10, KS = 5 };

/* --------------------------------------------------------------- model */

typedef struct model {
    int64_t c1, c2;
    gj_tensor *w1, *b1; /* [c1, 1, 5, 5], [c1] */
    gj_tensor *w2, *b2; /* [c2, c1, 5, 5], [c2] */
    gj_linear_layer fc; /* c2*7*7 -> 10 */
} model;

/* A new leaf that requires grad, uniform in +-bound (torch's default init
 * for conv weights and biases: bound = 1/sqrt(fan_in)). */
static gj_tensor *param(int ndim, const int64_t *shape, double bound) {
    gj_tensor *t = gj_rand(GJ_F32, ndim, shape, -bound, bound);
    if (t && gj_set_requires_grad(t, true) != 0) {
        gj_release(t);
        return NULL;
    }
    return t;
}

static int model_init(model *m, int64_t c1, int64_t c2) {
    memset(m, 0, sizeof *m);
    m->c1 = c1;
    m->c2 = c2;
    double bd1 = 1.0 / sqrt((double)(1 * KS * KS)), bd2 = 1.0 / sqrt((double)(c1 * KS * KS));
    m->w1 = param(4, (int64_t[]){c1, 1, KS, KS}, bd1);
    m->b1 = param(1, &c1, bd1);
    m->w2 = param(4, (int64_t[]){c2, c1, KS, KS}, bd2);
    m->b2 = param(1, &c2, bd2);
    if (!m->w1 || !m->b1 || !m->w2 || !m->b2)
        return -1;
    return gj_linear_init(&m->fc, c2 * 7 * 7, K, true, GJ_F32);
}

static void model_free(model *m) {
    gj_release(m->w1);
    gj_release(m->b1);
    gj_release(m->w2);
    gj_release(m->b2);
    gj_linear_free(&m->fc);
    m->w1 = m->b1 = m->w2 = m->b2 = NULL;
}

/* The model's parameters in a fixed order; returns their count (6). */
static int model_params(model *m, gj_tensor **p) {
    p[0] = m->w1, p[1] = m->b1, p[2] = m->w2, p[3] = m->b2;
    p[4] = m->fc.weight, p[5] = m->fc.bias;
    return 6;
}

/* logits [n, 10] of x [n, 784] of the model ctx; scope-owned new
 * reference or NULL. */
static gj_tensor *model_forward(void *ctx, gj_tensor *x) {
    model *m = ctx;
    int64_t n = gj_tensor_shape(x)[0];
    gj_tensor *h = gj_reshape(x, 4, (int64_t[]){n, 1, ROWS, COLS});
    h = h ? gj_conv2d(h, m->w1, m->b1, 1, 2, 1, 1) : NULL; /* [n, c1, 28, 28] */
    h = h ? gj_relu(h) : NULL;
    h = h ? gj_max_pool2d(h, 2, 2, 0) : NULL;              /* [n, c1, 14, 14] */
    h = h ? gj_conv2d(h, m->w2, m->b2, 1, 2, 1, 1) : NULL; /* [n, c2, 14, 14] */
    h = h ? gj_relu(h) : NULL;
    h = h ? gj_max_pool2d(h, 2, 2, 0) : NULL;              /* [n, c2, 7, 7] */
    h = h ? gj_reshape(h, 2, (int64_t[]){n, m->c2 * 49}) : NULL;
    return h ? gj_linear_forward(&m->fc, h) : NULL;        /* [n, 10] */
}

/* ------------------------------------------------------------ training */

typedef struct opts {
    train_flags f;
    bool cosine;
    int64_t c1, c2, limit;
} opts;

/* One training run (trainer.h, fashion_data.h): the classifier's run and
 * the model. --both keeps two. */
typedef struct cnn_run {
    fashion_run fr;
    model m;
} cnn_run;

/* The run's model from the seed, its AdamW and the classifier's part (the
 * step: fashion_loss of model_forward): train_def's init. */
static int cnn_init(train_run *r) {
    cnn_run *t = (cnn_run *)r;
    const opts *o = r->def->opts;
    gj_tensor *params[6];
    if (model_init(&t->m, o->c1, o->c2) != 0)
        return -1;
    int np = model_params(&t->m, params);
    if (!(r->opt = gj_adamw_new(np, params, o->f.lr, 0.9, 0.999, 1e-8, 0.01)))
        return -1;
    return fashion_run_init(&t->fr, 0, 1, EVAL_CHUNK, model_forward, &t->m);
}

static void cnn_free(train_run *r) {
    cnn_run *t = (cnn_run *)r;
    model_free(&t->m);
    fashion_run_free(&t->fr);
}

/* --cosine: from --lr to 0 over the whole run, no warm-up. */
static double cnn_lr(const train_run *r, int64_t s) {
    const train_def *d = r->def;
    return gj_lr_cosine(d->f->lr, s, 0, d->per_epoch * (int64_t)d->epochs, 0.0);
}

/* ---------------------------------------------------------------- main */

/* The options (examples/args.h). 0, 1 (--help/--version printed) or -1. */
static int parse_opts(int argc, char **argv, opts *o) {
    *o = (opts){.f = {.epochs = TARGET_EPOCHS,
                      .batch = 128,
                      .lr = 1e-3,
                      .seed = 42,
                      .csv = "fashion_cnn_loss.csv",
                      .png = "fashion_cnn_loss.png"},
                .c1 = 32,
                .c2 = 64};
    train_flags *f = &o->f;
    const char *channels = "32,64";
    const arg_spec specs[] = {
        TRAIN_ARG_COMPILED(f),
        TRAIN_ARG_BF16(f),
        ARG_OPT("both", ARG_FLAG, &f->both, 0, 0,
                "train eager and compiled side by side (steps in turn, ABBA), paired ratios: "
                "compiled autograd's backward, or with --compiled-step the whole step"),
        FASHION_ARGS(f),
        ARG_OPT("channels", ARG_STR, &channels, 0, 0, "channels of the two conv layers, C1,C2"),
        ARG_OPT("limit", ARG_I64, &o->limit, 1, 60000,
                "train on N examples per epoch (0: all 60000)"),
        ARG_OPT("cosine", ARG_FLAG, &o->cosine, 0, 0,
                "cosine learning-rate decay from --lr to 0 over the run"),
        TRAIN_ARG_QUIET(f),
        TRAIN_ARG_CSV(f),
        ARG_OPT("png", ARG_FILE, &f->png, 0, 0, "loss curve and accuracy as PNG (\"-\": none)"),
    };
    int rc = args_parse(PROG,
                        "Trains a two-conv CNN on Fashion-MNIST (Debian's dataset-fashion-mnist), "
                        "eager, with compiled autograd or with the compiled step.",
                        argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (rc != 0) return rc;
    long long c1, c2;
    int used = 0;
    if (sscanf(channels, "%lld,%lld%n", &c1, &c2, &used) != 2 || channels[used] || c1 < 1 ||
        c2 < 1 || c1 > 4096 || c2 > 4096) {
        fprintf(stderr, PROG ": --channels: '%s' is not C1,C2 with both in [1, 4096]\n",
                channels);
        return -1;
    }
    o->c1 = c1;
    o->c2 = c2;
    return train_flags_check(PROG, f);
}

/* Whether some epoch within the first TARGET_EPOCHS reached TARGET_ACC. */
static const char *target_met(const train_run *r) {
    const double *acc = ((const fashion_run *)r)->acc;
    int epochs = r->def->epochs;
    for (int e = 0; e < epochs && e < TARGET_EPOCHS; e++)
        if (acc[e] >= TARGET_ACC)
            return "met";
    return epochs >= TARGET_EPOCHS ? "NOT met" : "not reached yet";
}

/* The results (train_def's report): the counters or the --both table, the
 * final accuracy and whether the target was met, the files. */
static int cnn_report(const train_run *a, const train_run *c, double (*q)[3], double (*fq)[3]) {
    int last = a->def->epochs - 1;
    fashion_results(a, c, q);
    if (!c)
        printf("final test accuracy %.4f after %d epoch(s) (target %.2f within %d epochs: %s)\n",
               ((const fashion_run *)a)->acc[last], last + 1, TARGET_ACC, TARGET_EPOCHS,
               target_met(a));
    else
        printf("final test accuracy after %d epoch(s): eager %.4f, %s %.4f (target %.2f within "
               "%d epochs: eager %s, %s %s)\n",
               last + 1, ((const fashion_run *)a)->acc[last], c->tag,
               ((const fashion_run *)c)->acc[last], TARGET_ACC, TARGET_EPOCHS, target_met(a),
               c->tag, target_met(c));
    return fashion_write(a, c, "CNN");
}

int main(int argc, char **argv) {
    opts o;
    step_mode mode;
    int rc = train_start(parse_opts(argc, argv, &o), &o.f, &mode);
    if (rc >= 0) return rc;
    fashion_splits data = {0};
    rc = fashion_load(PROG, o.f.batch, &data);
    if (rc != 0)
        return rc;
    int64_t n = o.limit > 0 && o.limit < data.train.n ? o.limit : data.train.n;

    if (train_banner(&o.f))
        printf("Fashion-MNIST %lld train / %lld test | CNN conv5x5 1-%lld, pool, conv5x5 "
               "%lld-%lld, pool, linear %lld-%d (ReLU), AdamW lr %g%s, batch %d, %d epochs, "
               "seed %llu\n",
               (long long)data.train.n, (long long)data.test.n, (long long)o.c1,
               (long long)o.c1, (long long)o.c2, (long long)(o.c2 * 49), K, o.f.lr,
               o.cosine ? " cosine" : "", o.f.batch, o.f.epochs, (unsigned long long)o.f.seed);

    train_def d = fashion_def(PROG, &o.f, &o, &data, sizeof(cnn_run), n / o.f.batch, cnn_init,
                              cnn_free);
    if (o.cosine) /* the compiled step reads the learning rate at every run */
        d.lr_at = cnn_lr;
    d.report = cnn_report;
    rc = train_main(&d, mode);
    fashion_free(&data);
    return rc;
}
