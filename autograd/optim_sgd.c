/* SPDX-License-Identifier: MIT */
/*
 * optim_sgd.c - SGD with momentum and weight decay, torch.optim.SGD's rule
 * (dampening 0, no Nesterov), written once for the eager step and the
 * compiled step (ag.h, "optimizer updates"):
 *     d = g + weight_decay * p          (when weight_decay != 0)
 *     m = momentum * m + d; d = m       (when momentum != 0; m starts at 0)
 *     p = p - lr * d
 * Momentum and weight decay being nonzero shape the graph (structure bits
 * 1 and 2); their values and lr are run-time scalars.
 */
#include "ag.h"

#include <math.h>

enum { S_MOMENTUM = 1u, S_WD = 2u };
enum { C_LR, C_WD, C_MOMENTUM };
enum { H_LR, H_MOMENTUM, H_WD, N_H };

static uint32_t sgd_structure(const double *cfg) {
    return (cfg[C_MOMENTUM] != 0.0 ? S_MOMENTUM : 0u) | (cfg[C_WD] != 0.0 ? S_WD : 0u);
}

static bool sgd_uses_state(uint32_t s, int k) { return k == 0 && (s & S_MOMENTUM); }

static void sgd_hyper(const double *cfg, int64_t t, double *h) {
    (void)t;
    h[H_LR] = cfg[C_LR];
    h[H_MOMENTUM] = cfg[C_MOMENTUM];
    h[H_WD] = cfg[C_WD];
}

#define BIN(P, x, y) gj_ag_binary(b, GJ_P_##P, (x), (y))

static int sgd_update(gj_ag_builder *b, uint32_t s, gj_val *p, gj_val *g, gj_val *const *state,
                      gj_val *const *h, gj_val **p_new, gj_val **state_new) {
    gj_val *d = g;
    if (s & S_WD) d = BIN(ADD, d, BIN(MUL, h[H_WD], p));
    if (s & S_MOMENTUM) {
        d = d ? BIN(ADD, BIN(MUL, h[H_MOMENTUM], state[0]), d) : NULL;
        state_new[0] = d;
    }
    *p_new = d ? BIN(SUB, p, BIN(MUL, h[H_LR], d)) : NULL;
    return *p_new ? 0 : -1;
}

const gj_ag_optdef gj_ag_opt_sgd = {
    .name = "sgd",
    .n_cfg = 3,
    .cfg_names = {"lr", "weight_decay", "momentum"},
    .cfg_lo = {0.0, 0.0, 0.0},
    .cfg_hi = {INFINITY, INFINITY, INFINITY},
    .cfg_hi_open = {true, true, true},
    .n_state = 1,
    .state_names = {"momentum_buffer"},
    .counts_steps = false,
    .n_hyper = N_H,
    .structure = sgd_structure,
    .uses_state = sgd_uses_state,
    .hyper = sgd_hyper,
    .update = sgd_update,
};
