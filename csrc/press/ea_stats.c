/* The producer of ExpectedAttentionStats: the pre-RoPE query moments of a prompt, per layer and query head, by a
 * layer hook on a forward of the prompt (the same un-rotation as ExpectedAttention's own statistics,
 * kvc_query_moments in scorers/common.c). kvpress collects them with HF transformers over a corpus; Python sums
 * the moments over the texts and writes the mean and covariance in kvpress's folder format. The consumer's setter
 * (kvc_session_set_query_stats: given statistics for the attached press) is here too. */
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
                                     double *outer) {
    if (!s || !ids || !sum || !outer) return kvc_fail(KVC_ERR_ARG, "query_moments: null argument");
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

kvc_status kvc_session_set_query_stats(kvc_session *s, const float *mean, const float *cov, int64_t n_mean, int64_t n_cov) {
    kvc_press *p = NULL;
    if (!mean || !cov) return kvc_fail(KVC_ERR_ARG, "null argument");
    KVC_TRY(kvc_last_press(s, &p));
    const kvc_config *mc = &kvc_door_model(s)->cfg;
    return kvc_press_set_query_stats(p, mean, cov, n_mean, n_cov, mc->n_heads, mc->head_dim);
}
