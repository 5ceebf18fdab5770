/* SPDX-License-Identifier: MIT */
/*
 * kernels_attention.c - the eager kernels of ATTN_FWD and ATTN_BWD: the
 * algorithm of runtime/attention.h over the pool, built for the baseline
 * and (kernels_attention_x86v3.c, _x86v4.c) for AVX2+FMA and AVX-512 CPUs,
 * the widest the CPU runs taken. A compiled program runs the same
 * algorithm as a kernel of its own (the JIT specialises attention.h to its
 * shape), so the two give the same bits.
 *
 * Invariants:
 *   - Inputs may have any strides over (b, h, t); an input whose last
 *     dimension is not contiguous is copied first. Outputs are contiguous
 *     and written whole.
 *   - Units go to the pool one at a time (grain 1): the forward's are
 *     (b, h, query block), the backward's (b, h); the bits do not depend on
 *     the thread count (attention.h).
 *   - The backward's workspace (each unit's dQ accumulator and row terms)
 *     is scratch counted as tensor bytes, freed before returning.
 */
#include "runtime/kernels.h"

#include "runtime/attention.h"

/* The baseline build's units (attention_units.h); the x86-64-v3 and -v4
 * builds are kernels_attention_x86v3.c and _x86v4.c. */
#define GJ_ATTN_ISA base
#include "runtime/attention_units.h"

#if defined(__x86_64__)
void gj_rt_attn_fwd_range_x86v3(void *vctx, int64_t b, int64_t e);
void gj_rt_attn_bwd_range_x86v3(void *vctx, int64_t b, int64_t e);
void gj_rt_attn_fwd_range_x86v4(void *vctx, int64_t b, int64_t e);
void gj_rt_attn_bwd_range_x86v4(void *vctx, int64_t b, int64_t e);
#endif

/* The widest build of the units this CPU runs. */
static gj_rt_range_fn units_for(bool fwd) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return fwd ? gj_rt_attn_fwd_range_x86v4 : gj_rt_attn_bwd_range_x86v4;
    if (__builtin_cpu_supports("x86-64-v3"))
        return fwd ? gj_rt_attn_fwd_range_x86v3 : gj_rt_attn_bwd_range_x86v3;
#endif
    return fwd ? gj_rt_attn_fwd_range_base : gj_rt_attn_bwd_range_base;
}

/* strides[0..3) of t, a [., ., ., w] tensor whose last dimension is
 * contiguous (checked by the caller). */
static void strides3(const gj_tensor *t, int64_t *s) {
    for (int d = 0; d < 3; d++)
        s[d] = t->strides[d];
}

int gj_rt_k_attention(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs) {
    bool fwd = inst->prim == GJ_P_ATTN_FWD;
    int n = fwd ? 3 : 5; /* the strided inputs: q, k, v (, o, go) */
    gj_tensor *dense[5] = {NULL, NULL, NULL, NULL, NULL};
    const gj_tensor *t[5];
    int rc = -1;
    void *ws = NULL;
    size_t ws_bytes = 0;
    for (int i = 0; i < n; i++) {
        t[i] = in[i];
        if (in[i]->strides[3] != 1 && in[i]->shape[3] > 1) { /* the rows must be contiguous */
            if (!(dense[i] = gj_rt_contiguous(in[i])))
                goto done;
            t[i] = dense[i];
        }
    }
    gj_attn_run x;
    memset(&x, 0, sizeof x);
    x.type = in[0]->dtype == GJ_F32 ? GJ_ATTN_F32 : in[0]->dtype == GJ_BF16 ? GJ_ATTN_BF16
                                                                           : GJ_ATTN_F64;
    gj_attn_geom *g = &x.g;
    g->B = in[0]->shape[0];
    g->H = in[0]->shape[1];
    g->T = in[0]->shape[2];
    g->S = in[1]->shape[2];
    g->D = in[0]->shape[3];
    g->E = in[2]->shape[3];
    g->scale = inst->scalar;
    g->p = inst->scalar2;
    g->causal = inst->keepdim;
    strides3(t[0], g->qs);
    strides3(t[1], g->ks);
    strides3(t[2], g->vs);
    gj_attn_mem *m = &x.m;
    m->q = gj_rt_data_ptr(t[0]);
    m->k = gj_rt_data_ptr(t[1]);
    m->v = gj_rt_data_ptr(t[2]);
    m->seed = inst->seed;
    m->offset = inst->rng_offset;
    if (fwd) {
        m->out = gj_rt_data_ptr(outs[0]);
        m->lse = gj_rt_data_ptr(outs[1]);
        gj_rt_parallel_for(gj_attn_fwd_units(g), 1, units_for(true), &x);
        rc = 0;
        goto done;
    }
    strides3(t[3], g->os);
    strides3(t[4], g->gos);
    m->o = gj_rt_data_ptr(t[3]);
    m->go = gj_rt_data_ptr(t[4]);
    m->lse_in = gj_rt_data_ptr(in[5]);
    m->gq = gj_rt_data_ptr(outs[0]);
    m->gk = gj_rt_data_ptr(outs[1]);
    m->gv = gj_rt_data_ptr(outs[2]);
    ws_bytes = (size_t)gj_attn_bwd_units(g) * (size_t)gj_attn_bwd_ws_elems(g) *
               (x.type == GJ_ATTN_F64 ? sizeof(double) : sizeof(float));
    if (!(ws = gj_rt_k_scratch(ws_bytes)))
        goto done;
    m->ws = ws;
    gj_rt_parallel_for(gj_attn_bwd_units(g), 1, units_for(false), &x);
    rc = 0;
done:
    if (ws)
        gj_rt_k_scratch_free(ws, ws_bytes);
    for (int i = 0; i < n; i++)
        gj_rt_tensor_release(dense[i]);
    return rc;
}
