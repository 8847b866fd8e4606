/* ChunkPress (kvpress; FINCH's per-chunk selection, Corallo & Papotti, 2024): the layer's rows are cut
 * into chunks of cfg->chunk_press; each chunk is copied alone into a scratch K/V store and scored
 * there, as kvpress scores the chunk's keys and values alone, and keeps its own top
 * max(1, int(rows (1 - ratio))) (kvpress's n_kept per chunk, the last chunk included). So the
 * compression is spread evenly over the prompt instead of following where a global ranking
 * concentrates. Only scorers that read no queries take part (kvc_chunk_press_scorer). */
#include <stdlib.h>
#include <string.h>

#include "press.h"

kvc_status kvc_chunk_press_select(const kvc_layer_rows *lr, const kvc_layer_ctx *ctx, const kvc_press_config *cfg,
                                  const int64_t *len, kvc_buf **buf, int64_t *ld, float *const *scores,
                                  int64_t *const *keep, int64_t *n_keep) {
    const kvc_backend *be = lr->be;
    const int32_t Hkv = lr->mc->n_kv_heads, d = lr->mc->head_dim;
    const int64_t n = len[0], C = cfg->chunk_press;
    for (int32_t h = 1; h < Hkv; h++)
        if (len[h] != n) return kvc_fail(KVC_ERR_ARG, "ChunkPress needs every head of a layer to hold the same rows");
    int64_t *rows[KVC_MAX_KV_HEADS] = {0}, *top[KVC_MAX_KV_HEADS] = {0};
    float *part[KVC_MAX_KV_HEADS] = {0};
    int64_t upto[KVC_MAX_KV_HEADS], m[KVC_MAX_KV_HEADS], k[KVC_MAX_KV_HEADS];
    kvc_kv *tmp = NULL;
    kvc_status st = be->kv_new(Hkv, d, &tmp);
    const size_t cap = (size_t)(C < n ? C : n) + 1;
    for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
        n_keep[h] = 0;
        rows[h] = malloc(sizeof(int64_t) * cap);
        top[h] = malloc(sizeof(int64_t) * cap);
        part[h] = malloc(sizeof(float) * cap);
        if (!rows[h] || !top[h] || !part[h]) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: ChunkPress");
    }
    const kvc_layer_rows chunk_rows = {be, lr->mc, tmp, lr->inv_freq, lr->wo};
    for (int64_t i = 0; i < n && st == KVC_OK; i += C) {
        const int64_t end = i + C < n ? i + C : n;
        for (int32_t h = 0; h < Hkv; h++) {
            upto[h] = end;
            m[h] = end - i;
            k[h] = kvc_n_kept_ratio(m[h], cfg->compression_ratio);
            if (k[h] > m[h]) k[h] = m[h];
            for (int64_t r = i; r < end; r++) rows[h][r - i] = r;
        }
        /* the chunk alone: rows [0, end) copied, then compacted to [i, end) */
        st = be->kv_resize(tmp, upto, upto, lr->kv);
        if (st == KVC_OK) st = be->kv_gather(tmp, (const int64_t *const *)rows, m, m);
        if (st == KVC_OK) st = kvc_score_layer(&chunk_rows, ctx, cfg, 0, m, buf, ld, part);
        if (st == KVC_OK) st = be->topk(kvc_view_of(*buf, 0, *ld), Hkv, m, k, top);
        for (int32_t h = 0; h < Hkv && st == KVC_OK; h++) {
            memcpy(scores[h] + i, part[h], sizeof(float) * (size_t)m[h]);
            for (int64_t j = 0; j < k[h]; j++) keep[h][n_keep[h]++] = i + top[h][j]; /* chunks in order: sorted */
        }
    }
    if (tmp) be->kv_free(tmp);
    for (int32_t h = 0; h < Hkv; h++) {
        free(rows[h]);
        free(top[h]);
        free(part[h]);
    }
    return st;
}
