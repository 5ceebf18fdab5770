/* SPDX-License-Identifier: MIT */
/*
 * kernels_movement.c - RESHAPE, PERMUTE, EXPAND, SLICE (views) and PAD,
 * CAT (new contiguous tensors). COPY and CAST go straight to
 * gj_rt_copy_into from gj_rt_exec.
 *
 * Invariants:
 *   - A view is a new header over the input's storage (gj_rt_tensor_view
 *     retains it), with the input's offset/strides transformed; no data
 *     moves. RESHAPE only views a contiguous input; otherwise it copies the
 *     input to a contiguous tensor first and views that.
 *   - PAD and CAT write each input through a temporary view of the
 *     (zero-filled / fresh) output region it occupies, with the strided
 *     copy of rt (gj_rt_copy_into); the temporary headers are released
 *     before returning.
 */
#include "runtime/kernels.h"

gj_tensor *gj_rt_k_view_op(const gj_rt_inst *inst, gj_tensor *x, const gj_rt_meta *om) {
    int64_t st[GJ_MAX_DIMS];
    int64_t off = x->offset;
    switch (inst->prim) {
    case GJ_P_RESHAPE: {
        if (gj_rt_is_contiguous(x))
            return gj_rt_tensor_view(x->storage, x->dtype, om->ndim, om->shape, NULL, off);
        gj_tensor *c = gj_rt_contiguous(x);
        if (!c)
            return NULL;
        gj_tensor *v = gj_rt_tensor_view(c->storage, c->dtype, om->ndim, om->shape, NULL,
                                         c->offset);
        gj_rt_tensor_release(c);
        return v;
    }
    case GJ_P_PERMUTE:
        for (int k = 0; k < om->ndim; k++)
            st[k] = x->strides[inst->shape[k]];
        break;
    case GJ_P_EXPAND: {
        int lead = om->ndim - x->ndim;
        for (int k = 0; k < om->ndim; k++) {
            int kx = k - lead;
            st[k] = (kx < 0 || x->shape[kx] != om->shape[k]) ? 0 : x->strides[kx];
        }
        break;
    }
    case GJ_P_SLICE: {
        int ax = inst->axis < 0 ? inst->axis + x->ndim : inst->axis;
        for (int k = 0; k < om->ndim; k++)
            st[k] = x->strides[k];
        if (om->shape[ax] > 0)
            off += inst->start * x->strides[ax];
        break;
    }
    default:
        gj_rt_set_error("%s: not a view primitive", gj_rt_prim_name(inst->prim));
        return NULL;
    }
    return gj_rt_tensor_view(x->storage, x->dtype, om->ndim, om->shape, st, off);
}

/* Copies src into the region of out that starts at `pos` on axis ax and has
 * src's shape. */
static int gj_k_place(gj_tensor *out, int ax, int64_t pos, const gj_tensor *src) {
    if (src->numel == 0)
        return 0;
    gj_tensor *v = gj_rt_tensor_view(out->storage, out->dtype, out->ndim, src->shape,
                                     out->strides, out->offset + pos * out->strides[ax]);
    if (!v)
        return -1;
    int rc = gj_rt_copy_into(v, src);
    gj_rt_tensor_release(v);
    return rc;
}

int gj_rt_k_pad(const gj_rt_inst *inst, gj_tensor *x, gj_tensor *out) {
    int ax = inst->axis < 0 ? inst->axis + x->ndim : inst->axis;
    return gj_k_place(out, ax, inst->start, x);
}

int gj_rt_k_cat(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor *out) {
    int ax = inst->axis < 0 ? inst->axis + in[0]->ndim : inst->axis;
    int64_t pos = 0;
    for (int i = 0; i < inst->n_in; i++) {
        if (gj_k_place(out, ax, pos, in[i]) != 0)
            return -1;
        pos += in[i]->shape[ax];
    }
    return 0;
}
