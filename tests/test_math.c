/* SPDX-License-Identifier: MIT */
/*
 * test_math.c - accuracy of the scalar math (runtime/gj_math.h) against
 * libm, and the embedded bitcode of runtime/math_bc.c.
 *
 * Invariants:
 *   - Float functions are swept over every GJT_STEP-th float bit pattern of
 *     [-100, 100] (log: of all positive floats, subnormals included) against
 *     double-precision references; double functions over a dense bit-pattern
 *     sample against long double references. The bounds asserted here are
 *     the ones written in gj_math.h.
 *   - Under the sanitizers the sweep is 10x sparser (same bounds) to keep
 *     the suite fast.
 */
#include "gjtest.h"
#include "runtime/gj_math.h"
#include "runtime/rt.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define GJT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GJT_SANITIZED 1
#endif
#endif
#ifdef GJT_SANITIZED
#define GJT_STEP 977u
#define GJT_DSAMPLES 300000u
#else
#define GJT_STEP 97u
#define GJT_DSAMPLES 1000000u
#endif

#include <llvm-c/BitReader.h>
#include <llvm-c/Core.h>

/* ------------------------------------------------------------ helpers */

static float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static double d_of(uint64_t u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}
static uint32_t bits_f(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* One float ulp at |r| (subnormal spacing below FLT_MIN). */
static double ulp_f(double r) {
    r = fabs(r);
    if (r < FLT_MIN)
        return ldexp(1.0, -149);
    int e;
    frexp(r, &e);
    return ldexp(1.0, e - 24);
}

static double sig_ref(double z) { return z >= 0 ? 1 / (1 + exp(-z)) : exp(z) / (1 + exp(z)); }
static double gelu_ref(double x) {
    double z = x * (GJ_M_GELU_C1 + GJ_M_GELU_C2 * x * x);
    return x * sig_ref(z);
}
static double gelu_grad_ref(double x) {
    double z = x * (GJ_M_GELU_C1 + GJ_M_GELU_C2 * x * x);
    double s = sig_ref(z), sm = sig_ref(-z);
    return s + x * s * sm * (GJ_M_GELU_C1 + GJ_M_GELU_C3 * x * x);
}
static long double sig_ref_l(long double z) {
    return z >= 0 ? 1 / (1 + expl(-z)) : expl(z) / (1 + expl(z));
}

/* Accumulates the worst error of one function. */
typedef struct gjt_acc {
    const char *name;
    double worst; /* in the unit of the bound */
    double at;
    long bad;
} gjt_acc;

static void acc_add(gjt_acc *a, double err, double x, double bound) {
    if (err > a->worst) {
        a->worst = err;
        a->at = x;
    }
    if (!(err <= bound))
        a->bad++;
}

static void acc_report(const gjt_acc *a, double bound, const char *unit) {
    printf("  %-22s worst %.4g %s at %a (bound %.3g)\n", a->name, a->worst, unit, a->at, bound);
    if (a->bad) {
        print_error("%s: %ld points beyond %.3g %s\n", a->name, a->bad, bound, unit);
        fail();
    }
}

/* Same float special value (both NaN, or equal including the sign of 0). */
static bool same_f(float a, float b) {
    if (a != a || b != b)
        return a != a && b != b;
    return bits_f(a) == bits_f(b) || (a == b && a != 0);
}

/* -------------------------------------------------------- float sweeps */

static void test_float_sweep(void **state) {
    (void)state;
    gjt_acc e = {"exp_f (ulp)", 0, 0, 0}, es = {"exp_f subnormal (abs)", 0, 0, 0};
    gjt_acc th = {"tanh_f (ulp)", 0, 0, 0}, sg = {"sigmoid_f (ulp)", 0, 0, 0};
    gjt_acc ge = {"gelu_f (mixed)", 0, 0, 0}, gg = {"gelu_grad_f (mixed)", 0, 0, 0};
    gjt_acc sq = {"sqrt_f (ulp)", 0, 0, 0}, rs = {"rsqrt_f (ulp)", 0, 0, 0};
    const uint32_t lim = bits_f(100.0f);
    for (uint32_t b = 0; b <= lim; b += GJT_STEP) {
        for (int s = 0; s < 2; s++) {
            float x = f_of(b | (s ? 0x80000000u : 0u));
            double xd = x, r, f;

            r = exp(xd);
            f = gj_m_exp_f(x);
            if (r >= FLT_MIN && r <= FLT_MAX)
                acc_add(&e, fabs(f - r) / ulp_f(r), xd, 1.0);
            else if (r < FLT_MIN)
                acc_add(&es, fabs(f - r), xd, 0x1p-149);
            else if (!(f > FLT_MAX)) /* overflow must be inf */
                acc_add(&e, INFINITY, xd, 1.0);

            r = tanh(xd);
            acc_add(&th, fabs(gj_m_tanh_f(x) - r) / ulp_f(r), xd, 2.0);

            r = sig_ref(xd);
            if (r >= FLT_MIN)
                acc_add(&sg, fabs(gj_m_sigmoid_f(x) - r) / ulp_f(r), xd, 3.0);

            /* gelu: |err| <= 1.5e-6 |ref| + 2e-10, reported in units of it */
            r = gelu_ref(xd);
            acc_add(&ge, fabs(gj_m_gelu_f(x) - r) / (1.5e-6 * fabs(r) + 2e-10), xd, 1.0);
            r = gelu_grad_ref(xd);
            acc_add(&gg, fabs(gj_m_gelu_grad_f(x) - r) / (1e-6 * fabs(r) + 6e-8), xd, 1.0);

            if (s == 0 && x > 0) {
                r = sqrt(xd);
                acc_add(&sq, fabs(gj_m_sqrt_f(x) - r) / ulp_f(r), xd, 0.5);
                r = 1.0 / sqrt(xd);
                acc_add(&rs, fabs(gj_m_rsqrt_f(x) - r) / ulp_f(r), xd, 2.0);
            }
        }
    }
    printf("float sweep, every %u-th bit pattern of [-100, 100]:\n", GJT_STEP);
    acc_report(&e, 1.0, "ulp");
    acc_report(&es, 0x1p-149, "abs");
    acc_report(&th, 2.0, "ulp");
    acc_report(&sg, 3.0, "ulp");
    acc_report(&ge, 1.0, "x bound");
    acc_report(&gg, 1.0, "x bound");
    acc_report(&sq, 0.5, "ulp");
    acc_report(&rs, 2.0, "ulp");
}

static void test_float_log_sweep(void **state) {
    (void)state;
    gjt_acc l = {"log_f (ulp)", 0, 0, 0};
    for (uint32_t b = 1; b < 0x7f800000u; b += GJT_STEP) {
        float x = f_of(b);
        double r = log((double)x);
        acc_add(&l, fabs(gj_m_log_f(x) - r) / ulp_f(r), x, 1.0);
    }
    /* around 1, where log is small: the relative accuracy must hold too */
    for (uint32_t b = bits_f(0.5f); b < bits_f(2.0f); b += 7) {
        float x = f_of(b);
        double r = log((double)x);
        if (r != 0)
            acc_add(&l, fabs(gj_m_log_f(x) - r) / ulp_f(r), x, 1.0);
    }
    printf("log_f over all positive floats (step %u) and [0.5, 2) (step 7):\n", GJT_STEP);
    acc_report(&l, 1.0, "ulp");
}

static void test_float_specials(void **state) {
    (void)state;
    const float inf = INFINITY, nan = NAN;
    assert_true(same_f(gj_m_exp_f(inf), inf));
    assert_true(same_f(gj_m_exp_f(-inf), 0.0f));
    assert_true(same_f(gj_m_exp_f(nan), nan));
    assert_true(same_f(gj_m_exp_f(89.0f), inf));
    assert_true(same_f(gj_m_exp_f(-200.0f), 0.0f));
    assert_true(same_f(gj_m_exp_f(0.0f), 1.0f));
    assert_true(gj_m_exp_f(-103.0f) > 0.0f); /* subnormal range reached */
    assert_true(same_f(gj_m_log_f(0.0f), -inf));
    assert_true(same_f(gj_m_log_f(-0.0f), -inf));
    assert_true(same_f(gj_m_log_f(-1.0f), nan));
    assert_true(same_f(gj_m_log_f(inf), inf));
    assert_true(same_f(gj_m_log_f(nan), nan));
    assert_true(same_f(gj_m_log_f(1.0f), 0.0f));
    assert_true(fabs(gj_m_log_f(f_of(1)) - log(0x1p-149)) < 1e-4); /* smallest subnormal */
    assert_true(same_f(gj_m_tanh_f(inf), 1.0f));
    assert_true(same_f(gj_m_tanh_f(-inf), -1.0f));
    assert_true(same_f(gj_m_tanh_f(-0.0f), -0.0f));
    assert_true(same_f(gj_m_tanh_f(nan), nan));
    assert_true(same_f(gj_m_tanh_f(1e30f), 1.0f));
    assert_true(same_f(gj_m_sigmoid_f(inf), 1.0f));
    assert_true(same_f(gj_m_sigmoid_f(-inf), 0.0f));
    assert_true(same_f(gj_m_sigmoid_f(nan), nan));
    assert_true(same_f(gj_m_sigmoid_f(0.0f), 0.5f));
    assert_true(same_f(gj_m_gelu_f(inf), inf));
    assert_true(gj_m_gelu_f(-inf) == 0.0f);
    assert_true(same_f(gj_m_gelu_f(nan), nan));
    assert_true(same_f(gj_m_gelu_f(1e30f), 1e30f));
    assert_true(gj_m_gelu_f(-1e30f) == 0.0f);
    assert_true(same_f(gj_m_gelu_grad_f(inf), 1.0f));
    assert_true(gj_m_gelu_grad_f(-inf) == 0.0f);
    assert_true(same_f(gj_m_gelu_grad_f(nan), nan));
    assert_true(fabs(gj_m_gelu_grad_f(0.0f) - 0.5f) < 1e-7);
    assert_true(same_f(gj_m_relu_f(-2.0f), 0.0f));
    assert_true(same_f(gj_m_relu_f(3.0f), 3.0f));
    assert_true(same_f(gj_m_relu_f(nan), nan));
    assert_true(same_f(gj_m_step_f(2.0f), 1.0f));
    assert_true(same_f(gj_m_step_f(0.0f), 0.0f));
    assert_true(same_f(gj_m_step_f(nan), 0.0f));
    assert_true(same_f(gj_m_pow_f(-3.0f, 2.0f), 9.0f));
    assert_true(same_f(gj_m_pow_f(-2.0f, 3.0f), -8.0f));
    assert_true(same_f(gj_m_pow_f(4.0f, 0.5f), 2.0f));
    assert_true(same_f(gj_m_pow_f(4.0f, -1.0f), 0.25f));
    assert_true(fabs(gj_m_pow_f(2.0f, 1.5f) - 2.8284271f) < 1e-6);
    assert_true(gj_m_pow_d(2.0, -0.5) == pow(2.0, -0.5));
    assert_true(gj_m_exp_d(INFINITY) == INFINITY && gj_m_exp_d(-INFINITY) == 0.0);
    assert_true(gj_m_exp_d(710.0) == INFINITY && gj_m_exp_d(-800.0) == 0.0);
    assert_true(gj_m_exp_d(-745.0) > 0.0);
    assert_true(isnan(gj_m_exp_d(NAN)) && isnan(gj_m_log_d(-1.0)) && isnan(gj_m_log_d(NAN)));
    assert_true(gj_m_log_d(0.0) == -INFINITY && gj_m_log_d(INFINITY) == INFINITY);
    assert_true(fabs(gj_m_log_d(d_of(1)) - (-744.44007192138126)) < 1e-12);
    assert_true(gj_m_tanh_d(INFINITY) == 1.0 && gj_m_tanh_d(-INFINITY) == -1.0);
    assert_true(gj_m_tanh_d(-0.0) == 0.0 && signbit(gj_m_tanh_d(-0.0)));
    assert_true(gj_m_sigmoid_d(-INFINITY) == 0.0 && gj_m_sigmoid_d(INFINITY) == 1.0);
    assert_true(gj_m_gelu_d(-INFINITY) == 0.0 && gj_m_gelu_d(INFINITY) == INFINITY);
    assert_true(gj_m_gelu_grad_d(-INFINITY) == 0.0 && gj_m_gelu_grad_d(INFINITY) == 1.0);
    assert_true(isnan(gj_m_gelu_d(NAN)) && isnan(gj_m_gelu_grad_d(NAN)) &&
                isnan(gj_m_tanh_d(NAN)) && isnan(gj_m_sigmoid_d(NAN)));
}

/* -------------------------------------------------------- double sweeps */

static void test_double_sweep(void **state) {
    (void)state;
    gjt_acc e = {"exp_d (rel)", 0, 0, 0}, th = {"tanh_d (rel)", 0, 0, 0};
    gjt_acc sg = {"sigmoid_d (rel)", 0, 0, 0}, ge = {"gelu_d (mixed)", 0, 0, 0};
    gjt_acc gg = {"gelu_grad_d (mixed)", 0, 0, 0}, l = {"log_d (rel)", 0, 0, 0};
    uint64_t lim;
    double h = 100.0;
    memcpy(&lim, &h, 8);
    uint64_t step = lim / GJT_DSAMPLES;
    for (uint64_t b = 0; b <= lim; b += step) {
        for (int s = 0; s < 2; s++) {
            double x = d_of(b | (s ? 0x8000000000000000ull : 0));
            long double X = x, r;
            r = expl(X);
            if (r >= DBL_MIN && r <= DBL_MAX)
                acc_add(&e, (double)fabsl((gj_m_exp_d(x) - r) / r), x, 4e-16);
            r = tanhl(X);
            if (fabsl(r) >= DBL_MIN)
                acc_add(&th, (double)fabsl((gj_m_tanh_d(x) - r) / r), x, 6e-16);
            r = sig_ref_l(X);
            if (r >= DBL_MIN)
                acc_add(&sg, (double)fabsl((gj_m_sigmoid_d(x) - r) / r), x, 6e-16);
            long double z = X * (GJ_M_GELU_C1 + GJ_M_GELU_C2 * X * X);
            long double sz = sig_ref_l(z), smz = sig_ref_l(-z);
            r = X * sz;
            acc_add(&ge, (double)(fabsl(gj_m_gelu_d(x) - r) / (4e-15L * fabsl(r) + 2e-18L)), x,
                    1.0);
            r = sz + X * sz * smz * (GJ_M_GELU_C1 + GJ_M_GELU_C3 * X * X);
            acc_add(&gg, (double)(fabsl(gj_m_gelu_grad_d(x) - r) / (4e-15L * fabsl(r) + 1e-16L)),
                    x, 1.0);
        }
    }
    uint64_t linf = 0x7ff0000000000000ull, lstep = linf / GJT_DSAMPLES;
    for (uint64_t b = 1; b < linf; b += lstep) {
        double x = d_of(b);
        long double r = logl((long double)x);
        if (r != 0)
            acc_add(&l, (double)fabsl((gj_m_log_d(x) - r) / r), x, 4e-16);
    }
    for (int i = -200000; i <= 200000; i++) { /* near 1 */
        double x = 1.0 + i * 1e-6;
        long double r = logl((long double)x);
        if (r != 0)
            acc_add(&l, (double)fabsl((gj_m_log_d(x) - r) / r), x, 4e-16);
    }
    printf("double sample, %u bit patterns per sign of [-100, 100] and of (0, inf):\n",
           GJT_DSAMPLES);
    acc_report(&e, 4e-16, "rel");
    acc_report(&th, 6e-16, "rel");
    acc_report(&sg, 6e-16, "rel");
    acc_report(&ge, 1.0, "x bound");
    acc_report(&gg, 1.0, "x bound");
    acc_report(&l, 4e-16, "rel");
}

/* ---------------------------------------------------------------- bf16 */

/* Reference f32 -> bf16: round to nearest even by arithmetic on doubles. */
static uint16_t bf16_ref(float f) {
    uint32_t u = bits_f(f);
    if (f != f)
        return (uint16_t)((u >> 16) | 0x40u);
    if (isinf(f))
        return (uint16_t)(u >> 16);
    uint32_t lo = u & 0xffff0000u;
    double a = f_of(lo), b; /* truncation toward zero, and the next one away */
    if ((lo & 0x7fffffffu) == 0x7f7f0000u)
        b = copysign(ldexp(1.0, 128), (double)f); /* one bf16 step above max: inf */
    else
        b = f_of(lo + 0x10000u);
    double d = f, da = fabs(d - a), db = fabs(b - d);
    uint32_t pick = da < db ? lo : da > db ? lo + 0x10000u : (((lo >> 16) & 1u) ? lo + 0x10000u : lo);
    return (uint16_t)(pick >> 16);
}

static void test_bf16(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++)
        assert_true(bits_f(gj_m_bf16_to_f32((uint16_t)h)) == h << 16);
    long bad = 0;
    for (uint32_t b = 0; b < 0xffffffffu - GJT_STEP; b += GJT_STEP) {
        float f = f_of(b);
        if (gj_m_f32_to_bf16(f) != bf16_ref(f))
            bad++;
    }
    assert_int_equal(bad, 0);
    /* ties to even, overflow, NaN */
    assert_int_equal(gj_m_f32_to_bf16(f_of(0x3f808000u)), 0x3f80); /* tie, even stays */
    assert_int_equal(gj_m_f32_to_bf16(f_of(0x3f818000u)), 0x3f82); /* tie, odd rounds up */
    assert_int_equal(gj_m_f32_to_bf16(f_of(0x3f808001u)), 0x3f81);
    assert_int_equal(gj_m_f32_to_bf16(FLT_MAX), 0x7f80);          /* rounds to inf */
    assert_int_equal(gj_m_f32_to_bf16(-INFINITY), 0xff80);
    assert_true((gj_m_f32_to_bf16(f_of(0x7f800001u)) & 0x7fffu) > 0x7f80u); /* sNaN stays NaN */
    assert_true((gj_m_f32_to_bf16(f_of(0xffc00000u)) & 0x7fffu) > 0x7f80u);
    assert_int_equal(gj_m_f32_to_bf16(-0.0f), 0x8000);
}

/* ----------------------------------------------------------------- rng */

static void test_rng(void **state) {
    (void)state;
    const int n = 1 << 20;
    double s = 0, s2 = 0;
    float lo = 1, hi = 0;
    for (int i = 0; i < n; i++) {
        float u = gj_m_rng_u01(42, (uint64_t)i);
        assert_true(u >= 0.0f && u < 1.0f);
        s += u;
        s2 += (double)u * u;
        lo = u < lo ? u : lo;
        hi = u > hi ? u : hi;
    }
    double mean = s / n, var = s2 / n - mean * mean;
    printf("  rng_u01: mean %.5f var %.5f (1/12 = %.5f), min %.9g max %.9g\n", mean, var, 1.0 / 12,
           lo, hi);
    assert_true(fabs(mean - 0.5) < 0.002);
    assert_true(fabs(var - 1.0 / 12) < 0.002);
    assert_true(lo < 1e-5 && hi > 1 - 1e-5);
    /* pure function; seeds and counters decorrelate */
    assert_true(gj_m_rng_u01(7, 123) == gj_m_rng_u01(7, 123));
    int same = 0;
    for (int i = 0; i < 1000; i++)
        same += gj_m_rng_u01(1, (uint64_t)i) == gj_m_rng_u01(2, (uint64_t)i);
    assert_true(same < 5);
    /* lag-1 correlation of a stream */
    double c = 0;
    for (int i = 0; i < n - 1; i++)
        c += (gj_m_rng_u01(9, (uint64_t)i) - 0.5) * (gj_m_rng_u01(9, (uint64_t)i + 1) - 0.5);
    assert_true(fabs(c / (n - 1)) < 0.001);

    const float ps[] = {0.0f, 0.1f, 0.5f, 0.9f, 1.0f};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
        float p = ps[k];
        long zeros = 0;
        for (int i = 0; i < n; i++) {
            float m = gj_m_dropout_scale_f(5, (uint64_t)i, p);
            if (m == 0.0f)
                zeros++;
            else
                assert_true(m == 1.0f / (1.0f - p));
            double md = gj_m_dropout_scale_d(5, (uint64_t)i, (double)p);
            assert_true((md == 0.0) == (m == 0.0f));
        }
        double frac = (double)zeros / n;
        assert_true(fabs(frac - p) < 0.003);
    }
}

/* ------------------------------------------------------------- bitcode */

static void test_bitcode(void **state) {
    (void)state;
    assert_true(gj_rt_math_bc_size > 0);
    LLVMContextRef ctx = LLVMContextCreate();
    LLVMMemoryBufferRef buf = LLVMCreateMemoryBufferWithMemoryRange(
        (const char *)gj_rt_math_bc, gj_rt_math_bc_size, "gj_math", 0);
    LLVMModuleRef mod = NULL;
    assert_int_equal(LLVMParseBitcodeInContext2(ctx, buf, &mod), 0);
    assert_non_null(mod);
    static const char *const names[] = {
        "gj_bc_exp_f", "gj_bc_exp_d", "gj_bc_log_f", "gj_bc_log_d", "gj_bc_tanh_f",
        "gj_bc_tanh_d", "gj_bc_sigmoid_f", "gj_bc_sigmoid_d", "gj_bc_gelu_f", "gj_bc_gelu_d",
        "gj_bc_gelu_grad_f", "gj_bc_gelu_grad_d", "gj_bc_sqrt_f", "gj_bc_sqrt_d",
        "gj_bc_rsqrt_f", "gj_bc_rsqrt_d", "gj_bc_relu_f", "gj_bc_relu_d", "gj_bc_step_f",
        "gj_bc_step_d", "gj_bc_pow_f", "gj_bc_pow_d", "gj_bc_bf16_to_f32", "gj_bc_f32_to_bf16",
        "gj_bc_rng_u01", "gj_bc_dropout_scale_f", "gj_bc_dropout_scale_d",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        LLVMValueRef f = LLVMGetNamedFunction(mod, names[i]);
        if (!f || LLVMIsDeclaration(f)) {
            print_error("bitcode lacks a definition of %s\n", names[i]);
            fail();
        }
    }
    LLVMDisposeModule(mod);
    LLVMDisposeMemoryBuffer(buf);
    LLVMContextDispose(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_float_specials), cmocka_unit_test(test_float_sweep),
        cmocka_unit_test(test_float_log_sweep), cmocka_unit_test(test_double_sweep),
        cmocka_unit_test(test_bf16),           cmocka_unit_test(test_rng),
        cmocka_unit_test(test_bitcode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
