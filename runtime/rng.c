/* SPDX-License-Identifier: MIT */
/*
 * rng.c - the counter-based random generator behind randn/rand.
 *
 * Invariants: a random value is a pure function of (seed, counter), so any
 * thread can draw value k of a stream without shared state, and a kernel
 * split over threads draws exactly what a serial loop would. The global
 * stream is (g_seed, g_counter): gj_rt_rng_reserve hands out disjoint
 * ranges of counters atomically; gj_manual_seed sets the seed and rewinds
 * the counter to 0. The generator is SplitMix64 (its finaliser over a
 * Weyl sequence, here started from a pre-mixed seed).
 * (Dropout uses gj_m_rng_u01 of gj_math.h, shared with JIT code.)
 */
#include "runtime/rt.h"
#include "runtime/gj_math.h"

#include <math.h>

#define GJ_RT_RNG_DEFAULT_SEED 67280421310721ull

static atomic_ullong g_seed = GJ_RT_RNG_DEFAULT_SEED;
static atomic_ullong g_counter;
static atomic_ullong g_reseeds; /* gj_rt_rng_set_seed and gj_rng_set_state calls */

uint64_t gj_rt_rng_bits(uint64_t seed, uint64_t counter) {
    uint64_t key = gj_m_mix64(seed ^ 0x6a09e667f3bcc909ull);
    return gj_m_mix64(key + (counter + 1) * 0x9e3779b97f4a7c15ull);
}

/* Uniform in [0, 1) with 53 random bits. */
double gj_rt_rng_uniform(uint64_t seed, uint64_t counter) {
    return (double)(gj_rt_rng_bits(seed, counter) >> 11) * 0x1.0p-53;
}

/* Standard normal: Box-Muller (cosine branch) from two uniforms derived
 * from this one counter; u1 is in (0, 1] so the log is finite. */
double gj_rt_rng_normal(uint64_t seed, uint64_t counter) {
    uint64_t b = gj_rt_rng_bits(seed, counter);
    uint64_t c = gj_m_mix64(b ^ 0xbb67ae8584caa73bull);
    double u1 = (double)((b >> 11) + 1) * 0x1.0p-53;
    double u2 = (double)(c >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t gj_rt_rng_seed(void) { return atomic_load(&g_seed); }

void gj_rt_rng_set_seed(uint64_t seed) {
    atomic_fetch_add(&g_reseeds, 1);
    atomic_store(&g_seed, seed);
    atomic_store(&g_counter, 0);
}

uint64_t gj_rt_rng_reserve(uint64_t n) { return atomic_fetch_add(&g_counter, n); }

uint64_t gj_rt_rng_reseeds(void) { return atomic_load(&g_reseeds); }

void gj_manual_seed(uint64_t seed) { gj_rt_rng_set_seed(seed); }

/* The whole state is (seed, counter): a checkpoint that restores both makes
 * every later draw the same as in the run that saved it. Not atomic as a
 * pair: call it when no other thread draws. */
void gj_rng_get_state(uint64_t *seed, uint64_t *counter) {
    if (seed)
        *seed = atomic_load(&g_seed);
    if (counter)
        *counter = atomic_load(&g_counter);
}

void gj_rng_set_state(uint64_t seed, uint64_t counter) {
    atomic_fetch_add(&g_reseeds, 1);
    atomic_store(&g_seed, seed);
    atomic_store(&g_counter, counter);
}
