/* SPDX-License-Identifier: MIT */
/*
 * test_alloc_fail.c - out-of-memory at every allocation of a training step.
 *
 * For a tiny model, one clean forward+backward is run to count its
 * allocations N (gj_rt_alloc_count, both the metadata and the data path).
 * Then for every k in 1..N the k-th allocation is made to fail
 * (gj_rt_alloc_fail_at) and the step runs again inside a scope. It must
 * either succeed (with exactly the clean gradients: a swallowed failure must
 * not change results) or fail through a NULL / non-zero return whose
 * gj_last_error() mentions memory. After the scope pops and the .grads are
 * cleared, live tensor bytes must be back at the baseline; metadata leaks
 * are caught by ASan's leak checker in the sanitizer build.
 */
#include "gjtest.h"

#include "runtime/rt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct model {
    gj_tensor *p[8]; /* parameters (leaves requiring grad) */
    int np;
    gj_tensor *x, *labels, *idx, *mask;
    gj_optim *opt;
} model;

/* Forward to a scalar loss; NULL on error (error set). Temporaries are scoped. */
typedef gj_tensor *(*forward_fn)(model *m);

/* linear(3->5), gelu, linear(5->3), cross_entropy. */
static gj_tensor *fwd_mlp(model *m) {
    gj_tensor *h = gj_linear(m->x, m->p[0], m->p[1]);
    if (!h)
        return NULL;
    gj_tensor *g = gj_gelu(h);
    if (!g)
        return NULL;
    gj_tensor *o = gj_linear(g, m->p[2], m->p[3]);
    if (!o)
        return NULL;
    return gj_cross_entropy(o, m->labels);
}

/* embedding -> layer_norm -> masked self-attention -> cat -> linear -> CE. */
static gj_tensor *fwd_attn(model *m) {
    gj_tensor *e = gj_embedding(m->p[0], m->idx); /* [2,3,4] */
    if (!e)
        return NULL;
    gj_tensor *n = gj_layer_norm(e, m->p[1], m->p[2], 1e-5);
    if (!n)
        return NULL;
    gj_tensor *kt = gj_transpose(n, 1, 2);
    if (!kt)
        return NULL;
    gj_tensor *sc = gj_matmul(n, kt); /* [2,3,3] */
    if (!sc)
        return NULL;
    gj_tensor *mf = gj_masked_fill(sc, m->mask, -1e9);
    if (!mf)
        return NULL;
    gj_tensor *pr = gj_softmax(mf, 2);
    if (!pr)
        return NULL;
    gj_tensor *ctx = gj_matmul(pr, n); /* [2,3,4] */
    if (!ctx)
        return NULL;
    gj_tensor *both = gj_cat(2, (gj_tensor *[]){ctx, e}, 2); /* [2,3,8] */
    if (!both)
        return NULL;
    gj_tensor *flat = gj_reshape(both, 2, (int64_t[]){6, 8});
    if (!flat)
        return NULL;
    gj_tensor *d = gj_dropout(flat, 0.25, true);
    if (!d)
        return NULL;
    gj_tensor *o = gj_linear(d, m->p[3], NULL); /* [6,3] */
    if (!o)
        return NULL;
    return gj_cross_entropy(o, m->labels);
}

static gj_tensor *param(gjt_rng *r, int ndim, const int64_t *shape) {
    gj_tensor *t = gjt_uniform(r, GJ_F32, ndim, shape, -0.5, 0.5);
    assert_non_null(t);
    assert_int_equal(gj_set_requires_grad(t, true), 0);
    return t;
}

static void model_mlp(model *m) {
    gjt_rng r;
    gjt_rng_seed(&r, 3);
    memset(m, 0, sizeof *m);
    m->p[0] = param(&r, 2, (int64_t[]){5, 3});
    m->p[1] = param(&r, 1, (int64_t[]){5});
    m->p[2] = param(&r, 2, (int64_t[]){3, 5});
    m->p[3] = param(&r, 1, (int64_t[]){3});
    m->np = 4;
    m->x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 3}, -1, 1);
    m->labels = gjt_i64(1, (int64_t[]){4}, (int64_t[]){0, 2, 1, 2});
    assert_non_null(m->x);
    assert_non_null(m->labels);
}

static void model_attn(model *m) {
    gjt_rng r;
    gjt_rng_seed(&r, 4);
    memset(m, 0, sizeof *m);
    m->p[0] = param(&r, 2, (int64_t[]){5, 4}); /* embedding table */
    m->p[1] = param(&r, 1, (int64_t[]){4});    /* ln weight */
    m->p[2] = param(&r, 1, (int64_t[]){4});    /* ln bias */
    m->p[3] = param(&r, 2, (int64_t[]){3, 8}); /* head */
    m->np = 4;
    m->idx = gjt_i64(2, (int64_t[]){2, 3}, (int64_t[]){0, 4, 2, 2, 1, 3});
    m->labels = gjt_i64(1, (int64_t[]){6}, (int64_t[]){0, 1, 2, 2, 1, 0});
    m->mask = gjt_i64(2, (int64_t[]){3, 3}, (int64_t[]){0, 1, 1, 0, 0, 1, 0, 0, 0});
    assert_non_null(m->idx);
    assert_non_null(m->labels);
    assert_non_null(m->mask);
}

static void model_free(model *m) {
    gj_optim_free(m->opt);
    for (int i = 0; i < m->np; i++)
        gj_release(m->p[i]);
    gj_release(m->x);
    gj_release(m->labels);
    gj_release(m->idx);
    gj_release(m->mask);
}

static void clear_grads(model *m) {
    for (int i = 0; i < m->np; i++)
        assert_int_equal(gj_tensor_set_grad(m->p[i], NULL), 0);
}

/* One step: forward, backward (and an optimizer step if m->opt) inside a
 * scope pushed before the failure is armed. Returns 0 on success, 1 on a
 * reported failure (message copied to err). */
static int step(model *m, forward_fn fwd, int64_t fail_at, char *err, size_t cap) {
    int rc = 1;
    gj_scope_push();
    gj_manual_seed(9);
    gj_clear_error();
    if (fail_at > 0)
        gj_rt_alloc_fail_at(fail_at);
    gj_tensor *loss = fwd(m);
    if (!loss)
        goto out;
    if (gj_backward(loss, NULL) != 0)
        goto out;
    if (m->opt && gj_optim_step(m->opt) != 0)
        goto out;
    rc = 0;
out:
    gj_rt_alloc_fail_at(0);
    snprintf(err, cap, "%s", gj_last_error());
    gj_scope_pop();
    return rc;
}

static bool mentions_memory(const char *e) {
    const char *needles[] = {"memory", "alloc", "oom"};
    for (int i = 0; i < 3; i++) {
        for (const char *h = e; *h; h++) {
            size_t k = 0;
            while (needles[i][k] && h[k] && (h[k] | 32) == needles[i][k])
                k++;
            if (!needles[i][k])
                return true;
        }
    }
    return false;
}

/* Gradients of every parameter, concatenated (malloc'd). */
static double *grads_of(model *m, int64_t *n) {
    int64_t tot = 0;
    for (int i = 0; i < m->np; i++)
        tot += gj_tensor_numel(m->p[i]);
    double *g = calloc((size_t)tot, sizeof(double));
    int64_t off = 0;
    for (int i = 0; i < m->np; i++) {
        gj_tensor *gi = gj_tensor_grad(m->p[i]);
        if (gi)
            gj_tensor_to_f64(gi, g + off);
        else
            for (int64_t k = 0; k < gj_tensor_numel(m->p[i]); k++)
                g[off + k] = NAN; /* no .grad at all */
        off += gj_tensor_numel(m->p[i]);
    }
    *n = tot;
    return g;
}

/* The k loop. with_opt: an AdamW step is part of the run. */
static void run_fault_loop(const char *name, void (*build)(model *), forward_fn fwd,
                           bool with_opt) {
    model m;
    build(&m);
    char err[1024];
    if (with_opt) {
        m.opt = gj_adamw_new(m.np, m.p, 1e-3, 0.9, 0.999, 1e-8, 0.01);
        assert_non_null(m.opt);
    }
    /* warm-up (lazy one-time initialisation, optimizer state) */
    assert_int_equal(step(&m, fwd, 0, err, sizeof err), 0);
    clear_grads(&m);
    int64_t base = gjt_live_bytes();
    int64_t c0 = gj_rt_alloc_count();
    assert_int_equal(step(&m, fwd, 0, err, sizeof err), 0);
    int64_t N = gj_rt_alloc_count() - c0;
    int64_t ng;
    double *clean = grads_of(&m, &ng);
    clear_grads(&m);
    assert_int_equal(gjt_live_bytes(), base);
    assert_true(N > 0);

    int n_ok = 0, n_failed = 0, n_bad = 0;
    for (int64_t k = 1; k <= N; k++) {
        int rc = step(&m, fwd, k, err, sizeof err);
        if (rc == 0) {
            n_ok++;
            if (!with_opt) {
                int64_t n2;
                double *g = grads_of(&m, &n2);
                int64_t w;
                double d = gjt_max_abs_diff(g, clean, ng, &w);
                if (!(d <= 1e-6 * (1 + fabs(clean[w])))) {
                    fprintf(stderr,
                            "%s: allocation %lld of %lld failed, the step reported success but "
                            "gradient element %lld is %.9g instead of %.9g\n",
                            name, (long long)k, (long long)N, (long long)w, g[w], clean[w]);
                    n_bad++;
                }
                free(g);
            }
        } else {
            n_failed++;
            if (!mentions_memory(err)) {
                fprintf(stderr,
                        "%s: allocation %lld of %lld failed; error does not mention memory: "
                        "'%s'\n",
                        name, (long long)k, (long long)N, err);
                n_bad++;
            }
        }
        clear_grads(&m);
        int64_t live = gjt_live_bytes();
        if (live != base) {
            fprintf(stderr, "%s: allocation %lld of %lld failed (%s); %lld tensor bytes leaked\n",
                    name, (long long)k, (long long)N, rc ? "reported" : "swallowed",
                    (long long)(live - base));
            n_bad++;
            base = live; /* report each leaking k once */
        }
    }
    fprintf(stderr, "%s: %lld allocations; %d runs failed cleanly, %d succeeded, %d bad\n", name,
            (long long)N, n_failed, n_ok, n_bad);
    /* the model still trains normally afterwards */
    assert_int_equal(step(&m, fwd, 0, err, sizeof err), 0);
    if (!with_opt) {
        int64_t n2;
        double *g = grads_of(&m, &n2);
        assert_true(gjt_allclose("grads after the loop", g, clean, ng, 1e-6, 1e-6));
        free(g);
    }
    clear_grads(&m);
    free(clean);
    model_free(&m);
    assert_int_equal(n_bad, 0);
    assert_true(n_failed > 0);
}

static void test_mlp_every_allocation(void **s) {
    run_fault_loop("mlp", model_mlp, fwd_mlp, false);
}
static void test_attn_every_allocation(void **s) {
    run_fault_loop("attention", model_attn, fwd_attn, false);
}
static void test_mlp_adamw_every_allocation(void **s) {
    run_fault_loop("mlp+adamw", model_mlp, fwd_mlp, true);
}

/* Tensor creation and a scope push under OOM. gj_scope_push cannot return a
 * status, so a failed push must not leave the tensors created until the
 * matching pop without an owner. */
static void test_creation_and_scope_push(void **s) {
    int64_t live0 = gjt_live_bytes();
    for (int64_t k = 1; k <= 2; k++) {
        gj_clear_error();
        gj_rt_alloc_fail_at(k);
        gj_tensor *t = gj_zeros(GJ_F32, 1, (int64_t[]){64});
        gj_rt_alloc_fail_at(0);
        if (t) {
            gj_release(t);
        } else {
            if (!mentions_memory(gj_last_error()))
                fprintf(stderr, "gj_zeros OOM at %lld: '%s'\n", (long long)k, gj_last_error());
            assert_true(mentions_memory(gj_last_error()));
        }
        assert_int_equal(gjt_live_bytes(), live0);
    }
    /* the first allocation of the push itself fails */
    gj_rt_alloc_fail_at(1);
    gj_scope_push();
    gj_rt_alloc_fail_at(0);
    gj_tensor *t = gj_ones(GJ_F32, 1, (int64_t[]){64});
    assert_non_null(t);
    gj_scope_pop();
    int64_t leaked = gjt_live_bytes() - live0;
    if (leaked)
        fprintf(stderr, "scope_push under OOM: the tensor created in the scope was not "
                        "released by the matching pop (%lld bytes)\n", (long long)leaked);
    assert_int_equal(leaked, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_every_allocation),
        cmocka_unit_test(test_attn_every_allocation),
        cmocka_unit_test(test_mlp_adamw_every_allocation),
        cmocka_unit_test(test_creation_and_scope_push),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
