/* SPDX-License-Identifier: MIT */
/*
 * torch_compare.c - runs bench/torch_ref.py (PyTorch eager, the same W1-W5)
 * as a subprocess and reads its JSON for `gradjit-bench --compare torch`.
 *
 * Invariants: the child gets this process's environment plus
 * OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS = the bench's
 * thread count, OPENBLAS_CORETYPE = the core gradjit's OpenBLAS uses, and
 * OMP_WAIT_POLICY=PASSIVE unless the user set OMP_WAIT_POLICY (Debian's
 * PyTorch is built with OpenMP but calls the pthread build of OpenBLAS: with
 * libgomp's default spin-waiting, the idle OpenMP threads starve OpenBLAS's
 * threads and PyTorch runs several times slower, which is not a fair
 * reference). Only the child's stdout (the JSON) is captured; its stderr
 * goes straight to ours. The JSON reader below is a small recursive-descent
 * parser into a tree that is freed before bench_torch_run returns; nothing
 * here fails the bench: problems end up in torch_run.why.
 */
#include "compare.h"

#include <errno.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define JSON_MAX_DEPTH 32
#define CHILD_OUT_MAX (16u << 20) /* bytes of JSON accepted from the script */

/* ---------------------------------------------------------------- JSON */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jnode {
    jtype t;
    bool b;
    double num;
    char *str;           /* J_STR: owned */
    char *key;           /* member name inside an object: owned, else NULL */
    struct jnode *kids;  /* J_ARR / J_OBJ: owned array of n_kids */
    int n_kids, cap;
} jnode;

typedef struct jparser {
    const char *p, *end;
    char err[128];
} jparser;

static void jfree(jnode *n) {
    for (int i = 0; i < n->n_kids; i++)
        jfree(&n->kids[i]);
    free(n->kids);
    free(n->str);
    free(n->key);
    memset(n, 0, sizeof *n);
}

static void jskip(jparser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t'))
        ps->p++;
}

static int jfail(jparser *ps, const char *what) {
    if (!ps->err[0])
        snprintf(ps->err, sizeof ps->err, "%s at byte %ld", what, (long)(ps->end - ps->p));
    return -1;
}

/* A JSON string starting at the opening quote into *out (malloc'd, UTF-8). */
static int jstring(jparser *ps, char **out) {
    size_t cap = 32, n = 0;
    char *s = malloc(cap);
    if (!s)
        return jfail(ps, "out of memory");
    ps->p++; /* opening quote */
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned c = (unsigned char)*ps->p++;
        char enc[4];
        size_t k = 1;
        enc[0] = (char)c;
        if (c == '\\') {
            if (ps->p >= ps->end)
                break;
            char e = *ps->p++;
            const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
            const char *hit = strchr(from, e);
            if (e == 'u') {
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    char h = ps->p < ps->end ? *ps->p++ : 0;
                    int d = h >= '0' && h <= '9'   ? h - '0'
                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                   : -1;
                    if (d < 0) {
                        free(s);
                        return jfail(ps, "bad \\u escape");
                    }
                    v = v * 16 + (unsigned)d;
                }
                if (v >= 0xd800 && v <= 0xdfff)
                    v = '?'; /* surrogate halves: not needed for this document */
                if (v < 0x80) {
                    enc[0] = (char)v;
                } else if (v < 0x800) {
                    enc[0] = (char)(0xc0 | v >> 6);
                    enc[1] = (char)(0x80 | (v & 0x3f));
                    k = 2;
                } else {
                    enc[0] = (char)(0xe0 | v >> 12);
                    enc[1] = (char)(0x80 | ((v >> 6) & 0x3f));
                    enc[2] = (char)(0x80 | (v & 0x3f));
                    k = 3;
                }
            } else if (e && hit) {
                enc[0] = to[hit - from];
            } else {
                free(s);
                return jfail(ps, "bad escape");
            }
        }
        if (n + k + 1 > cap) {
            char *t = realloc(s, cap *= 2);
            if (!t) {
                free(s);
                return jfail(ps, "out of memory");
            }
            s = t;
        }
        memcpy(s + n, enc, k);
        n += k;
    }
    if (ps->p >= ps->end) {
        free(s);
        return jfail(ps, "unterminated string");
    }
    ps->p++; /* closing quote */
    s[n] = 0;
    *out = s;
    return 0;
}

/* Appends a zeroed child to n; NULL when out of memory. */
static jnode *jpush(jnode *n) {
    if (n->n_kids == n->cap) {
        int cap = n->cap ? 2 * n->cap : 8;
        jnode *k = realloc(n->kids, (size_t)cap * sizeof *k);
        if (!k)
            return NULL;
        n->kids = k;
        n->cap = cap;
    }
    jnode *c = &n->kids[n->n_kids++];
    memset(c, 0, sizeof *c);
    return c;
}

static int jvalue(jparser *ps, jnode *n, int depth) {
    jskip(ps);
    if (ps->p >= ps->end)
        return jfail(ps, "unexpected end");
    if (depth > JSON_MAX_DEPTH)
        return jfail(ps, "nesting too deep");
    char c = *ps->p;
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        n->t = c == '{' ? J_OBJ : J_ARR;
        ps->p++;
        jskip(ps);
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            return 0;
        }
        for (;;) {
            jnode *k = jpush(n);
            if (!k)
                return jfail(ps, "out of memory");
            if (n->t == J_OBJ) {
                jskip(ps);
                if (ps->p >= ps->end || *ps->p != '"' || jstring(ps, &k->key) != 0)
                    return jfail(ps, "expected a member name");
                jskip(ps);
                if (ps->p >= ps->end || *ps->p++ != ':')
                    return jfail(ps, "expected ':'");
            }
            if (jvalue(ps, k, depth + 1) != 0)
                return -1;
            jskip(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                continue;
            }
            if (ps->p < ps->end && *ps->p == close) {
                ps->p++;
                return 0;
            }
            return jfail(ps, "expected ',' or a closing bracket");
        }
    }
    if (c == '"') {
        n->t = J_STR;
        return jstring(ps, &n->str);
    }
    static const struct { const char *w; jtype t; bool b; } words[] = {
        {"true", J_BOOL, true}, {"false", J_BOOL, false}, {"null", J_NULL, false},
        {"NaN", J_NULL, false}, /* Python's json writes NaN for float('nan') */
    };
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        size_t len = strlen(words[i].w);
        if ((size_t)(ps->end - ps->p) >= len && !memcmp(ps->p, words[i].w, len)) {
            ps->p += len;
            n->t = words[i].t;
            n->b = words[i].b;
            return 0;
        }
    }
    char buf[64];
    size_t len = 0;
    while (ps->p + len < ps->end && len + 1 < sizeof buf && strchr("+-.0123456789eE", ps->p[len]))
        len++;
    if (len == 0)
        return jfail(ps, "unexpected character");
    memcpy(buf, ps->p, len);
    buf[len] = 0;
    char *e;
    n->num = strtod(buf, &e);
    if (*e)
        return jfail(ps, "bad number");
    n->t = J_NUM;
    ps->p += len;
    return 0;
}

/* Member key of object o, or NULL. */
static const jnode *jget(const jnode *o, const char *key) {
    if (!o || o->t != J_OBJ)
        return NULL;
    for (int i = 0; i < o->n_kids; i++)
        if (o->kids[i].key && !strcmp(o->kids[i].key, key))
            return &o->kids[i];
    return NULL;
}

static double jnum(const jnode *o, const char *key) {
    const jnode *v = jget(o, key);
    return v && v->t == J_NUM ? v->num : NAN;
}

static void jstr(const jnode *o, const char *key, char *buf, size_t cap) {
    const jnode *v = jget(o, key);
    snprintf(buf, cap, "%s", v && v->t == J_STR ? v->str : "");
}

/* ------------------------------------------------------------ process */

const char *bench_torch_default_script(void) {
    static char path[1024];
    const char *f = __FILE__; /* absolute under CMake: .../bench/torch_compare.c */
    const char *slash = strrchr(f, '/');
    if (slash)
        snprintf(path, sizeof path, "%.*s/torch_ref.py", (int)(slash - f), f);
    else
        snprintf(path, sizeof path, "bench/torch_ref.py");
    return path;
}

/* environ without the names in drop[], plus add[] ("NAME=value"), as a
 * malloc'd NULL-terminated array of borrowed strings. */
static char **child_env(const char *const *drop, int n_drop, char *const *add, int n_add) {
    int n = 0;
    while (environ[n])
        n++;
    char **env = malloc((size_t)(n + n_add + 1) * sizeof *env);
    if (!env)
        return NULL;
    int k = 0;
    for (int i = 0; i < n; i++) {
        bool keep = true;
        for (int j = 0; j < n_drop; j++) {
            size_t len = strlen(drop[j]);
            if (!strncmp(environ[i], drop[j], len) && environ[i][len] == '=')
                keep = false;
        }
        if (keep)
            env[k++] = environ[i];
    }
    for (int j = 0; j < n_add; j++)
        env[k++] = add[j];
    env[k] = NULL;
    return env;
}

/* Starts argv with env, captures its stdout into *out (malloc'd, NUL
 * terminated) and its exit status into *status. 0, or errno-style code
 * from the spawn (ENOENT: no such interpreter). */
static int run_child(char *const *argv, char *const *env, char **out, int *status) {
    int fds[2];
    *out = NULL;
    if (pipe(fds) != 0)
        return errno;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    pid_t pid;
    fflush(stdout);
    fflush(stderr);
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, env);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        return rc;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf && n + 1 >= cap && cap < CHILD_OUT_MAX) {
            char *t = realloc(buf, cap * 2);
            if (!t) {
                free(buf);
                buf = NULL;
            } else {
                buf = t;
                cap *= 2;
            }
        }
        char sink[4096];
        char *dst = buf && n + 1 < cap ? buf + n : sink;
        size_t room = buf && n + 1 < cap ? cap - n - 1 : sizeof sink;
        ssize_t got = read(fds[0], dst, room);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        if (dst != sink)
            n += (size_t)got;
    }
    close(fds[0]);
    while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
    }
    if (buf)
        buf[n] = 0;
    *out = buf;
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Fills r from the parsed document; 0, or -1 with r->why set. */
static int read_doc(const jnode *doc, torch_run *r) {
    const jnode *res = jget(doc, "results");
    if (!doc || doc->t != J_OBJ || !res || res->t != J_ARR) {
        snprintf(r->why, sizeof r->why, "the script's JSON has no \"results\" array");
        return -1;
    }
    jstr(doc, "torch_version", r->version, sizeof r->version);
    jstr(doc, "python", r->python, sizeof r->python);
    jstr(doc, "blas_core", r->blas_core, sizeof r->blas_core);
    jstr(doc, "blas_config", r->blas_config, sizeof r->blas_config);
    double t = jnum(doc, "threads"), bt = jnum(doc, "blas_threads");
    r->threads = isfinite(t) ? (int)t : -1;
    r->blas_threads = isfinite(bt) ? (int)bt : -1;
    for (int i = 0; i < res->n_kids && r->n_rows < BENCH_TORCH_MAX_ROWS; i++) {
        const jnode *o = &res->kids[i];
        torch_row *row = &r->rows[r->n_rows++];
        memset(row, 0, sizeof *row);
        jstr(o, "id", row->id, sizeof row->id);
        const jnode *ok = jget(o, "ok");
        row->ok = ok && ok->t == J_BOOL && ok->b;
        jstr(o, "error", row->error, sizeof row->error);
        row->fwd_med = jnum(o, "fwd_ms_median");
        row->fwd_min = jnum(o, "fwd_ms_min");
        row->bwd_med = jnum(o, "bwd_ms_median");
        row->bwd_min = jnum(o, "bwd_ms_min");
        row->loss_first = jnum(o, "loss_first");
        if (row->ok && !(isfinite(row->fwd_med) && isfinite(row->bwd_med))) {
            row->ok = false;
            snprintf(row->error, sizeof row->error, "no timings in the script's JSON");
        }
    }
    return 0;
}

void bench_torch_run(const torch_request *req, torch_run *r) {
    memset(r, 0, sizeof *r);
    char steps[16], warmup[16], threads[16], env_threads[3][48], env_core[96];
    snprintf(steps, sizeof steps, "%d", req->steps);
    snprintf(warmup, sizeof warmup, "%d", req->warmup);
    snprintf(threads, sizeof threads, "%d", req->threads);
    snprintf(env_threads[0], sizeof env_threads[0], "OMP_NUM_THREADS=%d", req->threads);
    snprintf(env_threads[1], sizeof env_threads[1], "OPENBLAS_NUM_THREADS=%d", req->threads);
    snprintf(env_threads[2], sizeof env_threads[2], "MKL_NUM_THREADS=%d", req->threads);
    char *add[6];
    int n_add = 0;
    for (int i = 0; i < 3; i++)
        add[n_add++] = env_threads[i];
    if (req->coretype && *req->coretype) {
        snprintf(env_core, sizeof env_core, "OPENBLAS_CORETYPE=%s", req->coretype);
        add[n_add++] = env_core;
    }
    const char *wait = getenv("OMP_WAIT_POLICY");
    static char passive[] = "OMP_WAIT_POLICY=PASSIVE";
    if (!wait)
        add[n_add++] = passive;
    snprintf(r->omp_wait_policy, sizeof r->omp_wait_policy, "%s", wait ? wait : "PASSIVE");
    static const char *const drop[] = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                       "MKL_NUM_THREADS", "OPENBLAS_CORETYPE"};
    int n_drop = req->coretype && *req->coretype ? 4 : 3;
    char **env = child_env(drop, n_drop, add, n_add);
    char *argv[] = {(char *)req->python, (char *)req->script, "--workloads",
                    (char *)req->workloads, "--steps", steps, "--warmup", warmup, "--threads",
                    threads, "--w4-checkpoint", req->w4_checkpoint ? "1" : "0", NULL};
    if (!env) {
        snprintf(r->why, sizeof r->why, "out of memory");
        return;
    }
    if (access(req->script, R_OK) != 0) {
        snprintf(r->why, sizeof r->why, "cannot read the PyTorch script %s (%s); pass "
                 "--torch-script PATH", req->script, strerror(errno));
        free(env);
        return;
    }
    double t0 = now_s();
    char *out = NULL;
    int status = 0, rc = run_child(argv, env, &out, &status);
    r->wall_s = now_s() - t0;
    free(env);
    if (rc != 0) {
        snprintf(r->why, sizeof r->why, "cannot run %s: %s (the comparison needs a Python with "
                 "PyTorch; Debian: apt install python3-torch, then --python /usr/bin/python3)",
                 req->python, strerror(rc));
        free(out);
        return;
    }
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 3) {
        snprintf(r->why, sizeof r->why, "PyTorch is not installed for %s (Debian: apt install "
                 "python3-torch)", req->python);
        free(out);
        return;
    }
    if (code == 127 || code == 126) {
        snprintf(r->why, sizeof r->why, "cannot run %s (exit status %d)", req->python, code);
        free(out);
        return;
    }
    jnode doc = {0};
    jparser ps = {out, out ? out + strlen(out) : NULL, ""};
    if (!out || jvalue(&ps, &doc, 0) != 0) {
        if (WIFSIGNALED(status))
            snprintf(r->why, sizeof r->why, "%s was killed by signal %d before writing its "
                     "results", req->script, WTERMSIG(status));
        else
            snprintf(r->why, sizeof r->why, "%s exited with status %d without valid JSON (%s); "
                     "its messages are above", req->script, code, out ? ps.err : "no output");
        jfree(&doc);
        free(out);
        return;
    }
    if (read_doc(&doc, r) == 0) {
        r->available = true;
        r->json_text = out;
        out = NULL;
    }
    jfree(&doc);
    free(out);
}

const torch_row *bench_torch_find(const torch_run *r, const char *id) {
    for (int i = 0; i < r->n_rows; i++)
        if (!strcasecmp(r->rows[i].id, id))
            return &r->rows[i];
    return NULL;
}

void bench_torch_free(torch_run *r) {
    free(r->json_text);
    r->json_text = NULL;
}
