// SPDX-License-Identifier: MIT
/*
 * train_fashion_cnn.c - trains a small CNN classifier on Fashion-MNIST with
 * gradjit (gj_conv2d, gj_max_pool2d), eagerly, with compiled autograd
 * (--compiled-autograd) or with the compiled training step
 * (--compiled-step), or eager and compiled from the same seed for a
 * side-by-side comparison (--both; --both --compiled-step). Data loading,
 * flags, the step (one step function, cnn_loss, run by examples/common.h's
 * stepper), output and the --both pairing are those of
 * train_fashion_mnist.c (the MLP example).
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
#include "plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define TARGET_ACC 0.91
#define TARGET_EPOCHS 5
#define EVAL_CHUNK 200 /* images per no-grad forward (conv columns are 25x the activations) */
#define SMOOTH 25 /* steps in the moving average of the plotted loss */

enum { ROWS = 28, COLS = 28, IN = ROWS * COLS, K = 10, KS = 5 };

/* ---------------------------------------------------------------- data */

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

/* logits [n, 10] of x [n, 784]; scope-owned new reference or NULL. */
static gj_tensor *model_forward(model *m, gj_tensor *x) {
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

/* The training step's forward (a gj_step_fn): ctx the model, in[0] images
 * [n, 784] f32, in[1] labels [n] i64 (borrowed). The mean cross-entropy, a
 * 0-d scope-owned new reference, or NULL. */
static gj_tensor *cnn_loss(void *ctx, int n_in, gj_tensor *const *in) {
    (void)n_in;
    gj_tensor *logits = model_forward(ctx, in[0]);
    return logits ? gj_cross_entropy(logits, in[1]) : NULL;
}

/* Test accuracy in [0,1], or -1 on error. No-grad forward in chunks. */
static double evaluate(model *m, const dataset *test) {
    float *x = malloc((size_t)EVAL_CHUNK * IN * sizeof *x);
    float *logits = malloc((size_t)EVAL_CHUNK * K * sizeof *logits);
    int64_t y[EVAL_CHUNK];
    int64_t correct = 0;
    double acc = -1.0;
    if (!x || !logits)
        goto fail;
    gj_no_grad_push();
    for (int64_t first = 0; first < test->n; first += EVAL_CHUNK) {
        int64_t n = test->n - first < EVAL_CHUNK ? test->n - first : EVAL_CHUNK;
        gather(test, NULL, first, n, x, y);
        gj_scope_push();
        int64_t xs[2] = {n, IN};
        gj_tensor *xt = gj_from_data(GJ_F32, 2, xs, x);
        gj_tensor *lt = xt ? model_forward(m, xt) : NULL;
        int ok = lt && gj_tensor_to_f32(lt, logits) == 0;
        gj_scope_pop();
        if (!ok) {
            gj_no_grad_pop();
            goto fail;
        }
        for (int64_t i = 0; i < n; i++) {
            int best = 0;
            for (int j = 1; j < K; j++)
                if (logits[i * K + j] > logits[i * K + best])
                    best = j;
            correct += best == y[i];
        }
    }
    gj_no_grad_pop();
    acc = (double)correct / (double)test->n;
fail:
    free(x);
    free(logits);
    return acc;
}

/* ------------------------------------------------------------ training */

typedef struct opts {
    bool compiled, compiled_step, both, quiet, tty, cosine;
    int epochs, batch, threads;
    int64_t c1, c2, limit;
    double lr;
    uint64_t seed;
    const char *csv, *png; /* NULL: not written */
} opts;

/* What one training run measured. */
typedef struct run_out {
    double *loss;        /* [n_steps] */
    int64_t n_steps;
    double *acc;         /* [epochs] test accuracy */
    double *epoch_s;     /* [epochs] wall time of the training part of the epoch */
    double *bwd_ms;      /* [epochs] mean backward ms (split modes; else NaN) */
    double *step_ms;     /* [epochs] mean ms of the whole step */
    double *train_loss;  /* [epochs] mean training loss */
    gj_ca_stats ca;      /* compiled autograd's counters (--compiled-autograd) */
    gj_ca_stats cs;      /* the compiled step's (--compiled-step) */
} run_out;

static void run_out_free(run_out *r) {
    free(r->loss);
    free(r->acc);
    free(r->epoch_s);
    free(r->bwd_ms);
    free(r->step_ms);
    free(r->train_loss);
    *r = (run_out){0};
}

/* One training run's state: the model, its optimizer, its shuffle and what
 * it measured so far. --both keeps two and steps them in turn. */
typedef struct trainer {
    const opts *o;
    step_mode mode;
    const char *tag;
    model m;
    gj_optim *opt;
    stepper st;     /* runs cnn_loss, backward and update in `mode` */
    int64_t *order; /* [n] shuffled example indices */
    float *xb;      /* [batch, IN] */
    int64_t *yb;    /* [batch] */
    uint64_t rng;
    int64_t per_epoch, step;
    double train_s, bwd_total, step_total, loss_total; /* this epoch */
    run_out *r;
} trainer;

static void trainer_free(trainer *t) {
    stepper_free(&t->st);
    gj_optim_free(t->opt);
    model_free(&t->m);
    free(t->order);
    free(t->xb);
    free(t->yb);
    t->opt = NULL;
    t->order = NULL;
    t->xb = NULL;
    t->yb = NULL;
}

/* The name of a mode in the trainers' output. */
static const char *mode_tag(step_mode m) {
    return m == STEP_COMPILED ? "compiled step" : m == STEP_SPLIT_CA ? "compiled" : "eager";
}

/* A fresh model from o->seed (so two trainers start bit-identical), its
 * AdamW, its stepper in `mode` and the run's buffers. 0, or 1 with a
 * message on stderr. */
static int trainer_init(trainer *t, const opts *o, step_mode mode, const dataset *tr, run_out *r) {
    memset(t, 0, sizeof *t);
    t->o = o;
    t->mode = mode;
    t->tag = mode_tag(mode);
    t->r = r;
    t->per_epoch = (o->limit > 0 && o->limit < tr->n ? o->limit : tr->n) / o->batch;
    t->rng = o->seed;
    t->order = malloc((size_t)tr->n * sizeof *t->order);
    t->xb = malloc((size_t)o->batch * IN * sizeof *t->xb);
    t->yb = malloc((size_t)o->batch * sizeof *t->yb);
    memset(r, 0, sizeof *r);
    r->n_steps = t->per_epoch * o->epochs;
    r->loss = calloc((size_t)r->n_steps, sizeof *r->loss);
    r->acc = calloc((size_t)o->epochs, sizeof *r->acc);
    r->epoch_s = calloc((size_t)o->epochs, sizeof *r->epoch_s);
    r->bwd_ms = calloc((size_t)o->epochs, sizeof *r->bwd_ms);
    r->step_ms = calloc((size_t)o->epochs, sizeof *r->step_ms);
    r->train_loss = calloc((size_t)o->epochs, sizeof *r->train_loss);
    if (!t->order || !t->xb || !t->yb || !r->loss || !r->acc || !r->epoch_s || !r->bwd_ms ||
        !r->step_ms || !r->train_loss) {
        fprintf(stderr, "train_fashion_cnn: out of memory\n");
        return 1;
    }
    gj_manual_seed(o->seed);
    gj_tensor *params[6];
    if (model_init(&t->m, o->c1, o->c2) != 0)
        goto gj_fail;
    int np = model_params(&t->m, params);
    if (!(t->opt = gj_adamw_new(np, params, o->lr, 0.9, 0.999, 1e-8, 0.01)))
        goto gj_fail;
    if (stepper_init(&t->st, mode, cnn_loss, &t->m, t->opt) != 0)
        goto gj_fail;
    for (int64_t i = 0; i < tr->n; i++)
        t->order[i] = i;
    if (!o->quiet)
        printf("[%s] %lld steps per epoch of %d examples\n", t->tag, (long long)t->per_epoch,
               o->batch);
    return 0;
gj_fail:
    fprintf(stderr, "train_fashion_cnn (%s): %s\n", t->tag, gj_last_error());
    return 1;
}

static void trainer_epoch_begin(trainer *t, const dataset *tr) {
    shuffle(t->order, tr->n, &t->rng);
    t->train_s = t->bwd_total = t->step_total = t->loss_total = 0.0;
}

/* Batch b of the epoch: forward, backward and AdamW update in this
 * trainer's mode, timed (*tm). 0, or 1 with a message on stderr. */
static int trainer_step(trainer *t, const dataset *tr, int64_t b, step_times *tm) {
    const opts *o = t->o;
    if (o->cosine) /* cosine from lr to 0 over the whole run, no warm-up */
        gj_optim_set_lr(t->opt, gj_lr_cosine(o->lr, t->step, 0,
                                              t->per_epoch * (int64_t)o->epochs, 0.0));
    double ts = now_s();
    gather(tr, t->order, b * o->batch, o->batch, t->xb, t->yb);
    gj_scope_push();
    int64_t xs[2] = {o->batch, IN}, ys = o->batch;
    gj_tensor *in[2] = {gj_from_data(GJ_F32, 2, xs, t->xb), gj_from_data(GJ_I64, 1, &ys, t->yb)};
    gj_tensor *loss = NULL;
    int ok = in[0] && in[1] && stepper_run(&t->st, 2, in, &loss, tm) == 0;
    double lv = ok ? gj_tensor_item(loss) : NAN;
    gj_scope_pop();
    if (!ok) {
        fprintf(stderr, "train_fashion_cnn (%s): %s\n", t->tag, gj_last_error());
        return 1;
    }
    t->r->loss[t->step++] = lv;
    t->bwd_total += step_mode_split(t->mode) ? tm->bwd_ms : 0.0;
    t->step_total += tm->step_ms;
    t->loss_total += lv;
    t->train_s += now_s() - ts;
    return 0;
}

/* The mean ms of a step's timed part over the epoch's first b steps: the
 * backward in the split modes, the whole step in gj_step's; *what names it. */
static double trainer_ms(const trainer *t, int64_t b, const char **what) {
    bool split = step_mode_split(t->mode);
    *what = split ? "backward" : "step";
    return (split ? t->bwd_total : t->step_total) / (double)b;
}

/* Closes epoch e: its figures and the test accuracy. 0, or 1. */
static int trainer_epoch_end(trainer *t, int e, const dataset *te) {
    run_out *r = t->r;
    r->epoch_s[e] = t->train_s;
    r->bwd_ms[e] = step_mode_split(t->mode) ? t->bwd_total / (double)t->per_epoch : NAN;
    r->step_ms[e] = t->step_total / (double)t->per_epoch;
    r->train_loss[e] = t->loss_total / (double)t->per_epoch;
    r->acc[e] = evaluate(&t->m, te);
    if (r->acc[e] < 0) {
        fprintf(stderr, "train_fashion_cnn (%s): %s\n", t->tag, gj_last_error());
        return 1;
    }
    return 0;
}

/* One training run in the given mode; fills r. 0, or 1 with a message. */
static int train(const opts *o, step_mode mode, const dataset *tr, const dataset *te,
                 run_out *r) {
    trainer t;
    int rc = 1;
    gj_compiled_autograd_reset_stats();
    gj_step_reset_stats();
    if (trainer_init(&t, o, mode, tr, r) != 0)
        goto done;
    for (int e = 0; e < o->epochs; e++) {
        trainer_epoch_begin(&t, tr);
        for (int64_t b = 0; b < t.per_epoch; b++) {
            step_times tm;
            if (trainer_step(&t, tr, b, &tm) != 0)
                goto done;
            if (progress_due(o->quiet, o->tty, 10, b, t.per_epoch)) {
                char bar[BAR_W + 1];
                const char *what;
                double ms = trainer_ms(&t, b + 1, &what);
                progress_bar(bar, b, t.per_epoch);
                printf("%s[%s] epoch %d/%d [%s] %lld/%lld loss %.4f  %.0f examples/s  "
                       "%s %.2f ms%s",
                       o->tty ? "\r" : "", t.tag, e + 1, o->epochs, bar, (long long)(b + 1),
                       (long long)t.per_epoch, r->loss[t.step - 1],
                       (double)((b + 1) * o->batch) / t.train_s, what, ms,
                       o->tty ? " " : "\n");
                fflush(stdout);
            }
        }
        if (trainer_epoch_end(&t, e, te) != 0)
            goto done;
        if (o->tty && !o->quiet)
            printf("\r%*s\r", 120, "");
        if (!o->quiet) {
            bool split = step_mode_split(t.mode);
            printf("[%s] epoch %d/%d: train loss %.4f, test accuracy %.4f, %.1f s "
                   "(%.0f examples/s), %s %.2f ms/step\n",
                   t.tag, e + 1, o->epochs, r->train_loss[e], r->acc[e], r->epoch_s[e],
                   (double)(t.per_epoch * o->batch) / r->epoch_s[e],
                   split ? "backward" : "step", split ? r->bwd_ms[e] : r->step_ms[e]);
        }
        fflush(stdout);
    }
    gj_compiled_autograd_stats(&r->ca);
    gj_step_stats(&r->cs);
    rc = 0;
done:
    trainer_free(&t);
    return rc;
}

/* --both: the eager and the compiled run side by side, one step of each in
 * turn (ABBA: eager first on even steps, compiled first on odd ones), so a
 * change of the machine's speed weighs on both alike. With compiled
 * autograd both runs are split (STEP_SPLIT, STEP_SPLIT_CA) and the backward
 * is compared; with --compiled-step they are gj_step's (STEP_EAGER,
 * STEP_COMPILED) and the whole step is. ratio[e] receives the median of
 * epoch e's per-step ratios eager / compiled, q1/q3 its quartiles. 0, or 1
 * with a message. */
static int train_both(const opts *o, const dataset *tr, const dataset *te, run_out *a,
                      run_out *c, double *ratio, double *q1, double *q3) {
    trainer te_, tc;
    int rc = 1;
    bool ia = false, ic = false, cs = o->compiled_step;
    const char *what = cs ? "step" : "backward";
    double *pr = NULL;
    gj_compiled_autograd_reset_stats();
    gj_step_reset_stats();
    if (trainer_init(&te_, o, cs ? STEP_EAGER : STEP_SPLIT, tr, a) != 0)
        goto done;
    ia = true;
    if (trainer_init(&tc, o, cs ? STEP_COMPILED : STEP_SPLIT_CA, tr, c) != 0)
        goto done;
    ic = true;
    pr = malloc((size_t)(te_.per_epoch + 1) * sizeof *pr);
    if (!pr) {
        fprintf(stderr, "train_fashion_cnn: out of memory\n");
        goto done;
    }
    for (int e = 0; e < o->epochs; e++) {
        trainer_epoch_begin(&te_, tr);
        trainer_epoch_begin(&tc, tr);
        for (int64_t b = 0; b < te_.per_epoch; b++) {
            step_times me, mc;
            trainer *first = b % 2 ? &tc : &te_, *second = b % 2 ? &te_ : &tc;
            step_times *mf = b % 2 ? &mc : &me, *ms = b % 2 ? &me : &mc;
            if (trainer_step(first, tr, b, mf) != 0 || trainer_step(second, tr, b, ms) != 0)
                goto done;
            pr[b] = cs ? me.step_ms / mc.step_ms : me.bwd_ms / mc.bwd_ms;
            if (progress_due(o->quiet, o->tty, 10, b, te_.per_epoch)) {
                char bar[BAR_W + 1];
                const char *w;
                progress_bar(bar, b, te_.per_epoch);
                printf("%s[both] epoch %d/%d [%s] %lld/%lld loss %.4f / %.4f  %s %.2f / "
                       "%.2f ms (eager / compiled)%s",
                       o->tty ? "\r" : "", e + 1, o->epochs, bar, (long long)(b + 1),
                       (long long)te_.per_epoch, a->loss[te_.step - 1], c->loss[tc.step - 1],
                       what, trainer_ms(&te_, b + 1, &w), trainer_ms(&tc, b + 1, &w),
                       o->tty ? " " : "\n");
                fflush(stdout);
            }
        }
        if (trainer_epoch_end(&te_, e, te) != 0 || trainer_epoch_end(&tc, e, te) != 0)
            goto done;
        double q[3];
        quartiles(pr, te_.per_epoch, q);
        q1[e] = q[0], ratio[e] = q[1], q3[e] = q[2];
        if (o->tty && !o->quiet)
            printf("\r%*s\r", 120, "");
        if (!o->quiet)
            printf("[both] epoch %d/%d: test accuracy %.4f / %.4f, %s %.2f / %.2f "
                   "ms/step (eager / compiled), paired ratio %.3fx [%.2f-%.2f]\n",
                   e + 1, o->epochs, a->acc[e], c->acc[e], what,
                   cs ? a->step_ms[e] : a->bwd_ms[e], cs ? c->step_ms[e] : c->bwd_ms[e],
                   ratio[e], q1[e], q3[e]);
        fflush(stdout);
    }
    gj_compiled_autograd_stats(&c->ca);
    gj_step_stats(&c->cs);
    rc = 0;
done:
    free(pr);
    if (ia)
        trainer_free(&te_);
    if (ic)
        trainer_free(&tc);
    return rc;
}

/* ---------------------------------------------------------------- main */

/* The options (examples/args.h). 0, 1 (--help/--version printed) or -1. */
static int parse_opts(int argc, char **argv, opts *o) {
    *o = (opts){.epochs = TARGET_EPOCHS,
                .batch = 128,
                .lr = 1e-3,
                .seed = 42,
                .c1 = 32,
                .c2 = 64,
                .csv = "fashion_cnn_loss.csv",
                .png = "fashion_cnn_loss.png"};
    const char *channels = "32,64";
    const arg_spec specs[] = {
        ARG_OPT("compiled-autograd", ARG_FLAG, &o->compiled, 0, 0, "run the backward compiled"),
        ARG_OPT("compiled-step", ARG_FLAG, &o->compiled_step, 0, 0,
                "run the whole step (forward, backward, AdamW update) as one compiled program"),
        ARG_OPT("both", ARG_FLAG, &o->both, 0, 0,
                "train eager and compiled side by side (steps in turn, ABBA), paired ratios: "
                "compiled autograd's backward, or with --compiled-step the whole step"),
        ARG_OPT("epochs", ARG_INT, &o->epochs, 1, 1000, "epochs"),
        ARG_OPT("batch", ARG_INT, &o->batch, 1, 60000, "examples per batch"),
        ARG_OPT("lr", ARG_DOUBLE, &o->lr, 0, 1e6, "AdamW learning rate"),
        ARG_OPT("seed", ARG_U64, &o->seed, 0, 0, "seed of the weights and the shuffle"),
        ARG_OPT("threads", ARG_INT, &o->threads, 0, 4096, "gradjit threads (0: every CPU)"),
        ARG_OPT("channels", ARG_STR, &channels, 0, 0, "channels of the two conv layers, C1,C2"),
        ARG_OPT("limit", ARG_I64, &o->limit, 1, 60000,
                "train on N examples per epoch (0: all 60000)"),
        ARG_OPT("cosine", ARG_FLAG, &o->cosine, 0, 0,
                "cosine learning-rate decay from --lr to 0 over the run"),
        ARG_OPT("quiet", ARG_FLAG, &o->quiet, 0, 0, "no per-step progress"),
        ARG_OPT("csv", ARG_FILE, &o->csv, 0, 0, "loss curve as CSV (\"-\": none)"),
        ARG_OPT("png", ARG_FILE, &o->png, 0, 0, "loss curve and accuracy as PNG (\"-\": none)"),
    };
    int rc = args_parse("train_fashion_cnn",
                        "Trains a two-conv CNN on Fashion-MNIST (Debian's dataset-fashion-mnist), "
                        "eager, with compiled autograd or with the compiled step.",
                        argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (rc != 0) return rc;
    long long c1, c2;
    int used = 0;
    if (sscanf(channels, "%lld,%lld%n", &c1, &c2, &used) != 2 || channels[used] || c1 < 1 ||
        c2 < 1 || c1 > 4096 || c2 > 4096) {
        fprintf(stderr, "train_fashion_cnn: --channels: '%s' is not C1,C2 with both in "
                        "[1, 4096]\n", channels);
        return -1;
    }
    o->c1 = c1;
    o->c2 = c2;
    if (o->compiled && o->compiled_step) {
        fprintf(stderr, "train_fashion_cnn: --compiled-autograd and --compiled-step are two "
                        "compiled modes; give one\n");
        return -1;
    }
    if (o->both && o->compiled) {
        fprintf(stderr, "train_fashion_cnn: --both already runs compiled autograd (--both "
                        "--compiled-step: the compiled step)\n");
        return -1;
    }
    return 0;
}

/* Loss curve(s) as CSV: step,loss (or step,loss_eager,loss_compiled). */
static int write_csv(const char *path, const run_out *a, const run_out *b) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "train_fashion_cnn: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    fputs(b ? "step,loss_eager,loss_compiled\n" : "step,loss\n", f);
    for (int64_t s = 0; s < a->n_steps; s++) {
        if (b)
            fprintf(f, "%lld,%.9g,%.9g\n", (long long)s, a->loss[s], b->loss[s]);
        else
            fprintf(f, "%lld,%.9g\n", (long long)s, a->loss[s]);
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "train_fashion_cnn: error writing %s\n", path);
        return -1;
    }
    return 0;
}

/* The loss curve(s) (moving average; the raw eager loss faint behind) and
 * the test accuracy per epoch, as a PNG, the runs named na and nb. b may be
 * NULL (one run). */
static int write_png(const char *path, const opts *o, const run_out *a, const run_out *b,
                     const char *na, const char *nb) {
    int64_t n = a->n_steps;
    double *sa = malloc((size_t)n * sizeof *sa), *sb = b ? malloc((size_t)n * sizeof *sb) : NULL;
    double ep[1000], acc_a[1000], acc_b[1000];
    plot_img im = {0};
    int rc = -1;
    if (!sa || (b && !sb)) {
        fprintf(stderr, "train_fashion_cnn: out of memory plotting\n");
        goto done;
    }
    smooth(a->loss, n, SMOOTH, sa);
    if (b)
        smooth(b->loss, n, SMOOTH, sb);
    for (int e = 0; e < o->epochs; e++) {
        ep[e] = e + 1;
        acc_a[e] = a->acc[e];
        acc_b[e] = b ? b->acc[e] : NAN;
    }
    if (plot_img_init(&im, 1000, 900) != 0)
        goto done;
    plot_series loss[3] = {
        {NULL, NULL, a->loss, (int)n, 0xd9d9d9u, 1, 0},
        {na, NULL, sa, (int)n, b ? 0x9ecae1u : 0x08519cu, b ? 5 : 2, 0},
        {nb, NULL, sb, (int)n, 0x08519cu, 1, 0},
    };
    char title[160];
    snprintf(title, sizeof title, "Fashion-MNIST CNN: training loss (%d-step moving average; "
             "raw in grey)", SMOOTH);
    plot_line_panel(&im, 0, 10, 1000, 520, title, "step", "cross-entropy", loss, b ? 3 : 2, 0, 0);
    plot_series acc[2] = {
        {na, ep, acc_a, o->epochs, b ? 0x9ecae1u : 0x08519cu, b ? 7 : 3, 13},
        {nb, ep, acc_b, o->epochs, 0x08519cu, 2, 7},
    };
    snprintf(title, sizeof title, "test accuracy per epoch (batch %d, lr %g, seed %llu)",
             o->batch, o->lr, (unsigned long long)o->seed);
    plot_line_panel(&im, 0, 540, 1000, 360, title, "epoch", "accuracy", acc, b ? 2 : 1, 0, 0);
    rc = plot_write_png(&im, path);
done:
    plot_img_free(&im);
    free(sa);
    free(sb);
    return rc;
}

/* Whether some epoch within the first TARGET_EPOCHS reached TARGET_ACC. */
static const char *target_met(const opts *o, const run_out *r) {
    for (int e = 0; e < o->epochs && e < TARGET_EPOCHS; e++)
        if (r->acc[e] >= TARGET_ACC)
            return "met";
    return o->epochs >= TARGET_EPOCHS ? "NOT met" : "not reached yet";
}

int main(int argc, char **argv) {
    opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;
    o.tty = isatty(STDOUT_FILENO) != 0;
    /* GRADJIT_COMPILED_AUTOGRAD=1 selects the compiled mode like the flag
     * (read here, before this program sets the flag itself). */
    if (!o.both && !o.compiled && !o.compiled_step && gj_compiled_autograd_enabled())
        o.compiled = true;
    step_mode mode = o.compiled ? STEP_SPLIT_CA : o.compiled_step ? STEP_COMPILED : STEP_EAGER;
    dataset tr = {0}, te = {0};
    int rc = load_split("train_fashion_cnn", "train", 60000, &tr);
    if (rc == 0)
        rc = load_split("train_fashion_cnn", "t10k", 10000, &te);
    if (rc != 0) {
        dataset_free(&tr);
        dataset_free(&te);
        return rc;
    }
    if (o.batch > tr.n) {
        fprintf(stderr, "train_fashion_cnn: --batch %d exceeds the %lld training examples\n",
                o.batch, (long long)tr.n);
        dataset_free(&tr);
        dataset_free(&te);
        return 2;
    }

    gj_set_num_threads(o.threads);
    gj_info info;
    gj_get_info(&info);
    if (!o.quiet)
        printf("gradjit %s, %d threads, BLAS %s | Fashion-MNIST %lld train / %lld test | "
               "CNN conv5x5 1-%lld, pool, conv5x5 %lld-%lld, pool, linear %lld-%d (ReLU), "
               "AdamW lr %g%s, batch %d, %d epochs, seed %llu\n",
               info.version, info.num_threads, info.blas_core ? info.blas_core : "?",
               (long long)tr.n, (long long)te.n, (long long)o.c1, (long long)o.c1,
               (long long)o.c2, (long long)(o.c2 * 49), K, o.lr, o.cosine ? " cosine" : "",
               o.batch, o.epochs,
               (unsigned long long)o.seed);

    run_out a = {0}, b = {0};
    rc = 1;
    if (!o.both) {
        if (train(&o, mode, &tr, &te, &a) != 0)
            goto out;
        if (mode == STEP_SPLIT_CA)
            print_ca("compiled", &a.ca);
        if (mode == STEP_COMPILED)
            print_step("compiled step", &a.cs);
        printf("final test accuracy %.4f after %d epoch(s) (target %.2f within %d epochs: %s)\n",
               a.acc[o.epochs - 1], o.epochs, TARGET_ACC, TARGET_EPOCHS,
               target_met(&o, &a));
        if (o.csv && write_csv(o.csv, &a, NULL) != 0)
            goto out;
        if (o.png && write_png(o.png, &o, &a, NULL, mode_tag(mode), NULL) != 0)
            goto out;
        if (!o.quiet && (o.csv || o.png))
            printf("wrote%s%s%s%s\n", o.csv ? " " : "", o.csv ? o.csv : "", o.png ? " " : "",
                   o.png ? o.png : "");
        rc = 0;
        goto out;
    }

    double ratio[1000], q1[1000], q3[1000];
    if (train_both(&o, &tr, &te, &a, &b, ratio, q1, q3) != 0)
        goto out;
    bool cs = o.compiled_step;
    const char *cname = cs ? "compiled step" : "compiled";
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
    for (int e = 0; e < o.epochs; e++)
        printf("%5d  %10.4f  %10.4f  %12.3f  %12.3f  %9.1f  %9.1f  %7.3fx [%.2f-%.2f]\n", e + 1,
               a.acc[e], b.acc[e], cs ? a.step_ms[e] : a.bwd_ms[e],
               cs ? b.step_ms[e] : b.bwd_ms[e], a.epoch_s[e], b.epoch_s[e], ratio[e], q1[e],
               q3[e]);
    if (cs)
        print_step(cname, &b.cs);
    else
        print_ca(cname, &b.ca);
    print_curves(cs ? "eager vs compiled step" : "eager vs compiled autograd", a.loss, b.loss,
                 a.n_steps);
    printf("final test accuracy after %d epoch(s): eager %.4f, %s %.4f (target %.2f "
           "within %d epochs: eager %s, %s %s)\n",
           o.epochs, a.acc[o.epochs - 1], cname, b.acc[o.epochs - 1], TARGET_ACC, TARGET_EPOCHS,
           target_met(&o, &a), cname, target_met(&o, &b));
    if (o.csv && write_csv(o.csv, &a, &b) != 0)
        goto out;
    if (o.png && write_png(o.png, &o, &a, &b, "eager", cname) != 0)
        goto out;
    if (!o.quiet && (o.csv || o.png))
        printf("wrote%s%s%s%s\n", o.csv ? " " : "", o.csv ? o.csv : "", o.png ? " " : "",
               o.png ? o.png : "");
    rc = 0;
out:
    run_out_free(&a);
    run_out_free(&b);
    dataset_free(&tr);
    dataset_free(&te);
    return rc;
}
