/* SPDX-License-Identifier: MIT */
/*
 * settings.c - every GRADJIT_* environment variable the front end reads,
 * in one place (fe.h). jit/'s settings are jit/base/settings.c's,
 * dist/'s are dist/pg.c's.
 *
 * Invariants:
 *   - GRADJIT_COMPILED_AUTOGRAD is read once, at the first query of the
 *     flag; gj_set_compiled_autograd, called before or after, wins.
 *   - GRADJIT_STEP_CHECK is read at each gj_step_new whose opts leave
 *     check_every 0, so it applies to the steps made after it is set.
 *   - GRADJIT_STEP_MEM_BUDGET_MB is read at each gj_step_new whose opts
 *     leave mem_budget 0, like the check.
 *   - GRADJIT_STEP_TRACE is read at each gj_step_new whose opts leave
 *     trace_computing false, like the check.
 *   - A value that does not parse is reported on stderr and the default
 *     used: once per process for the flag, at each read for the check.
 */
#include "fe.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static atomic_int g_compiled = -1; /* the compiled-autograd flag; -1: not decided yet */

/* The switch named by environment value v (NULL: unset): true for 1, on,
 * true, yes; false for 0, off, false, no, empty or unset (any case).
 * Anything else is false with one warning on stderr per process. */
static bool env_switch(const char *v) {
    static const char *on[] = {"1", "on", "true", "yes"}, *off[] = {"0", "off", "false", "no"};
    static atomic_bool warned;
    if (!v || !*v) return false;
    for (size_t i = 0; i < sizeof on / sizeof on[0]; i++) {
        if (strcasecmp(v, on[i]) == 0) return true;
        if (strcasecmp(v, off[i]) == 0) return false;
    }
    if (!atomic_exchange(&warned, true))
        fprintf(stderr,
                "gradjit: GRADJIT_COMPILED_AUTOGRAD='%s' is not 1/on/true/yes or "
                "0/off/false/no: compiled autograd stays off\n",
                v);
    return false;
}

bool gj_fe_compiled_enabled(void) {
    int f = atomic_load(&g_compiled);
    if (f < 0) {
        int want = env_switch(getenv("GRADJIT_COMPILED_AUTOGRAD")) ? 1 : 0;
        atomic_compare_exchange_strong(&g_compiled, &f, want);
        f = atomic_load(&g_compiled);
    }
    return f == 1;
}

void gj_fe_set_compiled(bool on) { atomic_store(&g_compiled, on ? 1 : 0); }

int gj_fe_step_check_env(void) {
    const char *e = getenv("GRADJIT_STEP_CHECK");
    if (!e || !*e) return 0;
    char *end = NULL;
    long n = strtol(e, &end, 10);
    if (*end == '\0' && n > 0 && n <= INT32_MAX) return (int)n;
    fprintf(stderr, "gradjit: GRADJIT_STEP_CHECK=%s is not a count >= 1: ignored\n", e);
    return 0;
}

size_t gj_fe_step_budget_env(void) {
    const char *e = getenv("GRADJIT_STEP_MEM_BUDGET_MB");
    if (!e || !*e) return 0;
    char *end = NULL;
    long long n = strtoll(e, &end, 10);
    if (*end == '\0' && n > 0 && (unsigned long long)n <= (SIZE_MAX >> 21))
        return (size_t)n << 20;
    fprintf(stderr, "gradjit: GRADJIT_STEP_MEM_BUDGET_MB=%s is not a size in MiB >= 1: ignored\n",
            e);
    return 0;
}

bool gj_fe_step_trace_computing_env(void) {
    const char *e = getenv("GRADJIT_STEP_TRACE");
    if (!e || !*e || strcasecmp(e, "abstract") == 0) return false;
    if (strcasecmp(e, "computing") == 0) return true;
    fprintf(stderr, "gradjit: GRADJIT_STEP_TRACE=%s is not abstract or computing: the first "
                    "trace stays abstract\n", e);
    return false;
}
