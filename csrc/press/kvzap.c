/* KVzapPress (kvpress; Jegou et al., 2026, KVzap, a fast surrogate of KVzip): per layer, a linear model or
 * a 2-layer MLP (exact GELU) maps each token's normed hidden state (the attention block's input) to one
 * score per KV head. The weights come from the caller (Python reads the model's files from a local path).
 * Computed on the host from the rows downloaded from the backend (float64 accumulation): the activations are
 * read, never the model's weight buffers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

struct kvc_kvzap {
    int32_t L, Hkv, D, hid; /* hid 0: linear */
    float *w1, *b1, *w2, *b2;
};

void kvc_kvzap_free(kvc_kvzap *z) {
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

kvc_status kvc_kvzap_new(const kvc_config *mc, int32_t hidden_dim, const float *w1, const float *b1, const float *w2,
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

kvc_status kvc_kvzap_scores(const kvc_kvzap *z, const kvc_backend *be, const kvc_layer_ctx *ctx, float *const *scores) {
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

kvc_status kvc_session_set_kvzap(kvc_session *s, int32_t hidden_dim, const float *w1, const float *b1, const float *w2,
                                 const float *b2) {
    kvc_press *p = NULL;
    KVC_TRY(kvc_last_press(s, &p));
    if (p->cfg.allocation != KVC_ALLOC_UNIFORM || p->cfg.chunk_length > 0 || p->head_keep || p->block_size || p->key_filters ||
        p->head_prune || p->fastkvzip)
        return kvc_fail(KVC_ERR_ARG, "KVzap scores with uniform top-k per head: use it with a plain budget");
    kvc_kvzap *z = NULL;
    KVC_TRY(kvc_kvzap_new(&kvc_door_model(s)->cfg, hidden_dim, w1, b1, w2, b2, &z));
    kvc_kvzap_free(p->kvzap);
    p->kvzap = z;
    return KVC_OK;
}
