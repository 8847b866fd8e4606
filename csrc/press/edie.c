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

/* I[h][0..len-w) before pooling for one KV head; probs is scratch [len]. */
static void edie_head(const kvc_score_input *in, int32_t h, int32_t w, float alpha, const float *vnorm,
                      double *acc, float *probs) {
    const kvc_config *c = in->cfg;
    const kvc_layer_ctx *ctx = in->ctx;
    const kvc_layer_cache *L = in->cache;
    const int32_t H = c->n_heads, g = H / c->n_kv_heads, d = c->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t len = L->len[h], n_past = len - w;
    /* mid-range rows (w, len - 2w]; empty -> every past row */
    int64_t mid_lo = w + 1, mid_hi = len - 2 * (int64_t)w;
    if (mid_hi > n_past - 1) mid_hi = n_past - 1;
    if (mid_lo > mid_hi) {
        mid_lo = 0;
        mid_hi = n_past - 1;
    }
    for (int32_t t = 0; t < g; t++) {
        const int32_t hq = h * g + t;
        for (int64_t j = ctx->n - w; j < ctx->n; j++) {
            const float *q = ctx->q + (j * H + hq) * d;
            const int64_t visible = ctx->past_len[h] + j + 1 < len ? ctx->past_len[h] + j + 1 : len;
            float mx = -FLT_MAX;
            for (int64_t r = 0; r < visible; r++) {
                const float *kr = L->k[h] + r * d;
                float dot = 0.f;
                for (int32_t e = 0; e < d; e++) dot += q[e] * kr[e];
                probs[r] = dot * scale;
                mx = probs[r] > mx ? probs[r] : mx;
            }
            double z = 0;
            for (int64_t r = 0; r < visible; r++) {
                probs[r] = expf(probs[r] - mx);
                z += probs[r];
            }
            const float inv = (float)(1.0 / z);
            for (int64_t r = 0; r < visible; r++) probs[r] *= inv;
            double onorm = 0;
            const float *o = ctx->attn + (j * H + hq) * d;
            for (int32_t e = 0; e < d; e++) onorm += fabsf(o[e]);
            float cj = 0.f;
            for (int64_t r = mid_lo; r <= mid_hi && r < visible; r++) cj = probs[r] > cj ? probs[r] : cj;
            const int64_t lim = n_past < visible ? n_past : visible;
            for (int64_t r = 0; r < lim; r++) {
                const double a = probs[r];
                acc[r] += cj * (a / (1.0 + alpha - a)) * (vnorm[r] + onorm);
            }
        }
    }
}

kvc_status kvc_score_edie(const kvc_score_input *in, float *const *scores) {
    const kvc_press_config *p = in->press;
    const kvc_layer_cache *L = in->cache;
    const int32_t Hkv = in->cfg->n_kv_heads, d = in->cfg->head_dim, w = p->window;
    if (!in->ctx->attn) return kvc_fail(KVC_ERR_ARG, "EDIE needs the attention outputs of the window queries");
    kvc_status st = KVC_OK;
    float gmax = -FLT_MAX;
#pragma omp parallel for schedule(dynamic, 1) reduction(max : gmax)
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t len = L->len[h], n_past = len - w;
        double *acc = calloc((size_t)(len > 0 ? len : 1), sizeof(double));
        float *probs = malloc(sizeof(float) * (size_t)(len > 0 ? len : 1));
        float *vnorm = malloc(sizeof(float) * (size_t)(len > 0 ? len : 1));
        float *tmp = malloc(sizeof(float) * (size_t)(len > 0 ? len : 1));
        if (!acc || !probs || !vnorm || !tmp) {
#pragma omp critical
            st = kvc_fail(KVC_ERR_NOMEM, "out of memory: EDIE scores");
        } else {
            for (int64_t r = 0; r < len; r++) {
                double s = 0;
                for (int32_t e = 0; e < d; e++) s += fabsf(L->v[h][r * d + e]);
                vnorm[r] = (float)s;
            }
            edie_head(in, h, w, p->edie_alpha, vnorm, acc, probs);
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
        free(acc);
        free(probs);
        free(vnorm);
        free(tmp);
    }
    if (st != KVC_OK) return st;
    if (gmax == -FLT_MAX) gmax = 0.f;
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t r = L->len[h] - w; r < L->len[h]; r++) scores[h][r] = gmax + 1.f;
    return KVC_OK;
}
