/* SPDX-License-Identifier: MIT */
/*
 * memplan.c - the memory plan of a plan: when each temporary and new .grad
 * buffer is allocated and freed.
 *
 * Contract: runs last, on a plan whose instructions and groups are final
 * (schedule.c has run). Every buffer gets first_instr / last_instr (the
 * instructions that use it); by_first lists temporaries and outputs in order of
 * first use, by_last temporaries in order of last use; program.c allocates
 * a buffer before the group of its first instruction and frees it after the group
 * of its last. peak_temp_bytes is the most temporary bytes alive at once
 * with those groups.
 */
#include "jit/plan/plan.h"

static void touch(gj_jit_plan *p, int b, int s) {
    gj_jit_buffer *x = &p->bufs[b];
    if (x->first_instr < 0 || s < x->first_instr) x->first_instr = s;
    if (s > x->last_instr) x->last_instr = s;
}

int gj_jit_plan_memory(gj_jit_plan *p) {
    for (int s = 0; s < p->n_instrs; s++) {
        gj_jit_instr *st = &p->instrs[s];
        if (st->kind == GJ_JIT_INSTR_KERNEL) {
            for (int q = 0; q < st->k.n_params; q++) touch(p, st->k.param_buf[q], s);
        } else if (st->kind == GJ_JIT_INSTR_MATMUL) {
            touch(p, st->mm.a_buf, s);
            touch(p, st->mm.b_buf, s);
            touch(p, st->mm.c_buf, s);
        } else if (st->kind == GJ_JIT_INSTR_FOLD) {
            touch(p, st->fd.src_buf, s);
            touch(p, st->fd.out_buf, s);
        } else if (st->kind == GJ_JIT_INSTR_LCE) {
            int b[8], nb = gj_jit_lce_bufs(&st->lc, b);
            for (int k = 0; k < nb; k++) touch(p, b[k], s);
        } else if (st->kind == GJ_JIT_INSTR_HOOK) {
            touch(p, st->hk.src_buf, s);
            touch(p, st->hk.out_buf, s);
        } else if (st->kind == GJ_JIT_INSTR_CALL) {
            for (int k = 0; k < st->cs.n_in; k++) touch(p, st->cs.src_buf[k], s);
            for (int k = 0; k < st->cs.n_out; k++) touch(p, st->cs.out_buf[k], s);
        } else {
            touch(p, st->ix.src_buf, s);
            touch(p, st->ix.idx_buf, s);
            touch(p, st->ix.out_buf, s);
        }
    }
    p->by_first = gj_rt_malloc((size_t)(p->n_bufs + 1) * sizeof *p->by_first);
    p->by_last = gj_rt_malloc((size_t)(p->n_bufs + 1) * sizeof *p->by_last);
    if (!p->by_first || !p->by_last) return -1;
    int n = 0, m = 0;
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        if ((x->kind != GJ_JIT_BUF_TEMP && x->kind != GJ_JIT_BUF_OUTPUT) || x->first_instr < 0)
            continue;
        p->by_first[n++] = b;
        if (x->kind == GJ_JIT_BUF_TEMP) p->by_last[m++] = b;
    }
    p->n_by_first = n;
    p->n_by_last = m;
    /* insertion sorts (stable) by first / last instruction */
    for (int i = 1; i < n; i++) {
        int v = p->by_first[i], j = i - 1;
        while (j >= 0 && p->bufs[p->by_first[j]].first_instr > p->bufs[v].first_instr) {
            p->by_first[j + 1] = p->by_first[j];
            j--;
        }
        p->by_first[j + 1] = v;
    }
    for (int i = 1; i < m; i++) {
        int v = p->by_last[i], j = i - 1;
        while (j >= 0 && p->bufs[p->by_last[j]].last_instr > p->bufs[v].last_instr) {
            p->by_last[j + 1] = p->by_last[j];
            j--;
        }
        p->by_last[j + 1] = v;
    }
    size_t live = 0, peak = 0; /* a group's buffers are all live while it runs */
    for (int s = 0, i = 0, j = 0; s < p->n_instrs; s = p->instrs[s].group_end) {
        int e = p->instrs[s].group_end;
        for (; i < n && p->bufs[p->by_first[i]].first_instr < e; i++)
            if (p->bufs[p->by_first[i]].kind == GJ_JIT_BUF_TEMP) live += p->bufs[p->by_first[i]].nbytes;
        if (live > peak) peak = live;
        for (; j < m && p->bufs[p->by_last[j]].last_instr < e; j++) live -= p->bufs[p->by_last[j]].nbytes;
    }
    p->peak_temp_bytes = peak;
    return 0;
}

