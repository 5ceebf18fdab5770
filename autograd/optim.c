/* SPDX-License-Identifier: MIT */
/*
 * optim.c - the eager interpreter of optimizer updates (ag.h, "optimizer
 * updates"): gj_ag_opt_apply runs an optimizer's formula on one parameter
 * in one pass over memory.
 *
 * The formula is first recorded on a small tape (a builder whose values
 * are tape slots): its inputs are the parameter, the gradient, the state
 * tensors (elementwise, n elements, in the compute type T) and the
 * run-time scalars (0-d). The tape is then interpreted over chunks of
 * OPT_CHUNK elements (in buffers on the stack): the tensors are loaded into chunk buffers in T, each
 * instruction runs the eager kernels' own dense loop (gj_rt_ew_dense) on
 * its buffers, and the new parameter and state are stored back in place.
 * Values that depend on scalars only are computed once per range.
 *
 * Invariants:
 *   - Every instruction has the eager kernels' semantics in T (the same
 *     loop; casts as the CAST kernel: f64 -> f32 rounds to nearest, a cast
 *     to bf16 rounds to nearest even and keeps the value in f32), so the
 *     interpreter and the compiled step, which lowers the same formula,
 *     give the same bits.
 *   - Elements are independent: a chunk's results do not depend on the
 *     chunking or the thread count.
 *   - A formula that uses anything but elementwise primitives, casts and
 *     0-d fills is refused before anything is written.
 *   - A state known to be zero (a first update: the caller's zero_state
 *     bits) is not read: its chunk buffer is filled with +0, the value a
 *     zero-filled tensor would load, so the bits are the same, and the
 *     update is the state's first writer.
 */
#include "ag.h"
#include "../runtime/gj_math.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { OPT_CHUNK = 128, OPT_MAX_VALS = 48 }; /* scratch: 48 KiB of stack per range */

/* Inputs of the tape: p, g, state 0.., hyper 0.. */
enum { OPT_IN_P = 0, OPT_IN_G = 1, OPT_IN_STATE = 2,
       OPT_IN_HYPER = OPT_IN_STATE + GJ_AG_OPT_MAX_STATE };

typedef struct opt_val {
    gj_dtype ct;    /* compute type of its buffer: GJ_F32 or GJ_F64 */
    gj_dtype dt;    /* its dtype as the formula sees it (GJ_BF16: f32 rounded to bf16) */
    bool scalar;    /* 0-d */
    int op;         /* the tape instruction that makes it, or -1 (an input) */
    int input;      /* OPT_IN_*: which input */
} opt_val;

typedef struct opt_op {
    gj_rt_inst inst;
    int in[3];
    int out;
} opt_op;

typedef struct opt_tape {
    gj_ag_builder b; /* first: the builder handed to the formula */
    opt_val v[OPT_MAX_VALS];
    int n_v;
    opt_op op[OPT_MAX_VALS];
    int n_op;
    int64_t n; /* elements of the non-scalar values */
    char why[160];
} opt_tape;

static gj_val *val_of(int id) { return (gj_val *)(uintptr_t)(id + 1); }
static int id_of(gj_val *v) { return (int)((uintptr_t)v - 1); }

static void tape_fail(opt_tape *t, const char *fmt, const char *what) {
    if (!t->why[0]) snprintf(t->why, sizeof t->why, fmt, what);
}

static int tape_new_val(opt_tape *t, gj_dtype dt, bool scalar, int op, int input) {
    if (t->n_v == OPT_MAX_VALS) {
        tape_fail(t, "%s", "the update has too many values");
        return -1;
    }
    gj_dtype ct = dt == GJ_F64 ? GJ_F64 : GJ_F32;
    t->v[t->n_v] = (opt_val){ct, dt, scalar, op, input};
    return t->n_v++;
}

static bool elementwise(gj_rt_prim p) {
    switch (p) {
    case GJ_P_NEG: case GJ_P_EXP: case GJ_P_LOG: case GJ_P_TANH: case GJ_P_SIGMOID:
    case GJ_P_RELU: case GJ_P_GELU: case GJ_P_SQRT: case GJ_P_RSQRT: case GJ_P_RECIP:
    case GJ_P_GELU_GRAD: case GJ_P_STEP: case GJ_P_ADD_SCALAR: case GJ_P_MUL_SCALAR:
    case GJ_P_POW_SCALAR: case GJ_P_ADD: case GJ_P_SUB: case GJ_P_MUL: case GJ_P_DIV:
    case GJ_P_EQ: case GJ_P_WHERE:
        return true;
    default:
        return false;
    }
}

static int tape_emit(gj_ag_builder *b, const gj_rt_inst *inst, gj_val *const *in, gj_val **outs) {
    opt_tape *t = (opt_tape *)b;
    const char *name = gj_rt_prim_name(inst->prim);
    bool fill = inst->prim == GJ_P_FILL && inst->ndim == 0;
    if (!fill && inst->prim != GJ_P_CAST && !elementwise(inst->prim)) {
        tape_fail(t, "an optimizer update may only use elementwise primitives, not %s", name);
        gj_rt_set_error("gj_optim_step: %s", t->why);
        return -1;
    }
    if (t->n_op == OPT_MAX_VALS || inst->n_in > 3) {
        tape_fail(t, "%s", "the update has too many instructions");
        gj_rt_set_error("gj_optim_step: %s", t->why);
        return -1;
    }
    opt_op *o = &t->op[t->n_op];
    memset(o, 0, sizeof *o);
    o->inst = *inst;
    bool scalar = true;
    gj_dtype dt = fill ? inst->dtype : GJ_F32;
    for (int i = 0; i < inst->n_in; i++) {
        o->in[i] = id_of(in[i]);
        scalar = scalar && t->v[o->in[i]].scalar;
    }
    if (inst->prim == GJ_P_CAST) dt = inst->dtype;
    else if (!fill) dt = t->v[o->in[inst->prim == GJ_P_WHERE ? 1 : 0]].dt;
    if (dt == GJ_BF16 && inst->prim != GJ_P_CAST) dt = GJ_F32; /* (ops on bf16 give f32 here) */
    if (dt != GJ_F32 && dt != GJ_F64 && dt != GJ_BF16) {
        tape_fail(t, "an optimizer update computes in f32 or f64, not %s", gj_rt_dtype_name(dt));
        gj_rt_set_error("gj_optim_step: %s", t->why);
        return -1;
    }
    int v = tape_new_val(t, dt, scalar, t->n_op, -1);
    if (v < 0) {
        gj_rt_set_error("gj_optim_step: %s", t->why);
        return -1;
    }
    o->out = v;
    t->n_op++;
    outs[0] = val_of(v);
    return 1;
}

static void tape_meta(gj_ag_builder *b, gj_val *v, gj_rt_meta *out) {
    opt_tape *t = (opt_tape *)b;
    const opt_val *x = &t->v[id_of(v)];
    memset(out, 0, sizeof *out);
    out->dtype = x->dt;
    out->ndim = x->scalar ? 0 : 1;
    out->shape[0] = t->n;
}

static gj_val *tape_constant(gj_ag_builder *b, gj_tensor *tn) {
    (void)tn;
    tape_fail((opt_tape *)b, "%s", "an optimizer update may not read other tensors");
    return NULL;
}

static void tape_keep(gj_ag_builder *b, gj_val *v) { (void)b, (void)v; }
static void tape_end_node(gj_ag_builder *b) { (void)b; }

/* -------------------------------------------------------- interpreter */

typedef struct opt_run {
    const opt_tape *t;
    int p_new, state_new[GJ_AG_OPT_MAX_STATE]; /* tape values, or -1 */
    const double *h;
    gj_tensor *p;
    const gj_tensor *g;
    gj_tensor *const *state;
    gj_dtype T;
    unsigned zero_state; /* bit k: state[k] stands for zeros (not read) */
} opt_run;

/* buf of value id in a range's scratch. */
static void *buf_of(char *scratch, int id) {
    return scratch + (size_t)id * OPT_CHUNK * sizeof(double);
}

/* dst[0..m) (compute type ct) = src[i0..i0+m) of dtype dt, converted. */
static void load(void *dst, gj_dtype ct, const void *src, gj_dtype dt, int64_t i0, int m) {
    if (ct == GJ_F64) {
        double *d = dst;
        if (dt == GJ_F64) memcpy(d, (const double *)src + i0, (size_t)m * sizeof *d);
        else if (dt == GJ_F32) for (int k = 0; k < m; k++) d[k] = ((const float *)src)[i0 + k];
        else for (int k = 0; k < m; k++) d[k] = gj_m_bf16_to_f32(((const uint16_t *)src)[i0 + k]);
        return;
    }
    float *d = dst;
    if (dt == GJ_F32) memcpy(d, (const float *)src + i0, (size_t)m * sizeof *d);
    else if (dt == GJ_F64) for (int k = 0; k < m; k++) d[k] = (float)((const double *)src)[i0 + k];
    else for (int k = 0; k < m; k++) d[k] = gj_m_bf16_to_f32(((const uint16_t *)src)[i0 + k]);
}

/* dst[i0..i0+m) of dtype dt = src[0..m) (compute type ct), converted. */
static void store(void *dst, gj_dtype dt, const void *src, gj_dtype ct, int64_t i0, int m) {
    if (dt == ct) {
        size_t es = gj_rt_dtype_size(dt);
        memcpy((char *)dst + (size_t)i0 * es, src, (size_t)m * es);
    } else if (dt == GJ_BF16) {
        for (int k = 0; k < m; k++)
            ((uint16_t *)dst)[i0 + k] = gj_m_f32_to_bf16(((const float *)src)[k]);
    } else if (dt == GJ_F32) { /* (from f64) */
        for (int k = 0; k < m; k++) ((float *)dst)[i0 + k] = (float)((const double *)src)[k];
    } else {
        for (int k = 0; k < m; k++) ((double *)dst)[i0 + k] = ((const float *)src)[k];
    }
}

/* Runs tape instruction o on m elements of the scratch buffers. */
static void run_op(const opt_tape *t, const opt_op *o, char *scratch, int m) {
    const opt_val *out = &t->v[o->out];
    void *dst = buf_of(scratch, o->out);
    if (o->inst.prim == GJ_P_FILL) {
        for (int k = 0; k < m; k++) {
            if (out->ct == GJ_F64) ((double *)dst)[k] = o->inst.scalar;
            else ((float *)dst)[k] = (float)o->inst.scalar;
        }
        if (out->dt == GJ_BF16)
            for (int k = 0; k < m; k++)
                ((float *)dst)[k] = gj_m_bf16_to_f32(gj_m_f32_to_bf16(((float *)dst)[k]));
        return;
    }
    if (o->inst.prim == GJ_P_CAST) {
        const opt_val *x = &t->v[o->in[0]];
        const void *src = buf_of(scratch, o->in[0]);
        if (out->ct == GJ_F64 && x->ct == GJ_F32)
            for (int k = 0; k < m; k++) ((double *)dst)[k] = ((const float *)src)[k];
        else if (out->ct == GJ_F32 && x->ct == GJ_F64)
            for (int k = 0; k < m; k++) ((float *)dst)[k] = (float)((const double *)src)[k];
        else memmove(dst, src, (size_t)m * gj_rt_dtype_size(out->ct));
        if (out->dt == GJ_BF16)
            for (int k = 0; k < m; k++)
                ((float *)dst)[k] = gj_m_bf16_to_f32(gj_m_f32_to_bf16(((float *)dst)[k]));
        return;
    }
    const void *in[3];
    for (int i = 0; i < o->inst.n_in; i++) in[i] = buf_of(scratch, o->in[i]);
    (void)gj_rt_ew_dense(o->inst.prim, out->ct, o->inst.scalar, m, in, dst); /* (checked) */
}

/* Fills the buffer of input value v for elements [i0, i0 + m). */
static void load_input(const opt_run *r, const opt_val *v, void *dst, int64_t i0, int m) {
    if (v->input == OPT_IN_P) load(dst, v->ct, gj_rt_data_ptr(r->p), r->p->dtype, i0, m);
    else if (v->input == OPT_IN_G) load(dst, v->ct, gj_rt_data_ptr(r->g), r->g->dtype, i0, m);
    else if (r->zero_state & (1u << (v->input - OPT_IN_STATE))) {
        memset(dst, 0, (size_t)m * gj_rt_dtype_size(v->ct)); /* +0, as zeroed memory loads */
    } else {
        const gj_tensor *s = r->state[v->input - OPT_IN_STATE];
        load(dst, v->ct, gj_rt_data_ptr(s), s->dtype, i0, m);
    }
}

static void opt_range(void *ctx, int64_t begin, int64_t end) {
    const opt_run *r = ctx;
    const opt_tape *t = r->t;
    _Alignas(64) double space[OPT_MAX_VALS * OPT_CHUNK];
    char *scratch = (char *)space;
    /* the scalars, once: hyper inputs, then what depends on them only */
    for (int id = 0; id < t->n_v; id++) {
        const opt_val *v = &t->v[id];
        if (!v->scalar || v->op >= 0) continue;
        double x = r->h[v->input - OPT_IN_HYPER];
        for (int k = 0; k < OPT_CHUNK; k++) {
            if (v->ct == GJ_F64) ((double *)buf_of(scratch, id))[k] = x;
            else ((float *)buf_of(scratch, id))[k] = (float)x;
        }
    }
    for (int i = 0; i < t->n_op; i++)
        if (t->v[t->op[i].out].scalar) run_op(t, &t->op[i], scratch, OPT_CHUNK);
    for (int64_t i0 = begin; i0 < end; i0 += OPT_CHUNK) {
        int m = (int)(end - i0 < OPT_CHUNK ? end - i0 : OPT_CHUNK);
        for (int id = 0; id < t->n_v; id++)
            if (!t->v[id].scalar && t->v[id].op < 0)
                load_input(r, &t->v[id], buf_of(scratch, id), i0, m);
        for (int i = 0; i < t->n_op; i++)
            if (!t->v[t->op[i].out].scalar) run_op(t, &t->op[i], scratch, m);
        store(gj_rt_data_ptr(r->p), r->p->dtype, buf_of(scratch, r->p_new), r->T, i0, m);
        for (int k = 0; k < GJ_AG_OPT_MAX_STATE; k++)
            if (r->state_new[k] >= 0)
                store(gj_rt_data_ptr(r->state[k]), r->state[k]->dtype,
                      buf_of(scratch, r->state_new[k]), r->T, i0, m);
    }
}

int gj_ag_opt_apply(const gj_ag_optdef *def, uint32_t s, const double *h, gj_tensor *p,
                    const gj_tensor *g, gj_tensor *const *state, unsigned *zero_state) {
    opt_tape *t = gj_rt_calloc(1, sizeof *t);
    if (!t) return -1;
    int rc = -1;
    t->b.emit = tape_emit;
    t->b.meta = tape_meta;
    t->b.constant = tape_constant;
    t->b.keep = tape_keep;
    t->b.drop = tape_keep;
    t->b.end_node = tape_end_node;
    t->n = p->numel;
    gj_dtype T = gj_ag_opt_dtype(p->dtype);
    gj_val *pv = val_of(tape_new_val(t, T, false, -1, OPT_IN_P));
    gj_val *gv = val_of(tape_new_val(t, T, false, -1, OPT_IN_G));
    gj_val *sv[GJ_AG_OPT_MAX_STATE] = {0}, *hv[GJ_AG_OPT_MAX_HYPER] = {0};
    gj_val *p_new = NULL, *s_new[GJ_AG_OPT_MAX_STATE] = {0};
    for (int k = 0; k < def->n_state; k++)
        if (def->uses_state(s, k)) sv[k] = val_of(tape_new_val(t, T, false, -1, OPT_IN_STATE + k));
    for (int j = 0; j < def->n_hyper; j++)
        hv[j] = val_of(tape_new_val(t, T, true, -1, OPT_IN_HYPER + j));
    if (def->update(&t->b, s, pv, gv, sv, hv, &p_new, s_new) != 0 || !p_new) {
        if (!gj_last_error()[0] || t->why[0])
            gj_rt_set_error("gj_optim_step: the %s update: %s", def->name,
                            t->why[0] ? t->why : "failed");
        goto done;
    }
    opt_run r = {t, id_of(p_new), {-1, -1}, h, p, g, state, T, 0};
    for (int k = 0; k < def->n_state; k++)
        if (sv[k]) r.state_new[k] = s_new[k] ? id_of(s_new[k]) : -1;
    for (int i = 0; i < t->n_op; i++) { /* every loop exists for its type */
        const opt_op *o = &t->op[i];
        if (o->inst.prim == GJ_P_FILL || o->inst.prim == GJ_P_CAST) continue;
        const void *in[3] = {0};
        double x[3] = {0};
        for (int k = 0; k < o->inst.n_in; k++) in[k] = &x[k];
        double y;
        if (gj_rt_ew_dense(o->inst.prim, t->v[o->out].ct, o->inst.scalar, 0, in, &y) != 0) {
            gj_rt_set_error("gj_optim_step: the %s update: no %s loop for %s", def->name,
                            gj_rt_prim_name(o->inst.prim), gj_rt_dtype_name(t->v[o->out].ct));
            goto done;
        }
    }
    for (int k = 0; zero_state && k < def->n_state; k++) {
        if (!(*zero_state & (1u << k)) || !state[k]) continue;
        if (sv[k] && r.state_new[k] >= 0)
            r.zero_state |= 1u << k; /* written below: its first writer */
        else
            gj_rt_zero_fill(gj_rt_data_ptr(state[k]),
                            (size_t)state[k]->numel * gj_rt_dtype_size(state[k]->dtype));
    }
    gj_rt_parallel_for(p->numel, 1 << 14, opt_range, &r);
    if (zero_state) *zero_state = 0;
    rc = 0;
done:
    gj_rt_free(t);
    return rc;
}
