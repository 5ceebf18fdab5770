/* SPDX-License-Identifier: MIT */
/*
 * attention_impl.h - one version of attention.h's algorithm, for the
 * element type GJ_ATTN_T accumulated in GJ_ATTN_A (attention.h includes it
 * three times: f32, bf16, f64). Not a header of its own: no include guard.
 *
 * Tiles (accumulator type, row-major, on the stack):
 *   Q [BR][D]    the block's queries          Kt [D][BC]  its keys, transposed
 *   V [BC][E]    its values                   S, P [BR][BC] scores, probabilities
 *   Vt [E][BC]   values transposed (backward)  dO [BR][E]   output gradients
 */
#define GJ_ATTN_CAT_(a, b) a##_##b
#define GJ_ATTN_CAT(a, b) GJ_ATTN_CAT_(a, b)
#define GJ_ATTN_FN(name) GJ_ATTN_CAT(gj_attn_##name, GJ_ATTN_SFX)

typedef GJ_ATTN_A GJ_ATTN_FN(acc_t);

/* rows [i0, i0 + n) of x (strides xs over b, h, t; width w) of head (b, h)
 * into tile[n][w], widened. */
static inline void GJ_ATTN_FN(load_rows)(GJ_ATTN_A *restrict tile, const GJ_ATTN_T *restrict x,
                                         const int64_t *xs, int64_t b, int64_t h, int64_t i0,
                                         int64_t n, int64_t w) {
    for (int64_t i = 0; i < n; i++) {
        const GJ_ATTN_T *row = x + b * xs[0] + h * xs[1] + (i0 + i) * xs[2];
        for (int64_t d = 0; d < w; d++)
            tile[i * w + d] = GJ_ATTN_LD(row, d);
    }
}

/* rows [j0, j0 + n) of x (width w) into tile[w][GJ_ATTN_BC] transposed,
 * columns n.. zero. */
static inline void GJ_ATTN_FN(load_cols)(GJ_ATTN_A *restrict tile, const GJ_ATTN_T *restrict x,
                                         const int64_t *xs, int64_t b, int64_t h, int64_t j0,
                                         int64_t n, int64_t w) {
    for (int64_t j = 0; j < GJ_ATTN_BC; j++) {
        const GJ_ATTN_T *row = x + b * xs[0] + h * xs[1] + (j0 + j) * xs[2];
        for (int64_t d = 0; d < w; d++)
            tile[d * GJ_ATTN_BC + j] = j < n ? GJ_ATTN_LD(row, d) : (GJ_ATTN_A)0;
    }
}

/* S[i][j] = sum_d A[i][d] Bt[d][j] over d ascending (fused multiply-adds
 * from 0), for i < n and every j < GJ_ATTN_BC. */
static inline void GJ_ATTN_FN(dots)(GJ_ATTN_A *restrict S, const GJ_ATTN_A *restrict A,
                                    int64_t n, const GJ_ATTN_A *restrict Bt, int64_t w) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        GJ_ATTN_A s0[GJ_ATTN_BC], s1[GJ_ATTN_BC], s2[GJ_ATTN_BC], s3[GJ_ATTN_BC];
        for (int j = 0; j < GJ_ATTN_BC; j++)
            s0[j] = s1[j] = s2[j] = s3[j] = 0;
        for (int64_t d = 0; d < w; d++) {
            const GJ_ATTN_A *bt = Bt + d * GJ_ATTN_BC;
            GJ_ATTN_A a0 = A[i * w + d], a1 = A[(i + 1) * w + d], a2 = A[(i + 2) * w + d],
                      a3 = A[(i + 3) * w + d];
            for (int j = 0; j < GJ_ATTN_BC; j++) {
                s0[j] = GJ_ATTN_FMA(a0, bt[j], s0[j]);
                s1[j] = GJ_ATTN_FMA(a1, bt[j], s1[j]);
                s2[j] = GJ_ATTN_FMA(a2, bt[j], s2[j]);
                s3[j] = GJ_ATTN_FMA(a3, bt[j], s3[j]);
            }
        }
        for (int j = 0; j < GJ_ATTN_BC; j++) {
            S[i * GJ_ATTN_BC + j] = s0[j];
            S[(i + 1) * GJ_ATTN_BC + j] = s1[j];
            S[(i + 2) * GJ_ATTN_BC + j] = s2[j];
            S[(i + 3) * GJ_ATTN_BC + j] = s3[j];
        }
    }
    for (; i < n; i++) {
        GJ_ATTN_A s0[GJ_ATTN_BC];
        for (int j = 0; j < GJ_ATTN_BC; j++)
            s0[j] = 0;
        for (int64_t d = 0; d < w; d++) {
            const GJ_ATTN_A *bt = Bt + d * GJ_ATTN_BC;
            GJ_ATTN_A a0 = A[i * w + d];
            for (int j = 0; j < GJ_ATTN_BC; j++)
                s0[j] = GJ_ATTN_FMA(a0, bt[j], s0[j]);
        }
        for (int j = 0; j < GJ_ATTN_BC; j++)
            S[i * GJ_ATTN_BC + j] = s0[j];
    }
}

/* C[r][e] += sum_j W[r][j] X[j][e] over j < nj ascending, for rows r < n
 * of C (width w): the products P V, dS K (W a [n][BC] tile, X [nj][w]). */
static inline void GJ_ATTN_FN(mix)(GJ_ATTN_A *restrict C, const GJ_ATTN_A *restrict W,
                                   int64_t n, const GJ_ATTN_A *restrict X, int64_t nj,
                                   int64_t w) {
    for (int64_t r = 0; r < n; r++) {
        GJ_ATTN_A *c = C + r * w;
        const GJ_ATTN_A *wr = W + r * GJ_ATTN_BC;
        for (int64_t j = 0; j < nj; j++) {
            GJ_ATTN_A s = wr[j];
            const GJ_ATTN_A *x = X + j * w;
            for (int64_t e = 0; e < w; e++)
                c[e] = GJ_ATTN_FMA(s, x[e], c[e]);
        }
    }
}

/* C[j][e] += sum_i W[i][j] X[i][e] over i < ni ascending, for rows j < nj
 * of C (width w): the products P^T dO, dS^T Q (W a [ni][BC] tile). */
static inline void GJ_ATTN_FN(mix_t)(GJ_ATTN_A *restrict C, const GJ_ATTN_A *restrict W,
                                     int64_t ni, const GJ_ATTN_A *restrict X, int64_t nj,
                                     int64_t w) {
    for (int64_t i = 0; i < ni; i++) {
        const GJ_ATTN_A *x = X + i * w;
        const GJ_ATTN_A *wr = W + i * GJ_ATTN_BC;
        for (int64_t j = 0; j < nj; j++) {
            GJ_ATTN_A s = wr[j];
            GJ_ATTN_A *c = C + j * w;
            for (int64_t e = 0; e < w; e++)
                c[e] = GJ_ATTN_FMA(s, x[e], c[e]);
        }
    }
}

/* The sum of p[0..GJ_ATTN_BC) in 16 lanes and a fixed tree. */
static inline GJ_ATTN_A GJ_ATTN_FN(row_sum)(const GJ_ATTN_A *restrict p) {
    GJ_ATTN_A l[16];
    for (int k = 0; k < 16; k++)
        l[k] = p[k];
    for (int j = 16; j < GJ_ATTN_BC; j += 16)
        for (int k = 0; k < 16; k++)
            l[k] += p[j + k];
    for (int w = 8; w >= 1; w /= 2)
        for (int k = 0; k < w; k++)
            l[k] += l[k + w];
    return l[0];
}

/* The last key of block j0 query i sees (exclusive): n, or i + 1 - j0. */
static inline int64_t GJ_ATTN_FN(seen)(const gj_attn_geom *g, int64_t i, int64_t j0, int64_t n) {
    if (!g->causal)
        return n;
    int64_t lim = i + 1 - j0;
    return lim < 0 ? 0 : lim < n ? lim : n;
}

/* S := scale S, masked keys (j >= the keys seen, or beyond the block) -inf. */
static inline void GJ_ATTN_FN(scale_mask)(const gj_attn_geom *g, GJ_ATTN_A *restrict S,
                                          int64_t i0, int64_t br, int64_t j0, int64_t bc) {
    GJ_ATTN_A scale = (GJ_ATTN_A)g->scale, ninf = (GJ_ATTN_A)-__builtin_inf();
    for (int64_t i = 0; i < br; i++) {
        int64_t lim = GJ_ATTN_FN(seen)(g, i0 + i, j0, bc);
        GJ_ATTN_A *s = S + i * GJ_ATTN_BC;
        for (int64_t j = 0; j < GJ_ATTN_BC; j++)
            s[j] = j < lim ? s[j] * scale : ninf;
    }
}

/* P := P * dropout scale of (b, h, i, j) (masked entries are 0 already). */
static inline void GJ_ATTN_FN(drop)(const gj_attn_geom *g, const gj_attn_mem *m,
                                    GJ_ATTN_A *restrict P, int64_t b, int64_t h, int64_t i0,
                                    int64_t br, int64_t j0, int64_t bc) {
    for (int64_t i = 0; i < br; i++) {
        uint64_t base = m->offset + (uint64_t)(((b * g->H + h) * g->T + i0 + i) * g->S + j0);
        for (int64_t j = 0; j < bc; j++)
            P[i * GJ_ATTN_BC + j] *= GJ_ATTN_DROP(m->seed, base + (uint64_t)j, (GJ_ATTN_A)g->p);
    }
}

/* ------------------------------------------------------------- forward */

/* Unit u of the forward: the output rows and log-sum-exps of one block of
 * queries of one head. */
static inline void GJ_ATTN_FN(fwd_unit)(const gj_attn_geom *g, const gj_attn_mem *m, int64_t u) {
    int64_t nqb = (g->T + GJ_ATTN_BR - 1) / GJ_ATTN_BR;
    int64_t qb = u % nqb, bh = u / nqb, b = bh / g->H, h = bh % g->H;
    int64_t i0 = qb * GJ_ATTN_BR, br = g->T - i0 < GJ_ATTN_BR ? g->T - i0 : GJ_ATTN_BR;
    int64_t D = g->D, E = g->E;
    GJ_ATTN_A Q[GJ_ATTN_BR * GJ_ATTN_DMAX], Kt[GJ_ATTN_DMAX * GJ_ATTN_BC];
    GJ_ATTN_A V[GJ_ATTN_BC * GJ_ATTN_DMAX], O[GJ_ATTN_BR * GJ_ATTN_DMAX];
    GJ_ATTN_A S[GJ_ATTN_BR * GJ_ATTN_BC], mx[GJ_ATTN_BR], sum[GJ_ATTN_BR];
    GJ_ATTN_FN(load_rows)(Q, m->q, g->qs, b, h, i0, br, D);
    for (int64_t i = 0; i < br; i++) {
        mx[i] = (GJ_ATTN_A)-__builtin_inf();
        sum[i] = 0;
        for (int64_t e = 0; e < E; e++)
            O[i * E + e] = 0;
    }
    int64_t jend = g->causal ? i0 + br : g->S;
    for (int64_t j0 = 0; j0 < jend; j0 += GJ_ATTN_BC) {
        int64_t bc = g->S - j0 < GJ_ATTN_BC ? g->S - j0 : GJ_ATTN_BC;
        GJ_ATTN_FN(load_cols)(Kt, m->k, g->ks, b, h, j0, bc, D);
        GJ_ATTN_FN(load_rows)(V, m->v, g->vs, b, h, j0, bc, E);
        GJ_ATTN_FN(dots)(S, Q, br, Kt, D);
        GJ_ATTN_FN(scale_mask)(g, S, i0, br, j0, bc);
        for (int64_t i = 0; i < br; i++) {
            GJ_ATTN_A *s = S + i * GJ_ATTN_BC, bm = mx[i];
            for (int j = 0; j < GJ_ATTN_BC; j++)
                bm = s[j] > bm ? s[j] : bm;
            /* a row that sees no key of this block keeps its state */
            GJ_ATTN_A alpha = bm == mx[i] ? (GJ_ATTN_A)1 : GJ_ATTN_EXP(mx[i] - bm);
            for (int j = 0; j < GJ_ATTN_BC; j++)
                s[j] = GJ_ATTN_EXP(s[j] - bm);
            sum[i] = GJ_ATTN_FMA(sum[i], alpha, GJ_ATTN_FN(row_sum)(s));
            mx[i] = bm;
            for (int64_t e = 0; e < E; e++)
                O[i * E + e] *= alpha;
        }
        if (g->p > 0)
            GJ_ATTN_FN(drop)(g, m, S, b, h, i0, br, j0, bc);
        GJ_ATTN_FN(mix)(O, S, br, V, bc, E);
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

/* Unit u of the backward: gq, gk and gv of head (b, h). ws: the unit's
 * gj_attn_bwd_ws_elems(g) accumulator elements. */
static inline void GJ_ATTN_FN(bwd_unit)(const gj_attn_geom *g, const gj_attn_mem *m, int64_t u) {
    int64_t b = u / g->H, h = u % g->H, D = g->D, E = g->E, T = g->T;
    GJ_ATTN_A *gq = (GJ_ATTN_A *)m->ws + u * gj_attn_bwd_ws_elems(g); /* [T][D] */
    GJ_ATTN_A *Di = gq + T * D;                                          /* [T] */
    const GJ_ATTN_A *lse = (const GJ_ATTN_A *)m->lse_in + (b * g->H + h) * T;
    GJ_ATTN_A Q[GJ_ATTN_BR * GJ_ATTN_DMAX], dO[GJ_ATTN_BR * GJ_ATTN_DMAX];
    GJ_ATTN_A K[GJ_ATTN_BC * GJ_ATTN_DMAX], Kt[GJ_ATTN_DMAX * GJ_ATTN_BC];
    GJ_ATTN_A Vt[GJ_ATTN_DMAX * GJ_ATTN_BC];
    GJ_ATTN_A dK[GJ_ATTN_BC * GJ_ATTN_DMAX], dV[GJ_ATTN_BC * GJ_ATTN_DMAX];
    GJ_ATTN_A P[GJ_ATTN_BR * GJ_ATTN_BC], dP[GJ_ATTN_BR * GJ_ATTN_BC], Z[GJ_ATTN_BR * GJ_ATTN_BC];
    /* D_i = dO_i . O_i, in 16 lanes and a fixed tree (as row_sum) */
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
        for (int64_t d = 0; d < D; d++)
            gq[i * D + d] = 0;
    }
    GJ_ATTN_A scale = (GJ_ATTN_A)g->scale;
    for (int64_t j0 = 0; j0 < g->S; j0 += GJ_ATTN_BC) {
        int64_t bc = g->S - j0 < GJ_ATTN_BC ? g->S - j0 : GJ_ATTN_BC;
        GJ_ATTN_FN(load_rows)(K, m->k, g->ks, b, h, j0, bc, D);
        GJ_ATTN_FN(load_cols)(Kt, m->k, g->ks, b, h, j0, bc, D);
        GJ_ATTN_FN(load_cols)(Vt, m->v, g->vs, b, h, j0, bc, E);
        for (int64_t x = 0; x < bc * D; x++)
            dK[x] = 0;
        for (int64_t x = 0; x < bc * E; x++)
            dV[x] = 0;
        int64_t q0 = g->causal ? j0 / GJ_ATTN_BR * GJ_ATTN_BR : 0;
        for (int64_t i0 = q0; i0 < T; i0 += GJ_ATTN_BR) {
            int64_t br = T - i0 < GJ_ATTN_BR ? T - i0 : GJ_ATTN_BR;
            GJ_ATTN_FN(load_rows)(Q, m->q, g->qs, b, h, i0, br, D);
            GJ_ATTN_FN(load_rows)(dO, m->go, g->gos, b, h, i0, br, E);
            GJ_ATTN_FN(dots)(P, Q, br, Kt, D);
            GJ_ATTN_FN(scale_mask)(g, P, i0, br, j0, bc);
            for (int64_t i = 0; i < br; i++)
                for (int j = 0; j < GJ_ATTN_BC; j++)
                    P[i * GJ_ATTN_BC + j] = GJ_ATTN_EXP(P[i * GJ_ATTN_BC + j] - lse[i0 + i]);
            GJ_ATTN_FN(dots)(dP, dO, br, Vt, E); /* dO V^T: the dropped P's gradient */
            if (g->p > 0) { /* Z: the mask; dV from P Z, dP := dP Z */
                for (int64_t i = 0; i < br; i++) {
                    uint64_t base =
                        m->offset + (uint64_t)(((b * g->H + h) * T + i0 + i) * g->S + j0);
                    for (int64_t j = 0; j < GJ_ATTN_BC; j++) {
                        GJ_ATTN_A z = j < bc ? GJ_ATTN_DROP(m->seed, base + (uint64_t)j,
                                                            (GJ_ATTN_A)g->p)
                                             : (GJ_ATTN_A)0;
                        dP[i * GJ_ATTN_BC + j] *= z;
                        Z[i * GJ_ATTN_BC + j] = P[i * GJ_ATTN_BC + j] * z;
                    }
                }
                GJ_ATTN_FN(mix_t)(dV, Z, br, dO, bc, E);
            } else {
                GJ_ATTN_FN(mix_t)(dV, P, br, dO, bc, E);
            }
            for (int64_t i = 0; i < br; i++)
                for (int j = 0; j < GJ_ATTN_BC; j++) {
                    GJ_ATTN_A *ds = &dP[i * GJ_ATTN_BC + j];
                    *ds = P[i * GJ_ATTN_BC + j] * (*ds - Di[i0 + i]) * scale;
                }
            GJ_ATTN_FN(mix)(gq + i0 * D, dP, br, K, bc, D);
            GJ_ATTN_FN(mix_t)(dK, dP, br, Q, bc, D);
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
#undef GJ_ATTN_SFX
#undef GJ_ATTN_LD
#undef GJ_ATTN_ST
#undef GJ_ATTN_FMA
#undef GJ_ATTN_EXP
#undef GJ_ATTN_LOG
#undef GJ_ATTN_DROP
