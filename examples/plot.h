/* SPDX-License-Identifier: MIT */
/*
 * plot.h - a tiny header-only chart writer for the examples and the bench:
 * an RGB raster, a 5x7 bitmap font, line charts (loss curves), grouped bar
 * charts (benchmark times) and a PNG encoder (zlib deflate, filter 0).
 * Used by examples/train_fashion_mnist.c, examples/train_charlm.c and
 * bench/bench.c (through a relative include); not part of the library.
 *
 * Invariants: a plot_img owns px, w * h * 3 bytes, row-major, top row
 * first, 8-bit R, G, B; every drawing call clips to the image, so any
 * coordinates are safe. Colours are 0xRRGGBB. Chart functions draw inside
 * a panel rectangle (px, py, pw, ph) of an existing image, so several panels
 * can share one PNG. Non-finite data values are skipped (lines) or drawn
 * as "n/a" (bars). All functions are static inline: including this header
 * costs nothing where a function is unused. Errors are reported as -1 with
 * a message on stderr (only plot_img_init and plot_write_png can fail).
 */
#ifndef GJ_EXAMPLES_PLOT_H
#define GJ_EXAMPLES_PLOT_H

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#define PLOT_GRID 0xe4e4e4u
#define PLOT_AXIS 0x404040u
#define PLOT_TEXT 0x202020u

/* ---------------------------------------------------------------- font */

/* Glyphs for ASCII 32..126: 7 rows, top first, bit 4 = leftmost column. */
static const uint8_t plot_font5x7[95][7] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, /* space */
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04}, /* ! */
    {0x0a, 0x0a, 0x00, 0x00, 0x00, 0x00, 0x00}, /* " */
    {0x0a, 0x0a, 0x1f, 0x0a, 0x1f, 0x0a, 0x0a}, /* # */
    {0x04, 0x0f, 0x14, 0x0e, 0x05, 0x1e, 0x04}, /* $ */
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}, /* % */
    {0x0c, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0d}, /* & */
    {0x04, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ' */
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}, /* ( */
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}, /* ) */
    {0x00, 0x04, 0x15, 0x0e, 0x15, 0x04, 0x00}, /* star */
    {0x00, 0x04, 0x04, 0x1f, 0x04, 0x04, 0x00}, /* + */
    {0x00, 0x00, 0x00, 0x00, 0x0c, 0x04, 0x08}, /* , */
    {0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00}, /* - */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0c, 0x0c}, /* . */
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}, /* slash */
    {0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e}, /* 0 */
    {0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e}, /* 1 */
    {0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f}, /* 2 */
    {0x1e, 0x01, 0x01, 0x0e, 0x01, 0x01, 0x1e}, /* 3 */
    {0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02}, /* 4 */
    {0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e}, /* 5 */
    {0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e}, /* 6 */
    {0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}, /* 7 */
    {0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e}, /* 8 */
    {0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c}, /* 9 */
    {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x0c, 0x00}, /* : */
    {0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x04, 0x08}, /* ; */
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02}, /* < */
    {0x00, 0x00, 0x1f, 0x00, 0x1f, 0x00, 0x00}, /* = */
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08}, /* > */
    {0x0e, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04}, /* ? */
    {0x0e, 0x11, 0x17, 0x15, 0x17, 0x10, 0x0e}, /* @ */
    {0x0e, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11}, /* A */
    {0x1e, 0x11, 0x11, 0x1e, 0x11, 0x11, 0x1e}, /* B */
    {0x0e, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0e}, /* C */
    {0x1c, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1c}, /* D */
    {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x1f}, /* E */
    {0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x10}, /* F */
    {0x0e, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0f}, /* G */
    {0x11, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11}, /* H */
    {0x0e, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e}, /* I */
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0c}, /* J */
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}, /* K */
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1f}, /* L */
    {0x11, 0x1b, 0x15, 0x15, 0x11, 0x11, 0x11}, /* M */
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}, /* N */
    {0x0e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e}, /* O */
    {0x1e, 0x11, 0x11, 0x1e, 0x10, 0x10, 0x10}, /* P */
    {0x0e, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0d}, /* Q */
    {0x1e, 0x11, 0x11, 0x1e, 0x14, 0x12, 0x11}, /* R */
    {0x0f, 0x10, 0x10, 0x0e, 0x01, 0x01, 0x1e}, /* S */
    {0x1f, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}, /* T */
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e}, /* U */
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0a, 0x04}, /* V */
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0a}, /* W */
    {0x11, 0x11, 0x0a, 0x04, 0x0a, 0x11, 0x11}, /* X */
    {0x11, 0x11, 0x0a, 0x04, 0x04, 0x04, 0x04}, /* Y */
    {0x1f, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1f}, /* Z */
    {0x0e, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0e}, /* [ */
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00}, /* backslash */
    {0x0e, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0e}, /* ] */
    {0x04, 0x0a, 0x11, 0x00, 0x00, 0x00, 0x00}, /* ^ */
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1f}, /* _ */
    {0x08, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00}, /* ` */
    {0x00, 0x00, 0x0e, 0x01, 0x0f, 0x11, 0x0f}, /* a */
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1e}, /* b */
    {0x00, 0x00, 0x0e, 0x10, 0x10, 0x11, 0x0e}, /* c */
    {0x01, 0x01, 0x0d, 0x13, 0x11, 0x11, 0x0f}, /* d */
    {0x00, 0x00, 0x0e, 0x11, 0x1f, 0x10, 0x0e}, /* e */
    {0x06, 0x09, 0x08, 0x1c, 0x08, 0x08, 0x08}, /* f */
    {0x0f, 0x11, 0x11, 0x11, 0x0f, 0x01, 0x0e}, /* g */
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}, /* h */
    {0x04, 0x00, 0x0c, 0x04, 0x04, 0x04, 0x0e}, /* i */
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0c}, /* j */
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12}, /* k */
    {0x0c, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e}, /* l */
    {0x00, 0x00, 0x1a, 0x15, 0x15, 0x11, 0x11}, /* m */
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}, /* n */
    {0x00, 0x00, 0x0e, 0x11, 0x11, 0x11, 0x0e}, /* o */
    {0x1e, 0x11, 0x11, 0x11, 0x1e, 0x10, 0x10}, /* p */
    {0x0f, 0x11, 0x11, 0x11, 0x0f, 0x01, 0x01}, /* q */
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}, /* r */
    {0x00, 0x00, 0x0e, 0x10, 0x0e, 0x01, 0x1e}, /* s */
    {0x08, 0x08, 0x1c, 0x08, 0x08, 0x09, 0x06}, /* t */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0d}, /* u */
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0a, 0x04}, /* v */
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0a}, /* w */
    {0x00, 0x00, 0x11, 0x0a, 0x04, 0x0a, 0x11}, /* x */
    {0x11, 0x11, 0x11, 0x11, 0x0f, 0x01, 0x0e}, /* y */
    {0x00, 0x00, 0x1f, 0x02, 0x04, 0x08, 0x1f}, /* z */
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02}, /* { */
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}, /* | */
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08}, /* } */
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00}, /* ~ */
};

/* ------------------------------------------------------------- raster */

typedef struct plot_img {
    int w, h;
    uint8_t *px; /* [h][w][3] */
} plot_img;

/* A white w x h image; 0, or -1 (message on stderr). */
static inline int plot_img_init(plot_img *im, int w, int h) {
    im->w = w;
    im->h = h;
    im->px = (w > 0 && h > 0) ? malloc((size_t)w * (size_t)h * 3) : NULL;
    if (!im->px) {
        fprintf(stderr, "plot: cannot allocate a %dx%d image\n", w, h);
        return -1;
    }
    memset(im->px, 0xff, (size_t)w * (size_t)h * 3);
    return 0;
}

static inline void plot_img_free(plot_img *im) {
    free(im->px);
    im->px = NULL;
    im->w = im->h = 0;
}

static inline void plot_px(plot_img *im, int x, int y, uint32_t rgb) {
    if (x < 0 || y < 0 || x >= im->w || y >= im->h)
        return;
    uint8_t *p = im->px + ((size_t)y * (size_t)im->w + (size_t)x) * 3;
    p[0] = (uint8_t)(rgb >> 16);
    p[1] = (uint8_t)(rgb >> 8);
    p[2] = (uint8_t)rgb;
}

/* rgb mixed with white: t = 0 gives rgb, t = 1 white. */
static inline uint32_t plot_tint(uint32_t rgb, double t) {
    uint32_t out = 0;
    for (int s = 16; s >= 0; s -= 8) {
        double c = (double)((rgb >> s) & 0xff);
        out |= (uint32_t)(c + (255.0 - c) * t + 0.5) << s;
    }
    return out;
}

/* Filled rectangle [x0, x1) x [y0, y1). */
static inline void plot_rect(plot_img *im, int x0, int y0, int x1, int y1, uint32_t rgb) {
    for (int y = y0; y < y1; y++)
        for (int x = x0; x < x1; x++)
            plot_px(im, x, y, rgb);
}

/* Outline of the rectangle [x0, x1] x [y0, y1]. */
static inline void plot_frame(plot_img *im, int x0, int y0, int x1, int y1, uint32_t rgb) {
    plot_rect(im, x0, y0, x1 + 1, y0 + 1, rgb);
    plot_rect(im, x0, y1, x1 + 1, y1 + 1, rgb);
    plot_rect(im, x0, y0, x0 + 1, y1 + 1, rgb);
    plot_rect(im, x1, y0, x1 + 1, y1 + 1, rgb);
}

/* Line from (x0, y0) to (x1, y1) (Bresenham) with a square brush of width px. */
static inline void plot_line(plot_img *im, int x0, int y0, int x1, int y1, uint32_t rgb,
                             int width) {
    int dx = abs(x1 - x0), dy = -abs(y1 - y0);
    int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, err = dx + dy;
    int lo = -(width - 1) / 2, hi = width / 2;
    for (;;) {
        plot_rect(im, x0 + lo, y0 + lo, x0 + hi + 1, y0 + hi + 1, rgb);
        if (x0 == x1 && y0 == y1)
            break;
        int e2 = 2 * err;
        if (e2 >= dy) {
            err += dy;
            x0 += sx;
        }
        if (e2 <= dx) {
            err += dx;
            y0 += sy;
        }
    }
}

/* Width in pixels of s drawn at scale (6 * scale per glyph, no trailing gap). */
static inline int plot_text_width(const char *s, int scale) {
    int n = (int)strlen(s);
    return n > 0 ? n * 6 * scale - scale : 0;
}

/* s with its top-left corner at (x, y); glyphs are 5x7 pixels times scale
 * (g, p, q and y sit two rows lower: their tails reach row 9). Characters
 * outside ASCII 32..126 draw as '?'. up: rotated a quarter turn
 * counter-clockwise (reads bottom to top, (x, y) is then the bottom-left). */
static inline void plot_text_dir(plot_img *im, int x, int y, const char *s, uint32_t rgb,
                                 int scale, bool up) {
    for (int i = 0; s[i]; i++) {
        int c = (unsigned char)s[i];
        const uint8_t *g = plot_font5x7[(c >= 32 && c <= 126 ? c : '?') - 32];
        int drop = (c == 'g' || c == 'p' || c == 'q' || c == 'y') ? 2 : 0; /* descenders */
        for (int r = 0; r < 7; r++)
            for (int col = 0; col < 5; col++) {
                if (!(g[r] & (0x10 >> col)))
                    continue;
                int u = (i * 6 + col) * scale, v = (r + drop) * scale;
                if (up)
                    plot_rect(im, x + v, y - u - scale, x + v + scale, y - u, rgb);
                else
                    plot_rect(im, x + u, y + v, x + u + scale, y + v + scale, rgb);
            }
    }
}

static inline void plot_text(plot_img *im, int x, int y, const char *s, uint32_t rgb,
                             int scale) {
    plot_text_dir(im, x, y, s, rgb, scale, false);
}

/* ----------------------------------------------------------------- PNG */

static inline void plot_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* One PNG chunk: length, type, data, CRC-32 over type and data. 0 or -1. */
static inline int plot_png_chunk(FILE *f, const char *type, const uint8_t *data, size_t len) {
    uint8_t b[8];
    plot_be32(b, (uint32_t)len);
    memcpy(b + 4, type, 4);
    uLong crc = crc32(0L, (const Bytef *)type, 4);
    if (len)
        crc = crc32(crc, data, (uInt)len);
    uint8_t c[4];
    plot_be32(c, (uint32_t)crc);
    if (fwrite(b, 1, 8, f) != 8 || (len && fwrite(data, 1, len, f) != len) ||
        fwrite(c, 1, 4, f) != 4)
        return -1;
    return 0;
}

/* Writes im as an 8-bit RGB PNG (no interlace, filter 0 on every row,
 * zlib level 9). 0, or -1 with a message on stderr. */
static inline int plot_write_png(const plot_img *im, const char *path) {
    size_t row = (size_t)im->w * 3 + 1, raw_len = row * (size_t)im->h;
    uLongf z_len = compressBound((uLong)raw_len);
    uint8_t *raw = malloc(raw_len), *z = malloc(z_len);
    FILE *f = NULL;
    int rc = -1;
    if (!raw || !z) {
        fprintf(stderr, "plot: out of memory writing %s\n", path);
        goto fail;
    }
    for (int y = 0; y < im->h; y++) {
        raw[row * (size_t)y] = 0;
        memcpy(raw + row * (size_t)y + 1, im->px + (size_t)y * (size_t)im->w * 3,
               (size_t)im->w * 3);
    }
    if (compress2(z, &z_len, raw, (uLong)raw_len, 9) != Z_OK) {
        fprintf(stderr, "plot: zlib failed compressing %s\n", path);
        goto fail;
    }
    if (!(f = fopen(path, "wb"))) {
        fprintf(stderr, "plot: cannot write %s: %s\n", path, strerror(errno));
        goto fail;
    }
    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    uint8_t ihdr[13];
    plot_be32(ihdr, (uint32_t)im->w);
    plot_be32(ihdr + 4, (uint32_t)im->h);
    ihdr[8] = 8;  /* bit depth */
    ihdr[9] = 2;  /* colour type: RGB */
    ihdr[10] = 0; /* deflate */
    ihdr[11] = 0; /* filter method 0 */
    ihdr[12] = 0; /* no interlace */
    if (fwrite(sig, 1, 8, f) != 8 || plot_png_chunk(f, "IHDR", ihdr, 13) != 0 ||
        plot_png_chunk(f, "IDAT", z, z_len) != 0 || plot_png_chunk(f, "IEND", NULL, 0) != 0) {
        fprintf(stderr, "plot: error writing %s\n", path);
        goto fail;
    }
    rc = 0;
fail:
    if (f && fclose(f) != 0 && rc == 0) {
        fprintf(stderr, "plot: error closing %s\n", path);
        rc = -1;
    }
    free(raw);
    free(z);
    return rc;
}

/* ---------------------------------------------------------------- axes */

/* A step of 1, 2 or 5 times a power of ten giving about `target` ticks over range. */
static inline double plot_nice_step(double range, int target) {
    if (!(range > 0) || !isfinite(range))
        return 1.0;
    double raw = range / (double)target, p = pow(10.0, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1.0 : m < 3.5 ? 2.0 : m < 7.5 ? 5.0 : 10.0) * p;
}

/* A tick label for v with as many decimals as step needs. */
static inline void plot_fmt_tick(char *buf, size_t cap, double v, double step) {
    int dec = step >= 1.0 ? 0 : (int)ceil(-log10(step) - 1e-9);
    if (fabs(v) < step * 1e-6)
        v = 0.0;
    if (fabs(v) >= 1e6 || (v != 0.0 && fabs(v) < 1e-4))
        snprintf(buf, cap, "%.2g", v);
    else
        snprintf(buf, cap, "%.*f", dec > 6 ? 6 : dec, v);
}

/* The plot area of a panel and its data ranges. */
typedef struct plot_axes {
    int x0, y0, x1, y1; /* plot area in pixels (x0 < x1, y0 < y1; y grows down) */
    double xmin, xmax, ymin, ymax;
} plot_axes;

static inline int plot_ax_x(const plot_axes *a, double v) {
    double t = (v - a->xmin) / (a->xmax - a->xmin);
    return a->x0 + (int)lround(t * (double)(a->x1 - a->x0));
}

static inline int plot_ax_y(const plot_axes *a, double v) {
    double t = (v - a->ymin) / (a->ymax - a->ymin);
    return a->y1 - (int)lround(t * (double)(a->y1 - a->y0));
}

/* Panel chrome: title above, y grid and tick labels (step ystep), x ticks
 * (if xstep > 0), axis labels, frame. */
static inline void plot_draw_axes(plot_img *im, const plot_axes *a, double xstep, double ystep,
                                  const char *title, const char *xlabel, const char *ylabel) {
    char buf[64];
    for (double v = ceil(a->ymin / ystep - 1e-9) * ystep; v <= a->ymax + ystep * 1e-9;
         v += ystep) {
        int y = plot_ax_y(a, v);
        plot_rect(im, a->x0 + 1, y, a->x1, y + 1, PLOT_GRID);
        plot_rect(im, a->x0 - 5, y, a->x0, y + 1, PLOT_AXIS);
        plot_fmt_tick(buf, sizeof buf, v, ystep);
        plot_text(im, a->x0 - 9 - plot_text_width(buf, 2), y - 7, buf, PLOT_TEXT, 2);
    }
    if (xstep > 0)
        for (double v = ceil(a->xmin / xstep - 1e-9) * xstep; v <= a->xmax + xstep * 1e-9;
             v += xstep) {
            int x = plot_ax_x(a, v);
            plot_rect(im, x, a->y0 + 1, x + 1, a->y1, PLOT_GRID);
            plot_rect(im, x, a->y1, x + 1, a->y1 + 6, PLOT_AXIS);
            plot_fmt_tick(buf, sizeof buf, v, xstep);
            plot_text(im, x - plot_text_width(buf, 2) / 2, a->y1 + 10, buf, PLOT_TEXT, 2);
        }
    plot_frame(im, a->x0, a->y0, a->x1, a->y1, PLOT_AXIS);
    if (title)
        plot_text(im, (a->x0 + a->x1 - plot_text_width(title, 2)) / 2, a->y0 - 26, title,
                  PLOT_TEXT, 2);
    if (xlabel)
        plot_text(im, (a->x0 + a->x1 - plot_text_width(xlabel, 2)) / 2, a->y1 + 32, xlabel,
                  PLOT_TEXT, 2);
    if (ylabel)
        plot_text_dir(im, a->x0 - 104, (a->y0 + a->y1 + plot_text_width(ylabel, 2)) / 2, ylabel,
                      PLOT_TEXT, 2, true);
}

/* Legend box in the corner of the plot area that covers the fewest of the
 * points pts[0..n_pts) (pixel x, y pairs; top-right on a tie): a colour
 * swatch and a label per entry (NULL labels are skipped). */
static inline void plot_legend(plot_img *im, const plot_axes *a, int n, const char *const *labels,
                               const uint32_t *colors, const int *pts, int n_pts) {
    int w = 0, rows = 0;
    for (int i = 0; i < n; i++)
        if (labels[i]) {
            int tw = plot_text_width(labels[i], 2);
            w = tw > w ? tw : w;
            rows++;
        }
    if (!rows)
        return;
    int bw = w + 46, bh = rows * 22 + 10, bx = a->x1 - bw - 10, by = a->y0 + 10, r = 0;
    int best = -1;
    for (int corner = 0; corner < 4; corner++) { /* top-right, top-left, bottom-right, -left */
        int cx = corner & 1 ? a->x0 + 10 : a->x1 - bw - 10;
        int cy = corner & 2 ? a->y1 - bh - 10 : a->y0 + 10, hits = 0;
        for (int i = 0; i < n_pts; i++)
            hits += pts[2 * i] >= cx - 6 && pts[2 * i] <= cx + bw + 6 &&
                    pts[2 * i + 1] >= cy - 6 && pts[2 * i + 1] <= cy + bh + 6;
        if (best < 0 || hits < best) {
            best = hits;
            bx = cx;
            by = cy;
        }
    }
    plot_rect(im, bx, by, bx + bw, by + bh, 0xffffffu);
    plot_frame(im, bx, by, bx + bw, by + bh, 0xb0b0b0u);
    for (int i = 0; i < n; i++) {
        if (!labels[i])
            continue;
        int y = by + 8 + r * 22;
        plot_rect(im, bx + 8, y + 1, bx + 30, y + 13, colors[i]);
        plot_text(im, bx + 38, y, labels[i], PLOT_TEXT, 2);
        r++;
    }
}

/* Legend in one row centred on x_mid with its top at y: swatch and label
 * per entry. */
static inline void plot_legend_row(plot_img *im, int x_mid, int y, int n, const char *const *labels,
                                   const uint32_t *colors) {
    int w = 0;
    for (int i = 0; i < n; i++)
        w += 30 + plot_text_width(labels[i], 2) + (i + 1 < n ? 24 : 0);
    int x = x_mid - w / 2;
    for (int i = 0; i < n; i++) {
        plot_rect(im, x, y + 1, x + 22, y + 13, colors[i]);
        plot_text(im, x + 30, y, labels[i], PLOT_TEXT, 2);
        x += 30 + plot_text_width(labels[i], 2) + 24;
    }
}

/* ---------------------------------------------------------- line chart */

typedef struct plot_series {
    const char *label; /* legend text, or NULL for no legend entry */
    const double *x;   /* [n] or NULL for 0, 1, ..., n-1 */
    const double *y;   /* [n] */
    int n;
    uint32_t rgb;
    int width;  /* line width in pixels */
    int marker; /* side of a square drawn at every point, 0 for none */
} plot_series;

/* Line chart of s[0..ns) in the panel (px, py, pw, ph), drawn in order (the
 * last series on top). The y range spans the finite values (or [ymin, ymax]
 * when ymin < ymax is given). */
static inline void plot_line_panel(plot_img *im, int px, int py, int pw, int ph,
                                   const char *title, const char *xlabel, const char *ylabel,
                                   const plot_series *s, int ns, double ymin, double ymax) {
    plot_axes a = {px + 110, py + 40, px + pw - 24, py + ph - 62, INFINITY, -INFINITY,
                   INFINITY, -INFINITY};
    bool x_int = true, markers = false;
    int n_all = 0;
    for (int k = 0; k < ns; k++) {
        markers |= s[k].marker > 0;
        n_all += s[k].n;
    }
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < s[k].n; i++) {
            double x = s[k].x ? s[k].x[i] : (double)i, y = s[k].y[i];
            if (!isfinite(x) || !isfinite(y))
                continue;
            a.xmin = fmin(a.xmin, x);
            a.xmax = fmax(a.xmax, x);
            x_int &= x == floor(x);
            a.ymin = fmin(a.ymin, y);
            a.ymax = fmax(a.ymax, y);
        }
    if (!(a.xmin <= a.xmax))
        a.xmin = 0, a.xmax = 1, a.ymin = 0, a.ymax = 1;
    if (ymin < ymax)
        a.ymin = ymin, a.ymax = ymax;
    if (a.xmax <= a.xmin)
        a.xmax = a.xmin + 1;
    if (a.ymax <= a.ymin)
        a.ymax = a.ymin + 1;
    double ystep = plot_nice_step(a.ymax - a.ymin, 6), xstep = plot_nice_step(a.xmax - a.xmin, 8);
    if (x_int && xstep < 1.0)
        xstep = 1.0;
    if (markers) { /* keep the end markers inside the frame */
        double pad = (a.xmax - a.xmin) * 0.04;
        a.xmin -= pad;
        a.xmax += pad;
    }
    a.ymin = floor(a.ymin / ystep) * ystep;
    a.ymax = ceil(a.ymax / ystep) * ystep;
    /* Every drawn point in pixels, for the legend's placement (sampled to at most 4096). */
    int stride = n_all > 4096 ? n_all / 4096 + 1 : 1, n_pts = 0;
    int *pts = malloc(sizeof(int) * 2 * (size_t)(n_all / stride + ns + 1));
    plot_draw_axes(im, &a, xstep, ystep, title, xlabel, ylabel);
    const char *labels[16];
    uint32_t colors[16];
    for (int k = 0; k < ns; k++) {
        bool have = false;
        int lx = 0, ly = 0;
        for (int i = 0; i < s[k].n; i++) {
            double x = s[k].x ? s[k].x[i] : (double)i, y = s[k].y[i];
            if (!isfinite(x) || !isfinite(y)) {
                have = false;
                continue;
            }
            int cx = plot_ax_x(&a, x), cy = plot_ax_y(&a, y);
            if (pts && i % stride == 0) {
                pts[2 * n_pts] = cx;
                pts[2 * n_pts + 1] = cy;
                n_pts++;
            }
            if (have)
                plot_line(im, lx, ly, cx, cy, s[k].rgb, s[k].width);
            if (s[k].marker > 0)
                plot_rect(im, cx - s[k].marker / 2, cy - s[k].marker / 2,
                          cx - s[k].marker / 2 + s[k].marker, cy - s[k].marker / 2 + s[k].marker,
                          s[k].rgb);
            lx = cx;
            ly = cy;
            have = true;
        }
        if (k < 16) {
            labels[k] = s[k].label;
            colors[k] = s[k].rgb;
        }
    }
    plot_legend(im, &a, ns < 16 ? ns : 16, labels, colors, pts, n_pts);
    free(pts);
}

/* ------------------------------------------------------------ bar chart */

/* Grouped bars in the panel (px, py, pw, ph): n_groups groups (x labels
 * group_labels) of n_bars bars each (legend bar_labels, colours colors);
 * values[g * n_bars + b] >= 0, NaN for a missing bar (drawn as "n/a").
 * Each bar carries its value printed with value_fmt (e.g. "%.1f"). The
 * title and a one-row legend sit above the plot area. */
static inline void plot_bar_panel(plot_img *im, int px, int py, int pw, int ph, const char *title,
                                  const char *ylabel, int n_groups, const char *const *group_labels,
                                  int n_bars, const char *const *bar_labels, const uint32_t *colors,
                                  const double *values, const char *value_fmt) {
    plot_axes a = {px + 110, py + 70, px + pw - 20, py + ph - 40, 0, 1, 0, 0};
    for (int i = 0; i < n_groups * n_bars; i++)
        if (isfinite(values[i]) && values[i] > a.ymax)
            a.ymax = values[i];
    if (!(a.ymax > 0))
        a.ymax = 1;
    a.ymax *= 1.08; /* room for the value labels */
    double ystep = plot_nice_step(a.ymax, 6);
    a.ymax = ceil(a.ymax / ystep) * ystep;
    plot_draw_axes(im, &a, 0, ystep, NULL, NULL, ylabel);
    if (title)
        plot_text(im, (a.x0 + a.x1 - plot_text_width(title, 2)) / 2, py + 8, title, PLOT_TEXT, 2);
    plot_legend_row(im, (a.x0 + a.x1) / 2, py + 36, n_bars, bar_labels, colors);
    double gw = (double)(a.x1 - a.x0) / (double)(n_groups > 0 ? n_groups : 1);
    double bw = gw * 0.8 / (double)(n_bars > 0 ? n_bars : 1);
    char buf[64];
    for (int g = 0; g < n_groups; g++) {
        double gx = a.x0 + gw * g + gw * 0.1;
        for (int b = 0; b < n_bars; b++) {
            double v = values[g * n_bars + b];
            int x0 = (int)lround(gx + bw * b) + 1, x1 = (int)lround(gx + bw * (b + 1)) - 1;
            int xc = (x0 + x1) / 2;
            if (!isfinite(v)) {
                plot_text_dir(im, xc - 3, a.y1 - 4, "n/a", 0x909090u, 1, true);
                continue;
            }
            int y = plot_ax_y(&a, v);
            plot_rect(im, x0, y, x1, a.y1, colors[b]);
            snprintf(buf, sizeof buf, value_fmt, v);
            int tw = plot_text_width(buf, 1);
            if (tw <= x1 - x0 + 6)
                plot_text(im, xc - tw / 2, y - 10, buf, PLOT_TEXT, 1);
            else
                plot_text_dir(im, xc - 3, y - 4, buf, PLOT_TEXT, 1, true);
        }
        const char *gl = group_labels[g];
        int xc = (int)lround(a.x0 + gw * (g + 0.5));
        plot_text(im, xc - plot_text_width(gl, 2) / 2, a.y1 + 10, gl, PLOT_TEXT, 2);
    }
}

#endif /* GJ_EXAMPLES_PLOT_H */
