/* SPDX-License-Identifier: MIT */
/*
 * optim_adamw.c - AdamW, torch.optim.AdamW's rule (no amsgrad, not
 * maximize), written once for the eager step and the compiled step (ag.h,
 * "optimizer updates"). At the parameter's t-th update:
 *     p = p * (1 - lr * weight_decay)
 *     m = m + (1 - beta1) * (g - m)               (torch's lerp)
 *     v = v * beta2 + (1 - beta2) * g * g
 *     p = p - lr / (1 - beta1^t) * (m / (sqrt(v) / sqrt(1 - beta2^t) + eps))
 * Every scalar is a run-time value (the bias corrections follow t); the
 * graph has no structure bits.
 */
#include "ag.h"

#include <math.h>

enum { C_LR, C_WD, C_BETA1, C_BETA2, C_EPS };
enum { H_DECAY, H_B1C, H_B2, H_B2C, H_EPS, H_STEP_SIZE, H_BC2_SQRT, N_H };

static uint32_t adamw_structure(const double *cfg) {
    (void)cfg;
    return 0;
}

static bool adamw_uses_state(uint32_t s, int k) {
    (void)s;
    return k < 2;
}

static void adamw_hyper(const double *cfg, int64_t t, double *h) {
    double lr = cfg[C_LR], b1 = cfg[C_BETA1], b2 = cfg[C_BETA2];
    h[H_DECAY] = 1.0 - lr * cfg[C_WD];
    h[H_B1C] = 1.0 - b1;
    h[H_B2] = b2;
    h[H_B2C] = 1.0 - b2;
    h[H_EPS] = cfg[C_EPS];
    h[H_STEP_SIZE] = lr / (1.0 - pow(b1, (double)t));
    h[H_BC2_SQRT] = sqrt(1.0 - pow(b2, (double)t));
}

#define BIN(P, x, y) gj_ag_binary(b, GJ_P_##P, (x), (y))

static int adamw_update(gj_ag_builder *b, uint32_t s, gj_val *p, gj_val *g,
                        gj_val *const *state, gj_val *const *h, gj_val **p_new,
                        gj_val **state_new) {
    (void)s;
    gj_val *m = state[0], *v = state[1];
    gj_val *pk = BIN(MUL, p, h[H_DECAY]);
    gj_val *m1 = BIN(ADD, m, BIN(MUL, h[H_B1C], BIN(SUB, g, m)));
    gj_val *v1 = BIN(ADD, BIN(MUL, v, h[H_B2]), BIN(MUL, BIN(MUL, h[H_B2C], g), g));
    gj_val *denom = v1 ? BIN(ADD, BIN(DIV, gj_ag_unary(b, GJ_P_SQRT, v1), h[H_BC2_SQRT]), h[H_EPS])
                       : NULL;
    *p_new = pk && m1 && denom ? BIN(SUB, pk, BIN(MUL, h[H_STEP_SIZE], BIN(DIV, m1, denom)))
                               : NULL;
    state_new[0] = m1;
    state_new[1] = v1;
    return *p_new ? 0 : -1;
}

const gj_ag_optdef gj_ag_opt_adamw = {
    .name = "adamw",
    .n_cfg = 5,
    .cfg_names = {"lr", "weight_decay", "beta1", "beta2", "eps"},
    .cfg_lo = {0.0, 0.0, 0.0, 0.0, 0.0},
    .cfg_hi = {INFINITY, INFINITY, 1.0, 1.0, INFINITY},
    .cfg_hi_open = {true, true, true, true, true},
    .n_state = 2,
    .state_names = {"exp_avg", "exp_avg_sq"},
    .counts_steps = true,
    .n_hyper = N_H,
    .structure = adamw_structure,
    .uses_state = adamw_uses_state,
    .hyper = adamw_hyper,
    .update = adamw_update,
};
