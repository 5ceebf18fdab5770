/* SPDX-License-Identifier: MIT */
/*
 * train_gpt2.c - trains GPT-2 from karpathy/llm.c's files as llm.c's
 * train_gpt2.c does, eagerly, with compiled autograd or with the compiled
 * training step, and prints each step as llm.c prints it, so the two
 * outputs compare line by line.
 *
 *   train_gpt2 --model gpt2_124M.bin --train tiny_shakespeare_train.bin
 *              [--val tiny_shakespeare_val.bin] [--batch 4] [--seq 64]
 *              [--steps 41] [--lr 1e-4] [--compiled-autograd | --compiled-step]
 *              [--threads N]
 *              [--shuffle] [--sample 63] [--tokenizer gpt2_tokenizer.bin]
 *              [--seed 1337] [--save FILE.bin | FILE.safetensors]
 *              [--resume FILE.safetensors] [--stop-after N]
 *   mpirun -np N train_gpt2 --ddp ...   (data parallel: --batch per rank)
 *   train_gpt2 --init-model FILE.bin [--layers 12 --channels 768 --heads 12
 *              --vocab 50257 --padded-vocab 50304 --max-seq 1024 --seed S]
 *   train_gpt2 --make-tokens IN.txt OUT.bin     (byte values as token ids)
 *   train_gpt2 --make-tokenizer FILE.bin        (the matching 257-piece tokenizer)
 *
 * Files (frontend/llmc.c reads and writes them byte for byte as llm.c):
 * the model checkpoint (gpt2_124M.bin, or --init-model's), token files
 * (the .bin files of llm.c's dev/data/ scripts, or --make-tokens'), the tokenizer
 * (gpt2_tokenizer.bin, or --make-tokenizer's) used to print samples.
 *
 * What llm.c's main does, and so this program (llm.c at the commit named
 * in tests/test_gpt2.c): steps 0 .. steps-1, each on the next batch of the
 * train file in file order (llm.c's train loader shuffles: --shuffle draws
 * the same order; without it, the order of llm.c's unshuffled loader);
 * before step s, when s % 10 == 0 and --val is given, "val loss %f" over 5
 * batches of the val file from its start; when s > 0 and s % 20 == 0,
 * --sample tokens generated from the end-of-text token (the tokenizer's,
 * or V-1 without one, which is GPT-2's 50256) with llm.c's xorshift
 * sampler seeded --seed (1337 in llm.c) and printed between "generating:"
 * and "---" lines; then the step: forward (the mean cross-entropy over
 * the real vocabulary), backward, AdamW as llm.c's gpt2_update (lr 1e-4,
 * betas 0.9/0.999, eps 1e-8, no weight decay: llm.c's float constants),
 * and "step %d: train loss %f (took %f ms)" (batch, forward, backward and
 * update, as llm.c times it). After each of the first two steps this
 * program adds "gradjit: step N paid ...": the step's time split into
 * compile, GEMM choices and running, and the new memory it touched; after
 * the last step a summary (mean step time, peak tensor memory). llm.c
 * prints neither.
 *
 * The step's forward is gpt2_loss of gpt2_model.h: one function from the
 * step's inputs (tokens, targets) to the loss, with the optimizer apart. It
 * is run by examples/common.h's stepper: eagerly through gj_step (the
 * default), through gj_step compiled (--compiled-step: forward, backward
 * and AdamW as one program from the second step on), or as forward,
 * gj_backward with compiled autograd and gj_optim_step
 * (--compiled-autograd); the same bits in every mode. The summary adds the
 * median step time after the first and the counters of the compiled mode.
 * The flags' checks and mode, stopping, and the checkpoint's common part
 * and metadata helpers are examples/trainer.h's (the loop is llm.c's, so
 * this program keeps its own).
 *
 * --ddp (under mpirun): every rank holds the model, reads its slice of each
 * chunk of N x B x T tokens in llm.c's DDP order (gj_llmc_loader_new_rank),
 * and the gradients are averaged over the ranks before AdamW (gj_ddp; in
 * every mode, inside the program with --compiled-step); printed train and
 * val losses are the means over the ranks. Unshuffled, N ranks at --batch B
 * train what one process at --batch N*B trains. Rank 0 prints, samples and
 * saves.
 *
 * Checkpoints: --save FILE.bin writes llm.c's checkpoint format (llm.c can
 * continue from it); --save FILE.safetensors writes the parameters under
 * llm.c's names ("model.wte", ...), the AdamW state, the step, the loaders'
 * positions and the sampler's state through gradjit's state dict API, and
 * --resume FILE.safetensors continues from it bit-identically (same
 * --batch, --seq, --shuffle, files and --threads; the precision (--bf16)
 * and --lr are recorded and must be the checkpoint's: trainer.h). --save
 * is written at the end, on Ctrl-C (the step under way finishes; exit
 * status 130) and at --stop-after N steps of this run.
 *
 * Invariants: every training step, evaluation batch and generated token
 * runs inside gj_scope_push/pop; the model, optimizer, loaders and
 * tokenizer are released before exit; the model's parameters live in
 * llm.c's 16 tensors (gpt2_model.h), so saving writes those.
 */
#include "gradjit.h"
#include "args.h"
#include "common.h"
#include "gpt2_model.h"
#include "trainer.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PROG "train_gpt2"
#define VAL_EVERY 10   /* llm.c: step % 10 == 0 */
#define VAL_BATCHES 5  /* llm.c: val_num_batches */
#define SAMPLE_EVERY 20

typedef struct opts {
    /* making files */
    const char *init_model, *make_tokens[2], *make_tokenizer;
    int layers, channels, heads, vocab, padded_vocab, max_seq;
    /* training (f: the modes, --batch, --lr, --seed, --threads, checkpoints) */
    train_flags f;
    const char *model, *train, *val, *tokenizer;
    int seq, sample;
    bool unfused; /* --unfused: attention and the head op by op */
    int memory_budget; /* --memory-budget MiB (0: none) */
    int64_t steps;
    bool shuffle, sample_given;
    bool ddp;       /* data parallel over the MPI ranks of mpirun */
    int zero;       /* --zero 1|2|3: ZeRO's stage (with --ddp) */
    gj_pg *pg;      /* --ddp: the world group */
    int rank, size; /* 0 and 1 without --ddp */
} opts;

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* ------------------------------------------------------- making files */

/* --init-model: GPT-2's initialisation written as an llm.c checkpoint. */
static int init_model(const opts *o) {
    gj_llmc_config cfg = {.max_seq_len = o->max_seq, .vocab_size = o->vocab,
                          .num_layers = o->layers, .num_heads = o->heads,
                          .channels = o->channels, .padded_vocab_size = o->padded_vocab};
    if (cfg.padded_vocab_size == 0) /* llm.c pads to a multiple of 128 */
        cfg.padded_vocab_size = (int)(((int64_t)cfg.vocab_size + 127) / 128 * 128);
    gj_tensor *file[GJ_LLMC_N_PARAMS];
    int64_t n = gj_llmc_num_parameters(&cfg);
    if (n < 0 || gpt2_init_params(&cfg, o->f.seed, file) != 0) {
        fprintf(stderr, PROG ": --init-model: %s\n", gj_last_error());
        return 1;
    }
    int rc = gj_llmc_save_model(o->init_model, &cfg, file);
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++)
        gj_release(file[i]);
    if (rc != 0) {
        fprintf(stderr, PROG ": %s\n", gj_last_error());
        return 1;
    }
    printf("wrote %s: GPT-2 initialisation (seed %" PRIu64 "), max_seq_len %d, vocab_size %d, "
           "padded_vocab_size %d, num_layers %d, num_heads %d, channels %d: %" PRId64
           " parameters\n",
           o->init_model, o->f.seed, cfg.max_seq_len, cfg.vocab_size, cfg.padded_vocab_size,
           cfg.num_layers, cfg.num_heads, cfg.channels, n);
    return 0;
}

/* --make-tokens IN OUT: the bytes of IN as token ids. */
static int make_tokens(const char *in, const char *out) {
    FILE *f = fopen(in, "rb");
    if (!f) {
        fprintf(stderr, PROG ": --make-tokens: cannot read %s: %s\n", in, strerror(errno));
        return 1;
    }
    uint16_t *tok = NULL;
    size_t n = 0, cap = 0;
    int c, rc = 1;
    while ((c = getc(f)) != EOF) {
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 1 << 16;
            uint16_t *t = nc <= INT32_MAX ? realloc(tok, nc * sizeof *t) : NULL;
            if (!t) {
                fprintf(stderr, PROG ": --make-tokens: %s is too large (out of memory or more "
                                "than 2^31 - 1 tokens)\n", in);
                goto done;
            }
            tok = t;
            cap = nc;
        }
        tok[n++] = (uint16_t)c;
    }
    if (ferror(f)) {
        fprintf(stderr, PROG ": --make-tokens: error reading %s\n", in);
        goto done;
    }
    if (n == 0) {
        fprintf(stderr, PROG ": --make-tokens: %s is empty\n", in);
        goto done;
    }
    if (gj_llmc_save_tokens(out, tok, (int64_t)n) != 0) {
        fprintf(stderr, PROG ": %s\n", gj_last_error());
        goto done;
    }
    printf("wrote %s: %zu tokens (the bytes of %s; token ids 0-255, a model needs "
           "--vocab >= 256)\n", out, n, in);
    rc = 0;
done:
    fclose(f);
    free(tok);
    return rc;
}

/* --make-tokenizer FILE: byte b is token b, end-of-text is token 256. */
static int make_tokenizer(const char *path) {
    static char bytes[256];
    const char *pieces[257];
    int lens[257];
    for (int b = 0; b < 256; b++) {
        bytes[b] = (char)b;
        pieces[b] = &bytes[b];
        lens[b] = 1;
    }
    pieces[256] = "<|endoftext|>";
    lens[256] = (int)strlen(pieces[256]);
    if (gj_llmc_tokenizer_save(path, 257, pieces, lens, 256) != 0) {
        fprintf(stderr, PROG ": %s\n", gj_last_error());
        return 1;
    }
    printf("wrote %s: byte-level tokenizer, 257 pieces (bytes 0-255, end-of-text 256)\n", path);
    return 0;
}

/* ------------------------------------------------------------ sampling */

/* llm.c's sampler: xorshift* and a float in [0, 1), then the first index
 * whose cumulative probability exceeds the coin. */
static uint32_t random_u32(uint64_t *state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float random_f32(uint64_t *state) { return (float)(random_u32(state) >> 8) / 16777216.0f; }

static int sample_mult(const float *p, int n, float coin) {
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += p[i];
        if (coin < cdf)
            return i;
    }
    return n - 1;
}

/* Prints a piece as llm.c's safe_printf: a lone byte only if printable or
 * white space. */
static void print_piece(const char *s, size_t len) {
    if (len == 0)
        return;
    if (len == 1 && !(isprint((unsigned char)s[0]) || isspace((unsigned char)s[0])))
        return;
    fwrite(s, 1, len, stdout);
}

/* Generates n tokens as llm.c does: position 0 holds the end-of-text
 * token, token t is drawn from the softmax (over the real vocabulary, in
 * f32 as llm.c) of the logits at t - 1 of a full-length forward (row 0 of
 * llm.c's batch: one row here). Prints them as it goes. 0 or -1. */
static int generate(gpt2 *m, int64_t T, int n, int64_t eot, const gj_llmc_tokenizer *tok,
                    uint64_t *rng) {
    int V = m->cfg.vocab_size, rc = -1;
    int64_t *ids = malloc((size_t)T * sizeof *ids);
    float *logit = malloc((size_t)V * sizeof *logit), *prob = malloc((size_t)V * sizeof *prob);
    if (!ids || !logit || !prob)
        goto done;
    for (int64_t i = 0; i < T; i++)
        ids[i] = eot;
    printf("generating:\n---\n");
    gj_no_grad_push();
    for (int t = 1; t <= n; t++) {
        gj_scope_push();
        int64_t s[2] = {1, T};
        gj_tensor *x = gj_from_data(GJ_I64, 2, s, ids);
        gj_tensor *lg = x ? gpt2_logits(m, x) : NULL;              /* (1, T, Vp) */
        lg = lg ? gj_narrow(gj_narrow(lg, 1, t - 1, 1), 2, 0, V) : NULL; /* (1, 1, V) */
        bool ok = lg && gj_tensor_to_f32(lg, logit) == 0;
        gj_scope_pop();
        if (!ok) {
            gj_no_grad_pop();
            goto done;
        }
        float maxval = -10000.0f, sum = 0.0f; /* llm.c's softmax_forward */
        for (int i = 0; i < V; i++)
            maxval = logit[i] > maxval ? logit[i] : maxval;
        for (int i = 0; i < V; i++) {
            prob[i] = expf(logit[i] - maxval);
            sum += prob[i];
        }
        for (int i = 0; i < V; i++)
            prob[i] /= sum;
        int next = sample_mult(prob, V, random_f32(rng));
        ids[t] = next;
        if (tok) {
            size_t len;
            const char *piece = gj_llmc_tokenizer_decode(tok, next, &len);
            if (piece)
                print_piece(piece, len);
            else
                printf("invalid token id %d!\n", next);
        } else {
            printf("%d ", next);
        }
        fflush(stdout);
    }
    gj_no_grad_pop();
    printf("\n---\n");
    rc = 0;
done:
    free(ids);
    free(logit);
    free(prob);
    return rc;
}

/* ------------------------------------------------------------ training */

typedef struct run {
    const opts *o;
    gpt2 m;
    gj_optim *opt;
    stepper st; /* gpt2_loss, backward and AdamW in the run's mode */
    gj_llmc_loader *train, *val;
    gj_ddp *ddp; /* --ddp: the gradients averaged over the ranks */
    gj_llmc_tokenizer *tok;
    uint64_t sample_rng;
    int64_t step; /* the next step to run */
    double total_ms; /* steps after the first */
    int64_t timed;
    double *step_ms; /* [steps] each step's ms (steps after the first) */
} run;

static void run_free(run *r) {
    stepper_free(&r->st);
    gj_ddp_free(r->ddp);
    free(r->step_ms);
    gj_optim_free(r->opt);
    gpt2_free(&r->m);
    gj_llmc_loader_free(r->train);
    gj_llmc_loader_free(r->val);
    gj_llmc_tokenizer_free(r->tok);
}

/* --ddp: the mean of v over the ranks (in f32, as llm.c's
 * multi_gpu_cpu_float_sum / num_processes); v itself without. NaN on
 * error. */
static double mean_over_ranks(run *r, double v) {
    if (!r->o->pg || isnan(v))
        return v;
    int64_t one = 1;
    float f = (float)v;
    gj_tensor *t = gj_from_data(GJ_F32, 1, &one, &f);
    double m = t && gj_allreduce(r->o->pg, t, GJ_REDUCE_AVG) == 0 ? gj_tensor_item(t) : NAN;
    gj_release(t);
    return m;
}

/* Mean loss of VAL_BATCHES batches from the val file's start (with --ddp
 * each rank its slice of them, then the mean over the ranks), summed in
 * f32 as llm.c. NaN on error. */
static double val_loss(run *r) {
    float total = 0.0f;
    gj_llmc_loader_reset(r->val);
    gj_no_grad_push();
    for (int i = 0; i < VAL_BATCHES; i++) {
        gj_scope_push();
        gj_tensor *in[2];
        gj_tensor *loss = gj_llmc_loader_next(r->val, &in[0], &in[1]) == 0
                              ? gpt2_loss(&r->m, 2, in) : NULL;
        double v = loss ? gj_tensor_item(loss) : NAN;
        gj_scope_pop();
        if (isnan(v)) {
            gj_no_grad_pop();
            return NAN;
        }
        total += (float)v;
    }
    gj_no_grad_pop();
    return mean_over_ranks(r, total / VAL_BATCHES);
}

/* One training step (batch, then forward, backward and AdamW through the
 * stepper), as llm.c's loop body. *loss receives the step's loss. 0 or -1. */
static int train_step(run *r, double *loss) {
    gj_scope_push();
    gj_tensor *in[2], *l = NULL;
    step_times tm;
    int ok = gj_llmc_loader_next(r->train, &in[0], &in[1]) == 0 &&
             stepper_run(&r->st, 2, in, &l, &tm) == 0;
    *loss = ok ? gj_tensor_item(l) : NAN;
    gj_scope_pop();
    if (ok)
        *loss = mean_over_ranks(r, *loss); /* the global batch's mean */
    return ok && !isnan(*loss) ? 0 : -1;
}

/* The state dict of a checkpoint: llm.c's 16 tensors as "model.<name>",
 * the optimizer and the RNG. New dict or NULL. */
static gj_state_dict *run_dict(run *r) {
    gj_state_dict *sd = gj_state_dict_new();
    int rc = sd ? 0 : -1;
    for (int i = 0; !rc && i < GJ_LLMC_N_PARAMS; i++) {
        char nm[64];
        snprintf(nm, sizeof nm, "model.%s", gj_llmc_param_name(i));
        rc = gj_state_dict_add(sd, nm, r->m.file[i]);
    }
    if (rc) {
        gj_state_dict_free(sd);
        return NULL;
    }
    return sd;
}

static const char *const cfg_keys[6] = {"llmc.max_seq_len", "llmc.vocab_size",
                                        "llmc.num_layers",  "llmc.num_heads",
                                        "llmc.channels",    "llmc.padded_vocab_size"};

static void cfg_values(const gj_llmc_config *c, int *v) {
    v[0] = c->max_seq_len;
    v[1] = c->vocab_size;
    v[2] = c->num_layers;
    v[3] = c->num_heads;
    v[4] = c->channels;
    v[5] = c->padded_vocab_size;
}

/* Writes --save: llm.c's format (.bin) or a gradjit checkpoint to resume
 * from (.safetensors) before step r->step. 0, or 1 with a message. */
static int run_save_files(run *r, const char *path) {
    if (ends_with(path, ".bin")) {
        if (r->o->rank != 0)
            return 0; /* (ZeRO keeps the path on every rank: rank 0 writes the parameters) */
        if (gj_llmc_save_model(path, &r->m.cfg, r->m.file) != 0) {
            fprintf(stderr, PROG ": %s\n", gj_last_error());
            return 1;
        }
        return 0;
    }
    const opts *o = r->o;
    gj_state_dict *sd = run_dict(r);
    int64_t epoch = 0, batch = 0;
    int v[6];
    cfg_values(&r->m.cfg, v);
    int rc = ckpt_add_common(sd, r->opt, r->o->zero ? r->ddp : NULL, &o->f, PROG, path);
    for (int k = 0; k < 6; k++)
        rc = rc || meta_i64(sd, cfg_keys[k], v[k]);
    rc = rc || meta_i64(sd, "train.step", r->step);
    /* the global batch (--ddp: all ranks'): a run with another number of
     * ranks and the same global batch reads the same chunks */
    rc = rc || meta_i64(sd, "train.batch_size", (int64_t)o->size * o->f.batch);
    rc = rc || meta_i64(sd, "train.seq_len", o->seq);
    rc = rc || meta_i64(sd, "train.shuffle", o->shuffle);
    rc = rc || gj_llmc_loader_get_position(r->train, &epoch, &batch);
    rc = rc || meta_i64(sd, "train.loader_epoch", epoch) ||
         meta_i64(sd, "train.loader_batch", batch);
    rc = rc || meta_u64(sd, "train.sample_rng", r->sample_rng);
    if (o->zero && o->rank != 0) { /* (its shard file written: rank 0 writes the rest) */
        gj_state_dict_free(sd);
        return rc ? 1 : 0;
    }
    return ckpt_write(sd, rc, path, PROG);
}

/* Reads back a gradjit checkpoint of --resume path: its complaints name
 * the file and the settings to resume with. */
static void resume_reader(ckpt_reader *rd, const gj_state_dict *sd, const char *path) {
    *rd = (ckpt_reader){.sd = sd, .same = "model, --batch (times the --ddp ranks), --seq and "
                                          "--shuffle"};
    snprintf(rd->where, sizeof rd->where, PROG ": --resume %s", path);
}

/* The model configuration stored in a gradjit checkpoint. 0 or 1. */
static int resume_config(const gj_state_dict *sd, const char *path, gj_llmc_config *c) {
    int64_t v[6];
    ckpt_reader rd;
    resume_reader(&rd, sd, path);
    for (int k = 0; k < 6; k++)
        if (ckpt_same(&rd, cfg_keys[k], -1, &v[k]) || v[k] > INT32_MAX)
            return 1;
    *c = (gj_llmc_config){.max_seq_len = (int)v[0], .vocab_size = (int)v[1],
                          .num_layers = (int)v[2], .num_heads = (int)v[3],
                          .channels = (int)v[4], .padded_vocab_size = (int)v[5]};
    return 0;
}

/* Restores parameters, AdamW state, RNG, step, loader and sampler from
 * sd (a gradjit checkpoint of this model). 0, or 1 with a message. */
static int run_resume_files(run *r, const gj_state_dict *sd, const char *path) {
    const opts *o = r->o;
    int v[6];
    int64_t step, epoch, batch;
    uint64_t rng;
    ckpt_reader rd;
    resume_reader(&rd, sd, path);
    cfg_values(&r->m.cfg, v);
    for (int k = 0; k < 6; k++)
        if (ckpt_same(&rd, cfg_keys[k], v[k], NULL))
            return 1;
    if (ckpt_same(&rd, "train.batch_size", (int64_t)o->size * o->f.batch, NULL) ||
        ckpt_same(&rd, "train.seq_len", o->seq, NULL) ||
        ckpt_same(&rd, "train.shuffle", o->shuffle, NULL) ||
        ckpt_same(&rd, "train.step", -1, &step) ||
        ckpt_same(&rd, "train.loader_epoch", -1, &epoch) ||
        ckpt_same(&rd, "train.loader_batch", -1, &batch))
        return 1;
    if (meta_get_u64(sd, "train.sample_rng", &rng) != 0 || errno || step > o->steps) {
        const char *rs = gj_state_dict_get_metadata(sd, "train.sample_rng");
        fprintf(stderr, PROG ": --resume %s: sampler state %s, step %lld (this run: %lld "
                        "steps)\n", path, rs ? rs : "absent", (long long)step,
                (long long)o->steps);
        return 1;
    }
    gj_state_dict *m = run_dict(r);
    int rc = !m || ckpt_load_common(sd, m, r->opt, r->o->zero ? r->ddp : NULL, path) != 0 ||
             gj_llmc_loader_set_position(r->train, epoch, batch) != 0;
    gj_state_dict_free(m);
    if (rc) {
        fprintf(stderr, PROG ": --resume %s: %s\n", path, gj_last_error());
        return 1;
    }
    r->step = step;
    r->sample_rng = rng;
    return 0;
}

/* --zero 3: the leaves are sharded, llm.c's tensors dropped; a save or a
 * load gathers the leaves on every rank (a collective) and goes through
 * llm.c's tensors made for it. */
static int z3_files(run *r) {
    if (gj_ddp_unshard(r->ddp) == 0 && gpt2_files_make(&r->m) == 0)
        return 0;
    fprintf(stderr, PROG ": --zero 3: %s\n", gj_last_error());
    return 1;
}

static int run_save(run *r, const char *path) {
    if (r->o->zero != 3)
        return run_save_files(r, path);
    if (z3_files(r) != 0)
        return 1;
    int rc = gpt2_files_sync(&r->m, false) != 0 ? 1 : run_save_files(r, path);
    if (gj_ddp_gather(r->ddp) != 0)
        rc = 1;
    gpt2_files_drop(&r->m);
    return rc;
}

static int run_resume(run *r, const gj_state_dict *sd, const char *path) {
    if (r->o->zero != 3)
        return run_resume_files(r, sd, path);
    if (z3_files(r) != 0)
        return 1;
    int rc = run_resume_files(r, sd, path);
    if (rc == 0 && (gpt2_files_sync(&r->m, true) != 0 || gj_ddp_reshard(r->ddp) != 0)) {
        fprintf(stderr, PROG ": --resume %s: %s\n", path, gj_last_error());
        rc = 1;
    }
    if (rc != 0)
        (void)gj_ddp_gather(r->ddp);
    gpt2_files_drop(&r->m);
    return rc;
}

/* The run stops before step r->step (Ctrl-C, --stop-after): saves if
 * --save was given. 130, or 1 if saving failed. */
static int run_stop(run *r) {
    const char *save = r->o->f.save;
    return stop_report(NULL, r->step, save, save && run_save(r, save) != 0,
                       save && ends_with(save, ".bin") ? "llm.c's format: parameters only"
                                                       : NULL);
}

/* Loads everything, prints llm.c's preamble, trains. 0, 130 (stopped and
 * saved) or 1. */
static int train(const opts *o, step_mode mode) {
    run r;
    memset(&r, 0, sizeof r);
    r.o = o;
    r.sample_rng = o->f.seed;
    int rc = 1;
    gj_state_dict *resume = NULL;
    if (o->f.resume && !(resume = gj_load_safetensors(o->f.resume)))
        goto gj_fail;
    if (resume && ckpt_check_settings(resume, &o->f, PROG, o->f.resume) != 0)
        goto done; /* (trained in another precision or with another --lr) */
    if (o->model) {
        if (gpt2_load(&r.m, o->model, GJ_F32) != 0)
            goto gj_fail;
    } else { /* --resume alone: the configuration comes from the checkpoint */
        gj_llmc_config cfg;
        gj_tensor *file[GJ_LLMC_N_PARAMS];
        if (resume_config(resume, o->f.resume, &cfg) != 0)
            goto done;
        if (gj_llmc_config_check(&cfg) != 0)
            goto gj_fail;
        for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
            int64_t s[3];
            int nd = gj_llmc_param_shape(&cfg, i, s);
            if (!(file[i] = gj_zeros(GJ_F32, nd, s))) {
                while (i-- > 0)
                    gj_release(file[i]);
                goto gj_fail;
            }
        }
        if (gpt2_init_from(&r.m, &cfg, file) != 0)
            goto gj_fail;
    }
    const gj_llmc_config *c = &r.m.cfg;
    if (o->seq > c->max_seq_len) {
        fprintf(stderr, PROG ": --seq %d is longer than the model's max_seq_len %d\n", o->seq,
                c->max_seq_len);
        goto done;
    }
    r.m.unfused = o->unfused;
    stepper_mem_budget = (size_t)o->memory_budget << 20;
    if (gpt2_set_seq_len(&r.m, o->seq) != 0)
        goto gj_fail;
    printf("[GPT-2]\nmax_seq_len: %d\nvocab_size: %d\npadded_vocab_size: %d\nnum_layers: %d\n"
           "num_heads: %d\nchannels: %d\nnum_parameters: %" PRId64 "\n",
           c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads,
           c->channels, gj_llmc_num_parameters(c));
    if (!(r.train = gj_llmc_loader_new_rank(o->train, o->f.batch, o->seq, c->vocab_size,
                                            o->shuffle, o->rank, o->size)))
        goto gj_fail;
    if (o->val && !(r.val = gj_llmc_loader_new_rank(o->val, o->f.batch, o->seq, c->vocab_size,
                                                    false, o->rank, o->size)))
        goto gj_fail;
    int64_t global = (int64_t)o->size * o->f.batch * o->seq; /* tokens of a step, all ranks */
    printf("train dataset num_batches: %" PRId64 "\n", gj_llmc_loader_num_tokens(r.train) / global);
    if (r.val)
        printf("val dataset num_batches: %" PRId64 "\n", gj_llmc_loader_num_tokens(r.val) / global);
    if (o->tokenizer && !(r.tok = gj_llmc_tokenizer_load(o->tokenizer)))
        goto gj_fail;
    int64_t eot = r.tok ? gj_llmc_tokenizer_eot(r.tok) : c->vocab_size - 1;
    if (eot >= c->vocab_size) {
        fprintf(stderr, PROG ": the tokenizer's end-of-text token %lld is not below the model's "
                        "vocab_size %d\n", (long long)eot, c->vocab_size);
        goto done;
    }
    int sample = o->sample_given ? o->sample : (o->seq - 1 < o->sample ? o->seq - 1 : o->sample);
    if (sample > o->seq - 1) {
        fprintf(stderr, PROG ": --sample %d: at most --seq - 1 = %d tokens\n", sample,
                o->seq - 1);
        goto done;
    }
    gj_ddp_options dopt = {.zero = o->zero};
    if (o->pg && !(r.ddp = gj_ddp_new(o->pg, r.m.n_leaves, r.m.leaf, &dopt)))
        goto gj_fail;
    if (o->zero == 3) /* (the leaves have their own, sharded, memory now) */
        gpt2_files_drop(&r.m);
    gj_tensor *const *opt_params = r.m.leaf; /* ZeRO: this rank's shards */
    int n_opt = o->zero ? gj_ddp_shards(r.ddp, &opt_params) : r.m.n_leaves;
    if (n_opt < 0)
        goto gj_fail;
    r.opt = gj_adamw_new(n_opt, opt_params, (float)o->f.lr, 0.9f, 0.999f, 1e-8f, 0.0f);
    if (!r.opt)
        goto gj_fail;
    if (r.ddp &&
        train_print_model_state(o->pg, o->zero, r.m.n_leaves, r.m.leaf, n_opt, opt_params) != 0)
        goto gj_fail;
    if (stepper_init(&r.st, mode, gpt2_loss, &r.m, r.opt) != 0)
        goto gj_fail;
    if (r.ddp && stepper_set_ddp(&r.st, r.ddp) != 0)
        goto gj_fail;
    if (!(r.step_ms = calloc((size_t)o->steps, sizeof *r.step_ms))) {
        fprintf(stderr, PROG ": out of memory\n");
        goto done;
    }
    if (resume) {
        if (run_resume(&r, resume, o->f.resume) != 0)
            goto done;
        gj_state_dict_free(resume);
        resume = NULL;
    }
    gj_info info;
    gj_get_info(&info);
    printf("gradjit %s: %d threads, BLAS %s, %s, batch %d, seq %d, AdamW lr %g%s\n",
           info.version, info.num_threads, info.blas_core ? info.blas_core : "?",
           mode == STEP_SPLIT_CA   ? "compiled autograd"
           : mode == STEP_COMPILED ? "compiled step"
                                   : "eager autograd",
           o->f.batch, o->seq, o->f.lr, o->shuffle ? ", shuffled" : "");
    if (o->pg)
        printf("DDP over %d MPI ranks: %d sequences per rank, %d per step, rank r reading its "
               "slice of every %d x %d x %d token chunk (llm.c's order); gradients and printed "
               "losses averaged over the ranks\n",
               o->size, o->f.batch, o->size * o->f.batch, o->size, o->f.batch, o->seq);
    if (o->f.resume)
        printf("resumed from %s at step %lld\n", o->f.resume, (long long)r.step);
    fflush(stdout);
    counters_reset();
    gj_mem_reset_peak();
    int64_t start = r.step;
    int64_t first_peak = 0;
    for (; r.step < o->steps; r.step++) {
        int64_t s = r.step;
        if (stop_due(s - start, o->f.stop_after)) {
            rc = run_stop(&r);
            goto done;
        }
        /* --zero 3: every rank gathers the model for what only some run
         * (rank 0 samples) or what reads it outside a step */
        bool look = (r.val && s % VAL_EVERY == 0) || (s > 0 && s % SAMPLE_EVERY == 0);
        if (o->zero == 3 && look && gj_ddp_unshard(r.ddp) != 0)
            goto gj_fail;
        if (r.val && s % VAL_EVERY == 0) {
            double v = val_loss(&r);
            if (isnan(v))
                goto gj_fail;
            printf("val loss %f\n", v);
        }
        if (sample > 0 && s > 0 && s % SAMPLE_EVERY == 0 &&
            generate(&r.m, o->seq, sample, eot, r.tok, &r.sample_rng) != 0)
            goto gj_fail;
        if (o->zero == 3 && look && gj_ddp_gather(r.ddp) != 0)
            goto gj_fail;
        gj_warmup_stats w0, w1;
        gj_warmup_stats_get(&w0);
        double t0 = now_s(), loss;
        if (train_step(&r, &loss) != 0)
            goto gj_fail;
        double ms = (now_s() - t0) * 1e3;
        gj_warmup_stats_get(&w1);
        if (s == start) { /* the first step's peak apart (a compiled step runs it eager) */
            gj_mem m0;
            gj_mem_stats(&m0);
            first_peak = m0.peak_bytes;
            gj_mem_reset_peak();
        }
        if (s > start) {
            r.total_ms += ms;
            r.step_ms[r.timed++] = ms;
        }
        printf("step %d: train loss %f (took %f ms)\n", (int)s, loss, ms);
        if (s < start + 2) { /* what the first steps paid (a line llm.c does not print) */
            gj_warmup_stats w = warmup_diff(&w0, &w1);
            print_warmup("gradjit:", s, ms, &w);
        }
        fflush(stdout);
    }
    gj_mem mem;
    gj_mem_stats(&mem);
    double q[3] = {NAN, NAN, NAN};
    if (r.timed)
        quartiles(r.step_ms, r.timed, q);
    int64_t peak = mem.peak_bytes > first_peak ? mem.peak_bytes : first_peak;
    printf("gradjit: %lld steps, %.1f ms per step after the first (median %.1f), peak tensor "
           "memory %.1f MiB (%.1f MiB in the steps after the first; held at most %.1f MiB%s)\n",
           (long long)(o->steps - start), r.timed ? r.total_ms / (double)r.timed : NAN, q[1],
           (double)peak / 1048576.0, r.timed ? (double)mem.peak_bytes / 1048576.0 : NAN,
           (double)mem.held_peak_bytes / 1048576.0,
           mem.limit_bytes ? ", under GRADJIT_MEM_LIMIT_MB" : "");
    stepper_print_memory(&r.st, "gradjit:");
    gj_ca_stats ca, cs;
    counters_read(&ca, &cs);
    print_counters(mode, &ca, &cs);
    if (o->f.save) {
        if (run_save(&r, o->f.save) != 0)
            goto done;
        printf("saved %s\n", o->f.save);
    }
    rc = 0;
    goto done;
gj_fail:
    fprintf(stderr, PROG ": %s\n", gj_last_error());
done:
    gj_set_compiled_autograd(false);
    gj_state_dict_free(resume);
    run_free(&r);
    return rc;
}

/* ---------------------------------------------------------------- main */

/* The options (examples/args.h). 0, 1 (--help/--version printed) or -1. */
static int parse_opts(int argc, char **argv, opts *o) {
    *o = (opts){.layers = 12, .channels = 768, .heads = 12, .vocab = 50257, .max_seq = 1024,
                .f = {.batch = 4, .lr = 1e-4, .seed = 1337}, .seq = 64, .steps = 41,
                .sample = 63};
    train_flags *f = &o->f;
    arg_spec specs[] = {
        ARG_OPT("model", ARG_FILE, &o->model, 0, 0, "llm.c model checkpoint to start from"),
        ARG_OPT("train", ARG_FILE, &o->train, 0, 0, "llm.c token file to train on"),
        ARG_OPT("val", ARG_FILE, &o->val, 0, 0, "llm.c token file: val loss every 10 steps"),
        ARG_OPT("batch", ARG_INT, &f->batch, 1, 65536, "sequences per batch (B)"),
        ARG_OPT("seq", ARG_INT, &o->seq, 1, 1 << 20, "tokens per sequence (T)"),
        ARG_OPT("steps", ARG_I64, &o->steps, 1, 1e12, "training steps (llm.c: 0 to 40)"),
        ARG_OPT("memory-budget", ARG_INT, &o->memory_budget, 0, 1 << 30,
                "MiB the compiled step's activations, gradients and temporaries may hold at "
                "once: values the backward reads are recomputed instead of kept (0: none)"),
        ARG_OPT("unfused", ARG_FLAG, &o->unfused, 0, 0,
                "attention and the loss op by op (T x T scores, B T x V logits) instead of "
                "the fused gj_scaled_dot_product_attention and gj_linear_cross_entropy"),
        TRAIN_ARG_LR(f),
        TRAIN_ARG_COMPILED(f),
        TRAIN_ARG_BF16(f),
        TRAIN_ARG_THREADS(f),
        ARG_OPT("shuffle", ARG_FLAG, &o->shuffle, 0, 0,
                "train batches in llm.c's shuffled order (its train loader's default)"),
        ARG_OPT_GIVEN("sample", ARG_INT, &o->sample, 0, 1 << 20,
                      "tokens generated at steps 20, 40, ... (at most --seq - 1; 0: none)",
                      &o->sample_given),
        ARG_OPT("tokenizer", ARG_FILE, &o->tokenizer, 0, 0,
                "llm.c tokenizer to print samples with (else token ids)"),
        ARG_OPT("ddp", ARG_FLAG, &o->ddp, 0, 0,
                "data parallel over MPI ranks (mpirun -np N ... --ddp): --batch sequences per "
                "rank, gradients and losses averaged"),
        TRAIN_ARG_ZERO(&o->zero),
        ARG_OPT("seed", ARG_U64, &f->seed, 0, 0,
                "sampler seed (llm.c: 1337); --init-model's seed"),
        ARG_OPT("save", ARG_FILE, &f->save, 0, 0,
                "checkpoint at the end and on Ctrl-C: FILE.bin (llm.c) or FILE.safetensors"),
        ARG_OPT("resume", ARG_FILE, &f->resume, 0, 0,
                "continue a FILE.safetensors of --save bit-identically (same --bf16, --lr)"),
        TRAIN_ARG_STOP_AFTER(f),
        ARG_OPT("init-model", ARG_FILE, &o->init_model, 0, 0,
                "write a GPT-2-initialised llm.c checkpoint and exit"),
        ARG_OPT("layers", ARG_INT, &o->layers, 1, 1 << 16, "--init-model: layers (L)"),
        ARG_OPT("channels", ARG_INT, &o->channels, 1, 1 << 20, "--init-model: channels (C)"),
        ARG_OPT("heads", ARG_INT, &o->heads, 1, 1 << 16, "--init-model: heads (NH)"),
        ARG_OPT("vocab", ARG_INT, &o->vocab, 1, INT32_MAX, "--init-model: vocabulary (V)"),
        ARG_OPT("padded-vocab", ARG_INT, &o->padded_vocab, 0, INT32_MAX,
                "--init-model: padded vocabulary (0: V rounded up to 128)"),
        ARG_OPT("max-seq", ARG_INT, &o->max_seq, 1, 1 << 20, "--init-model: max sequence length"),
        ARG_OPT("make-tokens", ARG_STR2, (void *)o->make_tokens, 0, 0,
                "IN.txt OUT.bin: write a token file of IN's bytes and exit"),
        ARG_OPT("make-tokenizer", ARG_FILE, &o->make_tokenizer, 0, 0,
                "write the byte-level tokenizer of --make-tokens' files and exit"),
    };
    int rc = args_parse(PROG,
                        "Trains GPT-2 from llm.c's files (model checkpoint, token files, "
                        "tokenizer) as llm.c's train_gpt2.c does, eager, with compiled "
                        "autograd or with the compiled step; or makes such files.",
                        argc, argv, specs, (int)(sizeof specs / sizeof specs[0]));
    if (rc != 0)
        return rc;
    if (train_flags_check(PROG, f) != 0)
        return -1;
    bool making = o->init_model || o->make_tokens[0] || o->make_tokenizer;
    if (making && (o->model || o->train || f->resume)) {
        fprintf(stderr, PROG ": --init-model, --make-tokens and --make-tokenizer write files "
                        "and exit; train in a second command\n");
        return -1;
    }
    if (!making && (!o->train || (!o->model && !f->resume))) {
        fprintf(stderr, PROG ": give --model FILE and --train FILE (or --resume FILE and "
                        "--train FILE), or one of --init-model, --make-tokens, "
                        "--make-tokenizer (see --help)\n");
        return -1;
    }
    if (f->save && !ends_with(f->save, ".bin") && !ends_with(f->save, ".safetensors")) {
        fprintf(stderr, PROG ": --save %s: name it FILE.bin (llm.c's format) or "
                        "FILE.safetensors (with the optimizer state, for --resume)\n", f->save);
        return -1;
    }
    if (train_zero_check(PROG, o->ddp, o->zero) != 0)
        return -1;
    if (f->resume && !ends_with(f->resume, ".safetensors")) {
        fprintf(stderr, PROG ": --resume %s: takes a FILE.safetensors of --save; an llm.c "
                        "checkpoint (.bin) is a --model\n", f->resume);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc != 0)
        return prc > 0 ? 0 : 2;
    if (o.init_model || o.make_tokens[0] || o.make_tokenizer) {
        int rc = 0;
        if (o.init_model)
            rc |= init_model(&o);
        if (!rc && o.make_tokens[0])
            rc |= make_tokens(o.make_tokens[0], o.make_tokens[1]);
        if (!rc && o.make_tokenizer)
            rc |= make_tokenizer(o.make_tokenizer);
        return rc;
    }
    step_mode mode = train_mode(&o.f); /* GRADJIT_COMPILED_AUTOGRAD=1 like the flag */
    gj_set_num_threads(o.f.threads);
    o.size = 1;
    if (o.ddp) {
        if (train_ddp_start(PROG, &o.pg, &o.rank, &o.size) != 0)
            return 1;
        if (o.rank != 0) { /* rank 0 prints, samples and saves; the others only train */
            o.sample = 0;
            o.sample_given = true;
            if (!o.zero) /* (ZeRO: every rank gathers the checkpoint, rank 0 writes it) */
                o.f.save = NULL;
        }
    }
    catch_sigint();
    int rc = train(&o, mode);
    gj_pg_free(o.pg);
    return rc;
}
