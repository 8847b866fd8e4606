/* LeverageScore (kvpress LeverageScorePress): the approximate leverage of a head's pre-RoPE keys under a
 * Gaussian sketch (common.c), z-scored over the layer; prefill only. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* One head's leverage of its n pre-RoPE keys x [n, d] (double) under the sketch phi [d, kk]:
 * X = (x - mean) phi, score_r = max(0, X_r (X^T X + j I)^-1 X_r^T), j = 1e-2 then 10x (5 tries, as kvpress). */
static kvc_status leverage_head(const double *x, int64_t n, int32_t d, const float *phi, int32_t kk, double *out) {
    double *X = malloc(sizeof(double) * (size_t)n * kk), *G = malloc(sizeof(double) * (size_t)kk * kk);
    double *L = malloc(sizeof(double) * (size_t)kk * kk), *mean = calloc((size_t)d, sizeof(double)), *y = malloc(sizeof(double) * kk);
    kvc_status st = X && G && L && mean && y ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: LeverageScore");
    for (int64_t r = 0; st == KVC_OK && r < n; r++)
        for (int32_t i = 0; i < d; i++) mean[i] += x[r * d + i] / (double)n;
    for (int64_t r = 0; st == KVC_OK && r < n; r++)
        for (int32_t j = 0; j < kk; j++) {
            double v = 0;
            for (int32_t i = 0; i < d; i++) v += (x[r * d + i] - mean[i]) * phi[i * kk + j];
            X[r * kk + j] = v;
        }
    for (int32_t a = 0; st == KVC_OK && a < kk; a++)
        for (int32_t b = 0; b <= a; b++) {
            double v = 0;
            for (int64_t r = 0; r < n; r++) v += X[r * kk + a] * X[r * kk + b];
            G[a * kk + b] = G[b * kk + a] = v;
        }
    int ok = 0;
    for (int t = 0; st == KVC_OK && t < 5 && !ok; t++) {
        const double jit = 1e-2 * pow(10.0, t);
        memcpy(L, G, sizeof(double) * (size_t)kk * kk);
        for (int32_t a = 0; a < kk; a++) L[a * kk + a] += jit;
        ok = kvc_cholesky(L, kk);
    }
    if (st == KVC_OK && !ok) st = kvc_fail(KVC_ERR_INTERNAL, "LeverageScore: Cholesky of the sketched Gram matrix failed after 5 jitters (as kvpress raises)");
    for (int64_t r = 0; st == KVC_OK && r < n; r++) { /* y = L^-T L^-1 X_r, score = X_r . y */
        const double *xr = X + r * kk;
        for (int32_t i = 0; i < kk; i++) {
            double v = xr[i];
            for (int32_t t = 0; t < i; t++) v -= L[i * kk + t] * y[t];
            y[i] = v / L[i * kk + i];
        }
        for (int32_t i = kk - 1; i >= 0; i--) {
            double v = y[i];
            for (int32_t t = i + 1; t < kk; t++) v -= L[t * kk + i] * y[t];
            y[i] = v / L[i * kk + i];
        }
        double sc = 0;
        for (int32_t i = 0; i < kk; i++) sc += xr[i] * y[i];
        out[r] = sc > 0 ? sc : 0;
    }
    free(X);
    free(G);
    free(L);
    free(mean);
    free(y);
    return st;
}

/* LeverageScore's z-scores of the prefill's rows [r0, r0 + n) alone, written to scores[h][r0 + r]. */
kvc_status kvc_leverage_range(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                              const int64_t *len, int64_t r0, int64_t n, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim, half = d / 2, kk = cfg->sketch_dim;
    double freq[128], ms; /* the keys of this prefill, turned as its forward turned them */
    KVC_TRY(kvc_layer_freqs(lr, ctx->layer, kvc_call_end(ctx), freq, &ms));
    float *hf = malloc(sizeof(float) * (size_t)Hkv * d * kk), *phi = malloc(sizeof(float) * (size_t)d * kk);
    double *x = malloc(sizeof(double) * (size_t)n * d), *acc = malloc(sizeof(double) * (size_t)Hkv * n);
    float *k[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = hf && phi && x && acc ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: LeverageScore");
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 0, k, NULL, &block);
    /* kvpress's sketch [Hkv, d, kk] is over HF's (half-split) dimensions: with adjacent pairs, ours are permuted */
    if (st == KVC_OK) kvc_gaussian_sketch(cfg->seed, ctx->layer, (int64_t)Hkv * d * kk, hf);
    const float scale = (float)(1.0 / sqrt((double)kk));
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        for (int32_t j = 0; j < half; j++) {
            int32_t a, b;
            kvc_rope_pair(c->rope_pairing, d, j, &a, &b);
            for (int32_t t = 0; t < kk; t++) {
                phi[a * kk + t] = hf[((int64_t)h * d + j) * kk + t] * scale;
                phi[b * kk + t] = hf[((int64_t)h * d + j + half) * kk + t] * scale;
            }
        }
        for (int64_t r = 0; r < n; r++) /* RoPE undone at the row's position */
            kvc_unrope(c->rope_pairing, d, freq, ms, (double)(ctx->pos ? ctx->pos[r0 + r] : r0 + r), k[h] + (r0 + r) * d,
                       x + r * d);
        st = leverage_head(x, n, d, phi, kk, acc + (size_t)h * n);
    }
    if (st == KVC_OK) kvc_zscore(acc, Hkv, n, r0, scores);
    kvc_free(block);
    free(hf);
    free(phi);
    free(x);
    free(acc);
    return st;
}

static kvc_status leverage_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    if (!kvc_plain_prefill(ctx, len, lr->mc->n_kv_heads))
        return kvc_fail(KVC_ERR_ARG, "LeverageScorePress scores a prefill with no past in the cache (kvpress: prefill only)");
    return kvc_leverage_range(lr, ctx, cfg, len, 0, ctx->n, scores);
}

static kvc_status leverage_check(const kvc_press_config *c) {
    if (c->sketch_dim < 1) return kvc_fail(KVC_ERR_ARG, "sketch_dimension must be a positive integer, got %d", c->sketch_dim);
    return KVC_OK;
}

static const char *const params[] = {"sketch_dim", "seed", NULL};

static const kvc_scorer_i leverage_scorer = {
    .name = "leverage",
    .title = "LeverageScore",
    .code = KVC_SCORE_LEVERAGE,
    .traits = KVC_SCORER_HOST,
    .params = params,
    .check = leverage_check,
    .host = leverage_scores,
    .select = NULL,
    .doc = "approximate leverage of the pre-RoPE keys (Gaussian sketch), z-scored (kvpress LeverageScore)",
};
KVC_REGISTER_SCORER(leverage_scorer);
