/* SPDX-License-Identifier: MIT */
/*
 * fma_peak.c - the machine's floating-point peak, measured: every thread
 * runs independent chains of vector FMAs at once, with the widest vectors
 * the CPU runs (AVX-512, else AVX2+FMA), and the rate is the best of 5
 * runs of the whole group. It is the ceiling no GEMM can pass: with it the
 * bench prints how much of a backward's time any GEMM could still save
 * (BENCHMARKS.md: "the ceiling is measured, not assumed").
 *
 * The loops are compiled for their instruction set with target
 * attributes and chosen at run time, so the bench itself stays built for
 * the baseline. Each thread keeps 12 accumulators (enough to cover the FMA
 * latency times the FMA ports of current x86 cores); an empty asm keeps
 * them in registers and alive. Other CPUs report 0 (unknown).
 */
#include "bench.h"
#include "clock.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GJ_BENCH_X86 1
#endif

enum { PEAK_ITERS = 1 << 22 }; /* 12 FMAs each: ~0.1 s on one AVX2 core */

#ifdef GJ_BENCH_X86
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx2,fma"))) static double fma_avx2(bool f64) {
    __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-6f);
    __m256d bd = _mm256_set1_pd(0.999), cd = _mm256_set1_pd(1e-6);
#define DECL(i) __m256 a##i = _mm256_set1_ps((float)(i)); __m256d d##i = _mm256_set1_pd(i);
    CHAINS(DECL)
#undef DECL
    if (f64) {
        for (long n = 0; n < PEAK_ITERS; n++) {
#define STEP(i) d##i = _mm256_fmadd_pd(d##i, bd, cd);
            CHAINS(STEP)
#undef STEP
            __asm__ volatile("" : "+x"(d0), "+x"(d1), "+x"(d2), "+x"(d3), "+x"(d4), "+x"(d5));
            __asm__ volatile("" : "+x"(d6), "+x"(d7), "+x"(d8), "+x"(d9), "+x"(d10), "+x"(d11));
        }
        double s[4];
        _mm256_storeu_pd(s, _mm256_add_pd(d0, d11));
        return s[0] * 0; /* 0, but not known to the compiler */
    }
    for (long n = 0; n < PEAK_ITERS; n++) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, b, c);
        CHAINS(STEP)
#undef STEP
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
        __asm__ volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
    }
    float s[8];
    _mm256_storeu_ps(s, _mm256_add_ps(a0, a11));
    return (double)s[0] * 0;
}

__attribute__((target("avx512f"))) static double fma_avx512(bool f64) {
    __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-6f);
    __m512d bd = _mm512_set1_pd(0.999), cd = _mm512_set1_pd(1e-6);
#define DECL(i) __m512 a##i = _mm512_set1_ps((float)(i)); __m512d d##i = _mm512_set1_pd(i);
    CHAINS(DECL)
#undef DECL
    if (f64) {
        for (long n = 0; n < PEAK_ITERS; n++) {
#define STEP(i) d##i = _mm512_fmadd_pd(d##i, bd, cd);
            CHAINS(STEP)
#undef STEP
            __asm__ volatile("" : "+v"(d0), "+v"(d1), "+v"(d2), "+v"(d3), "+v"(d4), "+v"(d5));
            __asm__ volatile("" : "+v"(d6), "+v"(d7), "+v"(d8), "+v"(d9), "+v"(d10), "+v"(d11));
        }
        return _mm512_reduce_add_pd(_mm512_add_pd(d0, d11)) * 0;
    }
    for (long n = 0; n < PEAK_ITERS; n++) {
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, b, c);
        CHAINS(STEP)
#undef STEP
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    }
    return (double)_mm512_reduce_add_ps(_mm512_add_ps(a0, a11)) * 0;
}
#undef CHAINS
#endif

typedef struct peak_part {
    int width; /* floats per vector: 16 (AVX-512) or 8 (AVX2) */
    bool f64;
    double sink;
} peak_part;

static void *peak_thread(void *arg) {
    peak_part *p = arg;
#ifdef GJ_BENCH_X86
    p->sink = p->width == 16 ? fma_avx512(p->f64) : fma_avx2(p->f64);
#else
    (void)p;
#endif
    return NULL;
}

/* GFLOP/s of `nt` threads at once, best of 5; 0 if no FMA loop fits. */
static double peak_of(int width, bool f64, int nt, double *sink) {
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        pthread_t th[64];
        peak_part parts[64];
        bool started[64] = {false};
        double t0 = bench_now_ms();
        for (int i = 0; i < nt; i++) {
            parts[i] = (peak_part){width, f64, 0};
            if (i > 0)
                started[i] = pthread_create(&th[i], NULL, peak_thread, &parts[i]) == 0;
        }
        peak_thread(&parts[0]);
        for (int i = 1; i < nt; i++) {
            if (started[i]) pthread_join(th[i], NULL);
            else peak_thread(&parts[i]);
        }
        double t = bench_now_ms() - t0;
        for (int i = 0; i < nt; i++)
            *sink += parts[i].sink;
        if (t < best)
            best = t;
    }
    int lanes = f64 ? width / 2 : width;
    /* 12 FMAs of `lanes` lanes, 2 flops each, per iteration */
    return (double)nt * PEAK_ITERS * 12.0 * lanes * 2.0 / (best * 1e6);
}

void bench_fma_peak(bench_ceiling *c, int threads) {
    int nt = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    int width = 0;
#ifdef GJ_BENCH_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        width = 16;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        width = 8;
#endif
    c->fma_isa = width == 16 ? "AVX-512" : width == 8 ? "AVX2+FMA" : NULL;
    if (!width)
        return;
    double sink = 0;
    c->peak_gflops_f32 = peak_of(width, false, nt, &sink);
    c->peak_gflops_f64 = peak_of(width, true, nt, &sink);
    c->sink += (uint64_t)sink;
}
