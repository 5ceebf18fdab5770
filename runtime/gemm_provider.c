/* SPDX-License-Identifier: MIT */
/*
 * gemm_provider.c - oneDNN's matmul primitive as a second GEMM provider
 * beside OpenBLAS, chosen per GEMM shape.
 *
 * Every f32 GEMM of gradjit, eager (gj_rt_sgemm) or compiled (the program
 * runs gj_rt_gemm_split_of's blocks itself), reaches gj_rt_gemm_block, and
 * each block is one single-threaded call. blas.c asks gj_rt_gemm_alt_block
 * first; it computes the block with oneDNN and returns true, or returns
 * false and the block goes to OpenBLAS as before.
 *
 * Invariants:
 *   - The auto choice is a function of the GEMM's key (transposes, M, N, K,
 *     the leading dimensions, beta 0 or 1: KIND_GEMM) and of the process-
 *     wide table, not of its blocks: the first block of the first call
 *     decides, every later block of that GEMM shape (eager or compiled, any
 *     thread, any thread count) finds the same answer. So one provider
 *     computes a given GEMM shape for the life of the process, eager and
 *     compiled stay bit-equal, and the thread count changes the bits only
 *     where the provider's own blocks do (OpenBLAS's sometimes, oneDNN's
 *     not: see GJ_RT_GEMM_PREFER_GEMM). Entries are never removed while the
 *     process runs (gj_rt_gemm_provider_reset is for tests, with no GEMM
 *     running).
 *   - Signals: oneDNN 2.x's generated f32 GEMM kernels point rsp into the
 *     heap while they run, so a signal delivered to a thread inside one
 *     (Ctrl-C, a profiler's timer) would write its frame into the heap and
 *     corrupt it (oneDNN issue 4845, fixed upstream in 2026; Debian 12
 *     ships 2.6.3). Every primitive therefore runs with the thread's
 *     asynchronous signals blocked (signals_block: two rt_sigprocmask calls
 *     per block, well under a microsecond); a signal that arrives meanwhile
 *     is delivered after the kernel, on the thread's own stack.
 *   - Settings. GJ_RT_GEMM_DEFAULT (GRADJIT_GEMM unset): f32 GEMMs as
 *     auto (below) where there is a cache directory to keep the measured
 *     choices in -- the first process to meet a shape on a machine decides
 *     it for every later one, so separate processes compute the same bits
 *     -- and OpenBLAS's where there is none (GRADJIT_CACHE_DIR=off: its bits
 *     then depend on no measurement); bf16 GEMMs oneDNN's where the CPU has
 *     AVX512_BF16 (oneDNN's brgemm kernels, with AMX where the CPU has it:
 *     several times OpenBLAS's f32 rate, which a bf16 GEMM otherwise gets
 *     after converting its operands), converted for OpenBLAS elsewhere (a
 *     rule of the CPU alone).
 *   - Setting GJ_RT_GEMM_AUTO (GRADJIT_GEMM=auto): a new GEMM
 *     (at least GJ_RT_GEMM_ALT_MIN multiply-adds, alpha == 1, beta 0 or 1,
 *     f32 or bf16) is measured once on the block being computed: 5-21 interleaved
 *     pairs of single-threaded runs of OpenBLAS and oneDNN (about 8 ms in
 *     all, more for a block that takes longer) on the block's own operands
 *     (A, B read; C written into a scratch copy); oneDNN must win the
 *     median pair by GJ_RT_GEMM_ALT_MARGIN. Smaller or other
 *     GEMMs are OpenBLAS's without a look-up. GJ_RT_GEMM_OPENBLAS never
 *     touches oneDNN (nor loads it); GJ_RT_GEMM_ONEDNN sends every f32 or bf16 GEMM
 *     with alpha == 1 and beta 0 or 1 that oneDNN accepts to oneDNN,
 *     without measuring.
 *   - Primitives are kept per block shape (KIND_BLOCK: the block's M, N
 *     and the GEMM's K and leading dimensions), made on first use (0.1-0.9
 *     ms each) and reused.
 *   - OpenBLAS is the fallback: oneDNN missing (built without it, or
 *     libdnnl.so.2 not loadable), a primitive it refuses to create, an
 *     execution error, or an allocation failure send the block to OpenBLAS
 *     (a refused block shape stays OpenBLAS's).
 *   - Threads: gradjit's pool is the only threading runtime. Debian's
 *     oneDNN threads through OpenMP (libgomp); every primitive is created
 *     and executed with the calling thread's OpenMP thread count set to 1
 *     (restored afterwards), so oneDNN runs inline on the pool thread that
 *     computes the block and libgomp never starts a thread. (Measured, see
 *     docs/performance.md section 7: one oneDNN call over the whole GEMM on
 *     two OpenMP threads took 1.3-2.1x as long as two blocks on the pool,
 *     and libgomp's spinning threads slowed the pool's next GEMM.)
 *   - Lookups are lock-free (published entries are immutable except for the
 *     atomic choice and primitive fields, which change only from "not yet"
 *     to a value); deciding, creating primitives and saving the file take
 *     g_lock. A thread that meets a GEMM while another thread measures it
 *     waits for that result, so even the first call of a shape is computed
 *     by one provider.
 *   - Memory: primitives live in the table until exit (an atexit handler
 *     destroys them and the table, and the calling thread's context); each
 *     thread that ran oneDNN has a context (stream, scratchpad) freed by a
 *     pthread key destructor when it exits. The engine and the library stay
 *     until the process ends.
 *   - Persistence: in auto mode the measured choices are saved to
 *     <cache dir>/gemm-<host hash>.gjg (the same directory as the program
 *     cache: GRADJIT_CACHE_DIR, else $XDG_CACHE_HOME/gradjit, else
 *     $HOME/.cache/gradjit; gj_rt_gemm_set_cache_dir overrides), keyed by
 *     a host id naming the CPU (cpuid brand, family, model, stepping, vector
 *     features), the library version, OpenBLAS's core and configuration and
 *     oneDNN's version. A measurement holds flock on the directory (waiting
 *     for it at most about 2 s, then measuring without it), reads
 *     the file first (a GEMM another process measured takes its choice) and
 *     writes the merged table back: the first process that measures a shape
 *     decides it for every later one on that machine, so separate processes
 *     compute the same bits. The file is read as distrustfully as the
 *     program cache: a directory and file owned by this user and not
 *     writable by group or others, a regular file opened without following
 *     a symlink or blocking, at most GJ_RT_GEMM_FILE_MAX bytes, its exact
 *     size, magic, host id and checksum checked and every record validated;
 *     anything else and the file is ignored (and rewritten by the next
 *     measurement). Written to a new temporary file (O_EXCL|O_NOFOLLOW,
 *     0600) renamed into place. A choice read from the file only picks one
 *     of the two correct providers.
 */
#define _GNU_SOURCE
#include "runtime/rt.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#ifdef GJ_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

/* GEMMs below this many multiply-adds stay with OpenBLAS in auto mode
 * without being measured (64x64x32: a few µs, where the call overheads
 * dominate). */
#define GJ_RT_GEMM_ALT_MIN ((int64_t)1 << 17)
/* oneDNN must be this much faster (the median of the measured pairs'
 * time ratios) to be chosen: a near tie keeps OpenBLAS. */
#define GJ_RT_GEMM_ALT_MARGIN 0.03
/* Which oneDNN implementation: 1 takes the GEMM-based one (gemm:jit)
 * wherever oneDNN offers it, 0 oneDNN's first choice (brg:avx512_core for
 * dense operands). A strided column block only has gemm:jit, a dense block
 * both; the two sum in different orders, so taking the same one everywhere
 * keeps a GEMM's bits from depending on how the thread count splits it. */
#ifndef GJ_RT_GEMM_PREFER_GEMM
#define GJ_RT_GEMM_PREFER_GEMM 1
#endif
/* Measuring budget per GEMM: enough pairs to fill about this many ns, at
 * least GJ_RT_GEMM_PAIRS_MIN and at most GJ_RT_GEMM_PAIRS_MAX. */
#define GJ_RT_GEMM_PROBE_NS 8e6
#define GJ_RT_GEMM_PAIRS_MIN 5
#define GJ_RT_GEMM_PAIRS_MAX 21
#define GJ_RT_GEMM_BUCKETS 1024
#define GJ_RT_GEMM_MAX_ENTRIES 16384 /* beyond: OpenBLAS, nothing recorded */
#define GJ_RT_GEMM_FILE_MAX ((off_t)4 << 20)

/* ------------------------------------------------------------ setting */

static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;
static atomic_int g_setting;      /* gj_rt_gemm_provider */
static atomic_bool g_simulate_missing;

/* ------------------------------------------------------------ the table */

/* A GEMM (KIND_GEMM: its auto choice) or one block of one (KIND_BLOCK: its
 * oneDNN primitive): row-major C[M,N] = op(A) op(B) + beta C, beta 0 or 1. */
typedef struct gemm_key {
    int64_t M, N, K, lda, ldb, ldc;
    uint8_t ta, tb, beta1, kind, bf16; /* bf16: A and B bf16, C f32 */
} gemm_key;

enum { KIND_GEMM = 0, KIND_BLOCK = 1 };

enum { CHOICE_NONE = 0, CHOICE_OPENBLAS = 1, CHOICE_ONEDNN = 2 };

typedef struct gemm_entry {
    struct gemm_entry *next; /* bucket chain; set before publication */
    gemm_key key;
    uint64_t hash;
    atomic_int choice;       /* KIND_GEMM: the auto mode's decision, CHOICE_* */
    atomic_bool refused;     /* KIND_BLOCK: oneDNN cannot create (or failed to run) it */
    _Atomic(void *) prim;    /* KIND_BLOCK: dnnl_primitive_t, created once */
    size_t scratch;          /* scratchpad bytes of prim */
    char impl[24];           /* oneDNN's implementation of prim ("gemm:jit") */
    float us_blas, us_dnnl;  /* medians of the measurement (0: not measured here) */
    bool saved;              /* in the file (loaded from it, or written) */
} gemm_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(gemm_entry *) g_buckets[GJ_RT_GEMM_BUCKETS];
static int g_entries; /* under g_lock */
static atomic_llong g_n_blas, g_n_dnnl, g_n_bf16, g_n_measured, g_n_loaded, g_n_refused;
static char *g_dir_override; /* gj_rt_gemm_set_cache_dir (malloc'd), under g_lock */
static int g_dir_mode = -1;  /* -1 environment, 0 off, 1 override */

static uint64_t key_hash(const gemm_key *k) {
    uint64_t h = 1469598103934665603ull;
    const int64_t v[11] = {k->M,  k->N,  k->K,     k->lda,  k->ldb, k->ldc,
                           k->ta, k->tb, k->beta1, k->kind, k->bf16};
    for (int i = 0; i < 11; i++) {
        h ^= (uint64_t)v[i];
        h *= 1099511628211ull;
        h ^= h >> 29;
    }
    return h;
}

static bool key_eq(const gemm_key *a, const gemm_key *b) {
    return a->M == b->M && a->N == b->N && a->K == b->K && a->lda == b->lda &&
           a->ldb == b->ldb && a->ldc == b->ldc && a->ta == b->ta && a->tb == b->tb &&
           a->beta1 == b->beta1 && a->kind == b->kind && a->bf16 == b->bf16;
}

static gemm_entry *lookup(const gemm_key *k, uint64_t h) {
    gemm_entry *e = atomic_load_explicit(&g_buckets[h % GJ_RT_GEMM_BUCKETS], memory_order_acquire);
    for (; e; e = e->next)
        if (e->hash == h && key_eq(&e->key, k))
            return e;
    return NULL;
}

/* Under g_lock: the entry of k, created (choice NONE) if missing; NULL when
 * the table is full or out of memory. */
__attribute__((unused)) static gemm_entry *lookup_or_add(const gemm_key *k, uint64_t h) {
    gemm_entry *e = lookup(k, h);
    if (e || g_entries >= GJ_RT_GEMM_MAX_ENTRIES)
        return e;
    e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->key = *k;
    e->hash = h;
    _Atomic(gemm_entry *) *b = &g_buckets[h % GJ_RT_GEMM_BUCKETS];
    e->next = atomic_load_explicit(b, memory_order_relaxed);
    atomic_store_explicit(b, e, memory_order_release);
    g_entries++;
    return e;
}

__attribute__((unused)) static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* ======================================================== with oneDNN */
#ifdef GJ_HAVE_DNNL

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
    free(t->scratch);
    free(t->pack);
    free(t);
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

static bool dnnl_ready(void) {
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
        t = calloc(1, sizeof *t);
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
        void *p = aligned_alloc(64, cap);
        if (!p)
            return NULL;
        free(t->scratch);
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
        uint16_t *p = aligned_alloc(64, (n * 2 + 63) & ~(size_t)63);
        if (!p)
            return NULL;
        free(t->pack);
        t->pack = p;
        t->pack_cap = n;
    }
    for (int64_t k = 0; k < c->K; k++)
        memcpy(t->pack + k * M, (const uint16_t *)A + k * c->lda, (size_t)M * 2);
    return t->pack;
}

/* Memory descriptors of the key's row-major A (op(A) M x K), B (K x N), C. */
static bool key_mds(const gemm_key *k, dnnl_memory_desc_t *a, dnnl_memory_desc_t *b,
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
static dnnl_primitive_t prim_make(const gemm_key *k, size_t *scratch, char *impl, size_t impl_cap) {
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
static bool prim_run(dnnl_primitive_t p, size_t scratch, const gemm_key *k, const void *A,
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

static void save_file(int dfd);
static void load_file(int dfd);
static void at_exit(void);
static const char *cache_dir(char *buf, size_t cap);
static int open_dir(const char *dir, bool create);

/* The single-threaded OpenBLAS call of key k (blas.c's block call; bf16
 * operands converted first). */
static void blas_run(const gemm_key *k, const void *A, const void *B, float *C) {
    if (k->bf16)
        gj_rt_bgemm_block_blas(k->ta, k->tb, k->M, k->N, k->K, A, k->lda, B, k->ldb,
                               k->beta1 ? 1.0f : 0.0f, C, k->ldc);
    else
        gj_rt_sgemm_block_blas(k->ta, k->tb, k->M, k->N, k->K, A, k->lda, B, k->ldb,
                               k->beta1 ? 1.0f : 0.0f, C, k->ldc);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* GRADJIT_LOG has the word "gemm": each auto decision on stderr. */
static bool log_gemm(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("GRADJIT_LOG");
        int v = 0;
        while (e && *e) {
            size_t n = strcspn(e, ", ");
            v |= (n == 4 && strncasecmp(e, "gemm", 4) == 0) || (n == 3 && strncasecmp(e, "all", 3) == 0);
            e += n;
            e += strspn(e, ", ");
        }
        on = v;
    }
    return on;
}

/* Under g_lock: measures the GEMM of decision entry d on its block (the
 * block's entry pe holds the primitive) with the block's own A and B,
 * writing into a scratch C; sets d->choice. */
static void measure(gemm_entry *d, gemm_entry *pe, const void *A, const void *B,
                    const float *C) {
    const gemm_key *k = &pe->key;
    size_t cn = (size_t)((k->M - 1) * k->ldc + k->N);
    float *Cs = aligned_alloc(64, ((cn * sizeof(float)) + 63) & ~(size_t)63);
    if (!Cs) { /* keep OpenBLAS (not saved: another process may measure it) */
        atomic_store(&d->choice, CHOICE_OPENBLAS);
        return;
    }
    for (int64_t i = 0; i < k->M; i++) /* beta == 1 reads C: start from its values */
        memcpy(Cs + i * k->ldc, C + i * k->ldc, (size_t)k->N * sizeof(float));
    dnnl_primitive_t p = atomic_load(&pe->prim);
    double tb[GJ_RT_GEMM_PAIRS_MAX], td[GJ_RT_GEMM_PAIRS_MAX];
    double t0 = now_ns();
    blas_run(k, A, B, Cs); /* warm-up: page faults, oneDNN's first run */
    double t1 = now_ns();
    bool ok = prim_run(p, pe->scratch, k, A, B, Cs);
    double t2 = now_ns();
    int pairs = 0;
    if (ok) {
        double per = (t1 - t0) + (t2 - t1);
        pairs = per > 0 ? (int)(GJ_RT_GEMM_PROBE_NS / per) : GJ_RT_GEMM_PAIRS_MAX;
        if (pairs < GJ_RT_GEMM_PAIRS_MIN)
            pairs = GJ_RT_GEMM_PAIRS_MIN;
        if (pairs > GJ_RT_GEMM_PAIRS_MAX)
            pairs = GJ_RT_GEMM_PAIRS_MAX;
        pairs |= 1; /* odd: a true median */
        if (pairs > GJ_RT_GEMM_PAIRS_MAX)
            pairs -= 2;
    }
    for (int r = 0; ok && r < pairs; r++) {
        for (int w = 0; w < 2; w++) { /* alternate which goes first */
            bool dnnl = (w == 0) == (r % 2 == 1);
            double s = now_ns();
            if (dnnl)
                ok = ok && prim_run(p, pe->scratch, k, A, B, Cs);
            else
                blas_run(k, A, B, Cs);
            (dnnl ? td : tb)[r] = now_ns() - s;
        }
    }
    free(Cs);
    if (!ok) {
        atomic_store(&pe->refused, true);
        atomic_fetch_add(&g_n_refused, 1);
        atomic_store(&d->choice, CHOICE_OPENBLAS);
        return;
    }
    /* the median of the pairs' ratios: the two runs of a pair share the
     * machine's load of that moment, so another job slowing some of them
     * moves single times far more than ratios */
    double ratio[GJ_RT_GEMM_PAIRS_MAX];
    for (int r = 0; r < pairs; r++)
        ratio[r] = td[r] / tb[r];
    qsort(ratio, (size_t)pairs, sizeof ratio[0], cmp_double);
    qsort(tb, (size_t)pairs, sizeof tb[0], cmp_double);
    qsort(td, (size_t)pairs, sizeof td[0], cmp_double);
    d->us_blas = (float)(tb[pairs / 2] * 1e-3);
    d->us_dnnl = (float)(td[pairs / 2] * 1e-3);
    atomic_fetch_add(&g_n_measured, 1);
    atomic_store(&d->choice, ratio[pairs / 2] < 1.0 - GJ_RT_GEMM_ALT_MARGIN ? CHOICE_ONEDNN
                                                                            : CHOICE_OPENBLAS);
    if (log_gemm())
        fprintf(stderr, "[gradjit gemm] %s%c%c M=%lld N=%lld K=%lld beta=%d: %s (openblas %.1f "
                        "us, onednn %.1f us on a block of %lld rows, %s)\n",
                k->bf16 ? "bf16 " : "", k->ta ? 'T' : 'N', k->tb ? 'T' : 'N', (long long)d->key.M,
                (long long)d->key.N, (long long)d->key.K, k->beta1,
                atomic_load(&d->choice) == CHOICE_ONEDNN ? "onednn" : "openblas",
                (double)d->us_blas, (double)d->us_dnnl, (long long)k->M, pe->impl);
}

/* Under g_lock: makes primitive entry e's primitive if it has none and is
 * not refused. */
static dnnl_primitive_t ensure_prim(gemm_entry *e) {
    dnnl_primitive_t p = atomic_load(&e->prim);
    if (p || atomic_load(&e->refused))
        return p;
    p = prim_make(&e->key, &e->scratch, e->impl, sizeof e->impl);
    if (!p) {
        atomic_store(&e->refused, true);
        atomic_fetch_add(&g_n_refused, 1);
        return NULL;
    }
    atomic_store(&e->prim, p);
    /* registered after oneDNN made its first primitive (and registered its
     * own lazily built statics' destructors), so it runs before them */
    if (!g_atexit_done) {
        g_atexit_done = true;
        atexit(at_exit);
    }
    return p;
}

/* Under g_lock: measures d with the other processes of this user kept out
 * (flock on the cache directory): the file is read first, and a GEMM some
 * other process measured meanwhile takes that process's choice, so that
 * the first measurement of a shape on a machine decides it for every later
 * process (their bits agree). Then the merged table is written back. */
static void measure_shared(gemm_entry *d, gemm_entry *pe, const void *A, const void *B,
                           const float *C) {
    char buf[4096];
    const char *dir = cache_dir(buf, sizeof buf);
    int dfd = dir ? open_dir(dir, true) : -1;
    /* at most about 2 s of waiting: a process stopped while it holds the
     * lock must not stop this one's GEMMs (it measures unlocked instead) */
    bool locked = false;
    for (int i = 0; dfd >= 0 && i < 2000 && !locked; i++) {
        locked = flock(dfd, LOCK_EX | LOCK_NB) == 0;
        if (!locked && errno != EWOULDBLOCK && errno != EINTR)
            break;
        if (!locked)
            nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    if (dfd >= 0)
        load_file(dfd);
    if (atomic_load(&d->choice) == CHOICE_NONE) {
        measure(d, pe, A, B, C);
        if (dfd >= 0 && d->us_blas > 0)
            save_file(dfd);
    }
    if (locked)
        flock(dfd, LOCK_UN);
    if (dfd >= 0)
        close(dfd);
}

/* The primitive of block key bk, made on first use; NULL if oneDNN refuses
 * it (or out of memory). */
static dnnl_primitive_t block_prim(const gemm_key *bk, size_t *scratch) {
    uint64_t h = key_hash(bk);
    gemm_entry *e = lookup(bk, h);
    dnnl_primitive_t p = e ? atomic_load_explicit(&e->prim, memory_order_acquire) : NULL;
    if (!p && !(e && atomic_load(&e->refused))) {
        pthread_mutex_lock(&g_lock);
        e = lookup_or_add(bk, h);
        p = e ? ensure_prim(e) : NULL;
        pthread_mutex_unlock(&g_lock);
    }
    if (p)
        *scratch = e->scratch;
    return p;
}

/* The auto mode's choice for GEMM key gk, whose block bk (operands A, B, C)
 * this call computes: measured on that block the first time (under
 * g_lock; a thread that arrives meanwhile waits for the result). */
static int auto_choice(const gemm_key *gk, const gemm_key *bk, const void *A, const void *B,
                       const float *C) {
    uint64_t h = key_hash(gk);
    gemm_entry *d = lookup(gk, h);
    int c = d ? atomic_load_explicit(&d->choice, memory_order_acquire) : CHOICE_NONE;
    if (c != CHOICE_NONE)
        return c;
    pthread_mutex_lock(&g_lock);
    d = lookup_or_add(gk, h);
    if (!d) {
        c = CHOICE_OPENBLAS;
    } else if ((c = atomic_load(&d->choice)) == CHOICE_NONE) {
        gemm_entry *pe = lookup_or_add(bk, key_hash(bk));
        if (!pe || !ensure_prim(pe))
            atomic_store(&d->choice, CHOICE_OPENBLAS); /* refused: nothing to measure */
        else
            measure_shared(d, pe, A, B, C);
        c = atomic_load(&d->choice);
    }
    pthread_mutex_unlock(&g_lock);
    return c;
}

/* The default's f32 rule: measured per shape, as auto, where the choices
 * are kept in a cache directory (every process on the machine then takes
 * the first measurement, so they compute the same bits); OpenBLAS's where
 * there is none (GRADJIT_CACHE_DIR=off: each process would measure for
 * itself). -1: not known yet (gj_rt_gemm_set_cache_dir resets it). */
static atomic_int g_default_measures = -1;

static bool default_measures(void) {
    int v = atomic_load_explicit(&g_default_measures, memory_order_relaxed);
    if (v < 0) {
        char buf[4096];
        pthread_mutex_lock(&g_lock);
        v = cache_dir(buf, sizeof buf) != NULL;
        pthread_mutex_unlock(&g_lock);
        atomic_store(&g_default_measures, v);
    }
    return v != 0;
}

bool gj_rt_gemm_alt_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                          const void *B, float *C) {
    int setting = gj_rt_gemm_provider_setting();
    if (setting == GJ_RT_GEMM_OPENBLAS || c->f64 || c->alpha != 1.0 ||
        (c->beta != 0.0 && c->beta != 1.0) || M <= 0 || N <= 0 || c->K <= 0)
        goto blas;
    /* the default: bf16 goes to oneDNN where the CPU multiplies bf16
     * itself; f32 is measured per shape where the choices are kept */
    bool measured = setting == GJ_RT_GEMM_AUTO;
    if (setting == GJ_RT_GEMM_DEFAULT) {
        if (c->bf16 ? !gj_rt_cpu_native_bf16() : !default_measures())
            goto blas;
        measured = !c->bf16;
    }
    if (measured && (double)c->M * (double)c->N * (double)c->K < (double)GJ_RT_GEMM_ALT_MIN)
        goto blas;
    if (!dnnl_ready())
        goto blas;
    bool beta1 = c->beta == 1.0;
    int64_t lda = c->lda;
    if (c->bf16 && c->ta && lda != M) { /* a strided A block made dense, for AMX */
        const uint16_t *pk = pack_a(c, M, A);
        if (pk) {
            A = pk;
            lda = M;
        }
    }
    gemm_key bk = {M, N, c->K, lda, c->ldb, c->ldc, c->ta, c->tb, beta1, KIND_BLOCK, c->bf16};
    if (measured) {
        gemm_key gk = {c->M,   c->N,   c->K, c->lda,    c->ldb, c->ldc,
                       c->ta,  c->tb,  beta1, KIND_GEMM, c->bf16};
        if (auto_choice(&gk, &bk, A, B, C) != CHOICE_ONEDNN)
            goto blas;
    }
    size_t scratch = 0;
    dnnl_primitive_t p = block_prim(&bk, &scratch);
    /* no primitive (refused) or an execution error (arguments are checked
     * before anything is written) or no memory for the thread's context:
     * this block goes to OpenBLAS */
    if (!p || !prim_run(p, scratch, &bk, A, B, C))
        goto blas;
    atomic_fetch_add_explicit(&g_n_dnnl, 1, memory_order_relaxed);
    if (c->bf16)
        atomic_fetch_add_explicit(&g_n_bf16, 1, memory_order_relaxed);
    return true;
blas:
    atomic_fetch_add_explicit(&g_n_blas, 1, memory_order_relaxed);
    if (c->bf16)
        atomic_fetch_add_explicit(&g_n_bf16, 1, memory_order_relaxed);
    return false;
}

bool gj_rt_onednn_available(void) { return dnnl_ready(); }

const char *gj_rt_onednn_version(void) { return dnnl_ready() ? g_dnnl_version : "unavailable"; }

static const char *dnnl_why(void) {
    if (atomic_load(&g_simulate_missing))
        return "oneDNN is marked missing (test switch)";
    return g_dnnl_error;
}

static void destroy_prim(void *p) {
    if (p)
        D.prim_destroy(p);
}

static const char *entry_impl(const gemm_entry *e) { return e->impl; }

static void at_exit(void) {
    gj_rt_gemm_provider_reset();
    if (atomic_load(&g_dnnl_ok)) {
        thread_ctx *t = pthread_getspecific(g_ctx_key);
        pthread_setspecific(g_ctx_key, NULL);
        ctx_free(t);
    }
}

#else /* ======================================== built without oneDNN */

bool gj_rt_gemm_alt_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                          const void *B, float *C) {
    (void)M, (void)N, (void)A, (void)B, (void)C;
    atomic_fetch_add_explicit(&g_n_blas, 1, memory_order_relaxed);
    if (c->bf16)
        atomic_fetch_add_explicit(&g_n_bf16, 1, memory_order_relaxed);
    return false;
}

bool gj_rt_onednn_available(void) { return false; }

const char *gj_rt_onednn_version(void) { return "unavailable"; }

static const char *dnnl_why(void) { return "gradjit was built without oneDNN (libdnnl-dev)"; }

static void destroy_prim(void *p) { (void)p; }

static const char *entry_impl(const gemm_entry *e) {
    (void)e;
    return "";
}

#endif /* GJ_HAVE_DNNL */

/* ------------------------------------------------------- the setting */

static void env_read(void) {
    const char *v = getenv("GRADJIT_GEMM");
    int s = GJ_RT_GEMM_DEFAULT; /* see the file comment, "Signals" */
    if (v && *v) {
        if (strcasecmp(v, "default") == 0)
            s = GJ_RT_GEMM_DEFAULT;
        else if (strcasecmp(v, "openblas") == 0)
            s = GJ_RT_GEMM_OPENBLAS;
        else if (strcasecmp(v, "onednn") == 0)
            s = GJ_RT_GEMM_ONEDNN;
        else if (strcasecmp(v, "auto") == 0)
            s = GJ_RT_GEMM_AUTO;
        else
            fprintf(stderr,
                    "gradjit: GRADJIT_GEMM='%s' is not default, openblas, onednn or auto: using "
                    "the default\n",
                    v);
    }
    if (s == GJ_RT_GEMM_ONEDNN && !gj_rt_onednn_available()) {
        fprintf(stderr, "gradjit: GRADJIT_GEMM=onednn: %s: using OpenBLAS\n", dnnl_why());
        s = GJ_RT_GEMM_OPENBLAS;
    }
    atomic_store(&g_setting, s);
}

int gj_rt_gemm_provider_setting(void) {
    pthread_once(&g_env_once, env_read);
    return atomic_load_explicit(&g_setting, memory_order_relaxed);
}

int gj_rt_set_gemm_provider(int p) {
    pthread_once(&g_env_once, env_read); /* the call wins over the environment */
    if (p != GJ_RT_GEMM_AUTO && p != GJ_RT_GEMM_OPENBLAS && p != GJ_RT_GEMM_ONEDNN &&
        p != GJ_RT_GEMM_DEFAULT) {
        gj_rt_set_error("gj_set_gemm_provider: %d is not a provider (auto 0, openblas 1, onednn 2, "
                        "default 3)",
                        p);
        return -1;
    }
    if (p == GJ_RT_GEMM_ONEDNN && !gj_rt_onednn_available()) {
        atomic_store(&g_setting, GJ_RT_GEMM_OPENBLAS);
        gj_rt_set_error("gj_set_gemm_provider: onednn: %s: OpenBLAS computes every GEMM", dnnl_why());
        return -1;
    }
    atomic_store(&g_setting, p);
    return 0;
}

const char *gj_rt_gemm_provider_name(int p) {
    return p == GJ_RT_GEMM_OPENBLAS ? "openblas"
           : p == GJ_RT_GEMM_ONEDNN ? "onednn"
           : p == GJ_RT_GEMM_DEFAULT ? "default"
                                      : "auto";
}

void gj_rt_gemm_simulate_no_onednn(bool on) {
    atomic_store(&g_simulate_missing, on);
    if (on && gj_rt_gemm_provider_setting() == GJ_RT_GEMM_ONEDNN)
        atomic_store(&g_setting, GJ_RT_GEMM_OPENBLAS);
}

int gj_rt_gemm_choice(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                      int64_t ldc, bool beta1, bool bf16) {
    gemm_key k = {M, N, K, lda, ldb, ldc, ta, tb, beta1, KIND_GEMM, bf16};
    gemm_entry *e = lookup(&k, key_hash(&k));
    if (!e)
        return CHOICE_NONE;
    return atomic_load(&e->choice);
}

void gj_rt_gemm_get_stats(gj_rt_gemm_stats *s) {
    s->openblas_blocks = atomic_load(&g_n_blas);
    s->onednn_blocks = atomic_load(&g_n_dnnl);
    s->bf16_blocks = atomic_load(&g_n_bf16);
    s->measured = atomic_load(&g_n_measured);
    s->loaded = atomic_load(&g_n_loaded);
    s->refused = atomic_load(&g_n_refused);
    pthread_mutex_lock(&g_lock);
    s->entries = g_entries;
    pthread_mutex_unlock(&g_lock);
}

void gj_rt_gemm_provider_reset(void) {
    pthread_mutex_lock(&g_lock);
    for (int b = 0; b < GJ_RT_GEMM_BUCKETS; b++) {
        gemm_entry *e = atomic_exchange(&g_buckets[b], NULL);
        while (e) {
            gemm_entry *n = e->next;
            destroy_prim(atomic_load(&e->prim));
            free(e);
            e = n;
        }
    }
    g_entries = 0;
    atomic_store(&g_n_blas, 0);
    atomic_store(&g_n_dnnl, 0);
    atomic_store(&g_n_bf16, 0);
    atomic_store(&g_n_measured, 0);
    atomic_store(&g_n_loaded, 0);
    atomic_store(&g_n_refused, 0);
    pthread_mutex_unlock(&g_lock);
}

void gj_rt_gemm_set_cache_dir(const char *dir) {
    atomic_store(&g_default_measures, -1);
    pthread_mutex_lock(&g_lock);
    free(g_dir_override);
    g_dir_override = NULL;
    g_dir_mode = -1;
    if (dir) {
        g_dir_mode = 0;
        if (*dir && (g_dir_override = strdup(dir)) != NULL)
            g_dir_mode = 1;
    }
    pthread_mutex_unlock(&g_lock);
}

void gj_rt_gemm_dump(FILE *f) {
    pthread_mutex_lock(&g_lock);
    for (int b = 0; b < GJ_RT_GEMM_BUCKETS; b++)
        for (gemm_entry *e = atomic_load(&g_buckets[b]); e; e = e->next) {
            const gemm_key *k = &e->key;
            int c = atomic_load(&e->choice);
            fprintf(f, "%s%s %c%c M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld beta=%d: ",
                    k->kind == KIND_GEMM ? "gemm" : "block", k->bf16 ? " bf16" : "",
                    k->ta ? 'T' : 'N', k->tb ? 'T' : 'N',
                    (long long)k->M, (long long)k->N, (long long)k->K, (long long)k->lda,
                    (long long)k->ldb, (long long)k->ldc, k->beta1);
            if (k->kind == KIND_GEMM && e->us_blas > 0)
                fprintf(f, "%s (openblas %.1f us, onednn %.1f us)\n",
                        c == CHOICE_ONEDNN ? "onednn" : "openblas", (double)e->us_blas,
                        (double)e->us_dnnl);
            else if (k->kind == KIND_GEMM)
                fprintf(f, "%s (%s)\n", c == CHOICE_ONEDNN ? "onednn" : c ? "openblas" : "-",
                        e->saved ? "from the file" : "not measured");
            else
                fprintf(f, "oneDNN primitive %s\n",
                        atomic_load(&e->refused) ? "refused" : entry_impl(e));
        }
    pthread_mutex_unlock(&g_lock);
}

/* ------------------------------------------------------- persistence */
#ifdef GJ_HAVE_DNNL

static const char g_magic[8] = {'G', 'J', 'G', 'E', 'M', 'M', '0', '1'};

/* One saved choice (native byte order: the host id pins the machine). */
typedef struct file_rec {
    int64_t M, N, K, lda, ldb, ldc;
    uint8_t ta, tb, beta1, choice;
    float us_blas, us_dnnl;
    uint8_t bf16, pad[3];
} file_rec;

static uint64_t fnv64(const void *p, size_t n, uint64_t h) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) {
        h ^= c[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* The host id: what makes a measurement valid only here. */
static void host_id(char *out, size_t cap) {
    char brand[49] = "";
    unsigned sig = 0;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    unsigned r[12], a, b, c, d;
    if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++)
            __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(brand, r, 48);
        brand[48] = '\0';
    }
    if (__get_cpuid(1, &a, &b, &c, &d))
        sig = a; /* family, model, stepping */
#endif
    gj_rt_cpu cpu;
    gj_rt_cpu_detect(&cpu);
    snprintf(out, cap,
             "gradjit %s; cpu %s; sig %08x; avx2 %d fma %d avx512 %d%d%d%d%d bf16 %d; openblas %s "
             "%s; onednn %s",
             GJ_VERSION_STRING, brand, sig, cpu.avx2, cpu.fma, cpu.avx512f, cpu.avx512bw,
             cpu.avx512vl, cpu.avx512dq, cpu.avx512cd, cpu.avx512bf16, gj_rt_blas_corename(),
             gj_rt_blas_config(), g_dnnl_version);
}

/* Under g_lock: the cache directory (borrowed until the lock is released),
 * or NULL for none: the program cache's rules (docs/guide.md section 7). */
static const char *cache_dir(char *buf, size_t cap) {
    if (g_dir_mode == 1)
        return g_dir_override;
    if (g_dir_mode == 0)
        return NULL;
    const char *e = getenv("GRADJIT_CACHE_DIR");
    if (e)
        return (*e && strcmp(e, "off") != 0) ? e : NULL;
    const char *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    int n;
    if (x && *x)
        n = snprintf(buf, cap, "%s/gradjit", x);
    else if (h && *h)
        n = snprintf(buf, cap, "%s/.cache/gradjit", h);
    else
        return NULL;
    return n > 0 && (size_t)n < cap ? buf : NULL; /* never a truncated path */
}

/* Whether st may be trusted: ours, not writable by group or others. */
static bool trusted(const struct stat *st) {
    return st->st_uid == geteuid() && !(st->st_mode & (S_IWGRP | S_IWOTH));
}

/* Opens dir one component at a time (creating missing ones 0700 when
 * create is true); -1 unless the last one is a directory we trust. */
static int open_dir(const char *dir, bool create) {
    char *copy = strdup(dir);
    if (!copy)
        return -1;
    int fd = open(dir[0] == '/' ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    for (char *c = copy; fd >= 0 && *c;) {
        size_t len = strcspn(c, "/");
        char *next = c + len + (c[len] == '/');
        c[len] = '\0';
        if (len > 0) {
            if (create)
                mkdirat(fd, c, 0700);
            int sub = openat(fd, c, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            close(fd);
            fd = sub;
        }
        c = next;
    }
    free(copy);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !trusted(&st))) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static void file_name(char out[40], const char *id) {
    snprintf(out, 40, "gemm-%016llx.gjg", (unsigned long long)fnv64(id, strlen(id), 1469598103934665603ull));
}

/* A record that could have come from gj_rt_gemm_alt_block's keys. */
static bool rec_ok(const file_rec *r) {
    if (r->ta > 1 || r->tb > 1 || r->beta1 > 1 || r->bf16 > 1 || r->pad[0] || r->pad[1] ||
        r->pad[2] ||
        (r->choice != CHOICE_OPENBLAS && r->choice != CHOICE_ONEDNN))
        return false;
    if (r->M < 1 || r->N < 1 || r->K < 1 || r->M > INT_MAX || r->N > INT_MAX || r->K > INT_MAX ||
        r->lda > INT_MAX || r->ldb > INT_MAX || r->ldc > INT_MAX)
        return false;
    int64_t acols = r->ta ? r->M : r->K, bcols = r->tb ? r->K : r->N;
    return r->lda >= acols && r->ldb >= bcols && r->ldc >= r->N &&
           isfinite(r->us_blas) && isfinite(r->us_dnnl);
}

/* Under g_lock: reads this host's file in directory dfd and adds its
 * choices for keys the table has not decided. The whole file or nothing. */
static void load_file(int dfd) {
    char id[768], name[40];
    host_id(id, sizeof id);
    file_name(name, id);
    int fd = openat(dfd, name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    unsigned char *data = NULL;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !trusted(&st) ||
        st.st_size > GJ_RT_GEMM_FILE_MAX || st.st_size < 8 + 4 + 4 + 8)
        goto done;
    size_t n = (size_t)st.st_size, got = 0;
    data = malloc(n);
    if (!data)
        goto done;
    while (got < n) {
        ssize_t r = read(fd, data + got, n - got);
        if (r <= 0)
            goto done;
        got += (size_t)r;
    }
    uint32_t idlen, count;
    uint64_t sum;
    memcpy(&sum, data + n - 8, 8);
    if (memcmp(data, g_magic, 8) != 0 || fnv64(data, n - 8, 1469598103934665603ull) != sum)
        goto done;
    memcpy(&idlen, data + 8, 4);
    if (idlen != strlen(id) || 12 + (size_t)idlen + 4 + 8 > n || memcmp(data + 12, id, idlen) != 0)
        goto done;
    memcpy(&count, data + 12 + idlen, 4);
    size_t off = 12 + (size_t)idlen + 4;
    if (count > GJ_RT_GEMM_MAX_ENTRIES || off + (size_t)count * sizeof(file_rec) + 8 != n)
        goto done;
    for (uint32_t i = 0; i < count; i++) {
        file_rec r;
        memcpy(&r, data + off + i * sizeof r, sizeof r);
        if (!rec_ok(&r))
            goto done;
    }
    for (uint32_t i = 0; i < count; i++) {
        file_rec r;
        memcpy(&r, data + off + i * sizeof r, sizeof r);
        gemm_key k = {r.M, r.N, r.K, r.lda, r.ldb, r.ldc, r.ta, r.tb, r.beta1, KIND_GEMM, r.bf16};
        gemm_entry *e = lookup_or_add(&k, key_hash(&k));
        if (!e || atomic_load(&e->choice) != CHOICE_NONE)
            continue; /* this process decided already */
        e->saved = true;
        atomic_store(&e->choice, (int)r.choice);
        atomic_fetch_add(&g_n_loaded, 1);
    }
done:
    free(data);
    close(fd);
}

/* Under g_lock: writes every decided, not refused entry to this host's file
 * in directory dfd (a new temporary file renamed over it). Failures are
 * silent: the choices are measured again by a later process. */
static void save_file(int dfd) {
    char id[768], name[40], tmp[48];
    host_id(id, sizeof id);
    file_name(name, id);
    uint32_t idlen = (uint32_t)strlen(id), count = 0;
    for (int b = 0; b < GJ_RT_GEMM_BUCKETS; b++)
        for (gemm_entry *e = atomic_load(&g_buckets[b]); e; e = e->next)
            count += e->key.kind == KIND_GEMM && atomic_load(&e->choice) != CHOICE_NONE;
    size_t n = 12 + idlen + 4 + (size_t)count * sizeof(file_rec) + 8, off = 0;
    unsigned char *data = malloc(n);
    if (!data)
        return;
    memcpy(data, g_magic, 8);
    memcpy(data + 8, &idlen, 4);
    memcpy(data + 12, id, idlen);
    memcpy(data + 12 + idlen, &count, 4);
    off = 12 + idlen + 4;
    for (int b = 0; b < GJ_RT_GEMM_BUCKETS; b++)
        for (gemm_entry *e = atomic_load(&g_buckets[b]); e; e = e->next) {
            if (e->key.kind != KIND_GEMM || atomic_load(&e->choice) == CHOICE_NONE)
                continue;
            const gemm_key *k = &e->key;
            file_rec r = {k->M, k->N, k->K, k->lda, k->ldb, k->ldc, k->ta, k->tb, k->beta1,
                          (uint8_t)atomic_load(&e->choice), e->us_blas, e->us_dnnl, k->bf16, {0}};
            memcpy(data + off, &r, sizeof r);
            off += sizeof r;
            e->saved = true;
        }
    uint64_t sum = fnv64(data, off, 1469598103934665603ull);
    memcpy(data + off, &sum, 8);
    int fd = -1;
    for (int attempt = 0; attempt < 8 && fd < 0; attempt++) {
        uint64_t r = (uint64_t)now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)attempt * 0x9e3779b97f4a7c15ull;
        snprintf(tmp, sizeof tmp, ".gjg-%016llx", (unsigned long long)r);
        fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    if (fd < 0)
        goto done;
    bool ok = true;
    for (size_t w = 0; ok && w < n;) {
        ssize_t r = write(fd, data + w, n - w);
        ok = r > 0;
        w += ok ? (size_t)r : 0;
    }
    ok = close(fd) == 0 && ok;
    if (!ok || renameat(dfd, tmp, dfd, name) != 0)
        unlinkat(dfd, tmp, 0);
done:
    free(data);
}

#endif /* GJ_HAVE_DNNL */
