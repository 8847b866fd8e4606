/* KVgrad (https://openreview.net/forum?id=cg1wTCJjjk; docs/METHODS.md "KVgrad"): KVzip's reconstruction
 * (kvzip.c) with input x gradient attribution.
 *
 * The reconstruction prompt of a chunk runs on the host (train/rows_grad.c) over the session's cache, full or
 * compressed (each head's rows at their positions, as KVzip's chunks), read-only: Phi = sum over its rows of ||h^L||^2 (the last layer's output, before the final norm), and the
 * backward gives, at every layer l, the gradient of Phi with respect to the residual right after the
 * attention, a^l (the attention output's gradient). Score of chunk row c at (l, KV head h):
 *   max over the rows p and the query heads hq of h's group of A[p, c] ||v_c W_o[:, hq]||_2 ||dPhi/da_p^l||_2,
 * A KVzip's restricted softmax. The eviction is KVzip's (kvc_kvzip_evict). */
#include <math.h>
#include <string.h>

#include "../train/rows_grad.h"
#include "press.h"

typedef struct kvgrad_state {
    kvc_session *s;    /* its cache's positions give each head's chunk rows */
    const kvc_config *c;
    const kvc_host_weights *M;
    int64_t start, end;
    int32_t n_sink;
    float *scores;     /* [L, Hkv, end - start] */
    float *grad_norms; /* [L, m] or NULL */
    float *wt;         /* [H d, D] a layer's W_o^T */
    double *gnorm;     /* [m] */
    double *wov;       /* [H, end - start] */
} kvgrad_state;

/* Phi = sum ||x||^2 over the rows; dPhi/dx = 2 x */
static double phi_output(void *user, const float *x, int64_t m, int64_t D, float *dx) {
    (void)user;
    double s = 0.0;
    for (int64_t i = 0; i < m * D; i++) {
        s += (double)x[i] * x[i];
        if (dx) dx[i] = 2.0f * x[i];
    }
    return s;
}

/* Layer l of the backward: the chunk rows' scores from the residual gradient dxm. */
static kvc_status kvgrad_layer(void *user, const kvc_rows_layer *view, const float *dxm) {
    kvgrad_state *t = user;
    const kvc_config *c = t->c;
    const int32_t l = view->layer, Hkv = c->n_kv_heads;
    const int64_t m = view->m, D = c->hidden, qd = (int64_t)c->n_heads * c->head_dim, n = t->end - t->start;
    for (int64_t p = 0; p < m; p++) {
        double s = 0.0;
        for (int64_t j = 0; j < D; j++) s += (double)dxm[p * D + j] * dxm[p * D + j];
        t->gnorm[p] = sqrt(s);
        if (t->grad_norms) t->grad_norms[(size_t)l * m + p] = (float)t->gnorm[p];
    }
    const float *wo = t->M->layers[l].wo; /* [D, H d] */
    for (int64_t i = 0; i < qd; i++)
        for (int64_t j = 0; j < D; j++) t->wt[i * D + j] = wo[j * qd + i];
    const kvc_layer_cache *L = &kvc_door_cache(t->s)->layers[l];
    kvc_kvzip_cols cols[KVC_MAX_KV_HEADS] = {{0}};
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        st = kvc_kvzip_cols_of(L->pos[h], view->held[h], t->start, t->end, t->n_sink, &cols[h]);
    if (st == KVC_OK) st = kvc_kvzip_wov_norms(c, t->wt, view->v, cols, n, t->wov);
    if (st == KVC_OK) st = kvc_kvzip_chunk_max(c, view->q, m, view->k, cols, n, t->gnorm, t->wov, t->scores + (size_t)l * Hkv * n);
    kvc_kvzip_cols_free(cols, Hkv);
    return st;
}

static kvc_status check_args(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                             int32_t n_sink, const float *scores) {
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int64_t n_ctx = kvc_door_position(s);
    if (!ids || !scores) return kvc_fail(KVC_ERR_ARG, "kvgrad_score: null argument");
    if (kvc_door_needs_reset(s)) return kvc_fail(KVC_ERR_ARG, "kvgrad_score: the session failed a call: reset() it first");
    if (n_ctx < 1) return kvc_fail(KVC_ERR_ARG, "kvgrad_score: the session must hold the cache of the context (prefill it first)");
    if (q_len < 1 || q_len > (1LL << 24))
        return kvc_fail(KVC_ERR_ARG, "kvgrad_score: the reconstruction prompt needs 1 to %lld tokens, got %lld", 1LL << 24,
                        (long long)q_len);
    if (start < 0 || end <= start || end > n_ctx)
        return kvc_fail(KVC_ERR_ARG, "kvgrad_score: chunk [%lld, %lld) outside the %lld context positions", (long long)start,
                        (long long)end, (long long)n_ctx);
    if (n_sink < 0) return kvc_fail(KVC_ERR_ARG, "n_sink must be >= 0, got %d", n_sink);
    for (int64_t i = 0; i < q_len; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab) return kvc_fail(KVC_ERR_ARG, "token %d outside the vocabulary", ids[i]);
    return kvc_rows_check_model(c, n_ctx + q_len - 1, "KVgrad");
}

kvc_status kvc_kvgrad_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                            int32_t n_sink, float *scores, float *grad_norms) {
    KVC_TRY(check_args(s, ids, q_len, start, end, n_sink, scores));
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int64_t n_ctx = kvc_door_position(s), D = c->hidden, qd = (int64_t)c->n_heads * c->head_dim, n = end - start;
    const kvc_host_weights *hw = NULL;
    KVC_TRY(kvc_door_host_weights(s, &hw));
    int64_t P = 0; /* the most rows a head holds: the prefix's room */
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t h = 0; h < c->n_kv_heads; h++) P = kvc_door_cache(s)->layers[l].len[h] > P ? kvc_door_cache(s)->layers[l].len[h] : P;
    kvgrad_state t = {s, c, hw, start, end, n_sink, scores, grad_norms, kvc_malloc(sizeof(float) * (size_t)(qd * D), "KVgrad W_o"),
                      kvc_malloc(sizeof(double) * (size_t)q_len, "KVgrad gradient norms"),
                      kvc_malloc(sizeof(double) * (size_t)(c->n_heads * n), "KVgrad |v W_o|")};
    float *x0 = kvc_malloc(sizeof(float) * (size_t)(q_len * D), "KVgrad embeddings");
    int64_t *pos = kvc_malloc(sizeof(int64_t) * (size_t)q_len, "KVgrad positions");
    kvc_session_prefix sp = {0};
    kvc_rows *r = NULL;
    kvc_status st = t.wt && t.gnorm && t.wov && x0 && pos ? KVC_OK : KVC_ERR_NOMEM;
    for (int64_t i = 0; st == KVC_OK && i < q_len; i++) {
        memcpy(x0 + i * D, hw->tok_embd + (int64_t)ids[i] * D, sizeof(float) * (size_t)D);
        pos[i] = n_ctx + i;
    }
    if (st == KVC_OK) st = kvc_session_prefix_init(&sp, s, P, q_len);
    if (st == KVC_OK) st = kvc_rows_new(c, hw, P, q_len, 1, &r);
    const kvc_rows_objective obj = {&t, 1, NULL, phi_output, NULL, kvgrad_layer};
    if (st == KVC_OK) st = kvc_rows_forward(r, &sp.pre, &obj, NULL, x0, pos, NULL);
    if (st == KVC_OK) st = kvc_rows_backward(r, &sp.pre, &obj, NULL);
    kvc_rows_free(r);
    kvc_session_prefix_free(&sp);
    kvc_free(x0);
    kvc_free(pos);
    kvc_free(t.wt);
    kvc_free(t.gnorm);
    kvc_free(t.wov);
    return st;
}

kvc_status kvc_session_kvgrad_score(kvc_session *s, const int32_t *ids, int64_t q_len, int64_t start, int64_t end,
                                    int32_t n_sink, float *scores, int64_t n_scores, float *grad_norms,
                                    int64_t n_grad_norms) {
    if (!s) return kvc_fail(KVC_ERR_ARG, "kvgrad_score: null session");
    const kvc_config *c = &kvc_door_model(s)->cfg;
    if (end > start)
        KVC_TRY(kvc_check_size("kvgrad_score: scores [L, Hkv, end - start]", n_scores,
                               (int64_t)c->n_layers * c->n_kv_heads * (end - start)));
    if (grad_norms) KVC_TRY(kvc_check_size("kvgrad_score: grad_norms [L, q_len]", n_grad_norms, (int64_t)c->n_layers * q_len));
    return kvc_kvgrad_score(s, ids, q_len, start, end, n_sink, scores, grad_norms);
}
