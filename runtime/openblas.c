/* SPDX-License-Identifier: MIT */
/*
 * openblas.c - the OpenBLAS leaf of the GEMM layer: the library loaded at
 * run time, and one block of a GEMM on the calling thread.
 *
 * Invariants:
 *   - The library is loaded at most once (pthread_once), by the first
 *     gj_rt_openblas_init. Before loading, if the user did not set
 *     OPENBLAS_CORETYPE, it is set from cpuid (gj_rt_blas_pick_coretype):
 *     OpenBLAS reads it only while loading, and Debian's 0.3.21 does not
 *     recognise recent Xeons (it falls back to Prescott kernels, several
 *     times slower).
 *   - g_loaded becomes true (release) only after every function pointer is
 *     set, so any thread that sees it may call them.
 *   - OpenBLAS runs single-threaded, always: its own worker threads spin
 *     (sched_yield) for about 2^28 cycles after each call, and on a small
 *     machine they then take cores from gradjit's pool. gemm.c splits a
 *     large GEMM into blocks on gradjit's pool instead, each block one call
 *     here.
 *   - If OpenBLAS cannot be loaded, gj_rt_openblas_init returns -1 and sets
 *     the error on every call; a block is then computed with a plain loop
 *     (slow but correct) rather than left unwritten.
 *   - bf16 operands are widened to f32 (exactly) into the calling thread's
 *     scratch (grown on demand, freed when the thread exits) and multiplied
 *     by sgemm; without memory for the scratch, element by element.
 */
#include "runtime/gemm_int.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

typedef void (*sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c,
                         int ldc);
typedef void (*dgemm_fn)(int order, int ta, int tb, int m, int n, int k, double alpha,
                         const double *a, int lda, const double *b, int ldb, double beta,
                         double *c, int ldc);
typedef char *(*str_fn)(void);
typedef void (*set_threads_fn)(int n);

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static atomic_bool g_loaded;
static char g_load_error[768];
static sgemm_fn g_sgemm;
static dgemm_fn g_dgemm;
static str_fn g_corename, g_config;

/* ------------------------------------------------------------- the CPU */

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

const char *gj_rt_blas_pick_coretype(void) {
    gj_rt_cpu c;
    gj_rt_cpu_detect(&c);
    return gj_rt_blas_core_for(&c);
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

/* ------------------------------------------------------------ loading */

static void load(void) {
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
    g_sgemm = (sgemm_fn)dlsym(h, "cblas_sgemm");
    g_dgemm = (dgemm_fn)dlsym(h, "cblas_dgemm");
    if (!g_sgemm || !g_dgemm) {
        snprintf(g_load_error, sizeof g_load_error,
                 "blas_init: OpenBLAS loaded but cblas_sgemm/cblas_dgemm not found: %s",
                 dlerror());
        g_sgemm = NULL;
        g_dgemm = NULL;
        dlclose(h);
        return;
    }
    g_corename = (str_fn)dlsym(h, "openblas_get_corename");
    g_config = (str_fn)dlsym(h, "openblas_get_config");
    set_threads_fn set_threads = (set_threads_fn)dlsym(h, "openblas_set_num_threads");
    if (set_threads)
        set_threads(1);
    atomic_store(&g_loaded, true);
}

int gj_rt_openblas_init(void) {
    pthread_once(&g_once, load);
    if (atomic_load(&g_loaded))
        return 0;
    gj_rt_set_error("%s", g_load_error);
    return -1;
}

const char *gj_rt_blas_corename(void) {
    if (gj_rt_openblas_init() != 0)
        return "unavailable";
    return g_corename ? g_corename() : "unknown";
}

const char *gj_rt_blas_config(void) {
    if (gj_rt_openblas_init() != 0)
        return "unavailable";
    return g_config ? g_config() : "unknown";
}

/* ------------------------------------------------- bf16 widened to f32 */

/* The calling thread's f32 scratch for widened bf16 operands. */
static pthread_key_t g_conv_key;
static pthread_once_t g_conv_once = PTHREAD_ONCE_INIT;
static bool g_conv_ok; /* the key exists (else no scratch: the exact loop) */

typedef struct conv_buf {
    float *p;
    size_t cap; /* floats */
} conv_buf;

static void conv_free(void *v) {
    conv_buf *b = v;
    if (b)
        gj_rt_free(b->p);
    gj_rt_free(b);
}

static void conv_key_make(void) { g_conv_ok = pthread_key_create(&g_conv_key, conv_free) == 0; }

static float *conv_scratch(size_t n) {
    pthread_once(&g_conv_once, conv_key_make);
    if (!g_conv_ok)
        return NULL;
    conv_buf *b = pthread_getspecific(g_conv_key);
    if (!b) {
        b = gj_rt_calloc(1, sizeof *b);
        if (!b || pthread_setspecific(g_conv_key, b) != 0) {
            gj_rt_free(b);
            return NULL;
        }
    }
    if (n > b->cap) {
        float *p = gj_rt_malloc(n * sizeof *p);
        if (!p)
            return NULL;
        gj_rt_free(b->p);
        b->p = p;
        b->cap = n;
    }
    return b->p;
}

static inline float bf16_at(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* dst[r * cols + c] = src[r * ld + c] widened to f32 (exact). */
static void widen_rows(int64_t rows, int64_t cols, const uint16_t *src, int64_t ld, float *dst) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++)
            dst[r * cols + k] = bf16_at(src, r * ld + k);
}

/* ----------------------------------------------------------- one block */

/* One body for every element type: C = alpha op(A) op(B) + beta C, the
 * plain loop used without OpenBLAS (LOAD reads an operand element). */
#define GJ_GEMM_LOOP(T, LOAD)                                                                   \
    for (int64_t i = 0; i < M; i++)                                                             \
        for (int64_t j = 0; j < N; j++) {                                                       \
            T acc = 0;                                                                          \
            for (int64_t k = 0; k < K; k++)                                                     \
                acc += LOAD(A, ta ? k * lda + i : i * lda + k) *                                \
                       LOAD(B, tb ? j * ldb + k : k * ldb + j);                                 \
            C[i * ldc + j] = (T)alpha * acc + (beta == 0 ? (T)0 : (T)beta * C[i * ldc + j]);    \
        }
#define GJ_LOAD_PLAIN(P, I) (P)[I]
#define GJ_LOAD_BF16(P, I) bf16_at(P, I)

static void loop_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                     const float *A, int64_t lda, const float *B, int64_t ldb, double beta,
                     float *C, int64_t ldc) {
    GJ_GEMM_LOOP(float, GJ_LOAD_PLAIN)
}

static void loop_f64(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                     const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                     double *C, int64_t ldc) {
    GJ_GEMM_LOOP(double, GJ_LOAD_PLAIN)
}

static void loop_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                      const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                      double beta, float *C, int64_t ldc) {
    GJ_GEMM_LOOP(float, GJ_LOAD_BF16)
}

/* f32 block: OpenBLAS's sgemm, or the loop. */
static void block_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                      const float *A, int64_t lda, const float *B, int64_t ldb, double beta,
                      float *C, int64_t ldc) {
    if (gj_rt_openblas_init() != 0) {
        loop_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    g_sgemm(CBLAS_ROW_MAJOR, ta ? CBLAS_TRANS : CBLAS_NO_TRANS, tb ? CBLAS_TRANS : CBLAS_NO_TRANS,
            (int)M, (int)N, (int)K, (float)alpha, A, (int)lda, B, (int)ldb, (float)beta, C,
            (int)ldc);
}

void gj_rt_openblas_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                          const void *B, void *C) {
    bool ta = c->ta, tb = c->tb;
    int64_t K = c->K;
    if (c->f64) {
        if (gj_rt_openblas_init() != 0)
            loop_f64(ta, tb, M, N, K, c->alpha, A, c->lda, B, c->ldb, c->beta, C, c->ldc);
        else
            g_dgemm(CBLAS_ROW_MAJOR, ta ? CBLAS_TRANS : CBLAS_NO_TRANS,
                    tb ? CBLAS_TRANS : CBLAS_NO_TRANS, (int)M, (int)N, (int)K, c->alpha, A,
                    (int)c->lda, B, (int)c->ldb, c->beta, C, (int)c->ldc);
        return;
    }
    if (!c->bf16) {
        block_f32(ta, tb, M, N, K, c->alpha, A, c->lda, B, c->ldb, c->beta, C, c->ldc);
        return;
    }
    /* bf16: the stored matrices are A [M, K] (ta: [K, M]), B [K, N] (tb: [N, K]) */
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    float *w = conv_scratch((size_t)(ar * ac + br * bc));
    if (!w) {
        loop_bf16(ta, tb, M, N, K, c->alpha, A, c->lda, B, c->ldb, c->beta, C, c->ldc);
        return;
    }
    widen_rows(ar, ac, A, c->lda, w);
    widen_rows(br, bc, B, c->ldb, w + ar * ac);
    block_f32(ta, tb, M, N, K, c->alpha, w, ac, w + ar * ac, bc, c->beta, C, c->ldc);
}
