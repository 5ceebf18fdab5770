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
 * lower.c emits one function per distinct description and every instruction with
 * that name calls it.
 *
 * A generic plan (plan/symbolic.c) compares generic descriptions: the sizes,
 * offsets and schedule are read at run time, so kernels that differ only
 * in them (a layer's kernels at two widths) share one function too.
 *
 * Contract: runs after the kernel names are set ("k<instruction>") and before
 * lowering; only names change. Descriptions are compared byte for byte
 * after serialising every field with the disk cache's writers (base/wbuf.h).
 */
#include "jit/plan/plan.h"
#include "jit/base/base.h"

#include <string.h>

/* A stride as a generic kernel sees it: 0 (broadcast) and 1 (contiguous)
 * change the code, any other value is read at run time. */
static int64_t stride_class(int64_t s) { return s == 0 ? 0 : s == 1 ? 1 : 2; }

void gj_jit_kernel_describe(const gj_jit_plan *p, const gj_jit_kernel *k, bool generic,
                            wbuf *b) {
    wbuf_i64(b, generic ? -1 : k->nd); /* a generic description never equals a plain one */
    wbuf_i64(b, k->nd);
    if (!generic) {
        wbuf_dims(b, k->dims, k->nd);
        wbuf_i64(b, k->block);
        wbuf_i64(b, k->nblk);
        wbuf_i64(b, k->rows);
        wbuf_i64(b, k->grain);
    }
    wbuf_i64(b, k->red);
    wbuf_i64(b, k->n_params);
    for (int q = 0; q < k->n_params; q++) /* the dropout parameter slot, if any */
        wbuf_i64(b, k->param_buf[q] == p->params_buf);
    wbuf_i64(b, k->n_acc);
    for (int a = 0; a < k->n_acc; a++) {
        const gj_jit_access *x = &k->acc[a];
        const gj_jit_buffer *bf = &p->bufs[x->buf];
        wbuf_i64(b, x->dtype);
        if (generic) {
            for (int d = 0; d < k->nd; d++) wbuf_i64(b, stride_class(x->strides[d]));
        } else {
            wbuf_i64(b, x->offset);
            wbuf_dims(b, x->strides, k->nd);
        }
        bool gen = bf->kind == GJ_JIT_BUF_IOTA || bf->kind == GJ_JIT_BUF_DROPOUT;
        wbuf_i64(b, gen ? (int64_t)bf->kind : -1);
        if (gen) { /* constants of the code, generic or not */
            wbuf_i64(b, bf->gen_inner);
            wbuf_i64(b, bf->gen_len);
            wbuf_i64(b, bf->gen_param);
            wbuf_i64(b, (int64_t)bf->gen_seed);
            wbuf_i64(b, (int64_t)bf->gen_offset);
            wbuf_f64(b, bf->gen_p);
        } else {
            int slot = -1;
            for (int q = 0; q < k->n_params && slot < 0; q++)
                if (k->param_buf[q] == x->buf) slot = q;
            wbuf_i64(b, slot);
        }
    }
    wbuf_kernel_code(b, k, generic);
}

int gj_jit_dedupe_kernels(gj_jit_plan *p) {
    int rc = -1, n = p->n_instrs;
    wbuf *d = gj_rt_calloc((size_t)n + 1, sizeof *d);
    if (!d) return -1;
    for (int s = 0; s < n; s++) {
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL) continue;
        gj_jit_kernel_describe(p, &p->instrs[s].k, gj_jit_kernel_generic(p, &p->instrs[s].k), &d[s]);
        if (d[s].oom) goto done;
        for (int t = 0; t < s; t++)
            if (p->instrs[t].kind == GJ_JIT_INSTR_KERNEL && d[t].n == d[s].n &&
                memcmp(d[t].p, d[s].p, d[s].n) == 0) {
                memcpy(p->instrs[s].k.name, p->instrs[t].k.name, sizeof p->instrs[s].k.name);
                break;
            }
    }
    rc = 0;
done:
    for (int s = 0; s < n; s++) gj_rt_free(d[s].p);
    gj_rt_free(d);
    return rc;
}
