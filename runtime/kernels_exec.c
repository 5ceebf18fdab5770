/* SPDX-License-Identifier: MIT */
/*
 * kernels_exec.c - gj_rt_exec: run one primitive eagerly on real tensors.
 *
 * Invariants:
 *   - The order is always: validate the input pointers, gj_rt_infer (the
 *     one shape rule), allocate the outputs with the inferred metas, run the
 *     kernel. Inputs are borrowed and never modified.
 *   - Outputs are new references: fresh contiguous tensors, except the view
 *     primitives (RESHAPE of a contiguous input, PERMUTE, EXPAND, SLICE),
 *     which share the input's storage.
 *   - Outputs are allocated uninitialised (gj_rt_tensor_empty) when the
 *     kernel writes every element, zero (gj_rt_tensor_new) for PAD, and
 *     zero-filled for SCATTER_ADD_ROWS even when the block is new from the
 *     system: the scatter writes a few rows, and the pages it left
 *     untouched would be first touched by whichever later step reuses the
 *     block.
 *   - On any failure every output allocated so far is released, outs[] is
 *     all NULL, the error is set, and -1 is returned.
 */
#include "runtime/kernels.h"

static bool gj_k_needs_zero(gj_rt_prim p) { return p == GJ_P_PAD; }

/* Test instrumentation: executions per primitive (relaxed counters). */
static atomic_llong g_exec_count[GJ_P_COUNT];

int64_t gj_rt_exec_count(gj_rt_prim p) {
    if ((unsigned)p >= (unsigned)GJ_P_COUNT)
        return 0;
    return atomic_load_explicit(&g_exec_count[p], memory_order_relaxed);
}

void gj_rt_exec_count_reset(void) {
    for (int p = 0; p < GJ_P_COUNT; p++)
        atomic_store_explicit(&g_exec_count[p], 0, memory_order_relaxed);
}

/* An abstract trace's primitive (an abstract input): abstract outputs of
 * the inferred metas, nothing run. A view whose layout allows shares its
 * input's storage, as it shares bytes otherwise. */
static int exec_abstract(const gj_rt_inst *inst, gj_tensor *const *in, const gj_rt_meta *om,
                         int nout, gj_tensor **outs) {
    gj_rt_prim p = inst->prim;
    bool view = p == GJ_P_PERMUTE || p == GJ_P_EXPAND || p == GJ_P_SLICE ||
                (p == GJ_P_RESHAPE && gj_rt_is_contiguous(in[0]));
    if (view && gj_rt_is_abstract(in[0])) {
        outs[0] = gj_rt_k_view_op(inst, in[0], &om[0]);
        return outs[0] ? 1 : -1;
    }
    for (int k = 0; k < nout; k++) {
        if (!(outs[k] = gj_rt_tensor_abstract(om[k].dtype, om[k].ndim, om[k].shape))) {
            for (int j = 0; j < k; j++) {
                gj_rt_tensor_release(outs[j]);
                outs[j] = NULL;
            }
            return -1;
        }
    }
    return nout;
}

int gj_rt_exec(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs) {
    if (!inst || !outs) {
        gj_rt_set_error("exec: NULL %s", inst ? "outputs array" : "instruction");
        return -1;
    }
    for (int k = 0; k < GJ_RT_MAX_OUTPUTS; k++)
        outs[k] = NULL;
    if ((unsigned)inst->prim >= (unsigned)GJ_P_COUNT) {
        gj_rt_set_error("exec: invalid primitive %d", (int)inst->prim);
        return -1;
    }
    const char *name = gj_rt_prim_name(inst->prim);
    int n_in = inst->n_in;
    if (n_in < 0 || n_in > GJ_RT_MAX_INPUTS) {
        gj_rt_set_error("%s: invalid input count %d", name, n_in);
        return -1;
    }
    if (n_in > 0 && !in) {
        gj_rt_set_error("%s: NULL inputs array", name);
        return -1;
    }
    gj_rt_meta im[GJ_RT_MAX_INPUTS], om[GJ_RT_MAX_OUTPUTS];
    uint64_t epoch = 0;
    bool abstract = false;
    for (int i = 0; i < n_in; i++) {
        if (!gj_rt_check_tensor(in[i], name, "input"))
            return -1;
        gj_rt_meta_of(in[i], &im[i]);
        if (gj_rt_is_abstract(in[i]) && gj_rt_abstract()) {
            abstract = true;
        } else if (in[i]->storage->fetch) { /* remote (ZeRO stage 3): present before it is read */
            if (!epoch)
                epoch = gj_rt_fetch_epoch();
            if (gj_rt_storage_fetch(in[i]->storage, epoch) != 0)
                return -1;
        }
    }
    int nout = gj_rt_infer(inst, im, om);
    if (nout < 0)
        return -1;
    if (abstract) /* (not counted: nothing runs) */
        return exec_abstract(inst, in, om, nout, outs);
    atomic_fetch_add_explicit(&g_exec_count[inst->prim], 1, memory_order_relaxed);

    gj_rt_prim p = inst->prim;
    if (p == GJ_P_RESHAPE || p == GJ_P_PERMUTE || p == GJ_P_EXPAND || p == GJ_P_SLICE) {
        outs[0] = gj_rt_k_view_op(inst, in[0], &om[0]);
        return outs[0] ? 1 : -1;
    }

    for (int k = 0; k < nout; k++) {
        outs[k] = gj_k_needs_zero(p) ? gj_rt_tensor_new(om[k].dtype, om[k].ndim, om[k].shape)
                                     : gj_rt_tensor_empty(om[k].dtype, om[k].ndim, om[k].shape);
        if (!outs[k])
            goto fail;
        if (p == GJ_P_SCATTER_ADD_ROWS)
            gj_rt_zero_fill(gj_rt_data_ptr(outs[k]),
                            (size_t)outs[k]->numel * gj_rt_dtype_size(outs[k]->dtype));
    }

    int rc;
    switch (p) {
    case GJ_P_FILL:
        rc = gj_rt_k_fill(inst, outs[0]);
        break;
    case GJ_P_DROPOUT_MASK:
        rc = gj_rt_k_dropout_mask(inst, outs[0]);
        break;
    case GJ_P_CAST: case GJ_P_COPY:
        rc = gj_rt_copy_into(outs[0], in[0]);
        break;
    case GJ_P_SUM:
        rc = gj_rt_k_sum(inst, in[0], outs[0]);
        break;
    case GJ_P_MAX:
        rc = gj_rt_k_max(inst, in[0], outs[0]);
        break;
    case GJ_P_PAD:
        rc = gj_rt_k_pad(inst, in[0], outs[0]);
        break;
    case GJ_P_CAT:
        rc = gj_rt_k_cat(inst, in, outs[0]);
        break;
    case GJ_P_MATMUL:
        rc = gj_rt_k_matmul(inst, in[0], in[1], outs[0]);
        break;
    case GJ_P_GATHER_ROWS:
        rc = gj_rt_k_gather_rows(in[0], in[1], outs[0]);
        break;
    case GJ_P_SCATTER_ADD_ROWS:
        rc = gj_rt_k_scatter_add_rows(inst, in[0], in[1], outs[0]);
        break;
    case GJ_P_SOFTMAX: case GJ_P_LOG_SOFTMAX: case GJ_P_SOFTMAX_BWD:
    case GJ_P_LOG_SOFTMAX_BWD: case GJ_P_LN_FWD: case GJ_P_LN_BWD: case GJ_P_CE_FWD:
    case GJ_P_CE_BWD:
        rc = gj_rt_k_composite(inst, in, outs);
        break;
    case GJ_P_IOTA:
        rc = gj_rt_k_iota(inst, outs[0]);
        break;
    case GJ_P_ATTN_FWD: case GJ_P_ATTN_BWD:
        rc = gj_rt_k_attention(inst, in, outs);
        break;
    case GJ_P_LCE_FWD:
        rc = gj_rt_k_lce(inst, in, outs);
        break;
    case GJ_P_IM2COL:
        rc = gj_rt_k_im2col(inst, in[0], outs[0]);
        break;
    case GJ_P_COL2IM:
        rc = gj_rt_k_col2im(inst, in[0], outs[0]);
        break;
    case GJ_P_NEG: case GJ_P_EXP: case GJ_P_LOG: case GJ_P_TANH: case GJ_P_SIGMOID:
    case GJ_P_RELU: case GJ_P_GELU: case GJ_P_SQRT: case GJ_P_RSQRT: case GJ_P_RECIP:
    case GJ_P_GELU_GRAD: case GJ_P_STEP: case GJ_P_ADD_SCALAR: case GJ_P_MUL_SCALAR:
    case GJ_P_POW_SCALAR: case GJ_P_ADD: case GJ_P_SUB: case GJ_P_MUL: case GJ_P_DIV:
    case GJ_P_EQ: case GJ_P_WHERE:
        rc = gj_rt_k_pointwise(inst, in, outs[0]);
        break;
    default:
        gj_rt_set_error("%s: no eager kernel", name);
        rc = -1;
        break;
    }
    if (rc != 0)
        goto fail;
    return nout;

fail:
    for (int k = 0; k < GJ_RT_MAX_OUTPUTS; k++) {
        gj_rt_tensor_release(outs[k]);
        outs[k] = NULL;
    }
    return -1;
}
