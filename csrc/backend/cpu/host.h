/* Host memory behind a backend table: the buffers and K/V stores of the CPU backend (fp32) and of the
 * emulated device (bf16 storage), their memory counters, and f32 access to views of either dtype for
 * the kernels (a f32 view is used in place; a bf16 view is converted into a scratch copy and rounded
 * back on store, as a device stores it). Internal to backend/cpu and backend/emulated. */
#ifndef KVC_CPU_HOST_H
#define KVC_CPU_HOST_H

#include <stdatomic.h>
#include <string.h>

#include "../../core/common.h"
#include "../../core/backend.h"
#include "../../core/kv_type.h"

/* Bytes allocated per category now and at most (KVC_STAT_* of memory_stats). */
typedef struct kvc_host_stats {
    _Atomic int64_t cur[3], peak_cat[3], total, peak;
} kvc_host_stats;

struct kvc_buf {
    void *p;
    int64_t n;
    int32_t dtype;
    int32_t cat;
    size_t bytes;
    kvc_host_stats *stats; /* NULL: wrapped memory the buffer does not own (read-only) */
    int32_t packed;        /* a native weight in the GEMV's interleaved layout (quant.h), else the file's */
};

/* One layer's K/V on the host (kv_store.c has the layout): per head the arena holds [Kp: np rows of dk
 * kept key channels][K][V] in the store's type fmt (core/kv_type.h); rows [0, nq) are in the type, rows
 * [nq, len) wait in f32 (staging: appended rows until kv_commit, KIVI's residual). KIVI keys are blocks of
 * fmt.group rows and keep their width when pruned (np counts the pruned rows; their dropped channels read
 * as zeros). dk == 0: no pruned rows (np all 0, kp NULL). */
struct kvc_kv {
    int32_t Hkv, d, dtype; /* dtype: the rows kv_append receives (the activations': KVC_F32 or KVC_BF16) */
    kvc_kv_format fmt;     /* the stored type (never KVC_KV_NATIVE) */
    int32_t direct;        /* fmt is dtype itself: appended rows are stored as they come, nothing waits */
    void *arena;
    size_t bytes;
    kvc_host_stats *stats;
    void **k, **v;   /* [Hkv] head slices of the arena: K, V */
    void **kp;       /* [Hkv] pruned key slices [np, dk] (rows stored alone) */
    int64_t *len;    /* [Hkv] */
    int64_t *cap;    /* [Hkv] */
    int64_t *np;     /* [Hkv] pruned rows (a prefix) */
    int32_t dk;      /* kept key channels of the pruned rows */
    int32_t *kidx;   /* [Hkv dk] their channel indices (NULL when dk == 0) */
    int64_t *nq;     /* [Hkv] rows in the type */
    float **sk;      /* [Hkv] staging rows [scap, 2 d]: row r >= nq at r - nq, its key then its value */
    int64_t *scap;   /* [Hkv] */
    size_t sbytes;   /* bytes of the staging rows and the undo rows */
    /* KIVI: a failed call loses nothing (core/kv_undo.h has the rule). mark[h]: the length before the last
     * kv_append (-1: none); uk[h]: the f32 rows [u0[h], u0[h] + un[h]) that waited before that append and its
     * commit quantised, so that cutting back to mark[h] (the engine's roll-back) gives the rows as they were;
     * dropped at the next append. */
    int64_t *mark, *u0, *un;
    float **uk;
};

void kvc_host_stats_add(kvc_host_stats *s, int32_t cat, int64_t bytes);
void kvc_host_stats_read(const kvc_host_stats *s, int64_t *out);
void kvc_host_stats_reset_peak(kvc_host_stats *s);

kvc_status kvc_hbuf_alloc(kvc_host_stats *st, int32_t dtype, int64_t n, int32_t cat, const char *what, kvc_buf **out);
void kvc_hbuf_free(kvc_buf *b);
/* A read-only buffer over host memory the caller owns (the backend table's wrap): not counted, not freed. */
kvc_status kvc_hbuf_wrap(int32_t dtype, int64_t n, const void *p, const char *what, kvc_buf **out);
kvc_status kvc_hbuf_upload(kvc_view dst, int64_t rows, int64_t cols, const void *src, int32_t src_dtype);
kvc_status kvc_hbuf_download(kvc_view src, int64_t rows, int64_t cols, void *dst, int32_t dst_dtype);
/* Bytes of n elements of dtype (native weight types: whole blocks, n a multiple of the block), or
 * (size_t)-1 when n is not. */
size_t kvc_hbuf_bytes(int32_t dtype, int64_t n);
static inline char *kvc_hbuf_at(kvc_view v, int64_t r, int64_t c) {
    const int64_t e = v.off + r * v.ld + c;
    return (char *)v.buf->p + (kvc_dtype_is_wtype(v.buf->dtype) ? kvc_hbuf_bytes(v.buf->dtype, e)
                                                                 : (size_t)e * kvc_dtype_size(v.buf->dtype));
}

/* A store for rows of dtype (the activations') kept in fmt's type (NULL or KVC_KV_NATIVE: dtype's own). */
kvc_status kvc_hkv_new(kvc_host_stats *st, int32_t dtype, const kvc_kv_format *fmt, int32_t Hkv, int32_t d, kvc_kv **out);
/* The rows appended since the last commit into the store's type (KIVI: the residual rule); after a layer's
 * attention has read them. */
kvc_status kvc_hkv_commit(kvc_kv *kv);
/* f32 rows [r0, r0 + n) of head h's keys or values for the kernels, *ld floats apart: in place where they are
 * f32 in memory (the type's rows of an f32 store, rows all waiting in f32), else decoded into buf ([n, d]
 * floats). Keys of rows below kvc_hkv_narrow_rows (ThinK's pruned rows stored narrow) come [n, dk]; a range
 * never straddles that bound. */
const float *kvc_hkv_keys_f32(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld);
const float *kvc_hkv_values_f32(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, float *buf, int64_t *ld);
int64_t kvc_hkv_narrow_rows(const kvc_kv *kv, int32_t h);
/* Rows [r0, r0 + m) of head h, m <= n, as a tile the decode reads where it lies (backend/cpu/kv_decode.h);
 * returns m, 0 where they are not all in the type, are ThinK-pruned, or the type is f32 or not read so. */
struct kvc_kv_tile;
int64_t kvc_hkv_tile(const kvc_kv *kv, int32_t h, int64_t r0, int64_t n, struct kvc_kv_tile *t);
void kvc_hkv_free(kvc_kv *kv);
size_t kvc_hkv_bytes(const kvc_kv *kv);
kvc_status kvc_hkv_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx);
kvc_status kvc_hkv_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src);
kvc_status kvc_hkv_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap);
kvc_status kvc_hkv_set_lens(kvc_kv *kv, const int64_t *len);
kvc_status kvc_hkv_write(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v);
kvc_status kvc_hkv_read(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v);
kvc_status kvc_hkv_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v);
kvc_status kvc_hkv_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v);
kvc_status kvc_hkv_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n);
/* kv_lend.c: the table's kv_rows, kv_keep_rows, kv_kept_free (core/backend.h) */
int32_t kvc_hkv_rows(const kvc_kv *kv, int32_t h, const void **k, const void **v);
kvc_status kvc_hkv_keep_rows(kvc_kv *kv, void **kept);
void kvc_hkv_kept_free(void *kept);

/* bf16 with round to nearest even (NaN stays a quiet NaN), as the device converts */
static inline uint16_t kvc_f32_to_bf16(float f) { return kvc_f32_to_bf16r(f); }
static inline float kvc_bf16_to_f32v(uint16_t b) { return kvc_bf16_to_f32r(b); }

/* f32 access to rows x cols of a float view: in place for f32, a converted copy for bf16. */
typedef struct kvc_frows {
    float *p;
    int64_t ld;
    float *tmp; /* the copy, or NULL */
} kvc_frows;
kvc_status kvc_frows_get(kvc_view v, int64_t rows, int64_t cols, int load, kvc_frows *out);
/* store a copy back (rounded to the view's dtype) and release it */
void kvc_frows_put(kvc_view v, int64_t rows, int64_t cols, kvc_frows *f);
void kvc_frows_drop(kvc_frows *f);

/* f32 pointers to the first len[h] rows of every head of kv (in place for f32, converted copies for
 * bf16); kvc_kv_f32_drop releases the copies. Pruned rows: with split == 0 they come expanded to d
 * channels (zeros in the dropped ones: what the scorers read); with split, k[h] points at the full rows
 * (row np[h] on) and kp[h] at the pruned rows [np[h], dk] (what the attention reads). */
typedef struct kvc_kv_f32 {
    const float **k, **v, **kp;
    float *copy;
} kvc_kv_f32;
kvc_status kvc_kv_f32_get(const kvc_kv *kv, int want_v, int split, kvc_kv_f32 *out);
void kvc_kv_f32_drop(const kvc_kv *kv, kvc_kv_f32 *f);

/* The table entries of a host backend: they work on f32 and bf16 storage alike (cpu_backend.c). */
kvc_status kvc_host_embed(kvc_view table, kvc_view ids, int64_t n, int64_t D, kvc_view x);
kvc_status kvc_host_rmsnorm_v(kvc_view x, const kvc_view *add, kvc_view w, kvc_view y, int64_t rows, int64_t D, float eps);
kvc_status kvc_host_matmul_v(kvc_view a, kvc_view w, kvc_view c, int64_t m, int64_t n, int64_t k, int32_t accumulate);
kvc_status kvc_host_add_bias_v(kvc_view y, kvc_view b, int64_t rows, int64_t dim);
kvc_status kvc_host_rope_v(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view pos, kvc_view inv_freq,
                           int32_t pairing, float mscale);
kvc_status kvc_host_head_rmsnorm_v(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view w, float eps);
kvc_status kvc_host_attention_v(kvc_view q, int64_t n, int32_t H, kvc_kv *kv, float scale, float softcap, kvc_view start,
                                kvc_view out, int32_t flags);
kvc_status kvc_host_swiglu_v(kvc_view gu, int64_t rows, int64_t F);
kvc_status kvc_host_geglu_v(kvc_view gu, int64_t rows, int64_t F);
kvc_status kvc_host_scale_v(kvc_view x, int64_t rows, int64_t cols, float alpha);
kvc_status kvc_host_score_v(const kvc_score_args *a);
kvc_status kvc_host_topk_v(kvc_view scores, int32_t heads, const int64_t *len, const int64_t *k, int64_t *const *keep);
kvc_status kvc_host_cos_sum_v(kvc_view resid, kvc_view o, int64_t rows, int64_t D, double *out);
/* mixture of experts (moe.c) */
kvc_status kvc_host_moe_route_v(kvc_view logits, int64_t n, int32_t E, int32_t k, int32_t norm, kvc_view ids, kvc_view w);
kvc_status kvc_host_gather_rows_v(kvc_view src, kvc_view idx, int64_t n, int64_t D, kvc_view dst);
kvc_status kvc_host_moe_combine_v(kvc_view x, kvc_view y, kvc_view w, kvc_view pos, int64_t n, int32_t k, int64_t D);

#endif
