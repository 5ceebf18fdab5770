/*
 * program.c - building a program from a captured graph, and running a plan:
 * a small interpreter over the plan's steps (fused kernels split across the
 * thread pool, BLAS calls) -- the "C-side program" form of the compiled
 * backward.
 *
 * Invariants:
 *   - Memory follows the plan's liveness: a temporary is allocated before
 *     its first step and freed after its last, a new .grad is allocated
 *     (by the caller's callback) just before the step that writes it.
 *   - Matmul steps call gj_rt_sgemm/gj_rt_dgemm exactly as the eager matmul
 *     kernel would for the same operand layouts (including its batch
 *     collapsing rule), so results agree with eager; an accumulating step
 *     (beta = 1) adds straight into an existing .grad.
 */
#include "program.h"

#include <string.h>
#include <time.h>

static double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static atomic_llong g_next_prefix;

gj_jit_program *gj_jit_program_build(gj_jit_graph *g, const char *prefix, void **obj_out,
                                     size_t *obj_size, char *why, size_t why_cap,
                                     bool *permanent) {
    *permanent = false;
    char auto_prefix[32];
    if (!prefix) {
        snprintf(auto_prefix, sizeof auto_prefix, "gjp%lld",
                 (long long)atomic_fetch_add(&g_next_prefix, 1));
        prefix = auto_prefix;
    }
    why[0] = '\0';
    gj_jit_program *pr = gj_rt_calloc(1, sizeof *pr);
    if (!pr) {
        snprintf(why, why_cap, "out of memory");
        return NULL;
    }
    if (gj_jit_log_flags() & GJ_JIT_LOG_GRAPH) {
        fprintf(stderr, "[gradjit graph] captured\n");
        gj_jit_graph_print(g, stderr);
    }
    if (gj_jit_pass_cse_dce(g) != 0) {
        snprintf(why, why_cap, "out of memory in CSE/DCE");
        goto fail;
    }
    if (gj_jit_log_flags() & GJ_JIT_LOG_GRAPH) {
        fprintf(stderr, "[gradjit graph] after CSE/DCE\n");
        gj_jit_graph_print(g, stderr);
    }
    if (gj_jit_plan_build(g, &pr->plan, why, why_cap) != 0) {
        *permanent = strncmp(why, "no lowering", 11) == 0 || strncmp(why, "internal", 8) == 0;
        goto fail;
    }
    if (gj_jit_log_flags() & GJ_JIT_LOG_PLAN) gj_jit_plan_print(&pr->plan, stderr);
    pr->n_inputs = g->n_inputs;
    pr->n_outputs = g->n_outputs;
    pr->inputs = gj_rt_calloc((size_t)g->n_inputs + 1, sizeof *pr->inputs);
    pr->outputs = gj_rt_calloc((size_t)g->n_outputs + 1, sizeof *pr->outputs);
    if (!pr->inputs || !pr->outputs) {
        snprintf(why, why_cap, "out of memory");
        goto fail;
    }
    memcpy(pr->inputs, g->inputs, (size_t)g->n_inputs * sizeof *pr->inputs);
    memcpy(pr->outputs, g->outputs, (size_t)g->n_outputs * sizeof *pr->outputs);
    for (int i = 0; i < g->n_inputs; i++)
        if (g->inputs[i].role == GJ_JIT_IN_OTHER) pr->recapture = true;
    pr->code = gj_jit_code_compile(&pr->plan, prefix, obj_out, obj_size, why, why_cap);
    if (!pr->code) {
        *permanent = strncmp(why, "LLVM", 4) == 0;
        goto fail;
    }
    return pr;
fail:
    gj_jit_program_free(pr);
    return NULL;
}

void gj_jit_program_free(gj_jit_program *pr) {
    if (!pr) return;
    gj_jit_code_free(pr->code);
    gj_jit_plan_free(&pr->plan);
    gj_rt_free(pr->inputs);
    gj_rt_free(pr->outputs);
    gj_rt_free(pr);
}

/* ---------------------------------------------------------------- run */

/* gj_k_mat_layout of the eager matmul: operand storage (rows r, cols c,
 * strides sr, sc) as row-major (flip false) or as its transpose. */
static void run_matmul(const gj_jit_matmul *m, void *const *bp) {
    size_t el = gj_rt_dtype_size(m->dtype);
    int64_t M = m->M, N = m->N, K = m->K;
    char *C = bp[m->c_buf];
    int64_t nbatch = 1;
    for (int k = 0; k < m->nb; k++) nbatch *= m->bshape[k];
    if (nbatch == 0 || M == 0 || N == 0) return;
    if (K == 0) {
        if (!m->accumulate) memset(C, 0, (size_t)(nbatch * M * N) * el);
        return;
    }
    bool collapse = nbatch > 1 && !m->ta;
    for (int k = 0; collapse && k < m->nb; k++) collapse = m->b_bstr[k] == 0 || m->bshape[k] == 1;
    if (collapse) {
        int64_t want = M * m->lda;
        for (int k = m->nb - 1; collapse && k >= 0; k--) {
            if (m->bshape[k] == 1) continue;
            collapse = m->a_bstr[k] == want;
            want *= m->bshape[k];
        }
    }
    if (collapse) {
        M *= nbatch;
        nbatch = 1;
    }
    const char *A = bp[m->a_buf], *B = bp[m->b_buf];
    int64_t idx[GJ_MAX_DIMS] = {0};
    for (int64_t bi = 0; bi < nbatch; bi++) {
        int64_t ao = m->a_off, bo = m->b_off;
        for (int k = 0; k < m->nb; k++) {
            ao += idx[k] * m->a_bstr[k];
            bo += idx[k] * m->b_bstr[k];
        }
        char *cp = C + (size_t)(bi * M * N) * el;
        if (m->dtype == GJ_F32)
            gj_rt_sgemm(m->ta, m->tb, M, N, K, 1.0f, (const float *)(const void *)(A + ao * (int64_t)el),
                        m->lda, (const float *)(const void *)(B + bo * (int64_t)el), m->ldb,
                        m->accumulate ? 1.0f : 0.0f, (float *)(void *)cp, N);
        else
            gj_rt_dgemm(m->ta, m->tb, M, N, K, 1.0, (const double *)(const void *)(A + ao * (int64_t)el),
                        m->lda, (const double *)(const void *)(B + bo * (int64_t)el), m->ldb,
                        m->accumulate ? 1.0 : 0.0, (double *)(void *)cp, N);
        for (int k = m->nb - 1; k >= 0; k--) {
            if (++idx[k] < m->bshape[k]) break;
            idx[k] = 0;
        }
    }
}

int gj_jit_plan_exec(const gj_jit_plan *p, void *const *in, const uint64_t *params, void **out,
                     gj_jit_out_alloc alloc, void *actx) {
    int max_params = 1, rc = -1;
    for (int s = 0; s < p->n_steps; s++)
        if (p->steps[s].kind == GJ_JIT_STEP_KERNEL && p->steps[s].k.n_params > max_params)
            max_params = p->steps[s].k.n_params;
    bool prof = (gj_jit_log_flags() & GJ_JIT_LOG_PROF) != 0;
    void **bp = gj_rt_calloc((size_t)p->n_bufs + 1, sizeof *bp);
    void **ctx = gj_rt_calloc((size_t)max_params, sizeof *ctx);
    if (!bp || !ctx) goto done;
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        if (x->kind == GJ_JIT_BUF_INPUT) bp[b] = in[x->index];
        else if (x->kind == GJ_JIT_BUF_OUTPUT) bp[b] = out[x->index];
        else if (x->kind == GJ_JIT_BUF_PARAMS) bp[b] = (void *)(uintptr_t)params;
    }
    int fi = 0, li = 0;
    for (int s = 0; s < p->n_steps; s++) {
        for (; fi < p->n_by_first && p->bufs[p->by_first[fi]].first_step == s; fi++) {
            int b = p->by_first[fi];
            const gj_jit_buffer *x = &p->bufs[b];
            if (x->kind == GJ_JIT_BUF_OUTPUT) {
                if (!out[x->index]) out[x->index] = alloc ? alloc(actx, x->index) : NULL;
                if (!out[x->index]) goto done;
                bp[b] = out[x->index];
            } else if (x->nbytes > 0) {
                bp[b] = gj_rt_alloc_data(x->nbytes);
                if (!bp[b]) goto done;
            }
        }
        const gj_jit_step *st = &p->steps[s];
        double t0 = prof ? prof_now() : 0;
        if (st->kind == GJ_JIT_STEP_MATMUL) {
            run_matmul(&st->mm, bp);
        } else if (st->k.rows > 0) {
            const gj_jit_kernel *k = &st->k;
            for (int q = 0; q < k->n_params; q++) ctx[q] = bp[k->param_buf[q]];
            gj_rt_parallel_for(k->rows, k->grain, k->fn, ctx);
        }
        if (prof)
            fprintf(stderr, "[gradjit prof] step %d %s: %.3f ms\n", s,
                    st->kind == GJ_JIT_STEP_MATMUL ? "gemm" : st->k.name, prof_now() - t0);
        for (; li < p->n_by_last && p->bufs[p->by_last[li]].last_step == s; li++) {
            int b = p->by_last[li];
            if (bp[b]) gj_rt_free_data(bp[b], p->bufs[b].nbytes);
            bp[b] = NULL;
        }
    }
    for (int o = 0; o < p->n_outputs; o++) { /* outputs no step writes (none expected) */
        if (out[o] || p->bufs[p->out_buf[o]].kind != GJ_JIT_BUF_OUTPUT) continue;
        out[o] = alloc ? alloc(actx, o) : NULL;
        if (!out[o]) goto done;
    }
    rc = 0;
done:
    if (rc != 0) {
        if (!bp || !ctx) gj_rt_set_error("compiled backward: out of memory");
        for (int b = 0; bp && b < p->n_bufs; b++)
            if (p->bufs[b].kind == GJ_JIT_BUF_TEMP && bp[b]) gj_rt_free_data(bp[b], p->bufs[b].nbytes);
    }
    gj_rt_free(bp);
    gj_rt_free(ctx);
    return rc;
}
