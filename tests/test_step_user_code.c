/* SPDX-License-Identifier: MIT */
/*
 * test_step_user_code.c - user code inside the compiled training step:
 * tensor hooks on parameters and on other leaves, post-accumulate hooks on
 * parameters (reading, scaling in place, replacing .grad), hooks added and
 * removed between steps, a hook that fails, what a program cannot follow
 * (record_stream, set_ during the backward, a post hook on a leaf outside
 * the optimizer), and custom ops the step function calls (their forward
 * and backward C functions, one failing), and hooks and a custom op under a memory
 * budget. Every case runs the same script eagerly and
 * compiled (step_model.h) and compares everything a step leaves, bit for
 * bit, and the hooks' calls; the compiled run's counters say which steps
 * ran as programs and why the others did not.
 */
#include "step_model.h"

/* ------------------------------------------------------------ the hooks */

static int64_t g_calls[8];    /* per hook: calls in this run */
static double g_seen[8];      /* per hook: the sum of what it saw */
static int g_step;            /* the step the script is at */
static int g_fail_step = -1;  /* the failing hook fails at this step */

static double sum_of(const gj_tensor *t) {
    int64_t n = gj_tensor_numel(t);
    double *v = malloc((size_t)n * sizeof *v), s = 0;
    assert_non_null(v);
    assert_int_equal(gj_tensor_to_f64(t, v), 0);
    for (int64_t i = 0; i < n; i++) s += v[i];
    free(v);
    return s;
}

static gj_tensor *halve(gj_tensor *g, void *u) {
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    g_seen[k] += sum_of(g);
    return gj_mul_scalar(g, 0.5);
}

static gj_tensor *watch(gj_tensor *g, void *u) {
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    g_seen[k] += sum_of(g);
    return NULL; /* keep it */
}

static gj_tensor *fail_at(gj_tensor *g, void *u) {
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    if (g_step == g_fail_step) /* an op of the hook fails (a shape that cannot be) */
        (void)gj_reshape(g, 1, (int64_t[]){1000003});
    return NULL;
}

static void post_scale(gj_tensor *leaf, void *u) { /* in place */
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    gj_tensor *g = gj_tensor_grad(leaf);
    g_seen[k] += sum_of(g);
    gj_mul_scalar_(g, 0.25);
}

static void post_replace(gj_tensor *leaf, void *u) { /* a new .grad */
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    gj_scope_push();
    gj_tensor_set_grad(leaf, gj_add_scalar(gj_tensor_grad(leaf), 0.125));
    gj_scope_pop();
}

static void post_read(gj_tensor *leaf, void *u) {
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    g_seen[k] += sum_of(gj_tensor_grad(leaf));
}

/* DeepSpeed's bucketing pattern: .grad copied into a flat bucket that is
 * then marked in use by a communication stream. */
static gj_tensor *g_bucket;
static gj_stream *g_stream;
static void post_bucket(gj_tensor *leaf, void *u) {
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    gj_tensor *g = gj_tensor_grad(leaf);
    int64_t n = gj_tensor_numel(g);
    memcpy(gj_tensor_data(g_bucket), gj_tensor_data(g), (size_t)n * sizeof(float));
    gj_tensor_record_stream(g_bucket, g_stream);
}

/* set_ of the parameter itself to a copy (another storage) */
static void post_set(gj_tensor *leaf, void *u) {
    int k = (int)(intptr_t)u;
    g_calls[k]++;
    gj_scope_push();
    gj_no_grad_push();
    gj_tensor *c = gj_contiguous(gj_mul_scalar(leaf, 1.0));
    assert_int_equal(gj_tensor_set_(leaf, c), 0);
    gj_no_grad_pop();
    gj_scope_pop();
}

static void reset_hooks(void) {
    memset(g_calls, 0, sizeof g_calls);
    memset(g_seen, 0, sizeof g_seen);
}

/* Calls the compiled run makes beyond eager's, per hook (a run stopped by
 * a failure is run again eagerly: the user code before it runs twice). */
static int64_t g_extra[8];
static gj_step_memory g_mem; /* the last compiled run's program */

/* Runs sc both ways from fresh hooks' records; the records must agree. */
static gj_ca_stats check_both(const char *what, sm_script *sc, const sm_model *flags) {
    int64_t calls[2][8];
    double seen[2][8];
    gj_compiled_autograd_set_quiet(true);
    sm_result r[2];
    for (int mode = 0; mode < 2; mode++) {
        reset_hooks();
        r[mode] = sm_run(sc, flags, mode == 0);
        memcpy(calls[mode], g_calls, sizeof g_calls);
        memcpy(seen[mode], g_seen, sizeof g_seen);
    }
    sm_same(what, sc, &r[0], &r[1]);
    for (int k = 0; k < 8; k++) {
        if (calls[0][k] + g_extra[k] != calls[1][k])
            fail_msg("%s: hook %d called %lld times eager, %lld compiled", what, k,
                     (long long)calls[0][k], (long long)calls[1][k]);
        if (!g_extra[k] && memcmp(&seen[0][k], &seen[1][k], sizeof seen[0][k]) != 0)
            fail_msg("%s: hook %d saw %.17g eager, %.17g compiled", what, k, seen[0][k],
                     seen[1][k]);
    }
    gj_ca_stats s = r[1].stats;
    g_mem = r[1].mem;
    sm_result_free(&r[0]);
    sm_result_free(&r[1]);
    return s;
}

static int64_t programs(const gj_ca_stats *s) {
    return s->compiles + s->mem_hits + s->disk_hits + s->instantiations;
}

/* ------------------------------------------------------------- the cases */

static void tensor_hooks(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    g_step = i;
    if (i == 0) {
        assert_true(gj_register_hook(m->p[0], halve, (void *)0) > 0);
        assert_true(gj_register_hook(m->p[2], watch, (void *)1) > 0);
        assert_true(gj_register_hook(m->p[2], halve, (void *)2) > 0); /* after the watch */
    }
}

/* Tensor hooks on parameters: the program calls them where the engine
 * does, with the same gradients, and uses what they return. */
static void test_tensor_hooks_on_parameters(void **st) {
    (void)st;
    for (int keep = 0; keep < 2; keep++) {
        sm_script sc = {.steps = 6, .batch = 5, .adamw = true, .keep_grads = keep,
                        .before = tensor_hooks};
        gj_ca_stats s = check_both("tensor hooks on parameters", &sc, &(sm_model){0});
        assert_int_equal(s.fallbacks, 0);
        assert_int_equal(programs(&s), 6);
        assert_int_equal(g_calls[0], 6);
        assert_int_equal(g_calls[1], 6);
    }
}

static void post_hooks(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    g_step = i;
    if (i == 0) {
        assert_true(gj_register_post_accumulate_grad_hook(m->p[1], post_scale, (void *)0) > 0);
        assert_true(gj_register_post_accumulate_grad_hook(m->p[3], post_replace, (void *)1) > 0);
        assert_true(gj_register_post_accumulate_grad_hook(m->p[0], post_read, (void *)2) > 0);
        assert_true(gj_register_post_accumulate_grad_hook(m->p[0], post_scale, (void *)3) > 0);
        assert_true(gj_register_hook(m->p[0], halve, (void *)4) > 0); /* before the post hooks */
    }
}

/* Post-accumulate hooks on parameters: each sees its .grad set to the
 * gradient where eager writes it; what they leave in .grad (scaled in
 * place, replaced) is what the update uses; with clipping too. */
static void test_post_hooks_on_parameters(void **st) {
    (void)st;
    for (int variant = 0; variant < 3; variant++) {
        sm_script sc = {.steps = 6, .batch = 5, .adamw = variant != 1, .keep_grads = variant == 1,
                        .clip = variant == 2 ? 0.05 : 0.0, .before = post_hooks};
        gj_ca_stats s = check_both("post-accumulate hooks on parameters", &sc, &(sm_model){0});
        assert_int_equal(s.fallbacks, 0);
        assert_int_equal(programs(&s), 6);
        for (int k = 0; k < 5; k++) assert_int_equal(g_calls[k], 6);
    }
}

static gj_tensor *g_x_leaf;
static void leaf_hooks(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)m, (void)eager;
    sm_script *w = (sm_script *)sc;
    g_step = i;
    assert_int_equal(gj_set_requires_grad(in[0], true), 0);
    assert_true(gj_register_hook(in[0], halve, (void *)0) > 0); /* a new input every step */
    w->watch[0] = in[0];
    g_x_leaf = in[0];
}

/* A tensor hook on a leaf outside the optimizer (an input that requires
 * grad): its .grad is what the hook returns, as eager's. */
static void test_hook_on_an_input_leaf(void **st) {
    (void)st;
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = leaf_hooks};
    gj_ca_stats s = check_both("a tensor hook on an input leaf", &sc, &(sm_model){0});
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(programs(&s), 5);
    assert_int_equal(g_calls[0], 5);
}

static void post_on_input(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)m, (void)eager;
    sm_script *w = (sm_script *)sc;
    g_step = i;
    assert_int_equal(gj_set_requires_grad(in[0], true), 0);
    assert_true(gj_register_post_accumulate_grad_hook(in[0], post_read, (void *)0) > 0);
    w->watch[0] = in[0];
}

/* A post-accumulate hook on a leaf outside the optimizer: that step runs
 * eagerly (hook_guard), with eager's results. */
static void test_post_hook_on_an_input_leaf(void **st) {
    (void)st;
    sm_script sc = {.steps = 4, .batch = 4, .adamw = true, .before = post_on_input};
    gj_ca_stats s = check_both("a post hook on an input leaf", &sc, &(sm_model){0});
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 4);
    assert_true(strstr(gj_compiled_autograd_last_fallback(),
                       "a post-accumulate hook on a leaf outside the optimizer") != NULL);
}

static int64_t g_handle;
static void hooks_come_and_go(const sm_script *sc, sm_model *m, int i, gj_tensor **in,
                              bool eager) {
    (void)sc, (void)in, (void)eager;
    g_step = i;
    if (i == 2) g_handle = gj_register_post_accumulate_grad_hook(m->p[2], post_scale, (void *)0);
    if (i == 4) assert_int_equal(gj_remove_hook(g_handle), 0);
    if (i == 5) g_handle = gj_register_hook(m->p[2], halve, (void *)1);
    if (i == 6) assert_int_equal(gj_remove_hook(g_handle), 0);
}

/* Hooks registered and removed between steps: each configuration is a
 * variant of its own (the guards see the parameters' hooks), none runs
 * eagerly. */
static void test_hooks_between_steps(void **st) {
    (void)st;
    sm_script sc = {.steps = 8, .batch = 4, .adamw = true, .before = hooks_come_and_go};
    gj_ca_stats s = check_both("hooks between steps", &sc, &(sm_model){0});
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(programs(&s), 8);
    assert_int_equal(g_calls[0], 2);
    assert_int_equal(g_calls[1], 1);
}

static void failing_hook(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    g_step = i;
    if (i == 0) assert_true(gj_register_hook(m->p[2], fail_at, (void *)0) > 0);
}

/* A hook that fails at step 3: both modes fail that step with the hook's
 * error and update nothing; the program's failure is transient (it ran
 * the step again eagerly to fail as eager does), the later steps run
 * compiled again. */
static void test_a_failing_hook(void **st) {
    (void)st;
    g_fail_step = 3;
    sm_script sc = {.steps = 6, .batch = 4, .adamw = true, .before = failing_hook};
    gj_compiled_autograd_set_quiet(true);
    sm_result r[2];
    int64_t calls[2];
    for (int mode = 0; mode < 2; mode++) {
        reset_hooks();
        r[mode] = sm_run(&sc, &(sm_model){0}, mode == 0);
        calls[mode] = g_calls[0];
    }
    assert_int_equal(calls[1], calls[0] + 1); /* the failing call twice: program, then eager */
    for (int mode = 0; mode < 2; mode++) { /* the same error but for the hook's number */
        assert_int_equal(r[mode].rc[3], -1);
        assert_true(strstr(r[mode].err[3], "with an error set inside it") != NULL);
        assert_true(strstr(r[mode].err[3], "gj_reshape: cannot reshape") != NULL);
    }
    snprintf(r[1].err[3], sizeof r[1].err[3], "%s", r[0].err[3]);
    sm_same("a failing hook", &sc, &r[0], &r[1]);
    assert_int_equal(r[1].stats.fallbacks, 1);
    assert_int_equal(r[1].stats.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 1);
    assert_int_equal(programs(&r[1].stats), 5);
    sm_result_free(&r[0]);
    sm_result_free(&r[1]);
    g_fail_step = -1;
}

static void bucketing(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    g_step = i;
    if (i == 0)
        for (int k = 0; k < SM_NP; k++)
            assert_true(gj_register_post_accumulate_grad_hook(m->p[k], post_bucket,
                                                              (void *)(intptr_t)k) > 0);
}

/* DeepSpeed's pattern written by a user (copy .grad into a bucket,
 * record_stream): the step traces and compiles once, sees record_stream
 * during its backward and runs eagerly from then on (record_stream), with
 * eager's results. */
static void test_record_stream_in_a_hook(void **st) {
    (void)st;
    int64_t n = SM_HID * SM_IN;
    g_bucket = gj_zeros(GJ_F32, 1, &n);
    g_stream = gj_stream_new();
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = bucketing};
    gj_ca_stats s = check_both("record_stream in a post hook", &sc, &(sm_model){0});
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_RECORD_STREAM], 4);
    assert_int_equal(s.fallbacks, 4);
    assert_int_equal(s.backwards, 5);
    assert_true(strstr(gj_compiled_autograd_last_fallback(), "record_stream") != NULL);
    gj_stream_free(g_stream);
    gj_release(g_bucket);
}

static void setting(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)in, (void)eager;
    g_step = i;
    if (i == 1) assert_true(gj_register_post_accumulate_grad_hook(m->p[3], post_set, (void *)0) > 0);
}

/* A post hook that set_s its parameter to other storage: from the step it
 * appears in, the step runs eagerly (set_mismatch), with eager's results. */
static void test_set_in_a_hook(void **st) {
    (void)st;
    sm_script sc = {.steps = 5, .batch = 4, .adamw = true, .before = setting};
    gj_ca_stats s = check_both("set_ in a post hook", &sc, &(sm_model){0});
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_SET_MISMATCH], 3);
    assert_int_equal(programs(&s), 2); /* step 0, and step 1 that traced */
    assert_int_equal(g_calls[0], 4);
}

/* ---------------------------------------------------------- custom ops */

/* xtanh(x, alpha) = alpha * x * tanh(x); its backward fails at g_fail_step
 * (its forward at g_fail_step + 100). */
static int ss_fwd(gj_tensor *x, double alpha, gj_tensor **out) {
    g_calls[5]++;
    if (g_step == g_fail_step + 100) return 7;
    *out = gj_mul_scalar(gj_mul(x, gj_tanh(x)), alpha);
    return *out ? 0 : 1;
}

static int ss_bwd(gj_tensor *g, gj_tensor *x, double alpha, gj_tensor **gx) {
    g_calls[6]++;
    if (g_step == g_fail_step) return 9;
    gj_tensor *t = gj_tanh(x); /* (x tanh x)' = tanh x + x (1 - tanh^2 x) */
    gj_tensor *d = gj_add(t, gj_mul(x, gj_add_scalar(gj_neg(gj_mul(t, t)), 1.0)));
    *gx = gj_mul_scalar(gj_mul(g, d), alpha);
    return *gx ? 0 : 1;
}

static gj_custom_op *softsign_op(void) {
    static gj_custom_op *op;
    if (!op) op = gj_custom_op_define("steptest::xtanh(Tensor x, float alpha) -> Tensor",
                                      (void *)ss_fwd, (void *)ss_bwd);
    assert_non_null(op);
    return op;
}

static void count_steps(const sm_script *sc, sm_model *m, int i, gj_tensor **in, bool eager) {
    (void)sc, (void)m, (void)in, (void)eager;
    g_step = i;
}

/* A custom op in the step function: the program calls its forward and
 * backward C functions (on copies) where eager does, every run. */
static void test_custom_op_in_the_step(void **st) {
    (void)st;
    sm_model flags = {.custom = softsign_op()};
    for (int variant = 0; variant < 2; variant++) {
        sm_script sc = {.steps = 6, .batch = 5, .adamw = variant == 0, .keep_grads = variant == 1,
                        .before = count_steps};
        gj_ca_stats s = check_both("a custom op in the step", &sc, &flags);
        assert_int_equal(s.fallbacks, 0);
        assert_int_equal(programs(&s), 6);
        assert_int_equal(g_calls[5], 6);
        assert_int_equal(g_calls[6], 6);
    }
}

/* Its backward fails at step 2, its forward at step 4: both modes fail
 * those steps with the same error and update nothing; each failure is
 * transient (the next step runs compiled). */
static void test_custom_op_that_fails(void **st) {
    (void)st;
    g_fail_step = 2; /* forward: step 102 never comes; then 4 via the loop below */
    sm_model flags = {.custom = softsign_op()};
    sm_script sc = {.steps = 6, .batch = 4, .adamw = true, .before = count_steps};
    g_extra[5] = g_extra[6] = 1; /* the program's forward and failing backward, then eager's */
    gj_ca_stats s = check_both("a custom op whose backward fails", &sc, &flags);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 1);
    assert_int_equal(programs(&s), 5);
    g_fail_step = -96; /* the forward fails at step 4 */
    g_extra[6] = 0;    /* (the failing forward twice; no backward that step) */
    s = check_both("a custom op whose forward fails", &sc, &flags);
    assert_int_equal(s.fallbacks_by_reason[GJ_CA_HOOK_GUARD], 1);
    assert_int_equal(programs(&s), 5);
    g_fail_step = -1;
    g_extra[5] = 0;
}

/* Hooks and a custom op under a memory budget just below the unbudgeted
 * program's planned peak (this small MLP's budgeted plans reach little
 * lower): the first step (traced, then finished by the eager backward,
 * whose effects the trace checks when the program calls user code) and the
 * programs after it, recomputing forward values under the budget, equal
 * eager bit for bit and call the user code as often. */
static void test_user_code_under_a_budget(void **st) {
    (void)st;
    sm_model plain = {0}, custom = {.custom = softsign_op()};
    void (*before[3])(const sm_script *, sm_model *, int, gj_tensor **, bool) = {
        tensor_hooks, post_hooks, count_steps};
    const sm_model *flags[3] = {&plain, &plain, &custom};
    for (int c = 0; c < 3; c++) {
        sm_script sc = {.steps = 5, .batch = 64, .adamw = true, .before = before[c]};
        (void)check_both("user code, no budget", &sc, flags[c]);
        gj_step_memory m0 = g_mem;
        assert_true(m0.planned_peak_bytes > 0 && m0.saved_bytes > 0);
        sc.mem_budget = (size_t)(m0.planned_peak_bytes - 1);
        gj_ca_stats s = check_both("user code under a budget", &sc, flags[c]);
        print_message("  case %d: peak %lld bytes, %lld kept; budget %zu: peak %lld, %lld "
                      "values recomputed\n",
                      c, (long long)m0.planned_peak_bytes, (long long)m0.saved_bytes,
                      sc.mem_budget, (long long)g_mem.planned_peak_bytes,
                      (long long)g_mem.recomputed_values);
        assert_int_equal(s.fallbacks, 0);
        assert_int_equal(programs(&s), 5);
        assert_int_equal(g_mem.budget_bytes, (int64_t)sc.mem_budget);
        assert_true(g_mem.planned_peak_bytes <= (int64_t)sc.mem_budget);
        assert_true(g_mem.recomputed_values > 0);
    }
}

int main(void) {
    gjt_setup();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tensor_hooks_on_parameters),
        cmocka_unit_test(test_post_hooks_on_parameters),
        cmocka_unit_test(test_hook_on_an_input_leaf),
        cmocka_unit_test(test_post_hook_on_an_input_leaf),
        cmocka_unit_test(test_hooks_between_steps),
        cmocka_unit_test(test_a_failing_hook),
        cmocka_unit_test(test_record_stream_in_a_hook),
        cmocka_unit_test(test_set_in_a_hook),
        cmocka_unit_test(test_custom_op_in_the_step),
        cmocka_unit_test(test_custom_op_that_fails),
        cmocka_unit_test(test_user_code_under_a_budget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
