/* RestoreKV (arXiv 2608.01247; docs/METHODS.md "RestoreKV"): rows given as input embeddings, appended to a
 * session's cache by one forward with LoRA adapters active (kvc_session_append_embeddings).
 *
 * The rows run on the host in fp32 (train/rows_grad.c) over the session's full cache at the positions after
 * it, the adapters added to their projections for this pass only (the model's weights are never touched);
 * each layer's own K/V then go into the session's cache through the backend (kv_write), so the rows land on
 * any device, rounded as it stores them. RestoreKVPress (kvpress_c/presses/restorekv.py) appends its restore
 * rows so after KVzip has scored the context and before KVzip's eviction of the context rows. */
#include <math.h>
#include <string.h>

#include "../train/rows_grad.h"
#include "press.h"

static kvc_status check_args(kvc_session *s, const float *emb, int64_t n, const kvc_lora *lora) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int64_t P = kvc_door_position(s);
    if (!emb) return kvc_fail(KVC_ERR_ARG, "append_embeddings: emb is NULL");
    if (n < 1 || n > (1LL << 20))
        return kvc_fail(KVC_ERR_ARG, "append_embeddings: need 1 to %lld rows, got %lld", 1LL << 20, (long long)n);
    if (kvc_door_needs_reset(s)) return kvc_fail(KVC_ERR_ARG, "append_embeddings: the session failed a call: reset() it first");
    for (int64_t i = 0; i < n * c->hidden; i++)
        if (!isfinite(emb[i]))
            return kvc_fail(KVC_ERR_ARG, "append_embeddings: the value at row %lld, column %lld is not finite",
                            (long long)(i / c->hidden), (long long)(i % c->hidden));
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t h = 0; h < c->n_kv_heads; h++)
            if (kvc_door_cache(s)->layers[l].len[h] != P)
                return kvc_fail(KVC_ERR_ARG, "append_embeddings: every head must hold the session's %lld rows (layer %d "
                                "head %d holds %lld: append before any eviction)", (long long)P, l, h,
                                (long long)kvc_door_cache(s)->layers[l].len[h]);
    if (lora && lora->n_layers != c->n_layers)
        return kvc_fail(KVC_ERR_ARG, "append_embeddings: the LoRA adapters were made for %d layers, the model has %d",
                        lora->n_layers, c->n_layers);
    return kvc_rows_check_model(c, P + n - 1, "append_embeddings");
}

/* Every layer's own K/V of the pass appended; on failure the layers appended so far are cut back. */
static kvc_status append_rows(kvc_session *s, const kvc_rows *r, const int64_t *pos, int64_t n) {
    kvc_status st = KVC_OK;
    int32_t l = 0;
    kvc_backend_lock(kvc_door_backend(s));
    for (; l < kvc_door_model(s)->cfg.n_layers && st == KVC_OK; l++) {
        const float *k, *v;
        kvc_rows_own_kv(r, l, &k, &v);
        st = kvc_cache_append_host(kvc_door_cache(s), l, k, v, pos, n);
    }
    if (st != KVC_OK) kvc_cache_drop_from(kvc_door_cache(s), l - 1, pos[0]);
    kvc_backend_unlock(kvc_door_backend(s));
    return st;
}

kvc_status kvc_append_embeddings(kvc_session *s, const float *emb, int64_t n, const kvc_lora *lora) {
    KVC_TRY(check_args(s, emb, n, lora));
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int64_t P = kvc_door_position(s);
    const kvc_host_weights *hw = NULL;
    KVC_TRY(kvc_door_host_weights(s, &hw));
    int64_t *pos = kvc_malloc(sizeof(int64_t) * (size_t)n, "append_embeddings positions");
    kvc_session_prefix sp = {0};
    kvc_rows *r = NULL;
    kvc_status st = pos ? KVC_OK : KVC_ERR_NOMEM;
    for (int64_t i = 0; st == KVC_OK && i < n; i++) pos[i] = P + i;
    if (st == KVC_OK) st = kvc_session_prefix_init(&sp, s, P, n);
    if (st == KVC_OK) st = kvc_rows_new(c, hw, P, n, 0, &r);
    if (st == KVC_OK) st = kvc_rows_forward(r, &sp.pre, NULL, lora, emb, pos, NULL);
    if (st == KVC_OK) st = append_rows(s, r, pos, n);
    if (st == KVC_OK) kvc_door_set_position(s, P + n); /* the rows appended above */
    kvc_rows_free(r);
    kvc_session_prefix_free(&sp);
    kvc_free(pos);
    return st;
}

kvc_status kvc_session_append_embeddings(kvc_session *s, const float *emb, int64_t n, const kvc_lora *lora) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "append_embeddings: null session");
    return kvc_append_embeddings(s, emb, n, lora);
}
