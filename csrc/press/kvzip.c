/* KVzip (arXiv 2505.23416; docs/METHODS.md "KVzip"): query-agnostic scores from context reconstruction.
 *
 * After the context's full prefill, a "repeat the context" prompt followed by a chunk of the context
 * runs through the model on the full cache, as TAKE's probes do (take.c): a layer hook scores the layer
 * right after its attention, then drops the prompt's rows, and the position goes back. A context row's
 * score is the most attention any reconstruction query of its KV head's group gives it, the softmax
 * taken over the sinks, the chunk and the causal reconstruction rows only (kvpress's KVzipPress).
 * KVzip+ divides each query's row by ||h|| (the normed hidden state) and multiplies each column by
 * ||v W_o|| of that query head. The eviction (kvc_kvzip_evict) then removes the lowest scores over
 * every layer and head at once (or per layer), the sinks kept. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../model/model.h"
#include "press.h"

#define KVZIP_TILE 64 /* reconstruction queries per GEMM */

typedef struct kvzip_state {
    int64_t start, end, n_ctx;
    int32_t n_sink, plus;
    float *out; /* [L, Hkv, end - start] */
} kvzip_state;

kvc_status kvc_kvzip_wov_norms(const kvc_config *c, const float *wt, float *const *v, int64_t start, int64_t end,
                               double *wov) {
    const int32_t H = c->n_heads, g = H / c->n_kv_heads, d = c->head_dim;
    const int64_t D = c->hidden, m = end - start;
    float *prod = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1) * (size_t)D);
    if (!prod) return kvc_fail(KVC_ERR_NOMEM, "out of memory: |v W_o|");
    for (int32_t hq = 0; hq < H; hq++) { /* [m, d] x W_o^T[hq] [d, D], then the rows' norms */
        kvc_host_gemm_nn(v[hq / g] + start * d, d, wt + (int64_t)hq * d * D, D, prod, D, m, D, d, 0);
        for (int64_t r = 0; r < m; r++) {
            double s = 0;
            for (int64_t j = 0; j < D; j++) s += (double)prod[r * D + j] * prod[r * D + j];
            wov[hq * m + r] = sqrt(s);
        }
    }
    free(prod);
    return KVC_OK;
}

kvc_status kvc_kvzip_chunk_max(const kvc_config *c, const float *qh, int64_t q, float *const *k, int64_t n_ctx,
                               int64_t start, int64_t end, int32_t n_sink, const double *row_w, const double *col_w,
                               float *out) {
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t qd = (int64_t)H * d, sink = n_sink < start ? n_sink : start, m = end - start, ncol = sink + m + q;
    const double scale = 1.0 / sqrt((double)d);
    for (int64_t r = 0; r < (int64_t)Hkv * m; r++) out[r] = 0.0f;
    /* each KV head's scored columns gathered: the sinks, the chunk, the reconstruction rows [ncol, d] */
    float *kc = malloc(sizeof(float) * (size_t)Hkv * (size_t)ncol * d);
    if (!kc) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t j = 0; j < ncol; j++) {
            const int64_t row = j < sink ? j : j < sink + m ? start + j - sink : n_ctx + j - sink - m;
            memcpy(kc + ((size_t)h * ncol + j) * d, k[h] + row * d, sizeof(float) * (size_t)d);
        }
    int failed = 0;
    /* query heads in parallel, queries in tiles (one GEMM + softmax rows each, causal over the reconstruction
     * rows); each head keeps its own maxima and merges them into its KV head's */
#pragma omp parallel
    {
        float *qt = malloc(sizeof(float) * KVZIP_TILE * (size_t)d);
        float *pr = malloc(sizeof(float) * KVZIP_TILE * (size_t)ncol);
        float *best = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
        int64_t vis[KVZIP_TILE];
        const int ok = qt && pr && best;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int32_t hq = 0; hq < H; hq++) {
            if (!ok) continue;
            const int32_t h = hq / g;
            for (int64_t r = 0; r < m; r++) best[r] = 0.0f;
            for (int64_t i0 = 0; i0 < q; i0 += KVZIP_TILE) {
                const int64_t tq = q - i0 < KVZIP_TILE ? q - i0 : KVZIP_TILE, cols = sink + m + i0 + tq;
                for (int64_t i = 0; i < tq; i++) {
                    memcpy(qt + i * d, qh + (i0 + i) * qd + (int64_t)hq * d, sizeof(float) * (size_t)d);
                    vis[i] = sink + m + i0 + i + 1;
                }
                kvc_host_probs_rows(qt, tq, kc + (size_t)h * ncol * d, cols, d, (float)scale, vis, pr);
                for (int64_t i = 0; i < tq; i++)
                    for (int64_t r = 0; r < m; r++) {
                        double a = (double)pr[i * cols + sink + r];
                        if (row_w) a *= row_w[i0 + i];
                        if (col_w) a *= col_w[hq * m + r];
                        if ((float)a > best[r]) best[r] = (float)a;
                    }
            }
#pragma omp critical(kvzip_merge)
            for (int64_t r = 0; r < m; r++)
                if (best[r] > out[h * m + r]) out[h * m + r] = best[r];
        }
        free(qt);
        free(pr);
        free(best);
    }
    free(kc);
    return failed ? kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip") : KVC_OK;
}

static kvc_status kvzip_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    const kvc_backend *be = kvc_door_backend(s);
    kvzip_state *t = user;
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t l = ctx->layer, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t q = ctx->n, qd = (int64_t)H * d, D = c->hidden, n_ctx = t->n_ctx, m = t->end - t->start;
    const kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    const int64_t *len = kvc_door_cache(s)->layers[l].len;

    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    float *qh = malloc(sizeof(float) * (size_t)(q * qd));
    double *hinv = malloc(sizeof(double) * (size_t)q);
    double *wov = t->plus ? malloc(sizeof(double) * (size_t)(H * m)) : NULL;
    float *resid = t->plus ? malloc(sizeof(float) * (size_t)(q * D)) : NULL, *w = t->plus ? malloc(sizeof(float) * (size_t)D) : NULL;
    float *wt = t->plus ? malloc(sizeof(float) * (size_t)qd * (size_t)D) : NULL;
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS];
    kvc_status st = qh && hinv && (!t->plus || (wov && resid && w && wt)) ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
    if (st == KVC_OK) st = kvc_press_layer_rows(&lr, len, t->plus, k, v, &block);
    if (st == KVC_OK) st = be->download(ctx->q, q, qd, qh, KVC_F32);
    for (int64_t i = 0; i < q; i++) hinv[i] = 1.0;
    if (st == KVC_OK && t->plus) { /* 1 / ||RMSNorm(x) w|| per query, |v W_o| per chunk row and query head */
        if (!lr.wo.buf) st = kvc_fail(KVC_ERR_ARG, "KVzip+ needs the model's output projection");
        if (st == KVC_OK) st = be->download(ctx->resid, q, D, resid, KVC_F32);
        if (st == KVC_OK) st = be->download(kvc_door_model(s)->layers[l].attn_norm, 1, D, w, KVC_F32);
        for (int64_t i = 0; i < q && st == KVC_OK; i++) {
            double ms = 0, nn = 0;
            for (int64_t j = 0; j < D; j++) ms += (double)resid[i * D + j] * resid[i * D + j];
            const double r = 1.0 / sqrt(ms / (double)D + c->rms_eps);
            for (int64_t j = 0; j < D; j++) {
                const double x = resid[i * D + j] * r * w[j];
                nn += x * x;
            }
            hinv[i] = 1.0 / sqrt(nn);
        }
        if (st == KVC_OK) st = kvc_wo_transposed(&lr, wt);
        if (st == KVC_OK) st = kvc_kvzip_wov_norms(c, wt, v, t->start, t->end, wov);
    }
    if (st == KVC_OK)
        st = kvc_kvzip_chunk_max(c, qh, q, k, n_ctx, t->start, t->end, t->n_sink, hinv, wov,
                                 t->out + (size_t)l * Hkv * m);
    /* the reconstruction rows go: the layer holds the context again */
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)(n_ctx > 0 ? n_ctx : 1)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
        for (int64_t r = 0; st == KVC_OK && r < n_ctx; r++) keep[h][r] = r;
        n_keep[h] = n_ctx;
    }
    if (st == KVC_OK) st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    kvc_free(block);
    free(qh);
    free(hinv);
    free(wov);
    free(resid);
    free(w);
    free(wt);
    return st;
}

kvc_status kvc_kvzip_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                           int32_t n_sink, int32_t plus, float *scores) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int64_t n_ctx = kvc_door_position(s);
    if (!ids || !scores) return kvc_fail(KVC_ERR_ARG, "kvzip_score: null argument");
    if (n_ctx < 1 || !kvc_door_holds_full_cache(s))
        return kvc_fail(KVC_ERR_ARG, "kvzip_score: the session must hold the full cache of the context (prefill it "
                        "without a press first)");
    if (q_len < 2) return kvc_fail(KVC_ERR_ARG, "kvzip_score: the reconstruction prompt needs at least 2 tokens");
    if (start < 0 || end <= start || end > n_ctx)
        return kvc_fail(KVC_ERR_ARG, "kvzip_score: chunk [%lld, %lld) outside the %lld context rows", (long long)start,
                        (long long)end, (long long)n_ctx);
    if (n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0, got %d", n_sink);
    for (int64_t i = 0; i < q_len; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab) return kvc_fail(KVC_ERR_ARG, "token %d outside the vocabulary", ids[i]);
    kvzip_state t = {start, end, n_ctx, n_sink, plus != 0, scores};
    /* the hook drops the reconstruction rows again: the position goes back */
    return kvc_door_probe(s, ids, q_len, NULL, 0, kvzip_hook, &t, KVC_ROW_NONE, NULL, 0);
}

typedef struct { float s; int64_t i; } scored_row;

static int by_score(const void *a, const void *b) {
    const scored_row *x = a, *y = b;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* The lowest scores of the first n rows of every (layer, KV head) go: int(numel * ratio) over all layers at
 * once, or int(Hkv n ratio) per layer (kvpress's KVzip). The first n_sink rows rank above everything; rows
 * after the n scored ones (RestoreKV's restore rows) always stay. Every head must hold the same rows. */
kvc_status kvc_evict_lowest(kvc_session *s, const float *scores, int64_t n, double ratio, int32_t layerwise, int32_t n_sink) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t L = c->n_layers, Hkv = c->n_kv_heads;
    const int64_t rows = kvc_session_cache_len(s, 0, 0), per_layer = (int64_t)Hkv * n, total = (int64_t)L * per_layer;
    if (!scores) return kvc_fail(KVC_ERR_ARG, "eviction: null scores");
    if (!(ratio >= 0 && ratio <= 1)) return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1], got %g", ratio);
    if (n < 1 || n > rows)
        return kvc_fail(KVC_ERR_ARG, "eviction: %lld scored rows, the cache holds %lld", (long long)n, (long long)rows);
    for (int32_t l = 0; l < L; l++)
        for (int32_t h = 0; h < Hkv; h++)
            if (kvc_session_cache_len(s, l, h) != rows)
                return kvc_fail(KVC_ERR_ARG, "eviction: layer %d head %d holds %lld rows, layer 0 head 0 %lld", l, h,
                                (long long)kvc_session_cache_len(s, l, h), (long long)rows);
    scored_row *sr = malloc(sizeof(scored_row) * (size_t)total);
    char *pruned = calloc((size_t)total, 1);
    kvc_status st = sr && pruned ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: eviction");
    float mx = -FLT_MAX;
    for (int64_t r = 0; st == KVC_OK && r < total; r++) mx = scores[r] > mx ? scores[r] : mx;
    for (int64_t r = 0; st == KVC_OK && r < total; r++) /* the sinks rank above everything (kvpress: max + 1) */
        sr[r] = (scored_row){r % n < n_sink ? mx + 1.0f : scores[r], r};
    for (int32_t part = 0; st == KVC_OK && part < (layerwise ? L : 1); part++) {
        scored_row *p = sr + (layerwise ? part * per_layer : 0);
        const int64_t m = layerwise ? per_layer : total, k = (int64_t)((double)m * ratio);
        qsort(p, (size_t)m, sizeof *p, by_score);
        for (int64_t r = 0; r < k; r++) pruned[p[r].i] = 1;
    }
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS];
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)rows))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: eviction");
    kvc_backend_lock(kvc_door_backend(s));
    for (int32_t l = 0; l < L && st == KVC_OK; l++) {
        for (int32_t h = 0; h < Hkv; h++) {
            n_keep[h] = 0;
            for (int64_t r = 0; r < rows; r++)
                if (r >= n || !pruned[(int64_t)l * per_layer + (int64_t)h * n + r]) keep[h][n_keep[h]++] = r;
        }
        st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    }
    kvc_backend_unlock(kvc_door_backend(s));
    if (st != KVC_OK) kvc_door_request_reset(s); /* some layers compacted, some not */
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    free(sr);
    free(pruned);
    return st;
}

kvc_status kvc_kvzip_evict(kvc_session *s, const float *scores, int64_t n_ctx, double ratio, int32_t layerwise,
                           int32_t n_sink) {
    if (kvc_door_position(s) < 1 || !kvc_door_holds_full_cache(s))
        return kvc_fail(KVC_ERR_ARG, "kvzip_evict: the session must hold the full cache of the context");
    return kvc_evict_lowest(s, scores, n_ctx, ratio, layerwise, n_sink);
}

/* ---- kvpress_c.h ---- */

/* scores [L, Hkv, rows] */
static int64_t layer_head_rows(kvc_session *s, int64_t rows) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    return (int64_t)c->n_layers * c->n_kv_heads * rows;
}

kvc_status kvc_session_kvzip_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                                   int32_t n_sink, int32_t plus, float *scores, int64_t n_scores) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_score: null session");
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "KVzip"));
    if (end > start) KVC_TRY(kvc_check_size("kvzip_score: scores [L, Hkv, end - start]", n_scores, layer_head_rows(s, end - start)));
    return kvc_kvzip_score(s, ids, q_len, start, end, n_sink, plus, scores);
}

kvc_status kvc_session_kvzip_evict(kvc_session *s, const float *scores, int64_t n_scores, double compression_ratio,
                                   int32_t layerwise, int32_t n_sink) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_evict: null session");
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "KVzip"));
    KVC_TRY(kvc_check_size("kvzip_evict: scores [L, Hkv, n]", n_scores, layer_head_rows(s, kvc_door_position(s))));
    if (!(compression_ratio >= 0 && compression_ratio < 1))
        return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1), got %g", compression_ratio);
    return kvc_kvzip_evict(s, scores, kvc_door_position(s), compression_ratio, layerwise, n_sink);
}

kvc_status kvc_session_kvzip_evict_prefix(kvc_session *s, const float *scores, int64_t n_scores, int64_t n_ctx,
                                          double compression_ratio, int32_t layerwise, int32_t n_sink) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_evict: null session");
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "KVzip"));
    if (n_ctx > 0) KVC_TRY(kvc_check_size("kvzip_evict: scores [L, Hkv, n_ctx]", n_scores, layer_head_rows(s, n_ctx)));
    return kvc_kvzip_evict(s, scores, n_ctx, compression_ratio, layerwise, n_sink);
}
