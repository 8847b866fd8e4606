/* The kernel table: every numeric kernel the engine and the presses call, as function pointers.
 * The CPU backend (backend/cpu) is the readable reference; the CUDA backend implements the same
 * table and is tested against it. Arrays are row-major fp32; no kernel allocates more than O(tile). */
#ifndef KVC_BACKEND_H
#define KVC_BACKEND_H

#include <stdint.h>

typedef struct kvc_backend {
    const char *name;
    /* C[m,n] = A[m,k] * B[n,k]^T */
    void (*matmul)(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k);
    /* y[r,:] = x[r,:] * rsqrt(mean(x[r,:]^2) + eps) * w   (y may alias x) */
    void (*rmsnorm)(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps);
    /* in place on x[n, heads, d], positions pos[n] */
    void (*rope)(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d,
                 const float *inv_freq, int32_t pairing);
    /* out = silu(gate) * up, elementwise over rows*dim (out may alias gate) */
    void (*swiglu)(const float *gate, const float *up, float *out, int64_t rows, int64_t dim);
    /* y[r,:] += b[:] over rows */
    void (*add_bias)(float *y, const float *b, int64_t rows, int64_t dim);
    /* y += x, n elements */
    void (*add)(float *y, const float *x, int64_t n);
    /* causal GQA attention over a ragged cache; see kvc_kernel_attention in kvpress_c.h */
    void (*attention)(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d,
                      const float *const *k, const float *const *v, const int64_t *past_len,
                      float scale, float *out);
} kvc_backend;

const kvc_backend *kvc_cpu_backend(void);

/* GEMM selection (backend/cpu/gemm.c) */
void kvc_cpu_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k);

#endif
