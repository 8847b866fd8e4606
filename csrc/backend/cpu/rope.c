/* Rotary position embedding, in place on x[n, heads, d]. Two pairings of the head dimensions:
 * HALF rotates (i, i + d/2) (Hugging Face, Qwen2), ADJACENT rotates (2i, 2i + 1) (GGUF llama
 * weights, whose q/k rows the converter permuted). Angles in double for long positions. */
#include <math.h>

#include "../backend.h"
#include "../../include/kvpress_c.h"

void kvc_cpu_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq, int32_t pairing) {
    const int32_t half = d / 2;
#pragma omp parallel for schedule(static) if (n > 4)
    for (int64_t t = 0; t < n; t++) {
        float cs[512], sn[512]; /* d/2 <= 512 */
        for (int32_t i = 0; i < half; i++) {
            const double a = (double)pos[t] * inv_freq[i];
            cs[i] = (float)cos(a);
            sn[i] = (float)sin(a);
        }
        for (int32_t h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * d;
            for (int32_t i = 0; i < half; i++) {
                const int32_t ia = pairing == KVC_ROPE_ADJACENT ? 2 * i : i;
                const int32_t ib = pairing == KVC_ROPE_ADJACENT ? 2 * i + 1 : i + half;
                const float a = v[ia], b = v[ib];
                v[ia] = a * cs[i] - b * sn[i];
                v[ib] = a * sn[i] + b * cs[i];
            }
        }
    }
}
