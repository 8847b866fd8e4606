/* Elementwise kernels: fp32 <-> bf16 conversion, embedding gather, SwiGLU on the fused gate|up GEMM
 * output, bias add, position fill. Grid-stride loops, memory-bound. */
#include "common.cuh"

namespace kvc {

static inline unsigned blocks_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    const int64_t cap = (int64_t)g.sm_count * 32;
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

__global__ void f32_to_bf16_kernel(const float *__restrict__ s, bf16 *__restrict__ d, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        d[i] = __float2bfloat16(s[i]);
}
__global__ void bf16_to_f32_kernel(const bf16 *__restrict__ s, float *__restrict__ d, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        d[i] = __bfloat162float(s[i]);
}

kvc_status f32_to_bf16(const float *src, bf16 *dst, int64_t n) {
    if (n <= 0) return KVC_OK;
    f32_to_bf16_kernel<<<blocks_for(n, 256), 256, 0, g.stream>>>(src, dst, n);
    LAUNCH_TRY("f32_to_bf16");
    return KVC_OK;
}
kvc_status bf16_to_f32(const bf16 *src, float *dst, int64_t n) {
    if (n <= 0) return KVC_OK;
    bf16_to_f32_kernel<<<blocks_for(n, 256), 256, 0, g.stream>>>(src, dst, n);
    LAUNCH_TRY("bf16_to_f32");
    return KVC_OK;
}

/* x[i, :] = table[ids[i], :] as fp32: one block per token */
__global__ void embed_kernel(const bf16 *__restrict__ table, const int32_t *__restrict__ ids, int64_t D,
                             float *__restrict__ x) {
    const int64_t i = blockIdx.x;
    const bf16 *src = table + (int64_t)ids[i] * D;
    for (int64_t e = threadIdx.x; e < D; e += blockDim.x) x[i * D + e] = __bfloat162float(src[e]);
}
kvc_status embed(const bf16 *table, const int32_t *ids, int64_t n, int64_t D, float *x) {
    if (n <= 0) return KVC_OK;
    embed_kernel<<<(unsigned)n, 256, 0, g.stream>>>(table, ids, D, x);
    LAUNCH_TRY("embedding");
    return KVC_OK;
}

/* silu(g) * u, computed in fp32, rounded once */
__global__ void swiglu_kernel(bf16 *gu, int64_t rows, int64_t F) {
    const int64_t total = rows * F;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = t / F, i = t % F;
        bf16 *row = gu + r * 2 * F;
        const float gt = __bfloat162float(row[i]), up = __bfloat162float(row[F + i]);
        row[i] = __float2bfloat16(gt / (1.f + __expf(-gt)) * up);
    }
}
kvc_status swiglu(bf16 *gu, int64_t rows, int64_t F) {
    if (rows <= 0) return KVC_OK;
    swiglu_kernel<<<blocks_for(rows * F, 256), 256, 0, g.stream>>>(gu, rows, F);
    LAUNCH_TRY("swiglu");
    return KVC_OK;
}

/* gelu_tanh(g) * u (Gemma's GeGLU), computed in fp32, rounded once */
__global__ void geglu_kernel(bf16 *gu, int64_t rows, int64_t F) {
    const int64_t total = rows * F;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = t / F, i = t % F;
        bf16 *row = gu + r * 2 * F;
        const float x = __bfloat162float(row[i]), up = __bfloat162float(row[F + i]);
        row[i] = __float2bfloat16(0.5f * x * (1.f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))) * up);
    }
}
kvc_status geglu(bf16 *gu, int64_t rows, int64_t F) {
    if (rows <= 0) return KVC_OK;
    geglu_kernel<<<blocks_for(rows * F, 256), 256, 0, g.stream>>>(gu, rows, F);
    LAUNCH_TRY("geglu");
    return KVC_OK;
}

__global__ void scale_kernel(float *x, int64_t ld, int64_t rows, int64_t cols, float alpha) {
    const int64_t total = rows * cols;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x)
        x[(t / cols) * ld + t % cols] *= alpha;
}
kvc_status scale_rows(float *x, int64_t ld, int64_t rows, int64_t cols, float alpha) {
    if (rows <= 0) return KVC_OK;
    scale_kernel<<<blocks_for(rows * cols, 256), 256, 0, g.stream>>>(x, ld, rows, cols, alpha);
    LAUNCH_TRY("scale");
    return KVC_OK;
}

__global__ void add_bias_kernel(bf16 *y, int64_t ld, const float *__restrict__ b, int64_t rows, int64_t dim) {
    const int64_t total = rows * dim;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = t / dim, i = t % dim;
        y[r * ld + i] = __float2bfloat16(__bfloat162float(y[r * ld + i]) + b[i]);
    }
}
kvc_status add_bias(bf16 *y, int64_t ld, const float *b, int64_t rows, int64_t dim) {
    if (rows <= 0) return KVC_OK;
    add_bias_kernel<<<blocks_for(rows * dim, 256), 256, 0, g.stream>>>(y, ld, b, rows, dim);
    LAUNCH_TRY("add_bias");
    return KVC_OK;
}


} // namespace kvc
