/* BlockPress (kvpress; the KeyDiff paper's block-wise prompt processing): the press's part that selects block by
 * block (array "block_size"). */
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct {
    int64_t block_size;
} block_state;

static kvc_status set_block_size(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    const int64_t b = *(const int64_t *)data;
    if (b < 1) return kvc_fail(KVC_ERR_ARG, "block_size must be >= 1, got %lld", (long long)b);
    ((block_state *)state)->block_size = b;
    return KVC_OK;
}

static kvc_status admit(const kvc_press *p) {
    char which[256];
    if (!kvc_scorer_has(p->cfg.scorer, KVC_SCORER_BLOCKABLE))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "BlockPress scores each block from its keys alone: wrap a scorer that reads no "
                        "queries (%s)", kvc_scorer_titles(KVC_SCORER_BLOCKABLE, which, sizeof which));
    return KVC_OK;
}

/* BlockPress (kvpress; the KeyDiff paper's block-wise prompt processing, simulated after the forward as
 * kvpress does): each head starts with its first n_kept rows; block after block, the kept rows and the
 * next block_size rows are copied into a scratch K/V store, scored there (a scorer that sees only those
 * rows), and the top n_kept become the kept rows. */
static kvc_status block_select(kvc_press *p, void *state, const kvc_press_config *cfg, kvc_session *s,
                               const kvc_layer_ctx *ctx, const int64_t *len, float *const *scores, int64_t *const *keep,
                               int64_t *n_keep) {
    const int64_t block_size = ((const block_state *)state)->block_size;
    const kvc_backend *be = kvc_door_backend(s);
    const int32_t Hkv = p->n_kv, d = kvc_door_model(s)->cfg.head_dim;
    const int64_t n = len[0];
    for (int32_t h = 1; h < Hkv; h++)
        if (len[h] != n) return kvc_fail(KVC_ERR_ARG, "BlockPress needs every head of a layer to hold the same rows");
    const int64_t nk = kvc_layer_budget(cfg, ctx->layer, p->n_layers, n);
    int64_t *cand[KVC_MAX_KV_HEADS] = {0}, full[KVC_MAX_KV_HEADS], kk[KVC_MAX_KV_HEADS], mm[KVC_MAX_KV_HEADS];
    kvc_kv *tmp = NULL;
    kvc_status st = be->kv_new(Hkv, d, NULL, &tmp);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        n_keep[h] = nk;
        kk[h] = nk;
        full[h] = n;
        for (int64_t i = 0; i < nk; i++) keep[h][i] = i;
        if (!(cand[h] = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: BlockPress");
    }
    const kvc_layer_rows lr = kvc_session_layer_rows(s, ctx->layer, tmp);
    for (int64_t i = nk; i < n && st == KVC_OK; i += block_size) {
        const int64_t end = i + block_size < n ? i + block_size : n;
        for (int32_t h = 0; h < Hkv; h++) {
            memcpy(cand[h], keep[h], sizeof(int64_t) * (size_t)nk); /* kept rows are all < i: the list stays sorted */
            for (int64_t r = i; r < end; r++) cand[h][nk + r - i] = r;
            mm[h] = nk + end - i;
        }
        st = be->kv_resize(tmp, full, full, kvc_door_cache(s)->layers[ctx->layer].kv);
        if (st == KVC_OK) st = be->kv_gather(tmp, (const int64_t *const *)cand, mm, mm);
        if (st == KVC_OK) st = kvc_score_layer(&lr, ctx, cfg, 0, mm, &p->dev_scores, &p->dev_ld, scores);
        if (st == KVC_OK) st = be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), Hkv, mm, kk, keep);
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            for (int64_t j = 0; j < nk; j++) keep[h][j] = cand[h][keep[h][j]];
    }
    if (tmp) be->kv_free(tmp);
    for (int32_t h = 0; h < Hkv; h++) free(cand[h]);
    return st;
}


static const kvc_part_array_i arrays[] = {
    {"block_size", KVC_ARRAY_I64, KVC_COUNT_ONE, set_block_size, "rows scored at a time beside the kept ones (>= 1)"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i block_part = {
    .name = "block", .title = "BlockPress", .traits = KVC_PART_SELECTS | KVC_PART_PLAIN, .order = 10,
    .state_size = sizeof(block_state), .arrays = arrays, .admit = admit, .select = block_select,
    .doc = "selects block by block: the kept rows and the next block_size rows scored alone, the top n_kept kept"};
KVC_REGISTER_PART(block_part);
