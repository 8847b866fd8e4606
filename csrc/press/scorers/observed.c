/* ObservedAttention / H2O one-shot (docs/METHODS.md, "Baseline scorers"): each row's attention summed over the
 * call's queries that see it, divided by how many do. The algorithm is observed.c's (kvc_observed_scores): it
 * reads every query's whole attention row of the uncompressed layer, so the press must come first. */
#include "common.h"

static kvc_status observed_scores(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, float *const *scores) {
    return kvc_observed_scores(lr, ctx, len, scores);
}

static const char *const params[] = {NULL};

static const kvc_scorer_i observed_scorer = {
    .name = "observed",
    .title = "ObservedAttention",
    .code = KVC_SCORE_OBSERVED,
    .traits = KVC_SCORER_HOST | KVC_SCORER_FIRST_ONLY,
    .params = params,
    .check = NULL,
    .host = observed_scores,
    .select = NULL,
    .doc = "attention summed over the prompt's queries / the queries that see it (H2O one-shot, Zhang et al. 2023)",
};
KVC_REGISTER_SCORER(observed_scorer);
