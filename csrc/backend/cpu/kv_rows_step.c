/* The decode step on rows stored alone in f16, bf16 or q8_0 (kv_decode.h: kvc_cpu_kv_scores, kvc_cpu_kv_pv on
 * such a tile), read where they lie: each vector of a key or value row is widened to f32 in registers and used
 * at once, instead of a tile decoded into a buffer and read back (which cost a q8_0 cache's decode step a
 * third of its time: 9 of 28 ms at 8k tokens on SmolLM2). The arithmetic is the tile decoders' (f16 and bf16
 * widen exactly, q8_0's d q rounds once) and the f32 attention's (attention.c: scores_dot's products and
 * 4-key reductions, pv_tile's updates, in the same order), so on AVX-512 the scores and outputs equal the
 * decoded path's bit for bit; the tests hold both to the same references. */
#include "kv_decode.h"

#include "../../core/kv_type.h"
#include "kv_simd.h"

#if defined(KVC_KV_SIMD)

#define NR_MAX 4 /* query rows a kernel keeps in registers */

/* channels [e, e + VL) of a row of type T, as f32 */
static inline __attribute__((always_inline)) vf row_vec(const int T, const uint8_t *row, int e) {
#if KVC_KV_SIMD == 512
    if (T == KVC_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * e)));
    if (T == KVC_KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * e))), 16));
    const uint8_t *b = row + (size_t)(e / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES; /* a vector lies in one block */
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + e % KVC_Q8_0_BLOCK))));
    return _mm512_mul_ps(_mm512_set1_ps(kvc_kv_half(b)), q);
#else
    if (T == KVC_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * e)));
    if (T == KVC_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * e))), 16));
    const uint8_t *b = row + (size_t)(e / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES;
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + e % KVC_Q8_0_BLOCK))));
    return _mm256_mul_ps(_mm256_set1_ps(kvc_kv_half(b)), q);
#endif
}

/* S[r ls + j] = Q[r] . k_j for NR rows and the tile's keys j < n, 4 keys at a time */
static inline __attribute__((always_inline)) void scores_nr(const int T, const int NR, const kvc_kv_tile *t, const float *Q,
                                                            int n, float *S, int ls) {
    const int d = t->d;
    for (int j = 0; j < n; j += 4) {
        const int nk = n - j < 4 ? n - j : 4;
        const uint8_t *row[4];
        vf acc[NR_MAX][4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            row[k] = t->k + (size_t)(j + (k < nk ? k : 0)) * t->kstride; /* past n: a row again, its sum unused */
            kvc_kv_prefetch(row[k], t->kstride);
            kvc_kv_prefetch_now(t->v + (size_t)(j + (k < nk ? k : 0)) * t->vstride, t->vstride);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) acc[r][k] = V_ZERO();
        }
        for (int e = 0; e < d; e += VL)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const vf x = row_vec(T, row[k], e);
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
 * value row's 4 vectors widened once for all NR rows */
static inline __attribute__((always_inline)) void pv_nr(const int T, const int NR, const kvc_kv_tile *t, const float *P,
                                                        int ls, int n, float *O) {
    const int d = t->d;
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
            for (int c = 0; c < 4; c++) x[c] = row_vec(T, row, c0 + c * VL);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const vf p = V_BCAST(P + r * ls + j);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) o[r][c] = V_FMA(p, x[c], o[r][c]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) V_STORE(O + r * d + c0 + c * VL, o[r][c]);
    }
}

static inline __attribute__((always_inline)) void scores_of(const int T, const kvc_kv_tile *t, const float *Q, int rows, int n,
                                                            float *S, int ls) {
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
#define SCORES(NR) scores_nr(T, NR, t, Q + (size_t)r0 * t->d, n, S + (size_t)r0 * ls, ls)
        KVC_NR_CASES(SCORES)
#undef SCORES
    }
}

static inline __attribute__((always_inline)) void pv_of(const int T, const kvc_kv_tile *t, const float *P, int ls, int rows,
                                                        int n, float *O) {
    for (int r0 = 0; r0 < rows; r0 += NR_MAX) {
        const int nr = rows - r0 < NR_MAX ? rows - r0 : NR_MAX;
#define PV(NR) pv_nr(T, NR, t, P + (size_t)r0 * ls, ls, n, O + (size_t)r0 * t->d)
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

void kvc_cpu_kv_rows_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls) {
#if defined(KVC_KV_SIMD)
    switch (t->f->type) {
    case KVC_KV_F16: scores_of(KVC_KV_F16, t, Q, rows, n, S, ls); break;
    case KVC_KV_BF16: scores_of(KVC_KV_BF16, t, Q, rows, n, S, ls); break;
    default: scores_of(KVC_KV_Q8_0, t, Q, rows, n, S, ls); break;
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
    default: pv_of(KVC_KV_Q8_0, t, P, ls, rows, n, O); break;
    }
#else
    (void)t, (void)P, (void)ls, (void)rows, (void)n, (void)O;
#endif
}
