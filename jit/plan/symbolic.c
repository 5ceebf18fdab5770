/* SPDX-License-Identifier: MIT */
/*
 * symbolic.c - plans whose sizes are symbolic (dynamic shapes).
 *
 * A generic plan's kernels are lowered with every size, offset, stride
 * other than 0 and 1, and schedule field read at run time from the
 * kernel's integer table (plan.h: gj_jit_kint_acc), so their machine code
 * depends only on the kernel's generic description (dedupe.c). A new
 * size of a call site is then planned as usual (plan.c fixes every
 * integer for that size: the GEMM shapes, the memory plan, the schedule)
 * and bound to kernels already compiled for another size (the cache
 * stage's registry): no LLVM work. Where a size changes the code (a
 * stride that becomes 0 or 1, a dimension of 1 merged away, a different
 * fusion), the generic description differs, the bind fails, and the
 * caller compiles.
 */
#include "jit/plan/plan.h"

#include "runtime/gj_math.h"

#include <string.h>

/* ------------------------------------------------------- integer tables */

bool gj_jit_generic_block_ok(const gj_jit_kernel *k) {
    if (k->attn || k->nd <= 0) return true; /* no loop nest: nothing in column blocks */
    if ((k->red >> (k->nd - 1)) & 1u) return true; /* inner mode: no column accumulators */
    for (int s = 0; s < k->n_st; s++)
        if (k->st[s].reduce) return k->block <= GJ_JIT_MAX_RED_BLOCK;
    return true;
}

/* The bits lower.c computes with for constant v in compute type dt. */
static int64_t const_bits(gj_dtype dt, double v) {
    uint64_t u = 0;
    if (dt == GJ_F64) {
        memcpy(&u, &v, sizeof u);
    } else if (dt == GJ_F32 || dt == GJ_BF16) {
        float f = dt == GJ_BF16 ? gj_m_bf16_to_f32(gj_m_f32_to_bf16((float)v)) : (float)v;
        uint32_t w;
        memcpy(&w, &f, sizeof w);
        u = w;
    } else {
        return gj_jit_sat_i64(v);
    }
    return (int64_t)u;
}

static int fill_kernel(gj_jit_kernel *k) {
    if (k->attn) return 0; /* an attention kernel's table is its geometry already */
    int n = gj_jit_kint_count(k);
    int64_t *t = gj_rt_realloc(k->ints, (size_t)n * sizeof *t);
    if (!t) return -1;
    k->ints = t;
    k->n_ints = n;
    for (int d = 0; d < k->nd; d++) t[d] = k->dims[d];
    for (int a = 0; a < k->n_acc; a++) {
        int b = gj_jit_kint_acc(k, a);
        t[b] = k->acc[a].offset;
        for (int d = 0; d < k->nd; d++) t[b + 1 + d] = k->acc[a].strides[d];
    }
    int sc = gj_jit_kint_sched(k);
    t[sc] = k->block;
    t[sc + 1] = k->nblk;
    for (int e = 0; e < k->n_ex; e++) {
        const gj_jit_expr *x = &k->ex[e];
        gj_rt_prim pr = x->inst.prim;
        int64_t v = 0;
        if (x->kind == GJ_JIT_E_CONST)
            v = const_bits(x->dtype, x->cval);
        else if (x->kind == GJ_JIT_E_OP &&
                 (pr == GJ_P_ADD_SCALAR || pr == GJ_P_MUL_SCALAR || pr == GJ_P_POW_SCALAR))
            v = const_bits(x->dtype == GJ_F64 ? GJ_F64 : GJ_F32, x->inst.scalar);
        t[gj_jit_kint_const(k, e)] = v;
    }
    return 0;
}

static int fill_ints(gj_jit_plan *p) {
    for (int s = 0; s < p->n_instrs; s++)
        if (p->instrs[s].kind == GJ_JIT_INSTR_KERNEL && fill_kernel(&p->instrs[s].k) != 0) return -1;
    return 0;
}

int gj_jit_plan_make_generic(gj_jit_plan *p) {
    if (p->generic) return 0;
    p->generic = true;
    for (int s = 0; s < p->n_instrs; s++)
        if (p->instrs[s].kind == GJ_JIT_INSTR_KERNEL)
            snprintf(p->instrs[s].k.name, sizeof p->instrs[s].k.name, "k%d", s);
    if (fill_ints(p) != 0 || gj_jit_dedupe_kernels(p) != 0) return -1;
    return 0;
}

int gj_jit_plan_make_kernels_generic(gj_jit_plan *p, const bool *pick) {
    if (p->generic) return 0;
    bool any = false;
    for (int s = 0; s < p->n_instrs; s++) {
        gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || !pick[s] || k->generic ||
            !gj_jit_generic_block_ok(k))
            continue;
        if (fill_kernel(k) != 0) return -1;
        k->generic = any = true;
        snprintf(k->name, sizeof k->name, "k%d", s);
    }
    return any ? gj_jit_dedupe_kernels(p) : 0;
}

int gj_jit_plan_make_specific(gj_jit_plan *p) {
    if (!p->generic) return 0;
    p->generic = false;
    for (int s = 0; s < p->n_instrs; s++) {
        gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || k->generic) continue;
        snprintf(k->name, sizeof k->name, "k%d", s);
        if (k->attn) continue; /* (its table stays: lowering takes its constants) */
        gj_rt_free(k->ints);
        k->ints = NULL;
        k->n_ints = 0;
        snprintf(k->name, sizeof k->name, "k%d", s);
    }
    return gj_jit_dedupe_kernels(p);
}

int gj_jit_generic_signature(const gj_jit_plan *p, wbuf *b) {
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL) continue;
        size_t n = strnlen(k->name, sizeof k->name);
        wbuf_u64(b, n);
        wbuf_put(b, k->name, n);
        bool first = true;
        for (int t = 0; t < s && first; t++)
            first = !(p->instrs[t].kind == GJ_JIT_INSTR_KERNEL && strcmp(p->instrs[t].k.name, k->name) == 0);
        wbuf_u64(b, first);
        if (first) gj_jit_kernel_describe(p, k, true, b);
    }
    return b->oom ? -1 : 0;
}

