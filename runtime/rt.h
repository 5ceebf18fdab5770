/* SPDX-License-Identifier: MIT */
/*
 * rt.h - the runtime layer: storage, tensors, the allocator, errors, the
 * thread pool, BLAS, and the eager kernels of every primitive.
 *
 * Invariants:
 *   - A tensor is a strided view of a reference-counted storage: element
 *     (i0..in) lives at storage->data + (offset + sum ik*strides[k]) * elsize.
 *     Strides are in elements and may be 0 (broadcast) but never negative.
 *   - Every storage byte comes from gj_rt_alloc_data (64-byte aligned), which
 *     keeps the live/peak counters exact; every other allocation of the
 *     library goes through gj_rt_malloc/gj_rt_calloc/gj_rt_free. Both paths
 *     count towards the test-only failure injection (gj_rt_alloc_fail_at).
 *   - The version counter lives on the storage: an in-place op on any view
 *     bumps it for every view of the same memory.
 *   - Nothing here knows about autograd: a tensor carries an opaque `ag`
 *     pointer that the autograd layer owns and frees through the callback
 *     registered with gj_rt_set_ag_free.
 */
#ifndef GJ_RT_H
#define GJ_RT_H

#include "gradjit.h"

#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

/* ------------------------------------------------------------ errors */

/* Set the thread-local message of gj_last_error() (printf format). */
void gj_rt_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The cause a NULL tensor argument cites (error.c explains the rule):
 * gj_rt_null_result: a public call is handing its caller NULL tensors
 * because of the current error (call it after the last gj_rt_set_error
 * of that failure); gj_rt_tensor_result: a public call handed out a
 * tensor (or a NULL that is no failure), so no earlier failure explains
 * a later NULL; gj_rt_null_cause: the message of the failure that the
 * NULL argument seen now comes from, or NULL if there is none. */
void gj_rt_null_result(void);
void gj_rt_tensor_result(void);
const char *gj_rt_null_cause(void);
/* Formats "[d0, d1, ...]" into buf (always NUL-terminated). Returns buf. */
char *gj_rt_fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape);
const char *gj_rt_dtype_name(gj_dtype dt);

/* ----------------------------------------------------------- allocator */

/* Metadata allocations (tensor structs, nodes, lists): NULL on failure
 * (and an error is set), counted by the failure injection only. */
void *gj_rt_malloc(size_t n);
void *gj_rt_calloc(size_t count, size_t n);
void *gj_rt_realloc(void *p, size_t n);
void gj_rt_free(void *p);
/* A metadata block aligned to align (a power of two, at least
 * sizeof(void *)), freed with gj_rt_free; NULL with an error on failure. */
void *gj_rt_malloc_aligned(size_t align, size_t n);
/* Tensor data: 64-byte aligned, counted in live/peak bytes. */
void *gj_rt_alloc_data(size_t nbytes);
void gj_rt_free_data(void *p, size_t nbytes);
/* alloc.c, memory that is known zero: gj_rt_alloc_data_zero returns
 * zeroed bytes, zero-filling only a block that is not new from the system
 * (a new one is zero, untouched); gj_rt_zero_fill zeroes p (large blocks on
 * the pool's threads) and counts it. gj_rt_zero_stats: bytes zero-filled,
 * bytes whose fill was skipped. */
void *gj_rt_alloc_data_zero(size_t nbytes);
void gj_rt_zero_fill(void *p, size_t nbytes);
void gj_rt_zero_stats(int64_t *zeroed, int64_t *skipped);
/* Test switch: the n-th allocation from now on (1 = the next) fails;
 * 0 disables. Returns how many allocations happened since the last call. */
int64_t gj_rt_alloc_fail_at(int64_t n);
int64_t gj_rt_alloc_count(void); /* every allocation made, both paths */

/* ----------------------------------------------------------- settings */

/* settings.c: the GRADJIT_* variables of the runtime, each read once on
 * first use (a value that does not parse is reported once and the default
 * used); the modules' setters win over them. */
int gj_rt_env_threads(void);         /* GRADJIT_NUM_THREADS; 0: one per core */
int64_t gj_rt_env_alloc_cache(void); /* GRADJIT_ALLOC_CACHE_MB in bytes; -1: default */
int64_t gj_rt_env_mem_limit(void);   /* GRADJIT_MEM_LIMIT_MB in bytes; 0: none */
int gj_rt_env_gemm(void);            /* GRADJIT_GEMM: a gj_rt_gemm_provider */
bool gj_rt_env_hugepages(void);      /* GRADJIT_HUGEPAGES (default on) */
/* The cache directory: GRADJIT_CACHE_DIR ("off": none), else
 * $XDG_CACHE_HOME/gradjit, else $HOME/.cache/gradjit; NULL for none. The
 * program cache (jit/) and the GEMM choices keep their files there. */
const char *gj_rt_env_cache_dir(void);
/* GRADJIT_LOG's words (the one parser of the library; "help" lists them). */
enum {
    GJ_RT_LOG_GRAPH = 1,
    GJ_RT_LOG_IR = 2,
    GJ_RT_LOG_CACHE = 4,
    GJ_RT_LOG_FALLBACK = 8,
    GJ_RT_LOG_PLAN = 16,
    GJ_RT_LOG_PROF = 32,
    GJ_RT_LOG_RECOMPILES = 64,
    GJ_RT_LOG_INSTRS = 128,
    GJ_RT_LOG_LEAKS = 256,
    GJ_RT_LOG_GEMM = 512,
    GJ_RT_LOG_ALL = 0x3ff,
};
unsigned gj_rt_log_flags(void);

/* -------------------------------------------------------------- files */

/* files.c: files written whole and read back distrustfully. Nothing here
 * sets the thread's error: failures are described in why[]. */
struct stat;
/* Whether st is owned by this user and not writable by group or others
 * (else why[] says which). */
bool gj_rt_file_trusted(const struct stat *st, char *why, size_t why_cap);
/* Directory dir opened one component at a time (missing ones created 0700
 * when create), if trusted: its descriptor; -2 when it is not trusted (why[]
 * says how: "owned by ...", "writable by ..."); -1 otherwise, with why[]
 * set (empty when it does not exist and create is false). */
int gj_rt_dir_open(const char *dir, bool create, char *why, size_t why_cap);
/* File name in directory dfd, read whole if it is a regular trusted file
 * of at most max bytes (opened without blocking or following a symlink):
 * 0 with *data (gj_rt_free it) and *len; 1 when it does not exist; -2
 * when it is not trusted and -1 when it cannot be read, with why[] set. */
int gj_rt_file_read(int dfd, const char *name, size_t max, unsigned char **data, size_t *len,
                    char *why, size_t why_cap);
/* Reads exactly n bytes from fd: 0, or -1 (error or end of file first). */
int gj_rt_read_all(int fd, void *buf, size_t n);
/* flock on directory dfd, waiting at most max_ms: whether it is held. */
bool gj_rt_dir_lock(int dfd, int max_ms);
void gj_rt_dir_unlock(int dfd);
/* 64 unpredictable bits (getrandom, else the clock, pid and a counter). */
uint64_t gj_rt_nonce64(void);
/* A file written under a fresh temporary name in its directory (dfd, or
 * name's own directory when dfd < 0; tmp_prefix + 16 hex digits, or
 * ".<name>.tmp-" + 16 hex when tmp_prefix is NULL), renamed over name when
 * complete: open, write..., close(ok). mode as open(2) takes it (0600 for
 * cache files). */
typedef struct gj_rt_sink {
    int fd, dfd;
    bool own_dfd;
    char name[208], tmp[232];
} gj_rt_sink;
int gj_rt_sink_open(gj_rt_sink *s, int dfd, const char *name, const char *tmp_prefix,
                    unsigned mode, char *why, size_t why_cap);
int gj_rt_sink_write(gj_rt_sink *s, const void *buf, size_t n, char *why, size_t why_cap);
/* ok: sync (when asked), close and rename; else (or if one of those
 * fails) the temporary file is removed. 0 or -1 (why[] set). */
int gj_rt_sink_close(gj_rt_sink *s, bool ok, bool sync, char *why, size_t why_cap);
/* The whole of a sink in one call. 0 or -1 (why[] set). */
int gj_rt_file_write(int dfd, const char *name, const char *tmp_prefix, unsigned mode,
                     const void *data, size_t n, bool sync, char *why, size_t why_cap);
/* "gradjit: <message>" on stderr unless this process printed it before. */
void gj_rt_warn_once(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ------------------------------------------------------------ storage */

typedef struct gj_rt_storage {
    atomic_long refcount;
    void *data;
    size_t nbytes;
    atomic_long version;
    bool external; /* data not owned (never freed) */
    /* Remote bytes (ZeRO stage 3's parameters, dist/): the owner's fetch
     * makes data present (it is NULL while released) and records the use;
     * NULL for every other storage. See gj_rt_storage_fetch. */
    int (*fetch)(void *owner, int id, uint64_t epoch);
    void *owner;
    int id;
} gj_rt_storage;

gj_rt_storage *gj_rt_storage_new(size_t nbytes); /* zero-filled; NULL on OOM */
void gj_rt_storage_retain(gj_rt_storage *s);
/* Makes t's bytes present if its storage is remote (a collective of the
 * owner's group when they are released: every rank reads the same remote
 * tensors in the same order). epoch names the operation reading them: an
 * owner never releases what the current epoch fetched. 0, or -1 with an
 * error. Non-remote storages: 0 at once. */
int gj_rt_storage_fetch(gj_rt_storage *s, uint64_t epoch);
/* A new remote storage of nbytes, refcount 1, released (no data): fetch
 * (owner, id, epoch) makes its bytes present. NULL with an error on OOM. */
gj_rt_storage *gj_rt_storage_new_remote(size_t nbytes,
                                        int (*fetch)(void *owner, int id, uint64_t epoch),
                                        void *owner, int id);
/* Abstract storage: nbytes without bytes (a remote storage whose fetch
 * fails with an error naming the abstract trace). A tensor over one is
 * abstract: its dtype, shape and strides are real, its values do not
 * exist. While gj_rt_set_abstract(true) holds on a thread, gj_rt_exec
 * makes abstract outputs for a primitive with an abstract input without
 * running it (the compiled step's abstract trace, frontend/step.c);
 * otherwise reading one is that error. */
gj_rt_storage *gj_rt_storage_new_abstract(size_t nbytes);
bool gj_rt_storage_is_abstract(const gj_rt_storage *s);
void gj_rt_set_abstract(bool on); /* this thread */
bool gj_rt_abstract(void);
/* A new epoch (one per eager primitive that reads remote tensors). */
uint64_t gj_rt_fetch_epoch(void);
void gj_rt_storage_release(gj_rt_storage *s);

/* ------------------------------------------------------------- tensor */

#define GJ_RT_TENSOR_MAGIC 0x676a5445u /* "gjTE" */
#define GJ_RT_TENSOR_DEAD 0xdeadbeefu

struct gj_tensor {
    uint32_t magic; /* GJ_RT_TENSOR_MAGIC while alive */
    atomic_long refcount;
    gj_dtype dtype;
    int ndim;
    int64_t shape[GJ_MAX_DIMS];
    int64_t strides[GJ_MAX_DIMS]; /* elements */
    int64_t offset;               /* elements */
    int64_t numel;
    gj_rt_storage *storage;
    void *ag;     /* autograd metadata, owned by autograd/ */
    void *scope;  /* the scope owning one reference, or NULL */
    int64_t scope_slot;
    /* References held by owners that lend the tensor out as borrowed
     * pointers (a leaf's .grad slot): the public gj_release refuses to
     * drop refcount to this level, since those references are not the
     * caller's to drop. Changed only through their owners. */
    atomic_int pinned;
    char *name;   /* gj_tensor_set_name (owned), or NULL; views do not inherit it */
};

/* " 'name'" for a named tensor (for messages), else "" (borrowed: t's own
 * string or a static empty one; valid while t is not renamed). */
const char *gj_rt_tensor_label(const gj_tensor *t, char *buf, size_t cap);

size_t gj_rt_dtype_size(gj_dtype dt);
bool gj_rt_dtype_is_float(gj_dtype dt);
bool gj_rt_dtype_valid(int dt);

/* Validate a user tensor pointer: non-NULL and alive. Sets an error naming
 * op and returns false otherwise. */
bool gj_rt_check_tensor(const gj_tensor *t, const char *op, const char *arg);
/* Validate a shape: 0 <= ndim <= GJ_MAX_DIMS, dims >= 0, numel*elsize no
 * overflow. Sets an error naming op. */
bool gj_rt_check_shape(int ndim, const int64_t *shape, gj_dtype dt, const char *op);

/* New contiguous tensor (refcount 1, data zeroed); NULL with error set. */
gj_tensor *gj_rt_tensor_new(gj_dtype dt, int ndim, const int64_t *shape);
/* New tensor header viewing `s` (retained). */
gj_tensor *gj_rt_tensor_view(gj_rt_storage *s, gj_dtype dt, int ndim, const int64_t *shape,
                             const int64_t *strides, int64_t offset);
/* Header-only alias of t (same storage/shape/strides), no autograd meta. */
gj_tensor *gj_rt_tensor_alias(const gj_tensor *t);
void gj_rt_tensor_retain(gj_tensor *t);
/* Drops one reference; on zero frees autograd meta (via the callback),
 * storage reference, header. Does not touch scopes (frontend does). */
void gj_rt_tensor_release(gj_tensor *t);
void gj_rt_set_ag_free(void (*fn)(gj_tensor *t));

void gj_rt_contiguous_strides(int ndim, const int64_t *shape, int64_t *strides);
bool gj_rt_is_contiguous(const gj_tensor *t);
int64_t gj_rt_numel(int ndim, const int64_t *shape);
static inline void *gj_rt_data_ptr(const gj_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)gj_rt_dtype_size(t->dtype);
}
/* t's bytes present (gj_rt_storage_fetch in an epoch of its own): what
 * a public function that reads a tensor's values outside gj_rt_exec calls
 * first. 0, or -1 with an error. */
static inline int gj_rt_present(const gj_tensor *t) {
    return t->storage->fetch ? gj_rt_storage_fetch(t->storage, gj_rt_fetch_epoch()) : 0;
}
/* Contiguous copy in the same dtype (new reference; retains t itself if it
 * is already contiguous). */
gj_tensor *gj_rt_contiguous(gj_tensor *t);
/* Element i (row-major order of the view) as double. */
double gj_rt_get(const gj_tensor *t, int64_t i);
void gj_rt_bump_version(gj_tensor *t);

/* Broadcast two shapes (numpy rules); false if incompatible. */
bool gj_rt_broadcast_shape(int na, const int64_t *a, int nb, const int64_t *b, int *nout,
                           int64_t *out);

/* Counter-based RNG (Philox-like hash): value k of stream (seed, offset). */
uint64_t gj_rt_rng_seed(void);
void gj_rt_rng_set_seed(uint64_t seed);
/* Reserve n consecutive counters of the global stream; returns the first. */
uint64_t gj_rt_rng_reserve(uint64_t n);
/* How many times the global stream was set (gj_manual_seed,
 * gj_rng_set_state) since the process started: a step's trace compares it
 * at its end with its start, so that a reseed to the seed it already had is
 * seen too. */
uint64_t gj_rt_rng_reseeds(void);

/* Checks that every element of the i64 tensor idx lies in [0, bound):
 * false with "<op>: <arg>[i] = v is out of range [0, bound)" (or a dtype
 * error) otherwise. The eager ops that index with values (cross-entropy
 * labels, embedding rows) and the compiled step call the same check. */
bool gj_rt_check_indices(const char *op, const char *arg, const gj_tensor *idx, int64_t bound);
/* The same, where with has_ignore the value `ignore` is also accepted
 * (linear cross-entropy's ignored label). */
bool gj_rt_check_labels(const char *op, const char *arg, const gj_tensor *idx, int64_t bound,
                        int64_t ignore, bool has_ignore);

/* -------------------------------------------------------- thread pool */

/* Starts a thread of gradjit's own (the pool's workers, a stream's thread)
 * with every asynchronous signal blocked, so that a signal sent to the
 * process is handled on one of the application's threads, never inside a
 * kernel on a thread the application cannot set up (an alternate signal
 * stack, a mask). Synchronous signals (SIGSEGV, SIGBUS, SIGFPE, SIGILL,
 * SIGTRAP, SIGSYS, SIGABRT) stay deliverable. As pthread_create. */
int gj_rt_thread_start(pthread_t *t, void *(*fn)(void *), void *arg);

/* Calls fn(ctx, begin, end) over [0, n) split in chunks of at least grain,
 * on the pool threads and the caller. Runs inline when n < 2*grain or one
 * thread is configured. Not reentrant from within fn (runs inline there). */
typedef void (*gj_rt_range_fn)(void *ctx, int64_t begin, int64_t end);
void gj_rt_parallel_for(int64_t n, int64_t grain, gj_rt_range_fn fn, void *ctx);
void gj_rt_set_num_threads(int n);
int gj_rt_num_threads(void);

/* --------------------------------------------------------------- GEMM */

/* The GEMM layer (gemm.c, the entry; gemm_choice.c, the provider of each
 * GEMM shape; openblas.c and onednn.c, the leaves; gemm_int.h, its inside).
 * OpenBLAS is loaded at first use; its core and build configuration: */
const char *gj_rt_blas_corename(void);
const char *gj_rt_blas_config(void);
/* Row-major C[M,N] = alpha * op(A) op(B) + beta * C with leading dims. */
void gj_rt_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                 float *C, int64_t ldc);
void gj_rt_dgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                 const double *A, int64_t lda, const double *B, int64_t ldb, double beta,
                 double *C, int64_t ldc);
/* C[M,N] = op(A) op(B) + beta * C with bf16 operands and an f32 result
 * (beta 0 or 1), accumulated in f32: oneDNN's bf16 matmul where the
 * provider setting gives it the GEMM, else both operands converted to f32
 * (exactly) for OpenBLAS's sgemm. */
void gj_rt_bgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A,
                 int64_t lda, const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc);

#include "rt_prim.h"

/* The eager loop of elementwise primitive prim (unary, _SCALAR, binary,
 * EQ, WHERE) over dense arrays of compute type ct (GJ_F32 or GJ_F64):
 * out[0..n) = prim(in[k][0..n)), scalar for the _SCALAR primitives. The
 * very loop the eager kernels run on each tile, so a caller that keeps its
 * values in the compute type gets the eager kernels' bits. 0, or -1 (no
 * error set) when prim has no such loop. */
int gj_rt_ew_dense(gj_rt_prim prim, gj_dtype ct, double scalar, int64_t n,
                   const void *const *in, void *out);

/* ---------------------------------------- runtime core additions (rtcore) */

/* An abstract tensor (gj_rt_storage_new_abstract): contiguous of dt and
 * shape; or with t's dtype, shape, strides and offset over a storage of
 * t's storage size. New reference, or NULL with an error. */
gj_tensor *gj_rt_tensor_abstract(gj_dtype dt, int ndim, const int64_t *shape);
gj_tensor *gj_rt_tensor_abstract_like(const gj_tensor *t);
static inline bool gj_rt_is_abstract(const gj_tensor *t) {
    return gj_rt_storage_is_abstract(t->storage);
}
/* As gj_rt_storage_new / gj_rt_tensor_new but the bytes are left undefined:
 * for outputs that a kernel overwrites entirely (saves the zero-fill pass). */
gj_rt_storage *gj_rt_storage_new_uninit(size_t nbytes);
gj_tensor *gj_rt_tensor_empty(gj_dtype dt, int ndim, const int64_t *shape);
/* Copies src, broadcast to dst's shape (numpy rules), into dst, converting
 * between any of f32/f64/bf16/i64 (to bf16: round to nearest even, NaN kept;
 * float to i64: truncation, NaN -> 0, saturating). Both borrowed; does not
 * bump dst's version. 0, or -1 with an error. */
int gj_rt_copy_into(gj_tensor *dst, const gj_tensor *src);
/* Stateless counter-based generator: 64 random bits, a uniform double in
 * [0, 1) and a standard normal (Box-Muller), each a pure function of
 * (seed, counter). */
uint64_t gj_rt_rng_bits(uint64_t seed, uint64_t counter);
double gj_rt_rng_uniform(uint64_t seed, uint64_t counter);
double gj_rt_rng_normal(uint64_t seed, uint64_t counter);
/* What the OpenBLAS core choice depends on (x86 cpuid; all false/0 elsewhere). */
typedef struct gj_rt_cpu {
    bool amd;   /* vendor AuthenticAMD */
    int family; /* display family (base + extended) */
    bool avx2, fma, avx512f, avx512bw, avx512vl, avx512dq, avx512cd, avx512bf16;
} gj_rt_cpu;
void gj_rt_cpu_detect(gj_rt_cpu *c);
/* The core for c ("Cooperlake", "SkylakeX", "Zen", "Haswell") or NULL. */
const char *gj_rt_blas_core_for(const gj_rt_cpu *c);
/* The OPENBLAS_CORETYPE that loading OpenBLAS sets from cpuid:
 * gj_rt_blas_core_for(this CPU), or NULL to let OpenBLAS decide. */
const char *gj_rt_blas_pick_coretype(void);
/* A GEMM as gj_rt_sgemm/dgemm/bgemm take it (row-major; alpha, beta in
 * double). bf16: A and B are bf16 (uint16_t), C is f32 (gj_rt_bgemm). */
typedef struct gj_rt_gemm_call {
    bool f64, ta, tb;
    int64_t M, N, K;
    double alpha;
    const void *A;
    int64_t lda;
    const void *B;
    int64_t ldb;
    double beta;
    void *C;
    int64_t ldc;
    bool bf16;
} gj_rt_gemm_call;
/* How gj_rt_sgemm/dgemm split a GEMM (ta: A stored transposed) on
 * `threads` threads: `parts` blocks of rows (by_rows) or of columns of C,
 * block i covering [len*i/parts, len*(i+1)/parts). A pure function of its
 * arguments: the compiled program runs the same blocks as eager. */
typedef struct gj_rt_gemm_split {
    int parts;
    bool by_rows;
    int64_t len;
} gj_rt_gemm_split;
void gj_rt_gemm_split_of(bool ta, int64_t M, int64_t N, int64_t K, int threads,
                         gj_rt_gemm_split *sp);
/* The split of GEMM c on `threads` threads: gj_rt_gemm_split_of's, except
 * that a bf16 GEMM with A not transposed is split by rows where it can be
 * (each block's A, B and C are then dense, which oneDNN's AMX and
 * AVX512_BF16 brgemm kernels need; a column block has strided B and C). A
 * pure function of c's shape, flags and threads. */
void gj_rt_gemm_split_for(const gj_rt_gemm_call *c, int threads, gj_rt_gemm_split *sp);
/* Computes block i of split sp of GEMM c on the calling thread (one
 * single-threaded BLAS call; arguments already valid). */
void gj_rt_gemm_block(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp, int i);
/* Computes every block of split sp of GEMM c: on the pool, or on the
 * calling thread when sp has one part. */
void gj_rt_gemm_run(const gj_rt_gemm_call *c, const gj_rt_gemm_split *sp);
/* Whether the calling thread is running a task of gj_rt_parallel_for (work
 * it starts then runs inline). */
bool gj_rt_in_pool_task(void);

/* ------------------------------------ GEMM providers (gemm_choice.c) */

/* Who computes an f32 or bf16 GEMM: OpenBLAS (bf16 operands converted to
 * f32), or oneDNN's matmul primitive (when gradjit was built with
 * libdnnl-dev and libdnnl.so.2 loads), chosen per GEMM shape. DEFAULT
 * (GRADJIT_GEMM unset): f32 shapes measured once per machine where the
 * cache directory keeps the choices, OpenBLAS where there is none; bf16
 * to oneDNN where the CPU multiplies bf16 natively (AVX512_BF16). AUTO
 * (GRADJIT_GEMM=auto) measures f32 and bf16 shapes (kept in the process
 * where there is no directory); OPENBLAS / ONEDNN pin one. f64 GEMMs,
 * alpha != 1 and beta other than 0 or 1 are always OpenBLAS's. */
typedef enum gj_rt_gemm_provider {
    GJ_RT_GEMM_AUTO = 0,
    GJ_RT_GEMM_OPENBLAS = 1,
    GJ_RT_GEMM_ONEDNN = 2,
    GJ_RT_GEMM_DEFAULT = 3,
} gj_rt_gemm_provider;
/* Sets the provider for every later GEMM (wins over GRADJIT_GEMM). 0, or -1
 * with an error: not a provider, or ONEDNN without oneDNN (then OpenBLAS is
 * pinned). */
int gj_rt_set_gemm_provider(int p);
/* The setting in force (GRADJIT_GEMM until gj_rt_set_gemm_provider). */
int gj_rt_gemm_provider_setting(void);
const char *gj_rt_gemm_provider_name(int p); /* "auto", "openblas", "onednn", "default" */
bool gj_rt_onednn_available(void);
const char *gj_rt_onednn_version(void); /* "2.6.3 (OpenMP)" or "unavailable" */
/* Whether the CPU multiplies bf16 natively (AVX512_BF16): where the default
 * setting sends bf16 GEMMs to oneDNN. */
bool gj_rt_cpu_native_bf16(void);
/* The measured decision for a GEMM shape: 0 none yet, 1 OpenBLAS, 2 oneDNN. */
int gj_rt_gemm_choice(bool ta, bool tb, int64_t M, int64_t N, int64_t K, bool beta1, bool bf16);
typedef struct gj_rt_gemm_stats {
    int64_t openblas_blocks, onednn_blocks; /* f32 and bf16 blocks computed by each */
    int64_t bf16_blocks;                    /* of which bf16 */
    int64_t measured, loaded;               /* shapes measured here, read from the file */
    int64_t refused;                        /* block shapes oneDNN refused */
    int64_t entries;                        /* shapes in the table */
    int64_t sample_macs;                    /* the largest sample a decision timed */
    double decide_ms; /* time deciding new shapes: reading the choices file, measuring */
} gj_rt_gemm_stats;
void gj_rt_gemm_get_stats(gj_rt_gemm_stats *s);
/* Tests: forgets every choice and primitive and zeroes the counters (no
 * GEMM may run meanwhile); makes oneDNN look missing (on) or not. */
void gj_rt_gemm_provider_reset(void);
void gj_rt_gemm_simulate_no_onednn(bool on);
/* Where the measured choices are kept: dir, or NULL for the default
 * (GRADJIT_CACHE_DIR's rules), or "" for nowhere. */
void gj_rt_gemm_set_cache_dir(const char *dir);
/* Lists the table (one line per key) on f. */
void gj_rt_gemm_dump(FILE *f);

/* ------------------------------------------------------- math bitcode */

/* runtime/math_bc.c (the scalar math of gj_math.h as gj_bc_* functions)
 * compiled to LLVM bitcode by clang-19 at build time and embedded here;
 * the JIT parses it and links it into every kernel module. */
extern const unsigned char gj_rt_math_bc[];
extern const size_t gj_rt_math_bc_size;
/* runtime/attention_bc.c likewise (the fused attention's JIT entries),
 * linked only into modules with an attention kernel. */
extern const unsigned char gj_rt_attn_bc[];
extern const size_t gj_rt_attn_bc_size;

/* ------------------------------ caching allocator and streams (hooks) */

/* alloc_cache.c: the block cache behind gj_rt_alloc_data/free_data.
 * gj_rt_cache_alloc returns a 64-byte aligned block of at least nbytes
 * (a cached block of nbytes' size class, else a new one; NULL on OOM,
 * no error set, or past the memory limit: *over_limit set, and an error
 * naming the limit); gj_rt_cache_free takes it back (cached, deferred
 * while a recorded stream has not passed, or freed). */
void *gj_rt_cache_alloc(size_t nbytes, bool *over_limit, bool *fresh);
/* Large blocks (alloc_cache.c, "first touch"): what the kernel offers for
 * transparent huge pages (a test may pretend another mode with
 * gj_rt_thp_simulate, -1 to stop), whether new large blocks are advised for
 * them (GRADJIT_HUGEPAGES or gj_set_hugepages, and the kernel), and the
 * counters of large blocks mapped since start. */
enum { GJ_RT_THP_NONE, GJ_RT_THP_NEVER, GJ_RT_THP_MADVISE, GJ_RT_THP_ALWAYS };
int gj_rt_thp_mode(void);
void gj_rt_thp_simulate(int mode);
bool gj_rt_hugepages_on(void); /* the setting (not the kernel) */
typedef struct gj_rt_page_stats_t {
    int thp_mode;          /* GJ_RT_THP_* */
    bool hugepages;        /* new large blocks are advised MADV_HUGEPAGE */
    int64_t large_min;     /* the smallest large block (2 MiB) */
    int64_t mapped_bytes;  /* large blocks mapped since start (fresh, zero) */
    int64_t advised_bytes; /* of which advised MADV_HUGEPAGE */
    int64_t n_mapped;      /* large blocks mapped */
} gj_rt_page_stats_t;
void gj_rt_page_stats(gj_rt_page_stats_t *out);
/* The memory limit on the bytes held for tensors (0: none; the default is
 * GRADJIT_MEM_LIMIT_MB). 0, or -1 with an error (negative). */
int gj_rt_set_mem_limit(int64_t bytes);
/* Bytes held from libc for tensor blocks (in use, cached, deferred), their
 * peak since the last reset, and the limit (0: none). */
void gj_rt_held_stats(int64_t *held, int64_t *peak, int64_t *limit);
void gj_rt_held_reset_peak(void);
void gj_rt_cache_free(void *p, size_t nbytes);
/* Bytes held for reuse (cached and stream-deferred blocks). */
int64_t gj_rt_cache_bytes(void);
/* Frees every cached block (deferred ones stay until their streams pass). */
void gj_rt_alloc_release_cache(void);
/* A mark of the cache's contents: blocks cached from now on are newer.
 * gj_rt_alloc_release_cache_before returns to the system the cached blocks
 * older than mark (those cached before it and not handed out since). */
uint64_t gj_rt_alloc_cache_mark(void);
void gj_rt_alloc_release_cache_before(uint64_t mark);
/* The data block p (from gj_rt_alloc_data) is in use on stream s: when it
 * is freed, it waits for s. 0 or -1 (OOM, error set). */
int gj_rt_cache_record_stream(void *p, gj_stream *s);
/* Returns deferred blocks whose streams have passed to the cache. */
void gj_rt_cache_poll(void);

/* stream.c: positions of a stream. A point is the number of work items
 * enqueued so far; the stream has passed it once as many have completed. */
uint64_t gj_rt_stream_point(gj_stream *s);
bool gj_rt_stream_passed(gj_stream *s, uint64_t point);
void gj_rt_stream_retain(gj_stream *s);
void gj_rt_stream_release(gj_stream *s);

/* ------------------------------------ exec counters (helper ckpt, tests) */

/* How many times gj_rt_exec ran primitive p (successfully validated) since
 * the last reset, on all threads: lets tests count e.g. the matmuls an
 * eager backward executes. 0 for an invalid p. */
int64_t gj_rt_exec_count(gj_rt_prim p);
void gj_rt_exec_count_reset(void);

/* Appended by helper "hookjit" (runtime/stream.c): how many times
 * gj_tensor_record_stream was called with a valid tensor and stream on this
 * thread. The compiled backward compares it around each hook call. */
uint64_t gj_rt_record_stream_calls(void);

#endif /* GJ_RT_H */
