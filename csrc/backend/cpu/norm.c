/* RMSNorm: y[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * w (y may alias x; rows have their strides). The sum of squares is
 * accumulated in double: rows are short (the hidden size) and this keeps it exact to fp32 output. */
#include <omp.h>

#include "cpu.h"

void kvc_cpu_rmsnorm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows, int64_t dim,
                     float eps) {
    const int par = rows > 1 && rows * dim >= 32768 && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* Qwen3's q/k norm: every head of every row normalised on its own (rows in parallel, heads serial). */
void kvc_cpu_head_rmsnorm(float *x, int64_t ld, int64_t n, int32_t heads, int32_t d, const float *w, float eps) {
    const int par = n > 1 && n * heads * d >= 32768 && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t r = 0; r < n; r++) kvc_cpu_rmsnorm(x + r * ld, d, w, x + r * ld, d, heads, d, eps);
}
