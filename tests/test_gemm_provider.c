/* SPDX-License-Identifier: MIT */
/*
 * test_gemm_provider.c - the GEMM providers behind gj_rt_sgemm and the
 * compiled program's blocks (runtime/gemm*.c, openblas.c, onednn.c):
 * OpenBLAS and oneDNN's matmul primitive, chosen per GEMM shape.
 *
 *   - Each provider (pinned) and the automatic choice agree with a naive
 *     f64 reference within an f32 error bound, on random shapes with every
 *     transpose, odd and padded sizes, beta 0 (C ignored, even NaN) and 1,
 *     alpha 1 and 1.5 (OpenBLAS's), on 1 and 2 threads.
 *   - The pinned setting is honoured (counted: blocks each provider
 *     computed); GRADJIT_GEMM is read (a child process); a bad value is an
 *     error.
 *   - Without oneDNN (simulated, or a build without libdnnl-dev) pinning
 *     oneDNN fails with a message and pins OpenBLAS, which gives the bits
 *     OpenBLAS gives pinned.
 *   - One provider and one shape give the same bits on every call, and the
 *     blocks run one by one (what the compiled program runs) give the bits
 *     of gj_rt_sgemm on the pool, for 1, 2 and 3 threads; oneDNN's bits do
 *     not depend on the thread count. (`--thread-bits` prints, per
 *     provider, how many elements change with the thread count.)
 *   - The automatic choice is measured once per GEMM shape (whatever the
 *     leading dimensions: a strided view and a dense copy of one GEMM take
 *     one provider, and each provider's bits do not depend on them), on a
 *     bounded sample of the GEMM, kept for every thread count, decided once
 *     when two threads meet a new shape at once, and read back from the
 *     cache directory by a fresh table (no new measurement); a damaged,
 *     group-writable or symlinked file is not used.
 *   - The default with a cache directory that cannot keep the choices (a
 *     plain file, a directory below a plain file, a world-writable
 *     directory): OpenBLAS, nothing measured, one warning naming the path.
 *   - GRADJIT_LOG=gemm (a child process) prints a shape once when it is
 *     decided: measured (also under the default setting with a cache
 *     directory) or read back from the directory; nothing without one.
 *   - oneDNN starts no threads of its own (OpenMP): the process has no more
 *     threads than gradjit's pool.
 *   - bf16 GEMMs (gj_rt_bgemm: bf16 operands, f32 result, beta 0 or 1):
 *     every provider agrees with the f64 reference of the bf16 values
 *     within an f32 accumulation bound; OpenBLAS pinned gives exactly the
 *     bits of sgemm on the operands widened to f32; the default sends bf16
 *     blocks to oneDNN exactly where the CPU has AVX512_BF16 (and oneDNN is
 *     there: without it, OpenBLAS's bits), and f32 blocks to OpenBLAS.
 *   - Signals: a timer signal every 200 us during GEMMs on the pool, its
 *     handler on the thread's own stack, leaves every provider's results
 *     (f32 and bf16) and the heap intact: oneDNN 2.x's generated GEMM
 *     kernels point rsp into the heap, so the provider blocks asynchronous
 *     signals while one runs (and gradjit's own threads block them always:
 *     the signal lands on this thread).
 *
 * `test_gemm_provider --paired N` prints instead the paired comparison of
 * docs/performance.md (OpenBLAS against oneDNN, both pinned, interleaved on
 * the pool, N pairs per shape) and the automatic choice per shape.
 */
#include "gjtest.h"
#include "runtime/gemm_int.h"

#include <pthread.h>

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *g_self = "test_gemm_provider";

/* ------------------------------------------------------------- helpers */

typedef struct gemm_case {
    bool ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    float alpha, beta;
    float *A, *B, *C0; /* inputs; C0: C before the call */
    size_t asz, bsz, csz;
} gemm_case;

static void case_make(gemm_case *g, gjt_rng *r, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                      int pad, float alpha, float beta) {
    memset(g, 0, sizeof *g);
    g->ta = ta, g->tb = tb, g->M = M, g->N = N, g->K = K, g->alpha = alpha, g->beta = beta;
    int64_t arows = ta ? K : M, acols = ta ? M : K, brows = tb ? N : K, bcols = tb ? K : N;
    g->lda = acols + pad, g->ldb = bcols + (pad ? 3 : 0), g->ldc = N + (pad ? 1 : 0);
    g->asz = (size_t)(arows * g->lda), g->bsz = (size_t)(brows * g->ldb);
    g->csz = (size_t)(M * g->ldc);
    g->A = malloc(g->asz * sizeof(float));
    g->B = malloc(g->bsz * sizeof(float));
    g->C0 = malloc(g->csz * sizeof(float));
    assert_non_null(g->A);
    assert_non_null(g->B);
    assert_non_null(g->C0);
    for (size_t i = 0; i < g->asz; i++) g->A[i] = (float)gjt_rng_uniform(r, -1, 1);
    for (size_t i = 0; i < g->bsz; i++) g->B[i] = (float)gjt_rng_uniform(r, -1, 1);
    for (size_t i = 0; i < g->csz; i++) g->C0[i] = beta == 0 ? NAN : (float)gjt_rng_uniform(r, -1, 1);
}

static void case_free(gemm_case *g) {
    free(g->A), free(g->B), free(g->C0);
}

static uint16_t to_bf16(float f) { /* round to nearest even (no NaNs here) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A bf16 case: g's operands rounded to bf16 (g->A/B then hold the widened
 * values, so the f32 helpers give its reference), Ah/Bh the bf16 arrays. */
static void case_bf16(gemm_case *g, uint16_t **Ah, uint16_t **Bh) {
    *Ah = malloc(g->asz * sizeof **Ah);
    *Bh = malloc(g->bsz * sizeof **Bh);
    assert_true(*Ah && *Bh);
    for (size_t i = 0; i < g->asz; i++) g->A[i] = from_bf16((*Ah)[i] = to_bf16(g->A[i]));
    for (size_t i = 0; i < g->bsz; i++) g->B[i] = from_bf16((*Bh)[i] = to_bf16(g->B[i]));
}

/* C = gj_rt_sgemm of the case (a new array, from C0). */
static float *case_run(const gemm_case *g) {
    float *C = malloc(g->csz * sizeof(float));
    assert_non_null(C);
    memcpy(C, g->C0, g->csz * sizeof(float));
    gj_rt_sgemm(g->ta, g->tb, g->M, g->N, g->K, g->alpha, g->A, g->lda, g->B, g->ldb, g->beta, C,
                g->ldc);
    return C;
}

/* The blocks of gj_rt_gemm_split_of on `threads` run one by one, last first
 * (the compiled program's path; any order). */
static float *case_run_blocks(const gemm_case *g, int threads) {
    float *C = malloc(g->csz * sizeof(float));
    assert_non_null(C);
    memcpy(C, g->C0, g->csz * sizeof(float));
    gj_rt_gemm_call c = {false, g->ta, g->tb, g->M, g->N, g->K, g->alpha, g->A, g->lda, g->B,
                         g->ldb, g->beta, C, g->ldc, false};
    gj_rt_gemm_split sp;
    gj_rt_gemm_split_of(g->ta, g->M, g->N, g->K, threads, &sp);
    for (int i = sp.parts - 1; i >= 0; i--) gj_rt_gemm_block(&c, &sp, i);
    return C;
}

/* The f64 reference of the case and its error bound per element:
 * 4 K u sum|a||b| + 2 u |ref| (u = 2^-24). */
static void case_ref(const gemm_case *g, double **ref, double **tol) {
    const double u = 1.0 / 16777216.0;
    *ref = malloc(g->csz * sizeof(double));
    *tol = malloc(g->csz * sizeof(double));
    assert_non_null(*ref);
    assert_non_null(*tol);
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->N; j++) {
            size_t at = (size_t)(i * g->ldc + j);
            double acc = 0, mag = 0;
            for (int64_t k = 0; k < g->K; k++) {
                double a = g->ta ? g->A[k * g->lda + i] : g->A[i * g->lda + k];
                double b = g->tb ? g->B[j * g->ldb + k] : g->B[k * g->ldb + j];
                acc += a * b;
                mag += fabs(a * b);
            }
            double want = g->alpha * acc + (g->beta == 0 ? 0.0 : g->beta * (double)g->C0[at]);
            (*ref)[at] = want;
            (*tol)[at] = 4.0 * (double)g->K * u * fabs(g->alpha) * mag + 2 * u * fabs(want) + 1e-30;
        }
}

/* Checks C against the reference, padding untouched. */
static void case_check(const gemm_case *g, const float *C, const double *ref, const double *tol,
                       const char *what) {
    for (int64_t i = 0; i < g->M; i++)
        for (int64_t j = 0; j < g->ldc; j++) {
            size_t at = (size_t)(i * g->ldc + j);
            if (j >= g->N) {
                if (memcmp(&C[at], &g->C0[at], sizeof(float)) != 0) {
                    print_error("%s: padding at [%lld,%lld] written\n", what, (long long)i,
                                (long long)j);
                    fail();
                }
                continue;
            }
            if (!(fabs((double)C[at] - ref[at]) <= tol[at])) {
                print_error("%s: %c%c M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld alpha=%g "
                            "beta=%g at [%lld,%lld]: %.9g, want %.9g (tol %.3g)\n",
                            what, g->ta ? 'T' : 'N', g->tb ? 'T' : 'N', (long long)g->M,
                            (long long)g->N, (long long)g->K, (long long)g->lda, (long long)g->ldb,
                            (long long)g->ldc, (double)g->alpha, (double)g->beta, (long long)i,
                            (long long)j, (double)C[at], ref[at], tol[at]);
                fail();
            }
        }
}

static bool same_bits(const float *a, const float *b, size_t n) {
    return memcmp(a, b, n * sizeof(float)) == 0;
}

static int64_t stat_dnnl(void) {
    gj_rt_gemm_stats s;
    gj_rt_gemm_get_stats(&s);
    return s.onednn_blocks;
}

static int64_t stat_blas(void) {
    gj_rt_gemm_stats s;
    gj_rt_gemm_get_stats(&s);
    return s.openblas_blocks;
}

/* The providers a test runs: OpenBLAS, oneDNN (when available), auto. */
static int providers(int *out) {
    int n = 0;
    out[n++] = GJ_RT_GEMM_OPENBLAS;
    if (gj_rt_onednn_available()) out[n++] = GJ_RT_GEMM_ONEDNN;
    out[n++] = GJ_RT_GEMM_AUTO;
    return n;
}

static int g_threads0;

static int group_setup(void **state) {
    (void)state;
    g_threads0 = gj_rt_num_threads();
    gj_rt_gemm_set_cache_dir(""); /* the suites' own file tests set their own */
    return 0;
}

static int restore(void **state) {
    (void)state;
    gj_rt_set_num_threads(g_threads0);
    gj_rt_gemm_simulate_no_onednn(false);
    gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO);
    gj_rt_gemm_set_cache_dir("");
    return 0;
}

/* ----------------------------------------------------------- the tests */

/* Case s of a suite's random shapes: every third small (sizes up to 40),
 * the others up to 300 x 300 with K up to kmax; transposes and beta from
 * the bits of s; padded leading dimensions for s % 5 == 1; alpha 1.5 for
 * s % 7 == 3 when alpha_varies. */
static void case_random(gemm_case *g, gjt_rng *r, int s, int64_t kmax, bool alpha_varies) {
    bool big = s % 3 != 0;
    int64_t M = 1 + gjt_rng_int(r, big ? 300 : 40), N = 1 + gjt_rng_int(r, big ? 300 : 40);
    int64_t K = 1 + gjt_rng_int(r, big ? kmax : 40);
    float beta = (s >> 2) & 1 ? 1.0f : 0.0f, alpha = alpha_varies && s % 7 == 3 ? 1.5f : 1.0f;
    case_make(g, r, s & 1, (s >> 1) & 1, M, N, K, s % 5 == 1 ? 2 : 0, alpha, beta);
}

static void test_reference(void **state) {
    (void)state;
    assert_int_equal(gj_rt_openblas_init(), 0);
    int prov[3], np = providers(prov);
    gjt_rng r;
    gjt_rng_seed(&r, 31);
    for (int t = 1; t <= 2; t++) {
        gj_rt_set_num_threads(t);
        for (int s = 0; s < 24; s++) {
            gemm_case g;
            case_random(&g, &r, s, 200, true);
            float alpha = g.alpha;
            double *ref, *tol;
            case_ref(&g, &ref, &tol);
            for (int p = 0; p < np; p++) {
                assert_int_equal(gj_rt_set_gemm_provider(prov[p]), 0);
                int64_t d0 = stat_dnnl();
                float *C = case_run(&g);
                char what[64];
                snprintf(what, sizeof what, "%s, %d thread(s)", gj_rt_gemm_provider_name(prov[p]), t);
                case_check(&g, C, ref, tol, what);
                if (prov[p] == GJ_RT_GEMM_OPENBLAS || alpha != 1.0f)
                    assert_int_equal(stat_dnnl(), d0); /* OpenBLAS's */
                else if (prov[p] == GJ_RT_GEMM_ONEDNN)
                    assert_true(stat_dnnl() > d0);
                free(C);
            }
            free(ref), free(tol);
            case_free(&g);
        }
    }
}

/* The pinned setting decides who computes each block. */
static void test_pinned(void **state) {
    (void)state;
    gjt_rng r;
    gjt_rng_seed(&r, 7);
    gemm_case g;
    case_make(&g, &r, false, true, 96, 130, 70, 0, 1.0f, 0.0f);
    for (int t = 1; t <= 2; t++) {
        gj_rt_set_num_threads(t);
        assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_OPENBLAS), 0);
        assert_int_equal(gj_rt_gemm_provider_setting(), GJ_RT_GEMM_OPENBLAS);
        int64_t d0 = stat_dnnl(), b0 = stat_blas();
        free(case_run(&g));
        assert_int_equal(stat_dnnl(), d0);
        assert_true(stat_blas() > b0);
        if (gj_rt_onednn_available()) {
            assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_ONEDNN), 0);
            d0 = stat_dnnl(), b0 = stat_blas();
            free(case_run(&g));
            assert_true(stat_dnnl() > d0);
            assert_int_equal(stat_blas(), b0);
        }
    }
    /* not a provider: an error, the setting kept */
    gj_clear_error();
    assert_int_equal(gj_rt_set_gemm_provider(7), -1);
    assert_true(gjt_error_has("not a provider"));
    assert_int_equal(gj_rt_gemm_provider_setting(),
                     gj_rt_onednn_available() ? GJ_RT_GEMM_ONEDNN : GJ_RT_GEMM_OPENBLAS);
    assert_string_equal(gj_rt_gemm_provider_name(GJ_RT_GEMM_AUTO), "auto");
    case_free(&g);
}

/* GRADJIT_GEMM in a new process: the child prints the setting. */
static void child_setting(const char *value, char *out, size_t cap) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        if (value) setenv("GRADJIT_GEMM", value, 1);
        else unsetenv("GRADJIT_GEMM");
        execl(g_self, g_self, "--child-setting", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t k;
    while (n + 1 < cap && (k = read(fds[0], out + n, cap - 1 - n)) > 0) n += (size_t)k;
    out[n] = '\0';
    close(fds[0]);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void test_env(void **state) {
    (void)state;
    char out[512];
    child_setting(NULL, out, sizeof out);
    assert_non_null(strstr(out, "setting default"));
    child_setting("Default", out, sizeof out);
    assert_non_null(strstr(out, "setting default"));
    child_setting("OpenBLAS", out, sizeof out);
    assert_non_null(strstr(out, "setting openblas"));
    child_setting("auto", out, sizeof out);
    assert_non_null(strstr(out, "setting auto"));
    child_setting("mkl", out, sizeof out);
    assert_non_null(strstr(out, "GRADJIT_GEMM='mkl' is not default, openblas, onednn or auto"));
    assert_non_null(strstr(out, "setting default"));
    child_setting("onednn", out, sizeof out);
    if (gj_rt_onednn_available()) {
        assert_non_null(strstr(out, "setting onednn"));
    } else { /* pinned to OpenBLAS, with one line saying why */
        assert_non_null(strstr(out, "GRADJIT_GEMM=onednn"));
        assert_non_null(strstr(out, "setting openblas"));
    }
}

/* Without oneDNN: pinning it fails cleanly and OpenBLAS computes all. */
static void test_without_onednn(void **state) {
    (void)state;
    gjt_rng r;
    gjt_rng_seed(&r, 11);
    gemm_case g;
    case_make(&g, &r, true, false, 120, 200, 90, 0, 1.0f, 1.0f);
    gj_rt_set_num_threads(2);
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_OPENBLAS), 0);
    float *ref = case_run(&g);
    gj_rt_gemm_simulate_no_onednn(true);
    assert_false(gj_rt_onednn_available());
    assert_string_equal(gj_rt_onednn_version(), "unavailable");
    gj_clear_error();
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_ONEDNN), -1);
    assert_true(gjt_error_has("onednn"));
    assert_true(gjt_error_has("OpenBLAS computes every GEMM"));
    assert_int_equal(gj_rt_gemm_provider_setting(), GJ_RT_GEMM_OPENBLAS);
    for (int pass = 0; pass < 2; pass++) { /* pinned OpenBLAS, then auto */
        int64_t d0 = stat_dnnl();
        float *C = case_run(&g);
        assert_int_equal(stat_dnnl(), d0);
        assert_true(same_bits(C, ref, g.csz));
        free(C);
        assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO), 0);
    }
    gj_rt_gemm_simulate_no_onednn(false);
    free(ref);
    case_free(&g);
}

/* Same bits on every call; the blocks one by one give the pool's bits. */
static void test_deterministic(void **state) {
    (void)state;
    int prov[3], np = providers(prov);
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    const int64_t shapes[][5] = {/* ta tb M N K */
                                 {0, 0, 256, 384, 384}, {0, 1, 128, 512, 256}, {1, 0, 384, 384, 256},
                                 {1, 1, 97, 211, 133},  {0, 0, 256, 10, 128}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        gemm_case g;
        case_make(&g, &r, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], shapes[s][4], 0,
                  1.0f, s % 2 ? 1.0f : 0.0f);
        for (int p = 0; p < np; p++) {
            assert_int_equal(gj_rt_set_gemm_provider(prov[p]), 0);
            float *first = NULL;
            for (int t = 1; t <= 3; t++) {
                gj_rt_set_num_threads(t);
                float *C1 = case_run(&g), *C2 = case_run(&g), *C3 = case_run_blocks(&g, t);
                /* oneDNN (gemm:jit for every block): the thread count does not
                 * change the bits either (OpenBLAS's can: runtime/blas.c) */
                if (!first) {
                    first = malloc(g.csz * sizeof(float));
                    assert_non_null(first);
                    memcpy(first, C1, g.csz * sizeof(float));
                } else if (prov[p] == GJ_RT_GEMM_ONEDNN && !same_bits(first, C1, g.csz)) {
                    print_error("onednn, shape %zu: %d threads differ from 1\n", s, t);
                    fail();
                }
                if (!same_bits(C1, C2, g.csz) || !same_bits(C1, C3, g.csz)) {
                    print_error("%s, %d threads, shape %zu: calls differ (repeat %d, blocks %d)\n",
                                gj_rt_gemm_provider_name(prov[p]), t, s,
                                !same_bits(C1, C2, g.csz), !same_bits(C1, C3, g.csz));
                    fail();
                }
                free(C1), free(C2), free(C3);
            }
            free(first);
        }
        case_free(&g);
    }
}

/* Auto: one measurement per GEMM shape, the choice kept at every thread
 * count and for every leading dimension; a thread count gives the bits of
 * the first run at that count, and oneDNN's bits do not depend on it. */
static void test_auto_once(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    gj_rt_gemm_provider_reset();
    gj_rt_set_num_threads(2);
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO), 0);
    gjt_rng r;
    gjt_rng_seed(&r, 9);
    gemm_case g;
    case_make(&g, &r, false, false, 128, 512, 256, 0, 1.0f, 0.0f);
    float *C1 = case_run(&g);
    gj_rt_gemm_stats s1, s2;
    gj_rt_gemm_get_stats(&s1);
    assert_int_equal(s1.measured, 1); /* one GEMM, measured on a sample of one block */
    int choice = gj_rt_gemm_choice(false, false, 128, 512, 256, false, false);
    assert_true(choice == 1 || choice == 2);
    /* other thread counts keep the choice: no new measurement; each count's
     * bits are its own run after run (OpenBLAS's may differ between counts:
     * its blocks round differently), and oneDNN's are the first run's */
    for (int t = 1; t <= 3; t++) {
        gj_rt_set_num_threads(t);
        float *C = case_run(&g), *Cb = case_run_blocks(&g, t), *Cc = case_run(&g);
        assert_true(same_bits(C, Cb, g.csz));
        assert_true(same_bits(C, Cc, g.csz));
        if (choice == 2) assert_true(same_bits(C, C1, g.csz));
        free(C), free(Cb), free(Cc);
    }
    /* the same shape on padded (strided) operands: the same decision */
    gemm_case gp;
    gjt_rng_seed(&r, 9);
    case_make(&gp, &r, false, false, 128, 512, 256, 2, 1.0f, 0.0f);
    gj_rt_set_num_threads(2);
    free(case_run(&gp));
    gj_rt_gemm_get_stats(&s2);
    assert_int_equal(s2.measured, 1);
    assert_int_equal(gj_rt_gemm_choice(false, false, 128, 512, 256, false, false), choice);
    free(C1);
    case_free(&gp);
    case_free(&g);
}

/* The bits of a GEMM do not depend on its operands' leading dimensions,
 * for either provider pinned: eager may multiply a strided view where a
 * compiled program multiplies a dense copy of it, and the choice per shape
 * gives both one provider, so both must give one result. */
static void test_leading_dims(void **state) {
    (void)state;
    int prov[3], np = providers(prov);
    const int64_t shapes[][5] = {/* ta tb M N K */
                                 {0, 0, 128, 64, 128}, {0, 1, 128, 128, 64}, {1, 0, 64, 128, 128},
                                 {1, 1, 97, 211, 133}, {0, 0, 256, 10, 128}, {0, 1, 512, 768, 256}};
    for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
        for (int p = 0; p < np; p++) {
            if (prov[p] == GJ_RT_GEMM_AUTO) continue;
            assert_int_equal(gj_rt_set_gemm_provider(prov[p]), 0);
            for (int t = 1; t <= 2; t++) {
                gj_rt_set_num_threads(t);
                gjt_rng r;
                gjt_rng_seed(&r, 31 + sh);
                gemm_case dense, padded;
                case_make(&dense, &r, shapes[sh][0], shapes[sh][1], shapes[sh][2], shapes[sh][3],
                          shapes[sh][4], 0, 1.0f, 0.0f);
                gjt_rng_seed(&r, 31 + sh);
                case_make(&padded, &r, shapes[sh][0], shapes[sh][1], shapes[sh][2],
                          shapes[sh][3], shapes[sh][4], 5, 1.0f, 0.0f);
                /* the padded case holds the dense case's values */
                int64_t ar = dense.ta ? dense.K : dense.M, ac = dense.ta ? dense.M : dense.K;
                int64_t br = dense.tb ? dense.N : dense.K, bc = dense.tb ? dense.K : dense.N;
                for (int64_t i = 0; i < ar; i++)
                    memcpy(padded.A + i * padded.lda, dense.A + i * dense.lda, (size_t)ac * 4);
                for (int64_t i = 0; i < br; i++)
                    memcpy(padded.B + i * padded.ldb, dense.B + i * dense.ldb, (size_t)bc * 4);
                float *Cd = case_run(&dense), *Cp = case_run(&padded);
                for (int64_t i = 0; i < dense.M; i++)
                    if (memcmp(Cd + i * dense.ldc, Cp + i * padded.ldc, (size_t)dense.N * 4) != 0) {
                        print_error("%s, %d threads, shape %zu: row %lld differs with padded "
                                    "operands\n", gj_rt_gemm_provider_name(prov[p]), t, sh,
                                    (long long)i);
                        fail();
                    }
                free(Cd), free(Cp);
                case_free(&dense), case_free(&padded);
            }
        }
}

/* Two threads meeting a new shape at once: one decision, both wait for it
 * and compute the same bits. */
typedef struct race_arg {
    const gemm_case *g;
    pthread_barrier_t *bar;
    float *C;
} race_arg;

static void *race_run(void *v) {
    race_arg *a = v;
    pthread_barrier_wait(a->bar);
    a->C = case_run(a->g);
    return NULL;
}

static void test_concurrent_first_calls(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    gj_rt_set_num_threads(1); /* each caller computes its GEMM itself */
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO), 0);
    for (int round = 0; round < 4; round++) {
        gj_rt_gemm_provider_reset();
        gjt_rng r;
        gjt_rng_seed(&r, 41 + round);
        gemm_case g;
        case_make(&g, &r, round & 1, round >> 1, 192, 160, 144, 0, 1.0f, 0.0f);
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, 2);
        race_arg a[2] = {{&g, &bar, NULL}, {&g, &bar, NULL}};
        pthread_t th[2];
        for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, race_run, &a[i]), 0);
        for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
        pthread_barrier_destroy(&bar);
        gj_rt_gemm_stats s;
        gj_rt_gemm_get_stats(&s);
        assert_int_equal(s.measured, 1);
        assert_int_equal(s.entries, 1);
        assert_true(same_bits(a[0].C, a[1].C, g.csz));
        free(a[0].C), free(a[1].C);
        case_free(&g);
    }
}

/* A decision times a bounded sample, however large the GEMM. */
static void test_sample_bounded(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    gj_rt_gemm_provider_reset();
    gj_rt_set_num_threads(2);
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO), 0);
    gjt_rng r;
    gjt_rng_seed(&r, 43);
    const int64_t shapes[][5] = {{0, 1, 256, 8192, 384}, {1, 0, 2048, 768, 512}, {0, 0, 64, 96, 80}};
    for (size_t k = 0; k < 3; k++) {
        gemm_case g;
        case_make(&g, &r, shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3], shapes[k][4], 0,
                  1.0f, 0.0f);
        double *ref, *tol;
        case_ref(&g, &ref, &tol);
        float *C = case_run(&g);
        case_check(&g, C, ref, tol, "auto, sampled decision");
        free(C), free(ref), free(tol);
        case_free(&g);
    }
    gj_rt_gemm_stats s;
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.measured, 3);
    /* the two large GEMMs (0.8 and 0.8 G multiply-adds) timed on samples of at
     * most 2^26; the small one whole */
    assert_true(s.sample_macs > 0);
    assert_true(s.sample_macs <= ((int64_t)1 << 26));
}

/* The default with a cache directory that cannot keep choices: in a child
 * process (the setting and the directory are read once), OpenBLAS for f32,
 * nothing measured, and one warning naming the path and why. */
static int child_default_gemm(void) {
    gjt_rng r;
    gjt_rng_seed(&r, 47);
    for (int k = 0; k < 3; k++) {
        gemm_case g;
        case_make(&g, &r, false, k == 1, 256, 384 + 16 * k, 384, 0, 1.0f, 0.0f);
        free(case_run(&g));
        case_free(&g);
    }
    gj_rt_gemm_stats s;
    gj_rt_gemm_get_stats(&s);
    printf("setting %s measured %lld onednn %lld openblas %lld\n",
           gj_rt_gemm_provider_name(gj_rt_gemm_provider_setting()), (long long)s.measured,
           (long long)s.onednn_blocks, (long long)s.openblas_blocks);
    return 0;
}

static void test_default_unusable_dir(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    char dir[] = "/tmp/gj-gemm-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char file[600], below[700], open_dir_[600], good[600], env[4][800];
    snprintf(file, sizeof file, "%s/plain", dir);
    snprintf(below, sizeof below, "%s/plain/sub", dir);
    snprintf(open_dir_, sizeof open_dir_, "%s/shared", dir);
    snprintf(good, sizeof good, "%s/good", dir);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fclose(f);
    assert_int_equal(mkdir(open_dir_, 0700), 0);
    assert_int_equal(chmod(open_dir_, 0777), 0);
    const char *paths[] = {file, below, open_dir_, good};
    const char *whys[] = {"not a directory", "not a directory", "writable by group or others", NULL};
    for (int k = 0; k < 4; k++) {
        snprintf(env[k], sizeof env[k], "GRADJIT_CACHE_DIR=%s", paths[k]);
        const char *e[] = {env[k], "GRADJIT_GEMM", "GRADJIT_NUM_THREADS=2", NULL};
        char *out = NULL, *err = NULL;
        int st = gjt_run_self(g_self, "--child-default-gemm", e, &out, &err);
        assert_int_equal(st, 0);
        if (whys[k]) {
            bool ok = strstr(out, "setting default measured 0 onednn 0") && strstr(err, paths[k]) &&
                      strstr(err, whys[k]) && strstr(err, "f32 GEMMs use OpenBLAS");
            int lines = 0;
            for (const char *c = err; (c = strstr(c, "cannot keep GEMM choices")); c++) lines++;
            if (!ok || lines != 1)
                print_error("%s: stdout: %s\nstderr: %s\n", paths[k], out, err);
            assert_true(ok);
            assert_int_equal(lines, 1);
        } else { /* a usable directory: measured, and no warning */
            if (!strstr(out, "setting default measured 3") || strstr(err, "cannot keep"))
                print_error("%s: stdout: %s\nstderr: %s\n", paths[k], out, err);
            assert_non_null(strstr(out, "setting default measured 3"));
            assert_null(strstr(err, "cannot keep"));
        }
        free(out), free(err);
    }
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* Removes test directory dir and the files in it (asserts it is gone). */
static void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    assert_int_equal(rmdir(dir), 0);
}

/* The choices file: written, read back, distrusted. */
static void test_file(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    char dir[] = "/tmp/gj-gemm-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_rt_gemm_set_cache_dir(dir);
    gj_rt_gemm_provider_reset();
    gj_rt_set_num_threads(1);
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO), 0);
    gjt_rng r;
    gjt_rng_seed(&r, 13);
    gemm_case g;
    case_make(&g, &r, true, false, 200, 150, 100, 0, 1.0f, 0.0f);
    free(case_run(&g));
    gj_rt_gemm_stats s;
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.measured, 1);
    int choice = gj_rt_gemm_choice(true, false, 200, 150, 100, false, false);
    /* one file, ours, 0600 */
    char path[512] = "";
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int files = 0;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        files++;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    }
    closedir(d);
    assert_int_equal(files, 1);
    assert_non_null(strstr(path, "/gemm-"));
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    /* a fresh table reads it: no measurement, the same choice */
    gj_rt_gemm_provider_reset();
    free(case_run(&g));
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.measured, 0);
    assert_int_equal(s.loaded, 1);
    assert_int_equal(gj_rt_gemm_choice(true, false, 200, 150, 100, false, false), choice);
    /* group-writable: not used (measured again; the save replaces it) */
    assert_int_equal(chmod(path, 0620), 0);
    gj_rt_gemm_provider_reset();
    free(case_run(&g));
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.loaded, 0);
    assert_int_equal(s.measured, 1);
    assert_int_equal(chmod(path, 0600), 0);
    /* damaged (a flipped byte in the middle): not used, then rewritten */
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, 40, SEEK_SET), 0);
    int c = fgetc(f);
    assert_int_equal(fseek(f, 40, SEEK_SET), 0);
    fputc(c ^ 0x20, f);
    fclose(f);
    gj_rt_gemm_provider_reset();
    free(case_run(&g));
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.loaded, 0);
    assert_int_equal(s.measured, 1);
    gj_rt_gemm_provider_reset();
    free(case_run(&g));
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.loaded, 1); /* the rewritten file */
    /* a symlink in its place: not followed */
    char moved[600];
    snprintf(moved, sizeof moved, "%s/real", dir);
    assert_int_equal(rename(path, moved), 0);
    assert_int_equal(symlink(moved, path), 0);
    gj_rt_gemm_provider_reset();
    free(case_run(&g));
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.loaded, 0);
    unlink(path);
    unlink(moved);
    remove_dir(dir); /* whatever the last save left */
    gj_rt_gemm_set_cache_dir("");
    gj_rt_gemm_provider_reset();
    case_free(&g);
}

/* The default's f32 rule: with a directory to keep the choices in, an f32
 * GEMM is measured once as auto would (its choice kept; the next process,
 * here a fresh table, reads it and computes the same bits); with none
 * (GRADJIT_CACHE_DIR=off) it stays OpenBLAS's, unmeasured. */
static void test_default_f32_rule(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    char dir[] = "/tmp/gj-gemm-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_rt_set_num_threads(1);
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_DEFAULT), 0);
    gjt_rng r;
    gjt_rng_seed(&r, 29);
    gemm_case g;
    case_make(&g, &r, false, true, 256, 384, 384, 0, 1.0f, 0.0f);
    gj_rt_gemm_stats s;
    /* nowhere to keep a choice: OpenBLAS, nothing measured */
    gj_rt_gemm_set_cache_dir("");
    gj_rt_gemm_provider_reset();
    float *C0 = case_run(&g);
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.measured, 0);
    assert_int_equal(s.onednn_blocks, 0);
    /* a directory: measured once, kept */
    gj_rt_gemm_set_cache_dir(dir);
    gj_rt_gemm_provider_reset();
    float *C1 = case_run(&g);
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.measured, 1);
    int choice = gj_rt_gemm_choice(false, true, 256, 384, 384, false, false);
    assert_true(choice == 1 || choice == 2); /* (openblas or onednn, as measured) */
    if (s.onednn_blocks == 0) assert_true(same_bits(C0, C1, g.csz)); /* OpenBLAS won */
    /* the next process (a fresh table) takes the kept choice: the same bits */
    gj_rt_gemm_provider_reset();
    float *C2 = case_run(&g);
    gj_rt_gemm_get_stats(&s);
    assert_int_equal(s.measured, 0);
    assert_int_equal(s.loaded, 1);
    assert_true(same_bits(C1, C2, g.csz));
    free(C0);
    free(C1);
    free(C2);
    remove_dir(dir);
    gj_rt_gemm_set_cache_dir("");
    gj_rt_gemm_provider_reset();
    case_free(&g);
}

/* GRADJIT_LOG=gemm in a new process under the default setting, with the
 * cache directory cache ("off": none): the child computes one f32 GEMM
 * (--child-gemm-log) and *out receives its stderr. */
static void child_gemm_log(const char *cache, char *out, size_t cap) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        unsetenv("GRADJIT_GEMM");
        setenv("GRADJIT_LOG", "gemm", 1);
        setenv("GRADJIT_CACHE_DIR", cache, 1);
        execl(g_self, g_self, "--child-gemm-log", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t k;
    while (n + 1 < cap && (k = read(fds[0], out + n, cap - 1 - n)) > 0) n += (size_t)k;
    out[n] = '\0';
    close(fds[0]);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* GRADJIT_LOG=gemm prints a shape's provider once when it is decided: when
 * it is measured, under the default setting too (with a cache directory),
 * not only with GRADJIT_GEMM=auto; when it is read back from the directory,
 * saying so; the default without a directory (OpenBLAS, unmeasured) prints
 * nothing. */
static void test_log_default(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    char dir[] = "/tmp/gj-gemm-XXXXXX", out[4096];
    assert_non_null(mkdtemp(dir));
    child_gemm_log(dir, out, sizeof out); /* measured: one line */
    fprintf(stderr, "%s", out);
    assert_non_null(strstr(out, "[gradjit gemm] NT M=256 N=384 K=384 beta=0: "));
    assert_null(strstr(strstr(out, "[gradjit gemm]") + 1, "[gradjit gemm]"));
    assert_non_null(strstr(out, "measured now"));
    child_gemm_log(dir, out, sizeof out); /* read back from the directory: said so */
    assert_non_null(strstr(out, "[gradjit gemm] NT M=256 N=384 K=384 beta=0: "));
    assert_non_null(strstr(out, "from the cache directory"));
    assert_null(strstr(strstr(out, "[gradjit gemm]") + 1, "[gradjit gemm]"));
    child_gemm_log("off", out, sizeof out); /* no directory: OpenBLAS, unmeasured */
    assert_null(strstr(out, "[gradjit gemm]"));
    remove_dir(dir);
}

static int count_threads(void) {
    int tasks = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) tasks += de->d_name[0] != '.';
    closedir(d);
    return tasks;
}

/* No OpenMP threads: oneDNN's GEMMs leave the process with the threads it
 * had (the pool's, and a sanitizer's own), on 2 and 3 threads. */
static void test_no_extra_threads(void **state) {
    (void)state;
    if (!gj_rt_onednn_available()) skip();
    gjt_rng r;
    gjt_rng_seed(&r, 17);
    gemm_case g;
    case_make(&g, &r, false, false, 256, 384, 384, 0, 1.0f, 0.0f);
    for (int t = 2; t <= 3; t++) {
        gj_rt_set_num_threads(t);
        assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_OPENBLAS), 0);
        free(case_run(&g)); /* the pool runs with t threads */
        int before = count_threads();
        if (before < 0) skip();
        assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_ONEDNN), 0);
        int64_t d0 = stat_dnnl();
        for (int i = 0; i < 3; i++) free(case_run(&g));
        assert_true(stat_dnnl() >= d0 + 3 * 2);
        int after = count_threads();
        if (after != before) {
            print_error("%d threads before oneDNN's GEMMs, %d after (pool of %d)\n", before, after,
                        t);
            fail();
        }
    }
    case_free(&g);
}


/* -------------------------------------------------- --paired: the table */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The ABBA loop of the paired modes: after 3 warm-up pairs, `pairs` pairs
 * of run(ctx, 0) and run(ctx, 1), the order alternating; t0, t1 and
 * ratio (t0 / t1 per pair) come back sorted. */
typedef struct pair_ctx {
    const gemm_case *g;
    const uint16_t *Ah, *Bh; /* --paired-bf16 */
    float *C;
} pair_ctx;

static void interleave(int pairs, void (*run)(const pair_ctx *, int), const pair_ctx *x,
                       double *t0, double *t1, double *ratio) {
    for (int i = -3; i < pairs; i++)
        for (int w = 0; w < 2; w++) {
            int side = (w == 0) == (i % 2 != 0);
            double s = now_s();
            run(x, side);
            double dt = now_s() - s;
            if (i >= 0) (side ? t1 : t0)[i] = dt;
        }
    for (int i = 0; i < pairs; i++) ratio[i] = t0[i] / t1[i];
    qsort(t0, (size_t)pairs, sizeof(double), cmp_d);
    qsort(t1, (size_t)pairs, sizeof(double), cmp_d);
    qsort(ratio, (size_t)pairs, sizeof(double), cmp_d);
}

/* --paired: side 0 OpenBLAS, side 1 oneDNN, both pinned. */
static void run_providers(const pair_ctx *x, int side) {
    const gemm_case *g = x->g;
    gj_rt_set_gemm_provider(side ? GJ_RT_GEMM_ONEDNN : GJ_RT_GEMM_OPENBLAS);
    gj_rt_sgemm(g->ta, g->tb, g->M, g->N, g->K, 1.0f, g->A, g->lda, g->B, g->ldb, 0.0f, x->C,
                g->ldc);
}

/* --paired-bf16: side 0 f32 OpenBLAS, side 1 bf16 with the default setting. */
static void run_bf16(const pair_ctx *x, int side) {
    const gemm_case *g = x->g;
    if (side) {
        gj_rt_set_gemm_provider(GJ_RT_GEMM_DEFAULT);
        gj_rt_bgemm(g->ta, g->tb, g->M, g->N, g->K, x->Ah, g->lda, x->Bh, g->ldb, 0.0f, x->C,
                    g->ldc);
    } else {
        run_providers(x, 0);
    }
}

static int paired(int pairs) {
    /* ta tb M N K: the GPT-2 d6 layers at B=4, T=64 (forward NN, dX NT,
     * dW TN), GPT-2's 768x3072 MLP layer, the Fashion MLP's three layers */
    const int64_t L[][2] = {{384, 1152}, {384, 384}, {384, 1536}, {1536, 384}, {768, 3072},
                            {784, 512},  {512, 256}, {256, 10}};
    const int64_t rows[] = {256, 256, 256, 256, 256, 128, 128, 128};
    if (!gj_rt_onednn_available()) {
        printf("oneDNN is not available: nothing to compare\n");
        return 0;
    }
    gj_rt_gemm_set_cache_dir("");
    gj_info info;
    gj_get_info(&info);
    printf("threads %d, OpenBLAS %s, oneDNN %s, %d pairs per shape\n", gj_rt_num_threads(),
           info.blas_core, gj_rt_onednn_version(), pairs);
    printf("%-4s %5s %5s %5s | %9s %9s | %6s %13s | %s\n", "form", "M", "N", "K", "openblas",
           "onednn", "ratio", "IQR", "auto picks");
    gjt_rng r;
    gjt_rng_seed(&r, 1);
    double lsum = 0;
    int nsh = 0;
    for (size_t l = 0; l < sizeof rows / sizeof rows[0]; l++)
        for (int form = 0; form < 3; form++) {
            int64_t T = rows[l], in = L[l][0], out = L[l][1], M, N, K;
            bool ta = false, tb = false;
            if (form == 0) M = T, K = in, N = out;                  /* y = x W */
            else if (form == 1) M = T, K = out, N = in, tb = true;  /* dx = dy W^T */
            else M = in, K = T, N = out, ta = true;                 /* dW = x^T dy */
            gemm_case g;
            case_make(&g, &r, ta, tb, M, N, K, 0, 1.0f, 0.0f);
            float *C = malloc(g.csz * sizeof(float));
            double *tb_ = malloc((size_t)pairs * sizeof(double)), *td = malloc((size_t)pairs * sizeof(double));
            double *ratio = malloc((size_t)pairs * sizeof(double));
            assert_true(C && tb_ && td && ratio);
            pair_ctx px = {&g, NULL, NULL, C};
            interleave(pairs, run_providers, &px, tb_, td, ratio);
            double fl = 2.0 * (double)M * (double)N * (double)K;
            /* the automatic choice for this GEMM's blocks */
            gj_rt_set_gemm_provider(GJ_RT_GEMM_AUTO);
            gj_rt_sgemm(ta, tb, M, N, K, 1.0f, g.A, g.lda, g.B, g.ldb, 0.0f, C, g.ldc);
            gj_rt_gemm_split sp;
            gj_rt_gemm_split_of(ta, M, N, K, gj_rt_num_threads(), &sp);
            int ch = gj_rt_gemm_choice(ta, tb, M, N, K, false, false);
            const char *pick = ch == 2 ? "onednn" : ch == 1 ? "openblas" : "openblas (small)";
            printf("%s%s   %5lld %5lld %5lld | %9.1f %9.1f | %6.3f [%5.3f,%5.3f] | %s (%d %s blocks)\n",
                   ta ? "T" : "N", tb ? "T" : "N", (long long)M, (long long)N, (long long)K,
                   fl / tb_[pairs / 2] * 1e-9, fl / td[pairs / 2] * 1e-9, ratio[pairs / 2],
                   ratio[pairs / 4], ratio[(3 * pairs) / 4], pick, sp.parts,
                   sp.by_rows ? "row" : "column");
            fflush(stdout);
            lsum += log(ratio[pairs / 2]);
            nsh++;
            free(C), free(tb_), free(td), free(ratio);
            case_free(&g);
        }
    printf("geometric mean of the median ratios (openblas time / onednn time): %.3f\n",
           exp(lsum / nsh));
    return 0;
}

/* `--paired-bf16 N`: the bf16 GEMM of each shape (gj_rt_bgemm with the
 * default setting: oneDNN where the CPU has AVX512_BF16) against the f32
 * GEMM of the same shape with OpenBLAS pinned, interleaved on the pool; and
 * the oneDNN implementation each bf16 block got. */
static int paired_bf16(int pairs) {
    const int64_t L[][2] = {{384, 1152}, {384, 384}, {384, 1536}, {1536, 384}, {384, 50304},
                            {768, 3072}, {768, 50304}, {784, 512}, {512, 256}, {256, 10}};
    const int64_t rows[] = {256, 256, 256, 256, 256, 256, 256, 128, 128, 128};
    gj_rt_gemm_set_cache_dir("");
    gj_info info;
    gj_get_info(&info);
    printf("threads %d, OpenBLAS %s, oneDNN %s, AVX512_BF16 %s, %d pairs per shape\n",
           gj_rt_num_threads(), info.blas_core, gj_rt_onednn_version(),
           gj_rt_cpu_native_bf16() ? "yes" : "no", pairs);
    printf("%-4s %5s %5s %5s | %12s %12s | %6s %13s\n", "form", "M", "N", "K", "f32 openblas",
           "bf16 default", "ratio", "IQR");
    gjt_rng r;
    gjt_rng_seed(&r, 1);
    double lsum = 0;
    int nsh = 0;
    for (size_t l = 0; l < sizeof rows / sizeof rows[0]; l++)
        for (int form = 0; form < 3; form++) {
            int64_t T = rows[l], in = L[l][0], out = L[l][1], M, N, K;
            bool ta = false, tb = false;
            if (form == 0) M = T, K = in, N = out, tb = out > 20000; /* the tied head: x wte^T */
            else if (form == 1) M = T, K = out, N = in, tb = out <= 20000; /* dx = dy W^T */
            else M = in, K = T, N = out, ta = true;                        /* dW = x^T dy */
            if (form == 2 && out > 20000) M = out, N = in; /* the head's dW: dy^T x */
            gemm_case g;
            case_make(&g, &r, ta, tb, M, N, K, 0, 1.0f, 0.0f);
            uint16_t *Ah, *Bh;
            case_bf16(&g, &Ah, &Bh);
            float *C = malloc(g.csz * sizeof(float));
            double *tf = malloc((size_t)pairs * sizeof(double)), *th = malloc((size_t)pairs * sizeof(double));
            double *ratio = malloc((size_t)pairs * sizeof(double));
            assert_true(C && tf && th && ratio);
            pair_ctx px = {&g, Ah, Bh, C};
            interleave(pairs, run_bf16, &px, tf, th, ratio);
            double fl = 2.0 * (double)M * (double)N * (double)K;
            printf("%s%s   %5lld %5lld %5lld | %12.1f %12.1f | %6.3f [%5.3f,%5.3f]\n", ta ? "T" : "N",
                   tb ? "T" : "N", (long long)M, (long long)N, (long long)K,
                   fl / tf[pairs / 2] * 1e-9, fl / th[pairs / 2] * 1e-9, ratio[pairs / 2],
                   ratio[pairs / 4], ratio[(3 * pairs) / 4]);
            fflush(stdout);
            lsum += log(ratio[pairs / 2]);
            nsh++;
            free(C), free(tf), free(th), free(ratio), free(Ah), free(Bh);
            case_free(&g);
        }
    printf("geometric mean of the median ratios (f32 openblas time / bf16 time): %.3f\n",
           exp(lsum / nsh));
    printf("the bf16 blocks' oneDNN primitives:\n");
    gj_rt_gemm_dump(stdout);
    return 0;
}

/* `--thread-bits`: for each provider, whether a GEMM's bits change with
 * the thread count (the split into blocks changes with it). */
static int thread_bits(void) {
    gj_rt_gemm_set_cache_dir("");
    int prov[3], np = providers(prov);
    gjt_rng r;
    gjt_rng_seed(&r, 3);
    const int64_t shapes[][5] = {{0, 0, 256, 1152, 384}, {0, 1, 256, 384, 1536}, {1, 0, 384, 1536, 256},
                                 {0, 0, 128, 512, 784},  {1, 0, 784, 512, 128},  {0, 0, 256, 10, 1024}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        gemm_case g;
        case_make(&g, &r, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], shapes[s][4], 0,
                  1.0f, 0.0f);
        for (int p = 0; p < np; p++) {
            gj_rt_set_gemm_provider(prov[p]);
            gj_rt_set_num_threads(1);
            float *C1 = case_run(&g);
            printf("%c%c %lldx%lldx%lld %-8s:", shapes[s][0] ? 'T' : 'N', shapes[s][1] ? 'T' : 'N',
                   (long long)g.M, (long long)g.N, (long long)g.K, gj_rt_gemm_provider_name(prov[p]));
            for (int t = 2; t <= 4; t++) {
                gj_rt_set_num_threads(t);
                float *Ct = case_run(&g);
                size_t diff = 0;
                for (size_t i = 0; i < g.csz; i++) diff += memcmp(&C1[i], &Ct[i], 4) != 0;
                printf("  %d threads: %5.2f%% of elements differ from 1 thread", t,
                       100.0 * (double)diff / (double)g.csz);
                free(Ct);
            }
            printf("\n");
            free(C1);
        }
        case_free(&g);
    }
    return 0;
}

/* ---------------------------------------------------------------- bf16 */

/* C = the f32 GEMM of the case's (widened) operands with OpenBLAS pinned,
 * run in the blocks a bf16 GEMM of its shape is split into
 * (gj_rt_gemm_split_for): what the widened bf16 path must give bit for
 * bit (OpenBLAS's bits can depend on the blocks). */
static float *case_run_split_bf16(const gemm_case *g) {
    float *C = malloc(g->csz * sizeof(float));
    assert_non_null(C);
    memcpy(C, g->C0, g->csz * sizeof(float));
    gj_rt_gemm_call c = {false, g->ta, g->tb, g->M, g->N, g->K, g->alpha, g->A, g->lda, g->B,
                         g->ldb, g->beta, C, g->ldc, false};
    gj_rt_gemm_call cb = c;
    cb.bf16 = true;
    gj_rt_gemm_split sp;
    gj_rt_gemm_split_for(&cb, gj_rt_num_threads(), &sp);
    int p0 = gj_rt_gemm_provider_setting();
    assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_OPENBLAS), 0);
    gj_rt_gemm_run(&c, &sp);
    assert_int_equal(gj_rt_set_gemm_provider(p0), 0);
    return C;
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(gj_rt_openblas_init(), 0);
    int prov[4], np = providers(prov);
    prov[np++] = GJ_RT_GEMM_DEFAULT;
    gjt_rng r;
    gjt_rng_seed(&r, 47);
    /* where oneDNN computes bf16 blocks is its choice (a CPU without
     * AVX512_BF16 may refuse them all, a block shape may be refused): the
     * cases each provider sent to it are counted and checked at the end */
    bool native = gj_rt_onednn_available() && gj_rt_cpu_native_bf16();
    int by_dnnl[2] = {0, 0}; /* pinned oneDNN, the default */
    for (int t = 1; t <= 2; t++) {
        gj_rt_set_num_threads(t);
        for (int s = 0; s < 16; s++) {
            gemm_case g;
            case_random(&g, &r, s, 400, false);
            bool ta = g.ta, tb = g.tb;
            int64_t M = g.M, N = g.N, K = g.K;
            float beta = g.beta;
            uint16_t *Ah, *Bh;
            case_bf16(&g, &Ah, &Bh);
            double *ref, *tol;
            case_ref(&g, &ref, &tol);
            float *Cs = case_run_split_bf16(&g); /* OpenBLAS on the widened operands */
            for (int p = 0; p < np; p++) {
                assert_int_equal(gj_rt_set_gemm_provider(prov[p]), 0);
                gj_rt_gemm_stats s0, s1;
                gj_rt_gemm_get_stats(&s0);
                float *C = malloc(g.csz * sizeof *C);
                assert_non_null(C);
                memcpy(C, g.C0, g.csz * sizeof *C);
                gj_rt_bgemm(ta, tb, M, N, K, Ah, g.lda, Bh, g.ldb, beta, C, g.ldc);
                gj_rt_gemm_get_stats(&s1);
                char what[64];
                snprintf(what, sizeof what, "bf16 %s, %d thread(s)", gj_rt_gemm_provider_name(prov[p]), t);
                case_check(&g, C, ref, tol, what);
                assert_true(s1.bf16_blocks > s0.bf16_blocks);
                bool dnnl = s1.onednn_blocks > s0.onednn_blocks;
                if (prov[p] == GJ_RT_GEMM_OPENBLAS) {
                    assert_false(dnnl);
                    assert_true(same_bits(C, Cs, g.csz)); /* converted exactly, then sgemm */
                } else if (prov[p] == GJ_RT_GEMM_ONEDNN) {
                    by_dnnl[0] += dnnl;
                } else if (prov[p] == GJ_RT_GEMM_DEFAULT) {
                    if (!native) assert_false(dnnl); /* widened for OpenBLAS */
                    by_dnnl[1] += dnnl;
                }
                free(C);
            }
            /* the default keeps f32 GEMMs with OpenBLAS */
            assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_DEFAULT), 0);
            int64_t d0 = stat_dnnl();
            free(case_run(&g));
            assert_int_equal(stat_dnnl(), d0);
            /* without oneDNN the default widens bf16 for OpenBLAS: the
             * pinned OpenBLAS bits */
            gj_rt_gemm_simulate_no_onednn(true);
            float *Cm = malloc(g.csz * sizeof *Cm);
            assert_non_null(Cm);
            memcpy(Cm, g.C0, g.csz * sizeof *Cm);
            gj_rt_bgemm(g.ta, g.tb, g.M, g.N, g.K, Ah, g.lda, Bh, g.ldb, g.beta, Cm, g.ldc);
            assert_int_equal(stat_dnnl(), d0);
            assert_true(same_bits(Cm, Cs, g.csz));
            free(Cm);
            gj_rt_gemm_simulate_no_onednn(false);
            assert_int_equal(gj_rt_set_gemm_provider(GJ_RT_GEMM_OPENBLAS), 0);
            free(Cs), free(Ah), free(Bh), free(ref), free(tol);
            case_free(&g);
        }
    }
    if (native) { /* AVX512_BF16 and oneDNN: both modes gave it bf16 work */
        assert_true(by_dnnl[0] > 0);
        assert_true(by_dnnl[1] > 0);
    }
}

/* ------------------------------------------------------------- signals */

static volatile sig_atomic_t g_alarms;
static void on_alarm(int sig) {
    (void)sig;
    g_alarms++;
}

/* 60 GEMMs of 256x512x1500 (a Fashion-MNIST weight gradient at batch 1500;
 * with bf16 operands when bf16) under a SIGALRM every 200 us (handler on
 * the alternate stack when alt): every result has the bits of the first,
 * computed before the timer. */
static void gemms_under_signals(bool alt, bool bf16) {
    const int64_t M = 256, N = 512, K = 1500;
    gjt_rng r;
    gjt_rng_seed(&r, 31);
    float *A = malloc((size_t)(K * M) * sizeof *A), *B = malloc((size_t)(K * N) * sizeof *B);
    float *C = malloc((size_t)(M * N) * sizeof *C), *C1 = malloc((size_t)(M * N) * sizeof *C1);
    assert_true(A && B && C && C1);
    for (int64_t i = 0; i < K * M; i++) A[i] = (float)gjt_rng_uniform(&r, -1, 1);
    for (int64_t i = 0; i < K * N; i++) B[i] = (float)gjt_rng_uniform(&r, -1, 1);
    uint16_t *Ah = malloc((size_t)(K * M) * sizeof *Ah), *Bh = malloc((size_t)(K * N) * sizeof *Bh);
    assert_true(Ah && Bh);
    for (int64_t i = 0; i < K * M; i++) Ah[i] = to_bf16(A[i]);
    for (int64_t i = 0; i < K * N; i++) Bh[i] = to_bf16(B[i]);
#define GEMM_(out)                                                                   \
    (bf16 ? gj_rt_bgemm(true, false, M, N, K, Ah, M, Bh, N, 0.0f, out, N)            \
          : gj_rt_sgemm(true, false, M, N, K, 1.0f, A, M, B, N, 0.0f, out, N))
    GEMM_(C1); /* A stored [K, M] */
    stack_t ss = {0}, old_ss;
    if (alt) {
        ss.ss_sp = malloc(1 << 16);
        ss.ss_size = 1 << 16;
        assert_non_null(ss.ss_sp);
        assert_int_equal(sigaltstack(&ss, &old_ss), 0);
    }
    struct sigaction sa, old_sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART | (alt ? SA_ONSTACK : 0);
    sigemptyset(&sa.sa_mask);
    assert_int_equal(sigaction(SIGALRM, &sa, &old_sa), 0);
    struct itimerval on = {{0, 200}, {0, 200}}, off = {{0, 0}, {0, 0}};
    g_alarms = 0;
    assert_int_equal(setitimer(ITIMER_REAL, &on, NULL), 0);
    int bad = 0;
    for (int i = 0; i < 60; i++) {
        GEMM_(C);
        bad += memcmp(C, C1, (size_t)(M * N) * sizeof *C) != 0;
        void *p = malloc(1 << 12); /* (a corrupted heap usually aborts here) */
        free(p);
    }
    assert_int_equal(setitimer(ITIMER_REAL, &off, NULL), 0);
    assert_int_equal(sigaction(SIGALRM, &old_sa, NULL), 0);
    if (alt) {
        assert_int_equal(sigaltstack(&old_ss, NULL), 0);
        free(ss.ss_sp);
    }
#undef GEMM_
    assert_true(g_alarms > 0);
    assert_int_equal(bad, 0);
    free(Ah);
    free(Bh);
    free(A);
    free(B);
    free(C);
    free(C1);
}

/* The public switch (gradjit.h) is the runtime's setting. */
static void test_public_switch(void **state) {
    (void)state;
    assert_int_equal(gj_set_gemm_provider(GJ_GEMM_OPENBLAS), 0);
    assert_int_equal(gj_get_gemm_provider(), GJ_GEMM_OPENBLAS);
    assert_int_equal(gj_rt_gemm_provider_setting(), GJ_RT_GEMM_OPENBLAS);
    assert_int_equal(gj_set_gemm_provider(GJ_GEMM_AUTO), 0);
    assert_int_equal(gj_get_gemm_provider(), GJ_GEMM_AUTO);
    gj_clear_error();
    assert_int_equal(gj_set_gemm_provider((gj_gemm_provider)7), -1);
    assert_non_null(strstr(gj_last_error(), "gj_set_gemm_provider: 7 is not a provider"));
    assert_int_equal(gj_get_gemm_provider(), GJ_GEMM_AUTO); /* unchanged */
    if (!gj_rt_onednn_available()) {
        assert_int_equal(gj_set_gemm_provider(GJ_GEMM_ONEDNN), -1);
        assert_int_equal(gj_get_gemm_provider(), GJ_GEMM_OPENBLAS);
    }
}

static void test_signals(void **state) {
    (void)state;
    gj_rt_gemm_provider_reset();
    int prov[4], np = providers(prov);
    prov[np++] = GJ_RT_GEMM_DEFAULT;
    for (int p = 0; p < np; p++) {
        gj_rt_gemm_provider_reset();
        assert_int_equal(gj_rt_set_gemm_provider(prov[p]), 0);
        gemms_under_signals(false, false);
        gemms_under_signals(false, true);
        if (prov[p] == GJ_RT_GEMM_ONEDNN) { /* and with the handler on an alternate stack */
            gemms_under_signals(true, false);
            gemms_under_signals(true, true);
        }
    }
}

int main(int argc, char **argv) {
    g_self = argv[0];
    if (argc >= 2 && strcmp(argv[1], "--child-setting") == 0) {
        printf("setting %s\n", gj_rt_gemm_provider_name(gj_rt_gemm_provider_setting()));
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "--child-gemm-log") == 0) { /* (test_log_default) */
        gjt_rng r;
        gjt_rng_seed(&r, 29);
        gemm_case g;
        case_make(&g, &r, false, true, 256, 384, 384, 0, 1.0f, 0.0f);
        gj_rt_set_num_threads(1);
        free(case_run(&g));
        case_free(&g);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "--thread-bits") == 0) return thread_bits();
    if (argc >= 2 && strcmp(argv[1], "--child-default-gemm") == 0) return child_default_gemm();
    if (argc >= 3 && strcmp(argv[1], "--paired") == 0) return paired(atoi(argv[2]) > 0 ? atoi(argv[2]) : 30);
    if (argc >= 3 && strcmp(argv[1], "--paired-bf16") == 0)
        return paired_bf16(atoi(argv[2]) > 0 ? atoi(argv[2]) : 30);
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_reference, restore),
        cmocka_unit_test_teardown(test_pinned, restore),
        cmocka_unit_test_teardown(test_env, restore),
        cmocka_unit_test_teardown(test_without_onednn, restore),
        cmocka_unit_test_teardown(test_deterministic, restore),
        cmocka_unit_test_teardown(test_auto_once, restore),
        cmocka_unit_test_teardown(test_leading_dims, restore),
        cmocka_unit_test_teardown(test_concurrent_first_calls, restore),
        cmocka_unit_test_teardown(test_sample_bounded, restore),
        cmocka_unit_test_teardown(test_default_unusable_dir, restore),
        cmocka_unit_test_teardown(test_file, restore),
        cmocka_unit_test_teardown(test_default_f32_rule, restore),
        cmocka_unit_test_teardown(test_log_default, restore),
        cmocka_unit_test_teardown(test_no_extra_threads, restore),
        cmocka_unit_test_teardown(test_public_switch, restore),
        cmocka_unit_test_teardown(test_bf16, restore),
        cmocka_unit_test_teardown(test_signals, restore),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
