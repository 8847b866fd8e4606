/* ThinKPress (kvpress; Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning"): per KV head,
 * channel c scores mean_q(q_c^2) (over the last `window` queries of the call and the group's query heads)
 * times mean_rows(k_c^2); the int(d x ratio) lowest channels are dropped from every cached row.
 * channel_free: the rows are stored with the kept channels only (kvc_cache_prune_keys: the layer's K store
 * shrinks and attention gathers the query to the kept channels for them, core/backend.h); otherwise they
 * are set to zero in place, as kvpress does (the store keeps its head dim). Both give the same attention.
 * The rows are read through the host (kv_read), once per layer of a compressed prefill. Ties: the lower
 * channel is pruned first. */
#include <stdlib.h>
#include <string.h>

#include "press.h"

kvc_status kvc_press_think(kvc_press *p, kvc_session *s, const kvc_layer_ctx *ctx) {
    const kvc_backend *be = kvc_door_backend(s);
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim, g = H / Hkv;
    const int64_t w = p->channel_window < ctx->n ? p->channel_window : ctx->n, qd = (int64_t)H * d;
    const int32_t n_pruned = (int32_t)((double)d * p->key_channel_ratio), dk = d - n_pruned;
    if (n_pruned <= 0 || d <= 0) return KVC_OK;
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[ctx->layer];
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = L->len[h] > maxlen ? L->len[h] : maxlen;
    float *q = malloc(sizeof(float) * (size_t)(w * qd)), *k = malloc(sizeof(float) * (size_t)(maxlen * d));
    double *score = malloc(sizeof(double) * (size_t)d);
    char *cut = malloc((size_t)d);
    int32_t *kidx = malloc(sizeof(int32_t) * (size_t)Hkv * (size_t)dk); /* kept channels per head */
    kvc_status st = (!q || !k || !score || !cut || !kidx) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: ThinK") : KVC_OK;
    if (st == KVC_OK) st = be->download(kvc_view_at(ctx->q, ctx->n - w, 0), w, qd, q, KVC_F32);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t n = L->len[h];
        st = n > 0 ? be->kv_read(L->kv, h, 0, n, k, NULL) : KVC_OK;
        if (st != KVC_OK) break;
        for (int32_t ch = 0; ch < d; ch++) {
            double qs = 0, ks = 0;
            for (int32_t j = 0; j < g; j++)
                for (int64_t t = 0; t < w; t++) {
                    const double x = q[t * qd + (int64_t)(h * g + j) * d + ch];
                    qs += x * x;
                }
            for (int64_t r = 0; r < n; r++) ks += (double)k[r * d + ch] * k[r * d + ch];
            score[ch] = qs / ((double)g * w) * (n > 0 ? ks / n : 0.0);
        }
        memset(cut, 0, (size_t)d);
        for (int32_t i = 0; i < n_pruned; i++) { /* the lowest remaining channel, the lower index on ties */
            int32_t best = -1;
            for (int32_t ch = 0; ch < d; ch++)
                if (!cut[ch] && (best < 0 || score[ch] < score[best])) best = ch;
            cut[best] = 1;
        }
        for (int32_t ch = 0, j = 0; ch < d; ch++)
            if (!cut[ch]) kidx[(size_t)h * dk + j++] = ch;
        if (p->channel_free || n == 0) continue;
        for (int64_t r = 0; r < n; r++)
            for (int32_t ch = 0; ch < d; ch++)
                if (cut[ch]) k[r * d + ch] = 0.0f;
        st = be->kv_write(L->kv, h, 0, n, k, NULL);
    }
    if (st == KVC_OK && p->channel_free) st = kvc_cache_prune_keys(kvc_door_cache(s), ctx->layer, dk, kidx);
    free(kidx);
    free(q);
    free(k);
    free(score);
    free(cut);
    return st;
}

kvc_status kvc_session_set_key_channels(kvc_session *s, double ratio, int32_t window, int32_t free_channels) {
    kvc_press *p = NULL;
    KVC_TRY(kvc_last_press(s, &p));
    if (!(ratio >= 0 && ratio < 1)) return kvc_fail(KVC_ERR_ARG, "key_channel_compression_ratio must be in [0, 1), got %g", ratio);
    if (window < 1) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 1, got %d", window);
    p->key_channel_ratio = ratio;
    p->channel_window = window;
    p->channel_free = free_channels != 0;
    return KVC_OK;
}
