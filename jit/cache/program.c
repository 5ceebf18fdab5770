/* SPDX-License-Identifier: MIT */
/*
 * program.c - making a program from a captured graph (program.h): the
 * graph passes and the plan, the compile of its kernels, what a program
 * holds and costs, and the public description of its plan. Running a
 * plan is the run stage's (jit/run/exec.c).
 *
 * Invariants:
 *   - A program's inputs, outputs and hook references are copies of the
 *     graph's, in the plan's order; a program whose plan failed is freed
 *     whole (gj_jit_program_free takes any partly made program).
 *   - gj_jit_program_bytes counts what the memory cache's limit charges:
 *     the plan's arrays at their capacities and the machine code.
 */
#include "jit/cache/program.h"

#include <string.h>

static atomic_llong g_next_prefix;

gj_jit_program *gj_jit_program_plan(gj_jit_graph *g, char *why, size_t why_cap,
                                    bool *permanent) {
    *permanent = false;
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
    bool changed = false;
    if (gj_jit_pass_cse_dce(g) != 0 || gj_jit_pass_pad_sums(g, &changed) != 0 ||
        (changed && gj_jit_pass_cse_dce(g) != 0)) {
        snprintf(why, why_cap, "out of memory in the graph passes");
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
    if (g->n_inputs > 0)
        memcpy(pr->inputs, g->inputs, (size_t)g->n_inputs * sizeof *pr->inputs);
    if (g->n_outputs > 0) /* none: a gj_grad whose inputs no gradient reaches */
        memcpy(pr->outputs, g->outputs, (size_t)g->n_outputs * sizeof *pr->outputs);
    for (int i = 0; i < g->n_inputs; i++)
        if (g->inputs[i].role == GJ_JIT_IN_OTHER) pr->recapture = true;
    if (g->n_hooks > 0) {
        pr->hooks = gj_rt_calloc((size_t)g->n_hooks, sizeof *pr->hooks);
        if (!pr->hooks) {
            snprintf(why, why_cap, "out of memory");
            goto fail;
        }
        memcpy(pr->hooks, g->hooks, (size_t)g->n_hooks * sizeof *pr->hooks);
        pr->n_hooks = g->n_hooks;
    }
    for (int s = 0; s < pr->plan.n_instrs; s++) pr->n_calls += pr->plan.instrs[s].kind == GJ_JIT_INSTR_CALL;
    return pr;
fail:
    gj_jit_program_free(pr);
    return NULL;
}

int gj_jit_program_compile(gj_jit_program *pr, const char *prefix, bool keep, char *why,
                           size_t why_cap, bool *permanent) {
    *permanent = false;
    why[0] = '\0';
    char auto_prefix[32];
    if (!prefix) {
        snprintf(auto_prefix, sizeof auto_prefix, "gjp%lld",
                 (long long)atomic_fetch_add(&g_next_prefix, 1));
        prefix = auto_prefix;
    }
    pr->code = gj_jit_code_compile(&pr->plan, prefix, keep, why, why_cap);
    if (!pr->code) {
        *permanent = strncmp(why, "LLVM", 4) == 0;
        return -1;
    }
    return 0;
}

gj_jit_program *gj_jit_program_build(gj_jit_graph *g, const char *prefix, char *why,
                                     size_t why_cap, bool *permanent) {
    gj_jit_program *pr = gj_jit_program_plan(g, why, why_cap, permanent);
    if (pr && gj_jit_program_compile(pr, prefix, false, why, why_cap, permanent) != 0) {
        gj_jit_program_free(pr);
        pr = NULL;
    }
    return pr;
}

void gj_jit_program_free(gj_jit_program *pr) {
    if (!pr) return;
    gj_jit_code_free(pr->code);
    for (int c = 0; c < pr->n_shared; c++) gj_jit_code_free(pr->shared[c]);
    gj_rt_free(pr->shared);
    gj_jit_plan_free(&pr->plan);
    gj_rt_free(pr->inputs);
    gj_rt_free(pr->outputs);
    gj_rt_free(pr->hooks);
    gj_rt_free(pr->ret);
    gj_rt_free(pr);
}

size_t gj_jit_program_bytes(const gj_jit_program *pr) {
    if (!pr) return 0;
    const gj_jit_plan *p = &pr->plan;
    size_t n = sizeof *pr + gj_jit_code_bytes(pr->code);
    n += (size_t)p->cap_instrs * sizeof *p->instrs + (size_t)p->cap_bufs * sizeof *p->bufs;
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_kernel *k = &p->instrs[s].k;
        n += (size_t)k->cap_acc * sizeof *k->acc + (size_t)k->cap_ex * sizeof *k->ex +
             (size_t)k->cap_st * sizeof *k->st + (size_t)k->n_params * sizeof *k->param_buf +
             (size_t)k->n_ints * sizeof *k->ints;
    }
    n += (size_t)pr->n_shared * sizeof *pr->shared; /* (their code is charged to its compiler) */
    n += (size_t)(p->n_by_first + p->n_by_last) * sizeof(int);
    n += (size_t)p->n_inputs * sizeof *p->in_meta;
    n += (size_t)p->n_outputs * (sizeof *p->out_meta + sizeof *p->out_buf);
    n += (size_t)p->n_rt_params * 2 * sizeof(int);
    n += (size_t)(pr->n_inputs + 1) * sizeof *pr->inputs;
    n += (size_t)(pr->n_outputs + 1) * sizeof *pr->outputs;
    n += (size_t)pr->n_hooks * sizeof *pr->hooks;
    n += (size_t)pr->n_ret * sizeof *pr->ret;
    return n;
}

static int64_t meta_bytes(const gj_rt_meta *m) {
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++) n *= m->shape[d];
    return n * (int64_t)gj_rt_dtype_size(m->dtype);
}

/* The public description of plan p (gradjit.h: gj_ca_program_info). */
void gj_jit_plan_info(const gj_jit_plan *p, gj_ca_program_info *out) {
    memset(out, 0, sizeof *out);
    out->instrs = p->n_instrs;
    out->parallel_groups = p->n_par_groups;
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_instr *st = &p->instrs[s];
        if (st->kind == GJ_JIT_INSTR_KERNEL) {
            out->kernel_instrs++;
            bool seen = false;
            for (int t = 0; t < s && !seen; t++)
                seen = p->instrs[t].kind == GJ_JIT_INSTR_KERNEL &&
                       strcmp(p->instrs[t].k.name, st->k.name) == 0;
            out->kernel_functions += !seen;
            out->shared_kernel_functions += !seen && st->k.shared;
        } else if (st->kind == GJ_JIT_INSTR_MATMUL) {
            const gj_jit_matmul *m = &st->mm;
            int64_t batch = 1;
            for (int k = 0; k < m->nb; k++) batch *= m->bshape[k];
            out->gemm_instrs++;
            out->gemm_flops += 2.0 * (double)m->M * (double)m->N * (double)m->K * (double)batch;
            if (out->n_gemms < GJ_CA_MAX_GEMMS)
                out->gemms[out->n_gemms] = (gj_ca_gemm){m->bf16 ? GJ_BF16 : m->dtype, m->ta, m->tb, m->M, m->N,
                                                        m->K, batch, m->accumulate};
            out->n_gemms++;
        } else {
            out->other_instrs++;
        }
    }
    for (int b = 0; b < p->n_bufs; b++) /* inputs some instruction reads */
        if (p->bufs[b].kind == GJ_JIT_BUF_INPUT && p->bufs[b].first_instr >= 0)
            out->input_bytes += meta_bytes(&p->in_meta[p->bufs[b].index]);
    for (int o = 0; o < p->n_outputs; o++)
        if (p->bufs[p->out_buf[o]].kind == GJ_JIT_BUF_OUTPUT)
            out->output_bytes += meta_bytes(&p->out_meta[o]);
}
