/* EDIE (docs/METHODS.md "EDIE scoring"): an error-driven upper bound with mid-range weighting, from the
 * window queries' attention and attention outputs; the window protected. The backend scores it. */

#include "common.h"

static kvc_status edie_check(const kvc_press_config *c) {
    if (!(c->edie_alpha > 0 && c->edie_alpha < 100)) return kvc_fail(KVC_ERR_ARG, "EDIE alpha must be in (0, 100), got %g", c->edie_alpha);
    return KVC_OK;
}

static const char *const params[] = {"window", "kernel", "edie_alpha", NULL};

static const kvc_scorer_i edie_scorer = {
    .name = "edie",
    .title = "EDIE",
    .code = KVC_SCORE_EDIE,
    .traits = KVC_SCORER_WINDOW | KVC_SCORER_READS_ATTN | KVC_SCORER_READS_V,
    .params = params,
    .check = edie_check,
    .host = NULL,
    .select = NULL,
    .doc = "error-driven upper bound with mid-range weighting (EDIE)",
};
KVC_REGISTER_SCORER(edie_scorer);
