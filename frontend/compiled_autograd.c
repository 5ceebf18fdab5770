/* SPDX-License-Identifier: MIT */
/*
 * compiled_autograd.c - the compiled-autograd switch, its statistics and the public
 * side of fallbacks (reason names, last message, quiet mode, recompile
 * limit); the machinery lives in jit/run/backward.c.
 *
 * The flag is process-wide (like torch's compiled_autograd context, but
 * sticky): gj_set_compiled_autograd wins over the environment variable
 * GRADJIT_COMPILED_AUTOGRAD, which is read once, at the first query
 * (settings.c).
 * gj_backward and gj_grad (torch.autograd.grad) both ask the compiled path
 * first (jit/run/backward.c) and both count in gj_ca_stats: a backward each,
 * then a compile, hit or fallback.
 */
#include "fe.h"
#include "../jit/jit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_llong g_backwards;

void gj_fe_count_backward(void) { atomic_fetch_add(&g_backwards, 1); }

void gj_set_compiled_autograd(bool on) { gj_fe_set_compiled(on); }

bool gj_compiled_autograd_enabled(void) { return gj_fe_compiled_enabled(); }

void gj_compiled_autograd_stats(gj_ca_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    gj_jit_stats(out);
    out->backwards = atomic_load(&g_backwards);
}

int gj_compiled_autograd_last_program(gj_ca_program_info *out) {
    if (!out) {
        gj_rt_set_error("gj_compiled_autograd_last_program: out is NULL");
        return -1;
    }
    if (!gj_jit_last_program_info(out)) {
        gj_rt_set_error("gj_compiled_autograd_last_program: no compiled backward ran on this "
                        "thread yet");
        return -1;
    }
    return 0;
}

void gj_compiled_autograd_reset_stats(void) {
    atomic_store(&g_backwards, 0);
    gj_jit_reset_stats();
}

const char *gj_ca_reason_name(gj_ca_reason r) { return gj_jit_reason_name(r); }

const char *gj_compiled_autograd_last_fallback(void) { return gj_jit_last_fallback(); }

void gj_compiled_autograd_set_quiet(bool quiet) { gj_jit_set_quiet(quiet); }

void gj_compiled_autograd_set_recompile_limit(int n) { gj_jit_set_recompile_limit(n); }

void gj_compiled_autograd_set_dynamic(gj_ca_dynamic mode) { gj_jit_set_dynamic(mode); }

gj_ca_dynamic gj_compiled_autograd_dynamic(void) { return gj_jit_dynamic(); }

void gj_compiled_autograd_set_mem_cache_limit(int64_t bytes) { gj_jit_set_mem_limit(bytes); }

int64_t gj_compiled_autograd_mem_cache_limit(void) { return gj_jit_mem_limit(); }

void gj_compiled_autograd_set_disk_cache_limit(int64_t bytes) { gj_jit_set_disk_limit(bytes); }

int64_t gj_compiled_autograd_disk_cache_limit(void) { return gj_jit_disk_limit(); }
