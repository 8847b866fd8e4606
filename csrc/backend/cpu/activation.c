/* Elementwise kernels: SwiGLU (silu(gate) * up), residual add, bias add. */
#include <math.h>

#include "../backend.h"

void kvc_cpu_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    const int64_t n = rows * dim;
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void kvc_cpu_add(float *y, const float *x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

void kvc_cpu_add_bias(float *y, const float *b, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++)
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] += b[i];
}
