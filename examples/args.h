/* SPDX-License-Identifier: MIT */
/*
 * args.h - the example programs' command line, one parser for all of them
 * (getopt_long over a table of options). Header-only; not part of the
 * library.
 *
 * Each option names where its value goes and its range; the value already
 * there is the default, which --help shows. Numbers must be whole (or
 * finite, for doubles) and in range, else the program stops with a message
 * naming the option, the value and the range. A FILE option takes "-" for
 * "no file" (NULL). --help prints the table, --version the program's and
 * gradjit's version.
 */
#ifndef GJ_EXAMPLES_ARGS_H
#define GJ_EXAMPLES_ARGS_H

#include "gradjit.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum arg_kind {
    ARG_FLAG,   /* bool: present or not */
    ARG_INT,    /* int, whole number in [lo, hi] */
    ARG_I64,    /* int64_t, whole number in [lo, hi] */
    ARG_U64,    /* uint64_t, any whole number >= 0 */
    ARG_DOUBLE, /* double, finite, lo < value <= hi */
    ARG_FILE,   /* const char *, "-" means none (NULL) */
    ARG_STR,    /* const char *, as given (the program checks it) */
    ARG_STRS,   /* repeatable: const char *dst[max], *count of them */
    ARG_STR2,   /* two values (--opt A B): const char *dst[2], as given */
} arg_kind;

typedef struct arg_spec {
    const char *name; /* without the leading "--" */
    arg_kind kind;
    void *dst;
    double lo, hi;
    const char *help;
    int *count, max;  /* ARG_STRS */
    bool *given;      /* set when the option appears (may be NULL) */
} arg_spec;

/* One table row (designated, so the rest of the fields stay zero). */
#define ARG_OPT(n, k, d, l, h, txt)                                                            \
    { .name = (n), .kind = (k), .dst = (d), .lo = (l), .hi = (h), .help = (txt) }
/* The same with *g set when the option appears. */
#define ARG_OPT_GIVEN(n, k, d, l, h, txt, g)                                                   \
    { .name = (n), .kind = (k), .dst = (d), .lo = (l), .hi = (h), .help = (txt), .given = (g) }

static inline const char *args_value_name(arg_kind k) {
    switch (k) {
    case ARG_INT: case ARG_I64: case ARG_U64: return "N";
    case ARG_DOUBLE: return "X";
    case ARG_FILE: case ARG_STRS: return "FILE";
    case ARG_STR: return "S";
    case ARG_STR2: return "A B";
    default: return "";
    }
}

static inline void args_default(const arg_spec *s, char *buf, size_t cap) {
    buf[0] = 0;
    switch (s->kind) {
    case ARG_FLAG: break;
    case ARG_INT: snprintf(buf, cap, "%d", *(int *)s->dst); break;
    case ARG_I64: snprintf(buf, cap, "%" PRId64, *(int64_t *)s->dst); break;
    case ARG_U64: snprintf(buf, cap, "%" PRIu64, *(uint64_t *)s->dst); break;
    case ARG_DOUBLE: snprintf(buf, cap, "%g", *(double *)s->dst); break;
    case ARG_FILE: {
        const char *v = *(const char **)s->dst;
        snprintf(buf, cap, "%s", v ? v : "none");
        break;
    }
    case ARG_STRS: snprintf(buf, cap, "%s", *s->count ? "given" : "none"); break;
    case ARG_STR2: {
        const char *const *v = s->dst;
        snprintf(buf, cap, "%s", v[0] ? "given" : "none");
        break;
    }
    case ARG_STR: {
        const char *v = *(const char **)s->dst;
        snprintf(buf, cap, "%s", v ? v : "none");
        break;
    }
    }
}

static inline void args_usage(FILE *f, const char *prog, const char *summary,
                              const arg_spec *specs, int n) {
    fprintf(f, "usage: %s [options]\n%s\n\noptions (default in brackets):\n", prog, summary);
    for (int i = 0; i < n; i++) {
        char opt[64], def[300];
        snprintf(opt, sizeof opt, "--%s%s%s", specs[i].name, specs[i].kind == ARG_FLAG ? "" : " ",
                 args_value_name(specs[i].kind));
        args_default(&specs[i], def, sizeof def);
        fprintf(f, "  %-22s %s", opt, specs[i].help);
        if (specs[i].kind != ARG_FLAG) fprintf(f, " [%s]", def);
        fprintf(f, "\n");
    }
    fprintf(f, "  %-22s %s\n  %-22s %s\n", "--help", "this text", "--version",
            "the program's and gradjit's version");
}

/* Parses argv into the specs' destinations. 0: go on; 1: --help or
 * --version was printed (exit 0); -1: an error was printed (exit 2). */
static inline int args_parse(const char *prog, const char *summary, int argc, char **argv,
                             const arg_spec *specs, int n) {
    struct option *lo = calloc((size_t)n + 3, sizeof *lo);
    if (!lo) return -1;
    for (int i = 0; i < n; i++)
        lo[i] = (struct option){specs[i].name,
                                specs[i].kind == ARG_FLAG ? no_argument : required_argument, NULL,
                                1000 + i};
    lo[n] = (struct option){"help", no_argument, NULL, 'h'};
    lo[n + 1] = (struct option){"version", no_argument, NULL, 'V'};
    int rc = 0, c;
    optind = 1;
    opterr = 0;
    while (rc == 0 && (c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        if (c == 'h') {
            args_usage(stdout, prog, summary, specs, n);
            rc = 1;
            break;
        }
        if (c == 'V') {
            gj_info info;
            gj_get_info(&info);
            printf("%s (gradjit %s)\n", prog, info.version);
            rc = 1;
            break;
        }
        if (c < 1000 || c >= 1000 + n) {
            fprintf(stderr, "%s: unknown option or missing value: %s (see --help)\n", prog,
                    argv[optind - 1]);
            rc = -1;
            break;
        }
        const arg_spec *s = &specs[c - 1000];
        const char *v = optarg;
        char *end = NULL;
        errno = 0;
        bool ok = true;
        switch (s->kind) {
        case ARG_FLAG: *(bool *)s->dst = true; break;
        case ARG_INT:
        case ARG_I64: {
            long long x = strtoll(v, &end, 10);
            ok = *v && !*end && !errno && x >= s->lo && x <= s->hi;
            if (ok && s->kind == ARG_INT) *(int *)s->dst = (int)x;
            if (ok && s->kind == ARG_I64) *(int64_t *)s->dst = x;
            if (!ok)
                fprintf(stderr, "%s: --%s: '%s' is not a whole number in [%.0f, %.0f]\n", prog,
                        s->name, v, s->lo, s->hi);
            break;
        }
        case ARG_U64: {
            unsigned long long x = strtoull(v, &end, 10);
            ok = *v && !*end && !errno && v[0] != '-';
            if (ok) *(uint64_t *)s->dst = x;
            else fprintf(stderr, "%s: --%s: '%s' is not a whole number >= 0\n", prog, s->name, v);
            break;
        }
        case ARG_DOUBLE: {
            double x = strtod(v, &end);
            ok = *v && !*end && !errno && isfinite(x) && x > s->lo && x <= s->hi;
            if (ok) *(double *)s->dst = x;
            else fprintf(stderr, "%s: --%s: '%s' is not a number in (%g, %g]\n", prog, s->name, v,
                         s->lo, s->hi);
            break;
        }
        case ARG_FILE: *(const char **)s->dst = strcmp(v, "-") ? v : NULL; break;
        case ARG_STR: *(const char **)s->dst = v; break;
        case ARG_STR2:
            /* the second value is the next word (getopt_long has already
             * moved past the first) */
            if (optind >= argc) {
                fprintf(stderr, "%s: --%s takes two values\n", prog, s->name);
                ok = false;
            } else {
                ((const char **)s->dst)[0] = v;
                ((const char **)s->dst)[1] = argv[optind++];
            }
            break;
        case ARG_STRS:
            if (*s->count >= s->max) {
                fprintf(stderr, "%s: --%s at most %d times\n", prog, s->name, s->max);
                ok = false;
            } else {
                ((const char **)s->dst)[(*s->count)++] = v;
            }
            break;
        }
        if (!ok) rc = -1;
        else if (s->given) *s->given = true;
    }
    if (rc == 0 && optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
        rc = -1;
    }
    free(lo);
    return rc;
}

#endif /* GJ_EXAMPLES_ARGS_H */
