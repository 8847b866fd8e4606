/* Rotary position embedding, in place on the n rows of x (stride ld), `heads` heads of d values each. For each pair (a, b) of dimensions and
 * i < d/2, with angle = pos * inv_freq[i]:  a' = a cos - b sin,  b' = a sin + b cos.
 * KVC_ROPE_HALF pairs (i, i + d/2) (Hugging Face layout, Qwen2); KVC_ROPE_ADJACENT pairs (2i, 2i+1)
 * (GGUF llama weights, whose q/k rows the converter interleaved). cos and sin are multiplied by mscale
 * (LongRoPE's attention factor) on the pairs that turn; a pair of frequency 0 (the pass-through part of a
 * partial rotary embedding) is left as it is. Angles, cos and sin are computed
 * in double: positions reach 1e5+, where a float angle would already be off by ~1e-2 rad. */
#include <omp.h>

#include "../../include/kvpress_c.h"
#include "cpu.h"

#define HALF_MAX 512 /* d <= 1024 (checked by kvc_kernel_rope) */

void kvc_cpu_rope(float *x, int64_t ld, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                  int32_t pairing, float mscale) {
    const int32_t half = d / 2;
    const int par = n > 1 && n * heads * d >= 16384 && !omp_in_parallel();
#pragma omp parallel for schedule(static) num_threads(kvc_cpu_threads()) if (par)
    for (int64_t t = 0; t < n; t++) {
        float cs[HALF_MAX], sn[HALF_MAX];
        for (int32_t i = 0; i < half; i++) {
            const double ang = (double)pos[t] * (double)inv_freq[i];
            const double ms = inv_freq[i] != 0.0f ? (double)mscale : 1.0;
            cs[i] = (float)(ms * cos(ang));
            sn[i] = (float)(ms * sin(ang));
        }
        for (int32_t h = 0; h < heads; h++) {
            float *v = x + t * ld + (int64_t)h * d;
            if (pairing == KVC_ROPE_ADJACENT) {
                for (int32_t i = 0; i < half; i++) {
                    const float a = v[2 * i], b = v[2 * i + 1];
                    v[2 * i] = a * cs[i] - b * sn[i];
                    v[2 * i + 1] = a * sn[i] + b * cs[i];
                }
            } else {
                float *va = v, *vb = v + half;
#pragma omp simd
                for (int32_t i = 0; i < half; i++) {
                    const float a = va[i], b = vb[i];
                    va[i] = a * cs[i] - b * sn[i];
                    vb[i] = a * sn[i] + b * cs[i];
                }
            }
        }
    }
}
