/* The decode step on rows stored alone in f16, bf16 or q8_0 (kv_decode.h: kvc_cpu_kv_scores, kvc_cpu_kv_pv on
 * such a tile), read where they lie: each vector of a key or value row is widened to f32 in registers and used
 * at once, instead of a tile decoded into a buffer and read back (which cost a q8_0 cache's decode step a
 * third of its time: 9 of 28 ms at 8k tokens on SmolLM2). The arithmetic is the tile decoders' (f16 and bf16
 * widen exactly, q8_0's d q is exact in f32) and the f32 attention's (attention.c: scores_dot's products and
 * 4-key reductions, pv_tile's updates, in the same order), so on AVX-512 the scores and outputs equal the
 * decoded path's bit for bit, but for q8_0: its P V rounds P s once per row and block and multiplies the bare
 * codes (one rounding where the decoded path rounds P (s q)), and with VNNI or on AVX2 both its products are
 * int16 ones (below); the tests hold each to its own bound.
 * q8_0 is bound by its arithmetic, not its bytes (a 64-key tile of 3 query rows: 17 ns a key in L2 against
 * f16's 11): its f16 scales are widened once per tile (q8_scales: 16 rows' scales in one gather) where each
 * vector had converted its block's, and P V's scaling moves into P (W below): 13.6 ns a key in L2 (17.3 before),
 * 18.2 over 512 MB (19.6; benchmarks/kv_step_kernels.py). The gather reads the whole tile's rows at once, so the
 * keys are prefetched a tile ahead (1 KB ahead, the gather waited on memory: 27% of the scores' time, slower
 * than before). Builds with AVX-512 VNNI multiply q8_0's codes in int16 products instead (the section below;
 * AVX2 builds too, in vpmaddwd: the one after it):
 * 9.3 ns a key in L2, 13.7 from memory; with the values' prefetches moved into P V (q8_pv_nr) 9.7 and 12.5.
 * On the VNNI path the next tile's keys and values are fetched into L2 (prefetcht2), not L1: a tile's 136 lines
 * asked into L1 at once held the fill buffers, and the prefetches themselves stalled (a quarter of P V's time on a
 * Zen 4 core); from L2 the gather and the loads wait little. Zen 4, 32 MB L3 (minimum of 3-5 processes): 13.5 ->
 * 10.8 ns a key from memory, the same in L2 (9.5); its decode step at 8k tokens 50.8 -> 58-65 tok/s. f16's and
 * KIVI's measured no faster so (f16 from memory 16.4 -> 20.5, kivi4 7.7 -> 7.9: their prefetches stay in L1). */
#include "kv_decode.h"

#include "../../core/kv_type.h"
#include "kv_simd.h"

#if defined(KVC_KV_SIMD)

#define NR_MAX 4 /* query rows a kernel keeps in registers */
#if KVC_KV_SIMD == 512
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#else
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#endif

/* channels [e, e + VL) of a row of type T, as f32; q8_0: its codes times sc, the scale of their block (the
 * tile's table, q8_scales), or the bare codes when sc is 0 (P V folds the scale into P) */
static inline __attribute__((always_inline)) vf row_vec(const int T, const uint8_t *row, int e, const float *sc) {
#if KVC_KV_SIMD == 512
    if (T == KVC_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * e)));
    if (T == KVC_KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * e))), 16));
    const uint8_t *b = row + (size_t)(e / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES; /* a vector lies in one block */
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + e % KVC_Q8_0_BLOCK))));
    return sc ? _mm512_mul_ps(_mm512_set1_ps(*sc), q) : q;
#else
    if (T == KVC_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * e)));
    if (T == KVC_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * e))), 16));
    const uint8_t *b = row + (size_t)(e / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES;
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + e % KVC_Q8_0_BLOCK))));
    return sc ? _mm256_mul_ps(_mm256_set1_ps(*sc), q) : q;
#endif
}

#define NB_MAX (256 / KVC_Q8_0_BLOCK) /* q8_0 blocks of a row at d <= 256 */

/* The scales of q8_0 rows j < n (stride bytes apart) as f32, sc[b KVC_KV_TILE + j] for block b of row j (0 past
 * n), widened once per tile where each vector had converted its block's f16 scale (4 instructions a vector) */
static inline __attribute__((always_inline)) void q8_scales(const uint8_t *rows, size_t stride, int n, int nb, float *sc) {
#if KVC_KV_SIMD == 512
    const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)stride));
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < n; j += 16) {
            /* the dword at each row's scale: the f16 scale and the block's first two codes (inside the row) */
            const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32((int)((size_t)j * stride) + b * KVC_Q8_0_BYTES));
            const __m512i x = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), V_MASK(n - j), at, rows, 1);
            _mm512_storeu_ps(sc + b * KVC_KV_TILE + j, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)));
        }
#else
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < (n + VL - 1) / VL * VL; j++)
            sc[b * KVC_KV_TILE + j] = j < n ? kvc_kv_half(rows + (size_t)j * stride + (size_t)b * KVC_Q8_0_BYTES) : 0.f;
#endif
}

/* S[r ls + j] = Q[r] . k_j for NR rows and the tile's keys j < n, 4 keys at a time */
static inline __attribute__((always_inline)) void scores_nr(const int T, const int NR, const kvc_kv_tile *t, const float *Q,
                                                            int n, float *S, int ls, const float *ks) {
    const int d = t->d;
    for (int j = 0; j < n; j += 4) {
        const int nk = n - j < 4 ? n - j : 4;
        const uint8_t *row[4];
        vf acc[NR_MAX][4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            row[k] = t->k + (size_t)(j + (k < nk ? k : 0)) * t->kstride; /* past n: a row again, its sum unused */
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) acc[r][k] = V_ZERO();
        }
        /* the 4 keys' rows ahead (q8_0: in the next tile, whose scales are read all at once as it starts) and
         * their values, one range each: a range a row (2 lines of f16) cost f16's scores on a Zen 4 core 9.1
         * against 6.6 ns a key in L2, the prefetch loops' own instructions */
        const size_t ahead = T == KVC_KV_Q8_0 ? (size_t)KVC_KV_TILE * t->kstride : (size_t)KVC_KV_PF;
        kvc_prefetch_lines(row[0] + ahead, (size_t)nk * t->kstride);
        kvc_prefetch_lines(t->v + (size_t)j * t->vstride, (size_t)nk * t->vstride);
        for (int e = 0; e < d; e += VL)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int jk = j + (k < nk ? k : 0);
                const vf x = row_vec(T, row[k], e, ks + e / KVC_Q8_0_BLOCK * KVC_KV_TILE + jk);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) acc[r][k] = V_FMA(V_LOAD(Q + r * d + e), x, acc[r][k]);
            }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const __m128 s = kvc_kv_sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            kvc_kv_store4(S + r * ls + j, s, nk);
        }
    }
}

/* O[NR, d] += sum_j P[r ls + j] v_j over the tile's values j < n: 4 vectors of O in registers at a time, each
 * value row's 4 vectors widened once for all NR rows. q8_0: v_j = s_jb c_j in block b, so P s is formed once
 * per row and block (W[(r NB_MAX + b) KVC_KV_TILE + j]) and multiplies the bare codes */
static inline __attribute__((always_inline)) void pv_nr(const int T, const int NR, const kvc_kv_tile *t, const float *P,
                                                        int ls, int n, float *O, const float *vs) {
    const int d = t->d, nb = d / KVC_Q8_0_BLOCK;
    float W[T == KVC_KV_Q8_0 ? NR_MAX * NB_MAX * KVC_KV_TILE : 1];
    if (T == KVC_KV_Q8_0)
        for (int r = 0; r < NR; r++)
            for (int b = 0; b < nb; b++)
                for (int j = 0; j < n; j += VL) {
                    const vf p = V_LOADM(P + r * ls + j, V_MASK(n - j));
                    V_STORE(W + (r * NB_MAX + b) * KVC_KV_TILE + j, V_MUL(p, V_LOAD(vs + b * KVC_KV_TILE + j)));
                }
    for (int c0 = 0; c0 < d; c0 += 4 * VL) {
        vf o[NR_MAX][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) o[r][c] = V_LOAD(O + r * d + c0 + c * VL);
        for (int j = 0; j < n; j++) {
            const uint8_t *row = t->v + (size_t)j * t->vstride;
            vf x[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) x[c] = row_vec(T, row, c0 + c * VL, NULL);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const float *w = T == KVC_KV_Q8_0 ? W + (r * NB_MAX + (c0 + c * VL) / KVC_Q8_0_BLOCK) * KVC_KV_TILE + j
                                                      : P + r * ls + j;
                    o[r][c] = V_FMA(V_BCAST(w), x[c], o[r][c]);
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) V_STORE(O + r * d + c0 + c * VL, o[r][c]);
    }
}

#if defined(KVC_KV_INT16)
/* ---- q8_0 in int16 products (AVX-512 VNNI: kv_simd.h) ----
 * Scores: per query row, q in int16 steps of max |q| / 32767; per 32-channel block the integer dot of those
 * and the codes (vpdpwssd, exact in int32), times the block's scale and summed over blocks in fp32, times
 * the step. 16 keys in the lanes: a block's 16 x 32 code bytes transposed to dword columns (the rows loaded
 * into kvc_kv_transpose's slots in its rotated order, so the keys come out in order), each dword's 4 codes
 * sign-extended by shifts to two pairs of words, which the query's pairs (q8_query) meet.
 * P V: per query row and value block, W = P s in int16 steps of max |W| / 32767 over the tile; a pair of
 * value rows interleaved byte by byte and sign-extended, so each dword lane holds one channel of both rows
 * and one vpdpwssd adds both rows' terms.
 * The float path's work per key was 4 widenings, 4 conversions and 12 FMAs for d 64 and 3 query rows, plus a
 * horizontal sum per 4 keys; here per key and block it is a load, 2 permutes (half an insert and 1.5 of the
 * transposition), 1.5 shifts and 3 vpdpwssd: 13.6 -> 9.3 ns a key in L2 (1.46x), 15.1 -> 13.7 from memory
 * (benchmarks/kv_step_kernels.py; the prefetches by cache line, not by row, were 1 ns of it). The only error
 * beyond fp32 rounding is the int16 rounding of q (scores) and W (P V): at most half a step per code unit of
 * a term (as KIVI's, kv_kivi_step.c). int32 cannot overflow: a block's score lane sums 32 products
 * |q| |c| <= 32767 x 128, a P V lane 64 (2.7e8 < 2^31). */
#define Q8_KS 16 /* keys a scores step puts in its lanes */

/* q in int16 steps into qp [d / 2] (dwords of word pairs): per block and dword u of its codes, channels
 * (4u, 4u + 2) of the block, then (4u + 1, 4u + 3), as the shifted codes' words come; returns the step */
static inline __attribute__((always_inline)) float q8_query(const float *q, int d, int32_t *qp) {
    int16_t qi[256];
    const float step = kvc_kv_to_int16(q, d, qi);
    /* word w of 32 channels: dword w / 2 = (u, parity), its half w % 2: channel w / 4 * 4 + w / 2 % 2 + w % 2 * 2 */
    static const int16_t ix[32] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                   16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
    const __m512i pick = _mm512_loadu_si512(ix);
    for (int c = 0; c < d; c += KVC_Q8_0_BLOCK)
        _mm512_storeu_si512(qp + c / 2, _mm512_permutexvar_epi16(pick, _mm512_loadu_si512(qi + c)));
    return step;
}

/* S[r ls + j] = step[r] sum_b ks_bj (qp[r] . codes_jb) for NR rows and the tile's keys j < n (ks: the key
 * scales' table, q8_scales) */
static inline __attribute__((always_inline)) void q8_scores_nr(const int NR, const kvc_kv_tile *t, const int32_t *qp,
                                                               const float *step, const float *ks, int n, float *S, int ls,
                                                               int pf) {
    const int d = t->d, nb = d / KVC_Q8_0_BLOCK;
    for (int j = 0; j < n; j += Q8_KS) {
        const int nk = n - j < Q8_KS ? n - j : Q8_KS;
        const uint8_t *row[Q8_KS];
#pragma GCC unroll 16
        for (int k = 0; k < Q8_KS; k++) row[k] = t->k + (size_t)(j + (k < nk ? k : 0)) * t->kstride; /* past n: a row again, its lane not stored */
        if (pf) /* the lines of these keys' rows in the next tile, into L2 (above); P V fetches the values' */
            kvc_prefetch_lines_l2(row[0] + (size_t)KVC_KV_TILE * t->kstride, (size_t)nk * t->kstride);
        vf f[NR_MAX];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) f[r] = V_ZERO();
        for (int b = 0; b < nb; b++) {
            const size_t at = (size_t)b * KVC_Q8_0_BYTES + 2;
            __m512i z[8], acc[NR_MAX][2]; /* two sums a row: one chain of 16 dependent vpdpwssd was the bound */
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) /* slots 2i, 2i + 1: keys i, i + 8 (the rotated order) */
                z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row[i] + at))),
                                          _mm256_loadu_si256((const __m256i *)(row[i + 8] + at)), 1);
            kvc_kv_transpose(8, z);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const __m512i ev = _mm512_srai_epi16(_mm512_slli_epi16(z[u], 8), 8), od = _mm512_srai_epi16(z[u], 8);
                const int32_t *w = qp + (b * 8 + u) * 2;
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    acc[r][0] = kvc_dpwssd_bcast(acc[r][0], ev, w + r * d / 2);
                    acc[r][1] = kvc_dpwssd_bcast(acc[r][1], od, w + r * d / 2 + 1);
                }
            }
            const vf sb = V_LOAD(ks + b * KVC_KV_TILE + j);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) f[r] = V_FMA(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[r][0], acc[r][1])), sb, f[r]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) V_STOREM(S + r * ls + j, V_MASK(nk), V_MUL(f[r], _mm512_set1_ps(step[r])));
    }
}

/* O[NR, d] += sum_j W_rbj codes_jb per value block b, W in int16 pairs (wp[(r nb + b) KVC_KV_TILE / 2 + j / 2]:
 * rows j, j + 1) of steps wstep[r nb + b]; 64 channels (2 blocks) in registers at a time. With pf, each pair
 * of rows prefetches the pair a tile on into L2 (the next tile's values, as the scores fetch its keys: the two
 * streams spread over the whole step, where the scores had asked for this tile's values and the next
 * keys at once, queued on the line fill buffers: 14.4 -> 12.5 ns a key from memory, with kv_simd.h's one
 * store per 32 int16 values) */
static inline __attribute__((always_inline)) void q8_pv_nr(const int NR, const kvc_kv_tile *t, const int32_t *wp,
                                                           const float *wstep, int n, float *O, int pf) {
    const int d = t->d, nb = d / KVC_Q8_0_BLOCK;
    /* a pair's unpacked halves hold channels {0..7, 16..23} and {8..15, 24..31} of a block: back in order */
    const __m512i lo16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi16 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int b0 = 0; b0 < nb; b0 += 2) { /* d is a multiple of 64 (kvc_cpu_kv_rows_ok) */
        __m512i acc[NR_MAX][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
        for (int j = 0; j < n; j += 2) {
            const uint8_t *a = t->v + (size_t)j * t->vstride, *c = j + 1 < n ? a + t->vstride : a; /* past n: weight 0 */
            if (pf && b0 == 0) kvc_prefetch_lines_l2(a + (size_t)KVC_KV_TILE * t->vstride, 2 * t->vstride);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const size_t at = (size_t)(b0 + h) * KVC_Q8_0_BYTES + 2;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a + at)), y = _mm256_loadu_si256((const __m256i *)(c + at));
                const __m512i lo = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(x, y)), hi = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(x, y));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const __m512i w = _mm512_set1_epi32(wp[(size_t)(r * nb + b0 + h) * KVC_KV_TILE / 2 + j / 2]);
                    acc[r][2 * h] = kvc_dpwssd(acc[r][2 * h], lo, w);
                    acc[r][2 * h + 1] = kvc_dpwssd(acc[r][2 * h + 1], hi, w);
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const vf sc = _mm512_set1_ps(wstep[r * nb + b0 + h]);
                const vf a = V_MUL(_mm512_cvtepi32_ps(acc[r][2 * h]), sc), b = V_MUL(_mm512_cvtepi32_ps(acc[r][2 * h + 1]), sc);
                float *o = O + r * d + (b0 + h) * KVC_Q8_0_BLOCK;
                V_STORE(o, V_ADD(V_LOAD(o), _mm512_permutex2var_ps(a, lo16, b)));
                V_STORE(o + VL, V_ADD(V_LOAD(o + VL), _mm512_permutex2var_ps(a, hi16, b)));
            }
    }
}

#elif defined(KVC_KV_INT16_AVX2)
/* ---- q8_0 in int16 products on AVX2 (vpmaddwd) ----
 * The products of the AVX-512 VNNI section's spec (above; the tests hold both to it): per query row, q in int16
 * steps; per key and 32-code block the integer dot of those and the codes, times the block's scale, summed over
 * blocks in fp32, times the step; per query row and value block, W = P s in int16 steps. One vpmaddwd makes
 * 16 int16 products (8 pairs summed) where an FMA makes 8 float ones, and on a Zen 2 core it issues as often
 * (12 independent ones 3.6 ns, 12 FMAs 4.2): the float path's widening of each code to f32 and its scaling go.
 * Scores: a key's block as two vectors of 16 codes widened to int16, met by the row's q in natural order; 4
 * keys' lanes summed by horizontal adds in int32 (the block's dot exact: 32 products of <= 32767 x 128 < 2^31),
 * then converted and multiplied by the 4 keys' scales at once (a conversion and an FMA per key and block a row,
 * as the lanes were first: 9.2 -> 9.0 ns a key in L2). All: 23.7 -> 18.8 ns a key in L2, 24.5 -> 19.7 from
 * memory (Zen 2, benchmarks/kv_step_kernels.py); the step at 8k tokens 32.8 -> 37.2 tok/s. P V: a pair of value
 * rows interleaved byte by byte and widened (each dword: one channel of both rows), met by the pair's W
 * broadcast; int32 over the tile (64 products of <= 32767 x 128 < 2^31). Its values prefetched a tile ahead in
 * P V (into L2 or L1, as the VNNI path's) measured no faster than this tile's in the scores (19.1 against 18.8). */

/* q in int16 steps into qp [d / 2] (as int16, in channel order); returns the step */
static inline __attribute__((always_inline)) float q8_query(const float *q, int d, int32_t *qp) {
    return kvc_kv_to_int16(q, d, (int16_t *)qp);
}

static inline __attribute__((always_inline)) void q8_scores_nr(const int NR, const kvc_kv_tile *t, const int32_t *qp,
                                                               const float *step, const float *ks, int n, float *S, int ls,
                                                               int pf) {
    const int d = t->d, nb = d / KVC_Q8_0_BLOCK;
    const int16_t *qi = (const int16_t *)qp;
    for (int j = 0; j < n; j += 4) {
        const int nk = n - j < 4 ? n - j : 4;
        const uint8_t *row[4];
        __m128 acc[NR_MAX]; /* 4 keys' scores a row */
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) row[k] = t->k + (size_t)(j + (k < nk ? k : 0)) * t->kstride; /* past n: a row again, its score unused */
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[r] = _mm_setzero_ps();
        if (pf) { /* as the float path's: the keys a tile on, this tile's values */
            kvc_prefetch_lines(row[0] + (size_t)KVC_KV_TILE * t->kstride, (size_t)nk * t->kstride);
            kvc_prefetch_lines(t->v + (size_t)j * t->vstride, (size_t)nk * t->vstride);
        }
        for (int b = 0; b < nb; b++) {
            __m256i p[NR_MAX][4]; /* the integer dots' lanes, a row and key */
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const uint8_t *c = row[k] + (size_t)b * KVC_Q8_0_BYTES + 2;
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
                const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const int16_t *w = qi + (size_t)r * d + b * KVC_Q8_0_BLOCK;
                    p[r][k] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)w)),
                                               _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(w + 16))));
                }
            }
            /* each row's 4 dots summed in int32 (exact), then converted and scaled once for the 4 keys */
            const __m128 sc = _mm_loadu_ps(ks + b * KVC_KV_TILE + j); /* the table is padded past n */
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[r][0], p[r][1]), _mm256_hadd_epi32(p[r][2], p[r][3]));
                const __m128i d4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(d4), sc, acc[r]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) kvc_kv_store4(S + r * ls + j, _mm_mul_ps(acc[r], _mm_set1_ps(step[r])), nk);
    }
}

/* O[NR, d] += wstep[r nb + b] sum_j W_rbj codes_jb per value block b (W as int16 at
 * wp[(r nb + b) KVC_KV_TILE / 2 + j / 2], pairs of rows j, j + 1), one block of 32 channels in registers at a time */
static inline __attribute__((always_inline)) void q8_pv_nr(const int NR, const kvc_kv_tile *t, const int32_t *wp,
                                                           const float *wstep, int n, float *O, int pf) {
    (void)pf; /* the scores fetched this tile's values */
    const int d = t->d, nb = d / KVC_Q8_0_BLOCK;
    for (int b = 0; b < nb; b++) {
        __m256i acc[NR_MAX][4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_si256();
        for (int j = 0; j < n; j += 2) {
            const uint8_t *a = t->v + (size_t)j * t->vstride + (size_t)b * KVC_Q8_0_BYTES + 2;
            const uint8_t *e = j + 1 < n ? a + t->vstride : a; /* past n: the row again, its weight 0 */
            __m256i w[NR_MAX];
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) w[r] = _mm256_set1_epi32(wp[(size_t)(r * nb + b) * KVC_KV_TILE / 2 + j / 2]);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) { /* channels 16 h .. 16 h + 15: two vectors of 8 channels x 2 rows */
                const __m128i x = _mm_loadu_si128((const __m128i *)(a + 16 * h)), y = _mm_loadu_si128((const __m128i *)(e + 16 * h));
                const __m256i u0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y)), u1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    acc[r][2 * h] = _mm256_add_epi32(acc[r][2 * h], _mm256_madd_epi16(u0, w[r]));
                    acc[r][2 * h + 1] = _mm256_add_epi32(acc[r][2 * h + 1], _mm256_madd_epi16(u1, w[r]));
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const vf sc = _mm256_set1_ps(wstep[r * nb + b]);
            float *o = O + r * d + b * KVC_Q8_0_BLOCK;
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) V_STORE(o + c * VL, V_ADD(V_LOAD(o + c * VL), V_MUL(_mm256_cvtepi32_ps(acc[r][c]), sc)));
        }
    }
}
#endif

#if defined(KVC_KV_Q8_INT16)
/* the queries in int16 steps are the task's (qc) when it keeps them: rounded on its first tile (3 rows' rounding
 * a tile was 6% of the kernel's instructions at d 64) */
static inline __attribute__((always_inline)) void q8_scores_of(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S,
                                                               int ls, kvc_kv_query *qc) {
    const int d = t->d, keep = qc && rows <= KVC_KV_QROWS;
    float ks[NB_MAX * KVC_KV_TILE], own_step[NR_MAX];
    int32_t own_qp[NR_MAX * 128];
    if (keep && (qc->q != Q || qc->rows != rows || qc->d != d)) qc->ready = 0, qc->q = Q, qc->rows = rows, qc->d = d;
    q8_scales(t->k, t->kstride, n, d / KVC_Q8_0_BLOCK, ks);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
        float *step = keep ? qc->step + r0 : own_step;
        int32_t *qp = keep ? qc->qp + (size_t)r0 * d / 2 : own_qp;
        if (!keep || !qc->ready)
            for (int r = 0; r < nr; r++) step[r] = q8_query(Q + (size_t)(r0 + r) * d, d, qp + r * d / 2);
#define SCORES(NR) q8_scores_nr(NR, t, qp, step, ks, n, S + (size_t)r0 * ls, ls, r0 == 0) /* the first rows prefetch */
        KVC_NR_CASES(SCORES)
#undef SCORES
    }
    if (keep) qc->ready = 1;
}

static inline __attribute__((always_inline)) void q8_pv_of(const kvc_kv_tile *t, const float *P, int ls, int rows, int n,
                                                           float *O) {
    const int d = t->d, nb = d / KVC_Q8_0_BLOCK;
    float vs[NB_MAX * KVC_KV_TILE], wstep[NR_MAX * NB_MAX], w[KVC_KV_TILE];
    int32_t wp[NR_MAX * NB_MAX * KVC_KV_TILE / 2];
    q8_scales(t->v, t->vstride, n, nb, vs);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
        for (int r = 0; r < nr; r++) /* W = P s in int16 steps, per row and block */
            for (int b = 0; b < nb; b++) {
                for (int j = 0; j < n; j += VL) {
                    const vmask mk = V_MASK(n - j);
                    V_STORE(w + j, V_MUL(V_LOADM(P + (size_t)(r0 + r) * ls + j, mk), V_LOADM(vs + b * KVC_KV_TILE + j, mk)));
                }
                wstep[r * nb + b] = kvc_kv_to_int16(w, n, (int16_t *)(wp + (size_t)(r * nb + b) * KVC_KV_TILE / 2));
            }
#define PV(NR) q8_pv_nr(NR, t, wp, wstep, n, O + (size_t)r0 * d, r0 == 0) /* the first rows prefetch */
        KVC_NR_CASES(PV)
#undef PV
    }
}
#endif

static inline __attribute__((always_inline)) void scores_of(const int T, const kvc_kv_tile *t, const float *Q, int rows, int n,
                                                            float *S, int ls) {
    float ks[T == KVC_KV_Q8_0 ? NB_MAX * KVC_KV_TILE : 1];
    if (T == KVC_KV_Q8_0) q8_scales(t->k, t->kstride, n, t->d / KVC_Q8_0_BLOCK, ks);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
#define SCORES(NR) scores_nr(T, NR, t, Q + (size_t)r0 * t->d, n, S + (size_t)r0 * ls, ls, ks)
        KVC_NR_CASES(SCORES)
#undef SCORES
    }
}

static inline __attribute__((always_inline)) void pv_of(const int T, const kvc_kv_tile *t, const float *P, int ls, int rows,
                                                        int n, float *O) {
    float vs[T == KVC_KV_Q8_0 ? NB_MAX * KVC_KV_TILE : 1];
    if (T == KVC_KV_Q8_0) q8_scales(t->v, t->vstride, n, t->d / KVC_Q8_0_BLOCK, vs);
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
#define PV(NR) pv_nr(T, NR, t, P + (size_t)r0 * ls, ls, n, O + (size_t)r0 * t->d, vs)
        KVC_NR_CASES(PV)
#undef PV
    }
}
#endif

int kvc_cpu_kv_rows_ok(const kvc_kv_format *f, int32_t d) {
#if defined(KVC_KV_SIMD)
    /* whole blocks of 4 vectors (q8_0: a vector inside one block of 32) */
    const int typed = f->type == KVC_KV_F16 || f->type == KVC_KV_BF16 || f->type == KVC_KV_Q8_0;
    return typed && d % (4 * VL) == 0 && d <= 256 && (f->type != KVC_KV_Q8_0 || d % KVC_Q8_0_BLOCK == 0);
#else
    (void)f, (void)d;
    return 0;
#endif
}

void kvc_cpu_kv_rows_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls, kvc_kv_query *qc) {
    (void)qc; /* q8_0 in int16 products keeps its queries there; the float products read Q itself */
#if defined(KVC_KV_SIMD)
    switch (t->f->type) {
    case KVC_KV_F16: scores_of(KVC_KV_F16, t, Q, rows, n, S, ls); break;
    case KVC_KV_BF16: scores_of(KVC_KV_BF16, t, Q, rows, n, S, ls); break;
#if defined(KVC_KV_Q8_INT16)
    default: q8_scores_of(t, Q, rows, n, S, ls, qc); break;
#else
    default: scores_of(KVC_KV_Q8_0, t, Q, rows, n, S, ls); break;
#endif
    }
#else
    (void)t, (void)Q, (void)rows, (void)n, (void)S, (void)ls;
#endif
}

void kvc_cpu_kv_rows_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O) {
#if defined(KVC_KV_SIMD)
    switch (t->f->type) {
    case KVC_KV_F16: pv_of(KVC_KV_F16, t, P, ls, rows, n, O); break;
    case KVC_KV_BF16: pv_of(KVC_KV_BF16, t, P, ls, rows, n, O); break;
#if defined(KVC_KV_Q8_INT16)
    default: q8_pv_of(t, P, ls, rows, n, O); break;
#else
    default: pv_of(KVC_KV_Q8_0, t, P, ls, rows, n, O); break;
#endif
    }
#else
    (void)t, (void)P, (void)ls, (void)rows, (void)n, (void)O;
#endif
}
