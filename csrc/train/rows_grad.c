/* The host forward and backward of m rows over a cached prefix (rows_grad.h): the decoder layer of
 * engine/forward.c written again on host arrays, and its hand-written backward.
 *
 * Forward per layer, rows x [m, D]:
 *   xn = rmsnorm(x); q, k, v = xn Wq, xn Wk, xn Wv (+ bias, + LoRA); q/k per-head rmsnorm (qwen3); RoPE;
 *   per query head: p = softmax(q K^T / sqrt(d)) over the prefix and the causal own rows, attn = p V;
 *   xm = x + attn Wo; x' = xm + down(silu(xm' Wg) * xm' Wu), xm' = rmsnorm(xm).
 * Backward, with dx the gradient of the layer's output:
 *   MLP:  da = dx Wd, (dg, du) = swiglu', dxn2 = dg Wg + du Wu, dxm = dx + rmsnorm'(xm) dxn2
 *   attn: dattn = dxm Wo; per query head: dp = dattn V^T (+ the objective's d/dp),
 *         ds = p (dp - sum_j p dp); dq = scale ds K; dk_own += scale ds^T q; dv_own += p^T dattn
 *   RoPE: rotation by the opposite angle; q/k norm: rmsnorm' per head;
 *   dxn = dq Wq + dk Wk + dv Wv; dx = dxm + rmsnorm'(x) dxn
 * The prefix's K/V are constants. Everything runs in fp32 (sums in double). */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "../core/hostmath.h"
#include "../core/press_i.h"
#include "rows_grad.h"

#define ROWS_MAX_HEADS 256 /* query heads of the per-head terms kept on the stack */

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

/* kvc_host_probs_rows fed in blocks, so the visibility list stays on the stack */
void kvc_rows_causal_probs(const float *q, int64_t m, const float *k, int64_t len, int32_t d, float scale, int64_t past,
                           float *p) {
    enum { BLOCK = 256 };
    int64_t visible[BLOCK];
    for (int64_t i0 = 0; i0 < m; i0 += BLOCK) {
        const int64_t mb = imin64(BLOCK, m - i0);
        for (int64_t i = 0; i < mb; i++) visible[i] = past + i0 + i + 1;
        kvc_host_probs_rows(q + i0 * d, mb, k, len, d, scale, visible, p + i0 * len);
    }
}

void kvc_rows_gather_head(const float *x, int32_t H, int32_t d, int32_t hq, int64_t m, float *dst) {
    for (int64_t i = 0; i < m; i++) memcpy(dst + i * d, x + (i * H + hq) * d, sizeof(float) * d);
}

/* C[m,n] = A[m,k] B[n,k]^T on contiguous host arrays */
static void mm(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    kvc_host_gemm_nt(a, k, b, c, n, m, n, k, 0);
}

kvc_status kvc_rows_check_model(const kvc_config *c, int64_t last_pos, const char *who) {
    if (c->sliding_window > 0 && c->window_first_layer < c->n_layers && last_pos >= c->sliding_window)
        return kvc_fail(KVC_ERR_UNSUPPORTED,
                        "%s: the host forward/backward has no sliding-window mask, and this model's window of %d "
                        "positions (from layer %d) is shorter than the %lld positions it would span; use a model without "
                        "a sliding window (Llama, Qwen2/Qwen3 without use_sliding_window) or a shorter context",
                        who, c->sliding_window, c->window_first_layer, (long long)last_pos + 1);
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Workspace                                                                                        */

struct kvc_rows {
    const kvc_config *c;
    const kvc_host_weights *M;
    int64_t P, m;
    int with_grad, nthreads, lora_used;
    int64_t *pos, *negpos;
    /* per layer (X has n_layers + 1 entries: the last is the model's output when the last MLP runs) */
    float *X, *XM, *Q, *KO, *VO, *GT, *UP, *QR, *KR;
    /* forward scratch */
    float *xn, *attn, *tmp, *act;
    /* per thread: a head's queries, probabilities, their gradient, its attention gradient */
    float *qh, *pr, *dp, *dah;
    /* per query head: the gradients of the own rows' K and V */
    float *dkp, *dvp;
    /* backward */
    float *dx, *dxm, *dattn, *dq, *dk, *dv, *dxn, *da, *dg, *du, *dqn, *dkn;
};

void kvc_rows_free(kvc_rows *r) {
    if (!r) return;
    float *list[] = {r->X, r->XM, r->Q, r->KO, r->VO, r->GT, r->UP, r->QR, r->KR, r->xn, r->attn, r->tmp, r->act,
                     r->qh, r->pr, r->dp, r->dah, r->dkp, r->dvp, r->dx, r->dxm, r->dattn, r->dq, r->dk, r->dv,
                     r->dxn, r->da, r->dg, r->du, r->dqn, r->dkn};
    for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) kvc_free(list[i]);
    kvc_free(r->pos);
    kvc_free(r->negpos);
    free(r);
}

/* floats of a buffer of a * b * c elements, or 0 on overflow */
static size_t nfl(size_t a, size_t b, size_t c) {
    size_t ab, abc;
    if (kvc_mul_ok(a, b, &ab) || kvc_mul_ok(ab, c, &abc) || abc > SIZE_MAX / 8) return 0;
    return abc;
}

kvc_status kvc_rows_new(const kvc_config *c, const kvc_host_weights *M, int64_t P, int64_t m, int with_grad,
                        kvc_rows **out) {
    *out = NULL;
    if (P < 0 || m < 1) return kvc_fail(KVC_ERR_ARG, "rows pass: %lld rows over a prefix of %lld", (long long)m, (long long)P);
    kvc_rows *r = calloc(1, sizeof *r);
    if (!r) return kvc_fail(KVC_ERR_NOMEM, "out of memory: rows pass");
    r->c = c;
    r->M = M;
    r->P = P;
    r->m = m;
    r->with_grad = with_grad;
    r->nthreads = kvc_host_threads() > 0 ? kvc_host_threads() : 1;
    const size_t Ly = c->n_layers, H = c->n_heads, D = c->hidden, F = c->ffn, d = c->head_dim, T = r->nthreads;
    const size_t qd = H * d, kd = (size_t)c->n_kv_heads * d, len = (size_t)(P + m), M_ = (size_t)m;
    const int g = with_grad, qn = with_grad && c->qk_norm;
    struct {
        float **p;
        size_t n;
        int need;
    } spec[] = {
        {&r->X, nfl(Ly + 1, M_, D), 1}, {&r->XM, nfl(Ly, M_, D), 1}, {&r->Q, nfl(Ly, M_, qd), 1},
        {&r->KO, nfl(Ly, M_, kd), 1}, {&r->VO, nfl(Ly, M_, kd), 1},
        {&r->GT, nfl(Ly, M_, F), 1}, {&r->UP, nfl(Ly, M_, F), 1}, {&r->QR, nfl(Ly, M_, qd), qn}, {&r->KR, nfl(Ly, M_, kd), qn},
        {&r->xn, nfl(1, M_, D), 1}, {&r->attn, nfl(1, M_, qd), 1}, {&r->tmp, nfl(1, M_, D), 1}, {&r->act, nfl(1, M_, F), 1},
        {&r->qh, nfl(T, M_, d), 1}, {&r->pr, nfl(T, M_, len), 1}, {&r->dp, nfl(T, M_, len), g}, {&r->dah, nfl(T, M_, d), g},
        {&r->dkp, nfl(H, M_, d), g}, {&r->dvp, nfl(H, M_, d), g},
        {&r->dx, nfl(1, M_, D), g}, {&r->dxm, nfl(1, M_, D), g}, {&r->dattn, nfl(1, M_, qd), g},
        {&r->dq, nfl(1, M_, qd), g}, {&r->dk, nfl(1, M_, kd), g}, {&r->dv, nfl(1, M_, kd), g},
        {&r->dxn, nfl(1, M_, D), g}, {&r->da, nfl(1, M_, F), g}, {&r->dg, nfl(1, M_, F), g}, {&r->du, nfl(1, M_, F), g},
        {&r->dqn, nfl(1, M_, qd), qn}, {&r->dkn, nfl(1, M_, kd), qn},
    };
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
        if (!spec[i].need) continue;
        if (spec[i].n == 0) {
            kvc_rows_free(r);
            return kvc_fail(KVC_ERR_NOMEM, "out of memory: the rows pass's workspace size overflows");
        }
        if (!(*spec[i].p = kvc_malloc(spec[i].n * sizeof(float), "rows pass workspace"))) {
            kvc_rows_free(r);
            return KVC_ERR_NOMEM;
        }
    }
    r->pos = kvc_malloc(sizeof(int64_t) * M_, "rows pass positions");
    r->negpos = kvc_malloc(sizeof(int64_t) * M_, "rows pass positions");
    if (!r->pos || !r->negpos) {
        kvc_rows_free(r);
        return KVC_ERR_NOMEM;
    }
    *out = r;
    return KVC_OK;
}

void kvc_rows_own_kv(const kvc_rows *r, int32_t l, const float **k, const float **v) {
    const size_t kd = (size_t)r->c->n_kv_heads * r->c->head_dim;
    *k = r->KO + (size_t)l * r->m * kd;
    *v = r->VO + (size_t)l * r->m * kd;
}

/* Layer l's prefix with the rows' own K/V copied after it. */
static kvc_status load_layer(const kvc_rows *r, const kvc_rows_prefix *pre, int32_t l, float **k, float **v) {
    const int32_t Hkv = r->c->n_kv_heads, d = r->c->head_dim;
    const int64_t P = r->P, m = r->m, kd = (int64_t)Hkv * d;
    KVC_TRY(pre->layer(pre->user, l, k, v));
    const float *ko = r->KO + (size_t)l * m * kd, *vo = r->VO + (size_t)l * m * kd;
    for (int32_t h = 0; h < Hkv; h++)
        for (int64_t i = 0; i < m; i++) {
            memcpy(k[h] + (P + i) * d, ko + i * kd + (int64_t)h * d, sizeof(float) * d);
            memcpy(v[h] + (P + i) * d, vo + i * kd + (int64_t)h * d, sizeof(float) * d);
        }
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Forward                                                                                          */

/* y[m, out] += scale (x A^T) B^T: a projection's LoRA (tmp [m, r]) */
static void lora_add(const kvc_lora_mat *L, const float *x, int64_t m, int64_t in, float *y, int64_t out, float *tmp) {
    if (!L || L->r == 0) return;
    kvc_host_gemm_nt(x, in, L->a, tmp, L->r, m, L->r, in, 0);
    for (int64_t i = 0; i < m * L->r; i++) tmp[i] *= L->scale;
    kvc_host_gemm_nt(tmp, L->r, L->b, y, out, m, out, L->r, 1);
}

static const kvc_lora_mat *lora_at(const struct kvc_lora *lora, int32_t l, int t) {
    return lora ? &lora->mats[(size_t)l * KVC_LORA_N + t] : NULL;
}

/* q, k, v of layer l from its input rows: projections, bias, LoRA, q/k norm, RoPE. */
static void qkv_forward(kvc_rows *r, int32_t l, const struct kvc_lora *lora, float *lora_tmp) {
    const kvc_config *c = r->c;
    const kvc_host_layer *W = &r->M->layers[l];
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t m = r->m, D = c->hidden, qd = (int64_t)H * d, kd = (int64_t)Hkv * d;
    const float *x = r->X + (size_t)l * m * D;
    float *q = r->Q + (size_t)l * m * qd, *kb = r->KO + (size_t)l * m * kd, *vb = r->VO + (size_t)l * m * kd;
    kvc_host_rmsnorm(x, W->attn_norm, r->xn, m, D, c->rms_eps);
    mm(r->xn, W->wq, q, m, qd, D);
    mm(r->xn, W->wk, kb, m, kd, D);
    mm(r->xn, W->wv, vb, m, kd, D);
    if (W->bq) {
        kvc_host_add_bias(q, W->bq, m, qd);
        kvc_host_add_bias(kb, W->bk, m, kd);
        kvc_host_add_bias(vb, W->bv, m, kd);
    }
    lora_add(lora_at(lora, l, KVC_LORA_Q), r->xn, m, D, q, qd, lora_tmp);
    lora_add(lora_at(lora, l, KVC_LORA_K), r->xn, m, D, kb, kd, lora_tmp);
    lora_add(lora_at(lora, l, KVC_LORA_V), r->xn, m, D, vb, kd, lora_tmp);
    if (W->q_norm) { /* qwen3: each head normalised before RoPE (the raw rows kept for the backward) */
        if (r->QR) {
            memcpy(r->QR + (size_t)l * m * qd, q, sizeof(float) * (size_t)(m * qd));
            memcpy(r->KR + (size_t)l * m * kd, kb, sizeof(float) * (size_t)(m * kd));
        }
        kvc_host_head_rmsnorm(q, m, H, d, W->q_norm, c->rms_eps);
        kvc_host_head_rmsnorm(kb, m, Hkv, d, W->k_norm, c->rms_eps);
    }
    const kvc_rope_rule rope = kvc_model_rope(r->M->rope, l, r->pos[m - 1] + 1); /* as the forward turns them */
    kvc_host_rope(q, r->pos, m, H, d, rope.host, c->rope_pairing, rope.mscale);
    kvc_host_rope(kb, r->pos, m, Hkv, d, rope.host, c->rope_pairing, rope.mscale);
}

/* attn = softmax(q K^T) V per query head; the objective's head terms added to *total in head order (the value is
 * then the same for any thread count). */
static void attention_forward(kvc_rows *r, int32_t l, float *const *K, float *const *V, const kvc_rows_objective *obj,
                              double *total) {
    const kvc_config *c = r->c;
    const int32_t H = c->n_heads, g = H / c->n_kv_heads, d = c->head_dim;
    const int64_t m = r->m, P = r->P, len = P + m, qd = (int64_t)H * d;
    const float scale = 1.0f / sqrtf((float)d), *q = r->Q + (size_t)l * m * qd;
    double head_term[ROWS_MAX_HEADS];
#pragma omp parallel for schedule(dynamic, 1) num_threads(r->nthreads)
    for (int32_t hq = 0; hq < H; hq++) {
        const int t = omp_get_thread_num();
        float *qh = r->qh + (size_t)t * m * d, *pr = r->pr + (size_t)t * m * len;
        kvc_rows_gather_head(q, H, d, hq, m, qh);
        kvc_rows_causal_probs(qh, m, K[hq / g], len, d, scale, P, pr);
        kvc_host_gemm_nn(pr, len, V[hq / g], d, r->attn + (size_t)hq * d, qd, m, d, len, 0);
        head_term[hq] = obj && obj->head_probs ? obj->head_probs(obj->user, l, hq, pr, len) : 0.0;
    }
    for (int32_t hq = 0; hq < H; hq++) *total += head_term[hq];
}

kvc_status kvc_rows_forward(kvc_rows *r, const kvc_rows_prefix *pre, const kvc_rows_objective *obj,
                            const struct kvc_lora *lora, const float *x0, const int64_t *pos, double *value) {
    const kvc_config *c = r->c;
    const int32_t Ly = c->n_layers, H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t m = r->m, D = c->hidden, F = c->ffn, qd = (int64_t)H * d;
    if (H > ROWS_MAX_HEADS || Hkv > KVC_MAX_KV_HEADS)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "rows pass: more than %d query heads", ROWS_MAX_HEADS);
    if (pre->P != r->P) return kvc_fail(KVC_ERR_INTERNAL, "rows pass: prefix of %lld rows, workspace for %lld",
                                        (long long)pre->P, (long long)r->P);
    int32_t max_r = 0;
    for (size_t i = 0; lora && i < (size_t)Ly * KVC_LORA_N; i++) max_r = lora->mats[i].r > max_r ? lora->mats[i].r : max_r;
    float *lora_tmp = max_r ? kvc_malloc(sizeof(float) * (size_t)m * max_r, "LoRA scratch") : NULL;
    if (max_r && !lora_tmp) return KVC_ERR_NOMEM;
    r->lora_used = max_r > 0;
    for (int64_t i = 0; i < m; i++) {
        r->pos[i] = pos[i];
        r->negpos[i] = -pos[i];
    }
    const int last_mlp = obj && obj->last_mlp;
    double total = 0.0;
    kvc_status st = KVC_OK;
    float *K[KVC_MAX_KV_HEADS], *V[KVC_MAX_KV_HEADS];
    memcpy(r->X, x0, sizeof(float) * (size_t)(m * D));
    for (int32_t l = 0; l < Ly && st == KVC_OK; l++) {
        const kvc_host_layer *W = &r->M->layers[l];
        float *x = r->X + (size_t)l * m * D, *xm = r->XM + (size_t)l * m * D;
        qkv_forward(r, l, lora, lora_tmp);
        if ((st = load_layer(r, pre, l, K, V)) != KVC_OK) break;
        attention_forward(r, l, K, V, obj, &total);
        mm(r->attn, W->wo, r->tmp, m, D, qd);
        lora_add(lora_at(lora, l, KVC_LORA_O), r->attn, m, qd, r->tmp, D, lora_tmp);
        for (int64_t i = 0; i < m * D; i++) xm[i] = x[i] + r->tmp[i];
        if (l + 1 == Ly && !last_mlp) break; /* nothing reads the last MLP */
        float *gt = r->GT + (size_t)l * m * F, *up = r->UP + (size_t)l * m * F;
        kvc_host_rmsnorm(xm, W->ffn_norm, r->xn, m, D, c->rms_eps);
        mm(r->xn, W->w_gate, gt, m, F, D);
        mm(r->xn, W->w_up, up, m, F, D);
        lora_add(lora_at(lora, l, KVC_LORA_GATE), r->xn, m, D, gt, F, lora_tmp);
        lora_add(lora_at(lora, l, KVC_LORA_UP), r->xn, m, D, up, F, lora_tmp);
        kvc_host_swiglu(gt, up, r->act, m, F);
        mm(r->act, W->w_down, r->tmp, m, D, F);
        lora_add(lora_at(lora, l, KVC_LORA_DOWN), r->act, m, F, r->tmp, D, lora_tmp);
        float *xnext = r->X + (size_t)(l + 1) * m * D;
        for (int64_t i = 0; i < m * D; i++) xnext[i] = xm[i] + r->tmp[i];
    }
    kvc_free(lora_tmp);
    if (st != KVC_OK) return st;
    if (obj && obj->output) {
        const float *out = last_mlp ? r->X + (size_t)Ly * m * D : r->XM + (size_t)(Ly - 1) * m * D;
        total += obj->output(obj->user, out, m, D, r->with_grad ? r->dx : NULL);
    } else if (r->with_grad) {
        memset(r->dx, 0, sizeof(float) * (size_t)(m * D));
    }
    if (value) *value = total;
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward                                                                                         */

/* dxm from dx through layer l's MLP (dx: the gradient of the layer's output). */
static void mlp_backward(kvc_rows *r, int32_t l) {
    const kvc_config *c = r->c;
    const kvc_host_layer *W = &r->M->layers[l];
    const int64_t m = r->m, D = c->hidden, F = c->ffn;
    const float *xm = r->XM + (size_t)l * m * D, *gt = r->GT + (size_t)l * m * F, *up = r->UP + (size_t)l * m * F;
    kvc_host_gemm_nn(r->dx, D, W->w_down, F, r->da, F, m, F, D, 0);
    kvc_swiglu_backward(gt, up, r->da, r->dg, r->du, m * F);
    kvc_host_gemm_nn(r->dg, F, W->w_gate, D, r->dxn, D, m, D, F, 0);
    kvc_host_gemm_nn(r->du, F, W->w_up, D, r->dxn, D, m, D, F, 1);
    memcpy(r->dxm, r->dx, sizeof(float) * (size_t)(m * D));
    kvc_rmsnorm_backward(xm, W->ffn_norm, r->dxn, r->dxm, m, D, c->rms_eps, 1);
}

/* dq [m, H d] and the own rows' dk, dv [m, Hkv d] from dattn (zero: only the objective's d/dp). */
static void attention_backward(kvc_rows *r, int32_t l, float *const *K, float *const *V, const kvc_rows_objective *obj,
                               int zero) {
    const kvc_config *c = r->c;
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, g = H / Hkv, d = c->head_dim;
    const int64_t m = r->m, P = r->P, len = P + m, qd = (int64_t)H * d, kd = (int64_t)Hkv * d;
    const float scale = 1.0f / sqrtf((float)d), *q = r->Q + (size_t)l * m * qd;
#pragma omp parallel for schedule(dynamic, 1) num_threads(r->nthreads)
    for (int32_t hq = 0; hq < H; hq++) {
        const int t = omp_get_thread_num();
        const int32_t h = hq / g;
        float *qh = r->qh + (size_t)t * m * d, *pr = r->pr + (size_t)t * m * len;
        float *dp = r->dp + (size_t)t * m * len, *dah = r->dah + (size_t)t * m * d;
        float *dkp = r->dkp + (size_t)hq * m * d, *dvp = r->dvp + (size_t)hq * m * d;
        kvc_rows_gather_head(q, H, d, hq, m, qh);
        kvc_rows_causal_probs(qh, m, K[h], len, d, scale, P, pr);
        kvc_rows_gather_head(r->dattn, H, d, hq, m, dah);
        if (zero)
            memset(dp, 0, sizeof(float) * (size_t)(m * len));
        else
            kvc_host_gemm_nt(dah, d, V[h], dp, len, m, len, d, 0);
        if (obj && obj->head_dprobs) obj->head_dprobs(obj->user, l, hq, dp, len);
        for (int64_t i = 0; i < m; i++) {
            float *dpr = dp + i * len;
            const float *prr = pr + i * len;
            const int64_t vis = P + i + 1;
            double sum = 0.0;
            for (int64_t j = 0; j < vis; j++) sum += (double)prr[j] * dpr[j];
            const float sf = (float)sum;
            for (int64_t j = 0; j < vis; j++) dpr[j] = prr[j] * (dpr[j] - sf);
            for (int64_t j = vis; j < len; j++) dpr[j] = 0.f;
        }
        /* dq = scale * ds K, written straight into this head's columns of dq */
        kvc_host_gemm_nn(dp, len, K[h], d, r->dq + (size_t)hq * d, qd, m, d, len, 0);
        for (int64_t i = 0; i < m; i++)
            for (int32_t e = 0; e < d; e++) r->dq[i * qd + (size_t)hq * d + e] *= scale;
        /* the own rows' keys and values: dk[j'] = scale sum_i ds[i, P + j'] q_i,
         * dv[j'] = sum_i p[i, P + j'] dattn_i (row i sees own row j' when j' <= i) */
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
            float *dkr = r->dk + i * kd + (size_t)h * d, *dvr = r->dv + i * kd + (size_t)h * d;
            memset(dkr, 0, sizeof(float) * d);
            memset(dvr, 0, sizeof(float) * d);
            for (int32_t hq = h * g; hq < (h + 1) * g; hq++) {
                const float *a = r->dkp + ((size_t)hq * m + i) * d, *b = r->dvp + ((size_t)hq * m + i) * d;
                for (int32_t e = 0; e < d; e++) {
                    dkr[e] += a[e];
                    dvr[e] += b[e];
                }
            }
        }
}

/* dx of layer l's input from dq, dk, dv and dxm: RoPE and q/k norm undone, the projections, the norm. */
static void qkv_backward(kvc_rows *r, int32_t l) {
    const kvc_config *c = r->c;
    const kvc_host_layer *W = &r->M->layers[l];
    const int32_t H = c->n_heads, Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t m = r->m, D = c->hidden, qd = (int64_t)H * d, kd = (int64_t)Hkv * d;
    /* RoPE is a rotation (times LongRoPE's factor): its transpose rotates by the opposite angle */
    const kvc_rope_rule rope = kvc_model_rope(r->M->rope, l, r->pos[m - 1] + 1);
    kvc_host_rope(r->dq, r->negpos, m, H, d, rope.host, c->rope_pairing, rope.mscale);
    kvc_host_rope(r->dk, r->negpos, m, Hkv, d, rope.host, c->rope_pairing, rope.mscale);
    const float *dq = r->dq, *dk = r->dk;
    if (W->q_norm) {
        kvc_rmsnorm_backward(r->QR + (size_t)l * m * qd, W->q_norm, r->dq, r->dqn, m * H, d, c->rms_eps, 0);
        kvc_rmsnorm_backward(r->KR + (size_t)l * m * kd, W->k_norm, r->dk, r->dkn, m * Hkv, d, c->rms_eps, 0);
        dq = r->dqn;
        dk = r->dkn;
    }
    kvc_host_gemm_nn(dq, qd, W->wq, D, r->dxn, D, m, D, qd, 0);
    kvc_host_gemm_nn(dk, kd, W->wk, D, r->dxn, D, m, D, kd, 1);
    kvc_host_gemm_nn(r->dv, kd, W->wv, D, r->dxn, D, m, D, kd, 1);
    memcpy(r->dx, r->dxm, sizeof(float) * (size_t)(m * D));
    kvc_rmsnorm_backward(r->X + (size_t)l * m * D, W->attn_norm, r->dxn, r->dx, m, D, c->rms_eps, 1);
}

kvc_status kvc_rows_backward(kvc_rows *r, const kvc_rows_prefix *pre, const kvc_rows_objective *obj, float *grad) {
    const kvc_config *c = r->c;
    const int32_t Ly = c->n_layers, d = c->head_dim;
    const int64_t m = r->m, D = c->hidden, qd = (int64_t)c->n_heads * d;
    if (!r->with_grad) return kvc_fail(KVC_ERR_INTERNAL, "rows pass: a backward on a forward-only workspace");
    if (r->lora_used) return kvc_fail(KVC_ERR_UNSUPPORTED, "rows pass: no backward through LoRA adapters");
    const int last_mlp = obj && obj->last_mlp, top_zero = !(obj && obj->output);
    float *K[KVC_MAX_KV_HEADS], *V[KVC_MAX_KV_HEADS];
    for (int32_t l = Ly - 1; l >= 0; l--) {
        const kvc_host_layer *W = &r->M->layers[l];
        const int top = l == Ly - 1, zero = top && !last_mlp && top_zero;
        KVC_TRY(load_layer(r, pre, l, K, V));
        if (!top || last_mlp) {
            mlp_backward(r, l);
        } else if (zero) { /* the objective reads nothing after this layer's attention probabilities */
            memset(r->dxm, 0, sizeof(float) * (size_t)(m * D));
        } else {
            memcpy(r->dxm, r->dx, sizeof(float) * (size_t)(m * D));
        }
        if (zero)
            memset(r->dattn, 0, sizeof(float) * (size_t)(m * qd));
        else
            kvc_host_gemm_nn(r->dxm, D, W->wo, qd, r->dattn, qd, m, qd, D, 0);
        if (obj && obj->resid_grad) {
            const kvc_rows_layer view = {l, r->P, m, r->Q + (size_t)l * m * qd, K, V};
            KVC_TRY(obj->resid_grad(obj->user, &view, r->dxm));
        }
        if (l == 0 && !grad) break; /* nobody reads the input's gradient */
        attention_backward(r, l, K, V, obj, zero);
        qkv_backward(r, l);
    }
    if (grad) memcpy(grad, r->dx, sizeof(float) * (size_t)(m * D));
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* A prefix read from a session's cache                                                              */

static kvc_status session_layer(void *user, int32_t l, float **k, float **v) {
    kvc_session_prefix *p = user;
    kvc_session *s = p->s;
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t Hkv = c->n_kv_heads, d = c->head_dim;
    const int64_t P = p->pre.P, rows = P + p->m;
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[l];
    kvc_status st = KVC_OK;
    const kvc_backend *be = kvc_door_backend(s);
    kvc_backend_lock(be);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        k[h] = p->block + ((size_t)h * 2) * (size_t)rows * d;
        v[h] = p->block + ((size_t)h * 2 + 1) * (size_t)rows * d;
        if (L->len[h] < P)
            st = kvc_fail(KVC_ERR_INTERNAL, "rows pass: layer %d head %d holds %lld rows, not %lld", l, h,
                          (long long)L->len[h], (long long)P);
        else if (P > 0)
            st = be->kv_read(L->kv, h, 0, P, k[h], v[h]);
    }
    kvc_backend_unlock(be);
    return st;
}

kvc_status kvc_session_prefix_init(kvc_session_prefix *p, kvc_session *s, int64_t P, int64_t m) {
    memset(p, 0, sizeof *p);
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const size_t n = nfl((size_t)c->n_kv_heads * 2, (size_t)(P + m), (size_t)c->head_dim);
    if (!n) return kvc_fail(KVC_ERR_NOMEM, "out of memory: the prefix's size overflows");
    if (!(p->block = kvc_malloc(n * sizeof(float), "rows pass prefix K/V"))) return KVC_ERR_NOMEM;
    p->pre = (kvc_rows_prefix){P, session_layer, p};
    p->s = s;
    p->m = m;
    return KVC_OK;
}

void kvc_session_prefix_free(kvc_session_prefix *p) {
    kvc_free(p->block);
    p->block = NULL;
}
