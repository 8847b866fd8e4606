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

} // namespace kvc
