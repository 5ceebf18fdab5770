/* SPDX-License-Identifier: MIT */
/*
 * attention_impl.h - one version of attention.h's algorithm, for the
 * element type GJ_ATTN_T accumulated in GJ_ATTN_A (attention.h includes it
 * three times: f32, bf16, f64). Not a header of its own: no include guard.
 *
 * Tiles (accumulator type, row-major, on the stack):
 *   Qt [D][BR]   the block's queries, transposed   K [BC][D], V [BC][E]  a key block
 *   St, Pt [BC][BR]  scores, probabilities (transposed: a row per key)
 *   Q [BR][D], dO [BR][E]  the backward's query rows and output gradients
 */
#define GJ_ATTN_CAT_(a, b) a##_##b
#define GJ_ATTN_CAT(a, b) GJ_ATTN_CAT_(a, b)
#define GJ_ATTN_FN(name) GJ_ATTN_CAT(gj_attn_##name, GJ_ATTN_SFX)

typedef GJ_ATTN_A GJ_ATTN_FN(acc_t);

/* rows [i0, i0 + n) of x (strides xs over b, h, t; width w) of head (b, h)
 * into tile[n][w], widened. */
GJ_ATTN_INLINE void GJ_ATTN_FN(load_rows)(GJ_ATTN_A *restrict tile, const GJ_ATTN_T *restrict x,
                                         const int64_t *xs, int64_t b, int64_t h, int64_t i0,
                                         int64_t n, int64_t w) {
    for (int64_t i = 0; i < n; i++) {
        const GJ_ATTN_T *row = x + b * xs[0] + h * xs[1] + (i0 + i) * xs[2];
        for (int64_t d = 0; d < w; d++)
            tile[i * w + d] = GJ_ATTN_LD(row, d);
    }
}

/* The one product of the algorithm: for rows r < n and columns w < W,
 *     C[r][w] := C0 + sum_k A(r, k) B[k][w],  k = 0, 1, .. K-1 in order,
 * one fused multiply-add per term; C0 = C[r][w] (add) or 0. A(r, k) is
 * A[r ars + k aks] (a row-major tile, or one read transposed), B's row k
 * starts at B + k ldb, C's row r at C + r ldc. Where W is a multiple of
 * the vector length (the block width, or a head size the kernel is
 * specialised to), blocks of R rows keep R x NV vectors of accumulators in
 * registers across k (GJ_ATTN_PRODV); otherwise one element at a time.
 * Either way each element is the same chain of fused multiply-adds. */
#define GJ_ATTN_VL ((int64_t)(sizeof(GJ_ATTN_V) / sizeof(GJ_ATTN_A)))
#define GJ_ATTN_PRODV(R_, NV_)                                                                 \
    do {                                                                                       \
        for (; r + (R_) <= n; r += (R_)) {                                                     \
            GJ_ATTN_V c[R_][NV_];                                                              \
            GJ_ATTN_UNROLL for (int q = 0; q < (R_); q++)                                      \
                GJ_ATTN_UNROLL for (int v = 0; v < (NV_); v++) {                               \
                    c[q][v] = (GJ_ATTN_V){0};                                                  \
                    if (add)                                                                   \
                        c[q][v] = *(const GJ_ATTN_VU *)(C + (r + q) * ldc + v * GJ_ATTN_VL);   \
                }                                                                              \
            for (int64_t k = 0; k < K; k++) {                                                  \
                GJ_ATTN_V bv[NV_];                                                             \
                GJ_ATTN_UNROLL for (int v = 0; v < (NV_); v++)                                 \
                    bv[v] = *(const GJ_ATTN_VU *)(B + k * ldb + v * GJ_ATTN_VL);               \
                GJ_ATTN_UNROLL for (int q = 0; q < (R_); q++) {                                \
                    GJ_ATTN_V a = A[(r + q) * ars + k * aks] - (GJ_ATTN_V){0};                 \
                    GJ_ATTN_UNROLL for (int v = 0; v < (NV_); v++)                             \
                        c[q][v] = GJ_ATTN_VFMA(a, bv[v], c[q][v]);                             \
                }                                                                              \
            }                                                                                  \
            GJ_ATTN_UNROLL for (int q = 0; q < (R_); q++)                                      \
                GJ_ATTN_UNROLL for (int v = 0; v < (NV_); v++)                                 \
                    *(GJ_ATTN_VU *)(C + (r + q) * ldc + v * GJ_ATTN_VL) = c[q][v];             \
        }                                                                                      \
    } while (0)

GJ_ATTN_INLINE void GJ_ATTN_FN(prod)(GJ_ATTN_A *restrict C, int64_t ldc, int64_t n,
                                     const GJ_ATTN_A *restrict A, int64_t ars, int64_t aks,
                                     int64_t K, const GJ_ATTN_A *restrict B, int64_t ldb,
                                     int64_t W, bool add) {
    int64_t r = 0;
    if (W % GJ_ATTN_VL == 0) {
        switch (W / GJ_ATTN_VL) {
        case 1: GJ_ATTN_PRODV(8, 1); GJ_ATTN_PRODV(1, 1); return;
        case 2: GJ_ATTN_PRODV(8, 2); GJ_ATTN_PRODV(1, 2); return;
        case 4: GJ_ATTN_PRODV(4, 4); GJ_ATTN_PRODV(1, 4); return;
        case 8: GJ_ATTN_PRODV(2, 8); GJ_ATTN_PRODV(1, 8); return;
        default: break;
        }
    }
    for (; r < n; r++) {
        GJ_ATTN_A c[GJ_ATTN_DMAX];
        for (int64_t w = 0; w < W; w++)
            c[w] = add ? C[r * ldc + w] : (GJ_ATTN_A)0;
        for (int64_t k = 0; k < K; k++) {
            GJ_ATTN_A a = A[r * ars + k * aks];
            const GJ_ATTN_A *b = B + k * ldb;
            for (int64_t w = 0; w < W; w++)
                c[w] = GJ_ATTN_FMA(a, b[w], c[w]);
        }
        for (int64_t w = 0; w < W; w++)
            C[r * ldc + w] = c[w];
    }
}
#undef GJ_ATTN_PRODV
#undef GJ_ATTN_VL

/* Scores St[j][i] (keys j < bc of block j0, queries i < GJ_ATTN_BR of
 * block i0, br of them real) := scale St, or -inf where key j is hidden
 * from query i (causal) or i is not a query (i >= br). */
GJ_ATTN_INLINE void GJ_ATTN_FN(scale_mask)(const gj_attn_geom *g, GJ_ATTN_A *restrict St,
                                           int64_t i0, int64_t br, int64_t j0, int64_t bc) {
    GJ_ATTN_A scale = (GJ_ATTN_A)g->scale, ninf = (GJ_ATTN_A)-__builtin_inf();
    if (br == GJ_ATTN_BR && (!g->causal || j0 + bc - 1 <= i0)) { /* every query sees every key */
        for (int64_t x = 0; x < bc * GJ_ATTN_BR; x++)
            St[x] *= scale;
        return;
    }
    for (int64_t j = 0; j < bc; j++) {
        GJ_ATTN_A *s = St + j * GJ_ATTN_BR;
        int64_t first = g->causal ? j0 + j - i0 : 0; /* the first query that sees key j */
        for (int64_t i = 0; i < GJ_ATTN_BR; i++)
            s[i] = i >= first && i < br ? s[i] * scale : ninf;
    }
}

/* Pt[j][i] *= the dropout scale of (b, h, i0 + i, j0 + j), for j < bc, i < br;
 * into Zt (PZ) and dPt (dP Z) for the backward when they are given. */
GJ_ATTN_INLINE void GJ_ATTN_FN(drop)(const gj_attn_geom *g, const gj_attn_mem *m,
                                     GJ_ATTN_A *restrict Pt, GJ_ATTN_A *restrict Zt,
                                     GJ_ATTN_A *restrict dPt, int64_t b, int64_t h, int64_t i0,
                                     int64_t br, int64_t j0, int64_t bc) {
    uint64_t base = m->offset + (uint64_t)(((b * g->H + h) * g->T + i0) * g->S + j0);
    for (int64_t j = 0; j < bc; j++)
        for (int64_t i = 0; i < GJ_ATTN_BR; i++) {
            GJ_ATTN_A z = i < br ? GJ_ATTN_DROP(m->seed, base + (uint64_t)(i * g->S + j),
                                                (GJ_ATTN_A)g->p)
                                 : (GJ_ATTN_A)0;
            int64_t x = j * GJ_ATTN_BR + i;
            if (Zt) {
                Zt[x] = Pt[x] * z;
                dPt[x] *= z;
            } else {
                Pt[x] *= z;
            }
        }
}

/* Rows [i0, i0 + n) of x (width w) of head (b, h) as an accumulator tile:
 * x's own memory where its element type is the accumulator's (*ld its row
 * stride), else a widened copy in tile (*ld = w). */
GJ_ATTN_INLINE const GJ_ATTN_A *GJ_ATTN_FN(rows)(GJ_ATTN_A *restrict tile, int64_t *ld,
                                                 const GJ_ATTN_T *restrict x, const int64_t *xs,
                                                 int64_t b, int64_t h, int64_t i0, int64_t n,
                                                 int64_t w) {
    if (sizeof(GJ_ATTN_T) == sizeof(GJ_ATTN_A)) {
        *ld = xs[2];
        return (const GJ_ATTN_A *)(const void *)(x + b * xs[0] + h * xs[1] + i0 * xs[2]);
    }
    GJ_ATTN_FN(load_rows)(tile, x, xs, b, h, i0, n, w);
    *ld = w;
    return tile;
}

/* tile[w][GJ_ATTN_BR] := rows [i0, i0 + n) of x (width w) transposed, the
 * columns n.. zero. */
GJ_ATTN_INLINE void GJ_ATTN_FN(load_t)(GJ_ATTN_A *restrict tile, int64_t ld,
                                       const GJ_ATTN_T *restrict x, const int64_t *xs,
                                       int64_t b, int64_t h, int64_t i0, int64_t n, int64_t w) {
    for (int64_t i = 0; i < n; i++) {
        const GJ_ATTN_T *row = x + b * xs[0] + h * xs[1] + (i0 + i) * xs[2];
        for (int64_t d = 0; d < w; d++)
            tile[d * ld + i] = GJ_ATTN_LD(row, d);
    }
    for (int64_t d = 0; d < w; d++)
        for (int64_t i = n; i < GJ_ATTN_BR; i++)
            tile[d * ld + i] = 0;
}

/* ------------------------------------------------------------- forward */

/* Unit u of the forward: the output rows and log-sum-exps of one block of
 * queries of one head. The scores are kept transposed (St[key][query]), so
 * every per-query statistic is a vector over the block's queries. */
GJ_ATTN_INLINE void GJ_ATTN_FN(fwd_unit)(const gj_attn_geom *g, const gj_attn_mem *m, int64_t u) {
    int64_t nqb = (g->T + GJ_ATTN_BR - 1) / GJ_ATTN_BR;
    int64_t qb = u % nqb, bh = u / nqb, b = bh / g->H, h = bh % g->H;
    int64_t i0 = qb * GJ_ATTN_BR, br = g->T - i0 < GJ_ATTN_BR ? g->T - i0 : GJ_ATTN_BR;
    int64_t D = g->D, E = g->E;
    GJ_ATTN_A Qt[GJ_ATTN_DMAX * GJ_ATTN_BR], K[GJ_ATTN_BC * GJ_ATTN_DMAX];
    GJ_ATTN_A V[GJ_ATTN_BC * GJ_ATTN_DMAX], O[GJ_ATTN_BR * GJ_ATTN_DMAX];
    GJ_ATTN_A St[GJ_ATTN_BC * GJ_ATTN_BR];
    GJ_ATTN_A mx[GJ_ATTN_BR], mn[GJ_ATTN_BR], al[GJ_ATTN_BR], sum[GJ_ATTN_BR];
    GJ_ATTN_FN(load_t)(Qt, GJ_ATTN_BR, m->q, g->qs, b, h, i0, br, D);
    for (int64_t i = 0; i < GJ_ATTN_BR; i++) {
        /* not a query (i >= br): 0, so its exponentials are exp(-inf) = 0 */
        mx[i] = i < br ? (GJ_ATTN_A)-__builtin_inf() : (GJ_ATTN_A)0;
        sum[i] = 0;
    }
    for (int64_t x = 0; x < br * E; x++)
        O[x] = 0;
    int64_t jend = g->causal ? i0 + br : g->S;
    for (int64_t j0 = 0; j0 < jend; j0 += GJ_ATTN_BC) {
        int64_t bc = g->S - j0 < GJ_ATTN_BC ? g->S - j0 : GJ_ATTN_BC;
        int64_t kld, vld;
        const GJ_ATTN_A *Kr = GJ_ATTN_FN(rows)(K, &kld, m->k, g->ks, b, h, j0, bc, D);
        const GJ_ATTN_A *Vr = GJ_ATTN_FN(rows)(V, &vld, m->v, g->vs, b, h, j0, bc, E);
        /* St = K Q^T, scaled and masked */
        GJ_ATTN_FN(prod)(St, GJ_ATTN_BR, bc, Kr, kld, 1, D, Qt, GJ_ATTN_BR, GJ_ATTN_BR, false);
        GJ_ATTN_FN(scale_mask)(g, St, i0, br, j0, bc);
        /* the running max; every real query sees a key of every block it
         * reaches (blocks start at multiples of 64 <= its index) */
        for (int64_t i = 0; i < GJ_ATTN_BR; i++)
            mn[i] = mx[i];
        for (int64_t j = 0; j < bc; j++)
            for (int64_t i = 0; i < GJ_ATTN_BR; i++)
                mn[i] = St[j * GJ_ATTN_BR + i] > mn[i] ? St[j * GJ_ATTN_BR + i] : mn[i];
        for (int64_t i = 0; i < GJ_ATTN_BR; i++)
            al[i] = mn[i] == mx[i] ? (GJ_ATTN_A)1 : GJ_ATTN_EXP(mx[i] - mn[i]);
        /* Pt = exp(St - max); the sums over keys in order */
        GJ_ATTN_A bs[GJ_ATTN_BR];
        for (int64_t i = 0; i < GJ_ATTN_BR; i++)
            bs[i] = 0;
        for (int64_t j = 0; j < bc; j++)
            for (int64_t i = 0; i < GJ_ATTN_BR; i++) {
                GJ_ATTN_A p = GJ_ATTN_EXP(St[j * GJ_ATTN_BR + i] - mn[i]);
                St[j * GJ_ATTN_BR + i] = p;
                bs[i] += p;
            }
        for (int64_t i = 0; i < GJ_ATTN_BR; i++) {
            sum[i] = GJ_ATTN_FMA(sum[i], al[i], bs[i]);
            mx[i] = mn[i];
        }
        for (int64_t i = 0; i < br; i++)
            for (int64_t e = 0; e < E; e++)
                O[i * E + e] *= al[i];
        if (g->p > 0)
            GJ_ATTN_FN(drop)(g, m, St, 0, 0, b, h, i0, br, j0, bc);
        /* O += P V */
        GJ_ATTN_FN(prod)(O, E, br, St, 1, GJ_ATTN_BR, bc, Vr, vld, E, true);
    }
    GJ_ATTN_T *out = (GJ_ATTN_T *)m->out + ((b * g->H + h) * g->T + i0) * E;
    GJ_ATTN_A *lse = (GJ_ATTN_A *)m->lse + (b * g->H + h) * g->T + i0;
    for (int64_t i = 0; i < br; i++) {
        GJ_ATTN_A inv = (GJ_ATTN_A)1 / sum[i];
        for (int64_t e = 0; e < E; e++)
            out[i * E + e] = GJ_ATTN_ST(O[i * E + e] * inv);
        lse[i] = mx[i] + GJ_ATTN_LOG(sum[i]);
    }
}

/* ------------------------------------------------------------ backward */

/* Unit u of the backward: gq, gk and gv of head (b, h), key blocks in order
 * and, for each, the query blocks that see it in order. ws: the unit's
 * gj_attn_bwd_ws_elems(g) accumulator elements (dQ [T][D]; Q^T and dO^T
 * a block at a time, [T/BR][D][BR] and [T/BR][E][BR]; D_i [T]). */
GJ_ATTN_INLINE void GJ_ATTN_FN(bwd_unit)(const gj_attn_geom *g, const gj_attn_mem *m, int64_t u) {
    int64_t b = u / g->H, h = u % g->H, D = g->D, E = g->E, T = g->T;
    int64_t Tp = (T + GJ_ATTN_BR - 1) / GJ_ATTN_BR * GJ_ATTN_BR; /* columns of the transposes */
    GJ_ATTN_A *gq = (GJ_ATTN_A *)m->ws + u * gj_attn_bwd_ws_elems(g);
    GJ_ATTN_A *Qt = gq + T * D, *dOt = Qt + D * Tp, *Di = dOt + E * Tp;
    const GJ_ATTN_A *lse = (const GJ_ATTN_A *)m->lse_in + (b * g->H + h) * T;
    GJ_ATTN_A Q[GJ_ATTN_BR * GJ_ATTN_DMAX], dO[GJ_ATTN_BR * GJ_ATTN_DMAX];
    GJ_ATTN_A K[GJ_ATTN_BC * GJ_ATTN_DMAX], V[GJ_ATTN_BC * GJ_ATTN_DMAX];
    GJ_ATTN_A dK[GJ_ATTN_BC * GJ_ATTN_DMAX], dV[GJ_ATTN_BC * GJ_ATTN_DMAX];
    GJ_ATTN_A Pt[GJ_ATTN_BC * GJ_ATTN_BR], dPt[GJ_ATTN_BC * GJ_ATTN_BR];
    GJ_ATTN_A Zt[GJ_ATTN_BC * GJ_ATTN_BR], ls[GJ_ATTN_BR], di[GJ_ATTN_BR];
    /* D_i = dO_i . O_i, in 16 lanes and a fixed tree */
    for (int64_t i = 0; i < T; i++) {
        const GJ_ATTN_T *o = (const GJ_ATTN_T *)m->o + b * g->os[0] + h * g->os[1] + i * g->os[2];
        const GJ_ATTN_T *go =
            (const GJ_ATTN_T *)m->go + b * g->gos[0] + h * g->gos[1] + i * g->gos[2];
        GJ_ATTN_A l[16];
        for (int k = 0; k < 16; k++)
            l[k] = 0;
        for (int64_t e = 0; e < E; e++)
            l[e % 16] = GJ_ATTN_FMA(GJ_ATTN_LD(go, e), GJ_ATTN_LD(o, e), l[e % 16]);
        for (int w = 8; w >= 1; w /= 2)
            for (int k = 0; k < w; k++)
                l[k] += l[k + w];
        Di[i] = l[0];
    }
    for (int64_t x = 0; x < T * D; x++)
        gq[x] = 0;
    for (int64_t i0 = 0; i0 < Tp; i0 += GJ_ATTN_BR) { /* the whole head's Q^T and dO^T */
        int64_t br = T - i0 < GJ_ATTN_BR ? T - i0 : GJ_ATTN_BR;
        GJ_ATTN_FN(load_t)(Qt + i0 * D, GJ_ATTN_BR, m->q, g->qs, b, h, i0, br, D);
        GJ_ATTN_FN(load_t)(dOt + i0 * E, GJ_ATTN_BR, m->go, g->gos, b, h, i0, br, E);
    }
    GJ_ATTN_A scale = (GJ_ATTN_A)g->scale;
    for (int64_t j0 = 0; j0 < g->S; j0 += GJ_ATTN_BC) {
        int64_t bc = g->S - j0 < GJ_ATTN_BC ? g->S - j0 : GJ_ATTN_BC;
        int64_t kld, vld, qld, old_;
        const GJ_ATTN_A *Kr = GJ_ATTN_FN(rows)(K, &kld, m->k, g->ks, b, h, j0, bc, D);
        const GJ_ATTN_A *Vr = GJ_ATTN_FN(rows)(V, &vld, m->v, g->vs, b, h, j0, bc, E);
        for (int64_t x = 0; x < bc * D; x++)
            dK[x] = 0;
        for (int64_t x = 0; x < bc * E; x++)
            dV[x] = 0;
        int64_t q0 = g->causal ? j0 / GJ_ATTN_BR * GJ_ATTN_BR : 0;
        for (int64_t i0 = q0; i0 < T; i0 += GJ_ATTN_BR) {
            int64_t br = T - i0 < GJ_ATTN_BR ? T - i0 : GJ_ATTN_BR;
            const GJ_ATTN_A *Qr = GJ_ATTN_FN(rows)(Q, &qld, m->q, g->qs, b, h, i0, br, D);
            const GJ_ATTN_A *dOr = GJ_ATTN_FN(rows)(dO, &old_, m->go, g->gos, b, h, i0, br, E);
            for (int64_t i = 0; i < GJ_ATTN_BR; i++) {
                ls[i] = i < br ? lse[i0 + i] : (GJ_ATTN_A)0;
                di[i] = i < br ? Di[i0 + i] : (GJ_ATTN_A)0;
            }
            /* Pt = exp(scale K Q^T - lse), masked */
            GJ_ATTN_FN(prod)(Pt, GJ_ATTN_BR, bc, Kr, kld, 1, D, Qt + i0 * D, GJ_ATTN_BR, GJ_ATTN_BR,
                             false);
            GJ_ATTN_FN(scale_mask)(g, Pt, i0, br, j0, bc);
            for (int64_t j = 0; j < bc; j++)
                for (int64_t i = 0; i < GJ_ATTN_BR; i++)
                    Pt[j * GJ_ATTN_BR + i] = GJ_ATTN_EXP(Pt[j * GJ_ATTN_BR + i] - ls[i]);
            /* dPt = V dO^T: the gradient of the dropped probabilities */
            GJ_ATTN_FN(prod)(dPt, GJ_ATTN_BR, bc, Vr, vld, 1, E, dOt + i0 * E, GJ_ATTN_BR,
                             GJ_ATTN_BR, false);
            if (g->p > 0) /* Zt = P Z, dPt := dPt Z */
                GJ_ATTN_FN(drop)(g, m, Pt, Zt, dPt, b, h, i0, br, j0, bc);
            /* dV += (P Z)^T dO, or P^T dO */
            GJ_ATTN_FN(prod)(dV, E, bc, g->p > 0 ? Zt : Pt, GJ_ATTN_BR, 1, br, dOr, old_, E, true);
            /* dSt = scale P (dP - D_i), in place of dPt */
            for (int64_t j = 0; j < bc; j++)
                for (int64_t i = 0; i < GJ_ATTN_BR; i++) {
                    int64_t x = j * GJ_ATTN_BR + i;
                    dPt[x] = Pt[x] * (dPt[x] - di[i]) * scale;
                }
            /* dQ_i += dS K_j; dK_j += dS^T Q_i */
            GJ_ATTN_FN(prod)(gq + i0 * D, D, br, dPt, 1, GJ_ATTN_BR, bc, Kr, kld, D, true);
            GJ_ATTN_FN(prod)(dK, D, bc, dPt, GJ_ATTN_BR, 1, br, Qr, qld, D, true);
        }
        GJ_ATTN_T *gk = (GJ_ATTN_T *)m->gk + ((b * g->H + h) * g->S + j0) * D;
        GJ_ATTN_T *gv = (GJ_ATTN_T *)m->gv + ((b * g->H + h) * g->S + j0) * E;
        for (int64_t x = 0; x < bc * D; x++)
            gk[x] = GJ_ATTN_ST(dK[x]);
        for (int64_t x = 0; x < bc * E; x++)
            gv[x] = GJ_ATTN_ST(dV[x]);
    }
    GJ_ATTN_T *out = (GJ_ATTN_T *)m->gq + (b * g->H + h) * T * D;
    for (int64_t x = 0; x < T * D; x++)
        out[x] = GJ_ATTN_ST(gq[x]);
}

#undef GJ_ATTN_FN
#undef GJ_ATTN_CAT
#undef GJ_ATTN_CAT_
#undef GJ_ATTN_T
#undef GJ_ATTN_A
#undef GJ_ATTN_V
#undef GJ_ATTN_VU
#undef GJ_ATTN_SFX
#undef GJ_ATTN_LD
#undef GJ_ATTN_ST
#undef GJ_ATTN_FMA
#undef GJ_ATTN_EXP
#undef GJ_ATTN_LOG
#undef GJ_ATTN_DROP
