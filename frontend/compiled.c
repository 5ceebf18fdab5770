/*
 * compiled.c - the compiled-autograd switch and its statistics.
 *
 * The flag is process-wide (like torch's compiled_autograd context, but
 * sticky): gj_set_compiled_autograd wins over the environment variable
 * GRADJIT_COMPILED_AUTOGRAD, which is read once, at the first query.
 */
#include "fe.h"
#include "../jit/jit.h"

#include <stdlib.h>
#include <string.h>

static atomic_int g_flag = -1; /* -1: not decided yet */
static atomic_llong g_backwards;

static bool env_true(const char *v) {
    return v && *v && strcmp(v, "0") != 0 && strcmp(v, "false") != 0 && strcmp(v, "off") != 0;
}

bool gj_fe_compiled_enabled(void) {
    int f = atomic_load(&g_flag);
    if (f < 0) {
        int want = env_true(getenv("GRADJIT_COMPILED_AUTOGRAD")) ? 1 : 0;
        atomic_compare_exchange_strong(&g_flag, &f, want);
        f = atomic_load(&g_flag);
    }
    return f == 1;
}

void gj_fe_count_backward(void) { atomic_fetch_add(&g_backwards, 1); }

void gj_set_compiled_autograd(bool on) { atomic_store(&g_flag, on ? 1 : 0); }

bool gj_compiled_autograd_enabled(void) { return gj_fe_compiled_enabled(); }

void gj_compiled_autograd_stats(gj_ca_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    gj_jit_stats(out);
    out->backwards = atomic_load(&g_backwards);
}

void gj_compiled_autograd_reset_stats(void) {
    atomic_store(&g_backwards, 0);
    gj_jit_reset_stats();
}
