/* FinchPress's scores (FINCH, Corallo & Papotti, 2024; kvpress FinchPress): the window is the question
 * that follows the context (its length set per prompt by the Python press). Each of the w window queries
 * (row len - w + j, seeing rows <= len - w + j) takes its softmax attention over the rows it sees; with
 * normalize (kvpress normalize_scores) that row is multiplied by len - w + j, so late queries, whose
 * attention is spread over more rows, weigh as much as early ones. Score of a past row = the mean over the
 * window queries, then over the KV head's group of query heads; no pooling (kvpress's FinchPress has
 * none). The window rows get the layer's maximum + 1, so they are kept first. On the host over the
 * backend's rows (every device), in double precision. SimLayerKV reads the same window attention, never
 * normalised (its window is the last n_last queries). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

kvc_status kvc_finch_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                            const int64_t *len, int normalize, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim, w = cfg->window;
    const int64_t qd = (int64_t)H * d;
    if (w < 1 || w > ctx->n)
        return kvc_fail(KVC_ERR_ARG, "FinchPress/SimLayerKV: the window (%d) must be 1 .. the forward call's %lld tokens", w,
                        (long long)ctx->n);
    for (int32_t h = 0; h < Hkv; h++)
        if (len[h] < w) return kvc_fail(KVC_ERR_ARG, "FinchPress/SimLayerKV: a head holds %lld rows, fewer than the window (%d)",
                                        (long long)len[h], w);
    const double scale = 1.0 / sqrt((double)d);
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    float *q = malloc(sizeof(float) * (size_t)w * (size_t)qd), *k[KVC_MAX_KV_HEADS], *block = NULL;
    double *logit = malloc(sizeof(double) * (size_t)maxlen), *acc = malloc(sizeof(double) * (size_t)maxlen);
    kvc_status st = q && logit && acc ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: FinchPress scores");
    if (st == KVC_OK) st = lr->be->download(kvc_view_at(ctx->q, ctx->n - w, 0), w, qd, q, KVC_F32);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 0, k, NULL, &block);
    double top = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t past = len[h] - w; /* the rows scored; the window follows them */
        memset(acc, 0, sizeof(double) * (size_t)(past > 0 ? past : 1));
        for (int32_t hq = h * g; hq < (h + 1) * g; hq++)
            for (int32_t j = 0; j < w; j++) {
                const float *qj = q + (int64_t)j * qd + (int64_t)hq * d;
                const int64_t vis = past + j + 1;
                double mx = -INFINITY, sum = 0;
                for (int64_t r = 0; r < vis; r++) {
                    const float *kr = k[h] + r * d;
                    double dot = 0;
                    for (int32_t e = 0; e < d; e++) dot += (double)qj[e] * kr[e];
                    logit[r] = dot * scale;
                    mx = fmax(mx, logit[r]);
                }
                for (int64_t r = 0; r < vis; r++) sum += exp(logit[r] - mx);
                const double weight = normalize ? (double)(past + j) : 1.0;
                for (int64_t r = 0; r < past; r++) acc[r] += exp(logit[r] - mx) / sum * weight;
            }
        for (int64_t r = 0; r < past; r++) {
            scores[h][r] = (float)(acc[r] / ((double)w * g));
            top = fmax(top, scores[h][r]);
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        for (int64_t r = len[h] - w; r < len[h]; r++) scores[h][r] = (float)(top + 1);
    kvc_free(block);
    free(q);
    free(logit);
    free(acc);
    return st;
}

static kvc_status finch_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                               const int64_t *len, float *const *scores) {
    return kvc_finch_scores(lr, ctx, cfg, len, cfg->finch_normalize, scores);
}

static const char *const params[] = {"window", "finch_normalize", NULL};

static const kvc_scorer_i finch_scorer = {
    .name = "finch",
    .title = "FinchPress",
    .code = KVC_SCORE_FINCH,
    .traits = KVC_SCORER_HOST | KVC_SCORER_WINDOW,
    .params = params,
    .check = NULL,
    .host = finch_scores,
    .select = NULL,
    .doc = "window queries' attention, each times the keys it sees - 1, unpooled (FINCH, Corallo & Papotti 2024)",
};
KVC_REGISTER_SCORER(finch_scorer);
