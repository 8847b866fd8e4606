/* The scoring entries of the CUDA table (core/backend.h): a layer's scores on the device (the kernels
 * of score.cu, composed as the CPU scorers of backend/cpu/score.c compute them), per-head top-k, and
 * TADA's residual cosines. The schedule that calls them is the core's (press/). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

namespace kvc {

static Buf g_att, g_stats, g_rows, g_topk_tmp, g_dsum; /* scratch, serialised by the core's device lock */

/* The last w queries of the call score the rows before them: window query j (row len - w + j) sees
 * rows < len - w + j + 1, rows < len - w are scored; the scratch for the window passes is sized. */
static kvc_status window_setup(HeadInfo &hi, int32_t H, int32_t Hkv, int64_t w, int64_t n, int64_t maxlen) {
    if (w > n) return fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%lld)",
                           (long long)n, (long long)w);
    for (int32_t h = 0; h < Hkv; h++) {
        hi.n_acc[h] = hi.len[h] - w;
        hi.vstart[h] = hi.len[h] - w;
        hi.vlimit[h] = hi.len[h];
    }
    KVC_TRY(scratch(g_att, sizeof(float) * (size_t)H * maxlen, "press window attention"));
    return scratch(g_stats, sizeof(float) * window_stats_floats(H, w, maxlen), "press softmax statistics");
}

kvc_status score(const kvc_score_args *a) {
    const kvc_kv *kv = a->kv;
    const int32_t H = a->H, Hkv = a->Hkv, d = a->d;
    const float scale = 1.0f / sqrtf((float)d);
    HeadInfo hi;
    memset(&hi, 0, sizeof hi);
    int64_t maxlen = 1;
    const bf16 *kfull[KVC_MAX_KV], *vfull[KVC_MAX_KV];
    bf16 **ktab = nullptr;
    if (kv->typed) KVC_TRY(kvt_rows_bf16(kv, kfull, vfull)); /* rows of a typed store decoded, as kv_read gives them */
    else if (kv->dk) KVC_TRY(kv_keys_full(kv, kfull, &ktab)); /* ThinK-pruned rows, expanded as kv_read gives them */
    for (int32_t h = 0; h < Hkv; h++) {
        hi.k[h] = kv->typed || kv->dk ? kfull[h] : kv->kh[h];
        hi.v[h] = kv->typed ? vfull[h] : kv->vh[h];
        hi.len[h] = hi.n_acc[h] = hi.vlimit[h] = a->len[h];
        maxlen = a->len[h] > maxlen ? a->len[h] : maxlen;
    }
    float *scores = at<float>(a->scores);
    const int64_t lds = a->scores.ld;
    const int q_f32 = a->q.buf && a->q.buf->dtype == KVC_F32;
    const size_t qes = q_f32 ? sizeof(float) : sizeof(bf16);
    switch (a->scorer) {
    case KVC_SCORE_KNORM:
        return score_knorm(hi, Hkv, d, scores, lds);
    case KVC_SCORE_STREAMING:
        return score_streaming(hi, Hkv, a->n_sink, scores, lds);
    case KVC_SCORE_RANDOM:
        return score_random(hi, Hkv, a->seed, a->layer, scores, lds);
    case KVC_SCORE_SNAPKV:
    case KVC_SCORE_TOVA: {
        const int tova = a->scorer == KVC_SCORE_TOVA;
        const int64_t w = tova ? 1 : a->window;
        if (tova)
            for (int32_t h = 1; h < Hkv; h++)
                if (hi.len[h] != hi.len[0]) return fail(KVC_ERR_ARG, "TOVA needs every head of a layer to hold the same tokens");
        KVC_TRY(window_setup(hi, H, Hkv, w, a->n, maxlen));
        const char *q = at<char>(a->q) + (size_t)(a->n - w) * a->q.ld * qes;
        KVC_TRY(window_attention(q, q_f32, a->q.ld, w, H, Hkv, d, hi, scale, g_att.as<float>(), maxlen, g_stats.as<float>()));
        KVC_TRY(pool_reduce(g_att.as<float>(), maxlen, H, Hkv, hi, tova ? 1 : a->kernel, a->pool_max, a->gqa_max,
                            a->pool_then_reduce, tova, scores, lds));
        return protect_tail(scores, lds, Hkv, hi);
    }
    case KVC_SCORE_EDIE: {
        const int64_t w = a->window;
        if (!a->attn.buf) return fail(KVC_ERR_ARG, "EDIE needs the attention outputs of the window queries");
        if (q_f32 || a->attn.buf->dtype != KVC_BF16) return fail(KVC_ERR_INTERNAL, "EDIE: queries and outputs must be bf16");
        KVC_TRY(window_setup(hi, H, Hkv, w, a->n, maxlen));
        KVC_TRY(edie_attention(at<bf16>(a->q) + (a->n - w) * a->q.ld, a->q.ld, at<bf16>(a->attn) + (a->n - w) * a->attn.ld,
                               a->attn.ld, w, H, Hkv, d, hi, scale, a->edie_alpha, g_att.as<float>(), maxlen,
                               g_stats.as<float>()));
        /* group sum (edie_attention scaled by the group size), then mean pooling counting padding */
        KVC_TRY(pool_reduce(g_att.as<float>(), maxlen, H, Hkv, hi, a->kernel, 0, 0, 0, 0, scores, lds));
        return protect_tail(scores, lds, Hkv, hi);
    }
    case KVC_SCORE_PROBE: {
        /* TAKE's probes see every row given (hi.vstart = vlimit = len), nothing after */
        for (int32_t h = 0; h < Hkv; h++) hi.vstart[h] = hi.len[h];
        KVC_TRY(scratch(g_att, sizeof(float) * (size_t)H * maxlen, "probe attention"));
        KVC_TRY(scratch(g_stats, sizeof(float) * window_stats_floats(H, a->n, maxlen), "probe softmax statistics"));
        KVC_TRY(window_attention(at<char>(a->q), q_f32, a->q.ld, a->n, H, Hkv, d, hi, scale, g_att.as<float>(), maxlen,
                                 g_stats.as<float>()));
        return pool_reduce(g_att.as<float>(), maxlen, H, Hkv, hi, a->kernel, 0, 0, 1, 0, scores, lds);
    }
    default:
        return fail(KVC_ERR_UNSUPPORTED, "scorer %d has no CUDA implementation", a->scorer);
    }
}

kvc_status topk(kvc_view scores, int32_t heads, const int64_t *len, const int64_t *k, int64_t *const *keep) {
    int64_t ld = scores.ld, most = 1;
    for (int32_t h = 0; h < heads; h++) most = k[h] > most ? k[h] : most;
    KVC_TRY(scratch(g_rows, sizeof(int32_t) * (size_t)(ld > 0 ? ld : 1), "top-k rows"));
    int32_t *host = (int32_t *)malloc(sizeof(int32_t) * (size_t)most);
    if (!host) return fail(KVC_ERR_NOMEM, "out of memory: top-k");
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < heads && st == KVC_OK; h++) {
        if (k[h] <= 0) continue;
        if (k[h] > len[h] || len[h] > ld) st = fail(KVC_ERR_INTERNAL, "top-k: %lld of %lld rows", (long long)k[h], (long long)len[h]);
        if (st == KVC_OK) st = topk_rows(at<float>(scores) + (size_t)h * ld, len[h], k[h], g_rows.as<int32_t>(), g_topk_tmp);
        if (st == KVC_OK &&
            d2h(host, g_rows.p, sizeof(int32_t) * k[h]) != cudaSuccess)
            st = cuda_fail(cudaGetLastError(), "top-k copy");
        if (st == KVC_OK && stream_wait() != cudaSuccess) st = cuda_fail(cudaGetLastError(), "top-k");
        for (int64_t i = 0; st == KVC_OK && i < k[h]; i++) keep[h][i] = host[i];
    }
    free(host);
    return st;
}

kvc_status cos_sum(kvc_view resid, kvc_view o, int64_t rows, int64_t D, double *out) {
    if (resid.buf->dtype != KVC_F32 || o.buf->dtype != KVC_BF16 || resid.ld != D)
        return fail(KVC_ERR_INTERNAL, "cos_sum: the residual stream must be f32 rows of D and O bf16");
    KVC_TRY(scratch(g_dsum, sizeof(double), "dissimilarity"));
    KVC_TRY(dissim_sum(at<float>(resid), at<bf16>(o), o.ld, rows, D, g_dsum.as<double>()));
    CU_TRY(d2h(out, g_dsum.p, sizeof(double)), "dissimilarity");
    CU_TRY(stream_wait(), "dissimilarity");
    return KVC_OK;
}

} // namespace kvc
