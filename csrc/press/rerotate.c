/* KeyRerotationPress (kvpress; the SinkCache / FINCH re-rotation): after a layer is compressed, its kept
 * keys are rotated as if they sat at positions 0 .. n_kept - 1 (row i by i - its position), so the cache
 * has no gaps in RoPE space; new tokens keep their original positions, as in kvpress. The rows go
 * through the host (kv_read, the CPU RoPE kernel with the model's host frequencies, kv_write), once per
 * layer per compressed prefill, so every backend runs it. The recorded positions stay the original ones
 * (the kept-index diagnostics). Keys must still sit at their original positions: the prefill press only. */
#include <stdlib.h>

#include "../core/hostmath.h" /* the RoPE rotation on host rows (deltas are negative) */
#include "../model/model.h"
#include "press.h"

kvc_status kvc_press_rerotate(kvc_session *s, int32_t layer) {
    const kvc_backend *be = kvc_door_backend(s);
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[layer];
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t d = c->head_dim;
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < kvc_door_cache(s)->n_kv && st == KVC_OK; h++) {
        const int64_t n = L->len[h];
        if (n == 0) continue;
        float *k = malloc(sizeof(float) * (size_t)n * (size_t)d);
        int64_t *delta = malloc(sizeof(int64_t) * (size_t)n);
        if (!k || !delta) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: key re-rotation");
        for (int64_t i = 0; i < n && st == KVC_OK; i++) delta[i] = i - L->pos[h][i];
        if (st == KVC_OK) st = be->kv_read(L->kv, h, 0, n, k, NULL);
        if (st == KVC_OK) kvc_host_rope(k, delta, n, 1, d, kvc_door_model(s)->rope_inv_freq, c->rope_pairing);
        if (st == KVC_OK) st = be->kv_write(L->kv, h, 0, n, k, NULL);
        free(k);
        free(delta);
    }
    return st;
}
