/* SPDX-License-Identifier: MIT */
/*
 * step.c - gj_step: a training step (forward, backward, update) run eagerly
 * or compiled whole (gradjit.h, "the compiled training step"). The eager
 * step is the reference; the compiled one traces it (autograd/trace.c) and
 * runs the program jit/step.c made from the trace.
 *
 * Invariants:
 *   - A run is the eager step -- zero_grad, fn, backward, optimizer step,
 *     zero_grad again unless keep_grads -- or zero_grad and the program of
 *     a variant whose guards hold, with the same results: loss,
 *     parameters, optimizer state (AdamW's step counts advanced here for
 *     the parameters the program updated), .grads (with keep_grads; of
 *     leaves outside the optimizer). A clipping program whose norm was not
 *     finite changed nothing: the run is then redone eagerly from the same
 *     generator position, which leaves eager's .grads and error.
 *   - Check mode (check_every, GRADJIT_STEP_CHECK): every check_every-th
 *     compiled run first traces fn again on its inputs (the generator put
 *     back after) and fails with the first difference from the trace of
 *     the program that run would use.
 *   - A step run inside a step function being traced makes the outer step
 *     untraceable and runs eagerly itself.
 *   - A run with no variant for its inputs traces: it runs the eager step
 *     with the trace recording fn's ops, and between fn and the backward
 *     (the graph alive, nothing updated yet) has the compiler make the
 *     program. If fn did what a replay cannot redo, the step is eager from
 *     then on (the reason counted once here, printed once).
 *   - Anomaly mode runs the step eagerly (counted, GJ_CA_INCOMPATIBLE_MODE).
 *   - With opts.ddp the gradients are averaged between the backward and the
 *     clip and update: eagerly by gj_ddp_wait (the reference), compiled by
 *     the reducer's calls inside the program (jit/step/calls.c). A step
 *     whose parameters carry a gj_ddp's hooks without it is refused.
 *   - User code in a program (hooks on leaves, custom ops) runs before any
 *     update; a run its guards stop is redone eagerly from the same
 *     generator position, and the step turns eager when the cause recurs
 *     (record_stream, set_, a .grad removed). A traced run whose backward
 *     saw record_stream or a parameter's set_ turns the step eager at once.
 *   - A traced run returns the allocator's cache when it ends.
 */
#include "fe.h"
#include "../jit/jit.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gj_step {
    gj_step_fn fn;
    void *ctx;
    gj_optim *opt;
    gj_step_opts o;
    gj_jit_cstep *jit;
    int n;                   /* parameters */
    gj_tensor **params;      /* borrowed from the optimizer */
    gj_tensor **s1, **s2;    /* this run's state (borrowed) */
    double *hyper;           /* [n * GJ_AG_OPT_MAX_HYPER + 1] */
    bool *updated;
    gj_tensor **grads;
    bool eager_only;         /* fn cannot be traced: every run is eager */
    gj_ca_reason why_code;   /* ... for this reason (why) */
    char why[320];
    uint64_t variant;        /* this run's variant key */
    int64_t compiled_runs;   /* runs that took the compiled path (check mode counts them) */
    gj_rt_meta *pmeta;       /* a traced run: each parameter's meta ... */
    void **pdata;            /* ... and data before its backward */
    const gj_jit_reducer *red; /* o.ddp's reducer, or NULL */
    int *red_of;             /* with red: per parameter, its index in red or -1 */
};

static void describe(gj_step *s, gj_jit_opt *jo);

static int64_t fnv(int64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t x = (uint64_t)h;
    for (size_t i = 0; i < n; i++) x = (x ^ b[i]) * 1099511628211ull;
    return (int64_t)x;
}

/* Every rank of o.ddp's group makes the same step: the same optimizer
 * (rule, configuration, hyperparameters), clipping and options; else the
 * ranks' updates would differ silently. One comparison each, so the error
 * says which differs. 0, or -1 with the error. */
static int reducer_agree(gj_step *s) {
    gj_jit_opt jo;
    describe(s, &jo);
    const int64_t seed = 1469598103934665603;
    int64_t rule = fnv(seed, jo.def ? jo.def->name : "", jo.def ? strlen(jo.def->name) : 0);
    rule = fnv(rule, &jo.structure, sizeof jo.structure);
    int64_t hyper = fnv(seed, s->hyper, (size_t)s->n * GJ_AG_OPT_MAX_HYPER * sizeof *s->hyper);
    int64_t clip = fnv(seed, &s->o.clip_norm, sizeof s->o.clip_norm);
    /* (ZeRO: each rank's optimizer has its own shards, as many as it has) */
    int64_t opts[3] = {s->o.keep_grads, s->red->zero ? 0 : s->n, s->o.autocast};
    if (s->red->zero) hyper = 0;
    const char *op = "gj_step_new (opts.ddp)";
    if (s->red->agree(s->red->ctx, &rule, 1, op, "the optimizer's rule and configuration") != 0 ||
        s->red->agree(s->red->ctx, &hyper, 1, op, "the optimizer's hyperparameters: learning "
                      "rate, betas or momentum, eps, weight decay") != 0 ||
        s->red->agree(s->red->ctx, &clip, 1, op, "opts.clip_norm") != 0 ||
        s->red->agree(s->red->ctx, opts, 3, op, "opts.keep_grads, the optimizer's "
                      "parameter count or opts.autocast") != 0)
        return -1;
    return 0;
}

/* A ZeRO gj_ddp: the optimizer is over its shards (every one of them, and
 * nothing else); no clipping (the norm would be of one rank's shards).
 * 0, or -1 with the error. */
static int zero_bind(gj_step *s) {
    const char *op = "gj_step_new";
    int n = 0;
    for (int i = 0; i < s->red->n; i++) n += s->red->shards[i] != NULL;
    for (int k = 0; k < s->n; k++)
        if (s->red_of[k] < 0) {
            gj_rt_set_error("%s: parameter %d of the optimizer is not a shard of opts.ddp (with "
                            "ZeRO the optimizer is made over gj_ddp_shards)", op, k);
            return -1;
        }
    if (n != s->n) {
        gj_rt_set_error("%s: the optimizer has %d parameters, opts.ddp %d shards on this rank "
                        "(with ZeRO the optimizer is made over gj_ddp_shards)", op, s->n, n);
        return -1;
    }
    if (s->o.clip_norm > 0) {
        gj_rt_set_error("%s: clip_norm with ZeRO is not supported (each rank holds a shard of "
                        "the gradients; the norm is global)", op);
        return -1;
    }
    return 0;
}

/* o.ddp: its reducer (registered while the gj_ddp lives), and per
 * parameter its index there; every parameter of the reducer must be one of
 * the optimizer's. 0, or -1 with an error. */
static int reducer_bind(gj_step *s) {
    const char *op = "gj_step_new";
    if (s->o.eval) {
        gj_rt_set_error("%s: an eval step has no backward for opts.ddp to average", op);
        return -1;
    }
    s->red = gj_jit_reducer_find(s->o.ddp);
    if (!s->red) {
        gj_rt_set_error("%s: opts.ddp is no live gj_ddp (freed, or not made by gj_ddp_new)", op);
        return -1;
    }
    s->red_of = gj_rt_malloc(((size_t)s->n + 1) * sizeof *s->red_of);
    if (!s->red_of) return -1;
    gj_tensor *const *mine = s->red->zero ? s->red->shards : s->red->params; /* (ZeRO: shards) */
    for (int k = 0; k < s->n; k++) {
        s->red_of[k] = -1;
        for (int i = 0; i < s->red->n; i++)
            if (mine[i] && mine[i] == s->params[k]) s->red_of[k] = i;
    }
    if (reducer_agree(s) != 0) return -1;
    if (s->red->zero) return zero_bind(s);
    for (int i = 0; i < s->red->n; i++) {
        int k = 0;
        while (k < s->n && s->red_of[k] != i) k++;
        if (k == s->n) {
            char nm[160];
            gj_rt_set_error("%s: parameter %d%s of opts.ddp is not one of the optimizer's %d "
                            "parameters: the step updates only those", op, i,
                            gj_rt_tensor_label(s->red->params[i], nm, sizeof nm), s->n);
            return -1;
        }
    }
    return 0;
}

gj_step *gj_step_new(gj_step_fn fn, void *ctx, gj_optim *opt, const gj_step_opts *opts) {
    const char *op = "gj_step_new";
    gj_step_opts o = {0};
    if (opts) o = *opts;
    if (!fn) {
        gj_rt_set_error("%s: fn is NULL", op);
        return NULL;
    }
    if (!opt && !o.eval) {
        gj_rt_set_error("%s: opt is NULL (only an eval step has no optimizer)", op);
        return NULL;
    }
    if (o.check_every < 0) {
        gj_rt_set_error("%s: check_every must be >= 0 (0: off), got %d", op, o.check_every);
        return NULL;
    }
    if (o.check_every == 0) o.check_every = gj_fe_step_check_env(); /* GRADJIT_STEP_CHECK=N */
    if (o.eval && o.mem_budget > 0) {
        gj_rt_set_error("%s: opts.mem_budget is %zu bytes, but an eval step has no backward to "
                        "plan activations for (leave it 0)", op, o.mem_budget);
        return NULL;
    }
    if (o.mem_budget > (SIZE_MAX >> 1)) {
        gj_rt_set_error("%s: opts.mem_budget of %zu bytes is no size (a negative number cast?)",
                        op, o.mem_budget);
        return NULL;
    }
    if (o.mem_budget == 0 && !o.eval) o.mem_budget = gj_fe_step_budget_env();
    if (!o.trace_computing) o.trace_computing = gj_fe_step_trace_computing_env();
    if (o.autocast != GJ_F32 && o.autocast != GJ_BF16) {
        gj_rt_set_error("%s: opts.autocast must be GJ_F32 (off) or GJ_BF16, got %d", op,
                        (int)o.autocast);
        return NULL;
    }
    if (!(o.clip_norm >= 0.0) || isinf(o.clip_norm)) {
        gj_rt_set_error("%s: clip_norm must be finite and >= 0 (0: no clipping), got %g", op,
                        o.clip_norm);
        return NULL;
    }
    gj_step *s = gj_rt_calloc(1, sizeof *s);
    if (!s) return NULL;
    s->fn = fn;
    s->ctx = ctx;
    s->opt = opt;
    s->o = o;
    s->n = gj_fe_optim_n(opt);
    size_t n1 = (size_t)s->n + 1;
    s->params = gj_rt_calloc(n1, sizeof *s->params);
    s->s1 = gj_rt_calloc(n1, sizeof *s->s1);
    s->s2 = gj_rt_calloc(n1, sizeof *s->s2);
    s->hyper = gj_rt_calloc(n1 * GJ_AG_OPT_MAX_HYPER + 1, sizeof *s->hyper);
    s->updated = gj_rt_calloc(n1, sizeof *s->updated);
    s->grads = gj_rt_calloc(n1, sizeof *s->grads);
    s->pmeta = gj_rt_calloc(n1, sizeof *s->pmeta);
    s->pdata = gj_rt_calloc(n1, sizeof *s->pdata);
    s->jit = gj_jit_cstep_new();
    if (!s->params || !s->s1 || !s->s2 || !s->hyper || !s->updated || !s->grads || !s->pmeta ||
        !s->pdata || !s->jit) {
        gj_step_free(s);
        return NULL;
    }
    for (int k = 0; k < s->n; k++) s->params[k] = gj_fe_optim_param(opt, k);
    if (o.ddp && reducer_bind(s) != 0) {
        gj_step_free(s);
        return NULL;
    }
    return s;
}

void gj_step_free(gj_step *s) {
    if (!s) return;
    gj_jit_cstep_free(s->jit);
    gj_rt_free(s->params);
    gj_rt_free(s->s1);
    gj_rt_free(s->s2);
    gj_rt_free(s->hyper);
    gj_rt_free(s->updated);
    gj_rt_free(s->grads);
    gj_rt_free(s->red_of);
    gj_rt_free(s->pmeta);
    gj_rt_free(s->pdata);
    gj_rt_free(s);
}

void gj_warmup_stats_get(gj_warmup_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    out->compile_ms = gj_jit_making_ms();
    gj_rt_gemm_stats g;
    gj_rt_gemm_get_stats(&g);
    out->gemm_choice_ms = g.decide_ms;
    out->gemm_measured = g.measured;
    gj_rt_page_stats_t pg;
    gj_rt_page_stats(&pg);
    out->new_bytes = pg.mapped_bytes;
    out->huge_bytes = pg.advised_bytes;
    out->page_kib = pg.hugepages ? 2048 : 4;
    gj_rt_zero_stats(&out->zeroed_bytes, &out->zero_skipped_bytes);
}

void gj_step_stats(gj_ca_stats *out) {
    if (!out) return;
    gj_jit_cstep_stats(out);
}

void gj_step_reset_stats(void) { gj_jit_cstep_reset_stats(); }

int gj_step_memory_stats(const gj_step *s, gj_step_memory *out) {
    if (!s || !out) {
        gj_rt_set_error("gj_step_memory_stats: %s is NULL", !s ? "the step" : "out");
        return -1;
    }
    gj_jit_step_mem m;
    if (gj_jit_cstep_memory(s->jit, &m) != 0) {
        gj_rt_set_error("gj_step_memory_stats: the step has no compiled program yet (%s)",
                        s->o.eager ? "opts.eager: every run is eager"
                                   : "its first run compiles it, or its runs are eager");
        return -1;
    }
    *out = (gj_step_memory){m.peak_bytes, m.saved_bytes, m.recompute_flops, m.recomputed,
                            m.budget_bytes};
    return 0;
}

/* The optimizer as the compiler sees it for this run. */
static void describe(gj_step *s, gj_jit_opt *jo) {
    memset(jo, 0, sizeof *jo);
    if (s->opt) gj_fe_optim_describe(s->opt, jo, s->s1, s->s2, s->hyper);
    jo->n = s->n;
    jo->clip = s->o.eval ? 0.0 : s->o.clip_norm;
    s->hyper[(size_t)s->n * GJ_AG_OPT_MAX_HYPER] = jo->clip; /* the run-time value */
    jo->params = s->params;
    jo->s1 = s->s1;
    jo->s2 = s->s2;
    jo->hyper = s->hyper;
}

/* Checks fn's result: a 0-d float tensor. */
static bool loss_ok(const gj_tensor *loss) {
    if (!loss) {
        if (!gj_last_error()[0]) /* (cleared before fn ran: fn said nothing) */
            gj_rt_set_error("gj_step_run: the step function returned NULL without an error");
        return false;
    }
    if (loss->ndim != 0 || !gj_rt_dtype_is_float(loss->dtype)) {
        char sh[96];
        gj_rt_fmt_shape(sh, sizeof sh, loss->ndim, loss->shape);
        gj_rt_set_error("gj_step_run: the step function returned a %s %s tensor; the loss must "
                        "be a 0-d float tensor",
                        gj_rt_dtype_name(loss->dtype), sh);
        return false;
    }
    return true;
}

/* The inputs fn sees while it is traced: each input without autograd meta
 * (no gradient, no history) through a view of its own, so that the trace
 * tells apart the ways fn reaches one tensor (in[0] and in[1] the same
 * tensor; an input that is also a tensor ctx holds) and the program reads
 * each the way fn did; inputs with autograd meta as they are (a leaf's
 * gradient belongs to the leaf itself). NULL on OOM; free with
 * proxies_free. */
static gj_tensor **proxies_new(int n_in, gj_tensor *const *in, bool abstract) {
    gj_tensor **px = gj_rt_calloc((size_t)n_in + 1, sizeof *px);
    if (!px) return NULL;
    for (int k = 0; k < n_in; k++) {
        const gj_ag_tensor_meta *m = in[k]->ag;
        bool plain = !m || (!m->requires_grad && !m->node);
        px[k] = !plain ? in[k] : abstract ? gj_rt_tensor_abstract_like(in[k])
                                          : gj_rt_tensor_alias(in[k]);
        if (!px[k]) return px; /* (proxies_free releases what was made) */
        if (!plain) gj_rt_tensor_retain(px[k]);
    }
    return px;
}

static void proxies_free(int n_in, gj_tensor **px) {
    if (!px) return;
    for (int k = 0; k < n_in; k++)
        if (px[k]) gj_rt_tensor_release(px[k]);
    gj_rt_free(px);
}

static bool proxies_ok(int n_in, gj_tensor **px) {
    if (!px) return false;
    for (int k = 0; k < n_in; k++)
        if (!px[k]) return false;
    return true;
}

/* Marks the step eager from now on for reason code (printed once; this
 * run counted as a fallback unless it was counted already). */
static void make_eager(gj_step *s, gj_ca_reason code, const char *why, bool counted) {
    s->eager_only = true;
    s->why_code = code;
    snprintf(s->why, sizeof s->why, "%s", why);
    if (counted) gj_jit_cstep_note_eager(code, why);
    else gj_jit_cstep_note_fallback(code, why, true);
}

/* The parameters' metas and data before a traced step's backward. */
static void params_note(gj_step *s) {
    for (int k = 0; k < s->n; k++) {
        gj_rt_meta_of(s->params[k], &s->pmeta[k]);
        s->pdata[k] = gj_rt_data_ptr(s->params[k]);
    }
}

/* After a traced step's backward: what its hooks did that a program cannot
 * follow (record_stream; set_ on a parameter) makes the step eager from
 * now on, with that reason (the program made before the backward stays
 * unused). */
static void backward_check(gj_step *s, uint64_t rs1) {
    char why[300];
    if (gj_rt_record_stream_calls() != rs1) {
        make_eager(s, GJ_CA_RECORD_STREAM,
                   "a hook called gj_tensor_record_stream during the step's backward", true);
        return;
    }
    for (int k = 0; k < s->n; k++) {
        gj_rt_meta m;
        gj_rt_meta_of(s->params[k], &m);
        if (m.dtype != s->pmeta[k].dtype || m.ndim != s->pmeta[k].ndim ||
            memcmp(m.shape, s->pmeta[k].shape, (size_t)m.ndim * sizeof m.shape[0]) != 0 ||
            gj_rt_data_ptr(s->params[k]) != s->pdata[k]) {
            snprintf(why, sizeof why, "a hook changed parameter %d (set_: %s, another storage) "
                     "during the step's backward", k, gj_rt_dtype_name(m.dtype));
            make_eager(s, GJ_CA_SET_MISMATCH, why, true);
            return;
        }
    }
}

/* How run_eager runs the step: eagerly; traced (the trace records fn and
 * the compiler makes the program before the backward); or traced and, when
 * the trace made a program that runs no user code, stopped after the
 * forward for that program to run the step (a training step's first run:
 * the eager backward and update would touch a second set of buffers, in
 * the eager engine's sizes, and hold what a memory budget keeps out; the
 * program's run touches its own, which every later run reuses). */
typedef enum run_mode { RUN_EAGER = 0, RUN_TRACE, RUN_TRACE_FORWARD, RUN_TRACE_ABSTRACT } run_mode;

/* Whether this run's first trace may be abstract (RUN_TRACE_ABSTRACT,
 * docs/architecture.md "Memory is the compiler's to plan"): a training
 * step (unless opts.trace_computing) without a reducer, whose parameters have no
 * hooks and whose inputs are plain tensors of their own (no autograd
 * history, no memory shared with another input or a parameter, no remote
 * or abstract bytes): what the program then reads is what the eager step
 * would. */
static bool abstract_ok(const gj_step *s, int n_in, gj_tensor *const *in) {
    if (s->o.eval || s->o.trace_computing || s->red) return false;
    for (int p = 0; p < s->n; p++) {
        const gj_ag_tensor_meta *m = s->params[p]->ag;
        if (m && (m->hooks || m->post_hooks)) return false;
    }
    for (int k = 0; k < n_in; k++) {
        const gj_ag_tensor_meta *m = in[k]->ag;
        if ((m && (m->requires_grad || m->node)) || in[k]->storage->fetch) return false;
        for (int j = 0; j < k; j++)
            if (in[j]->storage == in[k]->storage) return false;
        for (int p = 0; p < s->n; p++)
            if (s->params[p]->storage == in[k]->storage) return false;
    }
    return true;
}

/* The eager step, as mode says. The loss goes to the scope open when the
 * run started (a detached alias: no history). RUN_TRACE_FORWARD: *stopped
 * says whether it stopped after the forward (nothing updated, no loss: the
 * program is to run the step), else the step ran whole.
 * RUN_TRACE_ABSTRACT: the forward traced on abstract proxies of the inputs
 * (nothing computed that depends on them); 0 with *stopped (as above), or
 * without going on: 2 (nothing of the trace kept or counted: trace the step
 * again, computing) or 3 (the trace made its variant, or fell back and was
 * counted: run the step eagerly, untraced). */
static int run_eager_as(gj_step *s, int n_in, gj_tensor *const *in, gj_tensor **loss_out,
                        run_mode mode, bool *stopped) {
    bool trace = mode != RUN_EAGER, abstract = mode == RUN_TRACE_ABSTRACT;
    int rc = -1;
    bool reducing = false;
    gj_ag_trace *tr = NULL;
    gj_tensor *keep = NULL, **px = NULL;
    if (trace) {
        px = proxies_new(n_in, in, abstract);
        if (!proxies_ok(n_in, px)) {
            proxies_free(n_in, px);
            return -1;
        }
        in = px;
    }
    if (!s->o.eval) gj_optim_zero_grad(s->opt);
    uint64_t rs0 = gj_rt_record_stream_calls();
    gj_scope_push();
    if (s->o.eval) gj_no_grad_push();
    if (trace && !(tr = gj_ag_trace_begin(n_in, in, s->n, s->params))) goto done;
    gj_clear_error();
    gj_dtype ac0 = gj_get_autocast();
    gj_set_autocast(s->o.autocast);
    if (abstract) gj_rt_set_abstract(true);
    gj_tensor *loss = s->fn(s->ctx, n_in, in);
    if (abstract) gj_rt_set_abstract(false);
    gj_set_autocast(ac0);
    if (tr) gj_ag_trace_end(tr);
    if (abstract && !loss_ok(loss)) { /* (a value it needed, or a failure to see computing) */
        gj_clear_error();
        rc = 2;
        goto done;
    }
    if (!loss_ok(loss)) goto done;
    if (tr) {
        const char *why = tr->untraceable;
        if (!why[0] && tr->failed) why = "out of memory while tracing";
        if (!why[0] && gj_rt_record_stream_calls() != rs0)
            why = "the step function called gj_tensor_record_stream, which a compiled step "
                  "cannot replay";
        if (why[0] && abstract) { /* judged again by a trace that computes */
            rc = 2;
            goto done;
        }
        if (why[0]) { /* eager from now on */
            s->eager_only = true;
            s->why_code = GJ_CA_UNTRACEABLE;
            snprintf(s->why, sizeof s->why, "%s", why);
            gj_jit_cstep_note_fallback(GJ_CA_UNTRACEABLE, why, true);
        } else {
            gj_jit_opt jo;
            describe(s, &jo);
            gj_jit_step_call call = {n_in, in, &jo, s->variant, s->o.keep_grads, s->o.eval,
                                     s->o.check_every > 0, s->red, s->red_of,
                                     s->o.mem_budget, false};
            gj_ca_reason code;
            char jwhy[300];
            int pr = gj_jit_cstep_prepare(s->jit, tr, loss, &call, &code, jwhy, sizeof jwhy);
            if (pr < 0) goto done;
            bool plain = pr == 0 && gj_jit_cstep_newest_plain(s->jit);
            if ((mode == RUN_TRACE_FORWARD || abstract) && plain) {
                *stopped = true; /* the forward freed unused */
                rc = 0;
                goto done;
            }
            if (abstract) { /* no values for an eager backward */
                rc = 3;
                goto done;
            }
        }
    }
    if (!s->o.eval) {
        reducing = s->red != NULL; /* (the backward's hooks start the reducer's buckets) */
        uint64_t rs1 = gj_rt_record_stream_calls();
        if (tr) params_note(s);
        if (gj_backward(loss, NULL) != 0) goto done;
        reducing = false;
        if (tr && !s->eager_only) backward_check(s, rs1);
        if (s->red && s->red->wait(s->red->ctx) != 0) goto done;
        if (s->o.clip_norm > 0 && gj_clip_grad_norm(s->n, s->params, s->o.clip_norm, NULL) != 0)
            goto done;
        if (gj_optim_step(s->opt) != 0) goto done;
        if (s->red && s->red->after && s->red->after(s->red->ctx) != 0) goto done;
        if (!s->o.keep_grads) gj_optim_zero_grad(s->opt);
    }
    if (loss_out && !(keep = gj_rt_tensor_alias(loss))) goto done;
    rc = 0;
done:
    if (tr) gj_ag_trace_free(tr);
    if (s->o.eval) gj_no_grad_pop();
    gj_scope_pop();
    proxies_free(n_in, px);
    /* Hooks fn registered there: it registers them again when it runs next
     * (a hook makes the trace untraceable: this run never stops for the
     * program) */
    if (abstract) gj_fe_abstract_hooks_undo();
    /* A traced run is an eager step: the blocks it freed, cached for reuse,
     * are the eager step's sizes, which the program's buffers mostly are
     * not; returned now, the step holds no more than the eager step does.
     * (Stopped after the forward, the program's run takes what it can of
     * them first: run_after_trace.) */
    if (trace && !(stopped && *stopped)) gj_rt_alloc_release_cache();
    if (reducing) { /* a failed backward: nothing of the reducer's left in flight */
        char err[512];
        snprintf(err, sizeof err, "%s", gj_last_error());
        (void)s->red->end(s->red->ctx);
        gj_rt_set_error("%s", err);
    }
    if (rc == 0 && loss_out && keep && !(*loss_out = gj_fe_own(keep))) rc = -1;
    return rc;
}

static int run_eager(gj_step *s, int n_in, gj_tensor *const *in, gj_tensor **loss_out,
                     bool trace) {
    return run_eager_as(s, n_in, in, loss_out, trace ? RUN_TRACE : RUN_EAGER, NULL);
}

/* Check mode: traces fn again on this run's inputs (its forward runs
 * eagerly, nothing is updated, the generator is put back) and compares the
 * trace with the program's. 0 (the same), -1 (a difference: the error
 * names it; or fn failed). */
static int check_trace(gj_step *s, const gj_jit_step_call *call) {
    uint64_t seed, counter;
    gj_rng_get_state(&seed, &counter);
    int rc = -1;
    gj_tensor **px = proxies_new(call->n_in, call->in, false);
    if (!proxies_ok(call->n_in, px)) {
        proxies_free(call->n_in, px);
        return -1;
    }
    gj_jit_step_call pcall = *call;
    pcall.in = px;
    call = &pcall;
    gj_scope_push();
    if (s->o.eval) gj_no_grad_push();
    gj_ag_trace *tr = gj_ag_trace_begin(call->n_in, call->in, s->n, s->params);
    if (!tr) goto done;
    gj_clear_error();
    gj_dtype ac0 = gj_get_autocast();
    gj_set_autocast(s->o.autocast);
    gj_tensor *loss = s->fn(s->ctx, call->n_in, call->in);
    gj_set_autocast(ac0);
    gj_ag_trace_end(tr);
    if (!loss_ok(loss)) goto done;
    char diff[400];
    int c = gj_jit_cstep_check(s->jit, tr, loss, call, diff, sizeof diff);
    if (c == 1)
        gj_rt_set_error("gj_step_run: check mode (run %lld): %s; the program would replay the "
                        "old trace (name the C state that selects the graph with "
                        "gj_step_run_variant, or make the tensor inside the step function)",
                        (long long)s->compiled_runs, diff);
    rc = c == 0 ? 0 : -1;
done:
    if (tr) gj_ag_trace_free(tr);
    if (s->o.eval) gj_no_grad_pop();
    gj_scope_pop();
    proxies_free(call->n_in, px);
    gj_rng_set_state(seed, counter);
    return rc;
}

/* A parameter carrying a gj_ddp's hooks in a step not given that gj_ddp
 * would be updated with its own rank's gradient, the average coming after
 * the update: refused in both modes. 0, or -1 with the error. */
static int reducer_hooks_check(gj_step *s) {
    for (int k = 0; k < s->n; k++) {
        const gj_ag_hook *hs[16];
        int nh = gj_ag_leaf_hooks(s->params[k], hs, 16);
        for (int j = 0; j < nh && j < 16; j++)
            if (hs[j]->kind == GJ_AG_HOOK_POST_ACCUMULATE && gj_jit_reducer_owns_hook(hs[j]->handle)) {
                gj_rt_set_error("gj_step_run: parameter %d carries a gj_ddp's hooks, but the "
                                "step was made without it: its update would use this rank's "
                                "gradient before the average; give the gj_ddp to the step "
                                "(gj_step_opts.ddp)", k);
                return -1;
            }
    }
    return 0;
}

int gj_step_run(gj_step *s, int n_in, gj_tensor *const *in, gj_tensor **loss_out) {
    return gj_step_run_variant(s, 0, n_in, in, loss_out);
}

/* The first run of a program whose trace stopped after the forward: the
 * optimizer state a first update makes (zeros, as it would read them),
 * then the program runs the step (the caller has put the generator back
 * where the step started), its buffers taken from the blocks the traced
 * forward freed where their sizes allow; what it left of those goes back
 * to the system, so the cache then holds what every later run leaves.
 * gj_jit_cstep_run's result. */
static int run_after_trace(gj_step *s, gj_jit_step_call *call, gj_jit_opt *jo,
                           gj_tensor **loss) {
    uint64_t mark = gj_rt_alloc_cache_mark(); /* the forward's blocks are older */
    int r = -1;
    unsigned *need = gj_rt_calloc((size_t)s->n + 1, sizeof *need);
    if (!need) goto done;
    gj_jit_cstep_state_read(s->jit, s->n, need);
    int zs = gj_fe_optim_zero_state(s->opt, need);
    gj_rt_free(need);
    if (zs != 0) goto done;
    describe(s, jo); /* (the new state tensors) */
    call->after_trace = true;
    r = gj_jit_cstep_run(s->jit, call, loss, s->updated, s->o.keep_grads ? s->grads : NULL);
done:
    gj_rt_alloc_release_cache_before(mark);
    return r;
}

int gj_step_run_variant(gj_step *s, uint64_t variant, int n_in, gj_tensor *const *in,
                        gj_tensor **loss_out) {
    const char *op = "gj_step_run";
    if (loss_out) *loss_out = NULL;
    if (!s) {
        gj_rt_set_error("%s: step is NULL", op);
        return -1;
    }
    if (n_in < 0 || (n_in > 0 && !in)) {
        gj_rt_set_error("%s: %d inputs at %p", op, n_in, (const void *)in);
        return -1;
    }
    for (int k = 0; k < n_in; k++) {
        char arg[32];
        snprintf(arg, sizeof arg, "in[%d]", k);
        if (!gj_rt_check_tensor(in[k], op, arg)) return -1;
    }
    s->variant = variant;
    if (!s->red && !s->o.eval && reducer_hooks_check(s) != 0) return -1;
    if (gj_ag_trace_active()) { /* a step inside a step function being traced */
        gj_ag_trace_untraceable("the step function ran a step (gj_step_run), which a compiled "
                                "step cannot replay");
        return run_eager(s, n_in, in, loss_out, false);
    }
    if (s->o.eager) return run_eager(s, n_in, in, loss_out, false);
    if (gj_ag_anomaly()) {
        gj_jit_cstep_note_fallback(GJ_CA_INCOMPATIBLE_MODE,
                                  "anomaly mode checks every gradient of the eager engine", false);
        return run_eager(s, n_in, in, loss_out, false);
    }
    if (!s->o.eval && !gj_ag_grad_enabled()) { /* eager then reports no graph to differentiate */
        gj_jit_cstep_note_fallback(GJ_CA_INCOMPATIBLE_MODE, "a training step under no_grad", false);
        return run_eager(s, n_in, in, loss_out, false);
    }
    if (s->eager_only) {
        gj_jit_cstep_note_fallback(s->why_code, s->why, false);
        return run_eager(s, n_in, in, loss_out, false);
    }
    gj_jit_opt jo;
    describe(s, &jo);
    gj_jit_step_call call = {n_in, in, &jo, variant, s->o.keep_grads, s->o.eval,
                             s->o.check_every > 0, s->red, s->red_of, s->o.mem_budget, false};
    s->compiled_runs++;
    if (s->o.check_every > 0 && s->compiled_runs % s->o.check_every == 0 &&
        check_trace(s, &call) != 0)
        return -1;
    if (!s->o.eval) gj_optim_zero_grad(s->opt); /* as the eager step starts */
    uint64_t seed, counter;
    gj_rng_get_state(&seed, &counter);
    gj_tensor *loss = NULL;
    int r = gj_jit_cstep_run(s->jit, &call, &loss, s->updated, s->o.keep_grads ? s->grads : NULL);
    if (r == 1 && !s->o.eval) { /* a new variant: traced, then run by its program */
        bool stopped = false;
        int a = abstract_ok(s, n_in, in)
                    ? run_eager_as(s, n_in, in, loss_out, RUN_TRACE_ABSTRACT, &stopped)
                    : 2;
        if (a != 0) gj_rng_set_state(seed, counter); /* (what the abstract forward drew) */
        if (a < 0) return -1;
        if (a == 3) return run_eager(s, n_in, in, loss_out, false);
        if (a == 0) {
            gj_rng_set_state(seed, counter);
            r = run_after_trace(s, &call, &jo, &loss);
            /* Not selected: the abstract inputs hid an aliasing of the real
             * ones (with a constant of the function) that the guards see;
             * nothing ran. Traced again computing. */
            a = r == 1 ? 2 : 0;
            stopped = false;
        }
        if (a == 2) {
            gj_rng_set_state(seed, counter);
            if (run_eager_as(s, n_in, in, loss_out, RUN_TRACE_FORWARD, &stopped) != 0)
                return -1;
            if (!stopped) return 0; /* the traced step ran whole */
            gj_rng_set_state(seed, counter);
            r = run_after_trace(s, &call, &jo, &loss);
        }
        if (r == 1) {
            gj_rt_set_error("gj_step_run: internal: the program made by the trace was not "
                            "selected");
            r = -1;
        }
    }
    if (r < 0) return -1;
    if (r == 1) return run_eager(s, n_in, in, loss_out, true); /* trace (a new variant) */
    if (r == 3) { /* user code in the program tripped a guard: nothing updated */
        gj_ca_reason code;
        bool permanent;
        char why[320];
        gj_jit_cstep_last_trip(s->jit, &code, &permanent, why, sizeof why);
        if (permanent) make_eager(s, code, why, false);
        else gj_jit_cstep_note_fallback(code, why, false);
        gj_rng_set_state(seed, counter);
        return run_eager(s, n_in, in, loss_out, false);
    }
    if (r == 2) { /* a non-finite clip norm: eager leaves its .grads; the program left nothing */
        gj_rng_set_state(seed, counter);
        if (run_eager(s, n_in, in, loss_out, false) == 0) { /* (cannot: the same bits) */
            gj_rt_set_error("gj_step_run: internal: the eager step succeeded where its program "
                            "found a non-finite gradient norm");
        }
        return -1;
    }
    if (s->opt) gj_fe_optim_updated(s->opt, s->updated);
    if (!s->o.eval && !s->o.keep_grads) gj_optim_zero_grad(s->opt); /* (post hooks set some) */
    for (int k = 0; k < s->n && s->o.keep_grads; k++) {
        gj_ag_tensor_meta *m = gj_ag_meta_get(s->params[k], s->grads[k] != NULL);
        if (m) gj_ag_meta_set_grad(m, s->grads[k]); /* the slot takes the reference */
        else if (s->grads[k]) gj_rt_tensor_release(s->grads[k]);
        s->grads[k] = NULL;
    }
    int rc = loss_out ? ((*loss_out = gj_fe_own(loss)) ? 0 : -1) : 0;
    if (!loss_out) gj_rt_tensor_release(loss);
    return rc;
}
