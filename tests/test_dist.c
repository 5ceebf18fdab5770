/* SPDX-License-Identifier: MIT */
/*
 * test_dist.c - process groups, collectives and gj_ddp over MPI.
 *
 * ctest runs it three ways: alone (a one-rank group), under
 * `mpirun -np 2` and `mpirun -np 3 --oversubscribe`. Every rank runs every
 * test in the same order. References are computed on each rank without MPI:
 * the data of every rank's shard is generated from one seed, so a rank can
 * compute what each other rank's local gradient is and their average. A
 * build without MPI checks the "built without MPI" errors instead.
 * GJT_DIST_KILL=1 (tests/dist/killed.sh) kills rank 1 between two compiled
 * DDP steps: the others must stop, not hang.
 * GJT_DIST_DIVERGE=1 (tests/dist/diverge.sh) makes rank 1 skip a collective
 * that rank 0 issues: rank 0 must get the timeout error, not hang.
 */
#include "gjtest.h"
#include "jit/jit.h" /* gj_jit_last_post_hook_instrs: the compiled run's event log */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static gj_pg *g_pg;
static int g_rank, g_size;

/* ------------------------------------------------------------ collectives */

static void test_collectives(void **state) {
    (void)state;
    const gj_dtype dts[3] = {GJ_F64, GJ_F32, GJ_BF16};
    for (int k = 0; k < 3; k++) {
        int64_t n = 5;
        double v[5], want_sum[5];
        for (int i = 0; i < 5; i++) {
            v[i] = (g_rank + 1) * (i + 1); /* small integers: exact in bf16 too */
            want_sum[i] = (double)g_size * (g_size + 1) / 2 * (i + 1);
        }
        gj_tensor *t = gjt_tensor(dts[k], 1, &n, v);
        assert_int_equal(gj_allreduce(g_pg, t, GJ_REDUCE_SUM), 0);
        assert_true(gjt_tensor_close("allreduce sum", t, want_sum, 0, 0));
        gj_release(t);

        t = gjt_tensor(dts[k], 1, &n, v);
        double want_avg[5];
        for (int i = 0; i < 5; i++) want_avg[i] = want_sum[i] / g_size;
        assert_int_equal(gj_allreduce(g_pg, t, GJ_REDUCE_AVG), 0);
        assert_true(gjt_tensor_close("allreduce avg", t, want_avg, 0,
                                     dts[k] == GJ_BF16 ? 1.0 / 128 : 1e-7));
        gj_release(t);

        /* broadcast from the last rank */
        t = gjt_tensor(dts[k], 1, &n, v);
        double want_b[5];
        for (int i = 0; i < 5; i++) want_b[i] = (double)g_size * (i + 1);
        assert_int_equal(gj_broadcast(g_pg, t, g_size - 1), 0);
        assert_true(gjt_tensor_close("broadcast", t, want_b, 0, 0));
        gj_release(t);

        /* allgather: [2] per rank -> [2 * size] in rank order */
        int64_t two = 2;
        double mine[2] = {g_rank, 10 + g_rank};
        t = gjt_tensor(dts[k], 1, &two, mine);
        gj_tensor *all = gj_allgather(g_pg, t);
        assert_non_null(all);
        assert_int_equal(gj_tensor_shape(all)[0], 2 * g_size);
        for (int r = 0; r < g_size; r++) {
            assert_true(gj_tensor_item_at(all, 2 * r) == r);
            assert_true(gj_tensor_item_at(all, 2 * r + 1) == 10 + r);
        }
        gj_release(all);
        gj_release(t);

        /* reduce_scatter: [size, 3] of (rank + 1) * (row + col) -> this rank's row summed */
        int64_t rs[2] = {g_size, 3};
        double *m = malloc(sizeof(double) * (size_t)(3 * g_size));
        for (int r = 0; r < g_size; r++)
            for (int c = 0; c < 3; c++) m[r * 3 + c] = (g_rank + 1) * (r + c);
        t = gjt_tensor(dts[k], 2, rs, m);
        free(m);
        gj_tensor *part = gj_reduce_scatter(g_pg, t, GJ_REDUCE_SUM);
        assert_non_null(part);
        assert_int_equal(gj_tensor_shape(part)[0], 1);
        for (int c = 0; c < 3; c++)
            assert_true(gj_tensor_item_at(part, c) ==
                        (double)g_size * (g_size + 1) / 2 * (g_rank + c));
        gj_release(part);
        gj_release(t);

        /* asynchronous allreduce */
        t = gjt_tensor(dts[k], 1, &n, v);
        gj_work *w = gj_allreduce_async(g_pg, t, GJ_REDUCE_SUM);
        assert_non_null(w);
        assert_int_equal(gj_work_wait(w), 0);
        assert_true(gjt_tensor_close("async allreduce", t, want_sum, 0, 0));
        gj_release(t);
    }
    assert_int_equal(gj_pg_barrier(g_pg), 0);
}

static void test_collective_errors(void **state) {
    (void)state;
    int64_t s2[2] = {2, 3};
    gj_tensor *a = gj_zeros(GJ_F32, 2, s2);
    gj_tensor *at = gj_transpose(a, 0, 1);
    assert_int_equal(gj_allreduce(g_pg, at, GJ_REDUCE_SUM), -1);
    assert_true(gjt_error_has("gj_allreduce") && gjt_error_has("[3, 2]") &&
                gjt_error_has("not contiguous"));
    gj_tensor *ix = gjt_i64(1, (int64_t[]){2}, (int64_t[]){1, 2});
    assert_int_equal(gj_allreduce(g_pg, ix, GJ_REDUCE_SUM), -1);
    assert_true(gjt_error_has("i64"));
    assert_int_equal(gj_allreduce(NULL, a, GJ_REDUCE_SUM), -1);
    assert_true(gjt_error_has("process group is NULL"));
    assert_int_equal(gj_allreduce(g_pg, NULL, GJ_REDUCE_SUM), -1);
    assert_int_equal(gj_allreduce(g_pg, a, (gj_reduce_op)7), -1);
    assert_int_equal(gj_broadcast(g_pg, a, g_size), -1);
    assert_true(gjt_error_has("root"));
    assert_null(gj_allgather(g_pg, NULL));
    if (g_size > 1) {
        int64_t odd[1] = {g_size + 1};
        gj_tensor *o = gj_zeros(GJ_F64, 1, odd);
        assert_null(gj_reduce_scatter(g_pg, o, GJ_REDUCE_SUM));
        assert_true(gjt_error_has("multiple of the group size"));
        gj_release(o);
    }
    assert_int_equal(gj_work_wait(NULL), -1);
    assert_int_equal(gj_pg_rank(NULL), -1);
    gj_release(ix);
    gj_release(at);
    gj_release(a);
    /* the group still works after refused calls (nothing was issued) */
    assert_int_equal(gj_pg_barrier(g_pg), 0);
}

/* ---------------------------------------------------------------- models */

/* Two-layer tanh MLP over x [B, 6]: y = tanh(x W1 + b1) W2, loss = mean of
 * y^2 over the shard's rows. skip_b1 leaves b1 out of the graph (a
 * parameter with no gradient in that step). Params: W1 [6, 8], b1 [8],
 * W2 [8, 3]. */
enum { NP = 3, IN = 6, HID = 8, OUT = 3 };

static gj_tensor *model_loss(gj_tensor **p, gj_tensor *x, bool skip_b1) {
    gj_tensor *h = gj_matmul(x, p[0]);
    if (!skip_b1) h = gj_add(h, p[1]);
    h = gj_tanh(h);
    gj_tensor *y = gj_matmul(h, p[2]);
    return gj_mean(gj_mul(y, y), 0, NULL, false);
}

static void make_params(gj_dtype dt, uint64_t seed, gj_tensor **p) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    p[0] = gjt_uniform(&r, dt, 2, (int64_t[]){IN, HID}, -0.5, 0.5);
    p[1] = gjt_uniform(&r, dt, 1, (int64_t[]){HID}, -0.5, 0.5);
    p[2] = gjt_uniform(&r, dt, 2, (int64_t[]){HID, OUT}, -0.5, 0.5);
    for (int i = 0; i < NP; i++) assert_int_equal(gj_set_requires_grad(p[i], true), 0);
}

/* Shard r of step s: rows of x, the same on every rank. */
static gj_tensor *shard(gj_dtype dt, int step, int r, int64_t rows) {
    gjt_rng g;
    gjt_rng_seed(&g, 1000 + (uint64_t)step * 64 + (uint64_t)r);
    return gjt_uniform(&g, dt, 2, (int64_t[]){rows, IN}, -1, 1);
}

static void free_params(gj_tensor **p) {
    for (int i = 0; i < NP; i++) gj_release(p[i]);
}

/* The average over ranks of each rank's local gradient for step `step`
 * (rank r skips b1 when skip_odd and r is odd), computed here on fresh
 * parameters of the same values, eagerly: want[i] gets numel(p[i]) values. */
static void reference_grads(gj_dtype dt, uint64_t seed, int step, int64_t rows, bool skip_odd,
                            double **want) {
    bool was = gj_compiled_autograd_enabled();
    gj_set_compiled_autograd(false);
    gj_tensor *p[NP];
    make_params(dt, seed, p);
    for (int i = 0; i < NP; i++) {
        want[i] = calloc((size_t)gj_tensor_numel(p[i]), sizeof(double));
        assert_non_null(want[i]);
    }
    for (int r = 0; r < g_size; r++) {
        gj_tensor *x = shard(dt, step, r, rows); /* outside the scope: released below */
        gj_scope_push();
        gj_tensor *loss = model_loss(p, x, skip_odd && (r & 1));
        assert_int_equal(gj_backward(loss, NULL), 0);
        gj_scope_pop();
        gj_release(x);
        for (int i = 0; i < NP; i++) {
            gj_tensor *g = gj_tensor_grad(p[i]);
            if (!g) continue;
            double *v = gjt_values(g);
            for (int64_t j = 0; j < gj_tensor_numel(p[i]); j++) want[i][j] += v[j];
            free(v);
            gj_tensor_set_grad(p[i], NULL);
        }
    }
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < gj_tensor_numel(p[i]); j++) want[i][j] /= g_size;
    free_params(p);
    gj_set_compiled_autograd(was);
}

/* One DDP step on this rank: backward of its shard, then gj_ddp_wait. */
static void ddp_step(gj_ddp *d, gj_tensor **p, gj_dtype dt, int step, int64_t rows,
                     bool skip_odd) {
    for (int i = 0; i < NP; i++) gj_tensor_set_grad(p[i], NULL);
    gj_tensor *x = shard(dt, step, g_rank, rows); /* outside the scope: released below */
    gj_scope_push();
    gj_tensor *loss = model_loss(p, x, skip_odd && (g_rank & 1));
    assert_int_equal(gj_backward(loss, NULL), 0);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gj_ddp_wait(d), 0);
}

/* Every rank holds the same values in t (compared through allgather). */
static void assert_same_on_all_ranks(const char *what, gj_tensor *t) {
    int64_t n = gj_tensor_numel(t);
    gj_tensor *flat = gj_cast(t, GJ_F64);
    gj_tensor *row = gj_reshape(flat, 1, &n);
    gj_tensor *all = gj_allgather(g_pg, row);
    assert_non_null(all);
    gj_release(row);
    for (int r = 1; r < g_size; r++)
        for (int64_t j = 0; j < n; j++)
            if (gj_tensor_item_at(all, r * n + j) != gj_tensor_item_at(all, j)) {
                fprintf(stderr, "%s: rank %d differs from rank 0 at %lld\n", what, r,
                        (long long)j);
                fail();
            }
    gj_release(all);
    gj_release(flat);
}

static void check_grads(const char *what, gj_tensor **p, double **want, double rel) {
    for (int i = 0; i < NP; i++) {
        gj_tensor *g = gj_tensor_grad(p[i]);
        assert_non_null(g);
        double *v = gjt_values(g);
        char name[96];
        snprintf(name, sizeof name, "%s: grad of param %d", what, i);
        assert_true(gjt_same_as_eager(name, v, want[i], gj_tensor_numel(p[i]), rel));
        if (getenv("GJT_DIST_VERBOSE") && g_rank == 0) { /* the figures of the closing note */
            double md = 0, mw = 0;
            for (int64_t j = 0; j < gj_tensor_numel(p[i]); j++) {
                md = fmax(md, fabs(v[j] - want[i][j]));
                mw = fmax(mw, fabs(want[i][j]));
            }
            fprintf(stderr, "%s (%d ranks): max |ddp - whole batch| %.3g, relative %.3g\n",
                    name, g_size, md, mw > 0 ? md / mw : md);
        }
        free(v);
        assert_same_on_all_ranks(name, g);
    }
}

static void free_want(double **want) {
    for (int i = 0; i < NP; i++) free(want[i]);
}

/* DDP gradients equal the average of the ranks' local gradients (the
 * whole-batch gradient), in f64 and f32, eager then compiled; compiled
 * equals eager bit for bit; rank 0's parameters reach every rank. */
static void test_ddp_matches_whole_batch(void **state) {
    (void)state;
    const gj_dtype dts[2] = {GJ_F64, GJ_F32};
    for (int k = 0; k < 2; k++) {
        gj_dtype dt = dts[k];
        gj_tensor *p[NP];
        make_params(dt, 7, p);
        if (g_rank != 0) { /* other ranks start elsewhere: the broadcast must fix it */
            gj_tensor *q[NP];
            make_params(dt, 99 + (uint64_t)g_rank, q);
            for (int i = 0; i < NP; i++) {
                memcpy(gj_tensor_data(p[i]), gj_tensor_data(q[i]),
                       (size_t)gj_tensor_numel(p[i]) * (dt == GJ_F64 ? 8 : 4));
            }
            free_params(q);
        }
        gj_ddp *d = gj_ddp_new(g_pg, NP, p, NULL);
        assert_non_null(d);
        for (int i = 0; i < NP; i++) assert_same_on_all_ranks("broadcast params", p[i]);
        double *want[NP];
        reference_grads(dt, 7, 0, 4, false, want);
        double rel = dt == GJ_F64 ? 1e-14 : 1e-6;
        ddp_step(d, p, dt, 0, 4, false);
        check_grads("eager DDP", p, want, rel);
        double *eager[NP];
        for (int i = 0; i < NP; i++) eager[i] = gjt_values(gj_tensor_grad(p[i]));

        gj_ddp_stats st;
        assert_int_equal(gj_ddp_stats_get(d, &st), 0);
        assert_int_equal(st.n_buckets, 1);
        assert_int_equal(st.allreduces, 1);
        assert_int_equal(st.started_by_hook, 1); /* during backward, not in wait */
        assert_int_equal(st.steps, 1);

        /* compiled: two steps (compile, then a hit), no fallback, same bits */
        gj_set_compiled_autograd(true);
        gj_ca_stats a = gjt_ca_now();
        for (int s = 0; s < 2; s++) {
            ddp_step(d, p, dt, 0, 4, false);
            for (int i = 0; i < NP; i++) {
                double *v = gjt_values(gj_tensor_grad(p[i]));
                assert_memory_equal(v, eager[i], sizeof(double) * (size_t)gj_tensor_numel(p[i]));
                free(v);
            }
        }
        gj_ca_stats b = gjt_ca_now();
        assert_true(gjt_ran_compiled("compiled DDP", &a, &b, 2));
        gj_set_compiled_autograd(gjt_compiled());
        assert_int_equal(gj_ddp_stats_get(d, &st), 0);
        assert_int_equal(st.allreduces, 3);
        assert_int_equal(st.started_by_hook, 3);
        for (int i = 0; i < NP; i++) free(eager[i]);
        free_want(want);
        gj_ddp_free(d);
        free_params(p);
    }
}

/* Small buckets: one per parameter here, started in order by the hooks;
 * bf16 buckets round but stay close; a parameter unused on odd ranks
 * (find_unused_parameters) gets the average with zeros and nothing hangs. */
static void test_ddp_buckets_unused_bf16(void **state) {
    (void)state;
    gj_tensor *p[NP];
    make_params(GJ_F32, 11, p);
    gj_ddp_options o = {.bucket_bytes = 64}; /* every parameter is larger: 3 buckets */
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, &o);
    assert_non_null(d);
    gj_ddp_stats st;
    gj_ddp_stats_get(d, &st);
    assert_int_equal(st.n_buckets, 3);
    assert_int_equal(gj_ddp_bucket_of(d, 2), 0); /* reverse order: the last layer first */
    assert_int_equal(gj_ddp_bucket_of(d, 0), 2);
    assert_int_equal(gj_ddp_bucket_of(d, 3), -1);
    double *want[NP];
    for (int step = 0; step < 3; step++) {
        bool skip = step == 1;
        reference_grads(GJ_F32, 11, step, 3, skip, want);
        ddp_step(d, p, GJ_F32, step, 3, skip);
        check_grads(skip ? "unused on odd ranks" : "3 buckets", p, want, 1e-6);
        free_want(want);
    }
    gj_ddp_stats_get(d, &st);
    assert_int_equal(st.allreduces, 9);
    /* in the step with an unused b1 on odd ranks, its bucket (and, in
     * order, the one after it) started in gj_ddp_wait there */
    assert_true(st.started_by_hook <= 9 && st.started_by_hook >= 9 - (g_size > 1 ? 2 : 0));
    gj_ddp_free(d);

    /* bf16 buckets: f32 gradients sent as bf16 */
    o = (gj_ddp_options){.bf16_buckets = true};
    d = gj_ddp_new(g_pg, NP, p, &o);
    assert_non_null(d);
    reference_grads(GJ_F32, 11, 0, 3, false, want);
    ddp_step(d, p, GJ_F32, 0, 3, false);
    check_grads("bf16 buckets", p, want, 1.0 / 64);
    free_want(want);
    gj_ddp_free(d);
    free_params(p);
}

/* Compiled DDP with one bucket per parameter: the post-accumulate hooks
 * (GJ_HOOK_NO_GRAPH_WRITES) run between the program's steps as soon as
 * each .grad is final, so the first bucket's allreduce starts before the
 * last step (checked from the run's event log, not from a time); the
 * gradients are eager DDP's bit for bit and nothing falls back. */
static void test_ddp_compiled_overlap(void **state) {
    (void)state;
    gj_tensor *p[NP];
    make_params(GJ_F32, 13, p);
    gj_ddp_options o = {.bucket_bytes = 64};
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, &o);
    assert_non_null(d);
    gj_set_compiled_autograd(false);
    ddp_step(d, p, GJ_F32, 0, 6, false);
    double *eager[NP];
    for (int i = 0; i < NP; i++) eager[i] = gjt_values(gj_tensor_grad(p[i]));
    gj_set_compiled_autograd(true);
    gj_ca_stats a = gjt_ca_now();
    for (int s = 0; s < 2; s++) {
        ddp_step(d, p, GJ_F32, 0, 6, false);
        int at[8], n_steps = 0;
        int calls = gj_jit_last_post_hook_instrs(at, 8, &n_steps);
        assert_int_equal(calls, NP);
        if (getenv("GJT_DIST_VERBOSE")) fprintf(stderr, "post hooks after steps %d %d %d of %d\n", at[0], at[1], at[2], n_steps);
        for (int k = 1; k < calls; k++) assert_true(at[k] >= at[k - 1]);
        if (at[0] >= n_steps) {
            fprintf(stderr, "first post hook ran after all %d steps\n", n_steps);
            fail();
        }
        for (int i = 0; i < NP; i++) {
            double *v = gjt_values(gj_tensor_grad(p[i]));
            assert_memory_equal(v, eager[i], sizeof(double) * (size_t)gj_tensor_numel(p[i]));
            free(v);
        }
    }
    gj_ca_stats b = gjt_ca_now();
    assert_true(gjt_ran_compiled("compiled DDP, 3 buckets", &a, &b, 2));
    gj_set_compiled_autograd(gjt_compiled());
    gj_ddp_stats st;
    gj_ddp_stats_get(d, &st);
    assert_int_equal(st.allreduces, 9);
    assert_int_equal(st.started_by_hook, 9);
    for (int i = 0; i < NP; i++) free(eager[i]);
    gj_ddp_free(d);
    free_params(p);
}

/* Micro-batches: sync off for all but the last accumulates locally with no
 * collective; the result is the average of every rank's summed micro-batch
 * gradients. */
static void test_ddp_no_sync(void **state) {
    (void)state;
    gj_tensor *p[NP];
    make_params(GJ_F64, 5, p);
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, NULL);
    assert_non_null(d);
    double *w0[NP], *w1[NP];
    reference_grads(GJ_F64, 5, 0, 2, false, w0);
    reference_grads(GJ_F64, 5, 1, 2, false, w1);
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < gj_tensor_numel(p[i]); j++) w0[i][j] += w1[i][j];
    for (int i = 0; i < NP; i++) gj_tensor_set_grad(p[i], NULL);
    for (int micro = 0; micro < 2; micro++) {
        gj_ddp_set_sync(d, micro == 1);
        gj_tensor *x = shard(GJ_F64, micro, g_rank, 2); /* outside the scope: released below */
        gj_scope_push();
        assert_int_equal(gj_backward(model_loss(p, x, false), NULL), 0);
        gj_scope_pop();
        gj_release(x);
        gj_ddp_stats st;
        gj_ddp_stats_get(d, &st);
        assert_int_equal(st.allreduces, micro); /* nothing sent for the first */
    }
    assert_int_equal(gj_ddp_wait(d), 0);
    check_grads("no_sync micro-batches", p, w0, 1e-14);
    free_want(w0);
    free_want(w1);
    /* two backwards in one synced step: the second fails with a clear error */
    gj_ddp_set_sync(d, true);
    for (int i = 0; i < NP; i++) gj_tensor_set_grad(p[i], NULL);
    gj_tensor *x = shard(GJ_F64, 0, g_rank, 2); /* outside the scope: released below */
    gj_scope_push();
    assert_int_equal(gj_backward(model_loss(p, x, false), NULL), 0);
    assert_int_equal(gj_backward(model_loss(p, x, false), NULL), -1);
    assert_true(gjt_error_has("second gradient"));
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gj_ddp_wait(d), -1); /* reports it, and the buckets still went out */
    assert_true(gjt_error_has("second gradient"));
    assert_int_equal(gj_pg_barrier(g_pg), 0);
    gj_ddp_free(d);
    free_params(p);
}

/* Every rank must run the same compiled program: a rank with another batch
 * shape gets, on every rank, an error naming each rank's key (no hang), and
 * gj_ddp_new refuses parameters that differ between ranks. Ranks with
 * different heap layouts (allocations of rank-dependent sizes before the
 * model) agree: the key is process-stable. */
static void test_ddp_agreement(void **state) {
    (void)state;
    gj_tensor *junk[4];
    for (int k = 0; k < 4; k++) /* a different heap on every rank */
        junk[k] = gj_zeros(GJ_F32, 1, (int64_t[]){1 + 37 * g_rank + 11 * k});
    gj_tensor *p[NP];
    make_params(GJ_F64, 17, p);
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, NULL);
    assert_non_null(d);
    gj_set_compiled_autograd(true);
    if (g_size > 1) { /* the first backward under d: rank 1 runs another model */
        for (int i = 0; i < NP; i++) gj_tensor_set_grad(p[i], NULL);
        gj_tensor *x = shard(GJ_F64, 0, g_rank, 4); /* outside the scope: released below */
        gj_scope_push();
        assert_int_equal(gj_backward(model_loss(p, x, g_rank == 1), NULL), -1);
        assert_true(gjt_error_has("the ranks differ") && gjt_error_has("rank 1") &&
                    gjt_error_has("rank 0"));
        gj_scope_pop();
        gj_release(x);
        assert_int_equal(gj_ddp_wait(d), 0); /* every rank sends what it has: no hang */
    }
    gj_ca_stats a = gjt_ca_now();
    ddp_step(d, p, GJ_F64, 0, 4, false); /* the same model everywhere: agreed, compiled */
    gj_ca_stats b = gjt_ca_now();
    assert_true(gjt_ran_compiled("agreed key", &a, &b, 1));
    gj_set_compiled_autograd(gjt_compiled());
    gj_ddp_free(d);
    if (g_size > 1) { /* rank 1 wraps two parameters, the others three */
        d = gj_ddp_new(g_pg, g_rank == 1 ? 2 : NP, p, NULL);
        assert_null(d);
        assert_true(gjt_error_has("gj_ddp_new: the ranks differ"));
    }
    assert_int_equal(gj_pg_barrier(g_pg), 0);
    free_params(p);
    for (int k = 0; k < 4; k++) gj_release(junk[k]);
}

/* A user's own ZeRO-style bucketing (what DeepSpeed does) under the flag:
 * post-accumulate hooks copy each .grad into a flat bucket, record_stream
 * it on a communication stream, and the last one averages the bucket over
 * the ranks and writes the averages back. record_stream makes the key
 * eager-only after the first compiled run (GJ_CA_RECORD_STREAM: that run
 * still completes, later steps fall back); every step calls each hook
 * once and issues exactly one collective, and the gradients are exact. */
typedef struct zero_ctx {
    gj_tensor *bucket;   /* flat f64 [total] */
    gj_stream *stream;
    gj_tensor **p;
    int64_t off[NP];
    int hooks, collectives, failures;
} zero_ctx;

static zero_ctx g_zero;

static void zero_hook(gj_tensor *leaf, void *user) {
    zero_ctx *z = &g_zero;
    int i = (int)(intptr_t)user;
    gj_tensor *g = gj_tensor_grad(leaf);
    memcpy((double *)gj_tensor_data(z->bucket) + z->off[i], gj_tensor_data(g),
           sizeof(double) * (size_t)gj_tensor_numel(g));
    gj_tensor_record_stream(z->bucket, z->stream);
    if (++z->hooks % NP != 0) return;
    z->collectives++;
    if (gj_allreduce(g_pg, z->bucket, GJ_REDUCE_AVG) != 0) {
        z->failures++;
        return;
    }
    for (int k = 0; k < NP; k++) {
        gj_tensor *gk = gj_tensor_grad(z->p[k]);
        memcpy(gj_tensor_data(gk), (double *)gj_tensor_data(z->bucket) + z->off[k],
               sizeof(double) * (size_t)gj_tensor_numel(gk));
    }
}

static void test_user_zero_hook(void **state) {
    (void)state;
    gj_tensor *p[NP];
    make_params(GJ_F64, 23, p);
    zero_ctx *z = &g_zero;
    memset(z, 0, sizeof *z);
    z->p = p;
    int64_t total = 0;
    for (int i = 0; i < NP; i++) {
        z->off[i] = total;
        total += gj_tensor_numel(p[i]);
    }
    z->bucket = gj_zeros(GJ_F64, 1, &total);
    z->stream = gj_stream_new();
    int64_t h[NP];
    for (int i = NP - 1; i >= 0; i--) /* the order backward finalises them */
        h[i] = gj_register_post_accumulate_grad_hook(p[i], zero_hook, (void *)(intptr_t)i);
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_set_quiet(true);
    gj_ca_stats a = gjt_ca_now();
    const int steps = 3;
    for (int s = 0; s < steps; s++) {
        double *want[NP];
        reference_grads(GJ_F64, 23, s, 4, false, want);
        for (int i = 0; i < NP; i++) gj_tensor_set_grad(p[i], NULL);
        gj_tensor *x = shard(GJ_F64, s, g_rank, 4); /* outside the scope: released below */
        gj_scope_push();
        assert_int_equal(gj_backward(model_loss(p, x, false), NULL), 0);
        gj_scope_pop();
        gj_release(x);
        check_grads("user ZeRO hook", p, want, 1e-14);
        free_want(want);
        assert_int_equal(z->hooks, NP * (s + 1));      /* each hook once per step */
        assert_int_equal(z->collectives, s + 1);       /* one collective per step */
    }
    gj_ca_stats b = gjt_ca_now();
    assert_int_equal(z->failures, 0);
    assert_int_equal(b.backwards - a.backwards, steps);
    /* the first step ran compiled and tripped the record_stream guard; the
     * key is eager-only after it */
    assert_int_equal(b.fallbacks_by_reason[GJ_CA_RECORD_STREAM] -
                         a.fallbacks_by_reason[GJ_CA_RECORD_STREAM], steps);
    gj_compiled_autograd_set_quiet(false);
    gj_set_compiled_autograd(gjt_compiled());
    for (int i = 0; i < NP; i++) gj_remove_hook(h[i]);
    gj_stream_free(z->stream);
    gj_release(z->bucket);
    free_params(p);
}

/* ------------------------------------------------- DDP in the step */

typedef struct step_ctx {
    gj_tensor **p;
    bool skip_b1; /* b1 unused */
} step_ctx;

static gj_tensor *ddp_step_fn(void *ctx, int n_in, gj_tensor *const *in) {
    step_ctx *c = ctx;
    (void)n_in;
    return model_loss(c->p, in[0], c->skip_b1);
}

typedef struct step_case {
    const char *name;
    gj_dtype dt;
    int opt;               /* 0 AdamW, 1 SGD with momentum and weight decay, 2 Lion */
    double clip;
    bool keep_grads, bf16_buckets, unused; /* unused: b1 gets no gradient (zeros reduced) */
    int64_t bucket_bytes;  /* 0: the default (one bucket here) */
    bool user_hooks;       /* a post hook of the user's before the ddp's, a tensor hook after */
} step_case;

static void halve_grad(gj_tensor *leaf, void *u) { /* in place, before the average */
    (void)u;
    gj_mul_scalar_(gj_tensor_grad(leaf), 0.5);
}

static gj_tensor *plus_one(gj_tensor *g, void *u) {
    (void)u;
    return gj_add_scalar(g, 1.0);
}

static gj_optim *make_opt(int kind, gj_tensor **p) {
    if (kind == 0) return gj_adamw_new(NP, p, 1e-2, 0.9, 0.999, 1e-8, 0.01);
    if (kind == 1) return gj_sgd_new(NP, p, 5e-2, 0.9, 1e-3);
    return gj_lion_new(NP, p, 1e-3, 0.9, 0.99, 0.01);
}

/* One model trained by the eager step with opts.ddp and one by the
 * compiled step with opts.ddp, from the same values on the same shards:
 * the losses, the parameters (and with keep_grads the .grads) equal bit
 * for bit after every step, on every rank alike; the compiled step falls
 * back never after its first (traced) run; at step 0 the kept .grads are
 * the whole-batch average. */
static void run_step_case(const step_case *c) {
    gj_tensor *pe[NP], *pc[NP];
    make_params(c->dt, 31, pe);
    make_params(c->dt, 31, pc);
    gj_ddp_options o = {.bucket_bytes = c->bucket_bytes, .bf16_buckets = c->bf16_buckets};
    for (int k = 0; c->user_hooks && k < 2; k++) {
        gj_tensor *q = k ? pc[1] : pe[1];
        assert_true(gj_register_post_accumulate_grad_hook(q, halve_grad, NULL) > 0);
        assert_true(gj_register_hook(k ? pc[2] : pe[2], plus_one, NULL) > 0);
    }
    gj_ddp *de = gj_ddp_new(g_pg, NP, pe, &o), *dc = gj_ddp_new(g_pg, NP, pc, &o);
    assert_non_null(de);
    assert_non_null(dc);
    gj_optim *oe = make_opt(c->opt, pe), *oc = make_opt(c->opt, pc);
    step_ctx ce = {pe, c->unused}, cc = {pc, c->unused};
    gj_step_opts so = {.eager = true, .ddp = de, .clip_norm = c->clip, .keep_grads = c->keep_grads};
    gj_step *se = gj_step_new(ddp_step_fn, &ce, oe, &so);
    so.eager = false;
    so.ddp = dc;
    gj_step *sc = gj_step_new(ddp_step_fn, &cc, oc, &so);
    assert_non_null(se);
    assert_non_null(sc);
    gj_step_reset_stats();
    const int steps = 4;
    for (int s = 0; s < steps; s++) {
        gj_tensor *x = shard(c->dt, s, g_rank, 5), *le = NULL, *lc = NULL;
        assert_int_equal(gj_step_run(se, 1, &x, &le), 0);
        if (gj_step_run(sc, 1, &x, &lc) != 0) {
            fprintf(stderr, "%s: compiled step %d: %s\n", c->name, s, gj_last_error());
            fail();
        }
        double a = gj_tensor_item(le), b = gj_tensor_item(lc);
        if (memcmp(&a, &b, sizeof a) != 0) {
            fprintf(stderr, "%s: step %d: loss %.17g eager, %.17g compiled\n", c->name, s, a, b);
            fail();
        }
        for (int i = 0; i < NP; i++) {
            char what[128];
            snprintf(what, sizeof what, "%s: step %d param %d", c->name, s, i);
            double *ve = gjt_values(pe[i]), *vc = gjt_values(pc[i]);
            if (memcmp(ve, vc, sizeof(double) * (size_t)gj_tensor_numel(pe[i])) != 0) {
                fprintf(stderr, "%s differs: eager %.17g compiled %.17g (first value)\n", what,
                        ve[0], vc[0]);
                fail();
            }
            free(ve);
            free(vc);
            assert_same_on_all_ranks(what, pc[i]);
            gj_tensor *ge = gj_tensor_grad(pe[i]), *gc = gj_tensor_grad(pc[i]);
            assert_true((ge != NULL) == c->keep_grads && (gc != NULL) == c->keep_grads);
            if (ge) {
                double *we = gjt_values(ge), *wc = gjt_values(gc);
                assert_memory_equal(we, wc, sizeof(double) * (size_t)gj_tensor_numel(ge));
                free(we);
                free(wc);
            }
        }
        if (s == 0 && c->keep_grads && c->clip == 0 && !c->unused && !c->user_hooks) {
            /* the global batch's average */
            double *want[NP];
            reference_grads(c->dt, 31, 0, 5, false, want);
            check_grads(c->name, pc, want, c->dt == GJ_F64 ? 1e-14 : c->bf16_buckets ? 1.0 / 64 : 1e-6);
            free_want(want);
        }
        gj_release(x);
        gj_release(le);
        gj_release(lc);
    }
    gj_ca_stats st;
    gj_step_stats(&st);
    assert_int_equal(st.fallbacks, 0);
    assert_int_equal(st.backwards, steps); /* (the eager step's runs are not counted) */
    gj_ddp_stats de_st, dc_st;
    gj_ddp_stats_get(de, &de_st);
    gj_ddp_stats_get(dc, &dc_st);
    assert_int_equal(dc_st.allreduces, de_st.allreduces); /* the same collectives */
    assert_int_equal(dc_st.steps, steps);
    if (c->bucket_bytes > 0 && c->bucket_bytes < 100) { /* one bucket per parameter */
        int at[8], n_instrs = 0, last_gemm = -1;
        int gives = gj_jit_last_reducer_gives(at, 8, &n_instrs, &last_gemm);
        assert_int_equal(gives, NP);
        for (int k = 1; k < gives; k++) assert_true(at[k] > at[k - 1]);
        if (!(at[0] < last_gemm)) { /* the first bucket left while GEMMs were still to run */
            fprintf(stderr, "%s: first give at instruction %d, last GEMM %d of %d\n", c->name,
                    at[0], last_gemm, n_instrs);
            fail();
        }
    }
    gj_step_free(se);
    gj_step_free(sc);
    gj_optim_free(oe);
    gj_optim_free(oc);
    gj_ddp_free(de);
    gj_ddp_free(dc);
    free_params(pe);
    free_params(pc);
}

static void test_ddp_step(void **state) {
    (void)state;
    const step_case cases[] = {
        {"f64 AdamW, 3 buckets", GJ_F64, 0, 0.0, true, false, false, 64, false},
        {"f32 SGD, clipped, 1 bucket", GJ_F32, 1, 0.5, false, false, false, 0, false},
        {"f32 Lion, b1 unused", GJ_F32, 2, 0.0, true, false, true, 64, false},
        {"f32 AdamW, bf16 buckets", GJ_F32, 0, 0.0, true, true, false, 0, false},
        {"bf16 AdamW, 3 buckets", GJ_BF16, 0, 0.0, false, false, false, 64, false},
        {"f32 AdamW, the user's hooks", GJ_F32, 0, 0.0, true, false, false, 64, true},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) run_step_case(&cases[k]);
}

/* What a step cannot take as opts.ddp. */
static void test_ddp_step_errors(void **state) {
    (void)state;
    gj_tensor *p[NP];
    make_params(GJ_F32, 3, p);
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, NULL);
    assert_non_null(d);
    step_ctx c = {p, false};
    gj_optim *two = gj_sgd_new(2, p, 0.1, 0, 0); /* without p[2] */
    gj_step_opts so = {.ddp = d};
    assert_null(gj_step_new(ddp_step_fn, &c, two, &so));
    assert_true(gjt_error_has("parameter 2"));
    assert_true(gjt_error_has("is not one of the optimizer's 2 parameters"));
    so = (gj_step_opts){.ddp = (gj_ddp *)p[0]}; /* no gj_ddp */
    gj_optim *all = gj_sgd_new(NP, p, 0.1, 0, 0);
    assert_null(gj_step_new(ddp_step_fn, &c, all, &so));
    assert_true(gjt_error_has("opts.ddp is no live gj_ddp"));
    so = (gj_step_opts){.ddp = d, .eval = true};
    assert_null(gj_step_new(ddp_step_fn, &c, all, &so));
    assert_true(gjt_error_has("an eval step has no backward"));
    /* ranks whose steps differ are refused at setup, on every rank, naming
     * what differs */
    gj_optim *own = gj_sgd_new(NP, p, 0.1 + 0.01 * g_rank, 0, 0); /* a rank's own lr */
    so = (gj_step_opts){.ddp = d};
    gj_step *mixed = gj_step_new(ddp_step_fn, &c, own, &so);
    if (g_size > 1) {
        assert_null(mixed);
        assert_true(gjt_error_has("the ranks differ (the optimizer's hyperparameters"));
    } else {
        assert_non_null(mixed);
    }
    gj_step_free(mixed);
    gj_optim_free(own);
    so = (gj_step_opts){.ddp = d, .clip_norm = g_rank == 0 ? 1.0 : 0.0};
    mixed = gj_step_new(ddp_step_fn, &c, all, &so);
    if (g_size > 1) {
        assert_null(mixed);
        assert_true(gjt_error_has("the ranks differ (opts.clip_norm)"));
    }
    gj_step_free(mixed);
    so = (gj_step_opts){.ddp = d, .autocast = g_rank == 0 ? GJ_BF16 : GJ_F32};
    mixed = gj_step_new(ddp_step_fn, &c, all, &so); /* mixed precision on rank 0 only */
    if (g_size > 1) {
        assert_null(mixed);
        assert_true(gjt_error_has("the ranks differ (opts.keep_grads, the optimizer's parameter "
                                  "count or opts.autocast)"));
    }
    gj_step_free(mixed);
    /* compiled steps whose programs differ across ranks (another batch size
     * on rank 1): the key agreement fails the traced step on every rank,
     * before any bucket left; nothing hangs */
    if (g_size > 1) {
        so = (gj_step_opts){.ddp = d};
        gj_step *cs = gj_step_new(ddp_step_fn, &c, all, &so);
        assert_non_null(cs);
        gj_tensor *x = shard(GJ_F32, 0, g_rank, g_rank == 1 ? 5 : 4);
        assert_int_equal(gj_step_run(cs, 1, &x, NULL), -1);
        assert_true(gjt_error_has("the ranks differ"));
        gj_release(x);
        gj_step_free(cs);
    }
    /* the hooks of a gj_ddp not given to the step: refused in both modes
     * (the update would use this rank's gradient), nothing run */
    for (int eager = 0; eager < 2; eager++) {
        so = (gj_step_opts){.eager = eager};
        gj_step *s = gj_step_new(ddp_step_fn, &c, all, &so);
        gj_tensor *x = shard(GJ_F32, 0, g_rank, 4);
        double before = gj_tensor_item_at(p[0], 0);
        assert_int_equal(gj_step_run(s, 1, &x, NULL), -1);
        assert_true(gjt_error_has("parameter 0 carries a gj_ddp's hooks"));
        assert_true(gjt_error_has("gj_step_opts.ddp"));
        assert_true(gj_tensor_item_at(p[0], 0) == before);
        gj_release(x);
        gj_step_free(s);
    }
    gj_optim_free(two);
    gj_optim_free(all);
    gj_ddp_free(d);
    free_params(p);
}

/* ------------------------------------------------------------------ ZeRO */

/* ZeRO stages 1 and 2 against plain DDP with AdamW, f64, one bucket and
 * three: after every step the parameters equal DDP's (stage 1: the same
 * allreduce, the same bits; stage 2: a reduce-scatter, another summation
 * order, within 1e-14) on every rank; each rank's shards together with the
 * others' cover every element once (the optimizer state of one rank is
 * its share), also where the ranks do not divide a bucket; the compiled
 * gj_step with opts.ddp (its program gives the parameters' gradients,
 * takes its shards' averages, updates the shards; the shards gathered
 * after it) gives the hand-written loop's bits, without a fallback. */
static void test_zero(void **state) {
    (void)state;
    for (int stage = 1; stage <= 3; stage++)
        for (int bb = 0; bb < 2; bb++) {
            gj_ddp_options o = {.bucket_bytes = bb ? 64 : 0, .zero = stage};
            gj_ddp_options o0 = {.bucket_bytes = o.bucket_bytes};
            gj_tensor *pr[NP], *pz[NP], *ps[NP];
            make_params(GJ_F64, 41, pr);
            make_params(GJ_F64, 41, pz);
            make_params(GJ_F64, 41, ps);
            gj_ddp *dr = gj_ddp_new(g_pg, NP, pr, &o0), *dz = gj_ddp_new(g_pg, NP, pz, &o),
                   *ds = gj_ddp_new(g_pg, NP, ps, &o);
            assert_non_null(dr);
            assert_non_null(dz);
            assert_non_null(ds);
            gj_tensor *const *sz = NULL, *const *ss = NULL;
            int nz = gj_ddp_shards(dz, &sz), ns = gj_ddp_shards(ds, &ss);
            assert_true(nz >= 0 && nz == ns);
            int64_t mine = 0, total = 0;
            for (int k = 0; k < nz; k++) mine += gj_tensor_numel(sz[k]);
            for (int i = 0; i < NP; i++) total += gj_tensor_numel(pz[i]);
            int64_t all[8] = {0};
            gj_tensor *mt = gj_full(GJ_F64, 1, (int64_t[]){1}, (double)mine);
            gj_tensor *at = gj_allgather(g_pg, mt);
            int64_t sum = 0;
            for (int r = 0; r < g_size; r++) sum += all[r] = (int64_t)gj_tensor_item_at(at, r);
            assert_int_equal(sum, total); /* every element in one shard */
            gj_release(mt);
            gj_release(at);
            gj_optim *orf = gj_adamw_new(NP, pr, 1e-2, 0.9, 0.999, 1e-8, 0.01);
            gj_optim *oz = nz ? gj_adamw_new(nz, sz, 1e-2, 0.9, 0.999, 1e-8, 0.01) : NULL;
            gj_optim *os = nz ? gj_adamw_new(ns, ss, 1e-2, 0.9, 0.999, 1e-8, 0.01) : NULL;
            step_ctx cs = {ps, false};
            gj_step_opts so = {.ddp = ds};
            gj_step *st = os ? gj_step_new(ddp_step_fn, &cs, os, &so) : NULL;
            if (os && !st) fail_msg("gj_step_new with ZeRO: %s", gj_last_error());
            gj_step_reset_stats();
            for (int s = 0; s < 3; s++) {
                ddp_step(dr, pr, GJ_F64, s, 5, false);
                assert_int_equal(gj_optim_step(orf), 0);
                ddp_step(dz, pz, GJ_F64, s, 5, false);
                for (int i = 0; i < NP; i++) assert_null(gj_tensor_grad(pz[i])); /* cleared */
                if (oz) assert_int_equal(gj_optim_step(oz), 0);
                assert_int_equal(gj_ddp_gather(dz), 0);
                gj_tensor *x = shard(GJ_F64, s, g_rank, 5);
                if (st) {
                    if (gj_step_run(st, 1, &x, NULL) != 0)
                        fail_msg("ZeRO-%d step %d: %s", stage, s, gj_last_error());
                } else { /* (no shard on this rank: the collectives still run) */
                    ddp_step(ds, ps, GJ_F64, s, 5, false);
                    assert_int_equal(gj_ddp_gather(ds), 0);
                }
                gj_release(x);
                for (int i = 0; i < NP; i++) {
                    char what[96];
                    snprintf(what, sizeof what, "ZeRO-%d (%s), step %d, param %d", stage,
                             bb ? "3 buckets" : "1 bucket", s, i);
                    double *vr = gjt_values(pr[i]), *vz = gjt_values(pz[i]), *vs = gjt_values(ps[i]);
                    int64_t n = gj_tensor_numel(pr[i]);
                    if (stage == 1) { /* (stages 2 and 3: the same reduce-scatters) */
                        assert_memory_equal(vr, vz, (size_t)n * sizeof *vr);
                    } else {
                        assert_true(gjt_same_as_eager(what, vz, vr, n, 1e-14));
                    }
                    assert_memory_equal(vz, vs, (size_t)n * sizeof *vz); /* the step = the loop */
                    free(vr);
                    free(vz);
                    free(vs);
                    assert_same_on_all_ranks(what, pz[i]);
                }
            }
            if (st) { /* compiled: the gives, the shards' takes and updates, the gather */
                gj_ca_stats c;
                gj_step_stats(&c);
                if (c.fallbacks != 0)
                    fail_msg("ZeRO-%d compiled step fell back: %s", stage,
                             gj_compiled_autograd_last_fallback());
                assert_int_equal(c.compiles + c.mem_hits + c.disk_hits + c.instantiations, 3);
            }
            gj_step_free(st);
            gj_optim_free(orf);
            gj_optim_free(oz);
            gj_optim_free(os);
            gj_ddp_free(dr);
            gj_ddp_free(dz);
            gj_ddp_free(ds);
            free_params(pr);
            free_params(pz);
            free_params(ps);
        }
    /* what ZeRO refuses */
    gj_tensor *p[NP];
    make_params(GJ_F32, 43, p);
    assert_null(gj_ddp_new(g_pg, NP, p, &(gj_ddp_options){.zero = 4}));
    assert_true(gjt_error_has("ZeRO's stages are 1, 2 and 3"));
    assert_null(gj_ddp_new(g_pg, NP, p, &(gj_ddp_options){.zero = 1, .bf16_buckets = true}));
    assert_true(gjt_error_has("travel as they are"));
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, NULL);
    gj_tensor *const *sh = NULL;
    assert_int_equal(gj_ddp_shards(d, &sh), -1);
    assert_true(gjt_error_has("without ZeRO"));
    assert_int_equal(gj_ddp_gather(d), -1);
    assert_int_equal(gj_ddp_unshard(d), -1);
    assert_true(gjt_error_has("without ZeRO stage 3"));
    gj_ddp_free(d);
    free_params(p);
}

/* ZeRO stage 3 on a deeper chain (ZL layers, a bucket per parameter, so
 * more buckets than stay present): parameters hold no bytes at rest, the
 * forward gathers them bucket by bucket (prefetching the next), releases
 * the least recently read, and the backward gathers again what it reads.
 * Against stage 2 (the same reduce-scatters and updates): the same bits,
 * f64 AdamW, in the hand-written loop and in the compiled step (whose
 * program gathers its inputs as its instructions read them), on every
 * rank; and after gj_ddp_free the parameters hold the trained values
 * again. */
enum { ZL = 6, ZW = 5 };

static gj_tensor *chain_loss(gj_tensor *const *p, gj_tensor *x) {
    gj_tensor *h = x;
    for (int l = 0; l < ZL; l++) h = gj_tanh(gj_matmul(h, p[l]));
    return gj_mean(gj_mul(h, h), 0, NULL, false);
}

static gj_tensor *chain_step_fn(void *ctx, int n_in, gj_tensor *const *in) {
    (void)n_in;
    return chain_loss(ctx, in[0]);
}

static void chain_params(gj_tensor **p) {
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    for (int l = 0; l < ZL; l++) {
        p[l] = gjt_uniform(&r, GJ_F64, 2, (int64_t[]){ZW, ZW}, -0.9, 0.9);
        assert_int_equal(gj_set_requires_grad(p[l], true), 0);
    }
}

static gj_tensor *chain_input(int step) {
    gjt_rng g;
    gjt_rng_seed(&g, 500 + (uint64_t)step * 16 + (uint64_t)g_rank);
    return gjt_uniform(&g, GJ_F64, 2, (int64_t[]){4, ZW}, -1, 1);
}

static void chain_loop(gj_ddp *d, gj_tensor **p, gj_optim *o, int step) {
    gj_tensor *x = chain_input(step);
    gj_scope_push();
    assert_int_equal(gj_backward(chain_loss(p, x), NULL), 0);
    gj_scope_pop();
    gj_release(x);
    assert_int_equal(gj_ddp_wait(d), 0);
    if (o) assert_int_equal(gj_optim_step(o), 0);
    gj_optim_zero_grad(o);
    assert_int_equal(gj_ddp_gather(d), 0);
}

static void test_zero3(void **state) {
    (void)state;
    gj_tensor *p2[ZL], *p3[ZL], *pc[ZL];
    chain_params(p2);
    chain_params(p3);
    chain_params(pc);
    gj_ddp_options o2 = {.bucket_bytes = 8, .zero = 2}, o3 = {.bucket_bytes = 8, .zero = 3};
    gj_ddp *d2 = gj_ddp_new(g_pg, ZL, p2, &o2), *d3 = gj_ddp_new(g_pg, ZL, p3, &o3),
           *dc = gj_ddp_new(g_pg, ZL, pc, &o3);
    assert_non_null(d2);
    assert_non_null(d3);
    assert_non_null(dc);
    gj_ddp_stats st;
    assert_int_equal(gj_ddp_stats_get(d3, &st), 0);
    assert_int_equal(st.n_buckets, ZL);
    assert_int_equal(st.units, 0); /* nothing gathered at rest */
    gj_tensor *const *s2, *const *s3, *const *sc;
    int n2 = gj_ddp_shards(d2, &s2), n3 = gj_ddp_shards(d3, &s3), nc = gj_ddp_shards(dc, &sc);
    assert_true(n2 == n3 && n3 == nc);
    for (int k = 0; k < n3; k++) assert_int_equal(gj_tensor_numel(s2[k]), gj_tensor_numel(s3[k]));
    gj_optim *a2 = n2 ? gj_adamw_new(n2, s2, 1e-2, 0.9, 0.999, 1e-8, 0.01) : NULL;
    gj_optim *a3 = n3 ? gj_adamw_new(n3, s3, 1e-2, 0.9, 0.999, 1e-8, 0.01) : NULL;
    gj_optim *ac = nc ? gj_adamw_new(nc, sc, 1e-2, 0.9, 0.999, 1e-8, 0.01) : NULL;
    gj_step_opts so = {.ddp = dc};
    gj_step *stc = ac ? gj_step_new(chain_step_fn, pc, ac, &so) : NULL;
    if (ac && !stc) fail_msg("gj_step_new with ZeRO-3: %s", gj_last_error());
    gj_step_reset_stats();
    const int steps = 4;
    for (int s = 0; s < steps; s++) {
        chain_loop(d2, p2, a2, s);
        chain_loop(d3, p3, a3, s);
        assert_int_equal(gj_ddp_stats_get(d3, &st), 0);
        assert_int_equal(st.units, 0); /* released after the update */
        gj_tensor *x = chain_input(s);
        if (stc) {
            if (gj_step_run(stc, 1, &x, NULL) != 0)
                fail_msg("ZeRO-3 compiled step %d: %s", s, gj_last_error());
        } else {
            chain_loop(dc, pc, NULL, s);
        }
        gj_release(x);
        for (int k = 0; k < n3; k++) { /* the shards: the same bits in all three */
            double *v2 = gjt_values(s2[k]), *v3 = gjt_values(s3[k]), *vc = gjt_values(sc[k]);
            int64_t n = gj_tensor_numel(s3[k]);
            assert_memory_equal(v2, v3, (size_t)n * sizeof *v2);
            assert_memory_equal(v3, vc, (size_t)n * sizeof *v3);
            free(v2);
            free(v3);
            free(vc);
        }
    }
    assert_int_equal(gj_ddp_stats_get(d3, &st), 0);
    if (g_size > 1) {
        /* more gathers than buckets per step: the backward gathered again
         * what the forward released; never more than 3 present */
        if (!(st.gathers > (int64_t)steps * ZL) || st.max_units > 3 || st.prefetches == 0)
            fail_msg("ZeRO-3: %lld gathers (%lld prefetched) in %d steps of %d buckets, at most "
                     "%d present", (long long)st.gathers, (long long)st.prefetches, steps, ZL,
                     st.max_units);
    }
    if (stc) {
        gj_ca_stats c;
        gj_step_stats(&c);
        if (c.fallbacks != 0)
            fail_msg("ZeRO-3 compiled step fell back: %s", gj_compiled_autograd_last_fallback());
        /* the program gathers as it reads, as the eager step does: the
         * steps after the traced one gather again in the backward and hold
         * at most 3 buckets */
        gj_ddp_stats cst;
        assert_int_equal(gj_ddp_stats_get(dc, &cst), 0);
        if (g_size > 1 && (!(cst.gathers > (int64_t)steps * ZL) || cst.max_units > 3))
            fail_msg("ZeRO-3 compiled: %lld gathers in %d steps of %d buckets, at most %d "
                     "present", (long long)cst.gathers, steps, ZL, cst.max_units);
    }
    /* compiled autograd (the backward alone) cannot read parameters whose
     * bytes exist only while eager primitives read them: it runs such a
     * backward eagerly, naming why, with stage 2's bits still */
    gj_set_compiled_autograd(true);
    gj_compiled_autograd_reset_stats();
    chain_loop(d2, p2, a2, steps);
    chain_loop(d3, p3, a3, steps);
    gj_set_compiled_autograd(false);
    gj_ca_stats ca;
    gj_compiled_autograd_stats(&ca);
    assert_true(ca.fallbacks >= 1);
    if (!strstr(gj_compiled_autograd_last_fallback(), "sharded at rest (ZeRO stage 3)"))
        fail_msg("compiled autograd's fallback: %s", gj_compiled_autograd_last_fallback());
    for (int k = 0; k < n3; k++) {
        double *v2 = gjt_values(s2[k]), *v3 = gjt_values(s3[k]);
        assert_memory_equal(v2, v3, (size_t)gj_tensor_numel(s3[k]) * sizeof *v2);
        free(v2);
        free(v3);
    }
    if (stc) { /* (the compiled step's run catches up with the others) */
        gj_tensor *x = chain_input(steps);
        assert_int_equal(gj_step_run(stc, 1, &x, NULL), 0);
        gj_release(x);
    } else {
        chain_loop(dc, pc, NULL, steps);
    }
    /* reading a parameter gathers it (every rank reads the same) */
    for (int l = 0; l < ZL; l++) {
        double *v2 = gjt_values(p2[l]), *v3 = gjt_values(p3[l]);
        assert_memory_equal(v2, v3, (size_t)(ZW * ZW) * sizeof *v2);
        free(v2);
        free(v3);
    }
    assert_int_equal(gj_ddp_unshard(d3), 0);
    assert_int_equal(gj_ddp_stats_get(d3, &st), 0);
    assert_int_equal(st.units, ZL);
    assert_int_equal(gj_ddp_gather(d3), 0);
    /* written while unsharded, kept by gj_ddp_reshard (a checkpoint loaded) */
    assert_int_equal(gj_ddp_reshard(d3), -1);
    assert_true(gjt_error_has("not unsharded"));
    assert_int_equal(gj_ddp_unshard(d3), 0);
    double *keep = gjt_values(p3[1]), *w = gj_tensor_data(p3[1]);
    for (int e = 0; e < ZW * ZW; e++) w[e] = 0.25 * e;
    assert_int_equal(gj_ddp_reshard(d3), 0);
    assert_int_equal(gj_ddp_stats_get(d3, &st), 0);
    assert_int_equal(st.units, 0);
    double *back = gjt_values(p3[1]); /* gathered again from the shards */
    for (int e = 0; e < ZW * ZW; e++) assert_true(back[e] == 0.25 * e);
    free(back);
    assert_int_equal(gj_ddp_unshard(d3), 0);
    memcpy(gj_tensor_data(p3[1]), keep, (size_t)(ZW * ZW) * sizeof *keep);
    assert_int_equal(gj_ddp_reshard(d3), 0);
    free(keep);
    gj_step_free(stc);
    gj_optim_free(a2);
    gj_optim_free(a3);
    gj_optim_free(ac);
    gj_ddp_free(d2);
    gj_ddp_free(d3); /* (a collective: the parameters get their values back) */
    gj_ddp_free(dc);
    for (int l = 0; l < ZL; l++) {
        double *v2 = gjt_values(p2[l]), *v3 = gjt_values(p3[l]), *vc = gjt_values(pc[l]);
        assert_memory_equal(v2, v3, (size_t)(ZW * ZW) * sizeof *v2);
        assert_memory_equal(v2, vc, (size_t)(ZW * ZW) * sizeof *v2);
        free(v2);
        free(v3);
        free(vc);
        assert_same_on_all_ranks("ZeRO-3 after gj_ddp_free", p3[l]);
        gj_release(p2[l]);
        gj_release(p3[l]);
        gj_release(pc[l]);
    }
}

/* The user's hooks on a ZeRO-3 model: a tensor hook (halves a gradient)
 * registered before gj_ddp_new and a post-accumulate hook registered after
 * it (it runs after the ddp's own and reads the .grad): stage 3 by hand and
 * compiled give stage 2's bits, the hooks run as often and see the same
 * .grads, and the compiled step does not fall back. */
typedef struct z3_seen {
    int calls;
    double sum;
} z3_seen;

static gj_tensor *z3_halve(gj_tensor *g, void *u) {
    (void)u;
    return gj_mul_scalar(g, 0.5);
}

static void z3_post(gj_tensor *leaf, void *u) {
    z3_seen *z = u;
    gj_tensor *g = gj_tensor_grad(leaf);
    z->calls++;
    if (!g) {
        z->sum = NAN; /* (the .grad must still be there) */
        return;
    }
    double *v = gjt_values(g);
    for (int64_t e = 0; e < gj_tensor_numel(g); e++) z->sum += v[e];
    free(v);
}

static void test_zero3_hooks(void **state) {
    (void)state;
    gj_tensor *p[3][ZL];
    gj_ddp *d[3];
    gj_optim *o[3] = {NULL, NULL, NULL};
    z3_seen seen[3] = {{0, 0}, {0, 0}, {0, 0}};
    int ns[3];
    gj_tensor *const *sh[3];
    for (int m = 0; m < 3; m++) { /* stage 2, stage 3 by hand, stage 3 compiled */
        chain_params(p[m]);
        assert_true(gj_register_hook(p[m][1], z3_halve, NULL) > 0);
        gj_ddp_options zo = {.bucket_bytes = 8, .zero = m ? 3 : 2};
        assert_non_null(d[m] = gj_ddp_new(g_pg, ZL, p[m], &zo));
        assert_true(gj_register_post_accumulate_grad_hook(p[m][3], z3_post, &seen[m]) > 0);
        ns[m] = gj_ddp_shards(d[m], &sh[m]);
        if (ns[m]) o[m] = gj_sgd_new(ns[m], sh[m], 0.05, 0.9, 0.0);
    }
    gj_step_opts so = {.ddp = d[2]};
    gj_step *st = o[2] ? gj_step_new(chain_step_fn, p[2], o[2], &so) : NULL;
    gj_step_reset_stats();
    for (int s = 0; s < 3; s++) {
        chain_loop(d[0], p[0], o[0], s);
        chain_loop(d[1], p[1], o[1], s);
        gj_tensor *x = chain_input(s);
        if (st) {
            if (gj_step_run(st, 1, &x, NULL) != 0) fail_msg("step %d: %s", s, gj_last_error());
        } else {
            chain_loop(d[2], p[2], NULL, s);
        }
        gj_release(x);
        for (int k = 0; k < ns[0]; k++) {
            double *a = gjt_values(sh[0][k]), *b = gjt_values(sh[1][k]), *c = gjt_values(sh[2][k]);
            assert_memory_equal(a, b, (size_t)gj_tensor_numel(sh[0][k]) * sizeof *a);
            assert_memory_equal(a, c, (size_t)gj_tensor_numel(sh[0][k]) * sizeof *a);
            free(a);
            free(b);
            free(c);
        }
    }
    for (int m = 1; m < 3; m++) {
        assert_int_equal(seen[m].calls, seen[0].calls);
        assert_true(seen[m].sum == seen[0].sum); /* (NaN: a hook saw no .grad) */
    }
    assert_int_equal(seen[0].calls, 3);
    if (st) {
        gj_ca_stats c;
        gj_step_stats(&c);
        if (c.fallbacks != 0)
            fail_msg("ZeRO-3 compiled step with hooks fell back: %s",
                     gj_compiled_autograd_last_fallback());
    }
    gj_step_free(st);
    for (int m = 0; m < 3; m++) {
        gj_optim_free(o[m]);
        gj_ddp_free(d[m]);
        for (int l = 0; l < ZL; l++) gj_release(p[m][l]);
    }
}

/* DeepSpeed's ZeRO-3 bucketing pattern written by a user on a stage-3
 * model: a post-accumulate hook copies each .grad into a bucket tensor of
 * its own and records the bucket on a stream. The compiled step cannot
 * replay record_stream: it runs eagerly from then on, naming it, and its
 * results are the eager step's bit for bit; set_ on a sharded parameter
 * (the pattern's dtype swap) is refused with an error. */
typedef struct ds_ctx {
    gj_stream *stream;
    int calls;
} ds_ctx;

static void ds_bucket_hook(gj_tensor *leaf, void *u) {
    ds_ctx *c = u;
    gj_tensor *g = gj_tensor_grad(leaf);
    gj_tensor *bucket = g ? gj_zeros(gj_tensor_dtype(g), gj_tensor_ndim(g), gj_tensor_shape(g))
                          : NULL;
    c->calls++;
    if (bucket && gj_copy_(bucket, g) == 0) gj_tensor_record_stream(bucket, c->stream);
    gj_release(bucket);
}

static void test_zero3_deepspeed_pattern(void **state) {
    (void)state;
    gj_tensor *pe[ZL], *pc[ZL];
    chain_params(pe);
    chain_params(pc);
    ds_ctx ce = {gj_stream_new(), 0}, cc = {gj_stream_new(), 0};
    assert_non_null(ce.stream);
    assert_non_null(cc.stream);
    gj_ddp_options zo = {.bucket_bytes = 8, .zero = 3};
    gj_ddp *de = gj_ddp_new(g_pg, ZL, pe, &zo), *dc = gj_ddp_new(g_pg, ZL, pc, &zo);
    assert_non_null(de);
    assert_non_null(dc);
    for (int l = 0; l < ZL; l++) {
        assert_true(gj_register_post_accumulate_grad_hook(pe[l], ds_bucket_hook, &ce) > 0);
        assert_true(gj_register_post_accumulate_grad_hook(pc[l], ds_bucket_hook, &cc) > 0);
    }
    gj_tensor *const *se, *const *sc;
    int ne = gj_ddp_shards(de, &se), nc = gj_ddp_shards(dc, &sc);
    assert_int_equal(ne, nc);
    gj_optim *oe = gj_adamw_new(ne, se, 1e-2, 0.9, 0.999, 1e-8, 0.0);
    gj_optim *oc = gj_adamw_new(nc, sc, 1e-2, 0.9, 0.999, 1e-8, 0.0);
    gj_step_opts eo = {.ddp = de, .eager = true}, co = {.ddp = dc};
    gj_step *se_ = gj_step_new(chain_step_fn, pe, oe, &eo), *sc_ = gj_step_new(chain_step_fn, pc, oc, &co);
    assert_non_null(se_);
    assert_non_null(sc_);
    gj_step_reset_stats();
    for (int s = 0; s < 3; s++) {
        gj_tensor *x = chain_input(s);
        assert_int_equal(gj_step_run(se_, 1, &x, NULL), 0);
        assert_int_equal(gj_step_run(sc_, 1, &x, NULL), 0);
        gj_release(x);
        for (int k = 0; k < ne; k++) {
            double *a = gjt_values(se[k]), *b = gjt_values(sc[k]);
            assert_memory_equal(a, b, (size_t)gj_tensor_numel(se[k]) * sizeof *a);
            free(a);
            free(b);
        }
    }
    assert_int_equal(ce.calls, cc.calls);
    gj_ca_stats st;
    gj_step_stats(&st);
    assert_true(st.fallbacks >= 1);
    assert_true(st.fallbacks_by_reason[GJ_CA_RECORD_STREAM] >= 1);
    if (!strstr(gj_compiled_autograd_last_fallback(), "record_stream"))
        fail_msg("the fallback names: %s", gj_compiled_autograd_last_fallback());
    /* the pattern's set_ to another dtype: refused on a sharded parameter */
    gj_tensor *b16 = gj_cast(pe[0], GJ_BF16);
    assert_non_null(b16);
    assert_int_equal(gj_tensor_set_(pe[0], b16), -1);
    assert_true(gjt_error_has("sharded at rest (ZeRO stage 3)"));
    gj_release(b16);
    gj_step_free(se_);
    gj_step_free(sc_);
    gj_optim_free(oe);
    gj_optim_free(oc);
    gj_ddp_free(de);
    gj_ddp_free(dc);
    gj_stream_free(ce.stream);
    gj_stream_free(cc.stream);
    for (int l = 0; l < ZL; l++) {
        gj_release(pe[l]);
        gj_release(pc[l]);
    }
}

static void test_ddp_errors(void **state) {
    (void)state;
    gj_tensor *p[NP];
    make_params(GJ_F32, 3, p);
    assert_null(gj_ddp_new(NULL, NP, p, NULL));
    assert_null(gj_ddp_new(g_pg, 0, p, NULL));
    gj_tensor *twice[2] = {p[0], p[0]};
    assert_null(gj_ddp_new(g_pg, 2, twice, NULL));
    assert_true(gjt_error_has("parameter 1 is parameter 0"));
    gj_tensor *nl = gj_zeros(GJ_F32, 1, (int64_t[]){3}); /* does not require grad */
    assert_null(gj_ddp_new(g_pg, 1, &nl, NULL));
    assert_true(gjt_error_has("not a leaf that requires grad"));
    gj_release(nl);
    assert_int_equal(gj_ddp_wait(NULL), -1);
    assert_int_equal(gj_ddp_stats_get(NULL, NULL), -1);
    free_params(p);
}

/* ------------------------------------------------------- without MPI */

static void test_without_mpi(void **state) {
    (void)state;
    assert_null(gj_pg_init());
    assert_true(gjt_error_has("built without MPI"));
    int64_t n = 2;
    gj_tensor *t = gj_zeros(GJ_F32, 1, &n);
    assert_int_equal(gj_allreduce(NULL, t, GJ_REDUCE_SUM), -1);
    gj_release(t);
}

/* tests/dist/zero_ckpt.sh: GJT_ZERO_CKPT=save:PATH trains 2 steps with
 * ZeRO-1 (f64, 3 buckets, AdamW, compiled steps), writes PATH (parameters
 * and the consolidated optimizer state, gathered from every rank's
 * shards), trains 2 more and writes PATH.final (the parameters of the
 * unbroken run); GJT_ZERO_CKPT=resume:PATH, on another number of ranks
 * with ZeRO-2, loads PATH (each rank its shards' parts), trains steps 2
 * and 3 and must reach PATH.final's parameters (f64, 1e-12: the same
 * global batch of 12 rows, split over the ranks, summed in another
 * order). Rank 0 also loads PATH into a plain optimizer over the full
 * parameters: the format is the one-process one. The saving ranks also
 * write their own shards (gj_ddp_optim_shard_dict_add, no collective) to
 * PATH.rank<r>; every resuming rank consolidates them (gj_zero_consolidate)
 * into exactly the gathered file's optimizer state, and rank 0 checks that
 * a missing or repeated rank is refused. Exit status 0 or 1. */

/* The shard files of PATH, consolidated, equal PATH's gathered state (every
 * "optim." tensor, bit for bit, and the metadata); a rank missing or given
 * twice is refused. 0 or 1. */
static int zero_shards_check(const char *path, const gj_state_dict *in) {
    char nm[600];
    snprintf(nm, sizeof nm, "%s.rank0", path);
    gj_state_dict *s0 = gj_load_safetensors(nm);
    const char *rk = s0 ? gj_state_dict_get_metadata(s0, "optim.zero.ranks") : NULL;
    int n = rk ? atoi(rk) : 0, rc = n >= 1 ? 0 : 1;
    gj_state_dict *sh[8] = {s0};
    for (int r = 1; r < n && r < 8 && rc == 0; r++) {
        snprintf(nm, sizeof nm, "%s.rank%d", path, r);
        if (!(sh[r] = gj_load_safetensors(nm))) rc = 1;
    }
    gj_state_dict *all = gj_state_dict_new();
    if (rc == 0 && gj_zero_consolidate(n, (const gj_state_dict *const *)sh, "optim", all) != 0) {
        fprintf(stderr, "zero_ckpt: consolidate: %s\n", gj_last_error());
        rc = 1;
    }
    int checked = 0;
    for (int j = 0; rc == 0 && j < gj_state_dict_size(in); j++) {
        const char *k = gj_state_dict_name(in, j);
        if (strncmp(k, "optim.", 6) != 0) continue;
        gj_tensor *a = gj_state_dict_get(in, k), *b = gj_state_dict_get(all, k);
        double *x = gjt_values(a), *y = b ? gjt_values(b) : NULL;
        if (!b || gj_tensor_numel(a) != gj_tensor_numel(b) ||
            memcmp(x, y, (size_t)gj_tensor_numel(a) * sizeof *x) != 0) {
            fprintf(stderr, "zero_ckpt: consolidated %s differs from the gathered one\n", k);
            rc = 1;
        }
        free(x), free(y);
        checked++;
    }
    if (rc == 0 && (checked == 0 || gj_state_dict_size(all) != checked)) {
        fprintf(stderr, "zero_ckpt: %d gathered optimizer tensors, %d consolidated\n", checked,
                gj_state_dict_size(all));
        rc = 1;
    }
    const char *kind = gj_state_dict_get_metadata(all, "optim.n_params");
    if (rc == 0 && (!kind || strcmp(kind, gj_state_dict_get_metadata(in, "optim.n_params")))) rc = 1;
    gj_state_dict_free(all);
    if (rc == 0 && g_rank == 0 && n >= 2) { /* a rank missing, a rank twice */
        gj_state_dict *o2 = gj_state_dict_new();
        gj_clear_error();
        if (gj_zero_consolidate(n - 1, (const gj_state_dict *const *)sh, "optim", o2) == 0 ||
            !gjt_error_has("must be the"))
            rc = 1;
        gj_state_dict *twice[8];
        for (int r = 0; r < n && r < 8; r++) twice[r] = sh[r == 1 ? 0 : r];
        if (gj_zero_consolidate(n, (const gj_state_dict *const *)twice, "optim", o2) == 0) rc = 1;
        if (rc) fprintf(stderr, "zero_ckpt: an incomplete set of shard dicts was accepted\n");
        gj_state_dict_free(o2);
    }
    for (int r = 0; r < n && r < 8; r++) gj_state_dict_free(sh[r]);
    if (rc == 0)
        printf("zero_ckpt: rank %d: the %d shard files consolidate to the gathered state\n",
               g_rank, n);
    return rc;
}
static gj_tensor *global_rows(int step) {
    gjt_rng g;
    gjt_rng_seed(&g, 7000 + (uint64_t)step);
    gj_tensor *x = gjt_uniform(&g, GJ_F64, 2, (int64_t[]){12, IN}, -1, 1);
    return gj_contiguous(gj_narrow(x, 0, 12 / g_size * g_rank, 12 / g_size)); /* (scoped) */
}

static int zero_ckpt(const char *how) {
    bool save = strncmp(how, "save:", 5) == 0;
    const char *path = how + (save ? 5 : 7);
    char final[512];
    snprintf(final, sizeof final, "%s.final", path);
    gj_scope_push();
    gj_tensor *p[NP];
    make_params(GJ_F64, 61, p);
    gj_state_dict *in = save ? NULL : gj_load_safetensors(path);
    for (int i = 0; in && i < NP; i++) { /* the parameters of the checkpoint */
        char nm[32];
        snprintf(nm, sizeof nm, "p.%d", i);
        gj_tensor *t = gj_state_dict_get(in, nm);
        if (!t) return 1;
        memcpy(gj_tensor_data(p[i]), gj_tensor_data(t), sizeof(double) * (size_t)gj_tensor_numel(t));
    }
    gj_ddp_options o = {.bucket_bytes = 64, .zero = save ? 1 : 2, .no_broadcast = true};
    gj_ddp *d = gj_ddp_new(g_pg, NP, p, &o);
    gj_tensor *const *sh = NULL;
    int ns = d ? gj_ddp_shards(d, &sh) : -1;
    gj_optim *opt = ns > 0 ? gj_adamw_new(ns, sh, 1e-2, 0.9, 0.999, 1e-8, 0.01) : NULL;
    if (!opt) {
        fprintf(stderr, "zero_ckpt: setup: %s\n", gj_last_error());
        return 1;
    }
    if (in && gj_ddp_optim_load_state_dict(d, opt, in, "optim") != 0) {
        fprintf(stderr, "zero_ckpt: load: %s\n", gj_last_error());
        return 1;
    }
    step_ctx c = {p, false};
    gj_step *st = gj_step_new(ddp_step_fn, &c, opt, &(gj_step_opts){.ddp = d});
    int rc = st ? 0 : 1;
    for (int s = save ? 0 : 2; rc == 0 && s < 4; s++) {
        if (save && s == 2) { /* the checkpoint: every rank gathers, rank 0 writes */
            gj_state_dict *sd = gj_state_dict_new();
            for (int i = 0; i < NP; i++) {
                char nm[32];
                snprintf(nm, sizeof nm, "p.%d", i);
                gj_state_dict_add(sd, nm, p[i]);
            }
            if (gj_ddp_optim_state_dict_add(d, opt, sd, "optim") != 0 ||
                (g_rank == 0 && gj_save_safetensors(sd, path) != 0)) {
                fprintf(stderr, "zero_ckpt: save: %s\n", gj_last_error());
                rc = 1;
            }
            gj_state_dict_free(sd);
            gj_state_dict *mine = gj_state_dict_new(); /* and this rank's own shards */
            char nm[600];
            snprintf(nm, sizeof nm, "%s.rank%d", path, g_rank);
            if (rc == 0 && (gj_ddp_optim_shard_dict_add(d, opt, mine, "optim") != 0 ||
                            gj_save_safetensors(mine, nm) != 0)) {
                fprintf(stderr, "zero_ckpt: save %s: %s\n", nm, gj_last_error());
                rc = 1;
            }
            gj_state_dict_free(mine);
        }
        gj_scope_push(); /* this step's rows */
        gj_tensor *x = global_rows(s);
        if (rc == 0 && gj_step_run(st, 1, &x, NULL) != 0) {
            fprintf(stderr, "zero_ckpt: step %d: %s\n", s, gj_last_error());
            rc = 1;
        }
        gj_scope_pop();
    }
    if (rc == 0 && save && g_rank == 0) { /* the unbroken run's parameters */
        gj_state_dict *sd = gj_state_dict_new();
        for (int i = 0; i < NP; i++) {
            char nm[32];
            snprintf(nm, sizeof nm, "p.%d", i);
            gj_state_dict_add(sd, nm, p[i]);
        }
        rc = gj_save_safetensors(sd, final) != 0;
        gj_state_dict_free(sd);
    }
    if (rc == 0 && !save) {
        gj_state_dict *want = gj_load_safetensors(final);
        for (int i = 0; want && i < NP && rc == 0; i++) {
            char nm[32];
            snprintf(nm, sizeof nm, "p.%d", i);
            double *v = gjt_values(p[i]), *w = gjt_values(gj_state_dict_get(want, nm));
            for (int64_t j = 0; j < gj_tensor_numel(p[i]); j++)
                if (fabs(v[j] - w[j]) > 1e-12 * fmax(1.0, fabs(w[j]))) {
                    fprintf(stderr, "zero_ckpt: rank %d param %d[%lld]: resumed %.17g, unbroken "
                            "%.17g\n", g_rank, i, (long long)j, v[j], w[j]);
                    rc = 1;
                    break;
                }
            free(v);
            free(w);
        }
        if (!want) rc = 1;
        gj_state_dict_free(want);
        if (rc == 0) rc = zero_shards_check(path, in);
        if (rc == 0 && g_rank == 0) { /* the one-process format */
            gj_tensor *q[NP];
            make_params(GJ_F64, 61, q);
            gj_optim *full = gj_adamw_new(NP, q, 1e-2, 0.9, 0.999, 1e-8, 0.01);
            if (gj_optim_load_state_dict(full, in, "optim") != 0) {
                fprintf(stderr, "zero_ckpt: a plain optimizer refused it: %s\n", gj_last_error());
                rc = 1;
            }
            gj_optim_free(full);
            free_params(q);
        }
        printf("zero_ckpt: rank %d of %d resumed %s: %s\n", g_rank, g_size, path,
               rc == 0 ? "the unbroken run's parameters" : "DIFFERENT");
    }
    gj_step_free(st);
    gj_optim_free(opt);
    gj_ddp_free(d);
    gj_state_dict_free(in);
    free_params(p);
    gj_scope_pop();
    gj_pg_free(g_pg);
    return rc;
}

int main(void) {
    gjt_setup();
    if (!gj_dist_available()) {
        const struct CMUnitTest tests[] = {cmocka_unit_test(test_without_mpi)};
        return cmocka_run_group_tests(tests, NULL, NULL);
    }
    g_pg = gj_pg_init();
    if (!g_pg) {
        fprintf(stderr, "gj_pg_init: %s\n", gj_last_error());
        return 1;
    }
    g_rank = gj_pg_rank(g_pg);
    g_size = gj_pg_size(g_pg);
    if (getenv("GJT_ZERO_CKPT")) return zero_ckpt(getenv("GJT_ZERO_CKPT"));
    if (getenv("GJT_DIST_KILL")) { /* tests/dist/killed.sh: rank 1 dies inside a DDP step */
        gj_tensor *p[NP];
        make_params(GJ_F32, 51, p);
        gj_ddp *d = gj_ddp_new(g_pg, NP, p, &(gj_ddp_options){.bucket_bytes = 64});
        gj_optim *o = gj_adamw_new(NP, p, 1e-2, 0.9, 0.999, 1e-8, 0.0);
        step_ctx c = {p, false};
        gj_step *st = gj_step_new(ddp_step_fn, &c, o, &(gj_step_opts){.ddp = d});
        for (int s = 0; s < 4; s++) {
            if (s == 2 && g_rank == 1) _exit(9); /* killed mid-training */
            gj_tensor *x = shard(GJ_F32, s, g_rank, 4);
            int rc = gj_step_run(st, 1, &x, NULL);
            printf("killed: rank %d step %d rc %d%s%s\n", g_rank, s, rc, rc ? ": " : "",
                   rc ? gj_last_error() : "");
            fflush(stdout);
            if (rc != 0) _exit(3); /* the error the survivors report */
        }
        _exit(0);
    }
    if (getenv("GJT_DIST_DIVERGE")) { /* tests/dist/diverge.sh */
        int64_t n = 4;
        gj_tensor *t = gj_ones(GJ_F32, 1, &n);
        if (g_rank == 1) {
            sleep(4); /* alive, but never joins the collective */
            _exit(0);
        }
        int rc = gj_allreduce(g_pg, t, GJ_REDUCE_SUM);
        printf("diverge: rank %d rc %d: %s\n", g_rank, rc, gj_last_error());
        fflush(stdout);
        _exit(rc == -1 && strstr(gj_last_error(), "did not complete within") ? 0 : 1);
    }
    if (g_rank != 0) freopen("/dev/null", "w", stdout); /* one cmocka report */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_collectives),
        cmocka_unit_test(test_collective_errors),
        cmocka_unit_test(test_ddp_matches_whole_batch),
        cmocka_unit_test(test_ddp_buckets_unused_bf16),
        cmocka_unit_test(test_ddp_compiled_overlap),
        cmocka_unit_test(test_ddp_no_sync),
        cmocka_unit_test(test_ddp_agreement),
        cmocka_unit_test(test_user_zero_hook),
        cmocka_unit_test(test_ddp_errors),
        cmocka_unit_test(test_ddp_step),
        cmocka_unit_test(test_ddp_step_errors),
        cmocka_unit_test(test_zero),
        cmocka_unit_test(test_zero3),
        cmocka_unit_test(test_zero3_hooks),
        cmocka_unit_test(test_zero3_deepspeed_pattern),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_pg_free(g_pg);
    return rc;
}
