/* Top-k rows of a score vector on the device: higher score first, then lower row (the CPU rule,
 * press/select.c kvc_topk_rows), result sorted by row.
 *   1. keys = scores with NaN -> -inf and -0 -> +0 (so equal scores compare equal), values = rows;
 *   2. a stable descending radix sort of (key, row) pairs (CUB): equal keys keep increasing rows;
 *   3. flag the first k rows, then select the flagged rows in row order (CUB DeviceSelect).
 * O(n) work per pass; at n = 128k it is a few tens of microseconds. */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include "common.cuh"

namespace kvc {

__global__ void topk_prepare_kernel(const float *__restrict__ s, int64_t n, float *__restrict__ keys,
                                    int32_t *__restrict__ rows, uint8_t *__restrict__ flags) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = s[i];
        if (isnan(v)) v = -INFINITY;
        if ((__float_as_uint(v) << 1) == 0u) v = 0.f; /* -0 -> +0 (a bit test: no flag may fold it away) */
        keys[i] = v;
        rows[i] = (int32_t)i;
        flags[i] = 0;
    }
}

__global__ void topk_flag_kernel(const int32_t *__restrict__ sorted_rows, int64_t k, uint8_t *__restrict__ flags) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < k; i += (int64_t)gridDim.x * blockDim.x)
        flags[sorted_rows[i]] = 1;
}

static inline unsigned nblocks(int64_t n) {
    int64_t b = (n + 255) / 256;
    return (unsigned)(b < 1 ? 1 : (b > 8192 ? 8192 : b));
}

kvc_status topk_rows(const float *scores, int64_t n, int64_t k, int32_t *keep, Buf &tmp) {
    if (n <= 0) return KVC_OK;
    if (n > 2147483647) return fail(KVC_ERR_ARG, "top-k: %lld rows is too many", (long long)n);
    if (k > n) k = n;
    const int ni = (int)n;
    size_t sort_bytes = 0, sel_bytes = 0;
    CU_TRY(cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_bytes, (const float *)nullptr, (float *)nullptr,
                                                     (const int32_t *)nullptr, (int32_t *)nullptr, ni, 0, 32, g.stream),
           "top-k (sort size)");
    CU_TRY(cub::DeviceSelect::Flagged(nullptr, sel_bytes, (const int32_t *)nullptr, (const uint8_t *)nullptr,
                                      (int32_t *)nullptr, (int32_t *)nullptr, ni, g.stream),
           "top-k (select size)");
    const size_t al = 256;
    const size_t nk = (sizeof(float) * n + al) & ~(al - 1), nr = (sizeof(int32_t) * n + al) & ~(al - 1);
    const size_t nf = (n + al) & ~(al - 1);
    const size_t cub_bytes = ((sort_bytes > sel_bytes ? sort_bytes : sel_bytes) + al) & ~(al - 1);
    KVC_TRY(tmp.need(2 * nk + 2 * nr + nf + al + cub_bytes, "top-k scratch"));
    char *p = tmp.as<char>();
    float *keys = (float *)p, *keys_out = (float *)(p + nk);
    int32_t *rows = (int32_t *)(p + 2 * nk), *rows_out = (int32_t *)(p + 2 * nk + nr);
    uint8_t *flags = (uint8_t *)(p + 2 * nk + 2 * nr);
    int32_t *count = (int32_t *)(p + 2 * nk + 2 * nr + nf);
    void *cub_tmp = p + 2 * nk + 2 * nr + nf + al;
    topk_prepare_kernel<<<nblocks(n), 256, 0, g.stream>>>(scores, n, keys, rows, flags);
    LAUNCH_TRY("top-k (prepare)");
    size_t b = sort_bytes;
    CU_TRY(cub::DeviceRadixSort::SortPairsDescending(cub_tmp, b, keys, keys_out, rows, rows_out, ni, 0, 32, g.stream),
           "top-k (sort)");
    if (k > 0) {
        topk_flag_kernel<<<nblocks(k), 256, 0, g.stream>>>(rows_out, k, flags);
        LAUNCH_TRY("top-k (flag)");
    }
    b = sel_bytes;
    /* rows[] still holds 0..n-1 (the sort wrote to rows_out) */
    CU_TRY(cub::DeviceSelect::Flagged(cub_tmp, b, rows, flags, keep, count, ni, g.stream), "top-k (select)");
    return KVC_OK;
}

} // namespace kvc
