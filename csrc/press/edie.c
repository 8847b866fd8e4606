/* EDIE scorer (EDIE-TADA-error-driven-eviction.txt; METHODS.md "EDIE scoring").
 *
 * For query head h, window query j (the last w queries) and past row i (i < len - w):
 *   a_i^j  softmax attention of j over every row it can see
 *   U_i^j  = a_i^j / (1 + alpha - a_i^j) * (|v_i|_1 + |o_j|_1)       (o_j: j's attention output)
 *   c_j    = max over the mid-range rows w < i <= len - 2w of a_i^j   (all past rows if empty)
 *   I_i    = sum_j c_j U_i^j, summed over the heads of a GQA group, then mean-pooled; window protected.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "press.h"

/* I[h][0..len-w) before pooling for one KV head, accumulated into acc; probs is scratch [w, len]. */
static void edie_head(const kvc_score_input *in, int32_t h, int32_t w, float alpha, const float *vnorm,
                      double *acc, float *probs, float *qw, int64_t *vis) {
    const kvc_config *c = in->cfg;
    const kvc_layer_ctx *ctx = in->ctx;
    const kvc_layer_cache *L = in->cache;
    const int32_t H = c->n_heads, g = H / c->n_kv_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t len = L->len[h], n_past = len - w, n = ctx->n;
    /* mid-range rows (w, len - 2w]; empty -> every past row */
    int64_t mid_lo = w + 1, mid_hi = len - 2 * (int64_t)w;
    if (mid_hi > n_past - 1) mid_hi = n_past - 1;
    if (mid_lo > mid_hi) {
        mid_lo = 0;
        mid_hi = n_past - 1;
    }
    for (int32_t t = 0; t < g; t++) {
        const int32_t hq = h * g + t;
        kvc_gather_queries(ctx, H, d, hq, n - w, w, qw);
        for (int32_t j = 0; j < w; j++) vis[j] = ctx->past_len[h] + (n - w + j) + 1;
        kvc_probs_rows(qw, w, L->k[h], len, d, scale, vis, probs);
        for (int32_t j = 0; j < w; j++) {
            const float *a = probs + (size_t)j * len;
            const float *o = ctx->attn + ((n - w + j) * H + hq) * d;
            double onorm = 0;
            for (int32_t e = 0; e < d; e++) onorm += fabsf(o[e]);
            float cj = 0.f;
            for (int64_t r = mid_lo; r <= mid_hi; r++) cj = a[r] > cj ? a[r] : cj;
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < n_past; r++) {
                const double ar = a[r];
                acc[r] += cj * (ar / (1.0 + alpha - ar)) * (vnorm[r] + onorm);
            }
        }
    }
}

kvc_status kvc_score_edie(const kvc_score_input *in, float *const *scores) {
    const kvc_press_config *p = in->press;
    const kvc_layer_cache *L = in->cache;
    const int32_t Hkv = in->cfg->n_kv_heads, d = in->cfg->head_dim, w = p->window;
    if (!in->ctx->attn) return kvc_fail(KVC_ERR_ARG, "EDIE needs the attention outputs of the window queries");
    int64_t maxlen = 0;
    for (int32_t h = 0; h < Hkv; h++) maxlen = L->len[h] > maxlen ? L->len[h] : maxlen;
    const size_t ml = (size_t)(maxlen > 0 ? maxlen : 1);
    double *acc = malloc(sizeof(double) * ml);
    float *probs = malloc(sizeof(float) * (size_t)w * ml), *vnorm = malloc(sizeof(float) * ml);
    float *tmp = malloc(sizeof(float) * ml), *qw = malloc(sizeof(float) * (size_t)w * d);
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)w);
    kvc_status st = (!acc || !probs || !vnorm || !tmp || !qw || !vis) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: EDIE scores") : KVC_OK;
    float gmax = -FLT_MAX;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        const int64_t len = L->len[h], n_past = len - w;
        for (int64_t r = 0; r < len; r++) {
            double s = 0;
            for (int32_t e = 0; e < d; e++) s += fabsf(L->v[h][r * d + e]);
            vnorm[r] = (float)s;
        }
        memset(acc, 0, sizeof(double) * (size_t)len);
        edie_head(in, h, w, p->edie_alpha, vnorm, acc, probs, qw, vis);
        for (int64_t r = 0; r < n_past; r++) tmp[r] = (float)acc[r];
        /* mean pooling, counting padding (as torch avg_pool1d) */
        const int32_t half = p->kernel / 2;
        for (int64_t r = 0; r < n_past; r++) {
            double s = 0;
            for (int64_t t = r - half; t <= r + half; t++)
                if (t >= 0 && t < n_past) s += tmp[t];
            scores[h][r] = (float)(s / p->kernel);
            gmax = scores[h][r] > gmax ? scores[h][r] : gmax;
        }
    }
    free(acc); free(probs); free(vnorm); free(tmp); free(qw); free(vis);
    if (st != KVC_OK) return st;
    if (gmax == -FLT_MAX) gmax = 0.f;
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t r = L->len[h] - w; r < L->len[h]; r++) scores[h][r] = gmax + 1.f;
    return KVC_OK;
}
