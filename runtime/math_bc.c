/* SPDX-License-Identifier: MIT */
/*
 * math_bc.c - the scalar math of gj_math.h as externally visible functions
 * with stable names, compiled by clang-19 to LLVM bitcode (see
 * CMakeLists.txt) and embedded in the library as gj_rt_math_bc[]. The JIT
 * links this module into each kernel module, marks the functions internal
 * and inlines them, so fused kernels compute exactly what the eager kernels
 * compute.
 *
 * Invariants:
 *   - One wrapper per gj_math.h function: gj_bc_<name>_f (float) and
 *     gj_bc_<name>_d (double), plus the bf16 conversions and the dropout
 *     generator. Names and signatures are an ABI of the JIT: add, never
 *     rename. Every wrapper is a plain call of the inline function.
 *   - The only external references of the module are libm's powf/pow (from
 *     gj_m_pow_*), resolved by the JIT from the process.
 */
#include "gj_math.h"

#define GJ_BC_UNARY(name)                                              \
    float gj_bc_##name##_f(float x);                                   \
    double gj_bc_##name##_d(double x);                                 \
    float gj_bc_##name##_f(float x) { return gj_m_##name##_f(x); }     \
    double gj_bc_##name##_d(double x) { return gj_m_##name##_d(x); }

GJ_BC_UNARY(exp)
GJ_BC_UNARY(log)
GJ_BC_UNARY(tanh)
GJ_BC_UNARY(sigmoid)
GJ_BC_UNARY(gelu)
GJ_BC_UNARY(gelu_grad)
GJ_BC_UNARY(sqrt)
GJ_BC_UNARY(rsqrt)
GJ_BC_UNARY(relu)
GJ_BC_UNARY(step)

float gj_bc_pow_f(float x, float c);
double gj_bc_pow_d(double x, double c);
float gj_bc_bf16_to_f32(uint16_t h);
uint16_t gj_bc_f32_to_bf16(float f);
float gj_bc_rng_u01(uint64_t seed, uint64_t counter);
float gj_bc_dropout_scale_f(uint64_t seed, uint64_t counter, float p);
double gj_bc_dropout_scale_d(uint64_t seed, uint64_t counter, double p);

float gj_bc_pow_f(float x, float c) { return gj_m_pow_f(x, c); }
double gj_bc_pow_d(double x, double c) { return gj_m_pow_d(x, c); }
float gj_bc_bf16_to_f32(uint16_t h) { return gj_m_bf16_to_f32(h); }
uint16_t gj_bc_f32_to_bf16(float f) { return gj_m_f32_to_bf16(f); }
float gj_bc_rng_u01(uint64_t seed, uint64_t counter) { return gj_m_rng_u01(seed, counter); }
float gj_bc_dropout_scale_f(uint64_t seed, uint64_t counter, float p) {
    return gj_m_dropout_scale_f(seed, counter, p);
}
double gj_bc_dropout_scale_d(uint64_t seed, uint64_t counter, double p) {
    return gj_m_dropout_scale_d(seed, counter, p);
}

