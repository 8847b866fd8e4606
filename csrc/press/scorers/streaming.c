/* StreamingLLM (Xiao et al., 2023): the first n_sink rows, then the most recent. The backend scores it. */

#include "common.h"

static const char *const params[] = {"n_sink", NULL};

static const kvc_scorer_i streaming_scorer = {
    .name = "streaming",
    .title = "StreamingLLM",
    .code = KVC_SCORE_STREAMING,
    .traits = KVC_SCORER_CHUNKABLE | KVC_SCORER_BLOCKABLE | KVC_SCORER_SINK_ROWS,
    .params = params,
    .check = NULL,
    .host = NULL,
    .select = NULL,
    .doc = "first n_sink rows + the most recent (StreamingLLM, Xiao et al. 2023)",
};
KVC_REGISTER_SCORER(streaming_scorer);
