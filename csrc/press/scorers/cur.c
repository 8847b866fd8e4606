/* CUR (CurDKV; kvpress CURPress): ||k||^2, ||v||^2 (optionally through a Gaussian sketch), windowed,
 * combined by leverage_type, normalised; the sinks score 1. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

#define CUR_SKETCH 20 /* kvpress's r */

/* x2[r] = ||x_r||^2, or ||x_r G||^2 with the sketch g [d, CUR_SKETCH] (NULL: none); then, with a window w,
 * divided by the sum over its block of w rows (blocks from row 0, the last one zero-padded). */
static void cur_norms(const float *x, int64_t n, int32_t d, const float *g, int32_t w, double *x2) {
    for (int64_t r = 0; r < n; r++) {
        double s = 0;
        if (g) {
            for (int32_t j = 0; j < CUR_SKETCH; j++) {
                double p = 0;
                for (int32_t i = 0; i < d; i++) p += (double)x[r * d + i] * g[i * CUR_SKETCH + j];
                s += p * p;
            }
        } else {
            for (int32_t i = 0; i < d; i++) s += (double)x[r * d + i] * x[r * d + i];
        }
        x2[r] = s;
    }
    for (int64_t b = 0; w > 0 && b < n; b += w) {
        const int64_t e = b + w < n ? b + w : n;
        double s = 0;
        for (int64_t r = b; r < e; r++) s += x2[r];
        for (int64_t r = b; r < e; r++) x2[r] /= s;
    }
}

static kvc_status cur_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                             const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim, half = d / 2;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    float *gh = cfg->cur_random ? malloc(sizeof(float) * (size_t)d * CUR_SKETCH) : NULL;
    float *gk = cfg->cur_random ? malloc(sizeof(float) * (size_t)d * CUR_SKETCH) : NULL;
    double *k2 = malloc(sizeof(double) * (size_t)maxlen), *v2 = malloc(sizeof(double) * (size_t)maxlen);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = k2 && v2 && (!cfg->cur_random || (gh && gk)) ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CUR");
    if (st == KVC_OK && cfg->cur_random) {
        /* kvpress's G = randn(d, 20) / sqrt(20) over HF's dimensions: V's are ours; K's rows follow RoPE's pairs */
        kvc_gaussian_sketch(cfg->seed, ctx->layer, (int64_t)d * CUR_SKETCH, gh);
        const float sq = (float)sqrt((double)CUR_SKETCH);
        for (int32_t i = 0; i < d * CUR_SKETCH; i++) gh[i] /= sq; /* randn / sqrt(r) in float, as torch */
        for (int32_t j = 0; j < half; j++) {
            int32_t a, b;
            kvc_rope_pair(c->rope_pairing, d, j, &a, &b);
            memcpy(gk + (int64_t)a * CUR_SKETCH, gh + (int64_t)j * CUR_SKETCH, sizeof(float) * CUR_SKETCH);
            memcpy(gk + (int64_t)b * CUR_SKETCH, gh + (int64_t)(j + half) * CUR_SKETCH, sizeof(float) * CUR_SKETCH);
        }
    }
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t n = len[h];
        cur_norms(k[h], n, d, gk, cfg->cur_window, k2);
        cur_norms(v[h], n, d, gh, cfg->cur_window, v2);
        double tot = 0;
        for (int64_t r = 0; r < n; r++) {
            const double s = cfg->cur_type == 0 ? k2[r] : cfg->cur_type == 1 ? v2[r]
                           : cfg->cur_type == 2 ? (k2[r] + v2[r]) / 2 : k2[r] * v2[r];
            k2[r] = s;
            tot += s;
        }
        for (int64_t r = 0; r < n; r++) scores[h][r] = r < cfg->n_sink ? 1.0f : (float)(k2[r] / tot);
    }
    kvc_free(block);
    free(gh);
    free(gk);
    free(k2);
    free(v2);
    return st;
}

static kvc_status cur_check(const kvc_press_config *c) {
    if (c->cur_type < 0 || c->cur_type > 3)
        return kvc_fail(KVC_ERR_ARG, "leverage_type must be 'key', 'value', 'kv_avg' or 'kv_product' (0-3), got %d", c->cur_type);
    if (c->cur_window < 0) return kvc_fail(KVC_ERR_ARG, "local_window_size must be a positive integer, got %d", c->cur_window);
    return KVC_OK;
}

static const char *const params[] = {"n_sink", "cur_type", "cur_window", "cur_random", "seed", NULL};

static const kvc_scorer_i cur_scorer = {
    .name = "cur",
    .title = "CUR",
    .code = KVC_SCORE_CUR,
    .traits = KVC_SCORER_HOST | KVC_SCORER_READS_V,
    .params = params,
    .check = cur_check,
    .host = cur_scores,
    .select = NULL,
    .doc = "||k||^2, ||v||^2 (optionally sketched), windowed, combined, normalised (CurDKV)",
};
KVC_REGISTER_SCORER(cur_scorer);
