/* SPDX-License-Identifier: MIT */
/*
 * common.h - small helpers the example trainers share (header-only, all
 * static inline: a trainer that does not use one pays nothing): a
 * monotonic clock, a qsort comparator and quartiles, the seeded shuffle's
 * generator, checkpoint metadata as exact decimals, the progress bar, and
 * the Ctrl-C flag. Not part of the library.
 */
#ifndef GJ_EXAMPLES_COMMON_H
#define GJ_EXAMPLES_COMMON_H

#include "gradjit.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* Set by the SIGINT handler: the trainer finishes its step, saves (--save)
 * and exits 130. */
static volatile sig_atomic_t g_interrupted;

static inline void on_sigint(int sig) {
    (void)sig;
    g_interrupted = 1;
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v[0..n) (n >= 1) and gives its quartiles: q[0] lower, q[1] the
 * median, q[2] upper (the paired ratios' median [interquartile range]). */
static inline void quartiles(double *v, int64_t n, double q[3]) {
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    q[0] = v[n / 4];
    q[1] = v[n / 2];
    q[2] = v[(3 * n) / 4];
}

#define BAR_W 24 /* characters of the progress bar */

/* bar (BAR_W + 1 chars) filled in proportion to step i (0-based) of n. */
static inline void progress_bar(char *bar, int64_t i, int64_t n) {
    int fill = (int)((i + 1) * BAR_W / n);
    for (int k = 0; k < BAR_W; k++)
        bar[k] = k < fill ? '#' : '.';
    bar[BAR_W] = 0;
}

/* Whether step i of n gets a progress line: every `every` steps on a
 * terminal (and the last); otherwise (a log file) at every tenth of n. */
static inline bool progress_due(bool quiet, bool tty, int every, int64_t i, int64_t n) {
    if (quiet)
        return false;
    if (tty)
        return i % every == every - 1 || i + 1 == n;
    int64_t tenth = n / 10 > 0 ? n / 10 : 1;
    return (i + 1) % tenth == 0 && i + 1 != n;
}

static inline uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Checkpoint metadata: integers and doubles as decimals that read back
 * exactly (%.17g round-trips a double). 0 or -1 (error set). */
static inline int meta_i64(gj_state_dict *sd, const char *key, int64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRId64, v);
    return gj_state_dict_set_metadata(sd, key, buf);
}

static inline int meta_f64(gj_state_dict *sd, const char *key, double v) {
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", v);
    return gj_state_dict_set_metadata(sd, key, buf);
}

/* Moving average of v[0..n) over w steps (fewer at the start) into out. */
static inline void smooth(const double *v, int64_t n, int w, double *out) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += v[i];
        if (i >= w) acc -= v[i - w];
        out[i] = acc / (double)(i < w ? i + 1 : w);
    }
}

/* The compiled-autograd counters of a run, and a warning when nothing ran
 * compiled or something fell back. */
static inline void print_ca(const char *tag, const gj_ca_stats *c) {
    printf("[%s] compiled autograd: %lld backwards, %lld compiles (%.1f ms), %lld memory hits, "
           "%lld disk hits, %lld bound to symbolic kernels, %lld fallbacks\n",
           tag, (long long)c->backwards, (long long)c->compiles, c->compile_ms,
           (long long)c->mem_hits, (long long)c->disk_hits, (long long)c->instantiations,
           (long long)c->fallbacks);
    if (c->backwards == 0) printf("[%s] WARNING: no backward went through the compiled path\n", tag);
    if (c->fallbacks > 0)
        printf("[%s] WARNING: %lld backwards fell back to the eager engine (%s)\n", tag,
               (long long)c->fallbacks, gj_compiled_autograd_last_fallback());
}

#endif /* GJ_EXAMPLES_COMMON_H */
