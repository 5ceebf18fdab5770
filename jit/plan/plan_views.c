/* SPDX-License-Identifier: MIT */
/*
 * plan_views.c - view folding: a movement op (permute, transpose, expand,
 * reshape, narrow, ...) applied to a strided view of a buffer is another
 * strided view of the same buffer, so it costs no instruction and no copy.
 *
 * Contract: gj_jit_pl_fold_view is pure (no planner state); it either
 * writes the output view (offset and strides over the output shape, the
 * input's buffer) and returns true, or returns false when the strided form
 * cannot express the result (a reshape of an incompatible layout), and the
 * caller then copies the value into a contiguous buffer first. Strides
 * follow torch's rules, so a fold is valid exactly where torch's view is.
 */
#include "jit/plan/plan_int.h"

/* torch's stride computation for a view with a new shape; false if the
 * strided layout cannot express it. */
static bool reshape_strides(int on, const int64_t *oshape, const int64_t *ostr, int nn,
                            const int64_t *nshape, int64_t *nstr) {
    if (numel_of(on, oshape) == 0 || on == 0) {
        contig_strides(nn, nshape, nstr);
        return true;
    }
    int view_d = nn - 1;
    int64_t chunk = ostr[on - 1], tnum = 1, vnum = 1;
    for (int td = on - 1; td >= 0; td--) {
        tnum *= oshape[td];
        if (td == 0 || (oshape[td - 1] != 1 && ostr[td - 1] != tnum * chunk)) {
            while (view_d >= 0 && (vnum < tnum || nshape[view_d] == 1)) {
                nstr[view_d] = vnum * chunk;
                vnum *= nshape[view_d];
                view_d--;
            }
            if (vnum != tnum) return false;
            if (td > 0) {
                chunk = ostr[td - 1];
                tnum = 1;
                vnum = 1;
            }
        }
    }
    return view_d == -1;
}

/* out = movement inst applied to view in (shape im -> om). false if not
 * expressible (RESHAPE of an incompatible layout). */
bool gj_jit_pl_fold_view(const gj_rt_inst *inst, const gj_rt_meta *im, const vinfo *in,
                      const gj_rt_meta *om, vinfo *out) {
    out->offset = in->offset;
    switch (inst->prim) {
    case GJ_P_PERMUTE:
        for (int k = 0; k < om->ndim; k++) out->strides[k] = in->strides[inst->shape[k]];
        return true;
    case GJ_P_EXPAND: {
        int lead = om->ndim - im->ndim;
        for (int k = 0; k < om->ndim; k++) {
            int s = k - lead;
            out->strides[k] = (s < 0 || (im->shape[s] == 1 && om->shape[k] != 1))
                                  ? 0
                                  : in->strides[s];
        }
        return true;
    }
    case GJ_P_SLICE: {
        int ax = inst->axis < 0 ? inst->axis + im->ndim : inst->axis;
        memcpy(out->strides, in->strides, sizeof out->strides);
        out->offset = in->offset + inst->start * in->strides[ax];
        return true;
    }
    case GJ_P_RESHAPE:
        return reshape_strides(im->ndim, im->shape, in->strides, om->ndim, om->shape,
                               out->strides);
    default:
        return false;
    }
}
