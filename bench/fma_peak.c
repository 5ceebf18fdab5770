/* SPDX-License-Identifier: MIT */
/*
 * fma_peak.c - the machine's arithmetic peaks, measured: f32 and f64 vector
 * FMAs with the widest vectors the CPU runs (AVX-512, else AVX2+FMA), bf16
 * dot products (AVX512_BF16's vdpbf16ps: per f32 lane, two products of
 * bf16 pairs added to the lane) and bf16 tile products (AMX's tdpbf16ps),
 * each on every thread at once and on one thread alone. They are the
 * ceilings no GEMM can pass: with them the bench bounds a workload's time
 * from below (docs/benchmarks.md: the ceiling is measured, not assumed).
 *
 * A bound made from a peak stays a bound only if the peak is not
 * underestimated, and load from other processes can only make a measured
 * rate lower. So:
 *  - the peaks are measured in rounds through the run (bench_fma_peak at
 *    start, bench_fma_peak_again before each workload's bound and again
 *    when a measured time beats a bound), and every figure is the best
 *    timed run of all rounds;
 *  - the rate a bound uses is the larger of the all-threads figure and the
 *    one-thread figure times the threads: one thread alone needs one free
 *    core, not all of them (where threads share a core's FMA units this
 *    rate is above what they reach together, which keeps a bound a bound);
 *  - the machine is said to look busy when every thread at once reached
 *    less than BUSY_SCALING of threads x one thread, or when the timed
 *    runs of every thread at once spread by more than BUSY_SPREAD.
 * bf16 GEMMs are bounded by the fastest of the f32 FMA (a bf16 GEMM can
 * be computed in f32: some CPUs run vdpbf16ps slower than f32 FMAs), the
 * bf16 dot product and the AMX tiles.
 *
 * The loops are compiled for their instruction set with target attributes
 * and chosen at run time (cpuid), so the bench itself stays built for the
 * baseline. The vector loops keep 12 independent accumulators (enough to
 * cover the latency times the ports of current x86 cores); an empty asm
 * keeps them in registers and alive. The AMX loop keeps four accumulator
 * tiles over two A and two B tiles; Linux grants a process the tiles'
 * state on request (arch_prctl), and where it does not the tiles are not
 * measured. Other CPUs report 0 (unknown).
 *
 * The clock: cores reach their full rate only after tens of milliseconds
 * of work. On this project's Zen 5 VM (2 threads) runs of 8 ms measured
 * 216 GFLOP/s from idle and 360 after a warm-up, against 435 for runs of
 * 35 ms or more, and the compiled steps' GEMMs ran above the short runs'
 * "peak". So each round first runs the f32 loop on all threads for
 * PEAK_WARM_MS (PEAK_REWARM_MS in later rounds), untimed; each kind's
 * iteration count is then set from an untimed run so that a timed run
 * takes about PEAK_RUN_MS.
 */
#include "bench.h"
#include "clock.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define GJ_BENCH_X86 1
#endif
#if defined(GJ_BENCH_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define PEAK_WARM_MS 300.0  /* first round */
#define PEAK_REWARM_MS 100.0 /* later rounds (the run kept the cores busy) */
#define PEAK_RUN_MS 35.0
#define PEAK_REPS_FIRST 5
#define PEAK_REPS 3
#define BUSY_SCALING 0.85
#define BUSY_SPREAD 0.10

typedef enum { K_F32, K_F64, K_BF16_DP, K_BF16_AMX, K_COUNT } peak_kind;

#ifdef GJ_BENCH_X86
/* The body of one vector loop: 12 chains of V, initialised by SET1,
 * advanced by STEP(a) (a macro of the caller naming its constants), C the
 * asm register class. Returns 0, read from a chain so that the chains are
 * kept. */
#define PEAK_CHAINS(V, SET1, STEP, C)                                                     \
    V a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5), \
      a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10),             \
      a11 = SET1(11);                                                                     \
    for (long n = 0; n < iters; n++) {                                                    \
        a0 = STEP(a0), a1 = STEP(a1), a2 = STEP(a2), a3 = STEP(a3);                       \
        a4 = STEP(a4), a5 = STEP(a5), a6 = STEP(a6), a7 = STEP(a7);                       \
        a8 = STEP(a8), a9 = STEP(a9), a10 = STEP(a10), a11 = STEP(a11);                   \
        __asm__ volatile("" : "+" C(a0), "+" C(a1), "+" C(a2), "+" C(a3), "+" C(a4),      \
                         "+" C(a5));                                                      \
        __asm__ volatile("" : "+" C(a6), "+" C(a7), "+" C(a8), "+" C(a9), "+" C(a10),     \
                         "+" C(a11));                                                     \
    }                                                                                     \
    unsigned char s[sizeof(V)];                                                           \
    memcpy(s, &a0, sizeof s);                                                             \
    return (double)s[0] * 0;

__attribute__((target("avx2,fma"))) static double fma_avx2_f32(long iters) {
    __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-6f);
#define STEP(a) _mm256_fmadd_ps(a, b, c)
    PEAK_CHAINS(__m256, _mm256_set1_ps, STEP, "x")
#undef STEP
}
__attribute__((target("avx2,fma"))) static double fma_avx2_f64(long iters) {
    __m256d b = _mm256_set1_pd(0.999), c = _mm256_set1_pd(1e-6);
#define STEP(a) _mm256_fmadd_pd(a, b, c)
    PEAK_CHAINS(__m256d, _mm256_set1_pd, STEP, "x")
#undef STEP
}
__attribute__((target("avx512f"))) static double fma_avx512_f32(long iters) {
    __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-6f);
#define STEP(a) _mm512_fmadd_ps(a, b, c)
    PEAK_CHAINS(__m512, _mm512_set1_ps, STEP, "v")
#undef STEP
}
__attribute__((target("avx512f"))) static double fma_avx512_f64(long iters) {
    __m512d b = _mm512_set1_pd(0.999), c = _mm512_set1_pd(1e-6);
#define STEP(a) _mm512_fmadd_pd(a, b, c)
    PEAK_CHAINS(__m512d, _mm512_set1_pd, STEP, "v")
#undef STEP
}
/* vdpbf16ps: each f32 lane of a += x[2i] y[2i] + x[2i+1] y[2i+1], the x and
 * y bf16 0.001 (0x3a83): 2e-6 a step, so the lanes stay finite and normal. */
__attribute__((target("avx512f,avx512bf16"))) static double dp_avx512_bf16(long iters) {
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3a83), y = x;
#define STEP(a) _mm512_dpbf16_ps(a, x, y)
    PEAK_CHAINS(__m512, _mm512_set1_ps, STEP, "v")
#undef STEP
}
#undef PEAK_CHAINS

/* The tile configuration of palette 1: tiles 0..7 of 16 rows of 64 bytes. */
typedef struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tdpbf16ps: C[16x16 f32] += A[16x32 bf16] B[16 pairs x 32 bf16 ...], four
 * accumulators (tiles 0-3) over A tiles 4, 5 and B tiles 6, 7, all bf16
 * 0.001; the tiles are released after. */
__attribute__((target("amx-tile,amx-bf16"))) static double amx_bf16(long iters) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _Alignas(64) uint16_t src[16 * 32];
    _Alignas(64) float dst[16 * 16];
    for (int i = 0; i < 16 * 32; i++)
        src[i] = 0x3a83;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    for (long n = 0; n < iters; n++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, dst, 64);
    _tile_release();
    return (double)dst[0] * 0;
}

/* Whether the kernel lets this process use the AMX tiles' state (Linux:
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; asked once per process). */
static bool amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                   18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return false;
#endif
}
#endif /* GJ_BENCH_X86 */

/* FLOPs of one iteration of kind k's loop at `width` f32 lanes. */
static double flops_per_iter(peak_kind k, int width) {
    switch (k) {
    case K_F32: return 12.0 * width * 2;         /* 12 FMAs */
    case K_F64: return 12.0 * (width / 2) * 2;
    case K_BF16_DP: return 12.0 * width * 2 * 2; /* 12 dot products of 2 pairs a lane */
    case K_BF16_AMX: return 4.0 * 16 * 16 * 32 * 2; /* 4 tile products */
    default: return 0;
    }
}

typedef struct peak_part {
    peak_kind kind;
    int width; /* f32 lanes per vector: 16 (AVX-512) or 8 (AVX2) */
    long iters;
    double sink;
} peak_part;

static void *peak_thread(void *arg) {
    peak_part *p = arg;
#ifdef GJ_BENCH_X86
    switch (p->kind) {
    case K_F32: p->sink += p->width == 16 ? fma_avx512_f32(p->iters) : fma_avx2_f32(p->iters);
        break;
    case K_F64: p->sink += p->width == 16 ? fma_avx512_f64(p->iters) : fma_avx2_f64(p->iters);
        break;
    case K_BF16_DP: p->sink += dp_avx512_bf16(p->iters); break;
    case K_BF16_AMX: p->sink += amx_bf16(p->iters); break;
    default: break;
    }
#else
    (void)p;
#endif
    return NULL;
}

/* Kind k on `nt` threads at once: one short untimed run sets the iteration
 * count for runs of about PEAK_RUN_MS, one run of that length is untimed,
 * then `reps` timed runs. GFLOP/s of the fastest; *low of the slowest. */
static double rate_of(peak_kind k, int width, int nt, int reps, double *low, double *sink) {
    peak_part parts[64];
    long iters = k == K_BF16_AMX ? 1L << 14 : 1L << 18;
    for (int i = 0; i < nt; i++)
        parts[i] = (peak_part){k, width, iters, 0};
    double t = bench_threads_best_ms(nt, 1, peak_thread, parts, sizeof *parts);
    double scale = PEAK_RUN_MS / (t > 1e-3 ? t : 1e-3);
    iters = (long)((double)iters * (scale < 1 ? 1 : scale > 4096 ? 4096 : scale));
    for (int i = 0; i < nt; i++)
        parts[i].iters = iters;
    bench_threads_best_ms(nt, 1, peak_thread, parts, sizeof *parts);
    double best = 1e30, worst = 0;
    for (int r = 0; r < reps; r++) {
        double ms = bench_threads_best_ms(nt, 1, peak_thread, parts, sizeof *parts);
        best = ms < best ? ms : best;
        worst = ms > worst ? ms : worst;
    }
    for (int i = 0; i < nt; i++)
        *sink += parts[i].sink;
    double fl = (double)nt * (double)iters * flops_per_iter(k, width);
    *low = fl / (worst * 1e6);
    return fl / (best * 1e6);
}

static bench_peak *peak_slot(bench_ceiling *c, peak_kind k) {
    return k == K_F32 ? &c->f32 : k == K_F64 ? &c->f64 : k == K_BF16_DP ? &c->bf16_dp
                                                                        : &c->bf16_amx;
}

static double max2(double a, double b) { return a > b ? a : b; }

/* The CPU's vector width for the FMAs (0: none measured here) and whether
 * it has the bf16 dot product and the AMX bf16 tiles. */
static int cpu_width(bool *bf16_dp, bool *amx) {
    *bf16_dp = *amx = false;
#ifdef GJ_BENCH_X86
    __builtin_cpu_init();
    int width = 0;
    if (__builtin_cpu_supports("avx512f")) /* the OS saves the zmm state too */
        width = 16;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        width = 8;
    unsigned a, b, c, d;
    if (width == 16 && __get_cpuid_count(7, 1, &a, &b, &c, &d))
        *bf16_dp = (a >> 5) & 1; /* AVX512_BF16 */
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d))
        *amx = ((d >> 22) & 1) && ((d >> 24) & 1); /* AMX-BF16, AMX-TILE */
    return width;
#else
    return 0;
#endif
}

static int g_width; /* of the first round */

/* One round: every kind the CPU has, all threads and one thread; the best
 * figures of all rounds kept; then the rates and whether it looks busy. */
static void peak_round(bench_ceiling *c, double warm_ms, int reps) {
    int nt = c->threads < 1 ? 1 : c->threads > 64 ? 64 : c->threads;
    int width = g_width;
    double sink = 0;
    peak_part warm[64];
    for (int i = 0; i < nt; i++)
        warm[i] = (peak_part){K_F32, width, 1L << 20, 0};
    for (double t0 = bench_now_ms(); bench_now_ms() - t0 < warm_ms;)
        bench_threads_best_ms(nt, 1, peak_thread, warm, sizeof *warm);
    double round_all = 0;
    for (int k = 0; k < K_COUNT; k++) {
        if ((k == K_BF16_DP && !c->has_bf16_dp) ||
            (k == K_BF16_AMX && (!c->has_amx || c->amx_refused)))
            continue;
        bench_peak *p = peak_slot(c, (peak_kind)k);
        double low, low1;
        double all = rate_of((peak_kind)k, width, nt, reps, &low, &sink);
        double one = nt > 1 ? rate_of((peak_kind)k, width, 1, reps, &low1, &sink) : all;
        p->all = max2(p->all, all);
        p->all_low = p->all_low > 0 && p->all_low < low ? p->all_low : low;
        p->one = max2(p->one, one);
        p->rate = max2(p->all, p->one * nt);
        if (k == K_F32)
            round_all = all;
    }
    if (c->peak_rounds < BENCH_MAX_PEAK_ROUNDS)
        c->round_f32[c->peak_rounds] = round_all;
    c->peak_rounds++;
    c->sink += (uint64_t)sink;
    c->peak_gflops_f32 = c->f32.rate;
    c->peak_gflops_f64 = c->f64.rate;
    c->peak_gflops_bf16 = max2(c->f32.rate, max2(c->bf16_dp.rate, c->bf16_amx.rate));

    /* busy: from the f32 figures, the ones most bounds use */
    const bench_peak *p = &c->f32;
    double scaling = p->one > 0 ? p->all / (p->one * nt) : 1;
    double spread = p->all > 0 ? 1 - p->all_low / p->all : 0;
    c->busy_why[0] = 0;
    c->busy = (nt > 1 && scaling < BUSY_SCALING) || spread > BUSY_SPREAD;
    if (nt > 1 && scaling < BUSY_SCALING)
        snprintf(c->busy_why, sizeof c->busy_why,
                 "%d threads at once reached %.0f%% of %d x one thread's f32 rate (other "
                 "processes, or threads that share a core)", nt,
                 100 * scaling, nt);
    if (spread > BUSY_SPREAD) {
        size_t len = strlen(c->busy_why);
        snprintf(c->busy_why + len, sizeof c->busy_why - len,
                 "%sruns of %d threads at once ranged %.1f-%.1f GFLOP/s f32 (%.0f%%)",
                 len ? "; " : "", nt, p->all_low, p->all, 100 * spread);
    }
}

void bench_fma_peak(bench_ceiling *c, int threads) {
    if (c->threads <= 0)
        c->threads = threads;
    g_width = cpu_width(&c->has_bf16_dp, &c->has_amx);
    c->fma_isa = g_width == 16 ? "AVX-512" : g_width == 8 ? "AVX2+FMA" : NULL;
    if (!g_width)
        return;
#ifdef GJ_BENCH_X86
    if (c->has_amx)
        c->amx_refused = !amx_granted();
#endif
    peak_round(c, PEAK_WARM_MS, PEAK_REPS_FIRST);
}

void bench_fma_peak_again(bench_ceiling *c) {
    if (c->fma_isa)
        peak_round(c, PEAK_REWARM_MS, PEAK_REPS);
}

double bench_gemm_peak(const bench_ceiling *c, gj_dtype dt) {
    return dt == GJ_F64 ? c->peak_gflops_f64 : dt == GJ_BF16 ? c->peak_gflops_bf16
                                                             : c->peak_gflops_f32;
}

/* "448.2 (2 threads at once 447.0, 2 x one thread 224.1)" */
static void peak_text(char *buf, size_t cap, const bench_peak *p, int nt) {
    if (nt > 1)
        snprintf(buf, cap, "%.1f (%d threads at once %.1f, %d x one thread %.1f)", p->rate, nt,
                 p->all, nt, p->one);
    else
        snprintf(buf, cap, "%.1f", p->rate);
}

void bench_fma_peak_print(const bench_ceiling *c, const char *what) {
    if (!c->fma_isa) {
        printf("arithmetic peak: unknown on this CPU (no AVX2+FMA): no peak bounds\n");
        return;
    }
    int nt = c->threads < 1 ? 1 : c->threads;
    char f32[96], f64[96], dp[96], amx[96];
    peak_text(f32, sizeof f32, &c->f32, nt);
    peak_text(f64, sizeof f64, &c->f64, nt);
    printf("peak GFLOP/s %s (%d round%s, %s, best run of each): f32 FMA %s, f64 FMA %s\n", what,
           c->peak_rounds, c->peak_rounds == 1 ? "" : "s", c->fma_isa, f32, f64);
    if (c->has_bf16_dp)
        peak_text(dp, sizeof dp, &c->bf16_dp, nt);
    else
        snprintf(dp, sizeof dp, "none (no AVX512_BF16)");
    if (c->has_amx && !c->amx_refused)
        peak_text(amx, sizeof amx, &c->bf16_amx, nt);
    else
        snprintf(amx, sizeof amx, "%s", c->has_amx ? "not measured (the kernel refused the tiles)"
                                                   : "none");
    printf("  bf16: vdpbf16ps %s, AMX tdpbf16ps %s; bf16 GEMMs bounded at %.1f (the fastest of "
           "these and f32)\n",
           dp, amx, c->peak_gflops_bf16);
    if (c->busy)
        printf("  the machine looked BUSY: %s; the peaks keep the best of every round\n",
               c->busy_why);
    else if (nt > 1)
        printf("  the machine looked quiet: %d threads at once reached %.0f%% of %d x one "
               "thread's f32 rate, their runs ranged %.1f-%.1f\n",
               nt, 100 * c->f32.all / (c->f32.one * nt), nt, c->f32.all_low, c->f32.all);
    else
        printf("  the machine looked quiet: runs ranged %.1f-%.1f\n", c->f32.all_low,
               c->f32.all);
}
