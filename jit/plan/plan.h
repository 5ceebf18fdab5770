/* SPDX-License-Identifier: MIT */
/*
 * plan.h - the execution plan of a captured graph (internal to jit/): fused
 * kernels, BLAS calls, the buffers they read and write, and the memory plan.
 * Built by plan.c from a gj_jit_graph, compiled by lower.c/llvmjit.c, run by
 * program.c.
 *
 * Vocabulary (dimension legend: S = a kernel's iteration space):
 *   - A buffer is a contiguous array of one dtype: a graph input's tensor
 *     data, a new .grad (a graph output), or a temporary.
 *     A "virtual" buffer has no memory: its elements are computed from their
 *     index (IOTA, DROPOUT_MASK), so views of it compose like real ones.
 *   - An access is a strided view of a buffer over a kernel's S:
 *     element (i0..i{nd-1}) is buffer[offset + sum ik*strides[k]]; stride 0
 *     broadcasts. Stores always have an injective map (no stride 0 except on
 *     reduced dims of a reduction output, where it accumulates).
 *   - A kernel is one fused group: expressions over S, evaluated once per
 *     element, stores of materialised values, and sums over the dims in
 *     `red` (all of its reductions share them). Its LLVM function is
 *     void fn(void *const *bufs, int64_t row_begin, int64_t row_end), where
 *     bufs[p] is the base pointer of buffer param_buf[p].
 *
 * Invariants:
 *   - Instructions are in execution order; an instruction reads only buffers written by
 *     earlier instructions or graph inputs.
 *   - Memory plan: a temporary is allocated (gj_rt_alloc_data) just before
 *     the first instruction that uses it and freed right after the last one; a new
 *     .grad just before the step that writes it. by_first / by_last list
 *     them in that order.
 *   - A value summed by a kernel is added in the eager SUM kernel's order,
 *     starting from 0, in double: that order follows the strides of the
 *     tensor eager reduces (runtime/kernels_reduce.c), so a kernel's dims
 *     are nested as it nests them (plan_kernel.c), and in inner mode the 8
 *     lanes run over eager's whole innermost run, which may span the last
 *     run_dims dims of the kernel (when an access, a broadcast operand,
 *     keeps the kernel from merging them); a MAX compares in double from
 *     -inf (NaN wins), like the eager MAX kernel.
 */
#ifndef GJ_JIT_PLAN_H
#define GJ_JIT_PLAN_H

#include "jit/ir/ir.h"

typedef enum gj_jit_buf_kind {
    GJ_JIT_BUF_INPUT = 0,  /* data of graph input #index */
    GJ_JIT_BUF_OUTPUT = 1, /* new .grad of graph output #index */
    GJ_JIT_BUF_TEMP = 2,   /* a temporary of the run */
    GJ_JIT_BUF_IOTA = 3,   /* virtual: element e = (e / gen_inner) % gen_len */
    GJ_JIT_BUF_DROPOUT = 4, /* virtual: element e = dropout_scale(seed, offset + e, p) */
    GJ_JIT_BUF_PARAMS = 5   /* the run's u64 parameters (seed, offset of each dropout) */
} gj_jit_buf_kind;

typedef struct gj_jit_buffer {
    gj_jit_buf_kind kind;
    int index;
    gj_dtype dtype;
    int64_t numel;
    size_t nbytes;
    int first_instr, last_instr; /* -1 until used */
    int writer;                /* while planning: the step producing it, -1 */
    /* virtual buffers */
    int64_t gen_inner, gen_len;
    uint64_t gen_seed, gen_offset; /* constants, when gen_param < 0 */
    int gen_param;                 /* run-time seed/offset: params[2k], params[2k+1] */
    double gen_p;
} gj_jit_buffer;

typedef struct gj_jit_access {
    int buf;
    gj_dtype dtype;
    int64_t offset;
    int64_t strides[GJ_MAX_DIMS];
} gj_jit_access;

typedef enum gj_jit_expr_kind {
    GJ_JIT_E_LOAD = 0,  /* access #access */
    GJ_JIT_E_CONST = 1, /* cval in dtype */
    GJ_JIT_E_OP = 2,    /* inst on args */
} gj_jit_expr_kind;

typedef struct gj_jit_expr {
    gj_jit_expr_kind kind;
    gj_dtype dtype; /* dtype of the value (bf16 values are rounded) */
    int access;
    double cval;
    gj_rt_inst inst;
    int args[3];
} gj_jit_expr;

typedef struct gj_jit_store {
    int access;
    int expr;
    bool reduce; /* accumulated over the reduced dims instead of = */
    bool max;    /* reduce: a MAX (NaN wins, from -inf) instead of a SUM (from 0) */
} gj_jit_store;

typedef struct gj_jit_kernel {
    int nd;
    int64_t dims[GJ_MAX_DIMS];
    uint32_t red; /* reduced dims (bit k = dim k) */
    /* inner mode (the last dim reduced): the lanes of every sum run over
     * the last run_dims dims as one run (row-major), not over the last dim
     * alone (0 or 1) */
    int run_dims;
    gj_jit_access *acc;
    int n_acc, cap_acc;
    gj_jit_expr *ex;
    int n_ex, cap_ex;
    gj_jit_store *st;
    int n_st, cap_st;
    /* schedule (plan_kernel.c) */
    int64_t block;     /* inner-dim block per row (outer mode) */
    int64_t nblk;      /* blocks per inner dim */
    int64_t rows;      /* parallel rows */
    int64_t grain;     /* rows per task, at least */
    int *param_buf;    /* kernel param p -> buffer id */
    int n_params;
    char name[48];
    gj_rt_range_fn fn; /* after compilation: fn(bufs, row_begin, row_end) */
    /* A generic plan's kernel reads its integers at run time from
     * bufs[n_params] = ints (see gj_jit_kint_acc); NULL otherwise. */
    int64_t *ints;
    int n_ints;
    bool generic; /* generic in a plan that is not (gj_jit_plan_make_kernels_generic) */
    /* fn is another program's compiled kernel of the same description
     * (cache/kernels.c's registry): not lowered or compiled with this plan; lent
     * is its symbol in that program's code ("<prefix>_<name>"), what the
     * disk cache records so that a later process finds it again */
    bool shared;
    char lent[96];
    /* An attention kernel (attn = GJ_P_ATTN_FWD or GJ_P_ATTN_BWD, else 0):
     * no accesses, expressions or stores; its function runs units [row
     * begin, row end) of runtime/attention.h's algorithm over its buffers
     * (param_buf: forward q k v out lse, backward q k v o go lse gq gk gv
     * ws) with the geometry of its integer table ints[GJ_ATTN_NI]
     * (attention.h), which lowering makes constants of the code unless the
     * kernel is generic. attn_dtype: q's dtype. */
    int attn;
    gj_dtype attn_dtype;
} gj_jit_kernel;

/* The column block of an outer-mode kernel with reduce stores is at most
 * this many columns (plan_kernel.c's schedule; a generic kernel's accumulators
 * have room for this many, and cache/kernels.c refuses to bind a kernel whose
 * block is larger). */
#define GJ_JIT_MAX_RED_BLOCK 512

/* A generic kernel's integer table: dims[0..nd), then per access a its
 * offset and strides[0..nd) (from gj_jit_kint_acc(k, a)), then block and
 * nblk (from gj_jit_kint_sched(k)), then per expression e the bits of its
 * constant (a CONST's value, the scalar of ADD/MUL/POW_SCALAR) as the
 * kernel computes with it: a float's bits, a double's, or an i64 (from
 * gj_jit_kint_const(k, e)). Constants are run-time values too because
 * sizes reach them (a mean's 1/N). */
static inline int gj_jit_kint_acc(const gj_jit_kernel *k, int a) { return k->nd + a * (k->nd + 1); }
static inline int gj_jit_kint_sched(const gj_jit_kernel *k) { return k->nd + k->n_acc * (k->nd + 1); }
static inline int gj_jit_kint_const(const gj_jit_kernel *k, int e) { return gj_jit_kint_sched(k) + 2 + e; }
static inline int gj_jit_kint_count(const gj_jit_kernel *k) { return gj_jit_kint_const(k, k->n_ex); }

/* A double converted to i64 as the eager kernels do: NaN 0, saturating. */
static inline int64_t gj_jit_sat_i64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

typedef struct gj_jit_matmul {
    gj_dtype dtype;  /* of C: f32 or f64 */
    bool bf16;       /* A and B are bf16 (a wide product: gj_rt_bgemm's blocks) */
    bool accumulate; /* C += op(A) op(B) (beta 1): C is an existing .grad */
    int a_buf, b_buf, c_buf;
    bool ta, tb; /* BLAS flags after folding storage transposition */
    int64_t M, N, K, lda, ldb;
    int64_t a_off, b_off;
    int nb;                       /* batch dims of the output */
    int64_t bshape[GJ_MAX_DIMS];  /* batch shape */
    int64_t a_bstr[GJ_MAX_DIMS];  /* batch strides (0: broadcast) */
    int64_t b_bstr[GJ_MAX_DIMS];
} gj_jit_matmul;

/* GATHER_ROWS / SCATTER_ADD_ROWS, run by C loops in program.c with the
 * eager kernels' order (runtime/kernels_index.c): indices idx_buf[0..n)
 * (contiguous i64) are all checked against [0, V) before anything is
 * written.
 *   gather:  out[i, :] = table[idx[i], :], table element (r, j) at
 *            src_off + r*src_s0 + j*src_s1; out contiguous [n, D].
 *   scatter: out[V, D] = zeros, then out[idx[i], :] += src[i, :] in index
 *            order (src contiguous [n, D]); f32 and bf16 add in f32 (bf16
 *            through a scratch, rounded once), f64 in f64. */
typedef struct gj_jit_index {
    bool scatter;
    gj_dtype dtype; /* of table / src and out */
    int src_buf, idx_buf, out_buf;
    int64_t n, D, V;
    int64_t src_off, src_s0, src_s1;
} gj_jit_index;

/* IM2COL / COL2IM, run by the runtime's own cores (gj_rt_im2col_run /
 * gj_rt_col2im_run, the eager kernels' code: the same bits, the same split
 * over (n, c) planes). The source is read through a strided view of
 * src_buf (element offset src_off, strides src_st over the source's 4 or 6
 * dims); out_buf is a new contiguous temporary of the output's meta. */
typedef struct gj_jit_fold {
    bool col2im;
    gj_dtype dtype;
    int src_buf, out_buf;
    int64_t src_off;
    int64_t src_st[6];
    gj_rt_win win;
    double pad; /* IM2COL: the value outside the image */
} gj_jit_fold;

/* LCE_FWD, run by the runtime's own core (gj_rt_lce_run, the eager
 * kernel's code: the same chunks, GEMMs and sums, so the same bits). h
 * [N, C], w [V, C], labels [N] (i64) and b [V] are dense in their buffers
 * from element offsets *_off (b_buf -1: no bias); out_buf: the loss (a 0-d
 * temporary) and, with grad, gh, gw and gb (-1 without a bias), new
 * contiguous temporaries. */
typedef struct gj_jit_lce {
    gj_dtype dtype;
    bool grad;
    int64_t N, C, V, ignore;
    int h_buf, w_buf, lab_buf, b_buf;
    int64_t h_off, w_off, lab_off, b_off;
    int out_buf[4];
    int64_t out_off[4]; /* element offsets of the outputs in their buffers */
} gj_jit_lce;

/* The buffers of x (inputs, then outputs) into b[0..8); returns how many. */
static inline int gj_jit_lce_bufs(const gj_jit_lce *x, int b[8]) {
    int n = 0, in[4] = {x->h_buf, x->w_buf, x->lab_buf, x->b_buf};
    for (int k = 0; k < 4; k++)
        if (in[k] >= 0) b[n++] = in[k];
    for (int k = 0; k < 4; k++)
        if (x->out_buf[k] >= 0) b[n++] = x->out_buf[k];
    return n;
}

/* An opaque call of tensor hook #hook (the program's hook table): the
 * run-time callback gets src_buf (contiguous, of meta) and writes the value
 * flowing on to out_buf (contiguous, same meta). Hook instructions run in the
 * engine's order (each depends on the previous one). */
typedef struct gj_jit_hook_instr {
    int hook;
    int src_buf, out_buf;
    gj_rt_meta meta;
} gj_jit_hook_instr;

/* An opaque call of the backward of the custom op at canonical node
 * #node (or op #tape of that checkpoint node's tape): the run-time callback gets src_buf[0..n_in) (contiguous, of
 * in_meta: the output gradients, then the saved tensor arguments) and
 * writes the gradient of the k-th argument set in `args` to out_buf[k] (contiguous,
 * out_meta[k]). Call instructions run in the engine's order (each after the
 * previous call or hook instruction). */
typedef struct gj_jit_call_instr {
    bool fwd;      /* the op's forward instead: src_buf are its tensor arguments,
                      out_buf its outputs (a checkpoint region's recomputation) */
    int node;
    int tape;      /* -1, or the op of checkpoint node #node's tape */
    uint32_t args; /* bit i: tensor argument i has an output (in order) */
    int n_in, n_out;
    int src_buf[GJ_JIT_CALL_MAX_IN];
    gj_rt_meta in_meta[GJ_JIT_CALL_MAX_IN];
    int out_buf[GJ_RT_MAX_OUTPUTS];
    gj_rt_meta out_meta[GJ_RT_MAX_OUTPUTS];
} gj_jit_call_instr;

typedef enum gj_jit_instr_kind {
    GJ_JIT_INSTR_KERNEL = 0,
    GJ_JIT_INSTR_MATMUL = 1,
    GJ_JIT_INSTR_INDEX = 2,
    GJ_JIT_INSTR_HOOK = 3,
    GJ_JIT_INSTR_CALL = 4,
    GJ_JIT_INSTR_FOLD = 5,
    GJ_JIT_INSTR_LCE = 6
} gj_jit_instr_kind;

typedef struct gj_jit_instr {
    gj_jit_instr_kind kind;
    int64_t pos;   /* ordering key while planning */
    int group_end; /* instructions [first of its group, group_end) run side by side (schedule.c) */
    gj_jit_kernel k;
    gj_jit_matmul mm;
    gj_jit_index ix;
    gj_jit_hook_instr hk;
    gj_jit_call_instr cs;
    gj_jit_fold fd;
    gj_jit_lce lc;
} gj_jit_instr;

typedef struct gj_jit_plan {
    gj_jit_buffer *bufs;
    int n_bufs, cap_bufs;
    gj_jit_instr *instrs;
    int n_instrs, cap_instrs;
    size_t peak_temp_bytes; /* most temporary bytes alive at once */
    int *by_first;          /* temporaries and outputs by first instruction */
    int n_by_first;
    int *by_last;           /* temporaries by last instruction */
    int n_by_last;
    int n_inputs, n_outputs;
    gj_rt_meta *in_meta;  /* per graph input */
    gj_rt_meta *out_meta; /* per graph output: the new .grad's meta */
    int *out_buf;         /* per graph output: buffer holding it (input buffer if in place) */
    int n_rt_params;      /* run-time (seed, offset) pairs */
    int *rt_param_node;   /* pair k comes from this canonical (dropout) node's attrs */
    int *rt_param_tape;   /* ... or, when >= 0, from op #rt_param_tape[k] of the tape of
                             checkpoint node #rt_param_node[k] */
    int params_buf;       /* the GJ_JIT_BUF_PARAMS buffer, or -1 */
    int n_par_groups;     /* groups of instructions run side by side (schedule.c) */
    /* Generic (symbolic sizes, generic.c): the kernels' machine code does not
     * depend on the sizes, offsets and schedule of this plan -- they are read
     * from each kernel's ints -- so one compiled kernel serves every plan
     * whose kernel has the same generic description. */
    bool generic;
} gj_jit_plan;

/* Whether kernel k of plan p reads its integers at run time. */
static inline bool gj_jit_kernel_generic(const gj_jit_plan *p, const gj_jit_kernel *k) {
    return p->generic || k->generic;
}

/* schedule.c: pairs independent GEMM instructions when that costs no memory (see
 * its contract). order runs once before the memory plan; groups sets
 * group_end from the order. Each returns 0, or -1 on OOM. */
#define GJ_JIT_MAX_GROUP 2
int gj_jit_schedule_order(gj_jit_plan *p);
int gj_jit_schedule_groups(gj_jit_plan *p);

/* memplan.c: liveness of every buffer, the run's allocation and release
 * order, and the peak of temporary bytes (see its contract). 0, or -1 on
 * OOM. */
int gj_jit_plan_memory(gj_jit_plan *p);

/* dedupe.c: every kernel whose description equals an earlier kernel's takes
 * that kernel's name (one function per distinct kernel; for a generic plan
 * the generic description, gj_jit_kernel_describe). 0, or -1 on OOM. */
int gj_jit_dedupe_kernels(gj_jit_plan *p);
/* The bytes that determine kernel k's machine code (generic: without the
 * sizes, offsets, schedule and strides other than 0 and 1) into *b (a
 * wbuf, base/wbuf.h). */
struct wbuf;
void gj_jit_kernel_describe(const gj_jit_plan *p, const gj_jit_kernel *k, bool generic,
                            struct wbuf *b);


/* Builds the plan of g (after gj_jit_pass_cse_dce). Returns 0; or -1 with
 * why[] set ("no lowering for X", or an OOM message) and the error set. */
int gj_jit_plan_build(const gj_jit_graph *g, gj_jit_plan *p, char *why, size_t why_cap);
void gj_jit_plan_free(gj_jit_plan *p);
void gj_jit_plan_print(const gj_jit_plan *p, FILE *f);

/* --------------------------------- a step's memory budget (remat.c) */

typedef struct gj_jit_remat {
    size_t budget;       /* in: the most temporary bytes alive at once (> 0) */
    int hint_k;          /* in: n_dropped of an earlier plan of this graph (0: none) */
    uint64_t hint_order; /* in: that plan's order */
    size_t peak;         /* out: the planned peak of the graph left in g */
    size_t min_peak;     /* out: the smallest planned peak any choice tried reached */
    int n_dropped;       /* out: saved forward values now recomputed in the backward */
    uint64_t order;      /* out: a hash of the order candidates are dropped in */
    bool searched;       /* out: the choice was searched (not a hint, nor nothing) */
} gj_jit_remat;

/* Runs the graph passes on g (as gj_jit_program_plan does), then, when its
 * planned peak of temporaries is over out->budget, rewrites g to
 * recompute saved forward values in the backward (remat.c's contract),
 * cheapest first, as few as its trials find fit. 0 (g fits: rewritten or as it
 * was), 1 (nothing the pass can choose fits: g is as after the passes,
 * out->min_peak the smallest peak reached) or -1 (why[] set: out of
 * memory, or the plan failed as gj_jit_plan_build does). */
int gj_jit_pass_remat(gj_jit_graph *g, gj_jit_remat *out, char *why, size_t why_cap);
/* With a hint (hint_k > 0 and hint_order this graph's order) the first
 * hint_k candidates are tried first, and taken if they fit: one trial plan
 * instead of a search. A hint that does not fit is ignored. */
/* The trial plans gj_jit_pass_remat made in this process (tests). */
int64_t gj_jit_remat_trials(void);
/* What g (after its passes) keeps and recomputes: the bytes of the
 * forward values its backward reads (each base once; generators, which
 * have no memory, not counted), the FLOPs of its recomputed nodes and how
 * many values they make (views and generators not counted). saved_bytes
 * is 0 when out of memory. */
void gj_jit_remat_stats(const gj_jit_graph *g, int64_t *saved_bytes, double *flops, int64_t *n);

/* Test switch: while prim >= 0, the planner has "no lowering" for that
 * primitive (every primitive of the foundation has one; this is how the
 * tests reach the GJ_CA_NO_LOWERING fallback). -1 turns it off. */
void gj_jit_test_no_lowering(int prim);

/* --------------------------------------------- symbolic plans (symbolic.c) */

/* Makes p generic: fills every kernel's integer table (plan.h) and gives
 * kernels with one generic description one name. 0, or -1 on OOM. */
int gj_jit_plan_make_generic(gj_jit_plan *p);
/* Undoes gj_jit_plan_make_generic (the plan compiles specialised; kernels
 * made generic one by one stay so). 0, or -1 on OOM. */
int gj_jit_plan_make_specific(gj_jit_plan *p);
/* Makes the kernels of instructions s with pick[s] generic in a plan that
 * is not (a training step's updates: one compiled kernel serves every
 * parameter whose update has the same generic description, whatever its
 * length and hyperparameter slot). 0, or -1 on OOM. */
int gj_jit_plan_make_kernels_generic(gj_jit_plan *p, const bool *pick);
/* Whether generic kernel code has room for k's column accumulators
 * (its block at most GJ_JIT_MAX_RED_BLOCK when it has reduce stores). */
bool gj_jit_generic_block_ok(const gj_jit_kernel *k);
/* The kernel signature of generic plan p into *b (a wbuf): per kernel instruction
 * its name, and at a name's first instruction the kernel's generic description.
 * Two plans with equal signatures call the same kernel functions under
 * the same names. 0, or -1 on OOM. */
int gj_jit_generic_signature(const gj_jit_plan *p, wbuf *b);

/* A kernel's code: its expressions (instruction of each, zero for loads
 * and constants) and its stores -- the part of a kernel the disk cache and
 * dedupe.c both serialise. generic: without the constants and the
 * instructions' fields other than the primitive and its input count,
 * which a generic kernel does not build into its code (sizes reach them:
 * a mean's 1/N, the shapes of the ops they came from; lower.c). */
static inline void wbuf_kernel_code(wbuf *b, const gj_jit_kernel *k, bool generic) {
    if (k->attn) { /* (written only for attention kernels: other kernels' bytes are as before) */
        wbuf_i64(b, -(int64_t)k->attn);
        wbuf_i64(b, k->attn_dtype);
        wbuf_i64(b, k->n_ints);
        if (!generic)
            for (int i = 0; i < k->n_ints; i++) wbuf_i64(b, k->ints[i]);
    }
    wbuf_i64(b, k->n_ex);
    for (int e = 0; e < k->n_ex; e++) {
        const gj_jit_expr *x = &k->ex[e];
        wbuf_i64(b, x->kind);
        wbuf_i64(b, x->dtype);
        wbuf_i64(b, x->access);
        if (generic) {
            wbuf_i64(b, x->inst.prim);
            wbuf_i64(b, x->inst.n_in);
        } else {
            wbuf_f64(b, x->cval);
            wbuf_inst(b, &x->inst);
        }
        for (int q = 0; q < 3; q++) wbuf_i64(b, x->args[q]);
    }
    wbuf_i64(b, k->n_st);
    for (int q = 0; q < k->n_st; q++) {
        const gj_jit_store *x = &k->st[q];
        wbuf_i64(b, x->access);
        wbuf_i64(b, x->expr);
        /* (a run over several dims only changes the words of kernels that
         * have one: an older cache entry's plan blob differs exactly there) */
        uint64_t run = x->reduce && k->run_dims > 1 ? (uint64_t)k->run_dims : 0;
        wbuf_u64(b, (uint64_t)x->reduce | (uint64_t)x->max << 1 | run << 2);
    }
}

#endif /* GJ_JIT_PLAN_H */
