/* DropKV ("KV cache eviction via Decoupled Residual-Output Perturbation", openreview MqfNzH3TVH; kvpress pull
 * request #285, DropKVPress). Evicting row r alone renormalises the softmax of window query j over the rows left,
 * which moves its attention output o_j by p_jr / (1 - p_jr) (o_j - v_r). A row's score is that move squared,
 * summed over the last `window` queries:
 *     s_r = sum_j (p_jr / (1 - p_jr + epsilon))^2 ||v_r - o_j||^2,
 * averaged over the query heads of the KV head, average-pooled over `kernel` rows (zero padding counted, as
 * torch's avg_pool1d), the window rows then set to the head's maximum + 1 (kept first). kvpress keeps at least
 * the window in every head (KVC_SCORER_KEEP_WINDOW). On the host over the backend's rows (every device): the
 * probabilities and outputs in fp32 GEMMs, the squared distances summed in double in the direct form (the
 * kvpress code expands the square, which cancels in fp32). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* acc[r] += sum_j w(p_jr) ||v_r - o_j||^2 over the w window queries of one query head. */
static void residuals(const float *p, const float *o, const float *v, int64_t len, int32_t w, int32_t d, double eps,
                      double *acc) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < len; r++) {
        const float *vr = v + r * d;
        double s = 0;
        for (int32_t j = 0; j < w; j++) {
            const double pj = p[(int64_t)j * len + r];
            if (pj == 0) continue; /* a row after the query's position: masked, p = 0 */
            const double a = pj / (1.0 - pj + eps);
            double dist = 0;
            for (int32_t e = 0; e < d; e++) {
                const double x = (double)vr[e] - o[(int64_t)j * d + e];
                dist += x * x;
            }
            s += a * a * dist;
        }
        acc[r] += s;
    }
}

/* torch.nn.functional.avg_pool1d(x, kernel, stride 1, padding kernel // 2): zeros counted. */
static void avg_pool(const double *x, int64_t n, int32_t kernel, float *out) {
    const int64_t half = kernel / 2;
    for (int64_t r = 0; r < n; r++) {
        double s = 0;
        for (int64_t t = r - half; t <= r + half; t++)
            if (t >= 0 && t < n) s += x[t];
        out[r] = (float)(s / kernel);
    }
}

static kvc_status dropkv_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                const int64_t *len, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim, w = cfg->window;
    const int64_t qd = (int64_t)H * d;
    for (int32_t h = 0; h < Hkv; h++)
        if (len[h] < w) return kvc_fail(KVC_ERR_ARG, "DropKV: a head holds %lld rows, fewer than the window (%d)",
                                        (long long)len[h], w);
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    float *q = malloc(sizeof(float) * (size_t)w * (size_t)qd), *qh = malloc(sizeof(float) * (size_t)w * (size_t)d);
    float *p = malloc(sizeof(float) * (size_t)w * (size_t)maxlen), *o = malloc(sizeof(float) * (size_t)w * (size_t)d);
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)w);
    double *acc = malloc(sizeof(double) * (size_t)maxlen);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = q && qh && p && o && vis && acc ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: DropKV scores");
    if (st == KVC_OK) st = lr->be->download(kvc_view_at(ctx->q, ctx->n - w, 0), w, qd, q, KVC_F32);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    const float scale = 1.0f / sqrtf((float)d);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t n = len[h];
        for (int32_t j = 0; j < w; j++) vis[j] = n - w + j + 1; /* causal: query j is row n - w + j */
        memset(acc, 0, sizeof(double) * (size_t)n);
        for (int32_t hq = h * g; hq < (h + 1) * g; hq++) {
            for (int32_t j = 0; j < w; j++) memcpy(qh + (int64_t)j * d, q + (int64_t)j * qd + (int64_t)hq * d, sizeof(float) * (size_t)d);
            kvc_host_probs_rows(qh, w, k[h], n, d, scale, vis, p);
            kvc_host_gemm_nn(p, n, v[h], d, o, d, w, d, n, 0); /* o_j = sum_r p_jr v_r */
            residuals(p, o, v[h], n, w, d, cfg->epsilon, acc);
        }
        for (int64_t r = 0; r < n; r++) acc[r] /= g;
        avg_pool(acc, n, cfg->kernel, scores[h]);
        float top = -INFINITY;
        for (int64_t r = 0; r < n; r++) top = fmaxf(top, scores[h][r]);
        for (int64_t r = n - w; r < n; r++) scores[h][r] = top + 1.0f;
    }
    kvc_free(block);
    free(q);
    free(qh);
    free(p);
    free(o);
    free(vis);
    free(acc);
    return st;
}

static kvc_status dropkv_check(const kvc_press_config *c) {
    if (!(c->epsilon > 0 && isfinite(c->epsilon)))
        return kvc_fail(KVC_ERR_ARG, "DropKV epsilon must be finite and > 0, got %g", c->epsilon);
    return KVC_OK;
}

static const char *const params[] = {"window", "kernel", "epsilon", NULL};

static const kvc_scorer_i dropkv_scorer = {
    .name = "dropkv",
    .title = "DropKV",
    .code = -1, /* a host scorer: its code is given at registration */
    .traits = KVC_SCORER_HOST | KVC_SCORER_WINDOW | KVC_SCORER_READS_V | KVC_SCORER_KEEP_WINDOW,
    .params = params,
    .check = dropkv_check,
    .host = dropkv_scores,
    .select = NULL,
    .doc = "squared change of the window queries' outputs if the row alone were evicted (DropKV, kvpress PR #285)",
};
KVC_REGISTER_SCORER(dropkv_scorer);
