/* LUKVPress (kvpress; LU-KV, arXiv 2602.08585): a budget curve gives each KV head of a layer the fraction of
 * its rows it prunes; the wrapped press's scorer ranks the rows. The counts follow kvpress's rounding in fp32
 * (floors, then the rounded total's rest to the largest fractions); the first `sink` and the last `window` rows
 * are raised to the layer's maximum + 1 before each head keeps its own top rows (the backend's top-k: higher
 * score first, then the lower row, as kvpress's stable descending argsort). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct {
    float *prune;         /* [L * Hkv] the fraction of rows each head prunes */
    int64_t sink, window; /* the first and last rows raised to the layer's maximum + 1 */
} lukv_state;

static kvc_status set_prune(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p;
    const float *prune = data;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(prune[i])) return kvc_fail(KVC_ERR_ARG, "head prune ratio %lld is not a finite number", (long long)i);
    lukv_state *u = state;
    float *copy = malloc(sizeof(float) * (size_t)n);
    if (!copy) return kvc_fail(KVC_ERR_NOMEM, "out of memory: head prune ratios");
    memcpy(copy, prune, sizeof(float) * (size_t)n);
    free(u->prune);
    u->prune = copy;
    return KVC_OK;
}

static kvc_status set_count(int64_t *slot, const char *name, const void *data) {
    const int64_t v = *(const int64_t *)data;
    if (v < 0) return kvc_fail(KVC_ERR_ARG, "%s must be >= 0, got %lld", name, (long long)v);
    *slot = v;
    return KVC_OK;
}

static kvc_status set_sink(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    return set_count(&((lukv_state *)state)->sink, "sink", data);
}

static kvc_status set_window(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    return set_count(&((lukv_state *)state)->window, "window", data);
}

static void release(void *state) { free(((lukv_state *)state)->prune); }

static kvc_status admit(const kvc_press *p) {
    if (p->cfg.drop_window) return kvc_fail(KVC_ERR_ARG, "LU-KV's head counts are an allocation of their own: wrap a plain scorer press");
    return KVC_OK;
}

void kvc_lukv_counts(const float *prune, int32_t Hkv, int64_t n, int64_t *out) {
    float frac[KVC_MAX_KV_HEADS], sum = 0.0f;
    int given[KVC_MAX_KV_HEADS] = {0};
    int64_t base = 0;
    for (int32_t h = 0; h < Hkv; h++) {
        float rate = 1.0f - prune[h];
        rate = rate < 0.0f ? 0.0f : rate > 1.0f ? 1.0f : rate;
        const float ideal = rate * (float)n;
        sum += ideal;
        out[h] = (int64_t)floorf(ideal);
        frac[h] = ideal - floorf(ideal);
        base += out[h];
    }
    int64_t total = (int64_t)nearbyintf(sum); /* torch.round: halves to even */
    total = total > (int64_t)Hkv * n ? (int64_t)Hkv * n : total;
    total = total < Hkv ? Hkv : total;
    /* the rest of the total, one row each, to the largest fractional parts (ties: the lower head) */
    for (int64_t r = total - base; r > 0; r--) {
        int32_t best = -1;
        for (int32_t h = 0; h < Hkv; h++)
            if (!given[h] && (best < 0 || frac[h] > frac[best])) best = h;
        if (best < 0) break; /* every head has one: kvpress's top-k takes at most Hkv */
        given[best] = 1;
        out[best]++;
    }
    for (int32_t h = 0; h < Hkv; h++) out[h] = out[h] < 1 ? 1 : out[h] > n ? n : out[h];
}

static kvc_status lukv_select(kvc_press *p, void *state, const kvc_press_config *cfg, kvc_session *s,
                              const kvc_layer_ctx *ctx, const int64_t *len, float *const *scores, int64_t *const *keep,
                              int64_t *n_keep) {
    const lukv_state *u = state;
    if (!u->prune) return kvc_fail(KVC_ERR_ARG, "LU-KV: set head_prune before the prefill");
    const kvc_backend *be = kvc_door_backend(s);
    const int32_t Hkv = p->n_kv;
    const int64_t n = len[0];
    for (int32_t h = 1; h < Hkv; h++)
        if (len[h] != n) return kvc_fail(KVC_ERR_ARG, "LU-KV needs every head of a layer to hold the same rows");
    const kvc_layer_rows lr = kvc_press_layer_rows_of(p, s, ctx->layer);
    KVC_TRY(kvc_score_layer(&lr, ctx, cfg, kvc_press_window(cfg), len, &p->dev_scores, &p->dev_ld, scores));
    float mx = -INFINITY;
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t r = 0; r < n; r++) mx = scores[h][r] > mx ? scores[h][r] : mx;
    const float top = (float)((double)mx + 1.0); /* kvpress: scores.max().item() + 1, stored as fp32 */
    const int64_t sink = u->sink < n ? u->sink : n, w0 = n - u->window > 0 ? n - u->window : 0;
    for (int32_t h = 0; h < Hkv; h++) {
        for (int64_t r = 0; r < sink; r++) scores[h][r] = top;
        for (int64_t r = w0; r < n; r++) scores[h][r] = top;
        KVC_TRY(be->upload(kvc_view_of(p->dev_scores, (int64_t)h * p->dev_ld, p->dev_ld), 1, n, scores[h], KVC_F32));
    }
    kvc_lukv_counts(u->prune + (size_t)ctx->layer * Hkv, Hkv, n, n_keep);
    return be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), Hkv, len, n_keep, keep);
}

static const kvc_part_array_i arrays[] = {
    {"head_prune", KVC_ARRAY_F32, KVC_COUNT_KV_HEADS, set_prune, "the fraction of its rows each KV head prunes"},
    {"lukv_sink", KVC_ARRAY_I64, KVC_COUNT_ONE, set_sink, "first rows every head keeps (0)"},
    {"lukv_window", KVC_ARRAY_I64, KVC_COUNT_ONE, set_window, "last rows every head keeps (0)"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i lukv_part = {
    .name = "lukv", .title = "LUKVPress", .traits = KVC_PART_SELECTS | KVC_PART_PLAIN | KVC_PART_NEEDS_NO_BUDGET,
    .order = 10, .state_size = sizeof(lukv_state), .arrays = arrays, .admit = admit, .release = release,
    .select = lukv_select, .doc = "each KV head's share of a layer from LU-KV's budget curve; the scorer ranks the rows"};
KVC_REGISTER_PART(lukv_part);
