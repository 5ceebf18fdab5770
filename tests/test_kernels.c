/* SPDX-License-Identifier: MIT */
/*
 * test_kernels.c - every primitive of runtime/rt_prim.h through gj_rt_exec,
 * against naive double-precision references, plus the error rules of
 * gj_rt_infer.
 *
 * Invariants:
 *   - Inputs are random (gjt_rng, fixed seeds) and built in one of four
 *     layouts: contiguous, transposed storage (last two dims swapped),
 *     sliced (a narrowed last dim at an offset) and broadcast (dim 0 with
 *     stride 0); references read them through gj_rt_get, so they see the
 *     same (bf16-rounded) values the kernels see.
 *   - Tolerances: f32 1e-5 relative, f64 1e-12, bf16 8e-3 (one rounding of
 *     the result to 8 bits).
 *   - Every test checks that it leaves no tensor bytes alive.
 */
#include "gjtest.h"
#include "runtime/gj_math.h"
#include "runtime/rt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static gjt_rng g_rng;

/* ------------------------------------------------------------ helpers */

enum { L_CONTIG, L_TRANS, L_SLICED, L_BCAST, L_COUNT };
static const char *const g_lname[L_COUNT] = {"contig", "transposed", "sliced", "broadcast"};
static const gj_dtype g_fdt[3] = {GJ_F32, GJ_F64, GJ_BF16};

static void put(gj_tensor *t, int64_t i, double v) {
    char *d = t->storage->data;
    switch (t->dtype) {
    case GJ_F32: ((float *)(void *)d)[i] = (float)v; break;
    case GJ_F64: ((double *)(void *)d)[i] = v; break;
    case GJ_BF16: ((uint16_t *)(void *)d)[i] = gj_m_f32_to_bf16((float)v); break;
    case GJ_I64: ((int64_t *)(void *)d)[i] = (int64_t)v; break;
    }
}

/* New tensor of logical shape sh in layout L with uniform values in
 * [lo, hi) (i64: integers in [lo, hi)). */
static gj_tensor *mk(gj_dtype dt, int nd, const int64_t *sh, int L, double lo, double hi) {
    int64_t bsh[GJ_MAX_DIMS], st[GJ_MAX_DIMS];
    memcpy(bsh, sh, sizeof(int64_t) * (size_t)nd);
    int64_t off = 0;
    if (L == L_TRANS && nd >= 2) {
        bsh[nd - 2] = sh[nd - 1];
        bsh[nd - 1] = sh[nd - 2];
    } else if (L == L_SLICED && nd >= 1) {
        bsh[nd - 1] = sh[nd - 1] + 3;
        off = 1;
    } else if (L == L_BCAST && nd >= 1) {
        bsh[0] = 1;
    } else {
        L = L_CONTIG;
    }
    gj_tensor *b = gj_rt_tensor_new(dt, nd, bsh);
    assert_non_null(b);
    int64_t n = gj_rt_numel(nd, bsh);
    for (int64_t i = 0; i < n; i++) {
        double v = gjt_rng_uniform(&g_rng, lo, hi);
        put(b, i, dt == GJ_I64 ? floor(v) : v);
    }
    if (L == L_CONTIG)
        return b;
    memcpy(st, b->strides, sizeof st);
    if (L == L_TRANS) {
        st[nd - 2] = b->strides[nd - 1];
        st[nd - 1] = b->strides[nd - 2];
    } else if (L == L_BCAST) {
        st[0] = 0;
    }
    gj_tensor *v = gj_rt_tensor_view(b->storage, dt, nd, sh, st, off);
    assert_non_null(v);
    gj_rt_tensor_release(b);
    return v;
}

/* Rounds every element of t's storage down to an integer. */
static void quantize(gj_tensor *t) {
    size_t el = gj_rt_dtype_size(t->dtype);
    int64_t n = (int64_t)(t->storage->nbytes / el);
    gj_tensor *flat = gj_rt_tensor_view(t->storage, t->dtype, 1, &n, NULL, 0);
    assert_non_null(flat);
    for (int64_t i = 0; i < n; i++)
        put(flat, i, floor(gj_rt_get(flat, i)));
    gj_rt_tensor_release(flat);
}

static gj_tensor *mk_data(gj_dtype dt, int nd, const int64_t *sh, const double *data) {
    gj_tensor *t = gj_rt_tensor_new(dt, nd, sh);
    assert_non_null(t);
    for (int64_t i = 0; i < t->numel; i++)
        put(t, i, data[i]);
    return t;
}

static double *vals(const gj_tensor *t) {
    double *v = malloc(sizeof(double) * (size_t)(t->numel > 0 ? t->numel : 1));
    assert_non_null(v);
    for (int64_t i = 0; i < t->numel; i++)
        v[i] = gj_rt_get(t, i);
    return v;
}

static double tol_r(gj_dtype dt) { return dt == GJ_F64 ? 1e-12 : dt == GJ_F32 ? 1e-5 : 8e-3; }
static double tol_a(gj_dtype dt) { return dt == GJ_F64 ? 1e-13 : dt == GJ_F32 ? 1e-6 : 1e-5; }

static gj_rt_inst inst_of(gj_rt_prim p, int n_in) {
    gj_rt_inst in;
    memset(&in, 0, sizeof in);
    in.prim = p;
    in.n_in = n_in;
    return in;
}

/* Runs inst, asserting success and one output; returns it (new ref). */
static gj_tensor *run1(const gj_rt_inst *inst, gj_tensor *const *in) {
    gj_tensor *outs[GJ_RT_MAX_OUTPUTS];
    int n = gj_rt_exec(inst, in, outs);
    if (n != 1) {
        print_error("%s failed: %s\n", gj_rt_prim_name(inst->prim), gj_last_error());
        fail();
    }
    assert_true(gj_rt_is_contiguous(outs[0]) || inst->prim == GJ_P_PERMUTE ||
                inst->prim == GJ_P_EXPAND || inst->prim == GJ_P_SLICE);
    return outs[0];
}

static bool same_shape(const gj_tensor *t, int nd, const int64_t *sh) {
    if (t->ndim != nd)
        return false;
    for (int k = 0; k < nd; k++)
        if (t->shape[k] != sh[k])
            return false;
    return true;
}

/* Flat index into a broadcast input of shape (nd, sh) for output element o
 * of shape (ond, osh). */
static int64_t bidx(int ond, const int64_t *osh, int64_t o, int nd, const int64_t *sh) {
    int64_t idx = 0, mul = 1;
    for (int k = ond - 1; k >= 0; k--) {
        int64_t ik = o % osh[k];
        o /= osh[k];
        int kk = k - (ond - nd);
        if (kk >= 0) {
            idx += (sh[kk] == 1 ? 0 : ik) * mul;
            mul *= sh[kk];
        }
    }
    return idx;
}

static int64_t g_live0;
static int setup(void **state) {
    (void)state;
    g_live0 = gjt_live_bytes();
    return 0;
}
static int teardown(void **state) {
    (void)state;
    int64_t now = gjt_live_bytes();
    if (now != g_live0) {
        print_error("tensor bytes leaked: %lld\n", (long long)(now - g_live0));
        return -1;
    }
    return 0;
}

/* ----------------------------------------------------- unary elementwise */

static double ref_unary(gj_rt_prim p, double x, double c) {
    switch (p) {
    case GJ_P_NEG: return -x;
    case GJ_P_EXP: return exp(x);
    case GJ_P_LOG: return log(x);
    case GJ_P_TANH: return tanh(x);
    case GJ_P_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case GJ_P_RELU: return x < 0 ? 0 : x;
    case GJ_P_GELU: return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    case GJ_P_SQRT: return sqrt(x);
    case GJ_P_RSQRT: return 1 / sqrt(x);
    case GJ_P_RECIP: return 1 / x;
    case GJ_P_GELU_GRAD: {
        double u = sqrt(2 / M_PI) * (x + 0.044715 * x * x * x), t = tanh(u);
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * sqrt(2 / M_PI) * (1 + 3 * 0.044715 * x * x);
    }
    case GJ_P_STEP: return x > 0 ? 1 : 0;
    case GJ_P_ADD_SCALAR: return x + c;
    case GJ_P_MUL_SCALAR: return x * c;
    case GJ_P_POW_SCALAR: return pow(x, c);
    default: return NAN;
    }
}

static void test_unary(void **state) {
    (void)state;
    static const gj_rt_prim ps[] = {GJ_P_NEG, GJ_P_EXP, GJ_P_LOG, GJ_P_TANH, GJ_P_SIGMOID,
                                    GJ_P_RELU, GJ_P_GELU, GJ_P_SQRT, GJ_P_RSQRT, GJ_P_RECIP,
                                    GJ_P_GELU_GRAD, GJ_P_STEP, GJ_P_ADD_SCALAR,
                                    GJ_P_MUL_SCALAR, GJ_P_POW_SCALAR};
    /* {37, 45} transposed takes the blocked schedule (partial 32x32 blocks) */
    static const int64_t shapes[][3] = {{3, 5, 0}, {0, 4, 0}, {1, 1, 0}, {2, 3, 33}, {37, 45, 0}};
    static const int nds[] = {2, 2, 2, 3, 2};
    static const double pows[] = {2, 3, 0.5, -1, 1, 1.7};
    char what[160];
    for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
        gj_rt_prim p = ps[pi];
        bool positive = p == GJ_P_LOG || p == GJ_P_SQRT || p == GJ_P_RSQRT || p == GJ_P_RECIP ||
                        p == GJ_P_POW_SCALAR;
        int nc = p == GJ_P_POW_SCALAR ? 6 : 1;
        for (int ci = 0; ci < nc; ci++) {
            double c = p == GJ_P_POW_SCALAR ? pows[ci] : 0.75;
            for (int di = 0; di < 3; di++) {
                for (int si = 0; si < 5; si++) {
                    for (int L = 0; L < L_COUNT; L++) {
                        gj_dtype dt = g_fdt[di];
                        gj_tensor *x = mk(dt, nds[si], shapes[si], L, positive ? 0.1 : -3,
                                          positive ? 3 : 3);
                        gj_rt_inst in = inst_of(p, 1);
                        in.scalar = c;
                        gj_tensor *y = run1(&in, &x);
                        assert_true(same_shape(y, x->ndim, x->shape));
                        assert_int_equal(y->dtype, dt);
                        double *xv = vals(x), *yv = vals(y), *want = vals(y);
                        for (int64_t i = 0; i < x->numel; i++)
                            want[i] = ref_unary(p, xv[i], c);
                        snprintf(what, sizeof what, "%s(c=%g) %s %s shape#%d",
                                 gj_rt_prim_name(p), c, gj_rt_dtype_name(dt), g_lname[L], si);
                        assert_true(gjt_allclose(what, yv, want, y->numel, tol_a(dt),
                                                 tol_r(dt)));
                        free(xv);
                        free(yv);
                        free(want);
                        gj_rt_tensor_release(x);
                        gj_rt_tensor_release(y);
                    }
                }
            }
        }
    }
}

/* Large tensors take the parallel path; the flat fast path must agree with
 * gj_math.h bit for bit. */
static void test_unary_large_bitexact(void **state) {
    (void)state;
    int64_t sh[2] = {300, 301};
    gj_tensor *x = mk(GJ_F32, 2, sh, L_CONTIG, -8, 8);
    gj_tensor *xt = mk(GJ_F32, 2, sh, L_TRANS, -8, 8);
    static const gj_rt_prim ps[] = {GJ_P_EXP, GJ_P_TANH, GJ_P_SIGMOID, GJ_P_GELU,
                                    GJ_P_GELU_GRAD};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        gj_rt_inst in = inst_of(ps[k], 1);
        gj_tensor *ins[2] = {x, xt};
        for (int j = 0; j < 2; j++) {
            gj_tensor *y = run1(&in, &ins[j]);
            const float *yo = gj_rt_data_ptr(y);
            long bad = 0;
            for (int64_t i = 0; i < y->numel; i++) {
                float xi = (float)gj_rt_get(ins[j], i), r;
                switch (ps[k]) {
                case GJ_P_EXP: r = gj_m_exp_f(xi); break;
                case GJ_P_TANH: r = gj_m_tanh_f(xi); break;
                case GJ_P_SIGMOID: r = gj_m_sigmoid_f(xi); break;
                case GJ_P_GELU: r = gj_m_gelu_f(xi); break;
                default: r = gj_m_gelu_grad_f(xi); break;
                }
                bad += memcmp(&r, &yo[i], 4) != 0;
            }
            if (bad) {
                print_error("%s: %ld elements differ from gj_math.h\n", gj_rt_prim_name(ps[k]),
                            bad);
                fail();
            }
            gj_rt_tensor_release(y);
        }
    }
    gj_rt_tensor_release(x);
    gj_rt_tensor_release(xt);
}

/* ---------------------------------------------------- binary, eq, where */

typedef struct shape_pair {
    int na, nb;
    int64_t a[4], b[4];
} shape_pair;

static const shape_pair g_pairs[] = {
    {2, 2, {3, 4}, {3, 4}},       {2, 1, {3, 4}, {4}},     {3, 2, {2, 1, 4}, {3, 1}},
    {3, 2, {2, 35, 40}, {35, 40}},
    {2, 1, {0, 3}, {3}},          {0, 2, {0}, {2, 3}},     {2, 2, {1, 1}, {1, 1}},
    {3, 3, {2, 3, 40}, {2, 3, 40}}, {2, 3, {5, 1}, {2, 1, 7}},
};

static void broadcast(int na, const int64_t *a, int nb, const int64_t *b, int *no, int64_t *o) {
    *no = na > nb ? na : nb;
    for (int k = 0; k < *no; k++) {
        int ka = k - (*no - na), kb = k - (*no - nb);
        int64_t da = ka >= 0 ? a[ka] : 1, db = kb >= 0 ? b[kb] : 1;
        o[k] = da == 1 ? db : da;
    }
}

static void test_binary(void **state) {
    (void)state;
    static const gj_rt_prim ps[] = {GJ_P_ADD, GJ_P_SUB, GJ_P_MUL, GJ_P_DIV, GJ_P_EQ};
    char what[160];
    for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
        gj_rt_prim p = ps[pi];
        for (int di = 0; di < 4; di++) {
            gj_dtype dt = di < 3 ? g_fdt[di] : GJ_I64;
            if (dt == GJ_I64 && p != GJ_P_EQ)
                continue;
            for (size_t si = 0; si < sizeof g_pairs / sizeof g_pairs[0]; si++) {
                const shape_pair *sp = &g_pairs[si];
                for (int L = 0; L < L_COUNT; L++) {
                    /* EQ: small integers so that equal pairs are common */
                    double lo = p == GJ_P_EQ ? -2 : p == GJ_P_DIV ? 0.5 : -3;
                    double hi = p == GJ_P_EQ ? 2 : 3;
                    gj_tensor *a = mk(dt, sp->na, sp->a, L, lo, hi);
                    gj_tensor *b = mk(dt, sp->nb, sp->b, (L + 1) % L_COUNT, lo, hi);
                    if (p == GJ_P_EQ) { /* integers: equal pairs are common */
                        quantize(a);
                        quantize(b);
                    }
                    gj_tensor *in2[2] = {a, b};
                    gj_rt_inst in = inst_of(p, 2);
                    gj_tensor *y = run1(&in, in2);
                    int no;
                    int64_t osh[GJ_MAX_DIMS];
                    broadcast(sp->na, sp->a, sp->nb, sp->b, &no, osh);
                    assert_true(same_shape(y, no, osh));
                    assert_int_equal(y->dtype, dt);
                    double *av = vals(a), *bv = vals(b), *yv = vals(y), *want = vals(y);
                    for (int64_t o = 0; o < y->numel; o++) {
                        double x = av[bidx(no, osh, o, sp->na, sp->a)];
                        double z = bv[bidx(no, osh, o, sp->nb, sp->b)];
                        want[o] = p == GJ_P_ADD ? x + z
                                  : p == GJ_P_SUB ? x - z
                                  : p == GJ_P_MUL ? x * z
                                  : p == GJ_P_DIV ? x / z
                                                  : (double)(x == z);
                    }
                    snprintf(what, sizeof what, "%s %s pair#%zu %s", gj_rt_prim_name(p),
                             gj_rt_dtype_name(dt), si, g_lname[L]);
                    assert_true(gjt_allclose(what, yv, want, y->numel, tol_a(dt), tol_r(dt)));
                    free(av);
                    free(bv);
                    free(yv);
                    free(want);
                    gj_rt_tensor_release(a);
                    gj_rt_tensor_release(b);
                    gj_rt_tensor_release(y);
                }
            }
        }
    }
}

static void test_eq_exact(void **state) {
    (void)state;
    /* float EQ on values that are equal, unequal, NaN, +-0 */
    double av[6] = {1, 2, NAN, 0.0, -0.0, 3};
    double bv[6] = {1, 2.5, NAN, -0.0, 0.0, 3};
    int64_t sh[1] = {6};
    for (int di = 0; di < 3; di++) {
        gj_tensor *a = mk_data(g_fdt[di], 1, sh, av), *b = mk_data(g_fdt[di], 1, sh, bv);
        gj_tensor *in2[2] = {a, b};
        gj_rt_inst in = inst_of(GJ_P_EQ, 2);
        gj_tensor *y = run1(&in, in2);
        double want[6] = {1, 0, 0, 1, 1, 1};
        double *yv = vals(y);
        assert_true(gjt_allclose("eq specials", yv, want, 6, 0, 0));
        free(yv);
        gj_rt_tensor_release(a);
        gj_rt_tensor_release(b);
        gj_rt_tensor_release(y);
    }
}

static void test_where(void **state) {
    (void)state;
    static const gj_dtype cdts[] = {GJ_F32, GJ_F64, GJ_BF16, GJ_I64};
    static const gj_dtype vdts[] = {GJ_F32, GJ_F64, GJ_BF16, GJ_I64};
    int64_t csh[2] = {4, 1}, ash[2] = {4, 5}, bsh[1] = {5};
    for (int ci = 0; ci < 4; ci++) {
        for (int vi = 0; vi < 4; vi++) {
            for (int L = 0; L < L_COUNT; L++) {
                gj_tensor *c = mk(cdts[ci], 2, csh, L, -1, 2); /* i64: -1, 0, 1 */
                if (cdts[ci] != GJ_I64) /* a few exact zeros and a tiny value */
                    for (int64_t i = 0; i < 4; i += 2)
                        put(c, i, i == 0 ? 0.0 : 1e-30);
                gj_tensor *a = mk(vdts[vi], 2, ash, (L + 1) % L_COUNT, -5, 5);
                gj_tensor *b = mk(vdts[vi], 1, bsh, L, -5, 5);
                gj_tensor *in3[3] = {c, a, b};
                gj_rt_inst in = inst_of(GJ_P_WHERE, 3);
                gj_tensor *y = run1(&in, in3);
                assert_true(same_shape(y, 2, ash));
                assert_int_equal(y->dtype, vdts[vi]);
                double *cv = vals(c), *av = vals(a), *bv = vals(b), *yv = vals(y), *w = vals(y);
                for (int64_t o = 0; o < y->numel; o++) {
                    double cc = cv[bidx(2, ash, o, 2, csh)];
                    w[o] = cc != 0 ? av[o] : bv[bidx(2, ash, o, 1, bsh)];
                }
                assert_true(gjt_allclose("where", yv, w, y->numel, 0, 0));
                free(cv);
                free(av);
                free(bv);
                free(yv);
                free(w);
                gj_rt_tensor_release(a);
                gj_rt_tensor_release(b);
                gj_rt_tensor_release(c);
                gj_rt_tensor_release(y);
            }
        }
    }
}

/* ------------------------------------------------------- cast, fill, ... */

static void test_cast(void **state) {
    (void)state;
    static const gj_dtype all[4] = {GJ_F32, GJ_F64, GJ_BF16, GJ_I64};
    double data[8] = {-2.7, 2.7, 0.0, -0.5, 1e10, 3.0, 255.5, -1e-3};
    int64_t sh[2] = {2, 4};
    for (int s = 0; s < 4; s++) {
        for (int d = 0; d < 4; d++) {
            gj_tensor *x = mk_data(all[s], 2, sh, data);
            gj_rt_inst in = inst_of(GJ_P_CAST, 1);
            in.dtype = all[d];
            gj_tensor *y = run1(&in, &x);
            assert_int_equal(y->dtype, all[d]);
            assert_true(same_shape(y, 2, sh));
            double *xv = vals(x), *yv = vals(y), want[8];
            for (int i = 0; i < 8; i++) {
                double v = xv[i];
                if (all[d] == GJ_I64)
                    v = trunc(v);
                else if (all[d] == GJ_F32)
                    v = (float)v;
                else if (all[d] == GJ_BF16)
                    v = gj_m_bf16_to_f32(gj_m_f32_to_bf16((float)v));
                want[i] = v;
            }
            assert_true(gjt_allclose("cast", yv, want, 8, 0, 0));
            free(xv);
            free(yv);
            gj_rt_tensor_release(x);
            gj_rt_tensor_release(y);
        }
    }
    /* NaN -> i64 0; out-of-range saturates */
    double sp[3] = {NAN, 1e30, -1e30};
    int64_t sh3[1] = {3};
    gj_tensor *x = mk_data(GJ_F64, 1, sh3, sp);
    gj_rt_inst in = inst_of(GJ_P_CAST, 1);
    in.dtype = GJ_I64;
    gj_tensor *y = run1(&in, &x);
    const int64_t *yi = gj_rt_data_ptr(y);
    assert_true(yi[0] == 0 && yi[1] == INT64_MAX && yi[2] == INT64_MIN);
    gj_rt_tensor_release(x);
    gj_rt_tensor_release(y);
}

static void test_fill_iota_dropout(void **state) {
    (void)state;
    static const gj_dtype all[4] = {GJ_F32, GJ_F64, GJ_BF16, GJ_I64};
    int64_t sh[3] = {3, 4, 5};
    for (int d = 0; d < 4; d++) {
        gj_rt_inst in = inst_of(GJ_P_FILL, 0);
        in.dtype = all[d];
        in.ndim = 3;
        memcpy(in.shape, sh, sizeof sh);
        in.scalar = 2.5;
        gj_tensor *y = run1(&in, NULL);
        assert_true(same_shape(y, 3, sh));
        for (int64_t i = 0; i < y->numel; i++)
            assert_true(gj_rt_get(y, i) == (all[d] == GJ_I64 ? 2.0 : 2.5));
        gj_rt_tensor_release(y);

        for (int ax = -1; ax < 3; ax++) {
            gj_rt_inst io = inst_of(GJ_P_IOTA, 0);
            io.dtype = all[d];
            io.ndim = 3;
            memcpy(io.shape, sh, sizeof sh);
            io.axis = ax;
            y = run1(&io, NULL);
            int a = ax < 0 ? 2 : ax;
            for (int64_t i = 0; i < y->numel; i++) {
                int64_t idx[3] = {i / 20, (i / 5) % 4, i % 5};
                assert_true(gj_rt_get(y, i) == (double)idx[a]);
            }
            gj_rt_tensor_release(y);
        }
    }
    /* 0-d fill */
    gj_rt_inst f0 = inst_of(GJ_P_FILL, 0);
    f0.scalar = -1;
    gj_tensor *y0 = run1(&f0, NULL);
    assert_int_equal(y0->ndim, 0);
    assert_true(gj_rt_get(y0, 0) == -1.0);
    gj_rt_tensor_release(y0);

    /* dropout: exactly gj_m_dropout_scale of (seed, offset + i) */
    int64_t big[2] = {300, 301};
    for (int d = 0; d < 3; d++) {
        gj_rt_inst in = inst_of(GJ_P_DROPOUT_MASK, 0);
        in.dtype = g_fdt[d];
        in.ndim = 2;
        memcpy(in.shape, big, sizeof big);
        in.scalar = 0.3;
        in.seed = 1234;
        in.rng_offset = 99;
        gj_tensor *y = run1(&in, NULL);
        int64_t zeros = 0;
        for (int64_t i = 0; i < y->numel; i++) {
            double want = g_fdt[d] == GJ_F64
                              ? gj_m_dropout_scale_d(1234, 99 + (uint64_t)i, 0.3)
                              : gj_m_dropout_scale_f(1234, 99 + (uint64_t)i, 0.3f);
            if (g_fdt[d] == GJ_BF16)
                want = gj_m_bf16_to_f32(gj_m_f32_to_bf16((float)want));
            assert_true(gj_rt_get(y, i) == want);
            zeros += want == 0;
        }
        assert_true(fabs((double)zeros / (double)y->numel - 0.3) < 0.01);
        gj_rt_tensor_release(y);
    }
}

/* ------------------------------------------------------------ reductions */

static void test_sum_max(void **state) {
    (void)state;
    int64_t sh[4] = {3, 4, 5, 6};
    char what[160];
    for (int di = 0; di < 4; di++) {
        gj_dtype dt = di < 3 ? g_fdt[di] : GJ_I64;
        for (int L = 0; L < L_COUNT; L++) {
            gj_tensor *x = mk(dt, 4, sh, L, -10, 10);
            double *xv = vals(x);
            for (uint32_t mask = 0; mask < 16; mask++) {
                for (int kd = 0; kd < 2; kd++) {
                    for (int op = 0; op < 2; op++) { /* SUM, MAX */
                        bool is_max = op == 1;
                        if (is_max && (dt == GJ_I64 || mask == 0 || (mask & (mask - 1))))
                            continue;
                        gj_rt_inst in = inst_of(is_max ? GJ_P_MAX : GJ_P_SUM, 1);
                        in.axes = mask;
                        in.keepdim = kd;
                        gj_tensor *y = run1(&in, &x);
                        int64_t osh[4];
                        int on = 0;
                        for (int k = 0; k < 4; k++)
                            if (!(mask & (1u << k)))
                                osh[on++] = sh[k];
                            else if (kd)
                                osh[on++] = 1;
                        assert_true(same_shape(y, on, osh));
                        double *want = calloc((size_t)y->numel, sizeof(double));
                        for (int64_t o = 0; o < y->numel; o++)
                            want[o] = is_max ? -INFINITY : 0;
                        for (int64_t i = 0; i < x->numel; i++) {
                            int64_t r = i, o = 0, mul = 1;
                            for (int k = 3; k >= 0; k--) {
                                int64_t ik = r % sh[k];
                                r /= sh[k];
                                if (!(mask & (1u << k))) {
                                    o += ik * mul;
                                    mul *= sh[k];
                                }
                            }
                            want[o] = is_max ? fmax(want[o], xv[i]) : want[o] + xv[i];
                        }
                        double *yv = vals(y);
                        snprintf(what, sizeof what, "%s mask %u keep %d %s %s",
                                 is_max ? "max" : "sum", mask, kd, gj_rt_dtype_name(dt),
                                 g_lname[L]);
                        double rt = dt == GJ_BF16 ? 8e-3 : dt == GJ_F32 ? 1e-6 : 1e-12;
                        assert_true(gjt_allclose(what, yv, want, y->numel, rt, rt));
                        free(yv);
                        free(want);
                        gj_rt_tensor_release(y);
                    }
                }
            }
            free(xv);
            gj_rt_tensor_release(x);
        }
    }
    /* empty: sum over an empty axis is 0; max of an empty axis is an error */
    int64_t esh[2] = {0, 3};
    gj_tensor *e = mk(GJ_F32, 2, esh, L_CONTIG, 0, 1);
    gj_rt_inst in = inst_of(GJ_P_SUM, 1);
    in.axes = 1;
    gj_tensor *y = run1(&in, &e);
    assert_true(y->numel == 3 && gj_rt_get(y, 0) == 0 && gj_rt_get(y, 2) == 0);
    gj_rt_tensor_release(y);
    gj_rt_inst im = inst_of(GJ_P_MAX, 1);
    im.axes = 1;
    gj_tensor *outs[GJ_RT_MAX_OUTPUTS];
    assert_int_equal(gj_rt_exec(&im, &e, outs), -1);
    GJT_ASSERT_ERROR("max");
    assert_null(outs[0]);
    gj_rt_tensor_release(e);
    /* NaN propagates through max */
    double nv[4] = {1, NAN, 3, 2};
    int64_t nsh[1] = {4};
    gj_tensor *nt = mk_data(GJ_F32, 1, nsh, nv);
    gj_rt_inst im0 = inst_of(GJ_P_MAX, 1);
    im0.axes = 1;
    y = run1(&im0, &nt);
    assert_true(isnan(gj_rt_get(y, 0)));
    gj_rt_tensor_release(y);
    gj_rt_tensor_release(nt);
}

/* Sums do not depend on the thread count (split over outputs only). */
static void test_sum_deterministic(void **state) {
    (void)state;
    int64_t sh[2] = {700, 300};
    gj_tensor *x = mk(GJ_F32, 2, sh, L_CONTIG, -1, 1);
    for (uint32_t mask = 1; mask <= 3; mask++) {
        gj_rt_inst in = inst_of(GJ_P_SUM, 1);
        in.axes = mask;
        gj_rt_set_num_threads(1);
        gj_tensor *a = run1(&in, &x);
        gj_rt_set_num_threads(2);
        gj_tensor *b = run1(&in, &x);
        assert_memory_equal(gj_rt_data_ptr(a), gj_rt_data_ptr(b), (size_t)a->numel * 4);
        gj_rt_tensor_release(a);
        gj_rt_tensor_release(b);
    }
    gj_rt_tensor_release(x);
}

/* -------------------------------------------------------------- movement */

static void test_movement_views(void **state) {
    (void)state;
    int64_t sh[3] = {2, 3, 4};
    for (int di = 0; di < 4; di++) {
        gj_dtype dt = di < 3 ? g_fdt[di] : GJ_I64;
        for (int L = 0; L < L_COUNT; L++) {
            gj_tensor *x = mk(dt, 3, sh, L, -5, 5);
            double *xv = vals(x);
            /* reshape: view iff contiguous, values in row-major order */
            gj_rt_inst r = inst_of(GJ_P_RESHAPE, 1);
            r.ndim = 2;
            r.shape[0] = 4;
            r.shape[1] = 6;
            gj_tensor *y = run1(&r, &x);
            assert_true(same_shape(y, 2, r.shape));
            assert_true((y->storage == x->storage) == gj_rt_is_contiguous(x));
            double *yv = vals(y);
            assert_true(gjt_allclose("reshape", yv, xv, 24, 0, 0));
            free(yv);
            gj_rt_tensor_release(y);
            /* permute (2, 0, 1) */
            gj_rt_inst pm = inst_of(GJ_P_PERMUTE, 1);
            pm.ndim = 3;
            pm.shape[0] = 2;
            pm.shape[1] = 0;
            pm.shape[2] = 1;
            y = run1(&pm, &x);
            assert_true(y->storage == x->storage);
            int64_t psh[3] = {4, 2, 3};
            assert_true(same_shape(y, 3, psh));
            for (int64_t i = 0; i < 24; i++) {
                int64_t a = i / 6, b = (i / 3) % 2, c = i % 3; /* y[a, b, c] = x[b, c, a] */
                assert_true(gj_rt_get(y, i) == xv[b * 12 + c * 4 + a]);
            }
            gj_rt_tensor_release(y);
            /* slice axis -1 [1, 3) */
            gj_rt_inst sl = inst_of(GJ_P_SLICE, 1);
            sl.axis = -1;
            sl.start = 1;
            sl.len = 2;
            y = run1(&sl, &x);
            assert_true(y->storage == x->storage);
            for (int64_t i = 0; i < y->numel; i++)
                assert_true(gj_rt_get(y, i) == xv[(i / 2) * 4 + 1 + i % 2]);
            gj_rt_tensor_release(y);
            /* empty slice */
            sl.start = 4;
            sl.len = 0;
            y = run1(&sl, &x);
            assert_int_equal(y->numel, 0);
            gj_rt_tensor_release(y);
            /* copy: new contiguous storage, same values */
            gj_rt_inst cp = inst_of(GJ_P_COPY, 1);
            y = run1(&cp, &x);
            assert_true(y->storage != x->storage && gj_rt_is_contiguous(y));
            yv = vals(y);
            assert_true(gjt_allclose("copy", yv, xv, 24, 0, 0));
            free(yv);
            gj_rt_tensor_release(y);
            free(xv);
            gj_rt_tensor_release(x);
        }
    }
    /* expand [3, 1] -> [2, 3, 5] */
    int64_t esh[2] = {3, 1};
    gj_tensor *x = mk(GJ_F32, 2, esh, L_CONTIG, -1, 1);
    gj_rt_inst ex = inst_of(GJ_P_EXPAND, 1);
    ex.ndim = 3;
    ex.shape[0] = 2;
    ex.shape[1] = 3;
    ex.shape[2] = 5;
    gj_tensor *y = run1(&ex, &x);
    assert_true(y->storage == x->storage && y->strides[0] == 0 && y->strides[2] == 0);
    for (int64_t i = 0; i < 30; i++)
        assert_true(gj_rt_get(y, i) == gj_rt_get(x, (i / 5) % 3));
    /* reshape of the (non-contiguous) expanded view copies */
    gj_rt_inst r = inst_of(GJ_P_RESHAPE, 1);
    r.ndim = 1;
    r.shape[0] = 30;
    gj_tensor *z = run1(&r, &y);
    assert_true(z->storage != x->storage);
    for (int64_t i = 0; i < 30; i++)
        assert_true(gj_rt_get(z, i) == gj_rt_get(y, i));
    gj_rt_tensor_release(z);
    gj_rt_tensor_release(y);
    gj_rt_tensor_release(x);
}

static void test_pad_cat(void **state) {
    (void)state;
    for (int di = 0; di < 4; di++) {
        gj_dtype dt = di < 3 ? g_fdt[di] : GJ_I64;
        for (int L = 0; L < L_COUNT; L++) {
            int64_t sh[3] = {2, 3, 4};
            gj_tensor *x = mk(dt, 3, sh, L, -5, 5);
            double *xv = vals(x);
            for (int ax = 0; ax < 3; ax++) {
                gj_rt_inst p = inst_of(GJ_P_PAD, 1);
                p.axis = ax;
                p.start = 2;
                p.len = sh[ax] + 3;
                gj_tensor *y = run1(&p, &x);
                int64_t osh[3] = {2, 3, 4};
                osh[ax] = p.len;
                assert_true(same_shape(y, 3, osh));
                for (int64_t i = 0; i < y->numel; i++) {
                    int64_t id[3] = {i / (osh[1] * osh[2]), (i / osh[2]) % osh[1], i % osh[2]};
                    double want = 0;
                    if (id[ax] >= 2 && id[ax] < 2 + sh[ax]) {
                        id[ax] -= 2;
                        want = xv[id[0] * 12 + id[1] * 4 + id[2]];
                    }
                    assert_true(gj_rt_get(y, i) == want);
                }
                gj_rt_tensor_release(y);
            }
            /* cat along axis 1 (as -2) of x, a [2,1,4] and a [2,0,4] piece */
            int64_t s1[3] = {2, 1, 4}, s0[3] = {2, 0, 4};
            gj_tensor *b = mk(dt, 3, s1, L, -5, 5), *e = mk(dt, 3, s0, L_CONTIG, 0, 1);
            gj_tensor *ins[3] = {b, x, e};
            gj_rt_inst c = inst_of(GJ_P_CAT, 3);
            c.axis = -2;
            gj_tensor *y = run1(&c, ins);
            int64_t osh[3] = {2, 4, 4};
            assert_true(same_shape(y, 3, osh));
            for (int64_t i = 0; i < y->numel; i++) {
                int64_t i0 = i / 16, i1 = (i / 4) % 4, i2 = i % 4;
                double want = i1 == 0 ? gj_rt_get(b, i0 * 4 + i2)
                                      : xv[i0 * 12 + (i1 - 1) * 4 + i2];
                assert_true(gj_rt_get(y, i) == want);
            }
            gj_rt_tensor_release(y);
            gj_rt_tensor_release(b);
            gj_rt_tensor_release(e);
            free(xv);
            gj_rt_tensor_release(x);
        }
    }
}

/* ----------------------------------------------------------------- matmul */

typedef struct mm_case {
    int nx, ny;
    int64_t xs[4], ys[4]; /* logical shapes as stored (before ta/tb) */
    bool ta, tb;
} mm_case;

static void test_matmul(void **state) {
    (void)state;
    static const mm_case cases[] = {
        {2, 2, {3, 4}, {4, 5}, false, false},     {2, 2, {4, 3}, {4, 5}, true, false},
        {2, 2, {3, 4}, {5, 4}, false, true},      {2, 2, {4, 3}, {5, 4}, true, true},
        {3, 2, {2, 3, 4}, {4, 5}, false, false},  {3, 3, {2, 3, 4}, {2, 4, 5}, false, false},
        {4, 3, {2, 1, 3, 4}, {3, 4, 5}, false, false},
        {3, 2, {2, 4, 3}, {5, 4}, true, true},    {2, 2, {1, 1}, {1, 1}, false, false},
        {2, 2, {0, 4}, {4, 5}, false, false},     {2, 2, {3, 0}, {0, 5}, false, false},
        {3, 3, {1, 3, 4}, {2, 4, 1}, false, false}, {2, 2, {33, 17}, {17, 29}, false, false},
    };
    char what[160];
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const mm_case *mc = &cases[ci];
        for (int di = 0; di < 3; di++) {
            for (int L = 0; L < L_COUNT; L++) {
                gj_dtype dt = g_fdt[di];
                gj_tensor *x = mk(dt, mc->nx, mc->xs, L, -1, 1);
                gj_tensor *y = mk(dt, mc->ny, mc->ys, (L + 2) % L_COUNT, -1, 1);
                gj_rt_inst in = inst_of(GJ_P_MATMUL, 2);
                in.ta = mc->ta;
                in.tb = mc->tb;
                gj_tensor *ins[2] = {x, y};
                gj_tensor *z = run1(&in, ins);
                int nx = mc->nx, ny = mc->ny;
                int64_t M = mc->ta ? mc->xs[nx - 1] : mc->xs[nx - 2];
                int64_t K = mc->ta ? mc->xs[nx - 2] : mc->xs[nx - 1];
                int64_t N = mc->tb ? mc->ys[ny - 2] : mc->ys[ny - 1];
                int nb;
                int64_t bs[GJ_MAX_DIMS];
                broadcast(nx - 2, mc->xs, ny - 2, mc->ys, &nb, bs);
                bs[nb] = M;
                bs[nb + 1] = N;
                assert_true(same_shape(z, nb + 2, bs));
                double *xv = vals(x), *yv = vals(y), *zv = vals(z), *w = vals(z);
                int64_t nbatch = gj_rt_numel(nb, bs);
                int64_t xr = mc->xs[nx - 2], xc = mc->xs[nx - 1];
                int64_t yr = mc->ys[ny - 2], yc = mc->ys[ny - 1];
                for (int64_t b = 0; b < nbatch; b++) {
                    int64_t xb = bidx(nb, bs, b, nx - 2, mc->xs);
                    int64_t yb = bidx(nb, bs, b, ny - 2, mc->ys);
                    for (int64_t m = 0; m < M; m++)
                        for (int64_t n = 0; n < N; n++) {
                            double s = 0;
                            for (int64_t k = 0; k < K; k++) {
                                double a = mc->ta ? xv[xb * xr * xc + k * xc + m]
                                                  : xv[xb * xr * xc + m * xc + k];
                                double c = mc->tb ? yv[yb * yr * yc + n * yc + k]
                                                  : yv[yb * yr * yc + k * yc + n];
                                s += a * c;
                            }
                            w[(b * M + m) * N + n] = s;
                        }
                }
                snprintf(what, sizeof what, "matmul case %zu %s x:%s", ci, gj_rt_dtype_name(dt),
                         g_lname[L]);
                double rt = dt == GJ_BF16 ? 1e-2 : dt == GJ_F32 ? 1e-5 : 1e-12;
                assert_true(gjt_allclose(what, zv, w, z->numel, rt, rt));
                free(xv);
                free(yv);
                free(zv);
                free(w);
                gj_rt_tensor_release(x);
                gj_rt_tensor_release(y);
                gj_rt_tensor_release(z);
            }
        }
    }
}

/* --------------------------------------------------------------- indexing */

static void test_gather_scatter(void **state) {
    (void)state;
    int64_t tsh[2] = {7, 5}, ish[2] = {3, 4};
    for (int di = 0; di < 3; di++) {
        gj_dtype dt = g_fdt[di];
        for (int L = 0; L < L_COUNT; L++) {
            if (L == L_BCAST)
                continue;
            gj_tensor *tab = mk(dt, 2, tsh, L, -3, 3);
            gj_tensor *idx = mk(GJ_I64, 2, ish, L, 0, 7);
            gj_tensor *ins[2] = {tab, idx};
            gj_rt_inst g = inst_of(GJ_P_GATHER_ROWS, 2);
            gj_tensor *y = run1(&g, ins);
            int64_t osh[3] = {3, 4, 5};
            assert_true(same_shape(y, 3, osh));
            for (int64_t i = 0; i < 12; i++) {
                int64_t r = (int64_t)gj_rt_get(idx, i);
                for (int64_t j = 0; j < 5; j++)
                    assert_true(gj_rt_get(y, i * 5 + j) == gj_rt_get(tab, r * 5 + j));
            }
            /* scatter the gathered rows back: row r gets count(r) * table[r] */
            gj_rt_inst s = inst_of(GJ_P_SCATTER_ADD_ROWS, 2);
            s.len = 7;
            gj_tensor *sin[2] = {y, idx};
            gj_tensor *z = run1(&s, sin);
            assert_true(same_shape(z, 2, tsh));
            for (int64_t r = 0; r < 7; r++) {
                int64_t cnt = 0;
                for (int64_t i = 0; i < 12; i++)
                    cnt += (int64_t)gj_rt_get(idx, i) == r;
                for (int64_t j = 0; j < 5; j++) {
                    double want = (double)cnt * gj_rt_get(tab, r * 5 + j);
                    double got = gj_rt_get(z, r * 5 + j);
                    assert_true(fabs(got - want) <= tol_r(dt) * (1 + fabs(want)));
                }
            }
            gj_rt_tensor_release(z);
            gj_rt_tensor_release(y);
            gj_rt_tensor_release(idx);
            gj_rt_tensor_release(tab);
        }
    }
    /* out-of-range indices: errors naming the index and V, nothing leaked */
    gj_tensor *tab = mk(GJ_F32, 2, tsh, L_CONTIG, 0, 1);
    double bad[3] = {1, 7, 2};
    int64_t b3[1] = {3};
    gj_tensor *idx = mk_data(GJ_I64, 1, b3, bad);
    gj_tensor *outs[GJ_RT_MAX_OUTPUTS];
    gj_rt_inst g = inst_of(GJ_P_GATHER_ROWS, 2);
    gj_tensor *ins[2] = {tab, idx};
    assert_int_equal(gj_rt_exec(&g, ins, outs), -1);
    GJT_ASSERT_ERROR("gather_rows");
    GJT_ASSERT_ERROR("index 7");
    GJT_ASSERT_ERROR("V = 7");
    assert_null(outs[0]);
    int64_t s2[2] = {3, 5};
    gj_tensor *src = mk(GJ_F32, 2, s2, L_CONTIG, 0, 1);
    gj_rt_inst s = inst_of(GJ_P_SCATTER_ADD_ROWS, 2);
    s.len = 7;
    gj_tensor *sin[2] = {src, idx};
    assert_int_equal(gj_rt_exec(&s, sin, outs), -1);
    GJT_ASSERT_ERROR("scatter_add_rows");
    GJT_ASSERT_ERROR("index 7");
    gj_rt_tensor_release(src);
    gj_rt_tensor_release(idx);
    gj_rt_tensor_release(tab);
}

/* -------------------------------------------------------------- composites */

static void ref_softmax_row(const double *x, double *y, int64_t C, bool logsm) {
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < C; i++)
        m = fmax(m, x[i]);
    for (int64_t i = 0; i < C; i++)
        s += exp(x[i] - m);
    for (int64_t i = 0; i < C; i++)
        y[i] = logsm ? x[i] - m - log(s) : exp(x[i] - m) / s;
}

static void test_softmax_family(void **state) {
    (void)state;
    static const int64_t shapes[][3] = {{4, 7, 0}, {2, 3, 50}, {1, 1, 0}, {0, 5, 0}, {3, 1000, 0}};
    static const int nds[] = {2, 3, 2, 2, 2};
    char what[160];
    for (int si = 0; si < 5; si++) {
        int nd = nds[si];
        const int64_t *sh = shapes[si];
        int64_t C = sh[nd - 1];
        for (int di = 0; di < 3; di++) {
            gj_dtype dt = g_fdt[di];
            for (int L = 0; L < L_COUNT; L++) {
                gj_tensor *x = mk(dt, nd, sh, L, -4, 4);
                gj_tensor *gy = mk(dt, nd, sh, (L + 1) % L_COUNT, -1, 1);
                int64_t n = x->numel, R = C ? n / C : 0;
                double *xv = vals(x), *gv = vals(gy);
                double *w = malloc(sizeof(double) * (size_t)(n + 1));
                for (int lg = 0; lg < 2; lg++) {
                    gj_rt_inst in = inst_of(lg ? GJ_P_LOG_SOFTMAX : GJ_P_SOFTMAX, 1);
                    gj_tensor *y = run1(&in, &x);
                    for (int64_t r = 0; r < R; r++)
                        ref_softmax_row(xv + r * C, w + r * C, C, lg);
                    double *yv = vals(y);
                    snprintf(what, sizeof what, "%s %s %s shape#%d", gj_rt_prim_name(in.prim),
                             gj_rt_dtype_name(dt), g_lname[L], si);
                    assert_true(gjt_allclose(what, yv, w, n, tol_a(dt) * 10, tol_r(dt)));
                    /* backward from the kernel's own y (as autograd does) */
                    gj_rt_inst bw = inst_of(lg ? GJ_P_LOG_SOFTMAX_BWD : GJ_P_SOFTMAX_BWD, 2);
                    gj_tensor *bin[2] = {y, gy};
                    gj_tensor *gx = run1(&bw, bin);
                    for (int64_t r = 0; r < R; r++) {
                        double s = 0;
                        for (int64_t i = 0; i < C; i++)
                            s += lg ? gv[r * C + i] : gv[r * C + i] * yv[r * C + i];
                        for (int64_t i = 0; i < C; i++) {
                            double yy = yv[r * C + i], g = gv[r * C + i];
                            w[r * C + i] = lg ? g - exp(yy) * s : yy * (g - s);
                        }
                    }
                    double *gxv = vals(gx);
                    snprintf(what, sizeof what, "%s %s %s shape#%d", gj_rt_prim_name(bw.prim),
                             gj_rt_dtype_name(dt), g_lname[L], si);
                    assert_true(gjt_allclose(what, gxv, w, n, tol_a(dt) * 10, tol_r(dt) * 2));
                    free(gxv);
                    free(yv);
                    gj_rt_tensor_release(gx);
                    gj_rt_tensor_release(y);
                }
                free(w);
                free(xv);
                free(gv);
                gj_rt_tensor_release(x);
                gj_rt_tensor_release(gy);
            }
        }
    }
}

static void test_layer_norm(void **state) {
    (void)state;
    static const int64_t shapes[][3] = {{4, 7, 0}, {2, 3, 64}, {3, 1, 0}, {0, 5, 0}};
    static const int nds[] = {2, 3, 2, 2};
    char what[160];
    for (int si = 0; si < 4; si++) {
        int nd = nds[si];
        const int64_t *sh = shapes[si];
        int64_t C = sh[nd - 1];
        for (int di = 0; di < 3; di++) {
            gj_dtype dt = g_fdt[di];
            for (int L = 0; L < L_COUNT; L++) {
                gj_tensor *x = mk(dt, nd, sh, L, -2, 3);
                gj_rt_inst in = inst_of(GJ_P_LN_FWD, 1);
                in.scalar = 1e-5;
                gj_tensor *outs[GJ_RT_MAX_OUTPUTS];
                assert_int_equal(gj_rt_exec(&in, &x, outs), 3);
                int64_t n = x->numel, R = n / C;
                int64_t ssh[3];
                memcpy(ssh, sh, sizeof ssh);
                ssh[nd - 1] = 1;
                assert_true(same_shape(outs[0], nd, sh) && same_shape(outs[1], nd, ssh) &&
                            same_shape(outs[2], nd, ssh));
                double *xv = vals(x), *xh = vals(outs[0]), *mv = vals(outs[1]),
                       *rv = vals(outs[2]);
                double *w = malloc(sizeof(double) * (size_t)(n + 1));
                double *wm = malloc(sizeof(double) * (size_t)(R + 1));
                double *wr = malloc(sizeof(double) * (size_t)(R + 1));
                for (int64_t r = 0; r < R; r++) {
                    double mu = 0, var = 0;
                    for (int64_t i = 0; i < C; i++)
                        mu += xv[r * C + i];
                    mu /= (double)C;
                    for (int64_t i = 0; i < C; i++)
                        var += (xv[r * C + i] - mu) * (xv[r * C + i] - mu);
                    var /= (double)C;
                    wm[r] = mu;
                    wr[r] = 1 / sqrt(var + 1e-5);
                    for (int64_t i = 0; i < C; i++)
                        w[r * C + i] = (xv[r * C + i] - mu) * wr[r];
                }
                snprintf(what, sizeof what, "ln_fwd %s %s shape#%d", gj_rt_dtype_name(dt),
                         g_lname[L], si);
                double rt = tol_r(dt) * (dt == GJ_BF16 ? 2 : 10);
                assert_true(gjt_allclose(what, xh, w, n, rt, rt));
                assert_true(gjt_allclose(what, mv, wm, R, rt, rt));
                assert_true(gjt_allclose(what, rv, wr, R, rt, rt));

                /* backward with the kernel's own statistics */
                gj_tensor *g = mk(dt, nd, sh, (L + 1) % L_COUNT, -1, 1);
                gj_tensor *bin[4] = {x, outs[1], outs[2], g};
                gj_rt_inst bw = inst_of(GJ_P_LN_BWD, 4);
                gj_tensor *gx = run1(&bw, bin);
                double *gv = vals(g), *gxv = vals(gx);
                for (int64_t r = 0; r < R; r++) {
                    double a = 0, b = 0;
                    for (int64_t i = 0; i < C; i++) {
                        double xhat = (xv[r * C + i] - mv[r]) * rv[r];
                        a += gv[r * C + i];
                        b += gv[r * C + i] * xhat;
                    }
                    a /= (double)C;
                    b /= (double)C;
                    for (int64_t i = 0; i < C; i++) {
                        double xhat = (xv[r * C + i] - mv[r]) * rv[r];
                        w[r * C + i] = rv[r] * (gv[r * C + i] - a - xhat * b);
                    }
                }
                snprintf(what, sizeof what, "ln_bwd %s %s shape#%d", gj_rt_dtype_name(dt),
                         g_lname[L], si);
                assert_true(gjt_allclose(what, gxv, w, n, rt * 10, rt));
                free(gv);
                free(gxv);
                gj_rt_tensor_release(gx);
                gj_rt_tensor_release(g);
                free(xv);
                free(xh);
                free(mv);
                free(rv);
                free(w);
                free(wm);
                free(wr);
                for (int k = 0; k < 3; k++)
                    gj_rt_tensor_release(outs[k]);
                gj_rt_tensor_release(x);
            }
        }
    }
}

static void test_cross_entropy(void **state) {
    (void)state;
    static const int64_t NK[][2] = {{5, 7}, {1, 1}, {64, 300}, {0, 4}};
    char what[160];
    for (int si = 0; si < 4; si++) {
        int64_t N = NK[si][0], K = NK[si][1];
        for (int di = 0; di < 3; di++) {
            gj_dtype dt = g_fdt[di];
            for (int L = 0; L < L_COUNT; L++) {
                gj_tensor *x = mk(dt, 2, NK[si], L, -5, 5);
                gj_tensor *lab = mk(GJ_I64, 1, &N, L_CONTIG, 0, (double)K);
                gj_tensor *ins[2] = {x, lab}, *outs[GJ_RT_MAX_OUTPUTS];
                gj_rt_inst in = inst_of(GJ_P_CE_FWD, 2);
                assert_int_equal(gj_rt_exec(&in, ins, outs), 2);
                assert_int_equal(outs[0]->ndim, 0);
                assert_true(same_shape(outs[1], 1, &N));
                double *xv = vals(x), *lse = malloc(sizeof(double) * (size_t)(N + 1)), loss = 0;
                for (int64_t r = 0; r < N; r++) {
                    double m = -INFINITY, s = 0;
                    for (int64_t i = 0; i < K; i++)
                        m = fmax(m, xv[r * K + i]);
                    for (int64_t i = 0; i < K; i++)
                        s += exp(xv[r * K + i] - m);
                    lse[r] = m + log(s);
                    loss += lse[r] - xv[r * K + (int64_t)gj_rt_get(lab, r)];
                }
                loss /= (double)N;
                double *lv = vals(outs[1]), got = gj_rt_get(outs[0], 0);
                snprintf(what, sizeof what, "ce_fwd %s %s N=%lld", gj_rt_dtype_name(dt),
                         g_lname[L], (long long)N);
                assert_true(gjt_allclose(what, lv, lse, N, tol_r(dt), tol_r(dt)));
                if (N == 0)
                    assert_true(isnan(got));
                else
                    assert_true(gjt_allclose(what, &got, &loss, 1, tol_r(dt), tol_r(dt)));
                /* backward with g = 1.7 */
                gj_tensor *g = mk_data(dt, 0, NULL, (double[]){1.7});
                gj_tensor *bin[4] = {x, outs[1], lab, g};
                gj_rt_inst bw = inst_of(GJ_P_CE_BWD, 4);
                gj_tensor *gx = run1(&bw, bin);
                assert_true(same_shape(gx, 2, NK[si]));
                double *gxv = vals(gx), *w = malloc(sizeof(double) * (size_t)(N * K + 1));
                double gs = gj_rt_get(g, 0);
                for (int64_t r = 0; r < N; r++)
                    for (int64_t i = 0; i < K; i++)
                        w[r * K + i] = (exp(xv[r * K + i] - lv[r]) -
                                        (i == (int64_t)gj_rt_get(lab, r) ? 1 : 0)) *
                                       gs / (double)N;
                snprintf(what, sizeof what, "ce_bwd %s %s N=%lld", gj_rt_dtype_name(dt),
                         g_lname[L], (long long)N);
                assert_true(gjt_allclose(what, gxv, w, N * K, tol_a(dt), tol_r(dt) * 2));
                free(gxv);
                free(w);
                free(xv);
                free(lv);
                free(lse);
                gj_rt_tensor_release(gx);
                gj_rt_tensor_release(g);
                gj_rt_tensor_release(outs[0]);
                gj_rt_tensor_release(outs[1]);
                gj_rt_tensor_release(lab);
                gj_rt_tensor_release(x);
            }
        }
    }
    /* a bad label: error naming it and K, nothing leaked */
    int64_t sh[2] = {3, 4}, n3 = 3;
    gj_tensor *x = mk(GJ_F32, 2, sh, L_CONTIG, 0, 1);
    gj_tensor *lab = mk_data(GJ_I64, 1, &n3, (double[]){0, 4, 1});
    gj_tensor *ins[2] = {x, lab}, *outs[GJ_RT_MAX_OUTPUTS];
    gj_rt_inst in = inst_of(GJ_P_CE_FWD, 2);
    assert_int_equal(gj_rt_exec(&in, ins, outs), -1);
    GJT_ASSERT_ERROR("ce_fwd");
    GJT_ASSERT_ERROR("label 4");
    GJT_ASSERT_ERROR("K = 4");
    assert_null(outs[0]);
    assert_null(outs[1]);
    gj_rt_tensor_release(lab);
    lab = mk_data(GJ_I64, 1, &n3, (double[]){0, -1, 1});
    gj_tensor *lse = mk(GJ_F32, 1, &n3, L_CONTIG, 0, 1);
    gj_tensor *g = mk_data(GJ_F32, 0, NULL, (double[]){1});
    gj_tensor *bin[4] = {x, lse, lab, g};
    gj_rt_inst bw = inst_of(GJ_P_CE_BWD, 4);
    assert_int_equal(gj_rt_exec(&bw, bin, outs), -1);
    GJT_ASSERT_ERROR("ce_bwd");
    GJT_ASSERT_ERROR("label -1");
    gj_rt_tensor_release(g);
    gj_rt_tensor_release(lse);
    gj_rt_tensor_release(lab);
    gj_rt_tensor_release(x);
}

/* ------------------------------------------------------------- infer errors */

static gj_rt_meta meta(gj_dtype dt, int nd, const int64_t *sh) {
    gj_rt_meta m;
    memset(&m, 0, sizeof m);
    m.dtype = dt;
    m.ndim = nd;
    for (int k = 0; k < nd; k++)
        m.shape[k] = sh[k];
    return m;
}

/* Asserts gj_rt_infer rejects inst with an error naming the primitive and
 * containing `also` (if not NULL). */
static void expect_bad(const gj_rt_inst *inst, const gj_rt_meta *in, const char *also) {
    gj_rt_meta out[GJ_RT_MAX_OUTPUTS];
    gj_clear_error();
    if (gj_rt_infer(inst, in, out) != -1) {
        print_error("%s: expected a shape/dtype error\n", gj_rt_prim_name(inst->prim));
        fail();
    }
    GJT_ASSERT_ERROR(gj_rt_prim_name(inst->prim));
    if (also)
        GJT_ASSERT_ERROR(also);
}

static void test_infer_errors(void **state) {
    (void)state;
    int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s4[1] = {4}, s234[3] = {2, 3, 4}, s3[1] = {3};
    gj_rt_meta f23 = meta(GJ_F32, 2, s23), d23 = meta(GJ_F64, 2, s23), f4 = meta(GJ_F32, 1, s4);
    gj_rt_meta i23 = meta(GJ_I64, 2, s23), f32m = meta(GJ_F32, 2, s32);
    gj_rt_meta f234 = meta(GJ_F32, 3, s234), i3 = meta(GJ_I64, 1, s3), f3 = meta(GJ_F32, 1, s3);

    gj_rt_inst u = inst_of(GJ_P_TANH, 1);
    expect_bad(&u, &i23, "i64"); /* unary needs float */
    u.n_in = 2;
    expect_bad(&u, (gj_rt_meta[]){f23, f23}, "1 input");

    gj_rt_inst b = inst_of(GJ_P_ADD, 2);
    expect_bad(&b, (gj_rt_meta[]){f23, f4}, "broadcast");
    expect_bad(&b, (gj_rt_meta[]){f23, d23}, "dtype mismatch");
    gj_rt_inst w = inst_of(GJ_P_WHERE, 3);
    expect_bad(&w, (gj_rt_meta[]){i23, f23, d23}, "dtype");
    expect_bad(&w, (gj_rt_meta[]){f4, f23, f23}, "broadcast");

    gj_rt_inst c = inst_of(GJ_P_CAST, 1);
    c.dtype = (gj_dtype)9;
    expect_bad(&c, &f23, "dtype");
    gj_rt_inst fl = inst_of(GJ_P_FILL, 0);
    fl.ndim = 1;
    fl.shape[0] = -2;
    expect_bad(&fl, NULL, NULL);
    gj_rt_inst dm = inst_of(GJ_P_DROPOUT_MASK, 0);
    dm.scalar = 1.5;
    expect_bad(&dm, NULL, "1.5");
    gj_rt_inst io = inst_of(GJ_P_IOTA, 0);
    io.ndim = 2;
    io.shape[0] = io.shape[1] = 2;
    io.axis = 2;
    expect_bad(&io, NULL, "axis");

    gj_rt_inst s = inst_of(GJ_P_SUM, 1);
    s.axes = 1u << 2;
    expect_bad(&s, &f23, "out of range");
    gj_rt_inst m = inst_of(GJ_P_MAX, 1);
    m.axes = 3;
    expect_bad(&m, &f23, "one axis");

    gj_rt_inst r = inst_of(GJ_P_RESHAPE, 1);
    r.ndim = 1;
    r.shape[0] = 5;
    expect_bad(&r, &f23, "6 elements");
    gj_rt_inst p = inst_of(GJ_P_PERMUTE, 1);
    p.ndim = 2;
    p.shape[0] = p.shape[1] = 1;
    expect_bad(&p, &f23, "permutation");
    gj_rt_inst e = inst_of(GJ_P_EXPAND, 1);
    e.ndim = 2;
    e.shape[0] = 2;
    e.shape[1] = 4;
    expect_bad(&e, &f23, "expand");
    gj_rt_inst sl = inst_of(GJ_P_SLICE, 1);
    sl.axis = 1;
    sl.start = 2;
    sl.len = 2;
    expect_bad(&sl, &f23, "out of range");
    sl.axis = 5;
    expect_bad(&sl, &f23, "axis 5");
    gj_rt_inst pd = inst_of(GJ_P_PAD, 1);
    pd.axis = 0;
    pd.start = 1;
    pd.len = 2;
    expect_bad(&pd, &f23, NULL);
    gj_rt_inst ct = inst_of(GJ_P_CAT, 2);
    ct.axis = 0;
    expect_bad(&ct, (gj_rt_meta[]){f23, f234}, "incompatible");
    expect_bad(&ct, (gj_rt_meta[]){f23, d23}, "dtype");
    ct.n_in = 0;
    expect_bad(&ct, NULL, NULL);

    gj_rt_inst mm = inst_of(GJ_P_MATMUL, 2);
    expect_bad(&mm, (gj_rt_meta[]){f23, f23}, "inner dimensions");
    expect_bad(&mm, (gj_rt_meta[]){f4, f4}, "rank");
    expect_bad(&mm, (gj_rt_meta[]){f23, meta(GJ_F64, 2, s32)}, "dtype");
    gj_rt_meta b2 = meta(GJ_F32, 3, (int64_t[]){2, 3, 2}), b3 = meta(GJ_F32, 3, (int64_t[]){3, 2, 2});
    expect_bad(&mm, (gj_rt_meta[]){b2, b3}, "batch");
    mm.tb = true;
    expect_bad(&mm, (gj_rt_meta[]){f23, f32m}, "inner dimensions");

    gj_rt_inst g = inst_of(GJ_P_GATHER_ROWS, 2);
    expect_bad(&g, (gj_rt_meta[]){f23, f3}, "i64");
    expect_bad(&g, (gj_rt_meta[]){f234, i3}, "2-D");
    gj_rt_inst sc = inst_of(GJ_P_SCATTER_ADD_ROWS, 2);
    sc.len = 4;
    expect_bad(&sc, (gj_rt_meta[]){f23, meta(GJ_I64, 1, s3)}, "index shape");

    gj_rt_inst sm = inst_of(GJ_P_SOFTMAX, 1);
    expect_bad(&sm, &i23, NULL);
    expect_bad(&sm, (gj_rt_meta[]){meta(GJ_F32, 0, NULL)}, "rank");
    gj_rt_inst sb = inst_of(GJ_P_SOFTMAX_BWD, 2);
    expect_bad(&sb, (gj_rt_meta[]){f23, f32m}, "same shape");
    gj_rt_inst lf = inst_of(GJ_P_LN_FWD, 1);
    lf.scalar = -1;
    expect_bad(&lf, &f23, "eps");
    gj_rt_inst lb = inst_of(GJ_P_LN_BWD, 4);
    expect_bad(&lb, (gj_rt_meta[]){f23, f23, f23, f23}, "mean and rstd");
    gj_rt_inst cf = inst_of(GJ_P_CE_FWD, 2);
    expect_bad(&cf, (gj_rt_meta[]){f32m, meta(GJ_F32, 1, s3)}, "labels must be i64");
    expect_bad(&cf, (gj_rt_meta[]){f23, i3}, "labels must have shape");
    expect_bad(&cf, (gj_rt_meta[]){f234, i3}, "2-D");
    gj_rt_inst cb = inst_of(GJ_P_CE_BWD, 4);
    expect_bad(&cb, (gj_rt_meta[]){f32m, f3, i3, f3}, "0-d");

    /* exec reports infer errors too, with nothing allocated */
    gj_tensor *t = mk(GJ_F32, 2, s23, L_CONTIG, 0, 1), *t4 = mk(GJ_F32, 1, s4, L_CONTIG, 0, 1);
    gj_tensor *outs[GJ_RT_MAX_OUTPUTS];
    gj_tensor *bin[2] = {t, t4};
    assert_int_equal(gj_rt_exec(&b, bin, outs), -1);
    GJT_ASSERT_ERROR("add");
    GJT_ASSERT_ERROR("[2, 3]");
    GJT_ASSERT_ERROR("[4]");
    assert_null(outs[0]);
    gj_tensor *nul[2] = {t, NULL};
    assert_int_equal(gj_rt_exec(&b, nul, outs), -1);
    GJT_ASSERT_ERROR("add");
    gj_rt_tensor_release(t);
    gj_rt_tensor_release(t4);
    assert_string_equal(gj_rt_prim_name(GJ_P_GELU_GRAD), "gelu_grad");
    assert_string_equal(gj_rt_prim_name(GJ_P_CE_BWD), "ce_bwd");
}

/* Allocation failure inside exec leaks nothing and reports an error. */
static void test_exec_oom(void **state) {
    (void)state;
    int64_t sh[2] = {4, 6};
    gj_tensor *x = mk(GJ_BF16, 2, sh, L_TRANS, -1, 1), *y = mk(GJ_BF16, 2, sh, L_CONTIG, -1, 1);
    gj_rt_inst mm = inst_of(GJ_P_MATMUL, 2);
    mm.tb = true;
    gj_rt_inst ln = inst_of(GJ_P_LN_FWD, 1);
    const gj_rt_inst *insts[2] = {&mm, &ln};
    for (int k = 0; k < 2; k++) {
        gj_tensor *ins[2] = {x, y}, *outs[GJ_RT_MAX_OUTPUTS];
        for (int64_t n = 1; n < 40; n++) {
            int64_t live = gjt_live_bytes();
            gj_rt_alloc_fail_at(n);
            int rc = gj_rt_exec(insts[k], ins, outs);
            gj_rt_alloc_fail_at(0);
            if (rc < 0) {
                assert_true(gj_last_error()[0] != '\0');
                assert_true(gjt_live_bytes() == live);
            } else {
                for (int j = 0; j < rc; j++)
                    gj_rt_tensor_release(outs[j]);
                break;
            }
        }
    }
    gj_rt_tensor_release(x);
    gj_rt_tensor_release(y);
}

int main(void) {
    gjt_rng_seed(&g_rng, 20240601);
    gj_rt_set_num_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_unary, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unary_large_bitexact, setup, teardown),
        cmocka_unit_test_setup_teardown(test_binary, setup, teardown),
        cmocka_unit_test_setup_teardown(test_eq_exact, setup, teardown),
        cmocka_unit_test_setup_teardown(test_where, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cast, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fill_iota_dropout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sum_max, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sum_deterministic, setup, teardown),
        cmocka_unit_test_setup_teardown(test_movement_views, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pad_cat, setup, teardown),
        cmocka_unit_test_setup_teardown(test_matmul, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gather_scatter, setup, teardown),
        cmocka_unit_test_setup_teardown(test_softmax_family, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layer_norm, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cross_entropy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_infer_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_exec_oom, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
