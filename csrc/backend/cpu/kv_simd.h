/* What the K/V decode-step kernels share (kv_decode.c, kv_rows_step.c, kv_kivi_step.c): the build tests for
 * them, prefetches, 4-key sums, and for the int16 products the rounding to int16 and the transposition of a
 * slab of 16 rows. Internal to the CPU backend. */
#ifndef KVC_CPU_KV_SIMD_H
#define KVC_CPU_KV_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* AVX-512 (512), or AVX2 + FMA + F16C (256): the vectorised tile decoders and decode steps; other builds
 * decode tiles with core/kv_type.h's plain-C decoders */
#if defined(__AVX512F__)
#if defined(__AVX512BW__) /* cpu.h's vectors are 512-bit wherever AVX-512F is: no 256-bit path beside them */
#define KVC_KV_SIMD 512
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVC_KV_SIMD 256
#endif

#if defined(KVC_KV_SIMD)
#include <immintrin.h>

#include "cpu.h"

/* Bytes ahead of the row being read that a decode step prefetches: the cache streams from memory, and a
 * store's next tile follows this one */
#define KVC_KV_PF 1024

/* the rows KVC_KV_PF bytes on (cpu.h's kvc_prefetch_lines asks for the rows themselves) */
static inline __attribute__((always_inline)) void kvc_kv_prefetch(const uint8_t *row, size_t bytes) {
    kvc_prefetch_lines(row + KVC_KV_PF, bytes);
}

/* the f16 value at p */
static inline float kvc_kv_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the sums of a0..a3 (4 scores at once: one reduction per 4 keys; the f32 attention's order, attention.c) */
static inline __m128 kvc_kv_sum4(vf a0, vf a1, vf a2, vf a3) {
#if KVC_KV_SIMD == 512
    const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 y = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    const __m256 w = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
    return _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
#else
    const __m256 z = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
#endif
}

/* the first nk (1..4) of 4 scores into dst */
static inline void kvc_kv_store4(float *dst, __m128 s, int nk) {
    if (nk == 4) {
        _mm_storeu_ps(dst, s);
        return;
    }
    float s4[4];
    _mm_storeu_ps(s4, s);
    for (int k = 0; k < nk; k++) dst[k] = s4[k];
}

/* x rounded to int16 steps of max |x| / 32767 (the step): n values of x at a time VL, into q (n padded to
 * VL with zeros); returns the step, NaN where an x is NaN (the products then are, as fp32 ones would be:
 * max would drop it, and its code would be a finite -32768). The same codes on AVX-512 and AVX2 for finite x
 * (with a NaN only the step, NaN on both, is the same): x times 32767 / max |x| in fp32, rounded to nearest
 * (ties to even). */
static inline __attribute__((always_inline)) float kvc_kv_to_int16(const float *x, int n, int16_t *q) {
#if KVC_KV_SIMD == 512
    vf mx = V_ZERO();
    __mmask16 nan = 0;
    for (int i = 0; i < n; i += VL) {
        const vf v = V_LOADM(x + i, V_MASK(n - i));
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float M = _mm512_reduce_max_ps(mx), inv = M > 0 ? 32767.0f / M : 0.0f;
#define KVC_TO_I16(i) _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(V_LOADM(x + (i), V_MASK(n - (i))), _mm512_set1_ps(inv))))
    int i = 0;
    /* 32 at a time in one 64-byte store: callers read q back 32 at a time, and a load that spans two stores
     * waits for both to retire instead of being forwarded (that read was 7.5% of kivi4's scores' samples, 1.6% after) */
    for (; i + 2 * VL <= n; i += 2 * VL)
        _mm512_storeu_si512(q + i, _mm512_inserti64x4(_mm512_castsi256_si512(KVC_TO_I16(i)), KVC_TO_I16(i + VL), 1));
    for (; i < n; i += VL) _mm256_storeu_si256((__m256i *)(q + i), KVC_TO_I16(i));
#undef KVC_TO_I16
    return nan ? NAN : M / 32767.0f;
#else
    const vf abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    vf mx = V_ZERO(), nan = V_ZERO();
    for (int i = 0; i < n; i += VL) {
        const vf v = V_LOADM(x + i, V_MASK(n - i));
        mx = _mm256_max_ps(mx, _mm256_and_ps(v, abs));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float M = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))), inv = M > 0 ? 32767.0f / M : 0.0f;
#define KVC_TO_I32(i) _mm256_cvtps_epi32(_mm256_mul_ps(V_LOADM(x + (i), V_MASK(n - (i))), _mm256_set1_ps(inv)))
    int i = 0;
    /* 16 at a time in one 32-byte store, as the kernels read them back (above) */
    for (; i + 2 * VL <= n; i += 2 * VL)
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(KVC_TO_I32(i), KVC_TO_I32(i + VL)), 0xD8));
    for (; i < n; i += VL) {
        const __m256i c = KVC_TO_I32(i);
        _mm_storeu_si128((__m128i *)(q + i), _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
    }
#undef KVC_TO_I32
    return _mm256_movemask_ps(nan) ? NAN : M / 32767.0f;
#endif
}

/* Builds whose decode steps multiply int16 weights by the codes: AVX-512 VNNI for q8_0's (kv_rows_step.c),
 * and VBMI besides for KIVI's byte permutes (kv_kivi_step.c) */
#if KVC_KV_SIMD == 256
#define KVC_KV_INT16_AVX2 1 /* q8_0's in vpmaddwd (kv_rows_step.c) */
#endif
#if KVC_KV_SIMD == 512 && defined(__AVX512VNNI__)
#define KVC_KV_INT16 1
#if defined(__AVX512VBMI__)
#define KVC_KV_INT16_KIVI 1
#endif

/* acc + the sums of pairs of int16 products of a and b (vpdpwssd), the accumulator updated in place: in the
 * kernels' unrolled loops GCC 12 copies each accumulator of _mm512_dpwssd_epi32 out to a scratch register and
 * back (24 register moves for the 12 products of a pair of keys in KIVI's P V); the asm's tied operand keeps
 * it where it lives */
static inline __attribute__((always_inline)) __m512i kvc_dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* the same with b the int32 at w broadcast, read by the instruction itself (vpdpwssd's {1to16} operand: one
 * micro-fused load, where a broadcast into a register first is a load of its own) */
static inline __attribute__((always_inline)) __m512i kvc_dpwssd_bcast(__m512i acc, __m512i a, const int32_t *w) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));
    return acc;
}

/* Transposition of a slab of 16 key rows' dwords, T = 8 or 4 dwords of each: z[i] holds slots 16 / T i..
 * (T dwords each, in order), and z[u] lane l becomes dword u of slot (l % T) 16 / T + l / T, by log2 T
 * exchanges of a vector index bit with a lane bit (each a pair of two-source permutes). Slots come out in
 * the lanes so rotated: a permute by KVC_KV_SLOT_ORDER[T == 8] puts them in order (lane i = slot i), or a
 * caller loads its rows into the slots in the rotated order and needs none. */
static const int32_t KVC_KV_XCHG[3][2][16] = {
    {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}, {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
    {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
    {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}}};
static const int32_t KVC_KV_SLOT_ORDER[2][16] = {{0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15}, /* T = 4 */
                                                 {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15}}; /* T = 8 */
static inline __attribute__((always_inline)) void kvc_kv_transpose(const int T, __m512i *z) {
#pragma GCC unroll 3
    for (int s = 0; (1 << s) < T; s++) {
        const int b = 1 << s;
        const __m512i lo = _mm512_loadu_si512(KVC_KV_XCHG[s][0]), hi = _mm512_loadu_si512(KVC_KV_XCHG[s][1]);
#pragma GCC unroll 8
        for (int a = 0; a < T; a++)
            if (!(a & b)) {
                const __m512i x = _mm512_permutex2var_epi32(z[a], lo, z[a | b]);
                z[a | b] = _mm512_permutex2var_epi32(z[a], hi, z[a | b]);
                z[a] = x;
            }
    }
}
#endif /* KVC_KV_INT16 */
/* q8_0's decode step multiplies int16 codes (either path above; kv_rows_step.c) */
#if defined(KVC_KV_INT16) || defined(KVC_KV_INT16_AVX2)
#define KVC_KV_Q8_INT16 1
#endif
#endif

/* A kernel that keeps NR query rows in registers, called with nr (1..4) as a constant */
#define KVC_NR_CASES(CALL)   \
    switch (nr) {            \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    default: CALL(4); break; \
    }

#endif
