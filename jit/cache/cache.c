/* SPDX-License-Identifier: MIT */
/*
 * cache.c - programs by key (cache.h): the memory cache and the way a
 * missing program is made, for every compiled path.
 *
 * Invariants:
 *   - The cache maps a key (full canonical text, indexed by its 128-bit
 *     hash) to a program or to "eager-only" with the reason. A lookup
 *     compares the whole text. A memory miss captures and plans (the
 *     caller's gj_jit_source), then asks the disk cache (diskcache.c) for
 *     object code compiled for exactly that plan (the file's plan is never
 *     run, only compared); a compiled program is written there (its kernels
 *     are named after the hash of the key and the plan, so object code from
 *     another process links without clashes, and code made for another plan
 *     is never taken for this one's).
 *   - Dynamic shapes (plan/symbolic.c): when the call site already has a
 *     program (every time under GJ_CA_DYNAMIC_ALWAYS) the new plan is made
 *     generic and first bound to registered symbolic kernels: no compile,
 *     the entry is marked bound and counted in instantiations, not toward
 *     the recompile limit. Before any compile, kernels registered by other
 *     programs (same description) are bound and only the rest compiled;
 *     every compile and disk load registers its kernels (a disk load also
 *     the kernels its entry carries for the programs it borrowed from).
 *   - Disk cache: every program made here is written there (when the
 *     cache is on): compiled, bound to kernels of other programs (its entry
 *     carries their object code), with hook or custom call instructions (they name
 *     hooks and ops by canonical position, resolved at each run). A bound
 *     symbolic program is the exception: its kernels' symbolic entry serves
 *     every size.
 *   - One mutex guards the cache; making a program holds it (compiles are
 *     rare); running a program does not: a run holds a reference to its
 *     program (prog->refs, taken under the mutex), the cache another, and
 *     whoever drops the last one frees it.
 *   - Size limit (gj_jit_set_mem_limit, GRADJIT_CACHE_MEM_LIMIT, default
 *     GJ_JIT_MEM_LIMIT_DEFAULT): every entry is charged its bytes (the
 *     entry, its key text, and its program's data and machine code,
 *     gj_jit_program_bytes) into g_mem_bytes. After an insertion or a
 *     lower limit, entries are evicted least recently used first (a tick
 *     stamped at insertion and at every lookup that finds the entry) until
 *     g_mem_bytes is within the limit, except the most recently used entry,
 *     which stays even if alone it is larger. Evicting a program drops the
 *     cache's reference: its machine code goes with it (its own ORC
 *     resource tracker, codegen.h) unless another program borrowed its
 *     kernels. Eager-only entries are evicted as well (the key is then
 *     judged again when seen again), and an evicted key no longer counts
 *     toward its call site's recompile limit.
 *   - Recompile limit: a new key whose call site already has `limit`
 *     programs in the cache is marked eager-only instead of being
 *     captured; keys compiled before keep running compiled.
 *   - A demoted entry (a guard tripped on a cause that recurs) drops its
 *     program, which runs in progress keep alive, but still counts toward
 *     its call site's recompile limit.
 */
#include "jit/cache/cache.h"

#include "jit/cache/cache_int.h"
#include "jit/jit.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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
    char reason[400];     /* eager-only: the message (a guard's: first cause, "also: ..." */
    uint64_t agreed_gen;  /* the agreement registration this key was agreed under */
} cache_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static cache_entry *g_cache;
static int g_n_cache, g_cap_cache;
static int64_t g_mem_bytes;   /* sum of the entries' bytes */
static uint64_t g_tick;       /* LRU clock */
static uint64_t g_next_id = 1; /* program ids */
static int64_t g_disk_bytes;  /* our disk entries' bytes after this process's last save */
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
static int agree(const gj_jit_key *w, cache_entry *e) {
    if (!g_agree_fn || (e && e->agreed_gen == g_agree_gen)) return 0;
    if (g_agree_fn(g_agree_ctx, w->hash) != 0) return -1;
    if (e) e->agreed_gen = g_agree_gen;
    return 0;
}

/* Whether entry e stands for a compiled program (running or demoted). */
static bool has_program(const cache_entry *e) { return e->prog || e->demoted; }

/* Compiled programs in the cache for the call site of w (lock held); with
 * bound ones too if `bound` (programs bound to generic kernels made no
 * compile: they do not count toward the recompile limit). */
static int site_count(const gj_jit_key *w, bool bound) {
    int n = 0;
    for (int i = 0; i < g_n_cache; i++)
        n += has_program(&g_cache[i]) && (bound || !g_cache[i].bound) &&
             g_cache[i].site[0] == w->site[0] && g_cache[i].site[1] == w->site[1];
    return n;
}

static int site_programs(const gj_jit_key *w) { return site_count(w, false); }

/* Whether the call site of w has a symbolic program in the cache (lock held). */
static bool site_symbolic(const gj_jit_key *w) {
    for (int i = 0; i < g_n_cache; i++)
        if (g_cache[i].prog && g_cache[i].prog->plan.generic && g_cache[i].site[0] == w->site[0] &&
            g_cache[i].site[1] == w->site[1])
            return true;
    return false;
}

/* GRADJIT_LOG=recompiles (lock held): a new key w of a call site that has
 * programs already, about to compile or refused by the recompile limit
 * (not a size bound to the site's symbolic kernels, a disk hit or a
 * program bound to other programs' kernels: none of those compiles);
 * prints which part of the graph differs from the nearest key of that
 * site (fewest differing lines, the latest on a tie) and state, what
 * happens to it. */
static void log_recompile(const gj_jit_key *w, const char *state) {
    const cache_entry *best = NULL;
    int best_d = 0;
    for (int i = 0; i < g_n_cache; i++) {
        const cache_entry *e = &g_cache[i];
        if (!has_program(e) || e->site[0] != w->site[0] || e->site[1] != w->site[1]) continue;
        int d = gj_jit_key_distance(e->key, e->key_len, w->text, w->len);
        if (!best || d <= best_d) {
            best = e;
            best_d = d;
        }
    }
    if (!best) return;
    char what[600];
    gj_jit_key_diff(best->key, best->key_len, w->text, w->len, what, sizeof what);
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

void gj_jit_program_release(gj_jit_program *p) {
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
        gj_jit_count_evictions(1, 0);
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

void gj_jit_set_mem_limit(int64_t bytes) {
    gj_jit_store_mem_limit(bytes);
    pthread_mutex_lock(&g_lock);
    evict_to_limit();
    pthread_mutex_unlock(&g_lock);
}

/* Entry of key (lock held), or NULL. Finding it counts as a use (LRU). */
static cache_entry *cache_find(const gj_jit_key *w) {
    for (int i = 0; i < g_n_cache; i++) {
        cache_entry *e = &g_cache[i];
        if (e->hash[0] == w->hash[0] && e->hash[1] == w->hash[1] && e->key_len == w->len &&
            memcmp(e->key, w->text, w->len) == 0) {
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
static int cache_insert(const gj_jit_key *w, gj_jit_program *prog, gj_ca_reason code,
                        const char *reason, bool bound) {
    if (g_n_cache == g_cap_cache) {
        int nc = g_cap_cache ? g_cap_cache * 2 : 16;
        cache_entry *c = gj_rt_realloc(g_cache, (size_t)nc * sizeof *c);
        if (!c) goto fail;
        g_cache = c;
        g_cap_cache = nc;
    }
    char *key = gj_rt_malloc(w->len + 1);
    if (!key) goto fail;
    memcpy(key, w->text, w->len + 1);
    cache_entry *e = &g_cache[g_n_cache++];
    memset(e, 0, sizeof *e);
    e->hash[0] = w->hash[0];
    e->hash[1] = w->hash[1];
    e->site[0] = w->site[0];
    e->site[1] = w->site[1];
    e->code = code;
    e->key = key;
    e->key_len = w->len;
    e->prog = prog;
    e->bound = bound;
    e->agreed_gen = g_agree_gen; /* the miss that inserts it agreed first */
    if (prog) {
        prog->refs = 1;
        prog->id = g_next_id++;
    }
    e->last_use = ++g_tick;
    e->bytes = (int64_t)(sizeof *e + w->len + 1 + gj_jit_program_bytes(prog));
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
static void save_to_disk(const gj_jit_key *w, const gj_jit_program *prog, const char *prefix) {
    if (!gj_jit_disk_dir()) return;
    gj_jit_disk_usage du = {0, -1};
    gj_jit_disk_save(w, prog, prefix, &du);
    gj_jit_count_evictions(0, du.evictions);
    if (du.bytes >= 0) g_disk_bytes = du.bytes;
    if (prog->plan.generic) {
        gj_jit_disk_save_symbolic(prog, prefix, &du);
        gj_jit_count_evictions(0, du.evictions);
        if (du.bytes >= 0) g_disk_bytes = du.bytes;
    }
}

/* Inserts prog, made with no compile from kernels other programs compiled
 * (lock held), and counts it. 0; or -1 on OOM: prog freed, why[] set and
 * the lock dropped (the caller falls back). */
static int insert_bound(const gj_jit_key *w, gj_jit_program *prog, double t0, unsigned fl,
                        char *why, size_t why_cap) {
    if (cache_insert(w, prog, GJ_CA_OTHER, NULL, true) != 0) { /* (prog freed) */
        snprintf(why, why_cap, "out of memory in the cache");
        return -1;
    }
    if (fl & GJ_JIT_LOG_CACHE)
        fprintf(stderr,
                "[gradjit cache] bound %016llx%016llx to %skernels of %d program%s in %.1f ms (no "
                "compile)\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1],
                prog->plan.generic ? "symbolic " : "", prog->n_shared,
                prog->n_shared == 1 ? "" : "s", gj_jit_now_ms() - t0);
    /* (no code of its own: the entry holds the kernels it borrowed; a
     * symbolic program's other sizes find its kernels' symbolic entry) */
    if (!prog->plan.generic) save_to_disk(w, prog, "");
    else if ((fl & GJ_JIT_LOG_CACHE) && gj_jit_disk_dir())
        fprintf(stderr, "[gradjit cache] %016llx%016llx not saved: its symbolic kernels' entry "
                        "serves this size\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1]);
    return 0;
}

bool gj_jit_demote(const gj_jit_key *w, gj_ca_reason code, const char *why) {
    pthread_mutex_lock(&g_lock);
    cache_entry *e = cache_find(w);
    bool first = e && e->prog && !e->demoted;
    gj_jit_program *drop = NULL;
    if (first) {
        e->demoted = true;
        e->code = code;
        snprintf(e->reason, sizeof e->reason, "%s", why);
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

void gj_jit_cache_levels(int64_t *mem_bytes, int64_t *mem_entries, int64_t *disk_bytes) {
    pthread_mutex_lock(&g_lock);
    *mem_bytes = g_mem_bytes;
    *mem_entries = g_n_cache;
    *disk_bytes = g_disk_bytes;
    pthread_mutex_unlock(&g_lock);
}

/* ------------------------------------------------ making a program */

/* One miss of gj_jit_get_program, carried from stage to stage (the cache
 * lock held throughout): the key and its source, the site's decisions, the
 * program being made, and the outcome for the caller. */
typedef struct making {
    const gj_jit_key *w;
    const gj_jit_source *src;
    gj_jit_got *got;
    unsigned fl;
    gj_ca_dynamic dm;
    bool symbolic;    /* the site's programs after its first are symbolic */
    bool at_limit;    /* the site reached the recompile limit: no compile */
    bool disk;        /* the disk cache is on */
    bool permanent;   /* (of the last failure) */
    bool report;      /* a fallback decided here: the caller reports it */
    int n_site;       /* the site's programs before this one */
    char lwhy[200];   /* the recompile limit's message */
    char prefix[48];  /* the symbol prefix of the program's code */
    double t0;
    gj_jit_program *prog;
} making;

enum { MK_ON = -2 }; /* the next stage decides */

/* The program is found: it goes to the caller (the cache holds it). */
static int mk_got(making *m, gj_jit_made how) {
    m->got->made = how;
    m->got->prog = m->prog;
    return GJ_JIT_GOT;
}

/* This key runs eagerly: marked eager-only for good when permanent (a
 * fallback the caller then reports), else only this time. */
static int mk_eager(making *m, gj_ca_reason code, const char *why, bool permanent) {
    if (why != m->got->why) snprintf(m->got->why, sizeof m->got->why, "%s", why);
    m->got->code = code;
    gj_jit_program_free(m->prog);
    m->prog = NULL;
    if (!permanent) return GJ_JIT_FALL;
    cache_insert(m->w, NULL, code, m->got->why, false);
    m->report = true;
    return GJ_JIT_FELL;
}

/* A new key that would compile at a site at the recompile limit: eager
 * for good (logged under GRADJIT_LOG=recompiles). */
static int mk_at_limit(making *m) {
    if (m->fl & GJ_JIT_LOG_RECOMPILES) {
        char state[96];
        snprintf(state, sizeof state, "recompile limit %d reached: runs eagerly",
                 gj_jit_recompile_limit());
        log_recompile(m->w, state);
    }
    return mk_eager(m, GJ_CA_RECOMPILE_LIMIT, m->lwhy, true);
}

/* The site's decisions: symbolic or not, the recompile limit. */
static int mk_site(making *m) {
    int limit = gj_jit_recompile_limit(), n_site = site_programs(m->w);
    m->n_site = n_site;
    m->at_limit = limit >= 0 && n_site >= limit;
    /* dynamic shapes: the site's second program and later ones (every
     * program under ALWAYS) are symbolic; a new size of such a site
     * first tries the kernels compiled for other sizes, which is no
     * compile: the recompile limit stops only a compile */
    m->dm = gj_jit_dynamic();
    m->symbolic = m->dm == GJ_CA_DYNAMIC_ALWAYS ||
                  (m->dm == GJ_CA_DYNAMIC_AUTO && site_count(m->w, true) > 0);
    if (!m->at_limit) return MK_ON;
    snprintf(m->lwhy, sizeof m->lwhy,
             "%d programs already compiled for this call site (limit %d: "
             "gj_compiled_autograd_set_recompile_limit)",
             n_site, limit);
    return m->symbolic ? MK_ON : mk_at_limit(m);
}

/* Capture and plan (the source's), and the program's symbol prefix: its
 * code names the key and the plan, so code loaded from disk that another
 * process compiled for the same key but another plan never passes. */
static int mk_plan(making *m) {
    char *why = m->got->why;
    size_t cap = sizeof m->got->why;
    bool permanent = false;
    gj_ca_reason code = GJ_CA_OTHER;
    gj_jit_graph *g = m->src->capture(m->src->ctx, why, cap, &code, &permanent);
    if (!g) return mk_eager(m, code, why, permanent);
    m->permanent = false;
    m->prog = gj_jit_program_plan(g, why, cap, &m->permanent);
    if (m->prog && m->src->finish && m->src->finish(m->src->ctx, m->prog) != 0)
        drop_oom(&m->prog, &m->permanent, why, cap);
    if (m->prog && gj_jit_program_prefix(m->w, m->prog, m->prefix) != 0)
        drop_oom(&m->prog, &m->permanent, why, cap);
    if (m->prog) return MK_ON;
    gj_jit_count_compile_ms(m->src->path, gj_jit_now_ms() - m->t0); /* (planning counts) */
    return mk_eager(m, build_reason(why), why, m->permanent);
}

/* A symbolic site's new size: bound to the kernels compiled for others. */
static int mk_bind_symbolic(making *m) {
    if (!m->symbolic) return MK_ON;
    char bwhy[200] = "";
    gj_jit_program *prog = m->prog;
    int b = gj_jit_plan_make_generic(&prog->plan);
    if (b == 0)
        b = gj_jit_kernels_bind(&prog->plan, false, &prog->shared, &prog->n_shared, bwhy,
                                sizeof bwhy);
    if (b == 1 && (m->fl & (GJ_JIT_LOG_RECOMPILES | GJ_JIT_LOG_CACHE)) && site_symbolic(m->w))
        fprintf(stderr, "[gradjit recompiles] key %016llx%016llx compiles symbolically: %s\n",
                (unsigned long long)m->w->hash[0], (unsigned long long)m->w->hash[1], bwhy);
    if (b < 0) {
        drop_oom(&m->prog, &m->permanent, m->got->why, sizeof m->got->why);
        return mk_eager(m, GJ_CA_OTHER, m->got->why, false);
    }
    if (b != 0) return MK_ON;
    m->prog = NULL; /* (insert_bound frees it on failure) */
    if (insert_bound(m->w, prog, m->t0, m->fl, m->got->why, sizeof m->got->why) != 0)
        return GJ_JIT_FALL;
    m->prog = prog;
    return mk_got(m, GJ_JIT_MADE_BOUND);
}

/* From the disk cache: this key's entry (its plan must be this one byte for
 * byte; hook and custom calls name their hook or op by canonical position,
 * resolved at each run), else a symbolic program of these kernels from an
 * earlier process (another size), also for the first program of an AUTO
 * site, which compiles specialised when there is none. */
static int mk_from_disk(making *m) {
    if (!m->disk) return MK_ON;
    gj_jit_program *prog = m->prog;
    const gj_jit_key *w = m->w;
    bool found = false, loaded;
    char dwhy[300] = "";
    loaded = gj_jit_disk_load(w, prog, prog->plan.generic ? NULL : m->prefix, &found, dwhy,
                              sizeof dwhy) == 0;
    if (found && !loaded && (m->fl & GJ_JIT_LOG_CACHE))
        fprintf(stderr, "[gradjit cache] disk entry %016llx%016llx not used: %s\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1], dwhy);
    if (!loaded && m->dm != GJ_CA_DYNAMIC_OFF) {
        bool was = prog->plan.generic;
        if (!was && gj_jit_plan_make_generic(&prog->plan) != 0) {
            drop_oom(&m->prog, &m->permanent, m->got->why, sizeof m->got->why);
            return mk_eager(m, GJ_CA_OTHER, m->got->why, false);
        }
        found = false;
        loaded = gj_jit_disk_load_symbolic(prog, &found, dwhy, sizeof dwhy) == 0;
        if (found && !loaded && (m->fl & GJ_JIT_LOG_CACHE))
            fprintf(stderr, "[gradjit cache] symbolic disk entry for %016llx%016llx not used: %s\n",
                    (unsigned long long)w->hash[0], (unsigned long long)w->hash[1], dwhy);
        if (!loaded && !was && gj_jit_plan_make_specific(&prog->plan) != 0) {
            drop_oom(&m->prog, &m->permanent, m->got->why, sizeof m->got->why);
            return mk_eager(m, GJ_CA_OTHER, m->got->why, false);
        }
    }
    if (!loaded) return MK_ON;
    m->prog = NULL;
    if (cache_insert(w, prog, GJ_CA_OTHER, NULL, false) != 0) { /* (prog freed) */
        snprintf(m->got->why, sizeof m->got->why, "out of memory in the cache");
        return GJ_JIT_FALL;
    }
    m->prog = prog;
    /* for other programs: its kernels and the ones it borrowed */
    (void)gj_jit_kernels_register(&prog->plan, prog->code, prog->shared, prog->n_shared);
    if (m->fl & GJ_JIT_LOG_CACHE)
        fprintf(stderr, "[gradjit cache] disk hit %016llx%016llx in %.1f ms\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1],
                gj_jit_now_ms() - m->t0);
    return mk_got(m, GJ_JIT_MADE_DISK_HIT);
}

/* Kernels other programs compiled (the same description: another call
 * site, a gj_grad of the same model) are not compiled again; when none is
 * left the program is bound like a new size. */
static int mk_bind_kernels(making *m) {
    gj_jit_program *prog = m->prog;
    char kwhy[200];
    int missing = gj_jit_kernels_bind(&prog->plan, true, &prog->shared, &prog->n_shared, kwhy,
                                      sizeof kwhy);
    if (missing < 0) {
        drop_oom(&m->prog, &m->permanent, m->got->why, sizeof m->got->why);
        return mk_eager(m, GJ_CA_OTHER, m->got->why, false);
    }
    if (missing != 0) return MK_ON;
    m->prog = NULL;
    if (insert_bound(m->w, prog, m->t0, m->fl, m->got->why, sizeof m->got->why) != 0)
        return GJ_JIT_FALL;
    m->prog = prog;
    return mk_got(m, GJ_JIT_MADE_BOUND);
}

/* A compile: its kernels then serve other programs (a symbolic one's,
 * other sizes; failing to register only costs a later compile), and the
 * program goes to disk. */
static int mk_compile(making *m) {
    char *why = m->got->why;
    const gj_jit_key *w = m->w;
    /* (a symbolic program's code, or code whose key prefix is still live
     * because it lent kernels after its program was evicted, gets a fresh
     * prefix: see cache_int.h) */
    if (m->prog->plan.generic || gj_jit_code_prefix_live(m->prefix))
        gj_jit_generic_prefix(m->prefix);
    if (m->fl & GJ_JIT_LOG_RECOMPILES) {
        char state[96];
        snprintf(state, sizeof state, "program %d of the site, compiles%s", m->n_site + 1,
                 m->prog->plan.generic ? " symbolic" : "");
        log_recompile(w, state);
    }
    m->permanent = false;
    int c = gj_jit_program_compile(m->prog, m->prefix, m->disk, why, sizeof m->got->why,
                                   &m->permanent);
    gj_jit_count_compile_ms(m->src->path, gj_jit_now_ms() - m->t0);
    if (c != 0) return mk_eager(m, build_reason(why), why, m->permanent);
    gj_jit_program *prog = m->prog;
    m->prog = NULL;
    if (cache_insert(w, prog, GJ_CA_OTHER, NULL, false) != 0) { /* (prog freed) */
        snprintf(why, sizeof m->got->why, "out of memory in the cache");
        return GJ_JIT_FALL;
    }
    m->prog = prog;
    (void)gj_jit_kernels_register(&prog->plan, prog->code, NULL, 0);
    if (m->fl & GJ_JIT_LOG_CACHE)
        fprintf(stderr, "[gradjit cache] compiled %016llx%016llx in %.1f ms%s\n",
                (unsigned long long)w->hash[0], (unsigned long long)w->hash[1],
                gj_jit_now_ms() - m->t0,
                prog->n_shared ? " (some kernels shared with other programs)" : "");
    save_to_disk(w, prog, m->prefix);
    return mk_got(m, GJ_JIT_MADE_COMPILED);
}

/* The miss path of gj_jit_get_program, the cache lock held on entry and on
 * return (its one exit): the site's decisions, capture and plan, then a
 * symbolic binding, the disk cache, other programs' kernels or a compile.
 * Returns GJ_JIT_GOT (got->prog, held by the cache), _FALL or _FELL
 * (got->code, got->why; *report: the caller reports the fallback once
 * the lock is dropped). */
static int make_program(const gj_jit_key *w, const gj_jit_source *src, gj_jit_got *got,
                        unsigned fl, bool *report) {
    making m;
    memset(&m, 0, sizeof m);
    m.w = w;
    m.src = src;
    m.got = got;
    m.fl = fl;
    m.disk = gj_jit_disk_dir() != NULL;
    m.t0 = gj_jit_now_ms();
    int rc = mk_site(&m);
    if (rc == MK_ON) rc = mk_plan(&m);
    if (rc == MK_ON) rc = mk_bind_symbolic(&m);
    if (rc == MK_ON && m.at_limit) /* not bound: a compile, which the limit forbids */
        rc = mk_at_limit(&m);
    if (rc == MK_ON) rc = mk_from_disk(&m);
    if (rc == MK_ON) rc = mk_bind_kernels(&m);
    if (rc == MK_ON) rc = mk_compile(&m);
    gj_jit_count_making_ms(gj_jit_now_ms() - m.t0);
    *report = m.report;
    return rc;
}

int gj_jit_get_program(const gj_jit_key *k, const gj_jit_source *src, gj_jit_got *got) {
    unsigned fl = gj_jit_log_flags();
    got->prog = NULL;
    got->fresh = false;
    got->code = GJ_CA_OTHER;
    got->why[0] = '\0';
    pthread_mutex_lock(&g_lock);
    cache_entry *e = cache_find(k);
    if (!src->own_program && agree(k, e) != 0) { /* the processes run different programs */
        pthread_mutex_unlock(&g_lock);
        return -1;
    }
    if (e && (!e->prog || e->demoted)) {
        snprintf(got->why, sizeof got->why, "%s", e->reason);
        got->code = e->code;
        pthread_mutex_unlock(&g_lock);
        if (fl & GJ_JIT_LOG_INSTRS)
            fprintf(stderr, "[gradjit instrs] cache hit eager-only %016llx%016llx\n",
                    (unsigned long long)k->hash[0], (unsigned long long)k->hash[1]);
        return GJ_JIT_FALL;
    }
    int rc = GJ_JIT_GOT;
    if (e) {
        got->prog = e->prog;
        got->made = GJ_JIT_MADE_MEM_HIT;
        if (fl & GJ_JIT_LOG_INSTRS)
            fprintf(stderr, "[gradjit instrs] cache hit %016llx%016llx\n",
                    (unsigned long long)k->hash[0], (unsigned long long)k->hash[1]);
    } else {
        bool report = false;
        rc = make_program(k, src, got, fl, &report);
        if (rc != GJ_JIT_GOT) {
            pthread_mutex_unlock(&g_lock);
            if (report) gj_jit_fallback(src->path, got->code, got->why, true);
            return rc;
        }
        got->fresh = true;
    }
    got->prog->refs++; /* the run's reference (held): eviction cannot free it under the run */
    pthread_mutex_unlock(&g_lock);
    return GJ_JIT_GOT;
}
