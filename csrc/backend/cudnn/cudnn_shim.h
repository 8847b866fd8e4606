/* The interface between the CUDA backend and its cuDNN attention (libkvpress_c_cudnn.so, sdpa_cudnn.cpp): plain C,
 * so the backend (nvcc) opens the library at run time with dlopen, as it opens cuBLAS, and a build or a machine
 * without cuDNN never needs it. The library is built only where the cuDNN and cuDNN frontend headers were found
 * (setup.py: the PyPI packages nvidia-cudnn-cu13 and nvidia-cudnn-frontend, downloaded into the build cache);
 * it links libcudnn.so.9, which the backend loads first (KVC_CUDNN, else the loader's search). */
#ifndef KVC_CUDNN_SHIM_H
#define KVC_CUDNN_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_CUDNN_SHIM_VERSION 1
#define KVC_CUDNN_SHIM_VERSION_SYMBOL "kvc_cudnn_shim_version"
#define KVC_CUDNN_SHIM_OPEN_SYMBOL "kvc_cudnn_shim_open"
#define KVC_CUDNN_SHIM_SDPA_SYMBOL "kvc_cudnn_shim_sdpa"

/* Results of the shim's calls. */
enum { KVC_CUDNN_OK = 0, KVC_CUDNN_NEED_WORKSPACE = 1, KVC_CUDNN_UNSUPPORTED = 2, KVC_CUDNN_ERROR = 3 };

/* One causal prefill attention over a ragged K/V store, each KV head a batch entry: entry h holds the g query heads
 * h g .. h g + g - 1 (q columns (h g + j) d of each of the n rows, row stride ldq) over rows [0, seq_kv[h]) of its
 * keys and values (k + h head_stride, v + h head_stride, rows of d), bottom-right causal: query i sees the rows
 * < seq_kv[h] - n + i + 1. bf16 in and out (o: the layout of q, row stride ldo), fp32 softmax. */
typedef struct kvc_cudnn_sdpa_args {
    const void *q;
    int64_t ldq;
    const void *k, *v;
    int64_t head_stride;    /* elements from one head's first key row (and value row) to the next head's */
    const int32_t *seq_q;   /* device int32 [Hkv], every entry n */
    const int32_t *seq_kv;  /* device int32 [Hkv]: the store's lengths (this call's rows included) */
    void *o;
    int64_t ldo;
    int64_t n, max_kv;      /* queries; an upper bound of seq_kv (the store's capacity) */
    int32_t Hkv, g, d;
    float scale;
    void *stream;           /* cudaStream_t */
} kvc_cudnn_sdpa_args;

typedef int32_t (*kvc_cudnn_shim_version_fn)(void);
/* A cuDNN handle on the stream; KVC_CUDNN_OK, else KVC_CUDNN_ERROR with the reason in why. */
typedef int (*kvc_cudnn_shim_open_fn)(void *stream, char *why, size_t why_cap);
/* Runs the attention (the plan for its shape built once and cached). KVC_CUDNN_NEED_WORKSPACE: *ws_need bytes of
 * device workspace are needed, call again with them; KVC_CUDNN_UNSUPPORTED: cuDNN has no plan for the shape (the
 * backend's own kernels run it); KVC_CUDNN_ERROR: a failure, the reason in why. */
typedef int (*kvc_cudnn_shim_sdpa_fn)(const kvc_cudnn_sdpa_args *a, void *ws, size_t ws_bytes, size_t *ws_need, char *why,
                                      size_t why_cap);

#ifdef __cplusplus
}
#endif
#endif
