/* SimLayerKV (Zhang et al., 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction"; kvpress
 * SimLayerKVPress): a layer is lazy when its last n_last queries (the window) put more than lazy_threshold of
 * their attention, averaged over every query head and window query, on the first n_initial (n_sink) rows and
 * the n_recent rows before the window. A lazy layer keeps its first n_initial rows and its last
 * n_recent - n_last rows (kvpress's slice keys[-n_recent + n_last:]); any other layer keeps everything, and so
 * does every layer of a prompt of at most n_initial + n_recent + n_last rows, or with lazy_threshold 1. Its
 * scores: FINCH's window attention, unnormalised (finch.c). */
#include "common.h"

static kvc_status simlayer_select(const kvc_config *mc, const kvc_press_config *cfg, const int64_t *len,
                                  const float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const int32_t Hkv = mc->n_kv_heads, w = cfg->window;
    const int64_t ni = cfg->n_sink, nr = cfg->n_recent;
    int compress = cfg->lazy_threshold < 1.0f;
    for (int32_t h = 0; h < Hkv; h++) compress &= len[h] > ni + nr + w;
    double mass = 0;
    for (int32_t h = 0; h < Hkv && compress; h++) {
        const int64_t past = len[h] - w; /* the window's scores cover rows [0, past) */
        for (int64_t r = 0; r < ni; r++) mass += scores[h][r];
        for (int64_t r = past - nr; r < past; r++) mass += scores[h][r];
    }
    const int lazy = compress && mass / Hkv > (double)cfg->lazy_threshold;
    for (int32_t h = 0; h < Hkv; h++) {
        int64_t k = 0;
        for (int64_t r = 0; r < len[h]; r++)
            if (!lazy || r < ni || r >= len[h] - (nr - w)) keep[h][k++] = r;
        n_keep[h] = k;
    }
    return KVC_OK;
}

static kvc_status simlayer_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    return kvc_finch_scores(lr, ctx, cfg, len, 0, scores);
}

static kvc_status simlayer_check(const kvc_press_config *c) {
    if (!(c->lazy_threshold >= 0 && c->lazy_threshold <= 1))
        return kvc_fail(KVC_ERR_ARG, "lazy_threshold should be in [0, 1], got %g", c->lazy_threshold);
    if (c->n_recent <= c->window)
        return kvc_fail(KVC_ERR_ARG, "n_recent (%d) must be larger than n_last (%d): a lazy layer keeps n_recent - n_last "
                        "recent rows", c->n_recent, c->window);
    if (c->budget > 0 || c->compression_ratio != 0 || c->allocation != KVC_ALLOC_UNIFORM || c->chunk_length > 0 ||
        c->chunk_press > 0 || c->critical || c->drop_window)
        return kvc_fail(KVC_ERR_ARG, "SimLayerKV decides each layer's cache from its attention: it takes no "
                        "compression_ratio, budget, allocation or chunks");
    return KVC_OK;
}

static const char *const params[] = {"window", "n_sink", "n_recent", "lazy_threshold", NULL};

static const kvc_scorer_i simlayerkv_scorer = {
    .name = "simlayerkv",
    .title = "SimLayerKV",
    .code = KVC_SCORE_SIMLAYERKV,
    .traits = KVC_SCORER_HOST | KVC_SCORER_WINDOW | KVC_SCORER_OWN_BUDGET,
    .params = params,
    .check = simlayer_check,
    .host = simlayer_scores,
    .select = simlayer_select,
    .doc = "a lazy layer (attention on sinks + recent rows above a threshold) keeps those rows only (SimLayerKV, Zhang et al. 2024)",
};
KVC_REGISTER_SCORER(simlayerkv_scorer);
