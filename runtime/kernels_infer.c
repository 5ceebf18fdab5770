/* SPDX-License-Identifier: MIT */
/*
 * kernels_infer.c - gj_rt_infer, the one shape/dtype rule of every
 * primitive (eager gj_rt_exec and the JIT's recording builder both call
 * it), and gj_rt_prim_name.
 *
 * Invariants:
 *   - gj_rt_infer never touches data: it reads metas and the instruction
 *     only, so it can run at capture time on values that do not exist yet.
 *   - Every rejection sets an error that starts with the primitive's name,
 *     says what is wrong, and lists every input's shape and dtype.
 *   - Output metas are always valid: a known dtype, 0 <= ndim <= GJ_MAX_DIMS,
 *     dims >= 0, numel*elsize representable (the kernels may rely on it).
 *   - Negative axes (SLICE/PAD/CAT/IOTA) count from the end, as in numpy.
 */
#include "runtime/kernels.h"

#include <stdio.h>

/* ---------------------------------------------------------------- names */

#define GJ_K_UPPER(name) #name,
static const char *const g_upper[GJ_P_COUNT] = {GJ_RT_PRIM_LIST(GJ_K_UPPER)};
#undef GJ_K_UPPER

/* Lower-case names for messages; a primitive added to the list without an
 * entry here falls back to its upper-case enum name. */
static const char *const g_lower[GJ_P_COUNT] = {
    [GJ_P_NEG] = "neg", [GJ_P_EXP] = "exp", [GJ_P_LOG] = "log", [GJ_P_TANH] = "tanh",
    [GJ_P_SIGMOID] = "sigmoid", [GJ_P_RELU] = "relu", [GJ_P_GELU] = "gelu",
    [GJ_P_SQRT] = "sqrt", [GJ_P_RSQRT] = "rsqrt", [GJ_P_RECIP] = "recip",
    [GJ_P_GELU_GRAD] = "gelu_grad", [GJ_P_STEP] = "step", [GJ_P_ADD_SCALAR] = "add_scalar",
    [GJ_P_MUL_SCALAR] = "mul_scalar", [GJ_P_POW_SCALAR] = "pow_scalar", [GJ_P_CAST] = "cast",
    [GJ_P_ADD] = "add", [GJ_P_SUB] = "sub", [GJ_P_MUL] = "mul", [GJ_P_DIV] = "div",
    [GJ_P_EQ] = "eq", [GJ_P_WHERE] = "where", [GJ_P_FILL] = "fill",
    [GJ_P_DROPOUT_MASK] = "dropout_mask", [GJ_P_SUM] = "sum", [GJ_P_MAX] = "max",
    [GJ_P_RESHAPE] = "reshape", [GJ_P_PERMUTE] = "permute", [GJ_P_EXPAND] = "expand",
    [GJ_P_SLICE] = "slice", [GJ_P_PAD] = "pad", [GJ_P_CAT] = "cat", [GJ_P_COPY] = "copy",
    [GJ_P_MATMUL] = "matmul", [GJ_P_GATHER_ROWS] = "gather_rows",
    [GJ_P_SCATTER_ADD_ROWS] = "scatter_add_rows", [GJ_P_SOFTMAX] = "softmax",
    [GJ_P_LOG_SOFTMAX] = "log_softmax", [GJ_P_SOFTMAX_BWD] = "softmax_bwd",
    [GJ_P_LOG_SOFTMAX_BWD] = "log_softmax_bwd", [GJ_P_LN_FWD] = "ln_fwd",
    [GJ_P_LN_BWD] = "ln_bwd", [GJ_P_CE_FWD] = "ce_fwd", [GJ_P_CE_BWD] = "ce_bwd",
    [GJ_P_IOTA] = "iota", [GJ_P_IM2COL] = "im2col", [GJ_P_COL2IM] = "col2im",
    [GJ_P_ATTN_FWD] = "attn_fwd", [GJ_P_ATTN_BWD] = "attn_bwd",
    [GJ_P_LCE_FWD] = "lce_fwd",
};

const char *gj_rt_prim_name(gj_rt_prim p) {
    if ((unsigned)p >= (unsigned)GJ_P_COUNT)
        return "invalid-primitive";
    return g_lower[p] ? g_lower[p] : g_upper[p];
}

/* ---------------------------------------------------------------- errors */

/* Sets "<prim>: <message> (inputs: [2, 3] f32, [3] f64)" and returns -1. */
static int __attribute__((format(printf, 4, 5)))
gj_rt_k_ierr(const gj_rt_inst *inst, const gj_rt_meta *in, int n, const char *fmt, ...) {
    char msg[512], list[768], sh[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t pos = 0;
    list[0] = 0;
    for (int i = 0; i < n && pos < sizeof list; i++) {
        int nd = in[i].ndim < 0 ? 0 : in[i].ndim > GJ_MAX_DIMS ? GJ_MAX_DIMS : in[i].ndim;
        int w = snprintf(list + pos, sizeof list - pos, "%s%s %s", i ? ", " : "",
                         gj_rt_fmt_shape(sh, sizeof sh, nd, in[i].shape),
                         gj_rt_dtype_name(in[i].dtype));
        if (w < 0)
            break;
        pos += (size_t)w;
    }
    if (n > 0)
        gj_rt_set_error("%s: %s (inputs: %s)", gj_rt_prim_name(inst->prim), msg, list);
    else
        gj_rt_set_error("%s: %s", gj_rt_prim_name(inst->prim), msg);
    return -1;
}

#define IERR(...) return gj_rt_k_ierr(inst, in, n_in, __VA_ARGS__)

/* ---------------------------------------------------------------- helpers */

static void gj_rt_k_set_meta(gj_rt_meta *m, gj_dtype dt, int ndim, const int64_t *shape) {
    memset(m, 0, sizeof *m);
    m->dtype = dt;
    m->ndim = ndim;
    for (int k = 0; k < ndim; k++)
        m->shape[k] = shape[k];
}

static bool gj_rt_k_same_shape(const gj_rt_meta *a, const gj_rt_meta *b) {
    if (a->ndim != b->ndim)
        return false;
    for (int k = 0; k < a->ndim; k++)
        if (a->shape[k] != b->shape[k])
            return false;
    return true;
}

/* Normalises axis into [0, ndim); false if out of range. */
static bool gj_rt_k_axis(int axis, int ndim, int *out) {
    if (axis < 0)
        axis += ndim;
    if (axis < 0 || axis >= ndim)
        return false;
    *out = axis;
    return true;
}

/* Expected input count of p (CAT: -1, checked separately). */
static int gj_rt_k_arity(gj_rt_prim p) {
    switch (p) {
    case GJ_P_ADD: case GJ_P_SUB: case GJ_P_MUL: case GJ_P_DIV: case GJ_P_EQ:
    case GJ_P_MATMUL: case GJ_P_GATHER_ROWS: case GJ_P_SCATTER_ADD_ROWS:
    case GJ_P_SOFTMAX_BWD: case GJ_P_LOG_SOFTMAX_BWD: case GJ_P_CE_FWD:
        return 2;
    case GJ_P_WHERE: case GJ_P_ATTN_FWD:
        return 3;
    case GJ_P_LN_BWD: case GJ_P_CE_BWD:
        return 4;
    case GJ_P_ATTN_BWD:
        return 6;
    case GJ_P_FILL: case GJ_P_DROPOUT_MASK: case GJ_P_IOTA:
        return 0;
    case GJ_P_CAT: case GJ_P_LCE_FWD:
        return -1;
    default:
        return 1;
    }
}

static bool gj_rt_k_is_float(gj_dtype dt) {
    return dt == GJ_F32 || dt == GJ_F64 || dt == GJ_BF16;
}

/* ---------------------------------------------------------------- infer */

int gj_rt_infer(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_meta *out) {
    char s1[160], s2[160];
    if (!inst) {
        gj_rt_set_error("infer: NULL instruction");
        return -1;
    }
    if ((unsigned)inst->prim >= (unsigned)GJ_P_COUNT) {
        gj_rt_set_error("infer: invalid primitive %d", (int)inst->prim);
        return -1;
    }
    int n_in = inst->n_in;
    int want = gj_rt_k_arity(inst->prim);
    if (want >= 0 && n_in != want) {
        n_in = 0;
        IERR("takes %d input%s, got %d", want, want == 1 ? "" : "s", inst->n_in);
    }
    if (want < 0 && (n_in < 1 || n_in > GJ_RT_MAX_INPUTS)) {
        int got = n_in;
        n_in = 0;
        IERR("takes 1 to %d inputs, got %d", GJ_RT_MAX_INPUTS, got);
    }
    if (n_in > 0 && !in) {
        n_in = 0;
        IERR("NULL input metas");
    }
    for (int i = 0; i < n_in; i++) {
        bool ok = gj_rt_dtype_valid((int)in[i].dtype) && in[i].ndim >= 0 &&
                  in[i].ndim <= GJ_MAX_DIMS;
        for (int k = 0; ok && k < in[i].ndim; k++)
            ok = in[i].shape[k] >= 0;
        if (!ok)
            IERR("input %d has an invalid dtype or shape", i);
    }
    const gj_rt_meta *x = n_in > 0 ? &in[0] : NULL;
    const char *dn = x ? gj_rt_dtype_name(x->dtype) : "";

    switch (inst->prim) {
    /* ----------------------------------------------------- unary float */
    case GJ_P_NEG: case GJ_P_EXP: case GJ_P_LOG: case GJ_P_TANH: case GJ_P_SIGMOID:
    case GJ_P_RELU: case GJ_P_GELU: case GJ_P_SQRT: case GJ_P_RSQRT: case GJ_P_RECIP:
    case GJ_P_GELU_GRAD: case GJ_P_STEP: case GJ_P_ADD_SCALAR: case GJ_P_MUL_SCALAR:
    case GJ_P_POW_SCALAR:
        if (!gj_rt_k_is_float(x->dtype))
            IERR("needs a float input (f32, f64, bf16), got %s", dn);
        *out = *x;
        return 1;
    case GJ_P_CAST:
        if (!gj_rt_dtype_valid((int)inst->dtype))
            IERR("invalid target dtype %d", (int)inst->dtype);
        gj_rt_k_set_meta(out, inst->dtype, x->ndim, x->shape);
        if (!gj_rt_check_shape(out->ndim, out->shape, out->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        return 1;
    case GJ_P_COPY:
        *out = *x;
        return 1;

    /* --------------------------------------------------- binary/ternary */
    case GJ_P_ADD: case GJ_P_SUB: case GJ_P_MUL: case GJ_P_DIV: case GJ_P_EQ: {
        if (in[0].dtype != in[1].dtype)
            IERR("dtype mismatch: %s vs %s", dn, gj_rt_dtype_name(in[1].dtype));
        if (inst->prim != GJ_P_EQ && !gj_rt_k_is_float(x->dtype))
            IERR("needs float inputs (f32, f64, bf16), got %s", dn);
        int nd;
        int64_t sh[GJ_MAX_DIMS];
        if (!gj_rt_broadcast_shape(in[0].ndim, in[0].shape, in[1].ndim, in[1].shape, &nd, sh))
            IERR("cannot broadcast shapes %s and %s",
                 gj_rt_fmt_shape(s1, sizeof s1, in[0].ndim, in[0].shape),
                 gj_rt_fmt_shape(s2, sizeof s2, in[1].ndim, in[1].shape));
        gj_rt_k_set_meta(out, x->dtype, nd, sh);
        return 1;
    }
    case GJ_P_WHERE: {
        if (in[1].dtype != in[2].dtype)
            IERR("dtype mismatch between the two branches: %s vs %s",
                 gj_rt_dtype_name(in[1].dtype), gj_rt_dtype_name(in[2].dtype));
        int nd, nd2;
        int64_t sh[GJ_MAX_DIMS], sh2[GJ_MAX_DIMS];
        if (!gj_rt_broadcast_shape(in[1].ndim, in[1].shape, in[2].ndim, in[2].shape, &nd, sh) ||
            !gj_rt_broadcast_shape(in[0].ndim, in[0].shape, nd, sh, &nd2, sh2))
            IERR("cannot broadcast cond, a and b together");
        gj_rt_k_set_meta(out, in[1].dtype, nd2, sh2);
        return 1;
    }

    /* ---------------------------------------------------------- nullary */
    case GJ_P_FILL: case GJ_P_DROPOUT_MASK:
        if (!gj_rt_dtype_valid((int)inst->dtype))
            IERR("invalid dtype %d", (int)inst->dtype);
        if (inst->prim == GJ_P_DROPOUT_MASK) {
            if (!gj_rt_k_is_float(inst->dtype))
                IERR("needs a float dtype, got %s", gj_rt_dtype_name(inst->dtype));
            if (!(inst->scalar >= 0.0 && inst->scalar <= 1.0))
                IERR("drop probability %g outside [0, 1]", inst->scalar);
        }
        if (inst->ndim < 0 || inst->ndim > GJ_MAX_DIMS)
            IERR("invalid rank %d", inst->ndim);
        if (!gj_rt_check_shape(inst->ndim, inst->shape, inst->dtype,
                               gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, inst->dtype, inst->ndim, inst->shape);
        return 1;

    /* ------------------------------------------------------- reductions */
    case GJ_P_SUM: case GJ_P_MAX: {
        if (inst->prim == GJ_P_SUM && !(gj_rt_k_is_float(x->dtype) || x->dtype == GJ_I64))
            IERR("unsupported dtype %s", dn);
        if (inst->prim == GJ_P_MAX && !gj_rt_k_is_float(x->dtype))
            IERR("needs a float input (f32, f64, bf16), got %s", dn);
        uint32_t axes = inst->axes;
        if (x->ndim < 32 && (axes >> x->ndim) != 0)
            IERR("axes mask 0x%x names an axis out of range for rank %d", (unsigned)axes,
                 x->ndim);
        if (inst->prim == GJ_P_MAX) {
            if (axes == 0 || (axes & (axes - 1)) != 0)
                IERR("needs exactly one axis, mask is 0x%x", (unsigned)axes);
            int a = __builtin_ctz(axes);
            if (x->shape[a] == 0)
                IERR("axis %d is empty (max of nothing)", a);
        }
        int nd = 0;
        int64_t sh[GJ_MAX_DIMS];
        for (int k = 0; k < x->ndim; k++) {
            if (axes & (1u << k)) {
                if (inst->keepdim)
                    sh[nd++] = 1;
            } else {
                sh[nd++] = x->shape[k];
            }
        }
        gj_rt_k_set_meta(out, x->dtype, nd, sh);
        return 1;
    }

    /* --------------------------------------------------------- movement */
    case GJ_P_RESHAPE: {
        if (inst->ndim < 0 || inst->ndim > GJ_MAX_DIMS)
            IERR("invalid target rank %d", inst->ndim);
        for (int k = 0; k < inst->ndim; k++)
            if (inst->shape[k] < 0)
                IERR("negative target dim %lld", (long long)inst->shape[k]);
        if (!gj_rt_check_shape(inst->ndim, inst->shape, x->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        int64_t a = gj_rt_numel(x->ndim, x->shape), b = gj_rt_numel(inst->ndim, inst->shape);
        if (a != b)
            IERR("cannot reshape %s (%lld elements) to %s (%lld elements)",
                 gj_rt_fmt_shape(s1, sizeof s1, x->ndim, x->shape), (long long)a,
                 gj_rt_fmt_shape(s2, sizeof s2, inst->ndim, inst->shape), (long long)b);
        gj_rt_k_set_meta(out, x->dtype, inst->ndim, inst->shape);
        return 1;
    }
    case GJ_P_PERMUTE: {
        if (inst->ndim != x->ndim)
            IERR("permutation of rank %d for an input of rank %d", inst->ndim, x->ndim);
        bool seen[GJ_MAX_DIMS] = {false};
        int64_t sh[GJ_MAX_DIMS];
        for (int k = 0; k < x->ndim; k++) {
            int64_t a = inst->shape[k];
            if (a < 0 || a >= x->ndim || seen[a])
                IERR("bad permutation %s",
                     gj_rt_fmt_shape(s1, sizeof s1, inst->ndim, inst->shape));
            seen[a] = true;
            sh[k] = x->shape[a];
        }
        gj_rt_k_set_meta(out, x->dtype, x->ndim, sh);
        return 1;
    }
    case GJ_P_EXPAND: {
        if (inst->ndim < x->ndim || inst->ndim > GJ_MAX_DIMS)
            IERR("cannot expand rank %d to rank %d", x->ndim, inst->ndim);
        int off = inst->ndim - x->ndim;
        for (int k = 0; k < inst->ndim; k++) {
            int64_t t = inst->shape[k];
            bool ok = t >= 0;
            if (ok && k >= off)
                ok = x->shape[k - off] == t || x->shape[k - off] == 1;
            if (!ok)
                IERR("cannot expand %s to %s",
                     gj_rt_fmt_shape(s1, sizeof s1, x->ndim, x->shape),
                     gj_rt_fmt_shape(s2, sizeof s2, inst->ndim, inst->shape));
        }
        if (!gj_rt_check_shape(inst->ndim, inst->shape, x->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, x->dtype, inst->ndim, inst->shape);
        return 1;
    }
    case GJ_P_SLICE: case GJ_P_PAD: {
        int ax;
        if (!gj_rt_k_axis(inst->axis, x->ndim, &ax))
            IERR("axis %d out of range for rank %d", inst->axis, x->ndim);
        int64_t size = x->shape[ax];
        int64_t sh[GJ_MAX_DIMS];
        memcpy(sh, x->shape, sizeof sh);
        if (inst->prim == GJ_P_SLICE) {
            if (inst->start < 0 || inst->len < 0 || inst->start > size ||
                inst->len > size - inst->start)
                IERR("slice [%lld, %lld) out of range for axis %d of size %lld",
                     (long long)inst->start, (long long)inst->start + (long long)inst->len, ax,
                     (long long)size);
            sh[ax] = inst->len;
        } else {
            if (inst->start < 0 || inst->len < 0 || inst->start > inst->len ||
                size > inst->len - inst->start)
                IERR("cannot place axis %d of size %lld at %lld in a padded length of %lld", ax,
                     (long long)size, (long long)inst->start, (long long)inst->len);
            sh[ax] = inst->len;
            if (!gj_rt_check_shape(x->ndim, sh, x->dtype, gj_rt_prim_name(inst->prim)))
                return -1;
        }
        gj_rt_k_set_meta(out, x->dtype, x->ndim, sh);
        return 1;
    }
    case GJ_P_CAT: {
        int ax;
        if (!gj_rt_k_axis(inst->axis, x->ndim, &ax))
            IERR("axis %d out of range for rank %d", inst->axis, x->ndim);
        int64_t sh[GJ_MAX_DIMS];
        memcpy(sh, x->shape, sizeof sh);
        for (int i = 1; i < n_in; i++) {
            if (in[i].dtype != x->dtype)
                IERR("dtype mismatch: input 0 is %s, input %d is %s", dn, i,
                     gj_rt_dtype_name(in[i].dtype));
            bool ok = in[i].ndim == x->ndim;
            for (int k = 0; ok && k < x->ndim; k++)
                ok = k == ax || in[i].shape[k] == x->shape[k];
            if (!ok)
                IERR("input %d has shape %s, incompatible with %s outside axis %d", i,
                     gj_rt_fmt_shape(s1, sizeof s1, in[i].ndim, in[i].shape),
                     gj_rt_fmt_shape(s2, sizeof s2, x->ndim, x->shape), ax);
            sh[ax] += in[i].shape[ax];
        }
        if (!gj_rt_check_shape(x->ndim, sh, x->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, x->dtype, x->ndim, sh);
        return 1;
    }

    /* ----------------------------------------------------------- matmul */
    case GJ_P_MATMUL: {
        const gj_rt_meta *y = &in[1];
        if (x->dtype != y->dtype)
            IERR("dtype mismatch: %s vs %s", dn, gj_rt_dtype_name(y->dtype));
        if (!gj_rt_k_is_float(x->dtype))
            IERR("needs float inputs (f32, f64, bf16), got %s", dn);
        if (x->ndim < 2 || y->ndim < 2)
            IERR("needs inputs of rank >= 2, got ranks %d and %d", x->ndim, y->ndim);
        int nx = x->ndim, ny = y->ndim;
        int64_t M = inst->ta ? x->shape[nx - 1] : x->shape[nx - 2];
        int64_t Kx = inst->ta ? x->shape[nx - 2] : x->shape[nx - 1];
        int64_t Ky = inst->tb ? y->shape[ny - 1] : y->shape[ny - 2];
        int64_t N = inst->tb ? y->shape[ny - 2] : y->shape[ny - 1];
        if (Kx != Ky)
            IERR("inner dimensions differ: %lld vs %lld (ta=%d, tb=%d)", (long long)Kx,
                 (long long)Ky, (int)inst->ta, (int)inst->tb);
        int nb;
        int64_t sh[GJ_MAX_DIMS];
        if (!gj_rt_broadcast_shape(nx - 2, x->shape, ny - 2, y->shape, &nb, sh))
            IERR("cannot broadcast batch dims %s and %s",
                 gj_rt_fmt_shape(s1, sizeof s1, nx - 2, x->shape),
                 gj_rt_fmt_shape(s2, sizeof s2, ny - 2, y->shape));
        if (nb + 2 > GJ_MAX_DIMS)
            IERR("output rank %d exceeds %d", nb + 2, GJ_MAX_DIMS);
        sh[nb] = M;
        sh[nb + 1] = N;
        if (inst->wide && x->dtype != GJ_BF16)
            IERR("a wide product needs bf16 operands, got %s", dn);
        gj_dtype odt = inst->wide ? GJ_F32 : x->dtype;
        if (!gj_rt_check_shape(nb + 2, sh, odt, gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, odt, nb + 2, sh);
        return 1;
    }

    /* --------------------------------------------------------- indexing */
    case GJ_P_GATHER_ROWS: {
        const gj_rt_meta *idx = &in[1];
        if (x->ndim != 2)
            IERR("table must be 2-D [V, D], got rank %d", x->ndim);
        if (idx->dtype != GJ_I64)
            IERR("indices must be i64, got %s", gj_rt_dtype_name(idx->dtype));
        if (idx->ndim + 1 > GJ_MAX_DIMS)
            IERR("output rank %d exceeds %d", idx->ndim + 1, GJ_MAX_DIMS);
        int64_t sh[GJ_MAX_DIMS];
        memcpy(sh, idx->shape, sizeof(int64_t) * (size_t)idx->ndim);
        sh[idx->ndim] = x->shape[1];
        if (!gj_rt_check_shape(idx->ndim + 1, sh, x->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, x->dtype, idx->ndim + 1, sh);
        return 1;
    }
    case GJ_P_SCATTER_ADD_ROWS: {
        const gj_rt_meta *idx = &in[1];
        if (!gj_rt_k_is_float(x->dtype))
            IERR("needs float rows (f32, f64, bf16), got %s", dn);
        if (x->ndim < 1)
            IERR("rows must have rank >= 1");
        if (idx->dtype != GJ_I64)
            IERR("indices must be i64, got %s", gj_rt_dtype_name(idx->dtype));
        bool ok = idx->ndim == x->ndim - 1;
        for (int k = 0; ok && k < idx->ndim; k++)
            ok = idx->shape[k] == x->shape[k];
        if (!ok)
            IERR("index shape %s must equal the source shape without its last dim %s",
                 gj_rt_fmt_shape(s1, sizeof s1, idx->ndim, idx->shape),
                 gj_rt_fmt_shape(s2, sizeof s2, x->ndim - 1, x->shape));
        if (inst->len < 0)
            IERR("negative table size V = %lld", (long long)inst->len);
        int64_t sh[2] = {inst->len, x->shape[x->ndim - 1]};
        if (!gj_rt_check_shape(2, sh, x->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, x->dtype, 2, sh);
        return 1;
    }

    /* ------------------------------------------------------- composites */
    case GJ_P_SOFTMAX: case GJ_P_LOG_SOFTMAX: case GJ_P_LN_FWD: {
        if (!gj_rt_k_is_float(x->dtype))
            IERR("needs a float input (f32, f64, bf16), got %s", dn);
        if (x->ndim < 1)
            IERR("needs an input of rank >= 1 (acts on the last axis)");
        *out = *x;
        if (inst->prim != GJ_P_LN_FWD)
            return 1;
        if (!(inst->scalar >= 0.0))
            IERR("eps must be >= 0, got %g", inst->scalar);
        out[1] = *x;
        out[1].shape[x->ndim - 1] = 1;
        out[2] = out[1];
        return 3;
    }
    case GJ_P_SOFTMAX_BWD: case GJ_P_LOG_SOFTMAX_BWD: {
        if (!gj_rt_k_is_float(x->dtype) || in[1].dtype != x->dtype)
            IERR("needs two float inputs of one dtype, got %s and %s", dn,
                 gj_rt_dtype_name(in[1].dtype));
        if (x->ndim < 1 || !gj_rt_k_same_shape(x, &in[1]))
            IERR("y and gy must have the same shape of rank >= 1");
        *out = *x;
        return 1;
    }
    case GJ_P_LN_BWD: {
        if (!gj_rt_k_is_float(x->dtype))
            IERR("needs float inputs (f32, f64, bf16), got %s", dn);
        if (x->ndim < 1)
            IERR("needs an input of rank >= 1");
        gj_rt_meta stat = *x;
        stat.shape[x->ndim - 1] = 1;
        for (int i = 1; i < 4; i++)
            if (in[i].dtype != x->dtype)
                IERR("dtype mismatch: x is %s, input %d is %s", dn, i,
                     gj_rt_dtype_name(in[i].dtype));
        if (!gj_rt_k_same_shape(&in[1], &stat) || !gj_rt_k_same_shape(&in[2], &stat))
            IERR("mean and rstd must have shape %s",
                 gj_rt_fmt_shape(s1, sizeof s1, stat.ndim, stat.shape));
        if (!gj_rt_k_same_shape(&in[3], x))
            IERR("gxhat must have the shape of x %s",
                 gj_rt_fmt_shape(s1, sizeof s1, x->ndim, x->shape));
        *out = *x;
        return 1;
    }
    case GJ_P_CE_FWD: case GJ_P_CE_BWD: {
        const gj_rt_meta *lab = &in[inst->prim == GJ_P_CE_FWD ? 1 : 2];
        if (!gj_rt_k_is_float(x->dtype))
            IERR("logits must be float (f32, f64, bf16), got %s", dn);
        if (x->ndim != 2)
            IERR("logits must be 2-D [N, K], got rank %d", x->ndim);
        int64_t N = x->shape[0], K = x->shape[1];
        if (K < 1)
            IERR("logits have no classes (K = 0)");
        if (lab->dtype != GJ_I64)
            IERR("labels must be i64, got %s", gj_rt_dtype_name(lab->dtype));
        if (lab->ndim != 1 || lab->shape[0] != N)
            IERR("labels must have shape [%lld], got %s", (long long)N,
                 gj_rt_fmt_shape(s1, sizeof s1, lab->ndim, lab->shape));
        if (inst->prim == GJ_P_CE_FWD) {
            gj_rt_k_set_meta(&out[0], x->dtype, 0, NULL);
            gj_rt_k_set_meta(&out[1], x->dtype, 1, &N);
            return 2;
        }
        const gj_rt_meta *lse = &in[1], *g = &in[3];
        if (lse->dtype != x->dtype || lse->ndim != 1 || lse->shape[0] != N)
            IERR("lse must be %s [%lld], got %s %s", dn, (long long)N,
                 gj_rt_dtype_name(lse->dtype),
                 gj_rt_fmt_shape(s1, sizeof s1, lse->ndim, lse->shape));
        if (g->dtype != x->dtype || g->ndim != 0)
            IERR("g must be a 0-d %s tensor, got %s %s", dn, gj_rt_dtype_name(g->dtype),
                 gj_rt_fmt_shape(s1, sizeof s1, g->ndim, g->shape));
        *out = *x;
        return 1;
    }
    case GJ_P_IOTA: {
        if (!gj_rt_dtype_valid((int)inst->dtype))
            IERR("invalid dtype %d", (int)inst->dtype);
        if (inst->ndim < 1 || inst->ndim > GJ_MAX_DIMS)
            IERR("invalid rank %d (needs 1..%d)", inst->ndim, GJ_MAX_DIMS);
        int ax;
        if (!gj_rt_k_axis(inst->axis, inst->ndim, &ax))
            IERR("axis %d out of range for rank %d", inst->axis, inst->ndim);
        if (!gj_rt_check_shape(inst->ndim, inst->shape, inst->dtype,
                               gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, inst->dtype, inst->ndim, inst->shape);
        return 1;
    }
    case GJ_P_IM2COL: case GJ_P_COL2IM: {
        bool im = inst->prim == GJ_P_IM2COL;
        if (!gj_rt_k_is_float(x->dtype))
            IERR("needs a float input (f32, f64, bf16), got %s", dn);
        if (x->ndim != (im ? 4 : 6))
            IERR("needs a %s, got rank %d", im ? "4-D image [N, C, H, W]"
                                                : "6-D input [N, C, kh, kw, OH, OW]", x->ndim);
        const int64_t *a = inst->shape;
        if (inst->ndim != GJ_RT_WIN_NDIM || a[0] < 1 || a[1] < 1 || a[2] < 1 || a[3] < 1 ||
            a[4] < 0 || a[5] < 0 || a[6] < 1 || a[7] < 1)
            IERR("invalid window (kernel %lldx%lld, stride %lldx%lld, padding %lldx%lld, "
                 "dilation %lldx%lld)", (long long)a[0], (long long)a[1], (long long)a[2],
                 (long long)a[3], (long long)a[4], (long long)a[5], (long long)a[6],
                 (long long)a[7]);
        if (!im && (inst->start < 1 || inst->len < 1))
            IERR("invalid image size %lldx%lld", (long long)inst->start, (long long)inst->len);
        gj_rt_win g;
        if (!gj_rt_win_of(inst, x, &g))
            IERR("the window does not fit: image %lldx%lld, kernel %lldx%lld, stride "
                 "%lldx%lld, padding %lldx%lld, dilation %lldx%lld%s",
                 (long long)(im ? x->shape[2] : inst->start),
                 (long long)(im ? x->shape[3] : inst->len), (long long)a[0], (long long)a[1],
                 (long long)a[2], (long long)a[3], (long long)a[4], (long long)a[5],
                 (long long)a[6], (long long)a[7],
                 im ? " (no output position)" : " (or the columns' shape disagrees)");
        int64_t sh[6] = {g.N, g.C, g.kh, g.kw, g.OH, g.OW};
        if (!im) {
            sh[2] = g.H;
            sh[3] = g.W;
        }
        if (!gj_rt_check_shape(im ? 6 : 4, sh, x->dtype, gj_rt_prim_name(inst->prim)))
            return -1;
        gj_rt_k_set_meta(out, x->dtype, im ? 6 : 4, sh);
        return 1;
    }
    case GJ_P_ATTN_FWD: case GJ_P_ATTN_BWD:
        return gj_rt_attn_infer(inst, in, out);
    case GJ_P_LCE_FWD:
        return gj_rt_lce_infer(inst, in, out);
    default:
        break;
    }
    IERR("has no shape rule");
}

/* ATTN_FWD / ATTN_BWD (runtime/attention.h's layout). */
int gj_rt_attn_infer(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_meta *out) {
    char s1[160], s2[160], s3[160];
    const char *name = gj_rt_prim_name(inst->prim);
    const gj_rt_meta *q = &in[0], *k = &in[1], *v = &in[2];
    gj_dtype dt = q->dtype;
    if (!gj_rt_k_is_float(dt) || k->dtype != dt || v->dtype != dt) {
        gj_rt_set_error("%s: q, k and v must share one float dtype (f32, f64, bf16); got %s, %s, "
                        "%s", name, gj_rt_dtype_name(dt), gj_rt_dtype_name(k->dtype),
                        gj_rt_dtype_name(v->dtype));
        return -1;
    }
    gj_rt_fmt_shape(s1, sizeof s1, q->ndim, q->shape);
    gj_rt_fmt_shape(s2, sizeof s2, k->ndim, k->shape);
    gj_rt_fmt_shape(s3, sizeof s3, v->ndim, v->shape);
    bool ok = q->ndim == 4 && k->ndim == 4 && v->ndim == 4;
    for (int d = 0; ok && d < 2; d++)
        ok = k->shape[d] == q->shape[d] && v->shape[d] == q->shape[d];
    ok = ok && k->shape[3] == q->shape[3] && v->shape[2] == k->shape[2];
    if (!ok) {
        gj_rt_set_error("%s: expected q [B, H, T, D], k [B, H, S, D], v [B, H, S, E]; got q %s, k "
                        "%s, v %s", name, s1, s2, s3);
        return -1;
    }
    int64_t T = q->shape[2], S = k->shape[2], D = q->shape[3], E = v->shape[3];
    if (T < 1 || S < 1 || D < 1 || E < 1 || D > GJ_RT_ATTN_DMAX || E > GJ_RT_ATTN_DMAX) {
        gj_rt_set_error("%s: q %s, k %s, v %s: T, S, D and E must be at least 1 and the head sizes "
                        "D and E at most %d", name, s1, s2, s3, GJ_RT_ATTN_DMAX);
        return -1;
    }
    if (inst->keepdim && T != S) {
        gj_rt_set_error("%s: causal attention needs as many keys as queries; got q %s, k %s",
                        name, s1, s2);
        return -1;
    }
    if (!(inst->scalar2 >= 0.0 && inst->scalar2 < 1.0) || !(inst->scalar == inst->scalar)) {
        gj_rt_set_error("%s: dropout p must be in [0, 1) and the scale a number; got p %g, scale "
                        "%g", name, inst->scalar2, inst->scalar);
        return -1;
    }
    gj_dtype st = dt == GJ_F64 ? GJ_F64 : GJ_F32; /* lse's dtype */
    int64_t o[4] = {q->shape[0], q->shape[1], T, E};
    if (inst->prim == GJ_P_ATTN_FWD) {
        gj_rt_k_set_meta(&out[0], dt, 4, o);
        gj_rt_k_set_meta(&out[1], st, 3, o);
        return 2;
    }
    const gj_rt_meta *om = &in[3], *go = &in[4], *lse = &in[5];
    bool shapes = om->dtype == dt && go->dtype == dt && lse->dtype == st && om->ndim == 4 &&
                  go->ndim == 4 && lse->ndim == 3;
    for (int d = 0; shapes && d < 4; d++)
        shapes = om->shape[d] == o[d] && go->shape[d] == o[d] && (d == 3 || lse->shape[d] == o[d]);
    if (!shapes) {
        gj_rt_set_error("%s: expected o and go %s [%lld, %lld, %lld, %lld] and lse %s [%lld, %lld, "
                        "%lld] for q %s, v %s", name, gj_rt_dtype_name(dt), (long long)o[0],
                        (long long)o[1], (long long)o[2], (long long)o[3], gj_rt_dtype_name(st),
                        (long long)o[0], (long long)o[1], (long long)o[2], s1, s3);
        return -1;
    }
    out[0] = *q;
    out[0].ndim = 4;
    out[1] = *k;
    out[2] = *v;
    return 3;
}

/* LCE_FWD: h [N, C], w [V, C], labels [N] (i64), optional b [V]. */
int gj_rt_lce_infer(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_meta *out) {
    char sh[160], sw[160], sl[160], sb[160] = "none";
    const char *name = gj_rt_prim_name(inst->prim);
    if (inst->n_in != 3 && inst->n_in != 4) {
        gj_rt_set_error("%s: takes 3 or 4 inputs (h, w, labels, bias), got %d", name, inst->n_in);
        return -1;
    }
    const gj_rt_meta *h = &in[0], *w = &in[1], *lab = &in[2], *b = inst->n_in == 4 ? &in[3] : NULL;
    gj_rt_fmt_shape(sh, sizeof sh, h->ndim, h->shape);
    gj_rt_fmt_shape(sw, sizeof sw, w->ndim, w->shape);
    gj_rt_fmt_shape(sl, sizeof sl, lab->ndim, lab->shape);
    if (b) gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape);
    gj_dtype dt = h->dtype;
    bool ok = gj_rt_k_is_float(dt) && w->dtype == dt && lab->dtype == GJ_I64 &&
              (!b || b->dtype == dt) && h->ndim == 2 && w->ndim == 2 && lab->ndim == 1 &&
              (!b || b->ndim == 1);
    ok = ok && w->shape[1] == h->shape[1] && lab->shape[0] == h->shape[0] &&
         (!b || b->shape[0] == w->shape[0]) && h->shape[0] >= 1 && h->shape[1] >= 1 &&
         w->shape[0] >= 1;
    if (!ok) {
        gj_rt_set_error("%s: expected h [N, C] and weight [V, C] of one float dtype, labels [N] "
                        "i64 and bias [V] or none, N, C, V >= 1; got h %s %s, weight %s %s, "
                        "labels %s %s, bias %s %s", name, sh, gj_rt_dtype_name(dt), sw,
                        gj_rt_dtype_name(w->dtype), sl, gj_rt_dtype_name(lab->dtype), sb,
                        b ? gj_rt_dtype_name(b->dtype) : "");
        return -1;
    }
    gj_rt_k_set_meta(&out[0], dt == GJ_F64 ? GJ_F64 : GJ_F32, 0, NULL);
    if (!inst->keepdim)
        return 1;
    out[1] = *h;
    out[2] = *w;
    if (b)
        out[3] = *b;
    return b ? 4 : 3;
}
