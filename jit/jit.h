/* SPDX-License-Identifier: MIT */
/*
 * jit.h - the one narrow entry into the compiler. frontend/ (gj_backward,
 * gj_grad) calls it when the compiled-autograd flag is on; autograd/ and
 * runtime/ never call into jit/.
 */
#ifndef GJ_JIT_H
#define GJ_JIT_H

#include "jit/base/base.h"

/* Try to run this backward compiled. Sets *handled = true if it ran (the
 * return value is then the backward's status); false means "run eager"
 * (a fallback, already counted with its reason). */
int gj_jit_backward(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                    bool retain_graph, bool *handled);

/* gj_grad compiled: the gradients of roots (seeds: one per root, as
 * gj_jit_backward) with respect to inputs[0..n_inputs) (leaves or not; the
 * same twice is fine). *handled as for gj_jit_backward. When it ran and
 * succeeded, grads_out[i] is a new reference to input i's gradient, or
 * NULL when no gradient reaches it (gj_grad then applies allow_unused); an
 * input requested twice gets the same tensor with a reference per slot.
 * No .grad is read or written, no post-accumulate hook runs; without
 * retain_graph the nodes the engine's gj_grad would run are freed. The key
 * holds the inputs' edges and the gj_grad mode (capture.h). */
int gj_jit_grad(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds, int n_inputs,
                gj_tensor *const *inputs, gj_tensor **grads_out, bool retain_graph,
                bool *handled);

/* GRADJIT_LOG has the word "leaks" (parsed once with the others, ir.c):
 * frontend/tensor.c then reports live tensors and open scopes at exit. */
bool gj_jit_log_leaks(void);

/* Counters of gj_ca_stats (frontend/ adds `backwards`). */
void gj_jit_stats(gj_ca_stats *out);
/* The info of the program the calling thread's last compiled backward ran;
 * false if none. */
bool gj_jit_last_program_info(gj_ca_program_info *out);
void gj_jit_reset_stats(void);


/* Appended by helper "jit". The reason of this thread's last fallback
 * ("" if none since the last reset): a borrowed string. */
const char *gj_jit_last_fallback_reason(void);
/* Frees every cached program and eager-only mark, and the LLJIT itself
 * (recreated on demand). Must not run concurrently with a backward. */
void gj_jit_clear_cache(void);
/* quiet = true: no stderr line for a graph that falls back for good (the
 * default prints one line per such key; GRADJIT_LOG=fallback prints all). */
void gj_jit_set_quiet(bool quiet);
/* The on-disk cache directory (overrides GRADJIT_CACHE_DIR); NULL or ""
 * turns the disk cache off. Not thread-safe against running backwards. */
void gj_jit_set_disk_cache(const char *dir);
/* Back to the runtime's cache directory (GRADJIT_CACHE_DIR's rules). */
void gj_jit_default_disk_cache(void);

/* Appended by helper "jit2". */

/* The message of this thread's last fallback, "<reason name>: <detail>"
 * (same string as gj_jit_last_fallback_reason). */
const char *gj_jit_last_fallback(void);
/* The canonical key text of the backward of roots with seeds (entries may
 * be NULL: ones), as the compiled path computes it: identical in every
 * process that builds the same model. Returns a gj_rt_malloc'd string
 * (free with gj_rt_free) or NULL with the error set. */
char *gj_jit_key_string(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds);
/* Counts a backward that frontend/ runs eagerly, although the flag is on,
 * for a reason decided outside jit/ (anomaly mode: GJ_CA_INCOMPATIBLE_MODE):
 * the fallback counters, gj_compiled_autograd_last_fallback() and, under
 * GRADJIT_LOG=fallback, a stderr line. detail may be NULL. */
void gj_jit_note_fallback(gj_ca_reason reason, const char *detail);

/* The event log of this thread's last compiled run with post-accumulate
 * hooks: out[i] = how many of the program's steps had run when its i-th
 * post-accumulate hook call was made (*n_instrs: the program's step count;
 * a hook called mid-program, see GJ_HOOK_NO_GRAPH_WRITES, has a smaller
 * number). Returns the number of calls (up to cap written). For tests. */
#define GJ_JIT_MAX_POST_LOG 256
int gj_jit_last_post_hook_instrs(int *out, int cap, int *n_instrs);

/* Cross-process agreement (dist/ registers it while a gj_ddp lives): while
 * fn is set, the first use of each key under this registration (a compile,
 * disk load or memory hit of a key not yet agreed) calls fn(ctx, hash),
 * which compares the key's hash with the other processes' and returns 0,
 * or -1 with an error naming the ranks: the backward then fails with it.
 * Called on the backward's thread with the compiled cache locked. fn NULL
 * removes it. */
typedef int (*gj_jit_agree_fn)(void *ctx, const uint64_t hash[2]);
void gj_jit_set_agreement(gj_jit_agree_fn fn, void *ctx);

/* The memory cache's size limit (base.h: gj_jit_mem_limit); setting a
 * lower one evicts at once (cache/cache.c). */
void gj_jit_set_mem_limit(int64_t bytes);

/* ------------------------------------------- the compiled training step */
/* A training step (frontend gj_step) compiled whole: its forward (a trace
 * of the step function, autograd/trace.c), backward and optimizer update
 * as one program (jit/step/variants.c). */

/* The optimizer of a step as the compiler sees it (the frontend's
 * gj_optim, flattened): its rule (written once, autograd/optim_*.c) and
 * the structure bits of its configuration (the key and the guards), its
 * parameters and their state tensors (borrowed), and this run's run-time
 * scalars: per parameter GJ_AG_OPT_MAX_HYPER slots (the rule's n_hyper
 * first), then the clip norm. */
typedef struct gj_jit_opt {
    const gj_ag_optdef *def;
    uint32_t structure;
    int n;
    gj_tensor *const *params;
    gj_tensor *const *s1; /* per parameter or NULL: the rule's state 0 (SGD momentum, exp_avg) */
    gj_tensor *const *s2; /* state 1 (AdamW exp_avg_sq) */
    double clip;         /* > 0: the gradients' total norm is clipped to it first */
    const double *hyper; /* [n * GJ_AG_OPT_MAX_HYPER + 1]: the last one the clip norm */
} gj_jit_opt;

typedef struct gj_jit_cstep gj_jit_cstep; /* the compiled variants of one gj_step */
gj_jit_cstep *gj_jit_cstep_new(void);
void gj_jit_cstep_free(gj_jit_cstep *s);

/* One run of a step as the compiler sees it: the step inputs (borrowed),
 * the optimizer, the caller's variant key (gj_step_run_variant: C state
 * that selects the graph, part of the key and of the guards), the options,
 * and whether variants keep their trace's text for checks (check mode). */
/* A gradient reducer between a step's backward and its update (dist/'s
 * gj_ddp is one: it registers itself while it lives). The step gives it
 * every parameter's gradient once that gradient is final, in the reducer's
 * order, and takes each reduced gradient back before that parameter's
 * update; a compiled step does both as call instructions of its program
 * (the reducer's collectives then run while the backward goes on). */
typedef struct gj_jit_reducer {
    void *ctx;
    int n;                     /* parameters it reduces */
    gj_tensor *const *params;  /* [n], borrowed */
    const int *order;          /* [n]: the order it takes gradients (order[k]: an index) */
    const int64_t *hooks;      /* [n]: the hook each parameter carries for it (the step's
                                  own calls replace it), 0 if none */
    uint64_t layout;           /* a hash of its buckets and wire dtypes (in a program's key) */
    /* Takes parameter i's final gradient (contiguous, dtype dt; NULL: no
     * gradient this step, zeros), and starts what is complete. 0 or -1. */
    int (*give)(void *ctx, int i, gj_dtype dt, const void *grad);
    /* Waits for parameter i's reduced gradient and writes it to out
     * (contiguous, dt). 0 or -1. */
    int (*take)(void *ctx, int i, gj_dtype dt, void *out);
    /* The eager step's reduction: every parameter's .grad (or zeros)
     * reduced into its .grad. 0 or -1. */
    int (*wait)(void *ctx);
    /* After a compiled run, whatever its result: nothing left in flight,
     * ready for the next step. 0, or -1 if something in flight failed. */
    int (*end)(void *ctx);
    /* Whether every rank has the same values v[0..n) (a collective: every
     * rank calls it in the same order). 0, or -1 with an error naming
     * `what`, `detail` and each rank's values. */
    int (*agree)(void *ctx, const int64_t *v, int n, const char *what, const char *detail);
    /* ZeRO (stage 1, 2 or 3; 0: off): the optimizer updates shards[i] (this
     * rank's part of parameter i, NULL if none), whose .grad wait() leaves
     * the average in; after() then gathers every rank's updated parts. */
    int zero;
    gj_tensor *const *shards;
    int (*after)(void *ctx);
} gj_jit_reducer;

/* The event log of this thread's last compiled step run with a reducer:
 * out[k] = the program instruction at which the k-th give ran, *n_instrs
 * the program's instruction count, *last_gemm the last GEMM instruction
 * (-1: none). Returns the number of gives (up to cap written). For tests:
 * a give before the last GEMM started its bucket while the backward still
 * computed. */
int gj_jit_last_reducer_gives(int *out, int cap, int *n_instrs, int *last_gemm);

/* The reducers' registry: dist/ registers each reducer under its owner
 * (the gj_ddp) while it lives; the frontend finds the reducer of the
 * owner a step was given (NULL: not registered). Thread-safe. */
int gj_jit_reducer_register(const void *owner, const gj_jit_reducer *r);
void gj_jit_reducer_unregister(const void *owner);
const gj_jit_reducer *gj_jit_reducer_find(const void *owner);
/* Whether hook `handle` is one a registered reducer's calls replace. */
bool gj_jit_reducer_owns_hook(int64_t handle);

typedef struct gj_jit_step_call {
    int n_in;
    gj_tensor *const *in;
    const gj_jit_opt *opt;
    uint64_t variant;
    bool keep_grads, eval, keep_text;
    const gj_jit_reducer *red; /* NULL, or the reducer between backward and update */
    const int *red_of;         /* with red: per parameter of opt, its index in red or -1 */
    size_t mem_budget;         /* > 0: the most temporary bytes the program may hold at once
                                  (plan/remat.c); 0: none */
    bool after_trace;          /* the run of a step whose trace counted it already */
} gj_jit_step_call;

/* After the traced (eager) forward of a step, before its backward: makes
 * (finds, loads or compiles) the program of this trace and keeps it as a
 * variant of s, guarded by the inputs', parameters', state's and
 * constants' metas, their aliasing, the gradient state of inputs and
 * constants (no grad, a leaf that requires grad) and hooks on every leaf
 * the program writes, and the variant key. loss: the function's result
 * (its graph alive). 0 (a variant), 1 (no program: *code and why[] say
 * why; counted as a fallback), -1 (error set). */
int gj_jit_cstep_prepare(gj_jit_cstep *s, const gj_ag_trace *tr, gj_tensor *loss,
                         const gj_jit_step_call *call, gj_ca_reason *code, char *why,
                         size_t why_cap);

/* Runs the variant of s whose guards hold for this call (the generator
 * draws the step's dropout masks as eager would). Before the program
 * starts, the values the eager forward checks (class labels, embedding
 * indices) are checked with the eager op's message. Returns 0 (ran:
 * *loss_out a new 0-d tensor, parameters and state updated in place,
 * updated[p] set for every parameter updated, grads_out[p] a new reference
 * to its gradient when the variant keeps them, else NULL; the gradients of
 * leaves outside the optimizer accumulated into their .grad as the eager
 * backward does), 1 (no variant matches: trace the step again; nothing
 * changed), 2 (a clipping step whose norm was not finite: nothing changed,
 * error set; the caller runs the step eagerly to leave eager's .grads), 3
 * (user code in the program tripped a guard before any update:
 * gj_jit_cstep_last_trip says why; the caller runs the step eagerly from
 * the same generator position) or -1 (error set; nothing updated when a
 * check failed). */
int gj_jit_cstep_run(gj_jit_cstep *s, const gj_jit_step_call *call, gj_tensor **loss_out,
                     bool *updated, gj_tensor **grads_out);

/* Why the last gj_jit_cstep_run that returned 3 stopped: user code in its
 * program (a hook) failed (transient) or did what a program cannot follow
 * (record_stream, set_ on a tensor of the step, a .grad removed or of
 * another shape: permanent, the step should run eagerly from then on). */
/* The optimizer state the newest variant's program reads: bit i of
 * state[k] for state tensor i of parameter k (n_params entries). A step
 * whose trace ran only the forward makes it (zeros) before the program's
 * first run. */
void gj_jit_cstep_state_read(const gj_jit_cstep *s, int n_params, unsigned *state);
/* Whether the newest variant's program runs no user code (hooks, custom
 * ops' calls) and no reducer: the program alone can run the step whose
 * trace made it, with nothing of the eager backward to check. */
bool gj_jit_cstep_newest_plain(const gj_jit_cstep *s);
void gj_jit_cstep_last_trip(const gj_jit_cstep *s, gj_ca_reason *code, bool *permanent,
                            char *why, size_t cap);

/* Check mode: whether the trace tr of the step function, made again on
 * this call's inputs, is the trace the variant this call selects was made
 * from (ops, attributes, shapes, the constants it captured and their
 * values, nothing read). 0 (the same, or no variant matches), 1 (it
 * differs: diff[] names the first difference), -1 (error set). */
int gj_jit_cstep_check(gj_jit_cstep *s, const gj_ag_trace *tr, gj_tensor *loss,
                       const gj_jit_step_call *call, char *diff, size_t diff_cap);

/* How many variants s holds, and the bytes of their programs: at most the
 * memory cache's limit (gj_jit_mem_limit) beyond the most recent one. */
int gj_jit_cstep_variants(const gj_jit_cstep *s, int64_t *bytes);

/* The memory of the program of s's last prepared or run variant. */
typedef struct gj_jit_step_mem {
    int64_t peak_bytes;      /* its plan's peak of temporaries */
    int64_t saved_bytes;     /* forward values its backward reads */
    double recompute_flops;  /* FLOPs its backward spends computing forward values again */
    int64_t recomputed;      /* values recomputed */
    int64_t budget_bytes;    /* the budget it was planned under (0: none) */
} gj_jit_step_mem;
/* 0, or 1 when s has no compiled variant yet (nothing written). */
int gj_jit_cstep_memory(const gj_jit_cstep *s, gj_jit_step_mem *out);

/* The compiled step's counters (`backwards`: steps run) and their reset;
 * a fallback decided outside jit/ (an untraceable function, anomaly mode)
 * is counted with gj_jit_cstep_note_fallback. */
void gj_jit_cstep_stats(gj_ca_stats *out);
void gj_jit_cstep_reset_stats(void);
/* Milliseconds spent making programs for new keys (capture, plan, binding,
 * loading from disk or compiling), compiled autograd and compiled steps,
 * since the process started (no reset). */
double gj_jit_making_ms(void);
void gj_jit_cstep_note_fallback(gj_ca_reason reason, const char *detail, bool first);
/* A step that ran (and was counted) turns eager from its next run for
 * reason: the last fallback's message and its one print, no count. */
void gj_jit_cstep_note_eager(gj_ca_reason reason, const char *detail);

#endif /* GJ_JIT_H */
