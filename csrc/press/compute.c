/* The press as a pure function on arrays (kvc_press_compute*): one layer's K/V written to a K/V store of
 * the chosen backend, its queries uploaded, then the same scoring and selection as the schedule. */
#include <stdlib.h>
#include <string.h>

#include "press.h"

kvc_status kvc_device_press_compute(int32_t device, const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d,
                                    int32_t layer, int32_t n_layers, const float *q, const float *attn, int64_t n,
                                    const float *k, const float *v, int64_t len, int64_t layer_total, float *scores,
                                    int64_t *keep, int64_t *n_keep) {
    if (!cfg || !q || !k || !v || !scores || !keep || !n_keep) return kvc_fail(KVC_ERR_ARG, "press_compute: null argument");
    KVC_TRY(kvc_press_config_check(cfg));
    if (H <= 0 || Hkv <= 0 || H % Hkv || d <= 0 || d % 2 || d > 256 || Hkv > KVC_MAX_KV_HEADS)
        return kvc_fail(KVC_ERR_ARG, "press_compute: bad head shape H=%d Hkv=%d d=%d", H, Hkv, d);
    if (n < 1 || len < n) return kvc_fail(KVC_ERR_ARG, "press_compute: need 1 <= n (%lld) <= len (%lld)", (long long)n, (long long)len);
    if (layer < 0 || layer >= n_layers) return kvc_fail(KVC_ERR_ARG, "press_compute: layer %d not in [0, %d)", layer, n_layers);
    const int32_t w = kvc_press_window(cfg);
    if (w > 0 && n <= w)
        return kvc_fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%d)", (long long)n, w);
    if (kvc_scorer_has(cfg->scorer, KVC_SCORER_READS_ATTN) && !attn)
        return kvc_fail(KVC_ERR_ARG, "%s needs the attention outputs of the window queries", kvc_scorer_title(cfg->scorer));
    const kvc_backend *be;
    KVC_TRY(kvc_backend_get(device, &be));
    kvc_config mc;
    kvc_config_defaults(&mc);
    mc.n_heads = H;
    mc.n_kv_heads = Hkv;
    mc.head_dim = d;
    mc.n_layers = n_layers;
    mc.hidden = H * d;
    if (be->check_model) KVC_TRY(be->check_model(&mc));

    kvc_backend_lock(be);
    int64_t lens[KVC_MAX_KV_HEADS], past[KVC_MAX_KV_HEADS], zero[KVC_MAX_KV_HEADS] = {0};
    float *sp[KVC_MAX_KV_HEADS];
    int64_t *kp[KVC_MAX_KV_HEADS];
    for (int32_t h = 0; h < Hkv; h++) {
        lens[h] = len;
        past[h] = len - n;
        sp[h] = scores + (size_t)h * len;
        kp[h] = keep + (size_t)h * len;
    }
    kvc_kv *kv = NULL;
    kvc_buf *qb = NULL, *ab = NULL, *sb = NULL;
    int64_t ld = 0;
    const int64_t qd = (int64_t)H * d;
    kvc_status st = be->kv_new(Hkv, d, NULL, &kv);
    if (st == KVC_OK) st = be->kv_resize(kv, lens, zero, NULL);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        st = be->kv_write(kv, h, 0, len, k + (size_t)h * len * d, v + (size_t)h * len * d);
    if (st == KVC_OK) st = be->kv_set_lens(kv, lens);
    if (st == KVC_OK) st = be->alloc(be->act_dtype, n * qd, KVC_MEM_ACT, "press queries", &qb);
    if (st == KVC_OK) st = be->upload(kvc_view_of(qb, 0, qd), n, qd, q, KVC_F32);
    if (st == KVC_OK && attn) st = be->alloc(be->act_dtype, n * qd, KVC_MEM_ACT, "press attention outputs", &ab);
    if (st == KVC_OK && attn) st = be->upload(kvc_view_of(ab, 0, qd), n, qd, attn, KVC_F32);
    if (st == KVC_OK) {
        const kvc_layer_ctx ctx = {layer, n, past, kvc_view_of(qb, 0, qd), kvc_view_of(ab, 0, qd), kvc_view_of(NULL, 0, 0),
                                   kvc_view_of(NULL, 0, 0), NULL, /* rows at positions past + i */
                                   kvc_view_of(NULL, 0, 0)};
        const kvc_layer_rows lr = {be, &mc, kv, NULL, kvc_view_of(NULL, 0, 0), NULL, NULL, 0}; /* no model: no W_o */
        st = kvc_press_score_select(&lr, &ctx, cfg, lens, layer_total, &sb, &ld, sp, kp, n_keep);
    }
    if (sb) be->free(sb);
    if (ab) be->free(ab);
    if (qb) be->free(qb);
    if (kv) be->kv_free(kv);
    kvc_backend_unlock(be);
    return st;
}
