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

/* ---- K/V stores ---------------------------------------------------------------------------------
 * One arena per layer: each head's pruned keys Kp [np, dk], full keys K [cap - np, d], then V [cap, d],
 * 64-byte aligned slices (host.h); the layout and row rules are core/kv_layout.h's. */

#define KV_ALIGN 64

static kvc_kv_slices head_slices(const kvc_kv *kv, int32_t dk, int64_t cap, int64_t np) {
    return kvc_kv_head_slices(kvc_dtype_size(kv->dtype), kv->d, dk, cap, np, KV_ALIGN);
}

static size_t arena_bytes(const kvc_kv *kv, int32_t dk, const int64_t *cap, const int64_t *np) {
    size_t b = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) b += head_slices(kv, dk, cap[h], np ? np[h] : 0).bytes;
    return b;
}

/* The row rule of core/kv_layout.h as a status. */
static kvc_status rows_check(kvc_kv_op op, const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const int64_t *keep,
                             int64_t held, int64_t cap) {
    char why[256];
    if (kvc_kv_rows_refused(op, h, kv->Hkv, row0, rows, keep, held, cap, why, sizeof why))
        return kvc_fail(KVC_ERR_INTERNAL, "%s", why);
    return KVC_OK;
}

size_t kvc_hkv_bytes(const kvc_kv *kv) { return kv->bytes; }

kvc_status kvc_hkv_new(kvc_host_stats *st, int32_t dtype, int32_t Hkv, int32_t d, kvc_kv **out) {
    *out = NULL;
    kvc_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    kv->Hkv = Hkv;
    kv->d = d;
    kv->dtype = dtype;
    kv->stats = st;
    kv->k = calloc((size_t)Hkv, sizeof *kv->k);
    kv->v = calloc((size_t)Hkv, sizeof *kv->v);
    kv->kp = calloc((size_t)Hkv, sizeof *kv->kp);
    kv->len = calloc((size_t)Hkv, sizeof *kv->len);
    kv->cap = calloc((size_t)Hkv, sizeof *kv->cap);
    kv->np = calloc((size_t)Hkv, sizeof *kv->np);
    if (!kv->k || !kv->v || !kv->kp || !kv->len || !kv->cap || !kv->np) {
        kvc_hkv_free(kv);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    }
    *out = kv;
    return KVC_OK;
}

static void arena_release(kvc_kv *kv) {
    if (kv->arena) {
        kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, -(int64_t)kv->bytes);
        kvc_free(kv->arena);
    }
    kv->arena = NULL;
    kv->bytes = 0;
}

void kvc_hkv_free(kvc_kv *kv) {
    if (!kv) return;
    arena_release(kv);
    free(kv->k);
    free(kv->v);
    free(kv->kp);
    free(kv->len);
    free(kv->cap);
    free(kv->np);
    free(kv->kidx);
    free(kv);
}

/* A layout being built: the arena and its slices, the pruned rows and channels it will have. */
typedef struct layout {
    void *arena;
    size_t bytes;
    void **k, **v, **kp;
    int64_t *np;
    int32_t dk;
    int32_t *kidx; /* owned until adopted */
} layout;

static void layout_drop(layout *L) {
    kvc_free(L->arena);
    free(L->k); /* v and kp point into the same array */
    free(L->np);
    free(L->kidx);
    memset(L, 0, sizeof *L);
}

/* L->np, dk and kidx set: allocate the arena for cap[h] rows per head and point the slices into it. */
static kvc_status layout_alloc(const kvc_kv *kv, const int64_t *cap, layout *L) {
    L->bytes = arena_bytes(kv, L->dk, cap, L->np);
    if (L->bytes == 0) return KVC_OK;
    L->arena = kvc_malloc(L->bytes, "KV cache");
    if (!L->arena) return KVC_ERR_NOMEM;
    char *p = L->arena;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        const kvc_kv_slices s = head_slices(kv, L->dk, cap[h], L->np[h]);
        L->kp[h] = p + s.kp;
        L->k[h] = p + s.k;
        L->v[h] = p + s.v;
        p += s.bytes;
    }
    return KVC_OK;
}

/* Start a layout with dk kept channels (kidx [Hkv dk], copied; dk 0: none). */
static kvc_status layout_new(const kvc_kv *kv, int32_t dk, const int32_t *kidx, layout *L) {
    memset(L, 0, sizeof *L);
    const size_t H = (size_t)kv->Hkv;
    L->k = calloc(3 * H, sizeof *L->k);
    L->np = calloc(H, sizeof *L->np);
    L->dk = dk;
    if (dk > 0) L->kidx = malloc(sizeof(int32_t) * H * (size_t)dk);
    if (!L->k || !L->np || (dk > 0 && !L->kidx)) {
        layout_drop(L);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V store");
    }
    L->v = L->k + H;
    L->kp = L->k + 2 * H;
    if (dk > 0) memcpy(L->kidx, kidx, sizeof(int32_t) * H * (size_t)dk);
    return KVC_OK;
}

static void layout_adopt(kvc_kv *kv, layout *L, const int64_t *cap, const int64_t *len) {
    kvc_host_stats_add(kv->stats, KVC_MEM_CACHE, (int64_t)L->bytes); /* before the old one goes: the peak sees both */
    arena_release(kv);
    kv->arena = L->arena;
    kv->bytes = L->bytes;
    int64_t pruned = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        kv->k[h] = L->k[h];
        kv->v[h] = L->v[h];
        kv->kp[h] = L->np[h] > 0 ? L->kp[h] : NULL;
        kv->np[h] = L->np[h];
        kv->cap[h] = cap[h];
        kv->len[h] = len[h];
        pruned += L->np[h];
    }
    free(kv->kidx);
    kv->dk = pruned > 0 ? L->dk : 0; /* no pruned row left: the plain layout again */
    kv->kidx = pruned > 0 ? L->kidx : NULL;
    if (pruned == 0) free(L->kidx);
    L->arena = NULL;
    L->kidx = NULL;
    layout_drop(L);
}

static void put_row(int32_t dtype, void *dst, const float *src, int32_t d) {
    if (dtype == KVC_BF16)
        for (int32_t e = 0; e < d; e++) ((uint16_t *)dst)[e] = kvc_f32_to_bf16(src[e]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)d);
}

static void get_row(int32_t dtype, const void *src, float *dst, int32_t d) {
    if (dtype == KVC_BF16)
        for (int32_t e = 0; e < d; e++) dst[e] = kvc_bf16_to_f32v(((const uint16_t *)src)[e]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)d);
}

/* Key row r of head h as d f32 channels (a pruned row: zeros in the dropped channels). */
static void key_get(const kvc_kv *kv, int32_t h, int64_t r, float *out) {
    const size_t es = kvc_dtype_size(kv->dtype);
    if (r >= kv->np[h]) {
        get_row(kv->dtype, (const char *)kv->k[h] + (size_t)kvc_kv_full_row(r, kv->np[h]) * kv->d * es, out, kv->d);
        return;
    }
    float tmp[1024]; /* dk <= d <= 256 (the attention kernel's limit); 1024 leaves room */
    const int32_t dk = kv->dk, *ix = kv->kidx + (size_t)h * dk;
    get_row(kv->dtype, (const char *)kv->kp[h] + (size_t)r * dk * es, tmp, dk);
    memset(out, 0, sizeof(float) * (size_t)kv->d);
    for (int32_t j = 0; j < dk; j++) out[ix[j]] = tmp[j];
}

/* Store the d-channel key row `row` as row r of head h of layout L (a pruned row keeps its channels). */
static void key_put(const kvc_kv *kv, const layout *L, int32_t h, int64_t r, const float *row) {
    const size_t es = kvc_dtype_size(kv->dtype);
    if (r >= L->np[h]) {
        put_row(kv->dtype, (char *)L->k[h] + (size_t)kvc_kv_full_row(r, L->np[h]) * kv->d * es, row, kv->d);
        return;
    }
    float tmp[1024];
    const int32_t dk = L->dk, *ix = L->kidx + (size_t)h * dk;
    for (int32_t j = 0; j < dk; j++) tmp[j] = row[ix[j]];
    put_row(kv->dtype, (char *)L->kp[h] + (size_t)r * dk * es, tmp, dk);
}

/* kv's new arena (layout L: its np and channels set) of cap[h] rows per head holds, per head, rows
 * [0, n[h]) of from (keep NULL) or the rows keep[h][0 .. n[h]) of from; the old arena goes. Rows whose
 * key layout stays are copied as stored; the others pass through f32 (exact: bf16 -> f32 -> bf16). */
static kvc_status rebuild(kvc_kv *kv, const kvc_kv *from, const int64_t *cap, const int64_t *const *keep,
                          const int64_t *n, layout *L) {
    if (layout_alloc(kv, cap, L) != KVC_OK) {
        layout_drop(L);
        return KVC_ERR_NOMEM;
    }
    const size_t es = kvc_dtype_size(kv->dtype), ev = es * (size_t)kv->d;
    float row[1024];
    for (int32_t h = 0; h < kv->Hkv; h++) {
        const int same_ch = from->dk == L->dk &&
                            (L->dk == 0 || !memcmp(from->kidx + (size_t)h * L->dk, L->kidx + (size_t)h * L->dk,
                                                   sizeof(int32_t) * (size_t)L->dk));
        for (int64_t i = 0; i < n[h]; i++) {
            const int64_t s = keep ? keep[h][i] : i;
            memcpy((char *)L->v[h] + (size_t)i * ev, (const char *)from->v[h] + (size_t)s * ev, ev);
            const int sp = s < from->np[h], dp = i < L->np[h];
            if (!sp && !dp)
                memcpy((char *)L->k[h] + (size_t)(i - L->np[h]) * ev, (const char *)from->k[h] + (size_t)(s - from->np[h]) * ev, ev);
            else if (sp && dp && same_ch)
                memcpy((char *)L->kp[h] + (size_t)i * L->dk * es, (const char *)from->kp[h] + (size_t)s * L->dk * es,
                       (size_t)L->dk * es);
            else {
                key_get(from, h, s, row);
                key_put(kv, L, h, i, row);
            }
        }
    }
    layout_adopt(kv, L, cap, n);
    return KVC_OK;
}

kvc_status kvc_hkv_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src) {
    const kvc_kv *from = src ? src : kv;
    for (int32_t h = 0; h < kv->Hkv; h++) KVC_TRY(rows_check(KVC_KV_RESIZE, kv, h, 0, rows[h], NULL, from->len[h], cap[h]));
    layout L;
    KVC_TRY(layout_new(kv, from->dk, from->kidx, &L)); /* the pruned prefix goes along */
    for (int32_t h = 0; h < kv->Hkv; h++) L.np[h] = kvc_kv_resized_pruned(rows[h], from->np[h]);
    return rebuild(kv, from, cap, NULL, rows, &L);
}

kvc_status kvc_hkv_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        KVC_TRY(rows_check(KVC_KV_GATHER, kv, h, 0, n_keep[h], keep[h], kv->len[h], cap[h]));
    layout L;
    KVC_TRY(layout_new(kv, kv->dk, kv->kidx, &L));
    for (int32_t h = 0; h < kv->Hkv; h++) L.np[h] = kvc_kv_gathered_pruned(keep[h], n_keep[h], kv->np[h]);
    return rebuild(kv, kv, cap, keep, n_keep, &L);
}

kvc_status kvc_hkv_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx) {
    if (dk < 1 || dk > kv->d || kv->d > 1024) return kvc_fail(KVC_ERR_INTERNAL, "K/V prune: %d kept channels of %d", dk, kv->d);
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int32_t j = 0; j < dk; j++) {
            const int32_t c = kidx[(size_t)h * dk + j];
            if (c < 0 || c >= kv->d || (j > 0 && c <= kidx[(size_t)h * dk + j - 1]))
                return kvc_fail(KVC_ERR_INTERNAL, "K/V prune: head %d channels are not increasing inside [0, %d)", h, kv->d);
        }
    layout L;
    KVC_TRY(layout_new(kv, dk, kidx, &L));
    for (int32_t h = 0; h < kv->Hkv; h++) L.np[h] = kv->len[h];
    int64_t *cap = malloc(sizeof(int64_t) * (size_t)kv->Hkv), *len = malloc(sizeof(int64_t) * (size_t)kv->Hkv);
    kvc_status st = (!cap || !len) ? kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V prune") : KVC_OK;
    if (st == KVC_OK) {
        memcpy(cap, kv->cap, sizeof(int64_t) * (size_t)kv->Hkv);
        memcpy(len, kv->len, sizeof(int64_t) * (size_t)kv->Hkv);
        st = rebuild(kv, kv, cap, NULL, len, &L);
    } else {
        layout_drop(&L);
    }
    free(cap);
    free(len);
    return st;
}

kvc_status kvc_hkv_set_lens(kvc_kv *kv, const int64_t *len) {
    int into_pruned = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        if (len[h] < 0 || len[h] > kv->cap[h])
            return kvc_fail(KVC_ERR_INTERNAL, "K/V lengths: head %d gets %lld rows of %lld", h, (long long)len[h],
                            (long long)kv->cap[h]);
        into_pruned |= len[h] < kv->np[h];
    }
    if (into_pruned) { /* the pruned prefix shrinks: later rows are full again, so the arena is rebuilt */
        int64_t *cap = malloc(sizeof(int64_t) * (size_t)kv->Hkv);
        if (!cap) return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V lengths");
        memcpy(cap, kv->cap, sizeof(int64_t) * (size_t)kv->Hkv);
        const kvc_status st = kvc_hkv_resize(kv, cap, len, NULL);
        free(cap);
        return st;
    }
    for (int32_t h = 0; h < kv->Hkv; h++) kv->len[h] = len[h];
    return KVC_OK;
}

kvc_status kvc_hkv_write(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v) {
    KVC_TRY(rows_check(KVC_KV_WRITE, kv, h, row0, rows, NULL, 0, h >= 0 && h < kv->Hkv ? kv->cap[h] : 0));
    const size_t es = kvc_dtype_size(kv->dtype) * (size_t)kv->d;
    const layout self = {.k = kv->k, .v = kv->v, .kp = kv->kp, .np = kv->np, .dk = kv->dk, .kidx = kv->kidx};
    for (int64_t r = 0; r < rows; r++) {
        if (k) key_put(kv, &self, h, row0 + r, k + r * kv->d); /* a pruned row keeps its channels only */
        if (v) put_row(kv->dtype, (char *)kv->v[h] + (size_t)(row0 + r) * es, v + r * kv->d, kv->d);
    }
    return KVC_OK;
}

kvc_status kvc_hkv_read(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v) {
    KVC_TRY(rows_check(KVC_KV_READ, kv, h, row0, rows, NULL, h >= 0 && h < kv->Hkv ? kv->len[h] : 0, 0));
    const size_t es = kvc_dtype_size(kv->dtype) * (size_t)kv->d;
    for (int64_t r = 0; r < rows; r++) {
        if (k) key_get(kv, h, row0 + r, k + r * kv->d);
        if (v) get_row(kv->dtype, (const char *)kv->v[h] + (size_t)(row0 + r) * es, v + r * kv->d, kv->d);
    }
    return KVC_OK;
}

/* The batched entries of the table: checked whole before anything moves, so a refused call changes nothing. */
kvc_status kvc_hkv_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        KVC_TRY(rows_check(KVC_KV_READ, kv, h, row0 ? row0[h] : 0, rows[h], NULL, kv->len[h], 0));
    size_t off = 0;
    for (int32_t h = 0; h < kv->Hkv; h++) {
        KVC_TRY(kvc_hkv_read(kv, h, row0 ? row0[h] : 0, rows[h], k ? k + off : NULL, v ? v + off : NULL));
        off += (size_t)rows[h] * kv->d;
    }
    return KVC_OK;
}

kvc_status kvc_hkv_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v) {
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int64_t i = 0; i < n[h]; i++) KVC_TRY(rows_check(KVC_KV_WRITE, kv, h, idx[h][i], 1, NULL, 0, kv->cap[h]));
    size_t off = 0;
    for (int32_t h = 0; h < kv->Hkv; h++)
        for (int64_t i = 0; i < n[h]; i++, off += (size_t)kv->d)
            KVC_TRY(kvc_hkv_write(kv, h, idx[h][i], 1, k ? k + off : NULL, v ? v + off : NULL));
    return KVC_OK;
}

kvc_status kvc_hkv_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n) {
    const int32_t Hkv = kv->Hkv, d = kv->d;
    for (int32_t h = 0; h < Hkv; h++)
        if (kv->len[h] + n > kv->cap[h])
            return kvc_fail(KVC_ERR_INTERNAL, "K/V append: head %d has room for %lld rows, not %lld more", h,
                            (long long)(kv->cap[h] - kv->len[h]), (long long)n);
    if (src.buf->dtype != kv->dtype)
        return kvc_fail(KVC_ERR_INTERNAL, "K/V append: rows of dtype %d into a store of dtype %d", src.buf->dtype, kv->dtype);
    const size_t es = kvc_dtype_size(kv->dtype);
    for (int32_t h = 0; h < Hkv; h++) /* appended rows are full (len >= np: set_lens keeps it so) */
        for (int64_t i = 0; i < n; i++) {
            memcpy((char *)kv->k[h] + (size_t)kvc_kv_full_row(kv->len[h] + i, kv->np[h]) * d * es,
                   kvc_hbuf_at(src, i, kcol + (int64_t)h * d), (size_t)d * es);
            memcpy((char *)kv->v[h] + (size_t)(kv->len[h] + i) * d * es, kvc_hbuf_at(src, i, vcol + (int64_t)h * d),
                   (size_t)d * es);
        }
    for (int32_t h = 0; h < Hkv; h++) kv->len[h] += n;
    return KVC_OK;
}

kvc_status kvc_kv_f32_get(const kvc_kv *kv, int want_v, int split, kvc_kv_f32 *out) {
    memset(out, 0, sizeof *out);
    const int32_t Hkv = kv->Hkv, d = kv->d, dk = kv->dk;
    out->k = calloc((size_t)Hkv, sizeof *out->k);
    out->v = calloc((size_t)Hkv, sizeof *out->v);
    out->kp = calloc((size_t)Hkv, sizeof *out->kp);
    if (!out->k || !out->v || !out->kp) {
        kvc_kv_f32_drop(kv, out);
        return kvc_fail(KVC_ERR_NOMEM, "out of memory: K/V view");
    }
    if (kv->dtype == KVC_F32 && (dk == 0 || split)) {
        for (int32_t h = 0; h < Hkv; h++) {
            out->k[h] = kv->k[h];
            out->v[h] = kv->v[h];
            out->kp[h] = kv->kp[h];
        }
        return KVC_OK;
    }
    /* copies: keys (expanded, or pruned and full apart: dk + d floats at most per row) and values */
    size_t floats = 0;
    for (int32_t h = 0; h < Hkv; h++) floats += (size_t)kv->len[h] * ((size_t)d + (size_t)dk + (want_v ? (size_t)d : 0));
    out->copy = kvc_malloc(sizeof(float) * (floats ? floats : 1), "f32 copy of a K/V store");
    if (!out->copy) {
        kvc_kv_f32_drop(kv, out);
        return KVC_ERR_NOMEM;
    }
    float *p = out->copy;
    for (int32_t h = 0; h < Hkv; h++) {
        const int64_t len = kv->len[h], np = kv->np[h] < len ? kv->np[h] : len;
        if (split) {
            out->kp[h] = p;
            for (int64_t r = 0; r < np; r++)
                get_row(kv->dtype, (const char *)kv->kp[h] + (size_t)r * dk * kvc_dtype_size(kv->dtype), p + r * dk, dk);
            p += (size_t)np * dk;
            out->k[h] = p;
            for (int64_t r = np; r < len; r++) key_get(kv, h, r, p + (size_t)(r - np) * d);
            p += (size_t)(len - np) * d;
        } else {
            out->k[h] = p;
            kvc_hkv_read(kv, h, 0, len, p, NULL);
            p += (size_t)len * d;
        }
        if (want_v) {
            out->v[h] = p;
            kvc_hkv_read(kv, h, 0, len, NULL, p);
            p += (size_t)len * d;
        }
    }
    return KVC_OK;
}

void kvc_kv_f32_drop(const kvc_kv *kv, kvc_kv_f32 *f) {
    (void)kv;
    free(f->k);
    free(f->v);
    free(f->kp);
    kvc_free(f->copy);
    memset(f, 0, sizeof *f);
}
