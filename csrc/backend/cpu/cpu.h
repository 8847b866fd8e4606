/* Kernels of the CPU backend (one family per file). */
#ifndef KVC_CPU_H
#define KVC_CPU_H

#include <stdint.h>

void kvc_cpu_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps);
void kvc_cpu_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq, int32_t pairing);
void kvc_cpu_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim);
void kvc_cpu_add(float *y, const float *x, int64_t n);
void kvc_cpu_add_bias(float *y, const float *b, int64_t rows, int64_t dim);
void kvc_cpu_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d, const float *const *k,
                       const float *const *v, const int64_t *past_len, float scale, float *out);

#endif
