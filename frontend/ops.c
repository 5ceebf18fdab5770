/* SPDX-License-Identifier: MIT */
/*
 * ops.c - the public op functions of gradjit.h ("ops" section) and the
 * in-place ops.
 *
 * Every out-of-place op validates its arguments (naming the public
 * function, the shapes and the dtypes in the error), fills the attributes of
 * its autograd op (autograd/ops_*.c documents them), runs it through
 * gj_ag_apply and hands the result to the innermost scope (gj_fe_own).
 * Errors raised below (shape inference, allocation) are re-prefixed with
 * the public name, so every message starts with "gj_<op>: ".
 *
 * Invariants:
 *   - Every returned tensor is a new reference with a header of its own,
 *     never an argument: identities (gj_dropout when not training or p == 0,
 *     gj_contiguous of a contiguous tensor) return a view sharing the
 *     input's storage through the reshape op, with an identity backward.
 *   - In-place ops run runtime kernels directly (gj_rt_exec then
 *     gj_rt_copy_into), record no autograd node and bump the version of the
 *     modified storage. They refuse to write into an expanded view (stride
 *     0: several elements share memory). Not being recorded, they refuse ANY
 *     tensor that requires grad while grad mode is on (a leaf, and also a
 *     non-leaf, whose gradient would otherwise silently ignore the update);
 *     under gj_no_grad_push they are allowed, and a tensor saved for
 *     backward that is modified then makes that backward fail (version
 *     check of the engine).
 *   - Mixed precision (gj_set_autocast(GJ_BF16), per thread, as PyTorch's
 *     CPU autocast): the op functions cast their float arguments before
 *     validating them, through gj_cast (so the casts are ops of the graph,
 *     differentiable and traced like any other): GEMM ops (gj_matmul,
 *     gj_linear, gj_conv2d) take f32 arguments as bf16; softmax,
 *     log_softmax, layer_norm, cross_entropy, sum and mean take bf16
 *     arguments as f32; binary ops, gj_where and gj_cat with both f32 and
 *     bf16 arguments take all as f32. Every other op runs in its
 *     argument's dtype (a bf16 activation stays bf16). f64 is never cast.
 */
#include "fe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ----------------------------------------------------------- helpers */

/* Makes the current error start with "op: " (keeps it if it already does). */
static void fe_prefix_error(const char *op) {
    const char *msg = gj_last_error();
    size_t n = strlen(op);
    if (strncmp(msg, op, n) == 0 && msg[n] == ':')
        return;
    gj_rt_set_error("%s: %s", op, msg[0] ? msg : "failed");
}

/* Runs op on in[0..n) and returns its (single) output as a new scoped
 * reference, or NULL with an error naming `name`. */
static gj_tensor *fe_apply1(const char *name, const gj_ag_opdef *op, const gj_ag_attrs *a,
                            int n, gj_tensor *const *in) {
    gj_tensor *outs[GJ_AG_MAX_OUT] = {0};
    int r = gj_ag_apply(op, a, n, in, outs);
    if (r < 1) {
        for (int k = 0; k < r; k++)
            gj_rt_tensor_release(outs[k]);
        if (r == 0)
            gj_rt_set_error("op produced no output");
        fe_prefix_error(name);
        return gj_fe_fail();
    }
    for (int k = 1; k < r; k++)
        gj_rt_tensor_release(outs[k]);
    return gj_fe_own(outs[0]);
}

static bool fe_check(const gj_tensor *t, const char *op, const char *arg) {
    return gj_rt_check_tensor(t, op, arg);
}

/* t must be f32/f64/bf16. */
static bool fe_check_float(const gj_tensor *t, const char *op, const char *arg) {
    if (!fe_check(t, op, arg))
        return false;
    if (!gj_rt_dtype_is_float(t->dtype)) {
        char s[160];
        gj_rt_set_error("%s: expected a float tensor, got %s (argument %s, shape %s)", op,
                        gj_rt_dtype_name(t->dtype), arg,
                        gj_rt_fmt_shape(s, sizeof s, t->ndim, t->shape));
        return false;
    }
    return true;
}

static bool fe_same_dtype(const gj_tensor *a, const gj_tensor *b, const char *op,
                          const char *an, const char *bn) {
    if (a->dtype == b->dtype)
        return true;
    char sa[160], sb[160];
    gj_rt_set_error("%s: dtype mismatch: %s is %s %s, %s is %s %s (convert one with gj_cast)",
                    op, an, gj_rt_dtype_name(a->dtype),
                    gj_rt_fmt_shape(sa, sizeof sa, a->ndim, a->shape), bn,
                    gj_rt_dtype_name(b->dtype),
                    gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape));
    return false;
}

/* ------------------------------------------------ mixed precision */

static _Thread_local gj_dtype g_autocast = GJ_F32; /* GJ_F32: off */

int gj_set_autocast(gj_dtype dt) {
    if (dt != GJ_F32 && dt != GJ_BF16) {
        gj_rt_set_error("gj_set_autocast: the compute dtype must be GJ_BF16 (on) or GJ_F32 (off), "
                        "got %s",
                        gj_rt_dtype_valid((int)dt) ? gj_rt_dtype_name(dt) : "an invalid dtype");
        return -1;
    }
    g_autocast = dt;
    return 0;
}

gj_dtype gj_get_autocast(void) { return g_autocast; }

typedef enum fe_ac_rule {
    FE_AC_LOW,     /* f32 arguments as the autocast dtype (GEMMs) */
    FE_AC_F32,     /* bf16 arguments as f32 (precision-sensitive ops) */
    FE_AC_PROMOTE, /* f32 and bf16 together: all as f32 */
} fe_ac_rule;

/* Applies rule to the float tensors among t[0..n) (NULL entries skipped)
 * when autocast is on: each one cast is replaced by its cast (a new scoped
 * reference). false with an error (an invalid argument, or the cast's). */
static bool fe_autocast(const char *op, fe_ac_rule rule, int n, gj_tensor **t) {
    if (g_autocast == GJ_F32)
        return true;
    bool has32 = false, has16 = false;
    for (int k = 0; k < n; k++) {
        if (!t[k])
            continue;
        if (!gj_rt_check_tensor(t[k], op, "an argument"))
            return false;
        has32 |= t[k]->dtype == GJ_F32;
        has16 |= t[k]->dtype == g_autocast;
    }
    gj_dtype from = rule == FE_AC_LOW ? GJ_F32 : g_autocast;
    gj_dtype to = rule == FE_AC_LOW ? g_autocast : GJ_F32;
    if (rule == FE_AC_PROMOTE && !(has32 && has16))
        return true;
    for (int k = 0; k < n; k++) {
        if (!t[k] || t[k]->dtype != from)
            continue;
        gj_tensor *c = gj_cast(t[k], to);
        if (!c) {
            fe_prefix_error(op);
            return false;
        }
        t[k] = c;
    }
    return true;
}

/* Broadcast shape of a and b into (nd, shape); false with an error. */
static bool fe_broadcast(const gj_tensor *a, const gj_tensor *b, const char *op, int *nd,
                         int64_t *shape) {
    if (gj_rt_broadcast_shape(a->ndim, a->shape, b->ndim, b->shape, nd, shape))
        return true;
    char sa[160], sb[160];
    gj_rt_set_error("%s: shapes %s and %s cannot be broadcast together (%s, %s)", op,
                    gj_rt_fmt_shape(sa, sizeof sa, a->ndim, a->shape),
                    gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape),
                    gj_rt_dtype_name(a->dtype), gj_rt_dtype_name(b->dtype));
    return false;
}

/* Whether src broadcasts to exactly dst's shape (numpy rules). */
static bool fe_broadcasts_to(const gj_tensor *src, int nd, const int64_t *shape) {
    if (src->ndim > nd)
        return false;
    int off = nd - src->ndim;
    for (int k = 0; k < src->ndim; k++)
        if (src->shape[k] != shape[k + off] && src->shape[k] != 1)
            return false;
    return true;
}

/* Normalises axis (negative counts from the end) into [0, ndim). */
static bool fe_axis(int axis, int ndim, const char *op, const gj_tensor *x, int *out) {
    if (axis < -ndim || axis >= ndim) {
        char s[160];
        gj_rt_set_error("%s: axis %d out of range for a tensor of shape %s (ndim %d)", op, axis,
                        gj_rt_fmt_shape(s, sizeof s, x->ndim, x->shape), ndim);
        return false;
    }
    *out = axis < 0 ? axis + ndim : axis;
    return true;
}

static void fe_attrs_shape(gj_ag_attrs *a, int ndim, const int64_t *shape) {
    for (int k = 0; k < ndim; k++)
        a->i[k] = shape[k];
    a->ni = ndim;
}

/* The reshape op to x's own shape: a new header viewing x (an identity for
 * autograd). New scoped reference. */
static gj_tensor *fe_alias(const char *name, gj_tensor *x) {
    gj_ag_attrs a = {0};
    fe_attrs_shape(&a, x->ndim, x->shape);
    return fe_apply1(name, &gj_ag_op_reshape, &a, 1, &x);
}

/* ------------------------------------------------------- elementwise */

static gj_tensor *fe_binary(const char *op, const gj_ag_opdef *def, gj_tensor *a,
                            gj_tensor *b) {
    int nd;
    int64_t shape[GJ_MAX_DIMS];
    gj_tensor *ab[2] = {a, b};
    if (!fe_autocast(op, FE_AC_PROMOTE, 2, ab))
        return gj_fe_fail();
    a = ab[0], b = ab[1];
    if (!fe_check_float(a, op, "a") || !fe_check_float(b, op, "b") ||
        !fe_same_dtype(a, b, op, "a", "b") || !fe_broadcast(a, b, op, &nd, shape))
        return gj_fe_fail();
    gj_ag_attrs at = {0};
    gj_tensor *in[2] = {a, b};
    return fe_apply1(op, def, &at, 2, in);
}

gj_tensor *gj_add(gj_tensor *a, gj_tensor *b) { return fe_binary("gj_add", &gj_ag_op_add, a, b); }
gj_tensor *gj_sub(gj_tensor *a, gj_tensor *b) { return fe_binary("gj_sub", &gj_ag_op_sub, a, b); }
gj_tensor *gj_mul(gj_tensor *a, gj_tensor *b) { return fe_binary("gj_mul", &gj_ag_op_mul, a, b); }
gj_tensor *gj_div(gj_tensor *a, gj_tensor *b) { return fe_binary("gj_div", &gj_ag_op_div, a, b); }

/* A float unary op with optional scalar attribute c (f[0]). */
static gj_tensor *fe_unary(const char *op, const gj_ag_opdef *def, gj_tensor *x, double c) {
    if (!fe_check_float(x, op, "x"))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    a.f[0] = c;
    a.nf = 1;
    return fe_apply1(op, def, &a, 1, &x);
}

gj_tensor *gj_neg(gj_tensor *x) { return fe_unary("gj_neg", &gj_ag_op_neg, x, 0); }
gj_tensor *gj_exp(gj_tensor *x) { return fe_unary("gj_exp", &gj_ag_op_exp, x, 0); }
gj_tensor *gj_log(gj_tensor *x) { return fe_unary("gj_log", &gj_ag_op_log, x, 0); }
gj_tensor *gj_tanh(gj_tensor *x) { return fe_unary("gj_tanh", &gj_ag_op_tanh, x, 0); }
gj_tensor *gj_sigmoid(gj_tensor *x) { return fe_unary("gj_sigmoid", &gj_ag_op_sigmoid, x, 0); }
gj_tensor *gj_relu(gj_tensor *x) { return fe_unary("gj_relu", &gj_ag_op_relu, x, 0); }
gj_tensor *gj_gelu(gj_tensor *x) { return fe_unary("gj_gelu", &gj_ag_op_gelu, x, 0); }
gj_tensor *gj_sqrt(gj_tensor *x) { return fe_unary("gj_sqrt", &gj_ag_op_sqrt, x, 0); }
gj_tensor *gj_pow_scalar(gj_tensor *x, double p) {
    return fe_unary("gj_pow_scalar", &gj_ag_op_pow_scalar, x, p);
}
gj_tensor *gj_add_scalar(gj_tensor *x, double c) {
    return fe_unary("gj_add_scalar", &gj_ag_op_add_scalar, x, c);
}
gj_tensor *gj_mul_scalar(gj_tensor *x, double c) {
    return fe_unary("gj_mul_scalar", &gj_ag_op_mul_scalar, x, c);
}

/* -------------------------------------------------------- reductions */

/* Axes list -> bitmask (n_axes == 0: every axis); n receives the number of
 * reduced elements per output element. */
static bool fe_axes_mask(const char *op, const gj_tensor *x, int n_axes, const int *axes,
                         uint32_t *mask, int64_t *n) {
    *mask = 0;
    if (n_axes < 0 || (n_axes > 0 && !axes)) {
        gj_rt_set_error("%s: invalid axes list (n_axes %d, axes %s)", op, n_axes,
                        axes ? "given" : "NULL");
        return false;
    }
    if (n_axes == 0) {
        *mask = x->ndim ? (uint32_t)((1u << x->ndim) - 1u) : 0u;
    } else {
        for (int k = 0; k < n_axes; k++) {
            int ax;
            if (!fe_axis(axes[k], x->ndim, op, x, &ax))
                return false;
            if (*mask & (1u << ax)) {
                gj_rt_set_error("%s: axis %d appears twice in the axes list", op, axes[k]);
                return false;
            }
            *mask |= 1u << ax;
        }
    }
    *n = 1;
    for (int k = 0; k < x->ndim; k++)
        if (*mask & (1u << k))
            *n *= x->shape[k];
    return true;
}

static gj_tensor *fe_sum(const char *op, gj_tensor *x, int n_axes, const int *axes,
                         bool keepdim, bool mean) {
    uint32_t mask;
    int64_t n;
    if (!fe_autocast(op, FE_AC_F32, 1, &x) || !fe_check(x, op, "x"))
        return gj_fe_fail();
    /* gj_sum also counts i64 values (no gradient); gj_mean needs a float */
    if ((mean || x->dtype != GJ_I64) && !fe_check_float(x, op, "x"))
        return gj_fe_fail();
    if (!fe_axes_mask(op, x, n_axes, axes, &mask, &n))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    a.i[0] = mask;
    a.i[1] = keepdim;
    a.ni = 2;
    a.f[0] = mean ? (n > 0 ? 1.0 / (double)n : NAN) : 1.0;
    a.nf = 1;
    return fe_apply1(op, &gj_ag_op_sum, &a, 1, &x);
}

gj_tensor *gj_sum(gj_tensor *x, int n_axes, const int *axes, bool keepdim) {
    return fe_sum("gj_sum", x, n_axes, axes, keepdim, false);
}
gj_tensor *gj_mean(gj_tensor *x, int n_axes, const int *axes, bool keepdim) {
    return fe_sum("gj_mean", x, n_axes, axes, keepdim, true);
}

gj_tensor *gj_max(gj_tensor *x, int axis, bool keepdim) {
    const char *op = "gj_max";
    int ax;
    if (!fe_check_float(x, op, "x") || !fe_axis(axis, x->ndim, op, x, &ax))
        return gj_fe_fail();
    if (x->shape[ax] == 0) {
        char s[160];
        gj_rt_set_error("%s: cannot take the max over axis %d of size 0 (shape %s)", op, axis,
                        gj_rt_fmt_shape(s, sizeof s, x->ndim, x->shape));
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.i[0] = ax;
    a.i[1] = keepdim;
    a.ni = 2;
    return fe_apply1(op, &gj_ag_op_max, &a, 1, &x);
}

/* ------------------------------------------------------ linear algebra */

gj_tensor *gj_matmul(gj_tensor *a, gj_tensor *b) {
    const char *op = "gj_matmul";
    char sa[160], sb[160];
    gj_tensor *ab[2] = {a, b};
    if (!fe_autocast(op, FE_AC_LOW, 2, ab))
        return gj_fe_fail();
    a = ab[0], b = ab[1];
    if (!fe_check_float(a, op, "a") || !fe_check_float(b, op, "b") ||
        !fe_same_dtype(a, b, op, "a", "b"))
        return gj_fe_fail();
    if (a->ndim < 2 || b->ndim < 2) {
        gj_rt_fmt_shape(sa, sizeof sa, a->ndim, a->shape);
        gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape);
        gj_rt_set_error("%s: both operands need ndim >= 2, got a %s and b %s (%s)", op, sa, sb,
                        gj_rt_dtype_name(a->dtype));
        return gj_fe_fail();
    }
    if (a->shape[a->ndim - 1] != b->shape[b->ndim - 2]) {
        gj_rt_fmt_shape(sa, sizeof sa, a->ndim, a->shape);
        gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape);
        gj_rt_set_error("%s: inner dimensions differ: a %s, b %s (%s)", op, sa, sb,
                        gj_rt_dtype_name(a->dtype));
        return gj_fe_fail();
    }
    int nd;
    int64_t bs[GJ_MAX_DIMS];
    if (!gj_rt_broadcast_shape(a->ndim - 2, a->shape, b->ndim - 2, b->shape, &nd, bs)) {
        gj_rt_fmt_shape(sa, sizeof sa, a->ndim, a->shape);
        gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape);
        gj_rt_set_error("%s: batch dimensions of a %s and b %s cannot be broadcast (%s)", op,
                        sa, sb, gj_rt_dtype_name(a->dtype));
        return gj_fe_fail();
    }
    gj_ag_attrs at = {0};
    at.ni = 2; /* ta = tb = 0 */
    gj_tensor *in[2] = {a, b};
    return fe_apply1(op, &gj_ag_op_matmul, &at, 2, in);
}

gj_tensor *gj_linear(gj_tensor *x, gj_tensor *w, gj_tensor *b) {
    const char *op = "gj_linear";
    char sx[160], sw[160], sb[160] = "none";
    gj_tensor *xwb[3] = {x, w, b};
    if (!fe_autocast(op, FE_AC_LOW, 3, xwb))
        return gj_fe_fail();
    x = xwb[0], w = xwb[1], b = xwb[2];
    if (!fe_check_float(x, op, "x") || !fe_check_float(w, op, "w") ||
        !fe_same_dtype(x, w, op, "x", "w"))
        return gj_fe_fail();
    if (b && (!fe_check_float(b, op, "b") || !fe_same_dtype(x, b, op, "x", "b")))
        return gj_fe_fail();
    if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1] ||
        (b && (b->ndim != 1 || b->shape[0] != w->shape[0]))) {
        gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
        gj_rt_fmt_shape(sw, sizeof sw, w->ndim, w->shape);
        if (b)
            gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape);
        gj_rt_set_error("%s: expected x [..., in], w [out, in], b [out]; got x %s, w %s, b %s "
                        "(%s)",
                        op, sx, sw, sb, gj_rt_dtype_name(x->dtype));
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.i[0] = b != NULL;
    a.ni = 1;
    gj_tensor *in[3] = {x, w, b};
    return fe_apply1(op, &gj_ag_op_linear, &a, b ? 3 : 2, in);
}

/* ------------------------------------------------------- shape ops */

static gj_tensor *fe_permute(const char *op, gj_tensor *x, const int *perm) {
    int nd = x->ndim;
    if (nd > 0 && !perm) {
        gj_rt_set_error("%s: perm is NULL", op);
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    uint32_t seen = 0;
    for (int k = 0; k < nd; k++) {
        int ax;
        if (!fe_axis(perm[k], nd, op, x, &ax))
            return gj_fe_fail();
        if (seen & (1u << ax)) {
            gj_rt_set_error("%s: perm is not a permutation (axis %d repeated)", op, perm[k]);
            return gj_fe_fail();
        }
        seen |= 1u << ax;
        a.i[k] = ax;
    }
    a.ni = nd;
    return fe_apply1(op, &gj_ag_op_permute, &a, 1, &x);
}

gj_tensor *gj_permute(gj_tensor *x, const int *perm) {
    if (!fe_check(x, "gj_permute", "x"))
        return gj_fe_fail();
    return fe_permute("gj_permute", x, perm);
}

gj_tensor *gj_transpose(gj_tensor *x, int dim0, int dim1) {
    const char *op = "gj_transpose";
    int d0, d1;
    if (!fe_check(x, op, "x") || !fe_axis(dim0, x->ndim, op, x, &d0) ||
        !fe_axis(dim1, x->ndim, op, x, &d1))
        return gj_fe_fail();
    int perm[GJ_MAX_DIMS];
    for (int k = 0; k < x->ndim; k++)
        perm[k] = k;
    perm[d0] = d1;
    perm[d1] = d0;
    return fe_permute(op, x, perm);
}

/* Resolves a target shape with at most one -1 for x's element count. */
static bool fe_resolve_shape(const char *op, const gj_tensor *x, int ndim, const int64_t *shape,
                             int64_t *out) {
    char sx[160];
    if (ndim < 0 || ndim > GJ_MAX_DIMS || (ndim > 0 && !shape)) {
        gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
        gj_rt_set_error("%s: invalid target shape (ndim %d) for a tensor of shape %s", op, ndim,
                        sx);
        return false;
    }
    int infer = -1;
    int64_t known = 1;
    for (int k = 0; k < ndim; k++) {
        if (shape[k] == -1 && infer < 0) {
            infer = k;
        } else if (shape[k] < 0) {
            char st[160];
            gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
            gj_rt_set_error("%s: invalid target shape %s (only one -1 allowed, no other "
                            "negative size)",
                            op, gj_rt_fmt_shape(st, sizeof st, ndim, shape));
            return false;
        } else {
            known *= shape[k];
        }
        out[k] = shape[k];
    }
    bool ok;
    if (infer >= 0) {
        ok = known > 0 && x->numel % known == 0;
        if (ok)
            out[infer] = x->numel / known;
    } else {
        ok = known == x->numel;
    }
    if (!ok) {
        char st[160];
        gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
        gj_rt_set_error("%s: cannot reshape a tensor of shape %s (%lld elements, %s) to %s", op,
                        sx, (long long)x->numel, gj_rt_dtype_name(x->dtype),
                        gj_rt_fmt_shape(st, sizeof st, ndim, shape));
        return false;
    }
    return true;
}

gj_tensor *gj_reshape(gj_tensor *x, int ndim, const int64_t *shape) {
    const char *op = "gj_reshape";
    int64_t s[GJ_MAX_DIMS];
    if (!fe_check(x, op, "x") || !fe_resolve_shape(op, x, ndim, shape, s))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    fe_attrs_shape(&a, ndim, s);
    return fe_apply1(op, &gj_ag_op_reshape, &a, 1, &x);
}

/* Whether x's layout can be viewed as shape (ndim, ns) without copying
 * (the stride rule of torch.Tensor.view: each run of target dims must
 * cover a run of source dims that is contiguous within itself). */
static bool fe_viewable(const gj_tensor *x, int ndim, const int64_t *ns) {
    if (x->numel == 0 || x->ndim == 0)
        return true;
    int vd = ndim - 1;
    int64_t base = x->strides[x->ndim - 1], tnumel = 1, vnumel = 1;
    for (int td = x->ndim - 1; td >= 0; td--) {
        tnumel *= x->shape[td];
        if (td == 0 ||
            (x->shape[td - 1] != 1 && x->strides[td - 1] != tnumel * base)) {
            while (vd >= 0 && (vnumel < tnumel || ns[vd] == 1)) {
                vnumel *= ns[vd];
                vd--;
            }
            if (vnumel != tnumel)
                return false;
            if (td > 0) {
                base = x->strides[td - 1];
                tnumel = 1;
                vnumel = 1;
            }
        }
    }
    return vd == -1;
}

gj_tensor *gj_view(gj_tensor *x, int ndim, const int64_t *shape) {
    const char *op = "gj_view";
    int64_t s[GJ_MAX_DIMS];
    if (!fe_check(x, op, "x") || !fe_resolve_shape(op, x, ndim, shape, s))
        return gj_fe_fail();
    if (!fe_viewable(x, ndim, s)) {
        char sx[160], st[160], ss[160];
        gj_rt_set_error("%s: a tensor of shape %s and strides %s (%s) cannot be viewed as %s "
                        "without a copy; use gj_reshape",
                        op, gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape),
                        gj_rt_fmt_shape(ss, sizeof ss, x->ndim, x->strides),
                        gj_rt_dtype_name(x->dtype), gj_rt_fmt_shape(st, sizeof st, ndim, s));
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    fe_attrs_shape(&a, ndim, s);
    return fe_apply1(op, &gj_ag_op_reshape, &a, 1, &x);
}

gj_tensor *gj_expand(gj_tensor *x, int ndim, const int64_t *shape) {
    const char *op = "gj_expand";
    if (!fe_check(x, op, "x"))
        return gj_fe_fail();
    char sx[160], st[160];
    if (ndim < x->ndim || ndim > GJ_MAX_DIMS || (ndim > 0 && !shape)) {
        gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
        gj_rt_set_error("%s: cannot expand a tensor of shape %s to %d dims", op, sx, ndim);
        return gj_fe_fail();
    }
    int off = ndim - x->ndim;
    int64_t s[GJ_MAX_DIMS];
    for (int k = 0; k < ndim; k++) {
        int64_t want = shape[k];
        if (k >= off && want == -1)
            want = x->shape[k - off];
        bool ok = want >= 0 && (k < off || x->shape[k - off] == want || x->shape[k - off] == 1);
        if (!ok) {
            gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
            gj_rt_fmt_shape(st, sizeof st, ndim, shape);
            gj_rt_set_error("%s: cannot expand a tensor of shape %s (%s) to %s (dim %d)", op, sx,
                            gj_rt_dtype_name(x->dtype), st, k);
            return gj_fe_fail();
        }
        s[k] = want;
    }
    if (!gj_rt_check_shape(ndim, s, x->dtype, op))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    fe_attrs_shape(&a, ndim, s);
    return fe_apply1(op, &gj_ag_op_expand, &a, 1, &x);
}

gj_tensor *gj_narrow(gj_tensor *x, int axis, int64_t start, int64_t length) {
    const char *op = "gj_narrow";
    int ax;
    if (!fe_check(x, op, "x") || !fe_axis(axis, x->ndim, op, x, &ax))
        return gj_fe_fail();
    int64_t dim = x->shape[ax];
    if (start < 0)
        start += dim;
    if (start < 0 || start > dim || length < 0 || length > dim - start) {
        char s[160];
        gj_rt_set_error("%s: range [%lld, %lld + %lld) is outside axis %d of size %lld (shape "
                        "%s)",
                        op, (long long)start, (long long)start, (long long)length, axis,
                        (long long)dim, gj_rt_fmt_shape(s, sizeof s, x->ndim, x->shape));
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.i[0] = ax;
    a.i[1] = start;
    a.i[2] = length;
    a.ni = 3;
    return fe_apply1(op, &gj_ag_op_slice, &a, 1, &x);
}

/* cat of n >= 1 validated tensors: new UNscoped reference (groups of at
 * most GJ_RT_MAX_INPUTS are concatenated first, then their results). */
static gj_tensor *fe_cat_raw(int n, gj_tensor *const *xs, int axis) {
    gj_tensor *out[GJ_AG_MAX_OUT] = {0};
    gj_ag_attrs a = {0};
    a.i[0] = axis;
    a.ni = 1;
    if (n == 1)
        return gj_ag_apply(&gj_ag_op_copy, &a, 1, xs, out) < 1 ? NULL : out[0];
    if (n <= GJ_RT_MAX_INPUTS)
        return gj_ag_apply(&gj_ag_op_cat, &a, n, xs, out) < 1 ? NULL : out[0];
    int ng = (n + GJ_RT_MAX_INPUTS - 1) / GJ_RT_MAX_INPUTS;
    gj_tensor **parts = gj_rt_calloc((size_t)ng, sizeof *parts);
    gj_tensor *res = NULL;
    if (!parts)
        return gj_fe_fail();
    for (int g = 0; g < ng; g++) {
        int lo = g * GJ_RT_MAX_INPUTS, cnt = n - lo < GJ_RT_MAX_INPUTS ? n - lo : GJ_RT_MAX_INPUTS;
        if (!(parts[g] = fe_cat_raw(cnt, xs + lo, axis)))
            goto done;
    }
    res = fe_cat_raw(ng, parts, axis);
done:
    for (int g = 0; g < ng; g++)
        if (parts[g])
            gj_rt_tensor_release(parts[g]);
    gj_rt_free(parts);
    return res;
}

gj_tensor *gj_cat(int n, gj_tensor *const *xs, int axis) {
    const char *op = "gj_cat";
    if (n < 1 || !xs) {
        gj_rt_set_error("%s: need at least one tensor (n = %d, xs %s)", op, n,
                        xs ? "given" : "NULL");
        return gj_fe_fail();
    }
    gj_tensor *cast_xs[64];
    if (g_autocast != GJ_F32 && n <= 64) { /* (more parts: taken as they are) */
        memcpy(cast_xs, xs, (size_t)n * sizeof *xs);
        if (!fe_autocast(op, FE_AC_PROMOTE, n, cast_xs))
            return gj_fe_fail();
        xs = cast_xs;
    }
    for (int k = 0; k < n; k++) {
        char arg[32]; /* "xs[2] is NULL (caused by: ...)": the cause is kept */
        snprintf(arg, sizeof arg, "xs[%d]", k);
        if (!fe_check(xs[k], op, arg)) return gj_fe_fail();
    }
    int ax;
    if (!fe_axis(axis, xs[0]->ndim, op, xs[0], &ax))
        return gj_fe_fail();
    for (int k = 1; k < n; k++) {
        bool ok = xs[k]->dtype == xs[0]->dtype && xs[k]->ndim == xs[0]->ndim;
        for (int d = 0; ok && d < xs[0]->ndim; d++)
            ok = d == ax || xs[k]->shape[d] == xs[0]->shape[d];
        if (!ok) {
            char s0[160], sk[160];
            gj_rt_set_error("%s: xs[%d] (%s %s) does not match xs[0] (%s %s) outside axis %d", op,
                            k, gj_rt_dtype_name(xs[k]->dtype),
                            gj_rt_fmt_shape(sk, sizeof sk, xs[k]->ndim, xs[k]->shape),
                            gj_rt_dtype_name(xs[0]->dtype),
                            gj_rt_fmt_shape(s0, sizeof s0, xs[0]->ndim, xs[0]->shape), axis);
            return gj_fe_fail();
        }
    }
    gj_tensor *r = fe_cat_raw(n, xs, ax);
    if (!r) {
        fe_prefix_error(op);
        return gj_fe_fail();
    }
    return gj_fe_own(r);
}

/* A contiguous tensor is returned as a view of itself (new header, shared
 * storage, like torch.Tensor.contiguous returning self); otherwise a copy. */
gj_tensor *gj_contiguous(gj_tensor *x) {
    const char *op = "gj_contiguous";
    if (!fe_check(x, op, "x"))
        return gj_fe_fail();
    if (gj_rt_is_contiguous(x))
        return fe_alias(op, x);
    gj_ag_attrs a = {0};
    return fe_apply1(op, &gj_ag_op_copy, &a, 1, &x);
}

/* ----------------------------------------------------------- NN ops */

static gj_tensor *fe_softmax_like(const char *op, const gj_ag_opdef *def, gj_tensor *x,
                                  int axis) {
    int ax;
    if (!fe_autocast(op, FE_AC_F32, 1, &x) || !fe_check_float(x, op, "x"))
        return gj_fe_fail();
    if (x->ndim < 1) {
        gj_rt_set_error("%s: needs a tensor with ndim >= 1, got a 0-d %s tensor", op,
                        gj_rt_dtype_name(x->dtype));
        return gj_fe_fail();
    }
    if (!fe_axis(axis, x->ndim, op, x, &ax))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    a.i[0] = ax;
    a.ni = 1;
    return fe_apply1(op, def, &a, 1, &x);
}

gj_tensor *gj_softmax(gj_tensor *x, int axis) {
    return fe_softmax_like("gj_softmax", &gj_ag_op_softmax, x, axis);
}
gj_tensor *gj_log_softmax(gj_tensor *x, int axis) {
    return fe_softmax_like("gj_log_softmax", &gj_ag_op_log_softmax, x, axis);
}

gj_tensor *gj_layer_norm(gj_tensor *x, gj_tensor *w, gj_tensor *b, double eps) {
    const char *op = "gj_layer_norm";
    gj_tensor *xwb[3] = {x, w, b};
    if (!fe_autocast(op, FE_AC_F32, 3, xwb))
        return gj_fe_fail();
    x = xwb[0], w = xwb[1], b = xwb[2];
    if (!fe_check_float(x, op, "x"))
        return gj_fe_fail();
    if (x->ndim < 1) {
        gj_rt_set_error("%s: needs a tensor with ndim >= 1, got a 0-d %s tensor", op,
                        gj_rt_dtype_name(x->dtype));
        return gj_fe_fail();
    }
    if (!(eps >= 0.0) || isinf(eps)) {
        gj_rt_set_error("%s: eps must be finite and >= 0, got %g", op, eps);
        return gj_fe_fail();
    }
    int64_t c = x->shape[x->ndim - 1];
    gj_tensor *in[3] = {x, NULL, NULL};
    int n = 1;
    gj_tensor *const params[2] = {w, b};
    const char *names[2] = {"w", "b"};
    for (int k = 0; k < 2; k++) {
        gj_tensor *p = params[k];
        if (!p)
            continue;
        if (!fe_check_float(p, op, names[k]) || !fe_same_dtype(x, p, op, "x", names[k]))
            return gj_fe_fail();
        if (p->ndim != 1 || p->shape[0] != c) {
            char sx[160], sp[160];
            gj_rt_set_error("%s: %s must have shape [%lld] (the last dim of x %s), got %s", op,
                            names[k], (long long)c,
                            gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape),
                            gj_rt_fmt_shape(sp, sizeof sp, p->ndim, p->shape));
            return gj_fe_fail();
        }
        in[n++] = p;
    }
    gj_ag_attrs a = {0};
    a.i[0] = w != NULL;
    a.i[1] = b != NULL;
    a.ni = 2;
    a.f[0] = eps;
    a.nf = 1;
    return fe_apply1(op, &gj_ag_op_layer_norm, &a, n, in);
}

gj_tensor *gj_cross_entropy(gj_tensor *logits, gj_tensor *labels) {
    const char *op = "gj_cross_entropy";
    if (!fe_autocast(op, FE_AC_F32, 1, &logits) || !fe_check_float(logits, op, "logits") || !fe_check(labels, op, "labels"))
        return gj_fe_fail();
    char sl[160], sy[160];
    if (logits->ndim != 2 || labels->ndim != 1 || labels->shape[0] != logits->shape[0] ||
        logits->shape[0] < 1 || logits->shape[1] < 1) {
        gj_rt_fmt_shape(sl, sizeof sl, logits->ndim, logits->shape);
        gj_rt_fmt_shape(sy, sizeof sy, labels->ndim, labels->shape);
        gj_rt_set_error("%s: expected logits [N, K] and labels [N] with N, K >= 1; got logits "
                        "%s %s, labels %s %s",
                        op, sl, gj_rt_dtype_name(logits->dtype), sy,
                        gj_rt_dtype_name(labels->dtype));
        return gj_fe_fail();
    }
    if (!gj_rt_check_indices(op, "labels", labels, logits->shape[1]))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    gj_tensor *in[2] = {logits, labels};
    return fe_apply1(op, &gj_ag_op_cross_entropy, &a, 2, in);
}

/* Shapes of gj_linear_cross_entropy: h [..., C], weight [V, C], labels
 * h's leading shape, bias [V] or none; *n = the rows. */
static bool lce_shapes(const char *op, const gj_tensor *h, const gj_tensor *w, const gj_tensor *b,
                       const gj_tensor *labels, int64_t *n) {
    bool ok = h->ndim >= 1 && w->ndim == 2 && labels->ndim == h->ndim - 1 &&
              w->shape[1] == h->shape[h->ndim - 1] && (!b || (b->ndim == 1 && b->shape[0] == w->shape[0]));
    int64_t rows = 1;
    for (int d = 0; ok && d < labels->ndim; d++) {
        ok = labels->shape[d] == h->shape[d];
        rows *= h->shape[d];
    }
    ok = ok && rows >= 1 && w->shape[0] >= 1 && w->shape[1] >= 1;
    if (!ok) {
        char sh[160], sw[160], sl[160], sb[160] = "none";
        if (b)
            gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape);
        gj_rt_set_error("%s: expected h [..., C], weight [V, C], labels of h's leading shape and "
                        "bias [V] or NULL, with at least one row; got h %s %s, weight %s %s, "
                        "labels %s %s, bias %s", op,
                        gj_rt_fmt_shape(sh, sizeof sh, h->ndim, h->shape), gj_rt_dtype_name(h->dtype),
                        gj_rt_fmt_shape(sw, sizeof sw, w->ndim, w->shape), gj_rt_dtype_name(w->dtype),
                        gj_rt_fmt_shape(sl, sizeof sl, labels->ndim, labels->shape),
                        gj_rt_dtype_name(labels->dtype), sb);
        return false;
    }
    *n = rows;
    return true;
}

gj_tensor *gj_linear_cross_entropy(gj_tensor *h, gj_tensor *weight, gj_tensor *bias,
                                   gj_tensor *labels, int64_t ignore_index) {
    const char *op = "gj_linear_cross_entropy";
    gj_tensor *t[3] = {h, weight, bias};
    if (!fe_check_float(h, op, "h") || !fe_check_float(weight, op, "weight") ||
        (bias && !fe_check_float(bias, op, "bias")) || !fe_check(labels, op, "labels") ||
        !fe_autocast(op, FE_AC_LOW, 3, t))
        return gj_fe_fail();
    h = t[0], weight = t[1], bias = t[2];
    int64_t n = 0;
    if (!fe_same_dtype(h, weight, op, "h", "weight") ||
        (bias && !fe_same_dtype(h, bias, op, "h", "bias")) ||
        !lce_shapes(op, h, weight, bias, labels, &n) ||
        !gj_rt_check_labels(op, "labels", labels, weight->shape[0], ignore_index, true))
        return gj_fe_fail();
    gj_tensor *in[4] = {h, weight, labels, bias};
    if (h->ndim != 2) {
        in[0] = gj_reshape(h, 2, (int64_t[]){n, h->shape[h->ndim - 1]});
        in[2] = gj_reshape(labels, 1, &n);
        if (!in[0] || !in[2])
            return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.ni = 2;
    a.i[0] = ignore_index;
    a.i[1] = gj_is_grad_enabled() &&
             (gj_requires_grad(h) || gj_requires_grad(weight) || (bias && gj_requires_grad(bias)));
    return fe_apply1(op, &gj_ag_op_lce, &a, bias ? 4 : 3, in);
}

gj_tensor *gj_embedding(gj_tensor *table, gj_tensor *idx) {
    const char *op = "gj_embedding";
    if (!fe_check_float(table, op, "table") || !fe_check(idx, op, "idx"))
        return gj_fe_fail();
    if (table->ndim != 2 || idx->ndim + 1 > GJ_MAX_DIMS) {
        char st[160], si[160];
        gj_rt_set_error("%s: expected table [V, D] and idx with ndim < %d; got table %s, idx %s",
                        op, GJ_MAX_DIMS, gj_rt_fmt_shape(st, sizeof st, table->ndim, table->shape),
                        gj_rt_fmt_shape(si, sizeof si, idx->ndim, idx->shape));
        return gj_fe_fail();
    }
    if (!gj_rt_check_indices(op, "idx", idx, table->shape[0]))
        return gj_fe_fail();
    gj_ag_attrs a = {0};
    gj_tensor *in[2] = {table, idx};
    return fe_apply1(op, &gj_ag_op_embedding, &a, 2, in);
}

gj_tensor *gj_scaled_dot_product_attention(gj_tensor *q, gj_tensor *k, gj_tensor *v,
                                           bool causal, double scale, double dropout_p,
                                           bool train) {
    const char *op = "gj_scaled_dot_product_attention";
    gj_tensor *qkv[3] = {q, k, v};
    if (!fe_autocast(op, FE_AC_LOW, 3, qkv))
        return gj_fe_fail();
    q = qkv[0], k = qkv[1], v = qkv[2];
    if (!fe_check_float(q, op, "q") || !fe_check_float(k, op, "k") ||
        !fe_check_float(v, op, "v") || !fe_same_dtype(q, k, op, "q", "k") ||
        !fe_same_dtype(q, v, op, "q", "v"))
        return gj_fe_fail();
    if (!(dropout_p >= 0.0 && dropout_p < 1.0) || scale != scale) {
        gj_rt_set_error("%s: dropout_p must be in [0, 1) and scale a number (<= 0: 1/sqrt(D)); "
                        "got dropout_p %g, scale %g", op, dropout_p, scale);
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.nf = 2;
    a.ni = 3;
    a.i[0] = causal;
    a.f[1] = train ? dropout_p : 0.0;
    gj_rt_meta m[3], om[GJ_RT_MAX_OUTPUTS];
    for (int i = 0; i < 3; i++)
        gj_rt_meta_of(qkv[i], &m[i]);
    a.f[0] = scale > 0 ? scale : 1.0 / sqrt(q->ndim == 4 && q->shape[3] > 0 ? (double)q->shape[3] : 1.0);
    gj_rt_inst check = {.prim = GJ_P_ATTN_FWD, .n_in = 3, .scalar = a.f[0], .scalar2 = a.f[1],
                        .keepdim = causal};
    if (gj_rt_infer(&check, m, om) < 0) { /* the one shape rule, with the op's name */
        char why[512];
        snprintf(why, sizeof why, "%s", gj_last_error());
        gj_rt_set_error("%s: %s", op, why);
        return gj_fe_fail();
    }
    if (a.f[1] > 0) { /* the counters of gj_dropout on [B, H, T, S] */
        uint64_t seed = gj_rt_rng_seed();
        uint64_t offset = gj_rt_rng_reserve(
            (uint64_t)(q->shape[0] * q->shape[1] * q->shape[2] * k->shape[2]));
        memcpy(&a.i[1], &seed, sizeof seed);
        a.i[2] = (int64_t)offset;
    }
    return fe_apply1(op, &gj_ag_op_sdpa, &a, 3, qkv);
}

/* Training: reserves numel counters of the global generator, so each call
 * draws a fresh mask and backward regenerates the same one. Identity
 * (!train or p == 0): a view of x (new header, shared storage). */
gj_tensor *gj_dropout(gj_tensor *x, double p, bool train) {
    const char *op = "gj_dropout";
    if (!fe_check_float(x, op, "x"))
        return gj_fe_fail();
    if (!(p >= 0.0 && p <= 1.0)) {
        gj_rt_set_error("%s: p must be in [0, 1], got %g", op, p);
        return gj_fe_fail();
    }
    if (!train || p == 0.0)
        return fe_alias(op, x);
    gj_ag_attrs a = {0};
    uint64_t seed = gj_rt_rng_seed();
    uint64_t offset = gj_rt_rng_reserve((uint64_t)x->numel);
    memcpy(&a.i[0], &seed, sizeof seed);
    a.i[1] = (int64_t)offset;
    a.ni = 2;
    a.f[0] = p;
    a.nf = 1;
    return fe_apply1(op, &gj_ag_op_dropout, &a, 1, &x);
}

gj_tensor *gj_where(gj_tensor *cond, gj_tensor *a, gj_tensor *b) {
    const char *op = "gj_where";
    int nd, nd2;
    int64_t s[GJ_MAX_DIMS], s2[GJ_MAX_DIMS];
    gj_tensor *ab[2] = {a, b};
    if (!fe_autocast(op, FE_AC_PROMOTE, 2, ab))
        return gj_fe_fail();
    a = ab[0], b = ab[1];
    if (!fe_check(cond, op, "cond") || !fe_check_float(a, op, "a") ||
        !fe_check_float(b, op, "b") || !fe_same_dtype(a, b, op, "a", "b") ||
        !fe_broadcast(a, b, op, &nd, s))
        return gj_fe_fail();
    if (!gj_rt_broadcast_shape(cond->ndim, cond->shape, nd, s, &nd2, s2)) {
        char sc[160], sab[160];
        gj_rt_set_error("%s: cond %s (%s) cannot be broadcast with the shape %s of a and b", op,
                        gj_rt_fmt_shape(sc, sizeof sc, cond->ndim, cond->shape),
                        gj_rt_dtype_name(cond->dtype), gj_rt_fmt_shape(sab, sizeof sab, nd, s));
        return gj_fe_fail();
    }
    gj_ag_attrs at = {0};
    gj_tensor *in[3] = {cond, a, b};
    return fe_apply1(op, &gj_ag_op_where, &at, 3, in);
}

gj_tensor *gj_masked_fill(gj_tensor *x, gj_tensor *mask, double value) {
    const char *op = "gj_masked_fill";
    if (!fe_check_float(x, op, "x") || !fe_check(mask, op, "mask"))
        return gj_fe_fail();
    if (!fe_broadcasts_to(mask, x->ndim, x->shape)) {
        char sx[160], sm[160];
        gj_rt_set_error("%s: mask %s (%s) does not broadcast to x %s (%s)", op,
                        gj_rt_fmt_shape(sm, sizeof sm, mask->ndim, mask->shape),
                        gj_rt_dtype_name(mask->dtype),
                        gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape),
                        gj_rt_dtype_name(x->dtype));
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.f[0] = value;
    a.nf = 1;
    gj_tensor *in[2] = {x, mask};
    return fe_apply1(op, &gj_ag_op_masked_fill, &a, 2, in);
}

gj_tensor *gj_cast(gj_tensor *x, gj_dtype dtype) {
    const char *op = "gj_cast";
    if (!fe_check(x, op, "x"))
        return gj_fe_fail();
    if (!gj_rt_dtype_valid((int)dtype)) {
        gj_rt_set_error("%s: invalid target dtype %d", op, (int)dtype);
        return gj_fe_fail();
    }
    gj_ag_attrs a = {0};
    a.i[0] = dtype;
    a.ni = 1;
    if (gj_rt_dtype_is_float(dtype))
        return fe_apply1(op, &gj_ag_op_cast, &a, 1, &x);
    /* an integer result is not differentiable: no node, like PyTorch */
    gj_no_grad_push();
    gj_tensor *r = fe_apply1(op, &gj_ag_op_cast, &a, 1, &x);
    gj_no_grad_pop();
    return r;
}

/* ---------------------------------------------------------- in-place */

/* x may be modified in place: live, and not part of autograd while grad
 * mode is on (see the file comment). */
static bool fe_inplace_ok(gj_tensor *x, const char *op, const char *arg) {
    if (!fe_check(x, op, arg))
        return false;
    GJ_FE_TRACE_UNTRACEABLE(op); /* in-place ops are not recorded */
    if (gj_ag_grad_enabled() && gj_requires_grad(x)) {
        char s[160];
        gj_rt_fmt_shape(s, sizeof s, x->ndim, x->shape);
        if (gj_is_leaf(x))
            gj_rt_set_error("%s: a leaf tensor that requires grad (%s %s) cannot be modified in "
                            "place while grad mode is on; wrap the update in "
                            "gj_no_grad_push()/gj_no_grad_pop()",
                            op, gj_rt_dtype_name(x->dtype), s);
        else
            gj_rt_set_error("%s: a tensor that requires grad (%s %s, computed by an op) cannot "
                            "be modified in place while grad mode is on: in-place ops are not "
                            "recorded by autograd; use the out-of-place op",
                            op, gj_rt_dtype_name(x->dtype), s);
        return false;
    }
    for (int k = 0; k < x->ndim; k++) {
        if (x->strides[k] == 0 && x->shape[k] > 1) {
            char s[160];
            gj_rt_set_error("%s: %s (%s %s) is an expanded view whose elements share memory "
                            "(stride 0 on dim %d); make it contiguous before writing to it",
                            op, arg, gj_rt_dtype_name(x->dtype),
                            gj_rt_fmt_shape(s, sizeof s, x->ndim, x->shape), k);
            return false;
        }
    }
    return true;
}

/* y broadcasts to x's shape; both float of the same dtype. */
static bool fe_inplace_binary_ok(gj_tensor *x, gj_tensor *y, const char *op) {
    if (!fe_inplace_ok(x, op, "x") || !fe_check_float(x, op, "x") ||
        !fe_check_float(y, op, "y") || !fe_same_dtype(x, y, op, "x", "y"))
        return false;
    if (!fe_broadcasts_to(y, x->ndim, x->shape)) {
        char sx[160], sy[160];
        gj_rt_set_error("%s: y %s does not broadcast to x %s (%s)", op,
                        gj_rt_fmt_shape(sy, sizeof sy, y->ndim, y->shape),
                        gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape),
                        gj_rt_dtype_name(x->dtype));
        return false;
    }
    return true;
}

/* Runs one primitive on real tensors: new reference or NULL. */
static gj_tensor *fe_exec1(const gj_rt_inst *inst, gj_tensor *const *in) {
    gj_tensor *out[GJ_RT_MAX_OUTPUTS] = {0};
    int n = gj_rt_exec(inst, in, out);
    if (n < 1)
        return NULL;
    for (int k = 1; k < n; k++)
        gj_rt_tensor_release(out[k]);
    return out[0];
}

/* Writes the new value v (x's shape, stolen) into x and bumps its version. */
static int fe_store(gj_tensor *x, gj_tensor *v, const char *op) {
    if (!v) {
        fe_prefix_error(op);
        return -1;
    }
    int rc = gj_rt_copy_into(x, v);
    gj_rt_tensor_release(v);
    if (rc != 0) {
        fe_prefix_error(op);
        return -1;
    }
    gj_rt_bump_version(x);
    return 0;
}

static int fe_inplace_binary(gj_tensor *x, gj_tensor *y, gj_rt_prim p, const char *op) {
    if (!fe_inplace_binary_ok(x, y, op))
        return -1;
    gj_rt_inst inst = {.prim = p, .n_in = 2};
    gj_tensor *in[2] = {x, y};
    return fe_store(x, fe_exec1(&inst, in), op);
}

int gj_add_(gj_tensor *x, gj_tensor *y) { return fe_inplace_binary(x, y, GJ_P_ADD, "gj_add_"); }
int gj_mul_(gj_tensor *x, gj_tensor *y) { return fe_inplace_binary(x, y, GJ_P_MUL, "gj_mul_"); }

int gj_add_scaled_(gj_tensor *x, gj_tensor *y, double alpha) {
    const char *op = "gj_add_scaled_";
    if (!fe_inplace_binary_ok(x, y, op))
        return -1;
    gj_rt_inst ms = {.prim = GJ_P_MUL_SCALAR, .n_in = 1, .scalar = alpha};
    gj_tensor *t = fe_exec1(&ms, &y);
    if (!t) {
        fe_prefix_error(op);
        return -1;
    }
    gj_rt_inst add = {.prim = GJ_P_ADD, .n_in = 2};
    gj_tensor *in[2] = {x, t};
    gj_tensor *v = fe_exec1(&add, in);
    gj_rt_tensor_release(t);
    return fe_store(x, v, op);
}

int gj_mul_scalar_(gj_tensor *x, double c) {
    const char *op = "gj_mul_scalar_";
    if (!fe_inplace_ok(x, op, "x") || !fe_check_float(x, op, "x"))
        return -1;
    gj_rt_inst inst = {.prim = GJ_P_MUL_SCALAR, .n_in = 1, .scalar = c};
    return fe_store(x, fe_exec1(&inst, &x), op);
}

int gj_zero_(gj_tensor *x) {
    const char *op = "gj_zero_";
    if (!fe_inplace_ok(x, op, "x"))
        return -1;
    int64_t none[1] = {0};
    return fe_store(x, gj_rt_tensor_new(x->dtype, 0, none), op); /* 0-d zero, broadcast */
}

int gj_copy_(gj_tensor *dst, gj_tensor *src) {
    const char *op = "gj_copy_";
    if (!fe_inplace_ok(dst, op, "dst") || !fe_check(src, op, "src"))
        return -1;
    if (!fe_broadcasts_to(src, dst->ndim, dst->shape)) {
        char sd[160], ss[160];
        gj_rt_set_error("%s: src %s (%s) does not broadcast to dst %s (%s)", op,
                        gj_rt_fmt_shape(ss, sizeof ss, src->ndim, src->shape),
                        gj_rt_dtype_name(src->dtype),
                        gj_rt_fmt_shape(sd, sizeof sd, dst->ndim, dst->shape),
                        gj_rt_dtype_name(dst->dtype));
        return -1;
    }
    if (gj_rt_present(src) != 0 || gj_rt_present(dst) != 0 || gj_rt_copy_into(dst, src) != 0) {
        fe_prefix_error(op);
        return -1;
    }
    gj_rt_bump_version(dst);
    return 0;
}

/* ------------------------------------------------ convolution and pooling */

/* Sets "<op>: <what> (x [..] dt[, w [..] dt], <geometry>)" and returns NULL. */
static gj_tensor *fe_win_error(const char *op, const char *what, const gj_tensor *x,
                               const gj_tensor *w, const char *geo) {
    char sx[160], sw[160] = "";
    gj_rt_fmt_shape(sx, sizeof sx, x->ndim, x->shape);
    if (w)
        gj_rt_fmt_shape(sw, sizeof sw, w->ndim, w->shape);
    gj_rt_set_error("%s: %s (x %s %s%s%s%s%s, %s)", op, what, sx, gj_rt_dtype_name(x->dtype),
                    w ? ", w " : "", sw, w ? " " : "", w ? gj_rt_dtype_name(w->dtype) : "", geo);
    return gj_fe_fail();
}

/* Output positions of a window along one axis (<= 0: none). */
static int64_t fe_win_out(int64_t size, int64_t k, int64_t s, int64_t p, int64_t d) {
    int64_t room = size + 2 * p - d * (k - 1) - 1;
    return room < 0 ? 0 : room / s + 1;
}

#define FE_WIN_MAX (INT64_C(1) << 30) /* bound on sizes and window attributes */

gj_tensor *gj_conv2d(gj_tensor *x, gj_tensor *w, gj_tensor *b, int64_t stride, int64_t padding,
                     int64_t dilation, int64_t groups) {
    const char *op = "gj_conv2d";
    gj_tensor *xwb[3] = {x, w, b};
    if (!fe_autocast(op, FE_AC_LOW, 3, xwb))
        return gj_fe_fail();
    x = xwb[0], w = xwb[1], b = xwb[2];
    if (!fe_check_float(x, op, "x") || !fe_check_float(w, op, "w") ||
        !fe_same_dtype(x, w, op, "x", "w"))
        return gj_fe_fail();
    char geo[200];
    snprintf(geo, sizeof geo, "stride %lld, padding %lld, dilation %lld, groups %lld",
             (long long)stride, (long long)padding, (long long)dilation, (long long)groups);
    if (x->ndim != 4 || w->ndim != 4)
        return fe_win_error(op, "expected x [N, C, H, W] and w [OC, C/groups, kh, kw]", x, w,
                            geo);
    if (stride < 1 || padding < 0 || dilation < 1 || groups < 1 || stride > FE_WIN_MAX ||
        padding > FE_WIN_MAX || dilation > FE_WIN_MAX || groups > FE_WIN_MAX)
        return fe_win_error(op, "needs stride >= 1, padding >= 0, dilation >= 1, groups >= 1",
                            x, w, geo);
    for (int k = 0; k < 4; k++)
        if (x->shape[k] < 1 || w->shape[k] < 1 || x->shape[k] > FE_WIN_MAX ||
            w->shape[k] > FE_WIN_MAX)
            return fe_win_error(op, "every size of x and w must be >= 1", x, w, geo);
    int64_t C = x->shape[1], OC = w->shape[0];
    if (C % groups != 0 || OC % groups != 0)
        return fe_win_error(op, "the channels of x (C) and of w (OC) must be divisible by groups",
                            x, w, geo);
    if (w->shape[1] != C / groups)
        return fe_win_error(op, "w.shape[1] must be C / groups", x, w, geo);
    if (fe_win_out(x->shape[2], w->shape[2], stride, padding, dilation) < 1 ||
        fe_win_out(x->shape[3], w->shape[3], stride, padding, dilation) < 1)
        return fe_win_error(op, "output size would be <= 0 (kernel larger than the padded input)",
                            x, w, geo);
    if (b) {
        if (!fe_check_float(b, op, "b") || !fe_same_dtype(x, b, op, "x", "b"))
            return gj_fe_fail();
        if (b->ndim != 1 || b->shape[0] != OC) {
            char sb[160], msg[256];
            snprintf(msg, sizeof msg, "b must have shape [%lld] (OC), got %s", (long long)OC,
                     gj_rt_fmt_shape(sb, sizeof sb, b->ndim, b->shape));
            return fe_win_error(op, msg, x, w, geo);
        }
    }
    gj_ag_attrs a = {0};
    int64_t at[8] = {stride, stride, padding, padding, dilation, dilation, groups, b != NULL};
    memcpy(a.i, at, sizeof at);
    a.ni = 8;
    gj_tensor *in[3] = {x, w, b};
    return fe_apply1(op, &gj_ag_op_conv2d, &a, b ? 3 : 2, in);
}

/* Shared checks of the pools; NULL with an error, else runs op. */
static gj_tensor *fe_pool(const char *op, const gj_ag_opdef *def, gj_tensor *x, int64_t kernel,
                          int64_t stride, int64_t padding) {
    if (!fe_check_float(x, op, "x"))
        return gj_fe_fail();
    char geo[160];
    snprintf(geo, sizeof geo, "kernel %lld, stride %lld, padding %lld", (long long)kernel,
             (long long)stride, (long long)padding);
    if (x->ndim != 4)
        return fe_win_error(op, "expected x [N, C, H, W]", x, NULL, geo);
    if (stride == 0)
        stride = kernel;
    if (kernel < 1 || stride < 1 || padding < 0 || kernel > FE_WIN_MAX || stride > FE_WIN_MAX)
        return fe_win_error(op, "needs kernel >= 1, stride >= 1 (0: the kernel), padding >= 0",
                            x, NULL, geo);
    if (padding > kernel / 2)
        return fe_win_error(op, "padding must be at most half the kernel size", x, NULL, geo);
    for (int k = 0; k < 4; k++)
        if (x->shape[k] < 1 || x->shape[k] > FE_WIN_MAX)
            return fe_win_error(op, "every size of x must be >= 1", x, NULL, geo);
    if (fe_win_out(x->shape[2], kernel, stride, padding, 1) < 1 ||
        fe_win_out(x->shape[3], kernel, stride, padding, 1) < 1)
        return fe_win_error(op, "output size would be <= 0 (kernel larger than the padded input)",
                            x, NULL, geo);
    if (def == &gj_ag_op_max_pool2d && x->dtype == GJ_BF16 && kernel * kernel > 256)
        return fe_win_error(op, "bf16 supports at most 256 taps (kernel <= 16)", x, NULL, geo);
    gj_ag_attrs a = {0};
    int64_t at[8] = {kernel, kernel, stride, stride, padding, padding, 1, 1};
    memcpy(a.i, at, sizeof at);
    a.ni = 8;
    return fe_apply1(op, def, &a, 1, &x);
}

gj_tensor *gj_max_pool2d(gj_tensor *x, int64_t kernel, int64_t stride, int64_t padding) {
    return fe_pool("gj_max_pool2d", &gj_ag_op_max_pool2d, x, kernel, stride, padding);
}

gj_tensor *gj_avg_pool2d(gj_tensor *x, int64_t kernel, int64_t stride, int64_t padding) {
    return fe_pool("gj_avg_pool2d", &gj_ag_op_avg_pool2d, x, kernel, stride, padding);
}
