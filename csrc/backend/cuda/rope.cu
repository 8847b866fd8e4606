/* Rotary position embedding in place on bf16 rows, and the append of new K/V rows to the ragged
 * cache. RoPE: for pair (a, b) and i < d/2, angle = pos * inv_freq[i] (in double, like the CPU
 * backend: positions reach 1e5+), a' = a cos - b sin, b' = a sin + b cos; KVC_ROPE_HALF pairs
 * (i, i + d/2), KVC_ROPE_ADJACENT (2i, 2i + 1); cos and sin times mscale on the pairs that turn (a pair of frequency
 * 0, the pass-through part of a partial rotary embedding, is left as it is). One block per token: cos/sin once,
 * every head. */
#include "common.cuh"

namespace kvc {

__global__ void rope_kernel(bf16 *x, int64_t ld, int64_t col0, int32_t heads, int32_t d, const int64_t *__restrict__ pos,
                            const float *__restrict__ inv_freq, int32_t pairing, float mscale) {
    extern __shared__ float cs[]; /* [half] cos, then [half] sin */
    const int64_t t = blockIdx.x;
    const int32_t half = d / 2;
    float *sn = cs + half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double s, c;
        sincos((double)pos[t] * (double)inv_freq[i], &s, &c);
        const double ms = inv_freq[i] != 0.0f ? (double)mscale : 1.0;
        cs[i] = (float)(ms * c);
        sn[i] = (float)(ms * s);
    }
    __syncthreads();
    bf16 *row = x + t * ld + col0;
    for (int u = threadIdx.x; u < heads * half; u += blockDim.x) {
        const int h = u / half, i = u % half;
        bf16 *v = row + (int64_t)h * d;
        const int ia = pairing == KVC_ROPE_ADJACENT ? 2 * i : i, ib = pairing == KVC_ROPE_ADJACENT ? 2 * i + 1 : i + half;
        const float a = __bfloat162float(v[ia]), b = __bfloat162float(v[ib]);
        v[ia] = __float2bfloat16(a * cs[i] - b * sn[i]);
        v[ib] = __float2bfloat16(a * sn[i] + b * cs[i]);
    }
}

kvc_status rope(bf16 *x, int64_t ld, int64_t col0, int64_t n, int32_t heads, int32_t d, const int64_t *pos,
                const float *inv_freq, int32_t pairing, float mscale) {
    if (n <= 0) return KVC_OK;
    if (n > 2147483647) return fail(KVC_ERR_ARG, "rope: too many tokens");
    rope_kernel<<<(unsigned)n, 128, sizeof(float) * d, g.stream>>>(x, ld, col0, heads, d, pos, inv_freq, pairing, mscale);
    LAUNCH_TRY("rope");
    return KVC_OK;
}

/* one block per (token, KV head); 16-byte copies when d is a multiple of 8 */
__global__ void append_kv_kernel(const bf16 *__restrict__ src, int64_t ld, int64_t kcol, int64_t vcol, int32_t Hkv,
                                 int32_t d, bf16 *const *kp, bf16 *const *vp, const int32_t *__restrict__ base) {
    const int64_t i = blockIdx.x;
    const int h = blockIdx.y;
    const int64_t row = (int64_t)base[h] + i;
    const bf16 *ks = src + i * ld + kcol + (int64_t)h * d, *vs = src + i * ld + vcol + (int64_t)h * d;
    bf16 *kd = kp[h] + row * d, *vd = vp[h] + row * d;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        kd[e] = ks[e];
        vd[e] = vs[e];
    }
}

kvc_status append_kv(const bf16 *src, int64_t ld, int64_t kcol, int64_t vcol, int64_t n, int32_t Hkv, int32_t d,
                     bf16 *const *kp, bf16 *const *vp, const int32_t *base) {
    if (n <= 0) return KVC_OK;
    dim3 grid((unsigned)n, (unsigned)Hkv);
    append_kv_kernel<<<grid, d < 128 ? d : 128, 0, g.stream>>>(src, ld, kcol, vcol, Hkv, d, kp, vp, base);
    LAUNCH_TRY("append_kv");
    return KVC_OK;
}

__global__ void add_lens_kernel(int32_t *len, int32_t count, int32_t add) {
    if (threadIdx.x < count) len[threadIdx.x] += add;
}
kvc_status add_lens(int32_t *len, int32_t count, int32_t add) {
    add_lens_kernel<<<1, 64, 0, g.stream>>>(len, count, add);
    LAUNCH_TRY("add_lens");
    return KVC_OK;
}

} // namespace kvc
