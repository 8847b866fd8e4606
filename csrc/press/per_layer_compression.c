/* PerLayerCompressionPress (kvpress): the press's part that gives each layer its own compression_ratio (array
 * "layer_ratios", [L], each in [0, 1); 0 leaves a layer as it is). The press must use compression_ratio, not a
 * budget. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "press.h"

typedef struct {
    double *ratios; /* [L] */
} per_layer_state;

static kvc_status set_ratios(void *state, const kvc_press *p, const void *data, int64_t n) {
    (void)p;
    const double *r = data;
    for (int64_t l = 0; l < n; l++)
        if (!(r[l] >= 0 && r[l] < 1))
            return kvc_fail(KVC_ERR_ARG, "compression ratio of layer %lld must be in [0, 1), got %g", (long long)l, r[l]);
    per_layer_state *pl = state;
    double *copy = malloc(sizeof(double) * (size_t)n);
    if (!copy) return kvc_fail(KVC_ERR_NOMEM, "out of memory: layer ratios");
    memcpy(copy, r, sizeof(double) * (size_t)n);
    free(pl->ratios);
    pl->ratios = copy;
    return KVC_OK;
}

static void release(void *state) { free(((per_layer_state *)state)->ratios); }

static kvc_status admit(const kvc_press *p) {
    if (p->cfg.budget > 0) return kvc_fail(KVC_ERR_ARG, "per-layer compression ratios replace compression_ratio, not a budget");
    return KVC_OK;
}

static void layer_config(const void *state, int32_t layer, kvc_press_config *cfg) {
    const per_layer_state *pl = state;
    if (pl->ratios) cfg->compression_ratio = pl->ratios[layer];
}

static const kvc_part_array_i arrays[] = {
    {"layer_ratios", KVC_ARRAY_F64, KVC_COUNT_LAYERS, set_ratios, "each layer's compression_ratio, in [0, 1)"},
    {NULL, 0, 0, NULL, NULL},
};

static const kvc_press_part_i per_layer_part = {
    .name = "layer_ratios", .title = "PerLayerCompressionPress", .traits = 0, .order = 0,
    .state_size = sizeof(per_layer_state), .arrays = arrays, .admit = admit, .release = release,
    .layer_config = layer_config, .doc = "each layer's own compression_ratio"};
KVC_REGISTER_PART(per_layer_part);
