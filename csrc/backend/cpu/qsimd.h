/* Which integer instructions the native-weight kernels (quant.c, quant_k.c) are built with, and the
 * one u8 x s8 dot product they all use. KVC_QSIMD is 512 with AVX-512 VNNI (vpdpbusd, and the packed
 * GEMV's 16-row groups in one register), 256 with AVX2 + FMA + F16C (vpmaddubsw + vpmaddwd: the same
 * sums while each pair of products fits int16, which every caller's codes guarantee: codes <= 63
 * against activations in [-127, 127], or Q8_0's signed codes through kvc_dot_s8), else undefined (the
 * plain-C references run). Internal to backend/cpu. */
#ifndef KVC_CPU_QSIMD_H
#define KVC_CPU_QSIMD_H

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#define KVC_QSIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVC_QSIMD 256
#endif

#if defined(KVC_QSIMD)
#include <immintrin.h>

/* acc + per 32-bit lane sum of 4 products u[i] s[i] (u unsigned bytes, s signed) */
static inline __m256i kvc_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if KVC_QSIMD == 512
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* signed x signed bytes: |w| against a with w's sign (|w| <= 128 and |a| <= 127 keep AVX2's pairs in
 * int16; a is never -128: kvc_cpu_quantize_q8 rounds to [-127, 127]) */
static inline __m256i kvc_dot_s8(__m256i w, __m256i a) {
    return kvc_dpbusd(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
}

static inline float kvc_hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

#endif
