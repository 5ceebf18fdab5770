/* SPDX-License-Identifier: MIT */
/*
 * train_fashion_mnist.c - trains an MLP classifier on Fashion-MNIST with
 * gradjit, eagerly, with compiled autograd (--compiled-autograd) or with the
 * compiled training step (--compiled-step), or eager and compiled from the
 * same seed for a side-by-side comparison (--both, with compiled autograd;
 * --both --compiled-step, with the compiled step).
 *
 *   train_fashion_mnist [--compiled-autograd | --compiled-step] [--both]
 *                       [--epochs N] [--batch N]
 *                       [--lr X] [--seed N] [--threads N] [--quiet]
 *                       [--csv FILE] [--png FILE]
 *                       [--save FILE] [--resume FILE] [--stop-after N]
 *
 * The step: its forward is one step function (mlp_loss: the model, then
 * the batch's images and labels to the loss), run by examples/common.h's
 * stepper: eagerly through gj_step (the default), through gj_step compiled
 * (--compiled-step: forward, backward and the AdamW update as one program
 * after the first step), or as forward, gj_backward with compiled autograd
 * and gj_optim_step (--compiled-autograd; and --ddp, whose gradients are
 * averaged between backward and update). Every mode gives the same bits.
 *
 * Checkpoints (not with --both): --save FILE writes a safetensors file at
 * the end of the run, and when the run is interrupted: on SIGINT (Ctrl-C)
 * the step under way finishes, the checkpoint is written and the program
 * exits with status 130 (a second Ctrl-C kills it at once); --stop-after N
 * does the same after N steps of this run (for tests and time-sliced jobs).
 * --resume FILE continues such a run: model ("fc1.weight" ...), AdamW state,
 * RNG, the shuffle generator, the epoch's order and position, and the
 * losses so far are restored, so with the same --batch, --seed and
 * --threads the loss curve and the final model are bit-identical to a run
 * that never stopped (--epochs may grow).
 *
 * Output: a progress bar (on a terminal) with loss, examples/s and backward
 * ms (whole step ms in gj_step's modes); a line per epoch with test
 * accuracy; the loss curve of every step as
 * CSV (--csv, default fashion_mnist_loss.csv; "-" for none) and as a PNG
 * plot (--png, default fashion_mnist_loss.png; "-" for none) with the loss
 * curve(s) and the test accuracy per epoch (examples/plot.h).
 *
 * Data: Debian's dataset-fashion-mnist package, /usr/share/datasets/
 * fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz, read with the
 * library's gj_idx_load (examples/fashion_data.h): header, dimensions, exact
 * length and label range are checked; a missing file exits with code 2 and
 * names the package.
 * Pixels are scaled to [0,1] and standardised with the dataset's mean/std
 * (0.2860 / 0.3530).
 *
 * Model: 784 -> 512 -> GELU -> 256 -> GELU -> 10, cross-entropy, AdamW
 * (betas 0.9/0.999, eps 1e-8, weight decay 0.01). Every epoch visits the
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
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TARGET_ACC 0.87
#define EVAL_CHUNK 1000
#define SMOOTH 25 /* steps in the moving average of the plotted loss */

enum { ROWS = 28, COLS = 28, IN = ROWS * COLS, H1 = 512, H2 = 256, K = 10 };

/* ---------------------------------------------------------------- data */

/* --------------------------------------------------------------- model */

typedef struct model {
    gj_linear_layer l[3];
} model;

static int model_init(model *m) {
    const int64_t dims[4] = {IN, H1, H2, K};
    memset(m, 0, sizeof *m);
    for (int i = 0; i < 3; i++)
        if (gj_linear_init(&m->l[i], dims[i], dims[i + 1], true, GJ_F32) != 0)
            return -1;
    return 0;
}

static void model_free(model *m) {
    for (int i = 0; i < 3; i++)
        gj_linear_free(&m->l[i]);
}

/* logits [n, 10] of x [n, 784]; scope-owned new reference or NULL. */
static gj_tensor *model_forward(model *m, gj_tensor *x) {
    gj_tensor *h = gj_gelu(gj_linear_forward(&m->l[0], x)); /* [n, 512] */
    h = h ? gj_gelu(gj_linear_forward(&m->l[1], h)) : NULL;  /* [n, 256] */
    return h ? gj_linear_forward(&m->l[2], h) : NULL;        /* [n, 10] */
}

/* The training step's forward (a gj_step_fn): ctx the model, in[0] images
 * [n, 784] f32, in[1] labels [n] i64 (borrowed). The mean cross-entropy, a
 * 0-d scope-owned new reference, or NULL. */
static gj_tensor *mlp_loss(void *ctx, int n_in, gj_tensor *const *in) {
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
    bool compiled, compiled_step, both, quiet, tty, ddp;
    gj_pg *pg;       /* --ddp: the world group (launched with mpirun) */
    int rank, size;  /* 0 and 1 without --ddp */
    int epochs, batch, threads;
    double lr;
    uint64_t seed;
    const char *csv, *png; /* NULL: not written */
    const char *save, *resume; /* checkpoints; NULL: none */
    int64_t stop_after;        /* stop (and save) after this many steps; 0: never */
} opts;

/* Set by SIGINT; the training loop stops at the next step boundary. */

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
    stepper st;     /* runs mlp_loss, backward and update in `mode` */
    gj_ddp *ddp;    /* --ddp: gradients averaged over the ranks */
    int64_t *order; /* [n] shuffled example indices */
    float *xb;      /* [batch, IN] */
    int64_t *yb;    /* [batch] */
    uint64_t rng;
    int64_t per_epoch, step;
    double train_s, bwd_total, step_total, loss_total; /* this epoch */
    run_out *r;
    /* Where the run starts (a resumed run: later; order already shuffled
     * for start_epoch when start_shuffled). */
    int start_epoch;
    int64_t start_batch;
    bool start_shuffled;
} trainer;

static void trainer_free(trainer *t) {
    stepper_free(&t->st);
    gj_ddp_free(t->ddp);
    t->ddp = NULL;
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

/* --ddp: the averaged gradients are complete before the update. */
static int ddp_wait(void *ddp) { return gj_ddp_wait(ddp); }

/* A fresh model from o->seed (so two trainers start bit-identical), its
 * AdamW, its stepper in `mode` and the run's buffers. 0, or 1 with a
 * message on stderr. */
static int trainer_init(trainer *t, const opts *o, step_mode mode, const dataset *tr, run_out *r) {
    memset(t, 0, sizeof *t);
    t->o = o;
    t->mode = mode;
    t->tag = mode_tag(mode);
    t->r = r;
    t->per_epoch = tr->n / o->batch;
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
        fprintf(stderr, "train_fashion_mnist: out of memory\n");
        return 1;
    }
    gj_manual_seed(o->seed);
    gj_tensor *params[6];
    if (model_init(&t->m) != 0)
        goto gj_fail;
    for (int i = 0; i < 3; i++) {
        params[2 * i] = t->m.l[i].weight;
        params[2 * i + 1] = t->m.l[i].bias;
    }
    if (!(t->opt = gj_adamw_new(6, params, o->lr, 0.9, 0.999, 1e-8, 0.01)))
        goto gj_fail;
    if (o->ddp && !(t->ddp = gj_ddp_new(o->pg, 6, params, NULL)))
        goto gj_fail;
    if (stepper_init(&t->st, mode, mlp_loss, &t->m, t->opt) != 0)
        goto gj_fail;
    if (t->ddp) { /* a split mode (main): backward, the average, then the update */
        t->st.between = ddp_wait;
        t->st.between_user = t->ddp;
    }
    for (int64_t i = 0; i < tr->n; i++)
        t->order[i] = i;
    if (!o->quiet)
        printf("[%s] %lld steps per epoch of %d examples\n", t->tag, (long long)t->per_epoch,
               o->batch);
    return 0;
gj_fail:
    fprintf(stderr, "train_fashion_mnist (%s): %s\n", t->tag, gj_last_error());
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
    double ts = now_s();
    /* --ddp: every rank draws the same batch and takes its shard of it */
    int64_t shard = o->batch / o->size, first = b * o->batch + o->rank * shard;
    gather(tr, t->order, first, shard, t->xb, t->yb);
    gj_scope_push();
    int64_t xs[2] = {shard, IN}, ys = shard;
    gj_tensor *in[2] = {gj_from_data(GJ_F32, 2, xs, t->xb), gj_from_data(GJ_I64, 1, &ys, t->yb)};
    gj_tensor *loss = NULL;
    int ok = in[0] && in[1] && stepper_run(&t->st, 2, in, &loss, tm) == 0;
    gj_tensor *lg = ok && t->ddp ? gj_detach(loss) : NULL; /* the batch's mean loss */
    ok = ok && (!lg || gj_allreduce(o->pg, lg, GJ_REDUCE_AVG) == 0);
    double lv = ok ? gj_tensor_item(lg ? lg : loss) : NAN;
    gj_release(lg);
    gj_scope_pop();
    if (!ok) {
        fprintf(stderr, "train_fashion_mnist (%s): %s\n", t->tag, gj_last_error());
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
        fprintf(stderr, "train_fashion_mnist (%s): %s\n", t->tag, gj_last_error());
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------- checkpoints */

static const char *const LAYER_NAMES[3] = {"fc1", "fc2", "fc3"};

/* A new state dict holding the model's parameters under stable names
 * (references to the live tensors), or NULL with gj_last_error set. */
static gj_state_dict *model_dict(model *m) {
    gj_state_dict *sd = gj_state_dict_new();
    for (int i = 0; sd && i < 3; i++)
        if (gj_linear_state_dict_add(&m->l[i], sd, LAYER_NAMES[i]) != 0) {
            gj_state_dict_free(sd);
            return NULL;
        }
    return sd;
}

/* A copy of data [n] as a tensor named name in sd. */
static int add_array(gj_state_dict *sd, const char *name, gj_dtype dt, int64_t n,
                     const void *data) {
    gj_tensor *t = gj_from_data(dt, 1, &n, data);
    int rc = t ? gj_state_dict_add(sd, name, t) : -1;
    gj_release(t);
    return rc;
}

/* Saves everything the run needs to continue at batch b of epoch e
 * (shuffled: that epoch's order is already drawn). 0, or 1 with a message. */
static int trainer_save(trainer *t, const char *path, int e, int64_t b, bool shuffled,
                        int64_t n_examples) {
    const run_out *r = t->r;
    gj_state_dict *sd = model_dict(&t->m);
    char rng[32];
    snprintf(rng, sizeof rng, "%" PRIu64, t->rng);
    int rc = sd ? 0 : -1;
    rc = rc || gj_optim_state_dict_add(t->opt, sd, "optim");
    rc = rc || gj_rng_state_dict_add(sd, "rng");
    rc = rc || gj_state_dict_set_metadata(sd, "format", "gradjit");
    rc = rc || gj_state_dict_set_metadata(sd, "train.program", "train_fashion_mnist");
    rc = rc || meta_i64(sd, "train.epoch", e) || meta_i64(sd, "train.batch", b);
    rc = rc || meta_i64(sd, "train.shuffled", shuffled) || meta_i64(sd, "train.step", t->step);
    rc = rc || gj_state_dict_set_metadata(sd, "train.shuffle_rng", rng);
    rc = rc || meta_i64(sd, "train.batch_size", t->o->batch);
    rc = rc || meta_i64(sd, "train.seed", (int64_t)t->o->seed);
    rc = rc || meta_f64(sd, "train.train_s", t->train_s);
    rc = rc || meta_f64(sd, "train.bwd_total", t->bwd_total);
    rc = rc || meta_f64(sd, "train.step_total", t->step_total);
    rc = rc || meta_f64(sd, "train.loss_total", t->loss_total);
    rc = rc || add_array(sd, "train.order", GJ_I64, n_examples, t->order);
    rc = rc || add_array(sd, "train.loss", GJ_F64, t->step, r->loss);
    rc = rc || add_array(sd, "train.acc", GJ_F64, e, r->acc);
    rc = rc || add_array(sd, "train.epoch_s", GJ_F64, e, r->epoch_s);
    rc = rc || add_array(sd, "train.bwd_ms", GJ_F64, e, r->bwd_ms);
    rc = rc || add_array(sd, "train.step_ms", GJ_F64, e, r->step_ms);
    rc = rc || add_array(sd, "train.train_loss", GJ_F64, e, r->train_loss);
    rc = rc || gj_save_safetensors(sd, path);
    gj_state_dict_free(sd);
    if (rc) {
        fprintf(stderr, "train_fashion_mnist: saving %s: %s\n", path, gj_last_error());
        return 1;
    }
    return 0;
}

/* Metadata key as an integer within [lo, hi]. 0, or -1 with a message. */
static int get_i64(const gj_state_dict *sd, const char *key, int64_t lo, int64_t hi,
                   int64_t *out) {
    const char *v = gj_state_dict_get_metadata(sd, key);
    char *end = NULL;
    errno = 0;
    long long x = v ? strtoll(v, &end, 10) : 0;
    if (!v || !*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "train_fashion_mnist: checkpoint: %s is %s, expected an integer in "
                        "[%lld, %lld]\n",
                key, v ? v : "absent", (long long)lo, (long long)hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int get_f64(const gj_state_dict *sd, const char *key, double *out) {
    const char *v = gj_state_dict_get_metadata(sd, key);
    char *end = NULL;
    *out = v ? strtod(v, &end) : NAN;
    if (!v || !*v || *end) {
        fprintf(stderr, "train_fashion_mnist: checkpoint: %s is %s, expected a number\n", key,
                v ? v : "absent");
        return -1;
    }
    return 0;
}

/* Copies tensor name of sd (dtype dt, [n] elements) into out. */
static int get_array(const gj_state_dict *sd, const char *name, gj_dtype dt, int64_t n,
                     void *out, size_t elsize) {
    gj_tensor *t = gj_state_dict_get(sd, name);
    if (!t || gj_tensor_dtype(t) != dt || gj_tensor_ndim(t) != 1 || gj_tensor_numel(t) != n) {
        fprintf(stderr, "train_fashion_mnist: checkpoint: %s must be a 1-d %s tensor of %lld "
                        "elements\n",
                name, dt == GJ_I64 ? "i64" : "f64", (long long)n);
        return -1;
    }
    if (n > 0)
        memcpy(out, gj_tensor_data(t), (size_t)n * elsize);
    return 0;
}

/* Restores t (fresh from trainer_init) from a file of trainer_save. 0, or
 * 1 with a message. */
static int trainer_resume(trainer *t, const char *path, int64_t n_examples) {
    const opts *o = t->o;
    gj_state_dict *f = gj_load_safetensors(path), *m = f ? model_dict(&t->m) : NULL;
    int rc = 1;
    int64_t e, b, sh, step, bs, seed;
    uint64_t rng;
    if (!f || !m)
        goto gj_fail;
    if (get_i64(f, "train.batch_size", 1, INT64_MAX, &bs) || get_i64(f, "train.seed", INT64_MIN,
        INT64_MAX, &seed) || get_i64(f, "train.epoch", 0, o->epochs, &e) ||
        get_i64(f, "train.batch", 0, t->per_epoch - 1, &b) ||
        get_i64(f, "train.shuffled", 0, 1, &sh) ||
        get_i64(f, "train.step", 0, t->per_epoch * o->epochs, &step))
        goto done;
    if (bs != o->batch || (uint64_t)seed != o->seed) {
        fprintf(stderr, "train_fashion_mnist: %s was saved with --batch %lld --seed %llu; resume "
                        "with the same values (this run: --batch %d --seed %llu)\n",
                path, (long long)bs, (unsigned long long)seed, o->batch,
                (unsigned long long)o->seed);
        goto done;
    }
    if (step != e * t->per_epoch + (sh ? b : 0)) {
        fprintf(stderr, "train_fashion_mnist: %s: step %lld does not match epoch %lld batch "
                        "%lld\n",
                path, (long long)step, (long long)e, (long long)b);
        goto done;
    }
    const char *rs = gj_state_dict_get_metadata(f, "train.shuffle_rng");
    char *end = NULL;
    rng = rs ? strtoull(rs, &end, 10) : 0;
    if (!rs || !*rs || *end) {
        fprintf(stderr, "train_fashion_mnist: %s: bad train.shuffle_rng\n", path);
        goto done;
    }
    if (get_f64(f, "train.train_s", &t->train_s) || get_f64(f, "train.bwd_total", &t->bwd_total) ||
        get_f64(f, "train.loss_total", &t->loss_total) ||
        get_array(f, "train.order", GJ_I64, n_examples, t->order, sizeof *t->order) ||
        get_array(f, "train.loss", GJ_F64, step, t->r->loss, sizeof(double)) ||
        get_array(f, "train.acc", GJ_F64, e, t->r->acc, sizeof(double)) ||
        get_array(f, "train.epoch_s", GJ_F64, e, t->r->epoch_s, sizeof(double)) ||
        get_array(f, "train.bwd_ms", GJ_F64, e, t->r->bwd_ms, sizeof(double)) ||
        /* step times: absent from checkpoints of older versions */
        (gj_state_dict_get_metadata(f, "train.step_total") &&
         get_f64(f, "train.step_total", &t->step_total)) ||
        (gj_state_dict_get(f, "train.step_ms") &&
         get_array(f, "train.step_ms", GJ_F64, e, t->r->step_ms, sizeof(double))) ||
        get_array(f, "train.train_loss", GJ_F64, e, t->r->train_loss, sizeof(double)))
        goto done;
    for (int64_t i = 0; i < n_examples; i++)
        if (t->order[i] < 0 || t->order[i] >= n_examples) {
            fprintf(stderr, "train_fashion_mnist: %s: train.order holds %lld\n", path,
                    (long long)t->order[i]);
            goto done;
        }
    /* Model, optimizer and RNG: each checks names, shapes and dtypes. */
    if (gj_state_dict_copy_into(m, f, false) != 0 ||
        gj_optim_load_state_dict(t->opt, f, "optim") != 0 || gj_rng_load_state_dict(f, "rng") != 0)
        goto gj_fail;
    t->rng = rng;
    t->step = step;
    t->start_epoch = (int)e;
    t->start_batch = sh ? b : 0;
    t->start_shuffled = sh != 0;
    if (!o->quiet)
        printf("[%s] resumed from %s at epoch %lld, batch %lld (step %lld)\n", t->tag, path,
               (long long)e + 1, (long long)t->start_batch, (long long)step);
    rc = 0;
    goto done;
gj_fail:
    fprintf(stderr, "train_fashion_mnist: resuming from %s: %s\n", path, gj_last_error());
done:
    gj_state_dict_free(m);
    gj_state_dict_free(f);
    return rc;
}

/* The run stops at batch b of epoch e: saves if --save was given. Returns
 * 130 (the status of a SIGINT'ed program), or 1 if saving failed. */
static int trainer_stop(trainer *t, int e, int64_t b, bool shuffled, int64_t n_examples) {
    const opts *o = t->o;
    if (o->tty && !o->quiet)
        printf("\n");
    const char *why = g_interrupted ? "interrupted" : "stopped (--stop-after)";
    gj_ca_stats c; /* what the run compiled or found in the caches so far */
    if (t->mode == STEP_SPLIT_CA) {
        gj_compiled_autograd_stats(&c);
        print_ca(t->tag, &c);
    } else if (t->mode == STEP_COMPILED) {
        gj_step_stats(&c);
        print_step(t->tag, &c);
    }
    if (!o->save) {
        printf("[%s] %s at step %lld; no --save FILE given, nothing saved\n", t->tag, why,
               (long long)t->step);
        return 130;
    }
    if (trainer_save(t, o->save, e, b, shuffled, n_examples) != 0)
        return 1;
    printf("[%s] %s at step %lld: saved %s (continue with --resume %s)\n", t->tag, why,
           (long long)t->step, o->save, o->save);
    return 130;
}

/* One training run in the given mode (resumed from o->resume if given);
 * fills r. 0, 130 if it stopped early (SIGINT, --stop-after; saved to
 * o->save if given), or 1 with a message. */
static int train(const opts *o, step_mode mode, const dataset *tr, const dataset *te,
                 run_out *r) {
    trainer t;
    int rc = 1;
    int64_t run_steps = 0;
    gj_compiled_autograd_reset_stats();
    gj_step_reset_stats();
    if (trainer_init(&t, o, mode, tr, r) != 0)
        goto done;
    if (o->resume && trainer_resume(&t, o->resume, tr->n) != 0)
        goto done;
    for (int e = t.start_epoch; e < o->epochs; e++) {
        int64_t b0 = 0;
        if (e == t.start_epoch && t.start_shuffled)
            b0 = t.start_batch; /* resumed inside this epoch: order restored */
        else
            trainer_epoch_begin(&t, tr);
        for (int64_t b = b0; b < t.per_epoch; b++) {
            step_times tm;
            /* A step boundary: the place to stop and save. */
            if (g_interrupted || (o->stop_after > 0 && run_steps == o->stop_after)) {
                rc = trainer_stop(&t, e, b, true, tr->n);
                goto done;
            }
            run_steps++;
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
    if (o->save) {
        if (trainer_save(&t, o->save, o->epochs, 0, false, tr->n) != 0)
            goto done;
        if (!o->quiet)
            printf("[%s] saved %s\n", t.tag, o->save);
    }
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
        fprintf(stderr, "train_fashion_mnist: out of memory\n");
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
    *o = (opts){.epochs = 3,
                .batch = 128,
                .lr = 1e-3,
                .seed = 42,
                .csv = "fashion_mnist_loss.csv",
                .png = "fashion_mnist_loss.png"};
    const arg_spec specs[] = {
        ARG_OPT("compiled-autograd", ARG_FLAG, &o->compiled, 0, 0, "run the backward compiled"),
        ARG_OPT("compiled-step", ARG_FLAG, &o->compiled_step, 0, 0,
         "run the whole step (forward, backward, AdamW update) as one compiled program"),
        ARG_OPT("both", ARG_FLAG, &o->both, 0, 0,
         "train eager and compiled side by side (steps in turn, ABBA) and print paired ratios: "
         "compiled autograd's backward, or with --compiled-step the compiled step's whole step"),
        ARG_OPT("epochs", ARG_INT, &o->epochs, 1, 1000, "epochs"),
        ARG_OPT("batch", ARG_INT, &o->batch, 1, 60000, "examples per batch"),
        ARG_OPT("lr", ARG_DOUBLE, &o->lr, 0, 1e6, "AdamW learning rate"),
        ARG_OPT("seed", ARG_U64, &o->seed, 0, 0, "seed of the weights and the shuffle"),
        ARG_OPT("threads", ARG_INT, &o->threads, 0, 4096, "gradjit threads (0: every CPU)"),
        ARG_OPT("quiet", ARG_FLAG, &o->quiet, 0, 0, "no per-step progress"),
        ARG_OPT("csv", ARG_FILE, &o->csv, 0, 0, "loss curve as CSV (\"-\": none)"),
        ARG_OPT("png", ARG_FILE, &o->png, 0, 0, "loss curve and accuracy as PNG (\"-\": none)"),
        ARG_OPT("save", ARG_FILE, &o->save, 0, 0,
         "safetensors checkpoint at the end, on Ctrl-C and at --stop-after"),
        ARG_OPT("resume", ARG_FILE, &o->resume, 0, 0,
         "continue a saved run bit-identically (same --batch, --seed, --threads)"),
        ARG_OPT("stop-after", ARG_I64, &o->stop_after, 1, 9e18, "stop (and save) after N steps"),
        ARG_OPT("ddp", ARG_FLAG, &o->ddp, 0, 0,
         "data parallel over MPI ranks (mpirun -np N ... --ddp): each rank takes 1/N of every "
         "batch, gradients are averaged"),
    };
    int rc = args_parse("train_fashion_mnist",
                        "Trains a 784-512-256-10 GELU MLP on Fashion-MNIST (Debian's "
                        "dataset-fashion-mnist), eager, with compiled autograd or with the "
                        "compiled step.",
                        argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (rc != 0) return rc;
    o->size = 1;
    if (o->compiled && o->compiled_step) {
        fprintf(stderr, "train_fashion_mnist: --compiled-autograd and --compiled-step are two "
                        "compiled modes; give one\n");
        return -1;
    }
    if (o->both && o->compiled) {
        fprintf(stderr, "train_fashion_mnist: --both already runs compiled autograd (--both "
                        "--compiled-step: the compiled step)\n");
        return -1;
    }
    if (o->ddp && o->compiled_step) {
        fprintf(stderr, "train_fashion_mnist: --ddp averages the gradients between backward "
                        "and update, which the compiled step runs as one program; use --ddp "
                        "eagerly or with --compiled-autograd\n");
        return -1;
    }
    if (o->both && (o->save || o->resume || o->stop_after)) {
        fprintf(stderr, "train_fashion_mnist: --save, --resume and --stop-after are for one "
                        "run, not --both\n");
        return -1;
    }
    return 0;
}

/* Loss curve(s) as CSV: step,loss (or step,loss_eager,loss_compiled). */
static int write_csv(const char *path, const run_out *a, const run_out *b) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "train_fashion_mnist: cannot write %s: %s\n", path, strerror(errno));
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
        fprintf(stderr, "train_fashion_mnist: error writing %s\n", path);
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
        fprintf(stderr, "train_fashion_mnist: out of memory plotting\n");
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
    snprintf(title, sizeof title, "Fashion-MNIST MLP: training loss (%d-step moving average; "
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

int main(int argc, char **argv) {
    opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;
    o.tty = isatty(STDOUT_FILENO) != 0;
    /* GRADJIT_COMPILED_AUTOGRAD=1 selects the compiled mode like the flag
     * (read here, before this program sets the flag itself). */
    if (!o.both && !o.compiled && !o.compiled_step && gj_compiled_autograd_enabled())
        o.compiled = true;
    /* --ddp runs split: its gradients are averaged between backward and update */
    step_mode mode = o.compiled ? STEP_SPLIT_CA : o.compiled_step ? STEP_COMPILED
                     : o.ddp    ? STEP_SPLIT    : STEP_EAGER;
    if (o.ddp) {
        if (!(o.pg = gj_pg_init())) {
            fprintf(stderr, "train_fashion_mnist --ddp: %s\n", gj_last_error());
            return 1;
        }
        o.rank = gj_pg_rank(o.pg);
        o.size = gj_pg_size(o.pg);
        if (o.batch % o.size != 0) {
            fprintf(stderr, "train_fashion_mnist --ddp: --batch %d is not a multiple of the %d "
                            "ranks\n", o.batch, o.size);
            gj_pg_free(o.pg);
            return 2;
        }
        if (o.rank != 0) { /* rank 0 reports; the others only train */
            o.quiet = true;
            o.csv = o.png = o.save = NULL; /* rank 0 writes the files */
            if (!freopen("/dev/null", "w", stdout)) return 1;
        }
    }
    dataset tr = {0}, te = {0};
    int rc = load_split("train_fashion_mnist", "train", 60000, &tr);
    if (rc == 0)
        rc = load_split("train_fashion_mnist", "t10k", 10000, &te);
    if (rc != 0) {
        dataset_free(&tr);
        dataset_free(&te);
        gj_pg_free(o.pg);
        return rc;
    }
    if (o.batch > tr.n) {
        fprintf(stderr, "train_fashion_mnist: --batch %d exceeds the %lld training examples\n",
                o.batch, (long long)tr.n);
        dataset_free(&tr);
        dataset_free(&te);
        gj_pg_free(o.pg);
        return 2;
    }

    gj_set_num_threads(o.threads);
    gj_info info;
    gj_get_info(&info);
    if (!o.quiet)
        printf("gradjit %s, %d threads, BLAS %s | Fashion-MNIST %lld train / %lld test | "
               "MLP 784-%d-%d-%d GELU, AdamW lr %g, batch %d, %d epochs, seed %llu%s\n",
               info.version, info.num_threads, info.blas_core ? info.blas_core : "?",
               (long long)tr.n, (long long)te.n, H1, H2, K, o.lr, o.batch, o.epochs,
               (unsigned long long)o.seed, o.ddp ? "" : ", 1 process");
    if (o.ddp && !o.quiet)
        printf("DDP over %d MPI ranks: %d examples of every batch per rank, gradients "
               "averaged (gj_ddp)\n", o.size, o.batch / o.size);

    run_out a = {0}, b = {0};
    rc = 1;
    if (!o.both) {
        /* Ctrl-C: finish the step, save (--save), exit 130; a second one kills. */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_sigint;
        sa.sa_flags = SA_RESETHAND;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        rc = train(&o, mode, &tr, &te, &a);
        if (rc != 0)
            goto out;
        rc = 1;
        if (mode == STEP_SPLIT_CA)
            print_ca("compiled", &a.ca);
        if (mode == STEP_COMPILED)
            print_step("compiled step", &a.cs);
        printf("final test accuracy %.4f after %d epoch(s) (target %.2f within 3 epochs: %s)\n",
               a.acc[o.epochs - 1], o.epochs, TARGET_ACC,
               a.acc[o.epochs - 1] >= TARGET_ACC ? "met"
               : o.epochs >= 3                    ? "NOT met"
                                                  : "not reached yet");
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
           "within 3 epochs)\n",
           o.epochs, a.acc[o.epochs - 1], cname, b.acc[o.epochs - 1], TARGET_ACC);
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
    gj_pg_free(o.pg);
    return rc;
}
