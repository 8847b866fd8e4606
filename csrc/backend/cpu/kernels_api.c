/* The exported kvc_kernel_* entry points of the CPU backend, called in place on the caller's arrays (the
 * GEMM benchmark times them without copies): argument checks with clear messages, then the CPU kernel.
 * kvc_device_kernel_* (engine/device.c) runs the same contracts through any device's table.
 * (kvc_kernel_rope_freqs and kvc_kernel_dequantize live with the model code.) */
#include <math.h>

#include "../../core/common.h"
#include "../../model/dequant.h"
#include "../../core/kv_type.h"
#include "cpu.h"
#include "kv_decode.h"
#include "quant.h"

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) return kvc_fail(KVC_ERR_ARG, __VA_ARGS__); \
    } while (0)

kvc_status kvc_kernel_matmul(const float *a, const float *b, float *c, int64_t m, int64_t n, int64_t k) {
    CHECK(a && b && c, "matmul: a, b and c must not be NULL");
    CHECK(m > 0 && n > 0 && k > 0, "matmul: sizes must be positive (m=%lld n=%lld k=%lld)", (long long)m,
          (long long)n, (long long)k);
    kvc_cpu_matmul(a, b, c, m, n, k);
    return KVC_OK;
}

/* path 0: the engine's pick, 1: the blocked GEMM, 2: the vectorised GEMV, 3: the plain-C GEMV; the
 * weights (the file's layout in w) packed as the CPU backend keeps them where the type has a packed
 * layout (quant.h). path 4: the vectorised GEMV on the file's layout (a matrix that is not packed). */
kvc_status kvc_kernel_matmul_native(int32_t type, const float *a, const void *w, float *c, int64_t m, int64_t n, int64_t k,
                                    int32_t path) {
    CHECK(a && w && c, "matmul_native: a, w and c must not be NULL");
    CHECK(m > 0 && n > 0 && k > 0, "matmul_native: sizes must be positive (m=%lld n=%lld k=%lld)", (long long)m,
          (long long)n, (long long)k);
    CHECK(path >= 0 && path <= 4, "matmul_native: path must be 0..4, got %d", path);
    if (!kvc_cpu_wtype_ok(type))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "matmul_native: ggml type %s (%d) is not kept natively on the CPU",
                        ggml_type_name(type), type);
    size_t row_bytes = 0;
    KVC_TRY(ggml_nbytes(type, k, &row_bytes));
    kvc_wmat wm = {w, type, row_bytes, n, 0};
    void *packed = NULL;
    if (path != 4 && kvc_cpu_wtype_packs(type)) {
        if (!(packed = kvc_malloc(row_bytes * (size_t)n, "packed weights"))) return KVC_ERR_NOMEM;
        for (int64_t j = 0; j < n; j++) kvc_cpu_wpack_row(type, n, row_bytes, packed, j, (const char *)w + (size_t)j * row_bytes);
        wm.p = packed;
        wm.packed = 1;
    }
    if (path == 0) kvc_cpu_gemm_w(a, k, wm, c, n, m, n, k, 0);
    else if (path == 1) kvc_cpu_gemm_packed(a, k, wm, c, n, m, n, k, 0);
    else if (path == 2 || path == 4) kvc_cpu_qgemv(a, k, wm, c, n, m, n, k, 0);
    else kvc_cpu_qgemv_ref(a, k, wm, c, n, m, n, k, 0);
    kvc_free(packed);
    return KVC_OK;
}

kvc_status kvc_kernel_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
    CHECK(x && w && y, "rmsnorm: x, w and y must not be NULL");
    CHECK(rows > 0 && dim > 0, "rmsnorm: sizes must be positive (rows=%lld dim=%lld)", (long long)rows,
          (long long)dim);
    CHECK(eps > 0 && isfinite(eps), "rmsnorm: eps must be finite and > 0 (got %g)", (double)eps);
    kvc_cpu_rmsnorm(x, dim, w, y, dim, rows, dim, eps);
    return KVC_OK;
}

kvc_status kvc_kernel_rope(float *x, const int64_t *pos, int64_t n, int32_t heads, int32_t d, const float *inv_freq,
                           int32_t pairing) {
    CHECK(x && pos && inv_freq, "rope: x, pos and inv_freq must not be NULL");
    CHECK(n > 0 && heads > 0, "rope: sizes must be positive (n=%lld heads=%d)", (long long)n, heads);
    CHECK(d >= 2 && d % 2 == 0 && d <= 1024, "rope: head_dim must be even and in [2, 1024] (got %d)", d);
    CHECK(pairing == KVC_ROPE_HALF || pairing == KVC_ROPE_ADJACENT,
          "rope: pairing must be KVC_ROPE_HALF (0) or KVC_ROPE_ADJACENT (1), got %d", pairing);
    for (int64_t i = 0; i < n; i++)
        CHECK(pos[i] >= 0, "rope: position %lld is negative (%lld)", (long long)i, (long long)pos[i]);
    kvc_cpu_rope(x, (int64_t)heads * d, pos, n, heads, d, inv_freq, pairing, 1.0f);
    return KVC_OK;
}

kvc_status kvc_kernel_swiglu(const float *gate, const float *up, float *out, int64_t rows, int64_t dim) {
    CHECK(gate && up && out, "swiglu: gate, up and out must not be NULL");
    CHECK(rows > 0 && dim > 0, "swiglu: sizes must be positive (rows=%lld dim=%lld)", (long long)rows,
          (long long)dim);
    kvc_cpu_swiglu(gate, up, out, rows, dim);
    return KVC_OK;
}

/* plain arrays as the attention's row source: k[h], v[h] [rows, d], in place */
typedef struct arrays_src {
    const float *const *k, *const *v;
    int32_t d;
} arrays_src;
static const float *array_keys(const void *p, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    const arrays_src *a = p;
    *ld = a->d;
    return a->k[h] + r0 * a->d;
}
static const float *array_values(const void *p, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    const arrays_src *a = p;
    *ld = a->d;
    return a->v[h] + r0 * a->d;
}

kvc_status kvc_kernel_attention(const float *q, int64_t n, int32_t H, int32_t Hkv, int32_t d, const float *const *k,
                                const float *const *v, const int64_t *past_len, float scale, float *out) {
    CHECK(q && k && v && past_len && out, "attention: q, k, v, past_len and out must not be NULL");
    CHECK(n > 0 && H > 0 && Hkv > 0 && d > 0, "attention: sizes must be positive (n=%lld H=%d Hkv=%d d=%d)",
          (long long)n, H, Hkv, d);
    CHECK(H % Hkv == 0, "attention: the query heads H=%d must be a multiple of the KV heads Hkv=%d", H, Hkv);
    CHECK(d <= 256, "attention: head_dim %d > 256 is not supported", d);
    CHECK(isfinite(scale), "attention: scale must be finite");
    for (int32_t h = 0; h < Hkv; h++) {
        CHECK(k[h] && v[h], "attention: k[%d] or v[%d] is NULL", h, h);
        CHECK(past_len[h] >= 0, "attention: past_len[%d] is negative (%lld)", h, (long long)past_len[h]);
    }
    const arrays_src a = {k, v, d};
    const kvc_cpu_kvsrc src = {&a, array_keys, array_values, NULL, 0, NULL, NULL, 0};
    kvc_cpu_attention(q, (int64_t)H * d, n, H, Hkv, d, &src, past_len, NULL, scale, 0.0f, out, (int64_t)H * d);
    return KVC_OK;
}

kvc_status kvc_kernel_kv_decode(const kvc_kv_format *fmt, int32_t key_block, const void *src, size_t src_bytes,
                                int64_t r0, int64_t rows, int32_t w, int32_t path, float *out, int32_t *vectorised) {
    CHECK(fmt && src && out, "kv_decode: fmt, src and out must not be NULL");
    CHECK(w >= 1 && w <= 1024, "kv_decode: w must be in [1, 1024], got %d", w);
    CHECK(fmt->type >= 0 && fmt->type < KVC_KV_N_TYPES, "kv_decode: type %d is not a storage type", fmt->type);
    KVC_TRY(kvc_kv_format_check(fmt, w));
    CHECK(r0 >= 0 && rows >= 0, "kv_decode: r0 (%lld) and rows (%lld) must be >= 0", (long long)r0, (long long)rows);
    CHECK(path == 0 || path == 1, "kv_decode: path must be 0 (the attention's decoder) or 1 (plain C), got %d", path);
    CHECK(key_block == 0 || kvc_kv_type_key_blocks(fmt->type), "kv_decode: key_block 1 needs a KIVI type, got %s",
          kvc_kv_type_name(fmt->type));
    if (vectorised) *vectorised = path == 0 && kvc_cpu_kv_decode_simd();
    if (key_block) {
        CHECK(r0 + rows <= fmt->group, "kv_decode: rows [%lld, %lld) are outside a key block of %d rows", (long long)r0,
              (long long)(r0 + rows), fmt->group);
        CHECK(src_bytes >= kvc_kivi_block_bytes(fmt, w), "kv_decode: a key block of %d x %d needs %zu bytes, src has %zu",
              fmt->group, w, kvc_kivi_block_bytes(fmt, w), src_bytes);
        if (path == 0) kvc_cpu_kivi_decode_block(fmt, src, w, (int32_t)r0, (int32_t)rows, out);
        else kvc_kivi_decode_block(fmt, src, w, (int32_t)r0, (int32_t)rows, out);
        return KVC_OK;
    }
    const size_t rb = kvc_kv_row_bytes(fmt, w);
    CHECK(src_bytes / rb >= (size_t)(r0 + rows), "kv_decode: rows [%lld, %lld) of %zu bytes need %zu bytes, src has %zu",
          (long long)r0, (long long)(r0 + rows), rb, (size_t)(r0 + rows) * rb, src_bytes);
    const char *p = (const char *)src + (size_t)r0 * rb;
    if (path == 0) kvc_cpu_kv_decode_rows(fmt, p, rb, rows, w, out);
    else
        for (int64_t i = 0; i < rows; i++) kvc_kv_decode_row(fmt, p + (size_t)i * rb, w, out + i * w);
    return KVC_OK;
}

kvc_status kvc_kernel_kv_encode(const kvc_kv_format *fmt, const float *x, int64_t rows, int32_t w, int32_t path,
                                void *dst, size_t dst_bytes) {
    CHECK(fmt && x && dst, "kv_encode: fmt, x and dst must not be NULL");
    CHECK(w >= 1 && w <= 1024, "kv_encode: w must be in [1, 1024], got %d", w);
    CHECK(fmt->type >= 0 && fmt->type < KVC_KV_N_TYPES, "kv_encode: type %d is not a storage type", fmt->type);
    KVC_TRY(kvc_kv_format_check(fmt, w));
    CHECK(rows >= 0, "kv_encode: rows must be >= 0, got %lld", (long long)rows);
    CHECK(path == 0 || path == 1, "kv_encode: path must be 0 (the store's encoder) or 1 (plain C), got %d", path);
    const size_t rb = kvc_kv_row_bytes(fmt, w);
    CHECK(dst_bytes / rb >= (size_t)rows, "kv_encode: %lld rows of %zu bytes need %zu bytes, dst has %zu", (long long)rows,
          rb, rb * (size_t)rows, dst_bytes);
    for (int64_t i = 0; i < rows; i++) {
        if (path == 0) kvc_cpu_kv_encode_row(fmt, x + i * w, w, (char *)dst + (size_t)i * rb);
        else kvc_kv_encode_row(fmt, x + i * w, w, (char *)dst + (size_t)i * rb);
    }
    return KVC_OK;
}

kvc_status kvc_kernel_kv_tile(const kvc_kv_format *fmt, const void *keys, size_t key_bytes, int64_t r0,
                              const void *values, size_t value_bytes, int32_t n, int32_t d, int32_t rows,
                              const float *q, float *s, const float *p, float *o, int32_t *int16) {
    CHECK(fmt && keys && values && q && s && p && o, "kv_tile: no argument but int16 may be NULL");
    CHECK(fmt->type != KVC_KV_F32 && fmt->type != KVC_KV_NATIVE && kvc_kv_type_name(fmt->type),
          "kv_tile: the type must be f16, bf16, q8_0, kivi4 or kivi2 (f32 rows are read in place), got %s",
          kvc_kv_type_name(fmt->type) ? kvc_kv_type_name(fmt->type) : "an unknown code");
    CHECK(d >= 1 && d <= 1024, "kv_tile: d must be in [1, 1024], got %d", d);
    KVC_TRY(kvc_kv_format_check(fmt, d));
    CHECK(n >= 1 && n <= KVC_KV_TILE && rows >= 1, "kv_tile: n must be in [1, %d] and rows >= 1 (n=%d rows=%d)",
          KVC_KV_TILE, n, rows);
    const size_t rb = kvc_kv_row_bytes(fmt, d);
    const int blocks = kvc_kv_type_key_blocks(fmt->type);
    if (blocks) {
        CHECK(r0 >= 0 && r0 <= fmt->group - n, "kv_tile: rows [%lld, %lld) are outside a key block of %d rows",
              (long long)r0, (long long)(r0 + n), fmt->group);
        CHECK(key_bytes >= kvc_kivi_block_bytes(fmt, d), "kv_tile: a key block of %d x %d needs %zu bytes, keys has %zu",
              fmt->group, d, kvc_kivi_block_bytes(fmt, d), key_bytes);
    } else {
        CHECK(r0 >= 0 && r0 <= INT32_MAX && key_bytes / rb >= (size_t)r0 + (size_t)n,
              "kv_tile: key rows [%lld, %lld) need %zu bytes, keys has %zu", (long long)r0, (long long)(r0 + n),
              rb * (size_t)(r0 < 0 ? 0 : r0 + n), key_bytes);
    }
    CHECK(value_bytes / rb >= (size_t)n, "kv_tile: %d value rows need %zu bytes, values has %zu", n, rb * n, value_bytes);
    if (!kvc_cpu_kv_tile_ok(fmt, d))
        return kvc_fail(KVC_ERR_UNSUPPORTED, "kv_tile: this build decodes %s tiles of head_dim %d (group %d) to fp32",
                        kvc_kv_type_name(fmt->type), d, fmt->group);
    if (int16) *int16 = kvc_cpu_kv_step_int16(fmt->type);
    const kvc_kv_tile t = {fmt, d, blocks ? keys : (const uint8_t *)keys + (size_t)r0 * rb, blocks ? 0 : rb,
                           blocks ? (int32_t)r0 : 0, values, rb};
    /* the whole tile, preparing the queries as a task's first tile does; rows stored alone: the second half
     * scored again as a later tile of the task, reusing them */
    kvc_kv_query qc;
    kvc_kv_query_reset(&qc);
    kvc_cpu_kv_scores(&t, q, rows, n, s, n, &qc);
    const int32_t h = n / 2;
    if (!blocks && h > 0) {
        const kvc_kv_tile rest = {fmt, d, t.k + (size_t)h * rb, rb, 0, t.v + (size_t)h * rb, rb};
        kvc_cpu_kv_scores(&rest, q, rows, n - h, s + h, n, &qc);
    }
    kvc_cpu_kv_pv(&t, p, n, rows, n, o);
    return KVC_OK;
}
