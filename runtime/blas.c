/* SPDX-License-Identifier: MIT */
/*
 * blas.c - OpenBLAS, loaded at run time, and row-major GEMM wrappers.
 *
 * Invariants:
 *   - The library is loaded at most once (pthread_once), by the first
 *     gj_rt_blas_init (every wrapper calls it). Before loading, if the user
 *     did not set OPENBLAS_CORETYPE, it is set from cpuid
 *     (gj_rt_blas_pick_coretype): OpenBLAS reads it only while loading, and
 *     Debian's 0.3.21 does not recognise recent Xeons (it falls back to
 *     Prescott kernels, several times slower).
 *   - g_loaded becomes true (release) only after every function pointer is
 *     set, so any thread that sees it may call them.
 *   - If OpenBLAS cannot be loaded, gj_rt_blas_init returns -1 and sets the
 *     error on every call; the GEMM wrappers then compute with a plain loop
 *     (slow but correct) rather than leave C unwritten.
 *   - OpenBLAS runs single-threaded, always: its own worker threads spin
 *     (sched_yield) for about 2^28 cycles after each call, and on a small
 *     machine they then take cores from gradjit's pool and from the
 *     compiled program's concurrent steps. A large GEMM is split instead
 *     into row or column blocks of C run on gradjit's pool (gemm_split),
 *     each block a single-threaded BLAS call. The blocks are a pure function
 *     of the shape and the thread count (gj_rt_gemm_split_of), so the
 *     compiled program, which runs the same blocks itself, gets the same
 *     bits. (OpenBLAS's kernels do not sum every element in one order
 *     whatever the block: a 256x1024x10 sgemm split into two column halves
 *     differs from one call in about 3% of its elements.) A GEMM called
 *     from inside a pool task runs as one call on that thread.
 *   - Every f32 block first asks gemm_provider.c, which may compute it with
 *     oneDNN's matmul (single-threaded too) when that provider is chosen
 *     for the GEMM's shape; the choice is per GEMM shape and process-wide,
 *     so eager and compiled GEMMs of one shape use the same provider.
 */
#include "runtime/rt.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

enum { GJ_CBLAS_ROW_MAJOR = 101, GJ_CBLAS_NO_TRANS = 111, GJ_CBLAS_TRANS = 112 };

typedef void (*gj_sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta,
                            float *c, int ldc);
typedef void (*gj_dgemm_fn)(int order, int ta, int tb, int m, int n, int k, double alpha,
                            const double *a, int lda, const double *b, int ldb, double beta,
                            double *c, int ldc);
typedef char *(*gj_str_fn)(void);
typedef void (*gj_set_threads_fn)(int n);

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static atomic_bool g_loaded;
static char g_load_error[768];
static gj_sgemm_fn g_sgemm;
static gj_dgemm_fn g_dgemm;
static gj_str_fn g_corename, g_config;
static gj_set_threads_fn g_set_threads;

/* The OpenBLAS core for a CPU description: the widest kernel set the CPU
 * runs (AVX-512 with BF16 -> Cooperlake, AVX-512 -> SkylakeX, AVX2+FMA ->
 * Zen on AMD family >= 0x17, Haswell elsewhere), or NULL when nothing better
 * than OpenBLAS's own detection is known. Pure: tested over a table. */
const char *gj_rt_blas_core_for(const gj_rt_cpu *c) {
    if (c->avx512f && c->avx512bw && c->avx512vl && c->avx512dq && c->avx512cd)
        return c->avx512bf16 ? "Cooperlake" : "SkylakeX";
    if (c->avx2 && c->fma)
        return (c->amd && c->family >= 0x17) ? "Zen" : "Haswell";
    return NULL;
}

void gj_rt_cpu_detect(gj_rt_cpu *c) {
    memset(c, 0, sizeof *c);
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    c->avx2 = __builtin_cpu_supports("avx2");
    c->fma = __builtin_cpu_supports("fma");
    c->avx512f = __builtin_cpu_supports("avx512f");
    c->avx512bw = __builtin_cpu_supports("avx512bw");
    c->avx512vl = __builtin_cpu_supports("avx512vl");
    c->avx512dq = __builtin_cpu_supports("avx512dq");
    c->avx512cd = __builtin_cpu_supports("avx512cd");
    c->avx512bf16 = __builtin_cpu_supports("avx512bf16");
    unsigned a, b, cc, d;
    if (__get_cpuid(0, &a, &b, &cc, &d))
        c->amd = b == 0x68747541u && d == 0x69746e65u && cc == 0x444d4163u; /* AuthenticAMD */
    if (__get_cpuid(1, &a, &b, &cc, &d)) {
        int base = (int)((a >> 8) & 0xf);
        c->family = base == 0xf ? base + (int)((a >> 20) & 0xff) : base;
    }
#endif
}

/* Core type for OPENBLAS_CORETYPE from this CPU's features (with OS
 * support), or NULL when OpenBLAS's own detection should decide. */
const char *gj_rt_blas_pick_coretype(void) {
    gj_rt_cpu c;
    gj_rt_cpu_detect(&c);
    return gj_rt_blas_core_for(&c);
}

static void gj_rt_blas_load(void) {
    if (!getenv("OPENBLAS_CORETYPE")) {
        const char *core = gj_rt_blas_pick_coretype();
        if (core)
            setenv("OPENBLAS_CORETYPE", core, 0);
    }
    /* no OpenBLAS worker threads at all (see the invariants); the variable
     * is taken back after loading so that child processes do not inherit it */
    bool set_nt = !getenv("OPENBLAS_NUM_THREADS");
    if (set_nt)
        setenv("OPENBLAS_NUM_THREADS", "1", 0);
    char err0[320] = "";
    void *h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(err0, sizeof err0, "%s", e ? e : "unknown dlopen error");
        h = dlopen("libopenblas.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (set_nt)
        unsetenv("OPENBLAS_NUM_THREADS");
    if (!h) {
        const char *e = dlerror();
        snprintf(g_load_error, sizeof g_load_error,
                 "blas_init: cannot load OpenBLAS: dlopen(\"libopenblas.so.0\"): %s; "
                 "dlopen(\"libopenblas.so\"): %s",
                 err0, e ? e : "unknown dlopen error");
        return;
    }
    g_sgemm = (gj_sgemm_fn)dlsym(h, "cblas_sgemm");
    g_dgemm = (gj_dgemm_fn)dlsym(h, "cblas_dgemm");
    if (!g_sgemm || !g_dgemm) {
        snprintf(g_load_error, sizeof g_load_error,
                 "blas_init: OpenBLAS loaded but cblas_sgemm/cblas_dgemm not found: %s",
                 dlerror());
        g_sgemm = NULL;
        g_dgemm = NULL;
        dlclose(h);
        return;
    }
    g_corename = (gj_str_fn)dlsym(h, "openblas_get_corename");
    g_config = (gj_str_fn)dlsym(h, "openblas_get_config");
    g_set_threads = (gj_set_threads_fn)dlsym(h, "openblas_set_num_threads");
    if (g_set_threads)
        g_set_threads(1);
    atomic_store(&g_loaded, true);
}

int gj_rt_blas_init(void) {
    pthread_once(&g_once, gj_rt_blas_load);
    if (atomic_load(&g_loaded))
        return 0;
    gj_rt_set_error("%s", g_load_error);
    return -1;
}

void gj_rt_blas_set_num_threads(int n) {
    (void)n; /* OpenBLAS stays single-threaded; gemm_split uses the pool */
}

const char *gj_rt_blas_corename(void) {
    if (gj_rt_blas_init() != 0)
        return "unavailable";
    return g_corename ? g_corename() : "unknown";
}

const char *gj_rt_blas_config(void) {
    if (gj_rt_blas_init() != 0)
        return "unavailable";
    return g_config ? g_config() : "unknown";
}

/* Checks sizes and leading dimensions (row-major: op(A) is M x K, op(B) is
 * K x N, C is M x N) and that all fit OpenBLAS's 32-bit integers. */
static bool gj_rt_gemm_args_ok(const char *op, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                               int64_t lda, int64_t ldb, int64_t ldc) {
    int64_t acols = ta ? M : K, bcols = tb ? K : N;
    if (M < 0 || N < 0 || K < 0 || lda < (acols > 1 ? acols : 1) ||
        ldb < (bcols > 1 ? bcols : 1) || ldc < (N > 1 ? N : 1)) {
        gj_rt_set_error("%s: invalid arguments M=%lld N=%lld K=%lld ta=%d tb=%d lda=%lld ldb=%lld "
                        "ldc=%lld", op, (long long)M, (long long)N, (long long)K, ta, tb,
                        (long long)lda, (long long)ldb, (long long)ldc);
        return false;
    }
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
        ldc > INT_MAX) {
        gj_rt_set_error("%s: M=%lld N=%lld K=%lld (lda=%lld ldb=%lld ldc=%lld) exceed the 32-bit "
                        "BLAS interface", op, (long long)M, (long long)N, (long long)K,
                        (long long)lda, (long long)ldb, (long long)ldc);
        return false;
    }
    return true;
}

/* ------------------------------------------------- GEMM on the pool */

/* Below this many multiply-adds a GEMM is one call (OpenBLAS's own
 * threshold for going multi-threaded: 4 * 65536). */
#define GJ_RT_GEMM_SPLIT_MIN (1 << 18)
#define GJ_RT_GEMM_MIN_BLOCK 16 /* rows or columns of a block, at least */
/* With A transposed (the dW = dY^T X GEMMs of a backward), OpenBLAS runs
 * row blocks of C a little faster than column blocks: split by rows
 * whenever each block keeps at least this many rows. Zen 3, OpenBLAS
 * 0.3.21 core Zen, 2 threads, `gradjit-gemm-split` (the two ways of one
 * GEMM interleaved on the pool, rows / columns time, medians of three runs
 * of 100-200 pairs): sgemm TN 512x784x128 0.83-1.00, 256x512x128 0.94-0.97,
 * 128x512x128 0.96-0.97, 1024x1024x256 0.97, but 64x1024x512 1.11-1.13
 * (32-row blocks); dgemm alike (0.97-0.98; 64 rows 1.10). Without a
 * transpose of A neither side wins consistently (run to run 0.86-1.09), so
 * the longer side is split. In the Fashion-MNIST MLP's forward+backward
 * (old and new rule interleaved in one process) it saved 2-6%, in eager and
 * compiled mode alike. Re-check on another CPU with gradjit-gemm-split. */
#define GJ_RT_GEMM_TA_ROWS 64

void gj_rt_gemm_split_of(bool ta, int64_t M, int64_t N, int64_t K, int threads,
                         gj_rt_gemm_split *sp) {
    sp->by_rows = M >= N || (ta && M >= GJ_RT_GEMM_TA_ROWS * (int64_t)threads);
    sp->len = sp->by_rows ? M : N;
    int64_t parts = threads;
    if ((double)M * (double)N * (double)K < GJ_RT_GEMM_SPLIT_MIN)
        parts = 1;
    if (parts > sp->len / GJ_RT_GEMM_MIN_BLOCK)
        parts = sp->len / GJ_RT_GEMM_MIN_BLOCK;
    sp->parts = parts < 1 ? 1 : (int)parts;
}

void gj_rt_gemm_split_for(const gj_rt_gemm_call *c, int threads, gj_rt_gemm_split *sp) {
    gj_rt_gemm_split_of(c->ta, c->M, c->N, c->K, threads, sp);
    if (c->bf16 && !c->ta && sp->parts > 1 && !sp->by_rows && c->M / GJ_RT_GEMM_MIN_BLOCK >= sp->parts) {
        sp->by_rows = true; /* row blocks of A and C: dense operands (see the header) */
        sp->len = c->M;
    }
}

void gj_rt_gemm_block(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp, int i) {
    int64_t el = c->f64 ? 8 : 4, ael = c->bf16 ? 2 : el; /* C's, A's and B's element bytes */
    int64_t lo = sp->len * i / sp->parts, hi = sp->len * (i + 1) / sp->parts;
    int64_t M = c->M, N = c->N, ao = 0, bo = 0, co;
    if (sp->by_rows) {
        M = hi - lo;
        ao = c->ta ? lo : lo * c->lda;
        co = lo * c->ldc;
    } else {
        N = hi - lo;
        bo = c->tb ? lo * c->ldb : lo;
        co = lo;
    }
    int ta = c->ta ? GJ_CBLAS_TRANS : GJ_CBLAS_NO_TRANS;
    int tb = c->tb ? GJ_CBLAS_TRANS : GJ_CBLAS_NO_TRANS;
    const char *A = (const char *)c->A + ao * ael, *B = (const char *)c->B + bo * ael;
    char *C = (char *)c->C + co * el;
    if (M == 0 || N == 0)
        return;
    if (c->bf16) { /* alpha 1, beta 0 or 1 (gj_rt_bgemm) */
        if (gj_rt_blas_init() != 0 || !gj_rt_gemm_alt_block(c, M, N, A, B, (float *)(void *)C))
            gj_rt_bgemm_block_blas(c->ta, c->tb, M, N, c->K, (const uint16_t *)(const void *)A,
                                   c->lda, (const uint16_t *)(const void *)B, c->ldb,
                                   (float)c->beta, (float *)(void *)C, c->ldc);
        return;
    }
    if (gj_rt_blas_init() != 0) { /* the plain loop of GJ_RT_GEMM_BODY */
        if (c->f64)
            gj_rt_dgemm(c->ta, c->tb, M, N, c->K, c->alpha, (const double *)(const void *)A,
                        c->lda, (const double *)(const void *)B, c->ldb, c->beta,
                        (double *)(void *)C, c->ldc);
        else
            gj_rt_sgemm(c->ta, c->tb, M, N, c->K, (float)c->alpha, (const float *)(const void *)A,
                        c->lda, (const float *)(const void *)B, c->ldb, (float)c->beta,
                        (float *)(void *)C, c->ldc);
        return;
    }
    if (!c->f64 && gj_rt_gemm_alt_block(c, M, N, A, B, (float *)(void *)C))
        return; /* oneDNN computed it (gemm_provider.c) */
    if (c->f64)
        g_dgemm(GJ_CBLAS_ROW_MAJOR, ta, tb, (int)M, (int)N, (int)c->K, c->alpha,
                (const double *)(const void *)A, (int)c->lda, (const double *)(const void *)B,
                (int)c->ldb, c->beta, (double *)(void *)C, (int)c->ldc);
    else
        g_sgemm(GJ_CBLAS_ROW_MAJOR, ta, tb, (int)M, (int)N, (int)c->K, (float)c->alpha,
                (const float *)(const void *)A, (int)c->lda, (const float *)(const void *)B,
                (int)c->ldb, (float)c->beta, (float *)(void *)C, (int)c->ldc);
}

void gj_rt_sgemm_block_blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float *A,
                            int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                            int64_t ldc) {
    g_sgemm(GJ_CBLAS_ROW_MAJOR, ta ? GJ_CBLAS_TRANS : GJ_CBLAS_NO_TRANS,
            tb ? GJ_CBLAS_TRANS : GJ_CBLAS_NO_TRANS, (int)M, (int)N, (int)K, 1.0f, A, (int)lda, B,
            (int)ldb, beta, C, (int)ldc);
}

/* ------------------------------------------- bf16 operands through sgemm */

/* The calling thread's f32 scratch for converted bf16 operands, grown on
 * demand and freed when the thread exits. */
static pthread_key_t g_conv_key;
static pthread_once_t g_conv_once = PTHREAD_ONCE_INIT;
typedef struct conv_buf {
    float *p;
    size_t cap; /* floats */
} conv_buf;

static void conv_free(void *v) {
    conv_buf *b = v;
    if (b)
        free(b->p);
    free(b);
}

static bool g_conv_ok; /* the key exists (else no scratch: the exact loop) */

static void conv_key_make(void) { g_conv_ok = pthread_key_create(&g_conv_key, conv_free) == 0; }

static float *conv_scratch(size_t n) {
    pthread_once(&g_conv_once, conv_key_make);
    if (!g_conv_ok)
        return NULL;
    conv_buf *b = pthread_getspecific(g_conv_key);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || pthread_setspecific(g_conv_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    if (n > b->cap) {
        float *p = malloc(n * sizeof *p);
        if (!p)
            return NULL;
        free(b->p);
        b->p = p;
        b->cap = n;
    }
    return b->p;
}

/* dst[r * cols + c] = src[r * ld + c] widened to f32 (exact). */
static void bf16_rows_to_f32(int64_t rows, int64_t cols, const uint16_t *src, int64_t ld,
                             float *dst) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *s = src + r * ld;
        float *d = dst + r * cols;
        for (int64_t k = 0; k < cols; k++) {
            uint32_t u = (uint32_t)s[k] << 16;
            memcpy(&d[k], &u, sizeof u);
        }
    }
}

void gj_rt_bgemm_block_blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                            int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C,
                            int64_t ldc) {
    /* the stored matrices: A is [M, K] (ta: [K, M]), B [K, N] (tb: [N, K]) */
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    float *w = conv_scratch((size_t)(ar * ac + br * bc));
    if (!w) { /* no memory for the scratch: the exact product, element by element */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                float acc = 0;
                for (int64_t k = 0; k < K; k++) {
                    uint32_t ua = (uint32_t)(ta ? A[k * lda + i] : A[i * lda + k]) << 16;
                    uint32_t ub = (uint32_t)(tb ? B[j * ldb + k] : B[k * ldb + j]) << 16;
                    float fa, fb;
                    memcpy(&fa, &ua, sizeof fa);
                    memcpy(&fb, &ub, sizeof fb);
                    acc += fa * fb;
                }
                C[i * ldc + j] = acc + (beta == 0 ? 0.0f : C[i * ldc + j]);
            }
        return;
    }
    float *a = w, *b = w + ar * ac;
    bf16_rows_to_f32(ar, ac, A, lda, a);
    bf16_rows_to_f32(br, bc, B, ldb, b);
    if (gj_rt_blas_init() == 0)
        gj_rt_sgemm_block_blas(ta, tb, M, N, K, a, ac, b, bc, beta, C, ldc);
    else
        gj_rt_sgemm(ta, tb, M, N, K, 1.0f, a, ac, b, bc, beta, C, ldc);
}

bool gj_rt_cpu_native_bf16(void) {
    static int g_native = -1; /* a pure function of the CPU: racing writers agree */
    int v = __atomic_load_n(&g_native, __ATOMIC_RELAXED);
    if (v < 0) {
        gj_rt_cpu c;
        gj_rt_cpu_detect(&c);
        v = c.avx512bf16;
        __atomic_store_n(&g_native, v, __ATOMIC_RELAXED);
    }
    return v != 0;
}

typedef struct gemm_split_ctx {
    const gj_rt_gemm_call *c;
    const gj_rt_gemm_split *sp;
} gemm_split_ctx;

static void gemm_split_range(void *vctx, int64_t b, int64_t e) {
    const gemm_split_ctx *x = vctx;
    for (int64_t i = b; i < e; i++)
        gj_rt_gemm_block(x->c, x->sp, (int)i);
}

void gj_rt_gemm_run(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp) {
    gemm_split_ctx x = {c, sp};
    if (sp->parts == 1)
        gemm_split_range(&x, 0, 1);
    else
        gj_rt_parallel_for(sp->parts, 1, gemm_split_range, &x);
}

/* Runs a loaded-BLAS GEMM (arguments already checked) as the blocks of
 * gj_rt_gemm_split_of on the pool (one call when that is one block, or
 * when called from a pool task). */
static void gemm_split(bool f64, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                       const void *A, int64_t lda, const void *B, int64_t ldb, double beta,
                       void *C, int64_t ldc, bool bf16) {
    gj_rt_gemm_call c = {f64, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bf16};
    gj_rt_gemm_split sp;
    gj_rt_gemm_split_for(&c, gj_rt_in_pool_task() ? 1 : gj_rt_num_threads(), &sp);
    gj_rt_gemm_run(&c, &sp);
}

/* One body for both precisions: the K == 0 case, and the plain loop used
 * when OpenBLAS is unavailable. */
#define GJ_RT_GEMM_BODY(T, BLASFN)                                                          \
    if (!gj_rt_gemm_args_ok(#BLASFN, ta, tb, M, N, K, lda, ldb, ldc) || M == 0 || N == 0)     \
        return;                                                                             \
    if (K == 0) {                                                                           \
        for (int64_t i = 0; i < M; i++)                                                     \
            for (int64_t j = 0; j < N; j++)                                                 \
                C[i * ldc + j] = beta == 0 ? (T)0 : beta * C[i * ldc + j];                  \
        return;                                                                             \
    }                                                                                       \
    if (gj_rt_blas_init() == 0) {                                                           \
        gemm_split(sizeof(T) == 8, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,   \
                   false);                                                                  \
        return;                                                                             \
    }                                                                                       \
    for (int64_t i = 0; i < M; i++)                                                         \
        for (int64_t j = 0; j < N; j++) {                                                   \
            T acc = 0;                                                                      \
            for (int64_t k = 0; k < K; k++)                                                 \
                acc += (ta ? A[k * lda + i] : A[i * lda + k]) *                             \
                       (tb ? B[j * ldb + k] : B[k * ldb + j]);                              \
            C[i * ldc + j] = alpha * acc + (beta == 0 ? (T)0 : beta * C[i * ldc + j]);      \
        }

void gj_rt_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                 float *C, int64_t ldc) {
    GJ_RT_GEMM_BODY(float, g_sgemm)
}

void gj_rt_dgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                 const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                 double *C, int64_t ldc) {
    GJ_RT_GEMM_BODY(double, g_dgemm)
}

void gj_rt_bgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                 int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (!gj_rt_gemm_args_ok("bgemm", ta, tb, M, N, K, lda, ldb, ldc) || M == 0 || N == 0)
        return;
    if (K == 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++)
                C[i * ldc + j] = beta == 0 ? 0.0f : C[i * ldc + j];
        return;
    }
    gemm_split(false, ta, tb, M, N, K, 1.0, A, lda, B, ldb, beta, C, ldc, true);
}
