/* The backend interface: the one engine (engine/, cache/, press/) drives every device through this
 * table, as ggml's graph engine drives its backends (docs/ARCHITECTURE.md, "Backends").
 *
 * A backend owns buffers (opaque to the engine: reached through upload, download and the kernels,
 * never dereferenced), one K/V store per cached layer (kvc_kv: ragged heads, lengths resident where
 * the kernels read them), and the kernels the decoder layer and the presses need. Three implement it:
 *   cpu       backend/cpu: fp32 everywhere, the readable reference;
 *   emulated  backend/emulated: the device contract on the CPU (separate allocations, bf16 storage
 *             rounded where the CUDA backend rounds, the CPU kernels underneath), so CI runs the
 *             device path's host code;
 *   cuda      backend/cuda: a separate library opened at run time (core/cuda_loader.c).
 * Every entry returns a status and records a message (kvc_fail) on failure; none aborts.
 * KVC_BACKEND_VERSION changes whenever an entry or a struct here changes: the CUDA library is built
 * separately and the loader refuses a table of another version.
 *
 * Plain C: included by C (core) and C++ (nvcc) translation units. */
#ifndef KVC_BACKEND_H
#define KVC_BACKEND_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "../include/kvpress_c.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_BACKEND_VERSION 11 /* 11: hint_weights; 10: moe_route, gather_rows, moe_combine (mixture of experts); 9: kv_rows, kv_keep_rows, kv_kept_free, host_memory (rows lent in place); 8: kv_new takes the storage type (kvc_kv_format), kv_commit (quantised caches); 7: attention takes softcap (Gemma 2); 6: traffic_stats, kv_read_heads, kv_write_rows (batched host-device traffic); 5: geglu,
                                 scale (Gemma 3); 4: rope takes mscale (LongRoPE); 3: kv_bytes replaces kv_arena_bytes;
                                 kv_prune_keys (ThinK); wrap, wrap_keeps_layout (host memory) */

/* KV heads the kernels' parameter blocks hold; every model is checked against it once, at load. */
#define KVC_MAX_KV_HEADS 64
#define KVC_MAX_SCORERS 256 /* rows of the scorer table (press/scorer.c) */

typedef enum kvc_dtype { KVC_F32 = 0, KVC_BF16 = 1, KVC_I32 = 2, KVC_I64 = 3 } kvc_dtype;

static inline size_t kvc_dtype_size(int32_t t) { return t == KVC_BF16 ? 2 : t == KVC_I64 ? 8 : 4; }

/* Weights kept in a model file's own format (native weights, issue 18): dtype KVC_WTYPE(ggml type id),
 * e.g. KVC_WTYPE(3) for Q4_1 blocks. Such a buffer counts values, not bytes; the offset and row length
 * of a view of it are multiples of the type's block (model/dequant.h has the one block table). Only
 * weights use them, only on a backend whose weight_type_ok says so; upload takes the file's bytes
 * (src_dtype = the buffer's dtype), download gives f32. */
#define KVC_WTYPE_BASE 16
#define KVC_WTYPE(ggml_type) (KVC_WTYPE_BASE + (ggml_type))
static inline int kvc_dtype_is_wtype(int32_t t) { return t >= KVC_WTYPE_BASE; }

/* What an allocation holds, for the memory report (memory_stats). */
enum { KVC_MEM_WEIGHTS = 0, KVC_MEM_CACHE = 1, KVC_MEM_ACT = 2 };

/* Counters of memory_stats, bytes (peaks since reset_peak). */
enum {
    KVC_STAT_CURRENT = 0,
    KVC_STAT_PEAK = 1,
    KVC_STAT_WEIGHTS = 2,
    KVC_STAT_CACHE = 3,
    KVC_STAT_CACHE_PEAK = 4,
    KVC_STAT_ACT = 5,
    KVC_STAT_ACT_PEAK = 6,
    KVC_STAT_DEVICE_TOTAL = 7,
    KVC_STAT_N = 8
};

/* Counters of traffic_stats: host-device traffic since the last reset (tests assert the counts per layer of
 * the host algorithms; benchmarks report them). A transfer is one copy between host and device memory, a
 * sync one wait of the host for the device's stream. */
enum {
    KVC_XFER_DOWNLOADS = 0,
    KVC_XFER_UPLOADS = 1,
    KVC_XFER_SYNCS = 2,
    KVC_XFER_DOWN_BYTES = 3,
    KVC_XFER_UP_BYTES = 4,
    KVC_XFER_N = 5
};

typedef struct kvc_buf kvc_buf;     /* one allocation of elements of one dtype */
typedef struct kvc_kv kvc_kv;       /* one layer's K/V: Hkv heads, each [cap, d] rows, its own length */
/* Key-channel pruning (ThinK, kv_prune_keys): a layer's store may hold a prefix of np[h] rows per head
 * whose keys keep only dk of the d channels (the same dk for every head, channel indices per head): those
 * rows take dk values of K instead of d, and attention gathers the query to the kept channels for them
 * (exact: the dropped channels are zeros). Rows appended later are full. Every K/V entry keeps the prefix:
 * resize and gather carry it (a kept row stays pruned), set_lens below it shrinks it (rebuilding the
 * arena), kv_read gives pruned rows with zeros in the dropped channels, kv_write to them keeps the kept
 * channels only, and the scorers see them as kv_read does. The layout and the row rules (read, gather
 * and resize within the rows held, write within the capacity) are core/kv_layout.h's, for every backend. */
typedef struct kvc_graph kvc_graph; /* captured work, replayed (graph_*) */

/* A matrix inside a buffer: row r starts at element off + r * ld. Sizes travel with the calls. */
typedef struct kvc_view {
    kvc_buf *buf;
    int64_t off;
    int64_t ld;
} kvc_view;

static inline kvc_view kvc_view_of(kvc_buf *b, int64_t off, int64_t ld) {
    kvc_view v;
    v.buf = b;
    v.off = off;
    v.ld = ld;
    return v;
}
/* rows [r0, ...) and columns [c0, ...) of v */
static inline kvc_view kvc_view_at(kvc_view v, int64_t r0, int64_t c0) {
    v.off += r0 * v.ld + c0;
    return v;
}

/* Scorers a backend computes (press/score.c calls them; docs/METHODS.md, "Baseline scorers"). Besides the
 * public kvc_scorer codes: TAKE's probes, which see every row given and nothing causal. */
/* The built-in scorers' indices (a config's `scorer`; csrc/press/scorers/ has a row for each). A backend computes
 * those without a host function (the first seven); the rest run on the host. A scorer new to the project needs no
 * code here: its row says code -1 and the table gives it the next index (press/scorer.c). */
typedef enum kvc_scorer {
    KVC_SCORE_STREAMING = 0, /* first n_sink + most recent */
    KVC_SCORE_KNORM = 1,     /* -||k|| */
    KVC_SCORE_RANDOM = 2,    /* seeded uniform */
    KVC_SCORE_TOVA = 3,      /* last query's attention, mean over all heads */
    KVC_SCORE_OBSERVED = 4,  /* H2O one-shot: attention summed over prompt queries / queries that see it */
    KVC_SCORE_SNAPKV = 5,    /* window queries' attention, pooled, GQA-reduced */
    KVC_SCORE_EDIE = 6,      /* error-driven upper bound with mid-range weighting (EDIE) */
    /* ---- kvpress's scorers (docs/METHODS.md "kvpress scorers"); computed on the host ---- */
    KVC_SCORE_KEYDIFF = 7,   /* KeyDiff: -cos(k, mean of the normalised keys) */
    KVC_SCORE_LAGKV = 8,     /* LagKV: min-max normalised K/V std against the next partition, ranked */
    KVC_SCORE_EXPECTED = 9,  /* ExpectedAttention: softmax of E[q] k + k^T Cov[q] k / 2, over future positions */
    KVC_SCORE_NONCAUSAL = 10, /* NonCausalAttn: chunked non-causal attention x ||v||, pooled, z-normalised */
    KVC_SCORE_LEVERAGE = 11,  /* LeverageScore: approximate leverage of the pre-RoPE keys (Gaussian sketch), z-scored */
    KVC_SCORE_CUR = 12,       /* CUR (CurDKV): ||k||^2, ||v||^2 (optionally sketched), windowed, combined, normalised */
    KVC_SCORE_COMPACTOR = 13, /* Compactor: blend x LeverageScore + NonCausalAttn between sinks kept at the maximum */
    KVC_SCORE_FINCH = 14,     /* FINCH: window queries' attention (each times the keys it sees - 1), unpooled */
    KVC_SCORE_SIMLAYERKV = 15, /* SimLayerKV: a lazy layer (the last queries' attention on sinks + recent rows above a
                                  threshold) keeps n_sink + n_recent - window rows, another every row */
    KVC_SCORE_CAP = 16        /* CAPKV: w v^T (I + sum (w + eps) v v^T)^-1 v, w = exp(tau cos(k, R mean q)) */
} kvc_scorer;
#define KVC_SCORE_PROBE 100

/* One layer's scoring: scores[h][r] for r < len[h] (protected rows at max + 1, as on the CPU). */
typedef struct kvc_score_args {
    int32_t scorer;        /* kvc_scorer or KVC_SCORE_PROBE */
    int32_t layer;         /* RandomPress's seed stream */
    int32_t H, Hkv, d;
    kvc_kv *kv;            /* the layer's rows */
    const int64_t *len;    /* [Hkv] rows to score per head (for probes: the rows they see) */
    kvc_view q;            /* [n, H*d] this call's queries; the last `window` are the scoring window. PROBE: [n, H*d] f32 */
    int64_t n;
    kvc_view attn;         /* [n, H*d] their attention outputs (EDIE; buf NULL otherwise) */
    int32_t window;        /* w (SnapKV, EDIE); TOVA uses 1; 0 for the others */
    int32_t kernel, pool_max, gqa_max, pool_then_reduce; /* pooling and GQA reduction (SnapKV family, probes) */
    int32_t n_sink;        /* StreamingLLM */
    uint64_t seed;         /* RandomPress */
    float edie_alpha;
    kvc_view scores;       /* f32 [Hkv, ld] out */
} kvc_score_args;

/* Attention flags. */
#define KVC_ATTN_FORCE_PREFILL 1 /* one query through the prefill kernel (tests) */

/* Logit soft-capping (Gemma 2's attention scores and final logits): cap tanh(s / cap); cap 0: s. The one
 * formula every backend's attention applies to its scaled scores before the softmax. */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline float kvc_softcap(float s, float cap) { return cap > 0 ? cap * tanhf(s / cap) : s; }

typedef struct kvc_backend {
    int32_t version;   /* KVC_BACKEND_VERSION */
    const char *name;  /* "cpu", "emulated", "cuda" */
    int32_t device;    /* kvc_device */
    int32_t act_dtype; /* activations and K/V: KVC_F32 or KVC_BF16 (the residual stream and logits are f32) */
    int32_t weight_dtype; /* matrices (norm weights, biases and RoPE frequencies are f32) */
    /* 1 if matmul and embed take weights of ggml type `ggml_type` as stored in the file (dtype
     * KVC_WTYPE(ggml_type)); NULL or 0: the loader converts them to weight_dtype */
    int (*weight_type_ok)(int32_t ggml_type);
    int64_t mlp_rows;  /* rows per MLP block: gate|up scratch stays O(block x ffn) */
    int32_t serialize; /* calls from several threads take turns (one stream, shared scratch) */
    int32_t host_memory; /* its buffers and stores are in this process's memory (the CPU, the emulated device): rows it
                          * lends in place (kv_rows) are host addresses; 0: the device's (CUDA) */

    /* ---- the device ---- */
    const char *(*device_name)(void);
    const char *(*gemm_name)(void); /* the GEMM in use; a device without its vendor GEMM says so here */
    void (*memory_stats)(int64_t *out); /* [KVC_STAT_N] */
    void (*reset_peak)(void);
    /* Wait for the work enqueued so far; an asynchronous fault comes back here as a status, so the call
     * that caused it fails and rolls back (NULL: every entry completes before it returns). */
    kvc_status (*sync)(void);
    /* Named settings (tests and benchmarks): "builtin_gemm" 0/1, "attention_kernel" 0 (default) / 1 (a
     * preference: head dims its kernel cannot do run the default one).
     * KVC_ERR_ARG for a name or value the backend does not know. */
    kvc_status (*set_option)(const char *name, int value);
    /* KVC_ERR_UNSUPPORTED with the reason for a model shape the kernels do not take (NULL: any) */
    kvc_status (*check_model)(const kvc_config *c);
    /* [KVC_XFER_N] host-device traffic since the last reset; reset: start again from zero after reading
     * (NULL: the backend moves nothing between memories, the CPU) */
    void (*traffic_stats)(int64_t *out, int reset);

    /* ---- buffers: n elements of dtype; contents undefined until written ---- */
    kvc_status (*alloc)(int32_t dtype, int64_t n, int32_t category, const char *what, kvc_buf **out);
    void (*free)(kvc_buf *b);
    /* rows x cols of src (contiguous, src_dtype: KVC_F32 into float buffers of any dtype, converted and
     * rounded as the device stores them; KVC_I32 / KVC_I64 into buffers of that dtype) into view dst */
    kvc_status (*upload)(kvc_view dst, int64_t rows, int64_t cols, const void *src, int32_t src_dtype);
    /* rows x cols of view src into dst (contiguous, KVC_F32 for float buffers, else the buffer's dtype) */
    kvc_status (*download)(kvc_view src, int64_t rows, int64_t cols, void *dst, int32_t dst_dtype);
    /* The buffer's elements when they are f32 in this process's memory (the CPU backend), else NULL:
     * how host algorithms (Judge Q's backward) read a CPU model's weights without a copy. */
    const float *(*host_f32)(const kvc_buf *b);
    /* A read-only buffer over n elements of dtype at host address p (weights used in place in a mapped
     * model file): the caller keeps p alive and unchanged until free, which releases only the buffer;
     * upload into it fails. NULL where the device cannot compute on host memory: the loader copies. */
    kvc_status (*wrap)(int32_t dtype, int64_t n, const void *p, const char *what, kvc_buf **out);
    /* 1 when a weight of dtype wrapped in place keeps the layout the kernels are fastest on; 0 when the
     * backend rearranges that dtype at upload (the CPU's interleaved Q4_0/Q4_1/Q8_0 GEMV layout), so the
     * loader copies it unless asked not to repack; matmul takes such a buffer whole, as one matrix (the
     * loader gives each expert of such a type its own). NULL: every dtype wraps as well as it copies. */
    int (*wrap_keeps_layout)(int32_t dtype);

    /* ---- K/V of one layer (the ragged cache; cache/kv_cache.c keeps lengths, capacities and positions
     * on the host and mirrors the lengths here with kv_set_lens) ---- */
    /* A store of Hkv heads of d values in the storage type fmt (core/kv_type.h has the formats; NULL or
     * KVC_KV_NATIVE: act_dtype's own). KVC_ERR_ARG for a format the heads cannot take, KVC_ERR_UNSUPPORTED
     * for a type the backend does not store, each with the reason. */
    kvc_status (*kv_new)(int32_t Hkv, int32_t d, const kvc_kv_format *fmt, kvc_kv **out);
    /* The rows kv_append added since the last commit go into the store's type (until then they are read
     * as appended: a call's own queries see its rows exact); KIVI: whole key blocks once its residual
     * fills. The engine calls it after each layer's attention (graph-safe on devices with graphs). */
    kvc_status (*kv_commit)(kvc_kv *kv);
    void (*kv_free)(kvc_kv *kv);
    /* Storage bytes of the store now (the memory report; pruned keys count dk values a row; rows waiting in
     * f32 count as f32). */
    size_t (*kv_bytes)(const kvc_kv *kv);
    /* A new arena of cap[h] rows per head holding rows [0, rows[h]) of src (kv itself when NULL), lengths
     * rows[h]; the old arena is freed. */
    kvc_status (*kv_resize)(kvc_kv *kv, const int64_t *cap, const int64_t *rows, const kvc_kv *src);
    /* A new arena of cap[h] rows per head holding rows keep[h][0 .. n_keep[h]) (increasing), lengths
     * n_keep[h] (compaction: the old arena is freed, memory really drops). */
    kvc_status (*kv_gather)(kvc_kv *kv, const int64_t *const *keep, const int64_t *n_keep, const int64_t *cap);
    kvc_status (*kv_set_lens)(kvc_kv *kv, const int64_t *len);
    /* ThinK: every row held (rows [0, len[h]) of each head) keeps only the dk channels kidx[h dk ..]
     * (increasing, 1 <= dk <= d) of its key, in a new arena (the old one is freed: memory really drops).
     * Rows pruned before are re-pruned from their zero-filled form, so the result is exactly the d-channel
     * keys with the other channels zeroed. */
    kvc_status (*kv_prune_keys)(kvc_kv *kv, int32_t dk, const int32_t *kidx);
    /* rows [row0, row0 + rows) of head h from / to host f32 (either of k, v may be NULL) */
    kvc_status (*kv_write)(kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, const float *k, const float *v);
    kvc_status (*kv_read)(const kvc_kv *kv, int32_t h, int64_t row0, int64_t rows, float *k, float *v);
    /* Batched: rows [row0[h], row0[h] + rows[h]) of every head (row0 NULL: from 0) into host f32 k and v
     * (either may be NULL), head after head (rows[h] x d values each): one transfer and one wait for the
     * layer, not one per head (the host scorers' read). */
    kvc_status (*kv_read_heads)(const kvc_kv *kv, const int64_t *row0, const int64_t *rows, float *k, float *v);
    /* Batched: rows idx[h][0 .. n[h]) of every head (any order, no repeats) from host f32 k and v (either may
     * be NULL), head after head (n[h] x d values each): one transfer for the layer (merged values). */
    kvc_status (*kv_write_rows)(kvc_kv *kv, const int64_t *const *idx, const int64_t *n, const float *k, const float *v);
    /* Rows lent in place (table version 7): views handed out without a copy (a Python press's keys and values, DLPack).
     * kv_rows: *k and *v at row 0 of head h's K and V where the store keeps them (rows of d elements, row-major, the
     * rows held first), and their dtype (KVC_F32 or KVC_BF16), in the backend's memory (this process's for the CPU and
     * the emulated device, the GPU's for CUDA); -1 when the store does not keep them plainly (ThinK-pruned rows, another
     * type): the caller copies (kv_read_heads). Valid until the store changes. NULL: never lends.
     * kv_keep_rows: for a holder of those rows that outlives that (an array a press kept past its call): the store
     * moves to a copy of its rows and hands the old memory over as *kept, released by kv_kept_free on any thread
     * (it takes no lock). */
    int32_t (*kv_rows)(const kvc_kv *kv, int32_t h, const void **k, const void **v);
    kvc_status (*kv_keep_rows)(kvc_kv *kv, void **kept);
    void (*kv_kept_free)(void *kept);

    /* ---- the decoder layer's kernels ---- */
    /* x[i, :] = table[ids[i], :] (x f32, ids i32) */
    kvc_status (*embed)(kvc_view table, kvc_view ids, int64_t n, int64_t D, kvc_view x);
    /* with add: x += add first (x f32 is updated); then y = x / rms(x) * w */
    kvc_status (*rmsnorm)(kvc_view x, const kvc_view *add, kvc_view w, kvc_view y, int64_t rows, int64_t D, float eps);
    /* C[m, n] (+)= A[m, k] W[n, k]^T, fp32 accumulation; accumulate: C += (C f32). W may be native
     * (KVC_WTYPE) where weight_type_ok allows; then it is decoded block by block inside the kernel. */
    kvc_status (*matmul)(kvc_view a, kvc_view w, kvc_view c, int64_t m, int64_t n, int64_t k, int32_t accumulate);
    /* y[r, :] += b over rows */
    kvc_status (*add_bias)(kvc_view y, kvc_view b, int64_t rows, int64_t dim);
    /* in place on `heads` heads of d values from column col0 of each of n rows, at positions pos (i64); the
     * pairs with a nonzero frequency are turned and multiplied by mscale (LongRoPE's attention factor; 1:
     * none), those with frequency 0 (the pass-through part of a partial rotary embedding) left as they are */
    kvc_status (*rope)(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view pos, kvc_view inv_freq,
                       int32_t pairing, float mscale);
    /* rows len[h] .. len[h] + n - 1 of every head receive K (columns kcol + h d) and V (vcol + h d) of the
     * n rows of src; then len += n (on the device: graph-safe) */
    kvc_status (*kv_append)(kvc_kv *kv, kvc_view src, int64_t kcol, int64_t vcol, int64_t n);
    /* in place on `heads` heads of d values from column col0 of each of n rows: each head divided by its
     * root mean square (+ eps) and multiplied by w (f32 [d]): Qwen3's q/k norm */
    kvc_status (*head_rmsnorm)(kvc_view x, int64_t col0, int64_t n, int32_t heads, int32_t d, kvc_view w, float eps);
    /* causal GQA attention of this call's n queries (q rows, head hq at column hq d) over kv, whose
     * lengths already include their n rows: query i of head h sees rows < len[h] - n + i + 1, and with
     * a sliding window (start.buf not NULL: i64 [n, Hkv], ld Hkv) only the rows >= start[i, h]; the scores
     * scale q.k soft-capped (kvc_softcap: softcap 0 for none) */
    kvc_status (*attention)(kvc_view q, int64_t n, int32_t H, kvc_kv *kv, float scale, float softcap, kvc_view start,
                            kvc_view out, int32_t flags);
    /* gu[r, :F] = silu(gu[r, :F]) * gu[r, F:2F] */
    kvc_status (*swiglu)(kvc_view gu, int64_t rows, int64_t F);
    /* gu[r, :F] = gelu_tanh(gu[r, :F]) * gu[r, F:2F] (Gemma's GeGLU; gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi)
     * (g + 0.044715 g^3)))) */
    kvc_status (*geglu)(kvc_view gu, int64_t rows, int64_t F);
    /* x[r, :cols] *= alpha over rows (x f32: Gemma's embedding scale) */
    kvc_status (*scale)(kvc_view x, int64_t rows, int64_t cols, float alpha);

    /* ---- mixture of experts (engine/moe.c; table version 7) ---- */
    /* Routing of n tokens over E experts: for each row r of the router's logits (f32 [n, E]), p = softmax(row); ids[r, :k]
     * = the k experts of highest p, highest first (equal p: the lower expert first; NaN lowest), w[r, :k] their p,
     * divided by the sum of those k when norm (ids i32 [n, k], w f32 [n, k]). */
    kvc_status (*moe_route)(kvc_view logits, int64_t n, int32_t E, int32_t k, int32_t norm, kvc_view ids, kvc_view w);
    /* dst[i, :D] = src[idx[i], :D] for i < n (src and dst of the act dtype; idx i32, its n values contiguous): the rows
     * an expert runs on, gathered */
    kvc_status (*gather_rows)(kvc_view src, kvc_view idx, int64_t n, int64_t D, kvc_view dst);
    /* x[r, :D] += sum over j < k, in order, of w[r, j] y[pos[r, j], :D] for r < n (x f32; y of the act dtype: the experts'
     * outputs; w f32 [n, k]; pos i32 [n, k]) */
    kvc_status (*moe_combine)(kvc_view x, kvc_view y, kvc_view w, kvc_view pos, int64_t n, int32_t k, int64_t D);

    /* ---- the presses' kernels ---- */
    /* KVC_ERR_UNSUPPORTED for a scorer the backend lacks (press/score.c decides what runs where) */
    kvc_status (*score)(const kvc_score_args *a);
    /* keep[h][0 .. k[h]) = the top k[h] <= len[h] of score row h (f32 [heads, ld]): higher score first,
     * then lower row (NaN lowest); returned sorted by row */
    kvc_status (*topk)(kvc_view scores, int32_t heads, const int64_t *len, const int64_t *k, int64_t *const *keep);
    /* *out = sum over the rows of cos(R, R + O) (R f32 resid, O the attention block output) */
    kvc_status (*cos_sum)(kvc_view resid, kvc_view o, int64_t rows, int64_t D, double *out);

    /* Device-only timing for benchmarks (NULL: none): seconds per call (best of reps after a warm-up) of the
     * GEMM (what 0, dims {m, n, k}) or of the causal prefill attention (what 1, dims {n, H, Hkv, d}). */
    kvc_status (*bench)(int32_t what, const int64_t *dims, int32_t reps, double *seconds);

    /* ---- hints (NULL where the backend has no use for them; no result depends on one) ----
     * hint_weights: the n weights the engine reads next, after this layer's attention (its o projection and
     * MLP). A backend whose kernels stream weights from memory may fetch some of them while a kernel that
     * leaves memory bandwidth spare runs (the CPU's decode attention on a q8_0 or KIVI cache); the next hint
     * replaces it. */
    void (*hint_weights)(const kvc_view *w, int32_t n);

    /* ---- graphs (NULL where the backend has none: the engine then runs eagerly) ----
     * graph_capture records the work run(user) enqueues (it must read every input that changes between
     * replays from buffers, never from host values) into *g, replacing it; graph_launch replays it, or
     * returns KVC_ERR_UNSUPPORTED when the backend's own scratch moved since (capture again). */
    kvc_status (*graph_capture)(kvc_graph **g, kvc_status (*run)(void *user), void *user);
    kvc_status (*graph_launch)(kvc_graph *g);
    void (*graph_free)(kvc_graph *g);
} kvc_backend;

/* A backend built as a separate library (the CUDA one) exports two symbols: its KVC_BACKEND_VERSION, read
 * before anything else, and an open function that finds the device and returns the table, or a status
 * with the reason. The core lends it kvc_fail, so its messages reach kvc_last_error(). */
typedef struct kvc_host_services {
    kvc_status (*fail)(kvc_status st, const char *fmt, ...);
} kvc_host_services;
typedef int32_t (*kvc_backend_version_fn)(void);
typedef kvc_status (*kvc_backend_open_fn)(const kvc_host_services *host, const kvc_backend **out);
#define KVC_CUDA_VERSION_SYMBOL "kvc_cuda_backend_version"
#define KVC_CUDA_OPEN_SYMBOL "kvc_cuda_backend_open"

/* The registry (core/registry.c): the table of a device, loading it on first use. KVC_ERR_DEVICE with
 * the reason when it is not available ("CUDA backend not available: ..."). */
kvc_status kvc_backend_get(int32_t device, const kvc_backend **out);
/* The CPU backend (always available). */
const kvc_backend *kvc_backend_cpu(void);
/* Serialise a backend for the duration of one public call (no-op unless be->serialize); recursive. */
void kvc_backend_lock(const kvc_backend *be);
void kvc_backend_unlock(const kvc_backend *be);

#ifdef __cplusplus
}
#endif
#endif
