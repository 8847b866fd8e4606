/* Knorm (Devoto et al., 2024): -||k||, low-norm keys kept. The backend scores it. */

#include "common.h"

static const char *const params[] = {NULL};

static const kvc_scorer_i knorm_scorer = {
    .name = "knorm",
    .title = "Knorm",
    .code = KVC_SCORE_KNORM,
    .traits = KVC_SCORER_CHUNKABLE | KVC_SCORER_BLOCKABLE,
    .params = params,
    .check = NULL,
    .host = NULL,
    .select = NULL,
    .doc = "-||k|| (Knorm, Devoto et al. 2024)",
};
KVC_REGISTER_SCORER(knorm_scorer);
