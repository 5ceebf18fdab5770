/* SPDX-License-Identifier: MIT */
/*
 * train_charlm.c - trains a small character-level transformer language model
 * with gradjit, eagerly, with compiled autograd (--compiled-autograd) or
 * with the compiled training step (--compiled-step), or eager and compiled
 * from the same seed for a side-by-side comparison (--both; --both
 * --compiled-step), then prints the loss it reached and a sample of
 * generated text.
 *
 *   train_charlm [--compiled-autograd | --compiled-step] [--both] [--steps N | --epochs N]
 *                [--batch N] [--ctx T] [--vary-ctx] [--lr X] [--seed N] [--threads N]
 *                [--quiet] [--text PATH]... [--sample N] [--temperature X]
 *                [--csv FILE] [--png FILE]
 *                [--save FILE] [--resume FILE] [--stop-after N]
 *
 * Data: by default the license texts that Debian's base-files package
 * installs on every machine, /usr/share/common-licenses/ (every regular
 * file once, symlinks such as GPL -> GPL-3 resolved, in name order); --text
 * replaces that with the given files. The bytes are the characters; the
 * vocabulary is the set of distinct bytes. The last 10% of the text is held
 * out for validation. A step trains on --batch windows of --ctx characters
 * at random offsets (splitmix64 from --seed); an epoch is as many steps as
 * the training text holds windows (training chars / (batch * ctx)). With
 * --vary-ctx each training step's context length is drawn from
 * [max(2, ctx/4), ctx] (the same sequence in both modes of --both): with
 * compiled autograd or the compiled step, dynamic shapes bind the new
 * lengths to symbolic kernels instead of compiling each (validation keeps
 * --ctx).
 *
 * Model (legend: B batch, T context, C = 128 channels, H = 4 heads, V vocab):
 * token embedding [V, C] + learned position embedding [T, C]; two pre-norm
 * causal transformer blocks exactly like W3 of docs/benchmarks.md (h = x +
 * Attn(LN(x)), y = h + MLP(LN(h)), fused qkv Linear(C, 3C), softmax(q k^T /
 * sqrt(C/H)) with a causal mask, out Linear(C, C), MLP Linear(C, 4C) ->
 * GELU(tanh) -> Linear(4C, C)); final LayerNorm; LM head Linear(C, V);
 * cross-entropy over all B*T positions. AdamW (0.9/0.999, eps 1e-8, weight
 * decay 0.01), learning rate warmed up linearly over the first 5% of the
 * steps, then cosine-decayed to 10% of --lr.
 *
 * The step: its forward is one step function (lm_loss: the model, with its
 * position ids and causal mask made once, then the batch's inputs and
 * targets to the loss), run by examples/common.h's stepper: eagerly through
 * gj_step (the default), through gj_step compiled (--compiled-step:
 * forward, backward and the AdamW update as one program; the learning rate
 * of the schedule is read at every run), or as forward, gj_backward with
 * compiled autograd and gj_optim_step (--compiled-autograd). Every mode
 * gives the same bits. The run around it (steps, progress, --both's
 * pairing, checkpoints' common part, the CSV) is examples/trainer.h's, as
 * one epoch of --steps steps; this file holds the text, the model, the
 * flags and what is particular to them (batches, schedule, validation,
 * sample, its checkpoint fields, its summary and plot).
 *
 * Output: a progress bar (on a terminal) with loss, examples/s (windows/s)
 * and backward ms (whole step ms in gj_step's modes); validation loss
 * every 50 steps and at the end; the unigram entropy of the training text
 * (the loss of the best model that ignores context) next to the loss
 * reached; a sample of --sample generated characters (temperature
 * --temperature, from the prompt "The "); the loss curve as CSV and PNG
 * (defaults charlm_loss.csv/.png, "-" for none).
 *
 * Checkpoints (not with --both): --save FILE writes a safetensors file at
 * the end, and when the run stops early: on SIGINT (Ctrl-C) the step under
 * way finishes, the file is written and the program exits with status 130
 * (a second Ctrl-C kills it); --stop-after N stops so after N steps of this
 * run. --resume FILE continues: parameters ("tok_emb.weight",
 * "blocks.0.attn.qkv.weight", ...), AdamW state, RNG, the batch generator,
 * the step and the loss curve so far are restored, so with the same
 * --steps/--epochs, --batch, --ctx, --vary-ctx, --seed, text and --threads
 * the loss curve, model and sample are bit-identical to a run that never
 * stopped. The precision (--bf16) and --lr are recorded too (trainer.h): a
 * checkpoint resumes only with its own.
 *
 * Invariants: every training step, evaluation batch and generated character
 * runs inside gj_scope_push/pop; model, optimizer and text are released
 * before exit. With --both the two runs start from the same seed (model,
 * batch and sampling generators) and advance one step each in turn, in ABBA
 * order, so their timings share the machine's state; their loss curves
 * must be identical (printed: "identical", or the first step that differs)
 * and the median per-step ratios are printed: forward and backward with
 * compiled autograd, the whole step with --compiled-step. Without a
 * terminal, progress is printed at every tenth of the run.
 */
#include "gradjit.h"
#include "args.h"
#include "common.h"
#include "plot.h"
#include "trainer.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PROG "train_charlm"
#define DEFAULT_DIR "/usr/share/common-licenses"
#define DEFAULT_PACKAGE "base-files"
#define MAX_TEXTS 64
#define N_LAYER 2
#define N_EMBD 128
#define N_HEAD 4
#define EVAL_EVERY 50
#define EVAL_BATCHES 16
#define EVAL_SEED 0x5eedu
#define SMOOTH 10
#define PROMPT "The "

/* ---------------------------------------------------------------- text */

typedef struct corpus {
    uint8_t *ids;    /* [n] token id of every character */
    int64_t n;       /* characters in total */
    int64_t n_train; /* the first n_train are training text, the rest validation */
    int vocab;
    uint8_t byte_of[256]; /* id -> byte */
    int id_of[256];       /* byte -> id, -1 if absent */
    int n_files;
} corpus;

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Appends the bytes of path to *buf (capacity *cap, length *len). 0 or -1. */
static int append_file(const char *path, uint8_t **buf, size_t *len, size_t *cap) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "train_charlm: cannot read %s: %s\n", path, strerror(errno));
        return -1;
    }
    int rc = 0;
    for (;;) {
        if (*len + 65536 > *cap) {
            size_t nc = *cap ? *cap * 2 : 1 << 20;
            uint8_t *t = realloc(*buf, nc);
            if (!t) {
                fprintf(stderr, "train_charlm: out of memory reading %s\n", path);
                rc = -1;
                break;
            }
            *buf = t;
            *cap = nc;
        }
        size_t got = fread(*buf + *len, 1, 65536, f);
        *len += got;
        if (got < 65536) {
            if (ferror(f)) {
                fprintf(stderr, "train_charlm: error reading %s\n", path);
                rc = -1;
            }
            break;
        }
    }
    fclose(f);
    return rc;
}

/* The regular files of dir (symlinks resolved, each target once), sorted,
 * as malloc'd absolute paths in out[0..*n). 0, 2 if dir is missing, or -1. */
static int list_dir(const char *dir, char **out, int *n) {
    DIR *d = opendir(dir);
    *n = 0;
    if (!d) {
        fprintf(stderr,
                "train_charlm: cannot open %s (%s).\nThe default text comes from the Debian "
                "package \"%s\" (installed on every Debian system), or pass --text FILE.\n",
                dir, strerror(errno), DEFAULT_PACKAGE);
        return 2;
    }
    char *names[MAX_TEXTS];
    int k = 0;
    struct dirent *e;
    while ((e = readdir(d)) && k < MAX_TEXTS) {
        if (e->d_name[0] == '.')
            continue;
        char path[PATH_MAX], real[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (!realpath(path, real) || stat(real, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        names[k] = strdup(real);
        if (!names[k])
            break;
        k++;
    }
    closedir(d);
    qsort(names, (size_t)k, sizeof *names, cmp_str);
    for (int i = 0; i < k; i++) {
        if (*n > 0 && !strcmp(out[*n - 1], names[i])) {
            free(names[i]); /* a second link to the same file */
            continue;
        }
        out[(*n)++] = names[i];
    }
    return 0;
}

/* Loads the given files (or the default directory when n_paths == 0) into
 * c. 0 on success, 2 if the default text is missing, 1 on other errors. */
static int corpus_load(const char *const *paths, int n_paths, corpus *c) {
    char *files[MAX_TEXTS];
    int n_files = 0, rc = 1;
    uint8_t *buf = NULL;
    size_t len = 0, cap = 0;
    memset(c, 0, sizeof *c);
    if (n_paths == 0) {
        int lr = list_dir(DEFAULT_DIR, files, &n_files);
        if (lr != 0)
            return lr;
    } else {
        for (int i = 0; i < n_paths; i++)
            if ((files[n_files] = strdup(paths[i])))
                n_files++;
    }
    for (int i = 0; i < n_files; i++)
        if (append_file(files[i], &buf, &len, &cap) != 0)
            goto done;
    if (len < 10000) {
        fprintf(stderr, "train_charlm: only %zu characters of text; need at least 10000\n", len);
        goto done;
    }
    for (int b = 0; b < 256; b++)
        c->id_of[b] = -1;
    for (size_t i = 0; i < len; i++)
        c->id_of[buf[i]] = 0;
    for (int b = 0; b < 256; b++)
        if (c->id_of[b] == 0) {
            c->id_of[b] = c->vocab;
            c->byte_of[c->vocab++] = (uint8_t)b;
        }
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)c->id_of[buf[i]];
    c->ids = buf;
    buf = NULL;
    c->n = (int64_t)len;
    c->n_train = c->n - c->n / 10;
    c->n_files = n_files;
    rc = 0;
done:
    for (int i = 0; i < n_files; i++)
        free(files[i]);
    free(buf);
    return rc;
}

/* Entropy in nats of the character frequencies of the training text: the
 * loss of the best model that ignores context. */
static double unigram_entropy(const corpus *c) {
    int64_t count[256] = {0};
    for (int64_t i = 0; i < c->n_train; i++)
        count[c->ids[i]]++;
    double h = 0.0;
    for (int v = 0; v < c->vocab; v++)
        if (count[v] > 0) {
            double p = (double)count[v] / (double)c->n_train;
            h -= p * log(p);
        }
    return h;
}

/* B windows of T+1 characters at random offsets inside [lo, hi): inputs
 * x [B, T] and targets y [B, T] (x shifted by one), as i64. */
static void get_batch(const corpus *c, int64_t lo, int64_t hi, int B, int T, uint64_t *rng,
                      int64_t *x, int64_t *y) {
    uint64_t span = (uint64_t)(hi - lo - T - 1);
    for (int b = 0; b < B; b++) {
        int64_t o = lo + (int64_t)(splitmix64(rng) % span);
        for (int t = 0; t < T; t++) {
            x[b * T + t] = c->ids[o + t];
            y[b * T + t] = c->ids[o + t + 1];
        }
    }
}

/* --------------------------------------------------------------- model */

typedef struct block {
    gj_layer_norm_layer ln1, ln2;
    gj_linear_layer qkv, proj, fc, fc2;
} block;

typedef struct model {
    gj_embedding_layer tok, pos; /* [V, C], [T, C] */
    block blk[N_LAYER];
    gj_layer_norm_layer lnf;
    gj_linear_layer head; /* C -> V */
    int64_t V, T;
    gj_tensor *pos_ids;   /* [T] i64: 0 .. T-1 (made once: a step function's constant) */
    gj_tensor *mask;      /* [T, T] causal mask, 1 where key j > query i (made once) */
    bool unfused;         /* --unfused: attention and the loss op by op */
} model;

#define N_PARAMS (2 + 12 * N_LAYER + 4)

/* Causal mask [t, t]: 1 where key j > query i (masked out). New reference. */
static gj_tensor *causal_mask(int64_t t) {
    float *v = malloc((size_t)(t * t) * sizeof *v);
    if (!v)
        return NULL;
    for (int64_t i = 0; i < t; i++)
        for (int64_t j = 0; j < t; j++)
            v[i * t + j] = j > i ? 1.0f : 0.0f;
    int64_t s[2] = {t, t};
    gj_tensor *m = gj_from_data(GJ_F32, 2, s, v);
    free(v);
    return m;
}

/* Position ids 0 .. t-1 as [t] i64. New reference. */
static gj_tensor *position_ids(int64_t t) {
    int64_t *pos = malloc((size_t)t * sizeof *pos);
    if (!pos)
        return NULL;
    for (int64_t i = 0; i < t; i++)
        pos[i] = i;
    gj_tensor *p = gj_from_data(GJ_I64, 1, &t, pos);
    free(pos);
    return p;
}

static int model_init(model *m, int64_t V, int64_t T) {
    memset(m, 0, sizeof *m);
    m->V = V;
    m->T = T;
    if (!(m->pos_ids = position_ids(T)) || !(m->mask = causal_mask(T)))
        return -1;
    gj_scope_keep(m->pos_ids);
    gj_scope_keep(m->mask);
    if (gj_embedding_init(&m->tok, V, N_EMBD, GJ_F32) || gj_embedding_init(&m->pos, T, N_EMBD, GJ_F32))
        return -1;
    for (int l = 0; l < N_LAYER; l++) {
        block *b = &m->blk[l];
        if (gj_layer_norm_init(&b->ln1, N_EMBD, 1e-5, GJ_F32) ||
            gj_linear_init(&b->qkv, N_EMBD, 3 * N_EMBD, true, GJ_F32) ||
            gj_linear_init(&b->proj, N_EMBD, N_EMBD, true, GJ_F32) ||
            gj_layer_norm_init(&b->ln2, N_EMBD, 1e-5, GJ_F32) ||
            gj_linear_init(&b->fc, N_EMBD, 4 * N_EMBD, true, GJ_F32) ||
            gj_linear_init(&b->fc2, 4 * N_EMBD, N_EMBD, true, GJ_F32))
            return -1;
    }
    if (gj_layer_norm_init(&m->lnf, N_EMBD, 1e-5, GJ_F32) ||
        gj_linear_init(&m->head, N_EMBD, V, true, GJ_F32))
        return -1;
    return 0;
}

/* The parameters, borrowed, into p[0..N_PARAMS). */
static void model_params(model *m, gj_tensor **p) {
    int k = 0;
    p[k++] = m->tok.weight;
    p[k++] = m->pos.weight;
    for (int l = 0; l < N_LAYER; l++) {
        block *b = &m->blk[l];
        gj_tensor *list[12] = {b->ln1.weight, b->ln1.bias, b->qkv.weight, b->qkv.bias,
                               b->proj.weight, b->proj.bias, b->ln2.weight, b->ln2.bias,
                               b->fc.weight, b->fc.bias, b->fc2.weight, b->fc2.bias};
        for (int i = 0; i < 12; i++)
            p[k++] = list[i];
    }
    p[k++] = m->lnf.weight;
    p[k++] = m->lnf.bias;
    p[k++] = m->head.weight;
    p[k++] = m->head.bias;
}

static void model_free(model *m) {
    gj_release(m->pos_ids);
    gj_release(m->mask);
    m->pos_ids = m->mask = NULL;
    gj_embedding_free(&m->tok);
    gj_embedding_free(&m->pos);
    for (int l = 0; l < N_LAYER; l++) {
        block *b = &m->blk[l];
        gj_layer_norm_free(&b->ln1);
        gj_layer_norm_free(&b->ln2);
        gj_linear_free(&b->qkv);
        gj_linear_free(&b->proj);
        gj_linear_free(&b->fc);
        gj_linear_free(&b->fc2);
    }
    gj_layer_norm_free(&m->lnf);
    gj_linear_free(&m->head);
}

/* Heads idx (0 q, 1 k, 2 v) of qkv [B, t, 3C] as [B, H, t, C/H]. */
static gj_tensor *heads(gj_tensor *qkv, int idx, int64_t B, int64_t t) {
    static const int perm[4] = {0, 2, 1, 3};
    int64_t hs[4] = {B, t, N_HEAD, N_EMBD / N_HEAD};
    gj_tensor *h = gj_narrow(qkv, 2, (int64_t)idx * N_EMBD, N_EMBD); /* [B, t, C] */
    h = h ? gj_reshape(h, 4, hs) : NULL;                              /* [B, t, H, hd] */
    return h ? gj_permute(h, perm) : NULL;                            /* [B, H, t, hd] */
}

/* One pre-norm causal block (W3): x [B, t, C] -> [B, t, C]; mask [t, t]. */
static gj_tensor *block_forward(block *b, gj_tensor *x, gj_tensor *mask, int64_t B, int64_t t,
                                bool unfused) {
    static const int perm[4] = {0, 2, 1, 3};
    int64_t cs[3] = {B, t, N_EMBD};
    gj_tensor *a = gj_layer_norm_forward(&b->ln1, x);        /* [B, t, C] */
    gj_tensor *qkv = a ? gj_linear_forward(&b->qkv, a) : NULL; /* [B, t, 3C] */
    if (!qkv)
        return NULL;
    gj_tensor *q = heads(qkv, 0, B, t), *k = heads(qkv, 1, B, t), *v = heads(qkv, 2, B, t);
    if (!q || !k || !v)
        return NULL;
    double scale = 1.0 / sqrt((double)(N_EMBD / N_HEAD));
    gj_tensor *y;                                          /* [B, H, t, hd] */
    if (!unfused) {                                        /* never holds [t, t] */
        y = gj_scaled_dot_product_attention(q, k, v, true, scale, 0.0, false);
    } else {
        gj_tensor *kt = gj_transpose(k, 2, 3);             /* [B, H, hd, t] */
        gj_tensor *att = kt ? gj_matmul(q, kt) : NULL;     /* [B, H, t, t] */
        att = att ? gj_mul_scalar(att, scale) : NULL;
        att = att ? gj_masked_fill(att, mask, -1e9) : NULL;
        att = att ? gj_softmax(att, -1) : NULL;
        y = att ? gj_matmul(att, v) : NULL;
    }
    y = y ? gj_permute(y, perm) : NULL;                    /* [B, t, H, hd] */
    y = y ? gj_reshape(y, 3, cs) : NULL;                   /* [B, t, C] */
    y = y ? gj_linear_forward(&b->proj, y) : NULL;
    gj_tensor *h = y ? gj_add(x, y) : NULL;                /* [B, t, C] */
    gj_tensor *f = h ? gj_layer_norm_forward(&b->ln2, h) : NULL;
    f = f ? gj_gelu(gj_linear_forward(&b->fc, f)) : NULL;  /* [B, t, 4C] */
    f = f ? gj_linear_forward(&b->fc2, f) : NULL;          /* [B, t, C] */
    return f ? gj_add(h, f) : NULL;
}

/* The final layer norm's output [B, t, C] of token ids idx [B, t] i64
 * (borrowed), t <= T: the model's position ids and causal mask cut to t.
 * Scope-owned new reference, or NULL with gj_last_error() set. */
static gj_tensor *model_hidden(model *m, gj_tensor *idx) {
    int64_t B = gj_tensor_shape(idx)[0], t = gj_tensor_shape(idx)[1];
    gj_tensor *pt = t == m->T ? m->pos_ids : gj_narrow(m->pos_ids, 0, 0, t); /* [t] */
    gj_tensor *mask = t == m->T ? m->mask : gj_narrow(gj_narrow(m->mask, 0, 0, t), 1, 0, t);
    gj_tensor *x = pt && mask ? gj_add(gj_embedding_forward(&m->tok, idx), /* [B, t, C] */
                                       gj_embedding_forward(&m->pos, pt))  /* [t, C] */
                              : NULL;
    for (int l = 0; l < N_LAYER && x; l++)
        x = block_forward(&m->blk[l], x, mask, B, t, m->unfused);
    return x ? gj_layer_norm_forward(&m->lnf, x) : NULL;
}

/* Logits [B, t, V] of token ids idx [B, t]. Scope-owned, or NULL. */
static gj_tensor *model_logits(model *m, gj_tensor *idx) {
    gj_tensor *x = model_hidden(m, idx);
    return x ? gj_linear_forward(&m->head, x) : NULL; /* [B, t, V] */
}

/* The training step's forward (a gj_step_fn): ctx the model, in[0] inputs
 * [B, T] and in[1] targets [B*T], i64 (borrowed). The mean cross-entropy of
 * the next character over the B*T positions, a 0-d scope-owned new
 * reference, or NULL. */
static gj_tensor *lm_loss(void *ctx, int n_in, gj_tensor *const *in) {
    model *m = ctx;
    (void)n_in;
    const int64_t *xs = gj_tensor_shape(in[0]);
    int64_t ls[2] = {xs[0] * xs[1], m->V};
    if (!m->unfused) { /* the head fused with the loss: no [B*T, V] logits */
        gj_tensor *x = model_hidden(m, in[0]);
        x = x ? gj_reshape(x, 2, (int64_t[]){ls[0], N_EMBD}) : NULL; /* [B*T, C] */
        return x ? gj_linear_cross_entropy(x, m->head.weight, m->head.bias, in[1], -1) : NULL;
    }
    gj_tensor *logits = model_logits(m, in[0]);
    logits = logits ? gj_reshape(logits, 2, ls) : NULL; /* [B*T, V] */
    return logits ? gj_cross_entropy(logits, in[1]) : NULL;
}

/* lm_loss of x and y (B*T values each, i64). Scope-owned, or NULL. */
static gj_tensor *model_loss(model *m, const int64_t *x, const int64_t *y, int64_t B,
                             int64_t T) {
    int64_t is[2] = {B, T}, ys = B * T;
    gj_tensor *in[2] = {gj_from_data(GJ_I64, 2, is, x), gj_from_data(GJ_I64, 1, &ys, y)};
    return in[0] && in[1] ? lm_loss(m, 2, in) : NULL;
}

/* ------------------------------------------------------------ training */

typedef struct opts {
    train_flags f; /* f.epochs: epochs over the text instead of --steps (0: --steps) */
    bool vary_ctx;
    bool unfused; /* attention and the loss op by op */
    int64_t steps;
    int ctx, sample;
    double temperature;
    const char *texts[MAX_TEXTS];
    int n_texts;
} opts;

/* One training run (trainer.h: the run is one epoch of --steps steps): the
 * model, a batch's buffers, the validation losses and what the run
 * reached. --both keeps two. */
typedef struct lm_run {
    train_run run;
    model m;
    int64_t *x, *y;     /* [B*T] a batch's inputs and targets */
    double *val;        /* [steps] validation loss where evaluated, else NaN */
    double final_val;   /* validation loss at the end */
    double final_train; /* mean training loss of the last 20 steps */
    char *sample;       /* generated text (malloc'd, NUL-terminated) */
} lm_run;

/* Validation loss: mean over EVAL_BATCHES fixed batches (the same in every
 * run) from the held-out text. NaN on error. */
static double evaluate(model *m, const corpus *c, const opts *o, int64_t *x, int64_t *y) {
    uint64_t rng = EVAL_SEED;
    double total = 0.0;
    gj_no_grad_push();
    for (int i = 0; i < EVAL_BATCHES; i++) {
        get_batch(c, c->n_train, c->n, o->f.batch, o->ctx, &rng, x, y);
        gj_scope_push();
        gj_tensor *loss = model_loss(m, x, y, o->f.batch, o->ctx);
        double v = loss ? gj_tensor_item(loss) : NAN;
        gj_scope_pop();
        total += v;
    }
    gj_no_grad_pop();
    return total / EVAL_BATCHES;
}

/* Generates n characters after PROMPT by sampling from softmax(logits /
 * temperature) of the last position, feeding back at most T characters.
 * Returns a malloc'd string (prompt included) or NULL. */
static char *generate(model *m, const corpus *c, const opts *o, uint64_t seed) {
    int64_t plen = (int64_t)strlen(PROMPT), total = plen + o->sample;
    int64_t *ids = malloc((size_t)total * sizeof *ids);
    char *out = malloc((size_t)total + 1);
    float *logits = malloc((size_t)m->V * sizeof *logits);
    double *p = malloc((size_t)m->V * sizeof *p);
    uint64_t rng = seed ^ 0x5a4d504c45ull;
    int64_t len = 0;
    bool ok = ids && out && logits && p;
    for (int64_t i = 0; ok && i < plen; i++) {
        int id = c->id_of[(uint8_t)PROMPT[i]];
        ids[len++] = id >= 0 ? id : 0;
    }
    gj_no_grad_push();
    while (ok && len < total) {
        int64_t t = len < m->T ? len : m->T;
        gj_scope_push();
        int64_t is[2] = {1, t};
        gj_tensor *it = gj_from_data(GJ_I64, 2, is, ids + len - t);
        gj_tensor *lg = it ? model_logits(m, it) : NULL;      /* [1, t, V] */
        lg = lg ? gj_narrow(lg, 1, t - 1, 1) : NULL;          /* [1, 1, V] */
        ok = lg && gj_tensor_to_f32(lg, logits) == 0;
        gj_scope_pop();
        if (!ok)
            break;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t v = 0; v < m->V; v++)
            mx = fmax(mx, logits[v] / o->temperature);
        for (int64_t v = 0; v < m->V; v++)
            sum += p[v] = exp(logits[v] / o->temperature - mx);
        double u = (double)(splitmix64(&rng) >> 11) * 0x1.0p-53 * sum;
        int64_t pick = m->V - 1;
        for (int64_t v = 0; v < m->V; v++) {
            u -= p[v];
            if (u < 0) {
                pick = v;
                break;
            }
        }
        ids[len++] = pick;
    }
    gj_no_grad_pop();
    if (ok) {
        for (int64_t i = 0; i < len; i++)
            out[i] = (char)c->byte_of[ids[i]];
        out[len] = 0;
    } else {
        free(out);
        out = NULL;
    }
    free(ids);
    free(logits);
    free(p);
    return out;
}

/* Learning rate of step s of n: linear warm-up over 5%, cosine to 10%
 * (train_def's lr_at). */
static double lr_at(const train_run *r, int64_t s) {
    const opts *o = r->def->opts;
    int64_t warm = o->steps / 20 > 0 ? o->steps / 20 : 1;
    if (s < warm)
        return o->f.lr * (double)(s + 1) / (double)warm;
    double t = (double)(s - warm) / (double)(o->steps - warm > 0 ? o->steps - warm : 1);
    return o->f.lr * (0.1 + 0.9 * 0.5 * (1.0 + cos(M_PI * t)));
}

/* The run's buffers, its model from the seed, AdamW and stepper
 * (train_def's init). */
static int lm_init(train_run *r) {
    lm_run *t = (lm_run *)r;
    const opts *o = r->def->opts;
    const corpus *c = r->def->data;
    int64_t BT = (int64_t)o->f.batch * o->ctx;
    t->x = malloc((size_t)BT * sizeof *t->x);
    t->y = malloc((size_t)BT * sizeof *t->y);
    t->val = malloc((size_t)o->steps * sizeof *t->val);
    if (!t->x || !t->y || !t->val) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    for (int64_t s = 0; s < o->steps; s++)
        t->val[s] = NAN;
    gj_tensor *params[N_PARAMS];
    if (model_init(&t->m, c->vocab, o->ctx) != 0)
        return -1;
    t->m.unfused = o->unfused;
    model_params(&t->m, params);
    if (!(r->opt = gj_adamw_new(N_PARAMS, params, o->f.lr, 0.9, 0.999, 1e-8, 0.01)))
        return -1;
    return stepper_init(&r->st, r->mode, lm_loss, &t->m, r->opt) != 0 ? -1 : 0;
}

static void lm_free(train_run *r) {
    lm_run *t = (lm_run *)r;
    model_free(&t->m);
    free(t->x);
    free(t->y);
    free(t->val);
    free(t->sample);
}

/* The context length of training step s: --ctx, or with --vary-ctx a
 * length in [max(2, ctx/4), ctx] that depends only on the seed and s. */
static int64_t ctx_at(const opts *o, int64_t s) {
    if (!o->vary_ctx)
        return o->ctx;
    int64_t lo = o->ctx / 4 > 2 ? o->ctx / 4 : 2;
    uint64_t st = o->f.seed * 0x9e3779b97f4a7c15ull + (uint64_t)s;
    return lo + (int64_t)(splitmix64(&st) % (uint64_t)(o->ctx - lo + 1));
}

/* Step r->step's batch: --batch windows of ctx_at characters at random
 * offsets of the training text, inputs [B, T] and targets [B*T], i64. */
static int lm_batch(train_run *r, gj_tensor **in) {
    lm_run *t = (lm_run *)r;
    const opts *o = r->def->opts;
    const corpus *c = r->def->data;
    int64_t T = ctx_at(o, r->step), B = o->f.batch, BT = B * T, xs[2] = {B, T};
    get_batch(c, 0, c->n_train, o->f.batch, (int)T, &r->rng, t->x, t->y);
    in[0] = gj_from_data(GJ_I64, 2, xs, t->x);
    in[1] = gj_from_data(GJ_I64, 1, &BT, t->y);
    return 0;
}

/* The validation loss after every EVAL_EVERY-th step and the last. */
static int lm_after_step(train_run *r) {
    lm_run *t = (lm_run *)r;
    const opts *o = r->def->opts;
    int64_t s = r->step - 1;
    if ((s + 1) % EVAL_EVERY == 0 || s + 1 == o->steps) {
        t->val[s] = evaluate(&t->m, r->def->data, o, t->x, t->y);
        if (!isfinite(t->val[s]))
            return -1;
    }
    return 0;
}

/* After a step that was validated: its line (one run's, or --both's). */
static void lm_step_report(const train_run *a, const train_run *c) {
    const train_flags *f = a->def->f;
    const lm_run *la = (const lm_run *)a, *lc = (const lm_run *)c;
    int64_t s = a->step - 1, n = a->def->per_epoch;
    if (isnan(la->val[s]) || f->quiet)
        return;
    progress_clear(f, 110);
    if (!c)
        printf("[%s] step %lld/%lld: train loss %.4f, validation loss %.4f, %s %.2f ms/step\n",
               a->tag, (long long)(s + 1), (long long)n, a->loss[s], la->val[s],
               train_ms_what(a), train_ms(a, s + 1));
    else
        printf("[both] step %lld/%lld: validation loss %.4f / %.4f (eager / compiled)\n",
               (long long)(s + 1), (long long)n, la->val[s], lc->val[s]);
    fflush(stdout);
}

/* The loss reached and the sample (train_def's finish). */
static int lm_finish(train_run *r) {
    lm_run *t = (lm_run *)r;
    const opts *o = r->def->opts;
    t->final_val = t->val[o->steps - 1];
    int64_t tail = o->steps < 20 ? o->steps : 20;
    for (int64_t s = o->steps - tail; s < o->steps; s++)
        t->final_train += r->loss[s] / (double)tail;
    if (o->sample > 0 && !(t->sample = generate(&t->m, r->def->data, o, o->f.seed)))
        return -1;
    return 0;
}

/* ---------------------------------------------------------- checkpoints */

/* The model's parameters into sd under stable names (references to the
 * live tensors): train_def's model_dict. 0 or -1. */
static int lm_dict(train_run *r, gj_state_dict *sd) {
    model *m = &((lm_run *)r)->m;
    int rc = gj_embedding_state_dict_add(&m->tok, sd, "tok_emb");
    rc = rc || gj_embedding_state_dict_add(&m->pos, sd, "pos_emb");
    for (int l = 0; l < N_LAYER; l++) {
        block *b = &m->blk[l];
        char p[64];
#define LM_NAME(field) (snprintf(p, sizeof p, "blocks.%d.%s", l, field), p)
        rc = rc || gj_layer_norm_state_dict_add(&b->ln1, sd, LM_NAME("ln1"));
        rc = rc || gj_linear_state_dict_add(&b->qkv, sd, LM_NAME("attn.qkv"));
        rc = rc || gj_linear_state_dict_add(&b->proj, sd, LM_NAME("attn.proj"));
        rc = rc || gj_layer_norm_state_dict_add(&b->ln2, sd, LM_NAME("ln2"));
        rc = rc || gj_linear_state_dict_add(&b->fc, sd, LM_NAME("mlp.fc"));
        rc = rc || gj_linear_state_dict_add(&b->fc2, sd, LM_NAME("mlp.fc2"));
#undef LM_NAME
    }
    rc = rc || gj_layer_norm_state_dict_add(&m->lnf, sd, "ln_f");
    rc = rc || gj_linear_state_dict_add(&m->head, sd, "head");
    return rc ? -1 : 0;
}

/* The run's part of a checkpoint (trainer.h's train_save): its step and
 * settings, the batch generator, the totals so far, the curves. 0 or -1. */
static int lm_save(train_run *r, gj_state_dict *sd) {
    const lm_run *t = (const lm_run *)r;
    const opts *o = r->def->opts;
    const corpus *c = r->def->data;
    int64_t s = r->step;
    int rc = 0;
    rc = rc || meta_i64(sd, "train.step", s) || meta_i64(sd, "train.steps", o->steps);
    rc = rc || meta_i64(sd, "train.batch_size", o->f.batch) || meta_i64(sd, "train.ctx", o->ctx);
    rc = rc || meta_i64(sd, "train.vary_ctx", o->vary_ctx);
    rc = rc || meta_i64(sd, "train.seed", (int64_t)o->f.seed);
    rc = rc || meta_i64(sd, "train.vocab", c->vocab) || meta_i64(sd, "train.chars", c->n);
    rc = rc || meta_u64(sd, "train.batch_rng", r->rng);
    rc = rc || meta_f64(sd, "train.t_train", r->train_s);
    rc = rc || meta_f64(sd, "train.bwd_total", r->bwd_total);
    rc = rc || meta_f64(sd, "train.fwd_total", r->fwd_total);
    rc = rc || meta_f64(sd, "train.step_total", r->step_total);
    rc = rc || ckpt_add_array(sd, "train.loss", GJ_F64, s, r->loss);
    rc = rc || ckpt_add_array(sd, "train.val", GJ_F64, s, t->val);
    return rc ? -1 : 0;
}

/* Reads lm_save's part back into a fresh run (trainer.h's train_resume),
 * checking it against this run's settings: at step s, the run's one epoch
 * begun at batch s. 0, or 1 with a message. */
static int lm_resume(train_run *r, ckpt_reader *rd, const char *path) {
    lm_run *t = (lm_run *)r;
    const opts *o = r->def->opts;
    const corpus *c = r->def->data;
    int64_t s;
    uint64_t rng;
    rd->same = "--steps/--epochs, --batch, --ctx, --vary-ctx, --seed and text";
    snprintf(rd->where, sizeof rd->where, PROG ": %s", path);
    if (ckpt_same(rd, "train.steps", o->steps, NULL) ||
        ckpt_same(rd, "train.batch_size", o->f.batch, NULL) ||
        ckpt_same(rd, "train.ctx", o->ctx, NULL) ||
        (gj_state_dict_get_metadata(rd->sd, "train.vary_ctx") && /* (older versions: absent) */
         ckpt_same(rd, "train.vary_ctx", o->vary_ctx, NULL)) ||
        ckpt_same(rd, "train.vocab", c->vocab, NULL) ||
        ckpt_same(rd, "train.chars", c->n, NULL) || ckpt_same(rd, "train.step", -1, &s))
        return 1;
    const char *sv = gj_state_dict_get_metadata(rd->sd, "train.seed");
    char *end = NULL;
    uint64_t seed = sv ? strtoull(sv, &end, 10) : 0;
    if (!sv || *end || seed != o->f.seed || meta_get_u64(rd->sd, "train.batch_rng", &rng) != 0 ||
        s > o->steps) {
        const char *rs = gj_state_dict_get_metadata(rd->sd, "train.batch_rng");
        fprintf(stderr, PROG ": %s: seed %s (this run %llu), batch rng %s, step %lld of %lld\n",
                path, sv ? sv : "absent", (unsigned long long)o->f.seed, rs ? rs : "absent",
                (long long)s, (long long)o->steps);
        return 1;
    }
    if (ckpt_num(rd, "train.t_train", &r->train_s) ||
        ckpt_num(rd, "train.bwd_total", &r->bwd_total) ||
        ckpt_num(rd, "train.fwd_total", &r->fwd_total) ||
        ckpt_num_opt(rd, "train.step_total", &r->step_total) || /* older versions: absent */
        ckpt_array(rd, "train.loss", GJ_F64, s, r->loss) ||
        ckpt_array(rd, "train.val", GJ_F64, s, t->val))
        return 1;
    r->rng = rng;
    r->step = r->batch = s;
    r->begun = true;
    return 0;
}

/* ---------------------------------------------------------------- main */

/* The options (examples/args.h). 0, 1 (--help/--version printed) or -1. */
static int parse_opts(int argc, char **argv, opts *o) {
    *o = (opts){.f = {.batch = 16,
                      .lr = 6e-3,
                      .seed = 42,
                      .csv = "charlm_loss.csv",
                      .png = "charlm_loss.png"},
                .steps = 300,
                .ctx = 64,
                .sample = 400,
                .temperature = 0.8};
    train_flags *f = &o->f;
    bool steps_given = false;
    arg_spec specs[] = {
        TRAIN_ARG_COMPILED(f),
        TRAIN_ARG_BF16(f),
        ARG_OPT("both", ARG_FLAG, &f->both, 0, 0,
                "train eager and compiled side by side (steps in turn, ABBA), paired ratios: "
                "compiled autograd's forward and backward, or with --compiled-step the whole "
                "step"),
        ARG_OPT_GIVEN("steps", ARG_I64, &o->steps, 1, 10000000, "training steps", &steps_given),
        ARG_OPT("epochs", ARG_INT, &f->epochs, 1, 10000,
                "epochs over the text instead of --steps (0: use --steps)"),
        ARG_OPT("batch", ARG_INT, &f->batch, 1, 4096, "sequences per batch"),
        ARG_OPT("ctx", ARG_INT, &o->ctx, 2, 1024, "context length (characters)"),
        ARG_OPT("seq", ARG_INT, &o->ctx, 2, 1024, "the same as --ctx"),
        ARG_OPT("unfused", ARG_FLAG, &o->unfused, 0, 0,
                "attention and the loss op by op ([t, t] scores, [B*t, V] logits) instead of "
                "the fused gj_scaled_dot_product_attention and gj_linear_cross_entropy"),
        ARG_OPT("vary-ctx", ARG_FLAG, &o->vary_ctx, 0, 0,
                "draw each training step's context length in [ctx/4, ctx]"),
        TRAIN_ARG_LR(f),
        ARG_OPT("seed", ARG_U64, &f->seed, 0, 0, "seed of the weights and the batches"),
        TRAIN_ARG_THREADS(f),
        TRAIN_ARG_QUIET(f),
        {.name = "text", .kind = ARG_STRS, .dst = (void *)o->texts, .count = &o->n_texts,
         .max = MAX_TEXTS, .help = "a text file to train on (repeatable; default: the files "
                                   "of " DEFAULT_DIR ")"},
        ARG_OPT("sample", ARG_INT, &o->sample, 0, 100000, "characters sampled at the end"),
        ARG_OPT("temperature", ARG_DOUBLE, &o->temperature, 0, 1e6, "sampling temperature"),
        TRAIN_ARG_CSV(f),
        ARG_OPT("png", ARG_FILE, &f->png, 0, 0, "loss curves as PNG (\"-\": none)"),
        TRAIN_ARG_SAVE(f),
        ARG_OPT("resume", ARG_FILE, &f->resume, 0, 0,
                "continue a saved run bit-identically (same settings, --bf16 and --threads)"),
        TRAIN_ARG_STOP_AFTER(f),
    };
    int rc = args_parse(PROG,
                        "Trains a character-level transformer on text files, eager, with "
                        "compiled autograd or with the compiled step, and samples from it.",
                        argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (rc != 0) return rc;
    if (train_flags_check(PROG, f) != 0 || train_flags_check_one_run(PROG, f) != 0)
        return -1;
    if (steps_given && f->epochs) {
        fprintf(stderr, PROG ": give --steps or --epochs, not both\n");
        return -1;
    }
    return 0;
}

/* Training loss (moving average, raw faint), validation points and the
 * unigram entropy as a reference line, as a PNG: one run a, or --both's a
 * and c. */
static int write_png(const char *path, const train_run *a, const train_run *c, double h_uni) {
    const lm_run *la = (const lm_run *)a, *lc = (const lm_run *)c;
    const char *na = c ? "eager" : a->tag, *nb = c ? c->tag : NULL;
    int64_t n = a->def->per_epoch;
    double *sm[2] = {malloc((size_t)n * sizeof(double)), malloc((size_t)n * sizeof(double))};
    double *vx = malloc((size_t)n * sizeof(double)), *vy[2] = {malloc((size_t)n * sizeof(double)),
                                                               malloc((size_t)n * sizeof(double))};
    double hx[2] = {0, (double)(n - 1)}, hy[2] = {h_uni, h_uni};
    plot_img im = {0};
    int rc = -1, nv = 0;
    if (!sm[0] || !sm[1] || !vx || !vy[0] || !vy[1]) {
        fprintf(stderr, PROG ": out of memory plotting\n");
        goto done;
    }
    for (int k = 0; k < (c ? 2 : 1); k++) {
        const train_run *r = k ? c : a;
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++) {
            acc += r->loss[i] - (i >= SMOOTH ? r->loss[i - SMOOTH] : 0.0);
            sm[k][i] = acc / (double)(i < SMOOTH ? i + 1 : SMOOTH);
        }
    }
    for (int64_t i = 0; i < n; i++)
        if (isfinite(la->val[i])) {
            vx[nv] = (double)i;
            vy[0][nv] = la->val[i];
            vy[1][nv++] = c ? lc->val[i] : NAN;
        }
    if (plot_img_init(&im, 1000, 600) != 0)
        goto done;
    char ta[64], tb[64], va[64], vb[64];
    snprintf(ta, sizeof ta, c ? "train, %s" : "train (%s)", na);
    snprintf(tb, sizeof tb, "train, %s", nb ? nb : "");
    snprintf(va, sizeof va, c ? "validation, %s" : "validation", na);
    snprintf(vb, sizeof vb, "validation, %s", nb ? nb : "");
    plot_series s[6] = {
        {NULL, NULL, a->loss, (int)n, 0xd9d9d9u, 1, 0},
        {"unigram entropy", hx, hy, 2, 0x31a354u, 2, 0},
        {ta, NULL, sm[0], (int)n, c ? 0x9ecae1u : 0x08519cu, c ? 5 : 2, 0},
        {tb, NULL, sm[1], (int)n, 0x08519cu, 1, 0},
        {va, vx, vy[0], nv, 0xfd8d3cu, c ? 5 : 2, c ? 13 : 9},
        {vb, vx, vy[1], nv, 0xa63603u, 1, 7},
    };
    plot_series list[6];
    int ns = 0;
    for (int k = 0; k < 6; k++)
        if (c || (k != 3 && k != 5))
            list[ns++] = s[k];
    char title[200];
    snprintf(title, sizeof title, "char-level transformer: loss (nats/char, %d-step average; "
             "raw in grey)", SMOOTH);
    plot_line_panel(&im, 0, 10, 1000, 590, title, "step", "cross-entropy", list, ns, 0, 0);
    rc = plot_write_png(&im, path);
done:
    plot_img_free(&im);
    free(sm[0]);
    free(sm[1]);
    free(vx);
    free(vy[0]);
    free(vy[1]);
    return rc;
}

static void print_result(const char *tag, const train_run *r, double h_uni) {
    const lm_run *t = (const lm_run *)r;
    const opts *o = r->def->opts;
    printf("[%s] loss reached: train %.4f (mean of the last 20 steps), validation %.4f "
           "nats/char (%.3f bits); unigram entropy %.4f nats; %.1f s for %lld steps, ",
           tag, t->final_train, t->final_val, t->final_val / log(2.0), h_uni, r->epoch_s[0],
           (long long)o->steps);
    if (isnan(r->bwd_ms[0])) /* gj_step's modes time the whole step */
        printf("step %.2f ms\n", r->step_ms[0]);
    else
        printf("forward %.2f ms, backward %.2f ms per step\n", r->fwd_ms[0], r->bwd_ms[0]);
    if (t->sample)
        printf("[%s] sample (temperature %.2f):\n----\n%s\n----\n", tag, o->temperature,
               t->sample);
}

/* The results (train_def's report): the counters, or --both's table with
 * the paired ratios and whether the two runs agree; the loss reached and
 * the sample; the files. */
static int lm_report(const train_run *a, const train_run *b, double (*q3)[3], double (*fq3)[3]) {
    const opts *o = a->def->opts;
    const lm_run *la = (const lm_run *)a, *lb = (const lm_run *)b;
    double h_uni = unigram_entropy(a->def->data);
    if (!b) {
        print_counters(a->mode, &a->ca, &a->cs);
        print_result(a->tag, a, h_uni);
    } else {
        const double *q = q3[0], *fq = fq3[0]; /* the run's one epoch */
        const char *cname = b->tag;
        if (b->mode == STEP_COMPILED) {
            printf("\n%-13s %11s %11s %13s %9s\n", "mode", "train loss", "val loss", "step ms",
                   "seconds");
            printf("%-13s %11.4f %11.4f %13.2f %9.1f\n", "eager", la->final_train, la->final_val,
                   a->step_ms[0], a->epoch_s[0]);
            printf("%-13s %11.4f %11.4f %13.2f %9.1f\n", cname, lb->final_train, lb->final_val,
                   b->step_ms[0], b->epoch_s[0]);
            printf("steps interleaved ABBA; per-step ratio eager / compiled step, median "
                   "[interquartile range]: whole step (forward, backward, AdamW update) "
                   "%.3fx [%.2f-%.2f]\n",
                   q[1], q[0], q[2]);
        } else {
            printf("\n%-9s %11s %11s %13s %13s %9s\n", "mode", "train loss", "val loss",
                   "forward ms", "backward ms", "seconds");
            printf("%-9s %11.4f %11.4f %13.2f %13.2f %9.1f\n", "eager", la->final_train,
                   la->final_val, a->fwd_ms[0], a->bwd_ms[0], a->epoch_s[0]);
            printf("%-9s %11.4f %11.4f %13.2f %13.2f %9.1f\n", cname, lb->final_train,
                   lb->final_val, b->fwd_ms[0], b->bwd_ms[0], b->epoch_s[0]);
            printf("steps interleaved ABBA; per-step ratio eager / compiled, median "
                   "[interquartile range]: backward %.3fx [%.2f-%.2f], forward %.3fx "
                   "[%.2f-%.2f]\n",
                   q[1], q[0], q[2], fq[1], fq[0], fq[2]);
        }
        print_counters(b->mode, &b->ca, &b->cs);
        print_pair_curves(a, b);
        print_result("eager", a, h_uni);
        if (lb->sample && la->sample && !strcmp(la->sample, lb->sample))
            printf("[%s] sample: identical to the eager sample\n", cname);
        else
            print_result(cname, b, h_uni);
    }
    if (o->f.csv && write_loss_csv(o->f.csv, a, b, la->val, b ? lb->val : NULL) != 0)
        return 1;
    if (o->f.png && write_png(o->f.png, a, b, h_uni) != 0)
        return 1;
    print_wrote(&o->f);
    return 0;
}

int main(int argc, char **argv) {
    opts o;
    step_mode mode;
    int rc = train_start(parse_opts(argc, argv, &o), &o.f, &mode);
    if (rc >= 0) return rc;
    corpus c;
    rc = corpus_load(o.texts, o.n_texts, &c);
    if (rc != 0)
        return rc;
    if (c.n - c.n_train <= o.ctx + 1 || c.n_train <= o.ctx + 1) {
        fprintf(stderr, PROG ": --ctx %d is too long for %lld characters of text\n", o.ctx,
                (long long)c.n);
        free(c.ids);
        return 2;
    }
    int64_t per_epoch = c.n_train / ((int64_t)o.f.batch * o.ctx);
    if (per_epoch < 1)
        per_epoch = 1;
    if (o.f.epochs)
        o.steps = per_epoch * o.f.epochs;
    double h_uni = unigram_entropy(&c);

    if (train_banner(&o.f))
        printf("text: %d files, %lld chars (%lld train, %lld validation), vocabulary %d | %d "
               "blocks, C %d, %d heads, ctx %d, batch %d, %lld steps (%.2f epochs), AdamW lr "
               "%g, seed %llu | unigram entropy %.4f nats\n",
               c.n_files, (long long)c.n, (long long)c.n_train, (long long)(c.n - c.n_train),
               c.vocab, N_LAYER, N_EMBD, N_HEAD, o.ctx, o.f.batch, (long long)o.steps,
               (double)o.steps / (double)per_epoch, o.f.lr, (unsigned long long)o.f.seed, h_uni);

    /* the run: one epoch of --steps steps, a progress line every 5 */
    train_def d = {.prog = PROG, .f = &o.f, .opts = &o, .data = &c, .size = sizeof(lm_run),
                   .epochs = 1, .per_epoch = o.steps, .every = 5, .init = lm_init,
                   .free = lm_free, .lr_at = lr_at, .batch = lm_batch,
                   .after_step = lm_after_step, .step_report = lm_step_report,
                   .model_dict = lm_dict, .save = lm_save, .resume = lm_resume,
                   .finish = lm_finish, .report = lm_report};
    rc = train_main(&d, mode);
    free(c.ids);
    return rc;
}
