/* SPDX-License-Identifier: MIT */
/*
 * test_decompose.c - the decompositions of the composite primitives
 * (autograd/decompose.c) against the eager hand-fused composites.
 *
 * Each case runs one composite instruction twice through the eager builder:
 * once as the composite (gj_rt_exec's fused kernel), once through
 * gj_ag_decompose on a "spy" builder that forwards to the eager builder but
 * fails the test if a composite primitive is emitted. Outputs must have the
 * same metas and agree to 1e-12 in f64 (looser for f32/bf16, which only
 * checks the dtype plumbing). Every case also checks that no tensor byte
 * leaks.
 */
#include "gjtest.h"

#include "autograd/ag.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------- spy builder */

static int g_spy_emits;

static bool is_composite(gj_rt_prim p) {
    return p == GJ_P_SOFTMAX || p == GJ_P_LOG_SOFTMAX || p == GJ_P_SOFTMAX_BWD ||
           p == GJ_P_LOG_SOFTMAX_BWD || p == GJ_P_LN_FWD || p == GJ_P_LN_BWD ||
           p == GJ_P_CE_FWD || p == GJ_P_CE_BWD;
}

static int spy_emit(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in,
                    gj_val **outs) {
    (void)b;
    if (is_composite(inst->prim)) {
        print_error("decomposition emitted the composite %s\n", gj_rt_prim_name(inst->prim));
        fail();
    }
    g_spy_emits++;
    gj_ag_builder *e = gj_ag_eager_builder();
    return e->emit(e, inst, in, outs);
}
static void spy_meta(gj_ag_builder *b, gj_val *v, gj_rt_meta *out) {
    gj_ag_eager_builder()->meta(gj_ag_eager_builder(), v, out);
}

static gj_ag_builder *spy_builder(void) {
    static gj_ag_builder spy;
    gj_ag_builder *e = gj_ag_eager_builder();
    spy = *e;
    spy.emit = spy_emit;
    spy.meta = spy_meta;
    return &spy;
}

/* ---------------------------------------------------------- harness */

/* New tensor of dtype dt with values v (numel from shape). */
static gj_tensor *mk(gj_dtype dt, int ndim, const int64_t *shape, const double *v) {
    gj_tensor *t = gjt_tensor(dt, ndim, shape, v);
    assert_non_null(t);
    return t;
}

/* Random normal values * scale + shift, malloc'd. */
static double *rnd(gjt_rng *r, int64_t n, double scale, double shift) {
    double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    assert_non_null(v);
    for (int64_t i = 0; i < n; i++)
        v[i] = gjt_rng_normal(r) * scale + shift;
    return v;
}

/* Runs inst on in[] as composite and decomposed, compares every output.
 * Composite outputs (new references) go to keep[] if non-NULL. */
static void compare(const char *what, const gj_rt_inst *inst, gj_tensor **in, double tol,
                    gj_tensor **keep) {
    gj_ag_builder *e = gj_ag_eager_builder();
    gj_ag_builder *spy = spy_builder();
    gj_val *vin[GJ_RT_MAX_INPUTS];
    for (int k = 0; k < inst->n_in; k++)
        vin[k] = e->constant(e, in[k]);
    gj_val *c[GJ_RT_MAX_OUTPUTS] = {0}, *d[GJ_RT_MAX_OUTPUTS] = {0};
    int nc = e->emit(e, inst, vin, c);
    if (nc < 1)
        print_error("%s: composite failed: %s\n", what, gj_last_error());
    assert_true(nc >= 1);
    g_spy_emits = 0;
    int nd = gj_ag_decompose(spy, inst, vin, d);
    if (nd != nc)
        print_error("%s: decompose returned %d (composite %d): %s\n", what, nd, nc,
                    gj_last_error());
    assert_int_equal(nd, nc);
    assert_true(g_spy_emits > 0);
    for (int k = 0; k < nc; k++) {
        gj_rt_meta mc, md;
        e->meta(e, c[k], &mc);
        e->meta(e, d[k], &md);
        assert_int_equal(mc.dtype, md.dtype);
        assert_int_equal(mc.ndim, md.ndim);
        for (int a = 0; a < mc.ndim; a++)
            assert_int_equal(mc.shape[a], md.shape[a]);
        double *vc = gjt_values(gj_ag_val_tensor(c[k]));
        double *vd = gjt_values(gj_ag_val_tensor(d[k]));
        assert_non_null(vc);
        assert_non_null(vd);
        char label[128];
        snprintf(label, sizeof label, "%s output %d", what, k);
        bool ok = gjt_allclose(label, vd, vc, gj_rt_numel(mc.ndim, mc.shape), tol, tol);
        free(vc);
        free(vd);
        assert_true(ok);
        if (keep) {
            e->keep(e, c[k]);
            keep[k] = gj_ag_val_tensor(c[k]);
        }
    }
    e->end_node(e);
}

/* ------------------------------------------------------------ cases */

/* softmax / log_softmax forward and backward over the last axis of a
 * batched tensor, in dtype dt. */
static void softmax_case(gj_dtype dt, double tol) {
    int64_t live0 = gjt_live_bytes();
    gjt_rng r;
    gjt_rng_seed(&r, 11 + (uint64_t)dt);
    int64_t shape[3] = {3, 4, 7}, n = 3 * 4 * 7;
    double *xv = rnd(&r, n, 3.0, 0.5), *gv = rnd(&r, n, 1.0, 0.0);
    gj_tensor *x = mk(dt, 3, shape, xv), *gy = mk(dt, 3, shape, gv);
    const gj_rt_prim fwd[2] = {GJ_P_SOFTMAX, GJ_P_LOG_SOFTMAX};
    const gj_rt_prim bwd[2] = {GJ_P_SOFTMAX_BWD, GJ_P_LOG_SOFTMAX_BWD};
    for (int k = 0; k < 2; k++) {
        gj_rt_inst f = {.prim = fwd[k], .n_in = 1};
        gj_tensor *y[GJ_RT_MAX_OUTPUTS] = {0};
        compare(gj_rt_prim_name(fwd[k]), &f, &x, tol, y);
        gj_rt_inst bi = {.prim = bwd[k], .n_in = 2};
        gj_tensor *args[2] = {y[0], gy};
        compare(gj_rt_prim_name(bwd[k]), &bi, args, tol, NULL);
        gj_release(y[0]);
    }
    gj_release(x);
    gj_release(gy);
    free(xv);
    free(gv);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_softmax_f64(void **s) { softmax_case(GJ_F64, 1e-12); }
static void test_softmax_f32(void **s) { softmax_case(GJ_F32, 1e-5); }
static void test_softmax_bf16(void **s) { softmax_case(GJ_BF16, 2e-2); }

/* A row whose entries are all equal, and a large spread: the max shift. */
static void test_softmax_extremes(void **s) {
    int64_t live0 = gjt_live_bytes();
    int64_t shape[2] = {2, 5};
    const double v[10] = {2, 2, 2, 2, 2, -300, 0, 300, 299, -1};
    gj_tensor *x = mk(GJ_F64, 2, shape, v);
    gj_rt_inst f = {.prim = GJ_P_SOFTMAX, .n_in = 1};
    compare("softmax extremes", &f, &x, 1e-12, NULL);
    f.prim = GJ_P_LOG_SOFTMAX;
    compare("log_softmax extremes", &f, &x, 1e-12, NULL);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

/* layer norm forward (xhat, mean, rstd) and backward. */
static void layer_norm_case(gj_dtype dt, double tol) {
    int64_t live0 = gjt_live_bytes();
    gjt_rng r;
    gjt_rng_seed(&r, 23 + (uint64_t)dt);
    int64_t shape[3] = {2, 3, 10}, n = 60;
    double *xv = rnd(&r, n, 2.0, 1.5), *gv = rnd(&r, n, 1.0, 0.0);
    gj_tensor *x = mk(dt, 3, shape, xv), *g = mk(dt, 3, shape, gv);
    gj_rt_inst f = {.prim = GJ_P_LN_FWD, .n_in = 1, .scalar = 1e-5};
    gj_tensor *o[GJ_RT_MAX_OUTPUTS] = {0};
    compare("LN_FWD", &f, &x, tol, o);
    gj_rt_inst bi = {.prim = GJ_P_LN_BWD, .n_in = 4};
    gj_tensor *args[4] = {x, o[1], o[2], g};
    compare("LN_BWD", &bi, args, tol, NULL);
    for (int k = 0; k < 3; k++)
        gj_release(o[k]);
    gj_release(x);
    gj_release(g);
    free(xv);
    free(gv);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_layer_norm_f64(void **s) { layer_norm_case(GJ_F64, 1e-12); }
static void test_layer_norm_f32(void **s) { layer_norm_case(GJ_F32, 1e-4); }

/* cross entropy forward (loss, lse) and backward, for K classes (K = 1,
 * a power of two, and others exercise the iota construction). */
static void cross_entropy_case(gj_dtype dt, int64_t nrows, int64_t k, double tol) {
    int64_t live0 = gjt_live_bytes();
    gjt_rng r;
    gjt_rng_seed(&r, 37 + (uint64_t)k);
    int64_t shape[2] = {nrows, k}, lshape[1] = {nrows};
    double *xv = rnd(&r, nrows * k, 2.0, 0.0);
    int64_t *lab = malloc(sizeof(int64_t) * (size_t)nrows);
    assert_non_null(lab);
    for (int64_t i = 0; i < nrows; i++)
        lab[i] = i == 0 ? k - 1 : gjt_rng_int(&r, k); /* the last class at least once */
    gj_tensor *x = mk(dt, 2, shape, xv);
    gj_tensor *labels = gjt_i64(1, lshape, lab);
    assert_non_null(labels);
    gj_tensor *g = gj_scalar(dt, 0.7);
    assert_non_null(g);
    gj_rt_inst f = {.prim = GJ_P_CE_FWD, .n_in = 2};
    gj_tensor *o[GJ_RT_MAX_OUTPUTS] = {0};
    gj_tensor *fa[2] = {x, labels};
    compare("CE_FWD", &f, fa, tol, o);
    gj_rt_inst bi = {.prim = GJ_P_CE_BWD, .n_in = 4};
    gj_tensor *ba[4] = {x, o[1], labels, g};
    compare("CE_BWD", &bi, ba, tol, NULL);
    gj_release(o[0]);
    gj_release(o[1]);
    gj_release(x);
    gj_release(labels);
    gj_release(g);
    free(xv);
    free(lab);
    assert_int_equal(gjt_live_bytes(), live0);
}

static void test_cross_entropy_f64(void **s) {
    cross_entropy_case(GJ_F64, 6, 5, 1e-12);
    cross_entropy_case(GJ_F64, 4, 1, 1e-12);
    cross_entropy_case(GJ_F64, 9, 16, 1e-12);
    cross_entropy_case(GJ_F64, 7, 17, 1e-12);
    cross_entropy_case(GJ_F64, 3, 1000, 1e-12);
}
static void test_cross_entropy_f32(void **s) { cross_entropy_case(GJ_F32, 8, 10, 1e-5); }
static void test_cross_entropy_bf16(void **s) { cross_entropy_case(GJ_BF16, 8, 10, 3e-2); }

/* A non-composite instruction is refused with an error naming it. */
static void test_not_composite(void **s) {
    int64_t live0 = gjt_live_bytes();
    int64_t shape[1] = {3};
    gj_tensor *x = gj_ones(GJ_F64, 1, shape);
    assert_non_null(x);
    gj_ag_builder *e = gj_ag_eager_builder();
    gj_val *vin[2] = {e->constant(e, x), e->constant(e, x)};
    gj_val *out[GJ_RT_MAX_OUTPUTS] = {0};
    gj_rt_inst add = {.prim = GJ_P_ADD, .n_in = 2};
    gj_clear_error();
    assert_int_equal(gj_ag_decompose(e, &add, vin, out), -1);
    GJT_ASSERT_ERROR("ADD");
    e->end_node(e);
    gj_release(x);
    assert_int_equal(gjt_live_bytes(), live0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax_f64),       cmocka_unit_test(test_softmax_f32),
        cmocka_unit_test(test_softmax_bf16),      cmocka_unit_test(test_softmax_extremes),
        cmocka_unit_test(test_layer_norm_f64),    cmocka_unit_test(test_layer_norm_f32),
        cmocka_unit_test(test_cross_entropy_f64), cmocka_unit_test(test_cross_entropy_f32),
        cmocka_unit_test(test_cross_entropy_bf16), cmocka_unit_test(test_not_composite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
