/* LUKVPress (kvpress; LU-KV, arXiv 2602.08585): a budget curve gives each KV head of a layer the fraction of
 * its rows it prunes; the wrapped press's scorer ranks the rows. The counts follow kvpress's rounding in fp32
 * (floors, then the rounded total's rest to the largest fractions); the first `sink` and the last `window` rows
 * are raised to the layer's maximum + 1 before each head keeps its own top rows (the backend's top-k: higher
 * score first, then the lower row, as kvpress's stable descending argsort). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

kvc_status kvc_press_set_head_ratios(kvc_press *p, const float *prune, int64_t n, int32_t sink, int32_t window) {
    if (n != (int64_t)p->n_layers * p->n_kv)
        return kvc_fail(KVC_ERR_ARG, "need %d head prune ratios (layers x KV heads), got %lld", p->n_layers * p->n_kv,
                        (long long)n);
    if (sink < 0 || window < 0) return kvc_fail(KVC_ERR_ARG, "sink and window must be >= 0, got %d and %d", sink, window);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(prune[i])) return kvc_fail(KVC_ERR_ARG, "head prune ratio %lld is not a finite number", (long long)i);
    if (p->cfg.chunk_length > 0 || p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.reuse_layers > 1 || p->head_keep ||
        p->key_filters || p->kvzap || p->block_size || p->fastkvzip || p->cfg.critical || p->cfg.chunk_press > 0 ||
        p->cfg.finch_chunk > 0 || p->cfg.drop_window)
        return kvc_fail(KVC_ERR_ARG, "LU-KV's head counts are an allocation of their own: wrap a plain scorer press");
    if (!p->head_prune && !(p->head_prune = malloc(sizeof(float) * (size_t)n)))
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: head prune ratios");
    memcpy(p->head_prune, prune, sizeof(float) * (size_t)n);
    p->lukv_sink = sink;
    p->lukv_window = window;
    return KVC_OK;
}

void kvc_lukv_counts(const float *prune, int32_t Hkv, int64_t n, int64_t *out) {
    float frac[KVC_MAX_KV_HEADS], sum = 0.0f;
    int given[KVC_MAX_KV_HEADS] = {0};
    int64_t base = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        float rate = 1.0f - prune[h];
        rate = rate < 0.0f ? 0.0f : rate > 1.0f ? 1.0f : rate;
        const float ideal = rate * (float)n;
        sum += ideal;
        out[h] = (int64_t)floorf(ideal);
        frac[h] = ideal - floorf(ideal);
        base += out[h];
    }
    int64_t total = (int64_t)nearbyintf(sum); /* torch.round: halves to even */
    total = total > (int64_t)Hkv * n ? (int64_t)Hkv * n : total;
    total = total < Hkv ? Hkv : total;
    /* the rest of the total, one row each, to the largest fractional parts (ties: the lower head) */
    for (int64_t r = total - base; r > 0; r--) {
        int32_t best = -1;
        for (int32_t h = 0; h < Hkv; h++)
            if (!given[h] && (best < 0 || frac[h] > frac[best])) best = h;
        if (best < 0) break; /* every head has one: kvpress's top-k takes at most Hkv */
        given[best] = 1;
        out[best]++;
    }
    for (int32_t h = 0; h < Hkv; h++) out[h] = out[h] < 1 ? 1 : out[h] > n ? n : out[h];
}

kvc_status kvc_lukv_select(kvc_press *p, const kvc_press_config *cfg, kvc_session *s, const kvc_layer_ctx *ctx,
                           const int64_t *len, float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const kvc_backend *be = kvc_door_backend(s);
    const int32_t Hkv = p->n_kv;
    const int64_t n = len[0];
    for (int32_t h = 1; h < Hkv; h++)
        if (len[h] != n) return kvc_fail(KVC_ERR_ARG, "LU-KV needs every head of a layer to hold the same rows");
    const kvc_layer_rows lr = kvc_press_layer_rows_of(p, s, ctx->layer);
    KVC_TRY(kvc_score_layer(&lr, ctx, cfg, kvc_press_window(cfg), len, &p->dev_scores, &p->dev_ld, scores));
    float mx = -INFINITY;
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t r = 0; r < n; r++) mx = scores[h][r] > mx ? scores[h][r] : mx;
    const float top = (float)((double)mx + 1.0); /* kvpress: scores.max().item() + 1, stored as fp32 */
    const int64_t sink = p->lukv_sink < n ? p->lukv_sink : n, w0 = n - p->lukv_window > 0 ? n - p->lukv_window : 0;
    for (int32_t h = 0; h < Hkv; h++) {
        for (int64_t r = 0; r < sink; r++) scores[h][r] = top;
        for (int64_t r = w0; r < n; r++) scores[h][r] = top;
        KVC_TRY(be->upload(kvc_view_of(p->dev_scores, (int64_t)h * p->dev_ld, p->dev_ld), 1, n, scores[h], KVC_F32));
    }
    kvc_lukv_counts(p->head_prune + (size_t)ctx->layer * Hkv, Hkv, n, n_keep);
    return be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), Hkv, len, n_keep, keep);
}

kvc_status kvc_session_set_head_ratios(kvc_session *s, const float *prune, int64_t n, int32_t sink, int32_t window) {
    kvc_press *p = NULL;
    if (!prune) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_last_press(s, &p));
    return kvc_press_set_head_ratios(p, prune, n, sink, window);
}
