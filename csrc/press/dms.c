/* DMSPress (kvpress's; after Dynamic Memory Sparsification, Lancucki et al., 2025, inference without the
 * trained evictors): threshold eviction behind a sliding window (docs/METHODS.md, "DMSPress"). Each forward
 * call scores its own rows with the wrapped scorer (the scorer sees those rows only, as kvpress scores
 * keys[:, :, -q_len:]); the scores queue per layer; rows that leave the last dms_window rows are evicted for
 * real if they scored below dms_threshold. Heads evict independently (ragged). The prefill part is the
 * attached press's part (dms_part: the schedule calls its take_layer); the decoding part (kvpress decoding=True) rides on the
 * decoding press (decoding.c calls kvc_dms_decode) and continues the prefill's queue. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

/* Keep every row of head h except rows [first, first + m) whose score q[i] < threshold; returns the count. */
static int64_t keep_rows(int64_t len, int64_t first, int64_t m, const float *q, float threshold, int64_t *keep) {
    int64_t k = 0;
    for (int64_t r = 0; r < len; r++)
        if (r < first || r >= first + m || !(q[r - first] < threshold)) keep[k++] = r;
    return k;
}

static kvc_status alloc_rows(int32_t Hkv, const int64_t *len, float **scores, int64_t **keep) {
    for (int32_t h = 0; h < Hkv; h++) {
        scores[h] = malloc(sizeof(float) * (size_t)(len[h] > 0 ? len[h] : 1));
        keep[h] = malloc(sizeof(int64_t) * (size_t)(len[h] > 0 ? len[h] : 1));
        if (!scores[h] || !keep[h]) return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    }
    return KVC_OK;
}

static void free_rows(int32_t Hkv, float **scores, int64_t **keep) {
    for (int32_t h = 0; h < Hkv; h++) {
        free(scores[h]);
        free(keep[h]);
    }
}

/* The prefill part's state: the window rows' scores a prefill left unjudged, for the decoding part. */
typedef struct {
    float *tail;     /* [L * Hkv * dms_window] */
    int64_t *tail_n; /* [L] how many (-1: no prefill yet) */
    int32_t L;
} dms_state;

/* a reset session has no prefill: nothing is left for the decoding part */
static void reset(void *state) {
    dms_state *t = state;
    for (int32_t l = 0; t->tail_n && l < t->L; l++) t->tail_n[l] = -1;
}

static void release(void *state) {
    dms_state *t = state;
    free(t->tail);
    free(t->tail_n);
}

static kvc_status dms_prefill(kvc_press *p, void *state, kvc_session *s, const kvc_layer_ctx *ctx) {
    dms_state *t = state;
    const kvc_press_config *cfg = &p->cfg;
    const int32_t Hkv = p->n_kv, l = ctx->layer, W = cfg->dms_window;
    for (int32_t h = 0; h < Hkv; h++)
        if (ctx->past_len[h] != 0) return KVC_OK; /* kvpress: a call with a past is a decoding step */
    if (!t->tail) {
        t->tail = malloc(sizeof(float) * (size_t)p->n_layers * Hkv * (W > 0 ? W : 1));
        t->tail_n = malloc(sizeof(int64_t) * (size_t)p->n_layers);
        if (!t->tail || !t->tail_n) { /* both or neither: a later call must not find half of them */
            release(t);
            t->tail = NULL;
            t->tail_n = NULL;
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
        }
        for (int32_t i = 0; i < p->n_layers; i++) t->tail_n[i] = -1;
        t->L = p->n_layers;
    }
    const int64_t *len = kvc_door_cache(s)->layers[l].len, n = ctx->n;
    float *scores[KVC_MAX_KV_HEADS] = {0};
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS] = {0};
    kvc_status st = alloc_rows(Hkv, len, scores, keep);
    const kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    if (st == KVC_OK) st = kvc_score_layer(&lr, ctx, cfg, kvc_press_window(cfg), len, &p->dev_scores, &p->dev_ld, scores);
    const int64_t judged = n > W ? n - W : 0, tail = n - judged;
    int evict = 0;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        n_keep[h] = keep_rows(len[h], 0, judged, scores[h], cfg->dms_threshold, keep[h]);
        evict |= n_keep[h] < len[h];
        memcpy(t->tail + ((size_t)l * Hkv + h) * (W > 0 ? W : 1), scores[h] + judged, sizeof(float) * (size_t)tail);
    }
    if (st == KVC_OK) t->tail_n[l] = tail;
    if (st == KVC_OK && evict) st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    free_rows(Hkv, scores, keep);
    return st;
}

static int wanted(const kvc_press_config *cfg) { return cfg->dms != 0; }

/* Scores of a queue per layer: n[l] (< 0: none) of each head at q + (l Hkv + h) stride, saved head after head. */
static kvc_status queue_save(kvc_state_io *io, const int64_t *n, const float *const *q, const int64_t *stride, int32_t L,
                             int32_t Hkv) {
    int64_t total = 0, at = 0;
    for (int32_t l = 0; l < L; l++) total += n[l] > 0 ? n[l] * Hkv : 0;
    float *x = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
    if (!x) return kvc_fail(KVC_ERR_NOMEM, "out of memory: saving DMSPress's scores");
    for (int32_t l = 0; l < L; l++)
        for (int32_t h = 0; h < Hkv && n[l] > 0; h++, at += n[l]) memcpy(x + at, q[l] + (size_t)h * stride[l], sizeof(float) * (size_t)n[l]);
    kvc_status st = kvc_state_put(io, "count", KVC_I64, n, L);
    if (st == KVC_OK) st = kvc_state_put(io, "scores", KVC_F32, x, total);
    free(x);
    return st;
}

/* A saved queue read back: counts in [-1, W] and no more than any head of the layer holds (its rows are the layer's
 * last ones), scores not NaN; *x holds them head after head. */
static kvc_status queue_load(kvc_state_io *io, kvc_session *s, int32_t L, int32_t Hkv, int32_t W, int64_t *n, float **x) {
    *x = NULL;
    KVC_TRY(kvc_state_get(io, "count", KVC_I64, n, L));
    int64_t total = 0;
    for (int32_t l = 0; l < L; l++) {
        int ok = n[l] >= -1 && n[l] <= (W > 0 ? W : 0);
        for (int32_t h = 0; ok && h < Hkv; h++) ok = n[l] <= kvc_door_cache(s)->layers[l].len[h];
        if (!ok)
            return kvc_state_bad(io, "DMSPress's layer %d keeps %lld unjudged scores: its window is %d rows, the cache "
                                 "holds %lld", l, (long long)n[l], W, (long long)kvc_door_cache(s)->layers[l].len[0]);
        total += n[l] > 0 ? n[l] * Hkv : 0;
    }
    if (!(*x = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1)))) return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    kvc_status st = kvc_state_get(io, "scores", KVC_F32, *x, total);
    for (int64_t i = 0; st == KVC_OK && i < total; i++)
        if (isnan((*x)[i])) st = kvc_state_bad(io, "DMSPress's unjudged scores hold a NaN");
    if (st != KVC_OK) {
        free(*x);
        *x = NULL;
    }
    return st;
}

/* the window a prefill left unjudged, for the decoding part's first call */
static kvc_status save_part(const void *state, const kvc_press *p, kvc_state_io *io) {
    const dms_state *t = state;
    if (!t->tail) return KVC_OK; /* no prefill yet */
    const int32_t Hkv = p->n_kv, W = p->cfg.dms_window > 0 ? p->cfg.dms_window : 1;
    const float **q = malloc(sizeof *q * (size_t)t->L);
    int64_t *stride = malloc(sizeof(int64_t) * (size_t)t->L);
    kvc_status st = q && stride ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: saving DMSPress's scores");
    for (int32_t l = 0; st == KVC_OK && l < t->L; l++) {
        q[l] = t->tail + (size_t)l * Hkv * W;
        stride[l] = W;
    }
    if (st == KVC_OK) st = queue_save(io, t->tail_n, q, stride, t->L, Hkv);
    free(q);
    free(stride);
    return st;
}

static kvc_status load_part(void *state, kvc_press *p, kvc_session *s, kvc_state_io *io) {
    dms_state *t = state;
    const int32_t L = p->n_layers, Hkv = p->n_kv, W = p->cfg.dms_window > 0 ? p->cfg.dms_window : 1;
    int64_t *n = malloc(sizeof(int64_t) * (size_t)L);
    float *tail = malloc(sizeof(float) * (size_t)L * Hkv * W), *x = NULL;
    kvc_status st = n && tail ? queue_load(io, s, L, Hkv, p->cfg.dms_window, n, &x) : kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    int64_t at = 0;
    for (int32_t l = 0; st == KVC_OK && l < L; l++)
        for (int32_t h = 0; h < Hkv && n[l] > 0; h++, at += n[l])
            memcpy(tail + ((size_t)l * Hkv + h) * W, x + at, sizeof(float) * (size_t)n[l]);
    if (st == KVC_OK) {
        release(t);
        t->tail = tail;
        t->tail_n = n;
        t->L = L;
    } else {
        free(tail);
        free(n);
    }
    free(x);
    return st;
}

/* the press's setting dms turns it on: threshold eviction in place of the schedule's */
static const kvc_press_part_i dms_part = {
    .name = "dms", .title = "DMSPress", .traits = KVC_PART_SELECTS, .order = 10, .state_size = sizeof(dms_state),
    .wanted = wanted, .release = release, .reset = reset, .take_layer = dms_prefill, .save_state = save_part,
    .load_state = load_part, .doc = "rows leaving a sliding window evicted when they score below a threshold"};
KVC_REGISTER_PART(dms_part);

struct kvc_dms {
    kvc_press_config cfg;
    int32_t n_layers, n_kv, d;
    float **queue;     /* [L] [Hkv][cap] the unjudged scores, oldest first */
    int64_t *cap, *nq; /* [L] capacity per head, count (-1: not started) */
    kvc_kv *tmp;       /* the call's rows alone, for the scorer */
    kvc_buf *dev_scores;
    int64_t dev_ld;
    const kvc_backend *be;
};

kvc_status kvc_dms_new(const kvc_press_config *cfg, const kvc_config *mc, const kvc_backend *be, kvc_dms **out) {
    *out = NULL;
    kvc_dms *d = calloc(1, sizeof *d);
    if (!d) return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    d->cfg = *cfg;
    d->n_layers = mc->n_layers;
    d->n_kv = mc->n_kv_heads;
    d->d = mc->head_dim;
    d->be = be;
    d->queue = calloc((size_t)d->n_layers, sizeof(float *));
    d->cap = calloc((size_t)d->n_layers, sizeof(int64_t));
    d->nq = malloc(sizeof(int64_t) * (size_t)d->n_layers);
    if (!d->queue || !d->cap || !d->nq) {
        kvc_dms_free(d);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    }
    kvc_dms_reset(d);
    *out = d;
    return KVC_OK;
}

void kvc_dms_free(kvc_dms *d) {
    if (!d) return;
    for (int32_t l = 0; d->queue && l < d->n_layers; l++) free(d->queue[l]);
    free(d->queue);
    free(d->cap);
    free(d->nq);
    if (d->tmp) d->be->kv_free(d->tmp);
    if (d->dev_scores) d->be->free(d->dev_scores);
    free(d);
}

void kvc_dms_reset(kvc_dms *d) {
    if (!d) return;
    for (int32_t l = 0; l < d->n_layers; l++) d->nq[l] = -1;
}

/* The scores of this call's n rows alone: copied into a scratch store (kv_read / kv_write), scored there. */
static kvc_status score_call(kvc_dms *d, kvc_session *s, const kvc_layer_ctx *ctx, float *const *scores) {
    const int32_t Hkv = d->n_kv, dh = d->d;
    const int64_t n = ctx->n, *len = kvc_door_cache(s)->layers[ctx->layer].len;
    int64_t rows[KVC_MAX_KV_HEADS], zero[KVC_MAX_KV_HEADS] = {0};
    for (int32_t h = 0; h < Hkv; h++) rows[h] = n;
    if (!d->tmp) KVC_TRY(d->be->kv_new(Hkv, dh, NULL, &d->tmp));
    KVC_TRY(d->be->kv_resize(d->tmp, rows, zero, NULL));
    float *k = malloc(sizeof(float) * (size_t)(n * dh)), *v = malloc(sizeof(float) * (size_t)(n * dh));
    kvc_status st = k && v ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        st = d->be->kv_read(kvc_door_cache(s)->layers[ctx->layer].kv, h, len[h] - n, n, k, v);
        if (st == KVC_OK) st = d->be->kv_write(d->tmp, h, 0, n, k, v);
    }
    free(k);
    free(v);
    if (st == KVC_OK) st = d->be->kv_set_lens(d->tmp, rows);
    const kvc_layer_rows lr = kvc_session_layer_rows(s, ctx->layer, d->tmp);
    kvc_layer_ctx c2 = *ctx;
    int64_t past0[KVC_MAX_KV_HEADS] = {0}, *pos = malloc(sizeof(int64_t) * (size_t)n);
    if (!pos) return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    for (int64_t i = 0; i < n; i++) pos[i] = ctx->pos ? ctx->pos[i] : ctx->past_len[0] + i; /* the queries' own positions */
    c2.past_len = past0; /* the scorer sees the call's rows as the whole cache */
    c2.pos = pos;
    if (st == KVC_OK) st = kvc_score_layer(&lr, &c2, &d->cfg, kvc_press_window(&d->cfg), rows, &d->dev_scores, &d->dev_ld, scores);
    free(pos);
    return st;
}

kvc_status kvc_dms_decode(kvc_dms *d, kvc_session *s, const kvc_layer_ctx *ctx) {
    const int32_t Hkv = d->n_kv, l = ctx->layer, W = d->cfg.dms_window;
    const int64_t n = ctx->n, *len = kvc_door_cache(s)->layers[l].len;
    if (d->nq[l] < 0) { /* the first call after the prefill: the prefill press's unjudged window, if it left one */
        const kvc_press *p = kvc_door_slot(s, &kvc_press_slot_vt);
        const dms_state *pt = kvc_press_part(p, &dms_part);
        if (pt && pt->tail_n && pt->tail_n[l] > 0 && p->cfg.dms_window == W) {
            const int64_t t = pt->tail_n[l];
            if (!(d->queue[l] = malloc(sizeof(float) * (size_t)Hkv * (size_t)(t + n)))) return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
            d->cap[l] = t + n;
            for (int32_t h = 0; h < Hkv; h++)
                memcpy(d->queue[l] + (size_t)h * d->cap[l], pt->tail + ((size_t)l * Hkv + h) * (W > 0 ? W : 1), sizeof(float) * (size_t)t);
            d->nq[l] = t;
        } else {
            d->nq[l] = 0; /* set only now: a failed allocation above leaves the window to the retry */
        }
    }
    const int64_t nq = d->nq[l];
    if (nq + n > d->cap[l]) { /* room for this call's scores */
        const int64_t cap = nq + n + W;
        float *q = malloc(sizeof(float) * (size_t)Hkv * (size_t)cap);
        if (!q) return kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
        for (int32_t h = 0; h < Hkv && nq > 0; h++) memcpy(q + (size_t)h * cap, d->queue[l] + (size_t)h * d->cap[l], sizeof(float) * (size_t)nq);
        free(d->queue[l]);
        d->queue[l] = q;
        d->cap[l] = cap;
    }
    float *scores[KVC_MAX_KV_HEADS] = {0};
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS] = {0};
    kvc_status st = alloc_rows(Hkv, len, scores, keep);
    if (st == KVC_OK) st = score_call(d, s, ctx, scores);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        memcpy(d->queue[l] + (size_t)h * d->cap[l] + nq, scores[h], sizeof(float) * (size_t)n);
    const int64_t total = nq + n, judged = total > W ? total - W : 0;
    int evict = 0;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) { /* the queue's rows are the last `total` of every head */
        float *q = d->queue[l] + (size_t)h * d->cap[l];
        n_keep[h] = keep_rows(len[h], len[h] - total, judged, q, d->cfg.dms_threshold, keep[h]);
        evict |= n_keep[h] < len[h];
        memmove(q, q + judged, sizeof(float) * (size_t)(total - judged));
    }
    if (st == KVC_OK) d->nq[l] = total - judged;
    /* room for the window's worth of calls before the arena grows again */
    if (st == KVC_OK && evict) st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, W > 0 ? W : 1);
    free_rows(Hkv, scores, keep);
    return st;
}

kvc_status kvc_dms_save(const kvc_dms *d, kvc_state_io *io) {
    return queue_save(io, d->nq, (const float *const *)d->queue, d->cap, d->n_layers, d->n_kv);
}

kvc_status kvc_dms_load(kvc_dms *d, kvc_session *s, kvc_state_io *io) {
    const int32_t L = d->n_layers, Hkv = d->n_kv, W = d->cfg.dms_window;
    int64_t *n = malloc(sizeof(int64_t) * (size_t)L);
    float *x = NULL;
    kvc_status st = n ? queue_load(io, s, L, Hkv, W, n, &x) : kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    float **queue = st == KVC_OK ? calloc((size_t)L, sizeof(float *)) : NULL;
    if (st == KVC_OK && !queue) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
    int64_t at = 0;
    for (int32_t l = 0; st == KVC_OK && l < L; l++) {
        const int64_t cap = (n[l] > 0 ? n[l] : 0) + (W > 0 ? W : 1); /* room for a call's scores, as kvc_dms_decode grows it */
        if (!(queue[l] = malloc(sizeof(float) * (size_t)Hkv * (size_t)cap))) {
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: DMSPress");
            break;
        }
        for (int32_t h = 0; h < Hkv && n[l] > 0; h++, at += n[l])
            memcpy(queue[l] + (size_t)h * cap, x + at, sizeof(float) * (size_t)n[l]);
    }
    if (st == KVC_OK) {
        for (int32_t l = 0; l < L; l++) {
            free(d->queue[l]);
            d->queue[l] = queue[l];
            d->cap[l] = (n[l] > 0 ? n[l] : 0) + (W > 0 ? W : 1);
            d->nq[l] = n[l];
        }
    } else {
        for (int32_t l = 0; queue && l < L; l++) free(queue[l]);
    }
    free(queue);
    free(n);
    free(x);
    return st;
}
