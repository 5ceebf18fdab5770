/*
 * diskcache.c - serialisation of programs (plan + roles + object code) to
 * the on-disk cache and back.
 *
 * File layout (native byte order: the host id pins the machine):
 *   "GJJITC03"                     magic and format version (bumped whenever
 *                                  plan or lowering semantics change: 02 adds
 *                                  MAX stores, index steps, f64 decompositions; 03: 512-bit kernels)
 *   u64 layout                     sizes of the serialised structs
 *   str library version, str host id, str key, str symbol prefix
 *   blob plan                      see put_plan
 *   blob object                    the kernels' object file
 *   u64[2] checksum                gj_jit_hash128 of everything before
 * (str and blob: u64 length, then the bytes.)
 *
 * Invariants: a load checks everything above and then every index inside
 * the plan (buffers, accesses, expressions, steps) before anything uses it;
 * on any failure the partial program is freed and NULL returned. Pointers
 * inside serialised structs are never trusted: they are rebuilt.
 */
#include "diskcache.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char g_magic[8] = {'G', 'J', 'J', 'I', 'T', 'C', '0', '3'};

/* ------------------------------------------------------------ the dir */

static char g_dir_override[1024];
static int g_dir_mode = -1; /* -1: environment, 0: off, 1: override */

void gj_jit_set_disk_cache(const char *dir) {
    if (!dir || !*dir) {
        g_dir_mode = 0;
    } else {
        snprintf(g_dir_override, sizeof g_dir_override, "%s", dir);
        g_dir_mode = 1;
    }
}

const char *gj_jit_disk_dir(void) {
    static char dflt[1024];
    if (g_dir_mode == 0) return NULL;
    if (g_dir_mode == 1) return g_dir_override;
    const char *e = getenv("GRADJIT_CACHE_DIR");
    if (e) return (*e && strcmp(e, "off") != 0) ? e : NULL;
    const char *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    if (x && *x) snprintf(dflt, sizeof dflt, "%s/gradjit", x);
    else if (h && *h) snprintf(dflt, sizeof dflt, "%s/.cache/gradjit", h);
    else return NULL;
    return dflt;
}

/* mkdir -p. 0 or -1. */
static int make_dirs(const char *dir) {
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s", dir);
    for (char *q = tmp + 1; *q; q++) {
        if (*q != '/') continue;
        *q = '\0';
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
        *q = '/';
    }
    return (mkdir(tmp, 0755) == 0 || errno == EEXIST) ? 0 : -1;
}

static void file_name(char *out, size_t cap, const char *dir, const uint64_t h[2]) {
    snprintf(out, cap, "%s/%016llx%016llx.gjc", dir, (unsigned long long)h[0],
             (unsigned long long)h[1]);
}

/* ------------------------------------------------------------ buffers */

typedef struct wbuf {
    unsigned char *p;
    size_t n, cap;
    bool oom;
} wbuf;

static void put(wbuf *b, const void *src, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *q = gj_rt_realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_u64(wbuf *b, uint64_t v) { put(b, &v, sizeof v); }

static void put_blob(wbuf *b, const void *src, size_t n) {
    put_u64(b, n);
    put(b, src, n);
}

typedef struct rbuf {
    const unsigned char *p;
    size_t n, pos;
    bool bad;
} rbuf;

static void get(rbuf *b, void *dst, size_t n) {
    if (b->bad || n > b->n - b->pos) {
        b->bad = true;
        if (n) memset(dst, 0, n);
        return;
    }
    memcpy(dst, b->p + b->pos, n);
    b->pos += n;
}

static uint64_t get_u64(rbuf *b) {
    uint64_t v = 0;
    get(b, &v, sizeof v);
    return v;
}

/* A count that must fit in the rest of the buffer at elsize bytes each. */
static int get_count(rbuf *b, size_t elsize) {
    uint64_t v = get_u64(b);
    if (b->bad || v > (uint64_t)INT32_MAX || (elsize && v > (b->n - b->pos) / elsize)) {
        b->bad = true;
        return 0;
    }
    return (int)v;
}

/* A blob in place (pointer into the buffer). */
static const unsigned char *get_blob(rbuf *b, size_t *n) {
    uint64_t len = get_u64(b);
    if (b->bad || len > b->n - b->pos) {
        b->bad = true;
        *n = 0;
        return NULL;
    }
    const unsigned char *q = b->p + b->pos;
    b->pos += (size_t)len;
    *n = (size_t)len;
    return q;
}

/* n elements of size sz into a new gj_rt_malloc'd array (NULL if n == 0). */
static void *get_array(rbuf *b, int n, size_t sz, bool *oom) {
    if (n <= 0) return NULL;
    void *a = gj_rt_malloc((size_t)n * sz);
    if (!a) {
        *oom = true;
        b->bad = true;
        return NULL;
    }
    get(b, a, (size_t)n * sz);
    return a;
}

static uint64_t layout_signature(void) {
    uint64_t s[] = {sizeof(gj_jit_buffer), sizeof(gj_jit_access), sizeof(gj_jit_expr),
                    sizeof(gj_jit_store),  sizeof(gj_jit_kernel), sizeof(gj_jit_matmul),
                    sizeof(gj_rt_meta),    sizeof(gj_jit_input),  sizeof(gj_jit_output),
                    sizeof(gj_jit_index),  GJ_MAX_DIMS,           (uint64_t)GJ_P_COUNT};
    uint64_t h[2];
    gj_jit_hash128(s, sizeof s, h);
    return h[0];
}

/* --------------------------------------------------------------- plan */

static void put_plan(wbuf *b, const gj_jit_program *pr) {
    const gj_jit_plan *p = &pr->plan;
    put_u64(b, (uint64_t)p->n_inputs);
    put_u64(b, (uint64_t)p->n_outputs);
    put_u64(b, pr->recapture);
    put(b, p->in_meta, (size_t)p->n_inputs * sizeof *p->in_meta);
    put(b, p->out_meta, (size_t)p->n_outputs * sizeof *p->out_meta);
    put(b, p->out_buf, (size_t)p->n_outputs * sizeof *p->out_buf);
    put(b, pr->inputs, (size_t)pr->n_inputs * sizeof *pr->inputs);
    put(b, pr->outputs, (size_t)pr->n_outputs * sizeof *pr->outputs);
    put_u64(b, (uint64_t)p->n_bufs);
    put(b, p->bufs, (size_t)p->n_bufs * sizeof *p->bufs);
    put_u64(b, (uint64_t)p->n_steps);
    for (int s = 0; s < p->n_steps; s++) {
        const gj_jit_step *st = &p->steps[s];
        put_u64(b, st->kind);
        if (st->kind == GJ_JIT_STEP_MATMUL) {
            put(b, &st->mm, sizeof st->mm);
            continue;
        }
        if (st->kind == GJ_JIT_STEP_INDEX) {
            put(b, &st->ix, sizeof st->ix);
            continue;
        }
        const gj_jit_kernel *k = &st->k;
        put(b, k, sizeof *k);
        put(b, k->acc, (size_t)k->n_acc * sizeof *k->acc);
        put(b, k->ex, (size_t)k->n_ex * sizeof *k->ex);
        put(b, k->st, (size_t)k->n_st * sizeof *k->st);
        put(b, k->param_buf, (size_t)k->n_params * sizeof *k->param_buf);
    }
    put_u64(b, (uint64_t)p->n_rt_params);
    put(b, p->rt_param_node, (size_t)p->n_rt_params * sizeof *p->rt_param_node);
    put_u64(b, (uint64_t)(int64_t)p->params_buf);
    put_u64(b, p->peak_temp_bytes);
    put_u64(b, (uint64_t)p->n_by_first);
    put(b, p->by_first, (size_t)p->n_by_first * sizeof *p->by_first);
    put_u64(b, (uint64_t)p->n_by_last);
    put(b, p->by_last, (size_t)p->n_by_last * sizeof *p->by_last);
}

static bool idx_ok(int v, int n) { return v >= 0 && v < n; }

/* Every index inside the plan is in range. */
static bool plan_sane(const gj_jit_program *pr) {
    const gj_jit_plan *p = &pr->plan;
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        if (x->kind > GJ_JIT_BUF_PARAMS || !gj_rt_dtype_valid((int)x->dtype) || x->numel < 0) return false;
        if (x->kind == GJ_JIT_BUF_DROPOUT && x->gen_param >= p->n_rt_params) return false;
        if (x->kind == GJ_JIT_BUF_PARAMS && b != p->params_buf) return false;
        if (x->kind == GJ_JIT_BUF_INPUT && !idx_ok(x->index, p->n_inputs)) return false;
        if (x->kind == GJ_JIT_BUF_OUTPUT && !idx_ok(x->index, p->n_outputs)) return false;
        if (x->kind == GJ_JIT_BUF_IOTA && (x->gen_inner < 1 || x->gen_len < 1)) return false;
    }
    for (int o = 0; o < p->n_outputs; o++)
        if (!idx_ok(p->out_buf[o], p->n_bufs)) return false;
    if (p->n_rt_params > 0 && !idx_ok(p->params_buf, p->n_bufs)) return false;
    for (int k = 0; k < p->n_rt_params; k++)
        if (p->rt_param_node[k] < 0) return false;
    for (int i = 0; i < p->n_by_first; i++)
        if (!idx_ok(p->by_first[i], p->n_bufs)) return false;
    for (int i = 0; i < p->n_by_last; i++)
        if (!idx_ok(p->by_last[i], p->n_bufs)) return false;
    for (int i = 0; i < pr->n_inputs; i++)
        if ((unsigned)pr->inputs[i].role > GJ_JIT_IN_OTHER) return false;
    for (int o = 0; o < pr->n_outputs; o++)
        if (pr->outputs[o].grad_input >= pr->n_inputs || pr->outputs[o].acc_node < 0) return false;
    for (int s = 0; s < p->n_steps; s++) {
        const gj_jit_step *st = &p->steps[s];
        if (st->kind == GJ_JIT_STEP_MATMUL) {
            const gj_jit_matmul *m = &st->mm;
            if (!idx_ok(m->a_buf, p->n_bufs) || !idx_ok(m->b_buf, p->n_bufs) ||
                !idx_ok(m->c_buf, p->n_bufs) || m->nb < 0 || m->nb > GJ_MAX_DIMS ||
                (m->dtype != GJ_F32 && m->dtype != GJ_F64))
                return false;
            continue;
        }
        if (st->kind == GJ_JIT_STEP_INDEX) {
            const gj_jit_index *x = &st->ix;
            if (!idx_ok(x->src_buf, p->n_bufs) || !idx_ok(x->idx_buf, p->n_bufs) ||
                !idx_ok(x->out_buf, p->n_bufs) || x->n < 0 || x->D < 0 || x->V < 0 ||
                x->dtype == GJ_I64 || !gj_rt_dtype_valid((int)x->dtype) ||
                p->bufs[x->idx_buf].dtype != GJ_I64 || p->bufs[x->idx_buf].numel < x->n ||
                p->bufs[x->out_buf].numel < (x->scatter ? x->V * x->D : x->n * x->D) ||
                (x->scatter && p->bufs[x->src_buf].numel < x->n * x->D))
                return false;
            continue;
        }
        const gj_jit_kernel *k = &st->k;
        if (k->nd < 1 || k->nd > GJ_MAX_DIMS || k->rows < 0 || k->grain < 1) return false;
        for (int a = 0; a < k->n_acc; a++)
            if (!idx_ok(k->acc[a].buf, p->n_bufs)) return false;
        for (int q = 0; q < k->n_params; q++)
            if (!idx_ok(k->param_buf[q], p->n_bufs)) return false;
        for (int e = 0; e < k->n_ex; e++) {
            const gj_jit_expr *x = &k->ex[e];
            if (x->kind == GJ_JIT_E_LOAD && !idx_ok(x->access, k->n_acc)) return false;
            if (x->kind == GJ_JIT_E_OP) {
                if (x->inst.n_in < 0 || x->inst.n_in > 3 || (unsigned)x->inst.prim >= GJ_P_COUNT)
                    return false;
                for (int q = 0; q < x->inst.n_in; q++)
                    if (!idx_ok(x->args[q], e)) return false;
            }
            if (x->kind > GJ_JIT_E_OP) return false;
        }
        for (int q = 0; q < k->n_st; q++)
            if (!idx_ok(k->st[q].access, k->n_acc) || !idx_ok(k->st[q].expr, k->n_ex)) return false;
    }
    return true;
}

/* Reads a plan blob into pr. 0, or -1 (bad data or OOM). */
static int get_plan(rbuf *b, gj_jit_program *pr, bool *oom) {
    gj_jit_plan *p = &pr->plan;
    p->n_inputs = pr->n_inputs = get_count(b, sizeof(gj_rt_meta));
    p->n_outputs = pr->n_outputs = get_count(b, sizeof(gj_rt_meta));
    pr->recapture = get_u64(b) != 0;
    p->in_meta = get_array(b, p->n_inputs, sizeof *p->in_meta, oom);
    p->out_meta = get_array(b, p->n_outputs, sizeof *p->out_meta, oom);
    p->out_buf = get_array(b, p->n_outputs, sizeof *p->out_buf, oom);
    pr->inputs = get_array(b, pr->n_inputs, sizeof *pr->inputs, oom);
    pr->outputs = get_array(b, pr->n_outputs, sizeof *pr->outputs, oom);
    p->n_bufs = get_count(b, sizeof(gj_jit_buffer));
    p->bufs = get_array(b, p->n_bufs, sizeof *p->bufs, oom);
    p->cap_bufs = p->n_bufs;
    int ns = get_count(b, sizeof(uint64_t));
    if (ns > 0) {
        p->steps = gj_rt_calloc((size_t)ns, sizeof *p->steps);
        if (!p->steps) {
            *oom = true;
            return -1;
        }
        p->cap_steps = ns;
    }
    for (int s = 0; s < ns && !b->bad; s++) {
        gj_jit_step *st = &p->steps[s];
        p->n_steps = s + 1;
        uint64_t kind = get_u64(b);
        if (kind == GJ_JIT_STEP_MATMUL) {
            st->kind = GJ_JIT_STEP_MATMUL;
            get(b, &st->mm, sizeof st->mm);
            continue;
        }
        if (kind == GJ_JIT_STEP_INDEX) {
            st->kind = GJ_JIT_STEP_INDEX;
            get(b, &st->ix, sizeof st->ix);
            continue;
        }
        if (kind != GJ_JIT_STEP_KERNEL) return -1;
        st->kind = GJ_JIT_STEP_KERNEL;
        gj_jit_kernel *k = &st->k;
        get(b, k, sizeof *k);
        k->acc = NULL;
        k->ex = NULL;
        k->st = NULL;
        k->param_buf = NULL;
        k->fn = NULL;
        if (k->n_acc < 0 || k->n_ex < 0 || k->n_st < 0 || k->n_params < 0 ||
            (size_t)k->n_acc > b->n || (size_t)k->n_ex > b->n || (size_t)k->n_st > b->n ||
            (size_t)k->n_params > b->n) {
            k->n_acc = k->n_ex = k->n_st = k->n_params = 0;
            return -1;
        }
        k->acc = get_array(b, k->n_acc, sizeof *k->acc, oom);
        k->ex = get_array(b, k->n_ex, sizeof *k->ex, oom);
        k->st = get_array(b, k->n_st, sizeof *k->st, oom);
        k->param_buf = get_array(b, k->n_params, sizeof *k->param_buf, oom);
        k->cap_acc = k->n_acc;
        k->cap_ex = k->n_ex;
        k->cap_st = k->n_st;
        k->name[sizeof k->name - 1] = '\0';
    }
    p->n_rt_params = get_count(b, sizeof(int));
    p->rt_param_node = get_array(b, p->n_rt_params, sizeof *p->rt_param_node, oom);
    p->params_buf = (int)(int64_t)get_u64(b);
    p->peak_temp_bytes = (size_t)get_u64(b);
    p->n_by_first = get_count(b, sizeof(int));
    p->by_first = get_array(b, p->n_by_first, sizeof *p->by_first, oom);
    p->n_by_last = get_count(b, sizeof(int));
    p->by_last = get_array(b, p->n_by_last, sizeof *p->by_last, oom);
    if (b->bad || !plan_sane(pr)) return -1;
    return 0;
}

/* ---------------------------------------------------------- save/load */

int gj_jit_disk_save(const gj_jit_walk *w, const gj_jit_program *pr, const char *prefix,
                     const void *obj, size_t obj_size) {
    const char *dir = gj_jit_disk_dir();
    const char *host = gj_jit_host_id();
    bool log = (gj_jit_log_flags() & GJ_JIT_LOG_CACHE) != 0;
    if (!dir || !host[0] || !obj) return -1;
    wbuf b = {0}, pb = {0};
    int rc = -1;
    FILE *f = NULL;
    char path[1200], tmp[1300];
    put(&b, g_magic, sizeof g_magic);
    put_u64(&b, layout_signature());
    put_blob(&b, GJ_VERSION_STR, strlen(GJ_VERSION_STR));
    put_blob(&b, host, strlen(host));
    put_blob(&b, w->key, w->key_len);
    put_blob(&b, prefix, strlen(prefix));
    put_plan(&pb, pr);
    if (pb.oom) goto done;
    put_blob(&b, pb.p, pb.n);
    put_blob(&b, obj, obj_size);
    if (b.oom) goto done;
    uint64_t h[2];
    gj_jit_hash128(b.p, b.n, h);
    put(&b, h, sizeof h);
    if (b.oom || make_dirs(dir) != 0) goto done;
    file_name(path, sizeof path, dir, w->hash);
    snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid());
    f = fopen(tmp, "wb");
    if (!f) goto done;
    bool ok = fwrite(b.p, 1, b.n, f) == b.n;
    ok = (fclose(f) == 0) && ok;
    f = NULL;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        goto done;
    }
    rc = 0;
    if (log) fprintf(stderr, "[gradjit cache] saved %s (%zu bytes)\n", path, b.n);
done:
    if (rc != 0 && log) fprintf(stderr, "[gradjit cache] could not save to %s\n", dir);
    gj_rt_free(b.p);
    gj_rt_free(pb.p);
    return rc;
}

gj_jit_program *gj_jit_disk_load(const gj_jit_walk *w, bool *found, char *why, size_t why_cap) {
    *found = false;
    why[0] = '\0';
    const char *dir = gj_jit_disk_dir();
    if (!dir) return NULL;
    char path[1200];
    file_name(path, sizeof path, dir, w->hash);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    *found = true;
    gj_jit_program *pr = NULL;
    unsigned char *data = NULL;
    long len = -1;
    if (fseek(f, 0, SEEK_END) == 0) len = ftell(f);
    if (len < (long)(sizeof g_magic + 16) || fseek(f, 0, SEEK_SET) != 0) {
        snprintf(why, why_cap, "damaged (truncated)");
        goto fail;
    }
    data = gj_rt_malloc((size_t)len);
    if (!data || fread(data, 1, (size_t)len, f) != (size_t)len) {
        snprintf(why, why_cap, data ? "damaged (read error)" : "out of memory");
        goto fail;
    }
    uint64_t h[2], want[2];
    memcpy(want, data + len - 16, 16);
    gj_jit_hash128(data, (size_t)len - 16, h);
    if (h[0] != want[0] || h[1] != want[1]) {
        snprintf(why, why_cap, "damaged (checksum)");
        goto fail;
    }
    rbuf b = {data, (size_t)len - 16, 0, false};
    char magic[8];
    get(&b, magic, sizeof magic);
    if (memcmp(magic, g_magic, sizeof magic) != 0 || get_u64(&b) != layout_signature()) {
        snprintf(why, why_cap, "stale (format)");
        goto fail;
    }
    size_t n;
    const unsigned char *s = get_blob(&b, &n);
    if (b.bad || n != strlen(GJ_VERSION_STR) || memcmp(s, GJ_VERSION_STR, n) != 0) {
        snprintf(why, why_cap, "stale (library version)");
        goto fail;
    }
    const char *host = gj_jit_host_id();
    s = get_blob(&b, &n);
    if (b.bad || n != strlen(host) || memcmp(s, host, n) != 0) {
        snprintf(why, why_cap, "stale (LLVM version, target or CPU features)");
        goto fail;
    }
    s = get_blob(&b, &n);
    if (b.bad || n != w->key_len || memcmp(s, w->key, n) != 0) {
        snprintf(why, why_cap, "another key with the same hash");
        goto fail;
    }
    size_t plen;
    const unsigned char *pfx = get_blob(&b, &plen);
    char prefix[64];
    if (b.bad || plen == 0 || plen >= sizeof prefix) {
        snprintf(why, why_cap, "damaged (prefix)");
        goto fail;
    }
    memcpy(prefix, pfx, plen);
    prefix[plen] = '\0';
    size_t pn, on;
    const unsigned char *pdata = get_blob(&b, &pn);
    const unsigned char *obj = get_blob(&b, &on);
    if (b.bad || b.pos != b.n) {
        snprintf(why, why_cap, "damaged (layout)");
        goto fail;
    }
    pr = gj_rt_calloc(1, sizeof *pr);
    if (!pr) {
        snprintf(why, why_cap, "out of memory");
        goto fail;
    }
    rbuf pb = {pdata, pn, 0, false};
    bool oom = false;
    if (get_plan(&pb, pr, &oom) != 0 || pb.pos != pb.n) {
        snprintf(why, why_cap, oom ? "out of memory" : "damaged (plan)");
        goto fail;
    }
    char lwhy[300];
    pr->code = gj_jit_code_load(&pr->plan, prefix, obj, on, lwhy, sizeof lwhy);
    if (!pr->code) {
        snprintf(why, why_cap, "%s", lwhy);
        goto fail;
    }
    fclose(f);
    gj_rt_free(data);
    return pr;
fail:
    if (f) fclose(f);
    gj_rt_free(data);
    gj_jit_program_free(pr);
    return NULL;
}
