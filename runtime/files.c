/* SPDX-License-Identifier: MIT */
/*
 * files.c - files the library writes and reads back: the cache directory
 * (found, created and trusted), files in it read without trusting them,
 * and every file written whole under a temporary name and renamed into
 * place (the program cache, the GEMM choices, safetensors and llm.c
 * files).
 *
 * Invariants:
 *   - A directory is opened one component at a time (openat, so a path
 *     may have any length), missing components created 0700 on request;
 *     the last one is used only if it is a directory owned by this user
 *     and not writable by group or others (gj_rt_file_trusted). Nothing
 *     here follows a symlink in the last component of a file it opens.
 *   - A file read from such a directory is opened without blocking or
 *     following a symlink, and is read only if it is a regular, trusted
 *     file of at most the caller's size limit; it is read whole, its size
 *     exact, or not at all.
 *   - A sink (gj_rt_sink_*) writes a new file of a fresh random name in
 *     the target's directory, created O_CREAT|O_EXCL|O_NOFOLLOW with the
 *     caller's mode (less the umask: 0600 for cache files), and
 *     renames it over the target only when every byte is written (and,
 *     on request, synced): readers never see half a file, two writers
 *     never share one, and a failure leaves the target as it was and no
 *     temporary file behind.
 *   - Nothing here sets the thread's error: every failure is described in
 *     the caller's why[] buffer, and the caller decides whether it is an
 *     error (a user's save) or a quiet miss (a cache).
 */
#define _GNU_SOURCE
#include "runtime/rt.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

bool gj_rt_file_trusted(const struct stat *st, char *why, size_t why_cap) {
    if (st->st_uid != geteuid()) {
        snprintf(why, why_cap, "owned by uid %u, not by this user (uid %u)", (unsigned)st->st_uid,
                 (unsigned)geteuid());
        return false;
    }
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(why, why_cap, "writable by group or others (mode %03o; chmod go-w it)",
                 (unsigned)(st->st_mode & 0777));
        return false;
    }
    return true;
}

int gj_rt_dir_open(const char *dir, bool create, char *why, size_t why_cap) {
    why[0] = '\0';
    size_t n = strlen(dir);
    char *copy = gj_rt_malloc(n + 1);
    int fd = -1;
    if (!copy) {
        snprintf(why, why_cap, "out of memory");
        return -1;
    }
    memcpy(copy, dir, n + 1);
    fd = open(dir[0] == '/' ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        goto sys_fail;
    for (char *c = copy; *c;) {
        size_t len = strcspn(c, "/");
        char *next = c + len + (c[len] == '/');
        c[len] = '\0';
        if (len > 0) {
            if (create && mkdirat(fd, c, 0700) != 0 && errno != EEXIST)
                goto sys_fail;
            int sub = openat(fd, c, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (sub < 0) {
                if (errno == ENOENT && !create)
                    goto fail; /* not there yet: why[] stays empty */
                if (errno == ENOTDIR) {
                    snprintf(why, why_cap, "its component '%s' is not a directory", c);
                    goto fail;
                }
                goto sys_fail;
            }
            close(fd);
            fd = sub;
        }
        c = next;
    }
    struct stat st;
    if (fstat(fd, &st) != 0)
        goto sys_fail;
    if (!gj_rt_file_trusted(&st, why, why_cap)) {
        close(fd);
        gj_rt_free(copy);
        return -2;
    }
    gj_rt_free(copy);
    return fd;
sys_fail:
    snprintf(why, why_cap, "cannot open or create it: %s", strerror(errno));
fail:
    if (fd >= 0)
        close(fd);
    gj_rt_free(copy);
    return -1;
}

int gj_rt_file_read(int dfd, const char *name, size_t max, unsigned char **data, size_t *len,
                    char *why, size_t why_cap) {
    *data = NULL;
    *len = 0;
    why[0] = '\0';
    int fd = openat(dfd, name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return 1;
        snprintf(why, why_cap, "cannot open it: %s", strerror(errno));
        return -1;
    }
    struct stat st;
    unsigned char *p = NULL;
    int rc = -1;
    if (fstat(fd, &st) != 0) {
        snprintf(why, why_cap, "cannot stat it: %s", strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, why_cap, "not a regular file");
        goto fail;
    }
    if (!gj_rt_file_trusted(&st, why, why_cap)) {
        rc = -2;
        goto fail;
    }
    if (st.st_size < 0 || (uint64_t)st.st_size > (uint64_t)max) {
        snprintf(why, why_cap, "%lld bytes, more than the %zu allowed", (long long)st.st_size, max);
        goto fail;
    }
    size_t n = (size_t)st.st_size;
    if (!(p = gj_rt_malloc(n ? n : 1))) {
        snprintf(why, why_cap, "out of memory (%zu bytes)", n);
        goto fail;
    }
    if (gj_rt_read_all(fd, p, n) != 0) {
        snprintf(why, why_cap, "short read (the file changed while it was read?)");
        goto fail;
    }
    close(fd);
    *data = p;
    *len = n;
    return 0;
fail:
    gj_rt_free(p);
    close(fd);
    return rc;
}

int gj_rt_read_all(int fd, void *buf, size_t n) {
    unsigned char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

bool gj_rt_dir_lock(int dfd, int max_ms) {
    for (int i = 0; i <= max_ms; i++) {
        if (flock(dfd, LOCK_EX | LOCK_NB) == 0)
            return true;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return false;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    return false;
}

void gj_rt_dir_unlock(int dfd) { flock(dfd, LOCK_UN); }

uint64_t gj_rt_nonce64(void) {
    static atomic_ullong counter;
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        r = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 16) ^
            (uint64_t)(uintptr_t)&r;
    }
    r ^= atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull;
    r ^= r >> 31; /* mix the counter into every bit */
    r *= 0xbf58476d1ce4e5b9ull;
    return r ^ (r >> 29);
}

/* ------------------------------------------------------------------ sinks */

/* The directory part of path (".", "/" or its leading components) and the
 * last component, for openat. 0, or -1 (out of memory). */
static int split_path(const char *path, char **dir, const char **base) {
    const char *slash = strrchr(path, '/');
    size_t dl = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    *dir = gj_rt_malloc(dl + 1);
    if (!*dir)
        return -1;
    memcpy(*dir, slash ? path : ".", dl);
    (*dir)[dl] = '\0';
    *base = slash ? slash + 1 : path;
    return 0;
}

int gj_rt_sink_open(gj_rt_sink *s, int dfd, const char *name, const char *tmp_prefix,
                    unsigned mode, char *why, size_t why_cap) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->dfd = -1;
    why[0] = '\0';
    const char *base = name;
    char *dir = NULL;
    if (dfd < 0) { /* a path: its own directory */
        if (split_path(name, &dir, &base) != 0) {
            snprintf(why, why_cap, "out of memory");
            return -1;
        }
        s->dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (s->dfd < 0) {
            if (errno == ENOENT)
                snprintf(why, why_cap, "the directory %s does not exist", dir);
            else
                snprintf(why, why_cap, "cannot open its directory %s: %s", dir, strerror(errno));
            gj_rt_free(dir);
            return -1;
        }
        gj_rt_free(dir);
        s->own_dfd = true;
    } else {
        s->dfd = dfd;
    }
    size_t bl = strlen(base);
    if (bl == 0 || bl > 200) {
        snprintf(why, why_cap, "no file name, or one longer than 200 bytes");
        goto fail;
    }
    memcpy(s->name, base, bl + 1);
    for (int attempt = 0; attempt < 16 && s->fd < 0; attempt++) {
        if (tmp_prefix)
            snprintf(s->tmp, sizeof s->tmp, "%s%016llx", tmp_prefix,
                     (unsigned long long)gj_rt_nonce64());
        else
            snprintf(s->tmp, sizeof s->tmp, ".%s.tmp-%016llx", base,
                     (unsigned long long)gj_rt_nonce64());
        s->fd = openat(s->dfd, s->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                       (mode_t)mode);
        if (s->fd < 0 && errno != EEXIST)
            break;
    }
    if (s->fd < 0) {
        snprintf(why, why_cap, "cannot create a temporary file in its directory: %s",
                 strerror(errno));
        goto fail;
    }
    return 0;
fail:
    if (s->own_dfd && s->dfd >= 0)
        close(s->dfd);
    s->dfd = -1;
    return -1;
}

int gj_rt_sink_write(gj_rt_sink *s, const void *buf, size_t n, char *why, size_t why_cap) {
    const unsigned char *p = buf;
    while (n > 0) {
        ssize_t w = write(s->fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            snprintf(why, why_cap, "write: %s", w < 0 ? strerror(errno) : "no progress");
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int gj_rt_sink_close(gj_rt_sink *s, bool ok, bool sync, char *why, size_t why_cap) {
    int rc = ok ? 0 : -1;
    if (s->fd < 0)
        return -1;
    if (rc == 0 && sync && fsync(s->fd) != 0) {
        snprintf(why, why_cap, "fsync of the temporary file: %s", strerror(errno));
        rc = -1;
    }
    if (close(s->fd) != 0 && rc == 0) {
        snprintf(why, why_cap, "close of the temporary file: %s", strerror(errno));
        rc = -1;
    }
    if (rc == 0 && renameat(s->dfd, s->tmp, s->dfd, s->name) != 0) {
        snprintf(why, why_cap, "rename of the temporary file onto it: %s", strerror(errno));
        rc = -1;
    }
    if (rc != 0)
        unlinkat(s->dfd, s->tmp, 0);
    if (s->own_dfd)
        close(s->dfd);
    s->fd = -1;
    s->dfd = -1;
    return rc;
}

int gj_rt_file_write(int dfd, const char *name, const char *tmp_prefix, unsigned mode,
                     const void *data, size_t n, bool sync, char *why, size_t why_cap) {
    gj_rt_sink s;
    if (gj_rt_sink_open(&s, dfd, name, tmp_prefix, mode, why, why_cap) != 0)
        return -1;
    int w = gj_rt_sink_write(&s, data, n, why, why_cap);
    return gj_rt_sink_close(&s, w == 0, sync, why, why_cap);
}

/* ------------------------------------------------------- one-time notes */

void gj_rt_warn_once(const char *fmt, ...) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static uint64_t seen[64];
    static int n_seen;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the message */
    for (const char *c = msg; *c; c++) {
        h ^= (unsigned char)*c;
        h *= 1099511628211ull;
    }
    pthread_mutex_lock(&lock);
    bool fresh = true;
    for (int i = 0; i < n_seen && i < 64; i++)
        fresh &= seen[i] != h;
    if (fresh) {
        seen[n_seen % 64] = h;
        n_seen = n_seen < 64 ? n_seen + 1 : 64 + (n_seen + 1) % 64;
        fprintf(stderr, "gradjit: %s\n", msg);
    }
    pthread_mutex_unlock(&lock);
}
