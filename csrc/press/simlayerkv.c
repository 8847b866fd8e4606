/* SimLayerKV (Zhang et al., 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction"; kvpress
 * SimLayerKVPress): a layer is lazy when its last n_last queries (the window) put more than lazy_threshold of
 * their attention, averaged over every query head and window query, on the first n_initial (n_sink) rows and
 * the n_recent rows before the window. A lazy layer keeps its first n_initial rows and its last
 * n_recent - n_last rows (kvpress's slice keys[-n_recent + n_last:]); any other layer keeps everything, and so
 * does every layer of a prompt of at most n_initial + n_recent + n_last rows, or with lazy_threshold 1. */
#include "press.h"

kvc_status kvc_simlayer_select(const kvc_config *mc, const kvc_press_config *cfg, const int64_t *len,
                               const float *const *scores, int64_t *const *keep, int64_t *n_keep) {
    const int32_t Hkv = mc->n_kv_heads, w = cfg->window;
    const int64_t ni = cfg->n_sink, nr = cfg->n_recent;
    int compress = cfg->lazy_threshold < 1.0f;
    for (int32_t h = 0; h < Hkv; h++) compress &= len[h] > ni + nr + w;
    double mass = 0;
    for (int32_t h = 0; h < Hkv && compress; h++) {
        const int64_t past = len[h] - w; /* the window's scores cover rows [0, past) */
        for (int64_t r = 0; r < ni; r++) mass += scores[h][r];
        for (int64_t r = past - nr; r < past; r++) mass += scores[h][r];
    }
    const int lazy = compress && mass / Hkv > (double)cfg->lazy_threshold;
    for (int32_t h = 0; h < Hkv; h++) {
        int64_t k = 0;
        for (int64_t r = 0; r < len[h]; r++)
            if (!lazy || r < ni || r >= len[h] - (nr - w)) keep[h][k++] = r;
        n_keep[h] = k;
    }
    return KVC_OK;
}
