/* SPDX-License-Identifier: MIT */
/*
 * test_diskcache.c - the disk cache trusts nothing it reads, and the
 * environment variables are parsed strictly (docs/guide.md, section 5).
 *
 * Disk cache (docs/architecture.md, "The cache trusts nothing it reads"): a cache file
 * whose bytes are altered and re-checksummed is rejected, never run; the
 * directory is created 0700, and a directory or entry writable by group or
 * others (or another user's) is refused with one message; an entry that is
 * a FIFO, a directory or a huge file is rejected without blocking or
 * reading it; a cache directory path of any length either works or is
 * refused, and no file ever lands outside it; the temporary file is unique
 * (a symlink planted at the old pid-based name is never followed). Every
 * refused or rejected entry means a compile, and the backward still gives
 * the eager gradients.
 *
 * Environment: GRADJIT_COMPILED_AUTOGRAD, GRADJIT_LOG and
 * GRADJIT_NUM_THREADS are read once per process, so those tests run this
 * binary again (fork + exec with the variable set and a --child-* argument)
 * and look at the child's exit status and stderr.
 */
#include "gjtest.h"

#include "jit/capture/capture.h"
#include "jit/ir/ir.h"
#include "jit/jit.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *g_self; /* this binary (argv[0]), for the child runs */

/* ---------------------------------------------------------------- model */

/* x[5, 6] -> tanh(x @ w^T + b) -> mean: w [4, 6], b [4] require grad (a
 * matmul step and fused kernels in the plan). */
typedef gjt_mlp mlp; /* gjtest.h */

/* One backward (inputs from a fixed seed); its status. */
static int mlp_step(mlp *m, bool compiled) {
    gjt_rng r;
    gjt_rng_seed(&r, 5);
    gj_set_compiled_autograd(compiled);
    gj_scope_push();
    gj_tensor *x = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){5, 6}, -1, 1);
    int rc = gj_backward(gj_mean(gj_tanh(gj_linear(x, m->w, m->b)), 0, NULL, false), NULL);
    gj_release(x);
    gj_scope_pop();
    gj_set_compiled_autograd(false);
    return rc;
}

/* The 28 .grad values of w and b (malloc'd), then cleared. */
static double *take_grads(mlp *m) {
    double *g = malloc(28 * sizeof *g);
    assert_non_null(g);
    double *gw = gjt_values(gj_tensor_grad(m->w)), *gb = gjt_values(gj_tensor_grad(m->b));
    assert_true(gw && gb);
    memcpy(g, gw, 24 * sizeof *g);
    memcpy(g + 24, gb, 4 * sizeof *g);
    free(gw);
    free(gb);
    assert_int_equal(gj_tensor_set_grad(m->w, NULL), 0);
    assert_int_equal(gj_tensor_set_grad(m->b, NULL), 0);
    return g;
}

/* The eager gradients of the model (malloc'd). */
static double *eager_grads(mlp *m) {
    assert_int_equal(mlp_step(m, false), 0);
    return take_grads(m);
}

/* One compiled backward as a new process would run it (memory cache
 * dropped, statistics reset): it succeeds without a fallback and gives the
 * eager gradients ref. Returns its statistics. */
static gj_ca_stats run_compiled(mlp *m, const double *ref) {
    gj_jit_clear_cache();
    gj_compiled_autograd_reset_stats();
    assert_int_equal(mlp_step(m, true), 0);
    gj_ca_stats s = gjt_ca_now();
    if (s.fallbacks) print_error("fallback: %s\n", gj_jit_last_fallback());
    assert_int_equal(s.fallbacks, 0);
    assert_int_equal(s.compiles + s.disk_hits, 1);
    double *g = take_grads(m);
    bool ok = gjt_allclose("compiled vs eager", g, ref, 28, 1e-6, 1e-5);
    free(g);
    assert_true(ok);
    return s;
}

/* ------------------------------------------------------------ files */

/* Path of the one .gjc entry in dir (into out), or false. */
static bool entry_path(const char *dir, char *out, size_t cap) {
    bool found = false;
    DIR *d = opendir(dir);
    if (!d) return false;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n > 4 && strcmp(e->d_name + n - 4, ".gjc") == 0) {
            snprintf(out, cap, "%s/%s", dir, e->d_name);
            found = true;
        }
    }
    closedir(d);
    return found;
}

/* Removes name (a file, or a directory and everything below it) inside
 * directory dfd; works at any depth (no path longer than one name). */
static void remove_at(int dfd, const char *name) {
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
        if (fd >= 0) {
            DIR *d = fdopendir(fd);
            if (d) {
                for (struct dirent *e; (e = readdir(d));)
                    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
                        remove_at(dirfd(d), e->d_name);
                closedir(d);
            } else {
                close(fd);
            }
        }
        unlinkat(dfd, name, AT_REMOVEDIR);
    } else {
        unlinkat(dfd, name, 0);
    }
}

static void remove_tree(const char *path) {
    chmod(path, 0700);
    remove_at(AT_FDCWD, path);
}

/* Counts the files (anything but directories) below directory dfd; files
 * not at depth `want` (0: in dfd itself) are counted in *misplaced, and the
 * .gjc entries at that depth in *entries. */
static void count_files_at(int dfd, int depth, int want, int *entries, int *misplaced) {
    int fd = dup(dfd);
    assert_true(fd >= 0);
    DIR *d = fdopendir(fd);
    assert_non_null(d);
    rewinddir(d); /* the duplicate shares dfd's position */
    for (struct dirent *e; (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        struct stat st;
        assert_int_equal(fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW), 0);
        if (S_ISDIR(st.st_mode)) {
            int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
            assert_true(sub >= 0);
            count_files_at(sub, depth + 1, want, entries, misplaced);
            close(sub);
            continue;
        }
        size_t n = strlen(e->d_name);
        if (depth != want) {
            print_error("file %s at depth %d, outside the cache directory (depth %d)\n",
                        e->d_name, depth, want);
            (*misplaced)++;
        } else if (n > 4 && strcmp(e->d_name + n - 4, ".gjc") == 0) {
            (*entries)++;
        }
    }
    closedir(d);
}

/* The whole file (malloc'd), its size in *n. */
static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long len = ftell(f);
    assert_true(len > 0);
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    unsigned char *p = malloc((size_t)len);
    assert_non_null(p);
    assert_int_equal(fread(p, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return p;
}

/* Writes data[0..n) to path as a new 0600 file, its last 16 bytes replaced
 * by the checksum diskcache.c computes (gj_jit_hash128 of the rest): what a
 * forger with the library at hand would write. */
static void write_resummed(const char *path, unsigned char *data, size_t n) {
    uint64_t h[2];
    gj_jit_hash128(data, n - 16, h);
    memcpy(data + n - 16, h, 16);
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, data, n), (ssize_t)n);
    close(fd);
}

static uint64_t rd_u64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* ----------------------------------------------------- stderr capture */

static int g_saved_err = -1;
static char g_err_path[64];

/* From now on stderr goes to a temporary file. */
static void capture_begin(void) {
    fflush(stderr);
    snprintf(g_err_path, sizeof g_err_path, "/tmp/gjdc-err-XXXXXX");
    int fd = mkstemp(g_err_path);
    assert_true(fd >= 0);
    g_saved_err = dup(2);
    assert_true(g_saved_err >= 0);
    assert_true(dup2(fd, 2) >= 0);
    close(fd);
}

/* Restores stderr; what was written meanwhile (malloc'd, NUL-terminated). */
static char *capture_end(void) {
    fflush(stderr);
    assert_true(dup2(g_saved_err, 2) >= 0);
    close(g_saved_err);
    g_saved_err = -1;
    FILE *f = fopen(g_err_path, "rb");
    assert_non_null(f);
    char *s = calloc(1, 1 << 16);
    assert_non_null(s);
    size_t n = fread(s, 1, (1 << 16) - 1, f);
    s[n] = '\0';
    fclose(f);
    unlink(g_err_path);
    return s;
}

/* Occurrences of needle in s. */
static int count_of(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* ------------------------------------------------- A1: forged files */

/* A cache file whose header or plan bytes are altered -- every length
 * field and the magic, every 8-byte word of the plan decremented, and 320
 * plan bytes flipped or set -- and re-checksummed is rejected: every such load compiles
 * instead (no disk hit), nothing crashes, and the gradients are eager's.
 * The untouched file, re-written the same way, is a disk hit (so the loads
 * above really read the forged files). */
static void test_forged_plan(void **st) {
    (void)st;
    char dir[] = "/tmp/gjdc-forge-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    mlp m;
    gjt_mlp_init(&m, 77);
    double *ref = eager_grads(&m);
    run_compiled(&m, ref);
    char path[512];
    assert_true(entry_path(dir, path, sizeof path));
    size_t n;
    unsigned char *orig = read_all(path, &n);
    unsigned char *buf = malloc(n);
    assert_non_null(buf);

    /* the layout: magic, layout, 4 strings, plan blob, object blob, the
     * lent parts (none) and lent kernels (none), sum */
    size_t pos = 16, len = 0;
    for (int k = 0; k < 5; k++) { /* to the plan blob's bytes */
        assert_true(pos + 8 <= n - 16);
        len = (size_t)rd_u64(orig + pos);
        pos += 8;
        assert_true(len <= n - 16 - pos);
        if (k < 4) pos += len;
    }
    size_t plan_at = pos, plan_n = len;
    size_t obj_len_at = plan_at + plan_n;
    assert_true(plan_n > 64);
    size_t parts_at = obj_len_at + 8 + rd_u64(orig + obj_len_at);
    assert_true(parts_at + 8 + 8 + 16 == n);
    assert_true(rd_u64(orig + parts_at) == 0 && rd_u64(orig + parts_at + 8) == 0);

    memcpy(buf, orig, n);
    write_resummed(path, buf, n);
    assert_int_equal(run_compiled(&m, ref).disk_hits, 1);

    /* header: magic, layout signature, every length field */
    size_t hdr[64];
    int n_hdr = 0;
    for (size_t i = 0; i < 16; i++) hdr[n_hdr++] = i;
    size_t at = 16;
    for (int k = 0; k < 6; k++) {
        hdr[n_hdr++] = at;     /* low byte of the length */
        hdr[n_hdr++] = at + 7; /* high byte */
        if (k < 5) at += 8 + (size_t)rd_u64(orig + at);
    }
    for (int k = 0; k < 2; k++) { /* the counts of lent parts and kernels */
        hdr[n_hdr++] = parts_at + 8 * (size_t)k;
        hdr[n_hdr++] = parts_at + 8 * (size_t)k + 7;
    }
    for (int i = 0; i < n_hdr; i++) {
        memcpy(buf, orig, n);
        buf[hdr[i]] ^= 0xff;
        write_resummed(path, buf, n);
        gj_ca_stats s = run_compiled(&m, ref);
        assert_int_equal(s.disk_hits, 0);
    }

    /* plan: every 8-byte word one smaller (each numeric field off by one),
     * then 320 bytes spread over the blob flipped or set */
    for (size_t w = 0; w + 8 <= plan_n; w += 8) {
        memcpy(buf, orig, n);
        uint64_t v = rd_u64(buf + plan_at + w) - 1;
        memcpy(buf + plan_at + w, &v, 8);
        write_resummed(path, buf, n);
        gj_ca_stats s = run_compiled(&m, ref);
        if (s.disk_hits != 0) print_error("plan word at %zu, decremented, was accepted\n", w);
        assert_int_equal(s.disk_hits, 0);
    }
    const int n_plan = 320;
    for (int i = 0; i < n_plan; i++) {
        size_t p = plan_at + (size_t)i * plan_n / (size_t)n_plan + (size_t)(i % 5);
        if (p >= plan_at + plan_n) p = plan_at + plan_n - 1;
        memcpy(buf, orig, n);
        switch (i % 3) {
        case 0: buf[p] ^= 0x01; break;
        case 1: buf[p] ^= 0x80; break;
        default: buf[p] = buf[p] == 0xff ? 0x00 : 0xff; break;
        }
        write_resummed(path, buf, n);
        gj_ca_stats s = run_compiled(&m, ref);
        if (s.disk_hits != 0)
            print_error("plan byte %zu (change %d) was accepted\n", p - plan_at, i % 3);
        assert_int_equal(s.disk_hits, 0);
    }

    /* and the genuine file still loads */
    memcpy(buf, orig, n);
    write_resummed(path, buf, n);
    assert_int_equal(run_compiled(&m, ref).disk_hits, 1);

    free(buf);
    free(orig);
    free(ref);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    remove_tree(dir);
}

/* ----------------------------------------- A2: ownership and modes */

/* The directory is created 0700 (entries 0600). A directory, or an entry,
 * writable by group or others is refused with one message on stderr
 * naming it (a compile instead, no disk hit, nothing written into such a
 * directory); a refused entry is replaced by the compile's own. */
static void test_modes(void **st) {
    (void)st;
    char base[] = "/tmp/gjdc-mode-XXXXXX";
    assert_non_null(mkdtemp(base));
    char dir[256], path[512];
    snprintf(dir, sizeof dir, "%s/sub/cache", base);
    gj_jit_set_disk_cache(dir);
    mlp m;
    gjt_mlp_init(&m, 77);
    double *ref = eager_grads(&m);
    assert_int_equal(run_compiled(&m, ref).compiles, 1);
    struct stat sd, se;
    assert_int_equal(stat(dir, &sd), 0);
    assert_int_equal(sd.st_mode & 0777, 0700);
    assert_true(entry_path(dir, path, sizeof path));
    assert_int_equal(stat(path, &se), 0);
    assert_int_equal(se.st_mode & 0077, 0);
    assert_true(se.st_uid == geteuid());
    assert_int_equal(run_compiled(&m, ref).disk_hits, 1);

    /* a directory others may write into: refused, one message */
    assert_int_equal(chmod(dir, 0777), 0);
    capture_begin();
    gj_ca_stats s1 = run_compiled(&m, ref);
    gj_ca_stats s2 = run_compiled(&m, ref);
    char *err = capture_end();
    assert_int_equal(s1.disk_hits, 0);
    assert_int_equal(s2.disk_hits, 0);
    assert_int_equal(s1.compiles, 1);
    if (count_of(err, dir) != 1 || !strstr(err, "writable"))
        print_error("stderr was: %s\n", err);
    assert_int_equal(count_of(err, dir), 1);
    assert_non_null(strstr(err, "writable"));
    free(err);
    struct stat se2;
    assert_int_equal(stat(path, &se2), 0);
    assert_true(se2.st_ino == se.st_ino); /* not rewritten */

    /* group-writable: the same */
    assert_int_equal(chmod(dir, 0770), 0);
    capture_begin();
    assert_int_equal(run_compiled(&m, ref).disk_hits, 0);
    err = capture_end();
    assert_true(count_of(err, dir) <= 1);
    free(err);

    /* back to 0700: an entry writable by others is refused, once */
    assert_int_equal(chmod(dir, 0700), 0);
    assert_int_equal(chmod(path, 0666), 0);
    capture_begin();
    s1 = run_compiled(&m, ref);
    err = capture_end();
    assert_int_equal(s1.disk_hits, 0);
    assert_int_equal(s1.compiles, 1);
    if (count_of(err, path) != 1) print_error("stderr was: %s\n", err);
    assert_int_equal(count_of(err, path), 1);
    free(err);
    /* the compile replaced it with its own 0600 entry */
    assert_int_equal(stat(path, &se2), 0);
    assert_int_equal(se2.st_mode & 0077, 0);
    assert_int_equal(run_compiled(&m, ref).disk_hits, 1);

    /* another user's entry, then directory (only root can make them) */
    if (geteuid() == 0) {
        assert_int_equal(chown(path, 12345, (gid_t)-1), 0);
        capture_begin();
        s1 = run_compiled(&m, ref);
        err = capture_end();
        assert_int_equal(s1.disk_hits, 0);
        if (count_of(err, "owned by uid 12345") != 1) print_error("stderr was: %s\n", err);
        assert_int_equal(count_of(err, "owned by uid 12345"), 1);
        free(err);
        assert_int_equal(run_compiled(&m, ref).disk_hits, 1); /* replaced by ours */
        assert_int_equal(chown(dir, 12345, (gid_t)-1), 0);
        capture_begin();
        s1 = run_compiled(&m, ref);
        s2 = run_compiled(&m, ref);
        err = capture_end();
        assert_int_equal(s1.disk_hits + s2.disk_hits, 0);
        assert_int_equal(count_of(err, "owned by uid 12345"), 1);
        assert_non_null(strstr(err, dir));
        free(err);
        assert_int_equal(chown(dir, 0, (gid_t)-1), 0);
    }

    free(ref);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    remove_tree(base);
}

/* ---------------------------------------------- A3: kinds of entry */

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "test_diskcache: a load blocked (alarm)\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    _exit(3);
}

/* Bytes this process has read through read() and friends (Linux
 * /proc/self/io "rchar"), or -1. */
static long long bytes_read_so_far(void) {
    FILE *f = fopen("/proc/self/io", "r");
    if (!f) return -1;
    char line[128];
    long long v = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "rchar: %lld", &v) == 1) break;
    fclose(f);
    return v;
}

/* An entry that is a FIFO is rejected without blocking (an alarm kills the
 * test otherwise) and replaced by the compile's file; an entry that is a
 * directory is rejected and leaves no error message behind after the
 * successful backward; a 3 GiB sparse file is rejected without being read
 * (the process's read() byte count, /proc/self/io rchar, grows by far less
 * than the file). */
static void test_entry_kinds(void **st) {
    (void)st;
    char dir[] = "/tmp/gjdc-kind-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    mlp m;
    gjt_mlp_init(&m, 77);
    double *ref = eager_grads(&m);
    assert_int_equal(run_compiled(&m, ref).compiles, 1);
    char path[512];
    assert_true(entry_path(dir, path, sizeof path));

    /* FIFO */
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkfifo(path, 0600), 0);
    signal(SIGALRM, on_alarm);
    alarm(30);
    gj_ca_stats s = run_compiled(&m, ref);
    alarm(0);
    signal(SIGALRM, SIG_DFL);
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.disk_hits, 0);
    struct stat sb;
    assert_int_equal(lstat(path, &sb), 0);
    assert_true(S_ISREG(sb.st_mode));

    /* directory */
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkdir(path, 0700), 0);
    gj_clear_error();
    s = run_compiled(&m, ref);
    assert_int_equal(s.compiles, 1);
    if (gj_last_error()[0]) print_error("stale error: %s\n", gj_last_error());
    assert_string_equal(gj_last_error(), "");
    assert_int_equal(rmdir(path), 0);

    /* a huge sparse file */
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)3 << 30), 0);
    close(fd);
    gj_clear_error();
    long long read0 = bytes_read_so_far();
    s = run_compiled(&m, ref);
    long long read1 = bytes_read_so_far();
    assert_int_equal(s.compiles, 1);
    assert_int_equal(s.disk_hits, 0);
    assert_string_equal(gj_last_error(), "");
    assert_true(read0 >= 0 && read1 >= 0);
    if (read1 - read0 > (64ll << 20))
        print_error("the huge entry was read: %lld bytes\n", read1 - read0);
    assert_true(read1 - read0 <= (64ll << 20));

    free(ref);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    remove_tree(dir);
}

/* --------------------------------------------- A4: long directories */

/* Creates base/<c>/<c>/... (components of 200 characters) until the path is
 * at least len characters long; returns the path (malloc'd) and its depth
 * below base in *depth. Works past PATH_MAX (openat/mkdirat). */
static char *deep_dir(const char *base, size_t len, int *depth) {
    char comp[201];
    memset(comp, 'd', 200);
    comp[200] = '\0';
    size_t cap = len + 512;
    char *path = malloc(cap);
    assert_non_null(path);
    snprintf(path, cap, "%s", base);
    int fd = open(base, O_RDONLY | O_DIRECTORY);
    assert_true(fd >= 0);
    *depth = 0;
    while (strlen(path) < len) {
        assert_int_equal(mkdirat(fd, comp, 0700), 0);
        int sub = openat(fd, comp, O_RDONLY | O_DIRECTORY);
        assert_true(sub >= 0);
        close(fd);
        fd = sub;
        strcat(path, "/");
        strcat(path, comp);
        (*depth)++;
    }
    close(fd);
    return path;
}

/* Runs this binary with argument mode, variable name set to value (NULL:
 * unset) and GRADJIT_CACHE_DIR=off unless name is GRADJIT_CACHE_DIR.
 * Returns the exit status (-1 if it did not exit); *err receives its stderr
 * (malloc'd) when err is not NULL. */
static int run_child(const char *mode, const char *name, const char *value, char **err) {
    size_t n = strlen(name) + (value ? strlen(value) : 0) + 2; /* values of any length */
    char *set = malloc(n);
    assert_non_null(set);
    snprintf(set, n, "%s=%s", name, value ? value : "");
    const char *env[] = {strcmp(name, "GRADJIT_CACHE_DIR") != 0 ? "GRADJIT_CACHE_DIR=off" : "",
                         value ? set : name, NULL};
    int rc = gjt_run_self(g_self, mode, env[0][0] ? env : env + 1, NULL, err);
    free(set);
    return rc;
}

/* A cache directory of 2000 characters works (through the API and through
 * GRADJIT_CACHE_DIR in a new process): the entry lands in it, nowhere
 * else, and loads again. One of 5000 characters (past PATH_MAX) either
 * works the same or is refused with a message naming the problem; no file
 * is ever written outside it, nothing crashes. */
static void test_long_dir(void **st) {
    (void)st;
    char base[] = "/tmp/gjdc-long-XXXXXX";
    assert_non_null(mkdtemp(base));
    mlp m;
    gjt_mlp_init(&m, 77);
    double *ref = eager_grads(&m);

    /* 2000, environment, in a new process */
    int depth;
    char *d2 = deep_dir(base, 2000, &depth);
    assert_true(strlen(d2) >= 2000);
    char *err = NULL;
    int rc = run_child("--child-backward", "GRADJIT_CACHE_DIR", d2, &err);
    if (rc != 0) print_error("child: %s\n", err);
    assert_int_equal(rc, 0);
    free(err);
    int bfd = open(base, O_RDONLY | O_DIRECTORY);
    assert_true(bfd >= 0);
    int entries = 0, misplaced = 0;
    count_files_at(bfd, 0, depth, &entries, &misplaced);
    assert_int_equal(misplaced, 0);
    assert_int_equal(entries, 1);

    /* the same directory through the API, in this process: a disk hit */
    gj_jit_set_disk_cache(d2);
    assert_int_equal(run_compiled(&m, ref).disk_hits, 1);
    gj_jit_clear_cache();
    entries = misplaced = 0;
    count_files_at(bfd, 0, depth, &entries, &misplaced);
    assert_int_equal(misplaced, 0);
    assert_int_equal(entries, 1);
    close(bfd);
    remove_tree(base);
    free(d2);

    /* 5000 */
    assert_int_equal(mkdir(base, 0700), 0);
    char *d5 = deep_dir(base, 5000, &depth);
    gj_jit_set_disk_cache(d5);
    capture_begin();
    gj_ca_stats s1 = run_compiled(&m, ref);
    gj_ca_stats s2 = run_compiled(&m, ref);
    err = capture_end();
    bfd = open(base, O_RDONLY | O_DIRECTORY);
    assert_true(bfd >= 0);
    entries = misplaced = 0;
    count_files_at(bfd, 0, depth, &entries, &misplaced);
    close(bfd);
    assert_int_equal(misplaced, 0);
    assert_int_equal(s1.compiles, 1);
    if (entries == 0) { /* refused: said so, once */
        assert_int_equal(s2.compiles, 1);
        if (count_of(err, "too long") != 1) print_error("stderr was: %s\n", err);
        assert_int_equal(count_of(err, "too long"), 1);
    } else {
        assert_int_equal(entries, 1);
        assert_int_equal(s2.disk_hits, 1);
    }
    free(err);
    rc = run_child("--child-backward", "GRADJIT_CACHE_DIR", d5, NULL);
    assert_int_equal(rc, 0);
    bfd = open(base, O_RDONLY | O_DIRECTORY);
    assert_true(bfd >= 0);
    entries = misplaced = 0;
    count_files_at(bfd, 0, depth, &entries, &misplaced);
    close(bfd);
    assert_int_equal(misplaced, 0);
    assert_true(entries <= 1);

    free(d5);
    free(ref);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    remove_tree(base);
}

/* ---------------------------------------- A5: the temporary file */

/* A symlink planted where the old code put its temporary file
 * (<entry>.tmp<pid>) is never followed: the file it points to keeps its
 * contents, the entry written is a regular file of ours, and it loads. */
static void test_tmp_name(void **st) {
    (void)st;
    char dir[] = "/tmp/gjdc-tmp-XXXXXX";
    assert_non_null(mkdtemp(dir));
    gj_jit_set_disk_cache(dir);
    mlp m;
    gjt_mlp_init(&m, 77);
    double *ref = eager_grads(&m);
    run_compiled(&m, ref);
    char path[512], tmp[600], victim[300];
    assert_true(entry_path(dir, path, sizeof path));
    assert_int_equal(unlink(path), 0);
    snprintf(victim, sizeof victim, "%s.victim", dir);
    FILE *f = fopen(victim, "wb");
    assert_non_null(f);
    fputs("victim", f);
    fclose(f);
    snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid());
    assert_int_equal(symlink(victim, tmp), 0);

    assert_int_equal(run_compiled(&m, ref).compiles, 1);
    size_t n;
    unsigned char *v = read_all(victim, &n);
    assert_int_equal(n, 6);
    assert_memory_equal(v, "victim", 6);
    free(v);
    struct stat sb;
    assert_int_equal(lstat(path, &sb), 0);
    assert_true(S_ISREG(sb.st_mode));
    assert_int_equal(run_compiled(&m, ref).disk_hits, 1);
    /* no temporary file left behind: the entry and the planted link only */
    DIR *d = opendir(dir);
    assert_non_null(d);
    int files = 0;
    for (struct dirent *e; (e = readdir(d));)
        files += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    assert_int_equal(files, 2);

    unlink(tmp);
    unlink(victim);
    free(ref);
    gjt_mlp_free(&m);
    gj_jit_clear_cache();
    gj_jit_set_disk_cache(NULL);
    remove_tree(dir);
}

/* ------------------------------------------------- B: environment */

/* GRADJIT_COMPILED_AUTOGRAD: 1/on/true/yes in any case turn it on;
 * 0/off/false/no/empty and unset leave it off, silently; anything else
 * leaves it off with one warning naming the variable and the value. */
static void test_env_compiled(void **st) {
    (void)st;
    static const char *on[] = {"1", "on", "ON", "true", "True", "yes", "YES"};
    static const char *off[] = {"0", "off", "OFF", "Off", "false", "FALSE", "no", "No", ""};
    char *err;
    for (size_t i = 0; i < sizeof on / sizeof on[0]; i++) {
        assert_int_equal(run_child("--child-ca", "GRADJIT_COMPILED_AUTOGRAD", on[i], &err), 1);
        assert_string_equal(err, "");
        free(err);
    }
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++) {
        int rc = run_child("--child-ca", "GRADJIT_COMPILED_AUTOGRAD", off[i], &err);
        if (rc != 0) print_error("GRADJIT_COMPILED_AUTOGRAD='%s' turned it on\n", off[i]);
        assert_int_equal(rc, 0);
        assert_string_equal(err, "");
        free(err);
    }
    assert_int_equal(run_child("--child-ca", "GRADJIT_COMPILED_AUTOGRAD", NULL, &err), 0);
    assert_string_equal(err, "");
    free(err);
    assert_int_equal(run_child("--child-ca", "GRADJIT_COMPILED_AUTOGRAD", "maybe", &err), 0);
    assert_int_equal(count_of(err, "GRADJIT_COMPILED_AUTOGRAD"), 1);
    assert_non_null(strstr(err, "maybe"));
    free(err);
}

/* GRADJIT_LOG: words in any case; an unknown word warns once (naming the
 * variable and the word) and the known ones still count; "help" prints the
 * list of words once. */
static void test_env_log(void **st) {
    (void)st;
    char *err;
    /* cache: no warning, only its summary at exit, a line per compiled path */
    assert_int_equal(run_child("--child-log", "GRADJIT_LOG", "cache", &err), GJ_JIT_LOG_CACHE);
    assert_string_equal(err, "[gradjit cache] summary, compiled autograd (backwards): 0 compiles "
                             "(0.0 ms), 0 memory hits, 0 disk hits, 0 fallbacks\n"
                             "[gradjit cache] summary, compiled step (gj_step runs): 0 compiles "
                             "(0.0 ms), 0 memory hits, 0 disk hits, 0 fallbacks\n");
    free(err);
    assert_int_equal(run_child("--child-log", "GRADJIT_LOG", "Cache, GRAPH", &err),
                     GJ_JIT_LOG_CACHE | GJ_JIT_LOG_GRAPH);
    assert_int_equal(count_of(err, "GRADJIT_LOG"), 0);
    assert_int_equal(count_of(err, "summary"), 2);
    free(err);
    assert_int_equal(run_child("--child-log", "GRADJIT_LOG", "ALL", &err), 0xff);
    free(err);
    assert_int_equal(run_child("--child-log", "GRADJIT_LOG", "Recompiles", &err),
                     GJ_JIT_LOG_RECOMPILES);
    assert_string_equal(err, "");
    free(err);
    assert_int_equal(run_child("--child-log", "GRADJIT_LOG", "plan,bogus", &err),
                     GJ_JIT_LOG_PLAN);
    assert_int_equal(count_of(err, "GRADJIT_LOG"), 1);
    assert_int_equal(count_of(err, "bogus"), 1);
    free(err);
    assert_int_equal(run_child("--child-log", "GRADJIT_LOG", "help", &err), 0);
    static const char *words[] = {"graph", "ir",         "plan",  "cache", "fallback", "prof",
                                  "instrs", "recompiles", "leaks", "gemm", "all", "help"};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        if (!strstr(err, words[i])) print_error("help lacks '%s': %s\n", words[i], err);
        assert_non_null(strstr(err, words[i]));
    }
    assert_int_equal(count_of(err, "fallback"), 1);
    free(err);
}

/* GRADJIT_NUM_THREADS: a number sets the pool size; anything else warns
 * once (naming the variable and the value) and keeps the default. */
static void test_env_threads(void **st) {
    (void)st;
    char *err;
    assert_int_equal(run_child("--child-threads", "GRADJIT_NUM_THREADS", "3", &err), 3);
    assert_string_equal(err, "");
    free(err);
    int dflt = run_child("--child-threads", "GRADJIT_NUM_THREADS", NULL, NULL);
    assert_true(dflt >= 1);
    assert_int_equal(run_child("--child-threads", "GRADJIT_NUM_THREADS", "four", &err), dflt);
    assert_int_equal(count_of(err, "GRADJIT_NUM_THREADS"), 1);
    assert_non_null(strstr(err, "four"));
    free(err);
    assert_int_equal(run_child("--child-threads", "GRADJIT_NUM_THREADS", "2x", &err), dflt);
    assert_int_equal(count_of(err, "GRADJIT_NUM_THREADS"), 1);
    free(err);
}

/* ------------------------------------------------------------ main */

/* The child modes: each reads its variable twice (a warning must come
 * once) and answers through the exit status. */
static int child(const char *mode) {
    if (strcmp(mode, "--child-ca") == 0) {
        bool a = gj_compiled_autograd_enabled(), b = gj_compiled_autograd_enabled();
        return a != b ? 2 : a ? 1 : 0;
    }
    if (strcmp(mode, "--child-log") == 0) {
        unsigned a = gj_jit_log_flags(), b = gj_jit_log_flags();
        return a != b ? 254 : (int)(a & 0xff);
    }
    if (strcmp(mode, "--child-threads") == 0) {
        int a = gj_get_num_threads(), b = gj_get_num_threads();
        return a != b ? 254 : a & 0xff;
    }
    if (strcmp(mode, "--child-backward") == 0) { /* one compiled backward, cache from the env */
        gj_jit_set_quiet(true);
        mlp m;
        gjt_rng r;
        gjt_rng_seed(&r, 77);
        m.w = gjt_uniform(&r, GJ_F32, 2, (int64_t[]){4, 6}, -0.5, 0.5);
        m.b = gjt_uniform(&r, GJ_F32, 1, (int64_t[]){4}, -0.5, 0.5);
        if (gj_set_requires_grad(m.w, true) || gj_set_requires_grad(m.b, true)) return 1;
        int rc = mlp_step(&m, true);
        gj_ca_stats s = gjt_ca_now();
        gjt_mlp_free(&m);
        gj_jit_clear_cache();
        return rc == 0 && s.fallbacks == 0 && s.compiles + s.disk_hits == 1 ? 0 : 1;
    }
    return 126;
}

int main(int argc, char **argv) {
    g_self = argv[0];
    if (argc > 1) return child(argv[1]);
    gj_jit_set_quiet(true);
    const char *only = getenv("GJT_FILTER"); /* run just these tests (cmocka pattern) */
    if (only && *only) cmocka_set_test_filter(only);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forged_plan), cmocka_unit_test(test_modes),
        cmocka_unit_test(test_entry_kinds), cmocka_unit_test(test_long_dir),
        cmocka_unit_test(test_tmp_name),    cmocka_unit_test(test_env_compiled),
        cmocka_unit_test(test_env_log),     cmocka_unit_test(test_env_threads),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    gj_jit_clear_cache();
    return rc;
}
