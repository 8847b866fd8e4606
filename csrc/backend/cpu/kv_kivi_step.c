/* KIVI's decode step on the stored bytes (kv_decode.h: kvc_cpu_kv_scores, kvc_cpu_kv_pv): the attention's
 * products on a tile of kivi4 / kivi2 rows read where they lie, the dequantisation folded in.
 *
 * Keys per channel (k_c = m_c + s_c q_c over a key block): q . k = sum_c (q_c s_c) q_c' + sum_c q_c m_c, the
 * first over the codes as they come, the second once per tile (a tile lies in one block). Values per row
 * (v_c = m + s q_c in each value group): O += (P s) q + (P m), the second summed over the tile's rows first.
 *
 * Builds with AVX-512 VNNI (and VBMI) multiply integers: per query row and tile, q s is rounded to int16
 * with one step (max |q s| / 32767), and per query row, value group and tile so is P s; vpdpwssd then sums
 * pairs of int16 weights times codes widened to 16 bits into int32 lanes, exactly, and each sum is scaled by
 * its step once. The only error beyond fp32 rounding is the int16 rounding, at most step / 2 per code unit
 * of a term (so at most 2^-16 of the row's largest |q s| or P s times the code); int8 weights (vpdpbusd)
 * would make that 2^-8, too coarse for scores that feed a softmax. Scores put 16 keys in the 16 lanes: a
 * 16-key slab of codes is transposed to dword columns (3 levels of two-source permutes, shared by all
 * query rows) so no horizontal sum is left per key. P V puts channels in the lanes and a pair of keys in
 * each lane's two words (one byte permute per 16 bytes of each pair of rows). int32 cannot overflow: a
 * score lane sums d / 2 <= 128 pairs, a P V lane 32 pairs, each at most 2 x 32767 x 15 (2^31 > 128 x 983010).
 *
 * Other builds (AVX-512 without VNNI, AVX2 + FMA + F16C) multiply floats: codes are read VL bytes at a time,
 * widened to 32-bit lanes and split by shifts into per = 8 / bits vectors ("chunks"): lane i of chunk t
 * holds channel per i + t, so the codes need no shuffle; the query side and the output take that order
 * instead, once per tile (to_lanes, from_lanes); 4 keys' sums are reduced together, and the rows KVC_KV_PF
 * bytes ahead are prefetched as each row is read. Either way rounding differs from decoding then
 * multiplying; the tests bound it. f16, bf16 and q8_0 tiles: kv_rows_step.c. */
#include "kv_decode.h"

#include "../../core/kv_type.h"
#include "kv_simd.h"

#if defined(KVC_KV_SIMD)
#define KVD KVC_KV_SIMD
#endif

#if defined(KVD)
#include <immintrin.h>

#include "cpu.h"

#define AI inline __attribute__((always_inline))
#define NR_MAX 4 /* query rows a kernel keeps in registers */

#if KVD == 512
#define I_CVT(x) _mm512_cvtepi32_ps(x)
#define I_AND(x, m) _mm512_and_si512(x, _mm512_set1_epi32(m))
#define I_SHR(x, k) _mm512_srli_epi32(x, k)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
/* even and odd lanes of the 2 VL lanes [a, b]; and the inverse: a and b interleaved, low and high halves */
static inline vf ev(vf a, vf b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
}
static inline vf od(vf a, vf b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
}
static inline vf il_lo(vf a, vf b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), b);
}
static inline vf il_hi(vf a, vf b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), b);
}
/* VL bytes widened to 32-bit lanes */
typedef __m512i vi;
static inline vi widen(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#else
#define I_CVT(x) _mm256_cvtepi32_ps(x)
#define I_AND(x, m) _mm256_and_si256(x, _mm256_set1_epi32(m))
#define I_SHR(x, k) _mm256_srli_epi32(x, k)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
static inline vf ev(vf a, vf b) {
    const __m256i ix = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    return _mm256_permute2f128_ps(_mm256_permutevar8x32_ps(a, ix), _mm256_permutevar8x32_ps(b, ix), 0x20);
}
static inline vf od(vf a, vf b) {
    const __m256i ix = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    return _mm256_permute2f128_ps(_mm256_permutevar8x32_ps(a, ix), _mm256_permutevar8x32_ps(b, ix), 0x31);
}
static inline vf il_lo(vf a, vf b) { return _mm256_permute2f128_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b), 0x20); }
static inline vf il_hi(vf a, vf b) { return _mm256_permute2f128_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b), 0x31); }
typedef __m256i vi;
static inline vi widen(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#endif

/* per chunks of channels in order (n) into the order of a load of codes (x), and back */
static inline void to_lanes(const int per, const vf *n, vf *x) {
    if (per == 2) {
        x[0] = ev(n[0], n[1]);
        x[1] = od(n[0], n[1]);
    } else {
        const vf a = ev(n[0], n[1]), b = od(n[0], n[1]), c = ev(n[2], n[3]), e = od(n[2], n[3]);
        x[0] = ev(a, c);
        x[1] = ev(b, e);
        x[2] = od(a, c);
        x[3] = od(b, e);
    }
}
static inline void from_lanes(const int per, const vf *x, vf *n) {
    if (per == 2) {
        n[0] = il_lo(x[0], x[1]);
        n[1] = il_hi(x[0], x[1]);
    } else {
        const vf a = il_lo(x[0], x[2]), c = il_hi(x[0], x[2]), b = il_lo(x[1], x[3]), e = il_hi(x[1], x[3]);
        n[0] = il_lo(a, b);
        n[1] = il_hi(a, b);
        n[2] = il_lo(c, e);
        n[3] = il_hi(c, e);
    }
}

/* each value row's scale and min of value group e (sc, mn [e KVC_KV_TILE + j]) */
static void value_params(const kvc_kv_tile *t, int n, int ne, size_t gb, float *sc, float *mn) {
    for (int e = 0; e < ne; e++) {
#if KVD == 512
        /* the rows' (scale, min) pairs, 16 rows in one gather (a scalar copy of each: kivi4 P V 3.81 -> 3.64 ns a key) */
        const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32((int)t->vstride));
        for (int j = 0; j < n; j += VL) {
            const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32((int)((size_t)j * t->vstride + (size_t)e * gb)));
            const __m512i x = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), V_MASK(n - j), at, t->v, 1);
            V_STORE(sc + e * KVC_KV_TILE + j, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)));
            V_STORE(mn + e * KVC_KV_TILE + j, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16))));
        }
#else
        for (int j = 0; j < n; j++) {
            const uint8_t *h = t->v + (size_t)j * t->vstride + (size_t)e * gb;
            sc[e * KVC_KV_TILE + j] = kvc_kv_half(h);
            mn[e * KVC_KV_TILE + j] = kvc_kv_half(h + 2);
        }
#endif
    }
}

/* the key block's channel scales and mins (f16; d a multiple of 4 VL) */
static AI void key_params(const kvc_kv_tile *t, float *s, float *m) {
    for (int c = 0; c < t->d; c += VL) {
#if KVD == 512
        V_STORE(s + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t->k + 2 * (size_t)c))));
        V_STORE(m + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t->k + 2 * ((size_t)t->d + c)))));
#else
        V_STORE(s + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t->k + 2 * (size_t)c))));
        V_STORE(m + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t->k + 2 * ((size_t)t->d + c)))));
#endif
    }
}

#if defined(KVC_KV_INT16_KIVI)
/* ---- integer products (AVX-512 VNNI and VBMI: kv_simd.h) ---- */
#define KS 16 /* keys a scores step puts in its lanes */

/* share `part` of `parts` of the next tile's key bytes (the key rows after this tile's: a store's next tile),
 * a cache line at a time: each 16-key step of the scores asks for its share, a tile ahead of the loads (the
 * whole tile at once, the prefetches queued for the line fill buffers: kivi4 from memory 12.1 ns a key
 * against 9.8 spread so). The next tile's values are P V's to fetch (pv_nr), so the two streams spread over
 * the whole step (where the scores had asked for both: kivi4 from memory 9.9 -> 9.3 ns a key, kivi2 8.1 -> 8.0, min of 8) */
static AI void prefetch_next(const kvc_kv_tile *t, int bits, int n, int part, int parts) { /* inlined: see kvc_prefetch_lines */
    const size_t rb = (size_t)t->d * bits / 8, kb = 4 * (size_t)t->d + (size_t)n * rb;
    const uint8_t *k = t->k + 4 * (size_t)t->d + (size_t)(t->kr0 + n) * rb;
    const size_t k0 = kb * part / parts / 64 * 64, k1 = kb * (part + 1) / parts / 64 * 64;
    kvc_prefetch_lines(k + k0, (part + 1 == parts ? kb : k1) - k0);
}

/* dwords [T h, T h + T) of KS rows of rb bytes at p, T dwords of a row per lane group: z[i] = rows KS / T i.. */
static AI void slab(const int T, const uint8_t *p, size_t rb, int h, __m512i *z) {
    if (rb == 4 * (size_t)T) { /* unrolled: else GCC makes the loop a memcpy into z in memory */
#pragma GCC unroll 8
        for (int i = 0; i < T; i++) z[i] = _mm512_loadu_si512(p + 64 * i);
    } else if (T == 8) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2 * i * rb + 32 * h))),
                                      _mm256_loadu_si256((const __m256i *)(p + (2 * i + 1) * rb + 32 * h)), 1);
    } else {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + 4 * i * rb + 16 * h)));
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + (4 * i + 1) * rb + 16 * h)), 1);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + (4 * i + 2) * rb + 16 * h)), 2);
            z[i] = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p + (4 * i + 3) * rb + 16 * h)), 3);
        }
    }
}

/* S[r ls + j] = step[r] (qp[r] . codes_j) + bias[r] for NR rows and the tile's keys j < n, KS keys a step.
 * A dword of codes holds channels 32 / BITS t + i (code i); (dword >> BITS k) & mask gives in its two words
 * codes k and K + k (K = 16 / BITS), which qp [NR, d / 2] pairs with q s of those channels. */
/* T (dwords of a row per lane group) a constant, as the transposition needs to be unrolled: with T taken from
 * d at run time GCC kept its loops and z in memory (kivi4's scores 4.7 -> 3.8 ns a key in L2, kivi2's 4.0 -> 3.4) */
static AI void scores_nr_t(const int BITS, const int NR, const int T, const kvc_kv_tile *t, const int32_t *qp,
                           const float *step, const float *bias, int n, float *S, int ls, int pf) {
    const int d = t->d, K = 16 / BITS;
    const size_t rb = (size_t)d * BITS / 8; /* a key row's codes: a multiple of 16 bytes */
    const int slabs = (int)(rb / (4 * (size_t)T));
    const uint8_t *codes = t->k + 4 * (size_t)d + (size_t)t->kr0 * rb;
    const __m512i mask = _mm512_set1_epi32(((1 << BITS) - 1) * 0x10001), order = _mm512_loadu_si512(KVC_KV_SLOT_ORDER[T == 8]);
    uint8_t part[KS * 128]; /* a last slab of fewer than KS keys, zero padded (reads stay inside the tile) */
    for (int j = 0; j < n; j += KS) {
        const int nk = n - j < KS ? n - j : KS;
        const uint8_t *p = codes + (size_t)j * rb;
        if (pf) prefetch_next(t, BITS, n, j / KS, (n + KS - 1) / KS);
        if (nk < KS) {
            memcpy(part, p, (size_t)nk * rb);
            memset(part + (size_t)nk * rb, 0, (size_t)(KS - nk) * rb);
            p = part;
        }
        __m512i acc[NR_MAX][2]; /* two sums a row: one chain of T K dependent vpdpwssd a slab was the bound */
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int h = 0; h < slabs; h++) {
            __m512i z[8];
            slab(T, p, rb, h, z);
            kvc_kv_transpose(T, z);
#pragma GCC unroll 8
            for (int u = 0; u < T; u++)
#pragma GCC unroll 8
                for (int k = 0; k < K; k++) {
                    const __m512i c = _mm512_and_si512(k ? _mm512_srli_epi32(z[u], BITS * k) : z[u], mask);
                    const int32_t *w = qp + (h * T + u) * K + k;
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) acc[r][k & 1] = kvc_dpwssd_bcast(acc[r][k & 1], c, w + r * d / 2);
                }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m512i a = _mm512_add_epi32(acc[r][0], acc[r][1]);
            const vf s = V_FMA(I_CVT(_mm512_permutexvar_epi32(order, a)), _mm512_set1_ps(step[r]), _mm512_set1_ps(bias[r]));
            V_STOREM(S + r * ls + j, V_MASK(nk), s);
        }
    }
}

static AI void scores_nr(const int BITS, const int NR, const kvc_kv_tile *t, const int32_t *qp, const float *step,
                         const float *bias, int n, float *S, int ls, int pf) {
    if ((size_t)t->d * BITS / 8 % 32 == 0) /* a row's codes whole 32-byte halves of a lane group's 8 dwords */
        scores_nr_t(BITS, NR, 8, t, qp, step, bias, n, S, ls, pf);
    else
        scores_nr_t(BITS, NR, 4, t, qp, step, bias, n, S, ls, pf);
}

/* O[NR, d] += the tile's value codes j < n weighted by wp (row r's int16 weights of values j, j + 1 in value
 * group e: dword (r ne + e) KVC_KV_TILE / 2 + j / 2, P s in steps of step[r ne + e]), then bias [NR, ne]
 * (sum_j P m) on the group's channels. 64 channels at a time: 16 bytes of a pair of rows become dwords
 * (byte i of row j, 0, byte i of row j + 1, 0), whose per shifted and masked copies hold channels per i + c
 * of both rows in their two words (the chunk order of to_lanes). */
static AI void pv_nr(const int BITS, const int NR, const kvc_kv_tile *t, const int32_t *wp, const float *step, int ne,
                     const float *bias, int n, float *O, int pf) {
    const int d = t->d, per = 8 / BITS, g = kvc_kivi_vgroup(t->f->group, d);
    const size_t gb = 4 + (size_t)g * BITS / 8; /* a value group's bytes: scale, min, codes */
    const __m512i mask = _mm512_set1_epi32(((1 << BITS) - 1) * 0x10001);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pick = _mm512_add_epi32(iota, _mm512_slli_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32(64)), 16));
    for (int c0 = 0; c0 < d; c0 += 4 * VL) { /* 4 VL channels: whole loads, inside one group */
        const int e = c0 / g;
        const size_t at = (size_t)e * gb + 4 + (size_t)(c0 % g) * BITS / 8;
        const int32_t *w = wp + (size_t)e * KVC_KV_TILE / 2;
        __m512i acc[NR_MAX][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
        for (int j = 0; j < n; j += 2) {
            const uint8_t *a = t->v + (size_t)j * t->vstride, *b = j + 1 < n ? a + t->vstride : a; /* past n: weight 0 */
            if (pf && c0 == 0) kvc_prefetch_lines(a + (size_t)n * t->vstride, 2 * t->vstride); /* the pair a tile on */
#pragma GCC unroll 4
            for (int h = 0; h < 4 / per; h++) {
                const __m512i x = _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(a + at + 16 * h))),
                                                                 pick, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + at + 16 * h))));
#pragma GCC unroll 4
                for (int i = 0; i < per; i++) {
                    const __m512i cv = _mm512_and_si512(i ? _mm512_srli_epi32(x, BITS * i) : x, mask);
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++)
                        acc[r][h * per + i] = kvc_dpwssd(acc[r][h * per + i], cv, _mm512_set1_epi32(w[(size_t)r * ne * KVC_KV_TILE / 2 + j / 2]));
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const vf sc = _mm512_set1_ps(step[r * ne + e]), bv = V_BCAST(bias + r * ne + e);
            vf f[4];
            for (int c = 0; c < 4; c++) f[c] = V_MUL(I_CVT(acc[r][c]), sc);
            for (int c = 0; c < 4; c += per) {
                vf x[4];
                from_lanes(per, f + c, x);
                for (int i = 0; i < per; i++) V_STORE(O + r * d + c0 + (c + i) * VL, V_ADD(V_ADD(V_LOAD(O + r * d + c0 + (c + i) * VL), x[i]), bv));
            }
        }
    }
}

static AI void scores_of(const int BITS, const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls) {
    const int d = t->d, K = 16 / BITS, cpd = 32 / BITS; /* codes per dword */
    float s[256], m[256], qs[256], step[NR_MAX], bias[NR_MAX];
    int16_t qi[256];
    int32_t qp[NR_MAX * 128];
    __m512i pair; /* word i of 32: channel (i / cpd) cpd + (i % 2) K + (i % cpd) / 2, the codes' word pairs */
    {
        int16_t ix[32];
        for (int i = 0; i < 32; i++) ix[i] = (int16_t)(i / cpd * cpd + i % 2 * K + i % cpd / 2);
        pair = _mm512_loadu_si512(ix);
    }
    key_params(t, s, m);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
        for (int r = 0; r < nr; r++) { /* q s in int16 steps, paired as the codes' words come; and q . m */
            const float *q = Q + (size_t)(r0 + r) * d;
            vf b = V_ZERO();
            for (int c = 0; c < d; c += VL) {
                V_STORE(qs + c, V_MUL(V_LOAD(q + c), V_LOAD(s + c)));
                b = V_FMA(V_LOAD(q + c), V_LOAD(m + c), b);
            }
            bias[r] = V_HSUM(b);
            step[r] = kvc_kv_to_int16(qs, d, qi);
            for (int c = 0; c < d; c += 32) /* 32 channels: whole dwords of codes (cpd <= 16) */
                _mm512_storeu_si512(qp + r * d / 2 + c / 2, _mm512_permutexvar_epi16(pair, _mm512_loadu_si512(qi + c)));
        }
#define SCORES(NR) scores_nr(BITS, NR, t, qp, step, bias, n, S + (size_t)r0 * ls, ls, r0 == 0) /* the first rows prefetch */
        KVC_NR_CASES(SCORES)
#undef SCORES
    }
}

static AI void pv_of(const int BITS, const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O) {
    const int d = t->d, g = kvc_kivi_vgroup(t->f->group, d), ne = d / g;
    const size_t gb = 4 + (size_t)g * BITS / 8;
    float sc[4 * KVC_KV_TILE], mn[4 * KVC_KV_TILE], ps[KVC_KV_TILE], step[NR_MAX * 4], bias[NR_MAX * 4];
    int32_t wp[NR_MAX * 4 * KVC_KV_TILE / 2];
    value_params(t, n, ne, gb, sc, mn);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
        const float *Pr = P + (size_t)r0 * ls;
        for (int r = 0; r < nr; r++) /* P s in int16 steps, and P . m */
            for (int e = 0; e < ne; e++) {
                vf b = V_ZERO();
                for (int j = 0; j < n; j += VL) {
                    const vmask mk = V_MASK(n - j);
                    const vf p = V_LOADM(Pr + r * ls + j, mk);
                    V_STORE(ps + j, V_MUL(p, V_LOADM(sc + e * KVC_KV_TILE + j, mk)));
                    b = V_FMA(p, V_LOADM(mn + e * KVC_KV_TILE + j, mk), b);
                }
                bias[r * ne + e] = V_HSUM(b);
                step[r * ne + e] = kvc_kv_to_int16(ps, n, (int16_t *)(wp + (size_t)(r * ne + e) * KVC_KV_TILE / 2));
            }
#define PV(NR) pv_nr(BITS, NR, t, wp, step, ne, bias, n, O + (size_t)r0 * d, r0 == 0) /* the first rows prefetch */
        KVC_NR_CASES(PV)
#undef PV
    }
}

#else /* fp32 products */
/* the per chunks of VL bytes of codes at p */
static inline void ld_codes(const uint8_t *p, const int bits, vf *x) {
    const vi u = widen(p);
    if (bits == 4) {
        x[0] = I_CVT(I_AND(u, 15));
        x[1] = I_CVT(I_SHR(u, 4));
    } else {
        x[0] = I_CVT(I_AND(u, 3));
        x[1] = I_CVT(I_AND(I_SHR(u, 2), 3));
        x[2] = I_CVT(I_AND(I_SHR(u, 4), 3));
        x[3] = I_CVT(I_SHR(u, 6));
    }
}


/* S[r ls + j] = Qv[r] . codes_j + bias[r] for NR rows (Qv [NR, d]: q s in the codes' order) and the tile's
 * keys j < n, 4 keys at a time (their sums reduced together) */
static AI void scores_nr(const int BITS, const int NR, const kvc_kv_tile *t, const float *Qv,
                                                            const float *bias, int n, float *S, int ls) {
    const int d = t->d, per = 8 / BITS;
    const size_t rb = (size_t)d * BITS / 8; /* a key row's codes */
    const uint8_t *codes = t->k + 4 * (size_t)d + (size_t)t->kr0 * rb;
    for (int j = 0; j < n; j += 4) {
        const int nk = n - j < 4 ? n - j : 4;
        const uint8_t *row[4];
        vf acc[NR_MAX][4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            row[k] = codes + (size_t)(j + (k < nk ? k : 0)) * rb; /* past n: a row again, its sum unused */
            kvc_kv_prefetch(row[k], rb);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) acc[r][k] = V_ZERO();
        }
        for (int l = 0; l < d / VL / per; l++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                vf x[4];
                ld_codes(row[k] + (size_t)l * VL, BITS, x);
#pragma GCC unroll 4
                for (int c = 0; c < per; c++)
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) acc[r][k] = V_FMA(V_LOAD(Qv + r * d + (l * per + c) * VL), x[c], acc[r][k]);
            }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m128 s = _mm_add_ps(kvc_kv_sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(bias[r]));
            kvc_kv_store4(S + r * ls + j, s, nk);
        }
    }
}

/* O[NR, d] += the tile's value codes j < n weighted by cf (row r's weight of value j in value group e at
 * cf[(r ne + e) KVC_KV_TILE + j]: P s), then bias [NR, ne] (sum_j P m) on the group's channels; 4 chunks of
 * O in registers at a time */
static AI void pv_nr(const int BITS, const int NR, const kvc_kv_tile *t, const float *cf,
                                                        int ne, const float *bias, int n, float *O) {
    const int d = t->d, per = 8 / BITS, g = kvc_kivi_vgroup(t->f->group, d);
    const size_t gb = 4 + (size_t)g * BITS / 8; /* a value group's bytes: scale, min, codes */
    for (int v0 = 0; v0 < d / VL; v0 += 4) {
        const int c0 = v0 * VL; /* first channel (4 VL channels: whole loads, inside one group) */
        const int e = c0 / g;
        const size_t at = (size_t)e * gb + 4 + (size_t)(c0 % g) * BITS / 8;
        const float *w = cf + (size_t)e * KVC_KV_TILE;
        vf o[NR_MAX][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < 4; c += per) {
                vf x[4];
                for (int i = 0; i < per; i++) x[i] = V_LOAD(O + r * d + c0 + (c + i) * VL);
                to_lanes(per, x, o[r] + c);
            }
        for (int j = 0; j < n; j++) {
            const uint8_t *row = t->v + (size_t)j * t->vstride;
            vf x[4];
            if (v0 == 0) kvc_kv_prefetch(row, t->vstride);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c += per) ld_codes(row + at + (size_t)c * VL * BITS / 8, BITS, x + c);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const vf p = V_BCAST(w + (size_t)r * ne * KVC_KV_TILE + j);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) o[r][c] = V_FMA(p, x[c], o[r][c]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const vf b = V_BCAST(bias + r * ne + e);
            for (int c = 0; c < 4; c += per) {
                vf x[4];
                from_lanes(per, o[r] + c, x);
                for (int i = 0; i < per; i++) V_STORE(O + r * d + c0 + (c + i) * VL, V_ADD(x[i], b));
            }
        }
    }
}

static AI void scores_of(const int BITS, const kvc_kv_tile *t, const float *Q, int rows,
                                                            int n, float *S, int ls) {
    const int d = t->d, per = 8 / BITS;
    float qv[NR_MAX * 256], bias[NR_MAX], s[256], m[256];
    key_params(t, s, m);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
        const float *Qr = Q + (size_t)r0 * d;
        for (int r = 0; r < nr; r++) { /* q s in the codes' order, and q . m */
            vf b = V_ZERO();
            for (int c = 0; c < d; c += VL) b = V_FMA(V_LOAD(Qr + r * d + c), V_LOAD(m + c), b);
            bias[r] = V_HSUM(b);
            for (int c = 0; c < d; c += per * VL) {
                vf nat[4], x[4];
                for (int i = 0; i < per; i++) nat[i] = V_MUL(V_LOAD(Qr + r * d + c + i * VL), V_LOAD(s + c + i * VL));
                to_lanes(per, nat, x);
                for (int i = 0; i < per; i++) V_STORE(qv + r * d + c + i * VL, x[i]);
            }
        }
#define SCORES(NR) scores_nr(BITS, NR, t, qv, bias, n, S + (size_t)r0 * ls, ls)
        KVC_NR_CASES(SCORES)
#undef SCORES
    }
}

static AI void pv_of(const int BITS, const kvc_kv_tile *t, const float *P, int ls, int rows,
                                                        int n, float *O) {
    const int d = t->d, g = kvc_kivi_vgroup(t->f->group, d), ne = d / g;
    const size_t gb = 4 + (size_t)g * BITS / 8;
    float sc[8 * KVC_KV_TILE], mn[8 * KVC_KV_TILE], cf[NR_MAX * 8 * KVC_KV_TILE], bias[NR_MAX * 8];
    value_params(t, n, ne, gb, sc, mn);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
        const float *Pr = P + (size_t)r0 * ls;
        for (int r = 0; r < nr; r++) /* P s, and P . m */
            for (int e = 0; e < ne; e++) {
                vf b = V_ZERO();
                for (int j = 0; j < n; j += VL) {
                    const vmask mk = V_MASK(n - j);
                    const vf p = V_LOADM(Pr + r * ls + j, mk);
                    V_STORE(cf + (r * ne + e) * KVC_KV_TILE + j, V_MUL(p, V_LOADM(sc + e * KVC_KV_TILE + j, mk)));
                    b = V_FMA(p, V_LOADM(mn + e * KVC_KV_TILE + j, mk), b);
                }
                bias[r * ne + e] = V_HSUM(b);
            }
        float *Or = O + (size_t)r0 * d;
#define PV(NR) pv_nr(BITS, NR, t, cf, ne, bias, n, Or)
        KVC_NR_CASES(PV)
#undef PV
    }
}
#endif
#endif


int kvc_cpu_kv_kivi_ok(const kvc_kv_format *f, int32_t d) {
#if defined(KVD)
    /* whole column blocks of 4 chunks, each inside one value group */
    if (!kvc_kv_type_key_blocks(f->type) || d % (4 * VL) != 0 || d > 256) return 0;
    return kvc_kivi_vgroup(f->group, d) % (4 * VL) == 0;
#else
    (void)f, (void)d;
    return 0;
#endif
}

void kvc_cpu_kv_kivi_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls) {
#if defined(KVD)
    if (t->f->type == KVC_KV_KIVI4)
        scores_of(4, t, Q, rows, n, S, ls);
    else
        scores_of(2, t, Q, rows, n, S, ls);
#else
    (void)t, (void)Q, (void)rows, (void)n, (void)S, (void)ls;
#endif
}

void kvc_cpu_kv_kivi_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O) {
#if defined(KVD)
    if (t->f->type == KVC_KV_KIVI4)
        pv_of(4, t, P, ls, rows, n, O);
    else
        pv_of(2, t, P, ls, rows, n, O);
#else
    (void)t, (void)P, (void)ls, (void)rows, (void)n, (void)O;
#endif
}
