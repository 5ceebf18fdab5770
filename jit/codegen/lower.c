/* SPDX-License-Identifier: MIT */
/*
 * lower.c - LLVM IR for the kernels of a plan.
 *
 * Each kernel k becomes two functions:
 *   void <prefix>_<name>(ptr bufs, i64 begin, i64 end)
 *       loads the buffer pointers bufs[0..n_params) and calls
 *   internal void <prefix>_<name>.body(ptr noalias p0, ..., i64 begin, i64 end)
 *       which runs rows [begin, end) of the kernel's schedule (plan.h).
 * The body is always inlined into the entry, turning noalias into scoped
 * alias metadata, so the contiguous inner loops vectorize.
 *
 * Row r of a kernel (dims D[0..nd), L = nd-1, reduced set R):
 *   outer mode (L kept): r = (o, blk); o indexes the kept dims before L;
 *     for each reduced multi-index (row-major) and j in block blk of L:
 *     evaluate the expressions, store full values, and for each SUM add the
 *     value (in double) to acc[j]; after the loops store acc converted.
 *   inner mode (L reduced): r indexes all kept dims; for each reduced
 *     multi-index over R \ {L} (row-major) the run over L is summed into 8
 *     lane accumulators (lane = position mod 8, the tail continuing from
 *     lane 0), combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) and added to
 *     the output's accumulator: the eager SUM kernel's order. A kernel
 *     with run_dims > 1 (plan.h) has its run span its last run_dims dims:
 *     the lanes go on from row to row of the run (position mod 8; blocks
 *     of 8 when L's size is a multiple of 8, else one element at a time)
 *     and are combined once at its end. A MAX store
 *     does the same with max(a, b) = (b > a || b != b) ? b : a in double
 *     from -inf, its lanes folded into the accumulator l0 first, then l1..l7
 *     (the eager MAX kernel).
 * Values are computed in f32 (f32, bf16), f64 or i64; a bf16 result is
 * rounded to bf16 where eager would store it. Scalar math calls the gj_bc_*
 * bitcode functions (gj_math.h), so results match eager bit for bit.
 * Loop counters and accumulators are allocas; O3's SROA makes them SSA.
 * Kernels of at most GJ_JIT_SMALL_KERNEL elements mark their loops "do not
 * vectorize or unroll" (compile time; the arithmetic is the same).
 *
 * A generic plan's kernels (plan/symbolic.c) take one more pointer after the
 * buffers, bufs[n_params]: the kernel's integer table (plan.h). Every
 * size, offset, stride other than 0 and 1, block and block count is
 * loaded from it at the top of the body instead of being a constant; the
 * loops and the order of every sum are the same as with constants (the
 * column-block path and both the 8-wide and the tail loop of a run are
 * always emitted, with their bounds computed at run time), so a generic
 * kernel computes the same bits as the specialised one.
 */
#include "jit/codegen/codegen_int.h"

#include "runtime/attention_table.h"
#include "runtime/gj_math.h"

#include <llvm-c/DebugInfo.h>

/* Kernels of at most this many elements keep their loops scalar. */
#define GJ_JIT_SMALL_KERNEL 2048

#include <stdlib.h>
#include <string.h>

typedef struct kg {
    LLVMContextRef C;
    LLVMModuleRef M;
    LLVMBuilderRef B;
    LLVMTypeRef i1, i16, i64, f32, f64, ptr, vd;
    LLVMValueRef fn;
    LLVMBasicBlockRef entry;
    const gj_jit_plan *p;
    const gj_jit_kernel *k;
    LLVMValueRef *param;  /* per kernel param */
    int *acc_param;       /* per access: param index, -1 for virtual buffers */
    LLVMValueRef *ev;     /* per expression: current value */
    LLVMValueRef idx[GJ_MAX_DIMS]; /* current index per dim (NULL: none) */
    LLVMValueRef *racc;   /* per store: accumulator storage (reduce stores) */
    LLVMValueRef *lanes;  /* per store: <8 x double> lanes (inner mode) */
    LLVMValueRef lane;    /* current lane (inner mode, scalar tail) */
    LLVMValueRef *coll;   /* per store: the value of the current lane (collect mode) */
    bool collect;         /* reduce stores hand their value to coll[] */
    bool inner_mode;
    bool plain_loops; /* small kernel: loops marked "do not vectorize or unroll" */
    int vec_width;    /* > 0: the contiguous loop of an f32 reduction kernel asks for this width */
    bool generic;     /* integers come from the kernel's ints (plan.h), loaded in ints_v */
    LLVMValueRef *ints_v;
    char *why;
    size_t why_cap;
    bool failed;
} kg;

static void kg_fail(kg *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void kg_fail(kg *g, const char *fmt, ...) {
    if (g->failed) return;
    g->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->why, g->why_cap, fmt, ap);
    va_end(ap);
}

static LLVMValueRef c64(kg *g, int64_t v) { return LLVMConstInt(g->i64, (unsigned long long)v, 1); }

/* Integer #i of the kernel's table, whose value in this plan is v: the
 * constant v, or in a generic kernel the table's entry (loaded once at the
 * top of the body). */
static LLVMValueRef kint(kg *g, int i, int64_t v) { return g->generic ? g->ints_v[i] : c64(g, v); }
static LLVMValueRef kdim(kg *g, int d) { return kint(g, d, g->k->dims[d]); }

static LLVMTypeRef ctype(kg *g, gj_dtype dt) {
    return dt == GJ_F64 ? g->f64 : dt == GJ_I64 ? g->i64 : g->f32;
}

static LLVMTypeRef storage_type(kg *g, gj_dtype dt) {
    switch (dt) {
    case GJ_F32: return g->f32;
    case GJ_F64: return g->f64;
    case GJ_BF16: return g->i16;
    default: return g->i64;
    }
}

/* An alloca at the top of the entry block (so mem2reg/SROA handle it). */
static LLVMValueRef entry_alloca(kg *g, LLVMTypeRef t, const char *name) {
    LLVMBuilderRef b = LLVMCreateBuilderInContext(g->C);
    LLVMValueRef first = LLVMGetFirstInstruction(g->entry);
    if (first) LLVMPositionBuilderBefore(b, first);
    else LLVMPositionBuilderAtEnd(b, g->entry);
    LLVMValueRef a = LLVMBuildAlloca(b, t, name);
    LLVMDisposeBuilder(b);
    return a;
}

static LLVMValueRef call_bc(kg *g, const char *name, LLVMValueRef *args, unsigned n) {
    LLVMValueRef f = LLVMGetNamedFunction(g->M, name);
    if (!f) {
        kg_fail(g, "LLVM: bitcode math function %s missing", name);
        return LLVMGetUndef(g->f32);
    }
    return LLVMBuildCall2(g->B, LLVMGlobalGetValueType(f), f, args, n, "");
}

/* --------------------------------------------------------------- loops */

typedef struct loop {
    LLVMValueRef var, iv;
    LLVMBasicBlockRef hdr, body, exit;
    int64_t step;
} loop;

static void loop_open(kg *g, loop *l, LLVMValueRef lo, LLVMValueRef hi, int64_t step,
                      const char *name) {
    l->step = step;
    l->var = entry_alloca(g, g->i64, name);
    LLVMBuildStore(g->B, lo, l->var);
    l->hdr = LLVMAppendBasicBlockInContext(g->C, g->fn, name);
    l->body = LLVMAppendBasicBlockInContext(g->C, g->fn, "body");
    l->exit = LLVMAppendBasicBlockInContext(g->C, g->fn, "exit");
    LLVMBuildBr(g->B, l->hdr);
    LLVMPositionBuilderAtEnd(g->B, l->hdr);
    l->iv = LLVMBuildLoad2(g->B, g->i64, l->var, name);
    LLVMValueRef cond = LLVMBuildICmp(g->B, LLVMIntSLT, l->iv, hi, "");
    LLVMBuildCondBr(g->B, cond, l->body, l->exit);
    LLVMPositionBuilderAtEnd(g->B, l->body);
}

/* A fresh loop ID !{self, vectorize.enable = false, unroll.disable} for
 * the latch of a loop of a small kernel: vectorised and unrolled copies of
 * a loop of a few iterations only cost compile time. */
static LLVMValueRef plain_loop_id(kg *g) {
    LLVMMetadataRef self = LLVMTemporaryMDNode(g->C, NULL, 0);
    LLVMMetadataRef vec[2] = {LLVMMDStringInContext2(g->C, "llvm.loop.vectorize.enable", 26),
                              LLVMValueAsMetadata(LLVMConstInt(g->i1, 0, 0))};
    LLVMMetadataRef unr = LLVMMDStringInContext2(g->C, "llvm.loop.unroll.disable", 24);
    LLVMMetadataRef ops[3] = {self, LLVMMDNodeInContext2(g->C, vec, 2),
                              LLVMMDNodeInContext2(g->C, &unr, 1)};
    LLVMMetadataRef id = LLVMMDNodeInContext2(g->C, ops, 3);
    LLVMMetadataReplaceAllUsesWith(self, id);
    return LLVMMetadataAsValue(g->C, id);
}

/* A fresh loop ID !{self, vectorize.width = w, vectorize.enable = true}. */
static LLVMValueRef width_loop_id(kg *g, int w) {
    LLVMMetadataRef self = LLVMTemporaryMDNode(g->C, NULL, 0);
    LLVMMetadataRef wv[2] = {LLVMMDStringInContext2(g->C, "llvm.loop.vectorize.width", 25),
                             LLVMValueAsMetadata(LLVMConstInt(LLVMInt32TypeInContext(g->C),
                                                              (unsigned long long)w, 0))};
    LLVMMetadataRef en[2] = {LLVMMDStringInContext2(g->C, "llvm.loop.vectorize.enable", 26),
                             LLVMValueAsMetadata(LLVMConstInt(g->i1, 1, 0))};
    LLVMMetadataRef ops[3] = {self, LLVMMDNodeInContext2(g->C, wv, 2),
                              LLVMMDNodeInContext2(g->C, en, 2)};
    LLVMMetadataRef id = LLVMMDNodeInContext2(g->C, ops, 3);
    LLVMMetadataReplaceAllUsesWith(self, id);
    return LLVMMetadataAsValue(g->C, id);
}

static void loop_close(kg *g, loop *l) {
    LLVMValueRef next = LLVMBuildNSWAdd(g->B, l->iv, c64(g, l->step), "");
    LLVMBuildStore(g->B, next, l->var);
    LLVMValueRef br = LLVMBuildBr(g->B, l->hdr);
    if (g->plain_loops)
        LLVMSetMetadata(br, LLVMGetMDKindIDInContext(g->C, "llvm.loop", 9), plain_loop_id(g));
    LLVMPositionBuilderAtEnd(g->B, l->exit);
}

/* ------------------------------------------------------------ accesses */

/* Element offset of access a at the current indices. */
static LLVMValueRef acc_offset(kg *g, int a) {
    const gj_jit_access *x = &g->k->acc[a];
    int ia = gj_jit_kint_acc(g->k, a);
    LLVMValueRef off = kint(g, ia, x->offset);
    for (int d = 0; d < g->k->nd; d++) {
        if (!g->idx[d] || x->strides[d] == 0) continue;
        LLVMValueRef t = x->strides[d] == 1
                             ? g->idx[d]
                             : LLVMBuildNSWMul(g->B, g->idx[d], kint(g, ia + 1 + d, x->strides[d]), "");
        off = LLVMBuildNSWAdd(g->B, off, t, "");
    }
    return off;
}

static LLVMValueRef acc_ptr(kg *g, int a, LLVMValueRef off) {
    const gj_jit_access *x = &g->k->acc[a];
    LLVMValueRef base = g->param[g->acc_param[a]];
    return LLVMBuildInBoundsGEP2(g->B, storage_type(g, x->dtype), base, &off, 1, "");
}

/* f32 value rounded to bf16 and widened back (exactly what a bf16 store and
 * a later load do). */
static LLVMValueRef round_bf16(kg *g, LLVMValueRef v) {
    LLVMValueRef h = call_bc(g, "gj_bc_f32_to_bf16", &v, 1);
    return call_bc(g, "gj_bc_bf16_to_f32", &h, 1);
}

static LLVMValueRef gen_load(kg *g, int a) {
    const gj_jit_access *x = &g->k->acc[a];
    const gj_jit_buffer *b = &g->p->bufs[x->buf];
    LLVMValueRef off = acc_offset(g, a);
    if (b->kind == GJ_JIT_BUF_IOTA) {
        LLVMValueRef q = LLVMBuildUDiv(g->B, off, c64(g, b->gen_inner), "");
        LLVMValueRef i = LLVMBuildURem(g->B, q, c64(g, b->gen_len), "");
        if (x->dtype == GJ_I64) return i;
        LLVMValueRef v = LLVMBuildSIToFP(g->B, i, ctype(g, x->dtype), "");
        return x->dtype == GJ_BF16 ? round_bf16(g, v) : v;
    }
    if (b->kind == GJ_JIT_BUF_DROPOUT) {
        LLVMValueRef args[3], seed, base;
        if (b->gen_param >= 0) { /* run-time seed and offset: params[2k], params[2k+1] */
            LLVMValueRef pp = NULL;
            for (int q = 0; q < g->k->n_params; q++)
                if (g->k->param_buf[q] == g->p->params_buf) pp = g->param[q];
            if (!pp) {
                kg_fail(g, "internal: dropout parameters are not a kernel parameter");
                return LLVMGetUndef(ctype(g, x->dtype));
            }
            LLVMValueRef i0 = c64(g, 2 * (int64_t)b->gen_param), i1 = c64(g, 2 * (int64_t)b->gen_param + 1);
            seed = LLVMBuildLoad2(g->B, g->i64, LLVMBuildInBoundsGEP2(g->B, g->i64, pp, &i0, 1, ""), "");
            base = LLVMBuildLoad2(g->B, g->i64, LLVMBuildInBoundsGEP2(g->B, g->i64, pp, &i1, 1, ""), "");
        } else {
            seed = LLVMConstInt(g->i64, b->gen_seed, 0);
            base = LLVMConstInt(g->i64, b->gen_offset, 0);
        }
        args[0] = seed;
        args[1] = LLVMBuildAdd(g->B, base, off, "");
        if (x->dtype == GJ_F64) {
            args[2] = LLVMConstReal(g->f64, b->gen_p);
            return call_bc(g, "gj_bc_dropout_scale_d", args, 3);
        }
        args[2] = LLVMConstReal(g->f32, (double)(float)b->gen_p);
        LLVMValueRef v = call_bc(g, "gj_bc_dropout_scale_f", args, 3);
        return x->dtype == GJ_BF16 ? round_bf16(g, v) : v;
    }
    LLVMValueRef ld = LLVMBuildLoad2(g->B, storage_type(g, x->dtype), acc_ptr(g, a, off), "");
    if (x->dtype == GJ_BF16) return call_bc(g, "gj_bc_bf16_to_f32", &ld, 1);
    return ld;
}

/* Stores value v (compute type of dt) into access a at offset off. */
static void gen_store_at(kg *g, int a, LLVMValueRef off, LLVMValueRef v) {
    const gj_jit_access *x = &g->k->acc[a];
    if (x->dtype == GJ_BF16) v = call_bc(g, "gj_bc_f32_to_bf16", &v, 1);
    LLVMBuildStore(g->B, v, acc_ptr(g, a, off));
}

/* ---------------------------------------------------------- constants */

static LLVMValueRef const_of(kg *g, gj_dtype dt, double v) {
    switch (dt) {
    case GJ_F32: return LLVMConstReal(g->f32, (double)(float)v);
    case GJ_F64: return LLVMConstReal(g->f64, v);
    case GJ_BF16: return LLVMConstReal(g->f32, (double)gj_m_bf16_to_f32(gj_m_f32_to_bf16((float)v)));
    default: return LLVMConstInt(g->i64, (unsigned long long)gj_jit_sat_i64(v), 1);
    }
}

/* The constant of expression e (value v in compute type dt): const_of, or
 * in a generic kernel its bits from the integer table (plan/symbolic.c stores
 * exactly what const_of would make). */
static LLVMValueRef expr_const(kg *g, const gj_jit_expr *e, gj_dtype dt, double v) {
    if (!g->generic) return const_of(g, dt, v);
    LLVMValueRef bits = g->ints_v[gj_jit_kint_const(g->k, (int)(e - g->k->ex))];
    switch (dt) {
    case GJ_F64: return LLVMBuildBitCast(g->B, bits, g->f64, "");
    case GJ_F32:
    case GJ_BF16:
        return LLVMBuildBitCast(g->B, LLVMBuildTrunc(g->B, bits, LLVMInt32TypeInContext(g->C), ""),
                                g->f32, "");
    default: return bits;
    }
}

/* ---------------------------------------------------------- operations */

/* float -> i64 as the eager conversion: NaN -> 0, saturating, truncating. */
static LLVMValueRef f_to_i64(kg *g, LLVMValueRef v) {
    LLVMTypeRef t = LLVMTypeOf(v);
    LLVMValueRef d = t == g->f64 ? v : LLVMBuildFPExt(g->B, v, g->f64, "");
    LLVMValueRef hi = LLVMBuildFCmp(g->B, LLVMRealOGE, d, LLVMConstReal(g->f64, 9223372036854775808.0), "");
    LLVMValueRef lo = LLVMBuildFCmp(g->B, LLVMRealOLT, d, LLVMConstReal(g->f64, -9223372036854775808.0), "");
    LLVMValueRef nan = LLVMBuildFCmp(g->B, LLVMRealUNO, d, d, "");
    LLVMValueRef safe = LLVMBuildSelect(g->B, LLVMBuildOr(g->B, LLVMBuildOr(g->B, hi, lo, ""), nan, ""),
                                        LLVMConstReal(g->f64, 0.0), d, "");
    LLVMValueRef r = LLVMBuildFPToSI(g->B, safe, g->i64, "");
    r = LLVMBuildSelect(g->B, hi, c64(g, INT64_MAX), r, "");
    r = LLVMBuildSelect(g->B, lo, c64(g, INT64_MIN), r, "");
    return r;
}

static LLVMValueRef gen_cast(kg *g, LLVMValueRef v, gj_dtype from, gj_dtype to) {
    if (from == to) return v;
    if (from == GJ_I64) {
        if (to == GJ_F64) return LLVMBuildSIToFP(g->B, v, g->f64, "");
        LLVMValueRef f = LLVMBuildSIToFP(g->B, v, g->f32, "");
        return to == GJ_BF16 ? round_bf16(g, f) : f;
    }
    if (to == GJ_I64) return f_to_i64(g, v);
    if (to == GJ_F64) return from == GJ_F64 ? v : LLVMBuildFPExt(g->B, v, g->f64, "");
    /* to f32 or bf16 from a float type */
    LLVMValueRef f = from == GJ_F64 ? LLVMBuildFPTrunc(g->B, v, g->f32, "") : v;
    return to == GJ_BF16 ? round_bf16(g, f) : f;
}

/* Truth value of a condition (nonzero, NaN included). */
static LLVMValueRef truth(kg *g, LLVMValueRef v, gj_dtype dt) {
    if (dt == GJ_I64) return LLVMBuildICmp(g->B, LLVMIntNE, v, c64(g, 0), "");
    return LLVMBuildFCmp(g->B, LLVMRealUNE, v, LLVMConstReal(LLVMTypeOf(v), 0.0), "");
}

static LLVMValueRef gen_op(kg *g, const gj_jit_expr *e) {
    const gj_rt_inst *in = &e->inst;
    const gj_jit_expr *ax = &g->k->ex[e->args[0]];
    LLVMValueRef a = g->ev[e->args[0]];
    LLVMValueRef b = in->n_in > 1 ? g->ev[e->args[1]] : NULL;
    gj_dtype dt = e->dtype;
    bool dbl = dt == GJ_F64;
    LLVMTypeRef T = ctype(g, dt);
    const char *sfx = dbl ? "_d" : "_f";
    char fname[64];
    LLVMValueRef r = NULL;
    switch (in->prim) {
    case GJ_P_NEG: r = LLVMBuildFNeg(g->B, a, ""); break;
    case GJ_P_EXP: case GJ_P_LOG: case GJ_P_TANH: case GJ_P_SIGMOID: case GJ_P_RELU:
    case GJ_P_GELU: case GJ_P_SQRT: case GJ_P_RSQRT: case GJ_P_GELU_GRAD: case GJ_P_STEP: {
        const char *nm = in->prim == GJ_P_EXP ? "exp" : in->prim == GJ_P_LOG ? "log"
                         : in->prim == GJ_P_TANH ? "tanh" : in->prim == GJ_P_SIGMOID ? "sigmoid"
                         : in->prim == GJ_P_RELU ? "relu" : in->prim == GJ_P_GELU ? "gelu"
                         : in->prim == GJ_P_SQRT ? "sqrt" : in->prim == GJ_P_RSQRT ? "rsqrt"
                         : in->prim == GJ_P_GELU_GRAD ? "gelu_grad" : "step";
        snprintf(fname, sizeof fname, "gj_bc_%s%s", nm, sfx);
        r = call_bc(g, fname, &a, 1);
        break;
    }
    case GJ_P_RECIP: r = LLVMBuildFDiv(g->B, LLVMConstReal(T, 1.0), a, ""); break;
    case GJ_P_ADD_SCALAR: r = LLVMBuildFAdd(g->B, a, expr_const(g, e, dbl ? GJ_F64 : GJ_F32, in->scalar), ""); break;
    case GJ_P_MUL_SCALAR: r = LLVMBuildFMul(g->B, a, expr_const(g, e, dbl ? GJ_F64 : GJ_F32, in->scalar), ""); break;
    case GJ_P_POW_SCALAR: {
        LLVMValueRef args[2] = {a, expr_const(g, e, dbl ? GJ_F64 : GJ_F32, in->scalar)};
        r = call_bc(g, dbl ? "gj_bc_pow_d" : "gj_bc_pow_f", args, 2);
        break;
    }
    case GJ_P_CAST: return gen_cast(g, a, ax->dtype, dt);
    case GJ_P_COPY: return a;
    case GJ_P_ADD: r = LLVMBuildFAdd(g->B, a, b, ""); break;
    case GJ_P_SUB: r = LLVMBuildFSub(g->B, a, b, ""); break;
    case GJ_P_MUL: r = LLVMBuildFMul(g->B, a, b, ""); break;
    case GJ_P_DIV: r = LLVMBuildFDiv(g->B, a, b, ""); break;
    case GJ_P_EQ: {
        LLVMValueRef c = ax->dtype == GJ_I64 ? LLVMBuildICmp(g->B, LLVMIntEQ, a, b, "")
                                             : LLVMBuildFCmp(g->B, LLVMRealOEQ, a, b, "");
        if (dt == GJ_I64) return LLVMBuildSelect(g->B, c, c64(g, 1), c64(g, 0), "");
        r = LLVMBuildSelect(g->B, c, LLVMConstReal(T, 1.0), LLVMConstReal(T, 0.0), "");
        break;
    }
    case GJ_P_WHERE: {
        LLVMValueRef c = truth(g, a, ax->dtype);
        r = LLVMBuildSelect(g->B, c, b, g->ev[e->args[2]], "");
        break;
    }
    default:
        kg_fail(g, "no lowering for %s", gj_rt_prim_name(in->prim));
        return LLVMGetUndef(T);
    }
    if (dt == GJ_BF16) r = round_bf16(g, r);
    return r;
}

/* The eager MAX kernel's combine in double: b wins if greater or NaN. */
static LLVMValueRef max_combine(kg *g, LLVMValueRef a, LLVMValueRef b) {
    LLVMValueRef gt = LLVMBuildFCmp(g->B, LLVMRealOGT, b, a, "");
    LLVMValueRef nan = LLVMBuildFCmp(g->B, LLVMRealUNO, b, b, "");
    return LLVMBuildSelect(g->B, LLVMBuildOr(g->B, gt, nan, ""), b, a, "");
}

/* The starting value of reduce store s's accumulator. */
static LLVMValueRef red_init(kg *g, const gj_jit_store *st) {
    return LLVMConstReal(g->f64, st->max ? -__builtin_inf() : 0.0);
}

/* Evaluates every expression and does every store at the current indices.
 * Reduce stores add into their accumulator (outer mode: acc[j - j0];
 * inner mode: lane `lane` of lanes[s]), or, in collect mode, leave their
 * value (in double) in coll[s]. */
static void gen_body(kg *g, LLVMValueRef jrel) {
    const gj_jit_kernel *k = g->k;
    for (int e = 0; e < k->n_ex && !g->failed; e++) {
        const gj_jit_expr *x = &k->ex[e];
        if (x->kind == GJ_JIT_E_LOAD) g->ev[e] = gen_load(g, x->access);
        else if (x->kind == GJ_JIT_E_CONST) g->ev[e] = expr_const(g, x, x->dtype, x->cval);
        else g->ev[e] = gen_op(g, x);
    }
    for (int s = 0; s < k->n_st && !g->failed; s++) {
        const gj_jit_store *st = &k->st[s];
        LLVMValueRef v = g->ev[st->expr];
        if (!st->reduce) {
            gen_store_at(g, st->access, acc_offset(g, st->access), v);
            continue;
        }
        gj_dtype vd = k->ex[st->expr].dtype;
        if (vd != GJ_F64) v = LLVMBuildFPExt(g->B, v, g->f64, "");
        if (g->collect) {
            g->coll[s] = v;
            continue;
        }
        if (g->inner_mode) {
            LLVMTypeRef vt = LLVMVectorType(g->f64, 8);
            LLVMValueRef vec = LLVMBuildLoad2(g->B, vt, g->lanes[s], "");
            LLVMValueRef old = LLVMBuildExtractElement(g->B, vec, g->lane, "");
            LLVMValueRef nv = st->max ? max_combine(g, old, v) : LLVMBuildFAdd(g->B, old, v, "");
            LLVMBuildStore(g->B, LLVMBuildInsertElement(g->B, vec, nv, g->lane, ""), g->lanes[s]);
            continue;
        }
        LLVMValueRef slot = LLVMBuildInBoundsGEP2(g->B, g->f64, g->racc[s], &jrel, 1, "");
        LLVMValueRef old = LLVMBuildLoad2(g->B, g->f64, slot, "");
        LLVMBuildStore(g->B, st->max ? max_combine(g, old, v) : LLVMBuildFAdd(g->B, old, v, ""),
                       slot);
    }
}

/* Stores accumulator value v (double) through reduce store s at the
 * current indices. */
static void store_acc(kg *g, int s, LLVMValueRef v) {
    const gj_jit_store *st = &g->k->st[s];
    gj_dtype dt = g->k->acc[st->access].dtype;
    if (dt != GJ_F64) v = LLVMBuildFPTrunc(g->B, v, g->f32, "");
    gen_store_at(g, st->access, acc_offset(g, st->access), v);
}

/* Nested loops over the reduced dims in list[0..n) (row-major); calls
 * inner() inside. */
typedef void (*inner_fn)(kg *g, void *ctx);
static void reduced_loops(kg *g, const int *list, int n, inner_fn inner, void *ctx) {
    if (n == 0) {
        inner(g, ctx);
        return;
    }
    loop l;
    loop_open(g, &l, c64(g, 0), kdim(g, list[0]), 1, "r");
    g->idx[list[0]] = l.iv;
    reduced_loops(g, list + 1, n - 1, inner, ctx);
    loop_close(g, &l);
    g->idx[list[0]] = NULL;
}

typedef struct outer_ctx {
    LLVMValueRef j0, j1;
} outer_ctx;

static void outer_inner(kg *g, void *vctx) {
    outer_ctx *c = vctx;
    int L = g->k->nd - 1;
    loop l;
    loop_open(g, &l, c->j0, c->j1, 1, "j");
    g->idx[L] = l.iv;
    gen_body(g, LLVMBuildNSWSub(g->B, l.iv, c->j0, ""));
    if (g->vec_width > 0 && !g->plain_loops) { /* loop_close with a width hint */
        LLVMValueRef next = LLVMBuildNSWAdd(g->B, l.iv, c64(g, l.step), "");
        LLVMBuildStore(g->B, next, l.var);
        LLVMValueRef br = LLVMBuildBr(g->B, l.hdr);
        LLVMSetMetadata(br, LLVMGetMDKindIDInContext(g->C, "llvm.loop", 9),
                        width_loop_id(g, g->vec_width));
        LLVMPositionBuilderAtEnd(g->B, l.exit);
    } else {
        loop_close(g, &l);
    }
    g->idx[L] = NULL;
}

/* Every reduce store's 8 lanes set to its starting value. */
static void lanes_init(kg *g) {
    const gj_jit_kernel *k = g->k;
    for (int s = 0; s < k->n_st; s++) {
        if (!k->st[s].reduce) continue;
        LLVMValueRef init[8];
        for (int q = 0; q < 8; q++) init[q] = red_init(g, &k->st[s]);
        LLVMBuildStore(g->B, LLVMConstVector(init, 8), g->lanes[s]);
    }
}

/* Elements [0, n8v) of the last dim L (n8v a multiple of 8), lane q taking
 * element i + q of each block of 8: the body is emitted once per lane, the
 * lanes' values are gathered into a vector and added (max-combined) into
 * the <8 x double> accumulator at once, which is what lets LLVM keep the
 * lanes in vector registers (a small kernel loops over q instead: less
 * code). */
static void lanes_blocks(kg *g, LLVMValueRef n8v) {
    const gj_jit_kernel *k = g->k;
    int L = k->nd - 1;
    LLVMTypeRef vt = LLVMVectorType(g->f64, 8);
    if (g->plain_loops) { /* small kernel: lane q in a loop (less code) */
        loop li, lq;
        loop_open(g, &li, c64(g, 0), n8v, 8, "i8");
        loop_open(g, &lq, c64(g, 0), c64(g, 8), 1, "q");
        g->idx[L] = LLVMBuildNSWAdd(g->B, li.iv, lq.iv, "");
        g->lane = lq.iv;
        gen_body(g, NULL);
        loop_close(g, &lq);
        loop_close(g, &li);
    } else { /* blocks of 8: lane q takes element i + q */
        loop li;
        loop_open(g, &li, c64(g, 0), n8v, 8, "i8");
        LLVMValueRef *acc_vec = gj_rt_calloc((size_t)k->n_st + 1, sizeof *acc_vec);
        if (!acc_vec) {
            kg_fail(g, "out of memory while lowering");
            return;
        }
        for (int s = 0; s < k->n_st; s++)
            if (k->st[s].reduce) acc_vec[s] = LLVMGetUndef(vt);
        g->collect = true;
        for (int q = 0; q < 8 && !g->failed; q++) {
            g->idx[L] = q ? LLVMBuildNSWAdd(g->B, li.iv, c64(g, q), "") : li.iv;
            gen_body(g, NULL);
            for (int s = 0; s < k->n_st; s++)
                if (k->st[s].reduce)
                    acc_vec[s] = LLVMBuildInsertElement(g->B, acc_vec[s], g->coll[s], c64(g, q), "");
        }
        g->collect = false;
        for (int s = 0; s < k->n_st && !g->failed; s++) {
            if (!k->st[s].reduce) continue;
            LLVMValueRef old = LLVMBuildLoad2(g->B, vt, g->lanes[s], "");
            LLVMValueRef nv = k->st[s].max ? max_combine(g, old, acc_vec[s])
                                           : LLVMBuildFAdd(g->B, old, acc_vec[s], "");
            LLVMBuildStore(g->B, nv, g->lanes[s]);
        }
        gj_rt_free(acc_vec);
        loop_close(g, &li);
    }
    g->idx[L] = NULL;
}

/* Elements [from, to) of the last dim L one by one, element i into lane
 * (base + i) mod 8 (base NULL: lane i - from, from a multiple of 8). */
static void lanes_scalar(kg *g, LLVMValueRef from, LLVMValueRef to, LLVMValueRef base) {
    int L = g->k->nd - 1;
    loop lt;
    loop_open(g, &lt, from, to, 1, "tail");
    g->idx[L] = lt.iv;
    g->lane = base ? LLVMBuildAnd(g->B, LLVMBuildNSWAdd(g->B, base, lt.iv, ""), c64(g, 7), "")
                   : LLVMBuildNSWSub(g->B, lt.iv, from, "");
    gen_body(g, NULL);
    loop_close(g, &lt);
    g->idx[L] = NULL;
}

/* Every reduce store's lanes folded into its accumulator: a SUM adds the
 * fixed tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) to it, a MAX folds l0
 * first, then l1..l7 (the eager kernels). */
static void lanes_finish(kg *g) {
    const gj_jit_kernel *k = g->k;
    LLVMTypeRef vt = LLVMVectorType(g->f64, 8);
    for (int s = 0; s < k->n_st; s++) {
        if (!k->st[s].reduce) continue;
        LLVMValueRef l[8];
        LLVMValueRef vec = LLVMBuildLoad2(g->B, vt, g->lanes[s], "");
        for (int q = 0; q < 8; q++) l[q] = LLVMBuildExtractElement(g->B, vec, c64(g, q), "");
        if (k->st[s].max) {
            LLVMValueRef m = LLVMBuildLoad2(g->B, g->f64, g->racc[s], "");
            for (int q = 0; q < 8; q++) m = max_combine(g, m, l[q]);
            LLVMBuildStore(g->B, m, g->racc[s]);
            continue;
        }
        LLVMValueRef t = LLVMBuildFAdd(
            g->B,
            LLVMBuildFAdd(g->B, LLVMBuildFAdd(g->B, l[0], l[1], ""), LLVMBuildFAdd(g->B, l[2], l[3], ""), ""),
            LLVMBuildFAdd(g->B, LLVMBuildFAdd(g->B, l[4], l[5], ""), LLVMBuildFAdd(g->B, l[6], l[7], ""), ""), "");
        LLVMValueRef old = LLVMBuildLoad2(g->B, g->f64, g->racc[s], "");
        LLVMBuildStore(g->B, LLVMBuildFAdd(g->B, old, t, ""), g->racc[s]);
    }
}

/* The run over the last (reduced) dim L: blocks of 8, then the scalar
 * tail, lanes 0.. (the eager order); a generic kernel emits both loops,
 * with bounds read at run time. */
static void inner_run(kg *g, void *vctx) {
    (void)vctx;
    const gj_jit_kernel *k = g->k;
    int L = k->nd - 1;
    int64_t n = k->dims[L], n8 = n - n % 8;
    LLVMValueRef nrun = kdim(g, L);
    LLVMValueRef n8v = g->generic ? LLVMBuildAnd(g->B, nrun, c64(g, ~(int64_t)7), "") : c64(g, n8);
    lanes_init(g);
    if (g->generic || n8 > 0) lanes_blocks(g, n8v);
    if (g->generic || n8 < n) lanes_scalar(g, n8v, nrun, NULL);
    lanes_finish(g);
}

/* One row of a run over several dims (multi_run): the elements of the
 * last dim L at run position pos + i, i.e. lane (pos + i) mod 8. When
 * L's size is a multiple of 8, pos is too and the blocks of 8 keep
 * their lanes; otherwise the elements go one by one (a generic kernel
 * picks at run time). Then pos += L's size. */
static void run_row(kg *g, void *vctx) {
    LLVMValueRef pos_var = vctx;
    const gj_jit_kernel *k = g->k;
    int L = k->nd - 1;
    LLVMValueRef n = kdim(g, L);
    LLVMValueRef pos = LLVMBuildLoad2(g->B, g->i64, pos_var, "pos");
    if (!g->generic) {
        if (k->dims[L] % 8 == 0) lanes_blocks(g, n);
        else lanes_scalar(g, c64(g, 0), n, pos);
    } else {
        LLVMValueRef aligned = LLVMBuildICmp(g->B, LLVMIntEQ, LLVMBuildAnd(g->B, n, c64(g, 7), ""),
                                             c64(g, 0), "");
        LLVMBasicBlockRef bb_blk = LLVMAppendBasicBlockInContext(g->C, g->fn, "aligned");
        LLVMBasicBlockRef bb_one = LLVMAppendBasicBlockInContext(g->C, g->fn, "unaligned");
        LLVMBasicBlockRef bb_end = LLVMAppendBasicBlockInContext(g->C, g->fn, "row_done");
        LLVMBuildCondBr(g->B, aligned, bb_blk, bb_one);
        LLVMPositionBuilderAtEnd(g->B, bb_blk);
        lanes_blocks(g, n);
        LLVMBuildBr(g->B, bb_end);
        LLVMPositionBuilderAtEnd(g->B, bb_one);
        lanes_scalar(g, c64(g, 0), n, pos);
        LLVMBuildBr(g->B, bb_end);
        LLVMPositionBuilderAtEnd(g->B, bb_end);
    }
    LLVMBuildStore(g->B, LLVMBuildNSWAdd(g->B, pos, n, ""), pos_var);
}

typedef struct multi_ctx {
    const int *list; /* the run's dims before L */
    int n;
} multi_ctx;

/* A run over the last k->run_dims dims (eager's coalesced innermost run,
 * which an access keeps the kernel from merging into one dim): the lanes
 * start once, the rows of the run's outer dims (row-major) continue them
 * at the run position, and the lanes are folded once at the end. */
static void multi_run(kg *g, void *vctx) {
    const multi_ctx *c = vctx;
    LLVMValueRef pos = entry_alloca(g, g->i64, "pos");
    LLVMBuildStore(g->B, c64(g, 0), pos);
    lanes_init(g);
    reduced_loops(g, c->list, c->n, run_row, pos);
    lanes_finish(g);
}

/* The body function of kernel k. */
static void gen_kernel_body(kg *g) {
    const gj_jit_kernel *k = g->k;
    int nd = k->nd, L = nd - 1;
    unsigned pb = (unsigned)k->n_params + (g->generic ? 1u : 0u); /* after the ints */
    LLVMValueRef begin = LLVMGetParam(g->fn, pb);
    LLVMValueRef end = LLVMGetParam(g->fn, pb + 1);
    if (g->generic) { /* the integer table, loaded once */
        LLVMValueRef tab = LLVMGetParam(g->fn, (unsigned)k->n_params);
        for (int i = 0; i < k->n_ints; i++) {
            LLVMValueRef ix = c64(g, i);
            g->ints_v[i] = LLVMBuildLoad2(g->B, g->i64, LLVMBuildInBoundsGEP2(g->B, g->i64, tab, &ix, 1, ""), "");
        }
    }
    g->inner_mode = (k->red >> L) & 1u;
    int kept[GJ_MAX_DIMS], nk = 0, red[GJ_MAX_DIMS], nr = 0;
    for (int d = 0; d < nd; d++) {
        if ((k->red >> d) & 1u) {
            if (!(g->inner_mode && d == L)) red[nr++] = d;
        } else if (g->inner_mode || d < L) {
            kept[nk++] = d;
        }
    }
    for (int s = 0; s < k->n_st; s++) {
        if (!k->st[s].reduce) continue;
        if (g->inner_mode) {
            g->racc[s] = entry_alloca(g, g->f64, "acc");
            g->lanes[s] = entry_alloca(g, LLVMVectorType(g->f64, 8), "lanes");
        } else {
            int64_t nacc = g->generic ? GJ_JIT_MAX_RED_BLOCK : k->block > 0 ? k->block : 1;
            g->racc[s] = entry_alloca(g, LLVMArrayType2(g->f64, (uint64_t)nacc), "acc");
        }
    }
    loop rl;
    loop_open(g, &rl, begin, end, 1, "row");
    LLVMValueRef o = rl.iv, blk = NULL;
    int isch = gj_jit_kint_sched(k);
    if (!g->inner_mode && (k->nblk > 1 || g->generic)) {
        blk = LLVMBuildURem(g->B, rl.iv, kint(g, isch + 1, k->nblk), "");
        o = LLVMBuildUDiv(g->B, rl.iv, kint(g, isch + 1, k->nblk), "");
    }
    for (int t = nk - 1; t >= 0; t--) {
        int d = kept[t];
        if (t == 0) {
            g->idx[d] = o;
        } else {
            g->idx[d] = LLVMBuildURem(g->B, o, kdim(g, d), "");
            o = LLVMBuildUDiv(g->B, o, kdim(g, d), "");
        }
    }
    bool has_red = false;
    for (int s = 0; s < k->n_st; s++) has_red |= k->st[s].reduce;
    if (g->inner_mode) {
        for (int s = 0; s < k->n_st; s++)
            if (k->st[s].reduce) LLVMBuildStore(g->B, red_init(g, &k->st[s]), g->racc[s]);
        /* the run's dims before L are the last of red[] (plan_kernel.c) */
        int nrun = k->run_dims > 1 ? k->run_dims - 1 : 0;
        multi_ctx mc = {red + nr - nrun, nrun};
        if (nrun > nr)
            kg_fail(g, "internal: kernel %s: a run over %d dims of %d reduced", k->name,
                    k->run_dims, nr + 1);
        else if (nrun > 0) reduced_loops(g, red, nr - nrun, multi_run, &mc);
        else reduced_loops(g, red, nr, inner_run, NULL);
        for (int s = 0; s < k->n_st && !g->failed; s++)
            if (k->st[s].reduce) store_acc(g, s, LLVMBuildLoad2(g->B, g->f64, g->racc[s], ""));
    } else {
        outer_ctx c;
        LLVMValueRef block = kint(g, isch, k->block);
        c.j0 = blk ? LLVMBuildNSWMul(g->B, blk, block, "") : c64(g, 0);
        if (blk) {
            LLVMValueRef e = LLVMBuildNSWAdd(g->B, c.j0, block, "");
            LLVMValueRef lim = kdim(g, L);
            c.j1 = LLVMBuildSelect(g->B, LLVMBuildICmp(g->B, LLVMIntSLT, e, lim, ""), e, lim, "");
        } else {
            c.j1 = kdim(g, L);
        }
        if (has_red) {
            loop li;
            loop_open(g, &li, c64(g, 0), LLVMBuildNSWSub(g->B, c.j1, c.j0, ""), 1, "z");
            for (int s = 0; s < k->n_st; s++)
                if (k->st[s].reduce)
                    LLVMBuildStore(g->B, red_init(g, &k->st[s]),
                                   LLVMBuildInBoundsGEP2(g->B, g->f64, g->racc[s], &li.iv, 1, ""));
            loop_close(g, &li);
        }
        reduced_loops(g, red, nr, outer_inner, &c);
        if (has_red) {
            loop ls;
            loop_open(g, &ls, c.j0, c.j1, 1, "st");
            g->idx[L] = ls.iv;
            LLVMValueRef jr = LLVMBuildNSWSub(g->B, ls.iv, c.j0, "");
            for (int s = 0; s < k->n_st && !g->failed; s++)
                if (k->st[s].reduce)
                    store_acc(g, s, LLVMBuildLoad2(g->B, g->f64,
                                                   LLVMBuildInBoundsGEP2(g->B, g->f64, g->racc[s], &jr, 1, ""), ""));
            loop_close(g, &ls);
            g->idx[L] = NULL;
        }
    }
    for (int d = 0; d < nd; d++) g->idx[d] = NULL;
    loop_close(g, &rl);
    LLVMBuildRetVoid(g->B);
}

static void add_fn_attr(kg *g, LLVMValueRef fn, const char *kind) {
    unsigned id = LLVMGetEnumAttributeKindForName(kind, strlen(kind));
    LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(g->C, id, 0));
}

static void add_target_attrs(kg *g, LLVMValueRef fn, const char *cpu, const char *features) {
    LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                            LLVMCreateStringAttribute(g->C, "target-cpu", 10, cpu, (unsigned)strlen(cpu)));
    LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                            LLVMCreateStringAttribute(g->C, "target-features", 15, features,
                                                      (unsigned)strlen(features)));
    /* LLVM prefers 256-bit vectors on AVX-512 CPUs (frequency licences of
     * old Xeons); the eager kernels are compiled for 512 bits, and fused
     * kernels are long arithmetic loops that gain from the full width. */
    if (strstr(features, "+avx512f"))
        LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                                LLVMCreateStringAttribute(g->C, "prefer-vector-width", 19, "512", 3));
}

/* One lower_kernel, carried from part to part: the kernel, the target, the
 * two functions' names (the body `<prefix>_<name>.body`, internal and
 * always inlined, and the entry `<prefix>_<name>` the plan calls), the
 * body's parameter types (pt, owned, freed by lower_kernel) and type. The
 * kernel's tables in g are allocated by lk_tables and freed by lk_free. */
typedef struct lowering {
    const gj_jit_kernel *k;
    const char *cpu, *features;
    char name[128], bname[140];
    int np, nx; /* buffers; 1 for the ints table of a generic kernel */
    LLVMTypeRef *pt, bty;
} lowering;

/* A generic kernel has its integer table and a column block lowering can
 * take. 0, or -1 with g failed. */
static int lk_check(kg *g, const gj_jit_kernel *k) {
    if (g->generic && (!k->ints || k->n_ints != gj_jit_kint_count(k))) {
        kg_fail(g, "internal: generic kernel %s without its integer table", k->name);
        return -1;
    }
    if (g->generic && !gj_jit_generic_block_ok(k)) {
        kg_fail(g, "internal: generic kernel %s has a column block of %lld (more than %d)",
                k->name, (long long)k->block, GJ_JIT_MAX_RED_BLOCK);
        return -1;
    }
    return 0;
}

/* The kernel's tables in g, and what the body's loops decide from the
 * kernel alone: plain loops for small kernels, the vector width of an f32
 * reduction over outer dims, the parameter of each access. 0 or -1. */
static int lk_tables(kg *g, lowering *l) {
    const gj_jit_kernel *k = l->k;
    int np = l->np;
    l->pt = gj_rt_calloc((size_t)np + 3, sizeof *l->pt);
    g->ints_v = gj_rt_calloc((size_t)k->n_ints + 1, sizeof *g->ints_v);
    g->param = gj_rt_calloc((size_t)np + 1, sizeof *g->param);
    g->acc_param = gj_rt_calloc((size_t)k->n_acc + 1, sizeof *g->acc_param);
    g->ev = gj_rt_calloc((size_t)k->n_ex + 1, sizeof *g->ev);
    g->racc = gj_rt_calloc((size_t)k->n_st + 1, sizeof *g->racc);
    g->lanes = gj_rt_calloc((size_t)k->n_st + 1, sizeof *g->lanes);
    g->coll = gj_rt_calloc((size_t)k->n_st + 1, sizeof *g->coll);
    if (!l->pt || !g->param || !g->acc_param || !g->ev || !g->racc || !g->lanes || !g->coll ||
        !g->ints_v) {
        kg_fail(g, "out of memory while lowering");
        return -1;
    }
    g->k = k;
    int64_t work = 1;
    for (int d = 0; d < k->nd; d++) work *= k->dims[d];
    /* (a generic kernel runs at any size: its loops may vectorize) */
    g->plain_loops = work <= GJ_JIT_SMALL_KERNEL && !g->generic;
    /* A reduction over outer dims keeps one double accumulator per column,
     * and LLVM's cost model then vectorises the whole column loop at the
     * width of doubles (4 on AVX2), halving the f32 math's throughput. Ask
     * for the width of floats instead; every lane is its own column, so the
     * order of each sum is unchanged. */
    g->vec_width = 0;
    bool f32_red = false;
    for (int s2 = 0; s2 < k->n_st; s2++)
        f32_red |= k->st[s2].reduce && k->acc[k->st[s2].access].dtype != GJ_F64;
    if (f32_red && k->red && !((k->red >> (k->nd - 1)) & 1u))
        g->vec_width = strstr(l->features, "+avx512f") ? 16 : strstr(l->features, "+avx2") ? 8 : 0;
    for (int a = 0; a < k->n_acc; a++) {
        g->acc_param[a] = -1;
        for (int q = 0; q < np; q++)
            if (k->param_buf[q] == k->acc[a].buf) g->acc_param[a] = q;
    }
    return 0;
}

/* The body: (buffers..., [ints,] row0, row1), its buffers noalias and
 * nocapture, then gen_kernel_body. 0, or -1 with g failed. */
static int lk_body(kg *g, lowering *l) {
    int np = l->np, nx = l->nx;
    LLVMTypeRef *pt = l->pt;
    for (int q = 0; q < np + nx; q++) pt[q] = g->ptr;
    pt[np + nx] = g->i64;
    pt[np + nx + 1] = g->i64;
    l->bty = LLVMFunctionType(g->vd, pt, (unsigned)(np + nx) + 2, 0);
    g->fn = LLVMAddFunction(g->M, l->bname, l->bty);
    LLVMSetLinkage(g->fn, LLVMInternalLinkage);
    add_fn_attr(g, g->fn, "alwaysinline");
    add_fn_attr(g, g->fn, "nounwind");
    add_target_attrs(g, g->fn, l->cpu, l->features);
    unsigned na = LLVMGetEnumAttributeKindForName("noalias", 7);
    unsigned nc = LLVMGetEnumAttributeKindForName("nocapture", 9);
    for (int q = 0; q < np + nx; q++) { /* (the ints table too: nothing writes it) */
        LLVMAddAttributeAtIndex(g->fn, (unsigned)q + 1, LLVMCreateEnumAttribute(g->C, na, 0));
        LLVMAddAttributeAtIndex(g->fn, (unsigned)q + 1, LLVMCreateEnumAttribute(g->C, nc, 0));
        if (q < np) g->param[q] = LLVMGetParam(g->fn, (unsigned)q);
    }
    g->entry = LLVMAppendBasicBlockInContext(g->C, g->fn, "entry");
    LLVMPositionBuilderAtEnd(g->B, g->entry);
    gen_kernel_body(g);
    return g->failed ? -1 : 0;
}

/* The entry (void **bufs, row0, row1): loads each buffer pointer and
 * calls the body. 0, or -1 with g failed. */
static int lk_entry(kg *g, lowering *l) {
    int np = l->np, nx = l->nx;
    LLVMTypeRef et[3] = {g->ptr, g->i64, g->i64};
    LLVMValueRef efn = LLVMAddFunction(g->M, l->name, LLVMFunctionType(g->vd, et, 3, 0));
    add_fn_attr(g, efn, "nounwind");
    add_target_attrs(g, efn, l->cpu, l->features);
    LLVMBasicBlockRef eb = LLVMAppendBasicBlockInContext(g->C, efn, "entry");
    LLVMPositionBuilderAtEnd(g->B, eb);
    LLVMValueRef *args = gj_rt_calloc((size_t)np + 3, sizeof *args);
    if (!args) {
        kg_fail(g, "out of memory while lowering");
        return -1;
    }
    LLVMValueRef bufs = LLVMGetParam(efn, 0);
    for (int q = 0; q < np + nx; q++) {
        LLVMValueRef ix = c64(g, q);
        LLVMValueRef pp = LLVMBuildInBoundsGEP2(g->B, g->ptr, bufs, &ix, 1, "");
        args[q] = LLVMBuildLoad2(g->B, g->ptr, pp, "");
    }
    args[np + nx] = LLVMGetParam(efn, 1);
    args[np + nx + 1] = LLVMGetParam(efn, 2);
    LLVMBuildCall2(g->B, l->bty, g->fn, args, (unsigned)(np + nx) + 2, "");
    LLVMBuildRetVoid(g->B);
    gj_rt_free(args);
    return 0;
}

/* Frees the kernel's tables in g (and leaves them NULL). */
static void lk_free(kg *g) {
    gj_rt_free(g->param);
    gj_rt_free(g->acc_param);
    gj_rt_free(g->ev);
    gj_rt_free(g->racc);
    gj_rt_free(g->lanes);
    gj_rt_free(g->coll);
    gj_rt_free(g->ints_v);
    g->ints_v = NULL;
    g->coll = NULL;
    g->param = NULL;
    g->acc_param = NULL;
    g->ev = g->racc = g->lanes = NULL;
}

/* Attention kernel k (plan.h) as its entry <prefix>_<name>(ptr bufs, i64
 * begin, i64 end): a call of the attention bitcode's gj_bc_attn_<dir>_<dt>
 * with the kernel's integer table, a private constant global (the loads
 * fold once the call is inlined, so the algorithm is specialised to the
 * kernel's sizes and strides) or, generic, the table after the buffers. */
static int lower_attn(kg *g, const gj_jit_kernel *k, const char *prefix, const char *cpu,
                      const char *features) {
    char name[128], fname[40], gname[140];
    snprintf(name, sizeof name, "%s_%s", prefix, k->name);
    snprintf(fname, sizeof fname, "gj_bc_attn_%s_%s", k->attn == GJ_P_ATTN_FWD ? "fwd" : "bwd",
             k->attn_dtype == GJ_F64 ? "f64" : k->attn_dtype == GJ_BF16 ? "bf16" : "f32");
    LLVMValueRef callee = LLVMGetNamedFunction(g->M, fname);
    if (!callee || !k->ints || k->n_ints != GJ_ATTN_NI) {
        kg_fail(g, callee ? "internal: attention kernel %s without its table"
                          : "LLVM: attention bitcode function %s missing", callee ? k->name : fname);
        return -1;
    }
    LLVMTypeRef et[3] = {g->ptr, g->i64, g->i64};
    LLVMValueRef efn = LLVMAddFunction(g->M, name, LLVMFunctionType(g->vd, et, 3, 0));
    add_fn_attr(g, efn, "nounwind");
    add_target_attrs(g, efn, cpu, features);
    LLVMBasicBlockRef eb = LLVMAppendBasicBlockInContext(g->C, efn, "entry");
    LLVMPositionBuilderAtEnd(g->B, eb);
    LLVMValueRef bufs = LLVMGetParam(efn, 0), table;
    if (gj_jit_kernel_generic(g->p, k)) {
        LLVMValueRef ix = c64(g, k->n_params);
        table = LLVMBuildLoad2(g->B, g->ptr, LLVMBuildInBoundsGEP2(g->B, g->ptr, bufs, &ix, 1, ""), "");
    } else {
        LLVMValueRef vals[GJ_ATTN_NI];
        for (int i = 0; i < GJ_ATTN_NI; i++) vals[i] = c64(g, k->ints[i]);
        LLVMTypeRef at = LLVMArrayType2(g->i64, GJ_ATTN_NI);
        snprintf(gname, sizeof gname, "%s.table", name);
        table = LLVMAddGlobal(g->M, at, gname);
        LLVMSetInitializer(table, LLVMConstArray2(g->i64, vals, GJ_ATTN_NI));
        LLVMSetGlobalConstant(table, 1);
        LLVMSetLinkage(table, LLVMPrivateLinkage);
        LLVMSetUnnamedAddress(table, LLVMGlobalUnnamedAddr);
    }
    LLVMValueRef args[4] = {bufs, LLVMGetParam(efn, 1), LLVMGetParam(efn, 2), table};
    LLVMBuildCall2(g->B, LLVMGlobalGetValueType(callee), callee, args, 4, "");
    LLVMBuildRetVoid(g->B);
    return 0;
}

/* Lowers kernel k into g's module as its body and entry functions. 0, or
 * -1 with g failed. */
static int lower_kernel(kg *g, const gj_jit_kernel *k, const char *prefix, const char *cpu,
                        const char *features) {
    if (k->attn) return lower_attn(g, k, prefix, cpu, features);
    lowering l;
    memset(&l, 0, sizeof l);
    l.k = k;
    l.cpu = cpu;
    l.features = features;
    snprintf(l.name, sizeof l.name, "%s_%s", prefix, k->name);
    snprintf(l.bname, sizeof l.bname, "%s.body", l.name);
    l.np = k->n_params;
    g->generic = gj_jit_kernel_generic(g->p, k);
    l.nx = g->generic ? 1 : 0; /* the ints table after the buffers */
    if (lk_check(g, k) != 0) return -1;
    int rc = lk_tables(g, &l);
    if (rc == 0) rc = lk_body(g, &l);
    if (rc == 0) rc = lk_entry(g, &l);
    gj_rt_free(l.pt);
    lk_free(g);
    return rc;
}

int gj_jit_lower_plan(LLVMModuleRef M, const gj_jit_plan *p, const char *prefix,
                      const char *cpu, const char *features, const int *shard_of_instr,
                      int shard, char *why, size_t why_cap) {
    kg g;
    memset(&g, 0, sizeof g);
    g.C = LLVMGetModuleContext(M);
    g.M = M;
    g.B = LLVMCreateBuilderInContext(g.C);
    g.i1 = LLVMInt1TypeInContext(g.C);
    g.i16 = LLVMInt16TypeInContext(g.C);
    g.i64 = LLVMInt64TypeInContext(g.C);
    g.f32 = LLVMFloatTypeInContext(g.C);
    g.f64 = LLVMDoubleTypeInContext(g.C);
    g.ptr = LLVMPointerTypeInContext(g.C, 0);
    g.vd = LLVMVoidTypeInContext(g.C);
    g.p = p;
    g.why = why;
    g.why_cap = why_cap;
    int rc = 0;
    for (int s = 0; s < p->n_instrs && rc == 0; s++) {
        if (p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || p->instrs[s].k.shared) continue;
        if (shard_of_instr && shard_of_instr[s] != shard) continue;
        bool seen = false; /* a kernel shared with an earlier instruction (dedupe.c) */
        for (int t = 0; t < s && !seen; t++)
            seen = p->instrs[t].kind == GJ_JIT_INSTR_KERNEL &&
                   strcmp(p->instrs[t].k.name, p->instrs[s].k.name) == 0;
        if (!seen && lower_kernel(&g, &p->instrs[s].k, prefix, cpu, features) != 0) rc = -1;
    }
    LLVMDisposeBuilder(g.B);
    return rc;
}
