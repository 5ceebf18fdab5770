/* SPDX-License-Identifier: MIT */
/*
 * test_step_check.c - the two tools a compiled step gives for C state the
 * library cannot see: the variant key (gj_step_run_variant), with which a
 * train flag in ctx picks its own program, and check mode (check_every,
 * GRADJIT_STEP_CHECK), which traces the step function again every N runs
 * and fails on the first difference from the program's trace. Each of the
 * four ways a ported training loop changes its graph through C state (a
 * dropout flag toggled for evaluation, a scalar in ctx, a tensor in ctx
 * replaced by a new one, a branch on a flag) is caught; a step whose C
 * state does not change passes every check with the eager step's bits.
 */
#include "step_model.h"

#include <stdlib.h>

/* ------------------------------------------------------- variant key */

static void train_eval(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    m->train = i % 3 != 2; /* two training steps, then an evaluation one */
}

static uint64_t train_key(const sm_script *sc, const sm_model *m, int i) {
    (void)sc, (void)i;
    return m->train ? 1 : 2;
}

static void test_variant_key(void **st) {
    (void)st;
    sm_model f = {0};
    sm_script sc = {.steps = 9, .batch = 4, .adamw = true, .before = train_eval,
                    .variant = train_key};
    gj_ca_stats s = sm_check("train and eval selected by the variant key", &sc, &f);
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles + s.disk_hits + s.instantiations, 2); /* one program per key */
    assert_int_equal(s.mem_hits, 7);
}

/* -------------------------------------------------------- check mode */

typedef enum change { C_NONE, C_TRAIN, C_SCALAR, C_TENSOR, C_BRANCH } change;

static gj_tensor *g_made[8]; /* tensors change_c_state made (released by the test) */
static int g_n_made;

/* Changes the C state the step function reads at step 3. */
static void change_c_state(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)in, (void)eager;
    change c = (change)(intptr_t)sc->user;
    if (i != 3) return;
    switch (c) {
    case C_TRAIN: m->train = false; break;
    case C_SCALAR: m->cscale = 0.5; break;
    case C_TENSOR: {
        gjt_rng r;
        gjt_rng_seed(&r, 12);
        gj_tensor *t = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){SM_HID}, 0.5, 1.5);
        gj_scope_keep(t);
        g_made[g_n_made++] = t;
        m->cmask = t; /* (the old one is the test's) */
        break;
    }
    case C_BRANCH: m->branch = true; break;
    default: break;
    }
}

/* Runs the four changes (and none) compiled with a check every run (or
 * every third run): the change is found at the first check after it. */
static void test_check_mode_catches_c_state(void **st) {
    (void)st;
    static const char *const names[] = {"nothing changes", "the train flag toggled",
                                        "a scalar in ctx", "a tensor in ctx replaced",
                                        "a branch on a flag"};
    for (int every = 1; every <= 3; every += 2) {
        for (int c = C_NONE; c <= C_BRANCH; c++) {
            gj_compiled_autograd_set_quiet(true);
            sm_model f = {0};
            f.train = true;
            f.cscale = 1.25;
            gjt_rng r;
            gjt_rng_seed(&r, 13);
            f.cmask = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){SM_HID}, 0.5, 1.5);
            sm_script sc = {.steps = 6, .batch = 4, .adamw = true, .check_every = every,
                            .before = change_c_state, .user = (void *)(intptr_t)c};
            sm_result e = sm_run(&sc, &f, true);
            sm_result k = sm_run(&sc, &f, false);
            if (c == C_NONE) {
                sm_same(names[c], &sc, &e, &k);
                assert_int_equal(k.stats.fallbacks, 0);
            } else {
                /* step 3 is the first run after the change; with every == 3
                 * the next check is at the sixth run (step 5) */
                int at = every == 1 ? 3 : 5;
                for (int i = 0; i < at; i++) assert_int_equal(k.rc[i], e.rc[i]);
                if (k.rc[at] != -1)
                    fail_msg("%s (check every %d): step %d not caught", names[c], every, at);
                if (!strstr(k.err[at], "check mode"))
                    fail_msg("%s: '%s'", names[c], k.err[at]);
                printf("%s: %s\n", names[c], k.err[at]);
            }
            sm_result_free(&e);
            sm_result_free(&k);
            gj_release(f.cmask);
            for (; g_n_made > 0; g_n_made--) gj_release(g_made[g_n_made - 1]);
        }
    }
}

/* GRADJIT_STEP_CHECK=N turns check mode on for steps made after it is set;
 * a value that is not a count is refused with a message (and ignored). */
static void test_check_env(void **st) {
    (void)st;
    assert_int_equal(setenv("GRADJIT_STEP_CHECK", "1", 1), 0);
    sm_model f = {0};
    f.cscale = 1.25;
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = change_c_state,
                    .user = (void *)(intptr_t)C_SCALAR};
    gj_compiled_autograd_set_quiet(true);
    sm_result k = sm_run(&sc, &f, false);
    assert_int_equal(k.rc[3], -1);
    assert_non_null(strstr(k.err[3], "check mode"));
    sm_result_free(&k);
    assert_int_equal(setenv("GRADJIT_STEP_CHECK", "often", 1), 0);
    sm_result k2 = sm_run(&sc, &f, false); /* (ignored: the change replays, unchecked) */
    assert_int_equal(k2.rc[3], 0);
    sm_result_free(&k2);
    unsetenv("GRADJIT_STEP_CHECK");
    gj_step_opts bad = {.check_every = -1};
    sm_model m;
    sm_init(&m, 1);
    gj_optim *o = gj_sgd_new(SM_NP, m.p, 0.1, 0.0, 0.0);
    assert_null(gj_step_new(sm_loss, &m, o, &bad));
    assert_non_null(strstr(gj_last_error(), "check_every"));
    gj_optim_free(o);
    sm_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_variant_key),
        cmocka_unit_test(test_check_mode_catches_c_state),
        cmocka_unit_test(test_check_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
