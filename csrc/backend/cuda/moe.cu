/* The mixture-of-experts kernels (core/backend.h, table version 7): routing (softmax over the experts, the top k,
 * renormalised), the gather of the rows an expert runs on, and each token's weighted sum of its experts' outputs
 * added to the residual stream. Compiled for sm_90; not yet run on a GPU (no GPU in the session that wrote them). */
#include "common.cuh"

namespace kvc {

static inline unsigned grid_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    const int64_t cap = (int64_t)g.sm_count * 32;
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

/* a ranks before b: higher p, then the lower expert; NaN below every number (the CPU's rule, backend/cpu/moe.c) */
__device__ __forceinline__ bool ranks_before(float pa, int a, float pb, int b) {
    if (isnan(pa) || isnan(pb)) return isnan(pb) && (!isnan(pa) || a < b);
    return pa > pb || (pa == pb && a < b);
}

#define ROUTE_THREADS 128

/* The block's best (value, expert) by ranks_before; every thread gets it. */
__device__ void block_best(float &v, int &i, float *sv, int *si) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (oi >= 0 && (i < 0 || ranks_before(ov, oi, v, i))) v = ov, i = oi;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < warps; w++)
        if (si[w] >= 0 && (i < 0 || ranks_before(sv[w], si[w], v, i))) v = sv[w], i = si[w];
}

/* The block's sum (every thread gets it). */
__device__ float block_sum(float v, float *sv) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    float s = 0;
    for (int w = 0; w < warps; w++) s += sv[w];
    return s;
}

/* The block's largest value, NaN ignored (every thread gets it). */
__device__ float block_max(float v, float *sv) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    float m = sv[0];
    for (int w = 1; w < warps; w++) m = fmaxf(m, sv[w]);
    return m;
}

/* One block per token: p = softmax(logits) in shared memory, then k rounds of the block's best untaken expert. */
__global__ void moe_route_kernel(const float *__restrict__ logits, int64_t ldl, int E, int k, int norm, int32_t *__restrict__ ids,
                                 int64_t ldi, float *__restrict__ w, int64_t ldw) {
    extern __shared__ float p[]; /* [E], then E taken flags */
    unsigned char *taken = (unsigned char *)(p + E);
    __shared__ float sv[32];
    __shared__ int si[32];
    const float *row = logits + blockIdx.x * ldl;
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        p[e] = row[e];
        taken[e] = 0;
        mx = fmaxf(mx, p[e]);
    }
    mx = block_max(mx, sv);
    float part = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) part += (p[e] = expf(p[e] - mx));
    const float sum = block_sum(part, sv);
    for (int e = threadIdx.x; e < E; e += blockDim.x) p[e] /= sum;
    __syncthreads();
    float chosen = 0;
    for (int j = 0; j < k; j++) {
        float v = 0;
        int best = -1;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (!taken[e] && (best < 0 || ranks_before(p[e], e, v, best))) v = p[e], best = e;
        block_best(v, best, sv, si);
        if (threadIdx.x == 0) {
            taken[best] = 1;
            ids[blockIdx.x * ldi + j] = best;
            w[blockIdx.x * ldw + j] = v;
        }
        chosen += v;
        __syncthreads();
    }
    if (norm && threadIdx.x == 0)
        for (int j = 0; j < k; j++) w[blockIdx.x * ldw + j] /= chosen;
}

kvc_status moe_route(const float *logits, int64_t ldl, int64_t n, int32_t E, int32_t k, int32_t norm, int32_t *ids, int64_t ldi,
                     float *w, int64_t ldw) {
    if (n <= 0) return KVC_OK;
    if (E < 1 || k < 1 || k > E || E > 4096) return fail(KVC_ERR_INTERNAL, "moe_route: %d of %d experts", k, E);
    const size_t smem = sizeof(float) * (size_t)E + (size_t)E;
    moe_route_kernel<<<(unsigned)n, ROUTE_THREADS, smem, g.stream>>>(logits, ldl, E, k, norm, ids, ldi, w, ldw);
    LAUNCH_TRY("moe_route");
    return KVC_OK;
}

__global__ void gather_rows_kernel(const bf16 *__restrict__ src, int64_t lds, const int32_t *__restrict__ idx, int64_t n,
                                   int64_t D, bf16 *__restrict__ dst, int64_t ldd) {
    const int64_t total = n * D;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = t / D, c = t % D;
        dst[i * ldd + c] = src[(int64_t)idx[i] * lds + c];
    }
}

kvc_status gather_rows(const bf16 *src, int64_t lds, const int32_t *idx, int64_t n, int64_t D, bf16 *dst, int64_t ldd) {
    if (n <= 0) return KVC_OK;
    gather_rows_kernel<<<grid_for(n * D, 256), 256, 0, g.stream>>>(src, lds, idx, n, D, dst, ldd);
    LAUNCH_TRY("gather_rows");
    return KVC_OK;
}

/* x[r, c] += sum over j, in order, of w[r, j] y[pos[r, j], c] (fp32; one addition to x per element) */
__global__ void moe_combine_kernel(float *__restrict__ x, int64_t ldx, const bf16 *__restrict__ y, int64_t ldy,
                                   const float *__restrict__ w, int64_t ldw, const int32_t *__restrict__ pos, int64_t ldp,
                                   int64_t n, int k, int64_t D) {
    const int64_t total = n * D;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = t / D, c = t % D;
        float acc = 0.f;
        for (int j = 0; j < k; j++) acc += w[r * ldw + j] * __bfloat162float(y[(int64_t)pos[r * ldp + j] * ldy + c]);
        x[r * ldx + c] += acc;
    }
}

kvc_status moe_combine(float *x, int64_t ldx, const bf16 *y, int64_t ldy, const float *w, int64_t ldw, const int32_t *pos,
                       int64_t ldp, int64_t n, int32_t k, int64_t D) {
    if (n <= 0) return KVC_OK;
    moe_combine_kernel<<<grid_for(n * D, 256), 256, 0, g.stream>>>(x, ldx, y, ldy, w, ldw, pos, ldp, n, k, D);
    LAUNCH_TRY("moe_combine");
    return KVC_OK;
}

} // namespace kvc
