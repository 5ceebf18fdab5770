/* SPDX-License-Identifier: MIT */
/*
 * test_jit_schedule.c - the compiled program's schedule (jit/schedule.c) and
 * GEMMs on the pool (runtime/blas.c: gemm_split).
 *
 *   - A GEMM split into row or column blocks on the pool gives bit for bit
 *     what its blocks (gj_rt_gemm_split_of, gj_rt_gemm_block) give run one
 *     by one, which is what the compiled program runs, and is close to a
 *     double-precision reference: f32 and f64, every transpose, beta 0 and
 *     1, padded leading dimensions, 2 and 3 threads.
 *   - The Fashion-MNIST-shaped MLP (F1, smaller batch) compiles to a program
 *     whose independent dX and dW GEMMs run side by side (counted through
 *     gj_compiled_autograd_last_program: parallel groups, GEMM steps and
 *     FLOPs), and its compiled gradients equal eager's bit for bit at 1, 2
 *     and 3 threads.
 *   - A tensor hook between two GEMMs is never crossed: the hook sees the
 *     gradient it sees eagerly, and the gradients still match.
 *   - gj_compiled_autograd_last_program fails with a message before any
 *     compiled backward on the calling thread, and for NULL.
 *   - Identical layers share their fused kernels (jit/dedupe.c: counted as
 *     kernel_functions), with eager's gradients bit for bit.
 *   - A layer norm's backward computes its shared cheap values again in each
 *     kernel instead of storing them (jit/plan_nodes.c: need_value): no
 *     [N, C] temporary at the peak, eager's gradients bit for bit.
 */
#include "gjtest.h"
#include "jit/jit.h"
#include "runtime/rt.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------ GEMM splitting */

/* C = op(A) op(B) + beta C on `threads` threads (split on the pool) must be
 * bit for bit the blocks of gj_rt_gemm_split_of run one by one on this
 * thread (what the compiled program runs), and close to a double-precision
 * reference. (One unsplit call is not the reference for bits: OpenBLAS's
 * kernels round some elements differently when the block changes.) */
static void check_split(bool f64, bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t pad,
                        double beta, int threads) {
    gjt_rng r;
    gjt_rng_seed(&r, (uint64_t)(M * 131 + N * 17 + K + ta * 2 + tb + pad * 7));
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    size_t el = f64 ? 8 : 4;
    char *A = malloc((size_t)(ar * lda) * el), *B = malloc((size_t)(br * ldb) * el);
    char *C1 = malloc((size_t)(M * ldc) * el), *C2 = malloc((size_t)(M * ldc) * el);
    double *ref = malloc((size_t)(M * N) * sizeof *ref);
    assert_true(A && B && C1 && C2 && ref);
#define GET(p, i) (f64 ? ((const double *)(const void *)(p))[i] : (double)((const float *)(const void *)(p))[i])
#define SET(p, i, v)                                  \
    do {                                              \
        if (f64) ((double *)(void *)(p))[i] = (v);    \
        else ((float *)(void *)(p))[i] = (float)(v); \
    } while (0)
    for (int64_t i = 0; i < ar * lda; i++) SET(A, i, gjt_rng_uniform(&r, -1, 1));
    for (int64_t i = 0; i < br * ldb; i++) SET(B, i, gjt_rng_uniform(&r, -1, 1));
    for (int64_t i = 0; i < M * ldc; i++) SET(C1, i, gjt_rng_uniform(&r, -1, 1));
    memcpy(C2, C1, (size_t)(M * ldc) * el);
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++)
                acc += GET(A, ta ? k * lda + i : i * lda + k) * GET(B, tb ? j * ldb + k : k * ldb + j);
            ref[i * N + j] = acc + beta * GET(C1, i * ldc + j);
        }
    gj_set_num_threads(threads);
    if (f64)
        gj_rt_dgemm(ta, tb, M, N, K, 1.0, (const double *)(const void *)A, lda,
                    (const double *)(const void *)B, ldb, beta, (double *)(void *)C1, ldc);
    else
        gj_rt_sgemm(ta, tb, M, N, K, 1.0f, (const float *)(const void *)A, lda,
                    (const float *)(const void *)B, ldb, (float)beta, (float *)(void *)C1, ldc);
    gj_rt_gemm_split sp;
    gj_rt_gemm_split_of(ta, M, N, K, threads, &sp);
    assert_true(sp.parts >= 1 && sp.parts <= threads);
    assert_int_equal(sp.len, sp.by_rows ? M : N);
    if (sp.parts > 1) assert_true(sp.len / sp.parts >= 16);
    gj_rt_gemm_call c = {f64, ta, tb, M, N, K, 1.0, A, lda, B, ldb, beta, C2, ldc, false};
    for (int i = sp.parts - 1; i >= 0; i--) gj_rt_gemm_block(&c, &sp, i); /* any order */
    if (memcmp(C1, C2, (size_t)(M * ldc) * el) != 0)
        fail_msg("split GEMM differs from its blocks: %s ta=%d tb=%d M=%lld N=%lld K=%lld pad=%lld "
                 "beta=%g threads=%d",
                 f64 ? "dgemm" : "sgemm", ta, tb, (long long)M, (long long)N, (long long)K,
                 (long long)pad, beta, threads);
    double tol = f64 ? 1e-12 : 1e-5;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double got = GET(C1, i * ldc + j), want = ref[i * N + j];
            if (fabs(got - want) > tol * (1 + fabs(want)) * (1 + K / 16.0))
                fail_msg("GEMM M=%lld N=%lld K=%lld at [%lld,%lld]: %g, want %g", (long long)M,
                         (long long)N, (long long)K, (long long)i, (long long)j, got, want);
        }
    for (int64_t i = 0; i < M; i++) /* the padding of C is untouched */
        for (int64_t j = N; j < ldc; j++) assert_true(memcmp(C1 + (i * ldc + j) * (int64_t)el, C2 + (i * ldc + j) * (int64_t)el, el) == 0);
#undef GET
#undef SET
    free(A), free(B), free(C1), free(C2), free(ref);
}

static void test_gemm_split_bit_exact(void **state) {
    (void)state;
    static const int64_t shapes[][3] = {
        {128, 512, 256}, {512, 128, 256}, {256, 1024, 10}, {10, 1024, 256}, {97, 301, 129},
        {64, 64, 2048},  {1000, 33, 65}, {256, 700, 40},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int v = 0; v < 8; v++) {
            bool f64 = v & 1, ta = v & 2, tb = v & 4;
            int threads = 2 + (int)(s % 2);
            check_split(f64, ta, tb, shapes[s][0], shapes[s][1], shapes[s][2], s % 3 == 0 ? 3 : 0,
                        (s + (size_t)v) % 2 ? 1.0 : 0.0, threads);
        }
    gj_set_num_threads(0);
}

/* Which side a GEMM is split along: the longer one, except that with A
 * transposed (a backward's dW GEMMs) row blocks are taken whenever each
 * keeps >= 64 rows (runtime/blas.c: measured faster with OpenBLAS). */
static void test_gemm_split_side(void **state) {
    (void)state;
    gj_rt_gemm_split sp;
    gj_rt_gemm_split_of(false, 512, 784, 128, 2, &sp); /* NN, M < N: columns */
    assert_false(sp.by_rows);
    assert_int_equal(sp.parts, 2);
    assert_int_equal(sp.len, 784);
    gj_rt_gemm_split_of(true, 512, 784, 128, 2, &sp); /* TN, M < N: rows */
    assert_true(sp.by_rows);
    assert_int_equal(sp.len, 512);
    gj_rt_gemm_split_of(true, 64, 1024, 512, 2, &sp); /* TN, 32-row blocks: columns */
    assert_false(sp.by_rows);
    gj_rt_gemm_split_of(true, 192, 1024, 512, 4, &sp); /* 48-row blocks on 4 threads */
    assert_false(sp.by_rows);
    gj_rt_gemm_split_of(true, 256, 1024, 512, 4, &sp);
    assert_true(sp.by_rows);
    assert_int_equal(sp.parts, 4);
    gj_rt_gemm_split_of(false, 1024, 256, 64, 2, &sp); /* M >= N: rows either way */
    assert_true(sp.by_rows);
    gj_rt_gemm_split_of(true, 512, 784, 128, 1, &sp); /* one thread: one block */
    assert_int_equal(sp.parts, 1);
}

/* ------------------------------------------------- MLP program schedule */

enum { B = 64, IN = 784, H1 = 512, H2 = 256, K = 10 };

typedef struct mlp {
    gj_linear_layer l[3];
    gj_tensor *x, *y;
} mlp;

static void mlp_init(mlp *m) {
    gj_manual_seed(77);
    assert_int_equal(gj_linear_init(&m->l[0], IN, H1, true, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&m->l[1], H1, H2, true, GJ_F32), 0);
    assert_int_equal(gj_linear_init(&m->l[2], H2, K, true, GJ_F32), 0);
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    m->x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){B, IN}, -1, 1);
    m->y = gjt_labels(&r, 1, (int64_t[]){B}, K);
    assert_non_null(m->x);
    assert_non_null(m->y);
}

static void mlp_free(mlp *m) {
    for (int i = 0; i < 3; i++) gj_linear_free(&m->l[i]);
    gj_release(m->x);
    gj_release(m->y);
}

static gj_tensor *mlp_param(mlp *m, int i) { return i % 2 ? m->l[i / 2].bias : m->l[i / 2].weight; }

/* The hook of the hook test: doubles the gradient (a new tensor). */
static int g_hook_calls;
static gj_tensor *double_it(gj_tensor *grad, void *ctx) {
    (void)ctx;
    g_hook_calls++;
    return gj_mul_scalar(grad, 2.0);
}

/* One backward in the given mode; returns the six gradients (malloc'd,
 * concatenated) and their count in *n. */
static double *mlp_grads(mlp *m, bool compiled, bool hook, int64_t *n) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *h1 = gj_gelu(gj_linear_forward(&m->l[0], m->x));
    if (hook) assert_true(gj_register_hook(h1, double_it, NULL) >= 0);
    gj_tensor *h2 = gj_gelu(gj_linear_forward(&m->l[1], h1));
    gj_tensor *loss = gj_cross_entropy(gj_linear_forward(&m->l[2], h2), m->y);
    assert_non_null(loss);
    assert_int_equal(gj_backward(loss, NULL), 0);
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += gj_tensor_numel(mlp_param(m, i));
    double *out = malloc((size_t)total * sizeof *out);
    assert_non_null(out);
    int64_t at = 0;
    for (int i = 0; i < 6; i++) {
        gj_tensor *g = gj_tensor_grad(mlp_param(m, i));
        assert_non_null(g);
        double *v = gjt_values(g);
        assert_non_null(v);
        memcpy(out + at, v, (size_t)gj_tensor_numel(g) * sizeof *v);
        at += gj_tensor_numel(g);
        free(v);
        gj_tensor_set_grad(mlp_param(m, i), NULL);
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    *n = total;
    return out;
}

static void test_mlp_pairs_and_bit_exact(void **state) {
    (void)state;
    mlp m;
    mlp_init(&m);
    for (int threads = 1; threads <= 3; threads++) {
        gj_set_num_threads(threads);
        int64_t n1, n2;
        double *e = mlp_grads(&m, false, false, &n1);
        gj_ca_stats before, after;
        gj_compiled_autograd_stats(&before);
        double *c = mlp_grads(&m, true, false, &n2);
        gj_compiled_autograd_stats(&after);
        assert_int_equal(after.fallbacks, before.fallbacks);
        assert_int_equal(after.backwards, before.backwards + 1);
        assert_int_equal(n1, n2);
        if (memcmp(e, c, (size_t)n1 * sizeof *e) != 0) {
            int64_t worst;
            double d = gjt_max_abs_diff(e, c, n1, &worst);
            fail_msg("threads %d: compiled differs from eager (max |d| %g at %lld)", threads, d,
                     (long long)worst);
        }
        free(e);
        free(c);
        gj_ca_program_info pi;
        assert_int_equal(gj_compiled_autograd_last_program(&pi), 0);
        /* dX, dW of layers 3 and 2, dW of layer 1 (x needs no gradient) */
        assert_int_equal(pi.gemm_instrs, 5);
        assert_int_equal(pi.n_gemms, 5);
        assert_int_equal(pi.parallel_groups, 2);
        double flops = 2.0 * (2.0 * B * H2 * K + 2.0 * B * H1 * H2 + (double)B * IN * H1);
        assert_true(fabs(pi.gemm_flops - flops) < 0.5);
        assert_true(pi.output_bytes == 4 * (int64_t)(IN * H1 + H1 + H1 * H2 + H2 + H2 * K + K));
        assert_true(pi.input_bytes > 0);
    }
    gj_set_num_threads(0);
    mlp_free(&m);
}

static void test_hook_between_gemms(void **state) {
    (void)state;
    mlp m;
    mlp_init(&m);
    gj_set_num_threads(2);
    int64_t n1, n2;
    g_hook_calls = 0;
    double *e = mlp_grads(&m, false, true, &n1);
    assert_int_equal(g_hook_calls, 1);
    gj_ca_stats before, after;
    gj_compiled_autograd_stats(&before);
    double *c = mlp_grads(&m, true, true, &n2); /* compile */
    free(c);
    c = mlp_grads(&m, true, true, &n2); /* cache hit */
    gj_compiled_autograd_stats(&after);
    assert_int_equal(g_hook_calls, 3);
    assert_int_equal(after.fallbacks, before.fallbacks);
    assert_int_equal(n1, n2);
    assert_true(gjt_allclose("hook between GEMMs", c, e, n1, 0, 1e-6));
    free(e);
    free(c);
    gj_ca_program_info pi;
    assert_int_equal(gj_compiled_autograd_last_program(&pi), 0);
    assert_int_equal(pi.other_instrs, 1); /* the hook step */
    gj_set_num_threads(0);
    mlp_free(&m);
}

/* Four identical residual layers y = y + Linear(GELU(Linear(y))): their
 * fused kernels are compiled once each (kernel_functions counts distinct
 * ones), and the shared kernels give eager's gradients bit for bit. */
enum { DL = 4, DB = 32, DC = 48, DH = 96 };

static double *deep_grads(gj_linear_layer *l, gj_tensor *x, bool compiled, int64_t *n) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *y = x;
    for (int i = 0; i < DL; i++)
        y = gj_add(y, gj_linear_forward(&l[2 * i + 1], gj_gelu(gj_linear_forward(&l[2 * i], y))));
    gj_tensor *loss = gj_mean(gj_mul(y, y), 0, NULL, false);
    assert_non_null(loss);
    assert_int_equal(gj_backward(loss, NULL), 0);
    int64_t total = 0;
    for (int i = 0; i < 2 * DL; i++) total += gj_tensor_numel(l[i].weight) + gj_tensor_numel(l[i].bias);
    double *out = malloc((size_t)total * sizeof *out);
    assert_non_null(out);
    int64_t at = 0;
    for (int i = 0; i < 2 * DL; i++)
        for (int w = 0; w < 2; w++) {
            gj_tensor *p = w ? l[i].bias : l[i].weight;
            double *v = gjt_values(gj_tensor_grad(p));
            assert_non_null(v);
            memcpy(out + at, v, (size_t)gj_tensor_numel(p) * sizeof *v);
            at += gj_tensor_numel(p);
            free(v);
            gj_tensor_set_grad(p, NULL);
        }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    *n = total;
    return out;
}

static void test_identical_layers_share_kernels(void **state) {
    (void)state;
    gj_manual_seed(9);
    gj_linear_layer l[2 * DL];
    for (int i = 0; i < DL; i++) {
        assert_int_equal(gj_linear_init(&l[2 * i], DC, DH, true, GJ_F32), 0);
        assert_int_equal(gj_linear_init(&l[2 * i + 1], DH, DC, true, GJ_F32), 0);
    }
    gjt_rng r;
    gjt_rng_seed(&r, 11);
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){DB, DC}, -1, 1);
    int64_t n1, n2;
    double *e = deep_grads(l, x, false, &n1);
    double *c = deep_grads(l, x, true, &n2);
    assert_int_equal(n1, n2);
    assert_true(memcmp(e, c, (size_t)n1 * sizeof *e) == 0);
    gj_ca_program_info pi;
    assert_int_equal(gj_compiled_autograd_last_program(&pi), 0);
    print_message("  %d layers: %d kernel steps, %d distinct kernel functions\n", DL,
                  pi.kernel_instrs, pi.kernel_functions);
    assert_true(pi.kernel_instrs >= 2 * DL);
    /* the layers' kernels are shared (here 9 steps, 4 functions): at least
     * half of the steps call a function another step already has */
    assert_true(2 * pi.kernel_functions <= pi.kernel_instrs);
    free(e);
    free(c);
    gj_release(x);
    for (int i = 0; i < 2 * DL; i++) gj_linear_free(&l[i]);
}

/* The kernels of a program compile in one module per thread at once
 * (llvmjit.c): with 2 threads a program with 4 distinct kernels is made of
 * 2 object files, with 1 thread of one; both give eager's bits; the disk
 * cache keeps the several objects as one entry and a process with any
 * thread count loads it (a fresh cache directory, so the first compile
 * cannot be a disk hit). */
static void test_parallel_compile(void **state) {
    (void)state;
    char dir[] = "/tmp/gj_parcompile_XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    gj_manual_seed(21);
    gj_linear_layer l[2 * DL];
    for (int i = 0; i < DL; i++) {
        assert_int_equal(gj_linear_init(&l[2 * i], DC, DH, true, GJ_F32), 0);
        assert_int_equal(gj_linear_init(&l[2 * i + 1], DH, DC, true, GJ_F32), 0);
    }
    gjt_rng r;
    gjt_rng_seed(&r, 23);
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){DB, DC}, -1, 1);
    int64_t n1, n2;
    double *e = deep_grads(l, x, false, &n1);
    struct { int threads; const char *cache; int parts; int64_t compiles, disk_hits; } runs[] = {
        {2, dir, 2, 1, 0},   /* compiled: two object files, saved as one entry */
        {1, dir, 2, 0, 1},   /* one thread loads the two-part entry */
        {1, "off", 1, 1, 0}, /* one thread compiles one object file */
        {2, dir, 2, 0, 1},
    };
    for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
        gj_jit_set_disk_cache(strcmp(runs[k].cache, "off") == 0 ? NULL : runs[k].cache);
        gj_set_num_threads(runs[k].threads);
        gj_jit_clear_cache();
        gj_ca_stats a, b;
        gj_compiled_autograd_stats(&a);
        double *c = deep_grads(l, x, true, &n2);
        gj_compiled_autograd_stats(&b);
        assert_int_equal(n1, n2);
        if (memcmp(e, c, (size_t)n1 * sizeof *e) != 0) fail_msg("run %zu: not eager's bits", k);
        gj_ca_program_info pi;
        assert_int_equal(gj_compiled_autograd_last_program(&pi), 0);
        print_message("  run %zu: %d thread(s), cache %s: %d distinct kernels in %d object file(s), "
                      "%lld compile(s), %lld disk hit(s)\n",
                      k, runs[k].threads, runs[k].cache == dir ? "dir" : "off", pi.kernel_functions,
                      pi.code_parts, (long long)(b.compiles - a.compiles),
                      (long long)(b.disk_hits - a.disk_hits));
        assert_true(pi.kernel_functions >= 4);
        assert_int_equal(pi.code_parts, runs[k].parts);
        assert_int_equal(b.compiles - a.compiles, runs[k].compiles);
        assert_int_equal(b.disk_hits - a.disk_hits, runs[k].disk_hits);
        assert_int_equal(b.fallbacks, a.fallbacks);
        free(c);
    }
    gj_set_num_threads(0);
    gj_jit_clear_cache();
    gj_jit_default_disk_cache();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    free(e);
    gj_release(x);
    for (int i = 0; i < 2 * DL; i++) gj_linear_free(&l[i]);
}

/* ------------------------------------------ recomputing cheap values */

/* The extra tensor bytes at the peak of one backward of sum(y*y), y =
 * layer_norm(x, w, b) (x [N, C]), and the gradients of x, w, b in g[]
 * (N*C + 2*C values). */
static int64_t ln_backward(gj_tensor *x, gj_tensor *w, gj_tensor *b, bool compiled, double *g) {
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *y = gj_layer_norm(x, w, b, 1e-5);
    gj_tensor *loss = gj_sum(gj_mul(y, y), 0, NULL, false);
    assert_non_null(loss);
    gj_mem m0, m1;
    gj_mem_stats(&m0);
    gj_mem_reset_peak();
    assert_int_equal(gj_backward(loss, NULL), 0);
    gj_mem_stats(&m1);
    gj_tensor *p[3] = {x, w, b};
    int64_t at = 0;
    for (int i = 0; i < 3; i++) {
        double *v = gjt_values(gj_tensor_grad(p[i]));
        int64_t n = gj_tensor_numel(p[i]);
        memcpy(g + at, v, (size_t)n * sizeof *v);
        at += n;
        free(v);
        gj_tensor_set_grad(p[i], NULL);
    }
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    return m1.peak_bytes - m0.live_bytes;
}

/* A layer norm's backward (jit/plan_nodes.c: need_value): the values its
 * three kernels share -- xhat in f32 and in f64, g*w, the incoming 2*y --
 * are computed again by each kernel from x, mean, rstd, w and y instead of
 * being stored, so the compiled backward holds no [N, C] temporary besides
 * the new .grads; the gradients stay eager's bit for bit. */
static void test_recompute_layer_norm(void **state) {
    (void)state;
    enum { N = 64, C = 96 };
    gj_dtype dts[2] = {GJ_F32, GJ_F64};
    for (int d = 0; d < 2; d++) {
        gjt_rng r;
        gjt_rng_seed(&r, 31 + (uint64_t)d);
        gj_tensor *x = gjt_uniform(&r, dts[d], 2, (int64_t[]){N, C}, -2, 2);
        gj_tensor *w = gjt_uniform(&r, dts[d], 1, (int64_t[]){C}, 0.5, 1.5);
        gj_tensor *b = gjt_uniform(&r, dts[d], 1, (int64_t[]){C}, -0.5, 0.5);
        assert_int_equal(gj_set_requires_grad(x, true), 0);
        assert_int_equal(gj_set_requires_grad(w, true), 0);
        assert_int_equal(gj_set_requires_grad(b, true), 0);
        int64_t n = (int64_t)N * C + 2 * C, el = dts[d] == GJ_F64 ? 8 : 4;
        double *ge = malloc((size_t)n * sizeof *ge), *gc = malloc((size_t)n * sizeof *gc);
        assert_true(ge && gc);
        ln_backward(x, w, b, false, ge);
        gj_ca_stats before = gjt_ca_now();
        ln_backward(x, w, b, true, gc); /* compiles */
        int64_t extra = ln_backward(x, w, b, true, gc); /* runs the cached program */
        gj_ca_stats after = gjt_ca_now();
        assert_true(gjt_ran_compiled("layer norm", &before, &after, 2));
        if (memcmp(gc, ge, (size_t)n * sizeof *gc) != 0) {
            int64_t worst;
            double diff = gjt_max_abs_diff(gc, ge, n, &worst);
            fail_msg("layer norm %s: compiled differs from eager (max |d| %g at %lld)",
                     dts[d] == GJ_F64 ? "f64" : "f32", diff, (long long)worst);
        }
        /* the new .grads, and per-row sums and means (f64 [N] each): no
         * [N, C] temporary (before: xhat in f32 and f64 and g*w, 16 or 24
         * bytes an element more) */
        int64_t grads = n * el;
        if (extra >= grads + (int64_t)N * C * el)
            fail_msg("%s: the compiled layer-norm backward held %lld bytes beyond its %lld "
                     "bytes of .grad", dts[d] == GJ_F64 ? "f64" : "f32",
                     (long long)(extra - grads), (long long)grads);
        free(ge);
        free(gc);
        gj_release(x);
        gj_release(w);
        gj_release(b);
    }
}

/* Softmax's backward, dx = y * (dy - sum(dy * y)): the row sums are made
 * in f64 and cast to f32, and the kernel that reads the cast computes it
 * again (need_value). The cast's own group is then left with nothing to
 * store and is not run at all (plan.c drops kernel steps without stores;
 * plan_kernel.c drops expressions and accesses no store depends on). Two
 * kernels are left: the f64 row sums and dx; the gradients stay eager's. */
static void test_recompute_leaves_no_empty_kernel(void **state) {
    (void)state;
    enum { N = 48, C = 80 };
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -3, 3);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1);
    assert_int_equal(gj_set_requires_grad(x, true), 0);
    double *g[2];
    for (int mode = 0; mode < 2; mode++) {
        gj_ca_stats before = gjt_ca_now();
        for (int rep = 0; rep < 1 + mode; rep++) { /* compiled: compile, then run it cached */
            gj_set_compiled_autograd(mode == 1);
            gj_scope_push();
            gj_tensor *loss = gj_sum(gj_mul(gj_softmax(x, 1), w), 0, NULL, false);
            assert_non_null(loss);
            assert_int_equal(gj_backward(loss, NULL), 0);
            g[mode] = gjt_values(gj_tensor_grad(x));
            gj_tensor_set_grad(x, NULL);
            gj_scope_pop();
            gj_set_compiled_autograd(false);
            if (rep + 1 < 1 + mode) free(g[mode]);
        }
        if (mode == 1) {
            gj_ca_stats after = gjt_ca_now();
            assert_true(gjt_ran_compiled("softmax", &before, &after, 2));
        }
    }
    gj_ca_program_info pi;
    assert_int_equal(gj_compiled_autograd_last_program(&pi), 0);
    if (pi.kernel_instrs != 2)
        fail_msg("softmax backward: %d kernel steps, expected 2 (row sums, dx)", pi.kernel_instrs);
    if (memcmp(g[0], g[1], (size_t)N * C * sizeof *g[0]) != 0) {
        int64_t worst;
        double diff = gjt_max_abs_diff(g[1], g[0], (int64_t)N * C, &worst);
        fail_msg("softmax: compiled differs from eager (max |d| %g at %lld)", diff,
                 (long long)worst);
    }
    free(g[0]);
    free(g[1]);
    gj_release(x);
    gj_release(w);
}

static void *no_program_thread(void *arg) {
    int *rc = arg;
    gj_ca_program_info pi;
    rc[0] = gj_compiled_autograd_last_program(&pi);
    rc[1] = strstr(gj_last_error(), "no compiled backward") != NULL;
    return NULL;
}

static void test_last_program_errors(void **state) {
    (void)state;
    int rc[2] = {0, 0};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, no_program_thread, rc), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(rc[0], -1);
    assert_true(rc[1]);
    assert_int_equal(gj_compiled_autograd_last_program(NULL), -1);
    assert_true(gjt_error_has("out is NULL"));
}

int main(void) {
    gjt_setup();
    gj_compiled_autograd_set_quiet(true);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_split_bit_exact),
        cmocka_unit_test(test_gemm_split_side),
        cmocka_unit_test(test_mlp_pairs_and_bit_exact),
        cmocka_unit_test(test_hook_between_gemms),
        cmocka_unit_test(test_last_program_errors),
        cmocka_unit_test(test_identical_layers_share_kernels),
        cmocka_unit_test(test_parallel_compile),
        cmocka_unit_test(test_recompute_layer_norm),
        cmocka_unit_test(test_recompute_leaves_no_empty_kernel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
