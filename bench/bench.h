/* SPDX-License-Identifier: MIT */
/*
 * bench.h - the reference workloads of docs/benchmarks.md (W1..W5, F1, G1, G2) as
 * seen by the benchmark driver (bench.c). Written against the public API
 * only (and examples/gpt2_model.h for G1, G2).
 *
 * Invariants: a workload owns every tensor it creates in setup (parameters,
 * inputs, master copies, a model object and an optimizer) and releases them
 * all in teardown; forward runs inside the driver's open scope, so every
 * temporary it makes belongs to that scope. params[0..n_params) are exactly
 * the leaves that require grad: the driver clears their .grad between steps
 * and checks that backward wrote one for each. forward reads its inputs
 * only from in[0..n_in), so a step function handed those tensors as its
 * inputs (step.c) computes from its inputs.
 */
#ifndef GJ_BENCH_H
#define GJ_BENCH_H

#include "gradjit.h"

#include <stdio.h>

#define BENCH_MAX_PARAMS 160 /* G2: 2 + 12 x 12 + 2 GPT-2 leaves */
#define BENCH_MAX_OWNED 96

typedef struct bench_state {
    gj_tensor *params[BENCH_MAX_PARAMS]; /* leaves requiring grad (borrowed from owned) */
    int n_params;
    gj_tensor *owned[BENCH_MAX_OWNED]; /* every tensor the workload holds a reference to */
    int n_owned;
    gj_tensor *masters[BENCH_MAX_PARAMS]; /* W5: f32 master copy of params[i] (borrowed) */
    gj_tensor *in[4];                     /* inputs: x, labels, mask (borrowed) */
    int n_in;                             /* of in[] */
    int64_t param_elems;                  /* total elements in params */
    void *model;                          /* G1, G2: the gpt2 (owned), or NULL */
    void (*model_free)(void *model);
    gj_optim *opt;                        /* G1, G2: AdamW of after_backward (owned) */
} bench_state;

typedef struct bench_workload {
    const char *id;   /* "W1" */
    const char *name; /* "mlp" */
    const char *shape; /* one-line description of the shapes */
    const char *note;  /* printed in the row, or NULL */
    /* Creates parameters and inputs (seeded by the driver). 0 on success. */
    int (*setup)(bench_state *s);
    /* One forward pass to the scalar loss: a new reference owned by the open
     * scope, or NULL with gj_last_error() set. */
    gj_tensor *(*forward)(bench_state *s);
    /* Untimed work after backward (W5: SGD on the masters). May be NULL. */
    int (*after_backward)(bench_state *s);
    /* Runs its layers in activation-checkpoint regions (the PyTorch side of
     * --compare torch then uses torch.utils.checkpoint too). */
    bool checkpointed;
    /* GEMM FLOPs of one forward (2 M N K per product), counted from the
     * shapes (step.c's bound). */
    double (*fwd_flops)(const bench_state *s);
    /* The step of --paired --step: AdamW with this learning rate and weight
     * decay (betas 0.9/0.999, eps 1e-8). */
    double step_lr, step_wd;
    /* Why the workload has no --step row (its update is no optimizer's), or
     * NULL. */
    const char *no_step;
    /* Not in "all" (nor the default selection): run only when named. */
    bool opt_in;
    /* GJ_BF16: mixed precision (gj_set_autocast around the forward, the
     * step's opts.autocast); GJ_F32: off. */
    gj_dtype autocast;
} bench_workload;

/* Registry of the workloads: W1, W2, W3, W4, W4n, W5, F1, G1, G2, then F1b,
 * G1b and G2b (F1, G1 and G2 in bf16 mixed precision) (bit i of a
 * selection is bench_workloads[i]; the order only grows at the end). */
extern const bench_workload bench_workloads[];
extern const int bench_n_workloads;
/* The selection "all": every workload that is not opt_in. */
unsigned bench_all_workloads(void);

/* wl's forward on s under wl's autocast setting (restored after): the
 * workloads' one entry outside a gj_step. */
gj_tensor *bench_forward(const bench_workload *wl, bench_state *s);

#define BENCH_SEED 20240611u /* every workload's weights and data */

/* One workload's --paired result (paired.c). Ratios are eager / compiled
 * backward time per pair; quantiles over the pairs. */
typedef struct bench_paired_result {
    const bench_workload *wl;
    bool ok;
    char error[384];
    int pairs;
    double ratio_med, ratio_q1, ratio_q3; /* backward, eager / compiled */
    double step_ratio_med;                /* forward + backward */
    double eager_ms, compiled_ms;         /* median backward times */
    double compile_ms;                    /* spent compiling during warm-up */
    long long timed_compiles, timed_fallbacks, timed_backwards;
    double eager_min_ms, compiled_min_ms; /* the fastest backward of each side */
    /* the machine's ceiling for this backward (ceiling.c), 0 if unknown */
    double gemm_gflop, bytes_mb, bound_ms;
    /* the same with the GEMMs at the FMA peak (fma_peak.c): no GEMM can
     * pass it, so eager_ms / peak_ms is the largest ratio any compiled
     * program could reach on this machine; 0 if unknown */
    double peak_ms;
    /* the rates those were made with: the f32 peak (GFLOP/s) and the
     * bandwidth at the working set's size (GB/s) */
    double peak_gflops, read_gbs, write_gbs;
    /* bench_ceiling_check: a measured time was below bound_ms or peak_ms,
     * so the rates were measured again (rechecked); still below after that
     * (beaten: the row prints a warning) */
    bool rechecked, beaten;
    /* --symbolic: the two sides are the specialised compiled program
     * ("eager" fields) and the symbolic one (GJ_CA_DYNAMIC_ALWAYS,
     * "compiled" fields) of the same key */
    bool symbolic;
} bench_paired_result;

/* Interleaves eager and compiled steps of wl (ABBA), after `warmup` steps
 * of each (symbolic: specialised and symbolic compiled steps); fills r
 * (r->ok false with r->error on failure). */
void bench_paired_run(const bench_workload *wl, int pairs, int warmup, bool symbolic,
                      bench_paired_result *r);
void bench_paired_print_header(bool symbolic);
void bench_paired_print_row(const bench_paired_result *r);
/* The q-quantile of v[0..n) (sorts v). */
double bench_quantile(double *v, int n, double q);

/* The machine's ceiling (ceiling.c): copy bandwidth, and the GEMM rates of
 * the compiled programs' GEMM steps at 1 and all threads. */
#define BENCH_MAX_SHAPES 256
#define BENCH_MAX_PEAK_ROUNDS 64
typedef struct bench_gemm_rate {
    char workload[8];
    gj_ca_gemm g;
    double gflops_1, gflops_n; /* the best of every time it was timed */
} bench_gemm_rate;
/* One kind of arithmetic's peak (fma_peak.c), GFLOP/s over every round of
 * the run; all 0 where the CPU lacks it. */
typedef struct bench_peak {
    double all;     /* the best timed run of every thread at once */
    double all_low; /* the slowest timed run of every thread at once */
    double one;     /* the best timed run of one thread alone */
    double rate;    /* what bounds use: the larger of all and threads x one */
} bench_peak;
typedef struct bench_ceiling {
    int threads;
    double copy_gbs, read_gbs, write_gbs; /* GB/s, all threads */
    uint64_t sink;                         /* keeps the read pass */
    /* the peaks (fma_peak.c): f32 and f64 vector FMAs, bf16 dot products
     * (AVX512_BF16 vdpbf16ps) and bf16 tile products (AMX tdpbf16ps) */
    bench_peak f32, f64, bf16_dp, bf16_amx;
    /* the rates bounds use (bench_gemm_peak), GFLOP/s; 0 if unknown. bf16
     * is the fastest of f32 (a bf16 GEMM can be run in f32), the dot
     * product and the tiles */
    double peak_gflops_f32, peak_gflops_f64, peak_gflops_bf16;
    const char *fma_isa;  /* the vectors the FMAs ran on, or NULL (no peak) */
    bool has_bf16_dp;     /* the CPU has AVX512_BF16 */
    bool has_amx;         /* the CPU has AMX-BF16 */
    bool amx_refused;     /* ... but the kernel did not grant its tile state */
    int peak_rounds;      /* measurements of the peaks so far */
    double round_f32[BENCH_MAX_PEAK_ROUNDS]; /* each round's best, f32, all threads */
    /* the machine looked busy while the peaks were measured: all threads
     * well below threads x one thread, or runs spread (busy_why says) */
    bool busy;
    char busy_why[256];
    bench_gemm_rate shapes[BENCH_MAX_SHAPES];
    int n_shapes;
} bench_ceiling;
void bench_ceiling_measure(bench_ceiling *c, int threads);
/* Runs fn on parts[0..nt) (each `size` bytes) on nt <= 64 threads at once
 * (part 0 on the calling thread; a part whose thread cannot start runs on
 * the caller's afterwards), `reps` times: the best wall time, ms. */
double bench_threads_best_ms(int nt, int reps, void *(*fn)(void *), void *parts, size_t size);
/* Measures c's peaks (the first round; called by bench_ceiling_measure). */
void bench_fma_peak(bench_ceiling *c, int threads);
/* One more round of the peaks: every figure keeps the best of all rounds
 * (load can only slow a run down), c->busy is updated. */
void bench_fma_peak_again(bench_ceiling *c);
/* The peak, GFLOP/s, that bounds GEMM FLOPs of dtype dt: f64's, bf16's
 * (peak_gflops_bf16), else f32's; 0 if unknown. */
double bench_gemm_peak(const bench_ceiling *c, gj_dtype dt);
/* Prints the peaks (and whether the machine looked busy) in two or three
 * lines; `what` names the measurement ("at start", "over 5 rounds"). */
void bench_fma_peak_print(const bench_ceiling *c, const char *what);
/* Sets r's bound from the last compiled program of this thread (the
 * workload r just ran); records its GEMM rates in c. again: every GEMM
 * shape of the workload and the bandwidth are timed once more, and the
 * faster rate of the two measurements is kept. */
void bench_ceiling_bound(bench_ceiling *c, bench_paired_result *r, bool again);
/* After bench_ceiling_bound: when a measured backward of r (the fastest of
 * either side) is below r's bound or peak, measures the peaks, the GEMMs
 * and the bandwidth again and recomputes (r->rechecked); r->beaten if it
 * still is. */
void bench_ceiling_check(bench_ceiling *c, bench_paired_result *r);
void bench_ceiling_print(const bench_ceiling *c);
void bench_ceiling_print_shapes(const bench_ceiling *c);
void bench_ceiling_json(FILE *f, const bench_ceiling *c);
void bench_ceiling_free(bench_ceiling *c);

/* gradjit-bench --ddp (ddp.c), under mpirun: backward alone, allreduce
 * alone and the two together per workload, eager and compiled. 0 or 1. */
int bench_ddp_main(unsigned workloads, int rounds, double bucket_mb, const char *cpu);

/* One side of paired training steps (paired_step.c): a copy of the
 * workload (set up from BENCH_SEED), its AdamW (the workload's step_lr
 * and step_wd, betas 0.9/0.999, eps 1e-8) and its gj_step, eager or
 * compiled; with a process group also its gj_ddp (opts.ddp: gradients
 * averaged over the ranks inside the step; zero > 0: ZeRO's stage, the
 * AdamW over this rank's shards). */
typedef struct bench_side {
    const bench_workload *wl;
    bool eager;
    bench_state s;
    gj_optim *opt;
    gj_ddp *ddp; /* NULL without a group */
    gj_step *step;
    double loss; /* of its last step */
} bench_side;
/* 0, or -1 with err (the side is then freed by bench_side_free). */
int bench_side_init(bench_side *d, const bench_workload *wl, bool eager, gj_pg *pg, int zero,
                    char *err, size_t cap);
/* One step of d, timed (*ms): 0, or -1 with err. */
int bench_side_run(bench_side *d, double *ms, char *err, size_t cap);
void bench_side_free(bench_side *d);
/* Whether a's and b's parameters hold the same bits (as f64: exact for
 * every float dtype). */
bool bench_same_params(bench_state *a, bench_state *b);

/* gradjit-bench --ddp --step (ddp.c), under mpirun: the eager and the
 * compiled DDP training step (gj_step_opts.ddp) of each workload, paired
 * ABBA, and whether both sides end with the same bits. 0 or 1. */
int bench_ddp_step_main(unsigned workloads, int rounds, const char *cpu, int zero);

/* gradjit-bench --paired N --step (paired_step.c): eager and compiled
 * training steps (gj_step: forward, backward, AdamW update) of each
 * workload interleaved ABBA, with the step's bound; gemm_pair: both sides
 * compiled, the first with OpenBLAS pinned, the second with the GEMM
 * provider chosen per shape; bf16_pair: both sides compiled, the first in
 * f32, the second in bf16 mixed precision; budget_pair: both sides
 * compiled, the second under a memory budget of the first's planned peak
 * less half its kept activations (each side's measured peak printed). JSON to json_path (NULL:
 * none). 0, or 1 if a workload failed. */
int bench_step_main(unsigned workloads, int pairs, int warmup, const char *json_path,
                    const char *cpu, bool gemm_pair, bool bf16_pair, bool budget_pair);

/* The bandwidth of `threads` threads over a working set of `bytes`
 * (ceiling.c): what bytes that fit a cache level move at. GB/s: *read_gbs
 * of a read pass, *rw_gbs of bytes read and written (the faster of an
 * in-place update and a memcpy; read plus written bytes counted),
 * *write_gbs (if not NULL) of a write pass. */
void bench_bandwidth_at(size_t bytes, int threads, double *read_gbs, double *rw_gbs,
                        double *write_gbs);

/* Releases every owned tensor, the optimizer and the model, and resets s. */
void bench_state_free(bench_state *s);

#endif /* GJ_BENCH_H */
