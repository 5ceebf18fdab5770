/* SPDX-License-Identifier: MIT */
/*
 * gradjit.h - the one public header of gradjit, a C11 library for training
 * neural networks from C with an eager, define-by-run autograd engine whose
 * backward pass can be compiled (see docs/architecture.md).
 *
 * Ownership, for every function that returns a tensor:
 *   - "new reference": the caller owns one reference. If a scope is open
 *     (gj_scope_push), the innermost scope owns it instead and releases it at
 *     gj_scope_pop; gj_scope_keep(t) moves it out of the scope to the caller.
 *     gj_release(t) is always legal on a reference you own, scoped or not.
 *   - "borrowed": valid while the tensor it came from lives; do not release.
 * Functions taking tensors borrow them unless they say "stolen".
 *
 * Errors: a function that fails returns NULL (tensors) or a non-zero status
 * (int), or the sentinel its comment names (NaN, -1, false), and sets a
 * thread-local message, gj_last_error(), naming the op, the shapes and the
 * dtypes involved. No public function aborts on bad input. See "errors"
 * below for when the message is meaningful.
 */
#ifndef GRADJIT_H
#define GRADJIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GJ_VERSION_MAJOR 0
#define GJ_VERSION_MINOR 1
#define GJ_VERSION_PATCH 0
#define GJ_VERSION_STRING "0.1.0"

#define GJ_MAX_DIMS 8

/* Marks the functions of the public API: the shared library exports these
 * and nothing else (it is built with hidden visibility). */
#if defined(__GNUC__) || defined(__clang__)
#define GJ_API __attribute__((visibility("default")))
#else
#define GJ_API
#endif

typedef enum gj_dtype {
    GJ_F32 = 0,
    GJ_F64 = 1,
    GJ_BF16 = 2, /* storage only: math runs in f32, results round to bf16 */
    GJ_I64 = 3,  /* labels and indices; not differentiable */
} gj_dtype;

typedef struct gj_tensor gj_tensor;
typedef struct gj_state_dict gj_state_dict; /* named tensors: checkpoints */

/* ---------------------------------------------------------------- errors */

/* The message of the last failed call on this thread ("" if none yet, or
 * since gj_clear_error). It is meaningful right after a call that reported
 * failure (its NULL, non-zero status or other sentinel). Like errno, a
 * call that succeeds neither sets nor clears it, so after a success it may
 * still hold an older failure's message. The exceptions: gj_backward,
 * gj_backward_ex, gj_backward_multi, gj_grad and gj_batches_next empty it
 * when they succeed, and gj_custom_op_call empties it before it calls your
 * forward function (which may leave a message of its own). For a result
 * that cannot show failure by itself (gj_tensor_item of a tensor that may
 * hold NaN, gj_tensor_dtype), call gj_clear_error() first and test
 * gj_last_error()[0] after. Borrowed: a thread-local buffer overwritten by
 * the next error; copy it to keep it.
 *
 * A NULL tensor argument fails with "<op>: <arg> is NULL", followed by
 * "(caused by: <message>)" only when that NULL comes from a failed call:
 * when the last call on this thread that handed out tensors (returned one,
 * or filled out[] as gj_grad, gj_checkpoint, gj_batches_next and
 * gj_custom_op_call do) failed, and no error was set since. In
 * gj_gelu(gj_matmul(a, b)) the cause is matmul's message, however long the
 * chain (the innermost cause is kept). No cause is cited for a NULL you
 * pass yourself, after a call that failed with a status (gj_state_dict_add
 * returning -1), or when calls have made tensors since the failure, which
 * includes a sibling argument: in gj_add(f(), g()) C may evaluate g() after
 * a failed f(). gj_tensor_grad and gj_state_dict_get/_tensor returning NULL
 * without an error count as calls that handed out a tensor. */
GJ_API const char *gj_last_error(void);
/* Empties gj_last_error() (and forgets the cause above). */
GJ_API void gj_clear_error(void);

/* ------------------------------------------------------- library / info */

/* Library version, BLAS core in use (e.g. "SkylakeX"), thread count. The
 * strings are borrowed (static; do not free). */
typedef struct gj_info {
    const char *version;
    const char *blas_core;    /* openblas_get_corename() */
    const char *blas_config;  /* openblas_get_config() */
    int num_threads;
} gj_info;
GJ_API void gj_get_info(gj_info *out);

/* Threads used by gradjit kernels and BLAS. n <= 0: one per core. */
GJ_API void gj_set_num_threads(int n);
GJ_API int gj_get_num_threads(void);

/* Who computes f32 and bf16 GEMMs (docs/guide.md, section 8). DEFAULT:
 * f32 as AUTO where the cache directory keeps the measured choices (so
 * every process on a machine computes the same bits), else by OpenBLAS;
 * bf16 by oneDNN's matmul where the CPU multiplies bf16 natively
 * (AVX512_BF16, AMX), else converted to f32 for OpenBLAS. AUTO:
 * the faster of the two, measured once per GEMM shape; OPENBLAS, ONEDNN:
 * that one for every GEMM it takes. Wins over GRADJIT_GEMM. 0, or -1 with
 * an error (oneDNN not available: OpenBLAS is then pinned; or an unknown
 * value). */
typedef enum gj_gemm_provider {
    GJ_GEMM_AUTO = 0,
    GJ_GEMM_OPENBLAS = 1,
    GJ_GEMM_ONEDNN = 2,
    GJ_GEMM_DEFAULT = 3,
} gj_gemm_provider;
GJ_API int gj_set_gemm_provider(gj_gemm_provider p);
GJ_API gj_gemm_provider gj_get_gemm_provider(void);

/* --------------------------------------------------- memory accounting */

typedef struct gj_mem {
    int64_t live_bytes;  /* tensor storage bytes alive now */
    int64_t peak_bytes;  /* maximum of live_bytes since the last reset */
    int64_t n_allocs;    /* storage allocations since start */
    int64_t cached_bytes; /* held by the caching allocator for reuse (not in live_bytes) */
    int64_t held_bytes;   /* held from the system for tensors: blocks in use (rounded to
                             their size class), cached and stream-deferred */
    int64_t held_peak_bytes; /* maximum of held_bytes since the last reset */
    int64_t limit_bytes;  /* the memory limit on held_bytes (0: none) */
} gj_mem;
GJ_API void gj_mem_stats(gj_mem *out);
GJ_API void gj_mem_reset_peak(void);
/* A limit on the bytes gradjit holds for tensors (held_bytes: tensors,
 * compiled programs' buffers, the allocator's cache). An allocation that
 * would pass it first empties the cache, then fails: the op, step or
 * backward that asked returns NULL or -1 with an error naming the limit,
 * as for any out-of-memory, and nothing is corrupted. 0: no limit (the
 * default; GRADJIT_MEM_LIMIT_MB=N sets N MiB at start). 0, or -1 with an
 * error (negative). */
GJ_API int gj_set_mem_limit(int64_t bytes);
/* Huge pages for large tensor blocks (docs/guide.md, "Memory"): blocks of
 * 2 MiB and more are 2 MiB-aligned mappings advised for the kernel's
 * transparent huge pages (where /sys/kernel/mm/transparent_hugepage/enabled
 * is `always` or `madvise`), so touching one costs a fault per 2 MiB
 * instead of per 4 KiB. On by default; GRADJIT_HUGEPAGES=0 turns it off at
 * start, this call at any time (blocks mapped from then on). */
GJ_API void gj_set_hugepages(bool on);

/* What the first steps of a training run pay beyond a steady step, as
 * counters since the process started (never reset; take the difference
 * around a step). A trainer prints them after its first steps. */
typedef struct gj_warmup_stats {
    double compile_ms;      /* making compiled programs for new keys (compiled autograd and
                               compiled steps): capture, plan, loading from the cache
                               directory or compiling */
    double gemm_choice_ms;  /* choosing the GEMM provider of new shapes: reading the cache
                               directory's choices, measuring both providers */
    int64_t gemm_measured;  /* GEMM shapes measured in this process */
    int64_t new_bytes;      /* bytes of large blocks (2 MiB and more) taken new from the
                               system: zero, and paid for in page faults when first touched */
    int64_t huge_bytes;     /* of which advised for transparent huge pages */
    int64_t zeroed_bytes;   /* bytes of tensor memory gradjit zero-filled */
    int64_t zero_skipped_bytes; /* zero fills not written: the memory was new, so zero */
    int page_kib;           /* the page size large blocks ask for: 2048 (huge pages) or 4 */
} gj_warmup_stats;
GJ_API void gj_warmup_stats_get(gj_warmup_stats *out);

/* ------------------------------------------------------------- tensors */

/* New reference. data is copied; shape has ndim entries (0 <= ndim <= 8). */
GJ_API gj_tensor *gj_from_data(gj_dtype dtype, int ndim, const int64_t *shape, const void *data);
GJ_API gj_tensor *gj_zeros(gj_dtype dtype, int ndim, const int64_t *shape);
GJ_API gj_tensor *gj_ones(gj_dtype dtype, int ndim, const int64_t *shape);
GJ_API gj_tensor *gj_full(gj_dtype dtype, int ndim, const int64_t *shape, double value);
/* Standard normal * std, from the counter-based generator (gj_manual_seed). */
GJ_API gj_tensor *gj_randn(gj_dtype dtype, int ndim, const int64_t *shape, double std);
/* Uniform in [lo, hi). */
GJ_API gj_tensor *gj_rand(gj_dtype dtype, int ndim, const int64_t *shape, double lo, double hi);
GJ_API gj_tensor *gj_scalar(gj_dtype dtype, double value); /* 0-d tensor */

/* Seeds every random draw (randn, rand, dropout) of this process. */
GJ_API void gj_manual_seed(uint64_t seed);

/* Drop one reference (NULL is ignored). Only for references you own: never
 * for a borrowed pointer. Releasing the borrowed .grad of gj_tensor_grad
 * (when the .grad slot holds the only reference left) is detected and
 * refused: nothing is freed, gj_last_error() says why and a line goes to
 * stderr. Other borrowed pointers cannot be told apart. */
GJ_API void gj_release(gj_tensor *t);
/* Add one reference; returns t. The extra reference is the caller's, never a scope's. */
GJ_API gj_tensor *gj_retain(gj_tensor *t);

/* Scopes: every new reference returned while a scope is open belongs to
 * it; gj_scope_pop releases them all. gj_scope_keep moves t out of its scope
 * (the caller now owns that reference); returns t. */
GJ_API void gj_scope_push(void);
GJ_API void gj_scope_pop(void);
GJ_API gj_tensor *gj_scope_keep(gj_tensor *t);
/* Scopes open on the calling thread (0 outside any). A push without its
 * pop keeps every tensor made after it alive: when one thread's depth
 * reaches 10000, deeper than real programs nest, gradjit prints a warning
 * once on stderr; GRADJIT_LOG=leaks reports what is left at exit. */
GJ_API int gj_scope_depth(void);
/* Tensors alive in the process (headers not yet freed: yours, the scopes',
 * and those gradjit holds, such as .grad, saved tensors of graphs not yet
 * run backward, optimizer state). With gj_mem_stats' live_bytes and
 * gj_scope_depth, a leak check: take both before a step and compare after. */
GJ_API int64_t gj_live_tensors(void);

/* Accessors (borrowed views of metadata; never fail on a valid tensor).
 * The shape and strides arrays are borrowed: they live in t and are valid
 * while t lives (do not free them). On a NULL or released tensor each sets
 * an error naming itself and returns: ndim and numel -1, shape and strides
 * NULL, is_contiguous false, dtype GJ_F32 (indistinguishable from a real
 * f32: gj_clear_error() first and test gj_last_error() to tell). */
GJ_API gj_dtype gj_tensor_dtype(const gj_tensor *t);
GJ_API int gj_tensor_ndim(const gj_tensor *t);
GJ_API const int64_t *gj_tensor_shape(const gj_tensor *t);
GJ_API const int64_t *gj_tensor_strides(const gj_tensor *t); /* in elements */
GJ_API int64_t gj_tensor_numel(const gj_tensor *t);
GJ_API bool gj_tensor_is_contiguous(const gj_tensor *t);
/* Pointer to the first element (of the view), or NULL on error. Borrowed:
 * valid while t's storage lives and is not swapped (gj_tensor_set_). */
GJ_API void *gj_tensor_data(gj_tensor *t);
/* Copy the tensor's values, converted to f64/f32, into out (numel entries,
 * row-major order of the view). 0 on success. */
GJ_API int gj_tensor_to_f64(const gj_tensor *t, double *out);
GJ_API int gj_tensor_to_f32(const gj_tensor *t, float *out);
/* Element at a flat row-major index, as double (NaN and an error if out of range). */
GJ_API double gj_tensor_item_at(const gj_tensor *t, int64_t index);
GJ_API double gj_tensor_item(const gj_tensor *t); /* the single element */
/* A name for messages and dumps (copied; NULL or "" clears it; at most 255
 * bytes): errors about the tensor (a saved tensor modified in place, a
 * .grad of the wrong shape, optimizer and DDP parameter errors) quote it.
 * Views and copies do not inherit it. The nn layers' *_state_dict_add
 * name their parameters "<prefix>.weight" ... when they have no name. */
GJ_API int gj_tensor_set_name(gj_tensor *t, const char *name);
/* The name, or NULL (borrowed: valid until renamed or t dies). */
GJ_API const char *gj_tensor_name(const gj_tensor *t);
/* Version counter: bumped by every in-place op on the storage. */
GJ_API int64_t gj_tensor_version(const gj_tensor *t);

/* ------------------------------------------------------------ autograd */

GJ_API int gj_set_requires_grad(gj_tensor *t, bool requires_grad); /* leaves only */
/* false, with an error set, for a NULL or released t. */
GJ_API bool gj_requires_grad(const gj_tensor *t);
GJ_API bool gj_is_leaf(const gj_tensor *t);
/* The accumulated .grad of t, or NULL if none yet (no error: that is no
 * failure; a NULL or released t is, with an error). Borrowed: the .grad
 * slot holds the reference; do not gj_release it (refused, see
 * gj_release). It stays valid until .grad is replaced or cleared
 * (gj_tensor_set_grad, gj_optim_zero_grad) or t dies; gj_retain it to
 * keep it longer (then release that reference once). */
GJ_API gj_tensor *gj_tensor_grad(const gj_tensor *t);
/* Replace .grad (g borrowed: the slot takes a reference of its own; may be
 * NULL to clear). */
GJ_API int gj_tensor_set_grad(gj_tensor *t, gj_tensor *g);
/* New reference sharing t's storage, cut from the graph. */
GJ_API gj_tensor *gj_detach(gj_tensor *t);

/* Backward from root. seed: gradient of root (NULL: ones, root must then
 * have one element). Accumulates into .grad of every leaf that requires
 * grad, in that .grad's dtype. Frees the graph unless retain_graph.
 * Called from user code (a hook, a custom op's function) while a backward
 * runs on this thread, it fails (-1, an error naming gj_backward and
 * saying the graph's backward is running) if its graph shares a node with
 * the running one; so does gj_grad. Unrelated graphs are fine. */
GJ_API int gj_backward(gj_tensor *root, gj_tensor *seed);
GJ_API int gj_backward_ex(gj_tensor *root, gj_tensor *seed, bool retain_graph);
/* Backward from several roots in one traversal (torch.autograd.backward
 * with a list of tensors): seeds may be NULL or hold NULLs (ones, for
 * one-element roots); what flows from every root is summed (a root given
 * twice counts twice) and accumulated into .grad as gj_backward does,
 * compiled like it when the flag is on (the key holds every root). */
GJ_API int gj_backward_multi(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                             bool retain_graph);

/* torch.autograd.grad: gradients of outputs w.r.t. inputs, without touching
 * any .grad. seeds may be NULL (ones for each scalar output) or hold NULLs.
 * grads_out[i] receives a new reference (zeros if input i is unreachable
 * and allow_unused, else an error), a tensor of its own: an input given
 * twice gets two distinct tensors (sharing storage), each to be released
 * once, and never is it the caller's seed pointer. inputs may be
 * intermediate tensors (the gradient flowing into them). With compiled
 * autograd on it runs a compiled program (its key holds the inputs and the
 * gj_grad mode; allow_unused is applied after it) and counts in
 * gj_ca_stats like gj_backward, falling back to the eager engine with the
 * same reasons; the gradients are the eager ones. No create_graph: a
 * gradient is never differentiable again. */
GJ_API int gj_grad(int n_outputs, gj_tensor *const *outputs, gj_tensor *const *seeds,
            int n_inputs, gj_tensor *const *inputs, gj_tensor **grads_out,
            bool retain_graph, bool allow_unused);

/* No-grad mode, nestable (like torch.no_grad). */
GJ_API void gj_no_grad_push(void);
GJ_API void gj_no_grad_pop(void);
GJ_API bool gj_is_grad_enabled(void);

/* Mixed precision for the calling thread, as PyTorch's CPU autocast:
 * GJ_BF16 turns it on, GJ_F32 off (the default). While on, GEMM ops
 * (gj_matmul, gj_linear, gj_conv2d) cast their f32 arguments to bf16 and
 * return bf16 (bf16 products summed in f32, rounded once); gj_softmax,
 * gj_log_softmax, gj_layer_norm, gj_cross_entropy, gj_sum and gj_mean cast
 * bf16 arguments to f32 and return f32; binary ops, gj_where and gj_cat
 * given both f32 and bf16 compute in f32; every other op keeps its
 * argument's dtype (activations after a GEMM stay bf16). The casts are ops
 * of the graph (gj_cast): gradients flow back to f32 parameters in f32.
 * f64 is never cast. Keep parameters and optimizer state in f32 (the
 * master copy). Inside gj_step_run the step's opts.autocast decides. 0, or
 * -1 with an error (another dtype). */
GJ_API int gj_set_autocast(gj_dtype compute);
GJ_API gj_dtype gj_get_autocast(void);

/* ------------------------------------------------------------------ ops */
/* All return a new reference, or NULL with gj_last_error() set.
 * Binary ops broadcast (numpy rules) and require equal dtypes. */

GJ_API gj_tensor *gj_add(gj_tensor *a, gj_tensor *b);
GJ_API gj_tensor *gj_sub(gj_tensor *a, gj_tensor *b);
GJ_API gj_tensor *gj_mul(gj_tensor *a, gj_tensor *b);
GJ_API gj_tensor *gj_div(gj_tensor *a, gj_tensor *b);
GJ_API gj_tensor *gj_neg(gj_tensor *x);
GJ_API gj_tensor *gj_exp(gj_tensor *x);
GJ_API gj_tensor *gj_log(gj_tensor *x);
GJ_API gj_tensor *gj_tanh(gj_tensor *x);
GJ_API gj_tensor *gj_sigmoid(gj_tensor *x);
GJ_API gj_tensor *gj_relu(gj_tensor *x);
GJ_API gj_tensor *gj_gelu(gj_tensor *x); /* tanh approximation */
GJ_API gj_tensor *gj_sqrt(gj_tensor *x);
GJ_API gj_tensor *gj_pow_scalar(gj_tensor *x, double p);
GJ_API gj_tensor *gj_add_scalar(gj_tensor *x, double c);
GJ_API gj_tensor *gj_mul_scalar(gj_tensor *x, double c);

/* Reductions over the axes in axes[0..n_axes) (negative counts from the end;
 * n_axes == 0 means all axes). */
GJ_API gj_tensor *gj_sum(gj_tensor *x, int n_axes, const int *axes, bool keepdim);
GJ_API gj_tensor *gj_mean(gj_tensor *x, int n_axes, const int *axes, bool keepdim);
GJ_API gj_tensor *gj_max(gj_tensor *x, int axis, bool keepdim); /* values only */

/* matmul: 2-D x 2-D, or batched (leading dims broadcast), like torch.matmul
 * for ndim >= 2. linear: x[..., in] @ w[out, in]^T + b[out] (b may be NULL). */
GJ_API gj_tensor *gj_matmul(gj_tensor *a, gj_tensor *b);
GJ_API gj_tensor *gj_linear(gj_tensor *x, gj_tensor *w, gj_tensor *b);

/* Views and shape ops (views share storage where possible). */
GJ_API gj_tensor *gj_transpose(gj_tensor *x, int dim0, int dim1);
GJ_API gj_tensor *gj_permute(gj_tensor *x, const int *perm);
GJ_API gj_tensor *gj_reshape(gj_tensor *x, int ndim, const int64_t *shape); /* one -1 allowed */
GJ_API gj_tensor *gj_view(gj_tensor *x, int ndim, const int64_t *shape);    /* error if not viewable */
GJ_API gj_tensor *gj_expand(gj_tensor *x, int ndim, const int64_t *shape);
GJ_API gj_tensor *gj_narrow(gj_tensor *x, int axis, int64_t start, int64_t length);
GJ_API gj_tensor *gj_cat(int n, gj_tensor *const *xs, int axis);
GJ_API gj_tensor *gj_contiguous(gj_tensor *x);

/* NN ops. */
GJ_API gj_tensor *gj_softmax(gj_tensor *x, int axis);
GJ_API gj_tensor *gj_log_softmax(gj_tensor *x, int axis);
/* Normalises over the last dimension; w, b of shape [C] or NULL. */
GJ_API gj_tensor *gj_layer_norm(gj_tensor *x, gj_tensor *w, gj_tensor *b, double eps);
/* logits [N, K] (float), labels [N] (i64, 0 <= label < K): mean NLL. */
GJ_API gj_tensor *gj_cross_entropy(gj_tensor *logits, gj_tensor *labels);
/* table [V, D], idx i64 of any shape: out [..., D]. */
GJ_API gj_tensor *gj_embedding(gj_tensor *table, gj_tensor *idx);
/* Inverted dropout with probability p; identity when !train or p == 0. */
GJ_API gj_tensor *gj_dropout(gj_tensor *x, double p, bool train);
/* Scaled dot-product attention, fused: softmax(q k^T scale, causally
 * masked when causal) v, for q [B, H, T, D], k [B, H, S, D], v [B, H, S, E]
 * -> [B, H, T, E] in q's dtype. Computed in blocks of 64 queries and 64
 * keys that never hold the T x S scores: the forward keeps the output and
 * one log-sum-exp per query, the backward recomputes each block's
 * probabilities from it (FlashAttention's algorithm). causal: query i sees
 * keys j <= i (needs T == S). scale <= 0: 1/sqrt(D). When train and
 * dropout_p > 0, dropout on the probabilities with the generator's mask of
 * gj_dropout on the [B, H, T, S] probabilities (the counters reserved
 * likewise). f32, bf16 (f32 statistics; under gj_set_autocast q, k and v
 * are taken in bf16) or f64; head sizes D, E at most 128; any strides, the
 * last dimension contiguous or copied. The eager op and every compiled path
 * compute the same bits. */
GJ_API gj_tensor *gj_scaled_dot_product_attention(gj_tensor *q, gj_tensor *k, gj_tensor *v,
                                                  bool causal, double scale, double dropout_p,
                                                  bool train);
/* Linear cross-entropy, fused: the mean over rows of
 * gj_cross_entropy(h weight^T + bias, labels), for h [..., C], weight
 * [V, C], bias [V] or NULL and labels (i64) of h's leading shape, each in
 * [0, V) or equal to ignore_index (such rows add nothing and are not
 * counted in the mean; all rows ignored gives NaN, as a mean of nothing).
 * Never holds the rows x V logits: rows go in chunks whose logits take at
 * most 64 MiB, each made by one GEMM and turned in place into its
 * gradient. When a gradient is wanted (grad mode on and an argument that
 * requires it) the forward computes the gradients of h, weight and bias
 * for a unit upstream gradient and keeps them (the size of h, weight and
 * bias) until the backward scales them by the gradient that arrives:
 * three GEMMs of the unfused head's size, none recomputed. f32, bf16 (f32
 * logits and statistics; under gj_set_autocast h, weight and bias are
 * taken in bf16; the loss is f32) or f64 (loss f64). Eager and compiled
 * paths compute the same bits. */
GJ_API gj_tensor *gj_linear_cross_entropy(gj_tensor *h, gj_tensor *weight, gj_tensor *bias,
                                          gj_tensor *labels, int64_t ignore_index);
/* cond (any dtype, nonzero = true) broadcast with a and b. */
GJ_API gj_tensor *gj_where(gj_tensor *cond, gj_tensor *a, gj_tensor *b);
/* x with value where mask is nonzero. */
GJ_API gj_tensor *gj_masked_fill(gj_tensor *x, gj_tensor *mask, double value);
GJ_API gj_tensor *gj_cast(gj_tensor *x, gj_dtype dtype);

/* Convolution and pooling, NCHW layout (f32, f64, bf16; new reference).
 * gj_conv2d: x [N, C, H, W], w [OC, C / groups, kh, kw], b [OC] or NULL;
 * out [N, OC, OH, OW] with OH = (H + 2 padding - dilation (kh - 1) - 1) /
 * stride + 1 (the same for OW), as torch.nn.functional.conv2d with the same
 * stride, padding and dilation on both axes. Needs stride >= 1, padding
 * >= 0, dilation >= 1, groups >= 1 dividing both C and OC, equal dtypes
 * and OH, OW >= 1; otherwise NULL and an error naming the op, the shapes,
 * dtypes and attributes. */
GJ_API gj_tensor *gj_conv2d(gj_tensor *x, gj_tensor *w, gj_tensor *b, int64_t stride,
                            int64_t padding, int64_t dilation, int64_t groups);
/* Pools over kernel x kernel windows: x [N, C, H, W] -> [N, C, OH, OW],
 * OH = (H + 2 padding - kernel) / stride + 1 (floor, PyTorch's default
 * ceil_mode=False). stride 0 means stride = kernel (PyTorch's default);
 * padding must be at most kernel / 2.
 * gj_max_pool2d pads with -inf; its gradient goes to the first position of
 * each window (row-major) holding the maximum, as PyTorch's (a NaN counts
 * as the maximum).
 * gj_avg_pool2d pads with zeros and always divides by kernel * kernel:
 * padded positions count (PyTorch's count_include_pad=True default). */
GJ_API gj_tensor *gj_max_pool2d(gj_tensor *x, int64_t kernel, int64_t stride, int64_t padding);
GJ_API gj_tensor *gj_avg_pool2d(gj_tensor *x, int64_t kernel, int64_t stride, int64_t padding);

/* In-place ops: bump the version counter; return 0 or an error status.
 * Not allowed on a leaf that requires grad while grad mode is on. */
GJ_API int gj_add_(gj_tensor *x, gj_tensor *y);  /* x += y (y broadcast to x) */
GJ_API int gj_mul_(gj_tensor *x, gj_tensor *y);
GJ_API int gj_add_scaled_(gj_tensor *x, gj_tensor *y, double alpha); /* x += alpha*y */
GJ_API int gj_mul_scalar_(gj_tensor *x, double c);
GJ_API int gj_zero_(gj_tensor *x);
GJ_API int gj_copy_(gj_tensor *dst, gj_tensor *src); /* src broadcast to dst, cast */

/* ------------------------------------------------------------------- nn */

typedef struct gj_linear_layer {
    gj_tensor *weight; /* [out, in], owned by the layer (borrowed for users) */
    gj_tensor *bias;   /* [out] or NULL, owned by the layer (borrowed for users) */
    int64_t in_features, out_features;
} gj_linear_layer;
/* Kaiming-uniform like torch.nn.Linear. 0 on success. */
GJ_API int gj_linear_init(gj_linear_layer *l, int64_t in, int64_t out, bool bias, gj_dtype dtype);
GJ_API gj_tensor *gj_linear_forward(gj_linear_layer *l, gj_tensor *x);
GJ_API void gj_linear_free(gj_linear_layer *l);

typedef struct gj_layer_norm_layer {
    gj_tensor *weight, *bias; /* [C], owned by the layer (borrowed for users) */
    int64_t features;
    double eps;
} gj_layer_norm_layer;
GJ_API int gj_layer_norm_init(gj_layer_norm_layer *l, int64_t features, double eps, gj_dtype dtype);
GJ_API gj_tensor *gj_layer_norm_forward(gj_layer_norm_layer *l, gj_tensor *x);
GJ_API void gj_layer_norm_free(gj_layer_norm_layer *l);

typedef struct gj_embedding_layer {
    gj_tensor *weight; /* [V, D], owned by the layer (borrowed for users) */
    int64_t num, dim;
} gj_embedding_layer;
GJ_API int gj_embedding_init(gj_embedding_layer *l, int64_t num, int64_t dim, gj_dtype dtype);
GJ_API gj_tensor *gj_embedding_forward(gj_embedding_layer *l, gj_tensor *idx);
GJ_API void gj_embedding_free(gj_embedding_layer *l);

/* ------------------------------------------------------------ optimizers */

typedef struct gj_optim gj_optim;
/* params borrowed (retained by the optimizer). */
GJ_API gj_optim *gj_sgd_new(int n_params, gj_tensor *const *params, double lr, double momentum,
                     double weight_decay);
GJ_API gj_optim *gj_adamw_new(int n_params, gj_tensor *const *params, double lr, double beta1,
                       double beta2, double eps, double weight_decay);
/* Lion (Chen et al. 2023): c = beta1 m + (1 - beta1) g; p = p (1 - lr wd) -
 * lr sign(c); m = beta2 m + (1 - beta2) g. Usual: lr 1e-4 (3-10x below
 * AdamW's), beta1 0.9, beta2 0.99, weight_decay 3-10x AdamW's. */
GJ_API gj_optim *gj_lion_new(int n_params, gj_tensor *const *params, double lr, double beta1,
                             double beta2, double weight_decay);
GJ_API int gj_optim_step(gj_optim *o);
GJ_API void gj_optim_zero_grad(gj_optim *o); /* sets every .grad to NULL */
GJ_API void gj_optim_set_lr(gj_optim *o, double lr);
GJ_API void gj_optim_free(gj_optim *o);
/* The optimizer's state under prefix (NULL: "optim"), for checkpoints:
 * per parameter i (in the constructor's order) that has state, tensors
 * "<prefix>.<i>.momentum_buffer" (SGD with momentum) or
 * "<prefix>.<i>.exp_avg", "<prefix>.<i>.exp_avg_sq" and the i64 scalar
 * "<prefix>.<i>.step" (AdamW), or "<prefix>.<i>.exp_avg" (Lion), as
 * torch.optim names them; metadata
 * "<prefix>.kind" ("sgd"/"adamw"/"lion"), "<prefix>.n_params" and the
 * hyperparameters ("<prefix>.lr", ... exact decimal). The state tensors
 * are the optimizer's own (borrowed, the dict takes references): build the
 * dict right before saving. 0, or -1 with an error. */
GJ_API int gj_optim_state_dict_add(gj_optim *o, gj_state_dict *sd, const char *prefix);
/* Restores what gj_optim_state_dict_add stored into o (same kind, same
 * parameter count and shapes): state tensors are copied, parameters
 * without saved state get none (as before their first step), and the
 * hyperparameters (lr included) are set from the file. Checks everything
 * first; on a mismatch o is unchanged and the error lists every problem. */
GJ_API int gj_optim_load_state_dict(gj_optim *o, const gj_state_dict *sd, const char *prefix);

/* --------------------------------------------------- training utilities */

/* torch.nn.utils.clip_grad_norm_: the 2-norm of all the .grads of
 * params[0..n) together (parameters without a .grad are skipped; borrowed)
 * goes to *total_norm (may be NULL); when it exceeds max_norm every .grad is
 * scaled in place by max_norm / (norm + 1e-6). 0, or -1 with an error (bad
 * arguments; a non-finite norm, gradients then untouched). */
GJ_API int gj_clip_grad_norm(int n, gj_tensor *const *params, double max_norm,
                             double *total_norm);
/* Learning rate at `step` (from 0): StepLR, base_lr * gamma^(step / step_size). */
GJ_API double gj_lr_step(double base_lr, int64_t step, int64_t step_size, double gamma);
/* Linear warm-up over `warmup` steps (base_lr * (step + 1) / warmup), then a
 * cosine from base_lr down to min_lr at step `total` (and min_lr after).
 * NaN with an error for bad arguments. */
GJ_API double gj_lr_cosine(double base_lr, int64_t step, int64_t warmup, int64_t total,
                           double min_lr);
/* Indices (i64, new reference) of the largest values of x along axis, as
 * torch.argmax: the first of equal values, NaN counts as the largest. Not
 * differentiable. */
GJ_API gj_tensor *gj_argmax(gj_tensor *x, int axis, bool keepdim);
/* Fraction of rows of logits [N, K] whose argmax equals labels [N] (i64),
 * or NaN with an error. */
GJ_API double gj_accuracy(gj_tensor *logits, gj_tensor *labels);

/* ------------------------------------------ checkpoints (safetensors) */
/* A state dict is an ordered list of (name, tensor) plus string metadata,
 * as torch's state_dict; it is what checkpoints are saved from and loaded
 * into. Files use the safetensors format (8-byte little-endian header
 * length N, N bytes of JSON header padded with spaces to a multiple of 8,
 * then the raw little-endian data), readable by the safetensors, PyTorch
 * and numpy world. Dtypes: F32, F64, BF16, I64 (gj_dtype's four).
 * Names are non-empty valid UTF-8, unique, and not "__metadata__".
 * Resuming bit-identically: save the model (gj_*_state_dict_add), the
 * optimizer (gj_optim_state_dict_add) and the RNG (gj_rng_state_dict_add)
 * into one dict; load with gj_state_dict_copy_into, gj_optim_load_state_dict
 * and gj_rng_load_state_dict (docs/guide.md). */
/* New empty dict (free with gj_state_dict_free), or NULL with an error. */
GJ_API gj_state_dict *gj_state_dict_new(void);
/* Drops the dict's references to its tensors; NULL is ignored. */
GJ_API void gj_state_dict_free(gj_state_dict *sd);
/* Appends (name, t). t borrowed: the dict takes a reference of its own
 * (the tensor is shared, not copied: saving later saves its values then).
 * -1 with an error for a NULL or dead tensor, a bad or duplicate name. */
GJ_API int gj_state_dict_add(gj_state_dict *sd, const char *name, gj_tensor *t);
GJ_API int gj_state_dict_size(const gj_state_dict *sd);
/* Entry i (0 <= i < size) in order: name and tensor, both borrowed (valid
 * while the dict lives); NULL if i is out of range. */
GJ_API const char *gj_state_dict_name(const gj_state_dict *sd, int i);
GJ_API gj_tensor *gj_state_dict_tensor(const gj_state_dict *sd, int i);
/* The tensor named name (borrowed), or NULL (no error set) if absent. */
GJ_API gj_tensor *gj_state_dict_get(const gj_state_dict *sd, const char *name);
/* The tensors in order as an array of size entries (borrowed; valid until
 * the next gj_state_dict_add or free): e.g. an optimizer's parameter list. */
GJ_API gj_tensor *const *gj_state_dict_tensors(const gj_state_dict *sd);
/* String metadata ("__metadata__" of the file). set copies key and value
 * (valid UTF-8) and replaces an existing key. get: borrowed or NULL. */
GJ_API int gj_state_dict_set_metadata(gj_state_dict *sd, const char *key, const char *value);
GJ_API const char *gj_state_dict_get_metadata(const gj_state_dict *sd, const char *key);
GJ_API int gj_state_dict_metadata_size(const gj_state_dict *sd);
/* Metadata entry i: *key and *value borrowed. 0, or -1 if out of range. */
GJ_API int gj_state_dict_metadata_at(const gj_state_dict *sd, int i, const char **key,
                                     const char **value);

/* Writes sd to path (through a temporary file in the same directory,
 * then renamed over path, so an interrupted save leaves the old file).
 * Tensors are stored in the reference implementation's order (larger
 * element size first, then by name), non-contiguous views as contiguous
 * data. 0, or -1 with an error. */
GJ_API int gj_save_safetensors(const gj_state_dict *sd, const char *path);
/* The same file as bytes: *out receives malloc'd memory (free() it) of
 * *len bytes. 0, or -1 with an error. */
GJ_API int gj_save_safetensors_buffer(const gj_state_dict *sd, void **out, size_t *len);
/* Reads a safetensors file into a new dict (free with gj_state_dict_free)
 * holding new tensors (the dict owns them; not requiring grad), in the
 * header's order. The file is checked before anything is allocated for
 * data: a truncated file, a header length beyond the file, malformed or
 * non-strict JSON, unknown or unsupported dtypes, more than GJ_MAX_DIMS
 * dims, sizes that overflow, offsets that overlap, leave gaps or leave the
 * data region, a size that does not match the shape, duplicate names, are
 * each an error naming the file, the tensor and the problem (NULL). */
GJ_API gj_state_dict *gj_load_safetensors(const char *path);
/* The same from len bytes of memory (borrowed; copied). */
GJ_API gj_state_dict *gj_load_safetensors_buffer(const void *data, size_t len);

/* Copies the values of src's tensors into dst's tensors of the same names
 * (in place, under no-grad, bumping versions; dst's tensors keep their
 * identity, so optimizers and graphs holding them see the new values).
 * Every tensor of dst must be in src with the same dtype and shape; with
 * strict, src must not hold other names either (else they are ignored:
 * e.g. a checkpoint that also holds optimizer state). Checks everything
 * first: on any mismatch nothing is copied and the error lists every
 * missing name, unexpected name (strict), shape and dtype mismatch. */
GJ_API int gj_state_dict_copy_into(gj_state_dict *dst, const gj_state_dict *src, bool strict);
/* gj_load_safetensors(path) then gj_state_dict_copy_into(dst, it, strict). */
GJ_API int gj_load_safetensors_into(gj_state_dict *dst, const char *path, bool strict);

/* Parameters of the nn layers under stable names, as torch names them:
 * "<prefix>.weight" and "<prefix>.bias" (when the layer has one). The
 * tensors are the layer's own (borrowed; the dict takes references), so
 * gj_state_dict_copy_into with such a dict loads into the layer. */
GJ_API int gj_linear_state_dict_add(gj_linear_layer *l, gj_state_dict *sd, const char *prefix);
GJ_API int gj_layer_norm_state_dict_add(gj_layer_norm_layer *l, gj_state_dict *sd,
                                        const char *prefix);
GJ_API int gj_embedding_state_dict_add(gj_embedding_layer *l, gj_state_dict *sd,
                                       const char *prefix);

/* The RNG's whole state: its seed and the counter of values drawn so far
 * (randn, rand and dropout draw from the stream (seed, counter)). */
GJ_API void gj_rng_get_state(uint64_t *seed, uint64_t *counter);
GJ_API void gj_rng_set_state(uint64_t seed, uint64_t counter);
/* Stores / restores the RNG state as metadata "<prefix>.seed" and
 * "<prefix>.counter" (decimal; prefix NULL means "rng"). load: -1 with an
 * error (state unchanged) if missing or not decimal u64 values. */
GJ_API int gj_rng_state_dict_add(gj_state_dict *sd, const char *prefix);
GJ_API int gj_rng_load_state_dict(const gj_state_dict *sd, const char *prefix);

/* ------------------------------------------------------ data and text */

/* Reads an IDX file (the MNIST / Fashion-MNIST format; gzip-compressed or
 * plain), any of its element types (u8, i8, i16, i32, f32, f64), into a
 * new tensor of its shape: float dtypes get value * scale (1/255.0 maps
 * image bytes to [0, 1]), GJ_I64 the integers as they are (scale must be
 * 1). NULL with an error naming the file for a missing, damaged, truncated
 * or oversized file (trailing bytes included). */
GJ_API gj_tensor *gj_idx_load(const char *path, gj_dtype dtype, double scale);

/* Mini-batches over in-memory tensors that share their first dimension
 * (e.g. images [N, ...] and labels [N]): each epoch visits every row once,
 * in a permutation drawn from seed and the epoch number when shuffle
 * (reproducible, different each epoch), else in order; the last batch is
 * shorter unless drop_last. The iterator holds its own reference to (a
 * contiguous copy of) each tensor. */
typedef struct gj_batches gj_batches;
GJ_API gj_batches *gj_batches_new(int n_tensors, gj_tensor *const *tensors, int64_t batch,
                                  bool shuffle, bool drop_last, uint64_t seed);
/* The next batch: out[k] receives a new reference (rows of tensor k) and
 * true, or false at the end of the epoch (gj_last_error() empty) or on
 * error (set). */
GJ_API bool gj_batches_next(gj_batches *it, gj_tensor **out);
/* Starts the next epoch (a new permutation when shuffling). */
GJ_API void gj_batches_reset(gj_batches *it);
GJ_API int64_t gj_batches_len(const gj_batches *it); /* batches per epoch */
GJ_API void gj_batches_free(gj_batches *it);

/* ------------------------------------------- llm.c's files (GPT-2) */
/* The files of karpathy/llm.c's CPU trainer (train_gpt2.c), read and
 * written byte for byte as llm.c does, so a trainer can start from
 * gpt2_124M.bin, the token files of dev/data/ and gpt2_tokenizer.bin, and
 * llm.c can continue from a checkpoint written here. Each begins with 256
 * little-endian int32 (magic, version, ...). Readers check the magic, the
 * version, every size (positive, no overflow) and that the file's length is
 * exactly what the header announces before allocating anything; a bad file
 * is an error naming the function, the file and the field (never a crash).
 * Writers go through a temporary file renamed over the path. */

/* A model checkpoint's hyperparameters (header words 2..7). */
typedef struct gj_llmc_config {
    int max_seq_len;       /* maxT: rows of wpe (1024 for GPT-2) */
    int vocab_size;        /* V: real tokens (50257) */
    int num_layers;        /* L (12 for 124M) */
    int num_heads;         /* NH, dividing channels (12) */
    int channels;          /* C (768) */
    int padded_vocab_size; /* Vp >= V: rows of wte (50304) */
} gj_llmc_config;

/* The 16 parameter tensors, in llm.c's (and the file's) order:
 *   0 wte [Vp, C]    1 wpe [maxT, C]   2 ln1w [L, C]       3 ln1b [L, C]
 *   4 qkvw [L, 3C, C] 5 qkvb [L, 3C]   6 attprojw [L, C, C] 7 attprojb [L, C]
 *   8 ln2w [L, C]    9 ln2b [L, C]    10 fcw [L, 4C, C]   11 fcb [L, 4C]
 *  12 fcprojw [L, C, 4C] 13 fcprojb [L, C] 14 lnfw [C]   15 lnfb [C]
 * (weights [out, in], as gj_linear takes them). */
#define GJ_LLMC_N_PARAMS 16
/* "wte" ... "lnfb" (static), or NULL if i is out of range. */
GJ_API const char *gj_llmc_param_name(int i);
/* Shape of parameter i under cfg into shape[0..3); returns its ndim, or -1
 * with an error (NULL argument, i out of range). */
GJ_API int gj_llmc_param_shape(const gj_llmc_config *cfg, int i, int64_t *shape);
/* 0 if cfg is a valid configuration (every field positive, Vp >= V, C a
 * multiple of NH, sizes without int64 overflow), else -1 with an error
 * naming the field. */
GJ_API int gj_llmc_config_check(const gj_llmc_config *cfg);
/* Total parameter count (124475904 for GPT-2 124M), or -1 with an error. */
GJ_API int64_t gj_llmc_num_parameters(const gj_llmc_config *cfg);
/* Reads a checkpoint (magic 20240326, version 3: f32 parameters): *cfg
 * and params[0..16) (new references, in dtype GJ_F32 or GJ_F64, not
 * requiring grad). 0, or -1 with an error and params[] all NULL. */
GJ_API int gj_llmc_load_model(const char *path, gj_dtype dtype, gj_llmc_config *cfg,
                              gj_tensor **params);
/* Writes a version 3 checkpoint from params[0..16) (borrowed; f32 or f64,
 * each of its shape under cfg; f64 values are rounded to f32). 0 or -1. */
GJ_API int gj_llmc_save_model(const char *path, const gj_llmc_config *cfg,
                              gj_tensor *const *params);

/* Token files (magic 20240520, version 1: a count n, then n uint16 tokens).
 * The whole file as a new i64 tensor [n]; vocab_size > 0: every token must
 * be below it (else an error naming the file and the token's position). */
GJ_API gj_tensor *gj_llmc_load_tokens(const char *path, int64_t vocab_size);
/* Writes tokens[0..n), 1 <= n <= INT32_MAX. 0 or -1. */
GJ_API int gj_llmc_save_tokens(const char *path, const uint16_t *tokens, int64_t n);

/* Batches of a token file as llm.c's DataLoader serves them (one process,
 * one file): an epoch has (n - 1) / (B T) batches; batch k holds tokens
 * [k B T, (k+1) B T] (inputs the first B T as [B, T], targets the last B T);
 * after the last batch the next epoch starts at the beginning (the tail
 * that does not fill a batch is never used). With shuffle, each epoch
 * serves its batches in the order of a permutation drawn as llm.c's
 * shuffling train loader draws it (Fisher-Yates, Mersenne Twister seeded
 * 42; train_gpt2.c shuffles its train loader, not its val loader). The
 * whole file is checked when the loader is made (header, length, n >=
 * B T + 1, every token below vocab_size when > 0). NULL with an error. */
typedef struct gj_llmc_loader gj_llmc_loader;
GJ_API gj_llmc_loader *gj_llmc_loader_new(const char *path, int64_t B, int64_t T,
                                          int64_t vocab_size, bool shuffle);
/* The loader of process `rank` of `ranks` in data-parallel training, as
 * llm.c's DataLoader with process_rank and num_processes: an epoch has
 * (n - 1) / (ranks B T) batches; batch k of this rank holds tokens
 * [(k ranks + rank) B T, (k ranks + rank + 1) B T], its slice of the k-th
 * chunk of ranks B T tokens. Unshuffled, the ranks together read what one
 * process with batch ranks * B reads (its rows rank B .. rank B + B - 1);
 * shuffled, each rank draws its own chunk order (Mersenne Twister seeded
 * 42 + rank, as llm.c). gj_llmc_loader_new is rank 0 of 1. */
GJ_API gj_llmc_loader *gj_llmc_loader_new_rank(const char *path, int64_t B, int64_t T,
                                               int64_t vocab_size, bool shuffle, int rank,
                                               int ranks);
/* The next batch: *inputs, *targets receive new references (i64 [B, T]).
 * 0, or -1 with an error (both NULL). */
GJ_API int gj_llmc_loader_next(gj_llmc_loader *l, gj_tensor **inputs, gj_tensor **targets);
/* Back to the first batch, as llm.c's dataloader_reset (a new epoch: a
 * shuffling loader draws its next permutation). */
GJ_API void gj_llmc_loader_reset(gj_llmc_loader *l);
GJ_API int64_t gj_llmc_loader_num_tokens(const gj_llmc_loader *l);  /* -1 for NULL */
GJ_API int64_t gj_llmc_loader_num_batches(const gj_llmc_loader *l); /* per epoch */
/* Where the loader is, to resume: epoch (0 for the first, +1 per reset or
 * wrap) and batches served in it (0 ... num_batches). set: continues
 * exactly from there (a shuffling loader draws the permutations again).
 * 0, or -1 with an error. */
GJ_API int gj_llmc_loader_get_position(const gj_llmc_loader *l, int64_t *epoch, int64_t *batch);
GJ_API int gj_llmc_loader_set_position(gj_llmc_loader *l, int64_t epoch, int64_t batch);
GJ_API void gj_llmc_loader_free(gj_llmc_loader *l);

/* llm.c's tokenizer (magic 20240328): token id -> bytes, for printing
 * samples. Version 1 is GPT-2's (50257 pieces, end-of-text 50256); version
 * 2 stores the end-of-text id. NULL with an error. */
typedef struct gj_llmc_tokenizer gj_llmc_tokenizer;
GJ_API gj_llmc_tokenizer *gj_llmc_tokenizer_load(const char *path);
/* Writes a version 2 tokenizer of n pieces (pieces[i]: lens[i] bytes, 1 to
 * 255) with end-of-text eot (< n). 0 or -1. */
GJ_API int gj_llmc_tokenizer_save(const char *path, int64_t n, const char *const *pieces,
                                  const int *lens, int64_t eot);
GJ_API int64_t gj_llmc_tokenizer_vocab_size(const gj_llmc_tokenizer *t); /* -1 for NULL */
GJ_API int64_t gj_llmc_tokenizer_eot(const gj_llmc_tokenizer *t);        /* -1 for NULL */
/* The bytes of token id (borrowed, valid while t lives; NUL-terminated,
 * *len bytes not counting the NUL; len may be NULL), or NULL with an
 * error if id is out of range. */
GJ_API const char *gj_llmc_tokenizer_decode(const gj_llmc_tokenizer *t, int64_t id, size_t *len);
GJ_API void gj_llmc_tokenizer_free(gj_llmc_tokenizer *t);

/* t's values as text in the layout of PyTorch's repr ("tensor([[1.0000,
 * ...]], dtype=f32)"); a dimension longer than 2 * edge + 1 shows its first
 * and last edge entries around "..." (edge < 1: 3). A new string (free it
 * with gj_free_string), or NULL with an error. */
GJ_API char *gj_tensor_format(const gj_tensor *t, int edge);
GJ_API void gj_free_string(char *s);
/* gj_tensor_format(t, 3) and a newline on stdout. 0 or -1. */
GJ_API int gj_tensor_print(const gj_tensor *t);

/* ------------------------------------------------- compiled autograd */

GJ_API void gj_set_compiled_autograd(bool on); /* also GRADJIT_COMPILED_AUTOGRAD=1 */
GJ_API bool gj_compiled_autograd_enabled(void);

/* Why a backward ran eagerly although the flag was on (docs/fallbacks.md). */
typedef enum gj_ca_reason {
    GJ_CA_NO_LOWERING = 0,     /* an op or primitive the compiler cannot lower */
    GJ_CA_LLVM_ERROR,          /* LLVM failed (or the test switch forced it) */
    GJ_CA_RECORD_STREAM,       /* record_stream on a tensor of the graph */
    GJ_CA_SET_MISMATCH,        /* set_ with another dtype or shape than the graph's */
    GJ_CA_RECOMPILE_LIMIT,     /* too many distinct keys from one call site */
    GJ_CA_RETAIN_GRAPH,        /* retain_graph/create_graph not supported compiled */
    GJ_CA_HOOK_GUARD,          /* a hook behaved differently than during capture */
    GJ_CA_INCOMPATIBLE_MODE,   /* a setting incompatible with compiled mode (anomaly mode) */
    GJ_CA_OTHER,
    GJ_CA_LOCK_CONTENTION,     /* another thread's backward was writing a .grad this one writes */
    GJ_CA_UNTRACEABLE,         /* a compiled step's function did what a replay cannot redo */
    GJ_CA_N_REASONS
} gj_ca_reason;
GJ_API const char *gj_ca_reason_name(gj_ca_reason r); /* borrowed (static) */

/* Every backward counts once, when it ends: by how its program was found
 * if it ran compiled (compiles, mem_hits, disk_hits, instantiations), else
 * in fallbacks -- also one that found or compiled its program and then fell
 * back. So compiles + mem_hits + disk_hits + instantiations + fallbacks ==
 * backwards. */
typedef struct gj_ca_stats {
    int64_t backwards;    /* backward calls while the flag was on */
    int64_t compiles;     /* backwards that compiled their program and ran it */
    int64_t mem_hits;     /* ... that ran a program from the memory cache */
    int64_t disk_hits;    /* ... that ran a program loaded from the disk cache */
    int64_t fallbacks;    /* backwards that ran eagerly */
    double compile_ms;
    double run_ms;
    int64_t fallbacks_by_reason[GJ_CA_N_REASONS];
    /* The cache limits (gj_compiled_autograd_set_mem_cache_limit, ..._disk_...).
     * Counters (reset by gj_compiled_autograd_reset_stats): */
    int64_t mem_evictions;  /* entries evicted from the memory cache by its limit */
    int64_t disk_evictions; /* disk cache entries this process deleted for its limit */
    /* Levels now (not reset): */
    int64_t mem_bytes;      /* bytes the memory cache charges: programs (plan data and
                               machine code), keys, eager-only marks */
    int64_t mem_entries;    /* its entries (programs and eager-only keys) */
    int64_t disk_bytes;     /* bytes of the disk cache's entries after this process's
                               last save (0: none yet) */
    /* Counter (reset with the others): new keys that ran a program made
     * without compiling -- planned for their sizes and bound to kernels
     * compiled for other keys: a symbolic program's at another size
     * (gj_compiled_autograd_set_dynamic), or another call site's kernels of
     * the same description. Such a backward counts here, not in compiles
     * or hits. */
    int64_t instantiations;
} gj_ca_stats;
GJ_API void gj_compiled_autograd_stats(gj_ca_stats *out);
GJ_API void gj_compiled_autograd_reset_stats(void);
/* The message of the calling thread's last fallback, or when it has none
 * since the last reset the process's last one ("" if none): reason and
 * detail. Borrowed: overwritten by the next fallback; copy it to keep it. */
GJ_API const char *gj_compiled_autograd_last_fallback(void);
/* Quiet mode: no stderr line per fallback key (counters still count). */
GJ_API void gj_compiled_autograd_set_quiet(bool quiet);
/* Recompile limit: once n distinct keys of one call site have compiled
 * programs, every further new key of that site runs eagerly (reason
 * GJ_CA_RECOMPILE_LIMIT; remembered per key). A call site is the backward's
 * structure without shapes and attribute values: the same ops, edges,
 * creation order, dtypes and ranks (so a model run at many batch sizes is
 * one site). Default 8; n < 0: no limit; 0: nothing new compiles. */
GJ_API void gj_compiled_autograd_set_recompile_limit(int n);
/* Dynamic shapes, as PyTorch's compiled autograd after a recompile. AUTO
 * (the default): a call site's first program is specialised to its sizes;
 * when the site needs another program (a new batch size, sequence length,
 * eval batch), that one is symbolic: its kernels read every size, offset,
 * stride and loop block at run time, so a later new size is planned
 * (GEMM shapes, memory plan, schedule) and bound to those kernels without
 * compiling (gj_ca_stats.instantiations). A size that changes the code
 * (a stride that becomes 0 or 1, a dimension of 1 the plan merges away)
 * compiles again, symbolically. Bound programs do not count toward the
 * recompile limit. ALWAYS: every program is symbolic from the first
 * compile (its key differs from AUTO's). OFF: every new size compiles a
 * specialised program (the limit applies). Default AUTO, or the
 * environment variable GRADJIT_DYNAMIC=off|auto|always (read once; the
 * setter wins). */
typedef enum gj_ca_dynamic {
    GJ_CA_DYNAMIC_OFF = 0,
    GJ_CA_DYNAMIC_AUTO = 1,
    GJ_CA_DYNAMIC_ALWAYS = 2
} gj_ca_dynamic;
GJ_API void gj_compiled_autograd_set_dynamic(gj_ca_dynamic mode);
GJ_API gj_ca_dynamic gj_compiled_autograd_dynamic(void);
/* Size limits of the program caches, in bytes; bytes < 0: no limit.
 * Memory: compiled programs (plan data and machine code, freed with their
 * ORC resource tracker) and keys; when an insertion or a lower limit takes
 * it over, the least recently used entries are evicted (never the one in
 * use; a program a backward is running is freed when that run ends), and
 * an evicted key compiles again, or loads from disk, when next seen. It no
 * longer counts toward its call site's recompile limit. Default 256 MiB,
 * or GRADJIT_CACHE_MEM_LIMIT. Disk: after each save, the least recently
 * written or loaded entries are deleted until the cache directory's
 * entries fit (only gradjit's own entry files are counted or deleted).
 * Default 1 GiB, or GRADJIT_CACHE_DISK_LIMIT. The variables are read once
 * and take a whole number with an optional binary unit (512M, 2G, 65536,
 * 64KiB) or "none"; a setter wins over its variable. */
GJ_API void gj_compiled_autograd_set_mem_cache_limit(int64_t bytes);
GJ_API int64_t gj_compiled_autograd_mem_cache_limit(void);
GJ_API void gj_compiled_autograd_set_disk_cache_limit(int64_t bytes);
GJ_API int64_t gj_compiled_autograd_disk_cache_limit(void);

/* What the compiled program of the calling thread's last compiled backward
 * does (for profiles and benchmarks' lower bounds). gemms[] lists its BLAS
 * steps in order (at most GJ_CA_MAX_GEMMS; n_gemms counts them all). */
#define GJ_CA_MAX_GEMMS 64
typedef struct gj_ca_gemm {
    gj_dtype dtype;             /* of the operands (bf16: f32 result, summed in f32) */
    bool ta, tb;                /* operand transposes passed to BLAS */
    int64_t M, N, K, batch;     /* C[M,N] (+)= op(A)[M,K] op(B)[K,N], batch times */
    bool accumulate;            /* beta = 1: into an existing .grad */
} gj_ca_gemm;
typedef struct gj_ca_program_info {
    int instrs, kernel_instrs, gemm_instrs, other_instrs; /* the program's instructions, by kind */
    int kernel_functions;       /* distinct compiled kernels (identical ones are shared) */
    int code_parts;             /* object files of its machine code: kernels are compiled in
                                   up to one module per thread (at most 4) at once */
    int parallel_groups;        /* groups of instructions the program runs side by side */
    double gemm_flops;          /* 2*M*N*K*batch over the GEMM instructions */
    int64_t input_bytes;        /* graph inputs an instruction reads (saved tensors, seeds, .grad) */
    int64_t output_bytes;       /* new .grad written */
    int n_gemms;
    gj_ca_gemm gemms[GJ_CA_MAX_GEMMS];
    bool symbolic;              /* its kernels read the sizes at run time */
    bool bound;                 /* made for this key from kernels compiled for other keys */
    int shared_kernel_functions; /* of kernel_functions, those another program compiled
                                   (the same description): not compiled for this one */
} gj_ca_program_info;
/* 0 and *out filled, or -1 (error set) when this thread has run no
 * compiled backward yet. */
GJ_API int gj_compiled_autograd_last_program(gj_ca_program_info *out);

/* ------------------------------------------------ the compiled training step */
/* A whole training step -- forward, backward and the optimizer's update --
 * compiled into one program (docs/guide.md, "The compiled step"). The step
 * function builds the loss from the step's inputs with ordinary gj_* calls;
 * gj_step_run is then equivalent to
 *     gj_optim_zero_grad(opt); loss = fn(ctx, n_in, in);
 *     gj_backward(loss, NULL); [gj_clip_grad_norm(...);] gj_optim_step(opt);
 *     and, unless opts->keep_grads, gj_optim_zero_grad(opt) again
 * with the same bits in: the loss, the parameters, the optimizer state
 * (AdamW's step counts included), the generator's position, the .grad of
 * every parameter (none after the step, or the step's with keep_grads;
 * after a failed step exactly what the eager step leaves: none when fn or
 * a label check failed, the unclipped gradients when the clip norm was not
 * finite) and the .grad of every other leaf that requires grad and reaches
 * the loss (a step input or a tensor the function captures: accumulated,
 * as gj_backward does). One exception: a NaN's sign and payload bits may
 * differ (the program may fuse the operations that made it).
 * Its first run (and the first with new input shapes) runs fn eagerly
 * while it traces it, and compiles, and the program runs that step's
 * backward and update (with the eager step's bits; where the program calls
 * hooks, custom ops or a reducer, the eager backward and update finish the
 * first step); later runs run the program
 * without calling fn, after checking the guards of what the trace saw
 * (shapes, dtypes and layouts; which inputs, parameters and captured
 * tensors were the same tensor or shared memory; which required grad;
 * hooks; the variant key) and the values the eager ops check (class
 * labels, embedding indices: the same error, nothing updated). So fn must
 * compute the loss from its inputs, the optimizer's parameters and tensors
 * that do not change identity (a causal mask made once): it may not read
 * values (gj_tensor_item of any tensor), update tensors in place, register
 * hooks, draw random numbers other than gj_dropout's, reseed, or run a
 * backward or another step. What it does that a replay cannot redo makes
 * the step run eagerly from then on, with the reason counted
 * (gj_step_stats, GJ_CA_UNTRACEABLE) and printed once. C state fn reads
 * (a train flag, a scalar in ctx) is invisible to the library: name it
 * with gj_step_run_variant's key, and find what was missed with
 * check_every (GRADJIT_STEP_CHECK). Hooks registered before the step on
 * its leaves run inside the program where the eager step runs them (tensor
 * hooks; a parameter's post-accumulate hooks with its .grad set, the .grad
 * they leave being what the update uses); one that fails fails the step as
 * eagerly, one that calls gj_tensor_record_stream or set_s a tensor of the
 * step turns it eager (the reason counted). */
typedef struct gj_step gj_step;
/* Returns the step's loss: a 0-d float tensor (a new reference, as any op's
 * result), or NULL with an error. in[0..n_in) are borrowed. */
typedef gj_tensor *(*gj_step_fn)(void *ctx, int n_in, gj_tensor *const *in);
typedef struct gj_step_opts {
    bool eager;      /* every run eager (the reference the compiled step equals) */
    bool keep_grads; /* leave each parameter's .grad of the step after it */
    bool eval;       /* forward only: the loss under no_grad, no backward, no
                        update (opt may then be NULL) */
    double clip_norm; /* > 0: gj_clip_grad_norm(params, clip_norm) between the
                        backward and the update (a non-finite norm fails the
                        step, nothing updated, as the eager call does) */
    int check_every; /* > 0: check mode. Every check_every-th compiled run also
                        traces fn on its inputs and fails (-1, nothing updated)
                        with the first difference from the program's trace (ops,
                        attributes, shapes, captured tensors and their values,
                        a value read). 0: GRADJIT_STEP_CHECK=N if set, else off */
    struct gj_ddp *ddp; /* data parallel (gj_ddp_new over the optimizer's parameters
                        or some of them; it outlives the step): the gradients
                        are averaged over its ranks between the backward and the
                        clip and update. The eager step runs gj_ddp_wait there;
                        the compiled step gives each bucket its gradients as
                        soon as they are final (its allreduce runs while the
                        backward goes on) and updates each parameter once its
                        bucket is back: the same buckets, the same reduction,
                        the same bits as the eager step */
    gj_dtype autocast; /* GJ_BF16: mixed precision (gj_set_autocast) while fn
                        runs, eager or traced; parameters and optimizer state
                        stay as they are (f32 masters). GJ_F32 (0): off, even
                        when the calling thread has autocast on */
    size_t mem_budget; /* > 0: the most bytes the compiled step's temporaries
                        (activations kept for the backward, gradients, workspaces;
                        not parameters, optimizer state or inputs) may hold at
                        once. The program is planned under it: forward values the
                        backward reads are recomputed in the backward instead of
                        kept, cheapest per byte first (elementwise, then
                        reductions and norms, then attention, GEMMs last), with
                        the same kernels in the same order, so the step keeps
                        the eager step's bits. A checkpoint region's own policy
                        is never overridden. A budget the planner cannot meet
                        fails the run that compiles (the first run, and the
                        first of each new shape: -1, nothing updated) with an
                        error naming the smallest peak it reaches. 0:
                        GRADJIT_STEP_MEM_BUDGET_MB (MiB) if set, else none.
                        Refused for an eval step; an eager step ignores it */
    bool trace_computing; /* The first run of each new shape traces fn on
                        abstract inputs (shapes, no values: nothing computed
                        that depends on them) and its program computes the
                        whole step, the forward once; if fn needs a value
                        there (a read, a custom op's forward) or the step
                        cannot be compiled, it is traced again computing or
                        run eagerly, so fn runs twice in that run. true: that
                        run traces fn computing its forward eagerly (its
                        activations held until the program has run), fn
                        called once. false: GRADJIT_STEP_TRACE=computing if
                        set, else abstract. Steps with a gj_ddp, hooked
                        parameters or inputs that share memory or carry
                        history always trace computing */
} gj_step_opts;
/* opts NULL: all false (0). fn and ctx are borrowed for the step's life; so is
 * opt, whose parameters are the step's. NULL with an error. */
GJ_API gj_step *gj_step_new(gj_step_fn fn, void *ctx, gj_optim *opt, const gj_step_opts *opts);
/* One step on in[0..n_in) (borrowed). *loss_out (may be NULL) receives the
 * loss, a new 0-d tensor without history (owned by the innermost open
 * scope). 0, or -1 with an error (the step function's, or its backward's:
 * as for the eager step, parameters are then not updated).
 * gj_step_run is gj_step_run_variant with variant 0. */
GJ_API int gj_step_run(gj_step *s, int n_in, gj_tensor *const *in, gj_tensor **loss_out);
/* The same with a variant key: the C state that selects fn's graph (as
 * JAX's static arguments), e.g. 1 for training and 0 for evaluation when fn
 * reads a train flag in ctx. Each key has its own programs; a run replays
 * only a program traced with its key. */
GJ_API int gj_step_run_variant(gj_step *s, uint64_t variant, int n_in, gj_tensor *const *in,
                               gj_tensor **loss_out);
GJ_API void gj_step_free(gj_step *s);
/* Counters of every gj_step of the process, as gj_ca_stats: `backwards` is
 * the steps run; compiles / mem_hits / disk_hits / instantiations count the
 * steps that made or ran a program, fallbacks those that ran eagerly (with
 * their reason; gj_compiled_autograd_last_fallback's message starts with
 * "step: "). */
GJ_API void gj_step_stats(gj_ca_stats *out);
GJ_API void gj_step_reset_stats(void);
/* The memory of one step's compiled program (the variant its last
 * compiled run ran or compiled): */
typedef struct gj_step_memory {
    int64_t planned_peak_bytes; /* the most temporary bytes alive at once by its plan */
    int64_t saved_bytes;        /* forward values its backward reads (kept for it) */
    double recompute_flops;     /* FLOPs the backward spends recomputing forward values
                                   (0 without a budget, or when none was needed) */
    int64_t recomputed_values;  /* forward values recomputed */
    int64_t budget_bytes;       /* the budget it was planned under (0: none) */
} gj_step_memory;
/* 0, or -1 with an error (s or out NULL; no compiled program yet: an eager
 * step, or before the first run). */
GJ_API int gj_step_memory_stats(const gj_step *s, gj_step_memory *out);

/* ------------------------------------- runtime effects (helper "hooks") */
/* Hooks, streams, set_, custom ops and anomaly mode: the runtime effects
 * that compiled autograd must respect (docs/fallbacks.md). */

/* Tensor hook: called with the total gradient of the tensor it was
 * registered on (borrowed: do not release it) before that gradient flows
 * on; returns NULL or grad itself (as PyTorch's `lambda g: g`; no
 * reference is transferred, do not gj_retain it) to keep it, or a new
 * reference to a replacement of the same shape and dtype
 * (as everywhere, a tensor created while a scope is open belongs to the
 * scope: returning it is fine). Hooks run in registration order, under
 * no_grad, inside a scope of their own (their temporaries die when they
 * return). Non-leaf: when the gradient of that output of its grad_fn is
 * complete, before the grad_fn runs; leaf: before accumulation into .grad
 * (also for the inputs of gj_grad). The hook stays with the graph even if
 * the tensor is released, as in PyTorch. A hook that keeps the gradient
 * (NULL or grad) while an error raised inside it is still set (an op it
 * called failed; gj_last_error() non-empty) fails the backward with that
 * error: call gj_clear_error() for an error the hook handled. */
typedef gj_tensor *(*gj_grad_hook_fn)(gj_tensor *grad, void *user);
/* t must require grad. Returns a handle > 0, or -1 with an error. */
GJ_API int64_t gj_register_hook(gj_tensor *t, gj_grad_hook_fn fn, void *user);
/* Post-accumulate hook: called after .grad of leaf was written by a
 * backward (leaf borrowed, and so is its gj_tensor_grad; it may read or
 * replace .grad, e.g. with gj_tensor_set_ on it). Leaves that require grad
 * only. */
typedef void (*gj_post_accumulate_hook_fn)(gj_tensor *leaf, void *user);
GJ_API int64_t gj_register_post_accumulate_grad_hook(gj_tensor *leaf, gj_post_accumulate_hook_fn fn,
                                              void *user);
/* The same with flags. GJ_HOOK_NO_GRAPH_WRITES: fn promises to write no
 * tensor of the graph being differentiated (it reads .grad, copies it
 * away, starts work on a stream: a gradient reducer); a compiled backward
 * then calls it as soon as this leaf's .grad is final, between the
 * program's instructions, instead of after its last one (eager calls every
 * post-accumulate hook as soon as the .grad is written anyway). A hook
 * that breaks the promise gets unspecified gradients. */
#define GJ_HOOK_NO_GRAPH_WRITES 1u
GJ_API int64_t gj_register_post_accumulate_grad_hook_ex(gj_tensor *leaf,
                                                        gj_post_accumulate_hook_fn fn,
                                                        void *user, unsigned flags);
/* Removes a hook (0), or -1 if the handle is unknown or already removed. */
GJ_API int gj_remove_hook(int64_t handle);

/* Streams: an ordered queue of work run by its own thread. Events mark a
 * point of a stream (all work enqueued before the event was recorded). */
typedef struct gj_stream gj_stream;
typedef struct gj_event gj_event;
GJ_API gj_stream *gj_stream_new(void);                  /* NULL with an error */
GJ_API void gj_stream_free(gj_stream *s);               /* runs what is queued, then frees */
GJ_API int gj_stream_enqueue(gj_stream *s, void (*fn)(void *ctx), void *ctx);
GJ_API int gj_stream_synchronize(gj_stream *s);         /* waits for all work enqueued so far */
GJ_API gj_event *gj_stream_record_event(gj_stream *s);  /* NULL with an error */
GJ_API int gj_event_wait(gj_event *e);                  /* blocks until the point is passed */
GJ_API bool gj_event_query(gj_event *e);                /* true once the point is passed */
GJ_API void gj_event_free(gj_event *e);
/* Work enqueued on s after this call waits for e's point first. */
GJ_API int gj_stream_wait_event(gj_stream *s, gj_event *e);
/* t's storage is in use on s: when the storage dies, its memory is not
 * reused until s has passed the work enqueued up to that moment (which
 * includes everything enqueued before this call), as in PyTorch's caching
 * allocator. */
GJ_API int gj_tensor_record_stream(gj_tensor *t, gj_stream *s);
/* Frees every block the caching allocator keeps for reuse (gj_mem's
 * cached_bytes; blocks still waiting for a stream stay). Freed tensor
 * blocks are kept per size class (64-byte steps up to 1 MiB, four classes
 * per power of two above) up to GRADJIT_ALLOC_CACHE_MB (default 2048; 0
 * turns caching off); the cache is released when libc runs out of memory. */
GJ_API void gj_mem_release_cache(void);

/* dst shares src's storage, shape, strides, offset and dtype (the `.data =`
 * idiom); dst keeps its autograd identity (requires_grad, .grad, hooks).
 * dst's version moves past both old versions (the shared storage's counter
 * is raised, so src sees it too). Refused for a non-leaf that requires grad
 * while grad mode is on, and for a dst that requires grad when src's dtype
 * is not a float dtype. Not thread-safe against other uses of dst. */
GJ_API int gj_tensor_set_(gj_tensor *dst, gj_tensor *src);

/* Custom ops from plain C functions, described by a schema such as
 *   "mylib::scaled_gelu(Tensor x, float alpha) -> Tensor"
 *   "mylib::two(Tensor a, Tensor b) -> (Tensor, Tensor)"
 *   "mylib::shift(Tensor x, int k) -> Tensor"
 * Argument types: Tensor (C gj_tensor *, borrowed), float (C double), int
 * (C int64_t), bool (C bool). At least one Tensor argument (at most 8), at
 * most 4 float and 12 int/bool arguments, and 1 or 2 Tensor results.
 * Calling convention (through libffi):
 *   forward:  int fwd(<arguments in schema order>, gj_tensor **out0 [, **out1])
 *             writes a new reference to each output (or one of its
 *             borrowed arguments, as is or after gj_retain: that means
 *             "this value", and the op's output is a new tensor sharing its
 *             storage); returns 0, or non-zero on failure. Runs under
 *             no_grad in a scope of its own.
 *   backward: int bwd(gj_tensor *grad_out0 [, *grad_out1],
 *                     <arguments in schema order>,
 *                     gj_tensor **grad_in0, ..., one per Tensor argument)
 *             grad_out are borrowed (zeros when an output got no gradient);
 *             writes a new reference (or leaves NULL: no gradient) for each
 *             Tensor argument, of that argument's shape and dtype; writing
 *             a borrowed grad_out or argument itself, as is or after
 *             gj_retain, means "this value" (a straight-through estimator:
 *             *grad_in0 = grad_out0); returns 0 or non-zero (returning 0
 *             while an error raised inside is still set, gj_last_error()
 *             non-empty, fails as well). Runs under no_grad in a scope of
 *             its own.
 * backward_fn may be NULL (the op is then not differentiable: calling it on
 * inputs that require grad is an error). A name can be defined once; the op
 * lives until the process exits. NULL with an error on a bad schema. */
typedef struct gj_custom_op gj_custom_op;
GJ_API gj_custom_op *gj_custom_op_define(const char *schema, void *forward_fn, void *backward_fn);
/* The op defined under "ns::name", or NULL. Borrowed, like the pointer
 * gj_custom_op_define returns: the op lives until the process exits and
 * is never freed by the caller. */
GJ_API gj_custom_op *gj_custom_op_find(const char *name);
/* tensor_args: the Tensor arguments in schema order; scalar_args: the
 * other arguments in schema order, as doubles (int must be integral, bool
 * 0 or 1). outs receive new references. Records an autograd node when grad
 * mode is on and a tensor argument requires grad. 0 or -1 with an error. */
GJ_API int gj_custom_op_call(gj_custom_op *op, gj_tensor *const *tensor_args,
                      const double *scalar_args, gj_tensor **outs);

/* Anomaly mode: the eager engine checks every gradient an op produces for
 * NaN/Inf and fails naming the op; a backward in anomaly mode never runs
 * compiled (a warning is printed once). Process-wide. */
GJ_API void gj_set_anomaly_mode(bool on);
GJ_API bool gj_anomaly_mode_enabled(void);

/* ------------------------------------------------ activation checkpointing */

/* What to do with the outputs of one op inside a checkpoint region (as in
 * PyTorch's selective checkpointing). Eager honours SAVE/RECOMPUTE as
 * given; the compiled backward reads exactly what eager saved and
 * recomputes what eager recomputed (it may recompute a PREFER_SAVE op
 * when that lowers peak memory, never save more). */
typedef enum gj_ckpt_policy {
    GJ_CKPT_MUST_SAVE = 0,
    GJ_CKPT_PREFER_SAVE = 1,
    GJ_CKPT_MUST_RECOMPUTE = 2,
    GJ_CKPT_PREFER_RECOMPUTE = 3,
} gj_ckpt_policy;

/* The region's body: computes out[0..n_out) from in[0..n_in) (borrowed)
 * with gradjit ops. Store in out[k] a tensor computed here (as an op
 * returned it) or one of in[]; do not release it. Returns 0, or non-zero
 * on failure (set an error with the ops' own messages). */
typedef int (*gj_ckpt_fn)(void *user, int n_in, gj_tensor *const *in, int n_out,
                          gj_tensor **out);
/* Decides for the op named op_name ("matmul", "linear", "gelu", ... the
 * op definitions' names) at position (0, 1, ... in the region's op order). */
typedef gj_ckpt_policy (*gj_ckpt_policy_fn)(const char *op_name, int position,
                                            void *policy_data);

/* Runs fn(user, n_in, in, n_out, out) as an activation-checkpoint region:
 * only what policy saves is kept (policy NULL: nothing, everything is
 * recomputed); backward recomputes the rest from the region's inputs, then
 * runs the region's backward. Gradients flow to in[] and to every tensor
 * from outside the region that requires grad and is read inside
 * (parameters), exactly as without checkpointing. Dropout inside a region
 * draws the same mask when recomputed. fn runs inside its own scope
 * (gj_scope_push): its temporaries are freed when gj_checkpoint returns.
 * out[k] receive new references, 1 <= n_out <= 2, each a tensor header of
 * its own (never one of in[] or another out[q], even when fn stored the
 * same tensor there), owned as any op's result: by the innermost scope
 * open when gj_checkpoint returns -- the caller's, since fn's scope is
 * closed by then -- else by the caller, who releases them. With grad mode
 * on they carry the region's node; under no-grad fn simply runs and out[k]
 * shares the storage of what fn stored. Regions do not nest (a
 * gj_checkpoint inside fn fails with an error). Returns 0, or -1 with
 * gj_last_error() set and out[] all NULL. */
GJ_API int gj_checkpoint(gj_ckpt_fn fn, void *user, int n_in, gj_tensor *const *in, int n_out,
                  gj_tensor **out, gj_ckpt_policy_fn policy, void *policy_data);

/* ---------------------------------------------- data parallelism (MPI) */
/* Multi-process training over MPI (docs/distributed.md). Present in every
 * build; without MPI (GJ_MPI=OFF, or no MPI found at build time) every
 * function below fails with an error saying so, and gj_dist_available()
 * is false. Launch with mpirun; a process group is one MPI communicator
 * with an ordered communication stream: every collective of a group runs
 * on that stream's thread, in the order the calls were made, so all ranks
 * issue them in the same order. A collective that does not complete within
 * the group's timeout (GRADJIT_DIST_TIMEOUT seconds, default 300: a rank
 * died or took another path) fails with an error instead of hanging. */
typedef struct gj_pg gj_pg;
typedef struct gj_work gj_work;
typedef enum gj_reduce_op { GJ_REDUCE_SUM = 0, GJ_REDUCE_AVG = 1 } gj_reduce_op;

GJ_API bool gj_dist_available(void);
/* The world group: initialises MPI (thread level MULTIPLE) unless the
 * program already did, reading rank and size from mpirun's environment (a
 * process started without mpirun is rank 0 of 1). NULL with an error. */
GJ_API gj_pg *gj_pg_init(void);
/* A group over the caller's communicator: comm points to an MPI_Comm
 * (borrowed; the group duplicates it). MPI must be initialised. */
GJ_API gj_pg *gj_pg_from_comm(const void *mpi_comm);
GJ_API int gj_pg_rank(const gj_pg *pg); /* -1 for NULL */
GJ_API int gj_pg_size(const gj_pg *pg); /* -1 for NULL */
/* Waits for the group's pending work, frees it; MPI is finalised when the
 * last group of those gj_pg_init created goes and gradjit initialised it. */
GJ_API void gj_pg_free(gj_pg *pg);
GJ_API int gj_pg_barrier(gj_pg *pg);
/* Collectives on contiguous tensors (f32, f64, bf16; bf16 is reduced in
 * f32 and rounded once). Blocking: 0, or -1 with an error naming the
 * collective, the tensor's shape and dtype and MPI's message. t borrowed. */
GJ_API int gj_allreduce(gj_pg *pg, gj_tensor *t, gj_reduce_op op);
GJ_API int gj_broadcast(gj_pg *pg, gj_tensor *t, int root);
/* New reference [size * d0, d1, ...]: every rank's t (same shape) in rank order. */
GJ_API gj_tensor *gj_allgather(gj_pg *pg, gj_tensor *t);
/* New reference [d0 / size, d1, ...]: this rank's slice of the reduction
 * (d0 must be a multiple of size). */
GJ_API gj_tensor *gj_reduce_scatter(gj_pg *pg, gj_tensor *t, gj_reduce_op op);
/* Asynchronous allreduce: enqueued on the group's stream, returns at once.
 * t is retained until the work is waited for; do not touch its values
 * before. gj_work_wait blocks, returns the collective's status (error set
 * on failure) and frees the work. */
GJ_API gj_work *gj_allreduce_async(gj_pg *pg, gj_tensor *t, gj_reduce_op op);
GJ_API int gj_work_wait(gj_work *w);

/* Distributed data parallel (PyTorch's DDP): every rank holds the same
 * parameters, runs forward and backward on its shard of the batch, and
 * gj_ddp_wait leaves in every .grad the average over ranks. Gradients are
 * packed into buckets (bucket_bytes, in reverse parameter order, which is
 * the order backward finalises them); a bucket's allreduce starts, on the
 * group's stream, as soon as a post-accumulate hook saw its last gradient
 * (buckets start in index order on every rank, so the collectives match).
 * Works the same with compiled autograd on (the hooks do not make it fall
 * back). A parameter that got no gradient in a step (on some or all ranks)
 * counts as zeros; gj_ddp_wait starts any bucket still missing one, so no
 * rank waits for ever, and gives every such parameter the average too. */
typedef struct gj_ddp gj_ddp;
typedef struct gj_ddp_options {
    int64_t bucket_bytes; /* <= 0: 25 MiB */
    bool bf16_buckets;    /* send f32 gradients as bf16 (halves the bytes; rounds) */
    bool no_broadcast;    /* do not copy rank 0's parameters to every rank at start */
    /* ZeRO (Rajbhandari et al.): 1 shards the optimizer state, 2 also the
     * averaged gradients. Each bucket's elements (padded to a multiple of
     * the ranks) are split into one contiguous range per rank; the range's
     * part of each parameter is its shard (gj_ddp_shards: 1-D leaves that
     * are views of the parameters' memory), and the optimizer is made over
     * the shards, so its state is this rank's share only. gj_ddp_wait then
     * leaves the average in each shard's .grad (stage 1: from an allreduce,
     * stage 2: a reduce-scatter: only the shard's averages arrive) and
     * clears the parameters' .grads; after the optimizer's step,
     * gj_ddp_gather copies every rank's updated shards into every rank's
     * parameters (an allgather). A gj_step given such a gj_ddp (its
     * optimizer over the shards) does all of it, compiled too: its
     * program gives the parameters' gradients, takes its shards'
     * averages and updates them; the gather follows the program.
     * Parameters must travel as they are: f32/f64 (bf16 with
     * bf16_buckets). No clip_norm. 0: off.
     *
     * Stage 3 also keeps the parameters sharded at rest: the shards are
     * then memory of their own, and each parameter (given memory of its
     * own: one that viewed a larger tensor stops viewing it) holds no
     * bytes between reads. The first primitive that reads a parameter
     * gathers its bucket (an allgather of every rank's shards), the next
     * bucket starts gathering behind it, and at most 3 buckets stay
     * present (the least recently read go); the backward gathers again
     * what it reads. Reading a parameter is thus a collective: every
     * rank must read the same parameters in the same order (the same
     * model code), and writes to a parameter are lost at the next
     * release -- update the shards (the optimizer does), or write before
     * gj_ddp_new. gj_ddp_gather drops the gathered copies after the
     * update. A compiled step's program gathers the same way as its
     * instructions read the parameters (compiled autograd alone runs such
     * a backward eagerly). gj_ddp_free gives the parameters their memory
     * back (a collective). */
    int zero;
} gj_ddp_options;
typedef struct gj_ddp_stats {
    int n_buckets;
    int64_t steps;            /* gj_ddp_wait calls that reduced */
    int64_t allreduces;       /* bucket collectives issued */
    int64_t started_by_hook;  /* ... of which started from a hook during backward */
    int64_t bytes;            /* bytes sent into collectives */
    double comm_ms;           /* time in the collectives (on the stream) */
    double wait_ms;           /* time gj_ddp_wait (or a compiled step's takes of the
                                 averaged gradients, or a ZeRO-3 read waiting for its
                                 parameters' gather) blocked */
    /* ZeRO stage 3 */
    int64_t gathers;          /* parameter allgathers (a bucket each) */
    int64_t prefetches;       /* ... of which started ahead of a read */
    int max_units;            /* most buckets' parameters present at once */
    int units;                /* ... present now */
} gj_ddp_stats;
/* params borrowed (retained), leaves that require grad. opt may be NULL.
 * Broadcasts rank 0's values into every parameter unless opt->no_broadcast.
 * NULL with an error. */
GJ_API gj_ddp *gj_ddp_new(gj_pg *pg, int n_params, gj_tensor *const *params,
                          const gj_ddp_options *opt);
/* sync false: backwards accumulate locally with no communication (no_sync,
 * for micro-batches); the first backward after setting it true again
 * reduces the accumulated .grads. */
GJ_API void gj_ddp_set_sync(gj_ddp *d, bool sync);
/* Before the optimizer step: starts what has not started, waits for every
 * bucket and writes the averages into the .grads. 0, or -1 with an error
 * (a failed or timed-out collective; the .grads are then undefined). */
GJ_API int gj_ddp_wait(gj_ddp *d);
GJ_API int gj_ddp_stats_get(const gj_ddp *d, gj_ddp_stats *out);
/* Which bucket (0-based) parameter i is in, or -1. */
GJ_API int gj_ddp_bucket_of(const gj_ddp *d, int i);
/* ZeRO: this rank's shards, the parameters' parts it updates (in parameter
 * order, parameters with no part on this rank left out): *out receives a
 * borrowed array. Returns how many, or -1 with an error (not a ZeRO
 * gj_ddp). */
GJ_API int gj_ddp_shards(gj_ddp *d, gj_tensor *const **out);
/* ZeRO, after the optimizer's step over the shards: every rank's updated
 * shards into every rank's parameters (stage 3: the gathered copies
 * dropped; the next read gathers the updated values). 0, or -1 with an
 * error. */
GJ_API int gj_ddp_gather(gj_ddp *d);
/* ZeRO stage 3: every parameter's values gathered now and kept until the
 * next gj_ddp_gather (a collective): to read or save the whole model. 0,
 * or -1 with an error. */
GJ_API int gj_ddp_unshard(gj_ddp *d);
/* ZeRO stage 3, after gj_ddp_unshard: what was written into the parameters
 * since (a checkpoint loaded into them) kept: each rank's part copied into
 * its shards, then the gathered copies dropped. No collective. 0, or -1
 * with an error. */
GJ_API int gj_ddp_reshard(gj_ddp *d);
/* ZeRO checkpoints (collectives: every rank calls them). _add puts into sd
 * the state of opt (the optimizer over this ddp's shards) as an optimizer
 * of the same kind over the full parameters holds it -- what
 * gj_optim_state_dict_add of a plain (DDP or one-process) run writes under
 * prefix, every rank's shards gathered -- so one file, written by any
 * rank, is the whole model's. _load does the reverse: from such a state
 * (written by a ZeRO run on any number of ranks, or by a plain run) each
 * rank takes its shards' parts into opt. f32/f64 parameters. 0, or -1
 * with an error. */
GJ_API int gj_ddp_optim_state_dict_add(gj_ddp *d, gj_optim *opt, gj_state_dict *sd,
                                       const char *prefix);
GJ_API int gj_ddp_optim_load_state_dict(gj_ddp *d, gj_optim *opt, const gj_state_dict *sd,
                                        const char *prefix);
/* ZeRO checkpoints without gathering: this rank's shards of opt's state
 * into sd under prefix ("optim" if NULL), each parameter's part as
 * "<prefix>.<i>.<field>" (1-D) beside metadata "<prefix>.<i>.range" (its
 * start, length, the parameter's numel, ndim and shape), the optimizer's
 * own metadata and "<prefix>.zero.rank" / ".zero.ranks". No collective:
 * each rank writes its own file. 0, or -1 with an error. */
GJ_API int gj_ddp_optim_shard_dict_add(gj_ddp *d, gj_optim *opt, gj_state_dict *sd,
                                       const char *prefix);
/* The one-process optimizer state (what gj_optim_state_dict_add writes
 * under prefix, and what gj_ddp_optim_load_state_dict takes on any number
 * of ranks) assembled into out from the shard dicts of every rank of one
 * ZeRO run (n of them, any order). Refuses dicts of different runs, a rank
 * missing or twice, and ranges that do not tile a parameter. Needs no
 * gj_ddp and no MPI. 0, or -1 with an error. */
GJ_API int gj_zero_consolidate(int n, const gj_state_dict *const *shards, const char *prefix,
                               gj_state_dict *out);
GJ_API void gj_ddp_free(gj_ddp *d);

#ifdef __cplusplus
}
#endif
#endif /* GRADJIT_H */
