/* ggml tensor formats -> fp32 (block layouts of ggml's quantisation types). Contraction to FMA is off
 * so that q * d + m rounds exactly as the reference dequantisers (ggml, gguf-py) do. */
#pragma GCC optimize("fp-contract=off")
#include <string.h>

#include "convert.h"
#include "dequant.h"
#include "gguf.h"

/* bytes of one block: Q4_0 = fp16 d + 16 bytes of nibbles; Q4_1 = fp16 d, fp16 m + 16 bytes;
 * Q8_0 = fp16 d + 32 int8. Elements 0..15 of a Q4 block are the low nibbles, 16..31 the high. */
int64_t ggml_block_elems(int32_t type) {
    switch (type) {
    case GGML_T_F32: case GGML_T_F16: case GGML_T_BF16: return 1;
    case GGML_T_Q4_0: case GGML_T_Q4_1: case GGML_T_Q8_0: return 32;
    default: return 0;
    }
}

size_t ggml_block_bytes(int32_t type) {
    switch (type) {
    case GGML_T_F32: return 4;
    case GGML_T_F16: case GGML_T_BF16: return 2;
    case GGML_T_Q4_0: return 18;
    case GGML_T_Q4_1: return 20;
    case GGML_T_Q8_0: return 34;
    default: return 0;
    }
}

const char *ggml_type_name(int32_t type) {
    switch (type) {
    case GGML_T_F32: return "F32";
    case GGML_T_F16: return "F16";
    case GGML_T_BF16: return "BF16";
    case GGML_T_Q4_0: return "Q4_0";
    case GGML_T_Q4_1: return "Q4_1";
    case GGML_T_Q8_0: return "Q8_0";
    default: return "unsupported";
    }
}

kvc_status ggml_nbytes(int32_t type, int64_t n, size_t *out) {
    const int64_t be = ggml_block_elems(type);
    if (!be) return kvc_fail(KVC_ERR_UNSUPPORTED, "ggml tensor type %d is not supported (F32, F16, BF16, Q4_0, Q4_1, Q8_0 are)", type);
    if (n < 0 || n % be) return kvc_fail(KVC_ERR_FORMAT, "%lld elements is not a whole number of %s blocks", (long long)n, ggml_type_name(type));
    size_t bytes;
    if (kvc_mul_ok((size_t)(n / be), ggml_block_bytes(type), &bytes)) return kvc_fail(KVC_ERR_FORMAT, "tensor size overflows");
    *out = bytes;
    return KVC_OK;
}

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kvc_f16_to_f32(h);
}

kvc_status ggml_dequantize(int32_t type, const void *src, size_t src_bytes, float *dst, int64_t n) {
    size_t need;
    KVC_TRY(ggml_nbytes(type, n, &need));
    if (src_bytes != need)
        return kvc_fail(KVC_ERR_ARG, "dequantize: %lld %s values need %zu bytes, got %zu", (long long)n, ggml_type_name(type), need, src_bytes);
    const uint8_t *s = src;
    const int64_t nb = n / ggml_block_elems(type);
    switch (type) {
    case GGML_T_F32:
        memcpy(dst, s, (size_t)n * 4);
        break;
    case GGML_T_F16:
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) dst[i] = half(s + 2 * i);
        break;
    case GGML_T_BF16:
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            uint16_t b;
            memcpy(&b, s + 2 * i, 2);
            dst[i] = kvc_bf16_to_f32(b);
        }
        break;
    case GGML_T_Q4_0:
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = s + b * 18;
            const float d = half(blk);
            float *o = dst + b * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = ((int)(blk[2 + j] & 15) - 8) * d;
                o[j + 16] = ((int)(blk[2 + j] >> 4) - 8) * d;
            }
        }
        break;
    case GGML_T_Q4_1:
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = s + b * 20;
            const float d = half(blk), m = half(blk + 2);
            float *o = dst + b * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = (float)(blk[4 + j] & 15) * d + m;
                o[j + 16] = (float)(blk[4 + j] >> 4) * d + m;
            }
        }
        break;
    case GGML_T_Q8_0:
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = s + b * 34;
            const float d = half(blk);
            float *o = dst + b * 32;
            for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)blk[2 + j] * d;
        }
        break;
    default:
        return kvc_fail(KVC_ERR_UNSUPPORTED, "ggml tensor type %d is not supported", type);
    }
    return KVC_OK;
}

kvc_status kvc_kernel_dequantize(int32_t type, const void *src, size_t src_bytes, float *dst, int64_t n) {
    if (!src || !dst) return kvc_fail(KVC_ERR_ARG, "dequantize: null pointer");
    if (n < 0) return kvc_fail(KVC_ERR_ARG, "dequantize: negative count");
    return ggml_dequantize(type, src, src_bytes, dst, n);
}
