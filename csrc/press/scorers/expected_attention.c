/* ExpectedAttention (kvpress ExpectedAttentionPress): the mean and covariance of this call's queries after the
 * first n_sink, with RoPE undone, rotated by RoPE averaged over the next n_future positions; a key's score is
 * the softmax over the non-sink rows of k.mu / sqrt(d) + k^T Cov k / 2d, averaged over the group, times ||v||
 * (+ epsilon first); the sinks score the layer's maximum + 1. ExpectedAttentionStatsPress gives the statistics
 * instead (lr->q_mean, lr->q_cov). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* ExpectedAttentionStats: mu and cov of query head layout [H, d], [H, d, d] from the statistics the press was
 * given (pre-RoPE, the model's channel order) instead of this call's queries. */
static void given_stats(const kvc_layer_rows *lr, double *mu, double *cov) {
    const int64_t qd = (int64_t)lr->mc->n_heads * lr->mc->head_dim;
    for (int64_t i = 0; i < qd; i++) mu[i] = lr->q_mean[i];
    for (int64_t i = 0; cov && i < qd * lr->mc->head_dim; i++) cov[i] = lr->q_cov[i];
}

static kvc_status expected_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim, ns = cfg->n_sink;
    if (ctx->n <= ns && !lr->q_mean) /* given statistics need no queries */
        return kvc_fail(KVC_ERR_ARG, "ExpectedAttention needs more queries in the forward call (%lld) than n_sink (%d)",
                        (long long)ctx->n, ns);
    for (int32_t h = 0; h < Hkv; h++)
        if (len[h] <= ns)
            return kvc_fail(KVC_ERR_ARG, "ExpectedAttention needs more tokens (%lld) than n_sink (%d)", (long long)len[h], ns);
    double cb[128], sb[128];
    KVC_TRY(kvc_future_rope(lr, ctx, cfg->n_future, cb, sb));
    const int64_t qd = (int64_t)H * d;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    const int cov_on = cfg->use_covariance != 0;
    double *mu = malloc(sizeof(double) * (size_t)qd), *cov = cov_on ? malloc(sizeof(double) * (size_t)qd * d) : NULL;
    float *B = malloc(sizeof(float) * (size_t)(d + 1) * d), *T = malloc(sizeof(float) * (size_t)maxlen * (d + 1));
    double *acc = malloc(sizeof(double) * (size_t)maxlen), *lg = malloc(sizeof(double) * (size_t)maxlen);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = mu && (cov || !cov_on) && B && T && acc && lg ? KVC_OK
                                                                 : kvc_fail(KVC_ERR_NOMEM, "out of memory: ExpectedAttention");
    if (st == KVC_OK && lr->q_mean) given_stats(lr, mu, cov);
    else if (st == KVC_OK) st = kvc_query_stats(lr, ctx, ns, mu, cov);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    double top = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t nr = len[h] - ns;
        const float *kh = k[h] + (int64_t)ns * d;
        memset(acc, 0, sizeof(double) * (size_t)nr);
        for (int32_t j = 0; j < g; j++) {
            const int32_t hq = h * g + j;
            double *m = mu + (int64_t)hq * d;
            kvc_avg_rotate(c->rope_pairing, d, cb, sb, m, 1);
            /* B = [R Cov R^T; R mu]: one GEMM gives K (R Cov R^T) and K R mu */
            const int32_t cols = cov_on ? d + 1 : 1;
            if (cov_on) {
                double *C = cov + (int64_t)hq * d * d;
                for (int32_t col = 0; col < d; col++) kvc_avg_rotate(c->rope_pairing, d, cb, sb, C + col, d); /* R C */
                for (int32_t row = 0; row < d; row++) kvc_avg_rotate(c->rope_pairing, d, cb, sb, C + row * d, 1); /* (R C) R^T */
                for (int32_t i = 0; i < d * d; i++) B[i] = (float)C[i];
            }
            for (int32_t i = 0; i < d; i++) B[(int64_t)(cols - 1) * d + i] = (float)m[i];
            kvc_host_gemm_nt(kh, d, B, T, cols, nr, cols, d, 0);
            double mx = -INFINITY;
            for (int64_t r = 0; r < nr; r++) {
                double l = T[r * cols + cols - 1] / sqrt((double)d);
                if (cov_on) {
                    double quad = 0;
                    for (int32_t i = 0; i < d; i++) quad += (double)T[r * cols + i] * kh[r * d + i];
                    l += quad / d / 2;
                }
                lg[r] = l;
                mx = fmax(mx, l);
            }
            double sum = 0;
            for (int64_t r = 0; r < nr; r++) sum += (lg[r] = exp(lg[r] - mx));
            for (int64_t r = 0; r < nr; r++) acc[r] += lg[r] / sum / g;
        }
        for (int64_t r = 0; r < nr; r++) {
            double s = acc[r];
            if (cfg->use_vnorm) {
                const float *vr = v[h] + (r + ns) * d;
                double vn = 0;
                for (int32_t i = 0; i < d; i++) vn += (double)vr[i] * vr[i];
                s = (s + cfg->epsilon) * sqrt(vn);
            }
            scores[h][r + ns] = (float)s;
            top = fmax(top, (double)scores[h][r + ns]);
        }
    }
    /* the sinks: the layer's maximum + 1, as kvpress pads them */
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        for (int32_t r = 0; r < ns; r++) scores[h][r] = (float)(top + 1);
    kvc_free(block);
    free(mu);
    free(cov);
    free(B);
    free(T);
    free(acc);
    free(lg);
    return st;
}

static kvc_status expected_check(const kvc_press_config *c) {
    if (c->n_future < 1) return kvc_fail(KVC_ERR_ARG, "n_future_positions must be a positive integer, got %d", c->n_future);
    if (!(c->epsilon >= 0 && isfinite(c->epsilon))) return kvc_fail(KVC_ERR_ARG, "epsilon must be finite and >= 0, got %g", c->epsilon);
    return KVC_OK;
}

static const char *const params[] = {"n_sink", "n_future", "use_covariance", "use_vnorm", "epsilon", NULL};

static const kvc_scorer_i expected_scorer = {
    .name = "expected_attention",
    .title = "ExpectedAttention",
    .code = KVC_SCORE_EXPECTED,
    .traits = KVC_SCORER_HOST | KVC_SCORER_READS_V | KVC_SCORER_QUERY_STATS,
    .params = params,
    .check = expected_check,
    .host = expected_scores,
    .select = NULL,
    .doc = "softmax of E[q] k + k^T Cov[q] k / 2 over future positions, times ||v|| (kvpress ExpectedAttention)",
};
KVC_REGISTER_SCORER(expected_scorer);
