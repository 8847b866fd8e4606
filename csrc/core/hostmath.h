/* Host fp32 math for the algorithms that run on the host whatever the device: ObservedAttention's scores
 * and Ada-KV's eviction loss (press/), the selections, the rows' forward and backward (train/). Implemented with the
 * CPU backend's kernels (backend/cpu/hostmath.c); arrays are row-major fp32 host memory. */
#ifndef KVC_HOSTMATH_H
#define KVC_HOSTMATH_H

#include <stdint.h>

#include "common.h"

/* Threads the host kernels use (kvc_set_num_threads). */
int kvc_host_threads(void);
/* C[m,n] (+)= A[m,k] B[n,k]^T (rows of A and C with strides lda, ldc; B contiguous) */
void kvc_host_gemm_nt(const float *a, int64_t lda, const float *b, float *c, int64_t ldc, int64_t m, int64_t n, int64_t k,
                      int accumulate);
/* C[m,n] (+)= A[m,k] B[k,n] (strides lda, ldb, ldc) */
void kvc_host_gemm_nn(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m,
                      int64_t n, int64_t k, int accumulate);
/* Softmax attention of m queries q_rows [m, d] on one head's rows k [len, d]: query i sees rows
 * [0, visible[i]); probs [m, len] (zeros past visible). One GEMM, then the softmax rows. */
void kvc_host_probs_rows(const float *q_rows, int64_t m, const float *k, int64_t len, int32_t d, float scale,
                         const int64_t *visible, float *probs);
/* The same with the scaled scores soft-capped (kvc_softcap; cap 0: none): the model's own attention (Gemma 2). */
void kvc_host_probs_rows_capped(const float *q_rows, int64_t m, const float *k, int64_t len, int32_t d, float scale,
                                float cap, const int64_t *visible, float *probs);
void kvc_host_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps);
/* In place: each of the `heads` heads of d values of each of n rows [n, heads d] normalised on its own (qwen3's q/k norm). */
void kvc_host_head_rmsnorm(float *x, int64_t n, int32_t heads, int32_t d, const float *w, float eps);
/* RoPE on host rows [n, heads d] at pos[n] (a negative position turns back); mscale multiplies the turned pairs
 * (LongRoPE's attention factor, kvc_model_rope; 1 for a plain rotation). */
void kvc_host_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                   int32_t pairing, float mscale);
void kvc_host_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim);
void kvc_host_add_bias(float *y, const float *b, int64_t rows, int64_t dim);
/* The top k of n scores: higher score first, then lower row (NaN lowest); out receives the k rows in
 * increasing order. KVC_ERR_NOMEM (never a silent substitute) when its scratch cannot be allocated. */
kvc_status kvc_host_topk_rows(const float *scores, int64_t n, int64_t k, int64_t *out);

#endif
