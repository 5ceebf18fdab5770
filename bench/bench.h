/*
 * bench.h - the reference workloads of BENCHMARKS.md (W1..W5) as seen by the
 * benchmark driver (bench.c). Written against the public API only.
 *
 * Invariants: a workload owns every tensor it creates in setup (parameters,
 * inputs, master copies) and releases them all in teardown; forward runs
 * inside the driver's open scope, so every temporary it makes belongs to
 * that scope. params[0..n_params) are exactly the leaves that require grad:
 * the driver clears their .grad between steps and checks that backward wrote
 * one for each.
 */
#ifndef GJ_BENCH_H
#define GJ_BENCH_H

#include "gradjit.h"

#define BENCH_MAX_PARAMS 64
#define BENCH_MAX_OWNED 96

typedef struct bench_state {
    gj_tensor *params[BENCH_MAX_PARAMS]; /* leaves requiring grad (borrowed from owned) */
    int n_params;
    gj_tensor *owned[BENCH_MAX_OWNED]; /* every tensor the workload holds a reference to */
    int n_owned;
    gj_tensor *masters[BENCH_MAX_PARAMS]; /* W5: f32 master copy of params[i] (borrowed) */
    gj_tensor *in[4];                     /* inputs: x, labels, mask (borrowed) */
    int64_t param_elems;                  /* total elements in params */
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
} bench_workload;

/* Registry of the five workloads, in order W1..W5. */
extern const bench_workload bench_workloads[];
extern const int bench_n_workloads;

/* Releases every owned tensor and resets s. */
void bench_state_free(bench_state *s);

#endif /* GJ_BENCH_H */
