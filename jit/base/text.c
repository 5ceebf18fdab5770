/* SPDX-License-Identifier: MIT */
/*
 * text.c - the growable text writer (gj_jit_text, base.h): printf-style
 * appends into one buffer that doubles as it fills. The training step's
 * key texts are written with it; capture/key.c keeps its own writer, which
 * is on the backward's hot path and writes into the walk.
 */
#include "jit/base/base.h"

#include <stdarg.h>
#include <stdio.h>

void gj_jit_text_put(gj_jit_text *t, const char *fmt, ...) {
    if (t->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = t->cap - t->n;
        int k = vsnprintf(t->p ? t->p + t->n : NULL, t->p ? room : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            t->oom = true;
            return;
        }
        if (t->p && (size_t)k < room) {
            t->n += (size_t)k;
            return;
        }
        size_t nc = (t->cap ? t->cap * 2 : 4096) + (size_t)k;
        char *q = gj_rt_realloc(t->p, nc);
        if (!q) {
            t->oom = true;
            return;
        }
        t->p = q;
        t->cap = nc;
    }
}
