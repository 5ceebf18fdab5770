/* SPDX-License-Identifier: MIT */
/*
 * test_jit_steps.c - compiled autograd over many training steps: a call
 * site whose structure does not change compiles once, whatever changes
 * between steps at run time.
 *
 *   - Dropout inside checkpoint regions (one region, two regions, dropout
 *     inside and outside a region): the tape's dropout seeds and offsets
 *     are run-time inputs of the program, never key material. 20 SGD steps
 *     compiled give compiles 1, memory hits 19, fallbacks 0, and each
 *     step's gradients equal those of an eager run from the same seed and
 *     weights, bit for bit (the recomputed masks are eager's masks). The
 *     program is the same plan whatever the seeds, so the disk cache
 *     serves it after the memory cache is cleared (1 compile, 1 disk hit).
 *   - GRADJIT_LOG=recompiles: an MLP at batch 32, 48, then 40 in an
 *     exec'ed child of this binary (GJT_STEPS_CHILD=recompiles): its
 *     stderr holds one line naming the node and the size that changed, 32
 *     -> 48 (the symbolic program's compile), none for 40 (bound to that
 *     program, no compile); the key difference of two regions with other
 *     dropout p names the tape op and the attribute.
 *   - GRADJIT_LOG=cache's exit summary counts both compiled paths, each on
 *     its line: a child (GJT_STEPS_CHILD=summary) that compiles one
 *     backward and one gj_step program prints 1 compile on each.
 *   - A region that must recompute a custom op (a C forward): 5 steps
 *     compiled give 1 compile, 4 hits, 0 fallbacks, the user's forward
 *     and backward called as often as eagerly, and eager's gradients bit
 *     for bit.
 *
 * Dimension legend: N rows (batch), C features, H hidden.
 */
#include "gjtest.h"

#include "jit/capture/capture.h"
#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { N = 8, C = 6, H = 10, STEPS = 20 };

/* ------------------------------------------------------------ helpers */

/* The .grad values of t (malloc'd). */
static double *grad_of(gj_tensor *t) {
    gj_tensor *g = gj_tensor_grad(t);
    assert_non_null(g);
    double *v = gjt_values(g);
    assert_non_null(v);
    return v;
}

/* Bit-for-bit equality of n values (as doubles converted from f32),
 * printing the first difference. */
static bool same_bits(const char *what, int step, const double *a, const double *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&a[i], &b[i], sizeof a[i]) != 0) {
            fprintf(stderr, "  %s, step %d: element %lld: compiled %.9g, eager %.9g\n", what,
                    step, (long long)i, a[i], b[i]);
            return false;
        }
    }
    return true;
}

/* --------------------------------------------- dropout in regions */

typedef struct model {
    gj_tensor *w[3];   /* [C, H], [H, H], [H, C] */
    double p;          /* dropout inside the regions */
    double p_out;      /* dropout outside (after the last region) when > 0 */
    int regions;       /* 1: layers 1-2 in one region; 2: one region per layer */
    uint64_t seed;     /* train: the generator's seed is 4242 + seed */
} model;

typedef struct layer_ctx {
    const model *m;
    int first, last; /* layers [first, last] run in this region */
} layer_ctx;

/* Layer k: h = act(dropout(h w_k, p)), act tanh for layer 0, gelu for 1. */
static gj_tensor *layer(const model *m, int k, gj_tensor *h) {
    h = gj_matmul(h, m->w[k]);
    if (h) h = gj_dropout(h, m->p, true);
    if (h) h = k == 0 ? gj_tanh(h) : gj_gelu(h);
    return h;
}

static int region_fn(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    (void)n_in, (void)n_out;
    const layer_ctx *lc = user;
    gj_tensor *h = in[0];
    for (int k = lc->first; k <= lc->last && h; k++) h = layer(lc->m, k, h);
    out[0] = h;
    return h ? 0 : -1;
}

/* loss = sum(dropout(regions(x), p_out) w3 * r): a new reference held by
 * the current scope (as are the temporaries). */
static gj_tensor *model_loss(const model *m, gj_tensor *x, gj_tensor *r) {
    gj_tensor *h = x;
    layer_ctx lc[2] = {{m, 0, m->regions == 1 ? 1 : 0}, {m, 1, 1}};
    for (int g = 0; g < m->regions; g++) {
        gj_tensor *y = NULL;
        assert_int_equal(gj_checkpoint(region_fn, &lc[g], 1, &h, 1, &y, NULL, NULL), 0);
        h = y;
    }
    if (m->p_out > 0) h = gj_dropout(h, m->p_out, true);
    gj_tensor *y = h ? gj_matmul(h, m->w[2]) : NULL;
    gj_tensor *l = y ? gj_sum(gj_mul(y, r), 0, NULL, false) : NULL;
    assert_non_null(l);
    return l;
}

typedef struct run_log {
    double *g[STEPS][3]; /* gradients of w1..w3 at each step (malloc'd) */
} run_log;

/* STEPS steps of SGD from the same weights, data and generator seed;
 * compiled autograd as asked. Gradients of every step go to lg. */
static void train(const model *shape, bool compiled, run_log *lg) {
    gjt_rng r;
    gjt_rng_seed(&r, 77);
    model m = *shape;
    const int64_t ws[3][2] = {{C, H}, {H, H}, {H, C}};
    for (int k = 0; k < 3; k++) {
        m.w[k] = gjt_uniform(&r, GJ_F32, 2, ws[k], -0.6, 0.6);
        assert_non_null(m.w[k]);
        assert_int_equal(gj_set_requires_grad(m.w[k], true), 0);
    }
    gj_optim *opt = gj_sgd_new(3, m.w, 0.05, 0.0, 0.0);
    assert_non_null(opt);
    gj_set_compiled_autograd(compiled);
    gj_manual_seed(4242 + m.seed);
    for (int step = 0; step < STEPS; step++) {
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1);
        gj_tensor *rr = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1);
        assert_non_null(x);
        assert_non_null(rr);
        gj_optim_zero_grad(opt);
        assert_int_equal(gj_backward(model_loss(&m, x, rr), NULL), 0);
        for (int k = 0; k < 3; k++) lg->g[step][k] = grad_of(m.w[k]);
        assert_int_equal(gj_optim_step(opt), 0);
        gj_release(x);
        gj_release(rr);
        gj_scope_pop();
    }
    gj_set_compiled_autograd(false);
    gj_optim_free(opt);
    for (int k = 0; k < 3; k++) gj_release(m.w[k]);
}

/* The model trained compiled: one compile, STEPS - 1 memory hits, no
 * fallback, and every step's gradients are the eager run's, bit for bit. */
static void check_one_compile(const char *name, const model *m) {
    int64_t live0 = gjt_live_bytes();
    run_log eager, comp;
    train(m, false, &eager);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    train(m, true, &comp);
    gj_ca_stats st;
    gj_compiled_autograd_stats(&st);
    fprintf(stderr, "  %s: compiles %lld, hits %lld, fallbacks %lld\n", name,
            (long long)st.compiles, (long long)st.mem_hits, (long long)st.fallbacks);
    if (st.fallbacks) fprintf(stderr, "  last fallback: %s\n", gj_compiled_autograd_last_fallback());
    assert_int_equal(st.compiles, 1);
    assert_int_equal(st.mem_hits, STEPS - 1);
    assert_int_equal(st.disk_hits, 0);
    assert_int_equal(st.fallbacks, 0);
    const int64_t n[3] = {C * H, H * H, H * C};
    for (int step = 0; step < STEPS; step++)
        for (int k = 0; k < 3; k++) {
            char what[96];
            snprintf(what, sizeof what, "%s: grad of w%d", name, k + 1);
            assert_true(same_bits(what, step, comp.g[step][k], eager.g[step][k], n[k]));
            free(comp.g[step][k]);
            free(eager.g[step][k]);
        }
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_dropout_one_region(void **s) {
    (void)s;
    const double ps[] = {0.1, 0.3, 0.5};
    for (int i = 0; i < 3; i++) {
        model m = {.p = ps[i], .regions = 1};
        char name[64];
        snprintf(name, sizeof name, "one region, p %.1f", ps[i]);
        check_one_compile(name, &m);
    }
}

static void test_dropout_two_regions(void **s) {
    (void)s;
    model m = {.p = 0.2, .regions = 2};
    check_one_compile("two regions, p 0.2", &m);
}

static void test_dropout_inside_and_outside(void **s) {
    (void)s;
    model m = {.p = 0.4, .p_out = 0.25, .regions = 2};
    check_one_compile("dropout inside (p 0.4) and outside (p 0.25)", &m);
}

/* A program with run-time dropout parameters is the same plan at every
 * step, so the disk cache serves it to a later process (simulated: the
 * memory cache is cleared between the steps, with other seeds). */
static void test_dropout_disk_cache(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    char dir[] = "/tmp/gj_steps_cacheXXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    model m = {.p = 0.3, .p_out = 0.2, .regions = 2};
    run_log lg;
    train(&m, true, &lg); /* compiles once, saves to disk */
    gj_jit_clear_cache(); /* as a new process: memory empty, disk kept */
    model m2 = m;
    m2.seed = 99; /* other masks: the same program */
    run_log lg2;
    train(&m2, true, &lg2);
    gj_ca_stats st;
    gj_compiled_autograd_stats(&st);
    fprintf(stderr, "  disk: compiles %lld, disk hits %lld, memory hits %lld, fallbacks %lld\n",
            (long long)st.compiles, (long long)st.disk_hits, (long long)st.mem_hits,
            (long long)st.fallbacks);
    assert_int_equal(st.compiles, 1);
    assert_int_equal(st.disk_hits, 1);
    assert_int_equal(st.mem_hits, 2 * (STEPS - 1));
    assert_int_equal(st.fallbacks, 0);
    for (int step = 0; step < STEPS; step++)
        for (int k = 0; k < 3; k++) {
            free(lg.g[step][k]);
            free(lg2.g[step][k]);
        }
    gj_jit_set_disk_cache(NULL);
    gj_jit_clear_cache();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* ------------------------------------------------ GRADJIT_LOG=recompiles */

/* The child (GJT_STEPS_CHILD=recompiles): an MLP, relu(x w1 + b1) w2 with
 * a mean squared loss, one compiled backward at batch 32, then one at 48
 * (.grads cleared in between, as by an optimizer's zero_grad).
 * Exit status 0 if both ran compiled. */
static int child_recompiles(void) {
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    gj_tensor *w1 = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){C, H}, -1, 1);
    gj_tensor *b1 = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){H}, -1, 1);
    gj_tensor *w2 = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){H, 3}, -1, 1);
    if (!w1 || !b1 || !w2) return 2;
    gj_set_requires_grad(w1, true);
    gj_set_requires_grad(b1, true);
    gj_set_requires_grad(w2, true);
    gj_set_compiled_autograd(true);
    /* 32 compiles, 48 compiles the site's symbolic program, 40 is bound to
     * it without a compile */
    const int64_t batch[3] = {32, 48, 40};
    for (int i = 0; i < 3; i++) {
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){batch[i], C}, -1, 1);
        gj_tensor *h = gj_relu(gj_add(gj_matmul(x, w1), b1));
        gj_tensor *y = gj_matmul(h, w2);
        gj_tensor *l = gj_mean(gj_mul(y, y), 0, NULL, false);
        if (!l || gj_backward(l, NULL) != 0) return 3;
        gj_scope_pop();
        /* zero_grad: a .grad present would be another call site */
        gj_tensor_set_grad(w1, NULL);
        gj_tensor_set_grad(b1, NULL);
        gj_tensor_set_grad(w2, NULL);
    }
    gj_ca_stats st;
    gj_compiled_autograd_stats(&st);
    fprintf(stderr, "child: compiles %lld, bound %lld, hits %lld, fallbacks %lld\n",
            (long long)st.compiles, (long long)st.instantiations, (long long)st.mem_hits,
            (long long)st.fallbacks);
    gj_release(w1);
    gj_release(b1);
    gj_release(w2);
    return st.compiles == 2 && st.instantiations == 1 && st.fallbacks == 0 ? 0 : 4;
}

/* The loss of the summary child's step: mean((x w)^2). */
static gj_tensor *summary_loss(void *ctx, int n_in, gj_tensor *const *in) {
    (void)n_in;
    gj_tensor *y = gj_matmul(in[0], (gj_tensor *)ctx);
    return gj_mean(gj_mul(y, y), 0, NULL, false);
}

/* GJT_STEPS_CHILD=summary: two compiled backwards (1 compile, 1 hit), then
 * three runs of a compiled step (1 compile, 2 hits), each path's counters
 * on stderr; the exit summary of GRADJIT_LOG=cache follows. */
static int child_summary(void) {
    gjt_rng r;
    gjt_rng_seed(&r, 7);
    gj_tensor *w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){C, H}, -1, 1);
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1);
    if (!w || !x) return 2;
    gj_set_requires_grad(w, true);
    gj_set_compiled_autograd(true);
    for (int i = 0; i < 2; i++) {
        gj_scope_push();
        gj_tensor *l = summary_loss(w, 1, &x);
        if (!l || gj_backward(l, NULL) != 0) return 3;
        gj_scope_pop();
        gj_tensor_set_grad(w, NULL);
    }
    gj_set_compiled_autograd(false);
    gj_optim *opt = gj_sgd_new(1, &w, 0.1, 0.0, 0.0);
    gj_step *step = opt ? gj_step_new(summary_loss, w, opt, NULL) : NULL;
    if (!step) return 4;
    for (int i = 0; i < 3; i++)
        if (gj_step_run(step, 1, &x, NULL) != 0) return 5;
    gj_ca_stats ca, cs;
    gj_compiled_autograd_stats(&ca);
    gj_step_stats(&cs);
    fprintf(stderr, "child: backwards: compiles %lld, hits %lld; steps: compiles %lld, hits %lld\n",
            (long long)ca.compiles, (long long)ca.mem_hits, (long long)cs.compiles,
            (long long)cs.mem_hits);
    gj_step_free(step);
    gj_optim_free(opt);
    gj_release(w);
    gj_release(x);
    return ca.compiles == 1 && ca.mem_hits == 1 && cs.compiles == 1 && cs.mem_hits == 2 ? 0 : 6;
}

static char g_self[4096];

/* Runs this binary as the child `name` with GRADJIT_LOG=log and returns
 * its stderr (malloc'd); the child must exit with 0. */
static char *child_stderr(const char *name, const char *log) {
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fd[0]);
        if (dup2(fd[1], STDERR_FILENO) < 0) _exit(126);
        close(fd[1]);
        setenv("GJT_STEPS_CHILD", name, 1);
        setenv("GRADJIT_LOG", log, 1);
        char *argv[] = {g_self, NULL};
        execv(g_self, argv);
        _exit(127);
    }
    close(fd[1]);
    size_t cap = 1 << 14, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (len + 4096 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t k = read(fd[0], buf + len, cap - len - 1);
        if (k <= 0) break;
        len += (size_t)k;
    }
    buf[len] = '\0';
    close(fd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "child %s failed (status %d); its stderr:\n%s", name, status, buf);
        fail();
    }
    return buf;
}

/* Number of lines of text that contain needle. */
static int lines_with(const char *text, const char *needle) {
    int n = 0;
    for (const char *l = text; *l;) {
        const char *nl = strchr(l, '\n');
        size_t ll = nl ? (size_t)(nl - l) : strlen(l);
        const char *hit = strstr(l, needle);
        n += hit && hit < l + ll;
        l += ll + (nl != NULL);
    }
    return n;
}

static void test_log_recompiles(void **s) {
    (void)s;
    char *err = child_stderr("recompiles", "recompiles");
    fprintf(stderr, "%s", err);
    /* one line, for the second compile only: none for the size bound to
     * the symbolic program (no compile) */
    assert_int_equal(lines_with(err, "[gradjit recompiles]"), 1);
    const char *line = strstr(err, "[gradjit recompiles]");
    const char *end = strchr(line, '\n');
    assert_non_null(end);
    char one[1024];
    snprintf(one, sizeof one, "%.*s", (int)(end - line), line);
    assert_non_null(strstr(one, "size mismatch at dim 0: expected 32, actual 48"));
    assert_non_null(strstr(one, "node #0 sum (creation rank"));
    assert_non_null(strstr(one, "input 0 size mismatch"));
    assert_non_null(strstr(one, "program 2 of the site, compiles symbolic"));
    assert_null(strstr(err, "actual 40"));
    free(err);
    /* without the word: no line */
    err = child_stderr("recompiles", "cache");
    assert_int_equal(lines_with(err, "[gradjit recompiles]"), 0);
    free(err);
}

/* GRADJIT_LOG=cache's summary names each compiled path and counts its
 * compiles: the step's too (it once counted the backwards' only). */
static void test_log_cache_summary(void **s) {
    (void)s;
    char *err = child_stderr("summary", "cache");
    fprintf(stderr, "%s", err);
    assert_int_equal(lines_with(err, "[gradjit cache] summary"), 2);
    assert_non_null(strstr(err, "[gradjit cache] summary, compiled autograd (backwards): 1 "
                                "compiles ("));
    assert_non_null(strstr(err, "ms), 1 memory hits, 0 disk hits, 0 fallbacks\n"));
    assert_non_null(strstr(err, "[gradjit cache] summary, compiled step (gj_step runs): 1 "
                                "compiles ("));
    assert_non_null(strstr(err, "ms), 2 memory hits, 0 disk hits, 0 fallbacks\n"));
    free(err);
}

/* ------------------------------------- a custom op recomputed in a region */

static int g_fwd_calls, g_bwd_calls;

/* steps::scaled_tanh(x, a) = a * tanh(x) */
static int st_fwd(gj_tensor *x, double a, gj_tensor **out) {
    g_fwd_calls++;
    *out = gj_mul_scalar(gj_tanh(x), a);
    return *out ? 0 : 1;
}

/* d/dx a * tanh(x) = a * (1 - tanh(x)^2) */
static int st_bwd(gj_tensor *g, gj_tensor *x, double a, gj_tensor **gx) {
    g_bwd_calls++;
    gj_tensor *t = gj_tanh(x);
    *gx = gj_mul(g, gj_mul_scalar(gj_add_scalar(gj_neg(gj_mul(t, t)), 1.0), a));
    return *gx ? 0 : 1;
}

static gj_custom_op *scaled_tanh(void) {
    gj_custom_op *op = gj_custom_op_find("steps::scaled_tanh");
    if (!op)
        op = gj_custom_op_define("steps::scaled_tanh(Tensor x, float a) -> Tensor",
                                 (void *)st_fwd, (void *)st_bwd);
    assert_non_null(op);
    return op;
}

/* Region: y = sigmoid(scaled_tanh(x w1, 0.7)) w2: sigmoid's backward reads
 * its input, the custom op's output, which the region must recompute. */
static int custom_region(void *user, int n_in, gj_tensor *const *in, int n_out, gj_tensor **out) {
    (void)n_in, (void)n_out;
    gj_tensor *const *w = user;
    gj_tensor *h = gj_matmul(in[0], w[0]), *t = NULL;
    if (!h || gj_custom_op_call(scaled_tanh(), &h, (double[]){0.7}, &t) != 0) return -1;
    gj_tensor *s = gj_sigmoid(t);
    out[0] = s ? gj_matmul(s, w[1]) : NULL;
    return out[0] ? 0 : -1;
}

/* 5 steps (compiled or eager) of the region model; gradients of w1, w2 per
 * step into g, and the user functions' call counts into calls[2]. */
static void custom_steps(bool compiled, double *g[5][2], int calls[2]) {
    gjt_rng r;
    gjt_rng_seed(&r, 12);
    gj_tensor *w[2] = {gjt_uniform(&r, GJ_F32, 2, (int64_t[]){C, H}, -0.7, 0.7),
                       gjt_uniform(&r, GJ_F32, 2, (int64_t[]){H, C}, -0.7, 0.7)};
    for (int k = 0; k < 2; k++) assert_int_equal(gj_set_requires_grad(w[k], true), 0);
    gj_optim *opt = gj_sgd_new(2, w, 0.1, 0.0, 0.0);
    assert_non_null(opt);
    g_fwd_calls = g_bwd_calls = 0;
    gj_set_compiled_autograd(compiled);
    for (int step = 0; step < 5; step++) {
        gj_scope_push();
        gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1), *y = NULL;
        gj_optim_zero_grad(opt);
        assert_int_equal(gj_checkpoint(custom_region, w, 1, &x, 1, &y, NULL, NULL), 0);
        assert_int_equal(gj_backward(gj_sum(gj_mul(y, y), 0, NULL, false), NULL), 0);
        for (int k = 0; k < 2; k++) g[step][k] = grad_of(w[k]);
        assert_int_equal(gj_optim_step(opt), 0);
        gj_scope_pop();
    }
    gj_set_compiled_autograd(false);
    calls[0] = g_fwd_calls;
    calls[1] = g_bwd_calls;
    gj_optim_free(opt);
    gj_release(w[0]);
    gj_release(w[1]);
}

/* A region that must recompute a custom op compiles once: the program
 * calls the op's C forward (an opaque step) where eager recomputes it, as
 * often as eager does, and gradients equal eager's bit for bit. */
static void test_custom_recompute(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    double *ge[5][2], *gc[5][2];
    int ce[2], cc[2];
    custom_steps(false, ge, ce);
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    custom_steps(true, gc, cc);
    gj_ca_stats st;
    gj_compiled_autograd_stats(&st);
    fprintf(stderr, "  custom op recomputed: compiles %lld, hits %lld, fallbacks %lld; forward "
            "calls %d (eager %d), backward calls %d (eager %d)\n", (long long)st.compiles,
            (long long)st.mem_hits, (long long)st.fallbacks, cc[0], ce[0], cc[1], ce[1]);
    if (st.fallbacks) fprintf(stderr, "  last fallback: %s\n", gj_compiled_autograd_last_fallback());
    assert_int_equal(st.compiles, 1);
    assert_int_equal(st.mem_hits, 4);
    assert_int_equal(st.fallbacks, 0);
    assert_int_equal(ce[0], 10); /* forward and recomputation, per step */
    assert_int_equal(cc[0], ce[0]);
    assert_int_equal(cc[1], ce[1]);
    const int64_t n[2] = {C * H, H * C};
    for (int step = 0; step < 5; step++)
        for (int k = 0; k < 2; k++) {
            assert_true(same_bits(k ? "custom region: grad of w2" : "custom region: grad of w1",
                                  step, gc[step][k], ge[step][k], n[k]));
            free(gc[step][k]);
            free(ge[step][k]);
        }
    gj_jit_clear_cache();
    assert_int_equal(gjt_live_bytes(), live0);
}

/* The key of the model's loss (malloc'd by the library: gj_rt_free'd as free). */
static char *model_key(const model *m, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, 3);
    model mm = *m;
    const int64_t ws[3][2] = {{C, H}, {H, H}, {H, C}};
    gj_scope_push();
    for (int k = 0; k < 3; k++) {
        mm.w[k] = gjt_uniform(&r, GJ_F32, 2, ws[k], -0.6, 0.6);
        assert_int_equal(gj_set_requires_grad(mm.w[k], true), 0);
    }
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1);
    gj_tensor *rr = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){N, C}, -1, 1);
    gj_manual_seed(seed);
    gj_tensor *l = model_loss(&mm, x, rr);
    char *key = gj_jit_key_string(1, &l, NULL);
    assert_non_null(key);
    gj_scope_pop();
    return key;
}

/* The description names a checkpoint tape's op and attribute; the seed of
 * the generator is not in the key at all. */
static void test_key_diff_tape(void **s) {
    (void)s;
    int64_t live0 = gjt_live_bytes();
    model a = {.p = 0.1, .regions = 1}, b = {.p = 0.2, .regions = 1};
    char *ka = model_key(&a, 1), *ka2 = model_key(&a, 2), *kb = model_key(&b, 1);
    assert_string_equal(ka, ka2); /* other seed: same key */
    char what[600];
    int d = gj_jit_key_diff(ka, strlen(ka), kb, strlen(kb), what, sizeof what);
    fprintf(stderr, "  p 0.1 -> 0.2: %s (%d lines)\n", what, d);
    assert_true(d >= 1);
    assert_non_null(strstr(what, "checkpoint, tape op #1 dropout"));
    assert_non_null(strstr(what, "attribute f[0] mismatch: expected 0.10000000000000001, "
                                 "actual 0.20000000000000001"));
    assert_int_equal(gj_jit_key_diff(ka, strlen(ka), ka2, strlen(ka2), what, sizeof what), 0);
    gj_rt_free(ka);
    gj_rt_free(ka2);
    gj_rt_free(kb);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(int argc, char **argv) {
    (void)argc;
    const char *child = getenv("GJT_STEPS_CHILD");
    gj_jit_set_disk_cache(NULL); /* counters of this process's compiles only */
    if (child && strcmp(child, "recompiles") == 0) return child_recompiles();
    if (child && strcmp(child, "summary") == 0) return child_summary();
    ssize_t n = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
    if (n <= 0)
        snprintf(g_self, sizeof g_self, "%s", argv[0]);
    else
        g_self[n] = '\0';
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_log_recompiles),
        cmocka_unit_test(test_log_cache_summary),
        cmocka_unit_test(test_key_diff_tape),
        cmocka_unit_test(test_custom_recompute),
        cmocka_unit_test(test_dropout_disk_cache),
        cmocka_unit_test(test_dropout_one_region),
        cmocka_unit_test(test_dropout_two_regions),
        cmocka_unit_test(test_dropout_inside_and_outside),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
