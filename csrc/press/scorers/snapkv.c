/* SnapKV (Li et al., 2024): the window queries' attention, pooled over kernel rows, reduced over the GQA
 * group; the window protected. The backend scores it. */

#include "common.h"

static const char *const params[] = {"window", "kernel", "pool_max", "gqa_max", "pool_then_reduce", NULL};

static const kvc_scorer_i snapkv_scorer = {
    .name = "snapkv",
    .title = "SnapKV",
    .code = KVC_SCORE_SNAPKV,
    .traits = KVC_SCORER_WINDOW | KVC_SCORER_CHUNKABLE,
    .params = params,
    .check = NULL,
    .host = NULL,
    .select = NULL,
    .doc = "window queries' attention, pooled, GQA-reduced (SnapKV, Li et al. 2024)",
};
KVC_REGISTER_SCORER(snapkv_scorer);
