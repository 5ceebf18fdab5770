/* SPDX-License-Identifier: MIT */
/*
 * step.c - the compiled training step (jit.h): a step's key, its program
 * (the cache machinery every compiled path shares, cache.c) and its runs.
 *
 * A gj_jit_step keeps one variant per traced shape of the step: the
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
 *   - Not thread-safe: one gj_jit_step is used by one thread at a time
 *     (programs and caches are shared safely across steps and threads).
 */
#include "step.h"

#include "fallback.h"
#include "run.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct variant {
    gj_jit_program *prog; /* a reference of the step's own */
    gj_tensor **consts;   /* the trace's constants (references) */
    int n_consts;
    int n_in, n_params;
    gj_jit_opt_kind kind;
    bool momentum, weight_decay, clip, keep_grads, eval;
    uint64_t rng; /* numbers the step draws from the generator */
    bool *requires_grad; /* per parameter, when traced */
} variant;

struct gj_jit_cstep {
    variant *v;
    int n_v, cap_v;
};

gj_jit_cstep *gj_jit_cstep_new(void) { return gj_rt_calloc(1, sizeof(gj_jit_step)); }

static void variant_free(variant *v) {
    gj_jit_program_release(v->prog);
    for (int c = 0; c < v->n_consts; c++) gj_rt_tensor_release(v->consts[c]);
    gj_rt_free(v->consts);
    gj_rt_free(v->requires_grad);
}

void gj_jit_cstep_free(gj_jit_cstep *s) {
    if (!s) return;
    for (int i = 0; i < s->n_v; i++) variant_free(&s->v[i]);
    gj_rt_free(s->v);
    gj_rt_free(s);
}

/* ---------------------------------------------------------------- key */

typedef struct text {
    char *p;
    size_t n, cap;
    bool oom;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
    if (t->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = t->cap - t->n;
        int k = vsnprintf(t->p ? t->p + t->n : NULL, t->p ? room : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            t->oom = true;
            return;
        }
        if (t->p && (size_t)k < room) {
            t->n += (size_t)k;
            return;
        }
        size_t nc = (t->cap ? t->cap * 2 : 4096) + (size_t)k;
        char *q = gj_rt_realloc(t->p, nc);
        if (!q) {
            t->oom = true;
            return;
        }
        t->p = q;
        t->cap = nc;
    }
}

static void put_meta(text *t, const gj_rt_meta *m, bool sizes) {
    put(t, " %s", gj_rt_dtype_name(m->dtype));
    if (!sizes) {
        put(t, "/%d", m->ndim);
        return;
    }
    put(t, "[");
    for (int k = 0; k < m->ndim; k++) put(t, k ? ",%lld" : "%lld", (long long)m->shape[k]);
    put(t, "]");
}

/* The key text of a step (sizes) or of its call site (!sizes). */
static void step_text(text *t, const gj_ag_trace *tr, int loss_slot, const gj_jit_opt *o,
                      bool keep, bool eval, const gj_jit_walk *w, bool sizes) {
    put(t, "gradjit step v1 opt %d mom %d wd %d clip %d keep %d eval %d in %d params %d rng %llu\n",
        (int)o->kind, o->momentum, o->weight_decay, o->clip > 0, keep, eval, tr->n_inputs, o->n,
        sizes ? (unsigned long long)(tr->rng1 - tr->rng0) : 0ull);
    for (int p = 0; p < o->n; p++) {
        gj_ag_tensor_meta *m = o->params[p]->ag;
        put(t, "p%d rg %d", p, m && m->requires_grad);
        gj_rt_meta pm;
        gj_rt_meta_of(o->params[p], &pm);
        put_meta(t, &pm, sizes);
        put(t, "\n");
    }
    for (int s = 0; s < tr->n_slots; s++) {
        const gj_ag_trace_slot *sl = &tr->slots[s];
        put(t, "s%d %d %d", s, (int)sl->kind,
            sl->kind == GJ_AG_SLOT_ALIAS ? sl->alias_of
                                         : sl->kind == GJ_AG_SLOT_OUTPUT ? sl->out : sl->index);
        put_meta(t, &sl->meta, sizes);
        if (sizes && sl->kind != GJ_AG_SLOT_OUTPUT && sl->kind != GJ_AG_SLOT_ALIAS) {
            int64_t st[GJ_MAX_DIMS];
            gj_jit_input_strides(sl->t, st);
            put(t, " st");
            for (int k = 0; k < sl->meta.ndim; k++) put(t, " %lld", (long long)st[k]);
        }
        put(t, "\n");
    }
    for (int j = 0; j < tr->n_entries; j++) {
        const gj_ag_trace_entry *e = &tr->entries[j];
        put(t, "e%d %s in", j, e->op->name);
        for (int i = 0; i < e->n_in; i++) put(t, " %d", e->in[i]);
        put(t, " out");
        for (int k = 0; k < e->n_out; k++) put(t, " %d", e->out[k]);
        put(t, " grad %d", e->node != NULL);
        if (sizes) {
            uint32_t rt = gj_jit_runtime_attrs(e->op);
            put(t, " i");
            for (int k = 0; k < e->attrs.ni; k++) {
                if (e->op == &gj_ag_op_dropout && k == 1) /* its place in the step's draws */
                    put(t, " @%llu", (unsigned long long)((uint64_t)e->attrs.i[1] - tr->rng0));
                else if (rt & (1u << k))
                    put(t, " *");
                else
                    put(t, " %lld", (long long)e->attrs.i[k]);
            }
            put(t, " f");
            for (int k = 0; k < e->attrs.nf; k++) put(t, " %a", e->attrs.f[k]);
        }
        put(t, "\n");
    }
    put(t, "loss %d\n", loss_slot);
    if (w) {
        if (sizes) put(t, "backward\n%.*s", (int)w->key_len, w->key);
        else put(t, "backward site %016llx%016llx\n", (unsigned long long)w->site[0],
                 (unsigned long long)w->site[1]);
    }
}

/* ------------------------------------------------------------ prepare */

typedef struct step_src {
    gj_jit_step_spec spec;
    const gj_jit_walk *w;
    gj_jit_capture cap;
    bool captured;
} step_src;

static gj_jit_graph *step_capture(void *ctx, char *why, size_t why_cap, gj_ca_reason *code,
                                  bool *permanent) {
    step_src *s = ctx;
    s->captured = true;
    if (gj_jit_capture_step(&s->cap, s->w, &s->spec) == 0) return &s->cap.g;
    snprintf(why, why_cap, "%s", s->cap.reason);
    *code = s->cap.code;
    *permanent = s->cap.permanent;
    return NULL;
}

static int step_finish(void *ctx, gj_jit_program *prog) {
    step_src *s = ctx;
    int n = 2 * s->spec.opt->n + 1;
    prog->ret = gj_rt_malloc(((size_t)n + 1) * sizeof *prog->ret);
    if (!prog->ret) return -1;
    memcpy(prog->ret, s->cap.ret, (size_t)n * sizeof *prog->ret);
    prog->n_ret = n;
    return 0;
}

int gj_jit_cstep_prepare(gj_jit_cstep *st, const gj_ag_trace *tr, gj_tensor *loss,
                        const gj_jit_opt *opt, bool keep_grads, bool eval, gj_ca_reason *code,
                        char *why, size_t why_cap) {
    *code = GJ_CA_OTHER;
    why[0] = '\0';
    int loss_slot = gj_ag_trace_slot_of(tr, loss);
    step_src src;
    memset(&src, 0, sizeof src);
    gj_jit_walk w;
    bool have_walk = false;
    text kt = {0}, stx = {0};
    int rc = 1;
    gj_tensor **req = NULL;
    if (loss_slot < 0 || tr->slots[loss_slot].kind != GJ_AG_SLOT_OUTPUT) {
        snprintf(why, why_cap, "the step function's loss is not a value it computed");
        *code = GJ_CA_UNTRACEABLE;
        goto out;
    }
    if (!eval) { /* the backward: gj_grad of the loss for the parameters that require grad */
        req = gj_rt_calloc((size_t)opt->n + 1, sizeof *req);
        if (!req) goto oom;
        int n_req = 0;
        for (int p = 0; p < opt->n; p++) {
            gj_ag_tensor_meta *m = opt->params[p]->ag;
            if (m && m->requires_grad) req[n_req++] = opt->params[p];
        }
        have_walk = true;
        if (gj_jit_walk_build_grad(&w, 1, &loss, NULL, n_req, req) != 0) goto oom;
        if (w.invalid) {
            snprintf(why, why_cap, "%s", w.reason);
            goto out;
        }
    }
    step_text(&kt, tr, loss_slot, opt, keep_grads, eval, have_walk ? &w : NULL, true);
    step_text(&stx, tr, loss_slot, opt, keep_grads, eval, have_walk ? &w : NULL, false);
    if (kt.oom || stx.oom) goto oom;
    gj_jit_key key = {kt.p, kt.n, {0, 0}, {0, 0}};
    gj_jit_hash128(kt.p, kt.n, key.hash);
    gj_jit_hash128(stx.p, stx.n, key.site);
    src.spec = (gj_jit_step_spec){tr, loss_slot, loss, opt, keep_grads, eval};
    src.w = have_walk ? &w : NULL;
    gj_jit_source source = {step_capture, step_finish, &src, GJ_JIT_PATH_STEP};
    gj_jit_got got = {0};
    int g = gj_jit_get_program(&key, &source, &got);
    if (g < 0) {
        rc = -1;
        goto out;
    }
    if (g != GJ_JIT_GOT) {
        *code = got.code;
        snprintf(why, why_cap, "%s", got.why);
        if (g == GJ_JIT_FELL) rc = 2; /* counted and reported already */
        goto out;
    }
    if (st->n_v == st->cap_v) {
        int nc = st->cap_v ? 2 * st->cap_v : 4;
        variant *v = gj_rt_realloc(st->v, (size_t)nc * sizeof *v);
        if (!v) {
            gj_jit_program_release(got.prog);
            goto oom;
        }
        st->v = v;
        st->cap_v = nc;
    }
    variant *v = &st->v[st->n_v];
    memset(v, 0, sizeof *v);
    v->prog = got.prog;
    v->n_in = tr->n_inputs;
    v->n_params = opt->n;
    v->kind = opt->kind;
    v->momentum = opt->momentum;
    v->weight_decay = opt->weight_decay;
    v->clip = opt->clip > 0;
    v->keep_grads = keep_grads;
    v->eval = eval;
    v->rng = tr->rng1 - tr->rng0;
    for (int s = 0; s < tr->n_slots; s++) v->n_consts += tr->slots[s].kind == GJ_AG_SLOT_CONST;
    v->consts = gj_rt_calloc((size_t)v->n_consts + 1, sizeof *v->consts);
    v->requires_grad = gj_rt_calloc((size_t)opt->n + 1, sizeof *v->requires_grad);
    if (!v->consts || !v->requires_grad) {
        gj_rt_free(v->consts);
        gj_rt_free(v->requires_grad);
        gj_jit_program_release(got.prog);
        goto oom;
    }
    for (int p = 0; p < opt->n; p++) {
        gj_ag_tensor_meta *m = opt->params[p]->ag;
        v->requires_grad[p] = m && m->requires_grad;
    }
    for (int s = 0; s < tr->n_slots; s++) {
        const gj_ag_trace_slot *sl = &tr->slots[s];
        if (sl->kind != GJ_AG_SLOT_CONST) continue;
        gj_rt_tensor_retain(sl->t);
        v->consts[sl->index] = sl->t;
    }
    st->n_v++;
    gj_jit_count_run(GJ_JIT_PATH_STEP, got.made, 0.0); /* this step ran eagerly while tracing */
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
    gj_rt_free(req);
    gj_rt_free(kt.p);
    gj_rt_free(stx.p);
    return rc == 2 ? 1 : rc;
}

/* ---------------------------------------------------------------- run */

/* The tensor of step input i of variant v's program in this run, or NULL. */
static gj_tensor *bound_tensor(const variant *v, const gj_jit_input *x, int n_in,
                               gj_tensor *const *in, const gj_jit_opt *o, gj_tensor *hyper) {
    int k = x->slot;
    switch (x->node) {
    case GJ_JIT_STEPIN_INPUT: return k < n_in ? in[k] : NULL;
    case GJ_JIT_STEPIN_PARAM: return k < o->n ? o->params[k] : NULL;
    case GJ_JIT_STEPIN_STATE1: return k < o->n && o->s1 ? o->s1[k] : NULL;
    case GJ_JIT_STEPIN_STATE2: return k < o->n && o->s2 ? o->s2[k] : NULL;
    case GJ_JIT_STEPIN_CONST: return k < v->n_consts ? v->consts[k] : NULL;
    case GJ_JIT_STEPIN_HYPER: return hyper;
    default: return NULL;
    }
}

/* Whether every input of v's program is bound, in this run, to a tensor of
 * the meta and layout the program was made for (in[] receives the data). */
static bool guards_hold(const variant *v, int n_in, gj_tensor *const *in, const gj_jit_opt *o,
                        gj_tensor *hyper, void **data) {
    if (v->n_in != n_in || v->n_params != o->n || v->kind != o->kind ||
        v->momentum != o->momentum || v->weight_decay != o->weight_decay || v->clip != (o->clip > 0))
        return false;
    for (int p = 0; p < o->n; p++) { /* the graph's structure: what needs a gradient, hooks */
        gj_ag_tensor_meta *m = o->params[p]->ag;
        if ((m && m->requires_grad) != v->requires_grad[p] || gj_ag_leaf_has_hooks(o->params[p]))
            return false;
    }
    const gj_jit_program *pr = v->prog;
    for (int i = 0; i < pr->n_inputs; i++) {
        gj_tensor *t = bound_tensor(v, &pr->inputs[i], n_in, in, o, hyper);
        if (!t) return false;
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (!gj_jit_meta_equal(&m, &pr->plan.in_meta[i])) return false;
        int64_t st[GJ_MAX_DIMS];
        gj_jit_input_strides(t, st);
        if (memcmp(st, pr->inputs[i].strides, (size_t)m.ndim * sizeof st[0]) != 0) return false;
        data[i] = gj_rt_data_ptr(t);
    }
    return true;
}

typedef struct alloc_ctx {
    const gj_jit_plan *p;
    gj_tensor **news;
} alloc_ctx;

static void *alloc_new(void *vctx, int o) {
    alloc_ctx *c = vctx;
    const gj_rt_meta *m = &c->p->out_meta[o];
    c->news[o] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    return c->news[o] ? gj_rt_data_ptr(c->news[o]) : NULL;
}

int gj_jit_cstep_run(gj_jit_cstep *st, int n_in, gj_tensor *const *in, const gj_jit_opt *opt,
                    gj_tensor **loss_out, bool *updated, gj_tensor **grads_out) {
    *loss_out = NULL;
    for (int p = 0; p < opt->n; p++) {
        updated[p] = false;
        if (grads_out) grads_out[p] = NULL;
    }
    if (st->n_v == 0) return 1;
    double t0 = gj_jit_now_ms();
    int64_t nh = (int64_t)opt->n * GJ_JIT_HYPER + 1;
    gj_tensor *hyper = gj_rt_tensor_empty(GJ_F64, 1, &nh);
    if (!hyper) return -1;
    memcpy(gj_rt_data_ptr(hyper), opt->hyper, (size_t)nh * sizeof(double));
    int rc = 1;
    void **data = NULL, **out = NULL;
    gj_tensor **news = NULL;
    uint64_t *params = NULL;
    const variant *v = NULL;
    for (int i = 0; i < st->n_v && !v; i++) {
        gj_rt_free(data);
        data = gj_rt_calloc((size_t)st->v[i].prog->n_inputs + 1, sizeof *data);
        if (!data) {
            rc = -1;
            goto done;
        }
        if (guards_hold(&st->v[i], n_in, in, opt, hyper, data)) v = &st->v[i];
    }
    if (!v) goto done; /* rc 1: trace again */
    const gj_jit_program *pr = v->prog;
    const gj_jit_plan *p = &pr->plan;
    rc = -1;
    out = gj_rt_calloc((size_t)pr->n_outputs + 1, sizeof *out);
    news = gj_rt_calloc((size_t)pr->n_outputs + 1, sizeof *news);
    if (!out || !news) goto done;
    if (p->n_rt_params > 0) { /* the step's dropout masks, from the generator as eager draws */
        params = gj_rt_calloc((size_t)p->n_rt_params * 2, sizeof *params);
        if (!params) goto done;
        uint64_t seed = gj_rt_rng_seed(), base = gj_rt_rng_reserve(v->rng);
        for (int k = 0; k < p->n_rt_params; k++) {
            if (p->rt_param_tape[k] != GJ_JIT_RT_STEP) {
                gj_rt_set_error("gj_step_run: internal: a dropout mask of unknown origin");
                goto done;
            }
            params[2 * k] = seed;
            params[2 * k + 1] = base + (uint64_t)p->rt_param_node[k];
        }
    } else if (v->rng > 0) {
        (void)gj_rt_rng_reserve(v->rng); /* (draws no program step reads: keep eager's stream) */
    }
    alloc_ctx ac = {p, news};
    int er = gj_jit_plan_exec(p, data, params, out, alloc_new, &ac);
    gj_jit_count_run(GJ_JIT_PATH_STEP, GJ_JIT_MADE_MEM_HIT, gj_jit_now_ms() - t0); /* it ran */
    if (er != 0) goto done;
    int no = pr->ret[2 * opt->n];
    if (no >= 0 && news[no]) { /* a clipping step: its norm must be finite, as eager's */
        double norm = *(const double *)gj_rt_data_ptr(news[no]);
        if (!isfinite(norm)) { /* (the program left every parameter and state as they were) */
            gj_rt_set_error("gj_clip_grad_norm: the total gradient norm is %g: gradients left "
                            "as they are", norm);
            goto done;
        }
    }
    for (int i = 0; i < pr->n_inputs; i++) { /* what the update wrote in place */
        bool written = false;
        for (int o = 0; o < pr->n_outputs && !written; o++) written = pr->outputs[o].grad_input == i;
        if (written) gj_rt_bump_version(bound_tensor(v, &pr->inputs[i], n_in, in, opt, hyper));
    }
    *loss_out = news[0];
    news[0] = NULL;
    for (int q = 0; q < opt->n; q++) {
        updated[q] = !v->eval && pr->ret[opt->n + q] != 0;
        int o = pr->ret[q];
        if (grads_out && o >= 0) {
            grads_out[q] = news[o];
            news[o] = NULL;
        }
    }
    rc = 0;
done:
    for (int o = 0; news && v && o < v->prog->n_outputs; o++)
        if (news[o]) gj_rt_tensor_release(news[o]);
    gj_rt_tensor_release(hyper);
    gj_rt_free(data);
    gj_rt_free(out);
    gj_rt_free(news);
    gj_rt_free(params);
    return rc;
}
