/* SPDX-License-Identifier: MIT */
/*
 * kernels_elementwise.c - eager kernels of the elementwise primitives
 * (unary, scalar, binary, EQ, WHERE) and of the generators FILL,
 * DROPOUT_MASK and IOTA.
 *
 * Invariants:
 *   - Every op is one contiguous loop over gj_math.h functions in its
 *     compute type (f32 for f32 and bf16 data, f64, or i64 for EQ/WHERE on
 *     integers), compiled once per x86-64 level (GJ_K_CLONES) so it
 *     vectorizes. The loop sees restrict pointers to dense arrays only.
 *   - The iteration space is the output's (contiguous) shape with size-1
 *     dims dropped and mergeable dims coalesced. An input that is dense in
 *     that order and already in the compute type is read in place; any other
 *     input (strided, broadcast with stride 0, bf16, cond of another dtype)
 *     is gathered tile by tile (GJ_K_TILE elements) into a stack buffer in
 *     the compute type. bf16 outputs are computed into a buffer and rounded
 *     once on store.
 *   - WHERE's condition is loaded as truth values (nonzero -> 1, NaN counts
 *     as nonzero) so no dtype conversion can turn a nonzero into zero.
 *   - When an input is stored along the output's second-to-last dim (a
 *     transposed view), the iteration goes by 32x32 blocks of the last two
 *     dims instead, so that input is read through few cache lines / pages.
 *   - Parallel over flat output ranges (GJ_K_GRAIN); each output element is
 *     computed by exactly one thread from the same inputs, so results do not
 *     depend on the thread count.
 */
#include "runtime/kernels.h"

#define GJ_K_TILE 1024

/* Compute types. */
enum { GJ_K_CT_F32 = 0, GJ_K_CT_F64 = 1, GJ_K_CT_I64 = 2 };

typedef struct gj_k_ew_par {
    float cf;  /* inst->scalar in f32 */
    double cd; /* inst->scalar */
} gj_k_ew_par;

/* out[0..n) = op(in[k][0..n)): dense arrays of the compute type. */
typedef void (*gj_k_ew_fn)(int64_t n, const void *const *in, void *out, const gj_k_ew_par *p);

/* ------------------------------------------------------------ op loops */

#define GJ_K_EW1_T(NAME, T, CVAL, EXPR)                                                    \
    GJ_K_CLONES static void NAME(int64_t n, const void *const *in, void *outp,              \
                                 const gj_k_ew_par *p) {                                    \
        const T *restrict a = (const T *)in[0];                                             \
        T *restrict o = (T *)outp;                                                          \
        const T c = (T)(CVAL);                                                              \
        (void)c;                                                                            \
        for (int64_t i = 0; i < n; i++) {                                                   \
            const T x = a[i];                                                               \
            o[i] = (EXPR);                                                                  \
        }                                                                                   \
    }
#define GJ_K_EW1(OP, EF, ED)                          \
    GJ_K_EW1_T(ew_##OP##_f32, float, p->cf, EF)       \
    GJ_K_EW1_T(ew_##OP##_f64, double, p->cd, ED)

GJ_K_EW1(neg, -x, -x)
GJ_K_EW1(exp, gj_m_exp_f(x), gj_m_exp_d(x))
GJ_K_EW1(log, gj_m_log_f(x), gj_m_log_d(x))
GJ_K_EW1(tanh, gj_m_tanh_f(x), gj_m_tanh_d(x))
GJ_K_EW1(sigmoid, gj_m_sigmoid_f(x), gj_m_sigmoid_d(x))
GJ_K_EW1(relu, gj_m_relu_f(x), gj_m_relu_d(x))
GJ_K_EW1(gelu, gj_m_gelu_f(x), gj_m_gelu_d(x))
GJ_K_EW1(sqrt, gj_m_sqrt_f(x), gj_m_sqrt_d(x))
GJ_K_EW1(rsqrt, gj_m_rsqrt_f(x), gj_m_rsqrt_d(x))
GJ_K_EW1(recip, 1.0f / x, 1.0 / x)
GJ_K_EW1(gelu_grad, gj_m_gelu_grad_f(x), gj_m_gelu_grad_d(x))
GJ_K_EW1(step, gj_m_step_f(x), gj_m_step_d(x))
GJ_K_EW1(add_scalar, x + c, x + c)
GJ_K_EW1(mul_scalar, x * c, x * c)
/* pow with the exponents gj_m_pow special-cases as compile-time constants
 * (same values as gj_m_pow_*(x, c), but the loop vectorizes). */
GJ_K_EW1(pow_2, gj_m_pow_f(x, 2.0f), gj_m_pow_d(x, 2.0))
GJ_K_EW1(pow_3, gj_m_pow_f(x, 3.0f), gj_m_pow_d(x, 3.0))
GJ_K_EW1(pow_1, gj_m_pow_f(x, 1.0f), gj_m_pow_d(x, 1.0))
GJ_K_EW1(pow_h, gj_m_pow_f(x, 0.5f), gj_m_pow_d(x, 0.5))
GJ_K_EW1(pow_m1, gj_m_pow_f(x, -1.0f), gj_m_pow_d(x, -1.0))
GJ_K_EW1(pow, gj_m_pow_f(x, c), gj_m_pow_d(x, c))

#define GJ_K_EW2_T(NAME, T, EXPR)                                                          \
    GJ_K_CLONES static void NAME(int64_t n, const void *const *in, void *outp,              \
                                 const gj_k_ew_par *p) {                                    \
        const T *restrict a = (const T *)in[0];                                             \
        const T *restrict b = (const T *)in[1];                                             \
        T *restrict o = (T *)outp;                                                          \
        (void)p;                                                                            \
        for (int64_t i = 0; i < n; i++) {                                                   \
            const T x = a[i], y = b[i];                                                     \
            o[i] = (EXPR);                                                                  \
        }                                                                                   \
    }
#define GJ_K_EW2(OP, EXPR)                        \
    GJ_K_EW2_T(ew_##OP##_f32, float, EXPR)        \
    GJ_K_EW2_T(ew_##OP##_f64, double, EXPR)

GJ_K_EW2(add, x + y)
GJ_K_EW2(sub, x - y)
GJ_K_EW2(mul, x * y)
GJ_K_EW2(div, x / y)
GJ_K_EW2(eq, x == y ? 1 : 0)
GJ_K_EW2_T(ew_eq_i64, int64_t, x == y ? 1 : 0)

#define GJ_K_EW3_T(NAME, T)                                                                \
    GJ_K_CLONES static void NAME(int64_t n, const void *const *in, void *outp,              \
                                 const gj_k_ew_par *p) {                                    \
        const T *restrict cd = (const T *)in[0];                                            \
        const T *restrict a = (const T *)in[1];                                             \
        const T *restrict b = (const T *)in[2];                                             \
        T *restrict o = (T *)outp;                                                          \
        (void)p;                                                                            \
        for (int64_t i = 0; i < n; i++)                                                     \
            o[i] = cd[i] != 0 ? a[i] : b[i];                                                \
    }
GJ_K_EW3_T(ew_where_f32, float)
GJ_K_EW3_T(ew_where_f64, double)
GJ_K_EW3_T(ew_where_i64, int64_t)

/* The loop of prim in compute type ct (NULL if none). */
static gj_k_ew_fn gj_k_ew_pick(gj_rt_prim prim, int ct, double scalar) {
#define GJ_K_PICK(P, OP) \
    case GJ_P_##P: return ct == GJ_K_CT_F32 ? ew_##OP##_f32 : ct == GJ_K_CT_F64 ? ew_##OP##_f64 : NULL;
    switch (prim) {
        GJ_K_PICK(NEG, neg)
        GJ_K_PICK(EXP, exp)
        GJ_K_PICK(LOG, log)
        GJ_K_PICK(TANH, tanh)
        GJ_K_PICK(SIGMOID, sigmoid)
        GJ_K_PICK(RELU, relu)
        GJ_K_PICK(GELU, gelu)
        GJ_K_PICK(SQRT, sqrt)
        GJ_K_PICK(RSQRT, rsqrt)
        GJ_K_PICK(RECIP, recip)
        GJ_K_PICK(GELU_GRAD, gelu_grad)
        GJ_K_PICK(STEP, step)
        GJ_K_PICK(ADD_SCALAR, add_scalar)
        GJ_K_PICK(MUL_SCALAR, mul_scalar)
        GJ_K_PICK(ADD, add)
        GJ_K_PICK(SUB, sub)
        GJ_K_PICK(MUL, mul)
        GJ_K_PICK(DIV, div)
    case GJ_P_POW_SCALAR:
        if (ct == GJ_K_CT_I64)
            return NULL;
        if (scalar == 2.0)
            return ct == GJ_K_CT_F32 ? ew_pow_2_f32 : ew_pow_2_f64;
        if (scalar == 3.0)
            return ct == GJ_K_CT_F32 ? ew_pow_3_f32 : ew_pow_3_f64;
        if (scalar == 1.0)
            return ct == GJ_K_CT_F32 ? ew_pow_1_f32 : ew_pow_1_f64;
        if (scalar == 0.5)
            return ct == GJ_K_CT_F32 ? ew_pow_h_f32 : ew_pow_h_f64;
        if (scalar == -1.0)
            return ct == GJ_K_CT_F32 ? ew_pow_m1_f32 : ew_pow_m1_f64;
        return ct == GJ_K_CT_F32 ? ew_pow_f32 : ew_pow_f64;
    case GJ_P_EQ:
        return ct == GJ_K_CT_F32 ? ew_eq_f32 : ct == GJ_K_CT_F64 ? ew_eq_f64 : ew_eq_i64;
    case GJ_P_WHERE:
        return ct == GJ_K_CT_F32 ? ew_where_f32 : ct == GJ_K_CT_F64 ? ew_where_f64 : ew_where_i64;
    default:
        return NULL;
    }
#undef GJ_K_PICK
}

/* ------------------------------------------------------------- loaders */

/* dst[0..n) (dense, compute type) = convert(src[i*ss]) (ss in elements). */
typedef void (*gj_k_ld_fn)(void *dst, const char *src, int64_t ss, int64_t n);

#define GJ_K_LD(NAME, DT, ST, EXPR)                                                        \
    static void NAME(void *dp, const char *sp, int64_t ss, int64_t n) {                    \
        DT *restrict d = (DT *)dp;                                                          \
        const ST *restrict s = (const ST *)(const void *)sp;                                \
        if (ss == 1) {                                                                      \
            for (int64_t i = 0; i < n; i++) {                                               \
                const ST x = s[i];                                                          \
                d[i] = (EXPR);                                                              \
            }                                                                               \
        } else if (ss == 0) {                                                               \
            const ST x = s[0];                                                              \
            const DT v = (EXPR);                                                            \
            for (int64_t i = 0; i < n; i++)                                                 \
                d[i] = v;                                                                   \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                const ST x = s[i * ss];                                                     \
                d[i] = (EXPR);                                                              \
            }                                                                               \
        }                                                                                   \
    }

/* Values (only float -> float and i64 -> i64 are used for operands). */
GJ_K_LD(ld_f32_f32, float, float, x)
GJ_K_LD(ld_f32_f64, float, double, (float)x)
GJ_K_LD(ld_f32_bf16, float, uint16_t, gj_m_bf16_to_f32(x))
GJ_K_LD(ld_f64_f64, double, double, x)
GJ_K_LD(ld_f64_f32, double, float, (double)x)
GJ_K_LD(ld_f64_bf16, double, uint16_t, (double)gj_m_bf16_to_f32(x))
GJ_K_LD(ld_i64_i64, int64_t, int64_t, x)
/* Truth values of a condition: 1 where nonzero (NaN included), else 0. */
GJ_K_LD(tv_f32_f32, float, float, x != 0 ? 1.0f : 0.0f)
GJ_K_LD(tv_f32_f64, float, double, x != 0 ? 1.0f : 0.0f)
GJ_K_LD(tv_f32_bf16, float, uint16_t, (x & 0x7fffu) != 0 ? 1.0f : 0.0f)
GJ_K_LD(tv_f32_i64, float, int64_t, x != 0 ? 1.0f : 0.0f)
GJ_K_LD(tv_f64_f32, double, float, x != 0 ? 1.0 : 0.0)
GJ_K_LD(tv_f64_f64, double, double, x != 0 ? 1.0 : 0.0)
GJ_K_LD(tv_f64_bf16, double, uint16_t, (x & 0x7fffu) != 0 ? 1.0 : 0.0)
GJ_K_LD(tv_f64_i64, double, int64_t, x != 0 ? 1.0 : 0.0)
GJ_K_LD(tv_i64_f32, int64_t, float, x != 0 ? 1 : 0)
GJ_K_LD(tv_i64_f64, int64_t, double, x != 0 ? 1 : 0)
GJ_K_LD(tv_i64_bf16, int64_t, uint16_t, (x & 0x7fffu) != 0 ? 1 : 0)
GJ_K_LD(tv_i64_i64, int64_t, int64_t, x != 0 ? 1 : 0)

/* [compute type][source dtype in gj_dtype order f32, f64, bf16, i64]. */
static const gj_k_ld_fn g_ld[3][4] = {
    {ld_f32_f32, ld_f32_f64, ld_f32_bf16, NULL},
    {ld_f64_f32, ld_f64_f64, ld_f64_bf16, NULL},
    {NULL, NULL, NULL, ld_i64_i64},
};
static const gj_k_ld_fn g_tv[3][4] = {
    {tv_f32_f32, tv_f32_f64, tv_f32_bf16, tv_f32_i64},
    {tv_f64_f32, tv_f64_f64, tv_f64_bf16, tv_f64_i64},
    {tv_i64_f32, tv_i64_f64, tv_i64_bf16, tv_i64_i64},
};

GJ_K_CLONES static void gj_k_store_bf16(uint16_t *restrict o, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        o[i] = gj_m_f32_to_bf16(x[i]);
}

/* Not cloned itself: the resolver of a cloned extern function is exported
 * whatever the visibility. */
void gj_rt_k_round_bf16(uint16_t *restrict o, const float *restrict x, int64_t n) {
    gj_k_store_bf16(o, x, n);
}

/* ---------------------------------------------------------------- plan */

typedef struct gj_k_ew_plan {
    int nd; /* coalesced rank >= 1 */
    int64_t shape[GJ_MAX_DIMS];
    int nin;
    const char *base[3];
    int64_t st[3][GJ_MAX_DIMS]; /* element strides per coalesced dim */
    size_t el[3];
    bool direct[3]; /* dense in output order, already the compute type */
    gj_k_ld_fn ld[3];
    char *obase;
    bool odirect; /* output dtype is the compute type (else bf16 via buffer) */
    bool all_direct;
    size_t cel; /* compute element size */
    gj_k_ew_fn fn;
    gj_k_ew_par par;
} gj_k_ew_plan;

/* Gathers flat output elements [flat, flat+n) of input i into dst. */
static void gj_k_ew_gather(const gj_k_ew_plan *p, int i, char *dst, int64_t flat, int64_t n) {
    int last = p->nd - 1;
    const int64_t *st = p->st[i];
    int64_t idx[GJ_MAX_DIMS], off = 0, rem = flat;
    for (int k = last; k >= 0; k--) {
        idx[k] = rem % p->shape[k];
        rem /= p->shape[k];
        off += idx[k] * st[k];
    }
    int64_t done = 0;
    while (done < n) {
        int64_t run = p->shape[last] - idx[last];
        if (run > n - done)
            run = n - done;
        p->ld[i](dst + done * (int64_t)p->cel, p->base[i] + off * (int64_t)p->el[i], st[last], run);
        done += run;
        idx[last] += run;
        off += run * st[last];
        for (int k = last; k > 0 && idx[k] == p->shape[k]; k--) {
            off += st[k - 1] - p->shape[k] * st[k];
            idx[k] = 0;
            idx[k - 1]++;
        }
    }
}

/* A tile buffer in any compute type (a union, so typed access is legal). */
typedef union gj_k_tile {
    float f[GJ_K_TILE * 2];
    double d[GJ_K_TILE];
    int64_t i[GJ_K_TILE];
    uint16_t h[GJ_K_TILE * 4];
} gj_k_tile;

static void gj_k_ew_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_ew_plan *p = ctx;
    _Alignas(64) gj_k_tile tb[4];
    char *buf[4] = {(char *)&tb[0], (char *)&tb[1], (char *)&tb[2], (char *)&tb[3]};
    int64_t tile = p->all_direct ? e - b : GJ_K_TILE;
    for (int64_t t = b; t < e; t += tile) {
        int64_t n = e - t < tile ? e - t : tile;
        const void *ptr[3] = {NULL, NULL, NULL};
        for (int i = 0; i < p->nin; i++) {
            if (p->direct[i]) {
                ptr[i] = p->base[i] + t * (int64_t)p->cel;
            } else {
                gj_k_ew_gather(p, i, buf[i], t, n);
                ptr[i] = buf[i];
            }
        }
        void *o = p->odirect ? (void *)(p->obase + t * (int64_t)p->cel) : (void *)buf[3];
        p->fn(n, ptr, o, &p->par);
        if (!p->odirect)
            gj_k_store_bf16((uint16_t *)(void *)p->obase + t, tb[3].f, n);
    }
}

/* Blocked schedule, for an input whose storage runs along the output's
 * second-to-last dim (a transposed view): items are GJ_K_BLK x GJ_K_BLK
 * blocks of the last two dims (times the outer dims). Each block is gathered
 * into dense buffers (a transposed input column by column, i.e. along its
 * storage), so every input is read through a few cache lines per block
 * instead of one line and one page per element; the results are copied out
 * row by row. */
#define GJ_K_BLK 32
static void gj_k_ew_range_blocked(void *ctx, int64_t b, int64_t e) {
    const gj_k_ew_plan *p = ctx;
    _Static_assert(GJ_K_BLK * GJ_K_BLK <= GJ_K_TILE, "a block fits a tile");
    _Alignas(64) gj_k_tile tb[4];
    char *buf[4] = {(char *)&tb[0], (char *)&tb[1], (char *)&tb[2], (char *)&tb[3]};
    _Alignas(64) union {
        double d[GJ_K_BLK];
        float f[GJ_K_BLK * 2];
        int64_t i[GJ_K_BLK];
    } colu;
    char *col = (char *)&colu;
    int nd = p->nd, kr = nd - 2, kc = nd - 1;
    int64_t R = p->shape[kr], C = p->shape[kc];
    int64_t nbr = (R + GJ_K_BLK - 1) / GJ_K_BLK, nbc = (C + GJ_K_BLK - 1) / GJ_K_BLK;
    for (int64_t it = b; it < e; it++) {
        /* row blocks vary fastest: consecutive blocks read the same few
         * storage pages of the transposed input (TLB reach) */
        int64_t br = it % nbr, rest = it / nbr, bc = rest % nbc, o = rest / nbc;
        int64_t r0 = br * GJ_K_BLK, c0 = bc * GJ_K_BLK;
        int64_t nr = R - r0 < GJ_K_BLK ? R - r0 : GJ_K_BLK;
        int64_t nc = C - c0 < GJ_K_BLK ? C - c0 : GJ_K_BLK;
        int64_t ooff[3] = {0, 0, 0}, rem = o;
        for (int k = kr - 1; k >= 0; k--) {
            int64_t ik = rem % p->shape[k];
            rem /= p->shape[k];
            for (int i = 0; i < p->nin; i++)
                ooff[i] += ik * p->st[i][k];
        }
        const void *ptr[3] = {NULL, NULL, NULL};
        for (int i = 0; i < p->nin; i++) {
            int64_t sr = p->st[i][kr], sc = p->st[i][kc], cel = (int64_t)p->cel;
            if (sr != 0 && sr < sc) {
                /* stored along the rows: read each block column as one run
                 * (a few cache lines), then transpose it into the buffer */
                for (int64_t c = 0; c < nc; c++) {
                    int64_t off = ooff[i] + r0 * sr + (c0 + c) * sc;
                    p->ld[i](col, p->base[i] + off * (int64_t)p->el[i], sr, nr);
                    if (cel == 4)
                        for (int64_t r = 0; r < nr; r++)
                            memcpy(buf[i] + (r * nc + c) * 4, col + r * 4, 4);
                    else
                        for (int64_t r = 0; r < nr; r++)
                            memcpy(buf[i] + (r * nc + c) * 8, col + r * 8, 8);
                }
            } else {
                for (int64_t r = 0; r < nr; r++) {
                    int64_t off = ooff[i] + (r0 + r) * sr + c0 * sc;
                    p->ld[i](buf[i] + r * nc * cel, p->base[i] + off * (int64_t)p->el[i], sc, nc);
                }
            }
            ptr[i] = buf[i];
        }
        p->fn(nr * nc, ptr, buf[3], &p->par);
        int64_t ob = o * R * C + r0 * C + c0; /* output is contiguous */
        for (int64_t r = 0; r < nr; r++) {
            const char *src = buf[3] + r * nc * (int64_t)p->cel;
            if (p->odirect)
                memcpy(p->obase + (ob + r * C) * (int64_t)p->cel, src, (size_t)nc * p->cel);
            else
                gj_k_store_bf16((uint16_t *)(void *)p->obase + ob + r * C, tb[3].f + r * nc, nc);
        }
    }
}

int gj_rt_ew_dense(gj_rt_prim prim, gj_dtype ct, double scalar, int64_t n,
                   const void *const *in, void *out) {
    gj_k_ew_fn fn = gj_k_ew_pick(prim, ct == GJ_F64 ? GJ_K_CT_F64 : GJ_K_CT_F32, scalar);
    if (!fn)
        return -1;
    gj_k_ew_par par = {(float)scalar, scalar};
    fn(n, in, out, &par);
    return 0;
}

int gj_rt_k_pointwise(const gj_rt_inst *inst, gj_tensor *const *in, gj_tensor *out) {
    if (out->numel == 0)
        return 0;
    gj_k_ew_plan p;
    memset(&p, 0, sizeof p);
    /* The compute type follows the value operands (WHERE: in[1]). */
    gj_dtype vdt = inst->prim == GJ_P_WHERE ? in[1]->dtype : in[0]->dtype;
    int ct = vdt == GJ_F64 ? GJ_K_CT_F64 : vdt == GJ_I64 ? GJ_K_CT_I64 : GJ_K_CT_F32;
    gj_dtype cdt = ct == GJ_K_CT_F64 ? GJ_F64 : ct == GJ_K_CT_I64 ? GJ_I64 : GJ_F32;
    p.fn = gj_k_ew_pick(inst->prim, ct, inst->scalar);
    if (!p.fn) {
        gj_rt_set_error("%s: no kernel for dtype %s", gj_rt_prim_name(inst->prim),
                        gj_rt_dtype_name(vdt));
        return -1;
    }
    p.par.cf = (float)inst->scalar;
    p.par.cd = inst->scalar;
    p.nin = inst->n_in;
    p.cel = gj_rt_dtype_size(cdt);

    /* Input strides aligned to the output's dims (broadcast dims read 0). */
    int ond = out->ndim;
    int64_t ast[3][GJ_MAX_DIMS];
    for (int i = 0; i < p.nin; i++) {
        const gj_tensor *t = in[i];
        int off = ond - t->ndim;
        for (int k = 0; k < ond; k++) {
            int kt = k - off;
            ast[i][k] = (kt < 0 || t->shape[kt] != out->shape[k]) ? 0 : t->strides[kt];
        }
        p.base[i] = (const char *)gj_rt_data_ptr(t);
        p.el[i] = gj_rt_dtype_size(t->dtype);
        bool cond = inst->prim == GJ_P_WHERE && i == 0;
        p.ld[i] = cond ? g_tv[ct][t->dtype] : g_ld[ct][t->dtype];
        if (!p.ld[i]) {
            gj_rt_set_error("%s: cannot load %s input as %s", gj_rt_prim_name(inst->prim),
                            gj_rt_dtype_name(t->dtype), gj_rt_dtype_name(cdt));
            return -1;
        }
    }
    /* Coalesce: drop size-1 dims, merge dims dense in every operand. */
    for (int k = 0; k < ond; k++) {
        int64_t sz = out->shape[k];
        if (sz == 1)
            continue;
        int j = p.nd - 1;
        bool merge = j >= 0;
        for (int i = 0; merge && i < p.nin; i++)
            merge = p.st[i][j] == ast[i][k] * sz;
        if (merge) {
            p.shape[j] *= sz;
            for (int i = 0; i < p.nin; i++)
                p.st[i][j] = ast[i][k];
        } else {
            p.shape[p.nd] = sz;
            for (int i = 0; i < p.nin; i++)
                p.st[i][p.nd] = ast[i][k];
            p.nd++;
        }
    }
    if (p.nd == 0) {
        p.nd = 1;
        p.shape[0] = 1;
    }
    p.all_direct = true;
    for (int i = 0; i < p.nin; i++) {
        bool dense = in[i]->dtype == cdt;
        int64_t want = 1;
        for (int k = p.nd - 1; dense && k >= 0; k--) {
            dense = p.st[i][k] == want;
            want *= p.shape[k];
        }
        p.direct[i] = dense;
        p.all_direct &= dense;
    }
    p.obase = (char *)gj_rt_data_ptr(out);
    p.odirect = out->dtype == cdt;
    p.all_direct &= p.odirect;
    /* An input laid out along the second-to-last dim: blocked schedule. */
    bool blocked = false;
    for (int i = 0; p.nd >= 2 && i < p.nin; i++) {
        int64_t sr = p.st[i][p.nd - 2], sc = p.st[i][p.nd - 1];
        blocked |= sr != 0 && sr < sc && p.shape[p.nd - 1] > 4 && p.shape[p.nd - 2] > 4;
    }
    if (blocked) {
        int64_t R = p.shape[p.nd - 2], C = p.shape[p.nd - 1];
        int64_t items = (out->numel / (R * C)) * ((R + GJ_K_BLK - 1) / GJ_K_BLK) *
                        ((C + GJ_K_BLK - 1) / GJ_K_BLK);
        gj_rt_parallel_for(items, GJ_K_GRAIN / (GJ_K_BLK * GJ_K_BLK), gj_k_ew_range_blocked, &p);
        return 0;
    }
    gj_rt_parallel_for(out->numel, GJ_K_GRAIN, gj_k_ew_range, &p);
    return 0;
}

/* ------------------------------------------------------ fill, dropout */

typedef struct gj_k_fill_ctx {
    void *o;
    gj_dtype dt;
    double v;
    int64_t iv;
    uint64_t seed, off;
} gj_k_fill_ctx;

static void gj_k_fill_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_fill_ctx *c = ctx;
    switch (c->dt) {
    case GJ_F32: {
        float *o = c->o, v = (float)c->v;
        for (int64_t i = b; i < e; i++)
            o[i] = v;
        break;
    }
    case GJ_F64: {
        double *o = c->o, v = c->v;
        for (int64_t i = b; i < e; i++)
            o[i] = v;
        break;
    }
    case GJ_BF16: {
        uint16_t *o = c->o, v = gj_m_f32_to_bf16((float)c->v);
        for (int64_t i = b; i < e; i++)
            o[i] = v;
        break;
    }
    case GJ_I64: {
        int64_t *o = c->o, v = c->iv;
        for (int64_t i = b; i < e; i++)
            o[i] = v;
        break;
    }
    }
}

int gj_rt_k_fill(const gj_rt_inst *inst, gj_tensor *out) {
    gj_k_fill_ctx c = {.o = gj_rt_data_ptr(out), .dt = out->dtype, .v = inst->scalar};
    int64_t iv = 0;
    gj_rt_k_store(&iv, GJ_I64, 0, inst->scalar); /* saturating conversion */
    c.iv = iv;
    gj_rt_parallel_for(out->numel, GJ_K_GRAIN * 4, gj_k_fill_range, &c);
    return 0;
}

GJ_K_CLONES static void gj_k_dropout_f32(float *restrict o, uint64_t seed, uint64_t off, float pr,
                                         int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i++)
        o[i] = gj_m_dropout_scale_f(seed, off + (uint64_t)i, pr);
}
GJ_K_CLONES static void gj_k_dropout_f64(double *restrict o, uint64_t seed, uint64_t off,
                                         double pr, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i++)
        o[i] = gj_m_dropout_scale_d(seed, off + (uint64_t)i, pr);
}
GJ_K_CLONES static void gj_k_dropout_bf16(uint16_t *restrict o, uint64_t seed, uint64_t off,
                                          float pr, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i++)
        o[i] = gj_m_f32_to_bf16(gj_m_dropout_scale_f(seed, off + (uint64_t)i, pr));
}

static void gj_k_dropout_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_fill_ctx *c = ctx;
    switch (c->dt) {
    case GJ_F32: gj_k_dropout_f32(c->o, c->seed, c->off, (float)c->v, b, e); break;
    case GJ_F64: gj_k_dropout_f64(c->o, c->seed, c->off, c->v, b, e); break;
    case GJ_BF16: gj_k_dropout_bf16(c->o, c->seed, c->off, (float)c->v, b, e); break;
    case GJ_I64: break; /* rejected by gj_rt_infer */
    }
}

int gj_rt_k_dropout_mask(const gj_rt_inst *inst, gj_tensor *out) {
    gj_k_fill_ctx c = {.o = gj_rt_data_ptr(out), .dt = out->dtype, .v = inst->scalar,
                       .seed = inst->seed, .off = inst->rng_offset};
    gj_rt_parallel_for(out->numel, GJ_K_GRAIN, gj_k_dropout_range, &c);
    return 0;
}

/* ---------------------------------------------------------------- iota */

typedef struct gj_k_iota_ctx {
    void *o;
    gj_dtype dt;
    int64_t size, inner; /* axis length, product of the dims after it */
} gj_k_iota_ctx;

static void gj_k_iota_range(void *ctx, int64_t b, int64_t e) {
    const gj_k_iota_ctx *c = ctx;
    for (int64_t i = b; i < e; i++) {
        int64_t v = (i / c->inner) % c->size;
        if (c->dt == GJ_I64)
            ((int64_t *)c->o)[i] = v;
        else
            gj_rt_k_store(c->o, c->dt, i, (double)v);
    }
}

int gj_rt_k_iota(const gj_rt_inst *inst, gj_tensor *out) {
    if (out->numel == 0)
        return 0;
    int ax = inst->axis < 0 ? inst->axis + out->ndim : inst->axis;
    gj_k_iota_ctx c = {.o = gj_rt_data_ptr(out), .dt = out->dtype, .size = out->shape[ax],
                       .inner = gj_rt_numel(out->ndim - ax - 1, out->shape + ax + 1)};
    gj_rt_parallel_for(out->numel, GJ_K_GRAIN, gj_k_iota_range, &c);
    return 0;
}
