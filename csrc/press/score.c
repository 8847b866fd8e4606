/* Scorers: what matters in a layer's cache (METHODS.md, "Baseline scorers"). Each fills
 * scores[h][row] for every row of every KV head; higher means keep. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "press.h"

/* ---------------------------------------------------------------------------------------------- */
/* window attention                                                                                */

void kvc_attention_probs(const float *q, const float *k, int64_t visible, int32_t d, float scale, float *out) {
    float mx = -FLT_MAX;
    for (int64_t r = 0; r < visible; r++) {
        const float *kr = k + r * d;
        float dot = 0.f;
        for (int32_t j = 0; j < d; j++) dot += q[j] * kr[j];
        out[r] = dot * scale;
        if (out[r] > mx) mx = out[r];
    }
    double sum = 0.0;
    for (int64_t r = 0; r < visible; r++) {
        out[r] = expf(out[r] - mx);
        sum += out[r];
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t r = 0; r < visible; r++) out[r] *= inv;
}

/* Softmax attention of one query over rows [0, visible) of a head; adds weight * p[r] into acc[r]
 * for r < n_acc. `logits` is scratch of `visible` floats. */
static void accumulate_probs(const float *q, const float *k, int64_t visible, int32_t d, float scale,
                             float *logits, float *acc, int64_t n_acc, float weight) {
    kvc_attention_probs(q, k, visible, d, scale, logits);
    const int64_t lim = n_acc < visible ? n_acc : visible;
    for (int64_t r = 0; r < lim; r++) acc[r] += logits[r] * weight;
}

void kvc_window_attention(const kvc_score_input *in, int32_t w, float *const *out) {
    const kvc_config *c = in->cfg;
    const kvc_layer_ctx *ctx = in->ctx;
    const int32_t H = c->n_heads, g = c->n_heads / c->n_kv_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t n = ctx->n;
#pragma omp parallel for schedule(dynamic, 1)
    for (int32_t hq = 0; hq < H; hq++) {
        const int32_t h = hq / g;
        const int64_t len = in->cache->len[h], n_acc = len - w;
        float *acc = out[hq];
        memset(acc, 0, sizeof(float) * (n_acc > 0 ? n_acc : 0));
        float *logits = malloc(sizeof(float) * (len > 0 ? len : 1));
        if (!logits) continue; /* scores stay 0: caller checked memory beforehand in practice */
        for (int64_t i = n - w; i < n; i++) {
            const float *q = ctx->q + (i * H + hq) * d;
            const int64_t visible = ctx->past_len[h] + i + 1;
            accumulate_probs(q, in->cache->k[h], visible < len ? visible : len, d, scale, logits, acc, n_acc,
                             1.0f / (float)w);
        }
        free(logits);
    }
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
 * how many of them can see it; mean over the group. Two passes per query (max/sum, then probs) so
 * only O(len) scratch per head. */
static kvc_status score_observed(const kvc_score_input *in, float *const *scores) {
    const kvc_config *c = in->cfg;
    const kvc_layer_ctx *ctx = in->ctx;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t n = ctx->n;
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv; h++) memset(scores[h], 0, sizeof(float) * (size_t)in->cache->len[h]);
#pragma omp parallel for schedule(dynamic, 1)
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t len = in->cache->len[h], past = ctx->past_len[h];
        double *acc = calloc((size_t)(len > 0 ? len : 1), sizeof(double));
        float *logits = malloc(sizeof(float) * (size_t)(len > 0 ? len : 1));
        if (!acc || !logits) {
#pragma omp critical
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: observed-attention scores");
            free(acc);
            free(logits);
            continue;
        }
        for (int32_t j = 0; j < g; j++) {
            const int32_t hq = h * g + j;
            for (int64_t i = 0; i < n; i++) {
                const float *q = ctx->q + (i * H + hq) * d;
                const int64_t visible = past + i + 1;
                float mx = -FLT_MAX;
                for (int64_t r = 0; r < visible; r++) {
                    float dot = 0.f;
                    const float *kr = in->cache->k[h] + r * d;
                    for (int32_t t = 0; t < d; t++) dot += q[t] * kr[t];
                    logits[r] = dot * scale;
                    mx = logits[r] > mx ? logits[r] : mx;
                }
                double sum = 0;
                for (int64_t r = 0; r < visible; r++) {
                    logits[r] = expf(logits[r] - mx);
                    sum += logits[r];
                }
                const double inv = 1.0 / sum;
                for (int64_t r = 0; r < visible; r++) acc[r] += logits[r] * inv;
            }
        }
        for (int64_t r = 0; r < len; r++) {
            const int64_t seen = r < past ? n : n - (r - past);
            scores[h][r] = (float)(acc[r] / (seen > 0 ? seen : 1) / g);
        }
        free(acc);
        free(logits);
    }
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
