/* The producer of ExpectedAttentionStats: the pre-RoPE query moments of a prompt, per layer and query head, by a
 * layer hook on a forward of the prompt (the same un-rotation as ExpectedAttention's own statistics,
 * kvc_query_moments in scorers/common.c). kvpress collects them with HF transformers over a corpus; Python sums
 * the moments over the texts and writes the mean and covariance in kvpress's folder format. The consumer's setter
 * (kvc_session_set_query_stats: given statistics for the attached press) is here too. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct moments_state {
    int32_t n_sink;
    double *sum, *outer; /* [L, H, d], [L, H, d, d] */
} moments_state;

static kvc_status moments_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    const moments_state *m = user;
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const size_t hd = (size_t)c->n_heads * c->head_dim;
    const kvc_layer_rows lr = kvc_session_layer_rows(s, ctx->layer, NULL);
    return kvc_query_moments(&lr, ctx, m->n_sink, m->sum + (size_t)ctx->layer * hd,
                             m->outer + (size_t)ctx->layer * hd * c->head_dim);
}

kvc_status kvc_session_query_moments(kvc_session *s, const int32_t *ids, int64_t n, int32_t n_sink, double *sum,
                                     int64_t n_sum, double *outer, int64_t n_outer) {
    if (!s || !ids || !sum || !outer) return kvc_fail(KVC_ERR_ARG, "query_moments: null argument");
    const kvc_config *mc = &kvc_door_model(s)->cfg;
    const int64_t lhd = (int64_t)mc->n_layers * mc->n_heads * mc->head_dim;
    KVC_TRY(kvc_check_size("query_moments: sum [L, H, d]", n_sum, lhd));
    KVC_TRY(kvc_check_size("query_moments: outer [L, H, d, d]", n_outer, lhd * mc->head_dim));
    if (n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0, got %d", n_sink);
    if (n < 2) return kvc_fail(KVC_ERR_ARG, "query_moments: the prompt needs at least 2 tokens, got %lld", (long long)n);
    if (kvc_door_position(s) != 0 || kvc_door_slot(s, &kvc_press_slot_vt)) /* a past or a press would change the queries */
        return kvc_fail(KVC_ERR_ARG, "query_moments: use an empty session with no press attached");
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t L = c->n_layers, d = c->head_dim;
    moments_state m = {n_sink, sum, outer};
    const kvc_status st = kvc_door_probe(s, ids, n, NULL, 0, moments_hook, &m, KVC_ROW_NONE, NULL, 0);
    kvc_session_reset(s);
    if (st != KVC_OK) return st;
    /* the hook summed the lower triangles: mirror them */
    for (size_t i = 0; i < (size_t)L * c->n_heads; i++) {
        double *o = outer + i * d * d;
        for (int32_t a = 0; a < d; a++)
            for (int32_t b = a + 1; b < d; b++) o[a * d + b] = o[b * d + a];
    }
    return KVC_OK;
}

kvc_status kvc_query_stats_set(int32_t L, int32_t H, int32_t d, const float *mean, const float *cov, int64_t n_mean,
                               int64_t n_cov, float **m_slot, float **c_slot) {
    const int64_t nm = (int64_t)L * H * d;
    if (n_mean != nm || n_cov != nm * d)
        return kvc_fail(KVC_ERR_ARG, "need a query mean [%d layers, %d heads, %d] and covariance [%d, %d, %d, %d], got %lld "
                        "and %lld values", L, H, d, L, H, d, d, (long long)n_mean, (long long)n_cov);
    for (int64_t i = 0; i < n_mean; i++)
        if (!isfinite(mean[i])) return kvc_fail(KVC_ERR_ARG, "the query mean must be finite (value %lld is not)", (long long)i);
    for (int64_t i = 0; i < n_cov; i++)
        if (!isfinite(cov[i])) return kvc_fail(KVC_ERR_ARG, "the query covariance must be finite (value %lld is not)", (long long)i);
    float *m = malloc(sizeof(float) * (size_t)n_mean), *c = malloc(sizeof(float) * (size_t)n_cov);
    if (!m || !c) {
        free(m);
        free(c);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: query statistics");
    }
    memcpy(m, mean, sizeof(float) * (size_t)n_mean);
    memcpy(c, cov, sizeof(float) * (size_t)n_cov);
    free(*m_slot);
    free(*c_slot);
    *m_slot = m;
    *c_slot = c;
    return KVC_OK;
}

/* ExpectedAttentionStatsPress's part: given query statistics (arrays "query_mean" [L, H, d] and "query_cov"
 * [L, H, d, d], pre-RoPE, this model's channel order) that the ExpectedAttention scorer reads instead of the
 * call's queries (kvc_press_layer_rows_of). */
typedef struct {
    float *mean, *cov;
} query_stats_state;

static kvc_status set_finite(float **slot, const char *what, const void *data, int64_t n) {
    const float *x = data;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return kvc_fail(KVC_ERR_ARG, "the query %s must be finite (value %lld is not)", what, (long long)i);
    float *copy = malloc(sizeof(float) * (size_t)n);
    if (!copy) return kvc_fail(KVC_ERR_NOMEM, "out of memory: query statistics");
    memcpy(copy, x, sizeof(float) * (size_t)n);
    free(*slot);
    *slot = copy;
    return KVC_OK;
}

static kvc_status set_mean(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p;
    return set_finite(&((query_stats_state *)state)->mean, "mean", data, n);
}

static kvc_status set_cov(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p;
    return set_finite(&((query_stats_state *)state)->cov, "covariance", data, n);
}

static void release(void *state) {
    query_stats_state *q = state;
    free(q->mean);
    free(q->cov);
}

static kvc_status admit(const kvc_press *p) {
    if (!kvc_scorer_has(p->cfg.scorer, KVC_SCORER_QUERY_STATS))
        return kvc_fail(KVC_ERR_ARG, "query statistics are ExpectedAttention's: attach an ExpectedAttention press first");
    return KVC_OK;
}

static const kvc_part_array_i arrays[] = {
    {"query_mean", KVC_ARRAY_F32, KVC_COUNT_Q_CHANNELS, set_mean, "the pre-RoPE query mean of each layer and head"},
    {"query_cov", KVC_ARRAY_F32, KVC_COUNT_Q_CHANNELS2, set_cov, "the pre-RoPE query covariance of each layer and head"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i query_stats_part = {
    .name = "query_stats", .title = "ExpectedAttentionStatsPress", .traits = 0, .order = 0,
    .state_size = sizeof(query_stats_state), .arrays = arrays, .admit = admit, .release = release,
    .doc = "given query statistics for ExpectedAttention in place of the call's queries"};
KVC_REGISTER_PART(query_stats_part);

kvc_layer_rows kvc_press_layer_rows_of(const kvc_press *p, kvc_session *s, int32_t l) {
    kvc_layer_rows lr = kvc_session_layer_rows(s, l, NULL);
    const query_stats_state *q = kvc_press_part(p, &query_stats_part);
    if (q && q->mean && q->cov) {
        const size_t hd = (size_t)lr.mc->n_heads * lr.mc->head_dim;
        lr.q_mean = q->mean + (size_t)l * hd;
        lr.q_cov = q->cov + (size_t)l * hd * lr.mc->head_dim;
    }
    return lr;
}
