// SPDX-License-Identifier: MIT
/*
 * dist.h - internal interface of dist/ (data parallelism over MPI).
 *
 * dist/ is the top layer beside frontend/: it uses the public API (hooks,
 * .grad, streams), the runtime's allocator, errors and remote storages
 * (ZeRO stage 3's parameters) and jit's reducer registry, nothing of
 * autograd/. pg.c owns MPI: every MPI call of a group is a job run
 * on the group's communication stream, in submission order, so collectives
 * are issued in the same order on every rank whatever thread asked for
 * them. ddp.c builds gradient buckets on top of gj_dist_submit.
 */
#ifndef GJ_DIST_H
#define GJ_DIST_H

#include "gradjit.h"

#include <stdint.h>

typedef enum gj_dist_kind {
    GJ_DIST_ALLREDUCE = 0,
    GJ_DIST_BCAST,
    GJ_DIST_ALLGATHER,
    GJ_DIST_REDUCE_SCATTER,
    GJ_DIST_BARRIER,
} gj_dist_kind;

/* Wire types: F32 and F64 as MPI_FLOAT/MPI_DOUBLE; BF16 as 16-bit words
 * summed by a user op that adds in f32 and rounds each partial sum. */
typedef struct gj_dist_job {
    gj_dist_kind kind;
    gj_dtype wire;        /* GJ_F32, GJ_F64, GJ_BF16 or GJ_I64 (not reduced) */
    gj_reduce_op op;
    void *send;           /* allgather / reduce_scatter input; NULL: in place */
    void *buf;            /* in/out buffer */
    int64_t count;        /* elements of send (or of buf when in place) */
    int root;
    /* filled by the stream thread */
    int status;           /* 0 or -1 */
    char err[320];
    double ms;
    /* completion: an event recorded right after the job */
    gj_event *done;
} gj_dist_job;

/* Enqueues job on pg's stream (job must live until waited for). 0 or -1
 * (error set; the job will not run). */
int gj_dist_submit(gj_pg *pg, gj_dist_job *job);
/* Blocks until job ran; its status (error set from job->err on failure).
 * Frees the job's event. */
int gj_dist_wait(gj_dist_job *job);
/* Every rank's n values of mine, in rank order, into all (size * n). 0, or
 * -1 with an error naming what. */
int gj_dist_allgather_i64(gj_pg *pg, const int64_t *mine, int n, int64_t *all, const char *what);
/* Seconds a collective may take before it fails (GRADJIT_DIST_TIMEOUT). */
double gj_dist_timeout(void);
/* Monotonic milliseconds. */
double gj_dist_now_ms(void);

#endif /* GJ_DIST_H */
