/* SPDX-License-Identifier: MIT */
/*
 * step.c - gj_step: a training step (forward, backward, update) run eagerly
 * or compiled whole (gradjit.h, "the compiled training step"). The eager
 * step is the reference; the compiled one traces it (autograd/trace.c) and
 * runs the program jit/step.c made from the trace.
 *
 * Invariants:
 *   - A run is the eager step -- zero_grad, fn, backward, optimizer step,
 *     zero_grad again unless keep_grads -- or the program of a variant
 *     whose guards hold, with the same results: loss, parameters,
 *     optimizer state (AdamW's step counts advanced here for the parameters
 *     the program updated) and, with keep_grads, .grads.
 *   - A run with no variant for its inputs traces: it runs the eager step
 *     with the trace recording fn's ops, and between fn and the backward
 *     (the graph alive, nothing updated yet) has the compiler make the
 *     program. If fn did what a replay cannot redo, the step is eager from
 *     then on (the reason counted once here, printed once).
 *   - Anomaly mode runs the step eagerly (counted, GJ_CA_INCOMPATIBLE_MODE).
 */
#include "fe.h"
#include "../jit/jit.h"

#include <math.h>
#include <stdio.h>
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
    double *hyper;           /* [n * GJ_JIT_HYPER] */
    bool *updated;
    gj_tensor **grads;
    bool eager_only;         /* fn cannot be traced: every run is eager */
    char why[320];
};

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
    s->hyper = gj_rt_calloc(n1 * GJ_JIT_HYPER + 1, sizeof *s->hyper);
    s->updated = gj_rt_calloc(n1, sizeof *s->updated);
    s->grads = gj_rt_calloc(n1, sizeof *s->grads);
    s->jit = gj_jit_cstep_new();
    if (!s->params || !s->s1 || !s->s2 || !s->hyper || !s->updated || !s->grads || !s->jit) {
        gj_step_free(s);
        return NULL;
    }
    for (int k = 0; k < s->n; k++) s->params[k] = gj_fe_optim_param(opt, k);
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
    gj_rt_free(s);
}

void gj_step_stats(gj_ca_stats *out) {
    if (!out) return;
    gj_jit_cstep_stats(out);
}

void gj_step_reset_stats(void) { gj_jit_cstep_reset_stats(); }

/* The optimizer as the compiler sees it for this run. */
static void describe(gj_step *s, gj_jit_opt *jo) {
    memset(jo, 0, sizeof *jo);
    if (s->opt) gj_fe_optim_describe(s->opt, jo, s->s1, s->s2, s->hyper);
    jo->n = s->n;
    jo->clip = s->o.eval ? 0.0 : s->o.clip_norm;
    s->hyper[(size_t)s->n * GJ_JIT_HYPER] = jo->clip; /* the run-time value */
    jo->params = s->params;
    jo->s1 = s->s1;
    jo->s2 = s->s2;
    jo->hyper = s->hyper;
}

/* Checks fn's result: a 0-d float tensor. */
static bool loss_ok(const gj_tensor *loss) {
    if (!loss) return false;
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

/* The eager step; with trace, the trace records fn and the compiler makes
 * the program before the backward. The loss goes to the scope open when
 * the run started (a detached alias: no history). */
static int run_eager(gj_step *s, int n_in, gj_tensor *const *in, gj_tensor **loss_out,
                     bool trace) {
    int rc = -1;
    gj_ag_trace *tr = NULL;
    gj_tensor *keep = NULL;
    if (!s->o.eval) gj_optim_zero_grad(s->opt);
    uint64_t rs0 = gj_rt_record_stream_calls();
    gj_scope_push();
    if (s->o.eval) gj_no_grad_push();
    if (trace && !(tr = gj_ag_trace_begin(n_in, in, s->n, s->params))) goto done;
    gj_tensor *loss = s->fn(s->ctx, n_in, in);
    if (tr) gj_ag_trace_end(tr);
    if (!loss_ok(loss)) goto done;
    if (tr) {
        const char *why = tr->untraceable;
        if (!why[0] && tr->failed) why = "out of memory while tracing";
        if (!why[0] && gj_rt_record_stream_calls() != rs0)
            why = "the step function called gj_tensor_record_stream, which a compiled step "
                  "cannot replay";
        if (why[0]) { /* eager from now on */
            s->eager_only = true;
            snprintf(s->why, sizeof s->why, "%s", why);
            gj_jit_cstep_note_fallback(GJ_CA_UNTRACEABLE, why, true);
        } else {
            gj_jit_opt jo;
            describe(s, &jo);
            gj_ca_reason code;
            char jwhy[300];
            if (gj_jit_cstep_prepare(s->jit, tr, loss, &jo, s->o.keep_grads, s->o.eval, &code, jwhy,
                                    sizeof jwhy) < 0)
                goto done;
        }
    }
    if (!s->o.eval) {
        if (gj_backward(loss, NULL) != 0) goto done;
        if (s->o.clip_norm > 0 && gj_clip_grad_norm(s->n, s->params, s->o.clip_norm, NULL) != 0)
            goto done;
        if (gj_optim_step(s->opt) != 0) goto done;
        if (!s->o.keep_grads) gj_optim_zero_grad(s->opt);
    }
    if (loss_out && !(keep = gj_rt_tensor_alias(loss))) goto done;
    rc = 0;
done:
    if (tr) gj_ag_trace_free(tr);
    if (s->o.eval) gj_no_grad_pop();
    gj_scope_pop();
    if (rc == 0 && loss_out && !(*loss_out = gj_fe_own(keep))) rc = -1;
    return rc;
}

int gj_step_run(gj_step *s, int n_in, gj_tensor *const *in, gj_tensor **loss_out) {
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
    if (gj_ag_trace_active()) {
        gj_rt_set_error("%s: called from a step function being traced (steps do not nest)", op);
        return -1;
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
        gj_jit_cstep_note_fallback(GJ_CA_UNTRACEABLE, s->why, false);
        return run_eager(s, n_in, in, loss_out, false);
    }
    gj_jit_opt jo;
    describe(s, &jo);
    gj_tensor *loss = NULL;
    int r = gj_jit_cstep_run(s->jit, n_in, in, &jo, &loss, s->updated,
                            s->o.keep_grads ? s->grads : NULL);
    if (r < 0) return -1;
    if (r == 1) return run_eager(s, n_in, in, loss_out, true); /* trace (a new variant) */
    if (s->opt) gj_fe_optim_updated(s->opt, s->updated);
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
