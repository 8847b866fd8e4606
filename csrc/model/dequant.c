/* ggml tensor formats -> fp32, written from the block layouts of ggml's quantisation types.
 * Contraction to FMA is off so that d * q + m rounds exactly as the reference dequantisers (ggml,
 * gguf-py) do: a model loads to the same fp32 weights everywhere. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <omp.h>
#include <string.h>

#include "convert.h"
#include "dequant.h"
#include "gguf.h"

/* Below this many values a tensor is converted on one thread (~1-2 ms of work): every parallel
 * region ends in a barrier, and on a busy machine waiting there for a descheduled worker costs
 * more than the conversion (measured: 2 threads 4x slower than 1 over SmolLM2's 272 tensors). */
#define PAR_MIN_VALUES (1 << 22)

typedef struct type_info {
    const char *name;
    int32_t block_elems; /* 0: no such type */
    int32_t block_bytes;
    int32_t supported;   /* ggml_dequantize handles it */
} type_info;

/* Every ggml type id a GGUF file may hold, so that tensors of types we cannot decode are still
 * bounds-checked and named in errors. Block sizes are checked against gguf-py in the tests. */
static const type_info TYPES[] = {
    [GGML_T_F32] = {"F32", 1, 4, 1},          [GGML_T_F16] = {"F16", 1, 2, 1},
    [GGML_T_Q4_0] = {"Q4_0", 32, 18, 1},      [GGML_T_Q4_1] = {"Q4_1", 32, 20, 1},
    [GGML_T_Q5_0] = {"Q5_0", 32, 22, 1},      [GGML_T_Q5_1] = {"Q5_1", 32, 24, 1},
    [GGML_T_Q8_0] = {"Q8_0", 32, 34, 1},      [9] = {"Q8_1", 32, 40, 0},
    [GGML_T_Q2_K] = {"Q2_K", 256, 84, 1},     [GGML_T_Q3_K] = {"Q3_K", 256, 110, 1},
    [GGML_T_Q4_K] = {"Q4_K", 256, 144, 1},    [GGML_T_Q5_K] = {"Q5_K", 256, 176, 1},
    [GGML_T_Q6_K] = {"Q6_K", 256, 210, 1},    [15] = {"Q8_K", 256, 292, 0},
    [16] = {"IQ2_XXS", 256, 66, 0},           [17] = {"IQ2_XS", 256, 74, 0},
    [18] = {"IQ3_XXS", 256, 98, 0},           [19] = {"IQ1_S", 256, 50, 0},
    [20] = {"IQ4_NL", 32, 18, 0},             [21] = {"IQ3_S", 256, 110, 0},
    [22] = {"IQ2_S", 256, 82, 0},             [23] = {"IQ4_XS", 256, 136, 0},
    [24] = {"I8", 1, 1, 0},                   [25] = {"I16", 1, 2, 0},
    [26] = {"I32", 1, 4, 0},                  [27] = {"I64", 1, 8, 0},
    [28] = {"F64", 1, 8, 0},                  [29] = {"IQ1_M", 256, 56, 0},
    [GGML_T_BF16] = {"BF16", 1, 2, 1},        [34] = {"TQ1_0", 256, 54, 0},
    [35] = {"TQ2_0", 256, 66, 0},             [39] = {"MXFP4", 32, 17, 0},
    [40] = {"NVFP4", 64, 36, 0},              [41] = {"Q1_0", 128, 18, 0},
};
#define N_TYPES ((int32_t)(sizeof TYPES / sizeof TYPES[0]))

static const type_info *info(int32_t type) {
    if (type < 0 || type >= N_TYPES || TYPES[type].block_elems == 0) return NULL;
    return &TYPES[type];
}

int64_t ggml_block_elems(int32_t type) {
    const type_info *t = info(type);
    return t ? t->block_elems : 0;
}

size_t ggml_block_bytes(int32_t type) {
    const type_info *t = info(type);
    return t ? (size_t)t->block_bytes : 0;
}

const char *ggml_type_name(int32_t type) {
    const type_info *t = info(type);
    return t ? t->name : "unknown";
}

int ggml_type_known(int32_t type) { return info(type) != NULL; }

int ggml_type_supported(int32_t type) {
    const type_info *t = info(type);
    return t && t->supported;
}

kvc_status ggml_nbytes(int32_t type, int64_t n, size_t *out) {
    const type_info *t = info(type);
    if (!t) return kvc_fail(KVC_ERR_UNSUPPORTED, "ggml tensor type %d is unknown to this version of kvpress_c", type);
    if (n < 0 || n % t->block_elems)
        return kvc_fail(KVC_ERR_FORMAT, "%lld elements is not a whole number of %s blocks (%d values each)", (long long)n,
                        t->name, t->block_elems);
    size_t bytes;
    if (kvc_mul_ok((size_t)(n / t->block_elems), (size_t)t->block_bytes, &bytes))
        return kvc_fail(KVC_ERR_FORMAT, "%lld %s values overflow the address space", (long long)n, t->name);
    *out = bytes;
    return KVC_OK;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kvc_f16_to_f32v(h);
}

static inline float bf16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kvc_bf16_to_f32(h);
}

/* ---- 32-value blocks. Q4/Q5: byte j holds element j (low nibble) and j + 16 (high nibble). ---- */

static inline void q4_0(const uint8_t *b, float *o) { /* fp16 d, 16 bytes: (q - 8) d */
    const float d = half_at(b);
    for (int j = 0; j < 16; j++) {
        o[j] = (float)((b[2 + j] & 15) - 8) * d;
        o[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
    }
}

static inline void q4_1(const uint8_t *b, float *o) { /* fp16 d, fp16 m, 16 bytes: q d + m */
    const float d = half_at(b), m = half_at(b + 2);
    for (int j = 0; j < 16; j++) {
        o[j] = (float)(b[4 + j] & 15) * d + m;
        o[j + 16] = (float)(b[4 + j] >> 4) * d + m;
    }
}

/* Q5: the fifth bit of element e is bit e of a little-endian u32 after the scales. */
static inline void q5_0(const uint8_t *b, float *o) { /* fp16 d, u32 qh, 16 bytes: (q - 16) d */
    const float d = half_at(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4));         /* int: q - 16 may be negative */
        const int hi = (int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        o[j] = (float)(lo - 16) * d;
        o[j + 16] = (float)(hi - 16) * d;
    }
}

static inline void q5_1(const uint8_t *b, float *o) { /* fp16 d, fp16 m, u32 qh, 16 bytes: q d + m */
    const float d = half_at(b), m = half_at(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        o[j] = (float)((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) * d + m;
        o[j + 16] = (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m;
    }
}

static inline void q8_0(const uint8_t *b, float *o) { /* fp16 d, 32 int8: q d */
    const float d = half_at(b);
    for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)b[2 + j] * d;
}

/* ---- 256-value super-blocks (k-quants). Loops run over runs of 16 values that share a scale and
 * a bit position, so that the inner loops have constant shifts and vectorise. ---- */

static inline void q2_k(const uint8_t *b, float *o) {
    /* 16 scale bytes (low nibble: scale, high: min, per 16 values), 64 bytes of 2-bit values,
     * fp16 d, fp16 dmin. Byte l of half h holds elements 128h + 32s + l at bits 2s. */
    const uint8_t *sc = b, *qs = b + 16;
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int r = 0; r < 2; r++) {
                const int j = 8 * h + 2 * s + r; /* run of 16 values: elements 16j .. 16j + 15 */
                const float dl = d * (float)(sc[j] & 15), ml = dmin * (float)(sc[j] >> 4);
                const uint8_t *q = qs + 32 * h + 16 * r;
                for (int l = 0; l < 16; l++) o[16 * j + l] = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
            }
}

static inline void q3_k(const uint8_t *b, float *o) {
    /* 32 bytes of high bits (bit e/32 of byte e%32), 64 bytes of 2-bit low parts (as Q2_K), 12
     * bytes of 6-bit signed scales per 16 values, fp16 d. A clear high bit subtracts 4. */
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = half_at(b + 108);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int r = 0; r < 2; r++) {
                const int j = 8 * h + 2 * s + r, bit = 4 * h + s;
                const int lo = (sc[j & 7] >> (4 * (j >> 3))) & 15, hi = (sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
                const float dl = d * (float)((lo | (hi << 4)) - 32);
                const uint8_t *q = qs + 32 * h + 16 * r, *m = hm + 16 * r;
                for (int l = 0; l < 16; l++)
                    o[16 * j + l] = dl * (float)((int)((q[l] >> (2 * s)) & 3) - (((m[l] >> bit) & 1) ? 0 : 4));
            }
}

/* Q4_K/Q5_K: 8 groups of 32 values, each with a 6-bit scale and min packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline void q4_k(const uint8_t *b, float *o) {
    /* fp16 d, fp16 dmin, 12 scale bytes, 128 bytes: byte l of chunk c holds elements 64c + l (low
     * nibble) and 64c + 32 + l (high) */
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *qs = b + 16;
    for (int g = 0; g < 8; g++) {
        int sc, m;
        k_scale_min(b + 4, g, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (g >> 1);
        const int shift = 4 * (g & 1);
        for (int l = 0; l < 32; l++) o[32 * g + l] = dl * (float)((q[l] >> shift) & 15) - ml;
    }
}

static inline void q5_k(const uint8_t *b, float *o) {
    /* as Q4_K with 32 bytes of fifth bits (bit g of byte l for element 32g + l) before the nibbles */
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 8; g++) {
        int sc, m;
        k_scale_min(b + 4, g, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (g >> 1);
        const int shift = 4 * (g & 1);
        for (int l = 0; l < 32; l++)
            o[32 * g + l] = dl * (float)(((q[l] >> shift) & 15) | (((qh[l] >> g) & 1) << 4)) - ml;
    }
}

static inline void q6_k(const uint8_t *b, float *o) {
    /* 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (per 16 values), fp16
     * d. In half n, group g (32 values): low nibble (g < 2) or high nibble of ql[64n + 32(g&1) + l],
     * bits 2g of qh[32n + l]; value (q - 32) * d * scale. */
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < 2; n++)
        for (int g = 0; g < 4; g++)
            for (int r = 0; r < 2; r++) {
                const int j = 8 * n + 2 * g + r;
                const float dl = d * (float)sc[j];
                const uint8_t *ql = b + 64 * n + 32 * (g & 1) + 16 * r, *qh = b + 128 + 32 * n + 16 * r;
                const int shift = 4 * (g >> 1);
                for (int l = 0; l < 16; l++)
                    o[16 * j + l] = dl * (float)((int)(((ql[l] >> shift) & 15) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32);
            }
}

/* Threads only for a large array and outside a parallel region: a serial region (an `if` clause that is false, or a
 * nested region) still enters the OpenMP runtime, which allocates a team and takes locks at every call; the blocked
 * GEMM's panel packing calls this from its threads for every panel of a K-quant weight (a fifth of a prefill's time
 * there before). */
#define PAR_LOOP(i, count, body)                                             \
    do {                                                                     \
        if (n >= PAR_MIN_VALUES && !omp_in_parallel()) {                     \
            _Pragma("omp parallel for schedule(static)")                     \
            for (int64_t i = 0; i < (count); i++) body;                      \
        } else {                                                             \
            for (int64_t i = 0; i < (count); i++) body;                      \
        }                                                                    \
    } while (0)
#define BLOCK_LOOP(fn) PAR_LOOP(i, nb, fn(s + i * bs, dst + i * be))

kvc_status ggml_dequantize(int32_t type, const void *src, size_t src_bytes, float *dst, int64_t n) {
    size_t need = 0;
    KVC_TRY(ggml_nbytes(type, n, &need));
    if (src_bytes != need)
        return kvc_fail(KVC_ERR_ARG, "dequantize: %lld %s values need %zu bytes, got %zu", (long long)n, ggml_type_name(type),
                        need, src_bytes);
    if (!ggml_type_supported(type))
        return kvc_fail(KVC_ERR_UNSUPPORTED,
                        "ggml tensor type %s is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K are)",
                        ggml_type_name(type));
    if (n == 0) return KVC_OK;
    const uint8_t *s = src;
    const int64_t be = ggml_block_elems(type), bs = (int64_t)ggml_block_bytes(type), nb = n / be;
    switch (type) {
    case GGML_T_F32:
        memcpy(dst, s, (size_t)n * 4);
        break;
    case GGML_T_F16:
        PAR_LOOP(i, n, dst[i] = half_at(s + 2 * i));
        break;
    case GGML_T_BF16:
        PAR_LOOP(i, n, dst[i] = bf16_at(s + 2 * i));
        break;
    case GGML_T_Q4_0: BLOCK_LOOP(q4_0); break;
    case GGML_T_Q4_1: BLOCK_LOOP(q4_1); break;
    case GGML_T_Q5_0: BLOCK_LOOP(q5_0); break;
    case GGML_T_Q5_1: BLOCK_LOOP(q5_1); break;
    case GGML_T_Q8_0: BLOCK_LOOP(q8_0); break;
    case GGML_T_Q2_K: BLOCK_LOOP(q2_k); break;
    case GGML_T_Q3_K: BLOCK_LOOP(q3_k); break;
    case GGML_T_Q4_K: BLOCK_LOOP(q4_k); break;
    case GGML_T_Q5_K: BLOCK_LOOP(q5_k); break;
    case GGML_T_Q6_K: BLOCK_LOOP(q6_k); break;
    default:
        return kvc_fail(KVC_ERR_INTERNAL, "dequantize: type %s marked supported but not handled", ggml_type_name(type));
    }
    return KVC_OK;
}

kvc_status kvc_kernel_dequantize(int32_t type, const void *src, size_t src_bytes, float *dst, int64_t n) {
    if (n < 0) return kvc_fail(KVC_ERR_ARG, "dequantize: negative element count %lld", (long long)n);
    if (n > 0 && (!src || !dst)) return kvc_fail(KVC_ERR_ARG, "dequantize: null pointer");
    return ggml_dequantize(type, src, src_bytes, dst, n);
}
