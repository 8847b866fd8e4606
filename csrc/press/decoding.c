/* Compression while decoding (kvpress DecodingPress, CompressionRatioDecodingPress; docs/METHODS.md,
 * "Compression while decoding"). kvpress counts, per layer, the forward calls after the prefill
 * ("steps"), buffers their hidden states (the last hidden_states_buffer_size calls between two
 * compressions, plus the current one), and every compression_interval steps compresses the whole layer
 * to target_size rows with the base scorer. Here the buffer holds what the scorers read of those hidden
 * states: the post-RoPE queries of the last `w` rows (w = the scorer's window; TOVA 1; 0 for scorers that
 * read no query), fetched from the backend per step, and the row counts of the buffered calls (kvpress
 * asserts the buffer is longer than the window). The compression is the prefill press's score and
 * selection (score.c, allocation.c) with budget = target, then a real compaction on the backend.
 * ExpectedAttention reads every buffered row (its query statistics; kvpress drops the buffer's first n_sink rows
 * and averages RoPE over the positions that follow the buffer's length), so it buffers them all with their
 * positions; ExpectedAttentionStatsPress takes given statistics instead. */
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
    /* CAMPress: per layer, the cumulative attention of each step's last query [Hkv][cap] over the rows held */
    float **cam_attn;     /* [L] */
    int64_t *cam_cap;     /* [L] rows allocated per head */
    int64_t *cam_rows;    /* [L] rows tracked (every head holds the same) */
    int64_t *cam_events;  /* [L] merging compressions so far (the Bernoulli stream) */
    float **cam_k;        /* [L] the layer's keys on the host [Hkv][cam_cap][head_dim]: each step reads only its new rows */
    int64_t *cam_krows;   /* [L] rows of cam_k that hold the store's keys */
    kvc_dms *dms;         /* DMSPress(decoding=True): base.dms; its own schedule (dms.c) */
    /* ExpectedAttention: every buffered row's post-RoPE query and position, a ring per layer */
    float **rq;           /* [L] [rq_cap][qd] */
    int64_t **rpos;       /* [L] [rq_cap] */
    int64_t *rq_n, *rq_head, *rq_cap;
    float *rq_host;       /* [rq_max][qd] the rows in order, for the upload */
    int64_t *rq_pos;      /* [rq_max] their positions */
    int64_t rq_max;       /* rows qbuf, rq_host and rq_pos hold */
    float *q_mean, *q_cov; /* ExpectedAttentionStats: given statistics [L, H, d], [L, H, d, d], or NULL */
};

/* Whether the base scorer reads every buffered row (ExpectedAttention's query statistics). */
static int reads_all_rows(const kvc_press_config *b) { return kvc_scorer_has(b->scorer, KVC_SCORER_QUERY_STATS); }

void kvc_decoding_config_defaults(kvc_decoding_config *c) {
    memset(c, 0, sizeof *c);
    kvc_press_config_defaults(&c->base);
    c->compression_interval = 512;
    c->target_size = 2048;
    c->target_compression_ratio = 0.5;
    c->hidden_states_buffer_size = 256;
}

kvc_status kvc_decoding_config_new(kvc_decoding_config **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (!(*out = malloc(sizeof **out))) return kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press settings");
    kvc_decoding_config_defaults(*out);
    return KVC_OK;
}

void kvc_decoding_config_free(kvc_decoding_config *c) { free(c); }

/* Query rows a compression of this scorer reads. */
static int32_t query_rows(const kvc_press_config *b) {
    if (reads_all_rows(b)) return 0; /* its own buffer of every row */
    return kvc_scorer_query_rows(b);
}

kvc_status kvc_decoding_config_check(const kvc_decoding_config *c) {
    if (!c) return kvc_fail(KVC_ERR_ARG, "decoding config is NULL");
    if (c->base.dms) { /* DMSPress's decoding part: the threshold and window of its base decide, nothing else */
        KVC_TRY(kvc_press_config_check(&c->base));
        char which[256];
        if (kvc_scorer_has(c->base.scorer, KVC_SCORER_FIRST_ONLY | KVC_SCORER_READS_ATTN))
            return kvc_fail(KVC_ERR_UNSUPPORTED, "DMSPress while decoding scores each call's rows from its queries: wrap a "
                            "scorer press other than %s",
                            kvc_scorer_titles(KVC_SCORER_FIRST_ONLY | KVC_SCORER_READS_ATTN, which, sizeof which));
        if (c->cam_merge_budget > 0 || c->ratio_target) return kvc_fail(KVC_ERR_ARG, "DMSPress is neither CAMPress nor a ratio target");
        return KVC_OK;
    }
    kvc_press_config b = c->base;
    b.compression_ratio = 0;
    b.budget = 0;
    KVC_TRY(kvc_press_config_check(&b));
    if (kvc_scorer_has(b.scorer, KVC_SCORER_FIRST_ONLY | KVC_SCORER_READS_ATTN))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "a decoding press scores with the buffered queries only: %s needs every "
                        "query's attention row (use SnapKV, TOVA, Knorm, StreamingLLM or Random as the base press)",
                        kvc_scorer_title(b.scorer));
    if (b.drop_window) return kvc_fail(KVC_ERR_ARG, "drop_window does not apply to a decoding press");
    if (c->cam_merge_budget < 0) return kvc_fail(KVC_ERR_ARG, "merge_budget must be positive, got %d", c->cam_merge_budget);
    if (c->cam_merge_budget > 0) {
        if (c->ratio_target) return kvc_fail(KVC_ERR_ARG, "CAMPress compresses to target_size, not to a compression ratio");
        if (b.allocation != KVC_ALLOC_UNIFORM || b.chunk_length > 0 || b.critical || b.merge)
            return kvc_fail(KVC_ERR_ARG, "CAMPress ranks rows by its base press's scores averaged over heads: use a plain scorer "
                            "press as base_press (no Ada-KV, chunks, CriticalKV or MergingPress)");
    }
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
    if (d->cam_attn)
        for (int32_t l = 0; l < d->n_layers; l++) free(d->cam_attn[l]);
    if (d->cam_k)
        for (int32_t l = 0; l < d->n_layers; l++) free(d->cam_k[l]);
    free(d->cam_attn);
    free(d->cam_k);
    free(d->cam_krows);
    free(d->cam_cap);
    free(d->cam_rows);
    free(d->cam_events);
    kvc_dms_free(d->dms);
    for (int32_t l = 0; d->rq && l < d->n_layers; l++) {
        free(d->rq[l]);
        free(d->rpos[l]);
    }
    free(d->rq);
    free(d->rpos);
    free(d->rq_n);
    free(d->rq_head);
    free(d->rq_cap);
    free(d->rq_host);
    free(d->rq_pos);
    free(d->q_mean);
    free(d->q_cov);
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
    if (d->cam_rows) memset(d->cam_rows, 0, sizeof(int64_t) * L);
    if (d->cam_krows) memset(d->cam_krows, 0, sizeof(int64_t) * L);
    if (d->cam_events) memset(d->cam_events, 0, sizeof(int64_t) * L);
    kvc_dms_reset(d->dms);
    if (d->rq) {
        memset(d->rq_n, 0, sizeof(int64_t) * L);
        memset(d->rq_head, 0, sizeof(int64_t) * L);
    }
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
    if (cfg->cam_merge_budget > 0) {
        d->cam_attn = calloc(L, sizeof(float *));
        d->cam_cap = calloc(L, sizeof(int64_t));
        d->cam_rows = calloc(L, sizeof(int64_t));
        d->cam_events = calloc(L, sizeof(int64_t));
        d->cam_k = calloc(L, sizeof(float *));
        d->cam_krows = calloc(L, sizeof(int64_t));
    }
    if (reads_all_rows(&cfg->base)) {
        d->rq = calloc(L, sizeof(float *));
        d->rpos = calloc(L, sizeof(int64_t *));
        d->rq_n = calloc(L, sizeof(int64_t));
        d->rq_head = calloc(L, sizeof(int64_t));
        d->rq_cap = calloc(L, sizeof(int64_t));
    }
    kvc_status st = KVC_OK;
    if ((reads_all_rows(&cfg->base) && (!d->rq || !d->rpos || !d->rq_n || !d->rq_head || !d->rq_cap)) ||
        !d->steps || !d->entry_rows || !d->n_entries || !d->entry_head || !d->q_rows || !d->q_head ||
        (d->w > 0 && (!d->queries || !d->window)) ||
        (cfg->cam_merge_budget > 0 && (!d->cam_attn || !d->cam_cap || !d->cam_rows || !d->cam_events || !d->cam_k || !d->cam_krows)))
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press");
    if (st == KVC_OK && cfg->base.dms) st = kvc_dms_new(&cfg->base, mc, be, &d->dms);
    if (st == KVC_OK && d->w > 0 && !cfg->base.dms) {
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

/* ExpectedAttention's ring of layer l grown to `need` rows (the rows re-laid from slot 0). */
static kvc_status rows_reserve(kvc_decoding *d, int32_t l, int64_t need) {
    if (need <= d->rq_cap[l]) return KVC_OK;
    int64_t cap = d->rq_cap[l] > 0 ? d->rq_cap[l] : 16;
    while (cap < need) cap *= 2;
    float *q = malloc(sizeof(float) * (size_t)cap * (size_t)d->qd);
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)cap);
    if (!q || !pos) {
        free(q);
        free(pos);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press queries");
    }
    for (int64_t i = 0; i < d->rq_n[l]; i++) {
        const int64_t src = (d->rq_head[l] + i) % d->rq_cap[l];
        memcpy(q + (size_t)i * d->qd, d->rq[l] + (size_t)src * d->qd, sizeof(float) * (size_t)d->qd);
        pos[i] = d->rpos[l][src];
    }
    free(d->rq[l]);
    free(d->rpos[l]);
    d->rq[l] = q;
    d->rpos[l] = pos;
    d->rq_cap[l] = cap;
    d->rq_head[l] = 0;
    return KVC_OK;
}

/* The oldest k buffered rows of layer l leave with their call (ExpectedAttention). */
static void rows_drop(kvc_decoding *d, int32_t l, int64_t k) {
    if (!d->rq) return;
    k = k < d->rq_n[l] ? k : d->rq_n[l];
    if (d->rq_cap[l] > 0) d->rq_head[l] = (d->rq_head[l] + k) % d->rq_cap[l];
    d->rq_n[l] -= k;
}

static kvc_status rows_append(kvc_decoding *d, int32_t l, const kvc_layer_ctx *ctx) {
    KVC_TRY(rows_reserve(d, l, d->rq_n[l] + ctx->n));
    for (int64_t i = 0; i < ctx->n; i++) {
        const int64_t slot = (d->rq_head[l] + d->rq_n[l]) % d->rq_cap[l];
        KVC_TRY(d->be->download(kvc_view_at(ctx->q, i, 0), 1, d->qd, d->rq[l] + (size_t)slot * d->qd, KVC_F32));
        d->rpos[l][slot] = ctx->pos ? ctx->pos[i] : ctx->past_len[0] + i;
        d->rq_n[l]++;
    }
    return KVC_OK;
}

/* This call's rows into the layer's buffers: its row count as one entry, its last query rows. */
static kvc_status buffer_call(kvc_decoding *d, int32_t l, const kvc_layer_ctx *ctx) {
    int64_t *ring = d->entry_rows + (size_t)l * d->ne;
    if (d->n_entries[l] == d->ne) { /* drop the oldest (kvpress keeps the last buffer_size after each step) */
        rows_drop(d, l, ring[d->entry_head[l]]);
        d->entry_head[l] = (d->entry_head[l] + 1) % d->ne;
        d->n_entries[l]--;
    }
    ring[(d->entry_head[l] + d->n_entries[l]) % d->ne] = ctx->n;
    d->n_entries[l]++;
    if (d->rq && !d->q_mean) return rows_append(d, l, ctx);
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
        rows_drop(d, l, d->entry_rows[(size_t)l * d->ne + d->entry_head[l]]);
        d->entry_head[l] = (d->entry_head[l] + 1) % d->ne;
        d->n_entries[l]--;
    }
}

static void clear_buffers(kvc_decoding *d, int32_t l) {
    d->steps[l] = 0;
    d->n_entries[l] = d->entry_head[l] = 0;
    d->q_rows[l] = d->q_head[l] = 0;
    if (d->rq) d->rq_n[l] = d->rq_head[l] = 0;
}

kvc_status kvc_decoding_set_query_stats(kvc_decoding *d, const float *mean, const float *cov, int64_t n_mean,
                                        int64_t n_cov, int32_t H, int32_t hd) {
    if (!reads_all_rows(&d->cfg.base))
        return kvc_fail(KVC_ERR_ARG, "query statistics are ExpectedAttention's: the decoding press's base is another scorer");
    return kvc_query_stats_set(d->n_layers, H, hd, mean, cov, n_mean, n_cov, &d->q_mean, &d->q_cov);
}

/* ExpectedAttention's view of the buffer: every buffered row's query and position uploaded in order (none with given
 * statistics), the future positions from the buffer's length as kvpress counts them. */
static kvc_status all_rows_ctx(kvc_decoding *d, int32_t l, kvc_layer_ctx *c2, int64_t *future_from) {
    const int64_t n = buffered_rows(d, l);
    *future_from = n;
    if (d->q_mean) return KVC_OK; /* the scorer reads no query */
    if (d->rq_n[l] != n)
        return kvc_fail(KVC_ERR_INTERNAL, "decoding press: %lld buffered query rows for %lld buffered rows",
                        (long long)d->rq_n[l], (long long)n);
    if (n > d->rq_max) {
        float *h = malloc(sizeof(float) * (size_t)n * (size_t)d->qd);
        int64_t *p = malloc(sizeof(int64_t) * (size_t)n);
        kvc_buf *b = NULL;
        kvc_status st = h && p ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press queries");
        if (st == KVC_OK) {
            kvc_backend_lock(d->be);
            st = d->be->alloc(d->be->act_dtype, n * d->qd, KVC_MEM_ACT, "decoding press queries", &b);
            kvc_backend_unlock(d->be);
        }
        if (st != KVC_OK) {
            free(h);
            free(p);
            return st;
        }
        free(d->rq_host);
        free(d->rq_pos);
        if (d->qbuf) d->be->free(d->qbuf);
        d->rq_host = h;
        d->rq_pos = p;
        d->qbuf = b;
        d->rq_max = n;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t src = (d->rq_head[l] + i) % d->rq_cap[l];
        memcpy(d->rq_host + (size_t)i * d->qd, d->rq[l] + (size_t)src * d->qd, sizeof(float) * (size_t)d->qd);
        d->rq_pos[i] = d->rpos[l][src];
    }
    KVC_TRY(d->be->upload(kvc_view_of(d->qbuf, 0, d->qd), n, d->qd, d->rq_host, KVC_F32));
    c2->q = kvc_view_of(d->qbuf, 0, d->qd);
    c2->n = n;
    c2->pos = d->rq_pos;
    return KVC_OK;
}

/* ---- CAMPress (kvpress CAMPress; CaM, "CaM: Cache Merging for Memory-efficient LLMs Inference") ---- */

/* Every head of a CAM layer holds the same rows: one selection is shared. */
static kvc_status cam_rows(kvc_session *s, int32_t l, int64_t *n) {
    const int64_t *len = kvc_door_cache(s)->layers[l].len;
    for (int32_t h = 1; h < kvc_door_cache(s)->n_kv; h++)
        if (len[h] != len[0])
            return kvc_fail(KVC_ERR_UNSUPPORTED, "CAMPress shares one selection across a layer's KV heads: they must hold "
                            "the same number of rows (layer %d holds %lld and %lld)", l, (long long)len[0], (long long)len[h]);
    *n = len[0];
    return KVC_OK;
}

/* This step's last query's attention (softmax over every row held, 1/sqrt(d) scaled, averaged over the group's
 * query heads) added to the layer's cumulative attention; rows appended since the last step start at zero. */
static kvc_status cam_accumulate(kvc_decoding *d, kvc_session *s, const kvc_layer_ctx *ctx) {
    const int32_t l = ctx->layer, Hkv = d->n_kv;
    const kvc_config *mc = &kvc_door_model(s)->cfg;
    const int32_t dh = mc->head_dim, g = mc->n_heads / Hkv;
    int64_t n = 0;
    KVC_TRY(cam_rows(s, l, &n));
    if (n < d->cam_rows[l]) /* rows dropped outside CaM's own merges (a truncation): the sums no longer match */
        return kvc_fail(KVC_ERR_ARG, "CAMPress: layer %d holds %lld rows, fewer than the %lld its attention sums "
                        "cover (the cache was truncated under the press); start a new session", l, (long long)n,
                        (long long)d->cam_rows[l]);
    if (n > d->cam_cap[l]) {
        const int64_t cap = n + d->cfg.compression_interval;
        float *a = calloc((size_t)(Hkv * cap), sizeof(float)), *kh = malloc(sizeof(float) * (size_t)(Hkv * cap * dh));
        if (!a || !kh) {
            free(a); free(kh);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: CAMPress attention sums");
        }
        for (int32_t h = 0; h < Hkv && d->cam_attn[l]; h++) {
            memcpy(a + (size_t)h * cap, d->cam_attn[l] + (size_t)h * d->cam_cap[l], sizeof(float) * (size_t)d->cam_rows[l]);
            memcpy(kh + (size_t)(h * cap * dh), d->cam_k[l] + (size_t)(h * d->cam_cap[l] * dh),
                   sizeof(float) * (size_t)(d->cam_krows[l] * dh));
        }
        free(d->cam_attn[l]);
        free(d->cam_k[l]);
        d->cam_attn[l] = a;
        d->cam_k[l] = kh;
        d->cam_cap[l] = cap;
    }
    for (int32_t h = 0; h < Hkv; h++) /* rows new since the last step */
        memset(d->cam_attn[l] + (size_t)h * d->cam_cap[l] + d->cam_rows[l], 0, sizeof(float) * (size_t)(n - d->cam_rows[l]));
    d->cam_rows[l] = n;
    /* The keys held before this call were read at earlier steps (CaM merges values only, and cam_prune follows each
     * compaction): this call's rows, appended since, come down in one batched read, not the whole layer. A row a
     * failed call appended and rolled back is this call's again, so it is read again. */
    int64_t from = d->cam_krows[l] < n - ctx->n ? d->cam_krows[l] : n - ctx->n, row0[KVC_MAX_KV_HEADS], rows[KVC_MAX_KV_HEADS];
    from = from > 0 ? from : 0;
    for (int32_t h = 0; h < Hkv; h++) {
        row0[h] = from;
        rows[h] = n - from;
    }
    float *q = malloc(sizeof(float) * (size_t)d->qd), *fresh = malloc(sizeof(float) * (size_t)(Hkv * (n - from) * dh + 1));
    double *lg = malloc(sizeof(double) * (size_t)n);
    kvc_status st = q && fresh && lg ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CAMPress attention");
    if (st == KVC_OK) st = d->be->download(kvc_view_at(ctx->q, ctx->n - 1, 0), 1, d->qd, q, KVC_F32);
    if (st == KVC_OK && n > from) st = d->be->kv_read_heads(kvc_door_cache(s)->layers[l].kv, row0, rows, fresh, NULL);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        memcpy(d->cam_k[l] + (size_t)((h * d->cam_cap[l] + from) * dh), fresh + (size_t)(h * (n - from) * dh),
               sizeof(float) * (size_t)((n - from) * dh));
    d->cam_krows[l] = st == KVC_OK ? n : from;
    const double scale = 1.0 / sqrt((double)dh);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const float *k = d->cam_k[l] + (size_t)(h * d->cam_cap[l] * dh);
        float *sum = d->cam_attn[l] + (size_t)h * d->cam_cap[l];
        for (int32_t j = 0; j < g && st == KVC_OK; j++) {
            const float *qh = q + (size_t)(h * g + j) * dh;
            double mx = -INFINITY, z = 0;
            for (int64_t r = 0; r < n; r++) {
                double dot = 0;
                for (int32_t c = 0; c < dh; c++) dot += (double)qh[c] * k[r * dh + c];
                lg[r] = dot * scale;
                mx = lg[r] > mx ? lg[r] : mx;
            }
            for (int64_t r = 0; r < n; r++) z += (lg[r] = exp(lg[r] - mx));
            for (int64_t r = 0; r < n; r++) sum[r] += (float)(lg[r] / z / g);
        }
    }
    free(q); free(fresh); free(lg);
    return st;
}

/* The base press's scores, then CaM's shared selection and merge (merge.c): the merged values of the kept rows
 * go back to the store before the compaction. */
static kvc_status cam_select_merge(kvc_decoding *d, const kvc_layer_rows *lr, const kvc_layer_ctx *ctx,
                                   const kvc_press_config *cfg, const int64_t *len, int64_t target, float *const *scores,
                                   int64_t *const *keep, int64_t *n_keep) {
    const int32_t l = ctx->layer, Hkv = d->n_kv, dh = lr->mc->head_dim;
    const int64_t n = len[0];
    if (d->cam_rows[l] != n)
        return kvc_fail(KVC_ERR_INTERNAL, "CAMPress: %lld attention sums for %lld rows", (long long)d->cam_rows[l], (long long)n);
    KVC_TRY(kvc_score_layer(lr, ctx, cfg, kvc_press_window(cfg), len, &d->dev_scores, &d->dev_ld, scores));
    float *sc = malloc(sizeof(float) * (size_t)(Hkv * n)), *a = malloc(sizeof(float) * (size_t)(Hkv * n));
    float *v = malloc(sizeof(float) * (size_t)(Hkv * n * dh)), *out = malloc(sizeof(float) * (size_t)(Hkv * target * dh));
    kvc_status st = sc && a && v && out ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CAMPress");
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        memcpy(sc + (size_t)h * n, scores[h], sizeof(float) * (size_t)n);
        memcpy(a + (size_t)h * n, d->cam_attn[l] + (size_t)h * d->cam_cap[l], sizeof(float) * (size_t)n);
    }
    if (st == KVC_OK) st = lr->be->kv_read_heads(lr->kv, NULL, len, NULL, v); /* every head's values, one read */
    if (st == KVC_OK)
        st = kvc_cam_merge(sc, a, v, Hkv, n, dh, target, d->steps[l], d->cfg.cam_merge_budget, d->cfg.cam_seed, l,
                           d->cam_events[l], keep[0], out);
    const float *oh[KVC_MAX_KV_HEADS], *vh[KVC_MAX_KV_HEADS];
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        if (h > 0) memcpy(keep[h], keep[0], sizeof(int64_t) * (size_t)target);
        n_keep[h] = target;
        oh[h] = out + (size_t)h * target * dh;
        vh[h] = v + (size_t)h * n * dh;
    }
    if (st == KVC_OK) st = kvc_merge_write_back(lr, (const int64_t *const *)keep, n_keep, oh, vh); /* one write */
    if (st == KVC_OK) d->cam_events[l]++;
    free(sc); free(a); free(v); free(out);
    return st;
}

/* The attention sums follow the compaction: the kept rows, in order. */
static void cam_prune(kvc_decoding *d, int32_t l, int32_t Hkv, int32_t dh, const int64_t *keep, int64_t n_keep) {
    int64_t krows = 0; /* the kept rows whose keys the host holds: a prefix of keep */
    while (krows < n_keep && keep[krows] < d->cam_krows[l]) krows++;
    for (int32_t h = 0; h < Hkv; h++) {
        float *sum = d->cam_attn[l] + (size_t)h * d->cam_cap[l], *k = d->cam_k[l] + (size_t)(h * d->cam_cap[l] * dh);
        for (int64_t i = 0; i < n_keep; i++) sum[i] = sum[keep[i]]; /* keep is increasing: in place */
        for (int64_t i = 0; i < krows; i++)
            if (keep[i] != i) memcpy(k + i * dh, k + keep[i] * dh, sizeof(float) * (size_t)dh);
    }
    d->cam_krows[l] = krows;
    d->cam_rows[l] = n_keep;
}

/* Compress layer l to `target` rows per head. */
static kvc_status compress(kvc_decoding *d, kvc_session *s, const kvc_layer_ctx *ctx, int64_t target) {
    const int32_t l = ctx->layer, Hkv = d->n_kv;
    const int64_t *len = kvc_door_cache(s)->layers[l].len;
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
    int64_t future_from = 0; /* ExpectedAttention's: after the buffer (all_rows_ctx) */
    if (d->rq) KVC_TRY(all_rows_ctx(d, l, &c2, &future_from));
    if (kvc_scorer_has(cfg.scorer, KVC_SCORER_SINK_ROWS))
        for (int32_t h = 0; h < Hkv; h++)
            if (len[h] <= cfg.n_sink)
                return kvc_fail(KVC_ERR_ARG, "%s needs more tokens (%lld) than n_sink (%d)", kvc_scorer_title(cfg.scorer),
                                (long long)len[h], cfg.n_sink);
    float *scores[KVC_MAX_KV_HEADS] = {0};
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS] = {0};
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        scores[h] = malloc(sizeof(float) * (size_t)len[h]);
        keep[h] = malloc(sizeof(int64_t) * (size_t)len[h]);
        if (!scores[h] || !keep[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: decoding press");
    }
    kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    lr.future_from = future_from;
    if (d->q_mean) { /* ExpectedAttentionStats */
        const size_t hd = (size_t)lr.mc->n_heads * lr.mc->head_dim;
        lr.q_mean = d->q_mean + (size_t)l * hd;
        lr.q_cov = d->q_cov + (size_t)l * hd * lr.mc->head_dim;
    }
    if (st == KVC_OK && d->cfg.cam_merge_budget > 0) {
        st = cam_select_merge(d, &lr, &c2, &cfg, len, target, scores, keep, n_keep);
        if (st != KVC_OK) kvc_door_cache(s)->compactions++; /* kept rows may hold merged values already: no undoing the call */
    } else if (st == KVC_OK)
        st = kvc_press_score_select(&lr, &c2, &cfg, len, -1, &d->dev_scores, &d->dev_ld, scores, keep, n_keep);
    /* room for the steps until the next compression: the arena does not grow in between */
    if (st == KVC_OK)
        st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, d->cfg.compression_interval);
    if (st == KVC_OK && d->cfg.cam_merge_budget > 0) cam_prune(d, l, Hkv, kvc_door_model(s)->cfg.head_dim, keep[0], n_keep[0]);
    if (st == KVC_OK) d->compressions++;
    for (int32_t h = 0; h < Hkv; h++) {
        free(scores[h]);
        free(keep[h]);
    }
    return st;
}

kvc_status kvc_decoding_hook(kvc_decoding *d, kvc_session *s, const kvc_layer_ctx *ctx) {
    const int32_t l = ctx->layer;
    if (d->dms) return kvc_dms_decode(d->dms, s, ctx);
    KVC_TRY(buffer_call(d, l, ctx));
    if (d->cfg.cam_merge_budget > 0) KVC_TRY(cam_accumulate(d, s, ctx));
    d->steps[l]++;
    const int64_t target = d->cfg.ratio_target
                               ? kvc_n_kept_ratio(kvc_door_position(s) + ctx->n, d->cfg.target_compression_ratio) /* tokens seen */
                               : d->cfg.target_size;
    /* CAMPress waits, counting steps, until the layer holds more than target rows (kvpress's CAMPress) */
    const int interval_due = d->steps[l] >= d->cfg.compression_interval &&
                             (d->cfg.cam_merge_budget == 0 || kvc_door_cache(s)->layers[l].len[0] > target);
    if (interval_due || ctx->n >= target) {
        KVC_TRY(compress(d, s, ctx, target));
        clear_buffers(d, l);
        return KVC_OK;
    }
    trim(d, l);
    return KVC_OK;
}

/* ---- its state in a saved cache (mid-answer): rings written oldest first, read back checked ---- */

/* n values of a state array, allocated (NULL with n 0); *out NULL and an error otherwise. */
static kvc_status get_new(kvc_state_io *io, const char *name, int32_t dtype, int64_t n, void **out) {
    *out = malloc((size_t)(n > 0 ? n : 1) * kvc_dtype_size(dtype));
    if (!*out) return kvc_fail(KVC_ERR_NOMEM, "out of memory: reading a decoding press's state");
    const kvc_status st = kvc_state_get(io, name, dtype, *out, n);
    if (st != KVC_OK) {
        free(*out);
        *out = NULL;
    }
    return st;
}

static int64_t sum_i64(const int64_t *x, int64_t n) {
    int64_t s = 0;
    for (int64_t i = 0; i < n; i++) s += x[i];
    return s;
}

static int all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

/* The buffered calls' row counts and query rows of every layer, each ring from its oldest entry. */
static kvc_status save_buffers(const kvc_decoding *d, kvc_state_io *io) {
    const int32_t L = d->n_layers;
    int64_t total = sum_i64(d->n_entries, L), at = 0;
    int64_t *e = malloc(sizeof(int64_t) * (size_t)(total > 0 ? total : 1));
    if (!e) return kvc_fail(KVC_ERR_NOMEM, "out of memory: saving a decoding press's state");
    for (int32_t l = 0; l < L; l++)
        for (int64_t i = 0; i < d->n_entries[l]; i++) e[at++] = d->entry_rows[(size_t)l * d->ne + (d->entry_head[l] + i) % d->ne];
    kvc_status st = kvc_state_put(io, "n_entries", KVC_I64, d->n_entries, L);
    if (st == KVC_OK) st = kvc_state_put(io, "entries", KVC_I64, e, total);
    free(e);
    if (st != KVC_OK || d->w == 0) return st;
    total = sum_i64(d->q_rows, L);
    at = 0;
    float *q = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1) * (size_t)d->qd);
    if (!q) return kvc_fail(KVC_ERR_NOMEM, "out of memory: saving a decoding press's state");
    for (int32_t l = 0; l < L; l++)
        for (int64_t i = 0; i < d->q_rows[l]; i++, at++)
            memcpy(q + (size_t)at * d->qd, d->queries + ((size_t)l * d->w + (size_t)((d->q_head[l] + i) % d->w)) * d->qd,
                   sizeof(float) * (size_t)d->qd);
    st = kvc_state_put(io, "q_rows", KVC_I64, d->q_rows, L);
    if (st == KVC_OK) st = kvc_state_put(io, "queries", KVC_F32, q, total * d->qd);
    free(q);
    return st;
}

/* ExpectedAttention's every buffered row: its query and position. */
static kvc_status save_rows(const kvc_decoding *d, kvc_state_io *io) {
    const int32_t L = d->n_layers;
    const int64_t total = sum_i64(d->rq_n, L);
    float *q = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1) * (size_t)d->qd);
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(total > 0 ? total : 1)), at = 0;
    kvc_status st = q && pos ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: saving a decoding press's state");
    for (int32_t l = 0; l < L && st == KVC_OK; l++)
        for (int64_t i = 0; i < d->rq_n[l]; i++, at++) {
            const int64_t src = (d->rq_head[l] + i) % d->rq_cap[l];
            memcpy(q + (size_t)at * d->qd, d->rq[l] + (size_t)src * d->qd, sizeof(float) * (size_t)d->qd);
            pos[at] = d->rpos[l][src];
        }
    if (st == KVC_OK) st = kvc_state_put(io, "row_counts", KVC_I64, d->rq_n, L);
    if (st == KVC_OK) st = kvc_state_put(io, "row_queries", KVC_F32, q, total * d->qd);
    if (st == KVC_OK) st = kvc_state_put(io, "row_positions", KVC_I64, pos, total);
    free(q);
    free(pos);
    return st;
}

/* CAMPress's attention sums over the rows each layer tracks (the host copy of the keys is read again). */
static kvc_status save_cam(const kvc_decoding *d, kvc_state_io *io) {
    const int32_t L = d->n_layers, Hkv = d->n_kv;
    const int64_t total = sum_i64(d->cam_rows, L) * Hkv;
    float *a = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (!a) return kvc_fail(KVC_ERR_NOMEM, "out of memory: saving a decoding press's state");
    int64_t at = 0;
    for (int32_t l = 0; l < L; l++)
        for (int32_t h = 0; h < Hkv; h++, at += d->cam_rows[l])
            memcpy(a + at, d->cam_attn[l] + (size_t)h * d->cam_cap[l], sizeof(float) * (size_t)d->cam_rows[l]);
    kvc_status st = kvc_state_put(io, "cam_rows", KVC_I64, d->cam_rows, L);
    if (st == KVC_OK) st = kvc_state_put(io, "cam_attention", KVC_F32, a, total);
    if (st == KVC_OK) st = kvc_state_put(io, "cam_merges", KVC_I64, d->cam_events, L);
    free(a);
    return st;
}

/* The shape of its buffers (layers, KV heads, a query row's values, query rows, buffered calls): a press of other
 * settings keeps others. */
static void layout(const kvc_decoding *d, int64_t *out) {
    out[0] = d->n_layers;
    out[1] = d->n_kv;
    out[2] = d->qd;
    out[3] = d->w;
    out[4] = d->ne;
}

static kvc_status save_self(const void *self, kvc_state_io *io) {
    const kvc_decoding *d = self;
    int64_t shape[5];
    layout(d, shape);
    KVC_TRY(kvc_state_put(io, "layout", KVC_I64, shape, 5));
    KVC_TRY(kvc_state_put(io, "compressions", KVC_I64, &d->compressions, 1));
    KVC_TRY(kvc_state_put(io, "steps", KVC_I64, d->steps, d->n_layers));
    KVC_TRY(save_buffers(d, io));
    if (d->rq) KVC_TRY(save_rows(d, io));
    if (d->cfg.cam_merge_budget > 0) KVC_TRY(save_cam(d, io));
    if (!d->dms) return KVC_OK;
    const size_t mark = kvc_state_scope(io, "dms");
    const kvc_status st = kvc_dms_save(d->dms, io);
    kvc_state_unscope(io, mark);
    return st;
}

/* What a file holds for the press, read and checked before any of it replaces the press's own. */
typedef struct saved_decoding {
    int64_t compressions, *steps, *n_entries, *entries, *q_rows, *rq_n, *rpos, *cam_rows, *cam_events;
    float *queries, *rq, *cam_attn;
} saved_decoding;

static void saved_free(saved_decoding *v) {
    free(v->steps); free(v->n_entries); free(v->entries); free(v->q_rows); free(v->rq_n); free(v->rpos);
    free(v->cam_rows); free(v->cam_events); free(v->queries); free(v->rq); free(v->cam_attn);
}

static kvc_status read_saved(const kvc_decoding *d, kvc_session *s, kvc_state_io *io, saved_decoding *v) {
    const int32_t L = d->n_layers, Hkv = d->n_kv;
    const int64_t position = kvc_door_position(s), qd = d->qd;
    const kvc_cache *c = kvc_door_cache(s);
    int64_t shape[5], want[5];
    layout(d, want);
    KVC_TRY(kvc_state_get(io, "layout", KVC_I64, shape, 5));
    if (memcmp(shape, want, sizeof want) != 0)
        return kvc_state_bad(io, "its decoding press buffers %lld query rows and %lld calls per layer; the press attached "
                             "buffers %lld and %lld (saved with a press of other settings)", (long long)shape[3],
                             (long long)shape[4], (long long)want[3], (long long)want[4]);
    KVC_TRY(kvc_state_get(io, "compressions", KVC_I64, &v->compressions, 1));
    KVC_TRY(get_new(io, "steps", KVC_I64, L, (void **)&v->steps));
    KVC_TRY(get_new(io, "n_entries", KVC_I64, L, (void **)&v->n_entries));
    if (v->compressions < 0) return kvc_state_bad(io, "the decoding press's compression count is negative");
    for (int32_t l = 0; l < L; l++) {
        if (v->steps[l] < 0 || v->steps[l] > position)
            return kvc_state_bad(io, "the decoding press's layer %d counts %lld steps at position %lld", l,
                                 (long long)v->steps[l], (long long)position);
        if (v->n_entries[l] < 0 || v->n_entries[l] > d->ne)
            return kvc_state_bad(io, "the decoding press's layer %d buffers %lld calls; the press attached keeps %lld (its "
                                 "hidden_states_buffer_size + 1)", l, (long long)v->n_entries[l], (long long)d->ne);
    }
    const int64_t n_e = sum_i64(v->n_entries, L);
    KVC_TRY(get_new(io, "entries", KVC_I64, n_e, (void **)&v->entries));
    for (int64_t i = 0; i < n_e; i++)
        if (v->entries[i] < 1 || v->entries[i] > position)
            return kvc_state_bad(io, "the decoding press buffers a call of %lld rows at position %lld",
                                 (long long)v->entries[i], (long long)position);
    if (d->w > 0) {
        KVC_TRY(get_new(io, "q_rows", KVC_I64, L, (void **)&v->q_rows));
        for (int32_t l = 0; l < L; l++)
            if (v->q_rows[l] < 0 || v->q_rows[l] > d->w)
                return kvc_state_bad(io, "the decoding press's layer %d buffers %lld query rows; the press attached reads %d",
                                     l, (long long)v->q_rows[l], d->w);
        const int64_t n = sum_i64(v->q_rows, L) * qd;
        KVC_TRY(get_new(io, "queries", KVC_F32, n, (void **)&v->queries));
        if (!all_finite(v->queries, n)) return kvc_state_bad(io, "the decoding press's buffered queries are not finite");
    }
    if (d->rq) {
        KVC_TRY(get_new(io, "row_counts", KVC_I64, L, (void **)&v->rq_n));
        int64_t at = 0;
        for (int32_t l = 0; l < L; l++) { /* every buffered call's rows, or none with given statistics */
            const int64_t want = d->q_mean ? 0 : sum_i64(v->entries + at, v->n_entries[l]);
            at += v->n_entries[l];
            if (v->rq_n[l] != want)
                return kvc_state_bad(io, "the decoding press's layer %d buffers %lld query rows for calls of %lld rows", l,
                                     (long long)v->rq_n[l], (long long)want);
        }
        const int64_t n = sum_i64(v->rq_n, L);
        KVC_TRY(get_new(io, "row_queries", KVC_F32, n * qd, (void **)&v->rq));
        KVC_TRY(get_new(io, "row_positions", KVC_I64, n, (void **)&v->rpos));
        if (!all_finite(v->rq, n * qd)) return kvc_state_bad(io, "the decoding press's buffered queries are not finite");
        for (int64_t i = 0; i < n; i++)
            if (v->rpos[i] < 0 || v->rpos[i] >= position)
                return kvc_state_bad(io, "the decoding press buffers a query at position %lld of %lld",
                                     (long long)v->rpos[i], (long long)position);
    }
    if (d->cfg.cam_merge_budget > 0) {
        KVC_TRY(get_new(io, "cam_rows", KVC_I64, L, (void **)&v->cam_rows));
        KVC_TRY(get_new(io, "cam_merges", KVC_I64, L, (void **)&v->cam_events));
        for (int32_t l = 0; l < L; l++) {
            int ok = v->cam_rows[l] >= 0 && v->cam_events[l] >= 0;
            for (int32_t h = 0; h < Hkv; h++) ok &= v->cam_rows[l] <= c->layers[l].len[h];
            if (!ok)
                return kvc_state_bad(io, "CAMPress's layer %d tracks %lld rows (%lld merges); the cache holds %lld", l,
                                     (long long)v->cam_rows[l], (long long)v->cam_events[l], (long long)c->layers[l].len[0]);
        }
        const int64_t n = sum_i64(v->cam_rows, L) * Hkv;
        KVC_TRY(get_new(io, "cam_attention", KVC_F32, n, (void **)&v->cam_attn));
        for (int64_t i = 0; i < n; i++)
            if (!(v->cam_attn[i] >= 0 && isfinite(v->cam_attn[i])))
                return kvc_state_bad(io, "CAMPress's attention sums are not finite and >= 0");
    }
    return KVC_OK;
}

/* The checked state replaces the press's own; the rings start at their slot 0. */
static kvc_status commit_saved(kvc_decoding *d, saved_decoding *v, int32_t dh) {
    const int32_t L = d->n_layers, Hkv = d->n_kv;
    for (int32_t l = 0; d->rq && l < L; l++) KVC_TRY(rows_reserve(d, l, v->rq_n[l])); /* may fail: nothing set yet */
    if (d->cfg.cam_merge_budget > 0)
        for (int32_t l = 0; l < L; l++) {
            const int64_t cap = v->cam_rows[l] + d->cfg.compression_interval;
            float *a = calloc((size_t)(Hkv * cap), sizeof(float)), *k = malloc(sizeof(float) * (size_t)(Hkv * cap) * (size_t)dh);
            if (!a || !k) {
                free(a);
                free(k);
                return kvc_fail(KVC_ERR_NOMEM, "out of memory: CAMPress attention sums");
            }
            free(d->cam_attn[l]);
            free(d->cam_k[l]);
            d->cam_attn[l] = a;
            d->cam_k[l] = k;
            d->cam_cap[l] = cap;
        }
    d->compressions = v->compressions;
    memcpy(d->steps, v->steps, sizeof(int64_t) * (size_t)L);
    int64_t at = 0;
    for (int32_t l = 0; l < L; l++) {
        d->entry_head[l] = 0;
        d->n_entries[l] = v->n_entries[l];
        memcpy(d->entry_rows + (size_t)l * d->ne, v->entries + at, sizeof(int64_t) * (size_t)v->n_entries[l]);
        at += v->n_entries[l];
    }
    at = 0;
    for (int32_t l = 0; d->w > 0 && l < L; l++) {
        d->q_head[l] = 0;
        d->q_rows[l] = v->q_rows[l];
        memcpy(d->queries + (size_t)l * d->w * d->qd, v->queries + (size_t)at * d->qd, sizeof(float) * (size_t)(v->q_rows[l] * d->qd));
        at += v->q_rows[l];
    }
    at = 0;
    for (int32_t l = 0; d->rq && l < L; l++) {
        d->rq_head[l] = 0;
        d->rq_n[l] = v->rq_n[l];
        if (v->rq_n[l] > 0) {
            memcpy(d->rq[l], v->rq + (size_t)at * d->qd, sizeof(float) * (size_t)(v->rq_n[l] * d->qd));
            memcpy(d->rpos[l], v->rpos + at, sizeof(int64_t) * (size_t)v->rq_n[l]);
        }
        at += v->rq_n[l];
    }
    at = 0;
    for (int32_t l = 0; d->cfg.cam_merge_budget > 0 && l < L; l++) {
        for (int32_t h = 0; h < Hkv; h++, at += v->cam_rows[l])
            memcpy(d->cam_attn[l] + (size_t)h * d->cam_cap[l], v->cam_attn + at, sizeof(float) * (size_t)v->cam_rows[l]);
        d->cam_rows[l] = v->cam_rows[l];
        d->cam_events[l] = v->cam_events[l];
        d->cam_krows[l] = 0; /* the keys come again from the store at the next step */
    }
    return KVC_OK;
}

static kvc_status load_self(void *self, kvc_session *s, kvc_state_io *io) {
    kvc_decoding *d = self;
    saved_decoding v;
    memset(&v, 0, sizeof v);
    kvc_status st = read_saved(d, s, io, &v);
    if (st == KVC_OK && d->dms) {
        const size_t mark = kvc_state_scope(io, "dms");
        st = kvc_dms_load(d->dms, s, io);
        kvc_state_unscope(io, mark);
    }
    if (st == KVC_OK) st = commit_saved(d, &v, kvc_door_model(s)->cfg.head_dim);
    saved_free(&v);
    return st;
}

/* ---- the decoding press's slot and its kvc_session_* functions ---- */

static kvc_status on_decode_layer(void *self, kvc_session *s, const kvc_layer_ctx *ctx) {
    return kvc_decoding_hook(self, s, ctx);
}
static void reset_self(void *self) { kvc_decoding_reset(self); }
static void free_self(void *self) { kvc_decoding_free(self); }

const kvc_press_vt kvc_decoding_slot_vt = {.name = "decoding", .traits = KVC_PRESS_EAGER_DECODE,
                                           .on_decode_layer = on_decode_layer, .reset = reset_self, .free = free_self,
                                           .save_state = save_self, .load_state = load_self};

kvc_status kvc_session_set_decoding_press(kvc_session *s, const kvc_decoding_config *cfg) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    kvc_decoding *d = NULL;
    if (cfg) KVC_TRY(kvc_decoding_new(cfg, &kvc_door_model(s)->cfg, kvc_door_backend(s), &d));
    return kvc_session_attach(s, KVC_SLOT_DECODING, d ? &kvc_decoding_slot_vt : NULL, d); /* the slot owns it, freed if refused */
}

int64_t kvc_session_decoding_compressions(const kvc_session *s) {
    return s ? kvc_decoding_count(kvc_door_slot(s, &kvc_decoding_slot_vt)) : 0;
}

kvc_status kvc_session_set_decoding_query_stats(kvc_session *s, const float *mean, const float *cov, int64_t n_mean,
                                                int64_t n_cov) {
    if (!s || !mean || !cov) return kvc_fail(KVC_ERR_ARG, "null argument");
    kvc_decoding *d = kvc_door_slot(s, &kvc_decoding_slot_vt);
    if (!d) return kvc_fail(KVC_ERR_ARG, "no decoding press is attached to this session (set_decoding_press first)");
    const kvc_config *mc = &kvc_door_model(s)->cfg;
    return kvc_decoding_set_query_stats(d, mean, cov, n_mean, n_cov, mc->n_heads, mc->head_dim);
}
