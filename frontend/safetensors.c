/* SPDX-License-Identifier: MIT */
/*
 * safetensors.c - state dicts (named tensors + string metadata) and their
 * files in the safetensors format, and the RNG state as metadata (the nn
 * layers name their parameters in nn.c, the optimizers their state in
 * optim.c).
 *
 * File layout (as the reference implementation, huggingface/safetensors):
 *   u64 N (little-endian) | N bytes of JSON header | data
 *   header = {"__metadata__": {str: str}?,
 *             name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
 * padded with spaces so that 8 + N is a multiple of 8; offsets are relative
 * to the data region, and the tensors tile it exactly (sorted by offset:
 * no gap, no overlap, nothing after the last one). Data is little-endian,
 * row-major.
 *
 * Invariants:
 *   - A dict holds one reference (the caller's kind, never a scope's) to
 *     each of its tensors and its own copies of names, metadata keys and
 *     values; names are unique, non-empty, valid UTF-8, not "__metadata__".
 *   - The reader validates the whole header (syntax, fields, dtypes,
 *     shapes, sizes, offsets) before it allocates any tensor, so the memory
 *     it allocates is bounded by the file's own size; every read is
 *     bounds-checked against the source's size; a failure frees everything
 *     and leaves one error naming the source and the problem.
 *   - The writer writes a whole file under a temporary name and renames it
 *     over the target, so readers never see half a checkpoint.
 */
#include "fe.h"
#include "frontend/json.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation refuses headers above 100 MB. */
#define ST_MAX_HEADER 100000000ull
#define ST_META_KEY "__metadata__"

struct gj_state_dict {
    int n, cap;
    char **names;         /* [n] owned */
    gj_tensor **tensors;  /* [n] one reference each */
    int nm, capm;
    char **mkeys, **mvals; /* [nm] owned */
};

/* ----------------------------------------------------------- helpers */

static char *st_strdup(const char *s) {
    size_t n = strlen(s);
    char *d = gj_rt_malloc(n + 1);
    if (d)
        memcpy(d, s, n + 1);
    return d;
}

static const char *st_dtype_tag(gj_dtype dt) {
    switch (dt) {
    case GJ_F32: return "F32";
    case GJ_F64: return "F64";
    case GJ_BF16: return "BF16";
    case GJ_I64: return "I64";
    }
    return "?";
}

/* The reference writer orders tensors by dtype, descending, in its enum
 * order (... BF16 < F32 < F64 < I64), then by name: large elements first,
 * so every tensor's data is aligned to its element size. */
static int st_dtype_rank(gj_dtype dt) {
    switch (dt) {
    case GJ_BF16: return 0;
    case GJ_F32: return 1;
    case GJ_F64: return 2;
    case GJ_I64: return 3;
    }
    return -1;
}

/* Little-endian byte order of the data region, whatever the host's. */
static void st_to_le(void *p, size_t elsize, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++, b += elsize)
        for (size_t k = 0; k < elsize / 2; k++) {
            unsigned char t = b[k];
            b[k] = b[elsize - 1 - k];
            b[elsize - 1 - k] = t;
        }
#else
    (void)p, (void)elsize, (void)n;
#endif
}

static bool st_check_text(const char *op, const char *what, const char *s, bool name) {
    if (!s) {
        gj_rt_set_error("%s: %s is NULL", op, what);
        return false;
    }
    size_t n = strlen(s);
    if (name && n == 0) {
        gj_rt_set_error("%s: %s is empty", op, what);
        return false;
    }
    if (!gj_fe_json_utf8_valid(s, n)) {
        gj_rt_set_error("%s: %s \"%.200s\" is not valid UTF-8", op, what, s);
        return false;
    }
    if (name && strcmp(s, ST_META_KEY) == 0) {
        gj_rt_set_error("%s: \"%s\" is reserved for the file's metadata", op, ST_META_KEY);
        return false;
    }
    return true;
}

static int st_find(const gj_state_dict *sd, const char *name) {
    for (int i = 0; i < sd->n; i++)
        if (strcmp(sd->names[i], name) == 0)
            return i;
    return -1;
}

/* Appends (name, t) taking ownership of t's reference (stolen, also on
 * failure). Name checked by the caller. 0 or -1. */
static int st_append_owned(gj_state_dict *sd, const char *name, gj_tensor *t) {
    if (sd->n == sd->cap) {
        int nc = sd->cap ? sd->cap * 2 : 16;
        char **nn = gj_rt_realloc(sd->names, (size_t)nc * sizeof *nn);
        if (nn)
            sd->names = nn;
        gj_tensor **nt = nn ? gj_rt_realloc(sd->tensors, (size_t)nc * sizeof *nt) : NULL;
        if (!nt) {
            gj_rt_tensor_release(t);
            return -1;
        }
        sd->tensors = nt;
        sd->cap = nc;
    }
    char *copy = st_strdup(name);
    if (!copy) {
        gj_rt_tensor_release(t);
        return -1;
    }
    sd->names[sd->n] = copy;
    sd->tensors[sd->n] = t;
    sd->n++;
    return 0;
}

/* ------------------------------------------------------ the dict API */

gj_state_dict *gj_state_dict_new(void) { return gj_rt_calloc(1, sizeof(gj_state_dict)); }

void gj_state_dict_free(gj_state_dict *sd) {
    if (!sd)
        return;
    for (int i = 0; i < sd->n; i++) {
        gj_rt_free(sd->names[i]);
        gj_rt_tensor_release(sd->tensors[i]);
    }
    for (int i = 0; i < sd->nm; i++) {
        gj_rt_free(sd->mkeys[i]);
        gj_rt_free(sd->mvals[i]);
    }
    gj_rt_free(sd->names);
    gj_rt_free(sd->tensors);
    gj_rt_free(sd->mkeys);
    gj_rt_free(sd->mvals);
    gj_rt_free(sd);
}

int gj_state_dict_add(gj_state_dict *sd, const char *name, gj_tensor *t) {
    const char *op = "gj_state_dict_add";
    if (!sd) {
        gj_rt_set_error("%s: state dict is NULL", op);
        return -1;
    }
    if (!st_check_text(op, "name", name, true) || !gj_rt_check_tensor(t, op, name))
        return -1;
    if (st_find(sd, name) >= 0) {
        gj_rt_set_error("%s: the name \"%.200s\" is already in the state dict", op, name);
        return -1;
    }
    gj_rt_tensor_retain(t);
    return st_append_owned(sd, name, t);
}

int gj_state_dict_size(const gj_state_dict *sd) { return sd ? sd->n : 0; }

const char *gj_state_dict_name(const gj_state_dict *sd, int i) {
    return sd && i >= 0 && i < sd->n ? sd->names[i] : NULL;
}

/* Both return NULL without an error for an absent entry: no failure, so
 * that NULL, passed on, cites no earlier one (gj_rt_tensor_result). */
gj_tensor *gj_state_dict_tensor(const gj_state_dict *sd, int i) {
    gj_rt_tensor_result();
    return sd && i >= 0 && i < sd->n ? sd->tensors[i] : NULL;
}

gj_tensor *gj_state_dict_get(const gj_state_dict *sd, const char *name) {
    gj_rt_tensor_result();
    if (!sd || !name)
        return NULL;
    int i = st_find(sd, name);
    return i >= 0 ? sd->tensors[i] : NULL;
}

gj_tensor *const *gj_state_dict_tensors(const gj_state_dict *sd) {
    return sd ? sd->tensors : NULL;
}

/* Appends (key, value) copies; the caller knows key is new (the reader:
 * JSON keys are unique, so a forged header with many keys stays O(n)). */
static int st_meta_append(gj_state_dict *sd, const char *key, const char *value) {
    char *v = st_strdup(value);
    if (!v)
        return -1;
    if (sd->nm == sd->capm) {
        int nc = sd->capm ? sd->capm * 2 : 8;
        char **nk = gj_rt_realloc(sd->mkeys, (size_t)nc * sizeof *nk);
        if (nk)
            sd->mkeys = nk;
        char **nv = nk ? gj_rt_realloc(sd->mvals, (size_t)nc * sizeof *nv) : NULL;
        if (!nv) {
            gj_rt_free(v);
            return -1;
        }
        sd->mvals = nv;
        sd->capm = nc;
    }
    char *k = st_strdup(key);
    if (!k) {
        gj_rt_free(v);
        return -1;
    }
    sd->mkeys[sd->nm] = k;
    sd->mvals[sd->nm] = v;
    sd->nm++;
    return 0;
}

int gj_state_dict_set_metadata(gj_state_dict *sd, const char *key, const char *value) {
    const char *op = "gj_state_dict_set_metadata";
    if (!sd) {
        gj_rt_set_error("%s: state dict is NULL", op);
        return -1;
    }
    if (!st_check_text(op, "key", key, false) || !st_check_text(op, "value", value, false))
        return -1;
    for (int i = 0; i < sd->nm; i++) {
        if (strcmp(sd->mkeys[i], key) == 0) {
            char *v = st_strdup(value);
            if (!v)
                return -1;
            gj_rt_free(sd->mvals[i]);
            sd->mvals[i] = v;
            return 0;
        }
    }
    return st_meta_append(sd, key, value);
}

const char *gj_state_dict_get_metadata(const gj_state_dict *sd, const char *key) {
    if (!sd || !key)
        return NULL;
    for (int i = 0; i < sd->nm; i++)
        if (strcmp(sd->mkeys[i], key) == 0)
            return sd->mvals[i];
    return NULL;
}

int gj_state_dict_metadata_size(const gj_state_dict *sd) { return sd ? sd->nm : 0; }

int gj_state_dict_metadata_at(const gj_state_dict *sd, int i, const char **key,
                              const char **value) {
    if (!sd || i < 0 || i >= sd->nm) {
        gj_rt_set_error("gj_state_dict_metadata_at: index %d out of range", i);
        return -1;
    }
    if (key)
        *key = sd->mkeys[i];
    if (value)
        *value = sd->mvals[i];
    return 0;
}

/* ----------------------------------------------------------- writing */

typedef int (*st_write_fn)(void *ctx, const void *p, size_t n);

typedef struct st_order {
    int idx, rank;
    const char *name;
} st_order;

static int st_cmp_order(const void *a, const void *b) {
    const st_order *x = a, *y = b;
    if (x->rank != y->rank)
        return y->rank - x->rank;
    return strcmp(x->name, y->name);
}

/* The header (padded) and the file order of sd's tensors. *order is
 * gj_rt_malloc'd [n]. 0 or -1. */
static int st_build_header(const char *op, const gj_state_dict *sd, char **hdr, size_t *hlen,
                           int **order, uint64_t *data_len) {
    char *buf = NULL;
    size_t pos = 0, cap = 0;
    st_order *ord = gj_rt_malloc((size_t)(sd->n ? sd->n : 1) * sizeof *ord);
    int *out = gj_rt_malloc((size_t)(sd->n ? sd->n : 1) * sizeof *out);
    if (!ord || !out)
        goto fail;
    for (int i = 0; i < sd->n; i++) {
        gj_tensor *t = sd->tensors[i];
        if (!gj_rt_check_tensor(t, op, sd->names[i]))
            goto fail;
        ord[i] = (st_order){i, st_dtype_rank(t->dtype), sd->names[i]};
    }
    qsort(ord, (size_t)sd->n, sizeof *ord, st_cmp_order);
#define PUT(s)                                                                                     \
    do {                                                                                           \
        const char *s_ = (s);                                                                      \
        size_t n_ = strlen(s_);                                                                    \
        if (pos + n_ + 1 > cap) {                                                                  \
            size_t nc_ = cap ? cap : 256;                                                          \
            while (nc_ < pos + n_ + 1)                                                             \
                nc_ *= 2;                                                                          \
            char *b_ = gj_rt_realloc(buf, nc_);                                                    \
            if (!b_)                                                                               \
                goto fail;                                                                         \
            buf = b_;                                                                              \
            cap = nc_;                                                                             \
        }                                                                                          \
        memcpy(buf + pos, s_, n_ + 1);                                                             \
        pos += n_;                                                                                 \
    } while (0)
    PUT("{");
    bool first = true;
    if (sd->nm > 0) {
        PUT("\"" ST_META_KEY "\":{");
        for (int i = 0; i < sd->nm; i++) {
            if (i)
                PUT(",");
            if (gj_fe_json_append_string(&buf, &pos, &cap, sd->mkeys[i]) != 0)
                goto fail;
            PUT(":");
            if (gj_fe_json_append_string(&buf, &pos, &cap, sd->mvals[i]) != 0)
                goto fail;
        }
        PUT("}");
        first = false;
    }
    uint64_t off = 0;
    for (int k = 0; k < sd->n; k++) {
        const gj_tensor *t = sd->tensors[ord[k].idx];
        uint64_t nbytes = (uint64_t)t->numel * gj_rt_dtype_size(t->dtype);
        char num[64];
        if (!first)
            PUT(",");
        first = false;
        if (gj_fe_json_append_string(&buf, &pos, &cap, ord[k].name) != 0)
            goto fail;
        PUT(":{\"dtype\":\"");
        PUT(st_dtype_tag(t->dtype));
        PUT("\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, d ? ",%" PRId64 : "%" PRId64, t->shape[d]);
            PUT(num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off,
                 off + nbytes);
        PUT(num);
        off += nbytes;
        out[k] = ord[k].idx;
    }
    PUT("}");
    while ((8 + pos) % 8 != 0)
        PUT(" ");
#undef PUT
    gj_rt_free(ord);
    *hdr = buf;
    *hlen = pos;
    *order = out;
    *data_len = off;
    return 0;
fail:
    gj_rt_free(ord);
    gj_rt_free(out);
    gj_rt_free(buf);
    return -1;
}

/* Streams the whole file through write(ctx, ...). 0 or -1 (error set). */
static int st_write(const char *op, const gj_state_dict *sd, st_write_fn write, void *ctx,
                    uint64_t *total) {
    char *hdr = NULL;
    size_t hlen = 0;
    int *order = NULL;
    uint64_t data_len = 0;
    int rc = -1;
    if (st_build_header(op, sd, &hdr, &hlen, &order, &data_len) != 0)
        goto done;
    if (total) {
        *total = 8 + hlen + data_len;
        rc = 0;
        goto done;
    }
    unsigned char len8[8];
    for (int k = 0; k < 8; k++)
        len8[k] = (unsigned char)((uint64_t)hlen >> (8 * k));
    if (write(ctx, len8, 8) != 0 || write(ctx, hdr, hlen) != 0)
        goto done;
    for (int k = 0; k < sd->n; k++) {
        gj_tensor *t = sd->tensors[order[k]];
        if (t->numel == 0)
            continue;
        gj_tensor *c = gj_rt_present(t) == 0 ? gj_rt_contiguous(t) : NULL;
        if (!c)
            goto done;
        size_t es = gj_rt_dtype_size(t->dtype), nb = (size_t)t->numel * es;
        int wrc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        void *tmp = gj_rt_malloc(nb);
        wrc = -1;
        if (tmp) {
            memcpy(tmp, gj_rt_data_ptr(c), nb);
            st_to_le(tmp, es, (size_t)t->numel);
            wrc = write(ctx, tmp, nb);
            gj_rt_free(tmp);
        }
#else
        wrc = write(ctx, gj_rt_data_ptr(c), nb);
#endif
        gj_rt_tensor_release(c);
        if (wrc != 0)
            goto done;
    }
    rc = 0;
done:
    gj_rt_free(hdr);
    gj_rt_free(order);
    return rc;
}

typedef struct st_membuf {
    unsigned char *p;
    size_t pos, cap;
} st_membuf;

static int st_mem_write(void *ctx, const void *p, size_t n) {
    st_membuf *m = ctx;
    if (n > m->cap - m->pos) {
        gj_rt_set_error("gj_save_safetensors_buffer: the data grew while being written");
        return -1;
    }
    memcpy(m->p + m->pos, p, n);
    m->pos += n;
    return 0;
}

typedef struct st_filesink {
    gj_rt_sink sink;
    const char *path;
} st_filesink;

static int st_fd_write(void *ctx, const void *p, size_t n) {
    st_filesink *f = ctx;
    char why[200];
    if (gj_rt_sink_write(&f->sink, p, n, why, sizeof why) != 0) {
        gj_rt_set_error("gj_save_safetensors: writing %s: %s", f->path, why);
        return -1;
    }
    return 0;
}

int gj_save_safetensors_buffer(const gj_state_dict *sd, void **out, size_t *len) {
    const char *op = "gj_save_safetensors_buffer";
    if (!sd || !out || !len) {
        gj_rt_set_error("%s: NULL argument", op);
        return -1;
    }
    *out = NULL;
    *len = 0;
    uint64_t total = 0;
    if (st_write(op, sd, NULL, NULL, &total) != 0)
        return -1;
    if (total > SIZE_MAX) {
        gj_rt_set_error("%s: %" PRIu64 " bytes do not fit in memory", op, total);
        return -1;
    }
    st_membuf m = {malloc((size_t)total), 0, (size_t)total};
    if (!m.p) {
        gj_rt_set_error("%s: out of memory for %" PRIu64 " bytes", op, total);
        return -1;
    }
    if (st_write(op, sd, st_mem_write, &m, NULL) != 0 || m.pos != m.cap) {
        if (m.pos != m.cap && !gj_last_error()[0])
            gj_rt_set_error("%s: size changed while writing", op);
        free(m.p);
        return -1;
    }
    *out = m.p;
    *len = m.pos;
    return 0;
}

int gj_save_safetensors(const gj_state_dict *sd, const char *path) {
    const char *op = "gj_save_safetensors";
    if (!sd || !path || !path[0]) {
        gj_rt_set_error("%s: NULL state dict or empty path", op);
        return -1;
    }
    st_filesink f = {.path = path};
    char why[300];
    if (gj_rt_sink_open(&f.sink, -1, path, NULL, 0644, why, sizeof why) != 0) {
        gj_rt_set_error("%s: cannot write %s: %s", op, path, why); /* the user's path, not ours */
        return -1;
    }
    int rc = st_write(op, sd, st_fd_write, &f, NULL);
    if (gj_rt_sink_close(&f.sink, rc == 0, true, why, sizeof why) != 0 && rc == 0) {
        gj_rt_set_error("%s: cannot write %s: %s", op, path, why);
        rc = -1;
    }
    return rc;
}

/* ----------------------------------------------------------- reading */

/* Where bytes come from: memory or a file descriptor, of a known size. */
typedef struct st_src {
    const unsigned char *mem;
    int fd;
    uint64_t size;
    const char *op, *what;
} st_src;

static int st_read_at(const st_src *s, uint64_t off, void *dst, uint64_t n) {
    if (off > s->size || n > s->size - off) {
        gj_rt_set_error("%s: %s: read of %" PRIu64 " bytes at %" PRIu64 " beyond its %" PRIu64
                        " bytes",
                        s->op, s->what, n, off, s->size);
        return -1;
    }
    if (s->mem) {
        memcpy(dst, s->mem + off, (size_t)n);
        return 0;
    }
    char *b = dst;
    while (n > 0) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
        ssize_t r = pread(s->fd, b, chunk, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            gj_rt_set_error("%s: %s: %s at byte %" PRIu64, s->op, s->what,
                            r < 0 ? strerror(errno) : "the file became shorter while reading",
                            off);
            return -1;
        }
        b += r;
        off += (uint64_t)r;
        n -= (uint64_t)r;
    }
    return 0;
}

typedef struct st_ent {
    const char *name;
    gj_dtype dt;
    int ndim;
    int64_t shape[GJ_MAX_DIMS];
    uint64_t begin, end;
} st_ent;

static int st_cmp_ent(const void *a, const void *b) {
    const st_ent *x = *(st_ent *const *)a, *y = *(st_ent *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

/* One tensor entry of the header into e. 0, or -1 with an error. */
static int st_parse_entry(const st_src *s, const char *name, const gj_fe_json *v, st_ent *e,
                          uint64_t data_len) {
    const char *op = s->op, *what = s->what;
    char sh[256];
    e->name = name;
    if (name[0] == '\0') {
        gj_rt_set_error("%s: %s: a tensor has an empty name", op, what);
        return -1;
    }
    if (v->kind != GJ_FE_JSON_OBJECT) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": expected an object, found %s", op, what, name,
                        gj_fe_json_kind_name(v->kind));
        return -1;
    }
    for (size_t i = 0; i < v->len; i++) {
        const char *k = v->keys[i];
        if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets")) {
            gj_rt_set_error("%s: %s: tensor \"%.200s\": unknown field \"%.100s\"", op, what, name,
                            k);
            return -1;
        }
    }
    const gj_fe_json *dt = gj_fe_json_get(v, "dtype"), *shape = gj_fe_json_get(v, "shape"),
                     *offs = gj_fe_json_get(v, "data_offsets");
    if (!dt || !shape || !offs) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": missing field \"%s\"", op, what, name,
                        !dt ? "dtype" : !shape ? "shape" : "data_offsets");
        return -1;
    }
    if (dt->kind != GJ_FE_JSON_STRING) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": dtype must be a string, found %s", op, what,
                        name, gj_fe_json_kind_name(dt->kind));
        return -1;
    }
    static const char *const unsupported[] = {
        "BOOL", "U8", "I8", "I16", "U16", "F16", "I32", "U32", "U64", "F8_E5M2", "F8_E4M3",
        "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"};
    if (!strcmp(dt->str, "F32")) {
        e->dt = GJ_F32;
    } else if (!strcmp(dt->str, "F64")) {
        e->dt = GJ_F64;
    } else if (!strcmp(dt->str, "BF16")) {
        e->dt = GJ_BF16;
    } else if (!strcmp(dt->str, "I64")) {
        e->dt = GJ_I64;
    } else {
        bool known = false;
        for (size_t k = 0; k < sizeof unsupported / sizeof *unsupported; k++)
            known = known || !strcmp(dt->str, unsupported[k]);
        gj_rt_set_error("%s: %s: tensor \"%.200s\": %s dtype \"%.40s\" (gradjit reads F32, "
                        "F64, BF16 and I64)",
                        op, what, name, known ? "unsupported" : "unknown", dt->str);
        return -1;
    }
    if (shape->kind != GJ_FE_JSON_ARRAY) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": shape must be an array, found %s", op, what,
                        name, gj_fe_json_kind_name(shape->kind));
        return -1;
    }
    if (shape->len > GJ_MAX_DIMS) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": %zu dimensions (gradjit supports at most %d)",
                        op, what, name, shape->len, GJ_MAX_DIMS);
        return -1;
    }
    e->ndim = (int)shape->len;
    int64_t numel = 1;
    bool overflow = false;
    for (int d = 0; d < e->ndim; d++) {
        const gj_fe_json *x = &shape->items[d];
        if (x->kind != GJ_FE_JSON_NUMBER || !x->is_int || x->integer < 0) {
            gj_rt_set_error("%s: %s: tensor \"%.200s\": dimension %d of shape is not a "
                            "non-negative integer within int64",
                            op, what, name, d);
            return -1;
        }
        e->shape[d] = x->integer;
        if (!overflow && __builtin_mul_overflow(numel, x->integer, &numel))
            overflow = true;
    }
    int64_t nbytes = 0;
    if (!overflow &&
        __builtin_mul_overflow(numel, (int64_t)gj_rt_dtype_size(e->dt), &nbytes))
        overflow = true;
    if (overflow) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": shape %s of %s overflows 64-bit sizes", op,
                        what, name, gj_rt_fmt_shape(sh, sizeof sh, e->ndim, e->shape), dt->str);
        return -1;
    }
    if (offs->kind != GJ_FE_JSON_ARRAY || offs->len != 2) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": data_offsets must be an array of two "
                        "integers",
                        op, what, name);
        return -1;
    }
    for (int k = 0; k < 2; k++) {
        const gj_fe_json *x = &offs->items[k];
        if (x->kind != GJ_FE_JSON_NUMBER || !x->is_int || x->integer < 0) {
            gj_rt_set_error("%s: %s: tensor \"%.200s\": data_offsets[%d] is not a non-negative "
                            "integer within int64",
                            op, what, name, k);
            return -1;
        }
    }
    e->begin = (uint64_t)offs->items[0].integer;
    e->end = (uint64_t)offs->items[1].integer;
    if (e->end < e->begin) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": data_offsets [%" PRIu64 ", %" PRIu64
                        "] end before they begin",
                        op, what, name, e->begin, e->end);
        return -1;
    }
    if (e->end > data_len) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": data_offsets [%" PRIu64 ", %" PRIu64
                        "] go beyond the %" PRIu64 " bytes of data",
                        op, what, name, e->begin, e->end, data_len);
        return -1;
    }
    if (e->end - e->begin != (uint64_t)nbytes) {
        gj_rt_set_error("%s: %s: tensor \"%.200s\": data_offsets [%" PRIu64 ", %" PRIu64
                        "] hold %" PRIu64 " bytes but %s %s needs %" PRId64,
                        op, what, name, e->begin, e->end, e->end - e->begin, dt->str,
                        gj_rt_fmt_shape(sh, sizeof sh, e->ndim, e->shape), nbytes);
        return -1;
    }
    return 0;
}

static gj_state_dict *st_read(const st_src *s) {
    const char *op = s->op, *what = s->what;
    char *hdr = NULL;
    gj_fe_json *root = NULL;
    st_ent *ents = NULL;
    st_ent **sorted = NULL;
    gj_state_dict *sd = NULL;
    unsigned char len8[8];
    if (s->size < 8) {
        gj_rt_set_error("%s: %s: %" PRIu64 " bytes, too short for the 8-byte header length", op,
                        what, s->size);
        return NULL;
    }
    if (st_read_at(s, 0, len8, 8) != 0)
        return NULL;
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--)
        n = n << 8 | len8[k];
    if (n > s->size - 8) {
        gj_rt_set_error("%s: %s: header length %" PRIu64 " goes beyond the file (%" PRIu64
                        " bytes after the length): truncated or not a safetensors file",
                        op, what, n, s->size - 8);
        return NULL;
    }
    if (n > ST_MAX_HEADER) {
        gj_rt_set_error("%s: %s: header of %" PRIu64 " bytes is larger than the limit of %llu",
                        op, what, n, ST_MAX_HEADER);
        return NULL;
    }
    if (n < 2) {
        gj_rt_set_error("%s: %s: header of %" PRIu64 " bytes cannot hold a JSON object", op, what,
                        n);
        return NULL;
    }
    uint64_t data_len = s->size - 8 - n;
    if (!(hdr = gj_rt_malloc((size_t)n)) || st_read_at(s, 8, hdr, n) != 0)
        goto fail;
    if (hdr[0] != '{') {
        gj_rt_set_error("%s: %s: the header does not start with '{' (not a safetensors file?)",
                        op, what);
        goto fail;
    }
    char jerr[256];
    if (!(root = gj_fe_json_parse(hdr, (size_t)n, jerr, sizeof jerr))) {
        gj_rt_set_error("%s: %s: malformed JSON header: %s", op, what, jerr);
        goto fail;
    }
    if (root->kind != GJ_FE_JSON_OBJECT) {
        gj_rt_set_error("%s: %s: the header is not a JSON object", op, what);
        goto fail;
    }
    if (!(sd = gj_state_dict_new()) || !(ents = gj_rt_calloc(root->len + 1, sizeof *ents)) ||
        !(sorted = gj_rt_calloc(root->len + 1, sizeof *sorted)))
        goto fail;
    size_t ne = 0;
    for (size_t i = 0; i < root->len; i++) {
        const char *key = root->keys[i];
        const gj_fe_json *v = &root->items[i];
        if (strcmp(key, ST_META_KEY) == 0) {
            if (v->kind != GJ_FE_JSON_OBJECT) {
                gj_rt_set_error("%s: %s: %s must be an object, found %s", op, what, ST_META_KEY,
                                gj_fe_json_kind_name(v->kind));
                goto fail;
            }
            for (size_t k = 0; k < v->len; k++) {
                if (v->items[k].kind != GJ_FE_JSON_STRING) {
                    gj_rt_set_error("%s: %s: %s maps strings to strings, but \"%.200s\" is a %s",
                                    op, what, ST_META_KEY, v->keys[k],
                                    gj_fe_json_kind_name(v->items[k].kind));
                    goto fail;
                }
                if (st_meta_append(sd, v->keys[k], v->items[k].str) != 0)
                    goto fail;
            }
            continue;
        }
        if (st_parse_entry(s, key, v, &ents[ne], data_len) != 0)
            goto fail;
        sorted[ne] = &ents[ne];
        ne++;
    }
    /* The tensors must tile the data region exactly. */
    qsort(sorted, ne, sizeof *sorted, st_cmp_ent);
    uint64_t expect = 0;
    for (size_t k = 0; k < ne; k++) {
        const st_ent *e = sorted[k];
        if (e->begin < expect) {
            gj_rt_set_error("%s: %s: tensor \"%.200s\" [%" PRIu64 ", %" PRIu64
                            ") overlaps tensor \"%.200s\" (which ends at %" PRIu64 ")",
                            op, what, e->name, e->begin, e->end, sorted[k - 1]->name, expect);
            goto fail;
        }
        if (e->begin > expect) {
            gj_rt_set_error("%s: %s: %" PRIu64 " unused bytes at data offset %" PRIu64
                            " before tensor \"%.200s\"",
                            op, what, e->begin - expect, expect, e->name);
            goto fail;
        }
        expect = e->end;
    }
    if (expect != data_len) {
        gj_rt_set_error("%s: %s: the tensors cover %" PRIu64 " of the %" PRIu64
                        " data bytes (trailing bytes, or a damaged header)",
                        op, what, expect, data_len);
        goto fail;
    }
    /* Everything checked: allocate and read, in the header's order. */
    for (size_t k = 0; k < ne; k++) {
        const st_ent *e = &ents[k];
        gj_tensor *t = gj_rt_tensor_empty(e->dt, e->ndim, e->shape);
        if (!t)
            goto fail;
        if (t->numel > 0 &&
            st_read_at(s, 8 + n + e->begin, gj_rt_data_ptr(t), e->end - e->begin) != 0) {
            gj_rt_tensor_release(t);
            goto fail;
        }
        st_to_le(gj_rt_data_ptr(t), gj_rt_dtype_size(e->dt), (size_t)t->numel);
        if (st_append_owned(sd, e->name, t) != 0)
            goto fail;
    }
    gj_rt_free(sorted);
    gj_rt_free(ents);
    gj_fe_json_free(root);
    gj_rt_free(hdr);
    return sd;
fail:
    gj_state_dict_free(sd);
    gj_rt_free(sorted);
    gj_rt_free(ents);
    gj_fe_json_free(root);
    gj_rt_free(hdr);
    return NULL;
}

gj_state_dict *gj_load_safetensors_buffer(const void *data, size_t len) {
    if (!data && len > 0) {
        gj_rt_set_error("gj_load_safetensors_buffer: data is NULL");
        return NULL;
    }
    static const unsigned char empty[1];
    st_src s = {.mem = data ? data : empty,
                .fd = -1,
                .size = len,
                .op = "gj_load_safetensors_buffer",
                .what = "buffer"};
    return st_read(&s);
}

gj_state_dict *gj_load_safetensors(const char *path) {
    const char *op = "gj_load_safetensors";
    if (!path) {
        gj_rt_set_error("%s: path is NULL", op);
        return NULL;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        gj_rt_set_error("%s: cannot open %s: %s", op, path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        gj_rt_set_error("%s: %s is not a regular file", op, path);
        close(fd);
        return NULL;
    }
    st_src s = {.mem = NULL, .fd = fd, .size = (uint64_t)st.st_size, .op = op, .what = path};
    gj_state_dict *sd = st_read(&s);
    close(fd);
    return sd;
}

/* ------------------------------------------------------ copying into */

void gj_fe_msg_add(gj_fe_msg *m, const char *fmt, ...) {
    char line[600];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    m->count++;
    if (n < 0)
        return;
    size_t need = strlen(line) + 2;
    if (m->pos + need + 1 > sizeof m->buf) {
        m->dropped++;
        return;
    }
    m->pos += (size_t)snprintf(m->buf + m->pos, sizeof m->buf - m->pos, "%s%s",
                               m->pos ? "; " : "", line);
}

int gj_fe_msg_fail(const gj_fe_msg *m, const char *op, const char *one, const char *many) {
    char more[64] = "";
    if (m->dropped)
        snprintf(more, sizeof more, "; and %d more", m->dropped);
    gj_rt_set_error("%s: %d %s, nothing changed: %s%s", op, m->count,
                    m->count > 1 ? many : one, m->buf, more);
    return -1;
}

int gj_state_dict_copy_into(gj_state_dict *dst, const gj_state_dict *src, bool strict) {
    const char *op = "gj_state_dict_copy_into";
    if (!dst || !src) {
        gj_rt_set_error("%s: NULL state dict", op);
        return -1;
    }
    gj_fe_msg *m = gj_rt_calloc(1, sizeof *m);
    if (!m)
        return -1;
    char s1[256], s2[256];
    for (int i = 0; i < dst->n; i++) {
        const gj_tensor *d = dst->tensors[i];
        int j = st_find(src, dst->names[i]);
        if (j < 0) {
            gj_fe_msg_add(m, "missing \"%.200s\" (%s %s)", dst->names[i], st_dtype_tag(d->dtype),
                       gj_rt_fmt_shape(s1, sizeof s1, d->ndim, d->shape));
            continue;
        }
        const gj_tensor *s = src->tensors[j];
        bool shape_ok = s->ndim == d->ndim;
        for (int k = 0; shape_ok && k < d->ndim; k++)
            shape_ok = s->shape[k] == d->shape[k];
        if (!shape_ok || s->dtype != d->dtype)
            gj_fe_msg_add(m, "\"%.200s\": %s %s in the source, %s %s in the destination",
                       dst->names[i], st_dtype_tag(s->dtype),
                       gj_rt_fmt_shape(s1, sizeof s1, s->ndim, s->shape),
                       st_dtype_tag(d->dtype), gj_rt_fmt_shape(s2, sizeof s2, d->ndim, d->shape));
    }
    if (strict)
        for (int j = 0; j < src->n; j++)
            if (st_find(dst, src->names[j]) < 0)
                gj_fe_msg_add(m, "unexpected \"%.200s\"", src->names[j]);
    if (m->count > 0) {
        gj_fe_msg_fail(m, op, "mismatch", "mismatches");
        gj_rt_free(m);
        return -1;
    }
    gj_rt_free(m);
    for (int i = 0; i < dst->n; i++) {
        gj_tensor *d = dst->tensors[i], *s = src->tensors[st_find(src, dst->names[i])];
        if (d == s)
            continue;
        if (gj_rt_is_contiguous(d) && gj_rt_is_contiguous(s) && d->storage != s->storage) {
            if (d->numel > 0)
                memcpy(gj_rt_data_ptr(d), gj_rt_data_ptr(s),
                       (size_t)d->numel * gj_rt_dtype_size(d->dtype));
        } else if (gj_rt_copy_into(d, s) != 0) {
            return -1;
        }
        gj_rt_bump_version(d);
    }
    return 0;
}

int gj_load_safetensors_into(gj_state_dict *dst, const char *path, bool strict) {
    gj_state_dict *src = gj_load_safetensors(path);
    if (!src)
        return -1;
    int rc = gj_state_dict_copy_into(dst, src, strict);
    gj_state_dict_free(src);
    return rc;
}

/* --------------------------------------------------------------- RNG */

int gj_rng_state_dict_add(gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_rng_state_dict_add";
    if (!sd) {
        gj_rt_set_error("%s: state dict is NULL", op);
        return -1;
    }
    if (!prefix)
        prefix = "rng";
    uint64_t seed, counter;
    gj_rng_get_state(&seed, &counter);
    char key[256], val[32];
    snprintf(key, sizeof key, "%.200s.seed", prefix);
    snprintf(val, sizeof val, "%" PRIu64, seed);
    if (gj_state_dict_set_metadata(sd, key, val) != 0)
        return -1;
    snprintf(key, sizeof key, "%.200s.counter", prefix);
    snprintf(val, sizeof val, "%" PRIu64, counter);
    return gj_state_dict_set_metadata(sd, key, val);
}

/* A metadata value that is a plain decimal u64 ("0".."18446744073709551615"). */
int gj_fe_meta_u64(const gj_state_dict *sd, const char *key, uint64_t *out) {
    const char *v = gj_state_dict_get_metadata(sd, key);
    if (!v || !v[0] || strlen(v) > 20)
        return -1;
    uint64_t x = 0;
    for (const char *c = v; *c; c++) {
        if (*c < '0' || *c > '9')
            return -1;
        unsigned d = (unsigned)(*c - '0');
        if (x > (UINT64_MAX - d) / 10)
            return -1;
        x = x * 10 + d;
    }
    *out = x;
    return 0;
}

int gj_rng_load_state_dict(const gj_state_dict *sd, const char *prefix) {
    const char *op = "gj_rng_load_state_dict";
    if (!sd) {
        gj_rt_set_error("%s: state dict is NULL", op);
        return -1;
    }
    if (!prefix)
        prefix = "rng";
    char ks[256], kc[256];
    snprintf(ks, sizeof ks, "%.200s.seed", prefix);
    snprintf(kc, sizeof kc, "%.200s.counter", prefix);
    uint64_t seed, counter;
    const char *vs = gj_state_dict_get_metadata(sd, ks), *vc = gj_state_dict_get_metadata(sd, kc);
    if (!vs || !vc) {
        char what[600];
        if (!vs && !vc)
            snprintf(what, sizeof what, "\"%s\" and \"%s\"", ks, kc);
        else
            snprintf(what, sizeof what, "\"%s\"", vs ? kc : ks);
        gj_rt_set_error("%s: missing metadata %s (gj_rng_state_dict_add stores both)", op, what);
        return -1;
    }
    if (gj_fe_meta_u64(sd, ks, &seed) != 0 || gj_fe_meta_u64(sd, kc, &counter) != 0) {
        gj_rt_set_error("%s: metadata \"%s\" and \"%s\" must both be decimal unsigned 64-bit "
                        "integers (got \"%.40s\" and \"%.40s\")",
                        op, ks, kc, vs, vc);
        return -1;
    }
    gj_rng_set_state(seed, counter);
    return 0;
}
