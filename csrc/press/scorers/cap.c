/* CapPress (CAPKV): ExpectedAttention's rotated query mean as an anchor, alignment weights
 * w = exp(tau cos(anchor, k)), a row's score w v^T (I + sum (w + eps) v v^T)^-1 v. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* Per query head hq: the anchor a = R mu (mu: the mean of this call's pre-RoPE queries after the first n_sink,
 * R: RoPE averaged over the next n_future positions, as ExpectedAttention), w_t = exp(tau (cos(a, k_t) - max)) over
 * the rows t >= n_sink, A = I + sum_t (w_t + eps) v_t v_t^T, score_t = w_t v_t^T A^-1 v_t; the mean over the group;
 * the sinks score the layer's maximum + 1. Cosines clamp to [-1, 1] with norms at least 1e-12 (F.normalize). */
static kvc_status cap_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                             const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim, ns = cfg->n_sink;
    if (ctx->n <= ns)
        return kvc_fail(KVC_ERR_ARG, "CapPress needs more queries in the forward call (%lld) than n_sink (%d)",
                        (long long)ctx->n, ns);
    for (int32_t h = 0; h < Hkv; h++)
        if (len[h] <= ns)
            return kvc_fail(KVC_ERR_ARG, "Input cache length (%lld) must be larger than n_sink=%d", (long long)len[h], ns);
    double cb[128], sb[128];
    KVC_TRY(kvc_future_rope(lr, ctx, cfg->n_future, cb, sb));
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    double *mu = malloc(sizeof(double) * (size_t)H * d), *A = malloc(sizeof(double) * (size_t)d * d);
    double *w = malloc(sizeof(double) * (size_t)maxlen), *acc = malloc(sizeof(double) * (size_t)maxlen);
    double *x = malloc(sizeof(double) * (size_t)d);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = mu && A && w && acc && x ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CapPress");
    if (st == KVC_OK) st = kvc_query_stats(lr, ctx, ns, mu, NULL);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    double top = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t nr = len[h] - ns;
        const float *kh = k[h] + (int64_t)ns * d, *vh = v[h] + (int64_t)ns * d;
        memset(acc, 0, sizeof(double) * (size_t)nr);
        for (int32_t j = 0; j < g && st == KVC_OK; j++) {
            double *a = mu + (int64_t)(h * g + j) * d, an = 0, mx = -INFINITY;
            kvc_avg_rotate(c->rope_pairing, d, cb, sb, a, 1);
            for (int32_t i = 0; i < d; i++) an += a[i] * a[i];
            an = fmax(sqrt(an), 1e-12);
            for (int64_t r = 0; r < nr; r++) {
                double dot = 0, kn = 0;
                for (int32_t i = 0; i < d; i++) {
                    dot += a[i] * kh[r * d + i];
                    kn += (double)kh[r * d + i] * kh[r * d + i];
                }
                double cs = dot / an / fmax(sqrt(kn), 1e-12);
                w[r] = cfg->cap_tau * (cs < -1 ? -1 : cs > 1 ? 1 : cs);
                mx = fmax(mx, w[r]);
            }
            for (int64_t r = 0; r < nr; r++) w[r] = exp(w[r] - mx);
            for (int32_t i = 0; i < d * d; i++) A[i] = i % (d + 1) == 0 ? 1.0 : 0.0;
            for (int64_t r = 0; r < nr; r++) { /* A += (w + eps) v v^T, lower triangle */
                const double s = w[r] + cfg->epsilon;
                const float *vr = vh + r * d;
                for (int32_t p = 0; p < d; p++)
                    for (int32_t q = 0; q <= p; q++) A[p * d + q] += s * vr[p] * vr[q];
            }
            if (!kvc_cholesky(A, d)) {
                st = kvc_fail(KVC_ERR_INTERNAL, "CapPress: the capacity matrix of layer %d head %d is not positive definite",
                              ctx->layer, h * g + j);
                break;
            }
            for (int64_t r = 0; r < nr; r++) { /* v^T A^-1 v = ||L^-1 v||^2 */
                double lev = 0;
                for (int32_t p = 0; p < d; p++) {
                    double y = vh[r * d + p];
                    for (int32_t q = 0; q < p; q++) y -= A[p * d + q] * x[q];
                    x[p] = y / A[p * d + p];
                    lev += x[p] * x[p];
                }
                acc[r] += w[r] * lev / g;
            }
        }
        for (int64_t r = 0; r < nr && st == KVC_OK; r++) {
            scores[h][r + ns] = (float)acc[r];
            top = fmax(top, (double)scores[h][r + ns]);
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) /* the sinks: the layer's maximum + 1, as kvpress pads them */
        for (int32_t r = 0; r < ns; r++) scores[h][r] = (float)(top + 1);
    kvc_free(block);
    free(mu); free(A); free(w); free(acc); free(x);
    return st;
}

static kvc_status cap_check(const kvc_press_config *c) {
    if (c->n_future < 1) return kvc_fail(KVC_ERR_ARG, "n_future_positions must be a positive integer, got %d", c->n_future);
    if (!(c->epsilon >= 0 && isfinite(c->epsilon))) return kvc_fail(KVC_ERR_ARG, "epsilon must be finite and >= 0, got %g", c->epsilon);
    if (!isfinite(c->cap_tau)) return kvc_fail(KVC_ERR_ARG, "tau must be finite, got %g", c->cap_tau);
    return KVC_OK;
}

static const char *const params[] = {"n_sink", "n_future", "epsilon", "cap_tau", NULL};

static const kvc_scorer_i cap_scorer = {
    .name = "cap",
    .title = "CapPress",
    .code = KVC_SCORE_CAP,
    .traits = KVC_SCORER_HOST | KVC_SCORER_READS_V,
    .params = params,
    .check = cap_check,
    .host = cap_scores,
    .select = NULL,
    .doc = "w v^T (I + sum (w + eps) v v^T)^-1 v, w = exp(tau cos(k, R mean q)) (CAPKV)",
};
KVC_REGISTER_SCORER(cap_scorer);
