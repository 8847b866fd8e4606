/* A layer's scores, wherever they are computed: by the session's backend (the scorers of the kernel
 * table), or on the host by a scorer row's host function (ObservedAttention needs every query's whole
 * attention row, which no flash-style device kernel forms; kvpress's host scorers, scorers/). The checks a
 * scorer's traits ask for are made here, once, before the backend is called: its messages are the user's. */
#include <stdlib.h>
#include <string.h>

#include "press.h"

kvc_status kvc_layer_rope(const kvc_layer_rows *lr, int32_t layer, int64_t end, float *freq, float *mscale) {
    const int32_t half = lr->mc->head_dim / 2;
    if (!lr->model) {
        *mscale = 1.0f;
        return kvc_kernel_rope_freqs(lr->mc, freq);
    }
    const kvc_rope_rule r = kvc_model_rope(lr->model, layer, end);
    memcpy(freq, r.host, sizeof(float) * (size_t)half);
    *mscale = r.mscale;
    return KVC_OK;
}

kvc_status kvc_score_buffer(const kvc_backend *be, int32_t Hkv, kvc_buf **buf, int64_t *ld, int64_t maxlen) {
    if (*buf && *ld >= maxlen) return KVC_OK;
    if (*buf) be->free(*buf);
    *buf = NULL;
    *ld = 0;
    KVC_TRY(be->alloc(KVC_F32, (int64_t)Hkv * maxlen, KVC_MEM_ACT, "press scores", buf));
    *ld = maxlen;
    return KVC_OK;
}

/* What a backend scorer needs of the call, from its traits: the window's queries, the attention outputs,
 * heads of equal length. */
static kvc_status check_backend_scorer(const kvc_scorer_i *sc, const kvc_layer_ctx *ctx, int32_t window, const int64_t *len,
                                       int32_t Hkv) {
    if (sc->traits & KVC_SCORER_SAME_LEN)
        for (int32_t h = 1; h < Hkv; h++)
            if (len[h] != len[0]) return kvc_fail(KVC_ERR_ARG, "%s needs every head of a layer to hold the same tokens", sc->title);
    if ((sc->traits & KVC_SCORER_READS_ATTN) && !ctx->attn.buf)
        return kvc_fail(KVC_ERR_ARG, "%s needs the attention outputs of the window queries", sc->title);
    if (sc->traits & (KVC_SCORER_WINDOW | KVC_SCORER_LAST_QUERY)) {
        const int64_t m = sc->traits & KVC_SCORER_LAST_QUERY ? 1 : window;
        if (m < 1 || m > ctx->n)
            return kvc_fail(KVC_ERR_ARG, "the press window (%lld) needs that many queries in this call (%lld)", (long long)m,
                            (long long)ctx->n);
    }
    return KVC_OK;
}

kvc_status kvc_score_layer(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                           int32_t window, const int64_t *len, kvc_buf **buf, int64_t *ld, float *const *host) {
    const kvc_config *c = lr->mc;
    const kvc_backend *be = lr->be;
    const int32_t Hkv = c->n_kv_heads;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    KVC_TRY(kvc_score_buffer(be, Hkv, buf, ld, maxlen));
    const kvc_view scores = kvc_view_of(*buf, 0, *ld);
    const kvc_scorer_i *sc = kvc_scorer_of(cfg->scorer);
    if (!sc) return kvc_fail(KVC_ERR_ARG, "unknown scorer %d", cfg->scorer);
    if (sc->traits & KVC_SCORER_HOST) {
        KVC_TRY(sc->host(lr, ctx, cfg, len, host));
        for (int32_t h = 0; h < Hkv; h++) KVC_TRY(be->upload(kvc_view_at(scores, h, 0), 1, len[h], host[h], KVC_F32));
        return KVC_OK;
    }
    KVC_TRY(check_backend_scorer(sc, ctx, window, len, Hkv));
    kvc_score_args a;
    memset(&a, 0, sizeof a);
    a.scorer = cfg->scorer;
    a.layer = ctx->layer;
    a.H = c->n_heads;
    a.Hkv = Hkv;
    a.d = c->head_dim;
    a.kv = lr->kv;
    a.len = len;
    a.q = ctx->q;
    a.n = ctx->n;
    a.attn = sc->traits & KVC_SCORER_READS_ATTN ? ctx->attn : kvc_view_of(NULL, 0, 0);
    a.window = sc->traits & KVC_SCORER_LAST_QUERY ? 1 : window;
    a.kernel = sc->traits & KVC_SCORER_LAST_QUERY ? 1 : cfg->kernel;
    a.pool_max = cfg->pool_max;
    a.gqa_max = cfg->gqa_max;
    a.pool_then_reduce = cfg->pool_then_reduce;
    a.n_sink = cfg->n_sink;
    a.seed = cfg->seed;
    a.edie_alpha = cfg->edie_alpha;
    a.scores = scores;
    KVC_TRY(be->score(&a));
    for (int32_t h = 0; h < Hkv; h++) KVC_TRY(be->download(kvc_view_at(scores, h, 0), 1, len[h], host[h], KVC_F32));
    return KVC_OK;
}

kvc_status kvc_press_score_select(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, int64_t layer_total, kvc_buf **buf, int64_t *ld,
                                  float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const int32_t Hkv = lr->mc->n_kv_heads, layer = ctx->layer, L = lr->mc->n_layers, w = kvc_press_window(cfg);
    if (cfg->chunk_press > 0) return kvc_chunk_press_select(lr, ctx, cfg, len, buf, ld, scores, keep, n_keep);
    KVC_TRY(kvc_score_layer(lr, ctx, cfg, w, len, buf, ld, scores));
    if (cfg->critical) return kvc_critical_select(lr, cfg, layer, L, len, w, layer_total, scores, keep, n_keep);
    const kvc_scorer_i *sc = kvc_scorer_of(cfg->scorer);
    if (sc && sc->select) return sc->select(lr->mc, cfg, len, (const float *const *)scores, keep, n_keep);
    if (cfg->finch_chunk > 0)
        return kvc_chunk_topk(Hkv, len, cfg->finch_chunk, cfg->compression_ratio, (const float *const *)scores, keep, n_keep);
    if (cfg->drop_window) {
        /* the window rows are scoring queries only: select among the rows before them, the window goes */
        int64_t before[KVC_MAX_KV_HEADS];
        for (int32_t h = 0; h < Hkv; h++) before[h] = len[h] - w;
        return kvc_press_select(cfg, layer, L, Hkv, before, (const float *const *)scores, 0, layer_total, keep, n_keep);
    }
    if (kvc_press_per_head_topk(cfg)) {
        for (int32_t h = 0; h < Hkv; h++) {
            const int64_t k = kvc_layer_budget(cfg, layer, L, len[h]);
            n_keep[h] = k < len[h] ? k : len[h];
        }
        return lr->be->topk(kvc_view_of(*buf, 0, *ld), Hkv, len, n_keep, keep);
    }
    return kvc_press_select(cfg, layer, L, Hkv, len, (const float *const *)scores, w, layer_total, keep, n_keep);
}
