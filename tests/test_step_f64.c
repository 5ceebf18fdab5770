/* SPDX-License-Identifier: MIT */
/*
 * test_step_f64.c - f64 training steps whose batch size changes, compiled
 * (gj_step) against eager bit for bit: every step's loss, the parameters
 * and the optimizer's state (SGD's momentum buffers, AdamW's moments).
 *
 * In f64 a sum's order shows in its last bit. The eager SUM kernel
 * (runtime/kernels_reduce.c) adds in an order that follows the strides of
 * the tensor it reads: contiguous reduced dims coalesce into one run of 8
 * lanes, reduced dims are visited by decreasing stride, and an output
 * whose innermost kept dim has the smallest stride adds row by row. A
 * fused kernel reduces a value eager would have stored first, and its
 * loops used to follow its own dims instead, which its other accesses
 * decide: a broadcast operand (a linear layer's bias) kept it from
 * merging [B, C] into one run, so it added B runs of C; a transposed view
 * was summed in its logical order. Each case below but L_LN_T differed in
 * some bit before the planner nested the kernel's loops in eager's order
 * (plan_kernel.c, gj_jit_pl_red_order) and let a run span several dims
 * (lower.c). L_LN_T holds the other side: the eager composites (layer
 * norm, softmax, ...) reduce a contiguous copy of a strided input, and
 * their decomposition (autograd/decompose.c) says so with a COPY, where a
 * SUM of the view itself would now follow its strides.
 */
#include "gjtest.h"

#include "../jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NF = 16, NSTEPS = 5, MAXB = 10 };

typedef enum loss_kind {
    L_REPORTED = 0, /* the whole model below */
    L_LINEAR_SUM,   /* sum(linear(x, W, a)): a bias broadcast over a full sum */
    L_ROW_SUM,      /* sum(x * row): the same with a plain product */
    L_T_ROWWISE,    /* sum over dim 1 of a transposed copy's view: eager adds row-wise */
    L_T_ALL,        /* sum over all of a transposed view: eager's memory order */
    L_LN_T,         /* layer norm of a transposed view: rows of its contiguous copy */
    L_LSM_T_GRAD,   /* log-softmax whose gradient arrives transposed */
} loss_kind;

typedef struct f64_model {
    gj_tensor *p[4]; /* W [NF, NF], a, b, c [NF] */
    gj_tensor *mask; /* constant 0/1 [MAXB, NF] */
    loss_kind kind;
    int64_t nf;      /* features (NF, or fewer for the unaligned runs) */
} f64_model;

/* The model of the report: h = linear(x, W, a), elementwise math of h,
 * softmax of h minus its row max, log-softmax over the batch, cat /
 * narrow, a transposed contiguous copy, masked_fill and where with a
 * constant mask narrowed to the batch, layer norm, an expanded parameter,
 * a cast through f32, cross-entropy, and sums and means of products. */
static gj_tensor *reported_loss(f64_model *m, gj_tensor *x, gj_tensor *y) {
    int64_t B = gj_tensor_shape(x)[0], F = m->nf, bf[2] = {B, F}, r1[2] = {1, F};
    gj_tensor *h = gj_linear(x, m->p[0], m->p[1]);
    gj_tensor *sg = gj_sigmoid(h);
    gj_tensor *u = gj_add(gj_exp(gj_tanh(h)),
                          gj_mul(gj_log(gj_add_scalar(sg, 0.5)),
                                 gj_sqrt(gj_add_scalar(gj_relu(h), 1.0))));
    u = gj_sub(u, gj_div(gj_pow_scalar(gj_tanh(h), 2.0), gj_add_scalar(sg, 1.0)));
    gj_tensor *sm = gj_softmax(gj_sub(h, gj_max(h, 1, true)), 1);
    gj_tensor *ls0 = gj_log_softmax(h, 0);
    gj_tensor *parts[2] = {gj_narrow(h, 1, 0, F / 2), gj_narrow(u, 1, F / 2, F - F / 2)};
    gj_tensor *ct = gj_cat(2, parts, 1);
    gj_tensor *tt = gj_contiguous(gj_transpose(ct, 0, 1)); /* [F, B] */
    gj_tensor *mk = gj_narrow(m->mask, 0, 0, B);
    gj_tensor *mf = gj_masked_fill(sm, mk, 0.0);
    gj_tensor *wh = gj_where(mk, ls0, gj_tanh(u));
    gj_tensor *ln = gj_layer_norm(h, m->p[2], m->p[3], 1e-5);
    gj_tensor *ex = gj_expand(gj_reshape(m->p[3], 2, r1), 2, bf);
    gj_tensor *cs = gj_cast(gj_cast(gj_mul(ln, ex), GJ_F32), GJ_F64);
    gj_tensor *terms[5] = {
        gj_mean(gj_mul(mf, u), 0, NULL, false),
        gj_mean(gj_mul(wh, gj_tanh(h)), 0, NULL, false),
        gj_mean(gj_mul(tt, gj_tanh(tt)), 0, NULL, false),
        gj_sum(gj_mul(cs, gj_tanh(ln)), 0, NULL, false),
        gj_cross_entropy(gj_add(h, cs), y),
    };
    gj_tensor *loss = terms[0];
    for (int k = 1; k < 5; k++) loss = gj_add(loss, terms[k]);
    return loss;
}

static gj_tensor *f64_loss(void *ctx, int n_in, gj_tensor *const *in) {
    f64_model *m = ctx;
    (void)n_in;
    gj_tensor *x = in[0], *W = m->p[0], *a = m->p[1];
    int64_t F = m->nf, r1[2] = {1, F};
    switch (m->kind) {
    case L_REPORTED: return reported_loss(m, x, in[1]);
    case L_LINEAR_SUM: return gj_sum(gj_linear(x, W, a), 0, NULL, false);
    case L_ROW_SUM: return gj_sum(gj_mul(gj_tanh(x), gj_reshape(a, 2, r1)), 0, NULL, false);
    case L_T_ROWWISE: {
        gj_tensor *xt = gj_transpose(gj_mul(gj_matmul(x, W), gj_reshape(a, 2, r1)), 0, 1);
        return gj_sum(gj_tanh(gj_sum(xt, 1, (int[]){1}, false)), 0, NULL, false);
    }
    case L_T_ALL: {
        gj_tensor *xt = gj_transpose(gj_mul(gj_matmul(x, W), gj_reshape(a, 2, r1)), 0, 1);
        return gj_sum(xt, 0, NULL, false);
    }
    case L_LN_T: {
        gj_tensor *xt = gj_transpose(gj_matmul(x, W), 0, 1); /* [F, B] */
        gj_tensor *ln = gj_layer_norm(xt, NULL, NULL, 1e-5);
        return gj_sum(gj_mul(ln, gj_transpose(gj_tanh(x), 0, 1)), 0, NULL, false);
    }
    default: { /* L_LSM_T_GRAD: the gradient of log_softmax(h) is a transposed view */
        gj_tensor *ls = gj_log_softmax(gj_matmul(x, W), 1);
        gj_tensor *lt = gj_transpose(ls, 0, 1);
        return gj_sum(gj_mul(lt, gj_transpose(gj_tanh(x), 0, 1)), 0, NULL, false);
    }
    }
}

/* What a run leaves: the loss of each step, then the parameters and the
 * optimizer's state. */
typedef struct f64_result {
    double loss[NSTEPS];
    double *vals;
    int64_t n_vals;
} f64_result;

/* NSTEPS steps over batches b[], eager or compiled, from the same weights
 * and data (seeded), with SGD (momentum 0.9, weight decay 0.01) or AdamW. */
static f64_result run_steps(loss_kind kind, int64_t nf, const int64_t *b, bool adamw,
                            bool compiled) {
    f64_model m;
    memset(&m, 0, sizeof m);
    m.kind = kind;
    m.nf = nf;
    gjt_rng r;
    gjt_rng_seed(&r, 2024);
    int64_t ff[2] = {nf, nf}, mb[2] = {MAXB, nf};
    m.p[0] = gjt_uniform(&r, GJ_F64, 2, ff, -0.3, 0.3);
    m.p[1] = gjt_uniform(&r, GJ_F64, 1, &nf, -0.3, 0.3);
    m.p[2] = gjt_uniform(&r, GJ_F64, 1, &nf, 0.5, 1.5);
    m.p[3] = gjt_uniform(&r, GJ_F64, 1, &nf, -0.5, 0.5);
    for (int k = 0; k < 4; k++) assert_int_equal(gj_set_requires_grad(m.p[k], true), 0);
    double mk[MAXB * NF];
    for (int i = 0; i < MAXB * nf; i++) mk[i] = i % 3 == 0;
    m.mask = gjt_tensor(GJ_F64, 2, mb, mk);
    gj_optim *o = adamw ? gj_adamw_new(4, m.p, 1e-2, 0.9, 0.999, 1e-8, 0.01)
                        : gj_sgd_new(4, m.p, 0.05, 0.9, 0.01);
    assert_non_null(o);
    gj_step_opts so = {.eager = !compiled};
    gj_step *st = gj_step_new(f64_loss, &m, o, &so);
    assert_non_null(st);
    f64_result res;
    memset(&res, 0, sizeof res);
    for (int i = 0; i < NSTEPS; i++) {
        gj_scope_push();
        /* the parts: values of magnitudes 2^-5 .. 2^5, so that the order
         * of a sum shows in its bits at almost every step */
        double xv[MAXB * NF];
        for (int64_t k = 0; k < b[i] * nf; k++)
            xv[k] = gjt_rng_uniform(&r, -1, 1) *
                    (kind == L_REPORTED ? 1.0 : ldexp(1.0, (int)((k * 5 + i * 3) % 11) - 5));
        int64_t xs[2] = {b[i], nf};
        gj_tensor *in[2] = {gjt_tensor(GJ_F64, 2, xs, xv), gjt_labels(&r, 1, &b[i], nf)};
        gj_tensor *loss = NULL;
        if (gj_step_run(st, 2, in, &loss) != 0) fail_msg("step %d: %s", i, gj_last_error());
        res.loss[i] = gj_tensor_item(loss);
        gj_scope_pop();
    }
    gj_state_dict *sd = gj_state_dict_new();
    assert_int_equal(gj_optim_state_dict_add(o, sd, "o"), 0);
    int ns = gj_state_dict_size(sd);
    gj_tensor *const *sts = gj_state_dict_tensors(sd);
    int64_t n = 0;
    for (int k = 0; k < 4; k++) n += gj_tensor_numel(m.p[k]);
    for (int k = 0; k < ns; k++) n += gj_tensor_numel(sts[k]);
    res.vals = calloc((size_t)n, sizeof *res.vals);
    assert_non_null(res.vals);
    for (int k = 0; k < 4; k++) {
        assert_int_equal(gj_tensor_to_f64(m.p[k], res.vals + res.n_vals), 0);
        res.n_vals += gj_tensor_numel(m.p[k]);
    }
    for (int k = 0; k < ns; k++) {
        assert_int_equal(gj_tensor_to_f64(sts[k], res.vals + res.n_vals), 0);
        res.n_vals += gj_tensor_numel(sts[k]);
    }
    gj_state_dict_free(sd);
    gj_step_free(st);
    gj_optim_free(o);
    for (int k = 0; k < 4; k++) gj_release(m.p[k]);
    gj_release(m.mask);
    return res;
}

/* Runs kind eagerly and compiled; every step must run compiled and leave
 * eager's bits. */
static void check(const char *what, loss_kind kind, int64_t nf, const int64_t *b, bool adamw) {
    int64_t live0 = gjt_live_bytes();
    f64_result e = run_steps(kind, nf, b, adamw, false);
    gj_step_reset_stats();
    f64_result c = run_steps(kind, nf, b, adamw, true);
    gj_ca_stats s;
    gj_step_stats(&s);
    if (s.fallbacks != 0)
        fail_msg("%s: %lld steps ran eagerly: %s", what, (long long)s.fallbacks,
                 gj_compiled_autograd_last_fallback());
    assert_int_equal(s.backwards, NSTEPS);
    for (int i = 0; i < NSTEPS; i++)
        if (memcmp(&e.loss[i], &c.loss[i], sizeof e.loss[i]) != 0)
            fail_msg("%s: step %d (batch %lld) loss %.17g eager, %.17g compiled", what, i,
                     (long long)b[i], e.loss[i], c.loss[i]);
    assert_int_equal(e.n_vals, c.n_vals);
    int64_t bad = 0;
    for (int64_t k = 0; k < e.n_vals; k++) bad += memcmp(&e.vals[k], &c.vals[k], 8) != 0;
    if (bad)
        fail_msg("%s: %lld of %lld parameter and optimizer-state values differ", what,
                 (long long)bad, (long long)e.n_vals);
    free(e.vals);
    free(c.vals);
    assert_int_equal(gjt_live_bytes(), live0);
}

static const int64_t g_batches[NSTEPS] = {10, 10, 7, 10, 10};

/* The report: the loss of step 4 was 5.6937908467233447 eagerly and
 * 5.6937908467233456 compiled (parameters W [16, 16], a, b, c [16]; SGD
 * with momentum 0.9 and weight decay 0.01; batches of 10, 10, 7, 10, 10). */
static void test_reported_model(void **st) {
    (void)st;
    check("the reported model, SGD", L_REPORTED, NF, g_batches, false);
    check("the reported model, AdamW", L_REPORTED, NF, g_batches, true);
}

/* Its parts, one at a time; L_LINEAR_SUM was the reported difference. */
static void test_reduction_orders(void **st) {
    (void)st;
    check("sum(linear(x, W, a))", L_LINEAR_SUM, NF, g_batches, false);
    check("sum(tanh(x) * row)", L_ROW_SUM, NF, g_batches, false);
    check("sum over dim 1 of a transposed view", L_T_ROWWISE, NF, g_batches, false);
    check("sum of a transposed view", L_T_ALL, NF, g_batches, false);
    check("layer norm of a transposed view", L_LN_T, NF, g_batches, false);
    check("log-softmax with a transposed gradient", L_LSM_T_GRAD, NF, g_batches, true);
}

/* A run over [B, F] with F not a multiple of 8 goes element by element,
 * its lanes continuing from row to row; symbolic programs (every size read
 * at run time) pick that path or the blocks of 8 when they run. */
static void test_runs_over_rows(void **st) {
    (void)st;
    static const int64_t b2[NSTEPS] = {9, 3, 10, 6, 9};
    for (int dyn = 0; dyn < 2; dyn++) {
        gj_compiled_autograd_set_dynamic(dyn ? GJ_CA_DYNAMIC_ALWAYS : GJ_CA_DYNAMIC_AUTO);
        for (int64_t nf = 5; nf <= NF; nf += 3) { /* 5, 8, 11, 14 */
            char what[96];
            snprintf(what, sizeof what, "sum(linear(x, W, a)), %lld features%s", (long long)nf,
                     dyn ? ", symbolic" : "");
            check(what, L_LINEAR_SUM, nf, b2, false);
            snprintf(what, sizeof what, "the reported model, %lld features%s", (long long)nf,
                     dyn ? ", symbolic" : "");
            check(what, L_REPORTED, nf, b2, nf % 2 == 0);
        }
    }
    gj_compiled_autograd_set_dynamic(GJ_CA_DYNAMIC_AUTO);
}

int main(void) {
    gjt_setup();
    gj_compiled_autograd_set_quiet(true);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reported_model),
        cmocka_unit_test(test_reduction_orders),
        cmocka_unit_test(test_runs_over_rows),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
