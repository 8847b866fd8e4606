/* LoRA adapters (PEFT's: y = x W^T + scale (x A^T) B^T) for the host rows' forward (rows_grad.c): RestoreKV's
 * restore pass. Each (layer, projection) holds its own copy of A [r, in] and B [out, r]. */
#include <math.h>
#include <string.h>

#include "../core/press_i.h"
#include "rows_grad.h"

static const char *const target_names[KVC_LORA_N] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"};

kvc_status kvc_lora_new(const kvc_model *model, kvc_lora **out) {
    if (!out) return kvc_fail(KVC_ERR_ARG, "kvc_lora_new: out is NULL");
    *out = NULL;
    if (!model) return kvc_fail(KVC_ERR_ARG, "kvc_lora_new: model is NULL");
    const kvc_config *c = &model->cfg;
    kvc_lora *l = calloc(1, sizeof *l);
    if (l) l->mats = calloc((size_t)c->n_layers * KVC_LORA_N, sizeof *l->mats);
    if (!l || !l->mats) {
        free(l);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: LoRA adapters");
    }
    const int64_t D = c->hidden, F = c->ffn, qd = (int64_t)c->n_heads * c->head_dim, kd = (int64_t)c->n_kv_heads * c->head_dim;
    const int64_t in[KVC_LORA_N] = {D, D, D, qd, D, D, F}, outd[KVC_LORA_N] = {qd, kd, kd, D, F, F, D};
    memcpy(l->in, in, sizeof in);
    memcpy(l->out, outd, sizeof outd);
    l->n_layers = c->n_layers;
    *out = l;
    return KVC_OK;
}

void kvc_lora_free(kvc_lora *lora) {
    if (!lora) return;
    for (size_t i = 0; i < (size_t)lora->n_layers * KVC_LORA_N; i++) {
        kvc_free(lora->mats[i].a);
        kvc_free(lora->mats[i].b);
    }
    free(lora->mats);
    free(lora);
}

static kvc_status check_finite(const float *x, size_t n, int32_t layer, int32_t target, const char *which) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return kvc_fail(KVC_ERR_ARG, "LoRA layer %d %s: lora_%s holds a value that is not finite (element %zu)", layer,
                            target_names[target], which, i);
    return KVC_OK;
}

kvc_status kvc_lora_set(kvc_lora *lora, int32_t layer, int32_t target, int32_t rank, int64_t in, int64_t out,
                        const float *a, const float *b, float scale) {
    if (!lora) return kvc_fail(KVC_ERR_ARG, "kvc_lora_set: lora is NULL");
    if (layer < 0 || layer >= lora->n_layers)
        return kvc_fail(KVC_ERR_ARG, "LoRA: layer %d outside the model's %d layers", layer, lora->n_layers);
    if (target < 0 || target >= KVC_LORA_N) return kvc_fail(KVC_ERR_ARG, "LoRA: unknown target %d", target);
    if (rank < 1 || rank > 65536) return kvc_fail(KVC_ERR_ARG, "LoRA: rank %d outside [1, 65536]", rank);
    if (!a || !b) return kvc_fail(KVC_ERR_ARG, "kvc_lora_set: a and b must not be NULL");
    if (in != lora->in[target] || out != lora->out[target])
        return kvc_fail(KVC_ERR_ARG, "LoRA layer %d %s: the adapter maps %lld -> %lld features, the model's projection "
                        "%lld -> %lld", layer, target_names[target], (long long)in, (long long)out,
                        (long long)lora->in[target], (long long)lora->out[target]);
    if (!isfinite(scale)) return kvc_fail(KVC_ERR_ARG, "LoRA: scale %g is not finite", (double)scale);
    const size_t na = (size_t)rank * (size_t)lora->in[target], nb = (size_t)lora->out[target] * (size_t)rank;
    KVC_TRY(check_finite(a, na, layer, target, "A"));
    KVC_TRY(check_finite(b, nb, layer, target, "B"));
    float *ca = kvc_malloc(na * sizeof(float), "LoRA A"), *cb = kvc_malloc(nb * sizeof(float), "LoRA B");
    if (!ca || !cb) {
        kvc_free(ca);
        kvc_free(cb);
        return KVC_ERR_NOMEM;
    }
    memcpy(ca, a, na * sizeof(float));
    memcpy(cb, b, nb * sizeof(float));
    kvc_lora_mat *m = &lora->mats[(size_t)layer * KVC_LORA_N + target];
    kvc_free(m->a);
    kvc_free(m->b);
    *m = (kvc_lora_mat){rank, scale, ca, cb};
    return KVC_OK;
}
