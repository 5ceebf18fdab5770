/* SPDX-License-Identifier: MIT */
/*
 * gpt2_model.h - GPT-2 as karpathy/llm.c's train_gpt2.c computes it, written
 * with ordinary gradjit ops, over the parameters of an llm.c checkpoint
 * (gj_llmc_load_model). Header-only (static inline functions), shared by
 * examples/train_gpt2.c, tests/test_gpt2.c and bench/workloads.c (G1, G2);
 * not part of the library.
 *
 * Legend: B batch, T sequence length (<= maxT), C channels, NH heads, hs =
 * C / NH head size, L layers, V vocabulary, Vp padded vocabulary (>= V).
 *
 *   x = wte[tokens] + wpe[0:T]                                   (B, T, C)
 *   per layer l:
 *     qkv = LN(x; ln1w, ln1b) qkvw^T + qkvb                      (B, T, 3C)
 *     a   = softmax(q k^T / sqrt(hs), causal) v, per head        (B, NH, T, hs)
 *     x   = x + a attprojw^T + attprojb                          (B, T, C)
 *     x   = x + gelu_tanh(LN(x; ln2w, ln2b) fcw^T + fcb) fcprojw^T + fcprojb
 *   logits = LN(x; lnfw, lnfb) wte^T  (tied, padded)             (B, T, Vp)
 *   loss = mean cross-entropy of logits[..., 0:V] against targets
 * By default attention is gj_scaled_dot_product_attention and the loss
 * gj_linear_cross_entropy over wte[0:V] (the same function; neither the
 * T x T scores nor the logits are ever held); with `unfused` set the
 * formula is written out op by op (matmul, masked_fill, softmax, matmul;
 * linear, narrow, cross_entropy), as llm.c computes it.
 * LayerNorm eps 1e-5 (llm.c's). The padded logit columns [V, Vp) are cut
 * off with gj_narrow before the loss, so they take no part in it, exactly
 * as llm.c's softmax and cross-entropy loop only over [0, V): wte's padded
 * rows get a zero gradient from the head (and none from the embedding,
 * since tokens are < V).
 *
 * Invariants:
 *   - The model owns llm.c's 16 tensors (file[], dtype f32 or f64, not
 *     requiring grad): they hold every parameter's values in llm.c's
 *     layout, so they are what gets saved. The trainable leaves (leaf[])
 *     are views of them sharing their storage: one per layer for the
 *     per-layer tensors ([L, ...] sliced at l), the whole tensor for wte,
 *     wpe, lnfw, lnfb. An optimizer updating a leaf in place updates the
 *     file tensor; a load into a file tensor (gj_state_dict_copy_into)
 *     changes the leaves.
 *   - gpt2_loss is the whole forward of a training step from its two
 *     inputs; it takes no other state than the model and its causal mask.
 *   - Every function returns 0 / a tensor, or -1 / NULL with
 *     gj_last_error() set; tensors returned are new references (owned by
 *     the innermost open scope, as every gradjit op's result).
 */
#ifndef GJ_EXAMPLES_GPT2_MODEL_H
#define GJ_EXAMPLES_GPT2_MODEL_H

#include "gradjit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GPT2_LN_EPS 1e-5
/* Parameter tensors that have one slice per layer (indices into llm.c's 16). */
#define GPT2_PER_LAYER 12

typedef struct gpt2 {
    gj_llmc_config cfg;
    gj_dtype dtype;
    gj_tensor *file[GJ_LLMC_N_PARAMS]; /* llm.c's tensors: owned, no grad */
    gj_tensor **leaf;                  /* [n_leaves] trainable views: owned */
    int n_leaves;                      /* 2 + 12 L + 2 */
    gj_tensor *mask;                   /* unfused: (T, T), 1 above the diagonal; owned */
    int64_t mask_T;                    /* the sequence length of gpt2_set_seq_len */
    bool unfused;                      /* the op-by-op formula (set before gpt2_set_seq_len) */
} gpt2;

/* Index into leaf[] of llm.c tensor i (0..15) at layer l (ignored for wte,
 * wpe, lnfw, lnfb). Leaves are ordered wte, wpe, then layer by layer ln1w
 * ... fcprojb, then lnfw, lnfb. */
static inline int gpt2_leaf_index(const gpt2 *m, int i, int l) {
    if (i < 2)
        return i;
    if (i >= 14)
        return 2 + GPT2_PER_LAYER * m->cfg.num_layers + (i - 14);
    return 2 + GPT2_PER_LAYER * l + (i - 2);
}

static inline void gpt2_free(gpt2 *m) {
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        gj_release(m->file[i]);
        m->file[i] = NULL;
    }
    for (int k = 0; k < m->n_leaves; k++)
        gj_release(m->leaf[k]);
    free(m->leaf);
    gj_release(m->mask);
    memset(m, 0, sizeof *m);
}

/* A trainable leaf sharing the storage of file tensor t: t itself (l < 0)
 * or its slice l along the first dimension. New reference (the caller's,
 * not a scope's), requiring grad, named "<name>" or "<name>.<l>". */
static inline gj_tensor *gpt2_make_leaf(gj_tensor *t, const char *name, int l) {
    gj_tensor *v = t, *s = NULL, *leaf = NULL;
    if (l >= 0) {
        int nd = gj_tensor_ndim(t) - 1;
        int64_t shape[GJ_MAX_DIMS];
        memcpy(shape, gj_tensor_shape(t) + 1, (size_t)nd * sizeof *shape);
        s = gj_narrow(t, 0, l, 1);
        v = s ? gj_view(s, nd, shape) : NULL;
    }
    leaf = v ? gj_detach(v) : NULL;
    if (leaf)
        gj_scope_keep(leaf);
    if (v != t)
        gj_release(v);
    gj_release(s);
    char nm[64];
    if (l >= 0)
        snprintf(nm, sizeof nm, "%s.%d", name, l);
    else
        snprintf(nm, sizeof nm, "%s", name);
    if (leaf && (gj_set_requires_grad(leaf, true) != 0 || gj_tensor_set_name(leaf, nm) != 0)) {
        gj_release(leaf);
        return NULL;
    }
    return leaf;
}

/* Takes the 16 tensors of file (stolen: the model owns them from here on,
 * and frees them on failure too) with configuration cfg, and makes the
 * leaves. 0 or -1. */
static inline int gpt2_init_from(gpt2 *m, const gj_llmc_config *cfg, gj_tensor **file) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->dtype = gj_tensor_dtype(file[0]);
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++)
        m->file[i] = file[i];
    int L = cfg->num_layers;
    m->n_leaves = 2 + GPT2_PER_LAYER * L + 2;
    if (!(m->leaf = calloc((size_t)m->n_leaves, sizeof *m->leaf))) {
        fprintf(stderr, "gpt2: out of memory\n");
        gpt2_free(m);
        return -1;
    }
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        bool per_layer = i >= 2 && i < 14;
        for (int l = 0; l < (per_layer ? L : 1); l++) {
            gj_tensor *leaf = gpt2_make_leaf(m->file[i], gj_llmc_param_name(i), per_layer ? l : -1);
            if (!leaf) {
                gpt2_free(m);
                return -1;
            }
            m->leaf[gpt2_leaf_index(m, i, l)] = leaf;
        }
    }
    return 0;
}

/* ZeRO stage 3 gives every leaf memory of its own (gj_ddp_options.zero):
 * llm.c's tensors are then only the save and load format. gpt2_files_drop
 * frees them, gpt2_files_make makes them again (zeros), gpt2_files_sync
 * copies the leaves into them or (into_leaves) them into the leaves --
 * with the leaves unsharded (gj_ddp_unshard) on every rank. 0 or -1. */
static inline void gpt2_files_drop(gpt2 *m) {
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        gj_release(m->file[i]);
        m->file[i] = NULL;
    }
}

static inline int gpt2_files_make(gpt2 *m) {
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int64_t s[3];
        int nd = gj_llmc_param_shape(&m->cfg, i, s);
        if (!m->file[i] && (nd < 0 || !(m->file[i] = gj_zeros(m->dtype, nd, s))))
            return -1;
    }
    return 0;
}

static inline int gpt2_files_sync(gpt2 *m, bool into_leaves) {
    size_t es = m->dtype == GJ_F64 ? 8 : 4;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        bool per_layer = i >= 2 && i < 14;
        char *f = gj_tensor_data(m->file[i]);
        for (int l = 0; l < (per_layer ? m->cfg.num_layers : 1); l++) {
            gj_tensor *leaf = m->leaf[gpt2_leaf_index(m, i, l)];
            size_t n = (size_t)gj_tensor_numel(leaf) * es;
            char *v = gj_tensor_data(leaf);
            if (!f || !v)
                return -1;
            memcpy(into_leaves ? v : f + (size_t)(per_layer ? l : 0) * n,
                   into_leaves ? f + (size_t)(per_layer ? l : 0) * n : v, n);
        }
    }
    return 0;
}

/* Loads an llm.c checkpoint in dtype (f32, or f64 for gradient checks).
 * 0 or -1. */
static inline int gpt2_load(gpt2 *m, const char *path, gj_dtype dtype) {
    gj_llmc_config cfg;
    gj_tensor *file[GJ_LLMC_N_PARAMS];
    memset(m, 0, sizeof *m);
    if (gj_llmc_load_model(path, dtype, &cfg, file) != 0)
        return -1;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++)
        gj_scope_keep(file[i]);
    return gpt2_init_from(m, &cfg, file);
}

/* GPT-2's initialisation in llm.c's layout, f32, into file[0..16) (new
 * references, the caller's): weights normal(0, 0.02), the residual
 * projections attprojw and fcprojw normal(0, 0.02 / sqrt(2 L)), wte's
 * padded rows [V, Vp) zero, LayerNorm weights 1, biases 0; drawn with
 * gradjit's generator from seed, in llm.c's tensor order. 0 or -1. */
static inline int gpt2_init_params(const gj_llmc_config *cfg, uint64_t seed, gj_tensor **file) {
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++)
        file[i] = NULL;
    if (gj_llmc_config_check(cfg) != 0)
        return -1;
    gj_manual_seed(seed);
    double resid = 0.02 / sqrt(2.0 * cfg->num_layers);
    /* per tensor: wte (special), n normal 0.02, r residual projection,
     * 1 ones, 0 zeros */
    static const char kind[GJ_LLMC_N_PARAMS + 1] = "wn10n0r010n0r010";
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int64_t shape[3];
        int nd = gj_llmc_param_shape(cfg, i, shape);
        gj_tensor *t = NULL;
        if (i == 0) { /* wte: V random rows, then the padding's zero rows */
            int64_t vs[2] = {cfg->vocab_size, cfg->channels};
            gj_tensor *real = gj_randn(GJ_F32, 2, vs, 0.02);
            t = real ? gj_zeros(GJ_F32, nd, shape) : NULL;
            gj_tensor *top = t ? gj_narrow(t, 0, 0, cfg->vocab_size) : NULL;
            if (!top || gj_copy_(top, real) != 0) {
                gj_release(t);
                t = NULL;
            }
            gj_release(top);
            gj_release(real);
        } else if (kind[i] == 'n') { /* wpe, qkvw, fcw */
            t = gj_randn(GJ_F32, nd, shape, 0.02);
        } else if (kind[i] == 'r') { /* attprojw, fcprojw */
            t = gj_randn(GJ_F32, nd, shape, resid);
        } else if (kind[i] == '1') { /* ln1w, ln2w, lnfw */
            t = gj_ones(GJ_F32, nd, shape);
        } else { /* biases */
            t = gj_zeros(GJ_F32, nd, shape);
        }
        if (!t)
            goto fail;
        file[i] = gj_scope_keep(t);
    }
    return 0;
fail:
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        gj_release(file[i]);
        file[i] = NULL;
    }
    return -1;
}

/* Makes the causal mask for sequences of T tokens (T <= maxT). 0 or -1. */
static inline int gpt2_set_seq_len(gpt2 *m, int64_t T) {
    if (T < 1 || T > m->cfg.max_seq_len) {
        fprintf(stderr, "gpt2: sequence length %lld is not in [1, max_seq_len %d]\n",
                (long long)T, m->cfg.max_seq_len);
        return -1;
    }
    if (m->mask_T == T && (m->mask || !m->unfused))
        return 0;
    m->mask_T = T;
    if (!m->unfused)
        return 0;
    float *v = malloc((size_t)(T * T) * sizeof *v);
    if (!v)
        return -1;
    for (int64_t i = 0; i < T; i++)
        for (int64_t j = 0; j < T; j++)
            v[i * T + j] = j > i ? 1.0f : 0.0f;
    int64_t s[2] = {T, T};
    gj_tensor *mask = gj_from_data(GJ_F32, 2, s, v);
    free(v);
    if (!mask)
        return -1;
    gj_release(m->mask);
    m->mask = gj_scope_keep(mask);
    m->mask_T = T;
    return 0;
}

/* Head idx (0 q, 1 k, 2 v) of qkv (B, T, 3C) as (B, NH, T, hs): a view. */
static inline gj_tensor *gpt2_heads(const gpt2 *m, gj_tensor *qkv, int idx, int64_t B, int64_t T) {
    static const int perm[4] = {0, 2, 1, 3};
    int64_t C = m->cfg.channels, NH = m->cfg.num_heads;
    int64_t hs[4] = {B, T, NH, C / NH};
    gj_tensor *h = gj_narrow(qkv, 2, idx * C, C); /* (B, T, C) */
    h = h ? gj_reshape(h, 4, hs) : NULL;           /* (B, T, NH, hs) */
    return h ? gj_permute(h, perm) : NULL;          /* (B, NH, T, hs) */
}

/* Causal self-attention of q, k, v (B, NH, T, hs). */
static inline gj_tensor *gpt2_attention(gpt2 *m, gj_tensor *q, gj_tensor *k, gj_tensor *v) {
    double scale = 1.0 / sqrt((double)gj_tensor_shape(q)[3]);
    if (!m->unfused)
        return gj_scaled_dot_product_attention(q, k, v, true, scale, 0.0, false);
    gj_tensor *kt = gj_transpose(k, 2, 3);                     /* (B, NH, hs, T) */
    gj_tensor *att = kt ? gj_matmul(q, kt) : NULL;             /* (B, NH, T, T) */
    att = att ? gj_mul_scalar(att, scale) : NULL;
    att = att ? gj_masked_fill(att, m->mask, -INFINITY) : NULL;
    att = att ? gj_softmax(att, -1) : NULL;
    return att ? gj_matmul(att, v) : NULL;                     /* (B, NH, T, hs) */
}

/* Block l of the model on x (B, T, C): new reference, or NULL. */
static inline gj_tensor *gpt2_block(gpt2 *m, gj_tensor *x, int l) {
    static const int perm[4] = {0, 2, 1, 3};
    const int64_t *xs = gj_tensor_shape(x);
    int64_t B = xs[0], T = xs[1], cs[3] = {xs[0], xs[1], xs[2]};
    gj_tensor **p = m->leaf + 2 + GPT2_PER_LAYER * l; /* ln1w ... fcprojb of layer l */
    gj_tensor *h = gj_layer_norm(x, p[0], p[1], GPT2_LN_EPS); /* (B, T, C) */
    gj_tensor *qkv = h ? gj_linear(h, p[2], p[3]) : NULL;     /* (B, T, 3C) */
    gj_tensor *q = qkv ? gpt2_heads(m, qkv, 0, B, T) : NULL;  /* (B, NH, T, hs) */
    gj_tensor *k = q ? gpt2_heads(m, qkv, 1, B, T) : NULL;
    gj_tensor *v = k ? gpt2_heads(m, qkv, 2, B, T) : NULL;
    gj_tensor *y = v ? gpt2_attention(m, q, k, v) : NULL;    /* (B, NH, T, hs) */
    y = y ? gj_permute(y, perm) : NULL;                       /* (B, T, NH, hs) */
    y = y ? gj_reshape(y, 3, cs) : NULL;                      /* (B, T, C) */
    y = y ? gj_linear(y, p[4], p[5]) : NULL;
    x = y ? gj_add(x, y) : NULL;                              /* (B, T, C) */
    h = x ? gj_layer_norm(x, p[6], p[7], GPT2_LN_EPS) : NULL;
    h = h ? gj_linear(h, p[8], p[9]) : NULL;                  /* (B, T, 4C) */
    h = h ? gj_gelu(h) : NULL;
    h = h ? gj_linear(h, p[10], p[11]) : NULL;                /* (B, T, C) */
    return h ? gj_add(x, h) : NULL;
}

/* The final layer norm's output (B, T, C) of tokens (B, T) i64 (borrowed),
 * T the length of gpt2_set_seq_len. Each block runs in a scope of its own that keeps only its output: what
 * the backward needs stays referenced by the autograd graph, the rest is
 * freed block by block, so a forward under no-grad (the val loss) holds
 * one block's temporaries at a time instead of the whole model's.
 * Scope-owned new reference, or NULL. */
static inline gj_tensor *gpt2_hidden(gpt2 *m, gj_tensor *tokens) {
    const int64_t *ts = gj_tensor_shape(tokens);
    if (gj_tensor_ndim(tokens) != 2 || ts[1] != m->mask_T || (m->unfused && !m->mask)) {
        fprintf(stderr, "gpt2: tokens must be (B, T) with T the length of gpt2_set_seq_len\n");
        return NULL;
    }
    gj_tensor *pos = gj_narrow(m->leaf[1], 0, 0, ts[1]);             /* (T, C) */
    gj_tensor *x = pos ? gj_embedding(m->leaf[0], tokens) : NULL;    /* (B, T, C) */
    x = x ? gj_add(x, pos) : NULL;
    gj_tensor *own = NULL; /* x when it is a block's output (ours, not the scope's) */
    for (int l = 0; l < m->cfg.num_layers && x; l++) {
        gj_scope_push();
        gj_tensor *y = gpt2_block(m, x, l);
        if (y) gj_scope_keep(y);
        gj_scope_pop();
        if (own) gj_release(own);
        own = x = y;
    }
    gj_tensor **f = m->leaf + 2 + GPT2_PER_LAYER * m->cfg.num_layers; /* lnfw, lnfb */
    gj_tensor *out = x ? gj_layer_norm(x, f[0], f[1], GPT2_LN_EPS) : NULL;
    if (own) gj_release(own);
    return out;
}

/* Logits (B, T, Vp) of tokens (B, T) i64 (borrowed). Scope-owned new
 * reference, or NULL. */
static inline gj_tensor *gpt2_logits(gpt2 *m, gj_tensor *tokens) {
    gj_tensor *x = gpt2_hidden(m, tokens);
    return x ? gj_linear(x, m->leaf[0], NULL) : NULL; /* (B, T, Vp) */
}

/* The training step's forward, as gj_step will take it: in[0] tokens and
 * in[1] targets, both (B, T) i64 (borrowed); ctx is the gpt2. Returns the
 * mean cross-entropy over the B T positions and the real vocabulary (a 0-d
 * tensor of the model's dtype; scope-owned new reference), or NULL. */
static inline gj_tensor *gpt2_loss(void *ctx, int n_in, gj_tensor *const *in) {
    gpt2 *m = ctx;
    if (n_in != 2 || gj_tensor_ndim(in[0]) != 2) {
        fprintf(stderr, "gpt2_loss: takes tokens and targets, (B, T) each\n");
        return NULL;
    }
    const int64_t *ts = gj_tensor_shape(in[0]);
    int64_t BT = ts[0] * ts[1], ls[2] = {BT, m->cfg.padded_vocab_size};
    if (!m->unfused) { /* the head over wte's first V rows, fused */
        gj_tensor *x = gpt2_hidden(m, in[0]);                 /* (B, T, C) */
        gj_tensor *w = x ? gj_narrow(m->leaf[0], 0, 0, m->cfg.vocab_size) : NULL; /* (V, C) */
        return w ? gj_linear_cross_entropy(x, w, NULL, in[1], -1) : NULL;
    }
    gj_tensor *logits = gpt2_logits(m, in[0]);               /* (B, T, Vp) */
    logits = logits ? gj_reshape(logits, 2, ls) : NULL;      /* (B T, Vp) */
    logits = logits ? gj_narrow(logits, 1, 0, m->cfg.vocab_size) : NULL; /* (B T, V) */
    gj_tensor *y = logits ? gj_reshape(in[1], 1, &BT) : NULL; /* (B T) */
    return y ? gj_cross_entropy(logits, y) : NULL;
}

#endif /* GJ_EXAMPLES_GPT2_MODEL_H */
