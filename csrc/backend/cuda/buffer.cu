/* Buffers of the CUDA backend: tracked device allocations of one dtype, and the copies between them and
 * host arrays (f32 host values converted to bf16 on the device through a staging buffer, and back). */
#include <string.h>

#include "common.cuh"

namespace kvc {

kvc_status scratch(Buf &b, size_t bytes, const char *what) { return b.need(bytes ? bytes : 1, what); }

kvc_status buf_alloc(int32_t dtype, int64_t n, int32_t cat, const char *what, kvc_buf **out) {
    *out = nullptr;
    if (n < 0) return fail(KVC_ERR_NOMEM, "out of memory: %s (%lld elements)", what, (long long)n);
    kvc_buf *b = (kvc_buf *)calloc(1, sizeof *b);
    if (!b) return fail(KVC_ERR_NOMEM, "out of memory: %s", what);
    const size_t bytes = (size_t)n * kvc_dtype_size(dtype);
    kvc_status st = dalloc(&b->p, bytes, cat, what);
    if (st != KVC_OK) {
        free(b);
        return st;
    }
    b->n = n;
    b->dtype = dtype;
    b->cat = cat;
    b->bytes = bytes;
    *out = b;
    return KVC_OK;
}

void buf_free(kvc_buf *b) {
    if (!b) return;
    stream_wait(); /* work in flight may still read it */
    dfree(b->p, b->bytes, b->cat);
    free(b);
}

static Buf g_stage_f32, g_stage_bf16; /* conversions of rows x cols values */

static int float_dtype(int32_t t) { return t == KVC_F32 || t == KVC_BF16; }

kvc_status buf_upload(kvc_view dst, int64_t rows, int64_t cols, const void *src, int32_t src_dtype) {
    const int32_t t = dst.buf->dtype;
    if (float_dtype(t) ? src_dtype != KVC_F32 : src_dtype != t)
        return fail(KVC_ERR_INTERNAL, "upload: dtype %d into a buffer of dtype %d", src_dtype, t);
    if (rows <= 0 || cols <= 0) return KVC_OK;
    const size_t es = kvc_dtype_size(t);
    if (t != KVC_BF16) {
        traffic_add(0, 1, 0, 0, rows * cols * (int64_t)es);
        CU_TRY(cudaMemcpy2DAsync(at<char>(dst), (size_t)dst.ld * es, src, (size_t)cols * es, (size_t)cols * es, rows,
                                 cudaMemcpyHostToDevice, g.stream),
               "upload");
        CU_TRY(stream_wait(), "upload"); /* src is the caller's pageable memory */
        return KVC_OK;
    }
    const int64_t n = rows * cols;
    KVC_TRY(scratch(g_stage_f32, sizeof(float) * n, "upload staging"));
    CU_TRY(h2d(g_stage_f32.p, src, sizeof(float) * n), "upload");
    if (dst.ld == cols) return f32_to_bf16(g_stage_f32.as<float>(), at<bf16>(dst), n);
    KVC_TRY(scratch(g_stage_bf16, sizeof(bf16) * n, "upload staging"));
    KVC_TRY(f32_to_bf16(g_stage_f32.as<float>(), g_stage_bf16.as<bf16>(), n));
    CU_TRY(cudaMemcpy2DAsync(at<bf16>(dst), sizeof(bf16) * dst.ld, g_stage_bf16.p, sizeof(bf16) * cols,
                             sizeof(bf16) * cols, rows, cudaMemcpyDeviceToDevice, g.stream),
           "upload");
    return KVC_OK;
}

kvc_status buf_download(kvc_view src, int64_t rows, int64_t cols, void *dst, int32_t dst_dtype) {
    const int32_t t = src.buf->dtype;
    if (float_dtype(t) ? dst_dtype != KVC_F32 : dst_dtype != t)
        return fail(KVC_ERR_INTERNAL, "download: dtype %d from a buffer of dtype %d", dst_dtype, t);
    if (rows <= 0 || cols <= 0) return KVC_OK;
    const size_t es = kvc_dtype_size(t);
    if (t != KVC_BF16) {
        traffic_add(1, 0, 0, rows * cols * (int64_t)es, 0);
        CU_TRY(cudaMemcpy2DAsync(dst, (size_t)cols * es, at<char>(src), (size_t)src.ld * es, (size_t)cols * es, rows,
                                 cudaMemcpyDeviceToHost, g.stream),
               "download");
    } else {
        const int64_t n = rows * cols;
        KVC_TRY(scratch(g_stage_bf16, sizeof(bf16) * n, "download staging"));
        KVC_TRY(scratch(g_stage_f32, sizeof(float) * n, "download staging"));
        CU_TRY(cudaMemcpy2DAsync(g_stage_bf16.p, sizeof(bf16) * cols, at<bf16>(src), sizeof(bf16) * src.ld,
                                 sizeof(bf16) * cols, rows, cudaMemcpyDeviceToDevice, g.stream),
               "download");
        KVC_TRY(bf16_to_f32(g_stage_bf16.as<bf16>(), g_stage_f32.as<float>(), n));
        CU_TRY(d2h(dst, g_stage_f32.p, sizeof(float) * n), "download");
    }
    CU_TRY(stream_wait(), "download");
    return KVC_OK;
}

} // namespace kvc
