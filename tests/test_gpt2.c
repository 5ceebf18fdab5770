/* SPDX-License-Identifier: MIT */
/*
 * test_gpt2.c - the GPT-2 of examples/gpt2_model.h against llm.c itself,
 * and its gradients against finite differences.
 *
 * Golden losses: the test writes a small GPT-2 checkpoint (GPT-2's
 * initialisation from a fixed seed: 2 layers, 128 channels, 4 heads,
 * vocabulary 257 padded to 384, max_seq_len 64) and two token files (the
 * bytes of the texts below: 887 train tokens hold 3 batches of 4 x 64, so
 * ten steps wrap around the file three times; 561 val tokens hold 2
 * batches, so the 5 val batches wrap twice) through the library's
 * writers, checks that their bytes are those llm.c was run on (FNV-1a
 * hashes), and trains on them as llm.c's main does (val loss at step 0,
 * then 10 steps of forward, backward, AdamW lr 1e-4). Every loss must be
 * within 2e-3 relative of the loss llm.c printed, the val loss and step
 * 0's loss within 1e-5; eagerly, with compiled autograd (which must not
 * fall back), with the compiled training step (gj_step: every step but the
 * first runs one program of forward, backward and AdamW, none falls back,
 * and its losses and final parameters are the eager run's bit for bit),
 * and with llm.c's shuffled train loader. In bf16 mixed precision
 * (opts.autocast = GJ_BF16) the eager and the compiled step agree bit for
 * bit and every loss stays within 2% of llm.c's f32 loss.
 *
 * How the golden values were made: llm.c at commit
 * f1e2ace651495b74ae22d45d1723443fd00ecd3a (karpathy/llm.c, 2025-05-10),
 * train_gpt2.c built with its Makefile (`make train_gpt2`: cc -Ofast
 * -march=native -fopenmp -DOMP, gcc 12.2, on the AMD EPYC (Zen 5) of this
 * project's machine). Its main() was changed only to take its hard-coded
 * settings from the command line: the checkpoint path ("gpt2_124M.bin"),
 * the train and val token paths, B (4), T (64), the number of steps (the
 * loop `step <= 40` became `step <= steps - 1`), the train loader's
 * should_shuffle (1) and the tokenizer path. The files were those this test
 * writes (GJT_GPT2_KEEP=DIR keeps them in DIR), and the commands were
 *   train_gpt2 model.bin train.bin val.bin 4 64 10 0 none   (unshuffled)
 *   train_gpt2 model.bin train.bin val.bin 4 64 10 1 none   (llm.c's shuffle)
 * The numbers are what it printed ("val loss %f", "step %d: train loss %f").
 *
 * Gradients: on a tiny configuration (2 layers, 8 channels, 2 heads,
 * vocabulary 11 padded to 16, B 2, T 5) in f64 with random parameters,
 * every parameter's gradient from one backward must match central
 * differences of the loss; wte's padded rows must get exactly zero (the
 * logits of the padding take no part in the loss), and the compiled
 * backward must give the eager gradients.
 */
#include "gjtest.h"
#include "examples/gpt2_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char train_text[] =
    "gradjit trains neural networks from C. Its eager autograd records every operation as it "
    "runs, and its compiled autograd turns a whole backward pass into one program. This file "
    "is the training text of a small test: a GPT-2 with two layers reads it in three batches "
    "of four sequences of sixty-four bytes each, and then starts again at the beginning, "
    "exactly as the data loader of llm.c does when it reaches the end of a token file. The "
    "loss it reaches after ten steps was measured with llm.c itself, built on this machine "
    "from the same checkpoint and the same tokens, and the numbers below are the ones it "
    "printed. If they ever stop matching, something in the model, the optimizer or the files "
    "has changed, and the message of the test says which step went wrong first. Nothing here "
    "is meant to be read for its own sake; it only has to be text with the statistics of "
    "ordinary English prose.";

static const char val_text[] =
    "The validation text is shorter. It holds two batches, so five validation batches wrap "
    "around twice, which is what llm.c does when its validation file is small. A language "
    "model that has seen ten batches of English cannot say much about it yet, but its loss on "
    "these words should already fall a little below the loss of a uniform guess over two "
    "hundred and fifty seven tokens, the natural logarithm of 257, or about five and a half "
    "nats per byte. The end of the file is where the loader turns back, and the tokens after "
    "the last full batch are never read at all.";

#define GOLDEN_SEED 20261127u
#define GOLDEN_STEPS 10
#define GOLDEN_B 4
#define GOLDEN_T 64
static const gj_llmc_config golden_cfg = {.max_seq_len = 64, .vocab_size = 257,
                                          .num_layers = 2, .num_heads = 4, .channels = 128,
                                          .padded_vocab_size = 384};

/* FNV-1a 64 of the files llm.c was run on. */
#define HASH_MODEL 0x93a25cc85e7e5b71ull
#define HASH_TRAIN 0x82667c85e00c822bull
#define HASH_VAL 0x4efcf2cc1e2e0b26ull

/* llm.c's output on those files (see the header comment). */
static const double llmc_val0 = 5.547679;
static const double llmc_loss[GOLDEN_STEPS] = {5.542596, 5.403473, 5.309643, 5.166406,
                                               5.077759, 5.017455, 4.944173, 4.887532,
                                               4.847134, 4.818963};
static const double llmc_val0_shuffled = 5.547679;
static const double llmc_loss_shuffled[GOLDEN_STEPS] = {5.539736, 5.392918, 5.322803,
                                                        5.138851, 5.118268, 4.992299,
                                                        4.910040, 4.880843, 4.876934,
                                                        4.778355};

static char tmpdir[64];
static char p_model[128], p_train[128], p_val[128];

static uint64_t fnv1a_file(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint64_t h = 0xcbf29ce484222325ull;
    int c;
    while ((c = getc(f)) != EOF)
        h = (h ^ (uint64_t)c) * 0x100000001b3ull;
    fclose(f);
    return h;
}

static void save_text_tokens(const char *path, const char *text) {
    size_t n = strlen(text);
    uint16_t *tok = malloc(n * sizeof *tok);
    assert_non_null(tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (unsigned char)text[i];
    assert_int_equal(gj_llmc_save_tokens(path, tok, (int64_t)n), 0);
    free(tok);
}

/* Writes the golden files into tmpdir (or GJT_GPT2_KEEP) and checks them. */
static int setup_files(void **state) {
    (void)state;
    const char *keep = getenv("GJT_GPT2_KEEP");
    if (keep && keep[0]) {
        snprintf(tmpdir, sizeof tmpdir, "%s", keep);
    } else {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/gjt-gpt2-XXXXXX");
        if (!mkdtemp(tmpdir))
            return -1;
    }
    snprintf(p_model, sizeof p_model, "%s/model.bin", tmpdir);
    snprintf(p_train, sizeof p_train, "%s/train.bin", tmpdir);
    snprintf(p_val, sizeof p_val, "%s/val.bin", tmpdir);
    gj_tensor *file[GJ_LLMC_N_PARAMS];
    if (gpt2_init_params(&golden_cfg, GOLDEN_SEED, file) != 0)
        return -1;
    int rc = gj_llmc_save_model(p_model, &golden_cfg, file);
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++)
        gj_release(file[i]);
    if (rc != 0)
        return -1;
    save_text_tokens(p_train, train_text);
    save_text_tokens(p_val, val_text);
    return 0;
}

static int teardown_files(void **state) {
    (void)state;
    const char *keep = getenv("GJT_GPT2_KEEP");
    if (keep && keep[0])
        return 0;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------- golden */

/* How run_llmc_loop runs a step: forward, gj_backward and gj_optim_step,
 * eagerly or with compiled autograd; or through gj_step compiled. */
typedef enum { LOOP_EAGER, LOOP_COMPILED_AUTOGRAD, LOOP_COMPILED_STEP, LOOP_EAGER_STEP } loop_mode;

/* FNV-1a 64 of the bytes of the model's 16 tensors. */
static uint64_t fnv1a_model(const gpt2 *m) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        const unsigned char *p = gj_tensor_data(m->file[i]);
        size_t n = (size_t)gj_tensor_numel(m->file[i]) * sizeof(float);
        for (size_t k = 0; k < n; k++)
            h = (h ^ p[k]) * 0x100000001b3ull;
    }
    return h;
}

/* llm.c's main on the golden files: val loss (5 batches from the val
 * file's start, summed in f32) at step 0, then GOLDEN_STEPS steps. *hash
 * (may be NULL) receives fnv1a_model of the trained parameters. */
static void run_llmc_loop(loop_mode mode, bool shuffle, double *val0, double *loss,
                          uint64_t *hash, gj_dtype autocast) {
    gpt2 m;
    assert_int_equal(gpt2_load(&m, p_model, GJ_F32), 0);
    assert_int_equal(gpt2_set_seq_len(&m, GOLDEN_T), 0);
    gj_llmc_loader *tl = gj_llmc_loader_new(p_train, GOLDEN_B, GOLDEN_T, 257, shuffle);
    gj_llmc_loader *vl = gj_llmc_loader_new(p_val, GOLDEN_B, GOLDEN_T, 257, false);
    assert_non_null(tl);
    assert_non_null(vl);
    assert_int_equal(gj_llmc_loader_num_batches(tl), 3);
    assert_int_equal(gj_llmc_loader_num_batches(vl), 2);
    gj_optim *opt = gj_adamw_new(m.n_leaves, m.leaf, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f);
    assert_non_null(opt);
    float v = 0.0f;
    assert_int_equal(gj_set_autocast(autocast), 0); /* (the val loss too) */
    gj_no_grad_push();
    for (int i = 0; i < 5; i++) {
        gj_scope_push();
        gj_tensor *in[2];
        assert_int_equal(gj_llmc_loader_next(vl, &in[0], &in[1]), 0);
        gj_tensor *l = gpt2_loss(&m, 2, in);
        assert_non_null(l);
        v += (float)gj_tensor_item(l);
        gj_scope_pop();
    }
    gj_no_grad_pop();
    assert_int_equal(gj_set_autocast(GJ_F32), 0);
    *val0 = v / 5;
    bool step = mode == LOOP_COMPILED_STEP || mode == LOOP_EAGER_STEP;
    gj_step_opts so = {.eager = mode == LOOP_EAGER_STEP, .autocast = autocast};
    gj_step *st = step ? gj_step_new(gpt2_loss, &m, opt, &so) : NULL;
    assert_true(!step || st);
    gj_ca_stats before = gjt_ca_now(), sbefore;
    gj_step_stats(&sbefore);
    gj_set_compiled_autograd(mode == LOOP_COMPILED_AUTOGRAD);
    for (int s = 0; s < GOLDEN_STEPS; s++) {
        gj_scope_push();
        gj_tensor *in[2];
        assert_int_equal(gj_llmc_loader_next(tl, &in[0], &in[1]), 0);
        gj_tensor *l = NULL;
        if (step) {
            if (gj_step_run(st, 2, in, &l) != 0)
                fail_msg("step %d: %s", s, gj_last_error());
        } else {
            if (!(l = gpt2_loss(&m, 2, in)))
                fail_msg("gpt2_loss: %s", gj_last_error());
            gj_optim_zero_grad(opt);
            if (gj_backward(l, NULL) != 0 || gj_optim_step(opt) != 0)
                fail_msg("step %d: %s", s, gj_last_error());
        }
        loss[s] = gj_tensor_item(l);
        gj_scope_pop();
    }
    gj_set_compiled_autograd(false);
    gj_ca_stats after = gjt_ca_now(), safter;
    gj_step_stats(&safter);
    if (mode == LOOP_COMPILED_AUTOGRAD)
        assert_true(gjt_ran_compiled("gpt2 training steps", &before, &after, GOLDEN_STEPS));
    if (mode == LOOP_COMPILED_STEP) /* the first step traces (and compiles); every step counts */
        assert_true(gjt_ran_compiled("gpt2 compiled steps", &sbefore, &safter, GOLDEN_STEPS));
    if (hash)
        *hash = fnv1a_model(&m);
    gj_step_free(st);
    gj_optim_free(opt);
    gj_llmc_loader_free(tl);
    gj_llmc_loader_free(vl);
    gpt2_free(&m);
}

/* Every loss within 2e-3 relative of llm.c's; the val loss and step 0
 * within 1e-5. Prints the table either way. */
static void check_golden(const char *what, double val0, const double *loss, double llmc_v,
                         const double *llmc) {
    bool ok = fabs(val0 - llmc_v) <= 1e-5 * fabs(llmc_v);
    print_message("%s: val loss %.6f (llm.c %.6f)\n", what, val0, llmc_v);
    for (int s = 0; s < GOLDEN_STEPS; s++) {
        double rel = fabs(loss[s] - llmc[s]) / fabs(llmc[s]);
        bool good = rel <= (s == 0 ? 1e-5 : 2e-3);
        print_message("%s: step %d: train loss %.6f (llm.c %.6f, relative difference %.1e)%s\n",
                      what, s, loss[s], llmc[s], rel, good ? "" : "  <-- too far");
        ok = ok && good;
    }
    assert_true(ok);
}

static void test_golden_files(void **state) {
    (void)state;
    assert_int_equal(strlen(train_text), 887);
    assert_int_equal(strlen(val_text), 561);
    uint64_t h[3] = {fnv1a_file(p_model), fnv1a_file(p_train), fnv1a_file(p_val)};
    print_message("file hashes: model 0x%016llx, train 0x%016llx, val 0x%016llx\n",
                  (unsigned long long)h[0], (unsigned long long)h[1], (unsigned long long)h[2]);
    /* A difference means the golden losses below were not measured on these
     * files (the initialisation or a writer changed): run llm.c again on
     * the files of GJT_GPT2_KEEP=DIR and update the values and hashes. */
    assert_true(h[0] == HASH_MODEL);
    assert_true(h[1] == HASH_TRAIN);
    assert_true(h[2] == HASH_VAL);
}

static void test_golden_eager(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    double v, loss[GOLDEN_STEPS];
    run_llmc_loop(LOOP_EAGER, false, &v, loss, NULL, GJ_F32);
    check_golden("eager", v, loss, llmc_val0, llmc_loss);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_golden_compiled(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    double v, loss[GOLDEN_STEPS];
    run_llmc_loop(LOOP_COMPILED_AUTOGRAD, false, &v, loss, NULL, GJ_F32);
    check_golden("compiled", v, loss, llmc_val0, llmc_loss);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The compiled step: llm.c's losses, and the eager run's bits (every loss,
 * every trained parameter). */
static void test_golden_compiled_step(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    double v, ve, loss[GOLDEN_STEPS], eager[GOLDEN_STEPS];
    uint64_t h, he;
    run_llmc_loop(LOOP_EAGER, false, &ve, eager, &he, GJ_F32);
    run_llmc_loop(LOOP_COMPILED_STEP, false, &v, loss, &h, GJ_F32);
    check_golden("compiled step", v, loss, llmc_val0, llmc_loss);
    for (int s = 0; s < GOLDEN_STEPS; s++)
        if (loss[s] != eager[s])
            fail_msg("step %d: compiled step loss %.9g, eager %.9g", s, loss[s], eager[s]);
    if (h != he)
        fail_msg("the parameters after %d compiled steps differ from the eager ones", GOLDEN_STEPS);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* bf16 mixed precision (opts.autocast): the eager and the compiled step
 * give the same bits, and every loss stays within 2% of llm.c's f32 loss
 * (the val loss too). */
static void test_golden_bf16(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    double v, ve, loss[GOLDEN_STEPS], eager[GOLDEN_STEPS];
    uint64_t h, he;
    run_llmc_loop(LOOP_EAGER_STEP, false, &ve, eager, &he, GJ_BF16);
    run_llmc_loop(LOOP_COMPILED_STEP, false, &v, loss, &h, GJ_BF16);
    assert_true(v == ve);
    bool ok = fabs(v - llmc_val0) <= 0.02 * llmc_val0;
    print_message("bf16 mixed precision: val loss %.6f (llm.c f32 %.6f)\n", v, llmc_val0);
    for (int s = 0; s < GOLDEN_STEPS; s++) {
        if (loss[s] != eager[s])
            fail_msg("step %d: compiled step loss %.9g, eager step %.9g", s, loss[s], eager[s]);
        double rel = fabs(loss[s] - llmc_loss[s]) / llmc_loss[s];
        print_message("bf16 mixed precision: step %d: train loss %.6f (llm.c f32 %.6f, relative "
                      "difference %.1e)%s\n",
                      s, loss[s], llmc_loss[s], rel, rel <= 0.02 ? "" : "  <-- too far");
        ok = ok && rel <= 0.02;
    }
    if (h != he)
        fail_msg("the parameters after %d compiled bf16 steps differ from the eager ones",
                 GOLDEN_STEPS);
    assert_true(ok);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_golden_shuffled(void **state) {
    (void)state;
    double v, loss[GOLDEN_STEPS];
    run_llmc_loop(LOOP_EAGER, true, &v, loss, NULL, GJ_F32);
    check_golden("eager, shuffled", v, loss, llmc_val0_shuffled, llmc_loss_shuffled);
}

/* ---------------------------------------------------------- gradients */

static const gj_llmc_config tiny_cfg = {.max_seq_len = 8, .vocab_size = 11, .num_layers = 2,
                                        .num_heads = 2, .channels = 8,
                                        .padded_vocab_size = 16};
#define TINY_B 2
#define TINY_T 5

/* The tiny model in f64 with every parameter uniform in [-0.5, 0.5)
 * (LayerNorm weights around 1), padded wte rows included. */
static void tiny_model(gpt2 *m) {
    gj_tensor *file[GJ_LLMC_N_PARAMS];
    gjt_rng r;
    gjt_rng_seed(&r, 99);
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int64_t s[3];
        int nd = gj_llmc_param_shape(&tiny_cfg, i, s);
        const char *nm = gj_llmc_param_name(i);
        bool lnw = !strcmp(nm, "ln1w") || !strcmp(nm, "ln2w") || !strcmp(nm, "lnfw");
        file[i] = gjt_uniform(&r, GJ_F64, nd, s, lnw ? 0.5 : -0.5, lnw ? 1.5 : 0.5);
        assert_non_null(file[i]);
    }
    assert_int_equal(gpt2_init_from(m, &tiny_cfg, file), 0);
    assert_int_equal(gpt2_set_seq_len(m, TINY_T), 0);
}

static void tiny_batch(gj_tensor **in) {
    gjt_rng r;
    gjt_rng_seed(&r, 7);
    int64_t s[2] = {TINY_B, TINY_T};
    in[0] = gjt_labels(&r, 2, s, tiny_cfg.vocab_size);
    in[1] = gjt_labels(&r, 2, s, tiny_cfg.vocab_size);
}

static double tiny_loss(gpt2 *m, gj_tensor **in) {
    gj_no_grad_push();
    gj_scope_push();
    gj_tensor *l = gpt2_loss(m, 2, in);
    assert_non_null(l);
    double v = gj_tensor_item(l);
    gj_scope_pop();
    gj_no_grad_pop();
    return v;
}

/* One backward's gradients, per leaf (malloc'd arrays in g[k]). */
static void tiny_grads(gpt2 *m, gj_tensor **in, bool compiled, double **g) {
    gj_ca_stats before = gjt_ca_now();
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *l = gpt2_loss(m, 2, in);
    assert_non_null(l);
    assert_int_equal(gj_tensor_dtype(l), GJ_F64);
    assert_int_equal(gj_backward(l, NULL), 0);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    gj_ca_stats after = gjt_ca_now();
    if (compiled)
        assert_true(gjt_ran_compiled("gpt2 f64 backward", &before, &after, 1));
    for (int k = 0; k < m->n_leaves; k++) {
        gj_tensor *gr = gj_tensor_grad(m->leaf[k]);
        assert_non_null(gr);
        assert_int_equal(gj_tensor_dtype(gr), GJ_F64);
        g[k] = gjt_values(gr);
        assert_non_null(g[k]);
        gj_tensor_set_grad(m->leaf[k], NULL);
    }
}

static void test_gradients_f64(void **state) {
    (void)state;
    int64_t live0 = gjt_live_bytes();
    gpt2 m;
    tiny_model(&m);
    gj_tensor *in[2];
    tiny_batch(in);
    double **g = calloc((size_t)m.n_leaves, sizeof *g), **gc = calloc((size_t)m.n_leaves, sizeof *gc);
    assert_non_null(g);
    assert_non_null(gc);
    tiny_grads(&m, in, false, g);
    tiny_grads(&m, in, true, gc);
    const double h = 1e-6;
    int64_t checked = 0;
    double worst = 0.0;
    for (int k = 0; k < m.n_leaves; k++) {
        gj_tensor *leaf = m.leaf[k];
        int64_t n = gj_tensor_numel(leaf);
        double *x = gj_tensor_data(leaf); /* contiguous f64: a slice of llm.c's tensor */
        assert_true(gjt_same_as_eager(gj_tensor_name(leaf), gc[k], g[k], n, 1e-12));
        for (int64_t j = 0; j < n; j++) {
            double x0 = x[j];
            x[j] = x0 + h;
            double lp = tiny_loss(&m, in);
            x[j] = x0 - h;
            double lm = tiny_loss(&m, in);
            x[j] = x0;
            double fd = (lp - lm) / (2 * h), err = fabs(fd - g[k][j]);
            if (err > 1e-8 + 1e-6 * fabs(fd))
                fail_msg("%s[%lld]: backward %.12g, central difference %.12g",
                         gj_tensor_name(leaf), (long long)j, g[k][j], fd);
            worst = err > worst ? err : worst;
            checked++;
        }
    }
    /* the padded rows [V, Vp) of wte take no part in the loss */
    int64_t C = tiny_cfg.channels;
    for (int64_t j = tiny_cfg.vocab_size * C; j < tiny_cfg.padded_vocab_size * C; j++)
        assert_true(g[0][j] == 0.0 && gc[0][j] == 0.0);
    print_message("f64 gradients: %lld parameters against central differences, largest "
                  "difference %.2e; compiled = eager\n", (long long)checked, worst);
    for (int k = 0; k < m.n_leaves; k++) {
        free(g[k]);
        free(gc[k]);
    }
    free(g);
    free(gc);
    gj_release(in[0]);
    gj_release(in[1]);
    gpt2_free(&m);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    gjt_setup();
    gj_compiled_autograd_set_quiet(true);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_files),
        cmocka_unit_test(test_golden_eager),
        cmocka_unit_test(test_golden_compiled),
        cmocka_unit_test(test_golden_compiled_step),
        cmocka_unit_test(test_golden_bf16),
        cmocka_unit_test(test_golden_shuffled),
        cmocka_unit_test(test_gradients_f64),
    };
    return cmocka_run_group_tests(tests, setup_files, teardown_files);
}
