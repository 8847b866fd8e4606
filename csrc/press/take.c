/* TAKE: chunked prefill with probe tokens and delayed eviction (TAKE-chunked-prefill-eviction.txt,
 * Eq. 3-13; METHODS.md "TAKE").
 *
 * The prompt goes through the model in chunks of Z tokens, each followed by the p probe tokens.
 * After a layer's attention, the probes' queries (accumulated over chunks with an EMA) score the
 * layer's cache, the top-k rows per KV head are kept and the probe rows are dropped, so a later
 * chunk attends only to the pruned past and the cache per layer never exceeds Z + p + k rows.
 * Delayed eviction: layers 0..W-2 are not scored; the rows layer W-1 keeps prune all of 0..W-1. */
#include <math.h>
#include <string.h>

#include "../backend/cuda_loader.h"
#include "press.h"

typedef struct take_state {
    const kvc_take_config *cfg;
    int32_t L, H, Hkv, d;
    float *qa;          /* [L, p, H, d] accumulated probe queries */
    char *has_qa;       /* [L] */
    int last_chunk;
} take_state;

void kvc_take_config_defaults(kvc_take_config *c) {
    memset(c, 0, sizeof *c);
    c->chunk_size = 4096;
    c->kernel = 7;
    c->alpha = 0.2f;
    c->delayed = 1;
    c->warmup_layers = -1; /* half the layers */
    kvc_press_config_defaults(&c->inner);
}

/* Probe scores of one KV head over its first `real` rows: softmax of each accumulated probe query
 * over those rows, mean over probes and the group's heads (GQA mean after pooling), avg pooling. */
static kvc_status probe_scores(const take_state *t, const float *qa, const kvc_layer_cache *L, int32_t h,
                               int64_t real, float *out) {
    const int64_t p = t->cfg->n_probe;
    const int32_t g = t->H / t->Hkv, d = t->d, k = t->cfg->kernel, half = k / 2;
    const float scale = 1.0f / sqrtf((float)d);
    float *probs = malloc(sizeof(float) * (size_t)p * (size_t)(real > 0 ? real : 1));
    float *qrows = malloc(sizeof(float) * (size_t)p * d);
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)p);
    double *acc = calloc((size_t)(real > 0 ? real : 1), sizeof(double));
    double *mean = calloc((size_t)(real > 0 ? real : 1), sizeof(double));
    if (!probs || !qrows || !vis || !acc || !mean) {
        free(probs); free(qrows); free(vis); free(acc); free(mean);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE probe scores");
    }
    for (int64_t j = 0; j < p; j++) vis[j] = real; /* the probes see the whole (real) cache */
    for (int32_t t2 = 0; t2 < g; t2++) {
        const int32_t hq = h * g + t2;
        for (int64_t j = 0; j < p; j++) memcpy(qrows + j * d, qa + (j * t->H + hq) * d, sizeof(float) * d);
        kvc_probs_rows(qrows, p, L->k[h], real, d, scale, vis, probs);
        for (int64_t r = 0; r < real; r++) {
            double s = 0;
            for (int64_t j = 0; j < p; j++) s += probs[(size_t)j * real + r];
            acc[r] = s;
        }
        for (int64_t r = 0; r < real; r++) { /* mean over probes, pooled, then GQA mean */
            double s = 0;
            for (int64_t u = r - half; u <= r + half; u++)
                if (u >= 0 && u < real) s += acc[u];
            mean[r] += s / p / k / g;
        }
    }
    for (int64_t r = 0; r < real; r++) out[r] = (float)mean[r];
    free(probs); free(qrows); free(vis); free(acc); free(mean);
    return KVC_OK;
}

static kvc_status take_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    take_state *t = user;
    const kvc_take_config *cfg = t->cfg;
    const int32_t l = ctx->layer, Hkv = t->Hkv, H = t->H, d = t->d;
    const int64_t p = cfg->n_probe;
    const int32_t W = cfg->warmup_layers;
    kvc_layer_cache *L = &s->cache.layers[l];

    /* EMA of the probe queries at this layer */
    float *qa = t->qa + (size_t)l * p * H * d;
    const float *qp = ctx->q + (ctx->n - p) * H * d;
    if (!t->has_qa[l]) {
        memcpy(qa, qp, sizeof(float) * (size_t)p * H * d);
        t->has_qa[l] = 1;
    } else {
        for (size_t i = 0; i < (size_t)p * H * d; i++) qa[i] = cfg->alpha * qa[i] + (1 - cfg->alpha) * qp[i];
    }
    const int64_t k = (!t->last_chunk && l < W) ? cfg->warmup_budget : cfg->budget;
    const int defer = cfg->delayed && l < W - 1; /* chosen later by layer W-1 */

    kvc_status st = KVC_OK;
    int64_t **keep = calloc((size_t)Hkv, sizeof *keep), *n_keep = calloc((size_t)Hkv, sizeof *n_keep);
    float *scores = NULL;
    if (!keep || !n_keep) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
    int64_t maxlen = 0;
    for (int32_t h = 0; h < Hkv; h++) maxlen = L->len[h] > maxlen ? L->len[h] : maxlen;
    if (st == KVC_OK && !(scores = malloc(sizeof(float) * (size_t)(maxlen > 0 ? maxlen : 1))))
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)(L->len[h] > 0 ? L->len[h] : 1))))
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");

    if (st == KVC_OK && cfg->use_inner && !defer) {
        /* any scorer: its window is the probes; select among the real rows, drop the probes */
        float **sc = calloc((size_t)Hkv, sizeof *sc);
        if (!sc) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            if (!(sc[h] = malloc(sizeof(float) * (size_t)(L->len[h] > 0 ? L->len[h] : 1)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory");
        if (st == KVC_OK) {
            kvc_press_config inner = cfg->inner;
            inner.window = (int32_t)p;
            inner.compression_ratio = 0;
            inner.budget = k;
            inner.allocation = KVC_ALLOC_UNIFORM;
            kvc_config mc = s->model->cfg;
            kvc_score_input in = {&mc, L, ctx, &inner};
            st = kvc_press_score(&in, sc);
            int64_t lens[64];
            for (int32_t h = 0; h < Hkv; h++) lens[h] = L->len[h] - p;
            if (st == KVC_OK)
                st = kvc_press_select(&inner, l, t->L, Hkv, lens, (const float *const *)sc, 0, -1, keep, n_keep);
        }
        if (sc)
            for (int32_t h = 0; h < Hkv; h++) free(sc[h]);
        free(sc);
    } else if (st == KVC_OK) {
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const int64_t real = L->len[h] - p;
            if (defer || real <= k) { /* keep every real row, drop the probes */
                for (int64_t r = 0; r < real; r++) keep[h][r] = r;
                n_keep[h] = real;
                continue;
            }
            st = probe_scores(t, qa, L, h, real, scores);
            if (st == KVC_OK) {
                kvc_topk_rows(scores, real, k, keep[h]);
                n_keep[h] = k;
            }
        }
    }
    if (st == KVC_OK) st = kvc_cache_compact(&s->cache, l, (const int64_t *const *)keep, n_keep, 0);
    if (st == KVC_OK && cfg->delayed && l == W - 1) {
        /* delayed eviction: the earlier warm-up layers hold the same rows as this one did */
        for (int32_t m = 0; m < W - 1 && st == KVC_OK; m++)
            st = kvc_cache_compact(&s->cache, m, (const int64_t *const *)keep, n_keep, 0);
    }
    if (keep)
        for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    free(keep);
    free(n_keep);
    free(scores);
    return st;
}

/* The same step on a GPU session (the chunk loop below is shared): the probe queries come to the
 * host for the EMA (p x H x d floats), the probe scores, top-k and compaction run on the device. */
static kvc_status take_dev_hook(void *user, void *ds, const kvc_dev_ctx *ctx, int32_t l, int64_t n,
                                const int64_t *past) {
    kvc_session *s = user;
    take_state *t = s->hook_user;
    const kvc_take_config *cfg = t->cfg;
    const int32_t Hkv = t->Hkv, H = t->H, d = t->d, W = cfg->warmup_layers;
    const int64_t p = cfg->n_probe;
    const size_t qn = (size_t)p * H * d;
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    float *qa = t->qa + (size_t)l * qn;
    if (!t->has_qa[l]) {
        KVC_TRY(a->download_ctx(ctx, KVC_DEV_Q, n - p, p, qa));
        t->has_qa[l] = 1;
    } else {
        float *qp = kvc_malloc(sizeof(float) * qn, "TAKE probe queries");
        if (!qp) return KVC_ERR_NOMEM;
        kvc_status st = a->download_ctx(ctx, KVC_DEV_Q, n - p, p, qp);
        for (size_t i = 0; st == KVC_OK && i < qn; i++) qa[i] = cfg->alpha * qa[i] + (1 - cfg->alpha) * qp[i];
        kvc_free(qp);
        KVC_TRY(st);
    }
    const int64_t k = (!t->last_chunk && l < W) ? cfg->warmup_budget : cfg->budget;
    const int defer = cfg->delayed && l < W - 1;
    int64_t lens[64], real[64], kk[64], n_keep[64] = {0};
    int64_t *keep[64] = {0};
    float *sc[64] = {0};
    kvc_status st = KVC_OK;
    int score = 0;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        lens[h] = a->cache_len(ds, l, h);
        real[h] = lens[h] - p;
        score |= !defer && real[h] > k;
        kk[h] = (defer || real[h] <= k) ? real[h] : k;
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)(lens[h] > 0 ? lens[h] : 1))))
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
    }
    if (st == KVC_OK && cfg->use_inner && !defer) {
        kvc_press_config inner = cfg->inner;
        inner.window = (int32_t)p;
        inner.compression_ratio = 0;
        inner.budget = k;
        inner.allocation = KVC_ALLOC_UNIFORM;
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            if (!(sc[h] = malloc(sizeof(float) * (size_t)(lens[h] > 0 ? lens[h] : 1))))
                st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
        int on_device = 0;
        if (st == KVC_OK) st = kvc_dev_layer_scores(s, ds, ctx, &inner, l, n, past, lens, sc, &on_device);
        if (st == KVC_OK)
            st = kvc_press_select(&inner, l, t->L, Hkv, real, (const float *const *)sc, 0, -1, keep, n_keep);
    } else if (st == KVC_OK && score) {
        st = a->probe_score(ds, l, qa, p, real, cfg->kernel);
        if (st == KVC_OK) st = a->select_topk(ds, l, real, kk, keep, n_keep);
    } else if (st == KVC_OK) { /* keep every real row, drop the probes */
        for (int32_t h = 0; h < Hkv; h++) {
            for (int64_t r = 0; r < real[h]; r++) keep[h][r] = r;
            n_keep[h] = real[h];
        }
    }
    if (st == KVC_OK) st = a->compact(ds, l, (const int64_t *const *)keep, n_keep, 0);
    if (st == KVC_OK && cfg->delayed && l == W - 1)
        for (int32_t m = 0; m < W - 1 && st == KVC_OK; m++)
            st = a->compact(ds, m, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) {
        free(keep[h]);
        free(sc[h]);
    }
    return st;
}

kvc_dev_hook kvc_take_dev_hook_for(const kvc_session *s) { return s->hook == take_hook ? take_dev_hook : NULL; }

kvc_status kvc_session_prefill_take(kvc_session *s, const int32_t *ids, int64_t n, const kvc_take_config *cfg_in,
                                    float *logits) {
    if (!s || !ids || !cfg_in) return kvc_fail(KVC_ERR_ARG, "prefill_take: null argument");
    kvc_take_config cfg = *cfg_in;
    const kvc_config *mc = &s->model->cfg;
    if (n < 1) return kvc_fail(KVC_ERR_ARG, "prefill_take: empty prompt");
    if (cfg.chunk_size < 1) return kvc_fail(KVC_ERR_ARG, "chunk_size must be >= 1, got %lld", (long long)cfg.chunk_size);
    if (cfg.budget < 1) return kvc_fail(KVC_ERR_ARG, "TAKE budget must be >= 1, got %lld", (long long)cfg.budget);
    if (cfg.n_probe < 1 || !cfg.probe_ids) return kvc_fail(KVC_ERR_ARG, "TAKE needs at least one probe token");
    if (cfg.kernel < 1 || cfg.kernel % 2 == 0) return kvc_fail(KVC_ERR_ARG, "kernel_size must be odd and >= 1");
    if (!(cfg.alpha >= 0 && cfg.alpha <= 1)) return kvc_fail(KVC_ERR_ARG, "alpha must be in [0, 1]");
    if (cfg.warmup_layers < 0) cfg.warmup_layers = mc->n_layers / 2;
    if (cfg.warmup_layers > mc->n_layers) return kvc_fail(KVC_ERR_ARG, "warmup_layers exceeds the %d layers", mc->n_layers);
    if (cfg.warmup_budget < cfg.budget) cfg.warmup_budget = cfg.budget;
    if (mc->n_kv_heads > 64) return kvc_fail(KVC_ERR_UNSUPPORTED, "TAKE supports at most 64 KV heads");
    for (int64_t i = 0; i < cfg.n_probe; i++)
        if (cfg.probe_ids[i] < 0 || cfg.probe_ids[i] >= mc->vocab) return kvc_fail(KVC_ERR_ARG, "probe token %d outside the vocabulary", cfg.probe_ids[i]);
    if (cfg.use_inner && cfg.inner.allocation != KVC_ALLOC_UNIFORM)
        return kvc_fail(KVC_ERR_ARG, "inside TAKE the layer budgets come from TAKE: use a plain scorer press");
    if (cfg.prompt_cached) {
        /* one chunk whose forward already ran (shared prefill): its K/V do not depend on the probes,
         * which come after it, so running only the probes now gives the cache of the one-call chunk */
        if (n > cfg.chunk_size)
            return kvc_fail(KVC_ERR_ARG, "prompt_cached: a %lld-token prompt is more than one chunk (%lld): "
                            "run the chunked prefill", (long long)n, (long long)cfg.chunk_size);
        if (cfg.n_probe < 2)
            return kvc_fail(KVC_ERR_ARG, "prompt_cached needs at least 2 probe tokens (one token is a decode step)");
        if (cfg.use_inner && cfg.inner.scorer == KVC_SCORE_OBSERVED)
            return kvc_fail(KVC_ERR_ARG, "prompt_cached: the observed-attention scorer reads every query of the "
                            "chunk's call, which already ran: run the chunked prefill");
        int full = kvc_session_position(s) == n;
        for (int32_t l = 0; full && l < mc->n_layers; l++)
            for (int32_t h = 0; full && h < mc->n_kv_heads; h++) full = kvc_session_cache_len(s, l, h) == n;
        if (!full)
            return kvc_fail(KVC_ERR_ARG, "prompt_cached: the session must hold the full cache of the %lld prompt "
                            "tokens and nothing else", (long long)n);
    }

    take_state t = {&cfg, mc->n_layers, mc->n_heads, mc->n_kv_heads, mc->head_dim, NULL, NULL, 0};
    const size_t qa_floats = (size_t)t.L * cfg.n_probe * t.H * t.d;
    t.qa = kvc_malloc(sizeof(float) * qa_floats, "TAKE probe queries");
    t.has_qa = calloc((size_t)t.L, 1);
    int32_t *buf = cfg.prompt_cached ? NULL : malloc(sizeof(int32_t) * (size_t)(cfg.chunk_size + cfg.n_probe));
    kvc_status st = (!t.qa || !t.has_qa || (!buf && !cfg.prompt_cached)) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE")
                                                                          : KVC_OK;

    /* our hook replaces any attached press for the duration */
    kvc_layer_hook saved_hook = s->hook;
    void *saved_user = s->hook_user;
    void (*saved_free)(void *) = s->hook_free;
    s->hook = take_hook;
    s->hook_user = &t;
    s->hook_free = NULL;
    if (st == KVC_OK && cfg.prompt_cached) {
        const int64_t pos0 = s->pos;
        t.last_chunk = 1;
        st = kvc_forward_ex(s, cfg.probe_ids, cfg.n_probe, NULL, 0, KVC_ROW_NONE, NULL);
        if (st == KVC_OK) s->pos = pos0;
    }
    for (int64_t start = 0; start < n && st == KVC_OK && !cfg.prompt_cached; start += cfg.chunk_size) {
        const int64_t len = n - start < cfg.chunk_size ? n - start : cfg.chunk_size;
        t.last_chunk = start + len == n;
        memcpy(buf, ids + start, sizeof(int32_t) * (size_t)len);
        memcpy(buf + len, cfg.probe_ids, sizeof(int32_t) * (size_t)cfg.n_probe);
        const int64_t pos0 = s->pos;
        st = kvc_forward_ex(s, buf, len + cfg.n_probe, NULL, 0, t.last_chunk && logits ? len - 1 : KVC_ROW_NONE, logits);
        if (st == KVC_OK) s->pos = pos0 + len; /* the probes' positions are reused by the next chunk */
    }
    if (st != KVC_OK) s->needs_reset = 1;
    s->hook = saved_hook;
    s->hook_user = saved_user;
    s->hook_free = saved_free;
    kvc_free(t.qa);
    free(t.has_qa);
    free(buf);
    return st;
}
