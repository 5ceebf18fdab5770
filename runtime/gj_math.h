/* SPDX-License-Identifier: MIT */
/*
 * gj_math.h - the scalar math of gradjit, written once and used twice: the
 * eager kernels (runtime/kernels_*.c) loop over these functions, and
 * runtime/math_bc.c compiles them to LLVM bitcode that every JIT module links
 * and inlines. Same source, so eager and compiled results agree bit for bit
 * wherever the evaluation order matches.
 *
 * Invariants:
 *   - Every function is `static inline`, free of branches on data (selects
 *     and bit tricks only) and free of libm calls, so a loop over it
 *     vectorizes. The double exp/log/tanh are own implementations too (they
 *     reach ~2e-16); the one libm call is powf/pow inside gj_m_pow_* for
 *     exponents other than 2, 3, 1, 0.5, -1. Float->int conversions are never done with
 *     a C cast (undefined for NaN/out of range): integer parts come from the
 *     "add 1.5*2^23 (2^52) and read the bits" rounding trick instead.
 *   - Special values follow IEEE expectations: NaN in -> NaN out, overflow
 *     -> inf, underflow -> 0 (through the subnormal range), log(0) = -inf,
 *     log(x<0) = NaN, tanh(+-inf) = +-1, sigmoid(-inf) = 0.
 *   - The error bounds in the comments are the ones tests/test_math.c
 *     enforces over a dense sweep (float versions against libm in double,
 *     double versions against libm in long double); "ulp" is in units of
 *     the correctly rounded result's type. "measured" is the worst case seen
 *     on that sweep.
 *   - Compile without -ffast-math (the library uses -fno-math-errno
 *     -ffp-contract=off); the range reductions rely on exact IEEE rounding.
 */
#ifndef GJ_MATH_H
#define GJ_MATH_H

#include <stdint.h>

/* ------------------------------------------------------------ bit casts */

static inline uint32_t gj_m_f2u(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return v.u;
}
static inline float gj_m_u2f(uint32_t u) {
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
}
static inline uint64_t gj_m_d2u(double d) {
    union { double d; uint64_t u; } v;
    v.d = d;
    return v.u;
}
static inline double gj_m_u2d(uint64_t u) {
    union { double d; uint64_t u; } v;
    v.u = u;
    return v.d;
}
static inline float gj_m_abs_f(float x) { return gj_m_u2f(gj_m_f2u(x) & 0x7fffffffu); }
static inline double gj_m_abs_d(double x) {
    return gj_m_u2d(gj_m_d2u(x) & 0x7fffffffffffffffull);
}
/* |mag| with the sign bit of sgn. */
static inline float gj_m_copysign_f(float mag, float sgn) {
    return gj_m_u2f((gj_m_f2u(mag) & 0x7fffffffu) | (gj_m_f2u(sgn) & 0x80000000u));
}
static inline double gj_m_copysign_d(double mag, double sgn) {
    return gj_m_u2d((gj_m_d2u(mag) & 0x7fffffffffffffffull) |
                    (gj_m_d2u(sgn) & 0x8000000000000000ull));
}

/* ------------------------------------------------------------------ exp */

/* exp(x), float. Cephes expf polynomial after the reduction
 * x = n*ln2 + r, |r| <= ln2/2 (ln2 split hi/lo so n*hi is exact); 2^n is
 * applied as two factors 2^(n/2) * 2^(n-n/2) so results in the subnormal
 * range round once and overflow lands on inf.
 * Bound: <= 1 ulp for normal results (measured 0.96 ulp); subnormal results
 * within one subnormal step (2^-149). exp(+inf) = inf, exp(-inf) = 0. */
static inline float gj_m_exp_f(float x) {
    float xc = x > 88.8f ? 88.8f : x; /* NaN passes both selects */
    xc = xc < -104.0f ? -104.0f : xc;
    const float shift = 0x1.8p23f;
    float t = xc * 1.44269504088896341f + shift;
    float n = t - shift;
    int32_t ni = (int32_t)(gj_m_f2u(t) - gj_m_f2u(shift));
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float p = ((((1.9875691500E-4f * r + 1.3981999507E-3f) * r + 8.3334519073E-3f) * r +
                4.1665795894E-2f) * r + 1.6666665459E-1f) * r + 5.0000001201E-1f;
    p = p * z + r + 1.0f;
    int32_t n1 = ni >> 1;
    int32_t n2 = ni - n1;
    float s1 = gj_m_u2f((uint32_t)(n1 + 127) << 23);
    float s2 = gj_m_u2f((uint32_t)(n2 + 127) << 23);
    return (p * s1) * s2;
}

/* exp(x), double: own implementation (no libm). Reduction as the float
 * version with fdlibm's ln2 hi/lo, then the Taylor series of exp(r) to
 * degree 13 (truncation < 5e-18 relative for |r| <= ln2/2).
 * Bound: relative error <= 4e-16 for normal results (measured 1.4e-16). */
static inline double gj_m_exp_d(double x) {
    double xc = x > 709.9 ? 709.9 : x;
    xc = xc < -746.0 ? -746.0 : xc;
    const double shift = 0x1.8p52;
    double t = xc * 1.44269504088896338700e+00 + shift;
    double n = t - shift;
    int64_t ni = (int64_t)(gj_m_d2u(t) - gj_m_d2u(shift));
    double r = xc - n * 6.93147180369123816490e-01;
    r = r - n * 1.90821492927058770002e-10;
    double q = 1.0 / 6227020800.0;
    q = q * r + 1.0 / 479001600.0;
    q = q * r + 1.0 / 39916800.0;
    q = q * r + 1.0 / 3628800.0;
    q = q * r + 1.0 / 362880.0;
    q = q * r + 1.0 / 40320.0;
    q = q * r + 1.0 / 5040.0;
    q = q * r + 1.0 / 720.0;
    q = q * r + 1.0 / 120.0;
    q = q * r + 1.0 / 24.0;
    q = q * r + 1.0 / 6.0;
    q = q * r + 0.5;
    double p = 1.0 + (r + (r * r) * q);
    int64_t n1 = ni >> 1;
    int64_t n2 = ni - n1;
    double s1 = gj_m_u2d((uint64_t)(n1 + 1023) << 52);
    double s2 = gj_m_u2d((uint64_t)(n2 + 1023) << 52);
    return (p * s1) * s2;
}

/* ------------------------------------------------------------------ log */

/* log(x), float. Cephes logf: x = m*2^e with m in [sqrt(1/2), sqrt(2)),
 * degree-9 polynomial in m-1; subnormal inputs are scaled by 2^23 first.
 * Bound: <= 1 ulp (measured 0.81 ulp) over all positive floats.
 * log(0) = -inf, log(x<0) = NaN, log(inf) = inf, NaN -> NaN. */
static inline float gj_m_log_f(float x) {
    int32_t sub = x < 0x1p-126f;
    float xs = sub ? x * 0x1p23f : x;
    uint32_t ux = gj_m_f2u(xs);
    int32_t e = (int32_t)((ux >> 23) & 0xffu) - 126;
    e = sub ? e - 23 : e;
    float m = gj_m_u2f((ux & 0x007fffffu) | 0x3f000000u); /* [0.5, 1) */
    int32_t lo = m < 0.707106781186547524f;
    float ef = (float)(lo ? e - 1 : e);
    float f = lo ? (m + m) - 1.0f : m - 1.0f;
    float z = f * f;
    float y = ((((((((7.0376836292E-2f * f - 1.1514610310E-1f) * f + 1.1676998740E-1f) * f -
                    1.2420140846E-1f) * f + 1.4249322787E-1f) * f - 1.6668057665E-1f) * f +
                 2.0000714765E-1f) * f - 2.4999993993E-1f) * f + 3.3333331174E-1f) * f * z;
    y = y + -2.12194440e-4f * ef;
    y = y + -0.5f * z;
    float r = f + y;
    r = r + 0.693359375f * ef;
    const float inf = __builtin_inff();
    r = x == inf ? inf : r;
    r = x == 0.0f ? -inf : r;
    r = x < 0.0f ? __builtin_nanf("") : r;
    r = x != x ? x : r;
    return r;
}

/* log(x), double: own implementation (no libm), fdlibm's e_log.c scheme:
 * m in [sqrt(1/2), sqrt(2)), f = m-1, s = f/(2+f), log(1+f) =
 * f - (f^2/2 - s*(f^2/2 + R(s^2))) with fdlibm's degree-14 R.
 * Bound: relative error <= 4e-16 (measured 1.5e-16); specials as the float
 * one. */
static inline double gj_m_log_d(double x) {
    int sub = x < 0x1p-1022;
    double xs = sub ? x * 0x1p54 : x;
    uint64_t ux = gj_m_d2u(xs);
    int32_t e = (int32_t)((ux >> 52) & 0x7ffu) - 1022; /* int32: cvtdq2pd vectorizes */
    e = sub ? e - 54 : e;
    double m = gj_m_u2d((ux & 0x000fffffffffffffull) | 0x3fe0000000000000ull);
    int lo = m < 0.70710678118654752440;
    double k = (double)(lo ? e - 1 : e);
    double f = lo ? (m + m) - 1.0 : m - 1.0;
    double s = f / (2.0 + f);
    double z = s * s;
    double w = z * z;
    double t1 = w * (3.999999999940941908e-01 +
                     w * (2.222219843214978396e-01 + w * 1.531383769920937332e-01));
    double t2 = z * (6.666666666666735130e-01 +
                     w * (2.857142874366239149e-01 +
                          w * (1.818357216161805012e-01 + w * 1.479819860511658591e-01)));
    double R = t2 + t1;
    double hfsq = 0.5 * f * f;
    double r = k * 6.93147180369123816490e-01 -
               ((hfsq - (s * (hfsq + R) + k * 1.90821492927058770002e-10)) - f);
    const double inf = __builtin_inf();
    r = x == inf ? inf : r;
    r = x == 0.0 ? -inf : r;
    r = x < 0.0 ? __builtin_nan("") : r;
    r = x != x ? x : r;
    return r;
}

/* ----------------------------------------------------------------- tanh */

/* tanh(x), float. |x| < 0.625: Cephes tanhf odd polynomial; otherwise
 * 1 - 2/(exp(2|x|)+1) with the sign of x. Both are computed and selected.
 * Bound: <= 2 ulp (measured 1.27 ulp); tanh(+-0) = +-0, tanh(+-inf) = +-1. */
static inline float gj_m_tanh_f(float x) {
    float ax = gj_m_abs_f(x);
    float z = x * x;
    float ps = ((((-5.70498872745E-3f * z + 2.06390887954E-2f) * z - 5.37397155531E-2f) * z +
                 1.33314422036E-1f) * z - 3.33332819422E-1f) * z * x + x;
    float e = gj_m_exp_f(ax + ax);
    float pl = 1.0f - 2.0f / (e + 1.0f);
    return gj_m_copysign_f(ax < 0.625f ? ps : pl, x); /* odd; keeps tanh(-0) = -0 */
}

/* tanh(x), double: own implementation (no libm). |x| < 0.625: Cephes
 * tanh.c rational x + x^3 P(x^2)/Q(x^2); otherwise 1 - 2/(exp(2|x|)+1).
 * Bound: relative error <= 6e-16 (measured 2.4e-16). */
static inline double gj_m_tanh_d(double x) {
    double ax = gj_m_abs_d(x);
    double s = x * x;
    double P = (-9.64399179425052238628E-1 * s - 9.92877231001918586564E1) * s -
               1.61468768441708447952E3;
    double Q = ((s + 1.12811678491632931402E2) * s + 2.23548839060100448583E3) * s +
               4.84406305325125486048E3;
    double ps = x + x * s * (P / Q);
    double e = gj_m_exp_d(ax + ax);
    double pl = 1.0 - 2.0 / (e + 1.0);
    return gj_m_copysign_d(ax < 0.625 ? ps : pl, x);
}

/* -------------------------------------------------------------- sigmoid */

/* sigmoid(x) = 1/(1+exp(-x)), evaluated as e/(1+e) with e = exp(-|x|) for
 * x < 0 so that the left tail keeps full relative accuracy.
 * Bound (float): <= 3 ulp for normal results (measured 2.71 ulp, relative
 * 2e-7). (double): relative <= 6e-16 (measured 3.3e-16). */
static inline float gj_m_sigmoid_f(float x) {
    float e = gj_m_exp_f(-gj_m_abs_f(x));
    float r = 1.0f / (1.0f + e);
    return x >= 0.0f ? r : e * r;
}
static inline double gj_m_sigmoid_d(double x) {
    double e = gj_m_exp_d(-gj_m_abs_d(x));
    double r = 1.0 / (1.0 + e);
    return x >= 0.0 ? r : e * r;
}

/* ----------------------------------------------------------------- gelu */

/* gelu (tanh approximation) 0.5x(1+tanh(u)), u = sqrt(2/pi)(x+0.044715x^3),
 * evaluated as the identical x*sigmoid(2u) (no cancellation in the left
 * tail). x is clamped to +-T inside the argument (beyond T the sigmoid is
 * exactly 0 or 1 in the type) so x^3 never overflows; gelu(-inf) = -0.
 * Bound (float): |err| <= 1.5e-6*|gelu(x)| + 2e-10 (measured 0.66 of it):
 * relative ~1e-6 wherever |gelu| >= 1e-3; in the left tail the error is
 * dominated by the conditioning of exp in the argument 2u (relative
 * ~|2u|*2^-24), which any f32 evaluation shares.
 * (double): |err| <= 4e-15*|gelu(x)| + 2e-18 (measured 0.33 of it). */
#define GJ_M_GELU_C1 1.5957691216057308     /* 2*sqrt(2/pi) */
#define GJ_M_GELU_C2 0.07135481627260025    /* 2*sqrt(2/pi)*0.044715 */
#define GJ_M_GELU_C3 0.21406444881780076    /* 3*GJ_M_GELU_C2 */
static inline float gj_m_gelu_f(float x) {
    float xc = x > 20.0f ? 20.0f : x;
    xc = xc < -20.0f ? -20.0f : xc;
    float z = xc * ((float)GJ_M_GELU_C1 + (float)GJ_M_GELU_C2 * (xc * xc));
    float r = x * gj_m_sigmoid_f(z);
    return x < -20.0f ? -0.0f : r;
}
static inline double gj_m_gelu_d(double x) {
    double xc = x > 25.0 ? 25.0 : x;
    xc = xc < -25.0 ? -25.0 : xc;
    double z = xc * (GJ_M_GELU_C1 + GJ_M_GELU_C2 * (xc * xc));
    double r = x * gj_m_sigmoid_d(z);
    return x < -25.0 ? -0.0 : r;
}

/* d gelu(x)/dx = s + x*s*(1-s)*(c1 + 3*c2*x^2), s = sigmoid(z) as above,
 * with 1-s computed directly (not by subtraction). Clamping x to +-T makes
 * the result exactly 1 (x > T) or 0 (x < -T); gelu_grad(+-inf) = 1 / 0.
 * Bound (float): |err| <= 1e-6*|g| + 6e-8 (measured 0.85 of it; the
 * absolute part matters only near the root x = -0.7518 where the two terms
 * cancel). (double): |err| <= 4e-15*|g| + 1e-16 (measured 0.66 of it). */
static inline float gj_m_gelu_grad_f(float x) {
    float xc = x > 20.0f ? 20.0f : x;
    xc = xc < -20.0f ? -20.0f : xc;
    float x2 = xc * xc;
    float z = xc * ((float)GJ_M_GELU_C1 + (float)GJ_M_GELU_C2 * x2);
    float e = gj_m_exp_f(-gj_m_abs_f(z));
    float q = 1.0f / (1.0f + e);
    float eq = e * q;
    float s = z >= 0.0f ? q : eq;  /* sigmoid(z) */
    float sm = z >= 0.0f ? eq : q; /* 1 - sigmoid(z) */
    float dz = (float)GJ_M_GELU_C1 + (float)GJ_M_GELU_C3 * x2;
    float r = s + ((xc * s) * sm) * dz;
    return x != x ? x : r;
}
static inline double gj_m_gelu_grad_d(double x) {
    double xc = x > 25.0 ? 25.0 : x;
    xc = xc < -25.0 ? -25.0 : xc;
    double x2 = xc * xc;
    double z = xc * (GJ_M_GELU_C1 + GJ_M_GELU_C2 * x2);
    double e = gj_m_exp_d(-gj_m_abs_d(z));
    double q = 1.0 / (1.0 + e);
    double eq = e * q;
    double s = z >= 0.0 ? q : eq;
    double sm = z >= 0.0 ? eq : q;
    double dz = GJ_M_GELU_C1 + GJ_M_GELU_C3 * x2;
    double r = s + ((xc * s) * sm) * dz;
    return x != x ? x : r;
}

/* ------------------------------------------------- sqrt, relu, step, pow */

/* sqrt: correctly rounded, <= 0.5 ulp (the hardware instruction;
 * -fno-math-errno keeps it a single instruction). rsqrt = 1/sqrt(x):
 * <= 2 ulp (two roundings; measured 1.49 ulp). */
static inline float gj_m_sqrt_f(float x) { return __builtin_sqrtf(x); }
static inline double gj_m_sqrt_d(double x) { return __builtin_sqrt(x); }
static inline float gj_m_rsqrt_f(float x) { return 1.0f / __builtin_sqrtf(x); }
static inline double gj_m_rsqrt_d(double x) { return 1.0 / __builtin_sqrt(x); }

/* relu: x < 0 ? 0 : x (NaN propagates). step: x > 0 ? 1 : 0 (NaN -> 0). */
static inline float gj_m_relu_f(float x) { return x < 0.0f ? 0.0f : x; }
static inline double gj_m_relu_d(double x) { return x < 0.0 ? 0.0 : x; }
static inline float gj_m_step_f(float x) { return x > 0.0f ? 1.0f : 0.0f; }
static inline double gj_m_step_d(double x) { return x > 0.0 ? 1.0 : 0.0; }

/* x^c. The common exponents are exact products (2, 3, 1, -1: x*x, x*x*x,
 * x, 1/x; 0.5: sqrt) and everything else is libm pow (the one libm call of
 * this file; its bound is libm's, < 1 ulp in glibc). c is loop-invariant in
 * every use, so the selects below fold or unswitch out of loops. */
static inline float gj_m_pow_f(float x, float c) {
    return c == 2.0f   ? x * x
           : c == 1.0f ? x
           : c == 3.0f ? (x * x) * x
           : c == 0.5f ? __builtin_sqrtf(x)
           : c == -1.0f ? 1.0f / x
                        : __builtin_powf(x, c);
}
static inline double gj_m_pow_d(double x, double c) {
    return c == 2.0   ? x * x
           : c == 1.0 ? x
           : c == 3.0 ? (x * x) * x
           : c == 0.5 ? __builtin_sqrt(x)
           : c == -1.0 ? 1.0 / x
                       : __builtin_pow(x, c);
}

/* ----------------------------------------------------------------- bf16 */

/* bfloat16 is the top half of a float. Widening is exact. Narrowing rounds
 * to nearest, ties to even; overflow rounds to inf; NaN stays NaN (made
 * quiet, sign and top payload bits kept). */
static inline float gj_m_bf16_to_f32(uint16_t h) { return gj_m_u2f((uint32_t)h << 16); }
static inline uint16_t gj_m_f32_to_bf16(float f) {
    uint32_t u = gj_m_f2u(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x0040u;
    return (uint16_t)(f != f ? nan : rounded);
}

/* ------------------------------------------------------------------ rng */

/* splitmix64's finalizer (a bijection of 64-bit words). */
static inline uint64_t gj_m_mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z;
}

/* Counter-based uniform in [0, 1) with 24 random bits: value `counter` of
 * the stream `seed` is mix64(mix64(seed) + counter*golden) (splitmix64
 * evaluated at an arbitrary position). Pure function of its arguments, so
 * eager, compiled and recomputed (checkpointed) masks are identical. */
static inline float gj_m_rng_u01(uint64_t seed, uint64_t counter) {
    uint64_t z = gj_m_mix64(gj_m_mix64(seed) + counter * 0x9e3779b97f4a7c15ull);
    return (float)(int32_t)(z >> 40) * 0x1p-24f;
}

/* Dropout multiplier of element `counter`: 0 with probability p, else
 * 1/(1-p) (so p = 1 gives all zeros and p = 0 all ones). */
static inline float gj_m_dropout_scale_f(uint64_t seed, uint64_t counter, float p) {
    float u = gj_m_rng_u01(seed, counter);
    return u >= p ? 1.0f / (1.0f - p) : 0.0f;
}
static inline double gj_m_dropout_scale_d(uint64_t seed, uint64_t counter, double p) {
    double u = (double)gj_m_rng_u01(seed, counter);
    return u >= p ? 1.0 / (1.0 - p) : 0.0;
}

#endif /* GJ_MATH_H */
