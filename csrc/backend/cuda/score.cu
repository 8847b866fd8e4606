/* Press scorers on the device (docs/METHODS.md, "Baseline scorers"; the CPU scorers in press/score.c are
 * the reference).
 *
 * Window attention (SnapKV, TOVA, TAKE's probes): att[hq][r] = mean over the m scoring queries of
 * their softmax attention on row r, in two passes over the keys, without ever holding [m, len]:
 *   pass 1: per (query head, chunk of 1024 rows) the running max and sum of exp for every query,
 *           merged over the chunks (a small kernel) into the softmax statistics (M_j, L_j);
 *   pass 2: the same dot products again, p = exp(s - M_j) / L_j, summed over the queries.
 * A thread owns rows of the chunk and computes their dot products with 16 queries at a time (queries
 * in shared memory, read as broadcasts). Then pooling (avg counting padding, or max) and the GQA
 * reduction (mean or max, before or after pooling), and the protected tail (window) at max + 1.
 *
 * EDIE (docs/METHODS.md "EDIE scoring") rides on the same two passes: pass 1 also keeps each window query's
 * largest score over the mid-range rows, so c_j = exp(max - M_j) / L_j comes out of the merge; pass 2
 * sums c_j * a / (1 + alpha - a) * (|v_r|_1 + |o_j|_1) over the queries instead of the mean of a. */
#include "common.cuh"
#include "../../core/rng.h"

namespace kvc {

#define CK 1024 /* rows per block */
#define WT 128  /* threads per block */
#define JG 16   /* queries per group */
#define RPT (CK / WT)
#define NS 3    /* floats per (query head, query) statistic: max, sum of exp, EDIE's c_j (or mid-range max) */

size_t window_stats_floats(int32_t H, int64_t m, int64_t maxlen) {
    const int64_t nchunks = (maxlen + CK - 1) / CK;
    return (size_t)H * m * NS * (nchunks + 1);
}

/* EDIE's mid-range rows of a head holding len rows, w of them the window: (w, len - 2w] inside the
 * scored rows [0, len - w), or every scored row when that is empty */
__device__ __forceinline__ void edie_mid_range(int64_t len, int64_t w, int64_t *lo, int64_t *hi) {
    const int64_t n_past = len - w;
    *lo = w + 1;
    *hi = len - 2 * w < n_past - 1 ? len - 2 * w : n_past - 1;
    if (*lo > *hi) {
        *lo = 0;
        *hi = n_past - 1;
    }
}

/* EDIE = 0: att gets the mean attention over the m queries. EDIE = 1: o (attention outputs of the m
 * queries, bf16 rows of stride ldo) and alpha are used, and att gets the EDIE sum times edie_scale. */
template <int PASS, int EDIE>
__global__ void __launch_bounds__(WT) window_pass_kernel(const void *__restrict__ q, int q_f32, int64_t ldq, int64_t m,
                                                         int32_t g, int32_t d, const HeadInfo hi, float scale,
                                                         float *__restrict__ part, const float *__restrict__ stats,
                                                         float *__restrict__ att, int64_t lda, int64_t nchunks,
                                                         const bf16 *__restrict__ o, int64_t ldo, float alpha,
                                                         float edie_scale) {
    extern __shared__ float qs[]; /* [JG][d] */
    __shared__ float red_m[WT][JG + 1], red_l[WT][JG + 1];
    __shared__ float red_x[EDIE && PASS == 1 ? WT : 1][JG + 1];
    __shared__ float onorm[JG];
    const int hq = blockIdx.y, h = hq / g;
    const int64_t chunk = blockIdx.x;
    const int64_t len = hi.len[h];
    const bf16 *K = hi.k[h];
    int64_t mid_lo = 0, mid_hi = -1;
    if (EDIE) edie_mid_range(len, m, &mid_lo, &mid_hi);
    float acc[RPT], vnorm[RPT];
    for (int t = 0; t < RPT; t++) {
        acc[t] = 0.f;
        vnorm[t] = 0.f;
        const int64_t r = chunk * CK + (int64_t)t * WT + threadIdx.x;
        if (EDIE && PASS == 2 && r < len) {
            const bf16 *vr = hi.v[h] + r * d;
            for (int e = 0; e < d; e++) vnorm[t] += fabsf(__bfloat162float(vr[e]));
        }
    }
    for (int64_t j0 = 0; j0 < m; j0 += JG) {
        const int mg = m - j0 < JG ? (int)(m - j0) : JG;
        __syncthreads();
        for (int u = threadIdx.x; u < JG * d; u += WT) {
            const int j = u / d, e = u % d;
            float v = 0.f;
            if (j < mg) {
                const int64_t off = (j0 + j) * ldq + (int64_t)hq * d + e;
                v = q_f32 ? ((const float *)q)[off] : __bfloat162float(((const bf16 *)q)[off]);
            }
            qs[u] = v * scale;
        }
        if (EDIE && PASS == 2 && threadIdx.x < JG) {
            float on = 0.f;
            if ((int)threadIdx.x < mg) {
                const bf16 *oj = o + (j0 + threadIdx.x) * ldo + (int64_t)hq * d;
                for (int e = 0; e < d; e++) on += fabsf(__bfloat162float(oj[e]));
            }
            onorm[threadIdx.x] = on;
        }
        __syncthreads();
        float M[JG], L[JG], X[JG];
        for (int j = 0; j < JG; j++) {
            X[j] = PASS == 1 ? -INFINITY : 0.f;
            if (PASS == 1) {
                M[j] = -INFINITY;
                L[j] = 0.f;
            } else {
                const int64_t jj = j0 + (j < mg ? j : 0);
                M[j] = stats[((int64_t)hq * m + jj) * NS];
                L[j] = stats[((int64_t)hq * m + jj) * NS + 1];
                X[j] = stats[((int64_t)hq * m + jj) * NS + 2]; /* c_j */
            }
        }
#pragma unroll
        for (int t = 0; t < RPT; t++) {
            const int64_t r = chunk * CK + (int64_t)t * WT + threadIdx.x;
            if (r >= len) continue;
            float s[JG];
            for (int j = 0; j < JG; j++) s[j] = 0.f;
            const bf16 *kr = K + r * d;
            for (int e0 = 0; e0 < d; e0 += 8) {
                float kv[8];
                if (d % 8 == 0) {
                    const uint4 raw = *(const uint4 *)(kr + e0);
                    const bf16 *b = (const bf16 *)&raw;
                    for (int e = 0; e < 8; e++) kv[e] = __bfloat162float(b[e]);
                } else {
                    for (int e = 0; e < 8; e++) kv[e] = e0 + e < d ? __bfloat162float(kr[e0 + e]) : 0.f;
                }
#pragma unroll
                for (int j = 0; j < JG; j++) {
                    const float *qj = qs + j * d + e0;
                    float a = s[j];
                    for (int e = 0; e < 8; e++)
                        if (e0 + e < d) a += qj[e] * kv[e];
                    s[j] = a;
                }
            }
#pragma unroll
            for (int j = 0; j < JG; j++) {
                if (j >= mg) continue;
                const int64_t jj = j0 + j;
                int64_t vis = hi.vstart[h] + jj + 1;
                if (vis > hi.vlimit[h]) vis = hi.vlimit[h];
                if (r >= vis) continue;
                if (PASS == 1) {
                    const float mn = fmaxf(M[j], s[j]);
                    L[j] = L[j] * (M[j] == -INFINITY ? 0.f : __expf(M[j] - mn)) + __expf(s[j] - mn);
                    M[j] = mn;
                    if (EDIE && r >= mid_lo && r <= mid_hi) X[j] = fmaxf(X[j], s[j]);
                } else {
                    const float a = __expf(s[j] - M[j]) / L[j];
                    acc[t] += EDIE ? X[j] * (a / (1.f + alpha - a)) * (vnorm[t] + onorm[j]) : a;
                }
            }
        }
        if (PASS == 1) {
            for (int j = 0; j < JG; j++) {
                red_m[threadIdx.x][j] = M[j];
                red_l[threadIdx.x][j] = L[j];
                if (EDIE) red_x[threadIdx.x][j] = X[j];
            }
            __syncthreads();
            if (threadIdx.x < mg) {
                const int j = threadIdx.x;
                float mm = -INFINITY, xx = -INFINITY;
                for (int t = 0; t < WT; t++) mm = fmaxf(mm, red_m[t][j]);
                float ll = 0.f;
                if (mm != -INFINITY)
                    for (int t = 0; t < WT; t++)
                        if (red_m[t][j] != -INFINITY) ll += red_l[t][j] * __expf(red_m[t][j] - mm);
                if (EDIE)
                    for (int t = 0; t < WT; t++) xx = fmaxf(xx, red_x[t][j]);
                float *dst = part + (((int64_t)hq * nchunks + chunk) * m + j0 + j) * NS;
                dst[0] = mm;
                dst[1] = ll;
                dst[2] = xx;
            }
        }
    }
    if (PASS == 2) {
        const int64_t n_acc = hi.n_acc[h];
        for (int t = 0; t < RPT; t++) {
            const int64_t r = chunk * CK + (int64_t)t * WT + threadIdx.x;
            if (r < n_acc) att[(int64_t)hq * lda + r] = EDIE ? acc[t] * edie_scale : acc[t] / (float)m;
        }
    }
}

/* the chunks' statistics of each query merged: M, L, and c_j = exp(X - M) / L from the largest
 * mid-range score X (0 when no chunk had a mid-range row; unused outside EDIE) */
__global__ void window_merge_kernel(const float *__restrict__ part, int64_t m, int64_t nchunks, float *__restrict__ stats) {
    const int hq = blockIdx.y;
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    float M = -INFINITY, X = -INFINITY;
    for (int64_t c = 0; c < nchunks; c++) {
        const float *p = part + (((int64_t)hq * nchunks + c) * m + j) * NS;
        M = fmaxf(M, p[0]);
        X = fmaxf(X, p[2]);
    }
    float L = 0.f;
    for (int64_t c = 0; c < nchunks; c++) {
        const float *p = part + (((int64_t)hq * nchunks + c) * m + j) * NS;
        if (p[0] != -INFINITY) L += p[1] * __expf(p[0] - M);
    }
    L = L > 0.f ? L : 1.f;
    float *st = stats + ((int64_t)hq * m + j) * NS;
    st[0] = M;
    st[1] = L;
    st[2] = X == -INFINITY ? 0.f : __expf(X - M) / L;
}

template <int EDIE>
static kvc_status window_passes(const void *q, int q_f32, int64_t ldq, int64_t m, int32_t H, int32_t Hkv, int32_t d,
                                const HeadInfo &hi, float scale, float *att, int64_t lda, float *stats, const bf16 *o,
                                int64_t ldo, float alpha, float edie_scale) {
    if (m <= 0) return KVC_OK;
    int64_t maxlen = 1;
    for (int h = 0; h < Hkv; h++) maxlen = hi.len[h] > maxlen ? hi.len[h] : maxlen;
    const int64_t nchunks = (maxlen + CK - 1) / CK;
    float *part = stats + (size_t)H * m * NS; /* after the final statistics */
    const int32_t grp = H / Hkv;
    dim3 grid((unsigned)nchunks, (unsigned)H);
    const size_t smem = sizeof(float) * JG * d;
    window_pass_kernel<1, EDIE><<<grid, WT, smem, g.stream>>>(q, q_f32, ldq, m, grp, d, hi, scale, part, stats, att,
                                                              lda, nchunks, o, ldo, alpha, edie_scale);
    LAUNCH_TRY("window attention (pass 1)");
    dim3 mgrid((unsigned)((m + 127) / 128), (unsigned)H);
    window_merge_kernel<<<mgrid, 128, 0, g.stream>>>(part, m, nchunks, stats);
    LAUNCH_TRY("window attention (merge)");
    window_pass_kernel<2, EDIE><<<grid, WT, smem, g.stream>>>(q, q_f32, ldq, m, grp, d, hi, scale, part, stats, att,
                                                              lda, nchunks, o, ldo, alpha, edie_scale);
    LAUNCH_TRY("window attention (pass 2)");
    return KVC_OK;
}

kvc_status window_attention(const void *q, int q_f32, int64_t ldq, int64_t m, int32_t H, int32_t Hkv, int32_t d,
                            const HeadInfo &hi, float scale, float *att, int64_t lda, float *stats) {
    return window_passes<0>(q, q_f32, ldq, m, H, Hkv, d, hi, scale, att, lda, stats, nullptr, 0, 0.f, 0.f);
}

kvc_status edie_attention(const bf16 *q, int64_t ldq, const bf16 *o, int64_t ldo, int64_t w, int32_t H, int32_t Hkv,
                          int32_t d, const HeadInfo &hi, float scale, float alpha, float *att, int64_t lda, float *stats) {
    /* x the group size: pool_reduce's mean over a group is then EDIE's sum */
    return window_passes<1>(q, 0, ldq, w, H, Hkv, d, hi, scale, att, lda, stats, o, ldo, alpha, (float)(H / Hkv));
}

/* ---- pooling and GQA reduction ---- */

__device__ __forceinline__ float pool_at(const float *x, int64_t n, int64_t r, int half, int kernel, int pool_max) {
    const int64_t lo = r - half < 0 ? 0 : r - half, hi = r + half >= n ? n - 1 : r + half;
    if (pool_max) {
        float mx = -3.402823466e38f;
        for (int64_t t = lo; t <= hi; t++) mx = fmaxf(mx, x[t]);
        return mx;
    }
    float s = 0.f;
    for (int64_t t = lo; t <= hi; t++) s += x[t];
    return s / (float)kernel;
}

__global__ void pool_reduce_kernel(const float *__restrict__ att, int64_t lda, int32_t H, int32_t g, const HeadInfo hi,
                                   int32_t kernel, int32_t pool_max, int32_t gqa_max, int32_t ptr, int32_t all_heads,
                                   float *__restrict__ scores, int64_t lds) {
    const int h = blockIdx.y;
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t n = hi.n_acc[h];
    if (r >= n) return;
    const int half = kernel / 2;
    float v;
    if (all_heads) { /* TOVA: mean over every head of the layer */
        float s = 0.f;
        for (int hq = 0; hq < H; hq++) s += att[(int64_t)hq * lda + r];
        v = s / (float)H;
    } else if (ptr) {
        v = 0.f;
        for (int j = 0; j < g; j++) {
            const float x = pool_at(att + (int64_t)(h * g + j) * lda, n, r, half, kernel, pool_max);
            v = j == 0 ? x : (gqa_max ? fmaxf(v, x) : v + x);
        }
        if (!gqa_max) v /= (float)g;
    } else {
        const int64_t lo = r - half < 0 ? 0 : r - half, hi2 = r + half >= n ? n - 1 : r + half;
        float acc = pool_max ? -3.402823466e38f : 0.f;
        for (int64_t t = lo; t <= hi2; t++) {
            float red = 0.f;
            for (int j = 0; j < g; j++) {
                const float x = att[(int64_t)(h * g + j) * lda + t];
                red = j == 0 ? x : (gqa_max ? fmaxf(red, x) : red + x);
            }
            if (!gqa_max) red /= (float)g;
            acc = pool_max ? fmaxf(acc, red) : acc + red;
        }
        v = pool_max ? acc : acc / (float)kernel;
    }
    scores[(int64_t)h * lds + r] = v;
}

kvc_status pool_reduce(const float *att, int64_t lda, int32_t H, int32_t Hkv, const HeadInfo &hi, int32_t kernel,
                       int32_t pool_max, int32_t gqa_max, int32_t pool_then_reduce, int32_t all_heads, float *scores,
                       int64_t lds) {
    int64_t maxn = 1;
    for (int h = 0; h < Hkv; h++) maxn = hi.n_acc[h] > maxn ? hi.n_acc[h] : maxn;
    dim3 grid((unsigned)((maxn + 255) / 256), (unsigned)Hkv);
    pool_reduce_kernel<<<grid, 256, 0, g.stream>>>(att, lda, H, H / Hkv, hi, kernel, pool_max, gqa_max,
                                                   pool_then_reduce, all_heads, scores, lds);
    LAUNCH_TRY("pooling");
    return KVC_OK;
}

__global__ void protect_tail_kernel(float *scores, int64_t lds, int32_t Hkv, const HeadInfo hi) {
    __shared__ float red[1024 / 32];
    float mx = -3.402823466e38f;
    for (int h = 0; h < Hkv; h++)
        for (int64_t r = threadIdx.x; r < hi.n_acc[h]; r += blockDim.x) mx = fmaxf(mx, scores[(int64_t)h * lds + r]);
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : -3.402823466e38f;
        for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    float gmax = red[0];
    if (gmax == -3.402823466e38f) gmax = 0.f;
    for (int h = 0; h < Hkv; h++)
        for (int64_t r = hi.n_acc[h] + threadIdx.x; r < hi.len[h]; r += blockDim.x) scores[(int64_t)h * lds + r] = gmax + 1.f;
}

kvc_status protect_tail(float *scores, int64_t lds, int32_t Hkv, const HeadInfo &hi) {
    protect_tail_kernel<<<1, 1024, 0, g.stream>>>(scores, lds, Hkv, hi);
    LAUNCH_TRY("protected rows");
    return KVC_OK;
}

/* ---- scorers without attention ---- */

/* kind 0: knorm, 1: streaming, 2: random */
__global__ void simple_score_kernel(int kind, const HeadInfo hi, int32_t d, int32_t n_sink, uint64_t seed, int32_t layer,
                                    float *__restrict__ scores, int64_t lds) {
    const int h = blockIdx.y;
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t len = hi.len[h];
    if (r >= len) return;
    float v;
    if (kind == 0) {
        const bf16 *k = hi.k[h] + r * d;
        float s = 0.f;
        for (int e = 0; e < d; e++) {
            const float x = __bfloat162float(k[e]);
            s += x * x;
        }
        v = -sqrtf(s);
    } else if (kind == 1) {
        v = r < n_sink ? (float)(len + 1) : (float)r;
    } else {
        v = kvc_random_score(seed, layer, h, r);
    }
    scores[(int64_t)h * lds + r] = v;
}

static kvc_status simple_score(int kind, const HeadInfo &hi, int32_t Hkv, int32_t d, int32_t n_sink, uint64_t seed,
                               int32_t layer, float *scores, int64_t lds) {
    int64_t maxlen = 1;
    for (int h = 0; h < Hkv; h++) maxlen = hi.len[h] > maxlen ? hi.len[h] : maxlen;
    dim3 grid((unsigned)((maxlen + 255) / 256), (unsigned)Hkv);
    simple_score_kernel<<<grid, 256, 0, g.stream>>>(kind, hi, d, n_sink, seed, layer, scores, lds);
    LAUNCH_TRY("scores");
    return KVC_OK;
}

kvc_status score_knorm(const HeadInfo &hi, int32_t Hkv, int32_t d, float *scores, int64_t lds) {
    return simple_score(0, hi, Hkv, d, 0, 0, 0, scores, lds);
}
kvc_status score_streaming(const HeadInfo &hi, int32_t Hkv, int32_t n_sink, float *scores, int64_t lds) {
    return simple_score(1, hi, Hkv, 0, n_sink, 0, 0, scores, lds);
}
kvc_status score_random(const HeadInfo &hi, int32_t Hkv, uint64_t seed, int32_t layer, float *scores, int64_t lds) {
    return simple_score(2, hi, Hkv, 0, 0, seed, layer, scores, lds);
}

/* ---- TADA dissimilarity ---- */

__global__ void dissim_kernel(const float *__restrict__ R, const bf16 *__restrict__ O, int64_t ldo, int64_t D,
                              double *out) {
    __shared__ double red[3][8];
    const int64_t row = blockIdx.x;
    double rr = 0, ss = 0, rs = 0;
    for (int64_t e = threadIdx.x; e < D; e += blockDim.x) {
        const double a = R[row * D + e], b = a + (double)__bfloat162float(O[row * ldo + e]);
        rr += a * a;
        ss += b * b;
        rs += a * b;
    }
    for (int off = 16; off > 0; off >>= 1) {
        rr += __shfl_xor_sync(0xffffffffu, rr, off);
        ss += __shfl_xor_sync(0xffffffffu, ss, off);
        rs += __shfl_xor_sync(0xffffffffu, rs, off);
    }
    if (threadIdx.x % 32 == 0) {
        red[0][threadIdx.x / 32] = rr;
        red[1][threadIdx.x / 32] = ss;
        red[2][threadIdx.x / 32] = rs;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0, b = 0, c = 0;
        for (int w = 0; w < (int)blockDim.x / 32; w++) {
            a += red[0][w];
            b += red[1][w];
            c += red[2][w];
        }
        atomicAdd(out, c / (sqrt(a * b) + 1e-30));
    }
}

kvc_status dissim_sum(const float *R, const bf16 *O, int64_t ldo, int64_t rows, int64_t D, double *out) {
    CU_TRY(cudaMemsetAsync(out, 0, sizeof(double), g.stream), "dissimilarity");
    if (rows <= 0) return KVC_OK;
    dissim_kernel<<<(unsigned)rows, 256, 0, g.stream>>>(R, O, ldo, D, out);
    LAUNCH_TRY("dissimilarity");
    return KVC_OK;
}

} // namespace kvc
