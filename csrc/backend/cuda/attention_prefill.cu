/* Causal GQA prefill attention over the ragged cache, flash style (FlashAttention-2 schedule,
 * written from the algorithm): a block owns 64 queries of one query head; keys and values go through
 * shared memory in tiles of 64 with an online softmax (running max m and sum l per row; when the
 * max grows the row's output is rescaled by exp(m_old - m_new)), so no n x n buffer ever exists.
 * Q K^T and P V run on tensor cores (WMMA bf16 16x16x16, fp32 accumulation). Each of the 4 warps owns
 * 16 query rows: their scores, probabilities and output accumulator never leave the warp, so the
 * only block barriers are around the K/V tile loads. The output accumulator lives in shared memory
 * (fp32) between tiles because WMMA fragments have no row layout to rescale in registers.
 * Query i of KV head h sees cache rows < past[h] + i + 1, from start[i, h] on with a sliding window
 * (the key loop begins at the tile of the block's first query's start). head_dim 64 and 128 take this kernel;
 * others a simple warp-per-query kernel (correct, slower). */
#include <mma.h>

#include "attention_tiles.cuh"

namespace kvc {

using namespace nvcuda;

#define BR 64
#define BC 64

template <int D> struct FlashSmem {
    static constexpr int LDH = D + 8, LDS = BC + 4, LDP = BC + 8, LDO = D + 4;
    static constexpr size_t bytes = (size_t)BR * LDH * 2 + (size_t)BC * LDH * 2 * 2 + (size_t)BR * LDS * 4 +
                                    (size_t)BR * LDP * 2 + (size_t)BR * LDO * 4 + 2 * BR * 4;
};

template <int D, class Src>
__global__ void __launch_bounds__(128) flash_prefill_kernel(const bf16 *__restrict__ q, int64_t ldq, int64_t n,
                                                            int32_t g, const Src src,
                                                            const int32_t *__restrict__ past_arr,
                                                            const int64_t *__restrict__ start, float scale, float cap,
                                                            bf16 *__restrict__ out, int64_t ldo) {
    using S = FlashSmem<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Qs = (bf16 *)smem;
    bf16 *Ks = Qs + BR * S::LDH;
    bf16 *Vs = Ks + BC * S::LDH;
    float *Ss = (float *)(Vs + BC * S::LDH);
    bf16 *Ps = (bf16 *)(Ss + BR * S::LDS);
    float *Os = (float *)(Ps + BR * S::LDP);
    float *Ms = Os + BR * S::LDO;
    float *Ls = Ms + BR;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const PrefillBlock blk = prefill_block<BR, BC>(n, g, past_arr, start);
    const typename Src::Head rows = src.head(blk.h, D);
    const int hq = blk.hq;
    const int64_t q0 = blk.q0, past = blk.past, kend = blk.kend;
    constexpr int VEC = D / 8; /* 16-byte vectors per row */
    const uint4 zero = make_uint4(0, 0, 0, 0);

    for (int t = threadIdx.x; t < BR * VEC; t += blockDim.x) {
        const int r = t / VEC, c = (t % VEC) * 8;
        uint4 val = zero;
        if (q0 + r < n) val = *(const uint4 *)(q + (q0 + r) * ldq + (int64_t)hq * D + c);
        *(uint4 *)(Qs + r * S::LDH + c) = val;
    }
    for (int t = threadIdx.x; t < BR * S::LDO; t += blockDim.x) Os[t] = 0.f;
    if (threadIdx.x < BR) {
        Ms[threadIdx.x] = -INFINITY;
        Ls[threadIdx.x] = 0.f;
    }
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> qf[D / 16];
    for (int kk = 0; kk < D / 16; kk++) wmma::load_matrix_sync(qf[kk], Qs + (warp * 16) * S::LDH + kk * 16, S::LDH);

    const int r_own = warp * 16 + (lane >> 1); /* the row this lane pair handles in the softmax */
    const int c_half = (lane & 1) * (BC / 2), e_half = (lane & 1) * (D / 2);
    const int64_t qi_own = q0 + r_own;
    const int64_t first_own = qi_own < n ? blk.first_row(qi_own) : 0; /* its sliding window's first key */

    for (int64_t k0 = blk.kbeg; k0 < kend; k0 += BC) {
        __syncthreads(); /* every warp is done with the previous K/V tile */
        load_kv_tile<D, BC>(Ks, Vs, S::LDH, rows, k0, kend);
        __syncthreads();
        /* S = Q K^T for this warp's 16 rows */
        for (int j = 0; j < BC / 16; j++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
            wmma::fill_fragment(sf, 0.f);
            for (int kk = 0; kk < D / 16; kk++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, Ks + (j * 16) * S::LDH + kk * 16, S::LDH);
                wmma::mma_sync(sf, qf[kk], kf, sf);
            }
            wmma::store_matrix_sync(Ss + (warp * 16) * S::LDS + j * 16, sf, S::LDS, wmma::mem_row_major);
        }
        __syncwarp();
        /* online softmax: a lane pair per row, each lane half of the columns */
        {
            int64_t vis = past + qi_own + 1 - k0; /* visible columns of this tile: [lo, vis) */
            if (qi_own >= n) vis = 0;
            const int64_t lo = first_own - k0;
            float *srow = Ss + r_own * S::LDS;
            bf16 *prow = Ps + r_own * S::LDP;
            float mx = -INFINITY;
            for (int c = c_half; c < c_half + BC / 2; c++) {
                const float s = c < vis && c >= lo ? kvc_softcap(srow[c] * scale, cap) : -INFINITY;
                srow[c] = s;
                mx = fmaxf(mx, s);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            const float m_old = Ms[r_own];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int c = c_half; c < c_half + BC / 2; c++) {
                const bf16 p = __float2bfloat16(m_new == -INFINITY ? 0.f : __expf(srow[c] - m_new));
                prow[c] = p;
                sum += __bfloat162float(p); /* the normaliser of the weights P V actually uses */
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            const float corr = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
            float *orow = Os + r_own * S::LDO;
            if (corr != 1.f)
                for (int e = e_half; e < e_half + D / 2; e++) orow[e] *= corr;
            __syncwarp();
            if ((lane & 1) == 0) {
                Ls[r_own] = Ls[r_own] * corr + sum;
                Ms[r_own] = m_new;
            }
        }
        __syncwarp();
        /* O += P V */
        for (int dt = 0; dt < D / 16; dt++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
            wmma::load_matrix_sync(of, Os + (warp * 16) * S::LDO + dt * 16, S::LDO, wmma::mem_row_major);
            for (int kk = 0; kk < BC / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> pf;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> vf;
                wmma::load_matrix_sync(pf, Ps + (warp * 16) * S::LDP + kk * 16, S::LDP);
                wmma::load_matrix_sync(vf, Vs + (kk * 16) * S::LDH + dt * 16, S::LDH);
                wmma::mma_sync(of, pf, vf, of);
            }
            wmma::store_matrix_sync(Os + (warp * 16) * S::LDO + dt * 16, of, S::LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }
    __syncwarp();
    if (qi_own < n) {
        const float inv = 1.f / Ls[r_own];
        const float *orow = Os + r_own * S::LDO;
        bf16 *dst = out + qi_own * ldo + (int64_t)hq * D;
        for (int e = e_half; e < e_half + D / 2; e++) dst[e] = __float2bfloat16(orow[e] * inv);
    }
}

/* Any head_dim <= 256: one warp per (query, query head), a key at a time with an online softmax;
 * lane owns dimensions lane + 32 t. */
template <class Src>
__global__ void attn_generic_kernel(const bf16 *__restrict__ q, int64_t ldq, int64_t n, int32_t H, int32_t g,
                                    int32_t d, const Src src,
                                    const int32_t *__restrict__ past_arr, const int64_t *__restrict__ start,
                                    float scale, float cap, bf16 *__restrict__ out, int64_t ldo) {
    const int lane = threadIdx.x % 32;
    const int64_t wid = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (wid >= n * H) return;
    const int64_t i = wid / H;
    const int hq = (int)(wid % H), h = hq / g;
    const bf16 *qr = q + i * ldq + (int64_t)hq * d;
    float qv[8], o[8];
    for (int t = 0; t < 8; t++) {
        const int e = lane + 32 * t;
        qv[t] = e < d ? __bfloat162float(qr[e]) : 0.f;
        o[t] = 0.f;
    }
    const typename Src::Head rows = src.head(h, d);
    const int64_t vis = (int64_t)past_arr[h] + i + 1;
    const int64_t lo = start ? start[i * (H / g) + h] : 0; /* the sliding window's first row */
    float m = -INFINITY, l = 0.f;
    for (int64_t j = lo; j < vis; j++) {
        float part = 0.f;
        for (int t = 0; t < 8; t++) {
            const int e = lane + 32 * t;
            float kx;
            rows.template key<1>(j, e, &kx);
            part += qv[t] * kx; /* 0 past d */
        }
        for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
        const float s = kvc_softcap(part * scale, cap), mn = fmaxf(m, s);
        const float corr = m == -INFINITY ? 0.f : __expf(m - mn), p = __expf(s - mn);
        l = l * corr + p;
        for (int t = 0; t < 8; t++) {
            const int e = lane + 32 * t;
            float vx;
            rows.template value<1>(j, e, &vx);
            o[t] = o[t] * corr + p * vx; /* 0 past d */
        }
        m = mn;
    }
    for (int t = 0; t < 8; t++) {
        const int e = lane + 32 * t;
        if (e < d) out[i * ldo + (int64_t)hq * d + e] = __float2bfloat16(o[t] / l);
    }
}

template <int D, class Src>
static kvc_status launch_flash(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t grp, const Src &src,
                               const int32_t *past, const int64_t *start, float scale, float cap, bf16 *out, int64_t ldo) {
    static int configured = 0;
    const size_t smem = FlashSmem<D>::bytes;
    if (!configured) {
        CU_TRY(cudaFuncSetAttribute(flash_prefill_kernel<D, Src>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
               "attention: shared memory opt-in");
        configured = 1;
    }
    const int64_t tiles = (n + BR - 1) / BR;
    if (tiles > 2147483647) return fail(KVC_ERR_ARG, "attention: too many queries");
    dim3 grid((unsigned)tiles, (unsigned)H);
    flash_prefill_kernel<D, Src><<<grid, 128, smem, g.stream>>>(q, ldq, n, grp, src, past, start, scale, cap, out, ldo);
    LAUNCH_TRY("attention (flash prefill)");
    return KVC_OK;
}

template <class Src>
kvc_status attention_prefill(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const Src &src,
                             const int32_t *past, const int64_t *start, float scale, float cap, bf16 *out, int64_t ldo) {
    if (n <= 0) return KVC_OK;
    const int32_t grp = H / Hkv;
    const int aligned = ldq % 8 == 0;
    if (aligned && (d == 64 || d == 128) && attention_mma_enabled())
        return attention_prefill_mma(q, ldq, n, H, Hkv, d, src, past, start, scale, cap, out, ldo);
    if (d == 128 && aligned) return launch_flash<128>(q, ldq, n, H, grp, src, past, start, scale, cap, out, ldo);
    if (d == 64 && aligned) return launch_flash<64>(q, ldq, n, H, grp, src, past, start, scale, cap, out, ldo);
    if (d > 256) return fail(KVC_ERR_UNSUPPORTED, "CUDA attention: head_dim %d > 256", d);
    const int64_t warps = n * H;
    attn_generic_kernel<Src><<<(unsigned)((warps + 3) / 4), 128, 0, g.stream>>>(q, ldq, n, H, grp, d, src, past, start,
                                                                               scale, cap, out, ldo);
    LAUNCH_TRY("attention (generic)");
    return KVC_OK;
}

#define INSTANTIATE(S)                                                                                               \
    template kvc_status attention_prefill<S>(const bf16 *, int64_t, int64_t, int32_t, int32_t, int32_t, const S &,          \
                                             const int32_t *, const int64_t *, float, float, bf16 *, int64_t);
KVC_ROW_SOURCES(INSTANTIATE)

} // namespace kvc
