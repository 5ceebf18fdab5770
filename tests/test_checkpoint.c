/* SPDX-License-Identifier: MIT */
/*
 * test_checkpoint.c - activation checkpointing (gj_checkpoint, issue #5):
 * gradients equal the run without checkpointing (f64, every policy), the
 * region's node holds only what the policy saved, a backward that skips one
 * region still gives the next region its own saved values, dropout draws the
 * same mask when recomputed, matmul counts of the eager backward and of the
 * captured graph follow the policy, nested regions are a clear error, a
 * finite-difference check of a checkpointed MLP, the W4-style memory bound
 * (8 layers: eager with checkpointing peaks at most half of eager without),
 * compiled peaks at most eager's with and without checkpointing (a small
 * W4-style model, and the bench's W4 and W4n at their own size) and
 * compiled autograd's gradients equal eager's.
 *
 * Dimension legend: N rows (batch), C features, H hidden.
 */
#include "gjtest.h"

#include "autograd/ag.h"
#include "jit/capture/capture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ helpers */

static gj_tensor *leaf(gjt_rng *r, gj_dtype dt, int ndim, const int64_t *shape, double lo,
                       double hi, bool rg) {
    gj_tensor *t = gjt_uniform(r, dt, ndim, shape, lo, hi);
    assert_non_null(t);
    if (rg)
        assert_int_equal(gj_set_requires_grad(t, true), 0);
    return t;
}

/* The .grad values of t (malloc'd), then clears .grad. */
static double *take_grad(gj_tensor *t) {
    gj_tensor *g = gj_tensor_grad(t);
    assert_non_null(g);
    double *v = gjt_values(g);
    assert_non_null(v);
    assert_int_equal(gj_tensor_set_grad(t, NULL), 0);
    return v;
}

/* max |a - b| <= rel * max |b|, printing the worst element otherwise. */
static bool same(const char *what, const double *a, const double *b, int64_t n, double rel) {
    double scale = 0, d = 0;
    int64_t worst = 0;
    for (int64_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(b[i]));
        if (fabs(a[i] - b[i]) > d) {
            d = fabs(a[i] - b[i]);
            worst = i;
        }
    }
    if (d <= rel * scale)
        return true;
    fprintf(stderr, "  %s: max |diff| %.3g (max |ref| %.3g) at [%lld]: %.17g vs %.17g\n", what, d,
            scale, (long long)worst, a[worst], b[worst]);
    return false;
}

/* The checkpoint node behind a region output (borrowed). */
static gj_ag_node *node_of(gj_tensor *t) {
    gj_ag_tensor_meta *m = t->ag;
    assert_non_null(m);
    assert_non_null(m->node);
    assert_ptr_equal(m->node->op, &gj_ag_op_checkpoint);
    return m->node;
}

/* -------------------------------------------- mm -> gelu -> mm regions */

typedef struct mlp2 {
    gj_tensor *w1, *w2; /* [C, H], [H, C]: parameters, read from outside the region */
    double p;           /* dropout after the first matmul when > 0 */
} mlp2;

/* out = gelu(x w1) w2 (with dropout(p) after x w1 if p > 0). */
static int mlp2_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    mlp2 *m = user;
    gj_tensor *h = gj_matmul(in[0], m->w1);
    if (h && m->p > 0)
        h = gj_dropout(h, m->p, true);
    gj_tensor *g = h ? gj_gelu(h) : NULL;
    out[0] = g ? gj_matmul(g, m->w2) : NULL;
    return out[0] ? 0 : -1;
}

static gj_ckpt_policy pol_mm_recompute(const char *op, int pos, void *d) {
    (void)pos, (void)d;
    return strcmp(op, "matmul") == 0 ? GJ_CKPT_PREFER_RECOMPUTE : GJ_CKPT_MUST_RECOMPUTE;
}
static gj_ckpt_policy pol_mm_save(const char *op, int pos, void *d) {
    (void)pos, (void)d;
    return strcmp(op, "matmul") == 0 ? GJ_CKPT_MUST_SAVE : GJ_CKPT_PREFER_RECOMPUTE;
}
static gj_ckpt_policy pol_all_save(const char *op, int pos, void *d) {
    (void)op, (void)pos, (void)d;
    return GJ_CKPT_PREFER_SAVE;
}
static gj_ckpt_policy pol_gelu_save(const char *op, int pos, void *d) {
    (void)pos, (void)d;
    return strcmp(op, "gelu") == 0 ? GJ_CKPT_MUST_SAVE : GJ_CKPT_MUST_RECOMPUTE;
}

typedef enum { NO_CKPT = -1, P_NONE = 0, P_MM_RECOMPUTE, P_MM_SAVE, P_ALL_SAVE, P_GELU_SAVE } pmode;
static const gj_ckpt_policy_fn POLICIES[] = {NULL, pol_mm_recompute, pol_mm_save, pol_all_save,
                                             pol_gelu_save};

/* y = region(x) (or the plain computation for NO_CKPT): a new reference. */
static gj_tensor *mlp2_apply(mlp2 *m, gj_tensor *x, pmode mode) {
    gj_tensor *y = NULL;
    if (mode == NO_CKPT) {
        assert_int_equal(mlp2_fn(m, 1, &x, 1, &y), 0);
        return y;
    }
    assert_int_equal(gj_checkpoint(mlp2_fn, m, 1, &x, 1, &y, POLICIES[mode], NULL), 0);
    assert_non_null(y);
    return y;
}

enum { N = 6, C = 5, H = 7 };

typedef struct mlp_case {
    gj_tensor *x, *w1, *w2, *r; /* r [N, C]: the loss weights */
    mlp2 m;
} mlp_case;

static void case_init(mlp_case *c, gj_dtype dt, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    c->x = leaf(&r, dt, 2, (int64_t[]){N, C}, -1, 1, true);
    c->w1 = leaf(&r, dt, 2, (int64_t[]){C, H}, -1, 1, true);
    c->w2 = leaf(&r, dt, 2, (int64_t[]){H, C}, -1, 1, true);
    c->r = leaf(&r, dt, 2, (int64_t[]){N, C}, -1, 1, false);
    c->m = (mlp2){c->w1, c->w2, 0};
}

static void case_free(mlp_case *c) {
    gj_release(c->x);
    gj_release(c->w1);
    gj_release(c->w2);
    gj_release(c->r);
}

/* loss = sum(region(x) * r), a new (scoped) reference. */
static gj_tensor *case_loss(mlp_case *c, pmode mode) {
    gj_tensor *y = mlp2_apply(&c->m, c->x, mode);
    gj_tensor *l = gj_sum(gj_mul(y, c->r), 0, NULL, false);
    assert_non_null(l);
    return l;
}

/* Gradients of x, w1, w2 after one backward in mode (malloc'd, [3]). */
static void case_grads(mlp_case *c, pmode mode, double **g) {
    gj_scope_push();
    assert_int_equal(gj_backward(case_loss(c, mode), NULL), 0);
    gj_scope_pop();
    g[0] = take_grad(c->x);
    g[1] = take_grad(c->w1);
    g[2] = take_grad(c->w2);
}

/* Gradients equal the run without checkpointing for every policy; the node
 * holds exactly the inputs it reads plus what the policy saved. */
static void test_eager_semantics(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    mlp_case c;
    case_init(&c, GJ_F64, 11);
    double *ref[3];
    case_grads(&c, NO_CKPT, ref);
    const int64_t n[3] = {N * C, C * H, H * C};
    /* stored: x, w1, w2 (sources read) + saved outputs */
    const int stored[] = {3, 3, 3 + 2, 3 + 3, 3 + 1};
    const int saved_entries[] = {0, 0, 2, 3, 1};
    for (int mode = P_NONE; mode <= P_GELU_SAVE; mode++) {
        double *g[3];
        gj_scope_push();
        gj_tensor *y = mlp2_apply(&c.m, c.x, (pmode)mode);
        assert_true(gj_requires_grad(y));
        assert_false(gj_is_leaf(y));
        gj_ag_ckpt_info info;
        assert_int_equal(gj_ag_ckpt_info_of(node_of(y), &info), 0);
        assert_int_equal(info.n_entries, 3);
        assert_int_equal(info.n_saved_entries, saved_entries[mode]);
        assert_int_equal(info.n_stored, stored[mode]);
        assert_int_equal(info.n_in_node, 3); /* x, then w1 and w2 (implicit inputs) */
        gj_tensor *l = gj_sum(gj_mul(y, c.r), 0, NULL, false);
        assert_int_equal(gj_backward(l, NULL), 0);
        gj_scope_pop();
        g[0] = take_grad(c.x);
        g[1] = take_grad(c.w1);
        g[2] = take_grad(c.w2);
        for (int i = 0; i < 3; i++) {
            char what[64];
            snprintf(what, sizeof what, "policy %d grad %d", mode, i);
            assert_true(same(what, g[i], ref[i], n[i], 1e-14));
            free(g[i]);
        }
    }
    for (int i = 0; i < 3; i++)
        free(ref[i]);
    /* the tape's canonical text: the same for the same region built twice
     * (no address in it), telling policies apart */
    gj_scope_push();
    char *txt[3];
    const pmode tm[3] = {P_MM_SAVE, P_MM_SAVE, P_MM_RECOMPUTE};
    for (int k = 0; k < 3; k++) {
        gj_ag_node *nd = node_of(mlp2_apply(&c.m, c.x, tm[k]));
        int64_t len = gj_ag_ckpt_serialize(nd, NULL, NULL, 0);
        assert_true(len > 0);
        txt[k] = malloc((size_t)len + 1);
        assert_int_equal(gj_ag_ckpt_serialize(nd, NULL, txt[k], (size_t)len + 1), len);
        assert_int_equal(gj_ag_ckpt_n_ops(nd), 3);
        const gj_ag_attrs *at = NULL;
        assert_ptr_equal(gj_ag_ckpt_op(nd, 1, &at), &gj_ag_op_gelu);
        assert_non_null(at);
        assert_null(gj_ag_ckpt_op(nd, 3, &at));
    }
    assert_string_equal(txt[0], txt[1]);
    assert_string_not_equal(txt[0], txt[2]);
    assert_non_null(strstr(txt[0], "E0 matmul"));
    assert_non_null(strstr(txt[0], "MUST_SAVE"));
    assert_null(strstr(txt[2], "MUST_SAVE"));
    for (int k = 0; k < 3; k++)
        free(txt[k]);
    gj_scope_pop();
    /* a second backward through a used region fails like any graph */
    gj_scope_push();
    gj_tensor *l = case_loss(&c, P_MM_SAVE);
    assert_int_equal(gj_backward(l, NULL), 0);
    assert_int_not_equal(gj_backward(l, NULL), 0);
    GJT_ASSERT_ERROR("second time");
    gj_scope_pop();
    for (gj_tensor **t = (gj_tensor *[]){c.x, c.w1, c.w2}, **e = t + 3; t < e; t++)
        assert_int_equal(gj_tensor_set_grad(*t, NULL), 0);
    /* retain_graph: two backwards through the same region add up */
    gj_scope_push();
    l = case_loss(&c, P_MM_RECOMPUTE);
    assert_int_equal(gj_backward_ex(l, NULL, true), 0);
    double *g1 = take_grad(c.w1);
    assert_int_equal(gj_backward_ex(l, NULL, true), 0);
    assert_int_equal(gj_backward(l, NULL), 0);
    double *g3 = take_grad(c.w1);
    for (int i = 0; i < C * H; i++)
        assert_true(fabs(g3[i] - 2 * g1[i]) <= 1e-12 * (1 + fabs(g1[i])));
    free(g1);
    free(g3);
    gj_scope_pop();
    assert_int_equal(gj_tensor_set_grad(c.x, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(c.w2, NULL), 0);
    case_free(&c);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------ policy calls */

typedef struct seen {
    int n;
    char name[8][16];
    int pos[8];
    gj_ckpt_policy answer;
} seen;

static gj_ckpt_policy pol_record(const char *op, int pos, void *d) {
    seen *s = d;
    if (s->n < 8) {
        snprintf(s->name[s->n], sizeof s->name[0], "%s", op);
        s->pos[s->n++] = pos;
    }
    return s->answer;
}

/* The policy sees every op of the region with its position, once per
 * forward (never during recomputation); an invalid answer is an error. */
static void test_policy_calls(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    mlp_case c;
    case_init(&c, GJ_F64, 12);
    seen sn = {.answer = GJ_CKPT_MUST_RECOMPUTE};
    gj_scope_push();
    gj_tensor *y = NULL;
    assert_int_equal(gj_checkpoint(mlp2_fn, &c.m, 1, &c.x, 1, &y, pol_record, &sn), 0);
    assert_int_equal(sn.n, 3);
    assert_string_equal(sn.name[0], "matmul");
    assert_string_equal(sn.name[1], "gelu");
    assert_string_equal(sn.name[2], "matmul");
    for (int i = 0; i < 3; i++)
        assert_int_equal(sn.pos[i], i);
    assert_int_equal(gj_backward(gj_sum(y, 0, NULL, false), NULL), 0);
    assert_int_equal(sn.n, 3);
    /* an answer outside the enum */
    sn = (seen){.answer = (gj_ckpt_policy)7};
    gj_tensor *y2 = (gj_tensor *)&sn;
    assert_int_not_equal(gj_checkpoint(mlp2_fn, &c.m, 1, &c.x, 1, &y2, pol_record, &sn), 0);
    assert_null(y2);
    GJT_ASSERT_ERROR("policy returned 7 for op matmul at position 0");
    gj_scope_pop();
    for (gj_tensor **t = (gj_tensor *[]){c.x, c.w1, c.w2}, **e = t + 3; t < e; t++)
        assert_int_equal(gj_tensor_set_grad(*t, NULL), 0);
    case_free(&c);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ----------------------------------------------------- matmul counts */

/* MATMUL executions of one eager backward of the case under mode. */
static int64_t backward_matmuls(mlp_case *c, pmode mode) {
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(false);
    gj_scope_push();
    gj_tensor *l = case_loss(c, mode);
    gj_rt_exec_count_reset();
    assert_int_equal(gj_backward(l, NULL), 0);
    int64_t n = gj_rt_exec_count(GJ_P_MATMUL);
    gj_scope_pop();
    gj_set_compiled_autograd(was);
    for (gj_tensor **t = (gj_tensor *[]){c->x, c->w1, c->w2}, **e = t + 3; t < e; t++)
        assert_int_equal(gj_tensor_set_grad(*t, NULL), 0);
    return n;
}

/* Eager: recomputing the first matmul costs one matmul more than saving it
 * (the second one's output is not needed by any backward formula). */
static void test_eager_matmul_counts(void **s) {
    (void)s;
    mlp_case c;
    case_init(&c, GJ_F32, 13);
    int64_t plain = backward_matmuls(&c, NO_CKPT);
    int64_t rec = backward_matmuls(&c, P_MM_RECOMPUTE);
    int64_t sav = backward_matmuls(&c, P_MM_SAVE);
    int64_t none = backward_matmuls(&c, P_NONE);
    fprintf(stderr, "  backward matmuls: plain %lld, matmul PREFER_RECOMPUTE %lld, MUST_SAVE "
                    "%lld, no policy %lld\n",
            (long long)plain, (long long)rec, (long long)sav, (long long)none);
    assert_int_equal(plain, 4); /* two per matmul: x, w1 and w2 need gradients */
    assert_int_equal(rec, 5);
    assert_int_equal(sav, 4);
    assert_int_equal(none, 5);
    case_free(&c);
}

/* --------------------------------------- two regions, one skipped */

/* gj_grad of region 2's weights of loss = sum(region2(region1(x)) * r): the
 * engine skips region 1 (nothing it leads to needs a gradient), and region
 * 2, whose ops are of the same kinds, must still read its own saved values.
 * The eager matmul count shows region 1 was not recomputed. */
static void test_two_regions_skip_first(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(false); /* gj_grad is eager anyway */
    gjt_rng r;
    gjt_rng_seed(&r, 14);
    gj_tensor *x = leaf(&r, GJ_F64, 2, (int64_t[]){N, C}, -1, 1, true);
    gj_tensor *w[4];
    for (int i = 0; i < 4; i++)
        w[i] = leaf(&r, GJ_F64, 2, i % 2 ? (int64_t[]){H, C} : (int64_t[]){C, H}, -1, 1, true);
    gj_tensor *rr = leaf(&r, GJ_F64, 2, (int64_t[]){N, C}, -1, 1, false);
    mlp2 m1 = {w[0], w[1], 0}, m2 = {w[2], w[3], 0};
    double *ref[2] = {0};
    for (int mode = NO_CKPT; mode <= P_GELU_SAVE; mode++) {
        gj_scope_push();
        gj_tensor *y1 = mlp2_apply(&m1, x, (pmode)mode);
        gj_tensor *y2 = mlp2_apply(&m2, y1, (pmode)mode);
        gj_tensor *l = gj_sum(gj_mul(y2, rr), 0, NULL, false);
        gj_tensor *gw[2] = {0};
        gj_rt_exec_count_reset();
        assert_int_equal(gj_grad(1, &l, NULL, 2, &w[2], gw, false, false), 0);
        /* region 2 only: dW3 and dg of its second matmul, dW2 of its first,
         * plus the first matmul again when the policy recomputes matmuls */
        bool mm_saved = mode == P_MM_SAVE || mode == P_ALL_SAVE || mode == NO_CKPT;
        assert_int_equal(gj_rt_exec_count(GJ_P_MATMUL), mm_saved ? 3 : 4);
        for (int i = 0; i < 2; i++) {
            double *v = gjt_values(gw[i]);
            assert_non_null(v);
            gj_release(gw[i]);
            if (mode == NO_CKPT) {
                ref[i] = v;
                continue;
            }
            char what[64];
            snprintf(what, sizeof what, "policy %d dW%d", mode, i + 2);
            assert_true(same(what, v, ref[i], C * H, 1e-14));
            free(v);
        }
        gj_scope_pop();
    }
    for (int i = 0; i < 2; i++)
        free(ref[i]);
    /* nothing reached the leaves' .grad */
    for (int i = 0; i < 4; i++)
        assert_null(gj_tensor_grad(w[i]));
    assert_null(gj_tensor_grad(x));
    for (int i = 0; i < 4; i++)
        gj_release(w[i]);
    gj_release(x);
    gj_release(rr);
    gj_set_compiled_autograd(was);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* -------------------------------------------------------------- dropout */

static uint32_t dropout_rt(const gj_ag_opdef *op) { return op == &gj_ag_op_dropout ? 0x3u : 0u; }

/* Dropout inside a region draws the same mask when recomputed: gradients
 * equal the run without checkpointing from the same seed, and the
 * generator ends in the same state (recomputation draws nothing). */
static void test_dropout_mask(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    mlp_case c;
    case_init(&c, GJ_F64, 15);
    c.m.p = 0.5;
    double *ref[3], *after_ref, *after;
    gj_manual_seed(99);
    case_grads(&c, NO_CKPT, ref);
    gj_tensor *u = gj_rand(GJ_F64, 1, (int64_t[]){4}, 0, 1);
    after_ref = gjt_values(u);
    gj_release(u);
    for (pmode mode = P_NONE; mode <= P_MM_SAVE; mode++) {
        double *g[3];
        gj_manual_seed(99);
        case_grads(&c, mode, g);
        u = gj_rand(GJ_F64, 1, (int64_t[]){4}, 0, 1);
        after = gjt_values(u);
        gj_release(u);
        assert_true(same("generator state after backward", after, after_ref, 4, 0));
        free(after);
        const int64_t n[3] = {N * C, C * H, H * C};
        for (int i = 0; i < 3; i++) {
            char what[64];
            snprintf(what, sizeof what, "dropout policy %d grad %d", mode, i);
            assert_true(same(what, g[i], ref[i], n[i], 1e-14));
            free(g[i]);
        }
    }
    /* dropout's seed and offset are run-time attributes for the JIT key */
    gj_scope_push();
    gj_ag_node *nd = node_of(mlp2_apply(&c.m, c.x, P_NONE));
    char txt[4096];
    assert_true(gj_ag_ckpt_serialize(nd, dropout_rt, txt, sizeof txt) < (int64_t)sizeof txt);
    assert_non_null(strstr(txt, "E1 dropout af0x1p-1i*,*"));
    assert_true(gj_ag_ckpt_serialize(nd, NULL, txt, sizeof txt) < (int64_t)sizeof txt);
    assert_null(strstr(txt, "i*"));
    gj_scope_pop();
    /* a different seed gives a different gradient (the mask matters) */
    double *g[3];
    gj_manual_seed(100);
    case_grads(&c, P_NONE, g);
    bool differs = false;
    for (int i = 0; i < C * H; i++)
        differs |= fabs(g[1][i] - ref[1][i]) > 1e-9;
    assert_true(differs);
    for (int i = 0; i < 3; i++) {
        free(g[i]);
        free(ref[i]);
    }
    free(after_ref);
    case_free(&c);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Compiled autograd with dropout in a region: two steps with different
 * masks each give the eager gradients of their own step (a cached program
 * must never replay the first step's mask). */
static void test_dropout_compiled(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    mlp_case c;
    case_init(&c, GJ_F32, 20);
    c.m.p = 0.25;
    for (uint64_t seed = 5; seed < 8; seed++) {
        double *ge[3], *gc[3];
        gj_set_compiled_autograd(false);
        gj_manual_seed(seed);
        case_grads(&c, P_MM_RECOMPUTE, ge);
        gj_set_compiled_autograd(true);
        gj_manual_seed(seed);
        case_grads(&c, P_MM_RECOMPUTE, gc);
        const int64_t n[3] = {N * C, C * H, H * C};
        for (int i = 0; i < 3; i++) {
            assert_true(same("compiled dropout vs eager", gc[i], ge[i], n[i], 1e-6));
            free(ge[i]);
            free(gc[i]);
        }
    }
    gj_set_compiled_autograd(was);
    case_free(&c);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------- more stored tensors than a node */

typedef struct long_ctx {
    gj_tensor *stash; /* the 8th op's output, kept by the test */
} long_ctx;

/* Nine ops, all saved: with the input, ten stored tensors (more than a
 * node's GJ_AG_MAX_SAVED: the tape holds the rest itself). */
static int long_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    long_ctx *lc = user;
    gj_tensor *t = in[0];
    for (int k = 0; k < 9 && t; k++) {
        t = k % 3 == 0 ? gj_tanh(t) : k % 3 == 1 ? gj_mul_scalar(t, 0.75) : gj_sigmoid(t);
        if (k == 7 && t)
            lc->stash = gj_retain(t);
    }
    out[0] = t;
    return t ? 0 : -1;
}

static void test_many_stored(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    gjt_rng r;
    gjt_rng_seed(&r, 21);
    gj_tensor *x = leaf(&r, GJ_F64, 2, (int64_t[]){3, 4}, -2, 2, true);
    double *ref = NULL;
    for (int mode = 0; mode < 3; mode++) { /* plain, checkpointed eager, compiled */
        long_ctx lc = {0};
        gj_set_compiled_autograd(mode == 2);
        gj_scope_push();
        gj_tensor *y = NULL;
        if (mode == 0) {
            assert_int_equal(long_fn(&lc, 1, &x, 1, &y), 0);
        } else {
            assert_int_equal(gj_checkpoint(long_fn, &lc, 1, &x, 1, &y, pol_all_save, NULL), 0);
            gj_ag_ckpt_info info;
            assert_int_equal(gj_ag_ckpt_info_of(node_of(y), &info), 0);
            assert_int_equal(info.n_stored, 10);
            assert_int_equal(info.n_node_saved, 8);
            assert_non_null(gj_ag_ckpt_stored(node_of(y), 9, NULL));
        }
        assert_int_equal(gj_backward(gj_sum(y, 0, NULL, false), NULL), 0);
        gj_scope_pop();
        gj_release(lc.stash);
        double *g = take_grad(x);
        if (mode == 0) {
            ref = g;
            continue;
        }
        assert_true(same(mode == 1 ? "eager, 10 stored" : "compiled, 10 stored", g, ref, 12,
                         mode == 1 ? 1e-15 : 1e-12));
        free(g);
    }
    free(ref);
    /* a stored tensor the tape holds itself, modified in place after the
     * region: the backward refuses it, naming the in-place modification */
    gj_set_compiled_autograd(false);
    long_ctx lc = {0};
    gj_scope_push();
    gj_tensor *y = NULL;
    assert_int_equal(gj_checkpoint(long_fn, &lc, 1, &x, 1, &y, pol_all_save, NULL), 0);
    assert_int_equal(gj_mul_scalar_(lc.stash, 2.0), 0);
    assert_int_not_equal(gj_backward(gj_sum(y, 0, NULL, false), NULL), 0);
    GJT_ASSERT_ERROR("modified by an in-place operation");
    gj_scope_pop();
    gj_release(lc.stash);
    assert_int_equal(gj_tensor_set_grad(x, NULL), 0);
    gj_set_compiled_autograd(was);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------------- nesting, errors */

static int nested_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    mlp2 *m = user;
    gj_tensor *h = gj_tanh(in[0]);
    if (!h)
        return -1;
    return gj_checkpoint(mlp2_fn, m, 1, &h, 1, out, NULL, NULL);
}

static int three_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    out[0] = gj_tanh(in[0]);
    return 0;
}

static int null_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    return 0; /* forgets out[0] */
}

static int inplace_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    gj_tensor *h = gj_tanh(in[0]);
    out[0] = gj_exp(h); /* saved h is read by exp's backward... */
    return gj_mul_scalar_(h, 2.0); /* ...and then modified in place */
}

static int pass_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    out[0] = in[0];                            /* an input passed through */
    out[1] = gj_mul(in[0], (gj_tensor *)user); /* uses an outside tensor requiring grad */
    return out[1] ? 0 : -1;
}

static void test_nested_and_errors(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    mlp_case c;
    case_init(&c, GJ_F64, 16);
    gj_tensor *y = NULL, *yy[3] = {0};
    gj_scope_push();
    /* nested: a clear error, and the thread is usable afterwards */
    assert_int_not_equal(gj_checkpoint(nested_fn, &c.m, 1, &c.x, 1, &y, NULL, NULL), 0);
    assert_null(y);
    GJT_ASSERT_ERROR("nested checkpoint regions are not supported");
    assert_null(gj_ag_ckpt_active());
    assert_int_equal(gj_checkpoint(mlp2_fn, &c.m, 1, &c.x, 1, &y, NULL, NULL), 0);
    assert_int_equal(gj_backward(gj_sum(y, 0, NULL, false), NULL), 0);
    for (gj_tensor **t = (gj_tensor *[]){c.x, c.w1, c.w2}, **e = t + 3; t < e; t++)
        assert_int_equal(gj_tensor_set_grad(*t, NULL), 0);
    /* bad arguments */
    assert_int_not_equal(gj_checkpoint(NULL, NULL, 1, &c.x, 1, &y, NULL, NULL), 0);
    GJT_ASSERT_ERROR("gj_checkpoint");
    assert_int_not_equal(gj_checkpoint(three_fn, NULL, 1, &c.x, 3, yy, NULL, NULL), 0);
    GJT_ASSERT_ERROR("n_out");
    assert_int_not_equal(gj_checkpoint(null_fn, NULL, 1, &c.x, 1, &y, NULL, NULL), 0);
    GJT_ASSERT_ERROR("left out[0] NULL");
    assert_int_not_equal(gj_checkpoint(inplace_fn, NULL, 1, &c.x, 1, &y, NULL, NULL), 0);
    GJT_ASSERT_ERROR("modified in place");
    assert_null(gj_ag_ckpt_active());
    /* a region returning its input and using an outside tensor */
    /* x [N, C] * w1 [C, H] does not broadcast: fn fails, its error is kept */
    assert_int_not_equal(gj_checkpoint(pass_fn, c.w1, 1, &c.x, 2, yy, NULL, NULL), 0);
    GJT_ASSERT_ERROR("the region's function failed");
    gj_tensor *sc = gj_full(GJ_F64, 1, (int64_t[]){C}, 3.0);
    assert_int_equal(gj_set_requires_grad(sc, true), 0);
    assert_int_equal(gj_checkpoint(pass_fn, sc, 1, &c.x, 2, yy, NULL, NULL), 0);
    assert_ptr_not_equal(yy[0], c.x); /* a new header, not the input itself */
    assert_true(gj_is_leaf(c.x));
    gj_tensor *l = gj_add(gj_sum(yy[0], 0, NULL, false), gj_sum(yy[1], 0, NULL, false));
    assert_int_equal(gj_backward(l, NULL), 0);
    double *gx = take_grad(c.x), *gs = take_grad(sc);
    /* d/dx sum(x) + sum(x * sc) = 1 + 3; d/dsc = column sums of x */
    double *xv = gjt_values(c.x);
    for (int i = 0; i < N * C; i++)
        assert_true(fabs(gx[i] - 4.0) < 1e-15);
    for (int j = 0; j < C; j++) {
        double cs = 0;
        for (int i = 0; i < N; i++)
            cs += xv[i * C + j];
        assert_true(fabs(gs[j] - cs) < 1e-12);
    }
    free(gx);
    free(gs);
    free(xv);
    /* under no-grad fn simply runs */
    gj_no_grad_push();
    assert_int_equal(gj_checkpoint(mlp2_fn, &c.m, 1, &c.x, 1, &y, NULL, NULL), 0);
    assert_false(gj_requires_grad(y));
    gj_no_grad_pop();
    gj_release(sc); /* owned by the scope: gj_release takes it out */
    gj_scope_pop();
    for (gj_tensor **t = (gj_tensor *[]){c.x, c.w1, c.w2}, **e = t + 3; t < e; t++)
        assert_int_equal(gj_tensor_set_grad(*t, NULL), 0);
    case_free(&c);
    assert_int_equal(gjt_live_bytes(), live0);
}

static int twice_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    out[0] = in[0]; /* the caller's tensor itself... */
    out[1] = in[0]; /* ...twice */
    return 0;
}

/* Who owns out[k] (gradjit.h, gj_checkpoint): new references, each a
 * header of its own, given to the caller's innermost scope, under no-grad
 * as with grad. Before, under no-grad, out[k] was in[0] itself registered
 * in the scope: the caller's own gj_release(x) then took it out of the
 * scope, and the scope's reference leaked. */
static void test_out_ownership(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    for (int grad = 0; grad < 2; grad++) {
        gj_tensor *x = gj_ones(GJ_F64, 1, (int64_t[]){5}); /* the caller's, unscoped */
        assert_non_null(x);
        if (grad) assert_int_equal(gj_set_requires_grad(x, true), 0);
        gj_tensor *y[2] = {0};
        gj_scope_push();
        if (!grad) gj_no_grad_push();
        assert_int_equal(gj_checkpoint(twice_fn, NULL, 1, &x, 2, y, NULL, NULL), 0);
        if (!grad) gj_no_grad_pop();
        assert_ptr_not_equal(y[0], x);
        assert_ptr_not_equal(y[1], x);
        assert_ptr_not_equal(y[0], y[1]);
        assert_true(gj_tensor_item_at(y[1], 4) == 1.0);
        gj_release(x); /* the caller's reference: y[] keep the storage alive */
        assert_true(gj_tensor_item_at(y[0], 0) == 1.0);
        gj_scope_pop(); /* the scope owned y[0] and y[1] */
        assert_int_equal(gjt_live_bytes(), live0);
    }
    /* outside any scope the caller owns them */
    gj_tensor *x = gj_full(GJ_F64, 1, (int64_t[]){3}, 2.0), *y[2] = {0};
    gj_no_grad_push();
    assert_int_equal(gj_checkpoint(twice_fn, NULL, 1, &x, 2, y, NULL, NULL), 0);
    gj_no_grad_pop();
    gj_release(x);
    assert_true(gjt_live_bytes() > live0);
    gj_release(y[0]);
    gj_release(y[1]);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Every allocation of a checkpointed forward and backward made to fail in
 * turn: each call fails cleanly or succeeds, nothing leaks, nothing
 * crashes, the thread has no region left open. */
static void test_alloc_failures(void **s) {
    (void)s;
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(false);
    mlp_case c;
    case_init(&c, GJ_F64, 22);
    c.m.p = 0.5;
    int64_t live0 = gjt_live_bytes();
    int failed = 0;
    for (int64_t n = 1;; n++) {
        gj_scope_push();
        gj_rt_alloc_fail_at(n);
        gj_tensor *y = NULL;
        int rc = gj_checkpoint(mlp2_fn, &c.m, 1, &c.x, 1, &y, pol_mm_save, NULL);
        if (rc == 0) {
            gj_tensor *l = gj_sum(gj_mul(y, c.r), 0, NULL, false);
            rc = l ? gj_backward(l, NULL) : -1;
        } else {
            assert_null(y);
        }
        int64_t done = gj_rt_alloc_fail_at(0);
        failed += rc != 0;
        gj_scope_pop();
        assert_null(gj_ag_ckpt_active());
        for (gj_tensor **t = (gj_tensor *[]){c.x, c.w1, c.w2}, **e = t + 3; t < e; t++)
            assert_int_equal(gj_tensor_set_grad(*t, NULL), 0);
        assert_int_equal(gjt_live_bytes(), live0);
        if (done < n) { /* the whole step ran before the n-th allocation */
            assert_int_equal(rc, 0);
            break;
        }
    }
    assert_true(failed > 10);
    gj_set_compiled_autograd(was);
    case_free(&c);
}

/* ------------------------------------------------ finite differences */

/* Two checkpointed layers: y = tanh(linear(x, w1, b1)) -> linear(., w2, b2),
 * each a region reading its parameters from outside. */
typedef struct fd_ctx {
    gj_tensor **p; /* x, w1, b1, w2, b2 */
    gj_ckpt_policy_fn pol;
} fd_ctx;

static int fd_layer1(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    gj_tensor **p = user;
    gj_tensor *h = gj_linear(in[0], p[1], p[2]);
    out[0] = h ? gj_gelu(gj_tanh(h)) : NULL;
    return out[0] ? 0 : -1;
}

static int fd_layer2(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    gj_tensor **p = user;
    out[0] = gj_linear(in[0], p[3], p[4]);
    out[1] = out[0] ? gj_exp(gj_mul_scalar(out[0], 0.5)) : NULL;
    return out[1] ? 0 : -1;
}

static gj_tensor *fd_fn(gj_tensor **in, void *vctx) {
    fd_ctx *c = vctx;
    gj_tensor *h = NULL, *o[2] = {0};
    if (gj_checkpoint(fd_layer1, in, 1, &in[0], 1, &h, c->pol, NULL) != 0)
        return NULL;
    if (gj_checkpoint(fd_layer2, in, 1, &h, 2, o, c->pol, NULL) != 0)
        return NULL;
    return gj_add(o[0], o[1]);
}

static void test_fd_mlp(void **s) {
    (void)s;
    gj_ckpt_policy_fn pols[] = {NULL, pol_all_save, pol_gelu_save};
    for (int k = 0; k < 3; k++) {
        fd_ctx ctx = {NULL, pols[k]};
        gjt_check chk = {
            .name = "checkpointed mlp",
            .fn = fd_fn,
            .ctx = &ctx,
            .n_in = 5,
            .in = {{2, {3, 4}}, {2, {5, 4}}, {1, {5}}, {2, {2, 5}}, {1, {2}}},
            .data_seed = 17 + (uint64_t)k,
        };
        assert_int_equal(gjt_gradcheck(&chk), 0);
    }
}

/* ------------------------------------------------- W4-style memory */

enum { WL = 8 };

typedef struct w4 {
    int64_t n, c, h;     /* rows (batch), features, hidden */
    gj_tensor *x;        /* [n, c] */
    gj_tensor *p[WL][4]; /* w1 [h, c], b1 [h], w2 [c, h], b2 [c] */
} w4;

/* y = x + Linear(h, c)(gelu(Linear(c, h)(x))) with layer l's parameters. */
static int w4_layer(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    gj_tensor **p = user;
    gj_tensor *h = gj_linear(in[0], p[0], p[1]);
    gj_tensor *o = h ? gj_linear(gj_gelu(h), p[2], p[3]) : NULL;
    out[0] = o ? gj_add(in[0], o) : NULL;
    return out[0] ? 0 : -1;
}

/* A model of WL layers of shape (n, c, h), seeded; no .grads. */
static void w4_init(w4 *m, int64_t n, int64_t c, int64_t h, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    m->n = n;
    m->c = c;
    m->h = h;
    m->x = leaf(&r, GJ_F32, 2, (int64_t[]){n, c}, -1, 1, false);
    double a1 = 1.0 / sqrt((double)c), a2 = 1.0 / sqrt((double)h);
    for (int l = 0; l < WL; l++) {
        m->p[l][0] = leaf(&r, GJ_F32, 2, (int64_t[]){h, c}, -a1, a1, true);
        m->p[l][1] = leaf(&r, GJ_F32, 1, (int64_t[]){h}, -0.1, 0.1, true);
        m->p[l][2] = leaf(&r, GJ_F32, 2, (int64_t[]){c, h}, -a2, a2, true);
        m->p[l][3] = leaf(&r, GJ_F32, 1, (int64_t[]){c}, -0.1, 0.1, true);
    }
}

static void w4_free(w4 *m) {
    for (int l = 0; l < WL; l++)
        for (int k = 0; k < 4; k++)
            gj_release(m->p[l][k]);
    gj_release(m->x);
}

/* One step (forward, loss = mean(y*y), backward) into .grads that are
 * none; returns the peak tensor bytes above the bytes live before it. */
static int64_t w4_step(w4 *m, bool ckpt) {
    gj_mem m0, m1;
    gj_mem_stats(&m0);
    gj_mem_reset_peak();
    gj_scope_push();
    gj_tensor *y = m->x;
    for (int l = 0; l < WL; l++) {
        gj_tensor *o = NULL;
        if (ckpt)
            assert_int_equal(gj_checkpoint(w4_layer, m->p[l], 1, &y, 1, &o, NULL, NULL), 0);
        else
            assert_int_equal(w4_layer(m->p[l], 1, &y, 1, &o), 0);
        y = o;
    }
    gj_tensor *loss = gj_mean(gj_mul(y, y), 0, NULL, false);
    assert_non_null(loss);
    assert_int_equal(gj_backward(loss, NULL), 0);
    gj_mem_stats(&m1);
    gj_scope_pop();
    return m1.peak_bytes - m0.live_bytes;
}

static double **w4_grads(w4 *m) {
    double **g = calloc(WL * 4, sizeof *g);
    for (int l = 0; l < WL; l++)
        for (int k = 0; k < 4; k++)
            g[l * 4 + k] = take_grad(m->p[l][k]);
    return g;
}

static void w4_clear_grads(w4 *m) {
    for (int l = 0; l < WL; l++)
        for (int k = 0; k < 4; k++)
            assert_int_equal(gj_tensor_set_grad(m->p[l][k], NULL), 0);
}

static void w4_cmp(const char *what, w4 *m, double **a, double **b, double rel) {
    for (int l = 0; l < WL; l++)
        for (int k = 0; k < 4; k++) {
            char w[96];
            snprintf(w, sizeof w, "%s layer %d param %d", what, l, k);
            assert_true(same(w, a[l * 4 + k], b[l * 4 + k], gj_tensor_numel(m->p[l][k]), rel));
        }
}

static void w4_free_grads(double **g) {
    for (int i = 0; i < WL * 4; i++)
        free(g[i]);
    free(g);
}

/* The peaks of one model (w4_step) in both modes, with and without
 * checkpointing; compiled: the second step, which runs the cached program. */
typedef struct w4_peaks {
    int64_t plain, ckpt;           /* eager */
    int64_t comp_plain, comp_ckpt; /* compiled */
} w4_peaks;

static void w4_print(const char *name, const w4 *m, const w4_peaks *pk) {
    fprintf(stderr,
            "  %s (x[%lld,%lld], %d layers %lld-%lld-%lld): peak above live, eager %lld B, "
            "compiled %lld B; with checkpointing eager %lld B (%.2f), compiled %lld B\n",
            name, (long long)m->n, (long long)m->c, WL, (long long)m->c, (long long)m->h,
            (long long)m->c, (long long)pk->plain, (long long)pk->comp_plain,
            (long long)pk->ckpt, (double)pk->ckpt / (double)pk->plain, (long long)pk->comp_ckpt);
}

/* The compiled program never needs more memory than the eager engine:
 * compiled peak <= eager peak with and without checkpointing (counted
 * bytes, jit/schedule.c's rule), on a cached step. */
static void w4_check_peaks(const w4_peaks *pk) {
    assert_true(pk->comp_plain <= pk->plain);
    assert_true(pk->comp_ckpt <= pk->ckpt);
}

/* W4-style at a small size: gradients with checkpointing equal those
 * without (eager and compiled); eager with checkpointing peaks at most half
 * of eager without; compiled at most eager, with and without. */
static void test_w4_memory(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(false);
    w4 m;
    w4_init(&m, 512, 64, 256, 18);
    w4_peaks pk;
    pk.plain = w4_step(&m, false);
    double **g_plain = w4_grads(&m);
    pk.ckpt = w4_step(&m, true);
    double **g_ckpt = w4_grads(&m);
    w4_cmp("eager ckpt vs plain", &m, g_ckpt, g_plain, 1e-6);
    gj_set_compiled_autograd(true);
    gj_ca_stats a = gjt_ca_now();
    w4_step(&m, true);
    double **g_comp1 = w4_grads(&m);
    pk.comp_ckpt = w4_step(&m, true);
    gj_ca_stats b = gjt_ca_now();
    double **g_comp = w4_grads(&m);
    w4_step(&m, false);
    w4_clear_grads(&m);
    pk.comp_plain = w4_step(&m, false);
    double **g_comp_plain = w4_grads(&m);
    gj_set_compiled_autograd(was);
    w4_cmp("compiled ckpt (step 1) vs eager ckpt", &m, g_comp1, g_ckpt, 1e-5);
    w4_cmp("compiled ckpt (step 2) vs eager ckpt", &m, g_comp, g_ckpt, 1e-5);
    w4_cmp("compiled plain vs eager plain", &m, g_comp_plain, g_plain, 1e-5);
    w4_print("W4-style", &m, &pk);
    fprintf(stderr,
            "  compiled ckpt: %lld compiles, %lld hits (%lld from disk), %lld fallbacks%s%s\n",
            (long long)(b.compiles - a.compiles),
            (long long)(b.mem_hits - a.mem_hits + b.disk_hits - a.disk_hits),
            (long long)(b.disk_hits - a.disk_hits), (long long)(b.fallbacks - a.fallbacks),
            b.fallbacks > a.fallbacks ? ": " : "",
            b.fallbacks > a.fallbacks ? gj_compiled_autograd_last_fallback() : "");
    assert_true(2 * pk.ckpt <= pk.plain);
    w4_check_peaks(&pk);
    w4_free_grads(g_plain);
    w4_free_grads(g_ckpt);
    w4_free_grads(g_comp1);
    w4_free_grads(g_comp);
    w4_free_grads(g_comp_plain);
    w4_free(&m);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The benchmark's W4 and W4n (bench/workloads.c: x[128, 512], 8 layers
 * 512-2048-512, with and without checkpointing). Here the 4 MiB weight
 * gradients outweigh the [128, 2048] activations: the last layer's dW2
 * and dW1 GEMMs side by side held the recomputed gelu output while dW1's
 * .grad was made, 1 MiB above eager (jit/schedule.c now keeps such a pair
 * apart). Compiled peaks at most eager's, with and without checkpointing;
 * gradients are compared at the small size above. */
static void test_w4_bench_memory(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    w4 m;
    w4_init(&m, 128, 512, 2048, 20240611);
    w4_peaks pk;
    int64_t *slot[2][2] = {{&pk.plain, &pk.ckpt}, {&pk.comp_plain, &pk.comp_ckpt}};
    for (int mode = 0; mode < 2; mode++) {
        gj_set_compiled_autograd(mode == 1);
        for (int ck = 0; ck < 2; ck++)
            for (int rep = 0; rep < 2; rep++) { /* compiled: compile, then the cached program */
                *slot[mode][ck] = w4_step(&m, ck == 1);
                w4_clear_grads(&m);
            }
    }
    gj_set_compiled_autograd(was);
    w4_print("W4", &m, &pk);
    w4_check_peaks(&pk);
    w4_free(&m);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ----------------------------------------------- compiled: capture */

typedef struct held_set {
    int64_t count, bytes;
} held_set;

static int64_t meta_bytes(const gj_rt_meta *m) {
    return gj_rt_numel(m->ndim, m->shape) * (int64_t)gj_rt_dtype_size(m->dtype);
}

/* What the eager engine holds for the backward of the walk's graph: every
 * node's saved tensors plus the tensors checkpoint tapes hold themselves. */
static held_set eager_held(const gj_jit_walk *w) {
    held_set h = {0, 0};
    for (int i = 0; i < w->n; i++) {
        const gj_ag_node *n = w->nodes[i];
        if (n->kind != GJ_AG_OP)
            continue;
        for (int k = 0; k < n->n_saved; k++) {
            gj_rt_meta m;
            gj_rt_meta_of(n->saved[k].t, &m);
            h.count++;
            h.bytes += meta_bytes(&m);
        }
        gj_ag_ckpt_info info;
        if (gj_ag_ckpt_info_of(n, &info) != 0)
            continue;
        for (int k = info.n_node_saved; k < info.n_stored; k++) {
            gj_tensor *t = gj_ag_ckpt_stored(n, k, NULL);
            gj_rt_meta m;
            gj_rt_meta_of(t, &m);
            h.count++;
            h.bytes += meta_bytes(&m);
        }
    }
    return h;
}

/* Captures the backward of l: its matmul count and the saved tensors it reads. */
static int64_t capture_matmuls(gj_tensor *l, held_set *graph_held, held_set *eager) {
    gj_jit_walk w;
    gj_jit_capture cap;
    assert_int_equal(gj_jit_walk_build(&w, 1, &l, NULL), 0);
    assert_false(w.invalid);
    assert_int_equal(gj_jit_capture_run(&cap, &w, 1, &l, NULL), 0);
    int64_t n = 0;
    for (int i = 0; i < cap.g.n_nodes; i++)
        n += cap.g.nodes[i].inst.prim == GJ_P_MATMUL;
    *graph_held = (held_set){0, 0};
    for (int i = 0; i < cap.g.n_inputs; i++) {
        const gj_jit_input *in = &cap.g.inputs[i];
        if (in->role != GJ_JIT_IN_SAVED && in->role != GJ_JIT_IN_OTHER)
            continue;
        graph_held->count++;
        graph_held->bytes += meta_bytes(&cap.g.values[in->value].meta);
    }
    *eager = eager_held(&w);
    gj_jit_capture_free(&cap);
    gj_jit_walk_free(&w);
    return n;
}

/* mm -> gelu -> mm: the captured graph recomputes exactly what eager
 * recomputes (matmul counts equal), reads what eager saved, never holds
 * more than eager; the compiled backward's gradients equal eager's; the
 * key tells the two policies apart. */
static void test_compiled_capture(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    bool was = gj_compiled_autograd_enabled();
    mlp_case c;
    case_init(&c, GJ_F32, 19);
    const pmode modes[] = {P_MM_RECOMPUTE, P_MM_SAVE, P_NONE, P_GELU_SAVE};
    int64_t counts[4];
    char *keys[2] = {0};
    for (int k = 0; k < 4; k++) {
        gj_set_compiled_autograd(false);
        int64_t eager_n = backward_matmuls(&c, modes[k]);
        gj_scope_push();
        gj_tensor *l = case_loss(&c, modes[k]);
        held_set gh, eh;
        counts[k] = capture_matmuls(l, &gh, &eh);
        fprintf(stderr, "  policy %d: eager backward matmuls %lld, captured %lld; held by the "
                        "graph %lld tensors %lld B, by eager %lld tensors %lld B\n",
                (int)modes[k], (long long)eager_n, (long long)counts[k], (long long)gh.count,
                (long long)gh.bytes, (long long)eh.count, (long long)eh.bytes);
        assert_int_equal(counts[k], eager_n);
        assert_true(gh.count <= eh.count);
        assert_true(gh.bytes <= eh.bytes);
        if (k < 2) {
            gj_jit_walk w;
            assert_int_equal(gj_jit_walk_build(&w, 1, &l, NULL), 0);
            keys[k] = strdup(w.key);
            gj_jit_walk_free(&w);
        }
        /* compiled backward (or its fallback): the eager gradients */
        double *ge[3], *gc[3];
        assert_int_equal(gj_backward_ex(l, NULL, true), 0);
        ge[0] = take_grad(c.x);
        ge[1] = take_grad(c.w1);
        ge[2] = take_grad(c.w2);
        gj_set_compiled_autograd(true);
        gj_ca_stats a = gjt_ca_now();
        assert_int_equal(gj_backward(l, NULL), 0);
        gj_ca_stats b = gjt_ca_now();
        gc[0] = take_grad(c.x);
        gc[1] = take_grad(c.w1);
        gc[2] = take_grad(c.w2);
        if (b.fallbacks > a.fallbacks)
            fprintf(stderr, "  policy %d: compiled backward fell back: %s\n", (int)modes[k],
                    gj_compiled_autograd_last_fallback());
        const int64_t n[3] = {N * C, C * H, H * C};
        for (int i = 0; i < 3; i++) {
            assert_true(same("compiled vs eager", gc[i], ge[i], n[i], 1e-6));
            free(ge[i]);
            free(gc[i]);
        }
        gj_scope_pop();
    }
    assert_int_equal(counts[0], counts[1] + 1); /* MUST_SAVE: one matmul fewer */
    assert_string_not_equal(keys[0], keys[1]);
    free(keys[0]);
    free(keys[1]);
    gj_set_compiled_autograd(was);
    case_free(&c);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_eager_semantics),
        cmocka_unit_test(test_policy_calls),
        cmocka_unit_test(test_eager_matmul_counts),
        cmocka_unit_test(test_two_regions_skip_first),
        cmocka_unit_test(test_dropout_mask),
        cmocka_unit_test(test_dropout_compiled),
        cmocka_unit_test(test_many_stored),
        cmocka_unit_test(test_nested_and_errors),
        cmocka_unit_test(test_out_ownership),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_fd_mlp),
        cmocka_unit_test(test_w4_memory),
        cmocka_unit_test(test_w4_bench_memory),
        cmocka_unit_test(test_compiled_capture),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
