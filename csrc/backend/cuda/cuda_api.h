/* The boundary between the C core (libkvpress_c.so) and the CUDA backend (libkvpress_c_cuda.so).
 *
 * The CUDA backend is a separate shared library, loaded with dlopen only when a GPU is asked for
 * (kvc_cuda_available, kvc_model_load_device), so the core and the Python module never depend on CUDA
 * libraries. It exports one symbol, kvc_cuda_get_api, returning the table below. It never calls
 * into the core except through the kvc_cuda_host services handed to init (its error messages go to
 * the core's kvc_last_error that way).
 *
 * Device layout (engine.cuh): bf16 weights (q|k|v and gate|up fused), fp32 residual stream, bf16
 * activations, fp32 accumulation. The ragged KV cache is per (layer, KV head): bf16 K and V
 * [cap, d] slices of one device arena per layer; token positions stay on the host.
 *
 * Plain C: included by C (core) and C++ (nvcc) translation units. */
#ifndef KVC_CUDA_API_H
#define KVC_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

#include "../../include/kvpress_c.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_CUDA_API_VERSION 3

struct kvc_model;

/* Services the core lends the CUDA library. */
typedef struct kvc_cuda_host {
    /* record a message for kvc_last_error() and return st */
    kvc_status (*fail)(kvc_status st, const char *fmt, ...);
} kvc_cuda_host;

/* What a layer hook sees during a device forward: opaque, read through the api below. */
typedef struct kvc_dev_ctx kvc_dev_ctx;

/* Called after a layer's attention block of a multi-token device forward, once for the session
 * that ran it and once for every follower (after the follower received the layer's K/V rows).
 * past[h]: rows the session's (layer, h) held before this call's rows were appended. */
typedef kvc_status (*kvc_dev_hook)(void *user, void *dsess, const kvc_dev_ctx *ctx, int32_t layer, int64_t n,
                                   const int64_t *past);

/* The scorers the device has (score, k_score); the core scores the others on the host. One list
 * for both sides of the table. */
static inline int kvc_scorer_on_device(int32_t scorer) {
    return scorer == KVC_SCORE_SNAPKV || scorer == KVC_SCORE_TOVA || scorer == KVC_SCORE_KNORM ||
           scorer == KVC_SCORE_STREAMING || scorer == KVC_SCORE_RANDOM || scorer == KVC_SCORE_EDIE;
}

/* Which activation of a kvc_dev_ctx to read (download_ctx). */
enum { KVC_DEV_Q = 0, KVC_DEV_ATTN = 1, KVC_DEV_O = 2, KVC_DEV_RESID = 3 };

/* Device memory counters (memory_stats), bytes. */
enum {
    KVC_MEM_CURRENT = 0,     /* allocated now by this library */
    KVC_MEM_PEAK = 1,        /* most allocated at once since reset_peak */
    KVC_MEM_WEIGHTS = 2,     /* model weights now */
    KVC_MEM_CACHE = 3,       /* KV caches now */
    KVC_MEM_CACHE_PEAK = 4,  /* KV caches at most since reset_peak */
    KVC_MEM_ACT = 5,         /* activations and scratch now */
    KVC_MEM_ACT_PEAK = 6,    /* activations and scratch at most since reset_peak */
    KVC_MEM_DEVICE_TOTAL = 7,/* the device's memory */
    KVC_MEM_N = 8
};

typedef struct kvc_cuda_api {
    int32_t version; /* KVC_CUDA_API_VERSION */
    /* Find a device, create the stream and the GEMM handle. KVC_OK, or KVC_ERR_DEVICE with the reason. */
    kvc_status (*init)(const kvc_cuda_host *host);
    const char *(*device_name)(void);
    const char *(*gemm_name)(void); /* "cublas (<path>)" or "wmma" (the built-in fallback) */
    void (*force_builtin_gemm)(int on); /* tests: the WMMA kernel even when cuBLAS is loaded */
    void (*set_attention_kernel)(int kind); /* prefill attention: 0 WMMA (default), 1 register-tile mma */
    void (*memory_stats)(int64_t *out); /* [KVC_MEM_N] */
    void (*reset_peak)(void);

    /* ---- kernels on host arrays (H2D, kernel, D2H), fp32 in and out, for tests ---- */
    /* C[m,n] = A[m,k] B[n,k]^T with A, B rounded to bf16, fp32 accumulation and output */
    kvc_status (*k_matmul)(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k);
    /* y = rmsnorm(x (+ r)) * w; if r: x += r first and x_out receives it (x_out may be NULL) */
    kvc_status (*k_rmsnorm)(const float *x, const float *r, const float *w, float *y, float *x_out, int64_t rows,
                            int64_t dim, float eps);
    kvc_status (*k_rope)(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                         int32_t pairing);
    kvc_status (*k_swiglu)(const float *gate, const float *up, float *out, int64_t rows, int64_t dim);
    /* as kvc_kernel_attention (q, k, v rounded to bf16); n == 1 uses the split-K decode kernel
     * unless force_prefill */
    kvc_status (*k_attention)(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d, const float *const *k,
                              const float *const *v, const int64_t *past_len, float scale, float *out,
                              int32_t force_prefill);
    /* the device scorer on one layer (q [n, H, d]; attn [n, H, d] their attention outputs, for EDIE,
     * else may be NULL; k, v [Hkv, len, d]; this call's queries are the last n rows): scores [Hkv, len]
     * as kvc_press_compute_ex's. KVC_ERR_UNSUPPORTED for scorers the device does not have (the core
     * then scores on the host). */
    kvc_status (*k_score)(const kvc_press_config *cfg, int32_t H, int32_t Hkv, int32_t d, int32_t layer,
                          const float *q, const float *attn, int64_t n, const float *k, const float *v, int64_t len,
                          float *scores);
    /* Device-only timing (benchmarks): seconds per call of the GEMM (what 0, dims m, n, k: bf16 in,
     * bf16 out) or of the causal prefill attention (what 1, dims n, H, Hkv, d: one sequence, no past),
     * on device buffers, best of `reps` after a warm-up. */
    kvc_status (*bench)(int32_t what, const int64_t *dims, int32_t reps, double *seconds);
    /* top-k rows of each of `heads` score rows [heads, n] (higher first, then lower row), sorted */
    kvc_status (*k_topk)(const float *scores, int32_t heads, int64_t n, const int64_t *k, int64_t *keep);

    /* ---- model ---- */
    kvc_status (*model_upload)(const struct kvc_model *m, void **out);
    void (*model_free)(void *dm);

    /* ---- sessions ---- */
    kvc_status (*session_new)(void *dm, int64_t capacity_hint, void **out);
    void (*session_free)(void *ds);
    void (*session_clear)(void *ds); /* drop every row (arenas freed) */
    kvc_status (*session_copy)(void *dst, const void *src); /* dst: an exact copy of src's cache */
    int64_t (*cache_len)(void *ds, int32_t layer, int32_t h);
    const int64_t *(*cache_positions)(void *ds, int32_t layer, int32_t h);
    size_t (*cache_bytes)(void *ds);
    size_t (*peak_cache_bytes)(void *ds);
    kvc_status (*truncate)(void *ds, int32_t layer, const int64_t *new_len);
    /* Reserve room for `extra` more rows in every head of every layer (capacity hint). */
    kvc_status (*reserve_all)(void *ds, int64_t extra);

    /* One forward of n_ids ids then n_emb embedding rows at positions pos0.. of session ds; followers
     * receive every layer's new K/V rows. hook (may be NULL) runs when n > 1 for ds, and f_hooks[i]
     * for follower i. logits_row: KVC_ROW_NONE, KVC_ROW_ALL or a row. On failure the rows this call
     * appended are dropped from every layer a hook did not compact. */
    kvc_status (*forward)(void *ds, const int32_t *ids, int64_t n_ids, const float *emb, int64_t n_emb, int64_t pos0,
                          int64_t logits_row, float *logits, kvc_dev_hook hook, void *hook_user,
                          void *const *followers, const kvc_dev_hook *f_hooks, void *const *f_users, int32_t n_followers);
    /* One token for each of B sessions at positions pos[i]; logits [B, vocab]. */
    kvc_status (*forward_batch)(void *const *ds, int32_t B, const int32_t *ids, const int64_t *pos, float *logits);

    /* ---- presses on the device (called from hooks) ---- */
    /* Scores of the layer's rows into the session's device score buffer, [Hkv][len[h]]; protected
     * rows get max + 1 as on the CPU. KVC_ERR_UNSUPPORTED for a scorer the device does not have. */
    kvc_status (*score)(void *ds, const kvc_dev_ctx *ctx, const kvc_press_config *cfg, int32_t layer);
    /* TAKE's probe scores into the score buffer: for each KV head, the first real[h] rows scored by
     * the p accumulated probe queries qa [p, H, d] (host, fp32): softmax over those rows, mean over
     * the probes, average pooling `kernel` (padding counted), mean over the group's query heads. */
    kvc_status (*probe_score)(void *ds, int32_t layer, const float *qa, int64_t p, const int64_t *real, int32_t kernel);
    /* The score buffer to the host: out[h] receives len[h] (or lens[h] if lens) floats. */
    kvc_status (*scores_to_host)(void *ds, int32_t layer, const int64_t *lens, float *const *out);
    /* Top k[h] of the first lens[h] score rows of each head (higher first, then lower row); keep[h]
     * receives them sorted (caller-allocated, lens[h] entries), n_keep[h] = min(k[h], lens[h]). */
    kvc_status (*select_topk)(void *ds, int32_t layer, const int64_t *lens, const int64_t *k, int64_t *const *keep,
                              int64_t *n_keep);
    /* Keep rows keep[h][0 .. n_keep[h]) (increasing) of each head of `layer`, re-packed into an arena
     * sized for them plus `reserve`; the old arena is freed (real eviction). */
    kvc_status (*compact)(void *ds, int32_t layer, const int64_t *const *keep, const int64_t *n_keep, int64_t reserve);
    /* Host copies for the CPU fallback of scorers the device lacks: the layer's K and V per head
     * (k[h], v[h]: len[h] * d floats each), and rows [row0, row0 + rows) of an activation of ctx
     * (KVC_DEV_Q / ATTN: [rows, H*d]; O / RESID: [rows, D]). */
    kvc_status (*download_layer)(void *ds, int32_t layer, float *const *k, float *const *v);
    kvc_status (*download_ctx)(const kvc_dev_ctx *ctx, int32_t which, int64_t row0, int64_t rows, float *out);
    /* TADA: 1 - cos(R, R + O) averaged over the last w rows of ctx. */
    kvc_status (*dissimilarity)(const kvc_dev_ctx *ctx, int32_t w, double *out);
} kvc_cuda_api;

/* The one symbol libkvpress_c_cuda.so exports. */
typedef const kvc_cuda_api *(*kvc_cuda_get_api_fn)(void);
#define KVC_CUDA_GET_API "kvc_cuda_get_api"

#ifdef __cplusplus
}
#endif
#endif
