/* SPDX-License-Identifier: MIT */
/*
 * diskcache.c - programs (plan + roles + object code) in the on-disk cache.
 *
 * File layout (native byte order: the host id pins the machine):
 *   "GJJITC13"                     magic and format version (bumped whenever
 *                                  plan or lowering semantics change: 02 adds
 *                                  MAX stores, index instructions, f64 decompositions; 03: 512-bit kernels;
 *                                  04: the plan written field by field, see put_plan;
 *                                  05: dropout parameters read from checkpoint tapes;
 *                                  06: fold instructions, IM2COL / COL2IM;
 *                                  07: generic (symbolic) plans;
 *                                  08: hook and custom call instructions, lent kernels;
 *                                  09: generic kernels in plans that are not;
 *                                  10: bf16 GEMMs as wide products of bf16 operands;
 *                                  11: attention kernels, linear cross-entropy instructions;
 *                                  12: a linear cross-entropy's outputs at offsets,
 *                                  x * 1 planned as x, PAD fills only its gaps;
 *                                  13: the attention bitcode not vectorised by
 *                                  clang, so older entries' slower attention
 *                                  code is compiled again)
 *   u64 layout                     sizes of the serialised structs
 *   str library version, str host id, str key, str symbol prefix
 *   blob plan                      see put_plan
 *   blob object                    the object code of the kernels the program
 *                                  compiled itself (empty when it compiled none)
 *   u64 parts, then per part:      the code of kernels it borrowed from other
 *     str prefix, blob object      programs (cache/kernels.c's registry), whole
 *   u64 lent, then per kernel:     each borrowed kernel instruction: the part and the
 *     u64 instruction, u64 part, str sym  symbol it calls
 *   u64[2] checksum                gj_jit_hash128 of everything before
 * An entry is whole by itself: a later process loads a program that shared
 * kernels without the programs it shared them with. A part whose prefix a
 * code object of the process already has is that code (codegen.h), so loading
 * the lender later, or two borrowers, adds no object code twice.
 * A symbolic entry (a symbolic program filed under its kernels, for every
 * size) has the same layout: its key is "gradjit-symbolic v1 <hash of the
 * signature>", its plan blob the kernel signature (plan/symbolic.c), its prefix
 * the random "gjs<32 hex>" its code was compiled with.
 * (str and blob: u64 length, then the bytes.)
 * A hint (gj_jit_disk_hint_*) is a decision a plan took long to make,
 * filed like an entry under the hash of "gradjit-hint v1 <tag> <key
 * hash>" (so the limit counts and evicts it as one):
 *   "GJJITH01", u64 layout, str library version, u64[2] key hash,
 *   u64 n, i64 values[n], u64[2] checksum
 * Its reader checks every field and uses the values only as a guess that
 * the caller verifies (a memory budget's choice is planned again and
 * taken only if it fits).
 *
 * Invariants (docs/architecture.md, "The cache trusts nothing it reads"):
 *   - The plan in a file is never parsed. A load gets the program the
 *     caller planned from this run's captured graph and accepts the file
 *     only if its plan blob is byte for byte the serialisation of that
 *     plan: what runs is always the plan of this process, and the object
 *     code was compiled for exactly that plan. Any other field is bounds-
 *     checked (rbuf) before use; on any failure the caller compiles.
 *   - The directory is opened one component at a time (openat, so its
 *     path may have any length) and created 0700; it is used only if it is
 *     a directory owned by this user and not writable by group or others.
 *     An entry is opened without blocking or following a symlink
 *     (O_RDONLY|O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC) and used only if it is a
 *     regular file of at most GJ_DISK_MAX_BYTES with the same owner and
 *     mode rules. A refusal for ownership or mode is reported on stderr
 *     once per message and process.
 *   - Entries are written to a temporary file of a new random name created
 *     with O_CREAT|O_EXCL|O_NOFOLLOW, 0600, then renamed over the entry, so
 *     readers never see half a file and two writers never share a file.
 *   - Size limit (gj_jit_disk_limit: GRADJIT_CACHE_DISK_LIMIT, default
 *     GJ_JIT_DISK_LIMIT_DEFAULT): after each save the directory is listed
 *     and our entries -- exactly the names <32 lowercase hex>.gjc, lstat'ed
 *     without following links, regular files owned by this user -- are
 *     summed; while the sum is over the limit the least recently used one
 *     (oldest modification time; a used load sets it to the present) is
 *     unlinked, never the entry just written. A temporary file of ours
 *     (exactly the pattern of the temporary names its writes use, ".gjc-" and 16
 *     hex digits (runtime/files.c), a regular file of this user) is not
 *     counted, and is deleted once it is more than an hour old (a writer
 *     died before its rename). Anything else in the directory (other
 *     names, symlinks, directories, other users' files) is neither
 *     counted nor deleted. unlinkat never follows
 *     a link, and the directory is private to the user, so the worst a
 *     race does is delete an entry another process of ours just wrote
 *     (it is compiled again).
 *   - Nothing here sets the thread's error message: a cache problem is
 *     never the caller's error.
 */
#include "jit/cache/cache_int.h"
#include "jit/jit.h"
#include "jit/base/base.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char g_magic[8] = {'G', 'J', 'J', 'I', 'T', 'C', '1', '3'};

/* Largest entry read: a bigger file is rejected without being read. */
#define GJ_DISK_MAX_BYTES ((off_t)256 << 20)

/* ------------------------------------------------------------ the dir */

static pthread_mutex_t g_dir_lock = PTHREAD_MUTEX_INITIALIZER;
static char *g_dir_override; /* gj_rt_malloc'd */
static int g_dir_mode = -1;  /* -1: environment, 0: off, 1: override */

void gj_jit_set_disk_cache(const char *dir) {
    pthread_mutex_lock(&g_dir_lock);
    gj_rt_free(g_dir_override);
    g_dir_override = NULL;
    g_dir_mode = 0;
    if (dir && *dir) {
        size_t n = strlen(dir);
        g_dir_override = gj_rt_malloc(n + 1);
        if (g_dir_override) { /* out of memory: the disk cache stays off */
            memcpy(g_dir_override, dir, n + 1);
            g_dir_mode = 1;
        }
    }
    pthread_mutex_unlock(&g_dir_lock);
}

void gj_jit_default_disk_cache(void) {
    pthread_mutex_lock(&g_dir_lock);
    gj_rt_free(g_dir_override);
    g_dir_override = NULL;
    g_dir_mode = -1;
    pthread_mutex_unlock(&g_dir_lock);
}

/* The override, else the runtime's cache directory (GRADJIT_CACHE_DIR,
 * XDG_CACHE_HOME or HOME, read once: runtime/settings.c). */
const char *gj_jit_disk_dir(void) {
    const char *r = NULL;
    pthread_mutex_lock(&g_dir_lock);
    if (g_dir_mode == 1) r = g_dir_override;
    else if (g_dir_mode < 0) r = gj_rt_env_cache_dir();
    pthread_mutex_unlock(&g_dir_lock);
    return r;
}

/* Directory dir opened (runtime/files.c: created 0700 when create, used
 * only if trusted). A refusal for ownership or mode is reported once per
 * message and process on stderr. The descriptor, or -1 with why[] set
 * (empty: it does not exist and create is false). */
static int open_dir(const char *dir, bool create, char *why, size_t why_cap) {
    char how[200];
    int fd = gj_rt_dir_open(dir, create, how, sizeof how);
    if (fd == -2) {
        gj_rt_warn_once("disk cache directory %s is %s: not used, compiling instead", dir, how);
        snprintf(why, why_cap, "directory %s", how);
    } else if (fd < 0) {
        snprintf(why, why_cap, "%s", how);
    }
    return fd < 0 ? -1 : fd;
}

static void entry_name(char out[40], const uint64_t h[2]) {
    snprintf(out, 40, "%016llx%016llx.gjc", (unsigned long long)h[0], (unsigned long long)h[1]);
}

static bool all_hex(const char *s, int n) {
    for (int i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

/* Whether name is exactly what entry_name makes: 32 lowercase hex digits
 * and ".gjc". */
static bool is_entry_name(const char *name) {
    return strlen(name) == 36 && all_hex(name, 32) && strcmp(name + 32, ".gjc") == 0;
}

/* Whether name is exactly a temporary name of ours: ".gjc-" and 16 lowercase
 * hex digits. */
static bool is_tmp_name(const char *name) {
    return strlen(name) == 21 && strncmp(name, ".gjc-", 5) == 0 && all_hex(name + 5, 16);
}

/* A temporary file older than this was left by a writer that died between
 * creating and renaming it (a save takes well under a second). */
#define GJ_DISK_STALE_TMP_SEC 3600

/* ----------------------------------------------------------- the limit */

typedef struct disk_entry {
    char name[40];
    int64_t size;
    struct timespec mtime;
} disk_entry;

/* Older first; equal times by name (a total order, so the result does not
 * depend on the listing's order). */
static int older_first(const void *a, const void *b) {
    const disk_entry *x = a, *y = b;
    if (x->mtime.tv_sec != y->mtime.tv_sec) return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
    if (x->mtime.tv_nsec != y->mtime.tv_nsec) return x->mtime.tv_nsec < y->mtime.tv_nsec ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Keeps our entries in directory dfd (path dir, for messages) within
 * limit bytes, least recently used first, never deleting `keep` (see the
 * file comment). Fills *u. 0, or -1 (listing failed or out of memory:
 * nothing deleted beyond what *u counts). */
static int trim_dir(int dfd, const char *dir, const char *keep, int64_t limit,
                    gj_jit_disk_usage *u, char *why, size_t why_cap) {
    bool log = (gj_jit_log_flags() & GJ_JIT_LOG_CACHE) != 0;
    int lfd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
    disk_entry *v = NULL;
    int n = 0, cap = 0, rc = -1;
    int64_t total = 0;
    if (!d) {
        if (lfd >= 0) close(lfd);
        snprintf(why, why_cap, "cannot list the directory: %s", strerror(errno));
        return -1;
    }
    uid_t me = geteuid();
    time_t now = time(NULL);
    for (struct dirent *de; (de = readdir(d));) {
        bool entry = is_entry_name(de->d_name), tmp = !entry && is_tmp_name(de->d_name);
        if (!entry && !tmp) continue;
        struct stat st;
        if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue; /* gone */
        if (!S_ISREG(st.st_mode) || st.st_uid != me) continue; /* not ours */
        if (tmp) { /* never counted; deleted once clearly abandoned */
            if (now - st.st_mtim.tv_sec > GJ_DISK_STALE_TMP_SEC &&
                unlinkat(dfd, de->d_name, 0) == 0 && log)
                fprintf(stderr, "[gradjit cache] deleted %s/%s: a temporary file abandoned by a "
                                "writer that did not finish\n", dir, de->d_name);
            continue;
        }
        if (n == cap) {
            int nc = cap ? cap * 2 : 64;
            disk_entry *nv = gj_rt_realloc(v, (size_t)nc * sizeof *nv);
            if (!nv) {
                snprintf(why, why_cap, "out of memory");
                goto done;
            }
            v = nv;
            cap = nc;
        }
        memcpy(v[n].name, de->d_name, 37);
        v[n].size = (int64_t)st.st_size;
        v[n].mtime = st.st_mtim;
        total += v[n].size;
        n++;
    }
    if (limit >= 0 && total > limit) {
        qsort(v, (size_t)n, sizeof *v, older_first);
        for (int i = 0; i < n && total > limit; i++) {
            if (strcmp(v[i].name, keep) == 0) continue;
            if (unlinkat(dfd, v[i].name, 0) != 0 && errno != ENOENT) continue;
            total -= v[i].size;
            u->evictions++;
            if (log)
                fprintf(stderr,
                        "[gradjit cache] disk evicted %s/%s (%lld bytes, least recently used): "
                        "limit %lld bytes\n",
                        dir, v[i].name, (long long)v[i].size, (long long)limit);
        }
    }
    u->bytes = total;
    rc = 0;
done:
    closedir(d); /* closes lfd */
    gj_rt_free(v);
    return rc;
}

/* ------------------------------------------------------------ buffers */

static void put_blob(wbuf *b, const void *src, size_t n) {
    wbuf_u64(b, n);
    wbuf_put(b, src, n);
}

static void put_ints(wbuf *b, const int *v, int n) {
    wbuf_i64(b, n);
    for (int i = 0; i < n; i++) wbuf_i64(b, v[i]);
}

typedef struct rbuf {
    const unsigned char *p;
    size_t n, pos;
    bool bad;
} rbuf;

static uint64_t get_u64(rbuf *b) {
    uint64_t v = 0;
    if (b->bad || sizeof v > b->n - b->pos) {
        b->bad = true;
        return 0;
    }
    memcpy(&v, b->p + b->pos, sizeof v);
    b->pos += sizeof v;
    return v;
}

/* A blob in place (pointer into the buffer; NULL and b->bad if its length
 * runs past the end). */
static const unsigned char *get_blob(rbuf *b, size_t *n) {
    uint64_t len = get_u64(b);
    if (b->bad || len > b->n - b->pos) {
        b->bad = true;
        *n = 0;
        return NULL;
    }
    const unsigned char *q = b->p + b->pos;
    b->pos += (size_t)len;
    *n = (size_t)len;
    return q;
}

static uint64_t layout_signature(void) {
    uint64_t s[] = {sizeof(gj_jit_buffer), sizeof(gj_jit_access), sizeof(gj_jit_expr),
                    sizeof(gj_jit_store),  sizeof(gj_jit_kernel), sizeof(gj_jit_matmul),
                    sizeof(gj_rt_meta),    sizeof(gj_jit_input),  sizeof(gj_jit_output),
                    sizeof(gj_jit_index),  GJ_MAX_DIMS,           (uint64_t)GJ_P_COUNT,
                    sizeof(gj_jit_fold),   sizeof(gj_jit_hook_instr), sizeof(gj_jit_call_instr),
                    sizeof(gj_jit_hookref), sizeof(gj_jit_lce)};
    uint64_t h[2];
    gj_jit_hash128(s, sizeof s, h);
    return h[0];
}

/* --------------------------------------------------------------- plan */

static void put_meta(wbuf *b, const gj_rt_meta *m) {
    wbuf_i64(b, m->dtype);
    wbuf_i64(b, m->ndim);
    wbuf_dims(b, m->shape, m->ndim);
}

static void put_kernel(wbuf *b, const gj_jit_kernel *k) {
    wbuf_i64(b, k->nd);
    wbuf_dims(b, k->dims, k->nd);
    wbuf_u64(b, k->red);
    wbuf_i64(b, k->n_acc);
    for (int a = 0; a < k->n_acc; a++) {
        const gj_jit_access *x = &k->acc[a];
        wbuf_i64(b, x->buf);
        wbuf_i64(b, x->dtype);
        wbuf_i64(b, x->offset);
        wbuf_dims(b, x->strides, k->nd);
    }
    wbuf_kernel_code(b, k, false);
    wbuf_i64(b, k->block);
    wbuf_i64(b, k->nblk);
    wbuf_i64(b, k->rows);
    wbuf_i64(b, k->grain);
    put_ints(b, k->param_buf, k->n_params);
    put_blob(b, k->name, strnlen(k->name, sizeof k->name));
    wbuf_u64(b, k->generic); /* (its integer table then comes from this process's plan) */
}

static void put_matmul(wbuf *b, const gj_jit_matmul *m) {
    wbuf_i64(b, m->dtype);
    wbuf_u64(b, (uint64_t)m->accumulate | (uint64_t)m->ta << 1 | (uint64_t)m->tb << 2 |
                    (uint64_t)m->bf16 << 3);
    wbuf_i64(b, m->a_buf);
    wbuf_i64(b, m->b_buf);
    wbuf_i64(b, m->c_buf);
    wbuf_i64(b, m->M);
    wbuf_i64(b, m->N);
    wbuf_i64(b, m->K);
    wbuf_i64(b, m->lda);
    wbuf_i64(b, m->ldb);
    wbuf_i64(b, m->a_off);
    wbuf_i64(b, m->b_off);
    wbuf_i64(b, m->nb);
    wbuf_dims(b, m->bshape, m->nb);
    wbuf_dims(b, m->a_bstr, m->nb);
    wbuf_dims(b, m->b_bstr, m->nb);
}

static void put_index(wbuf *b, const gj_jit_index *x) {
    wbuf_u64(b, x->scatter);
    wbuf_i64(b, x->dtype);
    wbuf_i64(b, x->src_buf);
    wbuf_i64(b, x->idx_buf);
    wbuf_i64(b, x->out_buf);
    wbuf_i64(b, x->n);
    wbuf_i64(b, x->D);
    wbuf_i64(b, x->V);
    wbuf_i64(b, x->src_off);
    wbuf_i64(b, x->src_s0);
    wbuf_i64(b, x->src_s1);
}

static void put_fold(wbuf *b, const gj_jit_fold *x) {
    const gj_rt_win *w = &x->win;
    wbuf_u64(b, x->col2im);
    wbuf_i64(b, x->dtype);
    wbuf_i64(b, x->src_buf);
    wbuf_i64(b, x->out_buf);
    wbuf_i64(b, x->src_off);
    wbuf_dims(b, x->src_st, x->col2im ? 6 : 4);
    int64_t g[14] = {w->N, w->C, w->H, w->W, w->kh, w->kw, w->sh,
                     w->sw, w->ph, w->pw, w->dh, w->dw, w->OH, w->OW};
    for (int k = 0; k < 14; k++) wbuf_i64(b, g[k]);
    wbuf_f64(b, x->pad);
}

static void put_lce(wbuf *b, const gj_jit_lce *x) {
    int64_t v[] = {x->dtype, x->grad, x->N, x->C, x->V, x->ignore, x->h_buf, x->w_buf,
                   x->lab_buf, x->b_buf, x->h_off, x->w_off, x->lab_off, x->b_off,
                   x->out_buf[0], x->out_buf[1], x->out_buf[2], x->out_buf[3],
                   x->out_off[0], x->out_off[1], x->out_off[2], x->out_off[3]};
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++) wbuf_i64(b, v[k]);
}

static void put_hook_instr(wbuf *b, const gj_jit_hook_instr *x) {
    wbuf_i64(b, x->hook);
    wbuf_i64(b, x->src_buf);
    wbuf_i64(b, x->out_buf);
    put_meta(b, &x->meta);
}

static void put_call_instr(wbuf *b, const gj_jit_call_instr *x) {
    wbuf_u64(b, x->fwd);
    wbuf_i64(b, x->node);
    wbuf_i64(b, x->tape);
    wbuf_u64(b, x->args);
    wbuf_i64(b, x->n_in);
    for (int k = 0; k < x->n_in; k++) {
        wbuf_i64(b, x->src_buf[k]);
        put_meta(b, &x->in_meta[k]);
    }
    wbuf_i64(b, x->n_out);
    for (int k = 0; k < x->n_out; k++) {
        wbuf_i64(b, x->out_buf[k]);
        put_meta(b, &x->out_meta[k]);
    }
}

/* The canonical serialisation of program pr: every field that the plan's
 * execution or its object code depends on, one 8-byte word each (no
 * padding, no pointers), so the same graph planned by the same library on
 * the same host gives the same bytes. The file holds it, and a load
 * compares it with this process's plan. Hook and custom call instructions name
 * their hook or op by canonical position (the program resolves them at
 * each run), never by address. */
static void put_plan(wbuf *b, const gj_jit_program *pr) {
    const gj_jit_plan *p = &pr->plan;
    wbuf_i64(b, p->n_inputs);
    for (int i = 0; i < p->n_inputs; i++) put_meta(b, &p->in_meta[i]);
    wbuf_i64(b, p->n_outputs);
    for (int o = 0; o < p->n_outputs; o++) put_meta(b, &p->out_meta[o]);
    put_ints(b, p->out_buf, p->n_outputs);
    wbuf_u64(b, pr->recapture);
    wbuf_i64(b, pr->n_inputs);
    for (int i = 0; i < pr->n_inputs; i++) {
        const gj_jit_input *x = &pr->inputs[i];
        wbuf_i64(b, x->role);
        wbuf_i64(b, x->value);
        wbuf_i64(b, x->node);
        wbuf_i64(b, x->slot);
        wbuf_dims(b, x->strides, i < p->n_inputs ? p->in_meta[i].ndim : 0);
    }
    wbuf_i64(b, pr->n_outputs);
    for (int o = 0; o < pr->n_outputs; o++) {
        wbuf_i64(b, pr->outputs[o].value);
        wbuf_i64(b, pr->outputs[o].acc_node);
        wbuf_i64(b, pr->outputs[o].grad_input);
    }
    wbuf_i64(b, pr->n_hooks);
    for (int h = 0; h < pr->n_hooks; h++) {
        const gj_jit_hookref *x = &pr->hooks[h];
        wbuf_i64(b, x->node);
        wbuf_i64(b, x->k);
        wbuf_i64(b, x->j);
        wbuf_u64(b, x->post);
        wbuf_i64(b, x->n_out);
    }
    wbuf_i64(b, pr->n_calls);
    wbuf_i64(b, p->n_bufs);
    for (int i = 0; i < p->n_bufs; i++) {
        const gj_jit_buffer *x = &p->bufs[i];
        wbuf_i64(b, x->kind);
        wbuf_i64(b, x->index);
        wbuf_i64(b, x->dtype);
        wbuf_i64(b, x->numel);
        wbuf_u64(b, x->nbytes);
        wbuf_i64(b, x->first_instr);
        wbuf_i64(b, x->last_instr);
        wbuf_i64(b, x->gen_inner);
        wbuf_i64(b, x->gen_len);
        wbuf_u64(b, x->gen_seed);
        wbuf_u64(b, x->gen_offset);
        wbuf_i64(b, x->gen_param);
        wbuf_f64(b, x->gen_p);
    }
    wbuf_i64(b, p->n_instrs);
    for (int s = 0; s < p->n_instrs; s++) {
        const gj_jit_instr *st = &p->instrs[s];
        wbuf_i64(b, st->kind);
        if (st->kind == GJ_JIT_INSTR_MATMUL) put_matmul(b, &st->mm);
        else if (st->kind == GJ_JIT_INSTR_INDEX) put_index(b, &st->ix);
        else if (st->kind == GJ_JIT_INSTR_FOLD) put_fold(b, &st->fd);
        else if (st->kind == GJ_JIT_INSTR_LCE) put_lce(b, &st->lc);
        else if (st->kind == GJ_JIT_INSTR_HOOK) put_hook_instr(b, &st->hk);
        else if (st->kind == GJ_JIT_INSTR_CALL) put_call_instr(b, &st->cs);
        else put_kernel(b, &st->k);
    }
    put_ints(b, p->rt_param_node, p->n_rt_params);
    put_ints(b, p->rt_param_tape, p->n_rt_params);
    wbuf_i64(b, p->params_buf);
    wbuf_u64(b, p->peak_temp_bytes);
    put_ints(b, p->by_first, p->n_by_first);
    put_ints(b, p->by_last, p->n_by_last);
    wbuf_u64(b, p->generic); /* symbolic kernels take their integer table */
}

int gj_jit_program_prefix(const gj_jit_key *w, const gj_jit_program *pr, char out[48]) {
    wbuf b = {0};
    wbuf_u64(&b, w->hash[0]);
    wbuf_u64(&b, w->hash[1]);
    put_plan(&b, pr);
    if (b.oom) {
        gj_rt_free(b.p);
        return -1;
    }
    uint64_t h[2];
    gj_jit_hash128(b.p, b.n, h);
    gj_rt_free(b.p);
    snprintf(out, 48, "gjk%016llx%016llx", (unsigned long long)h[0], (unsigned long long)h[1]);
    return 0;
}

/* Whether pr can live on disk: no instruction kind put_plan does not know. */
static bool disk_able(const gj_jit_program *pr) {
    for (int s = 0; s < pr->plan.n_instrs; s++) {
        gj_jit_instr_kind k = pr->plan.instrs[s].kind;
        if (k != GJ_JIT_INSTR_KERNEL && k != GJ_JIT_INSTR_MATMUL && k != GJ_JIT_INSTR_INDEX &&
            k != GJ_JIT_INSTR_FOLD && k != GJ_JIT_INSTR_HOOK && k != GJ_JIT_INSTR_CALL &&
            k != GJ_JIT_INSTR_LCE)
            return false;
    }
    return true;
}

/* ---------------------------------------------------------- save/load */

/* What names an entry and what a load compares: its key text and hash
 * (the file name), and the bytes its plan blob must equal (a program's
 * serialised plan, or a symbolic entry's kernel signature). */
typedef struct entry_id {
    const char *key;
    size_t key_len;
    uint64_t hash[2];
    const wbuf *plan;
} entry_id;

/* The part of pr's lent code objects (pr->shared) that kernel k borrowed
 * from: the one whose prefix starts k->lent, or -1. */
static int part_of(const gj_jit_program *pr, const gj_jit_kernel *k) {
    for (int c = 0; c < pr->n_shared; c++) {
        const char *pre = gj_jit_code_prefix(pr->shared[c]);
        size_t n = strlen(pre);
        if (n > 0 && strncmp(k->lent, pre, n) == 0 && k->lent[n] == '_') return c;
    }
    return -1;
}

/* Appends pr's object code to b: its own (the kernels it compiled), then
 * the code of every kernel it borrowed and where each borrowed kernel is
 * (see the file layout). 0, or -1 with why[] set when some code kept no
 * copy of its object code (the disk cache was off when it was made). */
static int put_objects(wbuf *b, const gj_jit_program *pr, char *why, size_t why_cap) {
    size_t on = 0;
    const void *own = pr->code ? gj_jit_code_object(pr->code, &on) : NULL;
    bool compiled = false; /* some kernel is its own */
    for (int s = 0; s < pr->plan.n_instrs; s++)
        compiled |= pr->plan.instrs[s].kind == GJ_JIT_INSTR_KERNEL && !pr->plan.instrs[s].k.shared;
    if (compiled && !own) {
        snprintf(why, why_cap, "its object code was not kept (compiled while the disk cache "
                               "was off)");
        return -1;
    }
    put_blob(b, own, compiled ? on : 0);
    wbuf_u64(b, (uint64_t)pr->n_shared);
    for (int c = 0; c < pr->n_shared; c++) {
        size_t n;
        const void *obj = gj_jit_code_object(pr->shared[c], &n);
        if (!obj) {
            snprintf(why, why_cap, "the code of kernels it shares with another program was not "
                                   "kept (compiled while the disk cache was off)");
            return -1;
        }
        const char *pre = gj_jit_code_prefix(pr->shared[c]);
        put_blob(b, pre, strlen(pre));
        put_blob(b, obj, n);
    }
    int64_t n_lent = 0;
    for (int s = 0; s < pr->plan.n_instrs; s++)
        n_lent += pr->plan.instrs[s].kind == GJ_JIT_INSTR_KERNEL && pr->plan.instrs[s].k.shared;
    wbuf_i64(b, n_lent);
    for (int s = 0; s < pr->plan.n_instrs; s++) {
        const gj_jit_kernel *k = &pr->plan.instrs[s].k;
        if (pr->plan.instrs[s].kind != GJ_JIT_INSTR_KERNEL || !k->shared) continue;
        int part = part_of(pr, k);
        if (part < 0) {
            snprintf(why, why_cap, "a shared kernel's code is not among the program's");
            return -1;
        }
        wbuf_i64(b, s);
        wbuf_i64(b, part);
        put_blob(b, k->lent, strnlen(k->lent, sizeof k->lent));
    }
    return 0;
}

static int save_entry(const entry_id *id, const gj_jit_program *pr, const char *prefix,
                      gj_jit_disk_usage *u) {
    gj_jit_disk_usage scratch;
    if (!u) u = &scratch;
    u->evictions = 0;
    u->bytes = -1;
    const char *dir = gj_jit_disk_dir();
    const char *host = gj_jit_host_id();
    bool log = (gj_jit_log_flags() & GJ_JIT_LOG_CACHE) != 0;
    if (!dir) return -1;
    wbuf b = {0};
    int rc = -1, dfd = -1;
    char name[40], why[300] = "";
    if (!host[0]) {
        snprintf(why, sizeof why, "LLVM did not start");
        goto done;
    }
    wbuf_put(&b, g_magic, sizeof g_magic);
    wbuf_u64(&b, layout_signature());
    put_blob(&b, GJ_VERSION_STR, strlen(GJ_VERSION_STR));
    put_blob(&b, host, strlen(host));
    put_blob(&b, id->key, id->key_len);
    put_blob(&b, prefix, strlen(prefix));
    put_blob(&b, id->plan->p, id->plan->n);
    if (put_objects(&b, pr, why, sizeof why) != 0) goto done;
    if (b.oom || id->plan->oom) {
        snprintf(why, sizeof why, "out of memory");
        goto done;
    }
    uint64_t h[2];
    gj_jit_hash128(b.p, b.n, h);
    wbuf_put(&b, h, sizeof h);
    if (b.oom) {
        snprintf(why, sizeof why, "out of memory");
        goto done;
    }
    if ((uint64_t)b.n > (uint64_t)GJ_DISK_MAX_BYTES) { /* a load would reject it */
        snprintf(why, sizeof why, "%zu bytes, more than the limit", b.n);
        goto done;
    }
    dfd = open_dir(dir, true, why, sizeof why);
    if (dfd < 0) goto done;
    entry_name(name, id->hash);
    if (gj_rt_file_write(dfd, name, ".gjc-", 0600, b.p, b.n, false, why, sizeof why) != 0)
        goto done;
    rc = 0;
    if (log)
        fprintf(stderr, "[gradjit cache] saved %s/%s (%zu bytes%s)\n", dir, name, b.n,
                pr->n_shared ? ", with the code of the kernels it shares" : "");
    if (trim_dir(dfd, dir, name, gj_jit_disk_limit(), u, why, sizeof why) != 0 && log)
        fprintf(stderr, "[gradjit cache] could not apply the size limit to %s: %s\n", dir, why);
done:
    if (dfd >= 0) close(dfd);
    if (rc != 0 && log)
        fprintf(stderr, "[gradjit cache] not saved to %s: %s\n", dir,
                why[0] ? why : "unknown reason");
    gj_rt_free(b.p);
    return rc;
}

int gj_jit_disk_save(const gj_jit_key *w, const gj_jit_program *pr, const char *prefix,
                     gj_jit_disk_usage *u) {
    if (u) *u = (gj_jit_disk_usage){0, -1};
    if (!disk_able(pr)) {
        if (gj_jit_log_flags() & GJ_JIT_LOG_CACHE)
            fprintf(stderr, "[gradjit cache] %016llx%016llx not saved: a step kind the disk "
                            "cache does not store\n",
                    (unsigned long long)w->hash[0], (unsigned long long)w->hash[1]);
        return -1;
    }
    wbuf pb = {0};
    put_plan(&pb, pr);
    entry_id id = {w->text, w->len, {w->hash[0], w->hash[1]}, &pb};
    int rc = save_entry(&id, pr, prefix, u);
    gj_rt_free(pb.p);
    return rc;
}

/* Whether s[0..n) is the symbol prefix of code gradjit compiled: "gjk"
 * (a program's, named after its key) or "gjs" (a symbolic program's, or a
 * fresh one) and 32 lowercase hex digits. */
static bool code_prefix(const unsigned char *s, size_t n) {
    if (n != 35 || (memcmp(s, "gjs", 3) != 0 && memcmp(s, "gjk", 3) != 0)) return false;
    for (size_t i = 3; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

/* Loads the object sections of an entry (b at the own object) into pr:
 * the borrowed parts first (pr->shared, each a code object of the process,
 * deduplicated by prefix), the borrowed kernels marked shared and looked
 * up in them, then its own code (pr->code) for the rest, under prefix
 * (own, whose length is own_n; NULL when the entry has no own code). 0, or
 * -1 with why[] set and pr unchanged. */
static int load_objects(rbuf *b, gj_jit_program *pr, const char *prefix, char *why,
                        size_t why_cap) {
    gj_jit_plan *p = &pr->plan;
    size_t on;
    const unsigned char *own = get_blob(b, &on);
    uint64_t n_parts = get_u64(b);
    gj_jit_code **parts = NULL;
    int got = 0;
    if (b->bad || n_parts > 4096) {
        snprintf(why, why_cap, "damaged (layout)");
        return -1;
    }
    parts = gj_rt_calloc((size_t)n_parts + 1, sizeof *parts);
    if (!parts) {
        snprintf(why, why_cap, "out of memory");
        return -1;
    }
    char lwhy[300];
    for (uint64_t c = 0; c < n_parts; c++) {
        size_t pn, n;
        const unsigned char *pre = get_blob(b, &pn);
        const unsigned char *obj = get_blob(b, &n);
        if (b->bad || !code_prefix(pre, pn) || n == 0) {
            snprintf(why, why_cap, "damaged (a lent part)");
            goto fail;
        }
        char sym[GJ_JIT_PREFIX_MAX];
        memcpy(sym, pre, pn);
        sym[pn] = '\0';
        parts[got] = gj_jit_code_load(NULL, sym, obj, n, true, lwhy, sizeof lwhy);
        if (!parts[got]) {
            snprintf(why, why_cap, "%s", lwhy);
            goto fail;
        }
        got++;
    }
    uint64_t n_lent = get_u64(b);
    if (b->bad || n_lent > (uint64_t)p->n_instrs) {
        snprintf(why, why_cap, "damaged (layout)");
        goto fail;
    }
    for (uint64_t i = 0; i < n_lent; i++) {
        uint64_t s = get_u64(b), part = get_u64(b);
        size_t n;
        const unsigned char *sym = get_blob(b, &n);
        gj_jit_kernel *k = s < (uint64_t)p->n_instrs ? &p->instrs[s].k : NULL;
        if (b->bad || !k || p->instrs[s].kind != GJ_JIT_INSTR_KERNEL || k->shared ||
            part >= n_parts || n == 0 || n >= sizeof k->lent) {
            snprintf(why, why_cap, "damaged (a lent kernel)");
            goto fail;
        }
        memcpy(k->lent, sym, n);
        k->lent[n] = '\0';
        k->fn = gj_jit_code_lookup(parts[part], k->lent);
        k->shared = true;
        if (!k->fn) {
            snprintf(why, why_cap, "damaged (lent kernel %s not found)", k->lent);
            goto fail;
        }
    }
    if (b->bad || b->pos != b->n) {
        snprintf(why, why_cap, "damaged (layout)");
        goto fail;
    }
    bool compiled = false;
    for (int s = 0; s < p->n_instrs; s++)
        compiled |= p->instrs[s].kind == GJ_JIT_INSTR_KERNEL && !p->instrs[s].k.shared;
    if (compiled != (on > 0) || (on > 0 && !prefix)) {
        snprintf(why, why_cap, "damaged (its code does not cover its kernels)");
        goto fail;
    }
    if (on > 0) {
        pr->code = gj_jit_code_load(p, prefix, own, on, true, lwhy, sizeof lwhy);
        if (!pr->code) {
            snprintf(why, why_cap, "%s", lwhy);
            goto fail;
        }
    }
    if (got == 0) {
        gj_rt_free(parts);
        parts = NULL;
    }
    pr->shared = parts;
    pr->n_shared = got;
    return 0;
fail:
    for (int c = 0; c < got; c++) gj_jit_code_free(parts[c]);
    gj_rt_free(parts);
    for (int s = 0; s < p->n_instrs; s++) {
        gj_jit_kernel *k = &p->instrs[s].k;
        if (k->shared) {
            k->shared = false;
            k->fn = NULL;
            k->lent[0] = '\0';
        }
    }
    return -1;
}

/* One load_entry, carried from check to check: the entry's id, its
 * directory (dfd: open from le_read on, closed by load_entry), its bytes
 * (data, len: owned, freed by load_entry), the reader over them, and the symbol
 * prefix the entry names. Each check returns 0, or -1 with why[] set
 * (*found: an entry is there, refused). */
typedef struct loading {
    const entry_id *id;
    const char *dir;
    bool *found;
    char *why;
    size_t why_cap;
    char name[40];
    int dfd;
    unsigned char *data;
    size_t len;
    rbuf b;
    char sym[GJ_JIT_PREFIX_MAX];
    size_t sym_n;
} loading;

/* The entry's bytes (runtime/files.c: a regular file we own, in a
 * directory we trust, not too large, read whole) and their checksum (the
 * last 16 bytes). A refusal for ownership or mode is reported once. */
static int le_read(loading *l) {
    char *why = l->why, how[200];
    size_t why_cap = l->why_cap;
    l->dfd = open_dir(l->dir, false, why, why_cap);
    if (l->dfd < 0) {
        *l->found = why[0] != '\0'; /* a directory that exists but is refused */
        return -1;
    }
    int rc = gj_rt_file_read(l->dfd, l->name, (size_t)GJ_DISK_MAX_BYTES, &l->data, &l->len, how,
                             sizeof how);
    *l->found = rc != 1;
    if (rc == -2)
        gj_rt_warn_once("disk cache entry %s/%s is %s: not used, compiling instead", l->dir,
                        l->name, how);
    if (rc != 0) {
        snprintf(why, why_cap, "%s%s", rc == -2 ? "entry " : "", how); /* ELOOP: a symlink */
        return -1;
    }
    size_t len = l->len;
    if (len < sizeof g_magic + 16) {
        snprintf(why, why_cap, "damaged (truncated)");
        return -1;
    }
    uint64_t h[2], want[2];
    memcpy(want, l->data + len - 16, 16);
    gj_jit_hash128(l->data, len - 16, h);
    if (h[0] != want[0] || h[1] != want[1]) {
        snprintf(why, why_cap, "damaged (checksum)");
        return -1;
    }
    return 0;
}

/* The entry's head: format, library version, host, key, symbol prefix
 * (`prefix`, or a fresh one "gjs", or none), and its plan, which must be
 * this graph's byte for byte. Leaves l->b at the object code. */
static int le_head(loading *l, const char *prefix) {
    char *why = l->why;
    size_t why_cap = l->why_cap;
    const entry_id *id = l->id;
    rbuf *b = &l->b;
    *b = (rbuf){l->data, l->len - 16, 0, false};
    if (memcmp(l->data, g_magic, sizeof g_magic) != 0) {
        snprintf(why, why_cap, "stale (format)");
        return -1;
    }
    b->pos = sizeof g_magic;
    if (get_u64(b) != layout_signature()) {
        snprintf(why, why_cap, "stale (format)");
        return -1;
    }
    size_t n;
    const unsigned char *s = get_blob(b, &n);
    if (b->bad || n != strlen(GJ_VERSION_STR) || memcmp(s, GJ_VERSION_STR, n) != 0) {
        snprintf(why, why_cap, "stale (library version)");
        return -1;
    }
    const char *host = gj_jit_host_id();
    s = get_blob(b, &n);
    if (b->bad || n != strlen(host) || memcmp(s, host, n) != 0) {
        snprintf(why, why_cap, "stale (LLVM version, target or CPU features)");
        return -1;
    }
    s = get_blob(b, &n);
    if (b->bad || n != id->key_len || memcmp(s, id->key, n) != 0) {
        snprintf(why, why_cap, "another key with the same hash");
        return -1;
    }
    s = get_blob(b, &n);
    bool expected = prefix && n == strlen(prefix) && memcmp(s, prefix, n) == 0;
    bool fresh = n == 35 && memcmp(s, "gjs", 3) == 0 && code_prefix(s, n);
    if (b->bad || (n > 0 && !expected && !fresh)) {
        snprintf(why, why_cap, "damaged (symbol prefix)");
        return -1;
    }
    memcpy(l->sym, s, n);
    l->sym[n] = '\0';
    l->sym_n = n;
    size_t pn;
    const unsigned char *pdata = get_blob(b, &pn);
    if (b->bad) {
        snprintf(why, why_cap, "damaged (layout)");
        return -1;
    }
    if (pn != id->plan->n || memcmp(pdata, id->plan->p, pn) != 0) {
        snprintf(why, why_cap, "damaged or stale (its plan is not this graph's plan)");
        return -1;
    }
    return 0;
}

/* Loads entry id's object code into pr (see gj_jit_disk_load). The
 * entry's symbol prefix must be `prefix` (NULL: none expected) or a fresh
 * one ("gjs"). */
static int load_entry(const entry_id *id, gj_jit_program *pr, const char *prefix, bool *found,
                      char *why, size_t why_cap) {
    *found = false;
    why[0] = '\0';
    const char *dir = gj_jit_disk_dir();
    if (!dir || pr->code || pr->n_shared || id->plan->oom) return -1;
    loading l;
    memset(&l, 0, sizeof l);
    l.id = id;
    l.dir = dir;
    l.found = found;
    l.why = why;
    l.why_cap = why_cap;
    l.dfd = -1;
    entry_name(l.name, id->hash);
    int rc = le_read(&l);
    if (rc == 0) rc = le_head(&l, prefix);
    if (rc == 0 && load_objects(&l.b, pr, l.sym_n > 0 ? l.sym : NULL, why, why_cap) != 0) rc = -1;
    if (rc == 0) /* used now: the LRU stamp (we own it; failure is harmless) */
        (void)utimensat(l.dfd, l.name, NULL, AT_SYMLINK_NOFOLLOW);
    if (l.dfd >= 0) close(l.dfd);
    gj_rt_free(l.data);
    return rc;
}

int gj_jit_disk_load(const gj_jit_key *w, gj_jit_program *pr, const char *prefix, bool *found,
                     char *why, size_t why_cap) {
    *found = false;
    why[0] = '\0';
    if (!gj_jit_disk_dir() || pr->code || !disk_able(pr)) return -1;
    wbuf pb = {0};
    put_plan(&pb, pr);
    if (pb.oom) {
        snprintf(why, why_cap, "out of memory");
        return -1;
    }
    entry_id id = {w->text, w->len, {w->hash[0], w->hash[1]}, &pb};
    int rc = load_entry(&id, pr, prefix, found, why, why_cap);
    gj_rt_free(pb.p);
    return rc;
}

/* ---------------------------------------------------- symbolic entries */

/* The identity of generic plan p's symbolic entry: its kernel signature
 * (plan/symbolic.c) as the plan blob, and the key text "gradjit-symbolic v1
 * <hash of the signature>" whose hash names the file. 0, or -1 on OOM
 * (the caller frees sig->p either way). */
static int symbolic_id(const gj_jit_plan *p, wbuf *sig, char key[64], entry_id *id) {
    if (gj_jit_generic_signature(p, sig) != 0) return -1;
    uint64_t h[2];
    gj_jit_hash128(sig->p, sig->n, h);
    int n = snprintf(key, 64, "gradjit-symbolic v1 %016llx%016llx", (unsigned long long)h[0],
                     (unsigned long long)h[1]);
    *id = (entry_id){key, (size_t)n, {0, 0}, sig};
    gj_jit_hash128(key, (size_t)n, id->hash);
    return 0;
}

int gj_jit_disk_save_symbolic(const gj_jit_program *pr, const char *prefix,
                              gj_jit_disk_usage *u) {
    if (u) *u = (gj_jit_disk_usage){0, -1};
    if (!pr->plan.generic || !disk_able(pr)) return -1;
    wbuf sig = {0};
    char key[64];
    entry_id id;
    int rc = symbolic_id(&pr->plan, &sig, key, &id) == 0 ? save_entry(&id, pr, prefix, u) : -1;
    gj_rt_free(sig.p);
    return rc;
}

int gj_jit_disk_load_symbolic(gj_jit_program *pr, bool *found, char *why, size_t why_cap) {
    *found = false;
    why[0] = '\0';
    if (!gj_jit_disk_dir() || pr->code || !pr->plan.generic || !disk_able(pr)) return -1;
    wbuf sig = {0};
    char key[64];
    entry_id id;
    int rc = -1;
    if (symbolic_id(&pr->plan, &sig, key, &id) != 0) snprintf(why, why_cap, "out of memory");
    else rc = load_entry(&id, pr, NULL, found, why, why_cap);
    gj_rt_free(sig.p);
    return rc;
}

/* ---------------------------------------------------------------- hints */

static const char g_hint_magic[8] = {'G', 'J', 'J', 'I', 'T', 'H', '0', '1'};

static void hint_name(const gj_jit_key *w, const char *tag, char name[40]) {
    char t[128];
    int n = snprintf(t, sizeof t, "gradjit-hint v1 %s %016llx%016llx", tag,
                     (unsigned long long)w->hash[0], (unsigned long long)w->hash[1]);
    uint64_t h[2];
    gj_jit_hash128(t, (size_t)n, h);
    entry_name(name, h);
}

/* The record of n values for key w and tag (see the file comment). */
static void hint_record(wbuf *b, const gj_jit_key *w, const int64_t *v, int n) {
    wbuf_put(b, g_hint_magic, sizeof g_hint_magic);
    wbuf_u64(b, layout_signature());
    put_blob(b, GJ_VERSION_STR, strlen(GJ_VERSION_STR));
    wbuf_put(b, w->hash, 2 * sizeof w->hash[0]);
    wbuf_u64(b, (uint64_t)n);
    for (int i = 0; i < n; i++) wbuf_i64(b, v[i]);
    uint64_t h[2];
    gj_jit_hash128(b->p, b->n, h);
    wbuf_put(b, h, sizeof h);
}

int gj_jit_disk_hint_load(const gj_jit_key *w, const char *tag, int64_t *v, int n) {
    const char *dir = gj_jit_disk_dir();
    if (!dir || n < 1 || n > GJ_DISK_HINT_MAX) return -1;
    int64_t zero[GJ_DISK_HINT_MAX] = {0};
    wbuf want = {0};
    hint_record(&want, w, zero, n); /* the record's size and every field but the values */
    char why[200], name[40];
    int dfd = open_dir(dir, false, why, sizeof why), rc = -1;
    unsigned char *d = NULL;
    size_t len = 0;
    if (dfd >= 0 && !want.oom) {
        hint_name(w, tag, name);
        if (gj_rt_file_read(dfd, name, want.n, &d, &len, why, sizeof why) == 0 &&
            len == want.n) {
            size_t vo = want.n - 16 - (size_t)n * 8; /* the values' offset */
            uint64_t h[2];
            gj_jit_hash128(d, len - 16, h);
            if (memcmp(d, want.p, vo) == 0 && memcmp(d + len - 16, h, 16) == 0) {
                memcpy(v, d + vo, (size_t)n * 8);
                rc = 0;
            }
        }
    }
    if (dfd >= 0) close(dfd);
    gj_rt_free(d);
    gj_rt_free(want.p);
    return rc;
}

void gj_jit_disk_hint_save(const gj_jit_key *w, const char *tag, const int64_t *v, int n) {
    const char *dir = gj_jit_disk_dir();
    if (!dir || n < 1 || n > GJ_DISK_HINT_MAX) return;
    bool log = (gj_jit_log_flags() & GJ_JIT_LOG_CACHE) != 0;
    wbuf b = {0};
    hint_record(&b, w, v, n);
    char why[300] = "out of memory", name[40];
    int dfd = b.oom ? -1 : open_dir(dir, true, why, sizeof why);
    bool ok = false;
    if (dfd >= 0) {
        hint_name(w, tag, name);
        ok = gj_rt_file_write(dfd, name, ".gjc-", 0600, b.p, b.n, false, why, sizeof why) == 0;
        gj_jit_disk_usage u;
        if (ok && trim_dir(dfd, dir, name, gj_jit_disk_limit(), &u, why, sizeof why) != 0 && log)
            fprintf(stderr, "[gradjit cache] could not apply the size limit to %s: %s\n", dir,
                    why);
        close(dfd);
    }
    if (log)
        fprintf(stderr, ok ? "[gradjit cache] saved the %s of %016llx%016llx\n"
                           : "[gradjit cache] the %s of %016llx%016llx not saved: %s\n",
                tag, (unsigned long long)w->hash[0], (unsigned long long)w->hash[1], why);
    gj_rt_free(b.p);
}
