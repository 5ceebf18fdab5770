/* SPDX-License-Identifier: MIT */
/*
 * gjtest.c - shared helpers of the cmocka suites (see gjtest.h).
 *
 * Invariants: nothing here keeps state between calls except what a gjt_rng
 * holds; every tensor a helper creates is released before it returns unless
 * it is the returned new reference.
 */
#include "gjtest.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ------------------------------------------------------------------ RNG */

void gjt_rng_seed(gjt_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 1; }

/* splitmix64 */
uint64_t gjt_rng_u64(gjt_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double gjt_rng_uniform(gjt_rng *r, double lo, double hi) {
    double u = (double)(gjt_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return lo + (hi - lo) * u;
}

double gjt_rng_normal(gjt_rng *r) {
    double u1 = gjt_rng_uniform(r, 0.0, 1.0), u2 = gjt_rng_uniform(r, 0.0, 1.0);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}

int64_t gjt_rng_int(gjt_rng *r, int64_t n) { return (int64_t)(gjt_rng_u64(r) % (uint64_t)n); }

/* -------------------------------------------------------------- tensors */

int64_t gjt_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

/* New tensor of dtype dt holding data (converted from double). */
gj_tensor *gjt_tensor(gj_dtype dt, int ndim, const int64_t *shape, const double *data) {
    gj_tensor *t64 = gj_from_data(GJ_F64, ndim, shape, data);
    if (!t64 || dt == GJ_F64)
        return t64;
    gj_tensor *t = gj_cast(t64, dt);
    gj_release(t64);
    return t;
}

gj_tensor *gjt_uniform(gjt_rng *r, gj_dtype dt, int ndim, const int64_t *shape, double lo,
                       double hi) {
    int64_t n = gjt_numel(ndim, shape);
    double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        v[i] = gjt_rng_uniform(r, lo, hi);
    gj_tensor *t = gjt_tensor(dt, ndim, shape, v);
    free(v);
    return t;
}

gj_tensor *gjt_i64(int ndim, const int64_t *shape, const int64_t *data) {
    return gj_from_data(GJ_I64, ndim, shape, data);
}

gj_tensor *gjt_labels(gjt_rng *r, int ndim, const int64_t *shape, int64_t n) {
    int64_t m = gjt_numel(ndim, shape);
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
    for (int64_t i = 0; i < m; i++)
        v[i] = gjt_rng_int(r, n);
    gj_tensor *t = gj_from_data(GJ_I64, ndim, shape, v);
    free(v);
    return t;
}

double *gjt_values(const gj_tensor *t) {
    if (!t)
        return NULL;
    int64_t n = gj_tensor_numel(t);
    double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    if (gj_tensor_to_f64(t, v) != 0) {
        free(v);
        return NULL;
    }
    return v;
}

bool gjt_shape_is(const gj_tensor *t, int ndim, const int64_t *shape) {
    if (!t || gj_tensor_ndim(t) != ndim)
        return false;
    const int64_t *s = gj_tensor_shape(t);
    for (int i = 0; i < ndim; i++)
        if (s[i] != shape[i])
            return false;
    return true;
}

const char *gjt_fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < cap)
        snprintf(buf + k, cap - k, "]");
    return buf;
}

/* ---------------------------------------------------------- comparisons */

double gjt_max_abs_diff(const double *a, const double *b, int64_t n, int64_t *worst) {
    double m = 0.0;
    int64_t w = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (d > m || isnan(d)) {
            m = isnan(d) ? INFINITY : d;
            w = i;
        }
    }
    if (worst)
        *worst = w;
    return m;
}

bool gjt_allclose(const char *what, const double *got, const double *want, int64_t n,
                  double atol, double rtol) {
    int64_t bad = 0, worst = -1;
    double worst_ratio = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs(got[i] - want[i]);
        double tol = atol + rtol * fabs(want[i]);
        double ratio = isnan(err) ? INFINITY : err / tol;
        if (!(err <= tol)) {
            bad++;
            if (ratio >= worst_ratio) {
                worst_ratio = ratio;
                worst = i;
            }
        }
    }
    if (bad) {
        fprintf(stderr,
                "  %s: %lld of %lld elements differ; worst [%lld]: got %.17g want %.17g "
                "(|diff| %.3g, atol %.3g rtol %.3g)\n",
                what, (long long)bad, (long long)n, (long long)worst, got[worst], want[worst],
                fabs(got[worst] - want[worst]), atol, rtol);
        return false;
    }
    return true;
}

bool gjt_tensor_close(const char *what, const gj_tensor *t, const double *want, double atol,
                      double rtol) {
    double *v = gjt_values(t);
    if (!v) {
        fprintf(stderr, "  %s: no values (%s)\n", what, gj_last_error());
        return false;
    }
    bool ok = gjt_allclose(what, v, want, gj_tensor_numel(t), atol, rtol);
    free(v);
    return ok;
}

/* ---------------------------------------------------------------- errors */

bool gjt_error_has(const char *needle) {
    const char *h = gj_last_error();
    if (!h)
        return false;
    size_t nl = strlen(needle);
    for (; *h; h++) {
        size_t i = 0;
        while (i < nl && h[i] &&
               tolower((unsigned char)h[i]) == tolower((unsigned char)needle[i]))
            i++;
        if (i == nl)
            return true;
    }
    return nl == 0;
}

int64_t gjt_live_bytes(void) {
    gj_mem m;
    gj_mem_stats(&m);
    return m.live_bytes;
}

/* ----------------------------------------------- compiled autograd */

static int g_compiled_mode = -1; /* -1: not read yet */

/* The op suites run one graph at many shapes and attributes (one call site
 * with many keys): the recompile limit, a policy for trainers, is lifted. */
void gjt_set_compiled(bool on) {
    g_compiled_mode = on ? 1 : 0;
    if (on)
        gj_compiled_autograd_set_recompile_limit(-1);
}

bool gjt_compiled(void) {
    if (g_compiled_mode < 0) {
        const char *e = getenv("GJT_COMPILED");
        gjt_set_compiled(e && *e && strcmp(e, "0") != 0);
    }
    return g_compiled_mode == 1;
}

void gjt_setup(void) {
    if (!gjt_compiled())
        return;
    gj_set_compiled_autograd(true);
    fprintf(stderr, "gjtest: compiled mode (every backward compiled, checked against eager)\n");
}

void gjt_mlp_init(gjt_mlp *m, uint64_t seed) {
    gjt_rng r;
    gjt_rng_seed(&r, seed);
    m->w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
    m->b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
    assert_int_equal(gj_set_requires_grad(m->w, true), 0);
    assert_int_equal(gj_set_requires_grad(m->b, true), 0);
}

void gjt_mlp_free(gjt_mlp *m) {
    gj_release(m->w);
    gj_release(m->b);
}

/* The rest of the file at fd (from its start) as a malloc'd string. */
static char *read_back(int fd) {
    char *s = calloc(1, 1 << 16);
    assert_non_null(s);
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, s, (1 << 16) - 1);
    s[n > 0 ? n : 0] = '\0';
    return s;
}

int gjt_run_self(const char *self, const char *mode, const char *const *env, char **out,
                 char **err) {
    char op[] = "/tmp/gjt-out-XXXXXX", ep[] = "/tmp/gjt-err-XXXXXX";
    int ofd = mkstemp(op), efd = mkstemp(ep);
    assert_true(ofd >= 0 && efd >= 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        for (int i = 0; env && env[i]; i++) {
            const char *eq = strchr(env[i], '=');
            if (!eq) {
                unsetenv(env[i]);
                continue;
            }
            char name[256];
            assert_true(eq - env[i] < (ptrdiff_t)sizeof name);
            snprintf(name, sizeof name, "%.*s", (int)(eq - env[i]), env[i]);
            setenv(name, eq + 1, 1);
        }
        dup2(ofd, 1);
        dup2(efd, 2);
        execl(self, self, mode, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (out) *out = read_back(ofd);
    if (err) *err = read_back(efd);
    close(ofd);
    close(efd);
    unlink(op);
    unlink(ep);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

gj_ca_stats gjt_ca_now(void) {
    gj_ca_stats st;
    gj_compiled_autograd_stats(&st);
    return st;
}

bool gjt_ran_compiled(const char *what, const gj_ca_stats *a, const gj_ca_stats *b, int64_t n) {
    int64_t runs = (b->compiles - a->compiles) + (b->mem_hits - a->mem_hits) +
                   (b->disk_hits - a->disk_hits) + (b->instantiations - a->instantiations);
    int64_t fb = b->fallbacks - a->fallbacks, bw = b->backwards - a->backwards;
    if (runs == n && fb == 0 && bw == n)
        return true;
    fprintf(stderr,
            "  %s: backward did not run compiled: %lld backward(s), %lld compile(s), %lld "
            "memory hit(s), %lld disk hit(s), %lld bound, %lld fallback(s), expected %lld "
            "compiled\n",
            what, (long long)bw, (long long)(b->compiles - a->compiles),
            (long long)(b->mem_hits - a->mem_hits), (long long)(b->disk_hits - a->disk_hits),
            (long long)(b->instantiations - a->instantiations), (long long)fb, (long long)n);
    for (int r = 0; r < GJ_CA_N_REASONS; r++) {
        int64_t d = b->fallbacks_by_reason[r] - a->fallbacks_by_reason[r];
        if (d)
            fprintf(stderr, "    fallbacks for reason %s: %lld\n",
                    gj_ca_reason_name((gj_ca_reason)r), (long long)d);
    }
    if (fb)
        fprintf(stderr, "    last fallback: '%s'\n", gj_compiled_autograd_last_fallback());
    return false;
}

int gjt_backward(gj_tensor *root, gj_tensor *seed, bool retain_graph) {
    if (!gj_compiled_autograd_enabled())
        return gj_backward_ex(root, seed, retain_graph);
    gj_ca_stats a = gjt_ca_now();
    int rc = gj_backward_ex(root, seed, retain_graph);
    gj_ca_stats b = gjt_ca_now();
    if (rc == 0 && !gjt_ran_compiled("gjt_backward", &a, &b, 1))
        return -1;
    return rc;
}

bool gjt_backward_fails(gj_tensor *root, gj_tensor *seed, bool retain_graph) {
    gj_clear_error();
    if (gj_backward_ex(root, seed, retain_graph) == 0)
        return false;
    if (!gj_compiled_autograd_enabled())
        return true;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", gj_last_error());
    gj_set_compiled_autograd(false);
    gj_clear_error();
    int rc = gj_backward_ex(root, seed, retain_graph);
    gj_set_compiled_autograd(true);
    if (rc == 0) {
        fprintf(stderr, "  compiled backward failed ('%s') but the eager one succeeded\n", msg);
        return false;
    }
    if (strcmp(msg, gj_last_error()) != 0) {
        fprintf(stderr, "  compiled and eager backward fail differently:\n    compiled: '%s'\n"
                        "    eager:    '%s'\n",
                msg, gj_last_error());
        return false;
    }
    return true;
}

/* Non-finite eager values must be matched exactly (same infinity, or NaN);
 * the scale is the largest finite eager magnitude. */
bool gjt_same_as_eager(const char *what, const double *got, const double *want, int64_t n,
                       double rel) {
    double scale = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(want[i])) {
            if (!(got[i] == want[i] || (isnan(got[i]) && isnan(want[i])))) {
                fprintf(stderr, "  %s: compiled differs from eager at [%lld]: compiled %.17g "
                                "eager %.17g\n",
                        what, (long long)i, got[i], want[i]);
                return false;
            }
        } else if (fabs(want[i]) > scale) {
            scale = fabs(want[i]);
        }
    }
    int64_t worst = 0;
    double d = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(got[i] - want[i]);
        if (isfinite(want[i]) && (e > d || isnan(e))) {
            d = isnan(e) ? INFINITY : e;
            worst = i;
        }
    }
    if (d <= rel * scale)
        return true;
    fprintf(stderr,
            "  %s: compiled differs from eager: max |diff| %.3g, relative to max |eager| %.3g: "
            "%.3g (allowed %.3g); worst [%lld]: compiled %.17g eager %.17g\n",
            what, d, scale, scale > 0 ? d / scale : INFINITY, rel, (long long)worst, got[worst],
            want[worst]);
    return false;
}

double gjt_compiled_rel_tol(gj_dtype dt) {
    switch (dt) {
    case GJ_F64:
        return 1e-12;
    case GJ_BF16:
        return 0x1p-7; /* one bf16 ulp of the largest element */
    default:
        return 1e-6;
    }
}

/* ------------------------------------------------ finite differences */

/* Shape of the leaf behind input spec `in` (see gjt_view). */
static void leaf_shape(const gjt_input *in, int64_t *shape) {
    for (int i = 0; i < in->ndim; i++)
        shape[i] = in->shape[i];
    switch (in->view) {
    case GJT_TRANSPOSED:
        shape[in->ndim - 2] = in->shape[in->ndim - 1];
        shape[in->ndim - 1] = in->shape[in->ndim - 2];
        break;
    case GJT_NARROWED:
        shape[in->ndim - 1] += 3;
        break;
    case GJT_EXPANDED:
        shape[0] = 1;
        break;
    case GJT_PLAIN:
        break;
    }
}

static const char *view_name(gjt_view v) {
    switch (v) {
    case GJT_TRANSPOSED:
        return " (transposed view)";
    case GJT_NARROWED:
        return " (narrowed view)";
    case GJT_EXPANDED:
        return " (expanded view)";
    case GJT_PLAIN:
        break;
    }
    return "";
}

/* The input f sees for leaf (borrowed): the leaf itself (borrowed) or a view
 * (new reference, owned by the open scope); NULL on error. */
static gj_tensor *make_input(const gjt_input *in, gj_tensor *leaf) {
    switch (in->view) {
    case GJT_TRANSPOSED:
        return gj_transpose(leaf, in->ndim - 2, in->ndim - 1);
    case GJT_NARROWED:
        return gj_narrow(leaf, in->ndim - 1, 1, in->shape[in->ndim - 1]);
    case GJT_EXPANDED:
        return gj_expand(leaf, in->ndim, in->shape);
    case GJT_PLAIN:
        break;
    }
    return leaf;
}

/* Fills v[0..n) for spec in. */
static void fill_values(gjt_rng *r, const gjt_input *in, double *v, int64_t n) {
    double lo = in->lo, hi = in->hi;
    if (lo == hi) {
        lo = -1.0;
        hi = 1.0;
    }
    if (in->distinct) {
        for (int64_t i = 0; i < n; i++)
            v[i] = lo + (hi - lo) * ((double)i + 0.5) / (double)n;
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = gjt_rng_int(r, i + 1);
            double t = v[i];
            v[i] = v[j];
            v[j] = t;
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        double x;
        do {
            x = gjt_rng_uniform(r, lo, hi);
        } while (fabs(x) < in->min_abs);
        v[i] = x;
    }
}

static void print_inputs(const gjt_check *c) {
    char buf[128];
    for (int i = 0; i < c->n_in; i++)
        fprintf(stderr, "    input %d: %s%s%s\n", i,
                gjt_fmt_shape(buf, sizeof buf, c->in[i].ndim, c->in[i].shape),
                view_name(c->in[i].view), c->in[i].constant ? " (constant)" : "");
}

typedef struct fd_state {
    const gjt_check *c;
    gj_tensor *leaves[GJT_MAX_IN];
    double *R;          /* [out_numel] */
    int64_t out_numel;
    int out_ndim;
    int64_t out_shape[GJ_MAX_DIMS];
    gj_dtype out_dtype;
    bool have_out;
    double *vals_grad;  /* forward values of the grad-mode evaluation */
} fd_state;

/* One evaluation inside a fresh scope. grad_mode: build L = sum(out * R) in
 * the graph and run gj_backward (analytic pass), also storing out's values in
 * out_vals (if non-NULL). Otherwise returns the host dot of out with R in *L.
 * The first call fixes out's shape and R. 0 on success. */
static int fd_eval(fd_state *st, bool grad_mode, double *L, double *out_vals) {
    const gjt_check *c = st->c;
    int rc = -1;
    gj_tensor *inputs[GJT_MAX_IN] = {0};
    double *vals = NULL;
    gj_scope_push();
    if (c->reseed)
        gj_manual_seed(c->rng_seed);
    for (int i = 0; i < c->n_in; i++) {
        inputs[i] = make_input(&c->in[i], st->leaves[i]);
        if (!inputs[i]) {
            fprintf(stderr, "  %s: building input %d failed: %s\n", c->name, i, gj_last_error());
            goto fail;
        }
    }
    gj_tensor *out = c->fn(inputs, c->ctx);
    if (!out) {
        fprintf(stderr, "  %s: forward failed: %s\n", c->name, gj_last_error());
        goto fail;
    }
    if (!st->have_out) {
        st->out_ndim = gj_tensor_ndim(out);
        memcpy(st->out_shape, gj_tensor_shape(out), sizeof(int64_t) * (size_t)st->out_ndim);
        st->out_numel = gj_tensor_numel(out);
        st->out_dtype = gj_tensor_dtype(out);
        st->R = malloc(sizeof(double) * (size_t)(st->out_numel > 0 ? st->out_numel : 1));
        gjt_rng r;
        gjt_rng_seed(&r, c->data_seed * 7919 + 17);
        for (int64_t k = 0; k < st->out_numel; k++)
            st->R[k] = gjt_rng_uniform(&r, -1.0, 1.0);
        st->have_out = true;
    } else if (!gjt_shape_is(out, st->out_ndim, st->out_shape)) {
        fprintf(stderr, "  %s: output shape changed between evaluations\n", c->name);
        goto fail;
    }
    if (!grad_mode && gj_requires_grad(out)) {
        fprintf(stderr, "  %s: output requires grad under gj_no_grad_push\n", c->name);
        goto fail;
    }
    vals = gjt_values(out);
    if (!vals) {
        fprintf(stderr, "  %s: reading output failed: %s\n", c->name, gj_last_error());
        goto fail;
    }
    double host = 0.0;
    for (int64_t k = 0; k < st->out_numel; k++)
        host += vals[k] * st->R[k];
    if (out_vals)
        memcpy(out_vals, vals, sizeof(double) * (size_t)st->out_numel);
    if (grad_mode) {
        free(st->vals_grad);
        st->vals_grad = vals;
        vals = NULL;
        gj_tensor *Rt = gjt_tensor(st->out_dtype, st->out_ndim, st->out_shape, st->R);
        gj_tensor *prod = Rt ? gj_mul(out, Rt) : NULL;
        gj_tensor *loss = prod ? gj_sum(prod, 0, NULL, false) : NULL;
        if (!loss) {
            fprintf(stderr, "  %s: building L failed: %s\n", c->name, gj_last_error());
            goto fail;
        }
        double lg = gj_tensor_item(loss);
        double ltol = st->out_dtype == GJ_F64 ? 1e-9 : st->out_dtype == GJ_F32 ? 1e-4 : 2e-2;
        if (!(fabs(lg - host) <= ltol * (1.0 + fabs(host)))) {
            fprintf(stderr, "  %s: L in the graph %.17g != host dot %.17g\n", c->name, lg, host);
            goto fail;
        }
        if (gj_backward(loss, NULL) != 0) {
            fprintf(stderr, "  %s: backward failed: %s\n", c->name, gj_last_error());
            goto fail;
        }
    }
    *L = host;
    rc = 0;
fail:
    free(vals);
    gj_scope_pop();
    return rc;
}

/* The analytic pass of st (L = sum(f * R), backward into the leaves' .grad).
 * Eager mode: one fd_eval in grad mode. Compiled mode: eagerly first (the
 * reference), then, with every .grad cleared, compiled; the compiled one
 * must run compiled and match the reference within gjt_compiled_rel_tol of
 * the .grad's dtype, and its gradients are left in .grad. label names the
 * pass in messages. 0 on success; the compiled-autograd flag is restored. */
static int analytic_pass(fd_state *st, const char *label) {
    const gjt_check *c = st->c;
    double L;
    if (!gjt_compiled())
        return fd_eval(st, true, &L, NULL);
    bool was_on = gj_compiled_autograd_enabled();
    int rc = -1;
    double *eager[GJT_MAX_IN] = {0};
    bool has[GJT_MAX_IN] = {false};
    char what[200];
    gj_set_compiled_autograd(false);
    if (fd_eval(st, true, &L, NULL) != 0)
        goto done;
    for (int i = 0; i < c->n_in; i++) {
        gj_tensor *g = c->in[i].constant ? NULL : gj_tensor_grad(st->leaves[i]);
        if (!g)
            continue;
        has[i] = true;
        eager[i] = gjt_values(g);
        if (!eager[i] || gj_tensor_set_grad(st->leaves[i], NULL) != 0)
            goto done;
    }
    gj_set_compiled_autograd(true);
    gj_ca_stats before = gjt_ca_now();
    if (fd_eval(st, true, &L, NULL) != 0)
        goto done;
    gj_ca_stats after = gjt_ca_now();
    bool ok = gjt_ran_compiled(label, &before, &after, 1);
    for (int i = 0; i < c->n_in; i++) {
        if (c->in[i].constant)
            continue;
        gj_tensor *g = gj_tensor_grad(st->leaves[i]);
        if ((g != NULL) != has[i]) {
            fprintf(stderr, "  %s: input %d has %s .grad compiled but %s eagerly\n", label, i,
                    g ? "a" : "no", has[i] ? "one" : "none");
            ok = false;
            continue;
        }
        if (!g)
            continue;
        double *v = gjt_values(g);
        if (!v)
            goto done;
        snprintf(what, sizeof what, "%s: gradient of input %d", label, i);
        if (!gjt_same_as_eager(what, v, eager[i], gj_tensor_numel(g),
                               gjt_compiled_rel_tol(gj_tensor_dtype(g))))
            ok = false;
        free(v);
    }
    rc = ok ? 0 : -1;
done:
    gj_set_compiled_autograd(was_on);
    for (int i = 0; i < c->n_in; i++)
        free(eager[i]);
    return rc;
}

/* Leaves of check c in dtype dt (values drawn in f64 from r, then
 * converted); new references in leaves[]. 0 on success. */
static int make_leaves(const gjt_check *c, gjt_rng *r, gj_dtype dt, gj_tensor **leaves) {
    for (int i = 0; i < c->n_in; i++) {
        int64_t shape[GJ_MAX_DIMS];
        leaf_shape(&c->in[i], shape);
        int64_t n = gjt_numel(c->in[i].ndim, shape);
        double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
        fill_values(r, &c->in[i], v, n);
        leaves[i] = gjt_tensor(dt, c->in[i].ndim, shape, v);
        free(v);
        if (!leaves[i]) {
            fprintf(stderr, "%s: creating leaf %d failed: %s\n", c->name, i, gj_last_error());
            return -1;
        }
        if (!c->in[i].constant && gj_set_requires_grad(leaves[i], true) != 0) {
            fprintf(stderr, "%s: requires_grad failed: %s\n", c->name, gj_last_error());
            return -1;
        }
    }
    return 0;
}

int gjt_gradcheck(const gjt_check *c) {
    double eps = c->eps > 0 ? c->eps : 1e-6;
    double atol = c->atol > 0 ? c->atol : 1e-6;
    double rtol = c->rtol > 0 ? c->rtol : 1e-6;
    fd_state st = {.c = c};
    int rc = -1;
    double *analytic = NULL, *base_grad = NULL, *base_nograd = NULL;
    int64_t live0 = gjt_live_bytes();
    gjt_rng r;
    gjt_rng_seed(&r, c->data_seed);
    gj_clear_error();

    if (make_leaves(c, &r, GJ_F64, st.leaves) != 0)
        goto fail;

    /* Analytic pass (also keeps the forward values). */
    double L1;
    if (analytic_pass(&st, c->name) != 0)
        goto fail_print;
    base_grad = st.vals_grad;
    st.vals_grad = NULL;
    base_nograd = malloc(sizeof(double) * (size_t)(st.out_numel > 0 ? st.out_numel : 1));

    /* The forward in grad mode and under no_grad must agree. */
    gj_no_grad_push();
    int e0 = fd_eval(&st, false, &L1, base_nograd);
    gj_no_grad_pop();
    if (e0 != 0)
        goto fail_print;
    if (!gjt_allclose("forward (no_grad vs grad mode)", base_nograd, base_grad, st.out_numel,
                      1e-12, 1e-12))
        goto fail_print;

    /* Compare per leaf. */
    bool ok = true;
    for (int i = 0; i < c->n_in; i++) {
        if (c->in[i].constant)
            continue;
        gj_tensor *leaf = st.leaves[i];
        int64_t n = gj_tensor_numel(leaf);
        free(analytic);
        analytic = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
        gj_tensor *g = gj_tensor_grad(leaf);
        if (g) {
            if (!gjt_shape_is(g, gj_tensor_ndim(leaf), gj_tensor_shape(leaf)) ||
                gj_tensor_dtype(g) != GJ_F64) {
                char b1[128], b2[128];
                fprintf(stderr, "%s: .grad of input %d has shape %s dtype %d, leaf %s f64\n",
                        c->name, i, gjt_fmt_shape(b1, sizeof b1, gj_tensor_ndim(g),
                                                  gj_tensor_shape(g)),
                        (int)gj_tensor_dtype(g),
                        gjt_fmt_shape(b2, sizeof b2, gj_tensor_ndim(leaf), gj_tensor_shape(leaf)));
                goto fail_print;
            }
            if (gj_tensor_to_f64(g, analytic) != 0)
                goto fail_print;
        }
        double *d = gj_tensor_data(leaf);
        if (!d)
            goto fail_print;
        int64_t bad = 0, worst = -1;
        double worst_ratio = 0.0, worst_num = 0.0;
        /* every element, or c->sample random ones */
        int64_t n_check = (c->sample > 0 && c->sample < n) ? c->sample : n;
        gjt_rng pick;
        gjt_rng_seed(&pick, c->data_seed * 31 + (uint64_t)i + 5);
        gj_no_grad_push();
        for (int64_t kk = 0; kk < n_check; kk++) {
            int64_t k = n_check == n ? kk : gjt_rng_int(&pick, n);
            double orig = d[k], Lp, Lm;
            d[k] = orig + eps;
            int e1 = fd_eval(&st, false, &Lp, NULL);
            d[k] = orig - eps;
            int e2 = fd_eval(&st, false, &Lm, NULL);
            d[k] = orig;
            if (e1 || e2) {
                gj_no_grad_pop();
                goto fail_print;
            }
            double num = (Lp - Lm) / (2.0 * eps);
            double err = fabs(num - analytic[k]);
            double tol = atol + rtol * fabs(num);
            if (!(err <= tol)) {
                bad++;
                double ratio = isnan(err) ? INFINITY : err / tol;
                if (ratio >= worst_ratio) {
                    worst_ratio = ratio;
                    worst = k;
                    worst_num = num;
                }
            }
        }
        gj_no_grad_pop();
        if (bad) {
            char b1[128];
            int64_t idx[GJ_MAX_DIMS], rem = worst;
            int nd = gj_tensor_ndim(leaf);
            const int64_t *ls = gj_tensor_shape(leaf);
            for (int a = nd - 1; a >= 0; a--) {
                idx[a] = ls[a] ? rem % ls[a] : 0;
                rem = ls[a] ? rem / ls[a] : 0;
            }
            fprintf(stderr,
                    "%s: gradient of input %d wrong at %lld of %lld checked elements%s\n"
                    "    worst: leaf %s element %s (flat %lld): analytic %.12g numeric %.12g "
                    "(atol %.2g rtol %.2g eps %.2g)\n",
                    c->name, i, (long long)bad, (long long)n_check, g ? "" : " (.grad is NULL)",
                    gjt_fmt_shape(b1, sizeof b1, nd, ls),
                    gjt_fmt_shape((char[128]){0}, 128, nd, idx), (long long)worst,
                    analytic[worst], worst_num, atol, rtol, eps);
            ok = false;
        }
    }
    if (!ok)
        goto fail_print;
    rc = 0;
    goto fail;

fail_print:
    fprintf(stderr, "%s: FAILED (last error: '%s')\n", c->name, gj_last_error());
    print_inputs(c);
fail:
    for (int i = 0; i < c->n_in; i++)
        gj_release(st.leaves[i]);
    free(st.R);
    free(st.vals_grad);
    free(analytic);
    free(base_grad);
    free(base_nograd);
    if (rc == 0 && gjt_live_bytes() != live0) {
        fprintf(stderr, "%s: tensor bytes leaked: live %lld before, %lld after\n", c->name,
                (long long)live0, (long long)gjt_live_bytes());
        rc = -1;
    }
    return rc;
}

/* ------------------------------------------- low precision vs f64 */

int gjt_gradcompare(const gjt_check *c, gj_dtype dt, double atol, double rtol) {
    fd_state lo = {.c = c}, hi = {.c = c};
    int rc = -1;
    double *glo = NULL, *ghi = NULL;
    int64_t live0 = gjt_live_bytes();
    const char *dn = dt == GJ_F32 ? "f32" : dt == GJ_BF16 ? "bf16" : "other";
    gjt_rng r;
    gjt_rng_seed(&r, c->data_seed);
    gj_clear_error();
    if (make_leaves(c, &r, dt, lo.leaves) != 0)
        goto fail_print;
    /* the f64 leaves hold exactly the rounded values */
    for (int i = 0; i < c->n_in; i++) {
        gj_no_grad_push(); /* a new leaf, not a node of lo's graph */
        hi.leaves[i] = gj_cast(lo.leaves[i], GJ_F64);
        gj_no_grad_pop();
        if (!hi.leaves[i] ||
            (!c->in[i].constant && gj_set_requires_grad(hi.leaves[i], true) != 0))
            goto fail_print;
    }
    /* f64 forward fixes R; R is then rounded to dt and shared by both runs */
    double L;
    gj_no_grad_push();
    int e = fd_eval(&hi, false, &L, NULL);
    gj_no_grad_pop();
    if (e != 0)
        goto fail_print;
    {
        gj_tensor *Rt = gjt_tensor(dt, hi.out_ndim, hi.out_shape, hi.R);
        if (!Rt || gj_tensor_to_f64(Rt, hi.R) != 0) {
            gj_release(Rt);
            goto fail_print;
        }
        gj_release(Rt);
    }
    lo.R = malloc(sizeof(double) * (size_t)(hi.out_numel > 0 ? hi.out_numel : 1));
    memcpy(lo.R, hi.R, sizeof(double) * (size_t)hi.out_numel);
    lo.out_numel = hi.out_numel;
    lo.out_ndim = hi.out_ndim;
    memcpy(lo.out_shape, hi.out_shape, sizeof lo.out_shape);
    lo.out_dtype = dt;
    lo.have_out = true;
    char what[160];
    snprintf(what, sizeof what, "%s (f64 leaves)", c->name);
    if (analytic_pass(&hi, what) != 0)
        goto fail_print;
    snprintf(what, sizeof what, "%s (%s leaves)", c->name, dn);
    if (analytic_pass(&lo, what) != 0)
        goto fail_print;
    snprintf(what, sizeof what, "%s: %s forward vs f64", c->name, dn);
    if (!gjt_allclose(what, lo.vals_grad, hi.vals_grad, hi.out_numel, atol, rtol))
        goto fail_print;
    for (int i = 0; i < c->n_in; i++) {
        if (c->in[i].constant)
            continue;
        gj_tensor *gl = gj_tensor_grad(lo.leaves[i]), *gh = gj_tensor_grad(hi.leaves[i]);
        if (!gl || !gh) {
            fprintf(stderr, "%s: input %d has no .grad (%s: %s, f64: %s)\n", c->name, i, dn,
                    gl ? "yes" : "no", gh ? "yes" : "no");
            goto fail_print;
        }
        if (gj_tensor_dtype(gl) != dt) {
            fprintf(stderr, "%s: .grad of input %d is not %s\n", c->name, i, dn);
            goto fail_print;
        }
        int64_t n = gj_tensor_numel(gh);
        free(glo);
        free(ghi);
        glo = gjt_values(gl);
        ghi = gjt_values(gh);
        if (!glo || !ghi || gj_tensor_numel(gl) != n)
            goto fail_print;
        snprintf(what, sizeof what, "%s: %s gradient of input %d vs f64", c->name, dn, i);
        if (!gjt_allclose(what, glo, ghi, n, atol, rtol))
            goto fail_print;
    }
    rc = 0;
    goto fail;
fail_print:
    fprintf(stderr, "%s (%s vs f64): FAILED (last error: '%s')\n", c->name, dn, gj_last_error());
    print_inputs(c);
fail:
    for (int i = 0; i < c->n_in; i++) {
        gj_release(lo.leaves[i]);
        gj_release(hi.leaves[i]);
    }
    free(lo.R);
    free(hi.R);
    free(lo.vals_grad);
    free(hi.vals_grad);
    free(glo);
    free(ghi);
    if (rc == 0 && gjt_live_bytes() != live0) {
        fprintf(stderr, "%s: tensor bytes leaked: live %lld before, %lld after\n", c->name,
                (long long)live0, (long long)gjt_live_bytes());
        rc = -1;
    }
    return rc;
}

/* ------------------------------------------------------- scratch dirs */

int gjt_tmpdir_make(char *dir, size_t cap, const char *prefix) {
    int n = snprintf(dir, cap, "/tmp/%s-XXXXXX", prefix);
    return n > 0 && (size_t)n < cap && mkdtemp(dir) ? 0 : -1;
}

int gjt_tmpdir_remove(const char *dir) {
    char cmd[4200];
    int n = snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return n > 0 && (size_t)n < sizeof cmd && system(cmd) == 0 ? 0 : -1;
}
