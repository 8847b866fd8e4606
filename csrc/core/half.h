/* 16-bit floats on the host and the device: IEEE half (f16) and bfloat16, both ways, one home (the K/V
 * store types, the model loaders' conversions, the native-weight decoders). Static inline, plain C; CUDA
 * translation units include it too. */
#ifndef KVC_HALF_H
#define KVC_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define KVC_HALF_FN __host__ __device__ static inline
#else
#define KVC_HALF_FN static inline
#endif

/* ---- 16-bit floats: round to nearest even, NaN kept quiet ---- */
KVC_HALF_FN uint16_t kvc_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);            /* NaN */
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);           /* rounds past 65504: inf */
    if (x < 0x38800000u) {                                              /* below 2^-14: subnormal or 0 */
        if (x < 0x33000000u) return (uint16_t)sign;                     /* below half the least subnormal */
        const uint32_t m = (x & 0x7fffffu) | 0x800000u, sh = 126u - (x >> 23); /* 14..24 */
        uint32_t h = m >> sh;
        const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((x >> 13) - (112u << 10));
    const uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* branch-free, so that element loops vectorise; exact for every input (tests check all 65536) */
KVC_HALF_FN float kvc_f16_to_f32v(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    const float sub = (float)em * 0x1p-24f;
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    const uint32_t norm = (em << 13) + (112u << 23);
    const uint32_t is_norm = 0u - (uint32_t)(em >= 0x0400u), is_inf = 0u - (uint32_t)(em >= 0x7c00u);
    const uint32_t bits = (((norm + (is_inf & (112u << 23))) & is_norm) | (sub_bits & ~is_norm)) |
                          ((uint32_t)(h & 0x8000u) << 16);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

KVC_HALF_FN uint16_t kvc_f32_to_bf16r(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
KVC_HALF_FN float kvc_bf16_to_f32r(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
