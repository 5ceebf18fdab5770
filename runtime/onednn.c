/* SPDX-License-Identifier: MIT */
/*
 * onednn.c - the oneDNN leaf of the GEMM layer: oneDNN 2.x's matmul
 * primitive, loaded at run time, computing one block of an f32 or bf16
 * GEMM on the calling thread. Compiled only when gradjit is built with
 * oneDNN's header (GJ_HAVE_DNNL); gemm_int.h says "no" for it otherwise.
 *
 * Invariants:
 *   - Loaded with dlopen at first use (like OpenBLAS: a build with the
 *     header runs on a machine without the library, and a process that
 *     pins OpenBLAS never loads it); the library stays until exit.
 *   - Primitives are kept per block shape (a KIND_BLOCK gemm_key: the
 *     block's M and N, K, the leading dimensions, transposes, beta, bf16),
 *     made on first use (0.1-0.9 ms each) under g_lock and reused from any
 *     thread without a lock. A block shape oneDNN refuses, or whose
 *     implementation is a reference loop, stays refused: the caller then
 *     computes it with OpenBLAS.
 *   - f32 takes the GEMM-based implementation (gemm:jit) wherever oneDNN
 *     offers it: a strided column block only has gemm:jit, a dense block
 *     both, and the two sum in different orders, so taking the same one
 *     everywhere keeps a GEMM's bits independent of how a thread count
 *     splits it (GJ_RT_GEMM_PREFER_GEMM). bf16 takes oneDNN's first choice,
 *     its brgemm kernels (AMX tiles or AVX512_BF16), which need dense
 *     operands: a bf16 block whose A is a strided column slice is copied
 *     dense first (pack_a).
 *   - Signals: oneDNN 2.x's generated f32 GEMM kernels point rsp into the
 *     heap while they run, so a signal delivered to a thread inside one
 *     (Ctrl-C, a profiler's timer) would write its frame into the heap and
 *     corrupt it (oneDNN issue 4845, fixed upstream in 2026; Debian 12
 *     ships 2.6.3). Every primitive therefore runs with the thread's
 *     asynchronous signals blocked (signals_block: two rt_sigprocmask calls
 *     per block, well under a microsecond); a signal that arrives meanwhile
 *     is delivered after the kernel, on the thread's own stack.
 *   - Threads: gradjit's pool is the only threading runtime. Debian's
 *     oneDNN threads through OpenMP (libgomp); every primitive is created
 *     and executed with the calling thread's OpenMP thread count set to 1
 *     (restored afterwards), so oneDNN runs inline on the pool thread that
 *     computes the block and libgomp never starts a thread.
 *   - Memory: every allocation through the runtime's allocator. Primitives
 *     live until exit (an atexit handler destroys them and the calling
 *     thread's context); each thread that ran oneDNN has a context (stream,
 *     scratchpad, packing buffer) freed by a pthread key destructor when it
 *     exits.
 */
#include "runtime/gemm_int.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#ifndef GJ_RT_GEMM_PREFER_GEMM
#define GJ_RT_GEMM_PREFER_GEMM 1
#endif

#define GJ_DNNL_SONAME_(m) "libdnnl.so." #m
#define GJ_DNNL_SONAME(m) GJ_DNNL_SONAME_(m)

/* The C API of oneDNN 2.x, loaded with dlopen (like OpenBLAS: a build with
 * the header runs on a machine without the library, and a process that
 * pins OpenBLAS never loads it). */
static struct {
    const dnnl_version_t *(*version)(void);
    dnnl_status_t (*engine_create)(dnnl_engine_t *, dnnl_engine_kind_t, size_t);
    dnnl_status_t (*engine_destroy)(dnnl_engine_t);
    dnnl_status_t (*stream_create)(dnnl_stream_t *, dnnl_engine_t, unsigned);
    dnnl_status_t (*stream_destroy)(dnnl_stream_t);
    dnnl_status_t (*md_init_by_strides)(dnnl_memory_desc_t *, int, const dnnl_dims_t,
                                        dnnl_data_type_t, const dnnl_dims_t);
    dnnl_status_t (*md_init_by_tag)(dnnl_memory_desc_t *, int, const dnnl_dims_t,
                                    dnnl_data_type_t, dnnl_format_tag_t);
    size_t (*md_get_size)(const dnnl_memory_desc_t *);
    dnnl_status_t (*matmul_desc_init)(dnnl_matmul_desc_t *, const dnnl_memory_desc_t *,
                                      const dnnl_memory_desc_t *, const dnnl_memory_desc_t *,
                                      const dnnl_memory_desc_t *);
    dnnl_status_t (*attr_create)(dnnl_primitive_attr_t *);
    dnnl_status_t (*attr_destroy)(dnnl_primitive_attr_t);
    dnnl_status_t (*attr_set_scratchpad_mode)(dnnl_primitive_attr_t, dnnl_scratchpad_mode_t);
    dnnl_status_t (*attr_set_post_ops)(dnnl_primitive_attr_t, const_dnnl_post_ops_t);
    dnnl_status_t (*post_ops_create)(dnnl_post_ops_t *);
    dnnl_status_t (*post_ops_destroy)(dnnl_post_ops_t);
    dnnl_status_t (*post_ops_append_sum)(dnnl_post_ops_t, float);
    dnnl_status_t (*pd_create)(dnnl_primitive_desc_t *, const_dnnl_op_desc_t,
                               const_dnnl_primitive_attr_t, dnnl_engine_t,
                               const_dnnl_primitive_desc_t);
    dnnl_status_t (*pd_destroy)(dnnl_primitive_desc_t);
    dnnl_status_t (*pd_query)(const_dnnl_primitive_desc_t, dnnl_query_t, int, void *);
    dnnl_status_t (*it_create)(dnnl_primitive_desc_iterator_t *, const_dnnl_op_desc_t,
                               const_dnnl_primitive_attr_t, dnnl_engine_t,
                               const_dnnl_primitive_desc_t);
    dnnl_status_t (*it_next)(dnnl_primitive_desc_iterator_t);
    dnnl_primitive_desc_t (*it_fetch)(const_dnnl_primitive_desc_iterator_t);
    dnnl_status_t (*it_destroy)(dnnl_primitive_desc_iterator_t);
    const dnnl_memory_desc_t *(*pd_query_md)(const_dnnl_primitive_desc_t, dnnl_query_t, int);
    dnnl_status_t (*prim_create)(dnnl_primitive_t *, const_dnnl_primitive_desc_t);
    dnnl_status_t (*prim_destroy)(dnnl_primitive_t);
    dnnl_status_t (*prim_execute)(const_dnnl_primitive_t, dnnl_stream_t, int,
                                  const dnnl_exec_arg_t *);
    dnnl_status_t (*memory_create)(dnnl_memory_t *, const dnnl_memory_desc_t *, dnnl_engine_t,
                                   void *);
    dnnl_status_t (*memory_destroy)(dnnl_memory_t);
    int (*omp_get_max_threads)(void);
    void (*omp_set_num_threads)(int);
} D;

static pthread_once_t g_load_once = PTHREAD_ONCE_INIT;
static atomic_bool g_dnnl_ok;
static char g_dnnl_error[512];
static char g_dnnl_version[96] = "unavailable";
static dnnl_engine_t g_engine;
static pthread_key_t g_ctx_key;
static bool g_atexit_done; /* under g_lock */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* making primitives */
static atomic_bool g_simulate_missing;
static atomic_llong g_n_refused;

/* What a thread needs to run primitives: a stream and a scratchpad. */
typedef struct thread_ctx {
    dnnl_stream_t stream;
    void *scratch;
    size_t scratch_cap;
    uint16_t *pack; /* a bf16 block's A made dense (pack_a) */
    size_t pack_cap;
} thread_ctx;

static void ctx_free(void *p) {
    thread_ctx *t = p;
    if (!t)
        return;
    if (t->stream)
        D.stream_destroy(t->stream);
    gj_rt_free(t->scratch);
    gj_rt_free(t->pack);
    gj_rt_free(t);
}

/* A forked child has only the forking thread: a lock another thread held
 * at the fork is free in the child. */
static void child_after_fork(void) { pthread_mutex_init(&g_lock, NULL); }

static void dnnl_load(void) {
    void *h = dlopen(GJ_DNNL_SONAME(DNNL_VERSION_MAJOR), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(g_dnnl_error, sizeof g_dnnl_error, "cannot load oneDNN: %s",
                 e ? e : "unknown dlopen error");
        return;
    }
#define GJ_SYM(field, name)                                                             \
    do {                                                                                \
        *(void **)(&D.field) = dlsym(h, name);                                          \
        if (!D.field) {                                                                 \
            snprintf(g_dnnl_error, sizeof g_dnnl_error, "oneDNN has no %s", name);      \
            goto fail;                                                                  \
        }                                                                               \
    } while (0)
    GJ_SYM(version, "dnnl_version");
    GJ_SYM(engine_create, "dnnl_engine_create");
    GJ_SYM(engine_destroy, "dnnl_engine_destroy");
    GJ_SYM(stream_create, "dnnl_stream_create");
    GJ_SYM(stream_destroy, "dnnl_stream_destroy");
    GJ_SYM(md_init_by_strides, "dnnl_memory_desc_init_by_strides");
    GJ_SYM(md_init_by_tag, "dnnl_memory_desc_init_by_tag");
    GJ_SYM(md_get_size, "dnnl_memory_desc_get_size");
    GJ_SYM(matmul_desc_init, "dnnl_matmul_desc_init");
    GJ_SYM(attr_create, "dnnl_primitive_attr_create");
    GJ_SYM(attr_destroy, "dnnl_primitive_attr_destroy");
    GJ_SYM(attr_set_scratchpad_mode, "dnnl_primitive_attr_set_scratchpad_mode");
    GJ_SYM(attr_set_post_ops, "dnnl_primitive_attr_set_post_ops");
    GJ_SYM(post_ops_create, "dnnl_post_ops_create");
    GJ_SYM(post_ops_destroy, "dnnl_post_ops_destroy");
    GJ_SYM(post_ops_append_sum, "dnnl_post_ops_append_sum");
    GJ_SYM(pd_create, "dnnl_primitive_desc_create");
    GJ_SYM(pd_destroy, "dnnl_primitive_desc_destroy");
    GJ_SYM(pd_query, "dnnl_primitive_desc_query");
    GJ_SYM(it_create, "dnnl_primitive_desc_iterator_create");
    GJ_SYM(it_next, "dnnl_primitive_desc_iterator_next");
    GJ_SYM(it_fetch, "dnnl_primitive_desc_iterator_fetch");
    GJ_SYM(it_destroy, "dnnl_primitive_desc_iterator_destroy");
    GJ_SYM(pd_query_md, "dnnl_primitive_desc_query_md");
    GJ_SYM(prim_create, "dnnl_primitive_create");
    GJ_SYM(prim_destroy, "dnnl_primitive_destroy");
    GJ_SYM(prim_execute, "dnnl_primitive_execute");
    GJ_SYM(memory_create, "dnnl_memory_create");
    GJ_SYM(memory_destroy, "dnnl_memory_destroy");
#undef GJ_SYM
    const dnnl_version_t *v = D.version();
    const char *rt = v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP"
                     : v->cpu_runtime == DNNL_RUNTIME_SEQ ? "sequential"
                                                          : NULL;
    if (!rt || v->major != DNNL_VERSION_MAJOR) {
        snprintf(g_dnnl_error, sizeof g_dnnl_error,
                 "oneDNN %d.%d.%d (CPU runtime %u) not usable: gradjit needs major version %d "
                 "threaded by OpenMP or sequential",
                 v->major, v->minor, v->patch, v->cpu_runtime, DNNL_VERSION_MAJOR);
        goto fail;
    }
    if (v->cpu_runtime == DNNL_RUNTIME_OMP) {
        /* libgomp, a dependency of libdnnl: found through its handle */
        *(void **)(&D.omp_get_max_threads) = dlsym(h, "omp_get_max_threads");
        *(void **)(&D.omp_set_num_threads) = dlsym(h, "omp_set_num_threads");
        if (!D.omp_get_max_threads || !D.omp_set_num_threads) {
            snprintf(g_dnnl_error, sizeof g_dnnl_error,
                     "oneDNN uses OpenMP but omp_set_num_threads was not found");
            goto fail;
        }
    }
    if (D.engine_create(&g_engine, dnnl_cpu, 0) != dnnl_success) {
        snprintf(g_dnnl_error, sizeof g_dnnl_error, "oneDNN: cannot create a CPU engine");
        goto fail;
    }
    if (pthread_key_create(&g_ctx_key, ctx_free) != 0) {
        D.engine_destroy(g_engine);
        snprintf(g_dnnl_error, sizeof g_dnnl_error, "oneDNN: no thread key");
        goto fail;
    }
    pthread_atfork(NULL, NULL, child_after_fork);
    snprintf(g_dnnl_version, sizeof g_dnnl_version, "%d.%d.%d (%s)", v->major, v->minor,
             v->patch, rt);
    atomic_store(&g_dnnl_ok, true);
    return; /* the library stays loaded until exit */
fail:
    memset(&D, 0, sizeof D);
    dlclose(h);
}

bool gj_rt_onednn_ready(void) {
    if (atomic_load(&g_simulate_missing))
        return false;
    pthread_once(&g_load_once, dnnl_load);
    return atomic_load(&g_dnnl_ok);
}

/* The calling thread's OpenMP thread count is set to 1 while oneDNN runs
 * (see the invariants) and restored afterwards. */
static int omp_enter(void) {
    if (!D.omp_get_max_threads)
        return 0;
    int n = D.omp_get_max_threads();
    if (n != 1)
        D.omp_set_num_threads(1);
    return n;
}

static void omp_leave(int n) {
    if (D.omp_set_num_threads && n > 1)
        D.omp_set_num_threads(n);
}

static thread_ctx *ctx_get(size_t scratch) {
    thread_ctx *t = pthread_getspecific(g_ctx_key);
    if (!t) {
        t = gj_rt_calloc(1, sizeof *t);
        if (!t)
            return NULL;
        if (D.stream_create(&t->stream, g_engine, dnnl_stream_default_flags) != dnnl_success ||
            pthread_setspecific(g_ctx_key, t) != 0) {
            ctx_free(t);
            return NULL;
        }
    }
    if (scratch > t->scratch_cap) {
        size_t cap = (scratch + 4095) & ~(size_t)4095;
        void *p = gj_rt_malloc_aligned(64, cap);
        if (!p)
            return NULL;
        gj_rt_free(t->scratch);
        t->scratch = p;
        t->scratch_cap = cap;
    }
    return t;
}

/* A row block of a bf16 GEMM with A transposed is a column slice of the
 * stored [K, lda] matrix: strided, which oneDNN's brgemm (AMX) refuses.
 * Copies it into the calling thread's dense [K, M] buffer (K M bf16, a
 * fraction of the block's K M N products): the block's A then, with lda
 * M. NULL (the block stays as it is) when there is no memory. */
static const uint16_t *pack_a(const gj_rt_gemm_call *c, int64_t M, const void *A) {
    thread_ctx *t = ctx_get(0);
    size_t n = (size_t)c->K * (size_t)M;
    if (!t)
        return NULL;
    if (n > t->pack_cap) {
        uint16_t *p = gj_rt_malloc_aligned(64, n * 2);
        if (!p)
            return NULL;
        gj_rt_free(t->pack);
        t->pack = p;
        t->pack_cap = n;
    }
    for (int64_t k = 0; k < c->K; k++)
        memcpy(t->pack + k * M, (const uint16_t *)A + k * c->lda, (size_t)M * 2);
    return t->pack;
}

/* Memory descriptors of the key's row-major A (op(A) M x K), B (K x N), C. */
static bool key_mds(const gj_gemm_key *k, dnnl_memory_desc_t *a, dnnl_memory_desc_t *b,
                    dnnl_memory_desc_t *c) {
    dnnl_dims_t ad = {k->M, k->K}, bd = {k->K, k->N}, cd = {k->M, k->N};
    dnnl_dims_t as = {k->ta ? 1 : k->lda, k->ta ? k->lda : 1};
    dnnl_dims_t bs = {k->tb ? 1 : k->ldb, k->tb ? k->ldb : 1};
    dnnl_dims_t cs = {k->ldc, 1};
    dnnl_data_type_t ab = k->bf16 ? dnnl_bf16 : dnnl_f32;
    return D.md_init_by_strides(a, 2, ad, ab, as) == dnnl_success &&
           D.md_init_by_strides(b, 2, bd, ab, bs) == dnnl_success &&
           D.md_init_by_strides(c, 2, cd, dnnl_f32, cs) == dnnl_success;
}

/* Creates the primitive of k (single-threaded, user scratchpad, a sum
 * post-op for beta == 1). NULL if oneDNN refuses it. */
static dnnl_primitive_t prim_make(const gj_gemm_key *k, size_t *scratch, char *impl, size_t impl_cap) {
    dnnl_memory_desc_t a, b, c;
    dnnl_matmul_desc_t md;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t p = NULL;
    int omp = omp_enter();
    if (!key_mds(k, &a, &b, &c) || D.matmul_desc_init(&md, &a, &b, NULL, &c) != dnnl_success ||
        D.attr_create(&attr) != dnnl_success ||
        D.attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) != dnnl_success)
        goto done;
    if (k->beta1 && (D.post_ops_create(&po) != dnnl_success ||
                     D.post_ops_append_sum(po, 1.0f) != dnnl_success ||
                     D.attr_set_post_ops(attr, po) != dnnl_success))
        goto done;
    /* f32: the first GEMM-based implementation ("gemm:jit") if there is
     * one, else oneDNN's first choice: see GJ_RT_GEMM_PREFER_GEMM. bf16:
     * oneDNN's first choice (its brgemm kernels: AMX or AVX512_BF16). */
    dnnl_primitive_desc_iterator_t it = NULL;
    if (D.it_create(&it, &md, attr, g_engine, NULL) != dnnl_success)
        goto done;
    const char *want = k->bf16 ? "brg:" : "gemm:";
    for (int i = 0; (GJ_RT_GEMM_PREFER_GEMM || k->bf16) && i < 64; i++) {
        dnnl_primitive_desc_t cand = D.it_fetch(it);
        const char *name = NULL;
        if (cand && D.pd_query(cand, dnnl_query_impl_info_str, 0, &name) == dnnl_success &&
            name && strncmp(name, want, strlen(want)) == 0) {
            pd = cand;
            break;
        }
        if (cand)
            D.pd_destroy(cand);
        if (D.it_next(it) != dnnl_success)
            break;
    }
    D.it_destroy(it);
    if (!pd && D.pd_create(&pd, &md, attr, g_engine, NULL) != dnnl_success) {
        pd = NULL;
        goto done;
    }
    const char *iname = NULL;
    if (D.pd_query(pd, dnnl_query_impl_info_str, 0, &iname) != dnnl_success || !iname)
        iname = "?";
    snprintf(impl, impl_cap, "%s", iname);
    if (strncmp(iname, "ref", 3) == 0) /* a reference loop: slower than converting */
        goto done;
    const dnnl_memory_desc_t *sm = D.pd_query_md(pd, dnnl_query_scratchpad_md, 0);
    *scratch = sm ? D.md_get_size(sm) : 0;
    if (D.prim_create(&p, pd) != dnnl_success)
        p = NULL;
done:
    if (pd)
        D.pd_destroy(pd);
    if (po)
        D.post_ops_destroy(po);
    if (attr)
        D.attr_destroy(attr);
    omp_leave(omp);
    return p;
}

/* Every asynchronous signal is blocked on the calling thread while a
 * generated kernel runs (see "Signals" above); a signal that arrives meanwhile
 * is delivered when the mask is restored, on the thread's own stack. Faults
 * (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP) stay deliverable. */
static void signals_block(sigset_t *old) {
    sigset_t all;
    sigfillset(&all);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGTRAP);
    pthread_sigmask(SIG_BLOCK, &all, old);
}

/* Runs primitive p of key k on the given operands on the calling thread.
 * true on success. */
static bool prim_run(dnnl_primitive_t p, size_t scratch, const gj_gemm_key *k, const void *A,
                     const void *B, float *C) {
    thread_ctx *t = ctx_get(scratch);
    if (!t)
        return false;
    dnnl_memory_desc_t a, b, c, s;
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, ms = NULL;
    dnnl_exec_arg_t args[4];
    int n = 0;
    bool ok = false;
    int omp = omp_enter();
    if (!key_mds(k, &a, &b, &c) ||
        D.memory_create(&ma, &a, g_engine, (void *)(uintptr_t)A) != dnnl_success ||
        D.memory_create(&mb, &b, g_engine, (void *)(uintptr_t)B) != dnnl_success ||
        D.memory_create(&mc, &c, g_engine, C) != dnnl_success)
        goto done;
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, ma};
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, mb};
    args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DST, mc};
    if (scratch > 0) {
        dnnl_dims_t sd = {(dnnl_dim_t)scratch};
        if (D.md_init_by_tag(&s, 1, sd, dnnl_u8, dnnl_a) != dnnl_success ||
            D.memory_create(&ms, &s, g_engine, t->scratch) != dnnl_success)
            goto done;
        args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, ms};
    }
    sigset_t old;
    signals_block(&old);
    ok = D.prim_execute(p, t->stream, n, args) == dnnl_success;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
done:
    if (ms)
        D.memory_destroy(ms);
    if (mc)
        D.memory_destroy(mc);
    if (mb)
        D.memory_destroy(mb);
    if (ma)
        D.memory_destroy(ma);
    omp_leave(omp);
    return ok;
}

/* ------------------------------------------------------ the primitives */

typedef struct prim_entry {
    gj_gemm_node node;    /* a KIND_BLOCK key */
    atomic_bool refused;  /* oneDNN cannot create (or failed to run) it */
    _Atomic(void *) prim; /* dnnl_primitive_t, created once */
    size_t scratch;       /* scratchpad bytes of prim */
    char impl[24];        /* oneDNN's implementation ("gemm:jit") */
} prim_entry;

static gj_gemm_table g_prims;

static void prim_entry_free(gj_gemm_node *n) {
    prim_entry *e = (prim_entry *)n;
    void *p = atomic_load(&e->prim);
    if (p)
        D.prim_destroy(p);
    gj_rt_free(e);
}

void gj_rt_onednn_reset(void) {
    pthread_mutex_lock(&g_lock);
    gj_gemm_clear(&g_prims, prim_entry_free);
    atomic_store(&g_n_refused, 0);
    pthread_mutex_unlock(&g_lock);
}

static void at_exit(void) {
    gj_rt_onednn_reset();
    thread_ctx *t = pthread_getspecific(g_ctx_key);
    pthread_setspecific(g_ctx_key, NULL);
    ctx_free(t);
}

/* The entry of block key bk with its primitive made (or refused); NULL
 * when out of memory. */
static prim_entry *prim_for(const gj_gemm_key *bk) {
    uint64_t h = gj_gemm_key_hash(bk);
    prim_entry *e = (prim_entry *)gj_gemm_find(&g_prims, bk, h);
    if (e && (atomic_load_explicit(&e->prim, memory_order_acquire) || atomic_load(&e->refused)))
        return e;
    pthread_mutex_lock(&g_lock);
    e = (prim_entry *)gj_gemm_find(&g_prims, bk, h);
    if (!e && (e = gj_rt_calloc(1, sizeof *e)) != NULL) {
        e->node.key = *bk;
        e->node.hash = h;
        gj_gemm_publish(&g_prims, &e->node);
    }
    if (e && !atomic_load(&e->prim) && !atomic_load(&e->refused)) {
        dnnl_primitive_t p = prim_make(bk, &e->scratch, e->impl, sizeof e->impl);
        if (!p) {
            atomic_store(&e->refused, true);
            atomic_fetch_add(&g_n_refused, 1);
        } else {
            atomic_store_explicit(&e->prim, p, memory_order_release);
            /* registered after oneDNN made its first primitive (and
             * registered its own statics' destructors), so it runs first */
            if (!g_atexit_done) {
                g_atexit_done = true;
                atexit(at_exit);
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return e;
}

bool gj_rt_onednn_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                        const void *B, float *C) {
    if (c->f64 || c->alpha != 1.0 || (c->beta != 0.0 && c->beta != 1.0) || M <= 0 || N <= 0 ||
        c->K <= 0 || !gj_rt_onednn_ready())
        return false;
    int64_t lda = c->lda;
    if (c->bf16 && c->ta && lda != M) { /* a strided A block made dense, for brgemm */
        const uint16_t *pk = pack_a(c, M, A);
        if (pk) {
            A = pk;
            lda = M;
        }
    }
    gj_gemm_key bk = gj_gemm_block_key(c, M, N, lda);
    prim_entry *e = prim_for(&bk);
    dnnl_primitive_t p = e ? atomic_load_explicit(&e->prim, memory_order_acquire) : NULL;
    /* arguments are checked before anything is written: a failed run left
     * C as it was */
    if (!p || !prim_run(p, e->scratch, &bk, A, B, C))
        return false;
    return true;
}

void gj_rt_onednn_simulate_missing(bool on) { atomic_store(&g_simulate_missing, on); }

bool gj_rt_onednn_available(void) { return gj_rt_onednn_ready(); }

const char *gj_rt_onednn_version(void) {
    return gj_rt_onednn_ready() ? g_dnnl_version : "unavailable";
}

const char *gj_rt_onednn_why(void) {
    if (atomic_load(&g_simulate_missing))
        return "oneDNN is marked missing (test switch)";
    return gj_rt_onednn_ready() ? "" : g_dnnl_error;
}

int64_t gj_rt_onednn_refused(void) { return atomic_load(&g_n_refused); }

void gj_rt_onednn_dump(FILE *f) {
    pthread_mutex_lock(&g_lock);
    for (int b = 0; b < GJ_GEMM_BUCKETS; b++)
        for (gj_gemm_node *n = atomic_load(&g_prims.b[b]); n; n = n->next) {
            const prim_entry *e = (const prim_entry *)n;
            const gj_gemm_key *k = &n->key;
            fprintf(f, "block%s %c%c M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld beta=%d: "
                       "oneDNN primitive %s\n",
                    k->bf16 ? " bf16" : "", k->ta ? 'T' : 'N', k->tb ? 'T' : 'N', (long long)k->M,
                    (long long)k->N, (long long)k->K, (long long)k->lda, (long long)k->ldb,
                    (long long)k->ldc, k->beta1, atomic_load(&e->refused) ? "refused" : e->impl);
        }
    pthread_mutex_unlock(&g_lock);
}
