/* SPDX-License-Identifier: MIT */
/*
 * ops_elementwise.c - forward and backward formulas of the elementwise ops:
 * arithmetic (broadcasting), unary math, scalar ops, where / masked_fill,
 * cast, copy and dropout.
 *
 * Invariants: formulas use the builder only (no tensor access, no branch on
 * values; branches on attributes and metas are fine, they are part of the
 * node). Backward writes gin[i] only where gj_ag_needs_grad; a NULL output
 * gradient means "zero", so backward then returns no gradients at all.
 * Gradients of broadcast inputs are summed back to the input's shape.
 *
 * Attributes (filled by frontend/ops.c):
 *   pow_scalar: f[0] = p;  add_scalar / mul_scalar: f[0] = c
 *   masked_fill: f[0] = fill value (inputs x, mask)
 *   cast: i[0] = target dtype
 *   dropout: i[0] = generator seed (bits of the uint64), i[1] = first
 *            counter (gj_rt_rng_reserve), f[0] = p. The mask is regenerated
 *            in backward from (seed, offset), never saved.
 */
#include "autograd/ops_common.h"

/* ------------------------------------------------------------ arithmetic */

/* add: out = a + b.  ga = sum_to(g), gb = sum_to(g). */
static int add_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_binary(b, GJ_P_ADD, in[0], in[1]));
    return 1;
}
static int add_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    for (int i = 0; i < 2; i++)
        if (gj_ag_needs_grad(ctx, i))
            GJ_OPS_TRY(gin[i] = gj_ops_to_input(b, ctx, i, g));
    return 0;
}
const gj_ag_opdef gj_ag_op_add = {"add", add_fwd, add_bwd};

/* sub: out = a - b.  ga = sum_to(g), gb = sum_to(-g). */
static int sub_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_binary(b, GJ_P_SUB, in[0], in[1]));
    return 1;
}
static int sub_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    if (gj_ag_needs_grad(ctx, 0))
        GJ_OPS_TRY(gin[0] = gj_ops_to_input(b, ctx, 0, g));
    if (gj_ag_needs_grad(ctx, 1)) {
        gj_val *ng = gj_ag_unary(b, GJ_P_NEG, g);
        GJ_OPS_TRY(ng);
        GJ_OPS_TRY(gin[1] = gj_ops_to_input(b, ctx, 1, ng));
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_sub = {"sub", sub_fwd, sub_bwd};

/* mul: out = a * b; saves a, b.  ga = sum_to(g*b), gb = sum_to(g*a). */
static int mul_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_binary(b, GJ_P_MUL, in[0], in[1]));
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, in[1]);
    return 1;
}
static int mul_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    for (int i = 0; i < 2; i++) {
        if (!gj_ag_needs_grad(ctx, i))
            continue;
        gj_val *t = gj_ag_binary(b, GJ_P_MUL, g, gj_ag_saved(ctx, 1 - i));
        GJ_OPS_TRY(t);
        GJ_OPS_TRY(gin[i] = gj_ops_to_input(b, ctx, i, t));
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_mul = {"mul", mul_fwd, mul_bwd};

/* div: out = a / b; saves a, b.  ga = sum_to(g/b), gb = sum_to(-(g/b)*a/b). */
static int div_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_binary(b, GJ_P_DIV, in[0], in[1]));
    gj_ag_save(ctx, in[0]);
    gj_ag_save(ctx, in[1]);
    return 1;
}
static int div_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    gj_val *x = gj_ag_saved(ctx, 0), *y = gj_ag_saved(ctx, 1);
    gj_val *gy = gj_ag_binary(b, GJ_P_DIV, g, y); /* g / b */
    GJ_OPS_TRY(gy);
    if (gj_ag_needs_grad(ctx, 0))
        GJ_OPS_TRY(gin[0] = gj_ops_to_input(b, ctx, 0, gy));
    if (gj_ag_needs_grad(ctx, 1)) {
        gj_val *t = gj_ag_binary(b, GJ_P_MUL, gy, x);
        GJ_OPS_TRY(t);
        GJ_OPS_TRY(t = gj_ag_binary(b, GJ_P_DIV, t, y));
        GJ_OPS_TRY(t = gj_ag_unary(b, GJ_P_NEG, t));
        GJ_OPS_TRY(gin[1] = gj_ops_to_input(b, ctx, 1, t));
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_div = {"div", div_fwd, div_bwd};

/* ------------------------------------------------------------ unary math */

/* A unary op whose forward is one primitive on in[0], saving the input
 * (save_out false) or the output (save_out true). */
static int unary_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, gj_rt_prim p, bool save_out,
                     gj_val *x, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_unary(b, p, x));
    gj_ag_save(ctx, save_out ? outs[0] : x);
    return 1;
}

/* neg: gx = -g. */
static int neg_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_unary(b, GJ_P_NEG, in[0]));
    return 1;
}
static int neg_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    GJ_OPS_TRY(gin[0] = gj_ag_unary(b, GJ_P_NEG, gout[0]));
    return 0;
}
const gj_ag_opdef gj_ag_op_neg = {"neg", neg_fwd, neg_bwd};

/* exp: saves y.  gx = g * y. */
static int exp_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_EXP, true, in[0], outs);
}
static int exp_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, gout[0], gj_ag_saved(ctx, 0)));
    return 0;
}
const gj_ag_opdef gj_ag_op_exp = {"exp", exp_fwd, exp_bwd};

/* log: saves x.  gx = g / x. */
static int log_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_LOG, false, in[0], outs);
}
static int log_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_DIV, gout[0], gj_ag_saved(ctx, 0)));
    return 0;
}
const gj_ag_opdef gj_ag_op_log = {"log", log_fwd, log_bwd};

/* tanh: saves y.  gx = g * (1 - y*y), computed as g - g*(y*y) (3 kernels). */
static int tanh_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_TANH, true, in[0], outs);
}
static int tanh_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_val *y = gj_ag_saved(ctx, 0);
    gj_val *t = gj_ag_binary(b, GJ_P_MUL, y, y);
    GJ_OPS_TRY(t);
    GJ_OPS_TRY(t = gj_ag_binary(b, GJ_P_MUL, gout[0], t));
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_SUB, gout[0], t));
    return 0;
}
const gj_ag_opdef gj_ag_op_tanh = {"tanh", tanh_fwd, tanh_bwd};

/* sigmoid: saves y.  gx = g * y * (1 - y). */
static int sigmoid_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_SIGMOID, true, in[0], outs);
}
static int sigmoid_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                       gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_val *y = gj_ag_saved(ctx, 0);
    gj_val *om = gj_ag_unary(b, GJ_P_NEG, y);
    GJ_OPS_TRY(om);
    GJ_OPS_TRY(om = gj_ag_scalar_op(b, GJ_P_ADD_SCALAR, om, 1.0));
    gj_val *t = gj_ag_binary(b, GJ_P_MUL, gout[0], y);
    GJ_OPS_TRY(t);
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, t, om));
    return 0;
}
const gj_ag_opdef gj_ag_op_sigmoid = {"sigmoid", sigmoid_fwd, sigmoid_bwd};

/* relu: saves y (y > 0 exactly where x > 0).  gx = g * step(y). */
static int relu_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_RELU, true, in[0], outs);
}
static int relu_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_val *s = gj_ag_unary(b, GJ_P_STEP, gj_ag_saved(ctx, 0));
    GJ_OPS_TRY(s);
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, gout[0], s));
    return 0;
}
const gj_ag_opdef gj_ag_op_relu = {"relu", relu_fwd, relu_bwd};

/* gelu (tanh approximation): saves x.  gx = g * gelu'(x). */
static int gelu_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_GELU, false, in[0], outs);
}
static int gelu_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_val *d = gj_ag_unary(b, GJ_P_GELU_GRAD, gj_ag_saved(ctx, 0));
    GJ_OPS_TRY(d);
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, gout[0], d));
    return 0;
}
const gj_ag_opdef gj_ag_op_gelu = {"gelu", gelu_fwd, gelu_bwd};

/* sqrt: saves y.  gx = (0.5 * g) / y. */
static int sqrt_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    return unary_fwd(b, ctx, GJ_P_SQRT, true, in[0], outs);
}
static int sqrt_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_val *h = gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, gout[0], 0.5);
    GJ_OPS_TRY(h);
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_DIV, h, gj_ag_saved(ctx, 0)));
    return 0;
}
const gj_ag_opdef gj_ag_op_sqrt = {"sqrt", sqrt_fwd, sqrt_bwd};

/* pow_scalar: out = x^p (f[0] = p); saves x.  gx = g * (p * x^(p-1));
 * p == 0 gives zeros (the constant function), like PyTorch; p == 1 gives g. */
static int pow_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                   gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_scalar_op(b, GJ_P_POW_SCALAR, in[0], a->f[0]));
    gj_ag_save(ctx, in[0]);
    return 1;
}
static int pow_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                   gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    double p = a->f[0];
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    if (p == 0.0) {
        GJ_OPS_TRY(gin[0] = gj_ag_fill(b, m->dtype, m->ndim, m->shape, 0.0));
        return 0;
    }
    if (p == 1.0) { /* 1 * x^0 = 1 for every x */
        gin[0] = gout[0];
        return 0;
    }
    gj_val *d = gj_ag_scalar_op(b, GJ_P_POW_SCALAR, gj_ag_saved(ctx, 0), p - 1.0);
    GJ_OPS_TRY(d);
    GJ_OPS_TRY(d = gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, d, p));
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, gout[0], d));
    return 0;
}
const gj_ag_opdef gj_ag_op_pow_scalar = {"pow_scalar", pow_fwd, pow_bwd};

/* add_scalar: out = x + c.  gx = g. */
static int add_scalar_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                          gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_scalar_op(b, GJ_P_ADD_SCALAR, in[0], a->f[0]));
    return 1;
}
static int identity_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                        gj_val *const *gout, gj_val **gin) {
    if (gout[0] && gj_ag_needs_grad(ctx, 0))
        gin[0] = gout[0];
    return 0;
}
const gj_ag_opdef gj_ag_op_add_scalar = {"add_scalar", add_scalar_fwd, identity_bwd};

/* mul_scalar: out = x * c.  gx = g * c. */
static int mul_scalar_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                          gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, in[0], a->f[0]));
    return 1;
}
static int mul_scalar_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                          gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    GJ_OPS_TRY(gin[0] = gj_ag_scalar_op(b, GJ_P_MUL_SCALAR, gout[0], a->f[0]));
    return 0;
}
const gj_ag_opdef gj_ag_op_mul_scalar = {"mul_scalar", mul_scalar_fwd, mul_scalar_bwd};

/* ------------------------------------------------------- where / masking */

/* where(cond, a, b): saves cond.  ga = sum_to(where(cond, g, 0)),
 * gb = sum_to(where(cond, 0, g)); cond gets no gradient. */
static int where_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                     gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_where(b, in[0], in[1], in[2]));
    gj_ag_save(ctx, in[0]);
    return 1;
}
static int where_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                     gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g)
        return 0;
    gj_rt_meta gm;
    gj_ag_meta(b, g, &gm);
    gj_val *cond = gj_ag_saved(ctx, 0);
    gj_val *z = gj_ops_const0(b, gm.dtype, 0.0);
    GJ_OPS_TRY(z);
    for (int i = 1; i <= 2; i++) {
        if (!gj_ag_needs_grad(ctx, i))
            continue;
        gj_val *t = i == 1 ? gj_ag_where(b, cond, g, z) : gj_ag_where(b, cond, z, g);
        GJ_OPS_TRY(t);
        GJ_OPS_TRY(gin[i] = gj_ops_to_input(b, ctx, i, t));
    }
    return 0;
}
const gj_ag_opdef gj_ag_op_where = {"where", where_fwd, where_bwd};

/* masked_fill(x, mask) = where(mask, value, x) with value = f[0]; the
 * output has x's shape (the frontend checks mask broadcasts to it).
 * Saves mask.  gx = sum_to(where(mask, 0, g)). */
static int masked_fill_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                           gj_val *const *in, gj_val **outs) {
    gj_rt_meta xm;
    gj_ag_meta(b, in[0], &xm);
    gj_val *v = gj_ops_const0(b, xm.dtype, a->f[0]);
    GJ_OPS_TRY(v);
    GJ_OPS_TRY(outs[0] = gj_ag_where(b, in[1], v, in[0]));
    gj_ag_save(ctx, in[1]);
    return 1;
}
static int masked_fill_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                           gj_val *const *gout, gj_val **gin) {
    gj_val *g = gout[0];
    if (!g || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_rt_meta gm;
    gj_ag_meta(b, g, &gm);
    gj_val *z = gj_ops_const0(b, gm.dtype, 0.0);
    GJ_OPS_TRY(z);
    gj_val *t = gj_ag_where(b, gj_ag_saved(ctx, 0), z, g);
    GJ_OPS_TRY(t);
    GJ_OPS_TRY(gin[0] = gj_ops_to_input(b, ctx, 0, t));
    return 0;
}
const gj_ag_opdef gj_ag_op_masked_fill = {"masked_fill", masked_fill_fwd, masked_fill_bwd};

/* ------------------------------------------------------- cast / copy */

/* cast to dtype i[0].  gx = cast(g, input dtype); integer inputs get none. */
static int cast_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    GJ_OPS_TRY(outs[0] = gj_ag_cast(b, in[0], (gj_dtype)a->i[0]));
    return 1;
}
static int cast_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                    gj_val *const *gout, gj_val **gin) {
    const gj_rt_meta *m = gj_ag_input_meta(ctx, 0);
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0) || !gj_rt_dtype_is_float(m->dtype))
        return 0;
    gj_rt_meta gm;
    gj_ag_meta(b, gout[0], &gm);
    if (!gj_rt_dtype_is_float(gm.dtype))
        return 0;
    if (gm.dtype == m->dtype)
        gin[0] = gout[0];
    else
        GJ_OPS_TRY(gin[0] = gj_ag_cast(b, gout[0], m->dtype));
    return 0;
}
const gj_ag_opdef gj_ag_op_cast = {"cast", cast_fwd, cast_bwd};

/* copy: contiguous copy.  gx = g. */
static int copy_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                    gj_val *const *in, gj_val **outs) {
    gj_rt_inst inst = {.prim = GJ_P_COPY, .n_in = 1};
    GJ_OPS_TRY(outs[0] = gj_ag_emit1(b, &inst, in));
    return 1;
}
const gj_ag_opdef gj_ag_op_copy = {"copy", copy_fwd, identity_bwd};

/* ------------------------------------------------------------- dropout */

/* The DROPOUT_MASK instruction of a dropout node (shape/dtype of meta m). */
static void dropout_inst(const gj_ag_attrs *a, const gj_rt_meta *m, gj_rt_inst *inst) {
    memset(inst, 0, sizeof *inst);
    inst->prim = GJ_P_DROPOUT_MASK;
    inst->n_in = 0;
    inst->scalar = a->f[0];
    inst->dtype = m->dtype;
    uint64_t seed;
    memcpy(&seed, &a->i[0], sizeof seed);
    inst->seed = seed;
    inst->rng_offset = (uint64_t)a->i[1];
    inst->ndim = m->ndim;
    for (int k = 0; k < m->ndim; k++)
        inst->shape[k] = m->shape[k];
}

/* dropout: out = x * mask(seed, offset, p), mask in {0, 1/(1-p)}.
 * gx = g * mask (the same mask, regenerated). Saves nothing. */
static int dropout_fwd(gj_ag_builder *b, gj_ag_fctx *ctx, const gj_ag_attrs *a, int n_in,
                       gj_val *const *in, gj_val **outs) {
    gj_rt_meta m;
    gj_ag_meta(b, in[0], &m);
    gj_rt_inst inst;
    dropout_inst(a, &m, &inst);
    gj_val *mask = gj_ag_emit1(b, &inst, NULL);
    GJ_OPS_TRY(mask);
    GJ_OPS_TRY(outs[0] = gj_ag_binary(b, GJ_P_MUL, in[0], mask));
    return 1;
}
static int dropout_bwd(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                       gj_val *const *gout, gj_val **gin) {
    if (!gout[0] || !gj_ag_needs_grad(ctx, 0))
        return 0;
    gj_rt_inst inst;
    dropout_inst(a, gj_ag_input_meta(ctx, 0), &inst);
    gj_val *mask = gj_ag_emit1(b, &inst, NULL);
    GJ_OPS_TRY(mask);
    GJ_OPS_TRY(gin[0] = gj_ag_binary(b, GJ_P_MUL, gout[0], mask));
    return 0;
}
const gj_ag_opdef gj_ag_op_dropout = {"dropout", dropout_fwd, dropout_bwd};
