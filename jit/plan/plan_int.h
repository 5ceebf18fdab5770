/* SPDX-License-Identifier: MIT */
/*
 * plan_int.h - the planner's working state, shared by the passes that turn
 * a captured graph into a plan (internal to plan*.c; see plan.h for the
 * plan itself):
 *
 *   plan_nodes.c   each graph node -> values, fused groups and instructions
 *                  (fusion, BLAS / index / fold / hook / custom instructions,
 *                  graph outputs)
 *   plan_views.c   view folding: movement ops as index maps of a buffer
 *   plan_kernel.c  a fused group -> a kernel (accesses, expressions, stores)
 *                  and its schedule (rows, column blocks, grain)
 *   plan.c         the driver: the passes in order, the step order (a
 *                  topological order of the step graph), then schedule.c,
 *                  dedupe.c and memplan.c; printing
 *
 * Value classes while planning (one per graph value):
 *   VIEW  - a strided view of a buffer (graph inputs, BLAS and reduction
 *           results, movement ops folded into index maps, virtual buffers);
 *   CONST - a FILL (a scalar broadcast anywhere, never stored); its
 *           strides are the layout eager gives it (the FILL's fresh
 *           tensor, then views), which a reduction of it follows;
 *   FUSED - computed inside a fused group at each element of the group's
 *           iteration space; it gets a buffer ("materialised") only when
 *           something outside the group needs it.
 *
 * Invariants every pass keeps:
 *   - Instructions (fused groups, matmuls, index ops, ...) form a dependency
 *     graph: an instruction depends on the instructions that write the buffers it reads,
 *     and the graph stays acyclic (plan_nodes.c's fusion invariant).
 *   - A pass that fails returns -1 with pl->why set ("out of memory ...",
 *     "no lowering for ...", or "internal: ..."); program.c reads the
 *     prefix to tell a permanent failure from one of this run.
 */
#ifndef GJ_JIT_PLAN_INT_H
#define GJ_JIT_PLAN_INT_H

#include "jit/plan/plan.h"
#include "runtime/attention_table.h"

#include <stdlib.h>
#include <string.h>

typedef enum vkind { V_UNSET = 0, V_VIEW, V_CONST, V_FUSED } vkind;

typedef struct vinfo {
    vkind kind;
    int buf; /* VIEW: buffer; FUSED: buffer once materialised, else -1 */
    int64_t offset;
    int64_t strides[GJ_MAX_DIMS]; /* over the value's own shape */
    double cval;
    int group; /* FUSED: its group */
} vinfo;

/* The order in which the eager SUM and MAX kernels (runtime/kernels_reduce.c)
 * take the elements of the value they reduce, which follows that value's
 * strides: its dims of size > 1 as a kernel must nest its loops (perm[0]
 * outermost), and how many of the last are eager's innermost coalesced
 * run, summed in 8 lanes (run > 0: per output; run 0: one accumulator per
 * output, added to in sequence, perm's last dim kept). See
 * gj_jit_pl_red_order. */
typedef struct red_order {
    int n;
    int8_t perm[GJ_MAX_DIMS];
    int run;
} red_order;

typedef struct pgroup {
    int ndim;
    int64_t shape[GJ_MAX_DIMS];
    int first;
    int64_t pos;
    int *nodes; /* members and SUMs, in order */
    int n, cap;
    bool has_red;
    uint32_t red_axes;
    red_order ord;          /* has_red: the eager order of every reduction of the group */
    bool is_copy;           /* a copy group: value (or constant) -> a view of a buffer */
    int copy_src;           /* the value, or -1: the constant copy_cval */
    double copy_cval;
    int copy_dst;           /* destination buffer, written at */
    int64_t copy_off;       /* offset copy_off with strides copy_st over shape */
    int64_t copy_st[GJ_MAX_DIMS];
    int instr;              /* its pinstr */
    bool dead;              /* merged into another group */
    /* FUSED values of other groups that this group's kernel computes again
     * from their inputs instead of loading them (plan_nodes.c: cheap
     * elementwise values, so that they need no buffer) */
    int *recomp;
    int n_recomp, cap_recomp;
    /* members of the forward (phase 0) / kept apart from it under a step's
     * memory budget (ir.h, apart): a group never holds both, or a
     * backward value or a recomputation would run in the forward and be
     * kept across the step (plan_nodes.c) */
    bool has_fwd, has_apart;
} pgroup;

/* An instruction while planning: a group or a matmul, with its dependencies. */
/* What a planned instruction will be. */
typedef enum pinstr_kind {
    PS_GROUP = 0,   /* a fused elementwise group: a kernel */
    PS_MATMUL = 1,  /* a BLAS call */
    PS_BARRIER = 2, /* no code: joins several writers of one value */
    PS_DEAD = 3,    /* merged into another group */
    PS_INDEX = 4,   /* gather / scatter-add of rows */
    PS_HOOK = 5,    /* a tensor hook call */
    PS_CALL = 6,    /* a custom op's backward call */
    PS_FOLD = 7,    /* an im2col / col2im */
    PS_ATTN = 8,    /* a fused attention forward or backward: a kernel of its own */
    PS_LCE = 9      /* a fused linear cross-entropy: a runtime call */
} pinstr_kind;

/* A fused attention instruction while planning (plan.h, gj_jit_kernel.attn). */
typedef struct pattn {
    int prim;
    gj_dtype dtype;
    int bufs[10];
    int n_bufs;
    int64_t units;
    int64_t gi[GJ_ATTN_NI];
} pattn;

typedef struct pinstr {
    pinstr_kind kind;
    int idx;  /* group or matmul index */
    int64_t pos;
    int *deps;
    int n_deps, cap_deps;
    int mark;
} pinstr;

typedef struct planner {
    const gj_jit_graph *g;
    gj_jit_plan *p;
    vinfo *vi;
    pgroup *groups;
    int n_groups, cap_groups;
    gj_jit_matmul *mms;
    int n_mm, cap_mm;
    gj_jit_index *ixs;
    int n_ix, cap_ix;
    gj_jit_hook_instr *hks;
    int n_hk, cap_hk;
    gj_jit_call_instr *cls;
    int n_cl, cap_cl;
    gj_jit_fold *fds;
    int n_fd, cap_fd;
    pattn *ats;
    int n_at, cap_at;
    gj_jit_lce *lcs;
    int n_lc, cap_lc;
    int last_hook_instr; /* -1, or the pinstr of the latest hook or custom call */
    pinstr *ps;
    int n_ps, cap_ps;
    int *uses; /* per value: node inputs and graph outputs reading it */
    int mark_gen;
    int *stack;
    char *why;
    size_t why_cap;
} planner;

/* ---------------------------------------------------- small helpers */

static inline void contig_strides(int nd, const int64_t *shape, int64_t *st) {
    int64_t s = 1;
    for (int k = nd - 1; k >= 0; k--) {
        st[k] = s;
        s *= shape[k] > 0 ? shape[k] : 1;
    }
}

static inline int64_t numel_of(int nd, const int64_t *shape) {
    int64_t n = 1;
    for (int k = 0; k < nd; k++) n *= shape[k];
    return n;
}

static inline bool same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
    if (na != nb) return false;
    for (int k = 0; k < na; k++)
        if (a[k] != b[k]) return false;
    return true;
}

static inline const gj_rt_meta *vmeta(planner *pl, int v) { return &pl->g->values[v].meta; }

static inline bool buf_virtual(const gj_jit_buffer *b) {
    return b->kind == GJ_JIT_BUF_IOTA || b->kind == GJ_JIT_BUF_DROPOUT;
}

static inline bool is_member_of(planner *pl, int v, int gi) {
    return pl->vi[v].kind == V_FUSED && pl->vi[v].group == gi;
}

/* Does group gi compute value v again (a value of another group)? */
static inline bool recomputes(const planner *pl, int gi, int v) {
    const pgroup *G = &pl->groups[gi];
    for (int k = 0; k < G->n_recomp; k++)
        if (G->recomp[k] == v) return true;
    return false;
}

/* ------------------------------------------- shared between the passes */

/* Sets why to "out of memory while planning"; returns -1. */
int gj_jit_pl_oom(planner *pl);
/* Sets why (and the error) to "no lowering for <prim>[ detail]"; -1. */
int gj_jit_pl_no_lowering(planner *pl, const gj_jit_node *n, const char *detail);
/* A new buffer of the plan; its id, or -1 (out of memory). */
int gj_jit_pl_new_buf(planner *pl, gj_jit_buf_kind kind, int index, gj_dtype dt, int64_t numel);
/* plan_views.c: the index map of a movement op's output over its input's
 * buffer (in: the input's view), or false when strides cannot express it. */
bool gj_jit_pl_fold_view(const gj_rt_inst *inst, const gj_rt_meta *im, const vinfo *in,
                         const gj_rt_meta *om, vinfo *out);
/* plan_nodes.c: plans graph node i (values, groups, instructions). 0 or -1. */
int gj_jit_pl_node(planner *pl, int i);
/* plan_nodes.c: the graph outputs (new or accumulated .grad). 0 or -1. */
int gj_jit_pl_outputs(planner *pl);
/* plan_kernel.c: the eager reduction order (red_order) of a value of shape
 * S[0..nd) with strides st (its layout as the eager kernel reads it)
 * reduced over the dims in red. */
void gj_jit_pl_red_order(int nd, const int64_t *S, const int64_t *st, uint32_t red,
                         red_order *o);
static inline bool same_red_order(const red_order *a, const red_order *b) {
    return a->n == b->n && a->run == b->run && memcmp(a->perm, b->perm, (size_t)a->n) == 0;
}
/* The value expressions of the kernel being built: id[v] (one per graph
 * value, -1: none yet) and the values set, so that the next kernel resets
 * only those (a step of N layers has O(N) kernels and O(N) values). */
typedef struct gj_jit_memo {
    int *id;
    int *set; /* the values whose id[] this kernel set, n_set of them */
    int n_set;
} gj_jit_memo;

static inline void gj_jit_memo_put(gj_jit_memo *m, int v, int id) {
    if (m->id[v] < 0) m->set[m->n_set++] = v;
    m->id[v] = id;
}

static inline void gj_jit_memo_clear(gj_jit_memo *m) {
    for (int i = 0; i < m->n_set; i++) m->id[m->set[i]] = -1;
    m->n_set = 0;
}

/* plan_kernel.c: the kernel of fused group gi, scheduled; memo (all -1 on
 * entry) caches value expressions. 0 or -1. */
int gj_jit_pl_kernel(planner *pl, int gi, gj_jit_kernel *k, gj_jit_memo *memo);

#endif /* GJ_JIT_PLAN_INT_H */
