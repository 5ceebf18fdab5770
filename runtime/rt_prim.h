/* SPDX-License-Identifier: MIT */
/*
 * rt_prim.h - the primitive vocabulary shared by the eager kernels and the
 * compiler. Every forward and backward formula of autograd/ is written as a
 * sequence of these instructions (through a builder); the eager builder runs
 * each one at once with gj_rt_exec, the recording builder of jit/ records it
 * as an IR node. gj_rt_infer is the single shape/dtype rule for both.
 *
 * Conventions:
 *   - Elementwise unary/binary/ternary ops broadcast their inputs (numpy
 *     rules) and require equal float dtypes (WHERE: cond may be any dtype).
 *     bf16 inputs are computed in f32 and rounded once on store.
 *   - Reductions take a bitmask of input axes (bit k = axis k).
 *   - Composites (SOFTMAX .. CE_BWD) act on the LAST axis; the eager kernel
 *     is hand-fused, the compiler decomposes them into primitives
 *     (autograd/ag_decompose.c).
 */
#ifndef GJ_RT_PRIM_H
#define GJ_RT_PRIM_H

#define GJ_RT_PRIM_LIST(X)                                                            \
    /* unary elementwise: 1 input */                                                  \
    X(NEG) X(EXP) X(LOG) X(TANH) X(SIGMOID) X(RELU) X(GELU) X(SQRT) X(RSQRT) X(RECIP) \
    X(GELU_GRAD)  /* d gelu(x) / dx */                                                \
    X(STEP)       /* x > 0 ? 1 : 0 */                                                 \
    X(ADD_SCALAR) /* x + scalar */                                                    \
    X(MUL_SCALAR) /* x * scalar */                                                    \
    X(POW_SCALAR) /* x ^ scalar */                                                    \
    X(CAST)       /* to inst.dtype */                                                 \
    /* binary elementwise: 2 inputs */                                                \
    X(ADD) X(SUB) X(MUL) X(DIV)                                                       \
    X(EQ)         /* x == y ? 1 : 0, in x's dtype */                                  \
    /* ternary: cond, a, b */                                                         \
    X(WHERE)                                                                          \
    /* nullary */                                                                     \
    X(FILL)         /* inst.shape/dtype filled with scalar */                         \
    X(DROPOUT_MASK) /* inst.shape/dtype: 0 or 1/(1-p), p = scalar, from seed/offset */ \
    /* reductions: 1 input, axes mask, keepdim */                                     \
    X(SUM) X(MAX)                                                                     \
    /* movement */                                                                    \
    X(RESHAPE)  /* to inst.shape (same numel) */                                      \
    X(PERMUTE)  /* inst.shape[k] = source axis of output axis k */                    \
    X(EXPAND)   /* to inst.shape (broadcast of size-1 / leading dims) */              \
    X(SLICE)    /* axis, start, len */                                                \
    X(PAD)      /* axis, start, len: zeros of size len on axis, x placed at start */  \
    X(CAT)      /* n_in inputs, along axis */                                         \
    X(COPY)     /* contiguous copy */                                                 \
    /* linear algebra */                                                              \
    X(MATMUL)   /* [..,M,K]x[..,K,N], batch dims broadcast; ta/tb transpose last 2 */ \
    /* indexing (indices are i64) */                                                  \
    X(GATHER_ROWS)      /* table[V,D], idx[...] -> [..., D] */                        \
    X(SCATTER_ADD_ROWS) /* src[..., D], idx[...] -> [V=len, D] zeros + src rows */    \
    /* composites over the last axis */                                               \
    X(SOFTMAX) X(LOG_SOFTMAX)                                                         \
    X(SOFTMAX_BWD)      /* (y, gy) -> y * (gy - sum(gy*y)) */                         \
    X(LOG_SOFTMAX_BWD)  /* (y, gy) -> gy - exp(y) * sum(gy) */                        \
    X(LN_FWD)           /* x, eps=scalar -> xhat, mean[...,1], rstd[...,1] */         \
    X(LN_BWD)           /* (x, mean, rstd, gxhat) -> gx */                            \
    X(CE_FWD)           /* (logits[N,K], labels[N]) -> loss[], lse[N] */              \
    X(CE_BWD)           /* (logits, lse, labels, g[]) -> glogits[N,K] */           \
    /* nullary, appended (used by the CE decompositions for the one-hot) */           \
    X(IOTA)             /* inst.shape/dtype: value = index along inst.axis */        \
    /* sliding windows (conv2d, pooling), appended; geometry in inst.shape, below */  \
    X(IM2COL)  /* x[N,C,H,W] -> [N,C,kh,kw,OH,OW], scalar outside the image */        \
    X(COL2IM)  /* cols[N,C,kh,kw,OH,OW] -> [N,C,H=start,W=len], overlaps summed */   \
    /* fused attention (runtime/attention.h), appended */                            \
    X(ATTN_FWD) /* q[B,H,T,D], k[B,H,S,D], v[B,H,S,E] -> o[B,H,T,E], lse[B,H,T] */    \
    X(ATTN_BWD) /* (q, k, v, o, go, lse) -> gq, gk, gv */                             \
    /* fused linear cross-entropy (kernels_lce.c), appended */                        \
    X(LCE_FWD) /* (h[N,C], w[V,C], labels[N] (, b[V])) -> loss[] (, gh, gw (, gb)) */

typedef enum gj_rt_prim {
#define GJ_RT_PRIM_ENUM(name) GJ_P_##name,
    GJ_RT_PRIM_LIST(GJ_RT_PRIM_ENUM)
#undef GJ_RT_PRIM_ENUM
    GJ_P_COUNT
} gj_rt_prim;

const char *gj_rt_prim_name(gj_rt_prim p);

#define GJ_RT_MAX_INPUTS 16 /* CAT takes at most this many */
#define GJ_RT_ATTN_DMAX 128 /* ATTN_*: the largest head size (attention.h's GJ_ATTN_DMAX) */
#define GJ_RT_MAX_OUTPUTS 4 /* LCE_FWD with a bias */

/* One instruction: the primitive and its attributes (unused fields zero). */
typedef struct gj_rt_inst {
    gj_rt_prim prim;
    int n_in;
    double scalar;   /* ADD/MUL/POW_SCALAR c, FILL value, dropout p, LN eps */
    gj_dtype dtype;  /* CAST target; FILL/DROPOUT_MASK dtype */
    uint32_t axes;   /* SUM/MAX: bitmask of reduced input axes */
    bool keepdim;    /* SUM/MAX */
    bool ta, tb;     /* MATMUL */
    bool wide;       /* MATMUL of bf16 operands: the f32 result, not rounded
                        to bf16 (the compiled programs' legal form) */
    int axis;        /* SLICE/PAD/CAT */
    int64_t start;   /* SLICE/PAD */
    int64_t len;     /* SLICE: length taken; PAD: output length; SCATTER_ADD_ROWS: V */
    uint64_t seed, rng_offset; /* DROPOUT_MASK, ATTN_*'s dropout */
    double scalar2;  /* ATTN_*: dropout p (scalar: the scale; keepdim: causal) */
                     /* LCE_FWD: start = the ignored label, keepdim = also the
                        gradients for a unit upstream gradient */
    int ndim;        /* RESHAPE/EXPAND/FILL/DROPOUT_MASK target, PERMUTE rank;
                        IM2COL/COL2IM: 8, the window geometry in shape[] */
    int64_t shape[GJ_MAX_DIMS];
} gj_rt_inst;

/* IM2COL / COL2IM geometry: inst.shape = {kh, kw, sh, sw, ph, pw, dh, dw}
 * (kernel, stride, zero padding, dilation; ndim = 8). Output position
 * (oh, ow) and kernel tap (i, j) read image row h = oh*sh - ph + i*dh and
 * column w = ow*sw - pw + j*dw; OH = (H + 2 ph - dh (kh - 1) - 1) / sh + 1,
 * the same for OW. IM2COL writes inst.scalar where (h, w) is outside the
 * image; COL2IM (its adjoint, inst.start = H, inst.len = W) drops those
 * taps and adds the others into their image element. */
#define GJ_RT_WIN_NDIM 8

/* Shape and dtype of a value. */
typedef struct gj_rt_meta {
    gj_dtype dtype;
    int ndim;
    int64_t shape[GJ_MAX_DIMS];
} gj_rt_meta;

void gj_rt_meta_of(const gj_tensor *t, gj_rt_meta *out);

/* Output metas of inst applied to inputs of metas in[0..n_in). Returns the
 * number of outputs (1..3) or -1 with an error naming the primitive, the
 * shapes and dtypes. The one shape rule of eager and compiled modes. */
int gj_rt_infer(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_meta *out);
/* gj_rt_infer's rule for ATTN_FWD / ATTN_BWD (inputs already counted). */
int gj_rt_attn_infer(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_meta *out);
/* gj_rt_infer's rule for LCE_FWD. */
int gj_rt_lce_infer(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_meta *out);

/* LCE_FWD on dense row-major arrays (kernels_lce.c): the eager kernel's
 * core, which a compiled program calls with its buffers (the same bits).
 * h [N, C], w [V, C] and b [V] (or NULL) share dtype dt (f32, bf16, f64);
 * labels [N] lie in [0, V) or equal `ignore`. Writes *loss (f32, f64 for
 * f64): the mean over the rows not ignored of cross_entropy(h w^T + b);
 * with gh non-NULL also gh [N, C], gw [V, C] and, with b, gb [V] (dtype
 * dt): its gradients for a unit upstream gradient. 0, or -1 with an error
 * (a label out of range, out of memory) before anything is written. */
typedef struct gj_rt_lce {
    gj_dtype dt;
    int64_t N, C, V, ignore;
    const void *h, *w, *b;
    const int64_t *labels;
    void *loss, *gh, *gw, *gb;
} gj_rt_lce;
int gj_rt_lce_run(const gj_rt_lce *a);
/* The rows of one chunk (a function of N and V alone). */
int64_t gj_rt_lce_chunk_rows(int64_t N, int64_t V);
/* Test switch: the logits of a chunk at most this many bytes (0: the default). */
void gj_rt_lce_test_chunk_bytes(int64_t bytes);

/* Runs inst on real tensors. outs must have room for GJ_RT_MAX_OUTPUTS
 * entries (all are cleared first); outs[k] receive new references (movement
 * primitives return views sharing storage when the layout allows). Returns
 * the number of outputs, or -1 with an error set (nothing leaked). */
int gj_rt_exec(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor **outs);

/* The geometry of an IM2COL / COL2IM instruction on its input meta. */
typedef struct gj_rt_win {
    int64_t N, C, H, W;               /* image [N, C, H, W] */
    int64_t kh, kw, sh, sw, ph, pw, dh, dw;
    int64_t OH, OW;                   /* output positions */
} gj_rt_win;
/* Fills *g from inst and its input meta (IM2COL: the image; COL2IM: the
 * columns). false (no error set) if they do not fit together; gj_rt_infer
 * has the checks with messages. */
bool gj_rt_win_of(const gj_rt_inst *inst, const gj_rt_meta *in, gj_rt_win *g);
/* The two window kernels on raw memory, shared by the eager kernels and
 * the compiled program (so both give the same bits). x points at image
 * element (0,0,0,0) with element strides xs[4]; cols at element 0 with
 * strides cs[6]; out is contiguous. im2col copies (any float dtype, pad
 * value rounded to dt); col2im zero-fills out and adds each plane's taps in
 * (i, j, oh, ow) order, so every image element receives its terms in
 * (i, j) order, in dt (f32 and f64) or in an f32 scratch rounded once
 * (bf16). Both split over (n, c) planes only: results do not depend on the
 * thread count. col2im returns 0, or -1 with an error (out of memory for
 * the bf16 scratch). */
void gj_rt_im2col_run(const gj_rt_win *g, gj_dtype dt, const void *x, const int64_t *xs,
                      double pad, void *out);
int gj_rt_col2im_run(const gj_rt_win *g, gj_dtype dt, const void *cols, const int64_t *cs,
                     void *out);

#endif /* GJ_RT_PRIM_H */
