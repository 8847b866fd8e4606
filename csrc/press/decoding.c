/* Compression while decoding (kvpress DecodingPress, CompressionRatioDecodingPress; docs/METHODS.md,
 * "Compression while decoding"). kvpress counts, per layer, the forward calls after the prefill
 * ("steps"), buffers their hidden states (the last hidden_states_buffer_size calls between two
 * compressions, plus the current one), and every compression_interval steps compresses the whole layer
 * to target_size rows with the base scorer. Here the buffer holds what the scorers read of those hidden
 * states: the post-RoPE queries of the last `w` rows (w = the scorer's window; TOVA 1; 0 for scorers that
 * read no query), fetched from the backend per step, and the row counts of the buffered calls (kvpress
 * asserts the buffer is longer than the window). The compression is the prefill press's score and
 * selection (score.c, allocation.c) with budget = target, then a real compaction on the backend. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

struct kvc_decoding {
    kvc_decoding_config cfg;
    int32_t n_layers, n_kv;
    int64_t qd;          /* H * d: one query row */
    int32_t w;           /* query rows a compression reads */
    int64_t *steps;      /* [L] calls since the layer's last compression */
    int64_t *entry_rows; /* [L][ne] rows of the buffered calls (a ring of the last ne = buffer + 1) */
    int64_t ne;
    int64_t *n_entries;  /* [L] */
    int64_t *entry_head; /* [L] ring slot of the oldest entry */
    float *queries;      /* [L][w][qd] the last w query rows (a ring) */
    int64_t *q_rows;     /* [L] rows held (<= w) */
    int64_t *q_head;     /* [L] ring slot of the oldest row */
    float *window;       /* [w][qd] the rows in order, for the upload */
    kvc_buf *qbuf;       /* backend [w, qd] */
    kvc_buf *dev_scores;
    int64_t dev_ld;
    const kvc_backend *be;
    int64_t compressions;
};

void kvc_decoding_config_defaults(kvc_decoding_config *c) {
    memset(c, 0, sizeof *c);
    kvc_press_config_defaults(&c->base);
    c->compression_interval = 512;
    c->target_size = 2048;
    c->target_compression_ratio = 0.5;
    c->hidden_states_buffer_size = 256;
}

/* Query rows a compression of this scorer reads. */
static int32_t query_rows(const kvc_press_config *b) {
    return b->scorer == KVC_SCORE_TOVA ? 1 : kvc_press_window(b);
}

kvc_status kvc_decoding_config_check(const kvc_decoding_config *c) {
    if (!c) return kvc_fail(KVC_ERR_ARG, "decoding config is NULL");
    kvc_press_config b = c->base;
    b.compression_ratio = 0;
    b.budget = 0;
    KVC_TRY(kvc_press_config_check(&b));
    if (b.scorer == KVC_SCORE_OBSERVED || b.scorer == KVC_SCORE_EDIE)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "a decoding press scores with the buffered queries only: %s needs every "
                        "query's attention row (use SnapKV, TOVA, Knorm, StreamingLLM or Random as the base press)",
                        b.scorer == KVC_SCORE_OBSERVED ? "ObservedAttention" : "EDIE");
    if (b.drop_window) return kvc_fail(KVC_ERR_ARG, "drop_window does not apply to a decoding press");
    if (b.reuse_layers > 1) return kvc_fail(KVC_ERR_ARG, "layer-wise index reuse does not apply to a decoding press");
    if (b.allocation == KVC_ALLOC_LAYER)
        return kvc_fail(KVC_ERR_ARG, "per-layer totals (TADA) do not apply to a decoding press");
    if (c->compression_interval <= 0)
        return kvc_fail(KVC_ERR_ARG, "compression_interval must be greater than 0, got %lld", (long long)c->compression_interval);
    if (c->hidden_states_buffer_size < 0)
        return kvc_fail(KVC_ERR_ARG, "hidden_states_buffer_size must be >= 0, got %d", c->hidden_states_buffer_size);
    if (c->ratio_target) {
        if (!(c->target_compression_ratio >= 0 && c->target_compression_ratio < 1))
            return kvc_fail(KVC_ERR_ARG, "target_compression_ratio must be in [0, 1), got %g", c->target_compression_ratio);
    } else if (c->target_size <= 0) {
        return kvc_fail(KVC_ERR_ARG, "target_size must be greater than 0, got %lld", (long long)c->target_size);
    } else if (kvc_press_window(&b) > 0 && c->target_size < kvc_press_window(&b)) {
        return kvc_fail(KVC_ERR_ARG, "target_size (%lld) must be at least the base press's window_size (%d): the window is kept",
                        (long long)c->target_size, kvc_press_window(&b));
    }
    const int32_t w = query_rows(&b);
    const int64_t steps = (int64_t)c->hidden_states_buffer_size + 1 < c->compression_interval
                              ? (int64_t)c->hidden_states_buffer_size + 1 : c->compression_interval;
    if (w > 1 && steps <= w) /* single-token steps buffered at a compression */
        return kvc_fail(KVC_ERR_ARG, "the base press's window (%d) needs more buffered steps: raise compression_interval or "
                        "hidden_states_buffer_size above it", w);
    return KVC_OK;
}

void kvc_decoding_free(kvc_decoding *d) {
    if (!d) return;
    free(d->steps);
    free(d->entry_rows);
    free(d->n_entries);
    free(d->entry_head);
    free(d->queries);
    free(d->q_rows);
    free(d->q_head);
    free(d->window);
    if (d->qbuf) d->be->free(d->qbuf);
    if (d->dev_scores) d->be->free(d->dev_scores);
    free(d);
}

void kvc_decoding_reset(kvc_decoding *d) {
    if (!d) return;
    const size_t L = (size_t)d->n_layers;
    memset(d->steps, 0, sizeof(int64_t) * L);
    memset(d->n_entries, 0, sizeof(int64_t) * L);
    memset(d->entry_head, 0, sizeof(int64_t) * L);
    memset(d->q_rows, 0, sizeof(int64_t) * L);
    memset(d->q_head, 0, sizeof(int64_t) * L);
    d->compressions = 0;
}

int64_t kvc_decoding_count(const kvc_decoding *d) { return d ? d->compressions : 0; }

kvc_status kvc_decoding_new(const kvc_decoding_config *cfg, const kvc_config *mc, const kvc_backend *be, kvc_decoding **out) {
    *out = NULL;
    KVC_TRY(kvc_decoding_config_check(cfg));
    kvc_decoding *d = calloc(1, sizeof *d);
    if (!d) return kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press");
    d->cfg = *cfg;
    d->be = be;
    d->n_layers = mc->n_layers;
    d->n_kv = mc->n_kv_heads;
    d->qd = (int64_t)mc->n_heads * mc->head_dim;
    d->w = query_rows(&cfg->base);
    d->ne = (int64_t)cfg->hidden_states_buffer_size + 1;
    const size_t L = (size_t)d->n_layers, wq = (size_t)(d->w > 0 ? d->w : 1) * (size_t)d->qd;
    d->steps = calloc(L, sizeof(int64_t));
    d->entry_rows = calloc(L * (size_t)d->ne, sizeof(int64_t));
    d->n_entries = calloc(L, sizeof(int64_t));
    d->entry_head = calloc(L, sizeof(int64_t));
    d->q_rows = calloc(L, sizeof(int64_t));
    d->q_head = calloc(L, sizeof(int64_t));
    d->queries = d->w > 0 ? malloc(sizeof(float) * L * wq) : NULL;
    d->window = d->w > 0 ? malloc(sizeof(float) * wq) : NULL;
    kvc_status st = KVC_OK;
    if (!d->steps || !d->entry_rows || !d->n_entries || !d->entry_head || !d->q_rows || !d->q_head ||
        (d->w > 0 && (!d->queries || !d->window)))
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press");
    if (st == KVC_OK && d->w > 0) {
        kvc_backend_lock(be);
        st = be->alloc(be->act_dtype, (int64_t)d->w * d->qd, KVC_MEM_ACT, "decoding press queries", &d->qbuf);
        kvc_backend_unlock(be);
    }
    if (st != KVC_OK) {
        kvc_decoding_free(d);
        return st;
    }
    *out = d;
    return KVC_OK;
}

/* This call's rows into the layer's buffers: its row count as one entry, its last query rows. */
static kvc_status buffer_call(kvc_decoding *d, int32_t l, const kvc_layer_ctx *ctx) {
    int64_t *ring = d->entry_rows + (size_t)l * d->ne;
    if (d->n_entries[l] == d->ne) { /* drop the oldest (kvpress keeps the last buffer_size after each step) */
        d->entry_head[l] = (d->entry_head[l] + 1) % d->ne;
        d->n_entries[l]--;
    }
    ring[(d->entry_head[l] + d->n_entries[l]) % d->ne] = ctx->n;
    d->n_entries[l]++;
    if (d->w == 0) return KVC_OK;
    const int64_t take = ctx->n < d->w ? ctx->n : d->w;
    float *q = d->queries + (size_t)l * d->w * d->qd;
    for (int64_t i = 0; i < take; i++) {
        int64_t slot;
        if (d->q_rows[l] < d->w) {
            slot = (d->q_head[l] + d->q_rows[l]) % d->w;
            d->q_rows[l]++;
        } else {
            slot = d->q_head[l];
            d->q_head[l] = (d->q_head[l] + 1) % d->w;
        }
        KVC_TRY(d->be->download(kvc_view_at(ctx->q, ctx->n - take + i, 0), 1, d->qd, q + (size_t)slot * d->qd, KVC_F32));
    }
    return KVC_OK;
}

static int64_t buffered_rows(const kvc_decoding *d, int32_t l) {
    const int64_t *ring = d->entry_rows + (size_t)l * d->ne;
    int64_t r = 0;
    for (int64_t i = 0; i < d->n_entries[l]; i++) r += ring[(d->entry_head[l] + i) % d->ne];
    return r;
}

/* After a step that did not compress: kvpress trims its buffer to the last buffer_size calls. */
static void trim(kvc_decoding *d, int32_t l) {
    const int64_t keep = d->ne - 1;
    while (d->n_entries[l] > keep) {
        d->entry_head[l] = (d->entry_head[l] + 1) % d->ne;
        d->n_entries[l]--;
    }
}

static void clear_buffers(kvc_decoding *d, int32_t l) {
    d->steps[l] = 0;
    d->n_entries[l] = d->entry_head[l] = 0;
    d->q_rows[l] = d->q_head[l] = 0;
}

/* Compress layer l to `target` rows per head. */
static kvc_status compress(kvc_decoding *d, kvc_session *s, const kvc_layer_ctx *ctx, int64_t target) {
    const int32_t l = ctx->layer, Hkv = d->n_kv;
    const int64_t *len = s->cache.layers[l].len;
    int evict = 0;
    for (int32_t h = 0; h < Hkv; h++) evict |= len[h] > target;
    if (!evict) return KVC_OK; /* kvpress: ratio 0, the layer stays as it is */
    kvc_press_config cfg = d->cfg.base;
    cfg.compression_ratio = 0;
    cfg.budget = target;
    cfg.record_scores = 0;
    kvc_layer_ctx c2 = *ctx;
    const int32_t w = kvc_press_window(&cfg);
    if (d->w > 0) {
        const int64_t have = buffered_rows(d, l);
        if (d->w > 1 && have <= d->w)
            return kvc_fail(KVC_ERR_ARG, "the decoding press compresses with %lld buffered query rows, not more than the "
                            "window (%d): raise hidden_states_buffer_size or compression_interval", (long long)have, d->w);
        const float *q = d->queries + (size_t)l * d->w * d->qd;
        for (int64_t i = 0; i < d->q_rows[l]; i++)
            memcpy(d->window + (size_t)i * d->qd, q + (size_t)((d->q_head[l] + i) % d->w) * d->qd, sizeof(float) * (size_t)d->qd);
        KVC_TRY(d->be->upload(kvc_view_of(d->qbuf, 0, d->qd), d->q_rows[l], d->qd, d->window, KVC_F32));
        c2.q = kvc_view_of(d->qbuf, 0, d->qd);
        c2.n = d->q_rows[l];
    }
    for (int32_t h = 0; h < Hkv && w > 0; h++)
        if (len[h] <= w)
            return kvc_fail(KVC_ERR_ARG, "a head holds %lld rows, not more than the press window (%d)", (long long)len[h], w);
    if (cfg.scorer == KVC_SCORE_STREAMING)
        for (int32_t h = 0; h < Hkv; h++)
            if (len[h] <= cfg.n_sink)
                return kvc_fail(KVC_ERR_ARG, "StreamingLLM needs more tokens (%lld) than n_sink (%d)", (long long)len[h], cfg.n_sink);
    float *scores[KVC_MAX_KV_HEADS] = {0};
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS] = {0};
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        scores[h] = malloc(sizeof(float) * (size_t)len[h]);
        keep[h] = malloc(sizeof(int64_t) * (size_t)len[h]);
        if (!scores[h] || !keep[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press");
    }
    const kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    if (st == KVC_OK) st = kvc_press_score_select(&lr, &c2, &cfg, len, -1, &d->dev_scores, &d->dev_ld, scores, keep, n_keep);
    /* room for the steps until the next compression: the arena does not grow in between */
    if (st == KVC_OK)
        st = kvc_cache_compact(&s->cache, l, (const int64_t *const *)keep, n_keep, d->cfg.compression_interval);
    if (st == KVC_OK) d->compressions++;
    for (int32_t h = 0; h < Hkv; h++) {
        free(scores[h]);
        free(keep[h]);
    }
    return st;
}

kvc_status kvc_decoding_hook(kvc_decoding *d, kvc_session *s, const kvc_layer_ctx *ctx) {
    const int32_t l = ctx->layer;
    KVC_TRY(buffer_call(d, l, ctx));
    d->steps[l]++;
    const int64_t target = d->cfg.ratio_target
                               ? kvc_n_kept_ratio(s->pos + ctx->n, d->cfg.target_compression_ratio) /* tokens seen */
                               : d->cfg.target_size;
    if (d->steps[l] >= d->cfg.compression_interval || ctx->n >= target) {
        KVC_TRY(compress(d, s, ctx, target));
        clear_buffers(d, l);
        return KVC_OK;
    }
    trim(d, l);
    return KVC_OK;
}
