/* NonCausalAttn (Compactor's attention term; kvpress NonCausalAttnPress): a prefill's queries attend without a
 * causal mask inside chunks of attn_chunk rows (logits q.k unscaled; the last chunk padded with zero rows as kvpress
 * pads it: padded keys get logit -1e-9, padded queries logit 0 on the real keys), summed over the chunk's queries,
 * averaged over the group, times ||v||, averaged over 3 rows (zeros outside, as avg_pool1d), then z-normalised
 * over the whole layer (mean and unbiased std over every head and row). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

/* NonCausalAttn's z-scores of the prefill's rows [r0, r0 + n) alone (Compactor scores a middle slice),
 * written to scores[h][r0 + r]. */
kvc_status kvc_noncausal_range(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                               const int64_t *len, int64_t r0, int64_t n, float *const *scores) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t qd = (int64_t)H * d, C = cfg->attn_chunk;
    float *qt = malloc(sizeof(float) * (size_t)C * (size_t)qd), *qh = malloc(sizeof(float) * (size_t)C * d);
    float *dots = malloc(sizeof(float) * (size_t)C * (size_t)C);
    double *acc = calloc((size_t)Hkv * (size_t)n, sizeof(double));
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = qt && qh && dots && acc ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: NonCausalAttn");
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    for (int64_t c0 = 0; c0 < n && st == KVC_OK; c0 += C) {
        const int64_t m = n - c0 < C ? n - c0 : C; /* real rows of this chunk; C - m padded */
        st = lr->be->download(kvc_view_at(ctx->q, r0 + c0, 0), m, qd, qt, KVC_F32);
        for (int32_t hq = 0; hq < H && st == KVC_OK; hq++) {
            const int32_t h = hq / g;
            for (int64_t i = 0; i < m; i++) memcpy(qh + i * d, qt + i * qd + (int64_t)hq * d, sizeof(float) * d);
            kvc_host_gemm_nt(qh, d, k[h] + (r0 + c0) * d, dots, m, m, m, d, 0);
            /* each real query's softmax over the real keys (q.k) and the C - m padded ones (-1e-9), in place */
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                float *p = dots + i * m;
                double mx = m < C ? -1e-9 : -INFINITY, sum;
                for (int64_t j = 0; j < m; j++) mx = fmax(mx, p[j]);
                sum = (double)(C - m) * exp(-1e-9 - mx);
                for (int64_t j = 0; j < m; j++) sum += exp((double)p[j] - mx);
                for (int64_t j = 0; j < m; j++) p[j] = (float)(exp((double)p[j] - mx) / sum);
            }
            /* the C - m padded (zero) queries see logit 0 on every real key: the same row each */
            const double pad = (double)(C - m) / ((double)m + (double)(C - m) * exp(-1e-9));
            double *a = acc + (size_t)h * n + c0;
#pragma omp parallel for schedule(static)
            for (int64_t j = 0; j < m; j++) {
                double col = pad;
                for (int64_t i = 0; i < m; i++) col += dots[i * m + j];
                a[j] += col / g;
            }
        }
    }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        double *a = acc + (size_t)h * n;
        for (int64_t r = 0; r < n; r++) {
            double vn = 0;
            for (int32_t i = 0; i < d; i++) vn += (double)v[h][(r0 + r) * d + i] * v[h][(r0 + r) * d + i];
            a[r] *= sqrt(vn);
        }
        double prev = 0;
        for (int64_t r = 0; r < n; r++) { /* avg_pool1d(3, padding 1), the padding counted */
            const double cur = a[r], next = r + 1 < n ? a[r + 1] : 0.0;
            a[r] = (prev + cur + next) / 3.0;
            prev = cur;
        }
    }
    if (st == KVC_OK) kvc_zscore(acc, Hkv, n, r0, scores);
    kvc_free(block);
    free(qt);
    free(qh);
    free(dots);
    free(acc);
    return st;
}

static kvc_status noncausal_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                   const int64_t *len, float *const *scores) {
    if (!kvc_plain_prefill(ctx, len, lr->mc->n_kv_heads))
        return kvc_fail(KVC_ERR_ARG, "NonCausalAttnPress scores a prefill with no past in the cache (kvpress: prefill only)");
    return kvc_noncausal_range(lr, ctx, cfg, len, 0, ctx->n, scores);
}

static kvc_status noncausal_check(const kvc_press_config *c) {
    if (c->attn_chunk < 1) return kvc_fail(KVC_ERR_ARG, "chunk_size must be a positive integer, got %d", c->attn_chunk);
    return KVC_OK;
}

static const char *const params[] = {"attn_chunk", NULL};

static const kvc_scorer_i noncausal_scorer = {
    .name = "non_causal_attn",
    .title = "NonCausalAttn",
    .code = KVC_SCORE_NONCAUSAL,
    .traits = KVC_SCORER_HOST | KVC_SCORER_READS_V,
    .params = params,
    .check = noncausal_check,
    .host = noncausal_scores,
    .select = NULL,
    .doc = "chunked non-causal attention x ||v||, pooled, z-normalised (kvpress NonCausalAttn, Compactor)",
};
KVC_REGISTER_SCORER(noncausal_scorer);
