/* Scorers: what matters in a layer's cache (METHODS.md, "Baseline scorers"). Each fills
 * scores[h][row] for every row of every KV head; higher means keep. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "../backend/backend.h"
#include "press.h"

/* ---------------------------------------------------------------------------------------------- */
/* window attention                                                                                */

void kvc_probs_rows(const float *q_rows, int64_t m, const float *k, int64_t len, int32_t d, float scale,
                    const int64_t *visible, float *probs) {
    kvc_cpu_matmul(q_rows, k, probs, m, len, d);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        float *row = probs + i * len;
        const int64_t vis = visible[i] < len ? visible[i] : len;
        float mx = -FLT_MAX;
        for (int64_t r = 0; r < vis; r++) {
            row[r] *= scale;
            mx = row[r] > mx ? row[r] : mx;
        }
        double z = 0;
        for (int64_t r = 0; r < vis; r++) {
            row[r] = expf(row[r] - mx);
            z += row[r];
        }
        const float inv = (float)(1.0 / z);
        for (int64_t r = 0; r < vis; r++) row[r] *= inv;
        for (int64_t r = vis; r < len; r++) row[r] = 0.f;
    }
}

void kvc_gather_queries(const kvc_layer_ctx *ctx, int32_t H, int32_t d, int32_t hq, int64_t first, int64_t m, float *dst) {
    for (int64_t i = 0; i < m; i++) memcpy(dst + i * d, ctx->q + ((first + i) * H + hq) * d, sizeof(float) * d);
}

void kvc_window_attention(const kvc_score_input *in, int32_t w, float *const *out) {
    const kvc_config *c = in->cfg;
    const kvc_layer_ctx *ctx = in->ctx;
    const int32_t H = c->n_heads, g = c->n_heads / c->n_kv_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t n = ctx->n;
    int64_t maxlen = 0;
    for (int32_t h = 0; h < c->n_kv_heads; h++) maxlen = in->cache->len[h] > maxlen ? in->cache->len[h] : maxlen;
    float *qw = malloc(sizeof(float) * (size_t)w * d);
    float *probs = malloc(sizeof(float) * (size_t)w * (size_t)(maxlen > 0 ? maxlen : 1));
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)w);
    for (int32_t hq = 0; hq < H; hq++) {
        const int32_t h = hq / g;
        const int64_t len = in->cache->len[h], n_acc = len - w;
        float *acc = out[hq];
        if (n_acc > 0) memset(acc, 0, sizeof(float) * (size_t)n_acc);
        if (!qw || !probs || !vis) continue; /* out of memory: scores stay 0 */
        kvc_gather_queries(ctx, H, d, hq, n - w, w, qw);
        for (int32_t j = 0; j < w; j++) vis[j] = ctx->past_len[h] + (n - w + j) + 1;
        kvc_probs_rows(qw, w, in->cache->k[h], len, d, scale, vis, probs);
        /* mean over the window queries */
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n_acc; r++) {
            double s = 0;
            for (int32_t j = 0; j < w; j++) s += probs[(size_t)j * len + r];
            acc[r] = (float)(s / w);
        }
    }
    free(qw);
    free(probs);
    free(vis);
}

/* ---------------------------------------------------------------------------------------------- */
/* pooling and GQA reduction                                                                       */

/* 1-D pooling, stride 1, padding k/2: average counts the padding (torch avg_pool1d default); max
 * ignores it (torch max_pool1d pads with -inf). */
static void pool1d(const float *x, float *y, int64_t n, int32_t k, int pool_max) {
    const int32_t half = k / 2;
    for (int64_t i = 0; i < n; i++) {
        const int64_t lo = i - half < 0 ? 0 : i - half, hi = i + half >= n ? n - 1 : i + half;
        if (pool_max) {
            float m = -FLT_MAX;
            for (int64_t j = lo; j <= hi; j++) m = x[j] > m ? x[j] : m;
            y[i] = m;
        } else {
            double s = 0;
            for (int64_t j = lo; j <= hi; j++) s += x[j];
            y[i] = (float)(s / k);
        }
    }
}

/* SnapKV-family: window attention -> pooling -> GQA reduction, window rows protected. */
static kvc_status score_snapkv(const kvc_score_input *in, int32_t w, float *const *scores) {
    const kvc_config *c = in->cfg;
    const kvc_press_config *p = in->press;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv;
    float **att = calloc((size_t)H, sizeof *att);
    if (!att) return kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores");
    kvc_status st = KVC_OK;
    int64_t maxlen = 0;
    for (int32_t h = 0; h < Hkv; h++) maxlen = in->cache->len[h] > maxlen ? in->cache->len[h] : maxlen;
    for (int32_t hq = 0; hq < H && st == KVC_OK; hq++) {
        att[hq] = malloc(sizeof(float) * (size_t)(maxlen > 0 ? maxlen : 1));
        if (!att[hq]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores");
    }
    float *tmp = st == KVC_OK ? malloc(sizeof(float) * (size_t)(maxlen > 0 ? maxlen : 1)) : NULL;
    if (st == KVC_OK && !tmp) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores");
    if (st == KVC_OK) {
        kvc_window_attention(in, w, att);
        float global_max = -FLT_MAX;
        for (int32_t h = 0; h < Hkv; h++) {
            const int64_t n_past = in->cache->len[h] - w;
            float *s = scores[h];
            if (p->pool_then_reduce) {
                for (int32_t j = 0; j < g; j++) {
                    pool1d(att[h * g + j], tmp, n_past, p->kernel, p->pool_max);
                    for (int64_t r = 0; r < n_past; r++) {
                        if (j == 0) s[r] = tmp[r];
                        else s[r] = p->gqa_max ? (tmp[r] > s[r] ? tmp[r] : s[r]) : s[r] + tmp[r];
                    }
                }
                if (!p->gqa_max)
                    for (int64_t r = 0; r < n_past; r++) s[r] /= (float)g;
            } else {
                for (int64_t r = 0; r < n_past; r++) {
                    float v = att[h * g][r];
                    for (int32_t j = 1; j < g; j++) {
                        const float x = att[h * g + j][r];
                        v = p->gqa_max ? (x > v ? x : v) : v + x;
                    }
                    tmp[r] = p->gqa_max ? v : v / (float)g;
                }
                pool1d(tmp, s, n_past, p->kernel, p->pool_max);
            }
            for (int64_t r = 0; r < n_past; r++) global_max = s[r] > global_max ? s[r] : global_max;
        }
        if (global_max == -FLT_MAX) global_max = 0.f;
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = in->cache->len[h] - w; r < in->cache->len[h]; r++) scores[h][r] = global_max + 1.f;
    }
    free(tmp);
    for (int32_t hq = 0; hq < H; hq++) free(att[hq]);
    free(att);
    return st;
}

/* TOVA: the last query's attention (over every row but its own), mean over all heads of the layer;
 * the same scores for every KV head; the last row protected. */
static kvc_status score_tova(const kvc_score_input *in, float *const *scores) {
    const kvc_config *c = in->cfg;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads;
    const int64_t len = in->cache->len[0];
    for (int32_t h = 1; h < Hkv; h++)
        if (in->cache->len[h] != len) return kvc_fail(KVC_ERR_ARG, "TOVA needs every head of a layer to hold the same tokens");
    float **att = calloc((size_t)H, sizeof *att);
    if (!att) return kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores");
    kvc_status st = KVC_OK;
    for (int32_t hq = 0; hq < H && st == KVC_OK; hq++)
        if (!(att[hq] = malloc(sizeof(float) * (size_t)len))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press scores");
    if (st == KVC_OK) {
        kvc_window_attention(in, 1, att);
        float mx = -FLT_MAX;
        for (int64_t r = 0; r < len - 1; r++) {
            double sum = 0;
            for (int32_t hq = 0; hq < H; hq++) sum += att[hq][r];
            const float v = (float)(sum / H);
            for (int32_t h = 0; h < Hkv; h++) scores[h][r] = v;
            mx = v > mx ? v : mx;
        }
        if (mx == -FLT_MAX) mx = 0.f;
        for (int32_t h = 0; h < Hkv; h++) scores[h][len - 1] = mx + 1.f;
    }
    for (int32_t hq = 0; hq < H; hq++) free(att[hq]);
    free(att);
    return st;
}

/* ObservedAttention / H2O one-shot: each row's attention summed over this call's queries, divided by
 * how many of them can see it; mean over the group. Queries go in tiles of OBS_TILE (one GEMM each),
 * so memory is O(tile x len), never n x n. */
#define OBS_TILE 128
static kvc_status score_observed(const kvc_score_input *in, float *const *scores) {
    const kvc_config *c = in->cfg;
    const kvc_layer_ctx *ctx = in->ctx;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t n = ctx->n;
    int64_t maxlen = 0;
    for (int32_t h = 0; h < Hkv; h++) maxlen = in->cache->len[h] > maxlen ? in->cache->len[h] : maxlen;
    float *qt = malloc(sizeof(float) * OBS_TILE * d);
    float *probs = malloc(sizeof(float) * OBS_TILE * (size_t)(maxlen > 0 ? maxlen : 1));
    double *acc = malloc(sizeof(double) * (size_t)(maxlen > 0 ? maxlen : 1));
    int64_t vis[OBS_TILE];
    kvc_status st = (!qt || !probs || !acc) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: observed-attention scores") : KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t len = in->cache->len[h], past = ctx->past_len[h];
        memset(acc, 0, sizeof(double) * (size_t)len);
        for (int32_t j = 0; j < g; j++) {
            const int32_t hq = h * g + j;
            for (int64_t i0 = 0; i0 < n; i0 += OBS_TILE) {
                const int64_t m = n - i0 < OBS_TILE ? n - i0 : OBS_TILE;
                kvc_gather_queries(ctx, H, d, hq, i0, m, qt);
                for (int64_t i = 0; i < m; i++) vis[i] = past + i0 + i + 1;
                kvc_probs_rows(qt, m, in->cache->k[h], len, d, scale, vis, probs);
#pragma omp parallel for schedule(static)
                for (int64_t r = 0; r < len; r++) {
                    double s = 0;
                    for (int64_t i = 0; i < m; i++) s += probs[(size_t)i * len + r];
                    acc[r] += s;
                }
            }
        }
        for (int64_t r = 0; r < len; r++) {
            const int64_t seen = r < past ? n : n - (r - past);
            scores[h][r] = (float)(acc[r] / (seen > 0 ? seen : 1) / g);
        }
    }
    free(qt);
    free(probs);
    free(acc);
    return st;
}

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

kvc_status kvc_press_score(const kvc_score_input *in, float *const *scores) {
    const kvc_press_config *p = in->press;
    const kvc_layer_cache *L = in->cache;
    const int32_t Hkv = in->cfg->n_kv_heads, d = in->cfg->head_dim;
    switch (p->scorer) {
    case KVC_SCORE_SNAPKV:
        return score_snapkv(in, p->window, scores);
    case KVC_SCORE_EDIE:
        return kvc_score_edie(in, scores);
    case KVC_SCORE_TOVA:
        return score_tova(in, scores);
    case KVC_SCORE_OBSERVED:
        return score_observed(in, scores);
    case KVC_SCORE_KNORM:
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < L->len[h]; r++) {
                const float *k = L->k[h] + r * d;
                double s = 0;
                for (int32_t j = 0; j < d; j++) s += (double)k[j] * k[j];
                scores[h][r] = -(float)sqrt(s);
            }
        return KVC_OK;
    case KVC_SCORE_STREAMING:
        /* sinks first, then recency: top-k keeps the sinks and the most recent rows */
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < L->len[h]; r++)
                scores[h][r] = r < p->n_sink ? (float)(L->len[h] + 1) : (float)r;
        return KVC_OK;
    case KVC_SCORE_RANDOM:
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t r = 0; r < L->len[h]; r++) {
                uint64_t x = splitmix64(p->seed ^ splitmix64(((uint64_t)in->ctx->layer << 40) ^ ((uint64_t)h << 32) ^ (uint64_t)r));
                scores[h][r] = (float)((x >> 40) * (1.0 / 16777216.0));
            }
        return KVC_OK;
    default:
        return kvc_fail(KVC_ERR_ARG, "unknown scorer %d", p->scorer);
    }
}
