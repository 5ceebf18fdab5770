/* SPDX-License-Identifier: MIT */
/*
 * llmc.c - the files of karpathy/llm.c's GPT-2 trainer (train_gpt2.c), read
 * and written byte for byte as llm.c does:
 *
 *   model checkpoint (gpt2_124M.bin)   256 x int32 header: 20240326, 3,
 *       maxT, V, L, NH, C, Vp; then the 16 parameter tensors as f32 in
 *       llm.c's order (gj_llmc_param_name), nothing after them.
 *   token file (*_train.bin)           256 x int32 header: 20240520, 1,
 *       token count n; then n uint16 tokens, nothing after them.
 *   tokenizer (gpt2_tokenizer.bin)     256 x int32 header: 20240328,
 *       version 1 (V must be 50257, end-of-text 50256) or 2 (end-of-text
 *       in header[3]), V; then V pieces, each a uint8 length >= 1 and its
 *       bytes, nothing after them.
 * Everything is little-endian. The batch loader serves what llm.c's
 * DataLoader serves for one process and one file (llmc/dataloader.h):
 * batch k of an epoch is tokens [k B T, (k+1) B T] (inputs the first B T,
 * targets the last B T), an epoch has (n - 1) / (B T) batches, and the
 * batch after the last starts the next epoch at the file's beginning (the
 * tail that does not fill a batch is never read). Shuffled, the batches of
 * each epoch come in the order of a permutation drawn as llm.c draws it:
 * Fisher-Yates with a Mersenne Twister (numerically torch's) seeded 42,
 * one permutation per epoch from the same generator.
 *
 * Invariants:
 *   - A reader trusts nothing in a file: every header field is checked
 *     (magic, version, ranges, products in int64 without overflow) and the
 *     file's length must be exactly what the header announces, before any
 *     tensor or table is allocated; so the memory a reader allocates is
 *     bounded by the file's own size. Every read is exact (a short read is
 *     an error saying the file is truncated). A failure frees everything
 *     and leaves one error naming the function, the file and the field.
 *   - Writers write a whole file under a temporary name in the same
 *     directory and rename it over the target, as gj_save_safetensors.
 *   - A loader holds an open descriptor of its token file and reads each
 *     batch when asked (the file was checked when the loader was made;
 *     each batch is checked again, in case the file changed).
 */
#include "fe.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LLMC_HEADER_INTS 256
#define LLMC_HEADER_BYTES (LLMC_HEADER_INTS * 4)
#define LLMC_MODEL_MAGIC 20240326
#define LLMC_MODEL_VERSION 3
#define LLMC_TOKENS_MAGIC 20240520
#define LLMC_TOKENS_VERSION 1
#define LLMC_TOKENIZER_MAGIC 20240328
#define LLMC_GPT2_VOCAB 50257 /* version 1 tokenizers: GPT-2's, end-of-text 50256 */
#define LLMC_IO_CHUNK ((size_t)1 << 20)

/* ------------------------------------------------------------ helpers */

static int32_t llmc_le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

static void llmc_put32(unsigned char *p, int32_t v) {
    uint32_t u = (uint32_t)v;
    for (int k = 0; k < 4; k++)
        p[k] = (unsigned char)(u >> (8 * k));
}

/* What a header's first word says the file is, for messages about a file
 * given in the wrong place. */
static const char *llmc_kind_of(int32_t magic) {
    switch (magic) {
    case LLMC_MODEL_MAGIC: return " (that is llm.c's model checkpoint magic)";
    case LLMC_TOKENS_MAGIC: return " (that is llm.c's token file magic)";
    case LLMC_TOKENIZER_MAGIC: return " (that is llm.c's tokenizer magic)";
    case 20240327: return " (that is llm.c's model state file magic: gpt2_124M_debug_state.bin)";
    }
    return "";
}

/* Opens path for reading as a regular file; *size receives its length.
 * The descriptor, or -1 with an error naming op and path. */
static int llmc_open(const char *op, const char *path, int64_t *size) {
    if (!path || !path[0]) {
        gj_rt_set_error("%s: NULL or empty path", op);
        return -1;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        gj_rt_set_error("%s: cannot open %s: %s", op, path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        gj_rt_set_error("%s(%s): not a regular file", op, path);
        close(fd);
        return -1;
    }
    *size = (int64_t)st.st_size;
    return fd;
}

/* Reads exactly len bytes at offset off. 0, or -1 with an error saying
 * what was being read (a short read: the file is truncated). */
static int llmc_pread(const char *op, const char *path, int fd, void *buf, size_t len,
                      int64_t off, const char *what) {
    unsigned char *p = buf;
    while (len > 0) {
        ssize_t r = pread(fd, p, len > LLMC_IO_CHUNK ? LLMC_IO_CHUNK : len, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            gj_rt_set_error("%s(%s): reading %s: %s", op, path, what, strerror(errno));
            return -1;
        }
        if (r == 0) {
            gj_rt_set_error("%s(%s): truncated: the file ends inside %s (at byte %" PRId64 ")",
                            op, path, what, off);
            return -1;
        }
        p += r;
        off += r;
        len -= (size_t)r;
    }
    return 0;
}

/* Reads the 1024-byte header into h[256]. 0 or -1 (error set). */
static int llmc_read_header(const char *op, const char *path, int fd, int64_t size,
                            int32_t *h) {
    unsigned char raw[LLMC_HEADER_BYTES];
    if (size < LLMC_HEADER_BYTES) {
        gj_rt_set_error("%s(%s): truncated: %" PRId64 " bytes, shorter than the %d-byte header "
                        "(256 int32)",
                        op, path, size, LLMC_HEADER_BYTES);
        return -1;
    }
    if (llmc_pread(op, path, fd, raw, sizeof raw, 0, "the header") != 0)
        return -1;
    for (int k = 0; k < LLMC_HEADER_INTS; k++)
        h[k] = llmc_le32(raw + 4 * k);
    return 0;
}

/* A file written under a temporary name, renamed over its path when
 * complete (runtime/files.c's sink, with this file's errors). */
typedef struct llmc_sink {
    const char *op, *path;
    gj_rt_sink s;
} llmc_sink;

static int llmc_sink_open(llmc_sink *s, const char *op, const char *path) {
    char why[300];
    s->op = op;
    s->path = path;
    if (!path || !path[0]) {
        gj_rt_set_error("%s: NULL or empty path", op);
        return -1;
    }
    if (gj_rt_sink_open(&s->s, -1, path, NULL, 0644, why, sizeof why) != 0) {
        gj_rt_set_error("%s: cannot write %s: %s", op, path, why);
        return -1;
    }
    return 0;
}

static int llmc_sink_write(llmc_sink *s, const void *buf, size_t n) {
    char why[200];
    if (gj_rt_sink_write(&s->s, buf, n, why, sizeof why) != 0) {
        gj_rt_set_error("%s: writing %s: %s", s->op, s->path, why);
        return -1;
    }
    return 0;
}

/* Finishes the file: with ok, fsync, close and rename over the path;
 * otherwise (or if one of those fails) the temporary file is removed.
 * 0 or -1 (error set). */
static int llmc_sink_close(llmc_sink *s, bool ok) {
    char why[200];
    if (gj_rt_sink_close(&s->s, ok, true, why, sizeof why) != 0) {
        if (ok)
            gj_rt_set_error("%s: cannot write %s: %s", s->op, s->path, why);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------- model */

static const char *const llmc_names[GJ_LLMC_N_PARAMS] = {
    "wte",  "wpe",      "ln1w",     "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b",     "fcw",      "fcb",  "fcprojw", "fcprojb", "lnfw", "lnfb"};

const char *gj_llmc_param_name(int i) {
    return i >= 0 && i < GJ_LLMC_N_PARAMS ? llmc_names[i] : NULL;
}

/* The header field names, in header order from word 2. */
static const char *const llmc_fields[6] = {"max_seq_len", "vocab_size", "num_layers",
                                           "num_heads", "channels", "padded_vocab_size"};

/* Checks cfg and computes every parameter's element count into n[16] and
 * the total into *total (either may be NULL). op and path (may be NULL)
 * name the error. 0 or -1. */
static int llmc_config_sizes(const char *op, const char *path, const gj_llmc_config *c,
                             int64_t *n, int64_t *total) {
    char where[64 + PATH_MAX];
    snprintf(where, sizeof where, "%s%s%s%s", op, path ? "(" : "", path ? path : "",
             path ? ")" : "");
    if (!c) {
        gj_rt_set_error("%s: NULL config", where);
        return -1;
    }
    const int v[6] = {c->max_seq_len, c->vocab_size, c->num_layers,
                      c->num_heads,   c->channels,   c->padded_vocab_size};
    for (int k = 0; k < 6; k++)
        if (v[k] <= 0) {
            gj_rt_set_error("%s: %s is %d, must be positive", where, llmc_fields[k], v[k]);
            return -1;
        }
    if (c->padded_vocab_size < c->vocab_size) {
        gj_rt_set_error("%s: padded_vocab_size %d is smaller than vocab_size %d", where,
                        c->padded_vocab_size, c->vocab_size);
        return -1;
    }
    if (c->channels % c->num_heads != 0) {
        gj_rt_set_error("%s: channels %d is not a multiple of num_heads %d", where, c->channels,
                        c->num_heads);
        return -1;
    }
    int64_t s[3], cnt[GJ_LLMC_N_PARAMS], sum = 0;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int nd = gj_llmc_param_shape(c, i, s);
        int64_t e = 1;
        for (int d = 0; d < nd; d++)
            if (__builtin_mul_overflow(e, s[d], &e))
                goto overflow;
        if (__builtin_add_overflow(sum, e, &sum) || sum > (INT64_MAX - LLMC_HEADER_BYTES) / 4)
            goto overflow;
        cnt[i] = e;
    }
    if (n)
        memcpy(n, cnt, sizeof cnt);
    if (total)
        *total = sum;
    return 0;
overflow:
    gj_rt_set_error("%s: the parameter sizes overflow 64 bits (max_seq_len %d, vocab_size %d, "
                    "num_layers %d, num_heads %d, channels %d, padded_vocab_size %d)",
                    where, c->max_seq_len, c->vocab_size, c->num_layers, c->num_heads,
                    c->channels, c->padded_vocab_size);
    return -1;
}

int gj_llmc_param_shape(const gj_llmc_config *c, int i, int64_t *shape) {
    if (!c || !shape || i < 0 || i >= GJ_LLMC_N_PARAMS) {
        gj_rt_set_error("gj_llmc_param_shape: %s", !c || !shape ? "NULL argument"
                                                                : "index out of range [0, 16)");
        return -1;
    }
    const int64_t Vp = c->padded_vocab_size, C = c->channels, T = c->max_seq_len,
                  L = c->num_layers;
    switch (i) {
    case 0: shape[0] = Vp; shape[1] = C; return 2;                  /* wte */
    case 1: shape[0] = T; shape[1] = C; return 2;                   /* wpe */
    case 4: shape[0] = L; shape[1] = 3 * C; shape[2] = C; return 3; /* qkvw */
    case 5: shape[0] = L; shape[1] = 3 * C; return 2;               /* qkvb */
    case 6: shape[0] = L; shape[1] = C; shape[2] = C; return 3;     /* attprojw */
    case 10: shape[0] = L; shape[1] = 4 * C; shape[2] = C; return 3; /* fcw */
    case 11: shape[0] = L; shape[1] = 4 * C; return 2;               /* fcb */
    case 12: shape[0] = L; shape[1] = C; shape[2] = 4 * C; return 3; /* fcprojw */
    case 14: case 15: shape[0] = C; return 1;                        /* lnfw, lnfb */
    default: shape[0] = L; shape[1] = C; return 2; /* ln1w ln1b attprojb ln2w ln2b fcprojb */
    }
}

int gj_llmc_config_check(const gj_llmc_config *cfg) {
    return llmc_config_sizes("gj_llmc_config_check", NULL, cfg, NULL, NULL);
}

int64_t gj_llmc_num_parameters(const gj_llmc_config *cfg) {
    int64_t total;
    return llmc_config_sizes("gj_llmc_num_parameters", NULL, cfg, NULL, &total) ? -1 : total;
}

int gj_llmc_load_model(const char *path, gj_dtype dtype, gj_llmc_config *cfg,
                       gj_tensor **params) {
    const char *op = "gj_llmc_load_model";
    if (!cfg || !params) {
        gj_rt_set_error("%s: NULL config or parameter array", op);
        return -1;
    }
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++)
        params[i] = NULL;
    if (dtype != GJ_F32 && dtype != GJ_F64) {
        gj_rt_set_error("%s: dtype must be f32 or f64, got %s", op, gj_rt_dtype_name(dtype));
        return -1;
    }
    int64_t size = 0, cnt[GJ_LLMC_N_PARAMS], total = 0;
    int fd = llmc_open(op, path, &size);
    if (fd < 0)
        return -1;
    float *buf = NULL;
    int32_t h[LLMC_HEADER_INTS];
    gj_llmc_config c;
    if (llmc_read_header(op, path, fd, size, h) != 0)
        goto fail;
    if (h[0] != LLMC_MODEL_MAGIC) {
        gj_rt_set_error("%s(%s): header[0] (magic) is %d, expected %d (an llm.c model "
                        "checkpoint)%s",
                        op, path, h[0], LLMC_MODEL_MAGIC, llmc_kind_of(h[0]));
        goto fail;
    }
    if (h[1] != LLMC_MODEL_VERSION) {
        gj_rt_set_error("%s(%s): header[1] (version) is %d, expected %d (f32 parameters)%s", op,
                        path, h[1], LLMC_MODEL_VERSION,
                        h[1] == 5 ? "; version 5 holds bf16 parameters (train_gpt2.cu), which "
                                    "train_gpt2.c and gradjit do not read"
                                  : "");
        goto fail;
    }
    c = (gj_llmc_config){.max_seq_len = h[2], .vocab_size = h[3], .num_layers = h[4],
                         .num_heads = h[5], .channels = h[6], .padded_vocab_size = h[7]};
    if (llmc_config_sizes(op, path, &c, cnt, &total) != 0)
        goto fail;
    if (size != LLMC_HEADER_BYTES + 4 * total) {
        gj_rt_set_error("%s(%s): %s: the file has %" PRId64 " bytes, the header's sizes "
                        "(max_seq_len %d, vocab_size %d, num_layers %d, num_heads %d, channels "
                        "%d, padded_vocab_size %d: %" PRId64 " f32 parameters) need %" PRId64,
                        op, path, size < LLMC_HEADER_BYTES + 4 * total ? "truncated" : "too long",
                        size, c.max_seq_len, c.vocab_size, c.num_layers, c.num_heads, c.channels,
                        c.padded_vocab_size, total, LLMC_HEADER_BYTES + 4 * total);
        goto fail;
    }
    if (!(buf = gj_rt_malloc(LLMC_IO_CHUNK)))
        goto fail;
    int64_t off = LLMC_HEADER_BYTES;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int64_t shape[3];
        int nd = gj_llmc_param_shape(&c, i, shape);
        if (!(params[i] = gj_zeros(dtype, nd, shape)))
            goto fail;
        unsigned char *dst = gj_tensor_data(params[i]);
        for (int64_t done = 0; done < cnt[i];) {
            int64_t k = cnt[i] - done;
            if (k > (int64_t)(LLMC_IO_CHUNK / 4))
                k = (int64_t)(LLMC_IO_CHUNK / 4);
            char what[64];
            snprintf(what, sizeof what, "parameter %s", llmc_names[i]);
            if (llmc_pread(op, path, fd, buf, (size_t)k * 4, off, what) != 0)
                goto fail;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            for (int64_t j = 0; j < k; j++) {
                int32_t w = llmc_le32((unsigned char *)buf + 4 * j);
                memcpy(buf + j, &w, 4);
            }
#endif
            if (dtype == GJ_F32) {
                memcpy(dst + done * 4, buf, (size_t)k * 4);
            } else {
                double *d = (double *)(void *)dst + done;
                for (int64_t j = 0; j < k; j++)
                    d[j] = buf[j];
            }
            off += k * 4;
            done += k;
        }
    }
    gj_rt_free(buf);
    close(fd);
    *cfg = c;
    return 0;
fail:
    gj_rt_free(buf);
    close(fd);
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        gj_release(params[i]);
        params[i] = NULL;
    }
    return -1;
}

int gj_llmc_save_model(const char *path, const gj_llmc_config *cfg, gj_tensor *const *params) {
    const char *op = "gj_llmc_save_model";
    int64_t cnt[GJ_LLMC_N_PARAMS];
    if (!params) {
        gj_rt_set_error("%s: NULL parameter array", op);
        return -1;
    }
    if (llmc_config_sizes(op, path, cfg, cnt, NULL) != 0)
        return -1;
    for (int i = 0; i < GJ_LLMC_N_PARAMS; i++) {
        int64_t shape[3];
        int nd = gj_llmc_param_shape(cfg, i, shape);
        const gj_tensor *t = params[i];
        bool ok = t && (gj_tensor_dtype(t) == GJ_F32 || gj_tensor_dtype(t) == GJ_F64) &&
                  gj_tensor_ndim(t) == nd;
        for (int d = 0; ok && d < nd; d++)
            ok = gj_tensor_shape(t)[d] == shape[d];
        if (!ok) {
            char want[96], got[160] = "NULL";
            gj_rt_fmt_shape(want, sizeof want, nd, shape);
            if (t)
                snprintf(got, sizeof got, "%s %s", gj_rt_dtype_name(gj_tensor_dtype(t)),
                         gj_rt_fmt_shape((char[96]){0}, 96, gj_tensor_ndim(t),
                                         gj_tensor_shape(t)));
            gj_rt_set_error("%s(%s): parameter %d (%s) must be f32 or f64 of shape %s for this "
                            "config, got %s",
                            op, path ? path : "NULL", i, llmc_names[i], want, got);
            return -1;
        }
    }
    unsigned char hdr[LLMC_HEADER_BYTES] = {0};
    const int32_t words[8] = {LLMC_MODEL_MAGIC,  LLMC_MODEL_VERSION, cfg->max_seq_len,
                              cfg->vocab_size,   cfg->num_layers,    cfg->num_heads,
                              cfg->channels,     cfg->padded_vocab_size};
    for (int k = 0; k < 8; k++)
        llmc_put32(hdr + 4 * k, words[k]);
    llmc_sink s;
    if (llmc_sink_open(&s, op, path) != 0)
        return -1;
    float *buf = gj_rt_malloc(LLMC_IO_CHUNK);
    bool ok = buf && llmc_sink_write(&s, hdr, sizeof hdr) == 0;
    for (int i = 0; ok && i < GJ_LLMC_N_PARAMS; i++) {
        gj_tensor *c = gj_contiguous(params[i]);
        ok = c != NULL;
        const unsigned char *src = ok ? gj_tensor_data(c) : NULL;
        bool f64 = ok && gj_tensor_dtype(c) == GJ_F64;
        for (int64_t done = 0; ok && done < cnt[i];) {
            int64_t k = cnt[i] - done;
            if (k > (int64_t)(LLMC_IO_CHUNK / 4))
                k = (int64_t)(LLMC_IO_CHUNK / 4);
            for (int64_t j = 0; j < k; j++) {
                float f;
                if (f64) {
                    double d;
                    memcpy(&d, src + (done + j) * 8, 8);
                    f = (float)d;
                } else {
                    memcpy(&f, src + (done + j) * 4, 4);
                }
                int32_t w;
                memcpy(&w, &f, 4);
                llmc_put32((unsigned char *)(buf + j), w);
            }
            ok = llmc_sink_write(&s, buf, (size_t)k * 4) == 0;
            done += k;
        }
        gj_release(c);
    }
    gj_rt_free(buf);
    return llmc_sink_close(&s, ok);
}

/* -------------------------------------------------------- token files */

/* Opens a token file and checks its header and length: the descriptor
 * (*n receives the token count), or -1 (error set). */
static int llmc_tokens_open(const char *op, const char *path, int64_t *n) {
    int64_t size = 0;
    int32_t h[LLMC_HEADER_INTS];
    int fd = llmc_open(op, path, &size);
    if (fd < 0)
        return -1;
    if (llmc_read_header(op, path, fd, size, h) != 0)
        goto fail;
    if (h[0] != LLMC_TOKENS_MAGIC) {
        gj_rt_set_error("%s(%s): header[0] (magic) is %d, expected %d (an llm.c token file)%s",
                        op, path, h[0], LLMC_TOKENS_MAGIC, llmc_kind_of(h[0]));
        goto fail;
    }
    if (h[1] != LLMC_TOKENS_VERSION) {
        gj_rt_set_error("%s(%s): header[1] (version) is %d, expected %d (uint16 tokens)", op,
                        path, h[1], LLMC_TOKENS_VERSION);
        goto fail;
    }
    if (h[2] <= 0) {
        gj_rt_set_error("%s(%s): header[2] (token count) is %d, must be positive", op, path,
                        h[2]);
        goto fail;
    }
    if (size != LLMC_HEADER_BYTES + 2 * (int64_t)h[2]) {
        gj_rt_set_error("%s(%s): %s: the file has %" PRId64 " bytes, header[2] announces %d "
                        "uint16 tokens (%" PRId64 " bytes with the header)",
                        op, path,
                        size < LLMC_HEADER_BYTES + 2 * (int64_t)h[2] ? "truncated" : "too long",
                        size, h[2], LLMC_HEADER_BYTES + 2 * (int64_t)h[2]);
        goto fail;
    }
    *n = h[2];
    return fd;
fail:
    close(fd);
    return -1;
}

/* Reads tokens [first, first + k) into out (uint16 values as int64) and
 * checks them against vocab (> 0). 0 or -1 (error set). */
static int llmc_tokens_read(const char *op, const char *path, int fd, int64_t first, int64_t k,
                            int64_t vocab, int64_t *out, uint16_t *scratch) {
    if (llmc_pread(op, path, fd, scratch, (size_t)k * 2, LLMC_HEADER_BYTES + 2 * first,
                   "the tokens") != 0)
        return -1;
    const unsigned char *b = (const unsigned char *)scratch;
    for (int64_t j = 0; j < k; j++) {
        int64_t v = (int64_t)b[2 * j] | (int64_t)b[2 * j + 1] << 8;
        if (vocab > 0 && v >= vocab) {
            gj_rt_set_error("%s(%s): token %" PRId64 " is %" PRId64 ", not below the vocabulary "
                            "size %" PRId64,
                            op, path, first + j, v, vocab);
            return -1;
        }
        if (out)
            out[j] = v;
    }
    return 0;
}

gj_tensor *gj_llmc_load_tokens(const char *path, int64_t vocab_size) {
    const char *op = "gj_llmc_load_tokens";
    int64_t n = 0;
    int fd = llmc_tokens_open(op, path, &n);
    if (fd < 0)
        return NULL;
    gj_tensor *t = gj_zeros(GJ_I64, 1, &n);
    uint16_t *scratch = gj_rt_malloc(LLMC_IO_CHUNK);
    if (!t || !scratch)
        goto fail;
    int64_t *v = gj_tensor_data(t);
    for (int64_t done = 0; done < n;) {
        int64_t k = n - done < (int64_t)(LLMC_IO_CHUNK / 2) ? n - done
                                                             : (int64_t)(LLMC_IO_CHUNK / 2);
        if (llmc_tokens_read(op, path, fd, done, k, vocab_size, v + done, scratch) != 0)
            goto fail;
        done += k;
    }
    gj_rt_free(scratch);
    close(fd);
    return t;
fail:
    gj_rt_free(scratch);
    gj_release(t);
    close(fd);
    return NULL;
}

int gj_llmc_save_tokens(const char *path, const uint16_t *tokens, int64_t n) {
    const char *op = "gj_llmc_save_tokens";
    if (!tokens || n <= 0 || n > INT32_MAX) {
        gj_rt_set_error("%s(%s): need 1 to %d tokens (the header's count is an int32), got %" PRId64
                        "%s",
                        op, path ? path : "NULL", INT32_MAX, n, tokens ? "" : " (NULL)");
        return -1;
    }
    unsigned char hdr[LLMC_HEADER_BYTES] = {0};
    llmc_put32(hdr, LLMC_TOKENS_MAGIC);
    llmc_put32(hdr + 4, LLMC_TOKENS_VERSION);
    llmc_put32(hdr + 8, (int32_t)n);
    llmc_sink s;
    if (llmc_sink_open(&s, op, path) != 0)
        return -1;
    unsigned char *buf = gj_rt_malloc(LLMC_IO_CHUNK);
    bool ok = buf && llmc_sink_write(&s, hdr, sizeof hdr) == 0;
    for (int64_t done = 0; ok && done < n;) {
        int64_t k = n - done < (int64_t)(LLMC_IO_CHUNK / 2) ? n - done
                                                             : (int64_t)(LLMC_IO_CHUNK / 2);
        for (int64_t j = 0; j < k; j++) {
            buf[2 * j] = (unsigned char)(tokens[done + j] & 0xff);
            buf[2 * j + 1] = (unsigned char)(tokens[done + j] >> 8);
        }
        ok = llmc_sink_write(&s, buf, (size_t)k * 2) == 0;
        done += k;
    }
    gj_rt_free(buf);
    return llmc_sink_close(&s, ok);
}

/* ------------------------------------------------------------- loader */

/* The Mersenne Twister of llm.c's llmc/rand.h (numerically torch's
 * generator): enough of it for random_permutation. */
#define MT_N 624
#define MT_M 397

typedef struct llmc_mt {
    uint32_t s[MT_N];
    int left, next;
} llmc_mt;

static void llmc_mt_seed(llmc_mt *m, uint32_t seed) {
    m->s[0] = seed;
    for (uint32_t j = 1; j < MT_N; j++)
        m->s[j] = 1812433253u * (m->s[j - 1] ^ (m->s[j - 1] >> 30)) + j;
    m->left = 1;
    m->next = 0;
}

static void llmc_mt_twist(llmc_mt *m) {
    static const uint32_t mag[2] = {0u, 0x9908b0dfu};
    uint32_t y;
    int j;
    m->left = MT_N;
    m->next = 0;
    for (j = 0; j < MT_N - MT_M; j++) {
        y = (m->s[j] & 0x80000000u) | (m->s[j + 1] & 0x7fffffffu);
        m->s[j] = m->s[j + MT_M] ^ (y >> 1) ^ mag[y & 1u];
    }
    for (; j < MT_N - 1; j++) {
        y = (m->s[j] & 0x80000000u) | (m->s[j + 1] & 0x7fffffffu);
        m->s[j] = m->s[j + (MT_M - MT_N)] ^ (y >> 1) ^ mag[y & 1u];
    }
    y = (m->s[MT_N - 1] & 0x80000000u) | (m->s[0] & 0x7fffffffu);
    m->s[MT_N - 1] = m->s[MT_M - 1] ^ (y >> 1) ^ mag[y & 1u];
}

static uint32_t llmc_mt_u32(llmc_mt *m) {
    if (--m->left <= 0)
        llmc_mt_twist(m);
    uint32_t y = m->s[m->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

struct gj_llmc_loader {
    char *path;
    int fd;
    int64_t B, T, vocab, n_tokens, n_batches;
    int rank, ranks;      /* this process's slice of every ranks * B * T chunk */
    bool shuffle;
    int64_t epoch, batch; /* epochs started - 1; batches served in this epoch */
    llmc_mt mt;           /* shuffle: draws the permutations */
    int32_t *perm;        /* shuffle: [n_batches], this epoch's order */
    uint16_t *raw;        /* [B T + 1] */
    int64_t *ids;         /* [B T + 1] */
};

/* Draws the next epoch's permutation (llm.c's random_permutation of the
 * identity: Fisher-Yates from the last index down, j = u32 % (i + 1)). */
static void llmc_loader_permute(gj_llmc_loader *l) {
    for (int64_t i = 0; i < l->n_batches; i++)
        l->perm[i] = (int32_t)i;
    for (int64_t i = l->n_batches - 1; i > 0; i--) {
        int64_t j = llmc_mt_u32(&l->mt) % (uint32_t)(i + 1);
        int32_t t = l->perm[i];
        l->perm[i] = l->perm[j];
        l->perm[j] = t;
    }
}

gj_llmc_loader *gj_llmc_loader_new(const char *path, int64_t B, int64_t T, int64_t vocab_size,
                                   bool shuffle) {
    return gj_llmc_loader_new_rank(path, B, T, vocab_size, shuffle, 0, 1);
}

gj_llmc_loader *gj_llmc_loader_new_rank(const char *path, int64_t B, int64_t T,
                                        int64_t vocab_size, bool shuffle, int rank, int ranks) {
    const char *op = ranks == 1 && rank == 0 ? "gj_llmc_loader_new" : "gj_llmc_loader_new_rank";
    if (ranks < 1 || rank < 0 || rank >= ranks) {
        gj_rt_set_error("%s(%s): rank %d of %d ranks", op, path ? path : "NULL", rank, ranks);
        return NULL;
    }
    if (B < 1 || T < 1 || B > INT32_MAX / T || B * T > INT64_MAX / 4 / ranks) {
        gj_rt_set_error("%s(%s): batch %" PRId64 " x sequence %" PRId64 " must be positive "
                        "and fit in an int32",
                        op, path ? path : "NULL", B, T);
        return NULL;
    }
    int64_t n = 0;
    int fd = llmc_tokens_open(op, path, &n);
    if (fd < 0)
        return NULL;
    gj_llmc_loader *l = gj_rt_calloc(1, sizeof *l);
    if (!l) {
        close(fd);
        return NULL;
    }
    l->fd = fd;
    l->B = B;
    l->T = T;
    l->vocab = vocab_size;
    l->n_tokens = n;
    l->shuffle = shuffle;
    l->rank = rank;
    l->ranks = ranks;
    /* llm.c asserts at least one batch (of every rank) and the token after it */
    if (n < ranks * B * T + 1) {
        gj_rt_set_error("%s(%s): %" PRId64 " tokens, fewer than one batch of %d x %" PRId64
                        " x %" PRId64 " plus the last target (%" PRId64 ")",
                        op, path, n, ranks, B, T, ranks * B * T + 1);
        goto fail;
    }
    l->n_batches = (n - 1) / (ranks * B * T);
    size_t plen = strlen(path) + 1;
    if (!(l->path = gj_rt_malloc(plen)) ||
        !(l->raw = gj_rt_malloc((size_t)(B * T + 1) * sizeof *l->raw)) ||
        !(l->ids = gj_rt_malloc((size_t)(B * T + 1) * sizeof *l->ids)))
        goto fail;
    memcpy(l->path, path, plen);
    /* every token of the file is checked once, here */
    for (int64_t done = 0; done < n;) {
        int64_t k = n - done < B * T + 1 ? n - done : B * T + 1;
        if (llmc_tokens_read(op, path, fd, done, k, vocab_size, NULL, l->raw) != 0)
            goto fail;
        done += k;
    }
    if (shuffle && !(l->perm = gj_rt_malloc((size_t)l->n_batches * sizeof *l->perm)))
        goto fail;
    if (gj_llmc_loader_set_position(l, 0, 0) != 0)
        goto fail;
    return l;
fail:
    gj_llmc_loader_free(l);
    return NULL;
}

int gj_llmc_loader_next(gj_llmc_loader *l, gj_tensor **inputs, gj_tensor **targets) {
    const char *op = "gj_llmc_loader_next";
    if (!l || !inputs || !targets) {
        gj_rt_set_error("%s: NULL argument", op);
        return -1;
    }
    *inputs = *targets = NULL;
    if (l->batch >= l->n_batches) /* past the last batch: the next epoch */
        gj_llmc_loader_reset(l);
    int64_t BT = l->B * l->T, k = l->shuffle ? l->perm[l->batch] : l->batch;
    if (llmc_tokens_read(op, l->path, l->fd, (k * l->ranks + l->rank) * BT, BT + 1, l->vocab,
                         l->ids, l->raw) != 0)
        return -1;
    int64_t shape[2] = {l->B, l->T};
    gj_tensor *x = gj_from_data(GJ_I64, 2, shape, l->ids);
    gj_tensor *y = x ? gj_from_data(GJ_I64, 2, shape, l->ids + 1) : NULL;
    if (!y) {
        gj_release(x);
        return -1;
    }
    l->batch++;
    *inputs = x;
    *targets = y;
    return 0;
}

void gj_llmc_loader_reset(gj_llmc_loader *l) {
    if (!l)
        return;
    l->epoch++;
    l->batch = 0;
    if (l->shuffle)
        llmc_loader_permute(l);
}

int64_t gj_llmc_loader_num_tokens(const gj_llmc_loader *l) { return l ? l->n_tokens : -1; }

int64_t gj_llmc_loader_num_batches(const gj_llmc_loader *l) { return l ? l->n_batches : -1; }

int gj_llmc_loader_get_position(const gj_llmc_loader *l, int64_t *epoch, int64_t *batch) {
    if (!l || !epoch || !batch) {
        gj_rt_set_error("gj_llmc_loader_get_position: NULL argument");
        return -1;
    }
    *epoch = l->epoch;
    *batch = l->batch;
    return 0;
}

int gj_llmc_loader_set_position(gj_llmc_loader *l, int64_t epoch, int64_t batch) {
    /* shuffled, the permutations of every epoch up to this one are drawn
     * again: at most 2^33 draws (about a minute) */
    if (!l || epoch < 0 || batch < 0 || batch > l->n_batches ||
        (l->shuffle && epoch >= (INT64_C(1) << 33) / l->n_batches)) {
        gj_rt_set_error("gj_llmc_loader_set_position: %s epoch %" PRId64 ", batch %" PRId64
                        " (an epoch has %" PRId64 " batches)",
                        l ? "no such position:" : "NULL loader,", epoch, batch,
                        l ? l->n_batches : (int64_t)0);
        return -1;
    }
    if (l->shuffle) {
        llmc_mt_seed(&l->mt, 42 + (uint32_t)l->rank); /* llm.c: 42 + process rank */
        for (int64_t e = 0; e <= epoch; e++)
            llmc_loader_permute(l);
    }
    l->epoch = epoch;
    l->batch = batch;
    return 0;
}

void gj_llmc_loader_free(gj_llmc_loader *l) {
    if (!l)
        return;
    if (l->fd >= 0)
        close(l->fd);
    gj_rt_free(l->path);
    gj_rt_free(l->perm);
    gj_rt_free(l->raw);
    gj_rt_free(l->ids);
    gj_rt_free(l);
}

/* ---------------------------------------------------------- tokenizer */

struct gj_llmc_tokenizer {
    int64_t vocab, eot;
    int64_t *off;  /* [vocab + 1]: piece i is text[off[i] .. off[i+1]) */
    char *text;    /* the pieces, each followed by a NUL */
};

gj_llmc_tokenizer *gj_llmc_tokenizer_load(const char *path) {
    const char *op = "gj_llmc_tokenizer_load";
    int64_t size = 0;
    int fd = llmc_open(op, path, &size);
    if (fd < 0)
        return NULL;
    int32_t h[LLMC_HEADER_INTS];
    unsigned char *raw = NULL;
    gj_llmc_tokenizer *t = NULL;
    if (llmc_read_header(op, path, fd, size, h) != 0)
        goto fail;
    if (h[0] != LLMC_TOKENIZER_MAGIC) {
        gj_rt_set_error("%s(%s): header[0] (magic) is %d, expected %d (an llm.c tokenizer)%s",
                        op, path, h[0], LLMC_TOKENIZER_MAGIC, llmc_kind_of(h[0]));
        goto fail;
    }
    int64_t vocab = (uint32_t)h[2], eot;
    if (h[1] == 1) {
        if (vocab != LLMC_GPT2_VOCAB) {
            gj_rt_set_error("%s(%s): header[2] (vocab_size) is %" PRId64 "; a version 1 "
                            "tokenizer is GPT-2's, %d tokens",
                            op, path, vocab, LLMC_GPT2_VOCAB);
            goto fail;
        }
        eot = LLMC_GPT2_VOCAB - 1;
    } else if (h[1] == 2) {
        eot = h[3];
    } else {
        gj_rt_set_error("%s(%s): header[1] (version) is %d, expected 1 or 2", op, path, h[1]);
        goto fail;
    }
    /* each piece takes at least 2 bytes: the bound on vocab before allocating */
    int64_t body = size - LLMC_HEADER_BYTES;
    if (vocab < 1 || vocab > body / 2) {
        gj_rt_set_error("%s(%s): header[2] (vocab_size) is %" PRId64 ", but the %" PRId64
                        " bytes after the header hold at most %" PRId64 " pieces%s",
                        op, path, vocab, body, body / 2, vocab < 1 ? " (and it must be positive)"
                                                                    : ": truncated");
        goto fail;
    }
    if (eot < 0 || eot >= vocab) {
        gj_rt_set_error("%s(%s): header[3] (end-of-text token) is %" PRId64 ", not below "
                        "vocab_size %" PRId64,
                        op, path, eot, vocab);
        goto fail;
    }
    if (!(raw = gj_rt_malloc((size_t)body)) ||
        llmc_pread(op, path, fd, raw, (size_t)body, LLMC_HEADER_BYTES, "the pieces") != 0)
        goto fail;
    if (!(t = gj_rt_calloc(1, sizeof *t)) ||
        !(t->off = gj_rt_malloc((size_t)(vocab + 1) * sizeof *t->off)) ||
        !(t->text = gj_rt_malloc((size_t)body))) /* vocab lengths + vocab NULs <= body */
        goto fail;
    int64_t pos = 0, out = 0;
    for (int64_t i = 0; i < vocab; i++) {
        if (pos >= body) {
            gj_rt_set_error("%s(%s): truncated: the file ends before piece %" PRId64 " of %" PRId64,
                            op, path, i, vocab);
            goto fail;
        }
        int len = raw[pos++];
        if (len == 0) {
            gj_rt_set_error("%s(%s): piece %" PRId64 " has length 0 (llm.c needs at least one "
                            "byte)",
                            op, path, i);
            goto fail;
        }
        if (len > body - pos) {
            gj_rt_set_error("%s(%s): truncated: piece %" PRId64 " of %d bytes goes past the end "
                            "of the file",
                            op, path, i, len);
            goto fail;
        }
        t->off[i] = out;
        memcpy(t->text + out, raw + pos, (size_t)len);
        out += len;
        t->text[out++] = 0;
        pos += len;
    }
    t->off[vocab] = out;
    if (pos != body) {
        gj_rt_set_error("%s(%s): %" PRId64 " bytes after the last of %" PRId64 " pieces", op,
                        path, body - pos, vocab);
        goto fail;
    }
    t->vocab = vocab;
    t->eot = eot;
    gj_rt_free(raw);
    close(fd);
    return t;
fail:
    gj_rt_free(raw);
    gj_llmc_tokenizer_free(t);
    close(fd);
    return NULL;
}

int gj_llmc_tokenizer_save(const char *path, int64_t n, const char *const *pieces,
                           const int *lens, int64_t eot) {
    const char *op = "gj_llmc_tokenizer_save";
    if (!pieces || !lens || n < 1 || n > INT32_MAX || eot < 0 || eot >= n) {
        gj_rt_set_error("%s(%s): need 1 to %d pieces and an end-of-text token among them "
                        "(n %" PRId64 ", eot %" PRId64 "%s)",
                        op, path ? path : "NULL", INT32_MAX, n, eot,
                        pieces && lens ? "" : ", NULL pieces or lengths");
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        if (lens[i] < 1 || lens[i] > 255 || !pieces[i]) {
            gj_rt_set_error("%s(%s): piece %" PRId64 " has length %d; llm.c's pieces are 1 to "
                            "255 bytes",
                            op, path ? path : "NULL", i, lens[i]);
            return -1;
        }
    unsigned char hdr[LLMC_HEADER_BYTES] = {0};
    llmc_put32(hdr, LLMC_TOKENIZER_MAGIC);
    llmc_put32(hdr + 4, 2);
    llmc_put32(hdr + 8, (int32_t)n);
    llmc_put32(hdr + 12, (int32_t)eot);
    llmc_sink s;
    if (llmc_sink_open(&s, op, path) != 0)
        return -1;
    bool ok = llmc_sink_write(&s, hdr, sizeof hdr) == 0;
    for (int64_t i = 0; ok && i < n; i++) {
        unsigned char len = (unsigned char)lens[i];
        ok = llmc_sink_write(&s, &len, 1) == 0 && llmc_sink_write(&s, pieces[i], len) == 0;
    }
    return llmc_sink_close(&s, ok);
}

int64_t gj_llmc_tokenizer_vocab_size(const gj_llmc_tokenizer *t) { return t ? t->vocab : -1; }

int64_t gj_llmc_tokenizer_eot(const gj_llmc_tokenizer *t) { return t ? t->eot : -1; }

const char *gj_llmc_tokenizer_decode(const gj_llmc_tokenizer *t, int64_t id, size_t *len) {
    if (!t || id < 0 || id >= t->vocab) {
        gj_rt_set_error("gj_llmc_tokenizer_decode: %s %" PRId64 "%s", t ? "token" : "NULL "
                        "tokenizer, token", id, t ? " is out of range" : "");
        if (len)
            *len = 0;
        return NULL;
    }
    if (len)
        *len = (size_t)(t->off[id + 1] - t->off[id] - 1);
    return t->text + t->off[id];
}

void gj_llmc_tokenizer_free(gj_llmc_tokenizer *t) {
    if (!t)
        return;
    gj_rt_free(t->off);
    gj_rt_free(t->text);
    gj_rt_free(t);
}
