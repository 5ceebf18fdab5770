/* SPDX-License-Identifier: MIT */
/*
 * custom.c - custom ops defined from plain C functions and a schema string
 * ("mylib::scaled_gelu(Tensor x, float alpha) -> Tensor"): the schema
 * parser, libffi call interfaces built from it, and the op definition whose
 * formulas call the user's functions.
 *
 * Calling convention (public contract, gradjit.h):
 *   forward:  int fwd(<args in schema order>, gj_tensor **out0, ...)
 *   backward: int bwd(gj_tensor *gout0, ..., <args in schema order>,
 *                     gj_tensor **gin0, ... one per Tensor argument)
 * with Tensor -> gj_tensor * (borrowed), float -> double, int -> int64_t,
 * bool -> bool; both return 0 on success.
 *
 * Invariants:
 *   - A gj_custom_op is immutable once defined and lives until exit (nodes
 *     point at its opdef); the registry (g_ops, under g_mu) owns it, one op
 *     per name.
 *   - A node of a custom op has the op's tensor arguments as inputs (schema
 *     order), saves each of them (detached aliases, version-checked like any
 *     saved tensor), and keeps the scalar arguments in its attributes:
 *     float args in f[0..nf) and int/bool args in i[0..ni), schema order.
 *     So the structural key sees the op's name, its scalars and its metas.
 *   - opdef.forward is a libffi closure bound to the op (an op's formula
 *     receives no opdef pointer, and checkpoint replays call it directly);
 *     opdef.backward finds the op through the backward context's node.
 *   - The user's functions run under no_grad inside a user scope of their
 *     own, and only on real tensors: with a recording builder the forward
 *     (met when a checkpoint region recomputes) and the backward become
 *     opaque call nodes through the builder's call_custom_fwd and
 *     call_custom (the compiled program later runs gj_ag_custom_run_forward
 *     and gj_ag_custom_run_backward on copies of its buffers), or fail
 *     cleanly if the builder has none (the JIT falls back to eager).
 */
#include "ag.h"

#include <ffi.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define CUSTOM_MAX_TENSORS GJ_AG_MAX_SAVED /* every tensor argument is saved */
#define CUSTOM_MAX_FLOATS 4
#define CUSTOM_MAX_INTS (GJ_MAX_DIMS + 4)
#define CUSTOM_MAX_ARGS (CUSTOM_MAX_TENSORS + CUSTOM_MAX_FLOATS + CUSTOM_MAX_INTS)
#define CUSTOM_MAX_OUT GJ_AG_MAX_OUT
#define CUSTOM_NAME_MAX 128
#define CUSTOM_ARG_NAME_MAX 48

typedef enum arg_kind { ARG_TENSOR, ARG_FLOAT, ARG_INT, ARG_BOOL } arg_kind;

struct gj_custom_op {
    gj_ag_opdef def; /* def.name == name */
    char name[CUSTOM_NAME_MAX];
    char *schema;
    int n_args, n_tensors, n_floats, n_ints, n_out;
    arg_kind kinds[CUSTOM_MAX_ARGS];
    char arg_names[CUSTOM_MAX_ARGS][CUSTOM_ARG_NAME_MAX];
    void (*fwd)(void);
    void (*bwd)(void); /* NULL: not differentiable */
    ffi_cif fwd_cif, bwd_cif, tramp_cif;
    ffi_type *fwd_types[CUSTOM_MAX_ARGS + CUSTOM_MAX_OUT];
    ffi_type *bwd_types[CUSTOM_MAX_OUT + CUSTOM_MAX_ARGS + CUSTOM_MAX_TENSORS];
    ffi_type *tramp_types[6];
    ffi_closure *closure;
    struct gj_custom_op *next;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static gj_custom_op *g_ops;

static const char *kind_name(arg_kind k) {
    switch (k) {
    case ARG_TENSOR: return "Tensor";
    case ARG_FLOAT: return "float";
    case ARG_INT: return "int";
    case ARG_BOOL: return "bool";
    }
    return "?";
}

/* --------------------------------------------------------------- parser */

typedef struct parser {
    const char *s; /* the whole schema */
    const char *p; /* cursor */
    char err[200];
} parser;

static void skip_ws(parser *ps) {
    while (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n') ps->p++;
}

static bool fail_at(parser *ps, const char *what) {
    if (!ps->err[0])
        snprintf(ps->err, sizeof ps->err, "%s at offset %d", what, (int)(ps->p - ps->s));
    return false;
}

/* An identifier [A-Za-z_][A-Za-z0-9_]* into buf (cap bytes). */
static bool parse_ident(parser *ps, char *buf, size_t cap, const char *what) {
    skip_ws(ps);
    const char *b = ps->p;
    if (!((*b >= 'a' && *b <= 'z') || (*b >= 'A' && *b <= 'Z') || *b == '_'))
        return fail_at(ps, what);
    const char *e = b;
    while ((*e >= 'a' && *e <= 'z') || (*e >= 'A' && *e <= 'Z') || (*e >= '0' && *e <= '9') ||
           *e == '_')
        e++;
    if ((size_t)(e - b) >= cap) return fail_at(ps, "identifier too long");
    memcpy(buf, b, (size_t)(e - b));
    buf[e - b] = '\0';
    ps->p = e;
    return true;
}

static bool expect(parser *ps, const char *tok) {
    skip_ws(ps);
    size_t n = strlen(tok);
    if (strncmp(ps->p, tok, n) != 0) {
        char what[48];
        snprintf(what, sizeof what, "expected '%s'", tok);
        return fail_at(ps, what);
    }
    ps->p += n;
    return true;
}

static bool peek(parser *ps, char c) {
    skip_ws(ps);
    return *ps->p == c;
}

/* One argument "Type name" appended to op. */
static bool parse_arg(parser *ps, gj_custom_op *op) {
    char type[32], name[CUSTOM_ARG_NAME_MAX];
    const char *at = (skip_ws(ps), ps->p);
    if (!parse_ident(ps, type, sizeof type, "expected an argument type")) return false;
    arg_kind k;
    if (strcmp(type, "Tensor") == 0) k = ARG_TENSOR;
    else if (strcmp(type, "float") == 0) k = ARG_FLOAT;
    else if (strcmp(type, "int") == 0) k = ARG_INT;
    else if (strcmp(type, "bool") == 0) k = ARG_BOOL;
    else {
        ps->p = at;
        return fail_at(ps, "unknown argument type (supported: Tensor, float, int, bool)");
    }
    if (*ps->p == '?' || *ps->p == '[')
        return fail_at(ps, "optional and list types are not supported");
    if (!parse_ident(ps, name, sizeof name, "expected an argument name")) return false;
    for (int i = 0; i < op->n_args; i++)
        if (strcmp(op->arg_names[i], name) == 0) return fail_at(ps, "duplicate argument name");
    if (op->n_args == CUSTOM_MAX_ARGS) return fail_at(ps, "too many arguments");
    int *count = k == ARG_TENSOR ? &op->n_tensors : k == ARG_FLOAT ? &op->n_floats : &op->n_ints;
    int max = k == ARG_TENSOR ? CUSTOM_MAX_TENSORS
              : k == ARG_FLOAT ? CUSTOM_MAX_FLOATS
                               : CUSTOM_MAX_INTS;
    if (*count == max) {
        char what[96];
        snprintf(what, sizeof what, "too many %s arguments (at most %d)",
                 k == ARG_BOOL ? "int/bool" : k == ARG_INT ? "int/bool" : kind_name(k), max);
        return fail_at(ps, what);
    }
    (*count)++;
    op->kinds[op->n_args] = k;
    snprintf(op->arg_names[op->n_args], CUSTOM_ARG_NAME_MAX, "%s", name);
    op->n_args++;
    if (peek(ps, '=')) return fail_at(ps, "default values are not supported");
    return true;
}

/* One result "Tensor [name]". */
static bool parse_result(parser *ps, gj_custom_op *op) {
    char type[32], name[CUSTOM_ARG_NAME_MAX];
    if (!parse_ident(ps, type, sizeof type, "expected a result type")) return false;
    if (strcmp(type, "Tensor") != 0) return fail_at(ps, "results must be Tensor");
    if (op->n_out == CUSTOM_MAX_OUT) return fail_at(ps, "too many results (at most 2)");
    op->n_out++;
    skip_ws(ps);
    if ((*ps->p >= 'a' && *ps->p <= 'z') || (*ps->p >= 'A' && *ps->p <= 'Z') || *ps->p == '_')
        return parse_ident(ps, name, sizeof name, "expected a result name");
    return true;
}

/* Parses the whole schema into op (name, arguments, results). */
static bool parse_schema(parser *ps, gj_custom_op *op) {
    char ns[CUSTOM_NAME_MAX], nm[CUSTOM_NAME_MAX];
    if (!parse_ident(ps, ns, sizeof ns, "expected the op's namespace (\"ns::name\")")) return false;
    if (strncmp(ps->p, "::", 2) != 0)
        return fail_at(ps, "expected '::' (the op is named \"namespace::name\")");
    ps->p += 2;
    if (!parse_ident(ps, nm, sizeof nm, "expected the op's name after '::'")) return false;
    size_t lns = strlen(ns), lnm = strlen(nm);
    if (lns + lnm + 3 > sizeof op->name) return fail_at(ps, "op name too long");
    memcpy(op->name, ns, lns);
    memcpy(op->name + lns, "::", 2);
    memcpy(op->name + lns + 2, nm, lnm + 1);
    if (!expect(ps, "(")) return false;
    if (!peek(ps, ')')) {
        for (;;) {
            if (!parse_arg(ps, op)) return false;
            if (peek(ps, ',')) {
                ps->p++;
                continue;
            }
            break;
        }
    }
    if (!expect(ps, ")") || !expect(ps, "->")) return false;
    if (peek(ps, '(')) {
        ps->p++;
        for (;;) {
            if (!parse_result(ps, op)) return false;
            if (peek(ps, ',')) {
                ps->p++;
                continue;
            }
            break;
        }
        if (!expect(ps, ")")) return false;
    } else if (!parse_result(ps, op)) {
        return false;
    }
    skip_ws(ps);
    if (*ps->p) return fail_at(ps, "unexpected text after the results");
    if (op->n_tensors == 0) return fail_at(ps, "the op needs at least one Tensor argument");
    return true;
}

/* --------------------------------------------------------- user calls */

static ffi_type *ffi_of(arg_kind k) {
    switch (k) {
    case ARG_TENSOR: return &ffi_type_pointer;
    case ARG_FLOAT: return &ffi_type_double;
    case ARG_INT: return &ffi_type_sint64;
    case ARG_BOOL: return &ffi_type_uint8;
    }
    return &ffi_type_pointer;
}

/* Storage for the argument values of one call in schema order. */
typedef struct call_args {
    gj_tensor *t[CUSTOM_MAX_ARGS];
    double f[CUSTOM_MAX_ARGS];
    int64_t i[CUSTOM_MAX_ARGS];
    uint8_t b[CUSTOM_MAX_ARGS];
} call_args;

/* Fills ca and values[0..n_args) from tensors and the attributes. */
static void pack_args(const gj_custom_op *op, gj_tensor *const *tensors, const gj_ag_attrs *a,
                      call_args *ca, void **values) {
    int ti = 0, fi = 0, ii = 0;
    for (int j = 0; j < op->n_args; j++) {
        switch (op->kinds[j]) {
        case ARG_TENSOR:
            ca->t[j] = tensors[ti++];
            values[j] = &ca->t[j];
            break;
        case ARG_FLOAT:
            ca->f[j] = a->f[fi++];
            values[j] = &ca->f[j];
            break;
        case ARG_INT:
            ca->i[j] = a->i[ii++];
            values[j] = &ca->i[j];
            break;
        case ARG_BOOL:
            ca->b[j] = a->i[ii++] != 0;
            values[j] = &ca->b[j];
            break;
        }
    }
}

/* "custom op NAME: <what> returned rc[: last error]" as the error. */
static void user_failed(const gj_custom_op *op, const char *what, long rc) {
    char last[256];
    snprintf(last, sizeof last, "%s", gj_last_error());
    gj_rt_set_error("custom op %s: %s function returned %ld%s%s", op->name, what, rc,
                    last[0] ? ": " : "", last);
}

/* Takes the reference of a tensor user code wrote to an out-pointer: a
 * new, unscoped reference without autograd meta. Call while the user scope
 * is open. NULL (error set) if t is not a live tensor. */
static gj_tensor *own_user_tensor(const gj_custom_op *op, gj_tensor *t, gj_ag_uscope us,
                                  const char *what) {
    char arg[256];
    snprintf(arg, sizeof arg, "%s of custom op %s", what, op->name);
    return gj_ag_take_user_ref(t, us, arg);
}

/* User code may write to an out-pointer a tensor it was lent rather than
 * one it made: its borrowed grad_out (a straight-through estimator), an
 * argument (the identity), or the zeros the engine made for an output that
 * got no gradient. Written as is, such a pointer carries no reference of
 * its own; written after gj_retain (the documented way to return an
 * argument), it carries one. Which it is shows in the tensor's reference
 * count against before[k], taken just before the call: every use beyond
 * the references user code added is given one here, so that afterwards
 * each non-NULL out[i] holds a reference for own_user_tensor to take (or
 * drop_user_outs to drop), and handing back a lent tensor means "this
 * value" either way. lent[0..n_lent) were lent to the call. */
static void ref_lent_outs(gj_tensor **out, int n_out, gj_tensor *const *lent,
                          const long *before, int n_lent) {
    for (int k = 0; k < n_lent; k++) {
        bool seen = false;
        for (int j = 0; j < k; j++) seen |= lent[j] == lent[k];
        if (seen || !lent[k]) continue; /* lent twice: counted at its first entry */
        long extra = atomic_load(&lent[k]->refcount) - before[k];
        for (int i = 0; i < n_out; i++) {
            if (out[i] != lent[k]) continue;
            if (extra > 0) extra--; /* a reference user code took for this slot */
            else gj_rt_tensor_retain(out[i]);
        }
    }
}

/* Reference counts of lent[0..n) into before (see ref_lent_outs). */
static void count_lent(gj_tensor *const *lent, int n, long *before) {
    for (int k = 0; k < n; k++) before[k] = lent[k] ? atomic_load(&lent[k]->refcount) : 0;
}

/* Releases what user code wrote to out-pointers after a failure. */
static void drop_user_outs(gj_tensor **ts, int n, gj_ag_uscope us) {
    for (int k = 0; k < n; k++) {
        gj_ag_drop_user_ref(ts[k], us);
        ts[k] = NULL;
    }
}

static bool same_shape(const gj_tensor *t, const gj_rt_meta *m) {
    return t->dtype == m->dtype && t->ndim == m->ndim &&
           memcmp(t->shape, m->shape, (size_t)m->ndim * sizeof m->shape[0]) == 0;
}

int gj_ag_custom_run_backward(const gj_custom_op *op, const gj_ag_attrs *a,
                              const gj_rt_meta *out_meta, gj_tensor *const *gout,
                              gj_tensor *const *inputs, gj_tensor **gin) {
    gj_tensor *zeros[CUSTOM_MAX_OUT] = {0}, *go[CUSTOM_MAX_OUT];
    gj_tensor *res[CUSTOM_MAX_TENSORS] = {0};
    gj_tensor **pres[CUSTOM_MAX_TENSORS];
    void *values[CUSTOM_MAX_OUT + CUSTOM_MAX_ARGS + CUSTOM_MAX_TENSORS];
    call_args ca;
    int rc = -1;
    for (int i = 0; i < op->n_tensors; i++) gin[i] = NULL;
    if (!op->bwd) {
        gj_rt_set_error("custom op %s: no backward function was defined", op->name);
        return -1;
    }
    for (int k = 0; k < op->n_out; k++) {
        go[k] = gout[k];
        if (!go[k]) { /* an output that got no gradient: zeros, as PyTorch materializes */
            zeros[k] = gj_rt_tensor_new(out_meta[k].dtype, out_meta[k].ndim, out_meta[k].shape);
            if (!zeros[k]) goto done;
            go[k] = zeros[k];
        }
        values[k] = &go[k];
    }
    pack_args(op, inputs, a, &ca, values + op->n_out);
    for (int i = 0; i < op->n_tensors; i++) {
        pres[i] = &res[i];
        values[op->n_out + op->n_args + i] = &pres[i];
    }
    gj_tensor *lent[CUSTOM_MAX_OUT + CUSTOM_MAX_TENSORS];
    long before[CUSTOM_MAX_OUT + CUSTOM_MAX_TENSORS];
    int n_lent = 0;
    for (int k = 0; k < op->n_out; k++) lent[n_lent++] = go[k];
    for (int i = 0; i < op->n_tensors; i++) lent[n_lent++] = inputs[i];
    count_lent(lent, n_lent, before);
    ffi_arg ret = 0;
    char who[300];
    snprintf(who, sizeof who, "custom op %s: the backward function", op->name);
    gj_ag_uscope us = gj_ag_user_scope_push();
    gj_ag_no_grad_enter();
    gj_clear_error();
    ffi_call((ffi_cif *)&op->bwd_cif, op->bwd, &ret, values);
    gj_ag_no_grad_exit();
    ref_lent_outs(res, op->n_tensors, lent, before, n_lent);
    if ((int)ret != 0 || gj_last_error()[0]) { /* an error raised inside fails it too */
        if ((int)ret != 0) {
            user_failed(op, "backward", (long)(int)ret);
        } else {
            char why[512];
            snprintf(why, sizeof why, "%s", gj_last_error());
            gj_rt_set_error("custom op %s: backward function returned 0 with an error set "
                            "inside it (clear it with gj_clear_error if it was handled): %s",
                            op->name, why);
        }
        drop_user_outs(res, op->n_tensors, us);
        gj_ag_uscope_close_keep_error(us, who);
        goto done;
    }
    rc = 0;
    for (int i = 0, j = 0; i < op->n_tensors; i++, j++) {
        while (op->kinds[j] != ARG_TENSOR) j++;
        if (!res[i] || rc != 0) continue;
        gin[i] = own_user_tensor(op, res[i], us, "a gradient returned by the backward");
        res[i] = NULL;
        if (!gin[i]) {
            rc = -1;
            continue;
        }
        gj_rt_meta im;
        gj_rt_meta_of(inputs[i], &im);
        if (!same_shape(gin[i], &im)) {
            char got[96], want[96];
            gj_rt_fmt_shape(got, sizeof got, gin[i]->ndim, gin[i]->shape);
            gj_rt_fmt_shape(want, sizeof want, im.ndim, im.shape);
            gj_rt_set_error("custom op %s: backward returned a gradient %s %s for argument "
                            "'%s', which is %s %s",
                            op->name, gj_rt_dtype_name(gin[i]->dtype), got, op->arg_names[j],
                            gj_rt_dtype_name(im.dtype), want);
            rc = -1;
        }
    }
    if (rc != 0) drop_user_outs(res, op->n_tensors, us);
    if (rc != 0) gj_ag_uscope_close_keep_error(us, who);
    else if (gj_ag_user_scope_close(us, who) != 0) rc = -1;
    if (rc != 0)
        for (int i = 0; i < op->n_tensors; i++) {
            if (gin[i]) gj_rt_tensor_release(gin[i]);
            gin[i] = NULL;
        }
done:
    for (int k = 0; k < op->n_out; k++)
        if (zeros[k]) gj_rt_tensor_release(zeros[k]);
    return rc;
}

/* ------------------------------------------------------------ formulas */

int gj_ag_custom_run_forward(const gj_custom_op *op, const gj_ag_attrs *a,
                             gj_tensor *const *inputs, gj_tensor **outs) {
    gj_tensor *tin[CUSTOM_MAX_TENSORS] = {0};
    gj_tensor *res[CUSTOM_MAX_OUT] = {0};
    gj_tensor **pres[CUSTOM_MAX_OUT];
    void *values[CUSTOM_MAX_ARGS + CUSTOM_MAX_OUT];
    call_args ca;
    for (int k = 0; k < op->n_out; k++) outs[k] = NULL;
    for (int i = 0; i < op->n_tensors; i++) tin[i] = inputs[i];
    pack_args(op, tin, a, &ca, values);
    for (int k = 0; k < op->n_out; k++) {
        pres[k] = &res[k];
        values[op->n_args + k] = &pres[k];
    }
    long before[CUSTOM_MAX_TENSORS];
    count_lent(tin, op->n_tensors, before);
    ffi_arg ret = 0;
    int rc = -1;
    char who[300];
    snprintf(who, sizeof who, "custom op %s: the forward function", op->name);
    gj_ag_uscope us = gj_ag_user_scope_push();
    gj_ag_no_grad_enter();
    gj_clear_error();
    ffi_call((ffi_cif *)&op->fwd_cif, op->fwd, &ret, values);
    gj_ag_no_grad_exit();
    ref_lent_outs(res, op->n_out, tin, before, op->n_tensors);
    if ((int)ret != 0) {
        user_failed(op, "forward", (long)(int)ret);
        drop_user_outs(res, op->n_out, us);
        goto done;
    }
    for (int k = 0; k < op->n_out; k++) {
        if (!res[k]) {
            gj_rt_set_error("custom op %s: the forward function wrote no tensor to output %d",
                            op->name, k);
            drop_user_outs(res, op->n_out, us);
            goto done;
        }
    }
    rc = 0;
    for (int k = 0; k < op->n_out; k++) {
        bool lent = false;
        for (int i = 0; i < op->n_tensors; i++) lent |= res[k] == tin[i];
        gj_tensor *t = own_user_tensor(op, res[k], us, "an output of the forward");
        if (t && lent && t == res[k]) { /* an output is a tensor of its own, never an input */
            gj_tensor *al = gj_rt_tensor_alias(t);
            gj_rt_tensor_release(t);
            t = al;
        }
        res[k] = NULL;
        outs[k] = t;
        if (!t) {
            drop_user_outs(res, op->n_out, us);
            rc = -1;
            break;
        }
    }
done:
    if (rc != 0) gj_ag_uscope_close_keep_error(us, who);
    else if (gj_ag_user_scope_close(us, who) != 0) rc = -1;
    if (rc != 0)
        for (int k = 0; k < op->n_out; k++) {
            if (outs[k]) gj_rt_tensor_release(outs[k]);
            outs[k] = NULL;
        }
    return rc;
}

/* The forward formula (reached through op->closure): runs the user's
 * forward on the eager builder's tensors, saves every tensor argument.
 * A recording builder records an opaque call of it instead (the
 * recomputation of a checkpoint region), if it can. */
static int custom_forward(gj_custom_op *op, gj_ag_builder *b, gj_ag_fctx *ctx,
                          const gj_ag_attrs *a, int n_in, gj_val *const *in, gj_val **outs) {
    if (n_in != op->n_tensors) {
        gj_rt_set_error("custom op %s: internal: %d tensor inputs, schema has %d", op->name, n_in,
                        op->n_tensors);
        return -1;
    }
    if (b->records) {
        if (!b->call_custom_fwd) {
            gj_rt_set_error("custom op %s: cannot be captured: its forward is a C function the "
                            "recording builder cannot trace (runs eagerly)",
                            op->name);
            return -1;
        }
        int n = b->call_custom_fwd(b, &op->def, a, n_in, in, outs);
        if (n < 0) return -1;
        for (int i = 0; i < n_in; i++) gj_ag_save(ctx, in[i]);
        return n;
    }
    gj_tensor *tin[CUSTOM_MAX_TENSORS] = {0}, *res[CUSTOM_MAX_OUT] = {0};
    for (int i = 0; i < n_in; i++) {
        tin[i] = gj_ag_val_tensor(in[i]);
        if (gj_rt_is_abstract(tin[i])) { /* its C forward reads values */
            gj_rt_set_error("custom op %s: input %d is abstract (the compiled step's first "
                            "run traces under a memory budget without computing): its forward "
                            "cannot run on it",
                            op->name, i);
            return -1;
        }
    }
    if (gj_ag_custom_run_forward(op, a, tin, res) != 0) return -1;
    int rc = op->n_out;
    for (int k = 0; k < op->n_out; k++) {
        outs[k] = rc >= 0 ? gj_ag_eager_adopt(res[k]) : NULL; /* the step owns it now */
        if (!outs[k]) { /* not adopted: still ours */
            rc = -1;
            if (res[k]) gj_rt_tensor_release(res[k]);
        }
    }
    if (rc >= 0)
        for (int i = 0; i < n_in; i++) gj_ag_save(ctx, in[i]);
    return rc;
}

/* libffi closure handler with the signature of gj_ag_opdef.forward. */
static void forward_tramp(ffi_cif *cif, void *ret, void **args, void *user) {
    (void)cif;
    gj_custom_op *op = user;
    int r = custom_forward(op, *(gj_ag_builder **)args[0], *(gj_ag_fctx **)args[1],
                           *(const gj_ag_attrs **)args[2], *(int *)args[3],
                           *(gj_val *const **)args[4], *(gj_val ***)args[5]);
    *(ffi_arg *)ret = (ffi_arg)(ffi_sarg)r;
}

static int custom_backward(gj_ag_builder *b, gj_ag_bctx *ctx, const gj_ag_attrs *a,
                           gj_val *const *gout, gj_val **gin) {
    gj_ag_node *node = gj_ag_ctx_node(ctx);
    gj_custom_op *op = gj_ag_custom_of(node->op);
    if (!op) {
        gj_rt_set_error("custom op: internal: backward of a node that is not a custom op");
        return -1;
    }
    if (b->records) { /* an opaque call node of the compiled program, if the builder can */
        if (!b->call_custom) {
            gj_rt_set_error("custom op %s: cannot be captured: its backward is a C function the "
                            "recording builder cannot trace (runs eagerly)",
                            op->name);
            return -1;
        }
        gj_val *sv[CUSTOM_MAX_TENSORS];
        bool needs[CUSTOM_MAX_TENSORS];
        for (int i = 0; i < op->n_tensors; i++) {
            gin[i] = NULL;
            sv[i] = gj_ag_saved(ctx, i);
            needs[i] = gj_ag_needs_grad(ctx, i);
            if (!sv[i]) {
                gj_rt_set_error("custom op %s: internal: saved input %d is missing", op->name, i);
                return -1;
            }
        }
        return b->call_custom(b, node, gout, sv, needs, gin);
    }
    gj_tensor *inputs[CUSTOM_MAX_TENSORS], *go[CUSTOM_MAX_OUT] = {0}, *g[CUSTOM_MAX_TENSORS];
    for (int i = 0; i < op->n_tensors; i++) {
        gj_val *v = gj_ag_saved(ctx, i);
        if (!v) {
            gj_rt_set_error("custom op %s: internal: saved input %d is missing", op->name, i);
            return -1;
        }
        inputs[i] = gj_ag_val_tensor(v);
    }
    for (int k = 0; k < op->n_out; k++) go[k] = gout[k] ? gj_ag_val_tensor(gout[k]) : NULL;
    if (gj_ag_custom_run_backward(op, a, node->out_meta, go, inputs, g) != 0) return -1;
    int rc = 0;
    for (int i = 0; i < op->n_tensors; i++) {
        gin[i] = NULL;
        if (!g[i]) continue;
        if (rc != 0 || !gj_ag_needs_grad(ctx, i)) {
            gj_rt_tensor_release(g[i]);
            continue;
        }
        gin[i] = gj_ag_eager_adopt(g[i]);
        if (!gin[i]) rc = -1;
    }
    return rc;
}

/* ------------------------------------------------------------- public */

gj_custom_op *gj_ag_custom_of(const gj_ag_opdef *op) {
    if (!op || op->backward != custom_backward) return NULL;
    return (gj_custom_op *)((char *)op - offsetof(gj_custom_op, def));
}

int gj_ag_custom_n_outputs(const gj_custom_op *op) { return op ? op->n_out : -1; }
int gj_ag_custom_n_tensor_args(const gj_custom_op *op) { return op ? op->n_tensors : -1; }

gj_custom_op *gj_ag_custom_find(const char *name) {
    if (!name) return NULL;
    pthread_mutex_lock(&g_mu);
    gj_custom_op *op = g_ops;
    while (op && strcmp(op->name, name) != 0) op = op->next;
    pthread_mutex_unlock(&g_mu);
    return op;
}

/* Builds the call interfaces and the forward closure of a parsed op. */
static int prepare_ffi(gj_custom_op *op) {
    int n = 0;
    for (int j = 0; j < op->n_args; j++) op->fwd_types[n++] = ffi_of(op->kinds[j]);
    for (int k = 0; k < op->n_out; k++) op->fwd_types[n++] = &ffi_type_pointer;
    if (ffi_prep_cif(&op->fwd_cif, FFI_DEFAULT_ABI, (unsigned)n, &ffi_type_sint, op->fwd_types) !=
        FFI_OK)
        goto fail;
    n = 0;
    for (int k = 0; k < op->n_out; k++) op->bwd_types[n++] = &ffi_type_pointer;
    for (int j = 0; j < op->n_args; j++) op->bwd_types[n++] = ffi_of(op->kinds[j]);
    for (int i = 0; i < op->n_tensors; i++) op->bwd_types[n++] = &ffi_type_pointer;
    if (ffi_prep_cif(&op->bwd_cif, FFI_DEFAULT_ABI, (unsigned)n, &ffi_type_sint, op->bwd_types) !=
        FFI_OK)
        goto fail;
    /* int forward(gj_ag_builder *, gj_ag_fctx *, const gj_ag_attrs *, int, gj_val *const *, gj_val **) */
    ffi_type *tt[6] = {&ffi_type_pointer, &ffi_type_pointer, &ffi_type_pointer,
                       &ffi_type_sint,    &ffi_type_pointer, &ffi_type_pointer};
    memcpy(op->tramp_types, tt, sizeof tt);
    if (ffi_prep_cif(&op->tramp_cif, FFI_DEFAULT_ABI, 6, &ffi_type_sint, op->tramp_types) != FFI_OK)
        goto fail;
    void *code = NULL;
    op->closure = ffi_closure_alloc(sizeof(ffi_closure), &code);
    if (!op->closure) goto fail;
    if (ffi_prep_closure_loc(op->closure, &op->tramp_cif, forward_tramp, op, code) != FFI_OK)
        goto fail;
    memcpy(&op->def.forward, &code, sizeof code); /* the closure's entry point */
    return 0;
fail:
    gj_rt_set_error("gj_custom_op_define: libffi could not prepare the calls of %s", op->name);
    return -1;
}

static void op_free(gj_custom_op *op) {
    if (!op) return;
    if (op->closure) ffi_closure_free(op->closure);
    gj_rt_free(op->schema);
    gj_rt_free(op);
}

gj_custom_op *gj_ag_custom_define(const char *schema, void *forward_fn, void *backward_fn) {
    if (!schema || !forward_fn) {
        gj_rt_set_error("gj_custom_op_define: schema and forward_fn must not be NULL");
        return NULL;
    }
    gj_custom_op *op = gj_rt_calloc(1, sizeof *op);
    if (!op) return NULL;
    parser ps = {.s = schema, .p = schema};
    if (!parse_schema(&ps, op)) {
        gj_rt_set_error("gj_custom_op_define: malformed schema \"%s\": %s", schema, ps.err);
        goto fail;
    }
    size_t len = strlen(schema);
    op->schema = gj_rt_malloc(len + 1);
    if (!op->schema) goto fail;
    memcpy(op->schema, schema, len + 1);
    memcpy(&op->fwd, &forward_fn, sizeof op->fwd);
    memcpy(&op->bwd, &backward_fn, sizeof op->bwd);
    op->def.name = op->name;
    op->def.backward = custom_backward;
    if (prepare_ffi(op) != 0) goto fail;
    pthread_mutex_lock(&g_mu);
    for (gj_custom_op *o = g_ops; o; o = o->next) {
        if (strcmp(o->name, op->name) != 0) continue;
        pthread_mutex_unlock(&g_mu);
        gj_rt_set_error("gj_custom_op_define: an op named %s is already defined (schema \"%s\")",
                        op->name, o->schema);
        goto fail;
    }
    op->next = g_ops;
    g_ops = op;
    pthread_mutex_unlock(&g_mu);
    return op;
fail:
    op_free(op);
    return NULL;
}

int gj_ag_custom_call(gj_custom_op *op, gj_tensor *const *tensor_args, const double *scalar_args,
                      gj_tensor **outs) {
    if (!op || !tensor_args || !outs || (!scalar_args && op->n_args > op->n_tensors)) {
        gj_rt_set_error("gj_custom_op_call: op, tensor_args, outs%s must not be NULL",
                        op && op->n_args > op->n_tensors ? " and scalar_args" : "");
        return -1;
    }
    for (int k = 0; k < op->n_out; k++) outs[k] = NULL;
    gj_ag_attrs attrs;
    memset(&attrs, 0, sizeof attrs);
    bool any_rg = false;
    for (int j = 0, ti = 0, si = 0; j < op->n_args; j++) {
        char what[96];
        snprintf(what, sizeof what, "argument '%s'", op->arg_names[j]);
        if (op->kinds[j] == ARG_TENSOR) {
            gj_tensor *t = tensor_args[ti++];
            if (!gj_rt_check_tensor(t, op->name, what)) return -1;
            gj_ag_tensor_meta *m = t->ag;
            any_rg |= m && m->requires_grad;
            continue;
        }
        double v = scalar_args[si++];
        if (op->kinds[j] == ARG_FLOAT) {
            attrs.f[attrs.nf++] = v;
            continue;
        }
        bool ok = op->kinds[j] == ARG_BOOL ? (v == 0.0 || v == 1.0)
                                           : (v == trunc(v) && fabs(v) < 9.2e18);
        if (!ok) {
            gj_rt_set_error("%s: %s is %s but got %g", op->name, what,
                            op->kinds[j] == ARG_BOOL ? "a bool (0 or 1)" : "an integer", v);
            return -1;
        }
        attrs.i[attrs.ni++] = (int64_t)v;
    }
    if (any_rg && gj_ag_grad_enabled() && !op->bwd) {
        gj_rt_set_error("%s: an input requires grad but the op was defined without a backward "
                        "function (call it under no_grad, or define a backward)",
                        op->name);
        return -1;
    }
    return gj_ag_apply(&op->def, &attrs, op->n_tensors, tensor_args, outs) < 0 ? -1 : 0;
}
