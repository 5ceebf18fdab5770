/* SPDX-License-Identifier: MIT */
/*
 * test_jit_grad.c - gj_grad (torch.autograd.grad) with compiled autograd
 * on: it runs through the compiled path (key, cache, program) and must
 * return exactly the bits the eager gj_grad returns, touch no .grad, and
 * be counted like gj_backward (backwards, compiles, memory and disk hits,
 * fallbacks with their reason).
 *
 * Cases: the weights of an MLP (f32 and f64); several outputs with
 * explicit seeds and a NULL one; non-leaf inputs; an input given twice
 * (two distinct references); allow_unused with an unreachable input, and
 * eager's error without it; repeated calls hit the cache; gj_grad and
 * gj_backward of one model have different keys and both stay right;
 * retain_graph; an input that does not require grad (eager's error);
 * tensor hooks on a leaf input and on an intermediate; the
 * fallbacks (a forced LLVM failure, a hook calling record_stream, a failing
 * hook, anomaly mode) end with the eager result and count their reason.
 * Also gj_backward_multi (several roots in one backward), compiled against
 * eager and against gj_grad's gradients of the same outputs.
 */
#include "gjtest.h"

#include "jit/capture/capture.h"
#include "jit/codegen/codegen.h"
#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAXI 8

/* ------------------------------------------------------------ the model */

/* x[B,16] -> Linear(16,32) -> tanh -> Linear(32,10); p[0..3] = w1, b1,
 * w2, b2 (leaves that require grad); u: a leaf that requires grad and is
 * used by no forward. */
typedef struct mlp {
    gj_dtype dt;
    gj_tensor *p[4];
    gj_tensor *x, *labels, *u;
} mlp;

static void mlp_init(mlp *m, gj_dtype dt, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->dt = dt;
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    int64_t s1[2] = {32, 16}, s2[1] = {32}, s3[2] = {10, 32}, s4[1] = {10};
    m->p[0] = gjt_uniform(&r, dt, 2, s1, -0.25, 0.25);
    m->p[1] = gjt_uniform(&r, dt, 1, s2, -0.25, 0.25);
    m->p[2] = gjt_uniform(&r, dt, 2, s3, -0.2, 0.2);
    m->p[3] = gjt_uniform(&r, dt, 1, s4, -0.2, 0.2);
    m->u = gjt_uniform(&r, dt, 1, s4, -1, 1);
    m->x = gjt_uniform(&r, dt, 2, (int64_t[]){6, 16}, -2, 2);
    m->labels = gjt_labels(&r, 1, (int64_t[]){6}, 10);
    for (int i = 0; i < 4; i++) {
        assert_non_null(m->p[i]);
        assert_int_equal(gj_set_requires_grad(m->p[i], true), 0);
    }
    assert_non_null(m->u);
    assert_int_equal(gj_set_requires_grad(m->u, true), 0);
    assert_non_null(m->x);
    assert_non_null(m->labels);
}

static void mlp_free(mlp *m) {
    for (int i = 0; i < 4; i++) gj_release(m->p[i]);
    gj_release(m->u);
    gj_release(m->x);
    gj_release(m->labels);
}

/* The forward: *h1 = linear 1, *h = tanh(h1), returns the logits. */
static gj_tensor *forward(mlp *m, gj_tensor **h1, gj_tensor **h) {
    *h1 = gj_linear(m->x, m->p[0], m->p[1]);
    *h = gj_tanh(*h1);
    gj_tensor *o = gj_linear(*h, m->p[2], m->p[3]);
    assert_non_null(o);
    return o;
}

/* The scalar loss of the logits: cross entropy in f32, a mean square in
 * f64 (two loss tails). */
static gj_tensor *loss_of(mlp *m, gj_tensor *logits) {
    gj_tensor *l = m->dt == GJ_F32 ? gj_cross_entropy(logits, m->labels)
                                   : gj_mean(gj_mul(logits, logits), 0, NULL, false);
    assert_non_null(l);
    return l;
}

/* Starts a test: empty cache, zero counters. */
static void fresh(void) {
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
}

/* ------------------------------------------------------ one gj_grad run */

/* What one gj_grad returned: its status, error, and a copy of every
 * gradient (values as doubles: exact for f32 and f64), their dtypes and
 * whether the returned references were pairwise distinct. */
typedef struct res {
    int rc, n;
    double *v[MAXI];
    int64_t numel[MAXI];
    gj_dtype dt[MAXI];
    bool distinct;
    char err[400];
} res;

static void res_free(res *r) {
    for (int i = 0; i < r->n; i++) free(r->v[i]);
    memset(r, 0, sizeof *r);
}

/* A scenario: builds a forward on m and calls gj_grad once, n inputs
 * (grads in g[]); returns gj_grad's status. */
typedef int (*scen_fn)(mlp *m, gj_tensor **g, void *ctx);

/* Runs scenario f compiled or eagerly in a scope and records its result. */
static void run(scen_fn f, mlp *m, void *ctx, bool compiled, int n, res *r) {
    memset(r, 0, sizeof *r);
    r->n = n;
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *g[MAXI] = {0};
    r->rc = f(m, g, ctx);
    snprintf(r->err, sizeof r->err, "%s", r->rc ? gj_last_error() : "");
    r->distinct = true;
    for (int i = 0; i < n; i++) {
        if (r->rc != 0) {
            assert_null(g[i]); /* a failed gj_grad hands nothing out */
            continue;
        }
        assert_non_null(g[i]);
        r->v[i] = gjt_values(g[i]);
        r->numel[i] = gj_tensor_numel(g[i]);
        r->dt[i] = gj_tensor_dtype(g[i]);
        for (int j = 0; j < i; j++) r->distinct &= g[j] != g[i];
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    for (int i = 0; i < 4; i++) assert_null(gj_tensor_grad(m->p[i])); /* no .grad touched */
}

/* got == want bit for bit (status, message, dtypes, sizes, every value). */
static void assert_same(const char *what, const res *got, const res *want) {
    if (got->rc != want->rc || strcmp(got->err, want->err) != 0)
        fprintf(stderr, "%s: rc %d (%s), eager %d (%s)\n", what, got->rc, got->err, want->rc,
                want->err);
    assert_int_equal(got->rc, want->rc);
    assert_string_equal(got->err, want->err);
    assert_int_equal(got->n, want->n);
    for (int i = 0; i < got->n && got->rc == 0; i++) {
        assert_int_equal(got->numel[i], want->numel[i]);
        assert_int_equal(got->dt[i], want->dt[i]);
        if (memcmp(got->v[i], want->v[i], (size_t)got->numel[i] * sizeof(double)) != 0) {
            int64_t worst = 0;
            double d = gjt_max_abs_diff(got->v[i], want->v[i], got->numel[i], &worst);
            fprintf(stderr, "%s: gradient %d differs from eager's: max |diff| %g at %lld\n", what,
                    i, d, (long long)worst);
            fail();
        }
    }
}

/* Runs f eagerly, then `times` times compiled: each compiled result must
 * equal the eager one bit for bit. */
static void compare(const char *what, scen_fn f, mlp *m, void *ctx, int n, int times) {
    res want, got;
    run(f, m, ctx, false, n, &want);
    for (int t = 0; t < times; t++) {
        run(f, m, ctx, true, n, &got);
        assert_same(what, &got, &want);
        assert_int_equal(got.distinct, want.distinct);
        res_free(&got);
    }
    res_free(&want);
}

/* ------------------------------------------------------------ scenarios */

/* The weights of the MLP from its scalar loss. */
static int sc_weights(mlp *m, gj_tensor **g, void *ctx) {
    (void)ctx;
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    return gj_grad(1, &l, NULL, 4, m->p, g, false, false);
}

/* Three outputs: the logits and the hidden activation with explicit
 * (non-trivial) seeds, the loss with a NULL seed (ones). */
static int sc_multi(mlp *m, gj_tensor **g, void *ctx) {
    (void)ctx;
    gj_tensor *h1, *h;
    gj_tensor *o = forward(m, &h1, &h);
    gj_tensor *l = loss_of(m, o);
    gjt_rng r;
    gjt_rng_seed(&r, 404);
    gj_tensor *so = gjt_uniform(&r, m->dt, 2, (int64_t[]){6, 10}, -1, 1);
    gj_tensor *sh = gjt_uniform(&r, m->dt, 2, (int64_t[]){6, 32}, -1, 1);
    gj_tensor *outs[3] = {o, h, l}, *seeds[3] = {so, sh, NULL};
    gj_tensor *in[3] = {m->p[0], m->p[2], m->p[1]};
    int rc = gj_grad(3, outs, seeds, 3, in, g, false, false);
    gj_release(so);
    gj_release(sh);
    return rc;
}

/* Non-leaf inputs: h1 (before tanh), h (after) and w2. */
static int sc_nonleaf(mlp *m, gj_tensor **g, void *ctx) {
    (void)ctx;
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    gj_tensor *in[3] = {h1, m->p[2], h};
    return gj_grad(1, &l, NULL, 3, in, g, false, false);
}

/* w1 twice, and the non-leaf h twice. */
static int sc_twice(mlp *m, gj_tensor **g, void *ctx) {
    (void)ctx;
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    gj_tensor *in[5] = {m->p[0], h, m->p[2], m->p[0], h};
    return gj_grad(1, &l, NULL, 5, in, g, false, false);
}

/* w1 and the unused leaf u; ctx: a bool, allow_unused. */
static int sc_unused(mlp *m, gj_tensor **g, void *ctx) {
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    gj_tensor *in[3] = {m->p[0], m->u, m->p[3]};
    return gj_grad(1, &l, NULL, 3, in, g, false, *(bool *)ctx);
}

/* u twice, the only inputs: no gradient reaches either (allow_unused). */
static int sc_only_unused(mlp *m, gj_tensor **g, void *ctx) {
    (void)ctx;
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    gj_tensor *in[2] = {m->u, m->u};
    return gj_grad(1, &l, NULL, 2, in, g, false, true);
}

/* --------------------------------------------------------------- tests */

/* The MLP's weights, f32 and f64: one compile, then memory hits; the same
 * bits as eager each time; counted as backwards; no fallback. */
static void weights_case(gj_dtype dt) {
    mlp m;
    mlp_init(&m, dt, 11);
    fresh();
    compare("weights", sc_weights, &m, NULL, 4, 4);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 4);
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 3);
    assert_int_equal(s.fallbacks, 0);
    gj_ca_program_info info;
    assert_int_equal(gj_compiled_autograd_last_program(&info), 0);
    assert_true(info.instrs > 0);
    mlp_free(&m);
}

static void test_weights_f32(void **st) {
    (void)st;
    weights_case(GJ_F32);
}

static void test_weights_f64(void **st) {
    (void)st;
    weights_case(GJ_F64);
}

/* Several outputs with explicit seeds and one NULL seed. */
static void test_multi_outputs(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        mlp m;
        mlp_init(&m, d ? GJ_F64 : GJ_F32, 12);
        fresh();
        compare("multi", sc_multi, &m, NULL, 3, 2);
        gj_ca_stats s = gjt_ca_now();
        assert_int_equal(s.compiles, 1);
        assert_int_equal(s.mem_hits, 1);
        assert_int_equal(s.fallbacks, 0);
        mlp_free(&m);
    }
}

/* Non-leaf inputs get the gradient flowing into their grad_fn's output. */
static void test_nonleaf_inputs(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 13);
    fresh();
    compare("nonleaf", sc_nonleaf, &m, NULL, 3, 2);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 1);
    assert_int_equal(s.fallbacks, 0);
    mlp_free(&m);
}

/* An input given twice: two distinct references (as eager), equal values,
 * each released once (the scope); live bytes back to where they were. */
static void test_input_twice(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 14);
    int64_t live0 = gjt_live_bytes();
    fresh();
    res want, got;
    run(sc_twice, &m, NULL, false, 5, &want);
    run(sc_twice, &m, NULL, true, 5, &got);
    assert_same("twice", &got, &want);
    assert_true(want.distinct);
    assert_true(got.distinct);
    assert_memory_equal(got.v[0], got.v[3], (size_t)got.numel[0] * sizeof(double));
    assert_memory_equal(got.v[1], got.v[4], (size_t)got.numel[1] * sizeof(double));
    res_free(&want);
    res_free(&got);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.fallbacks, 0);
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
    mlp_free(&m);
}

/* An unreachable input: zeros with allow_unused; without it, eager's error
 * (and, as eager, nothing handed out). Both compiled, from one program
 * (allow_unused only changes what gj_grad does with a missing gradient).
 * Only unreachable inputs: a program without outputs, all zeros. */
static void test_allow_unused(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 15);
    fresh();
    bool allow = true;
    res want, got;
    run(sc_unused, &m, &allow, false, 3, &want);
    run(sc_unused, &m, &allow, true, 3, &got);
    assert_same("allow_unused", &got, &want);
    assert_int_equal(got.rc, 0);
    for (int64_t k = 0; k < got.numel[1]; k++) assert_true(got.v[1][k] == 0.0);
    res_free(&want);
    res_free(&got);
    /* only unreachable inputs: a program without outputs, zeros */
    run(sc_only_unused, &m, NULL, false, 2, &want);
    run(sc_only_unused, &m, NULL, true, 2, &got);
    assert_same("only unused", &got, &want);
    assert_int_equal(got.rc, 0);
    assert_true(got.distinct);
    for (int64_t k = 0; k < got.numel[0]; k++) assert_true(got.v[0][k] == 0.0);
    res_free(&want);
    res_free(&got);
    allow = false;
    run(sc_unused, &m, &allow, false, 3, &want);
    run(sc_unused, &m, &allow, true, 3, &got);
    assert_same("not allow_unused", &got, &want);
    assert_int_equal(got.rc, -1);
    assert_non_null(strstr(got.err, "input 1 is not reachable"));
    res_free(&want);
    res_free(&got);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 3);
    /* two keys; the second one's kernels are the first one's: bound to
     * them, no compile */
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.instantiations, 1);
    assert_int_equal(s.mem_hits, 1);
    assert_int_equal(s.fallbacks, 0);
    mlp_free(&m);
}

/* x does not require grad; ctx: unused. */
static int sc_no_grad_input(mlp *m, gj_tensor **g, void *ctx) {
    (void)ctx;
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    gj_tensor *in[2] = {m->p[0], m->x};
    return gj_grad(1, &l, NULL, 2, in, g, false, true);
}

/* An input that does not require grad is eager's error, compiled too, and
 * no fallback (the eager engine reports what it refuses, as for a
 * backward through a freed graph). */
static void test_errors_as_eager(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 24);
    fresh();
    res want, got;
    run(sc_no_grad_input, &m, NULL, false, 2, &want);
    run(sc_no_grad_input, &m, NULL, true, 2, &got);
    assert_same("no grad input", &got, &want);
    assert_int_equal(got.rc, -1);
    assert_non_null(strstr(got.err, "input 1 does not require grad"));
    res_free(&want);
    res_free(&got);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 1);
    assert_int_equal(s.compiles + s.mem_hits + s.disk_hits + s.fallbacks, 0);
    mlp_free(&m);
}

/* Keys: gj_grad and gj_backward of one graph differ, as do two gj_grads
 * asking for different inputs; the same request gives the same key. */
static void test_keys(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 16);
    gj_scope_push();
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(&m, forward(&m, &h1, &h));
    gj_jit_walk wb, wg, wg2, wg3;
    assert_int_equal(gj_jit_walk_build(&wb, 1, &l, NULL), 0);
    assert_int_equal(gj_jit_walk_build_grad(&wg, 1, &l, NULL, 4, m.p), 0);
    assert_int_equal(gj_jit_walk_build_grad(&wg2, 1, &l, NULL, 4, m.p), 0);
    gj_tensor *in3[2] = {m.p[0], h};
    assert_int_equal(gj_jit_walk_build_grad(&wg3, 1, &l, NULL, 2, in3), 0);
    assert_false(wb.grad_mode);
    assert_true(wg.grad_mode);
    assert_false(wb.key_len == wg.key_len && memcmp(wb.key, wg.key, wb.key_len) == 0);
    assert_false(wb.site[0] == wg.site[0] && wb.site[1] == wg.site[1]);
    assert_int_equal(wg.key_len, wg2.key_len);
    assert_memory_equal(wg.key, wg2.key, wg.key_len);
    assert_false(wg.key_len == wg3.key_len && memcmp(wg.key, wg3.key, wg.key_len) == 0);
    /* gj_grad mode: only what reaches a requested input is needed */
    int needed_b = 0, needed_g3 = 0;
    for (int i = 0; i < wb.n; i++) needed_b += wb.needed[i];
    for (int i = 0; i < wg3.n; i++) needed_g3 += wg3.needed[i];
    assert_int_equal(needed_b, wb.n);
    assert_true(needed_g3 < wg3.n);
    gj_jit_walk_free(&wb);
    gj_jit_walk_free(&wg);
    gj_jit_walk_free(&wg2);
    gj_jit_walk_free(&wg3);
    gj_scope_pop();
    mlp_free(&m);
}

/* One backward of the model's loss, compiled or not; copies the .grads
 * into out[4] (malloc'd) and clears them. */
static void backward_grads(mlp *m, bool compiled, double **out) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    assert_int_equal(gj_backward(l, NULL), 0);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    for (int i = 0; i < 4; i++) {
        out[i] = gjt_values(gj_tensor_grad(m->p[i]));
        assert_non_null(out[i]);
        assert_int_equal(gj_tensor_set_grad(m->p[i], NULL), 0);
    }
}

/* gj_grad and gj_backward on the same model, interleaved: two programs
 * (no key shared), then hits only; gj_grad's results equal eager's, and
 * the .grads of the compiled backward equal both the eager backward's and
 * the gradients gj_grad returned. */
static void test_grad_and_backward(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 17);
    fresh();
    res want;
    run(sc_weights, &m, NULL, false, 4, &want);
    double *eb[4];
    backward_grads(&m, false, eb);
    for (int round = 0; round < 3; round++) {
        res got;
        run(sc_weights, &m, NULL, true, 4, &got);
        assert_same("grad next to backward", &got, &want);
        res_free(&got);
        double *cb[4];
        backward_grads(&m, true, cb);
        for (int i = 0; i < 4; i++) {
            size_t nb = (size_t)want.numel[i] * sizeof(double);
            assert_memory_equal(cb[i], eb[i], nb);
            assert_memory_equal(cb[i], want.v[i], nb);
            free(cb[i]);
        }
    }
    for (int i = 0; i < 4; i++) free(eb[i]);
    res_free(&want);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 6);
    /* two keys (gj_grad's, gj_backward's), one compile: the second one's
     * fused kernels are the first one's, shared across programs */
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.instantiations, 1);
    assert_int_equal(s.mem_hits, 4);
    assert_int_equal(s.fallbacks, 0);
    mlp_free(&m);
}

/* retain_graph: a second gj_grad on the same graph works (a memory hit,
 * same bits); without it the graph is freed and a second call fails with
 * eager's message, in both modes. */
static void retain_run(mlp *m, bool compiled, res *r1, res *r2, bool retain) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *h1, *h;
    gj_tensor *l = loss_of(m, forward(m, &h1, &h));
    gj_tensor *in[2] = {m->p[2], h1};
    res *rs[2] = {r1, r2};
    for (int k = 0; k < 2; k++) {
        gj_tensor *g[2] = {NULL, NULL};
        res *r = rs[k];
        memset(r, 0, sizeof *r);
        r->n = 2;
        r->rc = gj_grad(1, &l, NULL, 2, in, g, retain, false);
        snprintf(r->err, sizeof r->err, "%s", r->rc ? gj_last_error() : "");
        for (int i = 0; i < 2 && r->rc == 0; i++) {
            r->v[i] = gjt_values(g[i]);
            r->numel[i] = gj_tensor_numel(g[i]);
            r->dt[i] = gj_tensor_dtype(g[i]);
        }
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
}

static void test_retain_graph(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 18);
    for (int retain = 1; retain >= 0; retain--) {
        fresh();
        res e1, e2, c1, c2;
        retain_run(&m, false, &e1, &e2, retain);
        retain_run(&m, true, &c1, &c2, retain);
        assert_same("retain 1st", &c1, &e1);
        assert_same("retain 2nd", &c2, &e2);
        assert_int_equal(c2.rc, retain ? 0 : -1);
        if (!retain) assert_non_null(strstr(c2.err, "second time"));
        gj_ca_stats s = gjt_ca_now();
        assert_int_equal(s.compiles, 1);
        assert_int_equal(s.mem_hits, retain ? 1 : 0); /* a freed graph is no fallback */
        assert_int_equal(s.fallbacks, 0);
        res_free(&e1);
        res_free(&e2);
        res_free(&c1);
        res_free(&c2);
    }
    mlp_free(&m);
}

/* ------------------------------------------------------------ hooks */

typedef struct hk {
    int calls;
    double scale;
    int mode;      /* 0: scale; 1: record_stream from call `from`; 2: fail from call `from` */
    int from;
    gj_stream *s;
} hk;

static gj_tensor *hook_fn(gj_tensor *grad, void *user) {
    hk *h = user;
    h->calls++;
    if (h->mode == 1 && h->calls >= h->from)
        assert_int_equal(gj_tensor_record_stream(grad, h->s), 0);
    if (h->mode == 2 && h->calls >= h->from) return gj_zeros(GJ_F32, 1, (int64_t[]){5});
    return gj_mul_scalar(grad, h->scale);
}

typedef struct hooks_ctx {
    hk on_w2, on_h;
} hooks_ctx;

/* Tensor hooks on the leaf input w2 and on the intermediate h (an input
 * too), registered on each new graph. */
static int sc_hooks(mlp *m, gj_tensor **g, void *ctx) {
    hooks_ctx *c = ctx;
    gj_tensor *h1, *h;
    gj_tensor *o = forward(m, &h1, &h);
    assert_true(gj_register_hook(h, hook_fn, &c->on_h) > 0);
    gj_tensor *l = loss_of(m, o);
    gj_tensor *in[3] = {m->p[0], h, m->p[2]};
    return gj_grad(1, &l, NULL, 3, in, g, false, false);
}

/* Hooks run once per call, compiled as eagerly, and their results flow on
 * (into w1's gradient) and are returned (h's). The leaf's hook is removed
 * at the end: it stays with w2 otherwise. */
static void test_hooks(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 19);
    fresh();
    hooks_ctx c = {.on_w2 = {.scale = 0.5}, .on_h = {.scale = 3.0}};
    int64_t hw = gj_register_hook(m.p[2], hook_fn, &c.on_w2);
    assert_true(hw > 0);
    compare("hooks", sc_hooks, &m, &c, 3, 3);
    assert_int_equal(c.on_w2.calls, 4);
    assert_int_equal(c.on_h.calls, 4);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.mem_hits, 2);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(gj_remove_hook(hw), 0);
    mlp_free(&m);
}

/* A hook that calls record_stream from its 2nd call (the 2nd compiled
 * run): that run finishes (the guard does not abandon) and the key becomes
 * eager-only; the 3rd compiled call falls back with the reason. A hook
 * that fails (a gradient of the wrong shape) from its 2nd call abandons
 * the compiled run: the eager engine redoes the call (the hook runs again)
 * and reports the error. Every result is eager's. */
static void test_hook_fallbacks(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 20);
    gj_stream *s = gj_stream_new();
    assert_non_null(s);
    /* record_stream: eager call 1 and 2 (references), compiled 3, 4, 5 */
    fresh();
    hooks_ctx ce = {.on_w2 = {.scale = 1.0}, .on_h = {.scale = 2.0, .mode = 1, .from = 1000, .s = s}};
    hooks_ctx cc = ce;
    res want, got;
    run(sc_hooks, &m, &ce, false, 3, &want);
    cc.on_h.from = 2; /* its 2nd call: the 2nd compiled run */
    for (int t = 0; t < 3; t++) {
        run(sc_hooks, &m, &cc, true, 3, &got);
        assert_same("record_stream hook", &got, &want);
        res_free(&got);
    }
    assert_int_equal(cc.on_h.calls, 3);
    gj_ca_stats st1 = gjt_ca_now();
    assert_int_equal(st1.compiles + st1.disk_hits, 1);
    assert_int_equal(st1.mem_hits, 0); /* the 2nd run hit, tripped: a fallback */
    assert_int_equal(st1.fallbacks, 2); /* the guard's, then the eager-only key's */
    assert_int_equal(st1.fallbacks_by_reason[GJ_CA_RECORD_STREAM], 2);
    assert_non_null(strstr(gj_compiled_autograd_last_fallback(), "record_stream"));
    res_free(&want);
    /* a failing hook */
    fresh();
    hooks_ctx fe = {.on_w2 = {.scale = 1.0}, .on_h = {.scale = 2.0, .mode = 2, .from = 2}};
    hooks_ctx fc = fe;
    res w1, w2;
    run(sc_hooks, &m, &fe, false, 3, &w1);
    run(sc_hooks, &m, &fe, false, 3, &w2); /* fails at its 2nd call */
    assert_int_equal(w2.rc, -1);
    run(sc_hooks, &m, &fc, true, 3, &got);
    assert_same("good hook", &got, &w1);
    res_free(&got);
    run(sc_hooks, &m, &fc, true, 3, &got); /* compiled: trips, eager redoes it */
    assert_int_equal(got.rc, -1); /* eager's error (the hook's handle is a new one) */
    assert_non_null(strstr(w2.err, "returned a gradient of shape [5] (f32)"));
    assert_non_null(strstr(got.err, "returned a gradient of shape [5] (f32)"));
    res_free(&got);
    assert_int_equal(fc.on_h.calls, 3); /* the failing call ran, then eager's again */
    gj_ca_stats st2 = gjt_ca_now();
    assert_int_equal(st2.compiles + st2.disk_hits, 1);
    assert_int_equal(st2.mem_hits, 0); /* the 2nd run hit, tripped: a fallback */
    assert_int_equal(st2.fallbacks, 1);
    assert_int_equal(st2.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 1);
    res_free(&w1);
    res_free(&w2);
    gj_stream_free(s);
    mlp_free(&m);
}

/* A forced LLVM failure: the key is eager-only (reason LLVM error), every
 * call gives eager's result and counts a fallback. */
static void test_llvm_fallback(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F64, 21);
    fresh();
    gj_jit_test_fail_llvm(true);
    compare("llvm failure", sc_nonleaf, &m, NULL, 3, 2);
    gj_jit_test_fail_llvm(false);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 2);
    assert_int_equal(s.compiles, 0);
    assert_int_equal(s.fallbacks, 2);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_LLVM_ERROR], 2);
    mlp_free(&m);
}

/* Anomaly mode runs gj_grad eagerly, as gj_backward: counted under
 * GJ_CA_INCOMPATIBLE_MODE. */
static void test_anomaly_fallback(void **st) {
    (void)st;
    mlp m;
    mlp_init(&m, GJ_F32, 22);
    fresh();
    gj_set_anomaly_mode(true);
    compare("anomaly", sc_weights, &m, NULL, 4, 1);
    gj_set_anomaly_mode(false);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.backwards, 1);
    assert_int_equal(s.compiles, 0);
    assert_int_equal(s.fallbacks, 1);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_INCOMPATIBLE_MODE], 1);
    mlp_free(&m);
}

/* The disk cache serves a gj_grad's program to a cleared memory cache
 * (the same key and plan). */
static void test_disk_hit(void **st) {
    (void)st;
    char dir[] = "/tmp/gj_grad_cacheXXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    mlp m;
    mlp_init(&m, GJ_F32, 23);
    fresh();
    compare("disk 1", sc_multi, &m, NULL, 3, 1);
    gj_jit_clear_cache();
    compare("disk 2", sc_multi, &m, NULL, 3, 1);
    gj_ca_stats s = gjt_ca_now();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.disk_hits, 1);
    assert_int_equal(s.fallbacks, 0);
    gj_jit_set_disk_cache(NULL);
    mlp_free(&m);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* ------------------------------------------------- multi-root backward */

/* gj_backward_multi of sc_multi's outputs and seeds (roots: 0 the three,
 * 1 the loss twice); the .grads of the 4 weights into out[] (malloc'd),
 * then cleared. Returns its status, message in err. */
static int multi_backward(mlp *m, bool compiled, int roots, double **out, char *err,
                          size_t cap) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *h1, *h;
    gj_tensor *o = forward(m, &h1, &h);
    gj_tensor *l = loss_of(m, o);
    gjt_rng r;
    gjt_rng_seed(&r, 404);
    gj_tensor *so = gjt_uniform(&r, m->dt, 2, (int64_t[]){6, 10}, -1, 1);
    gj_tensor *sh = gjt_uniform(&r, m->dt, 2, (int64_t[]){6, 32}, -1, 1);
    gj_tensor *outs[3] = {o, h, l}, *seeds[3] = {so, sh, NULL};
    gj_tensor *twice[2] = {l, l};
    int rc = roots == 0   ? gj_backward_multi(3, outs, seeds, false)
             : roots == 1 ? gj_backward_multi(2, twice, NULL, false)
                          : gj_backward_multi(2, outs, NULL, false); /* o: no implicit seed */
    snprintf(err, cap, "%s", rc ? gj_last_error() : "");
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    for (int i = 0; i < 4; i++) {
        gj_tensor *g = gj_tensor_grad(m->p[i]);
        out[i] = g ? gjt_values(g) : NULL;
        assert_int_equal(gj_tensor_set_grad(m->p[i], NULL), 0);
    }
    return rc;
}

/* Several roots in one backward: compiled .grads equal eager's bit for
 * bit (one compile, then a hit), and equal what gj_grad returns for the
 * same outputs and seeds; a root given twice counts twice; a missing seed
 * of a many-element root is the same error in both modes. */
static void test_backward_multi(void **st) {
    (void)st;
    for (int d = 0; d < 2; d++) {
        mlp m;
        mlp_init(&m, d ? GJ_F64 : GJ_F32, 25);
        fresh();
        res gr;
        run(sc_multi, &m, NULL, false, 3, &gr); /* w1, w2, b1 */
        for (int roots = 0; roots < 2; roots++) {
            double *e[4], *c[4];
            char ee[400], ce[400];
            assert_int_equal(multi_backward(&m, false, roots, e, ee, sizeof ee), 0);
            for (int t = 0; t < 2; t++) {
                assert_int_equal(multi_backward(&m, true, roots, c, ce, sizeof ce), 0);
                for (int i = 0; i < 4; i++) {
                    int64_t n = gj_tensor_numel(m.p[i]);
                    assert_non_null(e[i]);
                    assert_non_null(c[i]);
                    assert_memory_equal(c[i], e[i], (size_t)n * sizeof(double));
                    if (roots == 0 && i != 3) { /* gj_grad's inputs were w1, w2, b1 */
                        int k = i == 0 ? 0 : i == 2 ? 1 : 2;
                        assert_memory_equal(c[i], gr.v[k], (size_t)n * sizeof(double));
                    }
                    free(c[i]);
                }
            }
            if (roots == 1) { /* the loss twice: twice the gradient of one loss */
                res one;
                run(sc_weights, &m, NULL, false, 4, &one);
                for (int i = 0; i < 4; i++)
                    for (int64_t k = 0; k < one.numel[i]; k++)
                        assert_true(e[i][k] == 2.0 * one.v[i][k]);
                res_free(&one);
            }
            for (int i = 0; i < 4; i++) free(e[i]);
        }
        gj_ca_stats s = gjt_ca_now();
        assert_int_equal(s.compiles, 2);
        assert_int_equal(s.mem_hits, 2);
        assert_int_equal(s.fallbacks, 0);
        double *x[4];
        char ee[400], ce[400];
        assert_int_equal(multi_backward(&m, false, 2, x, ee, sizeof ee), -1);
        for (int i = 0; i < 4; i++) assert_null(x[i]);
        assert_int_equal(multi_backward(&m, true, 2, x, ce, sizeof ce), -1);
        for (int i = 0; i < 4; i++) assert_null(x[i]);
        assert_string_equal(ce, ee);
        assert_non_null(strstr(ce, "gj_backward_multi: a seed gradient is needed for output 0"));
        res_free(&gr);
        mlp_free(&m);
    }
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_weights_f32),
        cmocka_unit_test(test_weights_f64),
        cmocka_unit_test(test_multi_outputs),
        cmocka_unit_test(test_nonleaf_inputs),
        cmocka_unit_test(test_input_twice),
        cmocka_unit_test(test_allow_unused),
        cmocka_unit_test(test_errors_as_eager),
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_grad_and_backward),
        cmocka_unit_test(test_retain_graph),
        cmocka_unit_test(test_hooks),
        cmocka_unit_test(test_hook_fallbacks),
        cmocka_unit_test(test_llvm_fallback),
        cmocka_unit_test(test_anomaly_fallback),
        cmocka_unit_test(test_disk_hit),
        cmocka_unit_test(test_backward_multi),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
