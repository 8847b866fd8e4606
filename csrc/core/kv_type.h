/* The K/V cache's storage types (issue 27): one row of a table per type, the formats' one home.
 *
 * A store keeps every (layer, KV head) row in the session's type:
 *   f32, f16, bf16  each value as a float of that width;
 *   q8_0            GGUF's Q8_0 per row: blocks of 32 values, an f16 scale d = max|x| / 127 and 32 int8
 *                   q = round(x / d) (the last block of a row zero-padded);
 *   kivi4, kivi2    KIVI (Liu et al. 2024, transformers' QuantizedCache): asymmetric min-max codes of 4 or
 *                   2 bits, x ~ min + q scale with scale = (max - min) / (2^bits - 1), q = round((x - min) /
 *                   scale); keys per channel over groups of `group` consecutive rows (a key block), values
 *                   per row over groups of min(group, d) channels; scale and min as f16. The most recent rows
 *                   wait in f32 (the residual) and a key block is only written once `group` rows fill it:
 *                   after each layer's attention (kv_commit) the residual is quantised when it holds
 *                   `residual` rows or more, in whole blocks (what is left, fewer than `group` rows, stays).
 * Rows a layer appends wait in f32 until that layer's attention has read them (kv_commit): the call's own
 * rows are exact for its own queries, the past is read in the stored type, as transformers' QuantizedCache
 * does. The row formats below are what a store of any backend holds (the CUDA store includes this file).
 *
 * Plain C, static inline: included by C and CUDA translation units. */
#ifndef KVC_KV_TYPE_H
#define KVC_KV_TYPE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../include/kvpress_c.h"
#include "half.h"

#if defined(__CUDACC__)
#define KVC_KVT_FN __host__ __device__ static inline
#else
#define KVC_KVT_FN static inline
#endif

/* ---- the formats' sizes ---- */
#define KVC_Q8_0_BLOCK 32
#define KVC_Q8_0_BYTES 34 /* f16 d, 32 int8 */

KVC_KVT_FN int32_t kvc_kv_type_bits(int32_t t) {
    return t == KVC_KV_F32 ? 32 : t == KVC_KV_F16 || t == KVC_KV_BF16 ? 16 : t == KVC_KV_Q8_0 ? 8 : t == KVC_KV_KIVI4 ? 4 : 2;
}
/* 1: keys quantised per channel over blocks of `group` rows (KIVI); 0: every row stands alone */
KVC_KVT_FN int kvc_kv_type_key_blocks(int32_t t) { return t == KVC_KV_KIVI4 || t == KVC_KV_KIVI2; }
/* the channels of a value group of a KIVI row of width w */
KVC_KVT_FN int32_t kvc_kivi_vgroup(int32_t group, int32_t w) { return group < w ? group : w; }

/* Bytes of one row of `w` values stored alone (every type's values; keys unless key blocks). */
KVC_KVT_FN size_t kvc_kv_row_bytes(const kvc_kv_format *f, int32_t w) {
    switch (f->type) {
    case KVC_KV_F32: return 4 * (size_t)w;
    case KVC_KV_F16:
    case KVC_KV_BF16: return 2 * (size_t)w;
    case KVC_KV_Q8_0: return (size_t)((w + KVC_Q8_0_BLOCK - 1) / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES;
    default: {
        const int32_t g = kvc_kivi_vgroup(f->group, w), bits = kvc_kv_type_bits(f->type);
        return (size_t)(w / g) * (4 + (size_t)g * bits / 8);
    }
    }
}
/* Bytes of a KIVI key block: `group` rows of w channels: scales [w] and mins [w] (f16), then the rows' codes. */
KVC_KVT_FN size_t kvc_kivi_block_bytes(const kvc_kv_format *f, int32_t w) {
    return 4 * (size_t)w + (size_t)f->group * w * kvc_kv_type_bits(f->type) / 8;
}
/* Bytes a store of this type spends on `rows` key rows of width w (key blocks: whole blocks). */
KVC_KVT_FN size_t kvc_kv_key_bytes(const kvc_kv_format *f, int32_t w, int64_t rows) {
    if (kvc_kv_type_key_blocks(f->type)) return (size_t)((rows + f->group - 1) / f->group) * kvc_kivi_block_bytes(f, w);
    return (size_t)rows * kvc_kv_row_bytes(f, w);
}

/* ---- codes of n min-max values: q in [0, 2^bits), packed little end first (4 bits: 2 a byte) ---- */
KVC_KVT_FN void kvc_kivi_params(const float *x, int64_t n, int64_t stride, int32_t bits, uint16_t *scale, uint16_t *mn) {
    float lo = x[0], hi = x[0];
    for (int64_t i = 1; i < n; i++) {
        const float v = x[i * stride];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *mn = kvc_f32_to_f16(lo);
    *scale = kvc_f32_to_f16((hi - lo) / (float)((1 << bits) - 1));
}
KVC_KVT_FN uint32_t kvc_kivi_code(float x, float s, float m, int32_t bits) {
    if (!(s > 0.f)) return 0;
    const float q = rintf((x - m) / s), top = (float)((1 << bits) - 1);
    return (uint32_t)(q < 0.f ? 0.f : q > top ? top : q);
}
KVC_KVT_FN void kvc_kivi_put(uint8_t *codes, int64_t i, uint32_t q, int32_t bits) {
    const int32_t per = 8 / bits, sh = (int32_t)(i % per) * bits;
    uint8_t *b = codes + i / per;
    *b = (uint8_t)((*b & ~(((1u << bits) - 1u) << sh)) | (q << sh));
}
KVC_KVT_FN uint32_t kvc_kivi_get(const uint8_t *codes, int64_t i, int32_t bits) {
    const int32_t per = 8 / bits;
    return (codes[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1u);
}

/* ---- one row alone: encode w f32 values, decode into f32 ---- */
KVC_KVT_FN void kvc_kv_encode_row(const kvc_kv_format *f, const float *x, int32_t w, void *dst) {
    uint8_t *p = (uint8_t *)dst;
    switch (f->type) {
    case KVC_KV_F32: memcpy(p, x, 4 * (size_t)w); return;
    case KVC_KV_F16:
        for (int32_t e = 0; e < w; e++) ((uint16_t *)p)[e] = kvc_f32_to_f16(x[e]);
        return;
    case KVC_KV_BF16:
        for (int32_t e = 0; e < w; e++) ((uint16_t *)p)[e] = kvc_f32_to_bf16r(x[e]);
        return;
    case KVC_KV_Q8_0:
        for (int32_t b0 = 0; b0 < w; b0 += KVC_Q8_0_BLOCK, p += KVC_Q8_0_BYTES) {
            const int32_t nb = w - b0 < KVC_Q8_0_BLOCK ? w - b0 : KVC_Q8_0_BLOCK;
            float amax = 0.f;
            for (int32_t e = 0; e < nb; e++) amax = fabsf(x[b0 + e]) > amax ? fabsf(x[b0 + e]) : amax;
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f; /* as ggml: codes from d, d stored f16 */
            const uint16_t dh = kvc_f32_to_f16(d);
            memcpy(p, &dh, 2);
            for (int32_t e = 0; e < KVC_Q8_0_BLOCK; e++) ((int8_t *)p)[2 + e] = (int8_t)(e < nb ? rintf(x[b0 + e] * id) : 0.f);
        }
        return;
    default: {
        const int32_t g = kvc_kivi_vgroup(f->group, w), bits = kvc_kv_type_bits(f->type);
        for (int32_t g0 = 0; g0 < w; g0 += g, p += 4 + (size_t)g * bits / 8) {
            uint16_t sh, mh;
            kvc_kivi_params(x + g0, g, 1, bits, &sh, &mh);
            memcpy(p, &sh, 2);
            memcpy(p + 2, &mh, 2);
            const float s = kvc_f16_to_f32v(sh), m = kvc_f16_to_f32v(mh);
            memset(p + 4, 0, (size_t)g * bits / 8);
            for (int32_t e = 0; e < g; e++) kvc_kivi_put(p + 4, e, kvc_kivi_code(x[g0 + e], s, m, bits), bits);
        }
        return;
    }
    }
}

/* Values [e0, e0 + n) of a row of w stored alone into out[0 .. n) (a device kernel reads a lane's channels;
 * kvc_kv_decode_row is the whole row). */
KVC_KVT_FN void kvc_kv_decode_span(const kvc_kv_format *f, const void *src, int32_t w, int32_t e0, int32_t n, float *out) {
    const uint8_t *p = (const uint8_t *)src;
    const int32_t e1 = e0 + n;
    switch (f->type) {
    case KVC_KV_F32: memcpy(out, p + 4 * (size_t)e0, 4 * (size_t)n); return;
    case KVC_KV_F16:
        for (int32_t e = e0; e < e1; e++) out[e - e0] = kvc_f16_to_f32v(((const uint16_t *)p)[e]);
        return;
    case KVC_KV_BF16:
        for (int32_t e = e0; e < e1; e++) out[e - e0] = kvc_bf16_to_f32r(((const uint16_t *)p)[e]);
        return;
    case KVC_KV_Q8_0:
        for (int32_t b0 = e0 / KVC_Q8_0_BLOCK * KVC_Q8_0_BLOCK; b0 < e1; b0 += KVC_Q8_0_BLOCK) {
            const uint8_t *blk = p + (size_t)(b0 / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = kvc_f16_to_f32v(dh);
            const int32_t lo = b0 > e0 ? b0 : e0, hi = b0 + KVC_Q8_0_BLOCK < e1 ? b0 + KVC_Q8_0_BLOCK : e1;
            for (int32_t e = lo; e < hi; e++) out[e - e0] = d * (float)((const int8_t *)blk)[2 + e - b0];
        }
        return;
    default: {
        const int32_t g = kvc_kivi_vgroup(f->group, w), bits = kvc_kv_type_bits(f->type);
        for (int32_t g0 = e0 / g * g; g0 < e1; g0 += g) {
            const uint8_t *grp = p + (size_t)(g0 / g) * (4 + (size_t)g * bits / 8);
            uint16_t sh, mh;
            memcpy(&sh, grp, 2);
            memcpy(&mh, grp + 2, 2);
            const float s = kvc_f16_to_f32v(sh), m = kvc_f16_to_f32v(mh);
            const int32_t lo = g0 > e0 ? g0 : e0, hi = g0 + g < e1 ? g0 + g : e1;
            for (int32_t e = lo; e < hi; e++) out[e - e0] = m + s * (float)kvc_kivi_get(grp + 4, e - g0, bits);
        }
        return;
    }
    }
}

KVC_KVT_FN void kvc_kv_decode_row(const kvc_kv_format *f, const void *src, int32_t w, float *out) {
    kvc_kv_decode_span(f, src, w, 0, w, out);
}

/* ---- KIVI key blocks: `group` rows x w channels, each channel quantised over the block's rows ---- */
/* Channels [c0, c0 + nc) of a block from its rows x (row r at x + r ldx). c0 and nc are multiples of the codes a
 * byte holds (8 / bits), so the code bytes written are this call's alone: disjoint channel ranges may be encoded
 * at once (the CUDA store's commit kernel) and every bit of those bytes is written. */
KVC_KVT_FN void kvc_kivi_encode_cols(const kvc_kv_format *f, const float *x, size_t ldx, int32_t w, int32_t c0, int32_t nc,
                                     void *dst) {
    uint8_t *p = (uint8_t *)dst;
    const int32_t G = f->group, bits = kvc_kv_type_bits(f->type);
    uint8_t *codes = p + 4 * (size_t)w;
    for (int32_t c = c0; c < c0 + nc; c++) {
        uint16_t sh, mh;
        kvc_kivi_params(x + c, G, (int64_t)ldx, bits, &sh, &mh);
        memcpy(p + 2 * (size_t)c, &sh, 2);
        memcpy(p + 2 * (size_t)w + 2 * (size_t)c, &mh, 2);
        const float s = kvc_f16_to_f32v(sh), m = kvc_f16_to_f32v(mh);
        for (int32_t r = 0; r < G; r++) kvc_kivi_put(codes, (int64_t)r * w + c, kvc_kivi_code(x[(size_t)r * ldx + c], s, m, bits), bits);
    }
}
KVC_KVT_FN void kvc_kivi_encode_block(const kvc_kv_format *f, const float *x /* [group, w] */, int32_t w, void *dst) {
    memset((uint8_t *)dst + 4 * (size_t)w, 0, (size_t)f->group * w * kvc_kv_type_bits(f->type) / 8);
    kvc_kivi_encode_cols(f, x, (size_t)w, w, 0, w, dst);
}
/* Rows [r0, r0 + n), channels [c0, c0 + nc) of a block into out (row stride ldo). */
KVC_KVT_FN void kvc_kivi_decode_cols(const kvc_kv_format *f, const void *src, int32_t w, int32_t r0, int32_t n, int32_t c0,
                                     int32_t nc, float *out, size_t ldo) {
    const uint8_t *p = (const uint8_t *)src;
    const int32_t bits = kvc_kv_type_bits(f->type);
    const uint8_t *codes = p + 4 * (size_t)w;
    for (int32_t c = c0; c < c0 + nc; c++) {
        uint16_t sh, mh;
        memcpy(&sh, p + 2 * (size_t)c, 2);
        memcpy(&mh, p + 2 * (size_t)w + 2 * (size_t)c, 2);
        const float s = kvc_f16_to_f32v(sh), m = kvc_f16_to_f32v(mh);
        for (int32_t r = 0; r < n; r++) out[(size_t)r * ldo + (c - c0)] = m + s * (float)kvc_kivi_get(codes, (int64_t)(r0 + r) * w + c, bits);
    }
}
/* rows [r0, r0 + n) of a block into out [n, w] */
KVC_KVT_FN void kvc_kivi_decode_block(const kvc_kv_format *f, const void *src, int32_t w, int32_t r0, int32_t n, float *out) {
    kvc_kivi_decode_cols(f, src, w, r0, n, 0, w, out, (size_t)w);
}

/* ---- the table's checks and names (kv_type.c) ---- */
#ifndef __CUDACC__
/* "f32", "f16", "bf16", "q8_0", "kivi4", "kivi2"; NULL for another code */
const char *kvc_kv_type_name(int32_t type);
/* KVC_OK, or KVC_ERR_ARG saying what to change, for a format on heads of d values */
kvc_status kvc_kv_format_check(const kvc_kv_format *f, int32_t d);
#endif

#endif
