/* TOVA (Oren et al., 2024): the last query's attention, mean over every head of the layer, the same for
 * every KV head (so every head must hold the same rows). The backend scores it with window 1, kernel 1. */

#include "common.h"

static const char *const params[] = {NULL};

static const kvc_scorer_i tova_scorer = {
    .name = "tova",
    .title = "TOVA",
    .code = KVC_SCORE_TOVA,
    .traits = KVC_SCORER_CHUNKABLE | KVC_SCORER_SAME_LEN | KVC_SCORER_LAST_QUERY,
    .params = params,
    .check = NULL,
    .host = NULL,
    .select = NULL,
    .doc = "the last query's attention, mean over all heads (TOVA, Oren et al. 2024)",
};
KVC_REGISTER_SCORER(tova_scorer);
