/* SPDX-License-Identifier: MIT */
/*
 * fe.h - internal helpers shared by the frontend files (not installed).
 */
#ifndef GJ_FE_H
#define GJ_FE_H

#include "../autograd/ag.h"

/* Hands a new reference t to the innermost open scope (if any) and returns
 * t; NULL passes through. Every public function returning a tensor ends
 * with it or with gj_fe_fail: it also tells the error state (runtime/
 * error.c) that a tensor was handed out (t), or that the current error is
 * the cause of the NULL handed out (NULL, or t could not be registered). */
gj_tensor *gj_fe_own(gj_tensor *t);

/* The NULL a public function returning a tensor ends with when it fails,
 * after its last gj_rt_set_error: the message becomes the cause a NULL
 * argument cites when that NULL is passed on (gj_rt_check_tensor). */
static inline gj_tensor *gj_fe_fail(void) {
    gj_rt_null_result();
    return NULL;
}

/* Tell the step being traced on this thread, if any, that the function
 * read values of t, or did something a replay cannot reproduce
 * (autograd/trace.c). */
#define GJ_FE_TRACE_READ(t, what, writable)                                                    \
    do {                                                                                       \
        if (gj_ag_trace_active()) gj_ag_trace_note_read((t), (what), (writable));              \
    } while (0)
#define GJ_FE_TRACE_UNTRACEABLE(what)                                                          \
    do {                                                                                       \
        if (gj_ag_trace_active())                                                              \
            gj_ag_trace_untraceable("the step function called %s, which a compiled step "      \
                                    "cannot replay",                                           \
                                    (what));                                                   \
    } while (0)
/* Hooks the step function registers during an abstract first trace
 * (step.c; gj_rt_abstract) are noted and removed by this when that trace
 * ends: the function runs again (traced computing, or eagerly) and
 * registers them again. */
void gj_fe_abstract_hooks_undo(void);
#define GJ_FE_TRACE_CREATED(t, deterministic, what)                                            \
    do {                                                                                       \
        if ((t) && gj_ag_trace_active()) gj_ag_trace_note_created((t), (deterministic), (what)); \
    } while (0)

/* The optimizer as the compiled step sees it (optim.c): its parameter
 * count and k-th parameter (borrowed); its description for the compiler
 * (out's kind, n and structure; s1[k], s2[k] its state tensors, borrowed,
 * NULL before its first update; hyper[k * GJ_JIT_HYPER ..] the scalars of
 * parameter k's next update, as gj_optim_step would compute them); and the
 * bookkeeping of a compiled update (AdamW: the step count of every
 * parameter updated). */
struct gj_jit_opt;
int gj_fe_optim_n(const gj_optim *o);
gj_tensor *gj_fe_optim_param(const gj_optim *o, int k);
void gj_fe_optim_describe(const gj_optim *o, struct gj_jit_opt *out, gj_tensor **s1,
                          gj_tensor **s2, double *hyper);
void gj_fe_optim_updated(gj_optim *o, const bool *updated);
/* Makes the state tensors named by state[k] (bit i: state tensor i of
 * parameter k) that do not exist yet, zero-filled. 0 or -1 (OOM). */
int gj_fe_optim_zero_state(gj_optim *o, const unsigned *state);

/* ---- settings (settings.c): the front end's GRADJIT_* variables */

/* The compiled-autograd flag as seen by gj_backward/gj_grad (reads
 * GRADJIT_COMPILED_AUTOGRAD once); gj_fe_set_compiled sets it and wins
 * over the variable (gj_set_compiled_autograd). */
bool gj_fe_compiled_enabled(void);
void gj_fe_set_compiled(bool on);
/* GRADJIT_STEP_CHECK=N, read now: N (>= 1), or 0 when unset or not a
 * count (then reported on stderr). */
int gj_fe_step_check_env(void);
/* GRADJIT_STEP_MEM_BUDGET_MB=N (N >= 1 MiB): the step's memory budget in
 * bytes; 0 when unset or empty, or (with a warning) when it does not parse. */
size_t gj_fe_step_budget_env(void);
/* GRADJIT_STEP_TRACE=computing: true (a step's first trace computes its
 * forward); abstract, empty or unset: false; anything else false with a
 * warning on stderr. */
bool gj_fe_step_trace_computing_env(void);

/* Counts a backward in gj_ca_stats (compiled_autograd.c). */
void gj_fe_count_backward(void);

/* Registers the frontend's scopes with autograd, for user code the engine
 * calls (gj_ag_set_user_scope; idempotent). */
void gj_fe_use_scopes(void);

/* The metadata value of key as a plain decimal u64 ("0" to
 * "18446744073709551615", no sign or spaces): 0, or -1 (no error set) if
 * absent or malformed. (safetensors.c) */
int gj_fe_meta_u64(const gj_state_dict *sd, const char *key, uint64_t *out);

/* A list of problems for one error message that reports them all
 * ("3 mismatches, nothing changed: a; b; c"), truncated with "and N more"
 * only if it would overflow the error buffer. */
typedef struct gj_fe_msg {
    char buf[3200];
    size_t pos;
    int count, dropped;
} gj_fe_msg;
void gj_fe_msg_add(gj_fe_msg *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Sets the error "<op>: <count> <one|many>, nothing changed: ..."; returns -1. */
int gj_fe_msg_fail(const gj_fe_msg *m, const char *op, const char *one, const char *many);

#endif /* GJ_FE_H */
