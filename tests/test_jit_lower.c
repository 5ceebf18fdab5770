/* SPDX-License-Identifier: MIT */
/*
 * test_jit_lower.c - the compiler's back end on hand-built IR graphs:
 * planning (fusion, view folding, reductions, BLAS steps, memory plan),
 * LLVM lowering and ORC compilation, and the plan interpreter, checked
 * against C references written with the same scalar math (runtime/
 * gj_math.h). Where the evaluation order is the same the results must be
 * bit-identical; matmuls are compared with a tolerance against a double
 * reference. MAX, GATHER_ROWS, SCATTER_ADD_ROWS and bf16 MATMUL are
 * compared with the eager kernels' bytes. Also: the forced-LLVM-failure
 * switch, the "no lowering" test switch, and what a memory budget
 * recomputes (plan/remat.c: a node with several saved outputs copied once,
 * the fused head priced as its GEMMs).
 */
#include "gjtest.h"

#include "jit/jit.h"
#include "jit/cache/cache.h"
#include "jit/run/run.h" /* gj_jit_plan_exec */
#include "runtime/gj_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ helpers */

static int input(gj_jit_graph *g, gj_dtype dt, int nd, const int64_t *shape) {
    gj_rt_meta m = {.dtype = dt, .ndim = nd};
    memcpy(m.shape, shape, (size_t)nd * sizeof *shape);
    int v = gj_jit_graph_add_input(g, &m, GJ_JIT_IN_SAVED, -1, 0);
    assert_true(v >= 0);
    return v;
}

static int op(gj_jit_graph *g, gj_rt_inst inst, int a, int b, int c) {
    int args[3] = {a, b, c}, out[GJ_RT_MAX_OUTPUTS];
    int n = gj_jit_graph_add_node(g, &inst, args, out);
    if (n < 0) print_error("add_node %s: %s\n", gj_rt_prim_name(inst.prim), gj_last_error());
    assert_true(n >= 1);
    return out[0];
}

static int un(gj_jit_graph *g, gj_rt_prim p, int a) {
    return op(g, (gj_rt_inst){.prim = p, .n_in = 1}, a, -1, -1);
}
static int bin(gj_jit_graph *g, gj_rt_prim p, int a, int b) {
    return op(g, (gj_rt_inst){.prim = p, .n_in = 2}, a, b, -1);
}
static int sum(gj_jit_graph *g, int a, uint32_t axes, bool keep) {
    return op(g, (gj_rt_inst){.prim = GJ_P_SUM, .n_in = 1, .axes = axes, .keepdim = keep}, a,
              -1, -1);
}
static int out_new(gj_jit_graph *g, int v) {
    assert_int_equal(gj_jit_graph_add_output(g, v, -1, -1), 0);
    return g->n_outputs - 1;
}

static gj_jit_program *build(gj_jit_graph *g) {
    char why[300];
    bool perm = false;
    gj_jit_program *p = gj_jit_program_build(g, NULL, why, sizeof why, &perm);
    if (!p) print_error("program build failed: %s\n", why);
    assert_non_null(p);
    return p;
}

static float *rand_f32(gjt_rng *r, int64_t n, double lo, double hi) {
    float *x = malloc((size_t)n * sizeof *x);
    assert_non_null(x);
    for (int64_t i = 0; i < n; i++) x[i] = (float)gjt_rng_uniform(r, lo, hi);
    return x;
}

static void assert_same_f32(const char *what, const float *got, const float *want, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            print_error("%s[%lld]: got %.9g want %.9g\n", what, (long long)i, (double)got[i],
                        (double)want[i]);
            fail();
        }
    }
}

/* ----------------------------------------------------------- the tests */

/* tanh(x*b + s) * sigmoid(x) + exp(-(x*x)) with b[C] and s[R,1] broadcast:
 * one fused kernel, two outputs, bit-identical to the scalar reference. */
static void test_elementwise_broadcast(void **st) {
    (void)st;
    enum { R = 4, C = 33 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 1);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){R, C});
    int b = input(&g, GJ_F32, 1, (int64_t[]){C});
    int s = input(&g, GJ_F32, 2, (int64_t[]){R, 1});
    int v = un(&g, GJ_P_TANH, bin(&g, GJ_P_ADD, bin(&g, GJ_P_MUL, x, b), s));
    int y1 = bin(&g, GJ_P_MUL, v, un(&g, GJ_P_SIGMOID, x));
    int y = bin(&g, GJ_P_ADD, y1, un(&g, GJ_P_EXP, un(&g, GJ_P_NEG, bin(&g, GJ_P_MUL, x, x))));
    out_new(&g, y);
    out_new(&g, v);
    gj_jit_program *pr = build(&g);
    int kernels = 0;
    for (int k = 0; k < pr->plan.n_instrs; k++) kernels += pr->plan.instrs[k].kind == GJ_JIT_INSTR_KERNEL;
    assert_int_equal(kernels, 1);
    float *xv = rand_f32(&rng, R * C, -3, 3), *bv = rand_f32(&rng, C, -2, 2),
          *sv = rand_f32(&rng, R, -1, 1);
    float yo[R * C], vo[R * C], yr[R * C], vr[R * C];
    void *in[3] = {xv, bv, sv}, *out[2] = {yo, vo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            float xx = xv[i * C + j];
            float t = gj_m_tanh_f(xx * bv[j] + sv[i]);
            vr[i * C + j] = t;
            yr[i * C + j] = t * gj_m_sigmoid_f(xx) + gj_m_exp_f(-(xx * xx));
        }
    assert_same_f32("y", yo, yr, R * C);
    assert_same_f32("v", vo, vr, R * C);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    free(bv);
    free(sv);
}

/* The eager SUM order over a contiguous run: 8 lanes, tail from lane 0,
 * tree combine, all in double. */
static double lane_sum(const float *p, int64_t n, int64_t st) {
    double l[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) l[k] += (double)p[(i + k) * st];
    for (int k = 0; i < n; i++, k++) l[k] += (double)p[i * st];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* p = x*y; sum over the last axis (keepdim, fused: inner mode), over the
 * first axis (outer mode), and x - rowsum broadcast back. */
static void test_reductions(void **st) {
    (void)st;
    enum { R = 6, C = 37 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 2);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){R, C});
    int y = input(&g, GJ_F32, 2, (int64_t[]){R, C});
    int p = bin(&g, GJ_P_MUL, x, y);
    int s1 = sum(&g, p, 2u, true);
    int s0 = sum(&g, p, 1u, false);
    int d = bin(&g, GJ_P_SUB, x, s1);
    int all = sum(&g, d, 3u, false);
    out_new(&g, s1);
    out_new(&g, s0);
    out_new(&g, d);
    out_new(&g, all);
    gj_jit_program *pr = build(&g);
    float *xv = rand_f32(&rng, R * C, -1, 1), *yv = rand_f32(&rng, R * C, -1, 1);
    float s1o[R], s0o[C], dout[R * C], allo[1];
    void *in[2] = {xv, yv}, *out[4] = {s1o, s0o, dout, allo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    float pv[R * C], s1r[R], s0r[C], dr[R * C], allr[1];
    for (int i = 0; i < R * C; i++) pv[i] = xv[i] * yv[i];
    for (int i = 0; i < R; i++) s1r[i] = (float)lane_sum(pv + i * C, C, 1);
    for (int j = 0; j < C; j++) {
        double a = 0;
        for (int i = 0; i < R; i++) a += (double)pv[i * C + j];
        s0r[j] = (float)a;
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) dr[i * C + j] = xv[i * C + j] - s1r[i];
    allr[0] = (float)lane_sum(dr, R * C, 1);
    assert_same_f32("rowsum", s1o, s1r, R);
    assert_same_f32("colsum", s0o, s0r, C);
    assert_same_f32("x - rowsum", dout, dr, R * C);
    assert_same_f32("total", allo, allr, 1);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    free(yv);
}

static void ref_matmul(const float *a, const float *b, float *c, int M, int N, int K, bool ta,
                       bool tb) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (double)(ta ? a[k * M + i] : a[i * K + k]) * (double)(tb ? b[j * K + k] : b[k * N + j]);
            c[i * N + j] = (float)s;
        }
}

static void assert_close_f32(const char *what, const float *got, const float *want, int64_t n,
                             double rtol) {
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        if (d > rtol * (1.0 + fabs((double)want[i]))) {
            print_error("%s[%lld]: got %.9g want %.9g\n", what, (long long)i, (double)got[i],
                        (double)want[i]);
            fail();
        }
    }
}

/* Matmuls: plain, ta through a folded transpose view, tb, batched with a
 * shared right operand, and an elementwise consumer of a BLAS result. */
static void test_matmul(void **st) {
    (void)st;
    enum { M = 5, K = 7, N = 3 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 3);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int a = input(&g, GJ_F32, 2, (int64_t[]){M, K});
    int b = input(&g, GJ_F32, 2, (int64_t[]){K, N});
    int xb = input(&g, GJ_F32, 3, (int64_t[]){2, M, K});
    int c = op(&g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2}, a, b, -1); /* [M,N] */
    gj_rt_inst perm = {.prim = GJ_P_PERMUTE, .n_in = 1, .ndim = 2, .shape = {1, 0}};
    int at = op(&g, perm, a, -1, -1);                                          /* [K,M] view */
    int e = op(&g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2}, at, c, -1);  /* [K,N] */
    int f = op(&g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2, .tb = true}, c, b, -1); /* [M,K] */
    int h = op(&g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2}, xb, b, -1); /* [2,M,N] */
    int q = un(&g, GJ_P_TANH, c);
    out_new(&g, c);
    out_new(&g, e);
    out_new(&g, f);
    out_new(&g, h);
    out_new(&g, q);
    gj_jit_program *pr = build(&g);
    float *av = rand_f32(&rng, M * K, -1, 1), *bv = rand_f32(&rng, K * N, -1, 1),
          *xv = rand_f32(&rng, 2 * M * K, -1, 1);
    float co[M * N], eo[K * N], fo[M * K], ho[2 * M * N], qo[M * N];
    void *in[3] = {av, bv, xv}, *out[5] = {co, eo, fo, ho, qo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    float cr[M * N], er[K * N], fr[M * K], hr[2 * M * N], qr[M * N];
    ref_matmul(av, bv, cr, M, N, K, false, false);
    ref_matmul(av, co, er, K, N, M, true, false);
    ref_matmul(co, bv, fr, M, K, N, false, true);
    ref_matmul(xv, bv, hr, 2 * M, N, K, false, false);
    for (int i = 0; i < M * N; i++) qr[i] = gj_m_tanh_f(co[i]);
    assert_close_f32("a@b", co, cr, M * N, 1e-5);
    assert_close_f32("a^T@c", eo, er, K * N, 1e-5);
    assert_close_f32("c@b^T", fo, fr, M * K, 1e-5);
    assert_close_f32("batched", ho, hr, 2 * M * N, 1e-5);
    assert_same_f32("tanh(a@b)", qo, qr, M * N);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(av);
    free(bv);
    free(xv);
}

/* Views folded into index maps: permute + slice + expand, and a reshape of
 * a non-contiguous view (materialised by a copy kernel). */
static void test_views(void **st) {
    (void)st;
    gjt_rng rng;
    gjt_rng_seed(&rng, 4);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){3, 4});
    int v = input(&g, GJ_F32, 1, (int64_t[]){3});
    int p = op(&g, (gj_rt_inst){.prim = GJ_P_PERMUTE, .n_in = 1, .ndim = 2, .shape = {1, 0}}, x,
               -1, -1); /* [4,3] */
    int sl = op(&g, (gj_rt_inst){.prim = GJ_P_SLICE, .n_in = 1, .axis = 0, .start = 1, .len = 2}, p,
                -1, -1); /* [2,3] = x[:, 1:3]^T */
    int ev = op(&g, (gj_rt_inst){.prim = GJ_P_EXPAND, .n_in = 1, .ndim = 2, .shape = {2, 3}}, v, -1,
                -1);
    int y = bin(&g, GJ_P_ADD, sl, ev);
    int r = op(&g, (gj_rt_inst){.prim = GJ_P_RESHAPE, .n_in = 1, .ndim = 1, .shape = {6}}, sl, -1,
               -1);
    int z = bin(&g, GJ_P_MUL, r, r);
    out_new(&g, y);
    out_new(&g, z);
    out_new(&g, sl); /* a view as an output: copied */
    gj_jit_program *pr = build(&g);
    float *xv = rand_f32(&rng, 12, -1, 1), *vv = rand_f32(&rng, 3, -1, 1);
    float yo[6], zo[6], so[6], yr[6], zr[6], sr[6];
    void *in[2] = {xv, vv}, *out[3] = {yo, zo, so};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) {
            float s = xv[j * 4 + (i + 1)];
            sr[i * 3 + j] = s;
            yr[i * 3 + j] = s + vv[j];
            zr[i * 3 + j] = s * s;
        }
    assert_same_f32("slice+expand", yo, yr, 6);
    assert_same_f32("reshape copy", zo, zr, 6);
    assert_same_f32("view output", so, sr, 6);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    free(vv);
}

/* bf16: every op rounds its result to bf16 (as eager stores it), sums
 * accumulate in double and round once. */
static void test_bf16(void **st) {
    (void)st;
    enum { N = 50 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 5);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_BF16, 1, (int64_t[]){N});
    int y = un(&g, GJ_P_EXP, x);
    int z = bin(&g, GJ_P_MUL, y, x);
    int s = sum(&g, z, 1u, false);
    int c = op(&g, (gj_rt_inst){.prim = GJ_P_CAST, .n_in = 1, .dtype = GJ_F32}, z, -1, -1);
    out_new(&g, z);
    out_new(&g, s);
    out_new(&g, c);
    gj_jit_program *pr = build(&g);
    uint16_t xv[N], zo[N], so[1];
    float co[N];
    for (int i = 0; i < N; i++) xv[i] = gj_m_f32_to_bf16((float)gjt_rng_uniform(&rng, -2, 2));
    void *in[1] = {xv}, *out[3] = {zo, so, co};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    float zf[N];
    for (int i = 0; i < N; i++) {
        float xf = gj_m_bf16_to_f32(xv[i]);
        float yf = gj_m_bf16_to_f32(gj_m_f32_to_bf16(gj_m_exp_f(xf)));
        zf[i] = gj_m_bf16_to_f32(gj_m_f32_to_bf16(yf * xf));
        assert_int_equal(zo[i], gj_m_f32_to_bf16(zf[i]));
    }
    assert_same_f32("cast", co, zf, N);
    assert_int_equal(so[0], gj_m_f32_to_bf16((float)lane_sum(zf, N, 1)));
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
}

/* f64 math, constants, scalars, WHERE/EQ/STEP, casts, pow. */
static void test_f64_ops(void **st) {
    (void)st;
    enum { N = 41 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 6);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F64, 1, (int64_t[]){N});
    int y = input(&g, GJ_F64, 1, (int64_t[]){N});
    int half = op(&g, (gj_rt_inst){.prim = GJ_P_FILL, .n_in = 0, .scalar = 0.5, .dtype = GJ_F64}, -1,
                  -1, -1);
    int a = bin(&g, GJ_P_DIV, un(&g, GJ_P_GELU_GRAD, x), bin(&g, GJ_P_ADD, un(&g, GJ_P_SIGMOID, y), half));
    int b = op(&g, (gj_rt_inst){.prim = GJ_P_POW_SCALAR, .n_in = 1, .scalar = 3.0}, x, -1, -1);
    int c = op(&g, (gj_rt_inst){.prim = GJ_P_POW_SCALAR, .n_in = 1, .scalar = 1.7}, un(&g, GJ_P_RELU, y),
               -1, -1);
    int m = un(&g, GJ_P_STEP, x);
    int w = op(&g, (gj_rt_inst){.prim = GJ_P_WHERE, .n_in = 3}, m, a, b);
    int q = bin(&g, GJ_P_EQ, m, half);
    int t = op(&g, (gj_rt_inst){.prim = GJ_P_ADD_SCALAR, .n_in = 1, .scalar = 0.25},
               op(&g, (gj_rt_inst){.prim = GJ_P_MUL_SCALAR, .n_in = 1, .scalar = -3.0}, w, -1, -1), -1,
               -1);
    int f = op(&g, (gj_rt_inst){.prim = GJ_P_CAST, .n_in = 1, .dtype = GJ_F32},
               bin(&g, GJ_P_ADD, t, bin(&g, GJ_P_ADD, c, q)), -1, -1);
    out_new(&g, t);
    out_new(&g, f);
    gj_jit_program *pr = build(&g);
    double xv[N], yv[N], to[N], tr[N];
    float fo[N], fr[N];
    for (int i = 0; i < N; i++) {
        xv[i] = gjt_rng_uniform(&rng, -3, 3);
        yv[i] = gjt_rng_uniform(&rng, -3, 3);
    }
    void *in[2] = {xv, yv}, *out[2] = {to, fo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    for (int i = 0; i < N; i++) {
        double av = gj_m_gelu_grad_d(xv[i]) / (gj_m_sigmoid_d(yv[i]) + 0.5);
        double bv = gj_m_pow_d(xv[i], 3.0);
        double cv = gj_m_pow_d(gj_m_relu_d(yv[i]), 1.7);
        double mv = gj_m_step_d(xv[i]);
        double wv = mv != 0 ? av : bv;
        double qv = mv == 0.5 ? 1.0 : 0.0;
        tr[i] = wv * -3.0 + 0.25;
        fr[i] = (float)(tr[i] + (cv + qv));
    }
    assert_memory_equal(to, tr, sizeof tr);
    assert_same_f32("cast", fo, fr, N);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
}

/* IOTA + EQ one-hot (as the cross-entropy decomposition builds it) and a
 * dropout mask, each folded into the consumer kernel. */
static void test_generators(void **st) {
    (void)st;
    enum { R = 5, K = 7, N = 100 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 7);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int lab = input(&g, GJ_I64, 1, (int64_t[]){R});
    int x = input(&g, GJ_F32, 2, (int64_t[]){R, K});
    int z = input(&g, GJ_F32, 1, (int64_t[]){N});
    int lf = op(&g, (gj_rt_inst){.prim = GJ_P_CAST, .n_in = 1, .dtype = GJ_F32}, lab, -1, -1);
    int l2 = op(&g, (gj_rt_inst){.prim = GJ_P_RESHAPE, .n_in = 1, .ndim = 2, .shape = {R, 1}}, lf, -1,
                -1);
    int io = op(&g, (gj_rt_inst){.prim = GJ_P_IOTA, .n_in = 0, .dtype = GJ_F32, .axis = 0, .ndim = 1,
                                 .shape = {K}},
                -1, -1, -1);
    int oh = bin(&g, GJ_P_EQ, l2, io);
    int picked = sum(&g, bin(&g, GJ_P_MUL, oh, x), 2u, false);
    gj_rt_inst dm = {.prim = GJ_P_DROPOUT_MASK, .n_in = 0, .scalar = 0.3, .dtype = GJ_F32, .seed = 99,
                     .rng_offset = 12345, .ndim = 1, .shape = {N}};
    int dz = bin(&g, GJ_P_MUL, z, op(&g, dm, -1, -1, -1));
    out_new(&g, picked);
    out_new(&g, dz);
    gj_jit_program *pr = build(&g);
    int64_t lv[R];
    for (int i = 0; i < R; i++) lv[i] = gjt_rng_int(&rng, K);
    float *xv = rand_f32(&rng, R * K, -1, 1), *zv = rand_f32(&rng, N, -1, 1);
    float po[R], dzo[N], dzr[N];
    void *in[3] = {lv, xv, zv}, *out[2] = {po, dzo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    for (int i = 0; i < R; i++) {
        float row[K];
        for (int j = 0; j < K; j++) row[j] = ((float)lv[i] == (float)j ? 1.0f : 0.0f) * xv[i * K + j];
        float want = (float)lane_sum(row, K, 1);
        assert_same_f32("one-hot pick", &po[i], &want, 1);
        assert_true(po[i] == xv[i * K + lv[i]]);
    }
    for (int i = 0; i < N; i++) dzr[i] = zv[i] * gj_m_dropout_scale_f(99, 12345 + (uint64_t)i, 0.3f);
    assert_same_f32("dropout", dzo, dzr, N);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    free(zv);
}

/* Accumulation into an existing .grad in place (the recorder's form:
 * ADD(grad, g) written into the .grad input's own buffer), a constant
 * operand, and a long 1-D iteration space split in blocks across threads. */
static void test_inplace_and_large(void **st) {
    (void)st;
    enum { N = 300001 };
    gjt_rng rng;
    gjt_rng_seed(&rng, 8);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 1, (int64_t[]){N});
    int w = input(&g, GJ_F32, 1, (int64_t[]){N});
    int gr = input(&g, GJ_F32, 1, (int64_t[]){N});
    /* d/dx of tanh(x*w)*sigmoid(x): a W2-like chain */
    int t = un(&g, GJ_P_TANH, bin(&g, GJ_P_MUL, x, w));
    int one = op(&g, (gj_rt_inst){.prim = GJ_P_FILL, .n_in = 0, .scalar = 1.0, .dtype = GJ_F32}, -1,
                 -1, -1);
    int dt = bin(&g, GJ_P_SUB, one, bin(&g, GJ_P_MUL, t, t));
    int sg = un(&g, GJ_P_SIGMOID, x);
    int gx = bin(&g, GJ_P_MUL, bin(&g, GJ_P_MUL, dt, w), sg);
    int acc = bin(&g, GJ_P_ADD, gr, gx);
    assert_int_equal(gj_jit_graph_add_output(&g, acc, -1, 2), 0);
    int tot = sum(&g, gx, 1u, false);
    out_new(&g, tot);
    gj_jit_program *pr = build(&g);
    assert_int_equal(pr->plan.out_buf[0], 2); /* written into the .grad input */
    float *xv = rand_f32(&rng, N, -2, 2), *wv = rand_f32(&rng, N, -2, 2),
          *gv = rand_f32(&rng, N, -1, 1);
    float *want = malloc((size_t)N * sizeof *want), *gxr = malloc((size_t)N * sizeof *gxr);
    assert_non_null(want);
    assert_non_null(gxr);
    for (int i = 0; i < N; i++) {
        float tt = gj_m_tanh_f(xv[i] * wv[i]);
        gxr[i] = ((1.0f - tt * tt) * wv[i]) * gj_m_sigmoid_f(xv[i]);
        want[i] = gv[i] + gxr[i];
    }
    float toto = 0, totr = (float)lane_sum(gxr, N, 1);
    void *in[3] = {xv, wv, gv}, *out[2] = {NULL, &toto};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    assert_same_f32("in-place .grad", gv, want, N);
    assert_same_f32("sum", &toto, &totr, 1);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    free(wv);
    free(gv);
    free(want);
    free(gxr);
}

/* PAD and CAT: fused pieces are stored straight into their region of the
 * result, other pieces copied; PAD zero-fills first. */
static void test_pad_cat(void **st) {
    (void)st;
    gjt_rng rng;
    gjt_rng_seed(&rng, 9);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){3, 2});
    int y = input(&g, GJ_F32, 2, (int64_t[]){3, 4});
    int ex = un(&g, GJ_P_EXP, x);                          /* fused piece */
    int yt = op(&g, (gj_rt_inst){.prim = GJ_P_SLICE, .n_in = 1, .axis = -1, .start = 1, .len = 3}, y,
                -1, -1);                                   /* a view piece */
    int c = op(&g, (gj_rt_inst){.prim = GJ_P_CAT, .n_in = 3, .axis = 1}, ex, yt, x); /* [3, 7] */
    int pd = op(&g, (gj_rt_inst){.prim = GJ_P_PAD, .n_in = 1, .axis = 0, .start = 1, .len = 5},
                un(&g, GJ_P_TANH, y), -1, -1);             /* [5, 4] */
    int s = bin(&g, GJ_P_MUL, c, c);
    out_new(&g, s);
    out_new(&g, pd);
    gj_jit_program *pr = build(&g);
    float *xv = rand_f32(&rng, 6, -1, 1), *yv = rand_f32(&rng, 12, -1, 1);
    float so[21], po[20], sr[21], pr_[20];
    void *in[2] = {xv, yv}, *out[2] = {so, po};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    for (int i = 0; i < 3; i++) {
        float row[7];
        row[0] = gj_m_exp_f(xv[i * 2]);
        row[1] = gj_m_exp_f(xv[i * 2 + 1]);
        for (int j = 0; j < 3; j++) row[2 + j] = yv[i * 4 + 1 + j];
        row[5] = xv[i * 2];
        row[6] = xv[i * 2 + 1];
        for (int j = 0; j < 7; j++) sr[i * 7 + j] = row[j] * row[j];
    }
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 4; j++)
            pr_[i * 4 + j] = (i >= 1 && i < 4) ? gj_m_tanh_f(yv[(i - 1) * 4 + j]) : 0.0f;
    assert_same_f32("cat", so, sr, 21);
    assert_same_f32("pad", po, pr_, 20);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    free(yv);
}

/* Empty iteration spaces: no kernel row runs, sums over nothing are 0. */
static void test_empty(void **st) {
    (void)st;
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){0, 3});
    int y = un(&g, GJ_P_EXP, x);
    int s0 = sum(&g, y, 1u, false);  /* [3] of zeros */
    int s1 = sum(&g, y, 2u, false);  /* [0] */
    out_new(&g, s0);
    out_new(&g, s1);
    out_new(&g, y);
    gj_jit_program *pr = build(&g);
    float xv[1] = {0}, s0o[3] = {7, 7, 7}, s1o[1] = {7}, yo[1] = {7};
    void *in[1] = {xv}, *out[3] = {s0o, s1o, yo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    for (int i = 0; i < 3; i++) assert_true(s0o[i] == 0.0f);
    assert_true(s1o[0] == 7.0f && yo[0] == 7.0f); /* untouched: empty */
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
}

/* ------------------------------------------- MAX, index ops, bf16 matmul */

/* The eager kernel's result of inst on tensors in[0..n_in) (new reference). */
static gj_tensor *eager_ref(gj_rt_inst inst, int n_in, gj_tensor *const *in) {
    inst.n_in = n_in;
    gj_tensor *outs[GJ_RT_MAX_OUTPUTS];
    int n = gj_rt_exec(&inst, in, outs);
    if (n < 1) print_error("eager %s: %s\n", gj_rt_prim_name(inst.prim), gj_last_error());
    assert_true(n >= 1);
    for (int k = 1; k < n; k++) gj_release(outs[k]);
    return outs[0];
}

/* Output bytes of the compiled run == the eager tensor's bytes. */
static void assert_same_bytes(const char *what, const void *got, gj_tensor *want) {
    gj_tensor *c = gj_contiguous(want);
    assert_non_null(c);
    size_t n = (size_t)gj_tensor_numel(c) * (gj_tensor_dtype(c) == GJ_F64 || gj_tensor_dtype(c) == GJ_I64 ? 8
                                               : gj_tensor_dtype(c) == GJ_F32              ? 4
                                                                                           : 2);
    if (memcmp(got, gj_tensor_data(c), n) != 0) {
        print_error("%s: compiled result differs from the eager kernel's\n", what);
        fail();
    }
    gj_release(c);
}

/* MAX over the last axis (inner mode, with a NaN row, fused with the
 * softmax-style consumer x - max), over the first axis (outer mode) and
 * over a middle axis in f64: bit-identical to the eager MAX kernel. */
static void test_max(void **st) {
    (void)st;
    enum { R = 5, C = 37 };
    int64_t live0 = gjt_live_bytes();
    gjt_rng rng;
    gjt_rng_seed(&rng, 31);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){R, C});
    int y = input(&g, GJ_F64, 3, (int64_t[]){3, 4, 5});
    gj_rt_inst mx1 = {.prim = GJ_P_MAX, .n_in = 1, .axes = 2u, .keepdim = true};
    gj_rt_inst mx0 = {.prim = GJ_P_MAX, .n_in = 1, .axes = 1u, .keepdim = false};
    gj_rt_inst mxm = {.prim = GJ_P_MAX, .n_in = 1, .axes = 2u, .keepdim = false};
    int m1 = op(&g, mx1, x, -1, -1);
    int e = un(&g, GJ_P_EXP, bin(&g, GJ_P_SUB, x, m1));
    int m0 = op(&g, mx0, x, -1, -1);
    int mm = op(&g, mxm, y, -1, -1);
    out_new(&g, m1);
    out_new(&g, e);
    out_new(&g, m0);
    out_new(&g, mm);
    gj_jit_program *pr = build(&g);
    float *xv = rand_f32(&rng, R * C, -4, 4);
    xv[2 * C + 5] = NAN;
    double yv[60];
    for (int i = 0; i < 60; i++) yv[i] = gjt_rng_uniform(&rng, -3, 3);
    float m1o[R], eo[R * C], m0o[C];
    double mmo[15];
    void *in[2] = {xv, yv}, *out[4] = {m1o, eo, m0o, mmo};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    gj_tensor *xt = gj_from_data(GJ_F32, 2, (int64_t[]){R, C}, xv);
    gj_tensor *yt = gj_from_data(GJ_F64, 3, (int64_t[]){3, 4, 5}, yv);
    gj_tensor *r1 = eager_ref(mx1, 1, &xt), *r0 = eager_ref(mx0, 1, &xt), *rm = eager_ref(mxm, 1, &yt);
    assert_same_bytes("max last axis", m1o, r1);
    assert_same_bytes("max first axis", m0o, r0);
    assert_same_bytes("max middle axis f64", mmo, rm);
    assert_true(isnan(m1o[2]) && isnan(m0o[5]));
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            float want = gj_m_exp_f(xv[i * C + j] - m1o[i]);
            if (i != 2) assert_memory_equal(&eo[i * C + j], &want, sizeof want);
        }
    gj_release(r1);
    gj_release(r0);
    gj_release(rm);
    gj_release(xt);
    gj_release(yt);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    free(xv);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* GATHER_ROWS from a table and from a transposed view of one, and
 * SCATTER_ADD_ROWS with repeated indices over two column chunks (D = 300)
 * in f32, f64 and bf16: bit-identical to the eager kernels (same order). A
 * bad index is an error naming it, nothing written. */
static void test_index(void **st) {
    (void)st;
    enum { V = 4, D = 300, NI = 7 };
    int64_t live0 = gjt_live_bytes();
    gjt_rng rng;
    gjt_rng_seed(&rng, 32);
    int64_t iv[NI] = {2, 0, 2, 3, 2, 0, 1};
    gj_tensor *it = gjt_i64(1, (int64_t[]){NI}, iv);
    gj_dtype dts[3] = {GJ_F32, GJ_F64, GJ_BF16};
    for (int d = 0; d < 3; d++) {
        gj_dtype dt = dts[d];
        gj_jit_graph g;
        gj_jit_graph_init(&g);
        int src = input(&g, dt, 2, (int64_t[]){NI, D});
        int tab = input(&g, dt, 2, (int64_t[]){V, D});
        int tabT = input(&g, dt, 2, (int64_t[]){D, V});
        int idx = input(&g, GJ_I64, 1, (int64_t[]){NI});
        gj_rt_inst sc = {.prim = GJ_P_SCATTER_ADD_ROWS, .n_in = 2, .len = V};
        gj_rt_inst ga = {.prim = GJ_P_GATHER_ROWS, .n_in = 2};
        int s1 = op(&g, sc, src, idx, -1);
        int g1 = op(&g, ga, tab, idx, -1);
        int tv = op(&g, (gj_rt_inst){.prim = GJ_P_PERMUTE, .n_in = 1, .ndim = 2, .shape = {1, 0}},
                    tabT, -1, -1);
        int g2 = op(&g, ga, tv, idx, -1);
        int s2 = op(&g, sc, un(&g, GJ_P_TANH, src), idx, -1); /* src computed: materialised */
        out_new(&g, s1);
        out_new(&g, g1);
        out_new(&g, g2);
        out_new(&g, s2);
        gj_jit_program *pr = build(&g);
        gj_tensor *srct = gjt_uniform(&rng, dt, 2, (int64_t[]){NI, D}, -1, 1);
        gj_tensor *tabt = gjt_uniform(&rng, dt, 2, (int64_t[]){V, D}, -1, 1);
        gj_tensor *tabTt = gjt_uniform(&rng, dt, 2, (int64_t[]){D, V}, -1, 1);
        size_t el = dt == GJ_F64 ? 8 : dt == GJ_F32 ? 4 : 2;
        char *o1 = malloc(V * D * el), *o2 = malloc(NI * D * el), *o3 = malloc(NI * D * el),
             *o4 = malloc(V * D * el);
        assert_true(o1 && o2 && o3 && o4);
        void *in[4] = {gj_tensor_data(srct), gj_tensor_data(tabt), gj_tensor_data(tabTt),
                       gj_tensor_data(it)};
        void *out[4] = {o1, o2, o3, o4};
        assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
        gj_tensor *a1[2] = {srct, it}, *a2[2] = {tabt, it};
        gj_tensor *tT = gj_transpose(tabTt, 0, 1), *th = gj_tanh(srct);
        gj_tensor *a3[2] = {tT, it}, *a4[2] = {th, it};
        gj_tensor *r1 = eager_ref(sc, 2, a1), *r2 = eager_ref(ga, 2, a2), *r3 = eager_ref(ga, 2, a3),
                  *r4 = eager_ref(sc, 2, a4);
        assert_same_bytes("scatter_add_rows", o1, r1);
        assert_same_bytes("gather_rows", o2, r2);
        assert_same_bytes("gather_rows of a transposed table", o3, r3);
        assert_same_bytes("scatter_add_rows of a computed source", o4, r4);
        /* a bad index: an error, no crash */
        int64_t bad[NI] = {2, 0, 2, 9, 2, 0, 1};
        in[3] = bad;
        assert_int_not_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
        assert_non_null(strstr(gj_last_error(), "index 9 at position 3 out of range"));
        gj_release(r1);
        gj_release(r2);
        gj_release(r3);
        gj_release(r4);
        gj_release(tT);
        gj_release(th);
        gj_release(srct);
        gj_release(tabt);
        gj_release(tabTt);
        free(o1);
        free(o2);
        free(o3);
        free(o4);
        gj_jit_program_free(pr);
        gj_jit_graph_free(&g);
    }
    gj_release(it);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* bf16 MATMUL (plain, transposed operand view, batched): converted to f32,
 * an f32 GEMM, rounded once -- the eager kernel's bytes exactly. */
static void test_bf16_matmul(void **st) {
    (void)st;
    enum { M = 6, K = 9, N = 5 };
    int64_t live0 = gjt_live_bytes();
    gjt_rng rng;
    gjt_rng_seed(&rng, 33);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int a = input(&g, GJ_BF16, 2, (int64_t[]){M, K});
    int b = input(&g, GJ_BF16, 2, (int64_t[]){K, N});
    int xb = input(&g, GJ_BF16, 3, (int64_t[]){2, M, K});
    gj_rt_inst mm = {.prim = GJ_P_MATMUL, .n_in = 2};
    int c = op(&g, mm, a, b, -1);
    int at = op(&g, (gj_rt_inst){.prim = GJ_P_PERMUTE, .n_in = 1, .ndim = 2, .shape = {1, 0}}, a, -1, -1);
    int e = op(&g, mm, at, c, -1); /* [K, N] */
    int h = op(&g, mm, xb, b, -1);
    out_new(&g, c);
    out_new(&g, e);
    out_new(&g, h);
    gj_jit_program *pr = build(&g);
    for (int s = 0; s < pr->plan.n_instrs; s++)
        if (pr->plan.instrs[s].kind == GJ_JIT_INSTR_MATMUL) assert_int_equal(pr->plan.instrs[s].mm.dtype, GJ_F32);
    gj_tensor *av = gjt_uniform(&rng, GJ_BF16, 2, (int64_t[]){M, K}, -1, 1);
    gj_tensor *bv = gjt_uniform(&rng, GJ_BF16, 2, (int64_t[]){K, N}, -1, 1);
    gj_tensor *xv = gjt_uniform(&rng, GJ_BF16, 3, (int64_t[]){2, M, K}, -1, 1);
    uint16_t co[M * N], eo[K * N], ho[2 * M * N];
    void *in[3] = {gj_tensor_data(av), gj_tensor_data(bv), gj_tensor_data(xv)};
    void *out[3] = {co, eo, ho};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    gj_tensor *a1[2] = {av, bv};
    gj_tensor *rc = eager_ref(mm, 2, a1);
    gj_tensor *atv = gj_transpose(av, 0, 1);
    gj_tensor *a2[2] = {atv, rc}, *a3[2] = {xv, bv};
    gj_tensor *re = eager_ref(mm, 2, a2), *rh = eager_ref(mm, 2, a3);
    assert_same_bytes("bf16 a@b", co, rc);
    assert_same_bytes("bf16 a^T@c", eo, re);
    assert_same_bytes("bf16 batched", ho, rh);
    gj_release(rc);
    gj_release(re);
    gj_release(rh);
    gj_release(atv);
    gj_release(av);
    gj_release(bv);
    gj_release(xv);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* Reductions over a long last axis in a kernel big enough for the
 * vector-lane form (the body once per lane, <8 x double> accumulators):
 * sum of x*y (f32, fused, plus a tail), max with a NaN row, and an f64
 * sum of squares: the eager kernels' bytes. */
static void test_large_rows(void **st) {
    (void)st;
    enum { R = 50, C = 203 };
    int64_t live0 = gjt_live_bytes();
    gjt_rng rng;
    gjt_rng_seed(&rng, 34);
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 2, (int64_t[]){R, C});
    int y = input(&g, GJ_F32, 2, (int64_t[]){R, C});
    int z = input(&g, GJ_F64, 2, (int64_t[]){R, C});
    gj_rt_inst mx = {.prim = GJ_P_MAX, .n_in = 1, .axes = 2u, .keepdim = false};
    int s1 = sum(&g, bin(&g, GJ_P_MUL, x, y), 2u, true);
    int m1 = op(&g, mx, x, -1, -1);
    int s2 = sum(&g, bin(&g, GJ_P_MUL, z, z), 2u, false);
    out_new(&g, s1);
    out_new(&g, m1);
    out_new(&g, s2);
    gj_jit_program *pr = build(&g);
    gj_tensor *xt = gjt_uniform(&rng, GJ_F32, 2, (int64_t[]){R, C}, -3, 3);
    gj_tensor *yt = gjt_uniform(&rng, GJ_F32, 2, (int64_t[]){R, C}, -3, 3);
    gj_tensor *zt = gjt_uniform(&rng, GJ_F64, 2, (int64_t[]){R, C}, -3, 3);
    ((float *)gj_tensor_data(xt))[7 * C + 100] = NAN;
    float s1o[R], m1o[R];
    double s2o[R];
    void *in[3] = {gj_tensor_data(xt), gj_tensor_data(yt), gj_tensor_data(zt)};
    void *out[3] = {s1o, m1o, s2o};
    assert_int_equal(gj_jit_plan_exec(&pr->plan, in, NULL, out, NULL, NULL), 0);
    gj_tensor *p = gj_mul(xt, yt), *zz = gj_mul(zt, zt);
    gj_rt_inst sk = {.prim = GJ_P_SUM, .n_in = 1, .axes = 2u, .keepdim = true};
    gj_rt_inst sn = {.prim = GJ_P_SUM, .n_in = 1, .axes = 2u, .keepdim = false};
    gj_tensor *r1 = eager_ref(sk, 1, &p), *r2 = eager_ref(mx, 1, &xt), *r3 = eager_ref(sn, 1, &zz);
    assert_same_bytes("long row sum", s1o, r1);
    assert_same_bytes("long row max", m1o, r2);
    assert_same_bytes("long row f64 sum", s2o, r3);
    assert_true(isnan(m1o[7]) && isnan(s1o[7]));
    gj_release(r1);
    gj_release(r2);
    gj_release(r3);
    gj_release(p);
    gj_release(zz);
    gj_release(xt);
    gj_release(yt);
    gj_release(zt);
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
    assert_int_equal(gjt_live_bytes(), live0);
}


/* ------------------------------------------------- memory budget (remat.c) */

static int node_phase(gj_jit_graph *g, int v, int phase) {
    g->nodes[g->values[v].node].phase = phase;
    return v;
}

static int count_prim(const gj_jit_graph *g, gj_rt_prim p) {
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++) n += g->nodes[i].inst.prim == p;
    return n;
}

/* A step's graph by hand: o, lse = attention(q, k, v); y = o w; loss =
 * sum(y) (phase 0); the backward (phase 1) reads o for w's gradient,
 * then o and lse in attention's backward. */
static void attn_step_graph(gj_jit_graph *g) {
    enum { B = 1, H = 2, T = 64, D = 16, W = 256 };
    gj_jit_graph_init(g);
    int64_t s4[4] = {B, H, T, D};
    int q = input(g, GJ_F32, 4, s4), k = input(g, GJ_F32, 4, s4), v = input(g, GJ_F32, 4, s4);
    int w = input(g, GJ_F32, 2, (int64_t[]){D, W});
    int gy = input(g, GJ_F32, 2, (int64_t[]){B * H * T, W});
    gj_rt_inst at = {.prim = GJ_P_ATTN_FWD, .n_in = 3, .scalar = 0.25, .keepdim = true};
    int args[6] = {q, k, v}, out[GJ_RT_MAX_OUTPUTS];
    assert_int_equal(gj_jit_graph_add_node(g, &at, args, out), 2);
    int o = out[0], lse = out[1];
    gj_rt_inst rs = {.prim = GJ_P_RESHAPE, .n_in = 1, .ndim = 2, .shape = {B * H * T, D}};
    int o2 = op(g, rs, o, -1, -1);
    int y = op(g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2}, o2, w, -1);
    out_new(g, sum(g, y, 3u, false));
    int gw = node_phase(g, op(g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2, .ta = true}, o2, gy, -1), 1);
    int go2 = node_phase(g, op(g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2, .tb = true}, gy, w, -1), 1);
    gj_rt_inst rs4 = {.prim = GJ_P_RESHAPE, .n_in = 1, .ndim = 4, .shape = {B, H, T, D}};
    int go = node_phase(g, op(g, rs4, go2, -1, -1), 1);
    gj_rt_inst ab = at;
    ab.prim = GJ_P_ATTN_BWD;
    ab.n_in = 6;
    int bargs[6] = {q, k, v, o, go, lse};
    assert_int_equal(gj_jit_graph_add_node(g, &ab, bargs, out), 3);
    node_phase(g, out[0], 1);
    out_new(g, gw);
    for (int i = 0; i < 3; i++) out_new(g, out[i]);
}

/* A step's graph by hand with the fused head: hh = tanh(x w1); loss, gh,
 * gw = linear_cross_entropy(hh, wv, labels) (phase 0); the backward reads
 * hh and gh, the update gw, and its peak is a temporary of the backward
 * while they are held. */
static void lce_step_graph(gj_jit_graph *g) {
    enum { N = 64, C = 32, V = 512 };
    gj_jit_graph_init(g);
    int x = input(g, GJ_F32, 2, (int64_t[]){N, C});
    int w1 = input(g, GJ_F32, 2, (int64_t[]){C, C});
    int wv = input(g, GJ_F32, 2, (int64_t[]){V, C});
    int lab = input(g, GJ_I64, 1, (int64_t[]){N});
    int hh = un(g, GJ_P_TANH, op(g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2}, x, w1, -1));
    gj_rt_inst lc = {.prim = GJ_P_LCE_FWD, .n_in = 3, .start = -100, .keepdim = true};
    int args[3] = {hh, wv, lab}, out[GJ_RT_MAX_OUTPUTS];
    assert_int_equal(gj_jit_graph_add_node(g, &lc, args, out), 3);
    out_new(g, out[0]);
    /* a large temporary of the backward while hh and the head's gradients
     * are held: the peak a dropped value can lower */
    int wbig = input(g, GJ_F32, 2, (int64_t[]){C, 1024});
    int big = node_phase(g, op(g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2}, x, wbig, -1), 1);
    out_new(g, node_phase(g, sum(g, big, 3u, false), 1));
    int g1 = node_phase(g, bin(g, GJ_P_MUL, out[1], hh), 1);
    out_new(g, node_phase(g, op(g, (gj_rt_inst){.prim = GJ_P_MATMUL, .n_in = 2, .ta = true}, x, g1, -1), 1));
    out_new(g, node_phase(g, bin(g, GJ_P_ADD, wv, out[2]), 1));
}

/* The planned peak of make's graph without a budget (nothing dropped). */
static size_t unbudgeted_peak(void (*make)(gj_jit_graph *)) {
    char why[300];
    gj_jit_graph g;
    make(&g);
    gj_jit_remat r = {.budget = (size_t)1 << 40};
    assert_int_equal(gj_jit_pass_remat(&g, &r, why, sizeof why), 0);
    assert_int_equal(r.n_dropped, 0);
    assert_int_equal(count_prim(&g, GJ_P_ATTN_FWD) + count_prim(&g, GJ_P_LCE_FWD), 1);
    gj_jit_graph_free(&g);
    return r.peak;
}

/* Under a budget that attention's output does not fit, both of its saved
 * outputs are recomputed by one copy of the node: attention runs once in
 * the forward and once in the backward, not once per value. */
static void test_remat_shared_node(void **st) {
    (void)st;
    char why[300];
    gj_jit_graph g;
    size_t full = unbudgeted_peak(attn_step_graph);
    int fits = 0;
    for (size_t budget = full - 1; budget > full / 4; budget -= 1024) {
        attn_step_graph(&g);
        gj_jit_remat b = {.budget = budget};
        int rc = gj_jit_pass_remat(&g, &b, why, sizeof why);
        assert_true(rc == 0 || rc == 1);
        if (rc == 0) {
            fits++;
            assert_true(b.n_dropped >= 1 && b.peak <= budget && b.peak < full);
            assert_int_equal(count_prim(&g, GJ_P_ATTN_FWD), 2);
        }
        print_message("  budget %zu of %zu: rc %d, %d dropped, peak %zu, attention nodes %d\n",
                      budget, full, rc, b.n_dropped, b.peak, count_prim(&g, GJ_P_ATTN_FWD));
        gj_jit_graph_free(&g);
        if (rc == 1) break;
    }
    assert_true(fits > 0);
}

/* The fused head is priced as the GEMMs it runs (6 N V C FLOPs): a budget
 * a dropped GEMM output meets never runs the head again for its
 * gradients. */
static void test_remat_head_last(void **st) {
    (void)st;
    char why[300];
    gj_jit_graph g;
    size_t full = unbudgeted_peak(lce_step_graph);
    lce_step_graph(&g);
    gj_jit_remat b = {.budget = full - 1};
    assert_int_equal(gj_jit_pass_remat(&g, &b, why, sizeof why), 0);
    print_message("  budget %zu of %zu: %d dropped, peak %zu, head nodes %d, GEMMs %d\n",
                  b.budget, full, b.n_dropped, b.peak, count_prim(&g, GJ_P_LCE_FWD),
                  count_prim(&g, GJ_P_MATMUL));
    assert_true(b.n_dropped >= 1 && b.peak < full);
    assert_int_equal(count_prim(&g, GJ_P_LCE_FWD), 1);
    assert_int_equal(count_prim(&g, GJ_P_MATMUL), 4); /* x w1 twice, x wbig, w1's gradient */
    gj_jit_graph_free(&g);
}

/* A primitive without lowering (the test switch: every primitive has one),
 * and the forced LLVM failure: both fail the build with a readable,
 * permanent reason and leak nothing. */
static void test_failures(void **st) {
    (void)st;
    gj_jit_graph g;
    gj_jit_graph_init(&g);
    int x = input(&g, GJ_F32, 1, (int64_t[]){4});
    int idx = input(&g, GJ_I64, 1, (int64_t[]){3});
    int c = op(&g, (gj_rt_inst){.prim = GJ_P_SCATTER_ADD_ROWS, .n_in = 2, .len = 5},
               op(&g, (gj_rt_inst){.prim = GJ_P_RESHAPE, .n_in = 1, .ndim = 2, .shape = {3, 1}},
                  op(&g, (gj_rt_inst){.prim = GJ_P_SLICE, .n_in = 1, .axis = 0, .start = 0, .len = 3}, x,
                     -1, -1),
                  -1, -1),
               idx, -1);
    out_new(&g, c);
    char why[300];
    bool perm = false;
    gj_jit_test_no_lowering(GJ_P_SCATTER_ADD_ROWS);
    assert_null(gj_jit_program_build(&g, NULL, why, sizeof why, &perm));
    gj_jit_test_no_lowering(-1);
    assert_true(perm);
    assert_non_null(strstr(why, "no lowering for scatter_add_rows"));
    gj_jit_program *ok = build(&g); /* lowered without the switch */
    gj_jit_program_free(ok);
    gj_jit_graph_free(&g);

    gj_jit_graph_init(&g);
    x = input(&g, GJ_F32, 1, (int64_t[]){4});
    out_new(&g, un(&g, GJ_P_EXP, x));
    gj_jit_test_fail_llvm(true);
    perm = false;
    assert_null(gj_jit_program_build(&g, NULL, why, sizeof why, &perm));
    gj_jit_test_fail_llvm(false);
    assert_true(perm);
    assert_non_null(strstr(why, "LLVM error"));
    gj_jit_program *pr = build(&g); /* works again */
    gj_jit_program_free(pr);
    gj_jit_graph_free(&g);
}

int main(void) {
    gj_jit_set_quiet(true);
    gj_jit_set_disk_cache(NULL); /* counts below assume compiles, not disk hits */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_elementwise_broadcast),
        cmocka_unit_test(test_reductions),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_views),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_f64_ops),
        cmocka_unit_test(test_generators),
        cmocka_unit_test(test_inplace_and_large),
        cmocka_unit_test(test_pad_cat),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_max),
        cmocka_unit_test(test_index),
        cmocka_unit_test(test_bf16_matmul),
        cmocka_unit_test(test_large_rows),
        cmocka_unit_test(test_remat_shared_node),
        cmocka_unit_test(test_remat_head_last),
        cmocka_unit_test(test_failures),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
