/* SPDX-License-Identifier: MIT */
/*
 * trainer.h - the scaffolding the example trainers share, so that each
 * trainer's file holds its model, its data and its flags (header-only, all
 * static inline; not part of the library). On top of common.h's stepper:
 *
 *   flags        the flags every trainer takes (train_flags), the rows of
 *                args.h's table for those whose row is the same everywhere,
 *                their checks, the step mode they select, the SIGINT
 *                flag's handler, the first words of the run's first line
 *   the run      one training run (train_run): epochs of batches, each step
 *                through the stepper, timed, its loss recorded, a progress
 *                line; the trainer supplies its model, batches and reports
 *                as hooks (train_def). train_run_one runs one mode (with
 *                --save, --resume, --stop-after); train_run_both runs eager
 *                and compiled from the same seed in ABBA order and gives
 *                each epoch's paired ratio with its interquartile range
 *   stopping     the step boundary where a run stops and what it prints
 *   checkpoints  the parts every checkpoint holds (optimizer, RNG, format
 *                and program, the precision, --lr and threads it was
 *                trained with, checked on --resume), arrays, and reading
 *                metadata back with a message naming the key, the value
 *                and what was expected
 *   output       the loss curves as CSV, the compiled mode's counters, the
 *                loss curves compared, the "wrote" line
 *
 * Ownership: a train_run and all it holds (optimizer, stepper, loss curve,
 * the trainer's part) belong to whoever train_run_new / train_run_one /
 * train_run_both gave it to, and go with train_run_free. A train_def and
 * the options and data it points to are the trainer's and must outlive its
 * runs. Every function that fails prints why on stderr, naming the program.
 */
#ifndef GJ_EXAMPLES_TRAINER_H
#define GJ_EXAMPLES_TRAINER_H

#include "gradjit.h"
#include "args.h"
#include "common.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- flags */

/* The flags the trainers have in common (each trainer embeds one in its
 * options and lists the flags it takes in its own args.h table). */
typedef struct train_flags {
    bool compiled, compiled_step, both, quiet;
    bool bf16;                 /* mixed precision (gj_set_autocast(GJ_BF16)) */
    bool tty;                  /* stdout is a terminal (set by main, not a flag) */
    int epochs, batch, threads;
    double lr;
    uint64_t seed;
    const char *csv, *png;     /* NULL: not written */
    const char *save, *resume; /* checkpoints; NULL: none */
    int64_t stop_after;        /* stop (and save) after this many steps; 0: never */
} train_flags;

/* Rows of args.h's table for the common flags that read the same in every
 * trainer (each trainer's table lists the flags it takes, in its order):
 * f is the trainer's train_flags. TRAIN_ARG_COMPILED is two rows. */
#define TRAIN_ARG_COMPILED(f)                                                                  \
    ARG_OPT("compiled-autograd", ARG_FLAG, &(f)->compiled, 0, 0, "run the backward compiled"), \
    ARG_OPT("compiled-step", ARG_FLAG, &(f)->compiled_step, 0, 0,                              \
            "run the whole step (forward, backward, AdamW update) as one compiled program")
#define TRAIN_ARG_BF16(f)                                                                      \
    ARG_OPT("bf16", ARG_FLAG, &(f)->bf16, 0, 0,                                                \
            "mixed precision: GEMMs and activations in bf16; f32 parameters, AdamW state, "   \
            "softmax, layer norm and loss")
#define TRAIN_ARG_LR(f) ARG_OPT("lr", ARG_DOUBLE, &(f)->lr, 0, 1e6, "AdamW learning rate")
#define TRAIN_ARG_THREADS(f)                                                                   \
    ARG_OPT("threads", ARG_INT, &(f)->threads, 0, 4096, "gradjit threads (0: every CPU)")
#define TRAIN_ARG_QUIET(f) ARG_OPT("quiet", ARG_FLAG, &(f)->quiet, 0, 0, "no per-step progress")
#define TRAIN_ARG_CSV(f)                                                                       \
    ARG_OPT("csv", ARG_FILE, &(f)->csv, 0, 0, "loss curve as CSV (\"-\": none)")
#define TRAIN_ARG_SAVE(f)                                                                      \
    ARG_OPT("save", ARG_FILE, &(f)->save, 0, 0,                                                \
            "safetensors checkpoint at the end, on Ctrl-C and at --stop-after")
#define TRAIN_ARG_STOP_AFTER(f)                                                                \
    ARG_OPT("stop-after", ARG_I64, &(f)->stop_after, 1, 9e18, "stop (and save) after N steps")
/* --zero N (an int the trainer keeps beside its --ddp flag) */
#define TRAIN_ARG_ZERO(z)                                                                      \
    ARG_OPT("zero", ARG_INT, (z), 0, 3,                                                        \
            "with --ddp: ZeRO stage 1 (AdamW state sharded over the ranks), 2 (also the "      \
            "averaged gradients) or 3 (also the parameters, gathered per bucket); 0: off")

/* --zero needs --ddp. 0, or -1 after a message. */
static inline int train_zero_check(const char *prog, bool ddp, int zero) {
    if (zero && !ddp) {
        fprintf(stderr, "%s: --zero shards over the ranks of --ddp; give --ddp\n", prog);
        return -1;
    }
    return 0;
}

/* The name of a mode in the trainers' output ("[eager] ...", the column of
 * a --both table). A static string. */
static inline const char *mode_tag(step_mode m) {
    return m == STEP_COMPILED ? "compiled step" : m == STEP_SPLIT_CA ? "compiled" : "eager";
}

/* The compiled modes' flags are one at a time, and --both picks its
 * compiled side itself. 0, or -1 after a message starting with prog. */
static inline int train_flags_check(const char *prog, const train_flags *f) {
    if (f->compiled && f->compiled_step) {
        fprintf(stderr, "%s: --compiled-autograd and --compiled-step are two compiled modes; "
                        "give one\n", prog);
        return -1;
    }
    if (f->both && f->compiled) {
        fprintf(stderr, "%s: --both already runs compiled autograd (--both --compiled-step: "
                        "the compiled step)\n", prog);
        return -1;
    }
    return 0;
}

/* --save, --resume and --stop-after are one run's, not --both's. 0, or -1
 * after a message starting with prog. */
static inline int train_flags_check_one_run(const char *prog, const train_flags *f) {
    if (f->both && (f->save || f->resume || f->stop_after)) {
        fprintf(stderr, "%s: --save, --resume and --stop-after are for one run, not --both\n",
                prog);
        return -1;
    }
    return 0;
}

/* The mode of a single run: compiled autograd (split: forward, backward,
 * update apart) with --compiled-autograd, gj_step compiled with
 * --compiled-step, else gj_step eagerly. GRADJIT_COMPILED_AUTOGRAD=1
 * selects compiled autograd like the flag when no other mode is given (not
 * with --both); it is read here, so call this before the program sets the
 * flag itself, and it is recorded in f->compiled. */
static inline step_mode train_mode(train_flags *f) {
    if (!f->both && !f->compiled && !f->compiled_step && gj_compiled_autograd_enabled())
        f->compiled = true;
    if (f->bf16) /* this thread's ops, and every step made on it (stepper_init) */
        gj_set_autocast(GJ_BF16);
    return f->compiled ? STEP_SPLIT_CA : f->compiled_step ? STEP_COMPILED : STEP_EAGER;
}

/* Sets gradjit's threads (--threads) and, unless --quiet, begins the
 * run's first line with "gradjit <version>, <n> threads, BLAS <core> | ":
 * the trainer ends it with its data and model when this returns true. */
static inline bool train_banner(const train_flags *f) {
    gj_set_num_threads(f->threads);
    gj_info info;
    gj_get_info(&info);
    if (f->quiet)
        return false;
    printf("gradjit %s, %d threads, BLAS %s%s | ", info.version, info.num_threads,
           info.blas_core ? info.blas_core : "?",
           gj_get_autocast() == GJ_BF16 ? ", bf16 mixed precision" : "");
    return true;
}

/* --ddp: each rank's model-state bytes on rank 0's stdout (a collective:
 * every rank calls it): parameters, the gradient buckets (the parameters'
 * size), the .grads the optimizer reads after the reduction and AdamW's m
 * and v (with ZeRO, zero > 0: this rank's shards' only; stage 3 also holds
 * only its shards of the parameters, and its buckets only while a step
 * reduces them). params[0..n) are the model's, opt_params[0..n_opt) the
 * optimizer's; f32 bytes counted from their elements. 0, or -1 with
 * gj_last_error(). */
static inline int train_print_model_state(gj_pg *pg, int zero, int n,
                                          gj_tensor *const *params, int n_opt,
                                          gj_tensor *const *opt_params) {
    int64_t full = 0, mine = 0;
    for (int i = 0; i < n; i++) full += gj_tensor_numel(params[i]);
    for (int i = 0; i < n_opt; i++) mine += gj_tensor_numel(opt_params[i]);
    gj_tensor *t = gj_full(GJ_F64, 1, (int64_t[]){1}, (double)mine);
    gj_tensor *all = t ? gj_allgather(pg, t) : NULL;
    gj_release(t);
    if (!all)
        return -1;
    for (int r = 0; r < gj_pg_size(pg) && gj_pg_rank(pg) == 0; r++) {
        double m = gj_tensor_item_at(all, r), mib = 4.0 / 1048576.0;
        double g = zero ? m : (double)full, p = zero == 3 ? m : (double)full;
        double b = zero == 3 ? 0.0 : (double)full;
        printf("rank %d model state: parameters %.2f MiB (%s), gradient buckets %.2f MiB%s, "
               "averaged .grads %.2f MiB, AdamW m and v %.2f MiB (%s): %.2f MiB\n", r, p * mib,
               zero == 3 ? "its shard" : "all", b * mib,
               zero == 3 ? " at rest" : "", g * mib, 2 * m * mib, zero ? "its shard" : "all",
               (p + b + g + 2 * m) * mib);
    }
    gj_release(all);
    return 0;
}

/* --ddp: the process group mpirun started, with this process's rank and
 * the group's size; on ranks other than 0 stdout goes to /dev/null (rank 0
 * reports, the others only train). 0, or 1 after a message (nothing left
 * open). */
static inline int train_ddp_start(const char *prog, gj_pg **pg, int *rank, int *size) {
    if (!(*pg = gj_pg_init())) {
        fprintf(stderr, "%s --ddp: %s\n", prog, gj_last_error());
        return 1;
    }
    *rank = gj_pg_rank(*pg);
    *size = gj_pg_size(*pg);
    if (*rank != 0 && !freopen("/dev/null", "w", stdout)) {
        gj_pg_free(*pg);
        *pg = NULL;
        return 1;
    }
    return 0;
}

/* The start of a trainer's main, after parse_opts (whose result prc is):
 * the program's exit status when parse_opts printed --help or --version
 * (0) or refused the command line (2); else -1, with f->tty set and *mode
 * the single run's mode (train_mode). */
static inline int train_start(int prc, train_flags *f, step_mode *mode) {
    if (prc != 0)
        return prc > 0 ? 0 : 2;
    f->tty = isatty(STDOUT_FILENO) != 0;
    *mode = train_mode(f);
    return -1;
}

/* From now on Ctrl-C sets g_interrupted (common.h): the run finishes its
 * step, saves (--save) and exits 130. A second Ctrl-C kills at once. */
static inline void catch_sigint(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

/* ----------------------------------------------------- the mode's counters */

/* Zeroes the counters of compiled autograd and of the compiled step (a
 * run's start). */
static inline void counters_reset(void) {
    gj_compiled_autograd_reset_stats();
    gj_step_reset_stats();
}

/* The counters of compiled autograd (*ca) and of the compiled step (*cs)
 * since counters_reset. */
static inline void counters_read(gj_ca_stats *ca, gj_ca_stats *cs) {
    gj_compiled_autograd_stats(ca);
    gj_step_stats(cs);
}

/* The counters of mode m's compiled path, tagged with its name: print_ca
 * of *ca for compiled autograd, print_step of *cs for the compiled step;
 * nothing for the eager modes. */
static inline void print_counters(step_mode m, const gj_ca_stats *ca, const gj_ca_stats *cs) {
    if (m == STEP_SPLIT_CA)
        print_ca(mode_tag(m), ca);
    else if (m == STEP_COMPILED)
        print_step(mode_tag(m), cs);
}

/* --------------------------------------------------------------- stopping */

/* Whether a run stops at this step boundary: Ctrl-C, or `done` steps of
 * this run taken when --stop-after N asks for N (0: never). */
static inline bool stop_due(int64_t done, int64_t stop_after) {
    return g_interrupted || (stop_after > 0 && done == stop_after);
}

/* The line of a run that stopped before step `step` ("[tag] " first unless
 * tag is NULL): why (Ctrl-C or --stop-after), and that nothing was saved
 * (path NULL) or that path was saved, with note in the parentheses (NULL:
 * "continue with --resume <path>"). The caller saved to path before, and
 * prints nothing when that failed (save_failed). Returns the program's
 * status: 130 as a SIGINT'ed program, 1 when saving failed. */
static inline int stop_report(const char *tag, int64_t step, const char *path, bool save_failed,
                              const char *note) {
    const char *why = g_interrupted ? "interrupted" : "stopped (--stop-after)";
    if (save_failed)
        return 1;
    if (tag)
        printf("[%s] ", tag);
    if (!path) {
        printf("%s at step %lld; no --save FILE given, nothing saved\n", why, (long long)step);
        return 130;
    }
    printf("%s at step %lld: saved %s (", why, (long long)step, path);
    if (note)
        printf("%s)\n", note);
    else
        printf("continue with --resume %s)\n", path);
    return 130;
}

/* ------------------------------------------------------------ checkpoints */

/* A uint64 as metadata in decimal (the generators' states). 0 or -1. */
static inline int meta_u64(gj_state_dict *sd, const char *key, uint64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRIu64, v);
    return gj_state_dict_set_metadata(sd, key, buf);
}

/* Metadata key as a uint64 written by meta_u64 into *out: 0, or -1 when it
 * is absent, empty or not all digits. errno is strtoull's (ERANGE: too
 * large), for callers that refuse that too. */
static inline int meta_get_u64(const gj_state_dict *sd, const char *key, uint64_t *out) {
    const char *v = gj_state_dict_get_metadata(sd, key);
    char *end = NULL;
    errno = 0;
    *out = v ? strtoull(v, &end, 10) : 0;
    return v && *v && !*end ? 0 : -1;
}

/* The file of rank r's shards of a ZeRO checkpoint at path: path.rank<r>. */
static inline void ckpt_shard_path(char *out, size_t cap, const char *path, int r) {
    snprintf(out, cap, "%s.rank%d", path, r);
}

/* x in the fewest digits that read back as x ("0.006", not
 * "0.0060000000000000001"). */
static inline void shortest_g(char *buf, size_t cap, double x) {
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, x);
        if (strtod(buf, NULL) == x)
            return;
    }
}

/* The precision a run computes in, as checkpoints record it: "bf16" (bf16
 * mixed precision: --bf16, autocast on) or "f32". A static string. */
static inline const char *train_precision(void) {
    return gj_get_autocast() == GJ_BF16 ? "bf16" : "f32";
}

/* How the trainers' messages name a recorded precision p ("bf16", "f32"). */
static inline const char *precision_words(const char *p) {
    return strcmp(p, "bf16") == 0 ? "bf16 mixed precision (--bf16)" : "f32 (without --bf16)";
}

/* The settings every trainer takes that change a run's bits but no shape
 * of its checkpoint, as metadata of sd: train.precision (train_precision),
 * train.lr (--lr, exactly), train.threads (gradjit's threads: OpenBLAS
 * sums some GEMMs differently over another number of blocks). 0 or -1
 * with gj_last_error() set. */
static inline int ckpt_add_settings(gj_state_dict *sd, const train_flags *f) {
    int rc = gj_state_dict_set_metadata(sd, "train.precision", train_precision());
    rc = rc || meta_f64(sd, "train.lr", f->lr);
    rc = rc || meta_i64(sd, "train.threads", gj_get_num_threads());
    return rc ? -1 : 0;
}

/* --resume: ckpt_add_settings' records of checkpoint sd (read from path)
 * against this run's (f, and the precision and threads in force). A run
 * continues bit-identically only as it was trained, so another precision
 * or --lr is refused, with both values and the flag to resume with;
 * another thread count is allowed with a warning (the last bits may
 * differ, as on another machine). A checkpoint of an older version, which
 * recorded none of them, resumes as this command line says, with a note
 * saying so. 0, or 1 after "<prog>: --resume <path>: ..." on stderr. */
static inline int ckpt_check_settings(const gj_state_dict *sd, const train_flags *f,
                                      const char *prog, const char *path) {
    const char *p = gj_state_dict_get_metadata(sd, "train.precision");
    const char *lr = gj_state_dict_get_metadata(sd, "train.lr");
    const char *th = gj_state_dict_get_metadata(sd, "train.threads");
    const char *mine = train_precision();
    if (!p) {
        fprintf(stderr, "%s: note: --resume %s: the checkpoint does not record its precision, "
                        "--lr or threads (an older version wrote it); continuing in %s with "
                        "--lr %g as this command line asks: bit-identical only if the run was "
                        "trained so\n", prog, path, precision_words(mine), f->lr);
    } else if (strcmp(p, "f32") != 0 && strcmp(p, "bf16") != 0) {
        fprintf(stderr, "%s: --resume %s: train.precision is \"%.40s\", expected f32 or bf16\n",
                prog, path, p);
        return 1;
    } else if (strcmp(p, mine) != 0) {
        fprintf(stderr, "%s: --resume %s: the checkpoint was trained in %s, this run would "
                        "train in %s; a run continues bit-identically only in its own "
                        "precision: %s, or start a new run (without --resume) to train in %s\n",
                prog, path, precision_words(p), precision_words(mine),
                strcmp(p, "bf16") == 0 ? "add --bf16" : "drop --bf16", mine);
        return 1;
    }
    char *end = NULL;
    double v = lr ? strtod(lr, &end) : 0.0;
    if (lr && (!*lr || *end)) {
        fprintf(stderr, "%s: --resume %s: train.lr is \"%.40s\", expected a number\n", prog,
                path, lr);
        return 1;
    }
    if (lr && v != f->lr) {
        char a[32], b[32];
        shortest_g(a, sizeof a, v);
        shortest_g(b, sizeof b, f->lr);
        fprintf(stderr, "%s: --resume %s: the checkpoint was trained with --lr %s, this run has "
                        "--lr %s; resume with --lr %s to continue it bit-identically\n",
                prog, path, a, b, a);
        return 1;
    }
    long long t = th ? strtoll(th, &end, 10) : 0;
    if (th && *th && !*end && t != gj_get_num_threads())
        fprintf(stderr, "%s: warning: --resume %s: the checkpoint was trained on %lld thread%s, "
                        "this run has %d; a GEMM split over another number of threads may round "
                        "differently, so the rest of the run may differ in the last bits from "
                        "one that never stopped (--threads %lld continues it bit-identically)\n",
                prog, path, t, t == 1 ? "" : "s", gj_get_num_threads(), t);
    return 0;
}

/* What every trainer's checkpoint holds besides its model and its run:
 * the optimizer's state ("optim."), the RNG ("rng."), the settings that
 * change its bits (ckpt_add_settings, from f), and the metadata
 * format = gradjit and train.program = prog. Adds them to sd (NULL: fails,
 * so a failed dict passes through). With ZeRO (zero: the gj_ddp whose
 * shards opt updates) nothing is gathered: this rank writes its own shards
 * of the state to ckpt_shard_path(path, rank) (safetensors with the shard
 * metadata of gj_ddp_optim_shard_dict_add), and sd records how many ranks
 * did ("optim.zero.ranks"); ckpt_load_common consolidates them. 0, or -1
 * with gj_last_error() set. */
static inline int ckpt_add_common(gj_state_dict *sd, gj_optim *opt, gj_ddp *zero,
                                  const train_flags *f, const char *prog, const char *path) {
    int rc = sd ? 0 : -1;
    if (zero && rc == 0) {
        gj_state_dict *mine = gj_state_dict_new();
        rc = mine && gj_ddp_optim_shard_dict_add(zero, opt, mine, "optim") == 0 ? 0 : -1;
        const char *ranks = mine ? gj_state_dict_get_metadata(mine, "optim.zero.ranks") : NULL;
        const char *rank = mine ? gj_state_dict_get_metadata(mine, "optim.zero.rank") : NULL;
        char sp[PATH_MAX + 32];
        ckpt_shard_path(sp, sizeof sp, path, rank ? atoi(rank) : 0);
        rc = rc || !ranks || gj_save_safetensors(mine, sp) != 0;
        rc = rc || gj_state_dict_set_metadata(sd, "optim.zero.ranks", ranks);
        gj_state_dict_free(mine);
    } else {
        rc = rc || gj_optim_state_dict_add(opt, sd, "optim");
    }
    rc = rc || gj_rng_state_dict_add(sd, "rng");
    rc = rc || gj_state_dict_set_metadata(sd, "format", "gradjit");
    rc = rc || gj_state_dict_set_metadata(sd, "train.program", prog);
    rc = rc || ckpt_add_settings(sd, f);
    return rc ? -1 : 0;
}

/* A copy of data[0..n) (borrowed) as a 1-d tensor named name in sd. 0 or
 * -1 with gj_last_error() set. */
static inline int ckpt_add_array(gj_state_dict *sd, const char *name, gj_dtype dt, int64_t n,
                                 const void *data) {
    gj_tensor *t = gj_from_data(dt, 1, &n, data);
    int rc = t ? gj_state_dict_add(sd, name, t) : -1;
    gj_release(t);
    return rc;
}

/* Writes sd to path unless rc (the adding so far) failed, and frees sd
 * (owned: given up here). 0, or 1 after "<prog>: saving <path>: ...". */
static inline int ckpt_write(gj_state_dict *sd, int rc, const char *path, const char *prog) {
    rc = rc || gj_save_safetensors(sd, path);
    gj_state_dict_free(sd);
    if (rc) {
        fprintf(stderr, "%s: saving %s: %s\n", prog, path, gj_last_error());
        return 1;
    }
    return 0;
}

/* The optimizer state of a ZeRO checkpoint at path (f: its main file,
 * "optim.zero.ranks" = N) as one process's: the N shard files read and
 * consolidated (gj_zero_consolidate). A new dict, or NULL with
 * gj_last_error() set. */
static inline gj_state_dict *ckpt_zero_state(const gj_state_dict *f, const char *path) {
    const char *v = gj_state_dict_get_metadata(f, "optim.zero.ranks");
    int n = v ? atoi(v) : 0;
    if (n < 1 || n > 65536) /* (gj_zero_consolidate then says what is wrong) */
        n = 0;
    gj_state_dict **sh = calloc((size_t)n + 1, sizeof *sh), *all = gj_state_dict_new();
    int rc = sh && all ? 0 : -1;
    for (int r = 0; r < n && rc == 0; r++) {
        char sp[PATH_MAX + 32];
        ckpt_shard_path(sp, sizeof sp, path, r);
        if (!(sh[r] = gj_load_safetensors(sp))) rc = -1;
    }
    if (rc == 0)
        rc = gj_zero_consolidate(n, n ? (const gj_state_dict *const *)sh : NULL, "optim", all);
    for (int r = 0; sh && r < n; r++) gj_state_dict_free(sh[r]);
    free(sh);
    if (rc != 0) {
        gj_state_dict_free(all);
        return NULL;
    }
    return all;
}

/* The common part back from checkpoint f (written at path): the model's
 * tensors into model (a dict of the live parameters: names, shapes and
 * dtypes checked), the optimizer's state into opt (a ZeRO checkpoint's from
 * its shard files, on any number of ranks, with or without ZeRO), the RNG.
 * 0, or -1 with gj_last_error() set. */
static inline int ckpt_load_common(const gj_state_dict *f, gj_state_dict *model, gj_optim *opt,
                                   gj_ddp *zero, const char *path) {
    if (gj_state_dict_copy_into(model, f, false) != 0) return -1;
    gj_state_dict *st = NULL;
    const gj_state_dict *os = f;
    if (gj_state_dict_get_metadata(f, "optim.zero.ranks")) {
        if (!(st = ckpt_zero_state(f, path))) return -1;
        os = st;
    }
    int rc = (zero ? gj_ddp_optim_load_state_dict(zero, opt, os, "optim") /* its shards */
                   : gj_optim_load_state_dict(opt, os, "optim")) != 0 ||
             gj_rng_load_state_dict(f, "rng") != 0;
    gj_state_dict_free(st);
    return rc ? -1 : 0;
}

/* Reads a checkpoint's metadata and arrays back; every complaint is one
 * line "<where>: <key> ...". */
typedef struct ckpt_reader {
    const gj_state_dict *sd; /* borrowed */
    const char *same;        /* ckpt_same's advice: the settings to resume with */
    char where[PATH_MAX + 64];
} ckpt_reader;

/* Metadata key as a whole number in [lo, hi] into *out. 0, or -1 after
 * "<where>: <key> is <value>, expected an integer in [lo, hi]". */
static inline int ckpt_int(const ckpt_reader *rd, const char *key, int64_t lo, int64_t hi,
                           int64_t *out) {
    const char *v = gj_state_dict_get_metadata(rd->sd, key);
    char *end = NULL;
    errno = 0;
    long long x = v ? strtoll(v, &end, 10) : 0;
    if (!v || !*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "%s: %s is %s, expected an integer in [%lld, %lld]\n", rd->where, key,
                v ? v : "absent", (long long)lo, (long long)hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* Metadata key as a whole number >= 0 into *out (may be NULL) that must
 * equal want, a setting of this run (want < 0: any). 0, or -1 after
 * "<where>: <key> is <value>, this run has <want> (resume with the same
 * <same>)", or without the advice when want < 0. */
static inline int ckpt_same(const ckpt_reader *rd, const char *key, int64_t want, int64_t *out) {
    const char *v = gj_state_dict_get_metadata(rd->sd, key);
    char *end = NULL;
    errno = 0;
    long long x = v ? strtoll(v, &end, 10) : -1;
    if (!v || !*v || *end || errno || x < 0 || (want >= 0 && x != want)) {
        if (want >= 0)
            fprintf(stderr, "%s: %s is %s, this run has %lld (resume with the same %s)\n",
                    rd->where, key, v ? v : "absent", (long long)want, rd->same);
        else
            fprintf(stderr, "%s: %s is %s\n", rd->where, key, v ? v : "absent");
        return -1;
    }
    if (out)
        *out = x;
    return 0;
}

/* Metadata key as a number into *out. 0, or -1 after "<where>: <key> is
 * <value>, expected a number". ckpt_num_opt: an absent key is no error
 * and leaves *out as it was (what older checkpoints lack). */
static inline int ckpt_num(const ckpt_reader *rd, const char *key, double *out) {
    const char *v = gj_state_dict_get_metadata(rd->sd, key);
    char *end = NULL;
    *out = v ? strtod(v, &end) : NAN;
    if (!v || !*v || *end) {
        fprintf(stderr, "%s: %s is %s, expected a number\n", rd->where, key, v ? v : "absent");
        return -1;
    }
    return 0;
}

static inline int ckpt_num_opt(const ckpt_reader *rd, const char *key, double *out) {
    return gj_state_dict_get_metadata(rd->sd, key) ? ckpt_num(rd, key, out) : 0;
}

/* Tensor name, a 1-d array of n elements of dtype dt (GJ_I64 or GJ_F64),
 * copied into out[0..n). 0, or -1 after "<where>: <name> must be a 1-d
 * <dtype> tensor of <n> elements". */
static inline int ckpt_array(const ckpt_reader *rd, const char *name, gj_dtype dt, int64_t n,
                             void *out) {
    gj_tensor *t = gj_state_dict_get(rd->sd, name);
    if (!t || gj_tensor_dtype(t) != dt || gj_tensor_ndim(t) != 1 || gj_tensor_numel(t) != n) {
        fprintf(stderr, "%s: %s must be a 1-d %s tensor of %lld elements\n", rd->where, name,
                dt == GJ_I64 ? "i64" : "f64", (long long)n);
        return -1;
    }
    if (n > 0)
        memcpy(out, gj_tensor_data(t), (size_t)n * 8); /* i64 and f64: 8 bytes */
    return 0;
}

/* ----------------------------------------------------------------- the run */

typedef struct train_run train_run;

/* A trainer as the run sees it: its geometry and its hooks. Each hook gets
 * the trainer's own run struct (a train_run first; cast it back) and
 * returns 0; -1 with gj_last_error() set, which the run prints as
 * "<prog> (<tag>): <error>"; or 1 after printing a message itself. NULL
 * hooks do nothing, except init and batch, which every trainer has,
 * report (train_main's), and model_dict, save, resume (--save, --resume,
 * for the trainers that take them). */
typedef struct train_def {
    const char *prog;        /* the program: messages start with it */
    const train_flags *f;    /* the common flags */
    const void *opts, *data; /* the trainer's own options and data, for its hooks */
    size_t size;             /* sizeof the trainer's run struct */
    int epochs;              /* the run: epochs of per_epoch steps each */
    int64_t per_epoch;
    bool by_epoch; /* progress shows "epoch e/E [bar] b/n", else "[bar] step s/n" (one epoch) */
    int every;     /* on a terminal, a progress line every `every` steps */

    /* The model, r->opt and r->st (stepper_init in r->mode): called once
     * the run's own buffers are allocated and gj_manual_seed(seed) ran. */
    int (*init)(train_run *r);
    /* Releases the trainer's part, also of a run whose init failed half
     * way (its struct was zeroed); the run frees the rest. */
    void (*free)(train_run *r);
    /* The learning rate of step s (NULL: --lr throughout), set before it. */
    double (*lr_at)(const train_run *r, int64_t s);
    /* At the start of each epoch (not of one resumed inside): e.g. the
     * shuffle. */
    int (*epoch_begin)(train_run *r);
    /* The step's inputs in[0], in[1] for batch r->batch of epoch r->epoch
     * (step r->step): scope-owned tensors, made inside the step's scope (a
     * NULL one fails the step). */
    int (*batch)(train_run *r, gj_tensor **in);
    /* After each step, untimed (r->step already counts it): e.g. a
     * validation loss now and then. */
    int (*after_step)(train_run *r);
    /* After epoch e's figures are in: e.g. the test accuracy. */
    int (*epoch_end)(train_run *r, int e);
    /* Lines after step r->step - 1's progress line and after epoch e: one
     * run (c NULL) or --both's eager a and compiled c; q the quartiles of
     * epoch e's paired ratios eager / compiled (NULL for one run). */
    void (*step_report)(const train_run *a, const train_run *c);
    void (*epoch_report)(const train_run *a, const train_run *c, int e, const double q[3]);
    /* Checkpoints (train_save, train_resume). Adds the model's live
     * parameters to sd under stable names. 0 or -1 (gj_last_error()). */
    int (*model_dict)(train_run *r, gj_state_dict *sd);
    /* Adds to sd what the run needs besides model, optimizer and RNG to
     * continue at its position (r->epoch, r->batch, r->begun, r->step):
     * metadata, curves, generator. 0 or -1 (gj_last_error() set). */
    int (*save)(train_run *r, gj_state_dict *sd);
    /* Reads that back from rd (whose sd is the file; the hook sets its
     * where and same) into a fresh run, position included. 0, or 1 after a
     * message. */
    int (*resume)(train_run *r, ckpt_reader *rd, const char *path);
    /* At the end of a run that did not stop early (after its --save). */
    int (*finish)(train_run *r);
    /* train_main's results: of one run a (c, q, fq NULL), or of --both's a
     * and c with train_run_both's q and fq. Prints them and writes the
     * files; returns the program's exit status (0, or 1 after a message). */
    int (*report)(const train_run *a, const train_run *c, double (*q)[3], double (*fq)[3]);
} train_def;

/* One training run: the model and optimizer (the trainer's part), the
 * stepper, where the run is, and what it measured. The trainer's run
 * struct begins with one. */
struct train_run {
    const train_def *def;
    step_mode mode;
    const char *tag;       /* mode_tag(mode) */
    gj_optim *opt;         /* made by def->init; owned */
    gj_ddp *zero;          /* set by def->init when opt is over a ZeRO gj_ddp's shards
                              (borrowed): checkpoints gather and scatter its state */
    bool no_write;         /* a rank other than 0 of a ZeRO run: --save writes its shard
                              file only, rank 0 the rest */
    bool zero3;            /* zero is stage 3: the model's parameters are gathered (every
                              rank) for a save or a load */
    stepper st;            /* made by def->init; owned */
    gj_pg *pg;             /* set by def->init: each step's loss is averaged over pg's ranks
                              (data parallel); NULL: none. Borrowed */
    uint64_t rng;          /* the trainer's data generator (splitmix64), from --seed */
    /* Where the run is: the next step is batch `batch` of epoch `epoch`,
     * whose epoch_begin ran when `begun`; steps taken so far. */
    int epoch;
    int64_t batch;
    bool begun;
    int64_t step;
    /* This epoch so far (totals of step_times, ms; train_s: wall time of
     * the steps, s; the losses). */
    double train_s, fwd_total, bwd_total, step_total, loss_total;
    double *loss;     /* [epochs * per_epoch] each step's loss */
    double *epoch_s;  /* [epochs] train_s of the epoch */
    double *fwd_ms;   /* [epochs] mean forward ms (split modes; else NaN) */
    double *bwd_ms;   /* [epochs] mean backward ms (split modes; else NaN) */
    double *step_ms;  /* [epochs] mean ms of the whole step */
    double *train_loss; /* [epochs] mean training loss */
    gj_ca_stats ca, cs; /* the counters at the end of the run (compiled autograd, compiled step) */
};

/* A hook's result: -1 (gj_last_error() set) is printed as "<prog>
 * (<tag>): <error>". Returns 0, or 1 for any failure. */
static inline int train_hook(const train_run *r, int rc) {
    if (rc < 0)
        fprintf(stderr, "%s (%s): %s\n", r->def->prog, r->tag, gj_last_error());
    return rc ? 1 : 0;
}

/* Frees r (NULL: nothing) and all it owns: the stepper, the optimizer, the
 * trainer's part (def->free), what it measured. */
static inline void train_run_free(train_run *r) {
    if (!r)
        return;
    stepper_free(&r->st);
    gj_optim_free(r->opt);
    r->opt = NULL;
    if (r->def->free)
        r->def->free(r);
    free(r->loss);
    free(r->epoch_s);
    free(r->fwd_ms);
    free(r->bwd_ms);
    free(r->step_ms);
    free(r->train_loss);
    free(r);
}

/* A fresh run of d in mode m into *out (owned by the caller, who frees it
 * with train_run_free even when this fails, if non-NULL): its buffers,
 * gj_manual_seed(--seed) so that every run of d starts bit-identical, then
 * def->init. 0, or 1 after a message. */
static inline int train_run_new(const train_def *d, step_mode m, train_run **out) {
    int64_t n = d->per_epoch * d->epochs;
    size_t ne = (size_t)d->epochs;
    train_run *r = *out = calloc(1, d->size);
    if (!r) {
        fprintf(stderr, "%s: out of memory\n", d->prog);
        return 1;
    }
    r->def = d;
    r->mode = m;
    r->tag = mode_tag(m);
    r->rng = d->f->seed;
    r->loss = calloc((size_t)n, sizeof *r->loss);
    r->epoch_s = calloc(ne, sizeof *r->epoch_s);
    r->fwd_ms = calloc(ne, sizeof *r->fwd_ms);
    r->bwd_ms = calloc(ne, sizeof *r->bwd_ms);
    r->step_ms = calloc(ne, sizeof *r->step_ms);
    r->train_loss = calloc(ne, sizeof *r->train_loss);
    if (!r->loss || !r->epoch_s || !r->fwd_ms || !r->bwd_ms || !r->step_ms || !r->train_loss) {
        fprintf(stderr, "%s: out of memory\n", d->prog);
        return 1;
    }
    gj_manual_seed(d->f->seed);
    return train_hook(r, d->init(r));
}

/* Mean ms of a step's timed part over the epoch's first n steps: the
 * backward in the split modes, the whole step in gj_step's. */
static inline double train_ms(const train_run *r, int64_t n) {
    return (step_mode_split(r->mode) ? r->bwd_total : r->step_total) / (double)n;
}

/* What train_ms measures, in the trainers' lines. */
static inline const char *train_ms_what(const train_run *r) {
    return step_mode_split(r->mode) ? "backward" : "step";
}

/* Clears a progress line of `width` characters on a terminal. */
static inline void progress_clear(const train_flags *f, int width) {
    if (f->tty && !f->quiet)
        printf("\r%*s\r", width, "");
}

/* Epoch e begins at batch 0: its totals from zero, then def->epoch_begin. */
static inline int train_epoch_begin(train_run *r, int e) {
    r->epoch = e;
    r->batch = 0;
    r->begun = true;
    r->train_s = r->fwd_total = r->bwd_total = r->step_total = r->loss_total = 0.0;
    return train_hook(r, r->def->epoch_begin ? r->def->epoch_begin(r) : 0);
}

/* Epoch e's figures from its totals, then def->epoch_end. 0, or 1. */
static inline int train_epoch_end(train_run *r, int e) {
    double n = (double)r->def->per_epoch;
    bool split = step_mode_split(r->mode);
    r->epoch_s[e] = r->train_s;
    r->fwd_ms[e] = split ? r->fwd_total / n : NAN;
    r->bwd_ms[e] = split ? r->bwd_total / n : NAN;
    r->step_ms[e] = r->step_total / n;
    r->train_loss[e] = r->loss_total / n;
    return train_hook(r, r->def->epoch_end ? r->def->epoch_end(r, e) : 0);
}

/* One training step at the run's position: the learning rate, then inside
 * one scope the batch's inputs, forward, backward and update through the
 * stepper (timed into *tm), the loss (averaged over r->pg's ranks); then
 * def->after_step. The step's loss goes to r->loss[r->step++], its times
 * and loss to the epoch's totals. 0, or 1 after a message. */
static inline int train_run_step(train_run *r, step_times *tm) {
    const train_def *d = r->def;
    if (d->lr_at)
        gj_optim_set_lr(r->opt, d->lr_at(r, r->step));
    double ts = now_s();
    gj_scope_push();
    gj_tensor *in[2] = {NULL, NULL}, *loss = NULL;
    int hrc = d->batch(r, in);
    int ok = hrc == 0 && in[0] && in[1] && stepper_run(&r->st, 2, in, &loss, tm) == 0;
    gj_tensor *lg = ok && r->pg ? gj_detach(loss) : NULL; /* the batch's mean loss */
    ok = ok && (!lg || gj_allreduce(r->pg, lg, GJ_REDUCE_AVG) == 0);
    double lv = ok ? gj_tensor_item(lg ? lg : loss) : NAN;
    gj_release(lg);
    gj_scope_pop();
    if (!ok)
        return train_hook(r, hrc > 0 ? hrc : -1);
    r->loss[r->step++] = lv;
    if (step_mode_split(r->mode)) {
        r->fwd_total += tm->fwd_ms;
        r->bwd_total += tm->bwd_ms;
    }
    r->step_total += tm->step_ms;
    r->loss_total += lv;
    r->train_s += now_s() - ts;
    return train_hook(r, d->after_step ? d->after_step(r) : 0);
}

/* The progress line after batch b of epoch e (when progress_due): one run
 * (c NULL) with its loss, examples/s and train_ms, or --both's two. */
static inline void train_progress(const train_run *a, const train_run *c, int e, int64_t b) {
    const train_def *d = a->def;
    const train_flags *f = d->f;
    if (!progress_due(f->quiet, f->tty, d->every, b, d->per_epoch))
        return;
    char bar[BAR_W + 1];
    progress_bar(bar, b, d->per_epoch);
    printf("%s[%s] ", f->tty ? "\r" : "", c ? "both" : a->tag);
    if (d->by_epoch)
        printf("epoch %d/%d [%s] %lld/%lld", e + 1, d->epochs, bar, (long long)(b + 1),
               (long long)d->per_epoch);
    else
        printf("[%s] step %lld/%lld", bar, (long long)(b + 1), (long long)d->per_epoch);
    if (c)
        printf(" loss %.4f / %.4f  %s %.2f / %.2f ms (eager / compiled)", a->loss[a->step - 1],
               c->loss[c->step - 1], train_ms_what(a), train_ms(a, b + 1), train_ms(c, b + 1));
    else
        printf(" loss %.4f  %.0f examples/s  %s %.2f ms", a->loss[a->step - 1],
               (double)((b + 1) * f->batch) / a->train_s, train_ms_what(a), train_ms(a, b + 1));
    printf("%s", f->tty ? " " : "\n");
    fflush(stdout);
}

/* A new dict of r's model (def->model_dict: references to the live
 * parameters), or NULL with gj_last_error() set. */
static inline gj_state_dict *train_model_dict(train_run *r) {
    gj_state_dict *sd = gj_state_dict_new();
    if (sd && r->def->model_dict(r, sd) != 0) {
        gj_state_dict_free(sd);
        return NULL;
    }
    return sd;
}

/* --save: a safetensors checkpoint at path of the model (def->model_dict),
 * the optimizer, the RNG (ckpt_add_common) and the run (def->save). 0, or 1
 * after "<prog>: saving <path>: ...". */
static inline int train_save(train_run *r, const char *path) {
    const train_def *d = r->def;
    if (r->zero3 && gj_ddp_unshard(r->zero) != 0) {
        fprintf(stderr, "%s: saving %s: %s\n", d->prog, path, gj_last_error());
        return 1;
    }
    gj_state_dict *sd = train_model_dict(r);
    int rc = ckpt_add_common(sd, r->opt, r->zero, d->f, d->prog, path);
    rc = rc || d->save(r, sd);
    if (r->no_write) { /* (a ZeRO rank but 0: its shard file written, rank 0 writes the rest) */
        gj_state_dict_free(sd);
        rc = rc || (r->zero3 && gj_ddp_gather(r->zero) != 0);
        return rc ? 1 : 0;
    }
    rc = ckpt_write(sd, rc, path, d->prog);
    if (r->zero3 && gj_ddp_gather(r->zero) != 0) rc = 1;
    return rc;
}

/* --resume: the settings that change the run's bits (ckpt_check_settings:
 * another precision or --lr is refused), the run (def->resume), then
 * model, optimizer and RNG (ckpt_load_common) from the checkpoint at
 * path, into a fresh run; then
 * "[tag] resumed from <path> at ..." (unless --quiet) with the position.
 * 0, or 1 after a message ("<prog>: resuming from <path>: ..." for
 * gradjit's errors). */
static inline int train_resume(train_run *r, const char *path) {
    const train_def *d = r->def;
    gj_state_dict *f = gj_load_safetensors(path), *m = f ? train_model_dict(r) : NULL;
    ckpt_reader rd = {.sd = f};
    int rc = f && m ? ckpt_check_settings(f, d->f, d->prog, path) : -1;
    rc = rc == 0 ? d->resume(r, &rd, path) : rc;
    if (rc == 0 && r->zero3 && gj_ddp_unshard(r->zero) != 0) /* (written, then kept) */
        rc = -1;
    else if (rc == 0 && r->zero3)
        rc = ckpt_load_common(f, m, r->opt, r->zero, path) != 0 || gj_ddp_reshard(r->zero) != 0
                 ? -1 : 0;
    else if (rc == 0 && ckpt_load_common(f, m, r->opt, r->zero, path) != 0)
        rc = -1;
    if (rc < 0)
        fprintf(stderr, "%s: resuming from %s: %s\n", d->prog, path, gj_last_error());
    gj_state_dict_free(m);
    gj_state_dict_free(f);
    if (rc == 0 && !d->f->quiet) {
        printf("[%s] resumed from %s at ", r->tag, path);
        if (d->by_epoch)
            printf("epoch %lld, batch %lld (step %lld)\n", (long long)r->epoch + 1,
                   (long long)r->batch, (long long)r->step);
        else
            printf("step %lld of %lld\n", (long long)r->step, (long long)d->per_epoch);
    }
    return rc ? 1 : 0;
}

/* The run stops at its position (stop_due): the counters so far, then
 * --save and stop_report's line. Returns 130, or 1 if saving failed. */
static inline int train_stop(train_run *r) {
    const train_flags *f = r->def->f;
    if (f->tty && !f->quiet)
        printf("\n");
    gj_ca_stats ca, cs; /* what the run compiled or found in the caches so far */
    counters_read(&ca, &cs);
    print_counters(r->mode, &ca, &cs);
    return stop_report(r->tag, r->step, f->save, f->save && train_save(r, f->save) != 0, NULL);
}

/* One training run of d in mode m (resumed from --resume if given) into
 * *out (the caller's, to train_run_free; NULL until made): every epoch's
 * steps with progress and the trainer's reports, stopping at a step
 * boundary on Ctrl-C or --stop-after (saved to --save if given); at the
 * end the counters into r->ca, r->cs, --save, def->finish. 0, 130 if it
 * stopped early, or 1 after a message. */
static inline int train_run_one(const train_def *d, step_mode m, train_run **out) {
    const train_flags *f = d->f;
    int64_t done = 0; /* steps of this run */
    counters_reset();
    if (train_run_new(d, m, out) != 0)
        return 1;
    train_run *r = *out;
    if (f->resume && train_resume(r, f->resume) != 0)
        return 1;
    int e0 = r->epoch;
    bool resumed_inside = r->begun; /* epoch e0's batches from r->batch on */
    for (int e = e0; e < d->epochs; e++) {
        if (!(e == e0 && resumed_inside) && train_epoch_begin(r, e) != 0)
            return 1;
        for (int64_t b = r->batch; b < d->per_epoch; b++) {
            step_times tm;
            r->batch = b;
            if (stop_due(done, f->stop_after)) /* a step boundary: the place to stop */
                return train_stop(r);
            done++;
            if (train_run_step(r, &tm) != 0)
                return 1;
            if (done <= 2 && !f->quiet) { /* what the first steps paid */
                char tg[64];
                snprintf(tg, sizeof tg, "[%s]", r->tag);
                progress_clear(f, 100);
                print_warmup(tg, r->step - 1, tm.step_ms, &tm.w);
            }
            train_progress(r, NULL, e, b);
            if (d->step_report)
                d->step_report(r, NULL);
        }
        if (train_epoch_end(r, e) != 0)
            return 1;
        if (d->epoch_report)
            d->epoch_report(r, NULL, e, NULL);
        fflush(stdout);
    }
    counters_read(&r->ca, &r->cs);
    r->epoch = d->epochs;
    r->batch = 0;
    r->begun = false;
    if (f->save) {
        if (train_save(r, f->save) != 0)
            return 1;
        if (!f->quiet)
            printf("[%s] saved %s\n", r->tag, f->save);
    }
    return train_hook(r, d->finish ? d->finish(r) : 0);
}

/* --both: an eager run *a and a compiled run *c of d from the same seed
 * (the caller's, to train_run_free; NULL until made), one step of each in
 * turn, ABBA: eager first on even batches, compiled first on odd ones, so
 * that a change of the machine's speed weighs on both alike. With compiled
 * autograd both are split (STEP_SPLIT, STEP_SPLIT_CA) and the backward is
 * compared; with --compiled-step they are gj_step's (STEP_EAGER,
 * STEP_COMPILED) and the whole step is. q[e] receives the quartiles of
 * epoch e's per-step ratios eager / compiled (q[e][1] the median), fq[e]
 * those of the forward (split modes; NaN else); both [d->epochs]. The
 * compiled run's counters go to (*c)->ca, cs; def->finish runs for both.
 * 0, or 1 after a message. */
static inline int train_run_both(const train_def *d, train_run **a, train_run **c,
                                 double (*q)[3], double (*fq)[3]) {
    bool cs = d->f->compiled_step;
    int rc = 1;
    double *rt = NULL, *rf = NULL;
    counters_reset();
    if (train_run_new(d, cs ? STEP_EAGER : STEP_SPLIT, a) != 0 ||
        train_run_new(d, cs ? STEP_COMPILED : STEP_SPLIT_CA, c) != 0)
        return 1;
    train_run *ra = *a, *rc_ = *c;
    rt = malloc((size_t)(d->per_epoch + 1) * sizeof *rt);
    rf = malloc((size_t)(d->per_epoch + 1) * sizeof *rf);
    if (!rt || !rf) {
        fprintf(stderr, "%s: out of memory\n", d->prog);
        goto done;
    }
    for (int e = 0; e < d->epochs; e++) {
        if (train_epoch_begin(ra, e) != 0 || train_epoch_begin(rc_, e) != 0)
            goto done;
        for (int64_t b = 0; b < d->per_epoch; b++) {
            step_times ta, tc;
            ra->batch = rc_->batch = b;
            if (b % 2 ? train_run_step(rc_, &tc) || train_run_step(ra, &ta)
                      : train_run_step(ra, &ta) || train_run_step(rc_, &tc))
                goto done;
            rt[b] = cs ? ta.step_ms / tc.step_ms : ta.bwd_ms / tc.bwd_ms;
            rf[b] = cs ? NAN : ta.fwd_ms / tc.fwd_ms;
            train_progress(ra, rc_, e, b);
            if (d->step_report)
                d->step_report(ra, rc_);
        }
        if (train_epoch_end(ra, e) != 0 || train_epoch_end(rc_, e) != 0)
            goto done;
        quartiles(rt, d->per_epoch, q[e]);
        quartiles(rf, d->per_epoch, fq[e]);
        if (d->epoch_report)
            d->epoch_report(ra, rc_, e, q[e]);
        fflush(stdout);
    }
    counters_read(&rc_->ca, &rc_->cs);
    rc = train_hook(ra, d->finish ? d->finish(ra) : 0) ||
         train_hook(rc_, d->finish ? d->finish(rc_) : 0);
done:
    free(rt);
    free(rf);
    return rc;
}

/* A trainer's main once its data is loaded: one run of d in mode m, or
 * with --both the eager and compiled pair, then def->report; the runs
 * are freed after. A trainer that saves (def->save) stops at a step
 * boundary on Ctrl-C (catch_sigint), not with --both; one that does not
 * is killed by it. Returns the exit status: report's, or 130 if the run
 * stopped early, or 1 after a message. */
static inline int train_main(const train_def *d, step_mode m) {
    train_run *a = NULL, *c = NULL;
    double(*q)[3] = NULL, (*fq)[3] = NULL;
    int rc;
    if (!d->f->both) {
        if (d->save)
            catch_sigint();
        rc = train_run_one(d, m, &a);
    } else {
        q = calloc((size_t)d->epochs, sizeof *q);
        fq = calloc((size_t)d->epochs, sizeof *fq);
        rc = q && fq ? train_run_both(d, &a, &c, q, fq) : 1;
        if (!q || !fq)
            fprintf(stderr, "%s: out of memory\n", d->prog);
    }
    if (rc == 0)
        rc = d->report(a, c, q, fq);
    train_run_free(a);
    train_run_free(c);
    free(q);
    free(fq);
    return rc;
}

/* ----------------------------------------------------------------- output */

/* Whether --both's two runs gave the same loss curve, in one line
 * (print_curves). */
static inline bool print_pair_curves(const train_run *a, const train_run *c) {
    const train_def *d = a->def;
    return print_curves(c->mode == STEP_COMPILED ? "eager vs compiled step"
                                                 : "eager vs compiled autograd",
                        a->loss, c->loss, d->per_epoch * d->epochs);
}

/* The loss curve(s) as CSV at path: "step,loss" and a row per step, or
 * for --both (c) "step,loss_eager,loss_compiled". With va (a's validation
 * loss per step, NaN where none; vc c's) a "val_loss" column follows each
 * loss column, empty where NaN. 0, or -1 after a message. */
static inline int write_loss_csv(const char *path, const train_run *a, const train_run *c,
                                 const double *va, const double *vc) {
    const train_def *d = a->def;
    int64_t n = d->per_epoch * d->epochs;
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "%s: cannot write %s: %s\n", d->prog, path, strerror(errno));
        return -1;
    }
    fprintf(f, "step,%s%s%s%s\n", c ? "loss_eager" : "loss",
            va ? (c ? ",val_loss_eager" : ",val_loss") : "", c ? ",loss_compiled" : "",
            c && va ? ",val_loss_compiled" : "");
    for (int64_t s = 0; s < n; s++) {
        fprintf(f, "%lld,%.9g", (long long)s, a->loss[s]);
        if (va) {
            fputc(',', f);
            if (isfinite(va[s]))
                fprintf(f, "%.9g", va[s]);
        }
        if (c) {
            fprintf(f, ",%.9g", c->loss[s]);
            if (va) {
                fputc(',', f);
                if (isfinite(vc[s]))
                    fprintf(f, "%.9g", vc[s]);
            }
        }
        fputc('\n', f);
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "%s: error writing %s\n", d->prog, path);
        return -1;
    }
    return 0;
}

/* "wrote <csv> <png>" for the files written (unless --quiet). */
static inline void print_wrote(const train_flags *f) {
    if (!f->quiet && (f->csv || f->png))
        printf("wrote%s%s%s%s\n", f->csv ? " " : "", f->csv ? f->csv : "", f->png ? " " : "",
               f->png ? f->png : "");
}

#endif /* GJ_EXAMPLES_TRAINER_H */
