/* SPDX-License-Identifier: MIT */
/*
 * kernels.c - the process-wide registry of compiled kernels, which lets a
 * program of a new size bind to the kernels of a symbolic program
 * (plan/symbolic.c) instead of compiling.
 *
 * The registry maps kernel descriptions (generic ones for symbolic
 * plans, full ones for specialised plans: dedupe.c) to compiled kernel
 * functions, process-wide: a kernel another program compiled is not
 * compiled again (two call sites, a gj_grad and a backward of one model).
 * It holds one reference to each code object it indexes; a program bound
 * to registered kernels holds one per code object it uses
 * (gj_jit_program.shared), so code stays mapped while any program calls
 * it. gj_jit_generic_sweep drops the code objects only the registry
 * still holds.
 *
 * Invariants:
 *   - A description is compared byte for byte (its 128-bit hash first).
 *   - The registry lock is taken after cache.c's cache lock, never
 *     before it, and no LLVM lock is taken under it except by
 *     gj_jit_code_free in the sweep (llvmjit.c's lock is a leaf).
 */
#include "jit/cache/cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void gj_jit_generic_prefix(char out[48]) {
    uint64_t h[2];
    gj_jit_nonce(h);
    snprintf(out, 48, "gjs%016llx%016llx", (unsigned long long)h[0], (unsigned long long)h[1]);
}

/* ------------------------------------------------------------ registry */

typedef struct reg_entry {
    uint64_t h[2];
    unsigned char *desc;
    size_t n;
    gj_rt_range_fn fn;
    gj_jit_code *code;
    char sym[96]; /* fn's symbol in code: "<prefix>_<name>" */
} reg_entry;

static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static reg_entry *g_reg;
static int g_n_reg, g_cap_reg;
static gj_jit_code **g_codes; /* the code objects the registry holds a reference to */
static int g_n_codes, g_cap_codes;

static int find_locked(const wbuf *d, const uint64_t h[2]) {
    for (int i = 0; i < g_n_reg; i++)
        if (g_reg[i].h[0] == h[0] && g_reg[i].h[1] == h[1] && g_reg[i].n == d->n &&
            memcmp(g_reg[i].desc, d->p, d->n) == 0)
            return i;
    return -1;
}

/* The code object among lent[0..n_lent) whose prefix starts symbol sym
 * ("<prefix>_..."), or NULL. */
static gj_jit_code *lender_of(const char *sym, gj_jit_code *const *lent, int n_lent) {
    for (int c = 0; c < n_lent; c++) {
        const char *pre = gj_jit_code_prefix(lent[c]);
        size_t n = strlen(pre);
        if (n > 0 && strncmp(sym, pre, n) == 0 && sym[n] == '_') return lent[c];
    }
    return NULL;
}

/* Ensures room for one more code object in g_codes (lock held). */
static int codes_room(void) {
    if (g_n_codes < g_cap_codes) return 0;
    int nc = g_cap_codes ? 2 * g_cap_codes : 8;
    gj_jit_code **c = gj_rt_realloc(g_codes, (size_t)nc * sizeof *c);
    if (!c) return -1;
    g_codes = c;
    g_cap_codes = nc;
    return 0;
}

/* Whether the registry holds a reference to c (lock held). */
static bool codes_have(const gj_jit_code *c) {
    for (int i = 0; i < g_n_codes; i++)
        if (g_codes[i] == c) return true;
    return false;
}

int gj_jit_kernels_register(const gj_jit_plan *p, gj_jit_code *code, gj_jit_code *const *lent,
                            int n_lent) {
    int rc = 0;
    pthread_mutex_lock(&g_reg_lock);
    for (int s = 0; s < p->n_instrs && rc == 0; s++) {
        const gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || !k->fn) continue;
        gj_jit_code *c = k->shared ? lender_of(k->lent, lent, n_lent) : code;
        if (!c) continue;
        wbuf d = {0};
        gj_jit_kernel_describe(p, k, gj_jit_kernel_generic(p, k), &d);
        uint64_t h[2];
        gj_jit_hash128(d.p, d.n, h);
        if (d.oom) rc = -1;
        else if (find_locked(&d, h) < 0) {
            if (g_n_reg == g_cap_reg) {
                int nc = g_cap_reg ? 2 * g_cap_reg : 32;
                reg_entry *r = gj_rt_realloc(g_reg, (size_t)nc * sizeof *r);
                if (!r) rc = -1;
                else {
                    g_reg = r;
                    g_cap_reg = nc;
                }
            }
            if (rc == 0 && !codes_have(c) && codes_room() != 0) rc = -1;
            if (rc == 0) {
                reg_entry *e = &g_reg[g_n_reg++];
                *e = (reg_entry){{h[0], h[1]}, d.p, d.n, k->fn, c, ""};
                if (k->shared) snprintf(e->sym, sizeof e->sym, "%s", k->lent);
                else snprintf(e->sym, sizeof e->sym, "%s_%s", gj_jit_code_prefix(c), k->name);
                d.p = NULL;
                if (!codes_have(c)) {
                    gj_jit_code_ref(c);
                    g_codes[g_n_codes++] = c;
                }
            }
        }
        gj_rt_free(d.p);
    }
    pthread_mutex_unlock(&g_reg_lock);
    return rc;
}

int gj_jit_kernels_bind(gj_jit_plan *p, bool partial, gj_jit_code ***codes_out, int *n_codes_out,
                        char *why, size_t why_cap) {
    why[0] = '\0';
    *codes_out = NULL;
    *n_codes_out = 0;
    int n_k = 0;
    for (int s = 0; s < p->n_instrs; s++) n_k += p->instrs[s].kind == GJ_JIT_INSTR_KERNEL;
    if (n_k == 0) return partial ? 0 : 1; /* nothing to share (nor to compile) */
    gj_jit_code **codes = gj_rt_calloc((size_t)n_k + 1, sizeof *codes);
    if (!codes) return -1;
    int n_codes = 0, missing = 0, rc = 0;
    pthread_mutex_lock(&g_reg_lock);
    for (int s = 0; s < p->n_instrs && rc == 0 && (partial || missing == 0); s++) {
        gj_jit_kernel *k = &p->instrs[s].k;
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL) continue;
        bool first = true; /* (one lookup per distinct kernel: dedupe.c's names) */
        for (int t = 0; t < s && first; t++)
            first = !(p->instrs[t].kind == GJ_JIT_INSTR_KERNEL && strcmp(p->instrs[t].k.name, k->name) == 0);
        if (!first) continue;
        wbuf d = {0};
        gj_jit_kernel_describe(p, k, gj_jit_kernel_generic(p, k), &d);
        uint64_t h[2];
        gj_jit_hash128(d.p, d.n, h);
        int i = d.oom ? -2 : find_locked(&d, h);
        gj_rt_free(d.p);
        if (i >= 0 && gj_jit_kernel_generic(p, k) && !gj_jit_generic_block_ok(k)) i = -1; /* cannot happen (plan_kernel.c) */
        if (i == -2) {
            rc = -1;
        } else if (i < 0) {
            if (!missing++)
                snprintf(why, why_cap, "instruction %d (kernel over %d dims, %d accesses, %d expressions) "
                         "matches no compiled %skernel", s, k->nd, k->n_acc, k->n_ex,
                         p->generic ? "symbolic " : "");
        } else {
            for (int t = s; t < p->n_instrs; t++) /* every instruction calling it */
                if (p->instrs[t].kind == GJ_JIT_INSTR_KERNEL && strcmp(p->instrs[t].k.name, k->name) == 0) {
                    p->instrs[t].k.fn = g_reg[i].fn;
                    p->instrs[t].k.shared = true;
                    memcpy(p->instrs[t].k.lent, g_reg[i].sym, sizeof g_reg[i].sym);
                }
            bool have = false;
            for (int c = 0; c < n_codes && !have; c++) have = codes[c] == g_reg[i].code;
            if (!have) codes[n_codes++] = g_reg[i].code;
        }
    }
    bool keep = rc == 0 && (partial || missing == 0);
    if (keep)
        for (int c = 0; c < n_codes; c++) gj_jit_code_ref(codes[c]);
    pthread_mutex_unlock(&g_reg_lock);
    if (!keep) {
        for (int s = 0; s < p->n_instrs; s++)
            if (p->instrs[s].k.shared) {
                p->instrs[s].k.fn = NULL;
                p->instrs[s].k.shared = false;
                p->instrs[s].k.lent[0] = '\0';
            }
        gj_rt_free(codes);
        return rc < 0 ? -1 : 1;
    }
    if (n_codes == 0) {
        gj_rt_free(codes);
        codes = NULL;
    }
    *codes_out = codes;
    *n_codes_out = n_codes;
    return partial ? missing : 0;
}

/* Removes code object #ci and its entries from the registry (lock held);
 * returns it: the caller drops the registry's reference after unlocking. */
static gj_jit_code *forget_locked(int ci) {
    gj_jit_code *c = g_codes[ci];
    int w = 0;
    for (int i = 0; i < g_n_reg; i++) {
        if (g_reg[i].code == c) gj_rt_free(g_reg[i].desc);
        else g_reg[w++] = g_reg[i];
    }
    g_n_reg = w;
    g_codes[ci] = g_codes[--g_n_codes];
    return c;
}

void gj_jit_generic_sweep(bool all) {
    for (;;) {
        gj_jit_code *c = NULL;
        pthread_mutex_lock(&g_reg_lock);
        for (int ci = 0; ci < g_n_codes && !c; ci++)
            if (all || gj_jit_code_refs(g_codes[ci]) == 1) c = forget_locked(ci);
        if (!c && g_n_codes == 0) {
            gj_rt_free(g_reg);
            gj_rt_free(g_codes);
            g_reg = NULL;
            g_codes = NULL;
            g_cap_reg = g_cap_codes = 0;
        }
        pthread_mutex_unlock(&g_reg_lock);
        if (!c) return;
        gj_jit_code_free(c); /* the registry's reference */
    }
}

int gj_jit_generic_kernels(void) {
    pthread_mutex_lock(&g_reg_lock);
    int n = g_n_reg;
    pthread_mutex_unlock(&g_reg_lock);
    return n;
}
