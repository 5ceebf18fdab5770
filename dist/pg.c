// SPDX-License-Identifier: MIT
/*
 * pg.c - process groups and collectives over MPI.
 *
 * A group owns a duplicate of its communicator (errors return, never
 * abort) and a gradjit stream. Every MPI call made for the group (the
 * collectives, the barrier) is a gj_dist_job run on that stream's thread,
 * one after another in submission order: collectives on one communicator
 * must be issued in the same order on every rank, and this is what makes
 * that true when several threads of a rank submit. A job issues the
 * nonblocking form of its collective and polls it (MPI_Test drives Open
 * MPI's progress) until it completes or gj_dist_timeout() passes; a
 * timed-out request cannot be cancelled, so the group is then "broken" and
 * every later job fails at once. Without MPI (GJ_HAVE_MPI undefined) the
 * public functions fail with an error saying so.
 */
#define _GNU_SOURCE
#include "dist/dist.h"

#include "runtime/gj_math.h"
#include "runtime/rt.h"

#include <errno.h>
#include <sched.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double gj_dist_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* GRADJIT_DIST_TIMEOUT: a positive number of seconds (default 300). A
 * malformed value is reported once and the default used. */
double gj_dist_timeout(void) {
    static _Atomic double cached = 0;
    double t = atomic_load(&cached);
    if (t > 0) return t;
    t = 300;
    const char *e = getenv("GRADJIT_DIST_TIMEOUT");
    if (e && *e) {
        char *end;
        errno = 0;
        double v = strtod(e, &end);
        if (errno || *end || !(v > 0) || !isfinite(v))
            fprintf(stderr, "gradjit: GRADJIT_DIST_TIMEOUT=%s is not a positive number of "
                    "seconds; using 300\n", e);
        else
            t = v;
    }
    atomic_store(&cached, t);
    return t;
}

static const char *dtype_name(gj_dtype d) {
    switch (d) {
    case GJ_F32: return "f32";
    case GJ_F64: return "f64";
    case GJ_BF16: return "bf16";
    case GJ_I64: return "i64";
    }
    return "?";
}

static void fmt_shape(char *buf, size_t cap, const gj_tensor *t) {
    int n = gj_tensor_ndim(t), off = 0;
    const int64_t *s = gj_tensor_shape(t);
    off += snprintf(buf + off, cap - (size_t)off, "[");
    for (int i = 0; i < n && (size_t)off < cap; i++)
        off += snprintf(buf + off, cap - (size_t)off, "%s%lld", i ? ", " : "", (long long)s[i]);
    if ((size_t)off < cap) snprintf(buf + off, cap - (size_t)off, "]");
}

/* Checks a collective's tensor argument: alive, contiguous, a float dtype. */
static int check_tensor(const char *op, gj_tensor *t) {
    if (!t) {
        gj_rt_set_error("%s: tensor is NULL", op);
        return -1;
    }
    char sh[160];
    fmt_shape(sh, sizeof sh, t);
    gj_dtype d = gj_tensor_dtype(t);
    if (d != GJ_F32 && d != GJ_F64 && d != GJ_BF16) {
        gj_rt_set_error("%s: tensor %s %s: only f32, f64 and bf16 tensors can be reduced", op,
                        sh, dtype_name(d));
        return -1;
    }
    if (!gj_tensor_is_contiguous(t)) {
        gj_rt_set_error("%s: tensor %s %s is not contiguous", op, sh, dtype_name(d));
        return -1;
    }
    return 0;
}

static const char *kind_name(gj_dist_kind k) {
    switch (k) {
    case GJ_DIST_ALLREDUCE: return "allreduce";
    case GJ_DIST_BCAST: return "broadcast";
    case GJ_DIST_ALLGATHER: return "allgather";
    case GJ_DIST_REDUCE_SCATTER: return "reduce_scatter";
    case GJ_DIST_BARRIER: return "barrier";
    }
    return "?";
}

#ifdef GJ_HAVE_MPI
#include <mpi.h>
#include <pthread.h>

struct gj_pg {
    MPI_Comm comm;
    int rank, size;
    gj_stream *stream;
    bool from_init;          /* made by gj_pg_init (counts toward finalize) */
    _Atomic bool broken;     /* a collective timed out: its request is still pending */
};

static pthread_mutex_t g_mpi_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_groups;    /* live groups made by gj_pg_init */
static bool g_we_initialised, g_finalised;
static MPI_Op g_bf16_sum = MPI_OP_NULL;

bool gj_dist_available(void) { return true; }

/* MPI user op: bf16 words summed in f32, each partial sum rounded. */
static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
    (void)dt;
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++)
        b[i] = gj_m_f32_to_bf16(gj_m_bf16_to_f32(a[i]) + gj_m_bf16_to_f32(b[i]));
}

static void mpi_msg(char *out, size_t cap, const char *what, int code) {
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(code, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", code);
    snprintf(out, cap, "%.96s: %.200s", what, s);
}

static gj_pg *pg_new(MPI_Comm base, bool from_init) {
    gj_pg *pg = gj_rt_calloc(1, sizeof *pg);
    if (!pg) return NULL;
    int rc = MPI_Comm_dup(base, &pg->comm);
    if (rc != MPI_SUCCESS) {
        char m[400];
        mpi_msg(m, sizeof m, "gj_pg_init: MPI_Comm_dup", rc);
        gj_rt_set_error("%s", m);
        gj_rt_free(pg);
        return NULL;
    }
    MPI_Comm_set_errhandler(pg->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(pg->comm, &pg->rank);
    MPI_Comm_size(pg->comm, &pg->size);
    pg->from_init = from_init;
    pg->stream = gj_stream_new();
    if (!pg->stream) {
        MPI_Comm_free(&pg->comm);
        gj_rt_free(pg);
        return NULL;
    }
    return pg;
}

gj_pg *gj_pg_init(void) {
    pthread_mutex_lock(&g_mpi_lock);
    gj_pg *pg = NULL;
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (fin || g_finalised) {
        gj_rt_set_error("gj_pg_init: MPI was already finalised in this process (MPI cannot "
                        "start twice)");
        goto out;
    }
    if (!inited) {
        /* Open MPI's nonblocking allreduce (libnbc) picks a binomial tree
         * for few ranks, which took 2-3x the blocking allreduce's time on
         * 7 MB here; its ring runs at the blocking one's speed and gives
         * every rank the same bits. A user's own setting wins. */
        setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", 0);
        int provided = 0;
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
        if (rc != MPI_SUCCESS) {
            gj_rt_set_error("gj_pg_init: MPI_Init_thread failed (code %d)", rc);
            goto out;
        }
        g_we_initialised = true;
        if (provided < MPI_THREAD_SERIALIZED) {
            gj_rt_set_error("gj_pg_init: this MPI provides thread level %d; gradjit calls MPI "
                            "from its communication thread and needs at least "
                            "MPI_THREAD_SERIALIZED", provided);
            MPI_Finalize();
            g_finalised = true;
            goto out;
        }
    } else {
        int provided = 0;
        MPI_Query_thread(&provided);
        if (provided < MPI_THREAD_SERIALIZED) {
            gj_rt_set_error("gj_pg_init: MPI was initialised with thread level %d; gradjit "
                            "needs MPI_Init_thread with MPI_THREAD_SERIALIZED or more", provided);
            goto out;
        }
    }
    if (g_bf16_sum == MPI_OP_NULL) MPI_Op_create(bf16_sum, 1, &g_bf16_sum);
    pg = pg_new(MPI_COMM_WORLD, true);
    if (pg) g_init_groups++;
out:
    pthread_mutex_unlock(&g_mpi_lock);
    return pg;
}

gj_pg *gj_pg_from_comm(const void *mpi_comm) {
    if (!mpi_comm) {
        gj_rt_set_error("gj_pg_from_comm: communicator pointer is NULL");
        return NULL;
    }
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (!inited || fin) {
        gj_rt_set_error("gj_pg_from_comm: MPI is not initialised (call MPI_Init_thread first, "
                        "or use gj_pg_init)");
        return NULL;
    }
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_SERIALIZED) {
        gj_rt_set_error("gj_pg_from_comm: MPI thread level %d; gradjit needs "
                        "MPI_THREAD_SERIALIZED or more", provided);
        return NULL;
    }
    pthread_mutex_lock(&g_mpi_lock);
    if (g_bf16_sum == MPI_OP_NULL) MPI_Op_create(bf16_sum, 1, &g_bf16_sum);
    pthread_mutex_unlock(&g_mpi_lock);
    return pg_new(*(const MPI_Comm *)mpi_comm, false);
}

int gj_pg_rank(const gj_pg *pg) { return pg ? pg->rank : -1; }
int gj_pg_size(const gj_pg *pg) { return pg ? pg->size : -1; }

void gj_pg_free(gj_pg *pg) {
    if (!pg) return;
    gj_stream_free(pg->stream); /* runs what is queued first */
    bool broken = atomic_load(&pg->broken);
    if (!broken) MPI_Comm_free(&pg->comm); /* a pending request keeps it in use */
    pthread_mutex_lock(&g_mpi_lock);
    if (pg->from_init && --g_init_groups == 0 && g_we_initialised && !broken) {
        if (g_bf16_sum != MPI_OP_NULL) MPI_Op_free(&g_bf16_sum);
        MPI_Finalize();
        g_finalised = true;
    }
    pthread_mutex_unlock(&g_mpi_lock);
    gj_rt_free(pg);
}

/* Polls req until done or the timeout; 0, or -1 with job->err. */
static int poll_request(gj_pg *pg, gj_dist_job *job, MPI_Request *req, const char *what) {
    double limit = gj_dist_timeout() * 1e3, t0 = gj_dist_now_ms();
    for (long spins = 0;; spins++) {
        int flag = 0;
        int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            mpi_msg(job->err, sizeof job->err, what, rc);
            return -1;
        }
        if (flag) return 0;
        if (gj_dist_now_ms() - t0 > limit) {
            atomic_store(&pg->broken, true);
            snprintf(job->err, sizeof job->err, "%s did not complete within %.0f s on rank %d of "
                     "%d: another rank failed, was killed or issued a different collective "
                     "(GRADJIT_DIST_TIMEOUT); the process group is unusable now", what,
                     limit / 1e3, pg->rank, pg->size);
            return -1;
        }
        /* Open MPI moves a large message in fragments, each only when a
         * rank polls: yield (the backward's threads get the core when they
         * want it) rather than sleep, which cost 4x on 7 MB; after a
         * second without completion the other ranks are late (in their
         * backward, or gone): sleep then, 50 us at a time */
        if (spins < 64) continue;
        if (gj_dist_now_ms() - t0 < 1000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

static MPI_Datatype wire_type(gj_dtype d) {
    return d == GJ_F64 ? MPI_DOUBLE : d == GJ_F32 ? MPI_FLOAT : d == GJ_I64 ? MPI_INT64_T
                                                                           : MPI_UINT16_T;
}

static void scale_avg(gj_dist_job *job, int size, void *buf, int64_t n) {
    if (job->op != GJ_REDUCE_AVG || size == 1) return;
    if (job->wire == GJ_F64) {
        double *p = buf;
        for (int64_t i = 0; i < n; i++) p[i] /= size;
    } else if (job->wire == GJ_F32) {
        float *p = buf;
        for (int64_t i = 0; i < n; i++) p[i] /= (float)size;
    } else {
        uint16_t *p = buf;
        for (int64_t i = 0; i < n; i++)
            p[i] = gj_m_f32_to_bf16(gj_m_bf16_to_f32(p[i]) / (float)size);
    }
}

typedef struct job_ctx {
    gj_pg *pg;
    gj_dist_job *job;
} job_ctx;

/* Runs on the group's stream thread. */
static void run_job(void *arg) {
    job_ctx *c = arg;
    gj_pg *pg = c->pg;
    gj_dist_job *job = c->job;
    gj_rt_free(c);
    double t0 = gj_dist_now_ms();
    char what[96];
    snprintf(what, sizeof what, "MPI %s of %lld %s values", kind_name(job->kind),
             (long long)job->count, dtype_name(job->wire));
    job->status = -1;
    if (atomic_load(&pg->broken)) {
        snprintf(job->err, sizeof job->err, "%s: the process group is unusable after an earlier "
                 "collective timed out", what);
        return;
    }
    if (job->count > INT32_MAX) {
        snprintf(job->err, sizeof job->err, "%s: more than 2^31-1 elements in one collective",
                 what);
        return;
    }
    int n = (int)job->count, rc = MPI_SUCCESS;
    MPI_Datatype dt = wire_type(job->wire);
    MPI_Op op = job->wire == GJ_BF16 ? g_bf16_sum : MPI_SUM;
    MPI_Request req = MPI_REQUEST_NULL;
    switch (job->kind) {
    case GJ_DIST_ALLREDUCE:
        rc = MPI_Iallreduce(MPI_IN_PLACE, job->buf, n, dt, op, pg->comm, &req);
        break;
    case GJ_DIST_BCAST:
        rc = MPI_Ibcast(job->buf, n, dt, job->root, pg->comm, &req);
        break;
    case GJ_DIST_ALLGATHER:
        rc = MPI_Iallgather(job->send, n, dt, job->buf, n, dt, pg->comm, &req);
        break;
    case GJ_DIST_REDUCE_SCATTER:
        rc = MPI_Ireduce_scatter_block(job->send, job->buf, n / pg->size, dt, op, pg->comm, &req);
        break;
    case GJ_DIST_BARRIER:
        rc = MPI_Ibarrier(pg->comm, &req);
        break;
    }
    if (rc != MPI_SUCCESS) {
        mpi_msg(job->err, sizeof job->err, what, rc);
        return;
    }
    if (poll_request(pg, job, &req, what) != 0) return;
    if (job->kind == GJ_DIST_ALLREDUCE) scale_avg(job, pg->size, job->buf, job->count);
    if (job->kind == GJ_DIST_REDUCE_SCATTER)
        scale_avg(job, pg->size, job->buf, job->count / pg->size);
    job->status = 0;
    job->ms = gj_dist_now_ms() - t0;
}

int gj_dist_submit(gj_pg *pg, gj_dist_job *job) {
    job->status = -1;
    job->err[0] = 0;
    job->done = NULL;
    job_ctx *c = gj_rt_malloc(sizeof *c);
    if (!c) return -1;
    c->pg = pg;
    c->job = job;
    if (gj_stream_enqueue(pg->stream, run_job, c) != 0) {
        gj_rt_free(c);
        return -1;
    }
    job->done = gj_stream_record_event(pg->stream);
    if (!job->done) { /* the job is queued: wait for all of the stream instead */
        gj_stream_synchronize(pg->stream);
        return 0;
    }
    return 0;
}

#else /* no MPI in this build */

struct gj_pg {
    int unused;
};

bool gj_dist_available(void) { return false; }

static void no_mpi(const char *op) {
    gj_rt_set_error("%s: gradjit was built without MPI (install libopenmpi-dev and rebuild with "
                    "-DGJ_MPI=ON)", op);
}

gj_pg *gj_pg_init(void) {
    no_mpi("gj_pg_init");
    return NULL;
}

gj_pg *gj_pg_from_comm(const void *mpi_comm) {
    (void)mpi_comm;
    no_mpi("gj_pg_from_comm");
    return NULL;
}

int gj_pg_rank(const gj_pg *pg) { return pg ? 0 : -1; }
int gj_pg_size(const gj_pg *pg) { return pg ? 1 : -1; }
void gj_pg_free(gj_pg *pg) { (void)pg; }

int gj_dist_submit(gj_pg *pg, gj_dist_job *job) {
    (void)pg;
    job->done = NULL;
    no_mpi(kind_name(job->kind));
    return -1;
}
#endif

int gj_dist_wait(gj_dist_job *job) {
    if (job->done) {
        gj_event_wait(job->done);
        gj_event_free(job->done);
        job->done = NULL;
    }
    if (job->status != 0) gj_rt_set_error("%s", job->err[0] ? job->err : "collective failed");
    return job->status;
}

static int run_sync(gj_pg *pg, gj_dist_job *job) {
    if (gj_dist_submit(pg, job) != 0) return -1;
    return gj_dist_wait(job);
}

static int with_context(const char *ctx) {
    char m[512];
    snprintf(m, sizeof m, "%s", gj_last_error());
    gj_rt_set_error("%s: %s", ctx, m);
    return -1;
}

int gj_dist_allgather_i64(gj_pg *pg, const int64_t *mine, int n, int64_t *all,
                          const char *what) {
    gj_dist_job job = {.kind = GJ_DIST_ALLGATHER, .wire = GJ_I64, .send = (void *)mine,
                       .buf = all, .count = n};
    if (run_sync(pg, &job) == 0) return 0;
    return with_context(what);
}

static int need_pg(const char *op, gj_pg *pg) {
    if (pg) return 0;
    gj_rt_set_error("%s: process group is NULL", op);
    return -1;
}

int gj_pg_barrier(gj_pg *pg) {
    if (need_pg("gj_pg_barrier", pg) != 0) return -1;
    gj_dist_job job = {.kind = GJ_DIST_BARRIER, .wire = GJ_F32};
    return run_sync(pg, &job);
}

/* bf16 tensors are reduced in f32: a converted copy goes on the wire and
 * the result is rounded back once. */
static float *bf16_to_f32_copy(gj_tensor *t) {
    int64_t n = gj_tensor_numel(t);
    float *f = gj_rt_malloc((size_t)(n ? n : 1) * sizeof *f);
    if (!f) return NULL;
    const uint16_t *h = gj_tensor_data(t);
    for (int64_t i = 0; i < n; i++) f[i] = gj_m_bf16_to_f32(h[i]);
    return f;
}

static void f32_to_bf16_into(gj_tensor *t, const float *f) {
    int64_t n = gj_tensor_numel(t);
    uint16_t *h = gj_tensor_data(t);
    for (int64_t i = 0; i < n; i++) h[i] = gj_m_f32_to_bf16(f[i]);
}

static int prefix(const char *op, gj_tensor *t, char *ctx, size_t cap) {
    char sh[160];
    fmt_shape(sh, sizeof sh, t);
    snprintf(ctx, cap, "%s(%s %s)", op, sh, dtype_name(gj_tensor_dtype(t)));
    return 0;
}

int gj_allreduce(gj_pg *pg, gj_tensor *t, gj_reduce_op op) {
    if (need_pg("gj_allreduce", pg) != 0 || check_tensor("gj_allreduce", t) != 0) return -1;
    if (op != GJ_REDUCE_SUM && op != GJ_REDUCE_AVG) {
        gj_rt_set_error("gj_allreduce: unknown reduce op %d", (int)op);
        return -1;
    }
    char ctx[256];
    prefix("gj_allreduce", t, ctx, sizeof ctx);
    gj_dtype d = gj_tensor_dtype(t);
    float *tmp = d == GJ_BF16 ? bf16_to_f32_copy(t) : NULL;
    if (d == GJ_BF16 && !tmp) return -1;
    gj_dist_job job = {.kind = GJ_DIST_ALLREDUCE, .wire = d == GJ_BF16 ? GJ_F32 : d, .op = op,
                       .buf = tmp ? (void *)tmp : gj_tensor_data(t), .count = gj_tensor_numel(t)};
    int rc = run_sync(pg, &job);
    if (rc == 0 && tmp) f32_to_bf16_into(t, tmp);
    gj_rt_free(tmp);
    if (rc == 0) gj_rt_bump_version(t);
    return rc == 0 ? 0 : with_context(ctx);
}

int gj_broadcast(gj_pg *pg, gj_tensor *t, int root) {
    if (need_pg("gj_broadcast", pg) != 0 || check_tensor("gj_broadcast", t) != 0) return -1;
    if (root < 0 || root >= gj_pg_size(pg)) {
        gj_rt_set_error("gj_broadcast: root %d is not a rank of this group (size %d)", root,
                        gj_pg_size(pg));
        return -1;
    }
    char ctx[256];
    prefix("gj_broadcast", t, ctx, sizeof ctx);
    gj_dtype d = gj_tensor_dtype(t);
    gj_dist_job job = {.kind = GJ_DIST_BCAST, .wire = d, .buf = gj_tensor_data(t),
                       .count = gj_tensor_numel(t), .root = root};
    int rc = run_sync(pg, &job);
    if (rc == 0) gj_rt_bump_version(t);
    return rc == 0 ? 0 : with_context(ctx);
}

/* The NULL a collective returning a tensor ends with when it failed: the
 * error becomes the cause a NULL argument cites when it is passed on. */
static gj_tensor *dist_null(void) {
    gj_rt_null_result();
    return NULL;
}

gj_tensor *gj_allgather(gj_pg *pg, gj_tensor *t) {
    if (need_pg("gj_allgather", pg) != 0 || check_tensor("gj_allgather", t) != 0)
        return dist_null();
    int nd = gj_tensor_ndim(t);
    char ctx[256];
    prefix("gj_allgather", t, ctx, sizeof ctx);
    if (nd < 1) {
        gj_rt_set_error("%s: needs at least one dimension to gather along", ctx);
        return dist_null();
    }
    int64_t shape[GJ_MAX_DIMS];
    memcpy(shape, gj_tensor_shape(t), (size_t)nd * sizeof shape[0]);
    shape[0] *= gj_pg_size(pg);
    gj_tensor *out = gj_zeros(gj_tensor_dtype(t), nd, shape);
    if (!out) return dist_null();
    gj_dist_job job = {.kind = GJ_DIST_ALLGATHER, .wire = gj_tensor_dtype(t),
                       .send = gj_tensor_data(t), .buf = gj_tensor_data(out),
                       .count = gj_tensor_numel(t)};
    if (run_sync(pg, &job) != 0) {
        gj_release(out);
        with_context(ctx);
        return dist_null();
    }
    return out;
}

gj_tensor *gj_reduce_scatter(gj_pg *pg, gj_tensor *t, gj_reduce_op op) {
    if (need_pg("gj_reduce_scatter", pg) != 0 || check_tensor("gj_reduce_scatter", t) != 0)
        return dist_null();
    int nd = gj_tensor_ndim(t), size = gj_pg_size(pg);
    char ctx[256];
    prefix("gj_reduce_scatter", t, ctx, sizeof ctx);
    if (nd < 1 || gj_tensor_shape(t)[0] % size != 0) {
        gj_rt_set_error("%s: the first dimension must be a multiple of the group size %d", ctx,
                        size);
        return dist_null();
    }
    if (op != GJ_REDUCE_SUM && op != GJ_REDUCE_AVG) {
        gj_rt_set_error("%s: unknown reduce op %d", ctx, (int)op);
        return dist_null();
    }
    int64_t shape[GJ_MAX_DIMS];
    memcpy(shape, gj_tensor_shape(t), (size_t)nd * sizeof shape[0]);
    shape[0] /= size;
    gj_dtype d = gj_tensor_dtype(t);
    gj_tensor *out = gj_zeros(d, nd, shape);
    if (!out) return dist_null();
    float *in32 = NULL, *out32 = NULL;
    if (d == GJ_BF16) {
        in32 = bf16_to_f32_copy(t);
        out32 = gj_rt_malloc((size_t)(gj_tensor_numel(out) + 1) * sizeof *out32);
        if (!in32 || !out32) goto fail;
    }
    gj_dist_job job = {.kind = GJ_DIST_REDUCE_SCATTER, .wire = d == GJ_BF16 ? GJ_F32 : d,
                       .op = op, .send = in32 ? (void *)in32 : gj_tensor_data(t),
                       .buf = out32 ? (void *)out32 : gj_tensor_data(out),
                       .count = gj_tensor_numel(t)};
    if (run_sync(pg, &job) != 0) {
        with_context(ctx);
        goto fail;
    }
    if (out32) f32_to_bf16_into(out, out32);
    gj_rt_free(in32);
    gj_rt_free(out32);
    return out;
fail:
    gj_rt_free(in32);
    gj_rt_free(out32);
    gj_release(out);
    return dist_null();
}

struct gj_work {
    gj_dist_job job;
    gj_tensor *t;   /* retained */
    float *tmp;     /* bf16: the f32 copy on the wire */
    char ctx[256];
};

gj_work *gj_allreduce_async(gj_pg *pg, gj_tensor *t, gj_reduce_op op) {
    if (need_pg("gj_allreduce_async", pg) != 0 || check_tensor("gj_allreduce_async", t) != 0)
        return NULL;
    if (op != GJ_REDUCE_SUM && op != GJ_REDUCE_AVG) {
        gj_rt_set_error("gj_allreduce_async: unknown reduce op %d", (int)op);
        return NULL;
    }
    gj_work *w = gj_rt_calloc(1, sizeof *w);
    if (!w) return NULL;
    prefix("gj_allreduce_async", t, w->ctx, sizeof w->ctx);
    gj_dtype d = gj_tensor_dtype(t);
    if (d == GJ_BF16 && !(w->tmp = bf16_to_f32_copy(t))) {
        gj_rt_free(w);
        return NULL;
    }
    w->t = gj_retain(t);
    w->job = (gj_dist_job){.kind = GJ_DIST_ALLREDUCE, .wire = d == GJ_BF16 ? GJ_F32 : d,
                           .op = op, .buf = w->tmp ? (void *)w->tmp : gj_tensor_data(t),
                           .count = gj_tensor_numel(t)};
    if (gj_dist_submit(pg, &w->job) != 0) {
        gj_release(w->t);
        gj_rt_free(w->tmp);
        gj_rt_free(w);
        return NULL;
    }
    return w;
}

int gj_work_wait(gj_work *w) {
    if (!w) {
        gj_rt_set_error("gj_work_wait: work is NULL");
        return -1;
    }
    int rc = gj_dist_wait(&w->job);
    if (rc == 0 && w->tmp) f32_to_bf16_into(w->t, w->tmp);
    if (rc == 0) gj_rt_bump_version(w->t);
    else with_context(w->ctx);
    gj_release(w->t);
    gj_rt_free(w->tmp);
    gj_rt_free(w);
    return rc;
}
