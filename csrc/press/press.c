/* The post-prefill schedule: a press attached to a session compresses each layer right after its
 * attention during a multi-token forward (kvpress semantics), then evicts for real (compaction).
 * Also the public press API and its diagnostics. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "../backend/cuda_loader.h"
#include "press.h"

void kvc_press_config_defaults(kvc_press_config *c) {
    memset(c, 0, sizeof *c);
    c->scorer = KVC_SCORE_SNAPKV;
    c->allocation = KVC_ALLOC_UNIFORM;
    c->window = 64;
    c->kernel = 5;
    c->pool_then_reduce = 1;
    c->n_sink = 4;
    c->alpha_safeguard = 0.2f;
    c->safeguard = KVC_SAFEGUARD_PROTECT;
    c->pyramid_beta = 20;
    c->reuse_layers = 1;
    c->edie_alpha = 0.1f;
}

static int uses_window(int32_t scorer) { return kvc_scorer_has_window(scorer); }

static kvc_status validate(const kvc_press_config *c) {
    if (c->scorer < KVC_SCORE_STREAMING || c->scorer > KVC_SCORE_EDIE)
        return kvc_fail(KVC_ERR_ARG, "unknown scorer %d", c->scorer);
    if (c->allocation < KVC_ALLOC_UNIFORM || c->allocation > KVC_ALLOC_LAYER)
        return kvc_fail(KVC_ERR_ARG, "unknown allocation %d", c->allocation);
    if (!(c->compression_ratio >= 0 && c->compression_ratio < 1))
        return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1), got %g", c->compression_ratio);
    if (c->budget < 0) return kvc_fail(KVC_ERR_ARG, "budget must be >= 0 (0: use compression_ratio), got %lld", (long long)c->budget);
    if (uses_window(c->scorer) && c->window < 1) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 1, got %d", c->window);
    if (c->window < 0) return kvc_fail(KVC_ERR_ARG, "window_size must be >= 0");
    if (c->kernel < 1 || c->kernel % 2 == 0) return kvc_fail(KVC_ERR_ARG, "kernel_size must be odd and >= 1, got %d", c->kernel);
    if (c->n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0");
    if (!(c->alpha_safeguard >= 0 && c->alpha_safeguard <= 1)) return kvc_fail(KVC_ERR_ARG, "alpha_safeguard must be in [0, 1]");
    if (c->safeguard != KVC_SAFEGUARD_FLOOR && c->safeguard != KVC_SAFEGUARD_PROTECT) return kvc_fail(KVC_ERR_ARG, "unknown safeguard %d", c->safeguard);
    if (!(c->edie_alpha > 0 && c->edie_alpha < 100)) return kvc_fail(KVC_ERR_ARG, "EDIE alpha must be > 0, got %g", c->edie_alpha);
    if (c->chunk_length < 0) return kvc_fail(KVC_ERR_ARG, "chunk_length must be >= 0");
    if (c->reuse_layers < 0) return kvc_fail(KVC_ERR_ARG, "reuse_layers must be >= 1");
    if (c->chunk_length > 0 && c->allocation == KVC_ALLOC_ADAKV)
        return kvc_fail(KVC_ERR_ARG, "ChunkKV shares one chunk selection across a layer's heads; Ada-KV gives each head its own "
                        "budget: the two do not combine (use ChunkKVPress over SnapKVPress, or AdaKVPress alone)");
    if (c->allocation == KVC_ALLOC_PYRAMID && c->pyramid_beta < 1) return kvc_fail(KVC_ERR_ARG, "PyramidKV beta must be >= 1");
    if (c->budget > 0 && uses_window(c->scorer) && c->budget < c->window)
        return kvc_fail(KVC_ERR_ARG, "budget (%lld) must be at least the window (%d): the window is kept inside the budget",
                        (long long)c->budget, c->window);
    return KVC_OK;
}

kvc_status kvc_press_validate(const kvc_press_config *c) { return validate(c); }

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
    free(p);
}

static void press_free_cb(void *user) { kvc_press_free(user); }

kvc_status kvc_session_set_press(kvc_session *s, const kvc_press_config *cfg) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "session is NULL");
    if (cfg) KVC_TRY(validate(cfg));
    if (s->hook_free) s->hook_free(s->hook_user);
    s->hook = NULL;
    s->hook_user = NULL;
    s->hook_free = NULL;
    if (!cfg) return KVC_OK;
    kvc_press *p = calloc(1, sizeof *p);
    if (!p) return kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    p->cfg = *cfg;
    p->n_layers = s->model->cfg.n_layers;
    p->n_kv = s->model->cfg.n_kv_heads;
    const size_t nh = (size_t)p->n_layers * p->n_kv;
    p->scores = calloc(nh, sizeof *p->scores);
    p->score_len = calloc(nh, sizeof *p->score_len);
    p->error = malloc(sizeof(double) * (size_t)p->n_layers);
    p->layer_seconds = calloc((size_t)p->n_layers, sizeof(double));
    p->reuse_n = calloc((size_t)p->n_kv, sizeof(int64_t));
    p->layer_totals = malloc(sizeof(int64_t) * (size_t)p->n_layers);
    p->e_internal = malloc(sizeof(double) * (size_t)p->n_layers);
    p->dissim = malloc(sizeof(double) * (size_t)p->n_layers);
    if (!p->scores || !p->score_len || !p->error || !p->layer_seconds || !p->reuse_n || !p->layer_totals ||
        !p->e_internal || !p->dissim) {
        kvc_press_free(p);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    }
    for (int32_t l = 0; l < p->n_layers; l++) {
        p->error[l] = p->e_internal[l] = p->dissim[l] = NAN;
        p->layer_totals[l] = -1;
    }
    s->hook = kvc_press_hook;
    s->hook_user = p;
    s->hook_free = press_free_cb;
    return KVC_OK;
}

/* Ada-KV eviction loss: window queries' attention output with all rows vs with the kept rows. */
static double eviction_error(const kvc_session *s, const kvc_layer_ctx *ctx, int32_t w,
                             int64_t *const *keep, const int64_t *n_keep) {
    const kvc_config *c = &s->model->cfg;
    const kvc_layer_cache *L = &s->cache.layers[ctx->layer];
    const int32_t H = c->n_heads, g = H / c->n_kv_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    double total = 0;
    int64_t count = 0;
#pragma omp parallel for reduction(+ : total, count) schedule(dynamic, 1)
    for (int32_t hq = 0; hq < H; hq++) {
        const int32_t h = hq / g;
        const int64_t len = L->len[h];
        char *kept = calloc((size_t)(len > 0 ? len : 1), 1);
        double *full = malloc(sizeof(double) * d), *part = malloc(sizeof(double) * d);
        if (!kept || !full || !part) {
            free(kept); free(full); free(part);
            continue;
        }
        for (int64_t i = 0; i < n_keep[h]; i++) kept[keep[h][i]] = 1;
        for (int64_t i = ctx->n - w; i < ctx->n; i++) {
            const float *q = ctx->q + (i * H + hq) * d;
            const int64_t visible = ctx->past_len[h] + i + 1;
            double mx = -INFINITY;
            for (int64_t r = 0; r < visible; r++) {
                double dot = 0;
                for (int32_t t = 0; t < d; t++) dot += q[t] * L->k[h][r * d + t];
                mx = fmax(mx, dot * scale);
            }
            double zf = 0, zp = 0;
            memset(full, 0, sizeof(double) * d);
            memset(part, 0, sizeof(double) * d);
            for (int64_t r = 0; r < visible; r++) {
                double dot = 0;
                for (int32_t t = 0; t < d; t++) dot += q[t] * L->k[h][r * d + t];
                const double e = exp(dot * scale - mx);
                zf += e;
                for (int32_t t = 0; t < d; t++) full[t] += e * L->v[h][r * d + t];
                if (kept[r]) {
                    zp += e;
                    for (int32_t t = 0; t < d; t++) part[t] += e * L->v[h][r * d + t];
                }
            }
            double err = 0;
            for (int32_t t = 0; t < d; t++) err += fabs(full[t] / zf - (zp > 0 ? part[t] / zp : 0));
            total += err;
            count += 1;
        }
        free(kept); free(full); free(part);
    }
    return count ? total / count : NAN;
}

/* TADA statistics: E_internal and the residual-stream dissimilarity 1 - cos(R, R + O). */
static void layer_stats(kvc_press *p, const kvc_session *s, const kvc_layer_ctx *ctx, const float *const *scores, int32_t w) {
    const kvc_layer_cache *L = &s->cache.layers[ctx->layer];
    const int64_t D = s->model->cfg.hidden;
    double e = 0;
    for (int32_t h = 0; h < p->n_kv; h++)
        for (int64_t r = 0; r < L->len[h] - w; r++) e += scores[h][r];
    p->e_internal[ctx->layer] = e;
    if (!ctx->resid || !ctx->o) return;
    const int64_t nw = w > 0 ? (w < ctx->n ? w : ctx->n) : 1;
    double cos_sum = 0;
    for (int64_t j = ctx->n - nw; j < ctx->n; j++) {
        const float *R = ctx->resid + j * D, *O = ctx->o + j * D;
        double rr = 0, ss = 0, rs = 0;
        for (int64_t t = 0; t < D; t++) {
            const double a = R[t], b = (double)R[t] + O[t];
            rr += a * a;
            ss += b * b;
            rs += a * b;
        }
        cos_sum += rs / (sqrt(rr * ss) + 1e-30);
    }
    p->dissim[ctx->layer] = 1.0 - cos_sum / nw;
}

static kvc_status remember_for_reuse(kvc_press *p, const kvc_layer_cache *L, int64_t *const *keep, const int64_t *n_keep) {
    const int64_t len = L->len[0];
    for (int32_t h = 1; h < p->n_kv; h++)
        if (L->len[h] != len) {
            p->reuse_len = 0; /* ragged heads: nothing to reuse */
            return KVC_OK;
        }
    int64_t *rows = realloc(p->reuse_rows, sizeof(int64_t) * (size_t)(len > 0 ? len : 1) * p->n_kv);
    if (!rows) return kvc_fail(KVC_ERR_NOMEM, "out of memory: layer index reuse");
    p->reuse_rows = rows;
    for (int32_t h = 0; h < p->n_kv; h++) {
        memcpy(rows + (size_t)h * len, keep[h], sizeof(int64_t) * (size_t)n_keep[h]);
        p->reuse_n[h] = n_keep[h];
    }
    p->reuse_len = len;
    return KVC_OK;
}

kvc_status kvc_press_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    kvc_press *p = user;
    const kvc_press_config *cfg = &p->cfg;
    if (ctx->n <= 1) return KVC_OK; /* decoding: presses act on prefills only */
    if (cfg->reuse_layers > 1 && ctx->layer % cfg->reuse_layers == 0) p->reuse_len = 0; /* new group */
    if (cfg->budget == 0 && cfg->compression_ratio == 0) return KVC_OK;
    const kvc_config *c = &s->model->cfg;
    const int32_t Hkv = c->n_kv_heads, layer = ctx->layer;
    kvc_layer_cache *L = &s->cache.layers[layer];
    const int32_t w = uses_window(cfg->scorer) ? cfg->window : 0;
    /* the window's queries are this call's last w rows; a call after a prefill (Judge Q's soft rows on a
     * copied full cache) may be the window alone */
    for (int32_t h = 0; h < Hkv && w > 0; h++)
        if (L->len[h] <= w)
            return kvc_fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%d)",
                            (long long)L->len[h], w);
    if (w > 0 && ctx->n < w)
        return kvc_fail(KVC_ERR_ARG, "the press window (%d) is longer than this forward call (%lld tokens)", w,
                        (long long)ctx->n);
    if (cfg->scorer == KVC_SCORE_STREAMING) {
        for (int32_t h = 0; h < Hkv; h++)
            if (L->len[h] <= cfg->n_sink)
                return kvc_fail(KVC_ERR_ARG, "StreamingLLM needs more tokens (%lld) than n_sink (%d)",
                                (long long)L->len[h], cfg->n_sink);
    }
    if (cfg->budget > 0 && !cfg->drop_window) {
        int evict = 0;
        for (int32_t h = 0; h < Hkv; h++) evict |= L->len[h] > cfg->budget;
        if (!evict) return KVC_OK;
    }
    kvc_status st = KVC_OK;
    const size_t nh = (size_t)(uint32_t)Hkv; /* Hkv > 0 (validated config) */
    float **scores = calloc(nh, sizeof *scores);
    int64_t **keep = calloc(nh, sizeof *keep);
    int64_t *n_keep = calloc(nh, sizeof *n_keep);
    if (!scores || !keep || !n_keep) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        scores[h] = malloc(sizeof(float) * (size_t)(L->len[h] > 0 ? L->len[h] : 1));
        keep[h] = malloc(sizeof(int64_t) * (size_t)(L->len[h] > 0 ? L->len[h] : 1));
        if (!scores[h] || !keep[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: press");
    }
    const double t0 = omp_get_wtime();
    int reused = 0;
    if (st == KVC_OK && cfg->reuse_layers > 1 && layer % cfg->reuse_layers != 0 && p->reuse_len > 0) {
        /* ChunkKV layer-wise index reuse: a later layer of the group keeps what its first layer kept */
        reused = 1;
        for (int32_t h = 0; h < Hkv; h++) reused &= L->len[h] == p->reuse_len;
        if (reused)
            for (int32_t h = 0; h < Hkv; h++) {
                n_keep[h] = p->reuse_n[h];
                memcpy(keep[h], p->reuse_rows + (size_t)h * p->reuse_len, sizeof(int64_t) * (size_t)n_keep[h]);
            }
    }
    if (st == KVC_OK && !reused) {
        kvc_score_input in = {c, L, ctx, cfg};
        st = kvc_press_score(&in, scores);
        if (st == KVC_OK && cfg->drop_window) {
            /* select among the rows before the window; the window itself goes */
            int64_t lens[64];
            if (Hkv > 64) st = kvc_fail(KVC_ERR_UNSUPPORTED, "drop_window supports at most 64 KV heads");
            for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) lens[h] = L->len[h] - w;
            if (st == KVC_OK)
                st = kvc_press_select(cfg, layer, c->n_layers, Hkv, lens, (const float *const *)scores, 0,
                                      p->layer_totals[layer], keep, n_keep);
        } else if (st == KVC_OK) {
            st = kvc_press_select(cfg, layer, c->n_layers, Hkv, L->len, (const float *const *)scores, w,
                                  p->layer_totals[layer], keep, n_keep);
        }
        if (st == KVC_OK) layer_stats(p, s, ctx, (const float *const *)scores, w);
        if (st == KVC_OK && cfg->reuse_layers > 1) st = remember_for_reuse(p, L, keep, n_keep);
    }
    p->layer_seconds[layer] = omp_get_wtime() - t0;
    if (st == KVC_OK && cfg->record_scores && !reused) {
        for (int32_t h = 0; h < Hkv; h++) {
            const size_t i = (size_t)layer * Hkv + h;
            free(p->scores[i]);
            p->scores[i] = scores[h]; /* ownership moves to the press */
            p->score_len[i] = L->len[h];
            scores[h] = NULL;
        }
        const int32_t ew = w > 0 ? w : 1;
        p->error[layer] = eviction_error(s, ctx, ew < ctx->n ? ew : (int32_t)ctx->n, keep, n_keep);
    }
    if (st == KVC_OK) st = kvc_cache_compact(&s->cache, layer, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) {
        if (scores) free(scores[h]);
        if (keep) free(keep[h]);
    }
    free(scores);
    free(keep);
    free(n_keep);
    return st;
}

kvc_status kvc_session_press_scores(const kvc_session *s, int32_t layer, int32_t h, float *out, int64_t *n) {
    if (!s || !n) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (s->hook != kvc_press_hook) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session");
    const kvc_press *p = s->hook_user;
    if (layer < 0 || layer >= p->n_layers || h < 0 || h >= p->n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    const size_t i = (size_t)layer * p->n_kv + h;
    *n = p->scores[i] ? p->score_len[i] : 0;
    if (out && p->scores[i]) memcpy(out, p->scores[i], sizeof(float) * (size_t)*n);
    return KVC_OK;
}

kvc_status kvc_session_press_error(const kvc_session *s, int32_t layer, double *out) {
    if (!s || !out) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (s->hook != kvc_press_hook) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session");
    const kvc_press *p = s->hook_user;
    if (layer < 0 || layer >= p->n_layers) return kvc_fail(KVC_ERR_ARG, "layer %d out of range", layer);
    *out = p->error[layer];
    return KVC_OK;
}

kvc_status kvc_session_truncate(kvc_session *s, const int64_t *new_len, int64_t position) {
    if (!s || !new_len) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (position < 0) return kvc_fail(KVC_ERR_ARG, "position must be >= 0");
    if (s->dev) return kvc_dev_truncate(s, new_len, position);
    const int32_t Hkv = s->cache.n_kv;
    for (int32_t l = 0; l < s->cache.n_layers; l++)
        for (int32_t h = 0; h < Hkv; h++)
            if (new_len[l * Hkv + h] < 0 || new_len[l * Hkv + h] > s->cache.layers[l].len[h])
                return kvc_fail(KVC_ERR_ARG, "layer %d head %d holds %lld tokens: cannot truncate to %lld", l, h,
                                (long long)s->cache.layers[l].len[h], (long long)new_len[l * Hkv + h]);
    for (int32_t l = 0; l < s->cache.n_layers; l++) KVC_TRY(kvc_cache_truncate(&s->cache, l, new_len + l * Hkv));
    s->pos = position;
    return KVC_OK;
}

kvc_status kvc_session_cache_positions(const kvc_session *s, int32_t layer, int32_t h, int64_t *out) {
    if (!s || !out) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (layer < 0 || layer >= s->cache.n_layers || h < 0 || h >= s->cache.n_kv)
        return kvc_fail(KVC_ERR_ARG, "layer %d / head %d out of range", layer, h);
    if (s->dev) return kvc_dev_cache_positions(s, layer, h, out);
    const kvc_layer_cache *L = &s->cache.layers[layer];
    if (L->len[h] > 0) memcpy(out, L->pos[h], sizeof(int64_t) * (size_t)L->len[h]);
    return KVC_OK;
}

kvc_status kvc_press_compute(const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d, int32_t layer,
                             int32_t n_layers, const float *q, int64_t n, const float *k, const float *v,
                             int64_t len, float *scores, int64_t *keep, int64_t *n_keep) {
    return kvc_press_compute_ex(cfg, H, Hkv, d, layer, n_layers, q, NULL, n, k, v, len, -1, scores, keep, n_keep);
}

kvc_status kvc_press_compute_ex(const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d, int32_t layer,
                                int32_t n_layers, const float *q, const float *attn, int64_t n, const float *k,
                                const float *v, int64_t len, int64_t layer_total, float *scores, int64_t *keep,
                                int64_t *n_keep) {
    if (!cfg || !q || !k || !v || !scores || !keep || !n_keep) return kvc_fail(KVC_ERR_ARG, "press_compute: null argument");
    KVC_TRY(validate(cfg));
    if (H <= 0 || Hkv <= 0 || H % Hkv || d <= 0) return kvc_fail(KVC_ERR_ARG, "press_compute: bad head shape H=%d Hkv=%d d=%d", H, Hkv, d);
    if (n < 1 || len < n) return kvc_fail(KVC_ERR_ARG, "press_compute: need 1 <= n (%lld) <= len (%lld)", (long long)n, (long long)len);
    if (layer < 0 || layer >= n_layers) return kvc_fail(KVC_ERR_ARG, "press_compute: layer %d not in [0, %d)", layer, n_layers);
    const int32_t w = uses_window(cfg->scorer) ? cfg->window : 0;
    if (w > 0 && n <= w) return kvc_fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%d)", (long long)n, w);
    kvc_config mc;
    kvc_config_defaults(&mc);
    mc.n_heads = H;
    mc.n_kv_heads = Hkv;
    mc.head_dim = d;
    mc.n_layers = n_layers;
    kvc_status st = KVC_OK;
    int64_t *lens = malloc(sizeof(int64_t) * Hkv), *past = malloc(sizeof(int64_t) * Hkv);
    float **kp = malloc(sizeof(float *) * Hkv), **vp = malloc(sizeof(float *) * Hkv), **sp = malloc(sizeof(float *) * Hkv);
    int64_t **keepp = malloc(sizeof(int64_t *) * Hkv);
    if (!lens || !past || !kp || !vp || !sp || !keepp) st = kvc_fail(KVC_ERR_NOMEM, "out of memory");
    if (st == KVC_OK) {
        for (int32_t h = 0; h < Hkv; h++) {
            lens[h] = len;
            past[h] = len - n;
            kp[h] = (float *)k + (size_t)h * len * d;
            vp[h] = (float *)v + (size_t)h * len * d;
            sp[h] = scores + (size_t)h * len;
            keepp[h] = keep + (size_t)h * len;
        }
        kvc_layer_cache L = {0};
        L.len = lens;
        L.cap = lens;
        L.k = kp;
        L.v = vp;
        kvc_layer_ctx ctx = {layer, n, past, q, attn, NULL, NULL};
        kvc_score_input in = {&mc, &L, &ctx, cfg};
        st = kvc_press_score(&in, sp);
        if (st == KVC_OK)
            st = kvc_press_select(cfg, layer, n_layers, Hkv, lens, (const float *const *)sp, w, layer_total, keepp, n_keep);
    }
    free(lens); free(past); free(kp); free(vp); free(sp); free(keepp);
    return st;
}

kvc_status kvc_session_set_layer_budgets(kvc_session *s, const int64_t *totals, int32_t n_layers) {
    if (!s || !totals) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (s->hook != kvc_press_hook) return kvc_fail(KVC_ERR_ARG, "attach a press first (kvc_session_set_press)");
    kvc_press *p = s->hook_user;
    if (n_layers != p->n_layers) return kvc_fail(KVC_ERR_ARG, "need %d layer budgets, got %d", p->n_layers, n_layers);
    for (int32_t l = 0; l < n_layers; l++)
        if (totals[l] < 0) return kvc_fail(KVC_ERR_ARG, "layer %d budget is negative", l);
    memcpy(p->layer_totals, totals, sizeof(int64_t) * (size_t)n_layers);
    return KVC_OK;
}

kvc_status kvc_session_press_layer_stats(const kvc_session *s, int32_t layer, double *e_internal, double *dissimilarity) {
    if (!s || !e_internal || !dissimilarity) return kvc_fail(KVC_ERR_ARG, "null argument");
    if (s->hook != kvc_press_hook) return kvc_fail(KVC_ERR_ARG, "no press is attached to this session");
    const kvc_press *p = s->hook_user;
    if (layer < 0 || layer >= p->n_layers) return kvc_fail(KVC_ERR_ARG, "layer %d out of range", layer);
    *e_internal = p->e_internal[layer];
    *dissimilarity = p->dissim[layer];
    return KVC_OK;
}
