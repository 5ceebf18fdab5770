/* SPDX-License-Identifier: MIT */
/*
 * checkpoint.c - gj_checkpoint, the public entry of activation
 * checkpointing (the tape, the region's node and its backward live in
 * autograd/checkpoint.c).
 *
 * Ownership: fn runs inside a scope of its own, so everything it creates
 * and does not return dies when gj_checkpoint returns (that is what frees
 * a region's activations); what fn stores in out[] is owned by that scope
 * (or is one of in[], borrowed). The outputs handed to the caller are new
 * references, each a header of its own (never one of in[], never another
 * out[q]), given to the scope that is innermost once the region's scope
 * is closed -- the caller's, if one is open -- like any op's result. With
 * grad mode on they carry the region's node; under no-grad each is a new
 * header sharing the storage of what fn stored (so a tensor passed through
 * is never registered twice, in a scope and with the caller).
 */
#include "fe.h"

#include <stdio.h>

/* Validates the arguments (error set and false on a bad one). */
static bool ckpt_args_ok(gj_ckpt_fn fn, int n_in, gj_tensor *const *in, int n_out,
                         gj_tensor **out) {
    const char *op = "gj_checkpoint";
    if (!fn) {
        gj_rt_set_error("%s: fn is NULL", op);
        return false;
    }
    if (n_in < 0 || n_in > GJ_AG_MAX_IN || (n_in > 0 && !in)) {
        gj_rt_set_error("%s: needs 0 <= n_in <= %d and a non-NULL in[] (got n_in %d)", op,
                        GJ_AG_MAX_IN, n_in);
        return false;
    }
    if (n_out < 1 || n_out > GJ_AG_MAX_OUT || !out) {
        gj_rt_set_error("%s: needs 1 <= n_out <= %d and a non-NULL out[] (got n_out %d)", op,
                        GJ_AG_MAX_OUT, n_out);
        return false;
    }
    for (int i = 0; i < n_in; i++)
        if (!gj_rt_check_tensor(in[i], op, "in[i]")) return false;
    return true;
}

int gj_checkpoint(gj_ckpt_fn fn, void *user, int n_in, gj_tensor *const *in, int n_out,
                  gj_tensor **out, gj_ckpt_policy_fn policy, void *policy_data) {
    if (out && n_out > 0 && n_out <= GJ_AG_MAX_OUT)
        for (int k = 0; k < n_out; k++) out[k] = NULL;
    if (!ckpt_args_ok(fn, n_in, in, n_out, out)) goto fail;
    gj_ag_ckpt_region *r = NULL;
    if (gj_ag_grad_enabled()) { /* under no-grad nothing is recorded: fn just runs */
        r = gj_ag_ckpt_begin(n_in, in, policy, policy_data);
        if (!r) goto fail;
    } else if (gj_ag_ckpt_active()) {
        gj_rt_set_error("gj_checkpoint: nested checkpoint regions are not supported (a region "
                        "is already open on this thread)");
        goto fail;
    }
    gj_tensor *fo[GJ_AG_MAX_OUT] = {0}, *res[GJ_AG_MAX_OUT] = {0};
    int rc = -1;
    gj_scope_push();
    int frc = fn(user, n_in, in, n_out, fo);
    if (frc != 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", gj_last_error());
        gj_rt_set_error("gj_checkpoint: the region's function failed (returned %d): %s", frc,
                        msg[0] ? msg : "no error message");
        goto done;
    }
    for (int k = 0; k < n_out; k++) {
        if (!fo[k]) {
            gj_rt_set_error("gj_checkpoint: the region's function returned 0 but left out[%d] "
                            "NULL",
                            k);
            goto done;
        }
        if (!gj_rt_check_tensor(fo[k], "gj_checkpoint", "out[k] of the region's function"))
            goto done;
    }
    if (r) {
        gj_ag_ckpt_region *rr = r;
        r = NULL; /* gj_ag_ckpt_end always consumes it */
        if (gj_ag_ckpt_end(rr, n_out, fo, res) != 0) goto done;
    } else {
        /* a header of its own for each output, as gj_ag_ckpt_end gives
         * one to a passed-through input: what fn stored may be one of in[]
         * (the caller's, perhaps already in a scope) or stored twice */
        for (int k = 0; k < n_out; k++)
            if (!(res[k] = gj_rt_tensor_alias(fo[k]))) goto done;
    }
    rc = 0;
done:
    if (r) gj_ag_ckpt_abort(r);
    gj_scope_pop();
    for (int k = 0; k < n_out; k++) {
        if (rc == 0)
            out[k] = gj_fe_own(res[k]);
        else if (res[k])
            gj_rt_tensor_release(res[k]);
    }
    if (rc == 0)
        for (int k = 0; k < n_out; k++)
            if (!out[k]) { /* the scope could not register it (released): fail */
                for (int q = 0; q < n_out; q++)
                    if (out[q]) gj_release(out[q]);
                for (int q = 0; q < n_out; q++) out[q] = NULL;
                goto fail;
            }
    if (rc == 0) return 0;
fail:
    gj_rt_null_result(); /* out[] are NULL: a NULL passed on cites this failure */
    return -1;
}
