/* Elementwise kernels: SwiGLU (silu(gate) * up, silu(g) = g / (1 + exp(-g))), residual add, bias
 * add. Memory-bound: threads only for large arrays (a fork/join costs microseconds). */
#include <math.h>
#include <omp.h>

#include "cpu.h"

#define PAR_MIN 65536 /* elements from which a kernel runs on several threads */

/* out[i] = silu(gate[i]) * up[i] for i < n */
static void swiglu_span(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = kvc_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = kvc_exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void kvc_cpu_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    const int64_t n = rows * dim;
    const int nt = n >= PAR_MIN && !omp_in_parallel() ? kvc_cpu_threads() : 1;
    const int64_t span = ((n + nt - 1) / nt + 15) / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        const int64_t i0 = (int64_t)t * span;
        if (i0 < n) swiglu_span(gate + i0, up + i0, out + i0, n - i0 < span ? n - i0 : span);
    }
}

/* gu[r, :F] = gelu_tanh(gu[r, :F]) * gu[r, F:2F] (GeGLU; scalar: Gemma models only, the tanh in double
 * keeps it within float rounding of transformers' gelu_pytorch_tanh) */
void kvc_cpu_geglu_rows(float *gu, int64_t ld, int64_t rows, int64_t F) {
    const int par = rows > 1 && rows * F >= PAR_MIN && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t r = 0; r < rows; r++) {
        float *g = gu + r * ld;
        const float *u = g + F;
        for (int64_t i = 0; i < F; i++) {
            const double x = g[i];
            g[i] = (float)(0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))) * u[i];
        }
    }
}

/* x[r, :cols] *= alpha for each row of stride ld */
void kvc_cpu_scale_rows(float *x, int64_t ld, int64_t rows, int64_t cols, float alpha) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < cols; i++) x[r * ld + i] *= alpha;
}

/* gu[r, :F] = silu(gu[r, :F]) * gu[r, F:2F] for each row of stride ld (the fused gate|up GEMM output) */
void kvc_cpu_swiglu_rows(float *gu, int64_t ld, int64_t rows, int64_t F) {
    const int par = rows > 1 && rows * F >= PAR_MIN && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t r = 0; r < rows; r++) swiglu_span(gu + r * ld, gu + r * ld + F, gu + r * ld, F);
}

void kvc_cpu_add(float *y, const float *x, int64_t n) {
    const int par = n >= PAR_MIN && !omp_in_parallel();
#pragma omp parallel for simd schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

void kvc_cpu_add_bias(float *y, int64_t ld, const float *b, int64_t rows, int64_t dim) {
    const int par = rows > 1 && rows * dim >= PAR_MIN && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ld;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] += b[i];
    }
}
