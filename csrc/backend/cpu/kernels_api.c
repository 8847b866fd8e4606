/* The exported kvc_kernel_* entry points: argument checks, then the CPU kernel. */
#include "../../core/common.h"
#include "../backend.h"
#include "cpu.h"

#define CHECK(cond, ...) \
    if (!(cond)) return kvc_fail(KVC_ERR_ARG, __VA_ARGS__)

kvc_status kvc_kernel_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    CHECK(a && b && c, "matmul: null pointer");
    CHECK(m > 0 && n > 0 && k > 0, "matmul: sizes must be positive (m=%lld n=%lld k=%lld)", (long long)m, (long long)n, (long long)k);
    kvc_cpu_matmul(a, b, c, m, n, k);
    return KVC_OK;
}

kvc_status kvc_kernel_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
    CHECK(x && w && y, "rmsnorm: null pointer");
    CHECK(rows > 0 && dim > 0, "rmsnorm: sizes must be positive");
    CHECK(eps > 0, "rmsnorm: eps must be > 0");
    kvc_cpu_rmsnorm(x, w, y, rows, dim, eps);
    return KVC_OK;
}

kvc_status kvc_kernel_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq, int32_t pairing) {
    CHECK(x && pos && inv_freq, "rope: null pointer");
    CHECK(n > 0 && heads > 0, "rope: sizes must be positive");
    CHECK(d > 0 && d % 2 == 0 && d <= 1024, "rope: head_dim must be even, in [2, 1024] (got %d)", d);
    CHECK(pairing == KVC_ROPE_HALF || pairing == KVC_ROPE_ADJACENT, "rope: pairing must be 0 (half) or 1 (adjacent), got %d", pairing);
    for (int64_t i = 0; i < n; i++) CHECK(pos[i] >= 0, "rope: negative position at %lld", (long long)i);
    kvc_cpu_rope(x, pos, n, heads, d, inv_freq, pairing);
    return KVC_OK;
}

kvc_status kvc_kernel_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    CHECK(gate && up && out, "swiglu: null pointer");
    CHECK(rows > 0 && dim > 0, "swiglu: sizes must be positive");
    kvc_cpu_swiglu(gate, up, out, rows, dim);
    return KVC_OK;
}

kvc_status kvc_kernel_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d, const float *const *k,
                                const float *const *v, const int64_t *past_len, float scale, float *out) {
    CHECK(q && k && v && past_len && out, "attention: null pointer");
    CHECK(n > 0 && H > 0 && Hkv > 0 && d > 0, "attention: sizes must be positive");
    CHECK(H % Hkv == 0, "attention: H (%d) must be a multiple of Hkv (%d)", H, Hkv);
    CHECK(d <= 256, "attention: head_dim %d > 256 is not supported", d);
    for (int32_t h = 0; h < Hkv; h++) {
        CHECK(k[h] && v[h], "attention: null key/value pointer for head %d", h);
        CHECK(past_len[h] >= 0, "attention: negative past length for head %d", h);
    }
    kvc_cpu_attention(q, n, H, Hkv, d, k, v, past_len, scale, out);
    return KVC_OK;
}
