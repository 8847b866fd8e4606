/* Integer dot products of the K-quants Q4_K and Q6_K (256-value super-blocks) against int8 activation
 * rows of 32-value blocks (kvc_q8row), for the decode GEMV (quant.h), and their plain-C references.
 *
 * Q4_K: fp16 d, dmin; 12 bytes of 6-bit scales and mins (k_scale_min); 128 bytes of nibbles, byte l of
 * chunk c holding value 64c + l (low) and 64c + 32 + l (high). Value = d sc_g q - dmin m_g, sub-block g
 * of 32 values = exactly one activation block: sum = d sc_g d_a isum - dmin m_g s_a.
 * Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16 values), fp16 d;
 * value = d sc_j (q - 32). Activation block G of a super-block (values 32G..32G+31, half n = G / 4,
 * g = G % 4) takes ql[64n + 32(g & 1) + l] (nibble g >> 1) and bits 2g of qh[32n + l]; its two halves
 * have scales sc[8n + 2g] and sc[8n + 2g + 1], so the integer sums are taken per 16 values:
 * sum = d d_a sum_h sc_h (isum_h - 32 qsum_h), qsum_h the activation codes' sum over the half. */
#include <string.h>

#include "../../model/convert.h"
#include "../../model/gguf.h"
#include "cpu.h"
#include "quant.h"
#include "qsimd.h"

static inline float half_k(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kvc_f16_to_f32(h);
}

static inline void scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- plain-C references ------------------------------------------------------------------------- */

static float q4_k_ref(const uint8_t *w, kvc_q8row a, int64_t nsb) {
    float acc = 0.f;
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + s * 144;
        const float d = half_k(b), dmin = half_k(b + 2);
        for (int g = 0; g < 8; g++) {
            int sc, m;
            scale_min(b + 4, g, &sc, &m);
            const uint8_t *q = b + 16 + 32 * (g >> 1);
            const int64_t ib = 8 * s + g;
            int32_t isum = 0;
            for (int l = 0; l < 32; l++) isum += ((q[l] >> (4 * (g & 1))) & 15) * a.q[32 * ib + l];
            acc += d * (float)sc * a.d[ib] * (float)isum - dmin * (float)m * a.s[ib];
        }
    }
    return acc;
}

static float q6_k_ref(const uint8_t *w, kvc_q8row a, int64_t nsb) {
    float acc = 0.f;
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + s * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_k(b + 208);
        for (int G = 0; G < 8; G++) {
            const int n = G / 4, g = G % 4;
            const uint8_t *ql = b + 64 * n + 32 * (g & 1), *qh = b + 128 + 32 * n;
            const int64_t ib = 8 * s + G;
            int32_t tot = 0;
            for (int h = 0; h < 2; h++) {
                int32_t isum = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) {
                    const int q = ((ql[l] >> (4 * (g >> 1))) & 15) | (((qh[l] >> (2 * g)) & 3) << 4);
                    isum += (q - 32) * a.q[32 * ib + l];
                }
                tot += sc[8 * n + 2 * g + h] * isum;
            }
            acc += d * a.d[ib] * (float)tot;
        }
    }
    return acc;
}

/* ---- SIMD (qsimd.h: 256-bit lanes, one activation block per kvc_dpbusd; codes <= 63) ------------- */
#if defined(KVC_QSIMD)

static float q4_k_simd(const uint8_t *w, kvc_q8row a, int64_t nsb) {
    const __m256i f = _mm256_set1_epi8(15);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float off = 0.f;
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + s * 144;
        const float d = half_k(b), dmin = half_k(b + 2);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            int sc0, m0, sc1, m1;
            scale_min(b + 4, 2 * c, &sc0, &m0);
            scale_min(b + 4, 2 * c + 1, &sc1, &m1);
            const int64_t ib = 8 * s + 2 * c;
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            const __m256i i0 = kvc_dpbusd(_mm256_setzero_si256(), _mm256_and_si256(v, f),
                                                   _mm256_loadu_si256((const __m256i *)(a.q + 32 * ib)));
            const __m256i i1 = kvc_dpbusd(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(v, 4), f),
                                                   _mm256_loadu_si256((const __m256i *)(a.q + 32 * ib + 32)));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc0 * a.d[ib]), _mm256_cvtepi32_ps(i0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc1 * a.d[ib + 1]), _mm256_cvtepi32_ps(i1), acc1);
            off += dmin * ((float)m0 * a.s[ib] + (float)m1 * a.s[ib + 1]);
        }
    }
    return kvc_hsum8(_mm256_add_ps(acc0, acc1)) - off;
}

static float q6_k_simd(const uint8_t *w, kvc_q8row a, int64_t nsb) {
    const __m256i f = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + s * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_k(b + 208);
        for (int n = 0; n < 2; n++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * n)),
                          l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
            for (int g = 0; g < 4; g++) {
                const __m256i lo = (g & 1) ? l1 : l0;
                const __m256i nib = (g >> 1) ? _mm256_and_si256(_mm256_srli_epi16(lo, 4), f) : _mm256_and_si256(lo, f);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), three);
                const __m256i u = _mm256_or_si256(nib, _mm256_slli_epi16(hi, 4)); /* 0..63 */
                const int64_t ib = 8 * s + 4 * n + g;
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(a.q + 32 * ib));
                /* per lane (4 values): sum u qa - 32 sum qa; lanes 0-3 the first 16 values, 4-7 the rest */
                const __m256i isum = _mm256_sub_epi32(kvc_dpbusd(_mm256_setzero_si256(), u, qa),
                                                      kvc_dpbusd(_mm256_setzero_si256(), c32, qa));
                const int j = 8 * n + 2 * g;
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi32(sc[j + 1]), _mm_set1_epi32(sc[j]));
                const __m256 t = _mm256_cvtepi32_ps(_mm256_mullo_epi32(isum, scv));
                if (g & 1) acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d[ib]), t, acc1);
                else acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d[ib]), t, acc0);
            }
        }
    }
    return kvc_hsum8(_mm256_add_ps(acc0, acc1));
}

#endif

int kvc_cpu_wtype_kint8(int32_t t) { return t == GGML_T_Q4_K || t == GGML_T_Q6_K; }

float kvc_cpu_qdot_k(int32_t t, const void *w, kvc_q8row a, int64_t k, int ref) {
    const int64_t nsb = k / 256;
#if defined(KVC_QSIMD)
    if (!ref) return t == GGML_T_Q4_K ? q4_k_simd(w, a, nsb) : q6_k_simd(w, a, nsb);
#endif
    (void)ref;
    return t == GGML_T_Q4_K ? q4_k_ref(w, a, nsb) : q6_k_ref(w, a, nsb);
}
