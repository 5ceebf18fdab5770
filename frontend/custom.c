/* SPDX-License-Identifier: MIT */
/*
 * custom.c - the public API of custom ops (the schema parser, libffi calls
 * and the op definition are in autograd/custom.c).
 *
 * Invariants: every output handed to the caller is a new reference given to
 * the innermost open scope (gj_fe_own), like every other op's; the user's
 * forward and backward functions run inside a scope of this frontend.
 */
#include "fe.h"

gj_custom_op *gj_custom_op_define(const char *schema, void *forward_fn, void *backward_fn) {
    gj_fe_use_scopes();
    return gj_ag_custom_define(schema, forward_fn, backward_fn);
}

gj_custom_op *gj_custom_op_find(const char *name) { return gj_ag_custom_find(name); }

int gj_custom_op_call(gj_custom_op *op, gj_tensor *const *tensor_args,
                      const double *scalar_args, gj_tensor **outs) {
    if (gj_ag_custom_call(op, tensor_args, scalar_args, outs) != 0) {
        gj_rt_null_result(); /* a NULL output passed on cites this failure */
        return -1;
    }
    int n = gj_ag_custom_n_outputs(op), rc = 0;
    for (int k = 0; k < n; k++) {
        outs[k] = gj_fe_own(outs[k]); /* releases it on OOM */
        if (!outs[k]) rc = -1;
    }
    if (rc != 0)
        for (int k = 0; k < n; k++) {
            gj_release(outs[k]);
            outs[k] = NULL;
        }
    if (rc != 0) gj_rt_null_result();
    return rc;
}
