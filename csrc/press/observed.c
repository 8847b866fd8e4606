/* The press algorithms that run on the host, whatever the device: the layer's rows and this call's
 * queries are brought to the host as fp32 (a memcpy on the CPU backend), then:
 *  - ObservedAttention / H2O one-shot (docs/METHODS.md, "Baseline scorers"): each row's attention summed over
 *    the call's queries that see it, divided by how many do; mean over the group. Queries go in tiles of
 *    OBS_TILE (one GEMM each), so memory is O(tile x len), never n x n.
 *  - Ada-KV's eviction loss (AdaKV-headwise-budgets.txt; docs/METHODS.md "Diagnostics"): the L1 distance between
 *    the window queries' attention output over every row and over the kept rows, mean over queries and
 *    heads, in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../model/model.h"
#include "press.h"

#define OBS_TILE 128

kvc_status kvc_press_layer_rows(const kvc_layer_rows *lr, const int64_t *len, int want_v, float **k, float **v,
                             float **block) {
    const kvc_config *c = lr->mc;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim;
    size_t rows = 0;
    for (int32_t h = 0; h < Hkv; h++) rows += (size_t)len[h];
    *block = kvc_malloc(sizeof(float) * (rows ? rows : 1) * (size_t)d * (want_v ? 2 : 1), "layer rows on the host");
    if (!*block) return KVC_ERR_NOMEM;
    /* the layer in one batched read (one transfer, one wait on a device): K of every head, then V */
    float *kb = *block, *vb = want_v ? *block + rows * (size_t)d : NULL;
    size_t off = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        k[h] = kb + off;
        if (want_v) v[h] = vb + off;
        off += (size_t)len[h] * d;
    }
    return lr->be->kv_read_heads(lr->kv, NULL, len, kb, vb);
}

kvc_status kvc_observed_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const int64_t *len,
                               float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const float scale = kvc_attn_scale(c); /* the model's own attention */
    const int64_t n = ctx->n, qd = (int64_t)H * d;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    float *k[KVC_MAX_KV_HEADS], *block = NULL;
    float *qt = malloc(sizeof(float) * OBS_TILE * (size_t)qd), *qh = malloc(sizeof(float) * OBS_TILE * (size_t)d);
    float *probs = malloc(sizeof(float) * OBS_TILE * (size_t)maxlen);
    double *acc = calloc((size_t)Hkv * (size_t)maxlen, sizeof(double));
    int64_t vis[OBS_TILE];
    kvc_status st = (!qt || !qh || !probs || !acc) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: observed-attention scores") : KVC_OK;
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 0, k, NULL, &block);
    for (int64_t i0 = 0; i0 < n && st == KVC_OK; i0 += OBS_TILE) {
        const int64_t m = n - i0 < OBS_TILE ? n - i0 : OBS_TILE;
        st = lr->be->download(kvc_view_at(ctx->q, i0, 0), m, qd, qt, KVC_F32);
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            const int64_t past = ctx->past_len[h];
            for (int64_t i = 0; i < m; i++) vis[i] = past + i0 + i + 1;
            for (int32_t j = 0; j < g; j++) {
                const int32_t hq = h * g + j;
                for (int64_t i = 0; i < m; i++) memcpy(qh + i * d, qt + i * qd + (int64_t)hq * d, sizeof(float) * d);
                kvc_host_probs_rows_capped(qh, m, k[h], len[h], d, scale, c->attn_softcap, vis, probs);
                double *a = acc + (size_t)h * maxlen;
#pragma omp parallel for schedule(static)
                for (int64_t r = 0; r < len[h]; r++) {
                    double sum = 0;
                    for (int64_t i = 0; i < m; i++) sum += probs[(size_t)i * len[h] + r];
                    a[r] += sum;
                }
            }
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t past = ctx->past_len[h];
        for (int64_t r = 0; r < len[h]; r++) {
            const int64_t seen = r < past ? n : n - (r - past);
            scores[h][r] = (float)(acc[(size_t)h * maxlen + r] / (seen > 0 ? seen : 1) / g);
        }
    }
    kvc_free(block);
    free(qt);
    free(qh);
    free(probs);
    free(acc);
    return st;
}

/* A scaled score of the model's own attention: soft-capped where the model caps them (Gemma 2). */
static double model_score(double s, float cap) { return cap > 0 ? kvc_softcap((float)s, cap) : s; }

kvc_status kvc_eviction_error(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const int64_t *len, int32_t w,
                              const int64_t *const *keep, const int64_t *n_keep, double *out) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t qd = (int64_t)H * d;
    const float scale = kvc_attn_scale(c); /* the model's own attention */
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    float *q = malloc(sizeof(float) * (size_t)w * (size_t)qd);
    kvc_status st = q ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: eviction loss");
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    if (st == KVC_OK) st = lr->be->download(kvc_view_at(ctx->q, ctx->n - w, 0), w, qd, q, KVC_F32);
    double total = 0;
    int64_t count = 0;
    int oom = 0;
    if (st == KVC_OK) {
#pragma omp parallel for reduction(+ : total, count, oom) schedule(dynamic, 1)
        for (int32_t hq = 0; hq < H; hq++) {
            const int32_t h = hq / g;
            char *kept = calloc((size_t)(len[h] > 0 ? len[h] : 1), 1);
            double *full = malloc(sizeof(double) * d), *part = malloc(sizeof(double) * d);
            if (!kept || !full || !part) {
                oom = 1;
            } else {
                for (int64_t i = 0; i < n_keep[h]; i++) kept[keep[h][i]] = 1;
                for (int64_t i = 0; i < w; i++) {
                    const float *qi = q + i * qd + (int64_t)hq * d;
                    const int64_t visible = ctx->past_len[h] + (ctx->n - w + i) + 1;
                    double mx = -INFINITY;
                    for (int64_t r = 0; r < visible; r++) {
                        double dot = 0;
                        for (int32_t t = 0; t < d; t++) dot += qi[t] * k[h][r * d + t];
                        mx = fmax(mx, model_score(dot * scale, c->attn_softcap));
                    }
                    double zf = 0, zp = 0;
                    memset(full, 0, sizeof(double) * d);
                    memset(part, 0, sizeof(double) * d);
                    for (int64_t r = 0; r < visible; r++) {
                        double dot = 0;
                        for (int32_t t = 0; t < d; t++) dot += qi[t] * k[h][r * d + t];
                        const double e = exp(model_score(dot * scale, c->attn_softcap) - mx);
                        zf += e;
                        for (int32_t t = 0; t < d; t++) full[t] += e * v[h][r * d + t];
                        if (kept[r]) {
                            zp += e;
                            for (int32_t t = 0; t < d; t++) part[t] += e * v[h][r * d + t];
                        }
                    }
                    double err = 0;
                    for (int32_t t = 0; t < d; t++) err += fabs(full[t] / zf - (zp > 0 ? part[t] / zp : 0));
                    total += err;
                    count += 1;
                }
            }
            free(kept);
            free(full);
            free(part);
        }
        if (oom) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: eviction loss");
    }
    kvc_free(block);
    free(q);
    if (st == KVC_OK) *out = count ? total / count : NAN;
    return st;
}
