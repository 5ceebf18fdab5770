/* SPDX-License-Identifier: MIT */
/*
 * exec.c - running a plan (run.h): a small interpreter over the plan's
 * instructions -- fused kernels split across the thread pool, GEMMs (one
 * instruction or a group) as one pass of GEMM blocks, gathers and
 * scatters, folds, and the hook and call instructions that hand user code
 * to the caller's callbacks. The compiled backward (grads.c) and the
 * compiled step (step/) both run their programs here.
 *
 * Invariants:
 *   - Memory follows the plan's liveness: a temporary is allocated before
 *     its first instruction and freed after its last, a new output is
 *     allocated (by the caller's callback) just before the instruction that
 *     writes it.
 *   - Matmul instructions call the runtime's GEMM blocks exactly as the
 *     eager matmul kernel would for the same operand layouts (including its
 *     batch collapsing rule), so results agree with eager; an accumulating
 *     instruction (beta = 1) adds straight into an existing .grad.
 *   - A fold (IM2COL / COL2IM) calls the runtime's own core, reading its
 *     source in place through a strided view (eager's bits).
 *   - The interpreter never calls user code itself: hook and call
 *     instructions go to the caller's callbacks, and a callback's 1
 *     abandons the run (temporaries freed, outputs allocated so far the
 *     caller's).
 */
#include "jit/run/run.h"

#include "runtime/gj_math.h"

#include <string.h>
/* ------------------------------------------------------ matmul instructions */

/* The eager matmul kernel's batch collapsing rule (gj_k_mat_layout): a
 * batch of A row blocks stacked in memory against one shared B is one GEMM
 * with M * nbatch rows. Sets *M, *nbatch. */
static void mm_collapse(const gj_jit_matmul *m, int64_t *M, int64_t *nbatch) {
    int64_t nb = 1;
    for (int k = 0; k < m->nb; k++) nb *= m->bshape[k];
    *M = m->M;
    *nbatch = nb;
    bool collapse = nb > 1 && !m->ta;
    for (int k = 0; collapse && k < m->nb; k++) collapse = m->b_bstr[k] == 0 || m->bshape[k] == 1;
    if (collapse) {
        int64_t want = m->M * m->lda;
        for (int k = m->nb - 1; collapse && k >= 0; k--) {
            if (m->bshape[k] == 1) continue;
            collapse = m->a_bstr[k] == want;
            want *= m->bshape[k];
        }
    }
    if (collapse) {
        *M = m->M * nb;
        *nbatch = 1;
    }
}

/* The GEMMs of a group of matmul instructions as one list of blocks: instruction t
 * contributes nbatch[t] * split[t].parts blocks, block (batch, part) being
 * block `part` of gj_rt_gemm_split_of for that batch's GEMM -- the very
 * blocks the eager matmul kernel's gj_rt_sgemm call runs, so the bits are
 * the same, but all of them in one pass over the pool. */
typedef struct mm_group {
    const gj_jit_matmul *m[GJ_JIT_MAX_GROUP];
    int64_t M[GJ_JIT_MAX_GROUP], nbatch[GJ_JIT_MAX_GROUP], first[GJ_JIT_MAX_GROUP + 1];
    gj_rt_gemm_split split[GJ_JIT_MAX_GROUP];
    int n;
    void *const *bp;
} mm_group;

/* The GEMM of batch bi of matmul m (M rows after collapsing). */
static void mm_call(const gj_jit_matmul *m, int64_t M, int64_t nbatch, int64_t bi, void *const *bp,
                    gj_rt_gemm_call *c) {
    int64_t el = (int64_t)gj_rt_dtype_size(m->dtype), ael = m->bf16 ? 2 : el;
    int64_t ao = m->a_off, bo = m->b_off, rest = bi;
    for (int k = m->nb - 1; k >= 0 && nbatch > 1; k--) { /* unravel bi */
        int64_t ik = rest % m->bshape[k];
        rest /= m->bshape[k];
        ao += ik * m->a_bstr[k];
        bo += ik * m->b_bstr[k];
    }
    *c = (gj_rt_gemm_call){m->dtype == GJ_F64, m->ta, m->tb, M, m->N, m->K, 1.0,
                           (const char *)bp[m->a_buf] + ao * ael, m->lda,
                           (const char *)bp[m->b_buf] + bo * ael, m->ldb,
                           m->accumulate ? 1.0 : 0.0, (char *)bp[m->c_buf] + bi * M * m->N * el,
                           m->N, m->bf16};
}

static void mm_group_range(void *vctx, int64_t b, int64_t e) {
    const mm_group *g = vctx;
    int t = 0;
    for (int64_t i = b; i < e; i++) {
        while (i >= g->first[t + 1]) t++;
        int64_t r = i - g->first[t];
        int parts = g->split[t].parts;
        gj_rt_gemm_call c;
        mm_call(g->m[t], g->M[t], g->nbatch[t], r / parts, g->bp, &c);
        gj_rt_gemm_block(&c, &g->split[t], (int)(r % parts));
    }
}

/* Runs the matmul instructions [s, e) of p (one instruction, or a group of independent
 * ones, schedule.c) as one pass of GEMM blocks over the pool. */
static void run_matmuls(const gj_jit_plan *p, int s, int e, void *const *bp, int threads) {
    mm_group g;
    g.n = 0;
    g.bp = bp;
    g.first[0] = 0;
    for (int t = s; t < e; t++) {
        const gj_jit_matmul *m = &p->instrs[t].mm;
        int64_t M, nbatch;
        mm_collapse(m, &M, &nbatch);
        if (nbatch == 0 || M == 0 || m->N == 0) continue;
        if (m->K == 0) {
            if (!m->accumulate)
                memset(bp[m->c_buf], 0, (size_t)(nbatch * M * m->N) * gj_rt_dtype_size(m->dtype));
            continue;
        }
        int k = g.n++;
        g.m[k] = m;
        g.M[k] = M;
        g.nbatch[k] = nbatch;
        gj_rt_gemm_call c0;
        mm_call(m, M, nbatch, 0, bp, &c0);
        gj_rt_gemm_split_for(&c0, threads, &g.split[k]);
        g.first[k + 1] = g.first[k] + nbatch * g.split[k].parts;
    }
    if (g.n > 0) gj_rt_parallel_for(g.first[g.n], 1, mm_group_range, &g);
}

/* ------------------------------------------------------- index instructions */

#define GJ_JIT_SCOLS 256 /* columns per scatter task, as the eager kernel */

typedef struct gather_ctx {
    const gj_jit_index *x;
    const char *table;
    const int64_t *idx;
    char *out;
    size_t el;
} gather_ctx;

/* out[i, :] = table[idx[i], :] for i in [b, e). */
static void gather_range(void *vctx, int64_t b, int64_t e) {
    const gather_ctx *c = vctx;
    const gj_jit_index *x = c->x;
    int64_t D = x->D, el = (int64_t)c->el;
    for (int64_t i = b; i < e; i++) {
        const char *src = c->table + (x->src_off + c->idx[i] * x->src_s0) * el;
        char *dst = c->out + i * D * el;
        if (x->src_s1 == 1) {
            memcpy(dst, src, (size_t)(D * el));
        } else {
            for (int64_t j = 0; j < D; j++) memcpy(dst + j * el, src + j * x->src_s1 * el, (size_t)el);
        }
    }
}

typedef struct scatter_ctx {
    const gj_jit_index *x;
    const void *src; /* [n, D] */
    const int64_t *idx;
    void *acc; /* [V, D]: f32 (f32, bf16) or f64 */
} scatter_ctx;

/* Column chunks [b, e): every index in order adds its source row's chunk. */
static void scatter_range(void *vctx, int64_t b, int64_t e) {
    const scatter_ctx *c = vctx;
    int64_t D = c->x->D;
    for (int64_t ch = b; ch < e; ch++) {
        int64_t j0 = ch * GJ_JIT_SCOLS, j1 = j0 + GJ_JIT_SCOLS < D ? j0 + GJ_JIT_SCOLS : D;
        for (int64_t i = 0; i < c->x->n; i++) {
            int64_t r = c->idx[i];
            if (c->x->dtype == GJ_F64) {
                const double *restrict sp = (const double *)c->src + i * D;
                double *restrict a = (double *)c->acc + r * D;
                for (int64_t j = j0; j < j1; j++) a[j] += sp[j];
            } else if (c->x->dtype == GJ_BF16) {
                const uint16_t *restrict sp = (const uint16_t *)c->src + i * D;
                float *restrict a = (float *)c->acc + r * D;
                for (int64_t j = j0; j < j1; j++) a[j] += gj_m_bf16_to_f32(sp[j]);
            } else {
                const float *restrict sp = (const float *)c->src + i * D;
                float *restrict a = (float *)c->acc + r * D;
                for (int64_t j = j0; j < j1; j++) a[j] += sp[j];
            }
        }
    }
}

/* Runs an index instruction (plan.h). A scatter zero-fills its output
 * first, even a block new from the system: it writes a few rows, and the
 * pages it left untouched would be first touched by the run that reuses
 * the block, a later step, instead of this one. 0, or -1 with the error
 * set (a bad index: nothing written; out of memory). */
static int run_index(const gj_jit_index *x, void *const *bp) {
    const int64_t *idx = bp[x->idx_buf];
    const char *op = x->scatter ? "scatter_add_rows" : "gather_rows";
    for (int64_t i = 0; i < x->n; i++) {
        if (idx[i] < 0 || idx[i] >= x->V) {
            gj_rt_set_error("compiled backward: %s: index %lld at position %lld out of range "
                            "[0, %lld) (V = %lld)",
                            op, (long long)idx[i], (long long)i, (long long)x->V, (long long)x->V);
            return -1;
        }
    }
    size_t el = gj_rt_dtype_size(x->dtype);
    if (!x->scatter) {
        if (x->D <= 0 || x->n <= 0) return 0;
        gather_ctx c = {x, bp[x->src_buf], idx, bp[x->out_buf], el};
        gj_rt_parallel_for(x->n, x->D >= 32768 ? 1 : 32768 / x->D, gather_range, &c);
        return 0;
    }
    int64_t total = x->V * x->D;
    if (total <= 0) return 0; /* an empty [V, 0] or [0, D] output has no memory (NULL) */
    gj_rt_zero_fill(bp[x->out_buf], (size_t)total * el);
    if (x->n <= 0) return 0;
    void *acc = bp[x->out_buf];
    size_t acc_bytes = 0;
    if (x->dtype == GJ_BF16) { /* f32 scratch, rounded once */
        acc_bytes = (size_t)total * sizeof(float);
        acc = gj_rt_alloc_data_zero(acc_bytes);
        if (!acc) {
            gj_rt_set_error("compiled backward: scatter_add_rows: out of memory (%zu bytes)",
                            acc_bytes);
            return -1;
        }
    }
    scatter_ctx c = {x, bp[x->src_buf], idx, acc};
    int64_t chunks = (x->D + GJ_JIT_SCOLS - 1) / GJ_JIT_SCOLS, per = x->n * GJ_JIT_SCOLS;
    gj_rt_parallel_for(chunks, per >= 32768 ? 1 : 32768 / per, scatter_range, &c);
    if (acc != bp[x->out_buf]) {
        const float *a = acc;
        uint16_t *o = bp[x->out_buf];
        for (int64_t k = 0; k < total; k++) o[k] = gj_m_f32_to_bf16(a[k]);
        gj_rt_free_data(acc, acc_bytes);
    }
    return 0;
}

/* One gj_jit_plan_exec_calls, carried from instruction to instruction: the
 * plan, the callers' buffers and callbacks, and the interpreter's own
 * tables: bp[b] (buffer b's memory: the caller's for inputs, outputs and
 * params, else allocated here before its first instruction and freed
 * after its last), ctx[] (a kernel's arguments). */
typedef struct exec_run {
    const gj_jit_plan *p;
    void *const *in;
    const uint64_t *params;
    void **out;
    gj_jit_out_alloc alloc;
    void *actx;
    gj_jit_hook_call hook;
    gj_jit_custom_call call;
    gj_jit_input_fetch fetch;
    void *hctx;
    int threads;
    bool prof, instrs_log;
    void **bp, **ctx;
} exec_run;

/* The tables, and the buffers the caller gives. 0 or -1. */
static int ex_start(exec_run *x) {
    const gj_jit_plan *p = x->p;
    int max_params = 1;
    for (int s = 0; s < p->n_instrs; s++)
        if (p->instrs[s].kind == GJ_JIT_INSTR_KERNEL && p->instrs[s].k.n_params > max_params)
            max_params = p->instrs[s].k.n_params;
    unsigned lf = gj_jit_log_flags();
    x->prof = (lf & (GJ_JIT_LOG_PROF | GJ_JIT_LOG_INSTRS)) != 0;
    x->instrs_log = (lf & GJ_JIT_LOG_INSTRS) != 0;
    x->bp = gj_rt_calloc((size_t)p->n_bufs + 1, sizeof *x->bp);
    x->ctx = gj_rt_calloc((size_t)max_params + 1, sizeof *x->ctx); /* + a generic kernel's ints */
    if (!x->bp || !x->ctx) return -1;
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *bf = &p->bufs[b];
        if (bf->kind == GJ_JIT_BUF_INPUT) x->bp[b] = x->in[bf->index];
        else if (bf->kind == GJ_JIT_BUF_OUTPUT) x->bp[b] = x->out[bf->index];
        else if (bf->kind == GJ_JIT_BUF_PARAMS) x->bp[b] = (void *)(uintptr_t)x->params;
    }
    return 0;
}

/* The buffers whose first instruction is before e (from *fi on in the
 * plan's first-use order): an output by the caller's alloc, a temporary
 * here. 0 or -1. */
static int ex_alloc(exec_run *x, int *fi, int e) {
    const gj_jit_plan *p = x->p;
    for (; *fi < p->n_by_first && p->bufs[p->by_first[*fi]].first_instr < e; (*fi)++) {
        int b = p->by_first[*fi];
        const gj_jit_buffer *bf = &p->bufs[b];
        if (bf->kind == GJ_JIT_BUF_OUTPUT) {
            if (!x->out[bf->index])
                x->out[bf->index] = x->alloc ? x->alloc(x->actx, bf->index) : NULL;
            if (!x->out[bf->index]) return -1;
            x->bp[b] = x->out[bf->index];
        } else if (bf->nbytes > 0) {
            x->bp[b] = gj_rt_alloc_data(bf->nbytes);
            if (!x->bp[b]) return -1;
        }
    }
    return 0;
}

/* The buffers instruction st reads or writes, into b[] (at most cap);
 * returns how many. */
static int instr_bufs(const gj_jit_instr *st, int *b, int cap) {
    int n = 0;
#define ADD(x) do { if (n < cap) b[n++] = (x); } while (0)
    switch (st->kind) {
    case GJ_JIT_INSTR_MATMUL: ADD(st->mm.a_buf); ADD(st->mm.b_buf); ADD(st->mm.c_buf); break;
    case GJ_JIT_INSTR_INDEX: ADD(st->ix.src_buf); ADD(st->ix.idx_buf); ADD(st->ix.out_buf); break;
    case GJ_JIT_INSTR_FOLD: ADD(st->fd.src_buf); ADD(st->fd.out_buf); break;
    case GJ_JIT_INSTR_LCE: {
        int lb[8], nb = gj_jit_lce_bufs(&st->lc, lb);
        for (int k = 0; k < nb; k++) ADD(lb[k]);
        break;
    }
    case GJ_JIT_INSTR_HOOK: ADD(st->hk.src_buf); ADD(st->hk.out_buf); break;
    case GJ_JIT_INSTR_CALL:
        for (int k = 0; k < st->cs.n_in; k++) ADD(st->cs.src_buf[k]);
        break;
    default:
        for (int q = 0; q < st->k.n_params; q++) ADD(st->k.param_buf[q]);
        break;
    }
#undef ADD
    return n;
}

/* Before instructions s .. e-1: every program input they read made present
 * through x->fetch, in one epoch; bp[] points at it. 0 or -1. */
static int ex_fetch(exec_run *x, int s, int e) {
    const gj_jit_plan *p = x->p;
    uint64_t epoch = gj_rt_fetch_epoch();
    for (int k = s; k < e; k++) {
        int b[64];
        int n = instr_bufs(&p->instrs[k], b, 64);
        for (int j = 0; j < n; j++) {
            if (b[j] < 0 || p->bufs[b[j]].kind != GJ_JIT_BUF_INPUT) continue;
            const gj_jit_buffer *bf = &p->bufs[b[j]];
            if (!(x->bp[b[j]] = x->fetch(x->hctx, bf->index, epoch))) return -1;
        }
    }
    return 0;
}

/* A linear cross-entropy instruction: the eager kernel's core on the
 * program's buffers. 0 or -1 (a label out of range, OOM; error set). */
static int run_lce(const gj_jit_lce *x, void **bp) {
    size_t es = gj_rt_dtype_size(x->dtype);
    gj_rt_lce a = {.dt = x->dtype, .N = x->N, .C = x->C, .V = x->V, .ignore = x->ignore,
                   .h = (const char *)bp[x->h_buf] + x->h_off * (int64_t)es,
                   .w = (const char *)bp[x->w_buf] + x->w_off * (int64_t)es,
                   .labels = (const int64_t *)bp[x->lab_buf] + x->lab_off,
                   .b = x->b_buf >= 0 ? (const char *)bp[x->b_buf] + x->b_off * (int64_t)es : NULL,
                   .loss = bp[x->out_buf[0]]};
    void *out[4] = {NULL, NULL, NULL, NULL};
    for (int k = 1; k < 4; k++)
        if (x->grad && x->out_buf[k] >= 0) out[k] = (char *)bp[x->out_buf[k]] + x->out_off[k] * (int64_t)es;
    a.gh = out[1];
    a.gw = out[2];
    a.gb = out[3];
    return gj_rt_lce_run(&a);
}

/* Runs instructions s .. e-1 (e > s + 1: a group of GEMMs). 0, -1 (error
 * set), or what a hook or custom call returned. */
static int ex_instr(exec_run *x, int s, int e) {
    const gj_jit_plan *p = x->p;
    void **bp = x->bp;
    const gj_jit_instr *st = &p->instrs[s];
    if (st->kind == GJ_JIT_INSTR_MATMUL) {
        run_matmuls(p, s, e, bp, x->threads);
    } else if (st->kind == GJ_JIT_INSTR_INDEX) {
        if (run_index(&st->ix, bp) != 0) return -1;
    } else if (st->kind == GJ_JIT_INSTR_FOLD) {
        const gj_jit_fold *f = &st->fd;
        const char *src = (const char *)bp[f->src_buf] +
                          f->src_off * (int64_t)gj_rt_dtype_size(f->dtype);
        if (!f->col2im) {
            gj_rt_im2col_run(&f->win, f->dtype, src, f->src_st, f->pad, bp[f->out_buf]);
        } else if (gj_rt_col2im_run(&f->win, f->dtype, src, f->src_st, bp[f->out_buf]) != 0) {
            return -1;
        }
    } else if (st->kind == GJ_JIT_INSTR_LCE) {
        if (run_lce(&st->lc, bp) != 0) return -1;
    } else if (st->kind == GJ_JIT_INSTR_CALL) {
        if (!x->call) {
            gj_rt_set_error("compiled backward: a custom call step without a runner");
            return -1;
        }
        void *src[GJ_JIT_CALL_MAX_IN], *dst[GJ_RT_MAX_OUTPUTS];
        for (int k = 0; k < st->cs.n_in; k++) src[k] = bp[st->cs.src_buf[k]];
        for (int k = 0; k < st->cs.n_out; k++) dst[k] = bp[st->cs.out_buf[k]];
        int cr = x->call(x->hctx, &st->cs, src, dst);
        if (cr != 0) return cr;
    } else if (st->kind == GJ_JIT_INSTR_HOOK) {
        if (!x->hook) {
            gj_rt_set_error("compiled backward: a hook step without a hook runner");
            return -1;
        }
        int hr = x->hook(x->hctx, &st->hk, bp[st->hk.src_buf], bp[st->hk.out_buf]);
        if (hr != 0) return hr;
    } else if (st->k.rows > 0) {
        const gj_jit_kernel *k = &st->k;
        for (int q = 0; q < k->n_params; q++) x->ctx[q] = bp[k->param_buf[q]];
        x->ctx[k->n_params] = k->ints;
        gj_rt_parallel_for(k->rows, k->grain, k->fn, x->ctx);
    }
    return 0;
}

/* GRADJIT_LOG=prof,instrs: the time of instructions s .. e-1 (from t0). */
static void ex_prof(const exec_run *x, int s, int e, double t0) {
    const gj_jit_instr *st = &x->p->instrs[s];
    const char *what = st->kind == GJ_JIT_INSTR_MATMUL  ? "gemm"
                       : st->kind == GJ_JIT_INSTR_HOOK  ? "hook"
                       : st->kind == GJ_JIT_INSTR_CALL  ? "custom"
                       : st->kind == GJ_JIT_INSTR_LCE   ? "linear_cross_entropy"
                       : st->kind == GJ_JIT_INSTR_FOLD  ? (st->fd.col2im ? "col2im"
                                                                        : "im2col")
                       : st->kind == GJ_JIT_INSTR_INDEX ? (st->ix.scatter ? "scatter"
                                                                         : "gather")
                                                       : st->k.name;
    double ms = gj_jit_now_ms() - t0;
    if (x->instrs_log)
        fprintf(stderr, "[gradjit instrs] instr %d%s %s: %.3f ms\n", s,
                e - s > 1 ? "+" : "", what, ms);
    gj_jit_prof_instr(what, ms);
}

/* Frees the buffers whose last instruction is before e (from *li on in
 * the plan's last-use order). */
static void ex_free_dead(exec_run *x, int *li, int e) {
    const gj_jit_plan *p = x->p;
    for (; *li < p->n_by_last && p->bufs[p->by_last[*li]].last_instr < e; (*li)++) {
        int b = p->by_last[*li];
        if (x->bp[b]) gj_rt_free_data(x->bp[b], p->bufs[b].nbytes);
        x->bp[b] = NULL;
    }
}

int gj_jit_plan_exec_calls(const gj_jit_plan *p, void *const *in, const uint64_t *params,
                           void **out, gj_jit_out_alloc alloc, void *actx, gj_jit_hook_call hook,
                           gj_jit_custom_call call, gj_jit_progress progress,
                           gj_jit_input_fetch fetch, void *hctx) {
    exec_run x = {p, in, params, out, alloc, actx, hook, call, fetch, hctx, gj_rt_num_threads(),
                  false, false, NULL, NULL};
    int rc = ex_start(&x);
    int fi = 0, li = 0;
    for (int s = 0, e; rc == 0 && s < p->n_instrs; s = e) {
        e = p->instrs[s].group_end > s ? p->instrs[s].group_end : s + 1;
        rc = ex_alloc(&x, &fi, e);
        if (rc == 0 && fetch) rc = ex_fetch(&x, s, e);
        if (rc != 0) break;
        double t0 = x.prof ? gj_jit_now_ms() : 0;
        rc = ex_instr(&x, s, e);
        if (rc != 0) break;
        if (x.prof) ex_prof(&x, s, e, t0);
        ex_free_dead(&x, &li, e);
        if (progress && e < p->n_instrs && progress(hctx, e) != 0) rc = -1;
    }
    for (int o = 0; rc == 0 && o < p->n_outputs; o++) { /* outputs no instruction writes (none expected) */
        if (out[o] || p->bufs[p->out_buf[o]].kind != GJ_JIT_BUF_OUTPUT) continue;
        out[o] = alloc ? alloc(actx, o) : NULL;
        if (!out[o]) rc = -1;
    }
    if (rc != 0) {
        if ((!x.bp || !x.ctx) && rc < 0) gj_rt_set_error("compiled backward: out of memory");
        for (int b = 0; x.bp && b < p->n_bufs; b++)
            if (p->bufs[b].kind == GJ_JIT_BUF_TEMP && x.bp[b]) gj_rt_free_data(x.bp[b], p->bufs[b].nbytes);
    }
    gj_rt_free(x.bp);
    gj_rt_free(x.ctx);
    return rc;
}

int gj_jit_plan_exec(const gj_jit_plan *p, void *const *in, const uint64_t *params, void **out,
                     gj_jit_out_alloc alloc, void *actx) {
    return gj_jit_plan_exec_calls(p, in, params, out, alloc, actx, NULL, NULL, NULL, NULL, NULL);
}
