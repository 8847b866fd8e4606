/* Press operations on a device session, called from the core's press hook (backend/cuda_press.c)
 * after a layer's attention: score the layer's rows on the device (the scorers of score.cu; the
 * core falls back to the host for the others), hand the scores to the host (the core's allocation
 * and selection, so every allocation rule is the CPU's), or pick the top-k on the device, then
 * compact the layer into an arena sized for what is kept (real eviction). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.cuh"

namespace kvc {

/* The last w queries of the call score the rows before them: window query j (row len - w + j) sees
 * rows < len - w + j + 1, rows < len - w are scored; the scratch for the window passes is sized. */
static kvc_status window_setup(HeadInfo &hi, int32_t H, int32_t Hkv, int64_t w, int64_t n, int64_t maxlen, Buf &att_s,
                               Buf &stats) {
    if (w > n) return fail(KVC_ERR_ARG, "the prompt (%lld tokens) must be longer than the press window (%lld)",
                           (long long)n, (long long)w);
    for (int32_t h = 0; h < Hkv; h++) {
        hi.n_acc[h] = hi.len[h] - w;
        hi.vstart[h] = hi.len[h] - w;
        hi.vlimit[h] = hi.len[h];
    }
    KVC_TRY(att_s.need(sizeof(float) * (size_t)H * maxlen, "press window attention"));
    return stats.need(sizeof(float) * window_stats_floats(H, w, maxlen), "press softmax statistics");
}

kvc_status score_layer(const HeadInfo &hi0, int32_t H, int32_t Hkv, int32_t d, const bf16 *q, int64_t ldq,
                       const bf16 *attn, int64_t ld_attn, int64_t n, const kvc_press_config *cfg, int32_t layer,
                       Buf &att_s, Buf &stats, float *scores, int64_t lds) {
    HeadInfo hi = hi0;
    const float scale = 1.0f / sqrtf((float)d);
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = hi.len[h] > maxlen ? hi.len[h] : maxlen;
    switch (cfg->scorer) {
    case KVC_SCORE_KNORM:
        return score_knorm(hi, Hkv, d, scores, lds);
    case KVC_SCORE_STREAMING:
        return score_streaming(hi, Hkv, cfg->n_sink, scores, lds);
    case KVC_SCORE_RANDOM:
        return score_random(hi, Hkv, cfg->seed, layer, scores, lds);
    case KVC_SCORE_SNAPKV:
    case KVC_SCORE_TOVA: {
        const int tova = cfg->scorer == KVC_SCORE_TOVA;
        const int64_t w = tova ? 1 : cfg->window;
        if (tova)
            for (int32_t h = 1; h < Hkv; h++)
                if (hi.len[h] != hi.len[0])
                    return fail(KVC_ERR_ARG, "TOVA needs every head of a layer to hold the same tokens");
        KVC_TRY(window_setup(hi, H, Hkv, w, n, maxlen, att_s, stats));
        KVC_TRY(window_attention(q + (n - w) * ldq, 0, ldq, w, H, Hkv, d, hi, scale, att_s.as<float>(), maxlen,
                                 stats.as<float>()));
        KVC_TRY(pool_reduce(att_s.as<float>(), maxlen, H, Hkv, hi, tova ? 1 : cfg->kernel, cfg->pool_max, cfg->gqa_max,
                            cfg->pool_then_reduce, tova, scores, lds));
        return protect_tail(scores, lds, Hkv, hi);
    }
    case KVC_SCORE_EDIE: {
        const int64_t w = cfg->window;
        if (!attn) return fail(KVC_ERR_ARG, "EDIE needs the attention outputs of the window queries");
        KVC_TRY(window_setup(hi, H, Hkv, w, n, maxlen, att_s, stats));
        KVC_TRY(edie_attention(q + (n - w) * ldq, ldq, attn + (n - w) * ld_attn, ld_attn, w, H, Hkv, d, hi, scale,
                               cfg->edie_alpha, att_s.as<float>(), maxlen, stats.as<float>()));
        /* group sum (edie_attention scaled by the group size), then mean pooling counting padding */
        KVC_TRY(pool_reduce(att_s.as<float>(), maxlen, H, Hkv, hi, cfg->kernel, 0, 0, 0, 0, scores, lds));
        return protect_tail(scores, lds, Hkv, hi);
    }
    default:
        return fail(KVC_ERR_UNSUPPORTED, "scorer %d has no CUDA implementation (it runs on the host)", cfg->scorer);
    }
}

/* ---- on a session --------------------------------------------------------------------------------- */

static int64_t max_len(const DSess *s, int32_t l) {
    int64_t m = 1;
    for (int32_t h = 0; h < s->Hkv; h++) m = s->len[(size_t)l * s->Hkv + h] > m ? s->len[(size_t)l * s->Hkv + h] : m;
    return m;
}

kvc_status sess_score(DSess *s, const kvc_dev_ctx *ctx, const kvc_press_config *cfg, int32_t layer) {
    if (!kvc_scorer_on_device(cfg->scorer))
        return fail(KVC_ERR_UNSUPPORTED, "scorer %d has no CUDA implementation", cfg->scorer);
    const int64_t ld = max_len(s, layer);
    KVC_TRY(s->scores.need(sizeof(float) * (size_t)s->Hkv * ld, "press scores"));
    s->scores_ld = ld;
    const HeadInfo hi = head_info(s, layer);
    return score_layer(hi, s->m->c.n_heads, s->Hkv, s->d, ctx->c.q, ctx->c.ldq, ctx->c.attn,
                       (int64_t)s->m->c.n_heads * s->d, ctx->c.n, cfg, layer, s->att_s, s->stats, s->scores.as<float>(),
                       ld);
}

kvc_status sess_probe_score(DSess *s, int32_t layer, const float *qa, int64_t p, const int64_t *real, int32_t kernel) {
    const int32_t H = s->m->c.n_heads, Hkv = s->Hkv, d = s->d;
    HeadInfo hi = head_info(s, layer);
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) {
        if (real[h] < 0 || real[h] > hi.len[h])
            return fail(KVC_ERR_ARG, "probe scores: head %d has %lld rows, %lld asked", h, (long long)hi.len[h],
                        (long long)real[h]);
        /* only the real rows exist for the probes: they see all of them, nothing after */
        hi.len[h] = hi.n_acc[h] = hi.vstart[h] = hi.vlimit[h] = real[h];
        maxlen = real[h] > maxlen ? real[h] : maxlen;
    }
    if (p < 1) return fail(KVC_ERR_ARG, "probe scores: no probes");
    KVC_TRY(s->scores.need(sizeof(float) * (size_t)Hkv * maxlen, "press scores"));
    s->scores_ld = maxlen;
    KVC_TRY(s->probe_q.need(sizeof(float) * (size_t)p * H * d, "probe queries"));
    CU_TRY(cudaMemcpyAsync(s->probe_q.p, qa, sizeof(float) * p * H * d, cudaMemcpyHostToDevice, g.stream),
           "probe queries");
    KVC_TRY(s->att_s.need(sizeof(float) * (size_t)H * maxlen, "probe attention"));
    KVC_TRY(s->stats.need(sizeof(float) * window_stats_floats(H, p, maxlen), "probe softmax statistics"));
    KVC_TRY(window_attention(s->probe_q.p, 1, (int64_t)H * d, p, H, Hkv, d, hi, 1.0f / sqrtf((float)d),
                             s->att_s.as<float>(), maxlen, s->stats.as<float>()));
    return pool_reduce(s->att_s.as<float>(), maxlen, H, Hkv, hi, kernel, 0, 0, 1, 0, s->scores.as<float>(), maxlen);
}

kvc_status sess_scores_to_host(DSess *s, int32_t layer, const int64_t *lens, float *const *out) {
    for (int32_t h = 0; h < s->Hkv; h++) {
        const int64_t n = lens ? lens[h] : s->len[(size_t)layer * s->Hkv + h];
        if (n > s->scores_ld) return fail(KVC_ERR_ARG, "scores: %lld rows asked, %lld held", (long long)n, (long long)s->scores_ld);
        if (n > 0)
            CU_TRY(cudaMemcpyAsync(out[h], s->scores.as<float>() + (size_t)h * s->scores_ld, sizeof(float) * n,
                                   cudaMemcpyDeviceToHost, g.stream),
                   "scores copy");
    }
    CU_TRY(cudaStreamSynchronize(g.stream), "scores copy");
    return KVC_OK;
}

static kvc_status keep_staging(DSess *s, size_t n) {
    if (n <= s->keep32_cap) return KVC_OK;
    int32_t *p = (int32_t *)realloc(s->keep32, sizeof(int32_t) * n);
    if (!p) return fail(KVC_ERR_NOMEM, "out of memory: selection staging");
    s->keep32 = p;
    s->keep32_cap = n;
    return KVC_OK;
}

kvc_status sess_select_topk(DSess *s, int32_t layer, const int64_t *lens, const int64_t *k, int64_t *const *keep,
                            int64_t *n_keep) {
    int64_t total = 0, ld = s->scores_ld;
    for (int32_t h = 0; h < s->Hkv; h++) {
        if (lens[h] > ld) return fail(KVC_ERR_ARG, "top-k: %lld rows asked, %lld scored", (long long)lens[h], (long long)ld);
        n_keep[h] = k[h] < lens[h] ? (k[h] < 0 ? 0 : k[h]) : lens[h];
        total += n_keep[h];
    }
    KVC_TRY(s->rows_d.need(sizeof(int32_t) * (size_t)(ld > 0 ? ld : 1), "top-k rows"));
    KVC_TRY(keep_staging(s, (size_t)(total > 0 ? total : 1)));
    int64_t off = 0;
    for (int32_t h = 0; h < s->Hkv; h++) {
        if (n_keep[h] > 0) {
            KVC_TRY(topk_rows(s->scores.as<float>() + (size_t)h * ld, lens[h], n_keep[h], s->rows_d.as<int32_t>(),
                              s->topk_tmp));
            CU_TRY(cudaMemcpyAsync(s->keep32 + off, s->rows_d.p, sizeof(int32_t) * n_keep[h], cudaMemcpyDeviceToHost,
                                   g.stream),
                   "top-k copy");
            CU_TRY(cudaStreamSynchronize(g.stream), "top-k");
        }
        for (int64_t i = 0; i < n_keep[h]; i++) keep[h][i] = s->keep32[off + i];
        off += n_keep[h];
    }
    return KVC_OK;
}

kvc_status sess_compact(DSess *s, int32_t layer, const int64_t *const *keep, const int64_t *n_keep, int64_t reserve_rows) {
    const size_t o = (size_t)layer * s->Hkv;
    int64_t total = 0, cap[KVC_MAX_KV];
    for (int32_t h = 0; h < s->Hkv; h++) {
        if (n_keep[h] < 0 || n_keep[h] > s->len[o + h])
            return fail(KVC_ERR_ARG, "compact: head %d keeps %lld of %lld rows", h, (long long)n_keep[h],
                        (long long)s->len[o + h]);
        for (int64_t i = 0; i < n_keep[h]; i++)
            if (keep[h][i] < 0 || keep[h][i] >= s->len[o + h] || (i > 0 && keep[h][i] <= keep[h][i - 1]))
                return fail(KVC_ERR_ARG, "compact: head %d row list is not strictly increasing inside [0, %lld)", h,
                            (long long)s->len[o + h]);
        total += n_keep[h];
        cap[h] = n_keep[h] + (reserve_rows > 0 ? reserve_rows : 0);
    }
    KVC_TRY(keep_staging(s, (size_t)(total > 0 ? total : 1)));
    int64_t off = 0;
    for (int32_t h = 0; h < s->Hkv; h++)
        for (int64_t i = 0; i < n_keep[h]; i++) s->keep32[off++] = (int32_t)keep[h][i];
    KVC_TRY(s->rows_d.need(sizeof(int32_t) * (size_t)(total > 0 ? total : 1), "compaction rows"));
    if (total > 0)
        CU_TRY(cudaMemcpyAsync(s->rows_d.p, s->keep32, sizeof(int32_t) * total, cudaMemcpyHostToDevice, g.stream),
               "compaction rows");
    return layer_repack(s, layer, cap, s->rows_d.as<int32_t>(), n_keep, keep);
}

kvc_status sess_download_layer(DSess *s, int32_t layer, float *const *k, float *const *v) {
    const size_t o = (size_t)layer * s->Hkv;
    int64_t mx = 1;
    for (int32_t h = 0; h < s->Hkv; h++) mx = s->len[o + h] > mx ? s->len[o + h] : mx;
    KVC_TRY(s->att_s.need(sizeof(float) * mx * s->d, "layer download staging"));
    for (int32_t h = 0; h < s->Hkv; h++) {
        const int64_t n = s->len[o + h] * s->d;
        if (n == 0) continue;
        for (int pass = 0; pass < 2; pass++) {
            KVC_TRY(bf16_to_f32(pass ? s->vh[o + h] : s->kh[o + h], s->att_s.as<float>(), n));
            CU_TRY(cudaMemcpyAsync(pass ? v[h] : k[h], s->att_s.p, sizeof(float) * n, cudaMemcpyDeviceToHost, g.stream),
                   "layer download");
            CU_TRY(cudaStreamSynchronize(g.stream), "layer download");
        }
    }
    return KVC_OK;
}

kvc_status ctx_download(const kvc_dev_ctx *ctx, int32_t which, int64_t row0, int64_t rows, float *out) {
    const DevCtx &c = ctx->c;
    DSess *s = c.s;
    const int64_t D = s->m->c.hidden, qd = (int64_t)s->m->c.n_heads * s->d;
    if (row0 < 0 || rows < 0 || row0 + rows > c.n) return fail(KVC_ERR_ARG, "context rows out of range");
    if (rows == 0) return KVC_OK;
    if (which == KVC_DEV_RESID) {
        CU_TRY(cudaMemcpyAsync(out, c.resid + row0 * D, sizeof(float) * rows * D, cudaMemcpyDeviceToHost, g.stream),
               "context download");
        CU_TRY(cudaStreamSynchronize(g.stream), "context download");
        return KVC_OK;
    }
    const bf16 *src;
    int64_t ld, width;
    if (which == KVC_DEV_Q) {
        src = c.q;
        ld = c.ldq;
        width = qd;
    } else if (which == KVC_DEV_ATTN) {
        src = c.attn;
        ld = qd;
        width = qd;
    } else if (which == KVC_DEV_O) {
        src = c.o;
        ld = D;
        width = D;
    } else {
        return fail(KVC_ERR_ARG, "unknown context activation %d", which);
    }
    /* convert row by row block into a dense fp32 staging buffer (rows may have a stride) */
    Buf &st = s->stats;
    KVC_TRY(st.need(sizeof(float) * rows * width + sizeof(bf16) * rows * width, "context download staging"));
    bf16 *dense = (bf16 *)(st.as<float>() + rows * width);
    CU_TRY(cudaMemcpy2DAsync(dense, sizeof(bf16) * width, src + row0 * ld, sizeof(bf16) * ld, sizeof(bf16) * width,
                             rows, cudaMemcpyDeviceToDevice, g.stream),
           "context download");
    KVC_TRY(bf16_to_f32(dense, st.as<float>(), rows * width));
    CU_TRY(cudaMemcpyAsync(out, st.p, sizeof(float) * rows * width, cudaMemcpyDeviceToHost, g.stream), "context download");
    CU_TRY(cudaStreamSynchronize(g.stream), "context download");
    return KVC_OK;
}

kvc_status ctx_dissimilarity(const kvc_dev_ctx *ctx, int32_t w, double *out) {
    const DevCtx &c = ctx->c;
    DSess *s = c.s;
    const int64_t D = s->m->c.hidden;
    const int64_t nw = w > 0 ? (w < c.n ? w : c.n) : 1;
    KVC_TRY(s->dsum.need(sizeof(double), "dissimilarity"));
    KVC_TRY(dissim_sum(c.resid + (c.n - nw) * D, c.o + (c.n - nw) * D, D, nw, D, s->dsum.as<double>()));
    double cos_sum = 0;
    CU_TRY(cudaMemcpyAsync(&cos_sum, s->dsum.p, sizeof(double), cudaMemcpyDeviceToHost, g.stream), "dissimilarity");
    CU_TRY(cudaStreamSynchronize(g.stream), "dissimilarity");
    *out = 1.0 - cos_sum / (double)nw; /* dissim_sum adds the cosines */
    return KVC_OK;
}

} // namespace kvc
