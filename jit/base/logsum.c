// SPDX-License-Identifier: MIT
/*
 * logsum.c - the summaries GRADJIT_LOG=prof and =cache print at exit,
 * instead of a line per step (GRADJIT_LOG=instrs still prints those).
 *
 * prof: the compiled backwards' phases (key and lookup, program, graph
 * release) summed, and every instruction's time summed under its kernel name or
 * kind ("gemm", "gather", ...), the largest first. cache: the counters of
 * gj_ca_stats, printed by jit/jit.c (the counters of the caches are not a
 * leaf's to read). The tables are process-wide, behind one mutex; jit/jit.c
 * registers the exit-time printer and calls gj_jit_log_prof_summary.
 */
#include "jit/base/base.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SUM_MAX_NAMES 512

typedef struct instr_sum {
    char name[64];
    int64_t calls;
    double ms;
} instr_sum;

static pthread_mutex_t g_sum_lock = PTHREAD_MUTEX_INITIALIZER;
static instr_sum g_instrs[SUM_MAX_NAMES];
static int g_n_instrs;
static int64_t g_dropped; /* instruction names beyond the table */
static int64_t g_backwards, g_fresh;
static double g_total, g_key, g_program, g_release;

void gj_jit_prof_instr(const char *what, double ms) {
    pthread_mutex_lock(&g_sum_lock);
    int i = 0;
    while (i < g_n_instrs && strncmp(g_instrs[i].name, what, sizeof g_instrs[i].name - 1) != 0) i++;
    if (i == g_n_instrs) {
        if (g_n_instrs == SUM_MAX_NAMES) {
            g_dropped++;
            pthread_mutex_unlock(&g_sum_lock);
            return;
        }
        snprintf(g_instrs[i].name, sizeof g_instrs[i].name, "%s", what);
        g_n_instrs++;
    }
    g_instrs[i].calls++;
    g_instrs[i].ms += ms;
    pthread_mutex_unlock(&g_sum_lock);
}

void gj_jit_prof_backward(bool fresh, double total, double key, double program, double release) {
    pthread_mutex_lock(&g_sum_lock);
    if (fresh) { /* its key and lookup include the compile: not in the means */
        g_fresh++;
        pthread_mutex_unlock(&g_sum_lock);
        return;
    }
    g_backwards++;
    g_total += total;
    g_key += key;
    g_program += program;
    g_release += release;
    pthread_mutex_unlock(&g_sum_lock);
}

static int by_ms(const void *a, const void *b) {
    double x = ((const instr_sum *)a)->ms, y = ((const instr_sum *)b)->ms;
    return (x < y) - (x > y);
}

/* The memory's page size: large tensor blocks in 2 MiB pages or 4 KiB, and
 * what the first touches cost (blocks new from the system, zero fills
 * written and skipped). */
static void log_pages(void) {
    static const char *mode[] = {"absent", "never", "madvise", "always"};
    gj_rt_page_stats_t pg;
    gj_rt_page_stats(&pg);
    int64_t zeroed, skipped;
    gj_rt_zero_stats(&zeroed, &skipped);
    const char *why = pg.hugepages ? "transparent huge pages"
                      : !gj_rt_hugepages_on() ? "GRADJIT_HUGEPAGES=0"
                                              : "the kernel offers no transparent huge pages";
    fprintf(stderr,
            "[gradjit prof] memory: page size %s for tensor blocks of %lld MiB and more (%s; "
            "the kernel's mode: %s); %.1f MiB of such blocks mapped new (%.1f MiB advised), "
            "%.1f MiB zero-filled, %.1f MiB of zero fills skipped (new memory is zero)\n",
            pg.hugepages ? "2 MiB" : "4 KiB", (long long)(pg.large_min >> 20), why,
            pg.thp_mode >= 0 && pg.thp_mode < 4 ? mode[pg.thp_mode] : "?",
            (double)pg.mapped_bytes / 1048576.0, (double)pg.advised_bytes / 1048576.0,
            (double)zeroed / 1048576.0, (double)skipped / 1048576.0);
}

void gj_jit_log_prof_summary(void) {
    unsigned fl = gj_jit_log_flags();
    if (!(fl & GJ_JIT_LOG_PROF)) return;
    log_pages();
    pthread_mutex_lock(&g_sum_lock);
    if (g_backwards == 0) {
        fprintf(stderr, "[gradjit prof] summary: no compiled backward ran from a cached "
                        "program (%lld compiled or loaded one)\n", (long long)g_fresh);
        pthread_mutex_unlock(&g_sum_lock);
        return;
    }
    double n = (double)g_backwards, instrs_ms = 0;
    fprintf(stderr,
            "[gradjit prof] summary: %lld compiled backwards from cached programs (and %lld "
            "that compiled or loaded theirs, not in the means), mean %.3f ms: key and lookup "
            "%.3f (%.1f%%), program %.3f, graph release %.3f; instructions by total time (a kernel is "
            "named by its position in its program):\n",
            (long long)g_backwards, (long long)g_fresh, g_total / n, g_key / n, 100.0 * g_key / g_total,
            g_program / n, g_release / n);
    qsort(g_instrs, (size_t)g_n_instrs, sizeof g_instrs[0], by_ms);
    for (int i = 0; i < g_n_instrs; i++) instrs_ms += g_instrs[i].ms;
    int shown = g_n_instrs < 12 ? g_n_instrs : 12;
    for (int i = 0; i < shown; i++)
        fprintf(stderr, "[gradjit prof]   %-28s %8lld calls  %9.3f ms per backward  %5.1f%% of "
                        "instruction time\n",
                g_instrs[i].name, (long long)g_instrs[i].calls, g_instrs[i].ms / n,
                instrs_ms > 0 ? 100.0 * g_instrs[i].ms / instrs_ms : 0.0);
    if (g_n_instrs > shown || g_dropped)
        fprintf(stderr, "[gradjit prof]   (%d more instruction names%s; GRADJIT_LOG=instrs prints every "
                        "instruction)\n",
                g_n_instrs - shown, g_dropped ? ", some not counted" : "");
    pthread_mutex_unlock(&g_sum_lock);
}
