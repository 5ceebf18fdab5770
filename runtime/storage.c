/* SPDX-License-Identifier: MIT */
/*
 * storage.c - reference-counted blocks of tensor bytes.
 *
 * Invariants: a storage is created with refcount 1 and zero-filled data of
 * exactly `nbytes` usable bytes (data is never NULL, even for 0 bytes); the
 * last gj_rt_storage_release frees the data through gj_rt_free_data (unless
 * `external`, whose data the storage does not own) and then the header.
 * The version counter starts at 0 and only grows.
 * A remote storage (fetch set, by dist/'s ZeRO stage 3) is the exception:
 * its data is NULL while released and external (the owner's) while
 * present; gj_rt_exec fetches every remote input before it reads it.
 */
#include "runtime/rt.h"


/* New storage, refcount 1, zeroed (new reference). NULL with error on OOM. */
/* Memory fresh from the system is zero already: it is not written here
 * (gj_rt_alloc_data_zero). */
static gj_rt_storage *storage_make(size_t nbytes, bool zero) {
    gj_rt_storage *s = gj_rt_malloc(sizeof *s);
    if (!s)
        return NULL;
    s->data = zero ? gj_rt_alloc_data_zero(nbytes) : gj_rt_alloc_data(nbytes);
    if (!s->data)
        goto fail;
    atomic_init(&s->refcount, 1);
    atomic_init(&s->version, 0);
    s->nbytes = nbytes;
    s->external = false;
    s->fetch = NULL;
    s->owner = NULL;
    s->id = 0;
    return s;
fail:
    gj_rt_free(s);
    return NULL;
}

gj_rt_storage *gj_rt_storage_new(size_t nbytes) { return storage_make(nbytes, true); }

/* As gj_rt_storage_new, but the bytes are left undefined (for outputs that
 * a kernel overwrites entirely). */
gj_rt_storage *gj_rt_storage_new_uninit(size_t nbytes) { return storage_make(nbytes, false); }

void gj_rt_storage_retain(gj_rt_storage *s) {
    if (s)
        atomic_fetch_add(&s->refcount, 1);
}

void gj_rt_storage_release(gj_rt_storage *s) {
    if (!s || atomic_fetch_sub(&s->refcount, 1) != 1)
        return;
    if (!s->external)
        gj_rt_free_data(s->data, s->nbytes);
    gj_rt_free(s);
}

/* ---------------------------------------------------------- abstract */

static _Thread_local bool t_abstract;

void gj_rt_set_abstract(bool on) { t_abstract = on; }
bool gj_rt_abstract(void) { return t_abstract; }

static int abstract_fetch(void *owner, int id, uint64_t epoch) {
    (void)owner;
    (void)id;
    (void)epoch;
    gj_rt_set_error("the tensor is abstract (a value of a step function that the compiled "
                    "step's first run traced without computing, under a memory budget): it "
                    "has no values to read");
    return -1;
}

gj_rt_storage *gj_rt_storage_new_abstract(size_t nbytes) {
    return gj_rt_storage_new_remote(nbytes, abstract_fetch, NULL, 0);
}

bool gj_rt_storage_is_abstract(const gj_rt_storage *s) { return s && s->fetch == abstract_fetch; }

static atomic_ullong g_fetch_epoch;

uint64_t gj_rt_fetch_epoch(void) { return atomic_fetch_add(&g_fetch_epoch, 1) + 1; }

int gj_rt_storage_fetch(gj_rt_storage *s, uint64_t epoch) {
    if (!s || !s->fetch)
        return 0;
    return s->fetch(s->owner, s->id, epoch);
}

gj_rt_storage *gj_rt_storage_new_remote(size_t nbytes,
                                        int (*fetch)(void *owner, int id, uint64_t epoch),
                                        void *owner, int id) {
    gj_rt_storage *s = gj_rt_malloc(sizeof *s);
    if (!s)
        return NULL;
    atomic_init(&s->refcount, 1);
    atomic_init(&s->version, 0);
    s->data = NULL;
    s->nbytes = nbytes;
    s->external = true; /* (the owner's memory while present) */
    s->fetch = fetch;
    s->owner = owner;
    s->id = id;
    return s;
}
