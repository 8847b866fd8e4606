/* Native weights on the CPU: the integer dot products of the 32-value block types against int8
 * activations, their plain-C references, and the decode GEMV (quant.h). Block layouts (ggml): Q4_0
 * fp16 d + 16 bytes of nibbles, value (q - 8) d; Q4_1 d, m + nibbles, q d + m; Q5_0 d + u32 of fifth
 * bits + nibbles, (q - 16) d; Q5_1 d, m, fifth bits, nibbles, q d + m; Q8_0 d + 32 int8, q d. In the
 * nibble bytes, byte j holds element j (low) and j + 16 (high); fifth bit e is bit e of the u32.
 *
 * Every block's integer sum is sum(u * qa) over unsigned weight codes u (0..31), so one instruction
 * serves all types (kvc_dpbusd, qsimd.h: VNNI's vpdpbusd or AVX2's pair); the code's offset (-8, -16)
 * or Q4_1/Q5_1's m comes back through the activation block's s = d * sum(qa). Q8_0's codes are signed
 * (kvc_dot_s8). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../../model/convert.h"
#include "../../model/dequant.h"
#include "../../model/gguf.h"
#include "cpu.h"
#include "quant.h"
#include "qsimd.h"

#define MIN_PAR_BYTES (1 << 16) /* below this many weight bytes a GEMV runs on one thread */

int kvc_cpu_wtype_int8(int32_t t) {
    return t == GGML_T_Q4_0 || t == GGML_T_Q4_1 || t == GGML_T_Q5_0 || t == GGML_T_Q5_1 || t == GGML_T_Q8_0 ||
           kvc_cpu_wtype_kint8(t);
}

int kvc_cpu_wtype_ok(int32_t t) {
    return kvc_cpu_wtype_int8(t) || t == GGML_T_F16 || t == GGML_T_BF16 || t == GGML_T_Q2_K || t == GGML_T_Q3_K ||
           t == GGML_T_Q4_K || t == GGML_T_Q5_K || t == GGML_T_Q6_K;
}

int kvc_cpu_wtype_packs(int32_t t) { return t == GGML_T_Q4_0 || t == GGML_T_Q4_1 || t == GGML_T_Q8_0; }

/* ---- the interleaved layout (quant.h) ----------------------------------------------------------- */

static size_t head_bytes(int32_t t) { return t == GGML_T_Q4_1 ? 4 : 2; } /* d (and m) before the codes */

/* Byte o of block b of row j, where it lives: the group's run of block b, the field or code piece. */
static size_t packed_at(int32_t t, size_t row_bytes, int64_t j, int64_t b, size_t o) {
    const size_t bb = ggml_block_bytes(t), h = head_bytes(t), r = (size_t)(j % KVC_QG);
    const size_t run = (size_t)(j / KVC_QG) * KVC_QG * row_bytes + (size_t)b * KVC_QG * bb;
    if (o < h) return run + o / 2 * 2 * KVC_QG + r * 2 + o % 2;
    o -= h;
    return run + h * KVC_QG + o / 4 * 4 * KVC_QG + r * 4 + o % 4;
}

void kvc_cpu_wpack_row(int32_t t, int64_t rows, size_t row_bytes, void *base, int64_t j, const void *src) {
    if (j >= rows / KVC_QG * KVC_QG) { /* the tail rows: as in the file */
        memcpy((char *)base + (size_t)j * row_bytes, src, row_bytes);
        return;
    }
    const size_t bb = ggml_block_bytes(t), h = head_bytes(t);
    for (int64_t b = 0; b < (int64_t)(row_bytes / bb); b++) {
        const uint8_t *sb = (const uint8_t *)src + b * bb;
        for (size_t o = 0; o < h; o += 2) memcpy((char *)base + packed_at(t, row_bytes, j, b, o), sb + o, 2);
        for (size_t o = h; o < bb; o += 4) memcpy((char *)base + packed_at(t, row_bytes, j, b, o), sb + o, 4);
    }
}

const void *kvc_cpu_wrow_blocks(kvc_wmat w, int64_t j, int64_t b0, int64_t nb, void *dst) {
    const size_t bb = ggml_block_bytes(w.type);
    if (!w.packed || j >= w.rows / KVC_QG * KVC_QG) return (const char *)w.p + (size_t)j * w.row_bytes + (size_t)b0 * bb;
    const size_t h = head_bytes(w.type);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *db = (uint8_t *)dst + b * bb;
        for (size_t o = 0; o < h; o += 2) memcpy(db + o, (const char *)w.p + packed_at(w.type, w.row_bytes, j, b0 + b, o), 2);
        for (size_t o = h; o < bb; o += 4) memcpy(db + o, (const char *)w.p + packed_at(w.type, w.row_bytes, j, b0 + b, o), 4);
    }
    return dst;
}

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return kvc_f16_to_f32(h);
#endif
}

/* ---- activations -------------------------------------------------------------------------------- */

void kvc_cpu_quantize_q8(const float *x, int64_t k, kvc_q8row out) {
#if KVC_QSIMD == 512
    /* the same arithmetic 16 lanes at a time: x * (1 / d) in fp32, cvtps2dq rounds half to even */
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int64_t b = 0; b < k / 32; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(out.q + b * 32), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(out.q + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
        out.d[b] = d;
        out.s[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
    return;
#elif KVC_QSIMD == 256
    /* 8 lanes at a time; the four int32 vectors pack to bytes in the order (0,4,1,5,2,6,3,7) of 4-byte
     * pieces, which the permute puts back */
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0);
    for (int64_t b = 0; b < k / 32; b++) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(out.q + b * 32), _mm256_permutevar8x32_epi32(bytes, order));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        out.d[b] = d;
        out.s[b] = d * (float)_mm_cvtsi128_si32(s4);
    }
    return;
#endif
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        int8_t *q = out.q + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            q[j] = (int8_t)nearbyintf(xb[j] * id); /* round to nearest even, as cvtps2dq */
            sum += q[j];
        }
        out.d[b] = d;
        out.s[b] = d * (float)sum;
    }
}

/* ---- plain-C references ------------------------------------------------------------------------- */

/* u[32]: the block's unsigned codes; *m: Q4_1/Q5_1's offset (else 0); returns d and the code bias */
static float codes(int32_t t, const uint8_t *b, uint8_t *u, float *m, int *bias) {
    *m = 0.f;
    *bias = 0;
    const uint8_t *qs;
    uint32_t qh = 0;
    switch (t) {
    case GGML_T_Q4_0: qs = b + 2; *bias = 8; break;
    case GGML_T_Q4_1: qs = b + 4; *m = half(b + 2); break;
    case GGML_T_Q5_0: memcpy(&qh, b + 2, 4); qs = b + 6; *bias = 16; break;
    case GGML_T_Q5_1: *m = half(b + 2); memcpy(&qh, b + 4, 4); qs = b + 8; break;
    default: /* Q8_0 */
        for (int j = 0; j < 32; j++) u[j] = (uint8_t)((int8_t)b[2 + j] + 128);
        *bias = 128;
        return half(b);
    }
    for (int j = 0; j < 16; j++) {
        u[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
        u[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    return half(b);
}

static float qdot_ref(int32_t t, const uint8_t *w, kvc_q8row a, int64_t nb) {
    const size_t bb = ggml_block_bytes(t);
    float acc = 0.f;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t u[32];
        float m;
        int bias;
        const float d = codes(t, w + i * bb, u, &m, &bias);
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += (int32_t)u[j] * a.q[i * 32 + j];
        acc += d * a.d[i] * (float)s + (m - (float)bias * d) * a.s[i];
    }
    return acc;
}

/* ---- SIMD (qsimd.h: AVX-512 VNNI or AVX2) --------------------------------------------------------- */
#if defined(KVC_QSIMD)

static inline __m256i nibbles(const uint8_t *qs) { /* 16 bytes -> 32 codes: low nibbles, then high */
    const __m128i x = _mm_loadu_si128((const __m128i *)qs), f = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), f), _mm_and_si128(x, f));
}
static inline __m256i fifth(__m256i u, const uint8_t *qh) { /* OR in 16 where bit e of the u32 is set */
    uint32_t h;
    memcpy(&h, qh, 4);
#if KVC_QSIMD == 512
    return _mm256_or_si256(u, _mm256_maskz_mov_epi8((__mmask32)h, _mm256_set1_epi8(16)));
#else /* byte e takes byte e / 8 of h, then tests bit e % 8 */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                                     0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}

/* One type's loop: per block one integer dot (DOT(b, qa): 8 lanes of 4-product sums), a conversion and
 * an FMA with the block's scale product; the offset term (m - bias d_w) s_a goes to a scalar. Two blocks
 * in flight. (Measured alternatives on AVX-512, no faster: 16 blocks' scales as vectors through a
 * gather, and four accumulator chains.) HAS_M: whether the type has an m (at byte 2), BIAS the code bias. */
#define QDOT_BLOCK(acc, b, qa, dd) acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(DOT(b, qa)), acc)
#define QDOT_OFF(HAS_M, BIAS, b, d0, sa) (((HAS_M) ? half((b) + 2) : 0.f) - (float)(BIAS) * (d0)) * (sa)
#define QDOT_LOOP(HAS_M, BIAS)                                                                         \
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                     \
    float off = 0.f;                                                                                   \
    int64_t i = 0;                                                                                     \
    for (; i + 2 <= nb; i += 2) {                                                                      \
        const uint8_t *b0 = w + i * BB, *b1 = b0 + BB;                                                 \
        const float d0 = half(b0), d1 = half(b1);                                                      \
        QDOT_BLOCK(acc0, b0, a.q + i * 32, d0 * a.d[i]);                                               \
        QDOT_BLOCK(acc1, b1, a.q + i * 32 + 32, d1 * a.d[i + 1]);                                      \
        off += QDOT_OFF(HAS_M, BIAS, b0, d0, a.s[i]) + QDOT_OFF(HAS_M, BIAS, b1, d1, a.s[i + 1]);      \
    }                                                                                                  \
    for (; i < nb; i++) {                                                                              \
        const uint8_t *b0 = w + i * BB;                                                                \
        const float d0 = half(b0);                                                                     \
        QDOT_BLOCK(acc0, b0, a.q + i * 32, d0 * a.d[i]);                                               \
        off += QDOT_OFF(HAS_M, BIAS, b0, d0, a.s[i]);                                                  \
    }                                                                                                  \
    return kvc_hsum8(_mm256_add_ps(acc0, acc1)) + off;

#define LOADQ(qa) _mm256_loadu_si256((const __m256i *)(qa))
#define U_DOT(codes, qa) kvc_dpbusd(_mm256_setzero_si256(), codes, LOADQ(qa))
#define D_Q4_0(b, qa) U_DOT(nibbles((b) + 2), qa)
#define D_Q4_1(b, qa) U_DOT(nibbles((b) + 4), qa)
#define D_Q5_0(b, qa) U_DOT(fifth(nibbles((b) + 6), (b) + 2), qa)
#define D_Q5_1(b, qa) U_DOT(fifth(nibbles((b) + 8), (b) + 4), qa)
#define D_Q8_0(b, qa) kvc_dot_s8(LOADQ((b) + 2), LOADQ(qa))

#define DOT D_Q4_0
static float qdot_q4_0(const uint8_t *w, kvc_q8row a, int64_t nb) { enum { BB = 18 }; QDOT_LOOP(0, 8) }
#undef DOT
#define DOT D_Q4_1
static float qdot_q4_1(const uint8_t *w, kvc_q8row a, int64_t nb) { enum { BB = 20 }; QDOT_LOOP(1, 0) }
#undef DOT
#define DOT D_Q5_0
static float qdot_q5_0(const uint8_t *w, kvc_q8row a, int64_t nb) { enum { BB = 22 }; QDOT_LOOP(0, 16) }
#undef DOT
#define DOT D_Q5_1
static float qdot_q5_1(const uint8_t *w, kvc_q8row a, int64_t nb) { enum { BB = 24 }; QDOT_LOOP(1, 0) }
#undef DOT
#define DOT D_Q8_0
static float qdot_q8_0(const uint8_t *w, kvc_q8row a, int64_t nb) { enum { BB = 34 }; QDOT_LOOP(0, 0) }
#undef DOT

#endif

/* The decode GEMV's prefetch (qgroup, with cpu.h's kvc_prefetch_lines): block b of the group two groups on,
 * asked for as block b of this one is read, so the weights' one stream has lines in flight well ahead of the
 * loads, the requests spread over the whole group. The hardware's prefetcher alone kept too few: the decode
 * GEMV of the default model (96 MB a step) ran at ~9.6 GB/s, a decode step at 256 tokens of context in
 * 11.3 ms; with the lines one group on 7.5, two 7.4, four 7.8 (~13 GB/s; best of 5 alternating runs, one
 * thread). */

#if KVC_QSIMD == 512
/* 16 packed rows (one group, g) against activation row a: lane r = row r's sum. Per block: the codes
 * of the 16 rows in 64-byte pieces against 4 activation bytes broadcast (vpdpbusd), then in float
 * sum_r += d_r (d_a isum_r - bias s_a) (+ m_r s_a for Q4_1), the 16 d_r (m_r) one 32-byte load. */
static inline __attribute__((always_inline)) void qgroup(int32_t t, const uint8_t *g, kvc_q8row a, int64_t nb, float *out,
                                                        int pf) {
    const int q8 = t == GGML_T_Q8_0, hm = t == GGML_T_Q4_1;
    const size_t bb = q8 ? 34 : hm ? 20 : 18, h = hm ? 4 : 2;
    const float bias = q8 ? 128.f : hm ? 0.f : 8.f;
    const __m512i f = _mm512_set1_epi8(15), x80 = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *run = g + b * KVC_QG * bb, *qs = run + h * KVC_QG;
        if (pf) kvc_prefetch_lines(run + 2 * (size_t)nb * KVC_QG * bb, KVC_QG * bb); /* two groups on */
        const int8_t *aq = a.q + b * 32;
        int32_t a4[8];
        memcpy(a4, aq, 32);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        if (q8) {
            for (int c = 0; c < 8; c += 2) {
                s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(_mm512_loadu_si512(qs + c * 64), x80), _mm512_set1_epi32(a4[c]));
                s1 = _mm512_dpbusd_epi32(s1, _mm512_xor_si512(_mm512_loadu_si512(qs + c * 64 + 64), x80),
                                         _mm512_set1_epi32(a4[c + 1]));
            }
        } else {
            for (int c = 0; c < 4; c++) { /* low nibbles: codes 4c.., high: 16 + 4c.. */
                const __m512i v = _mm512_loadu_si512(qs + c * 64);
                s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(v, f), _mm512_set1_epi32(a4[c]));
                s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(v, 4), f), _mm512_set1_epi32(a4[c + 4]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)run));
        const __m512 dot = _mm512_fmadd_ps(_mm512_set1_ps(a.d[b]), _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                           _mm512_set1_ps(-bias * a.s[b]));
        acc = _mm512_fmadd_ps(d, dot, acc);
        if (hm) macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(run + 32))), _mm512_set1_ps(a.s[b]), macc);
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acc, macc));
}

#elif KVC_QSIMD == 256
/* The same with AVX2: the 16 rows as two 8-lane halves (rows 0-7 are bytes 0-31 of each 64-byte piece,
 * rows 8-15 bytes 32-63). A nibble block's byte products are summed in int16 over the whole block (8
 * vpmaddubsw, each lane |u qa + u' qa'| <= 2 15 127, so |sum| <= 30480: no overflow) and widened once;
 * Q8_0's signed codes take kvc_dot_s8 per piece. */
static inline __attribute__((always_inline)) void qgroup(int32_t t, const uint8_t *g, kvc_q8row a, int64_t nb, float *out,
                                                        int pf) {
    const int q8 = t == GGML_T_Q8_0, hm = t == GGML_T_Q4_1;
    const size_t bb = q8 ? 34 : hm ? 20 : 18, h = hm ? 4 : 2;
    const float bias = t == GGML_T_Q4_0 ? 8.f : 0.f;
    const __m256i f = _mm256_set1_epi8(15);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, macc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *run = g + b * KVC_QG * bb, *qs = run + h * KVC_QG;
        if (pf) kvc_prefetch_lines(run + 2 * (size_t)nb * KVC_QG * bb, KVC_QG * bb); /* two groups on */
        int32_t a4[8];
        memcpy(a4, a.q + b * 32, 32);
        const __m256 da = _mm256_set1_ps(a.d[b]), off = _mm256_set1_ps(-bias * a.s[b]);
        for (int hf = 0; hf < 2; hf++) {
            __m256i s = _mm256_setzero_si256();
            if (q8) {
                for (int c = 0; c < 8; c++)
                    s = _mm256_add_epi32(s, kvc_dot_s8(LOADQ(qs + c * 64 + hf * 32), _mm256_set1_epi32(a4[c])));
            } else {
                for (int c = 0; c < 4; c++) { /* low nibbles: codes 4c.., high: 16 + 4c.. */
                    const __m256i v = LOADQ(qs + c * 64 + hf * 32);
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(v, f), _mm256_set1_epi32(a4[c])));
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), f),
                                                                 _mm256_set1_epi32(a4[c + 4])));
                }
                s = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + 16 * hf)));
            acc[hf] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(da, _mm256_cvtepi32_ps(s), off), acc[hf]);
            if (hm)
                macc[hf] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + 32 + 16 * hf))),
                                           _mm256_set1_ps(a.s[b]), macc[hf]);
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc[0], macc[0]));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(acc[1], macc[1]));
}
#endif

/* Group g of packed rows against m <= KVC_QG activation rows: out[i * KVC_QG + r] for row g KVC_QG + r.
 * The reference (and builds without SIMD) copies each block back to the file's layout for qdot_ref,
 * summing in qdot_ref's order. */
static void qgroup_rows(kvc_wmat w, int64_t g, const kvc_q8row *a, int64_t m, int64_t nb, int ref, float *out) {
#if defined(KVC_QSIMD)
    if (!ref) {
        const uint8_t *base = (const uint8_t *)w.p + (size_t)g * KVC_QG * w.row_bytes;
        for (int64_t i = 0; i < m; i++) switch (w.type) { /* one specialised copy per type */
            /* the first activation row prefetches two groups on; the others find this one in cache */
            case GGML_T_Q4_0: qgroup(GGML_T_Q4_0, base, a[i], nb, out + i * KVC_QG, i == 0); break;
            case GGML_T_Q4_1: qgroup(GGML_T_Q4_1, base, a[i], nb, out + i * KVC_QG, i == 0); break;
            default: qgroup(GGML_T_Q8_0, base, a[i], nb, out + i * KVC_QG, i == 0); break;
            }
        return;
    }
#endif
    (void)ref;
    for (int64_t i = 0; i < m; i++)
        for (int r = 0; r < KVC_QG; r++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t blk[64];
                const kvc_q8row ab = {a[i].d + b, a[i].s + b, a[i].q + 32 * b};
                acc += qdot_ref(w.type, kvc_cpu_wrow_blocks(w, g * KVC_QG + r, b, 1, blk), ab, 1);
            }
            out[i * KVC_QG + r] = acc;
        }
}

/* Values [c0, c0 + kc) of rows [j0, j0 + nr) straight from packed groups into the prefill GEMM's panel,
 * bp[p * ldb + r] = W[j0 + r][c0 + p]: a 64-byte piece holds 4 codes of each of a group's 16 rows, so
 * each code position becomes one 16-lane row of the panel (no transpose). Returns 0 (nothing done)
 * unless the rows are whole packed groups. */
int kvc_cpu_wdecode_panel(kvc_wmat w, int64_t j0, int nr, int64_t c0, int64_t kc, float *bp, int64_t ldb) {
#if defined(KVC_QSIMD)
    if (!w.packed || j0 % KVC_QG || nr % KVC_QG || j0 + nr > w.rows / KVC_QG * KVC_QG) return 0;
    const int q8 = w.type == GGML_T_Q8_0, hm = w.type == GGML_T_Q4_1;
    const size_t bb = ggml_block_bytes(w.type), h = hm ? 4 : 2;
    for (int g = 0; g < nr / KVC_QG; g++) {
        const uint8_t *grp = (const uint8_t *)w.p + (size_t)((j0 / KVC_QG + g) * KVC_QG) * w.row_bytes;
        for (int64_t b = c0 / 32; b < (c0 + kc) / 32; b++) {
            const uint8_t *run = grp + (size_t)b * KVC_QG * bb, *qs = run + h * KVC_QG;
            float *out = bp + (b * 32 - c0) * ldb + g * KVC_QG;
#if KVC_QSIMD == 512
            const __m512i f = _mm512_set1_epi32(15);
            const __m512 bias = _mm512_set1_ps(w.type == GGML_T_Q4_0 ? 8.f : 0.f);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)run));
            const __m512 m = hm ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(run + 32))) : _mm512_setzero_ps();
            for (int c = 0; c < (q8 ? 8 : 4); c++) {
                const __m512i v = _mm512_loadu_si512(qs + c * 64);
                for (int t = 0; t < 4; t++) {
                    if (q8) { /* byte t of each lane, sign-extended */
                        const __m512 x = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * t), 24));
                        _mm512_storeu_ps(out + (4 * c + t) * ldb, _mm512_mul_ps(d, x));
                    } else { /* low nibble: value 4c + t, high: 16 + 4c + t */
                        const __m512 lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * t), f)), bias);
                        const __m512 hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * t + 4), f)), bias);
                        _mm512_storeu_ps(out + (4 * c + t) * ldb, _mm512_fmadd_ps(d, lo, m));
                        _mm512_storeu_ps(out + (16 + 4 * c + t) * ldb, _mm512_fmadd_ps(d, hi, m));
                    }
                }
            }
#else /* the same per half group: rows 0-7 (bytes 0-31 of a piece) and 8-15 (bytes 32-63) */
            const __m256i f = _mm256_set1_epi32(15);
            const __m256 bias = _mm256_set1_ps(w.type == GGML_T_Q4_0 ? 8.f : 0.f);
            for (int hf = 0; hf < 2; hf++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + 16 * hf)));
                const __m256 m = hm ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + 32 + 16 * hf))) : _mm256_setzero_ps();
                float *o = out + 8 * hf;
                for (int c = 0; c < (q8 ? 8 : 4); c++) {
                    const __m256i v = LOADQ(qs + c * 64 + 32 * hf);
                    for (int t = 0; t < 4; t++) {
                        if (q8) {
                            const __m256 x = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * t), 24));
                            _mm256_storeu_ps(o + (4 * c + t) * ldb, _mm256_mul_ps(d, x));
                        } else {
                            const __m256 lo = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t), f)), bias);
                            const __m256 hi = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 4), f)), bias);
                            _mm256_storeu_ps(o + (4 * c + t) * ldb, _mm256_fmadd_ps(d, lo, m));
                            _mm256_storeu_ps(o + (16 + 4 * c + t) * ldb, _mm256_fmadd_ps(d, hi, m));
                        }
                    }
                }
            }
#endif
        }
    }
    return 1;
#else
    (void)w, (void)j0, (void)nr, (void)c0, (void)kc, (void)bp, (void)ldb;
    return 0;
#endif
}

float kvc_cpu_qdot(int32_t t, const void *w, kvc_q8row a, int64_t k, int ref) {
    if (kvc_cpu_wtype_kint8(t)) return kvc_cpu_qdot_k(t, w, a, k, ref);
    const int64_t nb = k / 32;
#if defined(KVC_QSIMD)
    if (!ref) switch (t) {
        case GGML_T_Q4_0: return qdot_q4_0(w, a, nb);
        case GGML_T_Q4_1: return qdot_q4_1(w, a, nb);
        case GGML_T_Q5_0: return qdot_q5_0(w, a, nb);
        case GGML_T_Q5_1: return qdot_q5_1(w, a, nb);
        case GGML_T_Q8_0: return qdot_q8_0(w, a, nb);
        default: break;
        }
#endif
    (void)ref;
    return qdot_ref(t, w, a, nb);
}

void kvc_cpu_wdecode(int32_t t, const void *w, int64_t c0, int64_t nc, float *dst) {
#if defined(__AVX512F__) && defined(__F16C__)
    /* 16-bit floats widen exactly: 16 at a time here, the tail below */
    if (t == GGML_T_F16 || t == GGML_T_BF16) {
        const uint16_t *h = (const uint16_t *)w + c0;
        int64_t i = 0;
        for (; i + 16 <= nc; i += 16) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(h + i));
            _mm512_storeu_ps(dst + i, t == GGML_T_F16 ? _mm512_cvtph_ps(x)
                                                      : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
        }
        for (; i < nc; i++) dst[i] = t == GGML_T_F16 ? kvc_f16_to_f32(h[i]) : kvc_bf16_to_f32(h[i]);
        return;
    }
#elif defined(__AVX2__) && defined(__F16C__)
    if (t == GGML_T_F16 || t == GGML_T_BF16) {
        const uint16_t *h = (const uint16_t *)w + c0;
        int64_t i = 0;
        for (; i + 8 <= nc; i += 8) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(h + i));
            _mm256_storeu_ps(dst + i, t == GGML_T_F16 ? _mm256_cvtph_ps(x)
                                                      : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
        }
        for (; i < nc; i++) dst[i] = t == GGML_T_F16 ? kvc_f16_to_f32(h[i]) : kvc_bf16_to_f32(h[i]);
        return;
    }
#endif
    const int64_t be = ggml_block_elems(t);
    const size_t bb = ggml_block_bytes(t);
    /* whole blocks of a row checked at load: cannot fail */
    (void)ggml_dequantize(t, (const char *)w + (size_t)(c0 / be) * bb, (size_t)(nc / be) * bb, dst, nc);
}

/* ---- the decode GEMV ---------------------------------------------------------------------------- */

/* Scratch that lives as long as its thread (the OpenMP pool's threads persist): grown, never freed
 * per call, so a decode step allocates nothing once warm. */
static void *tls_grow(void **p, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        void *q = realloc(*p, bytes);
        if (!q) return NULL;
        *p = q;
        *cap = bytes;
    }
    return *p;
}
static _Thread_local void *t_act, *t_row, *t_rows;
static _Thread_local size_t t_act_cap, t_row_cap, t_rows_cap;

static float dot_f32(const float *x, const float *y, int64_t k) {
    int64_t p = 0;
    float s = 0.f;
#if defined(KVC_SIMD)
    vf a0 = V_ZERO(), a1 = V_ZERO();
    for (; p + 2 * VL <= k; p += 2 * VL) {
        a0 = V_FMA(V_LOAD(x + p), V_LOAD(y + p), a0);
        a1 = V_FMA(V_LOAD(x + p + VL), V_LOAD(y + p + VL), a1);
    }
    s = V_HSUM(V_ADD(a0, a1));
#endif
    for (; p < k; p++) s += x[p] * y[p];
    return s;
}

/* x . row of 16-bit floats (F16, or BF16 with bf16 = 1), widened in registers: no decoded row. */
static float dot_h16(const float *x, const uint16_t *h, int64_t k, int bf16) {
    int64_t p = 0;
    float s = 0.f;
#if defined(__AVX512F__) && defined(__F16C__)
#define WIDEN(i) (bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + (i)))), 16)) \
                       : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + (i)))))
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; p + 32 <= k; p += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + p), WIDEN(p), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + p + 16), WIDEN(p + 16), a1);
    }
#undef WIDEN
    s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WIDEN(i) (bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + (i)))), 16)) \
                       : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + (i)))))
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; p + 16 <= k; p += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + p), WIDEN(p), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + p + 8), WIDEN(p + 8), a1);
    }
#undef WIDEN
    s = kvc_hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; p < k; p++) s += x[p] * (bf16 ? kvc_bf16_to_f32(h[p]) : kvc_f16_to_f32(h[p]));
    return s;
}

static void put(float *c, float v, int accumulate) { *c = accumulate ? *c + v : v; }

static void qgemv(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                  int accumulate, int ref) {
    const int par = (double)n * (double)w.row_bytes >= MIN_PAR_BYTES && !omp_in_parallel();
    /* rows handed out in small chunks: on a busy machine a descheduled thread holds up one chunk, not
     * its whole static share */
    const int64_t chunk = n / (16 * kvc_cpu_threads()) > 16 ? n / (16 * kvc_cpu_threads()) : 16;
    const int64_t nb = k / 32;
    /* per row: k codes, nb scales and sums (a few KB); without them (out of memory) the fp32 path below
     * is slower but exact */
    char *q = kvc_cpu_wtype_int8(w.type) ? tls_grow(&t_act, &t_act_cap, (size_t)(m * (k + 8 * nb))) : NULL;
    if (q) {
        kvc_q8row *rows = tls_grow(&t_rows, &t_rows_cap, sizeof(kvc_q8row) * (size_t)m);
        if (!rows) q = NULL;
    }
    if (q) {
        kvc_q8row *rows = t_rows;
        for (int64_t i = 0; i < m; i++) {
            char *base = q + i * (k + 8 * nb);
            rows[i] = (kvc_q8row){(float *)base, (float *)base + nb, (int8_t *)(base + 8 * nb)};
            kvc_cpu_quantize_q8(a + i * lda, k, rows[i]);
        }
        /* packed groups of 16 rows first, then the rows as in the file (the tail, or an unpacked matrix) */
        const int64_t groups = w.packed ? n / KVC_QG : 0, j0 = groups * KVC_QG;
        const int64_t gchunk = groups / (16 * kvc_cpu_threads()) > 1 ? groups / (16 * kvc_cpu_threads()) : 1;
#pragma omp parallel num_threads(kvc_cpu_threads()) if (par)
        {
#pragma omp for schedule(dynamic, gchunk) nowait
            for (int64_t g = 0; g < groups; g++)
                for (int64_t i0 = 0; i0 < m; i0 += KVC_QG) { /* activation rows KVC_QG at a time */
                    const int64_t mi = m - i0 < KVC_QG ? m - i0 : KVC_QG;
                    float out[KVC_QG * KVC_QG];
                    qgroup_rows(w, g, rows + i0, mi, nb, ref, out);
                    for (int64_t i = 0; i < mi; i++)
                        for (int r = 0; r < KVC_QG; r++) put(c + (i0 + i) * ldc + g * KVC_QG + r, out[i * KVC_QG + r], accumulate);
                }
#pragma omp for schedule(dynamic, chunk)
            for (int64_t j = j0; j < n; j++) {
                const char *row = (const char *)w.p + (size_t)j * w.row_bytes;
                for (int64_t i = 0; i < m; i++) put(c + i * ldc + j, kvc_cpu_qdot(w.type, row, rows[i], k, ref), accumulate);
            }
        }
        return;
    }
#pragma omp parallel num_threads(kvc_cpu_threads()) if (par)
    {
        float *r = tls_grow(&t_row, &t_row_cap, sizeof(float) * (size_t)k);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t j = 0; j < n; j++) {
            const char *row = (const char *)w.p + (size_t)j * w.row_bytes;
            if (w.type == GGML_T_F16 || w.type == GGML_T_BF16) {
                for (int64_t i = 0; i < m; i++)
                    put(c + i * ldc + j, dot_h16(a + i * lda, (const uint16_t *)row, k, w.type == GGML_T_BF16), accumulate);
            } else if (r && !w.packed) {
                kvc_cpu_wdecode(w.type, row, 0, k, r);
                for (int64_t i = 0; i < m; i++) put(c + i * ldc + j, dot_f32(a + i * lda, r, k), accumulate);
            } else { /* no scratch row (or a packed row, out of memory above): one block at a time */
                float blk[256];
                uint8_t bytes[256];
                const int64_t be = ggml_block_elems(w.type);
                for (int64_t i = 0; i < m; i++) {
                    float s = 0.f;
                    for (int64_t p = 0; p < k; p += be) {
                        kvc_cpu_wdecode(w.type, kvc_cpu_wrow_blocks(w, j, p / be, 1, bytes), 0, be, blk);
                        s += dot_f32(a + i * lda + p, blk, be);
                    }
                    put(c + i * ldc + j, s, accumulate);
                }
            }
        }
    }
}

void kvc_cpu_qgemv(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                   int accumulate) {
    qgemv(a, lda, w, c, ldc, m, n, k, accumulate, 0);
}

void kvc_cpu_qgemv_ref(const float *a, int64_t lda, kvc_wmat w, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                       int accumulate) {
    qgemv(a, lda, w, c, ldc, m, n, k, accumulate, 1);
}
