/* SPDX-License-Identifier: MIT */
/*
 * clock.h - the benchmarks' clock and the comparator their medians sort
 * with (gradjit-bench's files and bench/tools/ share these two).
 */
#ifndef GJ_BENCH_CLOCK_H
#define GJ_BENCH_CLOCK_H

#include <time.h>

/* Milliseconds on the monotonic clock. */
static inline double bench_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* qsort comparator of doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif /* GJ_BENCH_CLOCK_H */
