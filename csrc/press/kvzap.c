/* KVzapPress (kvpress; Jegou et al., 2026, KVzap, a fast surrogate of KVzip): per layer, a linear model or
 * a 2-layer MLP (exact GELU) maps each token's normed hidden state (the attention block's input) to one
 * score per KV head. The weights come from the caller (Python reads the model's files from a local path).
 * Computed on the host from the rows downloaded from the backend (float64 accumulation): the activations are
 * read, never the model's weight buffers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct kvc_kvzap {
    int32_t L, Hkv, D, hid; /* hid 0: linear */
    float *w1, *b1, *w2, *b2;
} kvc_kvzap;

static void kvc_kvzap_free(kvc_kvzap *z) {
    if (!z) return;
    free(z->w1);
    free(z->b1);
    free(z->w2);
    free(z->b2);
    free(z);
}

static float *copy(const float *src, size_t n, kvc_status *st) {
    if (*st != KVC_OK) return NULL;
    float *p = malloc(sizeof(float) * (n ? n : 1));
    if (!p) *st = kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzap weights");
    else memcpy(p, src, sizeof(float) * n);
    return p;
}

static kvc_status kvc_kvzap_new(const kvc_config *mc, int32_t hidden_dim, const float *w1, const float *b1, const float *w2,
                         const float *b2, kvc_kvzap **out) {
    *out = NULL;
    if (hidden_dim < 0) return kvc_fail(KVC_ERR_ARG, "KVzap hidden_dim must be >= 0 (0: linear), got %d", hidden_dim);
    if (!w1 || !b1 || (hidden_dim > 0 && (!w2 || !b2))) return kvc_fail(KVC_ERR_ARG, "KVzap: missing weights");
    kvc_kvzap *z = calloc(1, sizeof *z);
    if (!z) return kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzap");
    z->L = mc->n_layers;
    z->Hkv = mc->n_kv_heads;
    z->D = mc->hidden;
    z->hid = hidden_dim;
    const size_t L = (size_t)z->L, o1 = (size_t)(hidden_dim > 0 ? hidden_dim : z->Hkv);
    kvc_status st = KVC_OK;
    z->w1 = copy(w1, L * o1 * (size_t)z->D, &st);
    z->b1 = copy(b1, L * o1, &st);
    if (hidden_dim > 0) {
        z->w2 = copy(w2, L * (size_t)z->Hkv * o1, &st);
        z->b2 = copy(b2, L * (size_t)z->Hkv, &st);
    }
    if (st != KVC_OK) {
        kvc_kvzap_free(z);
        return st;
    }
    *out = z;
    return KVC_OK;
}

static kvc_status kvc_kvzap_scores(const kvc_kvzap *z, const kvc_backend *be, const kvc_layer_ctx *ctx, float *const *scores) {
    if (!ctx->xn.buf) return kvc_fail(KVC_ERR_UNSUPPORTED, "KVzap needs the hidden states of the forward call");
    const int64_t n = ctx->n, D = z->D, o1 = z->hid > 0 ? z->hid : z->Hkv;
    const size_t l = (size_t)ctx->layer;
    float *x = malloc(sizeof(float) * (size_t)(n * D));
    double *hbuf = malloc(sizeof(double) * (size_t)o1);
    kvc_status st = (!x || !hbuf) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: KVzap scores") : KVC_OK;
    if (st == KVC_OK) st = be->download(ctx->xn, n, D, x, KVC_F32);
    const float *W1 = z->w1 + l * (size_t)o1 * D, *B1 = z->b1 + l * (size_t)o1;
    for (int64_t r = 0; r < n && st == KVC_OK; r++) {
        const float *xr = x + r * D;
        for (int64_t j = 0; j < o1; j++) {
            double a = B1[j];
            const float *w = W1 + j * D;
            for (int64_t i = 0; i < D; i++) a += (double)w[i] * xr[i];
            hbuf[j] = z->hid > 0 ? 0.5 * a * (1.0 + erf(a / sqrt(2.0))) : a;
        }
        for (int32_t h = 0; h < z->Hkv; h++) {
            double sc = hbuf[h];
            if (z->hid > 0) {
                const float *w = z->w2 + (l * z->Hkv + h) * (size_t)z->hid;
                sc = z->b2[l * z->Hkv + h];
                for (int32_t j = 0; j < z->hid; j++) sc += (double)w[j] * hbuf[j];
            }
            scores[h][r] = (float)sc;
        }
    }
    free(x);
    free(hbuf);
    return st;
}

typedef struct {
    kvc_kvzap *z;
} kvzap_state;

static void release(void *state) { kvc_kvzap_free(((kvzap_state *)state)->z); }

/* KVzapPress: the surrogate model's scores of this call's rows (host), uploaded, each head's top k. */
static kvc_status kvzap_select(kvc_press *p, void *state, const kvc_press_config *cfg, kvc_session *s,
                               const kvc_layer_ctx *ctx, const int64_t *len, float *const *scores, int64_t *const *keep,
                               int64_t *n_keep) {
    const kvc_backend *be = kvc_door_backend(s);
    int64_t maxlen = 1;
    for (int32_t h = 0; h < p->n_kv; h++) {
        if (len[h] != ctx->n)
            return kvc_fail(KVC_ERR_UNSUPPORTED, "KVzapPress scores the rows of one prefill from their hidden states: the "
                            "session must be empty before it (head %d holds %lld rows, the call %lld)", h,
                            (long long)len[h], (long long)ctx->n);
        maxlen = len[h] > maxlen ? len[h] : maxlen;
    }
    KVC_TRY(kvc_score_buffer(be, p->n_kv, &p->dev_scores, &p->dev_ld, maxlen));
    KVC_TRY(kvc_kvzap_scores(((const kvzap_state *)state)->z, be, ctx, scores));
    for (int32_t h = 0; h < p->n_kv; h++) {
        KVC_TRY(be->upload(kvc_view_of(p->dev_scores, (int64_t)h * p->dev_ld, p->dev_ld), 1, len[h], scores[h], KVC_F32));
        const int64_t kk = kvc_layer_budget(cfg, ctx->layer, p->n_layers, len[h]);
        n_keep[h] = kk < len[h] ? kk : len[h];
    }
    return be->topk(kvc_view_of(p->dev_scores, 0, p->dev_ld), p->n_kv, len, n_keep, keep);
}

static const kvc_press_part_i kvzap_part = {
    .name = "kvzap", .title = "KVzapPress", .traits = KVC_PART_SELECTS | KVC_PART_PLAIN, .order = 10,
    .state_size = sizeof(kvzap_state), .release = release, .select = kvzap_select,
    .doc = "scores the rows of a prefill from the block's normed input (a linear model or MLP per layer)"};
KVC_REGISTER_PART(kvzap_part);

kvc_status kvc_session_set_kvzap(kvc_session *s, int32_t hidden_dim, const float *w1, const float *b1, const float *w2,
                                 const float *b2) {
    kvc_press *p = NULL;
    KVC_TRY(kvc_last_press(s, &p));
    kvc_kvzap *z = NULL;
    KVC_TRY(kvc_kvzap_new(&kvc_door_model(s)->cfg, hidden_dim, w1, b1, w2, b2, &z));
    kvzap_state *st = NULL;
    const kvc_status rc = kvc_press_part_state(p, &kvzap_part, (void **)&st);
    if (rc != KVC_OK) {
        kvc_kvzap_free(z);
        return rc;
    }
    kvc_kvzap_free(st->z);
    st->z = z;
    return KVC_OK;
}
