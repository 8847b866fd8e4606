/* TAKE: chunked prefill with probe tokens and delayed eviction (TAKE-chunked-prefill-eviction.txt,
 * Eq. 3-13; docs/METHODS.md "TAKE").
 *
 * The prompt goes through the model in chunks of Z tokens, each followed by the p probe tokens.
 * After a layer's attention, the probes' queries (accumulated over chunks with an EMA) score the
 * layer's cache, the top-k rows per KV head are kept and the probe rows are dropped, so a later
 * chunk attends only to the pruned past and the cache per layer never exceeds Z + p + k rows.
 * Delayed eviction: layers 0..W-2 are not scored; the rows layer W-1 keeps prune all of 0..W-1.
 * On a session that holds rows, the hook scores every row of the layer (the session's press scope 'cache': the
 * conversation's cache goes on as one long prompt), or, with the press scope 'call', only the rows this call
 * appends: the rows held before its first chunk are set aside for the hook (kvc_door_aside) and stay. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"
#include "press.h"

typedef struct take_state {
    const kvc_take_config *cfg;
    const kvc_press_config *inner; /* the inner press's settings (cfg->inner's), or NULL */
    int32_t L, H, Hkv, d;
    float *qa;          /* [L, p, H, d] accumulated probe queries (host) */
    float *qp;          /* [p, H, d] this chunk's probe queries (host scratch) */
    char *has_qa;       /* [L] */
    int last_chunk;
    kvc_buf *qbuf;      /* f32 [p, H*d] on the backend: a layer's accumulated probes, scored there */
    kvc_buf *scores;    /* the backend's score buffer, f32 [Hkv, ld] */
    int64_t ld;
    int64_t *mark;      /* [L, Hkv] rows held before the call, kept out of its scope (press scope 'call'), or NULL */
} take_state;

void kvc_take_config_defaults(kvc_take_config *c) {
    memset(c, 0, sizeof *c);
    c->chunk_size = 4096;
    c->kernel = 7;
    c->alpha = 0.2f;
    c->delayed = 1;
    c->warmup_layers = -1; /* half the layers */
}

/* The probes' accumulated queries score the first real[h] rows of each head on the backend (softmax over
 * those rows, mean over the probes, average pooling, GQA mean), and the top kk[h] are kept. */
static kvc_status probe_select(take_state *t, kvc_session *s, int32_t l, const float *qa, const int64_t *real,
                               const int64_t *kk, int64_t *const *keep) {
    const kvc_backend *be = kvc_door_backend(s);
    const int64_t p = t->cfg->n_probe, qd = (int64_t)t->H * t->d;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < t->Hkv; h++) maxlen = real[h] > maxlen ? real[h] : maxlen;
    KVC_TRY(kvc_score_buffer(be, t->Hkv, &t->scores, &t->ld, maxlen));
    if (!t->qbuf) KVC_TRY(be->alloc(KVC_F32, p * qd, KVC_MEM_ACT, "TAKE probe queries", &t->qbuf));
    KVC_TRY(be->upload(kvc_view_of(t->qbuf, 0, qd), p, qd, qa, KVC_F32));
    kvc_score_args a;
    memset(&a, 0, sizeof a);
    a.scorer = KVC_SCORE_PROBE;
    a.layer = l;
    a.H = t->H;
    a.Hkv = t->Hkv;
    a.d = t->d;
    a.kv = kvc_door_cache(s)->layers[l].kv;
    a.len = real;
    a.q = kvc_view_of(t->qbuf, 0, qd);
    a.n = p;
    a.kernel = t->cfg->kernel;
    a.pool_then_reduce = 1;
    a.scores = kvc_view_of(t->scores, 0, t->ld);
    KVC_TRY(be->score(&a));
    return be->topk(a.scores, t->Hkv, real, kk, keep);
}

/* Delayed eviction: the warm-up layers m < l hold this call's rows as layer l held them before its choice (its
 * rows after the marks, in the same order): they keep the same ones; the rows held before the call stay. */
static kvc_status delayed_prune(take_state *t, kvc_session *s, int32_t l, const int64_t *real, int64_t *const *keep,
                                const int64_t *n_keep) {
    kvc_cache *c = kvc_door_cache(s);
    const int32_t Hkv = t->Hkv;
    int64_t *km[KVC_MAX_KV_HEADS] = {0}, nm[KVC_MAX_KV_HEADS];
    kvc_status st = KVC_OK;
    for (int32_t m = 0; m < l && st == KVC_OK; m++) {
        const kvc_layer_cache *M = &c->layers[m];
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const int64_t base = t->mark ? t->mark[(size_t)m * Hkv + h] : 0;
            int same = M->len[h] - base == real[h];
            for (int64_t r = 0; same && r < real[h]; r++) same = M->pos[h][base + r] == c->layers[l].pos[h][r];
            if (!same)
                st = kvc_fail(KVC_ERR_UNSUPPORTED, "TAKE's delayed eviction prunes layers 0..%d with layer %d's choice, but "
                              "layer %d head %d holds other rows than layer %d (a cache another press compressed): use "
                              "delayed=False", l, l, m, h, l);
            else if (!(km[h] = malloc(sizeof(int64_t) * (size_t)(base + n_keep[h] > 0 ? base + n_keep[h] : 1))))
                st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
            for (int64_t r = 0; st == KVC_OK && r < base; r++) km[h][r] = r;
            for (int64_t i = 0; st == KVC_OK && i < n_keep[h]; i++) km[h][base + i] = base + keep[h][i];
            nm[h] = base + n_keep[h];
        }
        if (st == KVC_OK) st = kvc_cache_compact(c, m, (const int64_t *const *)km, nm, 0);
        for (int32_t h = 0; h < Hkv; h++) {
            free(km[h]);
            km[h] = NULL;
        }
    }
    return st;
}

static kvc_status take_layer(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    take_state *t = user;
    const kvc_take_config *cfg = t->cfg;
    const int32_t l = ctx->layer, Hkv = t->Hkv, W = cfg->warmup_layers;
    const int64_t p = cfg->n_probe, qn = p * t->H * t->d;
    const int64_t *len = kvc_door_cache(s)->layers[l].len;

    /* EMA of the probe queries at this layer (the call's last p rows) */
    float *qa = t->qa + (size_t)l * qn;
    KVC_TRY(kvc_door_backend(s)->download(kvc_view_at(ctx->q, ctx->n - p, 0), p, (int64_t)t->H * t->d, t->qp, KVC_F32));
    if (!t->has_qa[l]) {
        memcpy(qa, t->qp, sizeof(float) * (size_t)qn);
        t->has_qa[l] = 1;
    } else {
        for (int64_t i = 0; i < qn; i++) qa[i] = cfg->alpha * qa[i] + (1 - cfg->alpha) * t->qp[i];
    }
    const int64_t k = (!t->last_chunk && l < W) ? cfg->warmup_budget : cfg->budget;
    const int defer = cfg->delayed && l < W - 1; /* chosen later by layer W-1 */

    int64_t real[KVC_MAX_KV_HEADS], kk[KVC_MAX_KV_HEADS], n_keep[KVC_MAX_KV_HEADS] = {0};
    int64_t *keep[KVC_MAX_KV_HEADS] = {0};
    float *sc[KVC_MAX_KV_HEADS] = {0};
    kvc_status st = KVC_OK;
    int score = 0;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        real[h] = len[h] - p;
        score |= !defer && real[h] > k;
        kk[h] = (defer || real[h] <= k) ? real[h] : k;
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)(len[h] > 0 ? len[h] : 1))))
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
    }
    if (st == KVC_OK && t->inner && !defer) {
        /* any scorer: its window is the probes; select among the real rows, the probes go */
        kvc_press_config inner = *t->inner;
        inner.window = (int32_t)p;
        inner.compression_ratio = 0;
        inner.budget = k;
        inner.allocation = KVC_ALLOC_UNIFORM;
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            if (!(sc[h] = malloc(sizeof(float) * (size_t)(len[h] > 0 ? len[h] : 1))))
                st = kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
        const kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
        if (st == KVC_OK) st = kvc_score_layer(&lr, ctx, &inner, (int32_t)p, len, &t->scores, &t->ld, sc);
        if (st == KVC_OK) st = kvc_press_select(&inner, l, t->L, Hkv, real, (const float *const *)sc, 0, -1, keep, n_keep);
    } else if (st == KVC_OK && score) {
        st = probe_select(t, s, l, qa, real, kk, keep);
        for (int32_t h = 0; h < Hkv; h++) n_keep[h] = kk[h];
    } else if (st == KVC_OK) { /* keep every real row, drop the probes */
        for (int32_t h = 0; h < Hkv; h++) {
            for (int64_t r = 0; r < real[h]; r++) keep[h][r] = r;
            n_keep[h] = real[h];
        }
    }
    /* delayed eviction: the earlier warm-up layers hold the same rows as this one did (checked before it evicts) */
    if (st == KVC_OK && cfg->delayed && l == W - 1) st = delayed_prune(t, s, l, real, keep, n_keep);
    if (st == KVC_OK) st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) {
        free(keep[h]);
        free(sc[h]);
    }
    return st;
}

static kvc_status take_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    take_state *t = user;
    if (!t->mark) return take_layer(user, s, ctx);
    return kvc_door_aside(s, ctx, t->mark + (size_t)ctx->layer * t->Hkv, take_layer, t); /* press scope 'call' */
}

/* The rows each head holds before the call, set aside for its hooks (the press scope 'call'), or NULL. */
static kvc_status call_mark(kvc_session *s, int32_t L, int32_t Hkv, int64_t **out) {
    *out = NULL;
    const kvc_cache *c = kvc_door_cache(s);
    if (kvc_door_press_scope(s) != KVC_PRESS_SCOPE_CALL || kvc_cache_is_empty(c)) return KVC_OK;
    if (!(*out = malloc(sizeof(int64_t) * (size_t)L * (size_t)Hkv))) return kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE");
    for (int32_t l = 0; l < L; l++) memcpy(*out + (size_t)l * Hkv, c->layers[l].len, sizeof(int64_t) * (size_t)Hkv);
    return KVC_OK;
}

kvc_status kvc_take_prefill(kvc_session *s, const int32_t *ids, int64_t n, const kvc_take_config *cfg_in, float *logits) {
    const kvc_backend *be = kvc_door_backend(s);
    kvc_take_config cfg = *cfg_in;
    const kvc_press_config *in = kvc_press_spec_config(cfg.inner); /* NULL: probe attention */
    const kvc_config *mc = &kvc_door_model(s)->cfg;
    if (n < 1) return kvc_fail(KVC_ERR_ARG, "prefill_take: empty prompt");
    if (cfg.chunk_size < 1) return kvc_fail(KVC_ERR_ARG, "chunk_size must be >= 1, got %lld", (long long)cfg.chunk_size);
    if (cfg.budget < 1) return kvc_fail(KVC_ERR_ARG, "TAKE budget must be >= 1, got %lld", (long long)cfg.budget);
    if (cfg.n_probe < 1 || !cfg.probe_ids) return kvc_fail(KVC_ERR_ARG, "TAKE needs at least one probe token");
    if (cfg.kernel < 1 || cfg.kernel % 2 == 0) return kvc_fail(KVC_ERR_ARG, "kernel_size must be odd and >= 1");
    if (!(cfg.alpha >= 0 && cfg.alpha <= 1)) return kvc_fail(KVC_ERR_ARG, "alpha must be in [0, 1]");
    if (cfg.warmup_layers < 0) cfg.warmup_layers = mc->n_layers / 2;
    if (cfg.warmup_layers > mc->n_layers) return kvc_fail(KVC_ERR_ARG, "warmup_layers exceeds the %d layers", mc->n_layers);
    if (cfg.warmup_budget < cfg.budget) cfg.warmup_budget = cfg.budget;
    for (int64_t i = 0; i < cfg.n_probe; i++)
        if (cfg.probe_ids[i] < 0 || cfg.probe_ids[i] >= mc->vocab) return kvc_fail(KVC_ERR_ARG, "probe token %d outside the vocabulary", cfg.probe_ids[i]);
    if (in && in->allocation != KVC_ALLOC_UNIFORM)
        return kvc_fail(KVC_ERR_ARG, "inside TAKE the layer budgets come from TAKE: use a plain scorer press");
    if (in) { /* the inner scorer's own settings; TAKE sets its window (the probes) and budgets */
        kvc_press_config inner = *in;
        inner.window = (int32_t)(cfg.n_probe < INT32_MAX ? cfg.n_probe : INT32_MAX);
        inner.compression_ratio = 0;
        inner.budget = 0;
        KVC_TRY(kvc_press_config_check(&inner));
    }
    if (cfg.prompt_cached) {
        /* one chunk whose forward already ran (shared prefill): its K/V do not depend on the probes,
         * which come after it, so running only the probes now gives the cache of the one-call chunk */
        if (n > cfg.chunk_size)
            return kvc_fail(KVC_ERR_ARG, "prompt_cached: a %lld-token prompt is more than one chunk (%lld): "
                            "run the chunked prefill", (long long)n, (long long)cfg.chunk_size);
        if (cfg.n_probe < 2)
            return kvc_fail(KVC_ERR_ARG, "prompt_cached needs at least 2 probe tokens (one token is a decode step)");
        if (in && kvc_scorer_has(in->scorer, KVC_SCORER_FIRST_ONLY))
            return kvc_fail(KVC_ERR_ARG, "prompt_cached: the observed-attention scorer reads every query of the "
                            "chunk's call, which already ran: run the chunked prefill");
        if (kvc_door_position(s) != n || !kvc_door_holds_full_cache(s))
            return kvc_fail(KVC_ERR_ARG, "prompt_cached: the session must hold the full cache of the %lld prompt "
                            "tokens and nothing else", (long long)n);
    }

    take_state t;
    memset(&t, 0, sizeof t);
    t.cfg = &cfg;
    t.inner = in;
    t.L = mc->n_layers;
    t.H = mc->n_heads;
    t.Hkv = mc->n_kv_heads;
    t.d = mc->head_dim;
    const size_t qn = (size_t)cfg.n_probe * t.H * t.d;
    t.qa = kvc_malloc(sizeof(float) * qn * (size_t)t.L, "TAKE probe queries");
    t.qp = kvc_malloc(sizeof(float) * qn, "TAKE probe queries");
    t.has_qa = calloc((size_t)t.L, 1);
    int32_t *buf = cfg.prompt_cached ? NULL : malloc(sizeof(int32_t) * (size_t)(cfg.chunk_size + cfg.n_probe));
    kvc_status st = (!t.qa || !t.qp || !t.has_qa || (!buf && !cfg.prompt_cached)) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: TAKE")
                                                                                  : KVC_OK;
    if (st == KVC_OK && !cfg.prompt_cached) st = call_mark(s, t.L, t.Hkv, &t.mark);

    /* TAKE's hook replaces the attached presses for the duration (the door's probes) */
    if (st == KVC_OK && cfg.prompt_cached) {
        t.last_chunk = 1;
        st = kvc_door_probe(s, cfg.probe_ids, cfg.n_probe, NULL, 0, take_hook, &t, KVC_ROW_NONE, NULL, 0);
    }
    for (int64_t start = 0; start < n && st == KVC_OK && !cfg.prompt_cached; start += cfg.chunk_size) {
        const int64_t len = n - start < cfg.chunk_size ? n - start : cfg.chunk_size;
        t.last_chunk = start + len == n;
        memcpy(buf, ids + start, sizeof(int32_t) * (size_t)len);
        memcpy(buf + len, cfg.probe_ids, sizeof(int32_t) * (size_t)cfg.n_probe);
        /* the probes' positions are reused by the next chunk */
        st = kvc_door_probe(s, buf, len + cfg.n_probe, NULL, 0, take_hook, &t,
                            t.last_chunk && logits ? len - 1 : KVC_ROW_NONE, logits, len);
    }
    if (st != KVC_OK) kvc_door_request_reset(s);
    kvc_backend_lock(be);
    if (t.qbuf) be->free(t.qbuf);
    if (t.scores) be->free(t.scores);
    kvc_backend_unlock(be);
    kvc_free(t.qa);
    kvc_free(t.qp);
    free(t.has_qa);
    free(t.mark);
    free(buf);
    return st;
}

kvc_status kvc_session_prefill_take(kvc_session *s, const int32_t *ids, int64_t n, const kvc_take_config *cfg,
                                    float *logits) {
    if (!s || !ids || !cfg) return kvc_fail(KVC_ERR_ARG, "prefill_take: null argument");
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "TAKE"));
    return kvc_take_prefill(s, ids, n, cfg, logits);
}
