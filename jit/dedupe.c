/* SPDX-License-Identifier: MIT */
/*
 * dedupe.c - fused kernels that are the same function share one.
 *
 * Eight identical layers give eight copies of each fused kernel; LLVM
 * compiling each copy is most of a cold compile. A kernel's machine code
 * depends only on its description: iteration space, schedule, accesses
 * (dtype, offset, strides, and which parameter slot or which generated
 * buffer they read), expressions and stores -- not on which buffers its
 * parameter slots point to at run time. gj_jit_dedupe_kernels gives every
 * kernel whose description equals an earlier one's that kernel's name, so
 * lower.c emits one function per distinct description and every step with
 * that name calls it.
 *
 * Contract: runs after the kernel names are set ("k<step>") and before
 * lowering; only names change. Descriptions are compared byte for byte
 * after serialising every field (no struct padding, no pointers).
 */
#include "plan.h"

#include <string.h>

typedef struct kbuf {
    unsigned char *p;
    size_t n, cap;
    bool oom;
} kbuf;

static void put(kbuf *b, const void *v, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 512;
        while (cap < b->n + n) cap *= 2;
        unsigned char *q = gj_rt_realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, v, n);
    b->n += n;
}

static void put_i64(kbuf *b, int64_t v) { put(b, &v, sizeof v); }
static void put_f64(kbuf *b, double v) { put(b, &v, sizeof v); }

/* The description of kernel k of plan p into b (see the file comment). */
static void describe(const gj_jit_plan *p, const gj_jit_kernel *k, kbuf *b) {
    put_i64(b, k->nd);
    for (int d = 0; d < k->nd; d++) put_i64(b, k->dims[d]);
    put_i64(b, k->red);
    put_i64(b, k->block);
    put_i64(b, k->nblk);
    put_i64(b, k->rows);
    put_i64(b, k->grain);
    put_i64(b, k->n_params);
    for (int q = 0; q < k->n_params; q++) /* the dropout parameter slot, if any */
        put_i64(b, k->param_buf[q] == p->params_buf);
    put_i64(b, k->n_acc);
    for (int a = 0; a < k->n_acc; a++) {
        const gj_jit_access *x = &k->acc[a];
        const gj_jit_buffer *bf = &p->bufs[x->buf];
        put_i64(b, x->dtype);
        put_i64(b, x->offset);
        for (int d = 0; d < k->nd; d++) put_i64(b, x->strides[d]);
        bool gen = bf->kind == GJ_JIT_BUF_IOTA || bf->kind == GJ_JIT_BUF_DROPOUT;
        put_i64(b, gen ? (int64_t)bf->kind : -1);
        if (bf->kind == GJ_JIT_BUF_IOTA || bf->kind == GJ_JIT_BUF_DROPOUT) {
            put_i64(b, bf->gen_inner);
            put_i64(b, bf->gen_len);
            put_i64(b, bf->gen_param);
            put_i64(b, (int64_t)bf->gen_seed);
            put_i64(b, (int64_t)bf->gen_offset);
            put_f64(b, bf->gen_p);
        } else {
            int slot = -1;
            for (int q = 0; q < k->n_params && slot < 0; q++)
                if (k->param_buf[q] == x->buf) slot = q;
            put_i64(b, slot);
        }
    }
    put_i64(b, k->n_ex);
    for (int e = 0; e < k->n_ex; e++) {
        const gj_jit_expr *x = &k->ex[e];
        put_i64(b, x->kind);
        put_i64(b, x->dtype);
        put_i64(b, x->access);
        put_f64(b, x->cval);
        for (int i = 0; i < 3; i++) put_i64(b, x->args[i]);
        if (x->kind == GJ_JIT_E_OP) { /* the instruction: primitive and attributes */
            const gj_rt_inst *in = &x->inst;
            put_i64(b, in->prim);
            put_i64(b, in->n_in);
            put_f64(b, in->scalar);
            put_i64(b, in->dtype);
            put_i64(b, in->axes);
            put_i64(b, in->keepdim);
            put_i64(b, in->ta);
            put_i64(b, in->tb);
            put_i64(b, in->axis);
            put_i64(b, in->start);
            put_i64(b, in->len);
            put_i64(b, (int64_t)in->seed);
            put_i64(b, (int64_t)in->rng_offset);
            put_i64(b, in->ndim);
            for (int d = 0; d < in->ndim && d < GJ_MAX_DIMS; d++) put_i64(b, in->shape[d]);
        }
    }
    put_i64(b, k->n_st);
    for (int s = 0; s < k->n_st; s++) {
        put_i64(b, k->st[s].access);
        put_i64(b, k->st[s].expr);
        put_i64(b, k->st[s].reduce);
        put_i64(b, k->st[s].max);
    }
}

int gj_jit_dedupe_kernels(gj_jit_plan *p) {
    int rc = -1, n = p->n_steps;
    kbuf *d = gj_rt_calloc((size_t)n + 1, sizeof *d);
    if (!d) return -1;
    for (int s = 0; s < n; s++) {
        if (p->steps[s].kind != GJ_JIT_STEP_KERNEL) continue;
        describe(p, &p->steps[s].k, &d[s]);
        if (d[s].oom) goto done;
        for (int t = 0; t < s; t++)
            if (p->steps[t].kind == GJ_JIT_STEP_KERNEL && d[t].n == d[s].n &&
                memcmp(d[t].p, d[s].p, d[s].n) == 0) {
                memcpy(p->steps[s].k.name, p->steps[t].k.name, sizeof p->steps[s].k.name);
                break;
            }
    }
    rc = 0;
done:
    for (int s = 0; s < n; s++) gj_rt_free(d[s].p);
    gj_rt_free(d);
    return rc;
}
