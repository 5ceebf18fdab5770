/* SPDX-License-Identifier: MIT */
/*
 * test_jit_key.c - the structural key of a backward across processes.
 *
 * The same model (a small pre-norm transformer block with an embedding,
 * dropout and a cross-entropy head: most op kinds) is built in two
 * separately exec'ed processes of this test binary (GJT_KEY_CHILD=variant
 * in the environment makes main() print the key text and exit): both print
 * the identical key, which is also the key this process computes while
 * allocating junk (tensors, and autograd nodes of an unrelated graph)
 * between every two ops, so neither allocation order, creation counters
 * nor address-space layout (ASLR: the children are exec'ed, not forked)
 * enters the key. The key changes when any one shape, dtype or attribute
 * changes, and it never contains a pointer-looking value.
 */
#include "gjtest.h"

#include "jit/jit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { B = 2, T = 5, C = 8, H = 2, V = 11 };

typedef struct variant {
    int64_t batch;  /* B */
    gj_dtype dt;    /* parameters' dtype */
    double eps;     /* layer norm eps (an attribute) */
    double p_drop;  /* dropout probability (an attribute) */
    bool junk;      /* allocate junk between ops */
} variant;

static variant variant_named(const char *name) {
    variant v = {B, GJ_F32, 1e-5, 0.1, false};
    if (strcmp(name, "junk") == 0) v.junk = true;
    else if (strcmp(name, "shape") == 0) v.batch = B + 1;
    else if (strcmp(name, "dtype") == 0) v.dt = GJ_F64;
    else if (strcmp(name, "eps") == 0) v.eps = 1e-6;
    else if (strcmp(name, "dropout") == 0) v.p_drop = 0.2;
    return v;
}

typedef struct junk {
    gj_tensor *t[64];
    int n;
} junk;

/* Allocates a few tensors of odd sizes and an unrelated autograd graph. */
static void make_junk(junk *j, gjt_rng *r) {
    for (int k = 0; k < 3 && j->n + 2 <= 64; k++) {
        int64_t n = 1 + gjt_rng_int(r, 5000);
        gj_tensor *a = gj_scope_keep(gj_randn(GJ_F32, 1, &n, 1.0));
        assert_non_null(a);
        assert_int_equal(gj_set_requires_grad(a, true), 0);
        gj_tensor *b = gj_scope_keep(gj_tanh(a)); /* a node outside the model's graph */
        assert_non_null(b);
        j->t[j->n++] = a;
        j->t[j->n++] = b;
    }
}

static void junk_free(junk *j) {
    for (int k = 0; k < j->n; k++) gj_release(j->t[k]);
    j->n = 0;
}

#define STEP(expr) (v.junk ? (make_junk(&jk, &jr), (expr)) : (expr))

/* The key text of the model of variant v (gj_rt_malloc'd). */
static char *model_key(variant v) {
    gjt_rng r, jr;
    gjt_rng_seed(&r, 2024);
    gjt_rng_seed(&jr, 99);
    junk jk = {.n = 0};
    gj_dtype dt = v.dt;
    gj_tensor *p[12];
    const int64_t shp[12][2] = {{V, C}, {C, 0}, {C, 0}, {3 * C, C}, {3 * C, 0}, {C, C},
                                {C, 0}, {4 * C, C}, {4 * C, 0}, {C, 4 * C}, {C, 0}, {V, C}};
    for (int i = 0; i < 12; i++) {
        int nd = shp[i][1] ? 2 : 1;
        p[i] = gjt_uniform(&r, dt, nd, shp[i], -0.3, 0.3);
        assert_non_null(p[i]);
        assert_int_equal(gj_set_requires_grad(p[i], true), 0);
        if (v.junk) make_junk(&jk, &jr);
    }
    int64_t bt[2] = {v.batch, T}, n = v.batch * T;
    int64_t tok[64], lab[64];
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (i * 7) % V;
        lab[i] = (i * 3) % V;
    }
    gj_tensor *idx = gjt_i64(2, bt, tok), *labels = gjt_i64(1, &n, lab);
    gj_scope_push();
    gj_manual_seed(1);
    gj_tensor *x = STEP(gj_embedding(p[0], idx)); /* [B, T, C] */
    gj_tensor *h = STEP(gj_layer_norm(x, p[1], p[2], v.eps));
    gj_tensor *qkv = STEP(gj_linear(h, p[3], p[4]));
    gj_tensor *hd[3];
    for (int k = 0; k < 3; k++) {
        gj_tensor *t = STEP(gj_narrow(qkv, 2, k * C, C));
        t = STEP(gj_reshape(t, 4, (int64_t[]){v.batch, T, H, C / H}));
        hd[k] = STEP(gj_permute(t, (int[]){0, 2, 1, 3}));
    }
    gj_tensor *att = STEP(gj_mul_scalar(gj_matmul(hd[0], gj_transpose(hd[1], 2, 3)), 0.5));
    att = STEP(gj_dropout(gj_softmax(att, -1), v.p_drop, true));
    gj_tensor *o = STEP(gj_permute(gj_matmul(att, hd[2]), (int[]){0, 2, 1, 3}));
    o = STEP(gj_reshape(o, 3, (int64_t[]){v.batch, T, C}));
    gj_tensor *y = STEP(gj_add(x, gj_linear(o, p[5], p[6])));
    gj_tensor *f = STEP(gj_linear(gj_gelu(gj_linear(y, p[7], p[8])), p[9], p[10]));
    gj_tensor *logits = STEP(gj_reshape(gj_linear(gj_add(y, f), p[11], NULL), 2, (int64_t[]){n, V}));
    gj_tensor *loss = STEP(gj_cross_entropy(logits, labels));
    assert_non_null(loss);
    char *key = gj_jit_key_string(1, &loss, NULL);
    assert_non_null(key);
    gj_scope_pop();
    junk_free(&jk);
    for (int i = 0; i < 12; i++) gj_release(p[i]);
    gj_release(idx);
    gj_release(labels);
    return key;
}

/* ------------------------------------------------------------ children */

static char g_self[4096];

/* Runs this binary with GJT_KEY_CHILD=variant and returns what it printed
 * (malloc'd). */
static char *child_key(const char *variant_name) {
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fd[0]);
        if (dup2(fd[1], STDOUT_FILENO) < 0) _exit(126);
        close(fd[1]);
        setenv("GJT_KEY_CHILD", variant_name, 1);
        char *argv[] = {g_self, NULL};
        execv(g_self, argv);
        _exit(127);
    }
    close(fd[1]);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (len + 4096 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t k = read(fd[0], buf + len, cap - len - 1);
        if (k <= 0) break;
        len += (size_t)k;
    }
    buf[len] = '\0';
    close(fd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    return buf;
}

/* The child's output is "<address of a stack variable>\n<key text>". */
static const char *key_part(const char *out) {
    const char *nl = strchr(out, '\n');
    assert_non_null(nl);
    return nl + 1;
}

static int child_main(const char *name) {
    int local = 0; /* a stack address: randomised by ASLR (heap addresses are not,
                      under sanitizer allocators) */
    printf("%p\n", (void *)&local);
    char *k = model_key(variant_named(name));
    fputs(k, stdout);
    gj_rt_free(k);
    return fflush(stdout) == 0 ? 0 : 1;
}

/* ------------------------------------------------------------ the tests */

/* Two exec'ed processes and this one (with junk) agree on the key. */
static void test_key_across_processes(void **st) {
    (void)st;
    char *a = child_key("base");
    char *b = child_key("base");
    assert_string_equal(key_part(a), key_part(b));
    char *mine = model_key(variant_named("junk"));
    assert_string_equal(key_part(a), mine);
    char *plain = model_key(variant_named("base"));
    assert_string_equal(plain, mine);
    /* under ASLR the two children's stacks were at different addresses */
    FILE *f = fopen("/proc/sys/kernel/randomize_va_space", "r");
    int aslr = 0;
    if (f) {
        if (fscanf(f, "%d", &aslr) != 1) aslr = 0;
        fclose(f);
    }
    size_t la = (size_t)(strchr(a, '\n') - a), lb = (size_t)(strchr(b, '\n') - b);
    bool same_addr = la == lb && memcmp(a, b, la) == 0;
    print_message("ASLR %d: children's stack addresses %s\n", aslr, same_addr ? "equal" : "differ");
    if (aslr >= 2) assert_false(same_addr);
    /* no address of either child appears in its key */
    char addr[64];
    snprintf(addr, sizeof addr, "%.*s", (int)la, a);
    assert_null(strstr(key_part(a), addr));
    free(a);
    free(b);
    gj_rt_free(mine);
    gj_rt_free(plain);
}

/* Changing one shape, one dtype or one attribute changes the key (and its
 * hash, checked through the compiled path's two programs). */
static void test_key_changes(void **st) {
    (void)st;
    char *base = model_key(variant_named("base"));
    const char *names[4] = {"shape", "dtype", "eps", "dropout"};
    for (int k = 0; k < 4; k++) {
        char *other = child_key(names[k]);
        if (strcmp(key_part(other), base) == 0) {
            print_error("changing %s did not change the key\n", names[k]);
            fail();
        }
        char *mine = model_key(variant_named(names[k]));
        assert_string_equal(key_part(other), mine); /* and stable across processes */
        free(other);
        gj_rt_free(mine);
    }
    gj_rt_free(base);
    /* bad input: an error, not a crash */
    assert_null(gj_jit_key_string(0, NULL, NULL));
    GJT_ASSERT_ERROR("gj_jit_key_string");
}

int main(int argc, char **argv) {
    (void)argc;
    const char *child = getenv("GJT_KEY_CHILD");
    if (child) return child_main(child);
    ssize_t n = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
    if (n <= 0) {
        snprintf(g_self, sizeof g_self, "%s", argv[0]);
    } else {
        g_self[n] = '\0';
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_across_processes),
        cmocka_unit_test(test_key_changes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
