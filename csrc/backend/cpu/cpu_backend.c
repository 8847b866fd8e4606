/* The CPU backend's table: views resolved to host arrays and handed to the kernels of this folder.
 * The entries work on f32 storage in place and on bf16 storage through converted copies, so the
 * emulated device (backend/emulated) reuses them with bf16 buffers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/hostmath.h"
#include "cpu.h"
#include "host.h"
#include "quant.h"
#include "weight_hint.h"

kvc_status kvc_host_embed(kvc_view table, kvc_view ids, int64_t n, int64_t D, kvc_view x) {
    if (x.buf->dtype != KVC_F32 || ids.buf->dtype != KVC_I32)
        return kvc_fail(KVC_ERR_INTERNAL, "embed: x must be f32 and ids i32");
    const int32_t *id = (const int32_t *)kvc_hbuf_at(ids, 0, 0);
    for (int64_t i = 0; i < n; i++) {
        float *dst = (float *)kvc_hbuf_at(x, i, 0);
        KVC_TRY(kvc_hbuf_download(kvc_view_at(table, id[i], 0), 1, D, dst, KVC_F32));
    }
    return KVC_OK;
}

kvc_status kvc_host_rmsnorm_v(kvc_view x, const kvc_view *add, kvc_view w, kvc_view y, int64_t rows, int64_t D, float eps) {
    if (x.buf->dtype != KVC_F32 || w.buf->dtype != KVC_F32)
        return kvc_fail(KVC_ERR_INTERNAL, "rmsnorm: the residual stream and the norm weights must be f32");
    float *xp = (float *)kvc_hbuf_at(x, 0, 0);
    if (add) {
        kvc_frows a;
        KVC_TRY(kvc_frows_get(*add, rows, D, 1, &a));
        for (int64_t r = 0; r < rows; r++) kvc_cpu_add(xp + r * x.ld, a.p + r * a.ld, D);
        kvc_frows_drop(&a);
    }
    kvc_frows yo;
    KVC_TRY(kvc_frows_get(y, rows, D, 0, &yo));
    kvc_cpu_rmsnorm(xp, x.ld, (const float *)kvc_hbuf_at(w, 0, 0), yo.p, yo.ld, rows, D, eps);
    kvc_frows_put(y, rows, D, &yo);
    return KVC_OK;
}

/* A native weight (KVC_WTYPE): its rows as the GEMM reads them, in place. */
static kvc_status host_matmul_native(kvc_view a, kvc_view w, kvc_view c, int64_t m, int64_t n, int64_t k, int32_t accumulate) {
    const int32_t t = w.buf->dtype - KVC_WTYPE_BASE;
    if (w.ld != k) return kvc_fail(KVC_ERR_INTERNAL, "matmul: weight rows must be contiguous");
    if (w.buf->packed && (w.off != 0 || n * k != w.buf->n))
        return kvc_fail(KVC_ERR_INTERNAL, "matmul: a packed weight is used whole");
    kvc_frows A, C = {0};
    KVC_TRY(kvc_frows_get(a, m, k, 1, &A));
    kvc_status st = kvc_frows_get(c, m, n, accumulate, &C);
    if (st == KVC_OK) {
        const kvc_wmat wm = {kvc_hbuf_at(w, 0, 0), t, kvc_hbuf_bytes(w.buf->dtype, k), n, w.buf->packed};
        kvc_cpu_gemm_w(A.p, A.ld, wm, C.p, C.ld, m, n, k,
                       accumulate);
        kvc_frows_put(c, m, n, &C);
    }
    kvc_frows_drop(&A);
    kvc_frows_drop(&C);
    return st;
}

kvc_status kvc_host_matmul_v(kvc_view a, kvc_view w, kvc_view c, int64_t m, int64_t n, int64_t k, int32_t accumulate) {
    if (kvc_dtype_is_wtype(w.buf->dtype)) return host_matmul_native(a, w, c, m, n, k, accumulate);
    kvc_frows A, W, C = {0};
    KVC_TRY(kvc_frows_get(a, m, k, 1, &A));
    kvc_status st = kvc_frows_get(w, n, k, 1, &W);
    if (st == KVC_OK && W.ld != k) st = kvc_fail(KVC_ERR_INTERNAL, "matmul: weight rows must be contiguous");
    if (st == KVC_OK) st = kvc_frows_get(c, m, n, accumulate, &C);
    if (st == KVC_OK) {
        kvc_cpu_gemm(A.p, A.ld, W.p, C.p, C.ld, m, n, k, accumulate);
        kvc_frows_put(c, m, n, &C);
    }
    kvc_frows_drop(&A);
    kvc_frows_drop(&W);
    kvc_frows_drop(&C);
    return st;
}

kvc_status kvc_host_add_bias_v(kvc_view y, kvc_view b, int64_t rows, int64_t dim) {
    if (b.buf->dtype != KVC_F32) return kvc_fail(KVC_ERR_INTERNAL, "add_bias: the bias must be f32");
    kvc_frows Y;
    KVC_TRY(kvc_frows_get(y, rows, dim, 1, &Y));
    kvc_cpu_add_bias(Y.p, Y.ld, (const float *)kvc_hbuf_at(b, 0, 0), rows, dim);
    kvc_frows_put(y, rows, dim, &Y);
    return KVC_OK;
}

kvc_status kvc_host_rope_v(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view pos, kvc_view inv_freq,
                           int32_t pairing, float mscale) {
    if (pos.buf->dtype != KVC_I64 || inv_freq.buf->dtype != KVC_F32)
        return kvc_fail(KVC_ERR_INTERNAL, "rope: positions must be i64 and frequencies f32");
    kvc_view xv = kvc_view_at(x, 0, col0);
    kvc_frows X;
    KVC_TRY(kvc_frows_get(xv, n, (int64_t)heads * d, 1, &X));
    kvc_cpu_rope(X.p, X.ld, (const int64_t *)kvc_hbuf_at(pos, 0, 0), n, heads, d, (const float *)kvc_hbuf_at(inv_freq, 0, 0),
                 pairing, mscale);
    kvc_frows_put(xv, n, (int64_t)heads * d, &X);
    return KVC_OK;
}

kvc_status kvc_host_head_rmsnorm_v(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view w, float eps) {
    if (w.buf->dtype != KVC_F32) return kvc_fail(KVC_ERR_INTERNAL, "head_rmsnorm: the norm weights must be f32");
    kvc_view xv = kvc_view_at(x, 0, col0);
    kvc_frows X;
    KVC_TRY(kvc_frows_get(xv, n, (int64_t)heads * d, 1, &X));
    kvc_cpu_head_rmsnorm(X.p, X.ld, n, heads, d, (const float *)kvc_hbuf_at(w, 0, 0), eps);
    kvc_frows_put(xv, n, (int64_t)heads * d, &X);
    return KVC_OK;
}

static const float *store_keys(const void *kv, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    return kvc_hkv_keys_f32(kv, h, r0, n, buf, ld);
}
static const float *store_values(const void *kv, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld) {
    return kvc_hkv_values_f32(kv, h, r0, n, buf, ld);
}
static int64_t store_narrow(const void *kv, int32_t h) { return kvc_hkv_narrow_rows(kv, h); }
static int64_t store_tile(const void *kv, int32_t h, int64_t r0, int64_t n, struct kvc_kv_tile *t) {
    return kvc_hkv_tile(kv, h, r0, n, t);
}

kvc_status kvc_host_attention_v(kvc_view q, int64_t n, int32_t H, kvc_kv *kv, float scale, float softcap, kvc_view start,
                                kvc_view out, int32_t flags) {
    (void)flags; /* one CPU kernel picks its own decode / prefill path */
    if (start.buf && (start.buf->dtype != KVC_I64 || start.ld != kv->Hkv))
        return kvc_fail(KVC_ERR_INTERNAL, "attention: window starts must be i64 [n, Hkv]");
    const int64_t *lo = start.buf ? (const int64_t *)kvc_hbuf_at(start, 0, 0) : NULL;
    const int32_t Hkv = kv->Hkv, d = kv->d;
    int64_t past[KVC_MAX_KV_HEADS];
    if (Hkv > KVC_MAX_KV_HEADS) return kvc_fail(KVC_ERR_INTERNAL, "attention: %d KV heads", Hkv);
    for (int32_t h = 0; h < Hkv; h++) past[h] = kv->len[h] - n;
    const kvc_cpu_kvsrc src = {kv, store_keys, store_values, store_narrow, kv->dk, kv->kidx, store_tile,
                               kv->fmt.type != KVC_KV_F32};
    kvc_frows Q = {0}, O = {0};
    kvc_status st = kvc_frows_get(q, n, (int64_t)H * d, 1, &Q);
    if (st == KVC_OK) st = kvc_frows_get(out, n, (int64_t)H * d, 0, &O);
    if (st == KVC_OK) {
        kvc_cpu_attention(Q.p, Q.ld, n, H, Hkv, d, &src, past, lo, scale, softcap, O.p, O.ld);
        kvc_frows_put(out, n, (int64_t)H * d, &O);
    }
    kvc_frows_drop(&Q);
    kvc_frows_drop(&O);
    return st;
}

kvc_status kvc_host_swiglu_v(kvc_view gu, int64_t rows, int64_t F) {
    kvc_frows G;
    KVC_TRY(kvc_frows_get(gu, rows, 2 * F, 1, &G));
    kvc_cpu_swiglu_rows(G.p, G.ld, rows, F);
    kvc_frows_put(gu, rows, 2 * F, &G);
    return KVC_OK;
}

kvc_status kvc_host_geglu_v(kvc_view gu, int64_t rows, int64_t F) {
    kvc_frows G;
    KVC_TRY(kvc_frows_get(gu, rows, 2 * F, 1, &G));
    kvc_cpu_geglu_rows(G.p, G.ld, rows, F);
    kvc_frows_put(gu, rows, 2 * F, &G);
    return KVC_OK;
}

kvc_status kvc_host_scale_v(kvc_view x, int64_t rows, int64_t cols, float alpha) {
    kvc_frows X;
    KVC_TRY(kvc_frows_get(x, rows, cols, 1, &X));
    kvc_cpu_scale_rows(X.p, X.ld, rows, cols, alpha);
    kvc_frows_put(x, rows, cols, &X);
    return KVC_OK;
}

kvc_status kvc_host_topk_v(kvc_view scores, int32_t heads, const int64_t *len, const int64_t *k, int64_t *const *keep) {
    if (scores.buf->dtype != KVC_F32) return kvc_fail(KVC_ERR_INTERNAL, "topk: scores must be f32");
    for (int32_t h = 0; h < heads; h++)
        KVC_TRY(kvc_host_topk_rows((const float *)kvc_hbuf_at(scores, h, 0), len[h], k[h], keep[h]));
    return KVC_OK;
}

kvc_status kvc_host_cos_sum_v(kvc_view resid, kvc_view o, int64_t rows, int64_t D, double *out) {
    if (resid.buf->dtype != KVC_F32) return kvc_fail(KVC_ERR_INTERNAL, "cos_sum: the residual stream must be f32");
    kvc_frows O;
    KVC_TRY(kvc_frows_get(o, rows, D, 1, &O));
    double sum = 0;
    for (int64_t j = 0; j < rows; j++) {
        const float *R = (const float *)kvc_hbuf_at(resid, j, 0), *Oj = O.p + j * O.ld;
        double rr = 0, ss = 0, rs = 0;
        for (int64_t t = 0; t < D; t++) {
            const double a = R[t], b = (double)R[t] + Oj[t];
            rr += a * a;
            ss += b * b;
            rs += a * b;
        }
        sum += rs / (sqrt(rr * ss) + 1e-30);
    }
    kvc_frows_drop(&O);
    *out = sum;
    return KVC_OK;
}

/* ---- the CPU table ---- */

static kvc_host_stats g_cpu_stats;

static const char *cpu_name(void) { return "cpu"; }
static const char *cpu_gemm(void) { return kvc_blas_name(); }
static void cpu_memory(int64_t *out) { kvc_host_stats_read(&g_cpu_stats, out); }
static void cpu_reset_peak(void) { kvc_host_stats_reset_peak(&g_cpu_stats); }
static kvc_status cpu_option(const char *name, int value) {
    if (name && strcmp(name, "weight_prefetch") == 0) return kvc_cpu_set_weight_prefetch(value);
    return kvc_fail(KVC_ERR_ARG, "the CPU backend has no setting '%s' (%d): it has 'weight_prefetch'", name ? name : "(null)", value);
}
static kvc_status cpu_alloc(int32_t dtype, int64_t n, int32_t cat, const char *what, kvc_buf **out) {
    return kvc_hbuf_alloc(&g_cpu_stats, dtype, n, cat, what, out);
}
static const float *cpu_host_f32(const kvc_buf *b) { return b && b->dtype == KVC_F32 ? (const float *)b->p : NULL; }
static int cpu_weight_type_ok(int32_t ggml_type) { return kvc_cpu_wtype_ok(ggml_type); }
static int cpu_wrap_keeps_layout(int32_t dtype) {
    return !(kvc_dtype_is_wtype(dtype) && kvc_cpu_wtype_packs(dtype - KVC_WTYPE_BASE));
}
static kvc_status cpu_kv_new(int32_t Hkv, int32_t d, const kvc_kv_format *fmt, kvc_kv **out) {
    return kvc_hkv_new(&g_cpu_stats, KVC_F32, fmt, Hkv, d, out);
}

static const kvc_backend g_cpu = {
    .version = KVC_BACKEND_VERSION,
    .name = "cpu",
    .device = KVC_DEVICE_CPU,
    .act_dtype = KVC_F32,
    .weight_dtype = KVC_F32,
    .weight_type_ok = cpu_weight_type_ok,
    .mlp_rows = 256,
    .serialize = 0,
    .host_memory = 1,
    .device_name = cpu_name,
    .gemm_name = cpu_gemm,
    .memory_stats = cpu_memory,
    .reset_peak = cpu_reset_peak,
    .sync = NULL, /* every kernel is done when it returns */
    .set_option = cpu_option,
    .alloc = cpu_alloc,
    .free = kvc_hbuf_free,
    .upload = kvc_hbuf_upload,
    .download = kvc_hbuf_download,
    .host_f32 = cpu_host_f32,
    .wrap = kvc_hbuf_wrap,
    .wrap_keeps_layout = cpu_wrap_keeps_layout,
    .kv_new = cpu_kv_new,
    .kv_commit = kvc_hkv_commit,
    .kv_free = kvc_hkv_free,
    .kv_bytes = kvc_hkv_bytes,
    .kv_resize = kvc_hkv_resize,
    .kv_gather = kvc_hkv_gather,
    .kv_set_lens = kvc_hkv_set_lens,
    .kv_prune_keys = kvc_hkv_prune_keys,
    .kv_write = kvc_hkv_write,
    .kv_read = kvc_hkv_read,
    .kv_read_heads = kvc_hkv_read_heads,
    .kv_write_rows = kvc_hkv_write_rows,
    .kv_rows = kvc_hkv_rows,
    .kv_keep_rows = kvc_hkv_keep_rows,
    .kv_kept_free = kvc_hkv_kept_free,
    .embed = kvc_host_embed,
    .rmsnorm = kvc_host_rmsnorm_v,
    .matmul = kvc_host_matmul_v,
    .add_bias = kvc_host_add_bias_v,
    .rope = kvc_host_rope_v,
    .kv_append = kvc_hkv_append,
    .head_rmsnorm = kvc_host_head_rmsnorm_v,
    .attention = kvc_host_attention_v,
    .hint_weights = kvc_cpu_hint_weights,
    .swiglu = kvc_host_swiglu_v,
    .geglu = kvc_host_geglu_v,
    .scale = kvc_host_scale_v,
    .moe_route = kvc_host_moe_route_v,
    .gather_rows = kvc_host_gather_rows_v,
    .moe_combine = kvc_host_moe_combine_v,
    .score = kvc_host_score_v,
    .topk = kvc_host_topk_v,
    .cos_sum = kvc_host_cos_sum_v,
    .graph_capture = NULL,
    .graph_launch = NULL,
    .graph_free = NULL,
};

const kvc_backend *kvc_backend_cpu(void) { return &g_cpu; }
