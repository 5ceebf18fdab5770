/* SPDX-License-Identifier: MIT */
/*
 * schedule.c - which steps of a plan run side by side.
 *
 * Eager runs one op after another, each GEMM on every core. At the small
 * shapes of a backward (a layer's dX and dW GEMMs, 128..1024 wide), two
 * single-threaded GEMMs on two cores do more than one GEMM on both, so the
 * compiled program pairs independent GEMM steps (plan.h: group_end) and
 * program.c runs a pair as two single-threaded BLAS calls on the thread
 * pool, and a lone GEMM as row or column blocks on the pool.
 *
 * Contract:
 *   - gj_jit_schedule_order moves a GEMM step up to right after an earlier
 *     GEMM step when it is independent of it and of every step in between
 *     (no buffer one writes is read or written by the other), never across
 *     a hook or custom call step (user code sees values in the engine's
 *     order), and only when the move does not raise the most bytes of
 *     temporaries and new .grad alive at once (compiled never needs more
 *     memory than the engine's order). It runs once, before the memory
 *     plan, and only permutes steps: what each step computes is unchanged.
 *   - gj_jit_schedule_groups sets group_end of every step from the order:
 *     adjacent independent GEMM steps form a group of at most
 *     GJ_JIT_MAX_GROUP; every other step is a group of one. It depends only
 *     on the plan, so a plan read from the disk cache gets the same groups.
 *   - Summation order inside every GEMM is BLAS's own for the whole K, so
 *     splitting M or N, or running two GEMMs at once, changes no value.
 */
#include "plan.h"

#include <stdint.h>
#include <string.h>

#define GJ_JIT_SCHED_WINDOW 8 /* steps a GEMM may move up past, at most */

/* The buffers step st reads (r) and writes (w): at most cap each; returns
 * the counts through nr, nw. */
static void step_bufs(const gj_jit_step *st, int *r, int *nr, int *w, int *nw, int cap) {
    *nr = *nw = 0;
#define GJ_ADD(arr, n, b)                                              \
    do {                                                               \
        if (*(n) < cap) (arr)[(*(n))++] = (b);                         \
    } while (0)
    switch (st->kind) {
    case GJ_JIT_STEP_MATMUL:
        GJ_ADD(r, nr, st->mm.a_buf);
        GJ_ADD(r, nr, st->mm.b_buf);
        if (st->mm.accumulate) GJ_ADD(r, nr, st->mm.c_buf);
        GJ_ADD(w, nw, st->mm.c_buf);
        break;
    case GJ_JIT_STEP_INDEX:
        GJ_ADD(r, nr, st->ix.src_buf);
        GJ_ADD(r, nr, st->ix.idx_buf);
        GJ_ADD(w, nw, st->ix.out_buf);
        break;
    case GJ_JIT_STEP_FOLD:
        GJ_ADD(r, nr, st->fd.src_buf);
        GJ_ADD(w, nw, st->fd.out_buf);
        break;
    case GJ_JIT_STEP_KERNEL:
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

/* Whether steps x and y may run in either order or at once. A step with
 * more buffers than the scan holds is treated as dependent. */
static bool independent(const gj_jit_step *x, const gj_jit_step *y) {
    if (x->kind == GJ_JIT_STEP_HOOK || x->kind == GJ_JIT_STEP_CALL ||
        y->kind == GJ_JIT_STEP_HOOK || y->kind == GJ_JIT_STEP_CALL)
        return false;
    int xr[GJ_JIT_SCHED_CAP], xw[GJ_JIT_SCHED_CAP], yr[GJ_JIT_SCHED_CAP], yw[GJ_JIT_SCHED_CAP];
    int nxr, nxw, nyr, nyw;
    step_bufs(x, xr, &nxr, xw, &nxw, GJ_JIT_SCHED_CAP);
    step_bufs(y, yr, &nyr, yw, &nyw, GJ_JIT_SCHED_CAP);
    if (nxr >= GJ_JIT_SCHED_CAP || nyr >= GJ_JIT_SCHED_CAP || nxw >= GJ_JIT_SCHED_CAP ||
        nyw >= GJ_JIT_SCHED_CAP)
        return false;
    return !any_common(xw, nxw, yr, nyr) && !any_common(xw, nxw, yw, nyw) &&
           !any_common(yw, nyw, xr, nxr);
}

/* Most bytes of temporaries and new .grad buffers alive at once when p
 * runs in its current order and groups (sets group_end): a buffer lives
 * from the group of its first use to the group of its last use (a .grad to
 * the end). SIZE_MAX when out of memory. */
static size_t plan_peak(gj_jit_plan *p) {
    gj_jit_schedule_groups(p);
    int *first = gj_rt_malloc((size_t)(p->n_bufs + 1) * sizeof *first);
    int *last = gj_rt_malloc((size_t)(p->n_bufs + 1) * sizeof *last);
    size_t *delta = gj_rt_calloc((size_t)p->n_steps + 2, sizeof *delta);
    size_t *drop = gj_rt_calloc((size_t)p->n_steps + 2, sizeof *drop);
    size_t peak = SIZE_MAX;
    if (!first || !last || !delta || !drop) goto out;
    for (int b = 0; b < p->n_bufs; b++) first[b] = last[b] = -1;
    for (int s = 0; s < p->n_steps; s++) {
        int g0 = s; /* first step of s's group */
        while (g0 > 0 && p->steps[g0 - 1].group_end == p->steps[s].group_end) g0--;
        int r[GJ_JIT_SCHED_CAP], w[GJ_JIT_SCHED_CAP], nr, nw;
        step_bufs(&p->steps[s], r, &nr, w, &nw, GJ_JIT_SCHED_CAP);
        for (int k = 0; k < nr + nw; k++) {
            int b = k < nr ? r[k] : w[k - nr];
            if (first[b] < 0 || g0 < first[b]) first[b] = g0;
            if (p->steps[s].group_end - 1 > last[b]) last[b] = p->steps[s].group_end - 1;
        }
    }
    for (int b = 0; b < p->n_bufs; b++) {
        const gj_jit_buffer *x = &p->bufs[b];
        if (first[b] < 0 || (x->kind != GJ_JIT_BUF_TEMP && x->kind != GJ_JIT_BUF_OUTPUT)) continue;
        delta[first[b]] += x->nbytes;
        if (x->kind == GJ_JIT_BUF_TEMP) drop[last[b]] += x->nbytes;
    }
    size_t live = 0;
    peak = 0;
    for (int s = 0; s < p->n_steps; s++) {
        live += delta[s];
        if (live > peak) peak = live;
        live -= drop[s];
    }
out:
    gj_rt_free(first);
    gj_rt_free(last);
    gj_rt_free(delta);
    gj_rt_free(drop);
    return peak;
}

void gj_jit_schedule_order(gj_jit_plan *p) {
    size_t peak = plan_peak(p);
    for (int s = 0; s + 1 < p->n_steps; s++) {
        if (p->steps[s].kind != GJ_JIT_STEP_MATMUL) continue;
        if (p->steps[s + 1].kind == GJ_JIT_STEP_MATMUL &&
            independent(&p->steps[s], &p->steps[s + 1])) {
            s++; /* already a pair */
            continue;
        }
        int lim = s + 1 + GJ_JIT_SCHED_WINDOW < p->n_steps ? s + 1 + GJ_JIT_SCHED_WINDOW : p->n_steps;
        for (int t = s + 2; t < lim; t++) {
            const gj_jit_step *y = &p->steps[t];
            if (y->kind == GJ_JIT_STEP_HOOK || y->kind == GJ_JIT_STEP_CALL) break;
            if (y->kind != GJ_JIT_STEP_MATMUL || !independent(&p->steps[s], y)) continue;
            bool movable = true;
            for (int u = s + 1; u < t && movable; u++) movable = independent(&p->steps[u], y);
            if (!movable) continue;
            gj_jit_step moved = *y;
            memmove(&p->steps[s + 2], &p->steps[s + 1], (size_t)(t - s - 1) * sizeof *p->steps);
            p->steps[s + 1] = moved;
            size_t np = plan_peak(p);
            if (np > peak) { /* never more memory than the engine's order: undo */
                moved = p->steps[s + 1];
                memmove(&p->steps[s + 1], &p->steps[s + 2], (size_t)(t - s - 1) * sizeof *p->steps);
                p->steps[t] = moved;
                continue;
            }
            peak = np;
            s++;
            break;
        }
    }
}

void gj_jit_schedule_groups(gj_jit_plan *p) {
    p->n_par_groups = 0;
    for (int s = 0; s < p->n_steps;) {
        int e = s + 1;
        if (p->steps[s].kind == GJ_JIT_STEP_MATMUL) {
            while (e < p->n_steps && e - s < GJ_JIT_MAX_GROUP &&
                   p->steps[e].kind == GJ_JIT_STEP_MATMUL) {
                bool ok = true;
                for (int u = s; u < e && ok; u++) ok = independent(&p->steps[u], &p->steps[e]);
                if (!ok) break;
                e++;
            }
        }
        if (e - s > 1) p->n_par_groups++;
        for (int u = s; u < e; u++) p->steps[u].group_end = e;
        s = e;
    }
}
