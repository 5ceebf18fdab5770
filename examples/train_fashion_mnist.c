/*
 * train_fashion_mnist.c - trains an MLP classifier on Fashion-MNIST with
 * gradjit, eagerly or with compiled autograd (--compiled-autograd), or both
 * from the same seed for a side-by-side comparison (--both).
 *
 *   train_fashion_mnist [--compiled-autograd | --both] [--epochs N] [--batch N]
 *                       [--lr X] [--seed N] [--threads N] [--quiet]
 *                       [--csv FILE] [--png FILE]
 *
 * Output: a progress bar (on a terminal) with loss, examples/s and backward
 * ms; a line per epoch with test accuracy; the loss curve of every step as
 * CSV (--csv, default fashion_mnist_loss.csv; "-" for none) and as a PNG
 * plot (--png, default fashion_mnist_loss.png; "-" for none) with the loss
 * curve(s) and the test accuracy per epoch (examples/plot.h).
 *
 * Data: Debian's dataset-fashion-mnist package, /usr/share/datasets/
 * fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (IDX files,
 * big-endian header, read through zlib). Magic numbers, dimensions and label
 * range are checked; a missing file exits with code 2 and names the package.
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
 * before exit. With --both the two runs reseed everything (gj_manual_seed
 * and the shuffle generator), so their loss curves agree up to rounding; the
 * largest relative difference is printed.
 */
#include "gradjit.h"
#include "plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define DATA_DIR "/usr/share/datasets/fashion-mnist"
#define DATA_PACKAGE "dataset-fashion-mnist"
#define PIX_MEAN 0.2860f
#define PIX_STD 0.3530f
#define TARGET_ACC 0.87
#define EVAL_CHUNK 1000
#define SMOOTH 25 /* steps in the moving average of the plotted loss */
#define BAR_W 24  /* characters of the progress bar */

enum { ROWS = 28, COLS = 28, IN = ROWS * COLS, H1 = 512, H2 = 256, K = 10 };

/* ---------------------------------------------------------------- data */

typedef struct dataset {
    uint8_t *images; /* [n, 784] */
    uint8_t *labels; /* [n], values 0..9 */
    int64_t n;
} dataset;

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads exactly len bytes from g; 0 on success. */
static int gz_read_all(gzFile g, uint8_t *buf, size_t len) {
    while (len > 0) {
        unsigned chunk = len > (1u << 30) ? (1u << 30) : (unsigned)len;
        int got = gzread(g, buf, chunk);
        if (got <= 0)
            return -1;
        buf += got;
        len -= (size_t)got;
    }
    return 0;
}

/* Loads one IDX file: magic 0x801 (labels, 1 dim) or 0x803 (images, 3 dims
 * of n x 28 x 28). *out receives a malloc'd buffer of *n_items items.
 * Returns 0, 2 if the file is missing, or 1 (message printed) if damaged. */
static int load_idx(const char *path, uint32_t magic, uint8_t **out, int64_t *n_items) {
    *out = NULL;
    if (access(path, R_OK) != 0) {
        fprintf(stderr,
                "train_fashion_mnist: cannot read %s (%s).\n"
                "The Fashion-MNIST data comes from the Debian package \"%s\": "
                "apt install %s\n",
                path, strerror(errno), DATA_PACKAGE, DATA_PACKAGE);
        return 2;
    }
    gzFile g = gzopen(path, "rb");
    if (!g) {
        fprintf(stderr, "train_fashion_mnist: gzopen %s failed\n", path);
        return 1;
    }
    int ndim = (int)(magic & 0xff);
    uint8_t hdr[16];
    size_t hlen = 4 + 4 * (size_t)ndim;
    int rc = 1;
    if (gz_read_all(g, hdr, hlen) != 0) {
        fprintf(stderr, "train_fashion_mnist: %s: truncated IDX header\n", path);
        goto done;
    }
    if (be32(hdr) != magic) {
        fprintf(stderr, "train_fashion_mnist: %s: magic 0x%08x, expected 0x%08x\n", path,
                be32(hdr), magic);
        goto done;
    }
    int64_t n = be32(hdr + 4), per = 1;
    for (int d = 1; d < ndim; d++)
        per *= be32(hdr + 4 + 4 * d);
    if (ndim == 3 && (be32(hdr + 8) != ROWS || be32(hdr + 12) != COLS)) {
        fprintf(stderr, "train_fashion_mnist: %s: images are %ux%u, expected %dx%d\n", path,
                be32(hdr + 8), be32(hdr + 12), ROWS, COLS);
        goto done;
    }
    if (n <= 0 || n > 10000000) {
        fprintf(stderr, "train_fashion_mnist: %s: implausible item count %lld\n", path,
                (long long)n);
        goto done;
    }
    size_t bytes = (size_t)(n * per);
    *out = malloc(bytes);
    if (!*out) {
        fprintf(stderr, "train_fashion_mnist: out of memory reading %s\n", path);
        goto done;
    }
    if (gz_read_all(g, *out, bytes) != 0) {
        fprintf(stderr, "train_fashion_mnist: %s: truncated data (expected %zu bytes)\n", path,
                bytes);
        goto done;
    }
    uint8_t extra;
    if (gzread(g, &extra, 1) != 0) {
        fprintf(stderr, "train_fashion_mnist: %s: trailing bytes after %zu data bytes\n", path,
                bytes);
        goto done;
    }
    *n_items = n;
    rc = 0;
done:
    if (rc != 0) {
        free(*out);
        *out = NULL;
    }
    gzclose(g);
    return rc;
}

/* Loads split ("train" or "t10k") with expected_n items; 0, 1 or 2 as load_idx. */
static int load_split(const char *split, int64_t expected_n, dataset *d) {
    char ip[512], lp[512];
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", DATA_DIR, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", DATA_DIR, split);
    int64_t ni = 0, nl = 0;
    int rc = load_idx(ip, 0x00000803u, &d->images, &ni);
    if (rc == 0)
        rc = load_idx(lp, 0x00000801u, &d->labels, &nl);
    if (rc == 0 && (ni != expected_n || nl != expected_n)) {
        fprintf(stderr, "train_fashion_mnist: %s: %lld images and %lld labels, expected %lld\n",
                split, (long long)ni, (long long)nl, (long long)expected_n);
        rc = 1;
    }
    for (int64_t i = 0; rc == 0 && i < nl; i++)
        if (d->labels[i] >= K) {
            fprintf(stderr, "train_fashion_mnist: %s: label %u at %lld out of range\n", split,
                    d->labels[i], (long long)i);
            rc = 1;
        }
    d->n = ni;
    return rc;
}

static void dataset_free(dataset *d) {
    free(d->images);
    free(d->labels);
    *d = (dataset){0};
}

/* Standardised pixels of rows idx[0..n) (or rows first..first+n if idx is
 * NULL) into x [n, 784] and their labels into y [n]. */
static void gather(const dataset *d, const int64_t *idx, int64_t first, int64_t n, float *x,
                   int64_t *y) {
    const float scale = 1.0f / (255.0f * PIX_STD), shift = PIX_MEAN / PIX_STD;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = idx ? idx[first + i] : first + i;
        const uint8_t *p = d->images + r * IN;
        for (int j = 0; j < IN; j++)
            x[i * IN + j] = (float)p[j] * scale - shift;
        y[i] = d->labels[r];
    }
}

/* splitmix64: the shuffle generator. */
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void shuffle(int64_t *v, int64_t n, uint64_t *state) {
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(splitmix64(state) % (uint64_t)(i + 1));
        int64_t t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

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
    bool compiled, both, quiet, tty;
    int epochs, batch, threads;
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
    double *bwd_ms;      /* [epochs] mean backward ms */
    double *train_loss;  /* [epochs] mean training loss */
    gj_ca_stats ca;
} run_out;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void run_out_free(run_out *r) {
    free(r->loss);
    free(r->acc);
    free(r->epoch_s);
    free(r->bwd_ms);
    free(r->train_loss);
    *r = (run_out){0};
}

/* One full training run in the given mode; fills r. 0 on success, else 1
 * with a message on stderr. */
static int train(const opts *o, bool compiled, const dataset *tr, const dataset *te,
                 run_out *r) {
    const char *tag = compiled ? "compiled" : "eager";
    int64_t per_epoch = tr->n / o->batch;
    int rc = 1;
    model m;
    gj_optim *opt = NULL;
    int64_t *order = malloc((size_t)tr->n * sizeof *order);
    float *xb = malloc((size_t)o->batch * IN * sizeof *xb);
    int64_t *yb = malloc((size_t)o->batch * sizeof *yb);
    memset(r, 0, sizeof *r);
    r->n_steps = per_epoch * o->epochs;
    r->loss = calloc((size_t)r->n_steps, sizeof *r->loss);
    r->acc = calloc((size_t)o->epochs, sizeof *r->acc);
    r->epoch_s = calloc((size_t)o->epochs, sizeof *r->epoch_s);
    r->bwd_ms = calloc((size_t)o->epochs, sizeof *r->bwd_ms);
    r->train_loss = calloc((size_t)o->epochs, sizeof *r->train_loss);
    memset(&m, 0, sizeof m);
    if (!order || !xb || !yb || !r->loss || !r->acc || !r->epoch_s || !r->bwd_ms ||
        !r->train_loss) {
        fprintf(stderr, "train_fashion_mnist: out of memory\n");
        goto done;
    }

    gj_set_compiled_autograd(compiled);
    gj_compiled_autograd_reset_stats();
    gj_manual_seed(o->seed);
    uint64_t rng = o->seed;
    if (model_init(&m) != 0)
        goto gj_fail;
    gj_tensor *params[6];
    for (int i = 0; i < 3; i++) {
        params[2 * i] = m.l[i].weight;
        params[2 * i + 1] = m.l[i].bias;
    }
    if (!(opt = gj_adamw_new(6, params, o->lr, 0.9, 0.999, 1e-8, 0.01)))
        goto gj_fail;
    for (int64_t i = 0; i < tr->n; i++)
        order[i] = i;

    if (!o->quiet)
        printf("[%s] %lld steps per epoch of %d examples\n", tag, (long long)per_epoch, o->batch);
    int64_t step = 0;
    for (int e = 0; e < o->epochs; e++) {
        shuffle(order, tr->n, &rng);
        double t_epoch = now_s(), bwd_total = 0.0, loss_total = 0.0;
        for (int64_t b = 0; b < per_epoch; b++, step++) {
            gather(tr, order, b * o->batch, o->batch, xb, yb);
            gj_scope_push();
            int64_t xs[2] = {o->batch, IN}, ys = o->batch;
            gj_tensor *x = gj_from_data(GJ_F32, 2, xs, xb);
            gj_tensor *y = gj_from_data(GJ_I64, 1, &ys, yb);
            gj_tensor *logits = x && y ? model_forward(&m, x) : NULL;
            gj_tensor *loss = logits ? gj_cross_entropy(logits, y) : NULL;
            int ok = loss != NULL;
            double t0 = now_s();
            ok = ok && gj_backward(loss, NULL) == 0;
            double bwd = (now_s() - t0) * 1e3;
            ok = ok && gj_optim_step(opt) == 0;
            double lv = ok ? gj_tensor_item(loss) : NAN;
            gj_optim_zero_grad(opt);
            gj_scope_pop();
            if (!ok)
                goto gj_fail;
            r->loss[step] = lv;
            bwd_total += bwd;
            loss_total += lv;
            if (o->tty && !o->quiet && (b % 10 == 9 || b + 1 == per_epoch)) {
                double el = now_s() - t_epoch;
                char bar[BAR_W + 1];
                int fill = (int)((b + 1) * BAR_W / per_epoch);
                for (int k = 0; k < BAR_W; k++)
                    bar[k] = k < fill ? '#' : '.';
                bar[BAR_W] = 0;
                printf("\r[%s] epoch %d/%d [%s] %lld/%lld loss %.4f  %.0f examples/s  "
                       "backward %.2f ms ",
                       tag, e + 1, o->epochs, bar, (long long)(b + 1), (long long)per_epoch, lv,
                       (double)((b + 1) * o->batch) / el, bwd_total / (double)(b + 1));
                fflush(stdout);
            }
        }
        r->epoch_s[e] = now_s() - t_epoch;
        r->bwd_ms[e] = bwd_total / (double)per_epoch;
        r->train_loss[e] = loss_total / (double)per_epoch;
        r->acc[e] = evaluate(&m, te);
        if (r->acc[e] < 0)
            goto gj_fail;
        if (o->tty && !o->quiet)
            printf("\r%*s\r", 120, "");
        if (!o->quiet)
            printf("[%s] epoch %d/%d: train loss %.4f, test accuracy %.4f, %.1f s "
                   "(%.0f examples/s), backward %.2f ms/step\n",
                   tag, e + 1, o->epochs, r->train_loss[e], r->acc[e], r->epoch_s[e],
                   (double)(per_epoch * o->batch) / r->epoch_s[e], r->bwd_ms[e]);
        fflush(stdout);
    }
    gj_compiled_autograd_stats(&r->ca);
    rc = 0;
    goto done;
gj_fail:
    fprintf(stderr, "train_fashion_mnist (%s): %s\n", tag, gj_last_error());
done:
    gj_optim_free(opt);
    model_free(&m);
    gj_set_compiled_autograd(false);
    free(order);
    free(xb);
    free(yb);
    return rc;
}

/* ---------------------------------------------------------------- main */

static void usage(FILE *f) {
    fprintf(f, "usage: train_fashion_mnist [--compiled-autograd | --both] [--epochs N] "
               "[--batch N] [--lr X]\n"
               "                           [--seed N] [--threads N] [--quiet] [--csv FILE] "
               "[--png FILE]\n"
               "  --csv/--png: loss curve files (defaults fashion_mnist_loss.csv/.png; "
               "\"-\": none)\n");
}

static int parse_opts(int argc, char **argv, opts *o) {
    *o = (opts){.epochs = 3,
                .batch = 128,
                .lr = 1e-3,
                .seed = 42,
                .csv = "fashion_mnist_loss.csv",
                .png = "fashion_mnist_loss.png"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(a, "--compiled-autograd")) {
            o->compiled = true;
        } else if (!strcmp(a, "--both")) {
            o->both = true;
        } else if (!strcmp(a, "--quiet")) {
            o->quiet = true;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else if (!v) {
            fprintf(stderr, "train_fashion_mnist: unknown option or missing value: %s\n", a);
            return -1;
        } else {
            i++;
            errno = 0;
            if (!strcmp(a, "--epochs")) {
                long n = strtol(v, &end, 10);
                if (*end || errno || n < 1 || n > 1000)
                    goto bad;
                o->epochs = (int)n;
            } else if (!strcmp(a, "--batch")) {
                long n = strtol(v, &end, 10);
                if (*end || errno || n < 1 || n > 60000)
                    goto bad;
                o->batch = (int)n;
            } else if (!strcmp(a, "--threads")) {
                long n = strtol(v, &end, 10);
                if (*end || errno || n < 0 || n > 4096)
                    goto bad;
                o->threads = (int)n;
            } else if (!strcmp(a, "--lr")) {
                o->lr = strtod(v, &end);
                if (*end || errno || !(o->lr > 0) || !isfinite(o->lr))
                    goto bad;
            } else if (!strcmp(a, "--seed")) {
                o->seed = strtoull(v, &end, 10);
                if (*end || errno)
                    goto bad;
            } else if (!strcmp(a, "--csv")) {
                o->csv = strcmp(v, "-") ? v : NULL;
            } else if (!strcmp(a, "--png")) {
                o->png = strcmp(v, "-") ? v : NULL;
            } else {
                fprintf(stderr, "train_fashion_mnist: unknown option %s\n", a);
                return -1;
            }
            continue;
        bad:
            fprintf(stderr, "train_fashion_mnist: bad value for %s: '%s'\n", a, v);
            return -1;
        }
    }
    if (o->both && o->compiled) {
        fprintf(stderr, "train_fashion_mnist: --both already runs the compiled mode\n");
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

/* Moving average of v[0..n) over the last `w` values (fewer at the start). */
static void smooth(const double *v, int64_t n, int w, double *out) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += v[i];
        if (i >= w)
            acc -= v[i - w];
        out[i] = acc / (double)(i < w ? i + 1 : w);
    }
}

/* The loss curve(s) (moving average; the raw eager loss faint behind) and
 * the test accuracy per epoch, as a PNG. b may be NULL (one run). */
static int write_png(const char *path, const opts *o, const run_out *a, const run_out *b,
                     bool a_compiled) {
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
    const char *na = b ? "eager" : a_compiled ? "compiled" : "eager";
    plot_series loss[3] = {
        {NULL, NULL, a->loss, (int)n, 0xd9d9d9u, 1, 0},
        {na, NULL, sa, (int)n, b ? 0x9ecae1u : 0x08519cu, b ? 5 : 2, 0},
        {"compiled", NULL, sb, (int)n, 0x08519cu, 1, 0},
    };
    char title[160];
    snprintf(title, sizeof title, "Fashion-MNIST MLP: training loss (%d-step moving average; "
             "raw in grey)", SMOOTH);
    plot_line_panel(&im, 0, 10, 1000, 520, title, "step", "cross-entropy", loss, b ? 3 : 2, 0, 0);
    plot_series acc[2] = {
        {na, ep, acc_a, o->epochs, b ? 0x9ecae1u : 0x08519cu, b ? 7 : 3, 13},
        {"compiled", ep, acc_b, o->epochs, 0x08519cu, 2, 7},
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

static void print_ca(const char *tag, const gj_ca_stats *c) {
    printf("[%s] compiled autograd: %lld backwards, %lld compiles (%.1f ms), %lld memory hits, "
           "%lld disk hits, %lld fallbacks\n",
           tag, (long long)c->backwards, (long long)c->compiles, c->compile_ms,
           (long long)c->mem_hits, (long long)c->disk_hits, (long long)c->fallbacks);
    if (c->backwards == 0)
        printf("[%s] WARNING: no backward went through the compiled path\n", tag);
    if (c->fallbacks > 0)
        printf("[%s] WARNING: %lld backwards fell back to the eager engine\n", tag,
               (long long)c->fallbacks);
}

int main(int argc, char **argv) {
    opts o;
    if (parse_opts(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    o.tty = isatty(STDOUT_FILENO) != 0;
    /* GRADJIT_COMPILED_AUTOGRAD=1 selects the compiled mode like the flag
     * (read here, before this program sets the flag itself). */
    if (!o.both && !o.compiled && gj_compiled_autograd_enabled())
        o.compiled = true;
    dataset tr = {0}, te = {0};
    int rc = load_split("train", 60000, &tr);
    if (rc == 0)
        rc = load_split("t10k", 10000, &te);
    if (rc != 0) {
        dataset_free(&tr);
        dataset_free(&te);
        return rc;
    }
    if (o.batch > tr.n) {
        fprintf(stderr, "train_fashion_mnist: --batch %d exceeds the %lld training examples\n",
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
               "MLP 784-%d-%d-%d GELU, AdamW lr %g, batch %d, %d epochs, seed %llu\n",
               info.version, info.num_threads, info.blas_core ? info.blas_core : "?",
               (long long)tr.n, (long long)te.n, H1, H2, K, o.lr, o.batch, o.epochs,
               (unsigned long long)o.seed);

    run_out a = {0}, b = {0};
    rc = 1;
    if (!o.both) {
        if (train(&o, o.compiled, &tr, &te, &a) != 0)
            goto out;
        if (o.compiled)
            print_ca("compiled", &a.ca);
        printf("final test accuracy %.4f after %d epoch(s) (target %.2f within 3 epochs: %s)\n",
               a.acc[o.epochs - 1], o.epochs, TARGET_ACC,
               a.acc[o.epochs - 1] >= TARGET_ACC ? "met"
               : o.epochs >= 3                    ? "NOT met"
                                                  : "not reached yet");
        if (o.csv && write_csv(o.csv, &a, NULL) != 0)
            goto out;
        if (o.png && write_png(o.png, &o, &a, NULL, o.compiled) != 0)
            goto out;
        if (!o.quiet && (o.csv || o.png))
            printf("wrote%s%s%s%s\n", o.csv ? " " : "", o.csv ? o.csv : "", o.png ? " " : "",
                   o.png ? o.png : "");
        rc = 0;
        goto out;
    }

    if (train(&o, false, &tr, &te, &a) != 0 || train(&o, true, &tr, &te, &b) != 0)
        goto out;
    printf("\n%5s  %10s  %10s  %12s  %12s  %9s  %9s\n", "epoch", "acc eager", "acc compl",
           "bwd ms eager", "bwd ms compl", "s eager", "s compl");
    for (int e = 0; e < o.epochs; e++)
        printf("%5d  %10.4f  %10.4f  %12.3f  %12.3f  %9.1f  %9.1f\n", e + 1, a.acc[e], b.acc[e],
               a.bwd_ms[e], b.bwd_ms[e], a.epoch_s[e], b.epoch_s[e]);
    double maxrel = 0.0;
    for (int64_t s = 0; s < a.n_steps; s++) {
        double rel = fabs(b.loss[s] - a.loss[s]) / fmax(fabs(a.loss[s]), 1e-30);
        if (!(rel <= maxrel))
            maxrel = rel;
    }
    print_ca("compiled", &b.ca);
    printf("max relative loss-curve difference (compiled vs eager, %lld steps): %.3e\n",
           (long long)a.n_steps, maxrel);
    printf("final test accuracy after %d epoch(s): eager %.4f, compiled %.4f (target %.2f "
           "within 3 epochs)\n",
           o.epochs, a.acc[o.epochs - 1], b.acc[o.epochs - 1], TARGET_ACC);
    if (o.csv && write_csv(o.csv, &a, &b) != 0)
        goto out;
    if (o.png && write_png(o.png, &o, &a, &b, false) != 0)
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
