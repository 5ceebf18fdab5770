/* SPDX-License-Identifier: MIT */
/*
 * ceiling.c - the machine's own ceiling, measured at start of a --paired
 * run and again through it, and each workload's lower bound
 * (docs/benchmarks.md: the ceiling is measured, not assumed).
 *
 * bound = sum over the compiled program's GEMM steps of the best time this
 *         machine does that GEMM in: on all threads, or single-threaded
 *         with every core doing one such GEMM at once (time / cores)
 *       + the program's compulsory bytes: the inputs some step reads, once,
 *         at the read bandwidth, or the new .grad, once, at the write
 *         bandwidth, whichever takes longer (a kernel reads and writes at
 *         once: the sum of the two is beaten by a streaming backward, W2),
 *         both rates measured over a working set of their size
 *         (bench_bandwidth_at: a cache's rate when they fit one).
 * peak  = the same with every GEMM at the peak of its dtype (fma_peak.c,
 *         bench_gemm_peak) instead of its measured rate, or at its measured
 *         rate where that is faster (then the peak was measured low): no
 *         GEMM passes it, so eager / peak is the most any compiled program
 *         could gain.
 * The GEMM list comes from the program itself (gj_compiled_autograd_
 * last_program), so the bound follows whatever the compiler emits. GEMMs
 * run through gj_matmul (eager, no grad), with the same transposes; a shape
 * met again in the same workload is timed once.
 *
 * Both are meant as lower bounds of the workload's backward, and load on
 * the machine while they are measured can only raise them: a slower GEMM,
 * a lower peak, a lower bandwidth. So the peaks are measured again before
 * each workload's bound (the best of all rounds kept), and when a measured
 * backward of either side is still faster than a bound, bench_ceiling_check
 * measures the peaks, the GEMMs and the bandwidth once more, keeps the
 * faster figures and recomputes; if a time still beats a bound, the row is
 * marked and its warning names both figures.
 *
 * bench_bandwidth_at: the rates at which bytes of a working set of a given
 * size move (step.c's bound, and the bytes above): a read pass, an
 * in-place read-modify-write pass (an optimizer's update of its tensors),
 * a memcpy and a write pass, all threads at once over their slices of one
 * buffer of that size, each kind repeated untimed for WS_WARM_MS (the
 * buffer into whatever cache holds it, the cores to their full clock:
 * fma_peak.c), then timed in runs of at least WS_RUN_MS, best of 5. The
 * passes use the widest vectors the CPU runs (target attributes, chosen at
 * run time, as fma_peak.c), so a working set that fits a cache is timed at
 * that cache's rate.
 */
#include "bench.h"
#include "clock.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct bw_part {
    char *dst;       /* NULL: read only */
    const char *src; /* NULL: write only */
    size_t n;
    uint64_t sum;
} bw_part;

static void *bw_thread(void *arg) {
    bw_part *p = arg;
    if (p->dst && p->src) {
        memcpy(p->dst, p->src, p->n);
    } else if (p->dst) {
        memset(p->dst, (int)(p->n & 0x7f), p->n);
    } else {
        const uint64_t *v = (const uint64_t *)(const void *)p->src;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = 0; i + 4 <= p->n / 8; i += 4) {
            s0 += v[i];
            s1 += v[i + 1];
            s2 += v[i + 2];
            s3 += v[i + 3];
        }
        p->sum = s0 + s1 + s2 + s3;
    }
    return NULL;
}

double bench_threads_best_ms(int nt, int reps, void *(*fn)(void *), void *parts, size_t size) {
    double best = 1e30;
    char *part = parts;
    for (int r = 0; r < reps; r++) {
        pthread_t th[64];
        bool started[64] = {false};
        double t0 = bench_now_ms();
        for (int i = 1; i < nt; i++)
            started[i] = pthread_create(&th[i], NULL, fn, part + (size_t)i * size) == 0;
        fn(part);
        for (int i = 1; i < nt; i++) {
            if (started[i]) pthread_join(th[i], NULL);
            else fn(part + (size_t)i * size);
        }
        double t = bench_now_ms() - t0;
        if (t < best)
            best = t;
    }
    return best;
}

/* Best of 5 GB/s of `nt` threads each doing its slice of one 64 MiB pass:
 * kind 0 copy (read + write bytes), 1 read, 2 write. */
static double bandwidth(int kind, int nt, char *a, char *b, size_t n, uint64_t *sink) {
    bw_part parts[64];
    for (int i = 0; i < nt; i++) {
        size_t lo = n * (size_t)i / (size_t)nt, hi = n * (size_t)(i + 1) / (size_t)nt;
        parts[i] = (bw_part){kind == 1 ? NULL : b + lo, kind == 2 ? NULL : a + lo, hi - lo, 0};
    }
    double best = bench_threads_best_ms(nt, 5, bw_thread, parts, sizeof *parts);
    for (int i = 0; i < nt; i++)
        *sink += parts[i].sum;
    return (kind == 0 ? 2.0 : 1.0) * (double)n / (best * 1e6);
}

/* Copy, read and write bandwidth of all threads over 64 MiB (past the
 * private caches), as the kernels use all threads; then the peaks. */
void bench_ceiling_measure(bench_ceiling *c, int threads) {
    memset(c, 0, sizeof *c);
    c->threads = threads;
    int nt = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    size_t n = (size_t)64 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a);
        free(b);
        return;
    }
    memset(a, 1, n);
    memset(b, 2, n);
    uint64_t sink = 0;
    c->copy_gbs = bandwidth(0, nt, a, b, n, &sink);
    c->read_gbs = bandwidth(1, nt, a, b, n, &sink);
    c->write_gbs = bandwidth(2, nt, a, b, n, &sink);
    c->sink = sink;
    bench_fma_peak(c, nt);
    free(a);
    free(b);
}

/* Best-of-5 milliseconds of one GEMM of g's shape on the current threads. */
static double time_gemm(const gj_ca_gemm *g) {
    gj_dtype dt = g->dtype;
    int64_t bt = g->batch;
    int64_t as[3] = {bt, g->ta ? g->K : g->M, g->ta ? g->M : g->K};
    int64_t bs[3] = {bt, g->tb ? g->N : g->K, g->tb ? g->K : g->N};
    double best = -1;
    gj_no_grad_push();
    gj_scope_push();
    gj_tensor *A = gj_randn(dt, bt > 1 ? 3 : 2, bt > 1 ? as : as + 1, 1.0);
    gj_tensor *B = gj_randn(dt, bt > 1 ? 3 : 2, bt > 1 ? bs : bs + 1, 1.0);
    int d0 = bt > 1 ? 1 : 0;
    if (A && g->ta)
        A = gj_transpose(A, d0, d0 + 1);
    if (B && g->tb)
        B = gj_transpose(B, d0, d0 + 1);
    if (!A || !B)
        goto out;
    best = 1e30;
    for (int r = 0; r < 7; r++) {
        gj_scope_push();
        double t0 = bench_now_ms();
        gj_tensor *C = gj_matmul(A, B);
        double t = bench_now_ms() - t0;
        gj_scope_pop();
        if (!C) {
            best = -1;
            goto out;
        }
        if (r >= 2 && t < best)
            best = t;
    }
out:
    gj_scope_pop();
    gj_no_grad_pop();
    return best;
}

/* The working set's bandwidth for r: read and write GB/s over the bytes
 * its backward must move (capped at 256 MiB: beyond any last-level cache,
 * memory's rate either way); with `again` the faster of r's previous and
 * a new measurement. */
static void ws_bandwidth(const bench_ceiling *c, bench_paired_result *r, double bytes, bool again) {
    double cap = (double)((size_t)256 << 20), rd, rw, wr;
    bench_bandwidth_at((size_t)(bytes < cap ? bytes : cap), c->threads, &rd, &rw, &wr);
    r->read_gbs = again && r->read_gbs > rd ? r->read_gbs : rd;
    r->write_gbs = again && r->write_gbs > wr ? r->write_gbs : wr;
}

void bench_ceiling_bound(bench_ceiling *c, bench_paired_result *r, bool again) {
    gj_ca_program_info pi;
    if (gj_compiled_autograd_last_program(&pi) != 0)
        return;
    int nt = c->threads > 0 ? c->threads : 1, n = pi.n_gemms < GJ_CA_MAX_GEMMS ? pi.n_gemms
                                                                         : GJ_CA_MAX_GEMMS;
    double gemm_ms = 0, peak_gemm_ms = 0;
    bool timed[BENCH_MAX_SHAPES] = {false}; /* shapes[i] timed in this call */
    for (int i = 0; i < n; i++) {
        const gj_ca_gemm *g = &pi.gemms[i];
        double fl = 2.0 * (double)g->M * (double)g->N * (double)g->K * (double)g->batch;
        bench_gemm_rate *seen = NULL; /* the same shape in this workload */
        for (int j = 0; j < c->n_shapes && !seen; j++) {
            const gj_ca_gemm *h = &c->shapes[j].g;
            if (!strcmp(c->shapes[j].workload, r->wl->id) && h->dtype == g->dtype &&
                h->ta == g->ta && h->tb == g->tb && h->M == g->M && h->N == g->N &&
                h->K == g->K && h->batch == g->batch)
                seen = &c->shapes[j];
        }
        double r1, rn;
        if (seen && (!again || timed[seen - c->shapes])) {
            r1 = seen->gflops_1;
            rn = seen->gflops_n;
        } else {
            double tn = time_gemm(g);
            gj_set_num_threads(1);
            double t1 = time_gemm(g);
            gj_set_num_threads(c->threads);
            if (tn < 0 || t1 < 0)
                return;
            r1 = fl / (t1 * 1e6);
            rn = fl / (tn * 1e6);
            if (!seen && c->n_shapes < BENCH_MAX_SHAPES) {
                seen = &c->shapes[c->n_shapes++];
                memset(seen, 0, sizeof *seen);
                snprintf(seen->workload, sizeof seen->workload, "%s", r->wl->id);
                seen->g = *g;
            }
            if (seen) { /* the faster of every time it was timed */
                seen->gflops_1 = r1 = r1 > seen->gflops_1 ? r1 : seen->gflops_1;
                seen->gflops_n = rn = rn > seen->gflops_n ? rn : seen->gflops_n;
                timed[seen - c->shapes] = true;
            }
        }
        double rate = r1 * nt > rn ? r1 * nt : rn, peak = bench_gemm_peak(c, g->dtype);
        gemm_ms += fl / (rate * 1e6);
        peak_gemm_ms += fl / ((peak > rate ? peak : rate) * 1e6);
    }
    double in = (double)pi.input_bytes, out = (double)pi.output_bytes;
    ws_bandwidth(c, r, in + out, again);
    r->gemm_gflop = pi.gemm_flops * 1e-9;
    r->bytes_mb = (in + out) * 1e-6;
    /* reads and writes overlap (a streaming kernel does both at once): the
     * longer of the two, not their sum */
    double read_ms = r->read_gbs > 0 ? in / (r->read_gbs * 1e6) : 0,
           write_ms = r->write_gbs > 0 ? out / (r->write_gbs * 1e6) : 0;
    double bytes_ms = read_ms > write_ms ? read_ms : write_ms;
    r->bound_ms = gemm_ms + bytes_ms;
    r->peak_gflops = c->peak_gflops_f32;
    r->peak_ms = c->peak_gflops_f32 > 0 ? peak_gemm_ms + bytes_ms : 0;
}

/* The fastest measured backward of r (either side). */
static double fastest(const bench_paired_result *r) {
    return r->eager_min_ms < r->compiled_min_ms ? r->eager_min_ms : r->compiled_min_ms;
}

static bool is_beaten(const bench_paired_result *r) {
    double t = fastest(r);
    return (r->bound_ms > 0 && t < r->bound_ms) || (r->peak_ms > 0 && t < r->peak_ms);
}

void bench_ceiling_check(bench_ceiling *c, bench_paired_result *r) {
    if (!r->ok || !is_beaten(r))
        return;
    r->rechecked = true;
    bench_fma_peak_again(c);
    bench_ceiling_bound(c, r, true);
    r->beaten = is_beaten(r);
}

void bench_ceiling_print(const bench_ceiling *c) {
    printf("bandwidth (%d threads, 64 MiB, best of 5): copy %.1f GB/s, read %.1f GB/s, write "
           "%.1f GB/s; bound = GEMM steps at the best measured rate (GFLOP/s table below) + the "
           "longer of inputs at read and new .grad at write bandwidth, over a working set of "
           "their size\n",
           c->threads, c->copy_gbs, c->read_gbs, c->write_gbs);
    bench_fma_peak_print(c, "at start");
    if (c->fma_isa)
        printf("peak = the bound with every GEMM at the peak of its dtype; eager/peak = the "
               "largest eager/compiled any program could reach here. The peaks are measured "
               "again before each bound and the best kept; a backward faster than its bound "
               "has the rates measured once more, then a WARNING\n");
    printf("\n");
}

void bench_ceiling_print_shapes(const bench_ceiling *c) {
    if (c->n_shapes == 0)
        return;
    printf("\nGEMM steps of each compiled backward at this machine's rates (GFLOP/s, best of 5; "
           "%% of the peak of all threads):\n");
    printf("%-4s %-3s %6s %6s %6s %6s %9s %9s %7s\n", "id", "op", "M", "N", "K", "batch",
           "1 thread", "all", "%peak");
    int nt = c->threads > 0 ? c->threads : 1;
    for (int i = 0; i < c->n_shapes; i++) {
        const bench_gemm_rate *s = &c->shapes[i];
        double best = s->gflops_1 * nt > s->gflops_n ? s->gflops_1 * nt : s->gflops_n;
        double peak = bench_gemm_peak(c, s->g.dtype);
        printf("%-4s %c%c  %6lld %6lld %6lld %6lld %9.1f %9.1f %6.0f%%%s\n", s->workload,
               s->g.ta ? 'T' : 'N', s->g.tb ? 'T' : 'N', (long long)s->g.M, (long long)s->g.N,
               (long long)s->g.K, (long long)s->g.batch, s->gflops_1, s->gflops_n,
               peak > 0 ? 100 * best / peak : 0, peak > 0 && best > peak ? " ABOVE THE PEAK" : "");
    }
}

static void json_peak(FILE *f, const char *key, const bench_peak *p) {
    fprintf(f, "\"%s\": {\"all\": %.2f, \"all_low\": %.2f, \"one\": %.2f, \"rate\": %.2f}", key,
            p->all, p->all_low, p->one, p->rate);
}

void bench_ceiling_json(FILE *f, const bench_ceiling *c) {
    fprintf(f,
            "{\"copy_gbs\": %.3f, \"read_gbs\": %.3f, \"write_gbs\": %.3f, "
            "\"fma_isa\": \"%s\", \"peak_gflops_f32\": %.2f, \"peak_gflops_f64\": %.2f, "
            "\"peak_gflops_bf16\": %.2f, \"bf16_dp\": %s, \"amx_bf16\": \"%s\",\n    \"peaks\": {",
            c->copy_gbs, c->read_gbs, c->write_gbs, c->fma_isa ? c->fma_isa : "",
            c->peak_gflops_f32, c->peak_gflops_f64, c->peak_gflops_bf16,
            c->has_bf16_dp ? "true" : "false",
            !c->has_amx ? "absent" : c->amx_refused ? "refused" : "measured");
    json_peak(f, "f32", &c->f32);
    fputs(", ", f);
    json_peak(f, "f64", &c->f64);
    fputs(", ", f);
    json_peak(f, "bf16_dp", &c->bf16_dp);
    fputs(", ", f);
    json_peak(f, "bf16_amx", &c->bf16_amx);
    fprintf(f, "},\n    \"peak_rounds\": %d, \"round_f32\": [", c->peak_rounds);
    for (int i = 0; i < c->peak_rounds && i < BENCH_MAX_PEAK_ROUNDS; i++)
        fprintf(f, "%s%.2f", i ? ", " : "", c->round_f32[i]);
    fprintf(f, "], \"busy\": %s, \"busy_why\": \"", c->busy ? "true" : "false");
    for (const char *p = c->busy_why; *p; p++) /* our own text: no control characters */
        fprintf(f, *p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
    fprintf(f, "\",\n    \"gemms\": [");
    for (int i = 0; i < c->n_shapes; i++) {
        const bench_gemm_rate *s = &c->shapes[i];
        fprintf(f,
                "%s\n    {\"workload\": \"%s\", \"ta\": %s, \"tb\": %s, \"M\": %lld, \"N\": %lld, "
                "\"K\": %lld, \"batch\": %lld, \"gflops_1\": %.2f, \"gflops_all\": %.2f}",
                i ? "," : "", s->workload, s->g.ta ? "true" : "false", s->g.tb ? "true" : "false",
                (long long)s->g.M, (long long)s->g.N, (long long)s->g.K, (long long)s->g.batch,
                s->gflops_1, s->gflops_n);
    }
    fprintf(f, "]}");
}

void bench_ceiling_free(bench_ceiling *c) { memset(c, 0, sizeof *c); }

/* ------------------------------------------ bandwidth at a working set */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define WS_X86 1

/* Sums the floats of p[0..n) (n a multiple of 256 bytes, p 64-byte aligned). */
__attribute__((target("avx512f"))) static float ws_read_avx512(const char *p, size_t n) {
    __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 256) {
        a = _mm512_add_ps(a, _mm512_load_ps((const float *)(const void *)(p + i)));
        b = _mm512_add_ps(b, _mm512_load_ps((const float *)(const void *)(p + i + 64)));
        c = _mm512_add_ps(c, _mm512_load_ps((const float *)(const void *)(p + i + 128)));
        d = _mm512_add_ps(d, _mm512_load_ps((const float *)(const void *)(p + i + 192)));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
}

/* Adds a tiny constant to every float of p[0..n) in place. */
__attribute__((target("avx512f"))) static void ws_rmw_avx512(char *p, size_t n) {
    __m512 k = _mm512_set1_ps(1e-30f);
    for (size_t i = 0; i < n; i += 64) {
        float *q = (float *)(void *)(p + i);
        _mm512_store_ps(q, _mm512_add_ps(_mm512_load_ps(q), k));
    }
}

__attribute__((target("avx2"))) static float ws_read_avx2(const char *p, size_t n) {
    __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 128) {
        a = _mm256_add_ps(a, _mm256_load_ps((const float *)(const void *)(p + i)));
        b = _mm256_add_ps(b, _mm256_load_ps((const float *)(const void *)(p + i + 32)));
        c = _mm256_add_ps(c, _mm256_load_ps((const float *)(const void *)(p + i + 64)));
        d = _mm256_add_ps(d, _mm256_load_ps((const float *)(const void *)(p + i + 96)));
    }
    float s[8];
    _mm256_storeu_ps(s, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

__attribute__((target("avx2"))) static void ws_rmw_avx2(char *p, size_t n) {
    __m256 k = _mm256_set1_ps(1e-30f);
    for (size_t i = 0; i < n; i += 32) {
        float *q = (float *)(void *)(p + i);
        _mm256_store_ps(q, _mm256_add_ps(_mm256_load_ps(q), k));
    }
}
#endif

static float ws_read_plain(const char *p, size_t n) {
    const float *v = (const float *)(const void *)p;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < n / 4; i += 4) {
        s0 += v[i];
        s1 += v[i + 1];
        s2 += v[i + 2];
        s3 += v[i + 3];
    }
    return s0 + s1 + s2 + s3;
}

static void ws_rmw_plain(char *p, size_t n) {
    float *v = (float *)(void *)p;
    for (size_t i = 0; i < n / 4; i++)
        v[i] += 1e-30f;
}

typedef struct ws_part {
    char *p;
    size_t n;   /* bytes of this thread's slice (a multiple of 256) */
    int kind;   /* 0 read, 1 read-modify-write, 2 memcpy of the first half onto the second,
                 * 3 write (zeros: the floats keep their value) */
    int reps, width; /* passes per run; vector width: 16 AVX-512, 8 AVX2, 0 plain */
    float sink;
} ws_part;

static void *ws_thread(void *arg) {
    ws_part *w = arg;
    for (int r = 0; r < w->reps; r++) {
        if (w->kind == 2) {
            memcpy(w->p + w->n / 2, w->p, w->n / 2);
            continue;
        }
        if (w->kind == 3) {
            memset(w->p, 0, w->n);
            continue;
        }
#ifdef WS_X86
        if (w->width == 16) {
            if (w->kind == 0) w->sink += ws_read_avx512(w->p, w->n);
            else ws_rmw_avx512(w->p, w->n);
            continue;
        }
        if (w->width == 8) {
            if (w->kind == 0) w->sink += ws_read_avx2(w->p, w->n);
            else ws_rmw_avx2(w->p, w->n);
            continue;
        }
#endif
        if (w->kind == 0) w->sink += ws_read_plain(w->p, w->n);
        else ws_rmw_plain(w->p, w->n);
    }
    return NULL;
}

#define WS_WARM_MS 100.0
#define WS_RUN_MS 30.0

void bench_bandwidth_at(size_t bytes, int threads, double *read_gbs, double *rw_gbs,
                        double *write_gbs) {
    *read_gbs = *rw_gbs = 0;
    if (write_gbs)
        *write_gbs = 0;
    int nt = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    size_t slice = (bytes / (size_t)nt + 255) / 256 * 256;
    if (slice < 256)
        slice = 256;
    char *buf = aligned_alloc(64, slice * (size_t)nt);
    if (!buf)
        return;
    memset(buf, 0, slice * (size_t)nt); /* floats of value 0 */
    int width = 0;
#ifdef WS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        width = 16;
    else if (__builtin_cpu_supports("avx2"))
        width = 8;
#endif
    size_t total = slice * (size_t)nt;
    double gbs[4] = {0, 0, 0, 0};
    for (int kind = 0; kind < (write_gbs ? 4 : 3); kind++) {
        ws_part parts[64];
        for (int i = 0; i < nt; i++)
            parts[i] = (ws_part){buf + (size_t)i * slice, slice, kind, 1, width, 0};
        double one = 1e30; /* ms of one pass */
        for (double t0 = bench_now_ms(); bench_now_ms() - t0 < WS_WARM_MS;)
            one = bench_threads_best_ms(nt, 1, ws_thread, parts, sizeof *parts);
        int reps = one >= WS_RUN_MS ? 1 : (int)(WS_RUN_MS / (one > 1e-3 ? one : 1e-3)) + 1;
        for (int i = 0; i < nt; i++)
            parts[i].reps = reps;
        double best = bench_threads_best_ms(nt, 5, ws_thread, parts, sizeof *parts);
        /* bytes moved per run: read; read + written; half read + half written;
         * written */
        double moved = (double)total * reps * (kind == 1 ? 2.0 : 1.0);
        gbs[kind] = moved / (best * 1e6);
    }
    free(buf);
    *read_gbs = gbs[0];
    *rw_gbs = gbs[1] > gbs[2] ? gbs[1] : gbs[2]; /* the faster way to read and write */
    if (write_gbs)
        *write_gbs = gbs[3];
}
