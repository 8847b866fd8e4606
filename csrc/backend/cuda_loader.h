/* The core's side of the CUDA backend: the run-time loader of libkvpress_c_cuda.so (cuda_loader.c)
 * and the device sessions and press hook built on its table (cuda_session.c). Plain C; nothing here
 * needs CUDA headers, so the core builds and runs without CUDA. */
#ifndef KVC_CUDA_LOADER_H
#define KVC_CUDA_LOADER_H

#include "../core/common.h"
#include "cuda/cuda_api.h"

struct kvc_model;
struct kvc_session;

/* The backend's table, loading and initialising it once. KVC_ERR_DEVICE with the reason when the
 * library is missing or no usable GPU is visible ("CUDA backend not available: ..."). */
kvc_status kvc_cuda_api_get(const kvc_cuda_api **out);
/* Free the model's device copy, if any (kvc_model_free). */
void kvc_cuda_model_release(struct kvc_model *m);

/* Device sessions (cuda_session.c): the session functions of the public API dispatch here when
 * s->dev is set. */
kvc_status kvc_dev_session_new(struct kvc_session *s, int64_t capacity_hint);
void kvc_dev_session_free(struct kvc_session *s);
void kvc_dev_session_reset(struct kvc_session *s);
kvc_status kvc_dev_copy_cache(struct kvc_session *dst, const struct kvc_session *src);
int64_t kvc_dev_cache_len(const struct kvc_session *s, int32_t layer, int32_t h);
size_t kvc_dev_cache_bytes(const struct kvc_session *s);
size_t kvc_dev_peak_cache_bytes(const struct kvc_session *s);
kvc_status kvc_dev_forward(struct kvc_session *s, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb,
                           int64_t logits_row, float *logits);
kvc_status kvc_dev_forward_batch(struct kvc_session *const *ss, int32_t B, const int32_t *ids, float *logits);
kvc_status kvc_dev_truncate(struct kvc_session *s, const int64_t *new_len, int64_t position);
kvc_status kvc_dev_cache_positions(const struct kvc_session *s, int32_t layer, int32_t h, int64_t *out);
/* Scores of a layer's rows (lens[h] per head) into host arrays: on the GPU for the scorers it has
 * (*on_device = 1), else by the CPU scorer on the layer's K/V and activations brought to the host. */
kvc_status kvc_dev_layer_scores(struct kvc_session *s, void *ds, const kvc_dev_ctx *ctx, const kvc_press_config *cfg,
                                int32_t layer, int64_t n, const int64_t *past, const int64_t *lens, float *const *scores,
                                int *on_device);
/* The device version of the hook the session has if it is TAKE's (press/take.c), else NULL. */
kvc_dev_hook kvc_take_dev_hook_for(const struct kvc_session *s);

#endif
