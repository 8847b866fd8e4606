/* Sessions of a model that lives on the GPU: the public session functions dispatch here when
 * s->dev is set, and the press attached to such a session acts through the device press hook below.
 *
 * The hook follows kvc_press_hook (press/press.c) step by step, with the layer's cache on the
 * device: scores on the GPU for the scorers it has (SnapKV, TOVA, Knorm, Streaming, Random, EDIE), on
 * the host from downloaded K/V and queries for ObservedAttention (it needs every query's attention,
 * which the flash-style kernel never forms); the scores come to
 * the host (E_internal for TADA, recorded scores); allocation and selection are the CPU's
 * (kvc_press_select: Ada-KV, ChunkKV, layer totals), except uniform and PyramidKV token selection,
 * which picks the top-k on the GPU; then the layer is compacted on the GPU (real eviction).
 * Not on the device: Ada-KV's eviction-loss diagnostic (kvc_session_press_error gives NaN). */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "../press/press.h"
#include "cuda_loader.h"

static const kvc_cuda_api *api_of(void) {
    const kvc_cuda_api *a = NULL;
    kvc_cuda_api_get(&a);
    return a;
}

kvc_status kvc_dev_session_new(kvc_session *s, int64_t capacity_hint) {
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    return a->session_new(s->model->cuda, capacity_hint, &s->dev);
}

void kvc_dev_session_free(kvc_session *s) {
    const kvc_cuda_api *a = api_of();
    if (a && s->dev) a->session_free(s->dev);
    s->dev = NULL;
}

void kvc_dev_session_reset(kvc_session *s) {
    const kvc_cuda_api *a = api_of();
    if (a && s->dev) a->session_clear(s->dev);
}

kvc_status kvc_dev_copy_cache(kvc_session *dst, const kvc_session *src) {
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    return a->session_copy(dst->dev, src->dev);
}

int64_t kvc_dev_cache_len(const kvc_session *s, int32_t layer, int32_t h) { return api_of()->cache_len(s->dev, layer, h); }
size_t kvc_dev_cache_bytes(const kvc_session *s) { return api_of()->cache_bytes(s->dev); }
size_t kvc_dev_peak_cache_bytes(const kvc_session *s) { return api_of()->peak_cache_bytes(s->dev); }

kvc_status kvc_dev_cache_positions(const kvc_session *s, int32_t layer, int32_t h, int64_t *out) {
    const kvc_cuda_api *a = api_of();
    const int64_t n = a->cache_len(s->dev, layer, h);
    if (n > 0) memcpy(out, a->cache_positions(s->dev, layer, h), sizeof(int64_t) * (size_t)n);
    return KVC_OK;
}

kvc_status kvc_dev_truncate(kvc_session *s, const int64_t *new_len, int64_t position) {
    const kvc_cuda_api *a = api_of();
    const kvc_config *c = &s->model->cfg;
    const int32_t Hkv = c->n_kv_heads;
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t h = 0; h < Hkv; h++) {
            const int64_t len = a->cache_len(s->dev, l, h);
            if (new_len[l * Hkv + h] < 0 || new_len[l * Hkv + h] > len)
                return kvc_fail(KVC_ERR_ARG, "layer %d head %d holds %lld tokens: cannot truncate to %lld", l, h,
                                (long long)len, (long long)new_len[l * Hkv + h]);
        }
    for (int32_t l = 0; l < c->n_layers; l++) KVC_TRY(a->truncate(s->dev, l, new_len + (size_t)l * Hkv));
    s->pos = position;
    return KVC_OK;
}

/* ---- the press on the device --------------------------------------------------------------------- */

/* Scores on the host for a scorer the GPU lacks (observed attention): the layer's K/V and this call's
 * queries come down, and the CPU scorer runs on them exactly as on a CPU session. */
static kvc_status host_scores(kvc_session *s, void *ds, const kvc_dev_ctx *ctx, const kvc_press_config *cfg,
                              int32_t layer, int64_t n, const int64_t *past, const int64_t *lens, float *const *scores) {
    const kvc_cuda_api *a = api_of();
    const kvc_config *c = &s->model->cfg;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim;
    const size_t qd = (size_t)c->n_heads * d;
    float *kh[64] = {0}, *vh[64] = {0};
    float *q = kvc_malloc(sizeof(float) * (size_t)n * qd, "press: queries on the host");
    kvc_status st = q ? KVC_OK : KVC_ERR_NOMEM;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        kh[h] = kvc_malloc(sizeof(float) * (size_t)(lens[h] > 0 ? lens[h] : 1) * d, "press: keys on the host");
        vh[h] = kvc_malloc(sizeof(float) * (size_t)(lens[h] > 0 ? lens[h] : 1) * d, "press: values on the host");
        if (!kh[h] || !vh[h]) st = KVC_ERR_NOMEM;
    }
    if (st == KVC_OK) st = a->download_layer(ds, layer, kh, vh);
    if (st == KVC_OK) st = a->download_ctx(ctx, KVC_DEV_Q, 0, n, q);
    if (st == KVC_OK) {
        int64_t lens_copy[64];
        memcpy(lens_copy, lens, sizeof(int64_t) * (size_t)Hkv);
        kvc_layer_cache L;
        memset(&L, 0, sizeof L);
        L.len = lens_copy;
        L.cap = lens_copy;
        L.k = kh;
        L.v = vh;
        kvc_layer_ctx hctx = {layer, n, past, q, NULL, NULL, NULL}; /* observed attention: no outputs needed */
        kvc_score_input in = {c, &L, &hctx, cfg};
        st = kvc_press_score(&in, scores);
    }
    for (int32_t h = 0; h < Hkv; h++) {
        kvc_free(kh[h]);
        kvc_free(vh[h]);
    }
    kvc_free(q);
    return st;
}

kvc_status kvc_dev_layer_scores(kvc_session *s, void *ds, const kvc_dev_ctx *ctx, const kvc_press_config *cfg,
                                int32_t layer, int64_t n, const int64_t *past, const int64_t *lens, float *const *scores,
                                int *on_device) {
    const kvc_cuda_api *a = api_of();
    *on_device = kvc_scorer_on_device(cfg->scorer);
    if (!*on_device) return host_scores(s, ds, ctx, cfg, layer, n, past, lens, scores);
    KVC_TRY(a->score(ds, ctx, cfg, layer));
    return a->scores_to_host(ds, layer, lens, scores);
}

static kvc_status dev_press_hook(void *user, void *ds, const kvc_dev_ctx *ctx, int32_t layer, int64_t n,
                                 const int64_t *past) {
    kvc_session *s = user;
    kvc_press *p = s->hook_user;
    const kvc_press_config *cfg = &p->cfg;
    const kvc_cuda_api *a = api_of();
    if (n <= 1) return KVC_OK;
    if (cfg->reuse_layers > 1 && layer % cfg->reuse_layers == 0) p->reuse_len = 0;
    if (cfg->budget == 0 && cfg->compression_ratio == 0) return KVC_OK;
    const kvc_config *c = &s->model->cfg;
    const int32_t Hkv = c->n_kv_heads;
    int64_t lens[64];
    for (int32_t h = 0; h < Hkv; h++) lens[h] = a->cache_len(ds, layer, h);
    const int32_t w = kvc_scorer_has_window(cfg->scorer) ? cfg->window : 0;
    for (int32_t h = 0; h < Hkv && w > 0; h++)
        if (lens[h] <= w)
            return kvc_fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%d)",
                            (long long)lens[h], w);
    if (w > 0 && n < w)
        return kvc_fail(KVC_ERR_ARG, "the press window (%d) is longer than this forward call (%lld tokens)", w, (long long)n);
    if (cfg->scorer == KVC_SCORE_STREAMING)
        for (int32_t h = 0; h < Hkv; h++)
            if (lens[h] <= cfg->n_sink)
                return kvc_fail(KVC_ERR_ARG, "StreamingLLM needs more tokens (%lld) than n_sink (%d)", (long long)lens[h],
                                cfg->n_sink);
    if (cfg->budget > 0 && !cfg->drop_window) {
        int evict = 0;
        for (int32_t h = 0; h < Hkv; h++) evict |= lens[h] > cfg->budget;
        if (!evict) return KVC_OK;
    }
    kvc_status st = KVC_OK;
    float *scores[64] = {0};
    int64_t *keep[64] = {0}, n_keep[64] = {0};
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        scores[h] = malloc(sizeof(float) * (size_t)(lens[h] > 0 ? lens[h] : 1));
        keep[h] = malloc(sizeof(int64_t) * (size_t)(lens[h] > 0 ? lens[h] : 1));
        if (!scores[h] || !keep[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    }
    const double t0 = omp_get_wtime();
    int reused = 0;
    if (st == KVC_OK && cfg->reuse_layers > 1 && layer % cfg->reuse_layers != 0 && p->reuse_len > 0) {
        reused = 1;
        for (int32_t h = 0; h < Hkv; h++) reused &= lens[h] == p->reuse_len;
        if (reused)
            for (int32_t h = 0; h < Hkv; h++) {
                n_keep[h] = p->reuse_n[h];
                memcpy(keep[h], p->reuse_rows + (size_t)h * p->reuse_len, sizeof(int64_t) * (size_t)n_keep[h]);
            }
    }
    if (st == KVC_OK && !reused) {
        int on_device = 0;
        st = kvc_dev_layer_scores(s, ds, ctx, cfg, layer, n, past, lens, scores, &on_device);
        const int device_topk = on_device && !cfg->drop_window && cfg->chunk_length == 0 &&
                                (cfg->allocation == KVC_ALLOC_UNIFORM || cfg->allocation == KVC_ALLOC_PYRAMID);
        if (st == KVC_OK && device_topk) {
            int64_t k[64];
            for (int32_t h = 0; h < Hkv; h++) k[h] = kvc_layer_budget(cfg, layer, c->n_layers, lens[h]);
            st = a->select_topk(ds, layer, lens, k, keep, n_keep);
        } else if (st == KVC_OK && cfg->drop_window) {
            int64_t sel[64];
            for (int32_t h = 0; h < Hkv; h++) sel[h] = lens[h] - w;
            st = kvc_press_select(cfg, layer, c->n_layers, Hkv, sel, (const float *const *)scores, 0,
                                  p->layer_totals[layer], keep, n_keep);
        } else if (st == KVC_OK) {
            st = kvc_press_select(cfg, layer, c->n_layers, Hkv, lens, (const float *const *)scores, w,
                                  p->layer_totals[layer], keep, n_keep);
        }
        if (st == KVC_OK) {
            /* TADA statistics, as layer_stats in press.c */
            double e = 0;
            for (int32_t h = 0; h < Hkv; h++)
                for (int64_t r = 0; r < lens[h] - w; r++) e += scores[h][r];
            p->e_internal[layer] = e;
            double dis = NAN;
            st = a->dissimilarity(ctx, w, &dis);
            p->dissim[layer] = dis;
        }
        if (st == KVC_OK && cfg->reuse_layers > 1) {
            int same = 1;
            for (int32_t h = 1; h < Hkv; h++) same &= lens[h] == lens[0];
            p->reuse_len = 0;
            if (same) {
                int64_t *rows = realloc(p->reuse_rows, sizeof(int64_t) * (size_t)(lens[0] > 0 ? lens[0] : 1) * Hkv);
                if (!rows) {
                    st = kvc_fail(KVC_ERR_NOMEM, "out of memory: layer index reuse");
                } else {
                    p->reuse_rows = rows;
                    for (int32_t h = 0; h < Hkv; h++) {
                        memcpy(rows + (size_t)h * lens[0], keep[h], sizeof(int64_t) * (size_t)n_keep[h]);
                        p->reuse_n[h] = n_keep[h];
                    }
                    p->reuse_len = lens[0];
                }
            }
        }
    }
    p->layer_seconds[layer] = omp_get_wtime() - t0;
    if (st == KVC_OK && cfg->record_scores && !reused) {
        for (int32_t h = 0; h < Hkv; h++) {
            const size_t i = (size_t)layer * Hkv + h;
            free(p->scores[i]);
            p->scores[i] = scores[h];
            p->score_len[i] = lens[h];
            scores[h] = NULL;
        }
        p->error[layer] = NAN; /* the eviction-loss diagnostic is CPU only */
    }
    if (st == KVC_OK) st = a->compact(ds, layer, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) {
        free(scores[h]);
        free(keep[h]);
    }
    return st;
}

static kvc_status hook_for(const kvc_session *s, kvc_dev_hook *out) {
    *out = NULL;
    if (!s->hook) return KVC_OK;
    if (s->hook == kvc_press_hook) {
        *out = dev_press_hook;
        return KVC_OK;
    }
    if ((*out = kvc_take_dev_hook_for(s))) return KVC_OK;
    return kvc_fail(KVC_ERR_UNSUPPORTED, "this session's layer hook has no CUDA version (use device='cpu')");
}

kvc_status kvc_dev_forward(kvc_session *s, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb,
                           int64_t logits_row, float *logits) {
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    const int32_t nf = s->n_followers;
    if (nf > 64) return kvc_fail(KVC_ERR_ARG, "at most 64 followers on the GPU");
    kvc_dev_hook hook, fh[64];
    void *fdev[64], *fu[64];
    KVC_TRY(hook_for(s, &hook));
    for (int32_t i = 0; i < nf; i++) {
        if (!s->followers[i]->dev) return kvc_fail(KVC_ERR_ARG, "follower %d is not a GPU session", i);
        KVC_TRY(hook_for(s->followers[i], &fh[i]));
        fdev[i] = s->followers[i]->dev;
        fu[i] = s->followers[i];
    }
    kvc_status st = a->forward(s->dev, ids, n_ids, emb, n_emb, s->pos, logits_row, logits, hook, s, fdev, fh, fu, nf);
    if (st != KVC_OK) {
        /* a press may have compacted layers before the failure: their old rows are gone */
        if (s->hook) s->needs_reset = 1;
        return st;
    }
    s->pos += n_ids + n_emb;
    return KVC_OK;
}

kvc_status kvc_dev_forward_batch(kvc_session *const *ss, int32_t B, const int32_t *ids, float *logits) {
    const kvc_cuda_api *a;
    KVC_TRY(kvc_cuda_api_get(&a));
    void **dev = malloc(sizeof(void *) * (size_t)B);
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)B);
    kvc_status st = dev && pos ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: batch");
    for (int32_t i = 0; i < B && st == KVC_OK; i++) {
        if (!ss[i]->dev) st = kvc_fail(KVC_ERR_ARG, "session %d is not a GPU session", i);
        dev[i] = ss[i]->dev;
        pos[i] = ss[i]->pos;
    }
    if (st == KVC_OK) st = a->forward_batch(dev, B, ids, pos, logits);
    if (st == KVC_OK)
        for (int32_t i = 0; i < B; i++) ss[i]->pos += 1;
    free(dev);
    free(pos);
    return st;
}
