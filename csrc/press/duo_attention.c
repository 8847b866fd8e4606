/* DuoAttentionPress (kvpress; Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with
 * Retrieval and Streaming Heads"): the press's part that gives each head its own row count (array
 * "head_budgets", [L, Hkv]; -1 keeps a head whole); the press's scorer ranks the rows, each head keeps its
 * top k on the backend. */
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct {
    int64_t *keep; /* [L * Hkv] */
} duo_state;

static kvc_status set_budgets(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p;
    duo_state *d = state;
    int64_t *k = malloc(sizeof(int64_t) * (size_t)n);
    if (!k) return kvc_fail(KVC_ERR_NOMEM, "out of memory: head budgets");
    memcpy(k, data, sizeof(int64_t) * (size_t)n);
    free(d->keep);
    d->keep = k;
    return KVC_OK;
}

static void release(void *state) { free(((duo_state *)state)->keep); }

static kvc_status head_budget_select(kvc_press *p, void *state, const kvc_press_config *cfg, kvc_session *s,
                                     const kvc_layer_ctx *ctx, const int64_t *len, float *const *scores,
                                     int64_t *const *keep, int64_t *n_keep) {
    const int64_t *given = ((const duo_state *)state)->keep + (size_t)ctx->layer * p->n_kv;
    const kvc_layer_rows lr = kvc_press_layer_rows_of(p, s, ctx->layer);
    KVC_TRY(kvc_score_layer(&lr, ctx, cfg, kvc_press_window(cfg), len, &p->dev_scores, &p->dev_ld, scores));
    for (int32_t h = 0; h < p->n_kv; h++) n_keep[h] = given[h] < 0 || given[h] > len[h] ? len[h] : given[h];
    return kvc_door_backend(s)->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), p->n_kv, len, n_keep, keep);
}

static const kvc_part_array_i arrays[] = {
    {"head_budgets", KVC_ARRAY_I64, KVC_COUNT_KV_HEADS, set_budgets,
     "rows each KV head keeps, replacing the press's budget (-1: all)"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i duo_part = {
    .name = "head_budgets", .title = "DuoAttentionPress",
    .traits = KVC_PART_SELECTS | KVC_PART_PLAIN | KVC_PART_NEEDS_NO_BUDGET, .order = 10,
    .state_size = sizeof(duo_state), .arrays = arrays, .release = release, .select = head_budget_select,
    .doc = "given rows per head (retrieval heads whole, streaming heads sink + recent); the scorer picks which"};
KVC_REGISTER_PART(duo_part);
