/* SPDX-License-Identifier: MIT */
/*
 * compiled.c - gj_jit_backward and gj_jit_grad: key -> cache -> (capture,
 * compile) -> run, with fallbacks to the eager engine and the statistics
 * of gj_ca_stats.
 *
 * Invariants:
 *   - A fallback (handled = false) has changed nothing: no .grad written,
 *     no graph freed. It is counted and its reason kept; the caller runs
 *     the eager engine, which gives the reference gradients (or the error).
 *   - The cache maps a key (full canonical text, indexed by its 128-bit
 *     hash) to a program or to "eager-only" with the reason. A lookup
 *     compares the whole text. A memory
 *     miss captures and plans, then asks the disk cache (diskcache.c) for
 *     object code compiled for exactly that plan (the file's plan is never
 *     run, only compared); a compiled program is written there (its kernels
 *     are named after the key's hash, so object code from another process
 *     links without clashes).
 *   - Dynamic shapes (generic.c): when the call site already has a
 *     program (every time under GJ_CA_DYNAMIC_ALWAYS) the new plan is made
 *     generic and first bound to registered symbolic kernels: no compile,
 *     the entry is marked bound and counted in instantiations, not toward
 *     the recompile limit. Before any compile, kernels registered by other
 *     programs (same description) are bound and only the rest compiled;
 *     every compile and disk load registers its kernels (a disk load also
 *     the kernels its entry carries for the programs it borrowed from).
 *   - One mutex guards the cache and the statistics; compiling holds it
 *     (compiles are rare); running a program does not: a run holds a
 *     reference to its program (prog->refs, taken under the mutex), the
 *     cache another, and whoever drops the last one frees it.
 *   - Size limit (gj_jit_set_mem_limit, GRADJIT_CACHE_MEM_LIMIT, default
 *     GJ_JIT_MEM_LIMIT_DEFAULT): every entry is charged its bytes (the
 *     entry, its key text, and its program's data and machine code,
 *     gj_jit_program_bytes) into g_mem_bytes. After an insertion or a
 *     lower limit, entries are evicted least recently used first (a tick
 *     stamped at insertion and at every lookup that finds the entry) until
 *     g_mem_bytes is within the limit, except the most recently used entry,
 *     which stays even if alone it is larger. Evicting a program drops the
 *     cache's reference: its machine code goes with it (its own ORC
 *     resource tracker, code.h; kernels are shared only within a program,
 *     dedupe.c). Eager-only entries are evicted as well (the key is then
 *     judged again when seen again), and an evicted key no longer counts
 *     toward its call site's recompile limit.
 *   - Inputs of a run come from the walk (canonical origins) unless the
 *     program needs a re-capture; saved tensors are checked exactly as the
 *     eager engine checks them (walk validation) before anything runs.
 *     They are read in place, in the layout the key recorded; an existing
 *     .grad is updated in place (through a contiguous copy if strided).
 *   - Every fallback has a class (gj_ca_reason, counted per class) and a
 *     message "<class>: <detail>" kept per thread. Classes decided here:
 *     no lowering, LLVM error, recompile limit, the hook guards (below),
 *     other (freed graph, modified saved tensor, aliasing .grad, out of
 *     memory).
 *   - Recompile limit: a new key whose call site (walk.site) already has
 *     `limit` programs in the cache is marked eager-only instead of being
 *     captured; keys compiled before keep running compiled.
 *   - Hooks: a tensor hook is a hook step of the plan, a post-accumulate
 *     hook runs once the plan ran, while the .grads are written in the
 *     engine's order, right after its leaf's (write_outputs). A hook never
 *     sees a buffer of the plan: it gets a fresh tensor
 *     holding a copy of the gradient, and what it returns (or the tensor it
 *     kept, with its in-place changes) is copied into the plan's buffer. A
 *     program with hooks also updates existing .grads through private
 *     copies, written back only once every step ran, so a run abandoned by
 *     a guard has written no .grad.
 *   - Guards after each hook call and custom call: record_stream called
 *     (the run finishes, the key becomes eager-only: GJ_CA_RECORD_STREAM);
 *     a graph input (saved tensor, seed, .grad) or a leaf whose .grad the
 *     program writes, whose dtype, shape or storage user code changed with
 *     set_ (GJ_CA_SET_MISMATCH; a .grad swapped for one of the same meta
 *     before the plan touched it is followed instead); a .grad replaced or
 *     created, or failing user code (GJ_CA_HOOK_GUARD). A tensor hook's or
 *     custom call's trip abandons the run, the eager engine runs the whole
 *     backward again (so the user code called before the trip runs twice
 *     in that step); a post hook's trip keeps the run, and the .grads not
 *     yet written get what the eager accumulate makes of them (a leaf now
 *     bf16: a bf16 .grad). Either way the key becomes eager-only (a demoted
 *     entry drops its program, which runs in progress keep alive, but
 *     still counts toward its call site's recompile limit) -- unless the
 *     trip was user code failing this time (a hook or custom op function
 *     returning an error, e.g. out of memory) with no earlier cause in the
 *     run: that backward falls back, the next one runs compiled again.
 *   - gj_grad (gj_jit_grad): the same path with a gj_grad walk and capture
 *     (capture.h). Its outputs (acc_node -1) are new tensors handed to the
 *     caller (program->ret maps requested inputs to outputs); no .grad is
 *     read, written or locked, no post-accumulate hook runs; without
 *     retain_graph the walk's needed op nodes are freed, as the engine's
 *     gj_grad frees the nodes it ran. Counters, fallbacks and guards are
 *     those of a backward.
 *   - Custom ops: a custom op's backward is a call step of the plan; its C
 *     function gets fresh tensors holding copies of the output gradients
 *     and saved arguments, and the gradients it returns are copied into
 *     the plan's buffers. It failing, or returning no gradient for an input
 *     that wants one, abandons the run like a tensor hook's guard (the
 *     eager engine redoes the backward).
 *   - Disk cache: every program made here is written there (when the
 *     cache is on): compiled, bound to kernels of other programs (its entry
 *     carries their object code), with hook or custom call steps (they name
 *     hooks and ops by canonical position, resolved at each run). A bound
 *     symbolic program is the exception: its kernels' symbolic entry serves
 *     every size.
 */
#include "jit.h"

#include "capture.h"
#include "diskcache.h"
#include "generic.h"
#include "program.h"

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

typedef struct cache_entry {
    uint64_t hash[2];
    uint64_t site[2]; /* call site (recompile limit) */
    char *key;
    size_t key_len;
    gj_jit_program *prog; /* NULL: eager-only (the cache's reference) */
    bool bound;           /* prog was bound to generic kernels, not compiled */
    bool demoted;         /* eager-only since a hook guard tripped (program dropped) */
    gj_ca_reason code;    /* eager-only: why */
    uint64_t last_use;    /* g_tick when inserted or last found */
    int64_t bytes;        /* charged to g_mem_bytes */
    char reason[256];
    uint64_t agreed_gen;  /* the agreement registration this key was agreed under */
} cache_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static cache_entry *g_cache;
static int g_n_cache, g_cap_cache;
static gj_ca_stats g_stats;
static int64_t g_mem_bytes;   /* sum of the entries' bytes */
static uint64_t g_tick;       /* LRU clock */
static uint64_t g_next_id = 1; /* program ids */
static int64_t g_disk_bytes;  /* our disk entries' bytes after this process's last save */
static atomic_bool g_quiet;
static atomic_int g_recompile_limit = 8;
static atomic_int g_dynamic = -1; /* gj_ca_dynamic; -1: GRADJIT_DYNAMIC not read yet */
/* Cross-process key agreement (gj_jit_set_agreement), under g_lock. */
static gj_jit_agree_fn g_agree_fn;
static void *g_agree_ctx;
static uint64_t g_agree_gen = 1;

void gj_jit_set_agreement(gj_jit_agree_fn fn, void *ctx) {
    pthread_mutex_lock(&g_lock);
    g_agree_fn = fn;
    g_agree_ctx = ctx;
    g_agree_gen++;
    pthread_mutex_unlock(&g_lock);
}

/* Agrees key w with the other processes if an agreement is registered and
 * this key was not agreed under it (lock held). 0, or -1 (error set). */
static int agree(const gj_jit_walk *w, cache_entry *e) {
    if (!g_agree_fn || (e && e->agreed_gen == g_agree_gen)) return 0;
    if (g_agree_fn(g_agree_ctx, w->hash) != 0) return -1;
    if (e) e->agreed_gen = g_agree_gen;
    return 0;
}
static pthread_once_t g_mem_limit_once = PTHREAD_ONCE_INIT;
static _Atomic int64_t g_mem_limit;
static _Thread_local char g_last_reason[400];
/* The id of the last program this thread ran (ids are never reused, so a
 * freed program is never mistaken for a new one) and its description. */
static _Thread_local uint64_t g_last_id;
static _Thread_local gj_ca_program_info g_last_info;
static _Thread_local bool g_have_last;

static void fallback(gj_ca_reason code, const char *reason, bool first_for_key);

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void gj_jit_stats(gj_ca_stats *out) {
    if (!out) return;
    pthread_mutex_lock(&g_lock);
    int64_t backwards = out->backwards;
    *out = g_stats;
    out->backwards = backwards;
    out->mem_bytes = g_mem_bytes;
    out->mem_entries = g_n_cache;
    out->disk_bytes = g_disk_bytes;
    pthread_mutex_unlock(&g_lock);
}

void gj_jit_reset_stats(void) {
    pthread_mutex_lock(&g_lock);
    memset(&g_stats, 0, sizeof g_stats);
    pthread_mutex_unlock(&g_lock);
    g_last_reason[0] = '\0';
}

const char *gj_jit_last_fallback_reason(void) { return g_last_reason; }

bool gj_jit_last_program_info(gj_ca_program_info *out) {
    if (g_have_last) *out = g_last_info;
    return g_have_last;
}

/* Remembers prog (a reference held) as this thread's last program (its
 * description is made once per program). */
static void note_last_program(const gj_jit_program *prog) {
    if (g_have_last && prog->id == g_last_id) return;
    gj_jit_plan_info(&prog->plan, &g_last_info);
    g_last_info.code_parts = gj_jit_code_parts(prog->code);
    g_last_info.symbolic = prog->plan.generic;
    g_last_info.bound = prog->code == NULL && prog->n_shared > 0;
    g_last_id = prog->id;
    g_have_last = true;
}

const char *gj_jit_last_fallback(void) { return g_last_reason; }

void gj_jit_set_quiet(bool quiet) { atomic_store(&g_quiet, quiet); }

void gj_jit_note_fallback(gj_ca_reason reason, const char *detail) {
    fallback(reason, detail ? detail : "", false);
}

void gj_jit_set_recompile_limit(int n) { atomic_store(&g_recompile_limit, n < 0 ? -1 : n); }

void gj_jit_set_dynamic(gj_ca_dynamic mode) {
    atomic_store(&g_dynamic, mode == GJ_CA_DYNAMIC_OFF || mode == GJ_CA_DYNAMIC_ALWAYS
                                 ? (int)mode
                                 : (int)GJ_CA_DYNAMIC_AUTO);
}

gj_ca_dynamic gj_jit_dynamic(void) {
    int m = atomic_load(&g_dynamic);
    if (m >= 0) return (gj_ca_dynamic)m;
    const char *e = getenv("GRADJIT_DYNAMIC");
    int want = GJ_CA_DYNAMIC_AUTO;
    if (e && *e) {
        if (strcasecmp(e, "off") == 0 || strcmp(e, "0") == 0) want = GJ_CA_DYNAMIC_OFF;
        else if (strcasecmp(e, "always") == 0) want = GJ_CA_DYNAMIC_ALWAYS;
        else if (strcasecmp(e, "auto") != 0 && strcmp(e, "1") != 0)
            fprintf(stderr, "gradjit: GRADJIT_DYNAMIC='%s' is not off, auto or always: using auto\n", e);
    }
    atomic_compare_exchange_strong(&g_dynamic, &m, want); /* the setter wins */
    return (gj_ca_dynamic)atomic_load(&g_dynamic);
}

int gj_jit_recompile_limit(void) { return atomic_load(&g_recompile_limit); }

/* Whether entry e stands for a compiled program (running or demoted). */
static bool has_program(const cache_entry *e) { return e->prog || e->demoted; }

/* Compiled programs in the cache for the call site of w (lock held); with
 * bound ones too if `bound` (programs bound to generic kernels made no
 * compile: they do not count toward the recompile limit). */
static int site_count(const gj_jit_walk *w, bool bound) {
    int n = 0;
    for (int i = 0; i < g_n_cache; i++)
        n += has_program(&g_cache[i]) && (bound || !g_cache[i].bound) &&
             g_cache[i].site[0] == w->site[0] && g_cache[i].site[1] == w->site[1];
    return n;
}

static int site_programs(const gj_jit_walk *w) { return site_count(w, false); }

/* Whether the call site of w has a symbolic program in the cache (lock held). */
static bool site_symbolic(const gj_jit_walk *w) {
    for (int i = 0; i < g_n_cache; i++)
        if (g_cache[i].prog && g_cache[i].prog->plan.generic && g_cache[i].site[0] == w->site[0] &&
            g_cache[i].site[1] == w->site[1])
            return true;
    return false;
}

/* GRADJIT_LOG=recompiles (lock held): a new key w of a call site that has
 * programs already; prints which part of the graph differs from the
 * nearest key of that site (fewest differing lines, the latest on a tie)
 * and whether it compiles or meets the recompile limit. */
static void log_recompile(const gj_jit_walk *w, int n_site, int limit, bool symbolic) {
    const cache_entry *best = NULL;
    int best_d = 0;
    for (int i = 0; i < g_n_cache; i++) {
        const cache_entry *e = &g_cache[i];
        if (!has_program(e) || e->site[0] != w->site[0] || e->site[1] != w->site[1]) continue;
        int d = gj_jit_key_distance(e->key, e->key_len, w->key, w->key_len);
        if (!best || d <= best_d) {
            best = e;
            best_d = d;
        }
    }
    if (!best) return;
    char what[600];
    gj_jit_key_diff(best->key, best->key_len, w->key, w->key_len, what, sizeof what);
    char state[96];
    if (limit >= 0 && n_site >= limit)
        snprintf(state, sizeof state, "recompile limit %d reached: runs eagerly%s", limit,
                 symbolic ? " unless bound to symbolic kernels" : "");
    else
        snprintf(state, sizeof state, "program %d of the site%s", n_site + 1,
                 symbolic ? ", symbolic" : "");
    fprintf(stderr,
            "[gradjit recompiles] call site %016llx%016llx, key %016llx%016llx (%s): %s; "
            "%d key line%s differ from the nearest key %016llx%016llx\n",
            (unsigned long long)w->site[0], (unsigned long long)w->site[1],
            (unsigned long long)w->hash[0], (unsigned long long)w->hash[1], state, what, best_d,
            best_d == 1 ? "" : "s", (unsigned long long)best->hash[0],
            (unsigned long long)best->hash[1]);
}

/* A miss that ran out of memory preparing *prog: frees it (not a
 * permanent failure: the eager engine runs this backward, the key is
 * tried again next time). */
static void drop_oom(gj_jit_program **prog, bool *permanent, char *why, size_t cap) {
    gj_jit_program_free(*prog);
    *prog = NULL;
    *permanent = false;
    snprintf(why, cap, "out of memory");
}

/* The class of a program-build failure, from its message (program.c). */
static gj_ca_reason build_reason(const char *why) {
    if (strncmp(why, "no lowering", 11) == 0) return GJ_CA_NO_LOWERING;
    if (strncmp(why, "LLVM", 4) == 0) return GJ_CA_LLVM_ERROR;
    return GJ_CA_OTHER;
}

/* Drops one reference to p (lock held); true when it was the last (the
 * caller frees p, with or without the lock). */
static bool unref_locked(gj_jit_program *p) { return p && --p->refs == 0; }

/* Drops a run's reference to p (lock not held), freeing p if it was the
 * last (the entry was evicted, demoted or cleared during the run). */
static void prog_release(gj_jit_program *p) {
    if (!p) return;
    pthread_mutex_lock(&g_lock);
    bool last = unref_locked(p);
    pthread_mutex_unlock(&g_lock);
    if (last) gj_jit_program_free(p);
}

/* Removes entry i (lock held): drops the cache's reference to its program
 * (freed if no run holds it) and its charge. Later entries move down one. */
static void cache_remove(int i) {
    cache_entry *e = &g_cache[i];
    if (unref_locked(e->prog)) gj_jit_program_free(e->prog);
    gj_rt_free(e->key);
    g_mem_bytes -= e->bytes;
    memmove(e, e + 1, (size_t)(g_n_cache - i - 1) * sizeof *e);
    g_n_cache--;
}

/* Evicts least recently used entries (lock held) while the cache holds
 * more bytes than the limit, never the most recently used one. */
static void evict_to_limit(void) {
    int64_t limit = gj_jit_mem_limit();
    unsigned fl = gj_jit_log_flags();
    while (limit >= 0 && g_mem_bytes > limit && g_n_cache > 1) {
        int lru = 0, mru = 0;
        for (int i = 1; i < g_n_cache; i++) {
            if (g_cache[i].last_use < g_cache[lru].last_use) lru = i;
            if (g_cache[i].last_use > g_cache[mru].last_use) mru = i;
        }
        if (lru == mru) break; /* cannot happen with n > 1 (ticks are unique) */
        const cache_entry *e = &g_cache[lru];
        if (fl & GJ_JIT_LOG_CACHE)
            fprintf(stderr,
                    "[gradjit cache] evicted %016llx%016llx (%s, %lld bytes): the memory cache "
                    "held %lld bytes, limit %lld\n",
                    (unsigned long long)e->hash[0], (unsigned long long)e->hash[1],
                    e->prog ? "program" : "eager-only mark", (long long)e->bytes,
                    (long long)g_mem_bytes, (long long)limit);
        g_stats.mem_evictions++;
        cache_remove(lru);
    }
    gj_jit_generic_sweep(false); /* generic kernels no program uses any more */
}

void gj_jit_clear_cache(void) {
    pthread_mutex_lock(&g_lock);
    bool busy = false; /* a program some run still holds (a misuse): keep the LLJIT */
    for (int i = 0; i < g_n_cache; i++) {
        gj_jit_program *p = g_cache[i].prog;
        if (unref_locked(p)) gj_jit_program_free(p);
        else if (p) busy = true;
        gj_rt_free(g_cache[i].key);
    }
    gj_rt_free(g_cache);
    g_cache = NULL;
    g_n_cache = g_cap_cache = 0;
    g_mem_bytes = 0;
    gj_jit_generic_sweep(true); /* the registry's references (runs keep theirs) */
    pthread_mutex_unlock(&g_lock);
    if (!busy) gj_jit_llvm_shutdown();
}

/* Reads GRADJIT_CACHE_MEM_LIMIT (once). */
static void mem_limit_from_env(void) {
    atomic_store(&g_mem_limit,
                 gj_jit_env_bytes("GRADJIT_CACHE_MEM_LIMIT", GJ_JIT_MEM_LIMIT_DEFAULT));
}

int64_t gj_jit_mem_limit(void) {
    pthread_once(&g_mem_limit_once, mem_limit_from_env);
    return atomic_load(&g_mem_limit);
}

void gj_jit_set_mem_limit(int64_t bytes) {
    pthread_once(&g_mem_limit_once, mem_limit_from_env); /* the setter wins over the env */
    atomic_store(&g_mem_limit, bytes < 0 ? -1 : bytes);
    pthread_mutex_lock(&g_lock);
    evict_to_limit();
    pthread_mutex_unlock(&g_lock);
}

/* Entry of key (lock held), or NULL. Finding it counts as a use (LRU). */
static cache_entry *cache_find(const gj_jit_walk *w) {
    for (int i = 0; i < g_n_cache; i++) {
        cache_entry *e = &g_cache[i];
        if (e->hash[0] == w->hash[0] && e->hash[1] == w->hash[1] && e->key_len == w->key_len &&
            memcmp(e->key, w->key, w->key_len) == 0) {
            e->last_use = ++g_tick;
            return e;
        }
    }
    return NULL;
}

/* Inserts a new entry (lock held) as the most recently used one, then
 * evicts down to the limit; prog may be NULL (eager-only), else the cache
 * takes its first reference. 0, or -1 on OOM (prog is then freed). The
 * entry pointer is not returned: eviction moves entries. */
static int cache_insert(const gj_jit_walk *w, gj_jit_program *prog, gj_ca_reason code,
                        const char *reason, bool bound) {
    if (g_n_cache == g_cap_cache) {
        int nc = g_cap_cache ? g_cap_cache * 2 : 16;
        cache_entry *c = gj_rt_realloc(g_cache, (size_t)nc * sizeof *c);
        if (!c) goto fail;
        g_cache = c;
        g_cap_cache = nc;
    }
    char *key = gj_rt_malloc(w->key_len + 1);
    if (!key) goto fail;
    memcpy(key, w->key, w->key_len + 1);
    cache_entry *e = &g_cache[g_n_cache++];
    memset(e, 0, sizeof *e);
    e->hash[0] = w->hash[0];
    e->hash[1] = w->hash[1];
    e->site[0] = w->site[0];
    e->site[1] = w->site[1];
    e->code = code;
    e->key = key;
    e->key_len = w->key_len;
    e->prog = prog;
    e->bound = bound;
    e->agreed_gen = g_agree_gen; /* the miss that inserts it agreed first */
    if (prog) {
        prog->refs = 1;
        prog->id = g_next_id++;
    }
    e->last_use = ++g_tick;
    e->bytes = (int64_t)(sizeof *e + w->key_len + 1 + gj_jit_program_bytes(prog));
    g_mem_bytes += e->bytes;
    if (reason) snprintf(e->reason, sizeof e->reason, "%s", reason);
    evict_to_limit();
    return 0;
fail:
    gj_jit_program_free(prog);
    return -1;
}

/* Writes prog (key w, own code compiled under prefix, "" if none) to the
 * disk cache when it is on, and a symbolic program also under its kernel
 * signature (for every size); counts evictions (lock held). A failure is
 * logged under GRADJIT_LOG=cache, never an error. */
static void save_to_disk(const gj_jit_walk *w, const gj_jit_program *prog, const char *prefix) {
    if (!gj_jit_disk_dir()) return;
    gj_jit_disk_usage du = {0, -1};
    gj_jit_disk_save(w, prog, prefix, &du);
    g_stats.disk_evictions += du.evictions;
    if (du.bytes >= 0) g_disk_bytes = du.bytes;
    if (prog->plan.generic) {
        gj_jit_disk_save_symbolic(prog, prefix, &du);
        g_stats.disk_evictions += du.evictions;
        if (du.bytes >= 0) g_disk_bytes = du.bytes;
    }
}

/* Inserts prog, made with no compile from kernels other programs compiled
 * (lock held), and counts it. 0; or -1 on OOM: prog freed, why[] set and
 * the lock dropped (the caller falls back). */
static int insert_bound(const gj_jit_walk *w, gj_jit_program *prog, double t0, unsigned fl,
                        char *why, size_t why_cap) {
    if (cache_insert(w, prog, GJ_CA_OTHER, NULL, true) != 0) {
        pthread_mutex_unlock(&g_lock);
        snprintf(why, why_cap, "out of memory in the cache");
        return -1;
    }
    g_stats.instantiations++;
    if (fl & GJ_JIT_LOG_CACHE)
        fprintf(stderr,
                "[gradjit cache] bound %016llx%016llx to %skernels of %d program%s in %.1f ms (no "
                "compile)\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1],
                prog->plan.generic ? "symbolic " : "", prog->n_shared,
                prog->n_shared == 1 ? "" : "s", now_ms() - t0);
    /* (no code of its own: the entry holds the kernels it borrowed; a
     * symbolic program's other sizes find its kernels' symbolic entry) */
    if (!prog->plan.generic) save_to_disk(w, prog, "");
    else if ((fl & GJ_JIT_LOG_CACHE) && gj_jit_disk_dir())
        fprintf(stderr, "[gradjit cache] %016llx%016llx not saved: its symbolic kernels' entry "
                        "serves this size\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1]);
    return 0;
}

/* Records a fallback of class code (lock NOT held): counts it, keeps its
 * message and prints it (once per key unless quiet; every time under
 * GRADJIT_LOG=fallback). */
static void fallback(gj_ca_reason code, const char *reason, bool first_for_key) {
    if ((unsigned)code >= GJ_CA_N_REASONS) code = GJ_CA_OTHER;
    snprintf(g_last_reason, sizeof g_last_reason, "%s: %s", gj_ca_reason_name(code), reason);
    pthread_mutex_lock(&g_lock);
    g_stats.fallbacks++;
    g_stats.fallbacks_by_reason[code]++;
    pthread_mutex_unlock(&g_lock);
    unsigned fl = gj_jit_log_flags();
    if ((fl & GJ_JIT_LOG_FALLBACK) || (first_for_key && !atomic_load(&g_quiet)))
        fprintf(stderr, "gradjit: compiled autograd fell back to eager: %s\n", g_last_reason);
}

/* Byte range [lo, hi) of the storage of t that its view can touch. */
static void byte_range(const gj_tensor *t, size_t *lo, size_t *hi) {
    size_t el = gj_rt_dtype_size(t->dtype);
    int64_t last = t->offset;
    for (int k = 0; k < t->ndim; k++)
        if (t->shape[k] > 0) last += (t->shape[k] - 1) * t->strides[k];
    *lo = (size_t)t->offset * el;
    *hi = t->numel > 0 ? (size_t)(last + 1) * el : *lo;
}

/* Do the memories of a and b overlap? */
static bool overlaps(const gj_tensor *a, const gj_tensor *b) {
    if (a->storage != b->storage) return false;
    size_t al, ah, bl, bh;
    byte_range(a, &al, &ah);
    byte_range(b, &bl, &bh);
    return al < bh && bl < ah;
}

typedef struct out_ctx {
    const gj_jit_plan *p;
    gj_tensor **news;
} out_ctx;

/* A new .grad tensor for output o (uninitialised: the step writes it all). */
static void *alloc_output(void *vctx, int o) {
    out_ctx *c = vctx;
    const gj_rt_meta *m = &c->p->out_meta[o];
    c->news[o] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    return c->news[o] ? gj_rt_data_ptr(c->news[o]) : NULL;
}

/* State of the hook calls of one compiled run. */
typedef struct hook_ctx {
    const gj_jit_program *pr;
    const gj_jit_walk *w;
    gj_tensor *const *tensors;   /* the run's inputs (borrowed) */
    void **data0;                /* their data pointers when the run started */
    gj_tensor **priv;            /* GRAD inputs: the private copy the plan updates */
    gj_rt_meta *leaf_meta;       /* per output: its leaf's dtype and shape at the start */
    const void **leaf_data;      /* per output: its leaf's data pointer at the start */
    const gj_ag_hook **hooks;    /* per hook reference, resolved at the start */
    /* writing outputs (write_outputs_until): the next output and hook
     * reference, and what the early writes between steps need */
    int next_out, next_hook;
    int early_from;              /* steps after which no hook/call step is left */
    gj_tensor **contig, **news;
    bool tripped;                /* a guard tripped (first reason kept) */
    bool transient;              /* ... because user code failed this time (not a cause
                                    that recurs: the key stays compiled) */
    gj_ca_reason code;
    char why[300];
} hook_ctx;

static void trip(hook_ctx *hc, gj_ca_reason code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void trip(hook_ctx *hc, gj_ca_reason code, const char *fmt, ...) {
    /* the first reason is kept, but a guard that abandons the run names it
     * rather than an earlier record_stream that let it go on */
    if (hc->tripped && (hc->code != GJ_CA_RECORD_STREAM || code == GJ_CA_RECORD_STREAM)) return;
    hc->tripped = true;
    hc->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(hc->why, sizeof hc->why, fmt, ap);
    va_end(ap);
}

/* The leaf of graph output o (NULL for a gradient gj_grad returns). */
static gj_tensor *output_leaf(const hook_ctx *hc, int o) {
    int acc = hc->pr->outputs[o].acc_node;
    return acc >= 0 ? hc->w->nodes[acc]->leaf : NULL;
}

/* Trips GJ_CA_SET_MISMATCH if user code `who` changed the dtype, shape or
 * storage of a leaf whose .grad the program writes (a parameter set_ to a
 * bf16 copy in the middle of the backward: eager then makes its .grad
 * bf16). 1 if it tripped, else 0. */
static int guard_leaves(hook_ctx *hc, const char *who) {
    char a[96], b[96];
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        gj_tensor *leaf = output_leaf(hc, o);
        if (!leaf) continue; /* a gj_grad output: no leaf written */
        gj_rt_meta m;
        gj_rt_meta_of(leaf, &m);
        if (!gj_jit_meta_equal(&m, &hc->leaf_meta[o])) {
            trip(hc, GJ_CA_SET_MISMATCH, "%s changed leaf %s (whose .grad is output #%d) to "
                 "%s (set_) during a compiled run", who,
                 gj_jit_fmt_meta(a, sizeof a, &hc->leaf_meta[o]), o,
                 gj_jit_fmt_meta(b, sizeof b, &m));
            return 1;
        }
        if (gj_rt_data_ptr(leaf) != hc->leaf_data[o]) {
            trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of leaf %s (whose .grad is "
                 "output #%d) (set_) during a compiled run", who,
                 gj_jit_fmt_meta(a, sizeof a, &m), o);
            return 1;
        }
    }
    return 0;
}

/* Checks, after user code `who` ("hook #3", "custom op ns::f") ran at
 * step `step` (a tensor hook or a custom call), that every tensor the
 * program reads or writes is still the one it was compiled for: inputs
 * (saved tensors, seeds, .grads) and the leaves whose .grad it writes. A
 * set_ that changed the dtype, shape or storage of one of them trips
 * GJ_CA_SET_MISMATCH, whichever user code made it; except that a .grad
 * whose storage was swapped (same dtype and shape) before the plan first
 * touched it is read again from its new storage, as the eager accumulation
 * would. A .grad replaced or created trips GJ_CA_HOOK_GUARD.
 * 0, 1 (tripped: abandon) or -1 (error). */
static int guard_inputs(hook_ctx *hc, const char *who, int step) {
    const gj_jit_plan *p = &hc->pr->plan;
    char a[96], b[96];
    for (int i = 0; i < hc->pr->n_inputs; i++) {
        gj_tensor *t = hc->tensors[i];
        const gj_jit_input *in = &hc->pr->inputs[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (!gj_jit_meta_equal(&m, &p->in_meta[i])) {
            trip(hc, GJ_CA_SET_MISMATCH,
                 "%s changed %s #%d from %s to %s (set_) during a compiled run", who,
                 in->role == GJ_JIT_IN_GRAD ? "the .grad of input" : "input", i,
                 gj_jit_fmt_meta(a, sizeof a, &p->in_meta[i]), gj_jit_fmt_meta(b, sizeof b, &m));
            return 1;
        }
        if (in->role == GJ_JIT_IN_GRAD) {
            gj_tensor *leaf = hc->w->nodes[in->node]->leaf;
            gj_ag_tensor_meta *lm = leaf ? leaf->ag : NULL;
            if (!lm || lm->grad != t) {
                trip(hc, GJ_CA_HOOK_GUARD, "%s replaced the .grad of a leaf during a "
                     "compiled run", who);
                return 1;
            }
            if (gj_rt_data_ptr(t) != hc->data0[i]) {
                if (p->bufs[i].first_step >= 0 && p->bufs[i].first_step <= step) {
                    trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of a .grad (set_) "
                         "after the compiled run had updated it", who);
                    return 1;
                }
                if (gj_rt_copy_into(hc->priv[i], t) != 0) return -1;
                hc->data0[i] = gj_rt_data_ptr(t);
            }
            continue; /* the sum is written back to its (new) storage at the end */
        }
        if (gj_rt_data_ptr(t) != hc->data0[i]) {
            trip(hc, GJ_CA_SET_MISMATCH, "%s swapped the storage of input #%d (set_) "
                 "during a compiled run", who, i);
            return 1;
        }
    }
    if (guard_leaves(hc, who) != 0) return 1;
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        if (hc->pr->outputs[o].grad_input >= 0 || !output_leaf(hc, o)) continue;
        gj_ag_tensor_meta *lm = output_leaf(hc, o)->ag;
        if (lm && lm->grad) {
            trip(hc, GJ_CA_HOOK_GUARD, "%s gave a leaf a .grad during a compiled run", who);
            return 1;
        }
    }
    return 0;
}

/* gj_jit_hook_call of run_program: calls the tensor hook on a fresh tensor
 * holding a copy of src and copies the value flowing on into dst. */
static int call_tensor_hook(void *vctx, const gj_jit_hookstep *hs, const void *src, void *dst) {
    hook_ctx *hc = vctx;
    const gj_rt_meta *m = &hs->meta;
    int64_t numel = 1;
    for (int k = 0; k < m->ndim; k++) numel *= m->shape[k];
    size_t nb = (size_t)numel * gj_rt_dtype_size(m->dtype);
    const gj_ag_hook *h = hc->hooks[hs->hook];
    if (h->removed) { /* removed by an earlier hook of this backward: eager skips it */
        if (nb) memcpy(dst, src, nb);
        return 0;
    }
    gj_tensor *t = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
    if (!t) return -1;
    if (nb) memcpy(gj_rt_data_ptr(t), src, nb);
    uint64_t rs0 = gj_rt_record_stream_calls();
    gj_tensor *rt = gj_ag_call_hook_ref(h, t);
    int rc = 0;
    if (!rt) {
        hc->transient = !hc->tripped; /* (a cause that recurs, met earlier, still demotes) */
        trip(hc, GJ_CA_HOOK_GUARD, "hook #%lld failed during a compiled run: %s",
             (long long)h->handle, gj_last_error());
        rc = 1;
    } else {
        gj_tensor *c = gj_rt_is_contiguous(rt) ? rt : gj_rt_contiguous(rt);
        if (!c) {
            rc = -1;
        } else {
            if (nb) memcpy(dst, gj_rt_data_ptr(c), nb);
            if (c != rt) gj_rt_tensor_release(c);
        }
        gj_rt_tensor_release(rt);
    }
    gj_rt_tensor_release(t);
    if (rc == 0 && gj_rt_record_stream_calls() != rs0)
        trip(hc, GJ_CA_RECORD_STREAM, "hook #%lld called gj_tensor_record_stream during a "
             "compiled run", (long long)h->handle);
    if (rc == 0) {
        const gj_jit_step *st = (const gj_jit_step *)(const void *)((const char *)hs -
                                                                     offsetof(gj_jit_step, hk));
        char who[48];
        snprintf(who, sizeof who, "hook #%lld", (long long)h->handle);
        rc = guard_inputs(hc, who, (int)(st - hc->pr->plan.steps));
    }
    return rc;
}

/* Fresh contiguous tensors ts[0..cs->n_in) holding copies of the call
 * step's input buffers src[] (of cs->in_meta). 0, or -1 on OOM (the ones
 * made so far are in ts for the caller to release). */
static int call_inputs(const gj_jit_callstep *cs, void *const *src, gj_tensor **ts) {
    for (int k = 0; k < cs->n_in; k++) {
        const gj_rt_meta *m = &cs->in_meta[k];
        ts[k] = gj_rt_tensor_empty(m->dtype, m->ndim, m->shape);
        if (!ts[k]) return -1;
        size_t nb = (size_t)gj_rt_numel(m->ndim, m->shape) * gj_rt_dtype_size(m->dtype);
        if (nb) memcpy(gj_rt_data_ptr(ts[k]), src[k], nb);
    }
    return 0;
}

/* The forward call step of call_custom: runs the custom op's forward C
 * function on fresh tensors holding copies of its tensor arguments (src)
 * and copies its outputs into dst. It failing, or giving an output of
 * another shape or dtype than the region's first run, abandons the run
 * (GJ_CA_HOOK_GUARD): the eager engine redoes the backward. */
static int call_custom_fwd(hook_ctx *hc, const gj_jit_callstep *cs, const gj_ag_opdef *od,
                           const gj_ag_attrs *at, const gj_custom_op *op, void *const *src,
                           void *const *dst) {
    int no = gj_ag_custom_n_outputs(op), nt = gj_ag_custom_n_tensor_args(op);
    if (nt != cs->n_in || no != cs->n_out) {
        trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: the tape op does not match the program",
             od->name);
        return 1;
    }
    gj_tensor *ts[GJ_JIT_CALL_MAX_IN] = {0}, *outs[GJ_RT_MAX_OUTPUTS] = {0};
    int rc = -1;
    if (call_inputs(cs, src, ts) != 0) goto done;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_custom_run_forward(op, at, ts, outs) != 0) {
        hc->transient = !hc->tripped;
        trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: forward failed while recomputing a "
             "checkpoint region during a compiled run: %s", od->name, gj_last_error());
        rc = 1;
        goto done;
    }
    if (gj_rt_record_stream_calls() != rs0)
        trip(hc, GJ_CA_RECORD_STREAM, "custom op %s called gj_tensor_record_stream during a "
             "compiled run", od->name);
    for (int k = 0; k < cs->n_out; k++) {
        gj_rt_meta m;
        gj_rt_meta_of(outs[k], &m);
        if (!gj_jit_meta_equal(&m, &cs->out_meta[k])) {
            char a[96], b[96];
            trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: recomputed output %d is %s, the region's "
                 "first run gave %s", od->name, k, gj_jit_fmt_meta(a, sizeof a, &m),
                 gj_jit_fmt_meta(b, sizeof b, &cs->out_meta[k]));
            rc = 1;
            goto done;
        }
        gj_tensor *c = gj_rt_is_contiguous(outs[k]) ? outs[k] : gj_rt_contiguous(outs[k]);
        if (!c) goto done;
        size_t nb = (size_t)gj_rt_numel(m.ndim, m.shape) * gj_rt_dtype_size(m.dtype);
        if (nb) memcpy(dst[k], gj_rt_data_ptr(c), nb);
        if (c != outs[k]) gj_rt_tensor_release(c);
    }
    rc = 0;
done:
    for (int k = 0; k < GJ_JIT_CALL_MAX_IN; k++)
        if (ts[k]) gj_rt_tensor_release(ts[k]);
    for (int k = 0; k < GJ_RT_MAX_OUTPUTS; k++)
        if (outs[k]) gj_rt_tensor_release(outs[k]);
    return rc;
}

/* gj_jit_custom_call of run_program: runs the custom op's backward C
 * function on fresh tensors holding copies of src (output gradients, then
 * saved arguments) and copies the gradients of the needed inputs into dst.
 * The function failing, or returning no gradient for a needed input,
 * abandons the run (GJ_CA_HOOK_GUARD): the eager engine redoes the
 * backward and reports the error or lets no gradient flow, as it does. */
static int call_custom(void *vctx, const gj_jit_callstep *cs, void *const *src,
                       void *const *dst) {
    hook_ctx *hc = vctx;
    const gj_ag_node *node = cs->node < hc->w->n ? hc->w->nodes[cs->node] : NULL;
    const gj_ag_opdef *od = NULL;
    const gj_ag_attrs *at = NULL;
    if (node && cs->tape < 0) {
        od = node->op;
        at = &node->attrs;
    } else if (node) { /* an op of a checkpoint node's tape */
        od = gj_ag_ckpt_op(node, cs->tape, &at);
    }
    const gj_custom_op *op = od && at ? gj_ag_custom_of(od) : NULL;
    if (!op) {
        trip(hc, GJ_CA_HOOK_GUARD, "custom call of node %d: not a custom op", cs->node);
        return 1;
    }
    int no = gj_ag_custom_n_outputs(op), nt = gj_ag_custom_n_tensor_args(op);
    if (cs->fwd) return call_custom_fwd(hc, cs, od, at, op, src, dst);
    if (no + nt != cs->n_in) {
        trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: the node does not match the program", od->name);
        return 1;
    }
    gj_tensor *ts[GJ_JIT_CALL_MAX_IN] = {0}, *gin[GJ_JIT_CALL_MAX_IN] = {0};
    int rc = -1;
    if (call_inputs(cs, src, ts) != 0) goto done;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_custom_run_backward(op, at, cs->in_meta, ts, ts + no, gin) != 0) {
        hc->transient = !hc->tripped;
        trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: backward failed during a compiled run: %s",
             od->name, gj_last_error());
        rc = 1;
        goto done;
    }
    if (gj_rt_record_stream_calls() != rs0)
        trip(hc, GJ_CA_RECORD_STREAM, "custom op %s called gj_tensor_record_stream during a "
             "compiled run", od->name);
    for (int i = 0, j = 0; i < nt && j < cs->n_out; i++) {
        if (!(cs->args & (1u << i))) continue; /* no gradient wanted: not an output */
        if (!gin[i]) {
            trip(hc, GJ_CA_HOOK_GUARD, "custom op %s: backward returned no gradient for "
                 "tensor argument %d during a compiled run", od->name, i);
            rc = 1;
            goto done;
        }
        gj_tensor *c = gj_rt_is_contiguous(gin[i]) ? gin[i] : gj_rt_contiguous(gin[i]);
        if (!c) goto done;
        size_t nb = (size_t)gj_rt_numel(c->ndim, c->shape) * gj_rt_dtype_size(c->dtype);
        if (nb) memcpy(dst[j], gj_rt_data_ptr(c), nb);
        if (c != gin[i]) gj_rt_tensor_release(c);
        j++;
    }
    {
        const gj_jit_step *st = (const gj_jit_step *)(const void *)((const char *)cs -
                                                                     offsetof(gj_jit_step, cs));
        char who[160];
        snprintf(who, sizeof who, "custom op %s", od->name);
        rc = guard_inputs(hc, who, (int)(st - hc->pr->plan.steps));
    }
done:
    for (int k = 0; k < GJ_JIT_CALL_MAX_IN; k++) {
        if (ts[k]) gj_rt_tensor_release(ts[k]);
        if (gin[k]) gj_rt_tensor_release(gin[k]);
    }
    return rc;
}

/* Writes graph output o into its leaf's .grad (news[o] or, for an existing
 * .grad, its private or contiguous copy contig[] written back). A leaf that
 * user code changed with set_ during the run (another dtype, or a .grad a
 * post-accumulate hook gave it) gets what the eager accumulate makes of the
 * program's gradient: a new .grad in the leaf's dtype, or the gradient
 * added into the .grad it has. A leaf of another shape is an error, as in
 * the eager engine. 0, or -1 (error set; earlier outputs stay written, as
 * with an eager backward that fails half-way). */
static int write_output(const gj_jit_program *pr, const gj_jit_walk *w,
                        gj_tensor *const *tensors, gj_tensor **contig, gj_tensor **news, int o) {
    const gj_jit_output *oo = &pr->outputs[o];
    const gj_rt_meta *om = &pr->plan.out_meta[o];
    if (oo->acc_node < 0) return 0; /* gj_grad: news[o] goes to the caller */
    gj_tensor *leaf = w->nodes[oo->acc_node]->leaf;
    if (!gj_ag_leaf_grad_fits(leaf, om, NULL)) return -1;
    if (oo->grad_input >= 0) {
        gj_tensor *g = tensors[oo->grad_input], *c = contig[oo->grad_input];
        if (c != g && gj_rt_copy_into(g, c) != 0) return -1; /* a strided or private .grad */
        gj_rt_bump_version(g);
        return 0;
    }
    gj_ag_tensor_meta *lm = gj_ag_meta_get(leaf, true);
    if (!lm) return -1;
    if (!news[o]) return 0; /* an empty gradient no step wrote: not expected */
    if (lm->grad || leaf->dtype != om->dtype) {
        gj_ag_builder *eb = gj_ag_eager_builder();
        int rc = eb->accumulate(eb, leaf, gj_ag_tensor_val(news[o]));
        gj_rt_tensor_release(news[o]);
        news[o] = NULL;
        return rc;
    }
    gj_ag_meta_set_grad(lm, news[o]); /* the slot takes the reference */
    news[o] = NULL;
    return 0;
}

/* Runs post-accumulate hook i of the program (its leaf's .grad is written)
 * and its guards, which trip but never abandon (the .grads written so far
 * are final): record_stream, a .grad whose dtype or shape changed, a leaf
 * of an output changed by set_ (the outputs not yet written then get the
 * eager accumulate's result, see write_output), a .grad given to a leaf
 * whose output is not yet written. 0, or -1 when an error was raised inside
 * the hook (the backward then fails with it, as in eager). */
static int run_post_hook(hook_ctx *hc, int i, int written) {
    gj_ag_builder *eb = gj_ag_eager_builder();
    const gj_jit_hookref *ref = &hc->pr->hooks[i];
    const gj_ag_hook *h = hc->hooks[i];
    gj_tensor *leaf = hc->w->nodes[ref->node]->leaf;
    uint64_t rs0 = gj_rt_record_stream_calls();
    if (gj_ag_eager_call_post_hook(eb, h, leaf) != 0)
        return -1; /* an error inside the hook fails the backward, as in eager */
    if (gj_rt_record_stream_calls() != rs0)
        trip(hc, GJ_CA_RECORD_STREAM, "post-accumulate hook #%lld called "
             "gj_tensor_record_stream during a compiled run", (long long)h->handle);
    char who[64];
    snprintf(who, sizeof who, "post-accumulate hook #%lld", (long long)h->handle);
    guard_leaves(hc, who);
    for (int o = 0; o < hc->pr->n_outputs; o++) {
        gj_ag_tensor_meta *lm = output_leaf(hc, o) ? output_leaf(hc, o)->ag : NULL;
        gj_rt_meta m;
        if (!lm || !lm->grad) continue;
        if (o >= written && hc->pr->outputs[o].grad_input < 0) {
            trip(hc, GJ_CA_HOOK_GUARD, "%s gave a leaf a .grad during a compiled run", who);
            continue;
        }
        gj_rt_meta_of(lm->grad, &m);
        if (!gj_jit_meta_equal(&m, &hc->pr->plan.out_meta[o])) {
            char a[96], b[96];
            trip(hc, GJ_CA_SET_MISMATCH, "%s changed a .grad from %s to %s (set_) during a "
                 "compiled run", who, gj_jit_fmt_meta(a, sizeof a, &hc->pr->plan.out_meta[o]),
                 gj_jit_fmt_meta(b, sizeof b, &m));
        }
    }
    return 0;
}

/* The event log of this thread's last compiled run: after how many steps
 * each post-accumulate hook ran (gj_jit_last_post_hook_steps). */
static _Thread_local int t_post_steps[GJ_JIT_MAX_POST_LOG], t_n_post_steps, t_run_steps;

int gj_jit_last_post_hook_steps(int *out, int cap, int *n_steps) {
    for (int i = 0; i < t_n_post_steps && i < cap; i++) out[i] = t_post_steps[i];
    if (n_steps) *n_steps = t_run_steps;
    return t_n_post_steps;
}

/* Steps after which output o of pr is final: no later step reads or
 * writes its buffer. */
static int output_final_after(const gj_jit_program *pr, int o) {
    const gj_jit_buffer *x = &pr->plan.bufs[pr->plan.out_buf[o]];
    return x->last_step + 1;
}

/* Writes outputs into their leaves' .grads in the eager engine's order,
 * each post-accumulate hook right after the .grads eager writes before it
 * (hookref.n_out), so a hook that changes a later leaf with set_ has the
 * effect it has in eager; resumes where the previous call stopped
 * (hc->next_out, hc->next_hook). With done < the plan's step count (called
 * between steps) it stops at the first output not yet final after `done`
 * steps and at the first hook not registered GJ_HOOK_NO_GRAPH_WRITES: only
 * such hooks run mid-program (a gradient reducer then starts while the
 * backward goes on); the rest wait for the last step. 0 or -1 (error set). */
static int write_outputs_until(hook_ctx *hc, const gj_jit_program *pr, const gj_jit_walk *w,
                               gj_tensor *const *tensors, bool hooks, int done) {
    bool all = done >= pr->plan.n_steps;
    for (;;) {
        while (hooks && hc->next_hook < pr->n_hooks && !pr->hooks[hc->next_hook].post)
            hc->next_hook++;
        bool hook_left = hooks && hc->next_hook < pr->n_hooks;
        int need = hook_left ? pr->hooks[hc->next_hook].n_out : pr->n_outputs;
        if (need > pr->n_outputs) need = pr->n_outputs;
        for (; hc->next_out < need; hc->next_out++) {
            if (!all && output_final_after(pr, hc->next_out) > done) return 0;
            if (write_output(pr, w, tensors, hc->contig, hc->news, hc->next_out) != 0) return -1;
        }
        if (!hook_left) return 0;
        const gj_ag_hook *h = hc->hooks[hc->next_hook];
        if (!all && !h->early) return 0;
        if (!h->removed) {
            if (t_n_post_steps < GJ_JIT_MAX_POST_LOG) t_post_steps[t_n_post_steps++] = done;
            if (run_post_hook(hc, hc->next_hook, hc->next_out) != 0) return -1;
        }
        hc->next_hook++;
    }
}

/* gj_jit_progress: between groups of steps, once no hook or custom call
 * step is left (they may abandon the run, which must then have written
 * nothing), the outputs that are final and the early hooks after them. */
static int write_early(void *ctx, int done) {
    hook_ctx *hc = ctx;
    if (done < hc->early_from) return 0;
    return write_outputs_until(hc, hc->pr, hc->w, hc->tensors, true, done);
}

/* Runs program pr on the tensors of this backward. Returns 0 (gradients
 * written; hc->tripped tells whether a guard tripped after a post hook or a
 * record_stream), 1 (fallback: nothing written, reason in why), 2 (a guard
 * tripped in a tensor hook: nothing written, hooks ran, reason in hc) or -1
 * (error set, nothing written). A gj_grad's program (ret_out non-NULL)
 * writes no .grad: on 0, ret_out[o] receives output o as a new tensor. */
static int run_program(gj_jit_program *pr, const gj_jit_walk *w, gj_tensor *const *tensors,
                       char *why, size_t why_cap, hook_ctx *hc, gj_tensor **ret_out) {
    const gj_jit_plan *p = &pr->plan;
    int rc = -1;
    int n_in = pr->n_inputs, n_out = pr->n_outputs;
    gj_tensor **contig = gj_rt_calloc((size_t)n_in + 1, sizeof *contig);
    gj_tensor **news = gj_rt_calloc((size_t)n_out + 1, sizeof *news);
    void **in = gj_rt_calloc((size_t)n_in + 1, sizeof *in);
    void **out = gj_rt_calloc((size_t)n_out + 1, sizeof *out);
    uint64_t *params = NULL;
    if (!contig || !news || !in || !out) goto done;
    bool hooks = pr->n_hooks > 0 || pr->n_calls > 0; /* user code runs during the plan */
    if (hooks) {
        hc->pr = pr;
        hc->w = w;
        hc->tensors = tensors;
        hc->data0 = gj_rt_calloc((size_t)n_in + 1, sizeof *hc->data0);
        hc->hooks = gj_rt_calloc((size_t)pr->n_hooks + 1, sizeof *hc->hooks);
        if (!hc->data0 || !hc->hooks) goto done;
        for (int i = 0; i < pr->n_hooks; i++) {
            const gj_jit_hookref *ref = &pr->hooks[i];
            const gj_ag_hook *hs[64];
            int c = ref->node < w->n ? gj_ag_node_hooks(w->nodes[ref->node], ref->k, hs, 64) : 0;
            if (ref->j >= c || ref->j >= 64 ||
                (hs[ref->j]->kind == GJ_AG_HOOK_POST_ACCUMULATE) != ref->post) {
                snprintf(why, why_cap, "hook #%d of the program not found on the graph", i);
                rc = 1;
                goto done;
            }
            hc->hooks[i] = hs[ref->j];
        }
    }
    for (int i = 0; i < n_in; i++) {
        gj_tensor *t = tensors[i];
        gj_rt_meta m;
        gj_rt_meta_of(t, &m);
        if (!gj_jit_meta_equal(&m, &p->in_meta[i])) {
            snprintf(why, why_cap, "input #%d changed shape or dtype", i);
            rc = 1;
            goto done;
        }
        if (pr->inputs[i].role == GJ_JIT_IN_GRAD) {
            for (int j = 0; j < n_in; j++)
                if (j != i && overlaps(tensors[j], t)) {
                    snprintf(why, why_cap, "a .grad shares memory with another input of the graph");
                    rc = 1;
                    goto done;
                }
        }
        if (pr->inputs[i].role == GJ_JIT_IN_GRAD) { /* written: contiguous (copy if strided) */
            if (hooks) { /* a private copy: written back once every step ran */
                contig[i] = gj_rt_tensor_empty(m.dtype, m.ndim, m.shape);
                if (contig[i] && gj_rt_copy_into(contig[i], t) != 0) goto done;
            } else {
                contig[i] = gj_rt_contiguous(t);
            }
            if (!contig[i]) goto done;
            in[i] = gj_rt_data_ptr(contig[i]);
            continue;
        }
        int64_t st[GJ_MAX_DIMS];
        gj_jit_input_strides(t, st);
        if (memcmp(st, pr->inputs[i].strides, (size_t)m.ndim * sizeof st[0]) != 0) {
            snprintf(why, why_cap, "input #%d has another layout than when compiled", i);
            rc = 1;
            goto done;
        }
        in[i] = gj_rt_data_ptr(t); /* read in place */
    }
    if (hooks) {
        for (int i = 0; i < n_in; i++) hc->data0[i] = gj_rt_data_ptr(tensors[i]);
        hc->priv = contig;
        hc->leaf_meta = gj_rt_calloc((size_t)n_out + 1, sizeof *hc->leaf_meta);
        hc->leaf_data = gj_rt_calloc((size_t)n_out + 1, sizeof *hc->leaf_data);
        if (!hc->leaf_meta || !hc->leaf_data) goto done;
        for (int o = 0; o < n_out; o++) {
            gj_tensor *leaf = output_leaf(hc, o);
            if (!leaf) continue; /* a gj_grad output */
            gj_rt_meta_of(leaf, &hc->leaf_meta[o]);
            hc->leaf_data[o] = gj_rt_data_ptr(leaf);
        }
    }
    if (p->n_rt_params > 0) { /* dropout seeds/offsets of this run */
        params = gj_rt_calloc((size_t)p->n_rt_params * 2, sizeof *params);
        if (!params) goto done;
        for (int k = 0; k < p->n_rt_params; k++) {
            if (gj_jit_dropout_params(w, p->rt_param_node[k], p->rt_param_tape[k],
                                      &params[2 * k]) != 0) {
                snprintf(why, why_cap, "dropout parameters not found");
                rc = 1;
                goto done;
            }
        }
    }
    out_ctx oc = {p, news};
    hc->contig = contig;
    hc->news = news;
    hc->next_out = hc->next_hook = 0;
    hc->early_from = 0;
    t_n_post_steps = 0;
    t_run_steps = p->n_steps;
    bool early = false;
    for (int i = 0; hooks && i < pr->n_hooks; i++)
        early |= pr->hooks[i].post && hc->hooks[i]->early;
    for (int s = 0; s < p->n_steps; s++)
        if (p->steps[s].kind == GJ_JIT_STEP_HOOK || p->steps[s].kind == GJ_JIT_STEP_CALL)
            hc->early_from = s + 1;
    int er = gj_jit_plan_exec_calls(p, in, params, out, alloc_output, &oc,
                                    hooks ? call_tensor_hook : NULL, hooks ? call_custom : NULL,
                                    early ? write_early : NULL, hc);
    if (er == 1) {
        rc = 2;
        goto done;
    }
    if (er != 0) goto done;
    if (write_outputs_until(hc, pr, w, tensors, hooks, p->n_steps) != 0) goto done;
    for (int o = 0; ret_out && o < n_out; o++) {
        if (!news[o]) { /* every output of a gj_grad is a new buffer */
            gj_rt_set_error("gj_grad: internal: compiled output #%d was not written", o);
            for (int q = 0; q < o; q++) gj_rt_tensor_release(ret_out[q]);
            goto done;
        }
        ret_out[o] = news[o];
    }
    for (int o = 0; ret_out && o < n_out; o++) news[o] = NULL;
    rc = 0;
done:
    for (int i = 0; i < n_in && contig; i++)
        if (contig[i]) gj_rt_tensor_release(contig[i]);
    for (int o = 0; o < n_out && news; o++)
        if (news[o]) gj_rt_tensor_release(news[o]);
    gj_rt_free(contig);
    gj_rt_free(news);
    gj_rt_free(in);
    gj_rt_free(out);
    gj_rt_free(params);
    gj_rt_free(hc->data0);
    gj_rt_free((void *)hc->hooks);
    gj_rt_free(hc->leaf_meta);
    gj_rt_free((void *)hc->leaf_data);
    hc->leaf_meta = NULL;
    hc->leaf_data = NULL;
    hc->data0 = NULL;
    hc->hooks = NULL;
    hc->priv = NULL;
    return rc;
}

/* Marks the entry of w eager-only after a guard tripped. Returns whether
 * this call did it (the first time for the key: print the warning). */
static bool demote(const gj_jit_walk *w, gj_ca_reason code, const char *why) {
    pthread_mutex_lock(&g_lock);
    cache_entry *e = cache_find(w);
    bool first = e && e->prog && !e->demoted;
    gj_jit_program *drop = NULL;
    if (first) {
        e->demoted = true;
        e->code = code;
        snprintf(e->reason, sizeof e->reason, "%.250s", why);
        int64_t pb = (int64_t)gj_jit_program_bytes(e->prog);
        e->bytes -= pb;
        g_mem_bytes -= pb;
        if (unref_locked(e->prog)) drop = e->prog; /* the caller's run still holds it */
        e->prog = NULL;
    }
    pthread_mutex_unlock(&g_lock);
    gj_jit_program_free(drop);
    return first;
}

/* The input tensors of program pr for this walk, from canonical origins.
 * tensors[] receives borrowed pointers. false if an origin is missing. */
static bool inputs_from_walk(const gj_jit_program *pr, const gj_jit_walk *w,
                             gj_tensor *const *seeds, gj_tensor **tensors) {
    for (int i = 0; i < pr->n_inputs; i++) {
        const gj_jit_input *in = &pr->inputs[i];
        gj_tensor *t = NULL;
        switch (in->role) {
        case GJ_JIT_IN_SAVED:
            if (in->node >= 0 && in->node < w->n && in->slot < w->nodes[in->node]->n_saved)
                t = w->nodes[in->node]->saved[in->slot].t;
            break;
        case GJ_JIT_IN_SEED:
            t = seeds ? seeds[in->slot] : NULL;
            break;
        case GJ_JIT_IN_GRAD:
            if (in->node >= 0 && in->node < w->n && w->nodes[in->node]->leaf) {
                gj_ag_tensor_meta *m = w->nodes[in->node]->leaf->ag;
                t = m ? m->grad : NULL;
            }
            break;
        default:
            break;
        }
        if (!t) return false;
        tensors[i] = t;
    }
    return true;
}

/* What a gj_grad asks for (NULL for a backward): the inputs, and where
 * their gradients go (new references, NULL where none reaches). */
typedef struct grad_req {
    int n_inputs;
    gj_tensor *const *inputs;
    gj_tensor **grads_out;
} grad_req;

/* Gives the gradients of a gj_grad's run (outs[o]: output o, a reference
 * each, consumed) to the requested inputs: an edge requested twice gets
 * the same tensor with one more reference (gj_grad then gives each slot
 * a header of its own, as after an eager run). */
static void hand_out(const gj_jit_program *pr, const grad_req *gr, gj_tensor **outs) {
    for (int i = 0; i < gr->n_inputs; i++) {
        int o = i < pr->n_ret ? pr->ret[i] : -1;
        gr->grads_out[i] = o >= 0 ? outs[o] : NULL;
        if (o >= 0) gj_rt_tensor_retain(outs[o]);
    }
    for (int o = 0; o < pr->n_outputs; o++) gj_rt_tensor_release(outs[o]);
}

/* Without retain_graph, frees the saved tensors of what the engine ran: in
 * backward mode every node of the roots' graph, in gj_grad mode the needed
 * op nodes of the walk (the engine's gj_grad frees only those). */
static void release_graph(const gj_jit_walk *w, int n_roots, gj_tensor *const *roots) {
    if (!w->grad_mode) {
        gj_ag_release_graph(n_roots, roots);
        return;
    }
    for (int i = 0; i < w->n; i++)
        if (w->needed[i] && w->nodes[i]->kind == GJ_AG_OP) gj_ag_node_free_saved(w->nodes[i]);
}

/* gj_jit_backward and gj_jit_grad (gr non-NULL). */
static int run_compiled(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                        const grad_req *gr, bool retain_graph, bool *handled) {
    *handled = false;
    gj_jit_walk w;
    gj_jit_capture cap;
    memset(&cap, 0, sizeof cap);
    gj_jit_program *held = NULL; /* the run's reference */
    bool have_cap = false;
    gj_tensor **tensors = NULL;
    uint64_t stripes = 0; /* leaf-lock stripes held during the run */
    char why[300] = "";
    gj_ca_reason code = GJ_CA_OTHER;
    int rc = 0;
    unsigned fl = gj_jit_log_flags();
    bool timed = (fl & (GJ_JIT_LOG_PROF | GJ_JIT_LOG_STEPS)) != 0;
    double tp0 = timed ? now_ms() : 0, tp1 = 0, tp2 = 0;
    bool fresh = false; /* this backward compiled or loaded its program */
    gj_tensor **outs = NULL; /* gj_grad: the program's outputs */
    if (gj_jit_walk_build_grad(&w, n_roots, roots, seeds, gr ? gr->n_inputs : 0,
                               gr ? gr->inputs : NULL) != 0) {
        gj_jit_walk_free(&w);
        fallback(GJ_CA_OTHER, "out of memory while computing the key", false);
        return 0;
    }
    if (w.invalid) {
        /* Not a fallback: the backward is an error (graph freed, saved
         * tensor modified, root without grad), which the eager engine
         * reports with its usual message. Nothing is counted. */
        goto out;
    }
    pthread_mutex_lock(&g_lock);
    cache_entry *e = cache_find(&w);
    gj_jit_program *prog = NULL;
    if (agree(&w, e) != 0) { /* the processes run different programs: an error */
        pthread_mutex_unlock(&g_lock);
        rc = -1;
        *handled = true;
        goto out;
    }
    if (e && (!e->prog || e->demoted)) {
        snprintf(why, sizeof why, "%s", e->reason);
        code = e->code;
        pthread_mutex_unlock(&g_lock);
        if (fl & GJ_JIT_LOG_STEPS)
            fprintf(stderr, "[gradjit steps] cache hit eager-only %016llx%016llx\n",
                    (unsigned long long)w.hash[0], (unsigned long long)w.hash[1]);
        goto fall;
    }
    if (e) {
        prog = e->prog;
        g_stats.mem_hits++;
        if (fl & GJ_JIT_LOG_STEPS)
            fprintf(stderr, "[gradjit steps] cache hit %016llx%016llx\n", (unsigned long long)w.hash[0],
                    (unsigned long long)w.hash[1]);
    } else {
        int limit = atomic_load(&g_recompile_limit), n_site = site_programs(&w);
        bool at_limit = limit >= 0 && n_site >= limit;
        /* dynamic shapes: the site's second program and later ones (every
         * program under ALWAYS) are symbolic; a new size of such a site
         * first tries the kernels compiled for other sizes, which is no
         * compile: the recompile limit stops only a compile */
        gj_ca_dynamic dm = gj_jit_dynamic();
        bool symbolic = dm == GJ_CA_DYNAMIC_ALWAYS ||
                        (dm == GJ_CA_DYNAMIC_AUTO && site_count(&w, true) > 0);
        if (fl & GJ_JIT_LOG_RECOMPILES) log_recompile(&w, n_site, limit, symbolic);
        char lwhy[200] = "";
        if (at_limit) {
            snprintf(lwhy, sizeof lwhy,
                     "%d programs already compiled for this call site (limit %d: "
                     "gj_compiled_autograd_set_recompile_limit)",
                     n_site, limit);
            if (!symbolic) {
                cache_insert(&w, NULL, GJ_CA_RECOMPILE_LIMIT, lwhy, false);
                pthread_mutex_unlock(&g_lock);
                fallback(GJ_CA_RECOMPILE_LIMIT, lwhy, true);
                goto out;
            }
        }
        double t0 = now_ms();
        have_cap = true;
        if (gj_jit_capture_run(&cap, &w, n_roots, roots, seeds) != 0) {
            snprintf(why, sizeof why, "%s", cap.reason);
            code = cap.code;
            if (cap.permanent) cache_insert(&w, NULL, code, why, false);
            pthread_mutex_unlock(&g_lock);
            if (cap.permanent) {
                fallback(code, why, true);
                goto out;
            }
            goto fall;
        }
        bool permanent = false, disk = gj_jit_disk_dir() != NULL;
        char prefix[48];
        snprintf(prefix, sizeof prefix, "gjk%016llx%016llx", (unsigned long long)w.hash[0],
                 (unsigned long long)w.hash[1]);
        prog = gj_jit_program_plan(&cap.g, why, sizeof why, &permanent);
        if (prog && w.grad_mode) { /* which output answers which input */
            prog->ret = gj_rt_malloc(((size_t)w.n_req + 1) * sizeof *prog->ret);
            if (!prog->ret) {
                drop_oom(&prog, &permanent, why, sizeof why);
            } else {
                memcpy(prog->ret, cap.ret, (size_t)w.n_req * sizeof *prog->ret);
                prog->n_ret = w.n_req;
            }
        }
        if (prog && symbolic) {
            char bwhy[200] = "";
            int b = gj_jit_plan_make_generic(&prog->plan);
            if (b == 0)
                b = gj_jit_kernels_bind(&prog->plan, false, &prog->shared, &prog->n_shared, bwhy,
                                        sizeof bwhy);
            if (b == 1 && (fl & (GJ_JIT_LOG_RECOMPILES | GJ_JIT_LOG_CACHE)) && site_symbolic(&w))
                fprintf(stderr, "[gradjit recompiles] key %016llx%016llx compiles symbolically: %s\n",
                        (unsigned long long)w.hash[0], (unsigned long long)w.hash[1], bwhy);
            if (b < 0) {
                drop_oom(&prog, &permanent, why, sizeof why);
            } else if (b == 0) {
                if (insert_bound(&w, prog, t0, fl, why, sizeof why) != 0) {
                    prog = NULL; /* freed, lock dropped */
                    goto fall;
                }
                fresh = true;
                goto run;
            }
        }
        if (at_limit && prog) { /* not bound: a compile, which the limit forbids */
            gj_jit_program_free(prog);
            prog = NULL;
            cache_insert(&w, NULL, GJ_CA_RECOMPILE_LIMIT, lwhy, false);
            pthread_mutex_unlock(&g_lock);
            fallback(GJ_CA_RECOMPILE_LIMIT, lwhy, true);
            goto out;
        }
        /* the disk cache answers only for the plan made here: its file's
         * plan must be this one byte for byte (hook and custom calls name
         * their hook or op by canonical position, resolved at each run) */
        bool found = false, loaded = false, on_disk = prog && disk;
        char dwhy[300] = "";
        if (on_disk) /* (a symbolic program's code has its own symbol prefix) */
            loaded = gj_jit_disk_load(&w, prog, prog->plan.generic ? NULL : prefix, &found, dwhy,
                                      sizeof dwhy) == 0;
        if (found && !loaded && (fl & GJ_JIT_LOG_CACHE))
            fprintf(stderr, "[gradjit cache] disk entry %016llx%016llx not used: %s\n",
                    (unsigned long long)w.hash[0], (unsigned long long)w.hash[1], dwhy);
        /* then a symbolic program of these kernels from an earlier process
         * (another size): also for the first program of an AUTO site, which
         * compiles specialised when there is none */
        if (on_disk && !loaded && dm != GJ_CA_DYNAMIC_OFF) {
            bool was = prog->plan.generic;
            if (!was && gj_jit_plan_make_generic(&prog->plan) != 0) {
                drop_oom(&prog, &permanent, why, sizeof why);
            } else {
                found = false;
                loaded = gj_jit_disk_load_symbolic(prog, &found, dwhy, sizeof dwhy) == 0;
                if (found && !loaded && (fl & GJ_JIT_LOG_CACHE))
                    fprintf(stderr, "[gradjit cache] symbolic disk entry for %016llx%016llx not "
                                    "used: %s\n",
                            (unsigned long long)w.hash[0], (unsigned long long)w.hash[1], dwhy);
                if (!loaded && !was && gj_jit_plan_make_specific(&prog->plan) != 0) {
                    drop_oom(&prog, &permanent, why, sizeof why);
                }
            }
        }
        if (loaded) {
            if (cache_insert(&w, prog, GJ_CA_OTHER, NULL, false) != 0) {
                pthread_mutex_unlock(&g_lock); /* prog freed by cache_insert */
                prog = NULL;
                snprintf(why, sizeof why, "out of memory in the cache");
                goto fall;
            }
            g_stats.disk_hits++;
            fresh = true;
            /* for other programs: its kernels and the ones it borrowed */
            (void)gj_jit_kernels_register(&prog->plan, prog->code, prog->shared, prog->n_shared);
            if (fl & GJ_JIT_LOG_CACHE)
                fprintf(stderr, "[gradjit cache] disk hit %016llx%016llx in %.1f ms\n",
                        (unsigned long long)w.hash[0], (unsigned long long)w.hash[1],
                        now_ms() - t0);
            goto run;
        }
        /* kernels other programs compiled (the same description: another
         * call site, a gj_grad of the same model) are not compiled again;
         * when none is left the program is bound like a new size */
        int missing = 1;
        char kwhy[200];
        if (prog) {
            missing = gj_jit_kernels_bind(&prog->plan, true, &prog->shared, &prog->n_shared, kwhy,
                                          sizeof kwhy);
            if (missing < 0) drop_oom(&prog, &permanent, why, sizeof why);
        }
        if (prog && missing == 0) {
            if (insert_bound(&w, prog, t0, fl, why, sizeof why) != 0) {
                prog = NULL; /* freed, lock dropped */
                goto fall;
            }
            fresh = true;
            goto run;
        }
        /* (a symbolic program's code, or code whose key prefix is still
         * live because it lent kernels after its program was evicted, gets
         * a fresh prefix: see diskcache.h) */
        if (prog && (prog->plan.generic || gj_jit_code_prefix_live(prefix)))
            gj_jit_generic_prefix(prefix);
        if (prog && gj_jit_program_compile(prog, prefix, disk, why, sizeof why, &permanent) != 0) {
            gj_jit_program_free(prog);
            prog = NULL;
        }
        if (!prog) {
            code = build_reason(why);
            if (permanent) cache_insert(&w, NULL, code, why, false);
            pthread_mutex_unlock(&g_lock);
            if (permanent) {
                fallback(code, why, true);
                goto out;
            }
            goto fall;
        }
        if (cache_insert(&w, prog, GJ_CA_OTHER, NULL, false) != 0) {
            pthread_mutex_unlock(&g_lock); /* prog freed by cache_insert */
            prog = NULL;
            snprintf(why, sizeof why, "out of memory in the cache");
            goto fall;
        }
        g_stats.compiles++;
        fresh = true;
        g_stats.compile_ms += now_ms() - t0;
        /* its kernels serve other programs (a symbolic one's, other sizes;
         * failing to register only costs a later compile) */
        (void)gj_jit_kernels_register(&prog->plan, prog->code, NULL, 0);
        if (fl & GJ_JIT_LOG_CACHE)
            fprintf(stderr, "[gradjit cache] compiled %016llx%016llx in %.1f ms%s\n",
                    (unsigned long long)w.hash[0], (unsigned long long)w.hash[1], now_ms() - t0,
                    prog->n_shared ? " (some kernels shared with other programs)" : "");
        save_to_disk(&w, prog, prefix);
    }
run:
    prog->refs++; /* this run's reference (held): eviction cannot free it under us */
    held = prog;
    pthread_mutex_unlock(&g_lock);

    /* .grads are read (as inputs, and when accumulating in place) and
     * written by the run: hold the stripes of every leaf it writes from
     * here to the end, or leave the backward to the eager engine, which
     * waits for them (docs/fallbacks.md) */
    for (int o = 0; o < prog->n_outputs; o++)
        if (prog->outputs[o].acc_node >= 0) /* none for gj_grad: it writes no .grad */
            stripes |= 1ull << gj_ag_leaf_stripe(w.nodes[prog->outputs[o].acc_node]->leaf);
    if (!gj_ag_leaf_trylock_stripes(stripes)) {
        stripes = 0;
        snprintf(why, sizeof why, "another thread's backward is writing a .grad of this backward");
        goto fall;
    }
    /* the run's input tensors */
    tensors = gj_rt_calloc((size_t)prog->n_inputs + 1, sizeof *tensors);
    if (gr) outs = gj_rt_calloc((size_t)prog->n_outputs + 1, sizeof *outs);
    if (!tensors || (gr && !outs)) {
        snprintf(why, sizeof why, "out of memory");
        goto fall;
    }
    if (have_cap) {
        memcpy(tensors, cap.tensors, (size_t)prog->n_inputs * sizeof *tensors);
    } else if (prog->recapture || !inputs_from_walk(prog, &w, seeds, tensors)) {
        have_cap = true;
        if (gj_jit_capture_run(&cap, &w, n_roots, roots, seeds) != 0 ||
            cap.g.n_inputs != prog->n_inputs) {
            snprintf(why, sizeof why, "re-capture failed: %s", cap.reason);
            code = cap.code;
            goto fall;
        }
        memcpy(tensors, cap.tensors, (size_t)prog->n_inputs * sizeof *tensors);
    }
    double t1 = now_ms();
    tp1 = t1;
    hook_ctx hc;
    memset(&hc, 0, sizeof hc);
    int r = run_program(prog, &w, tensors, why, sizeof why, &hc, outs);
    gj_ag_leaf_unlock_stripes(stripes); /* before g_lock: leaf locks are taken under it */
    stripes = 0;
    tp2 = now_ms();
    if (r == 1) goto fall;
    if (r == 2 || (r == 0 && hc.tripped)) {
        /* a guard: eager-only from now on, unless user code failed this
         * time (an allocation in a hook): the next clean step runs compiled */
        fallback(hc.code, hc.why, hc.transient ? false : demote(&w, hc.code, hc.why));
        if (r == 2) goto out; /* nothing written: the eager engine runs this backward */
    }
    if (r == 0) {
        note_last_program(prog);
        pthread_mutex_lock(&g_lock);
        g_stats.run_ms += now_ms() - t1;
        pthread_mutex_unlock(&g_lock);
    }
    rc = r == 0 ? 0 : -1;
    *handled = true;
    if (rc == 0 && gr) hand_out(prog, gr, outs);
    if (rc == 0 && !retain_graph) release_graph(&w, n_roots, roots);
    if (timed && rc == 0) {
        double tend = now_ms();
        if (fl & GJ_JIT_LOG_STEPS)
            fprintf(stderr,
                    "[gradjit steps] backward %.3f ms: key and lookup %.3f, program %.3f (steps "
                    "and buffers), graph release %.3f\n",
                    tend - tp0, tp1 - tp0, tp2 - tp1, tend - tp2);
        gj_jit_prof_backward(fresh, tend - tp0, tp1 - tp0, tp2 - tp1, tend - tp2);
    }
    goto out;
fall:
    fallback(code, why, false);
out:
    gj_ag_leaf_unlock_stripes(stripes);
    prog_release(held);
    gj_rt_free(tensors);
    gj_rt_free(outs);
    if (have_cap) gj_jit_capture_free(&cap);
    gj_jit_walk_free(&w);
    return rc;
}

int gj_jit_backward(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds,
                    bool retain_graph, bool *handled) {
    return run_compiled(n_roots, roots, seeds, NULL, retain_graph, handled);
}

int gj_jit_grad(int n_roots, gj_tensor *const *roots, gj_tensor *const *seeds, int n_inputs,
                gj_tensor *const *inputs, gj_tensor **grads_out, bool retain_graph,
                bool *handled) {
    for (int i = 0; i < n_inputs; i++) grads_out[i] = NULL;
    grad_req gr = {n_inputs, inputs, grads_out};
    return run_compiled(n_roots, roots, seeds, &gr, retain_graph, handled);
}
