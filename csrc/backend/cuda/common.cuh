/* Internal header of the CUDA backend: errors, the device context, tracked allocation, the buffers and
 * K/V stores of the kernel table (core/backend.h), the kernel entry points each .cu file provides
 * (one kernel family per file). Nothing here knows the core's model or session: the table is all. */
#ifndef KVC_CUDA_COMMON_CUH
#define KVC_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "../../core/backend.h"
#include "../../core/kv_layout.h"
#include "../../core/kv_type.h"

typedef __nv_bfloat16 bf16;

namespace kvc {

#define KVC_MAX_KV KVC_MAX_KV_HEADS /* KV heads a kernel parameter block holds (checked at model load) */
#define DECODE_SPLITS 64 /* split-K partitions of the decode attention */
#define MLP_ROWS 8192    /* rows per MLP block: gate|up activations stay O(block x ffn) */

/* ---- errors (context.cu) ---- */
kvc_status fail(kvc_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A CUDA error as a status: out of memory -> KVC_ERR_NOMEM, anything else KVC_ERR_DEVICE. */
kvc_status cuda_fail(cudaError_t e, const char *what);
/* The last launch error, if any, as a status. */
kvc_status check_launch(const char *what);
/* KVC_OK unless an error killed the context (an illegal address, a kernel fault: cuda_fail saw it); then
 * KVC_ERR_DEVICE "the CUDA context is lost after <error>: restart the process", on every call. */
kvc_status context_alive(void);

#define KVC_TRY(expr)                            \
    do {                                         \
        kvc_status kvc_st__ = (expr);            \
        if (kvc_st__ != KVC_OK) return kvc_st__; \
    } while (0)
#define CU_TRY(call, what)                                          \
    do {                                                            \
        cudaError_t e__ = (call);                                   \
        if (e__ != cudaSuccess) return kvc::cuda_fail(e__, what);   \
    } while (0)
#define LAUNCH_TRY(what)                                            \
    do {                                                            \
        kvc_status s__ = kvc::check_launch(what);                   \
        if (s__ != KVC_OK) return s__;                              \
    } while (0)

/* ---- context ---- */
struct Context {
    int ready;
    int device;
    int sm_count;
    size_t total_mem;
    char name[256];
    cudaStream_t stream;
};
extern Context g;
/* Initialise once (thread-safe); KVC_OK or the reason it cannot run. */
kvc_status ensure_init(void);
kvc_status init_with_host(const kvc_host_services *host);

/* ---- tracked device memory: every byte this library allocates, by category ---- */
enum { MEM_WEIGHTS = 0, MEM_CACHE = 1, MEM_ACT = 2 };
kvc_status dalloc(void **p, size_t bytes, int cat, const char *what);
void dfree(void *p, size_t bytes, int cat);
void memory_stats(int64_t *out); /* [KVC_STAT_N] */
void reset_peak(void);

/* A device buffer that grows on demand (activations, scratch). */
struct Buf {
    void *p = nullptr;
    size_t bytes = 0;
    int cat = MEM_ACT;
    kvc_status need(size_t b, const char *what) {
        if (b <= bytes) return KVC_OK;
        dfree(p, bytes, cat);
        p = nullptr;
        bytes = 0;
        size_t nb = b + b / 4;
        kvc_status st = dalloc(&p, nb, cat, what);
        if (st != KVC_OK) return st;
        bytes = nb;
        return KVC_OK;
    }
    void release() {
        dfree(p, bytes, cat);
        p = nullptr;
        bytes = 0;
    }
    template <class T> T *as() const { return (T *)p; }
};

/* ---- host-device traffic (context.cu): each copy and wait counted where it is made (traffic_stats) ---- */
void traffic_add(int64_t downs, int64_t ups, int64_t syncs, int64_t down_bytes, int64_t up_bytes);
void traffic_stats(int64_t *out, int reset);
/* cudaMemcpyAsync between host and device memory on the stream, counted */
cudaError_t h2d(void *dst, const void *src, size_t bytes);
cudaError_t d2h(void *dst, const void *src, size_t bytes);
/* cudaStreamSynchronize(g.stream), counted */
cudaError_t stream_wait(void);

/* Page-locked host memory grown on demand (the batched K/V reads and writes: one DMA at full bandwidth,
 * no staging copy by the driver). */
struct Pinned {
    void *p = nullptr;
    size_t bytes = 0;
    kvc_status need(size_t b, const char *what);
    template <class T> T *as() const { return (T *)p; }
};

/* ---- the table's objects (buffer.cu, kv.cu) ---- */
} // namespace kvc

struct kvc_buf {
    void *p;
    int64_t n;
    int32_t dtype;
    int32_t cat;
    size_t bytes;
};

/* The device table of a typed store (kv_typed.cu: f32, f16, q8_0, KIVI; core/kv_type.h has the formats), at a
 * fixed address for the store's life (graphs read it; the arena and the staging rows move under it). nq and
 * KIVI's undo state last: the device moves them (kv_append, kv_commit), so the host uploads the fields before
 * them without touching them. */
struct KvTab {
    uint8_t *k[KVC_MAX_KV];  /* KIVI: key blocks of `group` rows; else full key rows from np on, row r at (r - np) */
    uint8_t *v[KVC_MAX_KV];  /* value rows */
    uint8_t *kp[KVC_MAX_KV]; /* rows stored alone: the ThinK-pruned rows [np] of dk channels */
    float *st[KVC_MAX_KV];   /* staging rows (f32): row r >= nq at (r - nq) 2d, its K then its V */
    float *uk[KVC_MAX_KV];   /* KIVI's undo rows (f32, core/kv_undo.h): row r of [u0, u0 + un) at (r - u0) 2d */
    int64_t ucap;            /* undo rows a head has room for */
    int32_t *inv;            /* [Hkv d] (fixed): channel -> its slot among the dk kept, or -1 */
    uint64_t kprow;          /* bytes of a pruned row */
    int32_t np[KVC_MAX_KV];  /* pruned rows (KIVI: rows whose dropped channels read as zeros) */
    int32_t dk;
    int32_t nq[KVC_MAX_KV];  /* rows in the type; rows [nq, len) wait in the staging rows */
    int32_t mark[KVC_MAX_KV], u0[KVC_MAX_KV], un[KVC_MAX_KV]; /* KIVI's undo state (core/kv_undo.h) */
};

/* One layer's K/V: one arena, per head K [cap, d] then V [cap, d]; the device tables the kernels read
 * (head pointers, lengths) stay at fixed addresses for the object's life, so a captured graph stays valid
 * when the arena is replaced. A store of another type than bf16 is a typed store (typed; kv_typed.cu): its
 * arena holds the type's rows as core/kv_type.h lays them out, its device table is tabd. */
struct kvc_kv {
    int32_t Hkv, d;
    void *arena;
    size_t bytes;
    bf16 *kh[KVC_MAX_KV], *vh[KVC_MAX_KV]; /* head slices (device pointers, host copy) */
    int64_t cap[KVC_MAX_KV];               /* rows of room per head (the core keeps the lengths) */
    void *tables;  /* one allocation: kd [Hkv], vd [Hkv], kxd [Hkv], lend [Hkv], pastd [Hkv], xrowsd [Hkv] */
    size_t tables_bytes;
    bf16 **kd, **vd;
    int32_t *lend;  /* device lengths: the kernels read them; kv_append moves them on the device */
    int32_t *pastd; /* lend - n of a prefill call (scratch) */
    int32_t *xrowsd; /* rows of each head the expansion scratch holds expanded, when it holds this store's (kv_pruned.cu) */
    /* ThinK-pruned rows (core/backend.h; kv_pruned.cu): rows r < np[h] keep dk key channels in kph[h]
     * [np, dk]; kh[h] then holds rows from np[h] on, and the device table kd[h] = kh[h] - np[h] d, so the
     * append kernel still writes row len at kd[h] + len d. dk 0: none. */
    int64_t np[KVC_MAX_KV];
    bf16 *kph[KVC_MAX_KV];
    int32_t dk;
    int32_t *kidx; /* host [Hkv dk] kept channels */
    int32_t *invd; /* device [Hkv d] (in the arena): channel -> its slot among the kept, or -1 */
    bf16 **kxd;    /* device table [Hkv] (in tables): each head's keys expanded to d channels (kv_keys_full) */
    bf16 *kxh[KVC_MAX_KV]; /* its host copy: uploaded when it changes, never during a capture */
    kvc_kv *pruned_next;   /* the list of pruned stores (kv_pruned.cu): their tables follow the scratch */
    int pruned_listed;
    /* typed stores (kv_typed.cu) */
    int typed;
    kvc_kv_format fmt;
    KvTab *tabd;        /* the device table (and the channel map after it) */
    KvTab tabh;         /* its host copy (nq there is stale: the device commits) */
    size_t tab_bytes;
    float *stage;       /* staging rows: head h at stage + h scap 2d */
    int64_t scap;       /* staging rows per head */
    size_t sbytes;
    int64_t wait_max;   /* bound on the rows waiting in any head (the staging room appends need) */
    float *undo;        /* KIVI's undo rows: head h at undo + h ucap 2d (tabh.ucap) */
    size_t ubytes;
    size_t krow, vrow, kblock; /* bytes of a full key row, a value row, a KIVI key block */
};

namespace kvc {

/* buffer.cu */
kvc_status buf_alloc(int32_t dtype, int64_t n, int32_t cat, const char *what, kvc_buf **out);
void buf_free(kvc_buf *b);
kvc_status buf_upload(kvc_view dst, int64_t rows, int64_t cols, const void *src, int32_t src_dtype);
kvc_status buf_download(kvc_view src, int64_t rows, int64_t cols, void *dst, int32_t dst_dtype);
/* the view's first element as a typed device pointer */
template <class T> T *at(kvc_view v) { return (T *)((char *)v.buf->p + (size_t)v.off * kvc_dtype_size(v.buf->dtype)); }
/* A backend-wide scratch buffer grown on demand (calls are serialised by the core's device lock). */
kvc_status scratch(Buf &b, size_t bytes, const char *what);

/* kv.cu */
kvc_status kv_new(int32_t Hkv, int32_t d, const kvc_kv_format *fmt, kvc_kv **out);
kvc_status kv_commit(kvc_kv *kv);
void kv_free(kvc_kv *kv);
size_t kv_bytes(const kvc_kv *kv);
kvc_status kv_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx);
/* the head pointers (full rows shifted by np[h] d) and lengths to the device tables */
kvc_status kv_upload_tables(kvc_kv *kv, bf16 *const *kh, bf16 *const *vh, const int64_t *np, const int64_t *len);
#define KV_ALIGN 256 /* bytes a K/V arena slice is rounded to (core/kv_layout.h) */
/* the device lengths, on the host (the core's: they follow kv_set_lens and the appends) */
kvc_status kv_host_lens(const kvc_kv *kv, int64_t *len);
/* core/kv_layout.h's row rule as a status */
kvc_status kv_rows_check(kvc_kv_op op, const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const int64_t *keep,
                         int64_t held, int64_t cap);
/* kv_pruned.cu: a store leaves the list of pruned stores whose expanded-key tables follow the scratch */
void kv_pruned_forget(kvc_kv *kv);
/* kv_pruned.cu: the store's rows changed other than by appends (lengths set, rows written): its next expansion
 * starts from row 0 */
kvc_status kv_pruned_stale(kvc_kv *kv);
/* kv_pruned.cu: the layout changes of a store with pruned rows, through the host (rows as f32): a new arena
 * of cap[h] rows per head holding rows keep[h][0 .. n[h]) of from (keep NULL: rows [0, n[h])), the first
 * np_new[h] of them pruned to the dk channels kidx (dk 0: none) */
kvc_status kv_restage(kvc_kv *kv, const kvc_kv *from, const int64_t *cap, const int64_t *const *keep, const int64_t *n,
                      const int64_t *np_new, int32_t dk, const int32_t *kidx);
kvc_status kv_read_pruned(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v);
kvc_status kv_write_pruned(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v);
/* The keys of every head of a pruned store expanded to d channels (zeros in the dropped ones) in scratch,
 * rows < the device lengths (graph-safe for a fixed layout): host pointers to each head (heads) and the
 * device table of them (table). */
kvc_status kv_keys_full(const kvc_kv *kv, const bf16 **heads, bf16 ***table);
/* bumped whenever a pruned layout or its expansion scratch moves: graphs captured before replay stale
 * kernel parameters, so they are captured again */
extern uint64_t kv_layout_generation;
kvc_status kv_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src);
kvc_status kv_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap);
kvc_status kv_set_lens(kvc_kv *kv, const int64_t *len);
kvc_status kv_write(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v);
kvc_status kv_read(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v);
kvc_status kv_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v);
kvc_status kv_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v);
kvc_status kv_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n);
/* rows lent in place (core/backend.h) */
int32_t kv_rows(const kvc_kv *kv, int32_t h, const void **k, const void **v);
kvc_status kv_keep_rows(kvc_kv *kv, void **kept);
void kv_kept_free(void *kept);

/* kv_typed.cu: the typed store behind the entries of kv.cu (which check the row rules first) */
int kvt_is_typed(const kvc_kv_format *fmt);
kvc_status kvt_init(kvc_kv *kv, const kvc_kv_format *fmt);
void kvt_free(kvc_kv *kv);
size_t kvt_bytes(const kvc_kv *kv);
kvc_status kvt_commit(kvc_kv *kv);
kvc_status kvt_append(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n);
kvc_status kvt_resize(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src);
kvc_status kvt_gather(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap);
kvc_status kvt_set_lens(kvc_kv *kv, const int64_t *len);
kvc_status kvt_prune_keys(kvc_kv *kv, int32_t dk, const int32_t *kidx);
kvc_status kvt_write_rows(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v, int commit);
kvc_status kvt_read_heads(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v);
/* every row < the device lengths of every head as bf16 [len, d] in scratch (the scorers' rows; pruned channels
 * zero): host pointers to each head's keys and values */
kvc_status kvt_rows_bf16(const kvc_kv *kv, const bf16 **k, const bf16 **v);

/* ---- gemm.cu ---- */
/* C[m,n] (= or +=, beta 0 or 1) A[m,k] B[n,k]^T: A and B bf16 row-major with leading dimensions
 * lda, ldb; C fp32 (c_f32) or bf16 with ldc. fp32 accumulation. */
kvc_status gemm(const bf16 *A, int64_t lda, const bf16 *B, int64_t ldb, void *C, int64_t ldc, int c_f32, int64_t m,
                int64_t n, int64_t k, float beta);
kvc_status gemm_init(void);
const char *gemm_name(void);
/* force the built-in WMMA GEMM (tests) */
void gemm_force_builtin(int on);
int gemm_builtin_forced(void);

/* ---- activation.cu: conversions, embedding, SwiGLU, bias ---- */
kvc_status f32_to_bf16(const float *src, bf16 *dst, int64_t n);
kvc_status bf16_to_f32(const bf16 *src, float *dst, int64_t n);
kvc_status embed(const bf16 *table, const int32_t *ids, int64_t n, int64_t D, float *x);
/* gu [rows, 2F] (gate | up): gu[r, :F] = silu(gate) * up, in place */
kvc_status swiglu(bf16 *gu, int64_t rows, int64_t F);
kvc_status geglu(bf16 *gu, int64_t rows, int64_t F);
/* moe.cu: the mixture-of-experts kernels (core/backend.h's moe_route, gather_rows, moe_combine) */
kvc_status moe_route(const float *logits, int64_t ldl, int64_t n, int32_t E, int32_t k, int32_t norm, int32_t *ids, int64_t ldi,
                     float *w, int64_t ldw);
kvc_status gather_rows(const bf16 *src, int64_t lds, const int32_t *idx, int64_t n, int64_t D, bf16 *dst, int64_t ldd);
kvc_status moe_combine(float *x, int64_t ldx, const bf16 *y, int64_t ldy, const float *w, int64_t ldw, const int32_t *pos,
                       int64_t ldp, int64_t n, int32_t k, int64_t D);
kvc_status scale_rows(float *x, int64_t ld, int64_t rows, int64_t cols, float alpha);
/* y[r, :] += b over rows (bf16 y with row stride ld, fp32 b) */
kvc_status add_bias(bf16 *y, int64_t ld, const float *b, int64_t rows, int64_t dim);

/* ---- norm.cu ---- */
/* if o: x[r] += o[r] (o bf16, row stride ldo); then y[r] = x[r] / rms(x[r]) * w  (bf16 y) */
kvc_status rmsnorm(float *x, const bf16 *o, int64_t ldo, const float *w, bf16 *y, int64_t rows, int64_t D, float eps);
kvc_status head_rmsnorm(bf16 *x, int64_t ld, int64_t col0, int64_t n, int32_t heads, int32_t d, const float *w, float eps);

/* ---- rope.cu ---- */
/* in place on `heads` heads of d values starting at column col0 of each row of x (row stride ld) */
kvc_status rope(bf16 *x, int64_t ld, int64_t col0, int64_t n, int32_t heads, int32_t d, const int64_t *pos,
                const float *inv_freq, int32_t pairing, float mscale);
/* Per-head pointer table of a layer's cache, passed by value to kernels. */
struct HeadPtrs {
    bf16 *k[KVC_MAX_KV];
    bf16 *v[KVC_MAX_KV];
};
/* cache rows base[h] + i of head h receive K/V of token i: src rows (stride ld) hold K at column
 * kcol + h*d and V at vcol + h*d. base: device int32 [Hkv]. */
kvc_status append_kv(const bf16 *src, int64_t ld, int64_t kcol, int64_t vcol, int64_t n, int32_t Hkv, int32_t d,
                     bf16 *const *kp, bf16 *const *vp, const int32_t *base);
kvc_status add_lens(int32_t *len, int32_t count, int32_t add);

/* ---- the attention kernels read a layer's rows through a row source (kv_rows.cuh): Bf16Rows, the native store's
 * bf16 rows; TypedRows, a typed store's rows in its type and its staging rows ---- */
struct Bf16Rows;
struct TypedRows;

/* ---- attention_prefill.cu ---- */
/* Causal GQA attention of n queries (q rows, stride ldq, head hq at column hq*d) over the rows of each
 * KV head (src); query i of KV head h sees rows < past[h] + i + 1
 * (past: device int32 [Hkv]) and, with a sliding window (start: device i64 [n, Hkv], nondecreasing
 * in i; NULL without one), only the rows >= start[i * Hkv + h]. out rows stride ldo. Flash-style
 * (never n x n), WMMA tensor cores. */
template <class Src>
kvc_status attention_prefill(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const Src &src,
                             const int32_t *past, const int64_t *start, float scale, float cap, bf16 *out, int64_t ldo);

/* ---- attention_prefill_mma.cu: the register-tile kernel (opt-in: KVC_ATTN_MMA=1 or attention_use_mma; a
 * preference attention_prefill honours for head_dim 64 and 128, the other kernels doing the rest) ---- */
template <class Src>
kvc_status attention_prefill_mma(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const Src &src,
                                 const int32_t *past, const int64_t *start, float scale, float cap, bf16 *out, int64_t ldo);
void attention_use_mma(int on);
int attention_mma_enabled(void);

/* ---- attention_cudnn.cu: cuDNN's fused attention (attention_kernel 2; opened at run time) ---- */
/* on: load cuDNN (KVC_ERR_UNSUPPORTED with the reason where it cannot) and prefer it for prefills */
kvc_status attention_use_cudnn(int on);
int attention_cudnn_enabled(void);
/* The causal prefill of n queries over Hkv heads at one stride (head h's keys at k0 + h head_stride, values at
 * v0 + h head_stride, seq_kv[h] rows held, this call's n the last), per-entry lengths on the device. KVC_ERR_UNSUPPORTED
 * (no message): not enabled, or no cuDNN plan for the shape, and the own kernels run it. */
kvc_status attention_cudnn(const bf16 *q, int64_t ldq, int64_t n, int32_t H, int32_t Hkv, int32_t d, const bf16 *k0,
                           const bf16 *v0, int64_t head_stride, const int32_t *seq_kv, int64_t max_kv, float scale, bf16 *out,
                           int64_t ldo);

/* ---- attention_decode.cu ---- */
/* One query per head (q [H*d]) over len[h] rows of each KV head (len: device int32 [Hkv]), from row
 * start[h] on with a sliding window (device i64 [Hkv]; NULL: from row 0), split-K over the rows;
 * partial: scratch of decode_partial_floats() floats. */
size_t decode_partial_floats(int32_t H, int32_t d, int32_t splits);
template <class Src>
kvc_status attention_decode(const bf16 *q, int32_t H, int32_t Hkv, int32_t d, const Src &src, const int32_t *len,
                            const int64_t *start, float scale, float cap, bf16 *out, float *partial, int32_t splits);

/* ---- score.cu, press.cu ---- */
struct HeadInfo {
    const bf16 *k[KVC_MAX_KV];
    const bf16 *v[KVC_MAX_KV];
    int64_t len[KVC_MAX_KV];    /* rows held */
    int64_t n_acc[KVC_MAX_KV];  /* rows scored (before the protected tail) */
    int64_t vstart[KVC_MAX_KV]; /* query j sees rows < min(vlimit, vstart + j + 1) */
    int64_t vlimit[KVC_MAX_KV];
};
/* att[hq][r] (row stride lda) = mean over the m queries (q rows: q + j*ldq, fp32 or bf16) of their
 * softmax attention on row r, r < n_acc[h]. stats: scratch (window_stats_floats). */
size_t window_stats_floats(int32_t H, int64_t m, int64_t maxlen);
kvc_status window_attention(const void *q, int q_f32, int64_t ldq, int64_t m, int32_t H, int32_t Hkv, int32_t d,
                            const HeadInfo &hi, float scale, float *att, int64_t lda, float *stats);
/* EDIE (docs/METHODS.md): att[hq][r] = (group size) x sum over the w window queries (q, and their attention
 * outputs o, rows of stride ldq / ldo) of c_j a / (1 + alpha - a) (|v_r|_1 + |o_j|_1), r < n_acc[h];
 * mean pooling with the GQA mean of pool_reduce then gives EDIE's group sum. */
kvc_status edie_attention(const bf16 *q, int64_t ldq, const bf16 *o, int64_t ldo, int64_t w, int32_t H, int32_t Hkv,
                          int32_t d, const HeadInfo &hi, float scale, float alpha, float *att, int64_t lda, float *stats);
/* scores[h][r] (row stride lds), r < n_acc[h]: pooling and GQA reduction of att (SnapKV family);
 * all_heads: mean over every query head, the same for each KV head (TOVA). */
kvc_status pool_reduce(const float *att, int64_t lda, int32_t H, int32_t Hkv, const HeadInfo &hi, int32_t kernel,
                       int32_t pool_max, int32_t gqa_max, int32_t pool_then_reduce, int32_t all_heads, float *scores,
                       int64_t lds);
/* rows [n_acc[h], len[h]) get (max over every head's scored rows) + 1 */
kvc_status protect_tail(float *scores, int64_t lds, int32_t Hkv, const HeadInfo &hi);
kvc_status score_knorm(const HeadInfo &hi, int32_t Hkv, int32_t d, float *scores, int64_t lds);
kvc_status score_streaming(const HeadInfo &hi, int32_t Hkv, int32_t n_sink, float *scores, int64_t lds);
kvc_status score_random(const HeadInfo &hi, int32_t Hkv, uint64_t seed, int32_t layer, float *scores, int64_t lds);
/* 1 - cos(R, R + O) summed over rows (R fp32 [rows, D], O bf16 rows of stride ldo) into *out (device double) */
kvc_status dissim_sum(const float *R, const bf16 *O, int64_t ldo, int64_t rows, int64_t D, double *out);

/* ---- topk.cu ---- */
/* keep (device int32, n_keep <= n entries, sorted) = top k rows of scores[0..n) (device); returns the
 * count through *n_keep. tmp: scratch grown as needed. */
kvc_status topk_rows(const float *scores, int64_t n, int64_t k, int32_t *keep, Buf &tmp);

/* ---- compact.cu ---- */
/* new head h row i = old head h row rows[off[h] + i], i < cnt[h] (rows, off, cnt on the device side
 * as one int32 array: rows at `rows`, offsets in host struct) */
struct GatherInfo {
    const bf16 *ok[KVC_MAX_KV], *ov[KVC_MAX_KV];
    bf16 *nk[KVC_MAX_KV], *nv[KVC_MAX_KV];
    int64_t off[KVC_MAX_KV + 1]; /* prefix sums of the kept counts */
};
kvc_status gather_rows(const GatherInfo &gi, int32_t Hkv, int32_t d, const int32_t *rows);

/* press.cu: the table's scoring entries */
kvc_status score(const kvc_score_args *a);
kvc_status topk(kvc_view scores, int32_t heads, const int64_t *len, const int64_t *k, int64_t *const *keep);
kvc_status cos_sum(kvc_view resid, kvc_view o, int64_t rows, int64_t D, double *out);

} // namespace kvc

#endif
