/* SPDX-License-Identifier: MIT */
/*
 * ddp.c - gradjit-bench --ddp: how much of the gradient allreduce a DDP
 * backward hides behind its own compute (issue #11), eager and compiled.
 * Launched with mpirun; every rank runs the same workload (same seed), and
 * rank 0 prints.
 *
 * Per workload and mode, rounds of three measurements, interleaved so a
 * drift of the machine's speed weighs on all three alike:
 *   backward   forward, then backward with the reducer off (gj_ddp_set_sync
 *              false): the compute alone (timed: the backward);
 *   allreduce  gj_ddp_wait on the .grads that backward left: packs every
 *              bucket, averages it over the ranks, unpacks (no compute);
 *   together   forward, then backward + gj_ddp_wait with the reducer on.
 * overlap = (backward + allreduce - together) / allreduce: 1 when the whole
 * allreduce hid behind the backward, 0 when none did. Medians over rounds.
 * "comm ms": the mean time per reducing step the communication thread spent
 * in collectives (from issue to completion, gj_ddp_stats.comm_ms).
 *
 * --ddp --step (bench_ddp_step_main): the whole DDP training step, eager
 * (gj_step with opts.ddp: backward, gj_ddp_wait, AdamW) against compiled
 * (the same step as one program whose reducer calls start each bucket as
 * its gradients are final), each side its own copy of the model and its
 * own gj_ddp, interleaved ABBA with a barrier before every timed step so
 * no timing includes waiting for a slower rank. The ratio is eager /
 * compiled (> 1: compiled faster), median over rounds with its IQR; both
 * sides must end with the same parameters and loss bits. Per side, over
 * the timed steps: "comm" the time a step's collectives ran (issue to
 * completion, on the communication thread), "blocked" the time the step
 * waited for them (gj_ddp_wait, or the program's takes), and hidden = 1 -
 * blocked / comm, the share of the communication the step's own compute
 * covered.
 */
#include "bench.h"
#include "clock.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void clear_grads(bench_state *s) {
    for (int i = 0; i < s->n_params; i++) gj_tensor_set_grad(s->params[i], NULL);
}

/* forward + backward; *bwd_ms the backward (plus gj_ddp_wait when wait). */
static int one_step(const bench_workload *wl, bench_state *s, gj_ddp *d, bool wait,
                    double *bwd_ms) {
    int rc = -1;
    gj_scope_push();
    gj_tensor *loss = bench_forward(wl, s);
    if (!loss) goto out;
    double t0 = bench_now_ms();
    if (gj_backward(loss, NULL) != 0) goto out;
    if (wait && gj_ddp_wait(d) != 0) goto out;
    *bwd_ms = bench_now_ms() - t0;
    rc = 0;
out:
    gj_scope_pop();
    return rc;
}

typedef struct ddp_row {
    double bwd, ar, both, overlap;
    double bwd_q1, bwd_q3, both_q1, both_q3;
    gj_ddp_stats st;
} ddp_row;

static int measure(gj_pg *pg, const bench_workload *wl, bench_state *s, gj_ddp *d,
                   bool compiled, int rounds, ddp_row *row) {
    double *a = calloc((size_t)rounds, sizeof *a), *b = calloc((size_t)rounds, sizeof *b),
           *c = calloc((size_t)rounds, sizeof *c);
    int rc = -1;
    if (!a || !b || !c) goto out;
    gj_set_compiled_autograd(compiled);
    for (int r = -3; r < rounds; r++) { /* three warm-up rounds */
        double x = 0, y = 0, z = 0;
        clear_grads(s);
        gj_ddp_set_sync(d, false);
        if (one_step(wl, s, d, false, &x) != 0) goto out;
        gj_ddp_set_sync(d, true);
        /* the ranks' backwards end at different times: line them up so
         * that neither timing includes waiting for a slower rank */
        if (gj_pg_barrier(pg) != 0) goto out;
        double t0 = bench_now_ms();
        if (gj_ddp_wait(d) != 0) goto out;
        y = bench_now_ms() - t0;
        clear_grads(s);
        if (gj_pg_barrier(pg) != 0) goto out;
        if (one_step(wl, s, d, true, &z) != 0) goto out;
        if (r >= 0) {
            a[r] = x;
            b[r] = y;
            c[r] = z;
        }
    }
    double ov[4096];
    int n = rounds < 4096 ? rounds : 4096;
    for (int r = 0; r < n; r++) ov[r] = (a[r] + b[r] - c[r]) / b[r];
    row->overlap = bench_quantile(ov, n, 0.5);
    row->bwd_q1 = bench_quantile(a, rounds, 0.25);
    row->bwd_q3 = bench_quantile(a, rounds, 0.75);
    row->bwd = bench_quantile(a, rounds, 0.5);
    row->ar = bench_quantile(b, rounds, 0.5);
    row->both_q1 = bench_quantile(c, rounds, 0.25);
    row->both_q3 = bench_quantile(c, rounds, 0.75);
    row->both = bench_quantile(c, rounds, 0.5);
    gj_ddp_stats_get(d, &row->st);
    rc = 0;
out:
    gj_set_compiled_autograd(false);
    clear_grads(s);
    free(a);
    free(b);
    free(c);
    return rc;
}

int bench_ddp_main(unsigned workloads, int rounds, double bucket_mb, const char *cpu) {
    gj_pg *pg = gj_pg_init();
    if (!pg) {
        fprintf(stderr, "gradjit-bench --ddp: %s\n", gj_last_error());
        return 1;
    }
    int rank = gj_pg_rank(pg), size = gj_pg_size(pg), failed = 0;
    if (rank == 0) {
        gj_info info;
        gj_get_info(&info);
        printf("gradjit-bench --ddp: %d ranks, %d compute thread(s) each, BLAS %s, CPU %s\n"
               "buckets of %.2f MiB (the first at most 1 MiB); medians over %d rounds; "
               "overlap = (backward + allreduce - together) / allreduce\n\n",
               size, info.num_threads, info.blas_core ? info.blas_core : "?", cpu, bucket_mb,
               rounds);
        printf("%-4s %-9s %8s %18s %13s %18s %8s %8s %8s %8s\n", "wl", "mode", "buckets",
               "backward ms [IQR]", "allreduce ms", "together ms [IQR]", "overlap", "MB/step",
               "comm ms", "by hook");
    }
    for (int w = 0; w < bench_n_workloads; w++) {
        if (!(workloads & (1u << w))) continue;
        const bench_workload *wl = &bench_workloads[w];
        bench_state s;
        memset(&s, 0, sizeof s);
        gj_manual_seed(BENCH_SEED);
        if (wl->setup(&s) != 0) {
            fprintf(stderr, "%s: setup failed: %s\n", wl->id, gj_last_error());
            failed = 1;
            continue;
        }
        gj_ddp_options opt = {.bucket_bytes = (int64_t)(bucket_mb * 1048576.0)};
        gj_ddp *d = gj_ddp_new(pg, s.n_params, s.params, &opt);
        ddp_row row[2];
        for (int m = 0; d && m < 2; m++) {
            gj_ddp_stats before;
            gj_ddp_stats_get(d, &before);
            if (measure(pg, wl, &s, d, m == 1, rounds, &row[m]) != 0) {
                fprintf(stderr, "%s (%s): %s\n", wl->id, m ? "compiled" : "eager",
                        gj_last_error());
                failed = 1;
                break;
            }
            int64_t steps = row[m].st.steps - before.steps;
            double mb = steps ? (double)(row[m].st.bytes - before.bytes) / (double)steps / 1e6 : 0;
            double comm = steps ? (row[m].st.comm_ms - before.comm_ms) / (double)steps : 0;
            /* buckets started from a hook during the "together" backwards
             * (the "allreduce" measurement starts all of them in the wait) */
            double hook = (double)(row[m].st.started_by_hook - before.started_by_hook) /
                          ((double)(rounds + 3) * row[m].st.n_buckets);
            if (rank == 0)
                printf("%-4s %-9s %8d %7.3f [%.2f-%.2f] %13.3f %7.3f [%.2f-%.2f] %8.2f %8.2f "
                       "%8.2f %7.0f%%\n",
                       wl->id, m ? "compiled" : "eager", row[m].st.n_buckets, row[m].bwd,
                       row[m].bwd_q1, row[m].bwd_q3, row[m].ar, row[m].both, row[m].both_q1,
                       row[m].both_q3, row[m].overlap, mb, comm, 100.0 * hook);
            if (rank == 0 && m == 1)
                printf("%-4s compiled/eager DDP step (backward + allreduce): %.3fx faster\n",
                       wl->id, row[0].both / row[1].both);
            fflush(stdout);
        }
        if (!d) {
            fprintf(stderr, "%s: gj_ddp_new: %s\n", wl->id, gj_last_error());
            failed = 1;
        }
        gj_ddp_free(d);
        bench_state_free(&s);
    }
    gj_pg_free(pg);
    return failed;
}

/* ------------------------------------------------- the DDP training step */

/* One timed step of side d, after the ranks line up. */
static int timed_step(gj_pg *pg, bench_side *d, double *ms, char *err, size_t cap) {
    if (gj_pg_barrier(pg) != 0) {
        snprintf(err, cap, "barrier: %s", gj_last_error());
        return -1;
    }
    return bench_side_run(d, ms, err, cap);
}

int bench_ddp_step_main(unsigned workloads, int rounds, const char *cpu, int zero) {
    gj_pg *pg = gj_pg_init();
    if (!pg) {
        fprintf(stderr, "gradjit-bench --ddp --step: %s\n", gj_last_error());
        return 1;
    }
    int rank = gj_pg_rank(pg), size = gj_pg_size(pg), failed = 0;
    if (rank == 0) {
        gj_info info;
        gj_get_info(&info);
        printf("gradjit-bench --ddp --step: %d ranks, %d compute thread(s) each, BLAS %s, CPU %s\n"
               "the DDP training step (forward, backward, the gradients averaged, AdamW%s), "
               "eager vs compiled (gj_step_opts.ddp), %d rounds ABBA after 3 warm-up steps per "
               "side; ratio = eager / compiled%s\n\n",
               size, info.num_threads, info.blas_core ? info.blas_core : "?", cpu,
               zero == 3 ? " on the shards, parameters gathered per bucket: ZeRO-3"
               : zero ? " on the shards: ZeRO" : "", rounds,
               zero == 3 ? "; comm includes the parameter gathers" : "");
        printf("%-4s %8s %19s %19s %24s %9s %28s %28s\n", "wl", "buckets", "eager ms [IQR]",
               "compiled ms [IQR]", "eager/compiled [IQR]", "same bits",
               "eager comm/blocked ms hidden", "comp. comm/blocked ms hidden");
    }
    for (int w = 0; w < bench_n_workloads; w++) {
        if (!(workloads & (1u << w))) continue;
        const bench_workload *wl = &bench_workloads[w];
        bench_side side[2]; /* eager, compiled */
        char err[384] = "";
        double *t[2] = {calloc((size_t)rounds, sizeof(double)),
                        calloc((size_t)rounds, sizeof(double))};
        double *ratio = calloc((size_t)rounds, sizeof(double));
        int ok = t[0] && t[1] && ratio &&
                 bench_side_init(&side[0], wl, true, pg, zero, err, sizeof err) == 0 &&
                 bench_side_init(&side[1], wl, false, pg, zero, err, sizeof err) == 0;
        gj_ddp_stats st0[2], st1[2];
        for (int r = -3; ok && r < rounds; r++) {
            if (r == 0)
                for (int m = 0; m < 2; m++) gj_ddp_stats_get(side[m].ddp, &st0[m]);
            double ms[2];
            for (int k = 0; k < 2 && ok; k++) {
                int m = (r & 1) ? 1 - k : k; /* ABBA */
                ok = timed_step(pg, &side[m], &ms[m], err, sizeof err) == 0;
            }
            if (ok && r >= 0) {
                t[0][r] = ms[0];
                t[1][r] = ms[1];
                ratio[r] = ms[0] / ms[1];
            }
        }
        if (ok) {
            double comm[2], blocked[2];
            for (int m = 0; m < 2; m++) {
                gj_ddp_stats_get(side[m].ddp, &st1[m]);
                double n = (double)(st1[m].steps - st0[m].steps);
                comm[m] = n > 0 ? (st1[m].comm_ms - st0[m].comm_ms) / n : NAN;
                blocked[m] = n > 0 ? (st1[m].wait_ms - st0[m].wait_ms) / n : NAN;
            }
            bool same = bench_same_params(&side[0].s, &side[1].s) && side[0].loss == side[1].loss;
            if (rank == 0)
                printf("%-4s %8d %7.2f [%.2f-%.2f] %7.2f [%.2f-%.2f] %10.3f [%.3f-%.3f] %9s "
                       "%10.2f / %6.2f %7.2f %10.2f / %6.2f %7.2f\n",
                       wl->id, st1[1].n_buckets, bench_quantile(t[0], rounds, 0.5),
                       bench_quantile(t[0], rounds, 0.25), bench_quantile(t[0], rounds, 0.75),
                       bench_quantile(t[1], rounds, 0.5), bench_quantile(t[1], rounds, 0.25),
                       bench_quantile(t[1], rounds, 0.75), bench_quantile(ratio, rounds, 0.5),
                       bench_quantile(ratio, rounds, 0.25), bench_quantile(ratio, rounds, 0.75),
                       same ? "yes" : "NO", comm[0], blocked[0], 1.0 - blocked[0] / comm[0],
                       comm[1], blocked[1], 1.0 - blocked[1] / comm[1]);
            if (!same) failed = 1;
        } else {
            fprintf(stderr, "%s: %s\n", wl->id, err[0] ? err : "out of memory");
            failed = 1;
        }
        fflush(stdout);
        bench_side_free(&side[0]);
        bench_side_free(&side[1]);
        free(t[0]);
        free(t[1]);
        free(ratio);
    }
    gj_pg_free(pg);
    return failed;
}
