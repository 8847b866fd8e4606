/* Causal GQA attention over a ragged KV cache, flash style.
 *
 * Query i (of the n in this call; row i of q, stride ldq, head hq at column hq d) of query head hq
 * reads KV head h = hq / (H / Hkv), whose keys
 * k[h] and values v[h] are [past_len[h] + n, d]; it sees the first past_len[h] + i + 1 rows, from row
 * start[i, h] on when a sliding window gives start (i64 [n, Hkv], nondecreasing in i):
 *   out[i, hq] = softmax_j(cap(scale * q[i, hq] . k[h][j])) v[h][j]   over the visible j
 * (cap: kvc_softcap, Gemma 2's soft-capping; the identity without one).
 * Keys are visited in tiles with an online softmax (running max m and sum l per query row; when the
 * max grows, the earlier sum and output are rescaled by exp(m_old - m_new)), so memory is O(tile)
 * per thread and no n x n score matrix ever exists.
 *
 * Prefill (many queries): a task is (KV head, a group of its query heads, a tile of queries); its
 * rows (query, head) share every key and value tile, which is loaded once for all of them. Scores
 * and the update P V both run on the GEMM microkernel, with the scores stored keys x rows: K is read
 * in place as the microkernel's broadcast rows against the task's queries transposed once (rows are
 * lanes), the softmax runs down the columns with no horizontal reductions, and P V reads P
 * transposed. (Rows x keys needed every K tile transposed by every task that read it: 8192-token
 * attention of SmolLM2's 9 heads, 2 Zen 3 cores, 811 -> 704 ms with the same microkernel.)
 * Decode (n <= DECODE_N queries): a KV head has only n * g rows, so its keys are split into chunks
 * processed in parallel (each with its own m, l and partial output), then merged: with 3 KV heads
 * on 2 cores, or one long sequence, the heads alone would leave cores idle. There the scores are dot
 * products over d, 4 keys at a time (transposing a K tile would cost as much as the few rows' work),
 * and P V loads each value row once for all rows. Decode reads the whole cache from memory for little
 * arithmetic: keys are prefetched ahead and a tile's values during its scores (2x at 600 keys).
 * Scratch lives on the stack (about 150 KB per thread at d = 256) except the decode partials (kept per
 * calling thread, grown as needed).
 * ThinK-pruned rows (kvc_cpu_kvsrc's narrow rows): the first np[h] keys of a head hold dk channels; their
 * tiles score the query's kept channels (Qp) against them, the later tiles the whole query against full
 * keys, inside the same online softmax (exact: the dropped channels of a pruned key are zeros).
 * Rows come a tile at a time from the source (cpu.h, kvc_cpu_kvsrc): an f32 store's in place, any other
 * type's decoded into the task's tile buffers, so a quantised cache is read in its own bytes (the decode
 * streams a quarter of the f32 cache's bytes at 8 bits). */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/backend.h"
#include "cpu.h"
#include "kv_decode.h"
#include "kv_simd.h"
#include "weight_hint.h"

#define TK 128       /* keys per decode tile */
#define DTK 64       /* the same for rows decoded from a store's type: their K and V tiles stay in L1 */
#define PTK (KVC_MR * (128 / KVC_MR)) /* keys per prefill tile: whole microkernel panels (126 on AVX2) */
#define ROWS_MAX 128 /* query rows per prefill task */
/* Row stride of a prefill task's transposed arrays (QT, S) for rp rows: padded, because 128 floats
 * (512 bytes) would put a column's values in 8 of the 64 sets of a 32 KB L1 (the P V update, which reads
 * a column per key, ran 30% slower) */
#define LPAD (KVC_NR / 2)
#define LS(rp) ((rp) + LPAD)
#define QBUF 8192    /* floats of the per-task Q and O buffers: rows x d <= QBUF */
#define DMAX 256     /* head_dim limit (checked by kvc_kernel_attention) */
#define DECODE_N 4   /* up to this many queries: the split-keys decode path */
#define CHUNK_MIN 256 /* fewest keys per decode chunk */
#define PF_KEYS 32    /* decode: keys loaded this far ahead of the scores */

/* ---------------------------------------------------------------------------------------------- */
/* One online-softmax step for `rows` rows on a tile of `tk` keys.                                */
/* S[r][0:tk] holds the scaled scores (masked ones -inf); on return it holds P = exp(S - m_new).  */
/* O rows are rescaled by exp(m_old - m_new); l and m are updated.                                */
/* In phases over the rows (all maxima, then all exponentials, then the corrections of all rows in */
/* one vector exp on AVX-512): a row's max -> exp -> sum -> correction chain is long in latency    */
/* and short in work, and done a row at a time (with a scalar expf each) the rows of a decode tile */
/* ran one after another (~480 cycles for 3 rows x 64 keys).                                      */
static void softmax_step(float *S, int rows, int tk, float *m, float *l, float *O, int d) {
    float mx[ROWS_MAX], sum[ROWS_MAX], corr[ROWS_MAX];
    for (int r = 0; r < rows; r++) {
        const float *s = S + r * TK;
        float x = m[r];
#pragma omp simd reduction(max : x)
        for (int j = 0; j < tk; j++) x = s[j] > x ? s[j] : x;
        mx[r] = x;
    }
    for (int r = 0; r < rows; r++) {
        float *s = S + r * TK;
        const float x = mx[r];
        sum[r] = 0.f;
        if (x == -INFINITY) { /* nothing visible yet in this row */
            memset(s, 0, sizeof(float) * tk);
            continue;
        }
#if defined(__AVX512F__)
        const __m512 vmx = _mm512_set1_ps(x);
        __m512 vsum = _mm512_setzero_ps();
        for (int j = 0; j < tk; j += 16) {
            const __mmask16 mk = (__mmask16)(tk - j >= 16 ? 0xFFFF : (1u << (tk - j)) - 1);
            const __m512 p = kvc_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), vmx));
            _mm512_mask_storeu_ps(s + j, mk, p);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mk, p));
        }
        sum[r] = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 vmx = _mm256_set1_ps(x);
        __m256 vsum = _mm256_setzero_ps();
        float t = 0.f;
        int j = 0;
        for (; j + 8 <= tk; j += 8) {
            const __m256 p = kvc_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
            _mm256_storeu_ps(s + j, p);
            vsum = _mm256_add_ps(vsum, p);
        }
        for (; j < tk; j++) {
            s[j] = s[j] - x < -87.3f ? 0.f : expf(s[j] - x);
            t += s[j];
        }
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sum[r] = t + _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
        float t = 0.f;
        for (int j = 0; j < tk; j++) s[j] -= x;
        kvc_vexp(s, s, tk);
#pragma omp simd reduction(+ : t)
        for (int j = 0; j < tk; j++) t += s[j];
        sum[r] = t;
#endif
    }
#if defined(__AVX512F__)
    for (int r0 = 0; r0 < rows; r0 += 16) { /* exp(m_old - m_new); 0 where m_old is -inf (below exp's range) */
        const __mmask16 mk = (__mmask16)(rows - r0 >= 16 ? 0xFFFF : (1u << (rows - r0)) - 1);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, m + r0), _mm512_maskz_loadu_ps(mk, mx + r0));
        _mm512_mask_storeu_ps(corr + r0, mk, kvc_exp512(x));
    }
#else
    for (int r = 0; r < rows; r++) corr[r] = m[r] == -INFINITY || mx[r] == -INFINITY ? 0.f : expf(m[r] - mx[r]);
#endif
    for (int r = 0; r < rows; r++) {
        if (mx[r] == -INFINITY) continue; /* (its correction is NaN: -inf - -inf) */
        const float c = corr[r];
        if (c != 1.f) {
            float *o = O + r * d;
#pragma omp simd
            for (int e = 0; e < d; e++) o[e] *= c;
        }
        l[r] = l[r] * c + sum[r];
        m[r] = mx[r];
    }
}

/* O[rows][d] += P[rows][tk] V[tk][d] for few rows (decode): each V row loaded once for all rows, O in
 * registers, NR (1..4, a constant: the accumulators stay in registers) rows x 4 vectors of columns at a time
 * (the microkernel would broadcast P and reload V per vector of columns). Written once for AVX-512 and AVX2
 * (cpu.h's vf); on AVX2 the microkernel's panels had cost the f32 cache's decode step at 8k tokens 45% of its
 * time (Zen 2; with scores_dot's AVX2 path the step went 15.5 -> 20.1 tok/s). MASKED: the 4 vectors reach past d (masked loads, slow on AVX2, only then). */
#if defined(KVC_KV_SIMD)
static inline __attribute__((always_inline)) void pv_tile(const int MASKED, const float *P, const int NR, int tk,
                                                          const float *V, int64_t ldv, int d, int e0, float *O) {
    vmask mk[4];
    vf o[4][4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) mk[c] = V_MASK(d - e0 - VL * c);
#define PV_LOAD(p, c) (MASKED ? V_LOADM(p, mk[c]) : V_LOAD(p))
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) o[r][c] = PV_LOAD(O + r * d + e0 + VL * c, c);
    for (int j = 0; j < tk; j++) {
        const float *v = V + (int64_t)j * ldv + e0;
        vf x[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) x[c] = PV_LOAD(v + VL * c, c);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const vf p = V_BCAST(P + r * TK + j);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) o[r][c] = V_FMA(p, x[c], o[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            if (MASKED) V_STOREM(O + r * d + e0 + VL * c, mk[c], o[r][c]);
            else V_STORE(O + r * d + e0 + VL * c, o[r][c]);
        }
#undef PV_LOAD
}
#endif

static void update_pv_rows(const float *P, int rows, int tk, const float *V, int64_t ldv, int d, float *O) {
#if defined(KVC_KV_SIMD)
    for (int r0 = 0; r0 < rows; r0 += 4)
        for (int e0 = 0; e0 < d; e0 += 4 * VL) {
            const int nr = rows - r0 < 4 ? rows - r0 : 4;
            const float *p = P + r0 * TK;
            float *o = O + r0 * d;
            if (d - e0 >= 4 * VL) {
#define PV(NR) pv_tile(0, p, NR, tk, V, ldv, d, e0, o)
                KVC_NR_CASES(PV)
#undef PV
            } else {
#define PV(NR) pv_tile(1, p, NR, tk, V, ldv, d, e0, o)
                KVC_NR_CASES(PV)
#undef PV
            }
        }
#else /* the microkernel, O in registers over the keys */
    for (int r0 = 0; r0 < rows; r0 += KVC_MR) {
        const int mr = rows - r0 < KVC_MR ? rows - r0 : KVC_MR;
        for (int e0 = 0; e0 < d; e0 += KVC_NR) {
            const int nr = d - e0 < KVC_NR ? d - e0 : KVC_NR;
            kvc_cpu_ukr(mr, nr, tk, P + r0 * TK, TK, V + e0, ldv, O + r0 * d + e0, d, 1);
        }
    }
#endif
}

/* S[r][j] = Q[r] . K[j] for r < rows, j < tk, as dot products over d (for few rows, where
 * transposing the K tile would cost as much as the products). 4 keys at a time, whose 4 accumulators are
 * reduced together (kvc_kv_sum4: one horizontal reduction per 4 scores); a tile's last 1-3 keys too (the first
 * of them standing in for the missing ones, whose sums are dropped), so every score has the order of the typed
 * stores' decode step (kv_rows_step.c) whatever the tiling. Written once for AVX-512 and AVX2: on AVX2 the
 * plain loop a score had cost the f32 cache's decode step at 8k tokens 39% of its time (Zen 2). */
static void scores_dot(const float *Q, int rows, int d, const float *K, int64_t ldk, int tk, const float *V, int64_t ldv,
                       int stream, float *S) {
    int j = 0;
#if defined(KVC_KV_SIMD)
    const int dfull = d / VL * VL;
    const vmask tail = V_MASK(d - dfull);
    for (; j < tk; j += 4) {
        const int nk = tk - j < 4 ? tk - j : 4;
        const float *k0 = K + j * ldk, *k1 = nk > 1 ? k0 + ldk : k0, *k2 = nk > 2 ? k0 + 2 * ldk : k0;
        const float *k3 = nk > 3 ? k0 + 3 * ldk : k0;
        /* K and V in the store (stream): the cache streams from memory: fetch keys PF_KEYS ahead and this
         * tile's values for the update (decoded tiles are in cache: their decoders fetch the stored rows), a
         * line of each in turn from the row's start (rows end to end, so a row's last line is the next one's
         * first). Other forms of the same prefetches made the f32 step at 8k tokens ~15% slower on an AVX-512
         * host, for no known reason, while the attention alone measured them the same (METHODS "Later (stop
         * 45)"): change this loop only against the step (benchmarks/kv_cache_types.py). */
        for (int k = 0; stream && k < 4; k++)
            for (int e = 0; e < d; e += 16) {
                __builtin_prefetch(K + (j + PF_KEYS + k) * ldk + e, 0, 3);
                __builtin_prefetch(V + (j + k) * ldv + e, 0, 3);
            }
        for (int r = 0; r < rows; r++) {
            const float *q = Q + r * d;
            vf a0 = V_ZERO(), a1 = a0, a2 = a0, a3 = a0;
            for (int e = 0; e < dfull; e += VL) {
                const vf x = V_LOAD(q + e);
                a0 = V_FMA(x, V_LOAD(k0 + e), a0);
                a1 = V_FMA(x, V_LOAD(k1 + e), a1);
                a2 = V_FMA(x, V_LOAD(k2 + e), a2);
                a3 = V_FMA(x, V_LOAD(k3 + e), a3);
            }
            if (d > dfull) {
                const vf x = V_LOADM(q + dfull, tail);
                a0 = V_FMA(x, V_LOADM(k0 + dfull, tail), a0);
                a1 = V_FMA(x, V_LOADM(k1 + dfull, tail), a1);
                a2 = V_FMA(x, V_LOADM(k2 + dfull, tail), a2);
                a3 = V_FMA(x, V_LOADM(k3 + dfull, tail), a3);
            }
            kvc_kv_store4(S + r * TK + j, kvc_kv_sum4(a0, a1, a2, a3), nk);
        }
    }
#endif
    for (; j < tk; j++) {
        const float *kr = K + j * ldk;
        for (int r = 0; r < rows; r++) {
            const float *qr = Q + r * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int e = 0; e < d; e++) s += qr[e] * kr[e];
            S[r * TK + j] = s;
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Masks, pruned keys and query gathering, for both layouts of a task's scores.                   */

/* Soft-capping of a tile's scaled scores, entry (r, j) at S[r rs + j js] (before the mask). */
static void cap_tile(float *S, int64_t rs, int64_t js, int rows, int tk, float cap) {
    if (cap > 0)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < tk; j++) S[r * rs + j * js] = kvc_softcap(S[r * rs + j * js], cap);
}

/* Scores of `rows` rows (row r: query i0 + r / gc) on the tile of keys [k0, k0 + tk), entry (r, j) at
 * S[r rs + j js]: -inf where key k0 + j is past the row's query (causal) or below its window start
 * (lo: the head's column of start [n, Hkv], else NULL). */
static void mask_tile(float *S, int64_t rs, int64_t js, int rows, int gc, int64_t i0, int64_t past, const int64_t *lo,
                      int32_t Hkv, int64_t k0, int tk) {
    if (k0 + tk > past + i0 + 1) /* the tile reaches past the first row's last visible key */
        for (int r = 0; r < rows; r++) {
            const int64_t vis = past + i0 + r / gc + 1 - k0; /* visible keys of this tile */
            for (int64_t j = vis < 0 ? 0 : vis; j < tk; j++) S[r * rs + j * js] = -INFINITY;
        }
    if (lo && k0 < lo[(i0 + (rows - 1) / gc) * Hkv]) /* below the last row's window start */
        for (int r = 0; r < rows; r++) {
            const int64_t below = lo[(i0 + r / gc) * Hkv] - k0; /* keys of this tile out of the window */
            for (int64_t j = 0; j < below && j < tk; j++) S[r * rs + j * js] = -INFINITY;
        }
}

/* Pruned keys: keys [0, np) hold dk channels, scored with the rows' kept channels Qp. */
typedef struct pruned_keys {
    const float *Qp;
    int dk;
    int64_t np;
} pruned_keys;

/* The pruned-key view of head h for `rows` scaled queries Q: by rows [rows, d] when rp == 0, else
 * transposed [d, rp]; Qp gets their kept channels in the same layout ([rows, dk] or [dk, rp]). */
static const pruned_keys *prune_view(const kvc_cpu_kvsrc *kv, int32_t h, const float *Q, int rows, int d, int rp,
                                     float *Qp, pruned_keys *pk) {
    const int64_t np = kv->narrow ? kv->narrow(kv->src, h) : 0;
    if (np == 0) return NULL;
    const int32_t *ix = kv->kidx + (size_t)h * kv->dk;
    if (rp == 0) {
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < kv->dk; j++) Qp[r * kv->dk + j] = Q[r * d + ix[j]];
    } else {
        for (int j = 0; j < kv->dk; j++) memcpy(Qp + (size_t)j * LS(rp), Q + (size_t)ix[j] * LS(rp), sizeof(float) * rp);
    }
    pk->Qp = Qp;
    pk->dk = kv->dk;
    pk->np = np;
    return pk;
}

/* `rows` query rows (row r = query i0 + r / gc, head hq0 + r % gc), times scale: into Q [rows, d] when
 * rp == 0, else transposed into Q [d, rp] with the rows rows..rp-1 zero. */
static void gather_q(const float *q, int64_t ldq, int32_t d, int32_t hq0, int32_t gc, int64_t i0, int rows, int rp,
                     float scale, float *Q) {
    for (int r = 0; r < rows; r++) {
        const float *src = q + (i0 + r / gc) * ldq + (int64_t)(hq0 + r % gc) * d;
        if (rp == 0)
            for (int e = 0; e < d; e++) Q[r * d + e] = src[e] * scale;
        else
            for (int e = 0; e < d; e++) Q[e * LS(rp) + r] = src[e] * scale;
    }
    for (int e = 0; rp && e < d; e++) memset(Q + e * LS(rp) + rows, 0, sizeof(float) * (rp - rows));
}

/* ---------------------------------------------------------------------------------------------- */
/* Decode: the rows of one task against the keys [kb, ke) of their KV head, scores by rows S[r][j]. */
/* Q[rows][d] holds the queries already multiplied by `scale`; row r is query i0 + r / gc, which  */
/* sees the keys < past + i0 + r / gc + 1, and >= lo[(i0 + r / gc) * Hkv] with a window (lo: the  */
/* head's column of start, else NULL). Accumulates into O[rows][d], m[rows], l[rows].             */
static void attend_dot(const float *Q, int rows, int gc, int64_t i0, int d, const kvc_cpu_kvsrc *kv, int32_t h,
                       const pruned_keys *pk, int64_t past, const int64_t *lo, int32_t Hkv, int64_t kb, int64_t ke,
                       float cap, float *O, float *m, float *l, kvc_cpu_hint_cursor *next) {
    float S[ROWS_MAX * TK], Kb[TK * d], Vb[TK * d];
    kvc_kv_query qc; /* Q as the typed tiles' scores take it, prepared on the first (kv_decode.h) */
    kvc_kv_query_reset(&qc);
    const int64_t np = pk ? pk->np : 0;
    const int dtk = kv->decoded ? DTK : TK;
    if (lo && kb < lo[i0 * Hkv]) kb = lo[i0 * Hkv]; /* nothing below the first query's window start */
    for (int64_t k0 = kb; k0 < ke;) {
        const int64_t end = k0 < np && np < ke ? np : ke; /* a tile never straddles the pruned prefix's end */
        const int pruned = k0 < np, ds = pruned ? pk->dk : d;
        int tk = (int)(end - k0 < dtk ? end - k0 : dtk);
        kvc_kv_tile tile;
        const int64_t typed = kv->tile && !pruned ? kv->tile(kv->src, h, k0, tk, &tile) : 0;
        const float *V = NULL;
        int64_t ldk, ldv;
        if (typed > 0) { /* rows in the stored type, read where they lie */
            tk = (int)typed;
            kvc_cpu_kv_scores(&tile, Q, rows, tk, S, TK, &qc);
        } else {
            const float *K = kv->keys(kv->src, h, k0, tk, Kb, &ldk);
            V = kv->values(kv->src, h, k0, tk, Vb, &ldv);
            scores_dot(pruned ? pk->Qp : Q, rows, ds, K, ldk, tk, V, ldv, !kv->decoded, S);
        }
        cap_tile(S, TK, 1, rows, tk, cap);
        mask_tile(S, TK, 1, rows, gc, i0, past, lo, Hkv, k0, tk);
        softmax_step(S, rows, tk, m, l, O, d);
        if (typed > 0) {
            if (kvc_cpu_kv_step_spare(tile.f->type)) kvc_cpu_hint_fetch(next); /* memory has room for the next weights */
            kvc_cpu_kv_pv(&tile, S, TK, rows, tk, O);
        } else
            update_pv_rows(S, rows, tk, V, ldv, d, O);
        k0 += tk;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Prefill: the rows of one task against all the keys below ke, scores stored keys x rows.        */
/* Each tile's scores S[j][r] = K[j] . Q[r] run on the microkernel with keys as its broadcast rows */
/* and query rows as its lanes: K is read in place (no transposed copy of every tile per task) and */
/* the queries are transposed once per task (QT [d][rp], rp = rows padded to the lane count). The  */
/* softmax then runs down the columns: each row's max, exp and sum are plain vector operations     */
/* across rows. The update O += P V reads P transposed (kvc_cpu_ukr_at). m starts at -FLT_MAX, not */
/* -inf, so a row with no visible key yet gets exp(-inf) = 0 and a correction exp(0) = 1, no NaN.  */

/* One online-softmax step on a tile S[tk][rp]: on return S holds P = exp(S - m_new); corr[r] =   */
/* exp(m_old - m_new) (the caller rescales O), l = l corr + sum_j P, m = m_new.                   */
static void softmax_cols(float *S, int rp, int tk, float *m, float *l, float *corr) {
#if defined(KVC_SIMD)
    for (int r = 0; r < rp; r += VL) {
        const vf m_old = V_LOAD(m + r);
        vf mx = m_old, sum = V_ZERO();
        for (int j = 0; j < tk; j++) mx = V_MAX(mx, V_LOAD(S + j * LS(rp) + r));
        for (int j = 0; j < tk; j++) {
            const vf p = V_EXP(V_SUB(V_LOAD(S + j * LS(rp) + r), mx));
            V_STORE(S + j * LS(rp) + r, p);
            sum = V_ADD(sum, p);
        }
        const vf c = V_EXP(V_SUB(m_old, mx));
        V_STORE(corr + r, c);
        V_STORE(l + r, V_FMA(V_LOAD(l + r), c, sum));
        V_STORE(m + r, mx);
    }
#else
    for (int r = 0; r < rp; r++) {
        float mx = m[r], sum = 0.f;
        for (int j = 0; j < tk; j++) mx = S[j * LS(rp) + r] > mx ? S[j * LS(rp) + r] : mx;
        for (int j = 0; j < tk; j++) sum += S[j * LS(rp) + r] = expf(S[j * LS(rp) + r] - mx);
        corr[r] = expf(m[r] - mx);
        l[r] = l[r] * corr[r] + sum;
        m[r] = mx;
    }
#endif
}

/* QT [d][rp]: the task's scaled queries transposed (rows..rp-1 zero; rp a multiple of KVC_NR).   */
static void attend_tiles(const float *QT, int rows, int rp, int gc, int64_t i0, int d, const kvc_cpu_kvsrc *kv, int32_t h,
                         const pruned_keys *pk, int64_t past, const int64_t *lo, int32_t Hkv, int64_t ke, float cap,
                         float *O, float *m, float *l) {
    float S[PTK * LS(ROWS_MAX)], corr[ROWS_MAX], Kb[PTK * d], Vb[PTK * d];
    const int64_t np = pk ? pk->np : 0;
    for (int64_t k0 = lo ? lo[i0 * Hkv] : 0; k0 < ke;) {
        const int64_t end = k0 < np && np < ke ? np : ke; /* a tile never straddles the pruned prefix's end */
        const int tk = (int)(end - k0 < PTK ? end - k0 : PTK);
        const int pruned = k0 < np, ds = pruned ? pk->dk : d;
        int64_t ldk, ldv;
        const float *Qs = pruned ? pk->Qp : QT, *Ks = kv->keys(kv->src, h, k0, tk, Kb, &ldk);
        const float *V = kv->values(kv->src, h, k0, tk, Vb, &ldv);
        for (int j0 = 0; j0 < tk; j0 += KVC_MR) {
            const int mr = tk - j0 < KVC_MR ? tk - j0 : KVC_MR;
            for (int r0 = 0; r0 < rp; r0 += KVC_NR)
                kvc_cpu_ukr(mr, KVC_NR, ds, Ks + (int64_t)j0 * ldk, ldk, Qs + r0, LS(rp), S + j0 * LS(rp) + r0, LS(rp), 0);
        }
        cap_tile(S, 1, LS(rp), rows, tk, cap);
        mask_tile(S, 1, LS(rp), rows, gc, i0, past, lo, Hkv, k0, tk);
        softmax_cols(S, rp, tk, m, l, corr);
        for (int r = 0; r < rows; r++)
            if (corr[r] != 1.f)
                for (int e = 0; e < d; e++) O[r * d + e] *= corr[r];
        for (int e0 = 0; e0 < d; e0 += KVC_NR) {
            const int nr = d - e0 < KVC_NR ? d - e0 : KVC_NR;
            for (int r0 = 0; r0 < rows; r0 += KVC_MR) {
                const int mr = rows - r0 < KVC_MR ? rows - r0 : KVC_MR;
                kvc_cpu_ukr_at(mr, nr, tk, S + r0, LS(rp), V + e0, ldv, O + r0 * d + e0, d, 1);
            }
        }
        k0 += tk;
    }
}

/* Task = (KV head h, query heads [h*g + g0, +gc), queries [i0, i0 + mq)).                         */
static void attention_prefill(const float *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                              const kvc_cpu_kvsrc *kv, const int64_t *past_len, const int64_t *start, float scale,
                              float cap, float *out, int64_t ldo) {
    const int32_t g = H / Hkv;
    /* rows per task: QT [d][rp] must fit QBUF with rp a whole number of lane groups */
    const int rmax = QBUF / d / KVC_NR * KVC_NR < ROWS_MAX ? QBUF / d / KVC_NR * KVC_NR : ROWS_MAX;
    const int32_t gc = g < rmax ? g : rmax; /* query heads per task */
    const int64_t gchunks = (g + gc - 1) / gc;
    const int64_t tq = rmax / gc; /* queries per task */
    const int64_t qtiles = (n + tq - 1) / tq;
    const int64_t per_tile = (int64_t)Hkv * gchunks, tasks = per_tile * qtiles;
    const int par = !omp_in_parallel() && tasks > 1 && (double)n * (n + past_len[0]) * H * d > 2e5;
    /* later query tiles see more keys: hand them out first */
#pragma omp parallel for schedule(dynamic, 1) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t t = 0; t < tasks; t++) {
        float QT[QBUF + DMAX * LPAD], QpT[QBUF + DMAX * LPAD], O[QBUF], m[ROWS_MAX], l[ROWS_MAX];
        pruned_keys pk;
        const int64_t qt = qtiles - 1 - t / per_tile;
        const int32_t h = (int32_t)(t % per_tile / gchunks), g0 = (int32_t)(t % per_tile % gchunks * gc);
        const int32_t gn = g - g0 < gc ? g - g0 : gc;
        const int64_t i0 = qt * tq, mq = n - i0 < tq ? n - i0 : tq;
        const int rows = (int)(mq * gn), rp = (rows + KVC_NR - 1) / KVC_NR * KVC_NR;
        gather_q(q, ldq, d, h * g + g0, gn, i0, rows, rp, scale, QT);
        const pruned_keys *pkh = prune_view(kv, h, QT, rows, d, rp, QpT, &pk);
        memset(O, 0, sizeof(float) * rows * d);
        for (int r = 0; r < rp; r++) m[r] = -FLT_MAX, l[r] = 0.f;
        attend_tiles(QT, rows, rp, gn, i0, d, kv, h, pkh, past_len[h], start ? start + h : NULL, Hkv,
                     past_len[h] + i0 + mq, cap, O, m, l);
        for (int r = 0; r < rows; r++) {
            float *dst = out + (i0 + r / gn) * ldo + ((int64_t)h * g + g0 + r % gn) * d;
            const float inv = 1.f / l[r]; /* l >= 1: the row's own max contributes exp(0) */
            for (int e = 0; e < d; e++) dst[e] = O[r * d + e] * inv;
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Decode: n <= DECODE_N queries. Task = (KV head h, keys [kb, ke)) over all n * g rows of h; its  */
/* partial result (unnormalised O, m, l per row) goes to `part`, then the chunks of each head are  */
/* merged. Returns 0 (nothing done) when the rows do not fit the buffers or memory is short.       */

/* The decode partials: grown, never freed, per calling thread (a decode step allocates nothing once warm). */
static float *partials(size_t floats) {
    static _Thread_local float *p;
    static _Thread_local size_t cap;
    if (floats > cap) {
        float *q = realloc(p, sizeof(float) * floats);
        if (!q) return NULL;
        p = q;
        cap = floats;
    }
    return p;
}

static int attention_decode(const float *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                            const kvc_cpu_kvsrc *kv, const int64_t *past_len, const int64_t *start, float scale,
                            float cap, float *out, int64_t ldo, const kvc_cpu_hint *hint) {
    const int32_t g = H / Hkv;
    const int rows = (int)(n * g);
    if (rows > ROWS_MAX || rows * d > QBUF || Hkv > KVC_MAX_KV_HEADS) return 0;
    const int nt = omp_in_parallel() ? 1 : kvc_cpu_threads();
    int64_t total = 0; /* keys in reach: from the first query's window start (0 without one) to the end */
    for (int32_t h = 0; h < Hkv; h++) total += past_len[h] + n - (start ? start[h] : 0);
    /* chunks: enough tasks to balance the threads, each long enough to amortise its merge */
    int64_t ch = (total + 4 * nt - 1) / (4 * nt);
    ch = ch < CHUNK_MIN ? CHUNK_MIN : (ch + TK - 1) / TK * TK;
    int64_t first[KVC_MAX_KV_HEADS + 1]; /* first task of each head */
    first[0] = 0;
    for (int32_t h = 0; h < Hkv; h++) first[h + 1] = first[h] + (past_len[h] + n - (start ? start[h] : 0) + ch - 1) / ch;
    const int64_t tasks = first[Hkv], stride = (int64_t)rows * (d + 2);
    float *part = partials((size_t)(tasks * stride));
    if (!part) return 0;
    const int par = nt > 1 && tasks > 1 && (double)total * rows * d > 2e5;
#pragma omp parallel num_threads(nt) if (par)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            int32_t h = 0;
            while (first[h + 1] <= t) h++;
            const int64_t kb = (start ? start[h] : 0) + (t - first[h]) * ch, len = past_len[h] + n;
            const int64_t ke = kb + ch < len ? kb + ch : len;
            float Q[QBUF], Qp[QBUF];
            pruned_keys pk;
            float *O = part + t * stride, *m = O + rows * d, *l = m + rows;
            gather_q(q, ldq, d, h * g, g, 0, rows, 0, scale, Q);
            const pruned_keys *pkh = prune_view(kv, h, Q, rows, d, 0, Qp, &pk);
            memset(O, 0, sizeof(float) * rows * d);
            for (int r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.f;
            kvc_cpu_hint_cursor next; /* this task's share of the next weights */
            kvc_cpu_hint_part(hint, t, tasks, &next);
            attend_dot(Q, rows, g, 0, d, kv, h, pkh, past_len[h], start ? start + h : NULL, Hkv, kb, ke, cap, O, m, l, &next);
        }
        /* merge: rescale each chunk to the largest max of its row */
#pragma omp for schedule(static)
        for (int64_t hr = 0; hr < (int64_t)Hkv * rows; hr++) {
            const int32_t h = (int32_t)(hr / rows);
            const int r = (int)(hr % rows);
            float mx = -INFINITY, sum = 0.f;
            for (int64_t t = first[h]; t < first[h + 1]; t++) {
                const float mt = part[t * stride + rows * d + r];
                mx = mt > mx ? mt : mx;
            }
            float *dst = out + (int64_t)(r / g) * ldo + ((int64_t)h * g + r % g) * d;
            memset(dst, 0, sizeof(float) * d);
            for (int64_t t = first[h]; t < first[h + 1]; t++) {
                const float *O = part + t * stride;
                const float mt = O[rows * d + r];
                if (mt == -INFINITY) continue; /* a chunk this row does not see */
                const float w = expf(mt - mx);
                sum += O[rows * d + rows + r] * w;
                for (int e = 0; e < d; e++) dst[e] += O[r * d + e] * w;
            }
            const float inv = 1.f / sum;
            for (int e = 0; e < d; e++) dst[e] *= inv;
        }
    }
    return 1;
}

void kvc_cpu_attention(const float *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const kvc_cpu_kvsrc *kv,
                       const int64_t *past_len, const int64_t *start, float scale, float cap, float *out, int64_t ldo) {
    const kvc_cpu_hint next = kvc_cpu_hint_take(); /* the weights after this attention (weight_hint.h) */
    if (n <= DECODE_N && attention_decode(q, ldq, n, H, Hkv, d, kv, past_len, start, scale, cap, out, ldo, &next)) return;
    attention_prefill(q, ldq, n, H, Hkv, d, kv, past_len, start, scale, cap, out, ldo);
}
