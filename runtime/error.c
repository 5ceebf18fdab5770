/* SPDX-License-Identifier: MIT */
/*
 * error.c - the thread-local error message behind gj_last_error(), and the
 * "cause" a NULL tensor argument cites.
 *
 * Invariants: every thread owns one fixed buffer (no allocation, so setting
 * an error can never fail, not even while reporting an out-of-memory). The
 * buffer always holds a NUL-terminated string; "" means "no error". A new
 * error replaces the old one; messages longer than the buffer are truncated.
 * Successful calls neither set nor clear it (errno's rule; gradjit.h lists
 * the few calls that clear it on success).
 *
 * The cause: g_error_gen counts the messages set on this thread. When a
 * public call hands its caller a NULL tensor because it failed
 * (gj_rt_null_result), g_null_gen records the generation of the message
 * that explains it. That message is the cause of a NULL tensor argument
 * only while it is still the newest one (no error set since) and no call
 * has handed out a tensor (gj_rt_tensor_result) since: the NULL the
 * argument holds can then only come from that failure, or be passed
 * through untouched (gj_retain(NULL)). A check that cites a cause marks
 * its own message (which carries it) as the cause again, so the same NULL
 * used twice cites it twice. A failure that returns a status,
 * not a tensor, never becomes a cause, so "t is NULL" after an unrelated
 * failed gj_state_dict_add says just that.
 */
#include "runtime/rt.h"

#include <stdio.h>
#include <string.h>

#define GJ_RT_ERROR_CAP 4096

static _Thread_local char gj_rt_error_buf[GJ_RT_ERROR_CAP];
static _Thread_local uint64_t g_error_gen; /* messages set on this thread */
static _Thread_local uint64_t g_null_gen;  /* g_error_gen at the last NULL result; 0: none */

/* Formats into a scratch buffer first, so arguments may point into the
 * current message (e.g. to prefix it with context). */
void gj_rt_set_error(const char *fmt, ...) {
    char tmp[GJ_RT_ERROR_CAP];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(tmp, sizeof tmp, "(unformattable error message: %s)", fmt);
    memcpy(gj_rt_error_buf, tmp, sizeof tmp);
    g_error_gen++;
}

const char *gj_last_error(void) { return gj_rt_error_buf; }

void gj_clear_error(void) {
    gj_rt_error_buf[0] = '\0';
    g_null_gen = 0;
}

void gj_rt_null_result(void) { g_null_gen = gj_rt_error_buf[0] ? g_error_gen : 0; }

void gj_rt_tensor_result(void) { g_null_gen = 0; }

const char *gj_rt_null_cause(void) {
    if (g_null_gen == 0 || g_null_gen != g_error_gen || !gj_rt_error_buf[0]) return NULL;
    return gj_rt_error_buf;
}

/* "[d0, d1, ...]"; truncated output stays NUL-terminated. cap 0 leaves buf
 * untouched. Returns buf. */
char *gj_rt_fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    if (!buf || cap == 0)
        return buf;
    size_t pos = 0;
    int n = snprintf(buf, cap, "[");
    pos = n > 0 ? (size_t)n : 0;
    for (int k = 0; k < ndim && shape && pos < cap; k++) {
        n = snprintf(buf + pos, cap - pos, k ? ", %lld" : "%lld", (long long)shape[k]);
        if (n < 0)
            break;
        pos += (size_t)n;
    }
    if (pos < cap)
        snprintf(buf + pos, cap - pos, "]");
    return buf;
}

const char *gj_rt_dtype_name(gj_dtype dt) {
    switch (dt) {
    case GJ_F32: return "f32";
    case GJ_F64: return "f64";
    case GJ_BF16: return "bf16";
    case GJ_I64: return "i64";
    }
    return "invalid-dtype";
}
