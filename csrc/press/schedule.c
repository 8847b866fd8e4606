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
    kvc_press_parts_free(p);
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
    p->n_heads = mc->n_heads;
    p->head_dim = mc->head_dim;
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
    const kvc_status st = kvc_press_parts_wanted(p); /* the parts a setting turns on (DMSPress) */
    if (st != KVC_OK) {
        kvc_press_free(p);
        return st;
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

/* The parts' after_compact hooks in rank order (key rerotation, ThinK's channels); only those that act on a
 * layer that evicted nothing when `evicted` is 0. */
static kvc_status after_compact(kvc_press *p, kvc_session *s, const kvc_layer_ctx *ctx, int evicted) {
    KVC_FOR_PARTS(p, row, state)
        if (row->after_compact && (evicted || (row->traits & KVC_PART_WITHOUT_EVICTION)))
            KVC_TRY(row->after_compact(p, state, s, ctx));
    return KVC_OK;
}

static kvc_status press_layer(kvc_press *p, kvc_session *s, const kvc_layer_ctx *ctx) {
    kvc_press_config layer_cfg = p->cfg;
    kvc_part_select_fn select = NULL;
    void *select_state = NULL;
    KVC_FOR_PARTS(p, row, state) {
        if (row->layer_config) row->layer_config(state, ctx->layer, &layer_cfg); /* PerLayerCompressionPress */
        if (row->take_layer) return row->take_layer(p, state, s, ctx);          /* DMSPress, FastKVzip */
        if (row->select) {
            select = row->select;
            select_state = state;
        }
    }
    const kvc_press_config *cfg = &layer_cfg;
    if (cfg->reuse_layers > 1 && ctx->layer % cfg->reuse_layers == 0) p->reuse_len = 0; /* a new group */
    if (cfg->budget == 0 && cfg->compression_ratio == 0 && !kvc_press_parts_have(p, KVC_PART_NEEDS_NO_BUDGET) &&
        !kvc_press_decides_own_budget(cfg))
        return after_compact(p, s, ctx, 0);
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
    if (st == KVC_OK)
        st = select ? select(p, select_state, cfg, s, ctx, len, scores, keep, n_keep)
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
    if (st == KVC_OK) st = after_compact(p, s, ctx, 1);
    for (int32_t h = 0; h < Hkv; h++) {
        free(scores[h]);
        free(keep[h]);
    }
    return st;
}
