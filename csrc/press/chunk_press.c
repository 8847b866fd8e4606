/* Per-chunk selection. ChunkPress (kvpress; FINCH's per-chunk selection, Corallo & Papotti, 2024): the
 * layer's rows are cut into chunks of cfg->chunk_press; each chunk is copied alone into a scratch K/V
 * store and scored there, as kvpress scores the chunk's keys and values alone. FinchPress's chunk_length
 * cuts the scores of the whole layer instead. Either way each chunk keeps its own top
 * max(1, int(rows (1 - ratio))) (kvpress's n_kept per chunk, the last chunk included), so the compression
 * is spread evenly over the prompt instead of following where a global ranking concentrates.
 * A scorer that reads queries (SnapKV, TOVA) gets, as in kvpress, the queries of the chunk's last w rows
 * rotated to the prompt's last w positions (kvpress takes the chunk's last hidden states but the cos/sin of
 * the whole prompt's last positions): our post-RoPE queries of those rows, rotated further by the distance
 * between the two. Other scorers: those that read no queries (kvc_chunk_press_scorer). */
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "press.h"

/* The window queries kvpress scores chunk [.., end) with: this call's rows end - w .. end - 1 (past rows
 * before the call), moved to the positions of the call's last w rows; uploaded into *buf (grown). */
static kvc_status chunk_queries(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, int32_t w, int64_t end,
                                int64_t past, kvc_buf **buf, float *q, int64_t *delta, kvc_view *out) {
    const kvc_config *c = lr->mc;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, r0 = end - past - w;
    if (r0 < 0)
        return kvc_fail(KVC_ERR_UNSUPPORTED, "ChunkPress scores a chunk with the queries of its last %d rows: rows %lld.. "
                        "precede this forward call (compress a prefill into an empty session)", w, (long long)(end - w));
    for (int32_t j = 0; j < w; j++) {
        const int64_t a = ctx->n - w + j, b = r0 + j;
        delta[j] = ctx->pos ? ctx->pos[a] - ctx->pos[b] : a - b;
    }
    float freq[128], ms; /* a turn by the distance: the call's frequencies, no attention factor (already in q) */
    KVC_TRY(kvc_layer_rope(lr, ctx->layer, kvc_call_end(ctx), freq, &ms));
    KVC_TRY(lr->be->download(kvc_view_at(ctx->q, r0, 0), w, qd, q, KVC_F32));
    kvc_host_rope(q, delta, w, c->n_heads, c->head_dim, freq, c->rope_pairing, 1.0f);
    if (!*buf) KVC_TRY(lr->be->alloc(lr->be->act_dtype, w * qd, KVC_MEM_ACT, "ChunkPress window queries", buf));
    *out = kvc_view_of(*buf, 0, qd);
    return lr->be->upload(*out, w, qd, q, KVC_F32);
}

kvc_status kvc_chunk_topk(int32_t Hkv, const int64_t *len, int64_t chunk, double ratio, const float *const *scores,
                          int64_t *const *keep, int64_t *n_keep) {
    int64_t maxlen = 1;
    for (int32_t h = 0; h < Hkv; h++) maxlen = len[h] > maxlen ? len[h] : maxlen;
    int64_t *top = malloc(sizeof(int64_t) * (size_t)(chunk < maxlen ? chunk : maxlen));
    if (!top) return kvc_fail(KVC_ERR_NOMEM, "out of memory: per-chunk selection");
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        n_keep[h] = 0;
        for (int64_t i = 0; i < len[h] && st == KVC_OK; i += chunk) {
            const int64_t rows = len[h] - i < chunk ? len[h] - i : chunk;
            int64_t k = kvc_n_kept_ratio(rows, ratio);
            if (k > rows) k = rows;
            st = kvc_host_topk_rows(scores[h] + i, rows, k, top);
            for (int64_t j = 0; j < k && st == KVC_OK; j++) keep[h][n_keep[h]++] = i + top[j]; /* chunks in order */
        }
    }
    free(top);
    return st;
}

kvc_status kvc_chunk_press_select(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, kvc_buf **buf, int64_t *ld, float *const *scores,
                                  int64_t *const *keep, int64_t *n_keep) {
    const kvc_backend *be = lr->be;
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    const int64_t n = len[0], C = cfg->chunk_press;
    for (int32_t h = 1; h < Hkv; h++)
        if (len[h] != n) return kvc_fail(KVC_ERR_ARG, "ChunkPress needs every head of a layer to hold the same rows");
    const int32_t w = kvc_scorer_query_rows(cfg);
    const int64_t past = n - ctx->n, qd = (int64_t)lr->mc->n_heads * lr->mc->head_dim;
    int64_t *rows[KVC_MAX_KV_HEADS] = {0};
    float *part[KVC_MAX_KV_HEADS];
    int64_t upto[KVC_MAX_KV_HEADS], m[KVC_MAX_KV_HEADS];
    kvc_kv *tmp = NULL;
    kvc_buf *qbuf = NULL;
    float *q = w ? malloc(sizeof(float) * (size_t)w * (size_t)qd) : NULL;
    int64_t *delta = w ? malloc(sizeof(int64_t) * (size_t)w) : NULL;
    kvc_status st = w && (!q || !delta) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: ChunkPress") : be->kv_new(Hkv, d, NULL, &tmp);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(rows[h] = malloc(sizeof(int64_t) * (size_t)(C < n ? C : n)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: ChunkPress");
    const kvc_layer_rows chunk_rows = {be, lr->mc, tmp, lr->model, lr->wo, lr->q_mean, lr->q_cov, lr->future_from};
    kvc_layer_ctx chunk_ctx = *ctx;
    for (int64_t i = 0; i < n && st == KVC_OK; i += C) {
        const int64_t end = i + C < n ? i + C : n;
        for (int32_t h = 0; h < Hkv; h++) {
            upto[h] = end;
            m[h] = end - i;
            part[h] = scores[h] + i; /* the chunk's scores land side by side */
            for (int64_t r = i; r < end; r++) rows[h][r - i] = r;
        }
        /* the chunk alone: rows [0, end) copied, then compacted to [i, end) */
        st = be->kv_resize(tmp, upto, upto, lr->kv);
        if (st == KVC_OK) st = be->kv_gather(tmp, (const int64_t *const *)rows, m, m);
        if (st == KVC_OK && w > 0) {
            if (end - i <= w)
                st = kvc_fail(KVC_ERR_ARG, "ChunkPress: a chunk of %lld rows must be longer than the press window (%d), as "
                              "kvpress asserts: choose another chunk_length", (long long)(end - i), w);
            if (st == KVC_OK) st = chunk_queries(lr, ctx, w, end, past, &qbuf, q, delta, &chunk_ctx.q);
            chunk_ctx.n = w;
            chunk_ctx.pos = NULL;
        }
        if (st == KVC_OK) st = kvc_score_layer(&chunk_rows, &chunk_ctx, cfg, w, m, buf, ld, part);
    }
    if (qbuf) be->free(qbuf);
    free(q);
    free(delta);
    if (tmp) be->kv_free(tmp);
    for (int32_t h = 0; h < Hkv; h++) free(rows[h]);
    if (st != KVC_OK) return st;
    return kvc_chunk_topk(Hkv, len, C, cfg->compression_ratio, (const float *const *)scores, keep, n_keep);
}
