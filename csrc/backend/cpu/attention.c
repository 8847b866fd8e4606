/* Causal GQA attention over a ragged KV cache, flash style: for each (query head, query tile) the
 * keys are visited in tiles with an online softmax (running max and sum), so memory is O(tile) per
 * thread and no n x n matrix ever exists. Query i of the call sees the first past_len[h] + i + 1
 * rows of its KV head h = hq / (H / Hkv). */
#include <float.h>
#include <math.h>
#include <string.h>

#include "../backend.h"

#define TQ 16  /* query rows per task */
#define TK 128 /* key rows per tile */

static void attend_tile(const float *q, int64_t n, int32_t H, int32_t d, int32_t hq, int64_t i0, int64_t mq,
                        const float *K, const float *V, int64_t past, float scale, float *out) {
    float S[TQ][TK];
    float O[TQ][256]; /* d <= 256 */
    float mrow[TQ], lrow[TQ];
    for (int64_t i = 0; i < mq; i++) {
        mrow[i] = -FLT_MAX;
        lrow[i] = 0.f;
        memset(O[i], 0, sizeof(float) * d);
    }
    const int64_t kend = past + i0 + mq; /* rows visible to the last query of the tile */
    for (int64_t k0 = 0; k0 < kend; k0 += TK) {
        const int64_t mk = kend - k0 < TK ? kend - k0 : TK;
        for (int64_t i = 0; i < mq; i++) {
            const float *qi = q + ((i0 + i) * H + hq) * d;
            const int64_t vis = past + i0 + i + 1 - k0; /* visible rows of this tile for query i */
            const int64_t lim = vis < mk ? vis : mk;
            float mx = mrow[i];
            for (int64_t j = 0; j < lim; j++) {
                const float *kj = K + (k0 + j) * d;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int32_t e = 0; e < d; e++) s += qi[e] * kj[e];
                S[i][j] = s * scale;
                mx = S[i][j] > mx ? S[i][j] : mx;
            }
            if (lim <= 0) continue;
            const float corr = expf(mrow[i] - mx);
            float sum = 0.f;
            for (int64_t j = 0; j < lim; j++) {
                S[i][j] = expf(S[i][j] - mx);
                sum += S[i][j];
            }
            lrow[i] = lrow[i] * corr + sum;
            mrow[i] = mx;
            float *oi = O[i];
#pragma omp simd
            for (int32_t e = 0; e < d; e++) oi[e] *= corr;
            for (int64_t j = 0; j < lim; j++) {
                const float p = S[i][j];
                const float *vj = V + (k0 + j) * d;
#pragma omp simd
                for (int32_t e = 0; e < d; e++) oi[e] += p * vj[e];
            }
        }
    }
    for (int64_t i = 0; i < mq; i++) {
        float *o = out + ((i0 + i) * H + hq) * d;
        const float inv = lrow[i] > 0 ? 1.f / lrow[i] : 0.f;
        for (int32_t e = 0; e < d; e++) o[e] = O[i][e] * inv;
    }
    (void)n;
}

void kvc_cpu_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d, const float *const *k,
                       const float *const *v, const int64_t *past_len, float scale, float *out) {
    const int32_t g = H / Hkv;
    const int64_t tiles = (n + TQ - 1) / TQ;
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int32_t hq = 0; hq < H; hq++) {
            const int32_t h = hq / g;
            const int64_t i0 = t * TQ, mq = n - i0 < TQ ? n - i0 : TQ;
            attend_tile(q, n, H, d, hq, i0, mq, k[h], v[h], past_len[h], scale, out);
        }
    }
}
