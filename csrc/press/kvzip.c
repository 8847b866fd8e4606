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
    int64_t start, end;
    int32_t n_sink, plus;
    float *out; /* [L, Hkv, end - start] */
} kvzip_state;

kvc_status kvc_kvzip_cols_of(const int64_t *pos, int64_t held, int64_t start, int64_t end, int32_t n_sink,
                             kvc_kvzip_cols *out) {
    memset(out, 0, sizeof *out);
    const int64_t sink = n_sink < start ? n_sink : start;
    out->rows = malloc(sizeof(int64_t) * (size_t)(held > 0 ? held : 1));
    out->at = malloc(sizeof(int64_t) * (size_t)(held > 0 ? held : 1));
    if (!out->rows || !out->at) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
    for (int64_t r = 0; r < held; r++) /* rows are in position order: the sinks come first */
        if ((pos ? pos[r] : r) < sink) out->rows[out->ns++] = r;
    for (int64_t r = 0; r < held; r++) {
        const int64_t p = pos ? pos[r] : r;
        if (p >= start && p < end) {
            out->rows[out->ns + out->nc] = r;
            out->at[out->nc++] = p - start;
        }
    }
    out->rep0 = held;
    return KVC_OK;
}

void kvc_kvzip_cols_free(kvc_kvzip_cols *c, int32_t n) {
    for (int32_t i = 0; c && i < n; i++) {
        free(c[i].rows);
        free(c[i].at);
        c[i].rows = c[i].at = NULL;
    }
}

kvc_status kvc_kvzip_wov_norms(const kvc_config *c, const float *wt, float *const *v, const kvc_kvzip_cols *cols,
                               int64_t m, double *wov) {
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t D = c->hidden;
    int64_t most = 1;
    for (int32_t h = 0; h < Hkv; h++) most = cols[h].nc > most ? cols[h].nc : most;
    float *prod = malloc(sizeof(float) * (size_t)most * (size_t)D), *vr = malloc(sizeof(float) * (size_t)most * (size_t)d);
    if (!prod || !vr) {
        free(prod);
        free(vr);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: |v W_o|");
    }
    for (int64_t i = 0; i < (int64_t)H * m; i++) wov[i] = 0.0;
    for (int32_t hq = 0; hq < H; hq++) { /* the chunk rows' values [nc, d] x W_o^T[hq] [d, D], then the rows' norms */
        const kvc_kvzip_cols *cl = &cols[hq / g];
        for (int64_t j = 0; j < cl->nc; j++)
            memcpy(vr + j * d, v[hq / g] + cl->rows[cl->ns + j] * d, sizeof(float) * (size_t)d);
        if (cl->nc > 0) kvc_host_gemm_nn(vr, d, wt + (int64_t)hq * d * D, D, prod, D, cl->nc, D, d, 0);
        for (int64_t j = 0; j < cl->nc; j++) {
            double s = 0;
            for (int64_t x = 0; x < D; x++) s += (double)prod[j * D + x] * prod[j * D + x];
            wov[hq * m + cl->at[j]] = sqrt(s);
        }
    }
    free(prod);
    free(vr);
    return KVC_OK;
}

kvc_status kvc_kvzip_chunk_max(const kvc_config *c, const float *qh, int64_t q, float *const *k,
                               const kvc_kvzip_cols *cols, int64_t m, const double *row_w, const double *col_w, float *out) {
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t qd = (int64_t)H * d;
    const double scale = 1.0 / sqrt((double)d);
    for (int64_t r = 0; r < (int64_t)Hkv * m; r++) out[r] = 0.0f;
    /* each KV head's scored columns gathered: its sinks, its chunk rows, the reconstruction rows [ncol, d] */
    size_t off[KVC_MAX_KV_HEADS + 1];
    off[0] = 0;
    int64_t most = 1, widest = 1; /* chunk rows, columns of a head at most */
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t ncol = cols[h].ns + cols[h].nc + q;
        off[h + 1] = off[h] + (size_t)ncol * d;
        most = cols[h].nc > most ? cols[h].nc : most;
        widest = ncol > widest ? ncol : widest;
    }
    float *kc = malloc(sizeof(float) * (off[Hkv] > 0 ? off[Hkv] : 1));
    if (!kc) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
    for (int32_t h = 0; h < Hkv; h++) {
        const kvc_kvzip_cols *cl = &cols[h];
        const int64_t fixed = cl->ns + cl->nc;
        for (int64_t j = 0; j < fixed + q; j++) {
            const int64_t row = j < fixed ? cl->rows[j] : cl->rep0 + j - fixed;
            memcpy(kc + off[h] + (size_t)j * d, k[h] + row * d, sizeof(float) * (size_t)d);
        }
    }
    int failed = 0;
    /* query heads in parallel, queries in tiles (one GEMM + softmax rows each, causal over the reconstruction
     * rows); each head keeps its own maxima and merges them into its KV head's */
#pragma omp parallel
    {
        float *qt = malloc(sizeof(float) * KVZIP_TILE * (size_t)d);
        float *pr = malloc(sizeof(float) * KVZIP_TILE * (size_t)widest);
        float *best = malloc(sizeof(float) * (size_t)most);
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
            const kvc_kvzip_cols *cl = &cols[h];
            const int64_t fixed = cl->ns + cl->nc;
            for (int64_t r = 0; r < cl->nc; r++) best[r] = 0.0f;
            for (int64_t i0 = 0; i0 < q; i0 += KVZIP_TILE) {
                const int64_t tq = q - i0 < KVZIP_TILE ? q - i0 : KVZIP_TILE, ncols = fixed + i0 + tq;
                for (int64_t i = 0; i < tq; i++) {
                    memcpy(qt + i * d, qh + (i0 + i) * qd + (int64_t)hq * d, sizeof(float) * (size_t)d);
                    vis[i] = fixed + i0 + i + 1;
                }
                kvc_host_probs_rows(qt, tq, kc + off[h], ncols, d, (float)scale, vis, pr);
                for (int64_t i = 0; i < tq; i++)
                    for (int64_t r = 0; r < cl->nc; r++) {
                        double a = (double)pr[i * ncols + cl->ns + r];
                        if (row_w) a *= row_w[i0 + i];
                        if (col_w) a *= col_w[hq * m + cl->at[r]];
                        if ((float)a > best[r]) best[r] = (float)a;
                    }
            }
#pragma omp critical(kvzip_merge)
            for (int64_t r = 0; r < cl->nc; r++)
                if (best[r] > out[h * m + cl->at[r]]) out[h * m + cl->at[r]] = best[r];
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
    const int64_t q = ctx->n, qd = (int64_t)H * d, D = c->hidden, m = t->end - t->start;
    const kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[l];
    const int64_t *len = L->len;

    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    float *qh = malloc(sizeof(float) * (size_t)(q * qd));
    double *hinv = malloc(sizeof(double) * (size_t)q);
    double *wov = t->plus ? malloc(sizeof(double) * (size_t)(H * m)) : NULL;
    float *resid = t->plus ? malloc(sizeof(float) * (size_t)(q * D)) : NULL, *w = t->plus ? malloc(sizeof(float) * (size_t)D) : NULL;
    float *wt = t->plus ? malloc(sizeof(float) * (size_t)qd * (size_t)D) : NULL;
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS];
    kvc_kvzip_cols cols[KVC_MAX_KV_HEADS] = {{0}};
    kvc_status st = qh && hinv && (!t->plus || (wov && resid && w && wt)) ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
    /* each head's rows held before the reconstruction's, at their positions */
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) st = kvc_kvzip_cols_of(L->pos[h], len[h] - q, t->start, t->end, t->n_sink, &cols[h]);
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
        if (st == KVC_OK) st = kvc_kvzip_wov_norms(c, wt, v, cols, m, wov);
    }
    if (st == KVC_OK) st = kvc_kvzip_chunk_max(c, qh, q, k, cols, m, hinv, wov, t->out + (size_t)l * Hkv * m);
    /* the reconstruction rows go: the layer holds what it held before */
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        n_keep[h] = len[h] - q;
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)(n_keep[h] > 0 ? n_keep[h] : 1)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzip");
        for (int64_t r = 0; st == KVC_OK && r < n_keep[h]; r++) keep[h][r] = r;
    }
    if (st == KVC_OK) st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    kvc_kvzip_cols_free(cols, Hkv);
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
    if (n_ctx < 1 || kvc_door_needs_reset(s))
        return kvc_fail(KVC_ERR_ARG, "kvzip_score: the session must hold the cache of the context (prefill it first%s)",
                        n_ctx < 1 ? "" : "; it failed a call: reset() it");
    if (q_len < 2) return kvc_fail(KVC_ERR_ARG, "kvzip_score: the reconstruction prompt needs at least 2 tokens");
    if (start < 0 || end <= start || end > n_ctx)
        return kvc_fail(KVC_ERR_ARG, "kvzip_score: chunk [%lld, %lld) outside the %lld context positions", (long long)start,
                        (long long)end, (long long)n_ctx);
    if (n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0, got %d", n_sink);
    for (int64_t i = 0; i < q_len; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab) return kvc_fail(KVC_ERR_ARG, "token %d outside the vocabulary", ids[i]);
    kvzip_state t = {start, end, n_sink, plus != 0, scores};
    /* the hook drops the reconstruction rows again: the position goes back */
    return kvc_door_probe(s, ids, q_len, NULL, 0, kvzip_hook, &t, KVC_ROW_NONE, NULL, 0);
}

typedef struct { float s; int64_t i; } scored_row;

static int by_score(const void *a, const void *b) {
    const scored_row *x = a, *y = b;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

kvc_status kvc_evict_lowest(kvc_session *s, const float *scores, int64_t first, int64_t n, double ratio, int32_t layerwise,
                            int32_t n_sink) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const kvc_cache *cache = kvc_door_cache(s);
    const int32_t L = c->n_layers, Hkv = c->n_kv_heads;
    const int64_t per_layer = (int64_t)Hkv * n, total = (int64_t)L * per_layer;
    if (!scores) return kvc_fail(KVC_ERR_ARG, "eviction: null scores");
    if (!(ratio >= 0 && ratio <= 1)) return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1], got %g", ratio);
    if (first < 0 || n < 1) return kvc_fail(KVC_ERR_ARG, "eviction: no positions scored");
    /* the candidates: every row held inside the scored positions, in (layer, head, position) order */
    int64_t count = 0, most = 1;
    for (int32_t l = 0; l < L; l++)
        for (int32_t h = 0; h < Hkv; h++) {
            const kvc_layer_cache *Y = &cache->layers[l];
            most = Y->len[h] > most ? Y->len[h] : most;
            for (int64_t r = 0; r < Y->len[h]; r++) count += Y->pos[h][r] >= first && Y->pos[h][r] < first + n;
        }
    scored_row *sr = malloc(sizeof(scored_row) * (size_t)(count > 0 ? count : 1));
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(L + 1));
    char *pruned = calloc((size_t)(total > 0 ? total : 1), 1);
    kvc_status st = sr && at && pruned ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: eviction");
    float mx = -FLT_MAX;
    for (int64_t r = 0; st == KVC_OK && r < total; r++) mx = scores[r] > mx ? scores[r] : mx;
    int64_t k = 0;
    for (int32_t l = 0; st == KVC_OK && l < L; l++) {
        at[l] = k;
        for (int32_t h = 0; h < Hkv; h++) {
            const kvc_layer_cache *Y = &cache->layers[l];
            for (int64_t r = 0; r < Y->len[h]; r++) {
                const int64_t p = Y->pos[h][r];
                if (p < first || p >= first + n) continue;
                const int64_t i = (int64_t)l * per_layer + (int64_t)h * n + (p - first);
                sr[k++] = (scored_row){p < n_sink ? mx + 1.0f : scores[i], i}; /* the sinks above everything (kvpress: max + 1) */
            }
        }
    }
    if (st == KVC_OK) at[L] = k;
    for (int32_t part = 0; st == KVC_OK && part < (layerwise ? L : 1); part++) {
        scored_row *p = sr + (layerwise ? at[part] : 0);
        const int64_t m = layerwise ? at[part + 1] - at[part] : count, drop = (int64_t)((double)m * ratio);
        qsort(p, (size_t)m, sizeof *p, by_score);
        for (int64_t r = 0; r < drop; r++) pruned[p[r].i] = 1;
    }
    int64_t *keep[KVC_MAX_KV_HEADS] = {0}, n_keep[KVC_MAX_KV_HEADS];
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(keep[h] = malloc(sizeof(int64_t) * (size_t)most))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: eviction");
    kvc_backend_lock(kvc_door_backend(s));
    for (int32_t l = 0; l < L && st == KVC_OK; l++) {
        const kvc_layer_cache *Y = &cache->layers[l];
        for (int32_t h = 0; h < Hkv; h++) {
            n_keep[h] = 0;
            for (int64_t r = 0; r < Y->len[h]; r++) {
                const int64_t p = Y->pos[h][r];
                if (p < first || p >= first + n || !pruned[(int64_t)l * per_layer + (int64_t)h * n + (p - first)])
                    keep[h][n_keep[h]++] = r;
            }
        }
        st = kvc_cache_compact(kvc_door_cache(s), l, (const int64_t *const *)keep, n_keep, 0);
    }
    kvc_backend_unlock(kvc_door_backend(s));
    if (st != KVC_OK) kvc_door_request_reset(s); /* some layers compacted, some not */
    for (int32_t h = 0; h < Hkv; h++) free(keep[h]);
    free(sr);
    free(at);
    free(pruned);
    return st;
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

/* KVzip's eviction needs a cache to evict from and a session that did not fail a call */
static kvc_status evictable(kvc_session *s) {
    KVC_TRY(kvc_require_every_layer_pressed(&kvc_door_model(s)->cfg, "KVzip"));
    if (kvc_door_position(s) < 1 || kvc_door_needs_reset(s))
        return kvc_fail(KVC_ERR_ARG, "kvzip_evict: the session must hold the cache of the context%s",
                        kvc_door_position(s) < 1 ? "" : " (it failed a call: reset() it)");
    return KVC_OK;
}

kvc_status kvc_session_kvzip_evict(kvc_session *s, const float *scores, int64_t n_scores, double compression_ratio,
                                   int32_t layerwise, int32_t n_sink) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_evict: null session");
    KVC_TRY(evictable(s));
    KVC_TRY(kvc_check_size("kvzip_evict: scores [L, Hkv, n]", n_scores, layer_head_rows(s, kvc_door_position(s))));
    if (!(compression_ratio >= 0 && compression_ratio < 1))
        return kvc_fail(KVC_ERR_ARG, "compression_ratio must be in [0, 1), got %g", compression_ratio);
    return kvc_evict_lowest(s, scores, 0, kvc_door_position(s), compression_ratio, layerwise, n_sink);
}

kvc_status kvc_session_kvzip_evict_range(kvc_session *s, const float *scores, int64_t n_scores, int64_t first, int64_t n,
                                         double compression_ratio, int32_t layerwise, int32_t n_sink) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvzip_evict: null session");
    KVC_TRY(evictable(s));
    if (first < 0 || n < 1 || first > kvc_door_position(s) - n)
        return kvc_fail(KVC_ERR_ARG, "kvzip_evict: positions [%lld, %lld) scored, the session holds positions [0, %lld)",
                        (long long)first, (long long)first + (long long)n, (long long)kvc_door_position(s));
    KVC_TRY(kvc_check_size("kvzip_evict: scores [L, Hkv, n]", n_scores, layer_head_rows(s, n)));
    return kvc_evict_lowest(s, scores, first, n, compression_ratio, layerwise, n_sink);
}
