/* CriticalKV and CriticalAdaKV (docs/METHODS.md, "kvpress scorers"): a two-stage selection over any
 * scorer's scores. Stage one keeps each head's top first_stage_ratio share of its budget by the scores
 * alone; stage two ranks the rest by (score + eps) * |W_o v|, the L1 norm of each row's value through the
 * output projection of each query head of the group, averaged over the group. With Ada-KV the head
 * budgets are Ada-KV's, chosen on the plain scores first.
 *
 * W_o is reached through the backend's matmul only (the weights may be stored in any format): identity
 * rows times W_o give W_o^T [H d, D] in chunks, brought to the host as fp32; the per-head products
 * V_h W_o^T[head] run on the host. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "press.h"

#define EYE_ROWS 256

/* W_o^T [qd, D] on the host from the layer's o_proj weight, through be->matmul. */
kvc_status kvc_wo_transposed(const kvc_layer_rows *lr, float *wt) {
    const kvc_backend *be = lr->be;
    const int64_t qd = (int64_t)lr->mc->n_heads * lr->mc->head_dim, D = lr->mc->hidden;
    float *eye = calloc((size_t)EYE_ROWS * (size_t)qd, sizeof(float));
    kvc_buf *a = NULL, *c = NULL;
    kvc_status st = eye ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CriticalKV identity rows");
    if (st == KVC_OK) st = be->alloc(be->act_dtype, (int64_t)EYE_ROWS * qd, KVC_MEM_ACT, "CriticalKV identity rows", &a);
    if (st == KVC_OK) st = be->alloc(KVC_F32, (int64_t)EYE_ROWS * D, KVC_MEM_ACT, "CriticalKV W_o rows", &c);
    for (int64_t r0 = 0; r0 < qd && st == KVC_OK; r0 += EYE_ROWS) {
        const int64_t m = qd - r0 < EYE_ROWS ? qd - r0 : EYE_ROWS;
        memset(eye, 0, sizeof(float) * (size_t)EYE_ROWS * (size_t)qd);
        for (int64_t i = 0; i < m; i++) eye[i * qd + r0 + i] = 1.0f;
        st = be->upload(kvc_view_of(a, 0, qd), m, qd, eye, KVC_F32);
        if (st == KVC_OK) st = be->matmul(kvc_view_of(a, 0, qd), lr->wo, kvc_view_of(c, 0, D), m, D, qd, 0);
        if (st == KVC_OK) st = be->download(kvc_view_of(c, 0, D), m, D, wt + r0 * D, KVC_F32);
    }
    if (a) be->free(a);
    if (c) be->free(c);
    free(eye);
    return st;
}

/* norm[h][r] = mean over the query heads hq of h's group of || v_r W_o^T[hq d .. hq d + d) ||_1 */
static kvc_status wov_norms(const kvc_layer_rows *lr, const int64_t *len, double *const *norm) {
    const kvc_config *c = lr->mc;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t qd = (int64_t)H * d, D = c->hidden;
    if (!lr->wo.buf)
        return kvc_fail(KVC_ERR_ARG, "CriticalKV needs the model's output projection: run it in a session, not press_compute");
    float *wt = malloc(sizeof(float) * (size_t)qd * (size_t)D), *prod = malloc(sizeof(float) * EYE_ROWS * (size_t)D);
    float *k[KVC_MAX_KV_HEADS], *v[KVC_MAX_KV_HEADS], *block = NULL;
    kvc_status st = wt && prod ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: CriticalKV |W_o v|");
    if (st == KVC_OK) st = kvc_wo_transposed(lr, wt);
    if (st == KVC_OK) st = kvc_press_layer_rows(lr, len, 1, k, v, &block);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        memset(norm[h], 0, sizeof(double) * (size_t)len[h]);
        for (int32_t j = 0; j < g; j++) {
            const float *B = wt + (int64_t)(h * g + j) * d * D; /* [d, D] */
            for (int64_t r0 = 0; r0 < len[h]; r0 += EYE_ROWS) {
                const int64_t m = len[h] - r0 < EYE_ROWS ? len[h] - r0 : EYE_ROWS;
                kvc_host_gemm_nn(v[h] + r0 * d, d, B, D, prod, D, m, D, d, 0);
                for (int64_t r = 0; r < m; r++) {
                    double s = 0;
                    for (int64_t i = 0; i < D; i++) s += fabs((double)prod[r * D + i]);
                    norm[h][r0 + r] += s / g;
                }
            }
        }
    }
    kvc_free(block);
    free(wt);
    free(prod);
    return st;
}

kvc_status kvc_critical_select(const kvc_layer_rows *lr, const kvc_press_config *cfg, int32_t layer, int32_t n_layers,
                               const int64_t *len, int32_t window, int64_t layer_total, float *const *scores,
                               int64_t *const *keep, int64_t *n_keep) {
    const int32_t Hkv = lr->mc->n_kv_heads;
    int64_t budget[KVC_MAX_KV_HEADS], first[KVC_MAX_KV_HEADS];
    if (cfg->allocation == KVC_ALLOC_ADAKV) {
        /* CriticalAdaKV: Ada-KV's head budgets on the plain scores (its kept rows are each head's top) */
        KVC_TRY(kvc_press_select(cfg, layer, n_layers, Hkv, len, (const float *const *)scores, window, layer_total, keep,
                                 n_keep));
        /* kvpress sets Ada-KV's safeguarded rows (each head's top n_safe) to the float maximum before both
         * stages, so they are always among stage one's rows */
        int64_t n = 0, n_safe = 0;
        for (int32_t h = 0; h < Hkv; h++) n = len[h] > n ? len[h] : n;
        if (cfg->safeguard == KVC_SAFEGUARD_PROTECT) {
            const int64_t n_kept = kvc_layer_budget(cfg, layer, n_layers, n);
            n_safe = (int64_t)((double)n_kept * cfg->alpha_safeguard);
            if (cfg->alpha_safeguard > 0 && n_kept > 0 && n_safe < 1) n_safe = 1;
        }
        for (int32_t h = 0; h < Hkv; h++) {
            budget[h] = n_keep[h];
            first[h] = (int64_t)((double)budget[h] * cfg->first_stage_ratio);
            if (first[h] < n_safe) first[h] = n_safe;
        }
    } else {
        for (int32_t h = 0; h < Hkv; h++) {
            const int64_t k = kvc_layer_budget(cfg, layer, n_layers, len[h]);
            budget[h] = k < len[h] ? k : len[h];
            /* kvpress: int((1 - ratio) * n * first_stage_ratio), at least 1 */
            const double share = cfg->budget > 0 ? (double)budget[h] : (1.0 - cfg->compression_ratio) * (double)len[h];
            first[h] = (int64_t)(share * cfg->first_stage_ratio);
            if (cfg->first_stage_ratio > 0 && first[h] < 1) first[h] = 1;
        }
    }
    double *norm[KVC_MAX_KV_HEADS] = {0};
    int64_t *top = NULL;
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(norm[h] = malloc(sizeof(double) * (size_t)(len[h] > 0 ? len[h] : 1))))
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: CriticalKV");
    if (st == KVC_OK && !(top = malloc(sizeof(int64_t) * (size_t)maxlen))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: CriticalKV");
    if (st == KVC_OK) st = wov_norms(lr, len, norm);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t f = first[h] < budget[h] ? first[h] : budget[h];
        st = kvc_host_topk_rows(scores[h], len[h], f, top); /* stage one, on the plain scores */
        for (int64_t r = 0; r < len[h] && st == KVC_OK; r++)
            scores[h][r] = (float)(((double)scores[h][r] + cfg->critical_eps) * norm[h][r]);
        for (int64_t i = 0; i < f && st == KVC_OK; i++) scores[h][top[i]] = FLT_MAX;
        if (st == KVC_OK) st = kvc_host_topk_rows(scores[h], len[h], budget[h], keep[h]);
        n_keep[h] = budget[h];
    }
    for (int32_t h = 0; h < Hkv; h++) free(norm[h]);
    free(top);
    return st;
}
