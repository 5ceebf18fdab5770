/* SPDX-License-Identifier: MIT */
/*
 * optim_lion.c - Lion (Chen et al. 2023, "Symbolic Discovery of
 * Optimization Algorithms"), as its reference implementation updates,
 * written once for the eager step and the compiled step (ag.h, "optimizer
 * updates"):
 *     c = beta1 * m + (1 - beta1) * g
 *     p = p * (1 - lr * weight_decay) - lr * sign(c)
 *     m = beta2 * m + (1 - beta2) * g
 * sign(c) is 1, 0 or -1, and NaN where c is NaN. One state tensor
 * ("exp_avg"); every scalar is a run-time value.
 */
#include "ag.h"

#include <math.h>

enum { C_LR, C_WD, C_BETA1, C_BETA2 };
enum { H_LR, H_DECAY, H_B1, H_B1C, H_B2, H_B2C, N_H };

static uint32_t lion_structure(const double *cfg) {
    (void)cfg;
    return 0;
}

static bool lion_uses_state(uint32_t s, int k) {
    (void)s;
    return k == 0;
}

static void lion_hyper(const double *cfg, int64_t t, double *h) {
    (void)t;
    h[H_LR] = cfg[C_LR];
    h[H_DECAY] = 1.0 - cfg[C_LR] * cfg[C_WD];
    h[H_B1] = cfg[C_BETA1];
    h[H_B1C] = 1.0 - cfg[C_BETA1];
    h[H_B2] = cfg[C_BETA2];
    h[H_B2C] = 1.0 - cfg[C_BETA2];
}

#define BIN(P, x, y) gj_ag_binary(b, GJ_P_##P, (x), (y))

static int lion_update(gj_ag_builder *b, uint32_t s, gj_val *p, gj_val *g, gj_val *const *state,
                       gj_val *const *h, gj_val **p_new, gj_val **state_new) {
    (void)s;
    gj_val *m = state[0];
    gj_val *c = BIN(ADD, BIN(MUL, h[H_B1], m), BIN(MUL, h[H_B1C], g));
    gj_val *up = c ? gj_ag_unary(b, GJ_P_STEP, c) : NULL;                         /* c > 0 */
    gj_val *dn = c ? gj_ag_unary(b, GJ_P_STEP, gj_ag_unary(b, GJ_P_NEG, c)) : NULL; /* c < 0 */
    gj_val *sign = up && dn ? gj_ag_where(b, BIN(EQ, c, c), BIN(SUB, up, dn), c) : NULL;
    *p_new = sign ? BIN(SUB, BIN(MUL, p, h[H_DECAY]), BIN(MUL, h[H_LR], sign)) : NULL;
    state_new[0] = BIN(ADD, BIN(MUL, h[H_B2], m), BIN(MUL, h[H_B2C], g));
    return *p_new && state_new[0] ? 0 : -1;
}

const gj_ag_optdef gj_ag_opt_lion = {
    .name = "lion",
    .n_cfg = 4,
    .cfg_names = {"lr", "weight_decay", "beta1", "beta2"},
    .cfg_lo = {0.0, 0.0, 0.0, 0.0},
    .cfg_hi = {INFINITY, INFINITY, 1.0, 1.0},
    .cfg_hi_open = {true, true, true, true},
    .n_state = 1,
    .state_names = {"exp_avg"},
    .counts_steps = false,
    .n_hyper = N_H,
    .structure = lion_structure,
    .uses_state = lion_uses_state,
    .hyper = lion_hyper,
    .update = lion_update,
};
