/* Causal GQA prefill attention with the score, probability and output tiles in registers
 * (FlashAttention-2 schedule, written from the algorithm with the PTX mma.sync m16n8k16 bf16
 * instruction): a block owns 64 queries of one query head, each of its 4 warps 16 of them; keys and
 * values go through shared memory in tiles of 64. Per tile a warp computes S = Q K^T (8 fragments of
 * 16 x 8), the online softmax on those registers (a row's 8 values per thread, the row max and sum
 * reduced over the 4 threads that share the row), then O += P V with P re-packed from the S
 * accumulators as the A operand (the C layout of two 16 x 8 tiles is the A layout of one 16 x 16)
 * and V read with ldmatrix.trans. A sliding window (start[i, h]) masks the keys below each row's start;
 * a tile no row of the warp sees is skipped. Unlike the WMMA kernel (attention_prefill.cu) nothing but K and V
 * goes through shared memory.
 *
 * Opt-in until measured against the WMMA kernel and the CPU on a GPU: KVC_ATTN_MMA=1 in the
 * environment, or the setting attention_kernel 1. A preference: head_dim 64 and 128 only, so
 * attention_prefill (the one entry) runs the other kernels for the other head dims. */
#include <stdlib.h>
#include <string.h>

#include "attention_tiles.cuh"

namespace kvc {

#define MBR 64 /* queries per block */
#define MBC 64 /* keys per tile */

static int g_use_mma = -1; /* -1: read KVC_ATTN_MMA on first use */

void attention_use_mma(int on) { g_use_mma = on ? 1 : 0; }

int attention_mma_enabled(void) {
    if (g_use_mma < 0) {
        const char *e = getenv("KVC_ATTN_MMA");
        g_use_mma = e && strcmp(e, "1") == 0;
    }
    return g_use_mma;
}

__device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x = lo (lower address / lower k) */
    return *(uint32_t *)&v;
}

template <int D, class Src>
__global__ void __launch_bounds__(128) flash_mma_kernel(const bf16 *__restrict__ q, int64_t ldq, int64_t n, int32_t grp,
                                                        const Src src,
                                                        const int32_t *__restrict__ past_arr,
                                                        const int64_t *__restrict__ start, float scale, float cap,
                                                        bf16 *__restrict__ out, int64_t ldo) {
    constexpr int LD = D + 8; /* row stride in shared memory (halves): 16-byte aligned rows, no conflicts */
    __shared__ __align__(16) bf16 Ks[MBC * LD];
    __shared__ __align__(16) bf16 Vs[MBC * LD];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gq = lane >> 2, tq = lane & 3; /* mma fragment coordinates: row group, thread in group */
    const PrefillBlock blk = prefill_block<MBR, MBC>(n, grp, past_arr, start);
    const typename Src::Head rows = src.head(blk.h, D);
    const int hq = blk.hq;
    const int64_t q0 = blk.q0, past = blk.past, kend = blk.kend;
    const float L2E = 1.4426950408889634f, sl2 = scale * L2E; /* scores in log2 units: exp2 */

    /* this thread's two rows, and what the warp's last row sees (mma and shuffles need the whole warp:
     * a tile is skipped only when no row of the warp sees any of it) */
    const int64_t r0 = q0 + warp * 16 + gq, r1 = r0 + 8;
    const int64_t vis0 = r0 < n ? past + r0 + 1 : 0, vis1 = r1 < n ? past + r1 + 1 : 0;
    const int64_t wlast = q0 + warp * 16 + 15 < n - 1 ? q0 + warp * 16 + 15 : n - 1;
    const int64_t vis_w = q0 + warp * 16 < n ? past + wlast + 1 : 0;
    /* with a sliding window, the first key each row sees ([lo, vis) is visible), and the warp's lowest */
    const int64_t lo0 = r0 < n ? blk.first_row(r0) : 0, lo1 = r1 < n ? blk.first_row(r1) : 0;
    const int64_t lo_w = q0 + warp * 16 < n ? blk.first_row(q0 + warp * 16) : 0;

    /* Q fragments straight from global memory (A operand, row major) */
    uint32_t qf[D / 16][4];
    for (int kk = 0; kk < D / 16; kk++) {
        const int c = kk * 16 + 2 * tq;
        const bf16 *p0 = q + r0 * ldq + (int64_t)hq * D + c, *p1 = q + r1 * ldq + (int64_t)hq * D + c;
        qf[kk][0] = r0 < n ? *(const uint32_t *)p0 : 0u;
        qf[kk][1] = r1 < n ? *(const uint32_t *)p1 : 0u;
        qf[kk][2] = r0 < n ? *(const uint32_t *)(p0 + 8) : 0u;
        qf[kk][3] = r1 < n ? *(const uint32_t *)(p1 + 8) : 0u;
    }
    float o[D / 8][4];
    for (int dt = 0; dt < D / 8; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int64_t k0 = blk.kbeg; k0 < kend; k0 += MBC) {
        __syncthreads(); /* every warp is done with the previous tile */
        load_kv_tile<D, MBC>(Ks, Vs, LD, rows, k0, kend);
        __syncthreads();
        if (k0 >= vis_w || k0 + MBC <= lo_w) continue; /* warp-uniform */
        /* S = Q K^T: 8 fragments of 8 keys */
        float s[MBC / 8][4];
        for (int nt = 0; nt < MBC / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            const bf16 *kr = Ks + (nt * 8 + gq) * LD + 2 * tq;
            for (int kk = 0; kk < D / 16; kk++) {
                const uint32_t b0 = *(const uint32_t *)(kr + kk * 16), b1 = *(const uint32_t *)(kr + kk * 16 + 8);
                mma_bf16(s[nt], qf[kk], b0, b1);
            }
        }
        /* mask, scale, row max (each row is spread over the 4 threads of a group) */
        float mx0 = -INFINITY, mx1 = -INFINITY;
        for (int nt = 0; nt < MBC / 8; nt++)
            for (int e = 0; e < 2; e++) {
                const int64_t key = k0 + nt * 8 + 2 * tq + e;
                const float a = cap > 0 ? kvc_softcap(s[nt][e] * scale, cap) * L2E : s[nt][e] * sl2;
                const float b = cap > 0 ? kvc_softcap(s[nt][2 + e] * scale, cap) * L2E : s[nt][2 + e] * sl2;
                s[nt][e] = key < vis0 && key >= lo0 ? a : -INFINITY;
                s[nt][2 + e] = key < vis1 && key >= lo1 ? b : -INFINITY;
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
        for (int off = 1; off < 4; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float c0 = m0 == -INFINITY ? 0.f : exp2f(m0 - mn0), c1 = m1 == -INFINITY ? 0.f : exp2f(m1 - mn1);
        float sum0 = 0.f, sum1 = 0.f;
        for (int nt = 0; nt < MBC / 8; nt++)
            for (int e = 0; e < 2; e++) {
                s[nt][e] = mn0 == -INFINITY ? 0.f : exp2f(s[nt][e] - mn0);
                s[nt][2 + e] = mn1 == -INFINITY ? 0.f : exp2f(s[nt][2 + e] - mn1);
                sum0 += s[nt][e];
                sum1 += s[nt][2 + e];
            }
        for (int off = 1; off < 4; off <<= 1) {
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, off);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, off);
        }
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
        m0 = mn0;
        m1 = mn1;
        for (int dt = 0; dt < D / 8; dt++) {
            o[dt][0] *= c0;
            o[dt][1] *= c0;
            o[dt][2] *= c1;
            o[dt][3] *= c1;
        }
        /* O += P V, 16 keys at a time: P from two S fragments, V with ldmatrix.trans */
        for (int kt = 0; kt < MBC / 16; kt++) {
            uint32_t a[4];
            a[0] = pack_bf16(s[2 * kt][0], s[2 * kt][1]);
            a[1] = pack_bf16(s[2 * kt][2], s[2 * kt][3]);
            a[2] = pack_bf16(s[2 * kt + 1][0], s[2 * kt + 1][1]);
            a[3] = pack_bf16(s[2 * kt + 1][2], s[2 * kt + 1][3]);
            /* lanes 0-7 address keys kt*16 + 0..7 (matrix 0), lanes 8-15 keys + 8..15 (matrix 1) */
            const bf16 *vrow = Vs + (kt * 16 + (lane & 15)) * LD;
            for (int dt = 0; dt < D / 8; dt++) {
                uint32_t b0, b1;
                const uint32_t addr = (uint32_t)__cvta_generic_to_shared(vrow + dt * 8);
                asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                             : "=r"(b0), "=r"(b1)
                             : "r"(addr));
                mma_bf16(o[dt], a, b0, b1);
            }
        }
    }
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    for (int dt = 0; dt < D / 8; dt++) {
        const int c = dt * 8 + 2 * tq;
        if (r0 < n)
            *(__nv_bfloat162 *)(out + r0 * ldo + (int64_t)hq * D + c) = __floats2bfloat162_rn(o[dt][0] * inv0, o[dt][1] * inv0);
        if (r1 < n)
            *(__nv_bfloat162 *)(out + r1 * ldo + (int64_t)hq * D + c) = __floats2bfloat162_rn(o[dt][2] * inv1, o[dt][3] * inv1);
    }
}

template <int D, class Src>
static kvc_status launch(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t grp, const Src &src, const int32_t *past,
                         const int64_t *start, float scale, float cap, bf16 *out, int64_t ldo) {
    const int64_t tiles = (n + MBR - 1) / MBR;
    if (tiles > 2147483647) return fail(KVC_ERR_ARG, "attention: too many queries");
    dim3 grid((unsigned)tiles, (unsigned)H);
    flash_mma_kernel<D, Src><<<grid, 128, 0, g.stream>>>(q, ldq, n, grp, src, past, start, scale, cap, out, ldo);
    LAUNCH_TRY("attention (mma prefill)");
    return KVC_OK;
}

template <class Src>
kvc_status attention_prefill_mma(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const Src &src,
                                 const int32_t *past, const int64_t *start, float scale, float cap, bf16 *out, int64_t ldo) {
    if (n <= 0) return KVC_OK;
    if (d == 128) return launch<128>(q, ldq, n, H, H / Hkv, src, past, start, scale, cap, out, ldo);
    if (d == 64) return launch<64>(q, ldq, n, H, H / Hkv, src, past, start, scale, cap, out, ldo);
    return fail(KVC_ERR_UNSUPPORTED, "mma attention: head_dim %d (64 or 128 only)", d);
}

#define INSTANTIATE(S)                                                                                               \
    template kvc_status attention_prefill_mma<S>(const bf16 *, int64_t, int64_t, int32_t, int32_t, int32_t, const S &,      \
                                                 const int32_t *, const int64_t *, float, float, bf16 *, int64_t);
KVC_ROW_SOURCES(INSTANTIATE)

} // namespace kvc
