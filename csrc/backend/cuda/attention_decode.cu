/* Decode attention: one query per head over the ragged cache, split-K across the sequence.
 *
 * Block (KV head h, up to 4 of its query heads, split s) reads rows [s*chunk, (s+1)*chunk) of head
 * h once for those query heads (GQA: the group shares every K/V load; the rows come through a row source,
 * kv_rows.cuh: bf16 rows, or a typed store's rows decoded in the loads), chunk = ceil(len[h] / splits)
 * computed on the device from len (with a sliding window the rows [start[h], len[h]) are split
 * instead, start read from the device too; so a CUDA graph captured once serves every step, whatever the
 * lengths: heads of different lengths are just different chunk sizes, no padding). Each of the 4
 * warps takes 4 keys at a time (loads first, then math, to keep memory busy); a lane owns the EPL
 * contiguous dimensions lane * EPL + t, so when d == 32 EPL a key row is one vector load per lane
 * (8 bytes at d = 128: a warp reads 256 contiguous bytes per instruction). Partial results (unnormalised output, max, sum) per (query head, split) are merged by
 * a second kernel. head_dim <= 256. */
#include "kv_rows.cuh"

namespace kvc {

#define DG 4   /* query heads per block */
#define DW 4   /* warps per block */
#define DU 4   /* keys per warp step */

size_t decode_partial_floats(int32_t H, int32_t d, int32_t splits) { return (size_t)H * splits * (d + 2); }

template <int EPL, class Src> /* dims per lane: ceil(d / 32) rounded up to 2, 4 or 8 */
__global__ void __launch_bounds__(DW * 32) decode_split_kernel(const bf16 *__restrict__ q, int32_t H, int32_t g,
                                                                int32_t d, const Src src,
                                                                const int32_t *__restrict__ len_arr,
                                                                const int64_t *__restrict__ start_arr, float scale,
                                                                float cap, float *__restrict__ partial, int32_t splits) {
    __shared__ float sm_m[DW][DG], sm_l[DW][DG];
    __shared__ float sm_o[DW][DG][256];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gchunks = (g + DG - 1) / DG;
    const int h = blockIdx.x / gchunks, gc = blockIdx.x % gchunks;
    const int hq0 = h * g + gc * DG;
    const int ng = g - gc * DG < DG ? g - gc * DG : DG;
    const int s = blockIdx.y;
    const int64_t len = len_arr[h];
    const int64_t lo = start_arr ? start_arr[h] : 0; /* the sliding window's first row */
    const int64_t chunk = (len - lo + splits - 1) / splits;
    const int64_t kb = lo + (int64_t)s * chunk, ke = kb + chunk < len ? kb + chunk : len;
    const typename Src::Head rows = src.head(h, d);

    float qv[DG][EPL], o[DG][EPL], m[DG], l[DG];
    for (int j = 0; j < DG; j++) {
        m[j] = -INFINITY;
        l[j] = 0.f;
        for (int t = 0; t < EPL; t++) {
            const int e = lane * EPL + t;
            qv[j][t] = (j < ng && e < d) ? __bfloat162float(q[(int64_t)(hq0 + j) * d + e]) * scale : 0.f;
            o[j][t] = 0.f;
        }
    }
    for (int64_t k0 = kb + warp * DU; k0 < ke; k0 += DW * DU) {
        float kv[DU][EPL], vv[DU][EPL];
        for (int u = 0; u < DU; u++) {
            const int64_t r = k0 + u;
            if (r < ke) {
                rows.template key<EPL>(r, lane * EPL, kv[u]);
                rows.template value<EPL>(r, lane * EPL, vv[u]);
            } else {
                for (int t = 0; t < EPL; t++) kv[u][t] = vv[u][t] = 0.f;
            }
        }
        for (int u = 0; u < DU; u++) {
            if (k0 + u >= ke) break;
            for (int j = 0; j < DG; j++) {
                if (j >= ng) break;
                float part = 0.f;
                for (int t = 0; t < EPL; t++) part += qv[j][t] * kv[u][t];
                for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
                part = kvc_softcap(part, cap); /* q was scaled: part is the scaled score */
                const float mn = fmaxf(m[j], part);
                const float corr = m[j] == -INFINITY ? 0.f : __expf(m[j] - mn), p = __expf(part - mn);
                l[j] = l[j] * corr + p;
                for (int t = 0; t < EPL; t++) o[j][t] = o[j][t] * corr + p * vv[u][t];
                m[j] = mn;
            }
        }
    }
    /* merge the 4 warps */
    for (int j = 0; j < DG; j++) {
        if (lane == 0) {
            sm_m[warp][j] = m[j];
            sm_l[warp][j] = l[j];
        }
        for (int t = 0; t < EPL; t++) {
            const int e = lane * EPL + t;
            if (e < d) sm_o[warp][j][e] = o[j][t];
        }
    }
    __syncthreads();
    for (int u = threadIdx.x; u < ng * (d + 2); u += blockDim.x) {
        const int j = u / (d + 2), e = u % (d + 2);
        float M = -INFINITY;
        for (int w = 0; w < DW; w++) M = fmaxf(M, sm_m[w][j]);
        float acc = 0.f;
        if (M != -INFINITY) {
            for (int w = 0; w < DW; w++) {
                if (sm_m[w][j] == -INFINITY) continue;
                const float sc = __expf(sm_m[w][j] - M);
                acc += (e < d ? sm_o[w][j][e] : sm_l[w][j]) * sc;
            }
        }
        float *dst = partial + ((int64_t)(hq0 + j) * splits + s) * (d + 2);
        if (e < d) dst[e] = acc;
        else if (e == d) dst[d] = M;
        else dst[d + 1] = acc; /* e == d + 1: the sum */
    }
}

__global__ void decode_merge_kernel(const float *__restrict__ partial, int32_t d, int32_t splits, bf16 *__restrict__ out) {
    const int hq = blockIdx.x;
    const float *p = partial + (int64_t)hq * splits * (d + 2);
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, p[(int64_t)s * (d + 2) + d]);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float acc = 0.f, L = 0.f;
        for (int s = 0; s < splits; s++) {
            const float *ps = p + (int64_t)s * (d + 2);
            if (ps[d] == -INFINITY) continue;
            const float sc = __expf(ps[d] - M);
            acc += ps[e] * sc;
            L += ps[d + 1] * sc;
        }
        out[(int64_t)hq * d + e] = __float2bfloat16(L > 0.f ? acc / L : 0.f);
    }
}

template <class Src>
kvc_status attention_decode(const bf16 *q, int32_t H, int32_t Hkv, int32_t d, const Src &src, const int32_t *len,
                            const int64_t *start, float scale, float cap, bf16 *out, float *partial, int32_t splits) {
    if (d > 256) return fail(KVC_ERR_UNSUPPORTED, "CUDA decode attention: head_dim %d > 256", d);
    const int32_t grp = H / Hkv, gchunks = (grp + DG - 1) / DG;
    dim3 grid((unsigned)(Hkv * gchunks), (unsigned)splits);
    if (d <= 64)
        decode_split_kernel<2, Src><<<grid, DW * 32, 0, g.stream>>>(q, H, grp, d, src, len, start, scale, cap, partial, splits);
    else if (d <= 128)
        decode_split_kernel<4, Src><<<grid, DW * 32, 0, g.stream>>>(q, H, grp, d, src, len, start, scale, cap, partial, splits);
    else
        decode_split_kernel<8, Src><<<grid, DW * 32, 0, g.stream>>>(q, H, grp, d, src, len, start, scale, cap, partial, splits);
    LAUNCH_TRY("attention (decode split)");
    decode_merge_kernel<<<(unsigned)H, d < 128 ? d : 128, 0, g.stream>>>(partial, d, splits, out);
    LAUNCH_TRY("attention (decode merge)");
    return KVC_OK;
}

#define INSTANTIATE(S)                                                                                               \
    template kvc_status attention_decode<S>(const bf16 *, int32_t, int32_t, int32_t, const S &, const int32_t *,            \
                                            const int64_t *, float, float, bf16 *, float *, int32_t);
KVC_ROW_SOURCES(INSTANTIATE)

} // namespace kvc
