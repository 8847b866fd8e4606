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
 * the response rows are then cut from the cache and the soft rows run their own forward and
 * backward over m rows only, against the cached prompt keys/values: activations O(m) per layer,
 * the attention probabilities recomputed in the backward (never stored), memory
 * O(P * n_layers * kv_dim) for the cache. The last layer's MLP is skipped: no loss term depends on it.
 *
 * Backward per layer, with dx the gradient of the layer's output:
 *   MLP:  da = dx Wd, (dg, du) = swiglu', dxn2 = dg Wg + du Wu, dxm = dx + rmsnorm'(xm) dxn2
 *   attn: dattn = dxm Wo; per query head: dp = dattn V^T + [j < P] G[l, hq, j] / m,
 *         ds = p (dp - sum_j p dp); dq = scale ds K; dk_soft += scale ds^T q; dv_soft += p^T dattn
 *   RoPE: rotation by the opposite angle; dxn = dq Wq + dk Wk + dv Wv; dx = dxm + rmsnorm'(x) dxn
 * with G = dL/dA_soft = 2 (A_soft - A_resp) / (n_layers H P). Everything runs in fp32 (sums in double). */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../engine/session.h"
#include "judgeq_grad.h"

static int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

void kvc_rmsnorm_backward(const float *x, const float *w, const float *dy, float *dx, int64_t rows, int64_t dim,
                          float eps, int accumulate) {
    const int par = rows > 1 && rows * dim >= 32768 && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_host_threads()) if (par)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *dyr = dy + r * dim;
        float *dxr = dx + r * dim;
        double ss = 0.0, dot = 0.0;
        for (int64_t i = 0; i < dim; i++) {
            ss += (double)xr[i] * xr[i];
            dot += (double)dyr[i] * w[i] * xr[i];
        }
        const double inv = 1.0 / sqrt(ss / (double)dim + (double)eps);
        const float a = (float)inv, b = (float)(inv * inv * inv * dot / (double)dim);
        if (accumulate) {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) dxr[i] += a * w[i] * dyr[i] - b * xr[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) dxr[i] = a * w[i] * dyr[i] - b * xr[i];
        }
    }
}

void kvc_swiglu_backward(const float *gate, const float *up, const float *dout, float *dgate, float *dup, int64_t n) {
    const int par = n >= 65536 && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_host_threads()) if (par)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i], sg = 1.0f / (1.0f + expf(-g)), silu = g * sg;
        dup[i] = dout[i] * silu;
        dgate[i] = dout[i] * up[i] * sg * (1.0f + g * (1.0f - sg));
    }
}

/* Causal softmax rows of m queries at positions past .. past+m-1 over len cached keys (row i sees
 * keys 0 .. past+i): the scorers' kvc_probs_rows, fed in blocks so the visibility list stays on
 * the stack. */
static void probs_rows(const float *q, int64_t m, const float *k, int64_t len, int32_t d, float scale, int64_t past,
                       float *p) {
    enum { BLOCK = 256 };
    int64_t visible[BLOCK];
    for (int64_t i0 = 0; i0 < m; i0 += BLOCK) {
        const int64_t mb = imin64(BLOCK, m - i0);
        for (int64_t i = 0; i < mb; i++) visible[i] = past + i0 + i + 1;
        kvc_host_probs_rows(q + i0 * d, mb, k, len, d, scale, visible, p + i0 * len);
    }
}

/* Gather rows [first, first + m) of query head hq from x [*, H * d] into dst [m, d]. */
static void gather_head(const float *x, int32_t H, int32_t d, int32_t hq, int64_t first, int64_t m, float *dst) {
    for (int64_t i = 0; i < m; i++) memcpy(dst + i * d, x + ((first + i) * H + hq) * d, sizeof(float) * d);
}

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
    resp_ctx *r = user;
    const kvc_config *c = r->c;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t P = r->P, nr = r->nr, len = P + nr, qd = (int64_t)H * d;
    const kvc_layer_cache *L = &s->cache.layers[ctx->layer];
    for (int32_t h = 0; h < Hkv; h++)
        if (L->len[h] != len || ctx->past_len[h] != 0)
            return kvc_fail(KVC_ERR_INTERNAL, "judgeq: unexpected cache length %lld at layer %d (want %lld)",
                            (long long)L->len[h], ctx->layer, (long long)len);
    KVC_TRY(s->be->download(kvc_view_at(ctx->q, P, 0), nr, qd, r->qresp, KVC_F32));
    for (int32_t h = 0; h < Hkv; h++) KVC_TRY(s->be->kv_read(L->kv, h, 0, len, r->kbuf + (size_t)h * len * d, NULL));
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel for schedule(dynamic, 1) num_threads(kvc_host_threads())
    for (int32_t hq = 0; hq < H; hq++) {
        float *qh = r->qbuf + (size_t)hq * nr * d, *pr = r->pbuf + (size_t)hq * nr * len;
        gather_head(r->qresp, H, d, hq, 0, nr, qh);
        probs_rows(qh, nr, r->kbuf + (size_t)(hq / g) * len * d, len, d, scale, P, pr);
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
/* Workspace                                                                                        */

typedef struct work {
    const float *a_resp;                      /* [Lyr, H, P] the pair's target (borrowed) */
    float *a_soft, *gmap;                     /* [Lyr, H, P] */
    float *X, *XM, *Q, *GT, *UP;              /* per layer: inputs, mid residual, roped queries, gate, up */
    float *xn, *kb, *vb, *attn, *tmp, *act;   /* forward scratch */
    float *qh, *pr, *dp, *dah, *dkp, *dvp;    /* per query head scratch */
    float *dx, *dxm, *dattn, *dq, *dk, *dv, *dxn, *da, *dg, *du; /* backward */
    int64_t *pos, *negpos;
} work;

#define N_FLOAT_BUFS 29

static void work_free(work *w) {
    float **bufs[N_FLOAT_BUFS] = {&w->a_soft, &w->gmap, &w->X, &w->XM, &w->Q, &w->GT, &w->UP,
                                  &w->xn, &w->kb, &w->vb, &w->attn, &w->tmp, &w->act, &w->qh, &w->pr, &w->dp,
                                  &w->dah, &w->dkp, &w->dvp, &w->dx, &w->dxm, &w->dattn,
                                  &w->dq, &w->dk, &w->dv, &w->dxn, &w->da, &w->dg, &w->du};
    for (int i = 0; i < N_FLOAT_BUFS; i++) {
        kvc_free(*bufs[i]);
        *bufs[i] = NULL;
    }
    kvc_free(w->pos);
    kvc_free(w->negpos);
    w->pos = w->negpos = NULL;
}

/* floats of a buffer of a * b * c elements, or 0 on overflow */
static size_t nfl(size_t a, size_t b, size_t c) {
    size_t ab, abc;
    if (kvc_mul_ok(a, b, &ab) || kvc_mul_ok(ab, c, &abc) || abc > SIZE_MAX / 8) return 0;
    return abc;
}

static kvc_status work_alloc(work *w, const kvc_config *c, int64_t P, int64_t m, int with_grad) {
    memset(w, 0, sizeof *w);
    const size_t Ly = c->n_layers, H = c->n_heads, D = c->hidden, F = c->ffn, d = c->head_dim;
    const size_t qd = H * d, kd = (size_t)c->n_kv_heads * d, len = (size_t)(P + m);
    struct {
        float **p;
        size_t n;
        int need;
    } spec[] = {
        {&w->a_soft, nfl(Ly, H, P), 1}, {&w->gmap, nfl(Ly, H, P), with_grad},
        {&w->X, nfl(Ly, m, D), 1}, {&w->XM, nfl(Ly, m, D), 1}, {&w->Q, nfl(Ly, m, qd), 1},
        {&w->GT, nfl(Ly, m, F), 1}, {&w->UP, nfl(Ly, m, F), 1},
        {&w->xn, nfl(1, m, D), 1}, {&w->kb, nfl(1, m, kd), 1}, {&w->vb, nfl(1, m, kd), 1},
        {&w->attn, nfl(1, m, qd), 1}, {&w->tmp, nfl(1, m, D), 1}, {&w->act, nfl(1, m, F), 1},
        {&w->qh, nfl(H, m, d), 1}, {&w->pr, nfl(H, m, len), 1}, {&w->dp, nfl(H, m, len), with_grad},
        {&w->dah, nfl(H, m, d), with_grad}, {&w->dkp, nfl(H, m, d), with_grad}, {&w->dvp, nfl(H, m, d), with_grad},
        {&w->dx, nfl(1, m, D), with_grad}, {&w->dxm, nfl(1, m, D), with_grad}, {&w->dattn, nfl(1, m, qd), with_grad},
        {&w->dq, nfl(1, m, qd), with_grad}, {&w->dk, nfl(1, m, kd), with_grad}, {&w->dv, nfl(1, m, kd), with_grad},
        {&w->dxn, nfl(1, m, D), with_grad}, {&w->da, nfl(1, m, F), with_grad}, {&w->dg, nfl(1, m, F), with_grad},
        {&w->du, nfl(1, m, F), with_grad},
    };
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
        if (!spec[i].need) continue;
        if (spec[i].n == 0) {
            work_free(w);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: judgeq workspace size overflows");
        }
        *spec[i].p = kvc_malloc(spec[i].n * sizeof(float), "judgeq workspace");
        if (!*spec[i].p) {
            work_free(w);
            return KVC_ERR_NOMEM;
        }
    }
    w->pos = kvc_malloc(sizeof(int64_t) * (size_t)m, "judgeq positions");
    w->negpos = kvc_malloc(sizeof(int64_t) * (size_t)m, "judgeq positions");
    if (!w->pos || !w->negpos) {
        work_free(w);
        return KVC_ERR_NOMEM;
    }
    for (int64_t i = 0; i < m; i++) {
        w->pos[i] = P + i;
        w->negpos[i] = -(P + i);
    }
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Soft rows: forward (storing what the backward needs) and backward                               */

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

/* C[m,n] = A[m,k] B[n,k]^T on contiguous host arrays */
static void mm(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    kvc_host_gemm_nt(a, k, b, c, n, m, n, k, 0);
}

static kvc_status soft_forward(const kvc_config *c, const kvc_host_weights *M, const pair_kv *cache, work *w,
                               const float *soft, int64_t P, int64_t m, double *loss_out, int with_grad) {
    const int32_t Ly = c->n_layers, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim, g = H / Hkv;
    const int64_t D = c->hidden, F = c->ffn, qd = (int64_t)H * d, kd = (int64_t)Hkv * d, len = P + m;
    const float scale = 1.0f / sqrtf((float)d);
    const double norm = 1.0 / ((double)Ly * H * P);
    double loss = 0.0;
    memcpy(w->X, soft, sizeof(float) * (size_t)(m * D));
    for (int32_t l = 0; l < Ly; l++) {
        const kvc_host_layer *W = &M->layers[l];
        float *x = w->X + (size_t)l * m * D, *xm = w->XM + (size_t)l * m * D, *q = w->Q + (size_t)l * m * qd;
        kvc_host_rmsnorm(x, W->attn_norm, w->xn, m, D, c->rms_eps);
        mm(w->xn, W->wq, q, m, qd, D);
        mm(w->xn, W->wk, w->kb, m, kd, D);
        mm(w->xn, W->wv, w->vb, m, kd, D);
        if (W->bq) {
            kvc_host_add_bias(q, W->bq, m, qd);
            kvc_host_add_bias(w->kb, W->bk, m, kd);
            kvc_host_add_bias(w->vb, W->bv, m, kd);
        }
        kvc_host_rope(q, w->pos, m, H, d, M->rope_inv_freq, c->rope_pairing);
        kvc_host_rope(w->kb, w->pos, m, Hkv, d, M->rope_inv_freq, c->rope_pairing);
        /* the soft rows' own K/V after the prompt's */
        for (int32_t h = 0; h < Hkv; h++)
            for (int64_t i = 0; i < m; i++) {
                memcpy(pk(cache, l, h, 0) + (P + i) * d, w->kb + i * kd + (int64_t)h * d, sizeof(float) * d);
                memcpy(pk(cache, l, h, 1) + (P + i) * d, w->vb + i * kd + (int64_t)h * d, sizeof(float) * d);
            }
        /* per-head partial sums added in head order: the loss is bitwise the same for any thread count
         * (an OpenMP reduction combines in an unspecified order; resumed training must match) */
        double head_loss[256];
        if (H > 256) return kvc_fail(KVC_ERR_UNSUPPORTED, "judgeq: more than 256 query heads");
#pragma omp parallel for schedule(dynamic, 1) num_threads(kvc_host_threads())
        for (int32_t hq = 0; hq < H; hq++) {
            double layer_loss = 0.0;
            const int32_t h = hq / g;
            float *qh = w->qh + (size_t)hq * m * d, *pr = w->pr + (size_t)hq * m * len;
            gather_head(q, H, d, hq, 0, m, qh);
            probs_rows(qh, m, pk(cache, l, h, 0), len, d, scale, P, pr);
            kvc_host_gemm_nn(pr, len, pk(cache, l, h, 1), d, w->attn + (size_t)hq * d, qd, m, d, len, 0);
            const size_t off = ((size_t)l * H + hq) * P;
            float *as = w->a_soft + off;
            const float *ar = w->a_resp + off;
            for (int64_t j = 0; j < P; j++) {
                double acc = 0.0;
                for (int64_t i = 0; i < m; i++) acc += pr[i * len + j];
                as[j] = (float)(acc / (double)m);
                const double diff = acc / (double)m - (double)ar[j];
                layer_loss += diff * diff;
                if (with_grad) w->gmap[off + j] = (float)(2.0 * diff * norm);
            }
            head_loss[hq] = layer_loss;
        }
        for (int32_t hq = 0; hq < H; hq++) loss += head_loss[hq];
        mm(w->attn, W->wo, w->tmp, m, D, qd);
        for (int64_t i = 0; i < m * D; i++) xm[i] = x[i] + w->tmp[i];
        if (l + 1 == Ly) break; /* the last MLP feeds no loss term */
        float *gt = w->GT + (size_t)l * m * F, *up = w->UP + (size_t)l * m * F;
        kvc_host_rmsnorm(xm, W->ffn_norm, w->xn, m, D, c->rms_eps);
        mm(w->xn, W->w_gate, gt, m, F, D);
        mm(w->xn, W->w_up, up, m, F, D);
        kvc_host_swiglu(gt, up, w->act, m, F);
        mm(w->act, W->w_down, w->tmp, m, D, F);
        float *xnext = w->X + (size_t)(l + 1) * m * D;
        for (int64_t i = 0; i < m * D; i++) xnext[i] = xm[i] + w->tmp[i];
    }
    *loss_out = loss * norm;
    return KVC_OK;
}

static void soft_backward(const kvc_config *c, const kvc_host_weights *M, const pair_kv *cache, work *w, int64_t P,
                          int64_t m, float *grad) {
    const int32_t Ly = c->n_layers, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim, g = H / Hkv;
    const int64_t D = c->hidden, F = c->ffn, qd = (int64_t)H * d, kd = (int64_t)Hkv * d, len = P + m;
    const float scale = 1.0f / sqrtf((float)d), inv_m = 1.0f / (float)m;
    memset(w->dx, 0, sizeof(float) * (size_t)(m * D));
    for (int32_t l = Ly - 1; l >= 0; l--) {
        const kvc_host_layer *W = &M->layers[l];
        const int top = l == Ly - 1; /* its output feeds nothing: dx = 0 */
        const float *x = w->X + (size_t)l * m * D, *xm = w->XM + (size_t)l * m * D, *q = w->Q + (size_t)l * m * qd;
        if (!top) {
            const float *gt = w->GT + (size_t)l * m * F, *up = w->UP + (size_t)l * m * F;
            kvc_host_gemm_nn(w->dx, D, W->w_down, F, w->da, F, m, F, D, 0);
            kvc_swiglu_backward(gt, up, w->da, w->dg, w->du, m * F);
            kvc_host_gemm_nn(w->dg, F, W->w_gate, D, w->dxn, D, m, D, F, 0);
            kvc_host_gemm_nn(w->du, F, W->w_up, D, w->dxn, D, m, D, F, 1);
            memcpy(w->dxm, w->dx, sizeof(float) * (size_t)(m * D));
            kvc_rmsnorm_backward(xm, W->ffn_norm, w->dxn, w->dxm, m, D, c->rms_eps, 1);
            kvc_host_gemm_nn(w->dxm, D, W->wo, qd, w->dattn, qd, m, qd, D, 0);
        } else {
            memset(w->dxm, 0, sizeof(float) * (size_t)(m * D));
            memset(w->dattn, 0, sizeof(float) * (size_t)(m * qd));
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(kvc_host_threads())
        for (int32_t hq = 0; hq < H; hq++) {
            const int32_t h = hq / g;
            const float *K = pk(cache, l, h, 0), *V = pk(cache, l, h, 1), *gm = w->gmap + ((size_t)l * H + hq) * P;
            float *qh = w->qh + (size_t)hq * m * d, *pr = w->pr + (size_t)hq * m * len;
            float *dp = w->dp + (size_t)hq * m * len, *dah = w->dah + (size_t)hq * m * d;
            float *dkp = w->dkp + (size_t)hq * m * d, *dvp = w->dvp + (size_t)hq * m * d;
            gather_head(q, H, d, hq, 0, m, qh);
            probs_rows(qh, m, K, len, d, scale, P, pr);
            gather_head(w->dattn, H, d, hq, 0, m, dah);
            if (top)
                memset(dp, 0, sizeof(float) * (size_t)(m * len));
            else
                kvc_host_gemm_nt(dah, d, V, dp, len, m, len, d, 0);
            for (int64_t i = 0; i < m; i++) {
                float *dpr = dp + i * len;
                const float *prr = pr + i * len;
                const int64_t vis = P + i + 1;
                for (int64_t j = 0; j < P; j++) dpr[j] += gm[j] * inv_m;
                double sum = 0.0;
                for (int64_t j = 0; j < vis; j++) sum += (double)prr[j] * dpr[j];
                const float sf = (float)sum;
                for (int64_t j = 0; j < vis; j++) dpr[j] = prr[j] * (dpr[j] - sf);
                for (int64_t j = vis; j < len; j++) dpr[j] = 0.f;
            }
            /* dq = scale * ds K, written straight into this head's columns of dq */
            kvc_host_gemm_nn(dp, len, K, d, w->dq + (size_t)hq * d, qd, m, d, len, 0);
            for (int64_t i = 0; i < m; i++)
                for (int32_t e = 0; e < d; e++) w->dq[i * qd + (size_t)hq * d + e] *= scale;
            /* the soft rows' own keys and values: dk[j'] = scale sum_i ds[i, P + j'] q_i,
             * dv[j'] = sum_i p[i, P + j'] dattn_i (row i sees soft row j' when j' <= i) */
            memset(dkp, 0, sizeof(float) * (size_t)(m * d));
            memset(dvp, 0, sizeof(float) * (size_t)(m * d));
            for (int64_t jp = 0; jp < m; jp++) {
                float *dkr = dkp + jp * d, *dvr = dvp + jp * d;
                for (int64_t i = jp; i < m; i++) {
                    const float a = scale * dp[i * len + P + jp], b = pr[i * len + P + jp];
                    const float *qi = qh + i * d, *di = dah + i * d;
#pragma omp simd
                    for (int32_t e = 0; e < d; e++) {
                        dkr[e] += a * qi[e];
                        dvr[e] += b * di[e];
                    }
                }
            }
        }
        /* reduce the query heads of each group onto their KV head */
        for (int64_t i = 0; i < m; i++)
            for (int32_t h = 0; h < Hkv; h++) {
                float *dkr = w->dk + i * kd + (size_t)h * d, *dvr = w->dv + i * kd + (size_t)h * d;
                memset(dkr, 0, sizeof(float) * d);
                memset(dvr, 0, sizeof(float) * d);
                for (int32_t hq = h * g; hq < (h + 1) * g; hq++) {
                    const float *a = w->dkp + ((size_t)hq * m + i) * d, *b = w->dvp + ((size_t)hq * m + i) * d;
                    for (int32_t e = 0; e < d; e++) {
                        dkr[e] += a[e];
                        dvr[e] += b[e];
                    }
                }
            }
        /* RoPE is a rotation: its transpose rotates by the opposite angle */
        kvc_host_rope(w->dq, w->negpos, m, H, d, M->rope_inv_freq, c->rope_pairing);
        kvc_host_rope(w->dk, w->negpos, m, Hkv, d, M->rope_inv_freq, c->rope_pairing);
        kvc_host_gemm_nn(w->dq, qd, W->wq, D, w->dxn, D, m, D, qd, 0);
        kvc_host_gemm_nn(w->dk, kd, W->wk, D, w->dxn, D, m, D, kd, 1);
        kvc_host_gemm_nn(w->dv, kd, W->wv, D, w->dxn, D, m, D, kd, 1);
        memcpy(w->dx, w->dxm, sizeof(float) * (size_t)(m * D));
        kvc_rmsnorm_backward(x, W->attn_norm, w->dxn, w->dx, m, D, c->rms_eps, 1);
    }
    memcpy(grad, w->dx, sizeof(float) * (size_t)(m * D));
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
    if (st == KVC_OK) {
        s->hook = resp_hook;
        s->hook_user = &rc;
        st = kvc_forward_ex(s, ids, lenr, NULL, 0, KVC_ROW_NONE, NULL);
        s->hook = NULL;
        s->hook_user = NULL;
    }
    for (int32_t l = 0; l < c->n_layers && st == KVC_OK; l++)
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
            st = s->be->kv_read(s->cache.layers[l].kv, h, 0, P, pk(&pair->cache, l, h, 0), pk(&pair->cache, l, h, 1));
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
    /* the hand-written backward below is the Llama layer's: it has no q/k norm and no window mask */
    if (c->qk_norm || c->sliding_window)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "judgeq: training soft tokens on a model with %s is not implemented (its backward "
                        "pass is Llama's); train on a Llama/Mistral/Qwen2 model without a sliding window",
                        c->qk_norm ? "per-head q/k norms (qwen3)" : "sliding-window attention");
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
    const int with_grad = grad != NULL;
    work w;
    kvc_status st = room_for(pair, m);
    if (st == KVC_OK) st = work_alloc(&w, c, P, m, with_grad);
    if (st == KVC_OK) {
        w.a_resp = pair->a_resp;
        double L = 0.0;
        st = soft_forward(c, pair->hw, &pair->cache, &w, soft, P, m, &L, with_grad);
        if (st == KVC_OK) {
            if (with_grad) soft_backward(c, pair->hw, &pair->cache, &w, P, m, grad);
            *loss = L;
            const size_t nmap = (size_t)c->n_layers * c->n_heads * (size_t)P;
            if (soft_maps) memcpy(soft_maps, w.a_soft, sizeof(float) * nmap);
            if (response_maps) memcpy(response_maps, pair->a_resp, sizeof(float) * nmap);
        }
        work_free(&w);
    }
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
