/* SPDX-License-Identifier: MIT */
/*
 * gjtest.h - helpers shared by every cmocka suite of gradjit.
 *
 * Everything here goes through the public API (gradjit.h) only. Random test
 * data comes from a local splitmix64 generator (gjt_rng) seeded by each test,
 * never from the library's generator, so that test inputs do not change when
 * the library's RNG does.
 *
 * The finite-difference harness (gjt_gradcheck) builds f64 leaves from an
 * input specification, maps each leaf to the input f sees (the leaf itself,
 * or a non-contiguous/broadcast view of it), evaluates
 *     L = sum(f(inputs) * R)
 * with a fixed random R, runs gj_backward(L) for the analytic gradients (in
 * the leaves' .grad), and compares them with central differences computed by
 * perturbing the leaves' data in place and rebuilding the graph under
 * gj_no_grad_push. On failure it prints the check's name, the input shapes
 * and the worst element.
 *
 * Compiled mode (GJT_COMPILED=1 in the environment, or gjt_set_compiled):
 * every analytic pass of gjt_gradcheck and gjt_gradcompare runs twice, eager
 * (compiled autograd off) and compiled (on). The compiled backward must
 * really run compiled (one compile or cache hit, no fallback; a fallback
 * fails the check with its reason), its gradients must equal the eager ones
 * within 1e-12 (f64) / 1e-6 (f32) / 2^-7 (bf16) of the largest eager
 * magnitude, and the finite-difference (or f64) comparison is then made on
 * the compiled gradients. gjt_backward checks the same for a direct backward
 * whenever compiled autograd is on.
 *
 * Ownership: helpers returning gj_tensor* return a new reference; helpers
 * returning double* return malloc'd memory the caller frees.
 */
#ifndef GJTEST_H
#define GJTEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gradjit.h"

/* ------------------------------------------------------------------ RNG */

typedef struct gjt_rng {
    uint64_t s;
} gjt_rng;

void gjt_rng_seed(gjt_rng *r, uint64_t seed);
uint64_t gjt_rng_u64(gjt_rng *r);
double gjt_rng_uniform(gjt_rng *r, double lo, double hi); /* [lo, hi) */
double gjt_rng_normal(gjt_rng *r);
int64_t gjt_rng_int(gjt_rng *r, int64_t n); /* [0, n) */

/* -------------------------------------------------------------- tensors */

int64_t gjt_numel(int ndim, const int64_t *shape);
/* New f64-valued tensor of dtype dt (values converted) from a double array. */
gj_tensor *gjt_tensor(gj_dtype dt, int ndim, const int64_t *shape, const double *data);
/* New tensor of uniform values in [lo, hi). */
gj_tensor *gjt_uniform(gjt_rng *r, gj_dtype dt, int ndim, const int64_t *shape, double lo,
                       double hi);
/* New i64 tensor of integers in [0, n). */
gj_tensor *gjt_labels(gjt_rng *r, int ndim, const int64_t *shape, int64_t n);
/* New i64 tensor from an int64 array. */
gj_tensor *gjt_i64(int ndim, const int64_t *shape, const int64_t *data);
/* The tensor's values in row-major order of its view (malloc'd, NULL on error). */
double *gjt_values(const gj_tensor *t);
/* Whether t has exactly this shape. */
bool gjt_shape_is(const gj_tensor *t, int ndim, const int64_t *shape);
/* Formats a shape "[2, 3]" into buf. */
const char *gjt_fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape);

/* ---------------------------------------------------------- comparisons */

/* Largest |a[i] - b[i]|; *worst (may be NULL) receives its index. */
double gjt_max_abs_diff(const double *a, const double *b, int64_t n, int64_t *worst);
/* true if |got - want| <= atol + rtol*|want| for every element; otherwise
 * prints what (a label), the count of bad elements and the worst one. */
bool gjt_allclose(const char *what, const double *got, const double *want, int64_t n,
                  double atol, double rtol);
/* Same for a tensor against expected values (shape is the caller's business). */
bool gjt_tensor_close(const char *what, const gj_tensor *t, const double *want, double atol,
                      double rtol);

/* ---------------------------------------------------------------- errors */

/* Case-insensitive substring test on gj_last_error(). */
bool gjt_error_has(const char *needle);
/* Asserts that the last error is non-empty and mentions op. */
#define GJT_ASSERT_ERROR(op)                                                              \
    do {                                                                                  \
        if (!gjt_error_has(op) || gj_last_error()[0] == '\0') {                           \
            print_error("expected an error naming '%s', got '%s'\n", (op), gj_last_error()); \
            fail();                                                                       \
        }                                                                                 \
    } while (0)

/* ---------------------------------------------------------------- memory */

int64_t gjt_live_bytes(void);

/* ------------------------------------------------ finite differences */

#define GJT_MAX_IN 8

/* f: builds the output from inputs (borrowed); returns a new reference or
 * NULL (error set). Called inside a scope, so temporaries need no release. */
typedef gj_tensor *(*gjt_fn)(gj_tensor **inputs, void *ctx);

typedef enum gjt_view {
    GJT_PLAIN = 0,   /* the input is the contiguous leaf itself */
    GJT_TRANSPOSED,  /* leaf has the last two dims swapped; input = transpose */
    GJT_NARROWED,    /* leaf's last dim is 3 larger; input = narrow(last, 1, n) */
    GJT_EXPANDED,    /* leaf's dim 0 is 1; input = expand(leaf, shape) */
} gjt_view;

typedef struct gjt_input {
    int ndim;
    int64_t shape[GJ_MAX_DIMS]; /* shape of the input f sees */
    double lo, hi;              /* uniform range; lo == hi: [-1, 1) */
    double min_abs;             /* values resampled until |x| >= min_abs */
    bool distinct;              /* values a shuffled grid over [lo, hi) */
    gjt_view view;
    bool constant;              /* no requires_grad, not checked */
} gjt_input;

typedef struct gjt_check {
    const char *name;
    gjt_fn fn;
    void *ctx;
    int n_in;
    gjt_input in[GJT_MAX_IN];
    double eps, atol, rtol;     /* 0: 1e-6, 1e-6, 1e-6 */
    bool reseed;                /* gj_manual_seed(rng_seed) before each evaluation */
    uint64_t rng_seed;
    uint64_t data_seed;         /* seeds the leaves' values and R */
    int64_t sample;             /* > 0: check only this many random elements per leaf */
} gjt_check;

/* Runs the check; 0 if every analytic gradient matches. Also verifies that
 * the no-grad forward equals the grad-mode forward, that each leaf's .grad
 * has the leaf's shape and dtype, and that no tensor bytes leak. */
int gjt_gradcheck(const gjt_check *c);

/* The same check's analytic pass in dtype dt (f32 or bf16 leaves, values
 * drawn as for gjt_gradcheck and rounded to dt) against f64 leaves holding
 * the same rounded values: forward values and every .grad must agree within
 * atol + rtol*|f64|, and each .grad must have dtype dt. 0 if they do. */
int gjt_gradcompare(const gjt_check *c, gj_dtype dt, double atol, double rtol);

/* ----------------------------------------------- compiled autograd */

/* Whether the harness is in compiled mode (GJT_COMPILED set to anything but
 * "" or "0", read at the first call through gjt_set_compiled, unless
 * gjt_set_compiled decided before). */
bool gjt_compiled(void);
/* on: also lifts the recompile limit (gj_compiled_autograd_set_recompile_limit
 * (-1)): the suites run one graph at many shapes, one call site with many
 * keys, and every one of them must compile. */
void gjt_set_compiled(bool on);
/* Called first in main(): in compiled mode turns compiled autograd on for
 * the whole run (so direct backwards run compiled too) and says so on
 * stderr. Nothing in eager mode. */
void gjt_setup(void);

/* gj_backward_ex(root, seed, retain_graph). When compiled autograd is on
 * and the backward succeeds, it must have run compiled (exactly one compile
 * or cache hit and no fallback); if it fell back, the reason is printed and
 * -1 returned (the eager gradients are in .grad). Otherwise the backward's
 * status. */
int gjt_backward(gj_tensor *root, gj_tensor *seed, bool retain_graph);
/* For a backward that must fail: true if gj_backward_ex fails. When compiled
 * autograd is on, the eager engine must then fail the same way: it is run
 * again with compiled autograd off and must give the identical message (a
 * difference is printed and gives false). gj_last_error() holds the message
 * afterwards. */
bool gjt_backward_fails(gj_tensor *root, gj_tensor *seed, bool retain_graph);

/* The small model of several jit tests: a layer w [4, 6], b [4] (f32,
 * requiring grad) drawn uniform in [-0.5, 0.5) from seed. */
typedef struct gjt_mlp {
    gj_tensor *w, *b;
} gjt_mlp;
void gjt_mlp_init(gjt_mlp *m, uint64_t seed);
void gjt_mlp_free(gjt_mlp *m);

/* Runs program self (this test's binary) with the one argument mode in a
 * child process whose environment is this one's with each "NAME=VALUE" of
 * env set and each bare "NAME" unset (env NULL-terminated; NULL: no
 * change). Its stdout goes to *out and its stderr to *err (malloc'd, up to
 * 64 KiB each; a NULL pointer discards it). Returns the child's exit
 * status, -1 if it did not exit. */
int gjt_run_self(const char *self, const char *mode, const char *const *env, char **out,
                 char **err);

/* Compiled-autograd counters now (gj_compiled_autograd_stats). */
gj_ca_stats gjt_ca_now(void);
/* true if exactly n backwards ran between before and after, each compiled
 * (compiles + memory hits + disk hits grew by n, fallbacks by 0); otherwise
 * prints what, the counts, the fallback reasons and the last fallback. */
bool gjt_ran_compiled(const char *what, const gj_ca_stats *before, const gj_ca_stats *after,
                      int64_t n);

/* Compares gradient got with the eager reference want (n values): true if
 * max |got - want| <= rel * max |want| over the finite eager values (exact
 * when those are all zero) and every non-finite eager value is matched
 * exactly; otherwise prints what, the max absolute and the relative
 * difference and the worst element. */
bool gjt_same_as_eager(const char *what, const double *got, const double *want, int64_t n,
                       double rel);
/* The relative tolerance of compiled vs eager for dtype dt (see above). */
double gjt_compiled_rel_tol(gj_dtype dt);

/* ------------------------------------------------------- scratch dirs */

/* Makes a new directory /tmp/<prefix>-XXXXXX and writes its path into
 * dir (cap bytes). 0, or -1. */
int gjt_tmpdir_make(char *dir, size_t cap, const char *prefix);
/* Removes dir and everything below it. 0, or -1. */
int gjt_tmpdir_remove(const char *dir);

#endif /* GJTEST_H */
