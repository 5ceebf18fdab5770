/* SPDX-License-Identifier: MIT */
/*
 * test_jit_ops.c - every public op's backward, compiled: for each op (and
 * the nn layers) a small model loss = sum(op(inputs) * R) with a fixed
 * random R runs its backward eagerly and compiled, in f32 and in f64. The
 * compiled backward must not fall back (every primitive of the foundation
 * has a lowering) and every .grad must equal eager's bit for bit where the
 * evaluation order is the same -- all elementwise ops, reductions, views,
 * the composites (softmax, log-softmax, layer norm, cross-entropy: the
 * decompositions follow the eager kernels' double accumulation), gathers
 * and scatters, and a checkpoint region whose forward (composites, max,
 * gather) is recomputed inside the compiled backward. Cases marked "ordered" may differ by the order inside a
 * BLAS call or a GEMM that accumulates into .grad: those must agree within
 * 1e-6 (f32) / 1e-12 (f64) of the largest eager magnitude.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXIN 4

typedef struct op_case {
    const char *name;
    int n_in;
    int ndim[MAXIN];
    int64_t shape[MAXIN][3];
    double lo[MAXIN], hi[MAXIN];
    gj_tensor *(*fn)(gj_tensor **x, gj_dtype dt);
    bool ordered; /* BLAS order may differ: tolerance instead of bytes */
} op_case;

/* ------------------------------------------------------------ the ops */

static gj_tensor *f_add(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_add(x[0], x[1]); }
static gj_tensor *f_sub(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_sub(x[1], x[0]); }
static gj_tensor *f_mul(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_mul(x[0], x[1]); }
static gj_tensor *f_div(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_div(x[0], x[1]); }
static gj_tensor *f_neg(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_neg(x[0]); }
static gj_tensor *f_exp(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_exp(x[0]); }
static gj_tensor *f_log(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_log(x[0]); }
static gj_tensor *f_tanh(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_tanh(x[0]); }
static gj_tensor *f_sigmoid(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_sigmoid(x[0]); }
static gj_tensor *f_relu(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_relu(x[0]); }
static gj_tensor *f_gelu(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_gelu(x[0]); }
static gj_tensor *f_sqrt(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_sqrt(x[0]); }
static gj_tensor *f_pow(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_pow_scalar(x[0], 2.5); }
static gj_tensor *f_add_scalar(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_add_scalar(x[0], -0.75); }
static gj_tensor *f_mul_scalar(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_mul_scalar(x[0], 1.5); }
static gj_tensor *f_sum_axis(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_sum(x[0], 1, (int[]){0}, false); }
static gj_tensor *f_sum_keep(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_sum(x[0], 2, (int[]){0, 2}, true); }
static gj_tensor *f_sum_all(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_sum(x[0], 0, NULL, false); }
static gj_tensor *f_mean(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_mean(x[0], 1, (int[]){-1}, false); }
static gj_tensor *f_mean_all(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_mean(x[0], 0, NULL, true); }
static gj_tensor *f_max0(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_max(x[0], 0, false); }
static gj_tensor *f_max1(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_max(x[0], 1, true); }
static gj_tensor *f_matmul(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_matmul(x[0], x[1]); }
static gj_tensor *f_linear(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_linear(x[0], x[1], x[2]); }
static gj_tensor *f_linear_nb(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_linear(x[0], x[1], NULL); }
static gj_tensor *f_transpose(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_mul(gj_transpose(x[0], 0, 2), x[1]);
}
static gj_tensor *f_permute(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_tanh(gj_permute(x[0], (int[]){2, 0, 1}));
}
static gj_tensor *f_reshape(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_exp(gj_reshape(gj_transpose(x[0], 0, 1), 2, (int64_t[]){6, -1}));
}
static gj_tensor *f_view(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_sigmoid(gj_view(x[0], 3, (int64_t[]){2, 2, 3}));
}
static gj_tensor *f_expand(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_mul(gj_expand(x[0], 3, (int64_t[]){2, 3, 4}), x[1]);
}
static gj_tensor *f_narrow(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_tanh(gj_narrow(x[0], 1, 1, 2));
}
static gj_tensor *f_cat(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    gj_tensor *p[3] = {x[0], gj_tanh(x[1]), x[0]};
    return gj_cat(3, p, 1);
}
static gj_tensor *f_contiguous(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_mul(gj_contiguous(gj_transpose(x[0], 0, 1)), gj_transpose(x[0], 0, 1));
}
static gj_tensor *f_softmax(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_softmax(x[0], -1); }
static gj_tensor *f_softmax0(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_softmax(x[0], 0); }
static gj_tensor *f_log_softmax(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_log_softmax(x[0], 1); }
static gj_tensor *f_layer_norm(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_layer_norm(x[0], x[1], x[2], 1e-5);
}
static gj_tensor *f_layer_norm_plain(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    return gj_layer_norm(x[0], NULL, NULL, 1e-3);
}
static gj_tensor *f_cross_entropy(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    gj_tensor *lab = gjt_i64(1, (int64_t[]){5}, (int64_t[]){3, 0, 6, 6, 1});
    gj_tensor *l = gj_cross_entropy(x[0], lab);
    gj_release(lab);
    return l;
}
static gj_tensor *f_embedding(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    gj_tensor *idx = gjt_i64(2, (int64_t[]){2, 3}, (int64_t[]){4, 0, 4, 2, 1, 4});
    gj_tensor *e = gj_embedding(x[0], idx);
    gj_release(idx);
    return e;
}
static gj_tensor *f_dropout(gj_tensor **x, gj_dtype dt) { (void)dt; return gj_dropout(x[0], 0.3, true); }
static gj_tensor *f_where(gj_tensor **x, gj_dtype dt) {
    double c[12];
    for (int i = 0; i < 12; i++) c[i] = (i * 7) % 3 == 0;
    gj_tensor *cond = gjt_tensor(dt, 2, (int64_t[]){3, 4}, c);
    gj_tensor *w = gj_where(cond, x[0], x[1]);
    gj_release(cond);
    return w;
}
static gj_tensor *f_masked_fill(gj_tensor **x, gj_dtype dt) {
    double c[4] = {1, 0, 0, 1};
    gj_tensor *m = gjt_tensor(dt, 1, (int64_t[]){4}, c);
    gj_tensor *w = gj_masked_fill(gj_exp(x[0]), m, 0.5);
    gj_release(m);
    return w;
}
static gj_tensor *f_cast(gj_tensor **x, gj_dtype dt) {
    gj_dtype other = dt == GJ_F64 ? GJ_F32 : GJ_F64;
    return gj_cast(gj_tanh(gj_cast(x[0], other)), dt);
}
static gj_tensor *f_nn_linear(gj_tensor **x, gj_dtype dt) {
    gj_linear_layer l;
    if (gj_linear_init(&l, 4, 3, true, dt) != 0) return NULL;
    gj_set_requires_grad(l.weight, false);
    gj_set_requires_grad(l.bias, false);
    gj_tensor *y = gj_linear_forward(&l, x[0]);
    gj_linear_free(&l);
    return y;
}
static gj_tensor *f_nn_layer_norm(gj_tensor **x, gj_dtype dt) {
    gj_layer_norm_layer l;
    if (gj_layer_norm_init(&l, 6, 1e-5, dt) != 0) return NULL;
    gj_tensor *y = gj_layer_norm_forward(&l, x[0]);
    gj_layer_norm_free(&l);
    return y;
}
/* Three narrows of one tensor (its gradient is a sum of pads, compiled as
 * one CAT; a gap stays zero; relu makes -0.0 pieces, which the eager sum
 * turns into +0.0) and the q/k/v pattern of a fused projection. */
static gj_tensor *f_narrow_sum(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    gj_tensor *a = gj_tanh(gj_narrow(x[0], 1, 0, 2));
    gj_tensor *b = gj_relu(gj_narrow(x[0], 1, 4, 2));
    gj_tensor *c = gj_mul(gj_narrow(x[0], 1, 7, 2), gj_narrow(x[0], 1, 2, 2));
    gj_tensor *p[3] = {a, b, c};
    return gj_cat(3, p, 0);
}
/* 20 single-column narrows of one tensor: more pieces than one CAT takes
 * (the sum of pads stays as it is). */
static gj_tensor *f_narrow_many(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    gj_tensor *acc = NULL;
    for (int k = 0; k < 20; k++) {
        gj_tensor *t = gj_mul_scalar(gj_narrow(x[0], 1, 2 * k, 1), 1.0 + 0.25 * k);
        acc = acc ? gj_add(acc, t) : t;
    }
    return acc;
}

/* A checkpoint region recomputing forward composites, max and a gather
 * inside the compiled backward (the region's forward replay is part of the
 * captured graph): softmax, log_softmax, layer_norm, max, embedding, and a
 * cross-entropy as a second output. */
static int ckpt_body(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    (void)user;
    (void)n_in;
    (void)n_out;
    gj_tensor *idx = gjt_i64(1, (int64_t[]){4}, (int64_t[]){1, 4, 1, 0});
    gj_tensor *lab = gjt_i64(1, (int64_t[]){4}, (int64_t[]){5, 0, 2, 2});
    gj_tensor *h = gj_add(in[0], gj_embedding(in[1], idx));
    gj_tensor *y = gj_mul(gj_softmax(h, -1), gj_log_softmax(h, 1));
    y = gj_sub(gj_add(y, gj_layer_norm(h, NULL, NULL, 1e-5)), gj_max(h, 1, true));
    out[0] = y;
    out[1] = gj_cross_entropy(gj_tanh(h), lab);
    gj_release(idx);
    gj_release(lab);
    return out[0] && out[1] ? 0 : -1;
}
static gj_tensor *f_checkpoint(gj_tensor **x, gj_dtype dt) {
    (void)dt;
    gj_tensor *out[2] = {NULL, NULL};
    if (gj_checkpoint(ckpt_body, NULL, 2, x, 2, out, NULL, NULL) != 0) return NULL;
    gj_tensor *y = gj_add(out[0], out[1]);
    gj_release(out[0]);
    gj_release(out[1]);
    return y;
}
static gj_tensor *f_chain(gj_tensor **x, gj_dtype dt) { /* a small MLP block end to end */
    (void)dt;
    gj_tensor *h = gj_gelu(gj_linear(gj_layer_norm(x[0], NULL, NULL, 1e-5), x[1], x[2]));
    return gj_softmax(h, -1);
}


static const op_case g_cases[] = {
    {"add", 2, {2, 1}, {{3, 4}, {4}}, {-1, -1}, {1, 1}, f_add, false},
    {"sub", 2, {2, 2}, {{3, 4}, {3, 1}}, {-1, -1}, {1, 1}, f_sub, false},
    {"mul", 2, {2, 2}, {{3, 4}, {1, 4}}, {-1, -1}, {1, 1}, f_mul, false},
    {"div", 2, {2, 1}, {{3, 4}, {4}}, {-1, 0.5}, {1, 2}, f_div, false},
    {"neg", 1, {2}, {{3, 4}}, {-1}, {1}, f_neg, false},
    {"exp", 1, {2}, {{3, 4}}, {-2}, {2}, f_exp, false},
    {"log", 1, {2}, {{3, 4}}, {0.1}, {3}, f_log, false},
    {"tanh", 1, {2}, {{3, 4}}, {-2}, {2}, f_tanh, false},
    {"sigmoid", 1, {2}, {{3, 4}}, {-3}, {3}, f_sigmoid, false},
    {"relu", 1, {2}, {{3, 4}}, {-1}, {1}, f_relu, false},
    {"gelu", 1, {2}, {{3, 4}}, {-3}, {3}, f_gelu, false},
    {"sqrt", 1, {2}, {{3, 4}}, {0.1}, {4}, f_sqrt, false},
    {"pow_scalar", 1, {2}, {{3, 4}}, {0.1}, {2}, f_pow, false},
    {"add_scalar", 1, {2}, {{3, 4}}, {-1}, {1}, f_add_scalar, false},
    {"mul_scalar", 1, {2}, {{3, 4}}, {-1}, {1}, f_mul_scalar, false},
    {"sum_axis", 1, {3}, {{2, 3, 4}}, {-1}, {1}, f_sum_axis, false},
    {"sum_keepdim", 1, {3}, {{2, 3, 4}}, {-1}, {1}, f_sum_keep, false},
    {"sum_all", 1, {2}, {{3, 4}}, {-1}, {1}, f_sum_all, false},
    {"mean", 1, {2}, {{3, 4}}, {-1}, {1}, f_mean, false},
    {"mean_all", 1, {3}, {{2, 3, 4}}, {-1}, {1}, f_mean_all, false},
    {"max_axis0", 1, {2}, {{3, 4}}, {-1}, {1}, f_max0, false},
    {"max_axis1_keepdim", 1, {2}, {{3, 4}}, {-1}, {1}, f_max1, false},
    {"matmul", 2, {2, 2}, {{3, 4}, {4, 5}}, {-1, -1}, {1, 1}, f_matmul, true},
    {"matmul_batched", 2, {3, 2}, {{2, 3, 4}, {4, 5}}, {-1, -1}, {1, 1}, f_matmul, true},
    {"matmul_batched2", 2, {3, 3}, {{2, 3, 4}, {2, 4, 5}}, {-1, -1}, {1, 1}, f_matmul, true},
    {"linear", 3, {3, 2, 1}, {{2, 3, 4}, {5, 4}, {5}}, {-1, -1, -1}, {1, 1, 1}, f_linear, true},
    {"linear_no_bias", 2, {2, 2}, {{3, 4}, {5, 4}}, {-1, -1}, {1, 1}, f_linear_nb, true},
    {"transpose", 2, {3, 3}, {{2, 3, 4}, {4, 3, 2}}, {-1, -1}, {1, 1}, f_transpose, false},
    {"permute", 1, {3}, {{2, 3, 4}}, {-1}, {1}, f_permute, false},
    {"reshape", 1, {3}, {{2, 3, 2}}, {-1}, {1}, f_reshape, false},
    {"view", 1, {2}, {{4, 3}}, {-1}, {1}, f_view, false},
    {"expand", 2, {2, 3}, {{3, 1}, {2, 3, 4}}, {-1, -1}, {1, 1}, f_expand, false},
    {"narrow", 1, {2}, {{3, 4}}, {-1}, {1}, f_narrow, false},
    {"cat", 2, {2, 2}, {{3, 2}, {3, 4}}, {-1, -1}, {1, 1}, f_cat, false},
    {"narrow_sum", 1, {2}, {{3, 10}}, {-1}, {1}, f_narrow_sum, false},
    {"narrow_many", 1, {2}, {{2, 41}}, {-1}, {1}, f_narrow_many, false},
    {"contiguous", 1, {2}, {{3, 4}}, {-1}, {1}, f_contiguous, false},
    {"softmax", 1, {2}, {{3, 7}}, {-3}, {3}, f_softmax, false},
    {"softmax_axis0", 1, {2}, {{5, 3}}, {-3}, {3}, f_softmax0, false},
    {"log_softmax", 1, {2}, {{3, 9}}, {-3}, {3}, f_log_softmax, false},
    {"layer_norm", 3, {3, 1, 1}, {{2, 3, 10}, {10}, {10}}, {-2, 0.5, -0.5}, {2, 1.5, 0.5}, f_layer_norm, false},
    {"layer_norm_plain", 1, {2}, {{4, 13}}, {-2}, {2}, f_layer_norm_plain, false},
    {"cross_entropy", 1, {2}, {{5, 7}}, {-3}, {3}, f_cross_entropy, false},
    {"embedding", 1, {2}, {{5, 3}}, {-1}, {1}, f_embedding, false},
    {"dropout", 1, {2}, {{3, 4}}, {-1}, {1}, f_dropout, false},
    {"where", 2, {2, 2}, {{3, 4}, {3, 4}}, {-1, -1}, {1, 1}, f_where, false},
    {"masked_fill", 1, {2}, {{3, 4}}, {-1}, {1}, f_masked_fill, false},
    {"cast", 1, {2}, {{3, 4}}, {-1}, {1}, f_cast, false},
    {"nn_linear", 1, {2}, {{3, 4}}, {-1}, {1}, f_nn_linear, true},
    {"nn_layer_norm", 1, {2}, {{3, 6}}, {-1}, {1}, f_nn_layer_norm, false},
    {"checkpoint_recompute", 2, {2, 2}, {{4, 6}, {5, 6}}, {-2, -1}, {2, 1}, f_checkpoint, false},
    {"ln_linear_gelu_softmax", 3, {2, 2, 1}, {{4, 6}, {5, 6}, {5}}, {-1, -1, -1}, {1, 1, 1}, f_chain, true},
};

/* ------------------------------------------------------------ harness */

/* One backward of case c in dtype dt, compiled or not, with existing
 * .grad buffers when accumulate; returns each input's .grad values. */
static double **run_case(const op_case *c, gj_dtype dt, bool compiled, bool accumulate) {
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    gj_tensor *x[MAXIN] = {NULL};
    for (int i = 0; i < c->n_in; i++) {
        x[i] = gjt_uniform(&r, dt, c->ndim[i], c->shape[i], c->lo[i], c->hi[i]);
        assert_non_null(x[i]);
        assert_int_equal(gj_set_requires_grad(x[i], true), 0);
        if (accumulate) {
            gj_tensor *g0 = gjt_uniform(&r, dt, c->ndim[i], c->shape[i], -1, 1);
            assert_int_equal(gj_tensor_set_grad(x[i], g0), 0);
            gj_release(g0);
        }
    }
    gj_manual_seed(5);
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *y = c->fn(x, dt);
    if (!y) print_error("%s: %s\n", c->name, gj_last_error());
    assert_non_null(y);
    gj_tensor *w = gjt_uniform(&r, dt, gj_tensor_ndim(y), gj_tensor_shape(y), -1, 1);
    gj_tensor *loss = gj_sum(gj_mul(y, w), 0, NULL, false);
    gj_release(w);
    assert_non_null(loss);
    if (gj_backward(loss, NULL) != 0) print_error("%s: %s\n", c->name, gj_last_error());
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    double **g = calloc(MAXIN, sizeof *g);
    assert_non_null(g);
    for (int i = 0; i < c->n_in; i++) {
        gj_tensor *t = gj_tensor_grad(x[i]);
        g[i] = t ? gjt_values(t) : NULL;
        gj_release(x[i]);
    }
    return g;
}

static void check_case(const op_case *c, gj_dtype dt, bool accumulate) {
    double **ge = run_case(c, dt, false, accumulate);
    gj_ca_stats s0, s1;
    gj_compiled_autograd_stats(&s0);
    double **gc = run_case(c, dt, true, accumulate);
    gj_compiled_autograd_stats(&s1);
    char what[96];
    snprintf(what, sizeof what, "%s %s%s", c->name, gj_rt_dtype_name(dt),
             accumulate ? " (into .grad)" : "");
    if (s1.fallbacks != s0.fallbacks) {
        print_error("%s fell back: %s\n", what, gj_compiled_autograd_last_fallback());
        fail();
    }
    /* (or bound to kernels another case compiled: instantiations) */
    assert_int_equal(s1.compiles + s1.mem_hits + s1.instantiations,
                     s0.compiles + s0.mem_hits + s0.instantiations + 1);
    for (int i = 0; i < c->n_in; i++) {
        assert_true((ge[i] == NULL) == (gc[i] == NULL));
        if (!ge[i]) continue;
        int64_t n = gjt_numel(c->ndim[i], c->shape[i]);
        if (!c->ordered) {
            for (int64_t k = 0; k < n; k++) {
                if (memcmp(&ge[i][k], &gc[i][k], sizeof(double)) != 0) {
                    print_error("%s input %d [%lld]: compiled %.17g, eager %.17g (not bit-equal)\n",
                                what, i, (long long)k, gc[i][k], ge[i][k]);
                    fail();
                }
            }
        } else {
            double mx = 0, rtol = dt == GJ_F64 ? 1e-12 : 1e-6;
            for (int64_t k = 0; k < n; k++) mx = fmax(mx, fabs(ge[i][k]));
            assert_true(gjt_allclose(what, gc[i], ge[i], n, rtol * mx + 1e-300, 0.0));
        }
        free(ge[i]);
        free(gc[i]);
    }
    free(ge);
    free(gc);
}

static void test_every_op(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_compiled_autograd_reset_stats();
    int n = (int)(sizeof g_cases / sizeof g_cases[0]);
    for (int k = 0; k < n; k++) {
        check_case(&g_cases[k], GJ_F32, false);
        check_case(&g_cases[k], GJ_F64, false);
        check_case(&g_cases[k], GJ_F32, true);
    }
    gj_ca_stats s;
    gj_compiled_autograd_stats(&s);
    assert_int_equal(s.fallbacks, 0);
    print_message("%d ops x (f32, f64, f32 into .grad): %lld compiled backwards (%lld compiles, "
                  "%lld bound to kernels of other cases), 0 fallbacks\n",
                  n, (long long)(s.compiles + s.mem_hits + s.instantiations), (long long)s.compiles,
                  (long long)s.instantiations);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL);
    gj_jit_set_recompile_limit(-1); /* many small models, some of one call site */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_op),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
