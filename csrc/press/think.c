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

typedef struct {
    double ratio;        /* fraction of key channels dropped per KV head (0: off) */
    int64_t window;      /* window queries that score the channels */
    int64_t free_channels; /* 1: the kept channels only are stored (memory freed); 0: zeroed in place */
} think_state;

static kvc_status think(kvc_press *p, void *state, kvc_session *s, const kvc_layer_ctx *ctx) {
    (void)p;
    const think_state *t = state;
    const kvc_backend *be = kvc_door_backend(s);
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim, g = H / Hkv;
    const int64_t w = t->window < ctx->n ? t->window : ctx->n, qd = (int64_t)H * d;
    const int32_t n_pruned = (int32_t)((double)d * t->ratio), dk = d - n_pruned;
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
        if (t->free_channels || n == 0) continue;
        for (int64_t r = 0; r < n; r++)
            for (int32_t ch = 0; ch < d; ch++)
                if (cut[ch]) k[r * d + ch] = 0.0f;
        st = be->kv_write(L->kv, h, 0, n, k, NULL);
    }
    if (st == KVC_OK && t->free_channels) st = kvc_cache_prune_keys(kvc_door_cache(s), ctx->layer, dk, kidx);
    free(kidx);
    free(q);
    free(k);
    free(score);
    free(cut);
    return st;
}

static kvc_status set_ratio(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    const double r = *(const double *)data;
    if (!(r >= 0 && r < 1)) return kvc_fail(KVC_ERR_ARG, "key_channel_compression_ratio must be in [0, 1), got %g", r);
    ((think_state *)state)->ratio = r;
    return KVC_OK;
}

static kvc_status set_window(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    const int64_t w = *(const int64_t *)data;
    if (w < 1) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 1, got %lld", (long long)w);
    ((think_state *)state)->window = w;
    return KVC_OK;
}

static kvc_status set_free(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    ((think_state *)state)->free_channels = *(const int64_t *)data != 0;
    return KVC_OK;
}

static void init(void *state, const kvc_press *p) {
    (void)p;
    think_state *t = state;
    t->window = 32; /* kvpress ThinKPress's window_size */
    t->free_channels = 1;
}

static const kvc_part_array_i arrays[] = {
    {"key_channel_ratio", KVC_ARRAY_F64, KVC_COUNT_ONE, set_ratio, "fraction of key channels dropped per KV head, [0, 1)"},
    {"channel_window", KVC_ARRAY_I64, KVC_COUNT_ONE, set_window, "last queries that score the channels (32)"},
    {"channel_free", KVC_ARRAY_I64, KVC_COUNT_ONE, set_free,
     "1: rows stored with the kept channels only (memory freed); 0: dropped channels zeroed in place, as kvpress (1)"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i think_part = {
    .name = "think", .title = "ThinKPress", .traits = KVC_PART_WITHOUT_EVICTION, .order = 30,
    .state_size = sizeof(think_state), .arrays = arrays, .init = init, .after_compact = think,
    .doc = "after the token eviction, each KV head's lowest-scoring key channels dropped from every row"};
KVC_REGISTER_PART(think_part);
