/* Device helpers shared by the two flash-style prefill attention kernels (attention_prefill.cu, WMMA;
 * attention_prefill_mma.cu, mma.sync): the block's place in the grid and the K/V tile load through
 * shared memory. Both kernels give a block BQ queries of one query head (blockIdx.y) and walk its
 * KV head's cache in tiles of keys, read through a row source (kv_rows.cuh): a typed store's rows are decoded
 * into the tile as bf16, what the tensor cores multiply. */
#ifndef KVC_CUDA_ATTENTION_TILES_CUH
#define KVC_CUDA_ATTENTION_TILES_CUH

#include "kv_rows.cuh"

namespace kvc {

/* What a block of a prefill kernel works on. */
struct PrefillBlock {
    int hq;           /* query head */
    int64_t q0;       /* first query of the block */
    int64_t past;     /* cache rows of the KV head before the first query of this call */
    int64_t kend;     /* keys the block's last query sees: the end of the key loop */
    int64_t kbeg;     /* the start of the key loop: the first query's window start, down to a tile */
    int h;            /* the KV head */
    const int64_t *start; /* the KV head's column of the window starts (stride Hkv), or NULL */
    int32_t Hkv;

    /* the first row query i sees (0 without a sliding window) */
    __device__ __forceinline__ int64_t first_row(int64_t i) const { return start ? start[i * Hkv] : 0; }
};

/* The block's query tile (the longest tiles first: blockIdx.x 0 takes the last tile) and query head,
 * with grp query heads per KV head; query i of KV head h sees cache rows < past[h] + i + 1, and from
 * start[i * Hkv + h] on with a sliding window (start NULL: none). Starts are nondecreasing in i, so
 * the block's first query bounds the keys from below; key tiles stay BK-aligned. */
template <int BQ, int BK>
__device__ __forceinline__ PrefillBlock prefill_block(int64_t n, int32_t grp, const int32_t *__restrict__ past_arr,
                                                      const int64_t *__restrict__ start) {
    PrefillBlock b;
    const int64_t qt = gridDim.x - 1 - blockIdx.x;
    b.hq = blockIdx.y;
    const int h = b.hq / grp;
    b.Hkv = (int32_t)(gridDim.y / grp);
    b.q0 = qt * BQ;
    b.past = past_arr[h];
    const int64_t rows_here = n - b.q0 < BQ ? n - b.q0 : BQ;
    b.kend = b.past + b.q0 + rows_here;
    b.h = h;
    b.start = start ? start + h : nullptr;
    b.kbeg = b.first_row(b.q0) / BK * BK;
    return b;
}

/* Keys and values k0 .. k0 + BK - 1 (head_dim D) of a head's rows into Ks / Vs (row stride ld halves, rows
 * 16-byte aligned) by the whole block, 8 channels (16 bytes) a thread at a time; rows at or past kend are zero.
 * The caller puts the barriers around it. */
template <int D, int BK, class Head>
__device__ __forceinline__ void load_kv_tile(bf16 *Ks, bf16 *Vs, int ld, const Head &rows, int64_t k0, int64_t kend) {
    constexpr int VEC = D / 8; /* 16-byte vectors per row */
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int t = threadIdx.x; t < BK * VEC; t += blockDim.x) {
        const int r = t / VEC, c = (t % VEC) * 8;
        uint4 kv = zero, vv = zero;
        if (k0 + r < kend) {
            kv = rows.key8(k0 + r, c);
            vv = rows.value8(k0 + r, c);
        }
        *(uint4 *)(Ks + r * ld + c) = kv;
        *(uint4 *)(Vs + r * ld + c) = vv;
    }
}

} // namespace kvc

#endif
