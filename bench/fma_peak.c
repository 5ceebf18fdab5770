/* SPDX-License-Identifier: MIT */
/*
 * fma_peak.c - the machine's floating-point peak, measured: every thread
 * runs independent chains of vector FMAs at once, with the widest vectors
 * the CPU runs (AVX-512, else AVX2+FMA), and the rate is the best of 5
 * runs of the whole group. It is the ceiling no GEMM can pass: with it the
 * bench prints how much of a backward's time any GEMM could still save
 * (docs/benchmarks.md: the ceiling is measured, not assumed).
 *
 * The loops are compiled for their instruction set with target
 * attributes and chosen at run time, so the bench itself stays built for
 * the baseline. Each thread keeps 12 accumulators (enough to cover the FMA
 * latency times the FMA ports of current x86 cores); an empty asm keeps
 * them in registers and alive. Other CPUs report 0 (unknown).
 *
 * The clock: cores reach their full rate only after tens of milliseconds
 * of work. On this project's Zen 5 VM (2 threads) runs of 8 ms measured
 * 216 GFLOP/s from idle and 360 after a warm-up, against 435 for runs of
 * 35 ms or more, and the compiled steps' GEMMs ran above the short runs'
 * "peak". So all threads first run the loop for PEAK_WARM_MS, untimed, and
 * each timed run is about 35 ms there.
 */
#include "bench.h"
#include "clock.h"

#include <stdbool.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GJ_BENCH_X86 1
#endif

enum { PEAK_ITERS = 1 << 24 }; /* 12 FMAs each: about 35 ms on this Zen 5 at full clock */

#ifdef GJ_BENCH_X86
/* The body of one loop: vectors of type V, SET1 broadcasts, FMA is the
 * fused multiply-add, C the asm register class. Returns 0, read from a
 * chain so that the chains are kept. */
#define PEAK_BODY(V, SET1, FMA, C)                                                        \
    {                                                                                    \
        V b = SET1(0.999), c = SET1(1e-6);                                               \
        V a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4),          \
          a5 = SET1(5), a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9),          \
          a10 = SET1(10), a11 = SET1(11);                                                \
        for (long n = 0; n < PEAK_ITERS; n++) {                                          \
            a0 = FMA(a0, b, c), a1 = FMA(a1, b, c), a2 = FMA(a2, b, c);                   \
            a3 = FMA(a3, b, c), a4 = FMA(a4, b, c), a5 = FMA(a5, b, c);                   \
            a6 = FMA(a6, b, c), a7 = FMA(a7, b, c), a8 = FMA(a8, b, c);                   \
            a9 = FMA(a9, b, c), a10 = FMA(a10, b, c), a11 = FMA(a11, b, c);               \
            __asm__ volatile("" : "+" C(a0), "+" C(a1), "+" C(a2), "+" C(a3), "+" C(a4),  \
                             "+" C(a5));                                                 \
            __asm__ volatile("" : "+" C(a6), "+" C(a7), "+" C(a8), "+" C(a9), "+" C(a10), \
                             "+" C(a11));                                                \
        }                                                                                \
        unsigned char s[sizeof(V)];                                                      \
        memcpy(s, &a0, sizeof s);                                                        \
        return (double)s[0] * 0;                                                         \
    }

__attribute__((target("avx2,fma"))) static double fma_avx2_f32(void)
    PEAK_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, "x")
__attribute__((target("avx2,fma"))) static double fma_avx2_f64(void)
    PEAK_BODY(__m256d, _mm256_set1_pd, _mm256_fmadd_pd, "x")
__attribute__((target("avx512f"))) static double fma_avx512_f32(void)
    PEAK_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, "v")
__attribute__((target("avx512f"))) static double fma_avx512_f64(void)
    PEAK_BODY(__m512d, _mm512_set1_pd, _mm512_fmadd_pd, "v")
#undef PEAK_BODY
#endif

typedef struct peak_part {
    int width; /* floats per vector: 16 (AVX-512) or 8 (AVX2) */
    bool f64;
    double sink;
} peak_part;

static void *peak_thread(void *arg) {
    peak_part *p = arg;
#ifdef GJ_BENCH_X86
    if (p->width == 16)
        p->sink = p->f64 ? fma_avx512_f64() : fma_avx512_f32();
    else
        p->sink = p->f64 ? fma_avx2_f64() : fma_avx2_f32();
#else
    (void)p;
#endif
    return NULL;
}

#define PEAK_WARM_MS 300.0

/* GFLOP/s of `nt` threads at once, best of 5 after PEAK_WARM_MS of the
 * same work. */
static double peak_of(int width, bool f64, int nt, double *sink) {
    peak_part parts[64];
    for (int i = 0; i < nt; i++)
        parts[i] = (peak_part){width, f64, 0};
    for (double t0 = bench_now_ms(); bench_now_ms() - t0 < PEAK_WARM_MS;)
        bench_threads_best_ms(nt, 1, peak_thread, parts, sizeof *parts);
    double best = bench_threads_best_ms(nt, 5, peak_thread, parts, sizeof *parts);
    for (int i = 0; i < nt; i++)
        *sink += parts[i].sink;
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
