/* Reading (and a commit's writing) the K/V storage types on the CPU (kv_decode.h), vectorised (AVX-512, or
 * AVX2 + FMA + F16C; other builds run core/kv_type.h's plain-C decoders and encoders).
 *
 * Tile decoders: rows into f32, the same arithmetic as core/kv_type.h's decoders on 16 values at a time,
 * so the same bits: f16 and bf16 widen exactly, q8_0's d q and KIVI's m + s q round once (d q and s q are
 * exact in f32: 11 significant bits times 8 or 4), an FMA or a multiply and an add alike. They stream the
 * cache from memory: the bytes PF_DECODE ahead of the row being decoded are prefetched (a store's next
 * tile follows this one). The decode step on tiles read where they lie has its own files (kv_rows_step.c,
 * kv_kivi_step.c); the dispatch to them by the kind of store ends this one. */
#include "kv_decode.h"

#include "../../core/kv_type.h"
#include "kv_simd.h"

#if defined(KVC_KV_SIMD)
#define KVD KVC_KV_SIMD
#endif

#if defined(KVD)

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

/* ---- The decode step on a tile read where it lies: by the kind of store ---- */
int kvc_cpu_kv_tile_ok(const kvc_kv_format *f, int32_t d) {
    return kvc_kv_type_key_blocks(f->type) ? kvc_cpu_kv_kivi_ok(f, d) : kvc_cpu_kv_rows_ok(f, d);
}

void kvc_cpu_kv_scores(const kvc_kv_tile *t, const float *Q, int rows, int n, float *S, int ls, kvc_kv_query *qc) {
    if (kvc_kv_type_key_blocks(t->f->type))
        kvc_cpu_kv_kivi_scores(t, Q, rows, n, S, ls);
    else
        kvc_cpu_kv_rows_scores(t, Q, rows, n, S, ls, qc);
}

void kvc_cpu_kv_pv(const kvc_kv_tile *t, const float *P, int ls, int rows, int n, float *O) {
    if (kvc_kv_type_key_blocks(t->f->type))
        kvc_cpu_kv_kivi_pv(t, P, ls, rows, n, O);
    else
        kvc_cpu_kv_rows_pv(t, P, ls, rows, n, O);
}

int kvc_cpu_kv_step_int16(int32_t type) {
    int yes = 0;
#if defined(KVC_KV_Q8_INT16)
    yes |= type == KVC_KV_Q8_0;
#endif
#if defined(KVC_KV_INT16_KIVI)
    yes |= kvc_kv_type_key_blocks(type);
#endif
    (void)type;
    return yes;
}
