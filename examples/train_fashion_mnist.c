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
 * The step: its forward is one step function (fashion_data.h's
 * fashion_loss: this file's model_forward, then the cross-entropy of the
 * batch's labels), run by examples/common.h's stepper: eagerly through gj_step (the default), through gj_step compiled
 * (--compiled-step: forward, backward and the AdamW update as one program
 * after the first step), or as forward, gj_backward with compiled autograd
 * and gj_optim_step (--compiled-autograd). With --ddp the gradients are
 * averaged over the ranks between backward and update in every mode (the
 * compiled step does it inside its program, while the backward goes on).
 * Every mode gives the same bits.
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
 * that never stopped (--epochs may grow). The precision (--bf16) and --lr
 * are recorded too (trainer.h): a checkpoint resumes only with its own.
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
 * The run itself (epochs, steps, progress, --both's pairing, checkpoints'
 * common part, the CSV) is examples/trainer.h's; the Fashion-MNIST
 * classifier's part of it (batches, test accuracy, the epoch lines, the
 * --both table, the PNG) is examples/fashion_data.h's, shared with
 * train_fashion_cnn.c. This file holds the model, its flags and checkpoint
 * fields, and its target.
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

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PROG "train_fashion_mnist"
#define TARGET_ACC 0.87
#define EVAL_CHUNK 1000

enum { ROWS = 28, COLS = 28, IN = ROWS * COLS, H1 = 512, H2 = 256, K = 10 };

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

/* logits [n, 10] of x [n, 784] of the model ctx; scope-owned new
 * reference or NULL. */
static gj_tensor *model_forward(void *ctx, gj_tensor *x) {
    model *m = ctx;
    gj_tensor *h = gj_gelu(gj_linear_forward(&m->l[0], x)); /* [n, 512] */
    h = h ? gj_gelu(gj_linear_forward(&m->l[1], h)) : NULL;  /* [n, 256] */
    return h ? gj_linear_forward(&m->l[2], h) : NULL;        /* [n, 10] */
}

/* ------------------------------------------------------------ training */

typedef struct opts {
    train_flags f;
    bool ddp;
    int zero;        /* --zero 1|2|3: ZeRO's stage (with --ddp) */
    gj_pg *pg;       /* --ddp: the world group (launched with mpirun) */
    int rank, size;  /* 0 and 1 without --ddp */
} opts;

/* One training run (trainer.h, fashion_data.h): the classifier's run, the
 * model and with --ddp the gradients' averaging. --both keeps two. */
typedef struct mlp_run {
    fashion_run fr;
    model m;
    gj_ddp *ddp; /* --ddp: gradients averaged over the ranks */
} mlp_run;

/* The run's model from the seed, its AdamW, the classifier's part (the
 * step: fashion_loss of model_forward) and with --ddp the averaging
 * (train_def's init). */
static int mlp_init(train_run *r) {
    mlp_run *t = (mlp_run *)r;
    const opts *o = r->def->opts;
    gj_tensor *params[6];
    if (model_init(&t->m) != 0)
        return -1;
    for (int i = 0; i < 3; i++) {
        params[2 * i] = t->m.l[i].weight;
        params[2 * i + 1] = t->m.l[i].bias;
    }
    gj_ddp_options dopt = {.zero = o->zero};
    if (o->ddp && !(t->ddp = gj_ddp_new(o->pg, 6, params, &dopt)))
        return -1;
    gj_tensor *const *opt_params = params; /* ZeRO: this rank's shards */
    int n_opt = o->zero ? gj_ddp_shards(t->ddp, &opt_params) : 6;
    if (n_opt < 0 || !(r->opt = gj_adamw_new(n_opt, opt_params, o->f.lr, 0.9, 0.999, 1e-8, 0.01)))
        return -1;
    if (t->ddp && train_print_model_state(o->pg, o->zero, 6, params, n_opt, opt_params) != 0)
        return -1;
    if (o->zero) {
        r->zero = t->ddp;
        r->no_write = o->rank != 0;
        r->zero3 = o->zero == 3;
    }
    int rc = fashion_run_init(&t->fr, o->rank, o->size, EVAL_CHUNK, model_forward, &t->m);
    if (rc == 0 && t->ddp) { /* the gradients averaged before the update */
        rc = stepper_set_ddp(&r->st, t->ddp);
        r->pg = o->pg; /* and the loss averaged too */
    }
    return rc;
}

static void mlp_free(train_run *r) {
    mlp_run *t = (mlp_run *)r;
    gj_ddp_free(t->ddp);
    t->ddp = NULL;
    model_free(&t->m);
    fashion_run_free(&t->fr);
}

/* ---------------------------------------------------------- checkpoints */

static const char *const LAYER_NAMES[3] = {"fc1", "fc2", "fc3"};

/* The model's parameters into sd under stable names (references to the
 * live tensors): train_def's model_dict. 0 or -1. */
static int mlp_dict(train_run *r, gj_state_dict *sd) {
    model *m = &((mlp_run *)r)->m;
    for (int i = 0; i < 3; i++)
        if (gj_linear_state_dict_add(&m->l[i], sd, LAYER_NAMES[i]) != 0)
            return -1;
    return 0;
}

/* The run's part of a checkpoint (trainer.h's train_save): its position
 * (batch r->batch of epoch r->epoch, whose order is drawn if r->begun),
 * the shuffle, this epoch's totals and order, the curves so far. 0 or -1. */
static int mlp_save(train_run *r, gj_state_dict *sd) {
    const fashion_run *fr = (const fashion_run *)r;
    const train_flags *f = r->def->f;
    int e = r->epoch, rc = 0;
    rc = rc || meta_i64(sd, "train.epoch", e) || meta_i64(sd, "train.batch", r->batch);
    rc = rc || meta_i64(sd, "train.shuffled", r->begun) || meta_i64(sd, "train.step", r->step);
    rc = rc || meta_u64(sd, "train.shuffle_rng", r->rng);
    rc = rc || meta_i64(sd, "train.batch_size", f->batch);
    rc = rc || meta_i64(sd, "train.seed", (int64_t)f->seed);
    rc = rc || meta_f64(sd, "train.train_s", r->train_s);
    rc = rc || meta_f64(sd, "train.bwd_total", r->bwd_total);
    rc = rc || meta_f64(sd, "train.step_total", r->step_total);
    rc = rc || meta_f64(sd, "train.loss_total", r->loss_total);
    rc = rc || ckpt_add_array(sd, "train.order", GJ_I64, fashion_data(r)->train.n, fr->order);
    rc = rc || ckpt_add_array(sd, "train.loss", GJ_F64, r->step, r->loss);
    rc = rc || ckpt_add_array(sd, "train.acc", GJ_F64, e, fr->acc);
    rc = rc || ckpt_add_array(sd, "train.epoch_s", GJ_F64, e, r->epoch_s);
    rc = rc || ckpt_add_array(sd, "train.bwd_ms", GJ_F64, e, r->bwd_ms);
    rc = rc || ckpt_add_array(sd, "train.step_ms", GJ_F64, e, r->step_ms);
    rc = rc || ckpt_add_array(sd, "train.train_loss", GJ_F64, e, r->train_loss);
    return rc ? -1 : 0;
}

/* Reads mlp_save's part back into a fresh run (trainer.h's train_resume),
 * checking it against this run's settings. 0, or 1 with a message. */
static int mlp_resume(train_run *r, ckpt_reader *rd, const char *path) {
    fashion_run *fr = (fashion_run *)r;
    const train_def *d = r->def;
    const train_flags *f = d->f;
    int64_t n = fashion_data(r)->train.n;
    int64_t e, b, sh, step, bs, seed;
    uint64_t rng;
    snprintf(rd->where, sizeof rd->where, PROG ": checkpoint");
    if (ckpt_int(rd, "train.batch_size", 1, INT64_MAX, &bs) ||
        ckpt_int(rd, "train.seed", INT64_MIN, INT64_MAX, &seed) ||
        ckpt_int(rd, "train.epoch", 0, d->epochs, &e) ||
        ckpt_int(rd, "train.batch", 0, d->per_epoch - 1, &b) ||
        ckpt_int(rd, "train.shuffled", 0, 1, &sh) ||
        ckpt_int(rd, "train.step", 0, d->per_epoch * d->epochs, &step))
        return 1;
    if (bs != f->batch || (uint64_t)seed != f->seed) {
        fprintf(stderr, PROG ": %s was saved with --batch %lld --seed %llu; resume with the same "
                        "values (this run: --batch %d --seed %llu)\n",
                path, (long long)bs, (unsigned long long)seed, f->batch,
                (unsigned long long)f->seed);
        return 1;
    }
    if (step != e * d->per_epoch + (sh ? b : 0)) {
        fprintf(stderr, PROG ": %s: step %lld does not match epoch %lld batch %lld\n", path,
                (long long)step, (long long)e, (long long)b);
        return 1;
    }
    if (meta_get_u64(rd->sd, "train.shuffle_rng", &rng) != 0) {
        fprintf(stderr, PROG ": %s: bad train.shuffle_rng\n", path);
        return 1;
    }
    if (ckpt_num(rd, "train.train_s", &r->train_s) ||
        ckpt_num(rd, "train.bwd_total", &r->bwd_total) ||
        ckpt_num(rd, "train.loss_total", &r->loss_total) ||
        ckpt_array(rd, "train.order", GJ_I64, n, fr->order) ||
        ckpt_array(rd, "train.loss", GJ_F64, step, r->loss) ||
        ckpt_array(rd, "train.acc", GJ_F64, e, fr->acc) ||
        ckpt_array(rd, "train.epoch_s", GJ_F64, e, r->epoch_s) ||
        ckpt_array(rd, "train.bwd_ms", GJ_F64, e, r->bwd_ms) ||
        /* step times: absent from checkpoints of older versions */
        ckpt_num_opt(rd, "train.step_total", &r->step_total) ||
        (gj_state_dict_get(rd->sd, "train.step_ms") &&
         ckpt_array(rd, "train.step_ms", GJ_F64, e, r->step_ms)) ||
        ckpt_array(rd, "train.train_loss", GJ_F64, e, r->train_loss))
        return 1;
    for (int64_t i = 0; i < n; i++)
        if (fr->order[i] < 0 || fr->order[i] >= n) {
            fprintf(stderr, PROG ": %s: train.order holds %lld\n", path, (long long)fr->order[i]);
            return 1;
        }
    r->rng = rng;
    r->step = step;
    r->epoch = (int)e;
    r->batch = sh ? b : 0;
    r->begun = sh != 0;
    return 0;
}

/* The results (train_def's report): the counters or the --both table, the
 * final accuracy against the target, the files. */
static int mlp_report(const train_run *a, const train_run *c, double (*q)[3], double (*fq)[3]) {
    int epochs = a->def->epochs;
    double acc = ((const fashion_run *)a)->acc[epochs - 1];
    fashion_results(a, c, q);
    if (!c)
        printf("final test accuracy %.4f after %d epoch(s) (target %.2f within 3 epochs: %s)\n",
               acc, epochs, TARGET_ACC,
               acc >= TARGET_ACC ? "met" : epochs >= 3 ? "NOT met" : "not reached yet");
    else
        printf("final test accuracy after %d epoch(s): eager %.4f, %s %.4f (target %.2f within 3 "
               "epochs)\n",
               epochs, acc, c->tag, ((const fashion_run *)c)->acc[epochs - 1], TARGET_ACC);
    const opts *o = a->def->opts;
    if (o->ddp) { /* (each rank's own: rank 0's printed) */
        gj_mem m;
        gj_mem_stats(&m);
        printf("peak tensor memory %.1f MiB (held at most %.1f MiB)\n",
               (double)m.peak_bytes / 1048576.0, (double)m.held_peak_bytes / 1048576.0);
    }
    return fashion_write(a, c, "MLP");
}

/* ---------------------------------------------------------------- main */

/* The options (examples/args.h). 0, 1 (--help/--version printed) or -1. */
static int parse_opts(int argc, char **argv, opts *o) {
    *o = (opts){.f = {.epochs = 3,
                      .batch = 128,
                      .lr = 1e-3,
                      .seed = 42,
                      .csv = "fashion_mnist_loss.csv",
                      .png = "fashion_mnist_loss.png"}};
    train_flags *f = &o->f;
    const arg_spec specs[] = {
        TRAIN_ARG_COMPILED(f),
        TRAIN_ARG_BF16(f),
        ARG_OPT("both", ARG_FLAG, &f->both, 0, 0,
         "train eager and compiled side by side (steps in turn, ABBA) and print paired ratios: "
         "compiled autograd's backward, or with --compiled-step the compiled step's whole step"),
        FASHION_ARGS(f),
        TRAIN_ARG_QUIET(f),
        TRAIN_ARG_CSV(f),
        ARG_OPT("png", ARG_FILE, &f->png, 0, 0, "loss curve and accuracy as PNG (\"-\": none)"),
        TRAIN_ARG_SAVE(f),
        ARG_OPT("resume", ARG_FILE, &f->resume, 0, 0,
         "continue a saved run bit-identically (same --batch, --seed, --lr, --bf16, --threads)"),
        TRAIN_ARG_STOP_AFTER(f),
        ARG_OPT("ddp", ARG_FLAG, &o->ddp, 0, 0,
         "data parallel over MPI ranks (mpirun -np N ... --ddp): each rank takes 1/N of every "
         "batch, gradients are averaged"),
        TRAIN_ARG_ZERO(&o->zero),
    };
    int rc = args_parse(PROG,
                        "Trains a 784-512-256-10 GELU MLP on Fashion-MNIST (Debian's "
                        "dataset-fashion-mnist), eager, with compiled autograd or with the "
                        "compiled step.",
                        argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (rc != 0) return rc;
    o->size = 1;
    if (train_flags_check(PROG, f) != 0)
        return -1;
    if (train_zero_check(PROG, o->ddp, o->zero) != 0)
        return -1;
    return train_flags_check_one_run(PROG, f);
}

int main(int argc, char **argv) {
    opts o;
    step_mode mode;
    int rc = train_start(parse_opts(argc, argv, &o), &o.f, &mode);
    if (rc >= 0) return rc;
    if (o.ddp) {
        if (train_ddp_start(PROG, &o.pg, &o.rank, &o.size) != 0)
            return 1;
        if (o.f.batch % o.size != 0) {
            fprintf(stderr, PROG " --ddp: --batch %d is not a multiple of the %d ranks\n",
                    o.f.batch, o.size);
            gj_pg_free(o.pg);
            return 2;
        }
        if (o.rank != 0) { /* rank 0 reports; the others only train */
            o.f.quiet = true;
            o.f.csv = o.f.png = NULL; /* rank 0 writes the files */
            if (!o.zero) /* (ZeRO: every rank gathers the checkpoint, rank 0 writes it) */
                o.f.save = NULL;
        }
    }
    fashion_splits data = {0};
    rc = fashion_load(PROG, o.f.batch, &data);
    if (rc != 0) {
        gj_pg_free(o.pg);
        return rc;
    }

    if (train_banner(&o.f))
        printf("Fashion-MNIST %lld train / %lld test | MLP 784-%d-%d-%d GELU, AdamW lr %g, "
               "batch %d, %d epochs, seed %llu%s\n",
               (long long)data.train.n, (long long)data.test.n, H1, H2, K, o.f.lr, o.f.batch,
               o.f.epochs, (unsigned long long)o.f.seed, o.ddp ? "" : ", 1 process");
    if (o.ddp && !o.f.quiet)
        printf("DDP over %d MPI ranks: %d examples of every batch per rank, gradients "
               "averaged (gj_ddp)\n", o.size, o.f.batch / o.size);

    train_def d = fashion_def(PROG, &o.f, &o, &data, sizeof(mlp_run), data.train.n / o.f.batch,
                              mlp_init, mlp_free);
    d.model_dict = mlp_dict;
    d.save = mlp_save;
    d.resume = mlp_resume;
    d.report = mlp_report;
    rc = train_main(&d, mode);
    fashion_free(&data);
    gj_pg_free(o.pg);
    return rc;
}
