/* Every kvc_session_* function of the public API: life cycle, state, the cache, the attached press and
 * its diagnostics (computed in press/), TAKE's prefill (press/take.c), decode graphs. */
#include <stdlib.h>
#include <string.h>

#include "../press/press.h"
#include "session.h"

static int graphs_default(void) {
    const char *e = getenv("KVC_DECODE_GRAPHS");
    return e && !strcmp(e, "1");
}

kvc_status kvc_session_new(kvc_model *model, int64_t capacity_hint, kvc_session **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_session_new: out is NULL");
    *out = NULL;
    if (!model) return kvc_fail(KVC_ERR_ARG, "kvc_session_new: model is NULL");
    if (capacity_hint < 0) return kvc_fail(KVC_ERR_ARG, "capacity_hint must be >= 0");
    kvc_session *s = calloc(1, sizeof *s);
    if (!s) return kvc_fail(KVC_ERR_NOMEM, "out of memory: session");
    s->model = model;
    s->be = model->be;
    s->capacity_hint = capacity_hint;
    s->graphs = graphs_default();
    kvc_backend_lock(s->be);
    kvc_status st = kvc_cache_init(&s->cache, s->be, model->cfg.n_layers, model->cfg.n_kv_heads, model->cfg.head_dim);
    kvc_backend_unlock(s->be);
    if (st != KVC_OK) {
        free(s);
        return st;
    }
    *out = s;
    return KVC_OK;
}

void kvc_session_free(kvc_session *s) {
    if (!s) return;
    kvc_backend_lock(s->be);
    kvc_press_free(s->press);
    kvc_decoding_free(s->decoding);
    if (s->graph) s->be->graph_free(s->graph);
    kvc_act_free(s);
    kvc_cache_free(&s->cache);
    kvc_backend_unlock(s->be);
    free(s->positions);
    free(s->win);
    free(s);
}

void kvc_session_reset(kvc_session *s) {
    if (!s) return;
    kvc_backend_lock(s->be);
    kvc_status st = kvc_cache_clear(&s->cache);
    kvc_backend_unlock(s->be);
    s->press_seconds = 0.0;
    s->pos = 0;
    kvc_decoding_reset(s->decoding);
    /* A clear that stopped partway leaves rows behind: the next forward must refuse, not attend to them. */
    s->needs_reset = st != KVC_OK;
}

int64_t kvc_session_position(const kvc_session *s) { return s ? s->pos : 0; }

kvc_status kvc_session_set_position(kvc_session *s, int64_t position) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (position < 0) return kvc_fail(KVC_ERR_ARG, "position must be >= 0, got %lld", (long long)position);
    s->pos = position;
    return KVC_OK;
}

int64_t kvc_session_cache_len(const kvc_session *s, int32_t layer, int32_t h) {
    if (!s || layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv) return -1;
    return s->cache.layers[layer].len[h];
}

double kvc_session_press_seconds(const kvc_session *s) { return s ? s->press_seconds : 0.0; }
size_t kvc_session_cache_bytes(const kvc_session *s) { return s ? s->cache.bytes : 0; }
size_t kvc_session_peak_cache_bytes(const kvc_session *s) { return s ? s->cache.peak_bytes : 0; }

kvc_status kvc_session_truncate(kvc_session *s, const int64_t *new_len, int64_t position) {
    if (!s || !new_len) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (position < 0) return kvc_fail(KVC_ERR_ARG, "position must be >= 0");
    const int32_t Hkv = s->cache.n_kv;
    for (int32_t l = 0; l < s->cache.n_layers; l++)
        for (int32_t h = 0; h < Hkv; h++)
            if (new_len[l * Hkv + h] < 0 || new_len[l * Hkv + h] > s->cache.layers[l].len[h])
                return kvc_fail(KVC_ERR_ARG, "layer %d head %d holds %lld tokens: cannot truncate to %lld", l, h,
                                (long long)s->cache.layers[l].len[h], (long long)new_len[l * Hkv + h]);
    kvc_backend_lock(s->be);
    kvc_status st = KVC_OK;
    for (int32_t l = 0; l < s->cache.n_layers && st == KVC_OK; l++) st = kvc_cache_truncate(&s->cache, l, new_len + l * Hkv);
    kvc_backend_unlock(s->be);
    if (st == KVC_OK) s->pos = position;
    return st;
}

kvc_status kvc_session_cache_positions(const kvc_session *s, int32_t layer, int32_t h, int64_t *out) {
    if (!s || !out) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    const kvc_layer_cache *L = &s->cache.layers[layer];
    if (L->len[h] > 0) memcpy(out, L->pos[h], sizeof(int64_t) * (size_t)L->len[h]);
    return KVC_OK;
}

kvc_status kvc_session_cache_rows(const kvc_session *s, int32_t layer, int32_t h, float *k, float *v) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    const kvc_layer_cache *L = &s->cache.layers[layer];
    if (L->len[h] == 0 || (!k && !v)) return KVC_OK;
    kvc_backend_lock(s->be);
    kvc_status st = s->be->kv_read(L->kv, h, 0, L->len[h], k, v);
    kvc_backend_unlock(s->be);
    return st;
}

kvc_status kvc_session_copy_cache(kvc_session *dst, const kvc_session *src) {
    if (!dst || !src) return kvc_fail(KVC_ERR_ARG, "kvc_session_copy_cache: session is NULL");
    if (dst == src) return kvc_fail(KVC_ERR_ARG, "copying a session's cache onto itself");
    if (dst->model != src->model) return kvc_fail(KVC_ERR_ARG, "the two sessions belong to different models");
    if (src->needs_reset) return kvc_fail(KVC_ERR_ARG, "the source session failed a call: reset() it first");
    if (dst->needs_reset || dst->pos != 0 || !kvc_cache_is_empty(&dst->cache))
        return kvc_fail(KVC_ERR_ARG, "the destination session is not empty: call reset() on it first");
    kvc_backend_lock(dst->be);
    kvc_status st = kvc_cache_copy(&dst->cache, &src->cache);
    kvc_backend_unlock(dst->be);
    if (st == KVC_OK) dst->pos = src->pos;
    return st;
}

/* ---- the attached press ---- */

kvc_status kvc_session_set_press(kvc_session *s, const kvc_press_config *cfg) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    kvc_press *p = NULL;
    if (cfg) KVC_TRY(kvc_press_new(cfg, &s->model->cfg, s->be, &p));
    kvc_backend_lock(s->be);
    kvc_press_free(s->press);
    kvc_backend_unlock(s->be);
    s->press = p;
    s->hook = p ? kvc_press_hook : NULL;
    s->hook_user = p;
    return KVC_OK;
}

/* The press the wrapper settings apply to: the last one of the chain (ComposedPress adds a member, then sets it). */
static kvc_status last_press(kvc_session *s, kvc_press **out) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (!s->press) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session (set_press first)");
    kvc_press *p = s->press;
    while (p->next) p = p->next;
    *out = p;
    return KVC_OK;
}

kvc_status kvc_session_add_press(kvc_session *s, const kvc_press_config *cfg) {
    if (!s || !cfg) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (!s->press) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session (set_press first): add_press chains after it");
    if (kvc_scorer_has(cfg->scorer, KVC_SCORER_FIRST_ONLY))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "%s cannot follow another press: it reads the attention rows of "
                        "the uncompressed layer (put it first)", kvc_scorer_title(cfg->scorer));
    kvc_press *p = NULL;
    KVC_TRY(kvc_press_new(cfg, &s->model->cfg, s->be, &p));
    kvc_press *last = s->press;
    while (last->next) last = last->next;
    last->next = p;
    return KVC_OK;
}

kvc_status kvc_session_set_layer_ratios(kvc_session *s, const double *ratios, int32_t n_layers) {
    kvc_press *p = NULL;
    if (!ratios) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(last_press(s, &p));
    return kvc_press_set_layer_ratios(p, ratios, n_layers);
}

kvc_status kvc_session_set_key_rerotation(kvc_session *s, int32_t on) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (!s->press) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session (set_press first)");
    if (on && s->press->next) return kvc_fail(KVC_ERR_ARG, "key re-rotation applies to a single press, not a chain");
    s->press->rerotate = on != 0;
    return KVC_OK;
}

kvc_status kvc_session_set_head_budgets(kvc_session *s, const int64_t *keep, int64_t n) {
    kvc_press *p = NULL;
    if (!keep) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(last_press(s, &p));
    return kvc_press_set_head_budgets(p, keep, n);
}

kvc_status kvc_session_set_block_size(kvc_session *s, int64_t block_size) {
    kvc_press *p = NULL;
    KVC_TRY(last_press(s, &p));
    return kvc_press_set_block_size(p, block_size);
}

kvc_status kvc_session_set_key_filters(kvc_session *s, const float *filters, int64_t n) {
    kvc_press *p = NULL;
    if (!filters) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(last_press(s, &p));
    return kvc_press_set_key_filters(p, filters, n, s->model->cfg.head_dim);
}

kvc_status kvc_session_set_kvzap(kvc_session *s, int32_t hidden_dim, const float *w1, const float *b1, const float *w2,
                                 const float *b2) {
    kvc_press *p = NULL;
    KVC_TRY(last_press(s, &p));
    if (p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.chunk_length > 0 || p->head_keep || p->block_size || p->key_filters ||
        p->head_prune || p->fastkvzip)
        return kvc_fail(KVC_ERR_ARG, "KVzap scores with uniform top-k per head: use it with a plain budget");
    kvc_kvzap *z = NULL;
    KVC_TRY(kvc_kvzap_new(&s->model->cfg, hidden_dim, w1, b1, w2, b2, &z));
    kvc_kvzap_free(p->kvzap);
    p->kvzap = z;
    return KVC_OK;
}

kvc_status kvc_session_set_query_stats(kvc_session *s, const float *mean, const float *cov, int64_t n_mean, int64_t n_cov) {
    kvc_press *p = NULL;
    if (!mean || !cov) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(last_press(s, &p));
    return kvc_press_set_query_stats(p, mean, cov, n_mean, n_cov, s->model->cfg.n_heads, s->model->cfg.head_dim);
}

kvc_status kvc_session_set_decoding_query_stats(kvc_session *s, const float *mean, const float *cov, int64_t n_mean,
                                                int64_t n_cov) {
    if (!s || !mean || !cov) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (!s->decoding) return kvc_fail(KVC_ERR_ARG, "no decoding press is attached to this session (set_decoding_press first)");
    return kvc_decoding_set_query_stats(s->decoding, mean, cov, n_mean, n_cov, s->model->cfg.n_heads, s->model->cfg.head_dim);
}

kvc_status kvc_session_set_head_ratios(kvc_session *s, const float *prune, int64_t n, int32_t sink, int32_t window) {
    kvc_press *p = NULL;
    if (!prune) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(last_press(s, &p));
    return kvc_press_set_head_ratios(p, prune, n, sink, window);
}

kvc_status kvc_session_set_fastkvzip(kvc_session *s, const kvc_fastkvzip_config *cfg) {
    kvc_press *p = NULL;
    if (!cfg) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(last_press(s, &p));
    if (s->press->next) /* its eviction ranks every layer's full rows at once */
        return kvc_fail(KVC_ERR_ARG, "FastKVzip evicts over all layers at once after scoring them: use it alone, not in a chain");
    if (p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.chunk_length > 0 || p->cfg.budget > 0 || p->head_keep ||
        p->head_prune || p->block_size || p->key_filters || p->kvzap)
        return kvc_fail(KVC_ERR_ARG, "FastKVzip makes its own global selection from a compression_ratio: attach a plain press");
    kvc_fastkvzip *z = NULL;
    KVC_TRY(kvc_fastkvzip_new(&s->model->cfg, cfg, &z));
    kvc_fastkvzip_free(p->fastkvzip);
    p->fastkvzip = z;
    return KVC_OK;
}

kvc_status kvc_session_set_key_channels(kvc_session *s, double ratio, int32_t window, int32_t free_channels) {
    kvc_press *p = NULL;
    KVC_TRY(last_press(s, &p));
    if (!(ratio >= 0 && ratio < 1)) return kvc_fail(KVC_ERR_ARG, "key_channel_compression_ratio must be in [0, 1), got %g", ratio);
    if (window < 1) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 1, got %d", window);
    p->key_channel_ratio = ratio;
    p->channel_window = window;
    p->channel_free = free_channels != 0;
    return KVC_OK;
}

kvc_status kvc_session_set_decoding_press(kvc_session *s, const kvc_decoding_config *cfg) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    kvc_decoding *d = NULL;
    if (cfg) KVC_TRY(kvc_decoding_new(cfg, &s->model->cfg, s->be, &d));
    kvc_backend_lock(s->be);
    kvc_decoding_free(s->decoding);
    kvc_backend_unlock(s->be);
    s->decoding = d;
    return KVC_OK;
}

int64_t kvc_session_decoding_compressions(const kvc_session *s) { return s ? kvc_decoding_count(s->decoding) : 0; }

static kvc_status attached(const kvc_session *s, const kvc_press **p) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (!s->press) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session (set_press first)");
    *p = s->press;
    return KVC_OK;
}

kvc_status kvc_session_press_scores(const kvc_session *s, int32_t layer, int32_t h, float *out, int64_t *n) {
    const kvc_press *p = NULL;
    if (!n) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(attached(s, &p));
    return kvc_press_recorded_scores(p, layer, h, out, n);
}

kvc_status kvc_session_press_error(const kvc_session *s, int32_t layer, double *out) {
    const kvc_press *p = NULL;
    if (!out) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(attached(s, &p));
    if (layer < 0 || layer >= p->n_layers) return kvc_fail(KVC_ERR_ARG, "layer %d out of range", layer);
    *out = p->error[layer];
    return KVC_OK;
}

kvc_status kvc_session_set_layer_budgets(kvc_session *s, const int64_t *totals, int32_t n_layers) {
    const kvc_press *p = NULL;
    if (!totals) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(attached(s, &p));
    return kvc_press_set_layer_totals(s->press, totals, n_layers);
}

kvc_status kvc_session_press_layer_stats(const kvc_session *s, int32_t layer, double *e_internal, double *dissimilarity) {
    const kvc_press *p = NULL;
    if (!e_internal || !dissimilarity) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(attached(s, &p));
    if (layer < 0 || layer >= p->n_layers) return kvc_fail(KVC_ERR_ARG, "layer %d out of range", layer);
    *e_internal = p->e_internal[layer];
    *dissimilarity = p->dissim[layer];
    return KVC_OK;
}

kvc_status kvc_session_prefill_take(kvc_session *s, const int32_t *ids, int64_t n, const kvc_take_config *cfg,
                                    float *logits) {
    if (!s || !ids || !cfg) return kvc_fail(KVC_ERR_ARG, "prefill_take: null argument");
    return kvc_take_prefill(s, ids, n, cfg, logits);
}

/* ---- KVzip (press/kvzip.c) ---- */

kvc_status kvc_session_kvzip_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                                   int32_t n_sink, int32_t plus, float *scores) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_score: null session");
    return kvc_kvzip_score(s, ids, q_len, start, end, n_sink, plus, scores);
}

kvc_status kvc_session_kvzip_evict(kvc_session *s, const float *scores, double compression_ratio, int32_t layerwise,
                                   int32_t n_sink) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_evict: null session");
    if (!(compression_ratio >= 0 && compression_ratio < 1))
        return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1), got %g", compression_ratio);
    return kvc_kvzip_evict(s, scores, s->pos, compression_ratio, layerwise, n_sink);
}

kvc_status kvc_session_kvzip_evict_prefix(kvc_session *s, const float *scores, int64_t n_ctx, double compression_ratio,
                                          int32_t layerwise, int32_t n_sink) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_evict: null session");
    return kvc_kvzip_evict(s, scores, n_ctx, compression_ratio, layerwise, n_sink);
}

/* ---- KVgrad (press/kvgrad.c), rows from embeddings (press/restorekv.c) ---- */

kvc_status kvc_session_kvgrad_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                                    int32_t n_sink, float *scores, float *grad_norms) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvgrad_score: null session");
    return kvc_kvgrad_score(s, ids, q_len, start, end, n_sink, scores, grad_norms);
}

kvc_status kvc_session_append_embeddings(kvc_session *s, const float *emb, int64_t n, const kvc_lora *lora) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "append_embeddings: null session");
    return kvc_append_embeddings(s, emb, n, lora);
}

/* ---- decode graphs ---- */

kvc_status kvc_session_set_decode_graphs(kvc_session *s, int32_t on) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (on && !s->be->graph_capture)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "the %s backend has no graphs: decode steps run one kernel at a time",
                        s->be->name);
    s->graphs = on != 0;
    if (on) s->graph_error[0] = '\0';
    return KVC_OK;
}

kvc_status kvc_session_graph_info(const kvc_session *s, int32_t *on, int64_t *graph_steps, const char **error) {
    if (!s || !on || !graph_steps || !error) return kvc_fail(KVC_ERR_ARG, "null argument");
    *on = s->graphs;
    *graph_steps = s->graph_steps;
    *error = s->graph_error;
    return KVC_OK;
}
