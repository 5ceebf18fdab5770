/* SPDX-License-Identifier: MIT */
/*
 * test_guards.c - guards of the hardening issue: what user code may change
 * during a compiled backward, error messages of chained calls and of a
 * backward, and shape checks of creation functions.
 *
 *   1. A set_ that gives a parameter another dtype in the middle of the
 *      backward (DeepSpeed's `param.data = param.to(bf16)`), made by a
 *      tensor hook, a post-accumulate hook or a custom op's backward: the
 *      compiled backward falls back (GJ_CA_SET_MISMATCH) and every .grad
 *      equals the eager run's (same dtype, same bits), on the first
 *      compiled step and on a later step that runs the cached program;
 *      also by a custom op's forward that a checkpoint region recomputes
 *      during the backward (the program's forward call instruction).
 *   2. A failed op followed by a chain of ops keeps the innermost cause.
 *   3. A successful compiled backward leaves gj_last_error() as eager does.
 *   4. A leaf given another shape by set_ between forward and backward (or
 *      by a hook during it) makes the backward an error naming both
 *      shapes, in both modes.
 *   5. Creation functions check the byte size of a shape with a zero dim;
 *      a compiled embedding backward with embedding dimension 0 (run it
 *      under -DGJ_SANITIZE=ON: UBSan flags memset(NULL, 0, 0)).
 *   6. Several guards trip in one backward (DeepSpeed's ZeRO-3 hook: copy
 *      the .grad to a bucket, record_stream it, set_ a parameter to bf16):
 *      the fallback's reason is the first cause, record_stream, and the
 *      message lists set_mismatch after "also:"; a tensor hook doing the
 *      same still abandons the run; .grads as eager, which reports nothing.
 *      gj_jit_trip alone: repeats dropped, a full message ends in "...".
 *
 * MLP of 1: x[8, 64] -> linear(w1[96, 64], b1[96]) = h -> tanh -> linear(
 * w2[10, 96], b2[10]) -> cross entropy with labels y[8]; all f32.
 */
#include "gjtest.h"

#include "jit/run/run.h"
#include "jit/jit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NB 8
#define NI 64
#define NH 96
#define NO 10

/* ------------------------------------------- 1. set_ to bf16 mid-backward */

typedef enum who {
    BY_NONE = 0,
    BY_TENSOR_HOOK,
    BY_POST_HOOK,
    BY_CUSTOM_OP,
    BY_CKPT_FWD,       /* the custom op's forward, recomputed in a checkpoint region */
    BY_TENSOR_HOOK_RS, /* 6.: a tensor hook records a stream, then swaps */
    BY_ZERO3_HOOK,     /* 6.: a post hook copies to a bucket, records it, then swaps */
} who;

typedef struct mlp {
    gj_tensor *p[4]; /* w1, b1, w2, b2 (owned) */
    who by;
    int from;        /* first step whose backward swaps w1 to bf16 */
    int step, calls; /* calls: of the swapping user code */
    bool in_backward;  /* BY_CKPT_FWD: the forward runs as the region's recomputation */
    gj_tensor *bucket; /* BY_ZERO3_HOOK: flat f32 bucket [NO * NH] (owned) */
    gj_stream *s;      /* BY_*_RS, BY_ZERO3_HOOK: the reduce stream (owned) */
    int64_t hook;      /* the handle of the hook that swaps */
} mlp;

static mlp *g_mlp; /* for the custom op's backward */
static int g_scale_bwd_calls; /* calls of the custom op's backward in this run */

/* w1 := a bf16 copy of itself (set_), from step `from` on. */
static void swap_w1(mlp *m) {
    m->calls++;
    if (m->step < m->from) return;
    gj_no_grad_push();
    gj_tensor *c = gj_cast(m->p[0], GJ_BF16);
    gj_no_grad_pop();
    assert_non_null(c);
    assert_int_equal(gj_tensor_set_(m->p[0], c), 0);
    gj_release(c);
}

static gj_tensor *hook_swap(gj_tensor *grad, void *user) {
    (void)grad;
    swap_w1(user);
    return NULL;
}

static void post_swap(gj_tensor *leaf, void *user) {
    (void)leaf;
    swap_w1(user);
}

/* From step `from`: record_stream on the gradient it got, then swap w1. */
static gj_tensor *hook_rs_swap(gj_tensor *grad, void *user) {
    mlp *m = user;
    if (m->step >= m->from) assert_int_equal(gj_tensor_record_stream(grad, m->s), 0);
    swap_w1(m);
    return NULL;
}

/* DeepSpeed's ZeRO-3 pattern, on w2 (its .grad is final): from step
 * `from`, copy the .grad into the flat bucket, record the bucket on the
 * reduce stream, then w1 := a bf16 copy of itself. */
static void post_zero3(gj_tensor *leaf, void *user) {
    mlp *m = user;
    if (m->step >= m->from) {
        gj_tensor *flat = gj_view(gj_tensor_grad(leaf), 1, (int64_t[]){NO * NH});
        assert_non_null(flat);
        assert_int_equal(gj_copy_(m->bucket, flat), 0);
        gj_release(flat);
        assert_int_equal(gj_tensor_record_stream(m->bucket, m->s), 0);
    }
    swap_w1(m);
}

/* guards::scale(x, alpha) = alpha * x; its backward swaps w1, and so does
 * its forward when a checkpoint region recomputes it (BY_CKPT_FWD). */
static int scale_fwd(gj_tensor *x, double alpha, gj_tensor **out) {
    if (g_mlp && g_mlp->by == BY_CKPT_FWD && g_mlp->in_backward) swap_w1(g_mlp);
    *out = gj_mul_scalar(x, alpha);
    return *out ? 0 : 1;
}

static int scale_bwd(gj_tensor *g, gj_tensor *x, double alpha, gj_tensor **gx) {
    (void)x;
    g_scale_bwd_calls++;
    if (g_mlp->by == BY_CUSTOM_OP) swap_w1(g_mlp);
    *gx = gj_mul_scalar(g, alpha);
    return *gx ? 0 : 1;
}

static gj_custom_op *scale_op(void) {
    static gj_custom_op *op;
    if (!op)
        op = gj_custom_op_define("guards::scale(Tensor x, float alpha) -> Tensor",
                                 (void *)scale_fwd, (void *)scale_bwd);
    assert_non_null(op);
    return op;
}

/* The checkpoint region of BY_CKPT_FWD: tanh(scale(h, 0.75)), nothing
 * saved, so tanh's backward has the region recompute scale's forward. */
static int scale_tanh_region(void *user, int n_in, gj_tensor *const *in, int n_out,
                             gj_tensor **out) {
    (void)user, (void)n_in, (void)n_out;
    gj_tensor *s = NULL;
    double alpha = 0.75;
    if (gj_custom_op_call(scale_op(), (gj_tensor **)&in[0], &alpha, &s) != 0) return -1;
    out[0] = gj_tanh(s);
    return out[0] ? 0 : -1;
}

static void mlp_init(mlp *m) {
    gjt_rng r;
    gjt_rng_seed(&r, 4242);
    static const int64_t shp[4][2] = {{NH, NI}, {NH, 0}, {NO, NH}, {NO, 0}};
    for (int i = 0; i < 4; i++) {
        m->p[i] = gjt_uniform(&r, GJ_F32, shp[i][1] ? 2 : 1, shp[i], -0.2, 0.2);
        assert_int_equal(gj_set_requires_grad(m->p[i], true), 0);
    }
    if (m->by == BY_POST_HOOK) /* w2's .grad is written before w1's (eager order) */
        assert_true(gj_register_post_accumulate_grad_hook(m->p[2], post_swap, m) > 0);
    if (m->by == BY_TENSOR_HOOK_RS || m->by == BY_ZERO3_HOOK) {
        m->s = gj_stream_new();
        assert_non_null(m->s);
    }
    if (m->by == BY_ZERO3_HOOK) {
        m->bucket = gj_zeros(GJ_F32, 1, (int64_t[]){NO * NH});
        assert_non_null(m->bucket);
        m->hook = gj_register_post_accumulate_grad_hook(m->p[2], post_zero3, m);
        assert_true(m->hook > 0);
    }
}

/* One training step's backward; .grads cleared first. */
static void mlp_step(mlp *m, bool compiled) {
    gjt_rng r;
    gjt_rng_seed(&r, 900 + (uint64_t)m->step);
    for (int i = 0; i < 4; i++) assert_int_equal(gj_tensor_set_grad(m->p[i], NULL), 0);
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){NB, NI}, -1, 1);
    gj_tensor *y = gjt_labels(&r, 1, (int64_t[]){NB}, NO);
    gj_tensor *h = gj_linear(x, m->p[0], m->p[1]);
    assert_non_null(h);
    if (m->by == BY_TENSOR_HOOK) assert_true(gj_register_hook(h, hook_swap, m) > 0);
    if (m->by == BY_TENSOR_HOOK_RS) {
        m->hook = gj_register_hook(h, hook_rs_swap, m);
        assert_true(m->hook > 0);
    }
    if (m->by == BY_CUSTOM_OP) {
        gj_tensor *out = NULL;
        double alpha = 0.75;
        assert_int_equal(gj_custom_op_call(scale_op(), &h, &alpha, &out), 0);
        h = out;
    }
    if (m->by == BY_CKPT_FWD) {
        gj_tensor *out = NULL;
        assert_int_equal(gj_checkpoint(scale_tanh_region, NULL, 1, &h, 1, &out, NULL, NULL), 0);
        h = out;
    }
    gj_tensor *a = m->by == BY_CKPT_FWD ? h : gj_tanh(h);
    gj_tensor *loss = gj_cross_entropy(gj_linear(a, m->p[2], m->p[3]), y);
    assert_non_null(loss);
    m->in_backward = true;
    if (gj_backward(loss, NULL) != 0) fail_msg("backward failed: %s", gj_last_error());
    m->in_backward = false;
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    m->step++;
}

typedef struct grads {
    gj_dtype dt[4];
    double *v[4];
    double *bucket; /* BY_ZERO3_HOOK: the bucket's values, else NULL */
    int64_t hook;   /* the swapping hook's handle (0: none) */
} grads;

/* Runs steps 0..from (the last one swaps w1) on a fresh model; the .grads
 * after the last step. */
static grads mlp_run(who by, int from, bool compiled, int *calls) {
    mlp m = {{0}, by, from, 0, 0, false, NULL, NULL, 0};
    g_mlp = &m;
    g_scale_bwd_calls = 0;
    mlp_init(&m);
    for (int s = 0; s <= from; s++) mlp_step(&m, compiled);
    grads g = {{0}, {0}, NULL, m.hook};
    if (m.s) assert_int_equal(gj_stream_synchronize(m.s), 0);
    if (m.bucket) {
        g.bucket = gjt_values(m.bucket);
        assert_non_null(g.bucket);
        gj_release(m.bucket);
    }
    if (m.s) gj_stream_free(m.s);
    for (int i = 0; i < 4; i++) {
        gj_tensor *gr = gj_tensor_grad(m.p[i]);
        assert_non_null(gr);
        g.dt[i] = gj_tensor_dtype(gr);
        g.v[i] = gjt_values(gr);
        assert_non_null(g.v[i]);
        gj_release(m.p[i]);
    }
    *calls = m.calls;
    g_mlp = NULL;
    return g;
}

static void check_swap(who by, int from) {
    int64_t live0 = gjt_live_bytes();
    static const int64_t n[4] = {NH * NI, NH, NO * NH, NO};
    int ecalls, ccalls;
    grads want = mlp_run(by, from, false, &ecalls);
    int ebwd = g_scale_bwd_calls;
    assert_int_equal(want.dt[0], GJ_BF16); /* eager: w1 was bf16 when its .grad was made */
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    gj_compiled_autograd_set_quiet(true);
    grads got = mlp_run(by, from, true, &ccalls);
    int cbwd = g_scale_bwd_calls;
    gj_ca_stats s = gjt_ca_now();
    for (int i = 0; i < 4; i++) {
        if (got.dt[i] != want.dt[i])
            print_error("param %d: compiled .grad dtype %d, eager %d\n", i,
                        (int)got.dt[i], (int)want.dt[i]);
        assert_int_equal(got.dt[i], want.dt[i]);
        int64_t bad = 0;
        for (int64_t k = 0; k < n[i]; k++) bad += got.v[i][k] != want.v[i][k];
        if (bad) print_error("param %d: %lld gradient values differ\n", i, (long long)bad);
        assert_memory_equal(got.v[i], want.v[i], (size_t)n[i] * sizeof(double));
        free(got.v[i]);
        free(want.v[i]);
    }
    /* every backward counts once: step 0 made the program (compiled, or
     * loaded from the disk cache), the steps before `from` ran it from
     * memory, step `from` tripped and counts as the fallback */
    assert_int_equal(s.compiles + s.disk_hits, from > 0 ? 1 : 0);
    assert_int_equal(s.mem_hits, from > 0 ? from - 1 : 0);
    assert_int_equal(s.fallbacks, 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_SET_MISMATCH], 1);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "set_mismatch"));
    /* a tensor hook's or custom op's trip abandons the run: the eager
     * rerun calls it again; a post hook's trip keeps the run */
    assert_int_equal(ccalls, ecalls + (by == BY_POST_HOOK ? 0 : 1));
    /* the guards right after the recomputing forward call stopped the
     * program before it called the op's backward: only the eager rerun did */
    if (by == BY_CKPT_FWD) assert_int_equal(cbwd, ebwd);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* A tensor hook on the hidden activation swaps w1 on the first compiled
 * step (capture, compile, run). */
static void test_hook_set_bf16_first_step(void **st) {
    (void)st;
    check_swap(BY_TENSOR_HOOK, 0);
}

/* The same hook acting only from step 1: step 0 compiles, step 1 runs the
 * cached program and must still fall back. */
static void test_hook_set_bf16_cached(void **st) {
    (void)st;
    check_swap(BY_TENSOR_HOOK, 1);
}

/* A post-accumulate hook on w2 swaps w1 before w1's .grad is written. */
static void test_post_hook_set_bf16(void **st) {
    (void)st;
    check_swap(BY_POST_HOOK, 0);
    check_swap(BY_POST_HOOK, 1);
}

/* A custom op's backward swaps w1. */
static void test_custom_op_set_bf16(void **st) {
    (void)st;
    check_swap(BY_CUSTOM_OP, 0);
    check_swap(BY_CUSTOM_OP, 1);
}

/* A custom op's forward swaps w1 while a checkpoint region recomputes it
 * in the backward (a forward call instruction of the program): the guards
 * after that call trip as after any other, and the run is abandoned. */
static void test_recomputed_custom_fwd_set_bf16(void **st) {
    (void)st;
    check_swap(BY_CKPT_FWD, 0);
    check_swap(BY_CKPT_FWD, 1);
}

/* ------------------------------------------------- 2. error chains */

/* The README's loop with a wrong input width: the innermost cause survives
 * gelu, a second linear and cross entropy, and three more ops after it. */
static void test_error_chain_keeps_cause(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    gj_linear_layer l1, l2;
    assert_int_equal(gj_linear_init(&l1, 784, 256, true, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&l2, 256, 10, true, GJ_F32), 0);
    gj_scope_push();
    gj_clear_error();
    gj_tensor *x = gj_zeros(GJ_F32, 2, (int64_t[]){32, 100});
    gj_tensor *y = gj_zeros(GJ_I64, 1, (int64_t[]){32});
    gj_tensor *h1 = gj_linear_forward(&l1, x);
    assert_null(h1);
    char first[1024];
    snprintf(first, sizeof first, "%s", gj_last_error());
    assert_non_null(strstr(first, "gj_linear"));
    assert_non_null(strstr(first, "[32, 100]"));
    assert_non_null(strstr(first, "[256, 784]"));
    gj_tensor *h = gj_gelu(h1);
    gj_tensor *loss = gj_cross_entropy(gj_linear_forward(&l2, h), y);
    assert_null(loss);
    char want[1100];
    snprintf(want, sizeof want, "gj_cross_entropy: logits is NULL (caused by: %s)", first);
    assert_string_equal(gj_last_error(), want);
    /* three more ops on the failed result: still the same cause */
    gj_tensor *z = gj_mean(gj_exp(gj_tanh(loss)), 0, NULL, false);
    assert_null(z);
    snprintf(want, sizeof want, "gj_mean: x is NULL (caused by: %s)", first);
    assert_string_equal(gj_last_error(), want);
    /* a NULL passed with no error before it names only itself */
    gj_clear_error();
    assert_null(gj_tanh(NULL));
    assert_string_equal(gj_last_error(), "gj_tanh: x is NULL");
    gj_scope_pop();
    gj_linear_free(&l1);
    gj_linear_free(&l2);
    gj_clear_error();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------ 3. gj_last_error after a backward */

/* A successful backward after a failed call: the message gj_last_error()
 * holds afterwards in compiled mode (the program really ran: one compile,
 * then one cache hit) equals eager's. */
static void test_compiled_backward_clears_error(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    char after[2][1024];
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    for (int mode = 0; mode < 2; mode++) {
        mlp m = {{0}, BY_NONE, 0, 0, 0, false, NULL, NULL, 0};
        mlp_init(&m);
        for (int s = 0; s < 2; s++) {
            assert_null(gj_matmul(m.p[0], m.p[0])); /* [96, 64] @ [96, 64]: an error */
            assert_true(gjt_error_has("gj_matmul"));
            mlp_step(&m, mode == 1);
            snprintf(after[mode], sizeof after[mode], "%s", gj_last_error());
            if (mode == 1) assert_string_equal(after[1], after[0]);
        }
        for (int i = 0; i < 4; i++) gj_release(m.p[i]);
    }
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 1);
    assert_int_equal(s.fallbacks, 0);
    assert_string_equal(after[0], "");
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------- 4. a leaf set_ to another shape */

static gj_tensor *g_reshape_w;

static gj_tensor *hook_reshape_w(gj_tensor *grad, void *user) {
    (void)grad;
    (void)user;
    gj_tensor *z = gj_zeros(GJ_F32, 2, (int64_t[]){3, 8});
    assert_int_equal(gj_tensor_set_(g_reshape_w, z), 0);
    gj_release(z);
    return NULL;
}

/* w [4, 6] goes to [3, 8] (same numel) between forward and backward
 * (in_hook false) or in a hook on h during the backward: the backward
 * fails naming both shapes, and w gets no .grad. */
static void reshape_case(bool compiled, bool in_hook, char *msg, size_t cap) {
    gjt_rng r;
    gjt_rng_seed(&r, 31);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    gj_tensor *b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(w, true), 0);
    assert_int_equal(gj_set_requires_grad(b, true), 0);
    g_reshape_w = w;
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){3, 6}, -1, 1);
    gj_tensor *h = gj_linear(x, w, b);
    gj_tensor *loss = gj_mean(gj_tanh(h), 0, NULL, false);
    assert_non_null(loss);
    if (in_hook) {
        assert_true(gj_register_hook(h, hook_reshape_w, NULL) > 0);
    } else {
        gj_tensor *z = gj_zeros(GJ_F32, 2, (int64_t[]){3, 8});
        assert_int_equal(gj_tensor_set_(w, z), 0);
        gj_release(z);
    }
    assert_int_not_equal(gj_backward(loss, NULL), 0);
    snprintf(msg, cap, "%s", gj_last_error());
    if (!strstr(msg, "[4, 6]") || !strstr(msg, "[3, 8]") || !strstr(msg, "set_"))
        fail_msg("expected an error naming [4, 6], [3, 8] and set_, got '%s'", msg);
    assert_null(gj_tensor_grad(w));
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    gj_release(w);
    gj_release(b);
    g_reshape_w = NULL;
}

static void test_set_leaf_shape_is_error(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    char e[1024], c[1024];
    gj_compiled_autograd_set_quiet(true);
    for (int in_hook = 0; in_hook < 2; in_hook++) {
        gj_jit_clear_cache();
        gj_compiled_autograd_reset_stats();
        reshape_case(false, in_hook != 0, e, sizeof e);
        reshape_case(true, in_hook != 0, c, sizeof c);
        if (!in_hook) {
            assert_string_equal(c, e); /* the eager engine's message, not a fallback */
            assert_int_equal(gjt_ca_now().fallbacks, 0);
        } else {
            assert_int_equal(gjt_ca_now().fallbacks_by_reason[GJ_CA_SET_MISMATCH], 1);
        }
    }
    gj_jit_clear_cache();
    gj_clear_error();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------- 5. shapes and empty tensors */

static void test_zero_size_shape_overflow(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    static const int64_t bad[][3] = {
        {0, INT64_MAX, INT64_MAX},
        {INT64_MAX, INT64_MAX, 0},
        {0, (int64_t)1 << 61, 4}, /* 2^63 elements of 4 bytes */
        {(int64_t)1 << 62, 0, 2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const int64_t *sh = bad[i];
        gj_tensor *t[7] = {
            gj_zeros(GJ_F32, 3, sh),          gj_ones(GJ_F32, 3, sh),
            gj_full(GJ_F32, 3, sh, 2.0),      gj_randn(GJ_F32, 3, sh, 1.0),
            gj_rand(GJ_F32, 3, sh, 0.0, 1.0), gj_from_data(GJ_F32, 3, sh, NULL),
            gj_zeros(GJ_BF16, 3, sh),
        };
        static const char *names[7] = {"gj_zeros", "gj_ones",      "gj_full", "gj_randn",
                                       "gj_rand",  "gj_from_data", "gj_zeros"};
        for (int k = 0; k < 7; k++) {
            if (t[k]) {
                print_error("%s accepted shape [%lld, %lld, %lld]\n", names[k],
                            (long long)sh[0], (long long)sh[1], (long long)sh[2]);
                gj_release(t[k]);
                fail();
            }
        }
        /* the last message is the last call's */
        GJT_ASSERT_ERROR("gj_zeros");
        assert_true(gjt_error_has("too large"));
    }
    /* an empty shape whose bytes fit is still fine */
    gj_tensor *e = gj_zeros(GJ_F32, 3, (int64_t[]){0, (int64_t)1 << 40, 1 << 20});
    assert_non_null(e);
    assert_int_equal(gj_tensor_numel(e), 0);
    gj_release(e);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* An embedding of dimension 0 (f32 and bf16 tables), two steps that keep
 * the .grad: the compiled backward's scatter then writes a temporary of 0
 * bytes (no memory: NULL) added into the existing .grad, and gives the [V,
 * 0] .grad eager gives (under the sanitizer build: without memset(NULL, 0,
 * 0), and without asking the allocator for a 0-byte bf16 scratch). */
static void test_embedding_dim0_compiled(void **st) {
    (void)st;
    int64_t live0 = gjt_live_bytes();
    static const gj_dtype dts[2] = {GJ_F32, GJ_BF16};
    for (int d = 0; d < 2; d++) {
        for (int mode = 0; mode < 2; mode++) {
            gj_jit_clear_cache();
            gj_compiled_autograd_reset_stats();
            gj_tensor *table = gj_zeros(dts[d], 2, (int64_t[]){5, 0});
            assert_non_null(table);
            assert_int_equal(gj_set_requires_grad(table, true), 0);
            for (int step = 0; step < 2; step++) {
                gj_set_compiled_autograd(mode == 1);
                gj_scope_push();
                gj_tensor *idx = gjt_i64(1, (int64_t[]){3}, (int64_t[]){4, 0, 4});
                gj_tensor *e = gj_embedding(table, idx);
                if (!e) fail_msg("gj_embedding: %s", gj_last_error());
                gj_tensor *loss = gj_sum(gj_cast(e, GJ_F32), 0, NULL, false);
                assert_non_null(loss);
                if (gj_backward(loss, NULL) != 0) fail_msg("backward: %s", gj_last_error());
                gj_scope_pop();
                gj_set_compiled_autograd(false);
                gj_tensor *g = gj_tensor_grad(table);
                assert_non_null(g);
                assert_true(gjt_shape_is(g, 2, (int64_t[]){5, 0}));
                assert_int_equal(gj_tensor_dtype(g), dts[d]);
            }
            if (mode == 1) {
                gj_ca_stats s = gjt_ca_now(); /* really compiled: a new .grad, then into it */
                assert_int_equal(s.compiles, 2);
                assert_int_equal(s.fallbacks, 0);
            }
            gj_release(table);
        }
    }
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------ 6. the first cause names the fallback */

/* Several guards trip in one backward: the fallback's reason (the class
 * counted in fallbacks_by_reason, the message's first cause) is the first
 * cause in program order, and the message lists the later ones after
 * "also:". by: BY_ZERO3_HOOK (a post hook: the run is kept, every hook
 * runs once) or BY_TENSOR_HOOK_RS (a tensor hook: its set_ abandons the
 * run, which still happens, and the eager rerun calls it once more). The
 * .grads (and the bucket) equal an eager-only run's, and eager reports
 * nothing for the same hook. */
static void check_first_cause(who by, int from) {
    int64_t live0 = gjt_live_bytes();
    static const int64_t n[4] = {NH * NI, NH, NO * NH, NO};
    int ecalls, ccalls;
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    grads want = mlp_run(by, from, false, &ecalls);
    gj_ca_stats e = gjt_ca_now();
    assert_int_equal(e.fallbacks, 0); /* eager: no guard, nothing reported */
    assert_string_equal(gj_compiled_autograd_last_fallback(), "");
    assert_int_equal(want.dt[0], GJ_BF16);
    gj_compiled_autograd_reset_stats();
    gj_compiled_autograd_set_quiet(true);
    grads got = mlp_run(by, from, true, &ccalls);
    gj_ca_stats s = gjt_ca_now();
    for (int i = 0; i < 4; i++) {
        assert_int_equal(got.dt[i], want.dt[i]);
        assert_memory_equal(got.v[i], want.v[i], (size_t)n[i] * sizeof(double));
        free(got.v[i]);
        free(want.v[i]);
    }
    if (by == BY_ZERO3_HOOK) {
        assert_memory_equal(got.bucket, want.bucket, (size_t)(NO * NH) * sizeof(double));
        free(got.bucket);
        free(want.bucket);
    }
    assert_int_equal(s.compiles + s.disk_hits, from > 0 ? 1 : 0);
    assert_int_equal(s.mem_hits, from > 0 ? from - 1 : 0);
    assert_int_equal(s.fallbacks, 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RECORD_STREAM], 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_SET_MISMATCH], 0);
    const char *msg = gj_compiled_autograd_last_fallback();
    const char *hk = by == BY_ZERO3_HOOK ? "post-accumulate hook" : "hook";
    char head[300];
    snprintf(head, sizeof head,
             "record_stream: %s #%lld called gj_tensor_record_stream during a compiled run; "
             "also: set_mismatch: %s #%lld changed leaf f32[96, 64] (whose .grad is output #",
             hk, (long long)got.hook, hk, (long long)got.hook);
    if (strncmp(msg, head, strlen(head)) != 0 ||
        !strstr(msg, ") to bf16[96, 64] (set_) during a compiled run"))
        fail_msg("the fallback names\n  %s\nwanted\n  %s...) to bf16[96, 64] (set_) during a "
                 "compiled run", msg, head);
    /* a post hook's trip keeps the run; a tensor hook's abandons it */
    assert_int_equal(ccalls, ecalls + (by == BY_ZERO3_HOOK ? 0 : 1));
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* gj_jit_trip on its own: the first trip sets the class and message; the
 * same cause again adds nothing; each other cause is appended once after
 * "also:"; a message with no room left ends in "..." and stays bounded. */
static void test_trip_lists_later_causes(void **st) {
    (void)st;
    gj_jit_runctx hc;
    memset(&hc, 0, sizeof hc);
    gj_jit_trip(&hc, GJ_CA_RECORD_STREAM, "hook #%d called record_stream", 1);
    gj_jit_trip(&hc, GJ_CA_RECORD_STREAM, "hook #%d called record_stream", 1);
    gj_jit_trip(&hc, GJ_CA_SET_MISMATCH, "hook #%d changed leaf", 2);
    gj_jit_trip(&hc, GJ_CA_SET_MISMATCH, "hook #%d changed leaf", 2);
    gj_jit_trip(&hc, GJ_CA_HOOK_GUARD, "hook #%d called record_stream", 1); /* other class */
    assert_true(hc.tripped);
    assert_int_equal(hc.code, GJ_CA_RECORD_STREAM);
    assert_string_equal(hc.why, "hook #1 called record_stream; also: set_mismatch: hook #2 "
                                "changed leaf; also: hook_guard: hook #1 called record_stream");
    assert_false(hc.why_full);
    for (int i = 0; i < 40; i++)
        gj_jit_trip(&hc, GJ_CA_SET_MISMATCH, "post-accumulate hook #%d changed a .grad", 100 + i);
    assert_int_equal(hc.code, GJ_CA_RECORD_STREAM);
    assert_true(hc.why_full);
    size_t n = strlen(hc.why);
    assert_int_equal(n, sizeof hc.why - 1);
    assert_string_equal(hc.why + n - 3, "...");
    assert_int_equal(strncmp(hc.why, "hook #1 called record_stream; also: ", 36), 0);
}

/* The ZeRO-3 hook of the hardening issue: record_stream came first. */
static void test_zero3_hook_first_cause(void **st) {
    (void)st;
    check_first_cause(BY_ZERO3_HOOK, 0);
    check_first_cause(BY_ZERO3_HOOK, 1);
}

/* A tensor hook that records a stream, then swaps w1: the set_ abandons
 * the run, record_stream is still the reason. */
static void test_abandoning_trip_keeps_first_cause(void **st) {
    (void)st;
    check_first_cause(BY_TENSOR_HOOK_RS, 0);
    check_first_cause(BY_TENSOR_HOOK_RS, 1);
}

int main(void) {
    setenv("GRADJIT_CACHE_DIR", "off", 1); /* counts of compiles, not of disk hits */
    gjt_setup();
    gj_compiled_autograd_set_quiet(true);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hook_set_bf16_first_step),
        cmocka_unit_test(test_hook_set_bf16_cached),
        cmocka_unit_test(test_post_hook_set_bf16),
        cmocka_unit_test(test_custom_op_set_bf16),
        cmocka_unit_test(test_recomputed_custom_fwd_set_bf16),
        cmocka_unit_test(test_error_chain_keeps_cause),
        cmocka_unit_test(test_compiled_backward_clears_error),
        cmocka_unit_test(test_set_leaf_shape_is_error),
        cmocka_unit_test(test_embedding_dim0_compiled),
        cmocka_unit_test(test_zero_size_shape_overflow),
        cmocka_unit_test(test_trip_lists_later_causes),
        cmocka_unit_test(test_zero3_hook_first_cause),
        cmocka_unit_test(test_abandoning_trip_keeps_first_cause),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
