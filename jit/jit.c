/* SPDX-License-Identifier: MIT */
/*
 * jit.c - what jit.h promises process-wide and that needs every stage: the
 * counters of gj_ca_stats with the cache levels, and the exit-time summary
 * of GRADJIT_LOG=cache (both compiled paths: backwards and steps) and
 * =prof, registered from here, above every stage
 * (the leaves of base/ call nothing up).
 *
 * The summary is registered when GRADJIT_LOG is first read (a callback
 * this file hands base/ at load time), as before frontend registers its
 * leak report, so that at exit the leak report prints first.
 */
#include "jit/jit.h"

#include "jit/cache/cache.h"

#include <stdio.h>
#include <stdlib.h>

void gj_jit_stats(gj_ca_stats *out) {
    if (!out) return;
    int64_t backwards = out->backwards;
    gj_jit_counters(GJ_JIT_PATH_BACKWARD, out);
    out->backwards = backwards;
    gj_jit_cache_levels(&out->mem_bytes, &out->mem_entries, &out->disk_bytes);
}

/* One path's counters in the cache summary: "[gradjit cache] summary,
 * <what>: N compiles (ms), ..." and its fallbacks by reason. */
static void print_path_summary(const char *what, const gj_ca_stats *st) {
    fprintf(stderr,
            "[gradjit cache] summary, %s: %lld compiles (%.1f ms), %lld memory hits, %lld disk "
            "hits, %lld fallbacks",
            what, (long long)st->compiles, st->compile_ms, (long long)st->mem_hits,
            (long long)st->disk_hits, (long long)st->fallbacks);
    if (st->instantiations)
        fprintf(stderr, ", %lld bound to symbolic kernels (no compile)",
                (long long)st->instantiations);
    for (int r = 0; r < GJ_CA_N_REASONS; r++)
        if (st->fallbacks_by_reason[r])
            fprintf(stderr, " %s=%lld", gj_jit_reason_name((gj_ca_reason)r),
                    (long long)st->fallbacks_by_reason[r]);
    fprintf(stderr, "\n");
}

/* At exit: GRADJIT_LOG=cache's summary, a line for each compiled path
 * (compiled autograd's backwards, the compiled step's runs; the cache and
 * its evictions are shared), then GRADJIT_LOG=prof's. */
static void print_summary(void) {
    if (gj_jit_log_flags() & GJ_JIT_LOG_CACHE) {
        gj_ca_stats ca = {0}, cs = {0};
        gj_jit_stats(&ca);
        gj_jit_counters(GJ_JIT_PATH_STEP, &cs);
        print_path_summary("compiled autograd (backwards)", &ca);
        print_path_summary("compiled step (gj_step runs)", &cs);
        if (ca.mem_evictions || ca.disk_evictions)
            fprintf(stderr,
                    "[gradjit cache] summary, programs evicted by the cache limits: %lld from "
                    "memory, %lld from disk\n",
                    (long long)ca.mem_evictions, (long long)ca.disk_evictions);
    }
    gj_jit_log_prof_summary();
}

static void register_summary(unsigned flags) {
    if (flags & (GJ_JIT_LOG_PROF | GJ_JIT_LOG_CACHE)) atexit(print_summary);
}

/* At load time: the summary is registered when GRADJIT_LOG is first read. */
__attribute__((constructor)) static void jit_init(void) { gj_jit_on_log_flags(register_summary); }

bool gj_jit_log_leaks(void) { return (gj_jit_log_flags() & GJ_JIT_LOG_LEAKS) != 0; }
