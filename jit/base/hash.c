/* SPDX-License-Identifier: MIT */
/*
 * hash.c - the 128-bit hash of keys, kernel descriptions and disk entries,
 * and fresh unguessable names.
 */
#include "jit/base/base.h"
#include "runtime/gj_math.h"

#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

void gj_jit_hash128(const void *data, size_t n, uint64_t out[2]) {
    const unsigned char *p = data;
    uint64_t a = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    uint64_t b = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    for (size_t i = 0; i < n; i++) {
        a = (a ^ p[i]) * 0x100000001b3ull;
        b = (b + p[i] + 1) * 0xff51afd7ed558ccdull;
        b ^= b >> 29;
    }
    out[0] = gj_m_mix64(a ^ (uint64_t)n);
    out[1] = gj_m_mix64(b + 0x632be59bd9b4e019ull);
}

void gj_jit_nonce(uint64_t out[2]) {
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t seed[5] = {(uint64_t)getpid(), (uint64_t)ts.tv_sec, (uint64_t)ts.tv_nsec,
                        atomic_fetch_add(&counter, 1), (uint64_t)(uintptr_t)&ts};
    gj_jit_hash128(seed, sizeof seed, out);
}
