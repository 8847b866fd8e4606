/* A mixture-of-experts MLP (Qwen3-MoE, Mixtral), written once for every backend on its kernels (core/backend.h).
 * Per block of tokens, on the normed rows xn:
 *   logits = xn Wrouter^T; each token's experts and weights (moe_route: softmax, top k, renormalised where the
 *   model says); the experts come back to the host, which groups the (token, expert) pairs by expert (a counting
 *   sort: each expert's tokens in order) and uploads the grouping; the rows are gathered expert after expert
 *   (gather_rows); each expert that has tokens runs its SwiGLU MLP once on all of them (gate|up, silu(gate) * up,
 *   down: GEMMs of its own weights, in the file's type on the CPU, so only the chosen experts' weights are read),
 *   its outputs overwriting its gathered rows; then each token's outputs, weighted, are summed and added to the
 *   residual stream (moe_combine).
 * One token (a decode step) is the same with a block of one row. The routing is read on the host every layer, so a
 * session of an MoE model runs its decode steps eagerly (no graph: session.c). */
#include <string.h>

#include "session.h"

#define MOE_ROWS 512 /* tokens per block: the gathered rows (block x k x hidden) stay bounded */

static void release(kvc_session *s) {
    kvc_moe_act *a = &s->act.moe;
    kvc_buf **bufs[] = {&a->logits, &a->ids, &a->w, &a->map, &a->xs, &a->gu};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (*bufs[i]) s->be->free(*bufs[i]);
        *bufs[i] = NULL;
    }
    kvc_free(a->host);
    a->host = NULL;
    a->rows = 0;
}

void kvc_moe_release(kvc_session *s) { release(s); }

static kvc_status grow(kvc_session *s, kvc_buf **b, int32_t dtype, int64_t n, const char *what) {
    return s->be->alloc(dtype, n, KVC_MEM_ACT, what, b);
}

kvc_status kvc_moe_reserve(kvc_session *s, int64_t n) {
    const kvc_config *c = &s->model->cfg;
    kvc_moe_act *a = &s->act.moe;
    const int64_t rows = n < MOE_ROWS ? n : MOE_ROWS, E = c->n_experts, k = c->n_experts_used;
    if (E <= 0 || rows <= a->rows) return KVC_OK;
    release(s);
    const int32_t t = s->be->act_dtype;
    kvc_status st = grow(s, &a->logits, KVC_F32, rows * E, "activations (router logits)");
    if (st == KVC_OK) st = grow(s, &a->ids, KVC_I32, rows * k, "activations (experts of each token)");
    if (st == KVC_OK) st = grow(s, &a->w, KVC_F32, rows * k, "activations (expert weights)");
    if (st == KVC_OK) st = grow(s, &a->map, KVC_I32, 2 * rows * k, "activations (rows by expert)");
    if (st == KVC_OK) st = grow(s, &a->xs, t, rows * k * c->hidden, "activations (rows by expert)");
    if (st == KVC_OK) st = grow(s, &a->gu, t, rows * 2 * (int64_t)c->moe_ffn, "activations (an expert's gate|up)");
    if (st == KVC_OK && !(a->host = kvc_malloc(sizeof(int32_t) * (size_t)(3 * rows * k + 2 * E + 1), "expert grouping")))
        st = KVC_ERR_NOMEM;
    if (st != KVC_OK) {
        release(s);
        return st;
    }
    a->rows = rows;
    return KVC_OK;
}

/* The (token, expert) pairs of n tokens grouped by expert: rows [start[e], start[e + 1]) are expert e's, tokens in
 * order; tok[i] the token of row i, pos[r k + j] the row of token r's j-th expert. */
static kvc_status group(const int32_t *ids, int64_t n, int32_t k, int32_t E, int32_t *cnt, int32_t *start, int32_t *tok,
                        int32_t *pos) {
    memset(cnt, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < n * k; i++) {
        if (ids[i] < 0 || ids[i] >= E) return kvc_fail(KVC_ERR_INTERNAL, "routing chose expert %d of %d", ids[i], E);
        cnt[ids[i]]++;
    }
    start[0] = 0;
    for (int32_t e = 0; e < E; e++) start[e + 1] = start[e] + cnt[e];
    memset(cnt, 0, sizeof(int32_t) * (size_t)E); /* now rows filled per expert */
    for (int64_t r = 0; r < n; r++)
        for (int32_t j = 0; j < k; j++) {
            const int32_t e = ids[r * k + j], row = start[e] + cnt[e]++;
            tok[row] = (int32_t)r;
            pos[r * k + j] = row;
        }
    return KVC_OK;
}

kvc_status kvc_moe_mlp(kvc_session *s, int32_t l, int64_t rows) {
    const kvc_config *c = &s->model->cfg;
    const kvc_backend *be = s->be;
    const kvc_layer_weights *W = &s->model->layers[l];
    kvc_moe_act *a = &s->act.moe;
    const int32_t E = c->n_experts, k = c->n_experts_used;
    const int64_t D = c->hidden, Fe = c->moe_ffn;
    if (a->rows <= 0) return kvc_fail(KVC_ERR_INTERNAL, "MoE layer %d without its scratch", l);
    int32_t *ids = a->host, *map = ids + a->rows * k, *cnt = map + 2 * a->rows * k, *start = cnt + E;
    const kvc_view xn = kvc_view_of(s->act.xn, 0, D), x = kvc_view_of(s->act.x, 0, D), xs = kvc_view_of(a->xs, 0, D);
    const kvc_view logits = kvc_view_of(a->logits, 0, E), idv = kvc_view_of(a->ids, 0, k), wv = kvc_view_of(a->w, 0, k);
    const kvc_view gu = kvc_view_of(a->gu, 0, 2 * Fe);
    for (int64_t r0 = 0; r0 < rows; r0 += a->rows) {
        const int64_t nr = rows - r0 < a->rows ? rows - r0 : a->rows, m = nr * k;
        const kvc_view in = kvc_view_at(xn, r0, 0);
        KVC_TRY(be->matmul(in, W->router, logits, nr, E, D, 0));
        KVC_TRY(be->moe_route(logits, nr, E, k, c->moe_norm_topk, idv, wv));
        KVC_TRY(be->download(idv, nr, k, ids, KVC_I32));
        KVC_TRY(group(ids, nr, k, E, cnt, start, map, map + m));
        KVC_TRY(be->upload(kvc_view_of(a->map, 0, 2 * m), 1, 2 * m, map, KVC_I32));
        KVC_TRY(be->gather_rows(in, kvc_view_of(a->map, 0, m), m, D, xs));
        for (int32_t e = 0; e < E; e++) {
            const int64_t ne = start[e + 1] - start[e];
            if (ne == 0) continue;
            const kvc_view rows_e = kvc_view_at(xs, start[e], 0);
            KVC_TRY(kvc_wgroup_matmul(be, rows_e, &W->exp_gu[e], gu, ne, D));
            KVC_TRY(be->swiglu(gu, ne, Fe));
            KVC_TRY(be->matmul(gu, W->exp_down[e], rows_e, ne, D, Fe, 0)); /* its inputs are consumed: the outputs go there */
        }
        KVC_TRY(be->moe_combine(kvc_view_at(x, r0, 0), xs, wv, kvc_view_of(a->map, m, k), nr, k, D));
    }
    return KVC_OK;
}
