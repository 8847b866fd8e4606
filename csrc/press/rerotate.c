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

static kvc_status rerotate(kvc_session *s, int32_t layer, int64_t end) {
    const kvc_backend *be = kvc_door_backend(s);
    const kvc_layer_cache *L = &kvc_door_cache(s)->layers[layer];
    const kvc_config *c = &kvc_door_model(s)->cfg;
    const int32_t d = c->head_dim;
    /* a turn by the distance with the frequencies the call turned the keys with; the attention factor stays */
    const float *freq = kvc_model_rope(kvc_door_model(s), layer, end).host;
    kvc_status st = KVC_OK;
    for (int32_t h = 0; h < kvc_door_cache(s)->n_kv && st == KVC_OK; h++) {
        const int64_t n = L->len[h];
        if (n == 0) continue;
        float *k = malloc(sizeof(float) * (size_t)n * (size_t)d);
        int64_t *delta = malloc(sizeof(int64_t) * (size_t)n);
        if (!k || !delta) st = kvc_fail(KVC_ERR_NOMEM, "out of memory: key re-rotation");
        for (int64_t i = 0; i < n && st == KVC_OK; i++) delta[i] = i - L->pos[h][i];
        if (st == KVC_OK) st = be->kv_read(L->kv, h, 0, n, k, NULL);
        if (st == KVC_OK) kvc_host_rope(k, delta, n, 1, d, freq, c->rope_pairing, 1.0f);
        if (st == KVC_OK) st = be->kv_write(L->kv, h, 0, n, k, NULL);
        free(k);
        free(delta);
    }
    return st;
}

typedef struct {
    int64_t on;
} rerotate_state;

static kvc_status set_on(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p, (void)n;
    ((rerotate_state *)state)->on = *(const int64_t *)data != 0;
    return KVC_OK;
}

static kvc_status after_compact(kvc_press *p, void *state, kvc_session *s, const kvc_layer_ctx *ctx) {
    (void)p;
    return ((const rerotate_state *)state)->on ? rerotate(s, ctx->layer, kvc_call_end(ctx)) : KVC_OK;
}

static const kvc_part_array_i arrays[] = {
    {"key_rerotation", KVC_ARRAY_I64, KVC_COUNT_ONE, set_on, "1: kept keys re-rotated to positions 0 .. n_kept - 1"},
    {NULL, 0, 0, NULL, NULL},
};

/* first of the after-compaction parts: ThinK's channel scores read the re-rotated keys, as kvpress's order */
static const kvc_press_part_i rerotate_part = {
    .name = "key_rerotation", .title = "KeyRerotationPress", .traits = KVC_PART_ALONE, .order = 20,
    .state_size = sizeof(rerotate_state), .arrays = arrays, .after_compact = after_compact,
    .doc = "after a layer's eviction, its kept keys re-rotated to positions 0 .. n_kept - 1"};
KVC_REGISTER_PART(rerotate_part);
