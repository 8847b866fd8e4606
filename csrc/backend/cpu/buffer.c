/* Host buffers and K/V stores (host.h): the memory of the CPU backend and of the emulated device.
 * Every allocation is counted by category, so both report memory as the CUDA backend does. */
#include <stdlib.h>
#include <string.h>

#include "../../core/kv_layout.h"
#include "../../model/dequant.h"
#include "host.h"
#include "quant.h"

/* ---- counters -------------------------------------------------------------------------------- */

void kvc_host_stats_add(kvc_host_stats *s, int32_t cat, int64_t bytes) {
    if (!s) return;
    const int64_t c = atomic_fetch_add(&s->cur[cat], bytes) + bytes;
    const int64_t t = atomic_fetch_add(&s->total, bytes) + bytes;
    int64_t p = atomic_load(&s->peak_cat[cat]);
    while (c > p && !atomic_compare_exchange_weak(&s->peak_cat[cat], &p, c)) {}
    p = atomic_load(&s->peak);
    while (t > p && !atomic_compare_exchange_weak(&s->peak, &p, t)) {}
}

void kvc_host_stats_read(const kvc_host_stats *s, int64_t *out) {
    out[KVC_STAT_CURRENT] = atomic_load(&s->total);
    out[KVC_STAT_PEAK] = atomic_load(&s->peak);
    out[KVC_STAT_WEIGHTS] = atomic_load(&s->cur[KVC_MEM_WEIGHTS]);
    out[KVC_STAT_CACHE] = atomic_load(&s->cur[KVC_MEM_CACHE]);
    out[KVC_STAT_CACHE_PEAK] = atomic_load(&s->peak_cat[KVC_MEM_CACHE]);
    out[KVC_STAT_ACT] = atomic_load(&s->cur[KVC_MEM_ACT]);
    out[KVC_STAT_ACT_PEAK] = atomic_load(&s->peak_cat[KVC_MEM_ACT]);
    out[KVC_STAT_DEVICE_TOTAL] = 0;
}

void kvc_host_stats_reset_peak(kvc_host_stats *s) {
    atomic_store(&s->peak, atomic_load(&s->total));
    for (int c = 0; c < 3; c++) atomic_store(&s->peak_cat[c], atomic_load(&s->cur[c]));
}

/* ---- buffers ----------------------------------------------------------------------------------- */

size_t kvc_hbuf_bytes(int32_t dtype, int64_t n) {
    if (!kvc_dtype_is_wtype(dtype)) return (size_t)n * kvc_dtype_size(dtype);
    size_t b = 0;
    return ggml_nbytes(dtype - KVC_WTYPE_BASE, n, &b) == KVC_OK ? b : (size_t)-1;
}

kvc_status kvc_hbuf_alloc(kvc_host_stats *st, int32_t dtype, int64_t n, int32_t cat, const char *what, kvc_buf **out) {
    *out = NULL;
    size_t bytes;
    if (kvc_dtype_is_wtype(dtype)) {
        if (n < 0 || (bytes = kvc_hbuf_bytes(dtype, n)) == (size_t)-1)
            return kvc_fail(KVC_ERR_INTERNAL, "%s: %lld values are not whole %s blocks", what, (long long)n,
                            ggml_type_name(dtype - KVC_WTYPE_BASE));
    } else if (n < 0 || kvc_mul_ok((size_t)n, kvc_dtype_size(dtype), &bytes) != 0)
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: %s (%lld elements)", what, (long long)n);
    kvc_buf *b = calloc(1, sizeof *b);
    if (!b) return kvc_fail(KVC_ERR_NOMEM, "out of memory: %s", what);
    b->p = kvc_malloc(bytes, what);
    if (!b->p) {
        free(b);
        return KVC_ERR_NOMEM;
    }
    b->n = n;
    b->dtype = dtype;
    b->cat = cat;
    b->bytes = bytes;
    b->stats = st;
    /* the decode GEMV's interleaved layout for the types that have one (a weight is one matrix) */
    b->packed = kvc_dtype_is_wtype(dtype) && kvc_cpu_wtype_packs(dtype - KVC_WTYPE_BASE);
    kvc_host_stats_add(st, cat, (int64_t)bytes);
    *out = b;
    return KVC_OK;
}

kvc_status kvc_hbuf_wrap(int32_t dtype, int64_t n, const void *p, const char *what, kvc_buf **out) {
    *out = NULL;
    if (!p || n < 0 || kvc_hbuf_bytes(dtype, n) == (size_t)-1)
        return kvc_fail(KVC_ERR_INTERNAL, "%s: cannot wrap %lld values of dtype %d", what, (long long)n, dtype);
    kvc_buf *b = calloc(1, sizeof *b);
    if (!b) return kvc_fail(KVC_ERR_NOMEM, "out of memory: %s", what);
    b->p = (void *)p; /* never written: upload refuses a buffer without stats */
    b->n = n;
    b->dtype = dtype;
    b->cat = KVC_MEM_WEIGHTS;
    b->bytes = kvc_hbuf_bytes(dtype, n);
    *out = b;
    return KVC_OK;
}

void kvc_hbuf_free(kvc_buf *b) {
    if (!b) return;
    if (b->stats) {
        kvc_host_stats_add(b->stats, b->cat, -(int64_t)b->bytes);
        kvc_free(b->p);
    }
    free(b);
}

static int float_dtype(int32_t t) { return t == KVC_F32 || t == KVC_BF16; }

kvc_status kvc_hbuf_upload(kvc_view dst, int64_t rows, int64_t cols, const void *src, int32_t src_dtype) {
    const int32_t t = dst.buf->dtype;
    if (!dst.buf->stats) return kvc_fail(KVC_ERR_INTERNAL, "upload into a read-only buffer (weights mapped from the file)");
    if (kvc_dtype_is_wtype(t)) { /* the file's blocks, row by row */
        if (src_dtype != t) return kvc_fail(KVC_ERR_INTERNAL, "upload: dtype %d into a native weight buffer of dtype %d", src_dtype, t);
        const size_t rb = kvc_hbuf_bytes(t, cols);
        if (dst.buf->packed) { /* rows of the matrix [n / cols, cols] that the buffer is, scattered */
            if (dst.ld != cols || dst.off % cols)
                return kvc_fail(KVC_ERR_INTERNAL, "upload: a packed weight takes whole rows");
            for (int64_t r = 0; r < rows; r++)
                kvc_cpu_wpack_row(t - KVC_WTYPE_BASE, dst.buf->n / cols, rb, dst.buf->p, dst.off / cols + r,
                                  (const char *)src + (size_t)r * rb);
            return KVC_OK;
        }
        for (int64_t r = 0; r < rows; r++) memcpy(kvc_hbuf_at(dst, r, 0), (const char *)src + (size_t)r * rb, rb);
        return KVC_OK;
    }
    if (float_dtype(t) ? src_dtype != KVC_F32 : src_dtype != t)
        return kvc_fail(KVC_ERR_INTERNAL, "upload: %d elements into a buffer of dtype %d", src_dtype, t);
    for (int64_t r = 0; r < rows; r++) {
        char *d = kvc_hbuf_at(dst, r, 0);
        if (t == KVC_BF16) {
            const float *s = (const float *)src + r * cols;
            uint16_t *o = (uint16_t *)d;
            for (int64_t c = 0; c < cols; c++) o[c] = kvc_f32_to_bf16(s[c]);
        } else {
            memcpy(d, (const char *)src + (size_t)(r * cols) * kvc_dtype_size(t), (size_t)cols * kvc_dtype_size(t));
        }
    }
    return KVC_OK;
}

kvc_status kvc_hbuf_download(kvc_view src, int64_t rows, int64_t cols, void *dst, int32_t dst_dtype) {
    const int32_t t = src.buf->dtype;
    if (kvc_dtype_is_wtype(t)) { /* decoded to f32 (the embedding's rows) */
        if (dst_dtype != KVC_F32) return kvc_fail(KVC_ERR_INTERNAL, "download: a native weight buffer gives f32 only");
        const size_t rb = kvc_hbuf_bytes(t, cols);
        if (src.buf->packed && (src.ld != cols || src.off % cols))
            return kvc_fail(KVC_ERR_INTERNAL, "download: a packed weight gives whole rows");
        const kvc_wmat w = {src.buf->p, t - KVC_WTYPE_BASE, rb, src.buf->n / cols, src.buf->packed};
        const int64_t be = ggml_block_elems(w.type), nb = cols / be, step = 4096 / (int64_t)ggml_block_bytes(w.type);
        uint8_t raw[4096]; /* a packed row's blocks are apart: gathered a few KB at a time */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < nb; b += step) {
                const int64_t nbk = nb - b < step ? nb - b : step;
                const void *blk = kvc_cpu_wrow_blocks(w, src.off / cols + r, b, nbk, raw);
                KVC_TRY(ggml_dequantize(w.type, blk, (size_t)nbk * ggml_block_bytes(w.type), (float *)dst + r * cols + b * be,
                                        nbk * be));
            }
        return KVC_OK;
    }
    if (float_dtype(t) ? dst_dtype != KVC_F32 : dst_dtype != t)
        return kvc_fail(KVC_ERR_INTERNAL, "download: dtype %d from a buffer of dtype %d", dst_dtype, t);
    for (int64_t r = 0; r < rows; r++) {
        const char *s = kvc_hbuf_at(src, r, 0);
        if (t == KVC_BF16) {
            const uint16_t *i = (const uint16_t *)s;
            float *o = (float *)dst + r * cols;
            for (int64_t c = 0; c < cols; c++) o[c] = kvc_bf16_to_f32v(i[c]);
        } else {
            memcpy((char *)dst + (size_t)(r * cols) * kvc_dtype_size(t), s, (size_t)cols * kvc_dtype_size(t));
        }
    }
    return KVC_OK;
}

kvc_status kvc_frows_get(kvc_view v, int64_t rows, int64_t cols, int load, kvc_frows *out) {
    memset(out, 0, sizeof *out);
    if (v.buf->dtype == KVC_F32) {
        out->p = (float *)kvc_hbuf_at(v, 0, 0);
        out->ld = v.ld;
        return KVC_OK;
    }
    if (v.buf->dtype != KVC_BF16) return kvc_fail(KVC_ERR_INTERNAL, "a float view of a dtype %d buffer", v.buf->dtype);
    size_t n;
    if (kvc_mul_ok((size_t)(rows > 0 ? rows : 1), (size_t)(cols > 0 ? cols : 1), &n))
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: f32 view");
    out->tmp = kvc_malloc(n * sizeof(float), "f32 copy of a bf16 view");
    if (!out->tmp) return KVC_ERR_NOMEM;
    out->p = out->tmp;
    out->ld = cols;
    if (load) kvc_hbuf_download(v, rows, cols, out->tmp, KVC_F32);
    return KVC_OK;
}

void kvc_frows_put(kvc_view v, int64_t rows, int64_t cols, kvc_frows *f) {
    if (f->tmp) kvc_hbuf_upload(v, rows, cols, f->tmp, KVC_F32);
    kvc_frows_drop(f);
}

void kvc_frows_drop(kvc_frows *f) {
    kvc_free(f->tmp);
    f->tmp = NULL;
}
