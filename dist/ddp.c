// SPDX-License-Identifier: MIT
/*
 * ddp.c - distributed data parallel: gradient buckets averaged over a
 * process group while backward goes on.
 *
 * Invariants. Parameters are assigned to buckets once, in reverse order
 * (the order backward finalises them), a bucket holding one wire dtype and
 * about bucket_bytes. A post-accumulate hook per parameter copies its final
 * .grad into its bucket's wire buffer and marks it ready; buckets are
 * started strictly in index order (next_start), each as soon as it and all
 * before it are complete, so every rank issues the same collectives in the
 * same order whatever order its hooks ran in (an unused parameter on one
 * rank only delays, never reorders). gj_ddp_wait completes the missing
 * parameters (their .grad or zeros), starts the rest, waits for all and
 * writes the averages back; after it no bucket is in flight. With sync
 * off, hooks do nothing and .grads accumulate locally.
 *
 * ZeRO (opt.zero): each bucket, padded to a multiple of the ranks, is cut
 * into one range per rank; the optimizer updates this rank's shards.
 * Stage 3 also makes every parameter's storage remote (the section "ZeRO
 * stage 3" below): its bytes exist only while its bucket is gathered,
 * at most Z3_LIVE buckets at once, and the gradient buffers only while
 * a step reduces them.
 */
#include "dist/dist.h"

#include "jit/jit.h"
#include "runtime/gj_math.h"
#include "runtime/rt.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ddp_bucket {
    gj_dtype wire;
    int first, n;        /* params order[first .. first+n) */
    int64_t count;       /* elements */
    void *buf;           /* count wire values (ZeRO: padded to a multiple of the ranks) */
    int64_t padded;      /* ZeRO: count rounded up to a multiple of the ranks */
    int64_t lo, hi;      /* ZeRO: this rank's range [lo, hi) of the bucket's elements */
    void *shard_buf;     /* ZeRO: padded / ranks values (reduce-scatter, allgather) */
    int ready;           /* params of this bucket marked ready this step */
    bool started;
    bool early;          /* stage 3: reduced (and its buffer dropped) while later buckets
                            were still being filled; its averages wait in shard_buf */
    gj_dist_job job;
    /* ZeRO stage 3: the bucket is also the unit parameters are gathered in */
    void *full;          /* padded values: every rank's range (NULL: released) */
    void *send;          /* this rank's range, packed from its shards, while gathering */
    bool gathering;      /* gjob in flight (full allocated, not yet written) */
    gj_dist_job gjob;
    uint64_t use;        /* d->tick of its last read */
    uint64_t epoch;      /* the runtime epoch of its last read */
} ddp_bucket;

typedef struct hook_ctx {
    gj_ddp *d;
    int i;
} hook_ctx;

struct gj_ddp {
    gj_pg *pg;
    int n;
    gj_tensor **params;  /* retained */
    int *order;          /* bucket order: order[k] = param index */
    int *bucket_of;      /* per param */
    int64_t *offset;     /* per param: element offset in its bucket */
    bool *ready;         /* per param, this step */
    int64_t *hooks;      /* per param: post-accumulate hook handle */
    hook_ctx *ctx;       /* per param */
    ddp_bucket *b;
    int nb, next_start;
    bool sync, any_ready;
    gj_ddp_options opt;
    gj_ddp_stats st;
    pthread_mutex_t lock;
    char err[320];       /* first failure inside a hook this step */
    gj_jit_reducer red;  /* the calls a gj_step's program makes instead of the hooks */
    int rank, size;
    gj_tensor **shard;   /* ZeRO: per param, its part on this rank (a 1-D leaf view) or NULL */
    int64_t *shard_at;   /* ZeRO: per param, where its shard starts in it */
    gj_tensor **shards;  /* ZeRO: the non-NULL shards, in parameter order */
    int n_shards;
    uint64_t layout;     /* the hash of parameters and buckets all ranks agreed */
    /* ZeRO stage 3 */
    uint64_t tick;       /* reads of gathered units */
    int last_miss;       /* the unit last gathered on demand (-1: none), for the direction */
    bool held;           /* gj_ddp_unshard, a compiled step: every unit gathered and kept */
    bool z3_ready;       /* the parameters' storages are remote (z3_setup ran) */
    int *pend;           /* parameters whose full .grad is packed, to be dropped */
    int n_pend;
};

/* ZeRO stage 3: at most Z3_LIVE units present (gathered or in flight) at
 * once, unless one primitive reads more: the one read now and the
 * Z3_AHEAD prefetched after it. */
enum { Z3_LIVE = 3, Z3_AHEAD = 1 };

static size_t wire_bytes(gj_dtype d) { return d == GJ_F64 ? 8 : d == GJ_F32 ? 4 : 2; }

static void z3_release_all(gj_ddp *d);

static gj_dtype wire_of(gj_dtype param, bool bf16) {
    if (param == GJ_F64) return GJ_F64;
    return bf16 ? GJ_BF16 : GJ_F32; /* bf16 params are reduced in f32 unless asked otherwise */
}

/* Copies n contiguous values of dtype dt at src into wire buffer dst, as
 * pack does for a tensor of that dtype. */
static void pack_raw(gj_dtype dt, const void *src, int64_t n, gj_dtype wire, void *dst) {
    if (dt == wire) {
        memcpy(dst, src, (size_t)n * wire_bytes(wire));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        double v = dt == GJ_F64 ? ((const double *)src)[i]
                   : dt == GJ_F32 ? ((const float *)src)[i]
                                  : gj_m_bf16_to_f32(((const uint16_t *)src)[i]);
        if (wire == GJ_F64) ((double *)dst)[i] = v;
        else if (wire == GJ_F32) ((float *)dst)[i] = (float)v;
        else ((uint16_t *)dst)[i] = gj_m_f32_to_bf16((float)v);
    }
}

/* Copies tensor g (any layout; f32/f64/bf16) into wire buffer dst. */
static int pack(gj_tensor *g, gj_dtype wire, void *dst) {
    int64_t n = gj_tensor_numel(g);
    if (gj_tensor_dtype(g) == wire && gj_tensor_is_contiguous(g)) { /* the usual case */
        memcpy(dst, gj_tensor_data(g), (size_t)n * wire_bytes(wire));
        return 0;
    }
    if (wire == GJ_F64) return gj_tensor_to_f64(g, dst);
    if (wire == GJ_F32) return gj_tensor_to_f32(g, dst);
    float *tmp = gj_rt_malloc((size_t)(n ? n : 1) * sizeof *tmp);
    if (!tmp) return -1;
    int rc = gj_tensor_to_f32(g, tmp);
    uint16_t *h = dst;
    for (int64_t i = 0; rc == 0 && i < n; i++) h[i] = gj_m_f32_to_bf16(tmp[i]);
    gj_rt_free(tmp);
    return rc;
}

static double wire_at(const void *src, gj_dtype wire, int64_t i) {
    if (wire == GJ_F64) return ((const double *)src)[i];
    if (wire == GJ_F32) return ((const float *)src)[i];
    return gj_m_bf16_to_f32(((const uint16_t *)src)[i]);
}

/* Writes n wire values at src into dst (contiguous, dtype gd). */
static void unpack_raw(gj_dtype wire, const void *src, int64_t n, gj_dtype gd, void *dst) {
    if (gd == wire) {
        memcpy(dst, src, (size_t)n * wire_bytes(wire));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        double v = wire_at(src, wire, i);
        if (gd == GJ_F64) ((double *)dst)[i] = v;
        else if (gd == GJ_F32) ((float *)dst)[i] = (float)v;
        else ((uint16_t *)dst)[i] = gj_m_f32_to_bf16((float)v);
    }
}

/* Writes n wire values into param p's .grad (made, in p's dtype, when p
 * has none or a non-contiguous one). */
static int unpack(gj_tensor *p, gj_dtype wire, const void *src) {
    gj_tensor *g = gj_tensor_grad(p);
    int64_t n = gj_tensor_numel(p);
    gj_tensor *fresh = NULL;
    if (!g || !gj_tensor_is_contiguous(g)) {
        fresh = gj_zeros(gj_tensor_dtype(p), gj_tensor_ndim(p), gj_tensor_shape(p));
        if (!fresh) return -1;
        g = fresh;
    }
    unpack_raw(wire, src, n, gj_tensor_dtype(g), gj_tensor_data(g));
    int rc = 0;
    if (fresh) {
        rc = gj_tensor_set_grad(p, fresh);
        gj_release(fresh);
    } else {
        gj_rt_bump_version(g);
    }
    return rc;
}

/* Bucket b's gradient buffer (ZeRO stage 3: made on first use, zeroed, and
 * dropped once reduced, so nothing of it is held between steps). NULL
 * with an error when out of memory. */
static void *bucket_buf(ddp_bucket *b) {
    if (!b->buf) b->buf = gj_rt_calloc((size_t)(b->padded ? b->padded : 1), wire_bytes(b->wire));
    return b->buf;
}

static void bucket_buf_drop(const gj_ddp *d, ddp_bucket *b) {
    if (d->opt.zero < 3 || b->started) return;
    gj_rt_free(b->buf);
    b->buf = NULL;
}

/* ZeRO: where parameter i's shard sits in a buffer of bucket b's range
 * (this rank's part of the bucket: what a reduce-scatter delivers and an
 * allgather sends). */
static char *range_at(const gj_ddp *d, const ddp_bucket *b, int i, void *range) {
    return (char *)range + (d->offset[i] + d->shard_at[i] - b->lo) * (int64_t)wire_bytes(b->wire);
}

/* The same in b's own range buffer, shard_buf. */
static char *in_range(const gj_ddp *d, const ddp_bucket *b, int i) {
    return range_at(d, b, i, b->shard_buf);
}

/* ZeRO: where parameter i's shard's averages are once b was reduced
 * (stage 2: the range buffer; stage 1: its place in the whole bucket). */
static const char *reduced_shard(const gj_ddp *d, const ddp_bucket *b, int i) {
    if (d->opt.zero >= 2) return in_range(d, b, i);
    return (const char *)b->buf + (d->offset[i] + d->shard_at[i]) * (int64_t)wire_bytes(b->wire);
}

/* Starts every complete bucket from next_start on, in order. Lock held. */
static int start_ready(gj_ddp *d, bool by_hook) {
    while (d->next_start < d->nb && d->b[d->next_start].ready == d->b[d->next_start].n) {
        ddp_bucket *b = &d->b[d->next_start];
        b->job = (gj_dist_job){.kind = GJ_DIST_ALLREDUCE, .wire = b->wire, .op = GJ_REDUCE_AVG,
                               .buf = b->buf, .count = b->count};
        if (d->opt.zero >= 2) /* each rank receives its range's averages only */
            b->job = (gj_dist_job){.kind = GJ_DIST_REDUCE_SCATTER, .wire = b->wire,
                                   .op = GJ_REDUCE_AVG, .send = b->buf, .buf = b->shard_buf,
                                   .count = b->padded};
        if (gj_dist_submit(d->pg, &b->job) != 0) return -1;
        b->started = true;
        d->next_start++;
        d->st.allreduces++;
        d->st.started_by_hook += by_hook;
        d->st.bytes += b->count * (int64_t)wire_bytes(b->wire);
        /* stage 3: the bucket two before this one has had a whole bucket's
         * backward to finish: its averages are taken off the wire and its
         * gradient buffer dropped, so at most about two are held */
        int k = d->next_start - 3;
        if (d->opt.zero == 3 && k >= 0 && d->b[k].started) {
            ddp_bucket *e = &d->b[k];
            int rc = gj_dist_wait(&e->job);
            d->st.comm_ms += e->job.ms;
            e->started = false;
            if (rc != 0) {
                e->ready = -1;
                return -1;
            }
            e->early = true;
            bucket_buf_drop(d, e);
        }
    }
    return 0;
}

static void on_grad(gj_tensor *leaf, void *user) {
    hook_ctx *hc = user;
    gj_ddp *d = hc->d;
    int i = hc->i;
    if (!d->sync) return;
    pthread_mutex_lock(&d->lock);
    if (d->ready[i]) {
        gj_rt_set_error("gj_ddp: parameter %d got a second gradient before gj_ddp_wait (two "
                        "backwards in one step: turn sync off with gj_ddp_set_sync for all but "
                        "the last micro-batch)", i);
        snprintf(d->err, sizeof d->err, "%s", gj_last_error());
        pthread_mutex_unlock(&d->lock);
        return;
    }
    ddp_bucket *b = &d->b[d->bucket_of[i]];
    gj_tensor *g = gj_tensor_grad(leaf);
    int rc = bucket_buf(b) ? 0 : -1;
    if (rc == 0 && g) {
        rc = pack(g, b->wire, (char *)b->buf + d->offset[i] * (int64_t)wire_bytes(b->wire));
    } else if (rc == 0) {
        memset((char *)b->buf + d->offset[i] * (int64_t)wire_bytes(b->wire), 0,
               (size_t)gj_tensor_numel(leaf) * wire_bytes(b->wire));
    }
    /* stage 3: a full .grad packed into its bucket is dropped (as FSDP
     * frees the unsharded gradient), one parameter later: the hooks
     * registered after this one on the same leaf still see it */
    for (int k = 0; rc == 0 && k < d->n_pend; k++)
        rc = gj_tensor_set_grad(d->params[d->pend[k]], NULL);
    d->n_pend = 0;
    if (rc == 0 && d->opt.zero == 3 && g) d->pend[d->n_pend++] = i;
    if (rc == 0) {
        d->ready[i] = true;
        d->any_ready = true;
        b->ready++;
        rc = start_ready(d, true);
    }
    if (rc != 0 && !d->err[0]) snprintf(d->err, sizeof d->err, "%s", gj_last_error());
    pthread_mutex_unlock(&d->lock);
}

/* ------------------------------------------ the compiled step's calls */

/* gj_jit_reducer.give: parameter i's final gradient (NULL: zeros) into its
 * bucket, which starts, in order, once complete (as on_grad). */
static int red_give(void *ctx, int i, gj_dtype dt, const void *grad) {
    gj_ddp *d = ctx;
    pthread_mutex_lock(&d->lock);
    int rc = -1;
    ddp_bucket *b = &d->b[d->bucket_of[i]];
    if (d->ready[i]) {
        gj_rt_set_error("gj_ddp: parameter %d got a second gradient before its bucket was "
                        "reduced (another backward or step of the same parameters in between)",
                        i);
        goto out;
    }
    if (!bucket_buf(b)) goto out;
    void *dst = (char *)b->buf + d->offset[i] * (int64_t)wire_bytes(b->wire);
    int64_t n = gj_tensor_numel(d->params[i]);
    if (grad) pack_raw(dt, grad, n, b->wire, dst);
    else memset(dst, 0, (size_t)n * wire_bytes(b->wire));
    d->ready[i] = true;
    d->any_ready = true;
    b->ready++;
    rc = start_ready(d, true);
out:
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* gj_jit_reducer.take: waits for parameter i's bucket (once) and writes its
 * average. */
static int red_take(void *ctx, int i, gj_dtype dt, void *out) {
    gj_ddp *d = ctx;
    double t0 = gj_dist_now_ms();
    pthread_mutex_lock(&d->lock);
    int rc = 0;
    ddp_bucket *b = &d->b[d->bucket_of[i]];
    if (b->ready < 0) {
        gj_rt_set_error("gj_ddp: the allreduce of bucket %d failed", d->bucket_of[i]);
        rc = -1;
    } else if (b->started) { /* the first take of this bucket */
        rc = gj_dist_wait(&b->job);
        d->st.comm_ms += b->job.ms;
        b->started = false;
        if (rc != 0) b->ready = -1; /* (failed: every take of it fails) */
        else bucket_buf_drop(d, b); /* (stage 3: its averages are in shard_buf) */
    } else if (b->ready != b->n) {
        gj_rt_set_error("gj_step_run: internal: the gradient of parameter %d was taken before "
                        "its bucket %d was complete", i, d->bucket_of[i]);
        rc = -1;
    }
    if (rc == 0 && d->opt.zero) { /* this rank's shard of it */
        if (d->shard[i])
            unpack_raw(b->wire, reduced_shard(d, b, i), gj_tensor_numel(d->shard[i]), dt, out);
    } else if (rc == 0) {
        unpack_raw(b->wire, (char *)b->buf + d->offset[i] * (int64_t)wire_bytes(b->wire),
                   gj_tensor_numel(d->params[i]), dt, out);
    }
    d->st.wait_ms += gj_dist_now_ms() - t0;
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* gj_jit_reducer.end: after a compiled step, whatever its result. */
static int red_end(void *ctx) {
    gj_ddp *d = ctx;
    pthread_mutex_lock(&d->lock);
    int rc = 0;
    bool all = d->any_ready;
    for (int k = 0; k < d->nb; k++) {
        ddp_bucket *b = &d->b[k];
        if (b->started) { /* (a run that failed between give and take) */
            if (gj_dist_wait(&b->job) != 0) rc = -1;
            d->st.comm_ms += b->job.ms;
            b->started = false;
        }
        all &= b->ready == b->n;
        b->ready = 0;
        b->early = false;
        bucket_buf_drop(d, b);
    }
    memset(d->ready, 0, (size_t)d->n * sizeof *d->ready);
    d->next_start = 0;
    d->any_ready = false;
    d->err[0] = 0;
    if (rc == 0 && all) d->st.steps++;
    pthread_mutex_unlock(&d->lock);
    return rc;
}

static int red_wait(void *ctx) { return gj_ddp_wait(ctx); }

static int red_after(void *ctx) { return gj_ddp_gather(ctx); }

static int same_on_all_ranks(gj_pg *pg, const int64_t *mine, int n, const char *what,
                             const char *detail);

static int red_agree(void *ctx, const int64_t *v, int n, const char *what, const char *detail) {
    gj_ddp *d = ctx;
    return same_on_all_ranks(d->pg, v, n, what, detail);
}

/* The gj_ddp whose group agrees compiled keys (the newest one). */
static pthread_mutex_t g_agree_lock = PTHREAD_MUTEX_INITIALIZER;
static gj_ddp *g_agreeing;

/* Compares values mine[0..n) of every rank; 0 when all equal, else -1 with
 * an error "<what>: rank r: ..., rank s: ..." listing each rank's values. */
static int same_on_all_ranks(gj_pg *pg, const int64_t *mine, int n, const char *what,
                             const char *detail) {
    int size = gj_pg_size(pg);
    int64_t *all = gj_rt_calloc((size_t)size * (size_t)n, sizeof *all);
    if (!all) return -1;
    int rc = gj_dist_allgather_i64(pg, mine, n, all, what);
    bool same = true;
    for (int r = 1; rc == 0 && r < size; r++)
        same &= memcmp(all + (size_t)r * (size_t)n, all, (size_t)n * sizeof *all) == 0;
    if (rc == 0 && !same) {
        char msg[1024];
        int off = snprintf(msg, sizeof msg, "%s: the ranks differ (%s):", what, detail);
        for (int r = 0; r < size && off < (int)sizeof msg - 64; r++) {
            off += snprintf(msg + off, sizeof msg - (size_t)off, " rank %d", r);
            for (int k = 0; k < n && k < 2; k++)
                off += snprintf(msg + off, sizeof msg - (size_t)off, " %016llx",
                                (unsigned long long)all[(size_t)r * (size_t)n + (size_t)k]);
            off += snprintf(msg + off, sizeof msg - (size_t)off, "%s", r + 1 < size ? "," : "");
        }
        gj_rt_set_error("%s", msg);
        rc = -1;
    }
    gj_rt_free(all);
    return rc;
}

/* gj_jit_agree_fn: every rank must compile the same program. */
static int agree_key(void *ctx, const uint64_t hash[2]) {
    gj_ddp *d = ctx;
    int64_t mine[2];
    memcpy(mine, hash, sizeof mine);
    return same_on_all_ranks(d->pg, mine, 2, "compiled backward under gj_ddp",
                             "each rank's key of this backward: a different model, input shape "
                             "or hook on some rank; all ranks must run the same backward");
}

/* ---------------------------------------------------------------- ZeRO */

/* ZeRO: each parameter's part of this rank's range of its bucket, as a 1-D
 * leaf that requires grad and views the parameter's memory. */
static int zero_shards(gj_ddp *d) {
    d->shard = gj_rt_calloc((size_t)d->n + 1, sizeof *d->shard);
    d->shard_at = gj_rt_calloc((size_t)d->n + 1, sizeof *d->shard_at);
    d->shards = gj_rt_calloc((size_t)d->n + 1, sizeof *d->shards);
    if (!d->shard || !d->shard_at || !d->shards) return -1;
    gj_no_grad_push();
    int rc = 0;
    for (int i = 0; i < d->n && rc == 0; i++) {
        ddp_bucket *b = &d->b[d->bucket_of[i]];
        int64_t n = gj_tensor_numel(d->params[i]), a = d->offset[i];
        int64_t lo = b->lo > a ? b->lo : a, hi = b->hi < a + n ? b->hi : a + n;
        if (hi <= lo) continue;
        gj_scope_push();
        gj_tensor *flat = gj_reshape(gj_detach(d->params[i]), 1, &n);
        gj_tensor *v = flat ? gj_narrow(flat, 0, lo - a, hi - lo) : NULL;
        if (v) gj_retain(v);
        gj_scope_pop();
        if (!v || gj_set_requires_grad(v, true) != 0) {
            if (v) gj_release(v);
            rc = -1;
            break;
        }
        d->shard[i] = v;
        d->shard_at[i] = lo - a;
        d->shards[d->n_shards++] = v;
    }
    gj_no_grad_pop();
    return rc;
}

/* ZeRO, after bucket b was reduced: each shard's .grad from the averages
 * of its range (stage 1: the whole averaged bucket; stage 2: this rank's
 * range only); the parameters' own .grads are cleared. */
static int zero_unpack(gj_ddp *d, ddp_bucket *b) {
    for (int j = 0; j < b->n; j++) {
        int i = d->order[b->first + j];
        if (gj_tensor_set_grad(d->params[i], NULL) != 0) return -1;
        gj_tensor *sh = d->shard[i];
        if (!sh) continue;
        gj_tensor *g = gj_zeros(gj_tensor_dtype(sh), 1, gj_tensor_shape(sh));
        if (!g) return -1;
        unpack_raw(b->wire, reduced_shard(d, b, i), gj_tensor_numel(sh), gj_tensor_dtype(sh),
                   gj_tensor_data(g));
        int rc = gj_tensor_set_grad(sh, g);
        gj_release(g);
        if (rc != 0) return -1;
    }
    return 0;
}

int gj_ddp_shards(gj_ddp *d, gj_tensor *const **out) {
    if (!d || !out) {
        gj_rt_set_error("gj_ddp_shards: %s is NULL", !d ? "ddp" : "out");
        return -1;
    }
    if (!d->opt.zero) {
        gj_rt_set_error("gj_ddp_shards: the gj_ddp was made without ZeRO (gj_ddp_options.zero)");
        return -1;
    }
    *out = d->shards;
    return d->n_shards;
}

int gj_ddp_gather(gj_ddp *d) {
    if (!d || !d->opt.zero) {
        gj_rt_set_error("gj_ddp_gather: %s", !d ? "ddp is NULL"
                                                : "the gj_ddp was made without ZeRO "
                                                  "(gj_ddp_options.zero)");
        return -1;
    }
    int rc = 0;
    pthread_mutex_lock(&d->lock);
    if (d->opt.zero == 3) { /* stale copies dropped: the next read gathers the new values */
        z3_release_all(d);
        pthread_mutex_unlock(&d->lock);
        return 0;
    }
    for (int k = 0; k < d->nb && rc == 0; k++) {
        ddp_bucket *b = &d->b[k];
        size_t wb = wire_bytes(b->wire);
        int64_t s = b->padded / d->size;
        memset(b->shard_buf, 0, (size_t)(s ? s : 1) * wb);
        for (int j = 0; j < b->n; j++) { /* this rank's range, from the updated parameters */
            int i = d->order[b->first + j];
            if (!d->shard[i]) continue;
            memcpy(in_range(d, b, i),
                   (const char *)gj_tensor_data(d->params[i]) + d->shard_at[i] * (int64_t)wb,
                   (size_t)gj_tensor_numel(d->shard[i]) * wb);
        }
        b->job = (gj_dist_job){.kind = GJ_DIST_ALLGATHER, .wire = b->wire, .send = b->shard_buf,
                               .buf = b->buf, .count = s};
        if (gj_dist_submit(d->pg, &b->job) != 0 || gj_dist_wait(&b->job) != 0) {
            rc = -1;
            break;
        }
        d->st.comm_ms += b->job.ms;
        d->st.bytes += s * (int64_t)wb;
        for (int j = 0; j < b->n; j++) { /* every rank's ranges into the parameters */
            int i = d->order[b->first + j];
            memcpy(gj_tensor_data(d->params[i]), (const char *)b->buf + d->offset[i] * (int64_t)wb,
                   (size_t)gj_tensor_numel(d->params[i]) * wb);
            gj_rt_bump_version(d->params[i]);
        }
    }
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* -------------------------------------------------------- ZeRO stage 3
 *
 * Parameters sharded at rest: each rank keeps its shards (owned 1-D
 * leaves), and every parameter's storage is remote (runtime's
 * gj_rt_storage.fetch): no bytes until a primitive reads it. A read
 * gathers the parameter's whole bucket (the unit: one allgather of every
 * rank's ranges into one buffer its parameters point into), starts
 * gathering the next unit in the direction of the last two (the forward
 * walks units down, the backward up: a prefetch), and releases the units
 * read least recently while more than Z3_LIVE are present. The backward
 * reads a released parameter again through the same path (the autograd
 * graph keeps the parameter, never a copy of its bytes). Gradients go
 * through the buckets as in stage 2 and the full .grad is dropped as soon
 * as it is packed. Every rank reads the same parameters in the same
 * order, so the allgathers match. */

static int z3_fetch(void *owner, int id, uint64_t epoch);

/* Points unit b's parameters at their values in b->full (or at nothing). */
static void z3_point(gj_ddp *d, ddp_bucket *b, bool present) {
    size_t wb = wire_bytes(b->wire);
    for (int j = 0; j < b->n; j++) {
        int i = d->order[b->first + j];
        gj_rt_storage *st = d->params[i]->storage;
        if (st->fetch == z3_fetch && st->owner == d) /* (always: set_ refuses such a dst) */
            st->data = present ? (char *)b->full + d->offset[i] * (int64_t)wb : NULL;
    }
}

static size_t z3_bytes(const ddp_bucket *b) {
    return (size_t)(b->padded ? b->padded : 1) * wire_bytes(b->wire);
}

/* Starts gathering unit k: this rank's shards packed into its range, every
 * rank's ranges allgathered into a new buffer. Lock held. 0 or -1. */
static int z3_start(gj_ddp *d, int k) {
    ddp_bucket *b = &d->b[k];
    size_t wb = wire_bytes(b->wire);
    int64_t s = b->padded / d->size;
    b->full = gj_rt_alloc_data(z3_bytes(b));
    b->send = gj_rt_calloc((size_t)(s ? s : 1), wb);
    if (!b->full || !b->send) goto fail;
    for (int j = 0; j < b->n; j++) {
        int i = d->order[b->first + j];
        if (!d->shard[i]) continue;
        memcpy(range_at(d, b, i, b->send), gj_rt_data_ptr(d->shard[i]),
               (size_t)gj_tensor_numel(d->shard[i]) * wb);
    }
    b->gjob = (gj_dist_job){.kind = GJ_DIST_ALLGATHER, .wire = b->wire, .send = b->send,
                            .buf = b->full, .count = s};
    if (gj_dist_submit(d->pg, &b->gjob) != 0) goto fail;
    b->gathering = true;
    b->use = ++d->tick;
    d->st.gathers++;
    d->st.bytes += s * (int64_t)wb;
    return 0;
fail:
    if (b->full) gj_rt_free_data(b->full, z3_bytes(b));
    gj_rt_free(b->send);
    b->full = b->send = NULL;
    return -1;
}

/* Waits for unit k's gather, if in flight, and points its parameters at
 * it. Lock held. 0 or -1 (the unit released). */
static int z3_finish(gj_ddp *d, int k) {
    ddp_bucket *b = &d->b[k];
    if (!b->gathering) return 0;
    b->gathering = false;
    int rc = gj_dist_wait(&b->gjob);
    d->st.comm_ms += b->gjob.ms;
    gj_rt_free(b->send);
    b->send = NULL;
    if (rc != 0) {
        gj_rt_free_data(b->full, z3_bytes(b));
        b->full = NULL;
        return -1;
    }
    z3_point(d, b, true);
    return 0;
}

static int z3_present(const gj_ddp *d) {
    int n = 0;
    for (int k = 0; k < d->nb; k++) n += d->b[k].full != NULL;
    return n;
}

/* Unit k's parameters back to their shards only (a gather in flight is
 * waited for first). Lock held. */
static void z3_release(gj_ddp *d, int k) {
    ddp_bucket *b = &d->b[k];
    if (b->gathering) (void)z3_finish(d, k);
    if (!b->full) return;
    z3_point(d, b, false);
    gj_rt_free_data(b->full, z3_bytes(b));
    b->full = NULL;
}

/* Releases the units read least recently while more than `keep` are
 * present; never one read in `epoch` (the primitive reading now), nothing
 * while held. Lock held. */
static void z3_evict(gj_ddp *d, uint64_t epoch, int keep) {
    while (!d->held) {
        int live = 0, lru = -1;
        for (int k = 0; k < d->nb; k++) {
            const ddp_bucket *b = &d->b[k];
            if (!b->full) continue;
            live++;
            if (b->epoch != epoch && (lru < 0 || b->use < d->b[lru].use)) lru = k;
        }
        if (live <= keep || lru < 0) return;
        z3_release(d, lru);
    }
}

/* gj_rt_storage.fetch of parameter id's storage: its unit present (and
 * the next one on its way). */
static int z3_fetch(void *owner, int id, uint64_t epoch) {
    gj_ddp *d = owner;
    pthread_mutex_lock(&d->lock);
    int k = d->bucket_of[id], rc = 0;
    ddp_bucket *b = &d->b[k];
    bool missing = !b->full, arriving = b->gathering;
    b->epoch = epoch; /* (not released while this primitive reads it) */
    if (missing || arriving) {
        double t0 = gj_dist_now_ms(); /* (the reader blocks from here: counted as waited) */
        if (missing) z3_evict(d, epoch, Z3_LIVE - 1); /* room for it first */
        if (missing) rc = z3_start(d, k);
        /* the next units in the direction of the last two reads, queued
         * behind this one before waiting for it */
        int dir = d->last_miss >= 0 && k > d->last_miss ? 1 : -1;
        d->last_miss = k;
        for (int a = 1; rc == 0 && !d->held && a <= Z3_AHEAD; a++) {
            int nk = k + a * dir;
            if (nk < 0 || nk >= d->nb) break;
            if (d->b[nk].full) continue;
            z3_evict(d, epoch, Z3_LIVE - 1);
            rc = z3_start(d, nk);
            if (rc == 0) d->st.prefetches++;
        }
        if (rc == 0) rc = z3_finish(d, k);
        d->st.wait_ms += gj_dist_now_ms() - t0;
        int live = z3_present(d);
        if (live > d->st.max_units) d->st.max_units = live;
    }
    b->use = ++d->tick;
    b->epoch = epoch;
    pthread_mutex_unlock(&d->lock);
    if (rc != 0) {
        char err[400];
        snprintf(err, sizeof err, "%s", gj_last_error());
        gj_rt_set_error("gj_ddp (ZeRO stage 3): gathering parameter %d (bucket %d) failed: %s",
                        id, k, err);
    }
    return rc;
}

/* Every unit present until z3_release_all (held: nothing evicted). Lock
 * held. 0 or -1. */
static int z3_hold(gj_ddp *d) {
    d->held = true;
    int rc = 0;
    for (int k = 0; k < d->nb && rc == 0; k++)
        if (!d->b[k].full) rc = z3_start(d, k);
    for (int k = 0; k < d->nb; k++)
        if (z3_finish(d, k) != 0) rc = -1;
    int live = z3_present(d);
    if (live > d->st.max_units) d->st.max_units = live;
    return rc;
}

static void z3_release_all(gj_ddp *d) {
    for (int k = 0; k < d->nb; k++) z3_release(d, k);
    d->held = false;
    d->last_miss = -1;
}

/* Stage 3's start, after the broadcast: the shards become owned copies and
 * every parameter's storage a remote one of its own (a parameter that
 * viewed a larger tensor stops viewing it). 0 or -1. */
static int z3_setup(gj_ddp *d) {
    d->last_miss = -1;
    d->z3_ready = true; /* (from here on gj_ddp_free gives parameters memory back) */
    int ns = 0;
    for (int i = 0; i < d->n; i++) {
        gj_tensor *v = d->shard[i];
        if (!v) continue;
        gj_tensor *own = gj_zeros(gj_tensor_dtype(v), 1, gj_tensor_shape(v));
        if (!own) return -1;
        memcpy(gj_rt_data_ptr(own), gj_rt_data_ptr(v),
               (size_t)gj_tensor_numel(v) * gj_rt_dtype_size(gj_tensor_dtype(v)));
        if (gj_set_requires_grad(own, true) != 0) {
            gj_release(own);
            return -1;
        }
        gj_release(v);
        d->shard[i] = d->shards[ns++] = own;
    }
    for (int i = 0; i < d->n; i++) {
        gj_tensor *p = d->params[i];
        gj_rt_storage *s = gj_rt_storage_new_remote(
            (size_t)p->numel * gj_rt_dtype_size(p->dtype), z3_fetch, d, i);
        if (!s) return -1;
        atomic_store(&s->version, atomic_load(&p->storage->version));
        gj_rt_storage_release(p->storage);
        p->storage = s;
        p->offset = 0;
    }
    return 0;
}

/* A parameter whose memory could not be made at gj_ddp_free: every read
 * fails. */
static int z3_lost(void *owner, int id, uint64_t epoch) {
    (void)owner, (void)epoch;
    gj_rt_set_error("gj_ddp (ZeRO stage 3): parameter %d lost its values: gj_ddp_free could "
                    "not allocate its memory", id);
    return -1;
}

/* gj_ddp_free under stage 3: every parameter gathered into memory of its
 * own again (a collective). A parameter whose gather failed reads NaN. */
static void z3_teardown(gj_ddp *d) {
    pthread_mutex_lock(&d->lock);
    if (z3_hold(d) != 0)
        fprintf(stderr, "gradjit: gj_ddp_free: gathering the ZeRO stage 3 parameters failed "
                        "(%s): those not gathered are NaN\n", gj_last_error());
    for (int i = 0; i < d->n; i++) {
        gj_tensor *p = d->params[i];
        gj_rt_storage *s = p->storage;
        if (s->fetch != z3_fetch || s->owner != d) continue;
        void *own = gj_rt_alloc_data(s->nbytes ? s->nbytes : 1);
        s->fetch = own ? NULL : z3_lost;
        if (!own) continue;
        if (s->data) {
            memcpy(own, s->data, s->nbytes);
        } else {
            for (int64_t e = 0; e < p->numel; e++) {
                if (p->dtype == GJ_F64) ((double *)own)[e] = NAN;
                else if (p->dtype == GJ_F32) ((float *)own)[e] = NAN;
                else ((uint16_t *)own)[e] = 0x7fc0; /* bf16 NaN */
            }
        }
        s->data = own;
        s->external = false;
        s->owner = NULL;
    }
    for (int k = 0; k < d->nb; k++) { /* (the parameters point at their own memory now) */
        ddp_bucket *b = &d->b[k];
        if (b->full) gj_rt_free_data(b->full, z3_bytes(b));
        b->full = NULL;
    }
    d->held = false;
    pthread_mutex_unlock(&d->lock);
}

int gj_ddp_unshard(gj_ddp *d) {
    if (!d || d->opt.zero != 3) {
        gj_rt_set_error("gj_ddp_unshard: %s", !d ? "ddp is NULL"
                                                 : "the gj_ddp was made without ZeRO stage 3 "
                                                   "(gj_ddp_options.zero = 3)");
        return -1;
    }
    pthread_mutex_lock(&d->lock);
    int rc = z3_hold(d);
    if (rc != 0) z3_release_all(d);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

int gj_ddp_reshard(gj_ddp *d) {
    if (!d || d->opt.zero != 3 || !d->held) {
        gj_rt_set_error("gj_ddp_reshard: %s",
                        !d ? "ddp is NULL"
                        : d->opt.zero != 3 ? "the gj_ddp was made without ZeRO stage 3 "
                                             "(gj_ddp_options.zero = 3)"
                                           : "the parameters are not unsharded (gj_ddp_unshard)");
        return -1;
    }
    pthread_mutex_lock(&d->lock);
    for (int i = 0; i < d->n; i++) { /* this rank's part of each parameter into its shard */
        gj_tensor *sh = d->shard[i];
        if (!sh) continue;
        size_t es = gj_rt_dtype_size(d->params[i]->dtype);
        memcpy(gj_rt_data_ptr(sh), (const char *)gj_rt_data_ptr(d->params[i]) + d->shard_at[i] * (int64_t)es,
               (size_t)sh->numel * es);
        gj_rt_bump_version(sh);
    }
    z3_release_all(d);
    pthread_mutex_unlock(&d->lock);
    return 0;
}

/* ------------------------------------------------ ZeRO's checkpoints */

/* The optimizer state fields a checkpoint may hold per parameter (those of
 * SGD, AdamW and Lion, autograd/optim_*.c). */
static const char *const ZERO_FIELDS[] = {"exp_avg", "exp_avg_sq", "momentum_buffer"};
enum { ZERO_NF = 3 };

/* The index in d->shards of parameter i's shard, or -1. */
static int shard_index(const gj_ddp *d, int i) {
    for (int k = 0; k < d->n_shards; k++)
        if (d->shards[k] == d->shard[i]) return k;
    return -1;
}

static int zero_ckpt_check(gj_ddp *d, gj_optim *opt, const gj_state_dict *sd, const char *op) {
    if (!d || !opt || !sd) {
        gj_rt_set_error("%s: %s is NULL", op, !d ? "ddp" : !opt ? "opt" : "sd");
        return -1;
    }
    if (!d->opt.zero) {
        gj_rt_set_error("%s: the gj_ddp was made without ZeRO (gj_ddp_options.zero)", op);
        return -1;
    }
    for (int i = 0; i < d->n; i++)
        if (gj_tensor_dtype(d->params[i]) == GJ_BF16) {
            gj_rt_set_error("%s: parameter %d is bf16 (its optimizer state is f32, its bucket "
                            "bf16): ZeRO checkpoints take f32 and f64 parameters", op, i);
            return -1;
        }
    return 0;
}

/* The optimizer's own metadata (kind, hyperparameters) of mine ("s.")
 * into sd under prefix, all but the parameter count. 0 or -1. */
static int copy_optim_meta(const gj_state_dict *mine, gj_state_dict *sd, const char *prefix) {
    char key[512];
    for (int j = 0; j < gj_state_dict_metadata_size(mine); j++) {
        const char *k = NULL, *v = NULL;
        if (gj_state_dict_metadata_at(mine, j, &k, &v) != 0) return -1;
        if (strncmp(k, "s.", 2) != 0 || !strcmp(k, "s.n_params")) continue;
        snprintf(key, sizeof key, "%s.%s", prefix, k + 2);
        if (gj_state_dict_set_metadata(sd, key, v) != 0) return -1;
    }
    return 0;
}

int gj_ddp_optim_state_dict_add(gj_ddp *d, gj_optim *opt, gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_ddp_optim_state_dict_add";
    if (zero_ckpt_check(d, opt, sd, op) != 0) return -1;
    if (!prefix) prefix = "optim";
    int rc = -1, size = d->size;
    char key[512];
    gj_state_dict *mine = gj_state_dict_new(); /* this rank's optimizer, under "s" */
    int64_t *steps = gj_rt_calloc((size_t)d->n + 1, sizeof *steps);
    int64_t *all = gj_rt_calloc((size_t)d->n * (size_t)size + (size_t)size + 1, sizeof *all);
    if (!mine || !steps || !all || gj_optim_state_dict_add(opt, mine, "s") != 0) goto done;
    /* the metadata (kind, hyperparameters) as this rank's optimizer has them */
    if (copy_optim_meta(mine, sd, prefix) != 0) goto done;
    char nv[32];
    snprintf(nv, sizeof nv, "%d", d->n);
    snprintf(key, sizeof key, "%s.n_params", prefix);
    if (gj_state_dict_set_metadata(sd, key, nv) != 0) goto done;
    /* which fields any rank has, and each parameter's step count */
    int64_t mask = 0;
    for (int i = 0; i < d->n; i++) {
        int k = shard_index(d, i);
        for (int f = 0; k >= 0 && f < ZERO_NF; f++) {
            snprintf(key, sizeof key, "s.%d.%s", k, ZERO_FIELDS[f]);
            if (gj_state_dict_get(mine, key)) mask |= (int64_t)1 << f;
        }
        snprintf(key, sizeof key, "s.%d.step", k);
        gj_tensor *st = k >= 0 ? gj_state_dict_get(mine, key) : NULL;
        steps[i] = st ? (int64_t)gj_tensor_item(st) : -1;
    }
    if (gj_dist_allgather_i64(d->pg, &mask, 1, all, op) != 0) goto done;
    for (int r = 1; r < size; r++) all[0] |= all[r];
    mask = all[0];
    if (gj_dist_allgather_i64(d->pg, steps, d->n, all, op) != 0) goto done;
    for (int i = 0; i < d->n; i++) {
        int64_t best = -1;
        for (int r = 0; r < size; r++) best = all[(size_t)r * (size_t)d->n + (size_t)i] > best
                                                  ? all[(size_t)r * (size_t)d->n + (size_t)i]
                                                  : best;
        if (best < 0) continue; /* no state yet anywhere */
        gj_tensor *st = gj_full(GJ_I64, 0, NULL, (double)best);
        snprintf(key, sizeof key, "%s.%d.step", prefix, i);
        int r2 = st ? gj_state_dict_add(sd, key, st) : -1;
        gj_release(st);
        if (r2 != 0) goto done;
    }
    /* each field: every rank's range of every bucket gathered */
    for (int f = 0; f < ZERO_NF; f++) {
        if (!(mask >> f & 1)) continue;
        for (int kb = 0; kb < d->nb; kb++) {
            ddp_bucket *b = &d->b[kb];
            size_t wb = wire_bytes(b->wire);
            int64_t sl = b->padded / size;
            memset(b->shard_buf, 0, (size_t)(sl ? sl : 1) * wb);
            for (int j = 0; j < b->n; j++) {
                int i = d->order[b->first + j], k = shard_index(d, i);
                snprintf(key, sizeof key, "s.%d.%s", k, ZERO_FIELDS[f]);
                gj_tensor *t = k >= 0 ? gj_state_dict_get(mine, key) : NULL;
                if (!t) continue;
                pack_raw(gj_tensor_dtype(t), gj_tensor_data(t), gj_tensor_numel(t), b->wire,
                         in_range(d, b, i));
            }
            if (!bucket_buf(b)) goto done;
            b->job = (gj_dist_job){.kind = GJ_DIST_ALLGATHER, .wire = b->wire,
                                   .send = b->shard_buf, .buf = b->buf, .count = sl};
            if (gj_dist_submit(d->pg, &b->job) != 0 || gj_dist_wait(&b->job) != 0) goto done;
            for (int j = 0; j < b->n; j++) {
                int i = d->order[b->first + j];
                gj_tensor *full = gj_zeros(gj_tensor_dtype(d->params[i]),
                                           gj_tensor_ndim(d->params[i]),
                                           gj_tensor_shape(d->params[i]));
                if (!full) goto done;
                memcpy(gj_tensor_data(full), (const char *)b->buf + d->offset[i] * (int64_t)wb,
                       (size_t)gj_tensor_numel(full) * wb);
                snprintf(key, sizeof key, "%s.%d.%s", prefix, i, ZERO_FIELDS[f]);
                int r2 = gj_state_dict_add(sd, key, full);
                gj_release(full);
                if (r2 != 0) goto done;
            }
            bucket_buf_drop(d, b);
        }
    }
    rc = 0;
done:
    gj_state_dict_free(mine);
    gj_rt_free(steps);
    gj_rt_free(all);
    return rc;
}

int gj_ddp_optim_load_state_dict(gj_ddp *d, gj_optim *opt, const gj_state_dict *sd,
                                 const char *prefix) {
    const char *op = "gj_ddp_optim_load_state_dict";
    if (zero_ckpt_check(d, opt, sd, op) != 0) return -1;
    if (!prefix) prefix = "optim";
    char key[512], nv[32];
    size_t pl = strlen(prefix);
    snprintf(key, sizeof key, "%s.n_params", prefix);
    const char *n = gj_state_dict_get_metadata(sd, key);
    snprintf(nv, sizeof nv, "%d", d->n);
    if (!n || strcmp(n, nv) != 0) {
        gj_rt_set_error("%s: the state is of %s parameters, the gj_ddp has %d", op,
                        n ? n : "(no count)", d->n);
        return -1;
    }
    gj_state_dict *mine = gj_state_dict_new();
    int rc = mine ? 0 : -1;
    for (int j = 0; rc == 0 && j < gj_state_dict_metadata_size(sd); j++) {
        const char *k = NULL, *v = NULL;
        if (gj_state_dict_metadata_at(sd, j, &k, &v) != 0) rc = -1;
        else if (strncmp(k, prefix, pl) == 0 && k[pl] == '.' && strcmp(k + pl, ".n_params") != 0) {
            snprintf(key, sizeof key, "s%s", k + pl);
            rc = gj_state_dict_set_metadata(mine, key, v);
        }
    }
    snprintf(nv, sizeof nv, "%d", d->n_shards);
    if (rc == 0) rc = gj_state_dict_set_metadata(mine, "s.n_params", nv);
    for (int i = 0; rc == 0 && i < d->n; i++) { /* each shard's part of the full state */
        int k = shard_index(d, i);
        if (k < 0) continue;
        int64_t len = gj_tensor_numel(d->shard[i]), n_full = gj_tensor_numel(d->params[i]);
        for (int f = 0; rc == 0 && f <= ZERO_NF; f++) {
            const char *field = f < ZERO_NF ? ZERO_FIELDS[f] : "step";
            snprintf(key, sizeof key, "%s.%d.%s", prefix, i, field);
            gj_tensor *full = gj_state_dict_get(sd, key);
            if (!full) continue;
            gj_tensor *part = NULL;
            if (f == ZERO_NF) {
                part = gj_full(GJ_I64, 0, NULL, gj_tensor_item(full));
            } else if (gj_tensor_numel(full) != n_full ||
                       gj_tensor_dtype(full) != gj_tensor_dtype(d->params[i])) {
                gj_rt_set_error("%s: %s has %lld %s values, parameter %d %lld %s", op, key,
                                (long long)gj_tensor_numel(full),
                                gj_rt_dtype_name(gj_tensor_dtype(full)), i, (long long)n_full,
                                gj_rt_dtype_name(gj_tensor_dtype(d->params[i])));
                rc = -1;
                break;
            } else if ((part = gj_zeros(gj_tensor_dtype(full), 1, &len))) {
                gj_tensor *c = gj_contiguous(full);
                size_t eb = gj_tensor_dtype(full) == GJ_F64 ? 8 : 4;
                if (c)
                    memcpy(gj_tensor_data(part),
                           (const char *)gj_tensor_data(c) + d->shard_at[i] * (int64_t)eb,
                           (size_t)len * eb);
                else
                    rc = -1;
                gj_release(c);
            }
            snprintf(key, sizeof key, "s.%d.%s", k, field);
            if (!part || gj_state_dict_add(mine, key, part) != 0) rc = -1;
            gj_release(part);
        }
    }
    if (rc == 0) rc = gj_optim_load_state_dict(opt, mine, "s");
    gj_state_dict_free(mine);
    return rc;
}

/* ------------------------------------- ZeRO's checkpoints, one per rank */

int gj_ddp_optim_shard_dict_add(gj_ddp *d, gj_optim *opt, gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_ddp_optim_shard_dict_add";
    if (zero_ckpt_check(d, opt, sd, op) != 0) return -1;
    if (!prefix) prefix = "optim";
    char key[512], val[64 + 24 * GJ_MAX_DIMS];
    gj_state_dict *mine = gj_state_dict_new(); /* this rank's optimizer, under "s" */
    int rc = mine && gj_optim_state_dict_add(opt, mine, "s") == 0 ? 0 : -1;
    if (rc == 0) rc = copy_optim_meta(mine, sd, prefix);
    const int64_t meta[3][2] = {{0, d->n}, {1, d->rank}, {2, d->size}};
    const char *const meta_key[3] = {"n_params", "zero.rank", "zero.ranks"};
    for (int m = 0; rc == 0 && m < 3; m++) {
        snprintf(key, sizeof key, "%s.%s", prefix, meta_key[meta[m][0]]);
        snprintf(val, sizeof val, "%lld", (long long)meta[m][1]);
        rc = gj_state_dict_set_metadata(sd, key, val);
    }
    for (int i = 0; rc == 0 && i < d->n; i++) {
        int k = shard_index(d, i);
        if (k < 0) continue;
        gj_tensor *p = d->params[i];
        int at = snprintf(val, sizeof val, "%lld %lld %lld %d", (long long)d->shard_at[i],
                          (long long)gj_tensor_numel(d->shard[i]), (long long)gj_tensor_numel(p),
                          gj_tensor_ndim(p));
        for (int a = 0; a < gj_tensor_ndim(p); a++)
            at += snprintf(val + at, sizeof val - (size_t)at, " %lld",
                           (long long)gj_tensor_shape(p)[a]);
        snprintf(key, sizeof key, "%s.%d.range", prefix, i);
        rc = gj_state_dict_set_metadata(sd, key, val);
        for (int f = 0; rc == 0 && f <= ZERO_NF; f++) {
            const char *field = f < ZERO_NF ? ZERO_FIELDS[f] : "step";
            snprintf(key, sizeof key, "s.%d.%s", k, field);
            gj_tensor *t = gj_state_dict_get(mine, key);
            if (!t) continue;
            snprintf(key, sizeof key, "%s.%d.%s", prefix, i, field);
            rc = gj_state_dict_add(sd, key, t);
        }
    }
    gj_state_dict_free(mine);
    return rc;
}

/* One rank's range of parameter i in a shard dict: 0, 1 when it has none,
 * -1 with an error when it is malformed. */
static int shard_range(const gj_state_dict *s, const char *prefix, int i, int64_t r[4],
                       int64_t shape[GJ_MAX_DIMS], const char *op) {
    char key[512];
    snprintf(key, sizeof key, "%s.%d.range", prefix, i);
    const char *v = gj_state_dict_get_metadata(s, key);
    if (!v) return 1;
    char *end = NULL;
    for (int k = 0; k < 4; k++) {
        errno = 0;
        r[k] = strtoll(v, &end, 10);
        if (end == v || errno) goto bad;
        v = end;
    }
    if (r[0] < 0 || r[1] < 0 || r[2] < 0 || r[0] + r[1] > r[2] || r[3] < 0 || r[3] > GJ_MAX_DIMS)
        goto bad;
    int64_t n = 1;
    for (int k = 0; k < r[3]; k++) {
        errno = 0;
        shape[k] = strtoll(v, &end, 10);
        if (end == v || errno || shape[k] < 0) goto bad;
        v = end;
        n *= shape[k];
    }
    if (n != r[2] || *v) goto bad;
    return 0;
bad:
    gj_rt_set_error("%s: metadata %s is not \"start length numel ndim shape...\" of one "
                    "parameter", op, key);
    return -1;
}

int gj_zero_consolidate(int n, const gj_state_dict *const *shards, const char *prefix,
                        gj_state_dict *out) {
    const char *op = "gj_zero_consolidate";
    if (n < 1 || !shards || !out) {
        gj_rt_set_error("%s: needs n >= 1 shard dicts and an out dict (n %d, shards %s, out %s)",
                        op, n, shards ? "given" : "NULL", out ? "given" : "NULL");
        return -1;
    }
    if (!prefix) prefix = "optim";
    char key[512];
    int64_t np = -1;
    bool *seen = gj_rt_calloc((size_t)n, sizeof *seen);
    if (!seen) return -1;
    int rc = 0;
    for (int j = 0; j < n && rc == 0; j++) { /* every rank of one run, each once */
        const char *fk[3] = {"n_params", "zero.rank", "zero.ranks"};
        int64_t v[3];
        for (int m = 0; m < 3 && rc == 0; m++) {
            snprintf(key, sizeof key, "%s.%s", prefix, fk[m]);
            const char *s = shards[j] ? gj_state_dict_get_metadata(shards[j], key) : NULL;
            char *end = NULL;
            v[m] = s ? strtoll(s, &end, 10) : -1;
            if (!s || !*s || *end || v[m] < 0) {
                gj_rt_set_error("%s: shard dict %d has no %s (not written by "
                                "gj_ddp_optim_shard_dict_add)", op, j, key);
                rc = -1;
            }
        }
        if (rc != 0) break;
        if (v[2] != n || v[1] >= n || seen[v[1]] || (np >= 0 && v[0] != np)) {
            gj_rt_set_error("%s: shard dict %d is rank %lld of %lld ranks over %lld parameters; "
                            "the %d dicts given must be the %d ranks of one run, each once",
                            op, j, (long long)v[1], (long long)v[2], (long long)v[0], n, n);
            rc = -1;
            break;
        }
        seen[v[1]] = true;
        np = v[0];
    }
    gj_rt_free(seen);
    /* the optimizer's own metadata, as rank 0's dict has it */
    size_t pl = strlen(prefix);
    for (int j = 0; rc == 0 && j < gj_state_dict_metadata_size(shards[0]); j++) {
        const char *k = NULL, *v = NULL;
        if (gj_state_dict_metadata_at(shards[0], j, &k, &v) != 0) rc = -1;
        else if (strncmp(k, prefix, pl) == 0 && k[pl] == '.' && strncmp(k + pl + 1, "zero.", 5) &&
                 !strstr(k + pl + 1, ".range"))
            rc = gj_state_dict_set_metadata(out, k, v);
    }
    for (int64_t i = 0; rc == 0 && i < np; i++) {
        int64_t r[4], first[4] = {-1, -1, -1, -1}, shape[GJ_MAX_DIMS], covered = 0, step = -1;
        for (int j = 0; j < n && rc == 0; j++) {
            int g = shard_range(shards[j], prefix, (int)i, r, shape, op);
            if (g < 0) rc = -1;
            if (g != 0) continue;
            if (first[2] >= 0 && (r[2] != first[2] || r[3] != first[3])) {
                gj_rt_set_error("%s: the dicts disagree on parameter %lld's size", op, (long long)i);
                rc = -1;
            }
            if (first[2] < 0) memcpy(first, r, sizeof r);
            covered += r[1];
            snprintf(key, sizeof key, "%s.%lld.step", prefix, (long long)i);
            gj_tensor *st = gj_state_dict_get(shards[j], key);
            if (st && (int64_t)gj_tensor_item(st) > step) step = (int64_t)gj_tensor_item(st);
        }
        if (rc != 0 || first[2] < 0) continue; /* (no range: an empty parameter) */
        if (covered != first[2]) {
            gj_rt_set_error("%s: the ranks' ranges of parameter %lld cover %lld of its %lld "
                            "elements", op, (long long)i, (long long)covered, (long long)first[2]);
            rc = -1;
            break;
        }
        if (step >= 0) {
            gj_tensor *st = gj_full(GJ_I64, 0, NULL, (double)step);
            snprintf(key, sizeof key, "%s.%lld.step", prefix, (long long)i);
            rc = st ? gj_state_dict_add(out, key, st) : -1;
            gj_release(st);
        }
        for (int f = 0; rc == 0 && f < ZERO_NF; f++) {
            snprintf(key, sizeof key, "%s.%lld.%s", prefix, (long long)i, ZERO_FIELDS[f]);
            gj_tensor *full = NULL;
            int64_t got = 0;
            for (int j = 0; j < n && rc == 0; j++) {
                gj_tensor *part = gj_state_dict_get(shards[j], key);
                if (shard_range(shards[j], prefix, (int)i, r, shape, op) != 0) continue;
                if (!part) continue;
                gj_dtype dt = gj_tensor_dtype(part);
                if (!full && !(full = gj_zeros(dt, (int)first[3], shape))) {
                    rc = -1;
                    break;
                }
                if (gj_tensor_numel(part) != r[1] || dt != gj_tensor_dtype(full) ||
                    (dt != GJ_F32 && dt != GJ_F64)) {
                    gj_rt_set_error("%s: %s of shard dict %d has %lld %s values, its range %lld",
                                    op, key, j, (long long)gj_tensor_numel(part),
                                    gj_rt_dtype_name(dt), (long long)r[1]);
                    rc = -1;
                    break;
                }
                gj_tensor *c = gj_contiguous(part);
                size_t eb = dt == GJ_F64 ? 8 : 4;
                if (!c) rc = -1;
                else
                    memcpy((char *)gj_tensor_data(full) + r[0] * (int64_t)eb, gj_tensor_data(c),
                           (size_t)r[1] * eb);
                gj_release(c);
                got += r[1];
            }
            if (rc == 0 && full && got != first[2]) {
                gj_rt_set_error("%s: %s is in some ranks' dicts and not in others", op, key);
                rc = -1;
            }
            if (rc == 0 && full) rc = gj_state_dict_add(out, key, full);
            gj_release(full);
        }
    }
    return rc;
}

static void ddp_destroy(gj_ddp *d) {
    if (!d) return;
    if (d->z3_ready) z3_teardown(d);
    gj_jit_reducer_unregister(d);
    pthread_mutex_lock(&g_agree_lock);
    if (g_agreeing == d) {
        gj_jit_set_agreement(NULL, NULL);
        g_agreeing = NULL;
    }
    pthread_mutex_unlock(&g_agree_lock);
    for (int k = 0; k < d->nb; k++) {
        if (d->b[k].started) gj_dist_wait(&d->b[k].job);
        gj_rt_free(d->b[k].buf);
        gj_rt_free(d->b[k].shard_buf);
        gj_rt_free(d->b[k].send);
    }
    for (int i = 0; i < d->n && d->shard; i++)
        if (d->shard[i]) gj_release(d->shard[i]);
    gj_rt_free(d->shard);
    gj_rt_free(d->shard_at);
    gj_rt_free(d->shards);
    for (int i = 0; i < d->n; i++) {
        if (d->hooks && d->hooks[i] > 0) gj_remove_hook(d->hooks[i]);
        if (d->params && d->params[i]) gj_release(d->params[i]);
    }
    pthread_mutex_destroy(&d->lock);
    gj_rt_free(d->b);
    gj_rt_free(d->params);
    gj_rt_free(d->order);
    gj_rt_free(d->bucket_of);
    gj_rt_free(d->offset);
    gj_rt_free(d->ready);
    gj_rt_free(d->hooks);
    gj_rt_free(d->ctx);
    gj_rt_free(d->pend);
    gj_rt_free(d);
}

gj_ddp *gj_ddp_new(gj_pg *pg, int n_params, gj_tensor *const *params,
                   const gj_ddp_options *opt) {
    if (!pg) {
        gj_rt_set_error("gj_ddp_new: process group is NULL");
        return NULL;
    }
    if (n_params < 1 || !params) {
        gj_rt_set_error("gj_ddp_new: needs at least one parameter (got %d)", n_params);
        return NULL;
    }
    for (int i = 0; i < n_params; i++) {
        gj_tensor *p = params[i];
        char nm[160];
        if (!p || !gj_is_leaf(p) || !gj_requires_grad(p)) {
            gj_rt_set_error("gj_ddp_new: parameter %d%s is %s", i,
                            p ? gj_rt_tensor_label(p, nm, sizeof nm) : "",
                            !p ? "NULL" : "not a leaf that requires grad");
            return NULL;
        }
        gj_dtype dt = gj_tensor_dtype(p);
        if (dt != GJ_F32 && dt != GJ_F64 && dt != GJ_BF16) {
            gj_rt_set_error("gj_ddp_new: parameter %d has dtype %d, not f32, f64 or bf16", i,
                            (int)dt);
            return NULL;
        }
        if (!gj_tensor_is_contiguous(p)) {
            gj_rt_set_error("gj_ddp_new: parameter %d is not contiguous", i);
            return NULL;
        }
        if (opt && (opt->zero < 0 || opt->zero > 3)) {
            gj_rt_set_error("gj_ddp_new: zero is %d; ZeRO's stages are 1, 2 and 3 (0: off)",
                            opt->zero);
            return NULL;
        }
        if (opt && opt->zero && wire_of(dt, opt->bf16_buckets) != dt) {
            gj_rt_set_error("gj_ddp_new: ZeRO needs parameters that travel as they are, and "
                            "parameter %d is %s with %s buckets (give bf16 parameters "
                            "bf16_buckets, or f32 parameters f32 buckets)", i,
                            dt == GJ_BF16 ? "bf16" : "f32", opt->bf16_buckets ? "bf16" : "f32");
            return NULL;
        }
        for (int j = 0; j < i; j++)
            if (params[j] == p) {
                gj_rt_set_error("gj_ddp_new: parameter %d is parameter %d again", i, j);
                return NULL;
            }
    }
    gj_ddp *d = gj_rt_calloc(1, sizeof *d);
    if (!d) return NULL;
    pthread_mutex_init(&d->lock, NULL);
    d->pg = pg;
    d->n = n_params;
    d->sync = true;
    if (opt) d->opt = *opt;
    if (d->opt.bucket_bytes <= 0) d->opt.bucket_bytes = 25 << 20;
    size_t n = (size_t)n_params;
    d->params = gj_rt_calloc(n, sizeof *d->params);
    d->order = gj_rt_calloc(n, sizeof *d->order);
    d->bucket_of = gj_rt_calloc(n, sizeof *d->bucket_of);
    d->offset = gj_rt_calloc(n, sizeof *d->offset);
    d->ready = gj_rt_calloc(n, sizeof *d->ready);
    d->hooks = gj_rt_calloc(n, sizeof *d->hooks);
    d->ctx = gj_rt_calloc(n, sizeof *d->ctx);
    d->b = gj_rt_calloc(n, sizeof *d->b); /* at most one bucket per parameter */
    d->pend = gj_rt_calloc(n, sizeof *d->pend);
    if (!d->params || !d->order || !d->bucket_of || !d->offset || !d->ready || !d->hooks ||
        !d->ctx || !d->b || !d->pend)
        goto fail;
    for (int i = 0; i < n_params; i++) d->params[i] = gj_retain(params[i]);
    /* buckets: reverse parameter order, one wire dtype each, about bucket_bytes */
    int64_t bytes = 0;
    for (int k = 0; k < n_params; k++) {
        int i = n_params - 1 - k;
        d->order[k] = i;
        gj_dtype w = wire_of(gj_tensor_dtype(params[i]), d->opt.bf16_buckets);
        int64_t pb = gj_tensor_numel(params[i]) * (int64_t)wire_bytes(w);
        ddp_bucket *cur = d->nb ? &d->b[d->nb - 1] : NULL;
        /* the first bucket is small (at most 1 MiB, as PyTorch's reducer
         * does) so that the first allreduce starts early in the backward */
        int64_t cap = d->nb <= 1 && d->opt.bucket_bytes > (1 << 20) ? (1 << 20)
                                                                      : d->opt.bucket_bytes;
        if (!cur || cur->wire != w || bytes + pb > cap) {
            cur = &d->b[d->nb++]; /* a parameter larger than a bucket gets one of its own */
            cur->first = k;
            cur->wire = w;
            bytes = 0;
        }
        d->bucket_of[i] = d->nb - 1;
        d->offset[i] = cur->count;
        cur->count += gj_tensor_numel(params[i]);
        cur->n++;
        bytes += pb;
    }
    d->rank = gj_pg_rank(pg);
    d->size = gj_pg_size(pg);
    for (int k = 0; k < d->nb; k++) {
        ddp_bucket *b = &d->b[k];
        int64_t s = (b->count + d->size - 1) / d->size; /* a range per rank */
        b->padded = d->opt.zero ? s * d->size : b->count;
        b->lo = b->count < s * d->rank ? b->count : s * d->rank;
        b->hi = b->count < s * (d->rank + 1) ? b->count : s * (d->rank + 1);
        if (d->opt.zero < 3 && !bucket_buf(b)) goto fail; /* (stage 3: made when used) */
        if (d->opt.zero && !(b->shard_buf = gj_rt_calloc((size_t)(s ? s : 1), wire_bytes(b->wire))))
            goto fail;
    }
    if (d->opt.zero && zero_shards(d) != 0) goto fail;
    d->st.n_buckets = d->nb;
    { /* the same parameters (count, sizes, dtypes) and buckets on every rank */
        uint64_t h = 1469598103934665603ull;
        int64_t v[4] = {n_params, d->opt.bucket_bytes, d->opt.bf16_buckets, d->opt.zero};
        for (int k = 0; k < 4; k++) h = (h ^ (uint64_t)v[k]) * 1099511628211ull;
        for (int i = 0; i < n_params; i++) {
            h = (h ^ (uint64_t)gj_tensor_numel(params[i])) * 1099511628211ull;
            h = (h ^ (uint64_t)gj_tensor_dtype(params[i])) * 1099511628211ull;
        }
        d->layout = h;
        int64_t mine[2] = {(int64_t)h, n_params};
        if (same_on_all_ranks(pg, mine, 2, "gj_ddp_new",
                              "a hash of each rank's parameter sizes, dtypes and bucket options, "
                              "then its parameter count") != 0)
            goto fail;
    }
    if (!d->opt.no_broadcast)
        for (int i = 0; i < n_params; i++)
            if (gj_broadcast(pg, params[i], 0) != 0) goto fail;
    if (d->opt.zero == 3 && z3_setup(d) != 0) goto fail;
    for (int i = 0; i < n_params; i++) {
        d->ctx[i] = (hook_ctx){d, i};
        d->hooks[i] = gj_register_post_accumulate_grad_hook_ex(params[i], on_grad, &d->ctx[i],
                                                               GJ_HOOK_NO_GRAPH_WRITES);
        if (d->hooks[i] <= 0) goto fail;
    }
    d->red = (gj_jit_reducer){.ctx = d, .n = n_params, .params = d->params, .order = d->order,
                              .hooks = d->hooks, .layout = d->layout, .give = red_give,
                              .take = red_take, .wait = red_wait, .end = red_end,
                              .agree = red_agree, .zero = d->opt.zero, .shards = d->shard,
                              .after = d->opt.zero ? red_after : NULL};
    if (gj_jit_reducer_register(d, &d->red) != 0) goto fail;
    if (!d->opt.zero) { /* (ZeRO: each rank's programs update its own shards: keys differ) */
        pthread_mutex_lock(&g_agree_lock);
        g_agreeing = d;
        gj_jit_set_agreement(agree_key, d);
        pthread_mutex_unlock(&g_agree_lock);
    }
    return d;
fail:
    ddp_destroy(d);
    return NULL;
}

void gj_ddp_set_sync(gj_ddp *d, bool sync) {
    if (!d) return;
    pthread_mutex_lock(&d->lock);
    d->sync = sync;
    pthread_mutex_unlock(&d->lock);
}

int gj_ddp_wait(gj_ddp *d) {
    if (!d) {
        gj_rt_set_error("gj_ddp_wait: ddp is NULL");
        return -1;
    }
    double t0 = gj_dist_now_ms();
    int rc = 0;
    pthread_mutex_lock(&d->lock);
    if (d->err[0]) {
        gj_rt_set_error("gj_ddp_wait: a gradient hook failed during backward: %s", d->err);
        rc = -1;
    }
    /* parameters no hook marked this step: their .grad (accumulated under
     * no_sync) or zeros; then start the rest, in order */
    for (int i = 0; i < d->n; i++) {
        if (d->ready[i]) continue;
        ddp_bucket *b = &d->b[d->bucket_of[i]];
        if (!bucket_buf(b)) {
            rc = -1;
            break;
        }
        void *dst = (char *)b->buf + d->offset[i] * (int64_t)wire_bytes(b->wire);
        gj_tensor *g = gj_tensor_grad(d->params[i]);
        if (g) {
            if (pack(g, b->wire, dst) != 0) rc = -1;
        } else {
            memset(dst, 0, (size_t)gj_tensor_numel(d->params[i]) * wire_bytes(b->wire));
        }
        d->ready[i] = true;
        b->ready++;
    }
    if (start_ready(d, false) != 0) rc = -1;
    for (int k = 0; k < d->nb; k++) {
        ddp_bucket *b = &d->b[k];
        if (!b->started && !b->early) continue;
        if (b->started && gj_dist_wait(&b->job) != 0) rc = -1;
        if (b->started) d->st.comm_ms += b->job.ms;
        b->started = b->early = false;
        if (rc != 0) continue;
        if (d->opt.zero) {
            if (zero_unpack(d, b) != 0) rc = -1;
            bucket_buf_drop(d, b);
            continue;
        }
        for (int j = 0; j < b->n; j++) {
            int i = d->order[b->first + j];
            if (unpack(d->params[i], b->wire,
                       (char *)b->buf + d->offset[i] * (int64_t)wire_bytes(b->wire)) != 0)
                rc = -1;
        }
    }
    for (int k = 0; k < d->nb; k++) d->b[k].ready = 0;
    d->n_pend = 0; /* (zero_unpack cleared every parameter's .grad) */
    memset(d->ready, 0, (size_t)d->n * sizeof *d->ready);
    d->next_start = 0;
    d->any_ready = false;
    d->err[0] = 0;
    if (rc == 0) d->st.steps++;
    d->st.wait_ms += gj_dist_now_ms() - t0;
    pthread_mutex_unlock(&d->lock);
    return rc;
}

int gj_ddp_stats_get(const gj_ddp *d, gj_ddp_stats *out) {
    if (!d || !out) {
        gj_rt_set_error("gj_ddp_stats_get: %s is NULL", !d ? "ddp" : "out");
        return -1;
    }
    *out = d->st;
    out->units = z3_present(d);
    return 0;
}

int gj_ddp_bucket_of(const gj_ddp *d, int i) {
    if (!d || i < 0 || i >= d->n) return -1;
    return d->bucket_of[i];
}

void gj_ddp_free(gj_ddp *d) { ddp_destroy(d); }
