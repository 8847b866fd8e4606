/* Reading (and a commit's writing) the K/V storage types on the CPU (kv_decode.h), vectorised (AVX-512, or
 * AVX2 + FMA + F16C; other builds run core/kv_type.h's plain-C decoders and encoders).
 *
 * Tile decoders: rows into f32, the same arithmetic as core/kv_type.h's decoders on 16 values at a time,
 * so the same bits: f16 and bf16 widen exactly, q8_0's d q and KIVI's m + s q round once (d q and s q are
 * exact in f32: 11 significant bits times 8 or 4), an FMA or a multiply and an add alike. They stream the
 * cache from memory: the bytes PF_DECODE ahead of the row being decoded are prefetched (a store's next
 * tile follows this one).
 *
 * KIVI's decode step (kvc_cpu_kv_scores, kvc_cpu_kv_pv): the dequantisation folded into the products,
 * below. */
#include "kv_decode.h"

#include "../../core/kv_type.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVD 256
#endif

#if defined(KVD)
#include <immintrin.h>

#define PF_DECODE 2048
#define WMAX 1024 /* widest row a host store takes (kv_store.c) */
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PF_DECODE, _MM_HINT_T0)

/* ---- 16 values at a time ---- */
static inline void f16x16(const void *p, float *out) {
#if KVD == 512
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
#else
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1)));
#endif
}

static inline void bf16x16(const void *p, float *out) {
#if KVD == 512
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
#else
    for (int i = 0; i < 2; i++) {
        const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p + i));
        _mm256_storeu_ps(out + 8 * i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
    }
#endif
}

/* out = d q for 16 signed bytes q */
static inline void i8x16(const int8_t *p, float d, float *out) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
#if KVD == 512
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
#else
    const __m256 vd = _mm256_set1_ps(d);
    _mm256_storeu_ps(out, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
#endif
}

/* out = m + s q for 16 unsigned byte codes q, per value s[16] and m[16] */
static inline void u8x16(__m128i q, const float *s, const float *m, float *out) {
#if KVD == 512
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_loadu_ps(m)));
#else
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_loadu_ps(s), lo, _mm256_loadu_ps(m)));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_loadu_ps(s + 8), hi, _mm256_loadu_ps(m + 8)));
#endif
}

/* The same with one s and m for all 16 */
static inline void u8x16_1(__m128i q, float s, float m, float *out) {
#if KVD == 512
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(m)));
#else
    const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), vm));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), vm));
#endif
}

/* 32 KIVI codes (kv_type.h's packing: code i in bits (i % per) * bits of byte i / per) from p, 16 or 8 bytes,
 * as bytes in order: codes 0..15 in *a, 16..31 in *b */
static inline void codes32(const uint8_t *p, int32_t bits, __m128i *a, __m128i *b) {
    if (bits == 4) {
        const __m128i x = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(x, m4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m4);
        *a = _mm_unpacklo_epi8(lo, hi);
        *b = _mm_unpackhi_epi8(lo, hi);
    } else {
        const __m128i x = _mm_loadl_epi64((const __m128i *)p), m2 = _mm_set1_epi8(0x03);
        const __m128i c0 = _mm_and_si128(x, m2), c1 = _mm_and_si128(_mm_srli_epi16(x, 2), m2);
        const __m128i c2 = _mm_and_si128(_mm_srli_epi16(x, 4), m2), c3 = _mm_and_si128(_mm_srli_epi16(x, 6), m2);
        const __m128i t0 = _mm_unpacklo_epi8(c0, c1), t1 = _mm_unpacklo_epi8(c2, c3); /* pairs of byte k, k < 8 */
        *a = _mm_unpacklo_epi16(t0, t1);
        *b = _mm_unpackhi_epi16(t0, t1);
    }
}

/* n f16 or bf16 values in a row of memory */
static void halves(int32_t type, const uint16_t *p, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        PREFETCH(p + i);
        if (type == KVC_KV_F16)
            f16x16(p + i, out + i);
        else
            bf16x16(p + i, out + i);
    }
    for (; i < n; i++) out[i] = type == KVC_KV_F16 ? kvc_f16_to_f32v(p[i]) : kvc_bf16_to_f32r(p[i]);
}

/* one q8_0 row of w values */
static void q8_row(const uint8_t *p, int32_t w, float *out) {
    for (int32_t b0 = 0; b0 < w; b0 += KVC_Q8_0_BLOCK, p += KVC_Q8_0_BYTES) {
        uint16_t dh;
        memcpy(&dh, p, 2);
        const float d = _cvtsh_ss(dh);
        const int8_t *q = (const int8_t *)p + 2;
        PREFETCH(p);
        if (w - b0 >= KVC_Q8_0_BLOCK) {
            i8x16(q, d, out + b0);
            i8x16(q + 16, d, out + b0 + 16);
        } else {
            for (int32_t e = 0; e < w - b0; e++) out[b0 + e] = d * (float)q[e];
        }
    }
}

/* one KIVI value row: groups of g channels, each [f16 scale, f16 min, codes] */
static void kivi_row(const kvc_kv_format *f, const uint8_t *p, int32_t w, float *out) {
    const int32_t g = kvc_kivi_vgroup(f->group, w), bits = kvc_kv_type_bits(f->type);
    for (int32_t g0 = 0; g0 < w; g0 += g, p += 4 + (size_t)g * bits / 8) {
        uint16_t sh, mh;
        memcpy(&sh, p, 2);
        memcpy(&mh, p + 2, 2);
        const float s = _cvtsh_ss(sh), m = _cvtsh_ss(mh);
        PREFETCH(p);
        int32_t e = 0;
        for (; e + 32 <= g; e += 32) {
            __m128i a, b;
            codes32(p + 4 + (size_t)e * bits / 8, bits, &a, &b);
            u8x16_1(a, s, m, out + g0 + e);
            u8x16_1(b, s, m, out + g0 + e + 16);
        }
        for (; e < g; e++) out[g0 + e] = m + s * (float)kvc_kivi_get(p + 4, e, bits);
    }
}
#endif

void kvc_cpu_kv_decode_rows(const kvc_kv_format *f, const void *src, size_t stride, int64_t n, int32_t w, float *out) {
    const uint8_t *p = src;
#if defined(KVD)
    switch (f->type) {
    case KVC_KV_F16:
    case KVC_KV_BF16:
        if (stride == 2 * (size_t)w) { /* rows in one piece */
            halves(f->type, (const uint16_t *)p, n * w, out);
            return;
        }
        for (int64_t i = 0; i < n; i++) halves(f->type, (const uint16_t *)(p + (size_t)i * stride), w, out + i * w);
        return;
    case KVC_KV_Q8_0:
        for (int64_t i = 0; i < n; i++) q8_row(p + (size_t)i * stride, w, out + i * w);
        return;
    case KVC_KV_KIVI4:
    case KVC_KV_KIVI2:
        for (int64_t i = 0; i < n; i++) kivi_row(f, p + (size_t)i * stride, w, out + i * w);
        return;
    default: break;
    }
#endif
    for (int64_t i = 0; i < n; i++) kvc_kv_decode_row(f, p + (size_t)i * stride, w, out + i * w);
}

void kvc_cpu_kivi_decode_block(const kvc_kv_format *f, const void *block, int32_t w, int32_t r0, int32_t n, float *out) {
#if defined(KVD)
    if (w <= WMAX) {
        const uint8_t *p = block;
        const int32_t bits = kvc_kv_type_bits(f->type);
        const size_t rb = (size_t)w * bits / 8; /* a row's codes: whole bytes (kvc_kv_format_check) */
        float s[WMAX], m[WMAX];
        halves(KVC_KV_F16, (const uint16_t *)p, w, s);
        halves(KVC_KV_F16, (const uint16_t *)(p + 2 * (size_t)w), w, m);
        for (int32_t i = 0; i < n; i++) {
            const uint8_t *codes = p + 4 * (size_t)w + (size_t)(r0 + i) * rb;
            float *o = out + (size_t)i * w;
            PREFETCH(codes);
            int32_t c = 0;
            for (; c + 32 <= w; c += 32) {
                __m128i a, b;
                codes32(codes + (size_t)c * bits / 8, bits, &a, &b);
                u8x16(a, s + c, m + c, o + c);
                u8x16(b, s + c + 16, m + c + 16, o + c + 16);
            }
            for (; c < w; c++) o[c] = m[c] + s[c] * (float)kvc_kivi_get(codes, c, bits);
        }
        return;
    }
#endif
    kvc_kivi_decode_block(f, block, w, r0, n, out);
}

/* ---- encoders of rows stored alone (a commit's): core/kv_type.h's kvc_kv_encode_row, bit for bit ----
 * f16 through F16C's rounding (to nearest even, as kvc_f32_to_f16; a NaN is written as kvc_f32_to_f16
 * writes it), bf16 by the same integer rounding, q8_0's codes rint(x / d) by the vector conversion (the
 * same rounding mode) from the same d and 1 / d. KIVI's values take the plain-C encoder. */
#if defined(KVD)
/* 16 f16 or bf16 values; a lane that is NaN is written again by the plain-C conversion */
static void halves16_put(int32_t type, const float *x, uint16_t *out) {
#if KVD == 512
    const __m512 v = _mm512_loadu_ps(x);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (type == KVC_KV_F16) {
        _mm256_storeu_si256((__m256i *)out, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
    for (int i = 0; nan && i < 16; i++)
        if (nan >> i & 1) out[i] = type == KVC_KV_F16 ? kvc_f32_to_f16(x[i]) : kvc_f32_to_bf16r(x[i]);
#else
    for (int h = 0; h < 2; h++) {
        const __m256 v = _mm256_loadu_ps(x + 8 * h);
        const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        if (type == KVC_KV_F16) {
            _mm_storeu_si128((__m128i *)(out + 8 * h), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            const __m256i u = _mm256_castps_si256(v);
            const __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))),
                16);
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128((__m128i *)(out + 8 * h), _mm256_castsi256_si128(w));
        }
        for (int i = 0; nan && i < 8; i++)
            if (nan >> i & 1) out[8 * h + i] = type == KVC_KV_F16 ? kvc_f32_to_f16(x[8 * h + i]) : kvc_f32_to_bf16r(x[8 * h + i]);
    }
#endif
}

/* one whole q8_0 block: d = max |x| / 127 (NaNs skipped, as the plain-C loop skips them), codes rint(x / d) */
static void q8_block_put(const float *x, uint8_t *p) {
#if KVD == 512
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16), sign = _mm512_set1_ps(-0.f);
    /* max(|x|, acc): a NaN |x| gives acc (the second operand), as the plain-C comparison skips it */
    const __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, b), _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(m);
#else
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 32; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const uint16_t dh = kvc_f32_to_f16(d);
    memcpy(p, &dh, 2);
#if KVD == 512
    const __m512 vid = _mm512_set1_ps(id);
    _mm_storeu_si128((__m128i *)(p + 2), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vid))));
    _mm_storeu_si128((__m128i *)(p + 18), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vid))));
#else
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid));
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)(p + 2), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
}
#endif

void kvc_cpu_kv_encode_row(const kvc_kv_format *f, const float *x, int32_t w, void *dst) {
#if defined(KVD)
    uint8_t *p = dst;
    if (f->type == KVC_KV_F16 || f->type == KVC_KV_BF16) {
        int32_t e = 0;
        for (; e + 16 <= w; e += 16) halves16_put(f->type, x + e, (uint16_t *)p + e);
        for (; e < w; e++) ((uint16_t *)p)[e] = f->type == KVC_KV_F16 ? kvc_f32_to_f16(x[e]) : kvc_f32_to_bf16r(x[e]);
        return;
    }
    if (f->type == KVC_KV_Q8_0 && w % KVC_Q8_0_BLOCK == 0) {
        for (int32_t b0 = 0; b0 < w; b0 += KVC_Q8_0_BLOCK) q8_block_put(x + b0, p + (size_t)(b0 / KVC_Q8_0_BLOCK) * KVC_Q8_0_BYTES);
        return;
    }
#endif
    kvc_kv_encode_row(f, x, w, dst);
}

int kvc_cpu_kv_decode_simd(void) {
#if defined(KVD)
    return 1;
#else
    return 0;
#endif
}



/* ---- KIVI's decode step on the stored bytes ----
 * Keys per channel (k_c = m_c + s_c q_c over a key block): q . k = sum_c (q_c s_c) q_c' + sum_c q_c m_c, the
 * first over the codes as they come, the second once per tile (a tile lies in one block). Values per row
 * (v_c = m + s q_c in each value group): O += (P s) q + (P m), the second summed over the tile's rows first.
 * Codes are read VL bytes at a time, widened to 32-bit lanes and split by shifts into per = 8 / bits
 * vectors ("chunks"): lane i of chunk t holds channel per i + t, so the codes need no shuffle; the query
 * side and the output take that order instead, once per tile (to_lanes, from_lanes). Rounding differs from
 * decoding then multiplying (fp32 sums in another order); the tests bound it. The rows PF_FUSED bytes
 * ahead are prefetched as each row is read. f16, bf16 and q8_0 tiles are decoded instead: folding their
 * scales into the products measured no faster (the decode is a few instructions a value). */
#if defined(KVD)
#include "cpu.h"

#define PF_FUSED 4096
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

/* the sums of a0..a3 */
static inline __m128 sum4(vf a0, vf a1, vf a2, vf a3) {
#if KVD == 512
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

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the rows PF_FUSED bytes on, a cache line at a time */
static inline void prefetch_row(const uint8_t *row, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + PF_FUSED + o, _MM_HINT_T0);
}

/* S[r ls + j] = Qv[r] . codes_j + bias[r] for NR rows (Qv [NR, d]: q s in the codes' order) and the tile's
 * keys j < n, 4 keys at a time (their sums reduced together) */
static inline __attribute__((always_inline)) void scores_nr(const int BITS, const int NR, const kvc_kv_tile *t, const float *Qv,
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
            prefetch_row(row[k], rb);
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
            const __m128 s = _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(bias[r]));
            if (nk == 4) {
                _mm_storeu_ps(S + r * ls + j, s);
            } else {
                float s4[4];
                _mm_storeu_ps(s4, s);
                for (int k = 0; k < nk; k++) S[r * ls + j + k] = s4[k];
            }
        }
    }
}

/* O[NR, d] += the tile's value codes j < n weighted by cf (row r's weight of value j in value group e at
 * cf[(r ne + e) KVC_KV_TILE + j]: P s), then bias [NR, ne] (sum_j P m) on the group's channels; 4 chunks of
 * O in registers at a time */
static inline __attribute__((always_inline)) void pv_nr(const int BITS, const int NR, const kvc_kv_tile *t, const float *cf,
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
            if (v0 == 0) prefetch_row(row, t->vstride);
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

#define NR_CASES(CALL)       \
    switch (nr) {            \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    default: CALL(4); break; \
    }

static inline __attribute__((always_inline)) void scores_of(const int BITS, const kvc_kv_tile *t, const float *Q, int rows,
                                                            int n, float *S, int ls) {
    const int d = t->d, per = 8 / BITS;
    float qv[NR_MAX * 256], bias[NR_MAX], s[256], m[256];
    halves(KVC_KV_F16, (const uint16_t *)t->k, d, s); /* the block's channel scales and mins */
    halves(KVC_KV_F16, (const uint16_t *)t->k + d, d, m);
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
        NR_CASES(SCORES)
#undef SCORES
    }
}

static inline __attribute__((always_inline)) void pv_of(const int BITS, const kvc_kv_tile *t, const float *P, int ls, int rows,
                                                        int n, float *O) {
    const int d = t->d, g = kvc_kivi_vgroup(t->f->group, d), ne = d / g;
    const size_t gb = 4 + (size_t)g * BITS / 8;
    float sc[8 * KVC_KV_TILE], mn[8 * KVC_KV_TILE], cf[NR_MAX * 8 * KVC_KV_TILE], bias[NR_MAX * 8];
    for (int e = 0; e < ne; e++) /* each value row's scale and min per group */
        for (int j = 0; j < n; j++) {
            const uint8_t *h = t->v + (size_t)j * t->vstride + (size_t)e * gb;
            sc[e * KVC_KV_TILE + j] = half(h);
            mn[e * KVC_KV_TILE + j] = half(h + 2);
        }
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
        NR_CASES(PV)
#undef PV
    }
}
#endif

int kvc_cpu_kv_tile_ok(const kvc_kv_format *f, int32_t d) {
    if (!kvc_kv_type_key_blocks(f->type)) return kvc_cpu_kv_rows_ok(f, d);
#if defined(KVD)
    /* whole column blocks of 4 chunks, each inside one value group */
    if (d % (4 * VL) != 0 || d > 256) return 0;
    return kvc_kivi_vgroup(f->group, d) % (4 * VL) == 0;
#else
    return 0;
#endif
}

void kvc_cpu_kv_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls) {
    if (!kvc_kv_type_key_blocks(t->f->type)) {
        kvc_cpu_kv_rows_scores(t, Q, rows, n, S, ls);
        return;
    }
#if defined(KVD)
    if (t->f->type == KVC_KV_KIVI4)
        scores_of(4, t, Q, rows, n, S, ls);
    else
        scores_of(2, t, Q, rows, n, S, ls);
#else
    (void)t, (void)Q, (void)rows, (void)n, (void)S, (void)ls;
#endif
}

void kvc_cpu_kv_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O) {
    if (!kvc_kv_type_key_blocks(t->f->type)) {
        kvc_cpu_kv_rows_pv(t, P, ls, rows, n, O);
        return;
    }
#if defined(KVD)
    if (t->f->type == KVC_KV_KIVI4)
        pv_of(4, t, P, ls, rows, n, O);
    else
        pv_of(2, t, P, ls, rows, n, O);
#else
    (void)t, (void)P, (void)ls, (void)rows, (void)n, (void)O;
#endif
}
