/* What the K/V decode-step kernels share (kv_decode.c, kv_rows_step.c): the build test for them and three
 * small helpers. Internal to the CPU backend. */
#ifndef KVC_CPU_KV_SIMD_H
#define KVC_CPU_KV_SIMD_H

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

/* the rows KVC_KV_PF bytes on, a cache line at a time */
/* always inlined: a function of prefetches alone looks free of effects to GCC, which drops calls to it */
static inline __attribute__((always_inline)) void kvc_kv_prefetch(const uint8_t *row, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + KVC_KV_PF + o, _MM_HINT_T0);
}

/* the rows themselves (the values a tile's P V will read, fetched during its scores) */
static inline __attribute__((always_inline)) void kvc_kv_prefetch_now(const uint8_t *row, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
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
