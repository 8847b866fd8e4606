/* Compactor (kvpress CompactorPress): blend x LeverageScore + NonCausalAttn over the rows between the sinks,
 * the sinks kept at the layer's maximum; prefill only. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "common.h"

static kvc_status compactor_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                   const int64_t *len, float *const *scores) {
    const int32_t Hkv = lr->mc->n_kv_heads;
    const int64_t n = ctx->n;
    if (!kvc_plain_prefill(ctx, len, Hkv))
        return kvc_fail(KVC_ERR_ARG, "CompactorPress scores a prefill with no past in the cache (kvpress: prefill only)");
    const int64_t left = cfg->cmp_sink_start < n ? cfg->cmp_sink_start : n;
    const int64_t right = cfg->cmp_sink_end < n - left ? cfg->cmp_sink_end : n - left, m = n - left - right;
    if (m < 2)
        return kvc_fail(KVC_ERR_ARG, "CompactorPress needs at least 2 rows between its %lld + %lld sinks, got %lld tokens",
                        (long long)left, (long long)right, (long long)n);
    float *lev[KVC_MAX_KV_HEADS] = {0}, *block = malloc(sizeof(float) * (size_t)Hkv * (size_t)n);
    if (!block) return kvc_fail(KVC_ERR_NOMEM, "out of memory: Compactor");
    for (int32_t h = 0; h < Hkv; h++) lev[h] = block + (size_t)h * n;
    kvc_status st = kvc_leverage_range(lr, ctx, cfg, len, left, m, lev);
    if (st == KVC_OK) st = kvc_noncausal_range(lr, ctx, cfg, len, left, m, scores);
    float mx = -INFINITY;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        for (int64_t r = left; r < left + m; r++) {
            scores[h][r] = cfg->cmp_blend * lev[h][r] + scores[h][r];
            mx = scores[h][r] > mx ? scores[h][r] : mx;
        }
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) { /* the sinks: the layer's maximum (kvpress pads with it) */
        for (int64_t r = 0; r < left; r++) scores[h][r] = mx;
        for (int64_t r = left + m; r < n; r++) scores[h][r] = mx;
    }
    free(block);
    return st;
}

static kvc_status compactor_check(const kvc_press_config *c) {
    if (c->cmp_sink_start < 0 || c->cmp_sink_end < 0)
        return kvc_fail(KVC_ERR_ARG, "sink_size_start and sink_size_end must be >= 0, got %d and %d", c->cmp_sink_start, c->cmp_sink_end);
    if (!isfinite(c->cmp_blend)) return kvc_fail(KVC_ERR_ARG, "blending must be finite, got %g", c->cmp_blend);
    if (c->sketch_dim < 1) return kvc_fail(KVC_ERR_ARG, "sketch_dimension must be a positive integer, got %d", c->sketch_dim);
    if (c->attn_chunk < 1) return kvc_fail(KVC_ERR_ARG, "chunk_size must be a positive integer, got %d", c->attn_chunk);
    return KVC_OK;
}

static const char *const params[] = {"cmp_sink_start", "cmp_sink_end", "cmp_blend", "sketch_dim", "attn_chunk", "seed", NULL};

static const kvc_scorer_i compactor_scorer = {
    .name = "compactor",
    .title = "Compactor",
    .code = KVC_SCORE_COMPACTOR,
    .traits = KVC_SCORER_HOST | KVC_SCORER_READS_V,
    .params = params,
    .check = compactor_check,
    .host = compactor_scores,
    .select = NULL,
    .doc = "blend x LeverageScore + NonCausalAttn between sinks kept at the maximum (kvpress Compactor)",
};
KVC_REGISTER_SCORER(compactor_scorer);
