/* SPDX-License-Identifier: MIT */
/*
 * nn.c - the layers of gradjit.h: Linear, LayerNorm, Embedding.
 *
 * Invariants: a layer owns one reference to each parameter tensor, never a
 * scope's (init calls gj_scope_keep, so a layer created inside a scope
 * outlives it); every parameter is a float leaf that requires grad. After a
 * failed init and after free, the struct is zeroed, so free is idempotent.
 * Forward functions return new references like every op.
 */
#include "fe.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* A fresh parameter (new reference owned by the caller, not by a scope)
 * that requires grad; NULL (error set, nothing leaked) on failure. */
static gj_tensor *nn_param(gj_tensor *t) {
    if (!t)
        return NULL;
    gj_scope_keep(t);
    if (gj_set_requires_grad(t, true) != 0) {
        gj_release(t);
        return NULL;
    }
    return t;
}

/* Makes the current error start with "op: " (a failure inside gj_rand,
 * gj_ones, ... names that function otherwise). */
static void nn_prefix_error(const char *op) {
    const char *msg = gj_last_error();
    size_t n = strlen(op);
    if (strncmp(msg, op, n) != 0 || msg[n] != ':')
        gj_rt_set_error("%s: %s", op, msg[0] ? msg : "failed");
}

static bool nn_check_dims(const char *op, int64_t a, int64_t b, gj_dtype dt) {
    if (a <= 0 || b <= 0 || !gj_rt_dtype_valid((int)dt) || !gj_rt_dtype_is_float(dt)) {
        gj_rt_set_error("%s: sizes must be positive and dtype a float type, got %lld, %lld, "
                        "dtype %s",
                        op, (long long)a, (long long)b,
                        gj_rt_dtype_valid((int)dt) ? gj_rt_dtype_name(dt) : "invalid");
        return false;
    }
    return true;
}

/* ---------------------------------------------------------- Linear */

/* weight [out, in] and bias [out] ~ U(-1/sqrt(in), 1/sqrt(in)), which is
 * what torch.nn.Linear's kaiming_uniform_(a = sqrt(5)) amounts to. */
int gj_linear_init(gj_linear_layer *l, int64_t in, int64_t out, bool bias, gj_dtype dtype) {
    if (!l) {
        gj_rt_set_error("gj_linear_init: layer is NULL");
        return -1;
    }
    memset(l, 0, sizeof *l);
    if (!nn_check_dims("gj_linear_init", in, out, dtype))
        return -1;
    double bound = 1.0 / sqrt((double)in);
    int64_t ws[2] = {out, in}, bs[1] = {out};
    l->weight = nn_param(gj_rand(dtype, 2, ws, -bound, bound));
    if (!l->weight)
        goto fail;
    if (bias && !(l->bias = nn_param(gj_rand(dtype, 1, bs, -bound, bound))))
        goto fail;
    l->in_features = in;
    l->out_features = out;
    return 0;
fail:
    nn_prefix_error("gj_linear_init");
    gj_linear_free(l);
    return -1;
}

gj_tensor *gj_linear_forward(gj_linear_layer *l, gj_tensor *x) {
    if (!l || !l->weight) {
        gj_rt_set_error("gj_linear_forward: layer is NULL or not initialised");
        return gj_fe_fail();
    }
    return gj_linear(x, l->weight, l->bias);
}

void gj_linear_free(gj_linear_layer *l) {
    if (!l)
        return;
    gj_release(l->weight);
    gj_release(l->bias);
    memset(l, 0, sizeof *l);
}

/* ------------------------------------------------------- LayerNorm */

int gj_layer_norm_init(gj_layer_norm_layer *l, int64_t features, double eps, gj_dtype dtype) {
    if (!l) {
        gj_rt_set_error("gj_layer_norm_init: layer is NULL");
        return -1;
    }
    memset(l, 0, sizeof *l);
    if (!nn_check_dims("gj_layer_norm_init", features, 1, dtype))
        return -1;
    if (!(eps >= 0.0) || isinf(eps)) {
        gj_rt_set_error("gj_layer_norm_init: eps must be finite and >= 0, got %g", eps);
        return -1;
    }
    int64_t s[1] = {features};
    if (!(l->weight = nn_param(gj_ones(dtype, 1, s))) ||
        !(l->bias = nn_param(gj_zeros(dtype, 1, s)))) {
        nn_prefix_error("gj_layer_norm_init");
        gj_layer_norm_free(l);
        return -1;
    }
    l->features = features;
    l->eps = eps;
    return 0;
}

gj_tensor *gj_layer_norm_forward(gj_layer_norm_layer *l, gj_tensor *x) {
    if (!l || !l->weight) {
        gj_rt_set_error("gj_layer_norm_forward: layer is NULL or not initialised");
        return gj_fe_fail();
    }
    return gj_layer_norm(x, l->weight, l->bias, l->eps);
}

void gj_layer_norm_free(gj_layer_norm_layer *l) {
    if (!l)
        return;
    gj_release(l->weight);
    gj_release(l->bias);
    memset(l, 0, sizeof *l);
}

/* ------------------------------------------------------- Embedding */

/* weight [num, dim] ~ N(0, 1), like torch.nn.Embedding. */
int gj_embedding_init(gj_embedding_layer *l, int64_t num, int64_t dim, gj_dtype dtype) {
    if (!l) {
        gj_rt_set_error("gj_embedding_init: layer is NULL");
        return -1;
    }
    memset(l, 0, sizeof *l);
    if (!nn_check_dims("gj_embedding_init", num, dim, dtype))
        return -1;
    int64_t s[2] = {num, dim};
    if (!(l->weight = nn_param(gj_randn(dtype, 2, s, 1.0)))) {
        nn_prefix_error("gj_embedding_init");
        return -1;
    }
    l->num = num;
    l->dim = dim;
    return 0;
}

gj_tensor *gj_embedding_forward(gj_embedding_layer *l, gj_tensor *idx) {
    if (!l || !l->weight) {
        gj_rt_set_error("gj_embedding_forward: layer is NULL or not initialised");
        return gj_fe_fail();
    }
    return gj_embedding(l->weight, idx);
}

void gj_embedding_free(gj_embedding_layer *l) {
    if (!l)
        return;
    gj_release(l->weight);
    memset(l, 0, sizeof *l);
}

/* ------------------------------------------------- names (state dicts) */

/* Adds "<prefix>.<field>" -> t. */
static int nn_add_named(gj_state_dict *sd, const char *op, const char *prefix, const char *field,
                        gj_tensor *t) {
    if (!prefix || !prefix[0]) {
        gj_rt_set_error("%s: prefix must be a non-empty string", op);
        return -1;
    }
    char name[512];
    if ((size_t)snprintf(name, sizeof name, "%s.%s", prefix, field) >= sizeof name) {
        gj_rt_set_error("%s: prefix \"%.100s...\" is too long", op, prefix);
        return -1;
    }
    if (!t->name && gj_tensor_set_name(t, name) != 0) return -1; /* the layer names it */
    return gj_state_dict_add(sd, name, t);
}

/* Adds "<prefix>.weight" and, when there is one, "<prefix>.bias" (the
 * three layer kinds: bias NULL for the embedding). */
static int nn_add_layer(gj_state_dict *sd, const char *op, const char *prefix, gj_tensor *weight,
                        gj_tensor *bias) {
    if (!weight || !sd) {
        gj_rt_set_error("%s: NULL or uninitialised layer, or NULL state dict", op);
        return -1;
    }
    if (nn_add_named(sd, op, prefix, "weight", weight) != 0)
        return -1;
    return bias ? nn_add_named(sd, op, prefix, "bias", bias) : 0;
}

int gj_linear_state_dict_add(gj_linear_layer *l, gj_state_dict *sd, const char *prefix) {
    return nn_add_layer(sd, "gj_linear_state_dict_add", prefix, l ? l->weight : NULL,
                        l ? l->bias : NULL);
}

int gj_layer_norm_state_dict_add(gj_layer_norm_layer *l, gj_state_dict *sd, const char *prefix) {
    return nn_add_layer(sd, "gj_layer_norm_state_dict_add", prefix, l ? l->weight : NULL,
                        l ? l->bias : NULL);
}

int gj_embedding_state_dict_add(gj_embedding_layer *l, gj_state_dict *sd, const char *prefix) {
    return nn_add_layer(sd, "gj_embedding_state_dict_add", prefix, l ? l->weight : NULL, NULL);
}
