/* SPDX-License-Identifier: MIT */
/*
 * schedule.c - which instructions of a plan run side by side.
 *
 * Eager runs one op after another, each GEMM on every core. At the small
 * shapes of a backward (a layer's dX and dW GEMMs, 128..1024 wide), two
 * single-threaded GEMMs on two cores do more than one GEMM on both, so the
 * compiled program pairs independent GEMM instructions (plan.h: group_end) and
 * program.c runs a pair as two single-threaded BLAS calls on the thread
 * pool, and a lone GEMM as row or column blocks on the pool.
 *
 * Contract:
 *   - Memory: compiled never needs more memory than the step order (plan.c's
 *     topological order, which follows the engine's), counted as the most
 *     bytes of temporaries and new .grads alive at once when the instructions run
 *     one at a time (sched_mem). Neither a move nor a group may raise it:
 *     a group allocates the buffers of all its instructions before it runs and
 *     frees them after, so two GEMMs side by side can hold more than the
 *     same two in turn (W4's last layer: dW2's input, the recomputed gelu
 *     output, stayed alive while dW1's 4 MiB .grad was made).
 *   - gj_jit_schedule_order moves a GEMM instruction up to right after an earlier
 *     GEMM instruction when it is independent of it and of every instruction in between
 *     (no buffer one writes is read or written by the other), never across
 *     a hook or custom call instruction (user code sees values in the engine's
 *     order), and only when the new order one instruction at a time stays within
 *     the step order's peak and the pair fits under it (group_fits). It
 *     runs once, before the memory plan, and only permutes instructions: what each
 *     instruction computes is unchanged. 0, or -1 on OOM (nothing moved).
 *   - gj_jit_schedule_groups sets group_end of every instruction from the order:
 *     adjacent independent GEMM instructions form a group of at most
 *     GJ_JIT_MAX_GROUP when the group holds no more than the order's own
 *     peak one instruction at a time; every other instruction is a group of one. It
 *     depends only on the plan. 0, or -1 on OOM (group_end unset).
 *   - Summation order inside every GEMM is BLAS's own for the whole K, so
 *     splitting M or N, or running two GEMMs at once, changes no value.
 */
#include "jit/plan/plan.h"

#include <stdint.h>
#include <string.h>

#define GJ_JIT_SCHED_WINDOW 8 /* instructions a GEMM may move up past, at most */

/* The buffers instruction st reads (r) and writes (w): at most cap each; returns
 * the counts through nr, nw. */
static void instr_bufs(const gj_jit_instr *st, int *r, int *nr, int *w, int *nw, int cap) {
    *nr = *nw = 0;
#define GJ_ADD(arr, n, b)                                              \
    do {                                                               \
        if (*(n) < cap) (arr)[(*(n))++] = (b);                         \
    } while (0)
    switch (st->kind) {
    case GJ_JIT_INSTR_MATMUL:
        GJ_ADD(r, nr, st->mm.a_buf);
        GJ_ADD(r, nr, st->mm.b_buf);
        if (st->mm.accumulate) GJ_ADD(r, nr, st->mm.c_buf);
        GJ_ADD(w, nw, st->mm.c_buf);
        break;
    case GJ_JIT_INSTR_INDEX:
        GJ_ADD(r, nr, st->ix.src_buf);
        GJ_ADD(r, nr, st->ix.idx_buf);
        GJ_ADD(w, nw, st->ix.out_buf);
        break;
    case GJ_JIT_INSTR_FOLD:
        GJ_ADD(r, nr, st->fd.src_buf);
        GJ_ADD(w, nw, st->fd.out_buf);
        break;
    case GJ_JIT_INSTR_LCE:
        GJ_ADD(r, nr, st->lc.h_buf);
        GJ_ADD(r, nr, st->lc.w_buf);
        GJ_ADD(r, nr, st->lc.lab_buf);
        if (st->lc.b_buf >= 0) GJ_ADD(r, nr, st->lc.b_buf);
        for (int k = 0; k < 4; k++)
            if (st->lc.out_buf[k] >= 0) GJ_ADD(w, nw, st->lc.out_buf[k]);
        break;
    case GJ_JIT_INSTR_KERNEL:
        if (st->k.attn) { /* its inputs, then its outputs and workspace */
            int n_in = st->k.attn == GJ_P_ATTN_FWD ? 3 : 6;
            for (int q = 0; q < st->k.n_params; q++) {
                if (q < n_in) GJ_ADD(r, nr, st->k.param_buf[q]);
                else GJ_ADD(w, nw, st->k.param_buf[q]);
            }
            break;
        }
        for (int e = 0; e < st->k.n_ex; e++)
            if (st->k.ex[e].kind == GJ_JIT_E_LOAD) GJ_ADD(r, nr, st->k.acc[st->k.ex[e].access].buf);
        for (int q = 0; q < st->k.n_st; q++) GJ_ADD(w, nw, st->k.acc[st->k.st[q].access].buf);
        break;
    default: /* hooks and calls are barriers: never grouped or crossed */
        break;
    }
#undef GJ_ADD
}

static bool any_common(const int *a, int na, const int *b, int nb) {
    for (int i = 0; i < na; i++)
        for (int j = 0; j < nb; j++)
            if (a[i] == b[j]) return true;
    return false;
}

#define GJ_JIT_SCHED_CAP 64

/* Whether instructions x and y may run in either order or at once. An instruction with
 * more buffers than the scan holds is treated as dependent. */
static bool independent(const gj_jit_instr *x, const gj_jit_instr *y) {
    if (x->kind == GJ_JIT_INSTR_HOOK || x->kind == GJ_JIT_INSTR_CALL ||
        y->kind == GJ_JIT_INSTR_HOOK || y->kind == GJ_JIT_INSTR_CALL)
        return false;
    int xr[GJ_JIT_SCHED_CAP], xw[GJ_JIT_SCHED_CAP], yr[GJ_JIT_SCHED_CAP], yw[GJ_JIT_SCHED_CAP];
    int nxr, nxw, nyr, nyw;
    instr_bufs(x, xr, &nxr, xw, &nxw, GJ_JIT_SCHED_CAP);
    instr_bufs(y, yr, &nyr, yw, &nyw, GJ_JIT_SCHED_CAP);
    if (nxr >= GJ_JIT_SCHED_CAP || nyr >= GJ_JIT_SCHED_CAP || nxw >= GJ_JIT_SCHED_CAP ||
        nyw >= GJ_JIT_SCHED_CAP)
        return false;
    return !any_common(xw, nxw, yr, nyr) && !any_common(xw, nxw, yw, nyw) &&
           !any_common(yw, nyw, xr, nxr);
}

/* The memory of a plan whose instructions run one at a time in their current
 * order: a temporary is alive from the first instruction that uses it to the last,
 * a new .grad from its first instruction to the end (memplan.c's allocation and
 * release order, with groups of one). */
typedef struct sched_mem {
    int *first, *last; /* per buffer: the first and last instruction using it, or -1 */
    size_t *alloc;     /* per instruction: bytes of the buffers it uses first */
    size_t *drop;      /* per instruction: bytes of the temporaries it uses last */
    size_t *at;        /* per instruction: bytes alive while it runs */
    size_t peak;       /* the most of at[] */
} sched_mem;

static void mem_free(sched_mem *m) {
    gj_rt_free(m->first);
    gj_rt_free(m->last);
    gj_rt_free(m->alloc);
    gj_rt_free(m->drop);
    gj_rt_free(m->at);
    memset(m, 0, sizeof *m);
}

/* Room for the memory of p's plan. 0, or -1 on OOM (*m freed). */
static int mem_new(const gj_jit_plan *p, sched_mem *m) {
    m->first = gj_rt_malloc((size_t)(p->n_bufs + 1) * sizeof *m->first);
    m->last = gj_rt_malloc((size_t)(p->n_bufs + 1) * sizeof *m->last);
    m->alloc = gj_rt_malloc((size_t)(p->n_instrs + 1) * sizeof *m->alloc);
    m->drop = gj_rt_malloc((size_t)(p->n_instrs + 1) * sizeof *m->drop);
    m->at = gj_rt_malloc((size_t)(p->n_instrs + 1) * sizeof *m->at);
    m->peak = 0;
    if (m->first && m->last && m->alloc && m->drop && m->at) return 0;
    mem_free(m);
    return -1;
}

static void mem_use(sched_mem *m, int b, int s) {
    if (m->first[b] < 0) m->first[b] = s;
    m->last[b] = s;
}

/* Fills m for p's current order. Every buffer an instruction touches counts
 * (memplan.c's list: a kernel's params, hook and call buffers too). */
static void mem_eval(const gj_jit_plan *p, sched_mem *m) {
    for (int b = 0; b < p->n_bufs; b++) m->first[b] = m->last[b] = -1;
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_instr *st = &p->instrs[s];
        m->alloc[s] = m->drop[s] = 0;
        switch (st->kind) {
        case GJ_JIT_INSTR_KERNEL:
            for (int q = 0; q < st->k.n_params; q++) mem_use(m, st->k.param_buf[q], s);
            break;
        case GJ_JIT_INSTR_MATMUL:
            mem_use(m, st->mm.a_buf, s);
            mem_use(m, st->mm.b_buf, s);
            mem_use(m, st->mm.c_buf, s);
            break;
        case GJ_JIT_INSTR_FOLD:
            mem_use(m, st->fd.src_buf, s);
            mem_use(m, st->fd.out_buf, s);
            break;
        case GJ_JIT_INSTR_LCE: {
            int b[8], nb = gj_jit_lce_bufs(&st->lc, b);
            for (int k = 0; k < nb; k++) mem_use(m, b[k], s);
            break;
        }
        case GJ_JIT_INSTR_HOOK:
            mem_use(m, st->hk.src_buf, s);
            mem_use(m, st->hk.out_buf, s);
            break;
        case GJ_JIT_INSTR_CALL:
            for (int k = 0; k < st->cs.n_in; k++) mem_use(m, st->cs.src_buf[k], s);
            for (int k = 0; k < st->cs.n_out; k++) mem_use(m, st->cs.out_buf[k], s);
            break;
        case GJ_JIT_INSTR_INDEX:
            mem_use(m, st->ix.src_buf, s);
            mem_use(m, st->ix.idx_buf, s);
            mem_use(m, st->ix.out_buf, s);
            break;
        }
    }
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        if (m->first[b] < 0 || (x->kind != GJ_JIT_BUF_TEMP && x->kind != GJ_JIT_BUF_OUTPUT))
            continue;
        m->alloc[m->first[b]] += x->nbytes;
        if (x->kind == GJ_JIT_BUF_TEMP) m->drop[m->last[b]] += x->nbytes;
    }
    size_t live = 0;
    m->peak = 0;
    for (int s = 0; s < p->n_instrs; s++) {
        live += m->alloc[s];
        m->at[s] = live;
        if (live > m->peak) m->peak = live;
        live -= m->drop[s];
    }
}

/* Whether instructions [s, e) run as one group within the peak of m's order: a
 * group allocates the buffers of all its instructions before it runs and frees
 * them after, so it holds what instruction s holds plus what the others allocate.
 * (Groups are disjoint: each one's excess is independent of the others'.) */
static bool group_fits(const sched_mem *m, int s, int e) {
    size_t live = m->at[s];
    for (int u = s + 1; u < e; u++) live += m->alloc[u];
    return live <= m->peak;
}

int gj_jit_schedule_order(gj_jit_plan *p) {
    sched_mem cur, next;
    if (mem_new(p, &cur) != 0) return -1;
    if (mem_new(p, &next) != 0) {
        mem_free(&cur);
        return -1;
    }
    mem_eval(p, &cur);
    size_t limit = cur.peak; /* the step order's, one step at a time */
    for (int s = 0; s + 1 < p->n_instrs; s++) {
        if (p->instrs[s].kind != GJ_JIT_INSTR_MATMUL) continue;
        if (p->instrs[s + 1].kind == GJ_JIT_INSTR_MATMUL &&
            independent(&p->instrs[s], &p->instrs[s + 1]) && group_fits(&cur, s, s + 2)) {
            s++; /* already a pair */
            continue;
        }
        int lim = s + 1 + GJ_JIT_SCHED_WINDOW < p->n_instrs ? s + 1 + GJ_JIT_SCHED_WINDOW : p->n_instrs;
        for (int t = s + 2; t < lim; t++) {
            const gj_jit_instr *y = &p->instrs[t];
            if (y->kind == GJ_JIT_INSTR_HOOK || y->kind == GJ_JIT_INSTR_CALL) break;
            if (y->kind != GJ_JIT_INSTR_MATMUL || !independent(&p->instrs[s], y)) continue;
            bool movable = true;
            for (int u = s + 1; u < t && movable; u++) movable = independent(&p->instrs[u], y);
            if (!movable) continue;
            gj_jit_instr moved = *y;
            memmove(&p->instrs[s + 2], &p->instrs[s + 1], (size_t)(t - s - 1) * sizeof *p->instrs);
            p->instrs[s + 1] = moved;
            mem_eval(p, &next);
            if (next.peak > limit || !group_fits(&next, s, s + 2)) {
                /* more memory than the step order, or a pair that would: undo */
                moved = p->instrs[s + 1];
                memmove(&p->instrs[s + 1], &p->instrs[s + 2], (size_t)(t - s - 1) * sizeof *p->instrs);
                p->instrs[t] = moved;
                continue;
            }
            sched_mem tmp = cur;
            cur = next;
            next = tmp;
            s++;
            break;
        }
    }
    mem_free(&cur);
    mem_free(&next);
    return 0;
}

int gj_jit_schedule_groups(gj_jit_plan *p) {
    sched_mem m;
    if (mem_new(p, &m) != 0) return -1;
    mem_eval(p, &m);
    p->n_par_groups = 0;
    for (int s = 0; s < p->n_instrs;) {
        int e = s + 1;
        if (p->instrs[s].kind == GJ_JIT_INSTR_MATMUL) {
            while (e < p->n_instrs && e - s < GJ_JIT_MAX_GROUP &&
                   p->instrs[e].kind == GJ_JIT_INSTR_MATMUL && group_fits(&m, s, e + 1)) {
                bool ok = true;
                for (int u = s; u < e && ok; u++) ok = independent(&p->instrs[u], &p->instrs[e]);
                if (!ok) break;
                e++;
            }
        }
        if (e - s > 1) p->n_par_groups++;
        for (int u = s; u < e; u++) p->instrs[u].group_end = e;
        s = e;
    }
    mem_free(&m);
    return 0;
}
