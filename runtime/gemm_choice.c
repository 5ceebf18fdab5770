/* SPDX-License-Identifier: MIT */
/*
 * gemm_choice.c - which leaf computes a GEMM: the provider setting, the
 * choice per GEMM shape, its measurement on a sample of the GEMM, and the
 * file in the cache directory that keeps the choices of this machine.
 *
 * Invariants:
 *   - Settings (GRADJIT_GEMM, gj_set_gemm_provider): OPENBLAS never asks
 *     oneDNN (nor loads it); ONEDNN gives oneDNN every f32 or bf16 GEMM it
 *     accepts (alpha 1, beta 0 or 1), unmeasured; AUTO measures each new
 *     f32 or bf16 shape of at least GJ_RT_GEMM_ALT_MIN multiply-adds and
 *     keeps the faster; DEFAULT (unset) measures f32 shapes as AUTO does
 *     where the cache directory can keep the choices, and leaves f32 to
 *     OpenBLAS where it cannot (with one warning naming the directory and
 *     why, unless GRADJIT_CACHE_DIR=off asked for no directory): without a
 *     shared file, two processes could measure a near tie differently and
 *     compute different bits. bf16 goes to oneDNN where the CPU has
 *     AVX512_BF16 (a rule of the CPU alone). f64, alpha != 1 and other
 *     betas are always OpenBLAS's.
 *   - One choice per shape: the key is the shape (transposes, M, N, K,
 *     beta 0 or 1, bf16), not the leading dimensions nor the block, so
 *     eager and compiled runs, strided views and dense copies, every thread
 *     count, take the same provider for a GEMM. A shape is decided once per
 *     process: under g_lock, and a thread arriving meanwhile waits for that
 *     decision. Entries are never removed while GEMMs may run
 *     (gj_rt_gemm_provider_reset is for tests, with no GEMM running).
 *   - Once per machine: a decision holds flock on the cache directory
 *     (waiting at most GJ_RT_GEMM_LOCK_MS), reads the file first (a shape
 *     another process decided takes that choice) and writes the merged
 *     table back (gj_rt_file_write: atomic). A process that cannot get the
 *     lock in time measures for itself and keeps the choice to itself,
 *     with a warning. The file is read as distrustfully as the program
 *     cache (files.c): bounded size, exact length, magic, host id and
 *     checksum, every record validated; anything else and it is ignored
 *     (and rewritten by the next decision). A record only picks one of two
 *     correct providers.
 *   - Bounded cost: a decision times both leaves on a sample of the block
 *     being computed -- its first rows or columns, at most
 *     GJ_RT_GEMM_SAMPLE_MACS multiply-adds, read from the block's own
 *     operands, written into scratch -- in 5-21 interleaved pairs filling
 *     about GJ_RT_GEMM_PROBE_NS; oneDNN must win the median pair by
 *     GJ_RT_GEMM_ALT_MARGIN (a near tie keeps OpenBLAS). At most about
 *     10 ms per shape, whatever the GEMM's size.
 *   - Memory through the runtime's allocator; an allocation failure keeps
 *     OpenBLAS for that shape in this process (nothing saved).
 */
#include "runtime/gemm_int.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* GEMMs below this many multiply-adds stay with OpenBLAS without being
 * measured (64x64x32: a few us, where the call overheads dominate). */
#define GJ_RT_GEMM_ALT_MIN ((int64_t)1 << 17)
/* oneDNN must be this much faster (the median of the pairs' time ratios). */
#define GJ_RT_GEMM_ALT_MARGIN 0.03
/* The sample a decision times: at most this many multiply-adds (about
 * 0.3-0.6 ms single-threaded at these CPUs' FMA rates). */
#define GJ_RT_GEMM_SAMPLE_MACS ((int64_t)1 << 26)
#define GJ_RT_GEMM_SAMPLE_MIN 16 /* rows or columns a sample keeps, at least */
/* Pairs per decision: enough to fill about this many ns, within bounds. */
#define GJ_RT_GEMM_PROBE_NS 4e6
#define GJ_RT_GEMM_PAIRS_MIN 5
#define GJ_RT_GEMM_PAIRS_MAX 21
#define GJ_RT_GEMM_MAX_ENTRIES 16384 /* beyond: OpenBLAS, nothing recorded */
#define GJ_RT_GEMM_FILE_MAX ((size_t)4 << 20)
#define GJ_RT_GEMM_LOCK_MS 2000

/* ------------------------------------------------------------ setting */

static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;
static atomic_int g_setting;

static void env_read(void) {
    int s = gj_rt_env_gemm();
    if (s == GJ_RT_GEMM_ONEDNN && !gj_rt_onednn_ready()) {
        fprintf(stderr, "gradjit: GRADJIT_GEMM=onednn: %s: using OpenBLAS\n", gj_rt_onednn_why());
        s = GJ_RT_GEMM_OPENBLAS;
    }
    atomic_store(&g_setting, s);
}

int gj_rt_gemm_provider_setting(void) {
    pthread_once(&g_env_once, env_read);
    return atomic_load_explicit(&g_setting, memory_order_relaxed);
}

int gj_rt_set_gemm_provider(int p) {
    pthread_once(&g_env_once, env_read); /* the call wins over the environment */
    if (p != GJ_RT_GEMM_AUTO && p != GJ_RT_GEMM_OPENBLAS && p != GJ_RT_GEMM_ONEDNN &&
        p != GJ_RT_GEMM_DEFAULT) {
        gj_rt_set_error("gj_set_gemm_provider: %d is not a provider (auto 0, openblas 1, onednn 2, "
                        "default 3)",
                        p);
        return -1;
    }
    if (p == GJ_RT_GEMM_ONEDNN && !gj_rt_onednn_ready()) {
        atomic_store(&g_setting, GJ_RT_GEMM_OPENBLAS);
        gj_rt_set_error("gj_set_gemm_provider: onednn: %s: OpenBLAS computes every GEMM",
                        gj_rt_onednn_why());
        return -1;
    }
    atomic_store(&g_setting, p);
    return 0;
}

const char *gj_rt_gemm_provider_name(int p) {
    return p == GJ_RT_GEMM_OPENBLAS ? "openblas"
           : p == GJ_RT_GEMM_ONEDNN ? "onednn"
           : p == GJ_RT_GEMM_DEFAULT ? "default"
                                      : "auto";
}

void gj_rt_gemm_simulate_no_onednn(bool on) {
    gj_rt_onednn_simulate_missing(on);
    if (on && gj_rt_gemm_provider_setting() == GJ_RT_GEMM_ONEDNN)
        atomic_store(&g_setting, GJ_RT_GEMM_OPENBLAS);
}

#ifndef GJ_HAVE_DNNL /* built without oneDNN: the leaf's answers */
bool gj_rt_onednn_ready(void) { return false; }
bool gj_rt_onednn_block(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A,
                        const void *B, float *C) {
    (void)c, (void)M, (void)N, (void)A, (void)B, (void)C;
    return false;
}
const char *gj_rt_onednn_why(void) { return "gradjit was built without oneDNN (libdnnl-dev)"; }
void gj_rt_onednn_simulate_missing(bool on) { (void)on; }
void gj_rt_onednn_reset(void) {}
int64_t gj_rt_onednn_refused(void) { return 0; }
void gj_rt_onednn_dump(FILE *f) { (void)f; }
bool gj_rt_onednn_available(void) { return false; }
const char *gj_rt_onednn_version(void) { return "unavailable"; }
#endif

/* ------------------------------------------------------------ the table */

typedef struct choice_entry {
    gj_gemm_node node;     /* a KIND_SHAPE key */
    atomic_int choice;     /* GJ_GEMM_NONE until decided */
    float us_blas, us_dnnl; /* medians of the decision's pairs (0: not measured) */
    int64_t sample_m, sample_n; /* the sample timed */
    bool saved;            /* in the file (read from it, or written) */
    bool here;             /* measured by this process */
    atomic_bool logged;    /* GRADJIT_LOG=gemm printed it */
} choice_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* deciding, the file */
static gj_gemm_table g_choices;
static atomic_llong g_n_blas, g_n_dnnl, g_n_bf16, g_n_measured, g_n_loaded;
static atomic_llong g_sample_macs; /* the largest sample timed */
static atomic_llong g_decide_ns;   /* time in decisions: reading the file, measuring */
static char *g_dir_override;       /* gj_rt_gemm_set_cache_dir (owned), under g_lock */
static int g_dir_mode = -1;        /* -1 the cache directory's setting, 0 none, 1 override */
static atomic_int g_default_measures = -1; /* -1: not known yet */

/* Under g_lock: k's entry, created undecided if missing; NULL when the
 * table is full or out of memory. */
static choice_entry *entry_for(const gj_gemm_key *k, uint64_t h) {
    choice_entry *e = (choice_entry *)gj_gemm_find(&g_choices, k, h);
    if (e || g_choices.n >= GJ_RT_GEMM_MAX_ENTRIES)
        return e;
    if ((e = gj_rt_calloc(1, sizeof *e)) == NULL)
        return NULL;
    e->node.key = *k;
    e->node.hash = h;
    gj_gemm_publish(&g_choices, &e->node);
    return e;
}

static const char *choice_name(int c) {
    return c == GJ_GEMM_USE_ONEDNN ? "onednn" : c == GJ_GEMM_USE_OPENBLAS ? "openblas" : "-";
}

/* GRADJIT_LOG=gemm: shape e's provider, once per process. */
static void log_choice(choice_entry *e) {
    if (!(gj_rt_log_flags() & GJ_RT_LOG_GEMM) || atomic_exchange(&e->logged, true))
        return;
    const gj_gemm_key *k = &e->node.key;
    fprintf(stderr, "[gradjit gemm] %s%c%c M=%lld N=%lld K=%lld beta=%d: %s (openblas %.1f us, "
                    "onednn %.1f us on a %lldx%lld sample; %s)\n",
            k->bf16 ? "bf16 " : "", k->ta ? 'T' : 'N', k->tb ? 'T' : 'N', (long long)k->M,
            (long long)k->N, (long long)k->K, k->beta1, choice_name(atomic_load(&e->choice)),
            (double)e->us_blas, (double)e->us_dnnl, (long long)e->sample_m,
            (long long)e->sample_n, e->here ? "measured now"
                                    : "from the cache directory");
}

/* ------------------------------------------------------------- measuring */

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The sample of block [M, N] of GEMM c: its first *m rows and *n columns,
 * at most GJ_RT_GEMM_SAMPLE_MACS multiply-adds where K allows (the longer
 * side cut first; neither below GJ_RT_GEMM_SAMPLE_MIN unless the block
 * is). */
static void sample_of(const gj_rt_gemm_call *c, int64_t M, int64_t N, int64_t *m, int64_t *n) {
    double cap = (double)GJ_RT_GEMM_SAMPLE_MACS / (double)c->K; /* m n at most */
    int64_t lo_m = M < GJ_RT_GEMM_SAMPLE_MIN ? M : GJ_RT_GEMM_SAMPLE_MIN;
    int64_t lo_n = N < GJ_RT_GEMM_SAMPLE_MIN ? N : GJ_RT_GEMM_SAMPLE_MIN;
    *m = M;
    *n = N;
    if ((double)M * (double)N <= cap)
        return;
    int64_t *a = M >= N ? m : n, *b = M >= N ? n : m; /* cut a, then b if need be */
    int64_t lo_a = M >= N ? lo_m : lo_n, lo_b = M >= N ? lo_n : lo_m;
    int64_t want = (int64_t)(cap / (double)*b);
    *a = want > lo_a ? want : lo_a;
    if ((double)*a * (double)*b > cap) {
        want = (int64_t)(cap / (double)*a);
        *b = want > lo_b ? want : lo_b;
    }
}

/* Under g_lock: times both leaves on the sample of block [M, N] of GEMM c
 * (A, B and C the block's operands; C only read, for beta == 1) and sets
 * e's choice and times. */
static void measure(choice_entry *e, const gj_rt_gemm_call *c, int64_t M, int64_t N,
                    const void *A, const void *B, const float *C) {
    int64_t m, n;
    sample_of(c, M, N, &m, &n);
    size_t cn = (size_t)((m - 1) * c->ldc + n);
    float *Cs = gj_rt_malloc(cn * sizeof(float));
    if (!Cs) { /* keep OpenBLAS here (not saved: another process may measure it) */
        atomic_store(&e->choice, GJ_GEMM_USE_OPENBLAS);
        return;
    }
    for (int64_t i = 0; i < m; i++) /* beta == 1 reads C: start from its values */
        memcpy(Cs + i * c->ldc, C + i * c->ldc, (size_t)n * sizeof(float));
    double tb[GJ_RT_GEMM_PAIRS_MAX], td[GJ_RT_GEMM_PAIRS_MAX];
    double t0 = now_ns();
    gj_rt_openblas_block(c, m, n, A, B, Cs); /* warm-up: page faults, first runs */
    double t1 = now_ns();
    bool ok = gj_rt_onednn_block(c, m, n, A, B, Cs);
    double t2 = now_ns();
    int pairs = 0;
    if (ok) {
        double per = t2 - t0;
        pairs = per > 0 ? (int)(GJ_RT_GEMM_PROBE_NS / per) : GJ_RT_GEMM_PAIRS_MAX;
        pairs = pairs < GJ_RT_GEMM_PAIRS_MIN   ? GJ_RT_GEMM_PAIRS_MIN
                : pairs > GJ_RT_GEMM_PAIRS_MAX ? GJ_RT_GEMM_PAIRS_MAX
                                               : pairs | 1; /* odd: a true median */
    }
    (void)t1;
    for (int r = 0; ok && r < pairs; r++)
        for (int w = 0; w < 2; w++) { /* alternate which goes first */
            bool dnnl = (w == 0) == (r % 2 == 1);
            double s = now_ns();
            if (dnnl)
                ok = ok && gj_rt_onednn_block(c, m, n, A, B, Cs);
            else
                gj_rt_openblas_block(c, m, n, A, B, Cs);
            (dnnl ? td : tb)[r] = now_ns() - s;
        }
    gj_rt_free(Cs);
    e->sample_m = m;
    e->sample_n = n;
    e->here = true;
    int64_t macs = m * n * c->K, prev = atomic_load(&g_sample_macs);
    while (macs > prev && !atomic_compare_exchange_weak(&g_sample_macs, &prev, macs)) {
    }
    if (!ok) { /* oneDNN refused the sample: nothing to compare */
        atomic_store(&e->choice, GJ_GEMM_USE_OPENBLAS);
        return;
    }
    /* the median of the pairs' ratios: the two runs of a pair share the
     * machine's load of that moment, so another job slowing some of them
     * moves single times far more than ratios */
    double ratio[GJ_RT_GEMM_PAIRS_MAX];
    for (int r = 0; r < pairs; r++)
        ratio[r] = td[r] / tb[r];
    qsort(ratio, (size_t)pairs, sizeof ratio[0], cmp_double);
    qsort(tb, (size_t)pairs, sizeof tb[0], cmp_double);
    qsort(td, (size_t)pairs, sizeof td[0], cmp_double);
    e->us_blas = (float)(tb[pairs / 2] * 1e-3);
    e->us_dnnl = (float)(td[pairs / 2] * 1e-3);
    atomic_fetch_add(&g_n_measured, 1);
    atomic_store(&e->choice, ratio[pairs / 2] < 1.0 - GJ_RT_GEMM_ALT_MARGIN
                                 ? GJ_GEMM_USE_ONEDNN
                                 : GJ_GEMM_USE_OPENBLAS);
}

/* ------------------------------------------------------------- the file */

static const char g_magic[8] = {'G', 'J', 'G', 'E', 'M', 'M', '0', '2'};

/* One saved choice (native byte order: the host id pins the machine). */
typedef struct file_rec {
    int64_t M, N, K;
    uint8_t ta, tb, beta1, bf16, choice, pad[3];
    float us_blas, us_dnnl;
    int64_t sample_m, sample_n;
} file_rec;

static uint64_t fnv64(const void *p, size_t n) {
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= c[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* The host id: what makes a measurement valid only here. */
static void host_id(char *out, size_t cap) {
    char brand[49] = "";
    unsigned sig = 0;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    unsigned r[12], a, b, c, d;
    if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++)
            __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(brand, r, 48);
        brand[48] = '\0';
    }
    if (__get_cpuid(1, &a, &b, &c, &d))
        sig = a; /* family, model, stepping */
#endif
    gj_rt_cpu cpu;
    gj_rt_cpu_detect(&cpu);
    snprintf(out, cap,
             "gradjit %s; cpu %s; sig %08x; avx2 %d fma %d avx512 %d%d%d%d%d bf16 %d; openblas %s "
             "%s; onednn %s",
             GJ_VERSION_STRING, brand, sig, cpu.avx2, cpu.fma, cpu.avx512f, cpu.avx512bw,
             cpu.avx512vl, cpu.avx512dq, cpu.avx512cd, cpu.avx512bf16, gj_rt_blas_corename(),
             gj_rt_blas_config(), gj_rt_onednn_version());
}

static void file_name(char out[40], const char *id) {
    snprintf(out, 40, "gemm-%016llx.gjg", (unsigned long long)fnv64(id, strlen(id)));
}

/* A record that could have come from save_file. */
static bool rec_ok(const file_rec *r) {
    if (r->ta > 1 || r->tb > 1 || r->beta1 > 1 || r->bf16 > 1 || r->pad[0] || r->pad[1] ||
        r->pad[2] || (r->choice != GJ_GEMM_USE_OPENBLAS && r->choice != GJ_GEMM_USE_ONEDNN))
        return false;
    return r->M >= 1 && r->N >= 1 && r->K >= 1 && r->M <= INT_MAX && r->N <= INT_MAX &&
           r->K <= INT_MAX && r->sample_m >= 0 && r->sample_m <= r->M && r->sample_n >= 0 &&
           r->sample_n <= r->N && isfinite(r->us_blas) && isfinite(r->us_dnnl);
}

/* Under g_lock: reads this host's file in directory dfd and takes its
 * choices for shapes this process has not decided. The whole file or
 * nothing. */
static void load_file(int dfd) {
    char id[768], name[40], why[256];
    host_id(id, sizeof id);
    file_name(name, id);
    unsigned char *data;
    size_t n;
    if (gj_rt_file_read(dfd, name, GJ_RT_GEMM_FILE_MAX, &data, &n, why, sizeof why) != 0)
        return;
    uint32_t idlen, count;
    uint64_t sum;
    if (n < 8 + 4 + 4 + 8)
        goto done;
    memcpy(&sum, data + n - 8, 8);
    if (memcmp(data, g_magic, 8) != 0 || fnv64(data, n - 8) != sum)
        goto done;
    memcpy(&idlen, data + 8, 4);
    if (idlen != strlen(id) || 12 + (size_t)idlen + 4 + 8 > n || memcmp(data + 12, id, idlen) != 0)
        goto done;
    memcpy(&count, data + 12 + idlen, 4);
    size_t off = 12 + (size_t)idlen + 4;
    if (count > GJ_RT_GEMM_MAX_ENTRIES || off + (size_t)count * sizeof(file_rec) + 8 != n)
        goto done;
    for (uint32_t i = 0; i < count; i++) {
        file_rec r;
        memcpy(&r, data + off + i * sizeof r, sizeof r);
        if (!rec_ok(&r))
            goto done;
    }
    for (uint32_t i = 0; i < count; i++) {
        file_rec r;
        memcpy(&r, data + off + i * sizeof r, sizeof r);
        gj_gemm_key k = {r.M, r.N, r.K, 0, 0, 0, r.ta, r.tb, r.beta1, GJ_GEMM_KIND_SHAPE, r.bf16};
        choice_entry *e = entry_for(&k, gj_gemm_key_hash(&k));
        if (!e || atomic_load(&e->choice) != GJ_GEMM_NONE)
            continue; /* this process decided already */
        e->saved = true;
        e->us_blas = r.us_blas;
        e->us_dnnl = r.us_dnnl;
        e->sample_m = r.sample_m;
        e->sample_n = r.sample_n;
        atomic_store(&e->choice, (int)r.choice);
        atomic_fetch_add(&g_n_loaded, 1);
    }
done:
    gj_rt_free(data);
}

/* Under g_lock: writes every decided shape to this host's file in
 * directory dfd (dir names it in a warning). 0, or -1 (warned). */
static int save_file(int dfd, const char *dir) {
    char id[768], name[40], why[256];
    host_id(id, sizeof id);
    file_name(name, id);
    uint32_t idlen = (uint32_t)strlen(id), count = 0;
    for (int b = 0; b < GJ_GEMM_BUCKETS; b++)
        for (gj_gemm_node *n = atomic_load(&g_choices.b[b]); n; n = n->next)
            count += atomic_load(&((choice_entry *)n)->choice) != GJ_GEMM_NONE;
    size_t n = 12 + idlen + 4 + (size_t)count * sizeof(file_rec) + 8, off;
    unsigned char *data = gj_rt_malloc(n);
    if (!data)
        return -1;
    memcpy(data, g_magic, 8);
    memcpy(data + 8, &idlen, 4);
    memcpy(data + 12, id, idlen);
    memcpy(data + 12 + idlen, &count, 4);
    off = 12 + idlen + 4;
    for (int b = 0; b < GJ_GEMM_BUCKETS; b++)
        for (gj_gemm_node *nd = atomic_load(&g_choices.b[b]); nd; nd = nd->next) {
            choice_entry *e = (choice_entry *)nd;
            int ch = atomic_load(&e->choice);
            if (ch == GJ_GEMM_NONE)
                continue;
            const gj_gemm_key *k = &nd->key;
            file_rec r = {k->M,         k->N,       k->K,       k->ta,      k->tb,
                          k->beta1,     k->bf16,    (uint8_t)ch, {0, 0, 0}, e->us_blas,
                          e->us_dnnl,   e->sample_m, e->sample_n};
            memcpy(data + off, &r, sizeof r);
            off += sizeof r;
        }
    uint64_t sum = fnv64(data, off);
    memcpy(data + off, &sum, 8);
    int rc = gj_rt_file_write(dfd, name, ".gjg-", 0600, data, n, false, why, sizeof why);
    gj_rt_free(data);
    if (rc != 0) {
        gj_rt_warn_once("cannot write the GEMM choices file in %s (%s): other processes may "
                        "choose other providers for this process's new shapes",
                        dir, why);
        return -1;
    }
    for (int b = 0; b < GJ_GEMM_BUCKETS; b++)
        for (gj_gemm_node *nd = atomic_load(&g_choices.b[b]); nd; nd = nd->next)
            if (atomic_load(&((choice_entry *)nd)->choice) != GJ_GEMM_NONE)
                ((choice_entry *)nd)->saved = true;
    return 0;
}

/* Under g_lock: the directory the choices are kept in (borrowed until
 * the lock is released), or NULL for none. */
static const char *choice_dir(void) {
    if (g_dir_mode == 1)
        return g_dir_override;
    return g_dir_mode == 0 ? NULL : gj_rt_env_cache_dir();
}

/* Whether the default setting measures f32 GEMMs: a cache directory can
 * keep the choices (found, created, ours). Decided once (until
 * gj_rt_gemm_set_cache_dir); an unusable directory is reported once. */
static bool default_measures(void) {
    int v = atomic_load_explicit(&g_default_measures, memory_order_relaxed);
    if (v >= 0)
        return v != 0;
    pthread_mutex_lock(&g_lock);
    const char *dir = choice_dir();
    char why[320];
    int dfd = dir ? gj_rt_dir_open(dir, true, why, sizeof why) : -1;
    if (dir && dfd < 0)
        gj_rt_warn_once("the cache directory %s cannot keep GEMM choices (%s%s): f32 GEMMs use "
                        "OpenBLAS (set GRADJIT_CACHE_DIR to a private directory of yours, or "
                        "GRADJIT_CACHE_DIR=off to say none)",
                        dir, dfd == -2 ? "it is " : "", why[0] ? why : "it cannot be created");
    if (dfd >= 0)
        close(dfd);
    v = dfd >= 0;
    atomic_store(&g_default_measures, v);
    pthread_mutex_unlock(&g_lock);
    return v != 0;
}

/* Under g_lock: decides e on block [M, N] of GEMM c: the machine's choice
 * from the file if another process made it, else measured here (and
 * written back when the directory could be locked). */
static void decide(choice_entry *e, const gj_rt_gemm_call *c, int64_t M, int64_t N,
                   const void *A, const void *B, const float *C) {
    const char *dir = choice_dir();
    char why[320];
    int dfd = dir ? gj_rt_dir_open(dir, true, why, sizeof why) : -1;
    bool locked = dfd >= 0 && gj_rt_dir_lock(dfd, GJ_RT_GEMM_LOCK_MS);
    if (dfd >= 0)
        load_file(dfd);
    if (atomic_load(&e->choice) == GJ_GEMM_NONE) {
        measure(e, c, M, N, A, B, C);
        if (locked && e->us_blas > 0)
            save_file(dfd, dir);
        else if (dfd >= 0 && !locked)
            gj_rt_warn_once("the GEMM choices file in %s stayed locked by another process for "
                            "%d ms: this process keeps its own choices for new shapes",
                            dir, GJ_RT_GEMM_LOCK_MS);
    }
    if (locked)
        gj_rt_dir_unlock(dfd);
    if (dfd >= 0)
        close(dfd);
}

/* -------------------------------------------------------------- picking */

int gj_rt_gemm_pick(const gj_rt_gemm_call *c, int64_t M, int64_t N, const void *A, const void *B,
                    const float *C) {
    int setting = gj_rt_gemm_provider_setting();
    if (setting == GJ_RT_GEMM_OPENBLAS || c->f64 || c->alpha != 1.0 ||
        (c->beta != 0.0 && c->beta != 1.0))
        return GJ_GEMM_USE_OPENBLAS;
    bool measured = setting == GJ_RT_GEMM_AUTO;
    if (setting == GJ_RT_GEMM_DEFAULT) {
        if (c->bf16 ? !gj_rt_cpu_native_bf16() : !default_measures())
            return GJ_GEMM_USE_OPENBLAS;
        measured = !c->bf16;
    }
    if (measured && (double)c->M * (double)c->N * (double)c->K < (double)GJ_RT_GEMM_ALT_MIN)
        return GJ_GEMM_USE_OPENBLAS;
    if (!gj_rt_onednn_ready())
        return GJ_GEMM_USE_OPENBLAS;
    if (!measured)
        return GJ_GEMM_USE_ONEDNN;
    gj_gemm_key k = gj_gemm_shape_key(c);
    uint64_t h = gj_gemm_key_hash(&k);
    choice_entry *e = (choice_entry *)gj_gemm_find(&g_choices, &k, h);
    int ch = e ? atomic_load_explicit(&e->choice, memory_order_acquire) : GJ_GEMM_NONE;
    if (ch == GJ_GEMM_NONE) {
        pthread_mutex_lock(&g_lock);
        e = entry_for(&k, h);
        if (!e)
            ch = GJ_GEMM_USE_OPENBLAS; /* the table is full: nothing recorded */
        else if ((ch = atomic_load(&e->choice)) == GJ_GEMM_NONE) {
            double t0 = now_ns();
            decide(e, c, M, N, A, B, C);
            atomic_fetch_add(&g_decide_ns, (long long)(now_ns() - t0));
            ch = atomic_load(&e->choice);
        }
        pthread_mutex_unlock(&g_lock);
    }
    if (e)
        log_choice(e);
    return ch;
}

void gj_rt_gemm_count_block(int used, bool bf16) {
    atomic_fetch_add_explicit(used == GJ_GEMM_USE_ONEDNN ? &g_n_dnnl : &g_n_blas, 1,
                              memory_order_relaxed);
    if (bf16)
        atomic_fetch_add_explicit(&g_n_bf16, 1, memory_order_relaxed);
}

/* ------------------------------------------------------- introspection */

int gj_rt_gemm_choice(bool ta, bool tb, int64_t M, int64_t N, int64_t K, bool beta1, bool bf16) {
    gj_gemm_key k = {M, N, K, 0, 0, 0, ta, tb, beta1, GJ_GEMM_KIND_SHAPE, bf16};
    choice_entry *e = (choice_entry *)gj_gemm_find(&g_choices, &k, gj_gemm_key_hash(&k));
    return e ? atomic_load(&e->choice) : GJ_GEMM_NONE;
}

void gj_rt_gemm_get_stats(gj_rt_gemm_stats *s) {
    s->openblas_blocks = atomic_load(&g_n_blas);
    s->onednn_blocks = atomic_load(&g_n_dnnl);
    s->bf16_blocks = atomic_load(&g_n_bf16);
    s->measured = atomic_load(&g_n_measured);
    s->loaded = atomic_load(&g_n_loaded);
    s->refused = gj_rt_onednn_refused();
    s->sample_macs = atomic_load(&g_sample_macs);
    s->decide_ms = (double)atomic_load(&g_decide_ns) / 1e6;
    pthread_mutex_lock(&g_lock);
    s->entries = g_choices.n;
    pthread_mutex_unlock(&g_lock);
}

static void choice_free(gj_gemm_node *n) { gj_rt_free(n); }

void gj_rt_gemm_provider_reset(void) {
    pthread_mutex_lock(&g_lock);
    gj_gemm_clear(&g_choices, choice_free);
    atomic_store(&g_n_blas, 0);
    atomic_store(&g_n_dnnl, 0);
    atomic_store(&g_n_bf16, 0);
    atomic_store(&g_n_measured, 0);
    atomic_store(&g_n_loaded, 0);
    atomic_store(&g_sample_macs, 0);
    atomic_store(&g_decide_ns, 0);
    pthread_mutex_unlock(&g_lock);
    gj_rt_onednn_reset();
}

void gj_rt_gemm_set_cache_dir(const char *dir) {
    pthread_mutex_lock(&g_lock);
    gj_rt_free(g_dir_override);
    g_dir_override = NULL;
    g_dir_mode = -1;
    if (dir) {
        g_dir_mode = 0;
        size_t n = strlen(dir);
        if (n > 0 && (g_dir_override = gj_rt_malloc(n + 1)) != NULL) {
            memcpy(g_dir_override, dir, n + 1);
            g_dir_mode = 1;
        }
    }
    atomic_store(&g_default_measures, -1);
    pthread_mutex_unlock(&g_lock);
}

void gj_rt_gemm_dump(FILE *f) {
    pthread_mutex_lock(&g_lock);
    for (int b = 0; b < GJ_GEMM_BUCKETS; b++)
        for (gj_gemm_node *n = atomic_load(&g_choices.b[b]); n; n = n->next) {
            const choice_entry *e = (const choice_entry *)n;
            const gj_gemm_key *k = &n->key;
            fprintf(f, "gemm%s %c%c M=%lld N=%lld K=%lld beta=%d: %s", k->bf16 ? " bf16" : "",
                    k->ta ? 'T' : 'N', k->tb ? 'T' : 'N', (long long)k->M, (long long)k->N,
                    (long long)k->K, k->beta1, choice_name(atomic_load(&e->choice)));
            if (e->us_blas > 0)
                fprintf(f, " (openblas %.1f us, onednn %.1f us on a %lldx%lld sample%s)\n",
                        (double)e->us_blas, (double)e->us_dnnl, (long long)e->sample_m,
                        (long long)e->sample_n, e->saved ? ", kept" : "");
            else
                fprintf(f, " (%s)\n", e->saved ? "from the file" : "not measured");
        }
    pthread_mutex_unlock(&g_lock);
    gj_rt_onednn_dump(f);
}
