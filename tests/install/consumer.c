/* SPDX-License-Identifier: MIT */
/* consumer.c - a user's program built against an installed gradjit (through
 * find_package and through pkg-config) by tests/install/run.sh. */
#include <gradjit.h>
#include <math.h>
#include <stdio.h>

int main(void) {
    int64_t shape[2] = {2, 3};
    gj_tensor *x = gj_ones(GJ_F32, 2, shape);
    gj_set_requires_grad(x, true);
    gj_tensor *y = gj_sum(gj_tanh(x), 0, NULL, false);
    if (!y || gj_backward(y, NULL) != 0) {
        fprintf(stderr, "consumer: %s\n", gj_last_error());
        return 1;
    }
    double g = gj_tensor_item_at(gj_tensor_grad(x), 0), x0 = gj_tensor_item_at(x, 0);
    gj_release(y);
    gj_release(x);
    /* d tanh(1) = 1 - tanh(1)^2 = 0.419974..., computed here with libm: a
     * program that calls libm itself links with what gradjit's pkg-config
     * file and CMake targets give, no -lm of its own */
    double want = 1.0 - tanh(x0) * tanh(x0);
    if (!(fabs(g - want) < 1e-6)) {
        fprintf(stderr, "consumer: wrong gradient %.7f (want %.7f)\n", g, want);
        return 1;
    }
    printf("consumer ok\n");
    return 0;
}
