/* SPDX-License-Identifier: MIT */
/*
 * bench.c - gradjit-bench: runs the reference workloads of docs/benchmarks.md
 * (bench/workloads.c) eagerly and with compiled autograd and reports forward
 * and backward time, peak tensor bytes and compiled-autograd statistics.
 *
 *   gradjit-bench [--workload W1|W2|W3|W4|W5|F1|G1|G2|all[,..]]
 *                 [--mode eager|compiled|both]
 *                 [--steps N] [--warmup N] [--threads N] [--json FILE] [--png FILE]
 *                 [--compare torch [--python PATH] [--torch-script PATH]]
 *   gradjit-bench --paired N [--symbolic | --step] [--workload ...] [--json FILE]
 *
 * --paired N interleaves eager and compiled backwards (paired.c); with
 * --step, whole training steps through gj_step, eager and compiled (with
 * --gemm-pair: compiled steps, OpenBLAS pinned against the per-shape GEMM
 * provider choice; --gemm P pins the provider of a whole run)
 * (step.c). "all" is every workload but G2 (GPT-2 124M: name it).
 *
 * --compare torch also runs the same workloads in PyTorch eager mode
 * (bench/torch_ref.py under the system Python, /usr/bin/python3, with the
 * same thread count and OpenBLAS core; torch_compare.c) after gradjit's runs
 * and prints one table of PyTorch eager, gradjit eager and gradjit compiled
 * with ratios; it writes JSON and a PNG bar chart (default names
 * gradjit-bench-compare.json/.png unless --json/--png are given). PyTorch
 * missing is a message, not a failure.
 *
 * Invariants: every step runs inside gj_scope_push/pop and leaves no tensor
 * behind; .grad of every parameter is NULL when a step starts; the tensor
 * bytes alive after every step equal those alive after the first one, and
 * the bytes alive after a workload's teardown equal those before its setup,
 * otherwise the bench reports a leak and exits non-zero. Weights and data of
 * a workload come from gj_manual_seed(BENCH_SEED) in every mode, so eager and
 * compiled losses are comparable. Timings use CLOCK_MONOTONIC; "backward" is
 * the gj_backward call until it returns (every .grad written).
 */
#include "bench.h"
#include "clock.h"
#include "compare.h"
#include "../examples/plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define BENCH_MAX_STEPS 100000
#define BENCH_MAX_ROUNDS 64 /* --compare torch --rounds */

typedef enum { MODE_EAGER = 1, MODE_COMPILED = 2, MODE_BOTH = 3 } bench_mode;

/* --grads keep: .grad buffers stay allocated between steps and are zeroed
 * (PyTorch's zero_grad(set_to_none=False)); default: set to none. */
static bool g_keep_grads;

typedef struct bench_opts {
    unsigned workloads; /* bit i: bench_workloads[i] */
    bench_mode mode;
    int steps, warmup, threads;
    const char *json_path, *png_path;
    bool compare_torch;
    const char *python, *torch_script;
    bool ddp;          /* --ddp: under mpirun, overlap of allreduce and backward */
    double bucket_mb;  /* --bucket-mb */
    int zero;          /* --zero N with --ddp --step: ZeRO's stage */
    bool workloads_set;
    int pairs;  /* --paired N: interleaved eager/compiled pairs (0: off) */
    bool symbolic; /* --symbolic: the pairs are specialised / symbolic compiled */
    bool step;     /* --step: the pairs are whole steps (gj_step), eager / compiled */
    bool gemm_pair; /* --gemm-pair (with --step): compiled steps, OpenBLAS / the per-shape choice */
    bool bf16_pair; /* --bf16-pair (with --step): compiled steps, f32 / bf16 mixed precision */
    bool budget_pair; /* --budget-pair (with --step): compiled steps, no budget / half the peak */
    const char *gemm; /* --gemm P: pin the GEMM provider (openblas, onednn, auto) */
    int rounds; /* --compare torch: rounds alternating the two sides (>= 1) */
} bench_opts;

/* Everything measured for one workload in one mode. */
typedef struct bench_result {
    const bench_workload *wl;
    bool compiled;
    bool ok;           /* ran every step without an error */
    bool leak;         /* live bytes grew */
    char error[512];   /* why !ok or leak */
    int n;             /* timed steps */
    double fwd_med, fwd_min, bwd_med, bwd_min; /* ms over the timed steps */
    double first_fwd_ms, first_bwd_ms;         /* step 0 (includes compile) */
    int64_t peak_bytes;      /* max over timed steps of the step's peak */
    int64_t step_peak_bytes; /* max over timed steps of peak - live at step start */
    int64_t live_setup;      /* live bytes right after setup */
    int64_t live_first, live_last; /* after step 0 and after the last step */
    int64_t live_before, live_after; /* before setup, after teardown */
    int64_t param_elems;
    double loss_first, loss_last;
    double grad_norm_first; /* sqrt(sum over params of sum(grad^2)) after step 0 */
    /* compiled autograd (whole run, and the timed steps alone) */
    gj_ca_stats ca_first, ca_all, ca_timed;
} bench_result;

/* Median of v[0..n) (sorts v in place); n >= 1. */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double min_of(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] < m ? v[i] : m;
    return m;
}

static int64_t live_bytes(void) {
    gj_mem m;
    gj_mem_stats(&m);
    return m.live_bytes;
}

/* "model name" of the first CPU in /proc/cpuinfo, into buf. */
static void cpu_model(char *buf, size_t cap) {
    snprintf(buf, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) != 0)
            continue;
        char *c = strchr(line, ':');
        if (!c)
            continue;
        c++;
        while (*c == ' ' || *c == '\t')
            c++;
        size_t n = strcspn(c, "\n");
        snprintf(buf, cap, "%.*s", (int)n, c);
        break;
    }
    fclose(f);
}

static void ca_diff(gj_ca_stats *out, const gj_ca_stats *a, const gj_ca_stats *b) {
    out->backwards = a->backwards - b->backwards;
    out->compiles = a->compiles - b->compiles;
    out->mem_hits = a->mem_hits - b->mem_hits;
    out->disk_hits = a->disk_hits - b->disk_hits;
    out->fallbacks = a->fallbacks - b->fallbacks;
    out->compile_ms = a->compile_ms - b->compile_ms;
    out->run_ms = a->run_ms - b->run_ms;
}

/* Global L2 norm of the .grad of every parameter, computed in f64 outside the
 * library's kernels (to compare eager and compiled gradients). NaN on error. */
static double grad_norm(bench_state *s) {
    double total = 0.0;
    for (int i = 0; i < s->n_params; i++) {
        gj_tensor *g = gj_tensor_grad(s->params[i]);
        int64_t n = g ? gj_tensor_numel(g) : 0;
        double *v = g ? malloc((size_t)n * sizeof *v) : NULL;
        if (!v || gj_tensor_to_f64(g, v) != 0) {
            free(v);
            return NAN;
        }
        for (int64_t j = 0; j < n; j++)
            total += v[j] * v[j];
        free(v);
    }
    return sqrt(total);
}

/* One training step of workload wl: forward (timed), backward (timed), checks
 * that every parameter received a .grad of its own dtype, the untimed
 * after_backward hook, then clears the grads. All temporaries live in one
 * scope. Writes the times, peak bytes, loss and (if gnorm) the gradient norm;
 * 0 on success, else -1 with r->error set. */
static int run_step(const bench_workload *wl, bench_state *s, bench_result *r, double *fwd_ms,
                    double *bwd_ms, int64_t *peak, int64_t *step_peak, double *loss_out,
                    double *gnorm) {
    int rc = -1;
    gj_scope_push();
    gj_mem_reset_peak();
    int64_t live0 = live_bytes();

    double t0 = bench_now_ms();
    gj_tensor *loss = bench_forward(wl, s);
    double t1 = bench_now_ms();
    if (!loss) {
        snprintf(r->error, sizeof r->error, "forward failed: %s", gj_last_error());
        goto fail;
    }
    if (gj_backward(loss, NULL) != 0) {
        snprintf(r->error, sizeof r->error, "backward failed: %s", gj_last_error());
        goto fail;
    }
    double t2 = bench_now_ms();
    gj_mem m;
    gj_mem_stats(&m);

    *fwd_ms = t1 - t0;
    *bwd_ms = t2 - t1;
    *peak = m.peak_bytes;
    *step_peak = m.peak_bytes - live0;
    *loss_out = gj_tensor_item(loss);
    for (int i = 0; i < s->n_params; i++) {
        gj_tensor *g = gj_tensor_grad(s->params[i]);
        if (!g || gj_tensor_dtype(g) != gj_tensor_dtype(s->params[i]) ||
            gj_tensor_numel(g) != gj_tensor_numel(s->params[i])) {
            snprintf(r->error, sizeof r->error,
                     "backward left parameter %d without a .grad of its dtype and size", i);
            goto fail;
        }
    }
    if (gnorm)
        *gnorm = grad_norm(s);
    if (wl->after_backward && wl->after_backward(s) != 0) {
        snprintf(r->error, sizeof r->error, "after-backward step failed: %s", gj_last_error());
        goto fail;
    }
    rc = 0;
fail:
    for (int i = 0; i < s->n_params; i++) {
        gj_tensor *g = gj_tensor_grad(s->params[i]);
        if (g_keep_grads && g && rc == 0)
            gj_zero_(g); /* zero_grad(set_to_none=False): reused next step */
        else
            gj_tensor_set_grad(s->params[i], NULL);
    }
    gj_scope_pop();
    return rc;
}

/* Runs warmup + steps steps of wl in one mode and fills r. The compiled
 * flag is restored to off on return. */
static void run_workload(const bench_workload *wl, bool compiled, const bench_opts *o,
                         bench_result *r) {
    int total = o->warmup + o->steps;
    double *fwd = calloc((size_t)o->steps, sizeof *fwd);
    double *bwd = calloc((size_t)o->steps, sizeof *bwd);
    bench_state s = {0};
    gj_ca_stats before_timed = {0};
    memset(r, 0, sizeof *r);
    r->wl = wl;
    r->compiled = compiled;
    r->n = o->steps;
    if (!fwd || !bwd) {
        snprintf(r->error, sizeof r->error, "out of memory");
        goto done;
    }

    gj_set_compiled_autograd(compiled);
    gj_compiled_autograd_reset_stats();
    gj_clear_error();
    r->live_before = live_bytes();
    gj_manual_seed(BENCH_SEED);
    if (wl->setup(&s) != 0) {
        snprintf(r->error, sizeof r->error, "setup failed: %s", gj_last_error());
        goto done;
    }
    r->param_elems = s.param_elems;
    r->live_setup = live_bytes();

    for (int i = 0; i < total; i++) {
        if (i == o->warmup)
            gj_compiled_autograd_stats(&before_timed);
        double f = 0.0, b = 0.0, loss = 0.0;
        int64_t peak = 0, step_peak = 0;
        if (run_step(wl, &s, r, &f, &b, &peak, &step_peak, &loss,
                     i == 0 ? &r->grad_norm_first : NULL) != 0) {
            char tmp[sizeof r->error];
            snprintf(tmp, sizeof tmp, "step %d: %.480s", i, r->error);
            memcpy(r->error, tmp, sizeof tmp);
            goto done;
        }
        int64_t live = live_bytes();
        if (i == 0) {
            r->first_fwd_ms = f;
            r->first_bwd_ms = b;
            r->loss_first = loss;
            r->live_first = live;
            gj_compiled_autograd_stats(&r->ca_first);
        }
        r->loss_last = loss;
        r->live_last = live;
        if (i >= o->warmup) {
            int k = i - o->warmup;
            fwd[k] = f;
            bwd[k] = b;
            if (peak > r->peak_bytes)
                r->peak_bytes = peak;
            if (step_peak > r->step_peak_bytes)
                r->step_peak_bytes = step_peak;
        }
    }
    gj_compiled_autograd_stats(&r->ca_all);
    if (o->warmup == 0)
        memset(&before_timed, 0, sizeof before_timed);
    ca_diff(&r->ca_timed, &r->ca_all, &before_timed);
    r->fwd_min = min_of(fwd, o->steps);
    r->bwd_min = min_of(bwd, o->steps);
    r->fwd_med = median(fwd, o->steps);
    r->bwd_med = median(bwd, o->steps);
    r->ok = true;

done:
    bench_state_free(&s);
    gj_set_compiled_autograd(false);
    r->live_after = live_bytes();
    if (r->ok && r->live_last != r->live_first) {
        r->leak = true;
        snprintf(r->error, sizeof r->error,
                 "live tensor bytes grew across steps: %lld after step 0, %lld after step %d",
                 (long long)r->live_first, (long long)r->live_last, total - 1);
    } else if (r->ok && r->live_after != r->live_before) {
        r->leak = true;
        snprintf(r->error, sizeof r->error,
                 "live tensor bytes %lld before setup, %lld after teardown",
                 (long long)r->live_before, (long long)r->live_after);
    }
    free(fwd);
    free(bwd);
}

/* ------------------------------------------------------------ output */

static double mib(int64_t b) { return (double)b / (1024.0 * 1024.0); }

static void print_header(const char *cpu, const gj_info *info, const bench_opts *o) {
    printf("gradjit %s | CPU: %s | threads: %d | BLAS core: %s\n", info->version, cpu,
           info->num_threads, info->blas_core ? info->blas_core : "?");
    printf("BLAS config: %s\n", info->blas_config ? info->blas_config : "?");
    printf("%d timed steps (median / min) after %d warm-up steps, seed %u, float32 unless "
           "stated, .grad %s between steps\n\n",
           o->steps, o->warmup, BENCH_SEED,
           g_keep_grads ? "kept and zeroed" : "set to none");
    printf("%-3s %-13s %-8s %9s %9s %9s %9s %9s %9s %10s %10s %7s %5s %12s  %s\n", "id", "name",
           "mode", "fwd med", "fwd min", "bwd med", "bwd min", "peak MiB", "step MiB",
           "1st bwd ms", "compile ms", "hits", "fb", "loss", "note");
}

static void print_row(const bench_result *r) {
    const char *mode = r->compiled ? "compiled" : "eager";
    if (!r->ok) {
        printf("%-3s %-13s %-8s FAILED: %s\n", r->wl->id, r->wl->name, mode, r->error);
        return;
    }
    char hits[32] = "-", fb[24] = "-", comp[24] = "-";
    if (r->compiled) {
        snprintf(hits, sizeof hits, "%lld/%d",
                 (long long)(r->ca_timed.mem_hits + r->ca_timed.disk_hits), r->n);
        snprintf(fb, sizeof fb, "%lld", (long long)r->ca_all.fallbacks);
        if (r->ca_first.compiles == 0 && r->ca_first.disk_hits > 0)
            snprintf(comp, sizeof comp, "disk hit");
        else
            snprintf(comp, sizeof comp, "%.1f", r->ca_first.compile_ms);
    }
    printf("%-3s %-13s %-8s %9.3f %9.3f %9.3f %9.3f %9.1f %9.1f %10.3f %10s %7s %5s %12.6g  %s\n",
           r->wl->id, r->wl->name, mode, r->fwd_med, r->fwd_min, r->bwd_med, r->bwd_min,
           mib(r->peak_bytes), mib(r->step_peak_bytes), r->first_bwd_ms, comp, hits, fb,
           r->loss_first, r->wl->note ? r->wl->note : "");
}

/* Warnings below the table: fallbacks, a compiled path that never engaged,
 * leaks, and the live-bytes check itself. */
static void print_checks(const bench_result *r) {
    const char *mode = r->compiled ? "compiled" : "eager";
    if (!r->ok)
        return;
    printf("  %s %-8s live bytes: before setup %lld, after setup %lld, after step 0 %lld, "
           "after last step %lld, after teardown %lld -> %s\n",
           r->wl->id, mode, (long long)r->live_before, (long long)r->live_setup,
           (long long)r->live_first, (long long)r->live_last, (long long)r->live_after,
           r->leak ? "LEAK" : "flat");
    if (r->leak)
        printf("  %s %-8s LEAK: %s\n", r->wl->id, mode, r->error);
    if (!r->compiled)
        return;
    const gj_ca_stats *a = &r->ca_all;
    printf("  %s compiled: %lld backwards, %lld compiles (%.1f ms), %lld memory hits, %lld disk "
           "hits, %lld fallbacks, run %.1f ms\n",
           r->wl->id, (long long)a->backwards, (long long)a->compiles, a->compile_ms,
           (long long)a->mem_hits, (long long)a->disk_hits, (long long)a->fallbacks, a->run_ms);
    if (a->backwards == 0)
        printf("  %s WARNING: the compiled-autograd flag was on but no backward went through "
               "the compiled path (stats.backwards == 0)\n",
               r->wl->id);
    if (a->fallbacks > 0)
        printf("  %s WARNING: %lld of %lld backwards FELL BACK to the eager engine; its times "
               "are eager times (GRADJIT_LOG=fallback prints the reason)\n",
               r->wl->id, (long long)a->fallbacks, (long long)a->backwards);
}

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void json_num(FILE *f, double v) {
    if (isfinite(v))
        fprintf(f, "%.6g", v);
    else
        fputs("null", f);
}

static void json_ca(FILE *f, const char *key, const gj_ca_stats *s) {
    fprintf(f, "      \"%s\": {\"backwards\": %lld, \"compiles\": %lld, \"mem_hits\": %lld, "
               "\"disk_hits\": %lld, \"fallbacks\": %lld, \"compile_ms\": ",
            key, (long long)s->backwards, (long long)s->compiles, (long long)s->mem_hits,
            (long long)s->disk_hits, (long long)s->fallbacks);
    json_num(f, s->compile_ms);
    fputs(", \"run_ms\": ", f);
    json_num(f, s->run_ms);
    fputs("}", f);
}

/* Writes the whole run as JSON (with the PyTorch side when torch is not
 * NULL); 0 on success. */
static int write_json(const char *path, const char *cpu, const char *date, const gj_info *info,
                      const bench_opts *o, const bench_result *res, int n,
                      const torch_run *torch) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "gradjit-bench: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    fputs("{\n  \"gradjit_version\": ", f);
    json_str(f, info->version);
    fputs(",\n  \"date\": ", f);
    json_str(f, date);
    fputs(",\n  \"cpu\": ", f);
    json_str(f, cpu);
    fprintf(f, ",\n  \"threads\": %d,\n  \"blas_core\": ", info->num_threads);
    json_str(f, info->blas_core);
    fputs(",\n  \"blas_config\": ", f);
    json_str(f, info->blas_config);
    fprintf(f, ",\n  \"steps\": %d,\n  \"warmup\": %d,\n  \"seed\": %u,\n  \"results\": [\n",
            o->steps, o->warmup, BENCH_SEED);
    for (int i = 0; i < n; i++) {
        const bench_result *r = &res[i];
        fputs("    {\"id\": ", f);
        json_str(f, r->wl->id);
        fputs(", \"name\": ", f);
        json_str(f, r->wl->name);
        fputs(", \"shape\": ", f);
        json_str(f, r->wl->shape);
        fprintf(f, ", \"mode\": \"%s\", \"ok\": %s, \"leak\": %s", r->compiled ? "compiled" : "eager",
                r->ok ? "true" : "false", r->leak ? "true" : "false");
        if (r->wl->note) {
            fputs(", \"note\": ", f);
            json_str(f, r->wl->note);
        }
        if (!r->ok || r->leak) {
            fputs(", \"error\": ", f);
            json_str(f, r->error);
        }
        if (r->ok) {
            fprintf(f, ",\n      \"steps\": %d, \"param_elems\": %lld", r->n,
                    (long long)r->param_elems);
            const char *k[] = {"fwd_ms_median", "fwd_ms_min", "bwd_ms_median", "bwd_ms_min",
                               "first_fwd_ms", "first_bwd_ms", "loss_first", "loss_last",
                               "grad_norm_first"};
            double v[] = {r->fwd_med, r->fwd_min, r->bwd_med, r->bwd_min,     r->first_fwd_ms,
                          r->first_bwd_ms, r->loss_first, r->loss_last, r->grad_norm_first};
            for (int j = 0; j < 9; j++) {
                fprintf(f, ", \"%s\": ", k[j]);
                json_num(f, v[j]);
            }
            fprintf(f, ",\n      \"peak_bytes\": %lld, \"step_peak_bytes\": %lld, "
                       "\"live_bytes_before\": %lld, \"live_bytes_after\": %lld, "
                       "\"live_bytes_step0\": %lld, \"live_bytes_last_step\": %lld",
                    (long long)r->peak_bytes, (long long)r->step_peak_bytes,
                    (long long)r->live_before, (long long)r->live_after,
                    (long long)r->live_first, (long long)r->live_last);
            if (r->compiled) {
                fputs(",\n", f);
                json_ca(f, "compiled_first_step", &r->ca_first);
                fputs(",\n", f);
                json_ca(f, "compiled_timed_steps", &r->ca_timed);
                fputs(",\n", f);
                json_ca(f, "compiled_all_steps", &r->ca_all);
            }
        }
        fprintf(f, "}%s\n", i + 1 < n ? "," : "");
    }
    fputs("  ]", f);
    if (torch) {
        fprintf(f, ",\n  \"compare_torch\": {\"available\": %s, \"why\": ",
                torch->available ? "true" : "false");
        json_str(f, torch->why);
        fputs(", \"omp_wait_policy\": ", f);
        json_str(f, torch->omp_wait_policy);
        fputs(", \"wall_s\": ", f);
        json_num(f, torch->wall_s);
        fputs(",\n    \"torch\": ", f);
        fputs(torch->json_text ? torch->json_text : "null", f);
        fputs("}", f);
    }
    fputs("\n}\n", f);
    if (fclose(f) != 0) {
        fprintf(stderr, "gradjit-bench: error writing %s\n", path);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------- --compare torch */

/* The result of workload id in one mode, or NULL (not run or failed). */
static const bench_result *find_result(const bench_result *res, int n, const char *id,
                                       bool compiled) {
    for (int i = 0; i < n; i++)
        if (res[i].compiled == compiled && !strcmp(res[i].wl->id, id) && res[i].ok)
            return &res[i];
    return NULL;
}

/* "%9.3f" of v, or "-" when v is not finite. */
static const char *fmt_ms(char *buf, size_t cap, double v, const char *fmt) {
    if (isfinite(v))
        snprintf(buf, cap, fmt, v);
    else
        snprintf(buf, cap, "-");
    return buf;
}

/* One table: PyTorch eager, gradjit eager, gradjit compiled (forward and
 * backward medians) and the ratios PyTorch time / gradjit time. */
static void print_compare(const bench_opts *o, const bench_result *res, int n,
                          const torch_run *t, const gj_info *info, const char *cpu,
                          const char *date) {
    printf("\nPyTorch comparison (%s, same run; CPU %s)\n", date, cpu);
    if (t->available) {
        printf("  PyTorch %s eager (%s): %d threads, OpenBLAS core %s, %d BLAS threads, "
               "OMP_WAIT_POLICY=%s\n",
               t->version, t->python, t->threads, t->blas_core, t->blas_threads,
               t->omp_wait_policy);
        printf("  PyTorch BLAS: %s\n", t->blas_config[0] ? t->blas_config : "?");
    } else {
        printf("  PyTorch: not run: %s\n", t->why);
    }
    printf("  gradjit %s: %d threads, OpenBLAS core %s\n", info->version, info->num_threads,
           info->blas_core ? info->blas_core : "?");
    if (t->available && info->blas_core && strcmp(t->blas_core, info->blas_core) != 0)
        printf("  WARNING: the two sides run different OpenBLAS cores (%s vs %s)\n",
               t->blas_core, info->blas_core);
    if (t->available && t->threads != info->num_threads)
        printf("  WARNING: PyTorch ran %d threads, gradjit %d\n", t->threads, info->num_threads);
    printf("  median ms of %d steps after %d warm-up; ratio = PyTorch ms / gradjit ms "
           "(above 1: gradjit faster)\n\n",
           o->steps, o->warmup);
    printf("%-3s %-13s | %27s | %27s | %23s | %23s\n", "", "", "forward ms",
           "backward ms", "bwd ratio", "fwd+bwd ratio");
    printf("%-3s %-13s | %8s %8s %9s | %8s %8s %9s | %11s %11s | %11s %11s\n", "id", "name",
           "PyTorch", "gj eager", "gj compl", "PyTorch", "gj eager", "gj compl", "eager",
           "compiled", "eager", "compiled");
    for (int w = 0; w < bench_n_workloads; w++) {
        const bench_workload *wl = &bench_workloads[w];
        if (!(o->workloads & (1u << w)))
            continue;
        const torch_row *tr = t->available ? bench_torch_find(t, wl->id) : NULL;
        const bench_result *e = find_result(res, n, wl->id, false);
        const bench_result *c = find_result(res, n, wl->id, true);
        double tf = tr && tr->ok ? tr->fwd_med : NAN, tb = tr && tr->ok ? tr->bwd_med : NAN;
        double ef = e ? e->fwd_med : NAN, eb = e ? e->bwd_med : NAN;
        double cf = c ? c->fwd_med : NAN, cb = c ? c->bwd_med : NAN;
        char b[10][32];
        printf("%-3s %-13s | %8s %8s %9s | %8s %8s %9s | %11s %11s | %11s %11s\n", wl->id,
               wl->name, fmt_ms(b[0], 32, tf, "%.2f"), fmt_ms(b[1], 32, ef, "%.2f"),
               fmt_ms(b[2], 32, cf, "%.2f"), fmt_ms(b[3], 32, tb, "%.2f"),
               fmt_ms(b[4], 32, eb, "%.2f"), fmt_ms(b[5], 32, cb, "%.2f"),
               fmt_ms(b[6], 32, tb / eb, "%.2fx"), fmt_ms(b[7], 32, tb / cb, "%.2fx"),
               fmt_ms(b[8], 32, (tf + tb) / (ef + eb), "%.2fx"),
               fmt_ms(b[9], 32, (tf + tb) / (cf + cb), "%.2fx"));
        if (tr && !tr->ok)
            printf("    PyTorch %s FAILED: %s\n", wl->id, tr->error);
        if (c && c->ca_all.fallbacks > 0)
            printf("    %s: %lld compiled backwards fell back to eager\n", wl->id,
                   (long long)c->ca_all.fallbacks);
    }
}

/* Bar chart of the forward and backward medians (two panels, one bar per
 * system and workload) as a PNG. 0 on success. */
static int write_png_chart(const char *path, const bench_opts *o, const bench_result *res, int n,
                           const torch_run *t, const gj_info *info, const char *cpu,
                           const char *date) {
    const char *groups[8];
    double fwd[8 * 3], bwd[8 * 3];
    int ng = 0;
    bool with_torch = t && t->available;
    int nb = with_torch ? 3 : 2;
    for (int w = 0; w < bench_n_workloads && ng < 8; w++) {
        const bench_workload *wl = &bench_workloads[w];
        if (!(o->workloads & (1u << w)))
            continue;
        const torch_row *tr = with_torch ? bench_torch_find(t, wl->id) : NULL;
        const bench_result *e = find_result(res, n, wl->id, false);
        const bench_result *c = find_result(res, n, wl->id, true);
        double *f = fwd + ng * nb, *b = bwd + ng * nb;
        int k = 0;
        if (with_torch) {
            f[k] = tr && tr->ok ? tr->fwd_med : NAN;
            b[k++] = tr && tr->ok ? tr->bwd_med : NAN;
        }
        f[k] = e ? e->fwd_med : NAN;
        b[k++] = e ? e->bwd_med : NAN;
        f[k] = c ? c->fwd_med : NAN;
        b[k] = c ? c->bwd_med : NAN;
        groups[ng++] = wl->id;
    }
    static const char *const labels3[3] = {"PyTorch eager", "gradjit eager", "gradjit compiled"};
    static const uint32_t colors3[3] = {0xe6550du, 0x6baed6u, 0x08519cu};
    const char *const *labels = with_torch ? labels3 : labels3 + 1;
    const uint32_t *colors = with_torch ? colors3 : colors3 + 1;
    plot_img im;
    if (plot_img_init(&im, 1100, 1020) != 0)
        return -1;
    char head[512];
    snprintf(head, sizeof head, "gradjit-bench %s: %s", date, cpu);
    plot_text(&im, 20, 12, head, PLOT_TEXT, 2);
    if (with_torch)
        snprintf(head, sizeof head, "%d threads, OpenBLAS %s | PyTorch %s eager vs gradjit %s",
                 info->num_threads, info->blas_core ? info->blas_core : "?", t->version,
                 info->version);
    else
        snprintf(head, sizeof head, "%d threads, OpenBLAS %s | gradjit %s eager vs compiled",
                 info->num_threads, info->blas_core ? info->blas_core : "?", info->version);
    plot_text(&im, 20, 36, head, PLOT_TEXT, 2);
    char title[128];
    snprintf(title, sizeof title, "forward ms (median of %d steps)", o->steps);
    plot_bar_panel(&im, 0, 60, 1100, 480, title, "ms", ng, groups, nb, labels, colors, fwd,
                   "%.1f");
    snprintf(title, sizeof title, "backward ms (median of %d steps)", o->steps);
    plot_bar_panel(&im, 0, 540, 1100, 480, title, "ms", ng, groups, nb, labels, colors, bwd,
                   "%.1f");
    int rc = plot_write_png(&im, path);
    plot_img_free(&im);
    return rc;
}

/* ----------------------------------------------------------- options */

static void usage(FILE *f) {
    fprintf(f, "usage: gradjit-bench [--workload W1|W2|W3|W4|W5|F1|G1|G2|all[,W..]] "
               "[--mode eager|compiled|both]\n"
               "                     [--steps N] [--warmup N] [--threads N] [--json FILE] "
               "[--png FILE]\n"
               "                     [--grads none|keep] "
               "[--compare torch [--rounds R] [--python PATH] [--torch-script PATH]]\n"
               "                     [--ddp [--bucket-mb X]]   under mpirun: allreduce/backward "
               "overlap of gj_ddp, eager and compiled (W1, W4n by default; --paired N rounds);\n"
               "                     with --step [--zero 1|2|3]: the eager vs the compiled DDP "
               "training step (gj_step_opts.ddp; with ZeRO's stage), paired\n"
               "                     [--paired N [--symbolic | --step]]   N >= 30 interleaved "
               "eager/compiled pairs (ABBA), median ratio and IQR;\n"
               "                     with --symbolic: specialised / symbolic compiled program "
               "(dynamic shapes) of the same size;\n"
               "                     with --step: whole training steps (forward, backward, "
               "AdamW update; gj_step) eager / compiled, and the step's bound;\n"
               "                     with --step --gemm-pair: compiled steps with OpenBLAS "
               "pinned / with the GEMM provider chosen per shape (auto);\n"
               "                     with --step --bf16-pair: compiled steps in f32 / in bf16 "
               "mixed precision (autocast);\n"
               "                     with --step --budget-pair: compiled steps without / with a "
               "memory budget of the planned peak less half the kept activations "
               "(gj_step_opts.mem_budget), peaks printed\n"
               "  --gemm default|openblas|onednn|auto: the GEMM provider of the whole run (default: "
               "GRADJIT_GEMM, else the default: each f32 GEMM shape measured once, the faster of "
               "oneDNN and OpenBLAS, where a cache directory keeps the choices, OpenBLAS where "
               "there is none (GRADJIT_CACHE_DIR=off); bf16 by oneDNN on CPUs with AVX512_BF16)\n"
               "  --compare torch: one side-by-side table, then R (default 5) rounds "
               "alternating gradjit and PyTorch, median ratio\n"
               "  workloads: W1 W2 W3 W4 W4n W5 F1 G1 (all), G2 (GPT-2 124M), F1b G1b G2b (F1, G1, "
               "G2 in bf16 mixed precision), G3 G3b (G1's model at B 1, T 1024, f32 and bf16), "
               "G1u (G1 with attention and the head op by op) only when named; "
               "FILE \"-\": no file\n");
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

/* Comma-separated list of workload ids (case-insensitive) or "all". */
static int parse_workloads(const char *arg, unsigned *out) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    *out = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (!strcasecmp(tok, "all")) {
            *out |= bench_all_workloads();
            continue;
        }
        int found = 0;
        for (int i = 0; i < bench_n_workloads; i++)
            if (!strcasecmp(tok, bench_workloads[i].id) ||
                !strcasecmp(tok, bench_workloads[i].name)) {
                *out |= 1u << i;
                found = 1;
            }
        if (!found)
            return -1;
    }
    return *out ? 0 : -1;
}

static int parse_opts(int argc, char **argv, bench_opts *o) {
    *o = (bench_opts){.workloads = bench_all_workloads(),
                      .mode = MODE_BOTH,
                      .steps = 10,
                      .warmup = 3,
                      .threads = 0,
                      .rounds = 5,
                      .python = "/usr/bin/python3"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(a, "--ddp")) { /* takes no value */
            o->ddp = true;
            continue;
        }
        if (!strcmp(a, "--symbolic")) { /* takes no value */
            o->symbolic = true;
            continue;
        }
        if (!strcmp(a, "--step")) { /* takes no value */
            o->step = true;
            continue;
        }
        if (!strcmp(a, "--gemm-pair")) { /* takes no value */
            o->gemm_pair = true;
            continue;
        }
        if (!strcmp(a, "--bf16-pair")) { /* takes no value */
            o->bf16_pair = true;
            continue;
        }
        if (!strcmp(a, "--budget-pair")) { /* takes no value */
            o->budget_pair = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "gradjit-bench: %s needs a value (or is unknown)\n", a);
            return -1;
        }
        i++;
        if (!strcmp(a, "--workload")) {
            if (parse_workloads(v, &o->workloads)) {
                fprintf(stderr, "gradjit-bench: unknown workload '%s'\n", v);
                return -1;
            }
            o->workloads_set = true;
        } else if (!strcmp(a, "--mode")) {
            if (!strcmp(v, "eager"))
                o->mode = MODE_EAGER;
            else if (!strcmp(v, "compiled"))
                o->mode = MODE_COMPILED;
            else if (!strcmp(v, "both"))
                o->mode = MODE_BOTH;
            else {
                fprintf(stderr, "gradjit-bench: --mode must be eager, compiled or both\n");
                return -1;
            }
        } else if (!strcmp(a, "--steps")) {
            if (parse_int(v, 1, BENCH_MAX_STEPS, &o->steps)) {
                fprintf(stderr, "gradjit-bench: --steps must be 1..%d\n", BENCH_MAX_STEPS);
                return -1;
            }
        } else if (!strcmp(a, "--warmup")) {
            if (parse_int(v, 0, BENCH_MAX_STEPS, &o->warmup)) {
                fprintf(stderr, "gradjit-bench: --warmup must be 0..%d\n", BENCH_MAX_STEPS);
                return -1;
            }
        } else if (!strcmp(a, "--threads")) {
            if (parse_int(v, 0, 4096, &o->threads)) {
                fprintf(stderr, "gradjit-bench: --threads must be 0..4096 (0: all cores)\n");
                return -1;
            }
        } else if (!strcmp(a, "--json")) {
            o->json_path = v;
        } else if (!strcmp(a, "--png")) {
            o->png_path = v;
        } else if (!strcmp(a, "--compare")) {
            if (strcmp(v, "torch") != 0) {
                fprintf(stderr, "gradjit-bench: --compare knows only 'torch'\n");
                return -1;
            }
            o->compare_torch = true;
        } else if (!strcmp(a, "--grads")) {
            if (strcmp(v, "none") != 0 && strcmp(v, "keep") != 0) {
                fprintf(stderr, "gradjit-bench: --grads must be none or keep\n");
                return -1;
            }
            g_keep_grads = !strcmp(v, "keep");
        } else if (!strcmp(a, "--rounds")) {
            if (parse_int(v, 1, BENCH_MAX_ROUNDS, &o->rounds)) {
                fprintf(stderr, "gradjit-bench: --rounds must be 1..%d\n", BENCH_MAX_ROUNDS);
                return -1;
            }
        } else if (!strcmp(a, "--paired")) {
            if (parse_int(v, 30, BENCH_MAX_STEPS, &o->pairs)) {
                fprintf(stderr, "gradjit-bench: --paired must be 30..%d pairs\n", BENCH_MAX_STEPS);
                return -1;
            }
        } else if (!strcmp(a, "--zero")) {
            if (parse_int(v, 1, 3, &o->zero)) {
                fprintf(stderr, "gradjit-bench: --zero must be ZeRO's stage 1, 2 or 3\n");
                return -1;
            }
        } else if (!strcmp(a, "--bucket-mb")) {
            char *end;
            o->bucket_mb = strtod(v, &end);
            if (*end || !(o->bucket_mb > 0) || o->bucket_mb > 4096) {
                fprintf(stderr, "gradjit-bench: --bucket-mb must be a size in MiB in (0, 4096]\n");
                return -1;
            }
        } else if (!strcmp(a, "--python")) {
            o->python = v;
        } else if (!strcmp(a, "--torch-script")) {
            o->torch_script = v;
        } else if (!strcmp(a, "--gemm")) {
            if (strcmp(v, "openblas") && strcmp(v, "onednn") && strcmp(v, "auto") &&
                strcmp(v, "default")) {
                fprintf(stderr, "gradjit-bench: --gemm takes default, openblas, onednn or auto, "
                                "not %s\n", v);
                return -1;
            }
            o->gemm = v;
        } else {
            fprintf(stderr, "gradjit-bench: unknown option %s\n", a);
            return -1;
        }
    }
    if (o->zero && !(o->ddp && o->step)) {
        fprintf(stderr, "gradjit-bench: --zero goes with --ddp --step\n");
        return -1;
    }
    if (o->step && ((!o->pairs && !o->ddp) || o->symbolic)) {
        fprintf(stderr, "gradjit-bench: --step goes with --paired N or --ddp (and not "
                        "--symbolic)\n");
        return -1;
    }
    if (o->gemm_pair && (!o->step || o->gemm)) {
        fprintf(stderr, "gradjit-bench: --gemm-pair goes with --paired N --step (and not --gemm)\n");
        return -1;
    }
    if (o->bf16_pair && (!o->step || o->gemm_pair || o->ddp)) {
        fprintf(stderr, "gradjit-bench: --bf16-pair goes with --paired N --step (and not "
                        "--gemm-pair or --ddp)\n");
        return -1;
    }
    if (o->budget_pair && (!o->step || o->gemm_pair || o->bf16_pair || o->ddp)) {
        fprintf(stderr, "gradjit-bench: --budget-pair goes with --paired N --step (and not "
                        "--gemm-pair, --bf16-pair or --ddp)\n");
        return -1;
    }
    if (o->compare_torch && !o->json_path)
        o->json_path = "gradjit-bench-compare.json";
    if (o->compare_torch && !o->png_path)
        o->png_path = "gradjit-bench-compare.png";
    return 0;
}

/* --compare torch with rounds > 1: the gradjit side (eager and compiled
 * runs of every selected workload, in this process) and the PyTorch process
 * take turns, gradjit first in even rounds and PyTorch first in odd ones;
 * each round gives a backward ratio PyTorch / gradjit per workload, and the
 * median over the rounds with its range is printed. */
static void compare_rounds(const bench_opts *o, const torch_request *req) {
    static double re[BENCH_MAX_ROUNDS][16], rc[BENCH_MAX_ROUNDS][16];
    int R = o->rounds, ids[16], nw = 0;
    for (int w = 0; w < bench_n_workloads && nw < 16; w++)
        if (o->workloads & (1u << w))
            ids[nw++] = w;
    printf("\n%d rounds alternating gradjit (this process) and PyTorch (a child process), each "
           "round %d steps after %d warm-up per side; ratio = PyTorch backward ms / gradjit "
           "backward ms (medians of the round)\n",
           R, o->steps, o->warmup);
    for (int r = 0; r < R; r++) {
        torch_run t = {0};
        bool torch_first = r % 2 == 1;
        bench_result e, c;
        double eb[16], cb[16];
        if (torch_first)
            bench_torch_run(req, &t);
        for (int k = 0; k < nw; k++) {
            run_workload(&bench_workloads[ids[k]], false, o, &e);
            run_workload(&bench_workloads[ids[k]], true, o, &c);
            eb[k] = e.ok ? e.bwd_med : NAN;
            cb[k] = c.ok ? c.bwd_med : NAN;
        }
        if (!torch_first)
            bench_torch_run(req, &t);
        if (!t.available) {
            printf("PyTorch rounds stopped: %s\n", t.why);
            bench_torch_free(&t);
            return;
        }
        for (int k = 0; k < nw; k++) {
            const torch_row *tr = bench_torch_find(&t, bench_workloads[ids[k]].id);
            double tb = tr && tr->ok ? tr->bwd_med : NAN;
            re[r][k] = tb / eb[k];
            rc[r][k] = tb / cb[k];
        }
        printf("  round %d/%d done (%s first)\n", r + 1, R, torch_first ? "PyTorch" : "gradjit");
        fflush(stdout);
        bench_torch_free(&t);
    }
    printf("%-4s %-13s %26s %26s\n", "id", "name", "PyTorch/gj eager [range]",
           "PyTorch/gj compiled [range]");
    for (int k = 0; k < nw; k++) {
        double ve[BENCH_MAX_ROUNDS], vc[BENCH_MAX_ROUNDS];
        for (int r = 0; r < R; r++) {
            ve[r] = re[r][k];
            vc[r] = rc[r][k];
        }
        double me = bench_quantile(ve, R, 0.5), mc = bench_quantile(vc, R, 0.5);
        printf("%-4s %-13s %9.3fx [%.2f-%.2f] %12.3fx [%.2f-%.2f]\n", bench_workloads[ids[k]].id,
               bench_workloads[ids[k]].name, me, ve[0], ve[R - 1], mc, vc[0], vc[R - 1]);
    }
}

/* --paired: every selected workload interleaved, one table, optional JSON. */
static int paired_main(const bench_opts *o, const char *cpu, const gj_info *info) {
    printf("gradjit %s | CPU: %s | threads: %d | BLAS core: %s\n", info->version, cpu,
           info->num_threads, info->blas_core ? info->blas_core : "?");
    if (o->symbolic)
        printf("%d pairs (ABBA) after %d warm-up steps per mode; ratio = specialised / symbolic "
               "compiled backward of the same size (< 1: the symbolic program is slower; "
               "0.952: 5%% slower), median [interquartile range]\n",
               o->pairs, o->warmup);
    else
        printf("%d pairs (ABBA) after %d warm-up steps per mode; ratio = eager / compiled "
               "backward (> 1: compiled faster), median [interquartile range]\n",
               o->pairs, o->warmup);
    bench_ceiling ceil;
    bench_ceiling_measure(&ceil, info->num_threads);
    bench_ceiling_print(&ceil);
    bench_paired_print_header(o->symbolic);
    bench_paired_result res[16];
    int n = 0, failed = 0;
    for (int w = 0; w < bench_n_workloads && n < 16; w++) {
        if (!(o->workloads & (1u << w)))
            continue;
        bench_paired_run(&bench_workloads[w], o->pairs, o->warmup, o->symbolic, &res[n]);
        if (res[n].ok) {
            bench_fma_peak_again(&ceil); /* the best of every round */
            bench_ceiling_bound(&ceil, &res[n], false);
            bench_ceiling_check(&ceil, &res[n]);
        }
        bench_paired_print_row(&res[n]);
        fflush(stdout);
        failed |= !res[n].ok;
        n++;
    }
    bench_ceiling_print_shapes(&ceil);
    printf("\n");
    bench_fma_peak_print(&ceil, "over the run");
    int beaten = 0;
    for (int i = 0; i < n; i++)
        beaten += res[i].ok && res[i].beaten;
    if (beaten)
        printf("WARNING: %d workload%s ran faster than a bound (lines above)\n", beaten,
               beaten == 1 ? "" : "s");
    if (o->json_path && strcmp(o->json_path, "-") != 0) {
        FILE *f = fopen(o->json_path, "w");
        if (!f) {
            fprintf(stderr, "gradjit-bench: cannot write %s\n", o->json_path);
            return 1;
        }
        fprintf(f, "{\n  \"cpu\": ");
        json_str(f, cpu);
        fprintf(f, ",\n  \"threads\": %d,\n  \"blas_core\": ", info->num_threads);
        json_str(f, info->blas_core ? info->blas_core : "");
        fprintf(f, ",\n  \"pairs\": %d,\n  \"ceiling\": ", o->pairs);
        bench_ceiling_json(f, &ceil);
        fprintf(f, ",\n  \"workloads\": [\n");
        for (int i = 0; i < n; i++) {
            const bench_paired_result *r = &res[i];
            fprintf(f, "    {\"id\": \"%s\", \"ok\": %s", r->wl->id, r->ok ? "true" : "false");
            const struct { const char *key; double v; } nums[] = {
                {"ratio_median", r->ratio_med}, {"ratio_q1", r->ratio_q1},
                {"ratio_q3", r->ratio_q3},      {"step_ratio_median", r->step_ratio_med},
                {"eager_bwd_ms", r->eager_ms},  {"compiled_bwd_ms", r->compiled_ms},
                {"bound_ms", r->bound_ms},      {"gemm_gflop", r->gemm_gflop},
                {"bytes_mb", r->bytes_mb},      {"peak_ms", r->peak_ms},
                {"eager_bwd_min_ms", r->eager_min_ms},
                {"compiled_bwd_min_ms", r->compiled_min_ms},
                {"peak_gflops_f32", r->peak_gflops},
                {"read_gbs", r->read_gbs},      {"write_gbs", r->write_gbs},
            };
            for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++) {
                fprintf(f, ", \"%s\": ", nums[k].key);
                json_num(f, nums[k].v);
            }
            fprintf(f,
                    ", \"bound_rechecked\": %s, \"bound_beaten\": %s, \"timed_fallbacks\": "
                    "%lld, \"timed_compiles\": %lld}%s\n",
                    r->rechecked ? "true" : "false", r->beaten ? "true" : "false",
                    r->timed_fallbacks, r->timed_compiles, i + 1 < n ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        if (fclose(f) != 0)
            failed = 1;
        else
            printf("wrote %s\n", o->json_path);
    }
    bench_ceiling_free(&ceil);
    return failed ? 1 : 0;
}

int main(int argc, char **argv) {
    bench_opts o;
    if (parse_opts(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    gj_set_num_threads(o.threads);
    gj_info info;
    gj_get_info(&info);
    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    if (o.ddp && o.step) /* W1 and W4n unless --workload says otherwise */
        return bench_ddp_step_main(o.workloads_set ? o.workloads : (1u << 0) | (1u << 4),
                                   o.pairs ? o.pairs : 30, cpu, o.zero);
    if (o.ddp)
        return bench_ddp_main(o.workloads_set ? o.workloads : (1u << 0) | (1u << 4),
                              o.pairs ? o.pairs : 30, o.bucket_mb > 0 ? o.bucket_mb : 25.0, cpu);
    if (o.gemm) {
        gj_gemm_provider gp = !strcmp(o.gemm, "openblas") ? GJ_GEMM_OPENBLAS
                              : !strcmp(o.gemm, "onednn") ? GJ_GEMM_ONEDNN
                              : !strcmp(o.gemm, "default") ? GJ_GEMM_DEFAULT
                                                          : GJ_GEMM_AUTO;
        if (gj_set_gemm_provider(gp) != 0) {
            fprintf(stderr, "gradjit-bench: --gemm %s: %s\n", o.gemm, gj_last_error());
            return 1;
        }
    }
    if (o.pairs > 0 && o.step)
        return bench_step_main(o.workloads, o.pairs, o.warmup, o.json_path, cpu, o.gemm_pair,
                               o.bf16_pair, o.budget_pair);
    if (o.pairs > 0)
        return paired_main(&o, cpu, &info);
    print_header(cpu, &info, &o);

    bench_result res[2 * 16];
    int n = 0, failed = 0;
    for (int w = 0; w < bench_n_workloads; w++) {
        if (!(o.workloads & (1u << w)))
            continue;
        const bench_workload *wl = &bench_workloads[w];
        int first = n;
        if (o.mode & MODE_EAGER) {
            run_workload(wl, false, &o, &res[n]);
            print_row(&res[n]);
            fflush(stdout);
            n++;
        }
        if (o.mode & MODE_COMPILED) {
            run_workload(wl, true, &o, &res[n]);
            print_row(&res[n]);
            fflush(stdout);
            n++;
        }
        for (int i = first; i < n; i++)
            failed |= !res[i].ok || res[i].leak;
        if (o.mode == MODE_BOTH && res[first].ok && res[first + 1].ok) {
            const bench_result *e = &res[first], *c = &res[first + 1];
            double rel = fabs(c->loss_first - e->loss_first) /
                         fmax(fabs(e->loss_first), 1e-30);
            double grel = fabs(c->grad_norm_first - e->grad_norm_first) /
                          fmax(fabs(e->grad_norm_first), 1e-30);
            printf("  %s compiled/eager backward speedup: %.2fx (eager %.3f ms / compiled %.3f "
                   "ms median); step 0: loss rel. diff %.2e, grad-norm rel. diff %.2e%s\n",
                   wl->id, e->bwd_med / c->bwd_med, e->bwd_med, c->bwd_med, rel, grel,
                   c->ca_all.backwards == 0 ? " [compiled path NOT engaged: both rows are eager]"
                   : c->ca_all.fallbacks   ? " [compiled run had fallbacks]"
                                           : "");
        }
    }
    printf("\nchecks:\n");
    for (int i = 0; i < n; i++)
        print_checks(&res[i]);

    char date[64];
    time_t now = time(NULL);
    struct tm tm_now;
    strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime_r(&now, &tm_now));
    torch_run torch = {0};
    if (o.compare_torch) {
        char list[64] = "";
        bool ckpt = false;
        for (int w = 0; w < bench_n_workloads; w++)
            if (o.workloads & (1u << w)) {
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                         list[0] ? "," : "", bench_workloads[w].id);
                ckpt |= bench_workloads[w].checkpointed;
            }
        torch_request req = {o.python, o.torch_script ? o.torch_script
                                                      : bench_torch_default_script(),
                             list, o.steps, o.warmup, info.num_threads, info.blas_core, ckpt};
        printf("\nrunning the same workloads in PyTorch: %s %s ...\n", req.python, req.script);
        fflush(stdout);
        bench_torch_run(&req, &torch);
        if (!torch.available)
            printf("PyTorch comparison skipped: %s\n", torch.why);
        print_compare(&o, res, n, &torch, &info, cpu, date);
        if (torch.available && o.rounds > 1)
            compare_rounds(&o, &req);
    }
    if (o.json_path && strcmp(o.json_path, "-") == 0) /* "-": no file */
        o.json_path = NULL;
    if (o.png_path && strcmp(o.png_path, "-") == 0)
        o.png_path = NULL;
    if (o.json_path) {
        if (write_json(o.json_path, cpu, date, &info, &o, res, n,
                       o.compare_torch ? &torch : NULL) != 0)
            failed = 1;
        else
            printf("\nwrote %s\n", o.json_path);
    }
    if (o.png_path) {
        if (write_png_chart(o.png_path, &o, res, n, o.compare_torch ? &torch : NULL, &info, cpu,
                            date) != 0)
            failed = 1;
        else
            printf("wrote %s\n", o.png_path);
    }
    bench_torch_free(&torch);
    if (failed)
        fprintf(stderr, "gradjit-bench: FAILED (see rows marked FAILED or LEAK)\n");
    return failed ? 1 : 0;
}
