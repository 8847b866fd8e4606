/* LagKV (Liang et al., 2025; kvpress LagKVPress): rows after the n_sink sinks in partitions of lag_size; a
 * partition's K and V are min-max normalised by the next partition's per-dimension range, the std over
 * dimensions softmaxed over the partition, K and V averaged, then ranked inside the partition
 * (rank / lag_size) unless cross_scoring; sinks and the last (reference-only) partition and the remainder
 * score 1. On the host, in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* Softmax over the lag rows of partition x of the std over dimensions of (x - min) / (max - min), the
 * range per dimension from partition ref (both [lag, d]); out[lag] accumulates half of it; sd: scratch [lag]. */
static void lag_states(const float *x, const float *ref, int64_t lag, int32_t d, double *sd, double *out) {
    double lo[256], hi[256];
    for (int32_t i = 0; i < d; i++) lo[i] = hi[i] = ref[i];
    for (int64_t r = 1; r < lag; r++)
        for (int32_t i = 0; i < d; i++) {
            lo[i] = fmin(lo[i], ref[r * d + i]);
            hi[i] = fmax(hi[i], ref[r * d + i]);
        }
    double mx = -INFINITY;
    for (int64_t r = 0; r < lag; r++) {
        double mean = 0, ss = 0;
        for (int32_t i = 0; i < d; i++) mean += (x[r * d + i] - lo[i]) / (hi[i] - lo[i]);
        mean /= d;
        for (int32_t i = 0; i < d; i++) {
            const double z = (x[r * d + i] - lo[i]) / (hi[i] - lo[i]) - mean;
            ss += z * z;
        }
        sd[r] = sqrt(ss / (d - 1)); /* torch's std: unbiased */
        mx = fmax(mx, sd[r]);
    }
    double sum = 0;
    for (int64_t r = 0; r < lag; r++) sum += (sd[r] = exp(sd[r] - mx));
    for (int64_t r = 0; r < lag; r++) out[r] += 0.5 * sd[r] / sum;
}

static kvc_status lagkv_head(const float *k, const float *v, int64_t n, int32_t d, int32_t n_sink, int64_t lag,
                             int32_t cross, float *out) {
    if (n < n_sink + 2 * lag) { /* too short for two partitions: a ramp after the sinks, as kvpress */
        for (int64_t r = 0; r < n; r++) out[r] = r < n_sink ? 1.0f : (float)((double)(r - n_sink) / (double)(n - n_sink));
        return KVC_OK;
    }
    const int64_t parts = (n - n_sink) / lag;
    double *s = malloc(sizeof(double) * (size_t)lag * 2);
    if (!s) return kvc_fail(KVC_ERR_NOMEM, "out of memory: LagKV scores");
    double *sd = s + lag;
    for (int64_t r = 0; r < n; r++) out[r] = 1.0f;
    for (int64_t p = 0; p < parts - 1; p++) {
        const int64_t r0 = n_sink + p * lag;
        memset(s, 0, sizeof(double) * (size_t)lag);
        lag_states(k + r0 * d, k + (r0 + lag) * d, lag, d, sd, s);
        lag_states(v + r0 * d, v + (r0 + lag) * d, lag, d, sd, s);
        if (cross) {
            for (int64_t r = 0; r < lag; r++) out[r0 + r] = (float)s[r];
            continue;
        }
        /* rank inside the partition (0 = lowest; equal scores by row), over lag_size */
        for (int64_t r = 0; r < lag; r++) {
            int64_t rank = 0;
            for (int64_t j = 0; j < lag; j++) rank += s[j] < s[r] || (s[j] == s[r] && j < r);
            out[r0 + r] = (float)((double)rank / (double)lag);
        }
    }
    free(s);
    return KVC_OK;
}

static kvc_status lagkv_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                               const int64_t *len, float *const *scores) {
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        st = lagkv_head(k[h], v[h], len[h], d, cfg->n_sink, cfg->lag_size, cfg->cross_scoring, scores[h]);
    kvc_free(block);
    return st;
}

static kvc_status lagkv_check(const kvc_press_config *c) {
    if (c->lag_size < 1) return kvc_fail(KVC_ERR_ARG, "lag_size must be a positive integer, got %d", c->lag_size);
    return KVC_OK;
}

static const char *const params[] = {"n_sink", "lag_size", "cross_scoring", NULL};

static const kvc_scorer_i lagkv_scorer = {
    .name = "lagkv",
    .title = "LagKV",
    .code = KVC_SCORE_LAGKV,
    .traits = KVC_SCORER_HOST | KVC_SCORER_CHUNKABLE | KVC_SCORER_READS_V,
    .params = params,
    .check = lagkv_check,
    .host = lagkv_scores,
    .select = NULL,
    .doc = "K/V std against the next partition, ranked (LagKV, Liang et al. 2025)",
};
KVC_REGISTER_SCORER(lagkv_scorer);
