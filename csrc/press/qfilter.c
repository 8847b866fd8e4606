/* QFilterPress (kvpress; Godey et al., 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
 * Compression"): the press's part that scores each row -<k, filter[layer][h]> (array "key_filters",
 * [L, Hkv, head_dim] in this model's K channel order) in place of its scorer, then each head's top k. */
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct {
    float *filters; /* [L * Hkv * d] */
} qfilter_state;

static kvc_status set_filters(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p;
    qfilter_state *q = state;
    float *f = malloc(sizeof(float) * (size_t)n);
    if (!f) return kvc_fail(KVC_ERR_NOMEM, "out of memory: key filters");
    memcpy(f, data, sizeof(float) * (size_t)n);
    free(q->filters);
    q->filters = f;
    return KVC_OK;
}

static void release(void *state) { free(((qfilter_state *)state)->filters); }

/* QFilterPress: scores -<k_r, filter[layer][h]> on the host (the rows come through kv_read), uploaded to the
 * backend's score buffer, then each head's top k there. */
static kvc_status filter_select(kvc_press *p, void *state, const kvc_press_config *cfg, kvc_session *s,
                                const kvc_layer_ctx *ctx, const int64_t *len, float *const *scores, int64_t *const *keep,
                                int64_t *n_keep) {
    const float *filters = ((const qfilter_state *)state)->filters;
    const kvc_backend *be = kvc_door_backend(s);
    const int32_t d = kvc_door_model(s)->cfg.head_dim;
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[ctx->layer];
    int64_t maxlen = 1;
    for (int32_t h = 0; h < p->n_kv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    KVC_TRY(kvc_score_buffer(be, p->n_kv, &p->dev_scores, &p->dev_ld, maxlen));
    float *k = malloc(sizeof(float) * (size_t)maxlen * (size_t)d);
    kvc_status st = k ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: Q-filter scores");
    for (int32_t h = 0; h < p->n_kv && st == KVC_OK; h++) {
        const float *f = filters + ((size_t)ctx->layer * p->n_kv + h) * d;
        st = be->kv_read(L->kv, h, 0, len[h], k, NULL);
        for (int64_t r = 0; r < len[h] && st == KVC_OK; r++) {
            double dot = 0;
            for (int32_t j = 0; j < d; j++) dot += (double)k[r * d + j] * f[j];
            scores[h][r] = (float)-dot;
        }
        if (st == KVC_OK) st = be->upload(kvc_view_of(p->dev_scores, (int64_t)h * p->dev_ld, p->dev_ld), 1, len[h], scores[h], KVC_F32);
        const int64_t kk = kvc_layer_budget(cfg, ctx->layer, p->n_layers, len[h]);
        n_keep[h] = kk < len[h] ? kk : len[h];
    }
    free(k);
    if (st != KVC_OK) return st;
    return be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), p->n_kv, len, n_keep, keep);
}


static const kvc_part_array_i arrays[] = {
    {"key_filters", KVC_ARRAY_F32, KVC_COUNT_KV_CHANNELS, set_filters,
     "the filter of each layer and KV head (its K channel order); a row scores -<k, filter>"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i qfilter_part = {
    .name = "qfilter", .title = "QFilterPress", .traits = KVC_PART_SELECTS | KVC_PART_PLAIN, .order = 10,
    .state_size = sizeof(qfilter_state), .arrays = arrays, .release = release, .select = filter_select,
    .doc = "scores -<k, filter[layer][h]> in place of the scorer, uniform top-k per head"};
KVC_REGISTER_PART(qfilter_part);
