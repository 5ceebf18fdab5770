/* SPDX-License-Identifier: MIT */
/*
 * reducer.c - the registry of gradient reducers (jit.h, gj_jit_reducer):
 * dist/ registers each gj_ddp's reducer while it lives, and the frontend
 * finds the one a step was given. The reducer's calls themselves are
 * instructions of the step's program (step_capture.c, variants.c).
 *
 * Invariants: an owner has at most one entry; lookups and changes hold
 * one lock; an entry points at the owner's reducer, which outlives it.
 */
#include "jit/step/step_int.h"

#include <pthread.h>

typedef struct entry {
    const void *owner;
    const gj_jit_reducer *r;
} entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static entry *g_e;
static int g_n, g_cap;

int gj_jit_reducer_register(const void *owner, const gj_jit_reducer *r) {
    if (!owner || !r) {
        gj_rt_set_error("gj_jit_reducer_register: %s is NULL", !owner ? "owner" : "reducer");
        return -1;
    }
    int rc = 0;
    pthread_mutex_lock(&g_lock);
    int k = 0;
    while (k < g_n && g_e[k].owner != owner) k++;
    if (k == g_n) {
        if (g_n == g_cap) {
            int nc = g_cap ? 2 * g_cap : 4;
            entry *e = gj_rt_realloc(g_e, (size_t)nc * sizeof *e);
            if (!e) {
                rc = -1;
                goto out;
            }
            g_e = e;
            g_cap = nc;
        }
        g_n++;
    }
    g_e[k] = (entry){owner, r};
out:
    pthread_mutex_unlock(&g_lock);
    return rc;
}

void gj_jit_reducer_unregister(const void *owner) {
    pthread_mutex_lock(&g_lock);
    for (int k = 0; k < g_n; k++)
        if (g_e[k].owner == owner) {
            g_e[k] = g_e[--g_n];
            break;
        }
    if (g_n == 0) { /* (nothing left: no allocation outlives the last reducer) */
        gj_rt_free(g_e);
        g_e = NULL;
        g_cap = 0;
    }
    pthread_mutex_unlock(&g_lock);
}

bool gj_jit_reducer_owns_hook(int64_t handle) {
    bool own = false;
    pthread_mutex_lock(&g_lock);
    for (int k = 0; k < g_n && !own; k++)
        for (int i = 0; i < g_e[k].r->n && !own; i++) own = g_e[k].r->hooks[i] == handle;
    pthread_mutex_unlock(&g_lock);
    return own;
}

const gj_jit_reducer *gj_jit_reducer_find(const void *owner) {
    const gj_jit_reducer *r = NULL;
    pthread_mutex_lock(&g_lock);
    for (int k = 0; k < g_n && !r; k++)
        if (g_e[k].owner == owner) r = g_e[k].r;
    pthread_mutex_unlock(&g_lock);
    return r;
}
