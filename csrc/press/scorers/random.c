/* RandomPress: seeded uniform scores (core/rng.h kvc_random_score). The backend scores it. */

#include "common.h"

static const char *const params[] = {"seed", NULL};

static const kvc_scorer_i random_scorer = {
    .name = "random",
    .title = "Random",
    .code = KVC_SCORE_RANDOM,
    .traits = KVC_SCORER_CHUNKABLE | KVC_SCORER_BLOCKABLE,
    .params = params,
    .check = NULL,
    .host = NULL,
    .select = NULL,
    .doc = "seeded uniform (kvpress RandomPress)",
};
KVC_REGISTER_SCORER(random_scorer);
