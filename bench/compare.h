/* SPDX-License-Identifier: MIT */
/*
 * compare.h - the PyTorch side of `gradjit-bench --compare torch`
 * (torch_compare.c): runs bench/torch_ref.py under the system Python as a
 * subprocess with the bench's thread count and OpenBLAS core, and reads
 * back its JSON.
 *
 * Invariants: a torch_run is plain data (fixed-size strings, no pointers
 * except json_text, which it owns: free it with bench_torch_free). When
 * `available` is false, `why` says in one sentence why (Python or PyTorch
 * missing, the script failed) and nothing else is meaningful; that is a
 * message for the user, never a failure of the bench.
 */
#ifndef GJ_BENCH_COMPARE_H
#define GJ_BENCH_COMPARE_H

#include <stdbool.h>

#define BENCH_TORCH_MAX_ROWS 16

typedef struct torch_row {
    char id[8];        /* "W1" */
    bool ok;
    char error[256];   /* why !ok */
    double fwd_med, fwd_min, bwd_med, bwd_min; /* ms */
    double loss_first;
} torch_row;

typedef struct torch_request {
    const char *python;    /* interpreter, e.g. "/usr/bin/python3" */
    const char *script;    /* path of torch_ref.py */
    const char *workloads; /* "W1,W3" */
    int steps, warmup, threads;
    const char *coretype;  /* OPENBLAS_CORETYPE for the child, or NULL */
    bool w4_checkpoint;
} torch_request;

typedef struct torch_run {
    bool available;
    char why[512];
    char version[64], python[256], blas_core[128], blas_config[256];
    char omp_wait_policy[32]; /* what the child ran with */
    int threads, blas_threads;
    double wall_s;            /* whole subprocess */
    torch_row rows[BENCH_TORCH_MAX_ROWS];
    int n_rows;
    char *json_text;          /* the script's JSON document (owned), or NULL */
} torch_run;

/* Runs the script as described by req and fills out (always; see
 * `available`). Progress lines of the script go to this process's stderr. */
void bench_torch_run(const torch_request *req, torch_run *out);

/* The row for workload id, or NULL. */
const torch_row *bench_torch_find(const torch_run *r, const char *id);

void bench_torch_free(torch_run *r);

/* Default location of torch_ref.py: next to this source file (bench/). */
const char *bench_torch_default_script(void);

#endif /* GJ_BENCH_COMPARE_H */
