/* SPDX-License-Identifier: MIT */
/*
 * workloads.c - W1..W5, F1, G1, G2 and G3 of docs/benchmarks.md with
 * exactly those shapes, against the public API (gradjit.h) only; G1 and G2
 * are examples/gpt2_model.h's GPT-2 (llm.c's), with GPT-2's random
 * initialisation and tokens from a local text.
 *
 * Invariants: setup draws every weight and input from the generator that the
 * driver seeded (gj_manual_seed) just before, so eager and compiled runs of a
 * workload see bit-identical parameters and data. Every tensor setup creates
 * is appended to s->owned (the state's only owning list); s->params and
 * s->in borrow from it. forward never keeps a reference past the driver's
 * scope. Shape legend: B batch, T time, C channels, H heads, hd = C / H.
 */
#include "bench.h"
#include "../examples/gpt2_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* ------------------------------------------------------------- helpers */

/* Takes ownership of t (a new reference) into s->owned. Returns t, or NULL
 * if t is NULL or the list is full (t is then released). */
static gj_tensor *own(bench_state *s, gj_tensor *t) {
    if (!t)
        return NULL;
    if (s->n_owned >= BENCH_MAX_OWNED) {
        fprintf(stderr, "bench: too many tensors in one workload\n");
        gj_release(t);
        return NULL;
    }
    s->owned[s->n_owned++] = t;
    return t;
}

/* Registers an owned leaf as a parameter that requires grad. 0 on success. */
static int add_param(bench_state *s, gj_tensor *p) {
    if (!p || s->n_params >= BENCH_MAX_PARAMS)
        return -1;
    if (gj_set_requires_grad(p, true) != 0)
        return -1;
    s->params[s->n_params++] = p;
    s->param_elems += gj_tensor_numel(p);
    return 0;
}

/* A Linear(in, out) with bias, torch-style init; weight then bias become
 * owned parameters. 0 on success. */
static int add_linear(bench_state *s, int64_t in, int64_t out, gj_dtype dt) {
    gj_linear_layer l;
    if (gj_linear_init(&l, in, out, true, dt) != 0)
        return -1;
    /* The layer's two references move into s->owned (gj_linear_free not called). */
    gj_tensor *w = own(s, l.weight);
    gj_tensor *b = own(s, l.bias);
    if (!w || !b)
        return -1;
    if (add_param(s, w) || add_param(s, b))
        return -1;
    return 0;
}

/* A LayerNorm(C) with affine weight and bias (eps 1e-5), both parameters. */
static int add_layer_norm(bench_state *s, int64_t c) {
    gj_layer_norm_layer l;
    if (gj_layer_norm_init(&l, c, 1e-5, GJ_F32) != 0)
        return -1;
    gj_tensor *w = own(s, l.weight);
    gj_tensor *b = own(s, l.bias);
    if (!w || !b)
        return -1;
    if (add_param(s, w) || add_param(s, b))
        return -1;
    return 0;
}

/* i64 labels [n] uniform in [0, k), drawn from the seeded generator. */
static gj_tensor *random_labels(int64_t n, int k) {
    gj_tensor *u = gj_rand(GJ_F32, 1, &n, 0.0, (double)k);
    if (!u)
        return NULL;
    float *f = malloc((size_t)n * sizeof *f);
    int64_t *lab = malloc((size_t)n * sizeof *lab);
    gj_tensor *out = NULL;
    if (!f || !lab || gj_tensor_to_f32(u, f) != 0)
        goto fail;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = (int64_t)floorf(f[i]);
        lab[i] = v < 0 ? 0 : v >= k ? k - 1 : v;
    }
    out = gj_from_data(GJ_I64, 1, &n, lab);
fail:
    free(f);
    free(lab);
    gj_release(u);
    return out;
}

void bench_state_free(bench_state *s) {
    gj_optim_free(s->opt); /* borrows the parameters: first */
    for (int i = 0; i < s->n_owned; i++)
        gj_release(s->owned[i]);
    if (s->model_free)
        s->model_free(s->model);
    *s = (bench_state){0};
}

/* GEMM FLOPs of an n-row MLP in -> h1 -> h2 -> k (three Linear layers). */
static double mlp3_flops(double n, double in, double h1, double h2, double k) {
    return 2.0 * n * (in * h1 + h1 * h2 + h2 * k);
}

/* ------------------------------------------------------------ W1 mlp */

enum { W1_N = 256, W1_IN = 784, W1_H = 1024, W1_K = 10 };

/* x[256,784] -> Linear(784,1024) -> GELU -> Linear(1024,1024) -> GELU ->
 * Linear(1024,10) -> cross_entropy(labels[256] i64), mean over the batch.
 * p holds w1,b1,w2,b2,w3,b3 (f32). Returns the loss (scope-owned). */
static gj_tensor *mlp3_loss(gj_tensor *const *p, gj_tensor *x, gj_tensor *labels) {
    gj_tensor *h = gj_gelu(gj_linear(x, p[0], p[1]));     /* [N, H] */
    h = h ? gj_gelu(gj_linear(h, p[2], p[3])) : NULL;     /* [N, H] */
    gj_tensor *logits = h ? gj_linear(h, p[4], p[5]) : NULL; /* [N, K] */
    return logits ? gj_cross_entropy(logits, labels) : NULL;
}

/* Parameters of an n-row MLP in -> h1 -> h2 -> k (f32) and its inputs:
 * x[n, in] ~ N(0, 1), labels[n] in [0, k). */
static int mlp3_setup(bench_state *s, int64_t n, int64_t in, int64_t h1, int64_t h2, int k) {
    int64_t xs[2] = {n, in};
    if (add_linear(s, in, h1, GJ_F32) || add_linear(s, h1, h2, GJ_F32) ||
        add_linear(s, h2, k, GJ_F32))
        return -1;
    s->in[0] = own(s, gj_randn(GJ_F32, 2, xs, 1.0));
    s->in[1] = own(s, random_labels(n, k));
    s->n_in = 2;
    return s->in[0] && s->in[1] ? 0 : -1;
}

static int w1_setup(bench_state *s) { return mlp3_setup(s, W1_N, W1_IN, W1_H, W1_H, W1_K); }

static gj_tensor *w1_forward(bench_state *s) { return mlp3_loss(s->params, s->in[0], s->in[1]); }

static double w1_flops(const bench_state *s) {
    (void)s;
    return mlp3_flops(W1_N, W1_IN, W1_H, W1_H, W1_K);
}

/* ---------------------------------------------------- F1 fashion-mlp */

enum { F1_N = 128, F1_IN = 784, F1_H1 = 512, F1_H2 = 256, F1_K = 10 };

/* The main job's MLP (examples/train_fashion_mnist.c): x[128,784] ->
 * Linear(784,512) -> GELU -> Linear(512,256) -> GELU -> Linear(256,10) ->
 * cross_entropy, on random data of the dataset's shape. */
static int f1_setup(bench_state *s) { return mlp3_setup(s, F1_N, F1_IN, F1_H1, F1_H2, F1_K); }

static double f1_flops(const bench_state *s) {
    (void)s;
    return mlp3_flops(F1_N, F1_IN, F1_H1, F1_H2, F1_K);
}

/* -------------------------------------------------------- W2 pointwise */

enum { W2_N = 4194304 };

static int w2_setup(bench_state *s) {
    int64_t n = W2_N;
    for (int i = 0; i < 3; i++) {
        gj_tensor *t = own(s, gj_randn(GJ_F32, 1, &n, 1.0));
        if (add_param(s, t))
            return -1;
    }
    return 0;
}

/* loss = sum(tanh(x*w + b) * sigmoid(x) + exp(-(x*x))); x, w, b [4194304]. */
static gj_tensor *w2_forward(bench_state *s) {
    gj_tensor *x = s->params[0], *w = s->params[1], *b = s->params[2];
    gj_tensor *t = gj_tanh(gj_add(gj_mul(x, w), b));
    gj_tensor *u = t ? gj_mul(t, gj_sigmoid(x)) : NULL;
    gj_tensor *e = gj_exp(gj_neg(gj_mul(x, x)));
    gj_tensor *v = u && e ? gj_add(u, e) : NULL;
    return v ? gj_sum(v, 0, NULL, false) : NULL;
}

/* ------------------------------------------------------------ W3 block */

enum { W3_B = 8, W3_T = 128, W3_C = 256, W3_H = 4, W3_HD = W3_C / W3_H };

/* Parameter order: ln1 w,b | qkv w,b | proj w,b | ln2 w,b | fc w,b | fc2 w,b. */
static int w3_setup(bench_state *s) {
    int64_t xs[3] = {W3_B, W3_T, W3_C};
    if (add_layer_norm(s, W3_C) || add_linear(s, W3_C, 3 * W3_C, GJ_F32) ||
        add_linear(s, W3_C, W3_C, GJ_F32) || add_layer_norm(s, W3_C) ||
        add_linear(s, W3_C, 4 * W3_C, GJ_F32) || add_linear(s, 4 * W3_C, W3_C, GJ_F32))
        return -1;
    s->in[0] = own(s, gj_randn(GJ_F32, 3, xs, 1.0)); /* x, no grad */
    /* Causal mask [T, T]: 1 where key j > query i (masked out). */
    static float mask[W3_T * W3_T];
    for (int i = 0; i < W3_T; i++)
        for (int j = 0; j < W3_T; j++)
            mask[i * W3_T + j] = j > i ? 1.0f : 0.0f;
    int64_t ms[2] = {W3_T, W3_T};
    s->in[1] = own(s, gj_from_data(GJ_F32, 2, ms, mask));
    s->n_in = 2;
    return s->in[0] && s->in[1] ? 0 : -1;
}

/* The block's GEMMs: qkv, proj, fc, fc2 over B*T rows, and per head
 * q k^T and att v. */
static double w3_flops(const bench_state *s) {
    (void)s;
    double bt = (double)W3_B * W3_T, c = W3_C;
    return 2.0 * bt * (c * 3 * c + c * c + c * 4 * c + 4 * c * c) +
           2.0 * 2.0 * W3_B * W3_H * (double)W3_T * W3_T * W3_HD;
}

/* One head group of qkv [B,T,3C]: columns [idx*C, (idx+1)*C) as [B,H,T,hd]. */
static gj_tensor *w3_heads(gj_tensor *qkv, int idx) {
    static const int perm[4] = {0, 2, 1, 3};
    int64_t hs[4] = {W3_B, W3_T, W3_H, W3_HD};
    gj_tensor *t = gj_narrow(qkv, 2, (int64_t)idx * W3_C, W3_C); /* [B,T,C] view */
    t = t ? gj_reshape(t, 4, hs) : NULL;                          /* [B,T,H,hd] */
    return t ? gj_permute(t, perm) : NULL;                        /* [B,H,T,hd] */
}

/* Pre-norm causal transformer block, loss = mean(y*y). */
static gj_tensor *w3_forward(bench_state *s) {
    gj_tensor *const *p = s->params;
    gj_tensor *x = s->in[0], *mask = s->in[1];
    static const int perm[4] = {0, 2, 1, 3};
    int64_t cs[3] = {W3_B, W3_T, W3_C};

    gj_tensor *a = gj_layer_norm(x, p[0], p[1], 1e-5);      /* [B,T,C] */
    gj_tensor *qkv = a ? gj_linear(a, p[2], p[3]) : NULL;    /* [B,T,3C] */
    if (!qkv)
        return NULL;
    gj_tensor *q = w3_heads(qkv, 0), *k = w3_heads(qkv, 1), *v = w3_heads(qkv, 2);
    if (!q || !k || !v)
        return NULL;
    gj_tensor *kt = gj_transpose(k, 2, 3);                              /* [B,H,hd,T] */
    gj_tensor *att = kt ? gj_matmul(q, kt) : NULL;                      /* [B,H,T,T] */
    att = att ? gj_mul_scalar(att, 1.0 / sqrt((double)W3_HD)) : NULL;
    att = att ? gj_masked_fill(att, mask, -1e9) : NULL;
    att = att ? gj_softmax(att, -1) : NULL;
    gj_tensor *y = att ? gj_matmul(att, v) : NULL;                      /* [B,H,T,hd] */
    y = y ? gj_permute(y, perm) : NULL;                                 /* [B,T,H,hd] */
    y = y ? gj_reshape(y, 3, cs) : NULL;                                /* [B,T,C] */
    y = y ? gj_linear(y, p[4], p[5]) : NULL;
    gj_tensor *h = y ? gj_add(x, y) : NULL;                             /* [B,T,C] */
    gj_tensor *m = h ? gj_layer_norm(h, p[6], p[7], 1e-5) : NULL;
    m = m ? gj_gelu(gj_linear(m, p[8], p[9])) : NULL;                   /* [B,T,4C] */
    m = m ? gj_linear(m, p[10], p[11]) : NULL;                          /* [B,T,C] */
    gj_tensor *out = m ? gj_add(h, m) : NULL;
    gj_tensor *sq = out ? gj_mul(out, out) : NULL;
    return sq ? gj_mean(sq, 0, NULL, false) : NULL;
}

/* ------------------------------------------------------ W4 deep mlp */

enum { W4_N = 128, W4_C = 512, W4_H = 2048, W4_L = 8 };

static int w4_setup(bench_state *s) {
    int64_t xs[2] = {W4_N, W4_C};
    for (int l = 0; l < W4_L; l++)
        if (add_linear(s, W4_C, W4_H, GJ_F32) || add_linear(s, W4_H, W4_C, GJ_F32))
            return -1;
    s->in[0] = own(s, gj_randn(GJ_F32, 2, xs, 1.0));
    s->n_in = 1;
    return s->in[0] ? 0 : -1;
}

static double w4_flops(const bench_state *s) {
    (void)s;
    return W4_L * 2.0 * W4_N * (2.0 * W4_C * W4_H);
}

/* One W4 layer as a checkpoint region body: out[0] = y + Linear(2048,512)(
 * GELU(Linear(512,2048)(y))) with y = in[0] [N, C]; user is the layer's
 * w1, b1, w2, b2 (borrowed). */
static int w4_layer(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    gj_tensor *const *p = user;
    gj_tensor *h = gj_gelu(gj_linear(in[0], p[0], p[1])); /* [N, H] */
    h = h ? gj_linear(h, p[2], p[3]) : NULL;              /* [N, C] */
    out[0] = h ? gj_add(in[0], h) : NULL;                 /* [N, C] */
    return out[0] ? 0 : -1;
}

/* y = x; 8 times y = layer(y), each layer an activation-checkpoint region
 * with no policy (nothing inside is saved: backward recomputes the layer,
 * like torch.utils.checkpoint); loss = mean(y*y). */
static gj_tensor *w4_forward(bench_state *s) {
    gj_tensor *y = s->in[0]; /* [N, C] */
    for (int l = 0; l < W4_L && y; l++) {
        gj_tensor *out = NULL;
        if (gj_checkpoint(w4_layer, (void *)(s->params + 4 * l), 1, &y, 1, &out, NULL, NULL) != 0)
            return NULL;
        y = out;
    }
    gj_tensor *sq = y ? gj_mul(y, y) : NULL;
    return sq ? gj_mean(sq, 0, NULL, false) : NULL;
}

/* W4 without checkpointing (the reference for checkpointing's memory):
 * the same layers run directly, every activation saved for backward. */
static gj_tensor *w4_plain_forward(bench_state *s) {
    gj_tensor *y = s->in[0]; /* [N, C] */
    for (int l = 0; l < W4_L && y; l++) {
        gj_tensor *out = NULL;
        if (w4_layer((void *)(s->params + 4 * l), 1, &y, 1, &out) != 0) return NULL;
        y = out;
    }
    gj_tensor *sq = y ? gj_mul(y, y) : NULL;
    return sq ? gj_mean(sq, 0, NULL, false) : NULL;
}

/* ------------------------------------------------------ W5 bf16 mlp */

#define W5_LR 1e-3

/* W1's parameters initialised in f32 (kept as the master copies, not
 * requiring grad), cast to bf16 leaves that require grad. */
static int w5_setup(bench_state *s) {
    if (w1_setup(s) != 0)
        return -1;
    int n = s->n_params;
    s->n_params = 0;
    s->param_elems = 0;
    gj_tensor *f32[BENCH_MAX_PARAMS];
    for (int i = 0; i < n; i++)
        f32[i] = s->params[i];
    for (int i = 0; i < n; i++) {
        if (gj_set_requires_grad(f32[i], false) != 0)
            return -1;
        gj_no_grad_push();
        gj_tensor *b = own(s, gj_cast(f32[i], GJ_BF16));
        gj_no_grad_pop();
        if (add_param(s, b))
            return -1;
        s->masters[i] = f32[i];
    }
    return 0;
}

/* Each step casts the bf16 parameters to f32 (differentiable) and runs W1. */
static gj_tensor *w5_forward(bench_state *s) {
    gj_tensor *p[6];
    for (int i = 0; i < 6; i++)
        if (!(p[i] = gj_cast(s->params[i], GJ_F32)))
            return NULL;
    return mlp3_loss(p, s->in[0], s->in[1]);
}

/* Untimed SGD on the masters: m -= lr * f32(grad); param = bf16(m). */
static int w5_after_backward(bench_state *s) {
    int rc = 0;
    gj_no_grad_push();
    for (int i = 0; i < s->n_params && rc == 0; i++) {
        gj_tensor *g = gj_tensor_grad(s->params[i]);
        gj_tensor *g32 = g ? gj_cast(g, GJ_F32) : NULL;
        if (!g32 || gj_add_scaled_(s->masters[i], g32, -W5_LR) != 0 ||
            gj_copy_(s->params[i], s->masters[i]) != 0)
            rc = -1;
    }
    gj_no_grad_pop();
    return rc;
}

/* ------------------------------------------------------- G1, G2, G3 */

/* GPT-2 as llm.c defines it (examples/gpt2_model.h), B 4, T 64 (G3: B 1,
 * T 1024; G1u: attention and the head op by op), GPT-2's random initialisation (seed BENCH_SEED), vocabulary 50257 padded to
 * 50304. The tokens are the bytes of a local text (Debian's base-files
 * installs it everywhere; torch_ref.py reads the same bytes): tokens[i] =
 * byte i, targets[i] = byte i + 1. */
enum { G_B = 4, G_T = 64, G_V = 50257, G_VP = 50304, G_MAXT = 1024, G3_T = 1024 };
#define G_TEXT "/usr/share/common-licenses/GPL-3"
#define G_LR 1e-4 /* llm.c's AdamW: lr 1e-4, betas 0.9/0.999, eps 1e-8, no decay */

/* The model's batch and sequence length (G3: B 1, T 1024; else G_B, G_T). */
typedef struct g_model {
    gpt2 m;
    int64_t B, T;
} g_model;

static void g_model_free(void *m) {
    if (!m)
        return;
    gpt2_free(&((g_model *)m)->m);
    free(m);
}

static int g_setup(bench_state *s, int layers, int channels, int heads, int64_t B, int64_t T,
                   bool unfused) {
    gj_llmc_config cfg = {.max_seq_len = G_MAXT, .vocab_size = G_V, .num_layers = layers,
                          .num_heads = heads, .channels = channels, .padded_vocab_size = G_VP};
    g_model *gm = calloc(1, sizeof *gm);
    gj_tensor *file[GJ_LLMC_N_PARAMS];
    if (!gm)
        return -1;
    gpt2 *m = &gm->m;
    gm->B = B;
    gm->T = T;
    m->unfused = unfused;
    s->model = gm;
    s->model_free = g_model_free;
    if (gpt2_init_params(&cfg, BENCH_SEED, file) != 0 || gpt2_init_from(m, &cfg, file) != 0)
        return -1;
    m->unfused = unfused;
    if (gpt2_set_seq_len(m, T) != 0)
        return -1;
    for (int k = 0; k < m->n_leaves; k++)
        if (add_param(s, m->leaf[k]) != 0)
            return -1;
    int64_t n = B * T, shape[2] = {B, T};
    unsigned char *text = malloc((size_t)n + 1);
    int64_t *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    FILE *f = text && x && y ? fopen(G_TEXT, "rb") : NULL;
    size_t got = f ? fread(text, 1, (size_t)n + 1, f) : 0;
    if (f)
        fclose(f);
    if (got == (size_t)n + 1) {
        for (int64_t i = 0; i < n; i++) {
            x[i] = text[i];
            y[i] = text[i + 1];
        }
        s->in[0] = own(s, gj_from_data(GJ_I64, 2, shape, x)); /* tokens (B, T) */
        s->in[1] = own(s, gj_from_data(GJ_I64, 2, shape, y)); /* targets (B, T) */
    } else {
        fprintf(stderr, "bench: G1/G2/G3 read their tokens from " G_TEXT " (Debian's "
                        "base-files), which holds fewer than %lld bytes or cannot be read\n",
                (long long)n + 1);
    }
    free(text), free(x), free(y);
    if (got != (size_t)n + 1)
        return -1;
    s->n_in = 2;
    s->opt = gj_adamw_new(s->n_params, s->params, G_LR, 0.9, 0.999, 1e-8, 0.0);
    return s->in[0] && s->in[1] && s->opt ? 0 : -1;
}

static int g1_setup(bench_state *s) { return g_setup(s, 6, 384, 6, G_B, G_T, false); }
static int g2_setup(bench_state *s) { return g_setup(s, 12, 768, 12, G_B, G_T, false); }
static int g3_setup(bench_state *s) { return g_setup(s, 6, 384, 6, 1, G3_T, false); }
static int g1u_setup(bench_state *s) { return g_setup(s, 6, 384, 6, G_B, G_T, true); }

static gj_tensor *g_forward(bench_state *s) {
    return gpt2_loss(&((g_model *)s->model)->m, s->n_in, s->in);
}

/* Untimed, as W5's SGD: the model trains as llm.c's (the PyTorch side too). */
static int g_after_backward(bench_state *s) { return gj_optim_step(s->opt); }

/* Per layer: qkv, attention projection, fc, fc projection over B*T rows
 * (12 C^2 per row), and q k^T and att v over the keys the causal mask
 * keeps ((T + 1) / 2 per query on average, 2 C each); then the tied head
 * (C x Vp per row). The fused ops do work the compiled backward's GEMM
 * count (paired_step.c) does not see, so it is counted here: the fused
 * attention's backward (its four block products: twice the forward's)
 * and the fused head's two gradient GEMMs, which its forward runs (its
 * GEMMs stop at V). */
static double g_flops(const bench_state *s) {
    const g_model *gm = s->model;
    const gpt2 *m = &gm->m;
    double bt = (double)gm->B * gm->T, c = m->cfg.channels, keys = (gm->T + 1) / 2.0;
    double attn = 2.0 * 2.0 * bt * keys * c * (m->unfused ? 1.0 : 3.0);
    double head = 2.0 * bt * c * (m->unfused ? m->cfg.padded_vocab_size : 3.0 * m->cfg.vocab_size);
    return m->cfg.num_layers * (2.0 * bt * 12.0 * c * c + attn) + head;
}

/* ----------------------------------------------------------- registry */

#define STEP_LR 1e-3 /* a step's AdamW (docs/benchmarks.md) unless a row says otherwise */
#define STEP_WD 0.01 /* torch.optim.AdamW's default */

const bench_workload bench_workloads[] = {
    {"W1", "mlp", "x[256,784] 784-1024-1024-10 GELU, CE(i64)", NULL, w1_setup, w1_forward, NULL,
     false, w1_flops, STEP_LR, STEP_WD, NULL, false, GJ_F32},
    {"W2", "pointwise", "x,w,b[4194304] sum(tanh(xw+b)sig(x)+exp(-x^2))", NULL, w2_setup,
     w2_forward, NULL, false, NULL, STEP_LR, STEP_WD, NULL, false, GJ_F32},
    {"W3", "block", "B8 T128 C256 H4 causal pre-norm block", NULL, w3_setup, w3_forward, NULL,
     false, w3_flops, STEP_LR, STEP_WD, NULL, false, GJ_F32},
    {"W4", "deep-mlp-ckpt", "x[128,512] 8x(512-2048-512 GELU)+res, ckpt", "8 ckpt regions",
     w4_setup, w4_forward, NULL, true, w4_flops, STEP_LR, STEP_WD, NULL, false, GJ_F32},
    {"W4n", "deep-mlp", "W4 without checkpointing (memory reference)", "no ckpt", w4_setup,
     w4_plain_forward, NULL, false, w4_flops, STEP_LR, STEP_WD, NULL, false, GJ_F32},
    {"W5", "bf16-mlp", "W1, bf16 params, f32 masters+math", "SGD step untimed", w5_setup,
     w5_forward, w5_after_backward, false, w1_flops, STEP_LR, STEP_WD,
     "its update is SGD on f32 master copies, not an optimizer's step", false, GJ_F32},
    {"F1", "fashion-mlp", "x[128,784] 784-512-256-10 GELU, CE(i64)", NULL, f1_setup, w1_forward,
     NULL, false, f1_flops, STEP_LR, STEP_WD, NULL, false, GJ_F32},
    {"G1", "gpt2-d6", "GPT-2 L6 C384 H6 V50257 B4 T64 (llm.c)", "AdamW untimed", g1_setup,
     g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL, false, GJ_F32},
    {"G2", "gpt2-124M", "GPT-2 L12 C768 H12 V50257 B4 T64 (llm.c)", "AdamW untimed", g2_setup,
     g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL, true, GJ_F32},
    {"F1b", "fashion-bf16", "F1 in bf16 mixed precision (autocast)", NULL, f1_setup, w1_forward,
     NULL, false, f1_flops, STEP_LR, STEP_WD, NULL, true, GJ_BF16},
    {"G1b", "gpt2-d6-bf16", "G1 in bf16 mixed precision (autocast)", "AdamW untimed", g1_setup,
     g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL, true, GJ_BF16},
    {"G2b", "gpt2-124M-bf16", "G2 in bf16 mixed precision (autocast)", "AdamW untimed", g2_setup,
     g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL, true, GJ_BF16},
    {"G3", "gpt2-d6-T1024", "G1's model at B1 T1024 (fused attention and head)", "AdamW untimed",
     g3_setup, g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL, true, GJ_F32},
    {"G3b", "gpt2-d6-T1024-bf16", "G3 in bf16 mixed precision (autocast)", "AdamW untimed",
     g3_setup, g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL, true, GJ_BF16},
    {"G1u", "gpt2-d6-unfused", "G1 with attention and head op by op (T x T, logits)",
     "AdamW untimed", g1u_setup, g_forward, g_after_backward, false, g_flops, G_LR, 0.0, NULL,
     true, GJ_F32},
};
const int bench_n_workloads = (int)(sizeof bench_workloads / sizeof bench_workloads[0]);

gj_tensor *bench_forward(const bench_workload *wl, bench_state *s) {
    gj_dtype ac0 = gj_get_autocast();
    gj_set_autocast(wl->autocast);
    gj_tensor *loss = wl->forward(s);
    gj_set_autocast(ac0);
    return loss;
}

unsigned bench_all_workloads(void) {
    unsigned all = 0;
    for (int i = 0; i < bench_n_workloads; i++)
        if (!bench_workloads[i].opt_in)
            all |= 1u << i;
    return all;
}
