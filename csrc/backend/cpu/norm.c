/* RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, row by row (sum of squares in double). */
#include <math.h>

#include "../backend.h"

void kvc_cpu_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        double ss = 0;
        for (int64_t i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt(ss / dim + eps));
        for (int64_t i = 0; i < dim; i++) yr[i] = xr[i] * inv * w[i];
    }
}
