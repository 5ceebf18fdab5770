/* SPDX-License-Identifier: MIT */
/*
 * variants.c - the compiled training step (jit.h): a step's key, its program
 * (the cache machinery every compiled path shares, cache.c) and its runs.
 *
 * A gj_jit_cstep keeps one variant per traced shape of the step: the
 * program (a reference of its own, so an eviction from the memory cache
 * never strands a step), the trace's constants (references) and what the
 * variant was traced with (options, optimizer structure, the generator's
 * stretch). A run takes the first variant whose program's inputs all match
 * the tensors of this run: dtype, shape and layout of every step input,
 * parameter, optimizer state and constant (the guards); none matching
 * means the caller traces again (a new variant: another key, usually found
 * in the memory or disk cache, or bound to symbolic kernels for new sizes).
 *
 * Invariants:
 *   - The key is the canonical text of the trace -- its slots (kinds,
 *     indices, metas, layouts), its ops (names, attributes, with dropout
 *     seeds and offsets as their place in the step's own draws), the loss
 *     -- the optimizer's structure, the options, and the backward's gj_grad
 *     walk key; never an address. The call site is the same text without
 *     sizes and attribute values.
 *   - A run changes nothing before its program starts; the program writes
 *     the parameters and state in place (its last reads of each come first:
 *     plan_nodes.c), and every parameter and state it wrote has its version
 *     bumped afterwards, as the eager optimizer does.
 *   - Memory shared between a tensor the program writes in place (a
 *     parameter) and another tensor it reads (an input, a constant, another
 *     parameter: an overlapping view) is not compiled: the plan orders reads and writes
 *     of each buffer, not of two views of one memory. That run is eager.
 *   - Before a program starts, the values the eager forward checks (the
 *     labels of a cross-entropy, the rows of an embedding, when they come
 *     from a step input or a constant) are checked with the eager op's own
 *     message: a failing check changes nothing.
 *   - Not thread-safe: one gj_jit_cstep is used by one thread at a time
 *     (programs and caches are shared safely across steps and threads).
 */
#include "jit/step/step_int.h"

#include "jit/base/base.h"
#include "jit/run/run.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* A value the eager forward checks, read from a step input or a constant:
 * every element of it in [0, bound), or the step fails with op's message. */
typedef struct value_check {
    int kind, index; /* GJ_JIT_STEPIN_INPUT or _CONST, and which */
    int64_t bound;
    const char *op, *arg;
} value_check;

typedef struct variant {
    gj_jit_program *prog; /* a reference of the step's own */
    gj_tensor **consts;   /* the trace's constants (references) */
    int n_consts;
    int n_in, n_params;
    const gj_ag_optdef *def; /* the optimizer's rule and its structure bits */
    uint32_t structure;
    bool clip, keep_grads, eval;
    uint64_t rng;        /* numbers the step draws from the generator */
    uint64_t key;        /* the caller's variant key */
    bool reduced;        /* made with a reducer (of this layout and map): */
    uint64_t red_layout;
    int *red_of;         /* per parameter: its index in the reducer, or -1 */
    uint64_t *hook_sig;  /* per parameter, then per extra leaf: its hooks (hook_sig) */
    int *hook_bound;     /* per hook of the program: the bound tensor (a leaf) it is on */
    gj_jit_step_custom *customs; /* the custom ops its program calls */
    int n_customs;
    bool *requires_grad; /* per parameter, when traced */
    int32_t *alias;      /* per bound tensor (inputs, parameters, constants): alias_code */
    uint8_t *gstate;     /* per input, then per constant: grad_state */
    int n_extra;         /* leaves outside the optimizer whose gradients the program makes */
    int *extra;          /* [n_extra]: their bound index (an input or a constant) */
    value_check *checks;
    int n_checks;
    char *text;          /* check mode: the trace's text (trace_text) */
    size_t text_len;
    uint64_t last_use;   /* the run count of its last run (least recently used goes first) */
} variant;

struct gj_jit_cstep {
    variant *v;
    int n_v, cap_v;
    uint64_t runs;
    /* the last run abandoned by user code (gj_jit_cstep_last_trip) */
    gj_ca_reason trip_code;
    bool trip_permanent;
    char trip_why[sizeof ((gj_jit_runctx *)0)->why];
    gj_jit_step_mem mem; /* of the last variant prepared or run (has_mem) */
    bool has_mem;
};

gj_jit_cstep *gj_jit_cstep_new(void) { return gj_rt_calloc(1, sizeof(gj_jit_cstep)); }

static void variant_free(variant *v) {
    gj_jit_program_release(v->prog);
    for (int c = 0; c < v->n_consts; c++) gj_rt_tensor_release(v->consts[c]);
    gj_rt_free(v->consts);
    gj_rt_free(v->requires_grad);
    gj_rt_free(v->red_of);
    gj_rt_free(v->hook_sig);
    gj_rt_free(v->hook_bound);
    gj_rt_free(v->customs);
    gj_rt_free(v->alias);
    gj_rt_free(v->gstate);
    gj_rt_free(v->extra);
    gj_rt_free(v->checks);
    gj_rt_free(v->text);
}

/* ------------------------------------------------------------ guards */

/* The tensors a variant binds, in one list: the step inputs, the
 * parameters, then the constants. */
static int n_bound(int n_in, int n_params, int n_consts) { return n_in + n_params + n_consts; }

static gj_tensor *bound_at(int i, int n_in, gj_tensor *const *in, const gj_jit_opt *o,
                           gj_tensor *const *consts) {
    if (i < n_in) return in[i];
    if (i < n_in + o->n) return o->params[i - n_in];
    return consts[i - n_in - o->n];
}

/* Aliasing of bound tensor i with the ones before it: -1 (its memory is
 * its own), or 2 * j + 1 (the same tensor as j, the first before it whose
 * memory it overlaps), or 2 * j (another view overlapping j's memory). A
 * step input without gradient (gstate 0) is traced through a view of its
 * own (frontend/step.c), so for it "the same tensor" is only an overlap:
 * the function's reads through it and through another way to the same
 * tensor (a captured one) are distinct slots of the trace. */
static void alias_codes(int n, int n_in, gj_tensor *const *in, const gj_jit_opt *o,
                        gj_tensor *const *consts, const uint8_t *gstate, int32_t *code) {
    for (int i = 0; i < n; i++) {
        gj_tensor *t = bound_at(i, n_in, in, o, consts);
        bool pi = i < n_in && gstate[i] == 0;
        code[i] = -1;
        for (int j = 0; j < i && code[i] < 0; j++) {
            gj_tensor *u = bound_at(j, n_in, in, o, consts);
            bool plain = pi || (j < n_in && gstate[j] == 0);
            if (u == t && !plain) code[i] = 2 * j + 1;
            else if (u == t || gj_jit_views_overlap(u, t)) code[i] = 2 * j;
        }
    }
}

/* The hooks of leaf t as a guard sees them: how many, their kinds and
 * order, and which is `own` (the hook a reducer's calls replace; 0:
 * none). */
static uint64_t hook_sig(const gj_tensor *t, int64_t own) {
    const gj_ag_hook *hs[64];
    int n = gj_ag_leaf_hooks(t, hs, 64);
    uint64_t h = 1469598103934665603ull ^ (uint64_t)n;
    for (int j = 0; j < n && j < 64; j++)
        h = (h ^ (uint64_t)(1 + (int)hs[j]->kind + 2 * (own && hs[j]->handle == own))) *
            1099511628211ull;
    return h;
}

/* The handle of the hook the reducer of this call replaces on parameter
 * p (red_of: v's map), or 0. */
static int64_t own_hook(const gj_jit_step_call *call, const int *red_of, int p) {
    return call->red && red_of && red_of[p] >= 0 ? call->red->hooks[red_of[p]] : 0;
}

/* ZeRO: the hook the reducer's calls replace on leaf t (a parameter the
 * step function reads, whose shard the optimizer updates), or 0. */
static int64_t zero_own_hook(const gj_jit_step_call *call, const gj_tensor *t) {
    const gj_jit_reducer *red = call->red;
    for (int i = 0; red && red->zero && i < red->n; i++)
        if (red->params[i] == t) return red->hooks[i];
    return 0;
}

/* 0: no gradient; 1: a leaf that requires grad; 2: a tensor with autograd
 * history (the trace makes the step untraceable when the function uses it). */
static uint8_t grad_state(const gj_tensor *t) {
    const gj_ag_tensor_meta *m = t->ag;
    if (!m) return 0;
    if (m->node) return 2;
    return m->requires_grad ? 1 : 0;
}

void gj_jit_cstep_free(gj_jit_cstep *s) {
    if (!s) return;
    for (int i = 0; i < s->n_v; i++) variant_free(&s->v[i]);
    gj_rt_free(s->v);
    gj_rt_free(s);
}

/* ---------------------------------------------------------------- key */

static void put_meta(gj_jit_text *t, const gj_rt_meta *m, bool sizes) {
    gj_jit_text_put(t, " %s", gj_rt_dtype_name(m->dtype));
    if (!sizes) {
        gj_jit_text_put(t, "/%d", m->ndim);
        return;
    }
    gj_jit_text_put(t, "[");
    for (int k = 0; k < m->ndim; k++) gj_jit_text_put(t, k ? ",%lld" : "%lld", (long long)m->shape[k]);
    gj_jit_text_put(t, "]");
}

/* What prepare learns of a trace besides its ops: the constants (by
 * index), the aliasing and gradient state of everything it binds, the
 * leaves outside the optimizer that require grad, the values to check. */
typedef struct trace_info {
    gj_tensor **consts;
    int n_consts, nb;
    int32_t *alias;   /* [nb] */
    uint8_t *gstate;  /* [n_in + n_consts] */
    int *extra;       /* [n_extra]: bound indices */
    gj_tensor **extra_t;
    int n_extra;
    value_check *checks;
    int n_checks;
} trace_info;

static void trace_info_free(trace_info *ti) {
    gj_rt_free(ti->consts);
    gj_rt_free(ti->alias);
    gj_rt_free(ti->gstate);
    gj_rt_free(ti->extra);
    gj_rt_free(ti->extra_t);
    gj_rt_free(ti->checks);
    memset(ti, 0, sizeof *ti);
}

/* The value checks of the trace's ops whose checked argument is a step
 * input or a constant (autograd/trace.c refuses computed labels; computed
 * embedding rows are checked by the program's gather). */
static int find_checks(const gj_ag_trace *tr, trace_info *ti) {
    ti->checks = gj_rt_calloc((size_t)tr->n_entries + 1, sizeof *ti->checks);
    if (!ti->checks) return -1;
    for (int j = 0; j < tr->n_entries; j++) {
        const gj_ag_trace_entry *e = &tr->entries[j];
        bool ce = e->op == &gj_ag_op_cross_entropy, emb = e->op == &gj_ag_op_embedding;
        if (!ce && !emb) continue;
        int src = gj_ag_trace_value_source(tr, e->in[1]);
        if (src < 0) continue;
        const gj_ag_trace_slot *sl = &tr->slots[src];
        const gj_rt_meta *bm = &tr->slots[e->in[0]].meta;
        value_check *c = &ti->checks[ti->n_checks++];
        c->kind = sl->kind == GJ_AG_SLOT_INPUT ? GJ_JIT_STEPIN_INPUT : GJ_JIT_STEPIN_CONST;
        c->index = sl->index;
        c->bound = ce ? bm->shape[1] : bm->shape[0];
        c->op = ce ? "gj_cross_entropy" : "gj_embedding";
        c->arg = ce ? "labels" : "idx";
    }
    return 0;
}

static int trace_info_make(const gj_ag_trace *tr, const gj_jit_step_call *call, trace_info *ti) {
    memset(ti, 0, sizeof *ti);
    const gj_jit_opt *o = call->opt;
    for (int s = 0; s < tr->n_slots; s++) ti->n_consts += tr->slots[s].kind == GJ_AG_SLOT_CONST;
    ti->nb = n_bound(call->n_in, o->n, ti->n_consts);
    int ng = call->n_in + ti->n_consts;
    ti->consts = gj_rt_calloc((size_t)ti->n_consts + 1, sizeof *ti->consts);
    ti->alias = gj_rt_calloc((size_t)ti->nb + 1, sizeof *ti->alias);
    ti->gstate = gj_rt_calloc((size_t)ng + 1, sizeof *ti->gstate);
    ti->extra = gj_rt_calloc((size_t)ng + 1, sizeof *ti->extra);
    ti->extra_t = gj_rt_calloc((size_t)ng + 1, sizeof *ti->extra_t);
    if (!ti->consts || !ti->alias || !ti->gstate || !ti->extra || !ti->extra_t ||
        find_checks(tr, ti) != 0)
        return -1;
    for (int s = 0; s < tr->n_slots; s++)
        if (tr->slots[s].kind == GJ_AG_SLOT_CONST) ti->consts[tr->slots[s].index] = tr->slots[s].t;
    for (int g = 0; g < ng; g++) {
        int b = g < call->n_in ? g : g + o->n;
        ti->gstate[g] = grad_state(bound_at(b, call->n_in, call->in, o, ti->consts));
    }
    alias_codes(ti->nb, call->n_in, call->in, o, ti->consts, ti->gstate, ti->alias);
    for (int g = 0; g < ng; g++) {
        int b = g < call->n_in ? g : g + o->n;
        gj_tensor *t = bound_at(b, call->n_in, call->in, o, ti->consts);
        bool seen = ti->alias[b] >= 0 && (ti->alias[b] & 1); /* (the same tensor: once) */
        for (int p = 0; p < o->n && !seen; p++) seen = o->params[p] == t; /* (a parameter) */
        if (ti->gstate[g] == 1 && !seen && !call->eval) {
            ti->extra[ti->n_extra] = b;
            ti->extra_t[ti->n_extra++] = t;
        }
    }
    return 0;
}

/* ZeRO: whether bound tensor b is the parameter whose shard optimizer
 * parameter p is. The program reads the parameter (the forward, the
 * backward) and writes the shard, a view of it, in place: every read comes
 * before the first update (the backward's instructions are placed before
 * the updates), and the shards are gathered into the parameters after the
 * run. */
static bool zero_pair(const gj_jit_step_call *call, const trace_info *ti, int p, int b) {
    const gj_jit_reducer *red = call->red;
    int cb = b - call->n_in - call->opt->n;
    if (!red || !red->zero || call->red_of[p] < 0 || cb < 0 || cb >= ti->n_consts) return false;
    return ti->consts[cb] == red->params[call->red_of[p]];
}

/* The first bound tensor the program would write (a parameter) whose
 * memory overlaps another bound tensor's without being it, or -1. */
static int writer_alias(const trace_info *ti, const gj_jit_step_call *call) {
    int n_in = call->n_in, n_params = call->opt->n;
    for (int i = 0; i < ti->nb; i++) {
        int32_t c = ti->alias[i];
        if (c < 0 || (c & 1)) continue;
        int j = c / 2;
        bool pi = i >= n_in && i < n_in + n_params, pj = j >= n_in && j < n_in + n_params;
        if (pj && !pi && zero_pair(call, ti, j - n_in, i)) continue;
        if (pi || pj) return pi ? i - n_in : j - n_in;
    }
    return -1;
}

/* The key text of a step (sizes) or of its call site (!sizes). */
static void step_text(gj_jit_text *t, const gj_ag_trace *tr, int loss_slot, const gj_jit_step_call *call,
                      const trace_info *ti, const gj_jit_walk *w, bool sizes) {
    const gj_jit_opt *o = call->opt;
    gj_jit_text_put(t, "gradjit step v3 opt %s s %u clip %d keep %d eval %d in %d params %d rng %llu "
           "variant %llu\n",
        o->def ? o->def->name : "none", (unsigned)o->structure, o->clip > 0, call->keep_grads,
        call->eval,
        tr->n_inputs, o->n, sizes ? (unsigned long long)(tr->rng1 - tr->rng0) : 0ull,
        (unsigned long long)call->variant);
    if (call->mem_budget > 0) /* (no line without one: the keys of today's steps) */
        gj_jit_text_put(t, "budget %llu\n", (unsigned long long)call->mem_budget);
    if (call->red) {
        gj_jit_text_put(t, "reducer %016llx n %d of", (unsigned long long)call->red->layout,
                        call->red->n);
        for (int p = 0; p < o->n; p++) gj_jit_text_put(t, " %d", call->red_of[p]);
        gj_jit_text_put(t, "\n");
    }
    gj_jit_text_put(t, "alias");
    for (int i = 0; i < ti->nb; i++) gj_jit_text_put(t, " %d", (int)ti->alias[i]);
    gj_jit_text_put(t, "\ngrad");
    for (int g = 0; g < call->n_in + ti->n_consts; g++) gj_jit_text_put(t, " %d", (int)ti->gstate[g]);
    gj_jit_text_put(t, "\nextra");
    for (int e = 0; e < ti->n_extra; e++) gj_jit_text_put(t, " %d", ti->extra[e]);
    gj_jit_text_put(t, "\n");
    for (int p = 0; p < o->n; p++) {
        gj_ag_tensor_meta *m = o->params[p]->ag;
        gj_jit_text_put(t, "p%d rg %d", p, m && m->requires_grad);
        gj_rt_meta pm;
        gj_rt_meta_of(o->params[p], &pm);
        put_meta(t, &pm, sizes);
        gj_jit_text_put(t, "\n");
    }
    for (int s = 0; s < tr->n_slots; s++) {
        const gj_ag_trace_slot *sl = &tr->slots[s];
        gj_jit_text_put(t, "s%d %d %d", s, (int)sl->kind,
            sl->kind == GJ_AG_SLOT_ALIAS ? sl->alias_of
                                         : sl->kind == GJ_AG_SLOT_OUTPUT ? sl->out : sl->index);
        put_meta(t, &sl->meta, sizes);
        if (sizes && sl->kind != GJ_AG_SLOT_OUTPUT && sl->kind != GJ_AG_SLOT_ALIAS) {
            int64_t st[GJ_MAX_DIMS];
            gj_jit_input_strides(sl->t, st);
            gj_jit_text_put(t, " st");
            for (int k = 0; k < sl->meta.ndim; k++) gj_jit_text_put(t, " %lld", (long long)st[k]);
        }
        gj_jit_text_put(t, "\n");
    }
    for (int j = 0; j < tr->n_entries; j++) {
        const gj_ag_trace_entry *e = &tr->entries[j];
        gj_jit_text_put(t, "e%d %s in", j, e->op->name);
        for (int i = 0; i < e->n_in; i++) gj_jit_text_put(t, " %d", e->in[i]);
        gj_jit_text_put(t, " out");
        for (int k = 0; k < e->n_out; k++) gj_jit_text_put(t, " %d", e->out[k]);
        gj_jit_text_put(t, " grad %d", e->node != NULL);
        if (sizes) {
            uint32_t rt = gj_jit_runtime_attrs(e->op);
            gj_jit_text_put(t, " i");
            for (int k = 0; k < e->attrs.ni; k++) {
                if (e->op == &gj_ag_op_dropout && k == 1) /* its place in the step's draws */
                    gj_jit_text_put(t, " @%llu", (unsigned long long)((uint64_t)e->attrs.i[1] - tr->rng0));
                else if (rt & (1u << k))
                    gj_jit_text_put(t, " *");
                else
                    gj_jit_text_put(t, " %lld", (long long)e->attrs.i[k]);
            }
            gj_jit_text_put(t, " f");
            for (int k = 0; k < e->attrs.nf; k++) gj_jit_text_put(t, " %a", e->attrs.f[k]);
        }
        gj_jit_text_put(t, "\n");
    }
    gj_jit_text_put(t, "loss %d\n", loss_slot);
    if (w) {
        if (sizes) gj_jit_text_put(t, "backward\n%.*s", (int)w->key_len, w->key);
        else gj_jit_text_put(t, "backward site %016llx%016llx\n", (unsigned long long)w->site[0],
                 (unsigned long long)w->site[1]);
    }
}

/* ------------------------------------------------------------ prepare */

typedef struct step_src {
    gj_jit_step_spec spec;
    const gj_jit_walk *w;
    gj_jit_capture cap;
    bool captured;
    size_t budget;     /* the memory budget (0: none) */
    const gj_jit_key *key;
    bool over;         /* the budget cannot be met: the run fails with over_why */
    char over_why[300];
} step_src;

static double mib(size_t b) { return (double)b / (1024.0 * 1024.0); }

/* Under a memory budget, the captured graph rewritten to fit it
 * (plan/remat.c). The choice a search made is kept in the disk cache as
 * a hint for the key (the candidates dropped and their order): another
 * process planning the key tries it first, one trial plan instead of a
 * search's dozen. 0; 1 (s->over: it cannot fit); -1 (why[] set). */
static int step_budget(step_src *s, char *why, size_t why_cap) {
    gj_jit_remat rm = {.budget = s->budget};
    int64_t hint[2];
    if (gj_jit_disk_hint_load(s->key, "memory budget", hint, 2) == 0 && hint[0] > 0 &&
        hint[0] <= INT32_MAX) {
        rm.hint_k = (int)hint[0];
        rm.hint_order = (uint64_t)hint[1];
    }
    int rc = gj_jit_pass_remat(&s->cap.g, &rm, why, why_cap);
    if (rc == 0 && rm.searched && rm.n_dropped > 0) {
        hint[0] = rm.n_dropped;
        hint[1] = (int64_t)rm.order;
        gj_jit_disk_hint_save(s->key, "memory budget", hint, 2);
    }
    if (rc == 1) {
        s->over = true;
        snprintf(s->over_why, sizeof s->over_why,
                 "gj_step_run: the memory budget of %llu bytes (%.1f MiB) cannot be met: the "
                 "smallest peak the planner reaches is %llu bytes (%.1f MiB) of the step's "
                 "temporaries (opts.mem_budget, GRADJIT_STEP_MEM_BUDGET_MB)",
                 (unsigned long long)s->budget, mib(s->budget), (unsigned long long)rm.min_peak,
                 mib(rm.min_peak));
        snprintf(why, why_cap, "%s", s->over_why);
    }
    return rc;
}

static gj_jit_graph *step_capture(void *ctx, char *why, size_t why_cap, gj_ca_reason *code,
                                  bool *permanent) {
    step_src *s = ctx;
    s->captured = true;
    if (gj_jit_capture_step(&s->cap, s->w, &s->spec) == 0) {
        if (s->budget == 0 || s->spec.eval) return &s->cap.g;
        if (step_budget(s, why, why_cap) == 0) return &s->cap.g;
        *code = GJ_CA_OTHER;
        *permanent = false;
        return NULL;
    }
    snprintf(why, why_cap, "%s", s->cap.reason);
    *code = s->cap.code;
    *permanent = s->cap.permanent;
    return NULL;
}

/* The kernels of a step's updates: one dimension, no reduction, every
 * store into an input (a parameter or its state, in place). Generic, one
 * compiled kernel serves every parameter of an optimizer and dtype. */
static int generic_updates(gj_jit_plan *p) {
    bool *pick = gj_rt_calloc((size_t)p->n_instrs + 1, sizeof *pick);
    if (!pick) return -1;
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || k->nd != 1 || k->red || k->n_st == 0)
            continue;
        bool in_place = true;
        for (int t = 0; t < k->n_st && in_place; t++)
            in_place = p->bufs[k->acc[k->st[t].access].buf].kind == GJ_JIT_BUF_INPUT;
        pick[s] = in_place;
    }
    int rc = gj_jit_plan_make_kernels_generic(p, pick);
    gj_rt_free(pick);
    return rc;
}

static int step_finish(void *ctx, gj_jit_program *prog) {
    step_src *s = ctx;
    if (generic_updates(&prog->plan) != 0) return -1;
    int n = gj_jit_step_n_ret(s->spec.opt->n, s->spec.n_extra);
    prog->ret = gj_rt_malloc(((size_t)n + 1) * sizeof *prog->ret);
    if (!prog->ret) return -1;
    memcpy(prog->ret, s->cap.ret, (size_t)n * sizeof *prog->ret);
    prog->n_ret = n;
    gj_jit_remat_stats(&s->cap.g, &prog->saved_bytes, &prog->recompute_flops, &prog->recomputed);
    prog->budget = (int64_t)s->budget;
    return 0;
}

/* The memory of program pr as s's last (gj_jit_cstep_memory). */
static void note_memory(gj_jit_cstep *s, const gj_jit_program *pr) {
    s->mem = (gj_jit_step_mem){(int64_t)pr->plan.peak_temp_bytes, pr->saved_bytes,
                               pr->recompute_flops, pr->recomputed, pr->budget};
    s->has_mem = true;
}

int gj_jit_cstep_memory(const gj_jit_cstep *s, gj_jit_step_mem *out) {
    if (!s || !s->has_mem) return 1;
    *out = s->mem;
    return 0;
}

/* The bytes of the variants' programs (what the cache's limit counts). */
static int64_t variants_bytes(const gj_jit_cstep *st) {
    int64_t b = 0;
    for (int i = 0; i < st->n_v; i++) b += (int64_t)gj_jit_program_bytes(st->v[i].prog);
    return b;
}

/* Drops least recently used variants, never the newest (the last), while
 * their programs hold more than the memory cache's limit. */
static void bound_variants(gj_jit_cstep *st) {
    int64_t limit = gj_jit_mem_limit();
    while (limit >= 0 && st->n_v > 1 && variants_bytes(st) > limit) {
        int lru = 0;
        for (int i = 1; i < st->n_v - 1; i++)
            if (st->v[i].last_use < st->v[lru].last_use) lru = i;
        variant_free(&st->v[lru]);
        memmove(&st->v[lru], &st->v[lru + 1], (size_t)(st->n_v - lru - 1) * sizeof st->v[0]);
        st->n_v--;
    }
}

int gj_jit_cstep_variants(const gj_jit_cstep *st, int64_t *bytes) {
    if (bytes) *bytes = st ? variants_bytes(st) : 0;
    return st ? st->n_v : 0;
}

/* The hooks of new variant v: the signature of every parameter's and
 * extra leaf's hooks (the guards), and the leaf each hook of its program
 * is on (the program names it by its node in the backward's walk w). */
static int variant_hooks(variant *v, const gj_jit_step_call *call, const gj_jit_walk *w) {
    const gj_jit_opt *opt = call->opt;
    v->hook_sig = gj_rt_calloc((size_t)(opt->n + v->n_extra) + 1, sizeof *v->hook_sig);
    if (!v->hook_sig) return -1;
    for (int p = 0; p < opt->n; p++)
        v->hook_sig[p] = hook_sig(opt->params[p], own_hook(call, v->red_of, p));
    for (int e = 0; e < v->n_extra; e++) {
        gj_tensor *t = bound_at(v->extra[e], call->n_in, call->in, opt, v->consts);
        v->hook_sig[opt->n + e] = hook_sig(t, zero_own_hook(call, t));
    }
    const gj_jit_program *pr = v->prog;
    if (pr->n_hooks == 0) return 0;
    v->hook_bound = gj_rt_malloc((size_t)pr->n_hooks * sizeof *v->hook_bound);
    if (!v->hook_bound) return -1;
    int nb = n_bound(call->n_in, opt->n, v->n_consts);
    for (int i = 0; i < pr->n_hooks; i++) {
        const gj_jit_hookref *ref = &pr->hooks[i];
        const gj_tensor *leaf = w && ref->node >= 0 && ref->node < w->n ? w->nodes[ref->node]->leaf
                                                                        : NULL;
        v->hook_bound[i] = -1;
        for (int b = 0; leaf && b < nb && v->hook_bound[i] < 0; b++)
            if (bound_at(b, call->n_in, call->in, opt, v->consts) == leaf) v->hook_bound[i] = b;
        if (v->hook_bound[i] < 0) {
            gj_rt_set_error("gj_step_run: internal: hook #%d of the step's program is on no "
                            "leaf of the step", i);
            return -1;
        }
    }
    return 0;
}

/* The custom ops the program of new variant v calls, found where its
 * call instructions name them: the trace (the step function's calls) or
 * the backward's walk w (a backward, a checkpoint region's recomputation). */
static int variant_customs(variant *v, const gj_ag_trace *tr, const gj_jit_walk *w) {
    const gj_jit_plan *p = &v->prog->plan;
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_call_instr *cs = &p->instrs[s].cs;
        if (p->instrs[s].kind != GJ_JIT_INSTR_CALL ||
            (cs->tape != GJ_JIT_CALL_STEP_FWD && cs->tape < -1))
            continue;
        const gj_ag_opdef *op = NULL;
        const gj_ag_attrs *at = NULL;
        if (cs->tape == GJ_JIT_CALL_STEP_FWD && cs->node >= 0 && cs->node < tr->n_entries) {
            op = tr->entries[cs->node].op;
            at = &tr->entries[cs->node].attrs;
        } else if (cs->tape != GJ_JIT_CALL_STEP_FWD && w && cs->node >= 0 && cs->node < w->n) {
            const gj_ag_node *n = w->nodes[cs->node];
            if (cs->tape < 0) {
                op = n->op;
                at = &n->attrs;
            } else {
                op = gj_ag_ckpt_op(n, cs->tape, &at);
            }
        }
        if (!op || !at || !gj_ag_custom_of(op)) {
            gj_rt_set_error("gj_step_run: internal: call instruction %d of the step's program "
                            "names no custom op", s);
            return -1;
        }
        gj_jit_step_custom *c = gj_rt_realloc(v->customs, (size_t)(v->n_customs + 1) * sizeof *c);
        if (!c) return -1;
        v->customs = c;
        v->customs[v->n_customs++] = (gj_jit_step_custom){cs->tape, cs->node, op, *at};
    }
    return 0;
}

/* Keeps what the new variant v needs of the trace besides its program. */
static int variant_fill(variant *v, const gj_ag_trace *tr, const gj_jit_step_call *call,
                        trace_info *ti, const gj_jit_text *kt, const gj_jit_walk *w) {
    const gj_jit_opt *opt = call->opt;
    v->n_in = tr->n_inputs;
    v->n_params = opt->n;
    v->def = opt->def;
    v->structure = opt->structure;
    v->clip = opt->clip > 0;
    v->keep_grads = call->keep_grads;
    v->eval = call->eval;
    v->rng = tr->rng1 - tr->rng0;
    v->key = call->variant;
    v->reduced = call->red != NULL;
    if (call->red) {
        v->red_layout = call->red->layout;
        v->red_of = gj_rt_malloc(((size_t)opt->n + 1) * sizeof *v->red_of);
        if (!v->red_of) return -1;
        memcpy(v->red_of, call->red_of, (size_t)opt->n * sizeof *v->red_of);
    }
    v->consts = gj_rt_calloc((size_t)ti->n_consts + 1, sizeof *v->consts);
    v->requires_grad = gj_rt_calloc((size_t)opt->n + 1, sizeof *v->requires_grad);
    if (!v->consts || !v->requires_grad) return -1;
    v->n_consts = ti->n_consts;
    for (int c = 0; c < v->n_consts; c++) {
        gj_rt_tensor_retain(ti->consts[c]);
        v->consts[c] = ti->consts[c];
    }
    for (int p = 0; p < opt->n; p++) {
        gj_ag_tensor_meta *m = opt->params[p]->ag;
        v->requires_grad[p] = m && m->requires_grad;
    }
    v->alias = ti->alias; /* (taken over) */
    v->gstate = ti->gstate;
    v->extra = ti->extra;
    v->n_extra = ti->n_extra;
    v->checks = ti->checks;
    v->n_checks = ti->n_checks;
    ti->alias = NULL;
    ti->gstate = NULL;
    ti->extra = NULL;
    ti->checks = NULL;
    if (variant_hooks(v, call, w) != 0 || variant_customs(v, tr, w) != 0) return -1;
    if (call->keep_text) {
        v->text = gj_rt_malloc(kt->n + 1);
        if (!v->text) return -1;
        memcpy(v->text, kt->p, kt->n);
        v->text[kt->n] = '\0';
        v->text_len = kt->n;
    }
    return 0;
}

/* Appends the variant of program prog (the step's reference, taken over:
 * released on failure) and bounds the variants. 0, or -1 on OOM. */
static int variant_add(gj_jit_cstep *st, gj_jit_program *prog, const gj_ag_trace *tr,
                       const gj_jit_step_call *call, trace_info *ti, const gj_jit_text *tt,
                       const gj_jit_walk *w) {
    if (st->n_v == st->cap_v) {
        int nc = st->cap_v ? 2 * st->cap_v : 4;
        variant *v = gj_rt_realloc(st->v, (size_t)nc * sizeof *v);
        if (!v) {
            gj_jit_program_release(prog);
            return -1;
        }
        st->v = v;
        st->cap_v = nc;
    }
    variant *v = &st->v[st->n_v];
    memset(v, 0, sizeof *v);
    v->prog = prog;
    v->last_use = st->runs;
    if (variant_fill(v, tr, call, ti, tt, w) != 0) {
        variant_free(v);
        return -1;
    }
    st->n_v++;
    bound_variants(st);
    return 0;
}

int gj_jit_cstep_prepare(gj_jit_cstep *st, const gj_ag_trace *tr, gj_tensor *loss,
                         const gj_jit_step_call *call, gj_ca_reason *code, char *why,
                         size_t why_cap) {
    const gj_jit_opt *opt = call->opt;
    bool eval = call->eval;
    *code = GJ_CA_OTHER;
    why[0] = '\0';
    int loss_slot = gj_ag_trace_slot_of(tr, loss);
    step_src src;
    memset(&src, 0, sizeof src);
    gj_jit_walk w;
    bool have_walk = false;
    gj_jit_text kt = {0}, stx = {0}, tt = {0};
    int rc = 1;
    gj_tensor **req = NULL;
    trace_info ti;
    if (trace_info_make(tr, call, &ti) != 0) goto oom;
    if (loss_slot < 0 || tr->slots[loss_slot].kind != GJ_AG_SLOT_OUTPUT) {
        snprintf(why, why_cap, "the step function's loss is not a value it computed");
        *code = GJ_CA_UNTRACEABLE;
        goto out;
    }
    int wp = writer_alias(&ti, call);
    if (wp >= 0) { /* (this run is eager; a run without the aliasing traces again) */
        snprintf(why, why_cap, "parameter %d shares its memory with another tensor of the step "
                 "(a view of it as an input, a constant or a parameter): the update writes it in "
                 "place", wp);
        goto out;
    }
    if (!eval) { /* the backward: gj_grad of the loss for the leaves that require grad */
        req = gj_rt_calloc((size_t)opt->n + (size_t)ti.n_extra + 1, sizeof *req);
        if (!req) goto oom;
        int n_req = 0;
        for (int p = 0; p < opt->n; p++) {
            gj_ag_tensor_meta *m = opt->params[p]->ag;
            if (m && m->requires_grad) req[n_req++] = opt->params[p];
        }
        for (int e = 0; e < ti.n_extra; e++) req[n_req++] = ti.extra_t[e];
        have_walk = true;
        if (gj_jit_walk_build_grad(&w, 1, &loss, NULL, n_req, req) != 0) goto oom;
        if (w.invalid) {
            snprintf(why, why_cap, "%s", w.reason);
            goto out;
        }
    }
    step_text(&kt, tr, loss_slot, call, &ti, have_walk ? &w : NULL, true);
    step_text(&stx, tr, loss_slot, call, &ti, have_walk ? &w : NULL, false);
    if (call->keep_text) step_text(&tt, tr, loss_slot, call, &ti, NULL, true);
    if (kt.oom || stx.oom || tt.oom) goto oom;
    gj_jit_key key = {kt.p, kt.n, {0, 0}, {0, 0}};
    gj_jit_hash128(kt.p, kt.n, key.hash);
    gj_jit_hash128(stx.p, stx.n, key.site);
    src.spec = (gj_jit_step_spec){tr, loss_slot, loss, opt, call->keep_grads, eval,
                                  ti.n_extra, ti.extra_t, eval ? NULL : call->red, call->red_of};
    src.w = have_walk ? &w : NULL;
    src.budget = call->mem_budget;
    src.key = &key;
    gj_jit_source source = {step_capture, step_finish, &src, GJ_JIT_PATH_STEP,
                            call->red && call->red->zero};
    gj_jit_got got = {0};
    int g = gj_jit_get_program(&key, &source, &got);
    if (g < 0) {
        rc = -1;
        goto out;
    }
    if (g != GJ_JIT_GOT && src.over) { /* an error, not a fallback: the run fails */
        gj_rt_set_error("%s", src.over_why);
        rc = -1;
        goto out;
    }
    if (g != GJ_JIT_GOT) {
        *code = got.code;
        snprintf(why, why_cap, "%s", got.why);
        if (g == GJ_JIT_FELL) rc = 2; /* counted and reported already */
        goto out;
    }
    note_memory(st, got.prog);
    if (variant_add(st, got.prog, tr, call, &ti, &tt, have_walk ? &w : NULL) != 0) goto oom;
    gj_jit_count_run(GJ_JIT_PATH_STEP, got.made, 0.0); /* this step: traced (and run) */
    rc = 0;
    goto out;
oom:
    *code = GJ_CA_OTHER;
    snprintf(why, why_cap, "out of memory");
    rc = 1;
out:
    if (rc == 1) gj_jit_fallback(GJ_JIT_PATH_STEP, *code, why, false);
    if (src.captured) gj_jit_capture_free(&src.cap);
    if (have_walk) gj_jit_walk_free(&w);
    trace_info_free(&ti);
    gj_rt_free(req);
    gj_rt_free(kt.p);
    gj_rt_free(stx.p);
    gj_rt_free(tt.p);
    return rc == 2 ? 1 : rc;
}

/* ---------------------------------------------------------------- run */

/* The tensor of step input x of variant v's program in this call, or NULL. */
static gj_tensor *bound_tensor(const variant *v, int kind, int k, const gj_jit_step_call *call,
                               gj_tensor *hyper) {
    const gj_jit_opt *o = call->opt;
    switch (kind) {
    case GJ_JIT_STEPIN_INPUT: return k < call->n_in ? call->in[k] : NULL;
    case GJ_JIT_STEPIN_PARAM: return k < o->n ? o->params[k] : NULL;
    case GJ_JIT_STEPIN_STATE1: return k < o->n && o->s1 ? o->s1[k] : NULL;
    case GJ_JIT_STEPIN_STATE2: return k < o->n && o->s2 ? o->s2[k] : NULL;
    case GJ_JIT_STEPIN_CONST: return k < v->n_consts ? v->consts[k] : NULL;
    case GJ_JIT_STEPIN_HYPER: return hyper;
    default: return NULL;
    }
}

/* Whether v's structure, aliasing, gradient states and hooks hold for this
 * call (the guards that need no program input). */
static bool structure_holds(const variant *v, const gj_jit_step_call *call) {
    const gj_jit_opt *o = call->opt;
    if (v->n_in != call->n_in || v->n_params != o->n || v->def != o->def ||
        v->structure != o->structure || v->clip != (o->clip > 0) || v->key != call->variant)
        return false;
    if (v->reduced != (call->red != NULL) ||
        (v->reduced && (v->red_layout != call->red->layout ||
                        memcmp(v->red_of, call->red_of, (size_t)o->n * sizeof *v->red_of) != 0)))
        return false;
    for (int p = 0; p < o->n; p++) { /* the graph's structure: what needs a gradient, hooks */
        gj_ag_tensor_meta *m = o->params[p]->ag;
        if ((m && m->requires_grad) != v->requires_grad[p] ||
            hook_sig(o->params[p], own_hook(call, v->red_of, p)) != v->hook_sig[p])
            return false;
    }
    int ng = call->n_in + v->n_consts;
    for (int g = 0; g < ng; g++) {
        int b = g < call->n_in ? g : g + o->n;
        gj_tensor *t = bound_at(b, call->n_in, call->in, o, v->consts);
        if (grad_state(t) != v->gstate[g]) return false;
    }
    for (int e = 0; e < v->n_extra; e++) {
        gj_tensor *t = bound_at(v->extra[e], call->n_in, call->in, o, v->consts);
        if (hook_sig(t, zero_own_hook(call, t)) != v->hook_sig[o->n + e]) return false;
    }
    int nb = n_bound(call->n_in, o->n, v->n_consts); /* the aliasing the trace saw */
    int32_t stack[64], *code = nb <= 64 ? stack : gj_rt_malloc((size_t)nb * sizeof *code);
    if (!code) return false; /* (out of memory: trace again, which reports it) */
    alias_codes(nb, call->n_in, call->in, o, v->consts, v->gstate, code);
    bool same = memcmp(code, v->alias, (size_t)nb * sizeof *code) == 0;
    if (code != stack) gj_rt_free(code);
    if (!same) return false;
    return true;
}

/* Whether every guard of v holds for this call (data[] receives the data
 * of each program input). */
static bool guards_hold(const variant *v, const gj_jit_step_call *call, gj_tensor *hyper,
                        void **data) {
    if (!structure_holds(v, call)) return false;
    const gj_jit_program *pr = v->prog;
    for (int i = 0; i < pr->n_inputs; i++) {
        gj_tensor *t = bound_tensor(v, pr->inputs[i].node, pr->inputs[i].slot, call, hyper);
        if (!t) return false;
        if (gj_jit_input_fits(pr, i, t) != 0) return false;
        data[i] = gj_rt_data_ptr(t);
    }
    return true;
}

/* The eager forward's value checks, on this call's tensors. */
static bool checks_pass(const variant *v, const gj_jit_step_call *call) {
    for (int k = 0; k < v->n_checks; k++) {
        const value_check *c = &v->checks[k];
        const gj_tensor *t = bound_tensor(v, c->kind, c->index, call, NULL);
        if (t && !gj_rt_check_indices(c->op, c->arg, t, c->bound)) return false;
    }
    return true;
}

/* The gradients of leaves outside the optimizer go into their .grads as the
 * eager backward's accumulate puts them (set, or added in place). */
static int accumulate_extra(const variant *v, const gj_jit_step_call *call, gj_tensor **news) {
    const gj_jit_program *pr = v->prog;
    int base = 2 * call->opt->n + 1;
    gj_ag_builder *eb = gj_ag_eager_builder();
    for (int e = 0; e < v->n_extra; e++) {
        int o = pr->ret[base + e];
        if (o < 0 || !news[o]) continue;
        gj_tensor *leaf = bound_at(v->extra[e], call->n_in, call->in, call->opt, v->consts);
        gj_ag_leaf_lock(leaf);
        int r = eb->accumulate(eb, leaf, gj_ag_tensor_val(news[o]));
        gj_ag_leaf_unlock(leaf);
        if (r != 0) return -1;
    }
    return 0;
}

/* The first variant whose guards hold for this call, or NULL; *data (the
 * caller frees it) the data of its program's inputs. -1 on OOM. */
static int select_variant(gj_jit_cstep *st, const gj_jit_step_call *call, gj_tensor *hyper,
                          variant **out, void ***data) {
    *out = NULL;
    *data = NULL;
    for (int i = 0; i < st->n_v; i++) {
        gj_rt_free(*data);
        *data = gj_rt_calloc((size_t)st->v[i].prog->n_inputs + 1, sizeof **data);
        if (!*data) return -1;
        if (guards_hold(&st->v[i], call, hyper, *data)) {
            *out = &st->v[i];
            return 0;
        }
    }
    return 0;
}

/* One gj_jit_cstep_run, carried from stage to stage: the call and where
 * its results go, the variant chosen and its program, the run's scalars
 * (hyper, a new tensor) and what the run allocates, all freed by cr_free:
 * data[] (the data of each program input when the run starts), out[] and
 * news[] (new outputs, references), bound[] (a run with calls: the tensor
 * of each program input and of each hook's leaf), params[] (the dropout
 * seeds and offsets). Each stage returns CR_ON (the next stage runs) or
 * the run's result (jit.h: gj_jit_cstep_run). */
typedef struct cstep_run {
    gj_jit_cstep *st;
    const gj_jit_step_call *call;
    gj_tensor **loss_out, **grads_out;
    bool *updated;
    double t0;
    gj_tensor *hyper;
    variant *v;
    const gj_jit_program *pr;
    void **data, **out;
    gj_tensor **news, **bound;
    uint64_t *params;
} cstep_run;

enum { CR_ON = -2 }; /* the next stage decides */

/* The run's scalars and the first variant whose guards hold (1: none,
 * trace again), then the eager forward's value checks: nothing has run or
 * changed when this stage ends the run. */
static int cr_select(cstep_run *r) {
    const gj_jit_opt *opt = r->call->opt;
    int64_t nh = (int64_t)opt->n * GJ_AG_OPT_MAX_HYPER + 1;
    r->hyper = gj_rt_tensor_empty(GJ_F64, 1, &nh);
    if (!r->hyper) return -1;
    memcpy(gj_rt_data_ptr(r->hyper), opt->hyper, (size_t)nh * sizeof(double));
    if (select_variant(r->st, r->call, r->hyper, &r->v, &r->data) != 0) return -1;
    if (!r->v) return 1; /* trace again */
    r->v->last_use = r->st->runs;
    r->pr = r->v->prog;
    note_memory(r->st, r->pr);
    if (!checks_pass(r->v, r->call)) return -1; /* (nothing ran, nothing changed) */
    return CR_ON;
}

/* The output tables, and the step's dropout seeds and offsets: the
 * generator's stretch the eager step would draw from, reserved. */
static int cr_tables(cstep_run *r) {
    const gj_jit_program *pr = r->pr;
    const gj_jit_plan *p = &pr->plan;
    r->out = gj_rt_calloc((size_t)pr->n_outputs + 1, sizeof *r->out);
    r->news = gj_rt_calloc((size_t)pr->n_outputs + 1, sizeof *r->news);
    if (!r->out || !r->news) return -1;
    if (p->n_rt_params == 0) {
        if (r->v->rng > 0) /* (draws no instruction reads: keep eager's stream) */
            (void)gj_rt_rng_reserve(r->v->rng);
        return CR_ON;
    }
    r->params = gj_rt_calloc((size_t)p->n_rt_params * 2, sizeof *r->params);
    if (!r->params) return -1;
    uint64_t seed = gj_rt_rng_seed(), base = gj_rt_rng_reserve(r->v->rng);
    for (int k = 0; k < p->n_rt_params; k++) {
        if (p->rt_param_tape[k] != GJ_JIT_RT_STEP) {
            gj_rt_set_error("gj_step_run: internal: a dropout mask of unknown origin");
            return -1;
        }
        r->params[2 * k] = seed;
        r->params[2 * k + 1] = base + (uint64_t)p->rt_param_node[k];
    }
    return CR_ON;
}

/* Runs the program with its calls (user code, the reducer, remote inputs
 * gathered as read: gj_jit_step_exec). 3 when user code tripped a guard
 * (nothing updated; st keeps why), else 0 or -1. */
static int cr_exec_calls(cstep_run *r, bool remote, gj_jit_outs *ac) {
    const gj_jit_program *pr = r->pr;
    const gj_jit_step_call *call = r->call;
    const variant *v = r->v;
    r->bound = gj_rt_calloc((size_t)(pr->n_inputs + pr->n_hooks) + 1, sizeof *r->bound);
    if (!r->bound) return -1;
    for (int i = 0; i < pr->n_inputs; i++)
        r->bound[i] = bound_tensor(v, pr->inputs[i].node, pr->inputs[i].slot, call, r->hyper);
    for (int i = 0; i < pr->n_hooks; i++)
        r->bound[pr->n_inputs + i] = bound_at(v->hook_bound[i], call->n_in, call->in, call->opt,
                                              v->consts);
    gj_jit_step_run sr;
    memset(&sr, 0, sizeof sr);
    sr.hc.pr = pr;
    sr.hc.tensors = r->bound;
    sr.hc.data0 = r->data;
    sr.hc.remote = remote;
    sr.call = call;
    sr.customs = v->customs;
    sr.n_customs = v->n_customs;
    sr.hook_leaf = r->bound + pr->n_inputs;
    int er = gj_jit_step_exec(&sr, r->params, r->out, ac);
    if (er != 1) return er;
    gj_jit_cstep *st = r->st; /* user code tripped a guard: nothing updated, rerun eagerly */
    st->trip_code = sr.hc.code;
    st->trip_permanent = !sr.hc.transient;
    snprintf(st->trip_why, sizeof st->trip_why, "%s", sr.hc.why);
    return 3;
}

/* The program's run, then the reducer's after() (ZeRO: the updated shards
 * into every rank's parameters); the run counted. */
static int cr_exec(cstep_run *r) {
    const gj_jit_program *pr = r->pr;
    gj_jit_outs ac = {&pr->plan, r->news};
    bool remote = false; /* (ZeRO stage 3: parameters gathered as the program reads them) */
    for (int i = 0; i < pr->n_inputs && !remote; i++) {
        gj_tensor *t = bound_tensor(r->v, pr->inputs[i].node, pr->inputs[i].slot, r->call,
                                    r->hyper);
        remote = t && t->storage->fetch != NULL;
    }
    int er;
    if (pr->n_hooks > 0 || pr->n_calls > 0 || remote) /* user code, the reducer, or gathers */
        er = cr_exec_calls(r, remote, &ac);
    else
        er = gj_jit_plan_exec(&pr->plan, r->data, r->params, r->out, gj_jit_alloc_output, &ac);
    if (er != 0) return er == 3 ? 3 : -1;
    const gj_jit_reducer *red = r->call->red;
    if (r->v->reduced && red->after && red->after(red->ctx) != 0) return -1;
    if (!r->call->after_trace) /* it ran (else its trace counted the step) */
        gj_jit_count_run(GJ_JIT_PATH_STEP, GJ_JIT_MADE_MEM_HIT, gj_jit_now_ms() - r->t0);
    return CR_ON;
}

/* What the run leaves: a clipping step's norm checked (finite, as eager's),
 * the versions of what the update wrote bumped, the gradients of leaves
 * outside the optimizer accumulated, and the loss, the kept gradients and
 * the updated flags handed to the caller. */
static int cr_results(cstep_run *r) {
    const gj_jit_program *pr = r->pr;
    const gj_jit_opt *opt = r->call->opt;
    int no = pr->ret[2 * opt->n];
    if (no >= 0 && r->news[no]) {
        double norm = *(const double *)gj_rt_data_ptr(r->news[no]);
        if (!isfinite(norm)) { /* (the program left every parameter and state as they were) */
            gj_rt_set_error("gj_clip_grad_norm: the total gradient norm is %g: gradients left "
                            "as they are", norm);
            return 2;
        }
    }
    for (int i = 0; i < pr->n_inputs; i++) { /* what the update wrote in place */
        bool written = false;
        for (int o = 0; o < pr->n_outputs && !written; o++) written = pr->outputs[o].grad_input == i;
        if (written)
            gj_rt_bump_version(bound_tensor(r->v, pr->inputs[i].node, pr->inputs[i].slot, r->call,
                                            r->hyper));
    }
    if (accumulate_extra(r->v, r->call, r->news) != 0) return -1;
    *r->loss_out = r->news[0];
    r->news[0] = NULL;
    for (int q = 0; q < opt->n; q++) {
        r->updated[q] = !r->v->eval && pr->ret[opt->n + q] != 0;
        int o = pr->ret[q];
        if (r->grads_out && o >= 0) {
            r->grads_out[q] = r->news[o];
            r->news[o] = NULL;
        }
    }
    return 0;
}

/* Releases what the run holds, whatever the result. */
static void cr_free(cstep_run *r) {
    for (int o = 0; r->news && r->pr && o < r->pr->n_outputs; o++)
        if (r->news[o]) gj_rt_tensor_release(r->news[o]);
    if (r->hyper) gj_rt_tensor_release(r->hyper);
    gj_rt_free(r->data);
    gj_rt_free(r->out);
    gj_rt_free(r->news);
    gj_rt_free(r->bound);
    gj_rt_free(r->params);
}

int gj_jit_cstep_run(gj_jit_cstep *st, const gj_jit_step_call *call, gj_tensor **loss_out,
                     bool *updated, gj_tensor **grads_out) {
    const gj_jit_opt *opt = call->opt;
    *loss_out = NULL;
    for (int p = 0; p < opt->n; p++) {
        updated[p] = false;
        if (grads_out) grads_out[p] = NULL;
    }
    if (st->n_v == 0) return 1;
    st->runs++;
    cstep_run r;
    memset(&r, 0, sizeof r);
    r.st = st;
    r.call = call;
    r.loss_out = loss_out;
    r.grads_out = grads_out;
    r.updated = updated;
    r.t0 = gj_jit_now_ms();
    int rc = cr_select(&r);
    if (rc == CR_ON) rc = cr_tables(&r);
    if (rc == CR_ON) rc = cr_exec(&r);
    if (rc == CR_ON) rc = cr_results(&r);
    cr_free(&r);
    return rc;
}

void gj_jit_cstep_state_read(const gj_jit_cstep *st, int n_params, unsigned *state) {
    for (int k = 0; k < n_params; k++) state[k] = 0;
    if (st->n_v == 0) return;
    const gj_jit_program *pr = st->v[st->n_v - 1].prog;
    for (int i = 0; i < pr->n_inputs; i++) {
        int kind = pr->inputs[i].node, k = pr->inputs[i].slot;
        if ((kind == GJ_JIT_STEPIN_STATE1 || kind == GJ_JIT_STEPIN_STATE2) && k >= 0 && k < n_params)
            state[k] |= 1u << (kind - GJ_JIT_STEPIN_STATE1);
    }
}

bool gj_jit_cstep_newest_plain(const gj_jit_cstep *st) {
    if (st->n_v == 0) return false;
    const variant *v = &st->v[st->n_v - 1];
    return !v->reduced && v->prog->n_hooks == 0 && v->prog->n_calls == 0;
}

void gj_jit_cstep_last_trip(const gj_jit_cstep *st, gj_ca_reason *code, bool *permanent,
                            char *why, size_t cap) {
    *code = st->trip_code;
    *permanent = st->trip_permanent;
    snprintf(why, cap, "%s", st->trip_why);
}

/* -------------------------------------------------------------- check */

/* Where texts a and b first differ, as "'a's line from a little before the
 * difference' where the program has 'b's'" (at most 120 characters each). */
static void first_difference(const char *a, size_t na, const char *b, size_t nb, char *out,
                             size_t cap) {
    size_t i = 0, line = 0;
    while (i < na && i < nb && a[i] == b[i]) {
        if (a[i] == '\n') line = i + 1;
        i++;
    }
    size_t from = i > line + 40 ? i - 40 : line, ea = i, eb = i;
    while (ea < na && a[ea] != '\n') ea++;
    while (eb < nb && b[eb] != '\n') eb++;
    int la = (int)(ea - from > 120 ? 120 : ea - from), lb = (int)(eb - from > 120 ? 120 : eb - from);
    snprintf(out, cap, "the step function now traces '%s%.*s' where the program has '%s%.*s'",
             from > line ? "..." : "", la, a + from, from > line ? "..." : "", lb, b + from);
}

int gj_jit_cstep_check(gj_jit_cstep *st, const gj_ag_trace *tr, gj_tensor *loss,
                       const gj_jit_step_call *call, char *diff, size_t diff_cap) {
    diff[0] = '\0';
    int64_t nh = (int64_t)call->opt->n * GJ_AG_OPT_MAX_HYPER + 1;
    gj_tensor *hyper = gj_rt_tensor_empty(GJ_F64, 1, &nh);
    if (!hyper) return -1;
    variant *v = NULL;
    void **data = NULL;
    int rc = select_variant(st, call, hyper, &v, &data);
    gj_rt_free(data);
    gj_rt_tensor_release(hyper);
    if (rc != 0 || !v) return rc;
    if (!v->text) return 0; /* (traced before checks were on) */
    if (tr->untraceable[0] || tr->failed) {
        snprintf(diff, diff_cap, "the step function can no longer be traced: %s",
                 tr->failed ? "out of memory" : tr->untraceable);
        return 1;
    }
    trace_info ti;
    gj_jit_text tt = {0};
    rc = -1;
    if (trace_info_make(tr, call, &ti) != 0) goto out;
    int loss_slot = gj_ag_trace_slot_of(tr, loss);
    step_text(&tt, tr, loss_slot, call, &ti, NULL, true);
    if (tt.oom) goto out;
    rc = 0;
    if (tt.n != v->text_len || memcmp(tt.p, v->text, tt.n) != 0) {
        first_difference(tt.p, tt.n, v->text, v->text_len, diff, diff_cap);
        rc = 1;
        goto out;
    }
    for (int s = 0; s < tr->n_slots; s++) { /* the constants: the same tensors, or values */
        const gj_ag_trace_slot *sl = &tr->slots[s];
        if (sl->kind != GJ_AG_SLOT_CONST || sl->index >= v->n_consts) continue;
        const gj_tensor *old = v->consts[sl->index];
        if (!sl->created) {
            if (sl->t == old) continue;
            snprintf(diff, diff_cap, "constant %d (a tensor from outside the step function) is "
                     "another tensor than the one the program captured: a tensor in ctx was "
                     "replaced", sl->index);
            rc = 1;
            goto out;
        }
        gj_rt_meta mo;
        gj_rt_meta_of(old, &mo);
        bool same = gj_jit_meta_equal(&mo, &sl->meta);
        for (int64_t k = 0; same && k < sl->t->numel; k++) {
            double a = gj_rt_get(sl->t, k), b = gj_rt_get(old, k);
            same = memcmp(&a, &b, sizeof a) == 0;
        }
        if (!same) {
            snprintf(diff, diff_cap, "constant %d made in the step function holds other values "
                     "than when the program was traced (it depends on C state)", sl->index);
            rc = 1;
            goto out;
        }
    }
out:
    trace_info_free(&ti);
    gj_rt_free(tt.p);
    return rc;
}
