/*
 * compiled.c - gj_jit_backward: key -> cache -> (capture, compile) -> run,
 * with fallbacks to the eager engine and the statistics of gj_ca_stats.
 *
 * Invariants:
 *   - A fallback (handled = false) has changed nothing: no .grad written,
 *     no graph freed. It is counted and its reason kept; the caller runs
 *     the eager engine, which gives the reference gradients (or the error).
 *   - The cache maps a key (full canonical text, indexed by its 128-bit
 *     hash) to a program or to "eager-only" with the reason. Entries live
 *     until gj_jit_clear_cache. A lookup compares the whole text. A memory
 *     miss asks the disk cache (diskcache.c) before capturing; a compiled
 *     program is written there (its kernels are named after the key's hash,
 *     so object code from another process links without clashes).
 *   - One mutex guards the cache and the statistics; compiling holds it
 *     (compiles are rare); running a program does not.
 *   - Inputs of a run come from the walk (canonical origins) unless the
 *     program needs a re-capture; saved tensors are checked exactly as the
 *     eager engine checks them (walk validation) before anything runs.
 *     They are read in place, in the layout the key recorded; an existing
 *     .grad is updated in place (through a contiguous copy if strided).
 *   - Every fallback has a class (gj_ca_reason, counted per class) and a
 *     message "<class>: <detail>" kept per thread. Classes decided here:
 *     no lowering (also: hooks on the graph, which compiled programs do not
 *     call), LLVM error, recompile limit, other (freed graph, modified
 *     saved tensor, aliasing .grad, out of memory).
 *   - Recompile limit: a new key whose call site (walk.site) already has
 *     `limit` programs in the cache is marked eager-only instead of being
 *     captured; keys compiled before keep running compiled.
 */
#include "jit.h"

#include "capture.h"
#include "diskcache.h"
#include "program.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

typedef struct cache_entry {
    uint64_t hash[2];
    uint64_t site[2]; /* call site (recompile limit) */
    char *key;
    size_t key_len;
    gj_jit_program *prog; /* NULL: eager-only */
    gj_ca_reason code;    /* eager-only: why */
    char reason[256];
} cache_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static cache_entry *g_cache;
static int g_n_cache, g_cap_cache;
static gj_ca_stats g_stats;
static atomic_bool g_quiet;
static atomic_int g_recompile_limit = 8;
static _Thread_local char g_last_reason[400];

static void fallback(gj_ca_reason code, const char *reason, bool first_for_key);

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void gj_jit_stats(gj_ca_stats *out) {
    if (!out) return;
    pthread_mutex_lock(&g_lock);
    int64_t backwards = out->backwards;
    *out = g_stats;
    out->backwards = backwards;
    pthread_mutex_unlock(&g_lock);
}

void gj_jit_reset_stats(void) {
    pthread_mutex_lock(&g_lock);
    memset(&g_stats, 0, sizeof g_stats);
    pthread_mutex_unlock(&g_lock);
    g_last_reason[0] = '\0';
}

const char *gj_jit_last_fallback_reason(void) { return g_last_reason; }

const char *gj_jit_last_fallback(void) { return g_last_reason; }

void gj_jit_set_quiet(bool quiet) { atomic_store(&g_quiet, quiet); }

void gj_jit_note_fallback(gj_ca_reason reason, const char *detail) {
    fallback(reason, detail ? detail : "", false);
}

void gj_jit_set_recompile_limit(int n) { atomic_store(&g_recompile_limit, n < 0 ? -1 : n); }

int gj_jit_recompile_limit(void) { return atomic_load(&g_recompile_limit); }

/* Programs in the cache for the call site of w (lock held). */
static int site_programs(const gj_jit_walk *w) {
    int n = 0;
    for (int i = 0; i < g_n_cache; i++)
        n += g_cache[i].prog && g_cache[i].site[0] == w->site[0] && g_cache[i].site[1] == w->site[1];
    return n;
}

/* The class of a program-build failure, from its message (program.c). */
static gj_ca_reason build_reason(const char *why) {
    if (strncmp(why, "no lowering", 11) == 0) return GJ_CA_NO_LOWERING;
    if (strncmp(why, "LLVM", 4) == 0) return GJ_CA_LLVM_ERROR;
    return GJ_CA_OTHER;
}

void gj_jit_clear_cache(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_n_cache; i++) {
        gj_jit_program_free(g_cache[i].prog);
        gj_rt_free(g_cache[i].key);
    }
    gj_rt_free(g_cache);
    g_cache = NULL;
    g_n_cache = g_cap_cache = 0;
    pthread_mutex_unlock(&g_lock);
    gj_jit_llvm_shutdown();
}

/* Entry of key (lock held), or NULL. */
static cache_entry *cache_find(const gj_jit_walk *w) {
    for (int i = 0; i < g_n_cache; i++) {
        cache_entry *e = &g_cache[i];
        if (e->hash[0] == w->hash[0] && e->hash[1] == w->hash[1] && e->key_len == w->key_len &&
            memcmp(e->key, w->key, w->key_len) == 0)
            return e;
    }
    return NULL;
}

/* Inserts a new entry (lock held); prog may be NULL (eager-only). Returns
 * the entry or NULL on OOM (prog is then freed). */
static cache_entry *cache_insert(const gj_jit_walk *w, gj_jit_program *prog, gj_ca_reason code,
                                 const char *reason) {
    if (g_n_cache == g_cap_cache) {
        int nc = g_cap_cache ? g_cap_cache * 2 : 16;
        cache_entry *c = gj_rt_realloc(g_cache, (size_t)nc * sizeof *c);
        if (!c) goto fail;
        g_cache = c;
        g_cap_cache = nc;
    }
    char *key = gj_rt_malloc(w->key_len + 1);
    if (!key) goto fail;
    memcpy(key, w->key, w->key_len + 1);
    cache_entry *e = &g_cache[g_n_cache++];
    memset(e, 0, sizeof *e);
    e->hash[0] = w->hash[0];
    e->hash[1] = w->hash[1];
    e->site[0] = w->site[0];
    e->site[1] = w->site[1];
    e->code = code;
    e->key = key;
    e->key_len = w->key_len;
    e->prog = prog;
    if (reason) snprintf(e->reason, sizeof e->reason, "%s", reason);
    return e;
fail:
    gj_jit_program_free(prog);
    return NULL;
}

/* Records a fallback of class code (lock NOT held): counts it, keeps its
 * message and prints it (once per key unless quiet; every time under
 * GRADJIT_LOG=fallback). */
static void fallback(gj_ca_reason code, const char *reason, bool first_for_key) {
    if ((unsigned)code >= GJ_CA_N_REASONS) code = GJ_CA_OTHER;
    snprintf(g_last_reason, sizeof g_last_reason, "%s: %s", gj_ca_reason_name(code), reason);
    pthread_mutex_lock(&g_lock);
    g_stats.fallbacks++;
    g_stats.fallbacks_by_reason[code]++;
    pthread_mutex_unlock(&g_lock);
    unsigned fl = gj_jit_log_flags();
    if ((fl & GJ_JIT_LOG_FALLBACK) || (first_for_key && !atomic_load(&g_quiet)))
        fprintf(stderr, "gradjit: compiled autograd fell back to eager: %s\n", g_last_reason);
}

/* Byte range [lo, hi) of the storage of t that its view can touch. */
static void byte_range(const gj_tensor *t, size_t *lo, size_t *hi) {
    size_t el = gj_rt_dtype_size(t->dtype);
    int64_t last = t->offset;
    for (int k = 0; k < t->ndim; k++)
        if (t->shape[k] > 0) last += (t->shape[k] - 1) * t->strides[k];
    *lo = (size_t)t->offset * el;
    *hi = t->numel > 0 ? (size_t)(last + 1) * el : *lo;
}

/* Do the memories of a and b overlap? */
static bool overlaps(const gj_tensor *a, const gj_tensor *b) {
    if (a->storage != b->storage) return false;
    size_t al, ah, bl, bh;
    byte_range(a, &al, &ah);
    byte_range(b, &bl, &bh);
    return al < bh && bl < ah;
}

typedef struct out_ctx {
    const gj_jit_plan *p;
    gj_tensor **news;
} out_ctx;

/* A new .grad tensor for output o (uninitialised: the step writes it all). */
static void *alloc_output(void *vctx, int o) {
    out_ctx *c = vctx;
    const gj_rt_meta *m = &c->p->out_meta[o];
    c->news[o] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    return c->news[o] ? gj_rt_data_ptr(c->news[o]) : NULL;
}

/* Runs program pr on the tensors of this backward. Returns 0 (gradients
 * written), 1 (fallback: nothing written, reason in why) or -1 (error set,
 * nothing written). */
static int run_program(gj_jit_program *pr, const gj_jit_walk *w, gj_tensor *const *tensors,
                       char *why, size_t why_cap) {
    const gj_jit_plan *p = &pr->plan;
    int rc = -1;
    int n_in = pr->n_inputs, n_out = pr->n_outputs;
    gj_tensor **contig = gj_rt_calloc((size_t)n_in + 1, sizeof *contig);
    gj_tensor **news = gj_rt_calloc((size_t)n_out + 1, sizeof *news);
    void **in = gj_rt_calloc((size_t)n_in + 1, sizeof *in);
    void **out = gj_rt_calloc((size_t)n_out + 1, sizeof *out);
    uint64_t *params = NULL;
    if (!contig || !news || !in || !out) goto done;
    for (int i = 0; i < n_in; i++) {
        gj_tensor *t = tensors[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (!gj_jit_meta_equal(&m, &p->in_meta[i])) {
            snprintf(why, why_cap, "input #%d changed shape or dtype", i);
            rc = 1;
            goto done;
        }
        if (pr->inputs[i].role == GJ_JIT_IN_GRAD) {
            for (int j = 0; j < n_in; j++)
                if (j != i && overlaps(tensors[j], t)) {
                    snprintf(why, why_cap, "a .grad shares memory with another input of the graph");
                    rc = 1;
                    goto done;
                }
        }
        if (pr->inputs[i].role == GJ_JIT_IN_GRAD) { /* written: contiguous (copy if strided) */
            contig[i] = gj_rt_contiguous(t);
            if (!contig[i]) goto done;
            in[i] = gj_rt_data_ptr(contig[i]);
            continue;
        }
        int64_t st[GJ_MAX_DIMS];
        gj_jit_input_strides(t, st);
        if (memcmp(st, pr->inputs[i].strides, (size_t)m.ndim * sizeof st[0]) != 0) {
            snprintf(why, why_cap, "input #%d has another layout than when compiled", i);
            rc = 1;
            goto done;
        }
        in[i] = gj_rt_data_ptr(t); /* read in place */
    }
    if (p->n_rt_params > 0) { /* dropout seeds/offsets of this run */
        params = gj_rt_calloc((size_t)p->n_rt_params * 2, sizeof *params);
        if (!params) goto done;
        for (int k = 0; k < p->n_rt_params; k++) {
            int nd = p->rt_param_node[k];
            const gj_ag_node *node = (nd >= 0 && nd < w->n) ? w->nodes[nd] : NULL;
            if (!node || node->kind != GJ_AG_OP || node->op != &gj_ag_op_dropout ||
                node->attrs.ni < 2) {
                snprintf(why, why_cap, "dropout parameters not found");
                rc = 1;
                goto done;
            }
            memcpy(&params[2 * k], &node->attrs.i[0], sizeof params[0]);
            params[2 * k + 1] = (uint64_t)node->attrs.i[1];
        }
    }
    out_ctx oc = {p, news};
    if (gj_jit_plan_exec(p, in, params, out, alloc_output, &oc) != 0) goto done;
    for (int o = 0; o < n_out; o++) {
        const gj_jit_output *oo = &pr->outputs[o];
        gj_tensor *leaf = w->nodes[oo->acc_node]->leaf;
        if (oo->grad_input >= 0) {
            gj_tensor *g = tensors[oo->grad_input], *c = contig[oo->grad_input];
            if (c != g && gj_rt_copy_into(g, c) != 0) goto done; /* a strided .grad */
            gj_rt_bump_version(g);
            continue;
        }
        gj_ag_tensor_meta *lm = gj_ag_meta_get(leaf, true);
        if (!lm) goto done; /* earlier outputs are already set: an OOM error */
        if (!news[o]) continue; /* an empty gradient no step wrote: not expected */
        if (lm->grad) gj_rt_tensor_release(lm->grad);
        lm->grad = news[o];
        news[o] = NULL;
    }
    rc = 0;
done:
    for (int i = 0; i < n_in && contig; i++)
        if (contig[i]) gj_rt_tensor_release(contig[i]);
    for (int o = 0; o < n_out && news; o++)
        if (news[o]) gj_rt_tensor_release(news[o]);
    gj_rt_free(contig);
    gj_rt_free(news);
    gj_rt_free(in);
    gj_rt_free(out);
    gj_rt_free(params);
    return rc;
}

/* The input tensors of program pr for this walk, from canonical origins.
 * tensors[] receives borrowed pointers. false if an origin is missing. */
static bool inputs_from_walk(const gj_jit_program *pr, const gj_jit_walk *w,
                             gj_tensor *const *seeds, gj_tensor **tensors) {
    for (int i = 0; i < pr->n_inputs; i++) {
        const gj_jit_input *in = &pr->inputs[i];
        gj_tensor *t = NULL;
        switch (in->role) {
        case GJ_JIT_IN_SAVED:
            if (in->node >= 0 && in->node < w->n && in->slot < w->nodes[in->node]->n_saved)
                t = w->nodes[in->node]->saved[in->slot].t;
            break;
        case GJ_JIT_IN_SEED:
            t = seeds ? seeds[in->slot] : NULL;
            break;
        case GJ_JIT_IN_GRAD:
            if (in->node >= 0 && in->node < w->n && w->nodes[in->node]->leaf) {
                gj_ag_tensor_meta *m = w->nodes[in->node]->leaf->ag;
                t = m ? m->grad : NULL;
            }
            break;
        default:
            break;
        }
        if (!t) return false;
        tensors[i] = t;
    }
    return true;
}

int gj_jit_backward(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                    bool retain_graph, bool *handled) {
    *handled = false;
    gj_jit_walk w;
    gj_jit_capture cap;
    memset(&cap, 0, sizeof cap);
    bool have_cap = false;
    gj_tensor **tensors = NULL;
    char why[300] = "";
    gj_ca_reason code = GJ_CA_OTHER;
    int rc = 0;
    unsigned fl = gj_jit_log_flags();
    if (gj_jit_walk_build(&w, n_roots, roots, seeds) != 0) {
        gj_jit_walk_free(&w);
        fallback(GJ_CA_OTHER, "out of memory while computing the key", false);
        return 0;
    }
    if (w.invalid) {
        snprintf(why, sizeof why, "%s", w.reason);
        goto fall;
    }
    pthread_mutex_lock(&g_lock);
    cache_entry *e = cache_find(&w);
    gj_jit_program *prog = NULL;
    if (e && !e->prog) {
        snprintf(why, sizeof why, "%s", e->reason);
        code = e->code;
        pthread_mutex_unlock(&g_lock);
        if (fl & GJ_JIT_LOG_CACHE)
            fprintf(stderr, "[gradjit cache] hit eager-only %016llx%016llx\n",
                    (unsigned long long)w.hash[0], (unsigned long long)w.hash[1]);
        goto fall;
    }
    if (e) {
        prog = e->prog;
        g_stats.mem_hits++;
        if (fl & GJ_JIT_LOG_CACHE)
            fprintf(stderr, "[gradjit cache] hit %016llx%016llx\n", (unsigned long long)w.hash[0],
                    (unsigned long long)w.hash[1]);
    } else {
        if (w.n_hooks > 0) { /* hooks are not compiled (yet): eager for this key */
            snprintf(why, sizeof why,
                     "hooks on the graph (%d tensor/post-accumulate): hook calls have no "
                     "lowering in compiled programs",
                     w.n_hooks);
            cache_insert(&w, NULL, GJ_CA_NO_LOWERING, why);
            pthread_mutex_unlock(&g_lock);
            fallback(GJ_CA_NO_LOWERING, why, true);
            goto out;
        }
        int limit = atomic_load(&g_recompile_limit);
        if (limit >= 0 && site_programs(&w) >= limit) {
            snprintf(why, sizeof why,
                     "%d programs already compiled for this call site (limit %d: "
                     "gj_compiled_autograd_set_recompile_limit)",
                     site_programs(&w), limit);
            cache_insert(&w, NULL, GJ_CA_RECOMPILE_LIMIT, why);
            pthread_mutex_unlock(&g_lock);
            fallback(GJ_CA_RECOMPILE_LIMIT, why, true);
            goto out;
        }
        double t0 = now_ms();
        bool found = false;
        char dwhy[300];
        prog = gj_jit_disk_load(&w, &found, dwhy, sizeof dwhy);
        if (prog) {
            if (!cache_insert(&w, prog, GJ_CA_OTHER, NULL)) {
                pthread_mutex_unlock(&g_lock);
                snprintf(why, sizeof why, "out of memory in the cache");
                goto fall;
            }
            g_stats.disk_hits++;
            if (fl & GJ_JIT_LOG_CACHE)
                fprintf(stderr, "[gradjit cache] disk hit %016llx%016llx in %.1f ms\n",
                        (unsigned long long)w.hash[0], (unsigned long long)w.hash[1],
                        now_ms() - t0);
            goto run;
        }
        if (found && (fl & GJ_JIT_LOG_CACHE))
            fprintf(stderr, "[gradjit cache] disk entry %016llx%016llx not used: %s\n",
                    (unsigned long long)w.hash[0], (unsigned long long)w.hash[1], dwhy);
        have_cap = true;
        if (gj_jit_capture_run(&cap, &w, n_roots, roots, seeds) != 0) {
            snprintf(why, sizeof why, "%s", cap.reason);
            code = cap.code;
            if (cap.permanent) cache_insert(&w, NULL, code, why);
            pthread_mutex_unlock(&g_lock);
            if (cap.permanent) {
                fallback(code, why, true);
                goto out;
            }
            goto fall;
        }
        bool permanent = false, disk = gj_jit_disk_dir() != NULL;
        char prefix[48];
        snprintf(prefix, sizeof prefix, "gjk%016llx%016llx", (unsigned long long)w.hash[0],
                 (unsigned long long)w.hash[1]);
        void *obj = NULL;
        size_t obj_size = 0;
        prog = gj_jit_program_build(&cap.g, prefix, disk ? &obj : NULL, &obj_size, why, sizeof why,
                                    &permanent);
        if (!prog) {
            code = build_reason(why);
            if (permanent) cache_insert(&w, NULL, code, why);
            pthread_mutex_unlock(&g_lock);
            if (permanent) {
                fallback(code, why, true);
                goto out;
            }
            goto fall;
        }
        if (!cache_insert(&w, prog, GJ_CA_OTHER, NULL)) {
            pthread_mutex_unlock(&g_lock);
            gj_rt_free(obj);
            snprintf(why, sizeof why, "out of memory in the cache");
            goto fall;
        }
        g_stats.compiles++;
        g_stats.compile_ms += now_ms() - t0;
        if (fl & GJ_JIT_LOG_CACHE)
            fprintf(stderr, "[gradjit cache] compiled %016llx%016llx in %.1f ms\n",
                    (unsigned long long)w.hash[0], (unsigned long long)w.hash[1], now_ms() - t0);
        if (obj) gj_jit_disk_save(&w, prog, prefix, obj, obj_size);
        gj_rt_free(obj);
    }
run:
    pthread_mutex_unlock(&g_lock);

    /* the run's input tensors */
    tensors = gj_rt_calloc((size_t)prog->n_inputs + 1, sizeof *tensors);
    if (!tensors) {
        snprintf(why, sizeof why, "out of memory");
        goto fall;
    }
    if (have_cap) {
        memcpy(tensors, cap.tensors, (size_t)prog->n_inputs * sizeof *tensors);
    } else if (prog->recapture || !inputs_from_walk(prog, &w, seeds, tensors)) {
        have_cap = true;
        if (gj_jit_capture_run(&cap, &w, n_roots, roots, seeds) != 0 ||
            cap.g.n_inputs != prog->n_inputs) {
            snprintf(why, sizeof why, "re-capture failed: %s", cap.reason);
            code = cap.code;
            goto fall;
        }
        memcpy(tensors, cap.tensors, (size_t)prog->n_inputs * sizeof *tensors);
    }
    double t1 = now_ms();
    int r = run_program(prog, &w, tensors, why, sizeof why);
    if (r == 1) goto fall;
    if (r == 0) {
        pthread_mutex_lock(&g_lock);
        g_stats.run_ms += now_ms() - t1;
        pthread_mutex_unlock(&g_lock);
    }
    rc = r == 0 ? 0 : -1;
    *handled = true;
    if (rc == 0 && !retain_graph) gj_ag_release_graph(n_roots, roots);
    goto out;
fall:
    fallback(code, why, false);
out:
    gj_rt_free(tensors);
    if (have_cap) gj_jit_capture_free(&cap);
    gj_jit_walk_free(&w);
    return rc;
}
