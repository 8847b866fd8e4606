/* Per-chunk selection. ChunkPress (kvpress; FINCH's per-chunk selection, Corallo & Papotti, 2024): the
 * layer's rows are cut into chunks of cfg->chunk_press; each chunk is copied alone into a scratch K/V
 * store and scored there, as kvpress scores the chunk's keys and values alone. FinchPress's chunk_length
 * cuts the scores of the whole layer instead. Either way each chunk keeps its own top
 * max(1, int(rows (1 - ratio))) (kvpress's n_kept per chunk, the last chunk included), so the compression
 * is spread evenly over the prompt instead of following where a global ranking concentrates. Only
 * scorers that read no queries take part in ChunkPress (kvc_chunk_press_scorer). */
#include <stdlib.h>
#include <string.h>

#include "../core/hostmath.h"
#include "press.h"

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
    int64_t *rows[KVC_MAX_KV_HEADS] = {0};
    float *part[KVC_MAX_KV_HEADS];
    int64_t upto[KVC_MAX_KV_HEADS], m[KVC_MAX_KV_HEADS];
    kvc_kv *tmp = NULL;
    kvc_status st = be->kv_new(Hkv, d, &tmp);
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++)
        if (!(rows[h] = malloc(sizeof(int64_t) * (size_t)(C < n ? C : n)))) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: ChunkPress");
    const kvc_layer_rows chunk_rows = {be, lr->mc, tmp, lr->inv_freq, lr->wo};
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
        if (st == KVC_OK) st = kvc_score_layer(&chunk_rows, ctx, cfg, 0, m, buf, ld, part);
    }
    if (tmp) be->kv_free(tmp);
    for (int32_t h = 0; h < Hkv; h++) free(rows[h]);
    if (st != KVC_OK) return st;
    return kvc_chunk_topk(Hkv, len, C, cfg->compression_ratio, (const float *const *)scores, keep, n_keep);
}
