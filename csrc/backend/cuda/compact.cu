/* In-place compaction of a layer of the ragged cache after eviction: the kept rows of every head
 * are gathered into a new arena sized for them (the caller frees the old one, so the memory really
 * drops). One block per kept row, 16-byte copies. */
#include "common.cuh"

namespace kvc {

__global__ void gather_rows_kernel(const GatherInfo gi, int32_t Hkv, int32_t d, const int32_t *__restrict__ rows) {
    const int64_t t = blockIdx.x; /* index into the concatenated kept rows */
    int h = 0;
    while (h + 1 < Hkv && gi.off[h + 1] <= t) h++;
    const int64_t i = t - gi.off[h];
    const int64_t src = rows[t];
    const bf16 *ks = gi.ok[h] + src * d, *vs = gi.ov[h] + src * d;
    bf16 *kd = gi.nk[h] + i * d, *vd = gi.nv[h] + i * d;
    if (d % 8 == 0) {
        for (int e = threadIdx.x * 8; e < d; e += blockDim.x * 8) {
            *(uint4 *)(kd + e) = *(const uint4 *)(ks + e);
            *(uint4 *)(vd + e) = *(const uint4 *)(vs + e);
        }
    } else {
        for (int e = threadIdx.x; e < d; e += blockDim.x) {
            kd[e] = ks[e];
            vd[e] = vs[e];
        }
    }
}

kvc_status gather_rows(const GatherInfo &gi, int32_t Hkv, int32_t d, const int32_t *rows) {
    const int64_t total = gi.off[Hkv];
    if (total <= 0) return KVC_OK;
    if (total > 2147483647) return fail(KVC_ERR_ARG, "compaction: too many rows");
    gather_rows_kernel<<<(unsigned)total, 32, 0, g.stream>>>(gi, Hkv, d, rows);
    LAUNCH_TRY("cache compaction");
    return KVC_OK;
}

} // namespace kvc
