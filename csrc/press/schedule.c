/* The post-prefill schedule (kvpress's): a press attached to a session compresses each layer right after
 * its attention during a multi-token forward, then evicts for real (compaction). The same steps on every
 * backend: scores (score.c), per-head top-k on the backend or allocation on the host (allocation.c),
 * TADA's statistics, ChunkKV's layer-wise index reuse, the recorded diagnostics, the compaction. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "press.h"

void kvc_press_free(kvc_press *p) {
    if (!p) return;
    if (p->scores)
        for (int64_t i = 0; i < (int64_t)p->n_layers * p->n_kv; i++) free(p->scores[i]);
    free(p->scores);
    free(p->score_len);
    free(p->error);
    free(p->reuse_rows);
    free(p->reuse_n);
    free(p->layer_seconds);
    free(p->layer_totals);
    free(p->e_internal);
    free(p->dissim);
    if (p->dev_scores) p->be->free(p->dev_scores);
    free(p->layer_ratios);
    free(p->head_keep);
    free(p->key_filters);
    free(p->dms_tail);
    free(p->dms_tail_n);
    kvc_kvzap_free(p->kvzap);
    free(p->q_mean);
    free(p->q_cov);
    free(p->head_prune);
    kvc_fastkvzip_free(p->fastkvzip);
    kvc_press_free(p->next);
    free(p);
}

kvc_status kvc_press_new(const kvc_press_config *cfg, const kvc_config *mc, const kvc_backend *be, kvc_press **out) {
    *out = NULL;
    KVC_TRY(kvc_press_config_check(cfg));
    kvc_press *p = calloc(1, sizeof *p);
    if (!p) return kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    p->cfg = *cfg;
    p->be = be;
    p->n_layers = mc->n_layers;
    p->n_kv = mc->n_kv_heads;
    const size_t nh = (size_t)p->n_layers * p->n_kv, L = (size_t)p->n_layers;
    p->scores = calloc(nh, sizeof *p->scores);
    p->score_len = calloc(nh, sizeof *p->score_len);
    p->error = malloc(sizeof(double) * L);
    p->layer_seconds = calloc(L, sizeof(double));
    p->reuse_n = calloc((size_t)p->n_kv, sizeof(int64_t));
    p->layer_totals = malloc(sizeof(int64_t) * L);
    p->e_internal = malloc(sizeof(double) * L);
    p->dissim = malloc(sizeof(double) * L);
    if (!p->scores || !p->score_len || !p->error || !p->layer_seconds || !p->reuse_n || !p->layer_totals ||
        !p->e_internal || !p->dissim) {
        kvc_press_free(p);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    }
    for (int32_t l = 0; l < p->n_layers; l++) {
        p->error[l] = p->e_internal[l] = p->dissim[l] = NAN;
        p->layer_totals[l] = -1;
    }
    *out = p;
    return KVC_OK;
}

kvc_status kvc_press_recorded_scores(const kvc_press *p, int32_t layer, int32_t h, float *out, int64_t *n) {
    if (layer < 0 || layer >= p->n_layers || h < 0 || h >= p->n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    const size_t i = (size_t)layer * p->n_kv + h;
    *n = p->scores[i] ? p->score_len[i] : 0;
    if (out && p->scores[i]) memcpy(out, p->scores[i], sizeof(float) * (size_t)*n);
    return KVC_OK;
}

kvc_status kvc_press_set_layer_totals(kvc_press *p, const int64_t *totals, int32_t n_layers) {
    if (n_layers != p->n_layers) return kvc_fail(KVC_ERR_ARG, "need %d layer budgets, got %d", p->n_layers, n_layers);
    for (int32_t l = 0; l < n_layers; l++)
        if (totals[l] < 0) return kvc_fail(KVC_ERR_ARG, "layer %d budget is negative", l);
    memcpy(p->layer_totals, totals, sizeof(int64_t) * (size_t)n_layers);
    return KVC_OK;
}

kvc_status kvc_press_set_layer_ratios(kvc_press *p, const double *ratios, int32_t n_layers) {
    if (n_layers != p->n_layers) return kvc_fail(KVC_ERR_ARG, "need %d compression ratios (one per layer), got %d", p->n_layers, n_layers);
    if (p->cfg.budget > 0) return kvc_fail(KVC_ERR_ARG, "per-layer compression ratios replace compression_ratio, not a budget");
    for (int32_t l = 0; l < n_layers; l++)
        if (!(ratios[l] >= 0 && ratios[l] < 1))
            return kvc_fail(KVC_ERR_ARG, "compression ratio of layer %d must be in [0, 1), got %g", l, ratios[l]);
    if (!p->layer_ratios && !(p->layer_ratios = malloc(sizeof(double) * (size_t)n_layers)))
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: layer ratios");
    memcpy(p->layer_ratios, ratios, sizeof(double) * (size_t)n_layers);
    return KVC_OK;
}

kvc_status kvc_press_set_head_budgets(kvc_press *p, const int64_t *keep, int64_t n) {
    if (n != (int64_t)p->n_layers * p->n_kv)
        return kvc_fail(KVC_ERR_ARG, "need %d head budgets (layers x KV heads), got %lld", p->n_layers * p->n_kv, (long long)n);
    if (p->cfg.chunk_length > 0 || p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.reuse_layers > 1 || p->head_prune ||
        p->fastkvzip)
        return kvc_fail(KVC_ERR_ARG, "head budgets are an allocation of their own: use a plain scorer press");
    if (!p->head_keep && !(p->head_keep = malloc(sizeof(int64_t) * (size_t)n)))
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: head budgets");
    memcpy(p->head_keep, keep, sizeof(int64_t) * (size_t)n);
    return KVC_OK;
}

/* Given rows per head (DuoAttention: all for retrieval heads, sinks + recent for streaming heads): the
 * layer's scores, then each head's own top k on the backend. */
static kvc_status head_budget_select(kvc_press *p, const kvc_press_config *cfg, kvc_session *s, const kvc_layer_ctx *ctx,
                                     const int64_t *len, float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const kvc_layer_rows lr = kvc_press_layer_rows_of(p, s, ctx->layer);
    KVC_TRY(kvc_score_layer(&lr, ctx, cfg, kvc_press_window(cfg), len, &p->dev_scores, &p->dev_ld, scores));
    for (int32_t h = 0; h < p->n_kv; h++) {
        const int64_t k = p->head_keep[(size_t)ctx->layer * p->n_kv + h];
        n_keep[h] = k < 0 || k > len[h] ? len[h] : k;
    }
    return kvc_door_backend(s)->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), p->n_kv, len, n_keep, keep);
}

kvc_status kvc_press_set_block_size(kvc_press *p, int64_t block_size) {
    if (block_size < 0) return kvc_fail(KVC_ERR_ARG, "block_size must be >= 1, got %lld", (long long)block_size);
    char which[256];
    if (block_size > 0 && !kvc_scorer_has(p->cfg.scorer, KVC_SCORER_BLOCKABLE))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "BlockPress scores each block from its keys alone: wrap a scorer that reads no "
                        "queries (%s)", kvc_scorer_titles(KVC_SCORER_BLOCKABLE, which, sizeof which));
    if (block_size > 0 && (p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.chunk_length > 0 || p->head_keep ||
                           p->head_prune || p->fastkvzip))
        return kvc_fail(KVC_ERR_ARG, "BlockPress keeps the same count in every head: use a plain scorer press");
    p->block_size = block_size;
    return KVC_OK;
}

/* BlockPress (kvpress; the KeyDiff paper's block-wise prompt processing, simulated after the forward as
 * kvpress does): each head starts with its first n_kept rows; block after block, the kept rows and the
 * next block_size rows are copied into a scratch K/V store, scored there (a scorer that sees only those
 * rows), and the top n_kept become the kept rows. */
static kvc_status block_select(kvc_press *p, const kvc_press_config *cfg, kvc_session *s, const kvc_layer_ctx *ctx,
                               const int64_t *len, float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const kvc_backend *be = kvc_door_backend(s);
    const int32_t Hkv = p->n_kv, d = kvc_door_model(s)->cfg.head_dim;
    const int64_t n = len[0];
    for (int32_t h = 1; h < Hkv; h++)
        if (len[h] != n) return kvc_fail(KVC_ERR_ARG, "BlockPress needs every head of a layer to hold the same rows");
    const int64_t nk = kvc_layer_budget(cfg, ctx->layer, p->n_layers, n);
    int64_t *cand[KVC_MAX_KV_HEADS] = {0}, full[KVC_MAX_KV_HEADS], kk[KVC_MAX_KV_HEADS], mm[KVC_MAX_KV_HEADS];
    kvc_kv *tmp = NULL;
    kvc_status st = be->kv_new(Hkv, d, &tmp);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        n_keep[h] = nk;
        kk[h] = nk;
        full[h] = n;
        for (int64_t i = 0; i < nk; i++) keep[h][i] = i;
        if (!(cand[h] = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: BlockPress");
    }
    const kvc_layer_rows lr = kvc_session_layer_rows(s, ctx->layer, tmp);
    for (int64_t i = nk; i < n && st == KVC_OK; i += p->block_size) {
        const int64_t end = i + p->block_size < n ? i + p->block_size : n;
        for (int32_t h = 0; h < Hkv; h++) {
            memcpy(cand[h], keep[h], sizeof(int64_t) * (size_t)nk); /* kept rows are all < i: the list stays sorted */
            for (int64_t r = i; r < end; r++) cand[h][nk + r - i] = r;
            mm[h] = nk + end - i;
        }
        st = be->kv_resize(tmp, full, full, kvc_door_cache(s)->layers[ctx->layer].kv);
        if (st == KVC_OK) st = be->kv_gather(tmp, (const int64_t *const *)cand, mm, mm);
        if (st == KVC_OK) st = kvc_score_layer(&lr, ctx, cfg, 0, mm, &p->dev_scores, &p->dev_ld, scores);
        if (st == KVC_OK) st = be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), Hkv, mm, kk, keep);
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            for (int64_t j = 0; j < nk; j++) keep[h][j] = cand[h][keep[h][j]];
    }
    if (tmp) be->kv_free(tmp);
    for (int32_t h = 0; h < Hkv; h++) free(cand[h]);
    return st;
}

kvc_status kvc_press_set_key_filters(kvc_press *p, const float *filters, int64_t n, int32_t d) {
    if (n != (int64_t)p->n_layers * p->n_kv * d)
        return kvc_fail(KVC_ERR_ARG, "need key filters of shape [%d layers, %d KV heads, %d], got %lld values", p->n_layers,
                        p->n_kv, d, (long long)n);
    if (p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.chunk_length > 0 || p->head_keep || p->block_size ||
        p->head_prune || p->fastkvzip)
        return kvc_fail(KVC_ERR_ARG, "Q-filters score with uniform top-k per head: use them with a plain budget");
    if (!p->key_filters && !(p->key_filters = malloc(sizeof(float) * (size_t)n)))
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: key filters");
    memcpy(p->key_filters, filters, sizeof(float) * (size_t)n);
    return KVC_OK;
}

kvc_status kvc_query_stats_set(int32_t L, int32_t H, int32_t d, const float *mean, const float *cov, int64_t n_mean,
                               int64_t n_cov, float **m_slot, float **c_slot) {
    const int64_t nm = (int64_t)L * H * d;
    if (n_mean != nm || n_cov != nm * d)
        return kvc_fail(KVC_ERR_ARG, "need a query mean [%d layers, %d heads, %d] and covariance [%d, %d, %d, %d], got %lld "
                        "and %lld values", L, H, d, L, H, d, d, (long long)n_mean, (long long)n_cov);
    for (int64_t i = 0; i < n_mean; i++)
        if (!isfinite(mean[i])) return kvc_fail(KVC_ERR_ARG, "the query mean must be finite (value %lld is not)", (long long)i);
    for (int64_t i = 0; i < n_cov; i++)
        if (!isfinite(cov[i])) return kvc_fail(KVC_ERR_ARG, "the query covariance must be finite (value %lld is not)", (long long)i);
    float *m = malloc(sizeof(float) * (size_t)n_mean), *c = malloc(sizeof(float) * (size_t)n_cov);
    if (!m || !c) {
        free(m);
        free(c);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: query statistics");
    }
    memcpy(m, mean, sizeof(float) * (size_t)n_mean);
    memcpy(c, cov, sizeof(float) * (size_t)n_cov);
    free(*m_slot);
    free(*c_slot);
    *m_slot = m;
    *c_slot = c;
    return KVC_OK;
}

kvc_status kvc_press_set_query_stats(kvc_press *p, const float *mean, const float *cov, int64_t n_mean, int64_t n_cov,
                                     int32_t H, int32_t d) {
    if (!kvc_scorer_has(p->cfg.scorer, KVC_SCORER_QUERY_STATS))
        return kvc_fail(KVC_ERR_ARG, "query statistics are ExpectedAttention's: attach an ExpectedAttention press first");
    return kvc_query_stats_set(p->n_layers, H, d, mean, cov, n_mean, n_cov, &p->q_mean, &p->q_cov);
}

/* KVzapPress: the surrogate model's scores of this call's rows (host), uploaded, each head's top k. */
static kvc_status kvzap_select(kvc_press *p, const kvc_press_config *cfg, kvc_session *s, const kvc_layer_ctx *ctx,
                               const int64_t *len, float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const kvc_backend *be = kvc_door_backend(s);
    int64_t maxlen = 1;
    for (int32_t h = 0; h < p->n_kv; h++) {
        if (len[h] != ctx->n)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "KVzapPress scores the rows of one prefill from their hidden states: the "
                            "session must be empty before it (head %d holds %lld rows, the call %lld)", h,
                            (long long)len[h], (long long)ctx->n);
        maxlen = len[h] > maxlen ? len[h] : maxlen;
    }
    KVC_TRY(kvc_score_buffer(be, p->n_kv, &p->dev_scores, &p->dev_ld, maxlen));
    KVC_TRY(kvc_kvzap_scores(p->kvzap, be, ctx, scores));
    for (int32_t h = 0; h < p->n_kv; h++) {
        KVC_TRY(be->upload(kvc_view_of(p->dev_scores, (int64_t)h * p->dev_ld, p->dev_ld), 1, len[h], scores[h], KVC_F32));
        const int64_t kk = kvc_layer_budget(cfg, ctx->layer, p->n_layers, len[h]);
        n_keep[h] = kk < len[h] ? kk : len[h];
    }
    return be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), p->n_kv, len, n_keep, keep);
}

/* QFilterPress: scores -<k_r, filter[layer][h]> on the host (the rows come through kv_read), uploaded to the
 * backend's score buffer, then each head's top k there. */
static kvc_status filter_select(kvc_press *p, const kvc_press_config *cfg, kvc_session *s, const kvc_layer_ctx *ctx,
                                const int64_t *len, float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const kvc_backend *be = kvc_door_backend(s);
    if (p->kvzap) return kvzap_select(p, cfg, s, ctx, len, scores, keep, n_keep);
    const int32_t d = kvc_door_model(s)->cfg.head_dim;
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[ctx->layer];
    int64_t maxlen = 1;
    for (int32_t h = 0; h < p->n_kv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    KVC_TRY(kvc_score_buffer(be, p->n_kv, &p->dev_scores, &p->dev_ld, maxlen));
    float *k = malloc(sizeof(float) * (size_t)maxlen * (size_t)d);
    kvc_status st = k ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: Q-filter scores");
    for (int32_t h = 0; h < p->n_kv && st == KVC_OK; h++) {
        const float *f = p->key_filters + ((size_t)ctx->layer * p->n_kv + h) * d;
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

/* TADA statistics: E_internal (the scores over heads and past rows) and 1 - cos(R, R + O) over the
 * window tokens (the last one without a window). */
static kvc_status layer_stats(kvc_press *p, kvc_session *s, const kvc_layer_ctx *ctx, const int64_t *len,
                              const float *const *scores, int32_t w) {
    double e = 0;
    for (int32_t h = 0; h < p->n_kv; h++)
        for (int64_t r = 0; r < len[h] - w; r++) e += scores[h][r];
    p->e_internal[ctx->layer] = e;
    const int64_t nw = w > 0 ? (w < ctx->n ? w : ctx->n) : 1, D = kvc_door_model(s)->cfg.hidden;
    const kvc_backend *be = kvc_door_backend(s);
    double cos_sum = 0;
    KVC_TRY(be->cos_sum(kvc_view_at(ctx->resid, ctx->n - nw, 0), kvc_view_at(ctx->o, ctx->n - nw, 0), nw, D, &cos_sum));
    p->dissim[ctx->layer] = 1.0 - cos_sum / nw;
    return KVC_OK;
}

static kvc_status remember_for_reuse(kvc_press *p, const int64_t *len, int64_t *const *keep, const int64_t *n_keep) {
    p->reuse_len = 0;
    for (int32_t h = 1; h < p->n_kv; h++)
        if (len[h] != len[0]) return KVC_OK; /* ragged heads: nothing to reuse */
    int64_t *rows = realloc(p->reuse_rows, sizeof(int64_t) * (size_t)(len[0] > 0 ? len[0] : 1) * p->n_kv);
    if (!rows) return kvc_fail(KVC_ERR_NOMEM, "out of memory: layer index reuse");
    p->reuse_rows = rows;
    for (int32_t h = 0; h < p->n_kv; h++) {
        memcpy(rows + (size_t)h * len[0], keep[h], sizeof(int64_t) * (size_t)n_keep[h]);
        p->reuse_n[h] = n_keep[h];
    }
    p->reuse_len = len[0];
    return KVC_OK;
}

/* The checks a compression needs before it starts (the messages a user sees). */
static kvc_status check_layer(const kvc_press_config *cfg, const int64_t *len, int32_t Hkv, int32_t w, int64_t n) {
    for (int32_t h = 0; h < Hkv && w > 0; h++)
        if (len[h] <= w)
            return kvc_fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%d)", (long long)len[h], w);
    if (w > 0 && n < w)
        return kvc_fail(KVC_ERR_ARG, "the press window (%d) is longer than this forward call (%lld tokens)", w, (long long)n);
    if (kvc_scorer_has(cfg->scorer, KVC_SCORER_SINK_ROWS))
        for (int32_t h = 0; h < Hkv; h++)
            if (len[h] <= cfg->n_sink)
                return kvc_fail(KVC_ERR_ARG, "%s needs more tokens (%lld) than n_sink (%d)", kvc_scorer_title(cfg->scorer),
                                (long long)len[h], cfg->n_sink);
    return KVC_OK;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Score and select (or reuse the group's rows): keep[h] / n_keep[h] of the layer's rows. */
static kvc_status choose(kvc_press *p, const kvc_press_config *cfg, kvc_session *s, const kvc_layer_ctx *ctx,
                         const int64_t *len, int32_t w, float *const *scores, int64_t *const *keep, int64_t *n_keep,
                         int *reused) {
    const int32_t Hkv = p->n_kv, layer = ctx->layer;
    *reused = 0;
    if (cfg->reuse_layers > 1 && layer % cfg->reuse_layers != 0 && p->reuse_len > 0) {
        /* ChunkKV layer-wise index reuse: a later layer of the group keeps what its first layer kept */
        int same = 1;
        for (int32_t h = 0; h < Hkv; h++) same &= len[h] == p->reuse_len;
        if (same) {
            for (int32_t h = 0; h < Hkv; h++) {
                n_keep[h] = p->reuse_n[h];
                memcpy(keep[h], p->reuse_rows + (size_t)h * p->reuse_len, sizeof(int64_t) * (size_t)n_keep[h]);
            }
            *reused = 1;
            return KVC_OK;
        }
    }
    const kvc_layer_rows lr = kvc_press_layer_rows_of(p, s, layer);
    KVC_TRY(kvc_press_score_select(&lr, ctx, cfg, len, p->layer_totals[layer], &p->dev_scores, &p->dev_ld, scores, keep,
                                   n_keep));
    KVC_TRY(layer_stats(p, s, ctx, len, (const float *const *)scores, w));
    if (cfg->reuse_layers > 1) KVC_TRY(remember_for_reuse(p, len, keep, n_keep));
    return KVC_OK;
}

/* One press of a chain (ComposedPress) on the layer; then the next compresses what this one kept. */
static kvc_status press_layer(kvc_press *p, kvc_session *s, const kvc_layer_ctx *ctx);

kvc_status kvc_press_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    if (ctx->n <= 1) return KVC_OK; /* decoding: presses act on prefills only */
    for (kvc_press *p = user; p; p = p->next) KVC_TRY(press_layer(p, s, ctx));
    return KVC_OK;
}

static kvc_status press_layer(kvc_press *p, kvc_session *s, const kvc_layer_ctx *ctx) {
    kvc_press_config layer_cfg = p->cfg;
    if (p->layer_ratios) layer_cfg.compression_ratio = p->layer_ratios[ctx->layer]; /* PerLayerCompressionPress */
    const kvc_press_config *cfg = &layer_cfg;
    if (cfg->dms) return kvc_dms_prefill(p, s, ctx); /* DMSPress: its threshold, not a budget */
    if (p->fastkvzip) return kvc_fastkvzip_layer(p, s, ctx); /* FastKVzip: all layers' scores, then one eviction */
    if (cfg->reuse_layers > 1 && ctx->layer % cfg->reuse_layers == 0) p->reuse_len = 0; /* a new group */
    if (cfg->budget == 0 && cfg->compression_ratio == 0 && !p->head_keep && !p->head_prune && !kvc_press_decides_own_budget(cfg))
        return p->key_channel_ratio > 0 ? kvc_press_think(p, s, ctx) : KVC_OK;
    const int32_t Hkv = p->n_kv, layer = ctx->layer, w = kvc_press_window(cfg);
    const int64_t *len = kvc_door_cache(s)->layers[layer].len;
    KVC_TRY(check_layer(cfg, len, Hkv, w, ctx->n));
    if (cfg->budget > 0 && !cfg->drop_window) {
        int evict = 0;
        for (int32_t h = 0; h < Hkv; h++) evict |= len[h] > cfg->budget;
        if (!evict) return KVC_OK;
    }
    float *scores[KVC_MAX_KV_HEADS] = {0};
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS] = {0};
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        scores[h] = malloc(sizeof(float) * (size_t)(len[h] > 0 ? len[h] : 1));
        keep[h] = malloc(sizeof(int64_t) * (size_t)(len[h] > 0 ? len[h] : 1));
        if (!scores[h] || !keep[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    }
    const double t0 = now_seconds();
    int reused = 0;
    if (st == KVC_OK) st = p->key_filters || p->kvzap ? filter_select(p, cfg, s, ctx, len, scores, keep, n_keep)
                           : p->head_keep    ? head_budget_select(p, cfg, s, ctx, len, scores, keep, n_keep)
                           : p->head_prune   ? kvc_lukv_select(p, cfg, s, ctx, len, scores, keep, n_keep)
                           : p->block_size ? block_select(p, cfg, s, ctx, len, scores, keep, n_keep)
                                           : choose(p, cfg, s, ctx, len, w, scores, keep, n_keep, &reused);
    p->layer_seconds[layer] = now_seconds() - t0;
    if (st == KVC_OK && cfg->record_scores && !reused) {
        const int32_t ew = w > 0 ? (w < ctx->n ? w : (int32_t)ctx->n) : 1;
        const kvc_layer_rows lr = kvc_session_layer_rows(s, layer, NULL);
        st = kvc_eviction_error(&lr, ctx, len, ew, (const int64_t *const *)keep, n_keep, &p->error[layer]);
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const size_t i = (size_t)layer * Hkv + h;
            free(p->scores[i]);
            p->scores[i] = scores[h]; /* ownership moves to the press */
            p->score_len[i] = len[h];
            scores[h] = NULL;
        }
    }
    if (st == KVC_OK && cfg->merge) { /* MergingPress: evicted values folded into the kept rows first */
        const kvc_layer_rows lr = kvc_session_layer_rows(s, layer, NULL);
        st = kvc_press_merge(&lr, cfg, len, (const int64_t *const *)keep, n_keep);
        if (st != KVC_OK) kvc_door_cache(s)->compactions++; /* kept rows may hold merged values already: no undoing the call */
    }
    if (st == KVC_OK) st = kvc_cache_compact(kvc_door_cache(s), layer, (const int64_t *const *)keep, n_keep, 0);
    if (st == KVC_OK && p->rerotate) st = kvc_press_rerotate(s, layer);
    if (st == KVC_OK && p->key_channel_ratio > 0) st = kvc_press_think(p, s, ctx);
    for (int32_t h = 0; h < Hkv; h++) {
        free(scores[h]);
        free(keep[h]);
    }
    return st;
}
