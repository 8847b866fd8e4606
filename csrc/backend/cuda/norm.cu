/* RMSNorm on the fp32 residual stream, fused with the residual add of the previous block:
 *   x[r] += o[r] (if o);  y[r] = bf16(x[r] / sqrt(mean(x[r]^2) + eps) * w)
 * One block per row; the sum of squares in fp32 with a block reduction. */
#include "common.cuh"

namespace kvc {

template <int T>
__global__ void __launch_bounds__(T) rmsnorm_kernel(float *__restrict__ x, const bf16 *__restrict__ o, int64_t ldo,
                                                    const float *__restrict__ w, bf16 *__restrict__ y, int64_t D,
                                                    float eps) {
    __shared__ float red[T / 32];
    const int64_t r = blockIdx.x;
    float *xr = x + r * D;
    float ss = 0.f;
    for (int64_t e = threadIdx.x; e < D; e += T) {
        float v = xr[e];
        if (o) {
            v += __bfloat162float(o[r * ldo + e]);
            xr[e] = v;
        }
        ss += v * v;
    }
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < T / 32 ? red[threadIdx.x] : 0.f;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float inv = rsqrtf(red[0] / (float)D + eps);
    for (int64_t e = threadIdx.x; e < D; e += T) y[r * D + e] = __float2bfloat16(xr[e] * inv * w[e]);
}

kvc_status rmsnorm(float *x, const bf16 *o, int64_t ldo, const float *w, bf16 *y, int64_t rows, int64_t D, float eps) {
    if (rows <= 0) return KVC_OK;
    if (rows > 2147483647) return fail(KVC_ERR_ARG, "rmsnorm: too many rows");
    rmsnorm_kernel<256><<<(unsigned)rows, 256, 0, g.stream>>>(x, o, ldo, w, y, D, eps);
    LAUNCH_TRY("rmsnorm");
    return KVC_OK;
}

/* Qwen3's q/k norm in place on bf16 heads: one warp per (row, head), d <= 256 values, fp32 sum of squares
 * (the CPU reference sums in double; the difference is far below bf16's rounding of the result). */
__global__ void head_rmsnorm_kernel(bf16 *x, int64_t ld, int64_t col0, int32_t heads, int32_t d, const float *__restrict__ w,
                                    float eps) {
    const int64_t r = blockIdx.x;
    const int h = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (h >= heads) return;
    bf16 *v = x + r * ld + col0 + (int64_t)h * d;
    float ss = 0.f;
    for (int e = lane; e < d; e += 32) {
        const float a = __bfloat162float(v[e]);
        ss += a * a;
    }
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int e = lane; e < d; e += 32) v[e] = __float2bfloat16(__bfloat162float(v[e]) * inv * w[e]);
}

kvc_status head_rmsnorm(bf16 *x, int64_t ld, int64_t col0, int64_t n, int32_t heads, int32_t d, const float *w, float eps) {
    if (n <= 0) return KVC_OK;
    if (n > 2147483647) return fail(KVC_ERR_ARG, "head_rmsnorm: too many rows");
    const int warps = 4; /* heads per block */
    dim3 grid((unsigned)n, (unsigned)((heads + warps - 1) / warps));
    head_rmsnorm_kernel<<<grid, 32 * warps, 0, g.stream>>>(x, ld, col0, heads, d, w, eps);
    LAUNCH_TRY("head_rmsnorm");
    return KVC_OK;
}

} // namespace kvc
