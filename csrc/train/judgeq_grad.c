/* Judge Q training (JudgeQ-trainable-queries.txt, Eq. 3-5; docs/METHODS.md "Judge Q"): for one (prompt,
 * response) pair and soft-token embeddings E [m, D], the loss and dL/dE.
 *
 * Attention maps, per layer l and query head hq, over the P prompt positions j:
 *   A_resp[l, hq, j] = 1/nr sum_i softmax_i(j)   for the nr response rows of a forward of prompt+response
 *   A_soft[l, hq, j] = 1/m  sum_i softmax_i(j)   for the m soft rows of a forward of prompt+soft
 * where softmax_i is row i's causal attention over everything it sees (the prompt and the rows before
 * it, itself included), restricted to prompt positions afterwards and NOT renormalised: exactly the
 * scores JudgeQPress and ResponseGuidedPress use at inference (before pooling and GQA reduction).
 * Heads are query heads (the paper's attention map is per head; GQA reduction happens only at
 * selection time). Soft rows sit at positions P .. P+m-1, as at inference.
 *   L = 1 / (n_layers * H * P) * sum_{l, hq, j} (A_soft - A_resp)^2.
 *
 * The prompt's K/V do not depend on E (causal), so one forward of prompt+response (kvc_forward_ex,
 * a layer hook reading the response rows' queries) gives both the target and the prompt's cache;
 * the response rows are then cut from the cache and the soft rows run the host forward and backward of
 * train/rows_grad.c over m rows only, against the cached prompt keys/values, with this objective: the
 * maps and the loss read from each head's probabilities in the forward, d L / d A_soft = G = 2 (A_soft -
 * A_resp) / (n_layers H P) added to the probabilities' gradient (G[j] / m for every soft row) in the
 * backward. The last layer's MLP is skipped: no loss term depends on it. Memory O(P * n_layers * kv_dim)
 * for the cache, O(m) activations per layer. */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../core/press_i.h"
#include "rows_grad.h"

/* ---------------------------------------------------------------------------------------------- */
/* The target: the response rows' attention maps, from a layer hook of the prompt+response forward */

typedef struct resp_ctx {
    const kvc_config *c;
    int64_t P, nr;
    float *maps;  /* [n_layers, H, P] */
    float *qresp; /* [nr, H * d] the response rows' queries */
    float *kbuf;  /* [Hkv, P + nr, d] the layer's keys */
    float *qbuf;  /* [H, nr, d] */
    float *pbuf;  /* [H, nr, P + nr] */
} resp_ctx;

static kvc_status resp_hook(void *user, kvc_session *s, const kvc_layer_ctx *ctx) {
    const kvc_backend *be = kvc_door_backend(s);
    resp_ctx *r = user;
    const kvc_config *c = r->c;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t P = r->P, nr = r->nr, len = P + nr, qd = (int64_t)H * d;
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[ctx->layer];
    for (int32_t h = 0; h < Hkv; h++)
        if (L->len[h] != len || ctx->past_len[h] != 0)
            return kvc_fail(KVC_ERR_INTERNAL, "judgeq: unexpected cache length %lld at layer %d (want %lld)",
                            (long long)L->len[h], ctx->layer, (long long)len);
    KVC_TRY(be->download(kvc_view_at(ctx->q, P, 0), nr, qd, r->qresp, KVC_F32));
    for (int32_t h = 0; h < Hkv; h++) KVC_TRY(be->kv_read(L->kv, h, 0, len, r->kbuf + (size_t)h * len * d, NULL));
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel for schedule(dynamic, 1) num_threads(kvc_host_threads())
    for (int32_t hq = 0; hq < H; hq++) {
        float *qh = r->qbuf + (size_t)hq * nr * d, *pr = r->pbuf + (size_t)hq * nr * len;
        kvc_rows_gather_head(r->qresp, H, d, hq, nr, qh);
        kvc_rows_causal_probs(qh, nr, r->kbuf + (size_t)(hq / g) * len * d, len, d, scale, P, pr);
        float *out = r->maps + ((size_t)ctx->layer * H + hq) * P;
        for (int64_t j = 0; j < P; j++) {
            double acc = 0.0;
            for (int64_t i = 0; i < nr; i++) acc += pr[i * len + j];
            out[j] = (float)(acc / (double)nr);
        }
    }
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* The soft rows: the rows pass (rows_grad.c) with Judge Q's objective                                */

/* floats of a buffer of a * b * c elements, or 0 on overflow */
static size_t nfl(size_t a, size_t b, size_t c) {
    size_t ab, abc;
    if (kvc_mul_ok(a, b, &ab) || kvc_mul_ok(ab, c, &abc) || abc > SIZE_MAX / 8) return 0;
    return abc;
}

/* The pair's own copy of the prompt's K/V, with room for the soft rows after it: K and V of (layer l,
 * KV head h) are [cap, d] at kv + ((l * Hkv + h) * 2 + {0, 1}) * cap * d. */
typedef struct pair_kv {
    float *kv;
    int64_t cap;
    int32_t Hkv, d;
} pair_kv;

static float *pk(const pair_kv *c, int32_t l, int32_t h, int v) {
    return c->kv + (((size_t)l * c->Hkv + h) * 2 + (size_t)v) * (size_t)c->cap * c->d;
}

/* the rows pass's prefix: the pair's prompt K/V, the soft rows written after them */
static kvc_status pair_layer(void *user, int32_t l, float **k, float **v, int64_t *held) {
    const pair_kv *c = user;
    (void)held; /* the whole prompt: held stays P */
    for (int32_t h = 0; h < c->Hkv; h++) {
        k[h] = pk(c, l, h, 0);
        v[h] = pk(c, l, h, 1);
    }
    return KVC_OK;
}

typedef struct jq_objective {
    const float *a_resp;  /* [Lyr, H, P] the pair's target (borrowed) */
    float *a_soft, *gmap; /* [Lyr, H, P]; gmap = dL/dA_soft, with a gradient only */
    int64_t P, m;
    int32_t H;
    double norm;          /* 1 / (n_layers H P) */
} jq_objective;

/* A_soft of (l, hq), the head's share of the loss (before norm) and G */
static double jq_head_probs(void *user, int32_t l, int32_t hq, const float *pr, int64_t len) {
    jq_objective *o = user;
    const int64_t P = o->P, m = o->m;
    const size_t off = ((size_t)l * o->H + hq) * P;
    float *as = o->a_soft + off;
    const float *ar = o->a_resp + off;
    double layer_loss = 0.0;
    for (int64_t j = 0; j < P; j++) {
        double acc = 0.0;
        for (int64_t i = 0; i < m; i++) acc += pr[i * len + j];
        as[j] = (float)(acc / (double)m);
        const double diff = acc / (double)m - (double)ar[j];
        layer_loss += diff * diff;
        if (o->gmap) o->gmap[off + j] = (float)(2.0 * diff * o->norm);
    }
    return layer_loss;
}

/* dL/dp[i, j] = G[j] / m for the prompt positions j of every soft row i */
static void jq_head_dprobs(void *user, int32_t l, int32_t hq, float *dp, int64_t len) {
    const jq_objective *o = user;
    const float inv_m = 1.0f / (float)o->m, *gm = o->gmap + ((size_t)l * o->H + hq) * o->P;
    for (int64_t i = 0; i < o->m; i++)
        for (int64_t j = 0; j < o->P; j++) dp[i * len + j] += gm[j] * inv_m;
}

/* The loss (and its gradient) of m soft rows on the pair's cache; a_soft receives the maps. */
static kvc_status soft_rows(const kvc_config *c, const kvc_host_weights *M, pair_kv *cache, const float *a_resp,
                            float *a_soft, const float *soft, int64_t P, int64_t m, double *loss, float *grad) {
    const size_t nmap = nfl(c->n_layers, c->n_heads, P);
    jq_objective o = {a_resp, a_soft, grad ? kvc_malloc(nmap * sizeof(float), "judgeq map gradient") : NULL, P, m,
                      c->n_heads, 1.0 / ((double)c->n_layers * c->n_heads * P)};
    int64_t *pos = kvc_malloc(sizeof(int64_t) * (size_t)m, "judgeq positions");
    kvc_rows *r = NULL;
    kvc_status st = pos && (!grad || o.gmap) ? KVC_OK : KVC_ERR_NOMEM;
    for (int64_t i = 0; st == KVC_OK && i < m; i++) pos[i] = P + i;
    if (st == KVC_OK) st = kvc_rows_new(c, M, P, m, grad != NULL, &r);
    const kvc_rows_prefix pre = {P, pair_layer, cache};
    const kvc_rows_objective obj = {&o, 0, jq_head_probs, NULL, jq_head_dprobs, NULL};
    double L = 0.0;
    if (st == KVC_OK) st = kvc_rows_forward(r, &pre, &obj, NULL, soft, pos, &L);
    if (st == KVC_OK && grad) st = kvc_rows_backward(r, &pre, &obj, grad);
    if (st == KVC_OK) *loss = L * o.norm;
    kvc_rows_free(r);
    kvc_free(o.gmap);
    kvc_free(pos);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Public entry points                                                                             */

#define MAX_PROMPT (1LL << 24)
#define MAX_ROWS (1LL << 20)

struct kvc_judgeq_pair {
    kvc_model *model;
    const kvc_config *c;
    const kvc_host_weights *hw; /* the model's fp32 host weights (kvc_model_host_weights) */
    pair_kv cache;              /* the prompt's K/V, room for max_soft soft rows after it */
    int64_t P, nr, max_soft;
    float *a_resp;              /* [n_layers, H, P] */
    atomic_int busy;
};

static kvc_status check_ids(const int32_t *ids, int64_t n, int32_t vocab, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return kvc_fail(KVC_ERR_ARG, "judgeq: %s token id %d at index %lld is outside the vocabulary [0, %d)", what,
                            ids[i], (long long)i, vocab);
    return KVC_OK;
}

/* The forward of prompt + response on the host model: the target maps (resp_hook) and the prompt's K/V. */
static kvc_status target_and_prompt(kvc_judgeq_pair *pair, kvc_model *host, const int32_t *ids) {
    const kvc_config *c = pair->c;
    const int64_t P = pair->P, nr = pair->nr, lenr = P + nr;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim;
    const size_t nq = nfl(nr, c->n_heads, c->head_dim), nk = nfl(Hkv, lenr, d), np_ = nfl(c->n_heads, nr, lenr);
    if (!nq || !nk || !np_) return kvc_fail(KVC_ERR_NOMEM, "out of memory: judgeq pair size overflows");
    resp_ctx rc = {c, P, nr, pair->a_resp, kvc_malloc(nq * sizeof(float), "judgeq response queries"),
                   kvc_malloc(nk * sizeof(float), "judgeq keys"), kvc_malloc(nq * sizeof(float), "judgeq response queries"),
                   kvc_malloc(np_ * sizeof(float), "judgeq response attention")};
    kvc_session *s = NULL;
    kvc_status st = (!rc.qresp || !rc.kbuf || !rc.qbuf || !rc.pbuf) ? KVC_ERR_NOMEM : kvc_session_new(host, lenr, &s);
    if (st == KVC_OK) st = kvc_door_probe(s, ids, lenr, NULL, 0, resp_hook, &rc, KVC_ROW_NONE, NULL, lenr);
    for (int32_t l = 0; l < c->n_layers && st == KVC_OK; l++)
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            st = kvc_door_backend(s)->kv_read(kvc_door_cache(s)->layers[l].kv, h, 0, P, pk(&pair->cache, l, h, 0),
                                              pk(&pair->cache, l, h, 1));
    kvc_session_free(s);
    kvc_free(rc.qresp);
    kvc_free(rc.kbuf);
    kvc_free(rc.qbuf);
    kvc_free(rc.pbuf);
    return st;
}

kvc_status kvc_judgeq_pair_new(kvc_model *model, const int32_t *prompt_ids, int64_t n_prompt,
                               const int32_t *response_ids, int64_t n_response, int64_t max_soft,
                               kvc_judgeq_pair **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_pair_new: out is NULL");
    *out = NULL;
    if (!model) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_pair_new: model is NULL");
    if (n_prompt < 1 || n_prompt > MAX_PROMPT)
        return kvc_fail(KVC_ERR_ARG, "judgeq: the prompt needs 1 to %lld tokens, got %lld", MAX_PROMPT,
                        (long long)n_prompt);
    if (n_response < 1 || n_response > MAX_ROWS)
        return kvc_fail(KVC_ERR_ARG, "judgeq: the response needs 1 to %lld tokens, got %lld", MAX_ROWS,
                        (long long)n_response);
    if (max_soft < 0 || max_soft > MAX_ROWS)
        return kvc_fail(KVC_ERR_ARG, "judgeq: max_soft must be in [0, %lld], got %lld", MAX_ROWS, (long long)max_soft);
    if (!prompt_ids || !response_ids)
        return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_pair_new: prompt_ids and response_ids must not be NULL");
    const kvc_config *c = &model->cfg;
    /* the rows pass has no sliding-window mask */
    if (c->sliding_window)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "judgeq: training soft tokens on a model with sliding-window attention is not "
                        "implemented (the host backward has no window mask); train on a model without a sliding window");
    KVC_TRY(check_ids(prompt_ids, n_prompt, c->vocab, "prompt"));
    KVC_TRY(check_ids(response_ids, n_response, c->vocab, "response"));
    /* the gradient runs on the host in fp32: the model's own weights on the CPU, a host copy of a device
     * model's file otherwise (loaded once, on the first pair) */
    const kvc_host_weights *hw = NULL;
    KVC_TRY(kvc_model_host_weights(model, &hw));
    kvc_model *host = kvc_model_host_model(model);
    const int64_t P = n_prompt, nr = n_response, lenr = P + nr;
    const int64_t cap = P + (max_soft > 0 ? max_soft : 1);
    const size_t nmap = nfl(c->n_layers, c->n_heads, P), nkv = nfl((size_t)c->n_layers * c->n_kv_heads, 2 * cap, c->head_dim);
    if (!nmap || !nkv) return kvc_fail(KVC_ERR_NOMEM, "out of memory: judgeq pair size overflows");
    kvc_judgeq_pair *pair = calloc(1, sizeof *pair);
    int32_t *ids = kvc_malloc(sizeof(int32_t) * (size_t)lenr, "judgeq ids");
    kvc_status st = KVC_OK;
    if (!pair || !ids) {
        st = kvc_fail(KVC_ERR_NOMEM, "out of memory: judgeq pair");
        goto fail;
    }
    pair->model = model;
    pair->c = c;
    pair->hw = hw;
    pair->P = P;
    pair->nr = nr;
    pair->max_soft = max_soft;
    pair->cache = (pair_kv){kvc_malloc(nkv * sizeof(float), "judgeq prompt K/V"), cap, c->n_kv_heads, c->head_dim};
    pair->a_resp = kvc_malloc(nmap * sizeof(float), "judgeq target maps");
    atomic_init(&pair->busy, 0);
    if (!pair->cache.kv || !pair->a_resp) {
        st = KVC_ERR_NOMEM;
        goto fail;
    }
    memcpy(ids, prompt_ids, sizeof(int32_t) * (size_t)P);
    memcpy(ids + P, response_ids, sizeof(int32_t) * (size_t)nr);
    st = target_and_prompt(pair, host, ids);
    if (st != KVC_OK) goto fail;
    kvc_free(ids);
    *out = pair;
    return KVC_OK;
fail:
    kvc_free(ids);
    kvc_judgeq_pair_free(pair);
    return st;
}

void kvc_judgeq_pair_free(kvc_judgeq_pair *pair) {
    if (!pair) return;
    kvc_free(pair->cache.kv);
    kvc_free(pair->a_resp);
    free(pair);
}

size_t kvc_judgeq_pair_bytes(const kvc_judgeq_pair *pair) {
    if (!pair) return 0;
    const kvc_config *c = pair->c;
    return sizeof *pair + (size_t)c->n_layers * c->n_kv_heads * 2 * (size_t)pair->cache.cap * c->head_dim * sizeof(float) +
           (size_t)c->n_layers * c->n_heads * (size_t)pair->P * sizeof(float);
}

int64_t kvc_judgeq_pair_prompt_len(const kvc_judgeq_pair *pair) { return pair ? pair->P : 0; }

/* More soft rows than max_soft: the pair's K/V grows (the prompt's rows copied), and stays grown. */
static kvc_status room_for(kvc_judgeq_pair *pair, int64_t m) {
    pair_kv *c = &pair->cache;
    if (pair->P + m <= c->cap) return KVC_OK;
    const kvc_config *mc = pair->c;
    const size_t n = nfl((size_t)mc->n_layers * c->Hkv, 2 * (pair->P + m), c->d);
    if (!n) return kvc_fail(KVC_ERR_NOMEM, "out of memory: judgeq pair size overflows");
    pair_kv grown = {kvc_malloc(n * sizeof(float), "judgeq prompt K/V"), pair->P + m, c->Hkv, c->d};
    if (!grown.kv) return KVC_ERR_NOMEM;
    for (int32_t l = 0; l < mc->n_layers; l++)
        for (int32_t h = 0; h < c->Hkv; h++)
            for (int v = 0; v < 2; v++) memcpy(pk(&grown, l, h, v), pk(c, l, h, v), sizeof(float) * (size_t)pair->P * c->d);
    kvc_free(c->kv);
    *c = grown;
    return KVC_OK;
}

kvc_status kvc_judgeq_pair_loss_grad(kvc_judgeq_pair *pair, const float *soft, int64_t n_soft, double *loss,
                                     float *grad, float *soft_maps, float *response_maps) {
    if (!pair) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_pair_loss_grad: pair is NULL");
    if (!loss) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_pair_loss_grad: loss is NULL");
    if (n_soft < 1 || n_soft > MAX_ROWS)
        return kvc_fail(KVC_ERR_ARG, "judgeq: need 1 to %lld soft tokens, got %lld", MAX_ROWS, (long long)n_soft);
    if (!soft) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_pair_loss_grad: soft is NULL");
    const kvc_config *c = pair->c;
    for (int64_t i = 0; i < n_soft * c->hidden; i++)
        if (!isfinite(soft[i]))
            return kvc_fail(KVC_ERR_ARG, "judgeq: soft embedding value at row %lld, column %lld is not finite",
                            (long long)(i / c->hidden), (long long)(i % c->hidden));
    int expected = 0;
    if (!atomic_compare_exchange_strong(&pair->busy, &expected, 1))
        return kvc_fail(KVC_ERR_ARG, "judgeq: this pair is in use by another thread");
    const int64_t P = pair->P, m = n_soft;
    const size_t nmap = (size_t)c->n_layers * c->n_heads * (size_t)P;
    float *a_soft = kvc_malloc(nmap * sizeof(float), "judgeq soft maps");
    kvc_status st = a_soft ? room_for(pair, m) : KVC_ERR_NOMEM;
    double L = 0.0;
    if (st == KVC_OK) st = soft_rows(c, pair->hw, &pair->cache, pair->a_resp, a_soft, soft, P, m, &L, grad);
    if (st == KVC_OK) {
        *loss = L;
        if (soft_maps) memcpy(soft_maps, a_soft, sizeof(float) * nmap);
        if (response_maps) memcpy(response_maps, pair->a_resp, sizeof(float) * nmap);
    }
    kvc_free(a_soft);
    atomic_store(&pair->busy, 0);
    return st;
}

kvc_status kvc_judgeq_loss_grad(kvc_model *model, const int32_t *prompt_ids, int64_t n_prompt,
                                const int32_t *response_ids, int64_t n_response, const float *soft, int64_t n_soft,
                                double *loss, float *grad, float *soft_maps, float *response_maps) {
    if (!loss) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_loss_grad: loss is NULL");
    if (n_soft < 1 || n_soft > MAX_ROWS)
        return kvc_fail(KVC_ERR_ARG, "judgeq: need 1 to %lld soft tokens, got %lld", MAX_ROWS, (long long)n_soft);
    if (!soft) return kvc_fail(KVC_ERR_ARG, "kvc_judgeq_loss_grad: soft is NULL");
    kvc_judgeq_pair *pair = NULL;
    KVC_TRY(kvc_judgeq_pair_new(model, prompt_ids, n_prompt, response_ids, n_response, n_soft, &pair));
    kvc_status st = kvc_judgeq_pair_loss_grad(pair, soft, n_soft, loss, grad, soft_maps, response_maps);
    kvc_judgeq_pair_free(pair);
    return st;
}
